//! The job file: what `physalia submit job.yaml` reads.
//!
//! This module owns the schema of a job (the `JobSpec` tree, its defaults and its JSON Schema),
//! reading it from YAML, applying `--set key.path=value` overrides and validating it. It does no
//! other IO than reading the one file in [`load`]; nothing here touches datasets or starts
//! training. Paths inside a job (`dataset.path`, `output.dir`) are kept exactly as written:
//! a relative path is resolved against the *current working directory* of the process that
//! opens it, not against the job file's directory.
//!
//! Errors are one line each and name where the problem is: `file:line:column` for anything the
//! YAML parser or the schema rejects in the file itself, the offending `--set` text for
//! overrides, and the dotted field path for validation (`cora.yaml: train.lr: must be > 0,
//! got -0.01`).
//!
//! Overrides go through a generic value tree, which has no source locations. So the file is
//! parsed on its own when the merged document fails, and an error that the file alone already
//! produces (same field, same message) is reported with its line and column; anything else is
//! blamed on the override that touches the failing field.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

mod backend;

pub use backend::{
    AciRegistry, AciSettings, BackendSpec, DockerSettings, EcsSettings, KubernetesSettings,
    KubernetesToleration, Mode, Priced, is_fargate,
};

/// Default number of attention heads of a GAT hidden layer.
pub const DEFAULT_GAT_HEADS: u32 = 8;
/// Default number of attention heads of a GAT output layer (their outputs are averaged).
pub const DEFAULT_GAT_OUT_HEADS: u32 = 1;
/// Default slope of the leaky ReLU in GAT attention scores.
pub const DEFAULT_NEGATIVE_SLOPE: f64 = 0.2;
/// Largest R-MAT scale accepted (2^30 nodes).
pub const MAX_RMAT_SCALE: u32 = 30;
/// Retries in a row of a lost worker's epoch when the job file does not say.
pub const DEFAULT_MAX_RETRIES: u32 = 3;
/// Most retries in a row a job file may ask for.
pub const MAX_RETRIES_LIMIT: u32 = 100;
/// Longest job name accepted; job names become directory names.
pub const MAX_NAME_LEN: usize = 64;

// ---------------------------------------------------------------------------------------------
// Schema
// ---------------------------------------------------------------------------------------------

/// A training job, as written in a job file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Name of the job; job directories are named `<name>-<suffix>`. Letters, digits, `.`, `_`
    /// and `-` only. Default: the job file's stem.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The graph to train on: a dataset on disk (`path`) or a generated one (`synth`). A bare string is
    /// short for `{path: ...}`.
    #[serde(deserialize_with = "dataset_or_path")]
    #[schemars(schema_with = "dataset_schema")]
    pub dataset: DatasetSpec,
    /// The graph neural network to train.
    pub model: ModelSpec,
    /// Optimisation settings.
    #[serde(default)]
    pub train: TrainSpec,
    /// Number of workers the graph is partitioned over. 1 trains inside `physalia submit`; more
    /// start that many `physalia-worker` processes, each training one partition.
    #[serde(default = "default_workers")]
    pub workers: u32,
    /// How the work is split over workers: `partition` (full-graph training on METIS partitions with
    /// halo exchange), `data` (mini-batches of sampled neighbourhoods, gradients all-reduced every step),
    /// `model` (P3: input features split by column, the other layers data-parallel), or replicas of
    /// partition groups: `{partition: k, replicas: r}` (full-graph) or `{data: k, replicas: r}`
    /// (mini-batch), with `workers` = k x r; the replicas split the training nodes.
    #[serde(default)]
    pub parallelism: ParallelismSpec,
    /// Mini-batch settings for `data` and `model` parallelism.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minibatch: Option<MiniBatchSpec>,
    /// How workers exchange halo rows (only used when `workers` is above 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exchange: Option<ExchangeSpec>,
    /// What `physalia plan` optimises and under which limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub goal: Option<GoalSpec>,
    /// Scaling policy, inline: rules evaluated between epochs (see `examples/policies/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling: Option<physalia_policies::PolicySet>,
    /// Scaling policy in its own file, relative to the job file (instead of `scaling`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scaling_file: Option<PathBuf>,
    /// What each worker needs besides cores: GPUs (`resources: {gpu: {count: 1}}`), and what a worker
    /// that finds none does (`gpu_fallback`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourcesSpec>,
    /// Failure detection for multi-worker jobs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeouts: Option<TimeoutsSpec>,
    /// Times in a row a lost worker's epoch is retried from the last checkpoint before the job fails
    /// (a worker that died, vanished or went silent; an error a worker reports is not retried).
    /// Default 3; 0 fails the job at the first lost worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_retries: Option<u32>,
    /// Where the job runs (default `local`): a platform name, or `{name: NAME}` with each platform's
    /// settings (`docker`, `kubernetes`, `ecs`, `aci` sections: where its workers go, their image and
    /// their container SKU, whose catalog price the job is billed at).
    #[serde(default, deserialize_with = "backend::backend_or_name")]
    #[schemars(schema_with = "backend::backend_schema")]
    pub backend: BackendSpec,
    /// Where job directories are written.
    #[serde(default)]
    pub output: OutputSpec,
}

/// The dataset of a job: exactly one of `path` or `synth`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DatasetSpec {
    /// A `.safetensors` dataset file, or a directory in the generic (Cora-style) or OGB raw
    /// layout. A relative path is resolved against the current working directory, not against
    /// the job file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// How to read `path`; `auto` guesses from the file extension and directory contents.
    #[serde(default)]
    pub format: DatasetFormat,
    /// Divide each feature row by its sum (the Kipf & Welling preprocessing).
    #[serde(default)]
    pub row_normalize: bool,
    /// Generate a synthetic dataset instead of reading one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub synth: Option<SynthSpec>,
    /// Only the graph's statistics, for `physalia plan` before the data is here: `{nodes, edges,
    /// feat_dim, classes, train_nodes}`, or an OGB node-property dataset by name (`ogbn-arxiv`,
    /// `ogbn-products`, `ogbn-papers100M`) with its published sizes. `submit` needs the graph itself.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "stats_or_name"
    )]
    #[schemars(schema_with = "stats_schema")]
    pub stats: Option<StatsSpec>,
    /// How the graph is cut into the workers' parts when no current set is stored beside the dataset:
    /// `auto` (the planner's choice: METIS where it fits the coordinator's memory and its better-balanced
    /// parts pay for its longer run, streaming otherwise; `physalia plan` says which and why), `metis`
    /// (the whole graph in memory), or `stream` (out of core: restreamed Fennel, then label
    /// propagation). A set already stored for the part count is reused whichever made it.
    #[serde(default)]
    pub partitioner: PartitionerSpec,
}

/// `dataset.partitioner`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PartitionerSpec {
    #[default]
    Auto,
    Metis,
    Stream,
}

/// A graph's size as the planner needs it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StatsSpec {
    /// The published dataset these sizes are of, when given by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub nodes: u64,
    /// Directed edges of the training graph (an undirected edge counts twice).
    pub edges: u64,
    pub feat_dim: u32,
    pub classes: u32,
    pub train_nodes: u64,
}

/// The OGB node-property datasets by name, with the sizes the OGB paper and leaderboards publish (edges
/// counted in both directions, as they are trained: PyG's `ToUndirected`).
pub const KNOWN_GRAPHS: [(&str, u64, u64, u32, u32, u64); 3] = [
    ("ogbn-arxiv", 169_343, 2 * 1_166_243, 128, 40, 90_941),
    ("ogbn-products", 2_449_029, 2 * 61_859_140, 100, 47, 196_615),
    (
        "ogbn-papers100M",
        111_059_956,
        2 * 1_615_685_872,
        128,
        172,
        1_207_179,
    ),
];

/// The known dataset a path's last component names, if any: its own name in any case, or OGB's folder
/// name (`ogbn_papers100M`).
pub fn known_graph_named(name: &str) -> Option<&'static str> {
    let name = name.replace('_', "-").to_ascii_lowercase();
    KNOWN_GRAPHS
        .iter()
        .map(|k| k.0)
        .find(|k| k.to_ascii_lowercase() == name)
}

impl StatsSpec {
    /// A known dataset's statistics by name.
    pub fn named(name: &str) -> Option<StatsSpec> {
        KNOWN_GRAPHS.iter().find(|k| k.0 == name).map(
            |&(n, nodes, edges, feat_dim, classes, train_nodes)| StatsSpec {
                name: Some(n.to_string()),
                nodes,
                edges,
                feat_dim,
                classes,
                train_nodes,
            },
        )
    }
}

/// `stats: NAME` as well as `stats: {nodes, edges, ...}`.
fn stats_or_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<StatsSpec>, D::Error> {
    struct Visitor;
    impl<'de> serde::de::Visitor<'de> for Visitor {
        type Value = Option<StatsSpec>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a known dataset's name or a mapping {nodes, edges, feat_dim, classes, train_nodes}")
        }

        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            StatsSpec::named(v).map(Some).ok_or_else(|| {
                let known: Vec<&str> = KNOWN_GRAPHS.iter().map(|k| k.0).collect();
                E::custom(format!(
                    "unknown dataset {v:?}: known by name are {}; or give \
                     {{nodes, edges, feat_dim, classes, train_nodes}}",
                    known.join(", ")
                ))
            })
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            StatsSpec::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(Some)
        }
    }
    d.deserialize_any(Visitor)
}

fn stats_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let known: Vec<&str> = KNOWN_GRAPHS.iter().map(|k| k.0).collect();
    schemars::json_schema!({
        "anyOf": [
            {"type": "string", "enum": known},
            g.subschema_for::<StatsSpec>(),
        ]
    })
}

/// `dataset: PATH` as well as `dataset: {path: PATH, ...}`; any other value is an error naming what is
/// expected.
fn dataset_or_path<'de, D: serde::Deserializer<'de>>(d: D) -> Result<DatasetSpec, D::Error> {
    struct Visitor;
    impl<'de> serde::de::Visitor<'de> for Visitor {
        type Value = DatasetSpec;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a dataset path, or a mapping with `path` or `synth` (or `stats`, for planning only)")
        }

        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<DatasetSpec, E> {
            Ok(DatasetSpec {
                path: Some(PathBuf::from(v)),
                format: DatasetFormat::default(),
                row_normalize: false,
                synth: None,
                stats: None,
                partitioner: PartitionerSpec::default(),
            })
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<DatasetSpec, A::Error> {
            DatasetSpec::deserialize(serde::de::value::MapAccessDeserializer::new(map))
        }
    }
    d.deserialize_any(Visitor)
}

fn dataset_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let full = g.subschema_for::<DatasetSpec>();
    schemars::json_schema!({
        "anyOf": [
            { "type": "string", "description": "A dataset path: short for `{path: ...}`." },
            full,
        ]
    })
}

/// On-disk layout of a dataset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DatasetFormat {
    /// Guess from the path.
    #[default]
    Auto,
    /// A single `.safetensors` file.
    Safetensors,
    /// A directory in the generic (Cora-style) layout.
    Generic,
    /// A directory in the OGB raw layout.
    Ogb,
}

/// Parameters of a generated dataset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SynthSpec {
    /// Generator: a stochastic block model (`sbm`) or an R-MAT graph (`rmat`).
    pub kind: SynthKind,
    /// Number of nodes (sbm only, required there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<u64>,
    /// The graph has 2^scale nodes (rmat only, required there; at most 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<u32>,
    /// Edges per node (rmat only, required there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edge_factor: Option<u32>,
    /// Number of node classes (at least 2).
    pub classes: u32,
    /// Mean node degree (sbm only, required there; > 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub avg_degree: Option<f64>,
    /// Fraction of edges that join nodes of the same class, in [0, 1] (sbm only, optional).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub homophily: Option<f64>,
    /// Length of each node's feature vector (at least 1).
    pub feat_dim: u32,
    /// Seed of the generator.
    #[serde(default)]
    pub seed: u64,
}

/// Synthetic graph generators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SynthKind {
    /// Stochastic block model: one block per class.
    Sbm,
    /// Recursive matrix (R-MAT) power-law graph.
    Rmat,
}

/// The model to train.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Architecture: graph convolution (`gcn`), GraphSAGE (`sage`) or graph attention (`gat`).
    pub kind: ModelKind,
    /// Number of message-passing layers (at least 1).
    #[serde(default = "default_layers")]
    pub layers: u32,
    /// Width of each hidden layer (at least 1); per attention head for gat.
    #[serde(default = "default_hidden")]
    pub hidden: u32,
    /// Attention heads of each hidden layer (gat only; default 8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads: Option<u32>,
    /// Attention heads of the output layer, averaged (gat only; default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub out_heads: Option<u32>,
    /// Dropout probability on hidden activations, in [0, 1).
    #[serde(default = "default_dropout")]
    pub dropout: f64,
    /// Dropout probability on the input features before layer 1, in [0, 1). Default: `dropout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_dropout: Option<f64>,
    /// Dropout probability on attention coefficients, in [0, 1) (gat only). Default: `dropout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_dropout: Option<f64>,
    /// Activation between layers. `elu` is conventional for gat.
    #[serde(default)]
    pub activation: Activation,
    /// Slope of the leaky ReLU in attention scores, >= 0 (gat only; default 0.2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub negative_slope: Option<f64>,
}

/// GNN architectures: the planner's type, one for the job file and the plan.
pub use physalia_planner::ModelKind;

/// Activation functions between layers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// max(0, x).
    #[default]
    Relu,
    /// Exponential linear unit.
    Elu,
}

/// Optimisation settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TrainSpec {
    /// Number of training epochs (at least 1).
    pub epochs: u32,
    /// Adam learning rate (> 0, finite).
    pub lr: f64,
    /// L2 weight decay (>= 0, finite).
    pub weight_decay: f64,
    /// Seed of weight initialisation and dropout; run `i` uses `seed + i`.
    pub seed: u64,
    /// Number of repeated trainings whose accuracies are reported as mean and standard
    /// deviation (at least 1).
    pub runs: u32,
    /// Number of compute threads (at least 1). Default: all cores.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads: Option<u32>,
    /// Evaluate on the validation and test sets every this many epochs (at least 1).
    pub eval_every: u32,
    /// Stop after this many evaluations without a better validation accuracy (at least 1).
    /// Default: never stop early.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub patience: Option<u32>,
}

impl Default for TrainSpec {
    fn default() -> Self {
        TrainSpec {
            epochs: 200,
            lr: 0.01,
            weight_decay: 5e-4,
            seed: 0,
            runs: 1,
            threads: None,
            eval_every: 1,
            patience: None,
        }
    }
}

/// How a job splits its work over workers: the planner's [`physalia_planner::Mode`], which the workers'
/// assignment carries as is (`physalia_control::TrainMode`).
pub use physalia_planner::Mode as Parallelism;

/// The planner's objective and constraints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct GoalSpec {
    /// `min_cost`, `min_time`, `deadline` (cheapest within `deadline_s`) or `budget` (fastest within
    /// `budget_usd`).
    pub objective: Objective,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_usd: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline_s: Option<f64>,
    /// Most workers a plan may use.
    pub max_workers: u32,
    /// Only these backends (`local`, `docker`, `kubernetes`, `ecs`, `aci`); empty: all of the catalog.
    pub backends: Vec<String>,
    /// Also consider bf16 rows and boundary sampling (change the numbers slightly).
    pub allow_inexact_exchange: bool,
}

impl Default for GoalSpec {
    fn default() -> Self {
        GoalSpec {
            objective: Objective::MinCost,
            budget_usd: None,
            deadline_s: None,
            max_workers: 16,
            backends: Vec::new(),
            allow_inexact_exchange: false,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    #[default]
    MinCost,
    MinTime,
    Deadline,
    Budget,
}

/// A mode, or replicas of partition groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum ParallelismSpec {
    Mode(Parallelism),
    Groups(GroupsSpec),
}

impl Default for ParallelismSpec {
    fn default() -> Self {
        ParallelismSpec::Mode(Parallelism::Partition)
    }
}

/// `r` replicas of a `k`-way partitioning: exactly one of `partition` or `data` gives `k` and the mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GroupsSpec {
    /// Parts per replica, full-graph training in each group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<u32>,
    /// Parts per replica, mini-batch training in each group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<u32>,
    /// Number of replica groups (>= 1).
    pub replicas: u32,
}

/// Mini-batch training: neighbour sampling, batch size, the remote-row cache and the loader.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct MiniBatchSpec {
    /// In-neighbours sampled per node and hop, one per layer, the seeds' hop first (PyG order); -1 takes
    /// every neighbour. Default (or empty): one per layer, 25 for the seeds' hop and 10 for each other
    /// ([`default_fanouts`]).
    pub fanouts: Vec<i64>,
    /// Seeds per step over all workers (the global batch): each worker trains its share of every step's
    /// batch, so the number of workers does not change what is learned.
    pub batch_size: u32,
    /// Feature rows of other workers' nodes each worker caches, chosen by pre-sampling (data parallelism).
    pub cache_rows: u64,
    /// Batches pre-sampled to choose the cached rows.
    pub presample_batches: u32,
    /// Threads sampling and gathering batches ahead of training, and how many batches they may run ahead.
    pub loader_threads: u32,
    pub prefetch: u32,
}

/// The fan-outs of a job file that gives none: one per layer, 25 for the seeds' hop and 10 for each
/// other hop (`[25, 10]` for two layers, as GraphSAGE's paper and PyG's examples; the planner's
/// `TrainShape::fanouts_for` assumes the same).
pub fn default_fanouts(layers: u32) -> Vec<i64> {
    (0..layers).map(|l| if l == 0 { 25 } else { 10 }).collect()
}

impl MiniBatchSpec {
    /// The fan-outs for a model of `layers` layers: the written ones, else [`default_fanouts`].
    pub fn fanouts_for(&self, layers: u32) -> Vec<i64> {
        if self.fanouts.is_empty() {
            default_fanouts(layers)
        } else {
            self.fanouts.clone()
        }
    }

    /// The workers' mini-batch options for a model of `layers` layers.
    pub fn options(&self, layers: u32) -> physalia_control::MiniBatchOptions {
        physalia_control::MiniBatchOptions {
            fanouts: self
                .fanouts_for(layers)
                .iter()
                .map(|&f| (f > 0).then_some(f as u32))
                .collect(),
            batch_size: self.batch_size as usize,
            cache_rows: self.cache_rows as usize,
            presample_batches: self.presample_batches as usize,
            loader_threads: self.loader_threads as usize,
            prefetch: self.prefetch as usize,
        }
    }
}

impl Default for MiniBatchSpec {
    fn default() -> Self {
        MiniBatchSpec {
            // the model's layer count decides: `fanouts_for`
            fanouts: Vec::new(),
            batch_size: 1024,
            cache_rows: 0,
            presample_batches: 8,
            loader_threads: 1,
            prefetch: 2,
        }
    }
}

/// How workers exchange halo rows. The defaults are exact: the same losses as one worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ExchangeSpec {
    /// Fraction of boundary rows sent each training epoch, in (0, 1]; 1 sends all (exact).
    pub boundary_sampling: f64,
    /// Scale the sampled boundary rows by 1 / boundary_sampling (unbiased, but noisy at small rates). Off by
    /// default: unsampled boundary nodes drop out of that epoch's aggregation.
    #[serde(default)]
    pub boundary_rescale: bool,
    /// Epochs a received halo row is reused before it is refreshed (>= 0); 0 is always fresh (exact).
    pub staleness: u32,
    /// With `staleness` above 0: a worker re-sends a peer's rows before they are `staleness` epochs old as
    /// soon as they changed by at least this fraction (relative L2 norm) since it last sent them (Sancus).
    /// Unset: rows are refreshed on the fixed schedule, every `staleness + 1` epochs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness_threshold: Option<f64>,
    /// Element type of exchanged rows: `f32` (exact), `f16` or `bf16` (half the bytes, rounded).
    pub dtype: ExchangeDtype,
    /// SAR's sequential aggregation and rematerialisation: halo rows are aggregated one peer at a time and
    /// dropped, and fetched again in backward where a layer needs them (GAT), so a worker holds one peer's
    /// halo rows at a time instead of all. Exact; costs GAT's halo rows a second time in backward. CPU
    /// workers only; not with boundary sampling or staleness.
    #[serde(default)]
    pub rematerialize: bool,
}

impl Default for ExchangeSpec {
    fn default() -> Self {
        ExchangeSpec {
            boundary_sampling: 1.0,
            boundary_rescale: false,
            staleness: 0,
            staleness_threshold: None,
            dtype: ExchangeDtype::F32,
            rematerialize: false,
        }
    }
}

/// Element type of exchanged rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ExchangeDtype {
    #[default]
    F32,
    F16,
    Bf16,
}

/// A worker's devices.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ResourcesSpec {
    /// GPUs per worker: each worker trains on a GPU (local workers on one machine share its GPUs
    /// round-robin). Partition and data parallelism (P3 runs on the CPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuSpec>,
    /// When a worker finds no usable GPU (no driver, no device, too little memory, a CUDA library
    /// missing): `none` fails the job naming what is missing; `cpu` trains on the CPU instead, saying so
    /// in every epoch line and the summary.
    #[serde(default)]
    pub gpu_fallback: GpuFallback,
}

/// GPUs per worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    /// GPUs each worker sees (>= 1; a worker trains on one of them).
    #[serde(default = "one")]
    pub count: u32,
    /// The GPU model as the platform names it (kubernetes: the `nvidia.com/gpu.product` label); any
    /// when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum GpuFallback {
    /// Fail.
    #[default]
    None,
    /// Train on the CPU.
    Cpu,
}

/// How long the coordinator waits before it declares a worker lost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TimeoutsSpec {
    /// Seconds for every worker to start and register (> 0).
    pub register_s: f64,
    /// Seconds a worker may stay silent during training, i.e. the longest epoch (> 0).
    pub epoch_s: f64,
}

impl Default for TimeoutsSpec {
    fn default() -> Self {
        TimeoutsSpec {
            register_s: 30.0,
            epoch_s: 60.0,
        }
    }
}

/// Where a job runs: the planner's platform type, one for the job file, the catalog and the plan.
pub use physalia_planner::Backend as BackendKind;

/// Where job directories go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct OutputSpec {
    /// Job directories are created under this directory as `<dir>/<name>-<suffix>`. A relative
    /// path is resolved against the current working directory.
    pub dir: PathBuf,
}

impl Default for OutputSpec {
    fn default() -> Self {
        OutputSpec {
            dir: PathBuf::from("jobs"),
        }
    }
}

fn default_workers() -> u32 {
    1
}
fn default_layers() -> u32 {
    2
}
fn default_hidden() -> u32 {
    16
}
fn default_dropout() -> f64 {
    0.5
}

/// Where a job's graph comes from, once validated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DatasetSource<'a> {
    /// Read from disk.
    Path(&'a Path),
    /// Generate.
    Synth(&'a SynthSpec),
    /// Only statistics (planning).
    Stats(&'a StatsSpec),
}

impl DatasetSpec {
    /// The one source of the dataset; `None` unless exactly one of `path` and `synth` is set
    /// (which [`JobSpec::validate`] guarantees).
    pub fn source(&self) -> Option<DatasetSource<'_>> {
        match (&self.path, &self.synth, &self.stats) {
            (Some(path), None, None) => Some(DatasetSource::Path(path)),
            (None, Some(synth), None) => Some(DatasetSource::Synth(synth)),
            (None, None, Some(stats)) => Some(DatasetSource::Stats(stats)),
            _ => None,
        }
    }
}

impl ModelSpec {
    /// Heads of each hidden GAT layer, default applied.
    pub fn heads(&self) -> u32 {
        self.heads.unwrap_or(DEFAULT_GAT_HEADS)
    }
    /// Heads of the GAT output layer, default applied.
    pub fn out_heads(&self) -> u32 {
        self.out_heads.unwrap_or(DEFAULT_GAT_OUT_HEADS)
    }
    /// Dropout on the input features, default applied.
    pub fn input_dropout(&self) -> f64 {
        self.input_dropout.unwrap_or(self.dropout)
    }
    /// Dropout on attention coefficients, default applied.
    pub fn attn_dropout(&self) -> f64 {
        self.attn_dropout.unwrap_or(self.dropout)
    }
    /// Leaky ReLU slope of attention scores, default applied.
    pub fn negative_slope(&self) -> f64 {
        self.negative_slope.unwrap_or(DEFAULT_NEGATIVE_SLOPE)
    }
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Why a job file was rejected. Every message is a single line.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The job file could not be read.
    #[error("{}: cannot read job file: {source}", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid YAML or does not fit the schema (unknown field, wrong type, ...).
    #[error("{}{}{message}", located(origin, *.location), field_prefix(field))]
    Parse {
        /// The file name given to [`parse_str`] or [`load`].
        origin: String,
        /// 1-based (line, column), when the parser knows it.
        location: Option<(u64, u64)>,
        /// Dotted path of the offending field; empty for the document root.
        field: String,
        message: String,
    },
    /// A `--set` override is malformed or makes the job invalid.
    #[error("{origin}: --set {set}: {}{message}", field_prefix(field))]
    Override {
        origin: String,
        /// The override as given, `key.path=value`.
        set: String,
        /// Dotted path of the offending field, when known.
        field: String,
        message: String,
    },
    /// The scaling policy is invalid: every problem, each located (`file:line:col: field: message`).
    #[error("{}", errors.join("; "))]
    Policy { errors: Vec<String> },
    /// The job parses but a value is out of range or unsupported.
    #[error("{}{field}{}: {reason}", origin_prefix(origin), set_by(set))]
    Invalid {
        /// File name; `None` from [`JobSpec::validate`], filled in by [`load`] and [`parse_str`].
        origin: Option<String>,
        /// Dotted path of the field.
        field: String,
        reason: String,
        /// The override that set this field, if one did.
        set: Option<String>,
    },
}

fn located(origin: &str, location: Option<(u64, u64)>) -> String {
    match location {
        Some((line, column)) => format!("{origin}:{line}:{column}: "),
        None => format!("{origin}: "),
    }
}

fn field_prefix(field: &str) -> String {
    if field.is_empty() {
        String::new()
    } else {
        format!("{field}: ")
    }
}

fn origin_prefix(origin: &Option<String>) -> String {
    origin
        .as_ref()
        .map(|o| format!("{o}: "))
        .unwrap_or_default()
}

fn set_by(set: &Option<String>) -> String {
    set.as_ref()
        .map(|s| format!(" (from --set {s})"))
        .unwrap_or_default()
}

fn invalid(field: &str, reason: impl Into<String>) -> SpecError {
    SpecError::Invalid {
        origin: None,
        field: field.to_string(),
        reason: reason.into(),
        set: None,
    }
}

/// Escapes control characters so that text from the file or command line cannot break the
/// one-line shape of a message.
fn one_line(text: &str) -> String {
    if !text.chars().any(char::is_control) {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            let _ = write!(out, "{}", c.escape_debug());
        } else {
            out.push(c);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------------

/// Reads the job file at `path`, applies the `--set key.path=value` `overrides` in order, and
/// validates the result. Error messages name the file as `path` was written.
pub fn load(path: &Path, overrides: &[String]) -> Result<JobSpec, SpecError> {
    load_on(path, overrides, None)
}

/// [`load`], run on `backend` instead of the job file's `backend.name` (`--backend NAME`): the job file's
/// section for that platform applies.
pub fn load_on(
    path: &Path,
    overrides: &[String],
    backend: Option<BackendKind>,
) -> Result<JobSpec, SpecError> {
    let text = std::fs::read_to_string(path).map_err(|source| SpecError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut spec = parse_str_on(&text, &path.display().to_string(), overrides, backend)?;
    if let Some(file) = spec.scaling_file.take() {
        let file = path.parent().unwrap_or(Path::new(".")).join(file);
        // a policy file that is not there or not readable is named with the job file and the field
        let policy = load_policy(&file).map_err(|e| match e {
            SpecError::Read { path: file, source } => SpecError::Invalid {
                origin: Some(path.display().to_string()),
                field: "scaling_file".into(),
                reason: format!(
                    "{}: cannot read the scaling policy: {source}",
                    file.display()
                ),
                set: None,
            },
            other => other,
        })?;
        check_policy_workers(&spec, &policy).map_err(|e| match e {
            SpecError::Invalid { field, reason, .. } => SpecError::Invalid {
                origin: Some(path.display().to_string()),
                field,
                reason,
                set: None,
            },
            other => other,
        })?;
        spec.scaling = Some(policy);
    }
    Ok(spec)
}

/// Reads and checks a scaling-policy file; every problem is reported with its line and column.
pub fn load_policy(file: &Path) -> Result<physalia_policies::PolicySet, SpecError> {
    let text = std::fs::read_to_string(file).map_err(|source| SpecError::Read {
        path: file.to_path_buf(),
        source,
    })?;
    let origin = file.display().to_string();
    let policy = physalia_policies::parse_str(&text, &origin).map_err(|e| SpecError::Policy {
        errors: e.0.iter().map(|e| one_line(&e.to_string())).collect(),
    })?;
    policy_errors(&policy, &text, &origin, "")?;
    Ok(policy)
}

fn policy_errors(
    policy: &physalia_policies::PolicySet,
    text: &str,
    origin: &str,
    under: &str,
) -> Result<(), SpecError> {
    let errors = physalia_policies::check(policy);
    if errors.is_empty() {
        return Ok(());
    }
    Err(SpecError::Policy {
        errors: physalia_policies::locate(errors, text, origin, under)
            .iter()
            .map(|e| one_line(&e.to_string()))
            .collect(),
    })
}

/// The job's worker count must lie within the policy's bounds.
fn check_policy_workers(
    spec: &JobSpec,
    policy: &physalia_policies::PolicySet,
) -> Result<(), SpecError> {
    if !(policy.min_workers..=policy.max_workers).contains(&spec.workers) {
        return Err(invalid(
            "workers",
            format!(
                "{} lies outside the scaling policy's min_workers..max_workers = {}..{}",
                spec.workers, policy.min_workers, policy.max_workers
            ),
        ));
    }
    Ok(())
}

/// Parses a job from YAML `text`, applies `overrides` (each `key.path=value`, the value read as
/// YAML, so `train.lr=0.005` is a number and `model.kind=gat` a string; missing mapping keys
/// are created) and validates the result. `origin` names the text in error messages.
#[allow(dead_code)] // the tests' entry point; the CLI reads files through `load_on`
pub fn parse_str(text: &str, origin: &str, overrides: &[String]) -> Result<JobSpec, SpecError> {
    parse_str_on(text, origin, overrides, None)
}

/// [`parse_str`] on `backend` instead of the file's `backend.name`.
pub fn parse_str_on(
    text: &str,
    origin: &str,
    overrides: &[String],
    backend: Option<BackendKind>,
) -> Result<JobSpec, SpecError> {
    let origin = one_line(origin);
    let mut spec = if overrides.is_empty() {
        parse_located::<JobSpec>(text).map_err(|e| e.in_file(&origin))?
    } else {
        parse_with_overrides(text, &origin, overrides)?
    };
    if let Some(backend) = backend {
        spec.backend.name = backend;
    }
    spec.validate().map_err(|e| match e {
        SpecError::Invalid {
            field, reason, set, ..
        } => {
            let set = set.or_else(|| blame(overrides, &field).map(one_line));
            SpecError::Invalid {
                origin: Some(origin.clone()),
                field,
                reason,
                set,
            }
        }
        other => other,
    })?;
    if let Some(policy) = &spec.scaling {
        policy_errors(policy, text, &origin, "scaling")?;
    }
    Ok(spec)
}

/// The JSON Schema (draft 2020-12) of a job file, with the field docs as descriptions.
pub fn json_schema() -> Value {
    schemars::schema_for!(JobSpec).to_value()
}

/// A deserialization failure, before it is tied to a file or an override.
#[derive(Debug, Clone, PartialEq)]
struct RawError {
    location: Option<(u64, u64)>,
    field: String,
    message: String,
}

impl RawError {
    fn in_file(self, origin: &str) -> SpecError {
        SpecError::Parse {
            origin: origin.to_string(),
            location: self.location,
            field: self.field,
            message: self.message,
        }
    }

    /// Same problem, wherever it was found.
    fn same_problem(&self, other: &RawError) -> bool {
        self.field == other.field && self.message == other.message
    }
}

fn saphyr_options() -> serde_saphyr::Options {
    let mut options = serde_saphyr::Options::default();
    options.with_snippet = false;
    // `.inf` read into a generic value stays the text `.inf` (a JSON number cannot hold it), so
    // that it reaches the float field, and then validation, the same way with overrides as
    // without.
    options.non_finite_float_policy = serde_saphyr::NonFiniteFloatPolicy::AsString;
    options
}

/// Deserializes `text` into `T`, keeping the parser's location and the failing field's path.
fn parse_located<T: DeserializeOwned>(text: &str) -> Result<T, RawError> {
    let mut field = String::new();
    let result = serde_saphyr::with_deserializer_from_str_with_options(
        text,
        saphyr_options(),
        |deserializer| {
            serde_path_to_error::deserialize::<_, T>(deserializer).map_err(|e| {
                field = path_string(e.path());
                e.into_inner()
            })
        },
    );
    result.map_err(|e| RawError {
        location: e
            .location()
            .filter(|l| l.line() > 0)
            .map(|l| (l.line(), l.column())),
        field: one_line(&field),
        message: one_line(&saphyr_message(&e)),
    })
}

fn path_string(path: &serde_path_to_error::Path) -> String {
    let text = path.to_string();
    if text == "." { String::new() } else { text }
}

/// The message of a saphyr error without its location suffix or snippet.
fn saphyr_message(e: &serde_saphyr::Error) -> String {
    use serde_saphyr::MessageFormatter as _;
    let message: Cow<'_, str> =
        serde_saphyr::DefaultMessageFormatter.format_message(e.without_snippet());
    message.into_owned()
}

/// A parsed `--set key.path=value`.
struct Override<'a> {
    keys: Vec<&'a str>,
    value: Value,
}

fn parse_override(text: &str) -> Result<Override<'_>, String> {
    let Some((key, value)) = text.split_once('=') else {
        return Err("expected key.path=value".to_string());
    };
    let key = key.trim();
    if key.is_empty() {
        return Err("expected key.path=value, the key is empty".to_string());
    }
    let keys: Vec<&str> = key.split('.').collect();
    if keys.iter().any(|k| k.trim().is_empty()) {
        return Err(format!("empty segment in key path `{key}`"));
    }
    let keys = keys.into_iter().map(str::trim).collect();
    let value = value.trim();
    // An empty value is YAML's empty scalar, null, as in `key:`.
    let value = if value.is_empty() {
        Value::Null
    } else {
        serde_saphyr::from_str_with_options::<Value>(value, saphyr_options())
            .map_err(|e| format!("value is not valid YAML: {}", saphyr_message(&e)))?
    };
    Ok(Override { keys, value })
}

fn apply_override(root: &mut Value, over: &Override<'_>) -> Result<(), String> {
    let Some((last, parents)) = over.keys.split_last() else {
        return Err("expected key.path=value".to_string());
    };
    let mut node = root;
    for (depth, key) in parents.iter().enumerate() {
        let map = as_mapping(node, &over.keys[..depth])?;
        let child = map.entry(key.to_string()).or_insert(Value::Null);
        // A null (`key:` or absent) becomes the mapping the path asks for.
        if child.is_null() {
            *child = Value::Object(serde_json::Map::new());
        }
        node = child;
    }
    let map = as_mapping(node, parents)?;
    map.insert(last.to_string(), over.value.clone());
    Ok(())
}

fn as_mapping<'v>(
    node: &'v mut Value,
    keys: &[&str],
) -> Result<&'v mut serde_json::Map<String, Value>, String> {
    let kind = match node {
        Value::Object(_) => "",
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a sequence",
    };
    match node {
        Value::Object(map) => Ok(map),
        _ if keys.is_empty() => Err(format!("the document is {kind}, not a mapping")),
        _ => Err(format!("`{}` is {kind}, not a mapping", keys.join("."))),
    }
}

/// The last override whose key is the field, inside it, or contains it.
fn blame<'a>(overrides: &'a [String], field: &str) -> Option<&'a str> {
    overrides.iter().rev().map(String::as_str).find(|text| {
        let key = text.split_once('=').map_or(*text, |(k, _)| k).trim();
        let key: String = key.split('.').map(str::trim).collect::<Vec<_>>().join(".");
        related(&key, field)
    })
}

fn related(a: &str, b: &str) -> bool {
    let under = |inner: &str, outer: &str| {
        inner == outer
            || outer.is_empty()
            || inner
                .strip_prefix(outer)
                .is_some_and(|r| r.starts_with('.'))
    };
    under(a, b) || under(b, a)
}

fn parse_with_overrides(
    text: &str,
    origin: &str,
    overrides: &[String],
) -> Result<JobSpec, SpecError> {
    let file_error = || parse_located::<JobSpec>(text).err();
    let mut root: Value = match parse_located::<Value>(text) {
        Ok(root) => root,
        // The schema-aware parse gives a better message where it fails too.
        Err(e) => return Err(file_error().unwrap_or(e).in_file(origin)),
    };
    for text_set in overrides {
        let over_err = |message: String| SpecError::Override {
            origin: origin.to_string(),
            set: one_line(text_set),
            field: String::new(),
            message: one_line(&message),
        };
        let over = parse_override(text_set).map_err(over_err)?;
        if let Err(message) = apply_override(&mut root, &over) {
            // A document that is not a mapping is the file's fault; say where.
            if let Some(e) = file_error() {
                return Err(e.in_file(origin));
            }
            return Err(over_err(message));
        }
    }
    let merged = serde_saphyr::to_string(&root).map_err(|e| SpecError::Override {
        origin: origin.to_string(),
        set: one_line(&overrides.join(" --set ")),
        field: String::new(),
        message: one_line(&format!("cannot re-encode the overridden job: {e}")),
    })?;
    match parse_located::<JobSpec>(&merged) {
        Ok(spec) => Ok(spec),
        Err(merged_err) => {
            if let Some(file_err) = file_error()
                && file_err.same_problem(&merged_err)
            {
                return Err(file_err.in_file(origin));
            }
            let set = blame(overrides, &merged_err.field)
                .map(one_line)
                .unwrap_or_else(|| one_line(&overrides.join(" --set ")));
            Err(SpecError::Override {
                origin: origin.to_string(),
                set,
                field: merged_err.field,
                message: merged_err.message,
            })
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------------

impl JobSpec {
    /// Retries in a row of a lost worker's epoch before the job fails.
    pub fn max_retries(&self) -> u32 {
        self.max_retries.unwrap_or(DEFAULT_MAX_RETRIES)
    }

    /// Whether a resize of this job keeps the survivors in place (issue 33): partition parallelism
    /// with one part per worker, data parallelism or P3 (not replica groups), on a dataset file
    /// (`chunked`: a chunked one restarts), unless the policy asks for restarts; on every platform (a
    /// survivor rebinds its fixed mesh port once its link is closed; joiners start as a launch of their
    /// own on the job's network, their control endpoint beside the running one's). The coordinator
    /// decides by it, `plan --replay` prices by it, the preflight counts by it.
    pub fn resizes_in_place(&self, chunked: bool) -> bool {
        !chunked
            && !matches!(self.parallelism, ParallelismSpec::Groups(_))
            && self
                .scaling
                .as_ref()
                .is_none_or(|p| p.resize == physalia_policies::Resize::InPlace)
    }

    /// The training mode (a replica group trains in its group's mode).
    pub fn mode(&self) -> Parallelism {
        match self.parallelism {
            ParallelismSpec::Mode(m) => m,
            ParallelismSpec::Groups(GroupsSpec { data: Some(_), .. }) => Parallelism::Data,
            ParallelismSpec::Groups(_) => Parallelism::Partition,
        }
    }

    /// Parts of the partitioning the workers train on: `k` of `{partition|data: k, replicas: r}`, else the
    /// worker count.
    pub fn parts(&self) -> u32 {
        match self.parallelism {
            ParallelismSpec::Groups(g) => g.partition.or(g.data).unwrap_or(1),
            ParallelismSpec::Mode(_) => self.workers,
        }
    }

    /// Checks ranges and combinations the types cannot express; the first problem found, in
    /// document order, is returned as [`SpecError::Invalid`].
    pub fn validate(&self) -> Result<(), SpecError> {
        if let Some(name) = &self.name
            && !is_valid_name(name)
        {
            return Err(invalid(
                "name",
                format!(
                    "must be 1 to {MAX_NAME_LEN} letters, digits, '.', '_' or '-', not \
                     starting with '.' or '-', got {:?}",
                    one_line(name)
                ),
            ));
        }
        self.dataset.validate()?;
        self.model.validate()?;
        self.train.validate()?;
        if self.workers == 0 {
            return Err(invalid("workers", "must be >= 1, got 0"));
        }
        if self.workers > u32::from(u16::MAX) {
            return Err(invalid(
                "workers",
                format!("must be at most {}, got {}", u16::MAX, self.workers),
            ));
        }
        self.validate_exchange()?;
        self.validate_resources()?;
        self.validate_minibatch()?;
        self.validate_parallelism()?;
        self.validate_scaling()?;
        self.validate_limits()?;
        if self.workers > 1 && self.train.runs > 1 {
            return Err(invalid(
                "train.runs",
                format!(
                    "repeated runs need workers: 1, got {} runs on {} workers",
                    self.train.runs, self.workers
                ),
            ));
        }
        self.backend.validate()?;
        // with a `goal:` and no SKU named, the planner picks the SKU
        if self.goal.is_none() || self.backend.sku().is_some() {
            self.backend
                .priced(&physalia_planner::Catalog::builtin(), None)?;
        }
        if self.train.runs > 1 && !self.backend.section()?.trains_in_this_process() {
            return Err(invalid(
                "train.runs",
                format!(
                    "repeated runs run in this process; the {} backend runs one job of workers",
                    self.backend.name.as_str()
                ),
            ));
        }
        if self.output.dir.as_os_str().is_empty() {
            return Err(invalid("output.dir", "must not be empty"));
        }
        Ok(())
    }

    /// `exchange:`: boundary sampling, staleness and rematerialisation, and what they exclude.
    fn validate_exchange(&self) -> Result<(), SpecError> {
        if let Some(x) = &self.exchange {
            let p = x.boundary_sampling;
            if !(p.is_finite() && p > 0.0 && p <= 1.0) {
                return Err(invalid(
                    "exchange.boundary_sampling",
                    format!("must be in (0, 1], got {p}"),
                ));
            }
            if let Some(t) = x.staleness_threshold {
                if !(t.is_finite() && t > 0.0) {
                    return Err(invalid(
                        "exchange.staleness_threshold",
                        format!("must be > 0, got {t}"),
                    ));
                }
                if x.staleness == 0 {
                    return Err(invalid(
                        "exchange.staleness_threshold",
                        "needs exchange.staleness above 0 (the oldest a reused row may be)"
                            .to_string(),
                    ));
                }
                if p < 1.0 {
                    return Err(invalid(
                        "exchange.staleness_threshold",
                        "cannot be combined with exchange.boundary_sampling below 1".to_string(),
                    ));
                }
            }
            if x.rematerialize {
                if p < 1.0 || x.staleness > 0 {
                    return Err(invalid(
                        "exchange.rematerialize",
                        "fetches halo rows again in backward, so it cannot be combined with \
                         exchange.boundary_sampling below 1 or exchange.staleness above 0"
                            .to_string(),
                    ));
                }
                if self.resources.as_ref().is_some_and(|r| r.gpu.is_some()) {
                    return Err(invalid(
                        "exchange.rematerialize",
                        "runs on CPU workers only (the GPU engine keeps every halo row on the device); \
                         drop resources.gpu or the option"
                            .to_string(),
                    ));
                }
            }
        }
        Ok(())
    }

    /// `resources:`: the GPU request and its CPU fallback.
    fn validate_resources(&self) -> Result<(), SpecError> {
        if let Some(r) = &self.resources {
            if let Some(g) = &r.gpu {
                if g.count == 0 || g.count > 16 {
                    return Err(invalid(
                        "resources.gpu.count",
                        format!("must be 1 to 16, got {}", g.count),
                    ));
                }
                if g.model.as_deref().is_some_and(|m| m.trim().is_empty()) {
                    return Err(invalid(
                        "resources.gpu.model",
                        "must name a GPU model (or be left out for any)",
                    ));
                }
                if self.mode() == Parallelism::Model {
                    return Err(invalid(
                        "resources.gpu",
                        "GPU workers train full-graph (`parallelism: partition`) and data-parallel \
                         mini-batches (`parallelism: data`); model parallelism (P3) runs on the CPU: drop \
                         `resources.gpu` or use another parallelism",
                    ));
                }
            } else if r.gpu_fallback == GpuFallback::Cpu {
                return Err(invalid(
                    "resources.gpu_fallback",
                    "applies to GPU workers: set `resources.gpu` too",
                ));
            }
        }
        Ok(())
    }

    /// `minibatch:`: fan-outs per layer, batch size, loaders; data and model parallelism only.
    fn validate_minibatch(&self) -> Result<(), SpecError> {
        if let Some(mb) = &self.minibatch {
            if !mb.fanouts.is_empty() && mb.fanouts.len() != self.model.layers as usize {
                return Err(invalid(
                    "minibatch.fanouts",
                    format!(
                        "needs one fan-out per layer ({}), got {}",
                        self.model.layers,
                        mb.fanouts.len()
                    ),
                ));
            }
            if let Some(f) = mb
                .fanouts
                .iter()
                .find(|&&f| f == 0 || f < -1 || f > i64::from(u32::MAX))
            {
                return Err(invalid(
                    "minibatch.fanouts",
                    format!("each fan-out is a positive count or -1 (every neighbour), got {f}"),
                ));
            }
            if mb.batch_size == 0 {
                return Err(invalid("minibatch.batch_size", "must be >= 1, got 0"));
            }
            if mb.loader_threads == 0 || mb.prefetch == 0 {
                return Err(invalid(
                    "minibatch.loader_threads",
                    "loader_threads and prefetch must be >= 1",
                ));
            }
            if self.mode() == Parallelism::Partition {
                return Err(invalid(
                    "minibatch",
                    "is used by `parallelism: data` or `parallelism: model`; partition parallelism trains on the full graph",
                ));
            }
        }
        Ok(())
    }

    /// `parallelism:` and `workers`: replica groups that add up, what each mode allows.
    fn validate_parallelism(&self) -> Result<(), SpecError> {
        if let ParallelismSpec::Groups(g) = self.parallelism {
            let k = match (g.partition, g.data) {
                (Some(k), None) | (None, Some(k)) => k,
                _ => {
                    return Err(invalid(
                        "parallelism",
                        "give exactly one of `partition: k` or `data: k` with `replicas: r`",
                    ));
                }
            };
            if k == 0 || g.replicas == 0 {
                return Err(invalid(
                    "parallelism",
                    format!(
                        "parts and replicas must be >= 1, got {k} and {}",
                        g.replicas
                    ),
                ));
            }
            if u64::from(k) * u64::from(g.replicas) != u64::from(self.workers) {
                return Err(invalid(
                    "workers",
                    format!(
                        "must equal parts x replicas = {k} x {} = {}, got {}",
                        g.replicas,
                        u64::from(k) * u64::from(g.replicas),
                        self.workers
                    ),
                ));
            }
        }
        if self.mode() != Parallelism::Partition && self.exchange.is_some() {
            return Err(invalid(
                "exchange",
                "boundary sampling, staleness and compressed halo rows apply to partition parallelism only",
            ));
        }
        if self.mode() == Parallelism::Model {
            if self.model.kind == ModelKind::Gat {
                return Err(invalid(
                    "parallelism",
                    "model parallelism (P3) splits the first layer by input columns; GAT's attention needs whole rows: use gcn or sage, or data parallelism",
                ));
            }
            if self.model.layers < 2 {
                return Err(invalid(
                    "parallelism",
                    "model parallelism needs at least 2 layers (the first is split by columns)",
                ));
            }
        }
        Ok(())
    }

    /// `scaling:` / `scaling_file:`: one policy, within the job's worker bounds, not on replica groups.
    fn validate_scaling(&self) -> Result<(), SpecError> {
        if self.scaling.is_some() && self.scaling_file.is_some() {
            return Err(invalid(
                "scaling_file",
                "give the policy inline (`scaling`) or in a file (`scaling_file`), not both",
            ));
        }
        if let Some(policy) = &self.scaling
            && physalia_policies::check(policy).is_empty()
        {
            check_policy_workers(self, policy)?;
        }
        // Partition, data and model parallelism checkpoint every epoch and resume exactly with any worker
        // count (batch_size is the global batch), so a policy may resize them. Replica groups may not: a
        // resize sets any count in min_workers..max_workers (set, add or multiply, clamped), while their
        // ranks must be replica * k + part with the job file's k, so most counts cannot be laid out, and
        // `replicas` would no longer say how many groups run.
        if (self.scaling.is_some() || self.scaling_file.is_some())
            && let ParallelismSpec::Groups(g) = self.parallelism
        {
            let k = g.partition.or(g.data).unwrap_or(1);
            let mode = if g.data.is_some() {
                "data"
            } else {
                "partition"
            };
            return Err(invalid(
                "scaling",
                format!(
                    "scaling policies resize partition-, data- and model-parallel jobs, not replica groups: a \
                     resize may pick any worker count in min_workers..max_workers, but {k} parts x {} \
                     replicas need a multiple of {k}; use `parallelism: {mode}` to let the policy choose \
                     the worker count",
                    g.replicas,
                ),
            ));
        }
        Ok(())
    }

    /// `max_retries` and `timeouts:`.
    fn validate_limits(&self) -> Result<(), SpecError> {
        if let Some(r) = self.max_retries
            && r > MAX_RETRIES_LIMIT
        {
            return Err(invalid(
                "max_retries",
                format!("at most {MAX_RETRIES_LIMIT} retries in a row, got {r}"),
            ));
        }
        if let Some(t) = &self.timeouts {
            for (field, v) in [
                ("timeouts.register_s", t.register_s),
                ("timeouts.epoch_s", t.epoch_s),
            ] {
                if !(v.is_finite() && v > 0.0 && v <= 1e6) {
                    return Err(invalid(field, format!("must be > 0 seconds, got {v}")));
                }
            }
        }
        Ok(())
    }

    /// The job's name: `name` if set, otherwise the stem of the job file with characters that
    /// are not allowed in names replaced by `-` (`job` if nothing is left).
    pub fn job_name(&self, file: &Path) -> String {
        if let Some(name) = &self.name {
            return name.clone();
        }
        let stem = file
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let cleaned: String = stem
            .chars()
            .map(|c| if is_name_char(c) { c } else { '-' })
            .collect();
        let cleaned: String = cleaned
            .trim_start_matches(['.', '-'])
            .chars()
            .take(MAX_NAME_LEN)
            .collect();
        if cleaned.is_empty() {
            "job".to_string()
        } else {
            cleaned
        }
    }
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name.chars().all(is_name_char)
        && !name.starts_with(['.', '-'])
}

impl DatasetSpec {
    fn validate(&self) -> Result<(), SpecError> {
        if let Some(st) = &self.stats {
            if self.path.is_some() || self.synth.is_some() {
                return Err(invalid(
                    "dataset",
                    "set exactly one of `path`, `synth` or `stats`; `stats` describes a graph that is \
                     not here",
                ));
            }
            if self.format != DatasetFormat::Auto {
                return Err(invalid(
                    "dataset.format",
                    "applies only to `dataset.path`, not to `stats`",
                ));
            }
            let positive = [
                ("nodes", st.nodes),
                ("edges", st.edges),
                ("feat_dim", u64::from(st.feat_dim)),
                ("train_nodes", st.train_nodes),
            ];
            if let Some((field, _)) = positive.iter().find(|(_, v)| *v == 0) {
                return Err(invalid(
                    &format!("dataset.stats.{field}"),
                    "must be >= 1, got 0",
                ));
            }
            if st.classes < 2 {
                return Err(invalid(
                    "dataset.stats.classes",
                    format!(
                        "node classification needs at least 2 classes, got {}",
                        st.classes
                    ),
                ));
            }
            if st.train_nodes > st.nodes {
                return Err(invalid(
                    "dataset.stats.train_nodes",
                    format!(
                        "{} training nodes in a graph of {} nodes",
                        st.train_nodes, st.nodes
                    ),
                ));
            }
            return Ok(());
        }
        match (&self.path, &self.synth) {
            (Some(_), Some(_)) => Err(invalid(
                "dataset",
                "set exactly one of `path` or `synth`, both are set",
            )),
            (None, None) => Err(invalid(
                "dataset",
                "set exactly one of `path` or `synth`, neither is set",
            )),
            (Some(path), None) => {
                if path.as_os_str().is_empty() {
                    return Err(invalid("dataset.path", "must not be empty"));
                }
                Ok(())
            }
            (None, Some(synth)) => {
                if self.format != DatasetFormat::Auto {
                    return Err(invalid(
                        "dataset.format",
                        "applies only to `dataset.path`, not to `synth`",
                    ));
                }
                synth.validate()
            }
        }
    }
}

/// Field names and whether each is set.
type FieldsSet<'a> = &'a [(&'a str, bool)];

impl SynthSpec {
    fn validate(&self) -> Result<(), SpecError> {
        let (needed, foreign): (FieldsSet<'_>, FieldsSet<'_>) = match self.kind {
            SynthKind::Sbm => (
                &[
                    ("nodes", self.nodes.is_some()),
                    ("avg_degree", self.avg_degree.is_some()),
                ],
                &[
                    ("scale", self.scale.is_some()),
                    ("edge_factor", self.edge_factor.is_some()),
                ],
            ),
            SynthKind::Rmat => (
                &[
                    ("scale", self.scale.is_some()),
                    ("edge_factor", self.edge_factor.is_some()),
                ],
                &[
                    ("nodes", self.nodes.is_some()),
                    ("avg_degree", self.avg_degree.is_some()),
                    ("homophily", self.homophily.is_some()),
                ],
            ),
        };
        let kind = match self.kind {
            SynthKind::Sbm => "sbm",
            SynthKind::Rmat => "rmat",
        };
        if let Some((field, _)) = needed.iter().find(|(_, set)| !set) {
            return Err(invalid(
                &format!("dataset.synth.{field}"),
                format!("is required when kind is {kind}"),
            ));
        }
        if let Some((field, _)) = foreign.iter().find(|(_, set)| *set) {
            return Err(invalid(
                &format!("dataset.synth.{field}"),
                format!("does not apply when kind is {kind}"),
            ));
        }
        if let Some(nodes) = self.nodes
            && nodes < u64::from(self.classes.max(1))
        {
            return Err(invalid(
                "dataset.synth.nodes",
                format!(
                    "must be at least the number of classes ({}), got {nodes}",
                    self.classes
                ),
            ));
        }
        if let Some(scale) = self.scale
            && !(1..=MAX_RMAT_SCALE).contains(&scale)
        {
            return Err(invalid(
                "dataset.synth.scale",
                format!("must be in 1..={MAX_RMAT_SCALE}, got {scale}"),
            ));
        }
        if self.edge_factor == Some(0) {
            return Err(invalid("dataset.synth.edge_factor", "must be >= 1, got 0"));
        }
        if self.classes < 2 {
            return Err(invalid(
                "dataset.synth.classes",
                format!("must be >= 2, got {}", self.classes),
            ));
        }
        if let Some(degree) = self.avg_degree
            && !(degree.is_finite() && degree > 0.0)
        {
            return Err(invalid(
                "dataset.synth.avg_degree",
                format!("must be > 0 and finite, got {degree}"),
            ));
        }
        if let Some(homophily) = self.homophily
            && !(0.0..=1.0).contains(&homophily)
        {
            return Err(invalid(
                "dataset.synth.homophily",
                format!("must be in [0, 1], got {homophily}"),
            ));
        }
        if self.feat_dim == 0 {
            return Err(invalid("dataset.synth.feat_dim", "must be >= 1, got 0"));
        }
        Ok(())
    }
}

fn check_probability(field: &str, p: f64) -> Result<(), SpecError> {
    if (0.0..1.0).contains(&p) {
        Ok(())
    } else {
        Err(invalid(field, format!("must be in [0, 1), got {p}")))
    }
}

impl ModelSpec {
    fn validate(&self) -> Result<(), SpecError> {
        if self.layers == 0 {
            return Err(invalid("model.layers", "must be >= 1, got 0"));
        }
        if self.hidden == 0 {
            return Err(invalid("model.hidden", "must be >= 1, got 0"));
        }
        if self.kind != ModelKind::Gat {
            let kind = self.kind.as_str();
            let gat_only = [
                ("heads", self.heads.is_some()),
                ("out_heads", self.out_heads.is_some()),
                ("attn_dropout", self.attn_dropout.is_some()),
                ("negative_slope", self.negative_slope.is_some()),
            ];
            if let Some((field, _)) = gat_only.iter().find(|(_, set)| *set) {
                return Err(invalid(
                    &format!("model.{field}"),
                    format!(
                        "applies only to gat, but model.kind is {kind} (remove it or set it to null)"
                    ),
                ));
            }
        }
        if self.heads == Some(0) {
            return Err(invalid("model.heads", "must be >= 1, got 0"));
        }
        if self.out_heads == Some(0) {
            return Err(invalid("model.out_heads", "must be >= 1, got 0"));
        }
        check_probability("model.dropout", self.dropout)?;
        if let Some(p) = self.input_dropout {
            check_probability("model.input_dropout", p)?;
        }
        if let Some(p) = self.attn_dropout {
            check_probability("model.attn_dropout", p)?;
        }
        if let Some(slope) = self.negative_slope
            && !(slope.is_finite() && slope >= 0.0)
        {
            return Err(invalid(
                "model.negative_slope",
                format!("must be >= 0 and finite, got {slope}"),
            ));
        }
        Ok(())
    }
}

impl TrainSpec {
    fn validate(&self) -> Result<(), SpecError> {
        if self.epochs == 0 {
            return Err(invalid("train.epochs", "must be >= 1, got 0"));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(invalid(
                "train.lr",
                format!("must be > 0 and finite, got {}", self.lr),
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(invalid(
                "train.weight_decay",
                format!("must be >= 0 and finite, got {}", self.weight_decay),
            ));
        }
        if self.runs == 0 {
            return Err(invalid("train.runs", "must be >= 1, got 0"));
        }
        if self.threads == Some(0) {
            return Err(invalid("train.threads", "must be >= 1, got 0"));
        }
        if self.eval_every == 0 {
            return Err(invalid("train.eval_every", "must be >= 1, got 0"));
        }
        if self.patience == Some(0) {
            return Err(invalid("train.patience", "must be >= 1, got 0"));
        }
        Ok(())
    }
}
