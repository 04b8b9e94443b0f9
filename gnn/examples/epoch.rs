//! Times full-graph CPU training epochs of `physalia_gnn::train` on a generated SBM, the shape of
//! `bench/RESULTS.md`'s rows (2 layers, hidden 256, ReLU, Adam lr 0.01 / weight decay 5e-4, dropout between the
//! layers only, 10% training nodes), without the CLI: for comparing the engine before and after a change.
//!
//! `cargo run --release -p physalia-gnn --example epoch -- MODEL NODES EPOCHS DROPOUT THREADS` (defaults
//! `gcn 100000 5 0.5 2`), with the binaries' allocator and heap settings; prints the median epoch (forward + loss + backward + Adam, no evaluation) in seconds.
//! A sixth argument `profile` also prints where the epochs after the first went, per CPU operation
//! (`physalia_gnn::profile`: seconds per epoch, calls per epoch, share of the epoch; epochs 2..E-1, E >= 3).
//! GAT runs 4 heads of 64 columns; a seventh argument sets the hidden width of all heads together
//! (`bench/compare.py --gat-hidden`, 64 by default there).

use physalia_gnn::{
    LayerKind, LocalExchange, LocalGraph, Matrix, Model, ModelConfig, NodeSets, TrainConfig,
};
use physalia_graph::synth::{SbmParams, sbm};

/// The allocator the binaries run the engine with (`physalia`, `physalia-worker`).
#[global_allocator]
static ALLOC: physalia_gnn::heap::LineAligned = physalia_gnn::heap::LineAligned;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.into());
    let kind = match arg(0, "gcn").as_str() {
        "gcn" => LayerKind::Gcn,
        "sage" => LayerKind::Sage,
        "gat" => LayerKind::Gat,
        other => panic!("unknown model {other} (gcn, sage, gat)"),
    };
    let nodes: usize = arg(1, "100000").parse().expect("NODES is a number");
    let epochs: usize = arg(2, "5").parse().expect("EPOCHS is a number");
    let dropout: f32 = arg(3, "0.5").parse().expect("DROPOUT is a number");
    let threads: usize = arg(4, "2").parse().expect("THREADS is a number");
    let profile = arg(5, "") == "profile";
    let gat_hidden: usize = arg(6, "256").parse().expect("GAT_HIDDEN is a number");
    assert!(
        !profile || epochs >= 3,
        "profile counts epochs 2..E-1: give at least 3"
    );
    // as the binaries do: large buffers from the heap, never trimmed, so epochs reuse pages
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
    let mut spans = Vec::new();
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .expect("the global pool is built once");
    let d = sbm(&SbmParams {
        num_nodes: nodes,
        num_classes: 16,
        avg_degree: 10.0,
        feat_dim: 128,
        train_frac: 0.1,
        seed: 0,
        ..SbmParams::default()
    })
    .expect("valid SBM parameters");
    let n = d.labels.len();
    let x = Matrix::from_vec(n, 128, d.features.view().to_f32().into_owned());
    let g = LocalGraph::whole(kind, &d.indptr, &d.indices);
    let rows = |v: &[i64]| v.iter().map(|&i| i as u32).collect::<Vec<_>>();
    let sets = NodeSets {
        labels: d.labels.clone(),
        train: rows(&d.train_idx),
        val: rows(&d.val_idx),
        test: rows(&d.test_idx),
    };
    let mut cfg = ModelConfig::new(kind, 128, 256, 16);
    cfg.dropout = dropout;
    cfg.input_dropout = 0.0;
    if kind == LayerKind::Gat {
        cfg.heads = 4;
        cfg.hidden = gat_hidden / 4;
    }
    let mut model = Model::new(&cfg, 0).expect("valid model");
    let tc = TrainConfig {
        epochs,
        lr: 0.01,
        weight_decay: 5e-4,
        eval_every: epochs + 1,
        patience: None,
    };
    let mut times = Vec::new();
    physalia_gnn::train(
        &mut model,
        &g,
        &x,
        &sets,
        &tc,
        &mut LocalExchange,
        &mut |m| {
            times.push(m.train_s);
            // epochs 2..E-1: the first also caches `A X`, the last ends with an evaluation
            if profile && times.len() == 1 {
                physalia_gnn::profile::enable();
            }
            if profile && times.len() == epochs - 1 {
                spans = physalia_gnn::profile::take();
            }
        },
    )
    .expect("training runs");
    let steady_times = &times[1.min(times.len())..times.len().saturating_sub(1).max(1)];
    let counted: f64 = steady_times.iter().sum();
    let steady = steady_times.len().max(1) as f64;
    times.sort_by(f64::total_cmp);
    println!("{:.4}", times[times.len() / 2]);
    if profile {
        println!("epochs 2..{}: {:.4} s/epoch", epochs - 1, counted / steady);
        for (name, s, calls) in spans {
            println!(
                "  {name:<22} {:8.4} s/epoch {:6.1} calls/epoch {:5.1}%",
                s / steady,
                calls as f64 / steady,
                100.0 * s / counted.max(1e-12)
            );
        }
    }
}
