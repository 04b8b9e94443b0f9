//! The Kubernetes objects of one launch, as a pure function of the config, the spec and the worker count:
//! no client, no IO, so tests can write them out and validate them against the API schemas.
//!
//! - a `batch/v1` Job in Indexed completion mode: N completions, N in parallel, created suspended (no pod
//!   starts before its Secret exists) and resumed once the Secret and Service are in place. The rank is the
//!   completion index, handed to the worker as `PHYSALIA_RANK` by the downward API. `restartPolicy: Never`
//!   and `backoffLimitPerIndex: 0`: Kubernetes never restarts a worker; the coordinator relaunches from a
//!   checkpoint instead.
//! - a headless Service whose name is the pods' `subdomain`: each pod gets the DNS name
//!   `<job>-<index>.<service>.<namespace>.svc` (Indexed Jobs name their pods' hostnames `<job>-<index>`).
//! - a Secret holding every rank's files. Each pod mounts only its own rank's folder (`subPathExpr:
//!   $(PHYSALIA_RANK)`), so a worker sees its own key and no other.
//!
//! The Service and the Secret carry an owner reference to the Job ([`owned_by`]), so deleting the Job
//! garbage-collects them and the pods. In cluster mode the Job itself carries one to the coordinator's
//! Job (added at launch, which reads that Job's uid), so deleting the coordinator's Job collects every
//! launch it made.
//!
//! A GPU worker tolerates `nvidia.com/gpu` NoSchedule taints and the configuration's
//! ([`worker_tolerations`]); [`tolerates`] is the API's matching rule, which the preflight uses to
//! refuse a job whose every candidate node repels its pods.
//!
//! On AKS the coordinator's pod reaches Azure (an `az://` job store) through workload identity: AKS's
//! webhook mutates only pods labelled `azure.workload.identity/use: "true"`, giving them the federated
//! token file and `AZURE_*` variables; without the label an `az://` store cannot be reached
//! ([`uses_azure_workload_identity`]).

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::core::v1::{
    Affinity, Container, ContainerPort, EnvVar, EnvVarSource, KeyToPath, LocalObjectReference,
    NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectFieldSelector,
    PodSecurityContext, PodSpec, PodTemplateSpec, ResourceRequirements, Secret, SecretVolumeSource,
    Service, ServicePort, ServiceSpec, Taint, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::KubernetesConfig;
use crate::error::{Error, Result};
use crate::spec::{CONTAINER_SECRETS_DIR, ENV_ADVERTISE_IP, ENV_RANK, SecretValue, WorkerSpec};
use crate::{CoordinatorSpec, LaunchId};

/// The label every object of a launch carries; its value is [`LaunchId::base_name`].
pub const LABEL_LAUNCH: &str = "physalia.dev/launch";
/// The raw job id and segment, as annotations (label values cannot hold arbitrary ids).
pub const ANNOTATION_JOB_ID: &str = "physalia.dev/job-id";
pub const ANNOTATION_SEGMENT: &str = "physalia.dev/segment";
/// Set by the Job controller on every pod of an Indexed Job (the annotation exists since 1.21, the label
/// since 1.28; the annotation works on every supported version).
pub const COMPLETION_INDEX: &str = "batch.kubernetes.io/job-completion-index";
/// The container's name in every worker pod.
pub const CONTAINER: &str = "worker";
/// The container's name in the coordinator's pod.
pub const COORDINATOR_CONTAINER: &str = "coordinator";
/// The label of the coordinator's Job and pod; its value is [`LaunchId::coordinator_name`].
pub const LABEL_COORDINATOR: &str = "physalia.dev/coordinator";
/// The pod label AKS's workload identity webhook selects the pods it mutates by (its
/// MutatingWebhookConfiguration's `objectSelector`).
pub const AZURE_WORKLOAD_IDENTITY_USE: &str = "azure.workload.identity/use";
/// The client id the webhook hands a pod (`AZURE_CLIENT_ID`), which it reads from this annotation of the
/// pod's ServiceAccount; a value the container sets itself is kept (the webhook adds only variables the
/// container lacks).
pub const AZURE_WORKLOAD_IDENTITY_CLIENT_ID: &str = "azure.workload.identity/client-id";
/// The variable azure_identity's workload identity credential reads the client id from.
pub const ENV_AZURE_CLIENT_ID: &str = "AZURE_CLIENT_ID";

/// The cluster is AKS with workload identity enabled ([`KubernetesConfig::azure_workload_identity`]):
/// the coordinator's pod is labelled for the webhook whatever its job store.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AzureWorkloadIdentity {
    /// The client id of the user-assigned managed identity federated with the coordinator's
    /// ServiceAccount. Set, the coordinator's container gets it as `AZURE_CLIENT_ID`, so the
    /// ServiceAccount need not carry the [`AZURE_WORKLOAD_IDENTITY_CLIENT_ID`] annotation; unset, the
    /// annotation must be there (`kubectl annotate serviceaccount physalia-coordinator
    /// azure.workload.identity/client-id=CLIENT_ID`).
    pub client_id: Option<String>,
}

/// Whether the coordinator's pod must be labelled for AKS's workload identity webhook: the cluster is
/// AKS with workload identity ([`KubernetesConfig::azure_workload_identity`]), or the job store is
/// Azure Blob Storage (the coordinator's command names an `az://`, `abfs[s]://`, `azure://` or
/// `https://ACCOUNT.blob|dfs.core.windows.net` URL, or submit handed it `AZURE_STORAGE_ACCOUNT_NAME`,
/// which it does only for an Azure store), which no other Kubernetes identity reaches.
pub fn uses_azure_workload_identity(cfg: &KubernetesConfig, spec: &CoordinatorSpec) -> bool {
    let azure_url = |a: &String| {
        ["az://", "abfs://", "abfss://", "azure://"]
            .iter()
            .any(|scheme| a.starts_with(scheme))
            || (a.starts_with("https://")
                && (a.contains(".blob.core.windows.net") || a.contains(".dfs.core.windows.net")))
    };
    cfg.azure_workload_identity.is_some()
        || spec.command.iter().any(azure_url)
        || spec.env.contains_key("AZURE_STORAGE_ACCOUNT_NAME")
}

/// The GPU resource the NVIDIA device plugin advertises.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
const SECRETS_VOLUME: &str = "physalia-secrets";
/// The API server refuses Secrets over 1 MiB.
const SECRET_MAX_BYTES: usize = 1 << 20;

/// The three objects of one launch, before the Job exists (no owner references yet).
#[derive(Clone, Debug)]
pub struct LaunchObjects {
    pub job: Job,
    pub service: Service,
    pub secret: Secret,
}

/// Builds a launch's objects. The spec must already be valid ([`WorkerSpec::validate`]).
pub fn launch_objects(
    cfg: &KubernetesConfig,
    spec: &WorkerSpec,
    n_workers: usize,
) -> Result<LaunchObjects> {
    let id = LaunchId::new(&spec.job_id, spec.segment);
    let name = id.base_name();
    let labels = BTreeMap::from([
        ("app.kubernetes.io/name".to_string(), "physalia".to_string()),
        (
            "app.kubernetes.io/component".to_string(),
            "worker".to_string(),
        ),
        (
            "app.kubernetes.io/managed-by".to_string(),
            "physalia".to_string(),
        ),
        (LABEL_LAUNCH.to_string(), name.clone()),
    ]);
    let meta = ObjectMeta {
        name: Some(name.clone()),
        namespace: Some(cfg.namespace.clone()),
        labels: Some(labels.clone()),
        annotations: Some(BTreeMap::from([
            (ANNOTATION_JOB_ID.to_string(), spec.job_id.clone()),
            (ANNOTATION_SEGMENT.to_string(), spec.segment.to_string()),
        ])),
        ..ObjectMeta::default()
    };

    let (secret_data, items) = secret_layout(spec, n_workers)?;
    let secret = Secret {
        metadata: meta.clone(),
        type_: Some("Opaque".into()),
        immutable: Some(true),
        data: Some(secret_data),
        ..Secret::default()
    };

    let service = Service {
        metadata: meta.clone(),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(BTreeMap::from([(LABEL_LAUNCH.to_string(), name.clone())])),
            // Peers dial each other before any readiness is known; DNS records must exist at once.
            publish_not_ready_addresses: Some(true),
            ports: Some(vec![ServicePort {
                name: Some("mesh".into()),
                protocol: Some("UDP".into()),
                port: i32::from(spec.network.mesh_port),
                target_port: Some(IntOrString::Int(i32::from(spec.network.mesh_port))),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    };

    let field = |path: &str| EnvVarSource {
        field_ref: Some(ObjectFieldSelector {
            field_path: path.into(),
            ..ObjectFieldSelector::default()
        }),
        ..EnvVarSource::default()
    };
    let mut env = vec![
        EnvVar {
            name: ENV_RANK.into(),
            value_from: Some(field(&format!(
                "metadata.annotations['{COMPLETION_INDEX}']"
            ))),
            ..EnvVar::default()
        },
        EnvVar {
            name: ENV_ADVERTISE_IP.into(),
            value_from: Some(field("status.podIP")),
            ..EnvVar::default()
        },
    ];
    env.extend(
        spec.base_env(n_workers)
            .into_iter()
            .map(|(name, value)| EnvVar {
                name,
                value: Some(value),
                ..EnvVar::default()
            }),
    );

    let mut requests = BTreeMap::from([
        ("cpu".to_string(), cpu_quantity(spec.cpu)),
        ("memory".to_string(), memory_quantity(spec.memory_gib)),
    ]);
    let mut limits = BTreeMap::from([("memory".to_string(), memory_quantity(spec.memory_gib))]);
    let (node_selector, affinity, tolerations) = placement(cfg, spec);
    if let Some(gpu) = &spec.gpu {
        let count = Quantity(gpu.count.to_string());
        requests.insert(GPU_RESOURCE.into(), count.clone());
        limits.insert(GPU_RESOURCE.into(), count);
    }

    let container = Container {
        name: CONTAINER.into(),
        image: Some(spec.image_for(cfg.gpu_image.as_deref()).to_string()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: (!spec.command.is_empty()).then(|| spec.command.clone()),
        env: Some(env),
        ports: Some(vec![ContainerPort {
            name: Some("mesh".into()),
            container_port: i32::from(spec.network.mesh_port),
            protocol: Some("UDP".into()),
            ..ContainerPort::default()
        }]),
        resources: Some(ResourceRequirements {
            requests: Some(requests),
            limits: Some(limits),
            ..ResourceRequirements::default()
        }),
        volume_mounts: Some(vec![VolumeMount {
            name: SECRETS_VOLUME.into(),
            mount_path: CONTAINER_SECRETS_DIR.into(),
            sub_path_expr: Some(format!("$({ENV_RANK})")),
            read_only: Some(true),
            ..VolumeMount::default()
        }]),
        ..Container::default()
    };

    let n = i32::try_from(n_workers)
        .map_err(|_| Error::InvalidSpec(format!("{n_workers} workers is too many for a Job")))?;
    let pod_labels = labels;
    let job = Job {
        metadata: meta,
        spec: Some(JobSpec {
            completion_mode: Some("Indexed".into()),
            completions: Some(n),
            parallelism: Some(n),
            backoff_limit_per_index: Some(0),
            // With backoffLimitPerIndex 0 each index fails at most once, so n never fails the Job on
            // its own: the other ranks keep running. A server before 1.29 drops backoffLimitPerIndex;
            // backoffLimit then bounds the replacement pods to n instead of its default of six.
            backoff_limit: Some(n),
            suspend: Some(true),
            ttl_seconds_after_finished: cfg.ttl_after_finished_s,
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    restart_policy: Some("Never".into()),
                    subdomain: Some(name.clone()),
                    // Workers never call the API server.
                    automount_service_account_token: Some(false),
                    enable_service_links: Some(false),
                    containers: vec![container],
                    volumes: Some(vec![Volume {
                        name: SECRETS_VOLUME.into(),
                        secret: Some(SecretVolumeSource {
                            secret_name: Some(name.clone()),
                            items: Some(items),
                            default_mode: Some(if cfg.fs_group.is_some() { 0o440 } else { 0o400 }),
                            ..SecretVolumeSource::default()
                        }),
                        ..Volume::default()
                    }]),
                    node_selector,
                    affinity,
                    tolerations,
                    image_pull_secrets: cfg
                        .image_pull_secret
                        .as_ref()
                        .map(|s| vec![LocalObjectReference { name: s.clone() }]),
                    security_context: cfg.fs_group.map(|g| PodSecurityContext {
                        fs_group: Some(g),
                        ..PodSecurityContext::default()
                    }),
                    ..PodSpec::default()
                }),
            },
            ..JobSpec::default()
        }),
        ..Job::default()
    };
    Ok(LaunchObjects {
        job,
        service,
        secret,
    })
}

/// The coordinator's `batch/v1` Job: one pod (`backoffLimit: 0`, `restartPolicy: Never`: a coordinator
/// that fails is not restarted behind the user's back; `submit --resume` decides), running as
/// [`KubernetesConfig::coordinator_service_account`] (`infra/k8s/rbac.yaml`, whose Role is exactly what
/// the coordinator calls), with the spec's resources, labels and plain environment plus its own pod IP as
/// `PHYSALIA_ADVERTISE_IP` (what it hands workers as the control address). It mounts the service-account
/// token (it calls the API server) and no Secret: nothing secret is in the spec. Where it reaches Azure
/// ([`uses_azure_workload_identity`]) its pod carries `azure.workload.identity/use: "true"`, and the
/// configuration's identity's client id as `AZURE_CLIENT_ID`.
pub fn coordinator_job(cfg: &KubernetesConfig, spec: &CoordinatorSpec) -> Job {
    let name = LaunchId::coordinator_name(&spec.job_id);
    let mut labels = spec.labels.clone();
    let azure = uses_azure_workload_identity(cfg, spec);
    for (k, v) in [
        ("app.kubernetes.io/name", "physalia"),
        ("app.kubernetes.io/component", "coordinator"),
        ("app.kubernetes.io/managed-by", "physalia"),
        (LABEL_COORDINATOR, name.as_str()),
    ] {
        labels.insert(k.to_string(), v.to_string());
    }
    let meta = ObjectMeta {
        name: Some(name.clone()),
        namespace: Some(cfg.namespace.clone()),
        labels: Some(labels.clone()),
        annotations: Some(BTreeMap::from([(
            ANNOTATION_JOB_ID.to_string(),
            spec.job_id.clone(),
        )])),
        ..ObjectMeta::default()
    };
    let mut env = vec![EnvVar {
        name: ENV_ADVERTISE_IP.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: "status.podIP".into(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }];
    env.extend(
        spec.env
            .iter()
            .filter(|(k, _)| k.as_str() != ENV_ADVERTISE_IP)
            .map(|(name, value)| EnvVar {
                name: name.clone(),
                value: Some(value.clone()),
                ..EnvVar::default()
            }),
    );
    let client_id = (cfg.azure_workload_identity.as_ref()).and_then(|w| w.client_id.as_ref());
    if let Some(id) = client_id
        && !spec.env.contains_key(ENV_AZURE_CLIENT_ID)
    {
        env.push(EnvVar {
            name: ENV_AZURE_CLIENT_ID.into(),
            value: Some(id.clone()),
            ..EnvVar::default()
        });
    }
    // the pod's labels only: the webhook selects pods, and the Job needs no identity
    let mut pod_labels = labels.clone();
    if azure {
        pod_labels.insert(AZURE_WORKLOAD_IDENTITY_USE.to_string(), "true".to_string());
    }
    let container = Container {
        name: COORDINATOR_CONTAINER.into(),
        image: Some(spec.image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: (!spec.command.is_empty()).then(|| spec.command.clone()),
        env: Some(env),
        ports: Some(
            spec.control_ports()
                .enumerate()
                .map(|(i, port)| ContainerPort {
                    name: Some(match i {
                        0 => "control".to_string(),
                        i => format!("control-{i}"),
                    }),
                    container_port: i32::from(port),
                    protocol: Some("UDP".into()),
                    ..ContainerPort::default()
                })
                .collect(),
        ),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), cpu_quantity(spec.cpu)),
                ("memory".to_string(), memory_quantity(spec.memory_gib)),
            ])),
            limits: Some(BTreeMap::from([(
                "memory".to_string(),
                memory_quantity(spec.memory_gib),
            )])),
            ..ResourceRequirements::default()
        }),
        ..Container::default()
    };
    Job {
        metadata: meta,
        spec: Some(JobSpec {
            backoff_limit: Some(0),
            completions: Some(1),
            parallelism: Some(1),
            ttl_seconds_after_finished: cfg.ttl_after_finished_s,
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    restart_policy: Some("Never".into()),
                    service_account_name: Some(cfg.coordinator_service_account.clone()),
                    automount_service_account_token: Some(true),
                    enable_service_links: Some(false),
                    containers: vec![container],
                    image_pull_secrets: cfg
                        .image_pull_secret
                        .as_ref()
                        .map(|s| vec![LocalObjectReference { name: s.clone() }]),
                    ..PodSpec::default()
                }),
            },
            ..JobSpec::default()
        }),
        ..Job::default()
    }
}

/// Secret keys and the volume items that put rank r's files under `<r>/`: a shared file is stored once
/// (`shared.<file>`) and projected into every rank's folder; a per-rank file is `rank-<r>.<file>`.
fn secret_layout(
    spec: &WorkerSpec,
    n_workers: usize,
) -> Result<(BTreeMap<String, ByteString>, Vec<KeyToPath>)> {
    let mut data = BTreeMap::new();
    let mut items = Vec::new();
    for (file, value) in &spec.secrets {
        match value {
            SecretValue::Same(b) => {
                let key = format!("shared.{file}");
                data.insert(key.clone(), ByteString(b.expose().to_vec()));
                items.extend((0..n_workers).map(|r| KeyToPath {
                    key: key.clone(),
                    path: format!("{r}/{file}"),
                    ..KeyToPath::default()
                }));
            }
            SecretValue::PerRank(values) => {
                for (r, b) in values.iter().enumerate() {
                    let key = format!("rank-{r}.{file}");
                    data.insert(key.clone(), ByteString(b.expose().to_vec()));
                    items.push(KeyToPath {
                        key,
                        path: format!("{r}/{file}"),
                        ..KeyToPath::default()
                    });
                }
            }
        }
    }
    // The limit applies to the stored object, where values are base64.
    let total: usize = data
        .iter()
        .map(|(k, v)| k.len() + v.0.len().div_ceil(3) * 4)
        .sum();
    if total > SECRET_MAX_BYTES {
        return Err(Error::InvalidSpec(format!(
            "the secrets of {n_workers} workers take {total} bytes, over the 1 MiB a Kubernetes Secret holds"
        )));
    }
    // Items sorted by path so the generated objects are stable.
    items.sort_by(|a, b| a.path.cmp(&b.path));
    Ok((data, items))
}

/// A pod's `nodeSelector`, node affinity and tolerations.
type Placement = (
    Option<BTreeMap<String, String>>,
    Option<Affinity>,
    Option<Vec<Toleration>>,
);

/// The labels a worker's node must carry besides its instance type: the configuration's, and the GPU
/// model's product label where the spec names no instance type (the preflight looks for such a node).
pub fn node_labels(cfg: &KubernetesConfig, spec: &WorkerSpec) -> BTreeMap<String, String> {
    let mut labels = cfg.node_selector.clone();
    if spec.instance_types.is_empty()
        && let Some(kind) = spec.gpu.as_ref().and_then(|g| g.kind.as_ref())
    {
        labels.insert(cfg.gpu_product_label.clone(), kind.clone());
    }
    labels
}

/// Where a worker pod may run: on a node of one of the spec's instance types (the well-known label
/// every distribution sets; `nodeSelector` for one type, a required node affinity for several), and
/// on nodes carrying the configuration's labels; tolerating the configuration's taints and, for a GPU
/// pod, the `nvidia.com/gpu` taint GKE (and many EKS set-ups) put on GPU nodes. A GPU model
/// ([`crate::GpuRequest::kind`]) selects on [`KubernetesConfig::gpu_product_label`] only where the
/// spec names no instance type.
fn placement(cfg: &KubernetesConfig, spec: &WorkerSpec) -> Placement {
    let mut selector = node_labels(cfg, spec);
    let mut affinity = None;
    match spec.instance_types.as_slice() {
        [] => {}
        [one] => {
            selector.insert(cfg.instance_type_label.clone(), one.clone());
        }
        many => {
            affinity = Some(Affinity {
                node_affinity: Some(NodeAffinity {
                    required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                        node_selector_terms: vec![NodeSelectorTerm {
                            match_expressions: Some(vec![NodeSelectorRequirement {
                                key: cfg.instance_type_label.clone(),
                                operator: "In".into(),
                                values: Some(many.to_vec()),
                            }]),
                            ..NodeSelectorTerm::default()
                        }],
                    }),
                    ..NodeAffinity::default()
                }),
                ..Affinity::default()
            });
        }
    }
    let tolerations = worker_tolerations(cfg, spec);
    (
        (!selector.is_empty()).then_some(selector),
        affinity,
        (!tolerations.is_empty()).then_some(tolerations),
    )
}

/// The taints a worker pod tolerates: for a GPU pod, any `nvidia.com/gpu` NoSchedule taint (GKE's
/// `nvidia.com/gpu=present`, the common EKS set-up's), then the configuration's
/// ([`KubernetesConfig::tolerations`], the job file's `backend.kubernetes.tolerations`).
pub fn worker_tolerations(cfg: &KubernetesConfig, spec: &WorkerSpec) -> Vec<Toleration> {
    let mut tolerations = Vec::new();
    if spec.gpu.is_some() {
        tolerations.push(Toleration {
            key: Some(GPU_RESOURCE.into()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Toleration::default()
        });
    }
    tolerations.extend(cfg.tolerations.iter().cloned());
    tolerations
}

/// Whether a taint keeps a pod that does not tolerate it off the node: NoSchedule (the scheduler
/// refuses it) and NoExecute (refused and evicted); PreferNoSchedule only steers the scheduler.
pub fn taint_repels(taint: &Taint) -> bool {
    matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute")
}

/// Whether one of `tolerations` matches `taint`, as the API's `Toleration.ToleratesTaint` decides: an
/// effect, where given, must be the taint's; a key, where given, must be the taint's (an empty key
/// with `Exists` tolerates every taint); `Equal` (the default) compares the values, `Exists` takes
/// any value.
pub fn tolerates(tolerations: &[Toleration], taint: &Taint) -> bool {
    fn given(v: &Option<String>) -> Option<&str> {
        v.as_deref().filter(|s| !s.is_empty())
    }
    tolerations.iter().any(|t| {
        if given(&t.effect).is_some_and(|e| e != taint.effect) {
            return false;
        }
        if given(&t.key).is_some_and(|k| k != taint.key) {
            return false;
        }
        match t.operator.as_deref().unwrap_or("Equal") {
            "" | "Equal" => {
                t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
            }
            "Exists" => true,
            _ => false,
        }
    })
}

/// A taint as kubectl writes it: `key=value:Effect` (`key:Effect` without a value).
pub fn taint_text(taint: &Taint) -> String {
    match taint.value.as_deref().filter(|v| !v.is_empty()) {
        Some(v) => format!("{}={v}:{}", taint.key, taint.effect),
        None => format!("{}:{}", taint.key, taint.effect),
    }
}

/// The job file's `backend.kubernetes.tolerations` entry that tolerates `taint`, in YAML flow style.
pub fn toleration_text(taint: &Taint) -> String {
    match taint.value.as_deref().filter(|v| !v.is_empty()) {
        Some(v) => format!(
            "{{key: {}, value: {v}, effect: {}}}",
            taint.key, taint.effect
        ),
        None => format!(
            "{{key: {}, operator: Exists, effect: {}}}",
            taint.key, taint.effect
        ),
    }
}

/// `cpu` in millicores, rounded up (the scheduler must not give less than asked).
pub fn cpu_quantity(cpu: f64) -> Quantity {
    Quantity(format!("{}m", (cpu * 1000.0).ceil() as u64))
}

/// `memory_gib` in MiB, rounded up.
pub fn memory_quantity(memory_gib: f64) -> Quantity {
    Quantity(format!("{}Mi", (memory_gib * 1024.0).ceil() as u64))
}

/// An owner reference to `job` (which must have been created: it needs the server-assigned uid).
/// `blockOwnerDeletion` is left unset: setting it needs `update` on `jobs/finalizers`, more than the
/// coordinator's Role grants, and explicit cleanup deletes the dependants anyway.
pub fn owned_by(job: &Job) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: "batch/v1".into(),
        kind: "Job".into(),
        name: job.metadata.name.clone()?,
        uid: job.metadata.uid.clone()?,
        controller: Some(false),
        ..OwnerReference::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_over_a_mebibyte_are_refused_at_build_time() {
        use crate::spec::{SecretBytes, tests::spec};
        let mut s = spec();
        let n = 400;
        s.secrets.insert(
            "key.pem".into(),
            SecretValue::PerRank((0..n).map(|_| SecretBytes::new(vec![b'k'; 2000])).collect()),
        );
        let err = launch_objects(&KubernetesConfig::default(), &s, n).unwrap_err();
        assert!(
            err.to_string()
                .contains("over the 1 MiB a Kubernetes Secret holds"),
            "{err}"
        );
        s.secrets.insert(
            "key.pem".into(),
            SecretValue::PerRank((0..n).map(|_| SecretBytes::new(vec![b'k'; 1000])).collect()),
        );
        assert!(launch_objects(&KubernetesConfig::default(), &s, n).is_ok());
    }

    #[test]
    fn gpu_pods_run_the_gpu_image() {
        use crate::GpuRequest;
        use crate::spec::tests::spec;
        let cfg = KubernetesConfig {
            gpu_image: Some("ghcr.io/physalia/worker:0.1.0-cuda".into()),
            ..KubernetesConfig::default()
        };
        let image = |s: &WorkerSpec| {
            let objects = launch_objects(&cfg, s, 2).unwrap();
            let pod = objects.job.spec.unwrap().template.spec.unwrap();
            pod.containers[0].image.clone().unwrap()
        };
        let mut s = spec();
        assert_eq!(image(&s), "ghcr.io/physalia/worker:0.1.0");
        s.gpu = Some(GpuRequest {
            count: 1,
            kind: None,
        });
        assert_eq!(image(&s), "ghcr.io/physalia/worker:0.1.0-cuda");
        // no GPU image configured: the spec's image runs on the GPU
        let objects = launch_objects(&KubernetesConfig::default(), &s, 2).unwrap();
        let pod = objects.job.spec.unwrap().template.spec.unwrap();
        assert_eq!(
            pod.containers[0].image.as_deref(),
            Some("ghcr.io/physalia/worker:0.1.0")
        );
    }

    #[test]
    fn pods_are_placed_by_instance_type_and_the_configured_labels_and_taints() {
        use crate::GpuRequest;
        use crate::spec::tests::spec;
        let pod = |cfg: &KubernetesConfig, s: &WorkerSpec| {
            let objects = launch_objects(cfg, s, 1).unwrap();
            objects.job.spec.unwrap().template.spec.unwrap()
        };
        let mut s = spec();
        s.gpu = Some(GpuRequest {
            count: 1,
            kind: Some("L4".into()),
        });
        s.instance_types = vec!["g2-standard-8".into()];
        let p = pod(&KubernetesConfig::default(), &s);
        assert_eq!(
            p.node_selector,
            Some(BTreeMap::from([(
                "node.kubernetes.io/instance-type".into(),
                "g2-standard-8".into()
            )]))
        );
        let tolerations = p.tolerations.unwrap();
        assert_eq!(tolerations.len(), 1);
        assert_eq!(tolerations[0].key.as_deref(), Some(GPU_RESOURCE));
        // a distribution's labels and taints, from the job file
        let cfg = KubernetesConfig {
            node_selector: BTreeMap::from([(
                "cloud.google.com/gke-accelerator".into(),
                "nvidia-l4".into(),
            )]),
            tolerations: vec![Toleration {
                key: Some("sku".into()),
                operator: Some("Equal".into()),
                value: Some("gpu".into()),
                effect: Some("NoSchedule".into()),
                ..Toleration::default()
            }],
            ..KubernetesConfig::default()
        };
        let p = pod(&cfg, &s);
        let selector = p.node_selector.unwrap();
        assert_eq!(selector["cloud.google.com/gke-accelerator"], "nvidia-l4");
        assert_eq!(
            selector["node.kubernetes.io/instance-type"],
            "g2-standard-8"
        );
        assert_eq!(p.tolerations.unwrap()[1].key.as_deref(), Some("sku"));
        // several types: a node affinity
        s.instance_types.push("g2-standard-12".into());
        let p = pod(&KubernetesConfig::default(), &s);
        assert!(p.node_selector.is_none());
        let terms = p
            .affinity
            .unwrap()
            .node_affinity
            .unwrap()
            .required_during_scheduling_ignored_during_execution
            .unwrap()
            .node_selector_terms;
        let req = &terms[0].match_expressions.as_ref().unwrap()[0];
        assert_eq!(
            (req.operator.as_str(), req.values.clone().unwrap().len()),
            ("In", 2)
        );
        // no instance type: the GPU model on the product label, as before
        s.instance_types.clear();
        let p = pod(&KubernetesConfig::default(), &s);
        assert_eq!(p.node_selector.unwrap()["nvidia.com/gpu.product"], "L4");
    }

    #[test]
    fn tolerations_match_taints_as_the_api_does() {
        let taint = |key: &str, value: Option<&str>, effect: &str| Taint {
            key: key.into(),
            value: value.map(str::to_string),
            effect: effect.into(),
            ..Taint::default()
        };
        let gke = taint("nvidia.com/gpu", Some("present"), "NoSchedule");
        let aks = taint("sku", Some("gpu"), "NoSchedule");
        let t = |key: &str, op: Option<&str>, value: Option<&str>, effect: Option<&str>| {
            super::super::toleration(key, op, value, effect)
        };
        // a GPU pod's own toleration takes GKE's taint, and not AKS's
        let mut s = crate::spec::tests::spec();
        s.gpu = Some(crate::GpuRequest {
            count: 1,
            kind: None,
        });
        let own = worker_tolerations(&KubernetesConfig::default(), &s);
        assert!(tolerates(&own, &gke));
        assert!(!tolerates(&own, &aks));
        // a CPU pod tolerates nothing
        let cpu = worker_tolerations(&KubernetesConfig::default(), &crate::spec::tests::spec());
        assert!(cpu.is_empty() && !tolerates(&cpu, &gke));
        // Equal compares values; Exists takes any; an effect must match where given
        assert!(tolerates(
            &[t("sku", None, Some("gpu"), Some("NoSchedule"))],
            &aks
        ));
        assert!(!tolerates(
            &[t("sku", None, Some("cpu"), Some("NoSchedule"))],
            &aks
        ));
        assert!(tolerates(&[t("sku", Some("Exists"), None, None)], &aks));
        assert!(!tolerates(
            &[t("sku", Some("Exists"), None, Some("NoExecute"))],
            &aks
        ));
        assert!(!tolerates(&[t("other", Some("Exists"), None, None)], &aks));
        // an empty key with Exists tolerates every taint
        let everything = Toleration {
            operator: Some("Exists".into()),
            ..Toleration::default()
        };
        assert!(tolerates(std::slice::from_ref(&everything), &gke));
        assert!(taint_repels(&aks));
        assert!(taint_repels(&taint("k", None, "NoExecute")));
        assert!(!taint_repels(&taint("k", None, "PreferNoSchedule")));
        assert_eq!(taint_text(&aks), "sku=gpu:NoSchedule");
        assert_eq!(taint_text(&taint("k", None, "NoExecute")), "k:NoExecute");
        assert_eq!(
            toleration_text(&taint("k", None, "NoExecute")),
            "{key: k, operator: Exists, effect: NoExecute}"
        );
    }

    #[test]
    fn quantities_round_up() {
        assert_eq!(cpu_quantity(2.0).0, "2000m");
        assert_eq!(cpu_quantity(0.3333).0, "334m");
        assert_eq!(memory_quantity(8.0).0, "8192Mi");
        assert_eq!(memory_quantity(0.1).0, "103Mi");
    }
}
