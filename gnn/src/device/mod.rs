//! The device seam: the operations a GNN layer needs, as one trait ([`Ops`]) that every device implements,
//! in the manner of candle's backend traits.
//!
//! Implementations: [`Cpu`] (host memory, this crate's rayon kernels: `sparse`, `dense`, the GAT kernels of
//! `gat`, SAR's per-range kernels) and `physalia_gnn_cuda::CudaEngine` (device memory, NVRTC kernels,
//! cuBLAS). [`DeviceModel`] composes a GCN / GraphSAGE / GAT forward, backward and Adam step from these
//! operations once, generic over the trait: [`crate::Model`] is `DeviceModel<Cpu>`, so the code that runs on
//! the GPU is the code every CPU worker trains with.
//!
//! The trait has two levels. The primitives (products on strided views, SpMM, the GAT kernels, elementwise,
//! loss, Adam) are what a device must implement. The layer-level operations after them (the aggregation with
//! its exchange of halo rows, `H [W | W_root]` as one product, the fused first-layer backward, SAR's GAT,
//! a column slice's weight gradient) have default implementations composed of the primitives (`defaults.rs`);
//! a device overrides one where it has a faster kernel or a smaller footprint, as [`Cpu`] does with the
//! engine's row-block and per-range kernels.
//!
//! The trait lives in the base crate so that a device crate only adds kernels: the plan types the kernels
//! take ([`View`], [`GatShape`], [`Dropout`], [`AttnDropout`], [`AdamStep`], [`GraphView`], [`GatRemat`]) and
//! the shape checks shared by every implementation are here too. Each device has its own error type; it must
//! hold a [`DeviceError`] (shapes, the exchange, an unsupported configuration), which is what the generic
//! model code raises.

mod cpu;
mod defaults;
pub(crate) mod model;
mod sar;
mod train;

pub use cpu::{Cpu, CpuPrimitives};
pub use model::{
    AdamConfig, DeviceForward, DeviceGraph, DeviceModel, GraphView, download_all, keeps_input_halo,
};
pub use train::train_resumable_on;

use std::sync::Arc;

use crate::Activation;
use crate::exchange::{Exchange, ExchangeError, HaloSeed};
use crate::rng::drop_threshold;
use crate::sparse::SparseOp;
use crate::tensor::Matrix;

/// What the generic layer code and the shared checks raise; every device's error type holds it.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("exchange with peers failed: {0}")]
    Exchange(ExchangeError),
    #[error("{0}")]
    Unsupported(String),
}

impl From<DeviceError> for crate::Error {
    fn from(e: DeviceError) -> Self {
        match e {
            DeviceError::Shape(s) => crate::Error::Shape(s),
            DeviceError::Exchange(e) => crate::Error::Exchange(e),
            DeviceError::Unsupported(s) => crate::Error::Config(s),
        }
    }
}

/// A dense operand of a product: rows x cols elements of `m` starting at `offset`, `ld` apart between rows
/// (row-major), optionally transposed.
#[derive(Debug)]
pub struct View<'a, M> {
    pub m: &'a M,
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
    pub trans: bool,
}

impl<'a, M> View<'a, M> {
    /// The whole `rows x cols` matrix.
    pub fn full(m: &'a M, rows: usize, cols: usize) -> View<'a, M> {
        View {
            m,
            offset: 0,
            rows,
            cols,
            ld: cols,
            trans: false,
        }
    }

    /// Columns `col0..col0 + cols` of the first `rows` rows of a matrix `ld` wide.
    pub fn cols(m: &'a M, rows: usize, col0: usize, cols: usize, ld: usize) -> View<'a, M> {
        View {
            m,
            offset: col0,
            rows,
            cols,
            ld,
            trans: false,
        }
    }

    pub fn t(mut self) -> View<'a, M> {
        self.trans = !self.trans;
        self
    }

    /// Shape after the transpose.
    pub fn op_shape(&self) -> (usize, usize) {
        if self.trans {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }
}

/// Attention dropout of a GAT layer: the stream key and the rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnDropout {
    pub key: u64,
    pub p: f32,
}

impl AttnDropout {
    /// (key, 32-bit threshold, scale) as the kernels take them.
    pub fn kernel_args(self) -> (u64, u32, f32) {
        (self.key, drop_threshold(self.p), 1.0 / (1.0 - self.p))
    }
}

/// Dropout of activations: the stream key and the rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    pub key: u64,
    pub p: f32,
}

/// Shape of a GAT layer: heads, per-head width, concatenated or averaged heads, LeakyReLU slope.
#[derive(Clone, Copy, Debug)]
pub struct GatShape {
    pub heads: u32,
    pub c: u32,
    pub concat: bool,
    pub slope: f32,
}

impl GatShape {
    /// Output width: the heads concatenated, or one head's width when they are averaged.
    pub fn d_out(&self) -> usize {
        (if self.concat {
            self.heads * self.c
        } else {
            self.c
        }) as usize
    }
}

/// Scalars of one Adam step, computed on the host exactly as `optim.rs` does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    pub step_size: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub bc2_sqrt: f32,
}

impl AdamStep {
    /// Step `t` (1-based) with `optim.rs`'s arithmetic.
    pub fn new(t: u64, lr: f32, beta1: f32, beta2: f32, eps: f32, weight_decay: f32) -> AdamStep {
        let t = t as i32;
        let bc1 = 1.0 - beta1.powi(t);
        let bc2 = 1.0 - beta2.powi(t);
        AdamStep {
            step_size: lr / bc1,
            beta1,
            beta2,
            eps,
            weight_decay,
            bc2_sqrt: bc2.sqrt(),
        }
    }
}

/// What SAR's GAT keeps between forward and backward instead of the halo messages and the attention
/// coefficients: the halo rows' scores (`n_halo x heads`) and each destination's softmax maximum and sum per
/// head (`n x heads` each). A device whose forward recomputes everything in backward leaves them empty.
pub struct GatRemat<M> {
    pub s_halo: M,
    pub row_max: M,
    pub row_sum: M,
}

/// The first layer's gradients from [`Ops::fused_first_backward`].
pub struct FirstLayerGrads<M> {
    pub w: M,
    /// GraphSAGE's root weight.
    pub w_root: Option<M>,
    pub bias: M,
}

/// Everything the layers need from a device. Shapes are checked by the implementations; on the GPU all sizes
/// must fit the kernels' 32-bit indices.
pub trait Ops: Sized {
    /// A dense row-major f32 matrix in the device's memory.
    type Mat;
    /// A sparse operator with its transpose.
    type Csr;
    /// A list of u32 (row ids, global ids).
    type Idx;
    /// Class labels.
    type Labels;
    /// The device's error; shape and exchange failures of the generic code arrive as a [`DeviceError`].
    type Error: From<DeviceError> + std::error::Error;

    fn dims(&self, m: &Self::Mat) -> (usize, usize);
    fn upload(&mut self, m: &Matrix) -> Result<Self::Mat, Self::Error>;
    /// Like [`Ops::upload`], handing the host matrix over (the host device keeps it without a copy).
    fn upload_owned(&mut self, m: Matrix) -> Result<Self::Mat, Self::Error> {
        self.upload(&m)
    }
    fn download(&mut self, m: &Self::Mat) -> Result<Matrix, Self::Error>;
    /// Contents unspecified: for outputs a kernel writes in full.
    fn alloc(&mut self, rows: usize, cols: usize) -> Result<Self::Mat, Self::Error>;
    fn zeros(&mut self, rows: usize, cols: usize) -> Result<Self::Mat, Self::Error>;
    /// Hands a buffer back for reuse by a later `alloc` of the same size.
    fn recycle(&mut self, m: Self::Mat);
    /// Hands back a buffer nothing allocates again before the pass's peak: a device may return its memory
    /// to the system rather than keep it for reuse.
    fn release(&mut self, m: Self::Mat) {
        self.recycle(m)
    }
    fn upload_csr(&mut self, op: &SparseOp) -> Result<Self::Csr, Self::Error>;
    /// Like [`Ops::upload_csr`] for an operator the host keeps (the host device shares it without a copy).
    fn share_csr(&mut self, op: &Arc<SparseOp>) -> Result<Self::Csr, Self::Error> {
        self.upload_csr(op)
    }
    fn upload_idx(&mut self, v: &[u32]) -> Result<Self::Idx, Self::Error>;
    fn upload_labels(&mut self, v: &[i64]) -> Result<Self::Labels, Self::Error>;

    /// `C = op(A) op(B) + beta C` (beta 0 or 1).
    fn gemm(
        &mut self,
        a: View<'_, Self::Mat>,
        b: View<'_, Self::Mat>,
        beta: f32,
        c: &mut Self::Mat,
    ) -> Result<(), Self::Error>;
    /// `Y = A [own; halo]` over the CSR.
    fn spmm(
        &mut self,
        a: &Self::Csr,
        own: &Self::Mat,
        halo: Option<&Self::Mat>,
        y: &mut Self::Mat,
    ) -> Result<(), Self::Error>;
    /// `Y = A^T X` over the explicit transpose.
    fn spmm_t(
        &mut self,
        a: &Self::Csr,
        x: &Self::Mat,
        y: &mut Self::Mat,
    ) -> Result<(), Self::Error>;

    /// `m = [Z | s_src]`, `s_dst`, from `z` and the attention vectors (`heads x c` each).
    fn gat_messages(
        &mut self,
        z: &Self::Mat,
        a_src: &Self::Mat,
        a_dst: &Self::Mat,
        shape: GatShape,
        m: &mut Self::Mat,
        s_dst: &mut Self::Mat,
    ) -> Result<(), Self::Error>;
    #[allow(clippy::too_many_arguments)]
    fn gat_forward(
        &mut self,
        a: &Self::Csr,
        m_own: &Self::Mat,
        m_halo: Option<&Self::Mat>,
        s_dst: &Self::Mat,
        gids: Option<&Self::Idx>,
        drop: Option<AttnDropout>,
        shape: GatShape,
        alpha: &mut Self::Mat,
        out: &mut Self::Mat,
    ) -> Result<(), Self::Error>;
    #[allow(clippy::too_many_arguments)]
    fn gat_backward_edges(
        &mut self,
        a: &Self::Csr,
        m_own: &Self::Mat,
        m_halo: Option<&Self::Mat>,
        s_dst: &Self::Mat,
        alpha: &Self::Mat,
        d_out: &Self::Mat,
        gids: Option<&Self::Idx>,
        drop: Option<AttnDropout>,
        shape: GatShape,
        d_score: &mut Self::Mat,
        a_used: &mut Self::Mat,
        ds_dst: &mut Self::Mat,
    ) -> Result<(), Self::Error>;
    fn gat_backward_sources(
        &mut self,
        a: &Self::Csr,
        a_used: &Self::Mat,
        d_score: &Self::Mat,
        d_out: &Self::Mat,
        shape: GatShape,
        dm: &mut Self::Mat,
    ) -> Result<(), Self::Error>;
    fn gat_dz(
        &mut self,
        dm: &Self::Mat,
        ds_dst: &Self::Mat,
        a_src: &Self::Mat,
        a_dst: &Self::Mat,
        shape: GatShape,
        dz: &mut Self::Mat,
    ) -> Result<(), Self::Error>;

    fn bias_add(&mut self, x: &mut Self::Mat, bias: &Self::Mat) -> Result<(), Self::Error>;
    fn activate(&mut self, x: &mut Self::Mat, act: Activation) -> Result<(), Self::Error>;
    /// Inverted dropout keyed by `gid(row0 + r) * total_cols + col0 + col` (gid = row without `gids`).
    #[allow(clippy::too_many_arguments)]
    fn dropout(
        &mut self,
        x: &mut Self::Mat,
        gids: Option<&Self::Idx>,
        row0: usize,
        col0: usize,
        total_cols: usize,
        d: Dropout,
    ) -> Result<(), Self::Error>;
    /// A hidden layer's epilogue, `x = dropout(act(x + bias))`: the mask keyed as [`Ops::dropout`] keys a
    /// whole matrix (`row0` and `col0` 0, `total_cols` its width). The default runs the three operations; an
    /// engine that fuses them reads and writes `x` once instead of three times.
    fn bias_activate_dropout(
        &mut self,
        x: &mut Self::Mat,
        bias: &Self::Mat,
        act: Activation,
        gids: Option<&Self::Idx>,
        d: Option<Dropout>,
    ) -> Result<(), Self::Error> {
        self.bias_add(x, bias)?;
        self.activate(x, act)?;
        if let Some(d) = d {
            let cols = self.dims(x).1;
            self.dropout(x, gids, 0, 0, cols, d)?;
        }
        Ok(())
    }
    /// Bytes of the row blocks the layer-level defaults form a dropped-out input in, a block at a time
    /// ([`Ops::gemm_dropped_add`], the root weight's gradient in [`Ops::fused_first_backward`]): 4 MiB keeps a
    /// CPU's block in its caches; a GPU wants fewer, larger launches.
    fn dropped_block_bytes(&self) -> usize {
        4 << 20
    }
    /// `dy` through `y = dropout(act(z))` into the gradient of `z`.
    fn activation_backward(
        &mut self,
        dy: &mut Self::Mat,
        y: &Self::Mat,
        gids: Option<&Self::Idx>,
        row0: usize,
        act: Activation,
        d: Option<Dropout>,
    ) -> Result<(), Self::Error>;
    /// [`Ops::activation_backward`] with the result written over rows `row0..row0 + dy.rows()` of `y` (a
    /// matrix as wide as `dy`, `row0` also its offset into `gids`): each activation is read once, then
    /// replaced by its gradient, so a pass over row blocks needs no copy of them. `dy` is left unspecified.
    #[allow(clippy::too_many_arguments)]
    fn activation_backward_over(
        &mut self,
        dy: &mut Self::Mat,
        y: &mut Self::Mat,
        gids: Option<&Self::Idx>,
        row0: usize,
        act: Activation,
        d: Option<Dropout>,
    ) -> Result<(), Self::Error> {
        defaults::activation_backward_over(self, dy, y, gids, row0, act, d)
    }
    /// `a += b`; `b` may have fewer rows than `a` (of the same width): it adds into `a`'s first rows.
    fn add_assign(&mut self, a: &mut Self::Mat, b: &Self::Mat) -> Result<(), Self::Error>;
    /// `out (1 x cols) = column sums of x`.
    fn col_sums(&mut self, x: &Self::Mat, out: &mut Self::Mat) -> Result<(), Self::Error>;
    /// Copies a (non-transposed) view into `dst` starting at element `dst_offset`, rows `dst_ld` apart.
    fn copy2d(
        &mut self,
        src: View<'_, Self::Mat>,
        dst: &mut Self::Mat,
        dst_offset: usize,
        dst_ld: usize,
    ) -> Result<(), Self::Error>;
    /// Rows `idx` of `src`, packed.
    fn gather_rows(
        &mut self,
        src: &Self::Mat,
        idx: &Self::Idx,
        dst: &mut Self::Mat,
    ) -> Result<(), Self::Error>;
    /// Sum of the cross-entropy over `rows`, and the gradient of `sum / normalizer` into `grad` (zero on
    /// other rows).
    fn cross_entropy(
        &mut self,
        logits: &Self::Mat,
        labels: &Self::Labels,
        rows: &Self::Idx,
        normalizer: f64,
        grad: &mut Self::Mat,
    ) -> Result<f64, Self::Error>;
    /// Rows of `rows` whose first arg-max equals the label.
    fn correct(
        &mut self,
        logits: &Self::Mat,
        labels: &Self::Labels,
        rows: &Self::Idx,
    ) -> Result<u64, Self::Error>;
    fn adam(
        &mut self,
        w: &mut Self::Mat,
        g: &Self::Mat,
        m: &mut Self::Mat,
        v: &mut Self::Mat,
        s: AdamStep,
    ) -> Result<(), Self::Error>;
    /// Waits for queued work (a no-op on the host).
    fn synchronize(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Returns every recycled buffer to the device's allocator: shapes that change every step (sampled
    /// mini-batches) would otherwise each keep a cached buffer of their own.
    fn release_cached(&mut self) {}

    /// A copy of `m`.
    fn duplicate(&mut self, m: &Self::Mat) -> Result<Self::Mat, Self::Error> {
        let (r, c) = self.dims(m);
        let mut out = self.alloc(r, c)?;
        self.copy2d(View::full(m, r, c), &mut out, 0, c)?;
        Ok(out)
    }

    /// `m`'s memory as a `rows x cols` matrix whose contents are unspecified: a buffer that changes shape
    /// without being freed and allocated again (the first layer's dropped-out input lives in the buffer its
    /// output takes next). The default releases `m` to the device's allocator ([`Ops::release`], not the
    /// pool: nothing of its shape is asked for again in the epoch) and allocates.
    fn reuse_as(
        &mut self,
        m: Self::Mat,
        rows: usize,
        cols: usize,
    ) -> Result<Self::Mat, Self::Error> {
        self.release(m);
        self.alloc(rows, cols)
    }

    /// `a[row0..row0 + b.rows()] += b` (a column slice's weight gradient, P3).
    fn add_rows(
        &mut self,
        a: &mut Self::Mat,
        row0: usize,
        b: &Self::Mat,
    ) -> Result<(), Self::Error> {
        defaults::add_rows(self, a, row0, b)
    }

    // The layer-level operations: defaults in `defaults.rs`, composed of the primitives above.

    /// The halo rows of `layer`'s messages from the peers, given the owned rows `own` (`None`: no halo, a
    /// local exchange, or a block whose input holds every source). With a rematerialising exchange the rows
    /// arrive one range at a time and are put together.
    fn halo_rows(
        &mut self,
        g: GraphView<'_, Self>,
        layer: usize,
        own: &Self::Mat,
        ex: &mut dyn Exchange,
    ) -> Result<Option<Self::Mat>, Self::Error> {
        defaults::halo_rows(self, g, layer, own, ex)
    }

    /// [`Ops::halo_rows`] of an evaluation pass through [`Exchange::forward_seeded`]: the rows `seed` holds
    /// are not fetched. Not for a rematerialising exchange (it keeps no halo rows).
    fn seeded_halo_rows(
        &mut self,
        g: GraphView<'_, Self>,
        layer: usize,
        own: &Self::Mat,
        ex: &mut dyn Exchange,
        seed: &HaloSeed,
    ) -> Result<Option<Self::Mat>, Self::Error> {
        defaults::seeded_halo_rows(self, g, layer, own, ex, seed)
    }

    /// The owned rows' gradient from `ext`, a gradient over every source row: the halo rows' part goes to
    /// their owners through `ex`, and what peers computed for our rows is added.
    fn halo_backward(
        &mut self,
        g: GraphView<'_, Self>,
        layer: usize,
        ext: Self::Mat,
        ex: &mut dyn Exchange,
    ) -> Result<Self::Mat, Self::Error> {
        defaults::halo_backward(self, g, layer, ext, ex)
    }

    /// `A [own; halo]` of `layer`, the halo rows through `ex` (none on a block: `own` has every source).
    fn aggregate(
        &mut self,
        g: GraphView<'_, Self>,
        layer: usize,
        own: &Self::Mat,
        ex: &mut dyn Exchange,
    ) -> Result<Self::Mat, Self::Error> {
        defaults::aggregate(self, g, layer, own, ex)
    }

    /// The owned rows of `A^T d` (every source on a block), the halo rows' part sent to their owners through
    /// `ex` and what peers computed for our rows added.
    fn aggregate_backward(
        &mut self,
        g: GraphView<'_, Self>,
        layer: usize,
        d: &Self::Mat,
        ex: &mut dyn Exchange,
    ) -> Result<Self::Mat, Self::Error> {
        defaults::aggregate_backward(self, g, layer, d, ex)
    }

    /// `(H W, H W_root)`, which a device may compute as one product `H [W | W_root]` that reads `H` once.
    fn linear_pair(
        &mut self,
        h: &Self::Mat,
        w: &Self::Mat,
        w_root: &Self::Mat,
    ) -> Result<(Self::Mat, Self::Mat), Self::Error> {
        defaults::linear_pair(self, h, w, w_root)
    }

    /// `(H^T A, H^T B)`, which a device may compute as one product `H^T [A | B]`.
    fn matmul_at_pair(
        &mut self,
        h: &Self::Mat,
        a: &Self::Mat,
        b: &Self::Mat,
    ) -> Result<(Self::Mat, Self::Mat), Self::Error> {
        defaults::matmul_at_pair(self, h, a, b)
    }

    /// The first layer's gradients (weight, root weight when `x_root` is its input, bias) when it
    /// aggregated its input (`agg = A X`) and its output gradient is `sum_t A_t W_t^T` (`terms`, the second
    /// layer's factors) through the activation and dropout whose output is `h1`, which this consumes (the
    /// hidden layer is not read again). The hidden-width gradient need never exist beside it: a device may
    /// form and consume it a row block at a time, or write it over `h1` a row block at a time.
    /// `x_root_dropout`: the root weight's input is `dropout(x_root)` (input dropout, keyed by `gids` as
    /// [`Ops::dropout`] keys it), drawn again a row block at a time instead of held as a copy.
    #[allow(clippy::too_many_arguments)]
    fn fused_first_backward(
        &mut self,
        agg: &Self::Mat,
        x_root: Option<&Self::Mat>,
        x_root_dropout: Option<Dropout>,
        h1: Self::Mat,
        terms: &[(&Self::Mat, &Self::Mat)],
        gids: Option<&Self::Idx>,
        act: Activation,
        dropout: Option<Dropout>,
    ) -> Result<FirstLayerGrads<Self::Mat>, Self::Error> {
        defaults::fused_first_backward(
            self,
            agg,
            x_root,
            x_root_dropout,
            h1,
            terms,
            gids,
            act,
            dropout,
            None,
        )
    }

    /// `out += dropout(x) w` with the dropout (keyed by `gids` as [`Ops::dropout`] keys it) drawn a row
    /// block at a time, so the dropped-out copy of `x` never exists whole: GraphSAGE's root weight under
    /// input dropout (issue 34: the copy was 512 MiB at 1M nodes, held from forward to backward).
    fn gemm_dropped_add(
        &mut self,
        x: &Self::Mat,
        gids: Option<&Self::Idx>,
        d: Dropout,
        w: &Self::Mat,
        out: &mut Self::Mat,
    ) -> Result<(), Self::Error> {
        defaults::gemm_dropped_add(self, x, gids, d, w, out)
    }

    /// `(dropout(H) W, dropout(H) W_root)` ([`Ops::linear_pair`] of the dropped-out input), the dropout drawn
    /// a row block at a time as [`Ops::gemm_dropped_add`] draws it; a device may draw each block once for
    /// both products.
    fn linear_pair_dropped(
        &mut self,
        h: &Self::Mat,
        gids: Option<&Self::Idx>,
        d: Dropout,
        w: &Self::Mat,
        w_root: &Self::Mat,
    ) -> Result<(Self::Mat, Self::Mat), Self::Error> {
        let (rows, (_, cols)) = (self.dims(h).0, self.dims(w));
        let mut m = self.zeros(rows, cols)?;
        self.gemm_dropped_add(h, gids, d, w, &mut m)?;
        let mut r = self.zeros(rows, cols)?;
        self.gemm_dropped_add(h, gids, d, w_root, &mut r)?;
        Ok((m, r))
    }

    /// `dropout(x)^T b` for each `b` of `bs` (all with the same number of rows, the first rows of `x`), the
    /// dropout (keyed by `gids` as [`Ops::dropout`] keys it) drawn a row block at a time: the weight
    /// gradients of a first layer that transformed its input under input dropout, whose dropped-out copy
    /// (n x in_dim, 122 MiB for a quarter of SBM 1M) is then never held from forward to backward (issue 31).
    fn matmul_at_dropped(
        &mut self,
        x: &Self::Mat,
        gids: Option<&Self::Idx>,
        d: Dropout,
        bs: &[&Self::Mat],
    ) -> Result<Vec<Self::Mat>, Self::Error> {
        defaults::matmul_at_dropped(self, x, gids, d, bs)
    }

    /// GAT's aggregation with a rematerialising exchange (SAR) into `out` (`n x d_out`, bias not added),
    /// from the owned messages `m_own` (`[Z | s_src]`) and `s_dst`. Returns what
    /// [`Ops::gat_backward_remat`] needs besides them.
    #[allow(clippy::too_many_arguments)]
    fn gat_forward_remat(
        &mut self,
        g: GraphView<'_, Self>,
        layer: usize,
        m_own: &Self::Mat,
        s_dst: &Self::Mat,
        drop: Option<AttnDropout>,
        shape: GatShape,
        ex: &mut dyn Exchange,
        out: &mut Self::Mat,
    ) -> Result<GatRemat<Self::Mat>, Self::Error> {
        defaults::gat_forward_remat(self, g, layer, m_own, s_dst, drop, shape, ex, out)
    }

    /// Backward of [`Ops::gat_forward_remat`]: the halo messages fetched again, the coefficients recomputed,
    /// halo gradients returned to their owners. Returns the owned rows' `[dZ | ds_src]` (peers'
    /// contributions added) and `ds_dst`.
    #[allow(clippy::too_many_arguments)]
    fn gat_backward_remat(
        &mut self,
        g: GraphView<'_, Self>,
        layer: usize,
        m_own: &Self::Mat,
        s_dst: &Self::Mat,
        st: GatRemat<Self::Mat>,
        d_out: &Self::Mat,
        drop: Option<AttnDropout>,
        shape: GatShape,
        ex: &mut dyn Exchange,
    ) -> Result<(Self::Mat, Self::Mat), Self::Error> {
        defaults::gat_backward_remat(self, g, layer, m_own, s_dst, st, d_out, drop, shape, ex)
    }

    /// Sums the weight gradients over every worker through `ex`, in place.
    fn all_reduce(
        &mut self,
        grads: &mut [Self::Mat],
        ex: &mut dyn Exchange,
    ) -> Result<(), Self::Error> {
        defaults::all_reduce(self, grads, ex)
    }
}

/// `Ok` when `ok`, else a shape error with `what`.
pub fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), DeviceError> {
    if ok {
        Ok(())
    } else {
        Err(DeviceError::Shape(what()))
    }
}

/// Checks a product's shapes; returns (m, n, k).
pub fn gemm_shape<M>(
    a: &View<'_, M>,
    b: &View<'_, M>,
    c: (usize, usize),
) -> Result<(usize, usize, usize), DeviceError> {
    let (m, k) = a.op_shape();
    let (k2, n) = b.op_shape();
    check(k == k2 && c == (m, n), || {
        format!("gemm: {m}x{k} times {k2}x{n} into {}x{}", c.0, c.1)
    })?;
    check(a.ld >= a.cols && b.ld >= b.cols, || {
        "gemm: a row stride is smaller than the row".into()
    })?;
    Ok((m, n, k))
}

/// Checks that a [`Ops::copy2d`] stays inside both buffers (`src_len`, `dst_len` elements).
pub fn check_copy2d<M>(
    src: &View<'_, M>,
    dst_len: usize,
    src_len: usize,
    dst_offset: usize,
    dst_ld: usize,
) -> Result<(), DeviceError> {
    let end = |off: usize, ld: usize| {
        if src.rows == 0 || src.cols == 0 {
            0
        } else {
            off + (src.rows - 1) * ld + src.cols
        }
    };
    check(
        src.ld >= src.cols
            && dst_ld >= src.cols
            && end(src.offset, src.ld) <= src_len
            && end(dst_offset, dst_ld) <= dst_len,
        || "copy2d out of bounds".into(),
    )
}

/// Checks that every row of `rows` exists and has a label in `0..c` (`n x c` logits).
pub fn check_labels<L>(
    labels: &[L],
    rows: &[u32],
    (n, c): (usize, usize),
) -> Result<(), DeviceError>
where
    L: Copy + Into<i64>,
{
    check(labels.len() == n, || {
        format!("{} labels for {n} rows", labels.len())
    })?;
    for &r in rows {
        let ok = (r as usize) < n && (0..c as i64).contains(&labels[r as usize].into());
        check(ok, || {
            format!("row {r} is out of range or has no label in 0..{c}")
        })?;
    }
    Ok(())
}
