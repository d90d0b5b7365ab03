#!/usr/bin/env python3
"""Issue 2 acceptance check with pika: 10,000 persistent messages with publisher confirms to a
durable queue, consumed with manual ack, every one exactly once and in order.

Usage:
  python3 acceptance.py HOST PORT                 one run: publish 10,000, consume all, check
  python3 acceptance.py HOST PORT publish PREFIX  phase 1 of the restart check: durable queue
        PREFIX.durable gets 10,000 persistent confirmed messages, the first 2,000 are consumed
        and acked; non-durable queue PREFIX.transient gets one message
  python3 acceptance.py HOST PORT check PREFIX    phase 2 (after a broker restart): the durable
        queue still holds messages 2,000..9,999 and yields each once, in order; the
        non-durable queue is gone (404)
Prints "PASS acceptance[-phase]" or "FAIL ...: reason"; exit status 0/1.
Covers issue 2 "Done when" (first bullet) and item 8. Each phase is bounded to 20 s.
"""
import signal
import sys
import uuid

import pika

HOST = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1"
PORT = int(sys.argv[2]) if len(sys.argv) > 2 else 5672
MODE = sys.argv[3] if len(sys.argv) > 3 else "all"
PREFIX = sys.argv[4] if len(sys.argv) > 4 else "pika-acceptance." + uuid.uuid4().hex[:8]
N = 10_000
FIRST = 2_000  # consumed before the restart in the two-phase run
NAME = "acceptance" if MODE == "all" else "acceptance-" + MODE


class Fail(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Fail(msg)


def connect():
    return pika.BlockingConnection(pika.ConnectionParameters(
        host=HOST, port=PORT, heartbeat=0, connection_attempts=1,
        socket_timeout=5, blocked_connection_timeout=5))


def publish_all(queue):
    """Publish N persistent messages to `queue` with publisher confirms, pipelined (a window of
    1,000 unconfirmed), on pika's asynchronous SelectConnection; returns when every one is
    acked. A nack, a return or a close is a failure."""
    params = pika.ConnectionParameters(host=HOST, port=PORT, heartbeat=0, connection_attempts=1,
                                       socket_timeout=5)
    props = pika.BasicProperties(delivery_mode=2, content_type="application/octet-stream")
    st = {"sent": 0, "acked": 0, "errors": [], "ch": None}
    WINDOW = 1000

    def pump():
        ch = st["ch"]
        while st["sent"] < N and st["sent"] - st["acked"] < WINDOW:
            ch.basic_publish(exchange="", routing_key=queue, body=b"%08d" % st["sent"],
                             properties=props, mandatory=True)
            st["sent"] += 1

    def on_confirm(frame):
        m = frame.method
        if isinstance(m, pika.spec.Basic.Nack):
            st["errors"].append("basic.nack for tag %d" % m.delivery_tag)
        # tags count up from 1 and every publish is acked, so the tag is the running count
        if m.multiple or m.delivery_tag == st["acked"] + 1:
            st["acked"] = max(st["acked"], m.delivery_tag)
        else:
            st["errors"].append("confirm tag %d out of order after %d" % (m.delivery_tag, st["acked"]))
        if st["errors"] or st["acked"] >= N:
            conn.close()
        else:
            pump()

    def on_return(ch, method, props, body):
        st["errors"].append("message %r returned: %d %s" % (body, method.reply_code, method.reply_text))

    def on_channel(ch):
        st["ch"] = ch
        ch.add_on_return_callback(on_return)
        ch.confirm_delivery(on_confirm, callback=lambda _f: pump())

    def on_open(c):
        c.channel(on_open_callback=on_channel)

    def on_fail(c, err):
        st["errors"].append("connection failed: %s" % err)
        c.ioloop.stop()

    def on_closed(c, reason):
        c.ioloop.stop()

    conn = pika.SelectConnection(params, on_open_callback=on_open,
                                 on_open_error_callback=on_fail, on_close_callback=on_closed)
    conn.ioloop.start()
    check(not st["errors"], "; ".join(st["errors"][:5]))
    check(st["acked"] == N, "%d of %d publishes confirmed" % (st["acked"], N))


def consume_range(conn, ch, queue, start, stop):
    """Consume with manual ack; the bodies must be exactly start..stop-1 in order."""
    ch.basic_qos(prefetch_count=500)
    expected = [start]
    errors = []

    def on_msg(c, method, props, body):
        n = int(body)
        if n != expected[0]:
            errors.append("got %d, expected %d" % (n, expected[0]))
        if props.delivery_mode != 2:
            errors.append("message %d lost its delivery_mode" % n)
        expected[0] = n + 1
        c.basic_ack(method.delivery_tag)
        if expected[0] >= stop:
            c.stop_consuming()

    tag = ch.basic_consume(queue=queue, on_message_callback=on_msg)
    # bounded by the SIGALRM watchdog; process events until every message is seen
    while expected[0] < stop and not errors:
        conn.process_data_events(0.2)
    ch.basic_cancel(tag)
    check(not errors, "; ".join(errors[:5]))
    check(expected[0] == stop, "consumed up to %d, expected %d" % (expected[0], stop))


def run_all():
    conn = connect()
    ch = conn.channel()
    q = PREFIX + ".durable"
    ch.queue_delete(queue=q)
    ch.queue_declare(queue=q, durable=True)
    publish_all(q)
    check(ch.queue_declare(queue=q, durable=True, passive=True).method.message_count == N,
          "queue does not hold %d messages" % N)
    consume_range(conn, ch, q, 0, N)
    # exactly once: nothing left, nothing redelivered after the acks
    conn.process_data_events(0.3)
    check(ch.queue_declare(queue=q, durable=True, passive=True).method.message_count == 0,
          "messages left after acking all")
    ch.queue_delete(queue=q)
    conn.close()


def run_publish():
    conn = connect()
    ch = conn.channel()
    dq, tq = PREFIX + ".durable", PREFIX + ".transient"
    ch.queue_delete(queue=dq)
    ch.queue_delete(queue=tq)
    ch.queue_declare(queue=dq, durable=True)
    ch.queue_declare(queue=tq, durable=False)
    publish_all(dq)
    ch.basic_publish(exchange="", routing_key=tq, body=b"transient",
                     properties=pika.BasicProperties(delivery_mode=2))
    # consume on its own channel and close it: prefetched-but-unacked messages go back
    cch = conn.channel()
    consume_range(conn, cch, dq, 0, FIRST)
    cch.close()
    # the broker requeues the closed channel's unacked messages asynchronously: poll (≤ 3 s)
    for _ in range(60):
        n = ch.queue_declare(queue=dq, durable=True, passive=True).method.message_count
        if n == N - FIRST:
            break
        conn.process_data_events(0.05)
    check(n == N - FIRST, "durable queue holds %d, expected %d" % (n, N - FIRST))
    conn.close()


def run_check():
    conn = connect()
    ch = conn.channel()
    dq, tq = PREFIX + ".durable", PREFIX + ".transient"
    n = ch.queue_declare(queue=dq, durable=True, passive=True).method.message_count
    check(n == N - FIRST, "after restart the durable queue holds %d, expected %d" % (n, N - FIRST))
    consume_range(conn, ch, dq, FIRST, N)
    ch.queue_delete(queue=dq)
    ch2 = conn.channel()
    try:
        ch2.queue_declare(queue=tq, passive=True)
        raise Fail("non-durable queue %s survived the restart" % tq)
    except pika.exceptions.ChannelClosedByBroker as e:
        check(e.reply_code == 404, "passive declare of the gone queue → %d" % e.reply_code)
    conn.close()


def _alarm(signum, frame):
    raise Fail("did not finish within 20 s")


if __name__ == "__main__":
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    try:
        {"all": run_all, "publish": run_publish, "check": run_check}[MODE]()
        print("PASS %s" % NAME)
        rc = 0
    except Fail as e:
        print("FAIL %s: %s" % (NAME, e))
        rc = 1
    except Exception as e:  # protocol surprises are failures, not crashes
        print("FAIL %s: unexpected %s: %s" % (NAME, type(e).__name__, e))
        rc = 1
    sys.stdout.flush()
    sys.exit(rc)
