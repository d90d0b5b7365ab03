#!/usr/bin/env python3
"""Issue 9 (file descriptors) with pika: under a low RLIMIT_NOFILE, durable queues the broker
cannot hold must be refused visibly, and nothing that was confirmed may be lost.

Usage:
  python3 fd_limit.py HOST PORT declare PREFIX OUT_JSON [MAX]
      Declares durable queues PREFIX.0000, PREFIX.0001, ... (at most MAX, default 1000) and
      publishes one persistent message with publisher confirms to each (body and message_id =
      the queue name). Stops after STOP_AFTER refusals, or when new connections keep being
      refused (for 5 s). A refusal must be visible: queue.declare
      answered with connection.close 506 RESOURCE_ERROR (the script reconnects and checks with
      a passive declare that the queue was not created: 404), a publish answered with
      basic.nack or connection.close 506, or a new connection refused. Anything else (a
      declare-ok queue whose publish is returned as unroutable, a connection lost without a
      close, another reply code) is a failure. Requires at least one refusal (the limit was
      really reached) and at least MIN_CONFIRMED confirmed messages. Writes OUT_JSON:
      {"declared": [...], "confirmed": [...], "nacked": [...], "publish_refused": [...],
       "refused": [...], "connect_refusals": N}
  python3 fd_limit.py HOST PORT check PREFIX IN_JSON
      After a restart: every declared queue exists; every confirmed message is in its queue
      exactly once (basic.get, then get-empty); a nacked or refused publish left at most its own
      message; every refused queue is absent (404).
Prints "PASS fd-limit-MODE ..." or "FAIL ...: reason"; exit status 0/1. Bounded by SIGALRM.
"""
import json
import signal
import sys
import time

import pika
import pika.exceptions as px

HOST = sys.argv[1]
PORT = int(sys.argv[2])
MODE = sys.argv[3]
PREFIX = sys.argv[4]
PATH = sys.argv[5]
MAX = int(sys.argv[6]) if len(sys.argv) > 6 else 1000
STOP_AFTER = 10
MIN_CONFIRMED = 50
TIME_LIMIT = {"declare": 75, "check": 40}[MODE]


class Fail(Exception):
    pass


class Refused(Exception):
    """New connections kept being refused (descriptors nearly exhausted): a visible refusal."""


def check(cond, msg):
    if not cond:
        raise Fail(msg)


def params():
    return pika.ConnectionParameters(host=HOST, port=PORT, heartbeat=0, connection_attempts=1,
                                     socket_timeout=5, blocked_connection_timeout=10)


STATS = {"connect_refusals": 0}


def connect(limit_s=5.0):
    """A connection and a confirm-mode channel. A connection the broker closes right after
    accept (descriptors nearly exhausted) is a visible refusal: counted, retried for `limit_s`,
    then Refused."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            conn = pika.BlockingConnection(params())
            ch = conn.channel()
            ch.confirm_delivery()
            return conn, ch
        except px.AMQPConnectionError as e:
            STATS["connect_refusals"] += 1
            if time.monotonic() > deadline:
                raise Refused("no connection accepted within %.0f s (last: %r)" % (limit_s, e))
            time.sleep(0.1)


def close_quietly(conn):
    try:
        if conn is not None and conn.is_open:
            conn.close()
    except Exception:
        pass


def queue_state(conn, name):
    """(exists, ready count) by passive declare on a throwaway channel of `conn`."""
    ch = conn.channel()
    try:
        ok = ch.queue_declare(queue=name, passive=True)
    except px.ChannelClosedByBroker as e:
        check(e.reply_code == 404, "passive declare of %s: %d %s" % (name, e.reply_code, e.reply_text))
        return False, 0
    ch.close()
    return True, ok.method.message_count


def props(name):
    return pika.BasicProperties(delivery_mode=2, message_id=name)


def run_declare():
    declared, confirmed, nacked, publish_refused, refused = [], [], [], [], []
    not_checked = []  # refused queues whose absence could not be checked at once
    stopped_by = "max"
    conn, ch = connect()
    for i in range(MAX):
        if len(refused) + len(nacked) + len(publish_refused) >= STOP_AFTER:
            stopped_by = "refusals"
            break
        name = "%s.%04d" % (PREFIX, i)
        if conn is None:
            try:
                conn, ch = connect()
            except Refused as e:
                print("connections refused, declares stop: %s" % e)
                stopped_by = "connections refused"
                break
        try:
            ch.queue_declare(queue=name, durable=True)
        except px.ConnectionClosedByBroker as e:
            check(e.reply_code == 506,
                  "queue.declare %s refused with %d %s, expected 506 RESOURCE_ERROR" % (name, e.reply_code, e.reply_text))
            refused.append(name)
            conn = None
            # the refused queue must not exist (checked again after the restart)
            try:
                conn, ch = connect()
                exists, _ = queue_state(conn, name)
                check(not exists, "queue.declare %s was refused with 506, yet the queue exists" % name)
            except Refused:
                not_checked.append(name)
            except px.ConnectionClosedByBroker as e2:
                check(e2.reply_code == 506, "passive declare %s: %d %s" % (name, e2.reply_code, e2.reply_text))
                not_checked.append(name)
                conn = None
            continue
        except px.ChannelClosedByBroker as e:
            raise Fail("queue.declare %s: channel closed %d %s (expected declare-ok or connection.close 506)"
                       % (name, e.reply_code, e.reply_text))
        except px.AMQPConnectionError as e:
            raise Fail("queue.declare %s: connection lost without a close: %r" % (name, e))
        declared.append(name)
        try:
            ch.basic_publish(exchange="", routing_key=name, body=name.encode(), properties=props(name),
                             mandatory=True)
            confirmed.append(name)
        except px.NackError:
            nacked.append(name)
        except px.UnroutableError:
            raise Fail("queue %s got declare-ok but a publish to it was returned unroutable" % name)
        except px.ConnectionClosedByBroker as e:
            check(e.reply_code == 506, "publish to %s: connection closed %d %s" % (name, e.reply_code, e.reply_text))
            publish_refused.append(name)
            conn = None
        except px.ChannelClosedByBroker as e:
            raise Fail("publish to %s: channel closed %d %s" % (name, e.reply_code, e.reply_text))
        except px.AMQPConnectionError as e:
            raise Fail("publish to %s: connection lost without a close: %r" % (name, e))
    close_quietly(conn)
    out = {"declared": declared, "confirmed": confirmed, "nacked": nacked, "publish_refused": publish_refused,
           "refused": refused, "not_checked": not_checked, "connect_refusals": STATS["connect_refusals"]}
    with open(PATH, "w") as f:
        json.dump(out, f)
    summary = "declared=%d confirmed=%d nacked=%d publish_refused=%d refused=%d connect_refusals=%d stopped_by=%s" % (
        len(declared), len(confirmed), len(nacked), len(publish_refused), len(refused), STATS["connect_refusals"],
        stopped_by)
    print("RESULT " + summary)
    check(len(refused) + len(nacked) + len(publish_refused) + STATS["connect_refusals"] >= 1,
          "no refusal in %d declares under the descriptor limit: the limit was never reached, or the broker "
          "answered ok where it could not open the queue's files (%s)" % (MAX, summary))
    check(len(confirmed) >= MIN_CONFIRMED, "only %d confirmed, expected at least %d (%s)"
          % (len(confirmed), MIN_CONFIRMED, summary))
    return summary


def run_check():
    with open(PATH) as f:
        r = json.load(f)
    conn, _ch = connect()
    confirmed = set(r["confirmed"])
    bad = []
    for name in r["declared"]:
        exists, n = queue_state(conn, name)
        if not exists:
            bad.append("%s got declare-ok but is gone after the restart" % name)
            continue
        ch = conn.channel()
        got = []
        while len(got) < 3:
            method, _props, body = ch.basic_get(queue=name, auto_ack=False)
            if method is None:
                break
            got.append(body)
            ch.basic_ack(method.delivery_tag)
        ch.close()
        if any(b != name.encode() for b in got):
            bad.append("%s holds a wrong body: %r" % (name, got))
        if name in confirmed and len(got) != 1:
            bad.append("confirmed message of %s delivered %d times after the restart (ready count was %d)"
                       % (name, len(got), n))
        if name not in confirmed and len(got) > 1:
            bad.append("%s (publish not confirmed) holds %d messages" % (name, len(got)))
    for name in r["refused"]:
        exists, _ = queue_state(conn, name)
        if exists:
            bad.append("%s was refused with 506 but exists after the restart" % name)
    close_quietly(conn)
    check(not bad, "%d problems: %s" % (len(bad), "; ".join(bad[:8])))
    return "declared=%d confirmed=%d all present once; refused=%d all absent" % (
        len(r["declared"]), len(confirmed), len(r["refused"]))


def _alarm(signum, frame):
    raise Fail("did not finish within %d s" % TIME_LIMIT)


if __name__ == "__main__":
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIME_LIMIT)
    name = "fd-limit-" + MODE
    try:
        summary = {"declare": run_declare, "check": run_check}[MODE]()
        print("PASS %s %s" % (name, summary))
        rc = 0
    except (Fail, Refused) as e:
        print("FAIL %s: %s" % (name, e))
        rc = 1
    except Exception as e:  # protocol surprises are failures, not crashes
        print("FAIL %s: unexpected %s: %r" % (name, type(e).__name__, e))
        rc = 1
    sys.stdout.flush()
    sys.exit(rc)
