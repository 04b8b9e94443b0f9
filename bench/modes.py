#!/usr/bin/env python3
"""Partition, data (mini-batch) and model (P3) parallelism side by side on one graph family.

Runs `physalia submit` for each mode on the same SBM graph and prints per mode: final and best-val test
accuracy, median epoch seconds, bytes exchanged per epoch (all workers), and for mini-batch modes the
cache hit rate. Usage:

    python3 bench/modes.py --nodes 100000 --feat-dim 128 --workers 1 --epochs 10        # accuracy: full vs mini-batch
    python3 bench/modes.py --nodes 20000 --feat-dim 1024 --hidden 64 --workers 4 --epochs 5   # bytes: wide features
"""
import argparse, json, os, subprocess, sys, statistics, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "physalia")


def run(args, cwd):
    out = subprocess.run([BIN] + args, cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"physalia {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=100000)
    p.add_argument("--feat-dim", type=int, default=128)
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--kind", default="sage")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--fanouts", default="25,10")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--cache-rows", type=int, default=0)
    p.add_argument("--modes", default="partition,data,model")
    a = p.parse_args()
    out_dir = os.path.join(ROOT, "bench", "out")
    os.makedirs(out_dir, exist_ok=True)
    graph = os.path.join(out_dir, f"sbm-{a.nodes}-f{a.feat_dim}-c{a.classes}.safetensors")
    if not os.path.exists(graph):
        run(["data", "synth", "sbm", "--nodes", str(a.nodes), "--classes", str(a.classes),
             "--feat-dim", str(a.feat_dim), "--seed", "0", "--out", graph], ROOT)
    rows = []
    for mode in a.modes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            job = os.path.join(tmp, "job.yaml")
            with open(job, "w") as f:
                f.write(f"""name: modes-{mode}
dataset:
  path: {graph}
model:
  kind: {a.kind}
  layers: 2
  hidden: {a.hidden}
  dropout: 0.5
  input_dropout: 0.0
train:
  epochs: {a.epochs}
  lr: 0.01
  weight_decay: 0.0005
  seed: 0
  eval_every: {a.epochs}
workers: {a.workers}
parallelism: {mode}
output:
  dir: {tmp}/jobs
""")
                if mode != "partition":
                    f.write(f"minibatch:\n  fanouts: [{a.fanouts}]\n  batch_size: {a.batch}\n  cache_rows: {a.cache_rows}\n")
            s = json.loads(run(["submit", job, "--output", "json", "--quiet"], ROOT))
            hit = None
            jd = s["job_dir"] if os.path.isabs(s["job_dir"]) else os.path.join(ROOT, s["job_dir"])
            hits = misses = 0
            with open(os.path.join(jd, "metrics.jsonl")) as mf:
                for line in mf:
                    m = json.loads(line)["metrics"]
                    b = m.get("batches")
                    if b:
                        hits += b["cache_hits"]; misses += b["cache_misses"]
            if hits + misses:
                hit = hits / (hits + misses)
            rows.append({
                "mode": mode,
                "workers": a.workers,
                "test_final": s.get("mean_final_test_acc"),
                "test_at_best_val": s.get("mean_test_acc_at_best_val"),
                "median_epoch_s": s.get("median_epoch_s"),
                "bytes_per_epoch": (s.get("bytes_exchanged") or 0) / a.epochs,
                "cache_hit_rate": hit,
            })
    print(f"# SBM {a.nodes} nodes, {a.feat_dim} features, {a.classes} classes; {a.kind} hidden {a.hidden}; "
          f"{a.workers} workers; {a.epochs} epochs; fanouts {a.fanouts}, batch {a.batch}, cache {a.cache_rows}")
    print("| mode | workers | test (final) | test at best val | median epoch s | MiB exchanged / epoch | cache hit |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        hit = "-" if r["cache_hit_rate"] is None else f"{100 * r['cache_hit_rate']:.1f}%"
        print(f"| {r['mode']} | {r['workers']} | {r['test_final']:.4f} | {r['test_at_best_val']:.4f} | "
              f"{r['median_epoch_s']:.3f} | {r['bytes_per_epoch'] / 2**20:.2f} | {hit} |")


if __name__ == "__main__":
    main()
