//! The default implementations of [`Ops`]' layer-level operations, composed of its primitives, so a device
//! that has only the primitives (the GPU) runs every layer; [`super::Cpu`] overrides them with the engine's
//! fused and per-range kernels. The exchange is on the host: halo rows go down to it and come back up.

use std::ops::Range;

use crate::Activation;
use crate::exchange::{Exchange, ExchangeError, HaloSeed};
use crate::tensor::Matrix;

use super::{
    AttnDropout, DeviceError, Dropout, FirstLayerGrads, GatRemat, GatShape, GraphView, Ops, View,
};

fn exchange_error<E: From<DeviceError>>(e: ExchangeError) -> E {
    DeviceError::Exchange(e).into()
}

fn shape_error<E: From<DeviceError>>(what: String) -> E {
    DeviceError::Shape(what).into()
}

/// Rows `row0..row0 + rows` of a matrix `cols` wide.
/// The row blocks in which the fused first-layer backward forms its gradient (bytes of one block's
/// gradient): small against the hidden layer, large enough that a GPU's launches stay few.
const FUSED_BLOCK_BYTES: usize = 64 << 20;

fn rows_of<M>(m: &M, row0: usize, rows: usize, cols: usize) -> View<'_, M> {
    View {
        m,
        offset: row0 * cols,
        rows,
        cols,
        ld: cols,
        trans: false,
    }
}

/// A visitor of halo ranges that copies each into its rows of `halo` (every halo row, as wide as the
/// messages): the ranges put together for the one-shot kernels.
fn put_together(
    halo: &mut Matrix,
) -> impl FnMut(Range<usize>, Matrix) -> Result<(), ExchangeError> + '_ {
    move |range, rows| {
        let (n_halo, cols) = halo.shape();
        if range.end > n_halo || rows.shape() != (range.len(), cols) {
            return Err(format!(
                "halo range {range:?} does not fit {n_halo} halo rows {cols} wide"
            )
            .into());
        }
        halo.data_mut()[range.start * cols..range.end * cols].copy_from_slice(rows.data());
        Ok(())
    }
}

pub(super) fn add_rows<O: Ops>(
    ops: &mut O,
    a: &mut O::Mat,
    row0: usize,
    b: &O::Mat,
) -> Result<(), O::Error> {
    let (rows, cols) = ops.dims(b);
    let (a_rows, a_cols) = ops.dims(a);
    if a_cols != cols || row0 + rows > a_rows {
        return Err(shape_error(format!(
            "add_rows: {rows}x{cols} at row {row0} of {a_rows}x{a_cols}"
        )));
    }
    let mut part = ops.alloc(rows, cols)?;
    ops.copy2d(rows_of(&*a, row0, rows, cols), &mut part, 0, cols)?;
    ops.add_assign(&mut part, b)?;
    ops.copy2d(View::full(&part, rows, cols), a, row0 * cols, cols)?;
    ops.recycle(part);
    Ok(())
}

pub(super) fn activation_backward_over<O: Ops>(
    ops: &mut O,
    dy: &mut O::Mat,
    y: &mut O::Mat,
    gids: Option<&O::Idx>,
    row0: usize,
    act: Activation,
    d: Option<Dropout>,
) -> Result<(), O::Error> {
    let (rows, cols) = ops.dims(dy);
    let (y_rows, y_cols) = ops.dims(y);
    if y_cols != cols || row0 + rows > y_rows {
        return Err(shape_error(format!(
            "activation_backward_over: {rows}x{cols} at row {row0} of {y_rows}x{y_cols}"
        )));
    }
    let mut part = ops.alloc(rows, cols)?;
    ops.copy2d(rows_of(&*y, row0, rows, cols), &mut part, 0, cols)?;
    ops.activation_backward(dy, &part, gids, row0, act, d)?;
    ops.copy2d(View::full(&*dy, rows, cols), y, row0 * cols, cols)?;
    ops.recycle(part);
    Ok(())
}

pub(super) fn halo_rows<O: Ops>(
    ops: &mut O,
    g: GraphView<'_, O>,
    layer: usize,
    own: &O::Mat,
    ex: &mut dyn Exchange,
) -> Result<Option<O::Mat>, O::Error> {
    through_host(ops, g, own, ex, |ex, host| {
        if !ex.rematerializes() {
            return ex.forward(layer, host);
        }
        // the ranges put together: the one-shot aggregation's input, at the one-shot's memory
        let mut halo = Matrix::zeros(g.n_src - g.n, host.cols());
        ex.forward_each(layer, host, &mut put_together(&mut halo))?;
        Ok(Some(halo))
    })
}

pub(super) fn seeded_halo_rows<O: Ops>(
    ops: &mut O,
    g: GraphView<'_, O>,
    layer: usize,
    own: &O::Mat,
    ex: &mut dyn Exchange,
    seed: &HaloSeed,
) -> Result<Option<O::Mat>, O::Error> {
    through_host(ops, g, own, ex, |ex, host| {
        ex.forward_seeded(layer, host, seed)
    })
}

/// Halo rows fetched by `fetch` from the owned rows `own` on the host, checked to be `g`'s halo sources
/// as wide as `own` and put on the device (`None`: no halo, a local exchange, or a complete block).
fn through_host<O: Ops>(
    ops: &mut O,
    g: GraphView<'_, O>,
    own: &O::Mat,
    ex: &mut dyn Exchange,
    fetch: impl FnOnce(&mut dyn Exchange, &Matrix) -> Result<Option<Matrix>, ExchangeError>,
) -> Result<Option<O::Mat>, O::Error> {
    if ex.is_local() || g.complete {
        return Ok(None);
    }
    let host = ops.download(own)?;
    let cols = host.cols();
    let Some(halo) = fetch(ex, &host).map_err(exchange_error)? else {
        return Ok(None);
    };
    let n_halo = g.n_src - g.n;
    if halo.shape() != (n_halo, cols) {
        return Err(shape_error(format!(
            "the exchange returned {}x{} halo rows, the partition has {n_halo} halo sources {cols} wide",
            halo.rows(),
            halo.cols(),
        )));
    }
    Ok(Some(ops.upload_owned(halo)?))
}

pub(super) fn halo_backward<O: Ops>(
    ops: &mut O,
    g: GraphView<'_, O>,
    layer: usize,
    ext: O::Mat,
    ex: &mut dyn Exchange,
) -> Result<O::Mat, O::Error> {
    let (rows, cols) = ops.dims(&ext);
    if g.complete || (ex.is_local() && rows == g.n) {
        return Ok(ext);
    }
    let n = g.n;
    let mut own = ops.alloc(n, cols)?;
    ops.copy2d(rows_of(&ext, 0, n, cols), &mut own, 0, cols)?;
    let halo = if rows > n {
        let mut h = ops.alloc(rows - n, cols)?;
        ops.copy2d(rows_of(&ext, n, rows - n, cols), &mut h, 0, cols)?;
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
    if ex.rematerializes() {
        ex.backward_each(layer, halo.rows(), &mut from_peers, &mut |r| {
            halo.row_block(r.start, r.end)
        })
    } else {
        ex.backward(layer, halo, &mut from_peers)
    }
    .map_err(exchange_error)?;
    let up = ops.upload_owned(from_peers)?;
    ops.add_assign(&mut own, &up)?;
    ops.recycle(up);
    Ok(own)
}

pub(super) fn aggregate<O: Ops>(
    ops: &mut O,
    g: GraphView<'_, O>,
    layer: usize,
    own: &O::Mat,
    ex: &mut dyn Exchange,
) -> Result<O::Mat, O::Error> {
    let halo = ops.halo_rows(g, layer, own, ex)?;
    let cols = ops.dims(own).1;
    let mut y = ops.alloc(g.n, cols)?;
    ops.spmm(g.op, own, halo.as_ref(), &mut y)?;
    if let Some(h) = halo {
        ops.recycle(h);
    }
    Ok(y)
}

pub(super) fn aggregate_backward<O: Ops>(
    ops: &mut O,
    g: GraphView<'_, O>,
    layer: usize,
    d: &O::Mat,
    ex: &mut dyn Exchange,
) -> Result<O::Mat, O::Error> {
    let cols = ops.dims(d).1;
    let mut ext = ops.alloc(g.n_src, cols)?;
    ops.spmm_t(g.op, d, &mut ext)?;
    ops.halo_backward(g, layer, ext, ex)
}

fn product<O: Ops>(
    ops: &mut O,
    a: View<'_, O::Mat>,
    b: View<'_, O::Mat>,
) -> Result<O::Mat, O::Error> {
    let (m, n) = (a.op_shape().0, b.op_shape().1);
    let mut c = ops.alloc(m, n)?;
    ops.gemm(a, b, 0.0, &mut c)?;
    Ok(c)
}

fn whole<O: Ops>(ops: &O, m: &O::Mat) -> (usize, usize) {
    ops.dims(m)
}

pub(super) fn linear_pair<O: Ops>(
    ops: &mut O,
    h: &O::Mat,
    w: &O::Mat,
    w_root: &O::Mat,
) -> Result<(O::Mat, O::Mat), O::Error> {
    let ((hr, hc), (wr, wc)) = (whole(ops, h), whole(ops, w));
    let m = product(ops, View::full(h, hr, hc), View::full(w, wr, wc))?;
    let root = product(ops, View::full(h, hr, hc), View::full(w_root, wr, wc))?;
    Ok((m, root))
}

pub(super) fn matmul_at_pair<O: Ops>(
    ops: &mut O,
    h: &O::Mat,
    a: &O::Mat,
    b: &O::Mat,
) -> Result<(O::Mat, O::Mat), O::Error> {
    let ((hr, hc), (ar, ac), (br, bc)) = (whole(ops, h), whole(ops, a), whole(ops, b));
    let ga = product(ops, View::full(h, hr, hc).t(), View::full(a, ar, ac))?;
    let gb = product(ops, View::full(h, hr, hc).t(), View::full(b, br, bc))?;
    Ok((ga, gb))
}

/// The first layer's gradients; `block` rows of the gradient are formed at a time (`None`: 64 MiB of them).
#[allow(clippy::too_many_arguments)]
pub(super) fn fused_first_backward<O: Ops>(
    ops: &mut O,
    agg: &O::Mat,
    x_root: Option<&O::Mat>,
    x_root_dropout: Option<Dropout>,
    h1: O::Mat,
    terms: &[(&O::Mat, &O::Mat)],
    gids: Option<&O::Idx>,
    act: Activation,
    dropout: Option<Dropout>,
    block: Option<usize>,
) -> Result<FirstLayerGrads<O::Mat>, O::Error> {
    let (n, width) = ops.dims(&h1);
    for (a, w) in terms {
        let ((ar, ac), (wr, wc)) = (ops.dims(a), ops.dims(w));
        if ar != n || wr != width || wc != ac {
            return Err(shape_error(format!(
                "fused_first_backward: a {ar}-row term through a {wr}x{wc} weight for {n}x{width} hidden rows"
            )));
        }
    }
    let block = block
        .unwrap_or(FUSED_BLOCK_BYTES / (4 * width.max(1)))
        .max(1);
    // the gradient through the activation is written over `h1` a row block at a time: the hidden layer's
    // rows are read once (by the block's activation backward) before its gradient replaces them, so the
    // pass never holds a second n x width matrix
    let mut dz = h1;
    for r0 in (0..n).step_by(block) {
        let rows = block.min(n - r0);
        let mut d = ops.alloc(rows, width)?;
        for (i, (a, w)) in terms.iter().enumerate() {
            let ((_, ac), (wr, wc)) = (ops.dims(a), ops.dims(w));
            let beta = if i == 0 { 0.0 } else { 1.0 };
            ops.gemm(
                rows_of(*a, r0, rows, ac),
                View::full(*w, wr, wc).t(),
                beta,
                &mut d,
            )?;
        }
        ops.activation_backward_over(&mut d, &mut dz, gids, r0, act, dropout)?;
        ops.recycle(d);
    }
    let (ar, ac) = ops.dims(agg);
    let gw = product(ops, View::full(agg, ar, ac).t(), View::full(&dz, n, width))?;
    let gr = match (x_root, x_root_dropout) {
        (Some(x), None) => {
            let (xr, xc) = ops.dims(x);
            Some(product(
                ops,
                View::full(x, xr, xc).t(),
                View::full(&dz, n, width),
            )?)
        }
        (Some(x), Some(d)) => {
            // `dropout(X)^T dZ`, the dropped-out rows drawn a block at a time
            matmul_at_dropped(ops, x, gids, d, &[&dz])?.pop()
        }
        (None, _) => None,
    };
    let mut gb = ops.alloc(1, width)?;
    ops.col_sums(&dz, &mut gb)?;
    ops.recycle(dz);
    Ok(FirstLayerGrads {
        w: gw,
        w_root: gr,
        bias: gb,
    })
}

/// `dropout(x)^T b` for each `b` of `bs` (see [`Ops::matmul_at_dropped`]), the dropped-out rows of `x` drawn
/// a block at a time.
pub(super) fn matmul_at_dropped<O: Ops>(
    ops: &mut O,
    x: &O::Mat,
    gids: Option<&O::Idx>,
    d: Dropout,
    bs: &[&O::Mat],
) -> Result<Vec<O::Mat>, O::Error> {
    let (xr, xc) = ops.dims(x);
    let n = bs.first().map_or(0, |b| ops.dims(b).0);
    if bs.iter().any(|b| ops.dims(b).0 != n) || n > xr {
        return Err(shape_error(format!(
            "matmul_at_dropped: products over {n} rows of a {xr}x{xc} input, every one with as many rows"
        )));
    }
    let mut out = Vec::with_capacity(bs.len());
    for b in bs {
        let bc = ops.dims(b).1;
        out.push(ops.zeros(xc, bc)?);
    }
    let block = dropped_rows_block(ops, xc);
    for r0 in (0..n).step_by(block) {
        let rows = block.min(n - r0);
        let xd = dropped_rows(ops, x, gids, d, r0, rows)?;
        for (b, o) in bs.iter().zip(out.iter_mut()) {
            let bc = ops.dims(b).1;
            ops.gemm(
                View::full(&xd, rows, xc).t(),
                rows_of(*b, r0, rows, bc),
                1.0,
                o,
            )?;
        }
        ops.recycle(xd);
    }
    Ok(out)
}

/// Rows per block of a dropped-out input drawn again: [`Ops::dropped_block_bytes`] of them.
pub(super) fn dropped_rows_block<O: Ops>(ops: &O, cols: usize) -> usize {
    (ops.dropped_block_bytes() / (4 * cols.max(1))).max(1)
}

/// Rows `r0..r0 + rows` of `dropout(x)`: copied, then dropped out with the masks of those rows.
fn dropped_rows<O: Ops>(
    ops: &mut O,
    x: &O::Mat,
    gids: Option<&O::Idx>,
    d: Dropout,
    r0: usize,
    rows: usize,
) -> Result<O::Mat, O::Error> {
    let cols = ops.dims(x).1;
    let mut xd = ops.alloc(rows, cols)?;
    ops.copy2d(rows_of(x, r0, rows, cols), &mut xd, 0, cols)?;
    ops.dropout(&mut xd, gids, r0, 0, cols, d)?;
    Ok(xd)
}

/// `out += dropout(x) w` a row block at a time (see [`Ops::gemm_dropped_add`]).
pub(super) fn gemm_dropped_add<O: Ops>(
    ops: &mut O,
    x: &O::Mat,
    gids: Option<&O::Idx>,
    d: Dropout,
    w: &O::Mat,
    out: &mut O::Mat,
) -> Result<(), O::Error> {
    let ((n, cols), (wr, wc), (or, oc)) = (ops.dims(x), ops.dims(w), ops.dims(out));
    if wr != cols || or > n || oc != wc {
        return Err(shape_error(format!(
            "gemm_dropped_add: {n}x{cols} through {wr}x{wc} into {or}x{oc}"
        )));
    }
    let block = dropped_rows_block(ops, cols);
    for r0 in (0..or).step_by(block) {
        let rows = block.min(or - r0);
        let xd = dropped_rows(ops, x, gids, d, r0, rows)?;
        let mut part = ops.alloc(rows, wc)?;
        ops.gemm(
            View::full(&xd, rows, cols),
            View::full(w, wr, wc),
            0.0,
            &mut part,
        )?;
        ops.recycle(xd);
        ops.add_rows(out, r0, &part)?;
        ops.recycle(part);
    }
    Ok(())
}

/// SAR's GAT from the primitives: the halo messages put together for the one-shot kernels and dropped
/// after the layer (fetched again in backward); nothing kept but `m_own` and `s_dst`.
#[allow(clippy::too_many_arguments)]
pub(super) fn gat_forward_remat<O: Ops>(
    ops: &mut O,
    g: GraphView<'_, O>,
    layer: usize,
    m_own: &O::Mat,
    s_dst: &O::Mat,
    drop: Option<AttnDropout>,
    shape: GatShape,
    ex: &mut dyn Exchange,
    out: &mut O::Mat,
) -> Result<GatRemat<O::Mat>, O::Error> {
    let m_halo = ops.halo_rows(g, layer, m_own, ex)?;
    let heads = shape.heads as usize;
    let mut alpha = ops.alloc(g.nnz, heads)?;
    ops.gat_forward(
        g.op,
        m_own,
        m_halo.as_ref(),
        s_dst,
        g.gids,
        drop,
        shape,
        &mut alpha,
        out,
    )?;
    ops.recycle(alpha);
    if let Some(m) = m_halo {
        ops.recycle(m);
    }
    Ok(GatRemat {
        s_halo: ops.alloc(0, heads)?,
        row_max: ops.alloc(0, heads)?,
        row_sum: ops.alloc(0, heads)?,
    })
}

/// Backward of [`gat_forward_remat`]: the halo messages fetched again and put together, the coefficients
/// recomputed by the forward kernel, then the one-shot backward kernels.
#[allow(clippy::too_many_arguments)]
pub(super) fn gat_backward_remat<O: Ops>(
    ops: &mut O,
    g: GraphView<'_, O>,
    layer: usize,
    m_own: &O::Mat,
    s_dst: &O::Mat,
    st: GatRemat<O::Mat>,
    d_out: &O::Mat,
    drop: Option<AttnDropout>,
    shape: GatShape,
    ex: &mut dyn Exchange,
) -> Result<(O::Mat, O::Mat), O::Error> {
    for m in [st.s_halo, st.row_max, st.row_sum] {
        ops.recycle(m);
    }
    let heads = shape.heads as usize;
    let width = ops.dims(m_own).1;
    let m_halo = if ex.is_local() {
        None
    } else {
        let host = ops.download(m_own)?;
        let n_halo = g.n_src - g.n;
        let mut halo = Matrix::zeros(n_halo, width);
        ex.refetch_each(layer, &host, &mut put_together(&mut halo))
            .map_err(exchange_error)?;
        Some(ops.upload_owned(halo)?)
    };
    let mut alpha = ops.alloc(g.nnz, heads)?;
    let mut out = ops.alloc(g.n, shape.d_out())?;
    ops.gat_forward(
        g.op,
        m_own,
        m_halo.as_ref(),
        s_dst,
        g.gids,
        drop,
        shape,
        &mut alpha,
        &mut out,
    )?;
    ops.recycle(out);
    let mut d_score = ops.alloc(g.nnz, heads)?;
    let mut a_used = ops.alloc(g.nnz, heads)?;
    let mut ds_dst = ops.alloc(g.n, heads)?;
    ops.gat_backward_edges(
        g.op,
        m_own,
        m_halo.as_ref(),
        s_dst,
        &alpha,
        d_out,
        g.gids,
        drop,
        shape,
        &mut d_score,
        &mut a_used,
        &mut ds_dst,
    )?;
    ops.recycle(alpha);
    if let Some(m) = m_halo {
        ops.recycle(m);
    }
    let mut dm_ext = ops.alloc(g.n_src, width)?;
    ops.gat_backward_sources(g.op, &a_used, &d_score, d_out, shape, &mut dm_ext)?;
    ops.recycle(d_score);
    ops.recycle(a_used);
    let dm = ops.halo_backward(g, layer, dm_ext, ex)?;
    Ok((dm, ds_dst))
}

pub(super) fn all_reduce<O: Ops>(
    ops: &mut O,
    grads: &mut [O::Mat],
    ex: &mut dyn Exchange,
) -> Result<(), O::Error> {
    if ex.is_local() {
        return Ok(());
    }
    let mut host = grads
        .iter()
        .map(|g| ops.download(g))
        .collect::<Result<Vec<_>, _>>()?;
    ex.all_reduce(&mut host).map_err(exchange_error)?;
    for (d, h) in grads.iter_mut().zip(host) {
        let up = ops.upload_owned(h)?;
        ops.recycle(std::mem::replace(d, up));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CpuPrimitives;

    fn filled(rows: usize, cols: usize, seed: u32) -> Matrix {
        let v = (0..rows * cols)
            .map(|i| {
                let h = (i as u32 ^ seed).wrapping_mul(2654435761);
                (h >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect();
        Matrix::from_vec(rows, cols, v)
    }

    /// The gradient formed over `h1` in row blocks (the last one short) equals one block over every row:
    /// each row's gradient reads only that row of `h1` and of the terms, and dropout is keyed by the
    /// global row, so the block boundaries change nothing, bit for bit.
    #[test]
    fn fused_first_backward_is_the_same_in_any_row_blocks() {
        let (n, width, f, c) = (53, 12, 5, 4);
        let agg = filled(n, f, 1);
        let x = filled(n, f, 2);
        let (a1, w1) = (filled(n, c, 3), filled(width, c, 4));
        let (a2, w2) = (filled(n, c, 5), filled(width, c, 6));
        let terms = [(&a1, &w1), (&a2, &w2)];
        for act in [Activation::Relu, Activation::Elu] {
            for dropout in [None, Some(Dropout { key: 9, p: 0.3 })] {
                let run = |block: usize| {
                    let h1 = filled(n, width, 7);
                    fused_first_backward(
                        &mut CpuPrimitives,
                        &agg,
                        Some(&x),
                        None,
                        h1,
                        &terms,
                        None,
                        act,
                        dropout,
                        Some(block),
                    )
                    .unwrap()
                };
                let whole = run(n);
                for block in [1, 7, 52] {
                    let b = run(block);
                    let what = format!("{act:?} dropout {dropout:?} block {block}");
                    assert_eq!(b.w.data(), whole.w.data(), "{what}: weight");
                    assert_eq!(
                        b.w_root.as_ref().unwrap().data(),
                        whole.w_root.as_ref().unwrap().data(),
                        "{what}: root weight"
                    );
                    assert_eq!(b.bias.data(), whole.bias.data(), "{what}: bias");
                }
            }
        }
    }
}
