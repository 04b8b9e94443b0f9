#!/usr/bin/env python3
"""Full-graph GCN / GraphSAGE training with PyTorch Geometric on CPU, the
reference side of the Physalia benchmark (see bench/README.md).

Reads the generic layout written by bench/gen_sbm.py (edges.npy, features.npy,
labels.npy, train_idx.npy, val_idx.npy, test_idx.npy) and prints one JSON line
on stdout at the end.

Sparse path (PyG without torch-sparse / pyg-lib, which do not install here):
the adjacency is a `torch.sparse_csr_tensor` holding both directions of every
undirected edge. PyG's MessagePassing sees a sparse tensor and calls the
layer's `message_and_aggregate`, which goes to `torch_geometric.utils.spmm`:
  * GCNConv(cached=True): `gcn_norm` adds self loops and computes
    D^-1/2 (A+I) D^-1/2 once on the CSR (cached across epochs), then every
    forward is `torch.sparse.mm(csr, x)` (reduce='sum').
  * SAGEConv(aggr='mean'): `torch.sparse.mm(csr, x, 'mean')`, PyTorch's native
    CPU sparse-reduce kernel (`_sparse_mm_reduce_impl`, which has a backward).
No COO fallback and no edge-wise gather/scatter is involved; `--check-path`
prints which function PyG dispatched to.

  python3 bench/pyg_train.py --data bench/out/sbm-100000 --model gcn \
      --hidden 256 --layers 2 --epochs 5 --dropout 0.5 --threads 2 --lr 0.01
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import torch_geometric
from torch_geometric.nn import GATConv, GCNConv, SAGEConv


def log(msg):
    print(f"[pyg_train] {msg}", file=sys.stderr, flush=True)


def build_csr(edges: np.ndarray, n: int) -> torch.Tensor:
    """Symmetric CSR adjacency (both directions of every edge, value 1).

    Rows are targets, columns sources (PyG's adj_t); the matrix is symmetric
    so the distinction is moot."""
    e = torch.from_numpy(edges)
    row = torch.cat([e[:, 1], e[:, 0]])
    col = torch.cat([e[:, 0], e[:, 1]])
    del e
    key = row * n + col
    key, _ = torch.sort(key)
    row = key // n
    col = key - row * n
    del key
    counts = torch.bincount(row, minlength=n)
    crow = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=crow[1:])
    vals = torch.ones(col.numel(), dtype=torch.float32)
    return torch.sparse_csr_tensor(crow, col, vals, size=(n, n))


class Net(torch.nn.Module):
    """torch_geometric-style stack: conv, ReLU, dropout between layers (and on the input features when
    input_dropout > 0, as Physalia's `model.input_dropout` and Kipf & Welling's GCN do).

    GAT: `heads` heads of `hidden // heads` columns, concatenated, in the hidden layers; one output head;
    no attention dropout (Physalia's `attn_dropout: 0`)."""

    def __init__(self, model, in_dim, hidden, out_dim, layers, dropout, input_dropout=0.0, heads=4):
        super().__init__()
        dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
        convs = []
        for i in range(layers):
            if model == "gcn":
                convs.append(GCNConv(dims[i], dims[i + 1], cached=True))
            elif model == "gat":
                last = i == layers - 1
                convs.append(GATConv(dims[i], dims[i + 1] if last else dims[i + 1] // heads,
                                     heads=1 if last else heads, concat=not last))
            else:
                convs.append(SAGEConv(dims[i], dims[i + 1], aggr="mean"))
        self.convs = torch.nn.ModuleList(convs)
        self.dropout = dropout
        self.input_dropout = input_dropout

    def forward(self, x, adj_t):
        last = len(self.convs) - 1
        if self.input_dropout > 0:
            x = F.dropout(x, p=self.input_dropout, training=self.training)
        for i, conv in enumerate(self.convs):
            x = conv(x, adj_t)
            if i != last:
                x = F.relu(x)
                if self.dropout > 0:
                    x = F.dropout(x, p=self.dropout, training=self.training)
        return x


def install_path_probe():
    """Wrap torch.sparse.mm to record how PyG called it (layout, reduce)."""
    seen = {}
    orig = torch.sparse.mm

    def probe(mat1, mat2, reduce=None):
        k = (str(mat1.layout), "sum" if reduce is None else reduce, str(mat2.dtype))
        seen[k] = seen.get(k, 0) + 1
        return orig(mat1, mat2) if reduce is None else orig(mat1, mat2, reduce)

    torch.sparse.mm = probe
    return seen


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--model", choices=["gcn", "sage", "gat"], required=True)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--input-dropout", type=float, default=0.0,
                   help="dropout on the input features (default 0: the benchmark jobs' input_dropout)")
    p.add_argument("--heads", type=int, default=4, help="GAT: heads of the hidden layer (--hidden is their total)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-eval", action="store_true",
                   help="skip the (untimed) accuracy evaluation after training")
    p.add_argument("--check-path", action="store_true",
                   help="record which torch.sparse.mm variants PyG called (adds a tiny overhead)")
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    t0 = time.perf_counter()
    edges = np.load(os.path.join(a.data, "edges.npy"))
    x = torch.from_numpy(np.load(os.path.join(a.data, "features.npy")))
    y = torch.from_numpy(np.load(os.path.join(a.data, "labels.npy")))
    train_idx = torch.from_numpy(np.load(os.path.join(a.data, "train_idx.npy")))
    val_idx = torch.from_numpy(np.load(os.path.join(a.data, "val_idx.npy")))
    test_idx = torch.from_numpy(np.load(os.path.join(a.data, "test_idx.npy")))
    n, f = x.shape
    num_classes = int(y.max()) + 1
    adj_t = build_csr(edges, n)
    num_edges = int(edges.shape[0])
    if a.model == "gat":
        # GATConv scores every edge: it takes the edge list (both directions; it adds the self loops)
        crow, col = adj_t.crow_indices(), adj_t.col_indices()
        row = torch.repeat_interleave(torch.arange(n), crow[1:] - crow[:-1])
        adj_t = torch.stack([col, row])  # source, target
        del crow, col, row
    del edges
    log(f"loaded {n} nodes, {num_edges} undirected edges ({2 * num_edges} directed), "
        f"F={f}, C={num_classes} in {time.perf_counter() - t0:.2f}s; threads={torch.get_num_threads()}")

    seen = install_path_probe() if a.check_path else None

    model = Net(a.model, f, a.hidden, num_classes, a.layers, a.dropout, a.input_dropout, a.heads)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)

    epoch_s = []
    epoch_cpu_s = []  # process CPU time (all threads): a contention-robust companion to wall time
    losses = []
    for ep in range(a.epochs):
        model.train()
        c = time.process_time()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = model(x, adj_t)
        loss = F.cross_entropy(out[train_idx], y[train_idx])
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t
        epoch_cpu_s.append(time.process_time() - c)
        del out
        epoch_s.append(dt)
        losses.append(loss.detach().item())
        log(f"epoch {ep + 1}/{a.epochs}: loss {losses[-1]:.4f} {dt:.3f}s")

    result = {
        "impl": "pyg",
        "model": a.model,
        "nodes": int(n),
        "edges": num_edges,
        "epochs": a.epochs,
        "epoch_s": epoch_s,
        "median_epoch_s": statistics.median(epoch_s) if epoch_s else None,
        "epoch_cpu_s": epoch_cpu_s,
        "median_epoch_cpu_s": statistics.median(epoch_cpu_s) if epoch_cpu_s else None,
        "final_loss": losses[-1] if losses else None,
        "losses": losses,
        "dropout": a.dropout,
        "input_dropout": a.input_dropout,
        "hidden": a.hidden,
        "layers": a.layers,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "pyg": torch_geometric.__version__,
    }
    if not a.no_eval:
        model.eval()
        with torch.no_grad():
            pred = model(x, adj_t).argmax(dim=-1)
        for name, idx in [("train", train_idx), ("val", val_idx), ("test", test_idx)]:
            result[f"{name}_acc"] = float((pred[idx] == y[idx]).float().mean())
    if seen is not None:
        result["sparse_mm_calls"] = {f"{k[0]}/{k[1]}/{k[2]}": v for k, v in seen.items()}
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
