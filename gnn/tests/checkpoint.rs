//! Checkpoints: stopping after any epoch, saving, loading and resuming gives exactly the uninterrupted run
//! (weights, optimizer, dropout keys and best-validation tracking); damaged or foreign files are refused.

use physalia_gnn::save::{load_checkpoint, save_checkpoint, save_model};
use physalia_gnn::{
    Adam, LayerKind, LocalExchange, LocalGraph, Matrix, Model, ModelConfig, NodeSets, Pass,
    Progress, TrainConfig, train_resumable, train_resumable_owned,
};

mod common;
use common::problem;

fn setup(
    kind: LayerKind,
) -> (
    common::Problem,
    LocalGraph,
    NodeSets,
    ModelConfig,
    TrainConfig,
) {
    let p = problem(300, 6, 3, 12);
    let g = LocalGraph::whole(kind, &p.indptr, &p.indices);
    let sets = NodeSets {
        labels: p.labels.clone(),
        train: p.train.clone(),
        val: (0..300u32).filter(|v| v % 3 == 2).collect(),
        test: vec![],
    };
    let mut cfg = ModelConfig::new(kind, 6, 8, 3);
    cfg.heads = 2;
    let tc = TrainConfig {
        epochs: 12,
        lr: 0.01,
        weight_decay: 5e-4,
        eval_every: 2,
        patience: None,
    };
    (p, g, sets, cfg, tc)
}

#[test]
fn resuming_from_a_checkpoint_equals_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    for kind in [LayerKind::Gcn, LayerKind::Sage, LayerKind::Gat] {
        let (p, g, sets, cfg, tc) = setup(kind);
        let mut model = Model::new(&cfg, 4).unwrap();
        let mut opt = Adam::new(&model.params, tc.lr, tc.weight_decay);
        let mut straight = vec![];
        let (whole, _) = train_resumable(
            &mut model,
            &mut opt,
            Progress::default(),
            &g,
            &p.x,
            &sets,
            &tc,
            &mut LocalExchange,
            &mut |e| {
                straight.push(e.metrics.loss);
                true
            },
        )
        .unwrap();
        // the engine's time before the first epoch is that epoch's alone
        assert!(
            whole.epochs[0].prepare_s.is_some_and(|s| s >= 0.0),
            "{kind:?}"
        );
        assert!(
            whole.epochs[1..].iter().all(|m| m.prepare_s.is_none()),
            "{kind:?}"
        );
        for stop_after in [1, 5, 11] {
            let mut m1 = Model::new(&cfg, 4).unwrap();
            let mut o1 = Adam::new(&m1.params, tc.lr, tc.weight_decay);
            let mut losses = vec![];
            let (_, progress) = train_resumable(
                &mut m1,
                &mut o1,
                Progress::default(),
                &g,
                &p.x,
                &sets,
                &tc,
                &mut LocalExchange,
                &mut |e| {
                    losses.push(e.metrics.loss);
                    e.metrics.epoch < stop_after
                },
            )
            .unwrap();
            assert_eq!(progress.epoch, stop_after);
            let path = dir
                .path()
                .join(format!("{kind:?}-{stop_after}.safetensors"));
            save_checkpoint(&m1, &o1, &progress, &path).unwrap();
            let (mut m2, mut o2, progress2) = load_checkpoint(&path).unwrap();
            assert_eq!(progress2, progress);
            let (rest, _) = train_resumable(
                &mut m2,
                &mut o2,
                progress2,
                &g,
                &p.x,
                &sets,
                &tc,
                &mut LocalExchange,
                &mut |e| {
                    losses.push(e.metrics.loss);
                    true
                },
            )
            .unwrap();
            assert_eq!(losses, straight, "{kind:?} stopped after {stop_after}");
            for (a, b) in m2.params.iter().zip(&model.params) {
                assert_eq!(
                    a.value, b.value,
                    "{kind:?} stopped after {stop_after}: {}",
                    a.name
                );
            }
            assert_eq!(rest.best_epoch, whole.best_epoch);
            assert_eq!(rest.best_val_acc, whole.best_val_acc);
        }
    }
}

#[test]
fn damaged_or_foreign_files_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (_, _, _, cfg, tc) = setup(LayerKind::Gcn);
    let model = Model::new(&cfg, 1).unwrap();
    let opt = Adam::new(&model.params, tc.lr, tc.weight_decay);
    let error = |path: &std::path::Path| match load_checkpoint(path) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string(),
    };
    // a model file is not a checkpoint
    let plain = dir.path().join("model.safetensors");
    save_model(&model, &plain, &[("seed", "1".into())]).unwrap();
    let err = error(&plain);
    assert!(
        err.contains("model.safetensors") && err.contains("not a checkpoint"),
        "{err}"
    );
    // truncated
    let good = dir.path().join("ck.safetensors");
    save_checkpoint(&model, &opt, &Progress::default(), &good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = error(&cut);
    assert!(err.contains("cut.safetensors"), "{err}");
    // missing file
    let err = error(&dir.path().join("nope"));
    assert!(err.contains("nope"), "{err}");
}

/// A loop that owns the features frees them once the model stops reading them (GCN without input dropout,
/// once `A X` is cached) and trains exactly as the borrowing loop; where the features are still read (input
/// dropout, GraphSAGE's root weight) the model says so.
#[test]
fn owned_features_are_freed_once_unneeded_and_change_nothing() {
    for (kind, input_dropout, freed) in [
        (LayerKind::Gcn, 0.0, true),
        (LayerKind::Gcn, 0.5, false),
        (LayerKind::Sage, 0.0, false),
    ] {
        let (p, g, sets, mut cfg, tc) = setup(kind);
        cfg.input_dropout = input_dropout;
        let mut a = Model::new(&cfg, 3).unwrap();
        let mut oa = Adam::new(&a.params, tc.lr, tc.weight_decay);
        let (sa, _) = train_resumable(
            &mut a,
            &mut oa,
            Progress::default(),
            &g,
            &p.x,
            &sets,
            &tc,
            &mut LocalExchange,
            &mut |_| true,
        )
        .unwrap();
        let mut b = Model::new(&cfg, 3).unwrap();
        let mut ob = Adam::new(&b.params, tc.lr, tc.weight_decay);
        let (sb, _) = train_resumable_owned(
            &mut b,
            &mut ob,
            Progress::default(),
            &g,
            p.x.clone(),
            &sets,
            &tc,
            &mut LocalExchange,
            &mut |_| true,
        )
        .unwrap();
        let what = format!("{kind:?} input dropout {input_dropout}");
        let losses = |s: &physalia_gnn::TrainSummary| -> Vec<f64> {
            s.epochs.iter().map(|e| e.loss).collect()
        };
        assert_eq!(losses(&sa), losses(&sb), "{what}: losses");
        for (x, y) in a.params.iter().zip(&b.params) {
            assert_eq!(x.value, y.value, "{what}: {}", x.name);
        }
        assert_eq!(!b.needs_input(), freed, "{what}");
        // freed features are an empty matrix from then on, and the model runs without them
        let empty = Matrix::zeros(0, 0);
        let run = b.forward(&g, &empty, Pass::Eval, &mut LocalExchange);
        assert_eq!(run.is_ok(), freed, "{what}: forward without features");
    }
}
