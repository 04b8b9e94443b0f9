//! The CUDA C source of every kernel (compiled at run time by NVRTC), the launch geometry both the engine and
//! the emulator use, and the ports of the engine's random-number keys.
//!
//! The SpMM kernels have a line-by-line twin in [`crate::cpu_emulate`] that runs the same per-thread logic
//! serially on the host (checked against `physalia_gnn`'s SpMM, hub rows included); the other kernels are
//! checked against the CPU engine on a GPU (`tests/gpu.rs`), and the RNG ports here by unit tests.
//!
//! Conventions: row-major f32 matrices; CSR `indptr` is `long long`, `indices` are `unsigned`; one warp per
//! row for the kernels that reduce over a row's edges, so no atomics are used anywhere and every result is
//! deterministic (the sums run in a fixed order for a given launch geometry).

use physalia_gnn::rng::mix64;

/// Threads per block of every kernel.
pub const BLOCK: u32 = 256;
/// Warps per block.
pub const WARPS_PER_BLOCK: u32 = BLOCK / 32;
/// float4 column groups each lane of an SpMM row group accumulates per pass over the row's edges.
pub const SPMM_VEC: u32 = 4;
/// Rows per partial sum of the column-sum kernel (fixed, so sums do not depend on the GPU).
pub const COLSUM_CHUNK_ROWS: u32 = 8192;
/// Threads of the single-block reduction.
pub const REDUCE_THREADS: u32 = 1024;
/// Grid size cap of the grid-stride elementwise kernels.
pub const MAX_ELEMENTWISE_BLOCKS: u32 = 65_535;

/// Lanes that cooperate on one SpMM row: enough for every float4 (or float) of a row up to a full warp, a
/// power of two so a warp holds `32 / lanes` whole rows.
pub fn spmm_lanes(d: usize, vec4: bool) -> u32 {
    let units = if vec4 { d / 4 } else { d }.clamp(1, 32) as u32;
    // the largest power of two <= units
    1 << (31 - units.leading_zeros())
}

/// Rows with more in-edges than this are not walked by one group of lanes alone: their edges are cut into
/// chunks of [`HEAVY_CHUNK_EDGES`] that run in parallel, and a second kernel sums each row's chunks in order
/// (a hub row of 100k edges would otherwise keep one warp busy for the whole SpMM).
pub const HEAVY_ROW_EDGES: u64 = 2048;
pub const HEAVY_CHUNK_EDGES: i64 = 1024;

/// The heavy rows of a CSR and their chunks: `rows[h]`'s chunks are `first[h]..first[h + 1]`, chunk `k`
/// covers edges `lo[k]..hi[k]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeavyPlan {
    pub rows: Vec<u32>,
    pub first: Vec<u32>,
    pub lo: Vec<i64>,
    pub hi: Vec<i64>,
}

impl HeavyPlan {
    /// The rows of `indptr` with more than [`HEAVY_ROW_EDGES`] edges (empty when there are none).
    pub fn of(indptr: &[i64]) -> HeavyPlan {
        let mut p = HeavyPlan::default();
        for (row, w) in indptr.windows(2).enumerate() {
            let (lo, hi) = (w[0], w[1]);
            if (hi - lo) as u64 <= HEAVY_ROW_EDGES {
                continue;
            }
            p.first.push(p.lo.len() as u32);
            p.rows.push(row as u32);
            let mut e = lo;
            while e < hi {
                p.lo.push(e);
                p.hi.push((e + HEAVY_CHUNK_EDGES).min(hi));
                e += HEAVY_CHUNK_EDGES;
            }
        }
        if !p.rows.is_empty() {
            p.first.push(p.lo.len() as u32);
        }
        p
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn chunks(&self) -> usize {
        self.lo.len()
    }
}

/// `(grid, block)` for `n_rows` rows of `lanes` threads each.
pub fn rows_launch(n_rows: usize, lanes: u32) -> (u32, u32) {
    let threads = n_rows as u64 * lanes as u64;
    assert!(
        threads <= u32::MAX as u64 - BLOCK as u64,
        "too many rows for one launch"
    );
    ((threads as u32).div_ceil(BLOCK).max(1), BLOCK)
}

/// `(grid, block)` for a grid-stride loop over `n` elements.
pub fn elementwise_launch(n: usize) -> (u32, u32) {
    let blocks = (n as u64)
        .div_ceil(BLOCK as u64)
        .clamp(1, MAX_ELEMENTWISE_BLOCKS as u64);
    (blocks as u32, BLOCK)
}

/// Number of row chunks of the column-sum kernel.
pub fn colsum_chunks(rows: usize) -> u32 {
    (rows as u64).div_ceil(COLSUM_CHUNK_ROWS as u64).max(1) as u32
}

/// The key of `physalia_gnn::rng::Stream::new(seed, parts)` (the field is private there; the test
/// `stream_key_matches_the_engine` checks this port draw for draw).
pub fn stream_key(seed: u64, parts: &[u64]) -> u64 {
    let mut key = mix64(seed ^ 0x5048_5953_414C_4941);
    for &p in parts {
        key = mix64(key ^ p);
    }
    key
}

/// `Stream::at`.
pub fn stream_at(key: u64, index: u64) -> u64 {
    mix64(key.wrapping_add(index.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
}

/// The 16-bit threshold of `physalia_gnn::rng::Mask::new(_, p)`.
pub fn mask_threshold(p: f32) -> u32 {
    ((p as f64) * 65536.0).round().min(65535.0) as u32
}

/// `Mask::keep`: lane `idx % 4` of the hash of `idx / 4`.
pub fn mask_keep(key: u64, idx: u64, thr16: u32) -> bool {
    let h = stream_at(key, idx >> 2);
    ((h >> (16 * (idx & 3))) & 0xFFFF) as u32 >= thr16
}

/// GAT's attention-dropout index of (destination, source, head), from global ids (`model.rs`'s `edge_key`).
pub fn edge_key(dst: u64, src: u64, heads: u64, k: u64) -> u64 {
    ((dst << 32) | src).wrapping_mul(heads).wrapping_add(k)
}

/// Activation codes shared with the kernels.
pub const ACT_RELU: u32 = 0;
pub const ACT_ELU: u32 = 1;

/// Kernel names, in the order of [`SOURCE`].
pub const KERNELS: &[&str] = &[
    "spmm_v4",
    "spmm_scalar",
    "spmm_heavy_reduce",
    "gat_messages",
    "gat_forward",
    "gat_backward_edges",
    "gat_backward_sources",
    "gat_dz",
    "bias_add",
    "activate",
    "dropout",
    "bias_act_dropout",
    "activation_backward",
    "activation_backward_over",
    "add_assign",
    "col_sums_partial",
    "col_sums_finish",
    "copy2d",
    "gather_rows",
    "cross_entropy",
    "correct_rows",
    "sum_f64",
    "adam",
    "copy_bandwidth",
];

/// The kernels, one NVRTC program.
pub const SOURCE: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;
typedef long long i64;

#define FULL_MASK 0xffffffffu
#define SPMM_VEC 4
// no headers under NVRTC: spell out what math.h would give
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ u32 umin(u32 a, u32 b) { return a < b ? a : b; }

// ---- random numbers: rng.rs ported (Stream::at, Stream::keep, Mask::keep) ----

__device__ __forceinline__ u64 mix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64 stream_at(u64 key, u64 index) {
    return mix64(key + index * 0x9E3779B97F4A7C15ull);
}

// Stream::keep: true with probability 1 - p for the 32-bit threshold of drop_threshold(p).
__device__ __forceinline__ bool stream_keep(u64 key, u64 index, u32 threshold) {
    return (u32)(stream_at(key, index) >> 32) >= threshold;
}

// Mask::keep: four 16-bit lanes per hash.
__device__ __forceinline__ bool mask_keep(u64 key, u64 idx, u32 thr16) {
    const u64 h = stream_at(key, idx >> 2);
    return (u32)((h >> (16 * (idx & 3))) & 0xFFFFull) >= thr16;
}

__device__ __forceinline__ u64 edge_key(u64 dst, u64 src, u64 heads, u64 k) {
    return ((dst << 32) | src) * heads + k;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Row j of the sources: owned rows first, then halo rows (sparse.rs's Src).
__device__ __forceinline__ const float* src_row(const float* own, const float* halo, u32 n_own, u32 j, u32 d) {
    return j < n_own ? own + (u64)j * d : halo + (u64)(j - n_own) * d;
}

// ---- SpMM: Y = A X over a CSR (rows = outputs). Forward uses the CSR, backward the explicit transpose,
// so neither scatters. `lanes` threads (a power of two <= 32) share a row: a warp holds 32 / lanes rows,
// so narrow outputs (16 classes) do not leave most of a warp idle. Each lane accumulates SPMM_VEC column
// groups per pass over the row's edges, in edge order (the CPU's order). Row r covers edges
// lo[r]..hi[r] (the CSR's indptr and indptr + 1, or the chunks of heavy rows); rows of more than `heavy`
// edges are left to the chunked pass. ----

extern "C" __global__ void spmm_v4(const i64* __restrict__ lo_at, const i64* __restrict__ hi_at,
                                   const u32* __restrict__ indices, const float* __restrict__ values,
                                   const float* __restrict__ own, const float* __restrict__ halo, u32 n_own,
                                   float* __restrict__ y, u32 n_rows, u32 d, u32 lanes, u64 heavy) {
    const u32 tid = blockIdx.x * blockDim.x + threadIdx.x;
    const u32 row = tid / lanes;
    const u32 gl = tid % lanes;
    if (row >= n_rows) return;
    const i64 lo = lo_at[row], hi = hi_at[row];
    if ((u64)(hi - lo) > heavy) return;
    const u32 pass = 4 * lanes * SPMM_VEC;
    for (u32 c0 = 0; c0 < d; c0 += pass) {
        float4 acc[SPMM_VEC];
#pragma unroll
        for (int v = 0; v < SPMM_VEC; ++v) acc[v].x = acc[v].y = acc[v].z = acc[v].w = 0.f;
        for (i64 e = lo; e < hi; ++e) {
            const u32 j = indices[e];
            const float w = values[e];
            const float* x = src_row(own, halo, n_own, j, d);
#pragma unroll
            for (int v = 0; v < SPMM_VEC; ++v) {
                const u32 c = c0 + 4 * (gl + lanes * v);
                if (c < d) {
                    const float4 xv = *reinterpret_cast<const float4*>(x + c);
                    acc[v].x += w * xv.x;
                    acc[v].y += w * xv.y;
                    acc[v].z += w * xv.z;
                    acc[v].w += w * xv.w;
                }
            }
        }
#pragma unroll
        for (int v = 0; v < SPMM_VEC; ++v) {
            const u32 c = c0 + 4 * (gl + lanes * v);
            if (c < d) *reinterpret_cast<float4*>(y + (u64)row * d + c) = acc[v];
        }
    }
}

// The same for widths that are not a multiple of 4.
extern "C" __global__ void spmm_scalar(const i64* __restrict__ lo_at, const i64* __restrict__ hi_at,
                                       const u32* __restrict__ indices, const float* __restrict__ values,
                                       const float* __restrict__ own, const float* __restrict__ halo,
                                       u32 n_own, float* __restrict__ y, u32 n_rows, u32 d, u32 lanes,
                                       u64 heavy) {
    const u32 tid = blockIdx.x * blockDim.x + threadIdx.x;
    const u32 row = tid / lanes;
    const u32 gl = tid % lanes;
    if (row >= n_rows) return;
    const i64 lo = lo_at[row], hi = hi_at[row];
    if ((u64)(hi - lo) > heavy) return;
    const u32 pass = lanes * SPMM_VEC;
    for (u32 c0 = 0; c0 < d; c0 += pass) {
        float acc[SPMM_VEC];
#pragma unroll
        for (int v = 0; v < SPMM_VEC; ++v) acc[v] = 0.f;
        for (i64 e = lo; e < hi; ++e) {
            const u32 j = indices[e];
            const float w = values[e];
            const float* x = src_row(own, halo, n_own, j, d);
#pragma unroll
            for (int v = 0; v < SPMM_VEC; ++v) {
                const u32 c = c0 + gl + lanes * v;
                if (c < d) acc[v] += w * x[c];
            }
        }
#pragma unroll
        for (int v = 0; v < SPMM_VEC; ++v) {
            const u32 c = c0 + gl + lanes * v;
            if (c < d) y[(u64)row * d + c] = acc[v];
        }
    }
}

// Heavy rows: y[rows[h]] = the sum of its chunks' partial rows first[h]..first[h + 1], in chunk order.
extern "C" __global__ void spmm_heavy_reduce(const u32* __restrict__ rows, const u32* __restrict__ first,
                                             const float* __restrict__ partial, float* __restrict__ y,
                                             u32 n_heavy, u32 d) {
    const u64 total = (u64)n_heavy * d;
    for (u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += (u64)gridDim.x * blockDim.x) {
        const u32 h = (u32)(t / d), c = (u32)(t % d);
        float acc = 0.f;
        for (u32 k = first[h]; k < first[h + 1]; ++k) acc += partial[(u64)k * d + c];
        y[(u64)rows[h] * d + c] = acc;
    }
}

// ---- GAT (model.rs gat_forward / gat_backward). Messages are [Z | s_src] rows of width hc + heads. ----

// One warp per input row: m = [z | z_k . a_src_k], s_dst_k = z_k . a_dst_k.
extern "C" __global__ void gat_messages(const float* __restrict__ z, const float* __restrict__ a_src,
                                        const float* __restrict__ a_dst, float* __restrict__ m,
                                        float* __restrict__ s_dst, u32 n_rows, u32 heads, u32 c) {
    const u32 row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 lane = threadIdx.x & 31;
    if (row >= n_rows) return;
    const u32 hc = heads * c, width = hc + heads;
    const float* zr = z + (u64)row * hc;
    float* mr = m + (u64)row * width;
    for (u32 col = lane; col < hc; col += 32) mr[col] = zr[col];
    for (u32 k = 0; k < heads; ++k) {
        float ps = 0.f, pd = 0.f;
        for (u32 t = lane; t < c; t += 32) {
            const float zv = zr[k * c + t];
            ps += zv * a_src[k * c + t];
            pd += zv * a_dst[k * c + t];
        }
        ps = warp_sum(ps);
        pd = warp_sum(pd);
        if (lane == 0) {
            mr[hc + k] = ps;
            s_dst[(u64)row * heads + k] = pd;
        }
    }
}

// One warp per destination row: LeakyReLU scores, a max-shifted softmax over the row's edges per head, and
// the attention-weighted sum of the sources' Z. Writes alpha (per edge and head, before attention dropout)
// and out (before the bias). Heads are concatenated, or averaged (`concat` = 0).
extern "C" __global__ void gat_forward(const i64* __restrict__ indptr, const u32* __restrict__ indices,
                                       const float* __restrict__ m_own, const float* __restrict__ m_halo,
                                       u32 n_own, const float* __restrict__ s_dst,
                                       const u32* __restrict__ gids, u32 use_gids, u64 drop_key,
                                       u32 drop_threshold, float drop_scale, u32 use_drop, float slope,
                                       u32 heads, u32 c, u32 concat, float* __restrict__ alpha,
                                       float* __restrict__ out, u32 n_rows) {
    const u32 i = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 lane = threadIdx.x & 31;
    if (i >= n_rows) return;
    const u32 hc = heads * c, width = hc + heads;
    const u32 d_out = concat ? hc : c;
    const i64 lo = indptr[i];
    const u32 deg = (u32)(indptr[i + 1] - lo);
    const float head_scale = concat ? 1.f : 1.f / (float)heads;
    const u64 gi = use_gids ? (u64)gids[i] : (u64)i;
    float* orow = out + (u64)i * d_out;
    if (!concat)
        for (u32 col = lane; col < c; col += 32) orow[col] = 0.f;
    for (u32 k = 0; k < heads; ++k) {
        const float sd = s_dst[(u64)i * heads + k];
        float mx = NEG_INF;
        for (u32 t = lane; t < deg; t += 32) {
            const u32 j = indices[lo + t];
            float x = sd + src_row(m_own, m_halo, n_own, j, width)[hc + k];
            x = x > 0.f ? x : slope * x;
            alpha[(u64)(lo + t) * heads + k] = x;
            mx = fmaxf(mx, x);
        }
        mx = warp_max(mx);
        float sum = 0.f;
        for (u32 t = lane; t < deg; t += 32) {
            const u64 p = (u64)(lo + t) * heads + k;
            const float e = expf(alpha[p] - mx);
            alpha[p] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        for (u32 t = lane; t < deg; t += 32) {
            const u64 p = (u64)(lo + t) * heads + k;
            alpha[p] = alpha[p] / sum;
        }
        __syncwarp();
        for (u32 col = lane; col < c; col += 32) {
            float acc = 0.f;
            for (u32 t = 0; t < deg; ++t) {
                const u32 j = indices[lo + t];
                float a_used = alpha[(u64)(lo + t) * heads + k] * head_scale;
                if (use_drop) {
                    const u64 gj = use_gids ? (u64)gids[j] : (u64)j;
                    a_used = stream_keep(drop_key, edge_key(gi, gj, heads, k), drop_threshold)
                                 ? a_used * drop_scale : 0.f;
                }
                acc += a_used * src_row(m_own, m_halo, n_own, j, width)[k * c + col];
            }
            if (concat) orow[k * c + col] = acc;
            else orow[col] += acc;
        }
    }
}

// Backward pass 1, one warp per destination row: per edge and head the used attention (dropout and head
// averaging applied), and the gradient of the score sum (through the softmax and the LeakyReLU), summed per
// destination into ds_dst.
extern "C" __global__ void gat_backward_edges(const i64* __restrict__ indptr, const u32* __restrict__ indices,
                                              const float* __restrict__ m_own, const float* __restrict__ m_halo,
                                              u32 n_own, const float* __restrict__ s_dst,
                                              const float* __restrict__ alpha, const float* __restrict__ d_out,
                                              const u32* __restrict__ gids, u32 use_gids, u64 drop_key,
                                              u32 drop_threshold, float drop_scale, u32 use_drop, float slope,
                                              u32 heads, u32 c, u32 concat, float* __restrict__ d_score,
                                              float* __restrict__ a_used, float* __restrict__ ds_dst,
                                              u32 n_rows) {
    const u32 i = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 lane = threadIdx.x & 31;
    if (i >= n_rows) return;
    const u32 hc = heads * c, width = hc + heads;
    const u32 dw = concat ? hc : c;
    const i64 lo = indptr[i];
    const u32 deg = (u32)(indptr[i + 1] - lo);
    const float head_scale = concat ? 1.f : 1.f / (float)heads;
    const u64 gi = use_gids ? (u64)gids[i] : (u64)i;
    for (u32 k = 0; k < heads; ++k) {
        const float* g = d_out + (u64)i * dw + (concat ? k * c : 0);
        // the lanes take the row's edges, each its edge's whole dot product (the head's c columns of the
        // source's message, one cache line at c = 32): no reduction per edge, one per head for sigma
        float sigma = 0.f;
        for (u32 t = lane; t < deg; t += 32) {
            const u32 j = indices[lo + t];
            const u64 p = (u64)(lo + t) * heads + k;
            const float a = alpha[p];
            float mk = head_scale;
            if (use_drop) {
                const u64 gj = use_gids ? (u64)gids[j] : (u64)j;
                mk = stream_keep(drop_key, edge_key(gi, gj, heads, k), drop_threshold) ? mk * drop_scale : 0.f;
            }
            const float* zj = src_row(m_own, m_halo, n_own, j, width) + k * c;
            float dot = 0.f;
            for (u32 col = 0; col < c; ++col) dot += g[col] * zj[col];
            const float d_alpha = dot * mk;
            a_used[p] = a * mk;
            d_score[p] = d_alpha;
            sigma += a * d_alpha;
        }
        sigma = warp_sum(sigma);
        __syncwarp();
        const float sd = s_dst[(u64)i * heads + k];
        float acc = 0.f;
        for (u32 t = lane; t < deg; t += 32) {
            const u32 j = indices[lo + t];
            const u64 p = (u64)(lo + t) * heads + k;
            const float de = alpha[p] * (d_score[p] - sigma);
            const float x = sd + src_row(m_own, m_halo, n_own, j, width)[hc + k];
            const float dx = x > 0.f ? de : de * slope;
            d_score[p] = dx;
            acc += dx;
        }
        acc = warp_sum(acc);
        if (lane == 0) ds_dst[(u64)i * heads + k] = acc;
        __syncwarp();
    }
}

// Backward pass 2, one warp per source row over the transpose: the gradient of the source's message row
// [dZ_j | d s_src_j], gathering from its destinations (no scatter).
extern "C" __global__ void gat_backward_sources(const i64* __restrict__ t_indptr,
                                                const u32* __restrict__ t_indices,
                                                const u32* __restrict__ t_perm,
                                                const float* __restrict__ a_used,
                                                const float* __restrict__ d_score,
                                                const float* __restrict__ d_out, u32 heads, u32 c,
                                                u32 concat, float* __restrict__ dm, u32 n_src) {
    const u32 j = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 lane = threadIdx.x & 31;
    if (j >= n_src) return;
    const u32 hc = heads * c, width = hc + heads;
    const u32 dw = concat ? hc : c;
    const i64 lo = t_indptr[j], hi = t_indptr[j + 1];
    for (u32 col = lane; col < width; col += 32) {
        float acc = 0.f;
        for (i64 t = lo; t < hi; ++t) {
            const u32 i = t_indices[t];
            const u64 pos = (u64)t_perm[t] * heads;
            if (col < hc) {
                const u32 k = col / c, cc = col % c;
                const float a = a_used[pos + k];
                if (a != 0.f) acc += a * d_out[(u64)i * dw + (concat ? k * c : 0) + cc];
            } else {
                acc += d_score[pos + (col - hc)];
            }
        }
        dm[(u64)j * width + col] = acc;
    }
}

// dZ = dm[:, :hc] + d s_src (x) a_src + d s_dst (x) a_dst, per head; rows >= n_dst have no s_dst gradient.
extern "C" __global__ void gat_dz(const float* __restrict__ dm, const float* __restrict__ ds_dst,
                                  const float* __restrict__ a_src, const float* __restrict__ a_dst,
                                  float* __restrict__ dz, u32 n_in, u32 n_dst, u32 heads, u32 c) {
    const u32 hc = heads * c, width = hc + heads;
    const u64 n = (u64)n_in * hc;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x) {
        const u32 i = (u32)(idx / hc), col = (u32)(idx % hc), k = col / c;
        const float gs = dm[(u64)i * width + hc + k];
        const float gd = i < n_dst ? ds_dst[(u64)i * heads + k] : 0.f;
        dz[idx] = dm[(u64)i * width + col] + (gs * a_src[col] + gd * a_dst[col]);
    }
}

// ---- elementwise (model.rs add_bias, activate, dropout_cols, activation_backward; tensor.rs) ----

extern "C" __global__ void bias_add(float* __restrict__ x, const float* __restrict__ bias, u32 rows, u32 cols) {
    const u64 n = (u64)rows * cols;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x)
        x[idx] += bias[idx % cols];
}

extern "C" __global__ void activate(float* __restrict__ x, u32 n, u32 act) {
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x) {
        const float v = x[idx];
        x[idx] = act == 0 ? fmaxf(v, 0.f) : (v > 0.f ? v : expm1f(v));
    }
}

// Inverted dropout keyed by global element index gid(row) * total_cols + col0 + col (Mask::apply).
extern "C" __global__ void dropout(float* __restrict__ x, u32 rows, u32 cols, const u32* __restrict__ gids,
                                   u32 use_gids, u32 row0, u32 col0, u32 total_cols, u64 key, u32 thr16,
                                   float scale) {
    const u64 n = (u64)rows * cols;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x) {
        const u32 r = (u32)(idx / cols), col = (u32)(idx % cols);
        const u64 g = use_gids ? (u64)gids[row0 + r] : (u64)(row0 + r);
        const u64 e = g * total_cols + col0 + col;
        x[idx] = mask_keep(key, e, thr16) ? x[idx] * scale : 0.f;
    }
}

// A hidden layer's epilogue in one pass, x = dropout(act(x + bias)): bias_add, activate and dropout (a whole
// matrix's mask, gid(row) * cols + col) with the same float operations, so the same bits.
extern "C" __global__ void bias_act_dropout(float* __restrict__ x, const float* __restrict__ bias, u32 rows,
                                            u32 cols, u32 act, const u32* __restrict__ gids, u32 use_gids,
                                            u32 use_mask, u64 key, u32 thr16, float scale) {
    const u64 n = (u64)rows * cols;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x) {
        u32 r, col;
        if (n <= 0xffffffffull) {  // 32-bit division where the matrix allows it (64-bit is emulated)
            r = (u32)idx / cols;
            col = (u32)idx - r * cols;
        } else {
            r = (u32)(idx / cols);
            col = (u32)(idx % cols);
        }
        float v = x[idx] + bias[col];
        v = act == 0 ? fmaxf(v, 0.f) : (v > 0.f ? v : expm1f(v));
        if (use_mask) {
            const u64 g = use_gids ? (u64)gids[r] : (u64)r;
            v = mask_keep(key, g * cols + col, thr16) ? v * scale : 0.f;
        }
        x[idx] = v;
    }
}

// dy (gradient of y = dropout(act(z))) becomes the gradient of z, from y and, for ELU, the regenerated mask.
// The gradient of z at element idx of a row block starting at row0, from dy and y = dropout(act(z)).
__device__ __forceinline__ float act_grad(float dyv, float yv, u64 idx, u32 cols, const u32* __restrict__ gids,
                                          u32 use_gids, u32 row0, u32 act, u32 use_mask, u64 key, u32 thr16,
                                          float scale) {
    if (act == 0) return yv > 0.f ? dyv * scale : 0.f;
    bool keep = true;
    if (use_mask) {
        const u32 r = (u32)(idx / cols), col = (u32)(idx % cols);
        const u64 g = use_gids ? (u64)gids[row0 + r] : (u64)(row0 + r);
        keep = mask_keep(key, g * cols + col, thr16);
    }
    const float a = yv / scale;
    const float deriv = a > 0.f ? 1.f : a + 1.f;
    return keep ? dyv * deriv * scale : 0.f;
}

extern "C" __global__ void activation_backward(float* __restrict__ dy, const float* __restrict__ y, u32 rows,
                                               u32 cols, const u32* __restrict__ gids, u32 use_gids, u32 row0,
                                               u32 act, u32 use_mask, u64 key, u32 thr16, float scale) {
    const u64 n = (u64)rows * cols;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x)
        dy[idx] = act_grad(dy[idx], y[idx], idx, cols, gids, use_gids, row0, act, use_mask, key, thr16, scale);
}

// activation_backward written over y (the block's rows of the activations), dy only read.
extern "C" __global__ void activation_backward_over(const float* __restrict__ dy, float* __restrict__ y, u32 rows,
                                                    u32 cols, const u32* __restrict__ gids, u32 use_gids, u32 row0,
                                                    u32 act, u32 use_mask, u64 key, u32 thr16, float scale) {
    const u64 n = (u64)rows * cols;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x)
        y[idx] = act_grad(dy[idx], y[idx], idx, cols, gids, use_gids, row0, act, use_mask, key, thr16, scale);
}

extern "C" __global__ void add_assign(float* __restrict__ a, const float* __restrict__ b, u32 n) {
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x)
        a[idx] += b[idx];
}

// Column sums in f64 over fixed row chunks (grid: column blocks of 32 x chunks; block 32 x 8), then the
// chunks in order: the same bits on every GPU and every run.
extern "C" __global__ void col_sums_partial(const float* __restrict__ x, u32 rows, u32 cols, u32 chunk_rows,
                                            double* __restrict__ partial) {
    __shared__ double s[8][32];
    const u32 col = blockIdx.x * 32 + threadIdx.x;
    const u32 r0 = blockIdx.y * chunk_rows;
    const u32 r1 = umin(rows, r0 + chunk_rows);
    double acc = 0.0;
    if (col < cols)
        for (u32 r = r0 + threadIdx.y; r < r1; r += 8) acc += (double)x[(u64)r * cols + col];
    s[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < cols) {
        double t = 0.0;
        for (int k = 0; k < 8; ++k) t += s[k][threadIdx.x];
        partial[(u64)blockIdx.y * cols + col] = t;
    }
}

extern "C" __global__ void col_sums_finish(const double* __restrict__ partial, u32 chunks, u32 cols,
                                           float* __restrict__ out) {
    const u32 col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols) return;
    double t = 0.0;
    for (u32 k = 0; k < chunks; ++k) t += partial[(u64)k * cols + col];
    out[col] = (float)t;
}

// dst[r * dst_ld + c] = src[r * src_ld + c]: column blocks, splits and GAT's diagonal head blocks.
extern "C" __global__ void copy2d(const float* __restrict__ src, u32 src_ld, float* __restrict__ dst, u32 dst_ld,
                                  u32 rows, u32 cols) {
    const u64 n = (u64)rows * cols;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x) {
        const u32 r = (u32)(idx / cols), col = (u32)(idx % cols);
        dst[(u64)r * dst_ld + col] = src[(u64)r * src_ld + col];
    }
}

// Rows of src listed in idx, packed (the rows a worker sends to a peer).
extern "C" __global__ void gather_rows(const float* __restrict__ src, const u32* __restrict__ idx, u32 n_idx,
                                       u32 cols, float* __restrict__ dst) {
    const u64 n = (u64)n_idx * cols;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x) {
        const u32 r = (u32)(e / cols), col = (u32)(e % cols);
        dst[e] = src[(u64)idx[r] * cols + col];
    }
}

// ---- loss (loss.rs): one warp per listed row ----

// Cross-entropy of the listed rows: per-row loss (f64) and the gradient of sum / normalizer (scale).
// Rows not listed keep whatever grad holds (the caller zeroes it).
extern "C" __global__ void cross_entropy(const float* __restrict__ logits, const int* __restrict__ labels,
                                         const u32* __restrict__ rows, u32 n_list, u32 c, float scale,
                                         float* __restrict__ grad, double* __restrict__ loss) {
    const u32 w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 lane = threadIdx.x & 31;
    if (w >= n_list) return;
    const u32 r = rows[w];
    const float* z = logits + (u64)r * c;
    float mx = NEG_INF;
    for (u32 k = lane; k < c; k += 32) mx = fmaxf(mx, z[k]);
    mx = warp_max(mx);
    float s = 0.f;
    for (u32 k = lane; k < c; k += 32) s += expf(z[k] - mx);
    s = warp_sum(s);
    const int label = labels[r];
    if (lane == 0) loss[w] = (double)(mx + logf(s) - z[label]);
    float* g = grad + (u64)r * c;
    for (u32 k = lane; k < c; k += 32) {
        float v = expf(z[k] - mx) / s * scale;
        if ((int)k == label) v -= scale;
        g[k] = v;
    }
}

// 1.0 where the first arg-max of a listed row equals its label.
extern "C" __global__ void correct_rows(const float* __restrict__ logits, const int* __restrict__ labels,
                                        const u32* __restrict__ rows, u32 n_list, u32 c,
                                        double* __restrict__ flags) {
    const u32 w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u32 lane = threadIdx.x & 31;
    if (w >= n_list) return;
    const u32 r = rows[w];
    const float* z = logits + (u64)r * c;
    float best = NEG_INF;
    u32 arg = 0xffffffffu;
    for (u32 k = lane; k < c; k += 32)
        if (arg == 0xffffffffu || z[k] > best) { best = z[k]; arg = k; }
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(FULL_MASK, best, o);
        const u32 oa = __shfl_xor_sync(FULL_MASK, arg, o);
        if (oa != 0xffffffffu && (arg == 0xffffffffu || ob > best || (ob == best && oa < arg))) {
            best = ob;
            arg = oa;
        }
    }
    if (lane == 0) flags[w] = (int)arg == labels[r] ? 1.0 : 0.0;
}

// One block: the f64 sum of x[0..n] in a fixed order.
extern "C" __global__ void sum_f64(const double* __restrict__ x, u32 n, double* __restrict__ out) {
    __shared__ double s[1024];
    double acc = 0.0;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) acc += x[i];
    s[threadIdx.x] = acc;
    __syncthreads();
    for (u32 half = blockDim.x / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) s[threadIdx.x] += s[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = s[0];
}

// ---- Adam with L2 as torch.optim.Adam computes it (optim.rs); step_size = lr / (1 - beta1^t) ----

extern "C" __global__ void adam(float* __restrict__ w, const float* __restrict__ g, float* __restrict__ m,
                                float* __restrict__ v, u32 n, float step_size, float beta1, float beta2,
                                float eps, float weight_decay, float bc2_sqrt) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float gi = g[i] + weight_decay * w[i];
        const float mi = beta1 * m[i] + (1.f - beta1) * gi;
        const float vi = beta2 * v[i] + (1.f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        w[i] -= step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    }
}

// ---- a plain device copy, the yardstick of achieved bandwidth ----

extern "C" __global__ void copy_bandwidth(const float4* __restrict__ src, float4* __restrict__ dst, u64 n4) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (u64)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"#;

#[cfg(test)]
mod tests {
    use super::*;
    use physalia_gnn::rng::{Mask, Stream, drop_threshold};

    #[test]
    fn stream_key_matches_the_engine() {
        for (seed, parts) in [
            (0u64, vec![]),
            (7, vec![0xD0, 3, 1]),
            (u64::MAX, vec![0xA7D, 9, 0]),
        ] {
            let s = Stream::new(seed, &parts);
            let key = stream_key(seed, &parts);
            for i in (0..10_000u64).chain([u64::MAX - 3, 1 << 40]) {
                assert_eq!(stream_at(key, i), s.at(i));
            }
        }
    }

    #[test]
    fn mask_port_matches_the_engine() {
        for p in [0.0f32, 0.1, 0.5, 0.6, 0.999] {
            let key = stream_key(3, &[0xD0, 1, 0]);
            let mask = Mask::new(Stream::new(3, &[0xD0, 1, 0]), p);
            let thr = mask_threshold(p);
            for idx in 0..5000u64 {
                assert_eq!(mask_keep(key, idx, thr), mask.keep(idx), "p {p} idx {idx}");
            }
            let t32 = drop_threshold(p);
            let s = Stream::new(3, &[0xD0, 1, 0]);
            for idx in 0..5000u64 {
                assert_eq!((stream_at(key, idx) >> 32) as u32 >= t32, s.keep(idx, t32));
            }
        }
    }

    #[test]
    fn every_kernel_is_in_the_source() {
        for k in KERNELS {
            assert!(
                SOURCE.contains(&format!("__global__ void {k}(")),
                "{k} missing"
            );
        }
        assert_eq!(
            SOURCE.matches("__global__").count(),
            KERNELS.len(),
            "a kernel is missing from KERNELS"
        );
    }

    #[test]
    fn geometry() {
        assert_eq!(spmm_lanes(256, true), 32);
        assert_eq!(spmm_lanes(128, true), 32);
        assert_eq!(spmm_lanes(16, true), 4);
        assert_eq!(spmm_lanes(40, true), 8);
        assert_eq!(spmm_lanes(7, false), 4);
        assert_eq!(spmm_lanes(0, false), 1);
        assert_eq!(rows_launch(10, 32), (2, 256));
        assert_eq!(elementwise_launch(0), (1, 256));
        assert_eq!(elementwise_launch(1 << 30).0, MAX_ELEMENTWISE_BLOCKS);
        assert_eq!(colsum_chunks(8193), 2);
    }
}
