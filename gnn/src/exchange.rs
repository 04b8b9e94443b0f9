//! Where rows owned by other workers enter a layer: the seam between the engine and the network.
//!
//! Every layer's forward is split at its aggregation. Before aggregating, a layer hands the rows it computed
//! for its own nodes (its "messages") to an [`Exchange`], which returns the rows of the halo nodes that peers
//! own. Backward mirrors it: the gradients of halo rows go back to their owners and the gradients that peers
//! computed for our rows come in. Weight gradients are all-reduced at the end of backward.
//!
//! A single worker owns every node, so [`LocalExchange`] moves nothing; the QUIC mesh implements the same
//! trait for partition-parallel training.

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
