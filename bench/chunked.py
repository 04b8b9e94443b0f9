#!/usr/bin/env python3
"""Jobs on chunked SBM graphs of growing size (issue 31): every process's peak beside the graph's size.

For each `--nodes` size: `physalia data synth sbm --layout chunked` (average degree 20, 128 f32 features,
chunks of 16384 rows; kept under `--work` and reused), then the same partition-parallel GraphSAGE job
(`--workers` workers, 2 epochs) twice: the first partitions (the coordinator streams the assignment; the
workers cut their parts together, each reading 1/k of the chunk files and sending the rows to their
owners, and the coordinator commits the set), the second reuses the
stored set. From each job's `summary.json` and the set's `partition.safetensors`: the partitioning's seconds
(the assignment alone, and until the last part was written), edge cut and balance, the median epoch, the
coordinator's peak (`peak_rss_bytes`: its own VmHWM) and each worker's, and each worker's peak against its
share of the dataset's bytes plus its halo rows' features (the issue's bound: at most 1.5x), and the bytes of
the dataset's files each worker read (from its log) with their sum over the file's size.

    cargo build -p physalia
    python3 bench/chunked.py --bin target/debug/physalia --nodes 1000000,4000000 --work /tmp/chunked
"""

import argparse, json, os, re, subprocess, sys

MIB = 1 << 20

JOB = """name: chunked-{nodes}
dataset: {{path: {graph}}}
model: {{kind: sage, layers: 2, hidden: 16}}
train: {{epochs: 2, seed: 0, eval_every: 2}}
workers: {workers}
output: {{dir: {out}}}
"""


def run(binary, args, cwd):
    out = subprocess.run([binary] + args, cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"physalia {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def header_meta(path):
    """The `physalia` metadata of a safetensors file, from its header alone."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return json.loads(header["__metadata__"]["physalia"])


def data_bytes(graph):
    with open(os.path.join(graph, "manifest.json")) as f:
        m = json.load(f)
    total = 0
    for t in m["tensors"].values():
        for c in t["chunks"]:
            total += c["bytes"]
    return m, total


def job(binary, work, graph, nodes, workers):
    out = os.path.join(work, "jobs")
    path = os.path.join(work, f"job-{nodes}.yaml")
    with open(path, "w") as f:
        f.write(JOB.format(nodes=nodes, graph=graph, workers=workers, out=out))
    v = json.loads(run(binary, ["submit", path, "-q", "--output", "json"], work).strip().splitlines()[-1])
    job_dir = v["job_dir"] if os.path.isabs(v["job_dir"]) else os.path.join(work, v["job_dir"])
    with open(os.path.join(job_dir, "summary.json")) as f:
        return json.load(f), job_dir


def bytes_read(job_dir, workers):
    """MiB of the dataset's files each worker read while cutting its part (its log's `read X MiB of the
    dataset's files`), or None where it cut nothing (a reused set) or cut alone."""
    out = []
    for rank in range(workers):
        try:
            with open(os.path.join(job_dir, "logs", f"worker-{rank}.log")) as f:
                log = f.read()
        except OSError:
            out.append(None)
            continue
        m = re.search(r"read ([0-9.]+) MiB of the dataset's files", log)
        out.append(float(m.group(1)) if m else None)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/debug/physalia")
    ap.add_argument("--nodes", default="1000000")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--work", default="bench/out/chunked")
    a = ap.parse_args()
    binary = os.path.abspath(a.bin)
    os.makedirs(a.work, exist_ok=True)
    print("| graph | partitioning in the job | assignment s | until the last part s | cut | balance "
          "| median epoch s | coordinator peak MiB | worker peaks MiB | worker peak / (share + halo) "
          "| dataset read per worker MiB (all / file) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---|---|")
    for nodes in [int(x) for x in a.nodes.split(",")]:
        graph = os.path.abspath(os.path.join(a.work, f"sbm{nodes}"))
        if not os.path.isfile(os.path.join(graph, "manifest.json")):
            run(binary, ["data", "synth", "sbm", "--nodes", str(nodes), "--avg-degree", "20",
                         "--feat-dim", "128", "--layout", "chunked", "--chunk-rows", "16384", "-o", graph],
                a.work)
        manifest, size = data_bytes(graph)
        feat_dim = manifest["feat_dim"]
        set_dir = f"{graph}/parts/k{a.workers}-seed0"
        subprocess.run(["rm", "-rf", f"{graph}/parts"])
        for label in ["computed", "reused"]:
            s, job_dir = job(binary, a.work, graph, nodes, a.workers)
            read = bytes_read(job_dir, a.workers)
            read_cell = "-" if all(r is None for r in read) else (
                ", ".join("?" if r is None else f"{r:.0f}" for r in read)
                + f" ({sum(r or 0 for r in read) * MIB / size:.2f}x)")
            meta = header_meta(os.path.join(set_dir, "partition.safetensors"))
            halos = [p["n_halo"] for p in meta["parts"]]
            record = s["partitions"][0] if s.get("partitions") else {}
            peaks = [p or 0 for p in s.get("worker_peak_rss_bytes") or []]
            bounds = [size / a.workers + h * feat_dim * 4 for h in halos]
            ratios = [p / b for p, b in zip(peaks, bounds)]
            print(f"| SBM {nodes // 1000}k ({size / MIB:.0f} MiB) | {label} ({record.get('method', '?')}) "
                  f"| {record.get('partition_seconds') or meta.get('partition_seconds', 0):.1f} "
                  f"| {record.get('compute_seconds', meta['compute_seconds']):.1f} "
                  f"| {meta['edge_cut'] / max(meta['num_undirected_edges'], 1):.3f} | {meta['balance']:.3f} "
                  f"| {s['median_epoch_s']:.2f} "
                  f"| {s['peak_rss_bytes'] / MIB:.0f} "
                  f"| {', '.join(f'{p / MIB:.0f}' for p in peaks)} "
                  f"| {', '.join(f'{r:.2f}' for r in ratios)} | {read_cell} |", flush=True)


if __name__ == "__main__":
    main()
