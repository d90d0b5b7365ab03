#!/usr/bin/env python3
"""Writes the seed inputs of the AMQP fuzz targets into fuzz/corpus/<target>/.

The frames come from pika's own encoder (another implementation than the one under test),
one file per seed, named seed-<what>. Run from anywhere: python3 fuzz/seeds.py. The
raft_entry seeds come from `cargo test --test fuzz_corpus -- --ignored write_raft_seeds`.
"""
import datetime
import decimal
import os
import struct

import pika.data
import pika.frame
import pika.spec as s

HERE = os.path.dirname(os.path.abspath(__file__))

TABLES = {
    "empty": {},
    "ttl": {"x-message-ttl": 60000, "x-dead-letter-exchange": "dlx", "x-max-length": 10},
    "quorum": {"x-queue-type": "quorum", "x-delivery-limit": 3, "x-overflow": "reject-publish"},
    "headers": {"x-match": "all", "format": "pdf", "type": "report"},
    "nested": {"a": {"b": {"c": [1, "two", True, None]}}, "when": datetime.datetime(2026, 12, 4)},
    "client": {
        "product": "pika",
        "capabilities": {"publisher_confirms": True, "consumer_cancel_notify": True, "connection.blocked": True},
    },
    "numbers": {"big": 2**62, "neg": -5, "bytes": b"\x00\x01", "dec": decimal.Decimal("1.25")},
}

METHODS = {
    "start_ok": s.Connection.StartOk(TABLES["client"], "PLAIN", "\x00guest\x00guest", "en_US"),
    "tune_ok": s.Connection.TuneOk(2047, 131072, 60),
    "open": s.Connection.Open("/"),
    "close": s.Connection.Close(200, "bye", 0, 0),
    "channel_open": s.Channel.Open(),
    "channel_flow": s.Channel.Flow(False),
    "exchange_declare": s.Exchange.Declare(exchange="x", type="headers", durable=True, arguments=TABLES["ttl"]),
    "exchange_bind": s.Exchange.Bind(destination="d", source="x", routing_key="a.*", arguments={}),
    "queue_declare": s.Queue.Declare(queue="q", durable=True, arguments=TABLES["ttl"]),
    "queue_declare_quorum": s.Queue.Declare(queue="qq", durable=True, arguments=TABLES["quorum"]),
    "queue_bind": s.Queue.Bind(queue="q", exchange="x", routing_key="#.b", arguments=TABLES["headers"]),
    "queue_purge": s.Queue.Purge(queue="q"),
    "queue_delete": s.Queue.Delete(queue="q", if_unused=True, if_empty=True),
    "qos": s.Basic.Qos(prefetch_count=100, global_qos=False),
    "consume": s.Basic.Consume(queue="q", consumer_tag="c1", arguments={"x-priority": 5}),
    "cancel": s.Basic.Cancel("c1"),
    "publish": s.Basic.Publish(exchange="", routing_key="q", mandatory=True),
    "get": s.Basic.Get(queue="q", no_ack=False),
    "ack": s.Basic.Ack(delivery_tag=7, multiple=True),
    "nack": s.Basic.Nack(delivery_tag=9, multiple=False, requeue=True),
    "reject": s.Basic.Reject(delivery_tag=3, requeue=False),
    "recover": s.Basic.Recover(requeue=True),
    "confirm_select": s.Confirm.Select(),
    "tx_select": s.Tx.Select(),
    "tx_commit": s.Tx.Commit(),
}

PROPS = {
    "none": s.BasicProperties(),
    "persistent": s.BasicProperties(delivery_mode=2, content_type="text/plain"),
    "full": s.BasicProperties(
        content_type="application/json", content_encoding="gzip", headers=TABLES["nested"], delivery_mode=2,
        priority=7, correlation_id="c", reply_to="amq.rabbitmq.reply-to", expiration="60000", message_id="m",
        timestamp=1764806400, type="t", user_id="guest", app_id="a",
    ),
    "bad_expiration": s.BasicProperties(expiration="-1"),
}


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


def main():
    for name, t in TABLES.items():
        parts = []
        pika.data.encode_table(parts, t)
        write("field_table", name, b"".join(parts))
    for name, m in METHODS.items():
        write("method", name, struct.pack(">HH", m.INDEX >> 16, m.INDEX & 0xFFFF) + b"".join(m.encode()))
    for name, p in PROPS.items():
        frame = pika.frame.Header(1, 5, p).marshal()
        write("content_header", name, frame[7:-1])
    # Streams: frame_max byte, read-size byte, then frames as a client sends them.
    publish = b"".join(
        [pika.frame.Method(1, METHODS["publish"]).marshal(), pika.frame.Header(1, 5, PROPS["full"]).marshal(),
         pika.frame.Body(1, b"hello").marshal()]
    )
    session = b"".join(pika.frame.Method(0 if k in ("start_ok", "tune_ok", "open", "close") else 1, m).marshal()
                       for k, m in METHODS.items())
    heartbeat = pika.frame.Heartbeat().marshal()
    write("frames", "session", b"\x01\x07" + session)
    write("frames", "publish", b"\x00\xff" + publish + heartbeat + publish)
    write("frames", "split_body", b"\x02\x00" + publish)
    write("frames", "oversized_body", b"\x00\x10" + pika.frame.Body(1, b"z" * 5000).marshal())
    write("frames", "heartbeat_payload", b"\x01\x03" + b"\x08\x00\x00\x00\x00\x00\x01\x00\xce")
    for pattern, key in [("*.stock.#", "usd.stock"), ("a.#.b", "a.x.y.b"), ("#.#", "a.b"), ("#", ""), ("a.*", "a")]:
        write("topic", pattern.replace("*", "star").replace("#", "hash"), f"{pattern}\n{key}".encode())


if __name__ == "__main__":
    main()
