#!/usr/bin/env bash
# The management API and metrics under load (issue 13's check): starts a release ringmq on free
# loopback ports with its own temporary data dir, declares --queues idle durable queues through
# the management API, then runs the same ringmq-bench scenario --rounds times without and
# --rounds times with a scraper (alternating: quiet, scraped, quiet, scraped, …). The scraper
# fetches /metrics, /metrics/per-object and GET /api/queues (all queues, one page) once a second
# and records each answer's time (curl's time_total). Prints the bench's medians for both sides
# and the scrape times (p50, p99, max, in ms). See bench/README.md.
#
#   bench/mgmt-load.sh [--rounds N] [--queues N] [--out DIR] [-- ringmq-bench scenario flags]
#
# Default scenario: run --size 1024 --confirm 100 --prefetch 100 --multi-ack-every 1
#                   --duration 10 (the 1 KiB confirm + ack row of bench/README.md).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
rounds=3
queues=1000
out=''
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds="$2"; shift 2 ;;
        --queues) queues="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "mgmt-load.sh: unknown option $1" >&2; exit 1 ;;
    esac
done
scenario=("$@")
[ ${#scenario[@]} -gt 0 ] || scenario=(run --size 1024 --confirm 100 --prefetch 100 --multi-ack-every 1 --duration 10)

broker="$root/target/release/ringmq"
bench="$root/target/release/ringmq-bench"
if [ ! -x "$broker" ] || [ ! -x "$bench" ]; then
    echo "mgmt-load.sh: building ringmq and ringmq-bench (release)" >&2
    (cd "$root" && cargo build -j 2 --release --bin ringmq && cargo build -j 2 --release -p ringmq-bench >&2)
fi
command -v curl >/dev/null || { echo "mgmt-load.sh: needs curl" >&2; exit 1; }

work="$(mktemp -d)"
[ -n "$out" ] || out="$work/out"
mkdir -p "$out"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
amqp=$(free_port); mgmt=$(free_port); metrics=$(free_port)
broker_pid=''
scraper_pid=''
cleanup() {
    [ -z "$scraper_pid" ] || kill "$scraper_pid" 2>/dev/null || true
    [ -z "$broker_pid" ] || { kill "$broker_pid" 2>/dev/null || true; wait "$broker_pid" 2>/dev/null || true; }
    rm -rf "$work/data"
}
trap cleanup EXIT

"$broker" --data-dir "$work/data" --listen "127.0.0.1:$amqp" --management-listen "127.0.0.1:$mgmt" \
    --metrics-listen "127.0.0.1:$metrics" --log warn >"$out/broker.log" 2>&1 &
broker_pid=$!
api="http://127.0.0.1:$mgmt/api"
for _ in $(seq 1 100); do
    curl -sf -u guest:guest "$api/overview" >/dev/null 2>&1 && break
    sleep 0.1
done
curl -sf -u guest:guest "$api/overview" >/dev/null || { echo "mgmt-load.sh: the broker did not start" >&2; cat "$out/broker.log" >&2; exit 1; }

echo "mgmt-load.sh: declaring $queues durable queues" >&2
for i in $(seq 1 "$queues"); do
    printf 'url = "%s/queues/%%2F/load-%05d"\n' "$api" "$i"
done >"$work/urls"
t0=$(date +%s.%N)
curl -sf -u guest:guest -X PUT -H 'content-type: application/json' -d '{"durable":true}' \
    --parallel --parallel-max 8 -K "$work/urls" -w "%{http_code}\n" -o /dev/null >"$work/declared" 2>/dev/null || true
have=$(curl -sf -u guest:guest "$api/queues?columns=name" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))')
echo "mgmt-load.sh: the broker lists $have queues; the declares took $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" >&2
[ "$have" -ge "$queues" ] || { echo "mgmt-load.sh: declared $have of $queues queues" >&2; exit 1; }

scrape_loop() {
    local file="$1"
    while :; do
        local t0 now
        t0=$(date +%s.%N)
        for what in "metrics http://127.0.0.1:$metrics/metrics" \
                    "per-object http://127.0.0.1:$metrics/metrics/per-object" \
                    "api-queues $api/queues"; do
            set -- $what
            curl -s -u guest:guest -o /dev/null -w "$1 %{http_code} %{size_download} %{time_total}\n" "$2" >>"$file" || true
        done
        now=$(date +%s.%N)
        sleep "$(python3 -c "print(max(0.0, 1.0 - ($now - $t0)))" 2>/dev/null || echo 1)"
    done
}

uri="amqp://guest:guest@127.0.0.1:$amqp/%2f"
for r in $(seq 1 "$rounds"); do
    for side in quiet scraped; do
        if [ "$side" = scraped ]; then
            scrape_loop "$out/scrapes.txt" &
            scraper_pid=$!
        fi
        "$bench" "${scenario[@]}" --uri "$uri" --broker-pid "$broker_pid" --json --quiet \
            >>"$out/$side.jsonl" 2>>"$out/bench.log" || echo "mgmt-load.sh: bench round failed ($side)" >&2
        if [ -n "$scraper_pid" ]; then
            kill "$scraper_pid" 2>/dev/null || true
            wait "$scraper_pid" 2>/dev/null || true
            scraper_pid=''
        fi
        echo "mgmt-load.sh: round $r $side done" >&2
    done
done

python3 - "$out" <<'EOF'
import json, os, statistics, sys
out = sys.argv[1]
def rows(side):
    with open(os.path.join(out, side + ".jsonl")) as f:
        return [json.loads(l) for l in f if l.strip()]
def med(xs):
    return statistics.median(xs) if xs else float("nan")
def col(rs, key):
    return [r[key] for r in rs if isinstance(r.get(key), (int, float))]
for side in ("quiet", "scraped"):
    rs = rows(side)
    rate, p99, cpu = col(rs, "recv_rate"), col(rs, "confirm_p99_us"), col(rs, "broker_cpu_us_per_msg")
    lost = sum(col(rs, "lost")) + sum(col(rs, "duplicates"))
    print(f"{side:8} consumed msgs/s median {med(rate):,.0f} (rounds {', '.join(f'{x:,.0f}' for x in rate)}); "
          f"confirm p99 median {med(p99):,.0f} µs; broker CPU median {med(cpu):.2f} µs/msg; lost+dup {lost}")
times = {}
bad = 0
with open(os.path.join(out, "scrapes.txt")) as f:
    for line in f:
        name, code, size, t = line.split()
        if code != "200":
            bad += 1
        times.setdefault(name, []).append((float(t) * 1000.0, int(size)))
for name, xs in times.items():
    ms = sorted(t for t, _ in xs)
    p = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]
    print(f"{name:10} n={len(ms)} p50 {p(0.5):.1f} ms  p99 {p(0.99):.1f} ms  max {ms[-1]:.1f} ms  "
          f"({xs[-1][1]:,} bytes)")
print(f"non-200 answers: {bad}")
EOF
echo "mgmt-load.sh: raw figures in $out" >&2
