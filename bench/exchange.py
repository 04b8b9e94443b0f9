#!/usr/bin/env python3
"""Partition-parallel exchange: bytes per epoch against the halo minimum, and what boundary sampling
(BNS-GCN), staleness and 16-bit rows save, with the accuracy each keeps.

    python3 bench/exchange.py [--nodes 1000000] [--workers 4] [--epochs 12]

Runs `physalia submit bench/jobs/sbm-gcn.yaml` with `workers: W` on the SBM graph of bench/compare.py
(generated and imported if missing) once per exchange setting, reads every worker's per-epoch exchange
statistics from the job's metrics.jsonl, and prints a markdown table (also written to
bench/out/exchange.md).

Halo minimum per epoch = sum over parts of (halo rows x width x 4 bytes) x 2 (forward rows, backward
gradients), for every layer that exchanges each epoch. With the bench model (2-layer GCN, 128 -> 256 -> 16,
no input dropout) the first layer aggregates the constant input once (epoch 1 only), so the per-epoch
exchange is the second layer's 16-wide messages. Epoch 1 (one-time input exchange) and the last epoch
(which also runs the evaluation pass) are left out of the per-epoch mean.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd, **kw):
    print("[exchange] $ " + " ".join(str(c) for c in cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2, help="total threads; each worker gets threads/workers (>= 1)")
    ap.add_argument("--settings", default="exact,bf16,bns,stale1,stale3",
                    help="comma-separated subset of exact,bf16,bns,bns-rescaled,stale1,stale3,stale3-thr")
    args = ap.parse_args()
    os.chdir(ROOT)
    binary = ROOT / "target/release/physalia"
    if not binary.exists() or not (ROOT / "target/release/physalia-worker").exists():
        run(["cargo", "build", "--release", "-p", "physalia", "-p", "physalia-worker"])
    raw = ROOT / f"bench/out/sbm-{args.nodes}"
    data = ROOT / f"bench/out/sbm-{args.nodes}.safetensors"
    if not raw.exists():
        run([sys.executable, "bench/gen_sbm.py", "--nodes", str(args.nodes), "--out", str(raw)])
    if not data.exists():
        run([str(binary), "data", "import", str(raw), "--format", "generic", "--out", str(data)])
    parts = json.loads(run([str(binary), "data", "partition", str(data), "--k", str(args.workers), "--output", "json"]).stdout)
    pset = parts["partitions"][0]
    halo_rows = sum(p["halo"] for p in pset["parts"])
    width, out_dim = 256, 16
    minimum = halo_rows * out_dim * 4 * 2
    known = {
        "exact": ("exact (f32)", []),
        "bf16": ("bf16 rows", ["exchange.dtype=bf16"]),
        "bns": ("BNS p=0.1", ["exchange.boundary_sampling=0.1"]),
        "bns-rescaled": ("BNS p=0.1, rows x 1/p", ["exchange.boundary_sampling=0.1", "exchange.boundary_rescale=true"]),
        "stale1": ("staleness 1", ["exchange.staleness=1"]),
        "stale3": ("staleness 3", ["exchange.staleness=3"]),
        "stale3-thr": ("staleness <= 3, threshold 0.05", ["exchange.staleness=3", "exchange.staleness_threshold=0.05"]),
    }
    settings = [known[k] for k in args.settings.split(",")]
    rows = []
    for label, sets in settings:
        cmd = [str(binary), "submit", "bench/jobs/sbm-gcn.yaml", "--set", f"dataset.path={data}",
               "--set", f"workers={args.workers}", "--set", f"train.epochs={args.epochs}",
               "--set", f"train.eval_every={args.epochs}",
               "--set", f"train.threads={max(1, args.threads // args.workers)}",
               "--output", "json", "--quiet"]
        for s in sets:
            cmd += ["--set", s]
        summary = json.loads(run(cmd).stdout.strip().splitlines()[-1])
        job = Path(summary["job_dir"])
        per_epoch = []
        allreduce = []
        for line in (job / "metrics.jsonl").read_text().splitlines():
            m = json.loads(line)
            e = m["metrics"]["epoch"]
            if e == 1 or e == args.epochs:
                continue
            halo = sum(b["sent"] for w in m["workers"] for b in w["exchange"]["per_layer"] if b["layer"] is not None)
            ar = sum(b["sent"] for w in m["workers"] for b in w["exchange"]["per_layer"] if b["layer"] is None)
            per_epoch.append(halo)
            allreduce.append(ar)
        halo = statistics.mean(per_epoch)
        r = summary["runs"][0]
        rows.append({
            "setting": label, "halo_bytes_per_epoch": halo, "all_reduce_bytes_per_epoch": statistics.mean(allreduce),
            "final_test_acc": r["final_test_acc"], "median_epoch_s": summary["median_epoch_s"], "job_dir": str(job),
        })
        print(f"[exchange] {label}: {halo/2**20:.2f} MiB/epoch halo, test {r['final_test_acc']:.4f}", file=sys.stderr)
    exact = rows[0]
    lines = [
        f"SBM {args.nodes} nodes, {args.workers} workers (METIS: edge cut {pset['edge_cut']} of "
        f"{pset['num_undirected_edges']} undirected edges, balance {pset['balance']:.3f}, {halo_rows} halo rows in all), "
        f"2-layer GCN 128-{width}-{out_dim}, {args.epochs} epochs. Halo minimum per epoch: {halo_rows} x {out_dim} x 4 B x 2 "
        f"= {minimum/2**20:.2f} MiB.",
        "",
        "| setting | halo MiB/epoch | vs minimum | vs exact | all-reduce KiB/epoch | final test acc | vs exact (points) | epoch s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['halo_bytes_per_epoch']/2**20:.2f} | {r['halo_bytes_per_epoch']/minimum:.3f} | "
            f"{r['halo_bytes_per_epoch']/exact['halo_bytes_per_epoch']:.3f} | {r['all_reduce_bytes_per_epoch']/1024:.0f} | "
            f"{r['final_test_acc']:.4f} | {100*(r['final_test_acc']-exact['final_test_acc']):+.2f} | {r['median_epoch_s']:.2f} |")
    text = "\n".join(lines)
    print(text)
    out = ROOT / "bench/out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "exchange.md").write_text(text + "\n")
    (out / "exchange.json").write_text(json.dumps({"args": vars(args), "halo_rows": halo_rows, "minimum": minimum, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
