#!/usr/bin/env python3
"""The nemesis report: one self-contained HTML file (inline SVG, no script, no network).

    python3 bench/nemesis/plot.py history.jsonl report.html

Two charts over the run's time, each fault shaded as a band labelled with its number and
kind: acks per second per node (the node the publisher was connected to), and the confirm
latency of the acks of each second (p50 and p99, log scale). Below them, the checker's
summary and its per-fault table.
"""

import html
import json
import math
import sys
from collections import defaultdict

import check

W, H, LEFT, RIGHT, TOP, BOTTOM = 1100, 260, 60, 20, 24, 30
NODE_COLORS = {1: "#1f77b4", 2: "#2ca02c", 3: "#d62728"}
NODE_DASHES = {1: "none", 2: "7 3", 3: "2 2"}  # lines of nodes at the same rate stay apart
KIND_COLORS = {"isolate": "#ffbf80", "isolate-leader": "#ff9966", "bridge": "#c9b3ff", "one-way": "#99ccff",
               "flap": "#ffe680", "kill": "#ff8080", "pause-leader": "#d9a6a6", "delay": "#b3e6b3"}


def per_second(events):
    """(acks[node][second] counts, latencies[second] lists) from the history's events."""
    sent = {e["id"]: e["t"] for e in events if e["ev"] == "publish"}
    acks, lat = defaultdict(lambda: defaultdict(int)), defaultdict(list)
    for e in events:
        if e["ev"] == "confirm" and e["outcome"] == "ack":
            sec = int(e["t"])
            acks[e["node"]][sec] += 1
            if e["id"] in sent:
                lat[sec].append(e["t"] - sent[e["id"]])
    return acks, lat


class Chart:
    """An SVG chart of width W, height H, x in seconds [0, t_end], y in [y_lo, y_hi]."""

    def __init__(self, t_end, y_lo, y_hi, log_y=False):
        self.t_end, self.log_y = max(t_end, 1.0), log_y
        self.y_lo, self.y_hi = (math.log10(y_lo), math.log10(y_hi)) if log_y else (y_lo, y_hi)
        self.parts = []

    def x(self, t):
        return LEFT + (W - LEFT - RIGHT) * t / self.t_end

    def y(self, v):
        if self.log_y:
            v = math.log10(max(v, 10 ** self.y_lo))
        return H - BOTTOM - (H - TOP - BOTTOM) * (v - self.y_lo) / ((self.y_hi - self.y_lo) or 1.0)

    def bands(self, faults):
        """A shaded band per fault, labelled "#n kind" (just "#n" when there are many: the
        colour and the band's tooltip give the kind)."""
        for f in faults:
            label = f"#{f['n']}" + ("" if len(faults) > 20 else f" {f['kind']}")
            x0, x1 = self.x(f["start"]), self.x(max(f["heal"], f["start"] + 0.2))
            color = KIND_COLORS.get(f["kind"], "#ddd")
            self.parts.append(f'<rect x="{x0:.1f}" y="{TOP}" width="{x1 - x0:.1f}" height="{H - TOP - BOTTOM}" '
                              f'fill="{color}" opacity="0.55"><title>#{f["n"]} {html.escape(f["kind"])} '
                              f'{f["start"]:.1f}-{f["heal"]:.1f} s</title></rect>')
            self.parts.append(f'<text x="{x0 + 1:.1f}" y="{TOP - 4}" font-size="9" transform="rotate(-20 {x0 + 1:.1f} '
                              f'{TOP - 4})">{html.escape(label)}</text>')

    def line(self, points, color, label, dash="none"):
        if not points:
            return
        d = " ".join(f"{self.x(t):.1f},{self.y(v):.1f}" for t, v in points)
        self.parts.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="1.3" '
                          f'stroke-dasharray="{dash}">'
                          f'<title>{html.escape(label)}</title></polyline>')

    def axes(self, y_ticks, y_label):
        step = next(s for s in (5, 10, 30, 60, 120, 300, 600, 1200) if self.t_end / s <= 12)
        for k in range(int(self.t_end // step) + 1):
            x = self.x(k * step)
            self.parts.append(f'<line x1="{x:.1f}" y1="{H - BOTTOM}" x2="{x:.1f}" y2="{H - BOTTOM + 4}" stroke="#333"/>'
                              f'<text x="{x:.1f}" y="{H - BOTTOM + 15}" font-size="10" text-anchor="middle">{k * step}</text>')
        for v in y_ticks:
            y = self.y(v)
            self.parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}" stroke="#eee"/>'
                              f'<text x="{LEFT - 4}" y="{y + 3:.1f}" font-size="10" text-anchor="end">{v:g}</text>')
        self.parts.append(f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - RIGHT}" height="{H - TOP - BOTTOM}" '
                          f'fill="none" stroke="#333"/>'
                          f'<text x="12" y="{(H) / 2:.0f}" font-size="11" transform="rotate(-90 12 {H / 2:.0f})" '
                          f'text-anchor="middle">{html.escape(y_label)}</text>'
                          f'<text x="{W - RIGHT}" y="{H - 2}" font-size="10" text-anchor="end">seconds</text>')

    def svg(self):
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H + 10}">{"".join(self.parts)}</svg>'


def ack_chart(acks, faults, t_end):
    top = max([max(s.values()) for s in acks.values() if s] + [1])
    c = Chart(t_end, 0, top * 1.1)
    c.bands(faults)
    c.axes([round(top * k / 4) for k in range(5)], "acks per second")
    for node, secs in sorted(acks.items()):
        c.line([(s + 0.5, secs.get(s, 0)) for s in range(int(t_end) + 1)], NODE_COLORS.get(node, "#000"), f"node {node}",
               NODE_DASHES.get(node, "none"))
    return c.svg()


def latency_chart(lat, faults, t_end):
    c = Chart(t_end, 0.001, 40.0, log_y=True)
    c.bands(faults)
    c.axes([0.001, 0.01, 0.1, 1, 10], "confirm latency, s (log)")
    for p, color in ((50, "#555"), (99, "#e377c2")):
        pts = [(s + 0.5, check.percentile(sorted(v), p)) for s, v in sorted(lat.items())]
        c.line(pts, color, f"p{p}")
    return c.svg()


def table(rows, header):
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def fault_rows(summary):
    for f in summary["fault_list"]:
        what = f.get("links") or f.get("down") or ""
        yield [f["n"], f["kind"], f.get("mode", ""), f.get("node", ""), what, f"{f['start']:.1f}", f"{f['heal']:.1f}",
               f["first_ack_after_start_s"], f["first_ack_after_heal_s"], f["gap_s"],
               " ".join(f"{n}:{v}" for n, v in f["per_node_after_heal_s"].items()), f["minority"]]


def write(history_path, summary, out_path):
    events = check.load(history_path)
    t_end = max((e["t"] for e in events), default=1.0)
    acks, lat = per_second(events)
    faults = summary["fault_list"]
    legend = " ".join(f'<span style="color:{c}">&#9632; node {n}</span>' for n, c in NODE_COLORS.items())
    kinds = " ".join(f'<span style="background:{c}">&nbsp;{k}&nbsp;</span>' for k, c in KIND_COLORS.items())
    main_rows = [(k, json.dumps(summary[k])) for k in
                 ("ok", "fail_reasons", "seed", "duration_s", "published", "confirmed", "outcomes", "delivered_unique",
                  "lost", "duplicates", "redeliveries", "minority_confirms", "double_confirms", "unanswered", "confirm_latency_s",
                  "kinds", "worst_gap_by_kind_s", "slow_failovers", "unexpected_exits")]
    doc = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>ringmq nemesis, seed {html.escape(str(summary['seed']))}</title>
<style>body{{font-family:sans-serif;font-size:13px;margin:16px}} table{{border-collapse:collapse;margin:8px 0}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:left}} th{{background:#f3f3f3}}</style></head><body>
<h2>ringmq nemesis, seed {html.escape(str(summary['seed']))}: {'PASS' if summary['ok'] else 'FAIL'}</h2>
<p>Faults: {kinds}</p>
<h3>Acks per second, by the publisher's node</h3><p>{legend}</p>{ack_chart(acks, faults, t_end)}
<h3>Confirm latency per second: <span style="color:#555">p50</span>, <span style="color:#e377c2">p99</span></h3>
{latency_chart(lat, faults, t_end)}
<h3>Summary</h3>{table(main_rows, ["figure", "value"])}
<h3>Faults</h3>{table(fault_rows(summary), ["#", "kind", "mode", "node", "links / down", "start s", "heal s",
                                            "ack after start s", "ack after heal s", "ack gap s",
                                            "per node ack after heal s", "minority nodes"])}
</body></html>
"""
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(doc)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    write(sys.argv[1], check.check(check.load(sys.argv[1])), sys.argv[2])
