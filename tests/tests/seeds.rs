//! One dataset trained again with other seeds: each seed partitions the dataset anew and stores its set
//! beside the file (`g.parts/k<K>-seed<S>/`), and the next job on it must still plan and run, on any
//! worker count (issue 29 (a): the stored sets of two seeds reached the planner, which refused two
//! partitionings with the same part count, so every later job failed).

use std::path::Path;

use physalia_tests::{metrics, physalia, write_job};
use tempfile::TempDir;

const JOB: &str = "\
name: reseed
dataset: g.safetensors
model: {kind: gcn, layers: 2, hidden: 8}
train: {epochs: 2}
output: {dir: jobs}
";

/// Trains the job on `workers` workers with `seed` and returns its job directory.
fn train(dir: &Path, workers: u32, seed: u64) -> std::path::PathBuf {
    let sets = [format!("workers={workers}"), format!("train.seed={seed}")];
    let out = physalia(
        dir,
        [
            "submit",
            "job.yaml",
            "-q",
            "--set",
            sets[0].as_str(),
            "--set",
            sets[1].as_str(),
            "--output",
            "json",
        ],
    );
    assert!(
        out.success(),
        "seed {seed} on {workers} worker(s) failed ({:?}):\n{}",
        out.code,
        out.stderr
    );
    let v = out.last_json();
    assert_eq!(v["workers"], workers, "{v}");
    dir.join(
        v["job_dir"]
            .as_str()
            .expect("the summary names its job_dir"),
    )
}

#[test]
fn issue_29_a_dataset_trains_with_seeds_0_1_2_one_after_another_on_1_and_2_workers() {
    let t = TempDir::new().unwrap();
    physalia(
        t.path(),
        [
            "data",
            "synth",
            "sbm",
            "--nodes",
            "600",
            "--feat-dim",
            "8",
            "--seed",
            "1",
            "--out",
            "g.safetensors",
        ],
    )
    .ok();
    write_job(t.path(), "job.yaml", JOB);
    for workers in [1u32, 2] {
        for seed in [0u64, 1, 2] {
            let job_dir = train(t.path(), workers, seed);
            assert_eq!(
                metrics(&job_dir).len(),
                2,
                "seed {seed} on {workers} worker(s): one metrics line per epoch"
            );
            // the job trained on its own seed's partitioning, stored beside the dataset
            let set = t.path().join(format!("g.parts/k{workers}-seed{seed}"));
            assert!(
                set.join("partition.safetensors").is_file(),
                "{} is missing",
                set.display()
            );
        }
    }
}
