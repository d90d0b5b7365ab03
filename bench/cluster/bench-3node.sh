#!/usr/bin/env bash
# bench-3node.sh: the persistent confirm + ack scenario against a 3-node ringmq cluster and a
# 3-node RabbitMQ cluster with a quorum queue, on this one machine (loopback).
#
#   bench/cluster/bench-3node.sh ringmq|rabbitmq|both [--duration S] [options]
#
#   --duration S       seconds of publishing per run (default 30)
#   --rounds N         rounds (default 1); `both` runs ringmq and RabbitMQ alternately,
#                      ringmq first: ringmq, rabbitmq, ringmq, rabbitmq, ... A fresh cluster
#                      (fresh data dirs) is started for each round and stopped after it
#   --variants LIST    comma-separated, of: unlimited (as fast as the confirm window allows),
#                      rate (--rate R msgs/s) (default: unlimited,rate)
#   --rate R           msgs/s of the rate variant (default 1000)
#   --cores N          ringmq --cores per node (default 1: 3 nodes on a 2-core machine)
#   --base-port P      ringmq AMQP ports P..P+2 (default 7672); metrics P+10020.. (17692..),
#                      Raft transport P+20000.. (27672..)
#   --drain-timeout S  the bench's drain timeout (default 60)
#   --idle S           after each cluster start, measure the 3 nodes' CPU for S seconds with
#                      no client (default 10; 0 = skip): their idle cost, also in the figures
#   --ringmq PATH      ringmq binary (default: $RINGMQ or target/release/ringmq)
#   --bench PATH       ringmq-bench binary (default: $RINGMQ_BENCH or target/release/ringmq-bench)
#   --out DIR          results (results.jsonl, per-run bench output, node logs, env.txt)
#                      (default: ${TMPDIR:-/tmp}/bench-3node-<date>)
#
# The scenario (every run): 1 producer and 1 consumer, both connected to node 1 (ringmq-bench
# takes one --uri for producers and consumers alike), 1 durable queue declared through node 1
# (RabbitMQ: x-queue-type=quorum, its leader then on node 1; ringmq: a durable queue, which a
# 3-node ringmq replicates on all nodes), 1 KiB bodies, delivery_mode 2, publisher confirms
# with at most 100 outstanding, manual acks (multiple=true every 10 deliveries), prefetch 100:
#
#   ringmq-bench run --uri amqp://guest:guest@127.0.0.1:<node 1>/%2f --queues <q> --persistent \
#       --size 1024 --confirm 100 --multi-ack-every 10 --prefetch 100 --duration 30 \
#       [--queue-args x-queue-type=quorum] [--rate 1000]
#
# A confirm means: ringmq, fdatasync'ed in the Raft log of 2 of the 3 nodes; RabbitMQ quorum
# queue, written (fsync'ed) to the Raft log of 2 of the 3 nodes.
#
# Broker CPU: utime+stime (/proc/<pid>/stat fields 14 and 15, in clock ticks, getconf CLK_TCK)
# of the 3 broker processes (the 3 ringmq processes; the 3 beam.smp of RabbitMQ) read right
# before the bench starts and right after it exits (so setup, drain and teardown of the queue
# are in it), summed over the nodes and divided by the messages consumed. The bench's own
# "broker CPU" figure is node 1's alone (--broker-pid = node 1) over its own run window.
# Also recorded: the machine's busy CPU (/proc/stat) not accounted for by the brokers or the
# bench ("unattributed": kernel threads such as the ext4 journal, other processes), a rough
# check that the machine was quiet. /proc/stat is sampled at each tick (250 Hz here, tickless
# idle) while per-process times are exact, so at low load (the rate variant: short bursts
# between idle periods) it is off by many seconds either way; trust it only when the cores
# are busy.
#
# ringmq nodes: node i listens on 127.0.0.1:P+i-1, its data in a fresh temp dir; the script
# waits (bounded) until each completes an AMQP handshake (pika connection open, or the
# protocol header answered by connection.start when pika is missing) and every node names
# the same metadata leader (ringmq_raft_leader_id on /metrics), exactly one of them leading.
# RabbitMQ: bench/cluster/rabbitmq-3node.sh (AMQP 5682-5684, its own epmd on 4380), run with
# RMQ3_PROMETHEUS=0 (no plugins) and otherwise as shipped; state in a fresh temp dir.
#
# Everything this script starts (nodes, the bench, temp dirs) is stopped and removed on exit,
# also on failure or Ctrl-C; node logs are copied to DIR/logs first. Every wait is bounded.
# Exit status: 0 every run completed with 0 lost, duplicated or nacked and no client error; 1 a
# setup or a run failed (or a check above); 2 usage.
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"

usage() {
    sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'
    exit "${1:-2}"
}

SYSTEM="${1:-}"
case "$SYSTEM" in
    ringmq|rabbitmq|both) shift ;;
    -h|--help|help) usage 0 ;;
    *) usage ;;
esac

DURATION=30
ROUNDS=1
VARIANTS=unlimited,rate
RATE=1000
CORES=1
BASE=7672
DRAIN=60
IDLE=10
RINGMQ_BIN="${RINGMQ:-$ROOT/target/release/ringmq}"
BENCH_BIN="${RINGMQ_BENCH:-$ROOT/target/release/ringmq-bench}"
OUT=''
while [ $# -gt 0 ]; do
    [ $# -ge 2 ] || usage
    case "$1" in
        --duration) DURATION="$2" ;;
        --rounds) ROUNDS="$2" ;;
        --variants) VARIANTS="$2" ;;
        --rate) RATE="$2" ;;
        --cores) CORES="$2" ;;
        --base-port) BASE="$2" ;;
        --drain-timeout) DRAIN="$2" ;;
        --idle) IDLE="$2" ;;
        --ringmq) RINGMQ_BIN="$2" ;;
        --bench) BENCH_BIN="$2" ;;
        --out) OUT="$2" ;;
        *) usage ;;
    esac
    shift 2
done
for n in "$DURATION" "$ROUNDS" "$CORES" "$BASE" "$DRAIN"; do
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] || { echo "bench-3node: not a positive integer: $n" >&2; exit 2; }
done
[[ "$IDLE" =~ ^[0-9]+$ ]] || { echo "bench-3node: --idle: not an integer: $IDLE" >&2; exit 2; }
[[ "$RATE" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "bench-3node: --rate: not a number: $RATE" >&2; exit 2; }
IFS=, read -r -a VARIANT_LIST <<< "$VARIANTS"
for v in "${VARIANT_LIST[@]}"; do
    case "$v" in unlimited|rate) ;; *) echo "bench-3node: unknown variant $v" >&2; exit 2 ;; esac
done

say() { echo "[$(date +%H:%M:%S)] bench-3node: $*" >&2; }
die() { say "$*"; exit 1; }

[ -x "$BENCH_BIN" ] || die "no ringmq-bench at $BENCH_BIN (cargo build --release -p ringmq-bench, or --bench PATH)"
if [ "$SYSTEM" != rabbitmq ]; then
    [ -x "$RINGMQ_BIN" ] || die "no ringmq at $RINGMQ_BIN (cargo build --release, or --ringmq PATH)"
fi
command -v python3 > /dev/null || die "needs python3"
command -v curl > /dev/null || die "needs curl"

OUT="${OUT:-${TMPDIR:-/tmp}/bench-3node-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT/logs" "$OUT/runs"
RESULTS="$OUT/results.jsonl"
TICK="$(getconf CLK_TCK)"

# State for cleanup.
TMP=''            # temp dir of the current cluster
RQ_PIDS=()        # ringmq node pids we started
RQ_LEADER=''      # the metadata leader when the cluster was up
RMQ_DIR=''        # rabbitmq-3node.sh state dir while a RabbitMQ cluster may be up
BENCH_PID=''
FAILED=0

# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2> /dev/null; }
port_listening() { [ -n "$(ss -Hltn "sport = :$1" 2> /dev/null)" ]; }

# utime+stime of a process, in clock ticks (fields 14 and 15 of /proc/<pid>/stat; the fields
# are counted after the ")" closing the command name, which may contain spaces).
cpu_ticks() {
    local s
    s="$(cat "/proc/$1/stat" 2> /dev/null)" || { echo -1; return; }
    s="${s##*) }"
    # shellcheck disable=SC2086 # split the fields
    set -- $s
    echo $(( ${12} + ${13} ))
}

# busy ticks of the whole machine: user+nice+system+irq+softirq of the /proc/stat "cpu" line.
machine_ticks() {
    awk '$1 == "cpu" { print $2 + $3 + $4 + $7 + $8; exit }' /proc/stat
}

# A real AMQP handshake against 127.0.0.1:$1 (a bare TCP connect proves nothing: a connect to
# a free loopback port can connect to itself). Bounded by its socket timeouts and `timeout`.
amqp_handshake() {
    timeout 20 python3 - "$1" > /dev/null 2>&1 <<'EOF'
import socket, sys
port = int(sys.argv[1])
try:
    import pika
except ImportError:
    pika = None
if pika is not None:
    c = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", port, credentials=pika.PlainCredentials("guest", "guest"),
        connection_attempts=1, socket_timeout=3, stack_timeout=8, blocked_connection_timeout=5))
    ch = c.channel()
    ch.close()
    c.close()
else:
    s = socket.create_connection(("127.0.0.1", port), timeout=3)
    s.settimeout(5)
    s.sendall(b"AMQP\x00\x00\x09\x01")
    buf = b""
    while len(buf) < 11:
        chunk = s.recv(64)
        if not chunk:
            sys.exit(1)
        buf += chunk
    # method frame (type 1) on channel 0 carrying connection.start (class 10, method 10)
    sys.exit(0 if buf[0] == 1 and buf[1:3] == b"\0\0" and buf[7:11] == b"\0\x0a\0\x0a" else 1)
EOF
}

metric() { # metric PORT NAME -> value or empty
    local body
    body="$(curl -s --max-time 2 "http://127.0.0.1:$1/metrics" 2> /dev/null)" || true
    awk -v n="$2" '$1 == n { print $2; exit }' <<< "$body"
}

# ---------------------------------------------------------------------------------------
# ringmq cluster
# ---------------------------------------------------------------------------------------

rq_amqp() { echo $((BASE + $1 - 1)); }
rq_metrics() { echo $((BASE + 10020 + $1 - 1)); }
rq_cluster() { echo $((BASE + 20000 + $1 - 1)); }

start_ringmq() {
    local i p peers=''
    for i in 1 2 3; do
        for p in "$(rq_amqp "$i")" "$(rq_metrics "$i")" "$(rq_cluster "$i")"; do
            port_listening "$p" && die "127.0.0.1:$p is already in use (ss -ltnp 'sport = :$p'); try --base-port"
        done
        peers="${peers:+$peers,}$i=127.0.0.1:$(rq_cluster "$i")"
    done
    TMP="$(mktemp -d "${TMPDIR:-/tmp}/bench-3node-ringmq.XXXXXX")"
    RQ_PIDS=()
    for i in 1 2 3; do
        "$RINGMQ_BIN" --node-id "$i" --cores "$CORES" \
            --listen "127.0.0.1:$(rq_amqp "$i")" --metrics-listen "127.0.0.1:$(rq_metrics "$i")" \
            --cluster-listen "127.0.0.1:$(rq_cluster "$i")" --data-dir "$TMP/d$i" --peers "$peers" \
            > "$TMP/node$i.log" 2>&1 < /dev/null &
        RQ_PIDS+=($!)
    done
    say "ringmq: started nodes (pids ${RQ_PIDS[*]}, --cores $CORES) on AMQP $(rq_amqp 1)-$(rq_amqp 3), data in $TMP"
    local deadline=$((SECONDS + 120)) up
    while :; do
        up=0
        for i in 1 2 3; do
            if ! alive "${RQ_PIDS[$((i - 1))]}"; then
                tail -n 20 "$TMP/node$i.log" >&2 || true
                die "ringmq node $i exited during start"
            fi
            amqp_handshake "$(rq_amqp "$i")" && up=$((up + 1))
        done
        [ "$up" = 3 ] && break
        [ $SECONDS -lt $deadline ] || die "ringmq: only $up of 3 nodes answered an AMQP handshake within 120 s (logs $TMP/node*.log)"
        sleep 0.5
    done
    local l1 l2 l3 leaders
    while :; do
        l1="$(metric "$(rq_metrics 1)" ringmq_raft_leader_id)"
        l2="$(metric "$(rq_metrics 2)" ringmq_raft_leader_id)"
        l3="$(metric "$(rq_metrics 3)" ringmq_raft_leader_id)"
        leaders=0
        for i in 1 2 3; do
            [ "$(metric "$(rq_metrics "$i")" ringmq_raft_is_leader)" = 1 ] && leaders=$((leaders + 1))
        done
        if [ -n "$l1" ] && [ "$l1" != 0 ] && [ "$l1" = "$l2" ] && [ "$l2" = "$l3" ] && [ "$leaders" = 1 ]; then
            break
        fi
        [ $SECONDS -lt $deadline ] || die "ringmq: no agreed metadata leader within 120 s (leader ids: '$l1' '$l2' '$l3', $leaders leading)"
        sleep 0.5
    done
    RQ_LEADER="$l1"
    say "ringmq: 3 nodes answer AMQP; metadata leader is node $l1"
}

stop_ringmq() {
    local i pid
    for pid in "${RQ_PIDS[@]}"; do
        alive "$pid" && kill -TERM "$pid" 2> /dev/null || true
    done
    for pid in "${RQ_PIDS[@]}"; do
        for _ in $(seq 1 100); do
            alive "$pid" || break
            sleep 0.2
        done
        if alive "$pid"; then
            say "ringmq pid $pid still up 20 s after SIGTERM: SIGKILL"
            kill -KILL "$pid" 2> /dev/null || true
        fi
        wait "$pid" 2> /dev/null || true
    done
    RQ_PIDS=()
    if [ -n "$TMP" ] && [ -d "$TMP" ]; then
        for i in 1 2 3; do
            if [ -f "$TMP/node$i.log" ]; then cp "$TMP/node$i.log" "$OUT/logs/${LOG_PREFIX:-ringmq}-node$i.log" || true; fi
        done
        log_check "$OUT/logs/${LOG_PREFIX:-ringmq}-node"?.log
        rm -rf "$TMP"
    fi
    TMP=''
}

# ---------------------------------------------------------------------------------------
# RabbitMQ cluster (bench/cluster/rabbitmq-3node.sh)
# ---------------------------------------------------------------------------------------

RMQ_PIDS=()

start_rabbitmq() {
    RMQ_DIR="$(mktemp -d "${TMPDIR:-/tmp}/bench-3node-rabbitmq.XXXXXX")"
    say "rabbitmq: starting 3 nodes with rabbitmq-3node.sh (state in $RMQ_DIR)"
    RMQ3_PROMETHEUS=0 timeout 900 "$HERE/rabbitmq-3node.sh" --dir "$RMQ_DIR" start > "$OUT/logs/${LOG_PREFIX:-rabbitmq}-start.log" 2>&1 ||
        { tail -n 30 "$OUT/logs/${LOG_PREFIX:-rabbitmq}-start.log" >&2; die "rabbitmq: cluster start failed"; }
    tail -n 1 "$OUT/logs/${LOG_PREFIX:-rabbitmq}-start.log" >&2
    RMQ_PIDS=()
    local i pid
    for i in 1 2 3; do
        pid="$(cat "$RMQ_DIR/rabbit$i/beam.pid" 2> /dev/null || true)"
        [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2> /dev/null)" = beam.smp ] || pid=''
        if [ -z "$pid" ]; then # by the AMQP port's listener
            pid="$(ss -Hltnp "sport = :$((5682 + i - 1))" 2> /dev/null | grep -o 'pid=[0-9]*' | head -n1 | cut -d= -f2 || true)"
        fi
        [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2> /dev/null)" = beam.smp ] || die "rabbitmq: no beam.smp pid for node $i"
        amqp_handshake $((5682 + i - 1)) || die "rabbitmq: node $i does not answer an AMQP handshake"
        RMQ_PIDS+=("$pid")
    done
    say "rabbitmq: 3 nodes answer AMQP on 5682-5684 (beam.smp pids ${RMQ_PIDS[*]})"
}

stop_rabbitmq() {
    [ -n "$RMQ_DIR" ] || return 0
    timeout 300 "$HERE/rabbitmq-3node.sh" --dir "$RMQ_DIR" stop > /dev/null 2>&1 || say "rabbitmq: rabbitmq-3node.sh stop failed"
    local i pid
    for pid in "${RMQ_PIDS[@]}"; do # should be gone already; by pid only
        if alive "$pid" && [ "$(cat "/proc/$pid/comm" 2> /dev/null)" = beam.smp ]; then
            say "rabbitmq: beam.smp $pid still up: SIGKILL"
            kill -KILL "$pid" 2> /dev/null || true
        fi
    done
    for i in 1 2 3; do
        if [ -f "$RMQ_DIR/rabbit$i/server.log" ]; then cp "$RMQ_DIR/rabbit$i/server.log" "$OUT/logs/${LOG_PREFIX:-rabbitmq}-node$i-server.log" || true; fi
        for f in "$RMQ_DIR/rabbit$i/log"/*.log; do
            if [ -f "$f" ]; then cp "$f" "$OUT/logs/${LOG_PREFIX:-rabbitmq}-node$i-$(basename "$f")" || true; fi
        done
    done
    log_check "$OUT/logs/${LOG_PREFIX:-rabbitmq}-node"?-rabbit?@localhost.log
    if [ -f "$RMQ_DIR/join.log" ]; then cp "$RMQ_DIR/join.log" "$OUT/logs/${LOG_PREFIX:-rabbitmq}-join.log" || true; fi
    rm -rf "$RMQ_DIR"
    RMQ_DIR=''
    RMQ_PIDS=()
}

# log_check FILE...: how many warning and error lines each node log has (the first few shown).
log_check() {
    local f w e
    for f in "$@"; do
        [ -f "$f" ] || continue
        w="$(grep -c -E ' WARN |\[warning\]' "$f" || true)"
        e="$(grep -c -E ' ERROR |\[error\]|panicked' "$f" || true)"
        say "log $(basename "$f"): $w warning line(s), $e error line(s)"
        grep -E ' ERROR |\[error\]|panicked' "$f" | head -n 3 | cut -c1-200 >&2 || true
    done
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if alive "$BENCH_PID"; then kill -TERM "$BENCH_PID" 2> /dev/null || true; sleep 1; kill -KILL "$BENCH_PID" 2> /dev/null || true; fi
    if [ ${#RQ_PIDS[@]} -gt 0 ] || [ -n "$TMP" ]; then stop_ringmq || true; fi
    stop_rabbitmq || true
    [ "$rc" = 0 ] && [ "$FAILED" != 0 ] && rc=1
    say "results in $OUT (results.jsonl, runs/, logs/)"
    exit "$rc"
}
trap cleanup EXIT
trap 'say "failed (status $?) at line $LINENO: $BASH_COMMAND"' ERR
trap 'exit 130' INT
trap 'exit 143' TERM

# idle_cpu SYSTEM ROUND PID1 PID2 PID3: CPU of the 3 nodes over $IDLE s with no client.
idle_cpu() {
    local system="$1" round="$2" i before=() after=()
    shift 2
    [ "$IDLE" -gt 0 ] || return 0
    for i in 1 2 3; do before+=("$(cpu_ticks "${!i}")"); done
    sleep "$IDLE"
    for i in 1 2 3; do after+=("$(cpu_ticks "${!i}")"); done
    python3 - "$OUT/idle.jsonl" "$system" "$round" "$IDLE" "$TICK" "${before[*]}" "${after[*]}" <<'EOF' || true
import json, sys
path, system, rnd, secs, tick, before, after = sys.argv[1:]
node_s = [(int(a) - int(b)) / int(tick) for a, b in zip(after.split(), before.split())]
j = {"system": system, "round": int(rnd), "idle_s": int(secs), "cpu_s_per_node": [round(x, 2) for x in node_s],
     "cores_busy_idle": round(sum(node_s) / int(secs), 3)}
open(path, "a").write(json.dumps(j) + "\n")
print(f"{system:8} idle      r{rnd}: 3 nodes with no client used {j['cores_busy_idle']:.3f} cores "
      f"(CPU s per node over {secs} s: {j['cpu_s_per_node']})", flush=True)
EOF
}

# ---------------------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------------------

# run_one SYSTEM VARIANT ROUND PORT PID1 PID2 PID3
run_one() {
    local system="$1" variant="$2" round="$3" port="$4"
    shift 4
    local pids=("$@") name="$system-$variant-r$round" i
    local args=(run --uri "amqp://guest:guest@127.0.0.1:$port/%2f" --queues "bench-3node-$variant"
        --producers 1 --consumers 1 --persistent --size 1024 --confirm 100 --multi-ack-every 10
        --prefetch 100 --duration "$DURATION" --drain-timeout "$DRAIN" --json
        --broker-pid "${pids[0]}" --label "$system $variant round $round")
    [ "$system" = rabbitmq ] && args+=(--queue-args x-queue-type=quorum)
    [ "$variant" = rate ] && args+=(--rate "$RATE")
    echo "ringmq-bench ${args[*]}" > "$OUT/runs/$name.cmd"

    local before=() after=() m0 m1 load rc=0
    load="$(cut -d' ' -f1-3 /proc/loadavg)"
    for i in 0 1 2; do before+=("$(cpu_ticks "${pids[$i]}")"); done
    m0="$(machine_ticks)"
    say "$name: ringmq-bench ${args[*]}"
    timeout -k 5 $((DURATION + 2 * DRAIN + 150)) "$BENCH_BIN" "${args[@]}" > "$OUT/runs/$name.json" 2> "$OUT/runs/$name.err" &
    BENCH_PID=$!
    wait "$BENCH_PID" || rc=$?
    BENCH_PID=''
    m1="$(machine_ticks)"
    # ringmq: where the metadata group's leader was (it moves throughput: a queue served by
    # another node forwards its proposals to it); "2->3" when it moved during the run.
    local leader='' now=''
    if [ "$system" = ringmq ]; then
        leader="$RQ_LEADER"
        now="$(metric "$(rq_metrics 1)" ringmq_raft_leader_id || true)"
        [ -n "$now" ] && [ "$now" != "$leader" ] && leader="$leader->$now"
    fi
    for i in 0 1 2; do after+=("$(cpu_ticks "${pids[$i]}")"); done
    local dead=''
    for i in 0 1 2; do alive "${pids[$i]}" || dead="$dead $((i + 1))"; done

    python3 - "$OUT/runs/$name.json" "$RESULTS" "$system" "$variant" "$round" "$rc" "$TICK" \
        "${before[*]}" "${after[*]}" "$m0" "$m1" "$load" "$dead" "$CORES" "$leader" <<'EOF' || FAILED=1
import json, sys
(path, results, system, variant, rnd, rc, tick, before, after, m0, m1, load, dead, cores, leader) = sys.argv[1:]
tick = int(tick)
before = [int(x) for x in before.split()]
after = [int(x) for x in after.split()]
try:
    with open(path) as f:
        lines = [l for l in f.read().splitlines() if l.strip().startswith("{")]
    j = json.loads(lines[-1])
except Exception as e:
    j = {"error": f"no JSON from ringmq-bench ({e})"}
j.update(system=system, variant=variant, round=int(rnd), bench_exit=int(rc), loadavg_before=load,
         ringmq_cores=int(cores) if system == "ringmq" else None,
         metadata_leader=(leader or None) if system == "ringmq" else None)
ok = "sent" in j and all(b >= 0 and a >= b for a, b in zip(after, before))
if ok:
    node_s = [(a - b) / tick for a, b in zip(after, before)]
    n = j.get("received") or j.get("sent") or 0
    j["cluster_cpu_s_per_node"] = [round(x, 2) for x in node_s]
    j["cluster_cpu_s"] = round(sum(node_s), 2)
    j["cluster_cpu_us_per_msg"] = round(sum(node_s) * 1e6 / n, 2) if n else None
    busy = (int(m1) - int(m0)) / tick
    j["machine_busy_cpu_s"] = round(busy, 2)
    j["machine_unattributed_cpu_s"] = round(busy - sum(node_s) - (j.get("bench_cpu_s") or 0), 2)
if dead.strip():
    j["nodes_died"] = [int(x) for x in dead.split()]
with open(results, "a") as f:
    f.write(json.dumps(j, sort_keys=True) + "\n")

def ms(k):
    v = j.get(k)
    return "-" if v is None else f"{v / 1000:.2f} ms"
if not ok:
    print(f"{system:8} {variant:9} r{rnd}: FAILED (bench exit {rc}): {j.get('error') or j.get('first_error')}"
          f"{' nodes died: ' + dead if dead.strip() else ''}", flush=True)
    sys.exit(1)
print(f"{system:8} {variant:9} r{rnd}: published {j['send_rate']:,.0f}/s consumed {j['recv_rate']:,.0f}/s | "
      f"confirm p50 {ms('confirm_p50_us')} p99 {ms('confirm_p99_us')} | e2e p50 {ms('e2e_p50_us')} p99 {ms('e2e_p99_us')} | "
      f"lost {j.get('lost')} dup {j.get('duplicates')} nacked {j.get('nacked')} unconfirmed {j.get('unconfirmed')} "
      f"errors {j.get('errors')} | CPU 3 nodes {j['cluster_cpu_us_per_msg']} µs/msg "
      f"(s per node {j['cluster_cpu_s_per_node']}), node 1 by the bench {j.get('broker_cpu_us_per_msg')} µs/msg, "
      f"bench {j.get('bench_cpu_us_per_msg')} µs/msg | unattributed machine CPU {j['machine_unattributed_cpu_s']} s (approximate)",
      flush=True)
bad = (j.get("lost") not in (0,) or j.get("duplicates") not in (0,) or j.get("errors") or j.get("nacked")
       or int(rc) != 0 or dead.strip())
sys.exit(1 if bad else 0)
EOF
    if [ -n "$dead" ]; then
        FAILED=1
        die "$name: node(s)$dead died during the run"
    fi
}

# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------

{
    echo "date: $(date -Is)"
    echo "nproc: $(nproc)"
    echo "kernel: $(uname -srm)"
    grep -m1 'model name' /proc/cpuinfo || true
    echo "mem: $(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo)"
    echo "ringmq: $RINGMQ_BIN $([ -x "$RINGMQ_BIN" ] && "$RINGMQ_BIN" --version 2>/dev/null || true), built $(date -r "$RINGMQ_BIN" -Is 2>/dev/null || echo '?'), --cores $CORES per node"
    echo "source tree now: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" status --porcelain 2>/dev/null | grep -q . && echo ' + uncommitted changes' || true) (not necessarily what the binary was built from)"
    echo "ringmq-bench: $BENCH_BIN"
    echo "rabbitmq-server: $(dpkg-query -W -f='${Version}' rabbitmq-server 2>/dev/null || echo 'not installed')"
    echo "duration ${DURATION}s, rounds $ROUNDS, variants $VARIANTS, rate $RATE, drain-timeout ${DRAIN}s, CLK_TCK $TICK"
} > "$OUT/env.txt"
say "output in $OUT; $(nproc) cores; duration ${DURATION}s; variants $VARIANTS; rounds $ROUNDS"

case "$SYSTEM" in
    both) SYSTEMS=(ringmq rabbitmq) ;;
    *) SYSTEMS=("$SYSTEM") ;;
esac

for r in $(seq 1 "$ROUNDS"); do
    for s in "${SYSTEMS[@]}"; do
        LOG_PREFIX="$s-r$r"
        if [ "$s" = ringmq ]; then
            start_ringmq
            idle_cpu ringmq "$r" "${RQ_PIDS[@]}"
            for v in "${VARIANT_LIST[@]}"; do
                run_one ringmq "$v" "$r" "$(rq_amqp 1)" "${RQ_PIDS[@]}" || FAILED=1
            done
            stop_ringmq
        else
            start_rabbitmq
            idle_cpu rabbitmq "$r" "${RMQ_PIDS[@]}"
            for v in "${VARIANT_LIST[@]}"; do
                run_one rabbitmq "$v" "$r" 5682 "${RMQ_PIDS[@]}" || FAILED=1
            done
            stop_rabbitmq
        fi
    done
done

# Summary table of this invocation's runs, and ringmq/RabbitMQ ratios per variant.
python3 - "$RESULTS" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if "send_rate" in r and "cluster_cpu_us_per_msg" in r]
def ms(v): return "-" if v is None else f"{v / 1000:.2f}"
print()
print("| broker | variant | round | published msgs/s | consumed msgs/s | confirm p50 / p99 ms | e2e p50 / p99 ms | lost / dup / nacked | broker CPU µs/msg, 3 nodes | node 1 µs/msg (bench) | bench µs/msg |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['system']} | {r['variant']} | {r['round']} | {r['send_rate']:,.0f} | {r['recv_rate']:,.0f} | "
          f"{ms(r.get('confirm_p50_us'))} / {ms(r.get('confirm_p99_us'))} | {ms(r.get('e2e_p50_us'))} / {ms(r.get('e2e_p99_us'))} | "
          f"{r.get('lost')} / {r.get('duplicates')} / {r.get('nacked')} | {r['cluster_cpu_us_per_msg']} | "
          f"{r.get('broker_cpu_us_per_msg')} | {r.get('bench_cpu_us_per_msg')} |")
for v in sorted({r["variant"] for r in rows}):
    a = [r for r in rows if r["variant"] == v and r["system"] == "ringmq"]
    b = [r for r in rows if r["variant"] == v and r["system"] == "rabbitmq"]
    if not a or not b:
        continue
    med = lambda xs, k: statistics.median(x[k] for x in xs if x.get(k) is not None)
    print(f"\n{v}: ringmq/RabbitMQ (medians of {len(a)} and {len(b)} runs): "
          f"msgs/s consumed {med(a, 'recv_rate') / med(b, 'recv_rate'):.2f}x, "
          f"confirm p99 {med(a, 'confirm_p99_us') / med(b, 'confirm_p99_us'):.2f}x, "
          f"confirm p50 {med(a, 'confirm_p50_us') / med(b, 'confirm_p50_us'):.2f}x, "
          f"broker CPU/msg (3 nodes) {med(a, 'cluster_cpu_us_per_msg') / med(b, 'cluster_cpu_us_per_msg'):.2f}x")
EOF
