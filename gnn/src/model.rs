//! Models: a stack of GCN, GraphSAGE or GAT layers with hand-derived backward passes.
//!
//! Each layer is split at its aggregation (see [`crate::exchange`]):
//!
//! * `pre`: a local transform of the owned rows into messages (identity, `H W`, or GAT's `[H W | scores]`);
//! * the exchange appends the halo rows that peers own;
//! * `aggregate + post`: the sparse aggregation over the sources, then the dense transform and bias.
//!
//! GCN and GraphSAGE choose per layer whether to aggregate the input (`A H` then `W`) or the transformed rows
//! (`A (H W)`): the same function, but the aggregation and the exchange run at the narrower width. When the
//! first layer aggregates the raw input and no dropout touches the input, `A X` is the same every epoch and
//! is computed once ([`Model::forward`] keeps it).
//!
//! Dropout masks come from [`crate::rng::Stream`] keyed by (seed, epoch, layer) and indexed by the node's global
//! id, so a partition computes the same mask for a node as a single worker, and backward regenerates masks
//! instead of storing them.

use rayon::prelude::*;

use crate::config::{Activation, LayerKind, ModelConfig};
use crate::dense::{matmul, matmul_at, matmul_at_concat, matmul_bt, matmul_bt_into, matmul_into};
use crate::device::GatShape;
use crate::exchange::{Exchange, LocalExchange};
use crate::gat::{self, GAT_ROWS, dot, edge_key, split_by_rows};
use crate::rng::{Mask, Stream, drop_threshold};
use crate::sparse::{Norm, SparseOp};
use crate::tensor::{ELEMENTWISE_CHUNK, Matrix};
use crate::{Error, Result};

mod sar;

/// A learnable tensor and its name in saved models (`layers.0.weight`, ...).
#[derive(Clone, Debug)]
pub struct Param {
    pub name: String,
    pub value: Matrix,
}

/// The part of the graph a worker computes on, with the sparse operators its layers need.
///
/// Destination rows are the owned nodes; sources are the owned nodes followed by the halo nodes.
pub struct LocalGraph {
    n_dst: usize,
    n_src: usize,
    sym: Option<SparseOp>,
    mean: Option<SparseOp>,
    loops: Option<SparseOp>,
    global_ids: Option<Vec<u32>>,
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
        let build = |norm| SparseOp::build(n_dst, n_src, indptr, indices, norm, src_in_degree);
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
        }
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
        if let Some(op) = g.sym.take() {
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
            g.sym = Some(op.rescale_neighbours(&scale));
        }
        g
    }

    pub fn n_dst(&self) -> usize {
        self.n_dst
    }

    pub fn n_src(&self) -> usize {
        self.n_src
    }

    fn gid(&self, row: usize) -> u64 {
        match &self.global_ids {
            Some(g) => g[row] as u64,
            None => row as u64,
        }
    }

    /// Every source row's global node id (`None`: the row index is the id).
    pub fn global_ids(&self) -> Option<&[u32]> {
        self.global_ids.as_deref()
    }

    /// The sparse operator of `kind`'s layers (built by [`LocalGraph::new`] for that kind).
    pub fn op(&self, kind: LayerKind) -> &SparseOp {
        let op = match kind {
            LayerKind::Gcn => self.sym.as_ref(),
            LayerKind::Sage => self.mean.as_ref(),
            LayerKind::Gat => self.loops.as_ref(),
        };
        op.expect("LocalGraph is built for the model's layer kind")
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

/// The graphs a forward pass runs on.
#[derive(Clone, Copy)]
enum Graphs<'g> {
    /// One graph for every layer: the owned rows are the input, halo rows come through the exchange.
    Whole(&'g LocalGraph),
    /// One sampled block per layer (input layer first): the input has every source row.
    Blocks(&'g [LocalGraph]),
}

impl<'g> Graphs<'g> {
    fn layer(self, l: usize) -> &'g LocalGraph {
        match self {
            Graphs::Whole(g) => g,
            Graphs::Blocks(b) => &b[l],
        }
    }

    fn complete(self) -> bool {
        matches!(self, Graphs::Blocks(_))
    }

    /// Rows of layer `l`'s input.
    fn input_rows(self, l: usize) -> usize {
        match self {
            Graphs::Whole(g) => g.n_dst,
            Graphs::Blocks(b) => b[l].n_src,
        }
    }
}

/// Whether the layer aggregates its input or its transformed rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Order {
    AggregateFirst,
    TransformFirst,
}

#[derive(Clone, Debug)]
struct Layer {
    index: usize,
    kind: LayerKind,
    heads: usize,
    head_dim: usize,
    concat: bool,
    order: Order,
    w: usize,
    w_root: Option<usize>,
    att: Option<(usize, usize)>,
    bias: usize,
}

impl Layer {
    fn hc(&self) -> usize {
        self.heads * self.head_dim
    }

    fn d_out(&self) -> usize {
        if self.concat {
            self.hc()
        } else {
            self.head_dim
        }
    }
}

/// What backward needs from a layer's forward, besides the layer's input.
enum Cache {
    /// `A H` (None: the model's cached `A X`).
    Aggregated(Option<Matrix>),
    Transformed,
    /// The first layer's product came from outside (P3: summed over the workers' column slices).
    External,
    Gat {
        m_own: Matrix,
        m_halo: Option<Matrix>,
        s_dst: Vec<f32>,
        alpha: Vec<f32>,
    },
    /// GAT with rematerialised halo rows (see `sar`): the owned messages, the halo rows' scores only, and
    /// each destination's softmax maximum and sum per head.
    GatRemat {
        m_own: Matrix,
        s_halo: Matrix,
        s_dst: Vec<f32>,
        row_max: Vec<f32>,
        row_sum: Vec<f32>,
    },
}

/// Whether a forward pass trains (dropout on, keyed by epoch) or evaluates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Train { epoch: u64 },
    Eval,
}

/// A layer's input gradient: dense, or as `sum_t A_t W_t^T` (a row block at a time is enough to use it).
enum Dx {
    Dense(Matrix),
    Factored(Vec<(Matrix, usize)>),
}

/// Activations kept between forward and backward.
pub struct Forward<'x> {
    /// The input of each layer (after activation and dropout of the previous one).
    inputs: Vec<Input<'x>>,
    caches: Vec<Cache>,
    pub logits: Matrix,
    pass: Pass,
}

enum Input<'x> {
    Borrowed(&'x Matrix),
    Owned(Matrix),
}

impl Input<'_> {
    fn get(&self) -> &Matrix {
        match self {
            Input::Borrowed(m) => m,
            Input::Owned(m) => m,
        }
    }
}

pub struct Model {
    cfg: ModelConfig,
    seed: u64,
    layers: Vec<Layer>,
    pub params: Vec<Param>,
    /// `A X` of the first layer when it is constant across epochs.
    input_agg: Option<Matrix>,
}

impl Model {
    /// Builds a model with Glorot-initialised weights and zero biases, seeded.
    pub fn new(cfg: &ModelConfig, seed: u64) -> Result<Model> {
        validate(cfg)?;
        let mut params = Vec::new();
        let mut layers = Vec::new();
        let mut d_in = cfg.in_dim;
        for index in 0..cfg.layers {
            let last = index + 1 == cfg.layers;
            let (heads, head_dim, concat) = match cfg.kind {
                LayerKind::Gat if last => (cfg.out_heads, cfg.out_dim, false),
                LayerKind::Gat => (cfg.heads, cfg.hidden, true),
                _ => (1, if last { cfg.out_dim } else { cfg.hidden }, true),
            };
            let hc = heads * head_dim;
            let mut add = |name: &str, rows: usize, cols: usize, glorot: bool| {
                let mut m = Matrix::zeros(rows, cols);
                if glorot {
                    let stream = Stream::new(seed, &[0x1A17, index as u64, params.len() as u64]);
                    let a = (6.0 / (rows + cols) as f32).sqrt();
                    for (i, v) in m.data_mut().iter_mut().enumerate() {
                        *v = (2.0 * stream.uniform(i as u64) - 1.0) * a;
                    }
                }
                params.push(Param {
                    name: format!("layers.{index}.{name}"),
                    value: m,
                });
                params.len() - 1
            };
            let w = add("weight", d_in, hc, true);
            let w_root = (cfg.kind == LayerKind::Sage).then(|| add("root_weight", d_in, hc, true));
            // PyG's glorot on a (1, heads, head_dim) tensor: bound sqrt(6 / (heads + head_dim))
            let att = (cfg.kind == LayerKind::Gat).then(|| {
                (
                    add("att_src", heads, head_dim, true),
                    add("att_dst", heads, head_dim, true),
                )
            });
            let d_out = if concat { hc } else { head_dim };
            let bias = add("bias", 1, d_out, false);
            let order = if cfg.kind != LayerKind::Gat && d_in <= hc {
                Order::AggregateFirst
            } else {
                Order::TransformFirst
            };
            layers.push(Layer {
                index,
                kind: cfg.kind,
                heads,
                head_dim,
                concat,
                order,
                w,
                w_root,
                att,
                bias,
            });
            d_in = d_out;
        }
        Ok(Model {
            cfg: cfg.clone(),
            seed,
            layers,
            params,
            input_agg: None,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The seed of the initial weights and of every dropout mask.
    pub fn seed(&self) -> u64 {
        self.seed
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

    /// Whether later passes read the input features: false once the first layer's `A X` is cached for
    /// training and evaluation alike and nothing else reads `X` (no root weight, no input dropout), so a
    /// caller may free the features and pass an empty matrix from then on.
    pub fn needs_input(&self) -> bool {
        let l = &self.layers[0];
        !(self.input_agg.is_some()
            && l.order == Order::AggregateFirst
            && l.w_root.is_none()
            && self.cfg.input_dropout == 0.0)
    }

    /// Forgets the cached `A X` (call when the graph or the features change).
    pub fn clear_cache(&mut self) {
        self.input_agg = None;
    }

    fn first_aggregation_is_constant(&self, gs: Graphs<'_>, pass: Pass) -> bool {
        let l = &self.layers[0];
        !gs.complete()
            && l.order == Order::AggregateFirst
            && (self.cfg.input_dropout == 0.0 || pass == Pass::Eval)
    }

    /// Runs the model on the owned rows `x` (`n_dst x in_dim`); rows of halo nodes come through `ex`.
    pub fn forward<'x>(
        &mut self,
        g: &LocalGraph,
        x: &'x Matrix,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<Forward<'x>> {
        self.forward_graphs(Graphs::Whole(g), x, pass, ex)
    }

    /// Runs the model on a sampled mini-batch: `blocks[l]` is layer `l`'s block (input layer first) and `x` holds
    /// the input rows of every source of `blocks[0]`. The logits are the last block's destinations (the seeds).
    pub fn forward_blocks<'x>(
        &mut self,
        blocks: &[LocalGraph],
        x: &'x Matrix,
        pass: Pass,
    ) -> Result<Forward<'x>> {
        check_blocks(blocks, self.layers.len())?;
        self.forward_graphs(Graphs::Blocks(blocks), x, pass, &mut LocalExchange)
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
        let (l, x) = self.p3_input(g, x_cols, col0, pass)?;
        let d = x.cols();
        let w = self.params[l.w].value.row_block(col0, col0 + d);
        let op = g.op(l.kind);
        let mut out = if d <= w.cols() {
            matmul(&op.spmm(&x), &w)
        } else {
            op.spmm(&matmul(&x, &w))
        };
        if let Some(r) = l.w_root {
            let wr = self.params[r].value.row_block(col0, col0 + d);
            matmul_into(&x.top_rows(g.n_dst), &wr, &mut out, true);
        }
        Ok(out)
    }

    /// Gradients of the first layer's weight rows `col0..col0 + x_cols.cols()` from the gradient `d_z` of its
    /// output (as [`Model::backward_after_first`] returns it), added into `grads`.
    pub fn first_layer_partial_backward(
        &self,
        g: &LocalGraph,
        x_cols: &Matrix,
        col0: usize,
        pass: Pass,
        d_z: &Matrix,
        grads: &mut [Matrix],
    ) -> Result<()> {
        let (l, x) = self.p3_input(g, x_cols, col0, pass)?;
        let d = x.cols();
        let op = g.op(l.kind);
        let gw = if d <= d_z.cols() {
            matmul_at(&op.spmm(&x), d_z)
        } else {
            matmul_at(&x, &op.spmm_t(d_z))
        };
        add_rows(&mut grads[l.w], col0, &gw);
        if let Some(r) = l.w_root {
            let gr = matmul_at(&x.top_rows(g.n_dst), d_z);
            add_rows(&mut grads[r], col0, &gr);
        }
        Ok(())
    }

    /// The first layer and its input slice after input dropout, checked for P3.
    fn p3_input(
        &self,
        g: &LocalGraph,
        x_cols: &Matrix,
        col0: usize,
        pass: Pass,
    ) -> Result<(&Layer, Matrix)> {
        let l = &self.layers[0];
        if l.kind == LayerKind::Gat {
            return Err(Error::Config(
                "model parallelism (P3) splits the first layer's product by input columns; GAT's attention \
                 needs whole rows, so use gcn or sage, or data or partition parallelism"
                    .into(),
            ));
        }
        let d = x_cols.cols();
        if x_cols.rows() != g.n_src || col0 + d > self.cfg.in_dim {
            return Err(Error::Shape(format!(
                "a column slice {col0}..{} of {} rows for a layer of {} inputs and {} source rows",
                col0 + d,
                x_cols.rows(),
                self.cfg.in_dim,
                g.n_src
            )));
        }
        let mut x = x_cols.clone();
        if let Pass::Train { epoch } = pass
            && self.cfg.input_dropout > 0.0
        {
            let s = Stream::new(self.seed, &[0xD0, epoch, 0]);
            dropout_cols(
                &mut x,
                g.global_ids(),
                0,
                self.cfg.input_dropout,
                s,
                col0,
                self.cfg.in_dim,
            );
        }
        Ok((l, x))
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
        self.forward_from_first(Graphs::Whole(g), z0, pass, ex)
    }

    /// As [`Model::forward_after_first`] on mini-batch blocks (block 0's destinations are `z0`'s rows).
    pub fn forward_after_first_blocks(
        &mut self,
        blocks: &[LocalGraph],
        z0: Matrix,
        pass: Pass,
    ) -> Result<Forward<'static>> {
        check_blocks(blocks, self.layers.len())?;
        self.forward_from_first(Graphs::Blocks(blocks), z0, pass, &mut LocalExchange)
    }

    /// Backward of [`Model::forward_after_first_blocks`]: the gradients of every parameter except the first
    /// layer's weights (not all-reduced), and the gradient of `z0`.
    pub fn backward_after_first_blocks(
        &self,
        blocks: &[LocalGraph],
        fwd: Forward<'_>,
        d_logits: Matrix,
    ) -> Result<(Vec<Matrix>, Matrix)> {
        let mut d_z0 = None;
        let grads = self.backward_inner(
            Graphs::Blocks(blocks),
            fwd,
            d_logits,
            &mut LocalExchange,
            Some(&mut d_z0),
        )?;
        Ok((grads, d_z0.expect("the first layer's gradient is kept")))
    }

    /// Indices of the first layer's weights (the parameters P3 splits by rows).
    pub fn first_layer_weights(&self) -> Vec<usize> {
        let l = &self.layers[0];
        std::iter::once(l.w).chain(l.w_root).collect()
    }

    fn forward_graphs<'x>(
        &mut self,
        gs: Graphs<'_>,
        x: &'x Matrix,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<Forward<'x>> {
        let rows = gs.input_rows(0);
        // freed features are an empty matrix once the model no longer reads them
        let released = x.shape() == (0, 0) && !gs.complete() && !self.needs_input();
        if x.shape() != (rows, self.cfg.in_dim) && !released {
            return Err(Error::Shape(format!(
                "input features are {}x{}, the model expects {}x{}",
                x.rows(),
                x.cols(),
                rows,
                self.cfg.in_dim
            )));
        }
        self.cache_input_aggregation_in(gs, x, pass, ex)?;
        let train_epoch = match pass {
            Pass::Train { epoch } => Some(epoch),
            Pass::Eval => None,
        };
        let input = match train_epoch {
            Some(epoch) if self.cfg.input_dropout > 0.0 => {
                let mut x = x.clone();
                dropout_rows(
                    &mut x,
                    gs.layer(0),
                    self.cfg.input_dropout,
                    Stream::new(self.seed, &[0xD0, epoch, 0]),
                );
                Input::Owned(x)
            }
            _ => Input::Borrowed(x),
        };
        let inputs = vec![input];
        self.run_layers(gs, inputs, Vec::with_capacity(self.layers.len()), pass, ex)
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
        if x.shape() != (g.n_dst, self.cfg.in_dim) {
            return Err(Error::Shape(format!(
                "input features are {}x{}, the model expects {}x{}",
                x.rows(),
                x.cols(),
                g.n_dst,
                self.cfg.in_dim
            )));
        }
        self.cache_input_aggregation_in(Graphs::Whole(g), x, pass, ex)
    }

    fn cache_input_aggregation_in(
        &mut self,
        gs: Graphs<'_>,
        x: &Matrix,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<()> {
        ex.begin_pass(pass);
        if self.first_aggregation_is_constant(gs, pass) && self.input_agg.is_none() {
            let g = gs.layer(0);
            let l = &self.layers[0];
            self.input_agg = Some(sar::aggregate(g.op(l.kind), 0, x, ex)?);
        }
        Ok(())
    }

    /// P3: the first layer's output is `z0 + bias`; the remaining layers run as usual.
    fn forward_from_first(
        &mut self,
        gs: Graphs<'_>,
        mut z0: Matrix,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<Forward<'static>> {
        let l = &self.layers[0];
        let g = gs.layer(0);
        if z0.shape() != (g.n_dst, l.d_out()) {
            return Err(Error::Shape(format!(
                "the first layer's product is {}x{}, expected {}x{}",
                z0.rows(),
                z0.cols(),
                g.n_dst,
                l.d_out()
            )));
        }
        ex.begin_pass(pass);
        add_bias(&mut z0, &self.params[l.bias].value);
        let inputs = vec![Input::Owned(Matrix::zeros(0, 0))];
        self.finish_layer(gs, 0, z0, pass, inputs, vec![Cache::External], ex)
    }

    /// Runs layers `inputs.len() - 1..` (each entry of `inputs` is a layer's input).
    fn run_layers<'x>(
        &mut self,
        gs: Graphs<'_>,
        inputs: Vec<Input<'x>>,
        mut caches: Vec<Cache>,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<Forward<'x>> {
        let li = inputs.len() - 1;
        let layer = self.layers[li].clone();
        let h = inputs[li].get();
        let g = gs.layer(li);
        let (out, cache) = self.layer_forward(&layer, gs, g, h, pass, ex)?;
        caches.push(cache);
        self.finish_layer(gs, li, out, pass, inputs, caches, ex)
    }

    /// After layer `li` produced `out`: the logits, or the activation and dropout and the next layer.
    #[allow(clippy::too_many_arguments)]
    fn finish_layer<'x>(
        &mut self,
        gs: Graphs<'_>,
        li: usize,
        mut out: Matrix,
        pass: Pass,
        mut inputs: Vec<Input<'x>>,
        caches: Vec<Cache>,
        ex: &mut dyn Exchange,
    ) -> Result<Forward<'x>> {
        if li + 1 == self.layers.len() {
            return Ok(Forward {
                inputs,
                caches,
                logits: out,
                pass,
            });
        }
        activate(&mut out, self.cfg.activation);
        if let Pass::Train { epoch } = pass
            && self.cfg.dropout > 0.0
        {
            dropout_rows(
                &mut out,
                gs.layer(li),
                self.cfg.dropout,
                Stream::new(self.seed, &[0xD0, epoch, li as u64 + 1]),
            );
        }
        inputs.push(Input::Owned(out));
        self.run_layers(gs, inputs, caches, pass, ex)
    }

    /// One layer's forward. `h` is the layer's input: the owned rows (halo rows come through `ex`) or, for a
    /// block, every source row.
    fn layer_forward(
        &self,
        l: &Layer,
        gs: Graphs<'_>,
        g: &LocalGraph,
        h: &Matrix,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<(Matrix, Cache)> {
        let complete = gs.complete();
        let w = &self.params[l.w].value;
        let bias = &self.params[l.bias].value;
        let op = g.op(l.kind);
        let (mut out, cache) = match (l.kind, l.order) {
            (LayerKind::Gat, _) => return self.gat_forward(l, g, h, complete, pass, ex),
            (_, Order::AggregateFirst) => {
                let agg = if l.index == 0 && self.first_aggregation_is_constant(gs, pass) {
                    None
                } else if complete {
                    Some(op.spmm(h))
                } else {
                    Some(sar::aggregate(op, l.index, h, ex)?)
                };
                let a = match &agg {
                    Some(a) => a,
                    None => self
                        .input_agg
                        .as_ref()
                        .expect("input aggregation computed before layer 0"),
                };
                let mut out = matmul(a, w);
                if let Some(r) = l.w_root {
                    if complete {
                        matmul_into(&h.top_rows(g.n_dst), &self.params[r].value, &mut out, true);
                    } else {
                        matmul_into(h, &self.params[r].value, &mut out, true);
                    }
                }
                (out, Cache::Aggregated(agg))
            }
            (_, Order::TransformFirst) if complete => {
                let m = matmul(h, w);
                let mut out = op.spmm(&m);
                if let Some(r) = l.w_root {
                    matmul_into(&h.top_rows(g.n_dst), &self.params[r].value, &mut out, true);
                }
                (out, Cache::Transformed)
            }
            (_, Order::TransformFirst) => {
                // with a root weight, one product `H [W | W_root]` reads H once instead of twice
                let (m, root) = match l.w_root {
                    Some(r) => {
                        let both = matmul(h, &Matrix::concat_cols(w, &self.params[r].value));
                        let (m, root) = both.split_off_cols(w.cols());
                        (m, Some(root))
                    }
                    None => (matmul(h, w), None),
                };
                let mut out = sar::aggregate(op, l.index, &m, ex)?;
                if let Some(root) = root {
                    out.add_assign(&root);
                }
                (out, Cache::Transformed)
            }
        };
        add_bias(&mut out, bias);
        Ok((out, cache))
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
        self.backward_inner(Graphs::Whole(g), fwd, d_logits, ex, None)
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
        self.backward_inner(Graphs::Blocks(blocks), fwd, d_logits, ex, None)
    }

    /// With `first_grad`, the first layer's product came from outside: its output gradient is stored there and
    /// nothing is all-reduced (the caller owns both).
    fn backward_inner(
        &self,
        gs: Graphs<'_>,
        fwd: Forward<'_>,
        d_logits: Matrix,
        ex: &mut dyn Exchange,
        mut first_grad: Option<&mut Option<Matrix>>,
    ) -> Result<Vec<Matrix>> {
        let mut grads = self.zero_grads();
        let Forward {
            inputs,
            mut caches,
            pass,
            logits,
        } = fwd;
        // the loss has read the logits; backward needs only their gradient
        drop(logits);
        let epoch = match pass {
            Pass::Train { epoch } => epoch,
            Pass::Eval => 0,
        };
        let dropout = matches!(pass, Pass::Train { .. })
            .then_some(self.cfg.dropout)
            .filter(|&p| p > 0.0);
        // The first layer never needs its input's gradient. When it aggregated its input, its weight gradients
        // are row-block sums, so the second layer's input gradient (as wide as the hidden layer) can be formed
        // block by block and consumed at once instead of held whole.
        let fuse_first = !gs.complete()
            && first_grad.is_none()
            && self.layers[0].order == Order::AggregateFirst
            && self.layers.len() > 1;
        let mut d_out = d_logits;
        while let Some(cache) = caches.pop() {
            let li = caches.len();
            let layer = &self.layers[li];
            if let Cache::External = cache {
                grads[layer.bias] = d_out.column_sums();
                if let Some(slot) = first_grad.as_mut() {
                    **slot = Some(d_out);
                }
                return Ok(grads);
            }
            let h = inputs[li].get();
            let factored_ok = li == 1 && fuse_first;
            let g = gs.layer(li);
            let dx = self.layer_backward(
                layer,
                g,
                gs.complete(),
                h,
                cache,
                d_out,
                li > 0,
                factored_ok,
                pass,
                &mut grads,
                ex,
            )?;
            let mask = Stream::new(self.seed, &[0xD0, epoch, li as u64]);
            match dx {
                None => break,
                Some(Dx::Factored(terms)) => {
                    let first = caches.pop().expect("layer 0 is below layer 1");
                    let Cache::Aggregated(agg) = first else {
                        unreachable!("fused only after aggregate-first")
                    };
                    let agg = agg
                        .as_ref()
                        .or(self.input_agg.as_ref())
                        .expect("aggregation cached in forward");
                    self.fused_first_backward(
                        g,
                        inputs[0].get(),
                        agg,
                        h,
                        &terms,
                        dropout,
                        mask,
                        &mut grads,
                    );
                    break;
                }
                Some(Dx::Dense(mut dx)) => {
                    // through the previous layer's activation and dropout; `h` is their output
                    activation_backward(
                        &mut dx,
                        h.data(),
                        0,
                        g.global_ids(),
                        self.cfg.activation,
                        dropout,
                        mask,
                    );
                    d_out = dx;
                }
            }
        }
        ex.all_reduce(&mut grads).map_err(Error::Exchange)?;
        Ok(grads)
    }

    /// Weight gradients of the first layer (aggregate-first) from its output gradient given as
    /// `sum_t A_t W_t^T` (the second layer's factors), through the activation, one fixed row block at a time.
    #[allow(clippy::too_many_arguments)]
    fn fused_first_backward(
        &self,
        g: &LocalGraph,
        x: &Matrix,
        agg: &Matrix,
        h1: &Matrix,
        terms: &[(Matrix, usize)],
        dropout: Option<f32>,
        mask: Stream,
        grads: &mut [Matrix],
    ) {
        let l = &self.layers[0];
        let n = h1.rows();
        let width = h1.cols();
        let block = crate::dense::reduction_block(n);
        let n_blocks = n.div_ceil(block.max(1));
        let partials: Vec<(Matrix, Option<Matrix>, Matrix)> = (0..n_blocks)
            .into_par_iter()
            .map(|b| {
                let (r0, r1) = (b * block, ((b + 1) * block).min(n));
                let mut dz = Matrix::zeros(r1 - r0, width);
                for (a, w) in terms {
                    let a_blk = a.row_block(r0, r1);
                    crate::dense::matmul_bt_serial(&a_blk, &self.params[*w].value, &mut dz, true);
                }
                fn rows(m: &Matrix, r0: usize, r1: usize) -> &[f32] {
                    &m.data()[r0 * m.cols()..r1 * m.cols()]
                }
                activation_backward(
                    &mut dz,
                    rows(h1, r0, r1),
                    r0,
                    g.global_ids(),
                    self.cfg.activation,
                    dropout,
                    mask,
                );
                let gw = crate::dense::matmul_at_rows(rows(agg, r0, r1), agg.cols(), &dz);
                let gr = l
                    .w_root
                    .map(|_| crate::dense::matmul_at_rows(rows(x, r0, r1), x.cols(), &dz));
                (gw, gr, dz.column_sums_serial())
            })
            .collect();
        let mut gw = Matrix::zeros(agg.cols(), width);
        let mut gr = l.w_root.map(|_| Matrix::zeros(x.cols(), width));
        let mut gb = Matrix::zeros(1, width);
        for (pw, pr, pb) in partials {
            gw.add_assign_serial(&pw);
            if let (Some(gr), Some(pr)) = (&mut gr, &pr) {
                gr.add_assign_serial(pr);
            }
            gb.add_assign_serial(&pb);
        }
        grads[l.w] = gw;
        if let (Some(r), Some(gr)) = (l.w_root, gr) {
            grads[r] = gr;
        }
        grads[l.bias] = gb;
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_backward(
        &self,
        l: &Layer,
        g: &LocalGraph,
        complete: bool,
        h: &Matrix,
        cache: Cache,
        d_out: Matrix,
        need_dx: bool,
        factored_ok: bool,
        pass: Pass,
        grads: &mut [Matrix],
        ex: &mut dyn Exchange,
    ) -> Result<Option<Dx>> {
        if let Cache::Gat {
            m_own,
            m_halo,
            s_dst,
            alpha,
        } = cache
        {
            let dx = self.gat_backward(
                l, g, complete, h, m_own, m_halo, s_dst, alpha, d_out, need_dx, pass, grads, ex,
            )?;
            return Ok(dx.map(Dx::Dense));
        }
        if let Cache::GatRemat {
            m_own,
            s_halo,
            s_dst,
            row_max,
            row_sum,
        } = cache
        {
            let dx = self.gat_backward_remat(
                l, g, h, m_own, s_halo, s_dst, row_max, row_sum, d_out, need_dx, pass, grads, ex,
            )?;
            return Ok(dx.map(Dx::Dense));
        }
        grads[l.bias] = d_out.column_sums();
        let w = &self.params[l.w].value;
        let op = g.op(l.kind);
        if let (true, Cache::Transformed) = (need_dx && factored_ok, &cache) {
            let dm = sar::aggregate_backward(op, l.index, &d_out, ex)?;
            let mut terms = vec![];
            match l.w_root {
                Some(r) => {
                    // `[dm | d_out]` a row block at a time: never a third copy of both beside them
                    let both = matmul_at_concat(h, &[&dm, &d_out]);
                    (grads[l.w], grads[r]) = both.split_cols(dm.cols());
                    terms.push((d_out, r));
                }
                None => grads[l.w] = matmul_at(h, &dm),
            }
            terms.push((dm, l.w));
            return Ok(Some(Dx::Factored(terms)));
        }
        if complete {
            return Ok(self
                .block_backward(l, g, h, cache, d_out, need_dx, grads)
                .map(Dx::Dense));
        }
        let mut dx = None;
        if let Some(r) = l.w_root {
            grads[r] = matmul_at(h, &d_out);
            if need_dx {
                dx = Some(matmul_bt(&d_out, &self.params[r].value));
            }
        }
        match cache {
            Cache::Gat { .. } | Cache::GatRemat { .. } | Cache::External => {
                unreachable!("handled above")
            }
            Cache::Aggregated(agg) => {
                let agg = agg
                    .as_ref()
                    .or(self.input_agg.as_ref())
                    .expect("aggregation cached in forward");
                grads[l.w] = matmul_at(agg, &d_out);
                if need_dx {
                    let d_agg = matmul_bt(&d_out, w);
                    let d_own = sar::aggregate_backward(op, l.index, &d_agg, ex)?;
                    match &mut dx {
                        Some(dx) => dx.add_assign(&d_own),
                        None => dx = Some(d_own),
                    }
                }
            }
            Cache::Transformed => {
                let dm = sar::aggregate_backward(op, l.index, &d_out, ex)?;
                grads[l.w] = matmul_at(h, &dm);
                if need_dx {
                    match &mut dx {
                        Some(dx) => matmul_bt_into(&dm, w, dx, true),
                        None => dx = Some(matmul_bt(&dm, w)),
                    }
                }
            }
        }
        Ok(dx.map(Dx::Dense))
    }

    /// GCN / GraphSAGE backward on a block: `h` has every source row, the input gradient too; the root
    /// weight touches only the destination rows (a prefix of the sources).
    #[allow(clippy::too_many_arguments)]
    fn block_backward(
        &self,
        l: &Layer,
        g: &LocalGraph,
        h: &Matrix,
        cache: Cache,
        d_out: Matrix,
        need_dx: bool,
        grads: &mut [Matrix],
    ) -> Option<Matrix> {
        let w = &self.params[l.w].value;
        let op = g.op(l.kind);
        let mut dx = match cache {
            Cache::Aggregated(agg) => {
                let agg = agg.expect("blocks never use the cached input aggregation");
                grads[l.w] = matmul_at(&agg, &d_out);
                need_dx.then(|| op.spmm_t(&matmul_bt(&d_out, w)))
            }
            Cache::Transformed => {
                let dm = op.spmm_t(&d_out);
                grads[l.w] = matmul_at(h, &dm);
                need_dx.then(|| matmul_bt(&dm, w))
            }
            Cache::Gat { .. } | Cache::GatRemat { .. } | Cache::External => {
                unreachable!("handled by the caller")
            }
        };
        if let Some(r) = l.w_root {
            let h_dst = h.top_rows(g.n_dst);
            grads[r] = matmul_at(&h_dst, &d_out);
            if let Some(dx) = &mut dx {
                let d_root = matmul_bt(&d_out, &self.params[r].value);
                for (a, b) in dx.data_mut().iter_mut().zip(d_root.data()) {
                    *a += *b;
                }
            }
        }
        dx
    }

    /// GAT's messages for the input rows `h`: `[Z | s_src]` with `Z = h W` and `s_src = Z . a_src` per head,
    /// and `s_dst = Z . a_dst` (one per row and head).
    fn gat_messages(&self, l: &Layer, h: &Matrix) -> (Matrix, Vec<f32>) {
        let (ia, id) = l.att.expect("GAT layer has attention vectors");
        let z = matmul(h, &self.params[l.w].value);
        let n_in = h.rows();
        let mut m_own = Matrix::zeros(n_in, l.hc() + l.heads);
        let mut s_dst = vec![0f32; n_in * l.heads];
        gat::messages(
            z.data(),
            self.params[ia].value.data(),
            self.params[id].value.data(),
            self.gat_shape(l),
            m_own.data_mut(),
            &mut s_dst,
        );
        (m_own, s_dst)
    }

    fn gat_shape(&self, l: &Layer) -> GatShape {
        GatShape {
            heads: l.heads as u32,
            c: l.head_dim as u32,
            concat: l.concat,
            slope: self.cfg.negative_slope,
        }
    }

    fn attn_drop(&self, l: &Layer, pass: Pass) -> gat::AttnDrop {
        match pass {
            Pass::Train { epoch } if self.cfg.attn_dropout > 0.0 => Some((
                Stream::new(self.seed, &[0xA7D, epoch, l.index as u64]),
                drop_threshold(self.cfg.attn_dropout),
                1.0 / (1.0 - self.cfg.attn_dropout),
            )),
            _ => None,
        }
    }

    fn gat_forward(
        &self,
        l: &Layer,
        g: &LocalGraph,
        h: &Matrix,
        complete: bool,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<(Matrix, Cache)> {
        if !complete && ex.rematerializes() {
            return self.gat_forward_remat(l, g, h, pass, ex);
        }
        let (heads, hc) = (l.heads, l.hc());
        let width = hc + heads;
        let n = g.n_dst;
        // messages: [Z | s_src] for the input rows, and s_dst (kept for the destinations)
        let n_in = h.rows();
        let (m_own, mut s_dst) = self.gat_messages(l, h);
        s_dst.truncate(n * heads);
        let m_halo = if complete {
            None
        } else {
            ex.forward(l.index, &m_own).map_err(Error::Exchange)?
        };
        let op = g.op(LayerKind::Gat);
        let src = crate::sparse::Src {
            own: m_own.data(),
            halo: m_halo.as_ref().map(|m| m.data()).unwrap_or(&[]),
            n_own: n_in,
            d: width,
        };
        let mut alpha = vec![0f32; op.nnz() * heads];
        let mut out = Matrix::zeros(n, l.d_out());
        gat::forward(
            op,
            &src,
            &s_dst,
            g.global_ids(),
            self.attn_drop(l, pass),
            self.gat_shape(l),
            &mut alpha,
            out.data_mut(),
        );
        add_bias(&mut out, &self.params[l.bias].value);
        Ok((
            out,
            Cache::Gat {
                m_own,
                m_halo,
                s_dst,
                alpha,
            },
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn gat_backward(
        &self,
        l: &Layer,
        g: &LocalGraph,
        complete: bool,
        h: &Matrix,
        m_own: Matrix,
        m_halo: Option<Matrix>,
        s_dst: Vec<f32>,
        alpha: Vec<f32>,
        d_out: Matrix,
        need_dx: bool,
        pass: Pass,
        grads: &mut [Matrix],
        ex: &mut dyn Exchange,
    ) -> Result<Option<Matrix>> {
        grads[l.bias] = d_out.column_sums();
        let (heads, hc) = (l.heads, l.hc());
        let width = hc + heads;
        let n = g.n_dst;
        let op = g.op(LayerKind::Gat);
        let n_in = m_own.rows();
        let src = crate::sparse::Src {
            own: m_own.data(),
            halo: m_halo.as_ref().map(|m| m.data()).unwrap_or(&[]),
            n_own: n_in,
            d: width,
        };
        let shape = self.gat_shape(l);
        // pass 1, per destination row: d(score sum) per edge and head, the used attention, and d s_dst
        let nnz = op.nnz();
        let mut d_score = vec![0f32; nnz * heads];
        let mut a_used = vec![0f32; nnz * heads];
        let mut ds_dst = vec![0f32; n * heads];
        gat::backward_edges(
            op,
            &src,
            &s_dst,
            &alpha,
            d_out.data(),
            g.global_ids(),
            self.attn_drop(l, pass),
            shape,
            &mut d_score,
            &mut a_used,
            &mut ds_dst,
        );
        // pass 2, per source row over the transpose: dZ_j and d s_src_j
        let mut dm_ext = Matrix::zeros(g.n_src, width);
        gat::backward_sources(
            op,
            &a_used,
            &d_score,
            d_out.data(),
            shape,
            dm_ext.data_mut(),
        );
        drop(d_score);
        drop(a_used);
        let dm = if complete {
            dm_ext
        } else {
            let (mut dm, halo) = split_rows(dm_ext, n);
            ex.backward(l.index, halo, &mut dm)
                .map_err(Error::Exchange)?;
            dm
        };
        Ok(self.gat_backward_tail(l, h, n, &m_own, dm, ds_dst, need_dx, grads))
    }

    /// The end of GAT's backward, once the gradients of the messages of the input rows (`dm`, `[dZ | ds_src]`
    /// for the owned rows, peers' contributions included) and of `s_dst` are known: through the scores into
    /// `Z` and the attention vectors, then through `Z = h W`.
    #[allow(clippy::too_many_arguments)]
    fn gat_backward_tail(
        &self,
        l: &Layer,
        h: &Matrix,
        n: usize,
        m_own: &Matrix,
        dm: Matrix,
        ds_dst: Vec<f32>,
        need_dx: bool,
        grads: &mut [Matrix],
    ) -> Option<Matrix> {
        let (heads, c, hc) = (l.heads, l.head_dim, l.hc());
        let width = hc + heads;
        let n_in = m_own.rows();
        // through the scores s = Z . a into Z and the attention vectors
        let (ia, id) = l.att.expect("GAT layer has attention vectors");
        let a_src = self.params[ia].value.data();
        let a_dst = self.params[id].value.data();
        let mut dz = Matrix::zeros(n_in, hc);
        gat::dz(
            dm.data(),
            &ds_dst,
            a_src,
            a_dst,
            self.gat_shape(l),
            dz.data_mut(),
        );
        let z_own = Matrix::from_vec(
            n_in,
            hc,
            m_own
                .data()
                .chunks_exact(width)
                .flat_map(|r| &r[..hc])
                .copied()
                .collect(),
        );
        let ds_src = Matrix::from_vec(
            n_in,
            heads,
            dm.data()
                .chunks_exact(width)
                .flat_map(|r| &r[hc..])
                .copied()
                .collect(),
        );
        let ds_dst = Matrix::from_vec(n, heads, ds_dst);
        let z_dst = if n_in == n {
            None
        } else {
            Some(z_own.top_rows(n))
        };
        for (idx, s, z) in [
            (ia, &ds_src, &z_own),
            (id, &ds_dst, z_dst.as_ref().unwrap_or(&z_own)),
        ] {
            let full = matmul_at(s, z); // heads x hc; head k's gradient is block (k, k)
            let gm = &mut grads[idx];
            for k in 0..heads {
                gm.row_mut(k)
                    .copy_from_slice(&full.row(k)[k * c..(k + 1) * c]);
            }
        }
        grads[l.w] = matmul_at(h, &dz);
        need_dx.then(|| matmul_bt(&dz, &self.params[l.w].value))
    }
}

fn check_blocks(blocks: &[LocalGraph], layers: usize) -> Result<()> {
    if blocks.len() != layers {
        return Err(Error::Shape(format!(
            "{} blocks for a model of {layers} layers",
            blocks.len()
        )));
    }
    for (l, pair) in blocks.windows(2).enumerate() {
        if pair[1].n_src != pair[0].n_dst {
            return Err(Error::Shape(format!(
                "block {} has {} sources but block {l} has {} destinations",
                l + 1,
                pair[1].n_src,
                pair[0].n_dst
            )));
        }
    }
    Ok(())
}

/// `m[row0..row0 + part.rows()] += part`.
fn add_rows(m: &mut Matrix, row0: usize, part: &Matrix) {
    let cols = m.cols();
    assert_eq!(cols, part.cols(), "add_rows widths differ");
    let dst = &mut m.data_mut()[row0 * cols..(row0 + part.rows()) * cols];
    for (a, b) in dst.iter_mut().zip(part.data()) {
        *a += *b;
    }
}

fn validate(cfg: &ModelConfig) -> Result<()> {
    let bad = |m: String| Err(Error::Config(m));
    if cfg.layers == 0 {
        return bad("layers must be at least 1".into());
    }
    if cfg.in_dim == 0 || cfg.out_dim == 0 || cfg.hidden == 0 {
        return bad(format!(
            "in_dim, hidden and out_dim must be positive, got {}, {}, {}",
            cfg.in_dim, cfg.hidden, cfg.out_dim
        ));
    }
    if cfg.kind == LayerKind::Gat && (cfg.heads == 0 || cfg.out_heads == 0) {
        return bad("heads and out_heads must be positive".into());
    }
    for (name, p) in [
        ("dropout", cfg.dropout),
        ("input_dropout", cfg.input_dropout),
        ("attn_dropout", cfg.attn_dropout),
    ] {
        if !(0.0..1.0).contains(&p) {
            return bad(format!("{name} must be in [0, 1), got {p}"));
        }
    }
    Ok(())
}

#[inline]
/// Splits an `n_src`-row matrix into its first `n_dst` rows and the rest.
fn split_rows(m: Matrix, n_dst: usize) -> (Matrix, Matrix) {
    let cols = m.cols();
    let rows = m.rows();
    let mut data = m.into_vec();
    let halo = data.split_off(n_dst * cols);
    (
        Matrix::from_vec(n_dst, cols, data),
        Matrix::from_vec(rows - n_dst, cols, halo),
    )
}

pub(crate) fn add_bias(out: &mut Matrix, bias: &Matrix) {
    let b = bias.data();
    if b.is_empty() {
        return;
    }
    out.data_mut()
        .par_chunks_mut(b.len())
        .with_min_len(ELEMENTWISE_CHUNK / b.len().max(1))
        .for_each(|row| {
            for (o, &v) in row.iter_mut().zip(b) {
                *o += v;
            }
        });
}

pub(crate) fn activate(m: &mut Matrix, act: Activation) {
    m.data_mut()
        .par_iter_mut()
        .with_min_len(ELEMENTWISE_CHUNK)
        .for_each(|v| {
            *v = match act {
                Activation::Relu => v.max(0.0),
                Activation::Elu => {
                    if *v > 0.0 {
                        *v
                    } else {
                        v.exp_m1()
                    }
                }
            }
        });
}

/// Inverted dropout on rows keyed by the rows' global ids.
fn dropout_rows(m: &mut Matrix, g: &LocalGraph, p: f32, s: Stream) {
    let cols = m.cols();
    dropout_cols(m, g.global_ids(), 0, p, s, 0, cols);
}

/// Inverted dropout on columns `col0..col0 + m.cols()` of rows `total_cols` wide: the same decisions as
/// [`dropout_rows`] on the whole rows. Row `i` is source row `row0 + i` of `gids` (the row itself without).
pub(crate) fn dropout_cols(
    m: &mut Matrix,
    gids: Option<&[u32]>,
    row0: usize,
    p: f32,
    s: Stream,
    col0: usize,
    total_cols: usize,
) {
    let cols = m.cols();
    if cols == 0 {
        return;
    }
    let mask = Mask::new(s, p);
    let scale = 1.0 / (1.0 - p);
    m.data_mut()
        .par_chunks_mut(cols)
        .enumerate()
        .with_min_len(64)
        .for_each(|(i, row)| {
            let key = gat::gid(gids, row0 + i) * total_cols as u64 + col0 as u64;
            mask.apply(key, row, scale)
        });
}

/// `dy` (gradient of `y = dropout(act(z))`) becomes the gradient of `z`, from `y` and, for ELU, the
/// regenerated mask. For ReLU `y > 0` exactly when the element was kept and `z > 0`, so no mask is needed.
pub(crate) fn activation_backward(
    dy: &mut Matrix,
    y: &[f32],
    row0: usize,
    gids: Option<&[u32]>,
    act: Activation,
    dropout: Option<f32>,
    s: Stream,
) {
    let cols = dy.cols();
    if cols == 0 {
        return;
    }
    let scale = dropout.map(|p| 1.0 / (1.0 - p)).unwrap_or(1.0);
    let rows = dy
        .data_mut()
        .par_chunks_mut(cols)
        .zip(y.par_chunks(cols))
        .enumerate()
        .with_min_len(64);
    match act {
        Activation::Relu => rows.for_each(|(_, (drow, yrow))| {
            for (d, &yv) in drow.iter_mut().zip(yrow) {
                *d = if yv > 0.0 { *d * scale } else { 0.0 };
            }
        }),
        Activation::Elu => {
            let mask = dropout.map(|p| Mask::new(s, p));
            rows.for_each_init(
                || vec![true; cols],
                |keep, (i, (drow, yrow))| {
                    if let Some(m) = &mask {
                        m.fill(gat::gid(gids, row0 + i) * cols as u64, keep);
                    }
                    for ((d, &yv), &k) in drow.iter_mut().zip(yrow).zip(keep.iter()) {
                        // the pre-dropout activation value; elu'(z) = elu(z) + 1 for z <= 0
                        let a = yv / scale;
                        let deriv = if a > 0.0 { 1.0 } else { a + 1.0 };
                        *d = if k { *d * deriv * scale } else { 0.0 };
                    }
                },
            );
        }
    }
}
