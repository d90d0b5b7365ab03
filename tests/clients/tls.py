#!/usr/bin/env python3
"""ringmq over TLS (amqps) with pika and Python's ssl module.

Usage: python3 tls.py HOST PORT MODE CAFILE [CERTFILE KEYFILE]
  MODE plain     PLAIN guest/guest over TLS: declare, publish with confirm, get the message back.
  MODE external  EXTERNAL with the client certificate: the same round trip as its CN's user.
  MODE refused   the connection (TLS handshake or login) must fail.
Prints "PASS tls-MODE" or "FAIL tls-MODE: ..."; exit 0/1. Bounded to 20 s.
"""
import ssl
import sys
import uuid

import pika

from harness import HOST, PORT, Fail, check, main

MODE = sys.argv[3]
CAFILE = sys.argv[4]
CERT = sys.argv[5] if len(sys.argv) > 6 else None
KEY = sys.argv[6] if len(sys.argv) > 6 else None


def params():
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=CAFILE)
    if CERT:
        ctx.load_cert_chain(CERT, KEY)
    creds = pika.credentials.ExternalCredentials() if MODE in ("external", "refused") and CERT else \
        pika.PlainCredentials("guest", "guest")
    return pika.ConnectionParameters(
        host=HOST, port=PORT, heartbeat=0, connection_attempts=1, socket_timeout=5,
        blocked_connection_timeout=5, credentials=creds,
        ssl_options=pika.SSLOptions(ctx, server_hostname="localhost"))


def round_trip():
    conn = pika.BlockingConnection(params())
    ch = conn.channel()
    ch.confirm_delivery()
    q = "tls." + uuid.uuid4().hex[:8]
    ch.queue_declare(queue=q, auto_delete=True)
    body = ("over TLS " + uuid.uuid4().hex).encode() * 200  # several TLS records
    ch.basic_publish(exchange="", routing_key=q, body=body)
    _, _, got = ch.basic_get(queue=q, auto_ack=True)
    check(got == body, "got %r… back, not the message published" % (got[:40] if got else got))
    conn.close()


def refused():
    try:
        conn = pika.BlockingConnection(params())
    except (pika.exceptions.AMQPConnectionError, ssl.SSLError, ConnectionError) as e:
        print("refused as expected: %s %s" % (type(e).__name__, e))
        return
    conn.close()
    raise Fail("the connection was accepted")


if __name__ == "__main__":
    main("tls-" + MODE, refused if MODE == "refused" else round_trip)
