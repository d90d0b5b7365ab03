#!/usr/bin/env python3
"""ringmq cluster acceptance check: kill nodes under load, count what was lost.

What it does
------------
1. Starts three ringmq nodes on loopback, as in the README's "Cluster" example: node i
   (1..3) listens for AMQP on BASE+i-1 (5672, 5673, 5674), for metrics on
   METRICS_BASE+i-1 (15692..15694) and for its Raft transport on CLUSTER_BASE+i-1
   (25672..25674), with a fresh data dir under one temp dir. Each node's stdout and
   stderr go to <tmp>/nodeN.log (appended across restarts).
2. Waits until every node completes a real AMQP handshake (pika connection open; a bare
   TCP connect proves nothing: a connect to a free loopback port can connect to itself).
3. Declares one durable queue (--queue, default "acceptance") through node 1, so the
   queue's home node is node 1.
4. Runs, each in its own thread,
   - a publisher connected to node 1: persistent (delivery_mode=2), publisher confirms,
     mandatory=True, bodies "<run-id> <seq> <node it was published on>"; a publish is
     *confirmed* only if basic_publish returned normally (a nack, a basic.return or an
     exception means not confirmed); the time of every confirm is recorded;
   - a manual-ack consumer (prefetch 100) connected to node 2, which acks every delivery
     and counts unique sequence numbers, duplicates, redeliveries, and deliveries
     published on a node other than the one it consumes from.
   When a connection breaks (or the consumer is cancelled by the broker), the thread
   reconnects to the next node round-robin (1 -> 2 -> 3 -> 1), retrying with waits of
   0.2 s doubling to 2 s. A broker that stops answering an RPC (confirm, consume-ok, ...)
   for --rpc-timeout seconds gets the socket shut down under the client, which then
   reconnects: no wait in this script is unbounded.
5. --kills times (default 9): node (i % 3) + 1 gets SIGKILL, stays down --down seconds
   (3), is restarted with the same flags and data dir, must serve AMQP again within
   --start-timeout, then load runs for --between seconds (5).
6. Stops the publisher, lets the consumer drain until nothing new arrived for
   --drain-idle seconds (10), at most --drain-timeout seconds (120), and prints the
   summary: published, confirmed, received (unique), duplicates, redelivered,
   confirmed-but-lost (confirmed sequence numbers never received; the first ones
   listed), per kill the seconds from the kill to the first confirm after it, and whether
   messages flowed between nodes.

Exit status: 0 when no confirmed message was lost and every kill was followed by a confirm
within --confirm-within seconds (10); 1 otherwise (including a node that did not start or
exited on its own, which is reported). On every exit (also Ctrl-C, SIGTERM or an
exception) the three nodes are stopped and the temp dir removed, unless --keep; when the
check fails, the node logs are kept and their paths printed (the data dirs are removed
unless --keep).

Until queue messages are replicated, a queue lives only on its home node (node 1 here):
while node 1 is down its publishes are nacked and its consumers cancelled, so missing
confirms after the kills of node 1 are expected and reported as a FAIL, not hidden.

Usage
-----
    python3 -m pip install -q pika==1.3.2
    cargo build --release --bin ringmq
    python3 bench/cluster/acceptance.py                       # 9 kills, target/release/ringmq
    python3 bench/cluster/acceptance.py --kills 3 --ringmq /path/to/ringmq --json
    python3 bench/cluster/acceptance.py --base-port 6672      # 6672-6674, 16692-.., 26672-..
    python3 bench/cluster/acceptance.py --help                # every option

With --json, one JSON object goes to stdout and the human summary to stderr. Progress
lines always go to stderr.
"""

import argparse
import bisect
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

try:
    import pika
    import pika.exceptions as pex
except ImportError:  # pragma: no cover - environment problem, explained to the user
    sys.exit("acceptance.py: needs pika: python3 -m pip install -q pika==1.3.2")

HOST = "127.0.0.1"
T0 = time.monotonic()


def now():
    return time.monotonic()


def log(msg):
    print(f"[{now() - T0:7.2f}s] {msg}", file=sys.stderr, flush=True)


class Failure(Exception):
    """Setup failed (a node did not start, a port is taken, the declare failed)."""


# --------------------------------------------------------------------------------------
# Bounded RPCs: a watchdog shuts the socket of a connection whose RPC is overdue.
# --------------------------------------------------------------------------------------

class Guard:
    """Marks when its thread entered a blocking pika call on `conn`.

    pika's BlockingConnection has no per-call timeout: basic_publish with confirms waits
    for the ack as long as the broker keeps the connection alive. The watchdog thread
    calls abort() when a call has been busy longer than `limit`; shutting the socket down
    (safe from another thread, unlike any pika method) makes the blocked call raise
    StreamLostError in its own thread, which then reconnects.
    """

    def __init__(self, name, limit):
        self.name = name
        self.limit = limit
        self.conn = None
        self.busy_since = None
        self.what = None
        self.aborts = 0

    @contextlib.contextmanager
    def busy(self, what):
        self.what = what
        self.busy_since = now()
        try:
            yield
        finally:
            self.busy_since = None

    def overdue(self):
        since = self.busy_since
        return since is not None and now() - since > self.limit

    def abort(self):
        conn = self.conn
        try:
            sock = conn._impl._transport._sock  # pika 1.3 internals; see class docstring
            sock.shutdown(socket.SHUT_RDWR)
        except Exception:  # already closed or not connected yet: nothing to abort
            return False
        self.aborts += 1
        return True


class Watchdog(threading.Thread):
    def __init__(self, guards, stop):
        super().__init__(name="watchdog", daemon=True)
        self.guards = guards
        self.stop = stop

    def run(self):
        while not self.stop.wait(0.25):
            for g in list(self.guards):
                if g.overdue() and g.abort():
                    log(f"{g.name}: {g.what} unanswered for {g.limit:.0f} s: connection aborted")
                    g.busy_since = None


# --------------------------------------------------------------------------------------
# Nodes
# --------------------------------------------------------------------------------------

class Node:
    def __init__(self, idx, opts, root, peers):
        self.idx = idx
        self.amqp_port = opts.base_port + idx - 1
        self.metrics_port = opts.metrics_base_port + idx - 1
        self.cluster_port = opts.cluster_base_port + idx - 1
        self.data_dir = os.path.join(root, f"d{idx}")
        self.log_path = os.path.join(root, f"node{idx}.log")
        self.binary = opts.ringmq
        self.peers = peers
        self.extra = []
        if opts.cores:
            self.extra += ["--cores", str(opts.cores)]
        for a in opts.node_arg or []:
            self.extra += a.split()
        self.proc = None
        self.starts = 0
        self.expected_down = False

    def argv(self):
        return [self.binary,
                "--node-id", str(self.idx),
                "--listen", f"{HOST}:{self.amqp_port}",
                "--metrics-listen", f"{HOST}:{self.metrics_port}",
                "--cluster-listen", f"{HOST}:{self.cluster_port}",
                "--data-dir", self.data_dir,
                "--peers", self.peers] + self.extra

    def start(self):
        os.makedirs(self.data_dir, exist_ok=True)
        self.starts += 1
        with open(self.log_path, "ab") as f:
            f.write(f"=== start #{self.starts} at +{now() - T0:.2f}s: {' '.join(self.argv())}\n".encode())
            f.flush()
            # Own session: a Ctrl-C in the terminal reaches this script, which stops the
            # nodes itself, and not the nodes half-way through.
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.expected_down = False

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill(self):
        self.expected_down = True
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def stop(self):
        """TERM (graceful), then KILL after 10 s; bounded."""
        self.expected_down = True
        if not self.alive():
            return
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log_tail(self, n=15):
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode(errors="replace").splitlines()
            return "\n".join("      " + l for l in lines[-n:])
        except OSError:
            return "      (no log)"


def port_has_listener(port):
    """True when something already listens on HOST:port (bind with SO_REUSEADDR fails
    on Linux only for a listening socket, not for connections in TIME_WAIT)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((HOST, port))
        return False
    except OSError:
        return True
    finally:
        s.close()


def conn_params(port, name, timeout=5.0, heartbeat=10):
    return pika.ConnectionParameters(
        host=HOST, port=port, credentials=pika.PlainCredentials("guest", "guest"),
        heartbeat=heartbeat, connection_attempts=1, retry_delay=0,
        socket_timeout=timeout, stack_timeout=timeout, blocked_connection_timeout=30,
        client_properties={"connection_name": name})


def amqp_handshake(port, timeout=3.0):
    """A full AMQP handshake (protocol header, start/tune/open), then close."""
    conn = pika.BlockingConnection(conn_params(port, "acceptance-probe", timeout))
    try:
        return conn.is_open
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def wait_serving(node, timeout):
    """Seconds until `node` completes an AMQP handshake; Failure if it exits or times out."""
    start = now()
    deadline = start + timeout
    last = None
    while now() < deadline:
        if not node.alive():
            raise Failure(f"node {node.idx} exited (status {node.proc.returncode}) before serving AMQP; "
                          f"log {node.log_path}:\n{node.log_tail()}")
        try:
            if amqp_handshake(node.amqp_port, timeout=min(3.0, max(0.5, deadline - now()))):
                return now() - start
        except Exception as e:  # refused, reset, handshake not finished yet
            last = e
        time.sleep(0.2)
    raise Failure(f"node {node.idx} did not serve AMQP on {HOST}:{node.amqp_port} within {timeout:.0f} s "
                  f"(last error: {last!r}); log {node.log_path}:\n{node.log_tail()}")


# --------------------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------------------

class Client(threading.Thread):
    """A client that keeps one connection and moves to the next node when it breaks."""

    def __init__(self, name, ports, first, guard, stop):
        super().__init__(name=name, daemon=True)
        self.ports = ports
        self.node = first  # 0-based index of the node it is (or will be) connected to
        self.guard = guard
        self.stop = stop
        self.connects = 0
        self.breaks = 0
        self.errors = {}  # exception type -> count
        self.first_errors = []
        self.crashed = None
        self._last_line = None
        self._repeats = 0
        self.announce = False

    def say(self, line, key):
        """Logs `line`, folding a run of lines with the same `key` (e.g. the 404 every node
        answers while the queue's home node is down) into one count."""
        if key == self._last_line:
            self._repeats += 1
            return
        if self._repeats:
            log(f"{self.name}: (the same {self._repeats} more times)")
        self._last_line, self._repeats = key, 0
        log(f"{self.name}: {line}")

    def note_error(self, where, e):
        key = f"{where}: {type(e).__name__}"
        self.errors[key] = self.errors.get(key, 0) + 1
        if len(self.first_errors) < 8:
            self.first_errors.append(f"+{now() - T0:.2f}s node {self.node + 1} {where}: {e!r}")

    def run(self):
        try:
            self._run()
        except Exception as e:  # a bug in this script: report it, do not hang
            self.crashed = repr(e)
            log(f"{self.name}: crashed: {e!r}")

    def _run(self):
        backoff = 0.2
        while not self.stop.is_set():
            port = self.ports[self.node]
            try:
                conn = pika.BlockingConnection(conn_params(port, f"acceptance-{self.name}"))
            except Exception as e:
                self.note_error("connect", e)
                self.node = (self.node + 1) % len(self.ports)
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            self.connects += 1
            self.guard.conn = conn
            connected_at = now()
            self.announce = self.connects > 1  # log the first success of this session
            try:
                self.session(conn)
            except Exception as e:
                self.breaks += 1
                self.note_error("session", e)
                what = f"{type(e).__name__}: {str(e)[:110]}"
                self.say(f"dropped by node {self.node + 1} after {now() - connected_at:.1f} s: {what}", what)
            finally:
                self.guard.conn = None
                with contextlib.suppress(Exception):
                    if conn.is_open:
                        conn.close()
            # A session that ended at once (e.g. 404 while the queue's home is down) keeps
            # the backoff growing; one that ran a while starts again from 0.2 s.
            if now() - connected_at > 2.0:
                backoff = 0.2
            if self.stop.is_set():
                break
            self.node = (self.node + 1) % len(self.ports)
            self.stop.wait(backoff)
            backoff = min(backoff * 2, 2.0)

    def session(self, conn):
        raise NotImplementedError

    def working(self, what):
        if self.announce:
            self.announce = False
            self.say(f"{what} through node {self.node + 1}", None)


def paced(conn, rate, stop):
    """Yields once per publish due at `rate` a second (0: at once, each time) until `stop`
    is set, sleeping through `conn.sleep` (which services heartbeats). Far behind (a stall of
    over 1 s), it starts over from now instead of bursting to catch up."""
    interval = 1.0 / rate if rate > 0 else 0.0
    due = now()
    while not stop.is_set():
        if interval:
            due += interval
            wait = due - now()
            if wait > 0:
                conn.sleep(wait)
            elif wait < -1.0:
                due = now()
        yield


class Publisher(Client):
    def __init__(self, ports, queue, run_id, rate, guard, stop):
        super().__init__("publisher", ports, 0, guard, stop)
        self.queue = queue
        self.run_id = run_id
        self.rate = rate
        self.seq = 0
        self.confirmed = {}  # seq -> monotonic time of its confirm
        self.nacked = 0
        self.unroutable = 0
        self.failed = 0  # raised: connection or channel lost while waiting for the confirm
        self.props = pika.BasicProperties(delivery_mode=2)

    def counters(self):
        return {"published": self.seq, "confirmed": len(self.confirmed), "nacked": self.nacked,
                "unroutable": self.unroutable, "failed": self.failed}

    def session(self, conn):
        with self.guard.busy("channel.open/confirm.select"):
            ch = conn.channel()
            ch.confirm_delivery()
        for _ in paced(conn, self.rate, self.stop):
            self.seq += 1
            seq = self.seq
            body = f"{self.run_id} {seq} {self.node + 1}".encode()
            try:
                with self.guard.busy(f"confirm of #{seq}"):
                    ch.basic_publish("", self.queue, body, self.props, mandatory=True)
            except pex.UnroutableError:
                self.unroutable += 1
                continue
            except pex.NackError:
                self.nacked += 1
                continue
            except Exception:
                self.failed += 1
                raise
            self.confirmed[seq] = now()
            self.working("confirms again")


class Consumer(Client):
    def __init__(self, ports, queue, run_id, prefetch, guard, stop):
        super().__init__("consumer", ports, 1, guard, stop)
        self.queue = queue
        self.run_id = run_id
        self.prefetch = prefetch
        self.seen = {}  # seq -> deliveries
        self.deliveries = 0
        self.duplicates = 0
        self.redelivered = 0
        self.foreign = 0
        self.cross_node = 0
        self.flows = {}  # "published on -> consumed on" -> count
        self.cancels = 0
        self.last_rx = None

    class Cancelled(Exception):
        pass

    def on_message(self, ch, method, props, body):
        self.last_rx = now()
        self.deliveries += 1
        if method.redelivered:
            self.redelivered += 1
        parts = body.split()
        if len(parts) == 3 and parts[0].decode(errors="replace") == self.run_id:
            seq, pub_node = int(parts[1]), int(parts[2])
            n = self.seen.get(seq, 0)
            if n:
                self.duplicates += 1
            self.seen[seq] = n + 1
            if pub_node != self.node + 1:
                self.cross_node += 1
            key = f"{pub_node}->{self.node + 1}"
            self.flows[key] = self.flows.get(key, 0) + 1
        else:
            self.foreign += 1
        ch.basic_ack(method.delivery_tag)
        self.working("receives again")

    def session(self, conn):
        cancelled = []
        with self.guard.busy("channel.open/basic.qos/basic.consume"):
            ch = conn.channel()
            ch.add_on_cancel_callback(lambda frame: cancelled.append(frame))
            ch.basic_qos(prefetch_count=self.prefetch)
            ch.basic_consume(self.queue, self.on_message, auto_ack=False)
        while not self.stop.is_set():
            conn.process_data_events(time_limit=0.5)
            if cancelled:
                self.cancels += 1
                raise Consumer.Cancelled("basic.cancel from the broker")


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None and False (their help says what happens)."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " (see the top of this file)",
                                formatter_class=HelpFormatter)
    p.add_argument("--ringmq", default="target/release/ringmq", help="ringmq binary")
    p.add_argument("--base-port", type=int, default=5672, help="AMQP port of node 1 (nodes 2, 3: +1, +2)")
    p.add_argument("--metrics-base-port", type=int, default=None,
                   help="metrics port of node 1 (default: base port + 10020, i.e. 15692)")
    p.add_argument("--cluster-base-port", type=int, default=None,
                   help="cluster (Raft) port of node 1 (default: base port + 20000, i.e. 25672)")
    p.add_argument("--queue", default="acceptance", help="durable queue declared via node 1")
    p.add_argument("--kills", type=int, default=9, help="SIGKILLs, node (i %% 3) + 1 each")
    p.add_argument("--down", type=float, default=3.0, help="seconds a killed node stays down")
    p.add_argument("--between", type=float, default=5.0,
                   help="seconds of load after a restarted node serves again (also before the first kill)")
    p.add_argument("--rate", type=float, default=200.0, help="publishes per second, 0 = as fast as confirms come")
    p.add_argument("--prefetch", type=int, default=100, help="consumer prefetch")
    p.add_argument("--confirm-within", type=float, default=10.0,
                   help="pass only if every kill is followed by a confirm within this many seconds")
    p.add_argument("--start-timeout", type=float, default=60.0, help="seconds for a node to serve AMQP")
    p.add_argument("--rpc-timeout", type=float, default=15.0,
                   help="seconds a client waits for one broker reply (e.g. a confirm) before it drops the connection")
    p.add_argument("--drain-idle", type=float, default=10.0, help="drain ends after this many seconds without a delivery")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="longest drain, seconds")
    p.add_argument("--cores", type=int, default=None, help="--cores for each node (default: the node's own default, all CPUs)")
    p.add_argument("--node-arg", action="append", help="extra flags for every node, e.g. --node-arg='--log debug'")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (data dirs and logs)")
    p.add_argument("--json", action="store_true", help="JSON result on stdout, summary on stderr")
    p.add_argument("--verbose", action="store_true", help="show pika's own log")
    o = p.parse_args(argv)
    if o.metrics_base_port is None:
        o.metrics_base_port = o.base_port + 10020
    if o.cluster_base_port is None:
        o.cluster_base_port = o.base_port + 20000
    return o


def snapshot(d):
    """A copy of a dict another thread may still be filling (a client that did not stop
    in time): retried while the copy races with an insertion."""
    for _ in range(100):
        try:
            return dict(d)
        except RuntimeError:
            time.sleep(0.01)
    return {}


def sigterm_to_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def wait_load(seconds, nodes, result, stop_on=None):
    """Sleep `seconds`, watching for nodes that exit although nobody killed them: such a
    node is recorded (the check fails) and restarted so that the run can go on."""
    end = now() + seconds
    while now() < end:
        time.sleep(min(0.25, max(0.0, end - now())))
        for n in nodes:
            if not n.expected_down and not n.alive():
                msg = f"node {n.idx} exited on its own (status {n.proc.returncode}) at +{now() - T0:.2f}s"
                log(msg + f"; log {n.log_path}; restarting it")
                result["unexpected_exits"].append(msg)
                n.start()
                try:
                    wait_serving(n, result["_start_timeout"])
                except Failure as e:
                    n.expected_down = True  # recorded; do not restart it again and again
                    result["unexpected_exits"].append(f"node {n.idx} restart failed: {str(e).splitlines()[0]}")
                    log(str(e))


def run(opts):
    result = {"ok": False, "unexpected_exits": [], "kills": [], "setup_error": None,
              "_start_timeout": opts.start_timeout}
    binary = opts.ringmq
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        raise Failure(f"no executable ringmq at {binary!r} (build it: cargo build --release --bin ringmq, or give --ringmq)")
    opts.ringmq = os.path.abspath(binary)

    nodes_ports = [(opts.base_port + i, opts.metrics_base_port + i, opts.cluster_base_port + i) for i in range(3)]
    busy = [p for trio in nodes_ports for p in trio if port_has_listener(p)]
    if busy:
        raise Failure(f"ports already in use on {HOST}: {busy} (another broker? use --base-port)")

    root = tempfile.mkdtemp(prefix="ringmq-acceptance-")
    result["workdir"] = root
    peers = ",".join(f"{i + 1}={HOST}:{opts.cluster_base_port + i}" for i in range(3))
    nodes = [Node(i + 1, opts, root, peers) for i in range(3)]
    result["logs"] = [n.log_path for n in nodes]
    stop_pub = threading.Event()  # the publisher stops first,
    stop_con = threading.Event()  # the consumer after the drain
    stop_watchdog = threading.Event()
    guards = []
    pub = con = None
    state = {"root": root, "nodes": nodes}
    try:
        log(f"workdir {root}; binary {opts.ringmq}")
        for n in nodes:
            log(f"starting node {n.idx}: AMQP {n.amqp_port}, metrics {n.metrics_port}, cluster {n.cluster_port}")
            n.start()
        for n in nodes:
            took = wait_serving(n, opts.start_timeout)
            log(f"node {n.idx} serves AMQP ({took:.2f} s)")

        declare_guard = Guard("declare", opts.rpc_timeout)
        guards.append(declare_guard)
        Watchdog(guards, stop_watchdog).start()
        conn = pika.BlockingConnection(conn_params(nodes[0].amqp_port, "acceptance-declare"))
        declare_guard.conn = conn
        try:
            with declare_guard.busy("queue.declare"):
                conn.channel().queue_declare(opts.queue, durable=True)
        finally:
            declare_guard.conn = None
            with contextlib.suppress(Exception):
                conn.close()
        log(f"declared durable queue {opts.queue!r} via node 1 (its home node)")

        run_id = uuid.uuid4().hex[:12]
        ports = [n.amqp_port for n in nodes]
        pub_guard, con_guard = Guard("publisher", opts.rpc_timeout), Guard("consumer", opts.rpc_timeout)
        guards += [pub_guard, con_guard]
        pub = Publisher(ports, opts.queue, run_id, opts.rate, pub_guard, stop_pub)
        con = Consumer(ports, opts.queue, run_id, opts.prefetch, con_guard, stop_con)
        state["pub"], state["con"] = pub, con
        con.start()
        pub.start()
        load_start = now()
        wait_load(opts.between, nodes, result)
        log(f"load running: {len(pub.confirmed)} confirmed, {len(con.seen)} received")

        for i in range(opts.kills):
            n = nodes[i % 3]
            rec = {"kill": i + 1, "node": n.idx, "queue_home": n.idx == 1}
            before = pub.counters()
            t_kill = now()
            rec["t"] = round(t_kill - load_start, 3)
            log(f"kill {i + 1}/{opts.kills}: SIGKILL node {n.idx}{' (the queue home)' if n.idx == 1 else ''}")
            n.kill()
            wait_load(opts.down, nodes, result)
            n.start()
            try:
                took = wait_serving(n, opts.start_timeout)
            except Failure as e:
                rec["restart_error"] = str(e).splitlines()[0]
                n.expected_down = True  # not restarted again by wait_load
                result["kills"].append(rec)
                rec["_t_kill"] = t_kill
                log(f"kill {i + 1}: {rec['restart_error']}: no more kills")
                break
            rec["restart_to_serving_s"] = round(took, 3)
            rec["kill_to_serving_s"] = round(now() - t_kill, 3)
            log(f"node {n.idx} back, serving {took:.2f} s after its restart")
            wait_load(opts.between, nodes, result)
            after = pub.counters()
            rec["window"] = {k: after[k] - before[k] for k in after}
            rec["_t_kill"] = t_kill
            result["kills"].append(rec)
            log(f"  since the kill: {rec['window']}")

        log("stopping the publisher")
        stop_pub_at = now()
        stop_pub.set()
        pub.join(timeout=opts.rpc_timeout + 10)
        if pub.is_alive():
            log("publisher did not stop in time (counted as it is)")
        drain_start = now()
        log(f"draining: until {opts.drain_idle:.0f} s without a delivery, at most {opts.drain_timeout:.0f} s")
        confirmed = snapshot(pub.confirmed)
        confirmed_set = set(confirmed)
        while now() - drain_start < opts.drain_timeout:
            last = max(con.last_rx or 0.0, stop_pub_at)
            if now() - last >= opts.drain_idle:
                break
            wait_load(0.5, nodes, result)
        drained = now() - drain_start
        result["drain_s"] = round(drained, 2)
        result["drain_timed_out"] = drained >= opts.drain_timeout
        stop_con.set()
        con.join(timeout=opts.rpc_timeout + 5)

        # ---- figures ----
        if con.is_alive():
            log("consumer did not stop in time (counted as it is)")
        seen = snapshot(con.seen)
        lost = sorted(s for s in confirmed_set if s not in seen)
        received_unconfirmed = sum(1 for s in seen if s not in confirmed_set)
        confirm_times = sorted(confirmed.values())
        for rec in result["kills"]:
            t_kill = rec.pop("_t_kill")
            j = bisect.bisect_left(confirm_times, t_kill)
            rec["first_confirm_after_s"] = round(confirm_times[j] - t_kill, 3) if j < len(confirm_times) else None
            fc = rec["first_confirm_after_s"]
            rec["ok"] = fc is not None and fc <= opts.confirm_within and "restart_error" not in rec
        result.update({
            "run_id": run_id,
            "queue": opts.queue,
            "kills_requested": opts.kills,
            "published": pub.seq,
            "confirmed": len(confirmed_set),
            "nacked": pub.nacked,
            "unroutable": pub.unroutable,
            "publish_failed": pub.failed,
            "received": len(seen),
            "deliveries": con.deliveries,
            "duplicates": con.duplicates,
            "redelivered": con.redelivered,
            "foreign": con.foreign,
            "confirmed_but_lost": len(lost),
            "lost_first": lost[:20],
            "received_unconfirmed": received_unconfirmed,
            "cross_node_deliveries": con.cross_node,
            "flowed_between_nodes": con.cross_node > 0,
            "flows": dict(sorted(con.flows.items())),
            "publisher": {"connects": pub.connects, "breaks": pub.breaks, "rpc_aborts": pub_guard.aborts,
                          "errors": pub.errors, "first_errors": pub.first_errors, "crashed": pub.crashed},
            "consumer": {"connects": con.connects, "breaks": con.breaks, "cancels": con.cancels,
                         "rpc_aborts": con_guard.aborts, "errors": con.errors,
                         "first_errors": con.first_errors, "crashed": con.crashed},
        })
        reasons = []
        if lost:
            reasons.append(f"{len(lost)} confirmed messages lost")
        bad = [r for r in result["kills"] if not r["ok"]]
        if bad:
            reasons.append(f"{len(bad)} of {len(result['kills'])} kills without a confirm within {opts.confirm_within:g} s")
        if len(result["kills"]) < opts.kills:
            reasons.append(f"only {len(result['kills'])} of {opts.kills} kills done")
        if result["unexpected_exits"]:
            reasons.append(f"{len(result['unexpected_exits'])} unexpected node exits")
        if pub.crashed or con.crashed:
            reasons.append("a client thread crashed")
        if len(confirmed_set) == 0:
            reasons.append("nothing was confirmed")
        result["fail_reasons"] = reasons
        result["ok"] = not reasons
        return result
    finally:
        stop_pub.set()
        stop_con.set()
        for n in nodes:
            with contextlib.suppress(Exception):
                n.stop()
        stop_watchdog.set()
        result.pop("_start_timeout", None)
        cleanup_state.update(state)


cleanup_state = {}


def cleanup(opts, ok):
    """Stops the nodes (again: run() did, unless interrupted half-way) and removes the temp
    dir; when the check failed, keeps the node logs and prints their paths. --keep keeps all."""
    root = cleanup_state.get("root")
    nodes = cleanup_state.get("nodes", [])
    for n in nodes:
        with contextlib.suppress(Exception):
            n.stop()
    if not root or not os.path.isdir(root):
        return
    if opts.keep:
        print(f"kept {root}", file=sys.stderr)
        return
    if ok:
        shutil.rmtree(root, ignore_errors=True)
        return
    for n in nodes:
        shutil.rmtree(n.data_dir, ignore_errors=True)
    print("node logs (kept for the failure):", file=sys.stderr)
    for n in nodes:
        print(f"  node {n.idx}: {n.log_path}", file=sys.stderr)


def summary(r, opts):
    out = []
    add = out.append
    add(f"ringmq cluster acceptance: 3 nodes, queue {r['queue']!r} (home node 1), "
        f"{len(r['kills'])}/{r['kills_requested']} kills, {opts.down:g} s down, {opts.between:g} s between")
    add(f"  published            {r['published']}")
    add(f"  confirmed            {r['confirmed']}   (nacked {r['nacked']}, unroutable {r['unroutable']}, "
        f"failed {r['publish_failed']})")
    add(f"  received (unique)    {r['received']}   ({r['deliveries']} deliveries; "
        f"{r['received_unconfirmed']} received without a confirm; foreign {r['foreign']})")
    add(f"  duplicates           {r['duplicates']}")
    add(f"  redelivered          {r['redelivered']}")
    lost_list = ", ".join(str(s) for s in r["lost_first"][:10])
    add(f"  confirmed-but-lost   {r['confirmed_but_lost']}" + (f"   first: {lost_list}" if lost_list else ""))
    flows = ", ".join(f"{k}: {v}" for k, v in r["flows"].items())
    add(f"  between nodes        {'yes' if r['flowed_between_nodes'] else 'NO'}: "
        f"{r['cross_node_deliveries']} deliveries consumed on another node than published ({flows})")
    add(f"  drain                {r['drain_s']} s{' (timed out)' if r['drain_timed_out'] else ''}")
    p, c = r["publisher"], r["consumer"]
    add(f"  publisher            {p['connects']} connects, {p['breaks']} breaks, {p['rpc_aborts']} RPC timeouts")
    add(f"  consumer             {c['connects']} connects, {c['breaks']} breaks, {c['cancels']} cancels, "
        f"{c['rpc_aborts']} RPC timeouts")
    for k in r["kills"]:
        fc = k.get("first_confirm_after_s")
        fc_text = f"{fc:.2f} s" if fc is not None else "never"
        serving = (f"serving {k['kill_to_serving_s']:.2f} s after the kill" if "kill_to_serving_s" in k
                   else f"RESTART FAILED: {k.get('restart_error')}")
        w = k.get("window", {})
        wtext = (f"; until the next kill: {w.get('confirmed', 0)} confirmed, {w.get('nacked', 0)} nacked, "
                 f"{w.get('failed', 0)} failed" if w else "")
        add(f"  kill {k['kill']}: node {k['node']}{' (queue home)' if k['queue_home'] else '             '} "
            f"first confirm after {fc_text:>8}  {'ok' if k['ok'] else 'FAIL'}; {serving}{wtext}")
    for e in r["unexpected_exits"]:
        add(f"  UNEXPECTED: {e}")
    for who in ("publisher", "consumer"):
        if r[who]["crashed"]:
            add(f"  {who} thread crashed: {r[who]['crashed']}")
    add("RESULT: PASS" if r["ok"] else "RESULT: FAIL: " + "; ".join(r["fail_reasons"]))
    return "\n".join(out)


def main(argv=None):
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    if not opts.verbose:
        logging.getLogger("pika").setLevel(logging.CRITICAL)
    signal.signal(signal.SIGTERM, sigterm_to_interrupt)
    # Also when started with SIGINT ignored (a background job of a script): Ctrl-C or
    # kill -INT must still stop the nodes.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ok = False
    interrupted = False
    try:
        try:
            result = run(opts)
        except Failure as e:
            log(f"ERROR: {e}")
            result = {"ok": False, "setup_error": str(e)}
        except KeyboardInterrupt as e:
            log(f"interrupted ({str(e) or 'Ctrl-C'}): stopping the nodes")
            result = {"ok": False, "setup_error": "interrupted"}
            interrupted = True
        except Exception as e:
            log(f"ERROR: unexpected {type(e).__name__}: {e}")
            result = {"ok": False, "setup_error": f"{type(e).__name__}: {e}"}
        ok = result["ok"]
        human = sys.stderr if opts.json else sys.stdout
        if "published" in result:
            print(summary(result, opts), file=human, flush=True)
        else:
            print(f"RESULT: FAIL: {result.get('setup_error')}", file=human, flush=True)
        if opts.json:
            print(json.dumps(result, sort_keys=True), flush=True)
    finally:
        cleanup(opts, ok or interrupted)  # interrupted: nothing to look at, remove it all
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
