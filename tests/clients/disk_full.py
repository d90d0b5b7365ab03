#!/usr/bin/env python3
"""Issue 9 (a full disk) with pika: the disk alarm blocks publishers and not consumers, a
publish that cannot be stored is nacked, and every confirmed message is delivered later.

Messages are persistent, BODY bytes long; the body starts with the message's id (also its
message_id) and is padded with b"." (checked on delivery). Every mode prints progress lines,
then "PASS disk-full-MODE ..." or "FAIL disk-full-MODE: reason"; exit status 0/1; SIGALRM bounds
each run. JSON files hold {"sent": [...], "confirmed": [...], "nacked": [...], "unsettled": [...],
"consumed": [...]} (ids; "consumed" = delivered and acked before the file was written).

  fill QUEUE OUT_JSON      (the test talks to it over stdin/stdout)
      A publisher on its own connection (SelectConnection in a thread, confirms, a window of
      WINDOW unconfirmed) publishes until it receives connection.blocked (reason must mention
      the disk), then prints "BLOCKED ...". Nacks are allowed (the disk may fill between two
      alarm checks), but not for more than NACK_GRACE_S seconds without the block. A second connection that never published publishes
      one message and must be blocked after it ("LATE-BLOCKED"). The script prints "WAITING"
      and reads a line "go" (the test checks /metrics meanwhile). A consumer on a third
      connection (never published) drains half of the confirmed messages with manual acks (then
      10 % more at a time while the publisher stays blocked, up to 90 %) and must never be
      blocked ("DRAINED n of m ..."). The publisher must then receive connection.unblocked
      ("UNBLOCKED"), publish EXTRA more messages and get every one acked; the late connection
      must be unblocked too.
  publish QUEUE TAG N OUT_JSON
      N messages (ids TAG-i) with confirms; every one must be acked.
  publish-full QUEUE TAG MAX OUT_JSON
      On a full disk: publish (confirms, one at a time) up to MAX messages, stopping after
      NACKS_ENOUGH nacks or when the connection is blocked; at least one nack (or a block) is
      required: MAX messages cannot all fit. Acked ones are written as confirmed.
  publish-retry QUEUE TAG OUT_JSON [LIMIT_S]
      Publish one message at a time (confirms) until one is acked (bounded: LIMIT_S seconds,
      default 20); nacks before that are allowed (a stopped queue reopening once writing works
      again). Prints "ACKED after S s" (seconds from the first publish).
  publish-fault QUEUE TAG MAX OUT_JSON
      While the data directory's block device fails every write (EIO): publish (confirms, one at
      a time) until NACKS_ENOUGH nacks or MAX publishes, wait LATE_WAIT_S (past the broker's 1 s
      tick that retires a failed queue), publish LATE_PUBLISHES more. Every publish must be
      nacked, none acked (nothing can be stored), and none may close the channel or connection.
      Reads are reported (the Rust test requires both to be ok): after the first nack ("FIRST-NACK") and after the late
      publishes a basic.get (manual ack; the message is rejected with requeue, so nothing is
      acked on the failed store) prints "READ ok ID" / "LATE-READ ok ID" with the body checked,
      or "READ refused: CODE TEXT" (the connection is then opened again).
  stale-tag QUEUE          (the test talks to it over stdin/stdout)
      A delivery tag kept across a queue's reopen settles nothing. Publishes one confirmed
      message M; connection A basic.gets it (manual ack) and keeps the tag unacked; prints
      "HOLDING" and reads "fault" (the test has made every write fail). A publisher connection
      publishes (confirms, one at a time, at most NACKS_ENOUGH) until one is nacked: none may be
      acked ("FAULT-NACKED"); reads "healed", then publishes one at a time until one is acked
      (within REOPEN_LIMIT_S; the queue was reopened from disk; "REOPENED"). Connection B
      basic.gets M again with redelivered=true and keeps it; A (its channel still open, no
      basic.cancel or close seen) acks its old tag; B nacks M with requeue; a basic.get must
      return M again (an old tag acking by offset what B held would have deleted it).
  declare-full QUEUE
      Declare a new durable queue on a full disk: declare-ok or a visible error (channel or
      connection close with a reply code) both pass; a connection lost without a close fails.
  drain QUEUE IN_JSON [IN_JSON...]
      basic.get with manual acks until get-empty; every id confirmed in one of the files and
      not consumed there must be delivered; an id delivered again, or consumed before, must
      come with redelivered=true; every delivered id must be one that was sent.
"""
import json
import signal
import sys
import threading
import time

import pika
import pika.exceptions as px

HOST = sys.argv[1]
PORT = int(sys.argv[2])
MODE = sys.argv[3]
QUEUE = sys.argv[4]
REST = sys.argv[5:]
BODY = 4096
WINDOW = 64
MAX_FILL = 40000  # 160 MB: more than the test's filesystem; reaching it means "never blocked"
EXTRA = 200
NACKS_ENOUGH = 20
LATE_WAIT_S = 2.5  # publish-fault: how long the fault is held before the late publishes
LATE_PUBLISHES = 5
REOPEN_LIMIT_S = 15  # stale-tag: a publish confirmed this soon after "healed"
NACK_GRACE_S = 3  # nacks (the disk filled before the alarm) for longer than this without a block fail
TIME_LIMIT = {"fill": 85, "publish": 30, "publish-full": 60, "publish-retry": 30, "publish-fault": 45,
              "stale-tag": 60,
              "declare-full": 20, "drain": 60}[MODE]


class Fail(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Fail(msg)


def say(line):
    print(line)
    sys.stdout.flush()


def params(blocked_timeout=None):
    return pika.ConnectionParameters(host=HOST, port=PORT, heartbeat=0, connection_attempts=1,
                                     socket_timeout=5, blocked_connection_timeout=blocked_timeout)


def body(mid):
    b = mid.encode()
    return b + b"." * (BODY - len(b))


def props(mid):
    return pika.BasicProperties(delivery_mode=2, message_id=mid, content_type="application/octet-stream")


def body_ok(mid, data):
    return data == body(mid)


def write_json(path, **kw):
    out = {"sent": [], "confirmed": [], "nacked": [], "unsettled": [], "consumed": []}
    out.update({k: list(v) for k, v in kw.items()})
    with open(path, "w") as f:
        json.dump(out, f)


def declare(queue):
    conn = pika.BlockingConnection(params(10))
    ch = conn.channel()
    ch.queue_declare(queue=queue, durable=True)
    conn.close()


def wait_event(evt, limit, what, errors=None):
    deadline = time.monotonic() + limit
    while not evt.wait(0.2):
        if errors:
            raise Fail("%s: %s" % (what, "; ".join(errors[:5])))
        check(time.monotonic() < deadline, "%s: not within %d s" % (what, limit))


class Publisher(threading.Thread):
    """Confirmed publisher on its own SelectConnection, in its own thread. Phase "fill":
    publish until connection.blocked. Phase "more" (start_more): once unblocked, publish
    `extra` more; `settled` is set when nothing is unconfirmed any more."""

    def __init__(self, queue):
        super().__init__(daemon=True)
        self.queue = queue
        self.conn = None
        self.ch = None
        self.lock = threading.Lock()
        self.tag = 0
        self.pending = {}  # delivery tag -> id
        self.sent, self.acked, self.nacked, self.errors = [], [], [], []
        self.extra_ids = set()
        self.phase = "fill"
        self.extra = 0
        self.blocked = False
        self.blocked_reason = None
        self.closing = False
        self.first_nack = None
        self.nack_reported = False
        self.ready = threading.Event()
        self.blocked_evt = threading.Event()
        self.unblocked_evt = threading.Event()
        self.settled = threading.Event()

    def run(self):
        try:
            self.conn = pika.SelectConnection(params(), on_open_callback=self._on_open,
                                              on_open_error_callback=self._on_open_error,
                                              on_close_callback=self._on_closed)
            self.conn.add_on_connection_blocked_callback(self._on_blocked)
            self.conn.add_on_connection_unblocked_callback(self._on_unblocked)
            self.conn.ioloop.start()
        except Exception as e:  # surfaced to the main thread
            self.errors.append("publisher thread: %s: %r" % (type(e).__name__, e))

    # -- callbacks (publisher thread) --
    def _on_open(self, conn):
        conn.channel(on_open_callback=self._on_channel)

    def _on_open_error(self, conn, err):
        self.errors.append("publisher connection failed: %r" % (err,))
        conn.ioloop.stop()

    def _on_closed(self, conn, reason):
        if not self.closing:
            self.errors.append("publisher connection closed: %r" % (reason,))
        conn.ioloop.stop()

    def _on_channel(self, ch):
        self.ch = ch
        ch.add_on_return_callback(self._on_return)
        ch.add_on_close_callback(self._on_channel_closed)
        ch.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_select_ok)

    def _on_select_ok(self, _frame):
        self.ready.set()
        self._pump()

    def _on_channel_closed(self, ch, reason):
        if not self.closing:
            self.errors.append("publisher channel closed: %r" % (reason,))

    def _on_return(self, ch, method, properties, data):
        self.errors.append("message %s returned: %d %s" % (properties.message_id, method.reply_code, method.reply_text))

    def _on_blocked(self, conn, frame):
        self.blocked = True
        if self.phase == "fill":
            self.phase = "hold"  # the fill ends at the first block; start_more begins phase "more"
        self.blocked_reason = frame.method.reason
        self.blocked_evt.set()

    def _on_unblocked(self, conn, frame):
        self.blocked = False
        self.unblocked_evt.set()
        self._pump()

    def _on_confirm(self, frame):
        m = frame.method
        nack = isinstance(m, pika.spec.Basic.Nack)
        with self.lock:
            if m.multiple:
                tags = [t for t in self.pending if t <= m.delivery_tag]
            else:
                tags = [m.delivery_tag]
            for t in tags:
                mid = self.pending.pop(t, None)
                if mid is None:
                    self.errors.append("confirm for unknown delivery tag %d" % t)
                    continue
                (self.nacked if nack else self.acked).append(mid)
            if nack and self.phase == "fill":
                if self.first_nack is None:
                    self.first_nack = time.monotonic()
                elif time.monotonic() - self.first_nack > NACK_GRACE_S and not self.nack_reported:
                    self.nack_reported = True
                    self.errors.append("publishes nacked for %.0f s (%d nacks: the disk is full) without connection.blocked"
                                       % (NACK_GRACE_S, len(self.nacked)))
        self._pump()

    def _publish(self, mid):
        with self.lock:
            self.tag += 1
            self.pending[self.tag] = mid
            self.sent.append(mid)
        self.ch.basic_publish(exchange="", routing_key=self.queue, body=body(mid), properties=props(mid),
                              mandatory=True)

    def _pump(self):
        if self.ch is None or self.closing or self.errors:
            return
        if not self.blocked:
            if self.phase == "fill":
                while not self.blocked and len(self.pending) < WINDOW and len(self.sent) < MAX_FILL:
                    self._publish("f%06d" % len(self.sent))
                if len(self.sent) >= MAX_FILL and not self.blocked_evt.is_set():
                    self.errors.append("published %d messages (%d MB) without connection.blocked"
                                       % (MAX_FILL, MAX_FILL * BODY >> 20))
            elif self.phase == "more":
                while len(self.pending) < WINDOW and len(self.extra_ids) < self.extra:
                    mid = "x%06d" % len(self.extra_ids)
                    self.extra_ids.add(mid)
                    self._publish(mid)
        if self.phase == "more" and len(self.extra_ids) >= self.extra and not self.pending:
            self.settled.set()

    def _start_more(self, n):
        self.phase = "more"
        self.extra = n
        self._pump()

    def _close(self):
        self.closing = True
        if self.conn.is_open:
            self.conn.close()
        else:
            self.conn.ioloop.stop()

    # -- called from the main thread --
    def start_more(self, n):
        self.conn.ioloop.add_callback_threadsafe(lambda: self._start_more(n))

    def close(self):
        if self.conn is not None:
            self.conn.ioloop.add_callback_threadsafe(self._close)
        self.join(10)

    def snapshot(self):
        with self.lock:
            return list(self.sent), list(self.acked), list(self.nacked), list(self.pending.values())


def run_fill():
    out = REST[0]
    declare(QUEUE)
    pub = Publisher(QUEUE)
    pub.start()
    wait_event(pub.ready, 10, "publisher confirm mode", pub.errors)
    wait_event(pub.blocked_evt, 60, "connection.blocked for the publisher", pub.errors)
    sent, acked, nacked, pending = pub.snapshot()
    reason = pub.blocked_reason or ""
    say("BLOCKED sent=%d acked=%d nacked=%d unconfirmed=%d reason=%r" % (len(sent), len(acked), len(nacked),
                                                                        len(pending), reason))
    check("disk" in reason.lower(), "connection.blocked reason %r does not name the disk" % reason)
    check(len(acked) > 0, "blocked before any publish was confirmed")

    # A connection that publishes for the first time during the alarm: blocked after it.
    late_events = {"blocked": [], "unblocked": []}
    late = pika.BlockingConnection(params())
    late.add_on_connection_blocked_callback(lambda c, f: late_events["blocked"].append(f.method.reason))
    late.add_on_connection_unblocked_callback(lambda c, f: late_events["unblocked"].append(1))
    lch = late.channel()
    lch.basic_publish(exchange="", routing_key=QUEUE, body=body("late-0"), properties=props("late-0"))
    deadline = time.monotonic() + 5
    while not late_events["blocked"] and time.monotonic() < deadline:
        late.process_data_events(0.1)
    check(late_events["blocked"], "a connection that published during the alarm was not blocked within 5 s")
    say("LATE-BLOCKED reason=%r" % late_events["blocked"][0])

    say("WAITING")
    line = sys.stdin.readline()
    check(line.strip() == "go", "expected 'go' from the test on stdin, got %r" % line)

    # A consumer that never published keeps working during the alarm: it drains half of the
    # confirmed messages, then (if the publisher is still blocked) 10 % more at a time, up to 90 %.
    cons_blocked = []
    cons = pika.BlockingConnection(params())
    cons.add_on_connection_blocked_callback(lambda c, f: cons_blocked.append(f.method.reason))
    consumed, bad = [], []
    goal = {"n": 0}

    def on_msg(c, method, properties, data):
        # pika dispatches deliveries for as long as they keep coming: past the goal, leave them
        # unacked (they are requeued when the channel closes)
        if len(consumed) >= goal["n"]:
            return
        mid = properties.message_id
        if not body_ok(mid or "", data):
            bad.append("message %r has a wrong body (%d bytes)" % (mid, len(data)))
        consumed.append(mid)
        c.basic_ack(method.delivery_tag)

    def consume_upto(n):
        goal["n"] = n
        cch = cons.channel()
        cch.basic_qos(prefetch_count=200)
        cch.basic_consume(queue=QUEUE, on_message_callback=on_msg)
        deadline = time.monotonic() + 30
        while len(consumed) < n:
            check(time.monotonic() < deadline, "consumer drained %d of %d within 30 s during the alarm"
                  % (len(consumed), n))
            cons.process_data_events(0.1)
        cch.close()  # the unacked rest goes back to the queue

    pub.start_more(EXTRA)
    goals = [len(acked) * f // 10 for f in (5, 6, 7, 8, 9)]
    for n in goals:
        consume_upto(n)
        if pub.unblocked_evt.wait(4):
            break
        say("still blocked after draining %d of %d confirmed" % (len(consumed), len(acked)))
    pch = cons.channel()
    ready = 0
    for _ in range(60):  # the requeue of a closed channel's unacked messages is asynchronous
        ready = pch.queue_declare(queue=QUEUE, durable=True, passive=True).method.message_count
        if ready >= len(acked) - len(consumed):
            break
        cons.sleep(0.05)
    check(not bad, "; ".join(bad[:5]))
    say("DRAINED %d of %d confirmed, ready=%d" % (len(consumed), len(acked), ready))
    check(ready >= len(acked) - len(consumed),
          "after consuming %d of %d confirmed messages only %d are ready" % (len(consumed), len(acked), ready))
    wait_event(pub.unblocked_evt, 5, "connection.unblocked for the publisher after draining %d of %d"
               % (len(consumed), len(acked)), pub.errors)
    say("UNBLOCKED")
    wait_event(pub.settled, 30, "the %d publishes after connection.unblocked confirmed" % EXTRA, pub.errors)
    deadline = time.monotonic() + 5
    while not late_events["unblocked"] and time.monotonic() < deadline:
        late.process_data_events(0.1)
    check(late_events["unblocked"], "the late publisher was not unblocked within 5 s of the publisher")
    late.close()
    check(not cons_blocked, "the consumer connection (never published) got connection.blocked: %r" % cons_blocked)
    cons.close()
    pub.close()
    check(not pub.errors, "; ".join(pub.errors[:5]))
    sent, acked, nacked, pending = pub.snapshot()
    extra_nacked = [m for m in nacked if m in pub.extra_ids]
    check(not extra_nacked, "%d publishes after connection.unblocked were nacked (e.g. %s)"
          % (len(extra_nacked), extra_nacked[:3]))
    write_json(out, sent=sent + ["late-0"], confirmed=acked, nacked=nacked, unsettled=pending, consumed=consumed)
    return "sent=%d confirmed=%d nacked=%d unsettled=%d consumed=%d extra=%d" % (
        len(sent) + 1, len(acked), len(nacked), len(pending), len(consumed), EXTRA)


def run_publish():
    tag, n, out = REST[0], int(REST[1]), REST[2]
    declare(QUEUE)
    conn = pika.BlockingConnection(params(10))
    ch = conn.channel()
    ch.confirm_delivery()
    sent, confirmed = [], []
    for i in range(n):
        mid = "%s-%d" % (tag, i)
        sent.append(mid)
        try:
            ch.basic_publish(exchange="", routing_key=QUEUE, body=body(mid), properties=props(mid), mandatory=True)
        except px.NackError:
            raise Fail("publish %s nacked (%d acked before)" % (mid, len(confirmed)))
        confirmed.append(mid)
    conn.close()
    write_json(out, sent=sent, confirmed=confirmed)
    return "confirmed=%d" % len(confirmed)


def run_publish_full():
    tag, max_n, out = REST[0], int(REST[1]), REST[2]
    conn = pika.BlockingConnection(params(5))
    events = {"blocked": []}
    conn.add_on_connection_blocked_callback(lambda c, f: events["blocked"].append(f.method.reason))
    ch = conn.channel()
    ch.confirm_delivery()
    sent, confirmed, nacked = [], [], []
    blocked = None
    for i in range(max_n):
        mid = "%s-%d" % (tag, i)
        sent.append(mid)
        try:
            ch.basic_publish(exchange="", routing_key=QUEUE, body=body(mid), properties=props(mid), mandatory=True)
            confirmed.append(mid)
        except px.NackError:
            nacked.append(mid)
            if len(nacked) >= NACKS_ENOUGH:
                break
        except px.ConnectionBlockedTimeout:
            blocked = "blocked (ConnectionBlockedTimeout) at publish %d" % i
            break
        except px.UnroutableError:
            raise Fail("publish %s returned unroutable" % mid)
        except px.ConnectionClosedByBroker as e:
            raise Fail("publish %s on the full disk: connection closed %d %s (expected basic.nack)"
                       % (mid, e.reply_code, e.reply_text))
        except px.AMQPConnectionError as e:
            raise Fail("publish %s on the full disk: connection lost: %r" % (mid, e))
        conn.process_data_events(0)  # dispatches a connection.blocked callback
        if events["blocked"]:
            blocked = "connection.blocked %r after publish %d" % (events["blocked"][0], i)
            break
    if blocked is None and events["blocked"]:
        blocked = "connection.blocked %r" % events["blocked"][0]
    try:
        conn.close()
    except Exception:
        pass
    write_json(out, sent=sent, confirmed=confirmed, nacked=nacked)
    summary = "sent=%d acked=%d nacked=%d blocked=%s" % (len(sent), len(confirmed), len(nacked), blocked)
    say("RESULT " + summary)
    check(nacked or blocked, "%d publishes of %d KiB all acked on a full filesystem" % (len(sent), BODY >> 10))
    return summary


def run_publish_retry():
    tag, out = REST[0], REST[1]
    limit = float(REST[2]) if len(REST) > 2 else 20
    conn = pika.BlockingConnection(params(5))
    ch = conn.channel()
    ch.confirm_delivery()
    sent, confirmed, nacked = [], [], []
    started = time.monotonic()
    deadline = started + limit
    while not confirmed:
        check(time.monotonic() < deadline, "no publish acked within %g s after space was freed (%d nacked)"
              % (limit, len(nacked)))
        mid = "%s-%d" % (tag, len(sent))
        sent.append(mid)
        try:
            ch.basic_publish(exchange="", routing_key=QUEUE, body=body(mid), properties=props(mid), mandatory=True)
            confirmed.append(mid)
        except px.NackError:
            nacked.append(mid)
            conn.sleep(0.5)
    took = time.monotonic() - started
    say("ACKED after %.1f s" % took)
    conn.close()
    write_json(out, sent=sent, confirmed=confirmed, nacked=nacked)
    return "acked after %d nacks in %.1f s" % (len(nacked), took)


def run_publish_fault():
    tag, max_n, out = REST[0], int(REST[1]), REST[2]
    sent, confirmed, nacked = [], [], []
    started = time.monotonic()
    state = {"conn": None, "ch": None}

    def channel():
        if state["conn"] is None or not state["conn"].is_open:
            state["conn"] = pika.BlockingConnection(params(5))
            state["ch"] = None
        if state["ch"] is None or not state["ch"].is_open:
            state["ch"] = state["conn"].channel()
            state["ch"].confirm_delivery()
        return state["ch"]

    def publish(mid):
        sent.append(mid)
        try:
            channel().basic_publish(exchange="", routing_key=QUEUE, body=body(mid), properties=props(mid),
                                    mandatory=True)
            confirmed.append(mid)
            say("ACKED %s during the store fault" % mid)
        except px.NackError:
            nacked.append(mid)
        except px.UnroutableError:
            raise Fail("publish %s returned unroutable" % mid)
        except px.ChannelClosedByBroker as e:
            raise Fail("publish %s during the store fault: channel closed %d %s (expected basic.nack)"
                       % (mid, e.reply_code, e.reply_text))
        except px.ConnectionClosedByBroker as e:
            raise Fail("publish %s during the store fault: connection closed %d %s (expected basic.nack)"
                       % (mid, e.reply_code, e.reply_text))
        except px.AMQPConnectionError as e:
            raise Fail("publish %s during the store fault: connection lost: %r" % (mid, e))

    def read(label):
        # basic.get with a manual ack, the message rejected with requeue: nothing is acked on
        # the failed store. Reported; the Rust test requires "ok" (see the module doc).
        try:
            method, properties, data = channel().basic_get(queue=QUEUE, auto_ack=False)
        except (px.ChannelClosedByBroker, px.ConnectionClosedByBroker) as e:
            say("%s refused: %d %s" % (label, e.reply_code, e.reply_text))
            return
        if method is None:
            say("%s refused: get-empty (the queue held messages)" % label)
            return
        mid = properties.message_id or ""
        check(body_ok(mid, data), "%s: message %r has a wrong body (%d bytes)" % (label, mid, len(data)))
        state["ch"].basic_reject(method.delivery_tag, requeue=True)
        say("%s ok %s redelivered=%s" % (label, mid, method.redelivered))

    try:
        for i in range(max_n):
            publish("%s-%d" % (tag, i))
            if nacked and not state.get("read"):
                state["read"] = True
                say("FIRST-NACK %s after %.2f s" % (nacked[0], time.monotonic() - started))
                read("READ")
            if len(nacked) >= NACKS_ENOUGH:
                break
        # Hold the fault past the core's 1 s tick: the queue must not be retired while writes
        # still fail (it stays readable); its publishes must still be nacked.
        time.sleep(LATE_WAIT_S)
        for i in range(LATE_PUBLISHES):
            publish("%s-late-%d" % (tag, i))
        read("LATE-READ")
    finally:
        write_json(out, sent=sent, confirmed=confirmed, nacked=nacked)
    summary = "sent=%d acked=%d nacked=%d in %.1f s" % (len(sent), len(confirmed), len(nacked),
                                                       time.monotonic() - started)
    say("RESULT " + summary)
    check(not confirmed, "%d publishes acked while every write of the device failed, e.g. %s"
          % (len(confirmed), confirmed[:5]))
    check(len(nacked) == len(sent), "%d publishes, %d nacked" % (len(sent), len(nacked)))
    check(len(nacked) >= NACKS_ENOUGH + LATE_PUBLISHES, "only %d nacks" % len(nacked))
    try:
        state["conn"].close()
    except Exception:
        pass
    return summary


def run_stale_tag():
    events = []  # what connection A saw besides its own calls: basic.cancel, channel/connection close
    m_id = "stale-M"
    declare(QUEUE)
    pub_conn = pika.BlockingConnection(params(5))
    pub = pub_conn.channel()
    pub.confirm_delivery()
    try:
        pub.basic_publish(exchange="", routing_key=QUEUE, body=body(m_id), properties=props(m_id), mandatory=True)
    except px.NackError:
        raise Fail("the first publish (%s) was nacked before any fault" % m_id)

    a_conn = pika.BlockingConnection(params(5))
    a_conn.add_on_connection_blocked_callback(lambda c, f: events.append("A connection.blocked %r" % f.method.reason))
    a = a_conn.channel()
    # BlockingChannel has no close hook of its own; its impl Channel takes more than one
    a._impl.add_on_close_callback(lambda ch, reason: events.append("A channel closed: %r" % (reason,)))
    a.add_on_cancel_callback(lambda frame: events.append("A basic.cancel: %r" % (frame,)))
    method, properties, data = a.basic_get(queue=QUEUE, auto_ack=False)
    check(method is not None, "A: basic.get returned get-empty after %s was confirmed" % m_id)
    check(properties.message_id == m_id and body_ok(m_id, data),
          "A: basic.get returned %r (%d bytes), not %s" % (properties.message_id, len(data), m_id))
    a_tag = method.delivery_tag
    say("HOLDING %s tag=%d redelivered=%s" % (m_id, a_tag, method.redelivered))

    line = sys.stdin.readline()
    check(line.strip() == "fault", "expected 'fault' from the test on stdin, got %r" % line)
    fault_sent, fault_acked, fault_nacked = [], [], []
    while not fault_nacked:
        check(len(fault_sent) < NACKS_ENOUGH, "%d publishes during the store fault, none nacked" % len(fault_sent))
        mid = "fault-%d" % len(fault_sent)
        fault_sent.append(mid)
        try:
            pub.basic_publish(exchange="", routing_key=QUEUE, body=body(mid), properties=props(mid), mandatory=True)
            fault_acked.append(mid)
        except px.NackError:
            fault_nacked.append(mid)
        except (px.ChannelClosedByBroker, px.ConnectionClosedByBroker) as e:
            raise Fail("publish %s during the store fault: closed %d %s (expected basic.nack)"
                       % (mid, e.reply_code, e.reply_text))
    check(not fault_acked, "publishes confirmed while every write of the device failed: %s" % fault_acked)
    say("FAULT-NACKED %s (sent=%d acked=%d)" % (fault_nacked[0], len(fault_sent), len(fault_acked)))
    a_conn.process_data_events(0)

    line = sys.stdin.readline()
    check(line.strip() == "healed", "expected 'healed' from the test on stdin, got %r" % line)
    started = time.monotonic()
    retry_nacks = 0
    while True:
        check(time.monotonic() - started < REOPEN_LIMIT_S, "no publish confirmed within %d s after the fault ended "
              "(%d nacked)" % (REOPEN_LIMIT_S, retry_nacks))
        mid = "after-%d" % retry_nacks
        try:
            pub.basic_publish(exchange="", routing_key=QUEUE, body=body(mid), properties=props(mid), mandatory=True)
            break
        except px.NackError:
            retry_nacks += 1
            pub_conn.sleep(0.25)
    say("REOPENED: %s confirmed %.1f s after the fault ended (%d nacked before)"
        % (mid, time.monotonic() - started, retry_nacks))
    a_conn.process_data_events(0.2)  # anything the retire sent to A (basic.cancel, a close) arrives now
    say("A after the reopen: connection open=%s channel open=%s events=%s" % (a_conn.is_open, a.is_open, events))
    check(a_conn.is_open and a.is_open, "A's channel did not survive the reopen: %s" % events)

    b_conn = pika.BlockingConnection(params(5))
    b = b_conn.channel()
    method, properties, data = b.basic_get(queue=QUEUE, auto_ack=False)
    check(method is not None, "B: basic.get returned get-empty after the reopen (%s was never acked)" % m_id)
    check(properties.message_id == m_id, "B: basic.get after the reopen returned %r first, not %s"
          % (properties.message_id, m_id))
    check(method.redelivered, "B: %s delivered again after the reopen with redelivered=false" % m_id)
    b_tag = method.delivery_tag
    say("B-GOT %s tag=%d redelivered=%s" % (m_id, b_tag, method.redelivered))

    # A's stale tag: its channel still holds it, so no 406; it must settle nothing at the queue.
    a.basic_ack(a_tag)
    # a round trip on A's channel: its ack was handled before the reply (one channel, in order)
    a_count = a.queue_declare(queue=QUEUE, durable=True, passive=True).method.message_count
    check(a_conn.is_open and a.is_open, "A's basic.ack of its tag from before the reopen closed it: %s" % events)
    say("A-ACKED old tag %d (channel open; ready after it=%d)" % (a_tag, a_count))
    pub_conn.sleep(0.3)

    b.basic_nack(b_tag, requeue=True)
    b_count = b.queue_declare(queue=QUEUE, durable=True, passive=True).method.message_count
    say("B-NACKED %s requeue=true (ready after it=%d)" % (m_id, b_count))

    c_conn = pika.BlockingConnection(params(5))
    c = c_conn.channel()
    got = []
    while True:
        method, properties, data = c.basic_get(queue=QUEUE, auto_ack=False)
        if method is None:
            break
        got.append((properties.message_id, method.redelivered))
        c.basic_ack(method.delivery_tag)
    say("AFTER %s" % got)
    check(got, "get-empty after B requeued %s: A's stale tag deleted it" % m_id)
    check(got[0][0] == m_id, "the first basic.get after B requeued %s returned %r; %s is %s"
          % (m_id, got[0][0], m_id, "among the rest" if m_id in [g[0] for g in got] else
             "gone (A's stale tag acked it while B held it)"))
    check(got[0][1], "%s after B's requeue with redelivered=false" % m_id)
    a_conn.process_data_events(0)
    check(a_conn.is_open and a.is_open, "A's channel closed: %s" % events)
    check(not events, "A saw %s" % events)
    for conn in (c_conn, b_conn, a_conn, pub_conn):
        try:
            conn.close()
        except Exception:
            pass
    return "fault: sent=%d acked=%d nacked=%d; after: %d nacked then confirmed; queue then held %d messages, %s first" % (
        len(fault_sent), len(fault_acked), len(fault_nacked), retry_nacks, len(got), got[0][0])


def run_declare_full():
    conn = pika.BlockingConnection(params(5))
    ch = conn.channel()
    try:
        ch.queue_declare(queue=QUEUE, durable=True)
        outcome = "declare-ok"
        conn.close()
    except px.ChannelClosedByBroker as e:
        outcome = "channel closed %d %s" % (e.reply_code, e.reply_text)
        conn.close()
    except px.ConnectionClosedByBroker as e:
        outcome = "connection closed %d %s" % (e.reply_code, e.reply_text)
    except px.AMQPConnectionError as e:
        raise Fail("queue.declare on a full disk: connection lost without a close: %r" % (e,))
    return outcome


def run_drain():
    files = REST
    check(files, "drain needs at least one JSON file")
    sent, confirmed, consumed = set(), set(), set()
    for p in files:
        with open(p) as f:
            r = json.load(f)
        sent |= set(r["sent"])
        confirmed |= set(r["confirmed"])
        consumed |= set(r["consumed"])
    conn = pika.BlockingConnection(params(10))
    ch = conn.channel()
    seen = {}
    bad = []
    deliveries = 0
    while True:
        method, properties, data = ch.basic_get(queue=QUEUE, auto_ack=False)
        if method is None:
            break
        deliveries += 1
        mid = properties.message_id
        if mid not in sent:
            bad.append("delivered %r: not sent in this run, or acked and drained before" % (mid,))
        elif not body_ok(mid, data):
            bad.append("message %s has a wrong body (%d bytes)" % (mid, len(data)))
        if mid in seen and not method.redelivered:
            bad.append("%s delivered again with redelivered=false" % mid)
        if mid in consumed and not method.redelivered:
            bad.append("%s was consumed and acked before, delivered again with redelivered=false" % mid)
        seen[mid] = seen.get(mid, 0) + 1
        ch.basic_ack(method.delivery_tag)
    left = ch.queue_declare(queue=QUEUE, durable=True, passive=True).method.message_count
    conn.close()
    missing = sorted(confirmed - consumed - set(seen))
    summary = "deliveries=%d distinct=%d expected=%d missing=%d left=%d" % (
        deliveries, len(seen), len(confirmed - consumed), len(missing), left)
    say("RESULT " + summary)
    check(not missing, "%d confirmed messages lost, e.g. %s" % (len(missing), missing[:10]))
    check(not bad, "%d problems: %s" % (len(bad), "; ".join(bad[:8])))
    check(left == 0, "%d messages left after get-empty" % left)
    return summary


def _alarm(signum, frame):
    raise Fail("did not finish within %d s" % TIME_LIMIT)


if __name__ == "__main__":
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIME_LIMIT)
    name = "disk-full-" + MODE
    try:
        summary = {"fill": run_fill, "publish": run_publish, "publish-full": run_publish_full,
                   "publish-retry": run_publish_retry, "publish-fault": run_publish_fault,
                   "declare-full": run_declare_full, "stale-tag": run_stale_tag,
                   "drain": run_drain}[MODE]()
        print("PASS %s %s" % (name, summary))
        rc = 0
    except Fail as e:
        print("FAIL %s: %s" % (name, e))
        rc = 1
    except Exception as e:  # protocol surprises are failures, not crashes
        print("FAIL %s: unexpected %s: %r" % (name, type(e).__name__, e))
        rc = 1
    sys.stdout.flush()
    sys.exit(rc)
