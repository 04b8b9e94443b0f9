#!/usr/bin/env python3
"""Neighbour-sampling throughput: Physalia's sampler vs PyG's NeighborLoader.

  python3 bench/sampler.py [--file bench/out/sbm-1000000.safetensors] [--fanouts 25,10]
                           [--batch 1024] [--threads 2] [--seconds 5] [--gen-sbm N]

1. Runs graph/examples/sample_bench.rs (cargo run --release; CARGO_TARGET_DIR is honoured) on the
   dataset file and reads its JSON line: sampled edges/s through the prefetching loader, batches/s, and
   the memory-bandwidth bound measured in the same run. --gen-sbm N makes the example generate a Rust
   SBM into --file first when the file is missing (for machines without numpy for bench/gen_sbm.py).
2. If torch_geometric's NeighborLoader can run here (it needs pyg-lib or torch-sparse), samples the same
   training seeds in the same order with the same fan-outs and batch size, with torch.set_num_threads
   (--threads), for the same time, and prints the ratios. Otherwise says why and skips that part.

The graph is read straight from the safetensors file (header + raw little-endian tensors, numpy only), so
both sides sample the identical CSR. Note on semantics: our sampler (like GraphSAGE, SALIENT and DGL)
redraws neighbours for every destination of every block, seeds included; NeighborLoader draws only for
the nodes first reached at the previous hop, so it samples somewhat fewer edges per batch. Compare
edges/s for throughput; batches/s is reported for both too.

Prints one JSON object on stdout (also the last line), progress on stderr.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def say(msg):
    print(f"[sampler] {msg}", file=sys.stderr, flush=True)


def run_ours(a):
    cmd = ["cargo", "run", "--release", "-q", "-p", "physalia-graph", "--example", "sample_bench", "--",
           a.file, "--fanouts", a.fanouts, "--batch", str(a.batch), "--threads", str(a.threads),
           "--seconds", str(a.seconds)]
    if a.gen_sbm:
        cmd += ["--gen-sbm", str(a.gen_sbm)]
    say("$ " + " ".join(shlex.quote(c) for c in cmd))
    r = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(f"sample_bench failed (exit {r.returncode})")
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if not lines:
        sys.exit(f"sample_bench printed no JSON:\n{r.stdout}")
    return json.loads(lines[-1])


def pyg_unavailable():
    """None if NeighborLoader can sample here, else the reason."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return f"torch is not installed ({e})"
    try:
        import torch_geometric  # noqa: F401
        from torch_geometric.loader import NeighborLoader  # noqa: F401
    except ImportError as e:
        return f"torch_geometric is not installed ({e})"
    backends = []
    for mod in ("pyg_lib", "torch_sparse"):
        try:
            __import__(mod)
            backends.append(mod)
        except ImportError:
            pass
    if not backends:
        return "neither pyg_lib nor torch_sparse is installed (NeighborLoader needs one of them)"
    return None


def read_safetensors(path, names):
    """The named tensors of a safetensors file as numpy arrays (copies, so the file can close)."""
    import numpy as np
    dtypes = {"I64": np.int64, "I32": np.int32, "F32": np.float32}
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        base = 8 + n
        out = {}
        for name in names:
            t = header[name]
            start, end = t["data_offsets"]
            f.seek(base + start)
            out[name] = np.frombuffer(f.read(end - start), dtype=dtypes[t["dtype"]]).reshape(t["shape"])
    return out


def run_pyg(a):
    import numpy as np
    import torch
    import torch_geometric
    from torch_geometric.data import Data
    from torch_geometric.loader import NeighborLoader

    torch.set_num_threads(a.threads)
    t = read_safetensors(a.file, ["indptr", "indices", "train_idx"])
    indptr, indices = t["indptr"], t["indices"]
    n = len(indptr) - 1
    # Row v of our CSR lists the in-neighbours (sources) of v; PyG samples sources of edges into a node.
    dst = np.repeat(np.arange(n, dtype=np.int64), np.diff(indptr))
    edge_index = torch.from_numpy(np.stack([indices.astype(np.int64), dst]))
    data = Data(edge_index=edge_index, num_nodes=n)
    fanouts = [-1 if f in ("all", "-1") else int(f) for f in a.fanouts.split(",")]
    seeds = torch.from_numpy(t["train_idx"].copy())
    loader = NeighborLoader(data, num_neighbors=fanouts, batch_size=a.batch, input_nodes=seeds,
                            shuffle=False, num_workers=0)
    it = iter(loader)
    next(it)  # warm-up (builds the CSC the sampler reads)
    batches = edges = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < a.seconds:
        try:
            b = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        batches += 1
        edges += int(b.edge_index.size(1))
    wall = time.perf_counter() - t0
    return {"torch": torch.__version__, "pyg": torch_geometric.__version__, "threads": torch.get_num_threads(),
            "batches": batches, "wall_s": wall, "batches_per_s": batches / wall, "edges_per_s": edges / wall,
            "edges_per_batch": edges / max(batches, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", default=os.path.join("bench", "out", "sbm-1000000.safetensors"))
    p.add_argument("--fanouts", default="25,10")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--gen-sbm", type=int, default=0,
                   help="generate a Rust SBM with this many nodes into --file if it is missing")
    a = p.parse_args()
    os.chdir(ROOT)
    if not os.path.exists(a.file) and not a.gen_sbm:
        sys.exit(f"{a.file} does not exist; make it with bench/gen_sbm.py + `physalia data import` "
                 f"(see bench/compare.py), or pass --gen-sbm N")

    ours = run_ours(a)
    say(f"physalia: {ours['edges_per_s'] / 1e6:.1f} M edges/s, {ours['batches_per_s']:.1f} batches/s, "
        f"{ours['ratio_to_bound']:.2f} of the bandwidth bound ({ours['bound_edges_per_s'] / 1e6:.1f} M edges/s)")
    result = {"physalia": ours, "pyg": None}
    why = pyg_unavailable()
    if why:
        say(f"skipping PyG NeighborLoader: {why}")
        result["pyg_skipped"] = why
    else:
        pyg = run_pyg(a)
        result["pyg"] = pyg
        result["edges_per_s_ratio"] = ours["edges_per_s"] / pyg["edges_per_s"]
        result["batches_per_s_ratio"] = ours["batches_per_s"] / pyg["batches_per_s"]
        say(f"pyg: {pyg['edges_per_s'] / 1e6:.1f} M edges/s, {pyg['batches_per_s']:.1f} batches/s; "
            f"ours / pyg: {result['edges_per_s_ratio']:.2f}x edges/s, {result['batches_per_s_ratio']:.2f}x batches/s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
