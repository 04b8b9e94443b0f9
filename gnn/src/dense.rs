//! Dense products on the CPU: `matrixmultiply`'s single-threaded SGEMM micro-kernels, parallelised here
//! over fixed row blocks with rayon.
//!
//! GNN products are tall and narrow (a million rows times 128 or 256 columns). Splitting the tall side into
//! fixed blocks keeps every thread busy, and because the blocks do not depend on the thread count, products
//! whose reduction runs over the tall side (`A^T B`, the weight gradients) are summed in a fixed order: the
//! same bits on 1 or 16 threads.

use rayon::prelude::*;

use crate::tensor::Matrix;

/// Output rows per task for the row-parallel products.
pub(crate) const ROW_BLOCK: usize = 2048;
/// At most this many partial products are kept for `A^T B`; more rows mean taller blocks.
const MAX_PARTIALS: usize = 64;
const MIN_REDUCTION_BLOCK: usize = 8192;

/// `C = A B` (`accumulate`: `C += A B`). A: m x k, B: k x n, C: m x n.
pub fn matmul_into(a: &Matrix, b: &Matrix, c: &mut Matrix, accumulate: bool) {
    let (m, k) = a.shape();
    let (k2, n) = b.shape();
    assert_eq!(k, k2, "matmul inner dimensions differ");
    assert_eq!(c.shape(), (m, n), "matmul output shape");
    if n == 0 || m == 0 {
        return;
    }
    let beta = if accumulate { 1.0 } else { 0.0 };
    let bd = b.data();
    c.data_mut()
        .par_chunks_mut(ROW_BLOCK * n)
        .zip(a.data().par_chunks(ROW_BLOCK * k.max(1)))
        .for_each(|(cb, ab)| {
            let rows = cb.len() / n;
            // SAFETY: the pointers cover rows x k, k x n and rows x n row-major f32 buffers, checked above.
            unsafe {
                matrixmultiply::sgemm(
                    rows,
                    k,
                    n,
                    1.0,
                    ab.as_ptr(),
                    k as isize,
                    1,
                    bd.as_ptr(),
                    n as isize,
                    1,
                    beta,
                    cb.as_mut_ptr(),
                    n as isize,
                    1,
                );
            }
        });
}

pub fn matmul(a: &Matrix, b: &Matrix) -> Matrix {
    let mut c = Matrix::zeros(a.rows(), b.cols());
    matmul_into(a, b, &mut c, false);
    c
}

/// `C = A B^T` (`accumulate`: `C += A B^T`). A: m x k, B: n x k, C: m x n.
pub fn matmul_bt_into(a: &Matrix, b: &Matrix, c: &mut Matrix, accumulate: bool) {
    let (m, k) = a.shape();
    let (n, k2) = b.shape();
    assert_eq!(k, k2, "matmul_bt inner dimensions differ");
    assert_eq!(c.shape(), (m, n), "matmul_bt output shape");
    if n == 0 || m == 0 {
        return;
    }
    let beta = if accumulate { 1.0 } else { 0.0 };
    let bd = b.data();
    c.data_mut()
        .par_chunks_mut(ROW_BLOCK * n)
        .zip(a.data().par_chunks(ROW_BLOCK * k.max(1)))
        .for_each(|(cb, ab)| {
            let rows = cb.len() / n;
            // SAFETY: B is read transposed through its strides (row stride 1, column stride k).
            unsafe {
                matrixmultiply::sgemm(
                    rows,
                    k,
                    n,
                    1.0,
                    ab.as_ptr(),
                    k as isize,
                    1,
                    bd.as_ptr(),
                    1,
                    k as isize,
                    beta,
                    cb.as_mut_ptr(),
                    n as isize,
                    1,
                );
            }
        });
}

pub fn matmul_bt(a: &Matrix, b: &Matrix) -> Matrix {
    let mut c = Matrix::zeros(a.rows(), b.rows());
    matmul_bt_into(a, b, &mut c, false);
    c
}

/// Rows per block when a reduction runs over `rows` rows: a function of the row count only, so sums are the
/// same for any number of threads.
pub fn reduction_block(rows: usize) -> usize {
    MIN_REDUCTION_BLOCK.max(rows.div_ceil(MAX_PARTIALS))
}

/// `C (+)= A B^T` on the calling thread, with A given as `rows` row-major rows of width `k` (a row block of a
/// larger matrix, read in place) and C as `rows` rows of width `b.rows()`. B: n x k.
pub fn matmul_bt_rows_into(a: &[f32], k: usize, b: &Matrix, c: &mut [f32], accumulate: bool) {
    let n = b.rows();
    assert_eq!(b.cols(), k, "matmul_bt inner dimensions differ");
    let rows = a.len() / k.max(1);
    assert_eq!(c.len(), rows * n, "matmul_bt output is rows x n");
    if rows == 0 || n == 0 {
        return;
    }
    // SAFETY: A is rows x k and C rows x n (checked above); B is read transposed through its strides.
    unsafe {
        matrixmultiply::sgemm(
            rows,
            k,
            n,
            1.0,
            a.as_ptr(),
            k as isize,
            1,
            b.data().as_ptr(),
            1,
            k as isize,
            if accumulate { 1.0 } else { 0.0 },
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// `C (+)= A^T B` on the calling thread: A and B given as the same number of row-major rows, of widths `m`
/// and `n` (row blocks of larger matrices, read in place); C is m x n, row-major.
pub fn matmul_at_rows_into(
    a: &[f32],
    m: usize,
    b: &[f32],
    n: usize,
    c: &mut [f32],
    accumulate: bool,
) {
    let rows = a.len() / m.max(1);
    assert_eq!(b.len(), rows * n, "matmul_at row counts differ");
    assert_eq!(c.len(), m * n, "matmul_at output is m x n");
    if m == 0 || n == 0 {
        return;
    }
    if rows == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return;
    }
    // SAFETY: shapes checked above; A is read transposed through its strides.
    unsafe {
        matrixmultiply::sgemm(
            m,
            rows,
            n,
            1.0,
            a.as_ptr(),
            1,
            m as isize,
            b.as_ptr(),
            n as isize,
            1,
            if accumulate { 1.0 } else { 0.0 },
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// `C = A^T B`. A: r x m, B: r x n, C: m x n; the reduction runs over the r rows.
pub fn matmul_at(a: &Matrix, b: &Matrix) -> Matrix {
    let (r, m) = a.shape();
    let (r2, n) = b.shape();
    assert_eq!(r, r2, "matmul_at row counts differ");
    let c = Matrix::zeros(m, n);
    if r == 0 || m == 0 || n == 0 {
        return c;
    }
    let block = reduction_block(r);
    let partials: Vec<Vec<f32>> = a
        .data()
        .par_chunks(block * m)
        .zip(b.data().par_chunks(block * n))
        .map(|(ab, bb)| block_at_b(ab, bb, m, n))
        .collect();
    sum_partials(c, partials)
}

/// `A^T [B_1 | B_2 | ...]`, equal to [`matmul_at`] of `A` and the column concatenation of the `B`s, bit for bit
/// (each row block of the concatenation is assembled as [`matmul_at`] would read it), without the
/// concatenation ever existing whole: a block of it at a time.
pub fn matmul_at_concat(a: &Matrix, bs: &[&Matrix]) -> Matrix {
    at_concat(a, a.rows(), bs, None)
}

/// [`matmul_at_concat`] of `f(A)` over `A`'s first `rows` rows, where `f` changes rows independently (input
/// dropout): each row block of `A` is copied and passed to `draw` with its first row's index before its
/// product, so `f(A)` never exists whole. Equal bit for bit to [`matmul_at_concat`] of `f(A)`'s first `rows`
/// rows (the same blocks, summed in the same order).
pub fn matmul_at_concat_drawn(a: &Matrix, rows: usize, bs: &[&Matrix], draw: &Draw<'_>) -> Matrix {
    at_concat(a, rows, bs, Some(draw))
}

/// Changes a copied row block of a matrix in place, given the block's first row (input dropout's redraw).
pub type Draw<'a> = dyn Fn(&mut [f32], usize) + Sync + 'a;

fn at_concat(a: &Matrix, r: usize, bs: &[&Matrix], draw: Option<&Draw<'_>>) -> Matrix {
    let m = a.cols();
    assert!(r <= a.rows(), "matmul_at_concat over more rows than A has");
    let n: usize = bs.iter().map(|b| b.cols()).sum();
    for b in bs {
        assert_eq!(b.rows(), r, "matmul_at_concat row counts differ");
    }
    let c = Matrix::zeros(m, n);
    if r == 0 || m == 0 || n == 0 {
        return c;
    }
    let block = reduction_block(r);
    let partials: Vec<Vec<f32>> = a.data()[..r * m]
        .par_chunks(block * m)
        .enumerate()
        .map(|(blk, ab)| {
            let rows = ab.len() / m;
            let r0 = blk * block;
            let mut bb = vec![0f32; rows * n];
            for (i, row) in bb.chunks_exact_mut(n).enumerate() {
                let mut c0 = 0;
                for b in bs {
                    row[c0..c0 + b.cols()].copy_from_slice(b.row(r0 + i));
                    c0 += b.cols();
                }
            }
            match draw {
                None => block_at_b(ab, &bb, m, n),
                Some(draw) => {
                    let mut drawn = ab.to_vec();
                    draw(&mut drawn, r0);
                    block_at_b(&drawn, &bb, m, n)
                }
            }
        })
        .collect();
    sum_partials(c, partials)
}

/// One row block's `A_b^T B_b` (A_b: rows x m, B_b: rows x n, both row-major), a partial of `A^T B`.
fn block_at_b(ab: &[f32], bb: &[f32], m: usize, n: usize) -> Vec<f32> {
    let rows = ab.len() / m;
    assert_eq!(bb.len(), rows * n, "a row block of B is rows x n");
    let mut p = vec![0f32; m * n];
    // SAFETY: A's block is read transposed (row stride 1, column stride m); `bb` is rows x n (checked
    // above) and `p` is m x n.
    unsafe {
        matrixmultiply::sgemm(
            m,
            rows,
            n,
            1.0,
            ab.as_ptr(),
            1,
            m as isize,
            bb.as_ptr(),
            n as isize,
            1,
            0.0,
            p.as_mut_ptr(),
            n as isize,
            1,
        );
    }
    p
}

/// `c` plus the row blocks' partials, summed in block order (the same order for every caller, so
/// `matmul_at` and `matmul_at_concat` agree bit for bit).
fn sum_partials(mut c: Matrix, partials: Vec<Vec<f32>>) -> Matrix {
    let out = c.data_mut();
    for p in partials {
        for (o, v) in out.iter_mut().zip(p) {
            *o += v;
        }
    }
    c
}

/// The cores' peak single-precision rate in GFLOP/s, measured: every thread of the pool runs 12
/// independent chains of fused multiply-adds held in registers (no memory traffic) on the widest vectors
/// the CPU has (AVX-512F, AVX2 with FMA, else plain multiplies and adds), all threads at once. The limit
/// `physalia calibrate` holds the GEMM rate against.
pub fn peak_gflop_s() -> f64 {
    let iters = 2_000_000;
    // warm up (clocks, the pool), then the median of three, each at the flops it counted
    std::hint::black_box(peak_chains(iters / 10));
    let mut rates: Vec<f64> = (0..3)
        .map(|_| {
            let t0 = std::time::Instant::now();
            let (flops, value) = peak_chains(iters);
            std::hint::black_box(value);
            flops / t0.elapsed().as_secs_f64().max(1e-9) / 1e9
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[1]
}

/// Runs `iters` rounds of the chains on every thread of the pool; returns the flops done in all and a
/// value derived from the chains (so they are not optimised away).
fn peak_chains(iters: usize) -> (f64, f32) {
    const CHAINS: usize = 12;
    let results = rayon::broadcast(|_| chains::<CHAINS>(iters));
    let lanes = results.first().map_or(1, |r| r.1);
    let flops = (results.len() * iters * CHAINS * lanes * 2) as f64;
    (flops, results.iter().map(|r| r.0).sum())
}

/// One thread's chains: (a value of them, floats per vector).
fn chains<const C: usize>(iters: usize) -> (f32, usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above).
            return (unsafe { fma_chains::avx512::<C>(iters) }, 16);
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            return (unsafe { fma_chains::avx2::<C>(iters) }, 8);
        }
    }
    let mut acc = [0f32; C];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = std::hint::black_box(*a) * 0.999_999 + 1e-7;
        }
    }
    (acc.iter().sum(), 1)
}

#[cfg(target_arch = "x86_64")]
mod fma_chains {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512<const C: usize>(iters: usize) -> f32 {
        let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let mut acc = [_mm512_setzero_ps(); C];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        let mut s = _mm512_setzero_ps();
        for x in acc {
            s = _mm512_add_ps(s, x);
        }
        _mm512_reduce_add_ps(s)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2<const C: usize>(iters: usize) -> f32 {
        let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let mut acc = [_mm256_setzero_ps(); C];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let mut s = _mm256_setzero_ps();
        for x in acc {
            s = _mm256_add_ps(s, x);
        }
        let mut out = [0f32; 8];
        // SAFETY: `out` holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
        out.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_chains_run_every_round_they_count() {
        // each chain is x <- x * a + b from 0, `iters` times, on every lane of every chain: the value
        // returned is 12 chains x lanes x that, so a kernel that skipped rounds (or lanes) shows
        let iters = 1000;
        let (value, lanes) = chains::<12>(iters);
        let mut x = 0f64;
        for _ in 0..iters {
            x = x * 0.999_999 + 1e-7;
        }
        let want = 12.0 * lanes as f64 * x;
        assert!(
            ((value as f64) - want).abs() < 1e-3 * want,
            "{value} against {want} ({lanes} lanes)"
        );
        let (flops, _) = peak_chains(iters);
        assert_eq!(
            flops,
            (rayon::current_num_threads() * iters * 12 * lanes * 2) as f64
        );
        assert!(peak_gflop_s() > 0.0);
    }

    fn naive(a: &Matrix, b: &Matrix) -> Matrix {
        let mut c = Matrix::zeros(a.rows(), b.cols());
        for i in 0..a.rows() {
            for j in 0..b.cols() {
                let mut s = 0f64;
                for k in 0..a.cols() {
                    s += a.row(i)[k] as f64 * b.row(k)[j] as f64;
                }
                c.row_mut(i)[j] = s as f32;
            }
        }
        c
    }

    fn transpose(a: &Matrix) -> Matrix {
        let mut t = Matrix::zeros(a.cols(), a.rows());
        for i in 0..a.rows() {
            for j in 0..a.cols() {
                t.row_mut(j)[i] = a.row(i)[j];
            }
        }
        t
    }

    fn random(rows: usize, cols: usize, seed: u64) -> Matrix {
        let s = crate::rng::Stream::new(seed, &[]);
        Matrix::from_vec(
            rows,
            cols,
            (0..rows * cols)
                .map(|i| s.uniform(i as u64) - 0.5)
                .collect(),
        )
    }

    #[test]
    fn products_match_naive_across_block_boundaries() {
        for &(m, k, n) in &[(1, 1, 1), (5, 3, 7), (ROW_BLOCK + 3, 17, 9), (20_000, 6, 5)] {
            let a = random(m, k, 1);
            let b = random(k, n, 2);
            let want = naive(&a, &b);
            assert!(matmul(&a, &b).max_abs_diff(&want) < 1e-4);
            assert!(matmul_bt(&a, &transpose(&b)).max_abs_diff(&want) < 1e-4);
            let at = transpose(&a);
            assert!(matmul_at(&at, &b).max_abs_diff(&want) < 1e-4);
            let mut acc = want.clone();
            matmul_into(&a, &b, &mut acc, true);
            let mut twice = want.clone();
            twice.scale(2.0);
            assert!(acc.max_abs_diff(&twice) < 1e-4);
        }
    }

    #[test]
    fn reduction_is_independent_of_thread_count() {
        let a = random(50_000, 8, 3);
        let b = random(50_000, 4, 4);
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let three = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let x = one.install(|| matmul_at(&a, &b));
        let y = three.install(|| matmul_at(&a, &b));
        assert_eq!(x, y);
    }

    #[test]
    fn matmul_at_concat_is_matmul_at_of_the_concatenation_bit_for_bit() {
        for &rows in &[1, 7, 50_000] {
            let a = random(rows, 24, 5);
            let b1 = random(rows, 16, 6);
            let b2 = random(rows, 3, 7);
            let want = matmul_at(&a, &Matrix::concat_cols(&b1, &b2));
            assert_eq!(matmul_at_concat(&a, &[&b1, &b2]), want);
        }
    }

    #[test]
    fn a_drawn_product_is_the_product_of_the_drawn_rows_bit_for_bit() {
        // `draw` changes each row by its index (as input dropout keys its mask by row): a block handed the
        // wrong first row, or rows beyond `rows` read, would change the product
        let draw = |block: &mut [f32], r0: usize| {
            for (i, row) in block.chunks_exact_mut(24).enumerate() {
                let r = r0 + i;
                row[r % 24] = 0.0;
                row[(r * 7) % 24] *= 2.0;
            }
        };
        for &(rows, extra) in &[(1, 0), (7, 3), (50_000, 11)] {
            let a = random(rows + extra, 24, 5);
            let b1 = random(rows, 16, 6);
            let b2 = random(rows, 3, 7);
            let mut drawn = a.row_block(0, rows);
            draw(drawn.data_mut(), 0);
            let want = matmul_at_concat(&drawn, &[&b1, &b2]);
            assert_eq!(matmul_at_concat_drawn(&a, rows, &[&b1, &b2], &draw), want);
            assert_ne!(matmul_at_concat(&a.row_block(0, rows), &[&b1, &b2]), want);
        }
    }
}
