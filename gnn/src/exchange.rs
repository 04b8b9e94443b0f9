//! Where rows owned by other workers enter a layer: the seam between the engine and the network.
//!
//! Every layer's forward is split at its aggregation. Before aggregating, a layer hands the rows it computed
//! for its own nodes (its "messages") to an [`Exchange`], which returns the rows of the halo nodes that peers
//! own. Backward mirrors it: the gradients of halo rows go back to their owners and the gradients that peers
//! computed for our rows come in. Weight gradients are all-reduced at the end of backward.
//!
//! A single worker owns every node, so [`LocalExchange`] moves nothing; the QUIC mesh implements the same
//! trait for partition-parallel training.

use crate::tensor::Matrix;

pub type ExchangeError = Box<dyn std::error::Error + Send + Sync>;

pub trait Exchange {
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
}
