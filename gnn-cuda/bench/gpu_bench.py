#!/usr/bin/env python3
"""Physalia's CUDA engine against PyTorch Geometric on the same GPU and the same graph.

  python3 gnn-cuda/bench/gpu_bench.py [--nodes 2000000] [--avg-degree 20] [--feat-dim 128]
        [--hidden 256] [--gat-hidden 32] [--models gcn,sage,gat] [--dropouts 0.5,0] [--epochs 10] [--ours PATH]
        [--skip-ours] [--skip-pyg]

1. bench/gen_sbm.py writes the stochastic block model graph to bench/out/sbm-<N>-d<D>/ (skipped when
   present): 2M nodes, average degree 20, 128 features, 16 classes, seed 0 by default.
2. Ours: the `gpu_epoch` example (gnn-cuda/examples/gpu_epoch.rs; `--ours` names a built binary, default
   target/release/examples/gpu_epoch) reads the same .npy files through physalia-graph's generic
   importer; it prints one JSON line per model with its median epoch time, SpMM's achieved bandwidth and the
   measured device copy bandwidth.
3. PyG: a child process of this script (`--child`) trains bench/pyg_train.py's model (GCNConv(cached=True) /
   SAGEConv(aggr='mean'), ReLU, dropout between layers only, Adam lr 0.01, weight decay 5e-4) on the GPU
   with the adjacency as a torch.sparse_csr_tensor on the device, timing forward + loss + backward + step
   with torch.cuda.synchronize() around each epoch. When torch_geometric is not installed, the same model
   written with torch.sparse.mm (what PyG's layers call for a sparse adjacency) runs instead, labelled
   "torch".

Every model runs once per dropout rate (between layers; 0 = none). Memory is compared two ways: the device's
used memory (total - free, CUDA context and allocator caches included) for both, and torch's
max_memory_allocated for PyG alone (tensors only). Prints a table and writes bench/out/gpu/results.json. Targets (issue 8): our epoch time at most 0.7x PyG's,
SpMM's achieved bandwidth at least 60% of the measured copy bandwidth.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "bench", "out")


def say(msg):
    print(f"[gpu_bench] {msg}", file=sys.stderr, flush=True)


def graph_dir(a):
    d = os.path.join(OUT, f"sbm-{a.nodes}-d{a.avg_degree:g}")
    if not os.path.exists(os.path.join(d, "test_idx.npy")):
        cmd = [sys.executable, os.path.join(ROOT, "bench", "gen_sbm.py"), "--nodes", str(a.nodes),
               "--avg-degree", str(a.avg_degree), "--feat-dim", str(a.feat_dim), "--classes",
               str(a.classes), "--seed", "0", "--out", d]
        say("$ " + " ".join(cmd))
        subprocess.run(cmd, check=True)
    return d


def hidden_of(a, model):
    """Hidden width per head: GAT's 8 heads of `--gat-hidden` concatenate to `--hidden` (256 = 8 x 32)."""
    return a.gat_hidden if model == "gat" else a.hidden


def run_ours(a, d, dropout):
    """One gpu_epoch process per hidden width (GAT's is per head), every model's JSON line by name."""
    out = {}
    models = a.models.split(",")
    for hidden in sorted({hidden_of(a, m) for m in models}):
        names = ",".join(m for m in models if hidden_of(a, m) == hidden)
        out.update(run_ours_once(a, d, dropout, names, hidden))
    return out


def run_ours_once(a, d, dropout, models, hidden):
    binary = a.ours or os.path.join(ROOT, "target", "release", "examples", "gpu_epoch")
    cmd = [binary, "--data", d, "--models", models, "--hidden", str(hidden), "--epochs", str(a.epochs),
           "--dropout", str(dropout)]
    say("$ " + " ".join(cmd))
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if p.returncode == 2:
        say("ours: no usable GPU (see above)")
        return {}
    if p.returncode != 0:
        raise SystemExit(f"gpu_epoch failed with exit {p.returncode}")
    out = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[r["model"]] = r
    return out


def run_pyg_child(a, d, model, dropout):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model, "--data", d, "--hidden",
           str(hidden_of(a, model)), "--epochs", str(a.epochs), "--dropout", str(dropout)]
    say("$ " + " ".join(cmd))
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if p.returncode != 0:
        say(f"pyg child for {model} failed with exit {p.returncode}")
        return None
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def child(a):
    """Trains one model on the GPU with PyG (or plain torch) and prints one JSON line."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from pyg_train import build_csr  # the CPU benchmark's adjacency, both directions of every edge

    if not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    edges = np.load(os.path.join(a.data, "edges.npy"))
    x = torch.from_numpy(np.load(os.path.join(a.data, "features.npy"))).to(dev)
    y = torch.from_numpy(np.load(os.path.join(a.data, "labels.npy"))).to(dev)
    train_idx = torch.from_numpy(np.load(os.path.join(a.data, "train_idx.npy"))).to(dev)
    n, f = x.shape
    classes = int(y.max()) + 1
    adj = build_csr(edges, n).to(dev)
    del edges

    if a.child == "gat":
        # PyG's GATConv as its examples run it: edge_index (sources, targets) in COO, self-loops added by the
        # layer, 8 concatenated heads of `hidden`, then one averaged output head; ReLU and dropout between
        # layers (gpu_epoch's GAT: 8 heads, out_heads 1, attention dropout 0, ReLU).
        import torch_geometric
        from torch_geometric.nn import GATConv

        impl, version = "pyg", torch_geometric.__version__
        crow, col = adj.crow_indices(), adj.col_indices()
        row = torch.repeat_interleave(torch.arange(n, device=dev), crow[1:] - crow[:-1])
        edge_index = torch.stack([col, row])
        del adj, crow, col, row
        heads = 8
        convs = torch.nn.ModuleList([GATConv(f, a.hidden, heads=heads),
                                     GATConv(a.hidden * heads, classes, heads=1, concat=False)]).to(dev)

        def forward():
            h = F.relu(convs[0](x, edge_index))
            if a.dropout > 0:
                h = F.dropout(h, a.dropout, training=True)
            return convs[1](h, edge_index)

        params = convs.parameters()
        train_mode = convs.train
        return train_and_print(a, impl, version, forward, params, train_mode, y, train_idx, n)

    try:
        import torch_geometric
        from pyg_train import Net

        impl = "pyg"
        version = torch_geometric.__version__
        net = Net(a.child, f, a.hidden, classes, 2, a.dropout).to(dev)
        forward = lambda: net(x, adj)  # noqa: E731
        params = net.parameters()
        train_mode = net.train
    except ImportError:
        impl = "torch"
        version = torch.__version__
        # PyG's layers on a sparse adjacency, written out: GCN = D^-1/2 (A+I) D^-1/2 (X W) + b;
        # SAGE = mean_j X_j W_l + b + X W_r
        if a.child == "gcn":
            ones = torch.ones(n, device=dev)
            deg = torch.sparse.mm(adj, ones[:, None]).squeeze(1) + 1
            dinv = deg.rsqrt()
            crow, col = adj.crow_indices(), adj.col_indices()
            row = torch.repeat_interleave(torch.arange(n, device=dev), crow[1:] - crow[:-1])
            vals = dinv[row] * dinv[col]
            loops = torch.arange(n, device=dev)
            idx = torch.cat([torch.stack([row, col]), torch.stack([loops, loops])], 1)
            a_hat = torch.sparse_coo_tensor(idx, torch.cat([vals, dinv * dinv]), (n, n)).coalesce().to_sparse_csr()
        else:
            deg = torch.sparse.mm(adj, torch.ones(n, 1, device=dev)).clamp(min=1)
            crow, col = adj.crow_indices(), adj.col_indices()
            row = torch.repeat_interleave(torch.arange(n, device=dev), crow[1:] - crow[:-1])
            a_hat = torch.sparse_csr_tensor(crow, col, (1.0 / deg.squeeze(1))[row], (n, n))
        dims = [f, a.hidden, classes]
        lin = torch.nn.ModuleList([torch.nn.Linear(dims[i], dims[i + 1]) for i in range(2)]).to(dev)
        root = torch.nn.ModuleList([torch.nn.Linear(dims[i], dims[i + 1], bias=False) for i in range(2)]).to(dev)
        mods = torch.nn.ModuleList([lin, root]) if a.child == "sage" else lin

        def forward():
            h = x
            for i in range(2):
                out = lin[i](torch.sparse.mm(a_hat, h)) if dims[i] <= dims[i + 1] else torch.sparse.mm(a_hat, lin[i](h))
                if a.child == "sage":
                    out = out + root[i](h)
                h = out
                if i == 0:
                    h = F.relu(h)
                    if a.dropout > 0:
                        h = F.dropout(h, a.dropout, training=True)
            return h

        params = mods.parameters()
        train_mode = mods.train
    return train_and_print(a, impl, version, forward, params, train_mode, y, train_idx, n)


def train_and_print(a, impl, version, forward, params, train_mode, y, train_idx, n):
    """Times forward + loss + backward + Adam with synchronisation around each epoch; one JSON line."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.Adam(params, lr=0.01, weight_decay=5e-4)
    train_mode()
    times, losses = [], []
    torch.cuda.reset_peak_memory_stats()
    for ep in range(a.epochs + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = forward()
        loss = F.cross_entropy(out[train_idx], y[train_idx])
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        if ep >= 2:
            times.append(dt)
        losses.append(float(loss))
        print(f"[{impl}] {a.child} epoch {ep + 1}: loss {losses[-1]:.4f} {dt * 1e3:.1f} ms", file=sys.stderr)
    free, total = torch.cuda.mem_get_info()
    print(json.dumps({
        "impl": impl, "version": version, "torch": torch.__version__, "model": a.child, "nodes": int(n),
        "dropout": a.dropout, "device_used_bytes": total - free,
        "median_epoch_s": statistics.median(times), "epoch_s": times, "final_loss": losses[-1],
        "peak_cuda_bytes": torch.cuda.max_memory_allocated(), "gpu": torch.cuda.get_device_name(),
    }), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2_000_000)
    p.add_argument("--avg-degree", type=float, default=20.0)
    p.add_argument("--feat-dim", type=int, default=128)
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--models", default="gcn,sage,gat")
    p.add_argument("--gat-hidden", type=int, default=32, help="GAT's width per head (8 heads, concatenated)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--dropouts", default="0.5,0", help="dropout rates between layers, one run each")
    p.add_argument("--dropout", type=float, default=0.5, help=argparse.SUPPRESS)
    p.add_argument("--ours", help="path of the built gpu_epoch example")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--skip-pyg", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)

    d = graph_dir(a)
    rows = []
    for dropout in [float(p) for p in a.dropouts.split(",")]:
        ours = {} if a.skip_ours else run_ours(a, d, dropout)
        for model in a.models.split(","):
            theirs = None if a.skip_pyg else run_pyg_child(a, d, model, dropout)
            mine = ours.get(model)
            row = {"model": model, "dropout": dropout, "ours": mine, "baseline": theirs}
            if mine and theirs:
                row["time_ratio"] = mine["median_epoch_s"] / theirs["median_epoch_s"]
                row["device_memory_ratio"] = mine["device_used_bytes"] / theirs["device_used_bytes"]
            if mine:
                fwd = [s for s in mine["spmm"] if s["d"] == a.hidden and not s["transpose"]]
                if fwd:
                    row["spmm_fraction_of_copy"] = fwd[0]["fraction_of_copy"]
            rows.append(row)

    os.makedirs(os.path.join(OUT, "gpu"), exist_ok=True)
    with open(os.path.join(OUT, "gpu", "results.json"), "w") as fo:
        json.dump({"graph": d, "rows": rows}, fo, indent=2)
    gib = lambda v: f"{v / 2**30:.2f}" if v else "-"  # noqa: E731
    print(f"| model | dropout | baseline | baseline epoch ms | ours epoch ms | time ratio (<= 0.7) | baseline device GiB "
          f"(tensors GiB) | ours device GiB | memory ratio | SpMM d={a.hidden} % of copy (>= 60) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b, o = r["baseline"], r["ours"]
        fmt = lambda v, k=1e3: f"{v * k:.1f}" if v is not None else "-"  # noqa: E731
        print(f"| {r['model']} | {r['dropout']:g} | {b['impl'] + ' ' + b['version'] if b else '-'} | "
              f"{fmt(b['median_epoch_s']) if b else '-'} | {fmt(o['median_epoch_s']) if o else '-'} | "
              f"{r.get('time_ratio', float('nan')):.2f} | "
              f"{gib(b['device_used_bytes']) + ' (' + gib(b['peak_cuda_bytes']) + ')' if b else '-'} | "
              f"{gib(o['device_used_bytes']) if o else '-'} | {r.get('device_memory_ratio', float('nan')):.2f} | "
              f"{100 * r.get('spmm_fraction_of_copy', float('nan')):.0f} |")


if __name__ == "__main__":
    main()
