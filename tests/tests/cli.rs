//! End-to-end tests of the `physalia` CLI: bad inputs (one-line errors that say what and where, nothing
//! half-written), `data import | synth | inspect`, `validate` and `schema`.
//!
//! Training runs live in `cli_train.rs`.

use std::fs;
use std::path::Path;

use physalia_tests::{
    job_dirs, physalia, safetensors_header, snapshot, write_job, write_tiny_generic,
};
use tempfile::TempDir;

/// A tempdir with the tiny generic folder at `raw/` imported into `tiny.safetensors`.
fn tiny_imported() -> TempDir {
    let t = TempDir::new().unwrap();
    write_tiny_generic(&t.path().join("raw"));
    physalia(
        t.path(),
        ["data", "import", "raw", "--out", "tiny.safetensors"],
    )
    .ok();
    t
}

fn job_on(dataset: &str) -> String {
    format!(
        "name: t\ndataset:\n  path: {dataset}\nmodel:\n  kind: gcn\n  hidden: 8\ntrain:\n  epochs: 2\noutput:\n  dir: jobs\n"
    )
}

// -------------------------------------------------------------------------------------------------
// happy paths of the data commands

#[test]
fn import_then_inspect_tiny_folder() {
    let t = tiny_imported();
    let out = physalia(
        t.path(),
        ["data", "inspect", "tiny.safetensors", "--output", "json"],
    )
    .ok();
    let v = out.last_json();
    assert_eq!(v["stats"]["num_nodes"], 8);
    assert_eq!(
        v["stats"]["num_edges"], 24,
        "12 undirected edges stored both ways"
    );
    assert_eq!(v["stats"]["feat_dim"], 3);
    assert_eq!(v["stats"]["num_classes"], 2);
    assert_eq!(v["stats"]["train_size"], 4);
    assert_eq!(v["metadata"]["num_nodes"], 8);
    let text = physalia(t.path(), ["data", "inspect", "tiny.safetensors"]).ok();
    assert!(
        text.stdout
            .lines()
            .any(|l| l.starts_with("nodes") && l.trim_end().ends_with(" 8")),
        "{}",
        text.stdout
    );
    // the header parses as plain safetensors and holds the seven tensors
    let bytes = fs::read(t.path().join("tiny.safetensors")).unwrap();
    let h = safetensors_header(&bytes);
    assert_eq!(
        h.tensor_names(),
        [
            "features",
            "indices",
            "indptr",
            "labels",
            "test_idx",
            "train_idx",
            "val_idx"
        ]
    );
    // and no temporary file is left beside it
    let names: Vec<_> = fs::read_dir(t.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        names.len(),
        2,
        "expected only raw/ and tiny.safetensors, got {names:?}"
    );
}

#[test]
fn synth_then_inspect_json() {
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
    assert_eq!(v["stats"]["feat_dim"], 16);
    assert_eq!(v["stats"]["num_classes"], 4);
    assert_eq!(v["metadata"]["num_nodes"], 2000);
    // same seed, same file
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
            "y.safetensors",
        ],
    )
    .ok();
    assert!(
        fs::read(t.path().join("x.safetensors")).unwrap()
            == fs::read(t.path().join("y.safetensors")).unwrap(),
        "data synth with the same seed wrote different files"
    );
}

#[test]
fn cora_import_and_inspect() {
    let Some(cora) = physalia_tests::cora_dir() else {
        return;
    };
    let t = TempDir::new().unwrap();
    let out = t.path().join("cora.safetensors");
    physalia(
        t.path(),
        [
            "data".as_ref(),
            "import".as_ref(),
            cora.as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
        ],
    )
    .ok();
    let v = physalia(
        t.path(),
        ["data", "inspect", "cora.safetensors", "--output", "json"],
    )
    .ok()
    .last_json();
    assert_eq!(v["stats"]["num_nodes"], 2708);
    assert_eq!(v["stats"]["num_edges"], 10556);
    assert_eq!(v["stats"]["feat_dim"], 1433);
    assert_eq!(v["stats"]["num_classes"], 7);
    assert_eq!(v["stats"]["train_size"], 140);
    assert_eq!(v["stats"]["val_size"], 500);
    assert_eq!(v["stats"]["test_size"], 1000);
    let text = physalia(t.path(), ["data", "inspect", "cora.safetensors"]).ok();
    assert!(text.stdout.contains("2708"), "{}", text.stdout);
    assert!(text.stdout.contains("10556"), "{}", text.stdout);
}

#[test]
fn schema_has_model_property() {
    let t = TempDir::new().unwrap();
    let out = physalia(t.path(), ["schema"]).ok();
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("schema is JSON");
    assert!(
        v["properties"]["model"].is_object(),
        "no properties.model in {v}"
    );
    assert!(v["properties"]["dataset"].is_object());
    assert!(v["properties"]["train"].is_object());
}

#[test]
fn validate_accepts_a_good_job() {
    let t = tiny_imported();
    let job = write_job(t.path(), "ok.yaml", &job_on("tiny.safetensors"));
    let out = physalia(t.path(), ["validate".as_ref(), job.as_os_str()]).ok();
    assert!(out.stdout.contains("ok"), "{}", out.stdout);
    assert!(
        job_dirs(&t.path().join("jobs")).is_empty(),
        "validate must not create job directories"
    );
}

// -------------------------------------------------------------------------------------------------
// 1. truncated dataset file

#[test]
fn truncated_dataset_file_is_named_by_inspect_and_submit() {
    let t = tiny_imported();
    let path = t.path().join("tiny.safetensors");
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();

    physalia(t.path(), ["data", "inspect", "tiny.safetensors"])
        .one_line_error(&["tiny.safetensors", "truncated"]);
    physalia(
        t.path(),
        ["data", "inspect", "tiny.safetensors", "--output", "json"],
    )
    .one_line_error(&["tiny.safetensors"]);

    let job = write_job(t.path(), "job.yaml", &job_on("tiny.safetensors"));
    let before = snapshot(t.path());
    let out = physalia(t.path(), ["submit".as_ref(), job.as_os_str()]);
    out.one_line_error(&["tiny.safetensors", "dataset.path"]);
    assert!(out.stdout.is_empty(), "stdout: {}", out.stdout);
    assert!(
        !t.path().join("jobs").exists(),
        "a failed submit created output.dir"
    );
    assert_eq!(before, snapshot(t.path()), "a failed submit changed files");

    // a file shorter than the 8-byte length field
    fs::write(&path, [1u8, 2, 3]).unwrap();
    physalia(t.path(), ["data", "inspect", "tiny.safetensors"])
        .one_line_error(&["tiny.safetensors"]);
}

// -------------------------------------------------------------------------------------------------
// 2. indices out of range

#[test]
fn edge_node_out_of_range_names_edges_csv_and_line() {
    let t = TempDir::new().unwrap();
    let raw = t.path().join("raw");
    write_tiny_generic(&raw);
    let mut edges = fs::read_to_string(raw.join("edges.csv")).unwrap();
    edges.push_str("3,8\n"); // 8 nodes: ids 0..8; this is line 14 (header + 12 edges + this)
    assert_eq!(edges.lines().count(), 14);
    fs::write(raw.join("edges.csv"), edges).unwrap();

    // no output file is created
    let before = snapshot(t.path());
    let out = physalia(
        t.path(),
        ["data", "import", "raw", "--out", "x.safetensors"],
    );
    out.one_line_error(&["edges.csv:14", "8", "out of range"]);
    assert_eq!(
        before,
        snapshot(t.path()),
        "a failed import left files behind"
    );

    // a pre-existing output file is left untouched, byte for byte
    fs::write(t.path().join("x.safetensors"), b"precious bytes").unwrap();
    let before = snapshot(t.path());
    physalia(
        t.path(),
        ["data", "import", "raw", "--out", "x.safetensors"],
    )
    .one_line_error(&["edges.csv:14"]);
    assert_eq!(
        before,
        snapshot(t.path()),
        "a failed import changed the existing output or left files behind"
    );

    // a negative id and a malformed row are line errors too
    let mut edges = fs::read_to_string(raw.join("edges.csv"))
        .unwrap()
        .replace("3,8\n", "");
    edges.push_str("-1,2\n");
    fs::write(raw.join("edges.csv"), &edges).unwrap();
    physalia(
        t.path(),
        ["data", "import", "raw", "--out", "y.safetensors"],
    )
    .one_line_error(&["edges.csv:14"]);
    fs::write(raw.join("edges.csv"), edges.replace("-1,2\n", "3;4\n")).unwrap();
    physalia(
        t.path(),
        ["data", "import", "raw", "--out", "y.safetensors"],
    )
    .one_line_error(&["edges.csv:14"]);
    assert!(!t.path().join("y.safetensors").exists());

    // submit on the raw folder fails the same way and creates no job directory
    let job = write_job(t.path(), "job.yaml", &job_on("raw"));
    physalia(t.path(), ["submit".as_ref(), job.as_os_str()])
        .one_line_error(&["edges.csv:14", "dataset.path"]);
    assert!(job_dirs(&t.path().join("jobs")).is_empty());
}

/// Patches the first CSR entry of `tiny.safetensors` to an out-of-range node id; with `fix_checksum` also
/// rewrites the recorded checksum so the structural check is what fails.
fn corrupt_indices(path: &Path, fix_checksum: bool) {
    let mut bytes = fs::read(path).unwrap();
    let h = safetensors_header(&bytes);
    assert_eq!(h.json["indices"]["dtype"], "I32");
    let range = h.tensor_range("indices");
    let old_sum = physalia_graph::checksum(&bytes[range.clone()]);
    bytes[range.start..range.start + 4].copy_from_slice(&100i32.to_le_bytes());
    if fix_checksum {
        let new_sum = physalia_graph::checksum(&bytes[range.clone()]);
        let header = &mut bytes[8..8 + h.len];
        let pos = header
            .windows(old_sum.len())
            .position(|w| w == old_sum.as_bytes())
            .expect("the indices checksum is in the header");
        header[pos..pos + new_sum.len()].copy_from_slice(new_sum.as_bytes());
    }
    fs::write(path, bytes).unwrap();
}

#[test]
fn out_of_range_index_in_dataset_file_names_indices_tensor() {
    let t = tiny_imported();
    let path = t.path().join("tiny.safetensors");
    let good = fs::read(&path).unwrap();

    // as written by a bit flip: the checksum catches it
    corrupt_indices(&path, false);
    let e = physalia(t.path(), ["data", "inspect", "tiny.safetensors"])
        .one_line_error(&["tiny.safetensors", "indices"]);
    assert!(e.contains("checksum"), "{e}");
    let job = write_job(t.path(), "job.yaml", &job_on("tiny.safetensors"));
    physalia(t.path(), ["submit".as_ref(), job.as_os_str()])
        .one_line_error(&["tiny.safetensors", "indices"]);
    assert!(
        !t.path().join("jobs").exists(),
        "a failed submit created output.dir"
    );

    // with a matching checksum the content validation catches it
    fs::write(&path, &good).unwrap();
    corrupt_indices(&path, true);
    let e = physalia(t.path(), ["data", "inspect", "tiny.safetensors"]).one_line_error(&[
        "tiny.safetensors",
        "indices",
        "100",
    ]);
    assert!(
        !e.contains("checksum"),
        "the patched checksum should match: {e}"
    );
    physalia(t.path(), ["submit".as_ref(), job.as_os_str()])
        .one_line_error(&["tiny.safetensors", "indices"]);
    assert!(
        !t.path().join("jobs").exists(),
        "a failed submit created output.dir"
    );
}

// -------------------------------------------------------------------------------------------------
// 3. feature matrix of the wrong size

#[test]
fn feature_bin_of_wrong_size_names_bin_and_byte_counts() {
    let t = TempDir::new().unwrap();
    let raw = t.path().join("raw");
    write_tiny_generic(&raw); // features.bin holds 8 x 3 float32 = 96 bytes
    fs::write(
        raw.join("features.json"),
        r#"{"file": "features.bin", "num_nodes": 5, "feat_dim": 3, "dtype": "float32"}"#,
    )
    .unwrap();
    fs::write(t.path().join("out.safetensors"), b"old").unwrap();
    let before = snapshot(t.path());
    let e = physalia(
        t.path(),
        ["data", "import", "raw", "--out", "out.safetensors"],
    )
    .one_line_error(&["features.bin", "96", "60"]);
    // expected 60 (5 * 3 * 4), actual 96, in that role
    assert!(e.contains("is 96 bytes") && e.contains("60 bytes"), "{e}");
    assert_eq!(before, snapshot(t.path()));

    // a .bin one byte short of the JSON's claim
    fs::write(
        raw.join("features.json"),
        r#"{"file": "features.bin", "num_nodes": 8, "feat_dim": 3, "dtype": "float32"}"#,
    )
    .unwrap();
    let bin = fs::read(raw.join("features.bin")).unwrap();
    fs::write(raw.join("features.bin"), &bin[..bin.len() - 1]).unwrap();
    physalia(
        t.path(),
        ["data", "import", "raw", "--out", "new.safetensors"],
    )
    .one_line_error(&["features.bin", "95", "96"]);
    assert!(!t.path().join("new.safetensors").exists());

    let job = write_job(t.path(), "job.yaml", &job_on("raw"));
    physalia(t.path(), ["submit".as_ref(), job.as_os_str()]).one_line_error(&[
        "features.bin",
        "95",
        "96",
    ]);
    assert!(
        !t.path().join("jobs").exists(),
        "a failed submit created output.dir"
    );
}

// -------------------------------------------------------------------------------------------------
// 4. YAML typo

#[test]
fn yaml_typo_is_reported_with_file_line_column_and_field() {
    let t = tiny_imported();
    let job = write_job(
        t.path(),
        "typo.yaml",
        "dataset:\n  path: tiny.safetensors\nmodel:\n  kind: gcn\n  hiden: 16\ntrain:\n  epochs: 2\noutput:\n  dir: jobs\n",
    );
    for cmd in ["validate", "submit"] {
        let out = physalia(t.path(), [cmd, "typo.yaml"]);
        out.one_line_error(&["typo.yaml:5:3", "hiden"]);
        assert!(out.stdout.is_empty(), "{cmd} stdout: {}", out.stdout);
        // with an unrelated override the file's own error is still located
        physalia(t.path(), [cmd, "typo.yaml", "--set", "train.epochs=3"])
            .one_line_error(&["typo.yaml:5:3", "hiden"]);
    }
    assert!(
        !t.path().join("jobs").exists(),
        "a failed submit created output.dir"
    );
    let _ = job;

    // a typo at the top level
    write_job(
        t.path(),
        "top.yaml",
        "dataset:\n  path: tiny.safetensors\nmodel:\n  kind: gcn\ntrian:\n  epochs: 2\n",
    );
    physalia(t.path(), ["validate", "top.yaml"]).one_line_error(&["top.yaml:5:1", "trian"]);

    // a misspelt --set key names the override
    write_job(t.path(), "ok.yaml", &job_on("tiny.safetensors"));
    physalia(t.path(), ["submit", "ok.yaml", "--set", "model.hiden=4"])
        .one_line_error(&["--set model.hiden=4", "hiden"]);
    assert!(
        !t.path().join("jobs").exists(),
        "a failed submit created output.dir"
    );
}

#[test]
fn validate_names_a_dataset_that_is_not_there() {
    let t = TempDir::new().unwrap();
    write_job(t.path(), "missing.yaml", &job_on("nope.safetensors"));
    for cmd in ["validate", "submit"] {
        physalia(t.path(), [cmd, "missing.yaml"])
            .one_line_error(&["dataset.path", "nope.safetensors"]);
    }
    assert!(!t.path().join("jobs").exists());
}

#[test]
fn validate_names_every_file_the_job_names_that_cannot_be_read() {
    use std::os::unix::fs::PermissionsExt;
    let t = tiny_imported();
    // a scaling policy file that is not there: the job file, the field and the path
    write_job(
        t.path(),
        "policy.yaml",
        &format!(
            "{}scaling_file: nope-policy.yaml\n",
            job_on("tiny.safetensors")
        ),
    );
    for cmd in ["validate", "submit"] {
        physalia(t.path(), [cmd, "policy.yaml"]).one_line_error(&[
            "policy.yaml: scaling_file",
            "nope-policy.yaml",
            "cannot read the scaling policy",
        ]);
    }
    assert!(!t.path().join("jobs").exists());
    // a dataset that is there but cannot be opened (a root process reads anything: skip that half)
    write_job(t.path(), "ok.yaml", &job_on("tiny.safetensors"));
    let data = t.path().join("tiny.safetensors");
    fs::set_permissions(&data, fs::Permissions::from_mode(0o000)).unwrap();
    if fs::File::open(&data).is_err() {
        physalia(t.path(), ["validate", "ok.yaml"])
            .one_line_error(&["ok.yaml: dataset.path", "tiny.safetensors"]);
    } else {
        println!("skipping the unreadable-dataset half: this process reads a 0000 file (root)");
    }
    fs::set_permissions(&data, fs::Permissions::from_mode(0o644)).unwrap();
    physalia(t.path(), ["validate", "ok.yaml"]).ok();
    // a catalog given to validate: missing, then invalid, each named
    physalia(
        t.path(),
        ["validate", "ok.yaml", "--catalog", "nope-catalog.yaml"],
    )
    .one_line_error(&["--catalog", "nope-catalog.yaml", "cannot read"]);
    fs::write(
        t.path().join("cat.yaml"),
        "skus:\n  - name: x\n    vcpus: lots\n",
    )
    .unwrap();
    physalia(t.path(), ["validate", "ok.yaml", "--catalog", "cat.yaml"])
        .one_line_error(&["--catalog", "cat.yaml"]);
}

// -------------------------------------------------------------------------------------------------
// 5. negative learning rate

#[test]
fn negative_learning_rate_names_train_lr() {
    let t = tiny_imported();
    write_job(
        t.path(),
        "neg.yaml",
        "dataset:\n  path: tiny.safetensors\nmodel:\n  kind: gcn\ntrain:\n  epochs: 2\n  lr: -0.01\noutput:\n  dir: jobs\n",
    );
    for cmd in ["validate", "submit"] {
        physalia(t.path(), [cmd, "neg.yaml"]).one_line_error(&["neg.yaml", "train.lr", "-0.01"]);
    }
    write_job(t.path(), "ok.yaml", &job_on("tiny.safetensors"));
    for cmd in ["validate", "submit"] {
        physalia(t.path(), [cmd, "ok.yaml", "--set", "train.lr=-0.01"]).one_line_error(&[
            "ok.yaml",
            "train.lr",
            "--set train.lr=-0.01",
            "-0.01",
        ]);
    }
    // zero and non-numbers too
    physalia(t.path(), ["validate", "ok.yaml", "--set", "train.lr=0"])
        .one_line_error(&["train.lr"]);
    physalia(t.path(), ["validate", "ok.yaml", "--set", "train.lr=fast"])
        .one_line_error(&["train.lr", "fast"]);
    assert!(
        !t.path().join("jobs").exists(),
        "a failed submit created output.dir"
    );
}

// -------------------------------------------------------------------------------------------------
// other spec errors

#[test]
fn gat_only_fields_are_rejected_on_gcn() {
    let t = tiny_imported();
    write_job(t.path(), "ok.yaml", &job_on("tiny.safetensors"));
    physalia(t.path(), ["submit", "ok.yaml", "--set", "model.heads=4"])
        .one_line_error(&["model.heads", "gat"]);
    physalia(
        t.path(),
        [
            "validate",
            "ok.yaml",
            "--set",
            "model.kind=gat",
            "--set",
            "model.heads=4",
        ],
    )
    .ok();
    assert!(
        !t.path().join("jobs").exists(),
        "a failed submit created output.dir"
    );
}

#[test]
fn dataset_with_both_path_and_synth_is_rejected() {
    let t = tiny_imported();
    write_job(t.path(), "ok.yaml", &job_on("tiny.safetensors"));
    physalia(
        t.path(),
        [
            "validate",
            "ok.yaml",
            "--set",
            "dataset.synth={kind: sbm, nodes: 100, avg_degree: 5, classes: 2, feat_dim: 4}",
        ],
    )
    .one_line_error(&["dataset", "both"]);
}

#[test]
fn missing_dataset_path_names_it() {
    let t = TempDir::new().unwrap();
    write_job(t.path(), "job.yaml", &job_on("nowhere.safetensors"));
    physalia(t.path(), ["submit", "job.yaml"])
        .one_line_error(&["nowhere.safetensors", "dataset.path"]);
    assert!(
        !t.path().join("jobs").exists(),
        "a failed submit created output.dir"
    );
    physalia(
        t.path(),
        ["data", "import", "nowhere", "--out", "x.safetensors"],
    )
    .one_line_error(&["nowhere"]);
    physalia(t.path(), ["data", "inspect", "nowhere.safetensors"])
        .one_line_error(&["nowhere.safetensors"]);
    assert!(!t.path().join("x.safetensors").exists());
}

/// An OS error is printed once: the error types put the source's text into their own message *and* return
/// it as `source()`, and `main` joins the whole chain, so the text appears twice.
#[test]
fn missing_job_file_error_does_not_repeat_itself() {
    let t = TempDir::new().unwrap();
    let e = physalia(t.path(), ["validate", "nope.yaml"]).one_line_error(&["nope.yaml"]);
    assert_eq!(
        e.matches("os error 2").count(),
        1,
        "the OS error is printed more than once: {e}"
    );
    let e = physalia(t.path(), ["submit", "nope.yaml"]).one_line_error(&["nope.yaml"]);
    assert_eq!(
        e.matches("os error 2").count(),
        1,
        "the OS error is printed more than once: {e}"
    );
}

#[test]
fn import_into_missing_directory_error_does_not_repeat_itself() {
    let t = TempDir::new().unwrap();
    write_tiny_generic(&t.path().join("raw"));
    let before = snapshot(t.path());
    let e = physalia(
        t.path(),
        [
            "data",
            "import",
            "raw",
            "--out",
            "no/such/dir/x.safetensors",
        ],
    )
    .one_line_error(&["no/such/dir"]);
    assert_eq!(before, snapshot(t.path()));
    assert_eq!(
        e.matches("os error 2").count(),
        1,
        "the OS error is printed more than once: {e}"
    );
}

/// Dataset files get the permissions of any other file the user creates (mode 0666 minus the umask), not
/// the 0600 of the private temporary file they are written through.
#[cfg(unix)]
#[test]
fn written_dataset_file_has_ordinary_permissions() {
    use std::os::unix::fs::PermissionsExt;
    let t = tiny_imported();
    physalia(
        t.path(),
        [
            "data",
            "synth",
            "sbm",
            "--nodes",
            "50",
            "--classes",
            "2",
            "--avg-degree",
            "4",
            "--feat-dim",
            "2",
            "--out",
            "s.safetensors",
        ],
    )
    .ok();
    // the child inherits this process's umask, so a file created here shows the expected mode
    fs::write(t.path().join("probe"), b"").unwrap();
    let mode = |p: &str| fs::metadata(t.path().join(p)).unwrap().permissions().mode() & 0o777;
    let expected = mode("probe");
    assert_eq!(
        mode("tiny.safetensors"),
        expected,
        "data import wrote mode {:o}, expected {expected:o}",
        mode("tiny.safetensors")
    );
    assert_eq!(
        mode("s.safetensors"),
        expected,
        "data synth wrote mode {:o}, expected {expected:o}",
        mode("s.safetensors")
    );
}

/// Issue 14: `submit` on kubernetes and aci takes cluster mode's path (no longer refused as "not
/// yet"), and what would fail is refused first, in one line naming the file and the field or the
/// platform, before anything is made: no coordinator identity on aci, no Kubernetes configuration,
/// a local job store; `--detach` of a client-mode job is refused too.
#[test]
fn issue_14_cluster_mode_submit_refuses_bad_settings_before_making_anything() {
    let t = tiny_imported();
    let cloud = "name: t\ndataset: tiny.safetensors\nmodel: {kind: gcn, hidden: 8}\ntrain: {epochs: 2}\nworkers: 2\noutput: {dir: s3://physalia-test-nowhere/jobs}\nbackend:\n  name: kubernetes\n  kubernetes:\n    image: registry.example/physalia-worker:0.1.0\n    sku: gke-g2-standard-8\n  aci:\n    subscription_id: 00000000-0000-0000-0000-000000000000\n    resource_group: physalia\n    location: eastus\n    subnet_id: /subscriptions/0/resourceGroups/physalia/providers/Microsoft.Network/virtualNetworks/v/subnets/w\n    image: physalia.azurecr.io/physalia-worker:0.1.0\n    sku: aci-cpu-2x8\n";
    write_job(t.path(), "cloud.yaml", cloud);
    let before = snapshot(t.path());
    let submit = |args: &[&str]| {
        let out = std::process::Command::new(physalia_tests::physalia_bin())
            .current_dir(t.path())
            .args(["submit", "cloud.yaml"])
            .args(args)
            // no Kubernetes configuration and no cloud credentials here
            .env("KUBECONFIG", t.path().join("no-kubeconfig"))
            .env("HOME", t.path())
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("AWS_ACCESS_KEY_ID")
            .env_remove("AZURE_CLIENT_ID")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        physalia_tests::Output {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    };
    submit(&[]).one_line_error(&["cloud.yaml", "Kubernetes configuration"]);
    submit(&["--backend", "aci"]).one_line_error(&[
        "cloud.yaml",
        "backend.aci.coordinator_identity_id",
        "cluster mode",
    ]);
    submit(&["--set", "output.dir=jobs"]).one_line_error(&["cloud.yaml", "output.dir", "s3://"]);
    submit(&["--backend", "local", "--detach"]).one_line_error(&["--detach", "client mode"]);
    assert_eq!(snapshot(t.path()), before, "nothing was made");

    // `validate` refuses what `submit` would, for the platform `--backend` names (issue 30: a job
    // file that validated on aci was then refused by submit for its missing coordinator identity)
    physalia(t.path(), ["validate", "cloud.yaml", "--backend", "aci"]).one_line_error(&[
        "cloud.yaml",
        "backend.aci.coordinator_identity_id",
        "cluster mode",
    ]);
    physalia(
        t.path(),
        ["validate", "cloud.yaml", "--set", "output.dir=jobs"],
    )
    .one_line_error(&["cloud.yaml", "output.dir", "s3://"]);
    physalia(t.path(), ["validate", "cloud.yaml"]).ok();
    physalia(t.path(), ["validate", "cloud.yaml", "--backend", "local"]).ok();
    assert_eq!(snapshot(t.path()), before, "validate made nothing");
}
