//! What every backend is asked to run: one [`WorkerSpec`] for N workers (DESIGN invariant 6: every backend
//! receives the same spec; backend code only translates it to its platform).
//!
//! Secrets are file contents. A backend mounts them as files in a folder whose path it puts in
//! [`ENV_SECRETS_DIR`]; their bytes never appear in an environment value, a command line, a log line or a
//! `Debug` print ([`SecretBytes`] redacts itself). Most secrets differ per worker (each worker's certificate
//! names its rank), so a [`SecretValue`] is either the same for every rank or one value per rank.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

// The worker's environment contract lives once, with the worker and the coordinator.
pub use physalia_control::env::{
    ENV_ADVERTISE_IP, ENV_COORDINATOR, ENV_JOB_ID, ENV_MESH_PORT, ENV_RANK, ENV_SECRETS_DIR,
    ENV_WORK_DIR, ENV_WORLD, RESERVED_ENV,
};

/// Where the secret files are mounted inside a worker container (kubernetes, aci).
pub const CONTAINER_SECRETS_DIR: &str = "/var/run/physalia/secrets";

/// One worker, as every backend receives it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerSpec {
    /// The coordinator's job id. Platform object names are derived from it (see [`crate::LaunchId`]).
    pub job_id: String,
    /// Launches of this job so far (rescales, retries, prewarm): two launches of one job may run at once,
    /// so each gets its own platform objects. The local backend's `WorkerLaunch::segment`.
    pub segment: u32,
    /// Container image reference, e.g. `ghcr.io/physalia/worker:0.1.0-cuda`.
    pub image: String,
    /// The full command (argv[0] first); empty runs the image's entrypoint and default command.
    pub command: Vec<String>,
    /// Virtual CPUs of each worker's platform object (an ECS task, a pod, a container group), fractions
    /// allowed: what the platform must find free on one machine to place it.
    pub cpu: f64,
    /// Memory of each worker's platform object, GiB (helper containers of the object included).
    pub memory_gib: f64,
    pub gpu: Option<GpuRequest>,
    /// The machine types a worker may be placed on, as the platform names them (ECS's attribute
    /// `ecs.instance-type`, Kubernetes' node label `node.kubernetes.io/instance-type`): the SKU's
    /// (`physalia_planner::Placement`). Empty: anywhere the platform's capacity offers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub instance_types: Vec<String>,
    /// Plain environment (for example `RAYON_NUM_THREADS`); never secrets. The backend adds the
    /// [`RESERVED_ENV`] variables.
    pub env: BTreeMap<String, String>,
    /// File name -> contents, mounted under [`ENV_SECRETS_DIR`].
    pub secrets: BTreeMap<String, SecretValue>,
    pub network: NetworkSpec,
}

/// What a job asks of its platform at its peak, for the preflight's quota and capacity checks
/// ([`crate::Backend::check`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Demand {
    /// Workers of one launch at most: the scaling policy's `max_workers`, else the job's `workers`.
    pub workers: u32,
    /// Workers of another launch that may still run while one of `workers` starts: a scaling policy
    /// with `prewarm` starts the next launch while the current one trains, so during a resize both
    /// sets run (the prewarm never takes the next launch above `max_workers`, so the running one then
    /// has at most `max_workers - 1`). 0 where launches never overlap.
    pub overlap_workers: u32,
    /// vCPUs of the machine share behind one worker (the SKU's): what an instance quota counts for a
    /// worker that takes a whole machine (EC2's vCPU quotas count the instance, not the task).
    /// Platforms that count what the container asks for (Fargate, ACI) use [`WorkerSpec::cpu`].
    pub machine_vcpus: f64,
}

impl Demand {
    /// One worker on a machine of `machine_vcpus` (tests and single-worker probes).
    pub fn one(machine_vcpus: f64) -> Demand {
        Demand {
            workers: 1,
            overlap_workers: 0,
            machine_vcpus,
        }
    }

    /// Workers running at once at the job's peak: one launch's and, during a prewarmed resize, the
    /// launch still running beside it.
    pub fn peak_workers(&self) -> u32 {
        self.workers.max(1) + self.overlap_workers
    }

    /// How the peak was counted, for a refusal that names it: nothing, or `; a prewarmed launch of 3
    /// beside 2 still running`.
    pub fn overlap_note(&self) -> String {
        match self.overlap_workers {
            0 => String::new(),
            running => format!(
                "; a prewarmed launch of {} beside {running} still running",
                self.workers.max(1)
            ),
        }
    }
}

/// GPUs per worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRequest {
    pub count: u32,
    /// The GPU model as the platform names it (kubernetes: the value of the node label
    /// `nvidia.com/gpu.product`, e.g. `NVIDIA-H100-80GB-HBM3`); `None` takes any.
    pub kind: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkSpec {
    /// `host:port` of the coordinator's control endpoint as workers reach it (an IP in the workers'
    /// network, or a DNS name the platform resolves).
    pub coordinator_addr: String,
    /// UDP port of each worker's mesh endpoint.
    pub mesh_port: u16,
}

/// Secret bytes. `Debug` prints only the length; there is no `Display` and no `Serialize`, so a secret
/// cannot reach a log or a job record by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretBytes(Vec<u8>);

impl SecretBytes {
    pub fn new(bytes: impl Into<Vec<u8>>) -> SecretBytes {
        SecretBytes(bytes.into())
    }

    /// The bytes, for the code that hands them to the platform's secret store.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for SecretBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretBytes(<{} bytes redacted>)", self.0.len())
    }
}

/// A secret file's contents: the same for every worker, or one per rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SecretValue {
    Same(SecretBytes),
    PerRank(Vec<SecretBytes>),
}

// Specs are recorded in the job store; secrets are not. A deserialized spec has no secrets and must get
// them again from the coordinator (which re-issues certificates on every launch anyway).
impl Serialize for SecretValue {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str("<redacted>")
    }
}

impl<'de> Deserialize<'de> for SecretValue {
    fn deserialize<D: serde::Deserializer<'de>>(_: D) -> std::result::Result<Self, D::Error> {
        Err(serde::de::Error::custom(
            "secret values are never stored; the coordinator issues them at launch",
        ))
    }
}

impl SecretValue {
    /// The bytes rank `rank` gets.
    pub fn for_rank(&self, rank: usize) -> &SecretBytes {
        match self {
            SecretValue::Same(b) => b,
            SecretValue::PerRank(v) => &v[rank],
        }
    }
}

impl WorkerSpec {
    /// Checks what every backend relies on, for a launch of `n_workers`.
    pub fn validate(&self, n_workers: usize) -> Result<()> {
        let bad = |msg: String| Err(Error::InvalidSpec(msg));
        if n_workers == 0 {
            return bad("a launch needs at least one worker".into());
        }
        if self.job_id.is_empty() {
            return bad("job_id is empty".into());
        }
        if self.image.trim().is_empty() {
            return bad("image is empty".into());
        }
        if !(self.cpu.is_finite() && self.cpu > 0.0) {
            return bad(format!("cpu must be a positive number, got {}", self.cpu));
        }
        if !(self.memory_gib.is_finite() && self.memory_gib > 0.0) {
            return bad(format!(
                "memory_gib must be a positive number, got {}",
                self.memory_gib
            ));
        }
        if let Some(g) = &self.gpu
            && g.count == 0
        {
            return bad("gpu.count is 0; leave gpu out for a CPU worker".into());
        }
        if let Some(t) = self.instance_types.iter().find(|t| !is_instance_type(t)) {
            return bad(format!(
                "instance_types: {t:?} is not an instance type name (1-63 of [A-Za-z0-9._-], \
                 starting and ending alphanumeric)"
            ));
        }
        if self.network.mesh_port == 0 {
            return bad("network.mesh_port is 0; workers need a fixed port peers can reach".into());
        }
        if self
            .network
            .coordinator_addr
            .rsplit_once(':')
            .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
        {
            return bad(format!(
                "network.coordinator_addr must be host:port, got {:?}",
                self.network.coordinator_addr
            ));
        }
        for name in self.env.keys() {
            if RESERVED_ENV.contains(&name.as_str()) {
                return bad(format!(
                    "env sets {name}, which the backend sets itself; remove it"
                ));
            }
            if !is_env_name(name) {
                return bad(format!(
                    "env name {name:?} is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)"
                ));
            }
        }
        for (name, value) in &self.secrets {
            if !is_secret_file_name(name) {
                return bad(format!(
                    "secret file name {name:?} must be 1-253 characters of [-._a-zA-Z0-9], not . or .."
                ));
            }
            if let SecretValue::PerRank(v) = value
                && v.len() != n_workers
            {
                return bad(format!(
                    "secret {name} has {} per-rank values for {n_workers} workers",
                    v.len()
                ));
            }
        }
        Ok(())
    }

    /// The image a backend runs: `gpu_image` (the backend's CUDA image) when the spec asks for a GPU and
    /// the backend names one, [`WorkerSpec::image`] otherwise. A backend with no GPU image runs `image` on
    /// GPUs too, which must then be a CUDA image (`worker-image/Dockerfile.cuda`).
    pub fn image_for<'a>(&'a self, gpu_image: Option<&'a str>) -> &'a str {
        match (&self.gpu, gpu_image) {
            (Some(_), Some(gpu_image)) => gpu_image,
            _ => &self.image,
        }
    }

    /// The environment of rank `rank` as backends set it literally (all but what a platform fills in
    /// itself, like kubernetes's rank from the completion index), sorted by name.
    pub fn base_env(&self, n_workers: usize) -> BTreeMap<String, String> {
        let mut env = self.env.clone();
        env.insert(
            ENV_COORDINATOR.into(),
            self.network.coordinator_addr.clone(),
        );
        env.insert(ENV_WORLD.into(), n_workers.to_string());
        env.insert(ENV_JOB_ID.into(), self.job_id.clone());
        env.insert(ENV_SECRETS_DIR.into(), CONTAINER_SECRETS_DIR.into());
        env.insert(ENV_MESH_PORT.into(), self.network.mesh_port.to_string());
        env
    }
}

pub(crate) fn is_env_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A Kubernetes label value (also a valid ECS and ARM tag value): empty, or at most 63 characters of
/// `[A-Za-z0-9-_.]` starting and ending alphanumeric.
pub(crate) fn is_label_value(s: &str) -> bool {
    s.is_empty()
        || (s.len() <= 63
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && s.starts_with(|c: char| c.is_ascii_alphanumeric())
            && s.ends_with(|c: char| c.is_ascii_alphanumeric()))
}

/// An instance type as ECS's attribute and the Kubernetes node label carry it: a non-empty label value.
fn is_instance_type(s: &str) -> bool {
    !s.is_empty() && is_label_value(s)
}

/// A Kubernetes label key: an optional DNS-subdomain prefix and `/`, then a non-empty label value.
pub(crate) fn is_label_key(s: &str) -> bool {
    let (prefix, name) = match s.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                    && !part.starts_with('-')
                    && !part.ends_with('-')
            })
    });
    prefix_ok && !name.is_empty() && is_label_value(name)
}

/// A Kubernetes Secret key and a file name on every platform.
fn is_secret_file_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s != "."
        && s != ".."
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn spec() -> WorkerSpec {
        WorkerSpec {
            job_id: "cora-1732000000".into(),
            segment: 0,
            image: "ghcr.io/physalia/worker:0.1.0".into(),
            command: vec!["physalia-worker".into()],
            cpu: 2.0,
            memory_gib: 8.0,
            gpu: None,
            instance_types: Vec::new(),
            env: BTreeMap::from([("RAYON_NUM_THREADS".into(), "2".into())]),
            secrets: BTreeMap::from([("ca.pem".into(), SecretValue::Same(SecretBytes::new("CA")))]),
            network: NetworkSpec {
                coordinator_addr: "10.0.0.4:7000".into(),
                mesh_port: 7100,
            },
        }
    }

    #[test]
    fn validate_names_the_field() {
        let check = |f: &dyn Fn(&mut WorkerSpec), n: usize, needle: &str| {
            let mut s = spec();
            f(&mut s);
            let err = s.validate(n).unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        };
        assert!(spec().validate(2).is_ok());
        check(&|_| {}, 0, "at least one worker");
        check(&|s| s.cpu = 0.0, 1, "cpu");
        check(&|s| s.memory_gib = f64::NAN, 1, "memory_gib");
        check(
            &|s| s.instance_types = vec!["g5.xlarge; rm".into()],
            1,
            "instance_types",
        );
        check(
            &|s| s.network.coordinator_addr = "nohost".into(),
            1,
            "host:port",
        );
        check(
            &|s| {
                s.env.insert(ENV_RANK.into(), "0".into());
            },
            1,
            "PHYSALIA_RANK",
        );
        check(
            &|s| {
                s.secrets
                    .insert("../key".into(), SecretValue::Same(SecretBytes::new("k")));
            },
            1,
            "\"../key\"",
        );
        check(
            &|s| {
                s.secrets.insert(
                    "key.pem".into(),
                    SecretValue::PerRank(vec![SecretBytes::new("k")]),
                );
            },
            2,
            "1 per-rank values for 2 workers",
        );
    }

    #[test]
    fn a_gpu_spec_takes_the_gpu_image() {
        let mut s = spec();
        assert_eq!(
            s.image_for(Some("worker:cuda")),
            "ghcr.io/physalia/worker:0.1.0"
        );
        s.gpu = Some(GpuRequest {
            count: 1,
            kind: None,
        });
        assert_eq!(s.image_for(Some("worker:cuda")), "worker:cuda");
        assert_eq!(s.image_for(None), "ghcr.io/physalia/worker:0.1.0");
    }

    #[test]
    fn secrets_never_print_or_serialize() {
        let mut s = spec();
        s.secrets.insert(
            "key.pem".into(),
            SecretValue::PerRank(vec![SecretBytes::new("PRIVATE KEY BYTES")]),
        );
        let debug = format!("{s:?}");
        let json = serde_json::to_string(&s).unwrap();
        for text in [debug, json] {
            assert!(!text.contains("PRIVATE KEY BYTES"), "{text}");
        }
    }
}
