"""basic.recover(requeue=false): each unacked delivery comes again to the consumer that held it,
with redelivered=true and a new delivery tag; a consumer of the queue on another channel gets
none of them; acking the new tags empties the queue."""
import time
import uuid

from harness import check, connect, main


def scenario():
    conn = connect()
    admin = conn.channel()
    q = "recover-" + uuid.uuid4().hex[:8]
    admin.queue_declare(q)
    for body in (b"n1", b"n2"):
        admin.basic_publish("", q, body)
    ch, other = conn.channel(), conn.channel()
    got, rival = [], []
    ch.basic_consume(q, lambda _c, m, _p, body: got.append((m.delivery_tag, m.redelivered, body)))

    def wait(n):
        deadline = time.time() + 5
        while len(got) < n and time.time() < deadline:
            conn.process_data_events(0.05)

    wait(2)
    check([(t, r, b) for t, r, b in got] == [(1, False, b"n1"), (2, False, b"n2")], "first deliveries: %r" % got)
    other.basic_consume(q, lambda _c, m, _p, body: rival.append(body))
    ch.basic_recover(requeue=False)
    wait(4)
    check(got[2:] == [(3, True, b"n1"), (4, True, b"n2")], "after recover(requeue=false): %r" % got)
    conn.process_data_events(0.3)
    check(rival == [], "the other channel's consumer got %r" % rival)
    ch.basic_ack(4, multiple=True)
    ch.close()
    other.close()
    check(admin.queue_declare(q, passive=True).method.message_count == 0, "queue not empty after the acks")
    admin.queue_delete(q)
    conn.close()


if __name__ == "__main__":
    main("recover-without-requeue", scenario)
