//! Scaling policies in job files: `physalia validate` accepts every example policy (inline or as a file) and
//! reports every problem of a bad one with its file, line and column; a policy on a mode that cannot rescale
//! yet is refused instead of ignored.

use physalia_tests::{physalia, repo_root, write_job};
use tempfile::TempDir;

const JOB: &str = "\
dataset:
  synth:
    kind: sbm
    nodes: 500
    classes: 4
    feat_dim: 8
    avg_degree: 5
model:
  kind: gcn
  layers: 2
  hidden: 8
";

#[test]
fn every_example_policy_validates_as_a_file_and_inline() {
    let t = TempDir::new().unwrap();
    let dir = repo_root().join("examples/policies");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        n += 1;
        let policy = std::fs::read_to_string(&path).unwrap();
        // start at the policy's smallest size
        let min = policy
            .lines()
            .find_map(|l| l.strip_prefix("min_workers:"))
            .map(|v| v.split('#').next().unwrap().trim().to_string())
            .unwrap_or("1".into());
        let job = format!("{JOB}workers: {min}\n");
        std::fs::write(t.path().join("policy.yaml"), &policy).unwrap();
        write_job(
            t.path(),
            "file.yaml",
            &format!("{job}scaling_file: policy.yaml\n"),
        );
        physalia(t.path(), ["validate", "file.yaml"]).ok();
        let inline: String = policy.lines().map(|l| format!("  {l}\n")).collect();
        write_job(t.path(), "inline.yaml", &format!("{job}scaling:\n{inline}"));
        physalia(t.path(), ["validate", "inline.yaml"]).ok();
    }
    assert!(n >= 4, "found {n} example policies");
}

#[test]
fn bad_policies_fail_validate_with_line_and_column() {
    let t = TempDir::new().unwrap();
    // an unknown metric (line 5) and min above max (line 1), in a file and inline
    let policy = "min_workers: 8\nmax_workers: 2\nrules:\n  - name: grow\n    when: loss_delta > 0.1\n    then: {multiply_workers: 2}\n";
    std::fs::write(t.path().join("bad.yaml"), policy).unwrap();
    write_job(
        t.path(),
        "file.yaml",
        &format!("{JOB}scaling_file: bad.yaml\n"),
    );
    let out = physalia(t.path(), ["validate", "file.yaml"]);
    assert!(!out.success());
    let line = out.one_line_error(&["bad.yaml:5:11", "loss_delta", "delta_loss"]);
    assert!(
        line.contains("bad.yaml:1:") || line.contains("bad.yaml:2:"),
        "{line}"
    );
    let inline: String = policy.lines().map(|l| format!("  {l}\n")).collect();
    write_job(t.path(), "inline.yaml", &format!("{JOB}scaling:\n{inline}"));
    let out = physalia(t.path(), ["validate", "inline.yaml"]);
    assert!(!out.success());
    // the job's 11 lines and `scaling:` come first; the condition is on the policy's line 5
    out.one_line_error(&["inline.yaml:17:13", "loss_delta"]);
    // a CEL syntax error
    std::fs::write(
        t.path().join("bad.yaml"),
        "max_workers: 4\nrules:\n  - name: r\n    when: loss >\n    then: stop\n",
    )
    .unwrap();
    let out = physalia(t.path(), ["validate", "file.yaml"]);
    assert!(!out.success());
    out.one_line_error(&["bad.yaml:4:"]);
    // a missing policy file names it
    write_job(
        t.path(),
        "missing.yaml",
        &format!("{JOB}scaling_file: nope.yaml\n"),
    );
    let out = physalia(t.path(), ["validate", "missing.yaml"]);
    assert!(!out.success());
    out.one_line_error(&["nope.yaml"]);
}

#[test]
fn policies_on_modes_that_cannot_rescale_are_refused_and_nothing_is_written() {
    // data and model parallelism rescale now (they checkpoint every epoch); replica groups cannot, since a
    // resize may pick a count that is no multiple of their parts
    let t = TempDir::new().unwrap();
    let policy =
        std::fs::read_to_string(repo_root().join("examples/policies/double-on-plateau.yaml"))
            .unwrap();
    std::fs::write(t.path().join("policy.yaml"), policy).unwrap();
    write_job(
        t.path(),
        "job.yaml",
        &format!(
            "{JOB}workers: 4\nparallelism: {{data: 2, replicas: 2}}\nscaling_file: policy.yaml\n\
             output:\n  dir: jobs\n"
        ),
    );
    let out = physalia(t.path(), ["submit", "job.yaml"]);
    assert!(!out.success());
    out.one_line_error(&["scaling", "replica groups"]);
    assert!(!t.path().join("jobs").exists());
}
