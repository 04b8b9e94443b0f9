//! The platform registry: each platform the workers run on is one implementation of [`Platform`]
//! (`local.rs`, `docker.rs`, `kubernetes.rs`, `ecs.rs`, `aci.rs`), chosen once by [`of`], the only place
//! in the drivers where a platform's name picks code. A platform builds its backend (the job file's section
//! and the platform's standard credential chain), says where the workers reach the coordinator, and
//! turns a launch into the `WorkerSpec` its backend runs. What the job file says of each platform
//! (its section's checks, SKU, images, cluster-mode needs) is the coordinator crate's
//! `spec::Section`, the same registry on the side without IO.
//!
//! In client mode the coordinator is the `physalia submit` process, which must run where the workers'
//! network reaches it (a machine in the VPC, or a test's Docker network). In cluster mode it is
//! `physalia coordinate` inside the platform (`cluster.rs`), on the port its platform object declares
//! ([`COORDINATOR_PORT`]). Either way a cloud launch binds every interface and gives the workers one
//! address: `backend.coordinator_address`, or the one this machine's default route leaves from.
//!
//! Credentials never come from the job file, an argument or the environment values this module
//! reads: the platform's SDK reads its own chain (`AWS_PROFILE`, `AWS_ACCESS_KEY_ID`, a task role,
//! `AWS_ENDPOINT_URL` for a private endpoint).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use physalia_backends::{Backend, Prepared, SecretValue, WorkerSpec};

use crate::driver::Observer;
use crate::driver::resolved::ResolvedJob;
use crate::spec::BackendKind;

mod aci;
pub mod docker;
mod ecs;
mod kubernetes;
mod local;

/// What every platform does for a job: one implementation per platform, chosen by [`of`].
pub trait Platform: Sync {
    /// The backend of launch `segment` of job `job_id`, whose record is in `job_dir`.
    fn backend(
        &self,
        job: &ResolvedJob,
        job_id: &str,
        job_dir: &Path,
        segment: usize,
        obs: &dyn Observer,
    ) -> Result<Box<dyn Backend>>;

    /// Where the control endpoint binds and the address the workers are given, once the backend
    /// prepared the job (`prepared`).
    fn reach(&self, job: &ResolvedJob, prepared: &Prepared) -> Result<Reach>;

    /// What launch `w.segment` asks its backend to run, and how the coordinator follows it (the GPUs
    /// aside: [`launch`] adds the job's).
    fn worker(&self, job: &ResolvedJob, w: Worker) -> Result<Launch>;

    /// Removes what outlives every launch of the job (docker's network), at the job's end.
    fn release(&self, _job: &ResolvedJob, _job_id: &str) -> Result<()> {
        Ok(())
    }

    /// What a cluster-mode coordinator on this platform is told beyond the job store's settings (none
    /// of it a credential).
    fn coordinator_env(&self, _job: &ResolvedJob, _env: &mut BTreeMap<String, String>) {}

    /// Whether the workers read the coordinator's disk (processes on its machine): they then read a
    /// chunked dataset in place to cut their parts (issue 31) and write the parts into the set.
    /// Elsewhere they fetch the chunk files they read, which the coordinator serves, and hand their
    /// parts back.
    fn workers_read_coordinator_disk(&self) -> bool {
        false
    }
}

/// The platform `kind`: the registry.
pub fn of(kind: BackendKind) -> &'static dyn Platform {
    match kind {
        BackendKind::Local => &local::Local,
        BackendKind::Docker => &docker::Docker,
        BackendKind::Kubernetes => &kubernetes::Kubernetes,
        BackendKind::Ecs => &ecs::Ecs,
        BackendKind::Aci => &aci::Aci,
    }
}

/// The job's platform.
pub fn of_job(job: &ResolvedJob) -> &'static dyn Platform {
    of(job.spec.backend.name)
}

/// What launch `w.segment` of `job` runs on its platform, with the GPUs each worker asks for.
pub fn launch(job: &ResolvedJob, w: Worker) -> Result<Launch> {
    let mut launch = of_job(job).worker(job, w)?;
    launch.spec.gpu = job.gpu.clone();
    Ok(launch)
}

/// One launch as the coordinator sees it, for [`Platform::worker`].
pub struct Worker<'a> {
    pub job_id: &'a str,
    pub segment: usize,
    /// The coordinator's control endpoint, as the workers reach it.
    pub coordinator: SocketAddr,
    /// Each worker's share of this machine's cores (`train.threads` if set): for workers on this
    /// machine.
    pub threads: usize,
    /// The launch's CA and each rank's identity.
    pub secrets: BTreeMap<String, SecretValue>,
    /// The command of a worker process on this machine (program first).
    pub local_command: &'a [String],
    /// Where images built for the launch are reported.
    pub obs: &'a dyn Observer,
}

/// What a launch runs and how the coordinator follows it.
pub struct Launch {
    pub spec: WorkerSpec,
    /// Whether each rank's output is copied into the job's `logs/` when it ends (platforms that keep
    /// it themselves); `false`: the backend writes it there.
    pub copy_logs: bool,
    /// How often the coordinator asks the backend whether workers ended.
    pub poll_every: Duration,
}

impl Launch {
    fn copying_logs(spec: WorkerSpec, poll_every: Duration) -> Launch {
        Launch {
            spec,
            copy_logs: true,
            poll_every,
        }
    }
}

/// The UDP port a cluster-mode coordinator's control endpoint listens on: the one its platform object
/// declares (the ECS task definition's port mapping, the pod's container port) and infra/'s
/// `coordinator_port` opens (7000 in infra/ecs, infra/k8s and infra/azure).
pub const COORDINATOR_PORT: u16 = 7000;

/// The control endpoint's ports to try in order: any (`[0]`) unless the platform declared `port`
/// (a cluster-mode coordinator), then it and the next few (a prewarmed launch's control endpoint
/// lives beside the running one's): all that the coordinator's platform object declares.
pub fn control_ports(port: Option<u16>) -> Vec<u16> {
    match port {
        Some(p) => (0..physalia_backends::CONTROL_PORTS)
            .map(|i| p.saturating_add(i))
            .collect(),
        None => vec![0],
    }
}

/// The port every container worker's mesh listens on (each has its own address) unless the
/// section's `mesh_port` says otherwise: infra/ecs's default `mesh_port`, which its security group
/// opens among the tasks, and inside infra/azure's default `quic_ports`.
pub const MESH_PORT: u16 = 7100;

/// How often the coordinator asks a cloud platform whether workers ended.
const POLL_EVERY: Duration = Duration::from_secs(1);

/// Where the control endpoint binds and the address the workers are given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reach {
    pub bind: IpAddr,
    pub advertise: IpAddr,
}

impl Reach {
    /// Bound and advertised at one address (loopback, the job network's gateway).
    fn at(ip: IpAddr) -> Reach {
        Reach {
            bind: ip,
            advertise: ip,
        }
    }
}

/// A cloud platform's reach: bind every interface, advertise `backend.coordinator_address` or the
/// address this machine's default route leaves from.
fn cloud_reach(job: &ResolvedJob) -> Result<Reach> {
    let advertise = match job.spec.backend.coordinator_address {
        Some(ip) => ip,
        None => default_route_source().context(
            "finding this machine's address for the workers (it has no default route): set \
             backend.coordinator_address to an address the workers' subnets reach",
        )?,
    };
    Ok(Reach {
        bind: Ipv4Addr::UNSPECIFIED.into(),
        advertise,
    })
}

/// The source address of this machine's default route: a connected UDP socket sends nothing, but the
/// kernel picks the route and so the address.
fn default_route_source() -> Result<IpAddr> {
    let probe = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    // any address off every local network: a documentation prefix (TEST-NET-3), never contacted
    probe.connect((Ipv4Addr::new(203, 0, 113, 1), 9))?;
    let ip = probe.local_addr()?.ip();
    if ip.is_unspecified() || ip.is_loopback() {
        bail!("the default route leaves from {ip}");
    }
    Ok(ip)
}

/// The worker container of a cloud launch: `image` (the backend picks the section's `gpu_image`
/// for GPU workers), what its placement says a task or pod gets (vCPUs and memory), a thread per vCPU of it unless `train.threads` says
/// otherwise, the mesh on `mesh_port` (the port the platform's firewall opens between workers).
fn cloud_worker(job: &ResolvedJob, w: Worker, image: &str, mesh_port: u16) -> Result<Launch> {
    let sku = &job.sku;
    let threads = job
        .spec
        .train
        .threads
        .map(|t| t as usize)
        .unwrap_or((sku.request_vcpus().floor() as usize).max(1));
    let mut spec = crate::driver::workers::worker_spec(
        w.job_id,
        w.segment,
        image.to_string(),
        // the image's entry point, `physalia-worker`
        Vec::new(),
        w.coordinator,
        threads,
        w.secrets,
        mesh_port,
    );
    // what a task or pod can get on the SKU's machine (the price stays the machine's), placed on
    // the SKU's instance types
    spec.cpu = sku.request_vcpus();
    spec.memory_gib = sku.request_memory_gib();
    spec.instance_types = sku.instance_types();
    Ok(Launch::copying_logs(spec, POLL_EVERY))
}

/// The job's backend for what precedes every launch (the preflight, cluster mode's coordinator): no
/// job id or record yet.
pub fn job_free_backend(job: &ResolvedJob) -> Result<Box<dyn Backend>> {
    of_job(job).backend(
        job,
        "",
        Path::new(""),
        0,
        &crate::driver::Plain { quiet: true },
    )
}

/// The platform's preflight (`Backend::check`: credentials, the cluster, quotas and capacity at the
/// job's peak) on the container a launch's worker will be, before anything is created or recorded: a
/// refusal names its reason where a launch would wait for its timeout, and leaves no job behind.
pub fn preflight(job: &ResolvedJob, backend: &dyn Backend, obs: &dyn Observer) -> Result<()> {
    let probe = preflight_worker(job, obs)?;
    let demand = job.demand();
    Ok(crate::driver::workers::block_on(
        backend.check(&probe, demand),
    )??)
}

/// The container a cloud platform's preflight checks (`Backend::check`): a launch's worker, before
/// any launch.
pub fn preflight_worker(job: &ResolvedJob, obs: &dyn Observer) -> Result<WorkerSpec> {
    let w = Worker {
        job_id: "preflight",
        segment: 0,
        coordinator: SocketAddr::from(([127, 0, 0, 1], COORDINATOR_PORT)),
        threads: 1,
        secrets: BTreeMap::new(),
        local_command: &[],
        obs,
    };
    Ok(launch(job, w)?.spec)
}
