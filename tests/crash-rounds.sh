#!/usr/bin/env bash
# The full kill -9 crash test (issue 14 item 6): builds the release ringmq, then runs
# tests/crash_rounds.rs against it (RINGMQ_BIN) for --rounds rounds (default 100). Each round
# kills the broker with SIGKILL at a random moment of a mixed load (confirms, manual acks, nacks
# with requeue, rejects into a dead-letter queue, TTL expiry, basic.get), restarts it and checks
# that it serves; at the end every confirmed message must be accounted for and no message may
# have been outstanding to two channels. Prints one line per round and a summary line
# ("crash-rounds summary: rounds=… lost=0 violations=0 …"); exits non-zero on any failure.
#
#   tests/crash-rounds.sh [--rounds N] [--seed S] [--jobs J]
#
# --seed replays a printed seed (the same kill moments and client choices, not the same timing).
# --jobs is cargo's -j (default 1). The test harness itself is built in the dev profile; only
# the broker under test is the release build.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
rounds=100
seed=''
jobs=1
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds="$2"; shift 2 ;;
        --seed) seed="$2"; shift 2 ;;
        --jobs) jobs="$2"; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "crash-rounds.sh: unknown option $1" >&2; exit 1 ;;
    esac
done

cd "$root"
echo "crash-rounds.sh: building the release ringmq" >&2
cargo build -j "$jobs" --release --bin ringmq
export RINGMQ_BIN="$root/target/release/ringmq"
export RINGMQ_CRASH_ROUNDS="$rounds"
if [ -n "$seed" ]; then
    export RINGMQ_CRASH_ROUNDS_SEED="$seed"
fi
echo "crash-rounds.sh: $rounds rounds against $RINGMQ_BIN" >&2
started=$(date +%s)
status=0
cargo test -j "$jobs" --test crash_rounds -- --nocapture --test-threads 1 || status=$?
echo "crash-rounds.sh: $(( $(date +%s) - started )) s, exit status $status" >&2
exit "$status"
