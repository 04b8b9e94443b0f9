//! Plans a golden job file and prints the plan and how long planning took:
//! `cargo run -p physalia-planner --example plan -- planner/tests/golden/papers100m-sage-gpu.yaml`.

use std::time::Instant;

use physalia_planner::{CalibrationProfile, Catalog, PlanRequest, plan};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Job {
    catalogs: Vec<String>,
    #[serde(default)]
    calibration: Option<String>,
    request: serde_json::Value,
}

fn main() {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "planner/tests/golden/papers100m-sage-gpu.yaml".into());
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let job: Job = serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut catalog = Catalog::default();
    for c in &job.catalogs {
        let part = if c == "builtin" {
            Catalog::builtin()
        } else {
            // Paths in golden jobs are relative to the crate.
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(c);
            let t = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{c}: {e}"));
            Catalog::from_yaml_str(&t, c).unwrap_or_else(|e| panic!("{e}"))
        };
        catalog = catalog.merge(part).unwrap_or_else(|e| panic!("{e}"));
    }
    let profile = job.calibration.map(|c| {
        if c == "dev-vm" {
            CalibrationProfile::dev_vm_2026_11()
        } else {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(&c);
            let t = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{c}: {e}"));
            CalibrationProfile::from_yaml_str(&t, &c).unwrap_or_else(|e| panic!("{e}"))
        }
    });
    let request: PlanRequest =
        serde_json::from_value(job.request).unwrap_or_else(|e| panic!("{path}: {e}"));
    let start = Instant::now();
    let result = plan(&request, &catalog, profile.as_ref());
    let took = start.elapsed();
    match result {
        Ok(p) => print!("{}", p.render()),
        Err(e) => println!("error: {e}"),
    }
    eprintln!("planned in {:.1} ms", took.as_secs_f64() * 1e3);
}
