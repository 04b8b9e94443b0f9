//! Backends: where workers run. One [`Backend`] trait, one [`WorkerSpec`] for every platform; each module
//! only translates the spec to its platform's objects and its platform's failures to [`Error`]s.
//!
//! - [`kubernetes`]: an Indexed Job (rank = completion index), a headless Service for stable peer names, a
//!   Secret with the job's certificates, `nvidia.com/gpu` limits; the Service and Secret are owned by the
//!   Job, so deleting it deletes them.
//! - [`docker`]: one container per worker on a bridge network, through the Docker CLI; secrets streamed
//!   into the created container as a tar archive.
//! - [`ecs`]: AWS ECS through aws-sdk-ecs, one awsvpc task per worker, its certificates in a Secrets
//!   Manager secret that an init container writes out as files; Fargate for CPU workers, EC2 capacity
//!   (a GPU capacity provider) for GPU workers.
//! - [`aci`]: Azure Container Instances through the ARM REST API, one container group per worker, CPU only
//!   (ACI retired its GPU SKUs in July 2025).
//! - [`local`]: worker processes on this machine, each in its own process group, its secrets as files in
//!   a private folder, its output in the job's `logs/`.
//!
//! The orchestrator builds the docker backend's image (`coordinator/src/driver/image.rs`). See
//! `README.md` for where the coordinator runs on each platform and how each backend is tested without a
//! cloud.
//!
//! Cluster mode: the same trait starts the job's coordinator on the platform, next to its workers
//! ([`Backend::launch_coordinator`] from a [`CoordinatorSpec`], then [`Backend::coordinator_status`],
//! [`Backend::coordinator_logs`], [`Backend::stop_coordinator`] with the [`CoordinatorHandle`] the job store
//! keeps): a Job as ServiceAccount `physalia-coordinator` on kubernetes, a Fargate task with the coordinator
//! task role on ecs, a container group with a user-assigned identity on aci. They are methods of
//! [`Backend`] rather than a second trait because the orchestrator holds one `Box<dyn Backend>` chosen from
//! the job file; local and docker answer [`Error::Unsupported`] (the `physalia` process is the
//! coordinator there). [`Backend::check`] is the preflight the orchestrator calls before the first launch.
//!
//! Credentials come only from the platform's standard chain (aws-config's; kubeconfig or in-cluster; the
//! managed identity or the Azure CLI), never from arguments, the job file or a spec: absent or expired
//! ones are an [`Error::Credentials`] with what to run (`aws configure`, `az login`).
//!
//! Architecture Invariant: a launch either returns with every worker started or fails with nothing of it
//! left running. Every backend deletes what a failed launch created before it returns the error (and says
//! so with [`Error::CleanupFailed`] when the platform refuses even that).
//!
//! Architecture Invariant: secret bytes travel only inside the platform's secret object (a Kubernetes
//! Secret, an ACI secret volume, a Secrets Manager secret, a private folder for local processes) and reach
//! the worker as files; never in the worker's environment, an argument, an error message or a log line.
//! (ECS injects secrets only as environment values, so on ecs a short-lived init container receives the
//! rank's bundle that way and writes it out as files before the worker starts.)

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub mod aci;
mod coordinator;
pub mod docker;
pub mod ecs;
mod error;
pub mod kubernetes;
pub mod local;
mod names;
mod spec;

pub use coordinator::{
    CONTROL_PORTS, CoordinatorHandle, CoordinatorSpec, CoordinatorStatus, PlatformObject,
};
pub use error::{BackendName, Error, Result};
pub use names::LaunchId;
pub use spec::{
    CONTAINER_SECRETS_DIR, Demand, ENV_ADVERTISE_IP, ENV_COORDINATOR, ENV_JOB_ID, ENV_MESH_PORT,
    ENV_RANK, ENV_SECRETS_DIR, ENV_WORK_DIR, ENV_WORLD, GpuRequest, NetworkSpec, RESERVED_ENV,
    SecretBytes, SecretValue, WorkerSpec,
};

/// Starts, lists and stops the workers of a job on one platform.
///
/// Methods take a [`LaunchId`] rather than returning a handle that owns the workers: the id is plain data
/// the coordinator records in the job store, so a restarted coordinator (`submit --resume`) can list and
/// stop what its predecessor launched.
///
/// The trait is object-safe through `async_trait` (a boxed future per call): the orchestrator picks the
/// backend from the job file at run time and keeps a `Box<dyn Backend>`. Native `async fn` in traits
/// would need the same boxing by hand for `dyn`, and one allocation per cloud API call is nothing next to
/// the call.
#[async_trait]
pub trait Backend: Send + Sync {
    /// The name the job file uses (`kubernetes`, `aci`).
    fn name(&self) -> BackendName;

    /// Starts ranks `0..n_workers` from `spec` and returns once every one is running. On any failure,
    /// deletes whatever this launch created before returning the error.
    async fn launch(&self, spec: &WorkerSpec, n_workers: usize) -> Result<Launched>;

    /// Every worker of the launch the platform knows about, by rank.
    async fn list(&self, launch: &LaunchId) -> Result<Vec<WorkerStatus>>;

    /// Stops one worker; the platform does not restart it (the coordinator decides what happens next).
    /// Stopping a worker that is already gone succeeds.
    async fn stop(&self, launch: &LaunchId, rank: usize) -> Result<()>;

    /// Stops every worker of the launch and deletes all of its platform objects. Stopping a launch that is
    /// already gone succeeds.
    async fn stop_all(&self, launch: &LaunchId) -> Result<()>;

    /// The worker's output (stdout and stderr) so far, as the platform keeps it.
    async fn logs(&self, launch: &LaunchId, rank: usize) -> Result<String>;

    /// Makes what every launch of job `job_id` shares on this platform (docker: the job's bridge network)
    /// and says where the coordinator's control endpoint must listen for the workers to reach it. Called
    /// before every launch; a job already prepared gets the same answer. By default: nothing to make,
    /// and the workers reach the coordinator on loopback (processes on its machine).
    async fn prepare(&self, job_id: &str) -> Result<Prepared> {
        let _ = job_id;
        Ok(Prepared {
            control_ip: std::net::Ipv4Addr::LOCALHOST.into(),
        })
    }

    /// Deletes what [`Backend::prepare`] made, after the job's last launch was stopped. Releasing a job
    /// that holds nothing succeeds.
    async fn release(&self, job_id: &str) -> Result<()> {
        let _ = job_id;
        Ok(())
    }

    /// Preflight, before the job's first launch: refuses, with the platform's reason and a hint, what
    /// would fail anyway (credentials the platform refuses, an unknown cluster, GPUs where the platform
    /// has none, a size it does not sell, a quota below the job's `demand` at its peak, capacity the
    /// cluster cannot offer), having created nothing. By default: nothing to check.
    async fn check(&self, spec: &WorkerSpec, demand: Demand) -> Result<()> {
        let _ = (spec, demand);
        Ok(())
    }

    /// Cluster mode: starts the job's coordinator on the platform, next to where its workers will run,
    /// and returns once it runs (with its private IP) or fails having deleted everything it made. The
    /// handle is plain data for the job store. By default (local, docker) unsupported: there the
    /// `physalia` process is the coordinator.
    async fn launch_coordinator(&self, spec: &CoordinatorSpec) -> Result<CoordinatorHandle> {
        let _ = spec;
        Err(no_cluster_mode(self.name()))
    }

    /// Where the coordinator is: pending, running, succeeded, failed, with the platform's detail and its
    /// IP once assigned.
    async fn coordinator_status(&self, handle: &CoordinatorHandle) -> Result<CoordinatorStatus> {
        let _ = handle;
        Err(no_cluster_mode(self.name()))
    }

    /// The coordinator's output (stdout and stderr) so far, as the platform keeps it.
    async fn coordinator_logs(&self, handle: &CoordinatorHandle) -> Result<String> {
        let _ = handle;
        Err(no_cluster_mode(self.name()))
    }

    /// Stops the coordinator and deletes every object [`Backend::launch_coordinator`] made. Stopping one
    /// that is already gone succeeds.
    async fn stop_coordinator(&self, handle: &CoordinatorHandle) -> Result<()> {
        let _ = handle;
        Err(no_cluster_mode(self.name()))
    }
}

fn no_cluster_mode(backend: BackendName) -> Error {
    Error::Unsupported {
        backend,
        detail:
            "the coordinator runs inside the `physalia` process on this backend (client mode); \
                 cluster mode needs kubernetes, ecs or aci"
                .into(),
    }
}

/// What [`Backend::prepare`] says about a job's platform.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prepared {
    /// The address the coordinator's control endpoint binds: one the workers can reach.
    pub control_ip: std::net::IpAddr,
}

/// What [`Backend::launch`] started.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Launched {
    pub id: LaunchId,
    /// The workers, by rank, as they were when the launch returned.
    pub workers: Vec<WorkerStatus>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub rank: usize,
    /// The platform object running it (pod, container group).
    pub name: String,
    pub state: WorkerState,
    /// The address peers and the coordinator reach it at, once the platform assigned one.
    pub ip: Option<std::net::IpAddr>,
    /// A stable DNS name for the worker, where the platform gives one (kubernetes:
    /// `<pod>.<service>.<namespace>.svc`).
    pub dns_name: Option<String>,
    /// The platform's reason for the state, when it gives one (`ErrImagePull`, an exit code, ...).
    pub detail: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    /// Accepted, not running yet (scheduling, pulling the image, creating).
    Pending,
    Running,
    /// Exited with status 0.
    Succeeded,
    /// Exited non-zero, could not start, or was stopped.
    Failed,
    /// The platform says nothing we understand.
    Unknown,
}
