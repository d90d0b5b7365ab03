#!/usr/bin/env python3
"""ringmq client check with pika: queue length limits (issue 12 item 3).

Usage: python3 length_limits.py HOST PORT -> prints "PASS length_limits" or
"FAIL length_limits: ..."; exit 0/1. x-max-length with drop-head keeps the newest and
dead-letters the oldest with reason maxlen; x-overflow=reject-publish nacks a confirming
publisher (pika raises NackError) and stores nothing; an unknown x-overflow is 406.
Bounded to 20 s even against a broker that stops answering.
"""
import uuid

import pika

from harness import Fail, check, connect, main


def drain(ch, q):
    out = []
    for _ in range(100):
        method, _props, body = ch.basic_get(queue=q, auto_ack=True)
        if method is None:
            return out
        out.append(body)
    return out


def scenario():
    conn = connect()
    ch = conn.channel()
    ch.confirm_delivery()
    tag = uuid.uuid4().hex[:8]

    dlq = "pika-maxlen-dlq." + tag
    ch.queue_declare(queue=dlq)
    q = "pika-maxlen." + tag
    ch.queue_declare(queue=q, arguments={
        "x-max-length": 2, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    for i in range(4):
        ch.basic_publish(exchange="", routing_key=q, body=b"m%d" % i)
    n = ch.queue_declare(queue=q, passive=True).method.message_count
    check(n == 2, "drop-head kept %d messages, not 2" % n)
    check(drain(ch, q) == [b"m2", b"m3"], "drop-head did not keep the newest")
    for _ in range(50):
        if ch.queue_declare(queue=dlq, passive=True).method.message_count == 2:
            break
        conn.sleep(0.1)
    method, props, body = ch.basic_get(queue=dlq, auto_ack=True)
    check(method is not None and body == b"m0", "oldest not dead-lettered: %r" % (body,))
    death = props.headers["x-death"][0]
    reason = death["reason"]
    reason = reason.decode() if isinstance(reason, bytes) else reason
    check(reason == "maxlen", "x-death reason %r" % (reason,))

    rq = "pika-reject." + tag
    ch.queue_declare(queue=rq, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    ch.basic_publish(exchange="", routing_key=rq, body=b"kept")
    try:
        ch.basic_publish(exchange="", routing_key=rq, body=b"refused")
        raise Fail("a publish over the limit was confirmed")
    except pika.exceptions.NackError:
        pass
    check(drain(ch, rq) == [b"kept"], "reject-publish changed the queue")

    try:
        ch.queue_declare(queue="pika-bad." + tag, arguments={"x-max-length": 1, "x-overflow": "drop-tail"})
        raise Fail("unknown x-overflow accepted")
    except pika.exceptions.ChannelClosedByBroker as e:
        check(e.reply_code == 406, "unknown x-overflow → %d" % e.reply_code)
    conn.close()


if __name__ == "__main__":
    main("length_limits", scenario)
