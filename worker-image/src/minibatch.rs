//! Data parallelism: mini-batch training with sampled neighbourhoods, gradients all-reduced every step.
//!
//! Every worker holds the whole graph's structure (to sample) but only the feature rows of the nodes it owns
//! (its METIS part), and trains on the training seeds it owns: sampled neighbourhoods then mostly stay in the
//! part (PaGraph's and DistDGL's locality). Rows of input nodes that peers own come from a cache of hot
//! remote rows, chosen before training by pre-sampling (PaGraph / GNNLab), or are fetched from their owners
//! over the mesh ([`physalia_wire::fetch_rows`]) in one lockstep round per step.
//!
//! Batches are sampled, turned into the engine's blocks and gathered from local and cached rows on a pool of
//! loader threads while the trainer computes earlier ones (SALIENT's pipeline); only the fetch of uncached
//! remote rows and the all-reduce are on the trainer's thread. Every worker runs the same number of steps
//! per epoch (a worker out of seeds contributes zero gradients), and each step's loss is a mean over the
//! global batch, so the all-reduced gradient is that of the global batch.
//!
//! Evaluation is layer-wise full-graph inference: the partition-parallel forward pass with halo exchange,
//! exact, not sampled.
//!
//! P3 model parallelism ([`train_p3`]) reuses the sampler: features are split by column instead of by node.

use std::time::Instant;

use physalia_gnn::loss::cross_entropy;
use physalia_gnn::rng::Stream;
use physalia_gnn::{
    Adam, BatchStats, EpochMetrics, Exchange, ExchangeError, LayerKind, LocalExchange, LocalGraph,
    Matrix, Model, ModelConfig, NodeSets, Pass, TrainConfig, TrainSummary,
};
use physalia_graph::sample::{MiniBatch, Sampler, batch_key, with_prefetch};
use physalia_wire::{Dtype, Link, Phase, Tag, fetch_rows};

use crate::Error;
use crate::exchange::MeshExchange;

/// How mini-batches are drawn and prepared.
#[derive(Clone, Debug, PartialEq)]
pub struct MiniBatchOptions {
    /// Per hop, PyG order: `fanouts[0]` for the seeds. `None` takes every neighbour.
    pub fanouts: Vec<Option<u32>>,
    /// Seeds per worker per step.
    pub batch_size: usize,
    /// Remote feature rows each worker caches (0: none).
    pub cache_rows: usize,
    /// Batches pre-sampled to rank remote rows by how often they are read.
    pub presample_batches: usize,
    /// Loader threads and how many batches they may run ahead.
    pub loader_threads: usize,
    pub prefetch: usize,
}

impl Default for MiniBatchOptions {
    fn default() -> Self {
        MiniBatchOptions {
            fanouts: vec![Some(25), Some(10)],
            batch_size: 1024,
            cache_rows: 0,
            presample_batches: 8,
            loader_threads: 1,
            prefetch: 2,
        }
    }
}

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
    /// Every rank's training seeds (global ids): each rank trains on its own, all ranks need the counts.
    pub train_by_rank: &'a [Vec<u32>],
    /// Layer-wise inference over the owned rows (the partition, halo rows through the exchange) and the
    /// labelled rows it is scored on.
    pub eval_graph: &'a LocalGraph,
    pub eval_sets: &'a NodeSets,
}

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
        serve: &mut dyn FnMut(usize, &[u32]) -> Result<Vec<f32>, physalia_wire::WireError>,
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
        _serve: &mut dyn FnMut(usize, &[u32]) -> Result<Vec<f32>, physalia_wire::WireError>,
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
        serve: &mut dyn FnMut(usize, &[u32]) -> Result<Vec<f32>, physalia_wire::WireError>,
    ) -> Result<Vec<Vec<f32>>, ExchangeError> {
        let t = Instant::now();
        let out = fetch_rows(self.link_mut(), tag, requests, cols, Dtype::F32, serve)?;
        self.times.halo_s += t.elapsed().as_secs_f64();
        Ok(out)
    }
}

/// The dropout and sampling key of step `step` of `epoch`: step 0 uses the epoch itself, so a single
/// full batch draws the same masks as full-graph training.
pub fn step_pass(epoch: usize, step: usize) -> Pass {
    Pass::Train {
        epoch: epoch as u64 + ((step as u64) << 32),
    }
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

/// Trains with data parallelism: see the module doc. Every rank calls this with the same configuration.
pub fn train_minibatch(
    mesh: &mut dyn Mesh,
    shard: &Shard<'_>,
    cfg: &ModelConfig,
    seed: u64,
    tc: &TrainConfig,
    opts: &MiniBatchOptions,
    on_epoch: &mut dyn FnMut(&EpochMetrics),
) -> Result<(Model, TrainSummary), Error> {
    let (rank, world) = (mesh.rank(), mesh.world());
    let config = |problem: String| Error::Config(problem);
    if opts.fanouts.len() != cfg.layers {
        return Err(config(format!(
            "{} fan-outs for a model of {} layers: give one per layer",
            opts.fanouts.len(),
            cfg.layers
        )));
    }
    if opts.batch_size == 0 {
        return Err(config("batch_size must be at least 1".into()));
    }
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
    let cache = build_cache(mesh, shard, &sampler, seed, opts, d)?;
    let n_train: usize = shard.train_by_rank.iter().map(Vec::len).sum();
    if n_train == 0 {
        return Err(config("the training split is empty".into()));
    }
    let steps = shard
        .train_by_rank
        .iter()
        .map(|t| t.len().div_ceil(opts.batch_size))
        .max()
        .unwrap_or(0);
    // seeds in step s over all ranks: the loss of each step is a mean over them
    let global_batch: Vec<f64> = (0..steps)
        .map(|s| {
            shard
                .train_by_rank
                .iter()
                .map(|t| {
                    t.len()
                        .saturating_sub(s * opts.batch_size)
                        .min(opts.batch_size) as f64
                })
                .sum()
        })
        .collect();

    let mut model = Model::new(cfg, seed)?;
    let mut opt = Adam::new(&model.params, tc.lr, tc.weight_decay);
    let mut summary = TrainSummary::new(tc.epochs);
    let mut since_best = 0usize;
    let mine = &shard.train_by_rank[rank];
    for epoch in 1..=tc.epochs {
        let t0 = Instant::now();
        let mut seeds = mine.clone();
        shuffle(
            &mut seeds,
            Stream::new(seed, &[0x5EED, epoch as u64, rank as u64]),
        );
        let mut batches: Vec<Vec<u32>> =
            seeds.chunks(opts.batch_size).map(<[u32]>::to_vec).collect();
        batches.resize(steps, Vec::new());
        let mut stats = BatchStats::default();
        let mut loss_sum = 0f64;
        let prepare = |_: usize, mb: MiniBatch| prepare(cfg.kind, shard, cache.as_ref(), rank, mb);
        let key = Stream::new(seed, &[0x5A3F, epoch as u64, rank as u64]).at(0);
        let result: Result<(), Error> = with_prefetch(
            &sampler,
            &batches,
            key,
            opts.loader_threads,
            opts.prefetch,
            prepare,
            |it| {
                for step in 0..steps {
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
                    let grads = if p.seeds == 0 {
                        let mut g = model.zero_grads();
                        mesh.all_reduce(&mut g)
                            .map_err(physalia_gnn::Error::Exchange)?;
                        g
                    } else {
                        let fwd = model.forward_blocks(&p.blocks, &p.x, pass)?;
                        let rows: Vec<u32> = (0..p.seeds as u32).collect();
                        let (l, dl) =
                            cross_entropy(&fwd.logits, &p.labels, &rows, global_batch[step]);
                        loss_sum += l / global_batch[step];
                        model.backward_blocks(&p.blocks, fwd, dl, mesh)?
                    };
                    opt.step(&mut model.params, &grads);
                    stats.compute_s += tc0.elapsed().as_secs_f64();
                }
                Ok(())
            },
        );
        result?;
        mesh.begin_pass(Pass::Train {
            epoch: epoch as u64,
        });
        let mut loss = [loss_sum];
        mesh.all_reduce_scalars(&mut loss)
            .map_err(physalia_gnn::Error::Exchange)?;
        // each step's loss was a mean over its global batch; the epoch's is the mean over steps
        let loss = loss[0] / steps.max(1) as f64;
        let train_s = t0.elapsed().as_secs_f64();
        if !loss.is_finite() {
            return Err(physalia_gnn::Error::Diverged { epoch, loss }.into());
        }
        let mut m = EpochMetrics {
            epoch,
            loss,
            train_acc: None,
            val_acc: None,
            test_acc: None,
            train_s,
            eval_s: 0.0,
            exchange: Default::default(),
            batches: Some(stats),
        };
        if epoch % tc.eval_every.max(1) == 0 || epoch == tc.epochs {
            let t1 = Instant::now();
            let [tr, va, te] = physalia_gnn::evaluate(
                &mut model,
                shard.eval_graph,
                shard.features,
                shard.eval_sets,
                mesh,
            )?;
            m.eval_s = t1.elapsed().as_secs_f64();
            (m.train_acc, m.val_acc, m.test_acc) = (tr, va, te);
            if summary.observe(epoch, va, te) {
                since_best = 0;
            } else if va.is_some() {
                since_best += 1;
            }
        }
        m.exchange = mesh.take_stats();
        on_epoch(&m);
        summary.epochs.push(m);
        if tc.patience.is_some_and(|p| since_best >= p) {
            summary.stopped_early = true;
            break;
        }
    }
    Ok((model, summary))
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
    rank: usize,
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
        let src = if owner as usize == rank {
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
        requests[owner as usize].push(row);
        dest[owner as usize].push(r);
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

/// Pre-samples `presample_batches` batches of this rank's seeds, ranks remote input rows by how often they
/// were read, and fetches the `cache_rows` most read (ties to the lower node id). Every rank takes part in
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
                if shard.owner[v as usize] as usize != rank {
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
        let o = shard.owner[v as usize] as usize;
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
    pub owner: Vec<u32>,
    pub row: Vec<u32>,
    pub train_by_rank: Vec<Vec<u32>>,
    pub features: Matrix,
    pub labels: Vec<i64>,
    pub eval_graph: LocalGraph,
    pub eval_sets: NodeSets,
}

impl ShardData {
    /// A data-parallel worker's view: its partition (`part`), every node's part (`assignment`, which
    /// is also the rank that owns it) and the whole graph's training nodes.
    pub fn from_part(
        part: &physalia_graph::partition::Part,
        assignment: &[u32],
        train: &[u32],
        cfg: &ModelConfig,
        row_normalize_features: bool,
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
        let mut train_by_rank = vec![Vec::new(); part.k];
        for &v in train {
            train_by_rank[assignment[v as usize] as usize].push(v);
        }
        let (eval_graph, features, eval_sets) =
            crate::local_inputs(part, cfg, row_normalize_features);
        ShardData {
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
            eval_graph: &self.eval_graph,
            eval_sets: &self.eval_sets,
        }
    }
}
