"""What the pika check scripts of tests/clients/ share: the broker address from the command
line, a bounded BlockingConnection, `check`, and `main`, which runs a scenario under a time
limit and prints "PASS name" or "FAIL name: ..." with exit status 0 or 1.
"""
import signal
import sys

import pika

HOST = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1"
PORT = int(sys.argv[2]) if len(sys.argv) > 2 else 5672


class Fail(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Fail(msg)


def connect():
    return pika.BlockingConnection(pika.ConnectionParameters(
        host=HOST, port=PORT, heartbeat=0, connection_attempts=1,
        socket_timeout=5, blocked_connection_timeout=5))


def main(name, scenario, seconds=20):
    """Runs `scenario()`; a broker that stops answering fails it after `seconds`."""
    def alarm(signum, frame):
        raise Fail("did not finish within %d s" % seconds)

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        scenario()
        print("PASS %s" % name)
        rc = 0
    except Fail as e:
        print("FAIL %s: %s" % (name, e))
        rc = 1
    except Exception as e:  # protocol surprises are failures, not crashes
        print("FAIL %s: unexpected %s: %s" % (name, type(e).__name__, e))
        rc = 1
    sys.stdout.flush()
    sys.exit(rc)
