#!/usr/bin/env bash
# Runs every libFuzzer target for SECONDS (default 600) and prints, per target, libFuzzer's final
# statistics: executions, executions per second, coverage (edges) and features, and whether it crashed.
# New inputs go to a scratch corpus (the seeds under fuzz/corpus/<target> are read, not written); a crash
# leaves its input under fuzz/artifacts/<target>/, to be minimised and copied to fuzz/regressions/<target>/
# (tests/tests/fuzz_corpus.rs replays those in CI).
#
#   cargo +nightly install cargo-fuzz      # once
#   fuzz/soak.sh 600 [TARGET...]           # here: two targets at a time on two cores
set -uo pipefail
cd "$(dirname "$0")"
secs=${1:-600}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
parallel=${FUZZ_PARALLEL:-2}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cargo +nightly fuzz build -O || exit 1
run() {
    local t=$1
    mkdir -p "$scratch/$t"
    cargo +nightly fuzz run -O "$t" "$scratch/$t" "corpus/$t" -- \
        -max_total_time="$secs" -print_final_stats=1 -rss_limit_mb=4096 -timeout=10 \
        >"$scratch/$t.log" 2>&1
    local rc=$?
    local execs cov ft
    execs=$(grep -m1 '^stat::number_of_executed_units' "$scratch/$t.log" | awk '{print $2}')
    cov=$(grep -o 'cov: [0-9]*' "$scratch/$t.log" | tail -1 | awk '{print $2}')
    ft=$(grep -o 'ft: [0-9]*' "$scratch/$t.log" | tail -1 | awk '{print $2}')
    echo "$t: exit $rc, ${execs:-?} executions in ${secs} s, cov ${cov:-?} edges, ft ${ft:-?} features"
    if [ $rc -ne 0 ]; then
        tail -40 "$scratch/$t.log"
    fi
}
i=0
for t in "${targets[@]}"; do
    run "$t" &
    i=$((i + 1))
    if [ $((i % parallel)) -eq 0 ]; then
        wait
    fi
done
wait
