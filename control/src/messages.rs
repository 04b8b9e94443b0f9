//! What the coordinator and a worker say to each other, and the settings an assignment carries.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use physalia_gnn::{EpochMetrics, ModelConfig, TrainConfig, TrainSummary};
use physalia_wire::Dtype;
use serde::{Deserialize, Serialize};

/// Worker to coordinator.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToCoordinator {
    /// The first message: who I am and where my mesh endpoint listens.
    Register {
        rank: usize,
        pid: u32,
        mesh_addr: SocketAddr,
    },
    /// One training epoch finished (metrics are global; `exchange` is this worker's). Rank 0 sends it
    /// only after the coordinator stored the epoch's checkpoint, when the assignment asks for them.
    Epoch { rank: usize, metrics: EpochMetrics },
    /// Training finished; rank 0's model is stored with the coordinator.
    Done {
        rank: usize,
        summary: TrainSummary,
        peak_rss_bytes: Option<u64>,
    },
    /// Training failed on this worker.
    Failed { rank: usize, error: String },
    /// This worker could not exchange with its peers (a wait for a peer timed out, a mesh connection
    /// ended): a fault of the network or of a peer, not of this worker's own work, so the coordinator
    /// retries the epoch as for a lost worker.
    PeerLost { rank: usize, error: String },
    /// Answer to [`ToWorker::Pause`]: this worker stopped after the epoch it last reported, keeps its
    /// process, model, optimizer state and progress, and listens for the next mesh at `mesh_addr`
    /// (an in-place resize). `holds_part`: whether it holds the part of the assignment it paused under
    /// (false when the mesh was aborted before that part was loaded or its delta applied: the next
    /// assignment serves it a whole part).
    Paused {
        rank: usize,
        mesh_addr: SocketAddr,
        holds_part: bool,
    },
    /// A warning or an error this worker logged (its `tracing` event as one line, `target: message
    /// fields`): already in the worker's own log; the coordinator adds it to its log and, with `-v`,
    /// shows it live. Lines are cut at [`MAX_LOG_LINE_BYTES`].
    Log {
        rank: usize,
        level: String,
        line: String,
    },
}

/// The longest [`ToCoordinator::Log`] line a worker sends (longer ones are cut, marked with `...`).
pub const MAX_LOG_LINE_BYTES: usize = 4096;

/// Coordinator to worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToWorker {
    Assign(Box<Assignment>),
    /// Keep waiting for the assignment, up to `for_s` seconds from now: the coordinator started this
    /// worker ahead of the launch that will use it (a policy's prewarm) and tells it how long to wait.
    Wait {
        for_s: f64,
    },
    /// Go on with the next epoch: the coordinator recorded the last one and the job keeps its shape
    /// (sent after every epoch to a worker whose assignment is [`Assignment::gated`]).
    Continue,
    /// Do not start the next epoch: keep the training state in memory, bind a new mesh endpoint and answer
    /// [`ToCoordinator::Paused`]; the next [`ToWorker::Assign`] (a new world, a new part) continues from
    /// that state (an in-place resize).
    Pause,
    /// A peer of this worker was lost: give up the epoch in flight (close the mesh, so that no wait on
    /// the lost peer outlasts this word), keep the process and the part held, bind a new mesh endpoint
    /// and answer [`ToCoordinator::Paused`], as for [`ToWorker::Pause`]. The next assignment continues
    /// after the last epoch the job recorded: from the state held when that is the epoch this worker
    /// paused after, else from that epoch's checkpoint (the epoch in flight is trained again, with the
    /// lost worker's replacement).
    Abort {
        reason: String,
    },
    /// Fetch these files now, beside training, so the assignment that names them finds them here: the
    /// part deltas of the resize the coordinator foresees, made while the job trains. A hint: a worker
    /// that shares the coordinator's disk reads them in place anyway, and a fetch that fails is fetched
    /// again when the assignment needs it.
    /// `ready`: how the part the delta makes is readied ahead (absent from an older coordinator).
    Prefetch {
        artifacts: Vec<Artifact>,
        #[serde(default)]
        ready: Option<ReadyAs>,
    },
    /// Stop now (another worker failed, or the job was cancelled).
    Stop {
        reason: String,
    },
}

/// How a worker readies the part its delta makes, ahead of the assignment that trains on it (while a
/// joiner waits, beside a survivor's training): the engine's graph built for the job's layers and, when
/// the model keeps its first layer's input halo, the rows of the part's input halo the worker holds (its
/// old part's rows, those the delta carried) gathered under `seed`'s settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadyAs {
    pub layer: physalia_gnn::LayerKind,
    pub seed: Option<SeedAs>,
}

/// How a worker's input halo rows are prepared: as the engine prepares its own rows (row-normalised or
/// not) and rounded to the wire's dtype. A seed built ahead is used only under the same settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeedAs {
    pub row_normalize: bool,
    pub dtype: Dtype,
}

/// A file the coordinator serves: a worker that shares no disk with the coordinator fetches it by name
/// over its control connection and checks what it got against the size and the checksum.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    /// The name the coordinator serves it under (`part-3`, `dataset`, `checkpoint-000005`, ...).
    pub name: String,
    pub size: u64,
    /// xxh3-64 of the contents.
    pub xxh3: u64,
    /// Where the coordinator keeps it. A worker on the same machine whose file at this path has the same
    /// size and checksum reads it in place instead of fetching a copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Where the worker may read it itself: a store's signed URL for this one object (a chunk file of a
    /// dataset in the job store, issue 31), so the bytes need not pass through the coordinator. Fetched
    /// there first, checked the same way; the coordinator still serves it by name if that fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<SignedUrl>,
}

/// A URL that lets whoever holds it read one object until it expires (a presigned GET): its query
/// string is the credential, so it is never shown. `Debug` and `Display` give the object's address
/// alone; [`SignedUrl::expose`] is for the request itself.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SignedUrl(String);

impl SignedUrl {
    pub fn new(url: String) -> SignedUrl {
        SignedUrl(url)
    }

    /// The whole URL, signature included: only for the GET.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Scheme, host and path: what may be logged.
    pub fn address(&self) -> &str {
        self.0.split(['?', '#']).next().unwrap_or_default()
    }
}

impl std::fmt::Debug for SignedUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SignedUrl({}?<signature withheld>)", self.address())
    }
}

impl std::fmt::Display for SignedUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (signed)", self.address())
    }
}

/// Where a worker's part comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "from", rename_all = "snake_case")]
pub enum PartSource {
    /// A part file (or part delta) the coordinator serves.
    Served(Artifact),
    /// Cut by the worker itself (issue 31): a worker that reads the coordinator's disk cuts its part
    /// of a chunked dataset from the dataset and the stored assignment, writes it where the set keeps
    /// it, and trains on it; the coordinator commits the set once every worker has reported an epoch.
    /// Boxed: it is four times the size of the other variant (the wire format is the same).
    Cut(Box<PartCut>),
    /// The part this worker already holds, unchanged: a survivor of a lost worker's replacement (the
    /// job keeps its partitioning; only the replacement is sent its part).
    Held,
    /// No part: the worker trains on the whole dataset it is served (model parallelism, P3, splits the
    /// features by column, not the graph by rows).
    WholeDataset,
}

/// A part to cut: [`PartSource::Cut`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartCut {
    /// The chunked dataset's folder, read in place.
    pub dataset: PathBuf,
    /// The pending set's assignment (a partitioning describing no parts yet).
    pub assignment: PathBuf,
    /// Which part.
    pub part: usize,
    /// Where the part file is written.
    pub out: PathBuf,
    /// Whether the job's workers cut their parts together (`chunked_shuffle`): each reads `1/k` of the
    /// dataset's chunks and sends every row to the worker that owns it over the mesh, the worker's
    /// rank being its part. Otherwise the worker reads every edge chunk itself (`cut_part`).
    #[serde(default)]
    pub shuffle: bool,
    /// For a worker that does not read the coordinator's disk: the dataset's files and the assignment
    /// are fetched by name instead of read at the paths above, and the part is handed back
    /// ([`Upload::Part`]) instead of written to `out`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served: Option<ServedCut>,
}

/// What a worker that shares no disk with the coordinator fetches to cut its part: [`PartCut::served`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServedCut {
    /// The dataset's `manifest.json`.
    pub manifest: Artifact,
    /// Each chunk file is served as this prefix and its path in the manifest (its size and checksum
    /// are the manifest's), so the assignment does not list them: a worker fetches only the chunks
    /// it reads.
    pub chunk_prefix: String,
    /// The pending assignment.
    pub assignment: Artifact,
    /// Where this worker reads chunk files itself (a chunk's path in the manifest to a signed URL of
    /// its object in the store): the chunks it reads, when the dataset is in a store that signs URLs.
    /// A chunk not here, or whose URL fails, is fetched from the coordinator under `chunk_prefix`.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub direct: std::collections::BTreeMap<String, SignedUrl>,
    /// The dataset as its user knows it, for the worker's messages: its folder's URL in the job store
    /// (cluster mode), or its path on the coordinator's machine.
    #[serde(default)]
    pub source: String,
}

/// What a worker may send the coordinator to keep: rank 0 its checkpoints and the model, a worker that
/// cut its part away from the coordinator's disk that part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Upload {
    /// The checkpoint after `epoch` (weights, optimizer state, progress).
    Checkpoint { epoch: usize },
    /// The trained model.
    Model,
    /// Part `part` of a set its worker cut ([`PartCut::served`]); only that worker may send it, and only
    /// where the coordinator expects it.
    Part { part: usize },
}

impl Upload {
    /// Where the coordinator stores it, relative to the job directory.
    pub fn relative_path(self) -> PathBuf {
        match self {
            Upload::Checkpoint { epoch } => checkpoint_path(Path::new("checkpoints"), epoch),
            Upload::Model => PathBuf::from("model.safetensors"),
            Upload::Part { part } => PathBuf::from(format!("parts/part{part}.safetensors")),
        }
    }
}

/// The checkpoint file of `epoch` in a checkpoint folder.
pub fn checkpoint_path(dir: &Path, epoch: usize) -> PathBuf {
    dir.join(format!("epoch-{epoch:06}.safetensors"))
}

/// What a worker trains: sent once every worker has registered. Files are [`Artifact`]s, never paths on
/// the coordinator's disk.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Assignment {
    /// Mesh address of every rank, by rank.
    pub peers: Vec<SocketAddr>,
    /// Where this worker's part comes from.
    pub part: PartSource,
    /// `part` is a served part delta (an in-place resize, issue 33): the worker's part is the part it
    /// held under its previous assignment (none for a joiner) with the delta applied.
    #[serde(default)]
    pub part_delta: bool,
    /// The partitioning's node-to-part map (data parallelism).
    #[serde(default)]
    pub partitioning: Option<Artifact>,
    /// The whole dataset (data and model parallelism read its structure, splits, and for model parallelism
    /// this worker's feature columns).
    #[serde(default)]
    pub dataset: Option<Artifact>,
    pub model: ModelConfig,
    pub train: TrainConfig,
    pub seed: u64,
    pub exchange: ExchangeOptions,
    pub row_normalize: bool,
    /// The bound on every wait for a peer inside an epoch.
    pub epoch_timeout_s: f64,
    /// How the job is parallelised.
    #[serde(default)]
    pub mode: TrainMode,
    #[serde(default)]
    pub minibatch: Option<MiniBatchOptions>,
    /// Continue from this checkpoint.
    #[serde(default)]
    pub resume_from: Option<Artifact>,
    /// The epoch training continues after (0: from scratch). A worker that holds the state of this epoch
    /// in memory (it paused there for an in-place resize) continues from it and never reads
    /// `resume_from`.
    #[serde(default)]
    pub resume_epoch: usize,
    /// After reporting an epoch (all but the last), wait for [`ToWorker::Continue`] or
    /// [`ToWorker::Pause`] before starting the next: the coordinator may resize the job in place there.
    #[serde(default)]
    pub gated: bool,
    /// Rank 0 sends the coordinator a checkpoint after every epoch, before reporting the epoch.
    #[serde(default)]
    pub checkpoints: bool,
    /// The device this worker trains on.
    #[serde(default)]
    pub device: DeviceRequest,
}

/// GPUs for a worker, from the job's `resources.gpu` (or the GPU SKU it runs on).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRequest {
    /// GPUs visible to the worker; 0 trains on the CPU. Workers sharing a machine share its GPUs
    /// round-robin by rank.
    #[serde(default)]
    pub gpus: u32,
    /// Train on the CPU when no usable GPU is found (saying so in every epoch), instead of failing.
    #[serde(default)]
    pub fallback_cpu: bool,
}

/// The three ways a job splits its work over workers: the planner's [`physalia_planner::Mode`], one type
/// for the job file, the planner and the assignment (serialised `partition`, `data`, `model` in each).
pub use physalia_planner::Mode as TrainMode;

/// How halo rows are exchanged.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExchangeOptions {
    /// Fraction of boundary rows sent per training epoch (1 = all: exact).
    pub boundary_sampling: f32,
    /// Scale sampled rows by `1 / boundary_sampling` (an unbiased estimate of the aggregation, with high
    /// variance at small rates); off, unsampled boundary nodes simply drop out of the aggregation.
    #[serde(default)]
    pub boundary_rescale: bool,
    /// Reuse halo rows for this many epochs after a refresh (0 = always fresh: exact).
    pub staleness_epochs: u32,
    /// With `staleness_epochs` above 0: refresh earlier when rows changed by at least this fraction.
    #[serde(default)]
    pub staleness_threshold: Option<f32>,
    /// Element type of exchanged rows.
    pub dtype: Dtype,
    pub seed: u64,
    /// SAR: aggregate halo rows one peer at a time and drop them, fetching them again in backward instead
    /// of keeping them (GAT), so a worker holds one peer's halo rows at a time. Exact.
    #[serde(default)]
    pub rematerialize: bool,
}

impl ExchangeOptions {
    /// Options that cannot be combined, as a message naming them: rematerialisation fetches halo rows again
    /// in backward, which must be the rows forward used, so it takes every row fresh.
    pub fn check(&self) -> Result<(), String> {
        if self.rematerialize && (self.boundary_sampling < 1.0 || self.staleness_epochs > 0) {
            return Err(
                "exchange.rematerialize cannot be combined with boundary_sampling below 1 or staleness above 0"
                    .into(),
            );
        }
        Ok(())
    }
}

impl Default for ExchangeOptions {
    fn default() -> Self {
        ExchangeOptions {
            boundary_sampling: 1.0,
            boundary_rescale: false,
            staleness_epochs: 0,
            staleness_threshold: None,
            dtype: Dtype::F32,
            seed: 0,
            rematerialize: false,
        }
    }
}

/// How mini-batches are drawn and prepared.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MiniBatchOptions {
    /// Per hop, PyG order: `fanouts[0]` for the seeds. `None` takes every neighbour.
    pub fanouts: Vec<Option<u32>>,
    /// Seeds per step over all workers (the global batch; each worker trains its share of it), so what is
    /// learned does not depend on the worker count.
    pub batch_size: usize,
    /// Remote feature rows each worker caches (0: none).
    pub cache_rows: usize,
    /// Batches pre-sampled to rank remote rows by how often they are read.
    pub presample_batches: usize,
    /// Loader threads and how many batches they may run ahead.
    pub loader_threads: usize,
    pub prefetch: usize,
}

impl MiniBatchOptions {
    /// One fan-out per layer and a positive batch size.
    pub fn check(&self, layers: usize) -> Result<(), String> {
        if self.fanouts.len() != layers {
            return Err(format!(
                "{} fan-outs for a model of {layers} layers: give one per layer",
                self.fanouts.len()
            ));
        }
        if self.batch_size == 0 {
            return Err("batch_size must be at least 1".into());
        }
        Ok(())
    }
}

impl Default for MiniBatchOptions {
    fn default() -> Self {
        MiniBatchOptions {
            fanouts: vec![Some(25), Some(10)],
            batch_size: 1024,
            cache_rows: 0,
            presample_batches: 8,
            loader_threads: 1,
            prefetch: 2,
        }
    }
}
