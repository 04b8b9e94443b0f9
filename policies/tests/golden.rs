//! Golden policy traces: for every example policy in `examples/policies/`, a metrics history
//! (`tests/golden/<name>.history.json`: the starting plan and the epoch records) is replayed
//! through `simulate`, and the decisions, one JSON object per epoch, must equal
//! `tests/golden/<name>.trace.jsonl` exactly. Bad policies in `tests/invalid/<name>.yaml` must
//! fail with exactly the messages of `tests/invalid/<name>.errors`.
//!
//! `UPDATE_GOLDEN=1 cargo test -p physalia-policies --test golden` rewrites the expected files;
//! review the diff before committing it.

use std::path::{Path, PathBuf};

use physalia_policies::{EpochRecord, PlanState, parse_str, simulate};
use serde::Deserialize;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn examples_dir() -> PathBuf {
    crate_dir().join("../examples/policies")
}

fn updating() -> bool {
    std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v != "0" && !v.is_empty())
}

/// Compares `actual` with the file at `expected`, or rewrites the file when updating.
fn check(expected: &Path, actual: &str) {
    if updating() {
        std::fs::write(expected, actual).unwrap();
        return;
    }
    let want = std::fs::read_to_string(expected).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with UPDATE_GOLDEN=1 to create it",
            expected.display()
        )
    });
    if want != actual {
        let first = want
            .lines()
            .zip(actual.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| want.lines().count().min(actual.lines().count()));
        panic!(
            "{} differs from the actual output at line {}:\n  expected: {}\n  actual:   {}\n\
             run with UPDATE_GOLDEN=1 to rewrite it, and review the diff",
            expected.display(),
            first + 1,
            want.lines().nth(first).unwrap_or("<end of file>"),
            actual.lines().nth(first).unwrap_or("<end of file>"),
        );
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Input {
    plan: PlanState,
    history: Vec<EpochRecord>,
}

fn yaml_stems(dir: &Path) -> Vec<String> {
    let mut stems: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    stems.sort();
    stems
}

fn trace_of(name: &str) -> String {
    let policy_path = examples_dir().join(format!("{name}.yaml"));
    let text = std::fs::read_to_string(&policy_path).unwrap();
    let policy = parse_str(&text, &format!("examples/policies/{name}.yaml"))
        .unwrap_or_else(|e| panic!("example policy {name} is invalid:\n{e}"));
    let input_path = crate_dir().join(format!("tests/golden/{name}.history.json"));
    let input: Input = serde_json::from_str(
        &std::fs::read_to_string(&input_path)
            .unwrap_or_else(|e| panic!("{}: {e}", input_path.display())),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", input_path.display()));
    let mut out = String::new();
    for decision in simulate(&policy, &input.history, &input.plan) {
        out.push_str(&serde_json::to_string(&decision).unwrap());
        out.push('\n');
    }
    out
}

#[test]
fn every_example_policy_has_a_golden_trace() {
    let names = yaml_stems(&examples_dir());
    assert!(names.len() >= 4, "examples: {names:?}");
    for name in names {
        let actual = trace_of(&name);
        check(
            &crate_dir().join(format!("tests/golden/{name}.trace.jsonl")),
            &actual,
        );
    }
}

#[test]
fn invalid_policies_fail_with_the_expected_errors() {
    let dir = crate_dir().join("tests/invalid");
    let names = yaml_stems(&dir);
    assert!(!names.is_empty());
    for name in names {
        let text = std::fs::read_to_string(dir.join(format!("{name}.yaml"))).unwrap();
        let errors = match parse_str(&text, &format!("{name}.yaml")) {
            Ok(_) => panic!("tests/invalid/{name}.yaml was accepted"),
            Err(errors) => errors,
        };
        for error in errors.errors() {
            assert!(
                error.location().is_some(),
                "{name}: error without a location: {error}"
            );
        }
        check(&dir.join(format!("{name}.errors")), &format!("{errors}\n"));
    }
}
