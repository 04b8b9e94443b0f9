//! `physalia plan --replay JOB_DIR` on finished quickstart jobs: the planner's model fitted to the record
//! prices the job's own launches at the ledger's worker-seconds (within 10%), the JSON answer has every
//! priced alternative, and a directory that is not a finished job is refused in one line naming it.

use std::path::{Path, PathBuf};

use physalia_tests::{read_json, repo_root};
use serde_json::Value;
use tempfile::TempDir;

/// The quickstart (the planner's choice, local workers over QUIC, its 1 -> 2 -> 4 policy), smaller: a
/// graph of 4000 nodes and 12 epochs, so a debug build runs it in seconds.
fn quickstart(cwd: &Path) -> PathBuf {
    let job = repo_root().join("examples/quickstart.yaml");
    let out = std::process::Command::new(physalia_tests::physalia_bin())
        .current_dir(cwd)
        .args([
            "submit",
            job.to_str().unwrap(),
            "-q",
            "--output",
            "json",
            "--set",
            "dataset.synth.nodes=4000",
            "--set",
            "train.epochs=12",
            "--set",
            "output.dir=jobs",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "quickstart failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    PathBuf::from(v["job_dir"].as_str().unwrap())
}

fn replay(cwd: &Path, dir: &Path, extra: &[&str]) -> std::process::Output {
    std::process::Command::new(physalia_tests::physalia_bin())
        .current_dir(cwd)
        .args(["plan", "--replay", dir.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn replay_prices_the_quickstart_at_its_ledger_and_the_alternatives() {
    let t = TempDir::new().unwrap();
    let dir = t.path().join(quickstart(t.path()));
    let summary = read_json(&dir.join("summary.json"));
    // the record replay reads: each launch's span and each epoch's end
    let launches = summary["launches"].as_array().unwrap();
    assert!(!launches.is_empty());
    assert_eq!(summary["epoch_ends"].as_array().unwrap().len(), 12);
    let range = summary["workers_range"].as_array().unwrap();
    assert!(range[0].as_u64() <= range[1].as_u64());

    let out = replay(
        t.path(),
        &dir,
        &["--output", "json", "--sku", "aci-cpu-4x16"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ledger = summary["worker_seconds"].as_f64().unwrap();
    assert_eq!(r["ledger_worker_s"].as_f64().unwrap(), ledger);
    let own = r["own"]["worker_s"].as_f64().unwrap();
    assert!(
        (own - ledger).abs() <= 0.10 * ledger,
        "the job's own settings priced at {own} worker-s, the ledger says {ledger}"
    );
    assert!((r["own_error"].as_f64().unwrap() - (own / ledger - 1.0)).abs() < 1e-9);
    for k in ["compute", "network", "eval", "overhead"] {
        let f = r["fit"][k].as_f64().unwrap();
        assert!(f.is_finite() && f > 0.0, "fit.{k} = {f}");
    }
    assert!(!r["fit"]["per_workers"].as_object().unwrap().is_empty());
    let rows = r["rows"].as_array().unwrap();
    // the quickstart's policy resizes in place: the fit has its pause, the job as run resized in place,
    // and so does its policy replayed on ACI
    let pause = r["fit"]["resize_s"].as_f64().expect("a measured resize");
    assert!(pause.is_finite() && pause >= 0.0, "{pause}");
    let own_resizes = r["own"]["resizes"].as_array().unwrap();
    assert!(!own_resizes.is_empty(), "{}", r["own"]);
    assert!(own_resizes.iter().all(|h| h == "in place"), "{}", r["own"]);
    let on_aci = rows
        .iter()
        .find(|r| r["sku"] == "aci-cpu-4x16" && r["scenario"] == "policy")
        .unwrap();
    assert!(
        on_aci["resizes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|h| h == "in place"),
        "{on_aci}"
    );
    assert_eq!(r["epochs"], 12);
    let peak = r["peak_workers"].as_u64().unwrap();
    // on both SKUs: the job as run, its policy replayed, fixed counts and the fixed cluster at the peak
    for sku in ["local", "aci-cpu-4x16"] {
        let of: Vec<&Value> = rows.iter().filter(|r| r["sku"] == sku).collect();
        let scenario = |s: &str| of.iter().find(|r| r["scenario"] == s).copied();
        for s in ["as run", "policy", "fixed at peak"] {
            let row = scenario(s).unwrap_or_else(|| panic!("no `{s}` row on {sku}: {of:?}"));
            for k in ["wall_s", "worker_s", "usd"] {
                assert!(row[k].as_f64().unwrap() >= 0.0, "{s} {sku} {k}");
            }
            assert_eq!(row["epochs"], 12);
        }
        let fixed = scenario("fixed at peak").unwrap();
        assert_eq!(fixed["workers"], serde_json::json!([peak]));
        assert!((fixed["vs_fixed_peak"].as_f64().unwrap() - 1.0).abs() < 1e-9);
        assert!(
            of.iter()
                .any(|r| r["scenario"] == "fixed" && r["workers"] == serde_json::json!([1]))
        );
        // a priced SKU costs dollars, in proportion to worker-seconds
        if sku != "local" {
            let rate = |r: &Value| r["usd"].as_f64().unwrap() / r["worker_s"].as_f64().unwrap();
            for r in &of {
                assert!(r["usd"].as_f64().unwrap() > 0.0, "{r}");
                assert!((rate(r) / rate(of[0]) - 1.0).abs() < 1e-9, "{r}");
                assert!(r["nodes_per_usd"].as_f64().unwrap() > 0.0, "{r}");
            }
        }
    }
    // the policy replayed on the job's own SKU makes the job's decisions (they depend on the loss only)
    let own_workers = &r["own"]["workers"];
    let policy = rows
        .iter()
        .find(|r| r["sku"] == "local" && r["scenario"] == "policy")
        .unwrap();
    assert_eq!(&policy["workers"], own_workers);

    // the report finds the job by its name, as `status` and `logs` do
    physalia_tests::physalia(t.path(), ["report", "quickstart", "--out", "q.html"]).ok();
    assert!(
        std::fs::read_to_string(t.path().join("q.html"))
            .unwrap()
            .contains("<svg")
    );

    // the table
    let out = replay(t.path(), &dir, &[]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("against the ledger"), "{text}");
    assert!(text.contains("fixed at peak"), "{text}");
    assert!(text.contains("policy"), "{text}");
}

#[test]
fn replay_refuses_what_is_not_a_finished_job_naming_it() {
    let t = TempDir::new().unwrap();
    let check = |dir: &Path, want: &str| {
        let out = replay(t.path(), dir, &[]);
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(&dir.display().to_string()), "{err}");
        assert!(err.contains(want), "{err}");
        assert!(out.stdout.is_empty());
    };
    check(&t.path().join("nope"), "not a finished job directory");
    // a job directory whose metrics line is broken: the file and line
    let bad = t.path().join("bad");
    std::fs::create_dir(&bad).unwrap();
    std::fs::write(bad.join("job.json"), "{}").unwrap();
    check(&bad, "not a job record");
}
