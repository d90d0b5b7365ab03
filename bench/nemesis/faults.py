"""The nemesis's faults: a plan drawn from a seed, and its execution against a Cluster.

Kinds (a "link" is a directed proxy link FROM->TO: the connections node FROM dials to TO):
- isolate: every link to and from one node, in a partition mode.
- isolate-leader: the same for the node that leads the metadata (Raft) group when the fault
  starts (read from the nodes' metrics).
- bridge: nodes A and C cut from each other (A->C and C->A), both still linked with B.
- one-way: one directed link A->B only: A's raft, data and snapshot lanes to B; B's lanes to
  A still carry B's messages.
- flap: the two links between two nodes go down (in a partition mode) and up again every
  `period` seconds (0.5-1) for the fault's hold.
- kill: SIGKILL of one node; restarted `hold` seconds later with the same flags and data dir.
- pause-leader: SIGSTOP of the metadata leader, SIGCONT `hold` seconds later.
- delay: every link to and from one node delays each chunk by `delay_ms` (20-300).
Partition modes (proxy.py): blackhole, stall or reset.

Kinds and partition modes are drawn as shuffled bags (each kind once, in a seeded order, then
again), so any run of 8 faults covers every kind; the same seed gives the same plan.
"""

import random
import time

from nodes import log, now, wait_serving

KINDS = ("isolate", "isolate-leader", "bridge", "one-way", "flap", "kill", "pause-leader", "delay")
PARTITION_MODES = ("blackhole", "stall", "reset")
NODES = (1, 2, 3)


class Bag:
    """Draws the items of `items` in a seeded shuffled order, reshuffled when empty."""

    def __init__(self, rng, items):
        self.rng, self.items, self.left = rng, list(items), []

    def next(self):
        if not self.left:
            self.left = self.items[:]
            self.rng.shuffle(self.left)
        return self.left.pop()


def draw_fault(rng, kind, modes, hold):
    """One fault of `kind`: its targets, mode and hold time, all from `rng`."""
    f = {"kind": kind, "hold": round(rng.uniform(*hold), 2)}
    if kind in ("isolate", "kill", "delay"):
        f["node"] = rng.choice(NODES)
    if kind in ("isolate", "isolate-leader", "bridge", "one-way", "flap"):
        f["mode"] = modes.next()
    if kind == "bridge":
        f["middle"] = rng.choice(NODES)
    if kind in ("one-way", "flap"):
        f["link"] = rng.sample(NODES, 2)
    if kind == "flap":
        f["period"] = round(rng.uniform(0.5, 1.0), 2)
        f["hold"] = max(f["hold"], 4.0)  # several toggles
    if kind == "delay":
        f["delay_ms"] = rng.randrange(20, 301, 10)
    return f


def make_plan(seed, duration, gap, hold, warmup):
    """The faults of a run of `duration` seconds of load: after `warmup` seconds, faults one
    at a time, each `gap` (min, max) seconds after the previous heal and held `hold` (min,
    max) seconds, while the nominal schedule fits in the duration."""
    rng = random.Random(seed)
    kinds, modes = Bag(rng, KINDS), Bag(rng, PARTITION_MODES)
    plan, t = [], warmup
    while True:
        f = draw_fault(rng, kinds.next(), modes, hold)
        f["gap"] = round(rng.uniform(*gap), 2) if plan else 0.0
        f["at"] = round(t + f["gap"], 2)
        if f["at"] + f["hold"] > duration:
            return plan
        f["n"] = len(plan) + 1
        plan.append(f)
        t = f["at"] + f["hold"]


def describe(f):
    """One line for the printed plan."""
    extra = {k: v for k, v in f.items() if k not in ("n", "kind", "at", "gap", "hold")}
    args = " ".join(f"{k}={v}" for k, v in extra.items())
    return f"#{f['n']:>2} at ~{f['at']:6.1f} s  {f['kind']:<14} hold {f['hold']:4.1f} s  {args}"


class Executor:
    """Applies plan faults to a Cluster, one at a time, recording `fault` events (phase
    start, heal) in the history with what they did: the cut links, paused or killed node.
    A start is recorded once the fault is in effect (the proxy answered, the signal was
    sent), a heal once it is undone."""

    def __init__(self, cluster, history, start_timeout, on_tick):
        self.cluster, self.history = cluster, history
        self.start_timeout = start_timeout
        self.on_tick = on_tick  # called about 4 times a second while a fault holds or between

    def wait(self, seconds):
        """Sleeps `seconds`, calling on_tick every 0.25 s."""
        end = now() + seconds
        while now() < end:
            self.on_tick()
            left = end - now()
            if left > 0:
                time.sleep(min(0.25, left))

    def links_for(self, f, target):
        """The directed links a partition or delay fault acts on."""
        kind = f["kind"]
        if kind in ("isolate", "isolate-leader", "delay"):
            return [l for l in self.cluster.all_links() if target in l]
        if kind == "bridge":
            a, c = [n for n in NODES if n != f["middle"]]
            return [(a, c), (c, a)]
        if kind == "one-way":
            return [tuple(f["link"])]
        a, b = f["link"]  # flap
        return [(a, b), (b, a)]

    def run(self, f):
        """Executes fault `f` (start, hold, heal); returns when it is healed. A leader fault
        acts on node 1 when no node names a leader."""
        kind = f["kind"]
        target = f.get("node")
        if kind in ("isolate-leader", "pause-leader"):
            target = self.cluster.leader() or 1
        if kind == "kill":
            return self.kill(f, target)
        if kind == "pause-leader":
            return self.pause(f, target)
        links = self.links_for(f, target)
        mode = "delay" if kind == "delay" else f["mode"]
        self.cluster.set_links(links, mode, f.get("delay_ms", 0))
        self.start(f, node=target, links=links, mode=mode)
        if kind == "flap":
            self.flap(f, links)
        else:
            self.wait(f["hold"])
        self.cluster.set_links(links, "pass")
        self.heal(f)

    def start(self, f, **what):
        """Records and logs the start of fault `f`, with what it acts on."""
        log(f"fault {describe(f)} -> {what}")
        self.history.record("fault", phase="start", n=f["n"], kind=f["kind"], **what)

    def heal(self, f):
        """Records and logs the heal of fault `f`."""
        log(f"heal #{f['n']} {f['kind']}")
        self.history.record("fault", phase="heal", n=f["n"], kind=f["kind"])

    def flap(self, f, links):
        """With `links` cut, restores and cuts them in turn every f["period"] seconds for
        f["hold"] seconds."""
        end = now() + f["hold"]
        up = False
        while now() < end:
            self.wait(min(f["period"], max(0.0, end - now())))
            up = not up
            self.cluster.set_links(links, "pass" if up else f["mode"])

    def kill(self, f, node_id):
        """SIGKILL, f["hold"] seconds down, restart; records when it serves AMQP again."""
        node = self.cluster.node(node_id)
        node.kill()
        self.start(f, node=node_id, down=[node_id], links=[])
        self.wait(f["hold"])
        node.start()
        self.heal(f)
        took = wait_serving(node, self.start_timeout)
        log(f"node {node_id} serves again {took:.2f} s after its restart")
        self.history.record("serving", node=node_id, after_restart_s=round(took, 3))

    def pause(self, f, node_id):
        """SIGSTOP, f["hold"] seconds frozen, SIGCONT."""
        node = self.cluster.node(node_id)
        node.pause()
        self.start(f, node=node_id, down=[node_id], links=[])
        self.wait(f["hold"])
        node.resume()
        self.heal(f)

    def heal_all(self):
        """Every link back to pass, every paused node resumed (after an interruption)."""
        self.cluster.set_links(self.cluster.all_links(), "pass")
        for n in self.cluster.nodes:
            n.resume()
