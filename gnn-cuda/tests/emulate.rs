//! The kernels' host emulation against `physalia_gnn`'s CPU engine, to 1e-5: proves the kernels' index math,
//! thread-to-row mapping, transposed SpMM, softmax and RNG port before a GPU runs them. `tests/gpu.rs` runs
//! the same checks on the GPU.

mod common;

use common::*;
use physalia_gnn_cuda::Emulator;

const TOL: f32 = 1e-5;

#[test]
fn spmm_forward_transposed_and_with_halo_rows() {
    check_spmm(&mut Emulator, 300, TOL);
}

#[test]
fn spmm_splits_heavy_rows_into_chunks() {
    check_heavy_spmm(&mut Emulator, 7000, TOL);
}

#[test]
fn products_in_every_transpose_and_on_views() {
    check_gemm(&mut Emulator, TOL);
}

#[test]
fn elementwise_dropout_and_reductions() {
    check_elementwise(&mut Emulator, TOL);
}

#[test]
fn masked_cross_entropy_and_accuracy() {
    check_loss(&mut Emulator, TOL);
}

#[test]
fn adam_with_weight_decay() {
    check_adam(&mut Emulator, TOL);
}

#[test]
fn models_equal_the_cpu_engine() {
    for cfg in model_configs() {
        check_model(&mut Emulator, &cfg, 120, TOL);
    }
}

/// The Cora comparison of `tests/gpu.rs` on the emulator: checks the check itself (slow: run with
/// `--ignored`).
#[test]
#[ignore]
fn cora_accuracy_equals_cpu_on_the_emulator() {
    if let Some(dir) = cora_dir() {
        check_cora(
            &mut Emulator,
            &dir,
            &[physalia_gnn::LayerKind::Gcn, physalia_gnn::LayerKind::Gat],
        );
    }
}

/// The same checks on `physalia_gnn`'s own device: the engine's kernels behind the trait, and the generic
/// `DeviceModel` on them against `Model`.
mod cpu {
    use super::*;
    use physalia_gnn::Cpu;

    #[test]
    fn spmm_forward_transposed_and_with_halo_rows() {
        check_spmm(&mut Cpu, 300, TOL);
    }

    #[test]
    fn spmm_over_heavy_rows() {
        check_heavy_spmm(&mut Cpu, 7000, TOL);
    }

    #[test]
    fn products_in_every_transpose_and_on_views() {
        check_gemm(&mut Cpu, TOL);
    }

    #[test]
    fn elementwise_dropout_and_reductions() {
        check_elementwise(&mut Cpu, TOL);
    }

    #[test]
    fn masked_cross_entropy_and_accuracy() {
        check_loss(&mut Cpu, TOL);
    }

    #[test]
    fn adam_with_weight_decay() {
        check_adam(&mut Cpu, TOL);
    }

    #[test]
    fn models_equal_the_cpu_engine() {
        for cfg in model_configs() {
            check_model(&mut Cpu, &cfg, 120, TOL);
        }
    }
}
