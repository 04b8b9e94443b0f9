//! Hand-derived backward passes against central finite differences, for every layer kind, both aggregation
//! orders, dropout on (masks are fixed by the epoch key, so the loss is a deterministic function) and off.

use physalia_gnn::loss::cross_entropy;
use physalia_gnn::{Activation, LayerKind, LocalExchange, LocalGraph, Model, ModelConfig, Pass};

mod common;
use common::{Problem, problem};

fn loss(model: &mut Model, g: &LocalGraph, p: &Problem, pass: Pass) -> f64 {
    let fwd = model.forward(g, &p.x, pass, &mut LocalExchange).unwrap();
    cross_entropy(&fwd.logits, &p.labels, &p.train, p.train.len() as f64).0 / p.train.len() as f64
}

/// Fraction of parameter entries whose analytic gradient matches the finite difference.
fn check(cfg: ModelConfig, pass: Pass, seed: u64) -> f64 {
    check_on(cfg, pass, seed, 14, 1)
}

/// As `check`, on `n` nodes, testing every `stride`-th parameter entry.
fn check_on(cfg: ModelConfig, pass: Pass, seed: u64, n: usize, stride: usize) -> f64 {
    let p = problem(n, cfg.in_dim, cfg.out_dim, seed);
    let g = LocalGraph::whole(cfg.kind, &p.indptr, &p.indices);
    let mut model = Model::new(&cfg, seed).unwrap();
    let fwd = model.forward(&g, &p.x, pass, &mut LocalExchange).unwrap();
    let (_, d) = cross_entropy(&fwd.logits, &p.labels, &p.train, p.train.len() as f64);
    let grads = model.backward(&g, fwd, d, &mut LocalExchange).unwrap();
    let eps = 1e-2f32;
    let (mut ok, mut total) = (0, 0);
    assert_eq!(grads.len(), model.params.len());
    for (pi, grad) in grads.iter().enumerate() {
        for k in (0..model.params[pi].value.data().len()).step_by(stride) {
            let orig = model.params[pi].value.data()[k];
            model.params[pi].value.data_mut()[k] = orig + eps;
            let up = loss(&mut model, &g, &p, pass);
            model.params[pi].value.data_mut()[k] = orig - eps;
            let down = loss(&mut model, &g, &p, pass);
            model.params[pi].value.data_mut()[k] = orig;
            let fd = (up - down) / (2.0 * eps as f64);
            let an = grad.data()[k] as f64;
            total += 1;
            if (fd - an).abs() <= 2e-3 + 2e-2 * an.abs().max(fd.abs()) {
                ok += 1;
            } else {
                eprintln!(
                    "{} [{k}]: analytic {an:.6} finite difference {fd:.6}",
                    model.params[pi].name
                );
            }
        }
    }
    ok as f64 / total as f64
}

fn cfg(
    kind: LayerKind,
    in_dim: usize,
    hidden: usize,
    layers: usize,
    act: Activation,
    dropout: f32,
) -> ModelConfig {
    let mut c = ModelConfig::new(kind, in_dim, hidden, 3);
    c.layers = layers;
    c.activation = act;
    c.dropout = dropout;
    c.input_dropout = dropout;
    c.heads = 2;
    c.out_heads = 2;
    c.attn_dropout = dropout;
    c
}

const TRAIN: Pass = Pass::Train { epoch: 3 };

#[test]
fn gcn_gradients_both_orders() {
    // in < hidden: aggregate first; in > hidden: transform first
    for (inp, hid) in [(3, 5), (6, 4)] {
        for (pass, p) in [(Pass::Eval, 0.0), (TRAIN, 0.3)] {
            let frac = check(
                cfg(LayerKind::Gcn, inp, hid, 3, Activation::Elu, p),
                pass,
                1,
            );
            assert_eq!(frac, 1.0, "gcn in={inp} hidden={hid} dropout={p}");
        }
    }
}

#[test]
fn sage_gradients_both_orders() {
    for (inp, hid) in [(3, 5), (6, 4)] {
        for (pass, p) in [(Pass::Eval, 0.0), (TRAIN, 0.3)] {
            let frac = check(
                cfg(LayerKind::Sage, inp, hid, 3, Activation::Elu, p),
                pass,
                2,
            );
            assert_eq!(frac, 1.0, "sage in={inp} hidden={hid} dropout={p}");
        }
    }
}

#[test]
fn fused_first_layer_backward_matches_finite_differences() {
    // two layers, input narrower than hidden, output narrower than hidden: layer 0 aggregates first and
    // layer 1 transforms first, so the first layer's gradients are formed block by block
    for kind in [LayerKind::Gcn, LayerKind::Sage] {
        for (pass, p) in [(Pass::Eval, 0.0), (TRAIN, 0.3)] {
            for act in [Activation::Elu, Activation::Relu] {
                let mut c = cfg(kind, 3, 6, 2, act, p);
                c.input_dropout = 0.0;
                let frac = check(c, pass, 6);
                let need = if act == Activation::Elu { 1.0 } else { 0.97 };
                assert!(frac >= need, "{kind:?} {act:?} dropout={p}: {frac}");
            }
        }
    }
}

#[test]
fn gat_gradients_multi_head_with_attention_dropout() {
    // the LeakyReLU on attention scores has a kink that a finite difference may straddle; slope 1 removes it
    // here, and `relu_gradients_match_away_from_kinks` covers slope 0.2
    let smooth = |layers, p| {
        let mut c = cfg(LayerKind::Gat, 4, 3, layers, Activation::Elu, p);
        c.negative_slope = 1.0;
        c
    };
    for (pass, p) in [(Pass::Eval, 0.0), (TRAIN, 0.3)] {
        let frac = check(smooth(2, p), pass, 3);
        assert_eq!(frac, 1.0, "gat dropout={p}");
        let frac = check(smooth(3, p), pass, 4);
        assert_eq!(frac, 1.0, "gat 3 layers dropout={p}");
    }
}

#[test]
fn gradients_hold_across_kernel_row_blocks() {
    // more nodes than one row block of the GAT and SpMM kernels (regression: GAT's backward once read
    // attention coefficients with a block-local index, right only in the first block)
    for kind in [LayerKind::Gat, LayerKind::Gcn, LayerKind::Sage] {
        let mut c = cfg(kind, 4, 3, 2, Activation::Elu, 0.0);
        c.negative_slope = 1.0;
        let frac = check_on(c, Pass::Eval, 7, 700, 1);
        assert_eq!(frac, 1.0, "{kind:?}");
    }
}

#[test]
fn relu_gradients_match_away_from_kinks() {
    // a finite difference straddling a ReLU kink is wrong by construction; nearly all entries must match
    for kind in [LayerKind::Gcn, LayerKind::Sage, LayerKind::Gat] {
        let frac = check(cfg(kind, 5, 4, 2, Activation::Relu, 0.2), TRAIN, 5);
        assert!(frac > 0.97, "{kind:?}: only {frac} of entries match");
    }
}

#[test]
fn training_is_deterministic_across_thread_counts() {
    let p = problem(200, 8, 3, 9);
    for kind in [LayerKind::Gcn, LayerKind::Sage, LayerKind::Gat] {
        let run = |threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let c = cfg(kind, 8, 6, 2, Activation::Relu, 0.5);
                let g = LocalGraph::whole(kind, &p.indptr, &p.indices);
                let mut model = Model::new(&c, 11).unwrap();
                let sets = physalia_gnn::NodeSets {
                    labels: p.labels.clone(),
                    train: p.train.clone(),
                    val: vec![],
                    test: vec![],
                };
                let tc = physalia_gnn::TrainConfig {
                    epochs: 5,
                    lr: 0.01,
                    weight_decay: 5e-4,
                    eval_every: 1,
                    patience: None,
                };
                let s = physalia_gnn::train(
                    &mut model,
                    &g,
                    &p.x,
                    &sets,
                    &tc,
                    &mut LocalExchange,
                    &mut |_| {},
                )
                .unwrap();
                (
                    s.epochs.iter().map(|e| e.loss).collect::<Vec<_>>(),
                    model.params[0].value.clone(),
                )
            })
        };
        assert_eq!(run(1), run(3), "{kind:?}");
    }
}
