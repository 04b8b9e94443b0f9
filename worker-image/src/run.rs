//! What the `physalia-worker` process does: read its environment, register with the coordinator, join the
//! mesh, train its partition, report every epoch, and finish.
//!
//! Environment: the contract in [`physalia_control::env`] (set by the backend; certificates and keys are
//! files, never values on the command line).
//!
//! Files: the assignment names artifacts (this worker's partition, the partitioning, the dataset, the
//! checkpoint to resume from), never paths on the coordinator's disk. A worker on the coordinator's machine
//! reads them in place; any other fetches them over its control connection into its work folder
//! ([`physalia_control::env::ENV_WORK_DIR`]). Rank 0 sends the coordinator each epoch's checkpoint before
//! it reports the epoch, and the model before it reports that it is done.
//!
//! Devices: a worker asked for GPUs ([`Assignment::device`]) trains full-graph partitions and data-parallel
//! mini-batches on the CUDA engine (P3 stays on the CPU), on GPU
//! `rank % gpus` of those it sees (workers on one machine share them), or on the CPU when none is usable
//! and the job allows the fallback; every epoch it reports names the device (`cuda:0 (...)`, `cpu
//! (fallback: why)`).
//!
//! Test hooks: with [`ENV_TEST_DIE_AT_EPOCH`]` = E` and [`ENV_TEST_DIE_RANK`]` = R` (or `R1,R2`), rank `R`
//! kills itself with SIGKILL right after finishing epoch `E` (before reporting it), so tests can exercise a
//! worker crashing mid-training (`E = 0`: right after writing the part it cut, the first time it writes
//! it); with [`ENV_TEST_DIE_AT_JOIN`]` = J` instead, rank `R` kills itself as it starts joining its `J`-th
//! mesh (`0`: the first launch's, `1`: the one after its first in-place resize), so its peers are left
//! joining; with [`ENV_TEST_EMULATE_GPU`]` = 1` a GPU worker runs the device path (the GPU's model code and
//! loops) on the CPU device instead of looking for a GPU. Nothing else reads these variables.
//!
//! The worker never outlives its job: when the coordinator says stop, or its control connection ends
//! before training is done, the process exits at once (the coordinator also kills and reaps it).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use physalia_control::env::{
    ENV_TEST_DIE_AT_EPOCH, ENV_TEST_DIE_AT_JOIN, ENV_TEST_DIE_RANK, ENV_TEST_DIE_TOGETHER_DIR,
    ENV_TEST_EMULATE_GPU, ENV_TEST_MEMORY_HEADROOM, WorkerEnv,
};
use physalia_control::{
    Artifact, Assignment, ControlClient, DeviceRequest, PartSource, ReadyAs, ToCoordinator,
    ToWorker, TrainMode, Upload,
};
use physalia_gnn::EpochMetrics;
use physalia_graph::partition::Part;
use physalia_wire::{Link, QuicEndpoint, QuicOptions, TlsIdentity, job_key};

/// How long a worker waits for its assignment after registering, until the coordinator says otherwise
/// (`ToWorker::Wait`: a prewarmed worker waits for the launch that will use it).
const ASSIGNMENT_TIMEOUT: Duration = Duration::from_secs(300);

static DONE: AtomicBool = AtomicBool::new(false);

/// What training needs from the coordinator besides the mesh: its files, a place to keep what rank 0
/// writes, and the per-epoch report. The worker process implements it over its control connection;
/// tests over a folder.
pub trait Coordinator {
    /// `artifact` as a file on this machine, checked against its size and checksum.
    fn artifact(&mut self, artifact: &Artifact) -> Result<PathBuf>;
    /// Hands the file at `path` to the coordinator as `what`; returns once the coordinator stored it.
    fn keep(&mut self, what: Upload, path: &Path) -> Result<()>;
    /// Reports a finished epoch.
    fn epoch(&mut self, metrics: &EpochMetrics) -> Result<()>;
    /// A folder this worker may write.
    fn scratch(&self) -> &Path;
    /// How many artifacts [`Coordinator::artifact`] has read from their signed URLs so far (not
    /// through the coordinator).
    fn fetched_directly(&self) -> u64 {
        0
    }
    /// After reporting an epoch of a gated assignment ([`Assignment::gated`]): whether to go on with the
    /// next epoch or pause there for an in-place resize. Without a coordinator that resizes: go on.
    fn gate(&mut self, epoch: usize) -> Result<Gate> {
        let _ = epoch;
        Ok(Gate::Continue)
    }
    /// Whether the coordinator cancelled the epoch in flight ([`ToWorker::Abort`]: a peer was lost and is
    /// being replaced), waiting up to `wait` for its word; asked when training failed, so that the
    /// failure it caused (the mesh closed under the epoch, or the lost peer's connection ending first)
    /// pauses the worker instead of ending it. Without a coordinator that replaces: no.
    fn aborted(&mut self, wait: Duration) -> bool {
        let _ = wait;
        false
    }
    /// The part a gated worker trains on and keeps for its next resize: a delta sent ahead is applied to
    /// it beside training and the part it makes readied as `ready` says. Without a coordinator that
    /// resizes: nothing.
    fn kept_part(&mut self, part: &Arc<Part>, ready: ReadyAs) {
        let _ = (part, ready);
    }
}

/// What the coordinator says at the end of a gated epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Train the next epoch.
    Continue,
    /// Stop here keeping the training state: the job is resized in place.
    Pause,
}

/// How a stretch of training under one assignment ended.
pub enum Segment {
    /// Every epoch trained (or early stopping ended training): the summary (rank 0 handed over the model).
    Done(physalia_gnn::TrainSummary),
    /// Paused after an epoch at the coordinator's word, holding the training state to continue from in
    /// memory under the next assignment.
    Paused(Box<Held>),
}

/// What a paused worker keeps for its next assignment: the training state (none when the epoch in flight
/// was aborted: the state is then between epochs no longer recorded, and the checkpoint is read), and
/// the part it trained on (the rows it holds), to which the next assignment's part delta applies.
pub struct Held {
    pub state: Option<crate::Resume>,
    /// Shared with a delta applied to it ahead ([`Applied::from`]).
    pub part: Option<Arc<Part>>,
    /// The next assignment's part delta, applied ahead ([`ToWorker::Prefetch`]): by a joiner started
    /// ahead while it waited, by a survivor beside training. An assignment naming that delta trains on
    /// its part as it is.
    pub applied: Option<Applied>,
}

/// A part delta applied ahead: the artifact it was served as (name, checksum), the part it makes, the
/// rows of its input halo it carried, and the part it was applied to (`None`: a joiner's, applied to
/// nothing), which must be the part held when the assignment comes; with the rows of the new input halo
/// the part applied to and the carried rows hold, gathered under the settings named, and the engine's
/// graph of the part for the layers named ([`crate::local_graph`]), as [`ReadyAs`] asked.
pub struct Applied {
    pub artifact: (String, u64),
    pub part: Part,
    pub halo_rows: crate::delta::HaloRows,
    pub from: Option<Arc<Part>>,
    pub seed: Option<(crate::seed::SeedAs, crate::seed::SeedAhead)>,
    pub graph: Option<(physalia_gnn::LayerKind, physalia_gnn::LocalGraph)>,
}

impl Applied {
    /// Whether this is what assignment `a`'s part delta makes of `held` (the part held now).
    fn is_for(&self, a: &Assignment, held: Option<&Arc<Part>>) -> bool {
        let same_from = match (&self.from, held) {
            (None, None) => true,
            (Some(x), Some(y)) => Arc::ptr_eq(x, y),
            _ => false,
        };
        same_from && is_delta_of(a, &self.artifact)
    }
}

/// Whether `artifact` (name, checksum) is assignment `a`'s part delta.
fn is_delta_of(a: &Assignment, (name, xxh3): &(String, u64)) -> bool {
    match &a.part {
        PartSource::Served(art) => a.part_delta && art.name == *name && art.xxh3 == *xxh3,
        _ => false,
    }
}

/// What a gated worker shares with the thread reading the coordinator's words: the part it trains on
/// and keeps for the next resize, and the next resize's part delta being applied to it beside training
/// (the artifact's name and checksum with the thread applying it).
#[derive(Default)]
struct Ahead {
    kept: Mutex<Option<(Arc<Part>, ReadyAs)>>,
    #[allow(clippy::type_complexity)]
    applying: Mutex<Option<((String, u64), std::thread::JoinHandle<Option<Applied>>)>>,
}

impl Ahead {
    /// The delta applied ahead if it is what `a`'s part delta makes of `held` (waiting for the thread
    /// applying it); one applied for another assignment is dropped.
    fn take_for(&self, a: &Assignment, held: Option<&Arc<Part>>) -> Option<Applied> {
        let (artifact, handle) = self
            .applying
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        // another assignment's: the thread ends by itself, its part dropped
        let applied = is_delta_of(a, &artifact)
            .then(|| handle.join().ok().flatten())
            .flatten()?;
        applied.is_for(a, held).then_some(applied)
    }
}

/// Reads `ca.pem`, `cert.pem` and `key.pem` from `dir`.
pub fn read_identity(dir: &Path) -> Result<TlsIdentity> {
    let read = |f: &str| {
        let p = dir.join(f);
        std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))
    };
    Ok(TlsIdentity {
        ca_pem: read("ca.pem")?,
        cert_pem: read("cert.pem")?,
        key_pem: read("key.pem")?,
    })
}

pub(crate) fn test_die_at(rank: usize) -> Option<usize> {
    let epoch = std::env::var(ENV_TEST_DIE_AT_EPOCH).ok()?.parse().ok()?;
    test_die_ranks().contains(&rank).then_some(epoch)
}

/// The mesh join (counted from 0 for this process) at whose start the test hook kills rank `rank`.
fn test_die_at_join(rank: usize) -> Option<usize> {
    let join = std::env::var(ENV_TEST_DIE_AT_JOIN).ok()?.parse().ok()?;
    test_die_ranks().contains(&rank).then_some(join)
}

fn test_die_ranks() -> Vec<usize> {
    std::env::var(ENV_TEST_DIE_RANK)
        .unwrap_or_default()
        .split(',')
        .filter_map(|r| r.trim().parse().ok())
        .collect()
}

/// The test hook's death: SIGKILL, alone or (with [`ENV_TEST_DIE_TOGETHER_DIR`]) with the other ranks
/// listed, all killed by the last of them to arrive.
pub(crate) fn test_die(rank: usize) -> ! {
    let kill = |pid: i32| {
        // SAFETY: kill(2) has no memory effects.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    };
    if let Some(dir) = std::env::var_os(ENV_TEST_DIE_TOGETHER_DIR) {
        let dir = PathBuf::from(dir);
        let ranks = test_die_ranks();
        let tmp = dir.join(format!("{rank}.tmp"));
        if std::fs::write(&tmp, std::process::id().to_string()).is_ok()
            && std::fs::rename(&tmp, dir.join(format!("{rank}.pid"))).is_ok()
        {
            for _ in 0..60_000 {
                let pids: Vec<i32> = ranks
                    .iter()
                    .filter_map(|r| {
                        std::fs::read_to_string(dir.join(format!("{r}.pid")))
                            .ok()?
                            .parse()
                            .ok()
                    })
                    .collect();
                if pids.len() == ranks.len() {
                    pids.into_iter().for_each(kill);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    // SAFETY: getpid(2) has no memory effects.
    kill(unsafe { libc::getpid() });
    // the signal ends the process on its way back from kill(2)
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Peak resident set size of this process (Linux `VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The training state the assignment resumes from (`resume_from`), loaded; `None` when it starts afresh.
fn load_resume(a: &Assignment, io: &mut dyn Coordinator) -> Result<Option<crate::Resume>> {
    let Some(artifact) = &a.resume_from else {
        return Ok(None);
    };
    let path = io.artifact(artifact)?;
    let (model, opt, progress) = physalia_gnn::save::load_checkpoint(&path)
        .with_context(|| format!("resuming from {}", path.display()))?;
    Ok(Some(crate::Resume {
        model,
        opt,
        progress,
    }))
}

/// What every mode does after an epoch: when `checkpoint` (rank 0 of a job that keeps checkpoints), write
/// the epoch's checkpoint, hand it to the coordinator and delete the local copy, before the epoch is
/// reported (so every reported epoch has one); then report the epoch. Returns whether training goes on:
/// the first failure is kept in `failed` and stops it.
///
/// A gated epoch (all but the last of a gated assignment) then waits for the coordinator's word: a pause
/// stops training here (`paused`) with the state ready to continue from.
fn end_epoch(
    io: &mut dyn Coordinator,
    checkpoint: bool,
    e: &physalia_gnn::EpochEnd<'_>,
    device: Option<&str>,
    gated: Option<usize>,
    paused: &mut bool,
    failed: &mut Option<anyhow::Error>,
) -> bool {
    if checkpoint {
        let epoch = e.metrics.epoch;
        let path = physalia_control::checkpoint_path(io.scratch(), epoch);
        let kept = physalia_gnn::save::save_checkpoint(e.model, e.opt, e.progress, &path)
            .with_context(|| format!("writing {}", path.display()))
            .and_then(|()| io.keep(Upload::Checkpoint { epoch }, &path));
        let _ = std::fs::remove_file(&path);
        if let Err(err) = kept {
            failed.get_or_insert(err.context("keeping a checkpoint"));
            return false;
        }
    }
    let labelled;
    let metrics = match device {
        Some(d) => {
            let mut m = e.metrics.clone();
            m.device = Some(d.to_string());
            labelled = m;
            &labelled
        }
        None => e.metrics,
    };
    if let Err(err) = io.epoch(metrics) {
        failed.get_or_insert(err.context("reporting an epoch"));
        return false;
    }
    match gated {
        Some(last) if e.metrics.epoch < last => match io.gate(e.metrics.epoch) {
            Ok(Gate::Continue) => true,
            Ok(Gate::Pause) => {
                *paused = true;
                false
            }
            Err(err) => {
                failed.get_or_insert(err.context("waiting for the coordinator after an epoch"));
                false
            }
        },
        _ => true,
    }
}

/// The state an assignment trains from: the one `held` when the worker paused at the epoch the assignment
/// continues after (exact; its cached `A X` and halo rows were the old part's, so they go), else the
/// assignment's checkpoint (or a fresh start).
fn resume_in_place(
    a: &Assignment,
    held: Option<crate::Resume>,
    io: &mut dyn Coordinator,
    rank: usize,
    on: &str,
) -> Result<Option<crate::Resume>> {
    match held {
        Some(mut h) if a.resume_epoch > 0 && h.progress.epoch == a.resume_epoch => {
            h.model.clear_cache();
            eprintln!(
                "worker {rank}: continuing in place after epoch {} (model, optimizer and progress \
                 held in memory), on {on}",
                a.resume_epoch
            );
            Ok(Some(h))
        }
        _ => load_resume(a, io),
    }
}

/// How a stretch of training ended (`gated`: the worker may be paused; `keep`: the part it holds, if any):
/// `Ok` with the state and summary when it trained to its end; `Err` with the pause when the coordinator
/// paused it after an epoch (the state kept too) or cancelled the epoch in flight (a peer was lost and
/// the mesh was closed under it: only the part is kept, and the next assignment reads the last recorded
/// epoch's checkpoint; a peer's fault may be seen before the coordinator's word, so it is waited for a
/// while). Any other failure is the error.
#[allow(clippy::type_complexity)]
fn ended(
    io: &mut dyn Coordinator,
    rank: usize,
    trained: Result<(crate::Resume, physalia_gnn::TrainSummary)>,
    failed: Option<anyhow::Error>,
    paused: bool,
    gated: bool,
    keep: Option<Arc<Part>>,
) -> Result<std::result::Result<(crate::Resume, physalia_gnn::TrainSummary), Segment>> {
    let pause = |state, part| {
        Segment::Paused(Box::new(Held {
            state,
            part,
            applied: None,
        }))
    };
    let (state, summary) = match trained {
        Ok(done) => done,
        Err(e) if gated && io.aborted(abort_wait(&e)) => {
            eprintln!("worker {rank}: the epoch in flight was cancelled (a peer was lost): {e:#}");
            return Ok(Err(pause(None, keep)));
        }
        Err(e) => return Err(e),
    };
    if let Some(e) = failed {
        if gated && io.aborted(abort_wait(&e)) {
            return Ok(Err(pause(None, keep)));
        }
        return Err(e);
    }
    if paused {
        return Ok(Err(pause(Some(state), keep)));
    }
    Ok(Ok((state, summary)))
}

/// The device a worker of `rank` trains on for `req`, and the label its epochs carry (`None`: the CPU, as
/// asked). A GPU that cannot be used is an error naming what is missing, or the CPU when the job allows it.
pub fn choose_device(req: &DeviceRequest, rank: usize) -> Result<(crate::Device, Option<String>)> {
    use physalia_gnn_cuda::{DevicePreference, Selected};
    if req.gpus == 0 {
        return Ok((crate::Device::Cpu, None));
    }
    if std::env::var_os(ENV_TEST_EMULATE_GPU).is_some_and(|v| v == "1") {
        return Ok((
            crate::Device::Emulated,
            Some("emulated GPU (test hook)".into()),
        ));
    }
    let pref = DevicePreference::for_worker(req.gpus, None, rank, req.fallback_cpu);
    let selected = physalia_gnn_cuda::select(pref, 0).map_err(|e| {
        anyhow::anyhow!(
            "resources.gpu: worker {rank} found no usable GPU: {e} (or set `resources.gpu_fallback: cpu` \
             to train on the CPU instead)"
        )
    })?;
    // the worker's log has the whole story; epoch lines carry a short label
    eprintln!("worker {rank}: device {}", selected.describe());
    Ok(match selected {
        Selected::Cuda { device, .. } => (
            crate::Device::Cuda {
                index: device.index,
            },
            Some(format!("cuda:{} ({})", device.index, device.name)),
        ),
        Selected::Cpu { fallback } => (
            crate::Device::Cpu,
            Some(match fallback {
                Some(why) => format!("cpu (fallback: {})", short_reason(&why.to_string())),
                None => "cpu".into(),
            }),
        ),
    })
}

/// The head of an error message: up to its first `:` or ` (` (`no CUDA driver`, `no CUDA device 1`).
fn short_reason(text: &str) -> &str {
    let end = [text.find(':'), text.find(" (")]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(text.len());
    &text[..end]
}

/// Trains what the coordinator assigned, in the assigned mode; rank 0 hands the coordinator each epoch's
/// checkpoint (when asked) and the model. Every mode resumes from `resume_from` when the assignment names
/// one.
pub fn train_assigned<L: physalia_wire::Link + ?Sized>(
    link: &mut L,
    a: &Assignment,
    io: &mut dyn Coordinator,
) -> Result<physalia_gnn::TrainSummary> {
    match train_segment(link, a, io, None)? {
        Segment::Done(summary) => Ok(summary),
        Segment::Paused(_) => bail!(
            "the coordinator paused training after an epoch, and this caller cannot continue in place"
        ),
    }
}

/// [`train_assigned`] for a worker that may pause and continue in place: `held` is the training state it
/// paused with (used when it is the state of [`Assignment::resume_epoch`]; the checkpoint is then never
/// read) and the part it trained on (an assignment's part delta applies to it). A gated worker (any mode)
/// pauses at an epoch's end when the coordinator says so, or with the epoch in flight cancelled when a
/// peer was lost.
pub fn train_segment<L: physalia_wire::Link + ?Sized>(
    link: &mut L,
    a: &Assignment,
    io: &mut dyn Coordinator,
    held: Option<Held>,
) -> Result<Segment> {
    use crate::minibatch::{ColumnShard, ShardData, column_features, column_slice};
    use physalia_graph::{Dataset, Split};
    let rank = link.rank();
    // the setup before the first epoch (the part loaded or rebuilt, the engine built) is what an
    // in-place resize's pause holds beside the mesh join: logged with the first epoch
    let t_setup = Instant::now();
    let mut first_epoch = true;
    let mut setup_line = |m: &EpochMetrics| {
        if std::mem::take(&mut first_epoch) {
            let setup = t_setup.elapsed().as_secs_f64() - m.train_s - m.eval_s;
            let engine = match m.prepare_s {
                Some(p) => format!(
                    "; of which {p:.3} s in the engine before it: the training rows counted with the \
                     peers, the first layer's constant input (its A X, or the features' halo rows) prepared"
                ),
                None => String::new(),
            };
            eprintln!(
                "worker {rank}: set up for this assignment in {setup:.3} s (before epoch {}{engine})",
                m.epoch
            );
        }
    };
    let dataset = |io: &mut dyn Coordinator| -> Result<Dataset> {
        let artifact = a
            .dataset
            .as_ref()
            .context("the assignment names no dataset (needed for data and model parallelism)")?;
        let path = io.artifact(artifact)?;
        Dataset::open(&path).with_context(|| format!("opening {}", path.display()))
    };
    // rank 0 writes the checkpoints; every rank reports its epochs
    let checkpoint = rank == 0 && a.checkpoints;
    let mut failed = None;
    let ids = |ds: &Dataset, s: Split| ds.split(s).iter().map(|&i| i as u32).collect::<Vec<u32>>();
    let options = || a.minibatch.clone().unwrap_or_default();
    // a served part is fetched (or read in place); a part to cut is cut from the dataset when needed
    // the part this assignment's delta makes may be held, applied ahead (by a joiner while it waited, by
    // a survivor beside training); one made from another delta, or of another part, is no part of this
    // assignment's
    let preapplied = held
        .as_ref()
        .and_then(|h| h.applied.as_ref().map(|ap| ap.is_for(a, h.part.as_ref())))
        .unwrap_or(false);
    let (part_path, part_bytes) = match &a.part {
        PartSource::Served(art) if preapplied => (None, art.size),
        PartSource::Served(art) => (Some(io.artifact(art)?), art.size),
        PartSource::Cut(_) | PartSource::Held | PartSource::WholeDataset => (None, 0),
    };
    let load_part = |link: &mut L, io: &mut dyn Coordinator| -> Result<Part> {
        match (&a.part, &part_path) {
            (_, Some(path)) => {
                Part::load(path).with_context(|| format!("loading {}", path.display()))
            }
            (PartSource::Cut(c), None) => crate::cut::cut(link, io, c),
            (PartSource::Served(_), None) => unreachable!("a served part was fetched above"),
            (PartSource::Held, None) => {
                bail!(
                    "the assignment keeps the part this worker holds, which only partition parallelism does"
                )
            }
            (PartSource::WholeDataset, None) => {
                bail!("the assignment serves no part (model parallelism reads the whole dataset)")
            }
        }
    };
    let served_path = || {
        part_path
            .as_deref()
            .context("this assignment's part is to be cut, which only partition parallelism does")
    };
    // GPU workers train full-graph and data-parallel mini-batches; P3 runs on the CPU (the job file's
    // validation says so)
    let (device, label) = match a.mode {
        TrainMode::Partition | TrainMode::Data => choose_device(&a.device, rank)?,
        _ if a.device.gpus > 0 && a.device.fallback_cpu => (
            crate::Device::Cpu,
            Some("cpu (fallback: P3 trains on the CPU)".to_string()),
        ),
        _ if a.device.gpus > 0 => bail!(
            "resources.gpu: GPU workers train full-graph and data-parallel mini-batches; this assignment \
             is model (P3) parallelism"
        ),
        _ => (crate::Device::Cpu, None),
    };
    let label = label.as_deref();
    if let Some(l) = label {
        eprintln!("worker {rank}: training on {l}");
    }
    // every mode resizes in place: a gated worker waits for the coordinator's word after each epoch
    let gated = a.gated.then_some(a.train.epochs);
    let mut paused = false;
    let (mut held, mut held_part, applied) = match held {
        Some(h) => (h.state, h.part, h.applied),
        None => (None, None, None),
    };
    // the part its delta made ahead, the rows of the input halo the delta carried (read with it) and
    // those it held gathered ahead
    let (mut applied_part, mut carried, seed_ahead, graph_ahead) =
        match applied.filter(|_| preapplied) {
            Some(ap) => (Some(ap.part), Some(ap.halo_rows), ap.seed, ap.graph),
            None => (None, None, None, None),
        };
    // its engine graph built ahead, for these layers
    let graph_ahead = graph_ahead
        .filter(|(layer, _)| *layer == a.model.kind)
        .map(|(_, g)| g);
    // what the epochs trained, and the part a gated worker keeps for the next assignment
    let (trained, keep): (
        Result<(crate::Resume, physalia_gnn::TrainSummary)>,
        Option<Arc<Part>>,
    ) = match a.mode {
        TrainMode::Partition => {
            // the old model's kept input halo, in the held part's halo order (the state continues
            // without it: its rows seed the new part's halo below)
            let kept_halo = held.as_mut().and_then(|h| h.model.take_input_halo());
            let part = match (&a.part, a.part_delta) {
                // a lost peer replaced: this worker trains on the part it holds
                (PartSource::Held, _) => {
                    let part = held_part.take().map(Arc::unwrap_or_clone).context(
                        "the assignment keeps the part this worker holds, and it holds none",
                    )?;
                    eprintln!(
                        "worker {rank}: keeps part {} of {} ({} rows) for the next assignment",
                        part.part,
                        part.k,
                        part.owned.len()
                    );
                    part
                }
                // its delta applied ahead (a joiner's while it waited, a survivor's beside training)
                (_, true) if preapplied => {
                    let part = applied_part
                        .take()
                        .context("the applied delta's part is held")?;
                    eprintln!(
                        "worker {rank}: part {} of {} ({} rows) made from its delta ahead",
                        part.part,
                        part.k,
                        part.owned.len()
                    );
                    part
                }
                // an in-place resize: the rows this worker holds stay, the delta brings the rest
                (_, true) => {
                    let t = Instant::now();
                    let delta = crate::delta::PartDelta::read(served_path()?)?;
                    let part = crate::delta::apply(held_part.as_deref(), &delta)?;
                    carried = Some(delta.halo_rows()?);
                    eprintln!(
                        "worker {rank}: part {} of {} from the {} rows held and a delta of {} bytes ({} rows \
                         gained, {} given up) in {:.3} s",
                        part.part,
                        part.k,
                        held_part.as_ref().map_or(0, |p| p.owned.len()),
                        part_bytes,
                        delta.gained.len(),
                        delta.lost.len(),
                        t.elapsed().as_secs_f64()
                    );
                    part
                }
                (_, false) => load_part(link, io)?,
            };
            let on = format!("part {} of {}", part.part, part.k);
            let mut resume = resume_in_place(a, held, io, rank, &on)?;
            // the rows of the new part's input halo this worker holds (the old part's rows and its
            // halo's), when the model keeps one: only the others are fetched
            let old = match (&held_part, &a.part) {
                (Some(old), _) => Some(&**old),
                (None, PartSource::Held) => Some(&part),
                (None, _) => None,
            };
            // and those its delta carried (a joiner's whole input halo)
            let carried = carried.take().filter(|c| !c.ids.is_empty());
            let seed_as = crate::seed::SeedAs {
                row_normalize: a.row_normalize,
                dtype: a.exchange.dtype,
            };
            // the rows its old part and its delta carried, gathered ahead under these settings (a
            // survivor's beside training, a joiner's while it waited)
            let seed_ahead = seed_ahead
                .filter(|(s, _)| *s == seed_as)
                .map(|(_, seed)| seed);
            let mut raw: Vec<crate::seed::RawRows<'_>> = Vec::new();
            if seed_ahead.is_none() {
                raw.extend(old.map(crate::seed::RawRows::owned));
                raw.extend(
                    carried
                        .as_ref()
                        .map(|c| crate::seed::RawRows::carried(c, part.feat_dim)),
                );
            }
            // the old model's halo rows, in the held part's halo order (ready as the wire delivers them)
            let old_halo = held_part
                .as_ref()
                .zip(kept_halo.as_ref())
                .map(|(o, h)| (&o.halo[..], h));
            // a model with peers that keeps its input halo fetches one (alone it has no halo)
            let keeps_halo =
                physalia_gnn::device::keeps_input_halo(&a.model, a.exchange.rematerialize);
            let keeps = keeps_halo && a.peers.len() > 1;
            let holds_some = !raw.is_empty() || seed_ahead.is_some() || old_halo.is_some();
            if let (Some(r), true, true) = (resume.as_mut(), holds_some, keeps) {
                let t = Instant::now();
                let ahead = seed_ahead.as_ref().map_or(0, |s| s.gathered());
                let seed = match seed_ahead {
                    // gathered ahead: the old model's halo rows filled into the room left for them
                    Some(seed) => seed.complete(old_halo),
                    None => crate::seed::input_halo_seed(
                        &part,
                        &raw,
                        old_halo,
                        a.row_normalize,
                        a.exchange.dtype,
                    ),
                };
                eprintln!(
                    "worker {rank}: holds {} of the {} rows of its input halo ({} carried by its delta; \
                     gathered in {:.3} s, {ahead} of them ahead)",
                    seed.len(),
                    part.halo.len(),
                    carried.as_ref().map_or(0, |c| c.ids.len()),
                    t.elapsed().as_secs_f64()
                );
                r.model.seed_input_halo(seed);
            }
            drop(raw);
            drop(carried);
            drop(kept_halo);
            drop(held_part);
            // a gated worker may be resized in place: it keeps the rows it trains on for the next delta
            // (applied to them beside training when it is sent ahead)
            let t_keep = Instant::now();
            let keep = gated.map(|_| Arc::new(part.clone()));
            if let Some(k) = &keep {
                let ready = ReadyAs {
                    layer: a.model.kind,
                    seed: keeps_halo.then_some(seed_as),
                };
                io.kept_part(k, ready);
                eprintln!(
                    "worker {rank}: kept a copy of its part for the next resize in {:.3} s",
                    t_keep.elapsed().as_secs_f64()
                );
            }
            let trained = crate::train_owned_part_state(
                device,
                link,
                part,
                graph_ahead,
                &a.model,
                a.seed,
                &a.train,
                &a.exchange,
                a.row_normalize,
                resume,
                &mut |e| {
                    setup_line(e.metrics);
                    end_epoch(io, checkpoint, e, label, gated, &mut paused, &mut failed)
                },
            );
            (trained.map_err(Into::into), keep)
        }
        TrainMode::Data => {
            let map = a
                .partitioning
                .as_ref()
                .context("a data-parallel assignment names the partitioning")?;
            let map_path = io.artifact(map)?;
            let (_, partitioning) = physalia_graph::partition::load_partitioning(&map_path)?;
            let ds = dataset(io)?;
            let part = match &a.part {
                // a lost peer replaced: this worker samples from the part it holds (checked when loaded)
                PartSource::Held => held_part.take().map(Arc::unwrap_or_clone).context(
                    "the assignment keeps the part this worker holds, and it holds none",
                )?,
                _ => {
                    let part_path = served_path()?;
                    let part = load_part(link, io)?;
                    physalia_graph::partition::check_part_matches_dataset(
                        &part,
                        part_path,
                        Some((&partitioning, &map_path)),
                        &ds,
                    )?;
                    part
                }
            };
            drop(held_part);
            // every replica holds the same model: a survivor's is exact
            let on = format!("part {} of {}", part.part, part.k);
            let resume = resume_in_place(a, held, io, rank, &on)?;
            let trained = {
                let csr = ds.csr();
                let (replicas, replica) = crate::replica_of(&part, link.rank(), link.world())?;
                let data = ShardData::from_part(
                    &part,
                    &partitioning.parts,
                    &ids(&ds, Split::Train),
                    &a.model,
                    a.row_normalize,
                    replicas,
                    replica,
                );
                let shard = data.shard(csr.indptr, csr.indices);
                let mut mesh = crate::MeshExchange::new(link, &part, a.exchange.clone());
                crate::minibatch::train_minibatch_on(
                    device,
                    &mut mesh,
                    &shard,
                    &a.model,
                    a.seed,
                    &a.train,
                    &options(),
                    resume,
                    &mut |e| {
                        setup_line(e.metrics);
                        end_epoch(io, checkpoint, e, label, gated, &mut paused, &mut failed)
                    },
                )
            };
            let keep = gated.map(|_| Arc::new(part));
            (trained.map_err(Into::into), keep)
        }
        TrainMode::Model => {
            let ds = dataset(io)?;
            let d = ds.meta().feat_dim;
            let cols = column_slice(d, link.world(), link.rank());
            let on = format!("feature columns {cols:?} of {d}");
            let x_cols = column_features(ds.features(), d, cols.clone(), a.row_normalize);
            let sets = physalia_gnn::NodeSets {
                labels: ds.labels().to_vec(),
                train: ids(&ds, Split::Train),
                val: ids(&ds, Split::Val),
                test: ids(&ds, Split::Test),
            };
            let csr = ds.csr();
            let shard = ColumnShard {
                indptr: csr.indptr,
                indices: csr.indices,
                x_cols: &x_cols,
                cols,
                sets: &sets,
            };
            // every rank ends an epoch with the whole model and optimizer state (the first layer
            // gathered), so a survivor's is exact; the checkpoint holds it too. Each worker trains its
            // columns' rows of the first layer.
            drop(held_part);
            let resume = resume_in_place(a, held, io, rank, &on)?;
            let trained = crate::minibatch::train_p3(
                link,
                &shard,
                &a.model,
                a.seed,
                &a.train,
                &options(),
                resume,
                &mut |e| end_epoch(io, checkpoint, e, label, gated, &mut paused, &mut failed),
            );
            (trained.map_err(Into::into), None)
        }
    };
    let (model, mut summary) =
        match ended(io, rank, trained, failed, paused, gated.is_some(), keep)? {
            Ok((state, summary)) => (state.model, summary),
            Err(paused) => return Ok(paused),
        };
    for m in &mut summary.epochs {
        m.device = label.map(str::to_string);
    }
    if rank == 0 {
        let path = io.scratch().join("model.safetensors");
        physalia_gnn::save::save_model(&model, &path, &[("seed", a.seed.to_string())])
            .with_context(|| format!("saving the model to {}", path.display()))?;
        let kept = io.keep(Upload::Model, &path);
        let _ = std::fs::remove_file(&path);
        kept.context("handing the model to the coordinator")?;
    }
    Ok(Segment::Done(summary))
}

/// The worker process's [`Coordinator`]: its control connection and work folder.
struct ControlIo<'a> {
    control: &'a mut ControlClient,
    /// Where the part kept for the next resize is shared with the thread that applies a delta ahead.
    ahead: &'a Ahead,
    work: PathBuf,
    rank: usize,
    die_at: Option<usize>,
    /// What the coordinator says after a gated epoch (and the assignments that follow a pause), passed on
    /// by the thread that reads the control stream.
    words: &'a mpsc::Receiver<ToWorker>,
    /// How long to wait for the coordinator's word after a gated epoch.
    gate_timeout: Duration,
}

impl Coordinator for ControlIo<'_> {
    fn artifact(&mut self, artifact: &Artifact) -> Result<PathBuf> {
        Ok(self.control.fetch(artifact, &self.work)?)
    }

    fn kept_part(&mut self, part: &Arc<Part>, ready: ReadyAs) {
        *self.ahead.kept.lock().unwrap_or_else(|e| e.into_inner()) = Some((part.clone(), ready));
    }

    fn keep(&mut self, what: Upload, path: &Path) -> Result<()> {
        Ok(self.control.upload(what, path)?)
    }

    fn epoch(&mut self, m: &EpochMetrics) -> Result<()> {
        if self.die_at == Some(m.epoch) {
            eprintln!(
                "worker {}: test hook: killing myself after epoch {}",
                self.rank, m.epoch
            );
            test_die(self.rank);
        }
        Ok(self.control.send(&ToCoordinator::Epoch {
            rank: self.rank,
            metrics: m.clone(),
        })?)
    }

    fn scratch(&self) -> &Path {
        &self.work
    }

    fn fetched_directly(&self) -> u64 {
        self.control.fetched_directly().0
    }

    fn aborted(&mut self, wait: Duration) -> bool {
        aborted(self.words, self.rank, wait)
    }

    fn gate(&mut self, epoch: usize) -> Result<Gate> {
        match self.words.recv_timeout(self.gate_timeout) {
            Ok(ToWorker::Continue) => Ok(Gate::Continue),
            // a peer was lost after this epoch: pause holding the state (the coordinator continues
            // from the last epoch every worker reported, which may be the one before)
            Ok(ToWorker::Pause) | Ok(ToWorker::Abort { .. }) => Ok(Gate::Pause),
            Ok(other) => {
                bail!("after epoch {epoch} the coordinator sent {other:?}, not continue or pause")
            }
            Err(_) => bail!(
                "the coordinator said neither continue nor pause within {:?} after epoch {epoch}",
                self.gate_timeout
            ),
        }
    }
}

/// Whether the coordinator's words (`words`) cancel what this worker is doing ([`ToWorker::Abort`]: a
/// peer was lost and is being replaced), waiting up to `wait` for it; other words are logged and dropped.
fn aborted(words: &mpsc::Receiver<ToWorker>, rank: usize, wait: Duration) -> bool {
    let deadline = Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(word) = words.recv_timeout(left) else {
            return false;
        };
        match word {
            ToWorker::Abort { reason } => {
                eprintln!("worker {rank}: the coordinator cancelled the epoch: {reason}");
                return true;
            }
            other => eprintln!(
                "worker {rank}: ignoring {other:?} from the coordinator while training failed"
            ),
        }
    }
}

/// The mesh address peers should dial: the bound one, with an unspecified IP replaced by `advertise`
/// (the platform's word for this worker's address) or by the local address of the route to the
/// coordinator.
fn advertised(
    bound: SocketAddr,
    coordinator: SocketAddr,
    advertise: Option<std::net::IpAddr>,
) -> Result<SocketAddr> {
    if !bound.ip().is_unspecified() {
        return Ok(bound);
    }
    let ip = match advertise {
        Some(ip) => ip,
        None => {
            let probe = std::net::UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, 0))?;
            probe
                .connect(coordinator)
                .with_context(|| format!("finding the route to the coordinator {coordinator}"))?;
            probe.local_addr()?.ip()
        }
    };
    Ok(SocketAddr::new(ip, bound.port()))
}

pub fn run_from_env() -> Result<()> {
    let env = WorkerEnv::from_env().map_err(anyhow::Error::msg)?;
    let identity = read_identity(&env.secrets)?;
    let job = job_key(&env.job_id);
    let rank = env.rank;
    let bind: std::net::SocketAddr = match env.mesh_port {
        Some(port) => (std::net::Ipv4Addr::UNSPECIFIED, port).into(),
        None => "127.0.0.1:0".parse()?,
    };
    let endpoint = QuicEndpoint::bind(rank, job, &identity, bind, QuicOptions::default())
        .context("binding the mesh endpoint")?;
    let mesh_addr = advertised(endpoint.local_addr(), env.coordinator, env.advertise_ip)?;
    let mut control = ControlClient::connect(
        env.coordinator,
        &identity,
        rank,
        job,
        mesh_addr,
        Duration::from_secs(30),
    )?;
    // from here on (and the few before) this worker's warnings reach the coordinator's log too
    let log = control.log_sender();
    crate::logging::forward(move |level, line| {
        log.send(level.as_str(), line);
    });
    eprintln!(
        "worker {rank}/{}: registered, mesh endpoint {} (advertised {mesh_addr})",
        env.world,
        endpoint.local_addr()
    );
    // the part deltas of a foreseen resize are fetched beside training (or, prewarmed, while waiting)
    let prefetcher = control.prefetcher();
    let mut deadline = Instant::now() + ASSIGNMENT_TIMEOUT;
    // a joiner started ahead applies the delta it is sent while it waits
    let mut preload = None;
    let assignment = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match control.recv_timeout(left)? {
            ToWorker::Assign(a) => break a,
            ToWorker::Prefetch { artifacts, ready } => {
                // the first artifact is its part delta, readied as the coordinator says
                preload = artifacts.into_iter().next().map(|delta| {
                    apply_ahead(
                        rank,
                        prefetcher.clone(),
                        delta,
                        env.work_dir.clone(),
                        None,
                        ready,
                    )
                });
            }
            ToWorker::Wait { for_s } => {
                // a bad value from the coordinator must not turn into a panic or an endless wait
                let for_s = if for_s.is_finite() {
                    for_s.clamp(0.0, 7.0 * 86400.0)
                } else {
                    0.0
                };
                deadline = Instant::now() + Duration::from_secs_f64(for_s);
            }
            ToWorker::Stop { reason } => {
                bail!("stopped by the coordinator before training: {reason}")
            }
            other => bail!("the coordinator sent {other:?} before the assignment"),
        }
    };
    check_world(&assignment, rank)?;
    // From here on a stop or a lost coordinator ends the process, whatever training is doing; the
    // coordinator's other words (continue, pause, the assignment after a pause) go to training.
    let (words_tx, words) = mpsc::channel();
    // the mesh endpoint of the moment (each resize binds a new one): a cancelled epoch closes it, so that
    // no wait on a lost peer outlasts the coordinator's word
    let mesh_abort = Arc::new(Mutex::new(Some(endpoint.abort_handle())));
    // the part a survivor keeps while it trains, and its next delta applied to it beside training
    let ahead = Arc::new(Ahead::default());
    if let Some(incoming) = control.take_incoming() {
        let mesh_abort = mesh_abort.clone();
        let ahead = ahead.clone();
        let own_work_dir = env.work_dir_owned.then(|| env.work_dir.clone());
        let work_dir = env.work_dir.clone();
        std::thread::spawn(move || {
            let why = loop {
                break match incoming.recv() {
                    Ok(Ok(ToWorker::Prefetch { artifacts, .. })) => {
                        // a survivor's part delta (the first artifact) is applied to the part it
                        // keeps, beside training; without one kept, it is only fetched
                        let kept = ahead.kept.lock().unwrap_or_else(|e| e.into_inner()).clone();
                        let mut artifacts = artifacts;
                        // and only where this process has the memory to hold the part it makes
                        // beside the one it trains on; else it is applied in the pause, as before
                        let kept = kept.filter(|(from, _)| {
                            let Some(delta) = artifacts.first() else {
                                return false;
                            };
                            match ahead_fits(from, delta.size, memory_headroom()) {
                                Ok(()) => true,
                                Err(why) => {
                                    eprintln!(
                                        "worker {rank}: fetching its next delta ahead, applying it in \
                                         the pause: {why}"
                                    );
                                    false
                                }
                            }
                        });
                        if let (Some((from, ready)), false) = (kept, artifacts.is_empty()) {
                            let delta = artifacts.remove(0);
                            let name = (delta.name.clone(), delta.xxh3);
                            let handle = apply_ahead(
                                rank,
                                prefetcher.clone(),
                                delta,
                                work_dir.clone(),
                                Some(from),
                                Some(ready),
                            );
                            *ahead.applying.lock().unwrap_or_else(|e| e.into_inner()) =
                                Some((name, handle));
                        }
                        prefetch(rank, prefetcher.clone(), artifacts, work_dir.clone());
                        continue;
                    }
                    Ok(Ok(ToWorker::Stop { reason })) => {
                        format!("stopped by the coordinator: {reason}")
                    }
                    // sent before the assignment and overtaken by it: nothing to wait for now
                    Ok(Ok(ToWorker::Wait { .. })) => continue,
                    Ok(Ok(word @ ToWorker::Abort { .. })) => {
                        // the mesh of the moment is held while the word is passed on and it is closed:
                        // training that takes the word at its gate pauses and binds its next endpoint,
                        // which it can put here only after this abort (so the abort never closes it)
                        let current = mesh_abort.lock().unwrap_or_else(|e| e.into_inner());
                        // the word first: training that fails when the mesh closes finds it there
                        let ended = words_tx.send(word).is_err();
                        if let Some(abort) = &*current {
                            abort.abort();
                        }
                        drop(current);
                        if ended {
                            "training ended".into()
                        } else {
                            continue;
                        }
                    }
                    Ok(Ok(word)) => {
                        if words_tx.send(word).is_err() {
                            "training ended".into()
                        } else {
                            continue;
                        }
                    }
                    Ok(Err(reason)) => reason,
                    Err(_) => "the control connection is gone".into(),
                };
            };
            if DONE.load(Ordering::SeqCst) {
                std::process::exit(0);
            }
            eprintln!("worker {rank}: {why}; exiting");
            if let Some(dir) = &own_work_dir {
                let _ = std::fs::remove_dir_all(dir);
            }
            std::process::exit(3);
        });
    }
    let epoch_timeout = Duration::from_secs_f64(assignment.epoch_timeout_s);
    beat_while_computing(control.heartbeat(), endpoint.waiting(), epoch_timeout);
    let die_at = test_die_at(rank);
    let die_at_join = test_die_at_join(rank);
    std::fs::create_dir_all(&env.work_dir)
        .with_context(|| format!("creating the work folder {}", env.work_dir.display()))?;
    let trained = (|| -> Result<_> {
        // what a joiner applied while it waited (an assignment that names another part ignores it)
        let preloaded = preload
            .and_then(|p| p.join().ok().flatten())
            .map(|applied| Held {
                state: None,
                part: None,
                applied: Some(applied),
            });
        let (mut endpoint, mut assignment, mut held) = (endpoint, assignment, preloaded);
        for joins in 0usize.. {
            if die_at_join == Some(joins) {
                eprintln!("worker {rank}: test hook: killing myself as mesh {joins} forms");
                test_die(rank);
            }
            let t_join = Instant::now();
            // how long the link took to close after training (its peers receiving the last frames)
            let mut closed_s = 0.0;
            let segment = match endpoint.join(&assignment.peers) {
                Ok(mut link) => {
                    *mesh_abort.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some(link.abort_handle());
                    eprintln!(
                        "worker {rank}: joined the mesh of {} in {:.3} s",
                        assignment.peers.len(),
                        t_join.elapsed().as_secs_f64()
                    );
                    // the coordinator tells a stall from a long epoch (a worker waiting on one that
                    // computes is not stalled) and stops the launch within the epoch timeout; a wait on
                    // a peer gives up by itself only at PEER_WAIT_TIMEOUTS of it, when the coordinator
                    // cannot be heard either
                    link.set_timeout(Duration::from_secs_f64(
                        assignment.epoch_timeout_s * PEER_WAIT_TIMEOUTS,
                    ));
                    let mut io = ControlIo {
                        control: &mut control,
                        ahead: &ahead,
                        work: env.work_dir.clone(),
                        rank,
                        die_at,
                        words: &words,
                        gate_timeout: epoch_timeout.mul_f64(PEER_WAIT_TIMEOUTS),
                    };
                    let segment = train_segment(&mut link, &assignment, &mut io, held.take())?;
                    // Dropping the link waits for the peers to receive our last frames.
                    let t_close = Instant::now();
                    drop(link);
                    closed_s = t_close.elapsed().as_secs_f64();
                    segment
                }
                // a peer lost while the mesh formed, and being replaced: the coordinator closed the
                // endpoint under the join (a worker that does not resize in place is not told)
                Err(e) if assignment.gated && aborted(&words, rank, JOIN_ABORT_WAIT) => {
                    eprintln!(
                        "worker {rank}: joining the mesh was cancelled (a peer was lost): {e}"
                    );
                    Segment::Paused(Box::new(join_aborted(held.take(), &assignment)))
                }
                Err(e) => return Err(anyhow::Error::new(e).context("joining the mesh")),
            };
            match segment {
                Segment::Done(summary) => return Ok(summary),
                Segment::Paused(state) => {
                    // an in-place resize: a new mesh endpoint (same identity and rank) for the new world
                    let next =
                        QuicEndpoint::bind(rank, job, &identity, bind, QuicOptions::default())
                            .context("binding the mesh endpoint for the resized job")?;
                    let mesh_addr =
                        advertised(next.local_addr(), env.coordinator, env.advertise_ip)?;
                    *mesh_abort.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some(next.abort_handle());
                    match &state.state {
                        Some(s) => eprintln!(
                            "worker {rank}: paused after epoch {} keeping its state (its mesh closed in \
                             {closed_s:.3} s); mesh endpoint {mesh_addr}",
                            s.progress.epoch
                        ),
                        None => eprintln!(
                            "worker {rank}: paused with the epoch in flight cancelled, keeping its part; \
                             mesh endpoint {mesh_addr}"
                        ),
                    }
                    control.send(&ToCoordinator::Paused {
                        rank,
                        mesh_addr,
                        holds_part: state.part.is_some(),
                    })?;
                    assignment = match words.recv_timeout(ASSIGNMENT_TIMEOUT) {
                        Ok(ToWorker::Assign(a)) => a,
                        Ok(other) => {
                            bail!("paused, the coordinator sent {other:?}, not an assignment")
                        }
                        Err(_) => bail!(
                            "paused, no assignment from the coordinator within {ASSIGNMENT_TIMEOUT:?}"
                        ),
                    };
                    check_world(&assignment, rank)?;
                    endpoint = next;
                    let mut state = *state;
                    // its delta applied beside training, if it is this assignment's (waited for); the
                    // part it kept is the held one's (no second reference while it is taken)
                    if let Some(applied) = ahead.take_for(&assignment, state.part.as_ref()) {
                        state.applied = Some(applied);
                    }
                    ahead.kept.lock().unwrap_or_else(|e| e.into_inner()).take();
                    held = Some(state);
                }
            }
        }
        unreachable!("the loop over joins ends by returning")
    })();
    if env.work_dir_owned {
        // fetched artifacts and leftovers go with the worker
        let _ = std::fs::remove_dir_all(&env.work_dir);
    }
    match trained {
        Ok(summary) => {
            DONE.store(true, Ordering::SeqCst);
            control.send(&ToCoordinator::Done {
                rank,
                summary,
                peak_rss_bytes: peak_rss_bytes(),
            })?;
            control.finish(Duration::from_secs(5));
            eprintln!("worker {rank}: done");
            Ok(())
        }
        Err(e) => {
            let error = format!("{e:#}");
            let _ = control.send(&if is_peer_fault(&e) {
                ToCoordinator::PeerLost { rank, error }
            } else {
                ToCoordinator::Failed { rank, error }
            });
            control.finish(Duration::from_secs(2));
            Err(e)
        }
    }
}

/// What a worker keeps when its join under `a` was aborted: the training state it came in with (the
/// assignment continues after the epoch it holds), and the part it held only when `a` kept that part
/// (an assignment that brings a delta or a whole part was not loaded: the rows held are no longer this
/// rank's, and the coordinator serves a whole part next, told by [`ToCoordinator::Paused::holds_part`]).
fn join_aborted(held: Option<Held>, a: &Assignment) -> Held {
    let (state, part) = held.map_or((None, None), |h| (h.state, h.part));
    Held {
        state,
        part: part.filter(|_| matches!(a.part, PartSource::Held)),
        applied: None,
    }
}

/// How long a worker whose join failed waits for the coordinator's [`ToWorker::Abort`]: the failure is
/// the abort itself (the endpoint closed under the join), or a lost peer's join timeout, which the
/// coordinator has named long before.
const JOIN_ABORT_WAIT: Duration = Duration::from_secs(10);

/// Fetches `artifacts` into `dir` on a thread of its own ([`ToWorker::Prefetch`]): the assignment that
/// names them finds them there (a fetch of one still in flight waits for it). A failure is only logged:
/// the assignment fetches what is missing.
fn prefetch(
    rank: usize,
    prefetcher: physalia_control::Prefetcher,
    artifacts: Vec<Artifact>,
    dir: PathBuf,
) {
    if artifacts.is_empty() {
        return;
    }
    std::thread::spawn(move || {
        for a in artifacts {
            let t = Instant::now();
            match prefetcher.fetch(&a, &dir) {
                Ok(Some(_)) => eprintln!(
                    "worker {rank}: prefetched {} ({} bytes) in {:.3} s, beside training",
                    a.name,
                    a.size,
                    t.elapsed().as_secs_f64()
                ),
                Ok(None) => eprintln!(
                    "worker {rank}: {} not prefetched (held here already, fetched by another \
                     thread, or read from the store when needed)",
                    a.name
                ),
                Err(e) => eprintln!(
                    "worker {rank}: prefetching {} failed ({e}); the assignment fetches it",
                    a.name
                ),
            }
        }
    });
}

/// [`prefetch`] of a part delta, also read and applied on the thread to `from` (the part this worker
/// holds: a survivor's, kept while it trains; `None` for a joiner started ahead, waiting), so an
/// assignment naming that delta trains on the part at once. `None` when that fails (logged; the
/// assignment then reads the delta as usual).
fn apply_ahead(
    rank: usize,
    prefetcher: physalia_control::Prefetcher,
    a: Artifact,
    dir: PathBuf,
    from: Option<Arc<Part>>,
    ready: Option<ReadyAs>,
) -> std::thread::JoinHandle<Option<Applied>> {
    std::thread::spawn(move || {
        let t = Instant::now();
        let applied = (|| -> Result<(Part, crate::delta::HaloRows)> {
            let path = match prefetcher.fetch(&a, &dir)? {
                Some(copy) => copy,
                None => prefetcher
                    .held_copy(&a, &dir)
                    .context("the delta is neither on this machine nor fetched")?,
            };
            let delta = crate::delta::PartDelta::read(&path)?;
            ensure!(
                delta.held == from.as_ref().map_or(0, |p| p.owned.len()),
                "the delta applies to a part this worker does not hold"
            );
            Ok((
                crate::delta::apply(from.as_deref(), &delta)?,
                delta.halo_rows()?,
            ))
        })();
        let when = match from {
            Some(_) => "beside training",
            None => "while waiting",
        };
        match applied {
            Ok((part, halo_rows)) => {
                // the rows of its new input halo the held part and the carried rows hold (a joiner's:
                // the carried rows alone), prepared as the wire delivers them (a survivor's old model's
                // halo rows are added in the pause)
                let seed = ready.and_then(|r| r.seed).map(|s| {
                    let mut raw: Vec<crate::seed::RawRows<'_>> = from
                        .as_deref()
                        .map(crate::seed::RawRows::owned)
                        .into_iter()
                        .collect();
                    raw.push(crate::seed::RawRows::carried(&halo_rows, part.feat_dim));
                    let old_halo = from.as_deref().map(|o| &o.halo[..]);
                    let seed = crate::seed::SeedAhead::gather(
                        &part,
                        &raw,
                        old_halo,
                        s.row_normalize,
                        s.dtype,
                    );
                    (s, seed)
                });
                // the engine's graph of the part, which the pause would otherwise build
                let graph = ready.map(|r| (r.layer, crate::local_graph(&part, r.layer)));
                eprintln!(
                    "worker {rank}: applied {} ({} bytes, part {} of {}, {} rows{}{}) {when}, in {:.3} s",
                    a.name,
                    a.size,
                    part.part,
                    part.k,
                    part.owned.len(),
                    seed.as_ref().map_or(String::new(), |(_, s)| format!(
                        ", {} rows of its input halo gathered",
                        s.gathered()
                    )),
                    if graph.is_some() {
                        ", the engine's graph built"
                    } else {
                        ""
                    },
                    t.elapsed().as_secs_f64()
                );
                Some(Applied {
                    artifact: (a.name.clone(), a.xxh3),
                    part,
                    halo_rows,
                    from,
                    seed,
                    graph,
                })
            }
            Err(e) => {
                eprintln!(
                    "worker {rank}: applying {} {when} failed ({e:#}); the assignment reads it",
                    a.name
                );
                None
            }
        }
    })
}

/// Whether a survivor may apply its next delta (`delta_bytes` on the wire) to the part it keeps beside
/// training, with `headroom` bytes it may still allocate (`None`: unknown, taken as enough): the part the
/// delta makes lives with its engine graph and seed beside the part and engine it trains on until the
/// resize. The new part is at most the kept part and what the delta brings, its graph and seed at most
/// as much again, so it asks for twice their bytes.
fn ahead_fits(kept: &Part, delta_bytes: u64, headroom: Option<u64>) -> Result<(), String> {
    let need = 2 * (part_bytes(kept) + delta_bytes);
    match headroom {
        Some(free) if free < need => Err(format!(
            "the part it makes would need about {} MiB beside training and {} MiB are free",
            need >> 20,
            free >> 20
        )),
        _ => Ok(()),
    }
}

/// The bytes a part holds (its arrays; what the vectors hold, not their spare capacity).
fn part_bytes(p: &Part) -> u64 {
    let words = |n: usize, w: usize| (n * w) as u64;
    let features = words(p.features.view().len(), p.features.dtype().size_bytes());
    let sends: usize = p.send.iter().map(|(_, rows)| rows.len()).sum();
    features
        + words(p.indptr.len(), 8)
        + words(p.labels.len(), 8)
        + words(
            p.owned.len()
                + p.halo.len()
                + p.indices.len()
                + p.src_in_degree.len()
                + p.train.len()
                + p.val.len()
                + p.test.len()
                + sends,
            4,
        )
}

/// Bytes this process may still allocate ([`physalia_control::memory::headroom_bytes`]), or the test
/// hook's `PHYSALIA_TEST_MEMORY_HEADROOM`.
fn memory_headroom() -> Option<u64> {
    std::env::var(ENV_TEST_MEMORY_HEADROOM)
        .ok()
        .and_then(|v| v.parse().ok())
        .or_else(physalia_control::memory::headroom_bytes)
}

/// An assignment's world must hold this worker's rank (a resize in place changes the world, not the rank).
fn check_world(a: &Assignment, rank: usize) -> Result<()> {
    if rank >= a.peers.len() {
        bail!(
            "the assignment names {} peers, this worker is rank {rank}",
            a.peers.len()
        );
    }
    Ok(())
}

/// How many epoch timeouts a wait for a peer's frame lasts before the worker reports the peer lost.
const PEER_WAIT_TIMEOUTS: f64 = 3.0;

/// How long a worker whose training failed waits for the coordinator's [`ToWorker::Abort`] before it
/// reports the failure and exits: a lost peer's closed connection can be seen before the coordinator
/// names the loss (after its failure grace) and cancels the epoch. Only for a peer's fault; a failure of
/// the worker's own is reported at once.
fn abort_wait(e: &anyhow::Error) -> Duration {
    match is_peer_fault(e) {
        true => Duration::from_secs(10),
        false => Duration::ZERO,
    }
}

/// Beats a quarter of the epoch timeout apart (at most every 5 s) while this process computes: the
/// coordinator's silence check then bounds a stall, not an epoch, so a long epoch is not a lost worker.
/// Progress is this process's CPU time growing since the last beat: a frozen process beats not at all,
/// and one blocked waiting for a peer or a lock uses no CPU and stops beating (its peer wait is bounded
/// by the same timeout and reported as `PeerLost`). Instead, while the mesh is blocked on a peer, it says
/// which (`waiting`), so that if the wait outlasts the timeout the coordinator names the peer everyone
/// waits on (a delayed, frozen or cut-off worker), not a worker silent only because it waits.
fn beat_while_computing(
    heartbeat: physalia_control::Heartbeat,
    waiting: physalia_wire::Waiting,
    epoch_timeout: Duration,
) {
    let every = (epoch_timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(5));
    std::thread::spawn(move || {
        let mut last = cpu_time();
        loop {
            std::thread::sleep(every);
            let now = cpu_time();
            // a tenth of the interval on a core: the control runtime's keep-alives use far less
            let sent = if now.saturating_sub(last) >= every / 10 {
                heartbeat.beat()
            } else if let Some(peer) = waiting.peer() {
                heartbeat.waiting_on(peer)
            } else {
                true
            };
            if !sent {
                return;
            }
            last = now;
        }
    });
}

/// CPU time (user and system) this process has used.
fn cpu_time() -> Duration {
    // SAFETY: getrusage writes only into the struct it is given
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Whether training failed because a peer could not be reached (the exchange's waits and connections),
/// rather than for this worker's own data, settings or arithmetic.
fn is_peer_fault(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<physalia_gnn::Error>(),
            Some(physalia_gnn::Error::Exchange(_))
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 400 nodes, 3 classes, 5 features: the parts of the tests below.
    fn small_sbm() -> physalia_graph::OwnedDataset {
        physalia_graph::synth::sbm(&physalia_graph::synth::SbmParams {
            num_nodes: 400,
            num_classes: 3,
            feat_dim: 5,
            seed: 2,
            ..Default::default()
        })
        .unwrap()
    }

    /// A joiner waiting for its first assignment applies the delta it is sent ahead on a thread
    /// (fetched over its control connection, as a container does): the part is exactly the one the delta
    /// makes, named by the artifact; a file that is no delta leaves nothing held.
    #[test]
    fn a_waiting_joiner_applies_the_delta_it_is_sent_ahead() {
        use physalia_graph::partition::{Partitioning, build_parts};
        let ds = small_sbm();
        let old_owner: Vec<u32> = (0..400).map(|v| v % 2).collect();
        let new_owner: Vec<u32> = (0..400).map(|v| v % 3).collect();
        let p = Partitioning::from_assignment(ds.csr(), 3, new_owner.clone(), "t", 0).unwrap();
        let want = build_parts(&ds, &p).unwrap().swap_remove(2);
        let served = tempfile::tempdir().unwrap();
        let work = tempfile::tempdir().unwrap();
        let path = served.path().join("delta2.bin");
        crate::delta::diff(&old_owner, &new_owner, &want)
            .write(&path)
            .unwrap();
        let junk = served.path().join("junk.bin");
        std::fs::write(&junk, b"not a delta at all").unwrap();
        let ca = physalia_wire::JobCa::new("job-pre").unwrap();
        let files = physalia_control::Files::new(None);
        let mut delta = files.serve("part-prep0-k3-2", &path).unwrap();
        let mut bad = files.serve("part-prep0-k3-x", &junk).unwrap();
        let server = physalia_control::ControlServer::bind(
            &ca.identity(physalia_control::COORDINATOR_NAME).unwrap(),
            ca.job_key(),
            3,
            "127.0.0.1:0".parse().unwrap(),
            Duration::from_secs(5),
            files,
        )
        .unwrap();
        let client = ControlClient::connect(
            server.local_addr(),
            &ca.identity(&physalia_wire::worker_name(2)).unwrap(),
            2,
            ca.job_key(),
            "127.0.0.1:9".parse().unwrap(),
            Duration::from_secs(5),
        )
        .unwrap();
        // a container's view: the coordinator's paths are not on this machine
        delta.path = Some(PathBuf::from("/nonexistent/delta2.bin"));
        bad.path = None;
        let ready = ReadyAs {
            layer: physalia_gnn::LayerKind::Gcn,
            seed: None,
        };
        let applied = apply_ahead(
            2,
            client.prefetcher(),
            delta.clone(),
            work.path().into(),
            None,
            Some(ready),
        )
        .join()
        .unwrap()
        .expect("applied");
        assert_eq!(applied.part, want);
        assert_eq!(applied.artifact, (delta.name.clone(), delta.xxh3));
        assert!(applied.from.is_none());
        // the engine's graph of the part, for the layers asked: the one the pause would build
        let (layer, graph) = applied.graph.as_ref().expect("the graph built ahead");
        assert_eq!(*layer, physalia_gnn::LayerKind::Gcn);
        let x = physalia_gnn::Matrix::from_vec(
            want.owned.len() + want.halo.len(),
            3,
            (0..(want.owned.len() + want.halo.len()) * 3)
                .map(|i| (i % 7) as f32 - 3.0)
                .collect(),
        );
        let built = crate::local_graph(&want, physalia_gnn::LayerKind::Gcn);
        assert_eq!(
            (graph.n_dst(), graph.n_src()),
            (want.owned.len(), want.owned.len() + want.halo.len())
        );
        let gcn = physalia_gnn::LayerKind::Gcn;
        assert_eq!(graph.op(gcn).spmm(&x).data(), built.op(gcn).spmm(&x).data());
        let none = apply_ahead(2, client.prefetcher(), bad, work.path().into(), None, None)
            .join()
            .unwrap();
        assert!(none.is_none());
    }

    /// A survivor applies its next delta beside training only where its memory holds twice the kept part
    /// and the delta; unknown headroom does not stop it.
    #[test]
    fn a_survivor_applies_its_delta_ahead_only_where_its_memory_holds_it() {
        use physalia_graph::partition::{Partitioning, build_parts};
        let ds = small_sbm();
        let p =
            Partitioning::from_assignment(ds.csr(), 2, (0..400).map(|v| v % 2).collect(), "t", 0)
                .unwrap();
        let part = build_parts(&ds, &p).unwrap().swap_remove(1);
        let bytes = part_bytes(&part);
        // at least its features, its structure and its ids
        let at_least = (part.owned.len() * 5 * 4
            + part.indices.len() * 4
            + part.indptr.len() * 8
            + (part.owned.len() + part.halo.len()) * 4) as u64;
        assert!(bytes >= at_least, "{bytes} < {at_least}");
        let need = 2 * (bytes + 1000);
        assert_eq!(ahead_fits(&part, 1000, None), Ok(()));
        assert_eq!(ahead_fits(&part, 1000, Some(need)), Ok(()));
        assert_eq!(ahead_fits(&part, 1000, Some(u64::MAX)), Ok(()));
        let short = ahead_fits(&part, 1000, Some(need - 1)).unwrap_err();
        assert!(short.contains("MiB are free"), "{short}");
        assert!(ahead_fits(&part, 1 << 40, Some(1 << 39)).is_err());
    }

    #[test]
    fn an_exchange_failure_is_a_peer_fault_and_bad_settings_are_not() {
        let timed_out: physalia_gnn::ExchangeError = "timed out waiting for rank 1".into();
        let e = anyhow::Error::new(physalia_gnn::Error::Exchange(timed_out)).context("epoch 3");
        assert!(is_peer_fault(&e));
        let e = anyhow::Error::new(physalia_gnn::Error::Config("hidden is 0".into()));
        assert!(!is_peer_fault(&e));
        assert!(!is_peer_fault(&anyhow::anyhow!("dataset is unreadable")));
    }

    #[test]
    fn fallback_labels_keep_the_head_of_the_reason() {
        assert_eq!(
            short_reason("no CUDA driver: libcuda could not be loaded (no NVIDIA driver)"),
            "no CUDA driver"
        );
        assert_eq!(
            short_reason("the CUDA library nvrtc could not be loaded (install it)"),
            "the CUDA library nvrtc could not be loaded"
        );
        assert_eq!(short_reason("plain"), "plain");
    }

    #[test]
    fn a_cpu_worker_stays_on_the_cpu_and_names_no_device() {
        let (d, label) = choose_device(&DeviceRequest::default(), 3).unwrap();
        assert_eq!(d, crate::Device::Cpu);
        assert_eq!(label, None);
    }

    #[test]
    fn a_worker_advertises_a_dialable_mesh_address() {
        let coordinator: SocketAddr = "127.0.0.1:9".parse().unwrap();
        // bound to one address: that one
        let bound: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        assert_eq!(advertised(bound, coordinator, None).unwrap(), bound);
        // bound to every interface: the route to the coordinator, unless the platform said
        let any: SocketAddr = "0.0.0.0:4001".parse().unwrap();
        assert_eq!(
            advertised(any, coordinator, None).unwrap(),
            "127.0.0.1:4001".parse::<SocketAddr>().unwrap()
        );
        let pod: std::net::IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(
            advertised(any, coordinator, Some(pod)).unwrap(),
            "10.1.2.3:4001".parse::<SocketAddr>().unwrap()
        );
    }
}
