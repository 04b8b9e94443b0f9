//! What the planner is asked: plain values the orchestrator fills from the dataset, the
//! partition artifacts and the job file. Nothing here reads a file.
//!
//! Every struct is serde (YAML or JSON) with unknown fields refused, so a request can be
//! written by hand for `physalia plan` tests and golden files, and [`PlanRequest::validate`]
//! names the first field out of range.

use serde::{Deserialize, Serialize};

use crate::catalog::Backend;
use crate::error::PlanError;

/// The graph, as its dataset records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GraphStats {
    pub nodes: u64,
    /// Entries of the in-neighbour CSR: an undirected edge counts twice (the importers store
    /// both directions by default).
    pub edges: u64,
    pub feat_dim: u32,
    pub classes: u32,
    /// Training nodes (seeds of mini-batch training; the loss rows of full-graph training).
    pub train_nodes: u64,
    /// Bytes of one stored feature value (4 for f32, 2 for f16/bf16). The engine computes in
    /// f32 whatever the file holds, so this only changes how many bytes a worker loads.
    #[serde(default = "four")]
    pub feature_bytes_per_value: u32,
    /// The dataset is chunked (a directory with a manifest): only the streaming partitioner can cut
    /// it, METIS would load the whole graph.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub chunked: bool,
}

/// A stored k-way partitioning, measured from its artifacts: when present for a `k`, the cost
/// model uses it (the largest part) instead of the cut-fraction estimate. From a
/// `physalia_graph::partition::PartitionMeta`: `parts = meta.k`, `edge_cut = meta.edge_cut`,
/// and per `meta.parts[i]`: `n_owned`, `n_halo`, `n_local_edges`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartitionStats {
    /// Number of parts `k`.
    pub parts: u32,
    /// Undirected edges cut by the partitioning.
    pub edge_cut: u64,
    /// Per part, in part order: owned nodes, halo nodes, entries of the local CSR.
    pub owned_rows: Vec<u64>,
    pub halo_rows: Vec<u64>,
    pub local_edges: Vec<u64>,
}

/// GNN architectures: one type for the job file's `model.kind` and the planner's model (the engine's
/// `LayerKind` is the same three, converted where a job's model is built).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// Graph convolutional network (Kipf & Welling).
    Gcn,
    /// GraphSAGE with mean aggregation.
    Sage,
    /// Graph attention network.
    Gat,
}

impl ModelKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::Gcn => "gcn",
            ModelKind::Sage => "sage",
            ModelKind::Gat => "gat",
        }
    }
}

/// The model's shape: what decides FLOPs, widths of exchanged rows and parameter count.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    pub kind: ModelKind,
    pub layers: u32,
    /// Width of each hidden layer (per head for gat).
    pub hidden: u32,
    /// Attention heads of the hidden layers (gat; 1 otherwise).
    #[serde(default = "one")]
    pub heads: u32,
    /// Attention heads of the output layer, averaged (gat; 1 otherwise).
    #[serde(default = "one")]
    pub out_heads: u32,
    /// Dropout on the input features. At 0 the first layer's `A X` is computed once per run
    /// (when it aggregates raw features), and its halo rows travel once.
    #[serde(default)]
    pub input_dropout: f64,
}

/// Element type of exchanged halo rows.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum RowDtype {
    #[default]
    F32,
    F16,
    Bf16,
}

impl RowDtype {
    pub fn bytes(self) -> f64 {
        match self {
            RowDtype::F32 => 4.0,
            RowDtype::F16 | RowDtype::Bf16 => 2.0,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            RowDtype::F32 => "f32",
            RowDtype::F16 => "f16",
            RowDtype::Bf16 => "bf16",
        }
    }
}

/// How partition-parallel workers exchange halo rows (the job file's `exchange:`). The
/// default is exact.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExchangeOptions {
    /// Fraction of boundary rows sent each training epoch, in (0, 1] (BNS-GCN).
    pub boundary_sampling: f64,
    /// Epochs a received halo row is reused before it is refreshed (Sancus; fixed schedule).
    pub staleness: u32,
    pub dtype: RowDtype,
    /// SAR: halo rows aggregated one peer at a time and dropped, fetched again in backward where
    /// GAT needs them. Exact; partition parallelism on CPU workers only.
    #[serde(default)]
    pub rematerialize: bool,
}

impl Default for ExchangeOptions {
    fn default() -> Self {
        ExchangeOptions {
            boundary_sampling: 1.0,
            staleness: 0,
            dtype: RowDtype::F32,
            rematerialize: false,
        }
    }
}

impl ExchangeOptions {
    /// Sends every row fresh at f32: the same losses as one worker.
    pub fn is_exact(&self) -> bool {
        self.boundary_sampling >= 1.0 && self.staleness == 0 && self.dtype == RowDtype::F32
    }

    /// Short form for tables: `exact`, `bf16`, `p0.1+bf16`, `s3`, `remat`.
    pub fn label(&self) -> String {
        if self.is_exact() {
            return if self.rematerialize { "remat" } else { "exact" }.to_string();
        }
        let mut parts = Vec::new();
        if self.boundary_sampling < 1.0 {
            parts.push(format!("p{}", self.boundary_sampling));
        }
        if self.staleness > 0 {
            parts.push(format!("s{}", self.staleness));
        }
        if self.dtype != RowDtype::F32 {
            parts.push(self.dtype.as_str().to_string());
        }
        if self.rematerialize {
            parts.push("remat".to_string());
        }
        parts.join("+")
    }
}

/// Training settings that change the work per epoch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainShape {
    pub epochs: u32,
    /// Seeds per worker per step (mini-batch modes).
    #[serde(default = "default_batch")]
    pub batch_size: u32,
    /// In-neighbours sampled per node and hop, one per layer, the seeds' hop first; -1 takes
    /// every neighbour. As in the job file. Empty: 25 for the seeds' hop, 10 for each other.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fanouts: Vec<i64>,
    /// Full-graph evaluation every this many epochs.
    #[serde(default = "one")]
    pub eval_every: u32,
    /// Remote feature rows each data-parallel worker caches. `None`: the planner picks (half
    /// of the host memory left over, at most every remote row). Pass `None` unless the user
    /// wrote `minibatch.cache_rows` (the job file's default 0 means "no cache").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_rows: Option<u64>,
    /// The job's exchange options for partition parallelism.
    #[serde(default)]
    pub exchange: ExchangeOptions,
}

impl TrainShape {
    /// Fan-out per hop (the seeds' hop first); `None` takes every neighbour.
    pub fn fanouts_for(&self, layers: u32) -> Vec<Option<u32>> {
        if self.fanouts.is_empty() {
            return (0..layers)
                .map(|l| Some(if l == 0 { 25 } else { 10 }))
                .collect();
        }
        self.fanouts
            .iter()
            .map(|&f| u32::try_from(f).ok().filter(|&f| f > 0))
            .collect()
    }
}

/// What the plan is chosen for.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// The cheapest plan (ties: the faster).
    #[default]
    MinCost,
    /// The fastest plan (ties: the cheaper).
    MinTime,
    /// The cheapest plan that finishes within `deadline_s` (required).
    Deadline,
    /// The fastest plan that costs at most `budget_usd` (required).
    Budget,
}

impl Objective {
    pub fn as_str(self) -> &'static str {
        match self {
            Objective::MinCost => "min_cost",
            Objective::MinTime => "min_time",
            Objective::Deadline => "deadline",
            Objective::Budget => "budget",
        }
    }

    /// Whether candidates are ranked by cost first (else by time first).
    pub fn cost_first(self) -> bool {
        matches!(self, Objective::MinCost | Objective::Deadline)
    }
}

/// The three parallelism modes the engine has: how a job splits its work over workers. The one type of
/// this concept: the job file's `parallelism` (`physalia_coordinator::spec::Parallelism`) and the
/// workers' assignment (`physalia_control::TrainMode`) are this enum under those names.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
#[schemars(description = "How a job splits its work over workers: `partition`, `data` or `model`.")]
pub enum Mode {
    /// Full-graph training on METIS parts with halo exchange.
    #[default]
    Partition,
    /// Mini-batches of sampled neighbourhoods, gradients all-reduced every step.
    Data,
    /// P3: input features split by column, the other layers data-parallel.
    Model,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Partition => "partition",
            Mode::Data => "data",
            Mode::Model => "model",
        }
    }
}

/// Limits on the search.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Constraints {
    /// Most workers (containers) a plan may use, at least 1.
    pub max_workers: u32,
    /// Most USD a plan may cost in total.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_usd: Option<f64>,
    /// Most seconds a plan may take in total (cold start, loading and every epoch).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline_s: Option<f64>,
    pub objective: Objective,
    /// Only these backends (empty: every backend of the catalog).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub backends: Vec<Backend>,
    /// Only these SKUs by name (empty: all).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub skus: Vec<String>,
    /// Only these modes (empty: all three and their hybrids).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub modes: Vec<Mode>,
    /// Also try exchange options that change the numbers a little (bf16 rows; bf16 rows with
    /// BNS p = 0.1), which bench/RESULTS.md measured without accuracy loss on SBM.
    pub allow_inexact_exchange: bool,
    /// Also try hybrids (replica groups of parts). A running job is replanned without them: it resizes
    /// within one mode and cannot turn into groups.
    pub hybrids: bool,
    /// Memory of the process that partitions the graph (this machine's for a local coordinator);
    /// unset: [`crate::Assumptions::coordinator_memory_gib`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub coordinator_memory_gib: Option<f64>,
}

impl Default for Constraints {
    fn default() -> Self {
        Constraints {
            max_workers: 16,
            budget_usd: None,
            deadline_s: None,
            objective: Objective::MinCost,
            backends: Vec::new(),
            skus: Vec::new(),
            modes: Vec::new(),
            allow_inexact_exchange: false,
            hybrids: true,
            coordinator_memory_gib: None,
        }
    }
}

/// Everything a plan depends on besides the catalog and the calibration profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanRequest {
    pub graph: GraphStats,
    /// Measured partitionings, any `k`; missing ones are estimated.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<PartitionStats>,
    pub model: ModelShape,
    pub train: TrainShape,
    #[serde(default)]
    pub constraints: Constraints,
    /// The cost model's constants; the defaults are documented in [`crate::Assumptions`].
    #[serde(default)]
    pub assumptions: crate::Assumptions,
}

impl PlanRequest {
    /// The first value out of range, as `field: message`.
    pub fn validate(&self) -> Result<(), PlanError> {
        let g = &self.graph;
        at_least("graph.nodes", g.nodes, 1)?;
        at_least("graph.feat_dim", g.feat_dim.into(), 1)?;
        at_least("graph.classes", g.classes.into(), 2)?;
        at_least("graph.train_nodes", g.train_nodes, 1)?;
        if g.train_nodes > g.nodes {
            return Err(PlanError::invalid(
                "graph.train_nodes",
                format!("{} is more than graph.nodes ({})", g.train_nodes, g.nodes),
            ));
        }
        if !matches!(g.feature_bytes_per_value, 1 | 2 | 4 | 8) {
            return Err(PlanError::invalid(
                "graph.feature_bytes_per_value",
                format!("must be 1, 2, 4 or 8, got {}", g.feature_bytes_per_value),
            ));
        }
        for (i, p) in self.partitions.iter().enumerate() {
            let field = |name: &str| format!("partitions[{i}].{name}");
            at_least(&field("parts"), p.parts.into(), 1)?;
            for (name, v) in [
                ("owned_rows", &p.owned_rows),
                ("halo_rows", &p.halo_rows),
                ("local_edges", &p.local_edges),
            ] {
                if v.len() != p.parts as usize {
                    return Err(PlanError::invalid(
                        field(name),
                        format!("has {} entries for {} parts", v.len(), p.parts),
                    ));
                }
            }
            if p.owned_rows.iter().sum::<u64>() != g.nodes {
                return Err(PlanError::invalid(
                    field("owned_rows"),
                    format!(
                        "sums to {}, but the graph has {} nodes (stale partitioning?)",
                        p.owned_rows.iter().sum::<u64>(),
                        g.nodes
                    ),
                ));
            }
            if self.partitions[..i].iter().any(|q| q.parts == p.parts) {
                return Err(PlanError::invalid(
                    field("parts"),
                    format!("a second partitioning with {} parts", p.parts),
                ));
            }
        }
        if let Some(gib) = self.constraints.coordinator_memory_gib
            && !(gib.is_finite() && gib > 0.0)
        {
            return Err(PlanError::invalid(
                "constraints.coordinator_memory_gib",
                format!("must be a finite number above 0, got {gib}"),
            ));
        }
        let m = &self.model;
        at_least("model.layers", m.layers.into(), 1)?;
        at_least("model.hidden", m.hidden.into(), 1)?;
        at_least("model.heads", m.heads.into(), 1)?;
        at_least("model.out_heads", m.out_heads.into(), 1)?;
        if !(0.0..1.0).contains(&m.input_dropout) {
            return Err(PlanError::invalid(
                "model.input_dropout",
                format!("must be in [0, 1), got {}", m.input_dropout),
            ));
        }
        let t = &self.train;
        at_least("train.epochs", t.epochs.into(), 1)?;
        at_least("train.batch_size", t.batch_size.into(), 1)?;
        at_least("train.eval_every", t.eval_every.into(), 1)?;
        if !t.fanouts.is_empty() && t.fanouts.len() != m.layers as usize {
            return Err(PlanError::invalid(
                "train.fanouts",
                format!(
                    "has {} entries for {} layers (one per layer)",
                    t.fanouts.len(),
                    m.layers
                ),
            ));
        }
        if let Some(f) = t.fanouts.iter().find(|&&f| f == 0 || f < -1) {
            return Err(PlanError::invalid(
                "train.fanouts",
                format!("each must be at least 1, or -1 for every neighbour; got {f}"),
            ));
        }
        let x = &t.exchange;
        if !(x.boundary_sampling > 0.0 && x.boundary_sampling <= 1.0) {
            return Err(PlanError::invalid(
                "train.exchange.boundary_sampling",
                format!("must be in (0, 1], got {}", x.boundary_sampling),
            ));
        }
        if x.rematerialize && (x.boundary_sampling < 1.0 || x.staleness > 0) {
            return Err(PlanError::invalid(
                "train.exchange.rematerialize",
                "cannot be combined with boundary_sampling below 1 or staleness above 0",
            ));
        }
        let c = &self.constraints;
        at_least("constraints.max_workers", c.max_workers.into(), 1)?;
        if let Some(b) = c.budget_usd
            && !(b.is_finite() && b >= 0.0)
        {
            return Err(PlanError::invalid(
                "constraints.budget_usd",
                format!("must be a finite number at least 0, got {b}"),
            ));
        }
        if let Some(d) = c.deadline_s
            && !(d.is_finite() && d > 0.0)
        {
            return Err(PlanError::invalid(
                "constraints.deadline_s",
                format!("must be a finite number above 0, got {d}"),
            ));
        }
        match c.objective {
            Objective::Deadline if c.deadline_s.is_none() => {
                return Err(PlanError::invalid(
                    "constraints.deadline_s",
                    "the deadline objective needs a deadline",
                ));
            }
            Objective::Budget if c.budget_usd.is_none() => {
                return Err(PlanError::invalid(
                    "constraints.budget_usd",
                    "the budget objective needs a budget",
                ));
            }
            _ => {}
        }
        self.assumptions.validate()
    }
}

fn at_least(field: &str, value: u64, min: u64) -> Result<(), PlanError> {
    if value < min {
        return Err(PlanError::invalid(
            field,
            format!("must be at least {min}, got {value}"),
        ));
    }
    Ok(())
}

fn one() -> u32 {
    1
}
fn four() -> u32 {
    4
}
fn default_batch() -> u32 {
    1024
}
