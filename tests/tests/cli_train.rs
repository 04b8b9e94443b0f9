//! End-to-end training through `physalia submit`: the JSON summary, the job directory, accuracy well
//! above chance on a learnable SBM graph and on Cora, repeated runs, and determinism.

use std::fs;
use std::path::{Path, PathBuf};

use physalia_tests::{
    job_dirs, metrics, physalia, read_json, safetensors_header, write_job, write_tiny_generic,
};
use serde_json::Value;
use tempfile::TempDir;

/// Chance is 0.25 on 4 classes; measured final test accuracy after 30 epochs is 0.95-0.99 for gcn, sage
/// and gat on this graph (seeds 0-5), so 0.8 leaves a wide margin.
const SBM_MIN_ACC: f64 = 0.8;

/// A tempdir holding `x.safetensors` (SBM: 2000 nodes, 4 classes, 16 features, seed 1) and `job.yaml`
/// (2-layer gcn, 30 epochs, `output.dir: jobs`).
fn sbm_setup() -> TempDir {
    let t = TempDir::new().unwrap();
    physalia(
        t.path(),
        [
            "data",
            "synth",
            "sbm",
            "--nodes",
            "2000",
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
    let v = physalia(
        t.path(),
        ["data", "inspect", "x.safetensors", "--output", "json"],
    )
    .ok()
    .last_json();
    assert_eq!(v["stats"]["num_nodes"], 2000);
    assert_eq!(v["stats"]["num_classes"], 4);
    write_job(
        t.path(),
        "job.yaml",
        "name: sbm\ndataset:\n  path: x.safetensors\nmodel:\n  kind: gcn\n  layers: 2\n  hidden: 16\ntrain:\n  epochs: 30\n  seed: 0\noutput:\n  dir: jobs\n",
    );
    t
}

fn submit_json(cwd: &Path, job: &str, sets: &[&str], quiet: bool) -> (Value, String) {
    let mut args = vec![
        "submit".to_string(),
        job.to_string(),
        "--output".into(),
        "json".into(),
    ];
    if quiet {
        args.push("--quiet".into());
    }
    for s in sets {
        args.push("--set".into());
        args.push((*s).to_string());
    }
    let out = physalia(cwd, &args).ok();
    (out.last_json(), out.stderr)
}

fn f64_of(v: &Value, what: &str) -> f64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"))
}

/// Checks the summary and job directory of a finished single-run job; returns the job directory.
fn check_single_run(cwd: &Path, s: &Value, epochs: usize, kind: &str) -> PathBuf {
    assert!(f64_of(&s["median_epoch_s"], "median_epoch_s") > 0.0);
    let times = s["epoch_times_s"].as_array().expect("epoch_times_s");
    assert_eq!(times.len(), epochs);
    assert!(times.iter().all(|t| t.as_f64().is_some_and(|t| t >= 0.0)));
    assert!(
        s["peak_rss_bytes"].as_u64().is_some_and(|b| b > 0),
        "peak_rss_bytes: {}",
        s["peak_rss_bytes"]
    );
    assert_eq!(s["epochs"], epochs);
    assert_eq!(s["runs"].as_array().unwrap().len(), 1);
    assert_eq!(s["runs"][0]["final_epoch"], epochs);
    assert_eq!(s["model"]["kind"], kind);
    let dir = cwd.join(s["job_dir"].as_str().expect("job_dir"));
    assert!(dir.is_dir(), "{} is not a directory", dir.display());
    assert_eq!(
        job_dirs(&cwd.join("jobs")),
        vec![dir.clone()],
        "exactly one job directory"
    );

    let job = read_json(&dir.join("job.json"));
    assert_eq!(job["model"]["kind"], kind);
    assert_eq!(job["train"]["epochs"], epochs);
    assert_eq!(read_json(&dir.join("status.json"))["state"], "succeeded");
    let m = metrics(&dir);
    assert_eq!(m.len(), epochs, "metrics.jsonl lines");
    for (i, line) in m.iter().enumerate() {
        assert_eq!(line["run"], 0);
        assert_eq!(line["metrics"]["epoch"], i + 1);
        assert!(
            line["metrics"]["loss"].as_f64().is_some_and(f64::is_finite),
            "{line}"
        );
    }
    let summary = read_json(&dir.join("summary.json"));
    assert_eq!(
        summary["runs"], s["runs"],
        "summary.json and the printed summary disagree"
    );
    assert_eq!(summary["job_dir"], s["job_dir"]);

    let model = fs::read(dir.join("model.safetensors")).unwrap();
    let h = safetensors_header(&model);
    let names = h.tensor_names();
    for t in [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
    ] {
        assert!(
            names.iter().any(|n| n == t),
            "model.safetensors lacks {t}: {names:?}"
        );
    }
    assert!(
        !names.iter().any(|n| n.starts_with("layers.2.")),
        "a 2-layer model has no layers.2: {names:?}"
    );
    assert_eq!(
        h.json["layers.1.bias"]["shape"],
        serde_json::json!([4]),
        "output bias has one entry per class"
    );
    assert_eq!(
        h.json["layers.0.weight"]["shape"][0], 16,
        "first weight takes the 16 input features"
    );
    // tensors tile the data section exactly
    let end = names.iter().map(|n| h.tensor_range(n).end).max().unwrap();
    assert_eq!(end, model.len());
    // A one-worker job is the coordinator's like any other: beside the record it keeps the last checkpoint
    // (for `submit --resume`), the logs, its HTML report, and the (emptied) secrets folder; the dataset is a file, so its
    // partition lies beside it, not here. No temporary file is left behind, at any depth.
    let mut files: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "checkpoints",
            "job.json",
            "logs",
            "metrics.jsonl",
            "model.safetensors",
            "report.html",
            "secrets",
            "status.json",
            "summary.json"
        ]
    );
    fn no_temporaries(d: &Path) {
        for e in fs::read_dir(d).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            assert!(
                !name.starts_with('.') && !name.contains("partial") && !name.ends_with(".tmp"),
                "left behind: {}",
                e.path().display()
            );
            if e.file_type().unwrap().is_dir() {
                no_temporaries(&e.path());
            }
        }
    }
    no_temporaries(&dir);
    assert_eq!(
        fs::read_dir(dir.join("checkpoints")).unwrap().count(),
        1,
        "only the last checkpoint is kept"
    );
    assert_eq!(fs::read_dir(dir.join("secrets")).unwrap().count(), 0);
    dir
}

#[test]
fn sbm_gcn_trains_and_records_everything() {
    let t = sbm_setup();
    // not quiet: one progress line per epoch on stderr, the JSON summary last on stdout
    let (s, stderr) = submit_json(t.path(), "job.yaml", &[], false);
    let epoch_lines = stderr.lines().filter(|l| l.starts_with("epoch ")).count();
    assert_eq!(epoch_lines, 30, "stderr:\n{stderr}");
    let dir = check_single_run(t.path(), &s, 30, "gcn");
    let acc = f64_of(&s["runs"][0]["final_test_acc"], "final_test_acc");
    assert!(acc > SBM_MIN_ACC, "gcn final test accuracy {acc}");
    let names =
        safetensors_header(&fs::read(dir.join("model.safetensors")).unwrap()).tensor_names();
    assert_eq!(
        names,
        [
            "layers.0.bias",
            "layers.0.weight",
            "layers.1.bias",
            "layers.1.weight"
        ]
    );
}

#[test]
fn sbm_sage_trains() {
    let t = sbm_setup();
    let (s, stderr) = submit_json(t.path(), "job.yaml", &["model.kind=sage"], true);
    assert!(
        !stderr.lines().any(|l| l.starts_with("epoch ")),
        "--quiet printed epochs:\n{stderr}"
    );
    let dir = check_single_run(t.path(), &s, 30, "sage");
    let acc = f64_of(&s["runs"][0]["final_test_acc"], "final_test_acc");
    assert!(acc > SBM_MIN_ACC, "sage final test accuracy {acc}");
    let names =
        safetensors_header(&fs::read(dir.join("model.safetensors")).unwrap()).tensor_names();
    assert!(
        names.iter().any(|n| n == "layers.0.root_weight"),
        "{names:?}"
    );
}

#[test]
fn sbm_gat_trains() {
    let t = sbm_setup();
    let (s, _) = submit_json(
        t.path(),
        "job.yaml",
        &["model.kind=gat", "model.heads=4", "model.activation=elu"],
        true,
    );
    let dir = check_single_run(t.path(), &s, 30, "gat");
    assert_eq!(s["model"]["heads"], 4);
    let acc = f64_of(&s["runs"][0]["final_test_acc"], "final_test_acc");
    assert!(acc > SBM_MIN_ACC, "gat final test accuracy {acc}");
    let names =
        safetensors_header(&fs::read(dir.join("model.safetensors")).unwrap()).tensor_names();
    assert!(names.iter().any(|n| n == "layers.0.att_src"), "{names:?}");
    assert!(names.iter().any(|n| n == "layers.0.att_dst"), "{names:?}");
}

#[test]
fn two_runs_use_two_seeds_and_report_mean_and_std() {
    let t = sbm_setup();
    let (s, _) = submit_json(
        t.path(),
        "job.yaml",
        &["train.runs=2", "train.epochs=10", "train.seed=5"],
        true,
    );
    let runs = s["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["seed"], 5);
    assert_eq!(runs[1]["seed"], 6);
    let accs: Vec<f64> = runs
        .iter()
        .map(|r| f64_of(&r["test_acc_at_best_val"], "test_acc_at_best_val"))
        .collect();
    let mean = f64_of(&s["mean_test_acc_at_best_val"], "mean_test_acc_at_best_val");
    let std = f64_of(&s["std_test_acc_at_best_val"], "std_test_acc_at_best_val");
    assert!(
        (mean - (accs[0] + accs[1]) / 2.0).abs() < 1e-9,
        "mean {mean} of {accs:?}"
    );
    assert!(
        (std - (accs[0] - accs[1]).abs() / 2.0).abs() < 1e-9,
        "population std {std} of {accs:?}"
    );
    assert!(s["mean_final_test_acc"].as_f64().is_some());
    assert_eq!(
        s["epoch_times_s"].as_array().unwrap().len(),
        10,
        "epoch times of the first run"
    );

    let dir = t.path().join(s["job_dir"].as_str().unwrap());
    assert_eq!(read_json(&dir.join("status.json"))["state"], "succeeded");
    let m = metrics(&dir);
    assert_eq!(m.len(), 20);
    assert!(m[..10].iter().all(|l| l["run"] == 0 && l["seed"] == 5));
    assert!(m[10..].iter().all(|l| l["run"] == 1 && l["seed"] == 6));
    let w0 = fs::read(dir.join("model-run0.safetensors")).unwrap();
    let w1 = fs::read(dir.join("model-run1.safetensors")).unwrap();
    assert!(!dir.join("model.safetensors").exists());
    let (h0, h1) = (safetensors_header(&w0), safetensors_header(&w1));
    let r = h0.tensor_range("layers.0.weight");
    assert_ne!(
        w0[r.clone()],
        w1[h1.tensor_range("layers.0.weight")],
        "different seeds trained identical weights"
    );
}

#[test]
fn submit_with_synth_dataset() {
    let t = TempDir::new().unwrap();
    write_job(
        t.path(),
        "synth.yaml",
        "dataset:\n  synth:\n    kind: sbm\n    nodes: 1000\n    avg_degree: 8\n    classes: 3\n    feat_dim: 8\n    seed: 2\nmodel:\n  kind: gcn\ntrain:\n  epochs: 30\noutput:\n  dir: jobs\n",
    );
    let (s, _) = submit_json(t.path(), "synth.yaml", &[], true);
    assert_eq!(s["nodes"], 1000);
    assert_eq!(s["job"], "synth", "the job is named after the file");
    assert!(t.path().join(s["job_dir"].as_str().unwrap()).is_dir());
    assert_eq!(s["epoch_times_s"].as_array().unwrap().len(), 30);
    let acc = f64_of(&s["runs"][0]["final_test_acc"], "final_test_acc");
    assert!(acc > 0.6, "chance is 1/3, got {acc}");
    // nothing but the job directory was written
    let names: Vec<_> = fs::read_dir(t.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

#[test]
fn cora_example_job_trains_from_repo_root() {
    let Some(cora) = physalia_tests::cora_dir() else {
        return;
    };
    let root = physalia_tests::repo_root();
    let t = TempDir::new().unwrap();
    let out_dir = t.path().join("out");
    let out = physalia(
        &root,
        [
            "submit".to_string(),
            "examples/cora-gcn.yaml".into(),
            "--set".into(),
            format!("dataset.path={}", cora.display()),
            "--set".into(),
            "train.epochs=20".into(),
            "--set".into(),
            format!("output.dir={}", out_dir.display()),
            "--output".into(),
            "json".into(),
            "--quiet".into(),
        ],
    )
    .ok();
    let s = out.last_json();
    assert_eq!(s["nodes"], 2708);
    assert_eq!(s["edges"], 10556);
    assert_eq!(s["job"], "cora-gcn");
    let dir = PathBuf::from(s["job_dir"].as_str().unwrap());
    assert!(
        dir.starts_with(&out_dir),
        "{} is not under output.dir",
        dir.display()
    );
    assert_eq!(job_dirs(&out_dir), vec![dir.clone()]);
    assert_eq!(read_json(&dir.join("status.json"))["state"], "succeeded");
    assert_eq!(metrics(&dir).len(), 20);
    // measured 0.73-0.77 after 20 epochs (seeds 0-2); the most common class is about 0.3
    let acc = f64_of(&s["runs"][0]["final_test_acc"], "final_test_acc");
    assert!(acc > 0.5, "cora test accuracy after 20 epochs: {acc}");
    let h = safetensors_header(&fs::read(dir.join("model.safetensors")).unwrap());
    assert_eq!(
        h.json["layers.0.weight"]["shape"],
        serde_json::json!([1433, 16])
    );
    assert_eq!(h.json["layers.1.bias"]["shape"], serde_json::json!([7]));
}

/// The tensors of a model file, by name, as raw bytes.
fn tensors(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    let h = safetensors_header(bytes);
    h.tensor_names()
        .into_iter()
        .map(|n| (n.clone(), bytes[h.tensor_range(&n)].to_vec()))
        .collect()
}

fn losses(dir: &Path) -> Vec<f64> {
    metrics(dir)
        .iter()
        .map(|l| l["metrics"]["loss"].as_f64().unwrap())
        .collect()
}

#[test]
fn same_seed_gives_same_weights_and_losses() {
    let t = sbm_setup();
    let (a, _) = submit_json(
        t.path(),
        "job.yaml",
        &["train.epochs=15", "train.seed=3"],
        true,
    );
    let (b, _) = submit_json(
        t.path(),
        "job.yaml",
        &["train.epochs=15", "train.seed=3"],
        true,
    );
    let (da, db) = (
        t.path().join(a["job_dir"].as_str().unwrap()),
        t.path().join(b["job_dir"].as_str().unwrap()),
    );
    assert_ne!(da, db, "two submits share a job directory");
    assert_eq!(
        losses(&da),
        losses(&db),
        "losses differ between identical runs"
    );
    let (ma, mb) = (
        fs::read(da.join("model.safetensors")).unwrap(),
        fs::read(db.join("model.safetensors")).unwrap(),
    );
    assert!(
        tensors(&ma) == tensors(&mb),
        "weights differ between identical runs"
    );
    assert_eq!(
        safetensors_header(&ma).json,
        safetensors_header(&mb).json,
        "headers differ beyond key order"
    );
    assert_eq!(
        a["runs"][0]["final_test_acc"],
        b["runs"][0]["final_test_acc"]
    );
    // a different seed trains different weights
    let (c, _) = submit_json(
        t.path(),
        "job.yaml",
        &["train.epochs=15", "train.seed=4"],
        true,
    );
    let mc = fs::read(
        t.path()
            .join(c["job_dir"].as_str().unwrap())
            .join("model.safetensors"),
    )
    .unwrap();
    assert!(
        tensors(&ma) != tensors(&mc),
        "seeds 3 and 4 trained identical weights"
    );
}

/// Byte-identical model files for the same seed. The header's `__metadata__` comes from a `HashMap`, so its
/// key order changes from process to process; ten runs all agreeing by chance is (1/2)^9 with two keys.
#[test]
fn same_seed_gives_byte_identical_model_file() {
    let t = TempDir::new().unwrap();
    write_tiny_generic(&t.path().join("raw"));
    physalia(
        t.path(),
        ["data", "import", "raw", "--out", "tiny.safetensors"],
    )
    .ok();
    write_job(
        t.path(),
        "job.yaml",
        "dataset:\n  path: tiny.safetensors\nmodel:\n  kind: gcn\n  hidden: 4\ntrain:\n  epochs: 3\n  seed: 7\noutput:\n  dir: jobs\n",
    );
    let files: Vec<Vec<u8>> = (0..10)
        .map(|_| {
            let (s, _) = submit_json(t.path(), "job.yaml", &[], true);
            fs::read(
                t.path()
                    .join(s["job_dir"].as_str().unwrap())
                    .join("model.safetensors"),
            )
            .unwrap()
        })
        .collect();
    for (i, f) in files.iter().enumerate().skip(1) {
        assert!(tensors(f) == tensors(&files[0]), "run {i}: weights differ");
    }
    let differing = files.iter().filter(|f| **f != files[0]).count();
    assert_eq!(
        differing,
        0,
        "{differing} of 10 model.safetensors files differ from the first in their bytes (same seed, same weights); \
         first header: {}",
        String::from_utf8_lossy(&files[0][8..8 + safetensors_header(&files[0]).len])
    );
}

#[test]
fn data_and_model_parallelism_train_on_one_and_several_workers() {
    let t = sbm_setup();
    for (mode, workers) in [("data", 1), ("model", 1), ("data", 2), ("model", 2)] {
        let (s, _) = submit_json(
            t.path(),
            "job.yaml",
            &[
                &format!("parallelism={mode}"),
                &format!("workers={workers}"),
                "minibatch.fanouts=[10, 5]",
                "minibatch.batch_size=128",
                "minibatch.cache_rows=100",
                "train.epochs=15",
            ],
            true,
        );
        let acc = f64_of(&s["mean_final_test_acc"], "final test accuracy");
        assert!(acc >= SBM_MIN_ACC, "{mode} x{workers}: test accuracy {acc}");
        let dir = t.path().join(s["job_dir"].as_str().unwrap());
        let m = metrics(&dir);
        let batches = &m.last().unwrap()["metrics"]["batches"];
        assert!(
            batches["steps"].as_u64().unwrap() > 0,
            "{mode} x{workers}: {batches}"
        );
        if workers > 1 {
            assert!(
                s["bytes_exchanged"].as_u64().unwrap() > 0,
                "{mode} x{workers}"
            );
        }
    }
}

/// Issue 29 (b): `model.layers: 3` without fan-outs trains in every mode; the default fan-outs follow the
/// layer count (they were `[25, 10]` for any model, refused as "2 entries for 3 layers").
#[test]
fn issue_29_three_layers_without_fanouts_train_in_every_mode() {
    let t = sbm_setup();
    for mode in ["partition", "data", "model"] {
        let (s, _) = submit_json(
            t.path(),
            "job.yaml",
            &[
                &format!("parallelism={mode}"),
                "model.layers=3",
                "train.epochs=2",
            ],
            true,
        );
        let dir = t.path().join(s["job_dir"].as_str().unwrap());
        assert_eq!(metrics(&dir).len(), 2, "{mode}: one metrics line per epoch");
        let job = read_json(&dir.join("job.json"));
        assert_eq!(job["model"]["layers"], 3, "{mode}: {job}");
    }
}

#[test]
fn bad_parallelism_settings_are_refused_with_the_field() {
    let t = sbm_setup();
    for (sets, needle) in [
        (vec!["parallelism=model", "model.kind=gat"], "parallelism"),
        (
            vec!["parallelism=data", "minibatch.fanouts=[5]"],
            "minibatch.fanouts",
        ),
        (
            vec!["parallelism=data", "minibatch.fanouts=[5, 0]"],
            "minibatch.fanouts",
        ),
        (vec!["minibatch.batch_size=8"], "minibatch"),
    ] {
        let mut args = vec!["validate".to_string(), "job.yaml".to_string()];
        for s in &sets {
            args.push("--set".into());
            args.push(s.to_string());
        }
        let out = physalia(t.path(), &args);
        assert!(!out.success(), "{sets:?} was accepted");
        out.one_line_error(&[needle]);
    }
}
