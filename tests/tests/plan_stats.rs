//! Planning a graph that is not on this machine: `dataset: {stats: ...}` with the sizes, or an OGB
//! node-property dataset by name; `submit` refuses such a job, naming what it needs.

use physalia_tests::{job_dirs, physalia, write_job};
use tempfile::TempDir;

const MODEL: &str =
    "model: {kind: sage, layers: 2, hidden: 256}\ngoal: {objective: min_cost, max_workers: 64}\n";

#[test]
fn ogbn_papers100m_is_planned_by_name_with_alternatives_and_rejections() {
    let t = TempDir::new().unwrap();
    write_job(
        t.path(),
        "papers.yaml",
        &format!("dataset: {{stats: ogbn-papers100M}}\n{MODEL}"),
    );
    let out = physalia(t.path(), ["plan", "papers.yaml"]).ok();
    let text = out.stdout;
    for part in [
        "plan (min_cost):",
        "why:",
        "alternatives (",
        "rejected (",
        "does not fit",
    ] {
        assert!(text.contains(part), "{part:?} missing from:\n{text}");
    }
    let v = physalia(t.path(), ["plan", "papers.yaml", "--output", "json"])
        .ok()
        .last_json();
    assert!(
        v["chosen"]["candidate"]["workers"].as_u64().unwrap() > 1,
        "{v}"
    );
}

#[test]
fn statistics_given_by_hand_are_planned_and_checked() {
    let t = TempDir::new().unwrap();
    write_job(
        t.path(),
        "mine.yaml",
        &format!(
            "dataset:\n  stats: {{nodes: 5000000, edges: 100000000, feat_dim: 256, classes: 10, train_nodes: 500000}}\n{MODEL}"
        ),
    );
    physalia(t.path(), ["plan", "mine.yaml"]).ok();
    physalia(t.path(), ["validate", "mine.yaml"]).ok();
    let bad = [
        (
            "train_nodes: 500000}",
            "train_nodes: 6000000}",
            "dataset.stats.train_nodes",
        ),
        ("classes: 10", "classes: 1", "dataset.stats.classes"),
        ("nodes: 5000000,", "nodes: 0,", "dataset.stats.nodes"),
    ];
    let text = std::fs::read_to_string(t.path().join("mine.yaml")).unwrap();
    for (from, to, field) in bad {
        write_job(t.path(), "bad.yaml", &text.replacen(from, to, 1));
        physalia(t.path(), ["plan", "bad.yaml"]).one_line_error(&[field]);
    }
    write_job(
        t.path(),
        "unknown.yaml",
        &format!("dataset: {{stats: ogbn-mag}}\n{MODEL}"),
    );
    physalia(t.path(), ["plan", "unknown.yaml"]).one_line_error(&["ogbn-mag", "ogbn-papers100M"]);
}

#[test]
fn submit_refuses_a_graph_given_by_statistics_and_writes_nothing() {
    let t = TempDir::new().unwrap();
    write_job(
        t.path(),
        "arxiv.yaml",
        "dataset: {stats: ogbn-arxiv}\nmodel: {kind: gcn, hidden: 16}\noutput: {dir: jobs}\n",
    );
    physalia(t.path(), ["submit", "arxiv.yaml"]).one_line_error(&[
        "dataset.stats",
        "ogbn-arxiv",
        "dataset.path",
    ]);
    assert!(job_dirs(&t.path().join("jobs")).is_empty());
}

/// Issue 29 (c): an OGB dataset's name written as a path that is not here points to the
/// `{stats: NAME}` form that plans it, in `plan` and in `submit` (it said "no such directory").
#[test]
fn issue_29_a_known_dataset_name_as_a_missing_path_names_the_stats_form() {
    let t = TempDir::new().unwrap();
    write_job(
        t.path(),
        "papers.yaml",
        &format!("dataset: ogbn-papers100M\n{MODEL}output: {{dir: jobs}}\n"),
    );
    for command in ["plan", "submit"] {
        physalia(t.path(), [command, "papers.yaml"]).one_line_error(&[
            "dataset.path",
            "ogbn-papers100M",
            "no such file or directory",
            "{stats: ogbn-papers100M}",
        ]);
    }
    // OGB's own folder name (`ogbn_papers100M`) is the same dataset
    write_job(
        t.path(),
        "folder.yaml",
        &format!("dataset: data/ogbn_papers100M\n{MODEL}"),
    );
    physalia(t.path(), ["plan", "folder.yaml"]).one_line_error(&["{stats: ogbn-papers100M}"]);
    // a name that is no known dataset says only what is missing
    write_job(
        t.path(),
        "mine.yaml",
        &format!("dataset: my-graph\n{MODEL}"),
    );
    let line = physalia(t.path(), ["plan", "mine.yaml"]).one_line_error(&[
        "dataset.path",
        "my-graph",
        "no such file or directory",
    ]);
    assert!(!line.contains("stats:"), "{line}");
    assert!(job_dirs(&t.path().join("jobs")).is_empty());
}
