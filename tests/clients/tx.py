#!/usr/bin/env python3
"""ringmq client check with pika: transactions (tx.select, tx.commit, tx.rollback).

Usage: python3 tx.py HOST PORT   -> prints "PASS tx" or "FAIL tx: ..."; exit 0/1.
Covers issue 12 item 6, the way pika applications use transactions: publishes and acks held
until commit, rollback, a mandatory unroutable publish returned at commit (before commit-ok),
and the 406 for mixing tx and confirm mode. Bounded to 20 s even against a broker that stops
answering. Passes against RabbitMQ too.
"""
import uuid

import pika

from harness import Fail, check, connect, main


def ready(ch, q):
    return ch.queue_declare(queue=q, passive=True).method.message_count


def scenario():
    conn = connect()
    plain = conn.channel()
    q = "pika-tx." + uuid.uuid4().hex[:8]
    plain.queue_declare(queue=q, durable=True)
    ch = conn.channel()
    ch.tx_select()
    persistent = pika.BasicProperties(delivery_mode=2)
    for i in range(10):
        ch.basic_publish(exchange="", routing_key=q, body=b"m%d" % i, properties=persistent)
    check(ready(plain, q) == 0, "publishes visible before commit")
    ch.tx_commit()
    check(ready(plain, q) == 10, "after commit: %d ready" % ready(plain, q))
    ch.basic_publish(exchange="", routing_key=q, body=b"rolled back")
    ch.tx_rollback()
    check(ready(plain, q) == 10, "a rolled-back publish arrived")

    # acks: held until commit, undone by rollback
    tags = []
    for i in range(3):
        m, _, body = ch.basic_get(q, auto_ack=False)
        check(body == b"m%d" % i, "get %d: %r" % (i, body))
        tags.append(m.delivery_tag)
    ch.basic_ack(tags[2], multiple=True)
    ch.tx_rollback()
    ch.basic_ack(tags[0])
    ch.tx_commit()
    ch.close()  # m1 and m2 were not acked in a committed transaction: requeued
    check(ready(plain, q) == 9, "after commit of one ack and close: %d ready" % ready(plain, q))
    m, _, body = plain.basic_get(q, auto_ack=True)
    check(body == b"m1" and m.redelivered, "first after requeue: %r redelivered=%s" % (body, m.redelivered))

    # a mandatory unroutable publish comes back at commit, before commit-ok
    ch = conn.channel()
    returned = []
    ch.add_on_return_callback(lambda c, method, props, body: returned.append((method.reply_code, body)))
    ch.tx_select()
    ch.basic_publish(exchange="", routing_key=q + ".nowhere", body=b"lost", mandatory=True)
    conn.process_data_events(0.2)
    check(not returned, "returned before commit")
    ch.tx_commit()
    conn.process_data_events(0.2)
    check(returned == [(312, b"lost")], "returns at commit: %r" % returned)

    # tx and confirm mode exclude each other
    try:
        ch.confirm_delivery()
        raise Fail("confirm.select on a tx channel was accepted")
    except pika.exceptions.ChannelClosedByBroker as e:
        check(e.reply_code == 406, "confirm.select on tx channel: %d" % e.reply_code)
    ch = conn.channel()
    try:
        ch.tx_commit()
        raise Fail("tx.commit without tx.select was accepted")
    except pika.exceptions.ChannelClosedByBroker as e:
        check(e.reply_code == 406, "tx.commit without select: %d" % e.reply_code)
    plain.queue_delete(queue=q)
    conn.close()


if __name__ == "__main__":
    main("tx", scenario)
