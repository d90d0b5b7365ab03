#!/usr/bin/env python3
"""ringmq client check with pika: declare, publish, get, consume, ack, nack, cancel.

Usage: python3 basics.py HOST PORT   -> prints "PASS basics" or "FAIL basics: ..."; exit 0/1.
Covers issue 2 item 8 (the pika script set: the everyday basics from Python).
Bounded to 20 s even against a broker that stops answering.
"""
import signal
import sys
import uuid

import pika

NAME = "basics"
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


def scenario():
    conn = connect()
    ch = conn.channel()
    ch.confirm_delivery()
    q = "pika-basics." + uuid.uuid4().hex[:8]
    x = "pika-basics-x." + uuid.uuid4().hex[:8]
    ok = ch.queue_declare(queue=q, durable=False, auto_delete=False)
    check(ok.method.message_count == 0 and ok.method.consumer_count == 0, "fresh queue not empty")
    ch.exchange_declare(exchange=x, exchange_type="topic")
    ch.queue_bind(queue=q, exchange=x, routing_key="a.#")
    props = pika.BasicProperties(content_type="text/plain", delivery_mode=2, priority=3,
                                 correlation_id="c1", message_id="m1",
                                 headers={"n": 1, "s": "str", "nested": {"k": [1, "two"]}})
    ch.basic_publish(exchange=x, routing_key="a.b", body=b"via-topic", properties=props)
    ch.basic_publish(exchange="", routing_key=q, body=b"direct")
    # unroutable mandatory publish → UnroutableError from pika's confirm mode
    try:
        ch.basic_publish(exchange=x, routing_key="zzz", body=b"lost", mandatory=True)
        raise Fail("unroutable mandatory publish was not returned")
    except pika.exceptions.UnroutableError:
        pass
    check(ch.queue_declare(queue=q, passive=True).method.message_count == 2, "expected 2 ready")
    # get + ack
    m, p, body = ch.basic_get(q, auto_ack=False)
    check(body == b"via-topic", "get body %r" % body)
    check(p.headers == {"n": 1, "s": "str", "nested": {"k": [1, "two"]}}, "headers %r" % p.headers)
    check((p.content_type, p.delivery_mode, p.priority, p.correlation_id, p.message_id)
          == ("text/plain", 2, 3, "c1", "m1"), "properties changed")
    check(m.routing_key == "a.b" and m.exchange == x and not m.redelivered, "get method fields")
    ch.basic_ack(m.delivery_tag)
    # get + nack(requeue) → redelivered
    m, p, body = ch.basic_get(q, auto_ack=False)
    check(body == b"direct", "second get %r" % body)
    ch.basic_nack(m.delivery_tag, requeue=True)
    # consume
    got = []

    def on_msg(c, method, props, body):
        got.append((method, body))
        c.basic_ack(method.delivery_tag)

    tag = ch.basic_consume(queue=q, on_message_callback=on_msg)
    for _ in range(60):
        if got:
            break
        conn.process_data_events(0.05)
    check(len(got) == 1 and got[0][1] == b"direct" and got[0][0].redelivered, "consume got %r" % got)
    ch.basic_publish(exchange="", routing_key=q, body=b"third")
    for _ in range(60):
        if len(got) == 2:
            break
        conn.process_data_events(0.05)
    check(len(got) == 2 and got[1][1] == b"third", "consume after publish got %r" % got)
    ch.basic_cancel(tag)
    check(ch.basic_get(q, auto_ack=True) == (None, None, None), "queue not empty at the end")
    # errors come back as pika exceptions with the broker's reply code
    ch2 = conn.channel()
    try:
        ch2.queue_declare(queue=q + ".missing", passive=True)
        raise Fail("passive declare of a missing queue succeeded")
    except pika.exceptions.ChannelClosedByBroker as e:
        check(e.reply_code == 404, "passive missing → %d" % e.reply_code)
    n = ch.queue_delete(queue=q).method.message_count
    check(n == 0, "delete count %d" % n)
    ch.exchange_delete(exchange=x)
    conn.close()


def _alarm(signum, frame):
    raise Fail("did not finish within 20 s")


if __name__ == "__main__":
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    try:
        scenario()
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
