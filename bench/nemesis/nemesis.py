#!/usr/bin/env python3
"""ringmq nemesis: partitions of every shape, kill -9 and SIGSTOP under load, from a seed,
with a history of every publish, confirm and delivery, a checker and a plot.

What it does
------------
1. Starts proxy.py (a TCP proxy per directed link i->j, six of them) and three ringmq nodes
   on loopback (free ports, --cores 1, --replicas 3, management off, fresh data dirs in one
   temp dir, <tmp>/nodeN.log each, appended across restarts). Node i's --peers names itself
   at its real --cluster-listen and node j at the proxy of link i->j: every connection node
   i dials to node j (its raft, data and snapshot lanes to j; each lane carries data one way,
   from its dialer) runs through the link i->j, so faulting i->j alone cuts what i sends to j
   and nothing j sends to i.
2. Declares --queues durable queues (x-quorum-initial-group-size 3), queue k through node
   (k mod 3) + 1, so their first servers differ.
3. Runs --publishers publishers (publisher k starts on node ((k-1) mod 3) + 1 and publishes
   to queue k mod --queues at --rate msgs/s, confirms, persistent, mandatory, a unique id in
   the body and message_id) and --consumers manual-ack consumers (one per node at first,
   each consuming every queue). On any error a client reconnects to the next node; every
   blocking call is bounded (bench/cluster/acceptance.py's Guard: the socket is shut down
   under a call unanswered for --answer-limit + 5 s, 15 s for other calls).
4. Draws the fault plan from random.Random(--seed), prints it and saves it (plan.json):
   after --warmup seconds, one fault at a time, --gap seconds (MIN:MAX) after the previous
   heal, each held --hold seconds (MIN:MAX), until --duration seconds of load. The same seed
   gives the same plan; kinds come in shuffled rounds, so every 8 faults cover every kind:
     isolate         every link to and from one node cut (a partition mode, below)
     isolate-leader  the same for the metadata (Raft) leader, read from /metrics
     bridge          nodes A and C cut from each other, both still linked with B
     one-way         one directed link A->B cut: A's lanes to B; B still reaches A
     flap            the links between two nodes cut and restored every 0.5-1 s
     kill            SIGKILL of a node, restarted with the same flags and data dir
     pause-leader    SIGSTOP of the metadata leader, SIGCONT after the hold
     delay           every link to and from one node delays each chunk 20-300 ms
   Partition modes: blackhole (connections stay open, bytes dropped both ways; those that
   dropped bytes are reset at the heal), stall (nothing read: backpressure, no loss), reset
   (connections reset, new ones reset at once).
5. Heals everything, lets load run to --duration, stops the publishers, drains the consumers
   (until --drain-idle s without a delivery, at most --drain-timeout s), stops everything.
6. Checks the history (check.py: lost, duplicates, minority confirms, double confirms,
   unanswered publishes, time to an ack after each fault and heal) and writes, in --out: history.jsonl, plan.json,
   summary.json and report.html (confirms per second per node, confirm latency, the faults
   as bands, the summary).

Exit status: 0 when check.py passes (no confirmed message lost, no confirm from a node cut
from the majority for over 2 s, every publish answered within --answer-limit, no node exited
on its own, something confirmed); 1 otherwise; 2 on a setup error. Every process it starts
is stopped on every exit path (atexit, SIGTERM, SIGINT, SIGHUP; and the nodes and the proxy
get SIGKILL if this process dies); the temp dir is removed unless --keep, or on failure,
when the node logs are kept and their paths printed.

Usage
-----
    cargo build --release --bin ringmq
    python3 bench/nemesis/nemesis.py --seed 1 --duration 600 --ringmq target/release/ringmq --out /tmp/nemesis-1
    python3 bench/nemesis/check.py /tmp/nemesis-1/history.jsonl     # the checker alone
    python3 bench/nemesis/nemesis.py --help                          # every option

Progress lines go to stderr, the JSON summary to stdout.
"""

import argparse
import atexit
import datetime
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid

from nodes import Cluster, Failure, acceptance, log, now, wait_serving
import check
import faults
import plot
import workload


def span(text):
    """"MIN:MAX" -> (min, max) floats."""
    lo, _, hi = text.partition(":")
    lo, hi = float(lo), float(hi or lo)
    if not 0 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX with 0 <= MIN <= MAX, got {text!r}")
    return lo, hi


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " (see the top of this file)",
                                formatter_class=acceptance.HelpFormatter)
    p.add_argument("--seed", type=int, required=True, help="seed of the fault plan")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load, faults included")
    p.add_argument("--ringmq", default="target/release/ringmq", help="ringmq binary")
    p.add_argument("--out", required=True, help="directory for history.jsonl, plan.json, summary.json, report.html")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (data dirs and logs)")
    p.add_argument("--warmup", type=float, default=8.0, help="seconds of load before the first fault")
    p.add_argument("--gap", type=span, default=(4.0, 10.0), help="seconds from a heal to the next fault, MIN:MAX")
    p.add_argument("--hold", type=span, default=(3.0, 8.0), help="seconds a fault is held, MIN:MAX")
    p.add_argument("--publishers", type=int, default=3, help="publisher threads")
    p.add_argument("--consumers", type=int, default=3, help="consumer threads")
    p.add_argument("--queues", type=int, default=3, help="durable queues")
    p.add_argument("--rate", type=float, default=60.0, help="publishes per second per publisher")
    p.add_argument("--prefetch", type=int, default=50, help="consumer prefetch")
    p.add_argument("--cores", type=int, default=1, help="--cores for each node")
    p.add_argument("--answer-limit", type=float, default=30.0,
                   help="seconds within which the broker must answer every publish (README)")
    p.add_argument("--start-timeout", type=float, default=90.0, help="seconds for a node to serve AMQP")
    p.add_argument("--drain-idle", type=float, default=10.0, help="drain ends after this many seconds without a delivery")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="longest drain, seconds")
    p.add_argument("--verbose", action="store_true", help="show pika's own log")
    return p.parse_args(argv)


class Run:
    """One nemesis run: its cluster, clients, history and the cleanup of all of them."""

    def __init__(self, opts):
        self.opts = opts
        self.root = tempfile.mkdtemp(prefix="ringmq-nemesis-")
        self.cluster = Cluster(os.path.abspath(opts.ringmq), self.root, opts.cores)
        self.history = workload.History(os.path.join(opts.out, "history.jsonl"))
        self.stop_pub, self.stop_con, self.stop_dog = threading.Event(), threading.Event(), threading.Event()
        self.publishers, self.consumers, self.guards = [], [], []
        self.ok = False
        self.closed = False

    def queue(self, k):
        return f"nemesis-{k % self.opts.queues}"

    def start_clients(self):
        o = self.opts
        ports = [n.amqp_port for n in self.cluster.nodes]
        run_id = uuid.uuid4().hex[:12]
        for k in range(o.queues):
            workload.declare(ports[k % 3], [self.queue(k)], 15.0)
        log(f"declared {o.queues} durable queues")
        for k in range(1, o.consumers + 1):
            g = acceptance.Guard(f"consumer{k}", 15.0)
            self.consumers.append(workload.Consumer(k, ports, [self.queue(q) for q in range(o.queues)], run_id,
                                                    o.prefetch, g, self.stop_con, self.history))
            self.guards.append(g)
        for k in range(1, o.publishers + 1):
            g = acceptance.Guard(f"publisher{k}", o.answer_limit + 5.0)
            self.publishers.append(workload.Publisher(k, ports, self.queue(k), run_id, o.rate, g, self.stop_pub,
                                                      self.history))
            self.guards.append(g)
        acceptance.Watchdog(self.guards, self.stop_dog).start()
        for c in self.consumers + self.publishers:
            c.start()

    def watch_nodes(self):
        """Records and restarts a node that exited although no fault killed it."""
        for n in self.cluster.nodes:
            if not n.expected_down and not n.alive():
                what = f"node {n.idx} exited on its own (status {n.proc.returncode})"
                log(f"{what}; log {n.log_path}; restarting it")
                self.history.record("unexpected_exit", node=n.idx, what=what)
                n.start()
                wait_serving(n, self.opts.start_timeout)

    def drain(self, executor):
        """Stops the publishers, then waits until the consumers have been idle a while."""
        o = self.opts
        self.history.record("load_end")
        self.stop_pub.set()
        for p in self.publishers:
            p.join(timeout=o.answer_limit + 10)
        start = now()
        log(f"draining: until {o.drain_idle:.0f} s without a delivery, at most {o.drain_timeout:.0f} s")
        while now() - start < o.drain_timeout:
            last = max([c.last_rx or 0.0 for c in self.consumers] + [start])
            if now() - last >= o.drain_idle:
                break
            executor.wait(0.5)
        self.history.record("drain_end", drain_s=round(now() - start, 2))
        self.stop_con.set()
        for c in self.consumers:
            c.join(timeout=20)

    def execute(self):
        o = self.opts
        plan = faults.make_plan(o.seed, o.duration, o.gap, o.hold, o.warmup)
        with open(os.path.join(o.out, "plan.json"), "w") as f:
            json.dump(plan, f, indent=1)
        log(f"plan of seed {o.seed} ({len(plan)} faults):\n" + "\n".join(faults.describe(f) for f in plan))
        t0_utc = datetime.datetime.fromtimestamp(time.time() - self.history.t(), datetime.timezone.utc)
        self.history.record("run", seed=o.seed, duration=o.duration, plan=len(plan), answer_limit=o.answer_limit,
                            rate=o.rate, publishers=o.publishers, consumers=o.consumers, queues=o.queues,
                            t0_utc=t0_utc.isoformat(timespec="milliseconds"))  # t = 0 on the node logs' clock
        log(f"workdir {self.root}; out {o.out}; binary {self.cluster.nodes[0].binary}")
        self.cluster.start(o.start_timeout)
        self.start_clients()
        executor = faults.Executor(self.cluster, self.history, o.start_timeout, self.watch_nodes)
        load_start = now()
        executor.wait(o.warmup)
        for f in plan:
            executor.wait(f["gap"])
            executor.run(f)
        executor.heal_all()
        executor.wait(o.duration - (now() - load_start))
        self.drain(executor)

    def close(self):
        """Stops everything (idempotent); removes the temp dir unless --keep or a failure."""
        if self.closed:
            return
        self.closed = True
        self.stop_pub.set()
        self.stop_con.set()
        self.stop_dog.set()
        self.cluster.stop()
        self.history.close()
        if self.opts.keep:
            print(f"kept {self.root}", file=sys.stderr)
        elif self.ok:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            for n in self.cluster.nodes:
                shutil.rmtree(n.data_dir, ignore_errors=True)
            print("node logs (kept for the failure):", file=sys.stderr)
            for n in self.cluster.nodes:
                print(f"  node {n.idx}: {n.log_path}", file=sys.stderr)


def human(s):
    """The summary's main lines, for a terminal."""
    lat = s["confirm_latency_s"]
    out = [f"seed {s['seed']}: {s['faults']} faults {s['kinds']}",
           f"  published {s['published']}, confirmed {s['confirmed']}, outcomes {s['outcomes']}",
           f"  delivered {s['delivered_unique']} unique ({s['deliveries']} deliveries, {s['redeliveries']} redelivered, "
           f"{s['duplicates']} duplicates)",
           f"  lost {s['lost']}, minority confirms {s['minority_confirms']}, double confirms {s['double_confirms']}, "
           f"unanswered {s['unanswered']}",
           f"  confirm latency p50 {lat['p50']}, p99 {lat['p99']}, max {lat['max']} s",
           f"  worst ack gap by kind {s['worst_gap_by_kind_s']}"]
    for f in s["fault_list"]:
        target = f"node {f['node']}" if f.get("node") else " ".join(f"{a}->{b}" for a, b in f.get("links", []))
        out.append(f"  #{f['n']:>2} {f['kind']:<14} {f.get('mode', ''):<9} {target:<20} "
                   f"{f['start']:7.1f}-{f['heal']:7.1f} s  ack after start {f['first_ack_after_start_s']} s, "
                   f"after heal {f['first_ack_after_heal_s']} s, gap {f['gap_s']} s, minority {f['minority']}")
    out.append("RESULT: PASS" if s["ok"] else "RESULT: FAIL: " + "; ".join(s["fail_reasons"]))
    return "\n".join(out)


def report(opts):
    """Checks the history, writes summary.json and report.html; returns the summary."""
    summary = check.check(check.load(os.path.join(opts.out, "history.jsonl")), opts.answer_limit)
    with open(os.path.join(opts.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
    plot.write(os.path.join(opts.out, "history.jsonl"), summary, os.path.join(opts.out, "report.html"))
    print(human(summary), file=sys.stderr)
    print(json.dumps({k: v for k, v in summary.items() if k != "fault_list"}, sort_keys=True), flush=True)
    log(f"wrote {opts.out}/summary.json and {opts.out}/report.html")
    return summary


def interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None):
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    if not opts.verbose:
        logging.getLogger("pika").setLevel(logging.CRITICAL)
    if not (os.path.isfile(opts.ringmq) and os.access(opts.ringmq, os.X_OK)):
        log(f"ERROR: no executable ringmq at {opts.ringmq!r} (cargo build --release --bin ringmq, or give --ringmq)")
        return 2
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, interrupt)
    os.makedirs(opts.out, exist_ok=True)
    run = Run(opts)
    atexit.register(run.close)
    try:
        run.execute()
    except Failure as e:
        log(f"ERROR: {e}")
        run.close()
        return 2
    except KeyboardInterrupt as e:
        log(f"interrupted ({e}): stopping everything")
        run.close()
        return 2
    run.cluster.stop()
    run.history.close()
    run.ok = report(opts)["ok"]
    run.close()
    return 0 if run.ok else 1


if __name__ == "__main__":
    sys.exit(main())
