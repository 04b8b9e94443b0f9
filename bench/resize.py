#!/usr/bin/env python3
"""The pause at each resize, in place (issue 33) beside the checkpoint restart, on one graph and one policy.

Runs the same partition-parallel GraphSAGE job under the 1 -> 2 -> 4 -> 2 policy (after epochs 3, 6, 9) with
`resize: in_place` and `resize: restart`, alternating, `--reps` times each (a first unmeasured run computes the
METIS sets for 1, 2 and 4 parts, which both paths then reuse), and a fixed one-worker run for the losses.

The pause after epoch E is the time between the coordinator recording epoch E and the first epoch after it
starting: `end_s(E+1) - end_s(E)` (summary.json's `epoch_ends`) less epoch E+1's own time (the slowest rank's
`train_s` in metrics.jsonl, plus the epoch's evaluation). Between epochs that do not resize the same difference is the per-epoch
overhead (rank 0's checkpoint, the report, and in place the gate's round trip), printed as `between`.

Bytes per resize: in place, the rows that change owner (the coordinator's log line: their count and feature
bytes) and the part deltas the workers get (the rows each gains, with their in-neighbour lists, labels and
splits, plus the lost rows' ids and the new halo bookkeeping), with the ratio of the two, and apart from
them the input-halo rows the deltas carry (which the first epoch would otherwise fetch from peers); by restart, every
part file of the new count and the checkpoint each worker reads. An older coordinator's line (whole part
files read) is still parsed.

    python3 bench/resize.py --nodes 200000 --reps 2

`--backend docker`: the workers as containers of the local worker image on the job's Docker network (a
joiner is a container start; the restart path starts every container again).

`--prewarm`: the same resizes as doublings and a halving, with the policy's prewarm starting the next
launch's workers (restart) or the joiners (in place) one epoch ahead (`--prewarm-epochs 2`: two), so no
resize waits for a process start.

`--data-parallel`: the same with data parallelism (mini-batches); in place, the survivors keep their
processes, models and optimizers and the resized launch takes the stored set for the new count.
`--p3`: the same with model parallelism (P3: the first layer split by feature columns); in place, the
survivors keep their processes, models, optimizers and the dataset they read, and take the new count's
columns of it.

`--lose-worker`: no resize; three workers, and rank 1 (`--lose-ranks 1,2`: ranks 1 and 2, together) is
SIGKILLed: local processes kill themselves after
training epoch 5, before reporting it (the worker's test hook); with `--backend docker` its container is
`docker kill`ed once the job recorded epoch 4, wherever the job is then. In place the lost worker is replaced
alone (the others cancel the epoch and keep their processes and parts); by restart every worker starts again
from the checkpoint of the last recorded epoch. The pause is the longest gap between two epochs (it holds
the killed attempt, the coordinator's failure grace (0.25 s once a kill by a signal is seen, 1.5 s for
other evidence) and the recovery, both ways).
"""

import argparse, glob, json, os, re, statistics, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

POLICY = """min_workers: 1
max_workers: 4
cooldown_epochs: 0
resize: {resize}
rules:
  - name: two-at-3
    when: epoch == 3
    then: {{set_workers: 2}}
  - name: four-at-6
    when: epoch == 6
    then: {{set_workers: 4}}
  - name: two-at-9
    when: epoch == 9
    then: {{set_workers: 2}}
"""

JOB = """name: {name}
dataset: {{path: {graph}}}
model: {{kind: sage, layers: 2, hidden: {hidden}}}
train: {{epochs: 12, seed: 0, eval_every: 12}}
workers: {workers}
output: {{dir: {out}}}{parallelism}
backend: {backend}
"""


def run(binary, args, cwd, env=None):
    out = subprocess.run([binary] + args, cwd=cwd, capture_output=True, text=True,
                         env=None if env is None else {**os.environ, **env})
    if out.returncode != 0:
        sys.exit(f"physalia {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


PREWARMED = """min_workers: 1
max_workers: 4
cooldown_epochs: 0
resize: {resize}
prewarm:
  when: epoch == {first} || epoch == {second}
  rule: two-at-3
rules:
  - name: two-at-3
    when: epoch == 3
    then: {{multiply_workers: 2}}
  - name: four-at-6
    when: epoch == 6
    then: {{multiply_workers: 2}}
  - name: two-at-9
    when: epoch == 9
    then: {{multiply_workers: 0.5}}
"""


NEVER = """min_workers: 1
max_workers: 3
resize: {resize}
rules:
  - name: never
    when: epoch < 0
    then: stop
"""

BACKEND = "local"
PARALLELISM = ""


def submit(binary, tmp, name, graph, hidden, resize, policy_text=POLICY, workers=1, env=None):
    job = os.path.join(tmp, f"{name}.yaml")
    with open(job, "w") as f:
        f.write(JOB.format(name=name, graph=graph, hidden=hidden, out=os.path.join(tmp, "jobs"),
                           backend=BACKEND, workers=workers, parallelism=PARALLELISM))
        if resize:
            policy = os.path.join(tmp, f"{name}-policy.yaml")
            with open(policy, "w") as p:
                p.write(policy_text.format(resize=resize))
            f.write(f"scaling_file: {policy}\n")
    s = json.loads(run(binary, ["submit", job, "--output", "json", "--quiet"], tmp, env))
    d = s["job_dir"] if os.path.isabs(s["job_dir"]) else os.path.join(tmp, s["job_dir"])
    return s, d


def pauses(summary, job_dir):
    lines = [json.loads(l) for l in open(os.path.join(job_dir, "metrics.jsonl"))]
    own = {l["metrics"]["epoch"]: max(w["train_s"] for w in l["workers"]) + l["metrics"].get("eval_s", 0.0)
           for l in lines}
    ends = {e["epoch"]: e["end_s"] for e in summary["epoch_ends"]}
    gap = {e: ends[e + 1] - ends[e] - own[e + 1] for e in range(1, 12)}
    return gap, [l["metrics"]["loss"] for l in lines]


def moved(job_dir):
    """Per in-place resize: (rows that change owner, their feature bytes, what the workers got, how the
    partitioning was made)."""
    log = open(os.path.join(job_dir, "logs", "coordinator.log")).read()
    new = re.findall(r"(\d+) rows change owner \(([^)]*) of features\), partitioning ([^(]*)\(([\d.]+) s to make(?:: [^;]*)?[,;] "
                     r"([\d.]+) s in the pause\).*?\[bytes: deltas (\d+) rows (\d+) bookkeeping (\d+) "
                     r"moved_features (\d+)(?: halo_rows (\d+))?\]", log)
    if new:
        # the input-halo rows a delta carries are no rows that change owner: counted apart
        return [(m[0], m[1], f"deltas {(int(m[5]) - int(m[9] or 0)) / 2**20:.1f} MiB = "
                 f"{(int(m[5]) - int(m[9] or 0)) / max(int(m[8]), 1):.2f}x the moved "
                 f"rows' features (rows {int(m[6]) / 2**20:.1f} MiB, bookkeeping {int(m[7]) / 2**20:.2f} MiB), "
                 f"and {int(m[9] or 0) / 2**20:.1f} MiB of input-halo rows carried ahead",
                 f"{m[2].strip()}, {float(m[3]):.3f} s to make, {float(m[4]):.3f} s in the pause") for m in new]
    old = re.findall(r"(\d+) rows change owner \(([^)]*) of features\).*?\(([^)]*) in all\)", log)
    return [(m[0], m[1], f"part files read {m[2]}", "made in the pause") for m in old]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=200000)
    p.add_argument("--feat-dim", type=int, default=64)
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--prewarm", action="store_true", help="start the joiners (or the next launch) an epoch ahead")
    p.add_argument("--prewarm-epochs", type=int, default=1, choices=[1, 2],
                   help="with --prewarm: how many epochs ahead the joiners start")
    p.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "physalia"))
    p.add_argument("--backend", default="local", choices=["local", "docker"])
    p.add_argument("--lose-worker", action="store_true", help="no resize: rank 1 of 3 is killed after epoch 5")
    p.add_argument("--lose-ranks", default="1",
                   help="with --lose-worker on local processes: the ranks of the 3 killed together (e.g. 1,2)")
    p.add_argument("--data-parallel", action="store_true",
                   help="data parallelism (mini-batches of 1024 seeds, fan-outs 10, 10) instead of partition")
    p.add_argument("--p3", action="store_true",
                   help="model parallelism (P3, mini-batches as --data-parallel) instead of partition")
    p.add_argument("--keep", help="run the jobs in this folder and keep it (the workers' logs say where each "
                   "pause went), instead of a temporary one")
    a = p.parse_args()
    global BACKEND, PARALLELISM
    BACKEND = a.backend
    if a.data_parallel:
        PARALLELISM = "\nparallelism: data\nminibatch: {fanouts: [10, 10], batch_size: 1024}"
    if a.p3:
        PARALLELISM = "\nparallelism: model\nminibatch: {fanouts: [10, 10], batch_size: 1024}"
    a.bin = os.path.abspath(a.bin)
    out_dir = os.path.join(ROOT, "bench", "out")
    os.makedirs(out_dir, exist_ok=True)
    graph = os.path.join(out_dir, f"sbm-{a.nodes}-f{a.feat_dim}-c{a.classes}.safetensors")
    if not os.path.exists(graph):
        run(a.bin, ["data", "synth", "sbm", "--nodes", str(a.nodes), "--classes", str(a.classes),
                    "--feat-dim", str(a.feat_dim), "--seed", "0", "--out", graph], ROOT)
    if a.lose_worker:
        return lose_worker(a, graph)
    with jobs_folder(a.keep) as tmp:
        fixed, fixed_dir = submit(a.bin, tmp, "fixed", graph, a.hidden, None)
        _, want = pauses(fixed, fixed_dir)
        # computes and stores the METIS sets for 2 and 4 parts, which every run after reuses
        policy = PREWARMED.replace("{first}", str(3 - a.prewarm_epochs)).replace(
            "{second}", str(6 - a.prewarm_epochs)) if a.prewarm else POLICY
        submit(a.bin, tmp, "warm", graph, a.hidden, "restart", policy)
        rows = {"in_place": [], "restart": []}
        for rep in range(a.reps):
            for resize in ["restart", "in_place"]:
                s, d = submit(a.bin, tmp, f"{resize}-{rep}", graph, a.hidden, resize, policy)
                gap, losses = pauses(s, d)
                diff = max(abs(x - y) / abs(y) for x, y in zip(losses, want))
                between = statistics.median(gap[e] for e in gap if e not in (3, 6, 9))
                rows[resize].append(([gap[3], gap[6], gap[9]], between, diff, moved(d)))
                print(f"{resize} rep {rep}: pauses after 3/6/9 {gap[3]:.3f} / {gap[6]:.3f} / {gap[9]:.3f} s, "
                      f"between {between:.3f} s, max rel loss diff {diff:.1e}", flush=True)
                for m in moved(d):
                    print(f"  moved {m[0]} rows ({m[1]} of features); {m[2]}; partitioning {m[3]}")
        parts = os.path.splitext(graph)[0] + ".parts"
        parts = parts if os.path.isdir(parts) else None
        if parts:
            for k in (2, 4):
                files = glob.glob(os.path.join(parts, f"k{k}-seed0", "part*.safetensors"))
                print(f"restart to {k}: part files {sum(os.path.getsize(f) for f in files) / 2**20:.1f} MiB")
        for resize, r in rows.items():
            med = [statistics.median(x[0][i] for x in r) for i in range(3)]
            print(f"{resize}: median pauses {med[0]:.3f} / {med[1]:.3f} / {med[2]:.3f} s, "
                  f"between {statistics.median(x[1] for x in r):.3f} s")


def jobs_folder(keep):
    """A temporary folder for the jobs, or `keep` (made, and kept afterwards)."""
    import contextlib
    if keep is None:
        return tempfile.TemporaryDirectory()
    os.makedirs(keep, exist_ok=True)
    return contextlib.nullcontext(os.path.abspath(keep))


def kill_rank_1_container(tmp, name):
    """Waits for job `name` to record epoch 4, then `docker kill`s its rank 1's container."""
    import time
    deadline = time.time() + 600
    while time.time() < deadline:
        for d in glob.glob(os.path.join(tmp, "jobs", f"{name}-*")):
            m = os.path.join(d, "metrics.jsonl")
            if os.path.exists(m) and sum(1 for l in open(m) if l.endswith("\n")) >= 4:
                job_id = os.path.basename(d)
                subprocess.run(["docker", "kill", f"physalia-{job_id}-s0-1"], capture_output=True, check=True)
                return
        time.sleep(0.02)
    sys.exit(f"job {name} never recorded epoch 4")


def lose_worker(a, graph):
    import threading
    if a.lose_ranks != "1" and BACKEND == "docker":
        sys.exit("--lose-ranks: only rank 1 is killed on docker")
    kill = {"PHYSALIA_TEST_DIE_AT_EPOCH": "5", "PHYSALIA_TEST_DIE_RANK": a.lose_ranks}
    with jobs_folder(a.keep) as tmp:
        fixed, fixed_dir = submit(a.bin, tmp, "fixed", graph, a.hidden, None, workers=3)
        _, want = pauses(fixed, fixed_dir)
        rows = {"in_place": [], "restart": []}
        for rep in range(a.reps):
            for resize in ["restart", "in_place"]:
                name = f"{resize.replace('_', '-')}-{rep}"
                # the ranks listed die at once (the last to arrive kills them all)
                together = os.path.join(tmp, f"die-{name}")
                os.makedirs(together)
                kill["PHYSALIA_TEST_DIE_TOGETHER_DIR"] = together
                killer = None
                if BACKEND == "docker":
                    killer = threading.Thread(target=kill_rank_1_container, args=(tmp, name))
                    killer.start()
                s, d = submit(a.bin, tmp, name, graph, a.hidden, resize, NEVER, 3, kill)
                if killer:
                    killer.join()
                gap, losses = pauses(s, d)
                diff = max(abs(x - y) / abs(y) for x, y in zip(losses, want))
                at = max(gap, key=gap.get)
                between = statistics.median(gap[e] for e in gap if e != at)
                log = open(os.path.join(d, "logs", "coordinator.log")).read()
                how = "replaced alone" if "in-place replacement ready" in log else "every worker restarted"
                rows[resize].append(gap[at])
                print(f"{resize} rep {rep}: pause after epoch {at} {gap[at]:.3f} s ({how}), between {between:.3f} s, "
                      f"max rel loss diff {diff:.1e}", flush=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        print(f"median pause: restart {med['restart']:.3f} s, in place {med['in_place']:.3f} s "
              f"({med['in_place'] / med['restart']:.2f}x)")


if __name__ == "__main__":
    main()
