#!/usr/bin/env python3
"""Grounding the planner's cost model: predicted against measured epoch time on this machine (issue 5).

For each graph, mode and worker count it writes one job file and
  - asks `physalia plan JOB --as-written --calibration CAL --output json` for the predicted epoch
    (training + evaluation every epoch + the fixed per-epoch cost),
  - runs `physalia submit JOB` for a few epochs and takes rank 0's `train_s + eval_s` per epoch from
    `metrics.jsonl`, drops the first epoch (warm-up) and keeps the median of the rest,
then prints a table with the error of each configuration, the median absolute error, and whether the
plan `physalia plan --set goal.objective=min_time` chooses is within 10% of the fastest measured one.

    python3 bench/grounding.py                       # 2 graphs x 3 modes x 1-4 workers = 24 configurations
    python3 bench/grounding.py --sizes 20000 --modes partition --workers 1,2   # a quick look

The calibration profile is measured once per invocation (`physalia calibrate`) unless --calibration names
one. Run it on a quiet machine: every worker process shares the same cores.
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time

from jobs import job_yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BIN = os.environ.get("PHYSALIA_BIN", os.path.join(ROOT, "target", "release", "physalia"))


def run(bin_, args, cwd=ROOT):
    out = subprocess.run([bin_] + args, cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"physalia {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def last_json(text):
    return json.loads(text.strip().splitlines()[-1])


def job_text(a, graph, mode, workers, out_dir, goal=False):
    text = job_yaml(f"grounding-{mode}-{workers}", graph, a, mode, workers, out_dir)
    if goal:
        text += f"goal:\n  objective: min_time\n  backends: [local]\n  max_workers: {max(a.workers)}\n"
    return text


def measure(bin_, job, cwd):
    """Median over epochs 2.. of rank 0's train_s + eval_s, every epoch's value, and rank 0's exchange:
    median bytes sent per epoch and seconds in exchanges (halo rows or fetches, P3 partials, all-reduces;
    waiting for slower peers included)."""
    s = last_json(run(bin_, ["submit", job, "--output", "json", "--quiet"], cwd))
    jd = s["job_dir"] if os.path.isabs(s["job_dir"]) else os.path.join(cwd, s["job_dir"])
    times, sent, exch = [], [], []
    with open(os.path.join(jd, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)["metrics"]
            times.append(m["train_s"] + m["eval_s"])
            x, b = m.get("exchange") or {}, m.get("batches") or {}
            sent.append(x.get("bytes_sent", 0))
            # data parallelism's fetches are counted in halo_s too; P3's partials only in fetch_s
            exch.append(x.get("all_reduce_s", 0) + max(x.get("halo_s", 0), b.get("fetch_s", 0)))
    return statistics.median(times[1:]), times, statistics.median(sent[1:]), statistics.median(exch[1:])


def label(key):
    """(mode, workers, replicas, cache rows) as `partition 2`, `hybrid-data 2x2`, `data 4 (cache 5000 rows)`."""
    mode, workers, replicas, cache = key
    text = f"hybrid-{mode} {workers // replicas}x{replicas}" if replicas > 1 else f"{mode} {workers}"
    return text + (f" (cache {cache} rows)" if cache else "")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=DEFAULT_BIN, help="the physalia binary (release build)")
    p.add_argument("--sizes", default="20000,100000", help="SBM node counts, one graph each")
    p.add_argument("--feat-dim", type=int, default=128)
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--kind", default="sage")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--modes", default="partition,data,model")
    p.add_argument("--workers", default="1,2,3,4")
    p.add_argument("--epochs", type=int, default=10, help="per run; the first is dropped")
    p.add_argument("--fanouts", default="25,10")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--calibration", default=None, help="an existing profile; default: measure one now")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--reuse", default=None,
                   help="take the measured times from an earlier --json file instead of running the jobs "
                        "(for working on the model; publish only a fresh run)")
    a = p.parse_args()
    a.workers = [int(w) for w in a.workers.split(",")]
    bin_ = os.path.abspath(a.bin)
    out_dir = os.path.join(ROOT, "bench", "out")
    os.makedirs(out_dir, exist_ok=True)
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"# note: load average {load:.2f} before starting; numbers may be noisy", file=sys.stderr)

    cal = a.calibration
    if cal is None:
        cal = os.path.join(out_dir, "grounding-calibration.json")
        run(bin_, ["calibrate", "-o", cal])
    cal = os.path.abspath(cal)
    with open(cal) as f:
        profile = json.load(f)

    reuse = {}
    if a.reuse:
        with open(a.reuse) as f:
            old = json.load(f)
        reuse = {(r["graph"], r["mode"], r["workers"], 1, 0):
                 (r["measured_s"], r["epochs_s"], r.get("sent_bytes", 0), r.get("exchange_s", 0)) for r in old["rows"]}
        reuse.update({(c["graph"],) + tuple(c["key"]): (c["chosen_measured_s"], [], 0, 0) for c in old["checks"]})
    rows, checks = [], []
    for nodes in [int(n) for n in a.sizes.split(",")]:
        graph = os.path.join(out_dir, f"sbm-{nodes}-f{a.feat_dim}-c{a.classes}.safetensors")
        if not os.path.exists(graph):
            run(bin_, ["data", "synth", "sbm", "--nodes", str(nodes), "--classes", str(a.classes),
                       "--feat-dim", str(a.feat_dim), "--seed", "0", "--out", graph])
        measured = {}
        with tempfile.TemporaryDirectory() as tmp:
            for mode in a.modes.split(","):
                for w in a.workers:
                    job = os.path.join(tmp, f"{mode}-{w}.yaml")
                    with open(job, "w") as f:
                        f.write(job_text(a, graph, mode, w, tmp))
                    pred = last_json(run(bin_, ["plan", job, "--as-written", "--calibration", cal,
                                                "--output", "json"], tmp))
                    t0 = time.time()
                    med, times, sent, exch_s = reuse.get((nodes, mode, w, 1, 0)) or measure(bin_, job, tmp)
                    predicted = pred["prediction"]["time"]["epoch_s"]
                    measured[(mode, w, 1, 0)] = med
                    row = {
                        "graph": nodes, "mode": mode, "workers": w,
                        "predicted_s": predicted, "measured_s": med,
                        "error": (predicted - med) / med,
                        "epochs_s": times, "breakdown": pred["prediction"]["time"],
                        "sent_bytes": sent, "exchange_s": exch_s,
                        "wall_s": time.time() - t0,
                    }
                    rows.append(row)
                    print(f"{nodes:>7} {mode:<9} {w}  predicted {predicted:.4f} s  measured {med:.4f} s  "
                          f"{100 * row['error']:+.1f}%", file=sys.stderr)
            # the planner's choice for the fastest plan on this machine
            job = os.path.join(tmp, "goal.yaml")
            with open(job, "w") as f:
                f.write(job_text(a, graph, "partition", 1, tmp, goal=True))
            plan = last_json(run(bin_, ["plan", job, "--calibration", cal, "--output", "json"], tmp))
            c = plan["chosen"]["candidate"]
            cache = c["cache_rows"] if c["mode"] == "data" else 0
            key = (c["mode"], c["workers"], c["replicas"], cache)
            if key not in measured:
                # a plan outside the grid (a hybrid, a data-parallel cache): measure it too
                with open(job, "w") as f:
                    text = job_text(a, graph, c["mode"], c["workers"], tmp)
                    if cache:
                        text += f"  cache_rows: {cache}\n"
                    if c["replicas"] > 1:
                        text = text.replace(f"parallelism: {c['mode']}",
                                            f"parallelism: {{{c['mode']}: {c['parts']}, replicas: {c['replicas']}}}")
                    f.write(text)
                measured[key] = (reuse.get((nodes,) + key) or measure(bin_, job, tmp))[0]
            best_key = min(measured, key=measured.get)
            chosen_s, best_s = measured[key], measured[best_key]
            checks.append({
                "graph": nodes, "chosen": label(key), "key": list(key), "chosen_predicted_s": plan["chosen"]["prediction"]["time"]["epoch_s"],
                "chosen_measured_s": chosen_s, "fastest": label(best_key), "fastest_s": best_s,
                "within": chosen_s <= 1.10 * best_s,
            })

    print(f"# {profile['machine']}; calibration: GEMM {profile['gemm_gflop_s']:.0f} GFLOP/s, SpMM "
          f"{profile['spmm_gb_s']:.1f} GB/s, stream {profile['stream_gb_s']:.1f} GB/s, sampler "
          f"{profile['sampler_edges_per_s'] / 1e6:.0f} M edges/s, loopback {profile['loopback_gbit_s']:.2f} Gbit/s "
          f"{profile['loopback_latency_us']:.0f} us, epoch {1e3 * profile['epoch_overhead_s']:.2f} ms")
    print(f"# SBM, {a.feat_dim} features, {a.classes} classes; {a.kind} 2 layers hidden {a.hidden}, dropout 0.5; "
          f"fan-outs {a.fanouts}, batch {a.batch}; evaluation every epoch; {a.epochs} epochs, first dropped, median")
    loop_mib_s = profile["loopback_gbit_s"] * 1e9 / 8 / 2**20
    print(f"# exchange: MiB rank 0 sent per epoch and MiB/s over its seconds in exchanges (waits included); "
          f"the model gives each of n workers {loop_mib_s:.0f} x min(1, {profile['threads']} / (2 n)) MiB/s")
    print("| graph | mode | workers | predicted s | measured s | error | sent MiB | achieved MiB/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        sent = r["sent_bytes"] / 2**20
        rate = f"{sent / r['exchange_s']:.0f}" if sent and r["exchange_s"] else "-"
        print(f"| SBM {r['graph'] // 1000}k | {r['mode']} | {r['workers']} | {r['predicted_s']:.4f} | "
              f"{r['measured_s']:.4f} | {100 * r['error']:+.1f}% | {f'{sent:.1f}' if sent else '-'} | {rate} |")
    errs = [abs(r["error"]) for r in rows]
    print(f"\nconfigurations: {len(rows)}; median absolute error: **{100 * statistics.median(errs):.1f}%** "
          f"(mean {100 * statistics.mean(errs):.1f}%, max {100 * max(errs):.1f}%)")
    print("\n| graph | min_time plan | its predicted s | its measured s | fastest measured | fastest s | within 10% |")
    print("|---|---|---:|---:|---|---:|---|")
    for c in checks:
        print(f"| SBM {c['graph'] // 1000}k | {c['chosen']} | {c['chosen_predicted_s']:.4f} | "
              f"{c['chosen_measured_s']:.4f} | {c['fastest']} | {c['fastest_s']:.4f} | "
              f"{'yes' if c['within'] else '**no**'} ({c['chosen_measured_s'] / c['fastest_s']:.2f}x) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"profile": profile, "rows": rows, "checks": checks}, f, indent=1)


if __name__ == "__main__":
    main()
