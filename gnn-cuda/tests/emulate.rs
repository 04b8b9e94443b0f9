//! Host checks of the device layer without a GPU: every device operation and the generic `DeviceModel` on
//! `physalia_gnn::CpuPrimitives` (the CPU's primitives with the device trait's default layer-level
//! operations, as a GPU runs them) against `physalia_gnn`'s engine and `Model` (the same layers on `Cpu`, whose
//! overrides are the engine's fused and per-range kernels), the checks `tests/gpu.rs` runs on the GPU, and
//! the GPU's own SpMM algorithm (light rows, hub rows cut into chunks) through its thread-by-thread
//! emulation (`cpu_emulate`) against `physalia_gnn`'s SpMM, to 1e-5.

mod common;

use common::*;
use physalia_gnn::CpuPrimitives;
use physalia_gnn::Matrix;
use physalia_gnn::sparse::{Norm, SparseOp};
use physalia_gnn_cuda::HostCsr;
use physalia_gnn_cuda::cpu_emulate;
use physalia_gnn_cuda::kernels::HEAVY_ROW_EDGES;

const TOL: f32 = 1e-5;

#[test]
fn spmm_forward_transposed_and_with_halo_rows() {
    check_spmm(&mut CpuPrimitives, 300, TOL);
}

#[test]
fn spmm_over_heavy_rows() {
    check_heavy_spmm(&mut CpuPrimitives, 7000, TOL);
}

#[test]
fn products_in_every_transpose_and_on_views() {
    check_gemm(&mut CpuPrimitives, TOL);
}

#[test]
fn elementwise_dropout_and_reductions() {
    check_elementwise(&mut CpuPrimitives, TOL);
}

#[test]
fn masked_cross_entropy_and_accuracy() {
    check_loss(&mut CpuPrimitives, TOL);
}

#[test]
fn adam_with_weight_decay() {
    check_adam(&mut CpuPrimitives, TOL);
}

#[test]
fn models_equal_the_cpu_engine() {
    for cfg in model_configs() {
        check_model(&mut CpuPrimitives, &cfg, 120, TOL);
    }
}

/// The emulated kernels' SpMM over `op` (forward with `halo` rows after `own`, and transposed) against
/// `physalia_gnn`'s.
fn check_emulated_spmm(what: &str, op: &SparseOp, own: &Matrix, halo: Option<&Matrix>) {
    let a = HostCsr::from_op(op);
    let d = own.cols();
    let h = halo.map_or(&[][..], |h| h.data());
    let y = Matrix::from_vec(op.n_dst(), d, cpu_emulate::spmm(&a, own.data(), h, d));
    assert_close(
        &format!("{what}: spmm d={d}"),
        &y,
        &op.spmm_ext(own, halo),
        TOL,
    );
    let x = random(op.n_dst(), d, d as u64 ^ 3);
    let yt = Matrix::from_vec(op.n_src(), d, cpu_emulate::spmm_t(&a, x.data(), d));
    assert_close(&format!("{what}: spmm_t d={d}"), &yt, &op.spmm_t(&x), TOL);
}

#[test]
fn emulated_spmm_equals_the_cpu_at_every_width() {
    let n = 300;
    let p = problem(n, 1, 2, 11);
    for norm in [Norm::Symmetric, Norm::Mean, Norm::SelfLoopsOnly] {
        let op = SparseOp::build(n, n, &p.indptr, &p.indices, norm, None);
        for d in [1usize, 3, 4, 16, 40, 128, 130, 600] {
            check_emulated_spmm(&format!("{norm:?}"), &op, &random(n, d, d as u64), None);
        }
    }
}

/// Node 1 is a hub of `n / 3` edges, more than `HEAVY_ROW_EDGES`: its row and its column are cut into
/// chunks summed in order, forward and transposed, on the whole graph and on a partition with halo rows.
#[test]
fn emulated_spmm_splits_heavy_rows_into_chunks() {
    let n = 7000;
    let p = problem(n, 1, 2, 5);
    let hub = (p.indptr[2] - p.indptr[1]) as u64;
    assert!(hub > HEAVY_ROW_EDGES, "the hub has {hub} edges: not heavy");
    for norm in [Norm::Symmetric, Norm::Mean] {
        let op = SparseOp::build(n, n, &p.indptr, &p.indices, norm, None);
        for d in [4usize, 7, 64, 130] {
            check_emulated_spmm(
                &format!("heavy {norm:?}"),
                &op,
                &random(n, d, d as u64),
                None,
            );
        }
    }
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
    let (own, halo) = (random(n_dst, 64, 1), random(n - n_dst, 64, 2));
    check_emulated_spmm("heavy with halo rows", &op, &own, Some(&halo));
}

/// The Cora comparison of `tests/gpu.rs` on the CPU device: checks the check itself (slow: run with
/// `--ignored`).
#[test]
#[ignore]
fn cora_accuracy_equals_cpu_on_the_cpu_device() {
    if let Some(dir) = cora_dir() {
        check_cora(
            &mut CpuPrimitives,
            &dir,
            &[physalia_gnn::LayerKind::Gcn, physalia_gnn::LayerKind::Gat],
        );
    }
}

/// The device's step in the one training loop (`train_resumable_on`, what a GPU worker runs) against the
/// CPU's (`physalia_gnn::train_resumable`): per-epoch losses and validation accuracy, with GCN's features freed
/// once `A X` is cached (no input dropout) and kept (input dropout), and with SAGE, whose root weight reads
/// them every epoch.
#[test]
fn device_loop_equals_the_cpu_loop_with_and_without_the_features_freed() {
    use physalia_gnn::{
        Adam, LayerKind, LocalExchange, LocalGraph, Model, ModelConfig, NodeSets, Progress,
        TrainConfig,
    };
    let n = 400;
    let p = problem(n, 24, 4, 13);
    let sets = NodeSets {
        labels: p.labels.clone(),
        train: p.train.clone(),
        val: (0..n as u32).filter(|i| i % 5 == 1).collect(),
        test: (0..n as u32).filter(|i| i % 5 == 2).collect(),
    };
    let tc = TrainConfig {
        epochs: 6,
        lr: 0.01,
        weight_decay: 5e-4,
        eval_every: 2,
        patience: None,
    };
    for (kind, input_dropout) in [
        (LayerKind::Gcn, 0.0),
        (LayerKind::Gcn, 0.3),
        (LayerKind::Sage, 0.0),
    ] {
        let mut cfg = ModelConfig::new(kind, 24, 32, 4);
        cfg.input_dropout = input_dropout;
        cfg.dropout = 0.2;
        let what = format!("{kind:?} input dropout {input_dropout}");
        let g = LocalGraph::whole(kind, &p.indptr, &p.indices);
        let run = |device: bool| {
            let mut model = Model::new(&cfg, 3).unwrap();
            let mut opt = Adam::new(&model.params, tc.lr, tc.weight_decay);
            let (summary, _) = if device {
                physalia_gnn_cuda::train_resumable_on(
                    &mut CpuPrimitives,
                    &mut model,
                    &mut opt,
                    Progress::default(),
                    &g,
                    &p.x,
                    &sets,
                    &tc,
                    &mut LocalExchange,
                    &mut |_| true,
                )
                .unwrap()
            } else {
                physalia_gnn::train_resumable(
                    &mut model,
                    &mut opt,
                    Progress::default(),
                    &g,
                    &p.x,
                    &sets,
                    &tc,
                    &mut LocalExchange,
                    &mut |_| true,
                )
                .unwrap()
            };
            summary.epochs
        };
        let (cpu, dev) = (run(false), run(true));
        assert_eq!(cpu.len(), tc.epochs, "{what}");
        assert_eq!(dev.len(), tc.epochs, "{what}");
        for (c, d) in cpu.iter().zip(&dev) {
            let rel = (c.loss - d.loss).abs() / c.loss.abs().max(1e-3);
            assert!(
                rel < 1e-4,
                "{what}: epoch {}: loss {} vs {}",
                c.epoch,
                d.loss,
                c.loss
            );
            assert_eq!(c.val_acc, d.val_acc, "{what}: epoch {}", c.epoch);
        }
    }
}

/// GCN's normalised adjacency of an undirected graph is its own transpose (the GPU then uploads it once);
/// GraphSAGE's mean weights by the destination's degree and a partition's operator has halo columns, so
/// neither is.
#[test]
fn only_symmetric_operators_share_their_transpose() {
    let n = 500;
    let p = problem(n, 1, 2, 7);
    let of = |norm| HostCsr::from_op(&SparseOp::build(n, n, &p.indptr, &p.indices, norm, None));
    assert!(of(Norm::Symmetric).is_symmetric());
    assert!(of(Norm::SelfLoopsOnly).is_symmetric());
    assert!(!of(Norm::Mean).is_symmetric());
    let n_dst = n / 2;
    let deg: Vec<u32> = (0..n)
        .map(|j| (p.indptr[j + 1] - p.indptr[j]) as u32)
        .collect();
    let part = SparseOp::build(
        n_dst,
        n,
        &p.indptr[..=n_dst],
        &p.indices[..p.indptr[n_dst] as usize],
        Norm::Symmetric,
        Some(&deg),
    );
    assert!(!HostCsr::from_op(&part).is_symmetric());
}
