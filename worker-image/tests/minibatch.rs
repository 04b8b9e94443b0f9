//! Data-parallel and P3 mini-batch training over the in-memory mesh.
//!
//! With fan-outs that take every neighbour and one global batch per epoch (`batch_size` at least the
//! training set), N workers (each training its own seeds, fetching remote rows, all-reducing gradients)
//! compute what full-graph training computes on the same seeds: per-epoch losses and final weights within
//! 1e-4 relative. A cache of remote rows changes where rows come from, never the result.
//!
//! `batch_size` is the global batch and a seed's sampled neighbourhood depends only on (seed, epoch, step),
//! so with sampled fan-outs and several steps per epoch, 1, 2 and 4 workers also learn the same thing, in
//! data parallelism and in P3 alike (and the two modes agree with each other); on Cora the test accuracy
//! of the example job does not depend on the worker count.

use physalia_gnn::{
    Activation, LayerKind, LocalExchange, LocalGraph, Matrix, Model, ModelConfig, NodeSets,
    TrainConfig,
};
use physalia_graph::partition::{DatasetRef, build_parts, partition_metis};
use physalia_graph::{OwnedDataset, SbmParams, Split};
use physalia_wire::{Link, MemLink};
use physalia_worker::minibatch::{MiniBatchOptions, ShardData, train_minibatch};
use physalia_worker::{ExchangeOptions, MeshExchange};

const EPOCHS: usize = 6;

fn sbm() -> OwnedDataset {
    let p = SbmParams {
        num_nodes: 1500,
        num_classes: 4,
        feat_dim: 12,
        seed: 5,
        ..SbmParams::default()
    };
    physalia_graph::synth::sbm(&p).unwrap()
}

fn model_cfg(kind: LayerKind) -> ModelConfig {
    let mut c = ModelConfig::new(kind, 12, 16, 4);
    c.dropout = 0.5;
    c.input_dropout = 0.2;
    if kind == LayerKind::Gat {
        c.hidden = 4;
        c.heads = 2;
        c.activation = Activation::Elu;
    }
    c
}

fn train_cfg() -> TrainConfig {
    train_for(EPOCHS)
}

fn train_for(epochs: usize) -> TrainConfig {
    TrainConfig {
        epochs,
        lr: 0.01,
        weight_decay: 5e-4,
        eval_every: 2,
        patience: None,
    }
}

fn sets(ds: &OwnedDataset) -> NodeSets {
    let rows = |s: Split| ds.split(s).iter().map(|&i| i as u32).collect();
    NodeSets {
        labels: ds.labels.clone(),
        train: rows(Split::Train),
        val: rows(Split::Val),
        test: rows(Split::Test),
    }
}

fn features(ds: &OwnedDataset) -> Matrix {
    Matrix::from_vec(
        ds.meta.num_nodes,
        ds.meta.feat_dim,
        ds.features.view().to_f32().into_owned(),
    )
}

fn full_graph(ds: &OwnedDataset, cfg: &ModelConfig) -> (Vec<f64>, Vec<Matrix>) {
    let g = LocalGraph::whole(cfg.kind, &ds.indptr, &ds.indices);
    let mut model = Model::new(cfg, 7).unwrap();
    let s = physalia_gnn::train(
        &mut model,
        &g,
        &features(ds),
        &sets(ds),
        &train_cfg(),
        &mut LocalExchange,
        &mut |_| {},
    )
    .unwrap();
    (
        s.epochs.iter().map(|e| e.loss).collect(),
        model.params.into_iter().map(|p| p.value).collect(),
    )
}

struct Run {
    losses: Vec<f64>,
    weights: Vec<Matrix>,
    hits: u64,
    misses: u64,
    fetch_bytes: u64,
    val_acc: Option<f64>,
    test_at_best_val: Option<f64>,
}

impl Run {
    fn new() -> Run {
        Run {
            losses: vec![],
            weights: vec![],
            hits: 0,
            misses: 0,
            fetch_bytes: 0,
            val_acc: None,
            test_at_best_val: None,
        }
    }
}

fn data_parallel(
    ds: &OwnedDataset,
    cfg: &ModelConfig,
    k: usize,
    opts: &MiniBatchOptions,
) -> Vec<Run> {
    data_parallel_for(ds, cfg, k, opts, &train_cfg())
}

fn data_parallel_for(
    ds: &OwnedDataset,
    cfg: &ModelConfig,
    k: usize,
    opts: &MiniBatchOptions,
    tc: &TrainConfig,
) -> Vec<Run> {
    hybrid(ds, cfg, k, 1, opts, tc)
}

/// `replicas` replicas of a `k`-way partitioning: rank = replica * k + part.
fn hybrid(
    ds: &OwnedDataset,
    cfg: &ModelConfig,
    k: usize,
    replicas: usize,
    opts: &MiniBatchOptions,
    tc: &TrainConfig,
) -> Vec<Run> {
    hybrid_seeded(ds, cfg, k, replicas, opts, tc, 7, false)
}

/// [`hybrid`] with the training seed and feature row normalisation given.
#[allow(clippy::too_many_arguments)]
fn hybrid_seeded(
    ds: &OwnedDataset,
    cfg: &ModelConfig,
    k: usize,
    replicas: usize,
    opts: &MiniBatchOptions,
    tc: &TrainConfig,
    seed: u64,
    row_normalize: bool,
) -> Vec<Run> {
    let p = partition_metis(ds.csr(), k, 0).unwrap();
    let parts = build_parts(DatasetRef::from(ds), &p).unwrap();
    let train: Vec<u32> = ds.split(Split::Train).iter().map(|&i| i as u32).collect();
    let links = MemLink::mesh(k * replicas);
    std::thread::scope(|s| {
        let handles: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(rank, mut link)| {
                let (p, train, part) = (&p, &train, &parts[rank % k]);
                s.spawn(move || {
                    let data = ShardData::from_part(
                        part,
                        &p.parts,
                        train,
                        cfg,
                        row_normalize,
                        replicas,
                        rank / k,
                    );
                    let shard = data.shard(&ds.indptr, &ds.indices);
                    let mut mesh = MeshExchange::new(&mut link, part, ExchangeOptions::default());
                    let mut run = Run::new();
                    let (model, summary) =
                        train_minibatch(&mut mesh, &shard, cfg, seed, tc, opts, &mut |m| {
                            run.losses.push(m.loss);
                            run.val_acc = m.val_acc.or(run.val_acc);
                            let b = m.batches.as_ref().unwrap();
                            run.hits += b.cache_hits;
                            run.misses += b.cache_misses;
                            run.fetch_bytes += m
                                .exchange
                                .per_layer
                                .iter()
                                .filter(|l| l.phase == "fetch")
                                .map(|l| l.received)
                                .sum::<u64>();
                        })
                        .unwrap();
                    run.weights = model.params.into_iter().map(|p| p.value).collect();
                    run.test_at_best_val = summary.test_acc_at_best_val;
                    run
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn full_batch(cache_rows: usize) -> MiniBatchOptions {
    MiniBatchOptions {
        fanouts: vec![None, None],
        batch_size: 100_000,
        cache_rows,
        presample_batches: 1,
        loader_threads: 2,
        prefetch: 2,
    }
}

fn assert_same(what: &str, run: &Run, want: &(Vec<f64>, Vec<Matrix>)) {
    for (e, (a, b)) in run.losses.iter().zip(&want.0).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "{what}: epoch {} loss {a} vs full graph {b}",
            e + 1
        );
    }
    for (k, (a, b)) in run.weights.iter().zip(&want.1).enumerate() {
        let rel = a.max_abs_diff(b) / b.max_abs().max(1e-6);
        assert!(rel <= 1e-4, "{what}: parameter {k} differs by {rel:e}");
    }
}

#[test]
fn full_fanout_data_parallel_equals_full_graph_training() {
    let ds = sbm();
    for kind in [LayerKind::Gcn, LayerKind::Sage, LayerKind::Gat] {
        let cfg = model_cfg(kind);
        let want = full_graph(&ds, &cfg);
        for k in 1..=3 {
            let runs = data_parallel(&ds, &cfg, k, &full_batch(0));
            for (rank, run) in runs.iter().enumerate() {
                assert_same(&format!("{kind:?} k={k} rank {rank}"), run, &want);
            }
            if k > 1 {
                assert!(runs.iter().all(|r| r.misses > 0 && r.fetch_bytes > 0));
            }
        }
    }
}

#[test]
fn replicas_of_a_partitioning_split_the_seeds_and_equal_full_graph_training() {
    let ds = sbm();
    let cfg = model_cfg(LayerKind::Gcn);
    let want = full_graph(&ds, &cfg);
    for (k, replicas) in [(1, 2), (2, 2), (3, 2)] {
        let runs = hybrid(&ds, &cfg, k, replicas, &full_batch(50), &train_cfg());
        for (rank, run) in runs.iter().enumerate() {
            assert_same(
                &format!("{k} parts x {replicas} replicas, rank {rank}"),
                run,
                &want,
            );
        }
    }
}

#[test]
fn cache_serves_remote_rows_without_changing_results() {
    let ds = sbm();
    let cfg = model_cfg(LayerKind::Sage);
    let want = full_graph(&ds, &cfg);
    let uncached = data_parallel(&ds, &cfg, 3, &full_batch(0));
    let cached = data_parallel(&ds, &cfg, 3, &full_batch(200));
    for (rank, (c, u)) in cached.iter().zip(&uncached).enumerate() {
        assert_same(&format!("cached rank {rank}"), c, &want);
        assert!(c.hits > 0, "rank {rank}: the cache served nothing");
        assert_eq!(
            c.hits + c.misses,
            u.misses,
            "rank {rank}: remote reads differ"
        );
        assert!(
            c.fetch_bytes < u.fetch_bytes,
            "rank {rank}: the cache saved no bytes"
        );
    }
}

#[test]
fn sampled_minibatches_learn() {
    let ds = sbm();
    let cfg = model_cfg(LayerKind::Sage);
    let opts = MiniBatchOptions {
        fanouts: vec![Some(5), Some(5)],
        batch_size: 64,
        cache_rows: 100,
        presample_batches: 4,
        loader_threads: 1,
        prefetch: 2,
    };
    let runs = data_parallel_for(&ds, &cfg, 2, &opts, &train_for(20));
    let first = runs[0].losses[0];
    let last = *runs[0].losses.last().unwrap();
    assert!(last < 0.75 * first, "loss {first} -> {last}");
    let val = runs[0].val_acc.unwrap();
    assert!(val > 0.6, "validation accuracy {val} (chance: 0.25)");
    // every rank reports the same global loss and holds the same weights
    assert_eq!(runs[0].losses, runs[1].losses);
    assert_eq!(runs[0].weights, runs[1].weights);
}

fn p3(ds: &OwnedDataset, cfg: &ModelConfig, k: usize, opts: &MiniBatchOptions) -> Vec<Run> {
    p3_for(ds, cfg, k, opts, &train_cfg())
}

fn p3_for(
    ds: &OwnedDataset,
    cfg: &ModelConfig,
    k: usize,
    opts: &MiniBatchOptions,
    tc: &TrainConfig,
) -> Vec<Run> {
    use physalia_worker::minibatch::{ColumnShard, column_slice, train_p3};
    let x = features(ds);
    let sets = sets(ds);
    let links = MemLink::mesh(k);
    std::thread::scope(|s| {
        let handles: Vec<_> = links
            .into_iter()
            .map(|mut link| {
                let (x, sets) = (&x, &sets);
                s.spawn(move || {
                    let cols = column_slice(x.cols(), k, link.rank());
                    let mut x_cols = Matrix::zeros(x.rows(), cols.len());
                    for i in 0..x.rows() {
                        x_cols.row_mut(i).copy_from_slice(&x.row(i)[cols.clone()]);
                    }
                    let shard = ColumnShard {
                        indptr: &ds.indptr,
                        indices: &ds.indices,
                        x_cols: &x_cols,
                        cols,
                        sets,
                    };
                    let mut run = Run::new();
                    let (model, summary) =
                        train_p3(&mut link, &shard, cfg, 7, tc, opts, &mut |m| {
                            run.losses.push(m.loss);
                            run.val_acc = m.val_acc.or(run.val_acc);
                            run.fetch_bytes += m.exchange.bytes_received;
                        })
                        .unwrap();
                    run.weights = model.params.into_iter().map(|p| p.value).collect();
                    run.test_at_best_val = summary.test_acc_at_best_val;
                    run
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn p3_with_any_worker_count_equals_full_graph_training() {
    let ds = sbm();
    for kind in [LayerKind::Gcn, LayerKind::Sage] {
        let cfg = model_cfg(kind);
        let want = full_graph(&ds, &cfg);
        for k in 1..=3 {
            let runs = p3(&ds, &cfg, k, &full_batch(0));
            for (rank, run) in runs.iter().enumerate() {
                assert_same(&format!("P3 {kind:?} k={k} rank {rank}"), run, &want);
            }
        }
    }
}

#[test]
fn p3_sampled_batches_agree_across_workers_and_learn() {
    let ds = sbm();
    let cfg = model_cfg(LayerKind::Gcn);
    let opts = MiniBatchOptions {
        fanouts: vec![Some(5), Some(5)],
        batch_size: 32,
        ..MiniBatchOptions::default()
    };
    let runs = p3(&ds, &cfg, 3, &opts);
    assert_eq!(runs[0].losses, runs[1].losses);
    assert_eq!(runs[0].weights, runs[2].weights);
    let (first, last) = (runs[0].losses[0], *runs[0].losses.last().unwrap());
    assert!(last < first, "loss {first} -> {last}");
    assert!(runs.iter().all(|r| r.fetch_bytes > 0));
}

/// Sampled fan-outs, several steps per epoch (the last one short, so some workers get none of its seeds),
/// dropout on.
fn sampled(batch_size: usize) -> MiniBatchOptions {
    MiniBatchOptions {
        fanouts: vec![Some(5), Some(3)],
        batch_size,
        cache_rows: 0,
        presample_batches: 2,
        loader_threads: 2,
        prefetch: 2,
    }
}

/// Per-epoch losses within 1e-4 relative, and the final weights.
fn assert_same_run(what: &str, run: &Run, want: &Run) {
    assert_eq!(run.losses.len(), want.losses.len(), "{what}: epochs");
    assert_same(what, run, &(want.losses.clone(), want.weights.clone()));
}

#[test]
fn sampled_data_parallel_learns_the_same_on_1_2_and_4_workers() {
    let ds = sbm();
    let n_train = ds.split(Split::Train).len();
    // 4 steps of 48, 48, 48 and 6 seeds
    let opts = MiniBatchOptions {
        cache_rows: 40,
        ..sampled(48)
    };
    assert!(opts.batch_size < n_train && !n_train.is_multiple_of(opts.batch_size));
    for kind in [LayerKind::Sage, LayerKind::Gcn, LayerKind::Gat] {
        let cfg = model_cfg(kind);
        let one = data_parallel(&ds, &cfg, 1, &opts);
        for k in [2, 4] {
            let runs = data_parallel(&ds, &cfg, k, &opts);
            for (rank, run) in runs.iter().enumerate() {
                assert_same_run(&format!("{kind:?} k={k} rank {rank}"), run, &one[0]);
            }
        }
    }
    // replicas of a partitioning split the global batch the same way
    let cfg = model_cfg(LayerKind::Sage);
    let one = data_parallel(&ds, &cfg, 1, &opts);
    for (rank, run) in hybrid(&ds, &cfg, 2, 2, &opts, &train_cfg())
        .iter()
        .enumerate()
    {
        assert_same_run(&format!("2 parts x 2 replicas rank {rank}"), run, &one[0]);
    }
}

#[test]
fn sampled_p3_learns_the_same_on_1_2_and_4_workers_and_as_data_parallelism() {
    let ds = sbm();
    let opts = sampled(48);
    for kind in [LayerKind::Sage, LayerKind::Gcn] {
        let cfg = model_cfg(kind);
        let one = p3(&ds, &cfg, 1, &opts);
        for k in [2, 4] {
            for (rank, run) in p3(&ds, &cfg, k, &opts).iter().enumerate() {
                assert_same_run(&format!("P3 {kind:?} k={k} rank {rank}"), run, &one[0]);
            }
        }
        // the same steps, seeds, neighbourhoods and masks as data parallelism
        let dp = data_parallel(&ds, &cfg, 2, &opts);
        assert_same_run(
            &format!("P3 vs data parallelism, {kind:?}"),
            &one[0],
            &dp[0],
        );
    }
}

/// The example job `examples/cora-sage-minibatch.yaml`: GraphSAGE, fan-outs [25, 10], batches of 64,
/// hidden 16, dropout 0.5, lr 0.01, weight decay 5e-4, 60 epochs, row-normalised features.
fn cora_sage_minibatch_mean_test_acc(ds: &OwnedDataset, workers: usize, seeds: u64) -> f64 {
    let mut cfg = ModelConfig::new(LayerKind::Sage, ds.meta.feat_dim, 16, ds.meta.num_classes);
    cfg.dropout = 0.5;
    cfg.input_dropout = 0.5;
    let opts = MiniBatchOptions {
        fanouts: vec![Some(25), Some(10)],
        batch_size: 64,
        ..MiniBatchOptions::default()
    };
    let tc = TrainConfig {
        epochs: 60,
        lr: 0.01,
        weight_decay: 5e-4,
        eval_every: 1,
        patience: None,
    };
    let accs: Vec<f64> = (0..seeds)
        .map(|seed| {
            let runs = hybrid_seeded(ds, &cfg, workers, 1, &opts, &tc, seed, true);
            runs[0].test_at_best_val.unwrap()
        })
        .collect();
    accs.iter().sum::<f64>() / accs.len() as f64
}

/// Issue 13: the example's mean test accuracy (at best validation accuracy, over seeds) on 1, 2 and 4
/// workers within 0.7 points. Before `batch_size` was global, 2 workers took half the steps: 81.5% on one
/// worker, 79.2% on two (5 seeds). The full 5-seed measurement is in `bench/RESULTS.md`; this runs 2 seeds
/// (set `PHYSALIA_CORA_SEEDS` for more).
#[test]
fn cora_sage_minibatch_accuracy_does_not_depend_on_the_worker_count() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/cora");
    if !dir.is_dir() {
        eprintln!("skipping: {} not found", dir.display());
        return;
    }
    let ds = physalia_graph::import::generic(&dir, &Default::default()).unwrap();
    let seeds = std::env::var("PHYSALIA_CORA_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let means: Vec<(usize, f64)> = [1, 2, 4]
        .into_iter()
        .map(|w| (w, cora_sage_minibatch_mean_test_acc(&ds, w, seeds)))
        .collect();
    for (w, acc) in &means {
        eprintln!("cora sage minibatch, {w} worker(s), {seeds} seeds: mean test accuracy {acc:.4}");
    }
    let lo = means.iter().map(|m| m.1).fold(f64::INFINITY, f64::min);
    let hi = means.iter().map(|m| m.1).fold(0.0, f64::max);
    assert!(
        hi - lo <= 0.007,
        "mean test accuracies {means:?} spread over {:.2} points",
        100.0 * (hi - lo)
    );
    assert!(lo > 0.75, "mean test accuracies {means:?}");
}
