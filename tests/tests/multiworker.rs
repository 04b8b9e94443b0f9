//! Multi-worker jobs through `physalia submit`: N `physalia-worker` processes over QUIC compute the same
//! losses as one worker, and a worker killed mid-training fails the job with one error naming it, within a
//! bounded time, leaving no worker process behind.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use physalia_tests::{job_dirs, metrics, physalia, read_json, write_job};
use tempfile::TempDir;

const JOB: &str = "\
name: mw
dataset:
  synth:
    kind: sbm
    nodes: 4000
    classes: 4
    feat_dim: 16
    avg_degree: 10
    homophily: 0.8
    seed: 1
model:
  kind: gcn
  layers: 2
  hidden: 16
train:
  epochs: 20
  seed: 0
output:
  dir: jobs
";

fn losses(job_dir: &Path) -> Vec<f64> {
    metrics(job_dir)
        .iter()
        .map(|m| m["metrics"]["loss"].as_f64().unwrap())
        .collect()
}

#[test]
fn three_worker_processes_train_exactly_like_one() {
    let t = TempDir::new().unwrap();
    write_job(t.path(), "job.yaml", JOB);
    let one = physalia(t.path(), ["submit", "job.yaml", "-q", "--output", "json"])
        .ok()
        .last_json();
    let three = physalia(
        t.path(),
        [
            "submit",
            "job.yaml",
            "--set",
            "workers=3",
            "--output",
            "json",
        ],
    )
    .ok();
    let v = three.last_json();
    assert_eq!(v["workers"], 3);
    assert!(v["bytes_exchanged"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["worker_peak_rss_bytes"].as_array().unwrap().len(), 3);
    assert_eq!(v["epoch_times_s"].as_array().unwrap().len(), 20);
    // one line per epoch, with the exchange columns
    let lines: Vec<&str> = three
        .stderr
        .lines()
        .filter(|l| l.starts_with("epoch "))
        .collect();
    assert_eq!(lines.len(), 20, "{}", three.stderr);
    assert!(
        lines[0].contains("sent ") && lines[0].contains("halo max"),
        "{}",
        lines[0]
    );

    let dir1 = Path::new(one["job_dir"].as_str().unwrap());
    let dir3 = Path::new(v["job_dir"].as_str().unwrap());
    let (l1, l3) = (losses(&t.path().join(dir1)), losses(&t.path().join(dir3)));
    assert_eq!(l1.len(), 20);
    assert_eq!(l3.len(), 20);
    for (e, (a, b)) in l1.iter().zip(&l3).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * a.abs(),
            "epoch {}: 1 worker {a}, 3 workers {b}",
            e + 1
        );
    }
    let d3 = t.path().join(dir3);
    assert!(d3.join("model.safetensors").is_file());
    assert!(d3.join("dataset.safetensors").is_file());
    assert_eq!(read_json(&d3.join("status.json"))["state"], "succeeded");
    let m = &metrics(&d3)[0];
    assert_eq!(m["workers"].as_array().unwrap().len(), 3);
    assert!(m["workers"][0]["exchange"]["bytes_sent"].as_u64().unwrap() > 0);
    // secrets are private files (modes: physalia-backends' tests/local.rs), deleted with the workers
    let mut left = Vec::new();
    let mut dirs = vec![d3.join("secrets")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else {
                left.push(p);
            }
        }
    }
    assert!(left.is_empty(), "secrets left after the job: {left:?}");
}

#[test]
fn replicas_of_partition_groups_train_exactly_like_one_worker() {
    // 2 replicas of a 2-way partitioning: 4 processes, halo exchange inside each group, the replicas
    // split the training nodes and all-reduce over all four
    let t = TempDir::new().unwrap();
    write_job(t.path(), "job.yaml", JOB);
    let one = physalia(t.path(), ["submit", "job.yaml", "-q", "--output", "json"])
        .ok()
        .last_json();
    let four = physalia(
        t.path(),
        [
            "submit",
            "job.yaml",
            "-q",
            "--set",
            "workers=4",
            "--set",
            "parallelism={partition: 2, replicas: 2}",
            "--output",
            "json",
        ],
    )
    .ok()
    .last_json();
    assert_eq!(four["workers"], 4);
    let l1 = losses(&t.path().join(one["job_dir"].as_str().unwrap()));
    let l4 = losses(&t.path().join(four["job_dir"].as_str().unwrap()));
    assert_eq!(l4.len(), l1.len());
    for (e, (a, b)) in l1.iter().zip(&l4).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * a.abs(),
            "epoch {}: 1 worker {a}, 2x2 workers {b}",
            e + 1
        );
    }
    // mini-batch replicas train too
    let v = physalia(
        t.path(),
        [
            "submit",
            "job.yaml",
            "-q",
            "--set",
            "workers=4",
            "--set",
            "parallelism={data: 2, replicas: 2}",
            "--set",
            "minibatch.batch_size=256",
            "--output",
            "json",
        ],
    )
    .ok()
    .last_json();
    assert!(v["mean_final_test_acc"].as_f64().unwrap() > 0.8, "{v}");
    // a worker count that is not parts x replicas is refused before anything starts
    let out = physalia(
        t.path(),
        [
            "validate",
            "job.yaml",
            "--set",
            "workers=3",
            "--set",
            "parallelism={partition: 2, replicas: 2}",
        ],
    );
    assert!(!out.success());
    out.one_line_error(&["workers", "2 x 2 = 4"]);
}

fn alive(pid: u32) -> bool {
    // A zombie counts as gone only once reaped, which is what "no orphans" means.
    Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn a_worker_killed_mid_training_fails_the_job_naming_it() {
    // every multi-worker job retries a lost worker's epoch (elastic.rs tests that); with no retries
    // allowed, the first loss fails the job
    let t = TempDir::new().unwrap();
    write_job(t.path(), "job.yaml", JOB);
    let start = Instant::now();
    let out = Command::new(physalia_tests::physalia_bin())
        .current_dir(t.path())
        .args([
            "submit",
            "job.yaml",
            "--set",
            "workers=3",
            "--set",
            "max_retries=0",
            "-q",
        ])
        .env("PHYSALIA_TEST_DIE_AT_EPOCH", "3")
        .env("PHYSALIA_TEST_DIE_RANK", "1")
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let took = start.elapsed();
    let out = physalia_tests::Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    let line = out.one_line_error(&["worker 1 (pid ", "exited with signal 9 during epoch 3"]);
    assert!(took < Duration::from_secs(30), "took {took:?}: {line}");
    let dirs = job_dirs(&t.path().join("jobs"));
    assert_eq!(dirs.len(), 1);
    let status = read_json(&dirs[0].join("status.json"));
    assert_eq!(status["state"], "failed");
    assert!(
        status["error"].as_str().unwrap().contains("worker 1"),
        "{status}"
    );
    let log = std::fs::read_to_string(dirs[0].join("logs/coordinator.log")).unwrap();
    let pids: Vec<u32> = log
        .lines()
        .filter_map(|l| l.strip_prefix("started worker "))
        .filter_map(|l| l.split(" pid ").nth(1)?.trim().parse().ok())
        .collect();
    assert_eq!(pids.len(), 3, "{log}");
    for pid in pids {
        assert!(!alive(pid), "worker pid {pid} is still there");
    }
}
