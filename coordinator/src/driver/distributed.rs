//! `physalia submit` for every job the coordinator runs (several workers, a scaling policy, containers,
//! `--resume`): the IO shell around the [`Job`] state machine (`job.rs`).
//!
//! This process is the coordinator. It loads the dataset (a raw folder or a generated graph is first written
//! into the job directory as `dataset.safetensors`) and hands the [`Job`] to a [`Driver`], which carries out
//! its actions: a launch partitions the dataset for its worker count (`ensure_partitions`, stored beside the
//! dataset and reused), creates the launch's CA and identities, binds a control endpoint ([`ControlServer`]:
//! QUIC, mutual TLS against the launch's CA, a certificate named `coordinator`) and starts the workers on
//! the job's backend from one `WorkerSpec`; an assignment goes to every registered worker; a stopped launch
//! is told to stop, killed and reaped; a recorded epoch is appended to `metrics.jsonl` and printed. The
//! driver feeds back what the control servers and the backend say, and ticks the job's clock. The
//! coordinator is not a rank of the mesh: the workers' collectives run over exactly the N workers.
//!
//! Protocol: a worker binds its mesh endpoint, connects to the coordinator and sends
//! `Register {rank, pid, mesh_addr}`; once all N have registered the coordinator sends each an
//! `Assign {peers, part file, model, train config, seed, exchange options, checkpoint to resume from}`;
//! workers join the mesh, train, and send `Epoch {rank, metrics}` per epoch (rank 0 writes the epoch's
//! checkpoint first) and `Done {rank, summary}` or `Failed {rank, error}`. Prewarmed workers are told
//! `Wait {for_s}` after every epoch until a relaunch adopts or discards them.
//!
//! Timeouts: `timeouts.register_s` (default 30 s) for all workers to register, `timeouts.epoch_s` (default
//! 60 s) of silence from any worker during training (also the workers' bound on every wait for a peer),
//! 10 s for finished workers to exit. Nothing waits without a bound.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use physalia_control::{
    Artifact, Assignment, COORDINATOR_NAME, ControlServer, ExchangeOptions, Files, JobState,
    MetricsLine, Outbox, PartCut, PartSource, ServerEvent, ToCoordinator, ToWorker, TrainMode,
    checkpoint_path,
};
use physalia_gnn::{EpochMetrics, ModelConfig, TrainConfig};
use physalia_graph::chunked_partition::PendingSet;
use physalia_graph::partition::PartitionMethod;
use physalia_graph::stream::StreamParams;
use physalia_wire::{Dtype, JobCa};
use serde_json::json;

use crate::coordinator::Event;
use crate::driver::dataset::{self, Source};
use crate::driver::inplace::{self, Preparing};
use crate::driver::partitions::StoredPartitions;
use crate::driver::platform;
use crate::driver::resolved::ResolvedJob;
use crate::driver::summary::{self, RunResult};
use crate::driver::workers::{BackendWorkers, block_on, identities, local_worker_command};
use crate::driver::{Finished, Observer};
use crate::elastic::{Elastic, Stop};
use crate::job::{Job, JobAction, JobConfig, JobEvent, Outcome, Replan};
use crate::jobdir::{Cancelled, JobDir};
use crate::spec::{ExchangeDtype, JobSpec, ParallelismSpec};

/// The names a chunked dataset's files are served under to workers that cut their parts away from
/// the coordinator's disk: this and the file's path in the manifest.
const CHUNK_PREFIX: &str = "dataset-chunk/";

/// What makes `distributed::run` a cluster-mode coordinator.
pub struct Role {
    /// The id `submit` chose: the job's folder in the store.
    pub job_id: String,
    /// The port the coordinator's platform object declares for its control endpoint.
    pub control_port: u16,
    /// Where the record is staged in the coordinator's container.
    pub staging: PathBuf,
    /// What the coordinator's container costs a second, for the ledger.
    pub coordinator_usd_per_s: f64,
    /// The job as submitted (its dataset's store URL): what `job.json` keeps.
    pub recorded: JobSpec,
    /// The partition sets beside the dataset in its store (a dataset at a URL).
    pub partitions: Option<StoredPartitions>,
    /// A chunked dataset at a URL: the chunk files not downloaded, streamed to the workers that read them.
    pub stored_chunks: Option<super::partitions::StoredChunks>,
}

/// Where a stopped job continues: the newest checkpoint whose epochs are all recorded in `metrics.jsonl`.
pub struct ResumePoint {
    pub dir: PathBuf,
    pub epoch: usize,
    pub checkpoint: PathBuf,
    pub workers: usize,
    /// `metrics.jsonl`'s lines of epochs `1..=epoch`.
    pub lines: Vec<MetricsLine>,
}

/// Finds where the job in `dir` can continue.
pub fn resume_point(dir: &Path) -> Result<ResumePoint> {
    let metrics = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics)
        .with_context(|| format!("{}: not a job directory", dir.display()))?;
    let mut lines = MetricsLine::parse_all(&text, &metrics.display().to_string())
        .map_err(anyhow::Error::msg)?;
    if let Some(i) = lines
        .iter()
        .enumerate()
        .position(|(i, l)| l.run != 0 || l.metrics.epoch != i + 1)
    {
        bail!(
            "{}: line {} records run {} epoch {}, expected run 0 epoch {}; the record is not one \
             run's consecutive epochs",
            metrics.display(),
            i + 1,
            lines[i].run,
            lines[i].metrics.epoch,
            i + 1
        );
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
            "{}: no checkpoint to resume from (jobs run by the coordinator, with several workers, a \
             scaling policy or `backend: docker`, write checkpoints/ after every epoch; single-worker jobs \
             without a policy keep none)",
            dir.display()
        );
    };
    lines.truncate(epoch);
    let workers = lines[epoch - 1].worker_count();
    Ok(ResumePoint {
        dir: dir.to_path_buf(),
        epoch,
        checkpoint: checkpoint_path(&ck_dir, epoch),
        workers,
        lines,
    })
}

fn checkpoints_dir(job: &Path) -> PathBuf {
    job.join("checkpoints")
}

pub fn run(
    job: &ResolvedJob,
    name: &str,
    obs: &dyn Observer,
    resume: Option<ResumePoint>,
    memory_check: bool,
    cluster: Option<&Role>,
) -> Result<()> {
    let spec = &job.spec;
    let n = spec.workers as usize;
    let price = &job.priced;
    let t_load = Instant::now();
    let source = dataset::load(&spec.dataset, obs)?;
    dataset::check_parallelism(spec, &source)?;
    let partitioner = super::partitions::choose(
        spec,
        &source,
        crate::driver::memory::partition_memory_bytes(),
    )?;
    let stats = source.stats();
    let cfg = summary::model_config(spec, stats.feat_dim, stats.num_classes)?;
    let local_command = local_worker_command()?;
    if n > stats.num_nodes {
        bail!(
            "workers: {n} workers for a graph of {} nodes",
            stats.num_nodes
        );
    }
    // before anything is written or launched
    if memory_check {
        crate::driver::admission::check(job, &source, crate::driver::memory::available_bytes())?;
    }
    // a client-mode job on a cloud: the platform's preflight before the record is written (cluster
    // mode's `submit` ran it before it made anything)
    if cluster.is_none() && !spec.backend.name.on_this_machine() {
        let backend = platform::job_free_backend(job)?;
        platform::preflight(job, backend.as_ref(), obs)
            .with_context(|| format!("backend.{}: preflight", spec.backend.name.as_str()))?;
    }
    let (mut dir, remote) = open_record(spec, name, resume.as_ref(), cluster)?;
    let job_url = remote
        .as_ref()
        .map(|r| format!("{}/{}", r.url(), jobdir_id(dir.path())));
    dir.begin(
        spec.backend.name.as_str(),
        resume.as_ref().map_or(0, |rp| rp.epoch),
        spec.train.epochs as usize,
    )?;
    // from here the record has its status: the store's copy is readable from the first pass
    let mut mirror = remote
        .map(|r| crate::store::Mirror::start(r, jobdir_id(dir.path()), dir.path().to_path_buf()));
    let result = (|| -> Result<summary::JobSummary> {
        let data_name = source.name().to_string();
        // an in-place resize cuts a dataset file into parts in the coordinator (a chunked one
        // restarts)
        let in_place = spec.resizes_in_place(matches!(source, Source::Chunked(_)));
        let dataset_path = dataset_file(spec, source, dir.path(), obs)?;
        let load_s = t_load.elapsed().as_secs_f64();
        let job_abs = std::path::absolute(dir.path())?;
        let (state, pending) = new_job(
            spec,
            resume.as_ref(),
            cluster,
            price,
            (dir.path(), in_place),
            obs,
        )?;
        let driver = Driver {
            job,
            spec,
            name,
            cfg: &cfg,
            // replica groups train on a partitioning into fewer parts than workers: rank = replica
            // * k + part
            k: spec.parts() as usize,
            dataset_path: &dataset_path,
            job_abs: &job_abs,
            local_command: &local_command,
            obs,
            files: Files::new(Some(job_abs.clone())),
            minibatch: std::cell::RefCell::new(spec.minibatch.clone()),
            stored_partitions: cluster.and_then(|r| r.partitions.as_ref()),
            stored_chunks: cluster.and_then(|r| r.stored_chunks.as_ref()),
            partitioner: &partitioner,
            partition_records: Default::default(),
            control_port: cluster.map(|r| r.control_port),
            preparing: Default::default(),
            prefetched: Default::default(),
            served_cut: Default::default(),
        };
        let (state, outcome) = driver.run(state, pending, &mut dir)?;
        let partitions = driver.partition_records.take();
        let elastic = state.elastic();
        let mut run = summary::summarize(
            name,
            &data_name,
            &stats,
            &cfg,
            spec,
            &[RunResult {
                seed: spec.train.seed,
                summary: outcome.summary.clone(),
            }],
            dir.path(),
            load_s,
            price,
        );
        // the bill: every launch's workers from start to stop (prewarmed and idle ones included)
        run.usd_total = outcome.usd;
        // a cluster-mode record names the job where its readers find it, not the coordinator's staging
        if let Some(url) = &job_url {
            run.job_dir = url.clone();
        }
        let mut coordinated = coordinated(elastic, outcome, cluster, job_url.clone());
        coordinated.partitions = partitions;
        Ok(summary::JobSummary {
            run,
            coordinated: Some(coordinated),
        })
    })();
    // every launch's workers are gone by now; what the platform made for the job goes with it
    if let Err(e) = platform::of_job(job).release(job, &jobdir_id(dir.path())) {
        obs.notice(&format!(
            "warning: releasing the job's platform objects: {e:#}"
        ));
    }
    let summary = match result {
        Ok(summary) => summary,
        Err(e) => {
            return Err(fail(
                &mut dir,
                &mut mirror,
                job_url.as_deref(),
                name,
                e,
                obs,
            )?);
        }
    };
    succeed(
        &mut dir,
        &summary,
        &mut mirror,
        job_url.as_deref(),
        name,
        obs,
    )
}

/// What the coordinator measured and billed over the job's launches, for `summary.json`.
fn coordinated(
    elastic: &Elastic,
    outcome: Outcome,
    cluster: Option<&Role>,
    job_url: Option<String>,
) -> summary::Coordinated {
    summary::Coordinated {
        workers: elastic.workers(),
        bytes_exchanged: outcome.bytes_exchanged,
        worker_peak_rss_bytes: outcome.worker_peak_rss,
        coordinator_rss_bytes: summary::rss_bytes(),
        worker_seconds: outcome.worker_s,
        coordinator_seconds: outcome.coordinator_s,
        coordinator_usd_per_s: cluster.map_or(0.0, |r| r.coordinator_usd_per_s),
        scaling_events: elastic.events.clone(),
        launches: outcome.launches,
        epoch_ends: outcome.epochs,
        workers_range: elastic.workers_range(),
        job_url,
        partitions: Vec::new(),
    }
}

/// Records a job that failed or was cancelled (`e` says which), mirrors it one last time, and returns
/// the error naming where its record is.
fn fail(
    dir: &mut JobDir,
    mirror: &mut Option<crate::store::Mirror>,
    job_url: Option<&str>,
    name: &str,
    e: anyhow::Error,
    obs: &dyn Observer,
) -> Result<anyhow::Error> {
    let cancelled = e.is::<Cancelled>();
    match cancelled {
        true => dir.end(JobState::Cancelled, None)?,
        false => dir.end(JobState::Failed, Some(format!("{e:#}")))?,
    }
    finish_mirror(mirror, job_url, obs);
    let how = if cancelled { "was cancelled" } else { "failed" };
    Ok(e.context(format!(
        "job {name} {how}; its record is in {}",
        dir.path().display()
    )))
}

/// Records a finished job (`summary.json`, its state, its report), mirrors it one last time, and prints
/// its final lines.
fn succeed(
    dir: &mut JobDir,
    summary: &summary::JobSummary,
    mirror: &mut Option<crate::store::Mirror>,
    job_url: Option<&str>,
    name: &str,
    obs: &dyn Observer,
) -> Result<()> {
    dir.write_json("summary.json", summary)?;
    // the record's last bill is the summary's (every launch to its stop), not the last heartbeat's
    let usd = summary.run.usd_total;
    dir.update(|s| s.usd = usd)?;
    dir.end(JobState::Succeeded, None)?;
    // the report is a view of the record (its state included): a failure to render it does not fail
    // the job
    let report = match obs.write_report(dir.path()) {
        Ok(report) => report,
        Err(e) => {
            obs.notice(&format!("warning: writing the job's report: {e:#}"));
            None
        }
    };
    finish_mirror(mirror, job_url, obs);
    let location = job_url.map_or_else(|| dir.path().display().to_string(), str::to_string);
    // a record in a store is read there
    let report = match job_url {
        Some(url) => report.map(|_| format!("{url}/report.html")),
        None => report.map(|r| r.display().to_string()),
    };
    obs.finished(&Finished {
        name,
        summary,
        location: &location,
        report: report.as_deref(),
    })
}

/// The job's record: reopened to resume, staged under the id cluster mode's submitter chose, or new
/// under `output.dir` (staged here when that is a job store at a URL, returned to mirror it there).
fn open_record(
    spec: &JobSpec,
    name: &str,
    resume: Option<&ResumePoint>,
    cluster: Option<&Role>,
) -> Result<(JobDir, Option<crate::store::Remote>)> {
    let remote = match crate::store::is_url(&spec.output.dir) {
        true => {
            let r = crate::store::Remote::open(&spec.output.dir.to_string_lossy())
                .context("output.dir")?;
            r.check_writable().context("output.dir")?;
            Some(r)
        }
        false => None,
    };
    let dir = match (resume, cluster) {
        (Some(rp), _) => JobDir::reopen(&rp.dir, rp.epoch)?,
        // cluster mode: the job's id and record are the submitter's; this process stages it
        (None, Some(role)) => {
            let dir = JobDir::create_exact(&role.staging, &role.job_id)?;
            dir.write_json("job.json", &role.recorded)?;
            dir
        }
        (None, None) => {
            let root = match &remote {
                Some(_) => crate::store::staging_root(),
                None => spec.output.dir.clone(),
            };
            let dir = JobDir::create(&root, name)?;
            dir.write_json("job.json", spec)?;
            dir
        }
    };
    Ok((dir, remote))
}

/// The dataset file the workers fetch (a chunked dataset's directory, partitioned by streaming):
/// `dataset.path`, or a generated dataset written into the job's record. The loaded dataset is dropped
/// and its memory given back before the workers start.
fn dataset_file(spec: &JobSpec, source: Source, dir: &Path, obs: &dyn Observer) -> Result<PathBuf> {
    let path = match &source {
        Source::File(_) | Source::Chunked(_) => spec
            .dataset
            .path
            .clone()
            .expect("a file source comes from dataset.path"),
        Source::Memory(ds) => {
            let path = dir.join("dataset.safetensors");
            super::step(obs, "writing the generated dataset", || ds.write(&path))
                .with_context(|| format!("writing {}", path.display()))?;
            path
        }
    };
    drop(source);
    physalia_gnn::heap::release_freed_memory();
    Ok(std::path::absolute(&path)?)
}

/// The job's state machine, under its policy, from the start or from `resume`'s checkpoint; and the
/// policy's decision after the last recorded epoch (the coordinator may have died before it acted on
/// it, so it is made again and acted on first).
fn new_job(
    spec: &JobSpec,
    resume: Option<&ResumePoint>,
    cluster: Option<&Role>,
    price: &crate::spec::Priced,
    (dir, in_place): (&Path, bool),
    obs: &dyn Observer,
) -> Result<(Job, Option<Stop>)> {
    // Every job runs under a policy: without one, a policy that never fires, so a lost worker's epoch is
    // retried and a resumed job merges its epochs all the same.
    let policy = match &spec.scaling {
        Some(p) => p.clone(),
        None => serde_json::from_value(json!({ "max_workers": spec.workers.max(1), "rules": [] }))?,
    };
    let x = spec.exchange.clone().unwrap_or_default();
    let mut elastic = Elastic::new(
        policy,
        spec.workers,
        spec.train.epochs,
        price.usd_per_worker_s,
    )
    .with_exchange(x.boundary_sampling, x.staleness)
    .with_max_retries(spec.max_retries());
    let mut workers_now = spec.workers as usize;
    let mut start_epoch = 0;
    let mut pending: Option<Stop> = None;
    if let Some(rp) = resume {
        pending = elastic.replay(&rp.lines, spec.train.epochs as usize);
        workers_now = rp.workers;
        start_epoch = rp.epoch;
        let line = elastic.event(
            rp.epoch,
            format!(
                "resumed from {} on {workers_now} workers",
                rp.checkpoint.display()
            ),
            None,
        );
        obs.progress(&line);
    }
    // a resumed job's launches continue the numbering of the ones before (their logs stay)
    let first_launch = std::fs::read_dir(dir.join("logs"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with("worker-0."))
                .count()
        })
        .unwrap_or(0);
    let timeouts = spec.timeouts.clone().unwrap_or_default();
    let job = Job::new(
        JobConfig {
            workers: workers_now,
            epochs: spec.train.epochs as usize,
            seed: spec.train.seed,
            register_timeout: Duration::from_secs_f64(timeouts.register_s),
            epoch_timeout: Duration::from_secs_f64(timeouts.epoch_s),
            // every coordinated job checkpoints every epoch: rescales, retries and `submit --resume`
            // start there
            checkpoints: true,
            start_epoch,
            price_per_worker_s: price.usd_per_worker_s,
            // the coordinator is this process: on the user's machine (client mode, free) or a
            // platform's container (cluster mode) at its price
            coordinator_price_per_s: cluster.map_or(0.0, |r| r.coordinator_usd_per_s),
            mode: spec.mode(),
            in_place,
        },
        elastic,
        first_launch,
    );
    Ok((job, pending))
}

/// Uploads what the job's record gained since the mirror's last pass, and stops it. A record that
/// cannot be uploaded stays whole here, and the warning says where.
fn finish_mirror(mirror: &mut Option<crate::store::Mirror>, url: Option<&str>, obs: &dyn Observer) {
    if let Some(m) = mirror.take()
        && let Err(e) = m.finish()
    {
        obs.notice(&format!(
            "warning: the job's record could not be written to {}: {e:#}",
            url.unwrap_or("the job store")
        ));
    }
}

/// The job id: the job directory's name.
fn jobdir_id(dir: &Path) -> String {
    dir.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Started worker processes with their job CA and control endpoint, registering or registered.
struct Launch {
    server: ControlServer,
    /// Local processes or containers, through the backend's trait either way.
    workers: BackendWorkers,
    /// The CA the workers' certificates are issued by: the launch's own, or (joiners of an in-place
    /// resize) the launch's whose mesh they join.
    ca: Rc<JobCa>,
    /// The mesh rank of each of the launch's workers, by its index in the launch: `0..n`, or the ranks
    /// joiners take (from the old size up for a growth, the lost workers' for a replacement).
    ranks: Vec<usize>,
    /// The backend's launch (the job's segment) these workers were started as.
    segment: usize,
}

impl Launch {
    /// Issues a CA and identities for `n` workers, binds a control endpoint and starts the workers on the
    /// job's backend from one `WorkerSpec`. `join`: the CA of a running launch and the `n` ranks of its
    /// mesh the workers take (the joiners of an in-place resize, or the replacements of lost workers).
    fn start(
        d: &Driver,
        dir: &Path,
        n: usize,
        index: usize,
        join: Option<(Rc<JobCa>, Vec<usize>)>,
    ) -> Result<Launch> {
        let (job, spec, name, obs) = (d.job, d.spec, d.name, d.obs);
        let local_command = d.local_command;
        let timeouts = spec.timeouts.clone().unwrap_or_default();
        let register_timeout = Duration::from_secs_f64(timeouts.register_s);
        let (files, control_port) = (d.files.clone(), d.control_port);
        let dir = &std::path::absolute(dir)?;
        // The job id names the CA and keys frames: the job directory's name is unique per submission.
        let job_id = dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| name.into());
        let (ca, ranks) = match join {
            Some((ca, ranks)) => (ca, ranks),
            None => (
                Rc::new(JobCa::new(&job_id).context("creating the job certificate authority")?),
                (0..n).collect(),
            ),
        };
        ensure!(
            ranks.len() == n && ranks.windows(2).all(|w| w[0] < w[1]),
            "launch {index}: {n} workers cannot take ranks {ranks:?}"
        );
        // the mesh's size as far as this launch knows: its highest rank's
        let world = ranks.last().map_or(0, |r| r + 1);
        // every launch has its own CA and keys (joiners: the keys of their ranks under the CA of the
        // mesh they join), handed to the backend as the spec's secrets
        let secrets = identities(&ca, &ranks)?;
        let platform = platform::of_job(job);
        let backend = platform.backend(job, &job_id, dir, index, obs)?;
        // where the workers reach this machine: loopback for local processes, the job network's gateway
        // for containers, every interface (advertising one) for a cloud platform's
        let prepared = block_on(backend.prepare(&job_id))?
            .with_context(|| format!("preparing {} for the job", backend.name()))?;
        let reach = platform.reach(job, &prepared)?;
        // port 0 (any) unless this is a cluster-mode coordinator, whose platform object declares one
        let identity = ca.identity(COORDINATOR_NAME)?;
        let mut bound = None;
        for port in platform::control_ports(control_port) {
            match ControlServer::bind(
                &identity,
                ca.job_key(),
                world,
                SocketAddr::new(reach.bind, port),
                register_timeout,
                files.clone(),
            ) {
                Ok(s) => {
                    bound = Some(Ok(s));
                    break;
                }
                Err(e) => bound = Some(Err(e)),
            }
        }
        let server = bound
            .expect("at least one port is tried")
            .context("binding the coordinator's control endpoint")?;
        let cores = std::thread::available_parallelism()
            .map(|c| c.get())
            .unwrap_or(1);
        let threads = spec
            .train
            .threads
            .map(|t| t as usize)
            .unwrap_or((cores / world.max(1)).max(1));
        let coordinator = SocketAddr::new(reach.advertise, server.local_addr().port());
        let mut launch = platform::launch(
            job,
            platform::Worker {
                job_id: &job_id,
                segment: index,
                coordinator,
                threads,
                secrets,
                local_command,
                obs,
            },
        )?;
        // where each rank's output is copied when it ends, for platforms that keep it themselves
        let logs = match launch.copy_logs {
            true => {
                let logs_dir = dir.join("logs");
                std::fs::create_dir_all(&logs_dir)?;
                Some(
                    ranks
                        .iter()
                        .map(|&rank| {
                            physalia_backends::local::log_path(&logs_dir, index as u32, rank)
                        })
                        .collect(),
                )
            }
            false => None,
        };
        // the workers' ranks in the job, where they are not 0..n: a first rank (joiners of a growth) or
        // the list (replacements of lost workers)
        if let Some((key, value)) = physalia_control::env::rank_env(&ranks) {
            launch.spec.env.insert(key.to_string(), value);
        }
        let workers = BackendWorkers::launch(backend, &launch.spec, n, logs, launch.poll_every)?;
        Ok(Launch {
            server,
            workers,
            ca,
            ranks,
            segment: index,
        })
    }
}

/// The job's backend for launch `segment` of the job in `job_dir` (named after the directory).
pub fn job_backend(
    job: &ResolvedJob,
    job_dir: &Path,
    segment: usize,
    obs: &dyn Observer,
) -> Result<Box<dyn physalia_backends::Backend>> {
    let job_dir = std::path::absolute(job_dir)?;
    platform::of_job(job).backend(job, &jobdir_id(&job_dir), &job_dir, segment, obs)
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
        rematerialize: x.rematerialize,
    }
}

/// Appends to `logs/coordinator.log` (refusals, spawns, failures, the workers' warnings); never to the
/// terminal (the refusals and the workers' warnings are also `info` events, which `-v` shows). While it
/// is open, this process's own warnings are teed into the same file.
struct CoordLog(Option<std::fs::File>);

impl CoordLog {
    fn open(path: &Path) -> CoordLog {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .ok();
        physalia_worker::logging::tee(file.as_ref().and_then(|f| f.try_clone().ok()));
        CoordLog(file)
    }
}

impl Drop for CoordLog {
    fn drop(&mut self) {
        physalia_worker::logging::tee(None);
    }
}

impl CoordLog {
    fn line(&mut self, s: &str) {
        use std::io::Write;
        if let Some(f) = &mut self.0 {
            let _ = writeln!(f, "{s}");
        }
    }
}

/// What the job's launches share: the settings, the dataset and where things go.
struct Driver<'a> {
    job: &'a ResolvedJob,
    /// `job.spec`.
    spec: &'a JobSpec,
    name: &'a str,
    cfg: &'a ModelConfig,
    /// Parts of a replica group's partitioning (the worker count otherwise).
    k: usize,
    dataset_path: &'a Path,
    job_abs: &'a Path,
    /// How a worker process starts on this machine.
    local_command: &'a [String],
    /// Where what happens is reported.
    obs: &'a dyn Observer,
    /// What the control servers serve (partitions, the dataset, checkpoints) and where rank 0's
    /// checkpoints and model are stored: the job directory.
    files: Files,
    /// Mini-batch settings of the next assignments: the job file's, or a replan's choice.
    minibatch: std::cell::RefCell<Option<crate::spec::MiniBatchSpec>>,
    /// Partition sets kept beside the dataset in its object store (cluster mode).
    stored_partitions: Option<&'a StoredPartitions>,
    /// A chunked dataset's files left in its store (cluster mode).
    stored_chunks: Option<&'a super::partitions::StoredChunks>,
    /// How a missing partition set is computed (the job file's `dataset.partitioner` or the planner's).
    partitioner: &'a super::partitions::PartitionChoice,
    /// The set of each part count the launches trained on, for `summary.json`.
    partition_records: std::cell::RefCell<Vec<physalia_control::record::PartitionRecord>>,
    /// The port the control endpoints bind (and the next few): the one a cluster-mode
    /// coordinator's platform object declares; `None`: any.
    control_port: Option<u16>,
    /// The partitionings an in-place resize of the training launch may take, being made while it
    /// trains (`JobAction::Prepare`): (launch, its preparation for one count).
    preparing: std::cell::RefCell<Vec<(usize, Preparing)>>,
    /// The prepared deltas served ahead of their resize, as (launch, count, rank).
    prefetched: std::cell::RefCell<std::collections::HashSet<(usize, usize, usize)>>,
    /// The chunk files and artifacts a pending set's cut is served as ([`Self::serve_cut`]), keyed by
    /// its assignment file: registered once per launch, not once per rank.
    served_cut: std::cell::RefCell<Option<(PathBuf, physalia_control::ServedCut)>>,
}

/// How a job's run ended.
enum End {
    Finished,
    Failed(String),
    /// `physalia cancel`.
    Cancelled,
}

/// A job while the driver runs it: the state machine, its live launches, the actions it asked for
/// and not yet carried out, the coordinator's log.
struct Running {
    job: Job,
    live: std::collections::BTreeMap<usize, Live>,
    queue: std::collections::VecDeque<JobAction>,
    log: CoordLog,
    checkpoints: PathBuf,
}

impl Running {
    /// Tells the job `event` now and queues what it answers.
    fn feed(&mut self, event: JobEvent) {
        let actions = self.job.handle(event, Instant::now());
        self.queue.extend(actions);
    }

    /// Listens to every live launch once: exits first, messages second (a worker sends its last
    /// message before it exits, so whatever it said is in by the time its exit is handled), then
    /// the clock's tick.
    fn listen(&mut self) {
        let mut fed = Vec::new();
        let wait = Duration::from_millis(100 / self.live.len().max(1) as u64);
        for (&launch, l) in self.live.iter_mut() {
            let (exits, events) = l.poll(wait);
            for ev in events {
                if let Some(event) = worker_event(ev, l, &mut self.log, launch) {
                    fed.push(JobEvent::Worker { launch, event });
                }
            }
            for (rank, how, by_signal) in exits {
                self.log
                    .line(&format!("launch {launch}: worker {rank} {how}"));
                fed.push(JobEvent::Worker {
                    launch,
                    event: Event::Exited {
                        rank,
                        how,
                        by_signal,
                    },
                });
            }
        }
        if self.live.is_empty() {
            std::thread::sleep(wait);
        }
        fed.push(JobEvent::Tick);
        for ev in fed {
            self.feed(ev);
        }
    }
}

/// A launch the job has not stopped: its workers, their control connections, its partition files.
/// A launch resized in place is made of the backend launches of its survivors and of its joiners.
struct Live {
    launches: Vec<Launch>,
    /// By mesh rank.
    outboxes: Vec<Option<Outbox>>,
    /// Each rank's mesh address and pid, as it registered (or paused, for the next mesh).
    mesh: Vec<Option<(Option<u32>, SocketAddr)>>,
    /// The mesh ranks of this launch: `0..ranks`. A leaver of an in-place resize (a rank at or above
    /// it) is stopping: what it says or does is not the job's.
    ranks: usize,
    parts: Vec<PathBuf>,
    /// Names the part files are served under: `k<K>` for a stored set, `seg<L>` for the partitioning
    /// an in-place resize made for launch `L`.
    parts_tag: String,
    /// The node -> rank assignment of `parts` when an in-place resize made it (a stored set keeps its
    /// own in `partition.safetensors`).
    owner: Option<Arc<Vec<u32>>>,
    /// `parts` are part deltas (an in-place resize's): each worker applies its own to the part it held.
    part_delta: bool,
    /// `parts` are still to be cut, each by its worker from the chunked dataset (issue 31): the set is
    /// committed once every worker has reported an epoch.
    pending: Option<physalia_graph::chunked_partition::PendingSet>,
    /// By rank: the worker trains on the part it holds (a survivor of a lost worker's replacement),
    /// nothing is served to it.
    held: Vec<bool>,
    /// By rank: the worker paused holding the part of this launch's assignment (its
    /// [`ToCoordinator::Paused`] said so; false for one whose mesh was aborted before it had loaded
    /// that part, and for any rank that has not paused).
    holds_part: Vec<bool>,
    /// Workers no longer the job's, as (backend launch's segment, rank): replaced by another's launch, or
    /// leavers of a shrink. Their exits and words are not the job's; a backend launch all of whose
    /// workers are here is stopped and forgotten ([`Live::prune`]).
    retired: Vec<(usize, usize)>,
    /// Joiners started ahead of a resize (a prewarm): the launch they will join and its new size.
    joins: Option<(usize, usize)>,
}

impl Live {
    fn new(launch: Launch, ranks: usize, parts: Vec<PathBuf>, parts_tag: String) -> Live {
        Live {
            launches: vec![launch],
            outboxes: vec![None; ranks],
            mesh: vec![None; ranks],
            ranks,
            parts,
            parts_tag,
            owner: None,
            part_delta: false,
            pending: None,
            held: Vec::new(),
            holds_part: vec![false; ranks],
            retired: Vec::new(),
            joins: None,
        }
    }

    /// Every rank's pid (`pids`, by rank) and next mesh address, once every rank is ready.
    /// (Records the pids beside the addresses: the next resize or replacement reads them there.)
    fn ready(&mut self, pids: &[Option<u32>]) -> Vec<(Option<u32>, SocketAddr)> {
        self.mesh
            .iter_mut()
            .zip(pids)
            .map(|(m, pid)| {
                let addr = m.expect("every rank is ready").1;
                *m = Some((*pid, addr));
                (*pid, addr)
            })
            .collect()
    }

    /// Stops the backend launches none of whose workers is the job's any more (each replaced, or a
    /// leaver of a shrink) and closes their control endpoints: in cluster mode each holds one of the few
    /// ports the platform opens (`CONTROL_PORTS`), which the next joiners' launch needs. Their workers'
    /// output is kept as any stopped launch's. Returns their segments.
    fn prune(&mut self) -> Vec<usize> {
        let retired = &self.retired;
        let (keep, gone): (Vec<Launch>, Vec<Launch>) = std::mem::take(&mut self.launches)
            .into_iter()
            .partition(|l| l.ranks.iter().any(|&r| !retired.contains(&(l.segment, r))));
        self.launches = keep;
        let segments: Vec<usize> = gone.iter().map(|l| l.segment).collect();
        self.retired
            .retain(|(segment, _)| !segments.contains(segment));
        for mut l in gone {
            l.workers.kill_all();
            drop(l.server);
        }
        segments
    }

    /// The backend's exits (by mesh rank) and the control servers' events, waiting up to `wait` for the
    /// first when nothing exited.
    fn poll(&mut self, wait: Duration) -> (Vec<(usize, String, bool)>, Vec<ServerEvent>) {
        let ranks = self.ranks;
        let mut exits = Vec::new();
        for l in self.launches.iter_mut() {
            for (i, how, by_signal) in l.workers.poll_exits() {
                let rank = l.ranks[i];
                if rank < ranks && !self.retired.contains(&(l.segment, rank)) {
                    exits.push((rank, how, by_signal));
                }
            }
        }
        let mut events = Vec::new();
        let mut first = if exits.is_empty() {
            wait / self.launches.len().max(1) as u32
        } else {
            Duration::ZERO
        };
        for l in &self.launches {
            let retired = |ev: &ServerEvent| {
                event_rank(ev).is_some_and(|r| self.retired.contains(&(l.segment, r)))
            };
            if let Some(ev) = l.server.next_event(first) {
                if !retired(&ev) {
                    events.push(ev);
                }
                while let Some(ev) = l.server.next_event(Duration::ZERO) {
                    if !retired(&ev) {
                        events.push(ev);
                    }
                }
                first = Duration::ZERO;
            }
        }
        (exits, events)
    }
}

impl Driver<'_> {
    /// Runs the [`Job`] state machine until it ends: carries out its actions, feeds it what the launches'
    /// workers and control servers say, and ticks its clock. Every launch is stopped when this returns.
    fn run(&self, job: Job, pending: Option<Stop>, dir: &mut JobDir) -> Result<(Job, Outcome)> {
        let logs = dir.path().join("logs");
        std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
        // checkpoints/ exists before any worker writes into it
        let checkpoints = checkpoints_dir(self.job_abs);
        std::fs::create_dir_all(&checkpoints)
            .with_context(|| format!("creating {}", checkpoints.display()))?;
        let mut r = Running {
            job,
            live: Default::default(),
            queue: Default::default(),
            log: CoordLog::open(&logs.join("coordinator.log")),
            checkpoints,
        };
        r.queue = r.job.start(pending, Instant::now()).into();
        let end = loop {
            // carry out every action, and what answering them makes the job decide
            if let Some(end) = self.act(&mut r, dir)? {
                break end;
            }
            self.prefetch_prepared(&mut r);
            if dir.cancel_requested() {
                r.log
                    .line("cancel requested (physalia cancel): stopping every launch");
                self.obs.progress("cancel requested: stopping every worker");
                break End::Cancelled;
            }
            let bill = r.job.usd_at(Instant::now());
            let _ = dir.update_if_stale(|s| s.usd = bill);
            r.listen();
        };
        // nothing outlives the job
        for (_, l) in std::mem::take(&mut r.live) {
            stop(l, "the job ended", false);
        }
        let Running { job, mut log, .. } = r;
        match end {
            End::Finished => {
                log.line("finished");
                let outcome = job
                    .outcome()
                    .cloned()
                    .expect("a finished job has an outcome");
                Ok((job, outcome))
            }
            End::Failed(error) => {
                log.line(&format!("failed: {error}"));
                Err(anyhow!(error))
            }
            End::Cancelled => {
                log.line("cancelled");
                Err(anyhow!(Cancelled))
            }
        }
    }

    /// Carries out the queued actions until none is left or the job ends.
    fn act(&self, r: &mut Running, dir: &mut JobDir) -> Result<Option<End>> {
        // the job's end is known when it says so; what it queued with it is still carried out
        let mut end = None;
        while let Some(action) = r.queue.pop_front() {
            match action {
                JobAction::Launch {
                    launch,
                    workers,
                    mode,
                    prewarm,
                } => self.handle_launch(r, dir, launch, workers, mode, prewarm),
                JobAction::Assign {
                    launch,
                    peers,
                    resume_epoch,
                    mode,
                    boundary_sampling,
                    staleness,
                    gated,
                } => {
                    let l = r.live.get(&launch).expect("the job assigns a live launch");
                    for (rank, outbox) in l.outboxes.iter().enumerate() {
                        let mut a = self.assignment(
                            rank,
                            (&l.parts, &l.parts_tag, l.pending.as_ref()),
                            peers.clone(),
                            resume_epoch,
                            mode,
                            (boundary_sampling, staleness),
                        )?;
                        a.gated = gated;
                        a.part_delta = l.part_delta;
                        if mode != TrainMode::Model && l.held.get(rank).copied().unwrap_or(false) {
                            a.part = PartSource::Held;
                        }
                        if let Some(o) = outbox {
                            o.send(ToWorker::Assign(Box::new(a)));
                        }
                    }
                    r.log.line(&format!(
                        "launch {launch}: all workers registered; assignments sent"
                    ));
                    let workers = l.outboxes.len();
                    let _ = dir.update(|s| s.workers = workers);
                }
                JobAction::Replan {
                    epoch,
                    objective,
                    workers,
                    mode,
                    by_rank,
                } => {
                    r.log.line(&format!(
                        "after epoch {epoch}: asking the planner again ({})",
                        objective.as_str()
                    ));
                    let answer = self.replan(objective, workers, mode, &by_rank);
                    r.feed(JobEvent::Replanned(answer));
                }
                JobAction::LaunchJoiners {
                    launch,
                    joining,
                    base,
                    workers,
                    prewarm,
                } => self.handle_joiners(r, dir, launch, joining, base, workers, prewarm),
                JobAction::Prepare { launch, workers } => {
                    let line = match self.prepare(r, launch, &workers) {
                        Ok(()) => format!(
                            "launch {launch}: preparing the partitionings for {workers:?} workers while \
                             it trains"
                        ),
                        // a resize then makes its partitioning in its pause
                        Err(e) => format!(
                            "launch {launch}: preparing the partitionings for {workers:?} workers \
                             failed: {e:#}"
                        ),
                    };
                    r.log.line(&line);
                }
                JobAction::Continue { launch } => {
                    if let Some(l) = r.live.get(&launch) {
                        for o in l.outboxes.iter().flatten() {
                            o.send(ToWorker::Continue);
                        }
                    }
                }
                JobAction::Resize {
                    from,
                    to,
                    workers,
                    mode,
                    resume_epoch,
                    joiners,
                    replacing,
                } => {
                    let t = Instant::now();
                    let result = match replacing.clone() {
                        Some(ranks) => self.replace(r, dir, from, to, ranks, joiners),
                        None => {
                            self.resize(r, dir, from, to, (workers, mode), resume_epoch, joiners)
                        }
                    }
                    .map_err(|e| format!("{e:#}"));
                    r.log.line(&format!(
                        "launch {to}: in-place {} {} in {:.3} s",
                        if replacing.is_some() {
                            "replacement"
                        } else {
                            "resize"
                        },
                        if result.is_ok() { "ready" } else { "failed" },
                        t.elapsed().as_secs_f64()
                    ));
                    r.feed(JobEvent::Resized { launch: to, result });
                }
                JobAction::KeepWaiting { launch, for_s } => {
                    if let Some(l) = r.live.get(&launch) {
                        for o in l.outboxes.iter().flatten() {
                            o.send(ToWorker::Wait { for_s });
                        }
                    }
                }
                JobAction::StopLaunch {
                    launch,
                    reason,
                    finished,
                } => {
                    // a launch resized in place is made of the backend launches of its survivors and
                    // joiners: those are what the record lists (for `cancel` after a coordinator's death)
                    let mut segments = vec![launch as u32];
                    if let Some(l) = r.live.remove(&launch) {
                        segments.extend(l.launches.iter().map(|x| x.segment as u32));
                        stop(l, &reason, finished);
                    }
                    let _ = dir.update(|s| s.launches.retain(|l| !segments.contains(l)));
                }
                JobAction::Record {
                    epoch,
                    by_rank,
                    usd,
                } => {
                    // every worker trained an epoch, so every part it cut is written: the set is
                    // committed (a set that fails to commit is cut again by the next job)
                    for (launch, l) in r.live.iter_mut() {
                        if let Some(set) = l.pending.take() {
                            self.commit_cut(&set, &mut r.log);
                        }
                        // out of the pause: the launches of workers that left or were replaced stop now
                        let gone = l.prune();
                        if !gone.is_empty() {
                            let segments: Vec<u32> = gone.iter().map(|&g| g as u32).collect();
                            r.log.line(&format!(
                                "launch {launch}: backend launch{} {} stopped, every worker of {} left or \
                                 replaced (control endpoint{} closed)",
                                if gone.len() == 1 { "" } else { "es" },
                                segments
                                    .iter()
                                    .map(u32::to_string)
                                    .collect::<Vec<_>>()
                                    .join(", "),
                                if gone.len() == 1 { "it" } else { "them" },
                                if gone.len() == 1 { "" } else { "s" },
                            ));
                            let _ = dir.update(|s| s.launches.retain(|l| !segments.contains(l)));
                        }
                    }
                    if let Err(e) = self.handle_record(r, dir, epoch, &by_rank, usd) {
                        // the record is the job's truth: without it the epoch does not count
                        return Ok(Some(End::Failed(format!("{e:#}"))));
                    }
                }
                JobAction::Say(line) => {
                    r.log.line(&line);
                    self.obs.progress(&line);
                }
                JobAction::Log(line) => r.log.line(&line),
                JobAction::Finish => end = Some(End::Finished),
                JobAction::Fail { error } => end = Some(End::Failed(error)),
            }
        }
        Ok(end)
    }

    /// `JobAction::Launch`: partitions and starts the launch's workers, and tells the job how it went.
    fn handle_launch(
        &self,
        r: &mut Running,
        dir: &mut JobDir,
        launch: usize,
        workers: usize,
        mode: TrainMode,
        prewarm: bool,
    ) {
        let result = match self.launch(launch, workers, mode, dir) {
            Ok(l) => {
                let pids = l.launches[0].workers.pids();
                r.log.line(&format!(
                    "launch {launch}: control endpoint {}",
                    l.launches[0].server.local_addr()
                ));
                r.live.insert(launch, l);
                let _ = dir.update(|s| s.launches.push(launch as u32));
                Ok(pids)
            }
            Err(e) => {
                let e = format!("{e:#}");
                r.log.line(&format!(
                    "launch {launch} ({workers} workers{}) failed to start: {e}",
                    if prewarm { ", prewarm" } else { "" }
                ));
                Err(e)
            }
        };
        r.feed(JobEvent::Started { launch, result });
    }

    /// `JobAction::LaunchJoiners`: starts `workers` workers as ranks `base..` of launch `joining`'s mesh,
    /// under its CA, and tells the job how it went.
    #[allow(clippy::too_many_arguments)]
    fn handle_joiners(
        &self,
        r: &mut Running,
        dir: &mut JobDir,
        launch: usize,
        joining: usize,
        base: usize,
        workers: usize,
        prewarm: bool,
    ) {
        let started = match r.live.get(&joining) {
            Some(l) => {
                let ca = l.launches[0].ca.clone();
                let ranks = (base..base + workers).collect();
                Launch::start(self, dir.path(), workers, launch, Some((ca, ranks)))
            }
            None => Err(anyhow!("launch {joining} is not running")),
        };
        let result = match started {
            Ok(l) => {
                let pids = l.workers.pids();
                r.log.line(&format!(
                    "launch {launch}: {workers} joiners of launch {joining} (ranks {base}..{}), control \
                     endpoint {}",
                    base + workers,
                    l.server.local_addr()
                ));
                let mut live = Live::new(l, base + workers, Vec::new(), String::new());
                live.joins = Some((joining, base + workers));
                r.live.insert(launch, live);
                let _ = dir.update(|s| s.launches.push(launch as u32));
                Ok(pids)
            }
            Err(e) => {
                let e = format!("{e:#}");
                r.log.line(&format!(
                    "launch {launch} ({workers} joiners{}) failed to start: {e}",
                    if prewarm { ", prewarm" } else { "" }
                ));
                Err(e)
            }
        };
        r.feed(JobEvent::Started { launch, result });
    }

    /// `JobAction::Resize`: resizes launch `from` in place into launch `to` of `n` workers. Its ranks
    /// below `n` pause after the epoch they reported (keeping their processes, models, optimizer states
    /// and progress) and bind their next mesh endpoint; the ranks above stop; the joiners (launch
    /// `joiners`, ranks from `from`'s size up, under its CA) are the prewarmed ones or start now; a
    /// partitioning for `n` that keeps every survivor's rows where it can is made. Returns every rank's
    /// pid and next mesh address once all are ready; an error leaves the launches to the job (it stops
    /// them and restarts from the checkpoint).
    #[allow(clippy::too_many_arguments)]
    fn resize(
        &self,
        r: &mut Running,
        dir: &mut JobDir,
        from: usize,
        to: usize,
        (n, mode): (usize, TrainMode),
        resume_epoch: usize,
        joiners: Option<crate::job::Joiners>,
    ) -> Result<Vec<(Option<u32>, SocketAddr)>> {
        if let Some(rank) = fault_at_resize() {
            // the test hook: this rank is lost while the job resizes
            if let Some(pid) = r
                .live
                .get(&from)
                .and_then(|l| l.mesh.get(rank).copied().flatten())
                .and_then(|(pid, _)| pid)
            {
                // SAFETY: kill(2) of a worker process this coordinator started
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
        }
        let old = r
            .live
            .get_mut(&from)
            .with_context(|| format!("launch {from} is not running"))?;
        let n_old = old.ranks;
        let pids: Vec<Option<u32>> = old.mesh.iter().map(|m| m.and_then(|m| m.0)).collect();
        // every rank pauses, the leavers too: each leaves the mesh cleanly before any is stopped (a
        // peer that vanished mid-close holds the others' close to its timeout)
        for (rank, o) in old.outboxes.iter().enumerate() {
            o.as_ref()
                .with_context(|| {
                    format!("worker {rank} of launch {from} has no control connection")
                })?
                .send(ToWorker::Pause);
        }
        // the next addresses come with the pauses
        for m in old.mesh.iter_mut() {
            *m = None;
        }
        // joiners: the prewarmed ones registered while the job trained; others start now
        if let Some(j) = joiners
            && !j.prewarmed
        {
            let ca = old.launches[0].ca.clone();
            let l = Launch::start(
                self,
                dir.path(),
                n - n_old,
                j.launch,
                Some((ca, (n_old..n).collect())),
            )
            .context("starting the joiners")?;
            r.live
                .insert(j.launch, Live::new(l, n, Vec::new(), String::new()));
            let _ = dir.update(|s| s.launches.push(j.launch as u32));
        }
        // the partitioning for n workers: made while the launch trained, else now (while the survivors
        // pause and the joiners register)
        let t = Instant::now();
        if matches!(mode, TrainMode::Data | TrainMode::Model) {
            // data parallelism samples from the whole graph: the resized launch takes the set for n parts
            // (each worker's seeds and cache), stored or made now; P3 reads the whole dataset and takes
            // the new count's feature columns of it (no part, no partitioning). No rows move, only the
            // model is kept.
            let (parts, what) = match mode {
                TrainMode::Data => (
                    self.partition_set(n)?,
                    format!("data-parallel workers, the partition set for {n} parts"),
                ),
                _ => (
                    Vec::new(),
                    "model-parallel (P3) workers, each reading the whole dataset".to_string(),
                ),
            };
            r.log.line(&format!(
                "resizing in place after epoch {resume_epoch}: {n_old} -> {n} {what} ({:.3} s in the \
                 pause)",
                t.elapsed().as_secs_f64()
            ));
            return self.resized_launch(r, from, to, n, joiners, pids, |l| {
                l.parts = parts;
                l.parts_tag = format!("k{n}");
                l.owner = None;
                l.part_delta = false;
            });
        }
        let (tag, prepared, how) = match self.take_prepared(from, n) {
            Some(p) => {
                let ready = p.is_ready();
                let tag = prepared_tag(from, n);
                let made = p.wait()?;
                let how = match ready {
                    true => "prepared while the job trained",
                    false => "prepared while the job trained, finished in the pause",
                };
                (tag, made, how)
            }
            None => {
                let owner = self.owner_of(&r.live[&from])?;
                let tag = format!("seg{to}");
                let dir = self.job_abs.join("partitions").join(&tag);
                let input = self.prepare_input(&owner, n_old, &tag);
                (
                    tag,
                    inplace::prepare(&input, n, &dir)?,
                    "made in the pause (not foreseen)",
                )
            }
        };
        // the other counts' preparations for this launch are not needed
        self.preparing.borrow_mut().retain(|(l, _)| *l != from);
        let line = format!(
            "resizing in place after epoch {resume_epoch}: {n_old} -> {n} workers, {} rows change owner \
             ({} of features), partitioning {how} ({:.3} s to make: {}; {:.3} s in the pause); the workers \
             get deltas of {} in all ({} of rows gained, {} of halo bookkeeping, {} of input-halo rows \
             they would otherwise fetch from their peers) [bytes: deltas {} rows {} bookkeeping {} \
             moved_features {} halo_rows {}]",
            prepared.moved,
            summary::fmt_bytes(prepared.moved_feature_bytes),
            prepared.seconds,
            prepared
                .stages
                .iter()
                .map(|(n, s)| format!("{n} {s:.2} s"))
                .collect::<Vec<_>>()
                .join(", "),
            t.elapsed().as_secs_f64(),
            summary::fmt_bytes(prepared.file_bytes),
            summary::fmt_bytes(prepared.row_bytes),
            summary::fmt_bytes(prepared.bookkeeping_bytes),
            summary::fmt_bytes(prepared.halo_bytes),
            prepared.file_bytes,
            prepared.row_bytes,
            prepared.bookkeeping_bytes,
            prepared.moved_feature_bytes,
            prepared.halo_bytes,
        );
        r.log.line(&line);
        tracing::info!("{line}");
        {
            let mut records = self.partition_records.borrow_mut();
            if !records.iter().any(|p| p.parts == n) {
                records.push(physalia_control::record::PartitionRecord {
                    parts: n,
                    method: format!("in-place ({})", self.partitioner.method_name()),
                    reused: false,
                    why: Some(format!(
                        "resized in place from {n_old} workers: the set for {n} parts matched to the \
                         current ranks by overlap, {} rows moved",
                        prepared.moved
                    )),
                    edge_cut: prepared.edge_cut,
                    cut_fraction: prepared.cut_fraction,
                    balance: prepared.balance,
                    partition_seconds: None,
                    compute_seconds: prepared.seconds,
                    bytes_read: None,
                });
            }
        }
        self.resized_launch(r, from, to, n, joiners, pids, |l| {
            l.parts = prepared.deltas;
            l.parts_tag = tag;
            l.owner = Some(Arc::new(prepared.owner));
            l.part_delta = true;
        })
    }

    /// The end of [`Self::resize`]: waits for every rank (the survivors' pauses, the joiners'
    /// registrations), then makes launch `to` of `n` ranks from `from`'s survivors and the joiners (the
    /// leavers stop), its parts set by `parts`. Returns every rank's pid (`pids`: `from`'s, by rank) and
    /// next mesh address.
    #[allow(clippy::too_many_arguments)]
    fn resized_launch(
        &self,
        r: &mut Running,
        from: usize,
        to: usize,
        n: usize,
        joiners: Option<crate::job::Joiners>,
        pids: Vec<Option<u32>>,
        parts: impl FnOnce(&mut Live),
    ) -> Result<Vec<(Option<u32>, SocketAddr)>> {
        let n_old = r.live[&from].ranks;
        let keep = n.min(n_old);
        let join = joiners.map(|j| j.launch);
        let mut waits = vec![(from, (0..n_old).collect(), "survivors paused")];
        if let Some(j) = join {
            ensure!(
                r.live.contains_key(&j),
                "the joiners' launch {j} is not running"
            );
            waits.push((j, (n_old..n).collect(), "joiners registered"));
        }
        self.wait_ready(r, &waits)?;
        // one launch of n ranks: the survivors' and the joiners' backend launches and connections; the
        // leavers stop, and from here their exits and words are not the job's
        let mut old = r.live.remove(&from).expect("checked above");
        for o in old.outboxes.iter().skip(keep).flatten() {
            o.send(ToWorker::Stop {
                reason: format!("the job shrinks to {n} workers in place"),
            });
        }
        old.outboxes.truncate(keep);
        old.mesh.truncate(keep);
        for rank in keep..n_old {
            if let Some(l) = old
                .launches
                .iter()
                .rev()
                .find(|l| l.ranks.contains(&rank) && !old.retired.contains(&(l.segment, rank)))
            {
                old.retired.push((l.segment, rank));
            }
        }
        let mut pids = pids;
        pids.truncate(keep);
        if let Some(j) = join {
            let joined = r.live.remove(&j).expect("checked above");
            old.outboxes.extend(joined.outboxes.into_iter().skip(n_old));
            old.mesh.extend(joined.mesh.iter().skip(n_old).copied());
            pids.extend(joined.mesh.iter().skip(n_old).map(|m| m.and_then(|m| m.0)));
            old.launches.extend(joined.launches);
        }
        old.ranks = n;
        parts(&mut old);
        // every rank is assigned its part of the new launch (none holds one from a replacement)
        old.held = Vec::new();
        old.holds_part = vec![false; n];
        let ready = old.ready(&pids);
        r.live.insert(to, old);
        Ok(ready)
    }

    /// `JobAction::Resize` replacing lost workers: the workers of ranks `lost` (ascending) of launch
    /// `from` are gone, their ranks are taken by joiners (one launch, `joiners`, started now under
    /// `from`'s CA) and launch `to` is `from` again with them. Every other rank is told to cancel the
    /// epoch in flight ([`ToWorker::Abort`]: it closes its mesh, so no wait on a lost peer lasts) and
    /// pauses keeping its process and its part (or, its mesh aborted as it formed, only its state);
    /// the partitioning does not change, so a survivor is sent nothing ([`PartSource::Held`]) and a
    /// joiner is sent the part of its rank (the stored set's file, or cut from the dataset when an
    /// earlier in-place resize made the partitioning). Returns every rank's pid and next mesh address
    /// once all are ready; an error leaves the launches to the job (it stops them and restarts from the
    /// checkpoint).
    fn replace(
        &self,
        r: &mut Running,
        dir: &mut JobDir,
        from: usize,
        to: usize,
        lost: Vec<usize>,
        joiners: Option<crate::job::Joiners>,
    ) -> Result<Vec<(Option<u32>, SocketAddr)>> {
        let j = joiners.context("a replacement names its joiners' launch")?;
        let old = r
            .live
            .get_mut(&from)
            .with_context(|| format!("launch {from} is not running"))?;
        let n = old.ranks;
        ensure!(
            !lost.is_empty()
                && lost.windows(2).all(|w| w[0] < w[1])
                && lost.last().is_some_and(|&r| r < n),
            "workers {lost:?} are not ranks of launch {from}"
        );
        let which = crate::elastic::name_ranks(&lost);
        for (rank, o) in old.outboxes.iter().enumerate() {
            if lost.contains(&rank) {
                continue;
            }
            o.as_ref()
                .with_context(|| {
                    format!("worker {rank} of launch {from} has no control connection")
                })?
                .send(ToWorker::Abort {
                    reason: format!("{which} lost; being replaced"),
                });
        }
        // the lost workers' exits and connections are the old launch's business no more; one that went
        // silent may still run (frozen, or cut off): each is stopped before its rank starts again
        for &rank in &lost {
            let index = old
                .launches
                .iter()
                .rposition(|l| l.ranks.contains(&rank))
                .with_context(|| format!("no launch holds rank {rank}"))?;
            let holder = &mut old.launches[index];
            let at = holder
                .ranks
                .iter()
                .position(|&r| r == rank)
                .expect("found above");
            holder.workers.stop(at)?;
            old.retired.push((holder.segment, rank));
            old.outboxes[rank] = None;
        }
        let pids: Vec<Option<u32>> = old.mesh.iter().map(|m| m.and_then(|m| m.0)).collect();
        for m in old.mesh.iter_mut() {
            *m = None;
        }
        let ca = old.launches[0].ca.clone();
        let l = Launch::start(
            self,
            dir.path(),
            lost.len(),
            j.launch,
            Some((ca, lost.clone())),
        )
        .context("starting the replacement")?;
        let world = lost.last().map_or(0, |r| r + 1);
        r.live
            .insert(j.launch, Live::new(l, world, Vec::new(), String::new()));
        let _ = dir.update(|s| s.launches.push(j.launch as u32));
        // the lost workers' parts, while the replacements start: the stored set's files (served as
        // they are), or, when an earlier resize in place made the partitioning (its parts are deltas),
        // cut from the dataset and served under a name of the new launch
        let t = Instant::now();
        let old = &r.live[&from];
        let mut cut = Vec::new();
        let owner = match (&old.owner, old.part_delta) {
            (Some(owner), true) => Some(owner.clone()),
            _ => None,
        };
        let cut_part = |rank: usize| -> Result<(usize, PathBuf)> {
            let owner = owner
                .as_ref()
                .expect("cut only where the resize made the partitioning");
            let path = self
                .job_abs
                .join("partitions")
                .join(format!("seg{to}"))
                .join(format!("part{rank}.bin"));
            inplace::cut_part(
                self.dataset_path,
                self.spec.train.seed,
                owner,
                n,
                rank,
                &path,
            )?;
            Ok((rank, path))
        };
        let how = match owner {
            Some(_) => {
                for &rank in &lost {
                    cut.push(cut_part(rank)?);
                }
                "cut from the dataset"
            }
            None => "the stored set's",
        };
        r.log.line(&format!(
            "replacing {which} of launch {from}: {} {how} ({:.3} s)",
            match lost.len() {
                1 => "its part is",
                _ => "their parts are",
            },
            t.elapsed().as_secs_f64()
        ));
        // wait for every rank: the survivors' pauses, the replacements' registrations
        let survivors = (0..n).filter(|rank| !lost.contains(rank)).collect();
        self.wait_ready(
            r,
            &[
                (from, survivors, "survivors paused"),
                (j.launch, lost.clone(), "replacements registered"),
            ],
        )?;
        let mut old = r.live.remove(&from).expect("checked above");
        let mut joined = r.live.remove(&j.launch).expect("checked above");
        let mut pids = pids;
        for &rank in &lost {
            old.outboxes[rank] = joined.outboxes[rank].take();
            old.mesh[rank] = joined.mesh[rank];
            pids[rank] = joined.mesh[rank].and_then(|m| m.0);
        }
        old.launches.extend(joined.launches);
        // a survivor whose mesh was aborted as it formed (the lost worker died while the mesh joined)
        // holds no part of this launch: it is served a whole one, cut for it like the lost workers'
        // where the resize made the partitioning (P3 workers hold none and are served none: they read the
        // whole dataset)
        let serves_parts = !old.parts.is_empty();
        let empty: Vec<usize> = (0..n)
            .filter(|&rank| serves_parts && !lost.contains(&rank) && !old.holds_part[rank])
            .collect();
        if !empty.is_empty() {
            let t = Instant::now();
            if owner.is_some() {
                for &rank in &empty {
                    cut.push(cut_part(rank)?);
                }
            }
            r.log.line(&format!(
                "{} held no part (the mesh was aborted as it formed): served {} ({:.3} s)",
                crate::elastic::name_ranks(&empty),
                match owner {
                    Some(_) => "parts cut from the dataset",
                    None => "the stored set's parts",
                },
                t.elapsed().as_secs_f64()
            ));
        }
        old.held = (0..n)
            .map(|rank| !lost.contains(&rank) && !empty.contains(&rank))
            .collect();
        old.holds_part = vec![false; n];
        if !cut.is_empty() {
            // the others' entries are deltas no one is served again (they hold their parts)
            for (rank, path) in cut {
                old.parts[rank] = path;
            }
            old.parts_tag = format!("seg{to}");
            old.part_delta = false;
        }
        let ready = old.ready(&pids);
        r.live.insert(to, old);
        Ok(ready)
    }

    /// Waits, up to `timeouts.register_s`, until every rank of each `(launch, ranks, what)` is ready
    /// (its next mesh address known: a survivor paused, a joiner registered); a worker that exits, loses
    /// its connection or fails meanwhile is an error naming it, as is the timeout (saying which `what`
    /// were not all ready).
    fn wait_ready(&self, r: &mut Running, waits: &[(usize, Vec<usize>, &str)]) -> Result<()> {
        let timeouts = self.spec.timeouts.clone().unwrap_or_default();
        let deadline = Instant::now() + Duration::from_secs_f64(timeouts.register_s);
        loop {
            let ready: Vec<bool> = waits
                .iter()
                .map(|(launch, ranks, _)| {
                    let l = &r.live[launch];
                    ranks
                        .iter()
                        .all(|&rank| l.mesh.get(rank).is_some_and(Option::is_some))
                })
                .collect();
            if ready.iter().all(|&x| x) {
                return Ok(());
            }
            if Instant::now() > deadline {
                let state: Vec<String> = waits
                    .iter()
                    .zip(&ready)
                    .map(|((_, _, what), ok)| format!("{what}: {ok}"))
                    .collect();
                bail!(
                    "not every worker was ready within {} s ({})",
                    timeouts.register_s,
                    state.join(", ")
                );
            }
            for (launch, _, _) in waits {
                let l = r.live.get_mut(launch).expect("checked above");
                let (exits, events) = l.poll(Duration::from_millis(10));
                if let Some((rank, how, _)) = exits.first() {
                    bail!("worker {rank} {how}");
                }
                for ev in events {
                    match worker_event(ev, l, &mut r.log, *launch) {
                        Some(Event::Lost { rank, reason }) => bail!("worker {rank} {reason}"),
                        Some(Event::Failed { rank, error })
                        | Some(Event::PeerLost { rank, error }) => {
                            bail!("worker {rank} failed: {error}")
                        }
                        _ => {}
                    }
                }
            }
        }
    }

    /// The node -> rank assignment a launch trains on.
    fn owner_of(&self, l: &Live) -> Result<Arc<Vec<u32>>> {
        if let Some(owner) = &l.owner {
            return Ok(owner.clone());
        }
        let set = l
            .parts
            .first()
            .and_then(|p| p.parent())
            .context("the launch has no partition set")?;
        let path = set.join("partition.safetensors");
        let (_, p) = physalia_graph::partition::load_partitioning(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        Ok(Arc::new(p.parts))
    }

    /// What making a partitioning for an in-place resize of a launch of `k_old` ranks (node -> rank
    /// `owner`) needs, its deltas served as `part-<tag>-<rank>`.
    fn prepare_input(&self, owner: &Arc<Vec<u32>>, k_old: usize, tag: &str) -> inplace::Input {
        inplace::Input {
            dataset: self.dataset_path.to_path_buf(),
            seed: self.spec.train.seed,
            method: self.partitioner.method.clone(),
            owner: owner.clone(),
            k_old,
            files: self.files.clone(),
            tag: tag.to_string(),
            input_halo: physalia_gnn::device::keeps_input_halo(
                self.cfg,
                exchange_options(self.spec).rematerialize,
            ),
        }
    }

    /// `JobAction::Prepare`: starts making, on threads of their own and one at a time, the
    /// partitionings that an in-place resize of `launch` to any of `sizes` workers would take (at most
    /// three: the most likely, first). What was being made for earlier launches is dropped.
    fn prepare(&self, r: &Running, launch: usize, sizes: &[usize]) -> Result<()> {
        let l = r
            .live
            .get(&launch)
            .with_context(|| format!("launch {launch} is not running"))?;
        let owner = self.owner_of(l)?;
        let mut preparing = self.preparing.borrow_mut();
        preparing.clear();
        // one after the other, in the order given (the most likely first)
        let mut turn = None;
        for &k in sizes.iter().take(3) {
            let tag = prepared_tag(launch, k);
            let dir = self.job_abs.join("partitions").join(&tag);
            let input = self.prepare_input(&owner, l.ranks, &tag);
            let (p, next) = Preparing::start(input, k, dir, turn.take());
            turn = Some(next);
            preparing.push((launch, p));
        }
        Ok(())
    }

    /// Once the most likely resize of a launch is prepared (the first count `JobAction::Prepare` named),
    /// serves its deltas and tells each worker that will apply one to fetch it now, while the job trains
    /// ([`ToWorker::Prefetch`]): the survivors, which fetch it (unless they read this machine's disk) and
    /// apply it to the part they keep beside training, and the joiners started ahead for that count once
    /// they registered, wherever they run (idle, they apply it too). Each delta is offered once.
    fn prefetch_prepared(&self, r: &mut Running) {
        // how each readies the part its delta makes: the engine's graph for the job's layers and the
        // rows of its input halo it holds, under the assignment's settings, when the model keeps them
        let x = exchange_options(self.spec);
        let ready = physalia_control::ReadyAs {
            layer: self.cfg.kind,
            seed: physalia_gnn::device::keeps_input_halo(self.cfg, x.rematerialize).then_some(
                physalia_control::SeedAs {
                    row_normalize: self.spec.dataset.row_normalize,
                    dtype: x.dtype,
                },
            ),
        };
        let mut preparing = self.preparing.borrow_mut();
        let mut prefetched = self.prefetched.borrow_mut();
        let mut seen = std::collections::HashSet::new();
        for (launch, p) in preparing.iter_mut() {
            let (launch, k) = (*launch, p.k);
            // the first preparation of a launch is its likeliest count
            if !seen.insert(launch) {
                continue;
            }
            let Some(made) = p.made() else { continue };
            let tag = prepared_tag(launch, k);
            for (rank, delta) in made.deltas.iter().enumerate() {
                if prefetched.contains(&(launch, k, rank)) {
                    continue;
                }
                // the worker that will apply it: a survivor, or a joiner started ahead (not registered
                // yet: later)
                let survivor = r.live.get(&launch).filter(|l| rank < l.ranks);
                // every worker is told wherever it runs: it applies its delta ahead
                let outbox = match survivor {
                    Some(l) => l.outboxes.get(rank).cloned().flatten(),
                    None => r
                        .live
                        .values()
                        .find(|l| l.joins == Some((launch, k)))
                        .and_then(|l| l.outboxes.get(rank).cloned().flatten()),
                };
                let Some(outbox) = outbox else { continue };
                match self.serve(&format!("part-{tag}-{rank}"), delta) {
                    Ok(artifact) => {
                        r.log.line(&format!(
                            "launch {launch}: rank {rank} fetches {} ({}), its delta for {k} workers, \
                             while the job trains",
                            artifact.name,
                            summary::fmt_bytes(artifact.size)
                        ));
                        outbox.send(ToWorker::Prefetch {
                            artifacts: vec![artifact],
                            ready: Some(ready),
                        });
                    }
                    Err(e) => r.log.line(&format!(
                        "launch {launch}: serving rank {rank}'s delta ahead failed: {e:#}"
                    )),
                }
                prefetched.insert((launch, k, rank));
            }
        }
    }

    /// The preparation of `launch`'s resize to `k` workers, if one was started.
    fn take_prepared(&self, launch: usize, k: usize) -> Option<Preparing> {
        let mut preparing = self.preparing.borrow_mut();
        let i = preparing
            .iter()
            .position(|(l, p)| *l == launch && p.k == k)?;
        Some(preparing.swap_remove(i).1)
    }

    /// `JobAction::Record`: the epoch's line on the terminal and in `metrics.jsonl`, the status's
    /// epoch and bill; the checkpoint before it is no longer needed.
    fn handle_record(
        &self,
        r: &mut Running,
        dir: &mut JobDir,
        epoch: usize,
        by_rank: &[physalia_gnn::EpochMetrics],
        usd: f64,
    ) -> Result<()> {
        self.obs
            .progress(&epoch_line(self.spec.train.epochs as usize, by_rank, usd));
        let line = MetricsLine::coordinated(self.spec.train.seed, by_rank, usd);
        dir.append_metrics(&line)?;
        let bill = r.job.usd_at(Instant::now());
        let _ = dir.update(|s| {
            s.epoch = epoch;
            s.usd = bill;
        });
        if epoch > 1 {
            let _ = std::fs::remove_file(checkpoint_path(&r.checkpoints, epoch - 1));
        }
        Ok(())
    }

    /// Partitions the graph for `n` workers (stored beside the dataset and reused) and starts them.
    fn launch(&self, index: usize, n: usize, mode: TrainMode, dir: &JobDir) -> Result<Live> {
        // P3 splits the features by column and every worker reads the whole dataset: no partitioning
        if mode == TrainMode::Model {
            let launch = Launch::start(self, dir.path(), n, index, None)?;
            return Ok(Live::new(launch, n, Vec::new(), "p3".into()));
        }
        // replica groups keep their k; otherwise the partitioning follows the worker count
        let k = if matches!(self.spec.parallelism, ParallelismSpec::Groups(_)) {
            self.k
        } else {
            n
        };
        let seed = self.spec.train.seed;
        self.fetch_stored_set(k, seed);
        // a chunked dataset's missing set on a platform whose workers read this disk: the assignment
        // here, each part cut by its worker (this process never holds a part)
        if let Some(params) = self.cut_by_workers(k, seed)? {
            let pending = super::step(self.obs, &format!("partitioning into {k} parts"), || {
                physalia_graph::chunked_partition::begin_set_chunked(
                    self.dataset_path,
                    k,
                    seed,
                    &params,
                )
            })
            .with_context(|| {
                format!(
                    "partitioning {} into {k} parts",
                    self.dataset_path.display()
                )
            })?;
            physalia_gnn::heap::release_freed_memory();
            // a new (or resumed) assignment: its cut is served afresh
            self.served_cut.take();
            let launch = Launch::start(self, dir.path(), n, index, None)?;
            let mut live = Live::new(launch, n, pending.part_files.clone(), format!("k{k}"));
            live.pending = Some(pending);
            return Ok(live);
        }
        let parts = self.partition_set(k)?;
        let launch = Launch::start(self, dir.path(), n, index, None)?;
        Ok(Live::new(launch, n, parts, format!("k{k}")))
    }

    /// A set another job computed for the same dataset in the store saves partitioning it again; the
    /// store is a cache: failing to read or write it only costs the time to partition.
    fn fetch_stored_set(&self, k: usize, seed: u64) {
        if let Some(stored) = self.stored_partitions {
            match stored.fetch(self.dataset_path, k, seed) {
                Ok(true) => tracing::info!("partitions for {k} workers from {}", stored.url()),
                Ok(false) => {}
                Err(e) => self.obs.notice(&format!(
                    "warning: reading partitions from {}: {e:#}",
                    stored.url()
                )),
            }
        }
    }

    /// The part files of the dataset file's partition set for `k` parts: the stored one, or made now by
    /// the job's partitioner (and kept).
    fn partition_set(&self, k: usize) -> Result<Vec<PathBuf>> {
        let (seed, method) = (self.spec.train.seed, &self.partitioner.method);
        let sets = super::step(self.obs, &format!("partitioning into {k} parts"), || {
            physalia_graph::partition::ensure_partitions_reusing(
                self.dataset_path,
                &[k],
                seed,
                method,
            )
        })
        .with_context(|| {
            format!(
                "partitioning {} into {k} parts",
                self.dataset_path.display()
            )
        })?;
        let set = sets.into_iter().next().expect("one set per k");
        self.keep_partition(&set);
        // partitioning's buffers are free now; the coordinator holds little while its workers train
        physalia_gnn::heap::release_freed_memory();
        Ok(set.part_files)
    }

    /// The streaming parameters to partition with when the workers cut their own parts: a chunked
    /// dataset and no current set stored. Workers that read this disk read the dataset in place; the
    /// others fetch the chunk files they read ([`Self::serve_cut`]). One part too: it is the whole
    /// graph, which the one worker holds anyway and the coordinator then never does.
    fn cut_by_workers(&self, k: usize, seed: u64) -> Result<Option<StreamParams>> {
        if !physalia_graph::chunked::is_chunked(self.dataset_path) {
            return Ok(None);
        }
        if physalia_graph::partition::current_set(self.dataset_path, k, seed)?.is_some() {
            return Ok(None);
        }
        Ok(Some(match &self.partitioner.method {
            PartitionMethod::Stream(p) => p.clone(),
            PartitionMethod::Metis => StreamParams::refined(k),
        }))
    }

    /// Commits the set a launch's workers cut (they all reported an epoch, so every part is written)
    /// and keeps it ([`Self::keep_partition`]). A commit that fails costs the next job the
    /// partitioning, nothing else: the parts trained on are the workers' own.
    fn commit_cut(&self, pending: &PendingSet, log: &mut CoordLog) {
        // every part is in: no worker hands one back any more
        self.files.expect_no_parts();
        let t0 = Instant::now();
        match pending.commit() {
            Ok(meta) => {
                let set = physalia_graph::partition::PartitionSet {
                    dir: pending.dir.clone(),
                    meta,
                    part_files: pending.part_files.clone(),
                    reused: false,
                    seconds: t0.elapsed().as_secs_f64(),
                };
                log.line(&format!(
                    "partition set {} committed: its {} parts cut by the workers{}",
                    set.dir.display(),
                    set.meta.k,
                    if pending.resumed {
                        " on the assignment an earlier launch made (not partitioned again)"
                    } else {
                        ""
                    }
                ));
                self.keep_partition(&set);
            }
            Err(e) => self.obs.notice(&format!(
                "warning: committing the partitions the workers cut in {}: {e:#} (the next job \
                 partitions again)",
                pending.dir.display()
            )),
        }
    }

    /// A set the launch trains on: a computed one is stored beside the dataset in the store (a cache:
    /// failing costs the next job the partitioning, so it is a warning), and every one is recorded.
    fn keep_partition(&self, set: &physalia_graph::partition::PartitionSet) {
        if let Some(stored) = self.stored_partitions
            && !set.reused
            && let Err(e) = stored.store(set)
        {
            self.obs.notice(&format!(
                "warning: storing partitions beside the dataset at {}: {e:#}",
                stored.url()
            ));
        }
        self.record_partition(set);
    }

    /// Keeps the first set of each part count the job trains on for its summary, and says on the
    /// terminal how a computed one was made.
    fn record_partition(&self, set: &physalia_graph::partition::PartitionSet) {
        let m = &set.meta;
        let mut records = self.partition_records.borrow_mut();
        if records.iter().any(|r| r.parts == m.k) {
            return;
        }
        if !set.reused && m.k > 1 {
            self.obs.progress(&format!(
                "partitioned into {} parts by {}: cut {:.3}, balance {:.3}, {:.1}s ({})",
                m.k,
                m.method,
                m.cut_fraction(),
                m.balance,
                m.compute_seconds,
                self.partitioner.why,
            ));
        }
        records.push(physalia_control::record::PartitionRecord {
            parts: m.k,
            method: m.method.clone(),
            reused: set.reused,
            why: (!set.reused).then(|| self.partitioner.why.clone()),
            edge_cut: m.edge_cut,
            cut_fraction: m.cut_fraction(),
            balance: m.balance,
            partition_seconds: m.partition_seconds,
            compute_seconds: m.compute_seconds,
            bytes_read: m.bytes_read.filter(|_| !set.reused),
        });
    }

    /// Asks the planner again for the job as it runs (`workers` in `mode`, with the exchange the policy set)
    /// under `objective`, from its workers' measurements of the last epoch; the choice's mini-batch settings
    /// are kept for the next launches.
    fn replan(
        &self,
        objective: physalia_policies::Objective,
        workers: usize,
        mode: TrainMode,
        by_rank: &[EpochMetrics],
    ) -> std::result::Result<Replan, String> {
        let mut now = self.spec.clone();
        now.workers = workers as u32;
        now.parallelism = ParallelismSpec::Mode(mode);
        now.minibatch = self.minibatch.borrow().clone();
        now.goal = None;
        let max_workers = self
            .spec
            .scaling
            .as_ref()
            .map_or(now.workers, |p| p.max_workers);
        let (chosen, why) =
            crate::driver::plan::replan(&now, self.dataset_path, objective, by_rank, max_workers)
                .map_err(|e| format!("{e:#}"))?;
        let x = chosen.exchange.clone().unwrap_or_default();
        *self.minibatch.borrow_mut() = chosen.minibatch.clone();
        Ok(Replan {
            workers: chosen.workers as usize,
            mode: chosen.mode(),
            boundary_sampling: x.boundary_sampling,
            staleness: x.staleness,
            why,
        })
    }

    /// What a worker that does not read this disk needs to cut part `part` of the pending `set`: the
    /// dataset's manifest, every chunk file under [`CHUNK_PREFIX`] with the manifest's sizes and
    /// checksums (nothing is read until a worker asks for it), and the assignment, served once per
    /// set and launch; the part the worker hands back is taken into the set at `out`.
    fn serve_cut(
        &self,
        set: &PendingSet,
        part: usize,
        tag: &str,
        out: &Path,
    ) -> Result<physalia_control::ServedCut> {
        self.files.expect_part(part, &std::path::absolute(out)?);
        if let Some((assignment, served)) = &*self.served_cut.borrow()
            && *assignment == set.assignment
        {
            return Ok(served.clone());
        }
        let ds = physalia_graph::ChunkedDataset::open(self.dataset_path)?;
        for (_, tensor) in ds.manifest().tensors.all() {
            for c in &tensor.chunks {
                let xxh3 = u64::from_str_radix(&c.xxh3, 16).with_context(|| {
                    format!(
                        "{}: the checksum of {}",
                        self.dataset_path.display(),
                        c.file
                    )
                })?;
                let name = format!("{CHUNK_PREFIX}{}", c.file);
                let local = self.dataset_path.join(&c.file);
                match self.stored_chunks {
                    // in cluster mode only the structure is here: the rest comes from the store
                    Some(stored) if !local.is_file() => {
                        self.files
                            .serve_from(&name, stored.source(&c.file), c.bytes, xxh3);
                    }
                    _ => {
                        self.files.serve_known(&name, &local, c.bytes, xxh3);
                    }
                }
            }
        }
        let served = physalia_control::ServedCut {
            manifest: self.serve(
                "dataset-manifest",
                &self
                    .dataset_path
                    .join(physalia_graph::chunked::MANIFEST_FILE),
            )?,
            chunk_prefix: CHUNK_PREFIX.to_string(),
            assignment: self.serve(&format!("assignment-{tag}"), &set.assignment)?,
            // signed per rank: `with_direct`
            direct: Default::default(),
            source: match self.stored_chunks {
                Some(stored) => stored.url(),
                None => self.dataset_path.display().to_string(),
            },
        };
        *self.served_cut.borrow_mut() = Some((set.assignment.clone(), served.clone()));
        Ok(served)
    }

    /// `served` with a signed URL of every chunk file part `part`'s worker reads (all of them, or its
    /// share when the workers cut together in a world of `shuffled`), where the dataset is in a store
    /// that signs URLs (cluster mode on S3, Azure or GCS): the worker reads them from the store itself,
    /// and their bytes do not pass through the coordinator. A URL that cannot be signed leaves the relay
    /// (logged).
    fn with_direct(
        &self,
        mut served: physalia_control::ServedCut,
        part: usize,
        shuffled: Option<usize>,
    ) -> physalia_control::ServedCut {
        let Some(stored) = self.stored_chunks else {
            return served;
        };
        let signed = (|| -> Result<_> {
            let ds = physalia_graph::ChunkedDataset::open(self.dataset_path)?;
            let m = ds.manifest();
            let files = match shuffled {
                Some(world) => physalia_graph::chunked_shuffle::chunks_read_by(m, part, world),
                None => m
                    .tensors
                    .all()
                    .into_iter()
                    .flat_map(|(_, t)| &t.chunks)
                    .collect(),
            };
            let mut direct = std::collections::BTreeMap::new();
            // the structure this coordinator downloaded is in the store too: read from there as well
            for c in files {
                match stored.signed_get(&c.file)? {
                    Some(url) => direct.insert(c.file.clone(), url),
                    None => return Ok(Default::default()),
                };
            }
            Ok(direct)
        })();
        match signed {
            Ok(direct) => served.direct = direct,
            Err(e) => tracing::warn!(
                "the workers' chunk files go through the coordinator: no signed URLs ({e:#})"
            ),
        }
        served
    }

    /// Serves `path` under `name` to the job's workers.
    fn serve(&self, name: &str, path: &Path) -> Result<Artifact> {
        self.files
            .serve(name, path)
            .with_context(|| format!("serving {} to the workers", path.display()))
    }

    fn assignment(
        &self,
        rank: usize,
        (parts, parts_tag, pending): (&[PathBuf], &str, Option<&PendingSet>),
        peers: Vec<SocketAddr>,
        resume_epoch: usize,
        mode: TrainMode,
        (boundary_sampling, staleness): (f64, u32),
    ) -> Result<Assignment> {
        let spec = self.spec;
        let timeouts = spec.timeouts.clone().unwrap_or_default();
        let k = parts.len();
        let part_path = || {
            parts
                .get(rank % k.max(1))
                .context("the launch has no part files")
        };
        let part = match pending {
            // P3 splits the features by column, not the graph: no part, and no partitioning made
            _ if mode == TrainMode::Model => PartSource::WholeDataset,
            // the worker cuts its part of the pending set from the dataset (in place, or the chunk
            // files it fetched) and writes it where the set keeps it (or hands it back)
            Some(set) => {
                let part_path = part_path()?;
                // one worker per part: they cut together, each reading its share of the dataset
                let shuffle = k > 1 && peers.len() == k;
                // a worker away from this disk fetches the files it reads and hands its part back
                let served = match platform::of_job(self.job).workers_read_coordinator_disk() {
                    true => None,
                    false => {
                        let served = self.serve_cut(set, rank % k, parts_tag, part_path)?;
                        Some(self.with_direct(served, rank % k, shuffle.then_some(peers.len())))
                    }
                };
                PartSource::Cut(Box::new(PartCut {
                    dataset: std::path::absolute(self.dataset_path)?,
                    assignment: std::path::absolute(&set.assignment)?,
                    part: rank % k,
                    out: std::path::absolute(part_path)?,
                    shuffle,
                    served,
                }))
            }
            None => PartSource::Served(
                self.serve(&format!("part-{parts_tag}-{}", rank % k), part_path()?)?,
            ),
        };
        let partitioning = match mode {
            TrainMode::Data => {
                let set = part_path()?
                    .parent()
                    .context("a part file lies in its set's folder")?;
                Some(self.serve(
                    &format!("partitioning-k{k}"),
                    &set.join("partition.safetensors"),
                )?)
            }
            _ => None,
        };
        let dataset = match mode {
            TrainMode::Data | TrainMode::Model => Some(self.serve("dataset", self.dataset_path)?),
            TrainMode::Partition => None,
        };
        let resume_from = match resume_epoch {
            0 => None,
            e => Some(self.serve(
                &format!("checkpoint-{e:06}"),
                &checkpoint_path(&checkpoints_dir(self.job_abs), e),
            )?),
        };
        Ok(Assignment {
            peers,
            part,
            // set by the launch: whether `part` is a delta to the part the worker held
            part_delta: false,
            partitioning,
            dataset,
            model: self.cfg.clone(),
            train: TrainConfig {
                epochs: spec.train.epochs as usize,
                lr: spec.train.lr as f32,
                weight_decay: spec.train.weight_decay as f32,
                eval_every: spec.train.eval_every as usize,
                patience: spec.train.patience.map(|p| p as usize),
            },
            seed: spec.train.seed,
            exchange: {
                let mut x = exchange_options(spec);
                x.boundary_sampling = boundary_sampling as f32;
                x.staleness_epochs = staleness;
                x
            },
            row_normalize: spec.dataset.row_normalize,
            epoch_timeout_s: timeouts.epoch_s,
            mode,
            // the planner's choice after a replan, else the job file's
            minibatch: self
                .minibatch
                .borrow()
                .clone()
                .unwrap_or_default()
                .options(spec.model.layers)
                .into(),
            resume_from,
            resume_epoch,
            // set by the job's action: whether workers wait for its word after every epoch
            gated: false,
            // rank 0 hands over a checkpoint after every epoch, in every mode: rescales, retries and
            // `submit --resume` start there
            checkpoints: true,
            device: device_request(self.job),
        })
    }
}

/// What each worker trains on: its GPUs (none: the CPU) and whether it may fall back to the CPU.
pub fn device_request(job: &ResolvedJob) -> physalia_control::DeviceRequest {
    physalia_control::DeviceRequest {
        gpus: job.gpu.as_ref().map_or(0, |g| g.count),
        fallback_cpu: job
            .spec
            .resources
            .as_ref()
            .is_some_and(|r| r.gpu_fallback == crate::spec::GpuFallback::Cpu),
    }
}

/// A control server's event as the job sees it (registrations keep the worker's outbox).
/// Ranks at or above the launch's (leavers of an in-place resize, stopping) are not the job's; a
/// worker's pause (an in-place resize, which the driver carries out itself) keeps its next mesh address.
/// The rank of the worker a control server's event is about (none for a refused connection).
fn event_rank(ev: &ServerEvent) -> Option<usize> {
    match ev {
        ServerEvent::Registered { rank, .. }
        | ServerEvent::Alive { rank, .. }
        | ServerEvent::Waiting { rank, .. }
        | ServerEvent::Lost { rank, .. }
        | ServerEvent::Transfer { rank, .. } => Some(*rank),
        // the connection's rank (its certificate's), whatever the message says
        ServerEvent::Message { rank, .. } => Some(*rank),
        ServerEvent::Refused { .. } => None,
    }
}

fn worker_event(ev: ServerEvent, l: &mut Live, log: &mut CoordLog, launch: usize) -> Option<Event> {
    if event_rank(&ev).is_some_and(|r| r >= l.ranks) {
        return None;
    }
    Some(match ev {
        ServerEvent::Registered {
            rank,
            pid,
            mesh_addr,
            outbox,
        } => {
            log.line(&format!(
                "launch {launch}: worker {rank} (pid {pid}) registered, mesh {mesh_addr}"
            ));
            if let Some(slot) = l.outboxes.get_mut(rank) {
                *slot = Some(outbox);
            }
            if let Some(slot) = l.mesh.get_mut(rank) {
                *slot = Some((Some(pid), mesh_addr));
            }
            Event::Registered {
                rank,
                pid,
                mesh_addr,
            }
        }
        ServerEvent::Message {
            rank: from,
            msg: ToCoordinator::Log { level, line, .. },
        } => {
            // named by the connection's certificate, not by what the message claims
            let line = format!("launch {launch}: worker {from}: {level} {line}");
            log.line(&line);
            tracing::info!(target: "physalia::workers", "{line}");
            return None;
        }
        ServerEvent::Message { msg, .. } => match msg {
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
            ToCoordinator::PeerLost { rank, error } => Event::PeerLost { rank, error },
            ToCoordinator::Paused {
                rank,
                mesh_addr,
                holds_part,
            } => {
                log.line(&format!(
                    "launch {launch}: worker {rank} paused, next mesh {mesh_addr}{}",
                    if holds_part { "" } else { " (holding no part)" }
                ));
                if let Some(slot) = l.mesh.get_mut(rank) {
                    *slot = Some((slot.and_then(|s| s.0), mesh_addr));
                }
                if let Some(slot) = l.holds_part.get_mut(rank) {
                    *slot = holds_part;
                }
                return None;
            }
            ToCoordinator::Log { .. } => unreachable!("handled above"),
        },
        ServerEvent::Alive { rank, rtt } => Event::Alive { rank, rtt },
        ServerEvent::Waiting { rank, on, rtt } => Event::Waiting { rank, on, rtt },
        ServerEvent::Lost { rank, reason } => Event::Lost { rank, reason },
        ServerEvent::Refused { addr, reason } => {
            let line = format!("launch {launch}: refused a connection from {addr}: {reason}");
            log.line(&line);
            tracing::info!(target: "physalia::control", "{line}");
            return None;
        }
        ServerEvent::Transfer { rank, error } => {
            // the worker sees the same error and fails with it
            log.line(&format!("launch {launch}: worker {rank}: {error}"));
            return None;
        }
    })
}

/// Stops a launch: finished workers get a bounded moment to exit on their own, the others are told to
/// stop; then every one is killed and reaped, and its control endpoint closed.
fn stop(mut l: Live, reason: &str, finished: bool) {
    if finished {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !l.launches.iter().all(|x| x.workers.all_exited()) && Instant::now() < deadline {
            for x in &mut l.launches {
                x.workers.poll_exits();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    } else {
        for o in l.outboxes.iter().flatten() {
            o.send(ToWorker::Stop {
                reason: reason.to_string(),
            });
        }
    }
    for mut x in l.launches {
        x.workers.kill_all();
        drop(x.server);
    }
}

/// Test hook: `PHYSALIA_TEST_FAIL_RESIZE=R` SIGKILLs rank `R` of the launch being resized in place as
/// the resize begins, so tests see a resize fail part-way and fall back to the checkpoint restart.
pub const ENV_TEST_FAIL_RESIZE: &str = "PHYSALIA_TEST_FAIL_RESIZE";

fn fault_at_resize() -> Option<usize> {
    std::env::var(ENV_TEST_FAIL_RESIZE).ok()?.parse().ok()
}

/// The name of the partitioning for `k` workers prepared while launch `launch` trains (its folder under
/// `partitions/`, its artifacts' `part-<tag>-<rank>`).
fn prepared_tag(launch: usize, k: usize) -> String {
    format!("prep{launch}-k{k}")
}

/// The single-worker epoch line, then: total bytes sent, forward/backward payload bytes per layer summed
/// over workers, the longest halo wait and the longest all-reduce of any worker.
pub fn epoch_line(epochs: usize, by_rank: &[EpochMetrics], usd: f64) -> String {
    let m = &by_rank[0];
    let mut line = summary::epoch_line(1, 0, epochs, m);
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
            format!("L{l} {}/{}", summary::fmt_bytes(f), summary::fmt_bytes(b))
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
        summary::fmt_bytes(sent),
        layers.join(", "),
        halo,
        ar,
        usd
    ));
    line
}

/// Stops every launch a dead coordinator left running and releases the job's platform objects.
pub fn clean_up_after(
    dir: &Path,
    status: &physalia_control::JobStatus,
    obs: &dyn Observer,
) -> Result<()> {
    let spec_path = dir.join("job.json");
    let text = std::fs::read_to_string(&spec_path)
        .with_context(|| format!("{}: cannot read", spec_path.display()))?;
    let spec: JobSpec = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a job record", spec_path.display()))?;
    let job = ResolvedJob::new(spec)
        .with_context(|| format!("{}: the recorded job", spec_path.display()))?;
    let id = jobdir_id(dir);
    let mut failures = Vec::new();
    for &segment in &status.launches {
        let backend = job_backend(&job, dir, segment as usize, obs)?;
        let launch = physalia_backends::LaunchId::new(id.clone(), segment);
        if let Err(e) = crate::driver::workers::block_on(backend.stop_all(&launch))? {
            failures.push(format!("launch {segment}: {e}"));
        }
    }
    let backend = job_backend(&job, dir, 0, obs)?;
    if let Err(e) = crate::driver::workers::block_on(backend.release(&id))? {
        failures.push(format!("releasing the job's platform objects: {e}"));
    }
    if !failures.is_empty() {
        bail!("job {id}: {}", failures.join("; "));
    }
    Ok(())
}
