//! Live heap bytes of full-graph CPU training on a generated SBM, phase by phase: a counting global allocator
//! reports what is allocated after loading, after `A X` is cached, and after each epoch's forward, loss,
//! backward and optimizer step, with the peak reached inside each phase. For finding what makes a worker's
//! peak (bench/RESULTS.md, issue 17); the worker's peak RSS adds its runtime and the allocator's slack.
//!
//! `cargo run -p physalia-gnn --example live_bytes -- MODEL NODES DROPOUT [HIDDEN]` (e.g. `sage 1000000 0 256`).

use physalia_gnn::heap::Counting;
use physalia_gnn::{Adam, LayerKind, LocalExchange, LocalGraph, Matrix, Model, ModelConfig, Pass};
use physalia_graph::synth::{SbmParams, sbm};

#[global_allocator]
static A: Counting = Counting;
fn mib(b: usize) -> usize {
    b >> 20
}
fn mark(what: &str) {
    println!(
        "{what:30} live {:5} MiB peak {:5} MiB",
        mib(Counting::live()),
        mib(Counting::peak())
    );
    Counting::reset_peak();
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let kind = match args[0].as_str() {
        "gcn" => LayerKind::Gcn,
        "sage" => LayerKind::Sage,
        _ => LayerKind::Gat,
    };
    let nodes: usize = args[1].parse().expect("example setup");
    let dropout: f32 = args[2].parse().expect("example setup");
    let hidden: usize = args
        .get(3)
        .map(|s| s.parse().expect("example setup"))
        .unwrap_or(256);
    rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build_global()
        .expect("example setup");
    let d = sbm(&SbmParams {
        num_nodes: nodes,
        num_classes: 16,
        avg_degree: 10.0,
        feat_dim: 128,
        train_frac: 0.1,
        seed: 0,
        ..SbmParams::default()
    })
    .expect("example setup");
    let n = d.labels.len();
    let x = Matrix::from_vec(n, 128, d.features.view().to_f32().into_owned());
    let g = LocalGraph::whole(kind, &d.indptr, &d.indices);
    let labels = d.labels.clone();
    let train: Vec<u32> = d.train_idx.iter().map(|&i| i as u32).collect();
    drop(d);
    mark("loaded (x + graph)");
    println!(
        "graph ops {} MiB, x {} MiB",
        mib(g.memory_bytes()),
        mib(x.data().len() * 4)
    );
    let mut cfg = ModelConfig::new(kind, 128, hidden, 16);
    cfg.dropout = dropout;
    cfg.input_dropout = 0.0;
    if kind == LayerKind::Gat {
        cfg.heads = 4;
    }
    let mut model = Model::new(&cfg, 0).expect("example setup");
    let mut opt = Adam::new(&model.params, 0.01, 5e-4);
    let mut ex = LocalExchange;
    model
        .cache_input_aggregation(&g, &x, Pass::Train { epoch: 1 }, &mut ex)
        .expect("example setup");
    mark("A X cached");
    for epoch in 1..=2u64 {
        let fwd = model
            .forward(&g, &x, Pass::Train { epoch }, &mut ex)
            .expect("example setup");
        mark("forward");
        let (_l, dl) =
            physalia_gnn::loss::cross_entropy(&fwd.logits, &labels, &train, train.len() as f64);
        mark("loss");
        let grads = model.backward(&g, fwd, dl, &mut ex).expect("example setup");
        mark("backward");
        opt.step(&mut model.params, &grads);
        drop(grads);
        mark("step");
    }
}
