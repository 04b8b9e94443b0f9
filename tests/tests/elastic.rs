//! Elastic epochs through `physalia submit`: a scaling policy resizes the worker set between epochs (in
//! place for partition parallelism: the survivors keep their processes and training state; from the last
//! checkpoint otherwise, or when the policy says `resize: restart`, or when an in-place resize fails), and
//! a worker killed with SIGKILL is replaced by retrying its epoch from the checkpoint (alone, the others
//! keeping their processes, when the job resizes in place).
//! Exact partition parallelism, and mini-batch training whose batch is global (data parallelism, P3), make
//! both invisible in the loss curve: it equals a fixed-size run's.

use std::path::Path;

use physalia_tests::{metrics, read_json, write_job};
use serde_json::Value;
use tempfile::TempDir;

const JOB: &str = "\
name: el
dataset:
  synth: {kind: sbm, nodes: 3000, classes: 4, feat_dim: 16, avg_degree: 10, homophily: 0.8, seed: 1}
model: {kind: gcn, layers: 2, hidden: 16}
train: {epochs: 12, seed: 0}
output: {dir: jobs}
";

/// 1 -> 2 -> 4 -> 2 workers after epochs 3, 6 and 9.
const STEPS: &str = "\
min_workers: 1
max_workers: 4
cooldown_epochs: 0
rules:
  - name: two-at-3
    when: epoch == 3
    then: {set_workers: 2}
  - name: four-at-6
    when: epoch == 6
    then: {set_workers: 4}
  - name: two-at-9
    when: epoch == 9
    then: {set_workers: 2}
";

fn submit(cwd: &Path, job: &str, env: &[(&str, &str)]) -> Value {
    let mut cmd = std::process::Command::new(physalia_tests::physalia_bin());
    cmd.current_dir(cwd)
        .args(["submit", job, "-q", "--output", "json"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "submit {job} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn losses(dir: &Path) -> Vec<(u64, f64, usize)> {
    metrics(dir)
        .iter()
        .map(|m| {
            (
                m["metrics"]["epoch"].as_u64().unwrap(),
                m["metrics"]["loss"].as_f64().unwrap(),
                m["workers"].as_array().map_or(1, Vec::len),
            )
        })
        .collect()
}

fn assert_same_curve(got: &[(u64, f64, usize)], want: &[(u64, f64, usize)]) {
    let epochs: Vec<u64> = got.iter().map(|e| e.0).collect();
    assert_eq!(
        epochs,
        (1..=12).collect::<Vec<_>>(),
        "every epoch exactly once"
    );
    for ((e, a, _), (_, b, _)) in got.iter().zip(want) {
        assert!(
            (a - b).abs() <= 1e-3 * b.abs(),
            "epoch {e}: {a} vs fixed {b}"
        );
    }
}

/// A survivor whose memory would not hold the part its next delta makes beside the one it trains on
/// (the test hook's headroom of one byte) only fetches the delta ahead and applies it in the pause: the
/// job resizes in place all the same, with the fixed run's curve.
#[test]
fn a_survivor_short_of_memory_applies_its_delta_in_the_pause() {
    let tmp = TempDir::new().unwrap();
    let t = tmp.path();
    write_job(t, "fixed.yaml", JOB);
    write_job(t, "policy.yaml", STEPS);
    write_job(t, "job.yaml", &format!("{JOB}scaling_file: policy.yaml\n"));
    let fixed = submit(t, "fixed.yaml", &[]);
    let elastic = submit(t, "job.yaml", &[("PHYSALIA_TEST_MEMORY_HEADROOM", "1")]);
    let want = losses(&t.join(fixed["job_dir"].as_str().unwrap()));
    let dir = t.join(elastic["job_dir"].as_str().unwrap());
    assert_same_curve(&losses(&dir), &want);
    physalia_tests::assert_resized_in_place(&dir, &[(1, 2, 3), (2, 4, 6), (4, 2, 9)]);
    let rank0 = std::fs::read_to_string(dir.join("logs/worker-0.log")).unwrap();
    // every delta rank 0 was offered ahead was left for the pause, where it was applied
    let skipped = rank0
        .matches("fetching its next delta ahead, applying it in the pause: the part it makes would need about")
        .count();
    assert!(skipped > 0, "{rank0}");
    assert!(!rank0.contains("made from its delta ahead"), "{rank0}");
    assert!(!rank0.contains("beside training, in"), "{rank0}");
    assert_eq!(rank0.matches("rows held and a delta").count(), 3, "{rank0}");
}

#[test]
fn rescaling_1_2_4_2_keeps_the_fixed_runs_loss_curve() {
    let (_tmp, dir) = rescale_like_fixed(JOB);
    // partition parallelism resizes in place: rank 0 is one process from the first epoch to the last,
    // and every rank that survives a resize goes on from the state it holds, not from the checkpoint
    physalia_tests::assert_resized_in_place(&dir, &[(1, 2, 3), (2, 4, 6), (4, 2, 9)]);
    let log = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    let rank0 = std::fs::read_to_string(dir.join("logs/worker-0.log")).unwrap();
    // the shrink moved only the leavers' rows: ranks 0 and 1 kept theirs
    assert!(log.contains("4 -> 2 workers, "), "{log}");
    // the leavers' backend launch (ranks 2 and 3, started together at the growth) is stopped after the
    // shrink and its control endpoint closed: in cluster mode its port is free for the next joiners
    assert_eq!(
        log.matches("stopped, every worker of it left or replaced (control endpoint closed)")
            .count(),
        1,
        "{log}"
    );
    // each new partitioning was cut while the launch before it trained, not in the pause
    assert_eq!(
        log.matches("partitioning prepared while the job trained")
            .count(),
        3,
        "{log}"
    );
    // the survivors keep the rows they hold and get only a delta, applied in the pause or, sent ahead,
    // beside training: growing from one worker, rank 0 gains nothing and gives up the joiner's rows
    let rebuilt: Vec<&str> = rank0
        .lines()
        .filter(|l| l.contains("rows held and a delta") || l.contains("made from its delta ahead"))
        .collect();
    assert_eq!(rebuilt.len(), 3, "{rank0}");
    // each setup line says how much of it the engine spent before the first epoch
    assert_eq!(
        rank0.matches("s in the engine before it").count(),
        4,
        "{rank0}"
    );
    assert!(
        (rebuilt[0].contains("part 0 of 2 from the 3000 rows held")
            && rebuilt[0].contains("(0 rows gained"))
            || rebuilt[0].contains("part 0 of 2 (1500 rows) made from its delta ahead"),
        "{rank0}"
    );
    // a delta offered ahead was applied beside training and trained on, and the rows of the new input
    // halo the survivor held were gathered beside training too
    physalia_tests::assert_deltas_taken_ahead(&dir);
    // (how many parts a worker's log says were made from a delta ahead, and how many seeds gathered
    // ahead: the same, a joiner's too)
    let ahead = |log: &str| {
        let gathered = log
            .lines()
            .filter_map(|l| l.split_once(" of them ahead)")?.0.rsplit(", ").next())
            .filter(|n| n.parse::<usize>().is_ok_and(|n| n > 0))
            .count();
        (log.matches("made from its delta ahead").count(), gathered)
    };
    let (made_ahead, gathered_ahead) = ahead(&rank0);
    assert_eq!(gathered_ahead, made_ahead, "{rank0}");
    // each survivor seeds its new input halo with the rows it holds (its old part's features and its
    // old model's halo rows) and the rows its delta carries: a survivor of a growth holds every row and
    // is carried none, the shrink's survivor is carried the leavers' rows of its halo, and a joiner is
    // carried its whole halo; none fetches a row of it in the pause
    let seeded = |log: &str| -> Vec<(usize, usize, usize)> {
        log.lines()
            .filter_map(|l| {
                let rest = l.split("holds ").nth(1)?;
                let (held, rest) = rest.split_once(" of the ")?;
                let (all, rest) = rest.split_once(" rows of its input halo (")?;
                let (carried, _) = rest.split_once(" carried by its delta")?;
                Some((held.parse().ok()?, all.parse().ok()?, carried.parse().ok()?))
            })
            .collect()
    };
    let survivor = seeded(&rank0);
    assert_eq!(survivor.len(), 3, "{rank0}");
    assert!(
        survivor
            .iter()
            .all(|&(held, all, _)| held == all && all > 0),
        "{survivor:?}"
    );
    assert!(
        survivor[0].2 == 0 && survivor[1].2 == 0 && survivor[2].2 > 0,
        "{survivor:?}"
    );
    // rank 1 joined at 1 -> 2 (its whole halo carried), then survived the growth and the shrink
    // (its log is named by the launch that started it)
    let rank1: String = std::fs::read_dir(dir.join("logs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("worker-1."))
        })
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    let joiner = seeded(&rank1);
    assert!(
        !joiner.is_empty() && joiner.iter().all(|&(held, all, _)| held == all && all > 0),
        "{rank1}"
    );
    assert_eq!(
        joiner[0].2, joiner[0].1,
        "the joiner's whole halo carried: {rank1}"
    );
    let (made_ahead, gathered_ahead) = ahead(&rank1);
    assert_eq!(gathered_ahead, made_ahead, "{rank1}");
    let summary = read_json(&dir.join("summary.json"));
    // the ledger: each resize made a launch that continues the one before it, billed from the moment it
    // was ready; the launch it continued, through the pause
    let spans = summary["launches"].as_array().unwrap();
    let resized: Vec<&Value> = spans.iter().filter(|s| s["in_place"] == true).collect();
    assert_eq!(resized.len(), 3, "{spans:?}");
    for r in &resized {
        let start = r["start_s"].as_f64().unwrap();
        assert!(
            spans.iter().any(|s| s["stop_s"].as_f64() == Some(start)),
            "no launch billed up to the resized one's start: {spans:?}"
        );
    }
    // the record keeps every partitioning the job trained on: the launch's one part, then the two
    // in-place ones with their quality (the shrink back to 2 reuses the record of 2)
    let parts = summary["partitions"]
        .as_array()
        .expect("partitions recorded");
    let counts: Vec<u64> = parts.iter().map(|p| p["parts"].as_u64().unwrap()).collect();
    assert_eq!(counts, [1, 2, 4], "{parts:?}");
    for p in &parts[1..] {
        assert!(
            p["method"].as_str().unwrap().starts_with("in-place ("),
            "{p}"
        );
        let cut = p["cut_fraction"].as_f64().unwrap();
        assert!(cut > 0.0 && cut < 1.0, "{p}");
        assert!(p["edge_cut"].as_u64().unwrap() > 0, "{p}");
        assert!(p["why"].as_str().unwrap().contains("rows moved"), "{p}");
    }
}

#[test]
fn rescaling_by_restarts_keeps_the_fixed_runs_loss_curve() {
    // the path every mode took before in-place resizes, and the fallback: all workers stop, the new
    // count starts from the checkpoint
    let (_tmp, dir) = rescale_with(JOB, &format!("{STEPS}resize: restart\n"));
    assert!(
        dir.join("logs/worker-3.seg2.log").is_file(),
        "the 4-worker launch logged"
    );
    let log = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    assert!(!log.contains("in place"), "{log}");
}

#[test]
fn a_resize_that_fails_part_way_restarts_from_the_checkpoint() {
    // rank 0 is SIGKILLed as each in-place resize begins: the job restarts every worker from the
    // checkpoint of the epoch before, as a restart would have, and the curve is the fixed run's
    let t = TempDir::new().unwrap();
    write_job(t.path(), "fixed.yaml", JOB);
    write_job(t.path(), "policy.yaml", STEPS);
    write_job(
        t.path(),
        "job.yaml",
        &format!("{JOB}scaling_file: policy.yaml\n"),
    );
    let fixed = submit(t.path(), "fixed.yaml", &[]);
    let v = submit(t.path(), "job.yaml", &[("PHYSALIA_TEST_FAIL_RESIZE", "0")]);
    let want = losses(&t.path().join(fixed["job_dir"].as_str().unwrap()));
    let dir = t.path().join(v["job_dir"].as_str().unwrap());
    let got = losses(&dir);
    assert_same_curve(&got, &want);
    let workers: Vec<usize> = got.iter().map(|e| e.2).collect();
    assert_eq!(workers, [1, 1, 1, 2, 2, 2, 4, 4, 4, 2, 2, 2]);
    let events: Vec<String> = v["scaling_events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event"].as_str().unwrap().to_string())
        .collect();
    for (to, epoch) in [(2, 3), (4, 6), (2, 9)] {
        let line = format!("resizing in place to {to} workers failed (worker 0 ");
        let restart = format!("restarting from the checkpoint of epoch {epoch}");
        assert!(
            events
                .iter()
                .any(|e| e.starts_with(&line) && e.ends_with(&restart)),
            "{events:?}"
        );
    }
    let log = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    assert_eq!(log.matches("in-place resize failed").count(), 3, "{log}");
    assert_eq!(read_json(&dir.join("status.json"))["state"], "succeeded");
}

#[test]
fn rescaling_cora_1_2_4_2_keeps_the_fixed_runs_loss_curve() {
    let Some(cora) = physalia_tests::cora_dir() else {
        eprintln!("skipping: Cora not found");
        return;
    };
    let job = format!(
        "name: el\ndataset:\n  path: {}\n  row_normalize: true\nmodel: {{kind: gcn, layers: 2, hidden: 16}}\ntrain: {{epochs: 12, seed: 0}}\noutput: {{dir: jobs}}\n",
        cora.display()
    );
    rescale_like_fixed(&job);
}

/// Mini-batch training learns the same on any worker count (the batch is global, a seed's sample does not
/// depend on who draws it), and every worker ends an epoch with the whole model and optimizer state: data
/// parallelism and P3 resize in place like partition parallelism.
const MINIBATCH: &str = "minibatch: {fanouts: [5, 5], batch_size: 256}\n";

#[test]
fn data_parallel_rescaling_1_2_4_2_keeps_the_fixed_runs_loss_curve() {
    let (_tmp, dir) = rescale_like_fixed(&format!("{JOB}parallelism: data\n{MINIBATCH}"));
    // data parallelism resizes in place too (issue 33): rank 0 is one process throughout and goes on
    // from the model and optimizer it holds; the resized launches take the stored sets, no rows move
    physalia_tests::assert_resized_in_place(&dir, &[(1, 2, 3), (2, 4, 6), (4, 2, 9)]);
    let log = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    assert_eq!(
        log.matches("data-parallel workers, the partition set for")
            .count(),
        3,
        "{log}"
    );
}

/// Writes `job` as `fixed.yaml`, and as `job.yaml` with a policy that never fires (up to `max_workers`):
/// it only makes the job elastic, so that it resizes in place and replaces lost workers alone.
fn write_fixed_and_elastic(dir: &std::path::Path, job: &str, max_workers: usize) {
    write_job(dir, "fixed.yaml", job);
    write_job(
        dir,
        "job.yaml",
        &format!(
            "{job}scaling:\n  min_workers: 1\n  max_workers: {max_workers}\n  rules:\n    - name: never\n      \
             when: epoch < 0\n      then: stop\n"
        ),
    );
}

/// Runs `job` fixed and, made elastic by `write_fixed_and_elastic` (up to `max_workers`), under the test
/// hooks `env`; checks that the elastic run's curve is the fixed run's and returns the elastic run's
/// directory and its scaling events as text.
fn fixed_and_elastic_with(
    t: &Path,
    job: &str,
    max_workers: usize,
    env: &[(&str, &str)],
) -> (std::path::PathBuf, String) {
    write_fixed_and_elastic(t, job, max_workers);
    let fixed = submit(t, "fixed.yaml", &[]);
    let v = submit(t, "job.yaml", env);
    let want = losses(&t.join(fixed["job_dir"].as_str().unwrap()));
    let dir = t.join(v["job_dir"].as_str().unwrap());
    assert_same_curve(&losses(&dir), &want);
    (dir, v["scaling_events"].to_string())
}

/// Two workers of three killed together (a spot reclaim of two containers): both are replaced in one
/// launch of joiners, rank 0 keeps its process and part, and the curve is the fixed run's.
#[test]
fn two_workers_killed_together_are_replaced_and_the_third_keeps_its_process() {
    killed_together_are_replaced(
        "1,2",
        "replacing workers 1-2, the other 1 keep their processes",
        0,
    );
}

/// Ranks 0 and 2 of three killed together: one launch of joiners takes both ranks (not consecutive), and
/// rank 1 between them keeps its process and part (it was stopped with them, and every worker relaunched
/// when the lost ranks spanned the launch).
#[test]
fn workers_killed_apart_are_replaced_together_and_the_one_between_keeps_its_process() {
    killed_together_are_replaced(
        "0,2",
        "replacing workers 0, 2, the other 1 keep their processes",
        1,
    );
}

/// Kills `ranks` (of three) together after epoch 5: they are replaced (the scaling event says
/// `replacing`), rank `survivor` keeps its process and part, the curve is the fixed run's.
fn killed_together_are_replaced(ranks: &str, replacing: &str, survivor: usize) {
    let t = TempDir::new().unwrap();
    let three = JOB.replace("output:", "workers: 3\noutput:");
    // the two die at once, whatever the load on the machine
    let together = t.path().join("die-together");
    std::fs::create_dir(&together).unwrap();
    let (dir, events) = fixed_and_elastic_with(
        t.path(),
        &three,
        3,
        &[
            ("PHYSALIA_TEST_DIE_AT_EPOCH", "5"),
            ("PHYSALIA_TEST_DIE_RANK", ranks),
            ("PHYSALIA_TEST_DIE_TOGETHER_DIR", together.to_str().unwrap()),
        ],
    );
    let killed: Vec<usize> = ranks.split(',').map(|r| r.parse().unwrap()).collect();
    assert!(
        events.contains(replacing)
            && events.contains("retrying epoch 5")
            && killed
                .iter()
                .all(|r| events.contains(&format!("worker {r} (pid"))),
        "{events}"
    );
    let log = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    assert!(log.contains("in-place replacement ready"), "{log}");
    assert_eq!(
        log.matches(&format!("worker {survivor} (pid")).count(),
        1,
        "{log}"
    );
    let want = [0, 1, 2].map(|r| if r == survivor { 1 } else { 2 });
    assert_eq!(
        [0, 1, 2].map(|r| worker_outputs(&dir, r).len()),
        want,
        "rank {survivor} ran as one process, ranks {ranks} twice"
    );
    let kept = std::fs::read_to_string(dir.join(format!("logs/worker-{survivor}.log"))).unwrap();
    assert!(
        kept.contains(&format!("keeps part {survivor} of 3")),
        "{kept}"
    );
}

/// The output files of rank `rank`'s processes in `dir`'s logs, by name.
fn worker_outputs(dir: &Path, rank: usize) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.join("logs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("worker-{rank}.")))
        .collect();
    names.sort();
    names
}

/// A worker killed while the first mesh forms (assigned, not yet joined) leaves its peers joining a mesh
/// that cannot complete: the coordinator aborts their joins and replaces it alone; the survivors, which
/// hold no part yet, are served theirs, and the curve is the fixed run's.
#[test]
fn a_worker_lost_while_the_first_mesh_forms_is_replaced_alone() {
    let t = TempDir::new().unwrap();
    let three = JOB.replace("output:", "workers: 3\noutput:");
    let (dir, events) = fixed_and_elastic_with(
        t.path(),
        &three,
        3,
        &[
            ("PHYSALIA_TEST_DIE_AT_JOIN", "0"),
            ("PHYSALIA_TEST_DIE_RANK", "1"),
        ],
    );
    assert!(
        events.contains("replacing worker 1 alone") && events.contains("signal 9"),
        "{events}"
    );
    let log = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    assert!(log.contains("in-place replacement ready"), "{log}");
    assert!(
        log.contains("workers 0, 2 held no part (the mesh was aborted as it formed): served the stored set's parts"),
        "{log}"
    );
    assert_eq!(
        [0, 1, 2].map(|r| worker_outputs(&dir, r).len()),
        [1, 2, 1],
        "ranks 0 and 2 ran as one process each, rank 1 twice"
    );
    for rank in [0, 2] {
        let out =
            std::fs::read_to_string(dir.join("logs").join(&worker_outputs(&dir, rank)[0])).unwrap();
        assert!(
            out.contains("joining the mesh was cancelled (a peer was lost)"),
            "rank {rank}: {out}"
        );
    }
}

/// A worker killed as the mesh of an in-place resize forms (2 -> 3 after epoch 3; rank 1 dies at its
/// second join): it is replaced alone; rank 0 keeps its process and its model, optimizer and progress
/// (not the rows it held: its delta was never applied, so it is served a whole part, as the joiner that
/// had not loaded its own is), and the curve is the fixed run's.
#[test]
fn a_worker_lost_while_a_resized_mesh_forms_is_replaced_and_the_survivors_keep_their_state() {
    let t = TempDir::new().unwrap();
    let two = JOB.replace("output:", "workers: 2\noutput:");
    write_job(t.path(), "fixed.yaml", &two);
    write_job(
        t.path(),
        "job.yaml",
        &format!(
            "{two}scaling:\n  min_workers: 1\n  max_workers: 3\n  cooldown_epochs: 0\n  rules:\n    - name: \
             three-at-3\n      when: epoch == 3\n      then: {{set_workers: 3}}\n"
        ),
    );
    let fixed = submit(t.path(), "fixed.yaml", &[]);
    let v = submit(
        t.path(),
        "job.yaml",
        &[
            ("PHYSALIA_TEST_DIE_AT_JOIN", "1"),
            ("PHYSALIA_TEST_DIE_RANK", "1"),
        ],
    );
    let want = losses(&t.path().join(fixed["job_dir"].as_str().unwrap()));
    let dir = t.path().join(v["job_dir"].as_str().unwrap());
    assert_same_curve(&losses(&dir), &want);
    let events = v["scaling_events"].to_string();
    assert!(
        events.contains("replacing worker 1 alone") && events.contains("signal 9"),
        "{events}"
    );
    let log = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    assert!(
        log.contains("workers 0, 2 held no part (the mesh was aborted as it formed): served parts cut from the dataset"),
        "{log}"
    );
    assert_eq!(
        [0, 1, 2].map(|r| worker_outputs(&dir, r).len()),
        [1, 2, 1],
        "ranks 0 and 2 ran as one process each, rank 1 twice"
    );
    let rank0 =
        std::fs::read_to_string(dir.join("logs").join(&worker_outputs(&dir, 0)[0])).unwrap();
    assert!(
        rank0.contains("joining the mesh was cancelled (a peer was lost)")
            && rank0.contains(
                "continuing in place after epoch 3 (model, optimizer and progress held in memory)"
            ),
        "{rank0}"
    );
}

#[test]
fn a_data_parallel_worker_killed_is_replaced_alone() {
    mini_batch_worker_killed_is_replaced_alone("data");
}

#[test]
fn a_p3_worker_killed_is_replaced_alone() {
    mini_batch_worker_killed_is_replaced_alone("model");
}

fn mini_batch_worker_killed_is_replaced_alone(mode: &str) {
    let t = TempDir::new().unwrap();
    let two = format!(
        "{}parallelism: {mode}\n{MINIBATCH}",
        JOB.replace("output:", "workers: 2\noutput:")
    );
    let (dir, events) = fixed_and_elastic_with(
        t.path(),
        &two,
        2,
        &[
            ("PHYSALIA_TEST_DIE_AT_EPOCH", "5"),
            ("PHYSALIA_TEST_DIE_RANK", "1"),
        ],
    );
    assert!(
        events.contains("replacing worker 1 alone") && events.contains("retrying epoch 5"),
        "{events}"
    );
    // rank 0 ran as one process and paused (at its gate after epoch 5, or inside that epoch when the
    // killed worker's last frames died with it), then read the checkpoint of epoch 4 (the last recorded)
    let log = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    assert!(log.contains("in-place replacement ready"), "{log}");
    assert_eq!(log.matches("worker 0 (pid").count(), 1, "{log}");
    // the survivor holds what it trains on (a data-parallel part; P3 reads the whole dataset and is
    // served no part): nothing is served to it again
    assert!(!log.contains("held no part"), "{log}");
    let rank0 = std::fs::read_to_string(dir.join("logs/worker-0.log")).unwrap();
    assert!(
        rank0.contains("paused after epoch 5 keeping its state")
            || rank0.contains("paused with the epoch in flight cancelled"),
        "{rank0}"
    );
}

#[test]
fn p3_rescaling_1_2_4_2_keeps_the_fixed_runs_loss_curve() {
    let (_tmp, dir) = rescale_like_fixed(&format!("{JOB}parallelism: model\n{MINIBATCH}"));
    // P3 resizes in place too: every rank ends an epoch holding the whole model and optimizer (the
    // first layer gathered), so rank 0 is one process throughout and takes the new count's columns
    physalia_tests::assert_resized_in_place(&dir, &[(1, 2, 3), (2, 4, 6), (4, 2, 9)]);
    let log = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    assert_eq!(
        log.matches("model-parallel (P3) workers, each reading the whole dataset")
            .count(),
        3,
        "{log}"
    );
    // P3 splits features, not the graph: no launch or resize partitions it
    let summary = read_json(&dir.join("summary.json"));
    assert!(summary.get("partitions").is_none(), "{summary}");
    let rank0 = std::fs::read_to_string(dir.join("logs/worker-0.log")).unwrap();
    assert!(
        rank0.contains("continuing in place after epoch 6 (model, optimizer and progress held in memory), on feature columns 0..4 of 16"),
        "{rank0}"
    );
}

/// Runs `job` fixed and under the 1 -> 2 -> 4 -> 2 policy, checks the policy run against the fixed one,
/// and returns the policy run's directory (kept for the caller's checks).
fn rescale_like_fixed(job: &str) -> (TempDir, std::path::PathBuf) {
    rescale_with(job, STEPS)
}

fn rescale_with(job: &str, policy: &str) -> (TempDir, std::path::PathBuf) {
    let tmp = TempDir::new().unwrap();
    let t = tmp.path().to_path_buf();
    write_job(&t, "fixed.yaml", job);
    write_job(&t, "policy.yaml", policy);
    write_job(&t, "job.yaml", &format!("{job}scaling_file: policy.yaml\n"));
    let fixed = submit(&t, "fixed.yaml", &[]);
    let elastic = submit(&t, "job.yaml", &[]);
    let want = losses(&t.join(fixed["job_dir"].as_str().unwrap()));
    let dir = t.join(elastic["job_dir"].as_str().unwrap());
    let got = losses(&dir);
    assert_same_curve(&got, &want);
    let workers: Vec<usize> = got.iter().map(|e| e.2).collect();
    assert_eq!(workers, [1, 1, 1, 2, 2, 2, 4, 4, 4, 2, 2, 2]);
    assert_eq!(
        elastic["workers"], 2,
        "the summary names the workers the job ended on"
    );
    let events = elastic["scaling_events"].as_array().unwrap();
    let rules: Vec<&str> = events.iter().filter_map(|e| e["rule"].as_str()).collect();
    assert_eq!(rules, ["two-at-3", "four-at-6", "two-at-9"]);
    let final_acc = elastic["runs"][0]["final_test_acc"].as_f64().unwrap();
    let fixed_acc = fixed["runs"][0]["final_test_acc"].as_f64().unwrap();
    assert!(
        (final_acc - fixed_acc).abs() <= 0.005,
        "{final_acc} vs {fixed_acc}"
    );
    assert_eq!(read_json(&dir.join("status.json"))["state"], "succeeded");
    assert!(dir.join("model.safetensors").is_file());
    // cost is accounted per epoch and in total (the local backend's catalog price is 0)
    assert_eq!(elastic["usd_total"].as_f64(), Some(0.0));
    // the bill's worker-seconds cover at least every worker's training time
    let trained: f64 = metrics(&dir)
        .iter()
        .flat_map(|m| m["workers"].as_array().unwrap().clone())
        .map(|w| w["train_s"].as_f64().unwrap())
        .sum();
    let billed = elastic["worker_seconds"].as_f64().unwrap();
    assert!(billed >= trained && billed > 0.0, "{billed} < {trained}");
    assert!(metrics(&dir).iter().all(|m| m["usd"].as_f64() == Some(0.0)));
    (tmp, dir)
}

#[test]
fn a_worker_killed_mid_training_is_replaced_and_its_epoch_retried() {
    let t = TempDir::new().unwrap();
    let two = JOB.replace("output:", "workers: 2\noutput:");
    write_job(t.path(), "fixed.yaml", &two);
    // a policy that never fires: it only makes the job elastic
    write_job(
        t.path(),
        "policy.yaml",
        "min_workers: 1\nmax_workers: 2\nrules:\n  - name: never\n    when: epoch < 0\n    then: stop\n",
    );
    write_job(
        t.path(),
        "job.yaml",
        &format!("{two}scaling_file: policy.yaml\n"),
    );
    let fixed = submit(t.path(), "fixed.yaml", &[]);
    let v = submit(
        t.path(),
        "job.yaml",
        &[
            ("PHYSALIA_TEST_DIE_AT_EPOCH", "5"),
            ("PHYSALIA_TEST_DIE_RANK", "1"),
        ],
    );
    let want = losses(&t.path().join(fixed["job_dir"].as_str().unwrap()));
    let dir = t.path().join(v["job_dir"].as_str().unwrap());
    assert_same_curve(&losses(&dir), &want);
    let events = v["scaling_events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{events:?}");
    let what = events[0]["event"].as_str().unwrap();
    assert!(
        what.contains("lost a worker")
            && what.contains("signal 9")
            && what.contains("retrying epoch 5"),
        "{what}"
    );
    assert_eq!(events[0]["epoch"], 4);
    let log = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    assert!(log.contains("segment 1"), "{log}");
    // the job resizes in place, so the lost worker is replaced alone (issue 33): rank 0 keeps its
    // process and its part, one process of it ran (one output file), and it read the checkpoint of
    // epoch 4 (it had trained epoch 5, which the job did not record)
    assert!(
        what.contains("replacing worker 1 alone"),
        "the survivor was not kept: {what}"
    );
    assert!(log.contains("in-place replacement ready"), "{log}");
    let zero = worker_outputs(&dir, 0);
    assert_eq!(zero.len(), 1, "rank 0 ran as one process: {zero:?}");
    assert_eq!(
        worker_outputs(&dir, 1).len(),
        2,
        "rank 1 and its replacement"
    );
    // it paused at its gate after epoch 5, or inside that epoch when the killed worker's last frames
    // died with it
    let survivor = std::fs::read_to_string(dir.join("logs").join(&zero[0])).unwrap();
    assert!(
        (survivor.contains("paused after epoch 5 keeping its state")
            || survivor.contains("paused with the epoch in flight cancelled"))
            && survivor.contains("keeps part 0 of 2"),
        "{survivor}"
    );
    // the kill is visible in the report
    let out = std::process::Command::new(physalia_tests::physalia_bin())
        .args(["report", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let html = std::fs::read_to_string(dir.join("report.html")).unwrap();
    assert!(
        html.contains("lost a worker") && html.contains("signal 9"),
        "the kill is not in the report"
    );
    // the report gained a sixth plot (each epoch's time split into compute, halo, all-reduce, sampling,
    // evaluation) and the planner's prediction per worker count (one count here)
    assert_eq!(html.matches("<svg").count(), 6, "six plots");
    assert_eq!(
        html.matches("<tr><td>").count(),
        12 + 1 + 1 + 1,
        "12 epoch rows, one event row, one prediction row and one partition set's row"
    );
}

#[test]
fn a_plain_three_worker_job_survives_a_sigkilled_worker() {
    plain_job_survives_a_sigkilled_worker(3);
}

#[test]
fn a_one_worker_job_survives_its_worker_sigkilled() {
    plain_job_survives_a_sigkilled_worker(1);
}

fn plain_job_survives_a_sigkilled_worker(workers: usize) {
    // no scaling policy: every job the coordinator runs retries a lost worker's epoch from the last
    // checkpoint
    let t = TempDir::new().unwrap();
    let job = JOB.replace("output:", &format!("workers: {workers}\noutput:"));
    write_job(t.path(), "job.yaml", &job);
    let fixed = submit(t.path(), "job.yaml", &[]);
    let last = (workers - 1).to_string();
    let v = submit(
        t.path(),
        "job.yaml",
        &[
            ("PHYSALIA_TEST_DIE_AT_EPOCH", "5"),
            ("PHYSALIA_TEST_DIE_RANK", &last),
        ],
    );
    let want = losses(&t.path().join(fixed["job_dir"].as_str().unwrap()));
    let dir = t.path().join(v["job_dir"].as_str().unwrap());
    let got = losses(&dir);
    assert_same_curve(&got, &want);
    assert!(got.iter().all(|e| e.2 == workers), "{got:?}");
    let events = v["scaling_events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{events:?}");
    let what = events[0]["event"].as_str().unwrap();
    assert!(
        what.contains("signal 9")
            && what.contains(&format!("retrying epoch 5 on {workers} workers")),
        "{what}"
    );
    assert_eq!(read_json(&dir.join("status.json"))["state"], "succeeded");
    assert!(dir.join("model.safetensors").is_file());
    assert!(
        fixed["scaling_events"].as_array().unwrap().is_empty(),
        "{fixed}"
    );
}

#[test]
fn a_replan_asks_the_planner_with_the_measured_epochs_and_applies_its_choice() {
    // what the planner chooses depends on this machine's measured epochs; whatever it is, it is applied
    // from the last checkpoint, every epoch is recorded once, and the line says what and why
    let t = TempDir::new().unwrap();
    let job = JOB.replace("output:", "workers: 2\noutput:");
    write_job(
        t.path(),
        "policy.yaml",
        "min_workers: 1\nmax_workers: 4\nrules:\n  - name: faster\n    when: epoch == 4\n    then: {replan: min_time}\n",
    );
    write_job(
        t.path(),
        "job.yaml",
        &format!("{job}scaling_file: policy.yaml\n"),
    );
    let v = submit(t.path(), "job.yaml", &[]);
    let dir = t.path().join(v["job_dir"].as_str().unwrap());
    let got = losses(&dir);
    let epochs: Vec<u64> = got.iter().map(|e| e.0).collect();
    assert_eq!(
        epochs,
        (1..=12).collect::<Vec<_>>(),
        "every epoch exactly once"
    );
    let events = v["scaling_events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["rule"], "faster");
    assert_eq!(events[0]["epoch"], 4);
    let what = events[0]["event"].as_str().unwrap();
    assert!(
        (what.starts_with("replanned (min_time): partition on 2 -> ")
            || what.starts_with("replan (min_time) keeps partition on 2 workers"))
            && what.contains("measured compute"),
        "{what}"
    );
    // the epochs after the replan ran on what it chose
    let after = got[4].2;
    assert_eq!(v["workers"], after);
    assert!(got[4..].iter().all(|e| e.2 == after), "{got:?}");
    assert_eq!(read_json(&dir.join("status.json"))["state"], "succeeded");
}

#[test]
fn report_refuses_what_is_not_a_job_directory_naming_it() {
    let t = TempDir::new().unwrap();
    let run = |dir: &Path| {
        std::process::Command::new(physalia_tests::physalia_bin())
            .args(["report", dir.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let out = run(&t.path().join("nope"));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nope: no such job"), "{err}");
    // a line that is JSON but not a whole metrics line is refused too (no silent defaults), naming it
    std::fs::write(
        t.path().join("metrics.jsonl"),
        "{\"run\":0,\"metrics\":{\"epoch\":1}}\nnot json\n",
    )
    .unwrap();
    let out = run(t.path());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("metrics.jsonl:1: not a metrics line: missing field `loss`"),
        "{err}"
    );
    std::fs::write(t.path().join("metrics.jsonl"), "not json\n").unwrap();
    let err = String::from_utf8_lossy(&run(t.path()).stderr).into_owned();
    assert!(err.contains("metrics.jsonl:1: not a metrics line"), "{err}");
    assert!(!t.path().join("report.html").exists());
}

#[test]
fn a_job_whose_coordinator_died_resumes_from_its_directory() {
    coordinator_dies_and_the_job_resumes(2);
}

#[test]
fn a_one_worker_job_whose_coordinator_died_resumes_from_its_directory() {
    // one worker is the coordinator's job like any other: it checkpoints every epoch
    coordinator_dies_and_the_job_resumes(1);
}

fn coordinator_dies_and_the_job_resumes(workers: usize) {
    let t = TempDir::new().unwrap();
    let job = JOB
        .replace("nodes: 3000", "nodes: 12000")
        .replace("epochs: 12", "epochs: 120")
        .replace("output:", &format!("workers: {workers}\noutput:"));
    write_job(t.path(), "job.yaml", &job);
    let fixed = submit(t.path(), "job.yaml", &[]);
    let want = losses(&t.path().join(fixed["job_dir"].as_str().unwrap()));
    // start it again and kill the coordinator (the workers die with it) a few epochs in
    let mut child = std::process::Command::new(physalia_tests::physalia_bin())
        .current_dir(t.path())
        .args(["submit", "job.yaml", "-q"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let jobs = t.path().join("jobs");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let dir = loop {
        assert!(
            std::time::Instant::now() < deadline,
            "the job never got going"
        );
        let first = t.path().join(fixed["job_dir"].as_str().unwrap());
        let newest = physalia_tests::job_dirs(&jobs)
            .into_iter()
            .find(|d| d.file_name() != first.file_name());
        if let Some(d) = newest
            && std::fs::read_to_string(d.join("metrics.jsonl"))
                .is_ok_and(|m| m.lines().count() >= 3)
        {
            break d;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    child.kill().unwrap();
    child.wait().unwrap();
    let recorded = metrics(&dir).len();
    assert!(recorded < 120, "the job finished before it could be killed");
    assert_eq!(read_json(&dir.join("status.json"))["state"], "running");
    let out = std::process::Command::new(physalia_tests::physalia_bin())
        .current_dir(t.path())
        .args([
            "submit",
            "--resume",
            dir.to_str().unwrap(),
            "-q",
            "--output",
            "json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let got = losses(&dir);
    let epochs: Vec<u64> = got.iter().map(|e| e.0).collect();
    assert_eq!(
        epochs,
        (1..=120).collect::<Vec<_>>(),
        "every epoch exactly once"
    );
    for ((e, a, _), (_, b, _)) in got.iter().zip(&want) {
        assert!(
            (a - b).abs() <= 1e-3 * b.abs(),
            "epoch {e}: {a} vs uninterrupted {b}"
        );
    }
    assert_eq!(read_json(&dir.join("status.json"))["state"], "succeeded");
    let events = v["scaling_events"].as_array().unwrap();
    assert!(
        events[0]["event"]
            .as_str()
            .unwrap()
            .starts_with("resumed from"),
        "{events:?}"
    );
    // nothing to resume in a directory without checkpoints
    let out = std::process::Command::new(physalia_tests::physalia_bin())
        .current_dir(t.path())
        .args(["submit", "--resume", t.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a job directory"));
}

#[test]
fn policies_change_boundary_sampling_and_staleness_between_epochs() {
    let t = TempDir::new().unwrap();
    let two = JOB.replace("output:", "workers: 2\noutput:");
    write_job(
        t.path(),
        "policy.yaml",
        "min_workers: 2\nmax_workers: 2\ncooldown_epochs: 0\nrules:\n  - name: sample\n    when: epoch == 4\n    then: {boundary_sampling: 0.25}\n",
    );
    write_job(
        t.path(),
        "job.yaml",
        &format!("{two}scaling_file: policy.yaml\n"),
    );
    let v = submit(t.path(), "job.yaml", &[]);
    let dir = t.path().join(v["job_dir"].as_str().unwrap());
    // the halo rows' payload (layers' forward and backward; the all-reduce of weight gradients, which
    // sampling does not touch, left out: since the features' halo rows cross the network once, it is
    // half of this job's bytes, and the total no longer halves)
    let bytes: Vec<u64> = metrics(&dir)
        .iter()
        .map(|m| {
            m["workers"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|w| w["exchange"]["per_layer"].as_array().unwrap())
                .filter(|b| !b["layer"].is_null())
                .map(|b| b["sent"].as_u64().unwrap())
                .sum()
        })
        .collect();
    assert_eq!(bytes.len(), 12);
    // epochs 2-4 exchange every boundary row; from epoch 6 (after the relaunch's first epoch) a quarter
    let before = bytes[3] as f64;
    let after = bytes[6] as f64;
    assert!(after < 0.5 * before, "bytes per epoch {bytes:?}");
    let events = v["scaling_events"].as_array().unwrap();
    assert_eq!(events[0]["event"], "boundary sampling 1 -> 0.25");
    assert_eq!(events[0]["rule"], "sample");
}

#[test]
fn prewarmed_workers_take_over_at_the_rescale() {
    let t = TempDir::new().unwrap();
    write_job(t.path(), "fixed.yaml", JOB);
    // one spare is started after epoch 2; the rule grows to 2 after epoch 3 and uses it. A second
    // prewarm (after epoch 5, for 3 workers) does not match the next change (to 4) and is discarded.
    write_job(
        t.path(),
        "policy.yaml",
        "min_workers: 1\nmax_workers: 4\ncooldown_epochs: 0\nprewarm:\n  when: epoch == 2 || epoch == 5\n  workers: 1\nrules:\n  - name: two\n    when: epoch == 3\n    then: {set_workers: 2}\n  - name: four\n    when: epoch == 6\n    then: {set_workers: 4}\n",
    );
    write_job(
        t.path(),
        "job.yaml",
        &format!("{JOB}scaling_file: policy.yaml\n"),
    );
    let fixed = submit(t.path(), "fixed.yaml", &[]);
    let v = submit(t.path(), "job.yaml", &[]);
    let want = losses(&t.path().join(fixed["job_dir"].as_str().unwrap()));
    let dir = t.path().join(v["job_dir"].as_str().unwrap());
    let got = losses(&dir);
    assert_same_curve(&got, &want);
    let workers: Vec<usize> = got.iter().map(|e| e.2).collect();
    assert_eq!(workers, [1, 1, 1, 2, 2, 2, 4, 4, 4, 4, 4, 4]);
    let log = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    // in place, only the joiners are prewarmed, into the running launch's mesh
    assert!(
        log.contains("prewarming 1 workers to join launch 0 in place after epoch 2"),
        "{log}"
    );
    assert!(
        log.contains("1 -> 2 workers after epoch 3 (joiners prewarmed as launch 1)"),
        "{log}"
    );
    assert!(
        log.contains("prewarming 1 workers to join launch 2 in place after epoch 5"),
        "{log}"
    );
    assert!(
        log.contains("discarding 3 prewarmed workers: 4 are needed"),
        "{log}"
    );
    assert!(log.contains("(joiners started now as launch"), "{log}");
    // a joiner started ahead is sent its delta once it is prepared and applies it while it waits
    let ahead = physalia_tests::assert_deltas_taken_ahead(&dir);
    eprintln!("deltas taken ahead of their resize: {ahead}");
}

#[test]
fn prewarmed_workers_take_over_at_a_restarting_rescale() {
    let t = TempDir::new().unwrap();
    write_job(t.path(), "fixed.yaml", JOB);
    // as above, with `resize: restart`: the prewarm is a whole launch of the next count
    write_job(
        t.path(),
        "policy.yaml",
        "min_workers: 1\nmax_workers: 4\ncooldown_epochs: 0\nresize: restart\nprewarm:\n  when: epoch == 2 || epoch == 5\n  workers: 1\nrules:\n  - name: two\n    when: epoch == 3\n    then: {set_workers: 2}\n  - name: four\n    when: epoch == 6\n    then: {set_workers: 4}\n",
    );
    write_job(
        t.path(),
        "job.yaml",
        &format!("{JOB}scaling_file: policy.yaml\n"),
    );
    let fixed = submit(t.path(), "fixed.yaml", &[]);
    let v = submit(t.path(), "job.yaml", &[]);
    let want = losses(&t.path().join(fixed["job_dir"].as_str().unwrap()));
    let dir = t.path().join(v["job_dir"].as_str().unwrap());
    let got = losses(&dir);
    assert_same_curve(&got, &want);
    let workers: Vec<usize> = got.iter().map(|e| e.2).collect();
    assert_eq!(workers, [1, 1, 1, 2, 2, 2, 4, 4, 4, 4, 4, 4]);
    let log = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    assert!(log.contains("prewarming 2 workers after epoch 2"), "{log}");
    assert!(log.contains("using the 2 workers prewarmed"), "{log}");
    assert!(log.contains("prewarming 3 workers after epoch 5"), "{log}");
    assert!(
        log.contains("discarding 3 prewarmed workers: 4 are needed"),
        "{log}"
    );
}
