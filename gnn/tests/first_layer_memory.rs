//! A first layer that transforms its input before aggregating (features wider than the hidden layer) holds no
//! dropped-out copy of its input under input dropout: its products and weight gradients draw the dropout
//! again a row block at a time (issue 31: the copy was as large as a worker's features, held from forward to
//! backward). Measured with a counting allocator: the bytes a training step allocates beyond what was live
//! before it stay well under one copy of the features.

use physalia_gnn::heap::Counting;
use physalia_gnn::{Adam, LayerKind, LocalExchange, LocalGraph, Matrix, Model, ModelConfig, Pass};
use physalia_graph::synth::{SbmParams, sbm};

#[global_allocator]
static A: Counting = Counting;

#[test]
fn a_transforming_first_layer_holds_no_dropped_out_copy_of_its_input() {
    const NODES: usize = 40_000;
    const FEATURES: usize = 512;
    // two threads whatever the machine: the row blocks drawn at once are one per thread
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("a pool of two threads");
    let d = sbm(&SbmParams {
        num_nodes: NODES,
        num_classes: 4,
        avg_degree: 8.0,
        feat_dim: FEATURES,
        train_frac: 0.5,
        seed: 3,
        ..SbmParams::default()
    })
    .expect("a generated graph");
    let x = Matrix::from_vec(NODES, FEATURES, d.features.view().to_f32().into_owned());
    let train: Vec<u32> = d.train_idx.iter().map(|&i| i as u32).collect();
    let copy = NODES * FEATURES * 4;
    for kind in [LayerKind::Gcn, LayerKind::Sage] {
        let g = LocalGraph::whole(kind, &d.indptr, &d.indices);
        // 512 features into 8: the first layer transforms, then aggregates
        let mut cfg = ModelConfig::new(kind, FEATURES, 8, 4);
        cfg.input_dropout = 0.5;
        cfg.dropout = 0.5;
        let mut model = Model::new(&cfg, 0).expect("a model");
        let mut opt = Adam::new(&model.params, 0.01, 5e-4);
        let mut ex = LocalExchange;
        let mut step = |epoch: u64| -> f64 {
            let fwd = model
                .forward(&g, &x, Pass::Train { epoch }, &mut ex)
                .expect("forward");
            let (loss, dl) = physalia_gnn::loss::cross_entropy(
                &fwd.logits,
                &d.labels,
                &train,
                train.len() as f64,
            );
            let grads = model.backward(&g, fwd, dl, &mut ex).expect("backward");
            opt.step(&mut model.params, &grads);
            loss
        };
        pool.install(|| {
            // the first step allocates what every step reuses (the optimizer's moments)
            step(1);
            let before = Counting::live();
            Counting::reset_peak();
            let loss = step(2);
            assert!(loss.is_finite());
            let extra = Counting::peak().saturating_sub(before);
            assert!(
                extra < copy * 3 / 4,
                "{kind:?}: a training step allocated {extra} bytes beyond what was live, a dropped-out \
                 copy of the input is {copy}"
            );
        });
    }
}
