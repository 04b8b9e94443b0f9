//! Full-graph training with the model, its activations and Adam's state on an [`Ops`] device: the
//! [`EpochStep`] of a [`DeviceModel`], for one worker holding the whole graph or one partition of it, run by
//! the epoch loop every device shares ([`crate::train::train_loop`]). `physalia_gnn_cuda` calls it with the
//! GPU; the tests call it with [`super::Cpu`] to check it against the host [`Model`]'s step.

use crate::exchange::Exchange;
use crate::model::{LocalGraph, Model, Pass};
use crate::optim::Adam;
use crate::tensor::Matrix;
use crate::train::{
    EpochEnd, EpochStep, NodeSets, Progress, TrainConfig, TrainSummary, train_loop,
};

use super::{AdamConfig, DeviceGraph, DeviceModel, Ops};

/// Trains `model` from `start` (epochs `start.epoch + 1 ..= cfg.epochs`) on `ops`, as
/// [`crate::train_resumable`] does on the host: same arguments, same loop, same results up to the device's
/// float reordering (1e-4 on the losses), same callback. After every epoch `model` and `opt` hold the
/// device's parameters and Adam's moments (the callback sees them), so a checkpoint resumes on either device.
/// `E` is the caller's error, holding the device's and the engine's.
#[allow(clippy::too_many_arguments)]
pub fn train_resumable_on<O, E>(
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
) -> Result<(TrainSummary, Progress), E>
where
    O: Ops,
    E: From<O::Error> + From<crate::Error>,
{
    // the closure is written at the call, where the bound makes it `FnOnce`: the step it returns keeps the
    // references it was handed
    // a graph in a locality order: features and sets permuted in at the edge, as the host's step does
    let permuted = g.row_order().map(|o| o.rows_to_engine(x));
    let x = permuted.as_ref().unwrap_or(x);
    crate::train::at_edge(g, sets, ex, |sets, ex| {
        train_loop(
            || DeviceStep::upload(ops, model, opt, g, x, sets),
            start,
            g.n_dst(),
            sets,
            cfg,
            ex,
            on_epoch,
        )
    })
}

/// A [`DeviceModel`] training on one worker's graph, with everything an epoch reads resident on the device,
/// and the caller's host model and optimizer it copies its state into for the callback.
struct DeviceStep<'a, O: Ops> {
    ops: &'a mut O,
    model: &'a mut Model,
    opt: &'a mut Adam,
    dm: DeviceModel<O>,
    g: DeviceGraph<O>,
    /// The features; an empty matrix once the model no longer reads them.
    x: O::Mat,
    labels: O::Labels,
    /// Train, val and test rows.
    rows: [O::Idx; 3],
    adam: AdamConfig,
}

impl<'a, O: Ops> DeviceStep<'a, O> {
    /// Uploads the graph, the features, the labels, the row sets, the model and, when `opt` has stepped (a
    /// resumed checkpoint), Adam's moments.
    fn upload(
        ops: &'a mut O,
        model: &'a mut Model,
        opt: &'a mut Adam,
        g: &LocalGraph,
        x: &Matrix,
        sets: &NodeSets,
    ) -> Result<DeviceStep<'a, O>, O::Error> {
        let g = DeviceGraph::local(ops, g, model.config().kind)?;
        let x = ops.upload(x)?;
        let labels = ops.upload_labels(&sets.labels)?;
        let [train, val, test] = [&sets.train, &sets.val, &sets.test].map(|r| ops.upload_idx(r));
        let rows = [train?, val?, test?];
        let mut dm = DeviceModel::from_model(ops, model)?;
        // the host model's seed of the input halo (a resize in place) is the device copy's to use
        if let Some(seed) = model.take_input_seed() {
            dm.seed_input_halo(seed);
        }
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
        Ok(DeviceStep {
            ops,
            model,
            opt,
            dm,
            g,
            x,
            labels,
            rows,
            adam,
        })
    }

    /// Frees the device's copy of the features once the model no longer reads them
    /// ([`DeviceModel::needs_input`]: GCN's first layer with `A X` cached and no input dropout): an empty
    /// matrix stands in for them, and the buffer goes back to the device's allocator, not to the pool's cache
    /// (no other buffer of the epoch has its shape).
    fn release_unneeded_features(&mut self) -> Result<(), O::Error> {
        if self.ops.dims(&self.x) != (0, 0) && !self.dm.needs_input() {
            self.x = self.ops.alloc(0, 0)?;
        }
        Ok(())
    }
}

impl<O: Ops> EpochStep for DeviceStep<'_, O> {
    type Error = O::Error;

    fn prepare(&mut self, first: Pass, ex: &mut dyn Exchange) -> Result<(), O::Error> {
        // the device's features are its own copy, borrowed or not on the host: always freed when unneeded
        self.dm
            .cache_input_aggregation_ex(self.ops, &self.g, &self.x, first, ex)?;
        self.release_unneeded_features()
    }

    fn train_step(
        &mut self,
        epoch: usize,
        n_train: f64,
        ex: &mut dyn Exchange,
    ) -> Result<f64, O::Error> {
        let pass = Pass::Train {
            epoch: epoch as u64,
        };
        let fwd = self.dm.forward_ex(self.ops, &self.g, &self.x, pass, ex)?;
        let (r, c) = self.ops.dims(&fwd.logits);
        let mut d_logits = self.ops.alloc(r, c)?;
        let loss_sum = self.ops.cross_entropy(
            &fwd.logits,
            &self.labels,
            &self.rows[0],
            n_train,
            &mut d_logits,
        )?;
        let grads = self.dm.backward_ex(self.ops, &self.g, fwd, d_logits, ex)?;
        self.dm.adam_step(self.ops, grads, self.adam)?;
        Ok(loss_sum)
    }

    fn synchronize(&mut self) -> Result<(), O::Error> {
        self.ops.synchronize()
    }

    fn correct(&mut self, ex: &mut dyn Exchange) -> Result<[usize; 3], O::Error> {
        let [train, val, test] = &self.rows;
        let sets = [train, val, test];
        let counts = self
            .dm
            .evaluate_ex(self.ops, &self.g, &self.x, &self.labels, &sets, ex)?;
        Ok([0, 1, 2].map(|k| counts[k] as usize))
    }

    fn host_state(&mut self) -> Result<(&Model, &Adam), O::Error> {
        self.dm.download_into(self.ops, self.model)?;
        self.dm.download_adam(self.ops, self.opt)?;
        Ok((self.model, self.opt))
    }
}
