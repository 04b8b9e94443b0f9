//! One epoch loop for every device: the host `Model`'s step (`train_resumable_owned`, what a CPU worker runs)
//! and `DeviceModel<Cpu>`'s step (`device::train_resumable_on`, what a GPU worker runs, here on the host
//! device) through `train_loop` give the same losses, the same best-validation record and the same early
//! stop, and a run stopped on one device resumes on the other as if it had never stopped.

use physalia_gnn::device::train_resumable_on;
use physalia_gnn::{
    Adam, Cpu, EpochMetrics, Error, LayerKind, LocalExchange, LocalGraph, Model, ModelConfig,
    NodeSets, Progress, TrainConfig, TrainSummary, train_resumable_owned,
};

mod common;
use common::{Problem, problem};

/// Which step trains.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Step {
    Host,
    Device,
}

struct Job {
    p: Problem,
    g: LocalGraph,
    sets: NodeSets,
    cfg: ModelConfig,
    tc: TrainConfig,
}

fn job(kind: LayerKind, input_dropout: f32, patience: Option<usize>) -> Job {
    let n = 300;
    let p = problem(n, 6, 3, 12);
    let g = LocalGraph::whole(kind, &p.indptr, &p.indices);
    let sets = NodeSets {
        labels: p.labels.clone(),
        train: p.train.clone(),
        val: (0..n as u32).filter(|v| v % 3 == 2).collect(),
        test: (0..n as u32).filter(|v| v % 6 == 5).collect(),
    };
    let mut cfg = ModelConfig::new(kind, 6, 8, 3);
    cfg.heads = 2;
    cfg.dropout = 0.2;
    cfg.input_dropout = input_dropout;
    let tc = TrainConfig {
        epochs: if patience.is_some() { 60 } else { 12 },
        lr: 0.01,
        weight_decay: 5e-4,
        eval_every: if patience.is_some() { 1 } else { 2 },
        patience,
    };
    Job {
        p,
        g,
        sets,
        cfg,
        tc,
    }
}

/// Trains `model` from `start` on `step` until `stop_after` epochs (or the end); returns the summary, the
/// progress and every epoch's metrics the callback saw.
fn run(
    j: &Job,
    step: Step,
    model: &mut Model,
    opt: &mut Adam,
    start: Progress,
    stop_after: usize,
) -> (TrainSummary, Progress, Vec<EpochMetrics>) {
    let mut seen = vec![];
    let mut on_epoch = |e: &physalia_gnn::EpochEnd<'_>| {
        seen.push(e.metrics.clone());
        e.metrics.epoch < stop_after
    };
    let (summary, progress) = match step {
        Step::Host => train_resumable_owned(
            model,
            opt,
            start,
            &j.g,
            j.p.x.clone(),
            &j.sets,
            &j.tc,
            &mut LocalExchange,
            &mut on_epoch,
        ),
        Step::Device => train_resumable_on::<Cpu, Error>(
            &mut Cpu,
            model,
            opt,
            start,
            &j.g,
            &j.p.x,
            &j.sets,
            &j.tc,
            &mut LocalExchange,
            &mut on_epoch,
        ),
    }
    .unwrap();
    (summary, progress, seen)
}

fn fresh(j: &Job) -> (Model, Adam) {
    let model = Model::new(&j.cfg, 4).unwrap();
    let opt = Adam::new(&model.params, j.tc.lr, j.tc.weight_decay);
    (model, opt)
}

/// Per-epoch losses within 1e-4 (relative) and identical accuracies.
fn assert_same_epochs(what: &str, got: &[EpochMetrics], want: &[EpochMetrics]) {
    assert_eq!(got.len(), want.len(), "{what}: epochs");
    for (a, b) in got.iter().zip(want) {
        assert_eq!(a.epoch, b.epoch, "{what}");
        let rel = (a.loss - b.loss).abs() / b.loss.abs().max(1e-3);
        assert!(
            rel < 1e-4,
            "{what}: epoch {}: loss {} vs {}",
            a.epoch,
            a.loss,
            b.loss
        );
        let accs = |m: &EpochMetrics| [m.train_acc, m.val_acc, m.test_acc];
        assert_eq!(accs(a), accs(b), "{what}: epoch {}", a.epoch);
    }
}

fn assert_same_record(what: &str, got: &TrainSummary, want: &TrainSummary) {
    assert_eq!(got.best_epoch, want.best_epoch, "{what}: best epoch");
    assert_eq!(got.best_val_acc, want.best_val_acc, "{what}: best val");
    assert_eq!(
        got.test_acc_at_best_val, want.test_acc_at_best_val,
        "{what}: test at best val"
    );
    assert_eq!(got.stopped_early, want.stopped_early, "{what}: early stop");
}

/// GCN with its features freed once `A X` is cached (host and device alike), GCN with input dropout (kept),
/// GraphSAGE (its root weight reads them) and GAT: the same run on either step, and a run stopped after
/// epoch 5 on either step resumed on the other.
#[test]
fn host_and_device_steps_train_alike_and_resume_on_each_other() {
    for (kind, input_dropout) in [
        (LayerKind::Gcn, 0.0),
        (LayerKind::Gcn, 0.3),
        (LayerKind::Sage, 0.0),
        (LayerKind::Gat, 0.0),
    ] {
        let j = job(kind, input_dropout, None);
        let what = format!("{kind:?} input dropout {input_dropout}");
        let (mut hm, mut ho) = fresh(&j);
        let (host, _, host_seen) = run(&j, Step::Host, &mut hm, &mut ho, Progress::default(), 99);
        let (mut dm, mut dop) = fresh(&j);
        let (dev, _, dev_seen) = run(&j, Step::Device, &mut dm, &mut dop, Progress::default(), 99);
        assert_eq!(host.epochs.len(), j.tc.epochs, "{what}");
        assert_eq!(
            host_seen, host.epochs,
            "{what}: the callback saw every epoch"
        );
        assert_same_epochs(&format!("{what}: device"), &dev.epochs, &host.epochs);
        assert_eq!(dev_seen.len(), dev.epochs.len(), "{what}");
        assert_same_record(&format!("{what}: device"), &dev, &host);
        // the device's state reached the host model and optimizer
        assert_eq!(dop.steps(), ho.steps(), "{what}: Adam steps");
        for (a, b) in dm.params.iter().zip(&hm.params) {
            let err = a.value.max_abs_diff(&b.value);
            assert!(err < 1e-4, "{what}: {}: {err}", a.name);
        }
        for (first, then) in [(Step::Host, Step::Device), (Step::Device, Step::Host)] {
            let what = format!("{what}: 5 epochs on {first:?}, then {then:?}");
            let (mut m, mut o) = fresh(&j);
            let (head, progress, _) = run(&j, first, &mut m, &mut o, Progress::default(), 5);
            assert_eq!(progress.epoch, 5, "{what}");
            assert_eq!(o.steps(), 5, "{what}: Adam steps");
            let (tail, end, _) = run(&j, then, &mut m, &mut o, progress, 99);
            assert_eq!(end.epoch, j.tc.epochs, "{what}");
            let epochs: Vec<_> = head.epochs.into_iter().chain(tail.epochs.clone()).collect();
            assert_same_epochs(&what, &epochs, &host.epochs);
            assert_same_record(&what, &tail, &host);
        }
    }
}

/// Patience ends both steps' runs at the same epoch with the same best-validation record, and a run resumed
/// from mid-way (its evaluations since the best carried in `Progress`) stops there too.
#[test]
fn patience_stops_both_steps_at_the_same_epoch() {
    for kind in [LayerKind::Gcn, LayerKind::Gat] {
        let j = job(kind, 0.0, Some(3));
        let what = format!("{kind:?} patience 3");
        let (mut hm, mut ho) = fresh(&j);
        let (host, _, _) = run(&j, Step::Host, &mut hm, &mut ho, Progress::default(), 99);
        assert!(
            host.stopped_early,
            "{what}: the host ran all {} epochs",
            j.tc.epochs
        );
        let stop = host.epochs.len();
        assert!(stop < j.tc.epochs, "{what}");
        let (mut dm, mut dop) = fresh(&j);
        let (dev, _, _) = run(&j, Step::Device, &mut dm, &mut dop, Progress::default(), 99);
        assert_same_epochs(&format!("{what}: device"), &dev.epochs, &host.epochs);
        assert_same_record(&format!("{what}: device"), &dev, &host);
        // stopped one epoch before patience runs out, with evaluations since the best pending
        let (mut m, mut o) = fresh(&j);
        let (head, progress, _) = run(
            &j,
            Step::Host,
            &mut m,
            &mut o,
            Progress::default(),
            stop - 1,
        );
        assert!(!head.stopped_early, "{what}");
        assert!(progress.since_best > 0, "{what}: {progress:?}");
        let (tail, end, _) = run(&j, Step::Device, &mut m, &mut o, progress, 99);
        assert_eq!(end.epoch, stop, "{what}: resumed");
        let epochs: Vec<_> = head.epochs.into_iter().chain(tail.epochs.clone()).collect();
        assert_same_epochs(&format!("{what}: resumed"), &epochs, &host.epochs);
        assert_same_record(&format!("{what}: resumed"), &tail, &host);
    }
}
