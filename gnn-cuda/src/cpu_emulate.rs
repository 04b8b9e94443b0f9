//! The kernels of [`crate::kernels::SOURCE`] executed serially on the host, thread by thread (or warp by warp
//! with the 32 lanes as arrays), with the same launch geometry, index math and reduction order.
//!
//! This is not a second CPU engine: it exists so the kernels' algorithms (row-to-thread mapping, the
//! transposed SpMM, the max-shifted softmax, warp reductions, the RNG port) are tested against
//! `physalia_gnn` before a GPU runs them. Each function here follows its CUDA twin line by line, in the same
//! order as the source; `__shfl_xor_sync` is [`warp_sum`] / [`warp_max`] over the lanes' values.

pub use physalia_gnn::device::{AdamStep, GatShape};

use crate::kernels::{
    COLSUM_CHUNK_ROWS, REDUCE_THREADS, SPMM_VEC, edge_key, elementwise_launch, mask_keep,
    rows_launch, stream_at,
};

const LANES: usize = 32;

/// `v += __shfl_xor_sync(FULL_MASK, v, o)` for o = 16, 8, 4, 2, 1: every lane ends with the same sum.
pub fn warp_sum(mut v: [f32; LANES]) -> f32 {
    for o in [16, 8, 4, 2, 1] {
        let prev = v;
        for (l, x) in v.iter_mut().enumerate() {
            *x = prev[l] + prev[l ^ o];
        }
    }
    v[0]
}

/// `fmaxf` butterfly: CUDA's fmaxf, like `f32::max`, ignores a NaN operand.
pub fn warp_max(mut v: [f32; LANES]) -> f32 {
    for o in [16, 8, 4, 2, 1] {
        let prev = v;
        for (l, x) in v.iter_mut().enumerate() {
            *x = prev[l].max(prev[l ^ o]);
        }
    }
    v[0]
}

/// `stream_keep` of the source.
fn stream_keep(key: u64, index: u64, threshold: u32) -> bool {
    (stream_at(key, index) >> 32) as u32 >= threshold
}

/// Threads of a launch: `(grid * block)` ids, as `blockIdx.x * blockDim.x + threadIdx.x`.
fn threads(n_rows: usize, lanes: u32) -> u32 {
    let (grid, block) = rows_launch(n_rows, lanes);
    grid * block
}

fn src_row<'a>(own: &'a [f32], halo: &'a [f32], n_own: u32, j: u32, d: u32) -> &'a [f32] {
    let d = d as usize;
    if j < n_own {
        &own[j as usize * d..(j as usize + 1) * d]
    } else {
        let j = (j - n_own) as usize;
        &halo[j * d..(j + 1) * d]
    }
}

/// The edges of a SpMM launch in the device layout: row `r` covers edges `lo[r]..hi[r]` (a CSR's `indptr`
/// and `indptr[1..]`, or the chunks of its heavy rows).
pub struct CsrRef<'a> {
    pub lo: &'a [i64],
    pub hi: &'a [i64],
    pub indices: &'a [u32],
    pub values: &'a [f32],
}

// ---- SpMM ----

#[allow(clippy::too_many_arguments)]
pub fn spmm_v4(
    a: &CsrRef<'_>,
    own: &[f32],
    halo: &[f32],
    n_own: u32,
    y: &mut [f32],
    n_rows: u32,
    d: u32,
    lanes: u32,
    heavy: u64,
) {
    assert_eq!(d % 4, 0, "spmm_v4 reads float4");
    for tid in 0..threads(n_rows as usize, lanes) {
        let row = tid / lanes;
        let gl = tid % lanes;
        if row >= n_rows {
            continue;
        }
        let (lo, hi) = (a.lo[row as usize], a.hi[row as usize]);
        if (hi - lo) as u64 > heavy {
            continue;
        }
        let pass = 4 * lanes * SPMM_VEC;
        let mut c0 = 0;
        while c0 < d {
            let mut acc = [[0f32; 4]; SPMM_VEC as usize];
            for e in lo..hi {
                let j = a.indices[e as usize];
                let w = a.values[e as usize];
                let x = src_row(own, halo, n_own, j, d);
                for (v, acc) in acc.iter_mut().enumerate() {
                    let c = c0 + 4 * (gl + lanes * v as u32);
                    if c < d {
                        let xv = &x[c as usize..c as usize + 4];
                        for q in 0..4 {
                            acc[q] += w * xv[q];
                        }
                    }
                }
            }
            for (v, acc) in acc.iter().enumerate() {
                let c = c0 + 4 * (gl + lanes * v as u32);
                if c < d {
                    let o = row as usize * d as usize + c as usize;
                    y[o..o + 4].copy_from_slice(acc);
                }
            }
            c0 += pass;
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub fn spmm_scalar(
    a: &CsrRef<'_>,
    own: &[f32],
    halo: &[f32],
    n_own: u32,
    y: &mut [f32],
    n_rows: u32,
    d: u32,
    lanes: u32,
    heavy: u64,
) {
    for tid in 0..threads(n_rows as usize, lanes) {
        let row = tid / lanes;
        let gl = tid % lanes;
        if row >= n_rows {
            continue;
        }
        let (lo, hi) = (a.lo[row as usize], a.hi[row as usize]);
        if (hi - lo) as u64 > heavy {
            continue;
        }
        let pass = lanes * SPMM_VEC;
        let mut c0 = 0;
        while c0 < d {
            let mut acc = [0f32; SPMM_VEC as usize];
            for e in lo..hi {
                let j = a.indices[e as usize];
                let w = a.values[e as usize];
                let x = src_row(own, halo, n_own, j, d);
                for (v, acc) in acc.iter_mut().enumerate() {
                    let c = c0 + gl + lanes * v as u32;
                    if c < d {
                        *acc += w * x[c as usize];
                    }
                }
            }
            for (v, acc) in acc.iter().enumerate() {
                let c = c0 + gl + lanes * v as u32;
                if c < d {
                    y[row as usize * d as usize + c as usize] = *acc;
                }
            }
            c0 += pass;
        }
    }
}

pub fn spmm_heavy_reduce(
    rows: &[u32],
    first: &[u32],
    partial: &[f32],
    y: &mut [f32],
    n_heavy: u32,
    d: u32,
) {
    let d = d as usize;
    for t in 0..n_heavy as usize * d {
        let (h, c) = (t / d, t % d);
        let mut acc = 0f32;
        for k in first[h]..first[h + 1] {
            acc += partial[k as usize * d + c];
        }
        y[rows[h] as usize * d + c] = acc;
    }
}

// ---- GAT ----

/// Warps of a one-warp-per-row launch.
fn warps(n_rows: u32) -> u32 {
    threads(n_rows as usize, 32) / 32
}

#[allow(clippy::too_many_arguments)]
pub fn gat_messages(
    z: &[f32],
    a_src: &[f32],
    a_dst: &[f32],
    m: &mut [f32],
    s_dst: &mut [f32],
    n_rows: u32,
    heads: u32,
    c: u32,
) {
    let (heads, c) = (heads as usize, c as usize);
    let hc = heads * c;
    let width = hc + heads;
    for row in 0..warps(n_rows) as usize {
        if row >= n_rows as usize {
            continue;
        }
        let zr = &z[row * hc..(row + 1) * hc];
        let mr = &mut m[row * width..(row + 1) * width];
        for lane in 0..LANES {
            for col in (lane..hc).step_by(LANES) {
                mr[col] = zr[col];
            }
        }
        for k in 0..heads {
            let (mut ps, mut pd) = ([0f32; LANES], [0f32; LANES]);
            for lane in 0..LANES {
                for t in (lane..c).step_by(LANES) {
                    let zv = zr[k * c + t];
                    ps[lane] += zv * a_src[k * c + t];
                    pd[lane] += zv * a_dst[k * c + t];
                }
            }
            mr[hc + k] = warp_sum(ps);
            s_dst[row * heads + k] = warp_sum(pd);
        }
    }
}

/// Sources of the GAT kernels: messages of owned rows, then of halo rows.
pub struct Messages<'a> {
    pub own: &'a [f32],
    pub halo: &'a [f32],
    pub n_own: u32,
}

/// Global ids and attention dropout of the GAT kernels (`use_gids`, `use_drop` in the source).
#[derive(Clone, Copy)]
pub struct GatKeys<'a> {
    pub gids: Option<&'a [u32]>,
    /// (key, 32-bit threshold, scale)
    pub drop: Option<(u64, u32, f32)>,
}

impl GatKeys<'_> {
    fn gid(&self, r: u32) -> u64 {
        match self.gids {
            Some(g) => g[r as usize] as u64,
            None => r as u64,
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub fn gat_forward(
    indptr: &[i64],
    indices: &[u32],
    msg: &Messages<'_>,
    s_dst: &[f32],
    keys: GatKeys<'_>,
    shape: GatShape,
    alpha: &mut [f32],
    out: &mut [f32],
    n_rows: u32,
) {
    let GatShape {
        heads,
        c,
        concat,
        slope,
    } = shape;
    let (hu, cu) = (heads as usize, c as usize);
    let hc = heads * c;
    let width = hc + heads;
    let d_out = if concat { hc } else { c } as usize;
    let head_scale = if concat { 1.0 } else { 1.0 / heads as f32 };
    let src = |j: u32| src_row(msg.own, msg.halo, msg.n_own, j, width);
    for i in 0..warps(n_rows) {
        if i >= n_rows {
            continue;
        }
        let lo = indptr[i as usize];
        let deg = (indptr[i as usize + 1] - lo) as usize;
        let lo = lo as usize;
        let gi = keys.gid(i);
        let orow = &mut out[i as usize * d_out..(i as usize + 1) * d_out];
        if !concat {
            orow.iter_mut().for_each(|o| *o = 0.0);
        }
        for k in 0..hu {
            let sd = s_dst[i as usize * hu + k];
            let mut mx = [f32::NEG_INFINITY; LANES];
            for (lane, mx) in mx.iter_mut().enumerate() {
                for t in (lane..deg).step_by(LANES) {
                    let j = indices[lo + t];
                    let mut x = sd + src(j)[hc as usize + k];
                    x = if x > 0.0 { x } else { slope * x };
                    alpha[(lo + t) * hu + k] = x;
                    *mx = mx.max(x);
                }
            }
            let mx = warp_max(mx);
            let mut sum = [0f32; LANES];
            for (lane, sum) in sum.iter_mut().enumerate() {
                for t in (lane..deg).step_by(LANES) {
                    let p = (lo + t) * hu + k;
                    let e = (alpha[p] - mx).exp();
                    alpha[p] = e;
                    *sum += e;
                }
            }
            let sum = warp_sum(sum);
            for lane in 0..LANES {
                for t in (lane..deg).step_by(LANES) {
                    let p = (lo + t) * hu + k;
                    alpha[p] /= sum;
                }
            }
            // __syncwarp()
            for lane in 0..LANES {
                for col in (lane..cu).step_by(LANES) {
                    let mut acc = 0f32;
                    for t in 0..deg {
                        let j = indices[lo + t];
                        let mut a_used = alpha[(lo + t) * hu + k] * head_scale;
                        if let Some((key, thr, scale)) = keys.drop {
                            let gj = keys.gid(j);
                            a_used = if stream_keep(
                                key,
                                edge_key(gi, gj, heads as u64, k as u64),
                                thr,
                            ) {
                                a_used * scale
                            } else {
                                0.0
                            };
                        }
                        acc += a_used * src(j)[k * cu + col];
                    }
                    if concat {
                        orow[k * cu + col] = acc;
                    } else {
                        orow[col] += acc;
                    }
                }
            }
        }
    }
}

/// Outputs of [`gat_backward_edges`].
pub struct EdgeGrads<'a> {
    pub d_score: &'a mut [f32],
    pub a_used: &'a mut [f32],
    pub ds_dst: &'a mut [f32],
}

#[allow(clippy::too_many_arguments)]
pub fn gat_backward_edges(
    indptr: &[i64],
    indices: &[u32],
    msg: &Messages<'_>,
    s_dst: &[f32],
    alpha: &[f32],
    d_out: &[f32],
    keys: GatKeys<'_>,
    shape: GatShape,
    out: EdgeGrads<'_>,
    n_rows: u32,
) {
    let GatShape {
        heads,
        c,
        concat,
        slope,
    } = shape;
    let EdgeGrads {
        d_score,
        a_used,
        ds_dst,
    } = out;
    let (hu, cu) = (heads as usize, c as usize);
    let hc = heads * c;
    let width = hc + heads;
    let dw = if concat { hc } else { c } as usize;
    let head_scale = if concat { 1.0 } else { 1.0 / heads as f32 };
    let src = |j: u32| src_row(msg.own, msg.halo, msg.n_own, j, width);
    for i in 0..warps(n_rows) {
        if i >= n_rows {
            continue;
        }
        let lo = indptr[i as usize];
        let deg = (indptr[i as usize + 1] - lo) as usize;
        let lo = lo as usize;
        let gi = keys.gid(i);
        for k in 0..hu {
            let g0 = i as usize * dw + if concat { k * cu } else { 0 };
            let g = &d_out[g0..g0 + cu];
            let mut sigma = 0f32;
            for t in 0..deg {
                let j = indices[lo + t];
                let p = (lo + t) * hu + k;
                let a = alpha[p];
                let mut mk = head_scale;
                if let Some((key, thr, scale)) = keys.drop {
                    let gj = keys.gid(j);
                    mk = if stream_keep(key, edge_key(gi, gj, heads as u64, k as u64), thr) {
                        mk * scale
                    } else {
                        0.0
                    };
                }
                let zj = &src(j)[k * cu..(k + 1) * cu];
                let mut dot = [0f32; LANES];
                for (lane, dot) in dot.iter_mut().enumerate() {
                    for col in (lane..cu).step_by(LANES) {
                        *dot += g[col] * zj[col];
                    }
                }
                let d_alpha = warp_sum(dot) * mk;
                a_used[p] = a * mk;
                d_score[p] = d_alpha;
                sigma += a * d_alpha;
            }
            // __syncwarp()
            let sd = s_dst[i as usize * hu + k];
            let mut acc = [0f32; LANES];
            for (lane, acc) in acc.iter_mut().enumerate() {
                for t in (lane..deg).step_by(LANES) {
                    let j = indices[lo + t];
                    let p = (lo + t) * hu + k;
                    let de = alpha[p] * (d_score[p] - sigma);
                    let x = sd + src(j)[hc as usize + k];
                    let dx = if x > 0.0 { de } else { de * slope };
                    d_score[p] = dx;
                    *acc += dx;
                }
            }
            ds_dst[i as usize * hu + k] = warp_sum(acc);
        }
    }
}

/// The transpose of a CSR with the position of each entry in the forward arrays.
pub struct TransposeRef<'a> {
    pub t_indptr: &'a [i64],
    pub t_indices: &'a [u32],
    pub t_perm: &'a [u32],
}

#[allow(clippy::too_many_arguments)]
pub fn gat_backward_sources(
    t: &TransposeRef<'_>,
    a_used: &[f32],
    d_score: &[f32],
    d_out: &[f32],
    heads: u32,
    c: u32,
    concat: bool,
    dm: &mut [f32],
    n_src: u32,
) {
    let (hu, cu) = (heads as usize, c as usize);
    let hc = hu * cu;
    let width = hc + hu;
    let dw = if concat { hc } else { cu };
    for j in 0..warps(n_src) as usize {
        if j >= n_src as usize {
            continue;
        }
        let (lo, hi) = (t.t_indptr[j] as usize, t.t_indptr[j + 1] as usize);
        for lane in 0..LANES {
            for col in (lane..width).step_by(LANES) {
                let mut acc = 0f32;
                for tt in lo..hi {
                    let i = t.t_indices[tt] as usize;
                    let pos = t.t_perm[tt] as usize * hu;
                    if col < hc {
                        let (k, cc) = (col / cu, col % cu);
                        let a = a_used[pos + k];
                        if a != 0.0 {
                            acc += a * d_out[i * dw + if concat { k * cu } else { 0 } + cc];
                        }
                    } else {
                        acc += d_score[pos + (col - hc)];
                    }
                }
                dm[j * width + col] = acc;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub fn gat_dz(
    dm: &[f32],
    ds_dst: &[f32],
    a_src: &[f32],
    a_dst: &[f32],
    dz: &mut [f32],
    n_in: u32,
    n_dst: u32,
    heads: u32,
    c: u32,
) {
    let (hu, cu) = (heads as usize, c as usize);
    let hc = hu * cu;
    let width = hc + hu;
    for (idx, o) in dz.iter_mut().enumerate().take(n_in as usize * hc) {
        let (i, col) = (idx / hc, idx % hc);
        let k = col / cu;
        let gs = dm[i * width + hc + k];
        let gd = if i < n_dst as usize {
            ds_dst[i * hu + k]
        } else {
            0.0
        };
        *o = dm[i * width + col] + (gs * a_src[col] + gd * a_dst[col]);
    }
}

// ---- elementwise ----

pub fn bias_add(x: &mut [f32], bias: &[f32], rows: u32, cols: u32) {
    let n = rows as usize * cols as usize;
    for (idx, v) in x.iter_mut().enumerate().take(n) {
        *v += bias[idx % cols as usize];
    }
}

pub fn activate(x: &mut [f32], act: u32) {
    for v in x.iter_mut() {
        *v = if act == 0 {
            v.max(0.0)
        } else if *v > 0.0 {
            *v
        } else {
            v.exp_m1()
        };
    }
}

/// Where dropout and the activation's backward read their element keys.
#[derive(Clone, Copy)]
pub struct RowKeys<'a> {
    pub gids: Option<&'a [u32]>,
    pub row0: u32,
}

impl RowKeys<'_> {
    fn gid(&self, r: u32) -> u64 {
        match self.gids {
            Some(g) => g[(self.row0 + r) as usize] as u64,
            None => (self.row0 + r) as u64,
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub fn dropout(
    x: &mut [f32],
    rows: u32,
    cols: u32,
    keys: RowKeys<'_>,
    col0: u32,
    total_cols: u32,
    key: u64,
    thr16: u32,
    scale: f32,
) {
    let n = rows as usize * cols as usize;
    for (idx, v) in x.iter_mut().enumerate().take(n) {
        let (r, col) = ((idx / cols as usize) as u32, (idx % cols as usize) as u32);
        let e = keys.gid(r) * total_cols as u64 + col0 as u64 + col as u64;
        *v = if mask_keep(key, e, thr16) {
            *v * scale
        } else {
            0.0
        };
    }
}

#[allow(clippy::too_many_arguments)]
pub fn activation_backward(
    dy: &mut [f32],
    y: &[f32],
    rows: u32,
    cols: u32,
    keys: RowKeys<'_>,
    act: u32,
    mask: Option<(u64, u32)>,
    scale: f32,
) {
    let n = rows as usize * cols as usize;
    for idx in 0..n {
        let yv = y[idx];
        if act == 0 {
            dy[idx] = if yv > 0.0 { dy[idx] * scale } else { 0.0 };
        } else {
            let mut keep = true;
            if let Some((key, thr16)) = mask {
                let (r, col) = ((idx / cols as usize) as u32, (idx % cols as usize) as u64);
                keep = mask_keep(key, keys.gid(r) * cols as u64 + col, thr16);
            }
            let a = yv / scale;
            let deriv = if a > 0.0 { 1.0 } else { a + 1.0 };
            dy[idx] = if keep { dy[idx] * deriv * scale } else { 0.0 };
        }
    }
}

pub fn add_assign(a: &mut [f32], b: &[f32]) {
    for (a, b) in a.iter_mut().zip(b) {
        *a += *b;
    }
}

/// Both column-sum kernels: partial sums per (chunk, column) with 8 row strides reduced through shared
/// memory, then the chunks in order.
pub fn col_sums(x: &[f32], rows: u32, cols: u32, out: &mut [f32]) {
    let chunks = crate::kernels::colsum_chunks(rows as usize);
    let (rows_u, cols_u) = (rows as usize, cols as usize);
    let chunk_rows = COLSUM_CHUNK_ROWS as usize;
    let mut partial = vec![0f64; chunks as usize * cols_u];
    for by in 0..chunks as usize {
        for col in 0..cols_u {
            let r0 = by * chunk_rows;
            let r1 = rows_u.min(r0 + chunk_rows);
            let mut s = [0f64; 8];
            for (ty, s) in s.iter_mut().enumerate() {
                for r in (r0 + ty..r1).step_by(8) {
                    *s += x[r * cols_u + col] as f64;
                }
            }
            partial[by * cols_u + col] = s.iter().sum();
        }
    }
    for (col, o) in out.iter_mut().enumerate().take(cols_u) {
        let mut t = 0f64;
        for k in 0..chunks as usize {
            t += partial[k * cols_u + col];
        }
        *o = t as f32;
    }
}

pub fn copy2d(src: &[f32], src_ld: u32, dst: &mut [f32], dst_ld: u32, rows: u32, cols: u32) {
    for r in 0..rows as usize {
        for col in 0..cols as usize {
            dst[r * dst_ld as usize + col] = src[r * src_ld as usize + col];
        }
    }
}

pub fn gather_rows(src: &[f32], idx: &[u32], cols: u32, dst: &mut [f32]) {
    let cols = cols as usize;
    for (e, d) in dst.iter_mut().enumerate().take(idx.len() * cols) {
        let (r, col) = (e / cols, e % cols);
        *d = src[idx[r] as usize * cols + col];
    }
}

// ---- loss ----

#[allow(clippy::too_many_arguments)]
pub fn cross_entropy(
    logits: &[f32],
    labels: &[i32],
    rows: &[u32],
    c: u32,
    scale: f32,
    grad: &mut [f32],
    loss: &mut [f64],
) {
    let cu = c as usize;
    for w in 0..warps(rows.len() as u32) as usize {
        if w >= rows.len() {
            continue;
        }
        let r = rows[w] as usize;
        let z = &logits[r * cu..(r + 1) * cu];
        let mut mx = [f32::NEG_INFINITY; LANES];
        for (lane, mx) in mx.iter_mut().enumerate() {
            for k in (lane..cu).step_by(LANES) {
                *mx = mx.max(z[k]);
            }
        }
        let mx = warp_max(mx);
        let mut s = [0f32; LANES];
        for (lane, s) in s.iter_mut().enumerate() {
            for k in (lane..cu).step_by(LANES) {
                *s += (z[k] - mx).exp();
            }
        }
        let s = warp_sum(s);
        let label = labels[r];
        loss[w] = (mx + s.ln() - z[label as usize]) as f64;
        let g = &mut grad[r * cu..(r + 1) * cu];
        for lane in 0..LANES {
            for k in (lane..cu).step_by(LANES) {
                let mut v = (z[k] - mx).exp() / s * scale;
                if k as i32 == label {
                    v -= scale;
                }
                g[k] = v;
            }
        }
    }
}

pub fn correct_rows(logits: &[f32], labels: &[i32], rows: &[u32], c: u32, flags: &mut [f64]) {
    const NONE: u32 = u32::MAX;
    let cu = c as usize;
    for w in 0..warps(rows.len() as u32) as usize {
        if w >= rows.len() {
            continue;
        }
        let r = rows[w] as usize;
        let z = &logits[r * cu..(r + 1) * cu];
        let mut best = [f32::NEG_INFINITY; LANES];
        let mut arg = [NONE; LANES];
        for lane in 0..LANES {
            for k in (lane..cu).step_by(LANES) {
                if arg[lane] == NONE || z[k] > best[lane] {
                    best[lane] = z[k];
                    arg[lane] = k as u32;
                }
            }
        }
        for o in [16, 8, 4, 2, 1] {
            let (pb, pa) = (best, arg);
            for lane in 0..LANES {
                let (ob, oa) = (pb[lane ^ o], pa[lane ^ o]);
                if oa != NONE
                    && (arg[lane] == NONE
                        || ob > best[lane]
                        || (ob == best[lane] && oa < arg[lane]))
                {
                    best[lane] = ob;
                    arg[lane] = oa;
                }
            }
        }
        flags[w] = if arg[0] as i32 == labels[r] { 1.0 } else { 0.0 };
    }
}

/// The single-block tree reduction of `sum_f64`.
pub fn sum_f64(x: &[f64]) -> f64 {
    let threads = REDUCE_THREADS as usize;
    let mut s = vec![0f64; threads];
    for (t, s) in s.iter_mut().enumerate() {
        for i in (t..x.len()).step_by(threads) {
            *s += x[i];
        }
    }
    let mut half = threads / 2;
    while half > 0 {
        for t in 0..half {
            s[t] += s[t + half];
        }
        half /= 2;
    }
    s[0]
}

pub fn adam(w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: AdamStep) {
    for i in 0..w.len() {
        let gi = g[i] + s.weight_decay * w[i];
        let mi = s.beta1 * m[i] + (1.0 - s.beta1) * gi;
        let vi = s.beta2 * v[i] + (1.0 - s.beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        w[i] -= s.step_size * mi / (vi.sqrt() / s.bc2_sqrt + s.eps);
    }
}

/// The grid of a grid-stride kernel never changes the result of the elementwise kernels above; this keeps
/// the geometry function exercised with them.
pub fn elementwise_blocks(n: usize) -> u32 {
    elementwise_launch(n).0
}
