#!/usr/bin/env bash
# Runs the cargo-fuzz targets (ringmq::amqp::fuzz) on nightly, SECONDS each (default 300),
# growing fuzz/corpus/<target>/ and then minimising it. A crash is copied into
# fuzz/regressions/<target>/ (which `cargo test --test fuzz_corpus` replays) and fails the run.
#
#   bash fuzz/run.sh [SECONDS] [TARGET...]
#
# Needs `cargo install cargo-fuzz` and the nightly toolchain.
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-300}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(frames method content_header field_table raft_entry topic)
fi
failed=0
cargo +nightly fuzz build
for t in "${targets[@]}"; do
    case $t in
        frames) max_len=65536 ;;
        *) max_len=16384 ;;
    esac
    mkdir -p "corpus/$t" "artifacts/$t"
    before=$(ls "corpus/$t" | wc -l)
    start=$(date +%s)
    if ! cargo +nightly fuzz run "$t" "corpus/$t" -- -max_total_time="$secs" -max_len="$max_len" \
        -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 2> "artifacts/$t.log"; then
        failed=1
        mkdir -p "regressions/$t"
        for f in "artifacts/$t"/*; do
            [ -f "$f" ] && cp "$f" "regressions/$t/" && echo "$t: kept $(basename "$f") in regressions/$t"
        done
        tail -40 "artifacts/$t.log"
    fi
    # Minimise, keeping the hand-made seeds (seeds.py) whatever cmin thinks of them.
    mkdir -p "seeds.tmp/$t"
    mv "corpus/$t"/seed-* "seeds.tmp/$t/" 2> /dev/null || true
    cargo +nightly fuzz cmin "$t" "corpus/$t" -- -max_len="$max_len" > /dev/null 2>&1 || true
    mv "seeds.tmp/$t"/* "corpus/$t/" 2> /dev/null || true
    rm -rf seeds.tmp
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "artifacts/$t.log" | grep -o '[0-9]*$' || echo '?')
    cov=$(grep -o 'cov: [0-9]*' "artifacts/$t.log" | tail -1 || true)
    echo "$t: $(( $(date +%s) - start )) s, $runs runs, $cov, corpus $before -> $(ls "corpus/$t" | wc -l)"
done
exit $failed
