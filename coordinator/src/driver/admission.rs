//! Memory admission: before a job writes anything or launches a worker, the planner's predicted memory per
//! worker is checked against what the workers will have. On `local` and `docker` every worker shares this
//! machine, so the job must fit in its available memory (`MemAvailable`); a job that cannot fit is refused
//! with the numbers and the largest term, instead of dying in an allocation abort or the OOM killer mid-run.
//!
//! The prediction is the planner's (`physalia plan JOB --as-written` shows it in full); it errs high, so
//! `submit --skip-memory-check` runs a job anyway. GPU workers (`resources.gpu`) keep their activations on
//! the device and are not checked against host memory here.

use anyhow::{Result, bail};
use physalia_planner::Catalog;

use crate::driver::dataset::Source;
use crate::driver::resolved::ResolvedJob;

const GIB: f64 = (1u64 << 30) as f64;

/// Refuses `job` when its workers, all on this machine, would need more than `available` bytes.
pub fn check(job: &ResolvedJob, source: &Source, available: Option<f64>) -> Result<()> {
    let spec = &job.spec;
    let on_this_machine = spec.backend.name.on_this_machine();
    let gpu = job.gpu.is_some();
    let Some(available) = available.filter(|_| on_this_machine && !gpu) else {
        return Ok(());
    };
    let req = crate::driver::plan::request(spec, source)?;
    // the local SKU describes the development machine; this one has what /proc/meminfo says
    let mut catalog = Catalog::builtin();
    for sku in catalog.skus.iter_mut().filter(|s| s.name == "local") {
        sku.memory_gib = available / GIB;
    }
    let w = crate::driver::plan::as_written(spec, &req, &catalog, Some("local"), None)?;
    let m = &w.prediction.memory;
    if m.host_bytes <= m.host_usable_bytes {
        return Ok(());
    }
    let workers = f64::from(spec.workers);
    let terms = [
        ("activations", m.activations_bytes),
        ("features", m.features_bytes),
        ("graph structure", m.structure_bytes),
        ("halo rows", m.halo_bytes),
        ("weights and optimizer state", m.optimizer_bytes),
        ("cached rows", m.cache_bytes),
        ("process runtime", m.runtime_bytes),
    ];
    let (largest, largest_bytes) = terms
        .iter()
        .copied()
        .fold(("", f64::MIN), |a, b| if b.1 > a.1 { b } else { a });
    let gib = |b: f64| format!("{:.1} GiB", b / GIB);
    bail!(
        "the job does not fit in this machine's memory: each of its {} worker(s) needs about {} (the \
         planner's estimate; the largest part is {largest}: {}), {} in all, and this machine has {} \
         available. Make the model smaller (model.hidden, model.layers, model.heads), use mini-batches \
         (parallelism: data), or run on a larger machine; `physalia plan JOB --as-written` shows the \
         whole estimate, and `submit --skip-memory-check` runs it anyway",
        spec.workers,
        gib(m.host_bytes),
        gib(largest_bytes),
        gib(m.host_bytes * workers),
        gib(available)
    )
}
