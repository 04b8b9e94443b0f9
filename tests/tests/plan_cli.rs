//! `physalia plan`: the planner's answer for a job file, as text and JSON, using the partition sets stored
//! beside the dataset; an impossible goal and a broken catalog are clear errors.

use physalia_tests::{physalia, repo_root, write_job};
use tempfile::TempDir;

const JOB: &str = "\
dataset:
  path: x.safetensors
model:
  kind: sage
  layers: 2
  hidden: 64
train:
  epochs: 50
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
            "3000",
            "--classes",
            "4",
            "--feat-dim",
            "32",
            "--out",
            "x.safetensors",
        ],
    )
    .ok();
    write_job(t.path(), "job.yaml", JOB);
    t
}

#[test]
fn plans_a_job_as_text_and_json_with_measured_partitions() {
    let t = setup();
    physalia(
        t.path(),
        ["data", "partition", "x.safetensors", "--k", "2,4"],
    )
    .ok();
    let out = physalia(
        t.path(),
        [
            "plan",
            "job.yaml",
            "--set",
            "goal.objective=min_time",
            "--set",
            "goal.backends=[local]",
        ],
    )
    .ok();
    assert!(out.stdout.starts_with("plan (min_time):"), "{}", out.stdout);
    assert!(out.stdout.contains("memory per worker"), "{}", out.stdout);
    let v = physalia(t.path(), ["plan", "job.yaml", "--output", "json"])
        .ok()
        .last_json();
    let chosen = &v["chosen"];
    assert!(chosen["candidate"]["workers"].as_u64().unwrap() >= 1, "{v}");
    assert!(chosen["prediction"].is_object(), "{v}");
    // measured partition stats replace the cut estimate for k = 2 and 4
    let v = physalia(
        t.path(),
        [
            "plan",
            "job.yaml",
            "--set",
            "goal.max_workers=4",
            "--output",
            "json",
        ],
    )
    .ok()
    .last_json();
    let why = v["explanation"].to_string();
    assert!(
        why.contains("measured from the partition artifacts for k = 2, 4"),
        "{why}"
    );
}

#[test]
fn an_impossible_deadline_and_a_broken_catalog_are_clear_errors() {
    let t = setup();
    let out = physalia(
        t.path(),
        [
            "plan",
            "job.yaml",
            "--set",
            "goal.objective=deadline",
            "--set",
            "goal.deadline_s=0.001",
        ],
    );
    assert!(!out.success());
    out.one_line_error(&["deadline"]);
    let bad = repo_root().join("planner/tests/invalid");
    let file = std::fs::read_dir(&bad)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.to_string_lossy().contains("negative-price")
                && p.extension().is_some_and(|e| e == "yaml")
        })
        .expect("the planner's negative-price catalog");
    let out = physalia(
        t.path(),
        ["plan", "job.yaml", "--catalog", file.to_str().unwrap()],
    );
    assert!(!out.success());
    out.one_line_error(&["negative-price.yaml:", "usd_per_hour"]);
}

#[test]
fn calibrate_measures_this_machine_and_plan_uses_it() {
    let t = setup();
    let out = physalia(t.path(), ["calibrate", "--quick", "-o", "cal.json"]).ok();
    assert!(out.stdout.contains("wrote cal.json"), "{}", out.stdout);
    // each kernel against the machine's limit for it
    assert!(
        out.stderr.contains("% of the cores' peak"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("% of stream)"), "{}", out.stderr);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(t.path().join("cal.json")).unwrap()).unwrap();
    for k in [
        "gemm_gflop_s",
        "peak_gflop_s",
        "spmm_gb_s",
        "stream_gb_s",
        "sampler_edges_per_s",
        "loopback_gbit_s",
    ] {
        assert!(v[k].as_f64().unwrap() > 0.0, "{k}: {v}");
    }
    let with = physalia(
        t.path(),
        [
            "plan",
            "job.yaml",
            "--calibration",
            "cal.json",
            "--output",
            "json",
        ],
    )
    .ok()
    .last_json();
    let without = physalia(t.path(), ["plan", "job.yaml", "--output", "json"])
        .ok()
        .last_json();
    let epoch = |p: &serde_json::Value| p["chosen"]["prediction"]["time"]["epoch_s"].as_f64();
    assert!(epoch(&with).is_some(), "{}", with["chosen"]);
    assert_ne!(epoch(&with), epoch(&without), "the profile changed nothing");
}

#[test]
fn submit_with_a_goal_runs_the_planners_choice() {
    let t = setup();
    let out = physalia(
        t.path(),
        [
            "submit",
            "job.yaml",
            "--set",
            "workers=2",
            "--set",
            "goal.objective=min_time",
            "--set",
            "train.epochs=3",
            "--set",
            "output.dir=jobs",
            "--output",
            "json",
        ],
    )
    .ok();
    let line = out
        .stderr
        .lines()
        .find(|l| l.starts_with("plan (min_time): "))
        .unwrap_or_else(|| panic!("no plan line in {}", out.stderr));
    // the local backend is planned as one container: the job file's 2 workers are replaced
    assert!(line.contains(" on 1 x local"), "{line}");
    let v = out.last_json();
    assert!(v.get("workers").is_none() || v["workers"] == 1, "{v}");
    // a goal naming only another backend is refused before anything runs
    let out = physalia(
        t.path(),
        [
            "submit",
            "job.yaml",
            "--set",
            "goal.backends=[ecs]",
            "--set",
            "output.dir=jobs2",
        ],
    );
    assert!(!out.success());
    out.one_line_error(&["goal.backends", "`local`"]);
    assert!(!t.path().join("jobs2").exists());
}

#[test]
fn plan_as_written_predicts_the_job_files_own_settings() {
    let t = setup();
    let v = physalia(
        t.path(),
        [
            "plan",
            "job.yaml",
            "--as-written",
            "--set",
            "workers=2",
            "--set",
            "parallelism=data",
            "--output",
            "json",
        ],
    )
    .ok()
    .last_json();
    assert_eq!(v["candidate"]["mode"], "data", "{}", v["candidate"]);
    assert_eq!(v["candidate"]["workers"], 2, "{}", v["candidate"]);
    let epoch = v["prediction"]["time"]["epoch_s"].as_f64().unwrap();
    assert!(epoch > 0.0 && epoch.is_finite(), "{epoch}");
    assert_eq!(v["calibrated"], false);
    let one = physalia(
        t.path(),
        ["plan", "job.yaml", "--as-written", "--output", "json"],
    )
    .ok()
    .last_json();
    assert_eq!(one["candidate"]["workers"], 1);
    let text = physalia(
        t.path(),
        ["plan", "job.yaml", "--as-written", "--set", "workers=3"],
    )
    .ok()
    .stdout;
    assert!(
        text.starts_with("as written: partition 3 on local"),
        "{text}"
    );
}
