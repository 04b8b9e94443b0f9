//! `physalia submit` with `workers` above 1: the IO shell around the [`Coordinator`] state machine.
//!
//! Design (local backend): this process is the coordinator. It partitions the dataset
//! (`ensure_partitions`; a raw folder or a generated graph is first written into the job directory as
//! `dataset.safetensors`), creates the job CA and one identity per worker, binds its control endpoint on
//! `127.0.0.1:0` ([`ControlServer`]: QUIC, mutual TLS against the job CA, a certificate named
//! `coordinator`) and starts N `physalia-worker` processes through the local backend, which writes each
//! identity under `secrets/` ([`crate::workers`]). The coordinator is not a rank of the mesh: the workers'
//! collectives run over exactly the N workers, so a separate star of control connections is the simplest
//! design that keeps the mesh untouched.
//!
//! Protocol: a worker binds its mesh endpoint (`127.0.0.1:0`), connects to the coordinator and sends
//! `Register {rank, pid, mesh_addr}`; once all N have registered the coordinator sends each an
//! `Assign {peers, part file, model, train config, seed, exchange options, row_normalize}`; workers join the
//! mesh, train, and send `Epoch {rank, metrics}` per epoch and `Done {rank, summary}` (rank 0 writes the
//! model first) or `Failed {rank, error}`. On failure the coordinator sends `Stop` to everyone, SIGKILLs
//! and reaps every worker, and reports one error naming the worker that failed first.
//!
//! Timeouts: `timeouts.register_s` (default 30 s) for all workers to register, `timeouts.epoch_s` (default
//! 60 s) of silence from any worker during training (also the workers' bound on every wait for a peer),
//! 10 s for workers to exit after finishing. Nothing waits without a bound.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use physalia_gnn::{EpochMetrics, ModelConfig, TrainConfig, TrainSummary};
use physalia_wire::{Dtype, JobCa};
use physalia_worker::ExchangeOptions;
use physalia_worker::control::{
    Assignment, COORDINATOR_NAME, ControlServer, Outbox, ServerEvent, ToCoordinator, ToWorker,
    TrainMode,
};
use serde_json::{Value, json};

use crate::OutputFormat;
use crate::coordinator::{Action, Coordinator, Event};
use crate::dataset::{self, Source};
use crate::elastic::{Elastic, Next, Stop, epoch_usd};
use crate::jobdir::JobDir;
use crate::spec::{BackendKind, ExchangeDtype, JobSpec, Parallelism, ParallelismSpec};
use crate::submit::{self, RunResult};
use crate::workers::{BackendWorkers, identities, local_launch, worker_binary};

/// Where a stopped job continues: the newest checkpoint whose epochs are all recorded in `metrics.jsonl`.
pub struct ResumePoint {
    pub dir: PathBuf,
    pub epoch: usize,
    pub checkpoint: PathBuf,
    pub workers: usize,
    /// `metrics.jsonl`'s lines of epochs `1..=epoch`.
    pub lines: Vec<Value>,
}

/// Finds where the job in `dir` can continue.
pub fn resume_point(dir: &Path) -> Result<ResumePoint> {
    let metrics = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics)
        .with_context(|| format!("{}: not a job directory", dir.display()))?;
    let mut lines = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a JSON metrics line", metrics.display(), i + 1))?;
        if v["metrics"]["epoch"].as_u64() != Some(lines.len() as u64 + 1) {
            bail!(
                "{}:{}: expected epoch {}; the record is not one run's consecutive epochs",
                metrics.display(),
                i + 1,
                lines.len() + 1
            );
        }
        lines.push(v);
    }
    let ck_dir = checkpoints_dir(&std::path::absolute(dir)?);
    let newest = std::fs::read_dir(&ck_dir)
        .ok()
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            name.strip_prefix("epoch-")?
                .strip_suffix(".safetensors")?
                .parse::<usize>()
                .ok()
        })
        .filter(|&e| e >= 1 && e <= lines.len())
        .max();
    let Some(epoch) = newest else {
        bail!(
            "{}: no checkpoint to resume from (partition-parallel jobs run by the coordinator, with several \
             workers or a scaling policy, write checkpoints/ after every epoch; single-worker jobs without a \
             policy and data or model parallelism keep none)",
            dir.display()
        );
    };
    lines.truncate(epoch);
    let workers = lines[epoch - 1]["workers"].as_array().map_or(1, Vec::len);
    Ok(ResumePoint {
        dir: dir.to_path_buf(),
        epoch,
        checkpoint: physalia_worker::control::checkpoint_path(&ck_dir, epoch),
        workers,
        lines,
    })
}

fn checkpoints_dir(job: &Path) -> PathBuf {
    job.join("checkpoints")
}

pub fn run(
    spec: &JobSpec,
    name: &str,
    output: OutputFormat,
    quiet: bool,
    resume: Option<ResumePoint>,
) -> Result<()> {
    let n = spec.workers as usize;
    // replica groups train on a partitioning into fewer parts than workers: rank = replica * k + part
    let k = spec.parts() as usize;
    let binary = worker_binary()?;
    let t_load = Instant::now();
    let source = dataset::load(&spec.dataset)?;
    let stats = source.stats();
    let data_name = source.name().to_string();
    let cfg = submit::model_config(spec, stats.feat_dim, stats.num_classes)?;
    if n > stats.num_nodes {
        bail!(
            "workers: {n} workers for a graph of {} nodes",
            stats.num_nodes
        );
    }
    let mut dir = match &resume {
        Some(rp) => JobDir::reopen(&rp.dir, rp.epoch)?,
        None => {
            let dir = JobDir::create(&spec.output.dir, name)?;
            dir.write_json("job.json", spec)?;
            dir
        }
    };
    dir.write_json("status.json", &json!({ "state": "running" }))?;
    let result = (|| -> Result<Value> {
        let dataset_path = match &source {
            Source::File(_) => spec
                .dataset
                .path
                .clone()
                .expect("a file source comes from dataset.path"),
            Source::Memory(ds) => {
                let path = dir.path().join("dataset.safetensors");
                ds.write(&path)
                    .with_context(|| format!("writing {}", path.display()))?;
                path
            }
        };
        drop(source);
        let load_s = t_load.elapsed().as_secs_f64();
        let dataset_path = std::path::absolute(&dataset_path)?;
        let job_abs = std::path::absolute(dir.path())?;
        // a resumed job merges its epochs like an elastic one (without a policy: one that never fires)
        let policy = match (&spec.scaling, &resume) {
            (Some(p), _) => Some(p.clone()),
            (None, Some(_)) => Some(serde_json::from_value(json!({
                "max_workers": n.max(1),
                "rules": [],
            }))?),
            (None, None) => None,
        };
        let mut elastic = policy.map(|policy| {
            let x = spec.exchange.clone().unwrap_or_default();
            Elastic::new(
                policy,
                spec.workers,
                spec.train.epochs,
                submit::price_per_worker_s(),
            )
            .with_exchange(x.boundary_sampling, x.staleness)
        });
        let mut workers_now = n;
        let mut resume_from: Option<PathBuf> = None;
        // the policy's decision after the last recorded epoch: the coordinator may have died before it
        // acted on it, so it is made again and acted on first
        let mut pending: Option<(usize, Stop)> = None;
        if let (Some(rp), Some(el)) = (&resume, elastic.as_mut()) {
            pending = el
                .replay(&rp.lines, spec.train.epochs as usize)?
                .map(|why| (rp.epoch, why));
            workers_now = rp.workers;
            resume_from = Some(rp.checkpoint.clone());
            let line = el.event(
                rp.epoch,
                format!(
                    "resumed from {} on {workers_now} workers",
                    rp.checkpoint.display()
                ),
                None,
            );
            if !quiet {
                eprintln!("{line}");
            }
        }
        // a resumed job's launches continue the numbering of the ones before (their logs stay)
        let mut segment = std::fs::read_dir(dir.path().join("logs"))
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter(|e| e.file_name().to_string_lossy().starts_with("worker-0."))
                    .count()
            })
            .unwrap_or(0);
        let mut prewarmed: Option<Launch> = None;
        let runs = loop {
            if let (Some((after_epoch, why)), Some(el)) = (pending.take(), elastic.as_mut()) {
                let (next, line) = el.after_stop(workers_now, after_epoch, why);
                if let (Some(line), false) = (line, quiet) {
                    eprintln!("{line}");
                }
                match next {
                    Next::Relaunch { workers, .. } => workers_now = workers,
                    Next::Finish => break finish_early(el, spec.train.seed),
                    Next::Fail(error) => bail!(error),
                }
            }
            // replica groups keep their k; otherwise the partitioning follows the worker count
            let k = if matches!(spec.parallelism, ParallelismSpec::Groups(_)) {
                k
            } else {
                workers_now
            };
            let sets =
                physalia_graph::partition::ensure_partitions(&dataset_path, &[k], spec.train.seed)
                    .with_context(|| {
                        format!("partitioning {} into {k} parts", dataset_path.display())
                    })?;
            let parts = sets.into_iter().next().expect("one set per k").part_files;
            let end = coordinate(
                spec,
                name,
                &cfg,
                &parts,
                workers_now,
                &dataset_path,
                &binary,
                &mut dir,
                quiet,
                Segment {
                    index: segment,
                    resume_from: resume_from.as_deref(),
                    elastic: elastic.as_mut(),
                    prewarmed: prewarmed.take(),
                },
            )?;
            segment += 1;
            let Some(el) = elastic.as_mut() else {
                match end {
                    SegmentEnd::Finished(c) => break c,
                    SegmentEnd::Stopped { .. } => {
                        unreachable!("only elastic jobs stop between epochs")
                    }
                }
            };
            match end {
                SegmentEnd::Finished(c) => break finish(el, c),
                SegmentEnd::Stopped {
                    after_epoch,
                    why,
                    prewarmed: warm,
                } => {
                    prewarmed = warm.map(|w| *w);
                    let (next, line) = el.after_stop(workers_now, after_epoch, why);
                    if let (Some(line), false) = (line, quiet) {
                        eprintln!("{line}");
                    }
                    match next {
                        Next::Relaunch {
                            workers,
                            resume_epoch,
                        } => {
                            workers_now = workers;
                            resume_from = (resume_epoch > 0).then(|| {
                                physalia_worker::control::checkpoint_path(
                                    &checkpoints_dir(&job_abs),
                                    resume_epoch,
                                )
                            });
                        }
                        Next::Finish => break finish_early(el, spec.train.seed),
                        Next::Fail(error) => bail!(error),
                    }
                }
            }
        };
        let workers_rss = runs.worker_peak_rss.clone();
        let bytes = runs.bytes_exchanged;
        let usd_total = runs.usd;
        let scaling_events = elastic.as_ref().map(|e| e.events.clone());
        let summary = submit::summarize(
            name,
            &data_name,
            &stats,
            &cfg,
            spec,
            &[runs.run],
            dir.path(),
            load_s,
        );
        let mut v = serde_json::to_value(&summary)?;
        v["workers"] = json!(n);
        v["bytes_exchanged"] = json!(bytes);
        v["worker_peak_rss_bytes"] = json!(workers_rss);
        v["usd_total"] = json!(usd_total);
        if let Some(events) = scaling_events {
            v["scaling_events"] = json!(events);
        }
        Ok(v)
    })();
    if spec.backend == BackendKind::Docker {
        // every launch's containers are gone by now; the network goes with the job
        let job_id = dir
            .path()
            .file_name()
            .map(|s| s.to_string_lossy().into_owned());
        crate::docker::Network::remove_for(&job_id.unwrap_or_default());
    }
    match result {
        Err(e) => {
            let msg = format!("{e:#}");
            dir.write_json("status.json", &json!({ "state": "failed", "error": msg }))?;
            Err(e.context(format!(
                "job {name} failed; its record is in {}",
                dir.path().display()
            )))
        }
        Ok(v) => {
            dir.write_json("summary.json", &v)?;
            dir.write_json("status.json", &json!({ "state": "succeeded" }))?;
            match output {
                OutputFormat::Json => println!("{}", serde_json::to_string(&v)?),
                OutputFormat::Text => {
                    println!(
                        "job {name} finished on {n} workers: {}",
                        dir.path().display()
                    );
                    println!(
                        "final loss {:.4}, test at best val {}, median epoch {:.4}s, {} exchanged",
                        v["runs"][0]["final_loss"].as_f64().unwrap_or(f64::NAN),
                        v["runs"][0]["test_acc_at_best_val"]
                            .as_f64()
                            .map(|a| format!("{a:.4}"))
                            .unwrap_or("-".into()),
                        v["median_epoch_s"].as_f64().unwrap_or(0.0),
                        fmt_bytes(v["bytes_exchanged"].as_u64().unwrap_or(0))
                    );
                }
            }
            Ok(())
        }
    }
}

struct Coordinated {
    run: RunResult,
    worker_peak_rss: Vec<Option<u64>>,
    bytes_exchanged: u64,
    /// Every worker's seconds times its container's price (the catalog's; `local` is free).
    usd: f64,
}

/// One launch of the worker set: from scratch or from a checkpoint, until the job ends or it must stop.
struct Segment<'a> {
    index: usize,
    resume_from: Option<&'a Path>,
    elastic: Option<&'a mut Elastic>,
    /// Workers started ahead of this launch (a policy's `prewarm`), used when their count is right.
    prewarmed: Option<Launch>,
}

/// Started worker processes with their job CA and control endpoint, registering or registered.
struct Launch {
    index: usize,
    n: usize,
    server: ControlServer,
    /// Local processes or containers, through the backend's trait either way.
    workers: BackendWorkers,
    started: Instant,
}

impl Launch {
    /// Issues a CA and identities for `n` workers, binds a control endpoint and starts the workers on the
    /// job's backend from one `WorkerSpec`.
    #[allow(clippy::too_many_arguments)]
    fn start(
        spec: &JobSpec,
        name: &str,
        dir: &Path,
        n: usize,
        index: usize,
        binary: &Path,
        register_timeout: Duration,
        dataset_dir: Option<&Path>,
    ) -> Result<Launch> {
        let dir = &std::path::absolute(dir)?;
        // The job id names the CA and keys frames: the job directory's name is unique per submission.
        let job_id = dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| name.into());
        let ca = JobCa::new(&job_id).context("creating the job certificate authority")?;
        // every launch has its own CA and keys, handed to the backend as the spec's secrets
        let secrets = identities(&ca, n)?;
        // containers reach this machine at their network's gateway; local processes over loopback
        let network = match spec.backend {
            BackendKind::Docker => Some(crate::docker::Network::create(&job_id)?),
            _ => None,
        };
        let bind: SocketAddr = match &network {
            Some(net) => SocketAddr::new(net.gateway, 0),
            None => "127.0.0.1:0".parse()?,
        };
        let server = ControlServer::bind(
            &ca.identity(COORDINATOR_NAME)?,
            ca.job_key(),
            n,
            bind,
            register_timeout,
        )
        .context("binding the coordinator's control endpoint")?;
        let cores = std::thread::available_parallelism()
            .map(|c| c.get())
            .unwrap_or(1);
        let threads = spec
            .train
            .threads
            .map(|t| t as usize)
            .unwrap_or((cores / n).max(1));
        let (backend, worker_spec, logs, poll_every) = match &network {
            None => {
                let (backend, worker_spec) = local_launch(
                    binary,
                    &job_id,
                    index,
                    server.local_addr(),
                    threads,
                    secrets,
                    dir,
                );
                // the backend writes each rank's output into logs/ itself, and asking it is cheap
                (backend, worker_spec, None, Duration::ZERO)
            }
            Some(net) => {
                let image = crate::docker::ensure_image(binary, false)?;
                let uid = crate::docker::worker_uid();
                let checkpoints = checkpoints_dir(dir);
                std::fs::create_dir_all(&checkpoints)?;
                crate::docker::hand_over(&[dir, &checkpoints], uid)?;
                let data = dataset_dir
                    .ok_or_else(|| anyhow!("the docker backend needs the dataset's folder"))?;
                let logs_dir = dir.join("logs");
                std::fs::create_dir_all(&logs_dir)?;
                let (backend, worker_spec) = crate::docker::docker_launch(
                    &image,
                    &job_id,
                    index,
                    net,
                    server.local_addr(),
                    secrets,
                    threads,
                    // the job directory, and the dataset's folder unless it is inside it (a generated or
                    // imported dataset is written there)
                    if data.starts_with(dir) {
                        vec![(dir.to_path_buf(), true)]
                    } else {
                        vec![(data.to_path_buf(), false), (dir.to_path_buf(), true)]
                    },
                    uid,
                )?;
                let logs = (0..n)
                    .map(|rank| physalia_backends::local::log_path(&logs_dir, index as u32, rank))
                    .collect();
                (backend, worker_spec, Some(logs), Duration::from_millis(500))
            }
        };
        let workers = BackendWorkers::launch(backend, &worker_spec, n, logs, poll_every)?;
        Ok(Launch {
            index,
            n,
            server,
            workers,
            started: Instant::now(),
        })
    }
}

enum SegmentEnd {
    Finished(Coordinated),
    /// Every worker was stopped after epoch `after_epoch` (all of its reports in, its checkpoint written).
    /// `prewarmed`: workers started for the next launch during this one.
    Stopped {
        after_epoch: usize,
        why: Stop,
        prewarmed: Option<Box<Launch>>,
    },
}

/// The result of an elastic job from every launch's epochs.
fn finish(el: &Elastic, c: Coordinated) -> Coordinated {
    Coordinated {
        run: el.summary(c.run.seed, c.run.summary.stopped_early),
        worker_peak_rss: c.worker_peak_rss,
        bytes_exchanged: el.bytes,
        usd: el.usd,
    }
}

/// The result of an elastic job its policy stopped.
fn finish_early(el: &Elastic, seed: u64) -> Coordinated {
    Coordinated {
        run: el.summary(seed, true),
        worker_peak_rss: vec![],
        bytes_exchanged: el.bytes,
        usd: el.usd,
    }
}

fn exchange_options(spec: &JobSpec) -> ExchangeOptions {
    let x = spec.exchange.clone().unwrap_or_default();
    ExchangeOptions {
        boundary_sampling: x.boundary_sampling as f32,
        boundary_rescale: x.boundary_rescale,
        staleness_epochs: x.staleness,
        staleness_threshold: x.staleness_threshold.map(|t| t as f32),
        dtype: match x.dtype {
            ExchangeDtype::F32 => Dtype::F32,
            ExchangeDtype::F16 => Dtype::F16,
            ExchangeDtype::Bf16 => Dtype::BF16,
        },
        seed: spec.train.seed,
    }
}

/// Appends to `logs/coordinator.log` (refusals, spawns, failures); never to the terminal.
struct CoordLog(Option<std::fs::File>);

impl CoordLog {
    fn line(&mut self, s: &str) {
        use std::io::Write;
        if let Some(f) = &mut self.0 {
            let _ = writeln!(f, "{s}");
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn coordinate(
    spec: &JobSpec,
    name: &str,
    cfg: &ModelConfig,
    parts: &[PathBuf],
    workers: usize,
    dataset_path: &Path,
    binary: &Path,
    dir: &mut JobDir,
    quiet: bool,
    mut seg: Segment<'_>,
) -> Result<SegmentEnd> {
    let n = workers;
    // workers (containers especially) get absolute paths: their working folder is not ours
    let job_abs = std::path::absolute(dir.path())?;
    let timeouts = spec.timeouts.clone().unwrap_or_default();
    let (register_timeout, epoch_timeout) = (
        Duration::from_secs_f64(timeouts.register_s),
        Duration::from_secs_f64(timeouts.epoch_s),
    );
    let logs = dir.path().join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let mut log = CoordLog(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(logs.join("coordinator.log"))
            .ok(),
    );
    if seg.index > 0 {
        log.line(&format!(
            "segment {}: {n} workers, resuming from {}",
            seg.index,
            seg.resume_from
                .map(|p| p.display().to_string())
                .unwrap_or("scratch".into())
        ));
    }
    let launched = match seg.prewarmed.take() {
        Some(l) if l.n == n && l.index == seg.index => {
            log.line(&format!(
                "using the {n} workers prewarmed {:.2} s ago",
                l.started.elapsed().as_secs_f64()
            ));
            l
        }
        other => {
            if let Some(l) = other {
                log.line(&format!(
                    "discarding {} prewarmed workers: {n} are needed",
                    l.n
                ));
            }
            Launch::start(
                spec,
                name,
                dir.path(),
                n,
                seg.index,
                binary,
                register_timeout,
                dataset_path.parent(),
            )?
        }
    };
    let Launch {
        server,
        mut workers,
        ..
    } = launched;
    let mut coord = Coordinator::new(n, register_timeout, epoch_timeout, Instant::now());
    for (rank, pid) in workers.pids().into_iter().enumerate() {
        if let Some(pid) = pid {
            coord.set_pid(rank, pid);
            log.line(&format!("started worker {rank} pid {pid}"));
        }
    }
    log.line(&format!("control endpoint {}", server.local_addr()));

    let tc = TrainConfig {
        epochs: spec.train.epochs as usize,
        lr: spec.train.lr as f32,
        weight_decay: spec.train.weight_decay as f32,
        eval_every: spec.train.eval_every as usize,
        patience: spec.train.patience.map(|p| p as usize),
    };
    let seed = spec.train.seed;
    let mut outboxes: Vec<Option<Outbox>> = vec![None; n];
    let mut bytes_exchanged = 0u64;
    let mut usd = 0f64;
    let mut io_err = None;
    let start_epoch = match seg.resume_from {
        Some(path) => {
            physalia_gnn::save::load_checkpoint(path)
                .with_context(|| format!("reading the checkpoint {}", path.display()))?
                .2
                .epoch
        }
        None => 0,
    };
    let mut last_complete = start_epoch;
    let mut stop_now: Option<Stop> = None;
    let mut prewarmed: Option<Launch> = None;
    // partition-parallel jobs checkpoint every epoch: rescales, retries and `submit --resume` start there
    let checkpoint_dir = if spec.mode() == Parallelism::Partition {
        let d = checkpoints_dir(&job_abs);
        std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        Some(d)
    } else {
        None
    };
    let outcome: std::result::Result<(Vec<TrainSummary>, Vec<Option<u64>>), String> = loop {
        // exits first, messages second: a worker sends its last message before it exits, so whatever it
        // said is in by the time its exit is handled
        let exits = workers.poll_exits();
        let mut events = Vec::new();
        if let Some(ev) = server.next_event(Duration::from_millis(if exits.is_empty() {
            100
        } else {
            0
        })) {
            events.push(ev);
            while let Some(ev) = server.next_event(Duration::ZERO) {
                events.push(ev);
            }
        }
        let mut fed: Vec<Event> = Vec::new();
        for ev in events {
            match ev {
                ServerEvent::Registered {
                    rank,
                    pid,
                    mesh_addr,
                    outbox,
                } => {
                    log.line(&format!(
                        "worker {rank} (pid {pid}) registered, mesh {mesh_addr}"
                    ));
                    outboxes[rank] = Some(outbox);
                    fed.push(Event::Registered {
                        rank,
                        pid,
                        mesh_addr,
                    });
                }
                ServerEvent::Message { msg, .. } => fed.push(match msg {
                    ToCoordinator::Register { rank, .. } => Event::Failed {
                        rank,
                        error: "registered twice".into(),
                    },
                    ToCoordinator::Epoch { rank, metrics } => Event::Epoch { rank, metrics },
                    ToCoordinator::Done {
                        rank,
                        summary,
                        peak_rss_bytes,
                    } => Event::Done {
                        rank,
                        summary,
                        peak_rss_bytes,
                    },
                    ToCoordinator::Failed { rank, error } => Event::Failed { rank, error },
                }),
                ServerEvent::Lost { rank, reason } => fed.push(Event::Lost { rank, reason }),
                ServerEvent::Refused { addr, reason } => {
                    log.line(&format!("refused a connection from {addr}: {reason}"));
                }
            }
        }
        for (rank, how, by_signal) in exits {
            log.line(&format!("worker {rank} {how}"));
            fed.push(Event::Exited {
                rank,
                how,
                by_signal,
            });
        }
        fed.push(Event::Tick);
        let mut done = None;
        for ev in fed {
            for action in coord.handle(ev, Instant::now()) {
                match action {
                    Action::Assign { peers } => {
                        for (rank, outbox) in outboxes.iter().enumerate() {
                            let a = Assignment {
                                peers: peers.clone(),
                                part_path: std::path::absolute(&parts[rank % parts.len()])?,
                                model: cfg.clone(),
                                train: tc.clone(),
                                seed,
                                exchange: {
                                    let mut x = exchange_options(spec);
                                    if let Some(el) = seg.elastic.as_deref() {
                                        let (p, staleness) = el.exchange();
                                        x.boundary_sampling = p as f32;
                                        x.staleness_epochs = staleness;
                                    }
                                    x
                                },
                                row_normalize: spec.dataset.row_normalize,
                                model_out: (rank == 0).then(|| job_abs.join("model.safetensors")),
                                epoch_timeout_s: epoch_timeout.as_secs_f64(),
                                mode: match spec.mode() {
                                    Parallelism::Partition => TrainMode::Partition,
                                    Parallelism::Data => TrainMode::Data,
                                    Parallelism::Model => TrainMode::Model,
                                },
                                minibatch: spec
                                    .minibatch
                                    .clone()
                                    .unwrap_or_default()
                                    .options()
                                    .into(),
                                dataset_path: Some(dataset_path.to_path_buf()),
                                resume_from: seg.resume_from.map(Path::to_path_buf),
                                checkpoint_dir: checkpoint_dir.clone(),
                            };
                            if let Some(o) = outbox {
                                o.send(ToWorker::Assign(Box::new(a)));
                            }
                        }
                        log.line("all workers registered; assignments sent");
                    }
                    Action::EpochComplete { epoch, by_rank } => {
                        last_complete = last_complete.max(epoch);
                        bytes_exchanged +=
                            by_rank.iter().map(|m| m.exchange.bytes_sent).sum::<u64>();
                        if !quiet {
                            eprintln!("{}", epoch_line(tc.epochs, &by_rank));
                        }
                        let workers: Vec<Value> = by_rank
                            .iter()
                            .enumerate()
                            .map(|(r, m)| json!({ "rank": r, "train_s": m.train_s, "exchange": m.exchange }))
                            .collect();
                        let cost = epoch_usd(&by_rank, submit::price_per_worker_s());
                        usd += cost;
                        let line = json!({ "run": 0, "seed": seed, "metrics": by_rank[0], "workers": workers, "usd": cost });
                        if let Err(e) = dir.append_metrics(&line) {
                            io_err.get_or_insert(e);
                        }
                        if let Some(el) = seg.elastic.as_deref_mut()
                            && stop_now.is_none()
                        {
                            stop_now = el.after_epoch(&by_rank, tc.epochs);
                            // the policy expects to grow soon: start the next launch's workers now, so
                            // their cold start overlaps this launch's epochs
                            if let (None, None, Some(m)) =
                                (&stop_now, &prewarmed, el.prewarm_target())
                            {
                                log.line(&format!("prewarming {m} workers after epoch {epoch}"));
                                prewarmed = Some(Launch::start(
                                    spec,
                                    name,
                                    dir.path(),
                                    m,
                                    seg.index + 1,
                                    binary,
                                    register_timeout,
                                    dataset_path.parent(),
                                )?);
                            }
                        }
                        // older checkpoints are no longer needed
                        if let Some(d) = &checkpoint_dir
                            && epoch > 1
                        {
                            let _ = std::fs::remove_file(
                                physalia_worker::control::checkpoint_path(d, epoch - 1),
                            );
                        }
                    }
                    Action::Finished {
                        summaries,
                        peak_rss_bytes,
                    } => done = Some(Ok((summaries, peak_rss_bytes))),
                    Action::Fail { error } if seg.elastic.is_some() => {
                        stop_now.get_or_insert(Stop::Lost { error });
                    }
                    Action::Fail { error } => done = Some(Err(error)),
                }
            }
            if stop_now.is_some() {
                break;
            }
        }
        if let Some(d) = done {
            break d;
        }
        if let Some(why) = stop_now.take() {
            let reason = match &why {
                Stop::Rescale { to, rule, .. } => {
                    format!("rescaling to {to} workers (rule {rule})")
                }
                Stop::Lost { error } => format!("retrying after: {error}"),
                Stop::Reconfigure { what, .. } => format!("relaunching with {what}"),
                Stop::Finish => "the scaling policy stopped the job".into(),
            };
            log.line(&format!(
                "after epoch {last_complete}: {reason}; stopping every worker"
            ));
            for o in outboxes.iter().flatten() {
                o.send(ToWorker::Stop {
                    reason: reason.clone(),
                });
            }
            workers.kill_all();
            drop(server);
            if let Some(e) = io_err {
                return Err(e);
            }
            return Ok(SegmentEnd::Stopped {
                after_epoch: last_complete,
                why,
                prewarmed: prewarmed.map(Box::new),
            });
        }
    };
    match outcome {
        Err(error) => {
            log.line(&format!("failed: {error}; stopping every worker"));
            for o in outboxes.iter().flatten() {
                o.send(ToWorker::Stop {
                    reason: error.clone(),
                });
            }
            workers.kill_all();
            drop(server);
            Err(anyhow!(error))
        }
        Ok((summaries, peak_rss)) => {
            // Finished workers exit on their own; give them a bounded moment, then make sure.
            let deadline = Instant::now() + Duration::from_secs(10);
            while !workers.all_exited() && Instant::now() < deadline {
                workers.poll_exits();
                std::thread::sleep(Duration::from_millis(20));
            }
            workers.kill_all();
            drop(server);
            if let Some(e) = io_err {
                return Err(e);
            }
            let summary = summaries.into_iter().next().expect("rank 0 finished");
            log.line("finished");
            Ok(SegmentEnd::Finished(Coordinated {
                run: RunResult { seed, summary },
                worker_peak_rss: peak_rss,
                bytes_exchanged,
                usd,
            }))
        }
    }
}

fn fmt_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.2} MiB", b / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", b / 1024.0)
    }
}

/// The single-worker epoch line, then: total bytes sent, forward/backward payload bytes per layer summed
/// over workers, the longest halo wait and the longest all-reduce of any worker.
fn epoch_line(epochs: usize, by_rank: &[EpochMetrics]) -> String {
    let m = &by_rank[0];
    let mut line = submit::epoch_line(1, 0, epochs, m);
    let sent: u64 = by_rank.iter().map(|m| m.exchange.bytes_sent).sum();
    let mut per_layer: std::collections::BTreeMap<(u16, bool), u64> = Default::default();
    for w in by_rank {
        for l in &w.exchange.per_layer {
            if let Some(layer) = l.layer {
                let fwd = match l.phase.as_str() {
                    "forward" => true,
                    "backward" => false,
                    _ => continue,
                };
                *per_layer.entry((layer, fwd)).or_default() += l.sent;
            }
        }
    }
    let layers: Vec<String> = per_layer
        .keys()
        .map(|&(l, _)| l)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .map(|l| {
            let f = per_layer.get(&(l, true)).copied().unwrap_or(0);
            let b = per_layer.get(&(l, false)).copied().unwrap_or(0);
            format!("L{l} {}/{}", fmt_bytes(f), fmt_bytes(b))
        })
        .collect();
    let halo = by_rank
        .iter()
        .map(|m| m.exchange.halo_s)
        .fold(0.0, f64::max);
    let ar = by_rank
        .iter()
        .map(|m| m.exchange.all_reduce_s)
        .fold(0.0, f64::max);
    line.push_str(&format!(
        "  sent {}  fwd/bwd [{}]  halo max {:.3}s  allreduce max {:.3}s  ${:.6}",
        fmt_bytes(sent),
        layers.join(", "),
        halo,
        ar,
        epoch_usd(by_rank, submit::price_per_worker_s())
    ));
    line
}
