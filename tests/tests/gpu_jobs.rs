//! GPU workers through `physalia submit`: `resources.gpu` reaches every worker, which trains full-graph on
//! the device engine and names its device in every epoch and the summary; a job whose workers find no GPU
//! fails naming what is missing, or trains on the CPU and says so with `gpu_fallback: cpu`.
//!
//! Without a GPU the device path runs on the CUDA engine's host emulation (the worker's
//! `PHYSALIA_TEST_EMULATE_GPU=1` test hook); on a GPU machine the same job trains on the GPU
//! (`bench/RESULTS.md`, issue 15, has those runs).

use std::path::Path;
use std::process::Command;

use physalia_tests::{metrics, physalia, write_job};
use serde_json::Value;
use tempfile::TempDir;

const JOB: &str = "\
name: sbm
dataset: x.safetensors
model: {kind: gcn, layers: 2, hidden: 16, dropout: 0.5}
train: {epochs: 6, seed: 0, eval_every: 2}
workers: 2
output: {dir: jobs}
";

fn setup() -> TempDir {
    let t = TempDir::new().unwrap();
    physalia(
        t.path(),
        [
            "data",
            "synth",
            "sbm",
            "--nodes",
            "1500",
            "--classes",
            "4",
            "--feat-dim",
            "16",
            "--seed",
            "1",
            "--out",
            "x.safetensors",
        ],
    )
    .ok();
    t
}

/// `physalia submit job` with `env`; its exit status, JSON summary (when it succeeded) and stderr.
fn submit(cwd: &Path, job: &str, env: &[(&str, &str)]) -> (bool, Value, String) {
    let mut cmd = Command::new(physalia_tests::physalia_bin());
    cmd.current_dir(cwd)
        .args(["submit", job, "--output", "json"])
        .env_remove("PHYSALIA_TEST_EMULATE_GPU");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or(Value::Null);
    (
        out.status.success(),
        summary,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn epochs(cwd: &Path, summary: &Value) -> Vec<Value> {
    metrics(&cwd.join(summary["job_dir"].as_str().unwrap()))
        .into_iter()
        .map(|l| l["metrics"].clone())
        .collect()
}

/// Runs `job` on the CPU and, with `resources.gpu`, on the emulated device; checks every epoch's loss agrees
/// to 1e-4 and names the device (the CPU job's none). Returns both jobs' epochs and summaries, and the device
/// job's standard error.
fn cpu_and_emulated_gpu(cwd: &Path, job: &str) -> [(Vec<Value>, Value); 2] {
    write_job(cwd, "cpu.yaml", job);
    write_job(
        cwd,
        "gpu.yaml",
        &format!("{job}resources: {{gpu: {{count: 1}}}}\n"),
    );
    let (ok, cpu, err) = submit(cwd, "cpu.yaml", &[]);
    assert!(ok, "{err}");
    let (ok, gpu, err) = submit(cwd, "gpu.yaml", &[("PHYSALIA_TEST_EMULATE_GPU", "1")]);
    assert!(ok, "{err}");
    // the epoch lines say it too
    assert!(err.contains("on emulated GPU (test hook)"), "{err}");
    let (want, got) = (epochs(cwd, &cpu), epochs(cwd, &gpu));
    assert_eq!(got.len(), 6);
    for (g, w) in got.iter().zip(&want) {
        let (a, b) = (g["loss"].as_f64().unwrap(), w["loss"].as_f64().unwrap());
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "epoch {}: loss {a} on the device, {b} on the CPU",
            g["epoch"]
        );
        assert_eq!(g["device"], "emulated GPU (test hook)", "{g}");
        assert!(
            w.get("device").is_none(),
            "a CPU job's epochs name no device: {w}"
        );
    }
    assert_eq!(gpu["device"], "emulated GPU (test hook)");
    assert!(cpu.get("device").is_none(), "{cpu}");
    [(got, gpu), (want, cpu)]
}

#[test]
fn a_gpu_job_trains_on_the_device_and_equals_the_cpu_job() {
    let t = setup();
    let [(got, _), (want, _)] = cpu_and_emulated_gpu(t.path(), JOB);
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g["val_acc"], w["val_acc"], "epoch {}", g["epoch"]);
    }
}

#[test]
fn a_data_parallel_gpu_job_trains_its_minibatches_on_the_device_like_the_cpu() {
    let t = setup();
    let job = format!("{JOB}parallelism: data\nminibatch: {{fanouts: [5, 5], batch_size: 64}}\n");
    let [(got, _), _] = cpu_and_emulated_gpu(t.path(), &job);
    for g in &got {
        assert!(g["batches"]["steps"].as_u64().unwrap() > 1, "{g}");
    }
}

#[test]
fn a_gpu_job_without_a_gpu_fails_naming_it_or_falls_back_when_allowed() {
    let t = setup();
    let gpu = format!("{JOB}resources: {{gpu: {{count: 1}}}}\n");
    write_job(t.path(), "strict.yaml", &gpu);
    write_job(
        t.path(),
        "fallback.yaml",
        &gpu.replace("{count: 1}}", "{count: 1}, gpu_fallback: cpu}"),
    );
    let (ok, summary, err) = submit(t.path(), "strict.yaml", &[]);
    if ok {
        // a machine with a GPU: the job trained there
        let d = summary["device"].as_str().unwrap_or_default();
        assert!(d.starts_with("cuda:"), "{summary}");
    } else {
        let last = err.trim_end().lines().last().unwrap_or_default();
        assert!(
            err.contains("resources.gpu") && err.contains("no usable GPU"),
            "the failure names the field and the reason: {err}"
        );
        assert!(!last.is_empty());
    }
    let (ok, summary, err) = submit(t.path(), "fallback.yaml", &[]);
    assert!(ok, "{err}");
    let d = summary["device"].as_str().unwrap_or_default().to_string();
    if !d.starts_with("cuda:") {
        assert!(d.starts_with("cpu (fallback: "), "{summary}");
        for e in epochs(t.path(), &summary) {
            assert_eq!(e["device"].as_str(), Some(d.as_str()), "{e}");
        }
        assert!(err.contains("on cpu (fallback: "), "{err}");
    }
}
