//! [`Cpu`]: the device of host memory, whose operations are this crate's kernels: SpMM over both directions
//! of a [`SparseOp`] (`sparse.rs`), the row-block-parallel products of `dense.rs`, the GAT kernels of
//! `gat.rs`, the dropout, activation and loss functions below, and SAR's per-range kernels (`sar.rs`).
//! [`crate::Model`] is `DeviceModel<Cpu>`: every CPU worker trains through the generic layer code on this
//! device, and a GPU run of the same code differs only in its kernels.
//!
//! Besides the primitives, `Cpu` overrides the layer-level operations whose defaults would cost it time or
//! memory: halo rows are handed to the exchange without a copy, `H [W | W_root]` and `H^T [A | B]` are
//! one product each, the fused first-layer backward forms the hidden-width gradient one row block at a
//! time, SAR aggregates one peer's range of halo rows at a time and rematerialises GAT's, and sparse
//! operators are shared (`Arc`), not copied, when a device graph is made from a [`crate::LocalGraph`].

use std::sync::Arc;

use rayon::prelude::*;

use super::{
    AdamStep, AttnDropout, Dropout, FirstLayerGrads, GatRemat, GatShape, GraphView, Ops, View,
    check, check_copy2d, check_labels, gemm_shape, sar,
};
use crate::Activation;
use crate::dense::{
    matmul, matmul_at, matmul_at_concat, matmul_at_rows_into, matmul_bt_into, matmul_bt_rows_into,
    matmul_into, reduction_block,
};
use crate::exchange::{Exchange, HaloSeed};
use crate::rng::{Mask, Stream};
use crate::sparse::{SparseOp, Src};
use crate::tensor::{ELEMENTWISE_CHUNK, Matrix};
use crate::{Error, gat, loss};

/// Bytes of the hidden-width gradient the fused first-layer backward holds at once per thread: with the rows
/// of the aggregation and of the layer's output it reads beside it, within a core's L2.
const FUSED_ROWS_BYTES: usize = 256 << 10;

/// The host device: matrices are [`Matrix`], operators shared [`SparseOp`]s, errors the engine's [`Error`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

/// A view as a matrix: borrowed when it is a whole matrix, else its rows copied out.
enum Operand<'a> {
    Whole(&'a Matrix),
    Copied(Matrix),
}

impl Operand<'_> {
    fn of<'a>(v: &View<'a, Matrix>) -> Operand<'a> {
        let m = v.m;
        if v.offset == 0 && v.ld == v.cols && (v.rows, v.cols) == m.shape() {
            return Operand::Whole(m);
        }
        let d = m.data();
        let mut out = Vec::with_capacity(v.rows * v.cols);
        for r in 0..v.rows {
            let s = v.offset + r * v.ld;
            out.extend_from_slice(&d[s..s + v.cols]);
        }
        Operand::Copied(Matrix::from_vec(v.rows, v.cols, out))
    }

    fn get(&self) -> &Matrix {
        match self {
            Operand::Whole(m) => m,
            Operand::Copied(m) => m,
        }
    }
}

fn transpose(a: &Matrix) -> Matrix {
    let (r, c) = a.shape();
    let mut t = Matrix::zeros(c, r);
    for i in 0..r {
        for (j, &v) in a.row(i).iter().enumerate() {
            t.data_mut()[j * r + i] = v;
        }
    }
    t
}

fn check_gat(
    a: &SparseOp,
    m_own: &Matrix,
    m_halo: Option<&Matrix>,
    s_dst: &Matrix,
    shape: GatShape,
) -> Result<(), Error> {
    let (h, c) = (shape.heads as usize, shape.c as usize);
    let width = h * c + h;
    let n_halo = m_halo.map_or(0, |m| m.rows());
    check(
        m_own.cols() == width
            && m_halo.is_none_or(|m| m.cols() == width)
            && m_own.rows() + n_halo == a.n_src()
            && s_dst.cols() == h
            && s_dst.rows() >= a.n_dst(),
        || "gat message shapes".into(),
    )?;
    Ok(())
}

fn messages<'a>(m_own: &'a Matrix, m_halo: Option<&'a Matrix>) -> Src<'a> {
    Src {
        own: m_own.data(),
        halo: m_halo.map_or(&[][..], |m| m.data()),
        n_own: m_own.rows(),
        d: m_own.cols(),
    }
}

fn attn_drop(d: Option<AttnDropout>) -> gat::AttnDrop {
    d.map(|d| {
        let (key, thr, scale) = d.kernel_args();
        (Stream::from_key(key), thr, scale)
    })
}

impl Ops for Cpu {
    type Mat = Matrix;
    type Csr = Arc<SparseOp>;
    type Idx = Vec<u32>;
    type Labels = Vec<i64>;
    type Error = Error;

    fn dims(&self, m: &Matrix) -> (usize, usize) {
        m.shape()
    }
    fn upload(&mut self, m: &Matrix) -> Result<Matrix, Error> {
        Ok(m.clone())
    }
    fn upload_owned(&mut self, m: Matrix) -> Result<Matrix, Error> {
        Ok(m)
    }
    fn download(&mut self, m: &Matrix) -> Result<Matrix, Error> {
        Ok(m.clone())
    }
    fn alloc(&mut self, rows: usize, cols: usize) -> Result<Matrix, Error> {
        Ok(Matrix::zeros(rows, cols))
    }
    fn zeros(&mut self, rows: usize, cols: usize) -> Result<Matrix, Error> {
        Ok(Matrix::zeros(rows, cols))
    }
    fn recycle(&mut self, _m: Matrix) {}
    fn release(&mut self, m: Matrix) {
        crate::heap::drop_now(m.into_vec());
    }
    fn upload_csr(&mut self, op: &SparseOp) -> Result<Arc<SparseOp>, Error> {
        Ok(Arc::new(op.clone()))
    }
    fn share_csr(&mut self, op: &Arc<SparseOp>) -> Result<Arc<SparseOp>, Error> {
        Ok(Arc::clone(op))
    }
    fn upload_idx(&mut self, v: &[u32]) -> Result<Vec<u32>, Error> {
        Ok(v.to_vec())
    }
    fn upload_labels(&mut self, v: &[i64]) -> Result<Vec<i64>, Error> {
        Ok(v.to_vec())
    }

    fn gemm(
        &mut self,
        a: View<'_, Matrix>,
        b: View<'_, Matrix>,
        beta: f32,
        c: &mut Matrix,
    ) -> Result<(), Error> {
        let _p = crate::profile::span("gemm");
        gemm_shape(&a, &b, c.shape())?;
        let (am, bm) = (Operand::of(&a), Operand::of(&b));
        let (am, bm) = (am.get(), bm.get());
        let accumulate = beta != 0.0;
        if accumulate && beta != 1.0 {
            c.scale(beta);
        }
        match (a.trans, b.trans) {
            (false, false) => matmul_into(am, bm, c, accumulate),
            (false, true) => matmul_bt_into(am, bm, c, accumulate),
            (true, false) => {
                let p = matmul_at(am, bm);
                if accumulate {
                    c.add_assign(&p);
                } else {
                    *c = p;
                }
            }
            (true, true) => matmul_bt_into(&transpose(am), bm, c, accumulate),
        }
        Ok(())
    }

    fn spmm(
        &mut self,
        a: &Arc<SparseOp>,
        own: &Matrix,
        halo: Option<&Matrix>,
        y: &mut Matrix,
    ) -> Result<(), Error> {
        let _p = crate::profile::span("spmm");
        let d = own.cols();
        let n_halo = halo.map_or(0, |h| h.rows());
        check(
            own.rows() + n_halo == a.n_src()
                && y.shape() == (a.n_dst(), d)
                && halo.is_none_or(|h| h.cols() == d),
            || {
                format!(
                    "spmm: {} + {n_halo} source rows for {}",
                    own.rows(),
                    a.n_src()
                )
            },
        )?;
        *y = a.spmm_ext(own, halo);
        Ok(())
    }

    fn spmm_t(&mut self, a: &Arc<SparseOp>, x: &Matrix, y: &mut Matrix) -> Result<(), Error> {
        let _p = crate::profile::span("spmm_t");
        check(
            x.rows() == a.n_dst() && y.shape() == (a.n_src(), x.cols()),
            || format!("spmm_t: {} rows for {} destinations", x.rows(), a.n_dst()),
        )?;
        *y = a.spmm_t(x);
        Ok(())
    }

    fn gat_messages(
        &mut self,
        z: &Matrix,
        a_src: &Matrix,
        a_dst: &Matrix,
        shape: GatShape,
        m: &mut Matrix,
        s_dst: &mut Matrix,
    ) -> Result<(), Error> {
        let _p = crate::profile::span("gat_messages");
        let (h, c) = (shape.heads as usize, shape.c as usize);
        let n = z.rows();
        check(
            z.cols() == h * c
                && m.shape() == (n, h * c + h)
                && s_dst.shape() == (n, h)
                && a_src.data().len() == h * c
                && a_dst.data().len() == h * c,
            || "gat_messages shapes".into(),
        )?;
        gat::messages(
            z.data(),
            a_src.data(),
            a_dst.data(),
            shape,
            m.data_mut(),
            s_dst.data_mut(),
        );
        Ok(())
    }

    fn gat_forward(
        &mut self,
        a: &Arc<SparseOp>,
        m_own: &Matrix,
        m_halo: Option<&Matrix>,
        s_dst: &Matrix,
        gids: Option<&Vec<u32>>,
        drop: Option<AttnDropout>,
        shape: GatShape,
        alpha: &mut Matrix,
        out: &mut Matrix,
    ) -> Result<(), Error> {
        let _p = crate::profile::span("gat_forward");
        check_gat(a, m_own, m_halo, s_dst, shape)?;
        check(
            alpha.shape() == (a.nnz(), shape.heads as usize)
                && out.shape() == (a.n_dst(), shape.d_out()),
            || "gat_forward output shapes".into(),
        )?;
        out.fill(0.0);
        gat::forward(
            a,
            &messages(m_own, m_halo),
            s_dst.data(),
            gids.map(Vec::as_slice),
            attn_drop(drop),
            shape,
            alpha.data_mut(),
            out.data_mut(),
        );
        Ok(())
    }

    fn gat_backward_edges(
        &mut self,
        a: &Arc<SparseOp>,
        m_own: &Matrix,
        m_halo: Option<&Matrix>,
        s_dst: &Matrix,
        alpha: &Matrix,
        d_out: &Matrix,
        gids: Option<&Vec<u32>>,
        drop: Option<AttnDropout>,
        shape: GatShape,
        d_score: &mut Matrix,
        a_used: &mut Matrix,
        ds_dst: &mut Matrix,
    ) -> Result<(), Error> {
        let _p = crate::profile::span("gat_backward_edges");
        check_gat(a, m_own, m_halo, s_dst, shape)?;
        let h = shape.heads as usize;
        check(
            alpha.shape() == (a.nnz(), h)
                && d_score.shape() == (a.nnz(), h)
                && a_used.shape() == (a.nnz(), h)
                && ds_dst.shape() == (a.n_dst(), h)
                && d_out.shape() == (a.n_dst(), shape.d_out()),
            || "gat_backward_edges shapes".into(),
        )?;
        gat::backward_edges(
            a,
            &messages(m_own, m_halo),
            s_dst.data(),
            alpha.data(),
            d_out.data(),
            gids.map(Vec::as_slice),
            attn_drop(drop),
            shape,
            d_score.data_mut(),
            a_used.data_mut(),
            ds_dst.data_mut(),
        );
        Ok(())
    }

    fn gat_backward_sources(
        &mut self,
        a: &Arc<SparseOp>,
        a_used: &Matrix,
        d_score: &Matrix,
        d_out: &Matrix,
        shape: GatShape,
        dm: &mut Matrix,
    ) -> Result<(), Error> {
        let _p = crate::profile::span("gat_backward_sources");
        let (h, c) = (shape.heads as usize, shape.c as usize);
        check(
            dm.shape() == (a.n_src(), h * c + h)
                && d_out.shape() == (a.n_dst(), shape.d_out())
                && a_used.shape() == (a.nnz(), h)
                && d_score.shape() == (a.nnz(), h),
            || "gat_backward_sources shapes".into(),
        )?;
        dm.fill(0.0);
        gat::backward_sources(
            a,
            a_used.data(),
            d_score.data(),
            d_out.data(),
            shape,
            dm.data_mut(),
        );
        Ok(())
    }

    fn gat_dz(
        &mut self,
        dm: &Matrix,
        ds_dst: &Matrix,
        a_src: &Matrix,
        a_dst: &Matrix,
        shape: GatShape,
        dz: &mut Matrix,
    ) -> Result<(), Error> {
        let _p = crate::profile::span("gat_dz");
        let (h, c) = (shape.heads as usize, shape.c as usize);
        check(
            dm.shape() == (dz.rows(), h * c + h)
                && dz.cols() == h * c
                && ds_dst.cols() == h
                && ds_dst.rows() <= dz.rows()
                && a_src.data().len() == h * c
                && a_dst.data().len() == h * c,
            || "gat_dz shapes".into(),
        )?;
        gat::dz(
            dm.data(),
            ds_dst.data(),
            a_src.data(),
            a_dst.data(),
            shape,
            dz.data_mut(),
        );
        Ok(())
    }

    fn bias_add(&mut self, x: &mut Matrix, bias: &Matrix) -> Result<(), Error> {
        let _p = crate::profile::span("bias_add");
        check(bias.data().len() == x.cols(), || "bias width".into())?;
        add_bias(x, bias);
        Ok(())
    }

    fn activate(&mut self, x: &mut Matrix, act: Activation) -> Result<(), Error> {
        let _p = crate::profile::span("activate");
        activate(x, act);
        Ok(())
    }

    fn dropout(
        &mut self,
        x: &mut Matrix,
        gids: Option<&Vec<u32>>,
        row0: usize,
        col0: usize,
        total_cols: usize,
        d: Dropout,
    ) -> Result<(), Error> {
        let _p = crate::profile::span("dropout");
        check(
            gids.is_none_or(|g| g.len() >= row0 + x.rows()) && col0 + x.cols() <= total_cols,
            || "dropout rows or columns out of range".into(),
        )?;
        dropout_cols(
            x,
            gids.map(Vec::as_slice),
            row0,
            d.p,
            Stream::from_key(d.key),
            col0,
            total_cols,
        );
        Ok(())
    }

    fn bias_activate_dropout(
        &mut self,
        x: &mut Matrix,
        bias: &Matrix,
        act: Activation,
        gids: Option<&Vec<u32>>,
        d: Option<Dropout>,
    ) -> Result<(), Error> {
        let _p = crate::profile::span("bias_activate_dropout");
        check(bias.data().len() == x.cols(), || "bias width".into())?;
        check(gids.is_none_or(|g| g.len() >= x.rows()), || {
            "bias_activate_dropout: fewer global ids than rows".into()
        })?;
        bias_activate_dropout(x, bias, act, gids.map(Vec::as_slice), d);
        Ok(())
    }

    fn activation_backward(
        &mut self,
        dy: &mut Matrix,
        y: &Matrix,
        gids: Option<&Vec<u32>>,
        row0: usize,
        act: Activation,
        d: Option<Dropout>,
    ) -> Result<(), Error> {
        let _p = crate::profile::span("activation_backward");
        check(dy.shape() == y.shape(), || {
            "activation_backward shapes".into()
        })?;
        check(gids.is_none_or(|g| g.len() >= row0 + dy.rows()), || {
            "activation_backward rows out of range".into()
        })?;
        activation_backward(
            dy,
            y.data(),
            row0,
            gids.map(Vec::as_slice),
            act,
            d.map(|d| d.p),
            Stream::from_key(d.map_or(0, |d| d.key)),
        );
        Ok(())
    }

    fn add_assign(&mut self, a: &mut Matrix, b: &Matrix) -> Result<(), Error> {
        let _p = crate::profile::span("add_assign");
        check(a.cols() == b.cols() && b.rows() <= a.rows(), || {
            "add_assign shapes".into()
        })?;
        if a.shape() == b.shape() {
            a.add_assign(b);
        } else {
            let n = b.data().len();
            a.data_mut()[..n]
                .par_iter_mut()
                .zip(b.data())
                .with_min_len(ELEMENTWISE_CHUNK)
                .for_each(|(x, &y)| *x += y);
        }
        Ok(())
    }

    fn col_sums(&mut self, x: &Matrix, out: &mut Matrix) -> Result<(), Error> {
        let _p = crate::profile::span("col_sums");
        check(out.shape() == (1, x.cols()), || "col_sums width".into())?;
        *out = x.column_sums();
        Ok(())
    }

    fn copy2d(
        &mut self,
        src: View<'_, Matrix>,
        dst: &mut Matrix,
        dst_offset: usize,
        dst_ld: usize,
    ) -> Result<(), Error> {
        let _p = crate::profile::span("copy2d");
        check(!src.trans, || "copy2d copies without transposing".into())?;
        check_copy2d(
            &src,
            dst.data().len(),
            src.m.data().len(),
            dst_offset,
            dst_ld,
        )?;
        let (s, d) = (src.m.data(), dst.data_mut());
        for r in 0..src.rows {
            let (so, dof) = (src.offset + r * src.ld, dst_offset + r * dst_ld);
            d[dof..dof + src.cols].copy_from_slice(&s[so..so + src.cols]);
        }
        Ok(())
    }

    fn gather_rows(&mut self, src: &Matrix, idx: &Vec<u32>, dst: &mut Matrix) -> Result<(), Error> {
        let _p = crate::profile::span("gather_rows");
        let c = src.cols();
        check(
            dst.shape() == (idx.len(), c) && idx.iter().all(|&i| (i as usize) < src.rows()),
            || "gather_rows shapes".into(),
        )?;
        if c > 0 {
            dst.data_mut()
                .par_chunks_mut(c)
                .zip(idx.par_iter())
                .for_each(|(row, &i)| row.copy_from_slice(src.row(i as usize)));
        }
        Ok(())
    }

    fn cross_entropy(
        &mut self,
        logits: &Matrix,
        labels: &Vec<i64>,
        rows: &Vec<u32>,
        normalizer: f64,
        grad: &mut Matrix,
    ) -> Result<f64, Error> {
        let _p = crate::profile::span("cross_entropy");
        check(grad.shape() == logits.shape(), || {
            "cross_entropy shapes".into()
        })?;
        check_labels(labels, rows, logits.shape())?;
        let (loss, g) = loss::cross_entropy(logits, labels, rows, normalizer);
        *grad = g;
        Ok(loss)
    }

    fn correct(
        &mut self,
        logits: &Matrix,
        labels: &Vec<i64>,
        rows: &Vec<u32>,
    ) -> Result<u64, Error> {
        let _p = crate::profile::span("correct");
        check_labels(labels, rows, logits.shape())?;
        Ok(loss::correct(logits, labels, rows) as u64)
    }

    fn adam(
        &mut self,
        w: &mut Matrix,
        g: &Matrix,
        m: &mut Matrix,
        v: &mut Matrix,
        s: AdamStep,
    ) -> Result<(), Error> {
        let _p = crate::profile::span("adam");
        check(
            w.shape() == g.shape() && w.shape() == m.shape() && w.shape() == v.shape(),
            || "adam shapes".into(),
        )?;
        // `Adam::step`'s arithmetic, element by element
        for (((w, &g), m), v) in w
            .data_mut()
            .iter_mut()
            .zip(g.data())
            .zip(m.data_mut().iter_mut())
            .zip(v.data_mut().iter_mut())
        {
            let g = g + s.weight_decay * *w;
            *m = s.beta1 * *m + (1.0 - s.beta1) * g;
            *v = s.beta2 * *v + (1.0 - s.beta2) * g * g;
            *w -= s.step_size * *m / ((*v).sqrt() / s.bc2_sqrt + s.eps);
        }
        Ok(())
    }
    fn duplicate(&mut self, m: &Matrix) -> Result<Matrix, Error> {
        Ok(m.clone())
    }

    fn reuse_as(&mut self, m: Matrix, rows: usize, cols: usize) -> Result<Matrix, Error> {
        // within the vector's capacity nothing moves: shrinking keeps the bytes, growing writes zeros
        let mut v = m.into_vec();
        v.resize(rows * cols, 0.0);
        Ok(Matrix::from_vec(rows, cols, v))
    }

    fn add_rows(&mut self, a: &mut Matrix, row0: usize, b: &Matrix) -> Result<(), Error> {
        let _p = crate::profile::span("add_rows");
        check(a.cols() == b.cols() && row0 + b.rows() <= a.rows(), || {
            "add_rows shapes".into()
        })?;
        let cols = a.cols();
        let dst = &mut a.data_mut()[row0 * cols..(row0 + b.rows()) * cols];
        for (x, y) in dst.iter_mut().zip(b.data()) {
            *x += *y;
        }
        Ok(())
    }

    fn halo_rows(
        &mut self,
        g: GraphView<'_, Cpu>,
        layer: usize,
        own: &Matrix,
        ex: &mut dyn Exchange,
    ) -> Result<Option<Matrix>, Error> {
        let _p = crate::profile::span("halo_rows");
        if g.complete {
            return Ok(None);
        }
        if ex.rematerializes() {
            return super::defaults::halo_rows(self, g, layer, own, ex);
        }
        ex.forward(layer, own).map_err(Error::Exchange)
    }

    fn seeded_halo_rows(
        &mut self,
        g: GraphView<'_, Cpu>,
        layer: usize,
        own: &Matrix,
        ex: &mut dyn Exchange,
        seed: &HaloSeed,
    ) -> Result<Option<Matrix>, Error> {
        let _p = crate::profile::span("halo_rows");
        if g.complete {
            return Ok(None);
        }
        ex.forward_seeded(layer, own, seed).map_err(Error::Exchange)
    }

    fn halo_backward(
        &mut self,
        g: GraphView<'_, Cpu>,
        layer: usize,
        ext: Matrix,
        ex: &mut dyn Exchange,
    ) -> Result<Matrix, Error> {
        let _p = crate::profile::span("halo_backward");
        if g.complete {
            return Ok(ext);
        }
        let (mut own, halo) = split_rows(ext, g.n);
        if ex.rematerializes() {
            ex.backward_each(layer, halo.rows(), &mut own, &mut |r| {
                halo.row_block(r.start, r.end)
            })
        } else {
            ex.backward(layer, halo, &mut own)
        }
        .map_err(Error::Exchange)?;
        Ok(own)
    }

    fn aggregate(
        &mut self,
        g: GraphView<'_, Cpu>,
        layer: usize,
        own: &Matrix,
        ex: &mut dyn Exchange,
    ) -> Result<Matrix, Error> {
        let _p = crate::profile::span("aggregate");
        if g.complete {
            return Ok(g.op.spmm(own));
        }
        sar::aggregate(g.op, layer, own, ex)
    }

    fn aggregate_backward(
        &mut self,
        g: GraphView<'_, Cpu>,
        layer: usize,
        d: &Matrix,
        ex: &mut dyn Exchange,
    ) -> Result<Matrix, Error> {
        let _p = crate::profile::span("aggregate_backward");
        if g.complete {
            return Ok(g.op.spmm_t(d));
        }
        sar::aggregate_backward(g.op, layer, d, ex)
    }

    fn linear_pair(
        &mut self,
        h: &Matrix,
        w: &Matrix,
        w_root: &Matrix,
    ) -> Result<(Matrix, Matrix), Error> {
        let _p = crate::profile::span("linear_pair");
        check(w.shape() == w_root.shape() && h.cols() == w.rows(), || {
            "linear_pair shapes".into()
        })?;
        let both = matmul(h, &Matrix::concat_cols(w, w_root));
        Ok(both.split_off_cols(w.cols()))
    }

    fn matmul_at_pair(
        &mut self,
        h: &Matrix,
        a: &Matrix,
        b: &Matrix,
    ) -> Result<(Matrix, Matrix), Error> {
        let _p = crate::profile::span("matmul_at_pair");
        check(h.rows() == a.rows() && h.rows() == b.rows(), || {
            "matmul_at_pair shapes".into()
        })?;
        // `[a | b]` a row block at a time: never a third copy of both beside them
        let both = matmul_at_concat(h, &[a, b]);
        Ok(both.split_cols(a.cols()))
    }

    fn linear_pair_dropped(
        &mut self,
        h: &Matrix,
        gids: Option<&Vec<u32>>,
        d: Dropout,
        w: &Matrix,
        w_root: &Matrix,
    ) -> Result<(Matrix, Matrix), Error> {
        let _p = crate::profile::span("linear_pair_dropped");
        check(w.shape() == w_root.shape() && h.cols() == w.rows(), || {
            "linear_pair_dropped shapes".into()
        })?;
        // each row block drawn once for both products, as `linear_pair` reads H once
        let both_w = Matrix::concat_cols(w, w_root);
        let mut both = Matrix::zeros(h.rows(), both_w.cols());
        self.gemm_dropped_add(h, gids, d, &both_w, &mut both)?;
        Ok(both.split_off_cols(w.cols()))
    }

    fn matmul_at_dropped(
        &mut self,
        x: &Matrix,
        gids: Option<&Vec<u32>>,
        d: Dropout,
        bs: &[&Matrix],
    ) -> Result<Vec<Matrix>, Error> {
        let _p = crate::profile::span("matmul_at_dropped");
        let rows = bs.first().map_or(0, |b| b.rows());
        check(
            bs.iter().all(|b| b.rows() == rows) && rows <= x.rows(),
            || "matmul_at_dropped shapes".into(),
        )?;
        let gids = gids.map(Vec::as_slice);
        let k = x.cols();
        // the products of `matmul_at_pair` over the dropped-out rows, each reduction block's rows drawn on
        // its own thread
        let mut rest =
            crate::dense::matmul_at_concat_drawn(x, rows, bs, &|block: &mut [f32], r0: usize| {
                dropout_rows_serial(block, k, gids, r0, d)
            });
        let mut out = Vec::with_capacity(bs.len());
        for b in &bs[..bs.len().saturating_sub(1)] {
            let (left, right) = rest.split_off_cols(b.cols());
            out.push(left);
            rest = right;
        }
        if !bs.is_empty() {
            out.push(rest);
        }
        Ok(out)
    }

    fn gemm_dropped_add(
        &mut self,
        x: &Matrix,
        gids: Option<&Vec<u32>>,
        d: Dropout,
        w: &Matrix,
        out: &mut Matrix,
    ) -> Result<(), Error> {
        let _p = crate::profile::span("gemm_dropped_add");
        let (k, n) = w.shape();
        check(
            x.cols() == k && out.cols() == n && out.rows() <= x.rows(),
            || "gemm_dropped_add shapes".into(),
        )?;
        if n == 0 || out.rows() == 0 {
            return Ok(());
        }
        let gids = gids.map(Vec::as_slice);
        let rows_per = crate::dense::ROW_BLOCK;
        let wd = w.data();
        // the row blocks `Cpu::gemm` runs (so `out` gets the bits a product of the dropped-out copy gives),
        // each block's rows of `x` copied and dropped out on its own thread first
        out.data_mut()
            .par_chunks_mut(rows_per * n)
            .enumerate()
            .for_each(|(b, cb)| {
                let rows = cb.len() / n;
                let r0 = b * rows_per;
                let mut xd = x.data()[r0 * k..(r0 + rows) * k].to_vec();
                dropout_rows_serial(&mut xd, k, gids, r0, d);
                // SAFETY: xd is rows x k, w k x n and cb rows x n, row-major, checked above.
                unsafe {
                    matrixmultiply::sgemm(
                        rows,
                        k,
                        n,
                        1.0,
                        xd.as_ptr(),
                        k as isize,
                        1,
                        wd.as_ptr(),
                        n as isize,
                        1,
                        1.0,
                        cb.as_mut_ptr(),
                        n as isize,
                        1,
                    );
                }
            });
        Ok(())
    }

    fn fused_first_backward(
        &mut self,
        agg: &Matrix,
        x_root: Option<&Matrix>,
        x_root_dropout: Option<Dropout>,
        h1: Matrix,
        terms: &[(&Matrix, &Matrix)],
        gids: Option<&Vec<u32>>,
        act: Activation,
        dropout: Option<Dropout>,
    ) -> Result<FirstLayerGrads<Matrix>, Error> {
        let _p = crate::profile::span("fused_first_backward");
        let n = h1.rows();
        let width = h1.cols();
        check(
            agg.rows() == n
                && x_root.is_none_or(|x| x.rows() == n)
                && terms
                    .iter()
                    .all(|(a, w)| a.rows() == n && a.cols() == w.cols() && w.rows() == width),
            || "fused_first_backward shapes".into(),
        )?;
        let gids = gids.map(Vec::as_slice);
        let mask = Stream::from_key(dropout.map_or(0, |d| d.key));
        let p = dropout.map(|d| d.p);
        let block = reduction_block(n);
        let n_blocks = n.div_ceil(block.max(1));
        // A reduction block's hidden-width gradient is formed and consumed a few hundred rows at a time, so
        // it stays in L2 between the products that write and read it (a whole block's, 16 MiB at width
        // 256, went to memory and back three times: issue 34).
        let sub = (FUSED_ROWS_BYTES / (4 * width.max(1))).max(16);
        fn rows(m: &Matrix, r0: usize, r1: usize) -> &[f32] {
            &m.data()[r0 * m.cols()..r1 * m.cols()]
        }
        let partials: Vec<(Matrix, Option<Matrix>, Matrix)> = (0..n_blocks)
            .into_par_iter()
            .map(|b| {
                let (r0, r1) = (b * block, ((b + 1) * block).min(n));
                let mut gw = Matrix::zeros(agg.cols(), width);
                let mut gr = x_root.map(|x| Matrix::zeros(x.cols(), width));
                let mut gb = vec![0f64; width];
                let mut dz = vec![0f32; sub.min(r1 - r0) * width];
                // the root weight's input under input dropout: each sub-block's rows drawn again
                let mut xd: Vec<f32> = Vec::new();
                for s0 in (r0..r1).step_by(sub) {
                    let s1 = (s0 + sub).min(r1);
                    let dz = &mut dz[..(s1 - s0) * width];
                    for (t, (a, w)) in terms.iter().enumerate() {
                        matmul_bt_rows_into(rows(a, s0, s1), a.cols(), w, dz, t > 0);
                    }
                    activation_backward_rows(dz, rows(&h1, s0, s1), width, s0, gids, act, p, mask);
                    let first = s0 == r0;
                    matmul_at_rows_into(
                        rows(agg, s0, s1),
                        agg.cols(),
                        dz,
                        width,
                        gw.data_mut(),
                        !first,
                    );
                    if let (Some(x), Some(gr)) = (x_root, &mut gr) {
                        let xs = match x_root_dropout {
                            None => rows(x, s0, s1),
                            Some(d) => {
                                xd.clear();
                                xd.extend_from_slice(rows(x, s0, s1));
                                dropout_rows_serial(&mut xd, x.cols(), gids, s0, d);
                                &xd
                            }
                        };
                        matmul_at_rows_into(xs, x.cols(), dz, width, gr.data_mut(), !first);
                    }
                    // the bias's gradient: column sums in row order, as `column_sums_serial` adds them
                    for row in dz.chunks_exact(width.max(1)) {
                        for (a, &v) in gb.iter_mut().zip(row) {
                            *a += v as f64;
                        }
                    }
                }
                let gb = Matrix::from_vec(1, width, gb.into_iter().map(|v| v as f32).collect());
                (gw, gr, gb)
            })
            .collect();
        let mut gw = Matrix::zeros(agg.cols(), width);
        let mut gr = x_root.map(|x| Matrix::zeros(x.cols(), width));
        let mut gb = Matrix::zeros(1, width);
        for (pw, pr, pb) in partials {
            gw.add_assign_serial(&pw);
            if let (Some(gr), Some(pr)) = (&mut gr, &pr) {
                gr.add_assign_serial(pr);
            }
            gb.add_assign_serial(&pb);
        }
        Ok(FirstLayerGrads {
            w: gw,
            w_root: gr,
            bias: gb,
        })
    }

    fn gat_forward_remat(
        &mut self,
        g: GraphView<'_, Cpu>,
        layer: usize,
        m_own: &Matrix,
        s_dst: &Matrix,
        drop: Option<AttnDropout>,
        shape: GatShape,
        ex: &mut dyn Exchange,
        out: &mut Matrix,
    ) -> Result<GatRemat<Matrix>, Error> {
        let _p = crate::profile::span("gat_forward_remat");
        sar::gat_forward_remat(g, layer, m_own, s_dst, drop, shape, ex, out)
    }

    fn gat_backward_remat(
        &mut self,
        g: GraphView<'_, Cpu>,
        layer: usize,
        m_own: &Matrix,
        s_dst: &Matrix,
        st: GatRemat<Matrix>,
        d_out: &Matrix,
        drop: Option<AttnDropout>,
        shape: GatShape,
        ex: &mut dyn Exchange,
    ) -> Result<(Matrix, Matrix), Error> {
        let _p = crate::profile::span("gat_backward_remat");
        sar::gat_backward_remat(g, layer, m_own, s_dst, st, d_out, drop, shape, ex)
    }

    fn all_reduce(&mut self, grads: &mut [Matrix], ex: &mut dyn Exchange) -> Result<(), Error> {
        let _p = crate::profile::span("all_reduce");
        ex.all_reduce(grads).map_err(Error::Exchange)
    }
}

/// Splits an `n_src`-row matrix into its first `n_dst` rows and the rest.
pub(super) fn split_rows(m: Matrix, n_dst: usize) -> (Matrix, Matrix) {
    let cols = m.cols();
    let rows = m.rows();
    let mut data = m.into_vec();
    let halo = data.split_off(n_dst * cols);
    (
        Matrix::from_vec(n_dst, cols, data),
        Matrix::from_vec(rows - n_dst, cols, halo),
    )
}

fn add_bias(out: &mut Matrix, bias: &Matrix) {
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

/// `x = dropout(act(x + bias))` row by row while the row is in cache: one pass over `x` instead of
/// [`add_bias`], [`activate`] and [`dropout_cols`]'s three, with their operations in their order (the same
/// bits).
fn bias_activate_dropout(
    x: &mut Matrix,
    bias: &Matrix,
    act: Activation,
    gids: Option<&[u32]>,
    d: Option<Dropout>,
) {
    let cols = x.cols();
    if cols == 0 {
        return;
    }
    let b = bias.data();
    let mask = d.map(|d| (Mask::new(Stream::from_key(d.key), d.p), 1.0 / (1.0 - d.p)));
    x.data_mut()
        .par_chunks_mut(cols)
        .enumerate()
        .with_min_len((ELEMENTWISE_CHUNK / cols).max(1))
        .for_each(|(i, row)| {
            // each step a loop of its own over the row (in L1 by then), so each vectorises
            for (v, &bv) in row.iter_mut().zip(b) {
                *v += bv;
            }
            activate_slice(row, act);
            if let Some((mask, scale)) = &mask {
                mask.apply(gat::gid(gids, i) * cols as u64, row, *scale);
            }
        });
}

fn activate(m: &mut Matrix, act: Activation) {
    m.data_mut()
        .par_chunks_mut(ELEMENTWISE_CHUNK)
        .for_each(|c| activate_slice(c, act));
}

/// The activation over `v`, one loop per activation (each vectorises).
fn activate_slice(v: &mut [f32], act: Activation) {
    match act {
        Activation::Relu => v.iter_mut().for_each(|x| *x = x.max(0.0)),
        Activation::Elu => v.iter_mut().for_each(|x| {
            if *x <= 0.0 {
                *x = x.exp_m1()
            }
        }),
    }
}

/// Inverted dropout on columns `col0..col0 + m.cols()` of rows `total_cols` wide, keyed by the rows' global
/// ids: the same decisions as on the whole rows. Row `i` is source row `row0 + i` of `gids` (the row itself
/// without).
fn dropout_cols(
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

/// [`dropout_cols`] over all `cols` columns of the rows in `data` (rows `row0..`), on this thread: the
/// same masks, for a sub-block a parallel task draws again.
fn dropout_rows_serial(
    data: &mut [f32],
    cols: usize,
    gids: Option<&[u32]>,
    row0: usize,
    d: Dropout,
) {
    if cols == 0 {
        return;
    }
    let mask = Mask::new(Stream::from_key(d.key), d.p);
    let scale = 1.0 / (1.0 - d.p);
    for (i, row) in data.chunks_exact_mut(cols).enumerate() {
        let key = gat::gid(gids, row0 + i) * cols as u64;
        mask.apply(key, row, scale)
    }
}

/// `d * scale` where `y > 0`, else `+0.0`: ReLU's (and dropout's) backward for one element, without a
/// branch, bit for bit what the select gives.
#[inline(always)]
fn relu_grad(d: f32, y: f32, scale: f32) -> f32 {
    let keep = u32::from(y > 0.0).wrapping_neg();
    f32::from_bits((d * scale).to_bits() & keep)
}

/// `dy` (gradient of `y = dropout(act(z))`) becomes the gradient of `z`, from `y` and, for ELU, the
/// regenerated mask. For ReLU `y > 0` exactly when the element was kept and `z > 0`, so no mask is needed.
fn activation_backward(
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
    let grad = RowGrad::new(cols, gids, act, dropout, s);
    let rows = dy
        .data_mut()
        .par_chunks_mut(cols)
        .zip(y.par_chunks(cols))
        .enumerate()
        .with_min_len(64);
    rows.for_each_init(
        || grad.scratch(),
        |keep, (i, (drow, yrow))| grad.row(row0 + i, drow, yrow, keep),
    );
}

/// [`activation_backward`] on the calling thread, for `dy`'s rows `row0..` (`cols` wide each) inside a
/// parallel task.
#[allow(clippy::too_many_arguments)]
fn activation_backward_rows(
    dy: &mut [f32],
    y: &[f32],
    cols: usize,
    row0: usize,
    gids: Option<&[u32]>,
    act: Activation,
    dropout: Option<f32>,
    s: Stream,
) {
    if cols == 0 {
        return;
    }
    let grad = RowGrad::new(cols, gids, act, dropout, s);
    let mut keep = grad.scratch();
    for (i, (drow, yrow)) in dy
        .chunks_exact_mut(cols)
        .zip(y.chunks_exact(cols))
        .enumerate()
    {
        grad.row(row0 + i, drow, yrow, &mut keep);
    }
}

/// One row of the activation's (and dropout's) backward.
struct RowGrad<'a> {
    cols: usize,
    gids: Option<&'a [u32]>,
    act: Activation,
    scale: f32,
    mask: Option<Mask>,
}

impl<'a> RowGrad<'a> {
    fn new(
        cols: usize,
        gids: Option<&'a [u32]>,
        act: Activation,
        dropout: Option<f32>,
        s: Stream,
    ) -> RowGrad<'a> {
        RowGrad {
            cols,
            gids,
            act,
            scale: dropout.map(|p| 1.0 / (1.0 - p)).unwrap_or(1.0),
            // ReLU needs no mask (see `activation_backward`)
            mask: dropout
                .filter(|_| act == Activation::Elu)
                .map(|p| Mask::new(s, p)),
        }
    }

    /// The per-thread buffer [`RowGrad::row`] regenerates a mask row in.
    fn scratch(&self) -> Vec<bool> {
        vec![true; if self.mask.is_some() { self.cols } else { 0 }]
    }

    /// Row `i`'s gradient in place; `y` is the row's forward output.
    #[inline]
    fn row(&self, i: usize, drow: &mut [f32], yrow: &[f32], keep: &mut [bool]) {
        let scale = self.scale;
        match self.act {
            Activation::Relu => {
                // `if y > 0 { d * scale } else { 0 }` as a bit mask: the compiler made the branch a scalar
                // loop, and a branch on which half of the elements are positive mispredicts at random
                // (issue 34: the reason an epoch without dropout, where half are, was slower than one with
                // it)
                for (d, &yv) in drow.iter_mut().zip(yrow) {
                    *d = relu_grad(*d, yv, scale);
                }
            }
            Activation::Elu => {
                if let Some(m) = &self.mask {
                    m.fill(gat::gid(self.gids, i) * self.cols as u64, keep);
                }
                for (k, (d, &yv)) in drow.iter_mut().zip(yrow).enumerate() {
                    // the pre-dropout activation value; elu'(z) = elu(z) + 1 for z <= 0
                    let a = yv / scale;
                    let deriv = if a > 0.0 { 1.0 } else { a + 1.0 };
                    let kept = self.mask.is_none() || keep[k];
                    *d = if kept { *d * deriv * scale } else { 0.0 };
                }
            }
        }
    }
}

/// [`Cpu`]'s primitives without its layer-level overrides: the aggregation, the halo exchange, the fused
/// first-layer backward, SAR and P3's row update run the trait's defaults (`defaults.rs`), as on a device that
/// implements only the primitives (the GPU). Tests and the worker's emulated-GPU hook train on it, so the
/// defaults are checked against [`Cpu`]'s kernels on any machine.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuPrimitives;

impl Ops for CpuPrimitives {
    type Mat = Matrix;
    type Csr = Arc<SparseOp>;
    type Idx = Vec<u32>;
    type Labels = Vec<i64>;
    type Error = Error;

    fn dims(&self, m: &Matrix) -> (usize, usize) {
        Cpu.dims(m)
    }
    fn upload(&mut self, m: &Matrix) -> Result<Matrix, Error> {
        Cpu.upload(m)
    }
    fn upload_owned(&mut self, m: Matrix) -> Result<Matrix, Error> {
        Cpu.upload_owned(m)
    }
    fn download(&mut self, m: &Matrix) -> Result<Matrix, Error> {
        Cpu.download(m)
    }
    fn alloc(&mut self, rows: usize, cols: usize) -> Result<Matrix, Error> {
        Cpu.alloc(rows, cols)
    }
    fn zeros(&mut self, rows: usize, cols: usize) -> Result<Matrix, Error> {
        Cpu.zeros(rows, cols)
    }
    fn recycle(&mut self, m: Matrix) {
        Cpu.recycle(m)
    }
    fn release(&mut self, m: Matrix) {
        Cpu.release(m)
    }
    fn reuse_as(&mut self, m: Matrix, rows: usize, cols: usize) -> Result<Matrix, Error> {
        Cpu.reuse_as(m, rows, cols)
    }
    fn upload_csr(&mut self, op: &SparseOp) -> Result<Arc<SparseOp>, Error> {
        Cpu.upload_csr(op)
    }
    fn share_csr(&mut self, op: &Arc<SparseOp>) -> Result<Arc<SparseOp>, Error> {
        Cpu.share_csr(op)
    }
    fn upload_idx(&mut self, v: &[u32]) -> Result<Vec<u32>, Error> {
        Cpu.upload_idx(v)
    }
    fn upload_labels(&mut self, v: &[i64]) -> Result<Vec<i64>, Error> {
        Cpu.upload_labels(v)
    }
    fn gemm(
        &mut self,
        a: View<'_, Matrix>,
        b: View<'_, Matrix>,
        beta: f32,
        c: &mut Matrix,
    ) -> Result<(), Error> {
        Cpu.gemm(a, b, beta, c)
    }
    fn spmm(
        &mut self,
        a: &Arc<SparseOp>,
        own: &Matrix,
        halo: Option<&Matrix>,
        y: &mut Matrix,
    ) -> Result<(), Error> {
        Cpu.spmm(a, own, halo, y)
    }
    fn spmm_t(&mut self, a: &Arc<SparseOp>, x: &Matrix, y: &mut Matrix) -> Result<(), Error> {
        Cpu.spmm_t(a, x, y)
    }
    fn gat_messages(
        &mut self,
        z: &Matrix,
        a_src: &Matrix,
        a_dst: &Matrix,
        shape: GatShape,
        m: &mut Matrix,
        s_dst: &mut Matrix,
    ) -> Result<(), Error> {
        Cpu.gat_messages(z, a_src, a_dst, shape, m, s_dst)
    }
    fn gat_forward(
        &mut self,
        a: &Arc<SparseOp>,
        m_own: &Matrix,
        m_halo: Option<&Matrix>,
        s_dst: &Matrix,
        gids: Option<&Vec<u32>>,
        drop: Option<AttnDropout>,
        shape: GatShape,
        alpha: &mut Matrix,
        out: &mut Matrix,
    ) -> Result<(), Error> {
        Cpu.gat_forward(a, m_own, m_halo, s_dst, gids, drop, shape, alpha, out)
    }
    fn gat_backward_edges(
        &mut self,
        a: &Arc<SparseOp>,
        m_own: &Matrix,
        m_halo: Option<&Matrix>,
        s_dst: &Matrix,
        alpha: &Matrix,
        d_out: &Matrix,
        gids: Option<&Vec<u32>>,
        drop: Option<AttnDropout>,
        shape: GatShape,
        d_score: &mut Matrix,
        a_used: &mut Matrix,
        ds_dst: &mut Matrix,
    ) -> Result<(), Error> {
        Cpu.gat_backward_edges(
            a, m_own, m_halo, s_dst, alpha, d_out, gids, drop, shape, d_score, a_used, ds_dst,
        )
    }
    fn gat_backward_sources(
        &mut self,
        a: &Arc<SparseOp>,
        a_used: &Matrix,
        d_score: &Matrix,
        d_out: &Matrix,
        shape: GatShape,
        dm: &mut Matrix,
    ) -> Result<(), Error> {
        Cpu.gat_backward_sources(a, a_used, d_score, d_out, shape, dm)
    }
    fn gat_dz(
        &mut self,
        dm: &Matrix,
        ds_dst: &Matrix,
        a_src: &Matrix,
        a_dst: &Matrix,
        shape: GatShape,
        dz: &mut Matrix,
    ) -> Result<(), Error> {
        Cpu.gat_dz(dm, ds_dst, a_src, a_dst, shape, dz)
    }
    fn bias_add(&mut self, x: &mut Matrix, bias: &Matrix) -> Result<(), Error> {
        Cpu.bias_add(x, bias)
    }
    fn activate(&mut self, x: &mut Matrix, act: Activation) -> Result<(), Error> {
        Cpu.activate(x, act)
    }
    fn dropout(
        &mut self,
        x: &mut Matrix,
        gids: Option<&Vec<u32>>,
        row0: usize,
        col0: usize,
        total_cols: usize,
        d: Dropout,
    ) -> Result<(), Error> {
        Cpu.dropout(x, gids, row0, col0, total_cols, d)
    }
    fn activation_backward(
        &mut self,
        dy: &mut Matrix,
        y: &Matrix,
        gids: Option<&Vec<u32>>,
        row0: usize,
        act: Activation,
        d: Option<Dropout>,
    ) -> Result<(), Error> {
        Cpu.activation_backward(dy, y, gids, row0, act, d)
    }
    fn add_assign(&mut self, a: &mut Matrix, b: &Matrix) -> Result<(), Error> {
        Cpu.add_assign(a, b)
    }
    fn col_sums(&mut self, x: &Matrix, out: &mut Matrix) -> Result<(), Error> {
        Cpu.col_sums(x, out)
    }
    fn copy2d(
        &mut self,
        src: View<'_, Matrix>,
        dst: &mut Matrix,
        dst_offset: usize,
        dst_ld: usize,
    ) -> Result<(), Error> {
        Cpu.copy2d(src, dst, dst_offset, dst_ld)
    }
    fn gather_rows(&mut self, src: &Matrix, idx: &Vec<u32>, dst: &mut Matrix) -> Result<(), Error> {
        Cpu.gather_rows(src, idx, dst)
    }
    fn cross_entropy(
        &mut self,
        logits: &Matrix,
        labels: &Vec<i64>,
        rows: &Vec<u32>,
        normalizer: f64,
        grad: &mut Matrix,
    ) -> Result<f64, Error> {
        Cpu.cross_entropy(logits, labels, rows, normalizer, grad)
    }
    fn correct(
        &mut self,
        logits: &Matrix,
        labels: &Vec<i64>,
        rows: &Vec<u32>,
    ) -> Result<u64, Error> {
        Cpu.correct(logits, labels, rows)
    }
    fn adam(
        &mut self,
        w: &mut Matrix,
        g: &Matrix,
        m: &mut Matrix,
        v: &mut Matrix,
        s: AdamStep,
    ) -> Result<(), Error> {
        Cpu.adam(w, g, m, v, s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(rows: usize, cols: usize, seed: u64) -> Matrix {
        let s = Stream::new(seed, &[]);
        Matrix::from_vec(
            rows,
            cols,
            (0..rows * cols)
                .map(|i| s.uniform(i as u64) - 0.5)
                .collect(),
        )
    }

    /// The root weight under input dropout, its rows drawn again a block at a time: the same as a product
    /// of the whole dropped-out copy, on the CPU's kernels and on the primitives' composition, and so is
    /// the fused backward's root-weight gradient; with global ids keying the rows, over row counts that
    /// end mid-block.
    #[test]
    fn a_root_weight_drawing_its_dropout_again_equals_the_dropped_out_copy() {
        let (n, d_in, width, d_out) = (9_001, 24, 256, 5);
        let x = random(n, d_in, 11);
        let w = random(d_in, width, 12);
        let gids: Vec<u32> = (0..n as u32).map(|i| i * 7 + 3).collect();
        let d = Dropout { key: 41, p: 0.5 };
        let mut xd = x.clone();
        Cpu.dropout(&mut xd, Some(&gids), 0, 0, d_in, d).unwrap();
        assert!(xd.data().iter().filter(|&&v| v == 0.0).count() > n * d_in / 3);
        let base = random(n, width, 13);
        let mut want = base.clone();
        crate::dense::matmul_into(&xd, &w, &mut want, true);
        let mut got = base.clone();
        Cpu.gemm_dropped_add(&x, Some(&gids), d, &w, &mut got)
            .unwrap();
        assert!(
            got.max_abs_diff(&want) <= 1e-5,
            "{}",
            got.max_abs_diff(&want)
        );
        let mut composed = base.clone();
        CpuPrimitives
            .gemm_dropped_add(&x, Some(&gids), d, &w, &mut composed)
            .unwrap();
        assert!(composed.max_abs_diff(&want) <= 1e-5);

        let agg = random(n, d_in, 14);
        let terms_a = [random(n, d_out, 15)];
        let terms_w = [random(width, d_out, 16)];
        let terms: Vec<(&Matrix, &Matrix)> = terms_a.iter().zip(&terms_w).collect();
        let mut h1 = random(n, width, 17);
        Cpu.activate(&mut h1, Activation::Relu).unwrap();
        let want = Cpu
            .fused_first_backward(
                &agg,
                Some(&xd),
                None,
                h1.clone(),
                &terms,
                Some(&gids),
                Activation::Relu,
                None,
            )
            .unwrap();
        for (what, got) in [
            (
                "cpu",
                Cpu.fused_first_backward(
                    &agg,
                    Some(&x),
                    Some(d),
                    h1.clone(),
                    &terms,
                    Some(&gids),
                    Activation::Relu,
                    None,
                ),
            ),
            (
                "primitives",
                CpuPrimitives.fused_first_backward(
                    &agg,
                    Some(&x),
                    Some(d),
                    h1.clone(),
                    &terms,
                    Some(&gids),
                    Activation::Relu,
                    None,
                ),
            ),
        ] {
            let got = got.unwrap();
            let (g, r) = (got.w_root.unwrap(), want.w_root.as_ref().unwrap());
            let rel = g.max_abs_diff(r) / r.max_abs().max(1e-6);
            assert!(
                rel <= 1e-5,
                "{what}: root weight gradient differs by {rel:e}"
            );
            assert!(
                got.w.max_abs_diff(&want.w) <= 1e-5 * want.w.max_abs().max(1e-6),
                "{what}: weight"
            );
        }
    }

    #[test]
    fn the_fused_epilogue_is_bias_activation_and_dropout_bit_for_bit() {
        // rows over many parallel tasks, ids that are not the row numbers, both activations
        let (n, width) = (5_000, 37);
        let x = random(n, width, 11);
        let bias = random(1, width, 12);
        let ids: Vec<u32> = (0..n as u32).map(|i| i * 3 + 7).collect();
        for act in [Activation::Relu, Activation::Elu] {
            for d in [None, Some(Dropout { key: 5, p: 0.4 })] {
                for gids in [None, Some(&ids)] {
                    let mut fused = x.clone();
                    Cpu.bias_activate_dropout(&mut fused, &bias, act, gids, d)
                        .unwrap();
                    let mut apart = x.clone();
                    CpuPrimitives
                        .bias_activate_dropout(&mut apart, &bias, act, gids, d)
                        .unwrap();
                    let same = fused
                        .data()
                        .iter()
                        .zip(apart.data())
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{act:?}, dropout {d:?}, ids {}", gids.is_some());
                }
            }
        }
        let e = Cpu
            .bias_activate_dropout(
                &mut x.clone(),
                &random(1, 3, 1),
                Activation::Relu,
                None,
                None,
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("bias width"), "{e}");
    }

    #[test]
    fn fused_first_backward_over_many_row_blocks_is_the_primitives_composition() {
        // rows over several reduction blocks and many L2-sized sub-blocks of each, a width whose sub-blocks
        // are a few hundred rows, a root weight and two terms, as GraphSAGE's second layer hands them over
        let (n, d_in, width, d_out) = (20_000, 24, 256, 5);
        let agg = random(n, d_in, 1);
        let x = random(n, d_in, 2);
        let terms_a = [random(n, d_out, 3), random(n, d_out, 4)];
        let terms_w = [random(width, d_out, 5), random(width, d_out, 6)];
        let terms: Vec<(&Matrix, &Matrix)> = terms_a.iter().zip(&terms_w).collect();
        for act in [Activation::Relu, Activation::Elu] {
            for dropout in [None, Some(Dropout { key: 9, p: 0.5 })] {
                // a forward output: about half zero (ReLU) or negative (ELU), zero where dropped
                let mut h1 = random(n, width, 7);
                Cpu.activate(&mut h1, act).unwrap();
                if let Some(d) = dropout {
                    Cpu.dropout(&mut h1, None, 0, 0, width, d).unwrap();
                }
                let run = |fused: bool| {
                    if fused {
                        Cpu.fused_first_backward(
                            &agg,
                            Some(&x),
                            None,
                            h1.clone(),
                            &terms,
                            None,
                            act,
                            dropout,
                        )
                    } else {
                        CpuPrimitives.fused_first_backward(
                            &agg,
                            Some(&x),
                            None,
                            h1.clone(),
                            &terms,
                            None,
                            act,
                            dropout,
                        )
                    }
                    .unwrap()
                };
                let (got, want) = (run(true), run(false));
                for (g, w, what) in [
                    (&got.w, &want.w, "w"),
                    (
                        got.w_root.as_ref().unwrap(),
                        want.w_root.as_ref().unwrap(),
                        "w_root",
                    ),
                    (&got.bias, &want.bias, "bias"),
                ] {
                    let scale = w.data().iter().fold(1f32, |m, v| m.max(v.abs()));
                    assert!(
                        g.max_abs_diff(w) <= 1e-4 * scale,
                        "{act:?} dropout={dropout:?} {what}: {} (scale {scale})",
                        g.max_abs_diff(w)
                    );
                }
            }
        }
    }

    #[test]
    fn relu_grad_is_the_select_bit_for_bit() {
        let values = [
            -2.5f32,
            -1e-30,
            -0.0,
            0.0,
            1e-30,
            0.75,
            3.0e7,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE / 2.0,
        ];
        for &d in &values {
            for &y in &values {
                for scale in [1.0f32, 2.0, 1.0 / 0.7] {
                    let want = if y > 0.0 { d * scale } else { 0.0 };
                    let got = relu_grad(d, y, scale);
                    assert_eq!(got.to_bits(), want.to_bits(), "d={d} y={y} scale={scale}");
                }
            }
        }
    }
}
