//! Golden plans: every job in `tests/golden/<name>.yaml` (catalogs, an optional calibration
//! profile, and a plan request) is planned, and the rendered plan (or the error) must equal
//! `tests/golden/<name>.plan.txt`. Bad catalogs in `tests/invalid/<name>.yaml` must fail with
//! exactly the message of `tests/invalid/<name>.error`, placed at a line and column.
//!
//! `UPDATE_GOLDEN=1 cargo test -p physalia-planner --test golden` rewrites the expected
//! files; review the diff before committing it.

use std::path::{Path, PathBuf};

use physalia_planner::{CalibrationProfile, Catalog, PlanError, PlanRequest, plan};
use serde::Deserialize;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
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

/// A golden job: which catalogs (`builtin` or a path relative to the crate), which profile
/// (`dev-vm` for the built-in one, or a path), and the request.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Job {
    catalogs: Vec<String>,
    #[serde(default)]
    calibration: Option<String>,
    request: serde_json::Value,
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

fn load_catalog(names: &[String]) -> Catalog {
    let mut catalog = Catalog::default();
    for name in names {
        let part = if name == "builtin" {
            Catalog::builtin()
        } else {
            let text = std::fs::read_to_string(crate_dir().join(name)).unwrap();
            Catalog::from_yaml_str(&text, name).unwrap_or_else(|e| panic!("{e}"))
        };
        catalog = catalog.merge(part).unwrap_or_else(|e| panic!("{e}"));
    }
    catalog
}

fn load_profile(name: &str) -> CalibrationProfile {
    if name == "dev-vm" {
        return CalibrationProfile::dev_vm_2026_11();
    }
    let text = std::fs::read_to_string(crate_dir().join(name)).unwrap();
    CalibrationProfile::from_yaml_str(&text, name).unwrap_or_else(|e| panic!("{e}"))
}

/// The job's plan as text, or `error: ...`.
pub fn plan_text(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let job: Job =
        serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let request: PlanRequest = serde_json::from_value(job.request)
        .unwrap_or_else(|e| panic!("{}: request: {e}", path.display()));
    let catalog = load_catalog(&job.catalogs);
    let profile = job.calibration.as_deref().map(load_profile);
    match plan(&request, &catalog, profile.as_ref()) {
        Ok(p) => p.render(),
        Err(e) => format!("error: {e}\n"),
    }
}

#[test]
fn every_golden_job_plans_as_recorded() {
    let dir = crate_dir().join("tests/golden");
    let names = yaml_stems(&dir);
    assert!(names.len() >= 6, "golden jobs: {names:?}");
    for name in names {
        let actual = plan_text(&dir.join(format!("{name}.yaml")));
        check(&dir.join(format!("{name}.plan.txt")), &actual);
    }
}

#[test]
fn bad_catalogs_fail_with_located_errors() {
    let dir = crate_dir().join("tests/invalid");
    let names = yaml_stems(&dir);
    assert!(names.len() >= 5, "invalid catalogs: {names:?}");
    for name in names {
        let text = std::fs::read_to_string(dir.join(format!("{name}.yaml"))).unwrap();
        let origin = format!("{name}.yaml");
        let err = match Catalog::from_yaml_str(&text, &origin) {
            Ok(_) => panic!("tests/invalid/{name}.yaml was accepted"),
            Err(e) => e,
        };
        assert!(
            matches!(err, PlanError::Parse { .. }) && err.location().is_some(),
            "{name}: not a located parse error: {err}"
        );
        let message = err.to_string();
        assert!(
            !message.contains('\n'),
            "{name}: more than one line: {message}"
        );
        check(&dir.join(format!("{name}.error")), &format!("{message}\n"));
    }
}
