#!/usr/bin/env python3
"""Partition, data (mini-batch) and model (P3) parallelism side by side on one graph family.

Runs `physalia submit` for each mode on the same SBM graph and prints per mode: final and best-val test
accuracy, median epoch seconds, bytes exchanged per epoch (all workers), and for mini-batch modes the
cache hit rate. Usage:

    python3 bench/modes.py --nodes 100000 --feat-dim 128 --workers 1 --epochs 10        # accuracy: full vs mini-batch
    python3 bench/modes.py --nodes 20000 --feat-dim 1024 --hidden 64 --workers 4 --epochs 5   # bytes: wide features
"""
import argparse, json, os, subprocess, sys, statistics, tempfile

from jobs import job_yaml

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
    p.add_argument("--target", type=float, default=None,
                   help="report training seconds until validation accuracy first reaches this (evaluates every epoch)")
    p.add_argument("--seeds", type=int, default=1, help="repeat each mode with seeds 0..N-1 and report medians")
    a = p.parse_args()
    out_dir = os.path.join(ROOT, "bench", "out")
    os.makedirs(out_dir, exist_ok=True)
    graph = os.path.join(out_dir, f"sbm-{a.nodes}-f{a.feat_dim}-c{a.classes}.safetensors")
    if not os.path.exists(graph):
        run(["data", "synth", "sbm", "--nodes", str(a.nodes), "--classes", str(a.classes),
             "--feat-dim", str(a.feat_dim), "--seed", "0", "--out", graph], ROOT)
    rows = []
    for mode, seed in [(m, sd) for m in a.modes.split(",") for sd in range(a.seeds)]:
        with tempfile.TemporaryDirectory() as tmp:
            job = os.path.join(tmp, "job.yaml")
            with open(job, "w") as f:
                f.write(job_yaml(f"modes-{mode}", graph, a, mode, a.workers, tmp, seed=seed,
                                 eval_every=1 if a.target else a.epochs, cache_rows=a.cache_rows))
            s = json.loads(run(["submit", job, "--output", "json", "--quiet"], ROOT))
            hit = None
            jd = s["job_dir"] if os.path.isabs(s["job_dir"]) else os.path.join(ROOT, s["job_dir"])
            hits = misses = 0
            elapsed, to_target = 0.0, None
            with open(os.path.join(jd, "metrics.jsonl")) as mf:
                for line in mf:
                    rec = json.loads(line)
                    m = rec["metrics"]
                    b = m.get("batches")
                    if b:
                        hits += b["cache_hits"]; misses += b["cache_misses"]
                    elapsed += m["train_s"]
                    if a.target and to_target is None and (m.get("val_acc") or 0) >= a.target:
                        to_target = (m["epoch"], elapsed)
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
                "to_target": to_target,
            })
    print(f"# SBM {a.nodes} nodes, {a.feat_dim} features, {a.classes} classes; {a.kind} hidden {a.hidden}; "
          f"{a.workers} workers; {a.epochs} epochs; fanouts {a.fanouts}, batch {a.batch}, cache {a.cache_rows}")
    target = f" | epoch, train s to val {a.target}" if a.target else ""
    print(f"| mode | workers | test (final) | test at best val | median epoch s | MiB exchanged / epoch | cache hit{target} |")
    print("|---|---|---|---|---|---|---|" + ("---|" if a.target else ""))
    by_mode = {}
    for r in rows:
        by_mode.setdefault(r["mode"], []).append(r)
    med = statistics.median
    for mode, rs in by_mode.items():
        hits = [r["cache_hit_rate"] for r in rs if r["cache_hit_rate"] is not None]
        hit = f"{100 * med(hits):.1f}%" if hits else "-"
        line = (f"| {mode} | {rs[0]['workers']} | {med(r['test_final'] for r in rs):.4f} | "
                f"{med(r['test_at_best_val'] for r in rs):.4f} | {med(r['median_epoch_s'] for r in rs):.3f} | "
                f"{med(r['bytes_per_epoch'] for r in rs) / 2**20:.2f} | {hit}")
        if a.target:
            reached = [r["to_target"] for r in rs if r["to_target"]]
            line += (f" | {med(e for e, _ in reached):.0f}, {med(t for _, t in reached):.2f} s ({len(reached)}/{len(rs)} runs)"
                     if reached else f" | not reached (0/{len(rs)})")
        print(line + " |")
    if a.seeds > 1:
        print(f"(medians over seeds 0..{a.seeds - 1})")


if __name__ == "__main__":
    main()
