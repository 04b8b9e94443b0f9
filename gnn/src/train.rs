//! Full-graph training: forward, masked loss, backward, Adam, evaluation, per-epoch metrics.
//!
//! The same loop runs on a single worker (with [`LocalExchange`](crate::LocalExchange)) and on every worker
//! of a partition-parallel job; losses and accuracy counts are summed through the exchange so every worker
//! reports the global numbers. It is also the loop of every device: [`train_loop`] runs an [`EpochStep`], the
//! host [`Model`]'s here (`train_resumable`) or a [`crate::DeviceModel`]'s on any [`crate::Ops`] device
//! ([`crate::device::train_resumable_on`], what a GPU worker runs), so the two cannot drift apart.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::exchange::Exchange;
use crate::loss::{correct, cross_entropy};
use crate::model::{LocalGraph, Model, Pass};
use crate::optim::Adam;
use crate::tensor::Matrix;
use crate::{Error, Result};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    pub epochs: usize,
    pub lr: f32,
    pub weight_decay: f32,
    /// Evaluate every this many epochs (and always after the last).
    pub eval_every: usize,
    /// Stop when validation accuracy has not improved for this many evaluations.
    pub patience: Option<usize>,
}

impl TrainConfig {
    /// Whether epoch `epoch` (1-based) ends with an evaluation: every `eval_every`, and the last.
    pub fn evaluates(&self, epoch: usize) -> bool {
        epoch.is_multiple_of(self.eval_every.max(1)) || epoch == self.epochs
    }
}

/// The labelled rows of the owned nodes, as local row indices.
pub struct NodeSets {
    pub labels: Vec<i64>,
    pub train: Vec<u32>,
    pub val: Vec<u32>,
    pub test: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochMetrics {
    /// 1-based.
    pub epoch: usize,
    pub loss: f64,
    pub train_acc: Option<f64>,
    pub val_acc: Option<f64>,
    pub test_acc: Option<f64>,
    /// Forward, backward and optimizer step.
    pub train_s: f64,
    pub eval_s: f64,
    /// What the exchange moved in this epoch (all zero on a single worker).
    #[serde(default)]
    pub exchange: crate::exchange::ExchangeStats,
    /// Mini-batch training only: steps, sampling, feature fetching and the remote-row cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batches: Option<BatchStats>,
    /// The device the epoch trained on when it is not the CPU that was asked for: `cuda:0 (NVIDIA H100 ..)`,
    /// or `cpu (fallback: ...)` when a GPU was asked for and could not be used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The first epoch of a full-graph training call only: seconds the engine spent before it (the
    /// training rows counted over all workers, which waits for the slowest; the device set up; the first
    /// layer's constant input prepared: its `A X`, or the input features' halo rows under input dropout).
    /// After an in-place resize this is most of a worker's setup (issue 33).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prepare_s: Option<f64>,
}

/// One epoch of mini-batch training on one worker.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BatchStats {
    pub steps: usize,
    /// Seeds trained (this worker's share).
    pub seeds: u64,
    /// Edges in the sampled blocks.
    pub sampled_edges: u64,
    /// Seconds the trainer waited for the loader threads (sampling and gathering not hidden by compute).
    pub sample_wait_s: f64,
    /// Seconds fetching rows from peers (feature rows, or P3's partial products and their gradients).
    pub fetch_s: f64,
    /// Seconds in forward, backward and the optimizer.
    pub compute_s: f64,
    /// Input rows read from this worker's own features.
    pub local_rows: u64,
    /// Input rows owned by peers: found in the cache, or fetched.
    pub cache_hits: u64,
    pub cache_misses: u64,
}

impl BatchStats {
    /// Share of remote input rows the cache served; `None` when no row was remote.
    pub fn hit_rate(&self) -> Option<f64> {
        let remote = self.cache_hits + self.cache_misses;
        (remote > 0).then(|| self.cache_hits as f64 / remote as f64)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainSummary {
    pub epochs: Vec<EpochMetrics>,
    /// Epoch with the highest validation accuracy (the first such), with its validation and test accuracy.
    pub best_epoch: Option<usize>,
    pub best_val_acc: Option<f64>,
    pub test_acc_at_best_val: Option<f64>,
    pub stopped_early: bool,
}

impl EpochMetrics {
    /// A training epoch's metrics before evaluation and exchange statistics are added.
    pub fn trained(epoch: usize, loss: f64, train_s: f64) -> EpochMetrics {
        EpochMetrics {
            epoch,
            loss,
            train_acc: None,
            val_acc: None,
            test_acc: None,
            train_s,
            eval_s: 0.0,
            exchange: Default::default(),
            batches: None,
            device: None,
            prepare_s: None,
        }
    }
}

impl TrainSummary {
    pub fn new(epochs: usize) -> TrainSummary {
        TrainSummary {
            epochs: Vec::with_capacity(epochs),
            best_epoch: None,
            best_val_acc: None,
            test_acc_at_best_val: None,
            stopped_early: false,
        }
    }

    /// Records an evaluation; returns whether validation accuracy improved on the best so far.
    pub fn observe(&mut self, epoch: usize, val: Option<f64>, test: Option<f64>) -> bool {
        match val {
            Some(v) if self.best_val_acc.is_none_or(|b| v > b) => {
                self.best_epoch = Some(epoch);
                self.best_val_acc = Some(v);
                self.test_acc_at_best_val = test;
                true
            }
            _ => false,
        }
    }
}

/// Accuracy on train, val and test rows from an evaluation pass (no dropout), summed over workers. `x` and
/// `sets` are in the caller's order, whatever order `g` holds its rows in.
pub fn evaluate(
    model: &mut Model,
    g: &LocalGraph,
    x: &Matrix,
    sets: &NodeSets,
    ex: &mut dyn Exchange,
) -> Result<[Option<f64>; 3]> {
    let permuted = g.row_order().map(|o| o.rows_to_engine(x));
    let x = permuted.as_ref().unwrap_or(x);
    at_edge(g, sets, ex, |sets, ex| {
        let counts = correct_counts(model, g, x, sets, ex)?;
        global_accuracies(counts, sets, ex)
    })
}

/// This worker's correct predictions on its train, val and test rows from an evaluation pass; the
/// activations are dropped before the caller sums the counts over workers.
fn correct_counts(
    model: &mut Model,
    g: &LocalGraph,
    x: &Matrix,
    sets: &NodeSets,
    ex: &mut dyn Exchange,
) -> Result<[usize; 3]> {
    let fwd = model.forward(g, x, Pass::Eval, ex)?;
    let rows = [&sets.train, &sets.val, &sets.test];
    Ok(rows.map(|r| correct(&fwd.logits, &sets.labels, r)))
}

/// Train, val and test accuracy over all workers from this worker's correct counts on its rows of each.
pub fn global_accuracies(
    correct: [usize; 3],
    sets: &NodeSets,
    ex: &mut dyn Exchange,
) -> Result<[Option<f64>; 3]> {
    let mut counts = [0f64; 6];
    for (k, rows) in [&sets.train, &sets.val, &sets.test].into_iter().enumerate() {
        counts[2 * k] = correct[k] as f64;
        counts[2 * k + 1] = rows.len() as f64;
    }
    ex.all_reduce_scalars(&mut counts)
        .map_err(Error::Exchange)?;
    Ok([0, 1, 2].map(|k| (counts[2 * k + 1] > 0.0).then(|| counts[2 * k] / counts[2 * k + 1])))
}

/// Trains `model` for `cfg.epochs` epochs, calling `on_epoch` after each.
pub fn train(
    model: &mut Model,
    g: &LocalGraph,
    x: &Matrix,
    sets: &NodeSets,
    cfg: &TrainConfig,
    ex: &mut dyn Exchange,
    on_epoch: &mut dyn FnMut(&EpochMetrics),
) -> Result<TrainSummary> {
    let mut opt = Adam::new(&model.params, cfg.lr, cfg.weight_decay);
    let (summary, _) = train_resumable(
        model,
        &mut opt,
        Progress::default(),
        g,
        x,
        sets,
        cfg,
        ex,
        &mut |e| {
            on_epoch(e.metrics);
            true
        },
    )?;
    Ok(summary)
}

/// What `train_resumable`'s callback sees after an epoch: its metrics and everything a checkpoint holds.
pub struct EpochEnd<'a> {
    pub metrics: &'a EpochMetrics,
    pub progress: &'a Progress,
    pub model: &'a Model,
    pub opt: &'a Adam,
}

/// Where training stands after its last completed epoch: with the weights and the optimizer state, enough
/// to continue as if it had never stopped (dropout masks are keyed by epoch, so no random state is kept).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// Epochs completed.
    pub epoch: usize,
    pub best_epoch: Option<usize>,
    pub best_val_acc: Option<f64>,
    pub test_acc_at_best_val: Option<f64>,
    /// Evaluations since the best (for `patience`).
    pub since_best: usize,
}

impl Progress {
    /// An empty summary for the epochs after this point of a run of `epochs`, carrying its best-validation
    /// record, as a run that never stopped would have it.
    pub fn summary(&self, epochs: usize) -> TrainSummary {
        let mut summary = TrainSummary::new(epochs.saturating_sub(self.epoch));
        summary.best_epoch = self.best_epoch;
        summary.best_val_acc = self.best_val_acc;
        summary.test_acc_at_best_val = self.test_acc_at_best_val;
        summary
    }
}

/// Trains from `start` (epochs `start.epoch + 1 ..= cfg.epochs`) with the given optimizer. After each epoch
/// `on_epoch` sees its metrics and the progress so far and returns whether to go on; stopping there leaves
/// `model`, `opt` and the returned progress ready to be checkpointed and resumed, with results identical to
/// an uninterrupted run. The summary holds this call's epochs, with the best-validation fields over all.
#[allow(clippy::too_many_arguments)]
pub fn train_resumable(
    model: &mut Model,
    opt: &mut Adam,
    start: Progress,
    g: &LocalGraph,
    x: &Matrix,
    sets: &NodeSets,
    cfg: &TrainConfig,
    ex: &mut dyn Exchange,
    on_epoch: &mut dyn FnMut(&EpochEnd<'_>) -> bool,
) -> Result<(TrainSummary, Progress)> {
    let permuted = g.row_order().map(|o| o.rows_to_engine(x));
    at_edge(g, sets, ex, |sets, ex| {
        let step = HostStep {
            model,
            opt,
            g,
            x: Features::Borrowed(permuted.as_ref().unwrap_or(x)),
            sets,
        };
        train_loop(|| Ok(step), start, g.n_dst(), sets, cfg, ex, on_epoch)
    })
}

/// [`train_resumable`] owning the input features, so it can free them as soon as the model no longer reads
/// them ([`Model::needs_input`]: GCN's first layer once `A X` is cached), instead of holding them all run.
#[allow(clippy::too_many_arguments)]
pub fn train_resumable_owned(
    model: &mut Model,
    opt: &mut Adam,
    start: Progress,
    g: &LocalGraph,
    x: Matrix,
    sets: &NodeSets,
    cfg: &TrainConfig,
    ex: &mut dyn Exchange,
    on_epoch: &mut dyn FnMut(&EpochEnd<'_>) -> bool,
) -> Result<(TrainSummary, Progress)> {
    // the caller's features in engine order, the caller's copy freed before any activation exists
    let mut x = x;
    if let Some(o) = g.row_order() {
        o.permute_to_engine_in_place(&mut x);
    }
    at_edge(g, sets, ex, |sets, ex| {
        let step = HostStep {
            model,
            opt,
            g,
            x: Features::Owned(x),
            sets,
        };
        train_loop(|| Ok(step), start, g.n_dst(), sets, cfg, ex, on_epoch)
    })
}

/// Runs `f` with the caller's node sets and exchange as the engine sees them: unchanged, or, when `g` holds
/// its owned rows in a locality order, the sets in engine order and the exchange behind
/// [`crate::order::Reordered`] (owned rows handed to it in the caller's order). The one place the training
/// entry points cross [`crate::order`]'s edge, with the features they permute themselves.
pub(crate) fn at_edge<R>(
    g: &LocalGraph,
    sets: &NodeSets,
    ex: &mut dyn Exchange,
    f: impl FnOnce(&NodeSets, &mut dyn Exchange) -> R,
) -> R {
    match g.row_order() {
        None => f(sets, ex),
        Some(order) => {
            let sets = order.sets_to_engine(sets);
            let mut ex = crate::order::Reordered {
                inner: ex,
                order: order.clone(),
            };
            f(&sets, &mut ex)
        }
    }
}

/// One worker's share of a full-graph epoch on the device that holds the model: what [`train_loop`] asks of
/// the host [`Model`] (`train_resumable`) and of a [`crate::DeviceModel`] on any [`crate::Ops`] device
/// ([`crate::device::train_resumable_on`]). What is not a device's business stays in the loop, written once:
/// the collective calls outside the layers (the training rows' count, the loss, the accuracy counts), so
/// workers issue them in one order whatever their devices, and the timing, the divergence check, the
/// evaluation schedule, best validation, patience and the callback, so both devices report alike.
pub trait EpochStep {
    type Error;

    /// Runs before the first epoch of a call with epochs left (`first` is its pass): computes a constant
    /// `A X` and frees the features the model no longer reads, so their memory is free before any
    /// activation exists. A step whose features are borrowed has nothing to free and may do nothing.
    fn prepare(&mut self, first: Pass, ex: &mut dyn Exchange) -> Result<(), Self::Error>;

    /// One training step of epoch `epoch` (1-based, the dropout key): forward, the cross-entropy over this
    /// worker's training rows with its gradient normalised by `n_train` (the count over all workers),
    /// backward, the optimizer. Returns this worker's loss sum, which the loop sums over workers.
    fn train_step(
        &mut self,
        epoch: usize,
        n_train: f64,
        ex: &mut dyn Exchange,
    ) -> Result<f64, Self::Error>;

    /// Waits for the step's queued work, so the epoch's training time covers it; called after the loss is
    /// summed over workers, so an asynchronous device overlaps its last kernels with that exchange.
    fn synchronize(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }

    /// This worker's correct predictions on its train, val and test rows, from an evaluation pass.
    fn correct(&mut self, ex: &mut dyn Exchange) -> Result<[usize; 3], Self::Error>;

    /// The host model and optimizer the callback sees, holding the step's current state (a device copies
    /// its parameters and Adam's moments there, so a checkpoint written from them resumes on either device).
    fn host_state(&mut self) -> Result<(&Model, &Adam), Self::Error>;
}

/// The full-graph epoch loop of every device: `setup` builds the step (on a device: uploads the graph, the
/// features and the model) once the labels are checked and the training rows counted over all workers, then
/// epochs `start.epoch + 1 ..= cfg.epochs` run as [`train_resumable`] documents. `n_dst` is the number of
/// owned rows (one label each).
pub fn train_loop<S, E>(
    setup: impl FnOnce() -> Result<S, S::Error>,
    start: Progress,
    n_dst: usize,
    sets: &NodeSets,
    cfg: &TrainConfig,
    ex: &mut dyn Exchange,
    on_epoch: &mut dyn FnMut(&EpochEnd<'_>) -> bool,
) -> Result<(TrainSummary, Progress), E>
where
    S: EpochStep,
    E: From<S::Error> + From<Error>,
{
    if sets.labels.len() != n_dst {
        return Err(Error::Shape(format!("{} labels for {n_dst} nodes", sets.labels.len())).into());
    }
    let t_prepare = Instant::now();
    let mut n_train = [sets.train.len() as f64];
    ex.all_reduce_scalars(&mut n_train)
        .map_err(Error::Exchange)?;
    let n_train = n_train[0];
    if n_train == 0.0 {
        return Err(Error::Config("the training split is empty".into()).into());
    }
    let mut step = setup()?;
    let mut summary = start.summary(cfg.epochs);
    let mut progress = start;
    if progress.epoch < cfg.epochs {
        let first = Pass::Train {
            epoch: progress.epoch as u64 + 1,
        };
        step.prepare(first, ex)?;
    }
    let mut prepare_s = Some(t_prepare.elapsed().as_secs_f64());
    for epoch in progress.epoch + 1..=cfg.epochs {
        let t0 = Instant::now();
        let mut loss = [step.train_step(epoch, n_train, ex)?];
        ex.all_reduce_scalars(&mut loss).map_err(Error::Exchange)?;
        step.synchronize()?;
        let train_s = t0.elapsed().as_secs_f64();
        let loss = loss[0] / n_train;
        if !loss.is_finite() {
            return Err(Error::Diverged { epoch, loss }.into());
        }
        let mut m = EpochMetrics::trained(epoch, loss, train_s);
        m.prepare_s = prepare_s.take();
        let evaluated = cfg.evaluates(epoch);
        if evaluated {
            let t1 = Instant::now();
            let correct = step.correct(ex)?;
            [m.train_acc, m.val_acc, m.test_acc] = global_accuracies(correct, sets, ex)?;
            m.eval_s = t1.elapsed().as_secs_f64();
        }
        m.exchange = ex.take_stats();
        let (model, opt) = step.host_state()?;
        if close_epoch(
            &mut summary,
            &mut progress,
            cfg.patience,
            m,
            evaluated,
            model,
            opt,
            on_epoch,
        ) {
            break;
        }
    }
    Ok((summary, progress))
}

/// The input features of a training loop: borrowed, or owned and freed once the model no longer needs them.
enum Features<'x> {
    Borrowed(&'x Matrix),
    Owned(Matrix),
}

impl Features<'_> {
    fn get(&self) -> &Matrix {
        match self {
            Features::Borrowed(x) => x,
            Features::Owned(x) => x,
        }
    }

    /// Frees owned features the model will not read again (an empty matrix stands in for them) and hands
    /// their pages back to the OS, so they do not stay resident as a hole below the epoch's buffers.
    fn release_if_unneeded(&mut self, model: &Model) {
        if let Features::Owned(x) = self
            && x.rows() > 0
            && !model.needs_input()
        {
            *x = Matrix::zeros(0, 0);
            crate::heap::release_freed_memory();
        }
    }
}

/// The host [`Model`] as an [`EpochStep`]: the layers on [`crate::Cpu`], the host's loss and [`Adam`], and
/// the caller's model and optimizer updated in place (nothing to copy for the callback).
struct HostStep<'a, 'x> {
    model: &'a mut Model,
    opt: &'a mut Adam,
    g: &'a LocalGraph,
    x: Features<'x>,
    sets: &'a NodeSets,
}

impl EpochStep for HostStep<'_, '_> {
    type Error = Error;

    fn prepare(&mut self, first: Pass, ex: &mut dyn Exchange) -> Result<()> {
        // borrowed features stay the caller's: the first forward computes `A X` as every later one would
        if let Features::Owned(_) = self.x {
            self.model
                .cache_input_aggregation(self.g, self.x.get(), first, ex)?;
            self.x.release_if_unneeded(self.model);
            // what loading freed (the part's arrays, the operators' build buffers) would stay resident below
            // the epoch's buffers
            crate::heap::release_freed_memory();
        }
        Ok(())
    }

    fn train_step(&mut self, epoch: usize, n_train: f64, ex: &mut dyn Exchange) -> Result<f64> {
        let span = crate::profile::span("(forward, all)");
        let fwd = self.model.forward(
            self.g,
            self.x.get(),
            Pass::Train {
                epoch: epoch as u64,
            },
            ex,
        )?;
        drop(span);
        let span = crate::profile::span("loss");
        let sets = self.sets;
        let (loss_sum, d_logits) = cross_entropy(&fwd.logits, &sets.labels, &sets.train, n_train);
        drop(span);
        let span = crate::profile::span("(backward, all)");
        let grads = self.model.backward(self.g, fwd, d_logits, ex)?;
        drop(span);
        self.x.release_if_unneeded(self.model);
        let span = crate::profile::span("optimizer");
        self.opt.step(&mut self.model.params, &grads);
        drop(span);
        Ok(loss_sum)
    }

    fn correct(&mut self, ex: &mut dyn Exchange) -> Result<[usize; 3]> {
        let counts = correct_counts(self.model, self.g, self.x.get(), self.sets, ex)?;
        self.x.release_if_unneeded(self.model);
        Ok(counts)
    }

    fn host_state(&mut self) -> Result<(&Model, &Adam)> {
        Ok((self.model, self.opt))
    }
}

/// An epoch's end, the same for every trainer (full graph, mini-batch, P3): takes in its evaluation when
/// there was one (best validation, patience), advances `progress`, hands the callback the epoch, the model
/// and the optimizer, and records the epoch. Returns whether training stops here: patience ran out (the
/// summary says it stopped early) or the callback said so.
#[allow(clippy::too_many_arguments)]
pub fn close_epoch(
    summary: &mut TrainSummary,
    progress: &mut Progress,
    patience: Option<usize>,
    m: EpochMetrics,
    evaluated: bool,
    model: &Model,
    opt: &Adam,
    on_epoch: &mut dyn FnMut(&EpochEnd<'_>) -> bool,
) -> bool {
    if evaluated {
        if summary.observe(m.epoch, m.val_acc, m.test_acc) {
            progress.since_best = 0;
        } else if m.val_acc.is_some() {
            progress.since_best += 1;
        }
    }
    progress.epoch = m.epoch;
    progress.best_epoch = summary.best_epoch;
    progress.best_val_acc = summary.best_val_acc;
    progress.test_acc_at_best_val = summary.test_acc_at_best_val;
    let go_on = on_epoch(&EpochEnd {
        metrics: &m,
        progress,
        model,
        opt,
    });
    summary.epochs.push(m);
    let out_of_patience = patience.is_some_and(|p| progress.since_best >= p);
    if out_of_patience {
        summary.stopped_early = true;
    }
    out_of_patience || !go_on
}
