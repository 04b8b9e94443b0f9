//! The worker side of partition-parallel training: one partition of the graph, the engine, and a wire link
//! to the other workers.
//!
//! [`train_part`] is everything a worker does between joining the mesh and reporting its result; the
//! `physalia-worker` binary wraps it with registration and the QUIC mesh, tests wrap it with threads and
//! the in-memory link.

pub mod cut;
pub mod delta;
pub mod exchange;
pub mod logging;
pub mod minibatch;
pub mod run;
pub mod secrets;
pub mod seed;

use physalia_gnn::{
    LayerKind, LocalGraph, Matrix, Model, ModelConfig, NodeSets, TrainConfig, TrainSummary,
};
use physalia_graph::partition::Part;
use physalia_wire::Link;

pub use exchange::MeshExchange;
pub use physalia_control::{ExchangeOptions, MiniBatchOptions};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Engine(#[from] physalia_gnn::Error),
    #[error(transparent)]
    Device(#[from] physalia_gnn_cuda::TrainError),
    #[error(transparent)]
    Gpu(#[from] physalia_gnn_cuda::GpuError),
    #[error("partition {part}: {problem}")]
    Part { part: usize, problem: String },
    #[error("{0}")]
    Config(String),
}

/// The engine's view of a partition: its local graph (owned rows, then halo sources), features and node sets.
pub fn local_inputs(
    part: &Part,
    cfg: &ModelConfig,
    row_normalize_features: bool,
) -> (LocalGraph, Matrix, NodeSets) {
    let features = part.features.view().to_f32().into_owned();
    local_inputs_with(
        part,
        features,
        local_graph(part, cfg.kind),
        row_normalize_features,
    )
}

/// The engine's local graph of `part` for layers of `kind`: its owned rows, then its halo sources, with
/// the operators those layers aggregate with. A pure function of the part's structure, so it can be built
/// ahead of the training that uses it (an in-place resize's part, made beside training).
pub fn local_graph(part: &Part, kind: LayerKind) -> LocalGraph {
    let n_own = part.owned.len();
    let n_src = n_own + part.halo.len();
    let gids: Vec<u32> = part.owned.iter().chain(&part.halo).copied().collect();
    LocalGraph::new(
        kind,
        n_own,
        n_src,
        &part.indptr,
        &part.indices,
        Some(&part.src_in_degree),
        Some(gids),
    )
}

/// [`local_inputs`] with the part's features already as f32 rows (taken out of the part, not copied) and
/// its graph built.
fn local_inputs_with(
    part: &Part,
    features: Vec<f32>,
    graph: LocalGraph,
    row_normalize_features: bool,
) -> (LocalGraph, Matrix, NodeSets) {
    let n_own = part.owned.len();
    let mut x = Matrix::from_vec(n_own, part.feat_dim, features);
    if row_normalize_features {
        x.row_normalize();
    }
    let sets = NodeSets {
        labels: part.labels.clone(),
        train: part.train.clone(),
        val: part.val.clone(),
        test: part.test.clone(),
    };
    (graph, x, sets)
}

/// `(replicas, replica)` of a worker holding `part` at `rank` of `world` (rank = replica * k + part).
pub fn replica_of(part: &Part, rank: usize, world: usize) -> Result<(usize, usize), Error> {
    let k = part.k.max(1);
    if !world.is_multiple_of(k) || rank % k != part.part {
        return Err(Error::Part {
            part: part.part,
            problem: format!(
                "rank {rank} of {world} cannot hold part {} of {k}: ranks are replica * {k} + part",
                part.part
            ),
        });
    }
    Ok((world / k, rank / k))
}

/// The replica that trains on node `v` when `replicas` replicas split the training nodes.
pub fn owner_replica(v: u32, replicas: usize) -> usize {
    (physalia_gnn::rng::mix64(u64::from(v)) % replicas.max(1) as u64) as usize
}

/// Where a worker's full-graph training runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The CPU engine (`physalia_gnn`).
    Cpu,
    /// The CUDA engine (`physalia_gnn_cuda`) on GPU `index` as the driver numbers the visible devices.
    Cuda { index: usize },
    /// The GPU's path without a GPU (tests): the device training loops on `physalia_gnn::CpuPrimitives` (the
    /// CPU's primitives, the device trait's default layer-level operations, as on a GPU), with halo rows
    /// leaving and entering the device as on the GPU. Unlike the GPU it accepts `exchange.rematerialize`, so
    /// the trait's SAR defaults are checked too.
    Emulated,
}

/// Trains this worker's partition with its peers over `link`. Every worker of the job calls this with the
/// same configuration and seed; the model's weights stay identical on all of them.
#[allow(clippy::too_many_arguments)]
pub fn train_part<L: Link + ?Sized>(
    link: &mut L,
    part: &Part,
    cfg: &ModelConfig,
    seed: u64,
    tc: &TrainConfig,
    opts: &ExchangeOptions,
    row_normalize_features: bool,
    on_epoch: &mut dyn FnMut(&physalia_gnn::EpochMetrics),
) -> Result<(Model, TrainSummary), Error> {
    train_part_on(
        Device::Cpu,
        link,
        part,
        cfg,
        seed,
        tc,
        opts,
        row_normalize_features,
        on_epoch,
    )
}

/// [`train_part`] on `device`.
#[allow(clippy::too_many_arguments)]
pub fn train_part_on<L: Link + ?Sized>(
    device: Device,
    link: &mut L,
    part: &Part,
    cfg: &ModelConfig,
    seed: u64,
    tc: &TrainConfig,
    opts: &ExchangeOptions,
    row_normalize_features: bool,
    on_epoch: &mut dyn FnMut(&physalia_gnn::EpochMetrics),
) -> Result<(Model, TrainSummary), Error> {
    let (model, summary, _) = train_part_from(
        device,
        link,
        part,
        cfg,
        seed,
        tc,
        opts,
        row_normalize_features,
        None,
        &mut |e| {
            on_epoch(e.metrics);
            true
        },
    )?;
    Ok((model, summary))
}

/// A training state to continue from (a loaded checkpoint).
pub struct Resume {
    pub model: Model,
    pub opt: physalia_gnn::Adam,
    pub progress: physalia_gnn::Progress,
}

impl Resume {
    /// The state training starts from: `resume`, checked to be for this model configuration and seed,
    /// or (without one) a new model and optimizer before epoch 1. Every parallelism starts here.
    pub fn or_fresh(
        resume: Option<Resume>,
        cfg: &ModelConfig,
        seed: u64,
        tc: &TrainConfig,
    ) -> Result<Resume, Error> {
        match resume {
            Some(r) => {
                if r.model.config() != cfg || r.model.seed() != seed {
                    return Err(Error::Config(
                        "the checkpoint was written for another model configuration or seed".into(),
                    ));
                }
                Ok(r)
            }
            None => {
                let model = Model::new(cfg, seed)?;
                let opt = physalia_gnn::Adam::new(&model.params, tc.lr, tc.weight_decay);
                Ok(Resume {
                    model,
                    opt,
                    progress: Default::default(),
                })
            }
        }
    }
}

/// [`train_part`] from a checkpoint (or from scratch), with a callback that sees the model and optimizer
/// after every epoch (to checkpoint them) and may stop training there.
#[allow(clippy::too_many_arguments)]
pub fn train_part_from<L: Link + ?Sized>(
    device: Device,
    link: &mut L,
    part: &Part,
    cfg: &ModelConfig,
    seed: u64,
    tc: &TrainConfig,
    opts: &ExchangeOptions,
    row_normalize_features: bool,
    resume: Option<Resume>,
    on_epoch: &mut dyn FnMut(&physalia_gnn::EpochEnd<'_>) -> bool,
) -> Result<(Model, TrainSummary, physalia_gnn::Progress), Error> {
    check_width(part, cfg)?;
    let (graph, x, sets) = local_inputs(part, cfg, row_normalize_features);
    let (state, summary) = train_inputs(
        device, link, part, graph, x, sets, cfg, seed, tc, opts, resume, on_epoch,
    )?;
    Ok((state.model, summary, state.progress))
}

/// [`train_part_from`] for a worker that owns its part: the part's feature rows and structure are released
/// as soon as the engine holds its own copies (normalised f32 rows, its operators), so one copy of each is
/// resident, not two.
#[allow(clippy::too_many_arguments)]
pub fn train_owned_part<L: Link + ?Sized>(
    device: Device,
    link: &mut L,
    part: Part,
    cfg: &ModelConfig,
    seed: u64,
    tc: &TrainConfig,
    opts: &ExchangeOptions,
    row_normalize_features: bool,
    resume: Option<Resume>,
    on_epoch: &mut dyn FnMut(&physalia_gnn::EpochEnd<'_>) -> bool,
) -> Result<(Model, TrainSummary, physalia_gnn::Progress), Error> {
    let (state, summary) = train_owned_part_state(
        device,
        link,
        part,
        None,
        cfg,
        seed,
        tc,
        opts,
        row_normalize_features,
        resume,
        on_epoch,
    )?;
    Ok((state.model, summary, state.progress))
}

/// [`train_owned_part`] returning the whole training state it ends with (model, optimizer, progress), so a
/// worker that stopped after an epoch can go on from it in memory, on another part (an in-place resize).
/// `graph`: the part's [`local_graph`] for `cfg.kind`, when it was built ahead (else it is built here).
#[allow(clippy::too_many_arguments)]
pub fn train_owned_part_state<L: Link + ?Sized>(
    device: Device,
    link: &mut L,
    mut part: Part,
    graph: Option<LocalGraph>,
    cfg: &ModelConfig,
    seed: u64,
    tc: &TrainConfig,
    opts: &ExchangeOptions,
    row_normalize_features: bool,
    resume: Option<Resume>,
    on_epoch: &mut dyn FnMut(&physalia_gnn::EpochEnd<'_>) -> bool,
) -> Result<(Resume, TrainSummary), Error> {
    check_width(&part, cfg)?;
    // f32 features move into the engine's matrix instead of being copied (one copy resident, not two)
    let features = match std::mem::replace(
        &mut part.features,
        physalia_graph::Features::F32(Vec::new()),
    ) {
        physalia_graph::Features::F32(v) => v,
        other => other.view().to_f32().into_owned(),
    };
    let t = std::time::Instant::now();
    let n_src = part.owned.len() + part.halo.len();
    // a graph built ahead is this part's when its rows are (it was built from the same part)
    let ahead = graph.filter(|g| g.n_dst() == part.owned.len() && g.n_src() == n_src);
    let built_ahead = ahead.is_some();
    let graph = ahead.unwrap_or_else(|| local_graph(&part, cfg.kind));
    let (graph, x, sets) = local_inputs_with(&part, features, graph, row_normalize_features);
    // the setup's phases are in the worker's log (an in-place resize's pause is mostly setup)
    eprintln!(
        "worker {}: the engine's local graph and features built in {:.3} s{}",
        link.rank(),
        t.elapsed().as_secs_f64(),
        if built_ahead {
            " (the graph ahead, with the part)"
        } else {
            ""
        }
    );
    // the engine holds its own copies now; the exchange needs only the part's ids and send/receive lists
    part.indptr = Vec::new();
    part.indices = Vec::new();
    part.src_in_degree = Vec::new();
    part.labels = Vec::new();
    train_inputs(
        device, link, &part, graph, x, sets, cfg, seed, tc, opts, resume, on_epoch,
    )
}

fn check_width(part: &Part, cfg: &ModelConfig) -> Result<(), Error> {
    if cfg.in_dim != part.feat_dim {
        return Err(Error::Part {
            part: part.part,
            problem: format!(
                "features are {} wide, the model expects {}",
                part.feat_dim, cfg.in_dim
            ),
        });
    }
    Ok(())
}

/// Trains `part` from its engine inputs (which no longer need the part's features).
#[allow(clippy::too_many_arguments)]
fn train_inputs<L: Link + ?Sized>(
    device: Device,
    link: &mut L,
    part: &Part,
    graph: LocalGraph,
    x: Matrix,
    mut sets: NodeSets,
    cfg: &ModelConfig,
    seed: u64,
    tc: &TrainConfig,
    opts: &ExchangeOptions,
    resume: Option<Resume>,
    on_epoch: &mut dyn FnMut(&physalia_gnn::EpochEnd<'_>) -> bool,
) -> Result<(Resume, TrainSummary), Error> {
    opts.check().map_err(Error::Config)?;
    // the emulated device runs the device trait's SAR defaults (checked against the CPU's per-range kernels)
    if opts.rematerialize && matches!(device, Device::Cuda { .. }) {
        return Err(Error::Config(
            "exchange.rematerialize runs on the CPU engine only (the GPU engine keeps every halo row on the \
             device); train on the CPU or drop the option"
                .into(),
        ));
    }
    let (replicas, replica) = replica_of(part, link.rank(), link.world())?;
    // replicas of the partitioning split the training nodes; the all-reduce sums their gradients
    sets.train
        .retain(|&row| owner_replica(part.owned[row as usize], replicas) == replica);
    let Resume {
        mut model,
        mut opt,
        progress,
    } = Resume::or_fresh(resume, cfg, seed, tc)?;
    let mut ex = MeshExchange::new(link, part, opts.clone());
    // the device loop is generic over the device: the same call for the GPU and the CPU device
    macro_rules! on_device {
        ($ops:expr) => {
            physalia_gnn_cuda::train_resumable_on(
                $ops, &mut model, &mut opt, progress, &graph, &x, &sets, tc, &mut ex, on_epoch,
            )?
        };
    }
    let (summary, progress) = match device {
        // owned, so features the model stops reading (GCN's, once `A X` is cached) are freed
        Device::Cpu => physalia_gnn::train_resumable_owned(
            &mut model, &mut opt, progress, &graph, x, &sets, tc, &mut ex, on_epoch,
        )?,
        Device::Cuda { index } => on_device!(&mut physalia_gnn_cuda::CudaEngine::new(index)?),
        Device::Emulated => on_device!(&mut physalia_gnn::CpuPrimitives),
    };
    Ok((
        Resume {
            model,
            opt,
            progress,
        },
        summary,
    ))
}
