#!/usr/bin/env bash
# rabbitmq-3node.sh: a 3-node RabbitMQ cluster on this one machine, on loopback, to benchmark
# ringmq's cluster against.
#
#   bench/cluster/rabbitmq-3node.sh start     # fresh cluster: rabbit1/2/3@localhost, 2 and 3 joined to 1
#   bench/cluster/rabbitmq-3node.sh status    # processes, cluster_status, queues
#   bench/cluster/rabbitmq-3node.sh ctl 2 list_queues name type leader members   # rabbitmqctl on node 2
#   bench/cluster/rabbitmq-3node.sh stop      # stop the three nodes and our epmd; keeps the logs
#
# Nodes (ringmq's own cluster example uses 5672-5674, 15692-15694 and 25672-25674, so both
# can run side by side):
#
#   node              AMQP (RABBITMQ_NODE_PORT)  Erlang dist (RABBITMQ_DIST_PORT)  Prometheus
#   rabbit1@localhost 127.0.0.1:5682             127.0.0.1:25682                   127.0.0.1:15702
#   rabbit2@localhost 127.0.0.1:5683             127.0.0.1:25683                   127.0.0.1:15703
#   rabbit3@localhost 127.0.0.1:5684             127.0.0.1:25684                   127.0.0.1:15704
#
# All of them use one epmd of their own (127.0.0.1:$RMQ3_EPMD_PORT, default 4380, started and
# stopped by this script; a system epmd on 4369 is neither used nor touched) and one shared
# Erlang cookie ($DIR/.erlang.cookie, random per start, HOME=$DIR for the nodes and the CLI
# tools). User guest/guest (RabbitMQ's default: loopback connections only), vhost /.
#
# Environment:
#   RMQ3_DIR=DIR        state, data, logs (default ${TMPDIR:-/tmp}/ringmq-rabbitmq-3node);
#                       `--dir DIR` before the command does the same. `start` wipes and recreates
#                       it; `stop` removes the mnesia (data) dirs and keeps the logs in DIR/rabbitN/log.
#   RMQ3_EPMD_PORT=N    epmd port (default 4380)
#   RMQ3_PROMETHEUS=0   do not enable rabbitmq_prometheus (default: enabled if installed)
#   RMQ3_ERL_ARGS=...   extra Erlang VM flags for every node. On a small machine the three VMs'
#                       idle schedulers busy-wait and take CPU from each other and from the
#                       bench; "+sbwt none +sbwtdcpu none +sbwtdio none" turns that off (not the
#                       default: the default is RabbitMQ as shipped).
#   RMQ3_START_TIMEOUT  seconds to wait for each node (default 120)
#
# Needs Debian's rabbitmq-server (apt-get install -y rabbitmq-server; as root, `start` installs
# it when missing, with services kept from starting by the package's own policy). The nodes run
# as the calling user from /usr/lib/rabbitmq/bin directly, not through the system service.
#
# ---------------------------------------------------------------------------------------------
# A quorum queue for the bench
# ---------------------------------------------------------------------------------------------
# A quorum queue is declared durable with the argument x-queue-type=quorum; its leader goes on
# the node the declaring client is connected to (RabbitMQ 3.10's default leader locator,
# client-local) and it gets a replica on each of the 3 nodes. Consumers and publishers may
# connect to any node.
#
#   pika:   ch.queue_declare("bench-qq", durable=True, arguments={"x-queue-type": "quorum"})
#
#   ringmq-bench declares it itself with --queue-args (durable is implied by the quorum type):
#     target/release/ringmq-bench run --uri amqp://guest:guest@127.0.0.1:5682/%2f \
#         --queues bench-qq --queue-args x-queue-type=quorum \
#         --size 1024 --confirm 100 --prefetch 100 --multi-ack-every 1 --duration 10
#   The bench's broker CPU and RSS figures are those of one process (by default the listener
#   of the URI's port, i.e. node 1's beam.smp; --broker-pid PID for another): the replicas'
#   CPU on the other two nodes is not in them. `status` prints the three beam.smp pids.
#   Quorum queues ignore delivery_mode: every message is written to the Raft log of all three
#   nodes and confirmed once a majority (2 of 3) has it.
#
#   Check: rabbitmq-3node.sh ctl 1 list_queues name type leader members messages
set -euo pipefail

RMQ_BIN=/usr/lib/rabbitmq/bin
NODES=(1 2 3)
AMQP_BASE=5682
DIST_BASE=25682
PROM_BASE=15702

usage() {
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    exit "${1:-2}"
}

if [ "${1:-}" = "--dir" ]; then
    [ -n "${2:-}" ] || usage
    RMQ3_DIR="$2"
    shift 2
fi
DIR="${RMQ3_DIR:-${TMPDIR:-/tmp}/ringmq-rabbitmq-3node}"
EPMD_PORT="${RMQ3_EPMD_PORT:-4380}"
START_TIMEOUT="${RMQ3_START_TIMEOUT:-120}"
cmd="${1:-}"
[ -n "$cmd" ] || usage
shift || true

say() { echo "rabbitmq-3node: $*" >&2; }
die() { say "$*"; exit 1; }

node_name() { echo "rabbit$1@localhost"; }

# The environment every RabbitMQ script (server and CLI tools) of node $1 needs.
node_env() {
    local i="$1" nd="$DIR/rabbit$1"
    export HOME="$DIR"
    export ERL_EPMD_PORT="$EPMD_PORT" ERL_EPMD_ADDRESS=127.0.0.1
    export RABBITMQ_CONF_ENV_FILE="$DIR/rabbitmq-env.conf"
    export RABBITMQ_NODENAME
    RABBITMQ_NODENAME="$(node_name "$i")"
    export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
    export RABBITMQ_NODE_PORT=$((AMQP_BASE + i - 1))
    export RABBITMQ_DIST_PORT=$((DIST_BASE + i - 1))
    export RABBITMQ_CONFIG_FILE="$nd/rabbitmq.conf"
    export RABBITMQ_ADVANCED_CONFIG_FILE="$nd/advanced.config"
    export RABBITMQ_ENABLED_PLUGINS_FILE="$nd/enabled_plugins"
    export RABBITMQ_PLUGINS_EXPAND_DIR="$nd/plugins-expand"
    export RABBITMQ_MNESIA_BASE="$nd/mnesia"
    export RABBITMQ_LOG_BASE="$nd/log"
    export RABBITMQ_PID_FILE="$nd/beam.pid"
    export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1} ${RMQ3_ERL_ARGS:-}"
}

# rabbitmqctl against node $1 (in a subshell, so the node's env does not leak), bounded.
ctl() {
    local i="$1"
    shift
    (node_env "$i"; exec timeout 60 "$RMQ_BIN/rabbitmqctl" -n "$(node_name "$i")" "$@")
}

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
pid_of() { cat "$1" 2>/dev/null || true; }

port_listening() { [ -n "$(ss -Hltn "sport = :$1" 2>/dev/null)" ]; }

install_if_missing() {
    [ -x "$RMQ_BIN/rabbitmq-server" ] && return 0
    [ "$(id -u)" = 0 ] || die "rabbitmq-server is not installed and installing it needs root (apt-get install -y rabbitmq-server)"
    say "installing Debian's rabbitmq-server"
    DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q rabbitmq-server >&2
}

rabbitmq_version() {
    ctl 1 -q version 2>/dev/null || dpkg-query -W -f='${Version}' rabbitmq-server 2>/dev/null || echo '?'
}

start() {
    install_if_missing
    for i in "${NODES[@]}"; do
        alive "$(pid_of "$DIR/rabbit$i/server.pid")" && die "node $i is already running ($DIR): stop it first"
    done
    local ports=("$EPMD_PORT")
    for i in "${NODES[@]}"; do
        ports+=($((AMQP_BASE + i - 1)) $((DIST_BASE + i - 1)) $((PROM_BASE + i - 1)))
    done
    for p in "${ports[@]}"; do
        port_listening "$p" && die "127.0.0.1:$p is already in use (ss -ltnp 'sport = :$p')"
    done

    rm -rf "$DIR"
    mkdir -p "$DIR"
    : > "$DIR/rabbitmq-env.conf"
    # Shared cookie: Erlang reads $HOME/.erlang.cookie and insists on owner-only access.
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' | tr 'a-f' 'A-F' > "$DIR/.erlang.cookie"
    chmod 400 "$DIR/.erlang.cookie"

    local prometheus=0
    if [ "${RMQ3_PROMETHEUS:-1}" != 0 ] && ls -d /usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins/rabbitmq_prometheus-* > /dev/null 2>&1; then
        prometheus=1
    fi
    for i in "${NODES[@]}"; do
        local nd="$DIR/rabbit$i"
        mkdir -p "$nd/log" "$nd/mnesia"
        {
            echo "listeners.tcp.default = 127.0.0.1:$((AMQP_BASE + i - 1))"
            echo "loopback_users.guest = true"
            if [ "$prometheus" = 1 ]; then
                echo "prometheus.tcp.ip = 127.0.0.1"
                echo "prometheus.tcp.port = $((PROM_BASE + i - 1))"
            fi
        } > "$nd/rabbitmq.conf"
        echo '[].' > "$nd/advanced.config"
        if [ "$prometheus" = 1 ]; then echo '[rabbitmq_prometheus].' > "$nd/enabled_plugins"; else echo '[].' > "$nd/enabled_plugins"; fi
    done

    # Our own epmd, bound to loopback; daemonised by itself (it writes no pid file), so find
    # its pid by its port afterwards.
    ERL_EPMD_ADDRESS=127.0.0.1 epmd -port "$EPMD_PORT" -address 127.0.0.1 -daemon
    local epmd_pid=''
    for _ in $(seq 1 50); do
        epmd_pid="$(ss -Hltnp "sport = :$EPMD_PORT" 2>/dev/null | grep -o 'pid=[0-9]*' | head -n1 | cut -d= -f2 || true)"
        [ -n "$epmd_pid" ] && break
        sleep 0.1
    done
    [ -n "$epmd_pid" ] || die "epmd did not listen on 127.0.0.1:$EPMD_PORT"
    echo "$epmd_pid" > "$DIR/epmd.pid"

    for i in "${NODES[@]}"; do
        local nd="$DIR/rabbit$i"
        (
            node_env "$i"
            cd "$nd"
            exec setsid "$RMQ_BIN/rabbitmq-server" > "$nd/server.log" 2>&1 < /dev/null
        ) &
        echo $! > "$nd/server.pid"
        say "starting $(node_name "$i"): AMQP 127.0.0.1:$((AMQP_BASE + i - 1)), dist $((DIST_BASE + i - 1))$([ "$prometheus" = 1 ] && echo ", prometheus http://127.0.0.1:$((PROM_BASE + i - 1))/metrics"); log $nd/server.log"
    done
    for i in "${NODES[@]}"; do
        wait_node "$i"
    done

    for i in 2 3; do
        say "joining $(node_name "$i") to $(node_name 1)"
        # The CLI logs the joining node's feature-flag and connection-tracking warnings as
        # it goes (harmless on a fresh node): into join.log, shown only if a step fails.
        for step in stop_app reset "join_cluster $(node_name 1)" start_app; do
            # shellcheck disable=SC2086 # $step is a command and its argument
            ctl "$i" -q $step >> "$DIR/join.log" 2>&1 || { tail -n 40 "$DIR/join.log" >&2; die "node $i: $step failed"; }
        done
    done
    for i in "${NODES[@]}"; do
        wait_node "$i"
    done
    check_guest
    local members
    members="$(ctl 1 -q eval 'lists:sort(rabbit_nodes:all_running()).' 2>/dev/null | tr -d '\n ' || true)"
    say "running nodes: $members"
    case "$members" in
        *rabbit1@localhost*rabbit2@localhost*rabbit3@localhost*) ;;
        *) die "the cluster did not form (see: $0 status)" ;;
    esac
    echo "RabbitMQ $(rabbitmq_version) ($(erlang_version)): 3-node cluster up; AMQP on 127.0.0.1:5682, :5683, :5684; state in $DIR"
}

erlang_version() {
    (node_env 1; timeout 30 "$RMQ_BIN/rabbitmq-diagnostics" -n "$(node_name 1)" -q erlang_version 2>/dev/null) | head -n1 || echo '?'
}

wait_node() {
    local i="$1" deadline=$((SECONDS + START_TIMEOUT)) pid
    pid="$(pid_of "$DIR/rabbit$i/server.pid")"
    while [ $SECONDS -lt $deadline ]; do
        if ! alive "$pid"; then
            tail -n 30 "$DIR/rabbit$i/server.log" >&2 || true
            die "$(node_name "$i") exited during start; log $DIR/rabbit$i/server.log"
        fi
        if ctl "$i" -q await_startup --timeout 5 > /dev/null 2>&1; then
            return 0
        fi
        sleep 1
    done
    tail -n 30 "$DIR/rabbit$i/server.log" >&2 || true
    die "$(node_name "$i") did not start within ${START_TIMEOUT}s; log $DIR/rabbit$i/server.log"
}

# guest must be able to log in over loopback on every node: a real AMQP handshake (the
# 8-byte protocol header must get connection.start back), through pika when it is there.
check_guest() {
    local i port
    for i in "${NODES[@]}"; do
        port=$((AMQP_BASE + i - 1))
        if python3 -c 'import pika' 2> /dev/null; then
            python3 - "$port" <<'EOF' || die "guest could not connect to 127.0.0.1:$port"
import sys, pika
c = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", int(sys.argv[1]),
        credentials=pika.PlainCredentials("guest", "guest"), connection_attempts=1,
        socket_timeout=5, stack_timeout=10))
c.close()
EOF
        else
            ctl "$i" -q authenticate_user guest guest > /dev/null || die "guest/guest is refused on node $i"
        fi
    done
    say "guest/guest connects over loopback to 5682, 5683, 5684"
}

stop() {
    local any=0 i pid beam
    for i in 3 2 1; do
        pid="$(pid_of "$DIR/rabbit$i/server.pid")"
        beam="$(pid_of "$DIR/rabbit$i/beam.pid")"
        if alive "$pid" || alive "$beam"; then
            any=1
            say "stopping $(node_name "$i")"
            ctl "$i" -q stop > /dev/null 2>&1 || true
            for _ in $(seq 1 60); do
                alive "$pid" || alive "$beam" || break
                sleep 0.5
            done
            # Still there after 30 s: kill the processes this script started (by pid only).
            for p in "$beam" "$pid"; do
                if alive "$p"; then say "killing pid $p"; kill -KILL "$p" 2>/dev/null || true; fi
            done
        fi
        rm -f "$DIR/rabbit$i/server.pid"
    done
    pid="$(pid_of "$DIR/epmd.pid")"
    if alive "$pid" && grep -q epmd "/proc/$pid/comm" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        # epmd takes ~2 s to exit after SIGTERM: wait (bounded) so that a `start` right after
        # this finds its port free.
        for _ in $(seq 1 50); do
            alive "$pid" || break
            sleep 0.2
        done
    fi
    rm -f "$DIR/epmd.pid"
    if [ -d "$DIR" ]; then
        rm -rf "$DIR"/rabbit*/mnesia "$DIR"/rabbit*/plugins-expand
        [ "$any" = 1 ] && say "stopped; logs kept in $DIR/rabbit{1,2,3}/ (server.log, log/)"
    fi
    [ "$any" = 1 ] || say "nothing running in $DIR"
}

status() {
    local i pid beam up=0
    for i in "${NODES[@]}"; do
        pid="$(pid_of "$DIR/rabbit$i/server.pid")"
        beam="$(pid_of "$DIR/rabbit$i/beam.pid")"
        if alive "$pid"; then
            up=$((up + 1))
            echo "$(node_name "$i"): running (server script pid $pid, beam.smp pid ${beam:-?}), AMQP 127.0.0.1:$((AMQP_BASE + i - 1))"
        else
            echo "$(node_name "$i"): not running"
        fi
    done
    [ "$up" -gt 0 ] || return 1
    for i in "${NODES[@]}"; do
        if alive "$(pid_of "$DIR/rabbit$i/server.pid")"; then
            echo "RabbitMQ $(ctl "$i" -q version 2>/dev/null || echo '?')"
            ctl "$i" cluster_status 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' | sed -n '/^Disk Nodes/,/^Maintenance status/p' | sed '$d' || true
            echo "Queues:"
            ctl "$i" -q list_queues name type messages leader 2>/dev/null || true
            break
        fi
    done
    [ "$up" = 3 ]
}

case "$cmd" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    ctl)
        [ -n "${1:-}" ] || usage
        n="$1"
        shift
        ctl "$n" "$@"
        ;;
    -h|--help|help) usage 0 ;;
    *) usage ;;
esac
