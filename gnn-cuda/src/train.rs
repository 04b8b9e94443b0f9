//! Full-graph training on a device: `physalia_gnn::train_resumable`'s loop with the model, its activations and
//! the optimizer state on an [`Ops`] device, for one worker holding the whole graph or one partition of it.
//!
//! The loop is not here: it is the CPU's, the one `physalia_gnn::train_loop` every device runs (the global
//! number of training rows and every epoch's loss summed through the exchange, the divergence check, the
//! evaluation schedule, best validation and patience), with the device's step
//! (`physalia_gnn::device::train_resumable_on`: the `DeviceModel`, the device's loss and Adam). This module
//! gives it this crate's error, which holds the GPU's.

use physalia_gnn::device::Ops;
use physalia_gnn::{
    Adam, EpochEnd, Exchange, LocalGraph, Matrix, Model, NodeSets, Progress, TrainConfig,
    TrainSummary,
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
    physalia_gnn::device::train_resumable_on(ops, model, opt, start, g, x, sets, cfg, ex, on_epoch)
}
