#!/bin/bash
# Runs the GPU checks and the benchmark from a bundle made by gpu_bundle.sh, on the GPU machine.
#   run.sh tests   the kernel and model checks against the CPU engine (tests/gpu.rs), Cora included
#   run.sh bench   gpu_epoch on a 2M-node SBM drawn in Rust (no numpy needed)
#   run.sh all     both
#   run.sh jobs    whole jobs through `physalia submit` on the GPU (gpu_jobs.sh; needs the release binaries
#                  physalia and physalia-worker in $PHYSALIA_BIN_DIR, default .cpubin)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/cuda_env.sh"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>/dev/null || echo "no nvidia-smi"
ldconfig -p 2>/dev/null | grep -E "libcuda\.so|libnvrtc|libcublas\.so" | head
if [ -f "$here/cora.tar.gz" ] && [ ! -d "$here/cora" ]; then tar xzf "$here/cora.tar.gz" -C "$here"; fi
export PHYSALIA_CORA="$here/cora"
what=${1:-all}
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  "$here/gpu" --test-threads=1 --nocapture || rc=1
fi
if [ "$what" = jobs ]; then
  "$here/gpu_jobs.sh" || rc=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  "$here/gpu_epoch" --nodes 2000000 --degree 20 --features 128 --classes 16 --hidden 256 --epochs 10 \
    > "${OUT:-$here}/gpu_epoch.jsonl" || rc=1
  cat "${OUT:-$here}/gpu_epoch.jsonl"
fi
exit $rc
