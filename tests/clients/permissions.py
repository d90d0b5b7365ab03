"""Permission denials as a pika application meets them (issue 13, item 2), against a broker
seeded with tests/access.rs's configuration: user `app` may configure and read `app.*` (and
server-named queues) and write `app.*` and the default exchange; user `outsider` has no
permission in `/`.

Inside the patterns: declare, publish with a confirm, get. Outside: queue.declare, a confirmed
basic.publish, basic.consume and basic.get each close the channel with 403 ACCESS_REFUSED and
RabbitMQ's text; a wrong password and a vhost without permission refuse the connection.
"""
import os

import pika

from harness import HOST, PORT, check, main


def connect(user, password):
    return pika.BlockingConnection(pika.ConnectionParameters(
        host=HOST, port=PORT, heartbeat=0, connection_attempts=1, socket_timeout=5,
        blocked_connection_timeout=5, credentials=pika.PlainCredentials(user, password)))


def refused(conn, what, action, text):
    """Runs `action(channel)` on a fresh channel; it must close the channel with 403."""
    ch = conn.channel()
    try:
        action(ch)
    except pika.exceptions.ChannelClosedByBroker as e:
        check(e.reply_code == 403, "%s: reply %d %s, wanted 403" % (what, e.reply_code, e.reply_text))
        check(text in e.reply_text, "%s: %r lacks %r" % (what, e.reply_text, text))
        return
    raise AssertionError("%s: not refused" % what)


def scenario():
    suffix = str(os.getpid())
    guest = connect("guest", "guest")
    foreign = "guest.q." + suffix
    guest.channel().queue_declare(queue=foreign)

    conn = connect("app", "app-secret")
    ch = conn.channel()
    ch.confirm_delivery()
    mine = "app.pika." + suffix
    ch.queue_declare(queue=mine)
    ch.basic_publish(exchange="", routing_key=mine, body=b"inside")
    method, _, body = ch.basic_get(queue=mine, auto_ack=True)
    check(body == b"inside", "get inside: %r" % (body,))

    refused(conn, "declare outside", lambda c: c.queue_declare(queue="other." + suffix),
            "access to queue 'other.%s' in vhost '/' refused for user 'app'" % suffix)

    def publish_outside(c):
        c.confirm_delivery()
        c.basic_publish(exchange="amq.topic", routing_key="x", body=b"outside")
    refused(conn, "publish outside", publish_outside,
            "access to exchange 'amq.topic' in vhost '/' refused for user 'app'")
    refused(conn, "consume outside",
            lambda c: c.basic_consume(queue=foreign, on_message_callback=lambda *a: None),
            "access to queue '%s' in vhost '/' refused for user 'app'" % foreign)
    refused(conn, "get outside", lambda c: c.basic_get(queue=foreign),
            "access to queue '%s' in vhost '/' refused for user 'app'" % foreign)
    check(guest.channel().queue_declare(queue=foreign, passive=True).method.message_count == 0,
          "the refused publish reached no queue")
    conn.close()

    for user, password, code in [("app", "wrong", 403), ("outsider", "outsider-secret", 530)]:
        try:
            connect(user, password).close()
        except pika.exceptions.ProbableAccessDeniedError as e:
            # pika's name for a close before the connection opened; the reply is in its text.
            check(str(code) in repr(e), "%s: %r, wanted %d" % (user, e, code))
        except pika.exceptions.ConnectionClosedByBroker as e:
            check(e.reply_code == code, "%s: reply %d, wanted %d" % (user, e.reply_code, code))
        except pika.exceptions.AMQPConnectionError as e:
            # pika reports a close during connection.open as a connection error wrapping it.
            check(str(code) in repr(e), "%s: %r, wanted %d" % (user, e, code))
        else:
            raise AssertionError("%s logged in" % user)
    guest.close()


if __name__ == "__main__":
    main("permissions", scenario)
