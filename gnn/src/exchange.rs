//! Where rows owned by other workers enter a layer: the seam between the engine and the network.
//!
//! Every layer's forward is split at its aggregation. Before aggregating, a layer hands the rows it computed
//! for its own nodes (its "messages") to an [`Exchange`], which returns the rows of the halo nodes that peers
//! own. Backward mirrors it: the gradients of halo rows go back to their owners and the gradients that peers
//! computed for our rows come in. Weight gradients are all-reduced at the end of backward.
//!
//! A single worker owns every node, so [`LocalExchange`] moves nothing; the QUIC mesh implements the same
//! trait for partition-parallel training.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::tensor::Matrix;

/// What an exchange moved and waited for since the last [`Exchange::take_stats`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExchangeStats {
    /// Bytes on the wire (headers included).
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Payload bytes per layer and phase (`forward`, `backward`, `all_reduce`).
    pub per_layer: Vec<LayerBytes>,
    /// Seconds spent sending and waiting for halo rows and gradients.
    pub halo_s: f64,
    /// Seconds spent in all-reduce.
    pub all_reduce_s: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerBytes {
    /// `None` for the all-reduce of weight gradients and statistics.
    pub layer: Option<u16>,
    pub phase: String,
    pub sent: u64,
    pub received: u64,
}

pub type ExchangeError = Box<dyn std::error::Error + Send + Sync>;

/// Receives halo rows `range` (halo indices, a contiguous range of one peer's rows) of a layer's messages.
pub type VisitRows<'a> = dyn FnMut(Range<usize>, Matrix) -> Result<(), ExchangeError> + 'a;

/// Produces the gradients of halo rows `range` (halo indices) for their owner.
pub type HaloGrads<'a> = dyn FnMut(Range<usize>) -> Matrix + 'a;

pub trait Exchange {
    /// Called at the start of every forward pass, so the exchange can tag its messages and draw per-epoch
    /// choices (boundary sampling, staleness). Evaluation passes are `Pass::Eval`.
    fn begin_pass(&mut self, _pass: crate::model::Pass) {}

    /// Rows of the halo nodes of `layer`'s messages, in halo order, given the rows of the owned nodes.
    /// `None` when this worker has no halo.
    fn forward(&mut self, layer: usize, own: &Matrix) -> Result<Option<Matrix>, ExchangeError>;

    /// Sends `halo_grad` (gradients of the halo rows) to their owners and adds the gradients peers computed
    /// for our owned rows into `own_grad`.
    fn backward(
        &mut self,
        layer: usize,
        halo_grad: Matrix,
        own_grad: &mut Matrix,
    ) -> Result<(), ExchangeError>;

    /// Whether halo rows are dropped once aggregated and fetched again in backward (SAR: sequential
    /// aggregation and rematerialisation). Layers then take halo rows through [`Exchange::forward_each`],
    /// return their gradients through [`Exchange::backward_each`], and get them again for backward with
    /// [`Exchange::refetch_each`] instead of keeping them.
    fn rematerializes(&self) -> bool {
        false
    }

    /// The rows of the halo nodes of `layer`'s messages, handed to `visit` one contiguous range of halo
    /// rows at a time (one peer's rows), so a layer can aggregate them and drop them before the next range
    /// arrives. Ranges are disjoint and cover every halo row; their order is the exchange's. The default
    /// hands over [`Exchange::forward`]'s rows as one range.
    fn forward_each(
        &mut self,
        layer: usize,
        own: &Matrix,
        visit: &mut VisitRows<'_>,
    ) -> Result<(), ExchangeError> {
        if let Some(halo) = self.forward(layer, own)? {
            visit(0..halo.rows(), halo)?;
        }
        Ok(())
    }

    /// [`Exchange::forward_each`] again in backward: every worker sends its owned rows `own` (the same
    /// messages as in forward) once more and `visit` sees the same halo rows as forward did. The default has
    /// nothing to fetch from and fails.
    fn refetch_each(
        &mut self,
        layer: usize,
        _own: &Matrix,
        _visit: &mut VisitRows<'_>,
    ) -> Result<(), ExchangeError> {
        Err(format!("layer {layer}: this exchange cannot fetch halo rows again").into())
    }

    /// [`Exchange::backward`] with the halo gradients produced one range of halo rows at a time by `grad`
    /// (the ranges cover `0..n_halo`), so a layer never holds all of them. The default asks for all at once.
    fn backward_each(
        &mut self,
        layer: usize,
        n_halo: usize,
        own_grad: &mut Matrix,
        grad: &mut HaloGrads<'_>,
    ) -> Result<(), ExchangeError> {
        let halo = grad(0..n_halo);
        self.backward(layer, halo, own_grad)
    }

    /// Sums the weight gradients over all workers, in place.
    fn all_reduce(&mut self, grads: &mut [Matrix]) -> Result<(), ExchangeError>;

    /// Sums scalar statistics (loss, correct counts) over all workers, in place.
    fn all_reduce_scalars(&mut self, values: &mut [f64]) -> Result<(), ExchangeError>;

    /// Traffic and waiting since the previous call.
    fn take_stats(&mut self) -> ExchangeStats {
        ExchangeStats::default()
    }

    /// True when every call is a no-op (one worker owns the whole graph), so a device engine can skip
    /// copying rows to the host for it.
    fn is_local(&self) -> bool {
        false
    }
}

/// The exchange of a worker that owns the whole graph.
#[derive(Debug, Default)]
pub struct LocalExchange;

impl Exchange for LocalExchange {
    fn forward(&mut self, _layer: usize, _own: &Matrix) -> Result<Option<Matrix>, ExchangeError> {
        Ok(None)
    }

    fn backward(
        &mut self,
        _layer: usize,
        halo_grad: Matrix,
        _own: &mut Matrix,
    ) -> Result<(), ExchangeError> {
        debug_assert_eq!(halo_grad.rows(), 0, "a single worker has no halo");
        Ok(())
    }

    fn all_reduce(&mut self, _grads: &mut [Matrix]) -> Result<(), ExchangeError> {
        Ok(())
    }

    fn all_reduce_scalars(&mut self, _values: &mut [f64]) -> Result<(), ExchangeError> {
        Ok(())
    }

    fn is_local(&self) -> bool {
        true
    }
}
