//! Memory admission: a job the planner predicts cannot fit in this machine's memory is refused before
//! anything is written or launched, with the numbers and the largest term; `--skip-memory-check` overrides.

use physalia_tests::{job_dirs, physalia, write_job};
use tempfile::TempDir;

#[test]
fn a_job_too_big_for_this_machine_is_refused_with_the_numbers_and_writes_nothing() {
    let t = TempDir::new().unwrap();
    // 200k nodes x 128 features and a 1M-wide hidden layer: terabytes of activations
    write_job(
        t.path(),
        "big.yaml",
        "name: big\ndataset:\n  synth: {kind: sbm, nodes: 200000, classes: 4, avg_degree: 5, feat_dim: 128, seed: 1}\n\
         model: {kind: gcn, hidden: 1000000}\ntrain: {epochs: 2}\noutput: {dir: jobs}\n",
    );
    let out = physalia(t.path(), ["submit", "big.yaml"]);
    let line = out.one_line_error(&[
        "does not fit in this machine's memory",
        "the largest part is activations",
        "GiB available",
        "--skip-memory-check",
    ]);
    assert!(line.contains("needs about"), "{line}");
    // nothing was written: no job directory, no worker started
    assert!(job_dirs(&t.path().join("jobs")).is_empty());
}

#[test]
fn a_job_that_fits_runs_and_the_check_can_be_skipped() {
    let t = TempDir::new().unwrap();
    write_job(
        t.path(),
        "small.yaml",
        "name: small\ndataset:\n  synth: {kind: sbm, nodes: 500, classes: 3, avg_degree: 5, feat_dim: 8, seed: 1}\n\
         model: {kind: gcn, hidden: 8}\ntrain: {epochs: 2}\noutput: {dir: jobs}\n",
    );
    physalia(t.path(), ["submit", "small.yaml", "-q"]).ok();
    physalia(
        t.path(),
        ["submit", "small.yaml", "-q", "--skip-memory-check"],
    )
    .ok();
    assert_eq!(job_dirs(&t.path().join("jobs")).len(), 2);
}
