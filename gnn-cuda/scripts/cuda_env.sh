#!/bin/bash
# Sourced by the GPU bundle's scripts: puts libnvrtc and libcublas on LD_LIBRARY_PATH (the CUDA toolkit, or
# the nvidia-* wheels torch brings) and links their unversioned names where only versioned ones exist.
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
