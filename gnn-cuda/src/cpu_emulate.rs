//! The SpMM kernels of [`crate::kernels::SOURCE`] executed serially on the host, thread by thread, with the
//! same launch geometry, index math and summation order: the light-row pass (`spmm_v4` / `spmm_scalar`), the
//! heavy rows cut into chunks, and the in-order sum of each heavy row's chunks.
//!
//! The rest of the device is checked on the host through `physalia_gnn::device::CpuPrimitives` (the same
//! trait with its default layer-level operations, the CPU's kernels, the same `DeviceModel`), and against the
//! CPU on a GPU (`tests/gpu.rs`). SpMM alone keeps an emulation because its chunked hub rows are an algorithm
//! of the GPU's own (the CPU walks a row in one task):
//! `tests/emulate.rs` checks it against `physalia_gnn`'s SpMM on a graph with a hub row, forward and
//! transposed, with halo rows.

use crate::kernels::{HEAVY_ROW_EDGES, HeavyPlan, SPMM_VEC, rows_launch, spmm_lanes};
use crate::ops::HostCsr;

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

/// The engine's SpMM as it launches it: one pass over the light rows, the heavy rows' chunks into partial
/// rows, and their in-order sums. `y = A [own; halo]` over `(indptr, indices, values)`, `d` columns.
fn launch_spmm(
    (indptr, indices, values): (&[i64], &[u32], &[f32]),
    own: &[f32],
    halo: &[f32],
    n_own: u32,
    y: &mut [f32],
    d: usize,
) {
    let n_rows = indptr.len().saturating_sub(1);
    if n_rows == 0 || d == 0 {
        return;
    }
    let vec4 = d.is_multiple_of(4);
    let lanes = spmm_lanes(d, vec4);
    let plan = HeavyPlan::of(indptr);
    let heavy = if plan.is_empty() {
        u64::MAX
    } else {
        HEAVY_ROW_EDGES
    };
    let pass = |a: &CsrRef<'_>, y: &mut [f32], n: u32, heavy: u64| {
        if vec4 {
            spmm_v4(a, own, halo, n_own, y, n, d as u32, lanes, heavy);
        } else {
            spmm_scalar(a, own, halo, n_own, y, n, d as u32, lanes, heavy);
        }
    };
    let rows = CsrRef {
        lo: &indptr[..n_rows],
        hi: &indptr[1..],
        indices,
        values,
    };
    pass(&rows, y, n_rows as u32, heavy);
    if !plan.is_empty() {
        let chunks = CsrRef {
            lo: &plan.lo,
            hi: &plan.hi,
            indices,
            values,
        };
        let mut partial = vec![0f32; plan.chunks() * d];
        pass(&chunks, &mut partial, plan.chunks() as u32, u64::MAX);
        spmm_heavy_reduce(
            &plan.rows,
            &plan.first,
            &partial,
            y,
            plan.rows.len() as u32,
            d as u32,
        );
    }
}

/// `Y = A [own; halo]` (`a.n_dst x d`) as the engine computes it; `own` and `halo` are row-major, `d` wide.
pub fn spmm(a: &HostCsr, own: &[f32], halo: &[f32], d: usize) -> Vec<f32> {
    assert_eq!(
        (own.len() + halo.len()),
        a.n_src * d,
        "spmm: the sources are not n_src rows of width d"
    );
    let mut y = vec![f32::NAN; a.n_dst * d];
    launch_spmm(
        (&a.indptr, &a.indices, &a.values),
        own,
        halo,
        (own.len() / d.max(1)) as u32,
        &mut y,
        d,
    );
    y
}

/// `Y = A^T X` (`a.n_src x d`) over the explicit transpose, as the engine computes it.
pub fn spmm_t(a: &HostCsr, x: &[f32], d: usize) -> Vec<f32> {
    assert_eq!(
        x.len(),
        a.n_dst * d,
        "spmm_t: x is not n_dst rows of width d"
    );
    let mut y = vec![f32::NAN; a.n_src * d];
    launch_spmm(
        (&a.t_indptr, &a.t_indices, &a.t_values),
        x,
        &[],
        a.n_dst as u32,
        &mut y,
        d,
    );
    y
}
