"""The nemesis's cluster: three ringmq nodes whose peer links all run through proxy.py.

Node i's --peers names itself at its real --cluster-listen and every other node j at the
proxy port of the directed link i->j, so each connection node i dials to node j (its raft,
data and snapshot lanes to j) goes through the link i->j, and the nemesis can fault any set of
directed links (`Cluster.set_links`). The broker checks only that a node's own entry is on its
--cluster-listen port; the other entries are just where it dials.
"""

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "cluster"))

import acceptance  # noqa: E402  (bench/cluster/acceptance.py: nodes, bounded pika clients)
from acceptance import HOST, Failure, log, now, wait_serving  # noqa: E402  (re-exported too)

PR_SET_PDEATHSIG = 1


_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it


def die_with_parent():
    """In a child before exec: SIGKILL it when the thread that started it exits, so that no
    broker outlives a nemesis that was itself killed with SIGKILL (no atexit runs then)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_ports(n):
    """n distinct free TCP ports on HOST (bound to port 0 together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Node(acceptance.Node):
    """A ringmq node with its own --peers list (proxies for the other nodes), SIGSTOP/SIGCONT,
    and a parent-death signal. argv/kill/alive/log_tail come from acceptance.Node."""

    def __init__(self, idx, binary, root, ports, cores):
        self.idx = idx
        self.amqp_port, self.metrics_port, self.cluster_port = ports
        self.data_dir = os.path.join(root, f"d{idx}")
        self.log_path = os.path.join(root, f"node{idx}.log")
        self.binary = binary
        self.peers = None  # set by Cluster once the proxies are bound
        self.extra = ["--cores", str(cores), "--replicas", "3", "--management-listen", "off"]
        self.proc = None
        self.starts = 0
        self.expected_down = False
        self.paused = False

    def start(self):
        """Starts the process (log appended, own session, as acceptance.Node.start does)."""
        os.makedirs(self.data_dir, exist_ok=True)
        self.starts += 1
        with open(self.log_path, "ab") as f:
            f.write(f"=== start #{self.starts} at +{now() - acceptance.T0:.2f}s: {' '.join(self.argv())}\n".encode())
            f.flush()
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=die_with_parent)
        self.expected_down = False
        self.paused = False

    def pause(self):
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self):
        if self.paused and self.alive():
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def stop(self):
        self.resume()
        super().stop()

    def raft_figures(self, timeout=1.0):
        """{'leader_id', 'is_leader', 'term'} from the node's /metrics, or None."""
        want = {"ringmq_raft_leader_id": "leader_id", "ringmq_raft_is_leader": "is_leader", "ringmq_raft_term": "term"}
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=timeout) as r:
                text = r.read().decode(errors="replace")
        except (OSError, ValueError):
            return None
        out = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] in want:
                out[want[parts[0]]] = int(float(parts[1]))
        return out if len(out) == len(want) else None


class Cluster:
    """Three nodes, the proxy process between them, and the operations the faults use."""

    def __init__(self, binary, root, cores):
        ports = free_ports(9)
        self.nodes = [Node(i + 1, binary, root, ports[3 * i:3 * i + 3], cores) for i in range(3)]
        self.proxy = None
        self.link_ports = {}

    def node(self, idx):
        return self.nodes[idx - 1]

    def start_proxy(self):
        args = [sys.executable, os.path.join(HERE, "proxy.py")]
        for a in self.nodes:
            for b in self.nodes:
                if a is not b:
                    args += ["--link", f"{a.idx},{b.idx},{HOST}:{b.cluster_port}"]
        self.proxy = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      preexec_fn=die_with_parent)
        line = self.proxy.stdout.readline()
        if not line.startswith("ready "):
            raise Failure(f"proxy did not start: {line!r}")
        self.link_ports = {tuple(map(int, k.split(","))): v for k, v in json.loads(line[6:]).items()}
        for a in self.nodes:
            a.peers = ",".join(f"{b.idx}={HOST}:{b.cluster_port if a is b else self.link_ports[(a.idx, b.idx)]}"
                               for b in self.nodes)

    def set_links(self, links, mode, delay_ms=0):
        """Puts the directed links [(from, to), ...] in `mode` (proxy.py's modes)."""
        cmd = {"links": [list(l) for l in links], "mode": mode, "delay_ms": delay_ms}
        self.proxy.stdin.write(json.dumps(cmd) + "\n")
        self.proxy.stdin.flush()
        answer = self.proxy.stdout.readline().strip()
        if answer != "ok":
            raise Failure(f"proxy refused {cmd}: {answer!r}")

    def all_links(self):
        return [(a.idx, b.idx) for a in self.nodes for b in self.nodes if a is not b]

    def start(self, timeout):
        self.start_proxy()
        for n in self.nodes:
            log(f"starting node {n.idx}: AMQP {n.amqp_port}, metrics {n.metrics_port}, cluster {n.cluster_port}, "
                f"peers {n.peers}")
            n.start()
        for n in self.nodes:
            log(f"node {n.idx} serves AMQP ({wait_serving(n, timeout):.2f} s)")

    def leader(self):
        """The metadata (Raft) leader's id as the live nodes see it: the node that says it
        leads with the highest term, else the id most nodes name; None when none is known."""
        figures = {n.idx: n.raft_figures() for n in self.nodes if n.alive() and not n.paused}
        leading = [(f["term"], i) for i, f in figures.items() if f and f["is_leader"]]
        if leading:
            return max(leading)[1]
        named = [f["leader_id"] for f in figures.values() if f and f["leader_id"]]
        return max(set(named), key=named.count) if named else None

    def stop(self):
        """Stops every node (SIGCONT first when paused) and the proxy; safe to call twice."""
        for n in self.nodes:
            try:
                n.stop()
            except Exception:  # noqa: BLE001 - stopping the others matters more
                pass
        if self.proxy and self.proxy.poll() is None:
            self.proxy.kill()
            self.proxy.wait(timeout=10)
