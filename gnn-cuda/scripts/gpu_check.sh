#!/bin/bash
# One device session's checks in one command, each step under its own time limit so a hang costs that step
# alone. Needs the bundle (gpu_bundle.sh) and the release binaries physalia and physalia-worker in .cpubin/.
#
#   gnn-cuda/gpu-bundle/gpu_check.sh [STEP ...]     # steps: tests exact cora bench mem gat halo jobs
#
# tests  gnn-cuda/tests/gpu.rs (every kernel and model against the CPU engine), PHYSALIA_REQUIRE_GPU=1
# exact  the worker's exactness test on the GPU (1-3 workers sharing GPU 0 equal one CPU worker) and the
#        mini-batch device test
# cora   Cora GCN and GAT through `physalia submit` with one GPU worker: test accuracy
# bench  gpu_bench.py: SBM 2M, GCN, SAGE and GAT against PyG on the same GPU (dropout 0.5)
# mem    gpu_bench.py, ours alone, with PHYSALIA_GPU_POOL=exact and =driver: device memory of each
# gat    gpu_bench.py at 500k nodes, GAT against PyG's GATConv
# halo   SBM 1M: GCN on two workers sharing the GPU (the exchange's per-epoch split)
# jobs   SBM 1M: GCN, SAGE and GAT on one GPU worker (the planner's grounding) and mini-batch SAGE on one GPU
#        worker (the sample wait)
# profile gpu_epoch on SBMs of 1M and 2M nodes (degree 20), GCN, SAGE (hidden 256) and GAT (8 x 32): each
#        operation's device time an epoch (the planner's GPU grounding), JSON in $OUT/profile-N.jsonl
# BENCH_MODELS (default gcn,sage,gat) picks bench's models.
# Everything it prints also goes to $OUT/check.log; gpu_bench's table and JSON to $OUT.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
exec > >(tee -a "$out/check.log") 2>&1
source "$here/cuda_env.sh"
bin=$(cd "${PHYSALIA_BIN_DIR:-.cpubin}" && pwd)
steps=${*:-tests exact cora bench halo jobs}
export PHYSALIA_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ -f "$here/cora.tar.gz" ] && [ ! -d "$here/cora" ]; then tar xzf "$here/cora.tar.gz" -C "$here"; fi
export PHYSALIA_CORA="$here/cora"
rc=0
step() { # name, limit in seconds, command...
  local name=$1 limit=$2 t0
  shift 2
  t0=$(date +%s)
  echo "== $name"
  timeout "$limit" bash -c '"$@"' _ "$@"
  local code=$?
  echo "== $name: exit $code in $(( $(date +%s) - t0 )) s"
  [ $code = 0 ] || rc=1
}
work=$(mktemp -d)
submit() { # name; the job file on stdin; prints the summary line's essentials
  cat > "$work/$1.yaml"
  (cd "$work" && "$bin/physalia" submit "$1.yaml" --output json > "$1.json" 2> "$1.err") || { tail -5 "$work/$1.err"; return 1; }
  python3 - "$work/$1.json" <<'PY'
import json, os, statistics, sys
s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
job_dir = os.path.join(os.path.dirname(sys.argv[1]), s["job_dir"])  # relative to where submit ran
m = [json.loads(l)["metrics"] for l in open(job_dir + "/metrics.jsonl")]
def flat(d, pre=""):  # every "..._s" number, nested ones (the exchange's) as "exchange.halo_s"
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, pre + k + "."))
        elif k.endswith("_s") and isinstance(v, (int, float)):
            out[pre + k] = v
    return out
rows = [flat(x) for x in (m[1:] or m)]
keys = sorted({k for r in rows for k in r})
print(json.dumps({"job": s.get("name"), "device": s.get("device"), "workers": s.get("workers"),
                  "test_at_best_val": s["runs"][0].get("test_acc_at_best_val"),
                  "median": {k: round(statistics.median([r.get(k, 0) for r in rows]), 4) for k in keys}}))
PY
  cp "$work/$1.json" "$out/" 2>/dev/null
}
export -f submit
export work bin out
sbm1m() { # SBM 1M for the job steps, once
  [ -f "$work/sbm.safetensors" ] ||
    (cd "$work" && "$bin/physalia" data synth sbm --nodes 1000000 --classes 16 --feat-dim 128 --seed 0 --out sbm.safetensors | tail -1)
}
for s in $steps; do
  case $s in
    tests) step tests 180 "$here/gpu" --test-threads=1 ;;
    exact)
      step exact 180 "$here/exactness" gpu_partition --test-threads=1
      step minibatch 90 "$here/minibatch" device_data_parallel --test-threads=1 ;;
    cora)
      for ex in gcn gat; do
        { sed "s|path: ../shared/data/cora.*|path: $here/cora|; s|^name: .*|name: cora-$ex-gpu|" "$repo/examples/cora-$ex.yaml"
          echo "output: {dir: jobs}"; echo "resources: {gpu: {count: 1}}"; } | step "cora-$ex" 120 submit "cora-$ex-gpu"
      done ;;
    bench)
      step bench "${BENCH_LIMIT:-420}" python3 "$repo/gnn-cuda/bench/gpu_bench.py" --ours "$here/gpu_epoch" --dropouts 0.5 --epochs 8 \
        --models "${BENCH_MODELS:-gcn,sage,gat}"
      cp "$repo/bench/out/gpu/results.json" "$out/gpu_bench.json" 2>/dev/null ;;
    mem)
      # ours alone on bench's SBM 2M, the exact-size cache against the driver's pool (PyG's side: `bench`)
      for pool in exact driver; do
        PHYSALIA_GPU_POOL=$pool step "mem-$pool" 150 python3 "$repo/gnn-cuda/bench/gpu_bench.py" --ours "$here/gpu_epoch" \
          --dropouts 0.5 --epochs 8 --skip-pyg
        cp "$repo/bench/out/gpu/results.json" "$out/gpu_bench_$pool.json" 2>/dev/null
      done ;;
    gat)
      # GAT against PyG's GATConv where PyG fits (at 2M nodes its per-edge messages exceed the GPU)
      step gat-500k 150 python3 "$repo/gnn-cuda/bench/gpu_bench.py" --ours "$here/gpu_epoch" --nodes 500000 \
        --models gat --dropouts 0.5 --epochs 8
      cp "$repo/bench/out/gpu/results.json" "$out/gpu_bench_gat.json" 2>/dev/null ;;
    halo)
      # two workers sharing the GPU: the exchange's per-epoch split (halo_s)
      sbm1m
      printf 'name: sbm-gcn-w2\ndataset: sbm.safetensors\nmodel: {kind: gcn, layers: 2, hidden: 256, dropout: 0.5}\ntrain: {epochs: 6, seed: 0, eval_every: 6, lr: 0.01}\nworkers: 2\nresources: {gpu: {count: 1}}\noutput: {dir: jobs}\n' |
        step sbm-gcn-w2 150 submit sbm-gcn-w2 ;;
    jobs)
      sbm1m
      for kind in gcn sage gat; do
        model="{kind: $kind, layers: 2, hidden: 256, dropout: 0.5}"
        [ $kind = gat ] && model="{kind: gat, layers: 2, hidden: 32, heads: 8, out_heads: 1, dropout: 0.5, activation: relu}"
        printf 'name: sbm-%s-w1\ndataset: sbm.safetensors\nmodel: %s\ntrain: {epochs: 8, seed: 0, eval_every: 8, lr: 0.01}\nworkers: 1\nresources: {gpu: {count: 1}}\noutput: {dir: jobs}\n' \
          "$kind" "$model" | step "sbm-$kind-w1" 90 submit "sbm-$kind-w1"
      done
      printf 'name: mb-sage-w1\ndataset: sbm.safetensors\nmodel: {kind: sage, layers: 2, hidden: 256, dropout: 0.5}\ntrain: {epochs: 3, seed: 0, eval_every: 3, lr: 0.01}\nworkers: 1\nparallelism: data\nminibatch: {fanouts: [25, 10], batch_size: 1024}\nresources: {gpu: {count: 1}}\noutput: {dir: jobs}\n' |
        step mb-sage-w1 120 submit mb-sage-w1 ;;
    profile)
      for n in ${PROFILE_NODES:-1000000 2000000}; do
        step "profile-$n" 240 bash -c '"$1" --nodes "$2" --degree 20 --features 128 --classes 16 --hidden 256 \
          --gat-hidden 32 --models gcn,sage,gat --epochs 5 --profile 3 > "$3"' _ "$here/gpu_epoch" "$n" "$out/profile-$n.jsonl"
      done ;;
    *) echo "unknown step $s"; rc=1 ;;
  esac
done
exit $rc
