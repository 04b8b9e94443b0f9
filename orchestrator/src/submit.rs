//! `physalia submit`: resolve the job, load the data, train on the local backend, record everything in a
//! job directory, print a per-epoch line and a final summary.
//!
//! Every job goes to the coordinator library's driver (`physalia_coordinator::driver::distributed`) except
//! repeated seeds (`train.runs` > 1), which train here one after another; both report through
//! `driver::summary`.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use physalia_control::JobState;
use physalia_gnn::{
    EpochMetrics, LocalExchange, LocalGraph, Matrix, Model, ModelConfig, NodeSets, TrainConfig,
    TrainSummary,
};
use physalia_graph::Split;

use physalia_coordinator::driver::resolved::ResolvedJob;
use physalia_coordinator::driver::summary::{
    RunResult, epoch_line, fmt_acc, model_config, summarize,
};
use physalia_coordinator::driver::{admission, cluster, dataset, distributed, memory, plan};

use crate::jobdir::JobDir;
use crate::output::{OutputFormat, Terminal, print_summary};
use crate::spec::{self, BackendKind, JobSpec, Mode, Parallelism};
use physalia_worker::minibatch::{ColumnShard, ShardData, train_minibatch, train_p3};

/// Continues the job in `dir` (its coordinator died, or it was stopped) from its newest checkpoint whose epochs
/// are all recorded; later records are dropped and those epochs trained again.
pub fn resume(dir: &Path, output: OutputFormat, quiet: bool, memory_check: bool) -> Result<()> {
    let spec_path = dir.join("job.json");
    let text = std::fs::read_to_string(&spec_path)
        .with_context(|| format!("{}: not a job directory", dir.display()))?;
    let spec: JobSpec = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a job record", spec_path.display()))?;
    spec.validate()
        .with_context(|| format!("{}: the recorded job", spec_path.display()))?;
    let job = ResolvedJob::new(spec)
        .with_context(|| format!("{}: the recorded job", spec_path.display()))?;
    let point = distributed::resume_point(dir)?;
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
    let obs = Terminal::new(output, quiet);
    distributed::run(&job, &name, &obs, Some(point), memory_check, None)
}

pub fn run(
    job: &Path,
    overrides: &[String],
    backend: Option<BackendKind>,
    output: OutputFormat,
    quiet: bool,
    memory_check: bool,
    detach: bool,
) -> Result<()> {
    let mut spec = spec::load_on(job, overrides, backend)?;
    let obs = Terminal::new(output, quiet);
    if let Some((planned, line)) = plan::apply_goal(&spec, &obs)? {
        if !quiet {
            eprintln!("{line}");
        }
        spec = planned;
    }
    let name = spec.job_name(job);
    let resolved = ResolvedJob::new(spec)?;
    let spec = &resolved.spec;
    // cluster mode: the coordinator runs on the platform; this process hands it the job and follows it
    if spec.backend.mode() == Mode::Cluster {
        return cluster::submit(job, resolved, &obs, detach);
    }
    if detach {
        bail!(
            "{}: --detach: in client mode (backend.mode: client, and every local or docker job) this \
             process is the job's coordinator and cannot leave it",
            job.display()
        );
    }
    // Every job is the coordinator's (its workers checkpoint every epoch, a lost one is retried, a stopped
    // job resumes) except repeated seeds (`train.runs` > 1), a statistics loop that trains in this process.
    if spec.train.runs.max(1) == 1 {
        return distributed::run(&resolved, &name, &obs, None, memory_check, None);
    }
    run_seeds(&name, &resolved, output, quiet, memory_check)
}

/// Repeated seeds (`train.runs` > 1): one after another in this process, for a mean and a deviation.
fn run_seeds(
    name: &str,
    job: &ResolvedJob,
    output: OutputFormat,
    quiet: bool,
    memory_check: bool,
) -> Result<()> {
    let spec = &job.spec;
    if let Some(t) = spec.train.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t as usize)
            .build_global()
            .context("train.threads: starting the thread pool")?;
    }
    let price = &job.priced;
    let t_load = Instant::now();
    let obs = Terminal::new(output, quiet);
    let source = dataset::load(&spec.dataset, &obs)?;
    if memory_check {
        admission::check(job, &source, memory::available_bytes())?;
    }
    // this process trains on all of it: a chunked dataset is loaded whole
    let source = source.into_whole(&obs)?;
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
    let cfg = model_config(spec, stats.feat_dim, stats.num_classes)?;
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

    let mut dir = JobDir::create(&spec.output.dir, name)?;
    dir.write_json("job.json", spec)?;
    dir.begin(spec.backend.name.as_str(), 0, spec.train.epochs as usize)?;
    let result = train_runs(
        spec,
        &cfg,
        &graph,
        structure.as_ref(),
        &x,
        &sets,
        &mut dir,
        quiet,
        price.usd_per_worker_s,
    );
    match result {
        Err(e) => {
            let msg = format!("{e:#}");
            dir.end(JobState::Failed, Some(msg))?;
            Err(e.context(format!(
                "job {} failed; its record is in {}",
                name,
                dir.path().display()
            )))
        }
        Ok(runs) => {
            let summary = summarize(
                name,
                &data_name,
                &stats,
                &cfg,
                spec,
                &runs,
                dir.path(),
                load_s,
                price,
            );
            dir.write_json("summary.json", &summary)?;
            dir.end(JobState::Succeeded, None)?;
            print_summary(&summary, output)?;
            Ok(())
        }
    }
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
    usd_per_worker_s: f64,
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
            let usd = (m.train_s + m.eval_s) * usd_per_worker_s;
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
            // the status counts epochs over all runs
            let done = run as usize * tc.epochs + m.epoch;
            if let Err(e) = dir.update(|s| {
                s.epoch = done;
                s.epochs = runs as usize * tc.epochs;
                s.workers = 1;
                s.usd += usd;
            }) {
                io_err.get_or_insert(e);
            }
        };
        let input = Input {
            cfg,
            graph,
            structure,
            x,
            sets,
        };
        let trained = train_one(spec, &input, seed, &tc, &mut on_epoch);
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

/// What one seed trains on: the model, the whole graph (and its structure for mini-batch modes), the
/// features and the node sets.
struct Input<'a> {
    cfg: &'a ModelConfig,
    graph: &'a LocalGraph,
    structure: Option<&'a (Vec<i64>, Vec<i32>)>,
    x: &'a Matrix,
    sets: &'a NodeSets,
}

/// Trains one seed in this process, in the job's mode, calling `on_epoch` after every epoch.
fn train_one(
    spec: &JobSpec,
    input: &Input,
    seed: u64,
    tc: &TrainConfig,
    on_epoch: &mut dyn FnMut(&EpochMetrics),
) -> Result<(Model, TrainSummary)> {
    let Input {
        cfg,
        graph,
        x,
        sets,
        ..
    } = *input;
    let options = spec
        .minibatch
        .clone()
        .unwrap_or_default()
        .options(spec.model.layers);
    let copy_sets = || NodeSets {
        labels: sets.labels.clone(),
        train: sets.train.clone(),
        val: sets.val.clone(),
        test: sets.test.clone(),
    };
    match (spec.mode(), input.structure) {
        (Parallelism::Data, Some((indptr, indices))) => {
            let data = ShardData::whole(cfg.kind, indptr, indices, x.clone(), copy_sets());
            let shard = data.shard(indptr, indices);
            train_minibatch(
                &mut LocalExchange,
                &shard,
                cfg,
                seed,
                tc,
                &options,
                None,
                &mut |e| {
                    on_epoch(e.metrics);
                    true
                },
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
            train_p3(&mut link, &shard, cfg, seed, tc, &options, None, &mut |e| {
                on_epoch(e.metrics);
                true
            })
            .map(|(state, summary)| (state.model, summary))
            .map_err(Into::into)
        }
        _ => {
            let mut model = Model::new(cfg, seed)?;
            physalia_gnn::train(&mut model, graph, x, sets, tc, &mut LocalExchange, on_epoch)
                .map(|s| (model, s))
                .map_err(Into::into)
        }
    }
}
