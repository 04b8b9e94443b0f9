//! The layer logic, written once for every device: a GCN / GraphSAGE / GAT forward, backward and Adam step
//! composed from [`Ops`]. [`crate::Model`] is `DeviceModel<`[`super::Cpu`]`>`, the model every CPU worker
//! trains with; `physalia_gnn_cuda::CudaEngine` runs the same code on the GPU.
//!
//! Each layer is split at its aggregation: the messages of the owned rows (the input, `H W`, or GAT's
//! `[H W | s_src]`), the halo rows from the peers ([`Ops::halo_rows`] / [`Ops::aggregate`] through the
//! host's [`Exchange`]), then the aggregation and the dense part; backward mirrors it, the halo rows'
//! gradients going to their owners ([`Ops::halo_backward`] / [`Ops::aggregate_backward`]) and the weight
//! gradients all-reduced. GCN and GraphSAGE aggregate the input (`(A H) W`) or the transformed rows
//! (`A (H W)`), whichever is narrower; when the first layer aggregates raw features that no dropout touches,
//! `A X` is computed once and kept. When the first layer aggregated its input and the second transformed
//! first, the first layer's gradients come from the second layer's factors ([`Ops::fused_first_backward`]),
//! so a device need not hold the hidden-width gradient whole. Dropout and attention dropout are keyed by
//! global node ids, so every partitioning draws the masks of one worker.
//!
//! The same layers run on sampled mini-batch blocks (each layer's input holds every source row, so no
//! exchange is involved) and, for P3, from a first-layer product summed over column slices of the input
//! (`forward_after_first_in`).

use std::sync::Arc;

use crate::exchange::{Exchange, HaloSeed, LocalExchange};
use crate::model::{LocalGraph, Model, Param, Pass};
use crate::rng::Stream;
use crate::sparse::{Norm, SparseOp};
use crate::tensor::Matrix;
use crate::{LayerKind, ModelConfig};

use super::{AdamStep, AttnDropout, DeviceError, Dropout, GatRemat, GatShape, Ops, View};

/// The key of `Stream::new(seed, parts)`, as the kernels take it.
fn stream_key(seed: u64, parts: &[u64]) -> u64 {
    Stream::new(seed, parts).key()
}

fn shape_error<E: From<DeviceError>>(what: String) -> E {
    DeviceError::Shape(what).into()
}

/// Replaces gradient `i` (zero until its layer's backward sets it), handing the old buffer back.
fn set<O: Ops>(ops: &mut O, grads: &mut [O::Mat], i: usize, m: O::Mat) {
    let old = std::mem::replace(&mut grads[i], m);
    ops.recycle(old);
}

/// `set(ops, grads, i, value)` where computing the value borrows `ops` too.
macro_rules! set_grad {
    ($ops:expr, $grads:expr, $i:expr, $value:expr) => {{
        let value = $value;
        set($ops, $grads, $i, value);
    }};
}

/// A layer's shape and parameter slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerPlan {
    index: usize,
    kind: LayerKind,
    heads: usize,
    head_dim: usize,
    concat: bool,
    d_in: usize,
    /// `(A H) W` rather than `A (H W)`: the input is no wider than the output (never for GAT).
    aggregate_first: bool,
    w: usize,
    w_root: Option<usize>,
    att: Option<(usize, usize)>,
    bias: usize,
}

impl LayerPlan {
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

/// Whether a model of `cfg` fetches the input features' halo rows once and keeps them when it trains on a
/// partition with peers (input dropout, and a first layer that aggregates its input before transforming
/// it; not with a rematerialising exchange, `rematerialize`): what [`DeviceModel::seed_input_halo`] can
/// seed.
pub fn keeps_input_halo(cfg: &ModelConfig, rematerialize: bool) -> bool {
    !rematerialize
        && cfg.input_dropout > 0.0
        && plan(cfg).0.first().is_some_and(|l| l.aggregate_first)
}

/// The layer plans of a configuration and every parameter's (name, rows, cols, Glorot-initialised).
#[allow(clippy::type_complexity)]
fn plan(cfg: &ModelConfig) -> (Vec<LayerPlan>, Vec<(String, usize, usize, bool)>) {
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
            params.push((format!("layers.{index}.{name}"), rows, cols, glorot));
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
        layers.push(LayerPlan {
            index,
            kind: cfg.kind,
            heads,
            head_dim,
            concat,
            d_in,
            aggregate_first: cfg.kind != LayerKind::Gat && d_in <= hc,
            w,
            w_root,
            att,
            bias,
        });
        d_in = d_out;
    }
    (layers, params)
}

/// Glorot-initialised weights and zero biases of `cfg`, seeded, on the host.
fn initial_params(cfg: &ModelConfig, seed: u64) -> Vec<Param> {
    let (layers, shapes) = plan(cfg);
    let layer_of = |i: usize| {
        layers
            .iter()
            .find(|l| i <= l.bias)
            .expect("every parameter belongs to a layer")
            .index
    };
    shapes
        .into_iter()
        .enumerate()
        .map(|(i, (name, rows, cols, glorot))| {
            let mut m = Matrix::zeros(rows, cols);
            if glorot {
                let stream = Stream::new(seed, &[0x1A17, layer_of(i) as u64, i as u64]);
                let a = (6.0 / (rows + cols) as f32).sqrt();
                for (k, v) in m.data_mut().iter_mut().enumerate() {
                    *v = (2.0 * stream.uniform(k as u64) - 1.0) * a;
                }
            }
            Param { name, value: m }
        })
        .collect()
}

fn validate(cfg: &ModelConfig) -> Result<(), DeviceError> {
    let bad = |m: String| Err(DeviceError::Unsupported(m));
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

/// One layer's graph as the layer code reads it: `n` destination rows (the owned nodes, a block's
/// destinations) over `n_src` sources (the owned nodes then the halo, or a block's sources).
pub struct GraphView<'g, O: Ops> {
    pub n: usize,
    pub n_src: usize,
    pub op: &'g O::Csr,
    pub nnz: usize,
    /// Every source row's global node id (dropout keys); `None`: the row is the id.
    pub gids: Option<&'g O::Idx>,
    /// A sampled block: every source row is in the layer's input (no exchange of rows).
    pub complete: bool,
}

// by hand: derived impls would ask `O: Copy`
impl<O: Ops> Clone for GraphView<'_, O> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<O: Ops> Copy for GraphView<'_, O> {}

/// The sparse operator of one layer kind, resident on the device: `n` destination rows (the owned nodes)
/// over `n_src` sources (the owned nodes, then the halo).
pub struct DeviceGraph<O: Ops> {
    pub n: usize,
    pub n_src: usize,
    pub op: O::Csr,
    pub nnz: usize,
    /// Every source row's global node id (dropout keys); `None` on the whole graph.
    pub gids: Option<O::Idx>,
    /// A sampled block: every source row is in the layer's input (no exchange of rows).
    pub complete: bool,
}

impl<O: Ops> DeviceGraph<O> {
    /// The whole graph of an in-neighbour CSR, normalised for `kind` as `LocalGraph::whole` does.
    pub fn whole(
        ops: &mut O,
        kind: LayerKind,
        indptr: &[i64],
        indices: &[i32],
    ) -> Result<DeviceGraph<O>, O::Error> {
        let n = indptr.len().saturating_sub(1);
        let norm = match kind {
            LayerKind::Gcn => Norm::Symmetric,
            LayerKind::Sage => Norm::Mean,
            LayerKind::Gat => Norm::SelfLoopsOnly,
        };
        let op = Arc::new(SparseOp::build(n, n, indptr, indices, norm, None));
        Ok(DeviceGraph {
            n,
            n_src: n,
            nnz: op.nnz(),
            op: ops.share_csr(&op)?,
            gids: None,
            complete: false,
        })
    }

    /// A worker's part of the graph as the CPU engine holds it (`LocalGraph` built for `kind`).
    pub fn local(ops: &mut O, g: &LocalGraph, kind: LayerKind) -> Result<DeviceGraph<O>, O::Error> {
        let op = g.shared_op(kind);
        let gids = g.global_ids().map(|ids| ops.upload_idx(ids)).transpose()?;
        Ok(DeviceGraph {
            n: g.n_dst(),
            n_src: g.n_src(),
            nnz: op.nnz(),
            op: ops.share_csr(op)?,
            gids,
            complete: false,
        })
    }

    /// A sampled mini-batch block (`LocalGraph::block`): its input holds every source row.
    pub fn block(ops: &mut O, g: &LocalGraph, kind: LayerKind) -> Result<DeviceGraph<O>, O::Error> {
        Ok(DeviceGraph {
            complete: true,
            ..DeviceGraph::local(ops, g, kind)?
        })
    }

    pub fn view(&self) -> GraphView<'_, O> {
        GraphView {
            n: self.n,
            n_src: self.n_src,
            op: &self.op,
            nnz: self.nnz,
            gids: self.gids.as_ref(),
            complete: self.complete,
        }
    }
}

/// The graphs a pass runs over: one for every layer, or a sampled block per layer.
pub(crate) enum Graphs<'g, O: Ops> {
    Whole(GraphView<'g, O>),
    Blocks(&'g [GraphView<'g, O>]),
}

// by hand: derived impls would ask `O: Copy`
impl<O: Ops> Clone for Graphs<'_, O> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<O: Ops> Copy for Graphs<'_, O> {}

impl<'g, O: Ops> Graphs<'g, O> {
    fn layer(self, l: usize) -> GraphView<'g, O> {
        match self {
            Graphs::Whole(g) => g,
            Graphs::Blocks(b) => b[l],
        }
    }

    fn whole(self) -> bool {
        matches!(self, Graphs::Whole(_))
    }

    /// Rows of layer `l`'s input: the owned rows, or every source of the block.
    fn input_rows(self, l: usize) -> usize {
        match self {
            Graphs::Whole(g) => g.n,
            Graphs::Blocks(b) => b[l].n_src,
        }
    }
}

/// Checks that consecutive blocks chain (block `l + 1`'s sources are block `l`'s destinations).
pub(crate) fn check_blocks<O: Ops>(
    blocks: &[GraphView<'_, O>],
    layers: usize,
) -> Result<(), DeviceError> {
    if blocks.len() != layers {
        return Err(DeviceError::Shape(format!(
            "{} blocks for a model of {layers} layers",
            blocks.len()
        )));
    }
    for (l, pair) in blocks.windows(2).enumerate() {
        if pair[1].n_src != pair[0].n {
            return Err(DeviceError::Shape(format!(
                "block {} has {} sources but block {l} has {} destinations",
                l + 1,
                pair[1].n_src,
                pair[0].n
            )));
        }
    }
    Ok(())
}

/// What backward needs from a layer's forward, besides the layer's input.
enum Cache<M> {
    /// `A H` (None: the model's cached `A X`).
    Aggregated(Option<M>),
    Transformed,
    /// The first layer's product came from outside (P3: summed over the workers' column slices).
    External,
    Gat {
        m_own: M,
        m_halo: Option<M>,
        s_dst: M,
        alpha: M,
    },
    /// GAT with rematerialised halo rows (SAR): the owned messages and what the device kept.
    GatRemat {
        m_own: M,
        s_dst: M,
        st: GatRemat<M>,
    },
}

enum Input<'x, M> {
    Borrowed(&'x M),
    Owned(M),
    /// P3: the first layer's input stayed with its column slices.
    Absent,
}

impl<M> Input<'_, M> {
    fn get(&self) -> &M {
        match self {
            Input::Borrowed(m) => m,
            Input::Owned(m) => m,
            Input::Absent => unreachable!("P3's first layer is never run here"),
        }
    }
}

/// A layer's input gradient: dense, or as `sum_t A_t W_t^T` (parameter `t`'s weight).
enum Dx<M> {
    Dense(M),
    Factored(Vec<(M, usize)>),
}

/// A layer's output and what its backward needs.
type LayerOut<O> = (<O as Ops>::Mat, Cache<<O as Ops>::Mat>);

/// Activations kept between forward and backward.
pub struct DeviceForward<'x, O: Ops> {
    /// The input of each layer (after activation and dropout of the previous one).
    inputs: Vec<Input<'x, O::Mat>>,
    caches: Vec<Cache<O::Mat>>,
    pub logits: O::Mat,
    pass: Pass,
}

/// Adam's moments on the device.
struct AdamState<M> {
    step: u64,
    m: Vec<M>,
    v: Vec<M>,
}

/// A model whose parameters, activations and optimizer state live on an [`Ops`] device.
pub struct DeviceModel<O: Ops> {
    cfg: ModelConfig,
    seed: u64,
    layers: Vec<LayerPlan>,
    pub params: Vec<Param<O::Mat>>,
    adam: Option<AdamState<O::Mat>>,
    /// `A X` of the first layer when it is constant across epochs.
    input_agg: Option<O::Mat>,
    /// The input features' halo rows, fetched once: with input dropout the first layer's aggregation
    /// changes every epoch, but its halo rows are the peers' features under a mask keyed by global node id,
    /// which this worker draws itself, so they cross the network once instead of every epoch.
    input_halo: InputHalo<O::Mat>,
    /// Rows of the input halo this worker already holds (a resize in place): the next fetch of the
    /// input halo asks its peers for the others only.
    input_seed: Option<HaloSeed>,
}

/// The features' halo rows of a partition-parallel worker.
enum InputHalo<M> {
    /// Not fetched (or forgotten with the graph).
    Unfetched,
    /// Fetched; `None`: the exchange has no halo rows for this worker.
    Fetched(Option<M>),
}

/// Hyper-parameters of the Adam step (`crate::Adam`'s defaults for the betas and eps).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    pub lr: f32,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
}

impl AdamConfig {
    pub fn new(lr: f32, weight_decay: f32) -> AdamConfig {
        AdamConfig {
            lr,
            weight_decay,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

impl<O: Ops> DeviceModel<O> {
    /// A model of `cfg` with Glorot-initialised weights and zero biases, seeded, on the device.
    pub fn init(ops: &mut O, cfg: &ModelConfig, seed: u64) -> Result<DeviceModel<O>, O::Error> {
        validate(cfg)?;
        DeviceModel::from_params(ops, cfg, seed, initial_params(cfg, seed))
    }

    /// A model of `cfg` with the given host parameters (laid out as [`DeviceModel::init`] makes them).
    pub fn from_params(
        ops: &mut O,
        cfg: &ModelConfig,
        seed: u64,
        params: Vec<Param>,
    ) -> Result<DeviceModel<O>, O::Error> {
        let (layers, shapes) = plan(cfg);
        let ok = params.len() == shapes.len()
            && params
                .iter()
                .zip(&shapes)
                .all(|(p, (name, r, c, _))| &p.name == name && p.value.shape() == (*r, *c));
        if !ok {
            let got: Vec<&str> = params.iter().map(|p| p.name.as_str()).collect();
            let want: Vec<&str> = shapes.iter().map(|s| s.0.as_str()).collect();
            return Err(shape_error(format!(
                "the parameters {got:?} are not laid out as the configuration's ({want:?})"
            )));
        }
        let params = params
            .into_iter()
            .map(|p| {
                Ok(Param {
                    name: p.name,
                    value: ops.upload_owned(p.value)?,
                })
            })
            .collect::<Result<Vec<_>, O::Error>>()?;
        Ok(DeviceModel {
            cfg: cfg.clone(),
            seed,
            layers,
            params,
            adam: None,
            input_agg: None,
            input_halo: InputHalo::Unfetched,
            input_seed: None,
        })
    }

    /// Copies a CPU model's configuration and current parameters to the device.
    pub fn from_model(ops: &mut O, model: &Model) -> Result<DeviceModel<O>, O::Error> {
        DeviceModel::from_params(ops, model.config(), model.seed(), model.params.clone())
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The seed of the initial weights and of every dropout mask.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Parameter names, in the engine's order.
    pub fn names(&self) -> Vec<&str> {
        self.params.iter().map(|p| p.name.as_str()).collect()
    }

    /// Copies the parameters back into a CPU model of the same configuration.
    pub fn download_into(&self, ops: &mut O, model: &mut Model) -> Result<(), O::Error> {
        for (p, d) in model.params.iter_mut().zip(&self.params) {
            p.value = ops.download(&d.value)?;
        }
        Ok(())
    }

    /// Forgets the cached `A X` (call when the graph or the features change).
    pub fn clear_cache(&mut self) {
        self.input_agg = None;
        self.input_halo = InputHalo::Unfetched;
    }

    /// Takes the input features' halo rows this model fetched and kept (in the halo order of the graph it
    /// trained on; `None`: none kept, or this worker had no halo rows), forgetting them as
    /// [`DeviceModel::clear_cache`] does: a worker resized in place seeds its next input halo from them.
    pub fn take_input_halo(&mut self) -> Option<O::Mat> {
        match std::mem::replace(&mut self.input_halo, InputHalo::Unfetched) {
            InputHalo::Fetched(halo) => halo,
            InputHalo::Unfetched => None,
        }
    }

    /// Rows of the input halo this worker already holds, by global node id: the next time the first layer
    /// fetches its halo rows (the first pass after [`DeviceModel::clear_cache`]), only the rows `seed`
    /// lacks are asked of their owners. The rows must be exactly what the owners would send (the same
    /// features, normalisation and wire rounding); the seed is used once.
    pub fn seed_input_halo(&mut self, seed: HaloSeed) {
        self.input_seed = Some(seed);
    }

    /// The seed [`DeviceModel::seed_input_halo`] left, taken (a host model hands it to its device copy).
    pub(crate) fn take_input_seed(&mut self) -> Option<HaloSeed> {
        self.input_seed.take()
    }

    /// Whether later passes read the input features: false once the first layer's `A X` is cached for
    /// training and evaluation alike and nothing else reads `X` (no root weight, no input dropout), so a
    /// caller may free the features and pass an empty matrix from then on.
    pub fn needs_input(&self) -> bool {
        let l = &self.layers[0];
        !(self.input_agg.is_some()
            && l.aggregate_first
            && l.w_root.is_none()
            && self.cfg.input_dropout == 0.0)
    }

    /// Indices of the first layer's weights (the parameters P3 splits by rows).
    pub fn first_layer_weights(&self) -> Vec<usize> {
        let l = &self.layers[0];
        std::iter::once(l.w).chain(l.w_root).collect()
    }

    fn first_aggregation_is_constant(&self, pass: Pass) -> bool {
        self.layers[0].aggregate_first && (self.cfg.input_dropout == 0.0 || pass == Pass::Eval)
    }

    fn dropout_key(&self, epoch: u64, layer: u64) -> u64 {
        stream_key(self.seed, &[0xD0, epoch, layer])
    }

    /// The input features' dropout of `pass` (training with `input_dropout > 0`).
    fn input_dropout(&self, pass: Pass) -> Option<Dropout> {
        match pass {
            Pass::Train { epoch } if self.cfg.input_dropout > 0.0 => Some(Dropout {
                key: self.dropout_key(epoch, 0),
                p: self.cfg.input_dropout,
            }),
            _ => None,
        }
    }

    /// Whether the first layer aggregates the features' halo rows through `ex` on every training pass
    /// (input dropout makes `A X` change): then they are fetched once and kept ([`InputHalo`]).
    /// Rematerialising exchanges (SAR) keep nothing by design, so they fetch as before.
    fn keeps_input_halo(&self, g: GraphView<'_, O>, ex: &dyn Exchange) -> bool {
        self.layers[0].aggregate_first
            && self.cfg.input_dropout > 0.0
            && !g.complete
            && !ex.is_local()
            && !ex.rematerializes()
    }

    /// Forward over a worker's part (or the whole graph with a [`LocalExchange`]): `x` holds the owned rows;
    /// halo rows come through `ex`.
    pub fn forward_ex<'x>(
        &mut self,
        ops: &mut O,
        g: &DeviceGraph<O>,
        x: &'x O::Mat,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<DeviceForward<'x, O>, O::Error> {
        self.forward_in(ops, Graphs::Whole(g.view()), x, pass, ex)
    }

    /// Forward over sampled blocks: `x` holds block 0's source rows; the logits are the last block's
    /// destinations.
    pub fn forward_device_blocks<'x>(
        &mut self,
        ops: &mut O,
        blocks: &[DeviceGraph<O>],
        x: &'x O::Mat,
        pass: Pass,
    ) -> Result<DeviceForward<'x, O>, O::Error> {
        let views: Vec<_> = blocks.iter().map(DeviceGraph::view).collect();
        check_blocks(&views, self.layers.len())?;
        self.forward_in(ops, Graphs::Blocks(&views), x, pass, &mut LocalExchange)
    }

    /// Forward over `gs`; `x` is layer 0's input (an empty matrix once [`DeviceModel::needs_input`] says
    /// nothing reads it).
    pub(crate) fn forward_in<'x>(
        &mut self,
        ops: &mut O,
        gs: Graphs<'_, O>,
        x: &'x O::Mat,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<DeviceForward<'x, O>, O::Error> {
        let (rows, cols) = ops.dims(x);
        let want = (gs.input_rows(0), self.cfg.in_dim);
        // freed features are an empty matrix once the model no longer reads them
        let released = (rows, cols) == (0, 0) && gs.whole() && !self.needs_input();
        if (rows, cols) != want && !released {
            return Err(shape_error(format!(
                "input features are {rows}x{cols}, the model expects {}x{}",
                want.0, want.1
            )));
        }
        self.cache_input_aggregation_in(ops, gs, x, pass, ex)?;
        let g = gs.layer(0);
        let input = match self.input_dropout(pass) {
            // the first layer makes its dropped-out copy itself, in its output's buffer, and is done with
            // it once aggregated
            Some(_)
                if self.redraws_root_input(gs)
                    || self.backward_skips_first_input(gs)
                    || self.redraws_transformed_input(gs) =>
            {
                Input::Borrowed(x)
            }
            Some(d) => {
                let mut xd = ops.duplicate(x)?;
                ops.dropout(&mut xd, g.gids, 0, 0, cols, d)?;
                Input::Owned(xd)
            }
            None => Input::Borrowed(x),
        };
        let caches = Vec::with_capacity(self.layers.len());
        self.run_layers(ops, gs, vec![input], caches, None, pass, ex)
    }

    /// Starts `pass` on `ex` and computes the first layer's `A X` over `g` when it is constant across epochs
    /// and not cached yet (what [`DeviceModel::forward_ex`] does first), so a caller can free the features
    /// before the pass when [`DeviceModel::needs_input`] says nothing reads them any more.
    pub fn cache_input_aggregation_ex(
        &mut self,
        ops: &mut O,
        g: &DeviceGraph<O>,
        x: &O::Mat,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<(), O::Error> {
        let (rows, cols) = ops.dims(x);
        let gs = Graphs::Whole(g.view());
        if (rows, cols) != (gs.input_rows(0), self.cfg.in_dim) {
            return Err(shape_error(format!(
                "input features are {rows}x{cols}, the model expects {}x{}",
                gs.input_rows(0),
                self.cfg.in_dim
            )));
        }
        self.cache_input_aggregation_in(ops, gs, x, pass, ex)
    }

    /// [`DeviceModel::cache_input_aggregation_ex`] over `gs`.
    pub(crate) fn cache_input_aggregation_in(
        &mut self,
        ops: &mut O,
        gs: Graphs<'_, O>,
        x: &O::Mat,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<(), O::Error> {
        ex.begin_pass(pass);
        let g = gs.layer(0);
        let keep_halo = gs.whole() && self.keeps_input_halo(g, ex);
        // a seed serves the next fetch only; kept by a model that fetches nothing, it would be memory held
        // for nothing
        let seed = if gs.whole() {
            self.input_seed.take()
        } else {
            None
        };
        if keep_halo && matches!(self.input_halo, InputHalo::Unfetched) {
            // every rank of the mesh takes this branch on the same pass (the same configuration); the
            // rows are fetched as an evaluation pass fetches them, every row and none stale, whatever
            // boundary sampling or staleness this pass uses: fetched once, nothing is saved by thinning
            // them, and later epochs apply none of it to the first layer. Rows seeded by a resize in place
            // are not fetched again; without a seed every row is asked for (the same exchange on every
            // rank, whatever each holds).
            ex.begin_pass(Pass::Eval);
            let seed = seed.unwrap_or_default();
            let halo = ops.seeded_halo_rows(g, 0, x, ex, &seed);
            drop(seed);
            ex.begin_pass(pass);
            self.input_halo = InputHalo::Fetched(halo?);
        }
        if gs.whole() && self.first_aggregation_is_constant(pass) && self.input_agg.is_none() {
            let agg = match self.kept_input_halo(g, ex) {
                Some(halo) => self.aggregate_kept_input(ops, g, x, halo, pass)?,
                None => ops.aggregate(g, 0, x, ex)?,
            };
            self.input_agg = Some(agg);
        }
        Ok(())
    }

    /// The kept halo rows of the features when the first layer uses them (`Some(None)`: kept, and this
    /// worker has no halo rows).
    fn kept_input_halo(&self, g: GraphView<'_, O>, ex: &dyn Exchange) -> Option<Option<&O::Mat>> {
        match &self.input_halo {
            InputHalo::Fetched(halo) if self.keeps_input_halo(g, ex) => Some(halo.as_ref()),
            _ => None,
        }
    }

    /// `A dropout([X_own; X_halo])` of the first layer from the kept halo rows `halo` (`h`: the owned rows,
    /// already dropped out; no dropout outside training).
    fn aggregate_kept_input(
        &self,
        ops: &mut O,
        g: GraphView<'_, O>,
        h: &O::Mat,
        halo: Option<&O::Mat>,
        pass: Pass,
    ) -> Result<O::Mat, O::Error> {
        let cols = self.cfg.in_dim;
        let dropped = match (halo, self.input_dropout(pass)) {
            (Some(halo), Some(d)) => {
                let mut hd = ops.duplicate(halo)?;
                // the halo rows are sources g.n.. : their global ids key the mask as their owner's did
                ops.dropout(&mut hd, g.gids, g.n, 0, cols, d)?;
                Some(hd)
            }
            _ => None,
        };
        let mut y = ops.alloc(g.n, cols)?;
        ops.spmm(g.op, h, dropped.as_ref().or(halo), &mut y)?;
        if let Some(hd) = dropped {
            ops.recycle(hd);
        }
        Ok(y)
    }

    /// P3: the first layer's output is `z0 + bias` (`z0` summed over the column slices of
    /// [`DeviceModel::first_layer_partial_in`]); the remaining layers run as usual.
    pub(crate) fn forward_after_first_in(
        &mut self,
        ops: &mut O,
        gs: Graphs<'_, O>,
        z0: O::Mat,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<DeviceForward<'static, O>, O::Error> {
        let l = &self.layers[0];
        let g = gs.layer(0);
        let (r, c) = ops.dims(&z0);
        if (r, c) != (g.n, l.d_out()) {
            return Err(shape_error(format!(
                "the first layer's product is {r}x{c}, expected {}x{}",
                g.n,
                l.d_out()
            )));
        }
        ex.begin_pass(pass);
        // the bias, activation and dropout follow in `run_layers`, as for every layer
        let inputs = vec![Input::Absent];
        self.run_layers(ops, gs, inputs, vec![Cache::External], Some(z0), pass, ex)
    }

    /// Runs layers `inputs.len() - 1..`: each entry of `inputs` is a layer's input; `done` is the output of
    /// the last of them when it is already computed (P3's first layer).
    #[allow(clippy::too_many_arguments)]
    fn run_layers<'x>(
        &mut self,
        ops: &mut O,
        gs: Graphs<'_, O>,
        mut inputs: Vec<Input<'x, O::Mat>>,
        mut caches: Vec<Cache<O::Mat>>,
        mut done: Option<O::Mat>,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<DeviceForward<'x, O>, O::Error> {
        loop {
            let li = inputs.len() - 1;
            let g = gs.layer(li);
            let mut out = match done.take() {
                Some(out) => out,
                None => {
                    let l = self.layers[li].clone();
                    let (out, cache) = if li == 0
                        && self.backward_skips_first_input(gs)
                        && matches!(inputs[0], Input::Owned(_))
                    {
                        // the dropped-out features (n x in_dim) are freed once aggregated, before the
                        // layer's output exists, not held through the epoch; the next epoch's copy is
                        // made after this epoch's peak
                        let Input::Owned(x) = std::mem::replace(&mut inputs[0], Input::Absent)
                        else {
                            unreachable!("matched above")
                        };
                        let agg = self.aggregation(ops, &l, g, &x, pass, gs.whole(), ex)?;
                        ops.release(x);
                        self.after_aggregation(ops, &l, g.n, agg, None, None)?
                    } else if let (0, Some(d), true) = (
                        li,
                        self.input_dropout(pass),
                        self.redraws_root_input(gs) || self.backward_skips_first_input(gs),
                    ) {
                        // input dropout where backward never reads the dropped-out features (GCN) or
                        // draws them again (a root weight): they exist only while aggregated; the root
                        // product (here) and its gradient (`fused_first_backward`) draw their rows again
                        // a block at a time from the features, so the copy (512 MiB at 1M nodes) is not
                        // held beside the hidden layer through the epoch (issue 34)
                        let x = inputs[0].get();
                        let (rows, cols) = ops.dims(x);
                        // the copy lives in the buffer the layer's output takes next, no smaller (the layer
                        // aggregates first because its input is no wider than its output): an epoch asks
                        // for the same buffers as the last, each served from the one its size had
                        let fits = rows * cols <= g.n * l.hc();
                        let mut xd = if fits {
                            let buf = ops.alloc(g.n, l.hc())?;
                            let mut xd = ops.reuse_as(buf, rows, cols)?;
                            ops.copy2d(View::full(x, rows, cols), &mut xd, 0, cols)?;
                            xd
                        } else {
                            ops.duplicate(x)?
                        };
                        ops.dropout(&mut xd, g.gids, 0, 0, cols, d)?;
                        let agg = self.aggregation(ops, &l, g, &xd, pass, gs.whole(), ex)?;
                        let out = if fits {
                            Some(ops.reuse_as(xd, g.n, l.hc())?)
                        } else {
                            ops.release(xd);
                            None
                        };
                        let root = l.w_root.map(|_| (x, (d, g.gids)));
                        self.after_aggregation_into(
                            ops,
                            &l,
                            g.n,
                            agg,
                            root.map(|r| r.0),
                            root.map(|r| r.1),
                            out,
                        )?
                    } else {
                        let drawn = self.drawn_input_dropout(gs, li, &inputs[li], pass);
                        let h = inputs[li].get();
                        self.layer_forward(ops, &l, g, h, drawn, pass, gs.whole(), ex)?
                    };
                    caches.push(cache);
                    out
                }
            };
            // the layers return their output before its bias: a hidden layer's bias, activation and
            // dropout are one pass over it where the engine fuses them
            let bias = &self.params[self.layers[li].bias].value;
            if li + 1 == self.layers.len() {
                ops.bias_add(&mut out, bias)?;
                return Ok(DeviceForward {
                    inputs,
                    caches,
                    logits: out,
                    pass,
                });
            }
            let d = match pass {
                Pass::Train { epoch } if self.cfg.dropout > 0.0 => Some(Dropout {
                    key: self.dropout_key(epoch, li as u64 + 1),
                    p: self.cfg.dropout,
                }),
                _ => None,
            };
            ops.bias_activate_dropout(&mut out, bias, self.cfg.activation, g.gids, d)?;
            inputs.push(Input::Owned(out));
        }
    }

    /// An aggregate-first layer's `A H` (`None`: the first layer's constant one, cached in `input_agg`).
    #[allow(clippy::too_many_arguments)]
    fn aggregation(
        &self,
        ops: &mut O,
        l: &LayerPlan,
        g: GraphView<'_, O>,
        h: &O::Mat,
        pass: Pass,
        whole: bool,
        ex: &mut dyn Exchange,
    ) -> Result<Option<O::Mat>, O::Error> {
        Ok(
            if whole && l.index == 0 && self.first_aggregation_is_constant(pass) {
                None
            } else if let (true, Some(halo)) = (whole && l.index == 0, self.kept_input_halo(g, ex))
            {
                Some(self.aggregate_kept_input(ops, g, h, halo, pass)?)
            } else {
                Some(ops.aggregate(g, l.index, h, ex)?)
            },
        )
    }

    /// An aggregate-first layer's `(A H) W (+ H W_root)` before its bias, from its aggregation `agg` (see
    /// [`DeviceModel::aggregation`]); `h` is read only for the root weight.
    fn after_aggregation(
        &self,
        ops: &mut O,
        l: &LayerPlan,
        n: usize,
        agg: Option<O::Mat>,
        h: Option<&O::Mat>,
        h_dropout: Option<(Dropout, Option<&O::Idx>)>,
    ) -> Result<LayerOut<O>, O::Error> {
        self.after_aggregation_into(ops, l, n, agg, h, h_dropout, None)
    }

    /// [`DeviceModel::after_aggregation`] into `out` (`n x hc`, overwritten) when given.
    #[allow(clippy::too_many_arguments)]
    fn after_aggregation_into(
        &self,
        ops: &mut O,
        l: &LayerPlan,
        n: usize,
        agg: Option<O::Mat>,
        h: Option<&O::Mat>,
        h_dropout: Option<(Dropout, Option<&O::Idx>)>,
        out: Option<O::Mat>,
    ) -> Result<LayerOut<O>, O::Error> {
        let (d_in, hc) = (l.d_in, l.hc());
        let a = match &agg {
            Some(a) => a,
            None => self
                .input_agg
                .as_ref()
                .expect("input aggregation computed before layer 0"),
        };
        let mut out = match out {
            Some(out) => out,
            None => ops.alloc(n, hc)?,
        };
        ops.gemm(
            View::full(a, n, d_in),
            View::full(&self.params[l.w].value, d_in, hc),
            0.0,
            &mut out,
        )?;
        if let Some(r) = l.w_root {
            let h = h.expect("a root weight reads the layer's input");
            match h_dropout {
                Some((d, gids)) => {
                    ops.gemm_dropped_add(h, gids, d, &self.params[r].value, &mut out)?
                }
                None => ops.gemm(
                    View::full(h, n, d_in),
                    View::full(&self.params[r].value, d_in, hc),
                    1.0,
                    &mut out,
                )?,
            }
        }
        Ok((out, Cache::Aggregated(agg)))
    }

    /// Whether nothing reads the first layer's input after its forward: the whole graph's fused first-layer
    /// backward (see `backward_in`: it reads the aggregation, and the input only for a root weight) of a
    /// GCN-like first layer that aggregated its input and has no root weight, below a second layer that
    /// transforms first. Its input, when the forward
    /// made it (input dropout: a copy of the features), is then freed at once (issue 34: 512 MiB at 1M
    /// nodes and 128 features).
    fn backward_skips_first_input(&self, gs: Graphs<'_, O>) -> bool {
        self.fused_first_layer(gs)
            .is_some_and(|l0| l0.w_root.is_none())
    }

    /// The first layer when the fused first-layer backward runs: a GCN- or GraphSAGE-like first layer that
    /// aggregated its input, on the whole graph (not blocks), below a second layer that hands back its
    /// input gradient factored (it transformed before aggregating).
    fn fused_first_layer(&self, gs: Graphs<'_, O>) -> Option<&LayerPlan> {
        let [l0, l1, ..] = &self.layers[..] else {
            return None;
        };
        (gs.whole()
            && l0.kind != LayerKind::Gat
            && l0.aggregate_first
            && l1.kind != LayerKind::Gat
            && !l1.aggregate_first)
            .then_some(l0)
    }

    /// Whether the first layer's root weight reads its input again in the fused first-layer backward (a
    /// GraphSAGE-like first layer that aggregated its input, below a second layer that transforms first,
    /// on the whole graph or a partition): then, under input dropout, the dropped-out features are made
    /// only to be aggregated, and the root weight's forward product and gradient draw their rows again
    /// from the features ([`Ops::gemm_dropped_add`], `fused_first_backward`'s `x_root_dropout`).
    fn redraws_root_input(&self, gs: Graphs<'_, O>) -> bool {
        self.fused_first_layer(gs)
            .is_some_and(|l0| l0.w_root.is_some())
    }

    /// Whether a first layer that transforms its input before aggregating (its input is wider than its
    /// output: GCN and GraphSAGE on wide features) draws its input dropout again a row block at a time, in
    /// forward's products and backward's weight gradients ([`Ops::gemm_dropped_add`],
    /// [`Ops::matmul_at_dropped`]), instead of holding the dropped-out copy of the features from forward
    /// to backward (n x in_dim: 122 MiB for a quarter of SBM 1M, as much as the features; issue 31). On the
    /// whole graph or a partition; sampled blocks keep the copy.
    fn redraws_transformed_input(&self, gs: Graphs<'_, O>) -> bool {
        let l0 = &self.layers[0];
        gs.whole() && l0.kind != LayerKind::Gat && !l0.aggregate_first
    }

    /// The input dropout layer 0 draws again from its borrowed input (see
    /// [`DeviceModel::redraws_transformed_input`]), when this pass drops out its input.
    fn drawn_input_dropout(
        &self,
        gs: Graphs<'_, O>,
        li: usize,
        input: &Input<'_, O::Mat>,
        pass: Pass,
    ) -> Option<Dropout> {
        (li == 0 && matches!(input, Input::Borrowed(_)) && self.redraws_transformed_input(gs))
            .then(|| self.input_dropout(pass))
            .flatten()
    }

    /// One layer's forward, its output before the bias (`run_layers` adds it). `h` is the layer's input: the
    /// owned rows (halo rows come through `ex`) or, on a block, every source row; `drawn`: the input is
    /// `dropout(h)`, drawn again a row block at a time (a transforming first layer, see
    /// [`DeviceModel::redraws_transformed_input`]).
    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        ops: &mut O,
        l: &LayerPlan,
        g: GraphView<'_, O>,
        h: &O::Mat,
        drawn: Option<Dropout>,
        pass: Pass,
        whole: bool,
        ex: &mut dyn Exchange,
    ) -> Result<LayerOut<O>, O::Error> {
        if l.kind == LayerKind::Gat {
            return self.gat_forward(ops, l, g, h, pass, ex);
        }
        // `n` destinations; the input has `n_in` rows (more than `n` on a block: every source)
        let n = g.n;
        let (d_in, hc) = (l.d_in, l.hc());
        let w = &self.params[l.w].value;
        let root = l.w_root.map(|r| &self.params[r].value);
        let (out, cache) = if l.aggregate_first {
            let agg = self.aggregation(ops, l, g, h, pass, whole, ex)?;
            self.after_aggregation(ops, l, n, agg, Some(h), None)?
        } else if let (Some(wr), false) = (root, g.complete) {
            // one product `H [W | W_root]` reads H once instead of twice
            let (m, r) = match drawn {
                None => ops.linear_pair(h, w, wr)?,
                Some(d) => ops.linear_pair_dropped(h, g.gids, d, w, wr)?,
            };
            let mut out = ops.aggregate(g, l.index, &m, ex)?;
            ops.recycle(m);
            ops.add_assign(&mut out, &r)?;
            ops.recycle(r);
            (out, Cache::Transformed)
        } else {
            let n_in = ops.dims(h).0;
            let m = match drawn {
                None => {
                    let mut m = ops.alloc(n_in, hc)?;
                    ops.gemm(
                        View::full(h, n_in, d_in),
                        View::full(w, d_in, hc),
                        0.0,
                        &mut m,
                    )?;
                    m
                }
                Some(d) => {
                    let mut m = ops.zeros(n_in, hc)?;
                    ops.gemm_dropped_add(h, g.gids, d, w, &mut m)?;
                    m
                }
            };
            let mut out = ops.aggregate(g, l.index, &m, ex)?;
            ops.recycle(m);
            if let Some(wr) = root {
                // the root weight reads the destinations' rows of the input (a prefix of it on a block)
                match drawn {
                    None => ops.gemm(
                        View::full(h, n, d_in),
                        View::full(wr, d_in, hc),
                        1.0,
                        &mut out,
                    )?,
                    Some(d) => ops.gemm_dropped_add(h, g.gids, d, wr, &mut out)?,
                }
            }
            (out, Cache::Transformed)
        };
        Ok((out, cache))
    }

    fn gat_shape(&self, l: &LayerPlan) -> GatShape {
        GatShape {
            heads: l.heads as u32,
            c: l.head_dim as u32,
            concat: l.concat,
            slope: self.cfg.negative_slope,
        }
    }

    fn attn_dropout(&self, l: &LayerPlan, pass: Pass) -> Option<AttnDropout> {
        match pass {
            Pass::Train { epoch } if self.cfg.attn_dropout > 0.0 => Some(AttnDropout {
                key: stream_key(self.seed, &[0xA7D, epoch, l.index as u64]),
                p: self.cfg.attn_dropout,
            }),
            _ => None,
        }
    }

    fn gat_forward(
        &self,
        ops: &mut O,
        l: &LayerPlan,
        g: GraphView<'_, O>,
        h: &O::Mat,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<LayerOut<O>, O::Error> {
        let (heads, hc) = (l.heads, l.hc());
        let (ia, id) = l.att.expect("GAT layer has attention vectors");
        let (n_in, d_in) = ops.dims(h);
        let shape = self.gat_shape(l);
        // messages: [Z | s_src] for the input rows, and s_dst
        let mut z = ops.alloc(n_in, hc)?;
        ops.gemm(
            View::full(h, n_in, d_in),
            View::full(&self.params[l.w].value, d_in, hc),
            0.0,
            &mut z,
        )?;
        let mut m_own = ops.alloc(n_in, hc + heads)?;
        let mut s_dst = ops.alloc(n_in, heads)?;
        ops.gat_messages(
            &z,
            &self.params[ia].value,
            &self.params[id].value,
            shape,
            &mut m_own,
            &mut s_dst,
        )?;
        ops.recycle(z);
        let drop = self.attn_dropout(l, pass);
        let mut out = ops.alloc(g.n, l.d_out())?;
        let cache = if !g.complete && ex.rematerializes() {
            let st =
                ops.gat_forward_remat(g, l.index, &m_own, &s_dst, drop, shape, ex, &mut out)?;
            Cache::GatRemat { m_own, s_dst, st }
        } else {
            let m_halo = ops.halo_rows(g, l.index, &m_own, ex)?;
            let mut alpha = ops.alloc(g.nnz, heads)?;
            ops.gat_forward(
                g.op,
                &m_own,
                m_halo.as_ref(),
                &s_dst,
                g.gids,
                drop,
                shape,
                &mut alpha,
                &mut out,
            )?;
            Cache::Gat {
                m_own,
                m_halo,
                s_dst,
                alpha,
            }
        };
        Ok((out, cache))
    }

    /// Parameter gradients of a worker's part (or the whole graph with a [`LocalExchange`]) from the
    /// gradient of the mean loss with respect to the logits: halo gradients go to their owners through
    /// `ex`, and the parameter gradients are all-reduced through it.
    pub fn backward_ex(
        &self,
        ops: &mut O,
        g: &DeviceGraph<O>,
        fwd: DeviceForward<'_, O>,
        d_logits: O::Mat,
        ex: &mut dyn Exchange,
    ) -> Result<Vec<O::Mat>, O::Error> {
        self.backward_in(ops, Graphs::Whole(g.view()), fwd, d_logits, ex, None)
    }

    /// Backward of [`DeviceModel::forward_device_blocks`]; the parameter gradients are all-reduced through
    /// `ex` (data parallelism: every worker trained its share of the batch).
    pub fn backward_device_blocks(
        &self,
        ops: &mut O,
        blocks: &[DeviceGraph<O>],
        fwd: DeviceForward<'_, O>,
        d_logits: O::Mat,
        ex: &mut dyn Exchange,
    ) -> Result<Vec<O::Mat>, O::Error> {
        let views: Vec<_> = blocks.iter().map(DeviceGraph::view).collect();
        self.backward_in(ops, Graphs::Blocks(&views), fwd, d_logits, ex, None)
    }

    /// Zero gradients of every parameter, all-reduced through `ex` (a worker with no seeds in a step).
    pub fn zero_grads_reduced(
        &self,
        ops: &mut O,
        ex: &mut dyn Exchange,
    ) -> Result<Vec<O::Mat>, O::Error> {
        let mut grads = self.zero_grads_on(ops)?;
        ops.all_reduce(&mut grads, ex)?;
        Ok(grads)
    }

    fn zero_grads_on(&self, ops: &mut O) -> Result<Vec<O::Mat>, O::Error> {
        self.params
            .iter()
            .map(|p| {
                let (r, c) = ops.dims(&p.value);
                ops.zeros(r, c)
            })
            .collect()
    }

    /// Backward from the gradient of the mean loss with respect to the logits. With `first_grad`, the first
    /// layer's product came from outside (P3): its output gradient is stored there, the first layer's
    /// weights get zero gradients, and nothing is all-reduced (the caller owns both).
    pub(crate) fn backward_in(
        &self,
        ops: &mut O,
        gs: Graphs<'_, O>,
        fwd: DeviceForward<'_, O>,
        d_logits: O::Mat,
        ex: &mut dyn Exchange,
        mut first_grad: Option<&mut Option<O::Mat>>,
    ) -> Result<Vec<O::Mat>, O::Error> {
        let DeviceForward {
            mut inputs,
            mut caches,
            pass,
            logits,
        } = fwd;
        // zero gradients before the logits go, as every layer's replace theirs: the small buffers then do not
        // split the logits' freed block, which the next n-row buffer reuses
        let mut grads = self.zero_grads_on(ops)?;
        // the loss has read the logits; backward needs only their gradient
        ops.recycle(logits);
        let epoch = match pass {
            Pass::Train { epoch } => epoch,
            Pass::Eval => 0,
        };
        let p_drop = matches!(pass, Pass::Train { .. })
            .then_some(self.cfg.dropout)
            .filter(|&p| p > 0.0);
        let dropout = |li: usize| {
            p_drop.map(|p| Dropout {
                key: self.dropout_key(epoch, li as u64),
                p,
            })
        };
        // The first layer never needs its input's gradient. When it aggregated its input, its weight gradients
        // are row-block sums, so the second layer's input gradient (as wide as the hidden layer) can be formed
        // block by block and consumed at once instead of held whole.
        // (`backward_skips_first_input` is this without `first_grad`, which only P3 passes, whose first
        // layer's cache is external)
        let fuse_first = gs.whole()
            && first_grad.is_none()
            && self.layers[0].aggregate_first
            && self.layers.len() > 1;
        let mut d_out = d_logits;
        while let Some(cache) = caches.pop() {
            let li = caches.len();
            let l = &self.layers[li];
            let h = inputs.pop().expect("one input per layer");
            if let Cache::External = cache {
                ops.col_sums(&d_out, &mut grads[l.bias])?;
                if let Some(slot) = first_grad.as_mut() {
                    **slot = Some(d_out);
                }
                return Ok(grads);
            }
            let g = gs.layer(li);
            let fuse = li == 1 && fuse_first;
            let drawn = self.drawn_input_dropout(gs, li, &h, pass);
            let dx = self.layer_backward(
                ops,
                l,
                g,
                h.get(),
                drawn,
                cache,
                d_out,
                li > 0,
                fuse,
                pass,
                &mut grads,
                ex,
            )?;
            let Some(dx) = dx else {
                if let Input::Owned(m) = h {
                    ops.recycle(m);
                }
                break;
            };
            let y = match h {
                Input::Owned(m) => m,
                _ => unreachable!("a hidden layer's input is the previous layer's output"),
            };
            match dx {
                Dx::Factored(terms) => {
                    let Some(Cache::Aggregated(agg)) = caches.pop() else {
                        unreachable!("fused only after an aggregate-first layer 0")
                    };
                    let l0 = &self.layers[0];
                    let x = inputs.pop().expect("layer 0's input");
                    let a = agg
                        .as_ref()
                        .or(self.input_agg.as_ref())
                        .expect("aggregation cached in forward");
                    let refs: Vec<(&O::Mat, &O::Mat)> = terms
                        .iter()
                        .map(|(a, w)| (a, &self.params[*w].value))
                        .collect();
                    // the features themselves when forward drew the root weight's dropout again
                    let x_root_dropout = match x {
                        Input::Borrowed(_) => self.input_dropout(pass),
                        _ => None,
                    };
                    let first = ops.fused_first_backward(
                        a,
                        l0.w_root.map(|_| x.get()),
                        x_root_dropout,
                        y,
                        &refs,
                        g.gids,
                        self.cfg.activation,
                        dropout(li),
                    )?;
                    set(ops, &mut grads, l0.w, first.w);
                    if let (Some(r), Some(gr)) = (l0.w_root, first.w_root) {
                        set(ops, &mut grads, r, gr);
                    }
                    set(ops, &mut grads, l0.bias, first.bias);
                    drop(refs);
                    for (m, _) in terms {
                        ops.recycle(m);
                    }
                    if let Some(a) = agg {
                        ops.recycle(a);
                    }
                    if let Input::Owned(m) = x {
                        ops.recycle(m);
                    }
                    break;
                }
                Dx::Dense(mut dx) => {
                    // through the previous layer's activation and dropout; `y` is their output
                    ops.activation_backward(
                        &mut dx,
                        &y,
                        g.gids,
                        0,
                        self.cfg.activation,
                        dropout(li),
                    )?;
                    ops.recycle(y);
                    d_out = dx;
                }
            }
        }
        ops.all_reduce(&mut grads, ex)?;
        Ok(grads)
    }

    /// `C = op(A) op(B)` into a new matrix.
    fn product(ops: &mut O, a: View<'_, O::Mat>, b: View<'_, O::Mat>) -> Result<O::Mat, O::Error> {
        let (m, n) = (a.op_shape().0, b.op_shape().1);
        let mut c = ops.alloc(m, n)?;
        ops.gemm(a, b, 0.0, &mut c)?;
        Ok(c)
    }

    /// `H^T X` over the first `rows` rows of both: a weight's gradient.
    fn at_b(ops: &mut O, h: &O::Mat, x: &O::Mat, rows: usize) -> Result<O::Mat, O::Error> {
        let (hc, xc) = (ops.dims(h).1, ops.dims(x).1);
        Self::product(ops, View::full(h, rows, hc).t(), View::full(x, rows, xc))
    }

    /// `D W^T`: an input's gradient through a weight.
    fn a_bt(ops: &mut O, d: &O::Mat, w: &O::Mat) -> Result<O::Mat, O::Error> {
        let ((dr, dc), (wr, wc)) = (ops.dims(d), ops.dims(w));
        Self::product(ops, View::full(d, dr, dc), View::full(w, wr, wc).t())
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_backward(
        &self,
        ops: &mut O,
        l: &LayerPlan,
        g: GraphView<'_, O>,
        h: &O::Mat,
        drawn: Option<Dropout>,
        cache: Cache<O::Mat>,
        d_out: O::Mat,
        need_dx: bool,
        factored_ok: bool,
        pass: Pass,
        grads: &mut [O::Mat],
        ex: &mut dyn Exchange,
    ) -> Result<Option<Dx<O::Mat>>, O::Error> {
        ops.col_sums(&d_out, &mut grads[l.bias])?;
        let cache = match cache {
            Cache::Gat {
                m_own,
                m_halo,
                s_dst,
                alpha,
            } => {
                let dx = self.gat_backward(
                    ops, l, g, h, m_own, m_halo, s_dst, alpha, d_out, need_dx, pass, grads, ex,
                )?;
                return Ok(dx.map(Dx::Dense));
            }
            Cache::GatRemat { m_own, s_dst, st } => {
                let shape = self.gat_shape(l);
                let drop = self.attn_dropout(l, pass);
                let (dm, ds_dst) = ops
                    .gat_backward_remat(g, l.index, &m_own, &s_dst, st, &d_out, drop, shape, ex)?;
                ops.recycle(d_out);
                ops.recycle(s_dst);
                let dx = self.gat_backward_tail(ops, l, g, h, m_own, dm, ds_dst, need_dx, grads)?;
                return Ok(dx.map(Dx::Dense));
            }
            Cache::External => unreachable!("handled by the caller"),
            c => c,
        };
        // `n` destinations (d_out's rows); the input has `n_in` rows (every source on a block)
        let n = g.n;
        let (d_in, hc) = (l.d_in, l.hc());
        let w = &self.params[l.w].value;
        if let (Some(d), Cache::Transformed) = (drawn, &cache) {
            // the first layer under input dropout, its input the features themselves: both weight
            // gradients read `dropout(X)` drawn again a row block at a time (it has no input gradient)
            let dm = ops.aggregate_backward(g, l.index, &d_out, ex)?;
            let mut bs = vec![&dm];
            if l.w_root.is_some() {
                bs.push(&d_out);
            }
            let mut gs = ops.matmul_at_dropped(h, g.gids, d, &bs)?.into_iter();
            drop(bs);
            if let Some(gw) = gs.next() {
                set_grad!(ops, grads, l.w, gw);
            }
            if let (Some(r), Some(gr)) = (l.w_root, gs.next()) {
                set_grad!(ops, grads, r, gr);
            }
            ops.recycle(dm);
            ops.recycle(d_out);
            return Ok(None);
        }
        if let (true, Cache::Transformed) = (need_dx && factored_ok, &cache) {
            let dm = ops.aggregate_backward(g, l.index, &d_out, ex)?;
            let mut terms = vec![];
            match l.w_root {
                Some(r) => {
                    let (gw, gr) = ops.matmul_at_pair(h, &dm, &d_out)?;
                    set_grad!(ops, grads, l.w, gw);
                    set_grad!(ops, grads, r, gr);
                    terms.push((d_out, r));
                }
                None => {
                    let n_in = ops.dims(h).0;
                    set_grad!(ops, grads, l.w, Self::at_b(ops, h, &dm, n_in)?);
                    ops.recycle(d_out);
                }
            }
            terms.push((dm, l.w));
            return Ok(Some(Dx::Factored(terms)));
        }
        // the root weight reads the destinations' rows of the input (a prefix of it on a block); on a
        // partition its input gradient comes first, and the aggregation's is added to it
        let mut dx = None;
        let mut d_root = None;
        if let Some(r) = l.w_root {
            set_grad!(ops, grads, r, Self::at_b(ops, h, &d_out, n)?);
            if need_dx {
                let d = Self::a_bt(ops, &d_out, &self.params[r].value)?;
                if g.complete {
                    d_root = Some(d);
                } else {
                    dx = Some(d);
                }
            }
        }
        match cache {
            Cache::Aggregated(agg) => {
                let a = agg
                    .as_ref()
                    .or(self.input_agg.as_ref())
                    .expect("aggregation cached in forward");
                set_grad!(ops, grads, l.w, Self::at_b(ops, a, &d_out, n)?);
                if let Some(a) = agg {
                    ops.recycle(a);
                }
                if need_dx {
                    let d_agg = Self::a_bt(ops, &d_out, w)?;
                    let d_own = ops.aggregate_backward(g, l.index, &d_agg, ex)?;
                    ops.recycle(d_agg);
                    dx = Some(match dx {
                        Some(mut dx) => {
                            ops.add_assign(&mut dx, &d_own)?;
                            ops.recycle(d_own);
                            dx
                        }
                        None => d_own,
                    });
                }
            }
            Cache::Transformed => {
                let dm = ops.aggregate_backward(g, l.index, &d_out, ex)?;
                let n_in = ops.dims(&dm).0;
                set_grad!(ops, grads, l.w, Self::at_b(ops, h, &dm, n_in)?);
                if need_dx {
                    let (dmv, wt) = (View::full(&dm, n_in, hc), View::full(w, d_in, hc).t());
                    dx = Some(match dx {
                        Some(mut dx) => {
                            ops.gemm(dmv, wt, 1.0, &mut dx)?;
                            dx
                        }
                        None => Self::product(ops, dmv, wt)?,
                    });
                }
                ops.recycle(dm);
            }
            Cache::Gat { .. } | Cache::GatRemat { .. } | Cache::External => {
                unreachable!("handled above")
            }
        }
        ops.recycle(d_out);
        if let (Some(dx), Some(d)) = (&mut dx, &d_root) {
            ops.add_assign(dx, d)?;
        }
        if let Some(d) = d_root {
            ops.recycle(d);
        }
        Ok(dx.map(Dx::Dense))
    }

    #[allow(clippy::too_many_arguments)]
    fn gat_backward(
        &self,
        ops: &mut O,
        l: &LayerPlan,
        g: GraphView<'_, O>,
        h: &O::Mat,
        m_own: O::Mat,
        m_halo: Option<O::Mat>,
        s_dst: O::Mat,
        alpha: O::Mat,
        d_out: O::Mat,
        need_dx: bool,
        pass: Pass,
        grads: &mut [O::Mat],
        ex: &mut dyn Exchange,
    ) -> Result<Option<O::Mat>, O::Error> {
        let heads = l.heads;
        let width = l.hc() + heads;
        let n = g.n;
        let shape = self.gat_shape(l);
        // pass 1 per destination: d(score sum) per edge and head, the used attention, and d s_dst
        let mut d_score = ops.alloc(g.nnz, heads)?;
        let mut a_used = ops.alloc(g.nnz, heads)?;
        let mut ds_dst = ops.alloc(n, heads)?;
        ops.gat_backward_edges(
            g.op,
            &m_own,
            m_halo.as_ref(),
            &s_dst,
            &alpha,
            &d_out,
            g.gids,
            self.attn_dropout(l, pass),
            shape,
            &mut d_score,
            &mut a_used,
            &mut ds_dst,
        )?;
        ops.recycle(alpha);
        ops.recycle(s_dst);
        if let Some(m) = m_halo {
            ops.recycle(m);
        }
        // pass 2 per source over the transpose: [dZ_j | d s_src_j]
        let mut dm_ext = ops.alloc(g.n_src, width)?;
        ops.gat_backward_sources(g.op, &a_used, &d_score, &d_out, shape, &mut dm_ext)?;
        ops.recycle(d_score);
        ops.recycle(a_used);
        ops.recycle(d_out);
        let dm = ops.halo_backward(g, l.index, dm_ext, ex)?;
        self.gat_backward_tail(ops, l, g, h, m_own, dm, ds_dst, need_dx, grads)
    }

    /// The end of GAT's backward, once the gradients of the input rows' messages (`dm`, `[dZ | ds_src]`,
    /// peers' contributions included) and of `s_dst` are known: through the scores into `Z` and the
    /// attention vectors, then through `Z = h W`.
    #[allow(clippy::too_many_arguments)]
    fn gat_backward_tail(
        &self,
        ops: &mut O,
        l: &LayerPlan,
        g: GraphView<'_, O>,
        h: &O::Mat,
        m_own: O::Mat,
        dm: O::Mat,
        ds_dst: O::Mat,
        need_dx: bool,
        grads: &mut [O::Mat],
    ) -> Result<Option<O::Mat>, O::Error> {
        let (heads, c, hc) = (l.heads, l.head_dim, l.hc());
        let width = hc + heads;
        let n = g.n;
        let n_in = ops.dims(&m_own).0;
        let (ia, id) = l.att.expect("GAT layer has attention vectors");
        let mut dz = ops.alloc(n_in, hc)?;
        ops.gat_dz(
            &dm,
            &ds_dst,
            &self.params[ia].value,
            &self.params[id].value,
            self.gat_shape(l),
            &mut dz,
        )?;
        // head k's attention gradient is the diagonal block (k, k) of s^T Z (heads x hc)
        let mut full = ops.alloc(heads, hc)?;
        for (idx, s, rows) in [
            (ia, View::cols(&dm, n_in, hc, heads, width), n_in),
            (id, View::full(&ds_dst, n, heads), n),
        ] {
            ops.gemm(
                s.t(),
                View::cols(&m_own, rows, 0, hc, width),
                0.0,
                &mut full,
            )?;
            let mut ga = ops.alloc(heads, c)?;
            let diag = View {
                m: &full,
                offset: 0,
                rows: heads,
                cols: c,
                ld: hc + c,
                trans: false,
            };
            ops.copy2d(diag, &mut ga, 0, c)?;
            set_grad!(ops, grads, idx, ga);
        }
        ops.recycle(full);
        ops.recycle(dm);
        ops.recycle(ds_dst);
        ops.recycle(m_own);
        set_grad!(ops, grads, l.w, Self::at_b(ops, h, &dz, n_in)?);
        let dx = if need_dx {
            Some(Self::a_bt(ops, &dz, &self.params[l.w].value)?)
        } else {
            None
        };
        ops.recycle(dz);
        Ok(dx)
    }

    /// The first layer and its input slice after input dropout, checked for P3.
    fn p3_input(
        &self,
        ops: &mut O,
        g: GraphView<'_, O>,
        x_cols: &O::Mat,
        col0: usize,
        pass: Pass,
    ) -> Result<(&LayerPlan, O::Mat), O::Error> {
        let l = &self.layers[0];
        if l.kind == LayerKind::Gat {
            return Err(DeviceError::Unsupported(
                "model parallelism (P3) splits the first layer's product by input columns; GAT's attention \
                 needs whole rows, so use gcn or sage, or data or partition parallelism"
                    .into(),
            )
            .into());
        }
        let (rows, d) = ops.dims(x_cols);
        if rows != g.n_src || col0 + d > self.cfg.in_dim {
            return Err(shape_error(format!(
                "a column slice {col0}..{} of {rows} rows for a layer of {} inputs and {} source rows",
                col0 + d,
                self.cfg.in_dim,
                g.n_src
            )));
        }
        let mut x = ops.duplicate(x_cols)?;
        if let Pass::Train { epoch } = pass
            && self.cfg.input_dropout > 0.0
        {
            let drop = Dropout {
                key: self.dropout_key(epoch, 0),
                p: self.cfg.input_dropout,
            };
            ops.dropout(&mut x, g.gids, 0, col0, self.cfg.in_dim, drop)?;
        }
        Ok((l, x))
    }

    /// Rows `col0..col0 + d` of parameter `p` (`? x hc`).
    fn weight_rows(&self, p: usize, col0: usize, d: usize, hc: usize) -> View<'_, O::Mat> {
        View {
            m: &self.params[p].value,
            offset: col0 * hc,
            rows: d,
            cols: hc,
            ld: hc,
            trans: false,
        }
    }

    /// P3 model parallelism: the first layer's linear part (`A X W` and, for GraphSAGE, the root term)
    /// restricted to input columns `col0..col0 + x_cols.cols()`, for the destinations of `g` (a block, or the
    /// whole graph). `x_cols` holds those columns of every source row. Summing the results of all column
    /// slices gives the first layer's output before its bias.
    pub(crate) fn first_layer_partial_in(
        &self,
        ops: &mut O,
        g: GraphView<'_, O>,
        x_cols: &O::Mat,
        col0: usize,
        pass: Pass,
    ) -> Result<O::Mat, O::Error> {
        let (l, x) = self.p3_input(ops, g, x_cols, col0, pass)?;
        let (d, hc, n) = (ops.dims(&x).1, l.hc(), g.n);
        let w = self.weight_rows(l.w, col0, d, hc);
        let mut out = ops.alloc(n, hc)?;
        if d <= hc {
            let mut ax = ops.alloc(n, d)?;
            ops.spmm(g.op, &x, None, &mut ax)?;
            ops.gemm(View::full(&ax, n, d), w, 0.0, &mut out)?;
            ops.recycle(ax);
        } else {
            let mut xw = ops.alloc(g.n_src, hc)?;
            ops.gemm(View::full(&x, g.n_src, d), w, 0.0, &mut xw)?;
            ops.spmm(g.op, &xw, None, &mut out)?;
            ops.recycle(xw);
        }
        if let Some(r) = l.w_root {
            let wr = self.weight_rows(r, col0, d, hc);
            ops.gemm(View::full(&x, n, d), wr, 1.0, &mut out)?;
        }
        ops.recycle(x);
        Ok(out)
    }

    /// Gradients of the first layer's weight rows `col0..col0 + x_cols.cols()` from the gradient `d_z` of
    /// its output (as P3's backward returns it), added into `grads`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn first_layer_partial_backward_in(
        &self,
        ops: &mut O,
        g: GraphView<'_, O>,
        x_cols: &O::Mat,
        col0: usize,
        pass: Pass,
        d_z: &O::Mat,
        grads: &mut [O::Mat],
    ) -> Result<(), O::Error> {
        let (l, x) = self.p3_input(ops, g, x_cols, col0, pass)?;
        let (d, n) = (ops.dims(&x).1, g.n);
        let hc = ops.dims(d_z).1;
        let gw = if d <= hc {
            let mut ax = ops.alloc(n, d)?;
            ops.spmm(g.op, &x, None, &mut ax)?;
            let gw = Self::at_b(ops, &ax, d_z, n)?;
            ops.recycle(ax);
            gw
        } else {
            let mut t = ops.alloc(g.n_src, hc)?;
            ops.spmm_t(g.op, d_z, &mut t)?;
            let gw = Self::at_b(ops, &x, &t, g.n_src)?;
            ops.recycle(t);
            gw
        };
        ops.add_rows(&mut grads[l.w], col0, &gw)?;
        ops.recycle(gw);
        if let Some(r) = l.w_root {
            let gr = Self::at_b(ops, &x, d_z, n)?;
            ops.add_rows(&mut grads[r], col0, &gr)?;
            ops.recycle(gr);
        }
        ops.recycle(x);
        Ok(())
    }

    /// Continues from `opt`'s state (a resumed checkpoint): its step count and moments go to the device.
    pub fn restore_adam(&mut self, ops: &mut O, opt: &crate::Adam) -> Result<(), O::Error> {
        let (m, v) = opt.moments();
        let mut up = |bufs: &[Vec<f32>]| -> Result<Vec<O::Mat>, O::Error> {
            self.params
                .iter()
                .zip(bufs)
                .map(|(p, b)| {
                    let (r, c) = ops.dims(&p.value);
                    if b.len() != r * c {
                        return Err(shape_error(
                            "optimizer state does not match the model's parameters".into(),
                        ));
                    }
                    ops.upload(&Matrix::from_vec(r, c, b.clone()))
                })
                .collect()
        };
        let (m, v) = (up(m)?, up(v)?);
        if m.len() != self.params.len() || v.len() != self.params.len() {
            return Err(shape_error(
                "optimizer state does not match the model's parameters".into(),
            ));
        }
        self.adam = Some(AdamState {
            step: opt.steps(),
            m,
            v,
        });
        Ok(())
    }

    /// Copies the device's optimizer state into `opt` (for checkpoints); nothing before the first step.
    pub fn download_adam(&self, ops: &mut O, opt: &mut crate::Adam) -> Result<(), O::Error> {
        let Some(st) = &self.adam else {
            return Ok(());
        };
        let take = |ops: &mut O, ms: &[O::Mat]| -> Result<Vec<Vec<f32>>, O::Error> {
            ms.iter()
                .map(|m| ops.download(m).map(|h| h.data().to_vec()))
                .collect()
        };
        let (m, v) = (take(ops, &st.m)?, take(ops, &st.v)?);
        opt.restore(st.step, m, v).map_err(shape_error)
    }

    /// One Adam step (`crate::Adam::step`) on the device.
    pub fn adam_step(
        &mut self,
        ops: &mut O,
        grads: Vec<O::Mat>,
        cfg: AdamConfig,
    ) -> Result<(), O::Error> {
        if self.adam.is_none() {
            let mut m = Vec::with_capacity(self.params.len());
            let mut v = Vec::with_capacity(self.params.len());
            for p in &self.params {
                let (r, c) = ops.dims(&p.value);
                m.push(ops.zeros(r, c)?);
                v.push(ops.zeros(r, c)?);
            }
            self.adam = Some(AdamState { step: 0, m, v });
        }
        let st = self.adam.as_mut().expect("initialised above");
        st.step += 1;
        let s = AdamStep::new(
            st.step,
            cfg.lr,
            cfg.beta1,
            cfg.beta2,
            cfg.eps,
            cfg.weight_decay,
        );
        for (i, g) in grads.into_iter().enumerate() {
            ops.adam(&mut self.params[i].value, &g, &mut st.m[i], &mut st.v[i], s)?;
            ops.recycle(g);
        }
        Ok(())
    }

    /// One training epoch as `crate::train` runs it: forward (dropout keyed by `epoch`), the masked
    /// cross-entropy over `train` (normalised by its length), backward, Adam. Returns the mean loss.
    #[allow(clippy::too_many_arguments)]
    pub fn train_epoch(
        &mut self,
        ops: &mut O,
        g: &DeviceGraph<O>,
        x: &O::Mat,
        labels: &O::Labels,
        train: &O::Idx,
        n_train: usize,
        epoch: u64,
        adam: AdamConfig,
    ) -> Result<f64, O::Error> {
        let fwd = self.forward_ex(ops, g, x, Pass::Train { epoch }, &mut LocalExchange)?;
        let (r, c) = ops.dims(&fwd.logits);
        let mut d_logits = ops.alloc(r, c)?;
        let loss = ops.cross_entropy(&fwd.logits, labels, train, n_train as f64, &mut d_logits)?;
        let grads = self.backward_ex(ops, g, fwd, d_logits, &mut LocalExchange)?;
        self.adam_step(ops, grads, adam)?;
        Ok(loss / n_train as f64)
    }

    /// Correct predictions over each row set, in evaluation mode.
    pub fn evaluate(
        &mut self,
        ops: &mut O,
        g: &DeviceGraph<O>,
        x: &O::Mat,
        labels: &O::Labels,
        sets: &[&O::Idx],
    ) -> Result<Vec<u64>, O::Error> {
        self.evaluate_ex(ops, g, x, labels, sets, &mut LocalExchange)
    }

    /// [`DeviceModel::evaluate`] on a worker's part (this worker's rows only; the caller sums over workers).
    pub fn evaluate_ex(
        &mut self,
        ops: &mut O,
        g: &DeviceGraph<O>,
        x: &O::Mat,
        labels: &O::Labels,
        sets: &[&O::Idx],
        ex: &mut dyn Exchange,
    ) -> Result<Vec<u64>, O::Error> {
        let fwd = self.forward_ex(ops, g, x, Pass::Eval, ex)?;
        let out = sets
            .iter()
            .map(|rows| ops.correct(&fwd.logits, labels, rows))
            .collect::<Result<Vec<_>, _>>()?;
        let DeviceForward { inputs, logits, .. } = fwd;
        ops.recycle(logits);
        for i in inputs {
            if let Input::Owned(m) = i {
                ops.recycle(m);
            }
        }
        Ok(out)
    }
}

/// The host matrices of a forward pass (for tests and debugging).
pub fn download_all<O: Ops>(ops: &mut O, ms: &[O::Mat]) -> Result<Vec<Matrix>, O::Error> {
    ms.iter().map(|m| ops.download(m)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Activation;

    #[test]
    fn parameters_are_laid_out_as_saved_models_name_them() {
        for kind in [LayerKind::Gcn, LayerKind::Sage, LayerKind::Gat] {
            let mut cfg = ModelConfig::new(kind, 12, 5, 3);
            cfg.layers = 3;
            cfg.activation = Activation::Elu;
            let (layers, params) = plan(&cfg);
            let names: Vec<String> = params.into_iter().map(|p| p.0).collect();
            let mut want = vec![];
            for l in 0..3 {
                let per_kind: &[&str] = match kind {
                    LayerKind::Gcn => &["weight", "bias"],
                    LayerKind::Sage => &["weight", "root_weight", "bias"],
                    LayerKind::Gat => &["weight", "att_src", "att_dst", "bias"],
                };
                want.extend(per_kind.iter().map(|p| format!("layers.{l}.{p}")));
            }
            assert_eq!(names, want);
            assert_eq!(layers.len(), 3);
        }
    }
}
