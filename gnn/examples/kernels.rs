//! SpMM forward (`A X`) and transposed (`A^T X`) bandwidth at several widths against the machine's stream
//! bandwidth, on the operator `bench/compare.py`'s GCN builds (SBM, average degree 10, symmetric norm with
//! self-loops), single process, `THREADS` rayon threads. For issue 34: how close the sparse kernels run to
//! what the memory system delivers.
//!
//! `cargo run --release -p physalia-gnn --example kernels -- NODES THREADS [WIDTHS]` (defaults
//! `1000000 2 64,128,256`). Prints one line per kernel and width: median seconds of 5 runs and GB/s counted as
//! `physalia calibrate` counts SpMM (index and weight per edge, the gathered row, the written row), and the
//! fraction of the stream figure, measured the way `calibrate` measures it (`Matrix::add_assign`, 3 x 4 bytes a
//! float). The vector path the kernels picked on this CPU is printed first.

use std::alloc::{GlobalAlloc, Layout, System};
use std::time::Instant;

use physalia_gnn::Matrix;
use physalia_gnn::sparse::{Norm, Path, SparseOp};
use physalia_graph::synth::{SbmParams, sbm};

/// With `ALIGN64=1`, allocations of 1 MiB and more start on a cache line (glibc's malloc aligns to 16
/// bytes, so a 64-byte row of a width-16 matrix usually straddles two lines).
struct Aligned;
static ALIGN64: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
fn layout(l: Layout) -> Layout {
    if l.size() >= 1 << 20 && ALIGN64.load(std::sync::atomic::Ordering::Relaxed) {
        l.align_to(64).expect("64 is a valid alignment")
    } else {
        l
    }
}
unsafe impl GlobalAlloc for Aligned {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        unsafe { System.alloc(layout(l)) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        unsafe { System.alloc_zeroed(layout(l)) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, layout(l)) }
    }
}
#[global_allocator]
static A: Aligned = Aligned;

fn median_s(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2].max(1e-9)
}

fn filled(rows: usize, cols: usize) -> Matrix {
    let mut v: Vec<f32> = Vec::with_capacity(rows * cols);
    if std::env::var("HUGE").is_ok() {
        // transparent huge pages for the whole 2 MiB pages inside the buffer, before it is first written
        unsafe extern "C" {
            fn madvise(addr: *mut u8, len: usize, advice: i32) -> i32;
        }
        const MADV_HUGEPAGE: i32 = 14;
        let huge = 2usize << 20;
        let p = v.as_mut_ptr() as usize;
        let (a, end) = (
            (p + huge - 1) & !(huge - 1),
            (p + rows * cols * 4) & !(huge - 1),
        );
        if end > a {
            // SAFETY: advice on pages of this allocation, which nothing has touched yet
            unsafe { madvise(a as *mut u8, end - a, MADV_HUGEPAGE) };
        }
    }
    v.extend((0..rows * cols).map(|i| (i % 97) as f32 * 0.01));
    Matrix::from_vec(rows, cols, v)
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
    // set before any large allocation, so every one is freed with the layout it was made with
    ALIGN64.store(
        std::env::var("ALIGN64").is_ok(),
        std::sync::atomic::Ordering::Relaxed,
    );
    println!("vector path: {}", Path::detect().name());

    let len = 1usize << 24;
    let stream = {
        let mut a = filled(len / 64, 64);
        let b = filled(len / 64, 64);
        let s = median_s(5, || a.add_assign(&b));
        (3 * len * 4) as f64 / s / 1e9
    };
    println!("stream {stream:.1} GB/s");

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
    println!("graph: {n} nodes, {} entries with self-loops", op.nnz());
    for &d in &widths {
        let x = filled(n, d);
        let misaligned = x.data().as_ptr() as usize % 64;
        let bytes = op.nnz() as f64 * (8.0 + d as f64 * 4.0) + (n * d * 4) as f64;
        for (name, t) in [
            (
                "spmm  ",
                median_s(5, || {
                    std::hint::black_box(op.spmm(&x));
                }),
            ),
            (
                "spmm_t",
                median_s(5, || {
                    std::hint::black_box(op.spmm_t(&x));
                }),
            ),
        ] {
            let gbs = bytes / t / 1e9;
            println!(
                "{name} d={d:3}  {t:.4} s  {gbs:5.1} GB/s  {:.0}% of stream  (rows start {misaligned} B past a line)",
                100.0 * gbs / stream
            );
        }
    }
}
