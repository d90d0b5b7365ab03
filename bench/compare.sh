#!/usr/bin/env bash
# A/B comparison of two AMQP brokers with ringmq-bench: runs the same scenario against
# URI A and URI B alternately (A B A B …, --rounds times each) and prints the median of
# every figure and the ratio A/B. See bench/README.md.
#
#   bench/compare.sh [options] -- <scenario> [ringmq-bench flags]
#
#   --a URI          side A (default: ringmq's default amqp://guest:guest@127.0.0.1:5672/%2f);
#                    "none" runs side B only
#   --b URI          side B
#   --rabbitmq       side B is Debian's rabbitmq-server, installed if missing, started on a
#                    free loopback port with its own temporary data dir, stopped at the end
#   --label-a NAME   (default: ringmq)      --label-b NAME (default: rabbitmq or B)
#   --rounds N       rounds per side (default 3, at least 3 for a median worth the name)
#   --bench PATH     ringmq-bench binary (default: target/release/ringmq-bench, built if missing)
#   --out DIR        keep the JSON lines (a.jsonl, b.jsonl) there (default: a temp dir)
#   --floor          also run `ringmq-bench floor` with the same flags in every round (the
#                    bench's own relay: this machine's latency floor) and report A and B
#                    against it (floor.jsonl)
#
# Example:
#   bench/compare.sh --rabbitmq -- throughput --duration 10
#   bench/compare.sh --rabbitmq --a none -- latency --duration 10
#   bench/compare.sh --rabbitmq --floor -- latency --duration 10
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
uri_a='amqp://guest:guest@127.0.0.1:5672/%2f'
uri_b=''
label_a='ringmq'
label_b=''
rounds=3
bench=''
out=''
rabbitmq=0
floor=0

while [ $# -gt 0 ]; do
    case "$1" in
        --a) uri_a="$2"; shift 2 ;;
        --b) uri_b="$2"; shift 2 ;;
        --rabbitmq) rabbitmq=1; shift ;;
        --floor) floor=1; shift ;;
        --label-a) label_a="$2"; shift 2 ;;
        --label-b) label_b="$2"; shift 2 ;;
        --rounds) rounds="$2"; shift 2 ;;
        --bench) bench="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "compare.sh: unknown option $1 (scenario flags go after --)" >&2; exit 1 ;;
    esac
done
[ $# -ge 1 ] || { echo "compare.sh: missing scenario after --" >&2; exit 1; }
[ "$rounds" -ge 1 ] 2>/dev/null || { echo "compare.sh: --rounds must be a number" >&2; exit 1; }

if [ -z "$bench" ]; then
    bench="$root/target/release/ringmq-bench"
    if [ ! -x "$bench" ]; then
        echo "compare.sh: building ringmq-bench (release)" >&2
        (cd "$root" && cargo build -j 2 --release -p ringmq-bench >&2)
    fi
fi
[ -x "$bench" ] || { echo "compare.sh: no ringmq-bench binary at $bench" >&2; exit 1; }

workdir="$(mktemp -d "${TMPDIR:-/tmp}/ringmq-compare.XXXXXX")"
[ -n "$out" ] || out="$workdir"
mkdir -p "$out"
: > "$out/a.jsonl"
: > "$out/b.jsonl"
: > "$out/floor.jsonl"

# --- RabbitMQ on a free loopback port -------------------------------------------------
rmq_dir=''
rmq_pid=''
epmd_pid=''

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

port_open() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# The RabbitMQ process tree (server script, beam.smp, its helpers), deepest last.
rmq_tree() {
    local todo="$1" pid kids
    while [ -n "$todo" ]; do
        set -- $todo; pid=$1; shift; todo="$*"
        echo "$pid"
        kids="$(cat /proc/"$pid"/task/*/children 2>/dev/null || true)"
        [ -n "$kids" ] && todo="$todo $kids"
    done
}

# While side A runs, RabbitMQ is frozen (SIGSTOP) so that its idle schedulers (Erlang busy-
# waits before sleeping) take no CPU from A on a small machine; it resumes for its rounds.
rmq_signal() {
    [ -n "$rmq_pid" ] || return 0
    for p in $(rmq_tree "$rmq_pid"); do kill -"$1" "$p" 2>/dev/null || true; done
}

stop_rabbitmq() {
    rmq_signal CONT
    if [ -n "$rmq_pid" ] && kill -0 "$rmq_pid" 2>/dev/null; then
        # The wrapper script traps TERM and runs `rabbitmqctl stop`.
        kill -TERM "$rmq_pid" 2>/dev/null || true
        for _ in $(seq 1 60); do
            kill -0 "$rmq_pid" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 "$rmq_pid" 2>/dev/null; then
            for child in $(cat "/proc/$rmq_pid/task/$rmq_pid/children" 2>/dev/null); do
                kill -KILL "$child" 2>/dev/null || true
            done
            kill -KILL "$rmq_pid" 2>/dev/null || true
        fi
        wait "$rmq_pid" 2>/dev/null || true
    fi
    if [ -n "$epmd_pid" ] && kill -0 "$epmd_pid" 2>/dev/null; then
        kill -TERM "$epmd_pid" 2>/dev/null || true
        wait "$epmd_pid" 2>/dev/null || true
    fi
    rmq_pid=''
    epmd_pid=''
}

cleanup() {
    stop_rabbitmq
    if [ -n "$rmq_dir" ]; then rm -rf "$rmq_dir"; fi
    if [ "$out" != "$workdir" ]; then rm -rf "$workdir"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start_rabbitmq() {
    if [ ! -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then
        echo "compare.sh: installing Debian's rabbitmq-server" >&2
        [ "$(id -u)" = 0 ] || { echo "compare.sh: need root to apt-get install rabbitmq-server" >&2; exit 1; }
        DEBIAN_FRONTEND=noninteractive apt-get update >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y rabbitmq-server >&2
    fi
    rmq_dir="$(mktemp -d "${TMPDIR:-/tmp}/ringmq-rabbitmq.XXXXXX")"
    local amqp dist epmd_port
    amqp="$(free_port)"; dist="$(free_port)"; epmd_port="$(free_port)"
    cat > "$rmq_dir/rabbitmq.conf" <<EOF
listeners.tcp.default = 127.0.0.1:$amqp
loopback_users.guest = true
EOF
    echo '[].' > "$rmq_dir/enabled_plugins"
    # Our own epmd on a free port, so we never touch (or depend on) a system one.
    epmd -port "$epmd_port" -address 127.0.0.1 > "$rmq_dir/epmd.log" 2>&1 &
    epmd_pid=$!
    (
        export HOME="$rmq_dir" ERL_EPMD_PORT="$epmd_port" ERL_EPMD_ADDRESS=127.0.0.1
        export RABBITMQ_NODENAME="ringmqbench$$@localhost"
        export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT="$amqp" RABBITMQ_DIST_PORT="$dist"
        export RABBITMQ_MNESIA_BASE="$rmq_dir/mnesia" RABBITMQ_LOG_BASE="$rmq_dir/log"
        export RABBITMQ_CONFIG_FILE="$rmq_dir/rabbitmq" RABBITMQ_ENABLED_PLUGINS_FILE="$rmq_dir/enabled_plugins"
        export RABBITMQ_PLUGINS_EXPAND_DIR="$rmq_dir/plugins-expand" RABBITMQ_PID_FILE="$rmq_dir/rabbitmq.pid"
        export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
        exec /usr/lib/rabbitmq/bin/rabbitmq-server > "$rmq_dir/server.log" 2>&1 < /dev/null
    ) &
    rmq_pid=$!
    for _ in $(seq 1 120); do
        if port_open "$amqp"; then
            uri_b="amqp://guest:guest@127.0.0.1:$amqp/%2f"
            echo "compare.sh: RabbitMQ ($(dpkg-query -W -f='${Version}' rabbitmq-server 2>/dev/null || echo '?')) up on 127.0.0.1:$amqp" >&2
            return 0
        fi
        kill -0 "$rmq_pid" 2>/dev/null || break
        sleep 0.5
    done
    echo "compare.sh: RabbitMQ did not start; log:" >&2
    tail -n 30 "$rmq_dir/server.log" >&2 || true
    exit 1
}

if [ "$rabbitmq" = 1 ]; then
    start_rabbitmq
    [ -n "$label_b" ] || label_b='rabbitmq'
fi
[ -n "$uri_b" ] || { echo "compare.sh: give --b URI or --rabbitmq" >&2; exit 1; }
[ -n "$label_b" ] || label_b='B'

one() { # side uri label file
    local side="$1" uri="$2" label="$3" file="$4"; shift 4
    echo "compare.sh: $label: ringmq-bench $*" >&2
    set +e
    "$bench" "$@" --uri "$uri" --json --quiet --label "$label" 2> "$workdir/last.err" | tail -n 1 >> "$file"
    local rc=${PIPESTATUS[0]}
    set -e
    grep -E '^  ' "$workdir/last.err" | grep -v '^  setup' >&2 || true
    if [ "$rc" != 0 ]; then
        echo "compare.sh: $label ($side) exited $rc" >&2
        tail -n 5 "$workdir/last.err" >&2 || true
    fi
}

for r in $(seq 1 "$rounds"); do
    echo "compare.sh: --- round $r/$rounds" >&2
    if [ "$uri_a" != none ]; then
        rmq_signal STOP
        one A "$uri_a" "$label_a" "$out/a.jsonl" "$@"
        rmq_signal CONT
    fi
    one B "$uri_b" "$label_b" "$out/b.jsonl" "$@"
    if [ "$floor" = 1 ]; then
        # The relay replaces --uri; the scenario's flags stay.
        rmq_signal STOP
        one F "(the bench's relay)" floor "$out/floor.jsonl" floor "${@:2}"
        rmq_signal CONT
    fi
done

echo
echo "scenario: ringmq-bench $*"
"$bench" report --label-a "$label_a" --label-b "$label_b" "$out/a.jsonl" "$out/b.jsonl"
if [ "$floor" = 1 ]; then
    for side in a b; do
        [ -s "$out/$side.jsonl" ] || continue
        label=$([ "$side" = a ] && echo "$label_a" || echo "$label_b")
        echo
        echo "$label against this machine's floor (ringmq-bench floor ${*:2}):"
        "$bench" report --label-a "$label" --label-b floor "$out/$side.jsonl" "$out/floor.jsonl" || true
    done
fi
echo "(JSON lines in $out)"
