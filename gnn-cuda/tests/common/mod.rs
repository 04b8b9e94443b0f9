//! Checks of every device operation against `physalia_gnn`'s CPU engine, generic over [`Ops`]: the CPU device
//! runs them here (`tests/emulate.rs`), the GPU runs the very same checks (`tests/gpu.rs`).

#![allow(dead_code)] // each test binary uses a subset

use std::path::{Path, PathBuf};

use physalia_gnn::dense::{matmul, matmul_at, matmul_bt};
use physalia_gnn::device::{
    AdamConfig, AdamStep, DeviceGraph, DeviceModel, Dropout, GatShape, Ops, View,
};
use physalia_gnn::loss::{correct, cross_entropy};
use physalia_gnn::rng::{Mask, Stream};
use physalia_gnn::sparse::{Norm, SparseOp};
use physalia_gnn::{
    Activation, Adam, LayerKind, LocalExchange, LocalGraph, Matrix, Model, ModelConfig, Pass,
};
use physalia_gnn_cuda::kernels::stream_key;

pub struct Problem {
    pub indptr: Vec<i64>,
    pub indices: Vec<i32>,
    pub x: Matrix,
    pub labels: Vec<i64>,
    pub train: Vec<u32>,
}

/// A random undirected graph on `n` nodes: node 0 isolated, node 1 a hub linked to a third of the nodes (so
/// some rows have more edges than a warp has lanes), the rest about four neighbours each.
pub fn problem(n: usize, f: usize, classes: usize, seed: u64) -> Problem {
    let s = Stream::new(seed, &[]);
    let mut adj = vec![Vec::new(); n];
    let link = |a: usize, b: usize, adj: &mut Vec<Vec<i32>>| {
        if a != b && a != 0 && b != 0 && !adj[a].contains(&(b as i32)) {
            adj[a].push(b as i32);
            adj[b].push(a as i32);
        }
    };
    for k in 0..(n * 2) as u64 {
        let a = (s.at(2 * k) % n as u64) as usize;
        let b = (s.at(2 * k + 1) % n as u64) as usize;
        link(a, b, &mut adj);
    }
    for k in (2..n).step_by(3) {
        link(1, k, &mut adj);
    }
    let mut indptr = vec![0i64];
    let mut indices = Vec::new();
    for row in &mut adj {
        row.sort();
        indices.extend_from_slice(row);
        indptr.push(indices.len() as i64);
    }
    Problem {
        indptr,
        indices,
        x: random(n, f, seed ^ 1),
        labels: (0..n)
            .map(|i| (s.at(1 << 20 | i as u64) % classes as u64) as i64)
            .collect(),
        train: (0..n as u32).filter(|i| i % 3 != 2).collect(),
    }
}

pub fn random(rows: usize, cols: usize, seed: u64) -> Matrix {
    let s = Stream::new(seed, &[7]);
    Matrix::from_vec(
        rows,
        cols,
        (0..rows * cols)
            .map(|i| s.uniform(i as u64) * 2.0 - 1.0)
            .collect(),
    )
}

/// Largest elementwise difference relative to the largest magnitude of `want`.
pub fn rel_err(got: &Matrix, want: &Matrix) -> f32 {
    assert_eq!(got.shape(), want.shape(), "shapes differ");
    if got.data().iter().any(|v| !v.is_finite()) {
        return f32::INFINITY;
    }
    got.max_abs_diff(want) / want.max_abs().max(1e-12)
}

#[track_caller]
pub fn assert_close(what: &str, got: &Matrix, want: &Matrix, tol: f32) {
    let e = rel_err(got, want);
    assert!(e <= tol, "{what}: relative error {e:e} > {tol:e}");
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

const WIDTHS: &[usize] = &[1, 3, 4, 16, 40, 128, 130, 600];

/// SpMM forward (with and without halo rows) and over the transpose, every normalisation, widths from 1 to
/// past one pass of a warp (512 columns).
/// SpMM where node 1 is a hub of `n / 3` edges, more than `HEAVY_ROW_EDGES` (its row and its column are
/// split into chunks, forward and transposed), on the whole graph and on a partition with halo sources.
pub fn check_heavy_spmm<O: Ops>(ops: &mut O, n: usize, tol: f32) {
    let p = problem(n, 1, 2, 5);
    let hub = (p.indptr[2] - p.indptr[1]) as u64;
    assert!(
        hub > physalia_gnn_cuda::kernels::HEAVY_ROW_EDGES,
        "the hub has {hub} edges: not heavy"
    );
    for norm in [Norm::Symmetric, Norm::Mean] {
        let op = SparseOp::build(n, n, &p.indptr, &p.indices, norm, None);
        let d_op = ops.upload_csr(&op).unwrap();
        for d in [4usize, 7, 64, 130] {
            let x = random(n, d, d as u64);
            let dx = ops.upload(&x).unwrap();
            let mut y = ops.alloc(n, d).unwrap();
            ops.spmm(&d_op, &dx, None, &mut y).unwrap();
            assert_close(
                &format!("heavy spmm {norm:?} d={d}"),
                &ops.download(&y).unwrap(),
                &op.spmm(&x),
                tol,
            );
            ops.spmm_t(&d_op, &dx, &mut y).unwrap();
            assert_close(
                &format!("heavy spmm_t {norm:?} d={d}"),
                &ops.download(&y).unwrap(),
                &op.spmm_t(&x),
                tol,
            );
        }
    }
    // the hub owned, most of its neighbours halo rows
    let n_dst = n / 4;
    let deg: Vec<u32> = (0..n)
        .map(|j| (p.indptr[j + 1] - p.indptr[j]) as u32)
        .collect();
    let op = SparseOp::build(
        n_dst,
        n,
        &p.indptr[..=n_dst],
        &p.indices[..p.indptr[n_dst] as usize],
        Norm::Symmetric,
        Some(&deg),
    );
    let d_op = ops.upload_csr(&op).unwrap();
    let (own, halo) = (random(n_dst, 64, 1), random(n - n_dst, 64, 2));
    let (d_own, d_halo) = (ops.upload(&own).unwrap(), ops.upload(&halo).unwrap());
    let mut y = ops.alloc(n_dst, 64).unwrap();
    ops.spmm(&d_op, &d_own, Some(&d_halo), &mut y).unwrap();
    assert_close(
        "heavy spmm with halo rows",
        &ops.download(&y).unwrap(),
        &op.spmm_ext(&own, Some(&halo)),
        tol,
    );
}

pub fn check_spmm<O: Ops>(ops: &mut O, n: usize, tol: f32) {
    let p = problem(n, 1, 2, 11);
    for norm in [Norm::Symmetric, Norm::Mean, Norm::SelfLoopsOnly] {
        let op = SparseOp::build(n, n, &p.indptr, &p.indices, norm, None);
        let d_op = ops.upload_csr(&op).unwrap();
        for &d in WIDTHS {
            let x = random(n, d, d as u64);
            let dx = ops.upload(&x).unwrap();
            let mut y = ops.alloc(n, d).unwrap();
            ops.spmm(&d_op, &dx, None, &mut y).unwrap();
            let what = format!("spmm {norm:?} d={d}");
            assert_close(&what, &ops.download(&y).unwrap(), &op.spmm(&x), tol);
            let mut yt = ops.alloc(n, d).unwrap();
            ops.spmm_t(&d_op, &dx, &mut yt).unwrap();
            let what = format!("spmm_t {norm:?} d={d}");
            assert_close(&what, &ops.download(&yt).unwrap(), &op.spmm_t(&x), tol);
        }
    }
    // a partition: the first 2/3 of the nodes are owned, sources beyond them are halo rows
    let n_dst = 2 * n / 3;
    let mut indptr = vec![0i64];
    let mut indices = Vec::new();
    for i in 0..n_dst {
        indices.extend(&p.indices[p.indptr[i] as usize..p.indptr[i + 1] as usize]);
        indptr.push(indices.len() as i64);
    }
    let deg: Vec<u32> = (0..n)
        .map(|j| (p.indptr[j + 1] - p.indptr[j]) as u32)
        .collect();
    for norm in [Norm::Symmetric, Norm::Mean] {
        let op = SparseOp::build(n_dst, n, &indptr, &indices, norm, Some(&deg));
        let d_op = ops.upload_csr(&op).unwrap();
        for &d in &[4usize, 40, 130] {
            let own = random(n_dst, d, 1);
            let halo = random(n - n_dst, d, 2);
            let (d_own, d_halo) = (ops.upload(&own).unwrap(), ops.upload(&halo).unwrap());
            let mut y = ops.alloc(n_dst, d).unwrap();
            ops.spmm(&d_op, &d_own, Some(&d_halo), &mut y).unwrap();
            let want = op.spmm_ext(&own, Some(&halo));
            assert_close(
                &format!("spmm halo {norm:?} d={d}"),
                &ops.download(&y).unwrap(),
                &want,
                tol,
            );
            let z = random(n_dst, d, 3);
            let mut yt = ops.alloc(n, d).unwrap();
            let dz = ops.upload(&z).unwrap();
            ops.spmm_t(&d_op, &dz, &mut yt).unwrap();
            assert_close(
                &format!("spmm_t rect {norm:?} d={d}"),
                &ops.download(&yt).unwrap(),
                &op.spmm_t(&z),
                tol,
            );
        }
    }
}

/// Products in every transpose combination, with row-strided column views as the GAT backward uses them.
pub fn check_gemm<O: Ops>(ops: &mut O, tol: f32) {
    for &(m, k, n) in &[(1, 1, 1), (37, 5, 3), (300, 64, 16), (2049, 20, 33)] {
        let a = random(m, k, 1);
        let b = random(k, n, 2);
        let want = matmul(&a, &b);
        let (at, bt) = (transpose(&a), transpose(&b));
        let (da, db, dat, dbt) = (
            ops.upload(&a).unwrap(),
            ops.upload(&b).unwrap(),
            ops.upload(&at).unwrap(),
            ops.upload(&bt).unwrap(),
        );
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let va = if ta {
                View::full(&dat, k, m).t()
            } else {
                View::full(&da, m, k)
            };
            let vb = if tb {
                View::full(&dbt, n, k).t()
            } else {
                View::full(&db, k, n)
            };
            let mut c = ops.alloc(m, n).unwrap();
            ops.gemm(va, vb, 0.0, &mut c).unwrap();
            assert_close(
                &format!("gemm {m}x{k}x{n} {ta} {tb}"),
                &ops.download(&c).unwrap(),
                &want,
                tol,
            );
        }
        // beta = 1 accumulates
        let mut c = ops.upload(&want).unwrap();
        ops.gemm(View::full(&da, m, k), View::full(&db, k, n), 1.0, &mut c)
            .unwrap();
        let mut twice = want.clone();
        twice.scale(2.0);
        assert_close("gemm beta 1", &ops.download(&c).unwrap(), &twice, tol);
    }
    // A^T B on column views of wider matrices (ld > cols, offset > 0)
    let wide_a = random(50, 9, 3);
    let wide_b = random(50, 7, 4);
    let (wa, wb) = (ops.upload(&wide_a).unwrap(), ops.upload(&wide_b).unwrap());
    let mut c = ops.alloc(3, 4).unwrap();
    ops.gemm(
        View::cols(&wa, 50, 6, 3, 9).t(),
        View::cols(&wb, 50, 2, 4, 7),
        0.0,
        &mut c,
    )
    .unwrap();
    let sub = |m: &Matrix, c0: usize, w: usize| {
        Matrix::from_vec(
            m.rows(),
            w,
            (0..m.rows())
                .flat_map(|r| m.row(r)[c0..c0 + w].to_vec())
                .collect(),
        )
    };
    let want = matmul_at(&sub(&wide_a, 6, 3), &sub(&wide_b, 2, 4));
    assert_close("gemm views", &ops.download(&c).unwrap(), &want, tol);
    let _ = matmul_bt;
}

/// Bias, activations, dropout (the engine's masks, by global id and column offset), the activation's
/// backward, sums, copies, gathers.
pub fn check_elementwise<O: Ops>(ops: &mut O, tol: f32) {
    let (rows, cols) = (203, 37);
    let x = random(rows, cols, 5);
    let bias = random(1, cols, 6);
    let mut want = x.clone();
    for r in 0..rows {
        for (v, b) in want.row_mut(r).iter_mut().zip(bias.data()) {
            *v += b;
        }
    }
    let mut dx = ops.upload(&x).unwrap();
    let db = ops.upload(&bias).unwrap();
    ops.bias_add(&mut dx, &db).unwrap();
    assert_close("bias_add", &ops.download(&dx).unwrap(), &want, tol);

    for act in [Activation::Relu, Activation::Elu] {
        let mut dx = ops.upload(&x).unwrap();
        ops.activate(&mut dx, act).unwrap();
        let mut w = x.clone();
        for v in w.data_mut() {
            *v = match act {
                Activation::Relu => v.max(0.0),
                Activation::Elu if *v > 0.0 => *v,
                Activation::Elu => v.exp_m1(),
            };
        }
        assert_close(
            &format!("activate {act:?}"),
            &ops.download(&dx).unwrap(),
            &w,
            tol,
        );
    }

    // dropout on columns 5..5+cols of rows 60 wide, rows keyed by global ids starting at row 4
    let gids: Vec<u32> = (0..rows as u32 + 10).map(|i| i * 7 + 3).collect();
    let d_gids = ops.upload_idx(&gids).unwrap();
    for p in [0.1f32, 0.5] {
        let key = stream_key(9, &[0xD0, 2, 1]);
        let mask = Mask::new(Stream::new(9, &[0xD0, 2, 1]), p);
        let scale = 1.0 / (1.0 - p);
        let mut w = x.clone();
        for r in 0..rows {
            mask.apply(gids[4 + r] as u64 * 60 + 5, w.row_mut(r), scale);
        }
        let mut dx = ops.upload(&x).unwrap();
        ops.dropout(&mut dx, Some(&d_gids), 4, 5, 60, Dropout { key, p })
            .unwrap();
        assert_close(
            &format!("dropout p={p}"),
            &ops.download(&dx).unwrap(),
            &w,
            tol,
        );
        // without ids the row index is the key, as on a single worker
        let mut w = x.clone();
        for r in 0..rows {
            mask.apply(r as u64 * cols as u64, w.row_mut(r), scale);
        }
        let mut dx = ops.upload(&x).unwrap();
        ops.dropout(&mut dx, None, 0, 0, cols, Dropout { key, p })
            .unwrap();
        assert_close(
            &format!("dropout rows p={p}"),
            &ops.download(&dx).unwrap(),
            &w,
            tol,
        );
    }

    // the fused epilogue of a hidden layer: the same bits as its three operations, which are checked
    // against their definitions above
    for act in [Activation::Relu, Activation::Elu] {
        let d = Dropout {
            key: stream_key(7, &[0xD0, 1, 2]),
            p: 0.5,
        };
        for drop in [None, Some(d)] {
            for ids in [None, Some(&d_gids)] {
                let mut fused = ops.upload(&x).unwrap();
                ops.bias_activate_dropout(&mut fused, &db, act, ids, drop)
                    .unwrap();
                let mut apart = ops.upload(&x).unwrap();
                ops.bias_add(&mut apart, &db).unwrap();
                ops.activate(&mut apart, act).unwrap();
                if let Some(d) = drop {
                    ops.dropout(&mut apart, ids, 0, 0, cols, d).unwrap();
                }
                let (fused, apart) = (ops.download(&fused).unwrap(), ops.download(&apart).unwrap());
                let what = format!(
                    "bias_activate_dropout {act:?} dropout {} ids {}",
                    drop.is_some(),
                    ids.is_some()
                );
                assert!(
                    fused
                        .data()
                        .iter()
                        .zip(apart.data())
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: not the bits of bias_add, activate and dropout"
                );
                if drop.is_some() {
                    assert!(
                        fused.data().iter().filter(|v| **v == 0.0).count() > rows * cols / 4,
                        "{what}: the mask dropped too little"
                    );
                }
            }
        }
    }

    // activation backward against its definition: y = dropout(act(z))
    let p = 0.3f32;
    let key = stream_key(4, &[0xD0, 1, 1]);
    let mask = Mask::new(Stream::new(4, &[0xD0, 1, 1]), p);
    let scale = 1.0 / (1.0 - p);
    for act in [Activation::Relu, Activation::Elu] {
        for drop in [false, true] {
            let z = random(rows, cols, 8);
            let dy = random(rows, cols, 9);
            // y = dropout(act(z)) and the gradient of z, the mask of row r keyed by `key_row(r)`
            let reference = |key_row: &dyn Fn(usize) -> u64| {
                let (mut y, mut want) = (z.clone(), dy.clone());
                for r in 0..rows {
                    let mut keep = vec![true; cols];
                    if drop {
                        mask.fill(key_row(r) * cols as u64, &mut keep);
                    }
                    for (c, &kept) in keep.iter().enumerate() {
                        let zv = z.row(r)[c];
                        let (a, deriv) = match act {
                            Activation::Relu => (zv.max(0.0), if zv > 0.0 { 1.0 } else { 0.0 }),
                            Activation::Elu if zv > 0.0 => (zv, 1.0),
                            Activation::Elu => (zv.exp_m1(), zv.exp()),
                        };
                        let s = if drop { scale } else { 1.0 };
                        y.row_mut(r)[c] = if kept { a * s } else { 0.0 };
                        let g = &mut want.row_mut(r)[c];
                        *g = if kept { *g * deriv * s } else { 0.0 };
                    }
                }
                (y, want)
            };
            let (y, want) = reference(&|r| r as u64);
            let (mut ddy, dy_dev) = (ops.upload(&dy).unwrap(), ops.upload(&y).unwrap());
            let d = drop.then_some(Dropout { key, p });
            ops.activation_backward(&mut ddy, &dy_dev, None, 0, act, d)
                .unwrap();
            // ELU's derivative comes from y, so it is exact only up to exp rounding
            let what = format!("activation_backward {act:?} dropout {drop}");
            assert_close(&what, &ops.download(&ddy).unwrap(), &want, tol.max(1e-5));

            // written over rows 3.. of a taller y (the fused first-layer backward's row blocks): the mask
            // keyed by global ids from row 3, the rows around the block untouched
            let (above, below) = (3, 5);
            let ids: Vec<u32> = (0..(above + rows + below) as u32)
                .map(|i| i * 5 + 1)
                .collect();
            let (y, want) = reference(&|r| ids[above + r] as u64);
            let tall = random(above + rows + below, cols, 11);
            let (mut with_y, mut expect) = (tall.clone(), tall);
            for r in 0..rows {
                with_y.row_mut(above + r).copy_from_slice(y.row(r));
                expect.row_mut(above + r).copy_from_slice(want.row(r));
            }
            let (mut ddy, mut dtall) = (ops.upload(&dy).unwrap(), ops.upload(&with_y).unwrap());
            let d_ids = ops.upload_idx(&ids).unwrap();
            ops.activation_backward_over(&mut ddy, &mut dtall, Some(&d_ids), above, act, d)
                .unwrap();
            let what = format!("activation_backward_over {act:?} dropout {drop}");
            assert_close(
                &what,
                &ops.download(&dtall).unwrap(),
                &expect,
                tol.max(1e-5),
            );
            let mut short = ops.upload(&random(rows + above - 1, cols, 12)).unwrap();
            assert!(
                ops.activation_backward_over(&mut ddy, &mut short, None, above, act, d)
                    .is_err(),
                "{what}: a block past the end of y is refused"
            );
        }
    }

    let a = random(rows, cols, 10);
    let mut da = ops.upload(&a).unwrap();
    let dxx = ops.upload(&x).unwrap();
    ops.add_assign(&mut da, &dxx).unwrap();
    let mut w = a.clone();
    w.add_assign(&x);
    assert_close("add_assign", &ops.download(&da).unwrap(), &w, tol);

    for &(r, c) in &[(1, 1), (203, 37), (20_000, 5)] {
        let m = random(r, c, 12);
        let mut out = ops.alloc(1, c).unwrap();
        let dmm = ops.upload(&m).unwrap();
        ops.col_sums(&dmm, &mut out).unwrap();
        assert_close(
            &format!("col_sums {r}x{c}"),
            &ops.download(&out).unwrap(),
            &m.column_sums(),
            tol,
        );
    }

    // copy a 5x4 block from column 3 of x into column 2 of a 5x9 matrix
    let mut dst = ops.zeros(5, 9).unwrap();
    let dxx = ops.upload(&x).unwrap();
    let src = View {
        m: &dxx,
        offset: 3,
        rows: 5,
        cols: 4,
        ld: cols,
        trans: false,
    };
    ops.copy2d(src, &mut dst, 2, 9).unwrap();
    let mut w = Matrix::zeros(5, 9);
    for r in 0..5 {
        w.row_mut(r)[2..6].copy_from_slice(&x.row(r)[3..7]);
    }
    assert_close("copy2d", &ops.download(&dst).unwrap(), &w, 0.0);

    let idx = vec![5u32, 0, 202, 5, 17];
    let mut g = ops.alloc(idx.len(), cols).unwrap();
    let didx = ops.upload_idx(&idx).unwrap();
    ops.gather_rows(&dxx, &didx, &mut g).unwrap();
    let w = Matrix::from_vec(
        idx.len(),
        cols,
        idx.iter()
            .flat_map(|&i| x.row(i as usize).to_vec())
            .collect(),
    );
    assert_close("gather_rows", &ops.download(&g).unwrap(), &w, 0.0);
}

/// Masked cross-entropy, its gradient and the correct count, with more classes than a warp has lanes.
pub fn check_loss<O: Ops>(ops: &mut O, tol: f32) {
    for &(n, c) in &[(50, 3), (301, 47)] {
        let mut logits = random(n, c, 13);
        logits.scale(4.0);
        // a tie: the first arg-max wins, as on the CPU
        logits.row_mut(3).iter_mut().for_each(|v| *v = 1.0);
        let s = Stream::new(2, &[]);
        let labels: Vec<i64> = (0..n).map(|i| (s.at(i as u64) % c as u64) as i64).collect();
        let rows: Vec<u32> = (0..n as u32).filter(|i| i % 4 != 1).collect();
        let (loss, grad) = cross_entropy(&logits, &labels, &rows, 77.0);
        let (dl, dlab, drows) = (
            ops.upload(&logits).unwrap(),
            ops.upload_labels(&labels).unwrap(),
            ops.upload_idx(&rows).unwrap(),
        );
        let mut dg = ops.alloc(n, c).unwrap();
        let got = ops
            .cross_entropy(&dl, &dlab, &drows, 77.0, &mut dg)
            .unwrap();
        assert!(
            ((got - loss) / loss).abs() < tol as f64,
            "loss {got} vs {loss}"
        );
        assert_close(
            "cross_entropy grad",
            &ops.download(&dg).unwrap(),
            &grad,
            tol,
        );
        assert_eq!(
            ops.correct(&dl, &dlab, &drows).unwrap(),
            correct(&logits, &labels, &rows) as u64
        );
    }
}

/// Adam with weight decay over several steps, against `physalia_gnn::Adam`.
pub fn check_adam<O: Ops>(ops: &mut O, tol: f32) {
    let w0 = random(33, 17, 14);
    let mut params = vec![physalia_gnn::Param {
        name: "w".into(),
        value: w0.clone(),
    }];
    let mut adam = Adam::new(&params, 0.01, 5e-4);
    let (mut dw, mut m, mut v) = (
        ops.upload(&w0).unwrap(),
        ops.zeros(33, 17).unwrap(),
        ops.zeros(33, 17).unwrap(),
    );
    for t in 1..=5u64 {
        let g = random(33, 17, 100 + t);
        adam.step(&mut params, std::slice::from_ref(&g));
        let s = AdamStep::new(t, 0.01, 0.9, 0.999, 1e-8, 5e-4);
        let dg = ops.upload(&g).unwrap();
        ops.adam(&mut dw, &dg, &mut m, &mut v, s).unwrap();
    }
    assert_close("adam", &ops.download(&dw).unwrap(), &params[0].value, tol);
}

/// A model configuration for the equivalence checks.
pub fn config(
    kind: LayerKind,
    in_dim: usize,
    hidden: usize,
    layers: usize,
    act: Activation,
    dropout: bool,
) -> ModelConfig {
    let mut cfg = ModelConfig::new(kind, in_dim, hidden, 5);
    cfg.layers = layers;
    cfg.activation = act;
    cfg.heads = 3;
    cfg.out_heads = 2;
    let p = if dropout { 0.4 } else { 0.0 };
    cfg.dropout = p;
    cfg.input_dropout = p;
    cfg.attn_dropout = p;
    cfg
}

/// Forward, loss, backward and three epochs of training on the device against `physalia_gnn::Model` on the
/// CPU: logits, loss, every gradient and every parameter within `tol` (relative to each matrix's largest
/// entry).
pub fn check_model<O: Ops>(ops: &mut O, cfg: &ModelConfig, n: usize, tol: f32) {
    let what = format!(
        "{:?} {}->{} x{} layers {:?} dropout {}",
        cfg.kind, cfg.in_dim, cfg.hidden, cfg.layers, cfg.activation, cfg.dropout
    );
    let p = problem(n, cfg.in_dim, cfg.out_dim, 21);
    let g = LocalGraph::whole(cfg.kind, &p.indptr, &p.indices);
    let mut model = Model::new(cfg, 5).unwrap();
    let dg = DeviceGraph::whole(ops, cfg.kind, &p.indptr, &p.indices).unwrap();
    let mut dm = DeviceModel::from_model(ops, &model).unwrap();
    let x = ops.upload(&p.x).unwrap();
    let labels = ops.upload_labels(&p.labels).unwrap();
    let train = ops.upload_idx(&p.train).unwrap();
    let n_train = p.train.len();

    // one forward and backward
    let pass = Pass::Train { epoch: 3 };
    let fwd = model.forward(&g, &p.x, pass, &mut LocalExchange).unwrap();
    let (loss, d_logits) = cross_entropy(&fwd.logits, &p.labels, &p.train, n_train as f64);
    let logits_cpu = fwd.logits.clone();
    let grads = model
        .backward(&g, fwd, d_logits, &mut LocalExchange)
        .unwrap();
    let dfwd = dm
        .forward_ex(ops, &dg, &x, pass, &mut LocalExchange)
        .unwrap();
    assert_close(
        &format!("{what}: logits"),
        &ops.download(&dfwd.logits).unwrap(),
        &logits_cpu,
        tol,
    );
    let (r, c) = ops.dims(&dfwd.logits);
    let mut dd = ops.alloc(r, c).unwrap();
    let dloss = ops
        .cross_entropy(&dfwd.logits, &labels, &train, n_train as f64, &mut dd)
        .unwrap();
    assert!(
        ((dloss - loss) / loss).abs() < tol as f64,
        "{what}: loss {dloss} vs {loss}"
    );
    let dgrads = dm
        .backward_ex(ops, &dg, dfwd, dd, &mut LocalExchange)
        .unwrap();
    for ((name, got), want) in dm.names().iter().zip(&dgrads).zip(&grads) {
        assert_close(
            &format!("{what}: gradient of {name}"),
            &ops.download(got).unwrap(),
            want,
            tol,
        );
    }
    for gr in dgrads {
        ops.recycle(gr);
    }

    // three epochs of training from the same start
    let mut model = Model::new(cfg, 5).unwrap();
    let mut dm = DeviceModel::from_model(ops, &model).unwrap();
    let mut adam = Adam::new(&model.params, 0.01, 5e-4);
    for epoch in 1..=3u64 {
        let pass = Pass::Train { epoch };
        let fwd = model.forward(&g, &p.x, pass, &mut LocalExchange).unwrap();
        let (loss, d) = cross_entropy(&fwd.logits, &p.labels, &p.train, n_train as f64);
        let grads = model.backward(&g, fwd, d, &mut LocalExchange).unwrap();
        adam.step(&mut model.params, &grads);
        let dloss = dm
            .train_epoch(
                ops,
                &dg,
                &x,
                &labels,
                &train,
                n_train,
                epoch,
                AdamConfig::new(0.01, 5e-4),
            )
            .unwrap();
        let loss = loss / n_train as f64;
        assert!(
            ((dloss - loss) / loss).abs() < 10.0 * tol as f64,
            "{what}: epoch {epoch} loss {dloss} vs {loss}"
        );
    }
    for (pc, pd) in model.params.iter().zip(&dm.params) {
        assert_close(
            &format!("{what}: {} after 3 epochs", pc.name),
            &ops.download(&pd.value).unwrap(),
            &pc.value,
            10.0 * tol,
        );
    }
    // evaluation counts
    let fwd = model
        .forward(&g, &p.x, Pass::Eval, &mut LocalExchange)
        .unwrap();
    let want = correct(&fwd.logits, &p.labels, &p.train) as u64;
    let got = dm.evaluate(ops, &dg, &x, &labels, &[&train]).unwrap()[0];
    assert!(got.abs_diff(want) <= 1, "{what}: {got} correct vs {want}");
}

/// Every layer kind, both aggregation orders, both activations, dropout on and off, 2 and 3 layers.
pub fn model_configs() -> Vec<ModelConfig> {
    let mut out = Vec::new();
    for kind in [LayerKind::Gcn, LayerKind::Sage, LayerKind::Gat] {
        for (in_dim, hidden) in [(6, 16), (40, 8)] {
            for act in [Activation::Relu, Activation::Elu] {
                for dropout in [false, true] {
                    out.push(config(kind, in_dim, hidden, 2, act, dropout));
                }
            }
        }
        out.push(config(kind, 12, 10, 3, Activation::Elu, true));
    }
    out
}

/// GAT's kernels on their own, with halo rows and global ids (a partition's view), against a CPU reference
/// written from the definitions: the edge softmax sums to one per head and matches the model's.
pub fn gat_shape(heads: u32, c: u32, concat: bool) -> GatShape {
    GatShape {
        heads,
        c,
        concat,
        slope: 0.2,
    }
}

/// The Cora folder: `PHYSALIA_CORA`, or `../../shared/data/cora` from this crate.
pub fn cora_dir() -> Option<PathBuf> {
    let p = std::env::var("PHYSALIA_CORA")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../shared/data/cora"
            ))
        });
    if p.join("edges.csv").is_file() {
        Some(p)
    } else {
        eprintln!(
            "skipping: no Cora folder at {} (set PHYSALIA_CORA)",
            p.display()
        );
        None
    }
}

/// GCN or GAT on Cora with the paper settings, 200 epochs on the CPU engine and on the GPU from the same
/// initial weights: the final test accuracy is the same (a node or two may flip from float reordering
/// over 200 epochs of dropout training; at most 0.3% is allowed).
pub fn check_cora<O: Ops>(e: &mut O, dir: &Path, kinds: &[LayerKind]) {
    let opts = physalia_graph::import::ImportOptions {
        row_normalize: true,
        ..Default::default()
    };
    let ds = physalia_graph::import::generic(dir, &opts).unwrap();
    let n = ds.meta.num_nodes;
    let x = Matrix::from_vec(
        n,
        ds.meta.feat_dim,
        ds.features.view().to_f32().into_owned(),
    );
    let idx = |v: &[i64]| v.iter().map(|&i| i as u32).collect::<Vec<u32>>();
    let (train, test) = (idx(&ds.train_idx), idx(&ds.test_idx));
    for &kind in kinds {
        let mut cfg =
            physalia_gnn::ModelConfig::new(kind, ds.meta.feat_dim, 16, ds.meta.num_classes);
        if kind == LayerKind::Gat {
            cfg.hidden = 8;
            cfg.heads = 8;
            cfg.dropout = 0.6;
            cfg.input_dropout = 0.6;
            cfg.attn_dropout = 0.6;
            cfg.activation = Activation::Elu;
        }
        let (lr, wd) = if kind == LayerKind::Gat {
            (0.005, 5e-4)
        } else {
            (0.01, 5e-4)
        };
        let mut model = Model::new(&cfg, 0).unwrap();
        let g = LocalGraph::whole(kind, &ds.indptr, &ds.indices);
        let dg = DeviceGraph::whole(e, kind, &ds.indptr, &ds.indices).unwrap();
        let mut dm = DeviceModel::from_model(e, &model).unwrap();
        let dx = e.upload(&x).unwrap();
        let dl = e.upload_labels(&ds.labels).unwrap();
        let (dtrain, dtest) = (e.upload_idx(&train).unwrap(), e.upload_idx(&test).unwrap());
        let mut adam = Adam::new(&model.params, lr, wd);
        let t0 = std::time::Instant::now();
        for epoch in 1..=200u64 {
            let fwd = model
                .forward(&g, &x, Pass::Train { epoch }, &mut LocalExchange)
                .unwrap();
            let (_, d) = cross_entropy(&fwd.logits, &ds.labels, &train, train.len() as f64);
            let grads = model.backward(&g, fwd, d, &mut LocalExchange).unwrap();
            adam.step(&mut model.params, &grads);
        }
        let cpu_s = t0.elapsed().as_secs_f64();
        let t0 = std::time::Instant::now();
        for epoch in 1..=200u64 {
            dm.train_epoch(
                e,
                &dg,
                &dx,
                &dl,
                &dtrain,
                train.len(),
                epoch,
                AdamConfig::new(lr, wd),
            )
            .unwrap();
        }
        let gpu_s = t0.elapsed().as_secs_f64();
        let fwd = model
            .forward(&g, &x, Pass::Eval, &mut LocalExchange)
            .unwrap();
        let cpu_acc = correct(&fwd.logits, &ds.labels, &test) as f64 / test.len() as f64;
        let gpu_acc =
            dm.evaluate(e, &dg, &dx, &dl, &[&dtest]).unwrap()[0] as f64 / test.len() as f64;
        eprintln!(
            "Cora {kind:?}: test accuracy cpu {cpu_acc:.4} gpu {gpu_acc:.4}; 200 epochs cpu {cpu_s:.2}s gpu {gpu_s:.2}s"
        );
        assert!(
            (cpu_acc - gpu_acc).abs() <= 0.003,
            "{kind:?}: cpu {cpu_acc} gpu {gpu_acc}"
        );
        let mut back = Model::new(&cfg, 0).unwrap();
        dm.download_into(e, &mut back).unwrap();
        for (a, b) in back.params.iter().zip(&model.params) {
            eprintln!(
                "  {}: relative difference after 200 epochs {:.2e}",
                a.name,
                rel_err(&a.value, &b.value)
            );
        }
    }
}
