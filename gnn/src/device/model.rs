//! [`crate::Model`]'s forward, backward and Adam step composed from [`Ops`]: the layer logic written once
//! for every device (the CPU's [`super::Cpu`], `physalia_gnn_cuda::CudaEngine`).
//!
//! Every step follows `model.rs` (layer order, which side of the product is aggregated, dropout keys, the
//! GAT split into messages, edge softmax and the two backward passes) and `optim.rs`, so the parameters,
//! logits, loss and gradients equal [`crate::Model`]'s up to float reordering: `physalia-gnn-cuda`'s
//! `tests/emulate.rs` checks that on [`super::Cpu`], its `tests/gpu.rs` on the GPU, and
//! `worker-image/tests/exactness.rs` / `minibatch.rs` on partitions and blocks.
//!
//! Partitions: a [`DeviceGraph::local`] holds a worker's owned rows and halo sources. At every aggregation the
//! owned messages go to the host, through [`Exchange::forward`], and the halo rows it returns come back as
//! the SpMM's second source buffer; backward sends the halo rows' gradients through [`Exchange::backward`]
//! and adds what peers computed for our rows; weight gradients are all-reduced on the host. Dropout and
//! attention dropout are keyed by global node ids, so every partitioning draws the masks of one worker.
//! With a local exchange (one worker, the whole graph) nothing leaves the device.

use crate::exchange::{Exchange, ExchangeError, LocalExchange};
use crate::model::{LocalGraph, Model, Pass};
use crate::rng::Stream;
use crate::sparse::{Norm, SparseOp};
use crate::tensor::Matrix;
use crate::{LayerKind, ModelConfig};

use super::{AdamStep, AttnDropout, DeviceError, Dropout, GatShape, Ops, View};

/// The key of `Stream::new(seed, parts)`, as the kernels take it.
fn stream_key(seed: u64, parts: &[u64]) -> u64 {
    Stream::new(seed, parts).key()
}

fn shape_error<E: From<DeviceError>>(what: String) -> E {
    DeviceError::Shape(what).into()
}

/// A layer's shape and parameter slots, as `Model::new` lays them out.
#[derive(Clone, Debug, PartialEq, Eq)]
struct LayerPlan {
    index: usize,
    kind: LayerKind,
    heads: usize,
    head_dim: usize,
    concat: bool,
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
}

/// The layer plans and parameter names of a configuration, in `Model::new`'s order.
fn plan(cfg: &ModelConfig) -> (Vec<LayerPlan>, Vec<String>) {
    let mut names = Vec::new();
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
        let mut add = |name: &str| {
            names.push(format!("layers.{index}.{name}"));
            names.len() - 1
        };
        let w = add("weight");
        let w_root = (cfg.kind == LayerKind::Sage).then(|| add("root_weight"));
        let att = (cfg.kind == LayerKind::Gat).then(|| (add("att_src"), add("att_dst")));
        let bias = add("bias");
        layers.push(LayerPlan {
            index,
            kind: cfg.kind,
            heads,
            head_dim,
            concat,
            aggregate_first: cfg.kind != LayerKind::Gat && d_in <= hc,
            w,
            w_root,
            att,
            bias,
        });
        d_in = if concat { hc } else { head_dim };
    }
    (layers, names)
}

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
        let op = SparseOp::build(n, n, indptr, indices, norm, None);
        Ok(DeviceGraph {
            n,
            n_src: n,
            nnz: op.nnz(),
            op: ops.upload_csr(&op)?,
            gids: None,
            complete: false,
        })
    }

    /// A worker's part of the graph as the CPU engine holds it (`LocalGraph` built for `kind`).
    pub fn local(ops: &mut O, g: &LocalGraph, kind: LayerKind) -> Result<DeviceGraph<O>, O::Error> {
        let op = g.op(kind);
        let gids = g.global_ids().map(|ids| ops.upload_idx(ids)).transpose()?;
        Ok(DeviceGraph {
            n: g.n_dst(),
            n_src: g.n_src(),
            nnz: op.nnz(),
            op: ops.upload_csr(op)?,
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
}

/// The graphs a pass runs over: one for every layer, or a sampled block per layer.
enum Graphs<'g, O: Ops> {
    Whole(&'g DeviceGraph<O>),
    Blocks(&'g [DeviceGraph<O>]),
}

// by hand: derived impls would ask `O: Copy`
impl<O: Ops> Clone for Graphs<'_, O> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<O: Ops> Copy for Graphs<'_, O> {}

impl<'g, O: Ops> Graphs<'g, O> {
    fn layer(self, l: usize) -> &'g DeviceGraph<O> {
        match self {
            Graphs::Whole(g) => g,
            Graphs::Blocks(b) => &b[l],
        }
    }

    /// Rows of layer `l`'s input: the owned rows, or every source of the block.
    fn input_rows(self, l: usize) -> usize {
        match self {
            Graphs::Whole(g) => g.n,
            Graphs::Blocks(b) => b[l].n_src,
        }
    }
}

fn exchange_error<E: From<DeviceError>>(e: ExchangeError) -> E {
    DeviceError::Exchange(e).into()
}

/// The halo rows of `layer`'s messages from the peers (`None`: no halo), given the owned rows on the device.
fn exchange_forward<O: Ops>(
    ops: &mut O,
    ex: &mut dyn Exchange,
    g: &DeviceGraph<O>,
    layer: usize,
    own: &O::Mat,
) -> Result<Option<O::Mat>, O::Error> {
    if ex.is_local() || g.complete {
        return Ok(None);
    }
    let host = ops.download(own)?;
    let Some(halo) = ex.forward(layer, &host).map_err(exchange_error)? else {
        return Ok(None);
    };
    if halo.shape() != (g.n_src - g.n, host.cols()) {
        return Err(shape_error(format!(
            "the exchange returned {}x{} halo rows, the partition has {} halo sources {} wide",
            halo.rows(),
            halo.cols(),
            g.n_src - g.n,
            host.cols()
        )));
    }
    Ok(Some(ops.upload(&halo)?))
}

/// The owned rows' gradient from the gradient over every source (`n_src` rows): the halo rows' part goes to
/// their owners, and what peers computed for our rows is added.
fn exchange_backward<O: Ops>(
    ops: &mut O,
    ex: &mut dyn Exchange,
    g: &DeviceGraph<O>,
    layer: usize,
    ext: O::Mat,
) -> Result<O::Mat, O::Error> {
    let (rows, cols) = ops.dims(&ext);
    if g.complete || (ex.is_local() && rows == g.n) {
        return Ok(ext);
    }
    let n = g.n;
    let rows_of = |m, offset, rows| View {
        m,
        offset,
        rows,
        cols,
        ld: cols,
        trans: false,
    };
    let mut own = ops.alloc(n, cols)?;
    ops.copy2d(rows_of(&ext, 0, n), &mut own, 0, cols)?;
    let halo = if rows > n {
        let mut h = ops.alloc(rows - n, cols)?;
        ops.copy2d(rows_of(&ext, n * cols, rows - n), &mut h, 0, cols)?;
        let host = ops.download(&h)?;
        ops.recycle(h);
        host
    } else {
        Matrix::zeros(0, cols)
    };
    ops.recycle(ext);
    if ex.is_local() {
        return Ok(own);
    }
    let mut from_peers = Matrix::zeros(n, cols);
    ex.backward(layer, halo, &mut from_peers)
        .map_err(exchange_error)?;
    let up = ops.upload(&from_peers)?;
    ops.add_assign(&mut own, &up)?;
    ops.recycle(up);
    Ok(own)
}

/// What backward needs from a layer's forward.
enum Cache<M> {
    /// `A H` (None: the model's cached `A X`).
    Aggregated(Option<M>),
    Transformed,
    Gat {
        m_own: M,
        m_halo: Option<M>,
        s_dst: M,
        alpha: M,
    },
}

enum Input<'x, M> {
    Borrowed(&'x M),
    Owned(M),
}

impl<M> Input<'_, M> {
    fn get(&self) -> &M {
        match self {
            Input::Borrowed(m) => m,
            Input::Owned(m) => m,
        }
    }
}

/// A layer's output and what its backward needs.
type LayerOut<O> = (<O as Ops>::Mat, Cache<<O as Ops>::Mat>);

/// Activations kept between forward and backward.
pub struct DeviceForward<'x, O: Ops> {
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
    names: Vec<String>,
    pub params: Vec<O::Mat>,
    adam: Option<AdamState<O::Mat>>,
    input_agg: Option<O::Mat>,
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
    /// Copies a CPU model's configuration and current parameters to the device.
    pub fn from_model(ops: &mut O, model: &Model) -> Result<DeviceModel<O>, O::Error> {
        let cfg = model.config().clone();
        let (layers, names) = plan(&cfg);
        let cpu_names: Vec<&str> = model.params.iter().map(|p| p.name.as_str()).collect();
        if cpu_names != names.iter().map(String::as_str).collect::<Vec<_>>() {
            return Err(shape_error(format!(
                "the engine's parameters {cpu_names:?} are not laid out as expected ({names:?})"
            )));
        }
        let params = model
            .params
            .iter()
            .map(|p| ops.upload(&p.value))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DeviceModel {
            cfg,
            seed: model.seed(),
            layers,
            names,
            params,
            adam: None,
            input_agg: None,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Parameter names, in the engine's order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Copies the parameters back into a CPU model of the same configuration.
    pub fn download_into(&self, ops: &mut O, model: &mut Model) -> Result<(), O::Error> {
        for (p, d) in model.params.iter_mut().zip(&self.params) {
            p.value = ops.download(d)?;
        }
        Ok(())
    }

    /// Forgets the cached `A X` (call when the graph or the features change), as `Model::clear_cache`.
    pub fn clear_cache(&mut self, ops: &mut O) {
        if let Some(m) = self.input_agg.take() {
            ops.recycle(m);
        }
    }

    fn first_aggregation_is_constant(&self, pass: Pass) -> bool {
        self.layers[0].aggregate_first && (self.cfg.input_dropout == 0.0 || pass == Pass::Eval)
    }

    fn dropout_key(&self, epoch: u64, layer: u64) -> u64 {
        stream_key(self.seed, &[0xD0, epoch, layer])
    }

    /// Forward over the whole graph; `x` is `n x in_dim`.
    pub fn forward<'x>(
        &mut self,
        ops: &mut O,
        g: &DeviceGraph<O>,
        x: &'x O::Mat,
        pass: Pass,
    ) -> Result<DeviceForward<'x, O>, O::Error> {
        self.forward_ex(ops, g, x, pass, &mut LocalExchange)
    }

    /// Forward over a worker's part: `x` holds the owned rows; halo rows come through `ex`.
    pub fn forward_ex<'x>(
        &mut self,
        ops: &mut O,
        g: &DeviceGraph<O>,
        x: &'x O::Mat,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<DeviceForward<'x, O>, O::Error> {
        self.forward_graphs(ops, Graphs::Whole(g), x, pass, ex)
    }

    /// Forward over sampled blocks (`Model::forward_blocks`): `x` holds block 0's source rows; the logits
    /// are the last block's destinations.
    pub fn forward_blocks<'x>(
        &mut self,
        ops: &mut O,
        blocks: &[DeviceGraph<O>],
        x: &'x O::Mat,
        pass: Pass,
    ) -> Result<DeviceForward<'x, O>, O::Error> {
        if blocks.len() != self.layers.len() {
            return Err(shape_error(format!(
                "{} blocks for {} layers",
                blocks.len(),
                self.layers.len()
            )));
        }
        self.forward_graphs(ops, Graphs::Blocks(blocks), x, pass, &mut LocalExchange)
    }

    fn forward_graphs<'x>(
        &mut self,
        ops: &mut O,
        gs: Graphs<'_, O>,
        x: &'x O::Mat,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<DeviceForward<'x, O>, O::Error> {
        let (rows, cols) = ops.dims(x);
        if (rows, cols) != (gs.input_rows(0), self.cfg.in_dim) {
            return Err(shape_error(format!(
                "input features are {rows}x{cols}, the model expects {}x{}",
                gs.input_rows(0),
                self.cfg.in_dim
            )));
        }
        let g = gs.layer(0);
        ex.begin_pass(pass);
        let whole = matches!(gs, Graphs::Whole(_));
        if whole && self.first_aggregation_is_constant(pass) && self.input_agg.is_none() {
            let halo = exchange_forward(ops, ex, g, 0, x)?;
            let mut agg = ops.alloc(g.n, cols)?;
            ops.spmm(&g.op, x, halo.as_ref(), &mut agg)?;
            if let Some(h) = halo {
                ops.recycle(h);
            }
            self.input_agg = Some(agg);
        }
        let input = match pass {
            Pass::Train { epoch } if self.cfg.input_dropout > 0.0 => {
                let mut xd = ops.duplicate(x)?;
                let d = Dropout {
                    key: self.dropout_key(epoch, 0),
                    p: self.cfg.input_dropout,
                };
                ops.dropout(&mut xd, g.gids.as_ref(), 0, 0, cols, d)?;
                Input::Owned(xd)
            }
            _ => Input::Borrowed(x),
        };
        let mut inputs = vec![input];
        let mut caches = Vec::with_capacity(self.layers.len());
        for li in 0..self.layers.len() {
            let l = self.layers[li].clone();
            let g = gs.layer(li);
            let (mut out, cache) =
                self.layer_forward(ops, &l, g, inputs[li].get(), pass, whole, ex)?;
            caches.push(cache);
            if li + 1 == self.layers.len() {
                return Ok(DeviceForward {
                    inputs,
                    caches,
                    logits: out,
                    pass,
                });
            }
            ops.activate(&mut out, self.cfg.activation)?;
            if let Pass::Train { epoch } = pass
                && self.cfg.dropout > 0.0
            {
                let cols = ops.dims(&out).1;
                let d = Dropout {
                    key: self.dropout_key(epoch, li as u64 + 1),
                    p: self.cfg.dropout,
                };
                ops.dropout(&mut out, g.gids.as_ref(), 0, 0, cols, d)?;
            }
            inputs.push(Input::Owned(out));
        }
        unreachable!("a model has at least one layer")
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        ops: &mut O,
        l: &LayerPlan,
        g: &DeviceGraph<O>,
        h: &O::Mat,
        pass: Pass,
        whole: bool,
        ex: &mut dyn Exchange,
    ) -> Result<LayerOut<O>, O::Error> {
        if l.kind == LayerKind::Gat {
            return self.gat_forward(ops, l, g, h, pass, ex);
        }
        // `n` destinations; the input has `n_in` rows (more than `n` on a block: every source)
        let n = g.n;
        let (n_in, d_in) = ops.dims(h);
        let hc = l.hc();
        let w = &self.params[l.w];
        let (mut out, cache) = if l.aggregate_first {
            let agg = if whole && l.index == 0 && self.first_aggregation_is_constant(pass) {
                None
            } else {
                let halo = exchange_forward(ops, ex, g, l.index, h)?;
                let mut a = ops.alloc(n, d_in)?;
                ops.spmm(&g.op, h, halo.as_ref(), &mut a)?;
                if let Some(h) = halo {
                    ops.recycle(h);
                }
                Some(a)
            };
            let a = match &agg {
                Some(a) => a,
                None => self
                    .input_agg
                    .as_ref()
                    .expect("input aggregation computed before layer 0"),
            };
            let mut out = ops.alloc(n, hc)?;
            ops.gemm(
                View::full(a, n, d_in),
                View::full(w, d_in, hc),
                0.0,
                &mut out,
            )?;
            (out, Cache::Aggregated(agg))
        } else {
            let mut m = ops.alloc(n_in, hc)?;
            ops.gemm(
                View::full(h, n_in, d_in),
                View::full(w, d_in, hc),
                0.0,
                &mut m,
            )?;
            let halo = exchange_forward(ops, ex, g, l.index, &m)?;
            let mut out = ops.alloc(n, hc)?;
            ops.spmm(&g.op, &m, halo.as_ref(), &mut out)?;
            ops.recycle(m);
            if let Some(h) = halo {
                ops.recycle(h);
            }
            (out, Cache::Transformed)
        };
        if let Some(r) = l.w_root {
            let wr = &self.params[r];
            ops.gemm(
                View::full(h, n, d_in),
                View::full(wr, d_in, hc),
                1.0,
                &mut out,
            )?;
        }
        ops.bias_add(&mut out, &self.params[l.bias])?;
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
        g: &DeviceGraph<O>,
        h: &O::Mat,
        pass: Pass,
        ex: &mut dyn Exchange,
    ) -> Result<LayerOut<O>, O::Error> {
        let (heads, hc) = (l.heads, l.hc());
        let (ia, id) = l.att.expect("GAT layer has attention vectors");
        let (n, d_in) = ops.dims(h);
        let shape = self.gat_shape(l);
        let mut z = ops.alloc(n, hc)?;
        ops.gemm(
            View::full(h, n, d_in),
            View::full(&self.params[l.w], d_in, hc),
            0.0,
            &mut z,
        )?;
        let mut m_own = ops.alloc(n, hc + heads)?;
        let mut s_dst = ops.alloc(n, heads)?;
        ops.gat_messages(
            &z,
            &self.params[ia],
            &self.params[id],
            shape,
            &mut m_own,
            &mut s_dst,
        )?;
        ops.recycle(z);
        let m_halo = exchange_forward(ops, ex, g, l.index, &m_own)?;
        let d_out = if l.concat { hc } else { l.head_dim };
        let mut alpha = ops.alloc(g.nnz, heads)?;
        let mut out = ops.alloc(g.n, d_out)?;
        ops.gat_forward(
            &g.op,
            &m_own,
            m_halo.as_ref(),
            &s_dst,
            g.gids.as_ref(),
            self.attn_dropout(l, pass),
            shape,
            &mut alpha,
            &mut out,
        )?;
        ops.bias_add(&mut out, &self.params[l.bias])?;
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

    /// Parameter gradients from the gradient of the mean loss with respect to the logits.
    pub fn backward(
        &self,
        ops: &mut O,
        g: &DeviceGraph<O>,
        fwd: DeviceForward<'_, O>,
        d_logits: O::Mat,
    ) -> Result<Vec<O::Mat>, O::Error> {
        self.backward_ex(ops, g, fwd, d_logits, &mut LocalExchange)
    }

    /// [`DeviceModel::backward`] of a worker's part: halo gradients go to their owners through `ex`, and the
    /// parameter gradients are all-reduced through it.
    pub fn backward_ex(
        &self,
        ops: &mut O,
        g: &DeviceGraph<O>,
        fwd: DeviceForward<'_, O>,
        d_logits: O::Mat,
        ex: &mut dyn Exchange,
    ) -> Result<Vec<O::Mat>, O::Error> {
        self.backward_graphs(ops, Graphs::Whole(g), fwd, d_logits, ex)
    }

    /// Backward of [`DeviceModel::forward_blocks`]; the parameter gradients are all-reduced through `ex`
    /// (data parallelism: every worker trained its share of the batch).
    pub fn backward_blocks(
        &self,
        ops: &mut O,
        blocks: &[DeviceGraph<O>],
        fwd: DeviceForward<'_, O>,
        d_logits: O::Mat,
        ex: &mut dyn Exchange,
    ) -> Result<Vec<O::Mat>, O::Error> {
        self.backward_graphs(ops, Graphs::Blocks(blocks), fwd, d_logits, ex)
    }

    /// Zero gradients of every parameter, all-reduced through `ex` (a worker with no seeds in a step).
    pub fn zero_grads(&self, ops: &mut O, ex: &mut dyn Exchange) -> Result<Vec<O::Mat>, O::Error> {
        let grads = self
            .params
            .iter()
            .map(|p| {
                let (r, c) = ops.dims(p);
                ops.zeros(r, c)
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.all_reduce(ops, grads, ex)
    }

    fn all_reduce(
        &self,
        ops: &mut O,
        mut grads: Vec<O::Mat>,
        ex: &mut dyn Exchange,
    ) -> Result<Vec<O::Mat>, O::Error> {
        if !ex.is_local() {
            let mut host = download_all(ops, &grads)?;
            ex.all_reduce(&mut host).map_err(exchange_error)?;
            for (d, h) in grads.iter_mut().zip(&host) {
                let up = ops.upload(h)?;
                ops.recycle(std::mem::replace(d, up));
            }
        }
        Ok(grads)
    }

    fn backward_graphs(
        &self,
        ops: &mut O,
        gs: Graphs<'_, O>,
        fwd: DeviceForward<'_, O>,
        d_logits: O::Mat,
        ex: &mut dyn Exchange,
    ) -> Result<Vec<O::Mat>, O::Error> {
        let DeviceForward {
            inputs,
            mut caches,
            pass,
            logits,
        } = fwd;
        ops.recycle(logits);
        let mut grads: Vec<Option<O::Mat>> = (0..self.params.len()).map(|_| None).collect();
        let epoch = match pass {
            Pass::Train { epoch } => epoch,
            Pass::Eval => 0,
        };
        let dropout = matches!(pass, Pass::Train { .. })
            .then_some(self.cfg.dropout)
            .filter(|&p| p > 0.0);
        let mut d_out = d_logits;
        let mut inputs = inputs;
        while let Some(cache) = caches.pop() {
            let li = caches.len();
            let l = &self.layers[li];
            let h = inputs.pop().expect("one input per layer");
            let g = gs.layer(li);
            let dx = self.layer_backward(
                ops,
                l,
                g,
                h.get(),
                cache,
                &d_out,
                li > 0,
                pass,
                &mut grads,
                ex,
            )?;
            ops.recycle(d_out);
            let y = match h {
                Input::Owned(m) if li > 0 => m,
                Input::Owned(m) => {
                    ops.recycle(m);
                    break;
                }
                Input::Borrowed(_) => break,
            };
            // the layer's input is the previous layer's output: `y` of the activation's backward
            let mut dx = dx.expect("hidden layers return their input gradient");
            let d = dropout.map(|p| Dropout {
                key: self.dropout_key(epoch, li as u64),
                p,
            });
            ops.activation_backward(&mut dx, &y, g.gids.as_ref(), 0, self.cfg.activation, d)?;
            ops.recycle(y);
            d_out = dx;
        }
        let grads = grads
            .into_iter()
            .enumerate()
            .map(|(i, g)| {
                g.ok_or_else(|| shape_error(format!("no gradient for {}", self.names[i])))
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.all_reduce(ops, grads, ex)
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_backward(
        &self,
        ops: &mut O,
        l: &LayerPlan,
        g: &DeviceGraph<O>,
        h: &O::Mat,
        cache: Cache<O::Mat>,
        d_out: &O::Mat,
        need_dx: bool,
        pass: Pass,
        grads: &mut [Option<O::Mat>],
        ex: &mut dyn Exchange,
    ) -> Result<Option<O::Mat>, O::Error> {
        // `n` destinations (d_out's rows); the input has `n_in` rows (every source on a block)
        let n = g.n;
        let (n_in, d_in) = ops.dims(h);
        let d_o = ops.dims(d_out).1;
        let mut gb = ops.alloc(1, d_o)?;
        ops.col_sums(d_out, &mut gb)?;
        grads[l.bias] = Some(gb);
        if let Cache::Gat {
            m_own,
            m_halo,
            s_dst,
            alpha,
        } = cache
        {
            return self.gat_backward(
                ops, l, g, h, m_own, m_halo, s_dst, alpha, d_out, need_dx, pass, grads, ex,
            );
        }
        let hc = l.hc();
        let w = &self.params[l.w];
        // the root weight reads the destinations' rows of the input (a prefix of it on a block)
        let mut d_root = None;
        if let Some(r) = l.w_root {
            let mut gr = ops.alloc(d_in, hc)?;
            ops.gemm(
                View::full(h, n, d_in).t(),
                View::full(d_out, n, hc),
                0.0,
                &mut gr,
            )?;
            grads[r] = Some(gr);
            if need_dx {
                let mut d = ops.alloc(n, d_in)?;
                let wr = &self.params[r];
                ops.gemm(
                    View::full(d_out, n, hc),
                    View::full(wr, d_in, hc).t(),
                    0.0,
                    &mut d,
                )?;
                d_root = Some(d);
            }
        }
        let mut dx = None;
        match cache {
            Cache::Gat { .. } => unreachable!("handled above"),
            Cache::Aggregated(agg) => {
                let a = agg
                    .as_ref()
                    .or(self.input_agg.as_ref())
                    .expect("aggregation cached in forward");
                let mut gw = ops.alloc(d_in, hc)?;
                ops.gemm(
                    View::full(a, n, d_in).t(),
                    View::full(d_out, n, hc),
                    0.0,
                    &mut gw,
                )?;
                grads[l.w] = Some(gw);
                if need_dx {
                    let mut d_agg = ops.alloc(n, d_in)?;
                    ops.gemm(
                        View::full(d_out, n, hc),
                        View::full(w, d_in, hc).t(),
                        0.0,
                        &mut d_agg,
                    )?;
                    let mut d_ext = ops.alloc(g.n_src, d_in)?;
                    ops.spmm_t(&g.op, &d_agg, &mut d_ext)?;
                    ops.recycle(d_agg);
                    dx = Some(exchange_backward(ops, ex, g, l.index, d_ext)?);
                }
                if let Some(a) = agg {
                    ops.recycle(a);
                }
            }
            Cache::Transformed => {
                let mut dm_ext = ops.alloc(g.n_src, hc)?;
                ops.spmm_t(&g.op, d_out, &mut dm_ext)?;
                let dm = exchange_backward(ops, ex, g, l.index, dm_ext)?;
                let mut gw = ops.alloc(d_in, hc)?;
                ops.gemm(
                    View::full(h, n_in, d_in).t(),
                    View::full(&dm, n_in, hc),
                    0.0,
                    &mut gw,
                )?;
                grads[l.w] = Some(gw);
                if need_dx {
                    let mut d = ops.alloc(n_in, d_in)?;
                    ops.gemm(
                        View::full(&dm, n_in, hc),
                        View::full(w, d_in, hc).t(),
                        0.0,
                        &mut d,
                    )?;
                    dx = Some(d);
                }
                ops.recycle(dm);
            }
        }
        if let (Some(dx), Some(d)) = (&mut dx, &d_root) {
            ops.add_assign(dx, d)?;
        }
        if let Some(d) = d_root {
            ops.recycle(d);
        }
        Ok(dx)
    }

    #[allow(clippy::too_many_arguments)]
    fn gat_backward(
        &self,
        ops: &mut O,
        l: &LayerPlan,
        g: &DeviceGraph<O>,
        h: &O::Mat,
        m_own: O::Mat,
        m_halo: Option<O::Mat>,
        s_dst: O::Mat,
        alpha: O::Mat,
        d_out: &O::Mat,
        need_dx: bool,
        pass: Pass,
        grads: &mut [Option<O::Mat>],
        ex: &mut dyn Exchange,
    ) -> Result<Option<O::Mat>, O::Error> {
        let (heads, c, hc) = (l.heads, l.head_dim, l.hc());
        let width = hc + heads;
        let (n_in, d_in) = ops.dims(h);
        let n = g.n;
        let shape = self.gat_shape(l);
        let (ia, id) = l.att.expect("GAT layer has attention vectors");
        // pass 1 per destination, pass 2 per source over the transpose
        let mut d_score = ops.alloc(g.nnz, heads)?;
        let mut a_used = ops.alloc(g.nnz, heads)?;
        let mut ds_dst = ops.alloc(n, heads)?;
        ops.gat_backward_edges(
            &g.op,
            &m_own,
            m_halo.as_ref(),
            &s_dst,
            &alpha,
            d_out,
            g.gids.as_ref(),
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
        let mut dm_ext = ops.alloc(g.n_src, width)?;
        ops.gat_backward_sources(&g.op, &a_used, &d_score, d_out, shape, &mut dm_ext)?;
        let dm = exchange_backward(ops, ex, g, l.index, dm_ext)?;
        ops.recycle(d_score);
        ops.recycle(a_used);
        // through the scores into Z and the attention vectors
        let mut dz = ops.alloc(n_in, hc)?;
        ops.gat_dz(
            &dm,
            &ds_dst,
            &self.params[ia],
            &self.params[id],
            shape,
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
            grads[idx] = Some(ga);
        }
        ops.recycle(full);
        ops.recycle(dm);
        ops.recycle(ds_dst);
        ops.recycle(m_own);
        let mut gw = ops.alloc(d_in, hc)?;
        ops.gemm(
            View::full(h, n_in, d_in).t(),
            View::full(&dz, n_in, hc),
            0.0,
            &mut gw,
        )?;
        grads[l.w] = Some(gw);
        let dx = if need_dx {
            let mut d = ops.alloc(n_in, d_in)?;
            let w = &self.params[l.w];
            ops.gemm(
                View::full(&dz, n_in, hc),
                View::full(w, d_in, hc).t(),
                0.0,
                &mut d,
            )?;
            Some(d)
        } else {
            None
        };
        ops.recycle(dz);
        Ok(dx)
    }

    /// Continues from `opt`'s state (a resumed checkpoint): its step count and moments go to the device.
    pub fn restore_adam(&mut self, ops: &mut O, opt: &crate::Adam) -> Result<(), O::Error> {
        let (m, v) = opt.moments();
        let mut up = |bufs: &[Vec<f32>]| -> Result<Vec<O::Mat>, O::Error> {
            self.params
                .iter()
                .zip(bufs)
                .map(|(p, b)| {
                    let (r, c) = ops.dims(p);
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
                let (r, c) = ops.dims(p);
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
            ops.adam(&mut self.params[i], &g, &mut st.m[i], &mut st.v[i], s)?;
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
        let fwd = self.forward(ops, g, x, Pass::Train { epoch })?;
        let (r, c) = ops.dims(&fwd.logits);
        let mut d_logits = ops.alloc(r, c)?;
        let loss = ops.cross_entropy(&fwd.logits, labels, train, n_train as f64, &mut d_logits)?;
        let grads = self.backward(ops, g, fwd, d_logits)?;
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
    fn plans_match_the_engine_layout() {
        for kind in [LayerKind::Gcn, LayerKind::Sage, LayerKind::Gat] {
            let mut cfg = ModelConfig::new(kind, 12, 5, 3);
            cfg.layers = 3;
            cfg.activation = Activation::Elu;
            let model = Model::new(&cfg, 1).unwrap();
            let (_, names) = plan(&cfg);
            let cpu: Vec<String> = model.params.iter().map(|p| p.name.clone()).collect();
            assert_eq!(names, cpu);
        }
    }
}
