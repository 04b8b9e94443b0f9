#!/bin/bash
# Whole jobs through `physalia submit` with GPU workers, on the GPU machine (issue 15's must-shows):
#   1. worker-image's exactness test on the GPU: 1, 2 and 3 workers sharing GPU 0 over the in-memory mesh
#      equal one CPU worker (GCN, SAGE, GAT);
#   2. Cora GCN and GAT (the example jobs) on the GPU and on the CPU: test accuracy;
#   3. SBM (NODES, default 1M; 128 features, 16 classes): GCN, SAGE and GAT on one GPU worker, on two
#      workers sharing the GPU through the QUIC mesh (separate processes), and on one CPU worker: per-epoch
#      losses compared (two workers must equal one within 1e-4) and median epoch times.
# Needs the release binaries physalia and physalia-worker in $PHYSALIA_BIN_DIR (default .cpubin) and the
# bundle beside this script; writes gpu_jobs.json and the job records' metrics into $OUT.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/cuda_env.sh"
bin=$(cd "${PHYSALIA_BIN_DIR:-.cpubin}" && pwd)
repo=$(pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
rc=0
echo "== exactness on the GPU"
PHYSALIA_REQUIRE_GPU=1 "$here/exactness" gpu_partition --nocapture --test-threads=1 2>&1 | tail -3 || rc=1
PHYSALIA_REQUIRE_GPU=1 "$here/minibatch" device_data_parallel --nocapture --test-threads=1 2>&1 | tail -3 || rc=1
if [ -f "$here/cora.tar.gz" ] && [ ! -d "$here/cora" ]; then tar xzf "$here/cora.tar.gz" -C "$here"; fi
work=$(mktemp -d)
cd "$work" || exit 1
submit() { # name, then the job file's text on stdin
  cat > "$1.yaml"
  local t0
  t0=$(date +%s%N)
  "$bin/physalia" submit "$1.yaml" --output json > "$1.json" 2> "$1.err"
  local code=$?
  echo "$1: exit $code, $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  [ $code = 0 ] || { tail -3 "$1.err"; rc=1; }
}
if [ -z "${ONLY_MINIBATCH:-}" ]; then
echo "== Cora"
for ex in gcn gat; do
  for dev in gpu cpu; do
    res=""
    [ $dev = gpu ] && res="resources: {gpu: {count: 1}}"
    { sed "s|path: ../shared/data/cora.*|path: $here/cora|; s|^name: .*|name: cora-$ex-$dev|" "$repo/examples/cora-$ex.yaml"
      echo "output: {dir: jobs}"; echo "$res"; } | submit "cora-$ex-$dev"
  done
done
echo "== SBM ${NODES:-1000000}"
"$bin/physalia" data synth sbm --nodes "${NODES:-1000000}" --classes 16 --feat-dim 128 --seed 0 --out sbm.safetensors | tail -1
for kind in gcn sage gat; do
  model="{kind: $kind, layers: 2, hidden: 256, dropout: 0.5}"
  [ $kind = gat ] && model="{kind: gat, layers: 2, hidden: 32, heads: 8, out_heads: 1, dropout: 0.5, attn_dropout: 0.5, activation: elu}"
  for run in gpu-w1:1:gpu gpu-w2:2:gpu cpu-w1:1:cpu; do
    IFS=: read -r tag w dev <<<"$run"
    res=""
    [ $dev = gpu ] && res="resources: {gpu: {count: 1}}"
    printf 'name: sbm-%s-%s\ndataset: sbm.safetensors\nmodel: %s\ntrain: {epochs: 12, seed: 0, eval_every: 4, lr: 0.01}\nworkers: %s\n%s\noutput: {dir: jobs}\n' \
      "$kind" "$tag" "$model" "$w" "$res" | submit "sbm-$kind-$tag"
  done
done
else
"$bin/physalia" data synth sbm --nodes "${NODES:-1000000}" --classes 16 --feat-dim 128 --seed 0 --out sbm.safetensors | tail -1
fi
echo "== SBM ${NODES:-1000000}, data parallelism (fan-outs 25,10, batch 1024)"
for kind in gcn sage; do
  for run in gpu-w1:1:gpu gpu-w2:2:gpu cpu-w1:1:cpu; do
    IFS=: read -r tag w dev <<<"$run"
    res=""
    [ $dev = gpu ] && res="resources: {gpu: {count: 1}}"
    printf 'name: mb-%s-%s\ndataset: sbm.safetensors\nmodel: {kind: %s, layers: 2, hidden: 256, dropout: 0.5}\ntrain: {epochs: 4, seed: 0, eval_every: 4, lr: 0.01}\nworkers: %s\nparallelism: data\nminibatch: {fanouts: [25, 10], batch_size: 1024}\n%s\noutput: {dir: jobs}\n' \
      "$kind" "$tag" "$kind" "$w" "$res" | submit "mb-$kind-$tag"
  done
done
python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
res = {}
for f in sorted(glob.glob("*.json")):
    name = f[:-5]
    try:
        s = json.loads(open(f).read().strip().splitlines()[-1])
    except Exception as e:
        res[name] = {"error": str(e)}
        continue
    lines = [json.loads(l) for l in open(os.path.join(s["job_dir"], "metrics.jsonl"))]
    m = [l["metrics"] for l in lines]
    res[name] = {
        "device": s.get("device"), "workers": s.get("workers"),
        "losses": [x["loss"] for x in m], "test_acc": [x.get("test_acc") for x in m],
        "epoch_s": [x["train_s"] for x in m],
        "median_epoch_s": statistics.median([x["train_s"] for x in m[1:]]) if len(m) > 1 else None,
        "test_at_best_val": s["runs"][0].get("test_acc_at_best_val"),
        "final_test": s["runs"][0].get("final_test_acc"),
        "exchanged": s.get("bytes_exchanged"),
    }
for kind, pre in [("gcn", "sbm"), ("sage", "sbm"), ("gat", "sbm"), ("gcn", "mb"), ("sage", "mb")]:
    a, b = res.get(f"{pre}-{kind}-gpu-w1"), res.get(f"{pre}-{kind}-gpu-w2")
    c = res.get(f"{pre}-{kind}-cpu-w1")
    if a and c and "losses" in a and "losses" in c:
        d = max(abs(x - y) / max(abs(y), 1e-3) for x, y in zip(a["losses"], c["losses"]))
        res[f"{pre}-{kind}-gpu-vs-cpu"] = {"max_rel_loss_diff": d}
    if a and b and "losses" in a and "losses" in b:
        d = max(abs(x - y) / max(abs(y), 1e-3) for x, y in zip(b["losses"], a["losses"]))
        res[f"{pre}-{kind}-two-vs-one"] = {"max_rel_loss_diff": d, "within_1e-4": d <= 1e-4}
for k, v in res.items():
    short = {kk: vv for kk, vv in v.items() if kk not in ("losses", "epoch_s", "test_acc")}
    print(k, json.dumps(short))
json.dump(res, open(os.path.join(out, "gpu_jobs.json"), "w"), indent=1)
PY
cp sbm-gcn-gpu-w2.err "$out/" 2>/dev/null
exit $rc
