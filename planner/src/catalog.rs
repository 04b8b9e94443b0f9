//! The hardware and price catalog: container SKUs per backend, each with where its numbers come
//! from and when they were read.
//!
//! A catalog is YAML text (the files under `infra/catalog/`, or the user's own). Parsing is
//! the only text handling in the crate and does no IO: the caller reads the file and passes the
//! text with a name for messages. Every error names the file, line and column: values out of
//! range are refused while deserializing (the parser knows where it is), and the checks across
//! fields (one price form, unique names) are placed at the start of their SKU entry.
//!
//! A SKU is one container as the planner sees it: what one worker gets. For a GPU SKU the
//! compute numbers (`fp32_tflops`, `memory_bandwidth_gb_s`) are the GPU's and `memory_gib` is
//! the host memory of the container; for a CPU SKU they are the container's CPU share. A
//! `shared_host` SKU (the local machine) is the whole machine instead: a job's workers are
//! processes on it and split it among themselves.

use std::borrow::Cow;

use serde::de::{self, DeserializeOwned, Deserializer};
use serde::{Deserialize, Serialize};
use serde_saphyr::Spanned;

use crate::error::{Location, PlanError, one_line};

/// Where a job's workers run: the platforms of the `physalia` CLI. One type for the job file's
/// `backend.name`, the catalog's SKUs and the planner's candidates; each platform's behaviour is one
/// implementation in the coordinator's platform registry.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// In this process, on this machine.
    #[default]
    Local,
    /// Containers on the local Docker Engine, on a private bridge network.
    Docker,
    /// Pods on a Kubernetes cluster.
    Kubernetes,
    /// AWS Elastic Container Service tasks.
    Ecs,
    /// Azure Container Instances (CPU only since July 2025).
    Aci,
}

impl Backend {
    /// Every platform, in the order the CLI lists them.
    pub const ALL: [Backend; 5] = [
        Backend::Local,
        Backend::Docker,
        Backend::Kubernetes,
        Backend::Ecs,
        Backend::Aci,
    ];

    /// The name used in job files, catalogs and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Local => "local",
            Backend::Docker => "docker",
            Backend::Kubernetes => "kubernetes",
            Backend::Ecs => "ecs",
            Backend::Aci => "aci",
        }
    }
}

impl Backend {
    /// Whether its workers run on this machine (processes, or containers of the local Docker Engine)
    /// rather than on a cloud platform, which has its own coordinator (cluster mode) and polls.
    pub fn on_this_machine(self) -> bool {
        match self {
            Backend::Local | Backend::Docker => true,
            Backend::Kubernetes | Backend::Ecs | Backend::Aci => false,
        }
    }

    /// Whether the platform runs GPU workers (ACI retired its GPU SKUs in July 2025).
    pub fn runs_gpus(self) -> bool {
        match self {
            Backend::Local | Backend::Docker | Backend::Kubernetes | Backend::Ecs => true,
            Backend::Aci => false,
        }
    }

    /// The platform whose catalog SKUs this one's workers are: docker's containers run on this
    /// machine, the `local` SKUs.
    pub fn sku_platform(self) -> Backend {
        match self {
            Backend::Docker => Backend::Local,
            b @ (Backend::Local | Backend::Kubernetes | Backend::Ecs | Backend::Aci) => b,
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Backend {
    type Err = String;

    fn from_str(s: &str) -> Result<Backend, String> {
        Backend::ALL
            .into_iter()
            .find(|b| b.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Backend::ALL.iter().map(|b| b.as_str()).collect();
                format!("unknown backend {s:?}: one of {}", names.join(", "))
            })
    }
}

/// The GPU of a GPU SKU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// Marketing name (`A10G`, `L4`, `A100-40GB`, `H100-SXM`).
    pub model: String,
    /// Device memory of the one GPU a worker gets.
    #[serde(deserialize_with = "positive")]
    pub memory_gib: f64,
    /// The GPU's compute capability (`"8.9"` for an L4): the architecture the CUDA kernels are
    /// compiled for (`sm_89`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_capability: Option<MajorMinor>,
    /// The oldest NVIDIA driver the platform's GPU machine images run for this offering: the
    /// kernels must load on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<GpuDriver>,
}

/// The oldest driver a GPU offering runs, as its platform documents it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuDriver {
    /// The driver's version (`535.183.01`) or branch (`535`).
    #[serde(deserialize_with = "driver_version")]
    pub min_version: String,
    /// The CUDA version that driver supports, as `nvidia-smi` and `cuDriverGetVersion` report it
    /// (`"12.2"` for the R535 branch).
    pub cuda: MajorMinor,
    /// Where the version comes from (the platform's image release notes or documentation).
    pub source: Sources,
}

/// A `major.minor` version written as a string (`"8.9"`, `"12.2"`): a compute capability or a
/// CUDA version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MajorMinor {
    pub major: u32,
    pub minor: u32,
}

impl MajorMinor {
    /// As CUDA encodes a version: `1000 * major + 10 * minor` (12.2 is 12020).
    pub fn cuda_encoded(self) -> u32 {
        1000 * self.major + 10 * self.minor
    }
}

impl std::fmt::Display for MajorMinor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl std::str::FromStr for MajorMinor {
    type Err = String;

    fn from_str(s: &str) -> Result<MajorMinor, String> {
        let parse = |p: &str| {
            (!p.is_empty() && p.len() <= 4 && p.bytes().all(|b| b.is_ascii_digit()))
                .then(|| p.parse::<u32>().ok())
                .flatten()
        };
        match s.split_once('.') {
            Some((a, b)) => match (parse(a), parse(b)) {
                (Some(major), Some(minor)) if major > 0 => Ok(MajorMinor { major, minor }),
                _ => Err(format!(
                    "must be \"major.minor\" (like \"8.9\"), got `{}`",
                    one_line(s)
                )),
            },
            None => Err(format!(
                "must be \"major.minor\" (like \"8.9\"), got `{}`",
                one_line(s)
            )),
        }
    }
}

impl Serialize for MajorMinor {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MajorMinor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<MajorMinor, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(de::Error::custom)
    }
}

/// What one worker container can actually be given on its machine, and the machine types it is
/// placed on, as the platform names them.
///
/// The ECS container agent registers an instance's memory as the operating system reports it
/// (less than the instance's advertised memory), and a Kubernetes node's allocatable is its
/// capacity less the kubelet's and the system's reservations and the eviction threshold: a
/// worker asking for the whole machine is never placed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Placement {
    /// The machine types, as the platform's placement sees them: the ECS attribute
    /// `ecs.instance-type` (`g5.xlarge`), the Kubernetes node label
    /// `node.kubernetes.io/instance-type` (`g2-standard-8`, `Standard_NC4as_T4_v3`).
    pub instance_types: Vec<String>,
    /// vCPUs the task or pod asks for.
    #[serde(deserialize_with = "positive")]
    pub vcpus: f64,
    /// Memory the task or pod asks for, MiB.
    #[serde(deserialize_with = "positive")]
    pub memory_mib: f64,
    /// Where the figures come from (the platform's documented reservations).
    pub source: Sources,
}

/// What a container costs. Exactly one form: `usd_per_hour`, `usd_per_second`, or the pair
/// `usd_per_vcpu_second` + `usd_per_gib_second` (ACI bills vCPU-seconds and GB-seconds).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    #[serde(
        default,
        deserialize_with = "non_negative_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub usd_per_hour: Option<f64>,
    #[serde(
        default,
        deserialize_with = "non_negative_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub usd_per_second: Option<f64>,
    #[serde(
        default,
        deserialize_with = "non_negative_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub usd_per_vcpu_second: Option<f64>,
    #[serde(
        default,
        deserialize_with = "non_negative_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub usd_per_gib_second: Option<f64>,
}

/// One or more source URLs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Sources {
    One(String),
    Many(Vec<String>),
}

impl Sources {
    pub fn urls(&self) -> &[String] {
        match self {
            Sources::One(s) => std::slice::from_ref(s),
            Sources::Many(v) => v,
        }
    }
}

/// One container SKU: what a single worker gets and what it costs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sku {
    /// Unique across the catalogs in use (`ecs-g5.xlarge`).
    pub name: String,
    pub backend: Backend,
    /// The machine or node type behind the container (`g5.xlarge`, `p4d.24xlarge / 8`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// vCPUs of the container (loader threads sample on them).
    #[serde(deserialize_with = "positive")]
    pub vcpus: f64,
    /// Host memory of the container.
    #[serde(deserialize_with = "positive")]
    pub memory_gib: f64,
    /// Present for a GPU SKU: one GPU per worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<Gpu>,
    /// Where the platform places the worker and what the worker asks it for, where that is less
    /// than the machine (`vcpus`, `memory_gib`, which the price and the planner's speeds are
    /// for): an ECS task on an EC2 instance or a Kubernetes pod on a node. Absent for a container
    /// that is sold at exactly its size (Fargate, ACI, the local machine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
    /// Peak FP32 throughput of the device that runs the kernels (the GPU, else the vCPUs).
    #[serde(deserialize_with = "positive")]
    pub fp32_tflops: f64,
    /// Peak memory bandwidth of that device.
    #[serde(deserialize_with = "positive")]
    pub memory_bandwidth_gb_s: f64,
    /// Network bandwidth of the container, each direction.
    #[serde(deserialize_with = "positive")]
    pub network_gbit_s: f64,
    /// Cap on one flow (one peer connection), where the provider has one.
    #[serde(
        default,
        deserialize_with = "positive_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub single_flow_gbit_s: Option<f64>,
    /// One-way latency between two workers; default [`crate::Assumptions::network_latency_us`].
    #[serde(
        default,
        deserialize_with = "non_negative_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub network_latency_us: Option<f64>,
    /// Typical time from the request to a running worker (placement, image pull, start).
    #[serde(deserialize_with = "non_negative")]
    pub cold_start_s: f64,
    /// Most containers of this SKU a job may use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_containers: Option<u32>,
    /// The SKU is one machine and a job's workers are processes on it (the local machine): `n`
    /// workers split its vCPUs, memory bandwidth, memory and loopback `n` ways, and the price
    /// is paid once, not per worker. Otherwise every worker gets a whole SKU.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared_host: bool,
    pub price: Price,
    /// Where the numbers come from.
    pub source: Sources,
    /// When they were read (YYYY-MM-DD).
    pub as_of: String,
    /// What could not be verified, how a number was derived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

impl Sku {
    /// USD per second for one container.
    pub fn usd_per_s(&self) -> f64 {
        let p = &self.price;
        if let Some(h) = p.usd_per_hour {
            h / 3600.0
        } else if let Some(s) = p.usd_per_second {
            s
        } else {
            p.usd_per_vcpu_second.unwrap_or(0.0) * self.vcpus
                + p.usd_per_gib_second.unwrap_or(0.0) * self.memory_gib
        }
    }

    pub fn is_gpu(&self) -> bool {
        self.gpu.is_some()
    }

    /// Memory of the device that runs the kernels (the GPU's, or the host's for a CPU SKU).
    /// The memory the kernels run in: the GPU's, else the worker container's (see
    /// [`Sku::host_memory_bytes`]).
    pub fn device_memory_bytes(&self) -> f64 {
        self.gpu
            .as_ref()
            .map_or(self.request_memory_gib(), |g| g.memory_gib)
            * GIB
    }

    /// The host memory a worker has: what its container asks for ([`Sku::request_memory_gib`]: on a
    /// node, what is left after the platform's reservations), which is its limit, not the machine's.
    pub fn host_memory_bytes(&self) -> f64 {
        self.request_memory_gib() * GIB
    }

    /// Checks a SKU built in code (the parser checks the same while reading): every rate and
    /// size finite and above 0, cold start and prices at least 0, one price form.
    pub fn validate(&self) -> Result<(), PlanError> {
        let field = |f: &str| format!("sku `{}`.{f}", one_line(&self.name));
        let mut positive = vec![
            ("vcpus", self.vcpus),
            ("memory_gib", self.memory_gib),
            ("fp32_tflops", self.fp32_tflops),
            ("memory_bandwidth_gb_s", self.memory_bandwidth_gb_s),
            ("network_gbit_s", self.network_gbit_s),
        ];
        if let Some(f) = self.single_flow_gbit_s {
            positive.push(("single_flow_gbit_s", f));
        }
        if let Some(g) = &self.gpu {
            positive.push(("gpu.memory_gib", g.memory_gib));
        }
        if let Some(p) = &self.placement {
            positive.push(("placement.vcpus", p.vcpus));
            positive.push(("placement.memory_mib", p.memory_mib));
        }
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(PlanError::invalid(
                    field(name),
                    format!("must be a finite number above 0, got {v}"),
                ));
            }
        }
        let p = &self.price;
        let non_negative = [
            ("cold_start_s", Some(self.cold_start_s)),
            ("network_latency_us", self.network_latency_us),
            ("price.usd_per_hour", p.usd_per_hour),
            ("price.usd_per_second", p.usd_per_second),
            ("price.usd_per_vcpu_second", p.usd_per_vcpu_second),
            ("price.usd_per_gib_second", p.usd_per_gib_second),
        ];
        for (name, v) in non_negative {
            if let Some(v) = v
                && !(v.is_finite() && v >= 0.0)
            {
                return Err(PlanError::invalid(
                    field(name),
                    format!("must be a finite number at least 0, got {v}"),
                ));
            }
        }
        check_price(p).map_err(|m| PlanError::invalid(field("price"), m))?;
        if let Some(m) = check_placement(self) {
            return Err(PlanError::invalid(field(m.0), m.1));
        }
        if self.max_containers == Some(0) {
            return Err(PlanError::invalid(
                field("max_containers"),
                "must be at least 1",
            ));
        }
        Ok(())
    }

    /// vCPUs a worker container asks its platform for: [`Placement::vcpus`], else [`Sku::vcpus`].
    pub fn request_vcpus(&self) -> f64 {
        self.placement.as_ref().map_or(self.vcpus, |p| p.vcpus)
    }

    /// Memory a worker container asks its platform for, GiB: [`Placement::memory_mib`], else
    /// [`Sku::memory_gib`].
    pub fn request_memory_gib(&self) -> f64 {
        self.placement
            .as_ref()
            .map_or(self.memory_gib, |p| p.memory_mib / 1024.0)
    }

    /// The machine types a worker may be placed on (empty: anywhere the platform offers).
    pub fn instance_types(&self) -> Vec<String> {
        self.placement
            .as_ref()
            .map_or_else(Vec::new, |p| p.instance_types.clone())
    }

    /// `A10G` or `4 vCPU`.
    pub fn device_label(&self) -> String {
        match &self.gpu {
            Some(g) => g.model.clone(),
            None => format!("{} vCPU", self.vcpus),
        }
    }
}

/// The SKUs of one or more catalog files.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Catalog {
    pub skus: Vec<Sku>,
}

/// A catalog file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogFile {
    /// What the file covers (`aws-ecs`); informational.
    #[serde(default)]
    #[allow(dead_code)]
    catalog: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    note: Option<String>,
    skus: Vec<Spanned<Sku>>,
}

/// The catalog files of `infra/catalog/`, built into the binary.
const BUILTIN: &[(&str, &str)] = &[
    (
        "infra/catalog/aws-ecs.yaml",
        include_str!("../../infra/catalog/aws-ecs.yaml"),
    ),
    (
        "infra/catalog/kubernetes.yaml",
        include_str!("../../infra/catalog/kubernetes.yaml"),
    ),
    (
        "infra/catalog/azure-aci.yaml",
        include_str!("../../infra/catalog/azure-aci.yaml"),
    ),
    (
        "infra/catalog/local.yaml",
        include_str!("../../infra/catalog/local.yaml"),
    ),
];

impl Catalog {
    /// Parses and checks one catalog file's `text`; `origin` names it in messages.
    pub fn from_yaml_str(text: &str, origin: &str) -> Result<Catalog, PlanError> {
        let file: CatalogFile = parse_located(text, origin).map_err(|e| at_entry(e, text))?;
        let mut skus: Vec<Sku> = Vec::with_capacity(file.skus.len());
        for (i, spanned) in file.skus.into_iter().enumerate() {
            let at = location_of(&spanned.referenced);
            let sku = spanned.value;
            let err = |field: &str, message: String| PlanError::Parse {
                origin: one_line(origin),
                location: at,
                path: format!("skus[{i}]{field}"),
                message,
            };
            if sku.name.trim().is_empty() {
                return Err(err(".name", "must not be empty".into()));
            }
            if skus.iter().any(|s| s.name == sku.name) {
                return Err(err(
                    ".name",
                    format!("a second SKU named `{}`", one_line(&sku.name)),
                ));
            }
            check_price(&sku.price).map_err(|m| err(".price", m))?;
            if !is_date(&sku.as_of) {
                return Err(err(
                    ".as_of",
                    format!("must be a date YYYY-MM-DD, got `{}`", one_line(&sku.as_of)),
                ));
            }
            if sku.source.urls().is_empty() || sku.source.urls().iter().any(|u| u.is_empty()) {
                return Err(err(".source", "must name at least one source".into()));
            }
            if sku.max_containers == Some(0) {
                return Err(err(".max_containers", "must be at least 1".into()));
            }
            if let Some((f, m)) = check_placement(&sku) {
                return Err(err(&format!(".{f}"), m));
            }
            if let Some(d) = sku.gpu.as_ref().and_then(|g| g.driver.as_ref())
                && (d.source.urls().is_empty() || d.source.urls().iter().any(|u| u.is_empty()))
            {
                return Err(err(
                    ".gpu.driver.source",
                    "must name at least one source".into(),
                ));
            }
            if !sku.backend.runs_gpus() && sku.gpu.is_some() {
                return Err(err(
                    ".gpu",
                    "ACI retired its GPU SKUs in July 2025; Azure GPUs go through kubernetes (AKS)"
                        .into(),
                ));
            }
            skus.push(sku);
        }
        Ok(Catalog { skus })
    }

    /// The catalog files of `infra/catalog/`, as built into the crate.
    pub fn builtin() -> Catalog {
        let mut out = Catalog::default();
        for (origin, text) in BUILTIN {
            let c = Catalog::from_yaml_str(text, origin)
                .unwrap_or_else(|e| panic!("the built-in catalogs parse (tested): {e}"));
            out = out
                .merge(c)
                .unwrap_or_else(|e| panic!("the built-in catalogs have unique names: {e}"));
        }
        out
    }

    /// The built-in catalog files' names and texts, for `physalia plan --show-catalog` or to
    /// copy as a starting point.
    pub fn builtin_texts() -> &'static [(&'static str, &'static str)] {
        BUILTIN
    }

    /// Both catalogs' SKUs; a name in both is an error.
    pub fn merge(mut self, other: Catalog) -> Result<Catalog, PlanError> {
        for sku in other.skus {
            if self.skus.iter().any(|s| s.name == sku.name) {
                return Err(PlanError::invalid(
                    "catalog",
                    format!("SKU `{}` is in two catalogs", one_line(&sku.name)),
                ));
            }
            self.skus.push(sku);
        }
        Ok(self)
    }

    pub fn get(&self, name: &str) -> Option<&Sku> {
        self.skus.iter().find(|s| s.name == name)
    }
}

/// The catalog's entries, only where each starts.
#[derive(Deserialize)]
struct Skeleton {
    skus: Vec<Spanned<de::IgnoredAny>>,
}

/// Places a missing field at the start of its SKU entry rather than where the parser noticed
/// (the entry's last line).
fn at_entry(e: PlanError, text: &str) -> PlanError {
    let PlanError::Parse {
        origin,
        location,
        path,
        message,
    } = e
    else {
        return e;
    };
    let entry = path
        .strip_prefix("skus[")
        .and_then(|rest| rest.strip_suffix(']'))
        .and_then(|i| i.parse::<usize>().ok());
    let location = match entry {
        Some(i) if message.starts_with("missing field") => parse_located::<Skeleton>(text, &origin)
            .ok()
            .and_then(|s| s.skus.get(i).and_then(|n| location_of(&n.referenced)))
            .or(location),
        _ => location,
    };
    PlanError::Parse {
        origin,
        location,
        path,
        message,
    }
}

/// The placement's checks across fields: required where the worker shares a machine with the
/// platform's own processes (a Kubernetes node, an ECS GPU instance), at most the machine, with
/// machine types that are label values. Returns the failing field and why.
fn check_placement(sku: &Sku) -> Option<(&'static str, String)> {
    let Some(p) = &sku.placement else {
        return match sku.backend {
            Backend::Kubernetes => Some((
                "placement",
                "a kubernetes SKU needs `placement` (the node's instance types and what a pod \
                 can get after the node's reservations)"
                    .into(),
            )),
            Backend::Ecs if sku.gpu.is_some() => Some((
                "placement",
                "an ECS GPU SKU needs `placement` (the instance types and what the ECS agent \
                 registers on them)"
                    .into(),
            )),
            _ => None,
        };
    };
    if p.instance_types.is_empty() {
        return Some((
            "placement.instance_types",
            "must name at least one instance type".into(),
        ));
    }
    if let Some(t) = p.instance_types.iter().find(|t| {
        t.is_empty()
            || t.len() > 63
            || !t
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    }) {
        return Some((
            "placement.instance_types",
            format!(
                "`{}` is not an instance type name (1-63 of [A-Za-z0-9._-])",
                one_line(t)
            ),
        ));
    }
    if p.vcpus > sku.vcpus {
        return Some((
            "placement.vcpus",
            format!("{} is more than the SKU's {} vcpus", p.vcpus, sku.vcpus),
        ));
    }
    if p.memory_mib > sku.memory_gib * 1024.0 {
        return Some((
            "placement.memory_mib",
            format!(
                "{} MiB is more than the SKU's {} GiB",
                p.memory_mib, sku.memory_gib
            ),
        ));
    }
    if p.source.urls().is_empty() || p.source.urls().iter().any(|u| u.is_empty()) {
        return Some(("placement.source", "must name at least one source".into()));
    }
    None
}

fn check_price(p: &Price) -> Result<(), String> {
    let forms = [
        p.usd_per_hour.is_some(),
        p.usd_per_second.is_some(),
        p.usd_per_vcpu_second.is_some() || p.usd_per_gib_second.is_some(),
    ];
    match forms.iter().filter(|&&f| f).count() {
        0 => Err(
            "give one of usd_per_hour, usd_per_second, or usd_per_vcpu_second with \
                  usd_per_gib_second"
                .into(),
        ),
        1 if forms[2] && (p.usd_per_vcpu_second.is_none() || p.usd_per_gib_second.is_none()) => {
            Err("usd_per_vcpu_second and usd_per_gib_second go together".into())
        }
        1 => Ok(()),
        _ => Err(
            "give only one of usd_per_hour, usd_per_second, or usd_per_vcpu_second with \
                  usd_per_gib_second"
                .into(),
        ),
    }
}

fn is_date(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 10
        && b.iter().enumerate().all(|(i, c)| {
            if i == 4 || i == 7 {
                *c == b'-'
            } else {
                c.is_ascii_digit()
            }
        })
}

fn location_of(l: &serde_saphyr::Location) -> Option<Location> {
    Some(Location {
        line: u32::try_from(l.line()).ok().filter(|&l| l > 0)?,
        column: u32::try_from(l.column()).ok().filter(|&c| c > 0)?,
    })
}

// ---------------------------------------------------------------------------------------------
// Located YAML parsing (the pattern of orchestrator/src/spec.rs and policies/src/parse.rs)
// ---------------------------------------------------------------------------------------------

fn saphyr_options() -> serde_saphyr::Options {
    let mut options = serde_saphyr::Options::default();
    options.with_snippet = false;
    options
}

/// Deserializes `text` into `T`, keeping the parser's location and the failing field's path.
pub(crate) fn parse_located<T: DeserializeOwned>(text: &str, origin: &str) -> Result<T, PlanError> {
    let mut path = String::new();
    let result = serde_saphyr::with_deserializer_from_str_with_options(
        text,
        saphyr_options(),
        |deserializer| {
            serde_path_to_error::deserialize::<_, T>(deserializer).map_err(|e| {
                // `Spanned` entries add a `.value` step that is not in the text.
                let text = e.path().to_string().replace("].value", "]");
                path = if text == "." { String::new() } else { text };
                e.into_inner()
            })
        },
    );
    result.map_err(|e| PlanError::Parse {
        origin: one_line(origin),
        location: e.location().and_then(|l| location_of(&l)),
        path: one_line(&path),
        message: one_line(&saphyr_message(&e)),
    })
}

/// The message of a saphyr error without its location suffix or snippet.
fn saphyr_message(e: &serde_saphyr::Error) -> String {
    use serde_saphyr::MessageFormatter as _;
    let message: Cow<'_, str> =
        serde_saphyr::DefaultMessageFormatter.format_message(e.without_snippet());
    message.into_owned()
}

// ---------------------------------------------------------------------------------------------
// Range checks while deserializing: the parser places the error at the value
// ---------------------------------------------------------------------------------------------

pub(crate) fn positive<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let v = f64::deserialize(d)?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(de::Error::custom(format!(
            "must be a finite number above 0, got {v}"
        )))
    }
}

pub(crate) fn non_negative<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let v = f64::deserialize(d)?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(de::Error::custom(format!(
            "must be a finite number at least 0, got {v}"
        )))
    }
}

fn driver_version<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let v = String::deserialize(d)?;
    let ok = v
        .split('.')
        .all(|p| !p.is_empty() && p.len() <= 6 && p.bytes().all(|b| b.is_ascii_digit()));
    if ok {
        Ok(v)
    } else {
        Err(de::Error::custom(format!(
            "must be a driver version like 535.183.01 or a branch like 535, got `{}`",
            one_line(&v)
        )))
    }
}

pub(crate) fn positive_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    positive(d).map(Some)
}

fn non_negative_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    non_negative(d).map(Some)
}
