#!/usr/bin/env python3
"""Checks a nemesis history (JSON lines, see workload.py and faults.py) and prints a JSON
summary.

    python3 bench/nemesis/check.py history.jsonl [--answer-limit 30] [--minority-after 2]

What it counts:
- lost: messages whose publish was confirmed (ack) and that no consumer ever received.
- duplicates: deliveries of a message already delivered, not flagged redelivered (a
  redelivered=true delivery is counted apart, as a redelivery).
- minority confirms: acks that reached a publisher connected to a node while that node could
  not reach a majority, later than --minority-after seconds plus --grace after the fault
  started and before it healed. A node reaches another when the links both ways between them
  are up (not cut by a partition mode; a flapping link counts as cut for its whole fault) and
  the other is neither killed nor paused; with itself that must make 2 of 3 nodes.
- unanswered: publishes whose answer (ack, nack, return, or an error of their connection)
  came later than --answer-limit seconds (README: "Every publish in confirm mode is answered
  within 30 s"), plus --grace, or never (the client's guard gave up, or the run ended).
- double confirms: confirms that named no delivery tag waiting on their channel (a tag
  confirmed already, or never published; workload.TagWatch), which a blocking client would
  take for the next publish's answer.
- per fault: seconds from its start to the first ack after it, and from its heal to the
  first ack after it, on any node and per node; `gap_s`, the longest time without any ack
  from its start to 10 s after its heal (the failover as clients see it), worst per kind.

Exit status: 0 when nothing confirmed was lost, no minority confirm, no double confirm, every
publish answered within the limit, no node exited unexpectedly and something was confirmed; 1 otherwise.
"""

import argparse
import bisect
import json
import sys
from collections import Counter, defaultdict

PARTITION_MODES = ("blackhole", "stall", "reset")
NODES = (1, 2, 3)
AFTER_HEAL = 10.0  # the window after a heal in which gap_s is measured


def load(path):
    """The events of a history file, in file order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def pairs(events):
    """Each fault's start and heal events joined: [{n, kind, start, heal, ...start fields}]."""
    faults = {}
    for e in events:
        if e["ev"] != "fault":
            continue
        if e["phase"] == "start":
            faults[e["n"]] = {**{k: v for k, v in e.items() if k not in ("t", "ev", "phase")}, "start": e["t"]}
        elif e["n"] in faults:
            faults[e["n"]]["heal"] = e["t"]
    end = events[-1]["t"] if events else 0.0
    for f in faults.values():
        f.setdefault("heal", end)
    return [faults[n] for n in sorted(faults)]


def minority_nodes(fault):
    """The nodes that cannot reach a majority (2 of 3, themselves included) during `fault`."""
    cut = set()
    if fault.get("mode") in PARTITION_MODES:
        cut = {tuple(l) for l in fault.get("links", [])}
    down = set(fault.get("down", []))
    out = []
    for n in NODES:
        if n in down:
            continue
        reach = 1 + sum(1 for m in NODES if m != n and m not in down and (n, m) not in cut and (m, n) not in cut)
        if reach < 2:
            out.append(n)
    return out


def percentile(sorted_values, p):
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(p / 100.0 * len(sorted_values)))]


def first_after(times, t):
    """Seconds from t to the first time in sorted `times` at or after t; None if none."""
    i = bisect.bisect_left(times, t)
    return round(times[i] - t, 3) if i < len(times) else None


def longest_gap(times, start, end):
    """Longest interval in [start, end] holding none of the sorted `times`."""
    inside = times[bisect.bisect_left(times, start):bisect.bisect_right(times, end)]
    edges = [start] + inside + [end]
    return round(max(b - a for a, b in zip(edges, edges[1:])), 3)


def fault_timings(fault, acks, acks_by_node, window_end):
    """The per-fault figures: first ack after start and heal, per node, and the ack gap up
    to `window_end` (10 s after the heal, or the next fault's start if sooner)."""
    s, h = fault["start"], fault["heal"]
    return {
        "first_ack_after_start_s": first_after(acks, s),
        "first_ack_after_heal_s": first_after(acks, h),
        "per_node_after_start_s": {n: first_after(acks_by_node[n], s) for n in NODES},
        "per_node_after_heal_s": {n: first_after(acks_by_node[n], h) for n in NODES},
        "gap_s": longest_gap(acks, s, max(h, window_end)),
    }


def index(events):
    """(publishes by id, answers by id, deliveries by id) of a history."""
    publishes, answers, deliveries = {}, {}, defaultdict(list)
    for e in events:
        if e["ev"] == "publish":
            publishes[e["id"]] = e
        elif e["ev"] == "confirm":
            answers[e["id"]] = e
        elif e["ev"] == "deliver":
            deliveries[e["id"]].append(e)
    return publishes, answers, deliveries


def minority_confirms(fault, acked, after):
    """The acks of `fault`'s minority nodes later than `after` seconds into it, before its heal."""
    lo, hi = fault["start"] + after, fault["heal"]
    return [{"id": i, "node": a["node"], "t": a["t"], "fault": fault["n"], "kind": fault["kind"]}
            for i, a in acked.items() if a["node"] in fault["minority"] and lo <= a["t"] <= hi]


def unanswered_publishes(publishes, answers, limit):
    """Publishes answered later than `limit` seconds, given up by the client, or never."""
    out = []
    for i, p in publishes.items():
        a = answers.get(i)
        waited = (a["t"] - p["t"]) if a else None
        if a is None or a["outcome"] == "timeout" or waited > limit:
            out.append({"id": i, "node": p["node"], "published_t": p["t"],
                        "outcome": a["outcome"] if a else None, "waited_s": waited and round(waited, 3)})
    return sorted(out, key=lambda u: u["published_t"])


def verdict(summary, exits):
    """The reasons the run fails (empty: it passes)."""
    reasons = []
    if summary["lost"]:
        reasons.append(f"{summary['lost']} confirmed messages lost")
    if summary["minority_confirms"]:
        reasons.append(f"{summary['minority_confirms']} confirms on a minority node")
    if summary["double_confirms"]:
        reasons.append(f"{summary['double_confirms']} confirms of a delivery tag not waiting")
    if summary["unanswered"]:
        reasons.append(f"{summary['unanswered']} publishes not answered within {summary['answer_limit_s']:g} s")
    if exits:
        reasons.append(f"{len(exits)} unexpected node exits")
    if not summary["confirmed"]:
        reasons.append("nothing was confirmed")
    return reasons


def check(events, answer_limit=30.0, minority_after=2.0, grace=0.5):
    """The summary dict of a history; summary["ok"] is the verdict."""
    run = next((e for e in events if e["ev"] == "run"), {})
    publishes, answers, deliveries = index(events)
    load_end = next((e["t"] for e in events if e["ev"] == "load_end"), events[-1]["t"] if events else 0.0)
    acked = {i: a for i, a in answers.items() if a["outcome"] == "ack"}
    acks = sorted(a["t"] for a in acked.values())
    acks_by_node = {n: sorted(a["t"] for a in acked.values() if a["node"] == n) for n in NODES}
    lost = sorted((i for i in acked if i not in deliveries), key=lambda i: acked[i]["t"])

    faults = pairs(events)
    minority = []
    for f, nxt in zip(faults, faults[1:] + [None]):
        f["minority"] = minority_nodes(f)
        minority += minority_confirms(f, acked, minority_after + grace)
        window_end = min(f["heal"] + AFTER_HEAL, nxt["start"] if nxt else load_end)
        f.update(fault_timings(f, acks, acks_by_node, window_end))
    unanswered = unanswered_publishes(publishes, answers, answer_limit + grace)
    latencies = sorted(round(a["t"] - publishes[i]["t"], 4) for i, a in acked.items() if i in publishes)
    worst = {}
    for f in faults:
        worst[f["kind"]] = max(worst.get(f["kind"], 0.0), f["gap_s"])
    exits = [e for e in events if e["ev"] == "unexpected_exit"]
    doubles = [e for e in events if e["ev"] == "double_confirm"]

    summary = {
        "seed": run.get("seed"),
        "t0_utc": run.get("t0_utc"),
        "duration_s": round(load_end, 1),
        "published": len(publishes),
        "confirmed": len(acked),
        "outcomes": dict(sorted(Counter(a["outcome"] for a in answers.values()).items())),
        "delivered_unique": len(deliveries),
        "deliveries": sum(len(ds) for ds in deliveries.values()),
        "lost": len(lost),
        "lost_first": [{"id": i, "node": acked[i]["node"], "t": acked[i]["t"]} for i in lost[:20]],
        "duplicates": sum(1 for ds in deliveries.values() for d in ds[1:] if not d["redelivered"]),
        "redeliveries": sum(1 for ds in deliveries.values() for d in ds if d["redelivered"]),
        "delivered_unconfirmed": sum(1 for i in deliveries if i not in acked),
        "minority_confirms": len(minority),
        "minority_first": sorted(minority, key=lambda m: m["t"])[:20],
        "double_confirms": len(doubles),
        "double_confirms_first": doubles[:20],
        "unanswered": len(unanswered),
        "unanswered_first": unanswered[:20],
        "answer_limit_s": answer_limit,
        "confirm_latency_s": {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99),
                              "max": latencies[-1] if latencies else None},
        "faults": len(faults),
        "kinds": dict(sorted(Counter(f["kind"] for f in faults).items())),
        "worst_gap_by_kind_s": dict(sorted(worst.items())),
        "slow_failovers": [{"n": f["n"], "kind": f["kind"], "gap_s": f["gap_s"]} for f in faults if f["gap_s"] > 5.0],
        "unexpected_exits": [e.get("what") for e in exits],
        "fault_list": faults,
    }
    summary["fail_reasons"] = verdict(summary, exits)
    summary["ok"] = not summary["fail_reasons"]
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("history", help="history.jsonl written by nemesis.py")
    p.add_argument("--answer-limit", type=float, default=30.0, help="seconds within which every publish must be answered")
    p.add_argument("--minority-after", type=float, default=2.0,
                   help="seconds after which a node cut from the majority must no longer confirm")
    p.add_argument("--grace", type=float, default=0.5, help="seconds of slack for answers in flight")
    o = p.parse_args(argv)
    summary = check(load(o.history), o.answer_limit, o.minority_after, o.grace)
    print(json.dumps(summary, indent=1, sort_keys=True))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
