#!/bin/bash
# Builds what the GPU machine runs into gnn-cuda/gpu-bundle/ (ignored by git): the GPU and emulator test
# binaries, the gpu_epoch example, Cora, and run.sh, which finds libnvrtc and libcublas and runs them. The
# GPU machine may have no Rust toolchain; the folder travels to it as `carry` (it must stay under 64 MiB).
#
#   gnn-cuda/scripts/gpu_bundle.sh            # then on the GPU machine: gnn-cuda/gpu-bundle/run.sh [tests|bench|all]
set -euo pipefail
cd "$(dirname "$0")/../.."
target=${CARGO_TARGET_DIR:-target}
out=gnn-cuda/gpu-bundle
rm -rf "$out"
mkdir -p "$out"
cargo build --release -p physalia-gnn-cuda --example gpu_epoch
cp "$target/release/examples/gpu_epoch" "$out/"
for t in gpu emulate; do
  exe=$(cargo test --release -p physalia-gnn-cuda --test "$t" --no-run --message-format=json 2>/dev/null |
    python3 -c 'import sys, json
for l in sys.stdin:
    j = json.loads(l)
    if j.get("executable"): print(j["executable"])' | tail -1)
  cp "$exe" "$out/$t"
done
exe=$(cargo test --release -p physalia-worker --test exactness --no-run --message-format=json 2>/dev/null |
  python3 -c 'import sys, json
for l in sys.stdin:
    j = json.loads(l)
    if j.get("executable"): print(j["executable"])' | tail -1)
cp "$exe" "$out/exactness"
exe=$(cargo test --release -p physalia-worker --test minibatch --no-run --message-format=json 2>/dev/null |
  python3 -c 'import sys, json
for l in sys.stdin:
    j = json.loads(l)
    if j.get("executable"): print(j["executable"])' | tail -1)
cp "$exe" "$out/minibatch"
strip "$out"/gpu_epoch "$out"/gpu "$out"/emulate "$out"/exactness "$out"/minibatch
cora=${PHYSALIA_CORA:-../shared/data/cora}
if [ -f "$cora/edges.csv" ]; then
  tar czf "$out/cora.tar.gz" -C "$(dirname "$cora")" --exclude raw "$(basename "$cora")"
fi
cp gnn-cuda/scripts/run_bundle.sh "$out/run.sh"
cp gnn-cuda/scripts/cuda_env.sh gnn-cuda/scripts/gpu_jobs.sh gnn-cuda/scripts/gpu_check.sh "$out/"
du -sh "$out"
ls -la "$out"
