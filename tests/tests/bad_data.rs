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
