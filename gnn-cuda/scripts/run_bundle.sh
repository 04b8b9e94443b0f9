#!/bin/bash
# Runs the GPU checks and the benchmark from a bundle made by gpu_bundle.sh, on the GPU machine.
#   run.sh tests   the kernel and model checks against the CPU engine (tests/gpu.rs), Cora included
#   run.sh bench   gpu_epoch on a 2M-node SBM drawn in Rust (no numpy needed)
#   run.sh all     both
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
# libnvrtc and libcublas: the CUDA toolkit, or the nvidia-*-cu12 wheels torch brings
for pattern in /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib /usr/lib/x86_64-linux-gnu \
  /usr/local/lib/python3*/dist-packages/nvidia/*/lib /usr/lib/python3/dist-packages/nvidia/*/lib \
  "$HOME"/.local/lib/python3*/site-packages/nvidia/*/lib /opt/conda/lib/python3*/site-packages/nvidia/*/lib \
  /usr/local/lib/python3*/site-packages/nvidia/*/lib /opt/torch/.venv/lib/python3*/site-packages/nvidia/*/lib \
  /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib "$HOME"/.pyenv/versions/*/lib/python3*/site-packages/nvidia/*/lib; do
  for d in $pattern; do
    if ls "$d"/libnvrtc.so* "$d"/libcublas.so* >/dev/null 2>&1; then
      LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
  done
done
# cudarc opens the unversioned names (libnvrtc.so, libcublas.so) or the .so.12 ones; wheels of CUDA 13 ship only
# libnvrtc.so.13 and libcublas.so.13, so link the unversioned names to the first found.
links=$(mktemp -d)
for lib in libnvrtc libcublas libcublasLt; do
  IFS=: read -ra dirs <<<"$LD_LIBRARY_PATH"
  for d in "${dirs[@]}"; do
    f=$(ls "$d/$lib".so.* 2>/dev/null | grep -E "$lib\.so\.[0-9]+$" | head -1)
    if [ -n "$f" ] && [ ! -e "$d/$lib.so" ]; then ln -sf "$f" "$links/$lib.so"; break; fi
    [ -e "$d/$lib.so" ] && break
  done
done
LD_LIBRARY_PATH="$links${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
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
if [ "$what" = bench ] || [ "$what" = all ]; then
  "$here/gpu_epoch" --nodes 2000000 --degree 20 --features 128 --classes 16 --hidden 256 --epochs 10 \
    > "${OUT:-$here}/gpu_epoch.jsonl" || rc=1
  cat "${OUT:-$here}/gpu_epoch.jsonl"
fi
exit $rc
