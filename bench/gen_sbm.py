#!/usr/bin/env python3
"""Generate a learnable stochastic-block-model graph in Physalia's "generic layout".

numpy only, fully determined by --seed. Writes into --out:

  edges.npy      int64 [E, 2]  each undirected edge once, src < dst, no self loops,
                               no duplicates, sorted by (src, dst)
  features.npy   float32 [N, F] C order
  labels.npy     int64 [N]
  train_idx.npy  int64  (10% of nodes, random)
  val_idx.npy    int64  (10%)
  test_idx.npy   int64  (80%)
  meta.json      the generation parameters and the resulting counts

Classes are uniform at random. Each node draws about avg_degree/2 edge stubs;
a fraction --intra (default 0.8) of them go to a random node of the same class,
the rest to a random node of any class. Features are a per-class centroid plus
Gaussian noise that dominates it (--signal, default 0.1 of the noise scale per
dimension) so that features alone are weak and neighbourhood aggregation, which
averages the noise away over mostly same-class neighbours, is what makes the
task learnable.

  python3 bench/gen_sbm.py --nodes 1000000 --avg-degree 10 --feat-dim 128 \
      --classes 16 --seed 0 --out bench/out/sbm-1000000
"""

import argparse
import json
import os
import sys
import time

import numpy as np


def generate(n, avg_degree, feat_dim, classes, seed, intra, signal):
    rng = np.random.default_rng(seed)

    labels = rng.integers(0, classes, size=n, dtype=np.int64)

    # Nodes grouped by class, for drawing same-class partners.
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=classes)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))

    # Each undirected edge contributes 2 to the degree sum, so n*avg_degree/2
    # edges. Draw ~8% extra to compensate for self loops and duplicates.
    m_target = int(round(n * avg_degree / 2))
    m_draw = int(m_target * 1.08) + 16
    src = rng.integers(0, n, size=m_draw, dtype=np.int64)
    same = rng.random(m_draw) < intra
    dst = rng.integers(0, n, size=m_draw, dtype=np.int64)
    # Same-class partner: uniform position inside the source's class block.
    src_cls = labels[src[same]]
    offs = (rng.random(src_cls.shape[0]) * counts[src_cls]).astype(np.int64)
    dst[same] = order[starts[src_cls] + offs]
    del same, src_cls, offs

    lo = np.minimum(src, dst)
    hi = np.maximum(src, dst)
    del src, dst
    keep = lo != hi
    key = lo[keep] * n + hi[keep]
    del lo, hi, keep
    key = np.unique(key)  # sorted, deduplicated
    if key.shape[0] > m_target:
        # Drop a random surplus, keep sorted order.
        pick = rng.choice(key.shape[0], size=m_target, replace=False)
        pick.sort()
        key = key[pick]
        del pick
    edges = np.empty((key.shape[0], 2), dtype=np.int64)
    edges[:, 0] = key // n
    edges[:, 1] = key % n
    del key

    centroids = rng.standard_normal((classes, feat_dim), dtype=np.float32)
    features = rng.standard_normal((n, feat_dim), dtype=np.float32)
    features += np.float32(signal) * centroids[labels]
    features = np.ascontiguousarray(features, dtype=np.float32)

    perm = rng.permutation(n).astype(np.int64)
    n_train = int(n * 0.1)
    n_val = int(n * 0.1)
    train_idx = np.sort(perm[:n_train])
    val_idx = np.sort(perm[n_train:n_train + n_val])
    test_idx = np.sort(perm[n_train + n_val:])
    return edges, features, labels, train_idx, val_idx, test_idx


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--avg-degree", type=float, default=10.0)
    p.add_argument("--feat-dim", type=int, default=128)
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--intra", type=float, default=0.8, help="fraction of intra-class edges")
    p.add_argument("--signal", type=float, default=0.1,
                   help="centroid scale relative to unit per-dimension noise")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.nodes < 2 or a.classes < 1 or a.feat_dim < 1:
        p.error("need --nodes >= 2, --classes >= 1, --feat-dim >= 1")

    t0 = time.perf_counter()
    edges, feats, labels, tr, va, te = generate(
        a.nodes, a.avg_degree, a.feat_dim, a.classes, a.seed, a.intra, a.signal)
    os.makedirs(a.out, exist_ok=True)
    for name, arr in [("edges", edges), ("features", feats), ("labels", labels),
                      ("train_idx", tr), ("val_idx", va), ("test_idx", te)]:
        tmp = os.path.join(a.out, name + ".tmp.npy")
        np.save(tmp, arr)
        os.replace(tmp, os.path.join(a.out, name + ".npy"))
    meta = {
        "generator": "bench/gen_sbm.py", "nodes": a.nodes, "edges": int(edges.shape[0]),
        "avg_degree_requested": a.avg_degree, "avg_degree": 2.0 * edges.shape[0] / a.nodes,
        "feat_dim": a.feat_dim, "classes": a.classes, "seed": a.seed, "intra": a.intra,
        "signal": a.signal, "train": int(tr.shape[0]), "val": int(va.shape[0]), "test": int(te.shape[0]),
    }
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(f"wrote {a.out}: {a.nodes} nodes, {edges.shape[0]} undirected edges, "
          f"{a.feat_dim} features, {a.classes} classes in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
