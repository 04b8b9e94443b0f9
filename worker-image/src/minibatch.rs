//! Data parallelism: mini-batch training with sampled neighbourhoods, gradients all-reduced every step.
//!
//! `batch_size` is the global batch, so what is learned does not depend on the number of workers (which
//! the planner and the scaling policies change on the user's behalf). Each epoch puts all training seeds in
//! one order keyed by (seed, epoch) alone ([`epoch_order`]), the same on every worker and for every worker
//! count; step `s` trains on the `s`-th `batch_size` seeds of it; every worker runs
//! `ceil(n_train / batch_size)` steps; and each step's loss is a mean over its global batch, so the
//! all-reduced gradient is that of the global batch. Every worker samples its part of a step with the
//! step's key ([`step_key`], a function of (seed, epoch, step) only) and a node's draw at a hop is a pure
//! function of (key, hop, node) (see [`physalia_graph::sample`] on splitting a batch), so a seed's sampled
//! neighbourhood is the same whichever worker trains it and whichever seeds share its part; dropout masks
//! are keyed by global node id and the step. One worker or many therefore compute the same steps, up to
//! float rounding.
//!
//! Every worker holds the whole graph's structure (to sample) but only the feature rows of the nodes it owns
//! (its METIS part), and trains the seeds of each step's global batch that it owns (with replicas of the
//! partitioning, split further by [`crate::owner_replica`]): sampled neighbourhoods then mostly stay in the
//! part (PaGraph's and DistDGL's locality). A worker with none of a step's seeds contributes zero gradients
//! to that step's all-reduce. Rows of input nodes that peers own come from a cache of hot remote rows,
//! chosen before training by pre-sampling this worker's own seeds (PaGraph / GNNLab), or are fetched from
//! their owners over the mesh ([`physalia_wire::fetch_rows`]) in one lockstep round per step.
//!
//! Batches are sampled, turned into the engine's blocks and gathered from local and cached rows on a pool of
//! loader threads while the trainer computes earlier ones (SALIENT's pipeline); only the fetch of uncached
//! remote rows and the all-reduce are on the trainer's thread.
//!
//! Evaluation is layer-wise full-graph inference: the partition-parallel forward pass with halo exchange,
//! exact, not sampled.
//!
//! P3 model parallelism ([`train_p3`]) reuses the sampler and the same steps: features are split by column
//! instead of by node, and each step's global batch is split into one contiguous part per worker.
//!
//! Checkpoints: both trainers take an optional [`crate::Resume`] and hand their callback the model, the
//! optimizer and the [`Progress`] after every epoch (a [`physalia_gnn::EpochEnd`], as partition
//! parallelism does), so a job can stop after any epoch and continue from its checkpoint with any worker
//! count. Nothing random is kept between epochs: the epoch's order, each step's sampling key and dropout
//! key are functions of (seed, epoch, step), so a resumed run draws what the uninterrupted one draws. The
//! remote-row cache is chosen again at the start of each run; it changes where rows come from, never what
//! is trained.

use std::time::Instant;

use physalia_gnn::loss::cross_entropy;
use physalia_gnn::rng::Stream;
use physalia_gnn::{
    Adam, BatchStats, EpochEnd, EpochMetrics, Exchange, ExchangeError, LayerKind, LocalExchange,
    LocalGraph, Matrix, Model, ModelConfig, NodeSets, Pass, Progress, TrainConfig, TrainSummary,
    close_epoch,
};
use physalia_graph::sample::{MiniBatch, Sampler, batch_key, with_prefetch_keyed};
use physalia_wire::{Dtype, Link, Phase, Tag, fetch_rows};

use crate::exchange::MeshExchange;
use crate::{Error, Resume};

pub use physalia_control::MiniBatchOptions;

/// What a data-parallel worker holds.
pub struct Shard<'a> {
    /// The whole graph's in-neighbour CSR.
    pub indptr: &'a [i64],
    pub indices: &'a [i32],
    /// Every node's owner rank and its row in the owner's features.
    pub owner: &'a [u32],
    pub row: &'a [u32],
    /// This rank's feature rows (`owned x in_dim`) and their labels.
    pub features: &'a Matrix,
    pub labels: &'a [i64],
    /// Every rank's training seeds (global ids, disjoint): each rank trains its own, and every rank orders
    /// all of them into the epoch's global batches.
    pub train_by_rank: &'a [Vec<u32>],
    /// With replicas of the partitioning: the rank of this replica group's part 0 (owners are parts, peers
    /// are `rank_base + owner`); 0 otherwise.
    pub rank_base: usize,
    /// Layer-wise inference over the owned rows (the partition, halo rows through the exchange) and the
    /// labelled rows it is scored on.
    pub eval_graph: &'a LocalGraph,
    pub eval_sets: &'a NodeSets,
}

/// Answers a peer's request for rows by id (or refuses it).
pub type ServeRows<'a> =
    dyn FnMut(usize, &[u32]) -> Result<Vec<f32>, physalia_wire::WireError> + 'a;

/// Layer-wise evaluation at the end of an epoch: train, validation and test accuracy.
type Evaluate<'a> =
    dyn FnMut(&mut Model, &mut dyn Exchange) -> Result<[Option<f64>; 3], Error> + 'a;

/// The exchange a mini-batch trainer needs: all-reduce and evaluation ([`Exchange`]) plus fetching rows by id.
pub trait Mesh: Exchange {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// [`fetch_rows`] over this exchange's link.
    fn fetch(
        &mut self,
        tag: Tag,
        requests: &[Vec<u32>],
        cols: usize,
        serve: &mut ServeRows<'_>,
    ) -> Result<Vec<Vec<f32>>, ExchangeError>;
}

impl Mesh for LocalExchange {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn fetch(
        &mut self,
        _tag: Tag,
        requests: &[Vec<u32>],
        _cols: usize,
        _serve: &mut ServeRows<'_>,
    ) -> Result<Vec<Vec<f32>>, ExchangeError> {
        Ok(vec![Vec::new(); requests.len()])
    }
}

impl<L: Link + ?Sized> Mesh for MeshExchange<'_, L> {
    fn rank(&self) -> usize {
        self.link().rank()
    }
    fn world(&self) -> usize {
        self.link().world()
    }
    fn fetch(
        &mut self,
        tag: Tag,
        requests: &[Vec<u32>],
        cols: usize,
        serve: &mut ServeRows<'_>,
    ) -> Result<Vec<Vec<f32>>, ExchangeError> {
        let t = Instant::now();
        let out = fetch_rows(self.link_mut(), tag, requests, cols, Dtype::F32, serve)?;
        self.times.halo_s += t.elapsed().as_secs_f64();
        Ok(out)
    }
}

/// The dropout key of step `step` of `epoch` (the same on every worker; masks are keyed by global node id
/// under it): step 0 uses the epoch itself, so a single full batch draws the same masks as full-graph
/// training.
pub fn step_pass(epoch: usize, step: usize) -> Pass {
    Pass::Train {
        epoch: epoch as u64 + ((step as u64) << 32),
    }
}

/// The training seeds in ascending order, checked to be distinct nodes of a graph of `num_nodes` nodes.
fn training_seeds(seeds: &[u32], num_nodes: usize) -> Result<Vec<u32>, Error> {
    let mut all = seeds.to_vec();
    all.sort_unstable();
    if let Some(w) = all.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::Config(format!(
            "training node {} is listed twice",
            w[0]
        )));
    }
    if let Some(&v) = all.last().filter(|&&v| v as usize >= num_nodes) {
        return Err(Error::Config(format!(
            "training node {v} is not a node of the graph (0..{num_nodes})"
        )));
    }
    if all.is_empty() {
        return Err(Error::Config("the training split is empty".into()));
    }
    Ok(all)
}

/// Every training seed (`train`, ascending) in the order epoch `epoch` trains them: step `s`'s global batch
/// is `order[s * batch_size..][..batch_size]`. A function of (`train`, `seed`, `epoch`) alone, so the same on
/// every worker and for every worker count; data parallelism and P3 share it.
pub fn epoch_order(train: &[u32], seed: u64, epoch: usize) -> Vec<u32> {
    let mut order = train.to_vec();
    shuffle(&mut order, Stream::new(seed, &[0x5EED, epoch as u64]));
    order
}

/// The sampling key of step `step` of `epoch`: every worker samples its part of the step's global batch with
/// it, so each seed gets the neighbourhood it would get in the whole batch on one worker.
pub fn step_key(seed: u64, epoch: usize, step: usize) -> u64 {
    batch_key(Stream::new(seed, &[0x5A3F, epoch as u64]).at(0), step)
}

/// A batch ready for the trainer: blocks, input rows (remote rows not in the cache still missing), labels.
struct Prepared {
    blocks: Vec<LocalGraph>,
    x: Matrix,
    /// (row of `x`, owner, row in the owner's features), grouped by nothing in particular.
    missing: Vec<(u32, u32, u32)>,
    labels: Vec<i64>,
    seeds: usize,
    edges: usize,
    local: u64,
    hits: u64,
}

/// Remote rows kept on this worker: `slot[v]` is node `v`'s row in `rows`, or `u32::MAX`.
struct Cache {
    slot: Vec<u32>,
    rows: Matrix,
}

/// The engine's blocks of a sampled batch; sources carry their whole-graph degree and global id.
pub fn engine_blocks(kind: LayerKind, mb: &MiniBatch, indptr: &[i64]) -> Vec<LocalGraph> {
    mb.blocks
        .iter()
        .map(|b| {
            let ids = mb.nodes[..b.n_src].to_vec();
            let degs: Vec<u32> = ids
                .iter()
                .map(|&v| (indptr[v as usize + 1] - indptr[v as usize]) as u32)
                .collect();
            LocalGraph::block(kind, b.n_dst, b.n_src, &b.indptr, &b.indices, &degs, ids)
        })
        .collect()
}

/// Trains with data parallelism: see the module doc. Every rank calls this with the same configuration (and
/// the same `resume`, if any).
///
/// Training runs epochs `progress.epoch + 1 ..= tc.epochs` of `resume` (all of them without one). After
/// each, `on_epoch` sees its metrics, the progress, the model and the optimizer (identical on every rank:
/// any rank's are the checkpoint) and returns whether to go on; every rank must answer the same. Stopping
/// there and resuming from that state, with any number of workers, continues as if training had not
/// stopped. The summary holds this call's epochs, with the best-validation fields over all of them.
#[allow(clippy::too_many_arguments)]
pub fn train_minibatch(
    mesh: &mut dyn Mesh,
    shard: &Shard<'_>,
    cfg: &ModelConfig,
    seed: u64,
    tc: &TrainConfig,
    opts: &MiniBatchOptions,
    resume: Option<Resume>,
    on_epoch: &mut dyn FnMut(&EpochEnd<'_>) -> bool,
) -> Result<(Model, TrainSummary), Error> {
    train_minibatch_on(
        crate::Device::Cpu,
        mesh,
        shard,
        cfg,
        seed,
        tc,
        opts,
        resume,
        on_epoch,
    )
    .map(|(state, summary)| (state.model, summary))
}

/// A mini-batch step on a device: the batch's blocks, input rows and labels are uploaded, forward,
/// backward and Adam run there; the host `Model` and `Adam` get the device's state at each epoch's end
/// (evaluation, checkpoints).
trait DeviceSteps {
    /// Trains one step's batch; returns this worker's share of the step's loss (a mean over `batch_size`).
    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        blocks: &[LocalGraph],
        x: &Matrix,
        labels: &[i64],
        seeds: usize,
        batch_size: f64,
        pass: Pass,
        mesh: &mut dyn Exchange,
    ) -> Result<f64, Error>;
    /// A step with none of this worker's seeds: zero gradients all-reduced, then Adam.
    fn empty_step(&mut self, mesh: &mut dyn Exchange) -> Result<(), Error>;
    /// Copies the device's parameters and optimizer state into the host's.
    fn sync(&mut self, model: &mut Model, opt: &mut Adam) -> Result<(), Error>;
}

struct OnDevice<O: physalia_gnn::Ops> {
    ops: O,
    model: physalia_gnn::DeviceModel<O>,
    adam: physalia_gnn::device::AdamConfig,
    kind: LayerKind,
}

impl<O: physalia_gnn::Ops> OnDevice<O>
where
    Error: From<O::Error>,
{
    fn new(mut ops: O, model: &Model, opt: &Adam) -> Result<Self, Error> {
        let mut dm = physalia_gnn::DeviceModel::from_model(&mut ops, model)?;
        if opt.steps() > 0 {
            dm.restore_adam(&mut ops, opt)?;
        }
        Ok(OnDevice {
            ops,
            model: dm,
            adam: physalia_gnn::device::AdamConfig {
                lr: opt.lr,
                weight_decay: opt.weight_decay,
                beta1: opt.beta1,
                beta2: opt.beta2,
                eps: opt.eps,
            },
            kind: model.config().kind,
        })
    }
}

impl<O: physalia_gnn::Ops> DeviceSteps for OnDevice<O>
where
    Error: From<O::Error>,
{
    fn step(
        &mut self,
        blocks: &[LocalGraph],
        x: &Matrix,
        labels: &[i64],
        seeds: usize,
        batch_size: f64,
        pass: Pass,
        mesh: &mut dyn Exchange,
    ) -> Result<f64, Error> {
        use physalia_gnn::DeviceGraph;
        let ops = &mut self.ops;
        let blocks = blocks
            .iter()
            .map(|b| DeviceGraph::block(ops, b, self.kind))
            .collect::<Result<Vec<_>, _>>()?;
        let xd = ops.upload(x)?;
        let labels = ops.upload_labels(labels)?;
        let rows: Vec<u32> = (0..seeds as u32).collect();
        let rows = ops.upload_idx(&rows)?;
        let fwd = self.model.forward_device_blocks(ops, &blocks, &xd, pass)?;
        let (r, c) = ops.dims(&fwd.logits);
        let mut d_logits = ops.alloc(r, c)?;
        let loss = ops.cross_entropy(&fwd.logits, &labels, &rows, batch_size, &mut d_logits)?;
        let grads = self
            .model
            .backward_device_blocks(ops, &blocks, fwd, d_logits, mesh)?;
        self.model.adam_step(ops, grads, self.adam)?;
        ops.recycle(xd);
        // every step's blocks have new shapes: keep no buffer cached for shapes that will not come back
        ops.release_cached();
        Ok(loss / batch_size)
    }

    fn empty_step(&mut self, mesh: &mut dyn Exchange) -> Result<(), Error> {
        let grads = self.model.zero_grads_reduced(&mut self.ops, mesh)?;
        self.model.adam_step(&mut self.ops, grads, self.adam)?;
        Ok(())
    }

    fn sync(&mut self, model: &mut Model, opt: &mut Adam) -> Result<(), Error> {
        self.ops.synchronize()?;
        self.model.download_into(&mut self.ops, model)?;
        self.model.download_adam(&mut self.ops, opt)?;
        Ok(())
    }
}

/// [`train_minibatch`] with every step on `device` (evaluation stays on the CPU: the full-graph forward
/// of each worker's part), returning the whole training state where it stopped (the model, the optimizer
/// and the progress: what an in-place resize continues from when `on_epoch` paused it).
#[allow(clippy::too_many_arguments)]
pub fn train_minibatch_on(
    device: crate::Device,
    mesh: &mut dyn Mesh,
    shard: &Shard<'_>,
    cfg: &ModelConfig,
    seed: u64,
    tc: &TrainConfig,
    opts: &MiniBatchOptions,
    resume: Option<Resume>,
    on_epoch: &mut dyn FnMut(&EpochEnd<'_>) -> bool,
) -> Result<(Resume, TrainSummary), Error> {
    // A GPU worker's cores have nothing to do but prepare batches: with the default single loader the GPU
    // waited for it 55-80% of every epoch (SBM 1M, bench/RESULTS.md). As many loaders as the worker's
    // cores allow (up to 8), two batches in flight each; what is learned does not depend on it (steps are
    // keyed by (seed, epoch, step), not by the loader that prepared them).
    let gpu_opts;
    let opts = match device {
        crate::Device::Cpu => opts,
        _ => {
            let cores = std::env::var("RAYON_NUM_THREADS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
                .unwrap_or(1);
            let loaders = opts.loader_threads.max(cores.saturating_sub(1).clamp(1, 8));
            gpu_opts = MiniBatchOptions {
                loader_threads: loaders,
                prefetch: opts.prefetch.max(2 * loaders),
                ..opts.clone()
            };
            &gpu_opts
        }
    };
    let (rank, world) = (mesh.rank(), mesh.world());
    let config = |problem: String| Error::Config(problem);
    opts.check(cfg.layers).map_err(Error::Config)?;
    if shard.train_by_rank.len() != world {
        return Err(config(format!(
            "training seeds for {} ranks in a mesh of {world}",
            shard.train_by_rank.len()
        )));
    }
    if shard.features.cols() != cfg.in_dim {
        return Err(config(format!(
            "features are {} wide, the model expects {}",
            shard.features.cols(),
            cfg.in_dim
        )));
    }
    let sampler = Sampler::new(shard.indptr, shard.indices, &opts.fanouts)
        .map_err(|e| config(e.to_string()))?;
    let d = cfg.in_dim;
    let num_nodes = shard.owner.len();
    let all = training_seeds(&shard.train_by_rank.concat(), num_nodes)?;
    let Resume {
        mut model,
        mut opt,
        mut progress,
    } = Resume::or_fresh(resume, cfg, seed, tc)?;
    let mut on_device: Option<Box<dyn DeviceSteps>> = match device {
        crate::Device::Cpu => None,
        crate::Device::Cuda { index } => Some(Box::new(OnDevice::new(
            physalia_gnn_cuda::CudaEngine::new(index)?,
            &model,
            &opt,
        )?)),
        crate::Device::Emulated => Some(Box::new(OnDevice::new(
            physalia_gnn::CpuPrimitives,
            &model,
            &opt,
        )?)),
    };
    let mut summary = progress.summary(tc.epochs);
    let cache = build_cache(mesh, shard, &sampler, seed, opts, d)?;
    let n_train = all.len();
    let steps = n_train.div_ceil(opts.batch_size);
    // seeds in step s over all ranks: the loss of each step is a mean over them
    let global_batch: Vec<f64> = (0..steps)
        .map(|s| (n_train - s * opts.batch_size).min(opts.batch_size) as f64)
        .collect();
    let mut mine = vec![false; num_nodes];
    for &v in &shard.train_by_rank[rank] {
        mine[v as usize] = true;
    }

    for epoch in progress.epoch + 1..=tc.epochs {
        let t0 = Instant::now();
        // this rank's share of every step's global batch, in the global order
        let batches: Vec<Vec<u32>> = epoch_order(&all, seed, epoch)
            .chunks(opts.batch_size)
            .map(|global| {
                global
                    .iter()
                    .copied()
                    .filter(|&v| mine[v as usize])
                    .collect()
            })
            .collect();
        let mut stats = BatchStats::default();
        let mut loss_sum = 0f64;
        let part = rank - shard.rank_base;
        let prepare = |_: usize, mb: MiniBatch| prepare(cfg.kind, shard, cache.as_ref(), part, mb);
        let result: Result<(), Error> = with_prefetch_keyed(
            &sampler,
            &batches,
            |step| step_key(seed, epoch, step),
            opts.loader_threads,
            opts.prefetch,
            prepare,
            |it| {
                for (step, &batch_size) in global_batch.iter().enumerate() {
                    let tw = Instant::now();
                    let mut p = it.next().expect("one prepared batch per step");
                    stats.sample_wait_s += tw.elapsed().as_secs_f64();
                    let tf = Instant::now();
                    fill_missing(mesh, shard, &mut p, epoch, step, d)?;
                    stats.fetch_s += tf.elapsed().as_secs_f64();
                    let tc0 = Instant::now();
                    stats.steps += 1;
                    stats.seeds += p.seeds as u64;
                    stats.sampled_edges += p.edges as u64;
                    stats.local_rows += p.local;
                    stats.cache_hits += p.hits;
                    stats.cache_misses += p.missing.len() as u64;
                    let pass = step_pass(epoch, step);
                    mesh.begin_pass(pass);
                    if let Some(dev) = on_device.as_mut() {
                        if p.seeds == 0 {
                            dev.empty_step(mesh)?;
                        } else {
                            loss_sum += dev.step(
                                &p.blocks, &p.x, &p.labels, p.seeds, batch_size, pass, mesh,
                            )?;
                        }
                        stats.compute_s += tc0.elapsed().as_secs_f64();
                        continue;
                    }
                    let grads = if p.seeds == 0 {
                        let mut g = model.zero_grads();
                        mesh.all_reduce(&mut g)
                            .map_err(physalia_gnn::Error::Exchange)?;
                        g
                    } else {
                        let fwd = model.forward_blocks(&p.blocks, &p.x, pass)?;
                        let rows: Vec<u32> = (0..p.seeds as u32).collect();
                        let (l, dl) = cross_entropy(&fwd.logits, &p.labels, &rows, batch_size);
                        loss_sum += l / batch_size;
                        model.backward_blocks(&p.blocks, fwd, dl, mesh)?
                    };
                    opt.step(&mut model.params, &grads);
                    stats.compute_s += tc0.elapsed().as_secs_f64();
                }
                Ok(())
            },
        );
        result?;
        if let Some(dev) = on_device.as_mut() {
            dev.sync(&mut model, &mut opt)?;
        }
        let mut eval = |model: &mut Model, ex: &mut dyn Exchange| {
            physalia_gnn::evaluate(model, shard.eval_graph, shard.features, shard.eval_sets, ex)
                .map_err(Error::from)
        };
        let end = EpochDone {
            epoch,
            loss_sum,
            steps,
            started: t0,
            stats,
        };
        if end.finish(
            mesh,
            &mut model,
            &opt,
            tc,
            &mut eval,
            &mut summary,
            &mut progress,
            on_epoch,
        )? {
            break;
        }
    }
    Ok((
        Resume {
            model,
            opt,
            progress,
        },
        summary,
    ))
}

/// What a trainer knows at the end of an epoch's steps.
struct EpochDone {
    epoch: usize,
    /// Sum over this worker's steps of its loss share (each step's loss is a mean over the global batch).
    loss_sum: f64,
    steps: usize,
    started: Instant,
    stats: BatchStats,
}

impl EpochDone {
    /// The global mean loss, evaluation when due, best-validation tracking, the progress and the callback,
    /// as the full-graph loop ([`physalia_gnn::train_resumable`]) does them. Returns whether training stops
    /// here (patience ran out, or the callback said stop).
    #[allow(clippy::too_many_arguments)]
    fn finish(
        self,
        mesh: &mut dyn Exchange,
        model: &mut Model,
        opt: &Adam,
        tc: &TrainConfig,
        evaluate: &mut Evaluate<'_>,
        summary: &mut TrainSummary,
        progress: &mut Progress,
        on_epoch: &mut dyn FnMut(&EpochEnd<'_>) -> bool,
    ) -> Result<bool, Error> {
        let epoch = self.epoch;
        mesh.begin_pass(Pass::Train {
            epoch: epoch as u64,
        });
        let mut loss = [self.loss_sum];
        mesh.all_reduce_scalars(&mut loss)
            .map_err(physalia_gnn::Error::Exchange)?;
        // each step's loss was a mean over its global batch; the epoch's is the mean over steps
        let loss = loss[0] / self.steps.max(1) as f64;
        let train_s = self.started.elapsed().as_secs_f64();
        if !loss.is_finite() {
            return Err(physalia_gnn::Error::Diverged { epoch, loss }.into());
        }
        let mut m = EpochMetrics::trained(epoch, loss, train_s);
        m.batches = Some(self.stats);
        let evaluated = tc.evaluates(epoch);
        if evaluated {
            let t1 = Instant::now();
            let [tr, va, te] = evaluate(model, mesh)?;
            m.eval_s = t1.elapsed().as_secs_f64();
            (m.train_acc, m.val_acc, m.test_acc) = (tr, va, te);
        }
        m.exchange = mesh.take_stats();
        Ok(close_epoch(
            summary,
            progress,
            tc.patience,
            m,
            evaluated,
            model,
            opt,
            on_epoch,
        ))
    }
}

/// Fisher-Yates with a counter-based stream.
fn shuffle(v: &mut [u32], s: Stream) {
    for i in (1..v.len()).rev() {
        let j = (s.at(i as u64) % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

fn prepare(
    kind: LayerKind,
    shard: &Shard<'_>,
    cache: Option<&Cache>,
    part: usize,
    mb: MiniBatch,
) -> Prepared {
    let blocks = engine_blocks(kind, &mb, shard.indptr);
    let input = mb.input_nodes();
    let d = shard.features.cols();
    let mut x = Matrix::zeros(input.len(), d);
    let mut missing = Vec::new();
    let (mut local, mut hits) = (0u64, 0u64);
    for (r, &v) in input.iter().enumerate() {
        let v = v as usize;
        let (owner, row) = (shard.owner[v], shard.row[v]);
        let src = if owner as usize == part {
            local += 1;
            shard.features.row(row as usize)
        } else if let Some(c) = cache.filter(|c| c.slot[v] != u32::MAX) {
            hits += 1;
            c.rows.row(c.slot[v] as usize)
        } else {
            missing.push((r as u32, owner, row));
            continue;
        };
        x.row_mut(r).copy_from_slice(src);
    }
    let seeds = mb.seeds();
    let labels = seeds
        .iter()
        .map(|&v| shard.labels[shard.row[v as usize] as usize])
        .collect();
    Prepared {
        blocks,
        x,
        missing,
        labels,
        seeds: seeds.len(),
        edges: mb.num_edges(),
        local,
        hits,
    }
}

/// Serves a peer's request for rows of our features.
fn serve_rows<'s>(
    shard: &'s Shard<'_>,
) -> impl FnMut(usize, &[u32]) -> Result<Vec<f32>, physalia_wire::WireError> + 's {
    move |peer, rows| {
        let n = shard.features.rows();
        let mut out = Vec::with_capacity(rows.len() * shard.features.cols());
        for &r in rows {
            if r as usize >= n {
                return Err(physalia_wire::WireError::Usage(format!(
                    "rank {peer} asked for feature row {r}; this rank owns {n}"
                )));
            }
            out.extend_from_slice(shard.features.row(r as usize));
        }
        Ok(out)
    }
}

/// Fetches the batch's uncached remote rows from their owners (every rank takes part in every step).
fn fill_missing(
    mesh: &mut dyn Mesh,
    shard: &Shard<'_>,
    p: &mut Prepared,
    epoch: usize,
    step: usize,
    d: usize,
) -> Result<(), Error> {
    let world = mesh.world();
    if world == 1 {
        return Ok(());
    }
    let mut requests = vec![Vec::new(); world];
    let mut dest = vec![Vec::new(); world];
    for &(r, owner, row) in &p.missing {
        requests[shard.rank_base + owner as usize].push(row);
        dest[shard.rank_base + owner as usize].push(r);
    }
    let tag = Tag::new((epoch as u32) ^ ((step as u32) << 16), 0, Phase::Fetch);
    let rows = mesh
        .fetch(tag, &requests, d, &mut serve_rows(shard))
        .map_err(physalia_gnn::Error::Exchange)?;
    for (peer, rows) in rows.iter().enumerate() {
        for (k, &r) in dest[peer].iter().enumerate() {
            p.x.row_mut(r as usize)
                .copy_from_slice(&rows[k * d..(k + 1) * d]);
        }
    }
    Ok(())
}

/// Pre-samples `presample_batches` batches of `batch_size` of this rank's own seeds (per rank: this only
/// chooses what to cache, never what is trained), ranks remote input rows by how often they were read, and fetches the `cache_rows` most read (ties to the lower node id). Every rank takes part in
/// the fetch, also with an empty cache.
fn build_cache(
    mesh: &mut dyn Mesh,
    shard: &Shard<'_>,
    sampler: &Sampler<'_>,
    seed: u64,
    opts: &MiniBatchOptions,
    d: usize,
) -> Result<Option<Cache>, Error> {
    let (rank, world) = (mesh.rank(), mesh.world());
    if world == 1 {
        return Ok(None);
    }
    let mut wanted: Vec<u32> = Vec::new();
    if opts.cache_rows > 0 {
        let mut seeds = shard.train_by_rank[rank].clone();
        shuffle(&mut seeds, Stream::new(seed, &[0xCAC4E, rank as u64]));
        let mut scratch = physalia_graph::sample::Scratch::new(shard.owner.len());
        let mut count: Vec<u32> = vec![0; shard.owner.len()];
        let mut touched: Vec<u32> = Vec::new();
        for (b, chunk) in seeds
            .chunks(opts.batch_size)
            .take(opts.presample_batches.max(1))
            .enumerate()
        {
            let mb = sampler.sample(chunk, batch_key(seed ^ 0xCAC4E, b), &mut scratch);
            for &v in mb.input_nodes() {
                if shard.owner[v as usize] as usize + shard.rank_base != rank {
                    if count[v as usize] == 0 {
                        touched.push(v);
                    }
                    count[v as usize] += 1;
                }
            }
        }
        touched.sort_by_key(|&v| (std::cmp::Reverse(count[v as usize]), v));
        touched.truncate(opts.cache_rows);
        touched.sort_unstable();
        wanted = touched;
    }
    let mut requests = vec![Vec::new(); world];
    let mut dest = vec![Vec::new(); world];
    for (k, &v) in wanted.iter().enumerate() {
        let o = shard.rank_base + shard.owner[v as usize] as usize;
        requests[o].push(shard.row[v as usize]);
        dest[o].push(k);
    }
    let rows = mesh
        .fetch(
            Tag::new(u32::MAX, 0, Phase::Fetch),
            &requests,
            d,
            &mut serve_rows(shard),
        )
        .map_err(physalia_gnn::Error::Exchange)?;
    let mut cache = Cache {
        slot: vec![u32::MAX; shard.owner.len()],
        rows: Matrix::zeros(wanted.len(), d),
    };
    for (peer, rows) in rows.iter().enumerate() {
        for (k, &slot) in dest[peer].iter().enumerate() {
            cache
                .rows
                .row_mut(slot)
                .copy_from_slice(&rows[k * d..(k + 1) * d]);
        }
    }
    for (k, &v) in wanted.iter().enumerate() {
        cache.slot[v as usize] = k as u32;
    }
    // the fetch's bytes are reported with the first epoch's
    Ok((!wanted.is_empty()).then_some(cache))
}

/// The owned arrays behind a [`Shard`].
pub struct ShardData {
    pub rank_base: usize,
    pub owner: Vec<u32>,
    pub row: Vec<u32>,
    pub train_by_rank: Vec<Vec<u32>>,
    pub features: Matrix,
    pub labels: Vec<i64>,
    pub eval_graph: LocalGraph,
    pub eval_sets: NodeSets,
}

impl ShardData {
    /// A data-parallel worker's view: its partition (`part`), every node's part (`assignment`), the whole
    /// graph's training nodes, and which of `replicas` replicas of the partitioning this worker is in
    /// (rank = replica * k + part; replicas split the training nodes, see [`crate::owner_replica`]).
    pub fn from_part(
        part: &physalia_graph::partition::Part,
        assignment: &[u32],
        train: &[u32],
        cfg: &ModelConfig,
        row_normalize_features: bool,
        replicas: usize,
        replica: usize,
    ) -> ShardData {
        let mut next = vec![0u32; part.k];
        let row = assignment
            .iter()
            .map(|&p| {
                let r = next[p as usize];
                next[p as usize] += 1;
                r
            })
            .collect();
        let mut train_by_rank = vec![Vec::new(); part.k * replicas];
        for &v in train {
            let r = crate::owner_replica(v, replicas);
            train_by_rank[r * part.k + assignment[v as usize] as usize].push(v);
        }
        let (eval_graph, features, eval_sets) =
            crate::local_inputs(part, cfg, row_normalize_features);
        ShardData {
            rank_base: replica * part.k,
            owner: assignment.to_vec(),
            row,
            train_by_rank,
            features,
            labels: part.labels.clone(),
            eval_graph,
            eval_sets,
        }
    }

    /// One worker owning the whole graph.
    pub fn whole(
        kind: LayerKind,
        indptr: &[i64],
        indices: &[i32],
        features: Matrix,
        sets: NodeSets,
    ) -> ShardData {
        let n = features.rows();
        ShardData {
            rank_base: 0,
            owner: vec![0; n],
            row: (0..n as u32).collect(),
            train_by_rank: vec![sets.train.clone()],
            features,
            labels: sets.labels.clone(),
            eval_graph: LocalGraph::whole(kind, indptr, indices),
            eval_sets: sets,
        }
    }

    pub fn shard<'a>(&'a self, indptr: &'a [i64], indices: &'a [i32]) -> Shard<'a> {
        Shard {
            indptr,
            indices,
            owner: &self.owner,
            row: &self.row,
            features: &self.features,
            labels: &self.labels,
            train_by_rank: &self.train_by_rank,
            rank_base: self.rank_base,
            eval_graph: &self.eval_graph,
            eval_sets: &self.eval_sets,
        }
    }
}

/// What a P3 (model-parallel) worker holds: the whole structure, its column slice of every node's features,
/// and every node's label and split (small next to the features).
pub struct ColumnShard<'a> {
    pub indptr: &'a [i64],
    pub indices: &'a [i32],
    /// `num_nodes x (cols.len())`: columns `cols` of the input features.
    pub x_cols: &'a Matrix,
    pub cols: std::ops::Range<usize>,
    pub sets: &'a NodeSets,
}

/// Columns `cols` of every feature row, each row normalised over all its columns first when asked
/// (the same values as slicing the normalised matrix).
pub fn column_features(
    features: physalia_graph::FeatureView<'_>,
    d: usize,
    cols: std::ops::Range<usize>,
    row_normalize: bool,
) -> Matrix {
    let all = features.to_f32();
    let n = all.len() / d.max(1);
    let mut out = Matrix::zeros(n, cols.len());
    for i in 0..n {
        let row = &all[i * d..(i + 1) * d];
        // divided, not multiplied by the inverse: the same bits as `Matrix::row_normalize`
        let sum: f32 = if row_normalize { row.iter().sum() } else { 0.0 };
        for (o, &v) in out.row_mut(i).iter_mut().zip(&row[cols.clone()]) {
            *o = if sum != 0.0 { v / sum } else { v };
        }
    }
    out
}

/// The input columns of rank `rank` of `world` when `d` columns are split as evenly as possible.
pub fn column_slice(d: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
    let start = rank * d / world;
    start..(rank + 1) * d / world
}

/// A part that owns nothing: the exchange of a worker without a partition (P3 moves no halo rows).
fn no_part(rank: usize, world: usize) -> physalia_graph::partition::Part {
    physalia_graph::partition::Part {
        part: rank,
        k: world,
        owned: vec![],
        halo: vec![],
        indptr: vec![0],
        indices: vec![],
        src_in_degree: vec![],
        recv: vec![],
        send: vec![],
        labels: vec![],
        train: vec![],
        val: vec![],
        test: vec![],
        features: physalia_graph::format::Features::F32(vec![]),
        feat_dim: 0,
        num_classes: 0,
        num_nodes_global: 0,
        num_train_global: 0,
    }
}

/// A worker's part of a P3 step: every worker prepares every part of the step (only block 0 and its input
/// columns for parts other workers own).
struct P3Batch {
    blocks: Vec<LocalGraph>,
    x: Matrix,
    seeds: Vec<u32>,
    edges: usize,
}

/// P3 model parallelism with mini-batches: input features split by column over the workers. Steps are those
/// of data parallelism ([`epoch_order`], [`step_key`]); each step's global batch of `batch_size` seeds is
/// split into one contiguous part per worker, which owns it. Every worker samples every part of the step
/// (sampling is a pure function of the seeds and the key, so no structure travels), computes the first layer's partial product
/// of its columns for every batch and sends each to the batch's owner, which sums them in rank order and
/// runs the remaining layers; the first layer's output gradient goes back to every worker, which forms the
/// gradient of its rows of the first layer's weights. The remaining layers' gradients are all-reduced.
/// Evaluation is layer-wise full-graph inference with the first layer's partial products all-reduced.
///
/// The first layer's weight rows (and their Adam moments) are trained by their column owner; after every
/// epoch each worker sends its rows to every other (`gather_first_layer`), so at every epoch's end, and
/// on return, every rank holds the complete model and optimizer state, bitwise the same on all ranks.
/// `on_epoch` (called on every rank, which must all answer the same) therefore sees a complete checkpoint
/// on any rank; it runs like [`train_minibatch`]'s. Resuming takes the complete state on every rank, and
/// each worker trains the rows of its own columns of it, so the worker count may differ from the run that
/// wrote the checkpoint.
#[allow(clippy::too_many_arguments)]
pub fn train_p3<L: Link + ?Sized>(
    link: &mut L,
    shard: &ColumnShard<'_>,
    cfg: &ModelConfig,
    seed: u64,
    tc: &TrainConfig,
    opts: &MiniBatchOptions,
    resume: Option<Resume>,
    on_epoch: &mut dyn FnMut(&EpochEnd<'_>) -> bool,
) -> Result<(Resume, TrainSummary), Error> {
    let (rank, world) = (link.rank(), link.world());
    let config = |problem: String| Error::Config(problem);
    opts.check(cfg.layers).map_err(Error::Config)?;
    if cfg.layers < 2 {
        return Err(config(
            "model parallelism (P3) needs at least 2 layers: the first is split by columns, the rest run data-parallel".into(),
        ));
    }
    if shard.cols != column_slice(cfg.in_dim, world, rank)
        || shard.x_cols.cols() != shard.cols.len()
    {
        return Err(config(format!(
            "rank {rank} of {world} holds feature columns {:?}, expected {:?}",
            shard.cols,
            column_slice(cfg.in_dim, world, rank)
        )));
    }
    if cfg.kind == LayerKind::Gat {
        return Err(config(
            "model parallelism (P3) supports gcn and sage: GAT's attention needs whole input rows"
                .into(),
        ));
    }
    let sampler = Sampler::new(shard.indptr, shard.indices, &opts.fanouts)
        .map_err(|e| config(e.to_string()))?;
    let sets = shard.sets;
    let all = training_seeds(&sets.train, shard.indptr.len() - 1)?;
    let n_train = all.len();
    let Resume {
        mut model,
        mut opt,
        mut progress,
    } = Resume::or_fresh(resume, cfg, seed, tc)?;
    let mut summary = progress.summary(tc.epochs);
    let empty = no_part(rank, world);
    let mut mesh = MeshExchange::new(link, &empty, crate::ExchangeOptions::default());
    let first = model.first_layer_weights();
    let col0 = shard.cols.start;
    let whole = LocalGraph::whole(cfg.kind, shard.indptr, shard.indices);
    let steps = n_train.div_ceil(opts.batch_size);
    for epoch in progress.epoch + 1..=tc.epochs {
        let t0 = Instant::now();
        // batch s * world + w is rank w's part of step s's global batch: contiguous, sizes within one
        let mut batches: Vec<Vec<u32>> = Vec::with_capacity(steps * world);
        for global in epoch_order(&all, seed, epoch).chunks(opts.batch_size) {
            let len = global.len();
            for w in 0..world {
                batches.push(global[w * len / world..(w + 1) * len / world].to_vec());
            }
        }
        let mut stats = BatchStats::default();
        let mut loss_sum = 0f64;
        let prep = |b: usize, mb: MiniBatch| {
            let mut blocks = engine_blocks(cfg.kind, &mb, shard.indptr);
            if b % world != rank {
                blocks.truncate(1);
            }
            let input = mb.input_nodes();
            let mut x = Matrix::zeros(input.len(), shard.x_cols.cols());
            for (r, &v) in input.iter().enumerate() {
                x.row_mut(r).copy_from_slice(shard.x_cols.row(v as usize));
            }
            P3Batch {
                blocks,
                x,
                seeds: mb.seeds().to_vec(),
                edges: mb.num_edges(),
            }
        };
        let result: Result<(), Error> = with_prefetch_keyed(
            &sampler,
            &batches,
            |b| step_key(seed, epoch, b / world),
            opts.loader_threads,
            opts.prefetch,
            prep,
            |it| {
                for step in 0..steps {
                    let tw = Instant::now();
                    let group: Vec<P3Batch> = (0..world)
                        .map(|_| it.next().expect("world batches per step"))
                        .collect();
                    stats.sample_wait_s += tw.elapsed().as_secs_f64();
                    let tc0 = Instant::now();
                    let pass = step_pass(epoch, step);
                    mesh.begin_pass(pass);
                    let global: usize = group.iter().map(|b| b.seeds.len()).sum();
                    let mine = &group[rank];
                    stats.steps += 1;
                    stats.seeds += mine.seeds.len() as u64;
                    stats.sampled_edges += group.iter().map(|b| b.edges as u64).sum::<u64>();
                    stats.local_rows += group.iter().map(|b| b.x.rows() as u64).sum::<u64>();
                    let partials: Vec<Matrix> = group
                        .iter()
                        .map(|b| model.first_layer_partial(&b.blocks[0], &b.x, col0, pass))
                        .collect::<Result<_, _>>()?;
                    stats.compute_s += tc0.elapsed().as_secs_f64();
                    // partial products to the batch owners; ours summed in rank order
                    let tf = Instant::now();
                    let hidden = partials[rank].cols();
                    let got = swap_rows(
                        &mut mesh,
                        Tag::new(step as u32, 0, Phase::Forward),
                        |w| partials[w].data(),
                        |_| mine.blocks[0].n_dst(),
                        hidden,
                    )?;
                    stats.fetch_s += tf.elapsed().as_secs_f64();
                    let tc1 = Instant::now();
                    let mut z0 = Matrix::zeros(mine.blocks[0].n_dst(), hidden);
                    let mut from_peer = got.into_iter();
                    for w in 0..world {
                        if w == rank {
                            z0.add_assign(&partials[rank]);
                        } else {
                            let (_, rows) = from_peer.next().expect("one reply per peer");
                            z0.add_assign(&Matrix::from_vec(z0.rows(), hidden, rows));
                        }
                    }
                    let (mut grads, d_z0) = if mine.seeds.is_empty() {
                        (model.zero_grads(), Matrix::zeros(0, hidden))
                    } else {
                        let fwd = model.forward_after_first_blocks(&mine.blocks, z0, pass)?;
                        let labels: Vec<i64> = mine
                            .seeds
                            .iter()
                            .map(|&v| sets.labels[v as usize])
                            .collect();
                        let rows: Vec<u32> = (0..mine.seeds.len() as u32).collect();
                        let (l, dl) = cross_entropy(&fwd.logits, &labels, &rows, global as f64);
                        loss_sum += l / global as f64;
                        model.backward_after_first_blocks(&mine.blocks, fwd, dl)?
                    };
                    stats.compute_s += tc1.elapsed().as_secs_f64();
                    // the first layer's output gradient of every batch to every worker
                    let tf = Instant::now();
                    let got = swap_rows(
                        &mut mesh,
                        Tag::new(step as u32, 0, Phase::Backward),
                        |_| d_z0.data(),
                        |w| {
                            if group[w].seeds.is_empty() {
                                0
                            } else {
                                group[w].blocks[0].n_dst()
                            }
                        },
                        hidden,
                    )?;
                    stats.fetch_s += tf.elapsed().as_secs_f64();
                    let tc2 = Instant::now();
                    let mut from_peer = got.into_iter();
                    for (w, b) in group.iter().enumerate() {
                        let dz = if w == rank {
                            d_z0.clone()
                        } else {
                            let (_, rows) = from_peer.next().expect("one reply per peer");
                            Matrix::from_vec(rows.len() / hidden, hidden, rows)
                        };
                        if b.seeds.is_empty() {
                            continue;
                        }
                        model.first_layer_partial_backward(
                            &b.blocks[0],
                            &b.x,
                            col0,
                            pass,
                            &dz,
                            &mut grads,
                        )?;
                    }
                    all_reduce_except(&mut mesh, &mut grads, &first)?;
                    opt.step(&mut model.params, &grads);
                    stats.compute_s += tc2.elapsed().as_secs_f64();
                }
                Ok(())
            },
        );
        result?;
        // every rank gets the whole first layer and its moments: the epoch's state is complete everywhere
        gather_first_layer(&mut mesh, &mut model, &mut opt, &first, epoch)?;
        let mut eval =
            |model: &mut Model, ex: &mut dyn Exchange| p3_evaluate(model, &whole, shard, ex);
        let end = EpochDone {
            epoch,
            loss_sum,
            steps,
            started: t0,
            stats,
        };
        if end.finish(
            &mut mesh,
            &mut model,
            &opt,
            tc,
            &mut eval,
            &mut summary,
            &mut progress,
            on_epoch,
        )? {
            break;
        }
    }
    // the last epoch's gather (or the checkpoint resumed from) left the model and optimizer complete: a
    // worker paused here holds the whole state, as a data-parallel one does
    Ok((
        Resume {
            model,
            opt,
            progress,
        },
        summary,
    ))
}

/// P3's end of an epoch: every worker sends the rows of its columns of the first layer's weights, and of
/// their Adam moments, to every other worker, which writes them over its own copies of those rows. Only
/// the rows of a worker's own columns enter its products, so training is unchanged; what the rows of other
/// workers' columns held (their initial values, moved by weight decay alone) is replaced by the owners'
/// values, bit for bit, and every rank ends with the same complete model and optimizer state.
fn gather_first_layer<L: Link + ?Sized>(
    mesh: &mut MeshExchange<'_, L>,
    model: &mut Model,
    opt: &mut Adam,
    first: &[usize],
    epoch: usize,
) -> Result<(), Error> {
    let (rank, world) = (mesh.link().rank(), mesh.link().world());
    if world == 1 {
        return Ok(());
    }
    let d = model.config().in_dim;
    // the flat range of rows `cols` of each first-layer parameter
    let spans = |model: &Model, rank: usize| -> Vec<(usize, std::ops::Range<usize>)> {
        let c = column_slice(d, world, rank);
        first
            .iter()
            .map(|&i| {
                let w = model.params[i].value.cols();
                (i, c.start * w..c.end * w)
            })
            .collect()
    };
    let (m, v) = opt.moments();
    let (mut m, mut v) = (m.to_vec(), v.to_vec());
    let mut mine = Vec::new();
    for (i, span) in spans(model, rank) {
        for buf in [model.params[i].value.data(), &m[i], &v[i]] {
            mine.extend_from_slice(&buf[span.clone()]);
        }
    }
    let sizes: Vec<usize> = (0..world)
        .map(|w| spans(model, w).iter().map(|(_, s)| 3 * s.len()).sum())
        .collect();
    // flat values as rows of one column: any layer width travels the same way
    let got = swap_rows(
        mesh,
        Tag::all_reduce(epoch as u32, 0),
        |_| mine.as_slice(),
        |w| sizes[w],
        1,
    )?;
    for (w, rows) in got {
        let mut rows = rows.into_iter();
        for (i, span) in spans(model, w) {
            let n = span.len();
            for dst in [
                &mut model.params[i].value.data_mut()[span.clone()],
                &mut m[i][span.clone()],
                &mut v[i][span],
            ] {
                for (o, x) in dst.iter_mut().zip(rows.by_ref().take(n)) {
                    *o = x;
                }
            }
        }
    }
    let step = opt.steps();
    opt.restore(step, m, v).map_err(Error::Config)
}

/// Sends every peer `w` its rows `send(w)` and receives `recv_rows(w)` rows from it (P3's partial products and
/// their gradients), in rank order.
fn swap_rows<'r, L: Link + ?Sized>(
    mesh: &mut MeshExchange<'_, L>,
    tag: Tag,
    send: impl Fn(usize) -> &'r [f32],
    recv_rows: impl Fn(usize) -> usize,
    cols: usize,
) -> Result<Vec<(usize, Vec<f32>)>, Error> {
    let (rank, world) = (mesh.link().rank(), mesh.link().world());
    let peers = || (0..world).filter(move |&w| w != rank);
    let send: Vec<(usize, &[f32])> = peers().map(|w| (w, send(w))).collect();
    let recv: Vec<(usize, usize)> = peers().map(|w| (w, recv_rows(w))).collect();
    physalia_wire::halo_exchange(mesh.link_mut(), tag, &send, &recv, cols, Dtype::F32)
        .map_err(|e| physalia_gnn::Error::Exchange(e.into()).into())
}

/// All-reduces every gradient except those at `skip` (the first layer's, which stay with their columns).
fn all_reduce_except(
    mesh: &mut dyn Exchange,
    grads: &mut [Matrix],
    skip: &[usize],
) -> Result<(), Error> {
    let mut shared: Vec<Matrix> = Vec::new();
    for (i, g) in grads.iter_mut().enumerate() {
        if !skip.contains(&i) {
            shared.push(std::mem::replace(g, Matrix::zeros(0, 0)));
        }
    }
    mesh.all_reduce(&mut shared)
        .map_err(physalia_gnn::Error::Exchange)?;
    let mut it = shared.into_iter();
    for (i, g) in grads.iter_mut().enumerate() {
        if !skip.contains(&i) {
            *g = it.next().expect("one gradient per shared parameter");
        }
    }
    Ok(())
}

/// Layer-wise full-graph inference for P3: the first layer's partial products over all nodes, summed over
/// workers, then the remaining layers on the whole graph (every worker computes the same logits).
fn p3_evaluate(
    model: &mut Model,
    whole: &LocalGraph,
    shard: &ColumnShard<'_>,
    mesh: &mut dyn Exchange,
) -> Result<[Option<f64>; 3], Error> {
    mesh.begin_pass(Pass::Eval);
    let mut z0 =
        vec![model.first_layer_partial(whole, shard.x_cols, shard.cols.start, Pass::Eval)?];
    mesh.all_reduce(&mut z0)
        .map_err(physalia_gnn::Error::Exchange)?;
    let z0 = z0.pop().expect("one matrix");
    let fwd = model.forward_after_first(whole, z0, Pass::Eval, &mut LocalExchange)?;
    let sets = shard.sets;
    Ok([&sets.train, &sets.val, &sets.test].map(|rows| {
        (!rows.is_empty()).then(|| {
            physalia_gnn::loss::correct(&fwd.logits, &sets.labels, rows) as f64 / rows.len() as f64
        })
    }))
}
