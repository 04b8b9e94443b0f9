//! Cluster mode (`backend.mode: cluster`, the default on kubernetes, ecs and aci): the coordinator runs
//! on the platform, next to its workers, and this machine only hands it the job and follows it.
//!
//! `submit` ([`submit`]): preflight (the platform's own checks through [`Backend::check`], a job store
//! it can write, the coordinator's identity set), uploads a local dataset once, content-addressed
//! (`<store>/.datasets/<xxh3>-<file name>`, reused by every later job of the same bytes), writes the job
//! (`job.json`, a first `status.json`) into the store, starts the coordinator through
//! [`Backend::launch_coordinator`] as `physalia coordinate <job URL>`, records its
//! [`CoordinatorHandle`] as `coordinator.json` beside the record, and follows the record: the same
//! per-epoch lines and final lines as a local job. `--detach` returns once it runs; Ctrl-C while
//! following detaches too (the job goes on) and says how to re-attach.
//!
//! `physalia coordinate` ([`coordinate`], hidden): the coordinator's process. It reads the job from the
//! store, downloads the dataset, and runs it exactly as client mode does (`distributed::run`, the same
//! code path), its record mirrored to the store, its control endpoint on the port its platform object
//! declares. Its credentials are the platform's (the ECS task role through the container credentials
//! endpoint, the ServiceAccount, the managed identity), read by each SDK's standard chain: nothing
//! here passes, sets or logs one. At its end it deletes its platform object's template (the ECS task
//! definition) so that a detached job leaves nothing behind; its task ends with its process.
//!
//! `cancel` and `logs --rank coordinator` reach the coordinator through `coordinator.json`
//! ([`stop_coordinator`], [`coordinator_logs`]).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use physalia_backends::{Backend, CoordinatorHandle, CoordinatorSpec, WorkerState};
use physalia_control::{JobState, JobStatus, MetricsLine};

use crate::driver::Observer;
use crate::driver::distributed::Role;
use crate::driver::partitions::{StoredChunks, StoredPartitions, is_chunked_url};
use crate::driver::resolved::ResolvedJob;
use crate::driver::workers::block_on;
use crate::spec::JobSpec;
use crate::store::{self, Remote};

/// The coordinator's handle in the job's store folder.
pub const COORDINATOR_JSON: &str = "coordinator.json";
/// The store's folder of uploaded datasets, beside the jobs.
const DATASETS: &str = ".datasets";
/// The coordinator's container: 1 vCPU, and memory for partitioning its dataset
/// ([`coordinator_memory_gib`]).
const COORDINATOR_VCPUS: f64 = 1.0;
/// The coordinator's least memory: the smallest Fargate size for 1 vCPU.
const COORDINATOR_MIN_GIB: f64 = 2.0;
/// The most: Fargate's largest for 1 vCPU.
const COORDINATOR_MAX_GIB: f64 = 8.0;

/// The coordinator's memory for a dataset of `dataset_bytes` (its file): partitioning holds the graph,
/// the parts it writes and METIS's arrays at once. Measured (this project's 2-core VM): SBM 1M nodes,
/// average degree 20, 128 f32 features, a 616 MB file, into 4 parts peaked at 2.45 GiB, 4.0 times the
/// file; Cora's partitioning fits in well under 2 GiB. Four times the file and a quarter GiB, rounded up
/// to whole GiB, between 2 and 8.
pub fn coordinator_memory_gib(dataset_bytes: u64) -> f64 {
    let gib = dataset_bytes as f64 / f64::from(1u32 << 30);
    (0.25 + 4.0 * gib)
        .ceil()
        .clamp(COORDINATOR_MIN_GIB, COORDINATOR_MAX_GIB)
}

/// The size of the job's dataset file (at a URL: its object's), or, for a generated one, of the file it
/// would be (f32 features, i32 neighbours, i64 offsets, labels).
///
/// A chunked dataset counts what its coordinator holds instead: the streaming partitioner's per-node
/// arrays and two edge chunks ([`chunked_coordinator_bytes`]), never the dataset.
fn dataset_bytes(spec: &JobSpec) -> Result<u64> {
    if let Some(path) = &spec.dataset.path {
        if store::is_url(path) {
            let url = path.to_string_lossy();
            let (base, name) = url
                .trim_end_matches('/')
                .rsplit_once('/')
                .with_context(|| format!("dataset.path: {url} names no file"))?;
            let remote = Remote::open(base)?;
            if is_chunked_url(&url) {
                let bytes = remote
                    .get(name, physalia_graph::chunked::MANIFEST_FILE)?
                    .with_context(|| format!("dataset.path: {url} holds no manifest"))?;
                let text = String::from_utf8_lossy(&bytes);
                let origin = format!("{url}{}", physalia_graph::chunked::MANIFEST_FILE);
                let manifest = physalia_graph::chunked::Manifest::parse(Path::new(&origin), &text)?;
                return Ok(chunked_coordinator_bytes(&manifest));
            }
            return remote
                .size("", name)
                .with_context(|| format!("dataset.path: {url}"));
        }
        if physalia_graph::is_chunked(path) {
            let ds = physalia_graph::ChunkedDataset::open(path)
                .with_context(|| format!("dataset.path: {}", path.display()))?;
            return Ok(chunked_coordinator_bytes(ds.manifest()));
        }
        return Ok(std::fs::metadata(path)
            .with_context(|| format!("dataset.path: {}", path.display()))?
            .len());
    }
    let Some(synth) = &spec.dataset.synth else {
        return Ok(0);
    };
    let (nodes, degree) = match (synth.nodes, synth.scale) {
        (Some(n), _) => (n as f64, synth.avg_degree.unwrap_or(0.0)),
        (None, Some(scale)) => (
            2f64.powi(scale as i32),
            2.0 * f64::from(synth.edge_factor.unwrap_or(0)),
        ),
        (None, None) => return Ok(0),
    };
    Ok((nodes * (4.0 * f64::from(synth.feat_dim) + 4.0 * degree + 16.0)) as u64)
}
/// After its platform object ended, how long the record may take to say the job ended before the
/// coordinator is taken for lost: its process is gone by then, so this only covers a record read just
/// before its last write (object stores read their writes).
const GRACE: Duration = Duration::from_secs(5);

/// The price of the coordinator's container (1 vCPU, `memory_gib`) a second on the job's platform: the
/// per-vCPU and per-GiB prices of the platform's catalog (Fargate's on ecs, ACI's on aci); where the
/// catalog prices whole nodes (kubernetes), one vCPU's share of the job's SKU.
pub fn coordinator_usd_per_s(job: &ResolvedJob, memory_gib: f64) -> Result<f64> {
    let catalog = physalia_planner::Catalog::builtin();
    let per_unit = catalog.skus.iter().find_map(|s| {
        let p = &s.price;
        (s.backend == job.spec.backend.name && !s.is_gpu())
            .then_some(())
            .and(p.usd_per_vcpu_second.zip(p.usd_per_gib_second))
    });
    if let Some((vcpu, gib)) = per_unit {
        return Ok(vcpu * COORDINATOR_VCPUS + gib * memory_gib);
    }
    Ok(job.priced.usd_per_worker_s * COORDINATOR_VCPUS / job.sku.vcpus.max(COORDINATOR_VCPUS))
}

/// The backend of the job's platform that starts, follows and stops its coordinator.
/// What cluster mode needs of the job file beyond what validation checks, refused before anything is
/// made: a job store at a URL, the coordinator's identity, one seed.
/// What cluster mode asks of a job file before anything is created (`submit`, and `validate`): a job
/// store at a URL, one run, the platform's coordinator settings.
pub fn check_settings(spec: &JobSpec) -> Result<()> {
    let kind = spec.backend.name.as_str();
    if !store::is_url(&spec.output.dir) {
        bail!(
            "output.dir: cluster mode (the default on {kind}) keeps the job's record where the \
             coordinator on {kind} and this machine both reach it: an s3://, az:// or gs:// URL, not \
             {}; or set backend.mode: client to coordinate from this machine",
            spec.output.dir.display()
        );
    }
    if spec.train.runs > 1 {
        bail!(
            "train.runs: repeated seeds train one after another in the submitting process; set \
             backend.mode: client, or submit one job per seed"
        );
    }
    spec.backend.check_cluster()?;
    Ok(())
}

/// `physalia submit` in cluster mode. `spec` is resolved (its goal applied).
pub fn submit(
    job_file: &Path,
    mut job: ResolvedJob,
    obs: &dyn Observer,
    detach: bool,
) -> Result<()> {
    let file = job_file.display().to_string();
    let kind = job.spec.backend.name;
    check_settings(&job.spec).with_context(|| file.clone())?;
    let env = coordinator_env(&job, &|k| std::env::var(k).ok()).with_context(|| file.clone())?;
    let image = job
        .spec
        .backend
        .coordinator_image()
        .context("the platform's section names no image")?
        .to_string();
    let backend = crate::driver::platform::job_free_backend(&job).with_context(|| file.clone())?;
    crate::driver::platform::preflight(&job, backend.as_ref(), obs)
        .with_context(|| format!("{file}: backend.{}", kind.as_str()))?;
    let spec = &mut job.spec;
    let remote = Remote::open(&spec.output.dir.to_string_lossy())
        .with_context(|| format!("{file}: output.dir"))?;
    remote
        .check_writable()
        .with_context(|| format!("{file}: output.dir"))?;
    // a raw folder is imported here into a file (as a local job imports it on the fly), whose bytes
    // size the coordinator and are uploaded
    let imported = tempfile::tempdir().context("creating a temporary folder")?;
    if let Some(path) = spec.dataset.path.clone()
        && !store::is_url(&path)
    {
        let upload = dataset_to_upload(&spec.dataset, &path, imported.path(), obs)
            .with_context(|| format!("{file}: dataset.path: {}", path.display()))?;
        let url = upload_dataset(&remote, &upload, obs)
            .with_context(|| format!("{file}: dataset.path: {}", path.display()))?;
        spec.dataset.format = if physalia_graph::is_chunked(&upload) {
            // the coordinator finds the folder's manifest where it downloads it
            crate::spec::DatasetFormat::Auto
        } else {
            crate::spec::DatasetFormat::Safetensors
        };
        spec.dataset.path = Some(PathBuf::from(url));
    }
    let memory_gib = coordinator_memory_gib(dataset_bytes(spec).with_context(|| file.clone())?);
    let id = remote.new_job_id(&spec.job_name(job_file))?;
    remote.put(&id, "job.json", json_bytes(spec)?)?;
    // readable by `status` from now on; the coordinator rewrites it once it runs
    let mut status = JobStatus::starting(kind.as_str(), 0, spec.train.epochs as usize);
    status.coordinator = None;
    remote.put(&id, "status.json", json_bytes(&status)?)?;
    remote.put(&id, "metrics.jsonl", Vec::new())?;
    start_and_follow(
        Started {
            remote: &remote,
            id: &id,
            backend: backend.as_ref(),
            image,
            env,
            memory_gib,
            resume: false,
            status,
        },
        obs,
        detach,
    )
}

/// A job in the store whose coordinator is about to start.
struct Started<'a> {
    remote: &'a Remote,
    id: &'a str,
    backend: &'a dyn Backend,
    image: String,
    env: BTreeMap<String, String>,
    /// The coordinator's memory ([`coordinator_memory_gib`]).
    memory_gib: f64,
    /// The coordinator continues the record from its newest checkpoint.
    resume: bool,
    /// The record's status, rewritten as failed when the coordinator cannot start.
    status: JobStatus,
}

/// Starts job `s.id`'s coordinator on its platform, records its handle, and follows the job (or
/// returns at once with `detach`).
fn start_and_follow(s: Started, obs: &dyn Observer, detach: bool) -> Result<()> {
    let Started {
        remote,
        id,
        backend,
        image,
        env,
        memory_gib,
        resume,
        mut status,
    } = s;
    let kind = backend.name();
    let id = id.to_string();
    let job_url = format!("{}/{id}", remote.url());
    let mut command = vec![
        "/usr/local/bin/physalia".into(),
        "coordinate".into(),
        job_url.clone(),
        "--control-port".into(),
        crate::driver::platform::COORDINATOR_PORT.to_string(),
    ];
    if resume {
        command.push("--resume".into());
    }
    let coordinator = CoordinatorSpec {
        job_id: id.clone(),
        image,
        command,
        env,
        cpu: COORDINATOR_VCPUS,
        memory_gib,
        control_port: crate::driver::platform::COORDINATOR_PORT,
        labels: BTreeMap::new(),
    };
    obs.progress(&format!(
        "job {id}: starting its coordinator on {kind} (record: {job_url})"
    ));
    // from here a Ctrl-C detaches: the coordinator about to run must be recorded to be followed,
    // cancelled and cleaned up
    catch_interrupt();
    let handle = match block_on(backend.launch_coordinator(&coordinator))? {
        Ok(h) => h,
        Err(e) => {
            let msg = format!("starting the coordinator: {e}");
            status.state = JobState::Failed;
            status.error = Some(msg.clone());
            status.updated_unix_s = physalia_control::record::unix_now();
            let _ = remote.put(&id, "status.json", json_bytes(&status)?);
            bail!("job {id}: {msg}");
        }
    };
    remote.put(&id, COORDINATOR_JSON, json_bytes(&handle)?)?;
    let hints = format!(
        "  follow it:  physalia logs {id} --dir {store} --rank coordinator --follow\n  \
         its state:  physalia status {id} --dir {store}\n  stop it:    physalia cancel {id} --dir {store}",
        store = remote.url()
    );
    if detach {
        obs.detached(&id, &job_url)?;
        obs.notice(&format!(
            "job {id} runs on {kind} (cluster mode); its record: {job_url}\n{hints}"
        ));
        return Ok(());
    }
    follow(remote, &id, backend, &handle, obs, &hints)
}

/// `physalia submit --resume STORE/JOB`: continues a cluster-mode job whose coordinator is gone (its
/// container killed, its node lost) from its newest checkpoint in the store, with a new coordinator on
/// the same platform, and follows it as `submit` does. Refused while the old coordinator still runs,
/// and for a job that ended.
pub fn resume(job_url: &str, obs: &dyn Observer, detach: bool) -> Result<()> {
    let (base, id) = job_url
        .trim_end_matches('/')
        .rsplit_once('/')
        .with_context(|| format!("{job_url}: not a job's URL (STORE/JOB_ID)"))?;
    let remote = Remote::open(base)?;
    let bytes = remote
        .get(id, "job.json")?
        .with_context(|| format!("{job_url}: no job.json in the store"))?;
    let spec: JobSpec = serde_json::from_slice(&bytes)
        .with_context(|| format!("{job_url}/job.json: not a job record"))?;
    spec.validate()
        .with_context(|| format!("{job_url}/job.json: the recorded job"))?;
    if spec.backend.mode() != crate::spec::Mode::Cluster {
        bail!(
            "{job_url}: a client-mode job: resume it from its staging folder on the machine that \
             coordinated it (`physalia submit --resume ~/.cache/physalia/staging/{id}`)"
        );
    }
    let status_bytes = remote
        .get(id, "status.json")?
        .with_context(|| format!("{job_url}: no status.json in the store"))?;
    let status: JobStatus = serde_json::from_slice(&status_bytes)
        .with_context(|| format!("{job_url}/status.json: not a job status"))?;
    if status.state.is_final() {
        bail!(
            "{job_url}: the job {}; there is nothing to resume",
            status.state.as_str()
        );
    }
    let job = ResolvedJob::new(spec).with_context(|| format!("{job_url}/job.json"))?;
    let spec = &job.spec;
    let backend = crate::driver::platform::job_free_backend(&job)
        .with_context(|| format!("{job_url}/job.json"))?;
    if let Some(bytes) = remote.get(id, COORDINATOR_JSON)? {
        let old: CoordinatorHandle = serde_json::from_slice(&bytes)
            .with_context(|| format!("{job_url}/{COORDINATOR_JSON}: not a coordinator handle"))?;
        match block_on(backend.coordinator_status(&old))? {
            Ok(s) if matches!(s.state, WorkerState::Pending | WorkerState::Running) => bail!(
                "{job_url}: its coordinator still runs ({}); follow it with `physalia logs {id} --dir \
                 {base} --rank coordinator --follow`, or stop it with `physalia cancel {id} --dir {base}`",
                old.objects
                    .iter()
                    .map(|o| format!("{} {}", o.kind, o.id))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            _ => {}
        }
        // what the dead coordinator left on its platform goes first (its launches' workers, then its
        // ended task, pod or group): the new one takes the same names
        let tmp = tempfile::tempdir().context("making a folder for the job's record")?;
        let dir = remote.fetch(id, tmp.path())?;
        crate::driver::distributed::clean_up_after(&dir, &status, obs)
            .with_context(|| format!("{job_url}: stopping the gone coordinator's workers"))?;
        block_on(backend.stop_coordinator(&old))?.with_context(|| {
            format!("{job_url}: deleting the gone coordinator's platform objects")
        })?;
    }
    let checkpoints = remote.list(id, "checkpoints")?;
    if checkpoints.is_empty() {
        bail!("{job_url}: no checkpoint in the store to resume from");
    }
    let env = coordinator_env(&job, &|k| std::env::var(k).ok())?;
    let image = spec
        .backend
        .coordinator_image()
        .context("the platform's section names no image")?
        .to_string();
    obs.progress(&format!(
        "resuming {id} (recorded through epoch {} of {}) with a new coordinator",
        status.epoch, status.epochs
    ));
    start_and_follow(
        Started {
            remote: &remote,
            id,
            backend: backend.as_ref(),
            image,
            env,
            memory_gib: coordinator_memory_gib(dataset_bytes(spec)?),
            resume: true,
            status,
        },
        obs,
        detach,
    )
}

/// Where the coordinator finds what this machine found in its environment, none of it a credential:
/// an Azure job store's storage account (`az://CONTAINER/PREFIX` names no account; the CLI read
/// `AZURE_STORAGE_ACCOUNT_NAME`, and its endpoint if set: a sovereign cloud's), and on aci which of the
/// group's identities is the coordinator's (`AZURE_MSI_RESOURCE_ID`: a group that pulls from a registry
/// holds the pull identity too, and the metadata service then wants to be told).
fn coordinator_env(
    job: &ResolvedJob,
    var: &dyn Fn(&str) -> Option<String>,
) -> Result<BTreeMap<String, String>> {
    let mut env = BTreeMap::new();
    let dir = job.spec.output.dir.to_string_lossy();
    let azure = ["az://", "abfs://", "abfss://", "azure://"]
        .iter()
        .any(|s| dir.starts_with(s));
    if azure {
        let account = var("AZURE_STORAGE_ACCOUNT_NAME");
        // `abfss://container@ACCOUNT.dfs.core.windows.net/...` names it itself
        if account.is_none() && !dir.contains('@') {
            bail!(
                "output.dir: {dir} names no storage account: set AZURE_STORAGE_ACCOUNT_NAME (infra/azure's \
                 `storage_account`), which the coordinator is given too"
            );
        }
        for key in ["AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ENDPOINT"] {
            if let Some(v) = var(key) {
                env.insert(key.to_string(), v);
            }
        }
    }
    crate::driver::platform::of_job(job).coordinator_env(job, &mut env);
    Ok(env)
}

fn json_bytes(v: &impl serde::Serialize) -> Result<Vec<u8>> {
    let mut b = serde_json::to_vec_pretty(v)?;
    b.push(b'\n');
    Ok(b)
}

/// The file cluster mode uploads for the dataset at `path`: the file itself, or a raw folder (the generic
/// or OGB layout) imported into `tmp` as `<folder name>.safetensors`, as a local job imports it on the fly.
fn dataset_to_upload(
    spec: &crate::spec::DatasetSpec,
    path: &Path,
    tmp: &Path,
    obs: &dyn Observer,
) -> Result<PathBuf> {
    if !path.is_dir() || physalia_graph::is_chunked(path) {
        return Ok(path.to_path_buf());
    }
    let folder = crate::spec::DatasetSpec {
        path: Some(path.to_path_buf()),
        ..spec.clone()
    };
    let crate::driver::dataset::Source::Memory(ds) = crate::driver::dataset::load(&folder, obs)?
    else {
        bail!("expected a raw dataset folder (generic or OGB layout)");
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "dataset".into());
    let to = tmp.join(format!("{name}.safetensors"));
    crate::driver::step(obs, "importing the dataset folder into a file", || {
        ds.write(&to)
    })
    .with_context(|| format!("writing {}", to.display()))?;
    Ok(to)
}

/// What a cluster-mode coordinator holds of a chunked dataset while it partitions it: the streaming
/// partitioner's arrays (the assignment and the previous pass's, about 8 bytes a node) and two edge
/// chunks read ahead; it keeps the graph's structure on disk, never in memory, and never the features.
pub fn chunked_coordinator_bytes(m: &physalia_graph::chunked::Manifest) -> u64 {
    let largest = m
        .tensors
        .indices
        .chunks
        .iter()
        .map(|c| c.bytes)
        .max()
        .unwrap_or(0);
    m.num_nodes as u64 * 8 + 2 * largest
}

/// The tensors a cluster-mode coordinator downloads of a chunked dataset: the graph's structure, which
/// the streaming partitioner and the commit's cut count read. Features, labels and splits stay in the
/// store; workers get the chunks they read streamed through the coordinator.
const STRUCTURE: [&str; 2] = ["indptr", "indices"];

/// Uploads the chunked dataset folder at `dir` to `<store>/.datasets/<manifest fingerprint>-<folder
/// name>/` unless its manifest is there already: every chunk file, then the manifest, whose presence
/// marks a whole upload. Returns its URL (ending with `/`).
fn upload_chunked(remote: &Remote, dir: &Path, obs: &dyn Observer) -> Result<String> {
    use physalia_graph::chunked::MANIFEST_FILE;
    let ds = physalia_graph::ChunkedDataset::open(dir)?;
    let m = ds.manifest();
    let folder = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .context("no folder name")?;
    let name = format!("{}-{folder}", m.fingerprint());
    let url = format!("{}/{DATASETS}/{name}/", remote.url());
    let manifest = format!("{name}/{MANIFEST_FILE}");
    if remote.exists(DATASETS, &manifest)? {
        obs.progress(&format!("dataset already in the store: {url}"));
        return Ok(url);
    }
    let chunks: Vec<_> = m
        .tensors
        .all()
        .into_iter()
        .flat_map(|(_, t)| t.chunks.iter())
        .collect();
    obs.progress(&format!(
        "uploading the chunked dataset ({} files, {} bytes) to {url}",
        chunks.len(),
        m.data_bytes()
    ));
    for c in chunks {
        let file = dir.join(&c.file);
        remote
            .put_file(DATASETS, &format!("{name}/{}", c.file), &file)
            .with_context(|| format!("uploading {}", file.display()))?;
    }
    remote.put_file(DATASETS, &manifest, &dir.join(MANIFEST_FILE))?;
    Ok(url)
}

/// Downloads what a coordinator needs of the chunked dataset at `url` (a store folder ending with `/`)
/// into `dir`: the manifest and the structure's chunks ([`STRUCTURE`]; ones already here and whole are
/// kept). Returns the folder here and the store's handle on the rest.
fn download_chunked(url: &str, dir: &Path) -> Result<(PathBuf, StoredChunks)> {
    let (base, name) = url
        .trim_end_matches('/')
        .rsplit_once('/')
        .with_context(|| format!("dataset.path: {url} names no folder"))?;
    download_chunked_from(Remote::open(base)?, name, dir)
}

/// [`download_chunked`] of the folder `name` in `remote`.
fn download_chunked_from(
    remote: Remote,
    name: &str,
    dir: &Path,
) -> Result<(PathBuf, StoredChunks)> {
    use physalia_graph::chunked::MANIFEST_FILE;
    let url = format!("{}/{name}/", remote.url());
    let to = dir.join(name);
    std::fs::create_dir_all(&to).with_context(|| format!("creating {}", to.display()))?;
    remote
        .get_file(name, MANIFEST_FILE, &to.join(MANIFEST_FILE))
        .with_context(|| format!("dataset.path: downloading {url}{MANIFEST_FILE}"))?;
    let ds = physalia_graph::ChunkedDataset::open(&to)?;
    for (tensor, chunks) in ds.manifest().tensors.all() {
        if !STRUCTURE.contains(&tensor) {
            continue;
        }
        for c in &chunks.chunks {
            let file = to.join(&c.file);
            let whole = std::fs::read(&file).is_ok_and(|b| {
                b.len() as u64 == c.bytes && physalia_graph::format::checksum(&b) == c.xxh3
            });
            if whole {
                continue;
            }
            if let Some(parent) = file.parent() {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("creating {}", parent.display()))?;
            }
            remote
                .get_file(name, &c.file, &file)
                .with_context(|| format!("dataset.path: downloading {url}{}", c.file))?;
        }
    }
    Ok((
        to,
        StoredChunks {
            remote,
            folder: name.to_string(),
        },
    ))
}

/// Uploads the dataset file at `path` to `<store>/.datasets/<xxh3 of its bytes>-<file name>` unless it
/// is there already, or a chunked dataset folder ([`upload_chunked`]); returns its URL.
fn upload_dataset(remote: &Remote, path: &Path, obs: &dyn Observer) -> Result<String> {
    if physalia_graph::is_chunked(path) {
        return upload_chunked(remote, path, obs);
    }
    let meta = std::fs::metadata(path).context("cannot read")?;
    if !meta.is_file() {
        bail!("cluster mode uploads a dataset file; this is not one");
    }
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .context("no file name")?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut f = std::fs::File::open(path).context("cannot open")?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let name = format!("{:016x}-{file_name}", hasher.digest());
    let url = format!("{}/{DATASETS}/{name}", remote.url());
    if remote.exists(DATASETS, &name)? {
        obs.progress(&format!("dataset already in the store: {url}"));
        return Ok(url);
    }
    obs.progress(&format!(
        "uploading the dataset ({} bytes) to {url}",
        meta.len()
    ));
    remote.put_file(DATASETS, &name, path)?;
    Ok(url)
}

/// Downloads the dataset at `url` (in a store) into `dir`; returns its path there.
fn download_dataset(url: &str, dir: &Path) -> Result<PathBuf> {
    let (base, name) = url
        .trim_end_matches('/')
        .rsplit_once('/')
        .with_context(|| format!("dataset.path: {url} names no file"))?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let to = dir.join(name);
    Remote::open(base)?
        .get_file("", name, &to)
        .with_context(|| format!("dataset.path: downloading {url}"))?;
    Ok(to)
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Ctrl-C detaches from a followed job instead of killing this process mid-step.
fn catch_interrupt() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

/// Follows job `id` in the store until it ends: its epochs as they are recorded, then the final lines;
/// deletes the coordinator's platform objects once the job ended.
fn follow(
    remote: &Remote,
    id: &str,
    backend: &dyn Backend,
    handle: &CoordinatorHandle,
    obs: &dyn Observer,
    hints: &str,
) -> Result<()> {
    let tmp = tempfile::tempdir().context("making a folder for the job's record")?;
    let mut printed = 0;
    let mut asked = Instant::now() - Duration::from_secs(60);
    let mut ended: Option<(Instant, String)> = None;
    loop {
        if INTERRUPTED.load(Ordering::SeqCst) {
            obs.notice(&format!(
                "\ndetached: job {id} goes on without this process\n{hints}"
            ));
            return Ok(());
        }
        let dir = match remote.fetch(id, tmp.path()) {
            Ok(d) => d,
            Err(e) => {
                obs.notice(&format!("warning: reading the job's record: {e:#}"));
                sleep_unless_interrupted(Duration::from_secs(2));
                continue;
            }
        };
        let status = JobStatus::read(&dir.join("status.json")).map_err(anyhow::Error::msg)?;
        print_new_epochs(&dir, status.epochs, &mut printed, obs)?;
        if status.state.is_final() {
            // its last mirror pass (the report) and its own clean-up come after the recorded end;
            // the final status may have been uploaded before the last epochs' metrics
            wait_ended(backend, handle, Duration::from_secs(30));
            let dir = remote.fetch(id, tmp.path()).unwrap_or(dir);
            print_new_epochs(&dir, status.epochs, &mut printed, obs)?;
            if let Err(e) = block_on(backend.stop_coordinator(handle))? {
                obs.notice(&format!(
                    "warning: deleting the coordinator's platform objects: {e}"
                ));
            }
            return finished(remote, id, &dir, &status, obs);
        }
        if asked.elapsed() >= Duration::from_secs(5) {
            asked = Instant::now();
            match block_on(backend.coordinator_status(handle))? {
                Ok(s) if matches!(s.state, WorkerState::Pending | WorkerState::Running) => {}
                Ok(s) => {
                    let why = format!(
                        "{:?}{}",
                        s.state,
                        s.detail.map(|d| format!(": {d}")).unwrap_or_default()
                    );
                    ended.get_or_insert((Instant::now(), why));
                }
                Err(e) => obs.notice(&format!("warning: asking for the coordinator: {e}")),
            }
        }
        if let Some((t, why)) = &ended
            && t.elapsed() >= GRACE
        {
            let log = block_on(backend.coordinator_logs(handle))?.unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            let _ = block_on(backend.stop_coordinator(handle));
            // the record says so, or it would read as running until it is taken for lost
            let msg = format!("its coordinator ended ({why}) without recording the job's end");
            let mut failed = status;
            failed.state = JobState::Failed;
            failed.error = Some(msg.clone());
            failed.updated_unix_s = physalia_control::record::unix_now();
            let _ = remote.put(id, "status.json", json_bytes(&failed)?);
            let output = match tail.is_empty() {
                true => String::new(),
                false => format!(
                    "; its last output:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                ),
            };
            bail!("job {id}: {msg}{output}");
        }
        sleep_unless_interrupted(Duration::from_secs(1));
    }
}

/// Prints the epoch lines of the fetched record `dir` past the first `printed`.
fn print_new_epochs(
    dir: &Path,
    epochs: usize,
    printed: &mut usize,
    obs: &dyn Observer,
) -> Result<()> {
    let metrics = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics).unwrap_or_default();
    let lines = MetricsLine::parse_all(&text, &metrics.display().to_string())
        .map_err(anyhow::Error::msg)?;
    for line in lines.iter().skip(*printed) {
        obs.progress(&epoch_line(epochs, line));
    }
    *printed = (*printed).max(lines.len());
    Ok(())
}

/// Waits until the coordinator's platform object ended (or `timeout`, or a Ctrl-C).
fn wait_ended(backend: &dyn Backend, handle: &CoordinatorHandle, timeout: Duration) {
    let until = Instant::now() + timeout;
    while Instant::now() < until && !INTERRUPTED.load(Ordering::SeqCst) {
        match block_on(backend.coordinator_status(handle)) {
            Ok(Ok(s)) if matches!(s.state, WorkerState::Pending | WorkerState::Running) => {}
            _ => return,
        }
        sleep_unless_interrupted(Duration::from_millis(500));
    }
}

fn sleep_unless_interrupted(d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until && !INTERRUPTED.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A recorded epoch as the coordinator printed it.
fn epoch_line(epochs: usize, line: &MetricsLine) -> String {
    let by_rank: Vec<physalia_gnn::EpochMetrics> = if line.workers.is_empty() {
        vec![line.metrics.clone()]
    } else {
        line.workers
            .iter()
            .map(|w| {
                let mut m = line.metrics.clone();
                m.train_s = w.train_s;
                m.exchange = w.exchange.clone();
                m
            })
            .collect()
    };
    crate::driver::distributed::epoch_line(epochs, &by_rank, line.usd)
}

/// The final lines of a job that ended, from its record; an error unless it succeeded.
fn finished(
    remote: &Remote,
    id: &str,
    dir: &Path,
    status: &JobStatus,
    obs: &dyn Observer,
) -> Result<()> {
    let url = format!("{}/{id}", remote.url());
    match status.state {
        JobState::Succeeded => {
            let path = dir.join("summary.json");
            if !path.is_file() {
                bail!("{url}: the job succeeded but has no summary.json");
            }
            let summary = physalia_control::JobSummary::read(&path)
                .map_err(|e| anyhow::anyhow!("{url}/summary.json: {e}"))?;
            let name = summary.run.job.clone();
            let report = dir
                .join("report.html")
                .is_file()
                .then(|| format!("{url}/report.html"));
            obs.finished(&super::Finished {
                name: &name,
                summary: &summary,
                location: &url,
                report: report.as_deref(),
            })
        }
        JobState::Cancelled => bail!("job {id} was cancelled; its record is in {url}"),
        JobState::Failed => bail!(
            "job {id} failed: {}; its record is in {url}",
            status.error.as_deref().unwrap_or("no reason recorded")
        ),
        JobState::Running => unreachable!("called for a job that ended"),
    }
}

/// `physalia coordinate JOB_URL`: the coordinator of a cluster-mode job, inside the platform.
pub fn coordinate(
    job_url: &str,
    control_port: u16,
    resume: bool,
    obs: &dyn Observer,
) -> Result<()> {
    store::use_platform_identity();
    let (base, id) = job_url
        .trim_end_matches('/')
        .rsplit_once('/')
        .with_context(|| format!("{job_url}: not a job's URL (STORE/JOB_ID)"))?;
    let remote = Remote::open(base)?;
    let bytes = remote
        .get(id, "job.json")?
        .with_context(|| format!("{job_url}: no job.json in the store"))?;
    let recorded: JobSpec = serde_json::from_slice(&bytes)
        .with_context(|| format!("{job_url}/job.json: not a job record"))?;
    recorded
        .validate()
        .with_context(|| format!("{job_url}/job.json: the recorded job"))?;
    let work = std::env::temp_dir().join("physalia-coordinator");
    let mut spec = recorded.clone();
    spec.backend.coordinate_inside();
    let mut partitions = None;
    let mut stored_chunks = None;
    if let Some(path) = &spec.dataset.path
        && store::is_url(path)
    {
        let url = path.to_string_lossy().into_owned();
        if is_chunked_url(&url) {
            let (local, chunks) = download_chunked(&url, &work.join("datasets"))?;
            spec.dataset.path = Some(local);
            stored_chunks = Some(chunks);
        } else {
            spec.dataset.path = Some(download_dataset(&url, &work.join("datasets"))?);
        }
        partitions = Some(StoredPartitions::beside(&url)?);
    }
    // resuming: the record as the gone coordinator left it in the store, checkpoints included
    let resume = match resume {
        true => {
            let dir = remote.fetch_to_resume(id, &work.join("jobs"))?;
            Some(crate::driver::distributed::resume_point(&dir)?)
        }
        false => None,
    };
    let memory_gib = coordinator_memory_gib(dataset_bytes(&spec)?);
    let job = ResolvedJob::new(spec).with_context(|| format!("{job_url}/job.json"))?;
    let role = Role {
        job_id: id.to_string(),
        staging: work.join("jobs"),
        // the size submit chose, from the same dataset's bytes
        coordinator_usd_per_s: coordinator_usd_per_s(&job, memory_gib)?,
        recorded,
        partitions,
        stored_chunks,
        control_port,
    };
    let name = job.spec.name.clone().unwrap_or_else(|| id.to_string());
    let result = crate::driver::distributed::run(&job, &name, obs, resume, false, Some(&role));
    if let Err(e) = release_template(&remote, &job, id) {
        obs.notice(&format!(
            "warning: deleting the coordinator's task definition: {e:#}"
        ));
    }
    result
}

/// Deletes the coordinator's template objects (the ECS task definition), which outlive its task: the
/// task itself ends with this process.
fn release_template(remote: &Remote, job: &ResolvedJob, id: &str) -> Result<()> {
    let Some(bytes) = remote.get(id, COORDINATOR_JSON)? else {
        return Ok(());
    };
    let mut handle: CoordinatorHandle = serde_json::from_slice(&bytes)?;
    handle.objects.retain(|o| o.kind == "task-definition");
    if handle.objects.is_empty() {
        return Ok(());
    }
    let backend = crate::driver::platform::job_free_backend(job)?;
    block_on(backend.stop_coordinator(&handle))??;
    Ok(())
}

/// The coordinator handle recorded in a fetched job directory, if the job ran in cluster mode.
pub fn recorded_handle(dir: &Path) -> Result<Option<CoordinatorHandle>> {
    let path = dir.join(COORDINATOR_JSON);
    match std::fs::read(&path) {
        Ok(b) => Ok(Some(serde_json::from_slice(&b).with_context(|| {
            format!("{}: not a coordinator handle", path.display())
        })?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Stops the coordinator of the recorded job `spec` and deletes its platform objects.
pub fn stop_coordinator(spec: &JobSpec, handle: &CoordinatorHandle) -> Result<()> {
    let backend = crate::driver::platform::job_free_backend(&ResolvedJob::new(spec.clone())?)?;
    block_on(backend.stop_coordinator(handle))?
        .with_context(|| format!("stopping the coordinator of job {}", handle.job_id))
}

/// The coordinator's output as its platform keeps it, and whether it has ended (its output is whole).
pub fn coordinator_logs(spec: &JobSpec, handle: &CoordinatorHandle) -> Result<(String, bool)> {
    let backend = crate::driver::platform::job_free_backend(&ResolvedJob::new(spec.clone())?)?;
    // asked first: output read after the end is whole
    let ended = !matches!(
        block_on(backend.coordinator_status(handle))?.map(|s| s.state),
        Ok(WorkerState::Pending | WorkerState::Running)
    );
    let text = block_on(backend.coordinator_logs(handle))?
        .with_context(|| format!("reading the coordinator's output of job {}", handle.job_id))?;
    Ok((text, ended))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolved(spec: JobSpec) -> ResolvedJob {
        ResolvedJob::new(spec).unwrap()
    }

    fn job(backend: &str) -> JobSpec {
        let text = format!(
            "dataset: cora.safetensors\nmodel: {{kind: gcn}}\nworkers: 2\noutput: {{dir: s3://b/jobs}}\nbackend:\n  name: {backend}\n  ecs:\n    cluster: physalia\n    subnets: [subnet-1]\n    security_groups: [sg-1]\n    execution_role_arn: arn:aws:iam::123456789012:role/x\n    coordinator_task_role_arn: arn:aws:iam::123456789012:role/c\n    image: img\n    sku: ecs-fargate-2x8\n  kubernetes:\n    image: img\n    sku: gke-g2-standard-8\n"
        );
        crate::spec::parse_str(&text, "job.yaml", &[]).unwrap()
    }

    /// A chunked dataset goes to the store as its chunk files and then its manifest, once; a
    /// coordinator downloads the manifest and the graph's structure only, and the other chunks are
    /// streamed from the store with the manifest's bytes.
    #[test]
    fn a_chunked_dataset_is_uploaded_once_and_its_coordinator_downloads_the_structure_only() {
        use physalia_graph::chunked::MANIFEST_FILE;
        let quiet = crate::driver::Plain { quiet: true };
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("sbm");
        let ds = physalia_graph::synth::sbm(&physalia_graph::SbmParams {
            num_nodes: 3000,
            num_classes: 4,
            avg_degree: 6.0,
            feat_dim: 8,
            seed: 1,
            ..Default::default()
        })
        .unwrap();
        let manifest = physalia_graph::chunked::write_chunked(&ds, &dir, 700).unwrap();
        let remote = Remote::in_memory("s3://b/jobs");
        let url = upload_dataset(&remote, &dir, &quiet).unwrap();
        let name = format!("{}-sbm", manifest.fingerprint());
        assert_eq!(url, format!("s3://b/jobs/{DATASETS}/{name}/"));
        assert!(is_chunked_url(&url));
        let stored = remote.list(DATASETS, &name).unwrap();
        let files: Vec<_> = manifest
            .tensors
            .all()
            .into_iter()
            .flat_map(|(_, t)| t.chunks.iter().map(|c| (c.file.clone(), c.bytes)))
            .collect();
        assert_eq!(stored.len(), files.len() + 1, "{stored:?}");
        for (file, bytes) in &files {
            assert!(stored.contains(&(file.clone(), *bytes)), "{file} missing");
        }
        // a second upload finds the manifest and sends nothing
        let before = remote.list(DATASETS, &name).unwrap();
        assert_eq!(upload_dataset(&remote, &dir, &quiet).unwrap(), url);
        assert_eq!(remote.list(DATASETS, &name).unwrap(), before);

        let work = tempfile::tempdir().unwrap();
        let (local, chunks) =
            download_chunked_from(remote.child(DATASETS), &name, work.path()).unwrap();
        assert!(physalia_graph::is_chunked(&local));
        for (tensor, t) in manifest.tensors.all() {
            for c in &t.chunks {
                let here = local.join(&c.file).is_file();
                assert_eq!(here, STRUCTURE.contains(&tensor), "{}", c.file);
                // every chunk, here or not, streams from the store as the manifest says
                let mut rx = chunks.source(&c.file).open();
                let mut got = Vec::new();
                while let Some(piece) = rx.blocking_recv() {
                    got.extend_from_slice(&piece.unwrap());
                }
                assert_eq!(got, std::fs::read(dir.join(&c.file)).unwrap(), "{}", c.file);
            }
        }
        assert_eq!(
            std::fs::read(local.join(MANIFEST_FILE)).unwrap(),
            std::fs::read(dir.join(MANIFEST_FILE)).unwrap()
        );
        // a missing object is an error on the channel, naming it
        let mut rx = chunks.source("features/nope.bin").open();
        let e = rx.blocking_recv().unwrap().unwrap_err();
        assert!(e.contains("features/nope.bin"), "{e}");
        // the coordinator's size follows the nodes, not the features
        assert!(chunked_coordinator_bytes(&manifest) < 3000 * 8 + 2 * 700 * 8 * 8);
    }

    /// Cluster mode uploads a file: a raw folder (here the generic layout) is imported into one first,
    /// named after the folder, holding the same graph as the folder loaded; a file goes as it is.
    #[test]
    fn a_raw_dataset_folder_is_imported_into_the_file_cluster_mode_uploads() {
        let quiet = crate::driver::Plain { quiet: true };
        let t = tempfile::tempdir().unwrap();
        let folder = t.path().join("tiny");
        std::fs::create_dir_all(&folder).unwrap();
        let (n, f) = (6usize, 2usize);
        let mut edges = String::from("src,dst\n");
        for i in 0..n {
            edges.push_str(&format!("{i},{}\n", (i + 1) % n));
        }
        std::fs::write(folder.join("edges.csv"), edges).unwrap();
        let bin: Vec<u8> = (0..n * f).flat_map(|v| (v as f32).to_le_bytes()).collect();
        std::fs::write(folder.join("features.bin"), bin).unwrap();
        std::fs::write(
            folder.join("features.json"),
            format!(r#"{{"file": "features.bin", "num_nodes": {n}, "feat_dim": {f}, "dtype": "float32", "byte_order": "little"}}"#),
        )
        .unwrap();
        let labels: String = std::iter::once("node,label\n".to_string())
            .chain((0..n).map(|i| format!("{i},{}\n", i % 2)))
            .collect();
        std::fs::write(folder.join("labels.csv"), labels).unwrap();
        std::fs::write(folder.join("train_idx.txt"), "0\n1\n2\n").unwrap();
        std::fs::write(folder.join("val_idx.txt"), "3\n4\n").unwrap();
        std::fs::write(folder.join("test_idx.txt"), "5\n").unwrap();

        let spec = job("ecs").dataset;
        let out = t.path().join("out");
        std::fs::create_dir_all(&out).unwrap();
        let file = dataset_to_upload(&spec, &folder, &out, &quiet).unwrap();
        assert_eq!(file, out.join("tiny.safetensors"));
        let ds = physalia_graph::Dataset::open(&file).unwrap();
        let folder_spec = crate::spec::DatasetSpec {
            path: Some(folder.clone()),
            ..spec.clone()
        };
        let crate::driver::dataset::Source::Memory(loaded) =
            crate::driver::dataset::load(&folder_spec, &quiet).unwrap()
        else {
            panic!("a folder loads into memory");
        };
        assert_eq!(ds.csr().indptr, loaded.csr().indptr);
        assert_eq!(ds.csr().indices, loaded.csr().indices);
        assert_eq!(ds.labels(), &loaded.labels[..]);
        assert_eq!(ds.features_f32().len(), n * f);
        assert_eq!(ds.features_f32()[(n - 1) * f + 1], (n * f - 1) as f32);
        // a file is uploaded as it is
        assert_eq!(dataset_to_upload(&spec, &file, &out, &quiet).unwrap(), file);
    }

    /// The preflight's peak: a prewarmed launch runs beside the current one where a resize restarts
    /// (every cloud platform today, or `resize: restart`); where it happens in place (local) only the
    /// joiners start, so the peak stays `max_workers`.
    #[test]
    fn a_prewarm_counts_as_overlap_only_where_the_resize_restarts() {
        let policy = |resize: &str| {
            physalia_policies::parse_str(&format!(
                "min_workers: 1\nmax_workers: 4\n{resize}prewarm: {{when: epoch == 1, workers: 1}}\nrules:\n  - name: grow\n    when: epoch == 2\n    then: {{set_workers: 4}}\n"
                ),
                "policy.yaml",
            )
            .unwrap()
        };
        let with = |backend: &str, resize: &str| {
            let mut spec = job(backend);
            if backend == "local" {
                spec.output.dir = "jobs".into();
            }
            spec.scaling = Some(policy(resize));
            let job = resolved(spec);
            job.demand()
        };
        // every platform resizes in place: a prewarm starts only the joiners
        let d = with("ecs", "");
        assert_eq!((d.workers, d.overlap_workers), (4, 0));
        let d = with("ecs", "resize: restart\n");
        assert_eq!((d.workers, d.overlap_workers), (4, 3));
        let d = with("local", "");
        assert_eq!((d.workers, d.overlap_workers), (4, 0));
        let d = with("local", "resize: restart\n");
        assert_eq!((d.workers, d.overlap_workers), (4, 3));
        let mut spec = job("ecs");
        spec.scaling = None;
        assert_eq!(resolved(spec).demand().overlap_workers, 0);
    }

    /// The coordinator's memory follows its dataset: 2 GiB for Cora's 4 MB and anything under about
    /// 400 MB, 3 GiB for the 616 MB SBM 1M file measured at 2.45 GiB, at most Fargate's 8 GiB for 1 vCPU.
    #[test]
    fn the_coordinator_is_sized_by_its_dataset() {
        const MB: u64 = 1_000_000;
        assert_eq!(coordinator_memory_gib(0), 2.0);
        assert_eq!(coordinator_memory_gib(4 * MB), 2.0);
        assert_eq!(coordinator_memory_gib(400 * MB), 2.0);
        assert_eq!(coordinator_memory_gib(616 * MB), 3.0);
        assert_eq!(coordinator_memory_gib(1_500 * MB), 6.0);
        assert_eq!(coordinator_memory_gib(50_000 * MB), 8.0);
        // a generated dataset is sized as the file it would be: SBM 1M, degree 20, 128 features
        let mut spec = job("ecs");
        spec.dataset.path = None;
        spec.dataset.synth = Some(crate::spec::SynthSpec {
            kind: crate::spec::SynthKind::Sbm,
            nodes: Some(1_000_000),
            scale: None,
            edge_factor: None,
            classes: 8,
            avg_degree: Some(20.0),
            homophily: None,
            feat_dim: 128,
            seed: 0,
        });
        let bytes = dataset_bytes(&spec).unwrap();
        assert!((600 * MB..620 * MB).contains(&bytes), "{bytes}");
        assert_eq!(coordinator_memory_gib(bytes), 3.0);
    }

    /// The coordinator is billed as a 1 vCPU / 2 GiB Fargate task on ecs; on kubernetes, whose catalog
    /// prices nodes, as one vCPU's share of the job's node.
    #[test]
    fn the_coordinator_is_priced_from_the_platforms_catalog() {
        let catalog = physalia_planner::Catalog::builtin();
        let fargate = catalog.get("ecs-fargate-2x8").unwrap();
        let want = fargate.price.usd_per_vcpu_second.unwrap()
            + 2.0 * fargate.price.usd_per_gib_second.unwrap();
        let got = coordinator_usd_per_s(&resolved(job("ecs")), 2.0).unwrap();
        assert!((got - want).abs() < 1e-15 && got > 0.0, "{got} vs {want}");
        let node = catalog.get("gke-g2-standard-8").unwrap();
        let got = coordinator_usd_per_s(&resolved(job("kubernetes")), 2.0).unwrap();
        assert!((got - node.usd_per_s() / node.vcpus).abs() < 1e-15, "{got}");
    }

    /// The coordinator is told the Azure store's account (and endpoint) this machine was given, and on
    /// aci which identity is its own; nothing else of this machine's environment.
    #[test]
    fn the_coordinator_gets_the_stores_account_and_its_identity() {
        let text = "dataset: cora.safetensors\nmodel: {kind: gcn}\nworkers: 2\noutput: {dir: az://jobs/runs}\nbackend:\n  name: aci\n  aci:\n    subscription_id: s\n    resource_group: rg\n    location: eastus\n    subnet_id: /subscriptions/s/subnets/w\n    image: img\n    coordinator_identity_id: /subscriptions/s/id/coordinator\n    sku: aci-cpu-2x8\n";
        let spec = crate::spec::parse_str(text, "job.yaml", &[]).unwrap();
        let env = coordinator_env(&resolved(spec.clone()), &|k| match k {
            "AZURE_STORAGE_ACCOUNT_NAME" => Some("acct".into()),
            "AZURE_STORAGE_ACCOUNT_KEY" => Some("never-forwarded".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(
            env.into_iter().collect::<Vec<_>>(),
            [
                (
                    "AZURE_MSI_RESOURCE_ID".to_string(),
                    "/subscriptions/s/id/coordinator".to_string()
                ),
                ("AZURE_STORAGE_ACCOUNT_NAME".to_string(), "acct".to_string()),
            ]
        );
        let err = coordinator_env(&resolved(spec.clone()), &|_| None)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("output.dir: az://jobs/runs names no storage account")
                && err.contains("AZURE_STORAGE_ACCOUNT_NAME"),
            "{err}"
        );
        // an S3 store on ecs: nothing to pass on
        assert!(
            coordinator_env(&resolved(job("ecs")), &|_| Some("x".into()))
                .unwrap()
                .is_empty()
        );
    }

    /// What cluster mode needs beyond validation is refused naming the field.
    #[test]
    fn cluster_settings_are_checked_before_anything_is_made() {
        assert!(check_settings(&job("ecs")).is_ok());
        let mut local_store = job("ecs");
        local_store.output.dir = PathBuf::from("jobs");
        let err = check_settings(&local_store).unwrap_err().to_string();
        assert!(
            err.starts_with("output.dir:") && err.contains("s3://"),
            "{err}"
        );
        let mut no_role = job("ecs");
        no_role
            .backend
            .ecs
            .as_mut()
            .unwrap()
            .coordinator_task_role_arn = None;
        let err = check_settings(&no_role).unwrap_err().to_string();
        assert!(
            err.starts_with("backend.ecs.coordinator_task_role_arn:"),
            "{err}"
        );
        let mut seeds = job("ecs");
        seeds.train.runs = 3;
        let err = check_settings(&seeds).unwrap_err().to_string();
        assert!(err.starts_with("train.runs:"), "{err}");
    }
}
