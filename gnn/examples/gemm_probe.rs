//! GEMM GFLOP/s at an epoch's shapes (scratch probe for issue 34).
use physalia_gnn::Matrix;
use physalia_gnn::dense::{matmul, matmul_at};
use std::time::Instant;
#[global_allocator]
static ALLOC: physalia_gnn::heap::LineAligned = physalia_gnn::heap::LineAligned;
fn cpu() -> f64 {
    #[repr(C)]
    struct T {
        s: i64,
        n: i64,
    }
    unsafe extern "C" {
        fn clock_gettime(c: i32, t: *mut T) -> i32;
    }
    let mut t = T { s: 0, n: 0 };
    unsafe { clock_gettime(2, &mut t) };
    t.s as f64 + t.n as f64 * 1e-9
}
fn main() {
    rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build_global()
        .unwrap();
    let n = 1_000_000;
    let f = |r: usize, c: usize| {
        Matrix::from_vec(r, c, (0..r * c).map(|i| (i % 13) as f32 * 0.1).collect())
    };
    let x = f(n, 128);
    let w = f(128, 256);
    let h = f(n, 256);
    let w2 = f(256, 32);
    for _ in 0..3 {
        let (t, c) = (Instant::now(), cpu());
        let y = matmul(&x, &w);
        let (dt, dc) = (t.elapsed().as_secs_f64(), cpu() - c);
        let fl = 2.0 * n as f64 * 128.0 * 256.0 / 1e9;
        println!(
            "X W   1Mx128x256: {:.1} GFLOP/s wall, {:.1} per CPU-s/2",
            fl / dt,
            fl / dc * 2.0
        );
        drop(y);
        let (t, c) = (Instant::now(), cpu());
        let y = matmul(&h, &w2);
        let (dt, dc) = (t.elapsed().as_secs_f64(), cpu() - c);
        let fl = 2.0 * n as f64 * 256.0 * 32.0 / 1e9;
        println!(
            "H W2  1Mx256x32:  {:.1} GFLOP/s wall, {:.1} per CPU-s/2",
            fl / dt,
            fl / dc * 2.0
        );
        drop(y);
        let (t, c) = (Instant::now(), cpu());
        let y = matmul_at(&x, &h);
        let (dt, dc) = (t.elapsed().as_secs_f64(), cpu() - c);
        let fl = 2.0 * n as f64 * 256.0 * 128.0 / 1e9;
        println!(
            "X^T H 128x1Mx256: {:.1} GFLOP/s wall, {:.1} per CPU-s/2",
            fl / dt,
            fl / dc * 2.0
        );
        drop(y);
    }
}
