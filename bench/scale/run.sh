#!/usr/bin/env bash
# Many idle durable queues and many connections against one release ringmq (issue 14, item 5).
#
#   bash bench/scale/run.sh queues [N]        # N idle durable queues (default 10000)
#   bash bench/scale/run.sh connections [N]   # N connections with a channel each (default 10000)
#   bash bench/scale/run.sh stall [N]         # a 1,000 msgs/s flow's latency, quiet and while N open,
#                                             # through ringmq and through the bench's relay (the floor)
#
# queues: declares N durable queues through one pika connection, then reports the broker's
# RSS, open descriptors and disk (du) right after, after 15 s idle (idle queues close), and
# after a restart (time until a passive declare + publish + get round trip answers).
# connections: opens N connections (handshake + channel.open, raw sockets) and reports RSS per
# connection while they are open and after they close. Needs python3 with pika, and
# `ulimit -n` above N (the script raises its soft limit).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
what=${1:-queues}
n=${2:-10000}
(cd "$root" && cargo build --release -q --bin ringmq)
bin=$root/target/release/ringmq
data=$(mktemp -d)
port=$((20000 + RANDOM % 20000))
args=(--listen 127.0.0.1:$port --management-listen off --metrics-listen 127.0.0.1:$((port + 1)) --data-dir "$data")
rss() { awk '/VmRSS/{print $2}' /proc/"$1"/status; }
fds() { ls /proc/"$1"/fd | wc -l; }
start() {
    "$bin" "${args[@]}" >> "$data.log" 2>&1 &
    pid=$!
    for _ in $(seq 100); do grep -q "ringmq ready" "$data.log" 2>/dev/null && return; sleep 0.05; done
}
stop() { kill "$pid"; wait "$pid" || true; }
trap 'kill $pid 2>/dev/null || true; rm -rf "$data" "$data.log"' EXIT
ulimit -n "$(ulimit -Hn)"
start
case $what in
queues)
    idle_rss=$(rss $pid)
    python3 "$here/declare.py" $port "$n"
    echo "declared: rss $(rss $pid) kB (idle broker $idle_rss kB), $(fds $pid) descriptors, disk $(du -sk "$data" | cut -f1) kB"
    sleep 15
    echo "after 15 s idle: rss $(rss $pid) kB, $(fds $pid) descriptors, disk $(du -sk "$data" | cut -f1) kB"
    stop
    t0=$(date +%s.%N)
    start
    python3 "$here/reopen.py" $port "$n"
    echo "restart to serving: $(echo "$(date +%s.%N) - $t0" | bc) s; rss $(rss $pid) kB, $(fds $pid) descriptors"
    ;;
connections)
    python3 "$here/connections.py" $port "$n" $pid ch
    ;;
stall)
    (cd "$root" && cargo build --release -q -p ringmq-bench)
    uri="amqp://guest:guest@127.0.0.1:$port/%2f"
    flow() { "$root/target/release/ringmq-bench" run --uri "$uri" --size 1024 --rate 1000 --confirm 100 --duration 14 2>&1 | grep -E "^\[|^ +(published|integrity|e2e|confirm) "; }
    # The same flow through the bench's own relay (`ringmq-bench floor`): the machine's floor.
    floor() { "$root/target/release/ringmq-bench" floor --size 1024 --rate 1000 --confirm 100 --duration 14 2>&1 | grep -E "^\[|^ +(published|integrity|e2e|confirm) "; }
    opening() { (sleep 1; python3 "$here/connections.py" $port "$n" $pid ch > "$data.conns" 2>&1) & opener=$!; }
    echo "== quiet"; flow
    echo "== floor, quiet"; floor
    opening
    echo "== while $n connections open"; flow
    wait $opener; cat "$data.conns"
    opening
    echo "== floor while $n connections open to ringmq"; floor
    wait $opener; cat "$data.conns"; rm -f "$data.conns"
    ;;
*) echo "usage: $0 queues|connections|stall [N]" >&2; exit 64 ;;
esac
stop
