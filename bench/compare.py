#!/usr/bin/env python3
"""Physalia vs PyTorch Geometric on CPU, side by side, in one command.

  python3 bench/compare.py [--sizes 100000,1000000] [--epochs 10] [--repeats 1]
                           [--quick] [--only-pyg]

For each graph size N:
  1. bench/gen_sbm.py writes a stochastic block model graph to bench/out/sbm-N/
     (skipped if it is already there);
  2. `physalia data import` converts that same directory to
     bench/out/sbm-N.safetensors for our side (skipped if it exists);
  3. for each model (gcn, sage) and dropout (0.5, 0.0), PyG
     (bench/pyg_train.py) and Physalia (`physalia submit bench/jobs/sbm-<model>.yaml`)
     are run as child processes, alternately (the order flips every repeat),
     with the same thread count (OMP/MKL/RAYON_NUM_THREADS and their own
     --threads flags). Each child's peak RSS is taken from os.wait4's ru_maxrss,
     so both sides are measured by the kernel in the same way.

`--input-dropouts 0,0.5` adds rows with dropout on the input features on both sides (as
examples/cora-gcn.yaml runs GCN; the benchmark jobs set none, so GCN's first aggregation is cached).
`--models gat` adds PyG's GATConv against our GAT (hidden width --hidden as --heads heads).
`--ours-engine PATH` runs our side as the engine's `bench_train` example (the same engine, one process, no
coordinator) instead of `physalia submit`, for machines where the CLI (which builds the cloud SDKs) is not
built: `cargo build --release -p physalia-gnn --example bench_train`.

Prints a table and writes bench/out/results.md and bench/out/results.json
(rewritten after every configuration, so a partial run leaves partial results).
Child stdout/stderr are kept under bench/out/logs/.
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join("bench")
OUT = os.path.join("bench", "out")
LOGS = os.path.join(OUT, "logs")
BIN = os.path.join("target", "release", "physalia")
GEN_FILES = ["edges.npy", "features.npy", "labels.npy", "train_idx.npy", "val_idx.npy", "test_idx.npy"]


def say(msg):
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


class ChildFailed(Exception):
    pass


def tail(path, n=40):
    try:
        with open(path, "r", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return "<no output>"
    return "".join(lines[-n:]).rstrip() or "<empty>"


def child_env(threads):
    env = dict(os.environ)
    t = str(threads)
    env.update({"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "RAYON_NUM_THREADS": t,
                "OPENBLAS_NUM_THREADS": t, "PYTHONUNBUFFERED": "1"})
    return env


def run_child(cmd, tag, threads, timeout=None):
    """Run cmd, wait for it with os.wait4; return (returncode, peak_rss_bytes,
    wall_s, stdout_path, stderr_path)."""
    os.makedirs(LOGS, exist_ok=True)
    out_p = os.path.join(LOGS, tag + ".stdout")
    err_p = os.path.join(LOGS, tag + ".stderr")
    say("$ " + " ".join(shlex.quote(c) for c in cmd))
    t0 = time.perf_counter()
    with open(out_p, "wb") as fo, open(err_p, "wb") as fe:
        try:
            proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                    env=child_env(threads), cwd=ROOT)
        except OSError as e:
            raise ChildFailed(f"{tag}: could not start {cmd[0]}: {e}")
        deadline = None if timeout is None else t0 + timeout
        while True:
            flags = 0 if deadline is None else os.WNOHANG
            pid, status, ru = os.wait4(proc.pid, flags)
            if pid == proc.pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, ru = os.wait4(proc.pid, 0)
                proc.returncode = -9
                raise ChildFailed(f"{tag}: timed out after {timeout}s\n--- stderr tail ({err_p}) ---\n"
                                  + tail(err_p))
            time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)  # keep Popen from reaping again
    wall = time.perf_counter() - t0
    run_child.last_cpu_s = ru.ru_utime + ru.ru_stime
    return proc.returncode, ru.ru_maxrss * 1024, wall, out_p, err_p


def last_json(path):
    with open(path, "r", errors="replace") as f:
        lines = [l.strip() for l in f if l.strip()]
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def ensure_graph(n, args):
    d = os.path.join(OUT, f"sbm-{n}")
    if all(os.path.exists(os.path.join(d, f)) for f in GEN_FILES):
        say(f"graph {d} exists, reusing")
        return d
    cmd = [sys.executable, os.path.join(BENCH, "gen_sbm.py"), "--nodes", str(n), "--avg-degree",
           str(args.avg_degree), "--feat-dim", str(args.feat_dim), "--classes", str(args.classes),
           "--seed", str(args.seed), "--out", d]
    rc, rss, wall, o, e = run_child(cmd, f"gen-sbm-{n}", args.threads)
    if rc != 0:
        raise ChildFailed(f"gen_sbm.py failed (exit {rc})\n{tail(e)}")
    say(f"generated {d} in {wall:.1f}s")
    return d


def ensure_binary(args):
    if args.ours_engine:
        if not os.path.exists(args.ours_engine):
            raise ChildFailed(f"--ours-engine {args.ours_engine} does not exist (cargo build --release "
                              "-p physalia-gnn --example bench_train)")
        return
    if os.path.exists(args.bin):
        return
    if args.bin != BIN:
        raise ChildFailed(f"--bin {args.bin} does not exist")
    say(f"{BIN} missing: cargo build --release -p physalia")
    r = subprocess.run(["cargo", "build", "--release", "-p", "physalia"], cwd=ROOT)
    if r.returncode != 0 or not os.path.exists(BIN):
        raise ChildFailed("cargo build --release -p physalia failed; see the output above")


def ensure_import(n, graph_dir, args):
    st = os.path.join(OUT, f"sbm-{n}.safetensors")
    if os.path.exists(st):
        say(f"{st} exists, reusing")
        return st
    cmd = ([args.ours_engine, "import", graph_dir, st] if args.ours_engine else
           [args.bin, "data", "import", graph_dir, "--format", "generic", "--out", st])
    rc, rss, wall, o, e = run_child(cmd, f"import-sbm-{n}", args.threads)
    if rc != 0 or not os.path.exists(st):
        if os.path.exists(st):
            os.remove(st)  # do not leave a half-written file to be "reused"
        raise ChildFailed(f"physalia data import failed (exit {rc})\n--- stderr tail ({e}) ---\n{tail(e)}"
                          f"\n--- stdout tail ({o}) ---\n{tail(o, 10)}")
    say(f"imported {st} in {wall:.1f}s (peak RSS {rss / 2**20:.0f} MiB)")
    return st


def hidden_of(model, args):
    return args.gat_hidden if model == "gat" else args.hidden


def run_pyg(n, graph_dir, model, dropout, in_drop, rep, args):
    cmd = [sys.executable, os.path.join(BENCH, "pyg_train.py"), "--data", graph_dir, "--model", model,
           "--hidden", str(hidden_of(model, args)), "--layers", str(args.layers), "--epochs", str(args.epochs),
           "--dropout", str(dropout), "--input-dropout", str(in_drop), "--heads", str(args.heads),
           "--threads", str(args.threads), "--lr", str(args.lr), "--no-eval"]
    tag = f"pyg-sbm-{n}-{model}-p{dropout}-i{in_drop}-r{rep}"
    rc, rss, wall, o, e = run_child(cmd, tag, args.threads, args.timeout)
    if rc != 0:
        raise ChildFailed(f"{tag}: pyg_train.py failed (exit {rc})\n--- stderr tail ({e}) ---\n{tail(e)}")
    res = last_json(o)
    if res is None or "median_epoch_s" not in res:
        raise ChildFailed(f"{tag}: no JSON result line on stdout ({o})\n{tail(o, 10)}")
    return {"impl": "pyg", "median_epoch_s": float(res["median_epoch_s"]), "epoch_times_s": res["epoch_s"],
            "peak_rss_bytes": rss, "wall_s": wall, "cpu_s": run_child.last_cpu_s,
            "median_epoch_cpu_s": res.get("median_epoch_cpu_s"), "final_loss": res.get("final_loss"),
            "self_reported_peak_rss_bytes": res.get("peak_rss_bytes"),
            "torch": res.get("torch"), "pyg": res.get("pyg"), "log": o}


def run_ours(n, st, model, dropout, in_drop, rep, args):
    if args.ours_engine:
        cmd = [args.ours_engine, "train", st, model, str(args.epochs), str(dropout), str(in_drop),
               str(args.threads), str(hidden_of(model, args)), str(args.heads)]
    else:
        job = os.path.join(BENCH, "jobs", f"sbm-{model}.yaml")
        cmd = [args.bin, "submit", job, "--set", f"dataset.path={st}", "--set", f"model.dropout={dropout}",
               "--set", f"model.input_dropout={in_drop}", "--set", f"train.epochs={args.epochs}",
               "--set", f"train.threads={args.threads}", "--output", "json"]
    tag = f"ours-sbm-{n}-{model}-p{dropout}-i{in_drop}-r{rep}"
    rc, rss, wall, o, e = run_child(cmd, tag, args.threads, args.timeout)
    if rc != 0:
        raise ChildFailed(f"{tag}: physalia submit failed (exit {rc})\n--- stderr tail ({e}) ---\n{tail(e)}"
                          f"\n--- stdout tail ({o}) ---\n{tail(o, 10)}")
    res = last_json(o)
    if res is None or "median_epoch_s" not in res:
        raise ChildFailed(f"{tag}: the last stdout line of physalia submit is not a JSON object with "
                          f"median_epoch_s ({o})\n--- stdout tail ---\n{tail(o, 10)}\n--- stderr tail ---\n{tail(e)}")
    # The job runs as a coordinator (this child) and its worker process (a grandchild it reaps): wait4's
    # ru_maxrss is the larger of the two peaks. The coordinator peaks while it loads and checks the dataset,
    # before the worker starts, then holds little while the worker trains; the footprint is the larger of
    # its own peak and its resident set during training plus the workers' peaks, as the summary reports
    # them.
    workers = [w for w in (res.get("worker_peak_rss_bytes") or []) if w]
    if workers:
        during = (res.get("coordinator_rss_bytes") or res.get("peak_rss_bytes") or 0) + sum(workers)
        rss = max(rss, res.get("peak_rss_bytes") or 0, during)
    return {"impl": "ours", "median_epoch_s": float(res["median_epoch_s"]),
            "median_epoch_cpu_s": res.get("median_epoch_cpu_s"),
            "epoch_times_s": res.get("epoch_times_s"), "peak_rss_bytes": rss, "wall_s": wall,
            "cpu_s": run_child.last_cpu_s,
            "final_loss": res.get("final_loss", res.get("loss")), "log": o}


def summarise(runs):
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return None
    cpu = [r["median_epoch_cpu_s"] for r in ok if r.get("median_epoch_cpu_s") is not None]
    return {"median_epoch_s": statistics.median(r["median_epoch_s"] for r in ok),
            "median_epoch_cpu_s": statistics.median(cpu) if cpu else None,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ok),
            "final_loss": ok[-1].get("final_loss"), "repeats": len(ok)}


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def table_rows(rows):
    header = ["graph", "model", "dropout", "input dropout", "PyG median epoch s", "ours median epoch s", "ratio (ours/PyG)",
              "PyG peak RSS MiB", "ours peak RSS MiB", "ratio (ours/PyG)",
              "PyG CPU s/epoch", "ours CPU s/epoch", "CPU ratio"]
    body = []
    for r in rows:
        p, o = r["pyg"], r["ours"]
        pt = p and p["median_epoch_s"]
        ot = o and o["median_epoch_s"]
        pc = p and p.get("median_epoch_cpu_s")
        oc = o and o.get("median_epoch_cpu_s")
        pm = p and p["peak_rss_bytes"] / 2**20
        om = o and o["peak_rss_bytes"] / 2**20
        ofail = "FAILED" if r.get("ours_error") else None
        pfail = "FAILED" if r.get("pyg_error") else None
        body.append([r["graph"], r["model"], f"{r['dropout']:g}", f"{r.get('input_dropout', 0):g}",
                     pfail or fmt(pt, ".3f"), ofail or fmt(ot, ".3f"), fmt(ratio(ot, pt), ".2f"),
                     pfail or fmt(pm, ".0f"), ofail or fmt(om, ".0f"), fmt(ratio(om, pm), ".2f"),
                     fmt(pc, ".3f"), fmt(oc, ".3f"), fmt(ratio(oc, pc), ".2f")])
    return header, body


def print_table(rows):
    header, body = table_rows(rows)
    w = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).rjust(wi) if i > 3 else str(c).ljust(wi)
                                   for i, (c, wi) in enumerate(zip(cells, w)))
    print(line(header))
    print("  ".join("-" * wi for wi in w))
    for b in body:
        print(line(b))
    sys.stdout.flush()


def env_info(args):
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "threads": args.threads}
    try:
        with open("/proc/cpuinfo") as f:
            for l in f:
                if l.startswith("model name"):
                    info["cpu"] = l.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        info["loadavg_at_start"] = os.getloadavg()[0]
    except OSError:
        pass
    try:
        info["git_rev"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                         capture_output=True).stdout.strip() or None
    except OSError:
        pass
    return info


def write_results(rows, info, args):
    os.makedirs(OUT, exist_ok=True)
    header, body = table_rows(rows)
    md = ["# Physalia vs PyTorch Geometric (CPU)", "",
          f"Generated by `python3 bench/compare.py {' '.join(shlex.quote(a) for a in sys.argv[1:])}` "
          f"on {info.get('date')}.", "",
          f"CPU: {info.get('cpu', '?')} ({info.get('cpus')} logical CPUs); threads per run: {args.threads}; "
          f"epochs per run: {args.epochs}; repeats: {args.repeats}; "
          f"model: {args.layers} layers, hidden {args.hidden} (GAT: {args.gat_hidden} as {args.heads} heads); "
          f"our side: {'the engine example ' + args.ours_engine if args.ours_engine else 'physalia submit'}; torch {info.get('torch', '?')}, "
          f"torch_geometric {info.get('pyg', '?')}; load average at start "
          f"{fmt(info.get('loadavg_at_start'), '.2f')}.", "",
          "Epoch time is the median over epochs (then the median over repeats) of forward + backward + "
          "optimizer step; peak RSS is the child's ru_maxrss from wait4 (max over repeats); CPU s/epoch is the "
          "median epoch's process CPU time, all threads (less skewed than wall time on a shared machine)."
          + (f" For scale: a Python child that only runs `import torch, torch_geometric` peaks at "
             f"{info['pyg_import_only_rss_bytes'] / 2**20:.0f} MiB." if info.get("pyg_import_only_rss_bytes") else ""),
          "",
          "| " + " | ".join(header) + " |",
          "|" + "|".join(["---"] * 4 + ["---:"] * (len(header) - 4)) + "|"]
    md += ["| " + " | ".join(b) + " |" for b in body]
    errs = [r for r in rows if r.get("ours_error") or r.get("pyg_error")]
    if errs:
        md += ["", "Failures:", ""]
        for r in errs:
            for k in ("pyg_error", "ours_error"):
                if r.get(k):
                    md.append(f"- {r['graph']} {r['model']} dropout {r['dropout']:g} input dropout "
                              f"{r.get('input_dropout', 0):g} ({k[:-6]}): "
                              f"{r[k].splitlines()[0]}")
    with open(os.path.join(OUT, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump({"env": info, "args": vars(args), "results": rows}, f, indent=2)
        f.write("\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=None, help="comma-separated node counts (default 100000,1000000)")
    p.add_argument("--epochs", type=int, default=None, help="epochs per run (default 10)")
    p.add_argument("--repeats", type=int, default=1, help="runs per side and configuration, alternating order")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: --sizes 100000 --epochs 3 unless given explicitly")
    p.add_argument("--only-pyg", action="store_true", help="skip the Physalia side (no build, no import)")
    p.add_argument("--only-ours", action="store_true", help="skip the PyG side")
    p.add_argument("--models", default="gcn,sage")
    p.add_argument("--dropouts", default="0.5,0.0")
    p.add_argument("--input-dropouts", default="0.0",
                   help="dropout on the input features, both sides (0.5: as examples/cora-gcn.yaml runs GCN)")
    p.add_argument("--heads", type=int, default=4, help="GAT: heads of the hidden layer")
    p.add_argument("--gat-hidden", type=int, default=64,
                   help="GAT: hidden width, all heads together (PyG's GATConv holds every edge's messages, "
                        "edges x width floats, several times over)")
    p.add_argument("--ours-engine", default=None,
                   help="run our side as this bench_train example binary instead of physalia submit")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--avg-degree", type=float, default=10)
    p.add_argument("--feat-dim", type=int, default=128)
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bin", default=BIN, help="the physalia binary (default target/release/physalia)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per training child")
    args = p.parse_args()
    if args.sizes is None:
        args.sizes = "100000" if args.quick else "100000,1000000"
    if args.epochs is None:
        args.epochs = 3 if args.quick else 10
    if args.only_pyg and args.only_ours:
        p.error("--only-pyg and --only-ours exclude each other")
    sizes = [int(s.replace("_", "")) for s in args.sizes.split(",") if s.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    dropouts = [float(d) for d in args.dropouts.split(",") if d.strip()]
    in_drops = [float(d) for d in args.input_dropouts.split(",") if d.strip()]
    for m in models:
        if m not in ("gcn", "sage", "gat"):
            p.error(f"unknown model {m}")
    if "gat" in models and not args.ours_engine and not args.only_pyg:
        p.error("--models gat needs --ours-engine (bench/jobs has no GAT job)")

    os.chdir(ROOT)
    info = env_info(args)
    if info.get("loadavg_at_start", 0) > 0.5:
        say(f"warning: load average is {info['loadavg_at_start']:.2f} before starting; "
            "other processes will skew the timings (results.json also keeps each child's CPU seconds)")
    want_ours = not args.only_pyg
    want_pyg = not args.only_ours
    failures = 0
    if want_ours:
        try:
            ensure_binary(args)
        except ChildFailed as e:
            say(f"ERROR: {e}")
            return 1

    if want_pyg:
        # What `import torch, torch_geometric` alone costs, so the RSS columns can be read
        # against the frameworks' fixed overhead (measured the same way, via wait4).
        try:
            rc, rss, _, _, _ = run_child([sys.executable, "-c", "import torch, torch_geometric"],
                                         "pyg-import-only", args.threads)
            if rc == 0:
                info["pyg_import_only_rss_bytes"] = rss
        except ChildFailed:
            pass

    rows = []
    for n in sizes:
        try:
            graph_dir = ensure_graph(n, args)
        except ChildFailed as e:
            say(f"ERROR: {e}")
            return 1
        st, import_error = None, None
        if want_ours:
            try:
                st = ensure_import(n, graph_dir, args)
            except ChildFailed as e:
                import_error = str(e)
                say(f"ERROR: {e}")
        for model, dropout, in_drop in [(m, d, i) for m in models for i in in_drops for d in dropouts]:
            row = {"graph": f"sbm-{n}", "nodes": n, "model": model, "dropout": dropout,
                   "input_dropout": in_drop, "epochs": args.epochs, "pyg_runs": [], "ours_runs": []}
            for rep in range(args.repeats):
                order = ["pyg", "ours"] if rep % 2 == 0 else ["ours", "pyg"]
                for side in order:
                    if side == "pyg" and want_pyg:
                        try:
                            r = run_pyg(n, graph_dir, model, dropout, in_drop, rep, args)
                            info.setdefault("torch", r.get("torch"))
                            info.setdefault("pyg", r.get("pyg"))
                        except ChildFailed as e:
                            say(f"ERROR: {e}")
                            r = {"error": str(e)}
                        row["pyg_runs"].append(r)
                    elif side == "ours" and want_ours:
                        if import_error:
                            r = {"error": import_error}
                        else:
                            try:
                                r = run_ours(n, st, model, dropout, in_drop, rep, args)
                            except ChildFailed as e:
                                say(f"ERROR: {e}")
                                r = {"error": str(e)}
                        row["ours_runs"].append(r)
                    else:
                        continue
                    if "error" in r:
                        failures += 1
                    else:
                        say(f"{side:4s} sbm-{n} {model} p={dropout:g} in={in_drop:g} rep {rep}: median epoch "
                            f"{r['median_epoch_s']:.3f}s, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB")
            try:
                row["loadavg_after"] = os.getloadavg()[0]
            except OSError:
                pass
            row["pyg"] = summarise(row["pyg_runs"])
            row["ours"] = summarise(row["ours_runs"])
            for side in ("pyg", "ours"):
                errs = [r["error"] for r in row[f"{side}_runs"] if "error" in r]
                if errs and row[side] is None:
                    row[f"{side}_error"] = errs[0]
            rows.append(row)
            write_results(rows, info, args)

    print()
    print_table(rows)
    print(f"\nwrote {os.path.join(OUT, 'results.md')} and {os.path.join(OUT, 'results.json')}")
    if failures:
        say(f"{failures} run(s) failed; see the errors above and bench/out/logs/")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
