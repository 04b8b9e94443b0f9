//! A job resolved once: the job file (its goal applied) and everything the drivers derive from it,
//! computed here and passed down instead of recomputed from the raw spec by each driver.

use anyhow::{Context, Result};
use physalia_backends::{Demand, GpuRequest};
use physalia_planner::{Catalog, Sku};

use crate::spec::{JobSpec, Priced};

/// A job ready to run: its spec, the SKU its workers run on with its catalog price, and the GPUs each
/// worker asks its platform for. Its platform is `driver::platform::of_job` (the registry imports this
/// module, not the other way).
pub struct ResolvedJob {
    pub spec: JobSpec,
    /// The SKU's name and its price a worker-second, which every epoch's `usd` and the ledger use.
    pub priced: Priced,
    /// The catalog's entry for that SKU: what a container or pod of it gets (`placement`).
    pub sku: Sku,
    /// `resources.gpu`, else one GPU of a GPU SKU; `None`: CPU workers.
    pub gpu: Option<GpuRequest>,
}

impl ResolvedJob {
    /// Resolves `spec`, which validation accepted (a `goal:` job after the planner chose its SKU).
    pub fn new(spec: JobSpec) -> Result<ResolvedJob> {
        let catalog = Catalog::builtin();
        let priced = spec
            .backend
            .priced(&catalog, None)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let sku = catalog
            .get(&priced.sku)
            .with_context(|| format!("the SKU {} is not in the catalog", priced.sku))?
            .clone();
        let gpu = match spec.resources.as_ref().and_then(|r| r.gpu.as_ref()) {
            Some(g) => Some(GpuRequest {
                count: g.count,
                kind: g.model.clone(),
            }),
            None => sku.gpu.as_ref().map(|gpu| GpuRequest {
                count: 1,
                kind: Some(gpu.model.clone()),
            }),
        };
        Ok(ResolvedJob {
            spec,
            priced,
            sku,
            gpu,
        })
    }

    /// What the job asks of its platform at its peak, for the preflight's quota and capacity checks:
    /// the scaling policy's `max_workers` (else `workers`), each on the SKU's share of a machine; with
    /// a `prewarm` on a resize that restarts, a launch of up to `max_workers` started while one of up to
    /// `max_workers - 1` runs (in place only the joiners start: the peak stays `max_workers`). A
    /// dataset folder counts as one that restarts (a chunked dataset does; a raw folder is imported).
    pub fn demand(&self) -> Demand {
        let policy = self.spec.scaling.as_ref();
        let workers = policy.map_or(self.spec.workers, |p| p.max_workers.max(self.spec.workers));
        let folder = self.spec.dataset.path.as_ref().is_some_and(|p| p.is_dir());
        let in_place = self.spec.resizes_in_place(folder);
        let prewarm = policy.is_some_and(|p| p.prewarm.is_some() && !in_place);
        Demand {
            workers: workers.max(1),
            overlap_workers: if prewarm { workers.max(1) - 1 } else { 0 },
            machine_vcpus: self.sku.vcpus,
        }
    }
}
