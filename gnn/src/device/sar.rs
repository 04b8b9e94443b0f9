//! SAR (sequential aggregation and rematerialisation, MLSys 2022) on the [`super::Cpu`] device: its
//! overrides of [`super::Ops::aggregate`], [`super::Ops::aggregate_backward`] and GAT's rematerialising pair.
//!
//! When the exchange rematerialises ([`Exchange::rematerializes`]), a layer never holds every halo row at
//! once: it aggregates its owned rows, then each range of halo rows as [`Exchange::forward_each`] hands it
//! over, dropping it before the next; halo gradients are produced one range at a time
//! ([`Exchange::backward_each`]). GCN and GraphSAGE need no halo rows in backward. GAT keeps only the halo
//! rows' attention scores (`heads` values per row) and the per-destination softmax maximum and sum; its
//! attention coefficients are recomputed from them, and backward fetches the halo messages again
//! ([`Exchange::refetch_each`]) to form the gradient of the attention.
//!
//! Every range adds its terms to the rows it touches in the order of the local CSR (sources owned first,
//! then halo rows grouped by peer), so the result is the one-shot aggregation up to the order in which the
//! ranges arrive.

use rayon::prelude::*;

use super::{AttnDropout, GatRemat, GatShape, GraphView};
use crate::exchange::Exchange;
use crate::gat::{GAT_ROWS, dot, edge_key, gid, split_by_rows};
use crate::rng::Stream;
use crate::sparse::{SparseOp, col_range};
use crate::tensor::Matrix;
use crate::{Error, Result};

/// Source rows' attention scores: owned rows' from their messages, halo rows' kept from forward.
struct Scores<'a> {
    m_own: &'a Matrix,
    s_halo: &'a Matrix,
    hc: usize,
}

impl Scores<'_> {
    #[inline]
    fn get(&self, j: usize, k: usize) -> f32 {
        let n_in = self.m_own.rows();
        if j < n_in {
            self.m_own.row(j)[self.hc + k]
        } else {
            self.s_halo.row(j - n_in)[k]
        }
    }
}

/// One range of source rows: row `j` of the range is source `col0 + j`, `width` values wide.
#[derive(Clone, Copy)]
struct Segment<'a> {
    data: &'a [f32],
    width: usize,
    col0: usize,
}

impl Segment<'_> {
    fn col1(&self) -> usize {
        self.col0 + self.data.len() / self.width.max(1)
    }

    #[inline]
    fn row(&self, j: usize) -> &[f32] {
        let r = j - self.col0;
        &self.data[r * self.width..(r + 1) * self.width]
    }
}

/// The softmax of destination `i`, head `k`: its maximum and sum, with everything needed to recompute an
/// edge's coefficient exactly as the one-shot forward computes it.
struct Attention<'a> {
    s_dst: &'a [f32],
    row_max: &'a [f32],
    row_sum: &'a [f32],
    heads: usize,
    slope: f32,
}

impl Attention<'_> {
    /// The score before the leaky ReLU, and the coefficient.
    #[inline]
    fn coefficient(&self, scores: &Scores<'_>, i: usize, j: usize, k: usize) -> (f32, f32) {
        let ik = i * self.heads + k;
        let x = self.s_dst[ik] + scores.get(j, k);
        let e = if x > 0.0 { x } else { self.slope * x };
        (x, (e - self.row_max[ik]).exp() / self.row_sum[ik])
    }
}

/// `A [own; halo]` for a partition's layer, the halo rows coming through `ex`: at once, or (rematerialising)
/// one range at a time, each added and dropped.
pub(super) fn aggregate(
    op: &SparseOp,
    layer: usize,
    own: &Matrix,
    ex: &mut dyn Exchange,
) -> Result<Matrix> {
    if !ex.rematerializes() {
        let halo = ex.forward(layer, own).map_err(Error::Exchange)?;
        return Ok(op.spmm_ext(own, halo.as_ref()));
    }
    let mut y = Matrix::zeros(op.n_dst(), own.cols());
    op.spmm_cols_into(own, 0, &mut y);
    let n_own = own.rows();
    ex.forward_each(layer, own, &mut |range, rows| {
        op.spmm_cols_into(&rows, n_own + range.start, &mut y);
        Ok(())
    })
    .map_err(Error::Exchange)?;
    Ok(y)
}

/// The owned rows of `A^T d`, with the halo rows' part sent to their owners and what peers computed for our
/// rows added (rematerialising: one range of halo gradients at a time).
pub(super) fn aggregate_backward(
    op: &SparseOp,
    layer: usize,
    d: &Matrix,
    ex: &mut dyn Exchange,
) -> Result<Matrix> {
    let n = op.n_dst();
    if !ex.rematerializes() {
        let (mut own, halo) = super::cpu::split_rows(op.spmm_t(d), n);
        ex.backward(layer, halo, &mut own)
            .map_err(Error::Exchange)?;
        return Ok(own);
    }
    let mut own = op.spmm_t_range(d, 0, n);
    ex.backward_each(layer, op.n_src() - n, &mut own, &mut |r| {
        op.spmm_t_range(d, n + r.start, n + r.end)
    })
    .map_err(Error::Exchange)?;
    Ok(own)
}

/// Attention dropout as the row kernels take it.
type Drop = Option<(Stream, u32, f32)>;

fn attn_drop(d: Option<AttnDropout>) -> Drop {
    d.map(|d| {
        let (key, thr, scale) = d.kernel_args();
        (Stream::from_key(key), thr, scale)
    })
}

/// The factor an edge's coefficient is used with: the mean over heads, and attention dropout.
#[inline]
fn edge_factor(
    shape: GatShape,
    gids: Option<&[u32]>,
    drop: Drop,
    i: usize,
    j: usize,
    k: usize,
) -> f32 {
    let heads = shape.heads as usize;
    let m = if shape.concat {
        1.0
    } else {
        1.0 / heads as f32
    };
    match drop {
        Some((s, thr, scale)) => {
            if s.keep(edge_key(gid(gids, i), gid(gids, j), heads, k), thr) {
                m * scale
            } else {
                0.0
            }
        }
        None => m,
    }
}

/// GAT's forward with sequential aggregation: the halo rows' scores first (to normalise the softmax), then
/// the messages one range at a time, added into `out`.
#[allow(clippy::too_many_arguments)]
pub(super) fn gat_forward_remat(
    g: GraphView<'_, super::Cpu>,
    layer: usize,
    m_own: &Matrix,
    s_dst: &Matrix,
    attn: Option<AttnDropout>,
    shape: GatShape,
    ex: &mut dyn Exchange,
    out: &mut Matrix,
) -> Result<GatRemat<Matrix>> {
    let (heads, c) = (shape.heads as usize, shape.c as usize);
    let hc = heads * c;
    let width = hc + heads;
    let n = g.n;
    let n_in = m_own.rows();
    let s_dst = &s_dst.data()[..n * heads];
    let s_own = Matrix::from_vec(
        n_in,
        heads,
        m_own
            .data()
            .chunks_exact(width)
            .flat_map(|r| &r[hc..])
            .copied()
            .collect(),
    );
    let s_halo = ex
        .forward(layer, &s_own)
        .map_err(Error::Exchange)?
        .unwrap_or_else(|| Matrix::zeros(0, heads));
    drop(s_own);
    let op: &SparseOp = g.op;
    let scores = Scores {
        m_own,
        s_halo: &s_halo,
        hc,
    };
    // the softmax of every destination and head over all its sources, in the CSR's order
    let slope = shape.slope;
    let (indptr, indices) = (op.indptr(), op.indices());
    let mut row_max = Matrix::zeros(n, heads);
    let mut row_sum = Matrix::zeros(n, heads);
    row_max
        .data_mut()
        .par_chunks_mut(heads)
        .zip(row_sum.data_mut().par_chunks_mut(heads))
        .enumerate()
        .with_min_len(64)
        .for_each_init(Vec::new, |e, (i, (mx, sm))| {
            let (lo, hi) = (indptr[i], indptr[i + 1]);
            for k in 0..heads {
                let sd = s_dst[i * heads + k];
                e.clear();
                let mut max = f32::NEG_INFINITY;
                for &j in &indices[lo..hi] {
                    let x = sd + scores.get(j as usize, k);
                    let x = if x > 0.0 { x } else { slope * x };
                    max = max.max(x);
                    e.push(x);
                }
                let mut sum = 0f32;
                for x in e.iter() {
                    sum += (*x - max).exp();
                }
                mx[k] = max;
                sm[k] = sum;
            }
        });
    let att = Attention {
        s_dst,
        row_max: row_max.data(),
        row_sum: row_sum.data(),
        heads,
        slope,
    };
    let gids = g.gids.map(Vec::as_slice);
    let adrop = attn_drop(attn);
    out.fill(0.0);
    let own = Segment {
        data: m_own.data(),
        width,
        col0: 0,
    };
    gat_accumulate(shape, gids, op, &scores, &att, adrop, own, out);
    ex.forward_each(layer, m_own, &mut |range, rows| {
        let seg = Segment {
            data: rows.data(),
            width,
            col0: n_in + range.start,
        };
        gat_accumulate(shape, gids, op, &scores, &att, adrop, seg, out);
        Ok(())
    })
    .map_err(Error::Exchange)?;
    Ok(GatRemat {
        s_halo,
        row_max,
        row_sum,
    })
}

/// `out += sum_j alpha_ij Z_j` over the edges whose sources lie in `seg`.
#[allow(clippy::too_many_arguments)]
fn gat_accumulate(
    shape: GatShape,
    gids: Option<&[u32]>,
    op: &SparseOp,
    scores: &Scores<'_>,
    att: &Attention<'_>,
    adrop: Drop,
    seg: Segment<'_>,
    out: &mut Matrix,
) {
    let (heads, c) = (shape.heads as usize, shape.c as usize);
    let d_out = out.cols();
    let (indptr, indices) = (op.indptr(), op.indices());
    let (col0, col1) = (seg.col0, seg.col1());
    out.data_mut()
        .par_chunks_mut(d_out)
        .enumerate()
        .with_min_len(GAT_ROWS)
        .for_each(|(i, orow)| {
            let (lo, hi) = col_range(indices, indptr[i], indptr[i + 1], col0, col1);
            for k in 0..heads {
                let o = if shape.concat {
                    &mut orow[k * c..(k + 1) * c]
                } else {
                    &mut orow[..]
                };
                for &j in &indices[lo..hi] {
                    let j = j as usize;
                    let (_, a) = att.coefficient(scores, i, j, k);
                    let a_used = a * edge_factor(shape, gids, adrop, i, j, k);
                    let zj = &seg.row(j)[k * c..(k + 1) * c];
                    for (ov, &zv) in o.iter_mut().zip(zj) {
                        *ov += a_used * zv;
                    }
                }
            }
        });
}

/// GAT's backward with rematerialisation: the halo messages are fetched again for the gradient of the
/// attention; coefficients are recomputed; halo gradients go back one range at a time. Returns the owned
/// rows' `[dZ | ds_src]` and `ds_dst`.
#[allow(clippy::too_many_arguments)]
pub(super) fn gat_backward_remat(
    g: GraphView<'_, super::Cpu>,
    layer: usize,
    m_own: &Matrix,
    s_dst: &Matrix,
    st: GatRemat<Matrix>,
    d_out: &Matrix,
    attn: Option<AttnDropout>,
    shape: GatShape,
    ex: &mut dyn Exchange,
) -> Result<(Matrix, Matrix)> {
    let (heads, c) = (shape.heads as usize, shape.c as usize);
    let hc = heads * c;
    let width = hc + heads;
    let n = g.n;
    let n_in = m_own.rows();
    let op: &SparseOp = g.op;
    let (indptr, indices) = (op.indptr(), op.indices());
    let nnz = op.nnz();
    let gids = g.gids.map(Vec::as_slice);
    let scores = Scores {
        m_own,
        s_halo: &st.s_halo,
        hc,
    };
    let att = Attention {
        s_dst: &s_dst.data()[..n * heads],
        row_max: st.row_max.data(),
        row_sum: st.row_sum.data(),
        heads,
        slope: shape.slope,
    };
    let adrop = attn_drop(attn);
    let g_head = |i: usize, k: usize| -> &[f32] {
        let row = d_out.row(i);
        if shape.concat {
            &row[k * c..(k + 1) * c]
        } else {
            &row[..c]
        }
    };
    // pass 1a, per range of sources: d(alpha) per edge and head (it needs Z_j), and sigma_i = sum a d(alpha)
    let mut d_alpha = vec![0f32; nnz * heads];
    let mut sigma = vec![0f32; n * heads];
    let pass_1a = |seg: Segment<'_>, d_alpha: &mut [f32], sigma: &mut [f32]| {
        let (col0, col1) = (seg.col0, seg.col1());
        let chunks = split_by_rows(d_alpha, indptr, GAT_ROWS, heads);
        sigma
            .par_chunks_mut(GAT_ROWS * heads)
            .zip(chunks)
            .enumerate()
            .for_each(|(chunk, (sg, da))| {
                let first = chunk * GAT_ROWS;
                let base = indptr[first];
                for r in 0..sg.len() / heads {
                    let i = first + r;
                    let (lo, hi) = col_range(indices, indptr[i], indptr[i + 1], col0, col1);
                    for k in 0..heads {
                        let gi = g_head(i, k);
                        for (t, &j) in indices[lo..hi].iter().enumerate() {
                            let j = j as usize;
                            let (_, a) = att.coefficient(&scores, i, j, k);
                            let m = edge_factor(shape, gids, adrop, i, j, k);
                            let zj = &seg.row(j)[k * c..(k + 1) * c];
                            let d = dot(gi, zj) * m;
                            da[(lo + t - base) * heads + k] = d;
                            sg[r * heads + k] += a * d;
                        }
                    }
                }
            });
    };
    let own = Segment {
        data: m_own.data(),
        width,
        col0: 0,
    };
    pass_1a(own, &mut d_alpha, &mut sigma);
    ex.refetch_each(layer, m_own, &mut |range, rows| {
        let seg = Segment {
            data: rows.data(),
            width,
            col0: n_in + range.start,
        };
        pass_1a(seg, &mut d_alpha, &mut sigma);
        Ok(())
    })
    .map_err(Error::Exchange)?;
    // pass 1b, per destination: the used attention, d(score) per edge (in place of d(alpha)), d s_dst
    let mut d_score = d_alpha;
    let mut a_used = vec![0f32; nnz * heads];
    let mut ds_dst = Matrix::zeros(n, heads);
    {
        let ds_chunks = split_by_rows(&mut d_score, indptr, GAT_ROWS, heads);
        let au_chunks = split_by_rows(&mut a_used, indptr, GAT_ROWS, heads);
        ds_dst
            .data_mut()
            .par_chunks_mut(GAT_ROWS * heads)
            .zip(ds_chunks)
            .zip(au_chunks)
            .enumerate()
            .for_each(|(chunk, ((sd_out, dsc), au))| {
                let first = chunk * GAT_ROWS;
                let base = indptr[first];
                for r in 0..sd_out.len() / heads {
                    let i = first + r;
                    let (lo, hi) = (indptr[i], indptr[i + 1]);
                    for k in 0..heads {
                        let sg = sigma[i * heads + k];
                        let mut acc = 0f32;
                        for (t, &j) in indices[lo..hi].iter().enumerate() {
                            let j = j as usize;
                            let pos = (lo - base + t) * heads + k;
                            let (x, a) = att.coefficient(&scores, i, j, k);
                            au[pos] = a * edge_factor(shape, gids, adrop, i, j, k);
                            let de = a * (dsc[pos] - sg);
                            let dx = if x > 0.0 { de } else { de * att.slope };
                            dsc[pos] = dx;
                            acc += dx;
                        }
                        sd_out[r * heads + k] = acc;
                    }
                }
            });
    }
    drop(sigma);
    // pass 2, per source over the transpose: [dZ_j | d s_src_j] for a range of sources
    let (t_indptr, t_indices, t_perm) = (op.t_indptr(), op.t_indices(), op.t_perm());
    let dm_rows = |j0: usize, j1: usize| -> Matrix {
        let mut dm = Matrix::zeros(j1 - j0, width);
        dm.data_mut()
            .par_chunks_mut(width)
            .enumerate()
            .with_min_len(64)
            .for_each(|(r, row)| {
                let j = j0 + r;
                for t in t_indptr[j]..t_indptr[j + 1] {
                    let i = t_indices[t] as usize;
                    let pos = t_perm[t] as usize * heads;
                    for k in 0..heads {
                        let a = a_used[pos + k];
                        if a != 0.0 {
                            let gi = g_head(i, k);
                            for (o, &v) in row[k * c..(k + 1) * c].iter_mut().zip(gi) {
                                *o += a * v;
                            }
                        }
                        row[hc + k] += d_score[pos + k];
                    }
                }
            });
        dm
    };
    let mut dm = dm_rows(0, n);
    ex.backward_each(layer, g.n_src - n, &mut dm, &mut |r| {
        dm_rows(n + r.start, n + r.end)
    })
    .map_err(Error::Exchange)?;
    Ok((dm, ds_dst))
}
