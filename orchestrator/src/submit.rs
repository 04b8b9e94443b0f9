//! `physalia submit`: resolve the job, load the data, train on the local backend, record everything in a
//! job directory, print a per-epoch line and a final summary.
//!
//! With `workers: 1` the local backend trains inside this process; with more, `distributed.rs` coordinates
//! `physalia-worker` processes and reuses this module's summary and epoch line.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use physalia_gnn::{
    Activation, EpochMetrics, LayerKind, LocalExchange, LocalGraph, Matrix, Model, ModelConfig,
    NodeSets, TrainConfig, TrainSummary,
};
use physalia_graph::Split;
use serde::Serialize;
use serde_json::json;

use crate::OutputFormat;
use crate::dataset;
use crate::jobdir::JobDir;
use crate::spec::{self, JobSpec, ModelKind, Parallelism};
use physalia_worker::minibatch::{ColumnShard, ShardData, train_minibatch, train_p3};

/// Continues the job in `dir` (its coordinator died, or it was stopped) from its newest checkpoint whose epochs
/// are all recorded; later records are dropped and those epochs trained again.
pub fn resume(dir: &Path, output: OutputFormat, quiet: bool) -> Result<()> {
    let spec_path = dir.join("job.json");
    let text = std::fs::read_to_string(&spec_path)
        .with_context(|| format!("{}: not a job directory", dir.display()))?;
    let spec: JobSpec = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a job record", spec_path.display()))?;
    spec.validate()
        .with_context(|| format!("{}: the recorded job", spec_path.display()))?;
    let point = crate::distributed::resume_point(dir)?;
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "job".into());
    if !quiet {
        eprintln!(
            "resuming {name} after epoch {} on {} workers",
            point.epoch, point.workers
        );
    }
    crate::distributed::run(&spec, &name, output, quiet, Some(point))
}

pub fn run(job: &Path, overrides: &[String], output: OutputFormat, quiet: bool) -> Result<()> {
    let mut spec = spec::load(job, overrides)?;
    if let Some((planned, line)) = crate::plan::apply_goal(&spec)? {
        if !quiet {
            eprintln!("{line}");
        }
        spec = planned;
    }
    // a scaling policy may grow a one-worker job, and containers are workers: the coordinator runs them
    if spec.workers > 1
        || spec.scaling.is_some()
        || spec.backend == crate::spec::BackendKind::Docker
    {
        return crate::distributed::run(&spec, &spec.job_name(job), output, quiet, None);
    }
    if let Some(t) = spec.train.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t as usize)
            .build_global()
            .context("train.threads: starting the thread pool")?;
    }
    let name = spec.job_name(job);
    let t_load = Instant::now();
    let source = dataset::load(&spec.dataset)?;
    let stats = source.stats();
    let data_name = source.name().to_string();
    let mut x = Matrix::from_vec(
        stats.num_nodes,
        stats.feat_dim,
        source.features_f32().into_owned(),
    );
    if spec.dataset.row_normalize {
        x.row_normalize();
    }
    let cfg = model_config(&spec, stats.feat_dim, stats.num_classes)?;
    let graph = LocalGraph::whole(cfg.kind, source.indptr(), source.indices());
    let rows = |s: Split| {
        source
            .split(s)
            .iter()
            .map(|&i| i as u32)
            .collect::<Vec<u32>>()
    };
    let sets = NodeSets {
        labels: source.labels().to_vec(),
        train: rows(Split::Train),
        val: rows(Split::Val),
        test: rows(Split::Test),
    };
    // mini-batch modes sample from the whole structure
    let structure = (spec.mode() != Parallelism::Partition)
        .then(|| (source.indptr().to_vec(), source.indices().to_vec()));
    // the engine holds its own copies now: release the mapping or the in-memory dataset
    drop(source);
    let load_s = t_load.elapsed().as_secs_f64();

    let mut dir = JobDir::create(&spec.output.dir, &name)?;
    dir.write_json("job.json", &spec)?;
    dir.write_json("status.json", &json!({ "state": "running" }))?;
    let result = train_runs(
        &spec,
        &cfg,
        &graph,
        structure.as_ref(),
        &x,
        &sets,
        &mut dir,
        quiet,
    );
    match result {
        Err(e) => {
            let msg = format!("{e:#}");
            dir.write_json("status.json", &json!({ "state": "failed", "error": msg }))?;
            Err(e.context(format!(
                "job {} failed; its record is in {}",
                name,
                dir.path().display()
            )))
        }
        Ok(runs) => {
            let summary = summarize(
                &name,
                &data_name,
                &stats,
                &cfg,
                &spec,
                &runs,
                dir.path(),
                load_s,
            );
            dir.write_json("summary.json", &summary)?;
            dir.write_json("status.json", &json!({ "state": "succeeded" }))?;
            print_summary(&summary, output)?;
            Ok(())
        }
    }
}

pub(crate) struct RunResult {
    pub seed: u64,
    pub summary: TrainSummary,
}

#[allow(clippy::too_many_arguments)]
fn train_runs(
    spec: &JobSpec,
    cfg: &ModelConfig,
    graph: &LocalGraph,
    structure: Option<&(Vec<i64>, Vec<i32>)>,
    x: &Matrix,
    sets: &NodeSets,
    dir: &mut JobDir,
    quiet: bool,
) -> Result<Vec<RunResult>> {
    let tc = TrainConfig {
        epochs: spec.train.epochs as usize,
        lr: spec.train.lr as f32,
        weight_decay: spec.train.weight_decay as f32,
        eval_every: spec.train.eval_every as usize,
        patience: spec.train.patience.map(|p| p as usize),
    };
    let runs = spec.train.runs.max(1) as u64;
    let mut out = Vec::new();
    for run in 0..runs {
        let seed = spec.train.seed + run;
        let mut io_err = None;
        let mut on_epoch = |m: &EpochMetrics| {
            if !quiet {
                eprintln!("{}", epoch_line(runs, run, tc.epochs, m));
            }
            let usd = (m.train_s + m.eval_s) * price_per_worker_s();
            let line = physalia_control::MetricsLine {
                run,
                seed,
                metrics: m.clone(),
                workers: Vec::new(),
                usd,
            };
            if let Err(e) = dir.append_metrics(&line) {
                io_err.get_or_insert(e);
            }
        };
        let options = spec.minibatch.clone().unwrap_or_default().options();
        let copy_sets = || NodeSets {
            labels: sets.labels.clone(),
            train: sets.train.clone(),
            val: sets.val.clone(),
            test: sets.test.clone(),
        };
        let trained: Result<(Model, TrainSummary)> = match (spec.mode(), structure) {
            (Parallelism::Data, Some((indptr, indices))) => {
                let data = ShardData::whole(cfg.kind, indptr, indices, x.clone(), copy_sets());
                let shard = data.shard(indptr, indices);
                train_minibatch(
                    &mut LocalExchange,
                    &shard,
                    cfg,
                    seed,
                    &tc,
                    &options,
                    &mut on_epoch,
                )
                .map_err(Into::into)
            }
            (Parallelism::Model, Some((indptr, indices))) => {
                let sets = copy_sets();
                let shard = ColumnShard {
                    indptr,
                    indices,
                    x_cols: x,
                    cols: 0..x.cols(),
                    sets: &sets,
                };
                let mut link = physalia_wire::MemLink::mesh(1).pop().expect("one rank");
                train_p3(&mut link, &shard, cfg, seed, &tc, &options, &mut on_epoch)
                    .map_err(Into::into)
            }
            _ => {
                let mut model = Model::new(cfg, seed)?;
                physalia_gnn::train(
                    &mut model,
                    graph,
                    x,
                    sets,
                    &tc,
                    &mut LocalExchange,
                    &mut on_epoch,
                )
                .map(|s| (model, s))
                .map_err(Into::into)
            }
        };
        let (model, summary) =
            trained.with_context(|| format!("training run {run} (seed {seed})"))?;
        if let Some(e) = io_err {
            return Err(e);
        }
        let file = if runs == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-run{run}.safetensors")
        };
        physalia_gnn::save::save_model(
            &model,
            &dir.path().join(&file),
            &[("seed", seed.to_string())],
        )?;
        if runs > 1 && !quiet {
            eprintln!(
                "run {run}: test accuracy at best val {} (epoch {})",
                fmt_acc(summary.test_acc_at_best_val),
                summary
                    .best_epoch
                    .map(|e| e.to_string())
                    .unwrap_or("-".into())
            );
        }
        out.push(RunResult { seed, summary });
    }
    Ok(out)
}

pub(crate) fn epoch_line(runs: u64, run: u64, epochs: usize, m: &EpochMetrics) -> String {
    let prefix = if runs > 1 {
        format!("run {run} ")
    } else {
        String::new()
    };
    let w = epochs.to_string().len();
    let mut line = format!(
        "{prefix}epoch {:>w$}/{epochs}  loss {:.4}  train {}  val {}  test {}  {:.3}s",
        m.epoch,
        m.loss,
        fmt_acc(m.train_acc),
        fmt_acc(m.val_acc),
        fmt_acc(m.test_acc),
        m.train_s
    );
    if let Some(b) = &m.batches {
        line.push_str(&format!(
            "  steps {}  sample wait {:.3}s  fetch {:.3}s",
            b.steps, b.sample_wait_s, b.fetch_s
        ));
        if let Some(h) = b.hit_rate() {
            line.push_str(&format!("  cache hit {:.1}%", 100.0 * h));
        }
    }
    line
}

fn fmt_acc(a: Option<f64>) -> String {
    a.map(|a| format!("{:.4}", a))
        .unwrap_or_else(|| "  -   ".into())
}

pub fn model_config(spec: &JobSpec, in_dim: usize, classes: usize) -> Result<ModelConfig> {
    let m = &spec.model;
    if classes < 2 {
        bail!("the dataset has {classes} class(es); node classification needs at least 2");
    }
    let kind = match m.kind {
        ModelKind::Gcn => LayerKind::Gcn,
        ModelKind::Sage => LayerKind::Sage,
        ModelKind::Gat => LayerKind::Gat,
    };
    Ok(ModelConfig {
        kind,
        in_dim,
        hidden: m.hidden as usize,
        out_dim: classes,
        layers: m.layers as usize,
        heads: m.heads() as usize,
        out_heads: m.out_heads() as usize,
        dropout: m.dropout as f32,
        input_dropout: m.input_dropout() as f32,
        attn_dropout: if kind == LayerKind::Gat {
            m.attn_dropout() as f32
        } else {
            0.0
        },
        activation: match m.activation {
            spec::Activation::Relu => Activation::Relu,
            spec::Activation::Elu => Activation::Elu,
        },
        negative_slope: m.negative_slope() as f32,
    })
}

#[derive(Serialize)]
pub(crate) struct Summary {
    job: String,
    job_dir: String,
    dataset: String,
    nodes: usize,
    edges: usize,
    model: ModelConfig,
    parameters: usize,
    epochs: u32,
    runs: Vec<RunSummary>,
    /// Over runs: mean and population standard deviation of the test accuracy at the best validation epoch.
    mean_test_acc_at_best_val: Option<f64>,
    std_test_acc_at_best_val: Option<f64>,
    mean_final_test_acc: Option<f64>,
    /// Median over all epochs of all runs of the training time per epoch (forward, backward, step).
    median_epoch_s: f64,
    /// Training time per epoch of the first run.
    epoch_times_s: Vec<f64>,
    load_s: f64,
    peak_rss_bytes: Option<u64>,
    /// Every worker's seconds times its container's price, over all runs.
    usd_total: f64,
}

/// USD per worker-second on the local backend, from the planner's built-in catalog (free today).
pub(crate) fn price_per_worker_s() -> f64 {
    physalia_planner::Catalog::builtin()
        .get("local")
        .map(|s| s.usd_per_s())
        .unwrap_or(0.0)
}

#[derive(Serialize)]
struct RunSummary {
    seed: u64,
    final_epoch: usize,
    final_loss: f64,
    final_train_acc: Option<f64>,
    final_val_acc: Option<f64>,
    final_test_acc: Option<f64>,
    best_epoch: Option<usize>,
    best_val_acc: Option<f64>,
    test_acc_at_best_val: Option<f64>,
    stopped_early: bool,
    median_epoch_s: f64,
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn summarize(
    name: &str,
    data_name: &str,
    stats: &physalia_graph::GraphStats,
    cfg: &ModelConfig,
    spec: &JobSpec,
    runs: &[RunResult],
    dir: &Path,
    load_s: f64,
) -> Summary {
    let run_summaries: Vec<RunSummary> = runs
        .iter()
        .map(|r| {
            let last = r
                .summary
                .epochs
                .last()
                .expect("a run trains at least one epoch");
            RunSummary {
                seed: r.seed,
                final_epoch: last.epoch,
                final_loss: last.loss,
                final_train_acc: last.train_acc,
                final_val_acc: last.val_acc,
                final_test_acc: last.test_acc,
                best_epoch: r.summary.best_epoch,
                best_val_acc: r.summary.best_val_acc,
                test_acc_at_best_val: r.summary.test_acc_at_best_val,
                stopped_early: r.summary.stopped_early,
                median_epoch_s: median(r.summary.epochs.iter().map(|e| e.train_s).collect()),
            }
        })
        .collect();
    let (mean, std) = mean_std(
        run_summaries
            .iter()
            .filter_map(|r| r.test_acc_at_best_val)
            .collect(),
    );
    let (mean_final, _) = mean_std(
        run_summaries
            .iter()
            .filter_map(|r| r.final_test_acc)
            .collect(),
    );
    let all_times: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.summary.epochs.iter().map(|e| e.train_s))
        .collect();
    Summary {
        job: name.to_string(),
        job_dir: dir.display().to_string(),
        dataset: data_name.to_string(),
        nodes: stats.num_nodes,
        edges: stats.num_edges,
        model: cfg.clone(),
        parameters: Model::new(cfg, 0).map(|m| m.num_parameters()).unwrap_or(0),
        epochs: spec.train.epochs,
        runs: run_summaries,
        mean_test_acc_at_best_val: mean,
        std_test_acc_at_best_val: std,
        mean_final_test_acc: mean_final,
        median_epoch_s: median(all_times),
        epoch_times_s: runs[0].summary.epochs.iter().map(|e| e.train_s).collect(),
        load_s,
        peak_rss_bytes: peak_rss_bytes(),
        usd_total: runs
            .iter()
            .flat_map(|r| &r.summary.epochs)
            .map(|e| e.train_s + e.eval_s)
            .sum::<f64>()
            * price_per_worker_s(),
    }
}

fn print_summary(s: &Summary, output: OutputFormat) -> Result<()> {
    match output {
        OutputFormat::Json => println!("{}", serde_json::to_string(s)?),
        OutputFormat::Text => {
            println!("job {} finished: {}", s.job, s.job_dir);
            if s.runs.len() > 1 {
                println!(
                    "test accuracy at best val over {} runs: {} +- {}",
                    s.runs.len(),
                    fmt_acc(s.mean_test_acc_at_best_val),
                    fmt_acc(s.std_test_acc_at_best_val)
                );
            } else if let Some(r) = s.runs.first() {
                println!(
                    "final: loss {:.4} train {} val {} test {}; best val {} at epoch {}, test there {}",
                    r.final_loss,
                    fmt_acc(r.final_train_acc),
                    fmt_acc(r.final_val_acc),
                    fmt_acc(r.final_test_acc),
                    fmt_acc(r.best_val_acc),
                    r.best_epoch.map(|e| e.to_string()).unwrap_or("-".into()),
                    fmt_acc(r.test_acc_at_best_val)
                );
            }
            println!(
                "median epoch {:.4}s, peak memory {}",
                s.median_epoch_s,
                s.peak_rss_bytes
                    .map(|b| format!("{:.1} MiB", b as f64 / (1 << 20) as f64))
                    .unwrap_or("unknown".into())
            );
        }
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn mean_std(v: Vec<f64>) -> (Option<f64>, Option<f64>) {
    if v.is_empty() {
        return (None, None);
    }
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / n;
    (Some(mean), Some(var.sqrt()))
}

/// Peak resident set size of this process (Linux `VmHWM`).
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
