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

/// Halo rows a worker already holds, by global node id, exactly as their owners would send them (the
/// input features' rows, after the same normalisation and the wire's rounding): a worker resized in place
/// holds most rows of its new input halo (rows it gave up, rows of its old halo), so only the others cross
/// the network ([`Exchange::forward_seeded`]).
#[derive(Clone, Debug, PartialEq)]
pub struct HaloSeed {
    /// Global node ids, ascending, each once.
    gids: Vec<u32>,
    /// Row `i` is node `gids[i]`'s.
    rows: Matrix,
}

impl Default for HaloSeed {
    /// No rows held: every halo row is fetched.
    fn default() -> HaloSeed {
        HaloSeed {
            gids: Vec::new(),
            rows: Matrix::zeros(0, 0),
        }
    }
}

impl HaloSeed {
    /// The rows of nodes `gids` (row `i` node `gids[i]`'s), in any order; a node listed twice keeps its
    /// first row.
    pub fn new(gids: Vec<u32>, rows: Matrix) -> Result<HaloSeed, String> {
        if gids.len() != rows.rows() {
            return Err(format!(
                "{} node ids for {} seeded rows",
                gids.len(),
                rows.rows()
            ));
        }
        if gids.windows(2).all(|w| w[0] < w[1]) {
            return Ok(HaloSeed { gids, rows });
        }
        let mut order: Vec<usize> = (0..gids.len()).collect();
        // stable: of a node listed twice, the first row sorts first
        order.sort_by_key(|&i| gids[i]);
        order.dedup_by_key(|i| gids[*i]);
        let cols = rows.cols();
        let mut data = Vec::with_capacity(order.len() * cols);
        for &i in &order {
            data.extend_from_slice(rows.row(i));
        }
        Ok(HaloSeed {
            gids: order.iter().map(|&i| gids[i]).collect(),
            rows: Matrix::from_vec(order.len(), cols, data),
        })
    }

    /// Node `gid`'s row, if held.
    pub fn row(&self, gid: u32) -> Option<&[f32]> {
        self.gids.binary_search(&gid).ok().map(|i| self.rows.row(i))
    }

    /// The node of row `i` (rows in ascending node order), `i < len()`.
    pub fn gid(&self, i: usize) -> u32 {
        self.gids[i]
    }

    /// How many rows are held.
    pub fn len(&self) -> usize {
        self.gids.len()
    }

    /// The nodes held, ascending, and their rows in that order.
    pub fn parts(&self) -> (&[u32], &Matrix) {
        (&self.gids, &self.rows)
    }

    pub fn is_empty(&self) -> bool {
        self.gids.is_empty()
    }

    /// The rows' width (0 when empty and built without one).
    pub fn cols(&self) -> usize {
        self.rows.cols()
    }
}

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

    /// [`Exchange::forward`]'s rows of an evaluation pass when `seed` already holds some of them: only
    /// the halo rows it lacks are asked of their owners, who send just those. Every worker calls it on the
    /// same pass (with or without rows in hand: a worker with none asks for all of them); a worker's own
    /// seed is its business alone. The default fetches every row as [`Exchange::forward`] does.
    fn forward_seeded(
        &mut self,
        layer: usize,
        own: &Matrix,
        _seed: &HaloSeed,
    ) -> Result<Option<Matrix>, ExchangeError> {
        self.forward(layer, own)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_halo_seed_finds_rows_by_node_whatever_order_they_came_in() {
        let rows = Matrix::from_vec(4, 2, vec![9., 9., 1., 1., 3., 3., 7., 7.]);
        // node 9 listed twice: its first row is kept
        let seed = HaloSeed::new(vec![9, 1, 3, 9], rows).unwrap();
        assert_eq!(seed.len(), 3);
        assert_eq!(seed.cols(), 2);
        assert_eq!((0..3).map(|i| seed.gid(i)).collect::<Vec<_>>(), [1, 3, 9]);
        assert_eq!(seed.row(9), Some(&[9., 9.][..]));
        assert_eq!(seed.row(3), Some(&[3., 3.][..]));
        assert_eq!(seed.row(4), None);
        assert!(HaloSeed::default().row(0).is_none());
        let err = HaloSeed::new(vec![1, 2], Matrix::zeros(1, 2)).unwrap_err();
        assert!(err.contains("2 node ids for 1 seeded rows"), "{err}");
    }
}
