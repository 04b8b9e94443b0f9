//! The CPU model: [`Model`] is [`DeviceModel`] on the [`Cpu`] device, so the layer logic (forward, backward,
//! the choice of aggregation order, the cached `A X`, the fused first-layer backward, SAR, P3's column split)
//! exists once, in `device/model.rs`, for the CPU and the GPU alike. This module holds the host-side types
//! the rest of the workspace speaks in ([`Param`], [`LocalGraph`], [`Pass`]) and the CPU entry points, which
//! take host graphs and matrices and run the generic code on [`Cpu`].
//!
//! Dropout masks come from [`crate::rng::Stream`] keyed by (seed, epoch, layer) and indexed by the node's global
//! id, so a partition computes the same mask for a node as a single worker, and backward regenerates masks
//! instead of storing them.

use std::sync::Arc;

use crate::config::{LayerKind, ModelConfig};
use crate::device::model::{Graphs, check_blocks};
use crate::device::{Cpu, DeviceForward, DeviceModel, GraphView};
use crate::exchange::{Exchange, LocalExchange};
use crate::order::RowOrder;
use crate::sparse::{Norm, SparseOp};
use crate::tensor::Matrix;
use crate::{Error, Result};

/// A learnable tensor and its name in saved models (`layers.0.weight`, ...), in host memory unless `M` says
/// otherwise.
#[derive(Clone, Debug)]
pub struct Param<M = Matrix> {
    pub name: String,
    pub value: M,
}

/// The part of the graph a worker computes on, with the sparse operators its layers need.
///
/// Destination rows are the owned nodes; sources are the owned nodes followed by the halo nodes.
pub struct LocalGraph {
    n_dst: usize,
    n_src: usize,
    sym: Option<Arc<SparseOp>>,
    mean: Option<Arc<SparseOp>>,
    loops: Option<Arc<SparseOp>>,
    global_ids: Option<Vec<u32>>,
    /// The owned rows' permutation when they are held in a locality order ([`LocalGraph::with_order`]).
    order: Option<Arc<RowOrder>>,
}

impl LocalGraph {
    /// The whole graph on one worker, from an in-neighbour CSR.
    pub fn whole(kind: LayerKind, indptr: &[i64], indices: &[i32]) -> LocalGraph {
        let n = indptr.len().saturating_sub(1);
        LocalGraph::new(kind, n, n, indptr, indices, None, None)
    }

    /// A partition: `n_dst` owned rows, `n_src - n_dst` halo sources, the sources' global in-degrees (for GCN's
    /// normalisation), and every source's global node id (for dropout masks).
    pub fn new(
        kind: LayerKind,
        n_dst: usize,
        n_src: usize,
        indptr: &[i64],
        indices: &[i32],
        src_in_degree: Option<&[u32]>,
        global_ids: Option<Vec<u32>>,
    ) -> LocalGraph {
        let build = |norm| {
            Arc::new(SparseOp::build(
                n_dst,
                n_src,
                indptr,
                indices,
                norm,
                src_in_degree,
            ))
        };
        let (sym, mean, loops) = match kind {
            LayerKind::Gcn => (Some(build(Norm::Symmetric)), None, None),
            LayerKind::Sage => (None, Some(build(Norm::Mean)), None),
            LayerKind::Gat => (None, None, Some(build(Norm::SelfLoopsOnly))),
        };
        if let Some(g) = &global_ids {
            assert_eq!(g.len(), n_src, "one global id per source row");
        }
        LocalGraph {
            n_dst,
            n_src,
            sym,
            mean,
            loops,
            global_ids,
            order: None,
        }
    }

    /// [`LocalGraph::new`] with the owned rows renumbered by `order` (engine row `e` is the caller's row
    /// `order.caller_row(e)`); halo sources keep their place. The arguments are in the caller's order, as for
    /// [`LocalGraph::new`]; the operators, degrees and global ids are held in engine order, and the training
    /// entry points permute features and node sets in and owned rows out to the exchange
    /// ([`crate::order`]'s invariant). Without `global_ids` a row's id is its caller row, so dropout masks
    /// are the unordered graph's.
    #[allow(clippy::too_many_arguments)]
    pub fn with_order(
        kind: LayerKind,
        n_dst: usize,
        n_src: usize,
        indptr: &[i64],
        indices: &[i32],
        src_in_degree: Option<&[u32]>,
        global_ids: Option<Vec<u32>>,
        order: RowOrder,
    ) -> LocalGraph {
        assert_eq!(order.len(), n_dst, "the order permutes the owned rows");
        let (ip, ix) = order.csr_to_engine(indptr, indices);
        let degrees = src_in_degree.map(|d| order.sources_to_engine(d));
        let gids = match global_ids {
            Some(g) => order.sources_to_engine(&g),
            None => order
                .to_caller()
                .iter()
                .copied()
                .chain(n_dst as u32..n_src as u32)
                .collect(),
        };
        let mut g = LocalGraph::new(kind, n_dst, n_src, &ip, &ix, degrees.as_deref(), Some(gids));
        g.order = Some(Arc::new(order));
        g
    }

    /// [`LocalGraph::new`] in a locality order of the owned rows ([`RowOrder::locality`], computed once
    /// here from the owned rows' edges among themselves), or unordered when the rows fit one part.
    pub fn new_local(
        kind: LayerKind,
        n_dst: usize,
        n_src: usize,
        indptr: &[i64],
        indices: &[i32],
        src_in_degree: Option<&[u32]>,
        global_ids: Option<Vec<u32>>,
    ) -> LocalGraph {
        match RowOrder::locality(n_dst, indptr, indices) {
            Some(order) => LocalGraph::with_order(
                kind,
                n_dst,
                n_src,
                indptr,
                indices,
                src_in_degree,
                global_ids,
                order,
            ),
            None => LocalGraph::new(
                kind,
                n_dst,
                n_src,
                indptr,
                indices,
                src_in_degree,
                global_ids,
            ),
        }
    }

    /// The whole graph on one worker in a locality order ([`LocalGraph::new_local`]).
    pub fn whole_local(kind: LayerKind, indptr: &[i64], indices: &[i32]) -> LocalGraph {
        let n = indptr.len().saturating_sub(1);
        LocalGraph::new_local(kind, n, n, indptr, indices, None, None)
    }

    /// The permutation of the owned rows when they are held in a locality order: the engine's rows (logits,
    /// activations) map to the caller's with [`RowOrder::rows_to_caller`].
    pub fn row_order(&self) -> Option<&Arc<RowOrder>> {
        self.order.as_ref()
    }

    /// A sampled mini-batch block: destinations are the first `n_dst` of `n_src` sources, `indptr`/`indices` the
    /// sampled in-neighbours of each destination (local source indices), `src_in_degree` every source's in-degree
    /// in the whole graph and `global_ids` its node id. Every source row is present in the layer's input, so no
    /// exchange is involved.
    ///
    /// GCN's weights use the whole graph's degrees; when a destination kept `s < d` of its `d` neighbours, its
    /// neighbour weights are scaled by `d / s` (the self-loop is always kept), an unbiased estimate of the full
    /// aggregation that equals it when every neighbour is taken. GraphSAGE's mean and GAT's softmax run over
    /// the sampled neighbours.
    pub fn block(
        kind: LayerKind,
        n_dst: usize,
        n_src: usize,
        indptr: &[i64],
        indices: &[i32],
        src_in_degree: &[u32],
        global_ids: Vec<u32>,
    ) -> LocalGraph {
        assert_eq!(src_in_degree.len(), n_src, "one degree per source row");
        let mut g = LocalGraph::new(
            kind,
            n_dst,
            n_src,
            indptr,
            indices,
            Some(src_in_degree),
            Some(global_ids),
        );
        if let Some(op) = g.sym.take().and_then(Arc::into_inner) {
            let scale: Vec<f32> = (0..n_dst)
                .map(|i| {
                    let kept = (indptr[i + 1] - indptr[i]) as u32;
                    let d = src_in_degree[i];
                    if kept == 0 || kept >= d {
                        1.0
                    } else {
                        d as f32 / kept as f32
                    }
                })
                .collect();
            g.sym = Some(Arc::new(op.rescale_neighbours(&scale)));
        }
        g
    }

    pub fn n_dst(&self) -> usize {
        self.n_dst
    }

    pub fn n_src(&self) -> usize {
        self.n_src
    }

    /// Every source row's global node id (`None`: the row index is the id).
    pub fn global_ids(&self) -> Option<&[u32]> {
        self.global_ids.as_deref()
    }

    /// The sparse operator of `kind`'s layers (built by [`LocalGraph::new`] for that kind).
    pub fn op(&self, kind: LayerKind) -> &SparseOp {
        self.shared_op(kind)
    }

    /// [`LocalGraph::op`], shared (a device graph on the host holds it without a copy).
    pub fn shared_op(&self, kind: LayerKind) -> &Arc<SparseOp> {
        let op = match kind {
            LayerKind::Gcn => self.sym.as_ref(),
            LayerKind::Sage => self.mean.as_ref(),
            LayerKind::Gat => self.loops.as_ref(),
        };
        op.expect("LocalGraph is built for the model's layer kind")
    }

    /// The graph as the layers read it on the [`Cpu`] device (`complete`: a block).
    fn view(&self, kind: LayerKind, complete: bool) -> GraphView<'_, Cpu> {
        let op = self.shared_op(kind);
        GraphView {
            n: self.n_dst,
            n_src: self.n_src,
            op,
            nnz: op.nnz(),
            gids: self.global_ids.as_ref(),
            complete,
        }
    }

    /// Bytes held by the sparse operators.
    pub fn memory_bytes(&self) -> usize {
        [&self.sym, &self.mean, &self.loops]
            .iter()
            .filter_map(|o| o.as_ref())
            .map(|o| o.memory_bytes())
            .sum()
    }
}

/// Whether a forward pass trains (dropout on, keyed by epoch) or evaluates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Train { epoch: u64 },
    Eval,
}

/// The model every CPU worker trains with: the generic layers on the host device.
pub type Model = DeviceModel<Cpu>;

/// Activations kept between forward and backward on the host.
pub type Forward<'x> = DeviceForward<'x, Cpu>;

/// The blocks' views, checked to chain.
fn block_views(
    blocks: &[LocalGraph],
    kind: LayerKind,
    layers: usize,
) -> Result<Vec<GraphView<'_, Cpu>>> {
    let views: Vec<_> = blocks.iter().map(|b| b.view(kind, true)).collect();
    check_blocks(&views, layers)?;
    Ok(views)
}

/// The CPU entry points: host graphs and matrices in, the generic layers run on [`Cpu`].
impl DeviceModel<Cpu> {
    /// Builds a model with Glorot-initialised weights and zero biases, seeded.
    pub fn new(cfg: &ModelConfig, seed: u64) -> Result<Model> {
        DeviceModel::init(&mut Cpu, cfg, seed)
    }

    pub fn num_parameters(&self) -> usize {
        self.params.iter().map(|p| p.value.data().len()).sum()
    }

    /// Zero gradients shaped like the parameters.
    pub fn zero_grads(&self) -> Vec<Matrix> {
        self.params
            .iter()
            .map(|p| Matrix::zeros(p.value.rows(), p.value.cols()))
            .collect()
    }

    fn kind(&self) -> LayerKind {
        self.config().kind
    }

    fn n_layers(&self) -> usize {
        self.config().layers
    }

    /// Runs the model on the owned rows `x` (`n_dst x in_dim`); rows of halo nodes come through `ex`.
    pub fn forward<'x>(
        &mut self,
        g: &LocalGraph,
        x: &'x Matrix,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<Forward<'x>> {
        let g = g.view(self.kind(), false);
        self.forward_in(&mut Cpu, Graphs::Whole(g), x, pass, ex)
    }

    /// Runs the model on a sampled mini-batch: `blocks[l]` is layer `l`'s block (input layer first) and `x` holds
    /// the input rows of every source of `blocks[0]`. The logits are the last block's destinations (the seeds).
    pub fn forward_blocks<'x>(
        &mut self,
        blocks: &[LocalGraph],
        x: &'x Matrix,
        pass: Pass,
    ) -> Result<Forward<'x>> {
        let views = block_views(blocks, self.kind(), self.n_layers())?;
        self.forward_in(
            &mut Cpu,
            Graphs::Blocks(&views),
            x,
            pass,
            &mut LocalExchange,
        )
    }

    /// Starts `pass` on `ex` and computes the first layer's `A X` when it is constant across epochs and not
    /// cached yet (what [`Model::forward`] does first), so a caller can free the features before the pass
    /// when [`Model::needs_input`] says nothing reads them any more.
    pub fn cache_input_aggregation(
        &mut self,
        g: &LocalGraph,
        x: &Matrix,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<()> {
        let in_dim = self.config().in_dim;
        if x.shape() != (g.n_dst, in_dim) {
            return Err(Error::Shape(format!(
                "input features are {}x{}, the model expects {}x{in_dim}",
                x.rows(),
                x.cols(),
                g.n_dst,
            )));
        }
        let g = g.view(self.kind(), false);
        self.cache_input_aggregation_in(&mut Cpu, Graphs::Whole(g), x, pass, ex)
    }

    /// Backward from the gradient of the mean loss with respect to the logits. Returns parameter gradients,
    /// all-reduced through the exchange.
    pub fn backward(
        &self,
        g: &LocalGraph,
        fwd: Forward<'_>,
        d_logits: Matrix,
        ex: &mut dyn Exchange,
    ) -> Result<Vec<Matrix>> {
        let g = g.view(self.kind(), false);
        self.backward_in(&mut Cpu, Graphs::Whole(g), fwd, d_logits, ex, None)
    }

    /// Backward of [`Model::forward_blocks`]; the weight gradients are all-reduced through `ex` (data
    /// parallelism: every worker trained its own mini-batch).
    pub fn backward_blocks(
        &self,
        blocks: &[LocalGraph],
        fwd: Forward<'_>,
        d_logits: Matrix,
        ex: &mut dyn Exchange,
    ) -> Result<Vec<Matrix>> {
        let views = block_views(blocks, self.kind(), self.n_layers())?;
        self.backward_in(&mut Cpu, Graphs::Blocks(&views), fwd, d_logits, ex, None)
    }

    /// P3 model parallelism: the first layer's linear part (`A X W` and, for GraphSAGE, the root term) restricted
    /// to input columns `col0..col0 + x_cols.cols()`, for the destinations of `g` (a block, or the whole graph).
    /// `x_cols` holds those columns of every source row. Summing the results of all column slices gives the
    /// first layer's output before its bias; see [`Model::forward_after_first`].
    pub fn first_layer_partial(
        &self,
        g: &LocalGraph,
        x_cols: &Matrix,
        col0: usize,
        pass: Pass,
    ) -> Result<Matrix> {
        let g = g.view(self.kind(), false);
        self.first_layer_partial_in(&mut Cpu, g, x_cols, col0, pass)
    }

    /// Gradients of the first layer's weight rows `col0..col0 + x_cols.cols()` from the gradient `d_z` of its
    /// output (as [`Model::backward_after_first_blocks`] returns it), added into `grads`.
    pub fn first_layer_partial_backward(
        &self,
        g: &LocalGraph,
        x_cols: &Matrix,
        col0: usize,
        pass: Pass,
        d_z: &Matrix,
        grads: &mut [Matrix],
    ) -> Result<()> {
        let g = g.view(self.kind(), false);
        self.first_layer_partial_backward_in(&mut Cpu, g, x_cols, col0, pass, d_z, grads)
    }

    /// Runs layers after the first, given the first layer's product without bias (`z0`, summed over the
    /// column slices of [`Model::first_layer_partial`]). `g` is the graph for every layer (whole or partition,
    /// halo rows through `ex`).
    pub fn forward_after_first(
        &mut self,
        g: &LocalGraph,
        z0: Matrix,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<Forward<'static>> {
        let g = g.view(self.kind(), false);
        self.forward_after_first_in(&mut Cpu, Graphs::Whole(g), z0, pass, ex)
    }

    /// As [`Model::forward_after_first`] on mini-batch blocks (block 0's destinations are `z0`'s rows).
    pub fn forward_after_first_blocks(
        &mut self,
        blocks: &[LocalGraph],
        z0: Matrix,
        pass: Pass,
    ) -> Result<Forward<'static>> {
        let views = block_views(blocks, self.kind(), self.n_layers())?;
        self.forward_after_first_in(
            &mut Cpu,
            Graphs::Blocks(&views),
            z0,
            pass,
            &mut LocalExchange,
        )
    }

    /// Backward of [`Model::forward_after_first_blocks`]: the gradients of every parameter except the first
    /// layer's weights (not all-reduced), and the gradient of `z0`.
    pub fn backward_after_first_blocks(
        &self,
        blocks: &[LocalGraph],
        fwd: Forward<'_>,
        d_logits: Matrix,
    ) -> Result<(Vec<Matrix>, Matrix)> {
        let views = block_views(blocks, self.kind(), self.n_layers())?;
        let mut d_z0 = None;
        let grads = self.backward_in(
            &mut Cpu,
            Graphs::Blocks(&views),
            fwd,
            d_logits,
            &mut LocalExchange,
            Some(&mut d_z0),
        )?;
        Ok((grads, d_z0.expect("the first layer's gradient is kept")))
    }
}
