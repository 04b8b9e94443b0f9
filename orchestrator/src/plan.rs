//! `physalia plan`: the planner's answer for a job file, from the dataset's statistics and the partition sets
//! stored beside it, the built-in catalog (plus the user's) and, when given, a calibration profile.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use physalia_graph::{FeatureDtype, Split};
use physalia_planner::{
    CalibrationProfile, Catalog, Constraints, GraphStats, ModelShape, PartitionStats, PlanRequest,
    TrainShape,
};

use crate::OutputFormat;
use crate::dataset::{self, Source};
use crate::spec::{self, JobSpec, ModelKind, Objective};

#[derive(Args)]
pub struct PlanArgs {
    /// The job file (YAML).
    job: PathBuf,
    #[arg(long = "set", value_name = "PATH=VALUE")]
    overrides: Vec<String>,
    /// A catalog of your own (YAML, the format of `infra/catalog/`), merged with the built-in one.
    #[arg(long)]
    catalog: Option<PathBuf>,
    /// A calibration profile of this machine (YAML or JSON), used for the `local` SKU.
    #[arg(long)]
    calibration: Option<PathBuf>,
    /// Rows of alternatives and rejections to print.
    #[arg(long, default_value_t = 8)]
    rows: usize,
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    output: OutputFormat,
}

pub fn run(a: &PlanArgs) -> Result<()> {
    let spec = spec::load(&a.job, &a.overrides)?;
    let source = dataset::load(&spec.dataset)?;
    let req = request(&spec, &source)?;
    let mut catalog = Catalog::builtin();
    if let Some(path) = &a.catalog {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read the catalog", path.display()))?;
        catalog = catalog.merge(Catalog::from_yaml_str(&text, &path.display().to_string())?)?;
    }
    let calibration = match &a.calibration {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| {
                format!("{}: cannot read the calibration profile", path.display())
            })?;
            Some(CalibrationProfile::from_yaml_str(
                &text,
                &path.display().to_string(),
            )?)
        }
        None => None,
    };
    let plan = physalia_planner::plan(&req, &catalog, calibration.as_ref())?;
    match a.output {
        OutputFormat::Json => println!("{}", serde_json::to_string(&plan)?),
        OutputFormat::Text => print!("{}", plan.render_brief(a.rows)),
    }
    Ok(())
}

/// The planner's view of a job: graph statistics, stored partitionings, model, training and goal.
fn request(spec: &JobSpec, source: &Source) -> Result<PlanRequest> {
    let stats = source.stats();
    let graph = GraphStats {
        nodes: stats.num_nodes as u64,
        edges: stats.num_edges as u64,
        feat_dim: stats.feat_dim as u32,
        classes: stats.num_classes as u32,
        train_nodes: source.split(Split::Train).len() as u64,
        feature_bytes_per_value: match stats.feature_dtype {
            FeatureDtype::F32 => 4,
            FeatureDtype::F16 | FeatureDtype::BF16 => 2,
        },
    };
    let partitions = match (&spec.dataset.path, source) {
        (Some(path), Source::File(_)) => physalia_graph::partition::list_partitions(path)
            .unwrap_or_default()
            .into_iter()
            .filter(|p| p.status == physalia_graph::partition::ArtifactStatus::Current)
            .filter_map(|p| p.meta)
            .map(|m| PartitionStats {
                parts: m.k as u32,
                edge_cut: m.edge_cut as u64,
                owned_rows: m.parts.iter().map(|p| p.n_owned as u64).collect(),
                halo_rows: m.parts.iter().map(|p| p.n_halo as u64).collect(),
                local_edges: m.parts.iter().map(|p| p.n_local_edges as u64).collect(),
            })
            .collect(),
        _ => Vec::new(),
    };
    let model = serde_json::from_value::<ModelShape>(serde_json::json!({
        "kind": match spec.model.kind {
            ModelKind::Gcn => "gcn",
            ModelKind::Sage => "sage",
            ModelKind::Gat => "gat",
        },
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
        "fanouts": mb.fanouts,
        "eval_every": spec.train.eval_every,
    }))
    .context("describing the training to the planner")?;
    train.cache_rows = spec.minibatch.as_ref().map(|m| m.cache_rows);
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

/// With a `goal:` section, `submit` runs what the planner chooses on the job's backend: the mode, the
/// worker count (parts and replicas), the exchange options and the data-parallel cache. Returns the
/// adjusted job and one line saying what was chosen.
pub fn apply_goal(spec: &JobSpec) -> Result<Option<(JobSpec, String)>> {
    use crate::spec::{
        ExchangeDtype, ExchangeSpec, GroupsSpec, MiniBatchSpec, Parallelism, ParallelismSpec,
    };
    use physalia_planner::{Mode, RowDtype};
    let Some(goal) = &spec.goal else {
        return Ok(None);
    };
    let source = dataset::load(&spec.dataset)?;
    let mut req = request(spec, &source)?;
    drop(source);
    // only the backend the job runs on
    let backend = serde_json::to_value(spec.backend)?;
    req.constraints.backends = vec![serde_json::from_value(backend).context("backend")?];
    let name = req.constraints.backends[0].as_str();
    if !goal.backends.is_empty() && !goal.backends.iter().any(|b| b == name) {
        anyhow::bail!(
            "goal.backends {:?} does not include the job's backend `{name}`; submit runs on `backend:`",
            goal.backends
        );
    }
    let plan = physalia_planner::plan(&req, &Catalog::builtin(), None)?;
    let c = &plan.chosen.candidate;
    let mut out = spec.clone();
    out.workers = c.workers;
    let mode = match c.mode {
        Mode::Partition => Parallelism::Partition,
        Mode::Data => Parallelism::Data,
        Mode::Model => Parallelism::Model,
    };
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
        let exact = x.boundary_sampling >= 1.0 && x.staleness == 0 && x.dtype == RowDtype::F32;
        out.exchange = (!exact).then(|| ExchangeSpec {
            boundary_sampling: x.boundary_sampling,
            staleness: x.staleness,
            dtype: match x.dtype {
                RowDtype::F32 => ExchangeDtype::F32,
                RowDtype::F16 => ExchangeDtype::F16,
                RowDtype::Bf16 => ExchangeDtype::Bf16,
            },
            ..spec.exchange.clone().unwrap_or_default()
        });
    } else {
        out.exchange = None;
        let mut mb = spec
            .minibatch
            .clone()
            .unwrap_or_else(MiniBatchSpec::default);
        mb.cache_rows = c.cache_rows;
        out.minibatch = Some(mb);
    }
    out.validate()
        .context("the planner's choice does not fit the job file")?;
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
