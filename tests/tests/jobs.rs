//! `physalia list`, `status`, `logs` and `cancel` against real jobs: they read the job's record only, so
//! they work while the job runs, after it ended, and after its coordinator died.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use physalia_tests::{job_dirs, physalia, physalia_bin, read_json, write_job};
use serde_json::Value;
use tempfile::TempDir;

/// A small generated graph; `epochs` long, on `workers` local worker processes.
fn job(epochs: u32, workers: u32) -> String {
    format!(
        "name: small\ndataset:\n  synth:\n    kind: sbm\n    nodes: 2000\n    classes: 4\n    avg_degree: 8\n    \
         feat_dim: 16\n    seed: 1\nmodel:\n  kind: gcn\n  hidden: 16\ntrain:\n  epochs: {epochs}\n  \
         threads: 1\n  eval_every: 1000000\nworkers: {workers}\noutput:\n  dir: jobs\n"
    )
}

fn spawn_submit(dir: &Path, file: &str) -> Child {
    Command::new(physalia_bin())
        .current_dir(dir)
        .args(["submit", file, "-q"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning physalia submit")
}

/// Waits until the job under `dir/jobs` has recorded at least one epoch; returns its directory.
fn wait_for_an_epoch(dir: &Path, child: &mut Child) -> PathBuf {
    let t0 = Instant::now();
    loop {
        if let Some(job) = job_dirs(&dir.join("jobs")).into_iter().next()
            && let Ok(text) = std::fs::read_to_string(job.join("status.json"))
            && let Ok(v) = serde_json::from_str::<Value>(&text)
            && v["epoch"].as_u64().unwrap_or(0) >= 1
        {
            return job;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("submit ended before its first epoch: {status}");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no epoch within 120 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Worker pids the coordinator started (from its log).
fn worker_pids(job: &Path) -> Vec<u32> {
    std::fs::read_to_string(job.join("logs/coordinator.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            l.split_once("started worker ")?
                .1
                .split_once(" pid ")?
                .1
                .parse()
                .ok()
        })
        .collect()
}

fn gone(pid: u32) -> bool {
    let t0 = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() {
        // a zombie is gone for our purpose only once reaped; give the reaper a moment
        if t0.elapsed() > Duration::from_secs(10) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

#[test]
fn status_list_and_logs_read_a_finished_job() {
    let t = TempDir::new().unwrap();
    write_job(t.path(), "small.yaml", &job(3, 2));
    physalia(t.path(), ["submit", "small.yaml", "-q"]).ok();
    let dir = job_dirs(&t.path().join("jobs")).remove(0);
    let id = dir.file_name().unwrap().to_string_lossy().into_owned();

    // by job name (the newest of that name), by directory name, by path: the same job
    for name in ["small", id.as_str(), dir.to_str().unwrap()] {
        let v = physalia(t.path(), ["status", name, "--output", "json"])
            .ok()
            .last_json();
        assert_eq!(v["job"], id.as_str(), "{name}");
        assert_eq!(v["state"], "succeeded");
        assert_eq!(v["status"]["epoch"], 3);
        assert_eq!(v["status"]["epochs"], 3);
        assert_eq!(v["status"]["backend"], "local");
        assert_eq!(v["last_epoch"]["epoch"], 3);
        assert_eq!(v["last_epoch"]["workers"], 2);
    }
    let text = physalia(t.path(), ["status", "small"]).ok().stdout;
    assert!(text.contains("state: succeeded, epoch 3 of 3"), "{text}");

    let list = physalia(t.path(), ["list", "--output", "json"])
        .ok()
        .last_json();
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list[0]["job"], id.as_str());
    let text = physalia(t.path(), ["list"]).ok().stdout;
    assert!(text.lines().nth(1).unwrap().contains(&id), "{text}");
    assert!(text.contains("succeeded"), "{text}");
    // an ended job shows the workers of its last epoch (JOB STATE EPOCH WORKERS BACKEND USD)
    let row: Vec<&str> = text.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(row[3], "2", "{text}");
    // the folder (or a store's URL) as an argument, as `report` takes a job
    assert_eq!(physalia(t.path(), ["list", "jobs"]).ok().stdout, text);

    let coordinator = physalia(t.path(), ["logs", "small"]).ok().stdout;
    assert!(
        coordinator.contains("launch 0: all workers registered"),
        "{coordinator}"
    );
    let rank1 = physalia(t.path(), ["logs", "small", "--rank", "1"])
        .ok()
        .stdout;
    assert!(rank1.contains("worker 1/2"), "{rank1}");
    // following an ended job prints what there is and returns
    let followed = physalia(t.path(), ["logs", "small", "--rank", "1", "--follow"])
        .ok()
        .stdout;
    assert_eq!(followed, rank1);
    physalia(t.path(), ["logs", "small", "--rank", "5"]).one_line_error(&["rank 5"]);
    physalia(t.path(), ["status", "nosuch"]).one_line_error(&["nosuch", "no such job"]);
    // a finished job is not cancelled
    let out = physalia(t.path(), ["cancel", "small"]).ok().stdout;
    assert!(out.contains("already succeeded"), "{out}");
    assert_eq!(read_json(&dir.join("status.json"))["state"], "succeeded");
}

#[test]
fn cancel_stops_a_running_job_and_every_worker() {
    let t = TempDir::new().unwrap();
    write_job(t.path(), "small.yaml", &job(1_000_000, 2));
    let mut child = spawn_submit(t.path(), "small.yaml");
    let dir = wait_for_an_epoch(t.path(), &mut child);
    let running = physalia(t.path(), ["status", "small", "--output", "json"])
        .ok()
        .last_json();
    assert_eq!(running["state"], "running", "{running}");
    assert_eq!(running["status"]["workers"], 2, "{running}");
    let pids = worker_pids(&dir);
    assert_eq!(pids.len(), 2, "{pids:?}");

    let out = physalia(t.path(), ["cancel", "small"]).ok().stdout;
    assert!(out.contains("cancelled"), "{out}");
    let end = child.wait_with_output().unwrap();
    assert_eq!(end.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&end.stderr);
    assert!(stderr.contains("was cancelled"), "{stderr}");
    let status = read_json(&dir.join("status.json"));
    assert_eq!(status["state"], "cancelled", "{status}");
    assert_eq!(status["workers"], 0);
    for pid in pids {
        assert!(gone(pid), "worker pid {pid} outlived the cancel");
    }
    // the record still resumes: cancel keeps every recorded epoch and its checkpoint
    assert!(dir.join("checkpoints").read_dir().unwrap().next().is_some());
}

#[test]
fn a_job_whose_coordinator_died_is_lost_and_cancel_ends_it() {
    let t = TempDir::new().unwrap();
    write_job(t.path(), "small.yaml", &job(1_000_000, 2));
    let mut child = spawn_submit(t.path(), "small.yaml");
    let dir = wait_for_an_epoch(t.path(), &mut child);
    let pids = worker_pids(&dir);
    child.kill().unwrap();
    child.wait().unwrap();
    // the record still says running; the commands see through it
    assert_eq!(read_json(&dir.join("status.json"))["state"], "running");
    let v = physalia(t.path(), ["status", "small", "--output", "json"])
        .ok()
        .last_json();
    assert_eq!(v["state"], "lost", "{v}");
    let text = physalia(t.path(), ["status", "small"]).ok().stdout;
    assert!(text.contains("submit --resume"), "{text}");
    let list = physalia(t.path(), ["list"]).ok().stdout;
    assert!(list.contains("lost"), "{list}");

    let out = physalia(t.path(), ["cancel", "small"]).ok().stdout;
    assert!(
        out.contains("cancelled") && out.contains("coordinator was gone"),
        "{out}"
    );
    let status = read_json(&dir.join("status.json"));
    assert_eq!(status["state"], "cancelled", "{status}");
    // no worker outlives its coordinator, and the launch's secrets are gone
    for pid in pids {
        assert!(gone(pid), "worker pid {pid} outlived its coordinator");
    }
    let secrets = dir.join("secrets");
    let left: Vec<_> = walk(&secrets);
    assert!(left.is_empty(), "secrets left: {left:?}");
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
