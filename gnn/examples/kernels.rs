//! SpMM forward (`A X`) and transposed (`A^T X`) bandwidth at several widths against the machine's stream
//! bandwidth, on the operator `bench/compare.py`'s GCN builds (SBM, average degree 10, symmetric norm with
//! self-loops), single process, `THREADS` rayon threads. For issue 34: how close the sparse kernels run to
//! what the memory system delivers, the engine's kernels beside the base ones in one run.
//!
//! `cargo run --release -p physalia-gnn --example kernels -- NODES THREADS [WIDTHS] [REPS]` (defaults
//! `1000000 2 64,128,256 7`). Runs as the binaries do (`heap::LineAligned`, glibc's heap never trimmed). Each
//! repetition runs, in turn: the stream pass, then per kernel the base and the engine's. Prints per kernel and
//! width the median seconds and GB/s of each, counted as `physalia calibrate` counts SpMM (index and weight
//! per edge, the gathered row, the written row), against the median stream figure, measured the way
//! `calibrate` measures it (`Matrix::add_assign`, 3 x 4 bytes a float), and the median of the per-repetition
//! ratios engine / base. The machine may be shared: only what ran interleaved is compared.
//!
//! The base is the engine before issue 34's second round (`a2979ab`): its gather kernel, a verbatim copy in
//! `kernels/base_gather.rs`, on a source matrix on 4 KiB pages (`MADV_NOHUGEPAGE`, what `madvise` THP mode
//! gave it), and the output zeroed before it is written. Both compute the same bits, which is checked.

#[allow(dead_code)]
#[path = "kernels/base_gather.rs"]
mod base_gather;

use std::time::Instant;

use physalia_gnn::Matrix;
use physalia_gnn::sparse::{Norm, Path, SparseOp};
use physalia_graph::synth::{SbmParams, sbm};
use rayon::prelude::*;

#[global_allocator]
static ALLOC: physalia_gnn::heap::LineAligned = physalia_gnn::heap::LineAligned;

fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn time_s(f: impl FnOnce()) -> f64 {
    let t0 = Instant::now();
    f();
    t0.elapsed().as_secs_f64().max(1e-9)
}

/// A matrix filled with a fixed pattern; on 4 KiB pages when `small_pages` (advised before first touch).
fn filled(rows: usize, cols: usize, small_pages: bool) -> Matrix {
    let mut v: Vec<f32> = Vec::with_capacity(rows * cols);
    if small_pages {
        physalia_gnn::heap::advise_huge_pages(v.as_ptr() as *const u8, rows * cols * 4, false);
    }
    v.extend((0..rows * cols).map(|i| (i % 97) as f32 * 0.01 - 0.3));
    Matrix::from_vec(rows, cols, v)
}

/// The MiB of `len` bytes at `p` that sit on transparent huge pages (`/proc/self/smaps`: the VMAs over the
/// range, their `AnonHugePages` counted in proportion), or `None` where there is no such file.
fn huge_mib(p: *const u8, len: usize) -> Option<f64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let (lo, hi) = (p as u64, p as u64 + len as u64);
    let (mut vma, mut mib) = ((0u64, 0u64), 0f64);
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = head.split_once('-')
            && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            vma = (a, b);
        } else if let Some(kib) = line.strip_prefix("AnonHugePages:") {
            let kib: f64 = kib.trim().trim_end_matches("kB").trim().parse().ok()?;
            let overlap = hi.min(vma.1).saturating_sub(lo.max(vma.0));
            if overlap > 0 {
                mib += kib / 1024.0 * overlap as f64 / (vma.1 - vma.0) as f64;
            }
        }
    }
    Some(mib)
}

/// A copy of `v` on 4 KiB pages (fresh heap pages, advised before first touch).
fn small_pages<T: Copy>(v: &[T]) -> Vec<T> {
    let mut w = Vec::with_capacity(v.len());
    physalia_gnn::heap::advise_huge_pages(w.as_ptr() as *const u8, std::mem::size_of_val(v), false);
    w.extend_from_slice(v);
    w
}

/// One direction of the operator as the base engine held it: on 4 KiB pages.
struct BaseCsr {
    indptr: Vec<usize>,
    indices: Vec<u32>,
    weights: Vec<f32>,
}

/// The base engine's SpMM into `y` (on 4 KiB pages, as the base's heap was): zeroed on the calling thread
/// (`Matrix::zeros` on a reused heap block is a serial `memset`), then `SPMM_ROWS`-row blocks through the
/// base gather kernel.
fn base_spmm(a: &BaseCsr, x: &Matrix, y: &mut Matrix) {
    const SPMM_ROWS: usize = 256;
    let (indptr, indices, weights) = (&a.indptr, &a.indices, &a.weights);
    let d = x.cols();
    let xd = x.data();
    let path = match Path::detect() {
        Path::Avx512 => base_gather::Path::Avx512,
        Path::Avx2 => base_gather::Path::Avx2,
        Path::Portable => base_gather::Path::Portable,
    };
    assert_eq!(y.shape(), (indptr.len() - 1, d));
    std::hint::black_box(y.data_mut()).fill(0.0);
    y.data_mut()
        .par_chunks_mut(SPMM_ROWS * d)
        .enumerate()
        .for_each(|(chunk, out)| {
            base_gather::gather(
                path,
                base_gather::Block {
                    out,
                    first: chunk * SPMM_ROWS,
                    d,
                    accumulate: false,
                    entries: |i| (indptr[i], indptr[i + 1]),
                    indices,
                    weight: |k, _| weights[k],
                    row: |j| &xd[j * d..(j + 1) * d],
                    prefetch: true,
                },
            )
        });
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let nodes: usize = args
        .first()
        .map_or(Ok(1_000_000), |s| s.parse())
        .expect("NODES is a number");
    let threads: usize = args
        .get(1)
        .map_or(Ok(2), |s| s.parse())
        .expect("THREADS is a number");
    let widths: Vec<usize> = args
        .get(2)
        .map_or("64,128,256", |s| s.as_str())
        .split(',')
        .map(|w| w.parse().expect("WIDTHS are numbers"))
        .collect();
    let reps: usize = args
        .get(3)
        .map_or(Ok(7), |s| s.parse())
        .expect("REPS is a number");
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .expect("the global pool is built once");
    // as the binaries do (orchestrator and worker `main`): large buffers from the heap, never trimmed, so
    // repeated products reuse pages instead of faulting them in
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_MAX: i32 = -4;
        // SAFETY: only tunes glibc's allocator, before any large allocation.
        unsafe {
            mallopt(M_MMAP_MAX, 0);
            mallopt(M_TRIM_THRESHOLD, i32::MAX);
        }
    }
    println!("vector path: {}", Path::detect().name());
    // the base's sources and outputs first, on fresh heap pages: a block reusing freed pages keeps the page
    // size they were faulted in with, whatever it is advised
    let mut x_bases: Vec<(Matrix, Matrix)> = widths
        .iter()
        .map(|&d| (filled(nodes, d, true), filled(nodes, d, true)))
        .collect();

    let g = sbm(&SbmParams {
        num_nodes: nodes,
        num_classes: 16,
        avg_degree: 10.0,
        feat_dim: 1,
        seed: 0,
        ..SbmParams::default()
    })
    .expect("valid SBM parameters");
    let n = g.indptr.len() - 1;
    let op = SparseOp::build(n, n, &g.indptr, &g.indices, Norm::Symmetric, None);
    drop(g);
    println!("graph: {n} nodes, {} entries with self-loops", op.nnz());
    let base = BaseCsr {
        indptr: small_pages(op.indptr()),
        indices: small_pages(op.indices()),
        weights: small_pages(op.values()),
    };
    let base_t = BaseCsr {
        indptr: small_pages(op.t_indptr()),
        indices: small_pages(op.t_indices()),
        // the transpose's weights, entry by entry
        weights: small_pages(
            &op.t_perm()
                .iter()
                .map(|&k| op.values()[k as usize])
                .collect::<Vec<f32>>(),
        ),
    };

    let len = 1usize << 24;
    let mut sa = filled(len / 64, 64, false);
    let sb = filled(len / 64, 64, false);
    let stream_bytes = (3 * len * 4) as f64;

    println!(
        "kernel  width  base s  base GB/s  engine s  engine GB/s  stream GB/s  engine % of stream  engine/base time"
    );
    for (&d, (x_base, mut y_base)) in widths.iter().zip(x_bases.drain(..)) {
        assert_eq!(x_base.rows(), n, "the SBM has NODES nodes");
        let x = filled(n, d, false);
        let bytes = op.nnz() as f64 * (8.0 + d as f64 * 4.0) + (n * d * 4) as f64;
        let huge = |m: &Matrix| {
            huge_mib(m.data().as_ptr() as *const u8, m.data().len() * 4)
                .map_or("?".into(), |h| format!("{h:.0}"))
        };
        println!(
            "width {d}: sources of {} MiB, on huge pages: base {} MiB, engine {} MiB",
            (n * d * 4) >> 20,
            huge(&x_base),
            huge(&x)
        );
        // warm up (page faults, the pool) and check the bits
        for (name, a, e) in [
            ("A X", &base, op.spmm(&x)),
            ("A^T X", &base_t, op.spmm_t(&x)),
        ] {
            base_spmm(a, &x_base, &mut y_base);
            assert!(
                y_base
                    .data()
                    .iter()
                    .zip(e.data())
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: the engine's kernel and the base differ at width {d}"
            );
        }
        let mut t = [[(); 2].map(|_| Vec::new()), [(); 2].map(|_| Vec::new())];
        let mut stream = Vec::new();
        for _ in 0..reps {
            stream.push(stream_bytes / time_s(|| sa.add_assign(&sb)) / 1e9);
            t[0][0].push(time_s(|| base_spmm(&base, &x_base, &mut y_base)));
            t[0][1].push(time_s(|| {
                std::hint::black_box(op.spmm(&x));
            }));
            t[1][0].push(time_s(|| base_spmm(&base_t, &x_base, &mut y_base)));
            t[1][1].push(time_s(|| {
                std::hint::black_box(op.spmm_t(&x));
            }));
        }
        let stream = median(stream);
        for (name, [base, engine]) in ["A X  ", "A^T X"].into_iter().zip(t) {
            let ratio = median(base.iter().zip(&engine).map(|(b, e)| e / b).collect());
            let (base, engine) = (median(base), median(engine));
            let (gb, ge) = (bytes / base / 1e9, bytes / engine / 1e9);
            println!(
                "{name}  {d:5}  {base:6.3}  {gb:9.1}  {engine:8.3}  {ge:11.1}  {stream:11.1}  {:17.0}%  {ratio:16.2}",
                100.0 * ge / stream
            );
        }
    }
}
