//! GAT's kernels on the host, row-parallel with rayon: messages, the edge softmax with attention dropout, and
//! the two backward passes (per destination over the CSR, per source over its transpose).
//!
//! They are the [`crate::device::Cpu`] device's GAT primitives (and so [`crate::Model`]'s); the
//! rematerialising variants of `device/sar.rs` reuse their pieces. Each writes its output rows from one task
//! and never scatters, so results do not depend on the thread count. The CUDA twins are
//! `physalia-gnn-cuda`'s `kernels.rs`.

use rayon::prelude::*;

use crate::device::GatShape;
use crate::gather::prefetch_l2;
use crate::rng::Stream;
use crate::sparse::{SparseOp, Src};

/// Rows per task in the row-parallel GAT kernels.
pub(crate) const GAT_ROWS: usize = 128;

/// Edges ahead of the current one whose gathered rows (and per-edge values) the kernels prefetch: random
/// rows otherwise make every edge wait on memory (issue 34: the per-source backward at 4 heads of 8 was
/// 40% of a GAT epoch).
const AHEAD: usize = 16;

/// Attention dropout as the kernels apply it: the stream, the 32-bit threshold and the keep scale.
pub(crate) type AttnDrop = Option<(Stream, u32, f32)>;

/// `a . b` in a fixed order the compiler vectorises: 16 interleaved partial sums (partial `l` takes
/// elements `l`, `l + 16`, ...), then the partials halved pairwise, then the tail of fewer than 16 in order.
/// One chain of adds (the first version) ran at the latency of an add per element, the cost of GAT's
/// backward over edges (issue 34). The same bits on every x86 CPU: no run-time dispatch, no fused
/// multiply-add.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 16;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; L];
    let (ca, cb) = (a.chunks_exact(L), b.chunks_exact(L));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..L {
            acc[l] += x[l] * y[l];
        }
    }
    let mut w = L;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    let mut sum = acc[0];
    for (x, y) in ra.iter().zip(rb) {
        sum += x * y;
    }
    sum
}

/// The dropout index of (destination, source, head) on an edge, from global ids.
#[inline]
pub(crate) fn edge_key(dst: u64, src: u64, heads: usize, k: usize) -> u64 {
    ((dst << 32) | src)
        .wrapping_mul(heads as u64)
        .wrapping_add(k as u64)
}

/// The global id of source row `row` (`None`: the row is its own id).
#[inline]
pub(crate) fn gid(gids: Option<&[u32]>, row: usize) -> u64 {
    match gids {
        Some(g) => g[row] as u64,
        None => row as u64,
    }
}

/// Splits a per-edge array (`heads` values per edge) into the pieces owned by consecutive blocks of `rows`
/// destination rows, so row blocks can write their edges in parallel.
pub(crate) fn split_by_rows<'a>(
    mut data: &'a mut [f32],
    indptr: &[usize],
    rows: usize,
    heads: usize,
) -> Vec<&'a mut [f32]> {
    let n = indptr.len() - 1;
    let mut out = Vec::with_capacity(n.div_ceil(rows));
    let mut start = 0;
    while start < n {
        let end = (start + rows).min(n);
        let len = (indptr[end] - indptr[start]) * heads;
        let (head, tail) = std::mem::take(&mut data).split_at_mut(len);
        out.push(head);
        data = tail;
        start = end;
    }
    out
}

/// Prefetches source row `j` of `src`, if there is one.
#[inline(always)]
fn prefetch_row(src: &Src<'_>, j: usize) {
    if j < src.n_own + src.halo.len() / src.d.max(1) {
        prefetch_l2(src.row(j).as_ptr(), src.d * 4);
    }
}

fn dims(s: GatShape) -> (usize, usize, usize) {
    let (heads, c) = (s.heads as usize, s.c as usize);
    (heads, c, heads * c)
}

/// `m = [Z | s_src]` (rows `hc + heads` wide) and `s_dst` (rows `heads` wide) from `z` (rows `hc` wide):
/// `s = Z . a` per head.
pub(crate) fn messages(
    z: &[f32],
    a_src: &[f32],
    a_dst: &[f32],
    shape: GatShape,
    m: &mut [f32],
    s_dst: &mut [f32],
) {
    let (heads, c, hc) = dims(shape);
    m.par_chunks_mut(hc + heads)
        .zip(s_dst.par_chunks_mut(heads))
        .zip(z.par_chunks(hc))
        .for_each(|((m, sd), zr)| {
            m[..hc].copy_from_slice(zr);
            for k in 0..heads {
                let zh = &zr[k * c..(k + 1) * c];
                m[hc + k] = dot(zh, &a_src[k * c..(k + 1) * c]);
                sd[k] = dot(zh, &a_dst[k * c..(k + 1) * c]);
            }
        });
}

/// The edge softmax of every destination of `op` and the attention-weighted sum of its sources' `Z`:
/// `alpha` (nnz x heads) gets the coefficients before dropout, `out` (zeroed, `n_dst x d_out`) the sums.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    op: &SparseOp,
    src: &Src<'_>,
    s_dst: &[f32],
    gids: Option<&[u32]>,
    attn_drop: AttnDrop,
    shape: GatShape,
    alpha: &mut [f32],
    out: &mut [f32],
) {
    let (heads, c, hc) = dims(shape);
    let (concat, slope) = (shape.concat, shape.slope);
    let d_out = shape.d_out();
    let (indptr, indices) = (op.indptr(), op.indices());
    let alpha_chunks = split_by_rows(alpha, indptr, GAT_ROWS, heads);
    out.par_chunks_mut(GAT_ROWS * d_out)
        .zip(alpha_chunks)
        .enumerate()
        .for_each(|(chunk, (out, alpha))| {
            let first = chunk * GAT_ROWS;
            let base = indptr[first];
            let mut e = Vec::new();
            for (r, orow) in out.chunks_exact_mut(d_out).enumerate() {
                let i = first + r;
                let (lo, hi) = (indptr[i], indptr[i + 1]);
                for k in 0..heads {
                    let sd = s_dst[i * heads + k];
                    e.clear();
                    let mut max = f32::NEG_INFINITY;
                    for (t, &j) in (lo..hi).zip(&indices[lo..hi]) {
                        if k == 0 && t + AHEAD < indices.len() {
                            prefetch_row(src, indices[t + AHEAD] as usize);
                        }
                        let x = sd + src.row(j as usize)[hc + k];
                        let x = if x > 0.0 { x } else { slope * x };
                        max = max.max(x);
                        e.push(x);
                    }
                    let mut sum = 0f32;
                    for x in e.iter_mut() {
                        *x = (*x - max).exp();
                        sum += *x;
                    }
                    let o = if concat {
                        &mut orow[k * c..(k + 1) * c]
                    } else {
                        &mut orow[..]
                    };
                    let head_scale = if concat { 1.0 } else { 1.0 / heads as f32 };
                    for (t, &j) in indices[lo..hi].iter().enumerate() {
                        let a = e[t] / sum;
                        alpha[(lo - base + t) * heads + k] = a;
                        let mut a_used = a * head_scale;
                        if let Some((s, thr, scale)) = attn_drop {
                            let key = edge_key(gid(gids, i), gid(gids, j as usize), heads, k);
                            a_used = if s.keep(key, thr) {
                                a_used * scale
                            } else {
                                0.0
                            };
                        }
                        let zj = &src.row(j as usize)[k * c..(k + 1) * c];
                        for (ov, &zv) in o.iter_mut().zip(zj) {
                            *ov += a_used * zv;
                        }
                    }
                }
            }
        });
}

/// Backward pass 1, per destination row: the gradient of every edge's score (`d_score`), the attention as
/// used in forward (`a_used`: head averaging and dropout applied), and the gradient of `s_dst` (`ds_dst`,
/// `n_dst x heads`), from the output gradient `d_out` (`n_dst x d_out`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_edges(
    op: &SparseOp,
    src: &Src<'_>,
    s_dst: &[f32],
    alpha: &[f32],
    d_out: &[f32],
    gids: Option<&[u32]>,
    attn_drop: AttnDrop,
    shape: GatShape,
    d_score: &mut [f32],
    a_used: &mut [f32],
    ds_dst: &mut [f32],
) {
    let (heads, c, hc) = dims(shape);
    let (concat, slope) = (shape.concat, shape.slope);
    let dw = shape.d_out();
    let (indptr, indices) = (op.indptr(), op.indices());
    let head_scale = if concat { 1.0 } else { 1.0 / heads as f32 };
    // gradient of head k's output for destination i
    let g_head = |i: usize, k: usize| -> &[f32] {
        let row = &d_out[i * dw..(i + 1) * dw];
        if concat {
            &row[k * c..(k + 1) * c]
        } else {
            &row[..c]
        }
    };
    let ds_chunks = split_by_rows(d_score, indptr, GAT_ROWS, heads);
    let au_chunks = split_by_rows(a_used, indptr, GAT_ROWS, heads);
    ds_dst
        .par_chunks_mut(GAT_ROWS * heads)
        .zip(ds_chunks)
        .zip(au_chunks)
        .enumerate()
        .for_each(|(chunk, ((sd_out, dsc), au))| {
            let first = chunk * GAT_ROWS;
            let base = indptr[first];
            let mut da = Vec::new();
            for r in 0..sd_out.len() / heads {
                let i = first + r;
                let (lo, hi) = (indptr[i], indptr[i + 1]);
                for k in 0..heads {
                    let gi = g_head(i, k);
                    da.clear();
                    let mut sigma = 0f32;
                    for (t, &j) in indices[lo..hi].iter().enumerate() {
                        if k == 0 && lo + t + AHEAD < indices.len() {
                            prefetch_row(src, indices[lo + t + AHEAD] as usize);
                        }
                        // `pos` indexes this block's slices, `alpha` is the whole array
                        let pos = (lo - base + t) * heads + k;
                        let a = alpha[(lo + t) * heads + k];
                        let mut m = head_scale;
                        if let Some((s, thr, scale)) = attn_drop {
                            let key = edge_key(gid(gids, i), gid(gids, j as usize), heads, k);
                            m = if s.keep(key, thr) { m * scale } else { 0.0 };
                        }
                        au[pos] = a * m;
                        let zj = &src.row(j as usize)[k * c..(k + 1) * c];
                        let d_alpha = dot(gi, zj) * m;
                        sigma += a * d_alpha;
                        da.push(d_alpha);
                    }
                    let sd = s_dst[i * heads + k];
                    let mut acc = 0f32;
                    for (t, &j) in indices[lo..hi].iter().enumerate() {
                        let pos = (lo - base + t) * heads + k;
                        let de = alpha[(lo + t) * heads + k] * (da[t] - sigma);
                        let x = sd + src.row(j as usize)[hc + k];
                        let dx = if x > 0.0 { de } else { de * slope };
                        dsc[pos] = dx;
                        acc += dx;
                    }
                    sd_out[r * heads + k] = acc;
                }
            }
        });
}

/// Backward pass 2, per source row over the transpose: `dm = [dZ | ds_src]` (zeroed, `n_src x (hc + heads)`)
/// of every source.
pub(crate) fn backward_sources(
    op: &SparseOp,
    a_used: &[f32],
    d_score: &[f32],
    d_out: &[f32],
    shape: GatShape,
    dm: &mut [f32],
) {
    let (heads, c, hc) = dims(shape);
    let concat = shape.concat;
    let dw = shape.d_out();
    let g_head = |i: usize, k: usize| -> &[f32] {
        let row = &d_out[i * dw..(i + 1) * dw];
        if concat {
            &row[k * c..(k + 1) * c]
        } else {
            &row[..c]
        }
    };
    let (t_indptr, t_indices, t_perm) = (op.t_indptr(), op.t_indices(), op.t_perm());
    let nnz = t_indices.len();
    dm.par_chunks_mut(hc + heads)
        .enumerate()
        .for_each(|(j, row)| {
            for t in t_indptr[j]..t_indptr[j + 1] {
                if t + AHEAD < nnz {
                    // the output gradient's row and the edge's values, all at random
                    let (i, pos) = (
                        t_indices[t + AHEAD] as usize,
                        t_perm[t + AHEAD] as usize * heads,
                    );
                    prefetch_l2(d_out.as_ptr().wrapping_add(i * dw), dw * 4);
                    prefetch_l2(a_used.as_ptr().wrapping_add(pos), heads * 4);
                    prefetch_l2(d_score.as_ptr().wrapping_add(pos), heads * 4);
                }
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
}

/// Through the scores `s = Z . a` into `Z`: `dz` (`n_in x hc`) from `dm` (`n_in x (hc + heads)`) and
/// `ds_dst` (the first `ds_dst.len() / heads` rows are destinations).
pub(crate) fn dz(
    dm: &[f32],
    ds_dst: &[f32],
    a_src: &[f32],
    a_dst: &[f32],
    shape: GatShape,
    dz: &mut [f32],
) {
    let (heads, c, hc) = dims(shape);
    let width = hc + heads;
    let n = ds_dst.len() / heads.max(1);
    dz.par_chunks_mut(hc).enumerate().for_each(|(i, dzr)| {
        let dmr = &dm[i * width..(i + 1) * width];
        dzr.copy_from_slice(&dmr[..hc]);
        for k in 0..heads {
            let gs = dmr[hc + k];
            let gd = if i < n { ds_dst[i * heads + k] } else { 0.0 };
            for t in 0..c {
                dzr[k * c + t] += gs * a_src[k * c + t] + gd * a_dst[k * c + t];
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::dot;

    #[test]
    fn dot_is_the_sum_of_products_at_every_length() {
        for n in 0..70 {
            let a: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.5 - 1.25).collect();
            let b: Vec<f32> = (0..n).map(|i| (i % 5) as f32 * 0.3 + 0.1).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let got = dot(&a, &b) as f64;
            assert!(
                (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "n={n}: {got} vs {want}"
            );
            // the shorter slice bounds it
            assert_eq!(
                dot(&a, &b[..n / 2]).to_bits(),
                dot(&a[..n / 2], &b[..n / 2]).to_bits()
            );
        }
    }
}
