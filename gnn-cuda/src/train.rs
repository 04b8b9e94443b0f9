//! Full-graph training on a device: `physalia_gnn::train_resumable`'s loop with the model, its activations and
//! the optimizer state on an [`Ops`] device, for one worker holding the whole graph or one partition of it.
//!
//! The loop is the CPU's, step for step: the global number of training rows and every epoch's loss are summed
//! through the exchange, the loss is checked for divergence, evaluation runs every `eval_every` epochs and
//! after the last, and [`physalia_gnn::close_epoch`] keeps the best-validation record and patience. After each
//! epoch the parameters and Adam's moments are copied into the host `Model` and `Adam` the callback sees, so a
//! checkpoint written there resumes on either device.

use std::time::Instant;

use physalia_gnn::device::{AdamConfig, DeviceGraph, DeviceModel, Ops};
use physalia_gnn::{
    Adam, EpochEnd, EpochMetrics, Exchange, LocalGraph, Matrix, Model, NodeSets, Pass, Progress,
    TrainConfig, TrainSummary,
};

use crate::device::GpuError;

/// Why device training stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Device(#[from] GpuError),
    #[error(transparent)]
    Engine(#[from] physalia_gnn::Error),
}

fn exchange(e: physalia_gnn::ExchangeError) -> TrainError {
    TrainError::Engine(physalia_gnn::Error::Exchange(e))
}

/// Trains `model` from `start` (epochs `start.epoch + 1 ..= cfg.epochs`) on `ops`, as
/// `physalia_gnn::train_resumable` does on the CPU: same arguments, same results up to float reordering
/// (1e-4 on the losses), same callback. `model` and `opt` hold the device's state after every epoch.
#[allow(clippy::too_many_arguments)]
pub fn train_resumable_on<O>(
    ops: &mut O,
    model: &mut Model,
    opt: &mut Adam,
    start: Progress,
    g: &LocalGraph,
    x: &Matrix,
    sets: &NodeSets,
    cfg: &TrainConfig,
    ex: &mut dyn Exchange,
    on_epoch: &mut dyn FnMut(&EpochEnd<'_>) -> bool,
) -> Result<(TrainSummary, Progress), TrainError>
where
    O: Ops,
    TrainError: From<O::Error>,
{
    if sets.labels.len() != g.n_dst() {
        return Err(physalia_gnn::Error::Shape(format!(
            "{} labels for {} nodes",
            sets.labels.len(),
            g.n_dst()
        ))
        .into());
    }
    let mut n_train = [sets.train.len() as f64];
    ex.all_reduce_scalars(&mut n_train).map_err(exchange)?;
    if n_train[0] == 0.0 {
        return Err(physalia_gnn::Error::Config("the training split is empty".into()).into());
    }
    let kind = model.config().kind;
    let dg = DeviceGraph::local(ops, g, kind)?;
    let mut xd = ops.upload(x)?;
    let labels = ops.upload_labels(&sets.labels)?;
    let rows = [&sets.train, &sets.val, &sets.test].map(|r| ops.upload_idx(r));
    let [train, val, test] = rows;
    let (train, val, test) = (train?, val?, test?);
    let mut dm = DeviceModel::from_model(ops, model)?;
    if opt.steps() > 0 {
        dm.restore_adam(ops, opt)?;
    }
    let adam = AdamConfig {
        lr: opt.lr,
        weight_decay: opt.weight_decay,
        beta1: opt.beta1,
        beta2: opt.beta2,
        eps: opt.eps,
    };
    let mut summary = start.summary(cfg.epochs);
    let mut progress = start;
    if progress.epoch < cfg.epochs {
        // a constant `A X` before the first epoch, so features the model no longer reads are freed before any
        // activation exists (as the CPU's loop does)
        let first = Pass::Train {
            epoch: progress.epoch as u64 + 1,
        };
        dm.cache_input_aggregation_ex(ops, &dg, &xd, first, ex)?;
        release_unneeded_features(ops, &dm, &mut xd)?;
    }
    for epoch in progress.epoch + 1..=cfg.epochs {
        let t0 = Instant::now();
        let fwd = dm.forward_ex(
            ops,
            &dg,
            &xd,
            Pass::Train {
                epoch: epoch as u64,
            },
            ex,
        )?;
        let (r, c) = ops.dims(&fwd.logits);
        let mut d_logits = ops.alloc(r, c)?;
        let loss_sum =
            ops.cross_entropy(&fwd.logits, &labels, &train, n_train[0], &mut d_logits)?;
        let grads = dm.backward_ex(ops, &dg, fwd, d_logits, ex)?;
        dm.adam_step(ops, grads, adam)?;
        let mut loss = [loss_sum];
        ex.all_reduce_scalars(&mut loss).map_err(exchange)?;
        ops.synchronize()?;
        let train_s = t0.elapsed().as_secs_f64();
        let loss = loss[0] / n_train[0];
        if !loss.is_finite() {
            return Err(physalia_gnn::Error::Diverged { epoch, loss }.into());
        }
        let mut m = EpochMetrics::trained(epoch, loss, train_s);
        let evaluated = cfg.evaluates(epoch);
        if evaluated {
            let t1 = Instant::now();
            let correct = dm.evaluate_ex(ops, &dg, &xd, &labels, &[&train, &val, &test], ex)?;
            let correct = [0, 1, 2].map(|k| correct[k] as usize);
            [m.train_acc, m.val_acc, m.test_acc] =
                physalia_gnn::global_accuracies(correct, sets, ex)?;
            m.eval_s = t1.elapsed().as_secs_f64();
        }
        m.exchange = ex.take_stats();
        // the callback sees the device's state (a checkpoint written from it resumes on either device)
        dm.download_into(ops, model)?;
        dm.download_adam(ops, opt)?;
        if physalia_gnn::close_epoch(
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

/// Frees the device's copy of the features once the model no longer reads them
/// ([`DeviceModel::needs_input`]: GCN's first layer with `A X` cached and no input dropout): an empty matrix
/// stands in for them, and the buffer goes back to the device's allocator, not to the pool's cache (no other
/// buffer of the epoch has its shape).
fn release_unneeded_features<O: Ops>(
    ops: &mut O,
    dm: &DeviceModel<O>,
    xd: &mut O::Mat,
) -> Result<(), O::Error> {
    if ops.dims(xd) != (0, 0) && !dm.needs_input() {
        *xd = ops.alloc(0, 0)?;
    }
    Ok(())
}
