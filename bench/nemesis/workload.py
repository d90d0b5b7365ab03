"""The nemesis's workload and its history: pika publishers and consumers that record every
publish, confirm and delivery as one JSON line each.

Publishers use publisher confirms, persistent messages (delivery_mode=2) and mandatory=True;
each message's id ("<publisher>-<seq>") is its message_id and, after the run id, its body.
Consumers ack manually and consume every queue. Both are acceptance.Client threads: on any
error they reconnect to the next node, and every blocking pika call is bounded by a Guard;
one away from its first node for 10 s moves on, back towards it.
"""

import json
import threading

from nodes import acceptance, now

pika = acceptance.pika
pex = acceptance.pex

AWAY_LIMIT = 10.0  # seconds a client stays on another node than its home before going on


def away_too_long(client, since):
    """True when `client` has been connected for AWAY_LIMIT seconds to a node other than its
    home (its first node): it then ends its session cleanly and moves on to the next node,
    so that after failures every node gets its clients back."""
    return client.node != client.home and now() - since > AWAY_LIMIT


class History:
    """The append-only history file (JSON lines), shared by every thread. Each event has
    `t`, seconds since the history started (monotonic clock), and `ev`, its kind."""

    def __init__(self, path):
        self.path = path
        self.t0 = now()
        self._lock = threading.Lock()
        self._file = open(path, "w", encoding="utf-8")

    def t(self):
        return round(now() - self.t0, 4)

    def record(self, ev, **fields):
        line = json.dumps({"t": self.t(), "ev": ev, **fields}, separators=(",", ":"))
        with self._lock:
            if not self._file.closed:  # a client thread that outlived the run
                self._file.write(line + "\n")

    def close(self):
        with self._lock:
            self._file.close()


class TagWatch:
    """Reads the confirms (basic.ack and basic.nack) of one confirm-mode channel by delivery
    tag, beside pika's own callback. pika's blocking channel takes whichever confirm comes next
    for the publish it waits for, whatever tag it names, so a second confirm of one tag would
    shift every later answer by one, unseen (an ack "for" a publish the broker never stored).
    Records `double_confirm` for a confirm that names no tag waiting: one confirmed already,
    or one never published."""

    def __init__(self, history, node, k):
        self.history, self.node, self.k = history, node, k
        self.published = 0  # tags taken: one per basic.publish on the channel
        self.low = 1  # every tag below is confirmed
        self.confirmed = set()  # confirmed tags at or above `low`

    def listen(self, ch):
        for method in (pika.spec.Basic.Ack, pika.spec.Basic.Nack):
            ch._impl.callbacks.add(ch.channel_number, method, self.on_confirm, False)

    def on_confirm(self, frame):
        m = frame.method
        tags = range(self.low, m.delivery_tag + 1) if m.multiple else [m.delivery_tag]
        fresh = [t for t in tags if self.low <= t <= self.published and t not in self.confirmed]
        if not fresh:
            self.history.record("double_confirm", pub=self.k, node=self.node, tag=m.delivery_tag,
                                multiple=bool(m.multiple), published=self.published)
        self.confirmed.update(fresh)
        while self.low in self.confirmed:
            self.confirmed.discard(self.low)
            self.low += 1


class Publisher(acceptance.Client):
    """Publishes to one queue at `rate` msgs/s, one confirm at a time. Records `publish`
    before each basic.publish, then `confirm` with outcome ack, nack, return (basic.return:
    unroutable), error (the connection or channel failed while waiting) or timeout (the
    guard aborted the wait: the broker did not answer within the guard's limit)."""

    def __init__(self, k, ports, queue, run_id, rate, guard, stop, history):
        super().__init__(f"publisher{k}", ports, (k - 1) % len(ports), guard, stop)
        self.k, self.queue, self.run_id, self.rate, self.history = k, queue, run_id, rate, history
        self.home = self.node
        self.seq = 0

    def session(self, conn):
        since = now()
        with self.guard.busy("channel.open/confirm.select"):
            ch = conn.channel()
            ch.confirm_delivery()
        tags = TagWatch(self.history, self.node + 1, self.k)
        tags.listen(ch)
        for _ in acceptance.paced(conn, self.rate, self.stop):
            if self.stop.is_set() or away_too_long(self, since):
                return
            tags.published += 1
            self.publish_one(ch)

    def publish_one(self, ch):
        self.seq += 1
        mid = f"{self.k}-{self.seq}"
        node = self.node + 1
        props = pika.BasicProperties(delivery_mode=2, message_id=mid)
        self.history.record("publish", id=mid, node=node, pub=self.k, queue=self.queue)
        sent = now()
        try:
            with self.guard.busy(f"confirm of {mid}"):
                ch.basic_publish("", self.queue, f"{self.run_id} {mid}".encode(), props, mandatory=True)
        except pex.UnroutableError:
            self.history.record("confirm", id=mid, node=node, outcome="return")
            return
        except pex.NackError:
            self.history.record("confirm", id=mid, node=node, outcome="nack")
            return
        except Exception as e:
            outcome = "timeout" if now() - sent >= self.guard.limit else "error"
            self.history.record("confirm", id=mid, node=node, outcome=outcome, error=type(e).__name__)
            raise
        self.history.record("confirm", id=mid, node=node, outcome="ack")
        self.working("confirms again")


class Consumer(acceptance.Client):
    """Consumes every queue with manual acks (prefetch `prefetch`); records `deliver` with
    the message's id, the node and the redelivered flag before acking it."""

    class Cancelled(Exception):
        pass

    def __init__(self, k, ports, queues, run_id, prefetch, guard, stop, history):
        super().__init__(f"consumer{k}", ports, (k - 1) % len(ports), guard, stop)
        self.k, self.queues, self.run_id, self.prefetch, self.history = k, queues, run_id, prefetch, history
        self.home = self.node
        self.last_rx = None

    def on_message(self, ch, method, props, body):
        self.last_rx = now()
        parts = body.decode(errors="replace").split()
        if len(parts) == 2 and parts[0] == self.run_id:
            self.history.record("deliver", id=parts[1], node=self.node + 1, con=self.k,
                                redelivered=bool(method.redelivered))
        else:
            self.history.record("foreign", node=self.node + 1, con=self.k, body=body[:80].decode(errors="replace"))
        ch.basic_ack(method.delivery_tag)
        self.working("receives again")

    def session(self, conn):
        since = now()
        cancelled = []
        with self.guard.busy("channel.open/basic.qos/basic.consume"):
            ch = conn.channel()
            ch.add_on_cancel_callback(cancelled.append)
            ch.basic_qos(prefetch_count=self.prefetch)
            for q in self.queues:
                ch.basic_consume(q, self.on_message, auto_ack=False)
        while not self.stop.is_set() and not away_too_long(self, since):
            conn.process_data_events(time_limit=0.5)
            if cancelled:
                raise Consumer.Cancelled("basic.cancel from the broker")


def declare(port, queues, limit):
    """Declares the durable queues (3 replicas each) through the node on `port` (the
    declaring node serves them first); each declare is aborted after `limit` seconds."""
    guard = acceptance.Guard("declare", limit)
    stop = threading.Event()
    acceptance.Watchdog([guard], stop).start()
    conn = pika.BlockingConnection(acceptance.conn_params(port, "nemesis-declare"))
    guard.conn = conn
    try:
        ch = conn.channel()
        for q in queues:
            with guard.busy(f"queue.declare {q}"):
                ch.queue_declare(q, durable=True, arguments={"x-quorum-initial-group-size": 3})
    finally:
        stop.set()
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - closing a connection the guard aborted
            pass
