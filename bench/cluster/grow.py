#!/usr/bin/env python3
"""grow.py: how long a replica set takes to grow back, and what it costs the queue's publishers.

    python3 bench/cluster/grow.py [--messages 100000] [--size 1024] [--rate 1000] [--ringmq PATH]

Four ringmq nodes on loopback (`--replicas 2 --cores 1`, fresh data dirs under --out). A
durable queue declared on node 1 is stored on node 1 and one other node. ringmq-bench fills
it with --messages persistent messages of --size bytes (confirmed, nothing consumed). Then a
publisher at --rate msgs/s runs for --window seconds twice: once as it is (the baseline), and
once while the queue's second replica is killed with SIGKILL and forgotten (`--forget-node`),
so that the set (node 1 alone) grows back onto one of the two other nodes: node 1 copies the
backlog through the Raft log while the publisher goes on. Printed: the copy's time, rate and
rounds (from node 1's log line "queue replica set grown"), and the publisher's confirm
p50/p99 in both windows. Nothing is asserted.

Reuses the node handling of acceptance.py (beside this file).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import acceptance as acc  # noqa: E402

import pika  # noqa: E402

QUEUE = "ringmq-grow-bench"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--ringmq", default=os.environ.get("RINGMQ", os.path.join(root, "target/release/ringmq")))
    p.add_argument("--bench", default=os.environ.get("RINGMQ_BENCH", os.path.join(root, "target/release/ringmq-bench")))
    p.add_argument("--messages", type=int, default=100_000, help="backlog to copy")
    p.add_argument("--size", type=int, default=1024, help="message body bytes")
    p.add_argument("--rate", type=int, default=1000, help="msgs/s of the publisher in both windows")
    p.add_argument("--window", type=float, default=10.0, help="seconds of each publisher window")
    p.add_argument("--base-port", type=int, default=7772)
    p.add_argument("--out", default=None, help="node data dirs and logs (default: a temp dir)")
    return p.parse_args(argv)


def bench(opts, node, args):
    """Runs ringmq-bench against `node`'s AMQP port; returns its JSON figures."""
    uri = f"amqp://guest:guest@{acc.HOST}:{node.amqp_port}/%2f"
    cmd = [opts.bench, "run", "--uri", uri, "--queues", QUEUE, "--predeclared", "--consumers", "0",
           "--persistent", "--size", str(opts.size), "--quiet", "--json"] + args
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if not lines:
        raise acc.Failure(f"ringmq-bench printed no figures: {out.stdout[-500:]} {out.stderr[-500:]}")
    return json.loads(lines[-1])


def publisher(opts, node):
    """Starts the --rate publisher for one --window; returns the process (JSON on stdout)."""
    uri = f"amqp://guest:guest@{acc.HOST}:{node.amqp_port}/%2f"
    cmd = [opts.bench, "run", "--uri", uri, "--queues", QUEUE, "--predeclared", "--consumers", "0",
           "--persistent", "--size", str(opts.size), "--confirm", "100", "--rate", str(opts.rate),
           "--duration", str(opts.window), "--quiet", "--json"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def figures(proc):
    """Waits for a publisher started by `publisher`; returns its JSON figures."""
    out, err = proc.communicate(timeout=600)
    lines = [l for l in out.splitlines() if l.startswith("{")]
    if not lines:
        raise acc.Failure(f"ringmq-bench printed no figures: {out[-500:]} {err[-500:]}")
    return json.loads(lines[-1])


def replicas(nodes):
    hexname = "2f." + QUEUE.encode().hex()
    return [n for n in nodes if os.path.isdir(os.path.join(n.data_dir, "queues", hexname))]


def grown_line(node, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(node.log_path, errors="replace") as f:
            for line in f:
                if "queue replica set grown" in line:
                    return line
        time.sleep(0.05)
    raise acc.Failure(f"no 'queue replica set grown' in node 1's log within {timeout} s:\n{node.log_tail()}")


def main(argv=None):
    opts = parse_args(argv)
    root = opts.out or tempfile.mkdtemp(prefix="ringmq-grow-")
    node_opts = argparse.Namespace(base_port=opts.base_port, metrics_base_port=opts.base_port + 10020,
                                   cluster_base_port=opts.base_port + 20000, ringmq=opts.ringmq, cores=1,
                                   node_arg=["--replicas 2"])
    peers = ",".join(f"{i}={acc.HOST}:{node_opts.cluster_base_port + i - 1}" for i in range(1, 5))
    nodes = [acc.Node(i, node_opts, root, peers) for i in range(1, 5)]
    try:
        for n in nodes:
            n.start()
        for n in nodes:
            acc.wait_serving(n, 60)
        conn = pika.BlockingConnection(acc.conn_params(nodes[0].amqp_port, "grow-bench"))
        conn.channel().queue_declare(QUEUE, durable=True)
        conn.close()
        t = time.monotonic()
        fill = bench(opts, nodes[0], ["--confirm", "500", "--messages", str(opts.messages), "--duration", "900"])
        print(f"backlog: {fill['confirmed']} messages of {opts.size} B in {time.monotonic() - t:.1f} s")
        second = [n for n in replicas(nodes) if n is not nodes[0]]
        if len(second) != 1:
            raise acc.Failure(f"expected the queue on node 1 and one other, found it on {[n.idx for n in replicas(nodes)]}")
        other = second[0]

        base = figures(publisher(opts, nodes[0]))
        pub = publisher(opts, nodes[0])
        time.sleep(1.0)
        other.kill()
        forget = subprocess.run([opts.ringmq, "--forget-node", str(other.idx), "--peers", peers],
                                capture_output=True, text=True, timeout=120)
        if forget.returncode != 0:
            raise acc.Failure(f"--forget-node failed: {forget.stdout} {forget.stderr}")
        line = grown_line(nodes[0], 300)
        during = figures(pub)
        ms = int(re.search(r"ms=(\d+)", line).group(1))
        rounds = int(re.search(r"rounds=(\d+)", line).group(1))
        tail = int(re.search(r"tail=(\d+)", line).group(1))
        target = int(re.search(r"node=(\d+)", line).group(1))
        mib = fill["confirmed"] * opts.size / (1 << 20)
        print(f"grown onto node {target}: {ms} ms for {tail} offsets ({mib:.0f} MiB of bodies) in {rounds} rounds: "
              f"{tail / (ms / 1000):,.0f} msgs/s, {mib / (ms / 1000):.0f} MiB/s")
        for name, f in (("publisher, no grow", base), ("publisher, during the grow", during)):
            print(f"{name}: {f['confirmed']} confirmed, {f['nacked']} nacked, confirm p50 {f['confirm_p50_us'] / 1000:.2f} ms, "
                  f"p99 {f['confirm_p99_us'] / 1000:.2f} ms, max {f['confirm_max_us'] / 1000:.2f} ms")
    finally:
        for n in nodes:
            n.stop()
    print(f"logs and data: {root}")


if __name__ == "__main__":
    main()
