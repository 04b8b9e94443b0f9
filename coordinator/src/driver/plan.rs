//! The planner for a job: its request (graph statistics, the partitionings stored beside its dataset, model,
//! training, goal), the prediction for the job as written, the goal's choice applied to the job, and the
//! replan of a running job from what its workers measured.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use physalia_graph::FeatureDtype;
use physalia_graph::partition::{ArtifactStatus, PartitionMeta, PartitionSummary};
use physalia_planner::{
    CalibrationProfile, Candidate, Catalog, Constraints, ExchangeOptions, GraphStats, ModelShape,
    PartitionStats, PlanRequest, Prediction, RowDtype, Sku, TrainShape,
};
use serde::Serialize;

use crate::driver::Observer;
use crate::driver::dataset::{self, Source};
use crate::spec::{self, JobSpec, Objective};

/// The planner's graph of `dataset.stats` (f32 features).
pub fn stats_graph(st: &spec::StatsSpec) -> GraphStats {
    GraphStats {
        nodes: st.nodes,
        edges: st.edges,
        feat_dim: st.feat_dim,
        classes: st.classes,
        train_nodes: st.train_nodes,
        feature_bytes_per_value: 4,
        chunked: false,
    }
}

/// The planner's view of a job: graph statistics, stored partitionings, model, training and goal.
pub fn request(spec: &JobSpec, source: &Source) -> Result<PlanRequest> {
    let stats = source.stats();
    let graph = GraphStats {
        nodes: stats.num_nodes as u64,
        edges: stats.num_edges as u64,
        feat_dim: stats.feat_dim as u32,
        classes: stats.num_classes as u32,
        train_nodes: source.train_nodes() as u64,
        feature_bytes_per_value: match stats.feature_dtype {
            FeatureDtype::F32 => 4,
            FeatureDtype::F16 | FeatureDtype::BF16 => 2,
        },
        chunked: source.is_chunked(),
    };
    let partitions = match (&spec.dataset.path, source) {
        (Some(path), Source::File(_) | Source::Chunked(_)) => one_per_part_count(
            physalia_graph::partition::list_partitions(path).unwrap_or_default(),
            spec.train.seed,
        ),
        _ => Vec::new(),
    };
    let mut req = request_from(spec, graph, partitions)?;
    // a job on this machine partitions in this process: its memory, not a cluster coordinator's
    if spec.backend.name.on_this_machine()
        && let Some(bytes) = crate::driver::memory::partition_memory_bytes()
    {
        req.constraints.coordinator_memory_gib = Some(bytes / f64::from(1u32 << 30));
    }
    // a chunked dataset trains only partition-parallel (data and model parallelism ship the whole file)
    if source.is_chunked() {
        req.constraints.modes = vec![physalia_planner::Mode::Partition];
    }
    Ok(req)
}

/// The planner's measured partitionings from the sets stored beside a dataset: one per part count (the
/// planner refuses two), the job's own seed's where it is stored (the set the job will train on), else
/// the lowest seed's. Jobs with other seeds leave sets of the same part count beside the dataset.
fn one_per_part_count(stored: Vec<PartitionSummary>, seed: u64) -> Vec<PartitionStats> {
    // part count -> (seed, its partitioning)
    let mut chosen: BTreeMap<usize, (u64, PartitionMeta)> = BTreeMap::new();
    for set in stored {
        if set.status != ArtifactStatus::Current {
            continue;
        }
        let Some(meta) = set.meta else { continue };
        let better = match chosen.get(&set.k) {
            None => true,
            Some(&(kept, _)) => kept != seed && (set.seed == seed || set.seed < kept),
        };
        if better {
            chosen.insert(set.k, (set.seed, meta));
        }
    }
    chosen
        .into_values()
        .map(|(_, m)| PartitionStats {
            parts: m.k as u32,
            edge_cut: m.edge_cut as u64,
            owned_rows: m.parts.iter().map(|p| p.n_owned as u64).collect(),
            halo_rows: m.parts.iter().map(|p| p.n_halo as u64).collect(),
            local_edges: m.parts.iter().map(|p| p.n_local_edges as u64).collect(),
        })
        .collect()
}

/// [`request`] from the graph's statistics and its stored partitionings.
pub fn request_from(
    spec: &JobSpec,
    graph: GraphStats,
    partitions: Vec<PartitionStats>,
) -> Result<PlanRequest> {
    let model = serde_json::from_value::<ModelShape>(serde_json::json!({
        "kind": spec.model.kind,
        "layers": spec.model.layers,
        "hidden": spec.model.hidden,
        "heads": spec.model.heads.unwrap_or(8),
        "out_heads": spec.model.out_heads.unwrap_or(1),
        "input_dropout": spec.model.input_dropout.unwrap_or(spec.model.dropout),
    }))
    .context("describing the model to the planner")?;
    let mb = spec.minibatch.clone().unwrap_or_default();
    let mut train: TrainShape = serde_json::from_value(serde_json::json!({
        "epochs": spec.train.epochs,
        "batch_size": mb.batch_size,
        "fanouts": mb.fanouts_for(spec.model.layers),
        "eval_every": spec.train.eval_every,
    }))
    .context("describing the training to the planner")?;
    train.cache_rows = spec.minibatch.as_ref().map(|m| m.cache_rows);
    train.exchange = exchange_options(spec);
    let goal = spec.goal.clone().unwrap_or_default();
    let constraints: Constraints = serde_json::from_value(serde_json::json!({
        "max_workers": goal.max_workers,
        "budget_usd": goal.budget_usd,
        "deadline_s": goal.deadline_s,
        "objective": match goal.objective {
            Objective::MinCost => "min_cost",
            Objective::MinTime => "min_time",
            Objective::Deadline => "deadline",
            Objective::Budget => "budget",
        },
        "backends": goal.backends,
        "allow_inexact_exchange": goal.allow_inexact_exchange,
    }))
    .context("goal")?;
    Ok(PlanRequest {
        graph,
        partitions,
        model,
        train,
        constraints,
        assumptions: Default::default(),
    })
}

/// The job's halo exchange options as the planner's (exact when the job has no `exchange:`).
fn exchange_options(spec: &JobSpec) -> ExchangeOptions {
    use crate::spec::ExchangeDtype;
    match &spec.exchange {
        None => ExchangeOptions::default(),
        Some(x) => ExchangeOptions {
            boundary_sampling: x.boundary_sampling,
            staleness: x.staleness,
            dtype: match x.dtype {
                ExchangeDtype::F32 => RowDtype::F32,
                ExchangeDtype::F16 => RowDtype::F16,
                ExchangeDtype::Bf16 => RowDtype::Bf16,
            },
            rematerialize: x.rematerialize,
        },
    }
}

/// What `physalia plan --as-written` prints: the job's own settings as a candidate, the SKU it runs on, and
/// the cost model's prediction for it.
#[derive(Serialize)]
pub struct AsWritten {
    pub candidate: Candidate,
    pub sku: Sku,
    pub prediction: Prediction,
    /// Whether a calibration profile replaced the catalog's rates (local SKUs).
    pub calibrated: bool,
    /// The partition step before the launch, when the job partitions its graph.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partition: Option<physalia_planner::PartitionStep>,
}

/// The planner's prediction for the job's own settings on its backend's SKU.
pub fn as_written(
    spec: &JobSpec,
    req: &PlanRequest,
    catalog: &Catalog,
    sku: Option<&str>,
    calibration: Option<&CalibrationProfile>,
) -> Result<AsWritten> {
    use crate::spec::ParallelismSpec;
    let backend = spec.backend.name;
    // `--sku`, else the SKU the job's section names (local and docker: this machine)
    let sku = match sku.or(spec.backend.sku()) {
        Some(name) => catalog
            .get(name)
            .with_context(|| format!("--sku: no SKU named `{name}` in the catalog"))?,
        None => {
            let of_backend: Vec<&Sku> = catalog
                .skus
                .iter()
                .filter(|s| s.backend == backend.sku_platform())
                .collect();
            match of_backend[..] {
                [one] => one,
                [] => anyhow::bail!(
                    "the catalog has no SKU for the backend `{}`; name one with --sku, or add one \
                     with --catalog",
                    backend.as_str(),
                ),
                _ => anyhow::bail!(
                    "the backend `{}` has {} SKUs in the catalog ({}); pick one with --sku",
                    backend.as_str(),
                    of_backend.len(),
                    of_backend
                        .iter()
                        .map(|s| s.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }
        }
    };
    let mode = spec.mode();
    let replicas = match spec.parallelism {
        ParallelismSpec::Groups(g) => g.replicas,
        ParallelismSpec::Mode(_) => 1,
    };
    let candidate = Candidate {
        mode,
        workers: spec.workers,
        parts: spec.parts(),
        replicas,
        sku: sku.name.clone(),
        backend: sku.backend,
        exchange: req.train.exchange.clone(),
        cache_rows: req.train.cache_rows.unwrap_or(0),
    };
    let prediction = physalia_planner::predict(req, sku, &candidate, calibration)
        .context("predicting the job as written")?;
    let candidate = Candidate {
        cache_rows: prediction.cache_rows,
        ..candidate
    };
    let partition = physalia_planner::partition_step(req, &candidate, &prediction);
    Ok(AsWritten {
        candidate,
        sku: sku.clone(),
        prediction,
        calibrated: calibration.is_some() && sku.backend.on_this_machine(),
        partition,
    })
}

/// With a `goal:` section, `submit` runs what the planner chooses on the job's backend: the mode, the
/// worker count (parts and replicas), the exchange options and the data-parallel cache. Returns the
/// adjusted job and one line saying what was chosen.
pub fn apply_goal(spec: &JobSpec, obs: &dyn Observer) -> Result<Option<(JobSpec, String)>> {
    let Some(goal) = &spec.goal else {
        return Ok(None);
    };
    let source = dataset::load(&spec.dataset, obs)?;
    let mut req = request(spec, &source)?;
    drop(source);
    // only the backend the job runs on
    req.constraints.backends = vec![spec.backend.name];
    let name = req.constraints.backends[0].as_str();
    if !goal.backends.is_empty() && !goal.backends.iter().any(|b| b == name) {
        anyhow::bail!(
            "goal.backends {:?} does not include the job's backend `{name}`; submit runs on `backend:`",
            goal.backends
        );
    }
    // a SKU the job's section names is the only one the planner may pick
    let mut catalog = Catalog::builtin();
    if let Some(sku) = spec.backend.sku() {
        catalog.skus.retain(|s| s.name == sku);
    }
    let plan = physalia_planner::plan(&req, &catalog, None)?;
    let out = apply_choice(spec, &plan.chosen.candidate)?;
    let c = &plan.chosen.candidate;
    let p = &plan.chosen.prediction;
    let line = format!(
        "plan ({}): {} on {} x {} — predicted {:.3} s per epoch, ${:.4} in all (`physalia plan` explains)",
        serde_json::to_value(goal.objective)?
            .as_str()
            .unwrap_or("?"),
        c.kind(),
        c.workers,
        c.sku,
        p.time.epoch_s,
        p.usd_total
    );
    Ok(Some((out, line)))
}

/// The job file with the planner's choice `c` applied: the mode, the worker count (parts and replicas), the
/// exchange options and the data-parallel cache.
fn apply_choice(spec: &JobSpec, c: &Candidate) -> Result<JobSpec> {
    use crate::spec::{ExchangeDtype, ExchangeSpec, GroupsSpec, Parallelism, ParallelismSpec};
    use physalia_planner::RowDtype;
    let mut out = spec.clone();
    out.workers = c.workers;
    // the container the planner chose is the one the job is billed at
    out.backend.set_sku(&c.sku);
    let mode = c.mode;
    out.parallelism = if c.replicas > 1 {
        ParallelismSpec::Groups(GroupsSpec {
            partition: (mode == Parallelism::Partition).then_some(c.parts),
            data: (mode == Parallelism::Data).then_some(c.parts),
            replicas: c.replicas,
        })
    } else {
        ParallelismSpec::Mode(mode)
    };
    if mode == Parallelism::Partition {
        out.minibatch = None;
        let x = &c.exchange;
        let exact = x.boundary_sampling >= 1.0
            && x.staleness == 0
            && x.dtype == RowDtype::F32
            && !x.rematerialize;
        out.exchange = (!exact).then(|| ExchangeSpec {
            boundary_sampling: x.boundary_sampling,
            staleness: x.staleness,
            rematerialize: x.rematerialize,
            dtype: match x.dtype {
                RowDtype::F32 => ExchangeDtype::F32,
                RowDtype::F16 => ExchangeDtype::F16,
                RowDtype::Bf16 => ExchangeDtype::Bf16,
            },
            ..spec.exchange.clone().unwrap_or_default()
        });
    } else {
        out.exchange = None;
        let mut mb = spec.minibatch.clone().unwrap_or_default();
        mb.cache_rows = c.cache_rows;
        out.minibatch = Some(mb);
    }
    out.validate()
        .context("the planner's choice does not fit the job file")?;
    Ok(out)
}

/// A running job's plan again, under `objective`, from what its workers measured in one epoch
/// (`by_rank`): the planner's model of this machine is scaled so that it predicts the measured compute and
/// network time of the job as it runs (`spec`, read from `dataset`), then every candidate is ranked with
/// it, between `min_workers` and `max_workers`. Returns the job with the choice applied and a line on why.
pub fn replan(
    spec: &JobSpec,
    dataset: &std::path::Path,
    objective: physalia_policies::Objective,
    by_rank: &[physalia_gnn::EpochMetrics],
    max_workers: u32,
) -> Result<(JobSpec, String)> {
    let source = match physalia_graph::is_chunked(dataset) {
        true => Source::Chunked(
            physalia_graph::ChunkedDataset::open(dataset)
                .with_context(|| format!("reading {}", dataset.display()))?,
        ),
        false => Source::File(
            physalia_graph::Dataset::open_unverified(dataset)
                .with_context(|| format!("reading {}", dataset.display()))?,
        ),
    };
    let mut file = spec.clone();
    file.dataset.path = Some(dataset.to_path_buf());
    let mut req = request(&file, &source)?;
    drop(source);
    req.constraints.backends = vec![spec.backend.name];
    req.constraints.max_workers = max_workers;
    // the job resizes within one mode: replica groups are chosen at submit only
    req.constraints.hybrids = false;
    req.constraints.objective = match objective {
        physalia_policies::Objective::MinCost => physalia_planner::Objective::MinCost,
        physalia_policies::Objective::MinTime => physalia_planner::Objective::MinTime,
    };
    req.constraints.budget_usd = None;
    req.constraints.deadline_s = None;
    let catalog = Catalog::builtin();
    let base = CalibrationProfile::dev_vm_2026_11();
    let now = as_written(spec, &req, &catalog, None, Some(&base))?;
    // what the model predicted for the job as it runs, against what its workers measured
    let t = &now.prediction.time;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let compute = median(
        by_rank
            .iter()
            .map(|m| (m.train_s - m.exchange.halo_s - m.exchange.all_reduce_s).max(0.0))
            .collect(),
    );
    let network = median(
        by_rank
            .iter()
            .map(|m| m.exchange.halo_s + m.exchange.all_reduce_s)
            .collect(),
    );
    let ratio = |measured: f64, predicted: f64| {
        if measured > 0.0 && predicted > 0.0 {
            (measured / predicted).clamp(0.01, 100.0)
        } else {
            1.0
        }
    };
    let fc = ratio(compute, t.compute_s + t.sample_s);
    let fnet = ratio(network, t.exchange_s + t.allreduce_s);
    let profile = CalibrationProfile {
        gemm_gflop_s: base.gemm_gflop_s / fc,
        spmm_gb_s: base.spmm_gb_s / fc,
        stream_gb_s: base.stream_gb_s / fc,
        sampler_edges_per_s: base.sampler_edges_per_s / fc,
        loopback_gbit_s: base.loopback_gbit_s / fnet,
        loopback_latency_us: base.loopback_latency_us * fnet,
        ..base
    };
    let plan = physalia_planner::plan(&req, &catalog, Some(&profile))?;
    let out = apply_choice(spec, &plan.chosen.candidate)?;
    let why = format!(
        "measured compute {compute:.3} s and network {network:.3} s per epoch, {fc:.2}x and {fnet:.2}x the \
         model's; predicted {:.3} s per epoch",
        plan.chosen.prediction.time.epoch_s
    );
    Ok((out, why))
}
