//! Bad data is refused before a job starts, naming the tensor and the first bad row: features that are NaN
//! or infinite, an empty training split (labels out of range and overlapping splits are refused by the
//! dataset format itself, `graph/src/format.rs`).

use std::fs;

use physalia_tests::{job_dirs, physalia, write_job, write_tiny_generic};
use tempfile::TempDir;

/// Sets feature (row, col) of the tiny generic dataset (8 nodes x 3 features, f32 little-endian).
fn set_feature(dir: &std::path::Path, row: usize, col: usize, v: f32) {
    let path = dir.join("features.bin");
    let mut b = fs::read(&path).unwrap();
    let at = (row * 3 + col) * 4;
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    fs::write(path, b).unwrap();
}

const JOB: &str =
    "dataset: data\nmodel: {kind: gcn, hidden: 4}\ntrain: {epochs: 2}\noutput: {dir: jobs}\n";

#[test]
fn non_finite_features_are_refused_naming_the_row_and_column() {
    for (v, says) in [(f32::NAN, "is NaN"), (f32::INFINITY, "is inf")] {
        let t = TempDir::new().unwrap();
        write_tiny_generic(&t.path().join("data"));
        set_feature(&t.path().join("data"), 5, 2, v);
        write_job(t.path(), "job.yaml", JOB);
        let out = physalia(t.path(), ["submit", "job.yaml"]);
        out.one_line_error(&[
            "dataset.path",
            "tensor 'features': row 5 column 2",
            says,
            "finite",
        ]);
        assert!(
            job_dirs(&t.path().join("jobs")).is_empty(),
            "nothing written"
        );
        // plan reads the same dataset and says the same
        physalia(t.path(), ["plan", "job.yaml"]).one_line_error(&["row 5 column 2"]);
    }
}

#[test]
fn an_empty_training_split_is_refused_before_the_job_starts() {
    let t = TempDir::new().unwrap();
    write_tiny_generic(&t.path().join("data"));
    fs::write(t.path().join("data/train_idx.txt"), "").unwrap();
    write_job(t.path(), "job.yaml", JOB);
    let out = physalia(t.path(), ["submit", "job.yaml"]);
    out.one_line_error(&["train_idx", "empty"]);
    assert!(
        job_dirs(&t.path().join("jobs")).is_empty(),
        "nothing written"
    );
}

#[test]
fn labels_outside_the_class_range_are_refused_naming_the_row() {
    let t = TempDir::new().unwrap();
    let data = t.path().join("data");
    write_tiny_generic(&data);
    // node 3's label is -5: neither a class nor -1 (unlabelled)
    let labels = fs::read_to_string(data.join("labels.csv"))
        .unwrap()
        .replace("\n3,1\n", "\n3,-5\n");
    assert!(labels.contains("3,-5"));
    fs::write(data.join("labels.csv"), labels).unwrap();
    write_job(t.path(), "job.yaml", JOB);
    for cmd in ["submit", "plan"] {
        physalia(t.path(), [cmd, "job.yaml"]).one_line_error(&["labels", "-5"]);
    }
    assert!(job_dirs(&t.path().join("jobs")).is_empty());
}

#[test]
fn overlapping_splits_are_refused_naming_the_node() {
    let t = TempDir::new().unwrap();
    let data = t.path().join("data");
    write_tiny_generic(&data);
    // node 2 is both a training and a test node
    fs::write(data.join("test_idx.txt"), "6\n2\n7\n").unwrap();
    write_job(t.path(), "job.yaml", JOB);
    physalia(t.path(), ["submit", "job.yaml"]).one_line_error(&[
        "node 2",
        "train_idx",
        "test_idx",
        "overlap",
    ]);
    assert!(job_dirs(&t.path().join("jobs")).is_empty());
}
