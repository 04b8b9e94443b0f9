//! The kubernetes backend (kube-rs): one Indexed Job per launch, with a headless Service and a Secret
//! owned by it ([`objects`] builds them, without IO).
//!
//! A launch creates the Job suspended (in cluster mode owned by the coordinator's Job, so deleting that
//! collects it), then the Secret and the Service with owner references to it, then resumes the Job and
//! polls the pods until every rank runs. It fails fast on what will not fix itself
//! (an image that cannot be pulled, a pod refused by a ResourceQuota, a pod that failed) and gives up after
//! [`KubernetesConfig::start_timeout`] on what might (a pod nobody can schedule), naming each waiting rank
//! and the scheduler's reason. On failure it deletes the Job (background propagation: the garbage collector
//! removes its pods) and, explicitly, the Secret and Service, so the keys are gone at once.
//!
//! The coordinator's permissions are `infra/k8s/rbac.yaml`; every call here is covered by it.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, Node, Pod, Secret, Service};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, LogParams, Patch, PatchParams, PostParams};

use crate::error::{BackendName, Error, Result};
use crate::{
    Backend, CoordinatorHandle, CoordinatorSpec, CoordinatorStatus, Demand, LaunchId, Launched,
    PlatformObject, WorkerSpec, WorkerState, WorkerStatus,
};

pub mod objects;

use objects::{
    COMPLETION_INDEX, CONTAINER, COORDINATOR_CONTAINER, LABEL_COORDINATOR, LABEL_LAUNCH,
};
pub use objects::{LaunchObjects, coordinator_job, launch_objects};

/// The kind of the coordinator's one object in its [`CoordinatorHandle`].
const KIND_JOB: &str = "job.batch";

const NAME: BackendName = "kubernetes";

/// Waiting reasons that mean the image will not come (the kubelet retries, but only with backoff).
const IMAGE_ERRORS: [&str; 4] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
];

#[derive(Clone, Debug)]
pub struct KubernetesConfig {
    /// Namespace of every object (`infra/k8s/namespace.yaml` creates `physalia`).
    pub namespace: String,
    /// How long a launch waits for every pod to run (node scale-up and a CUDA image pull take minutes).
    pub start_timeout: Duration,
    /// How often a launch looks at the pods.
    pub poll_interval: Duration,
    /// Finished Jobs (and, through owner references, their Secret and Service) are deleted this long
    /// after they finish, in case the coordinator did not.
    pub ttl_after_finished_s: Option<i32>,
    /// The node label a [`crate::GpuRequest::kind`] selects on (NVIDIA GPU feature discovery's) when the
    /// spec names no instance type.
    pub gpu_product_label: String,
    /// The node label [`WorkerSpec::instance_types`] select on: `node.kubernetes.io/instance-type`.
    pub instance_type_label: String,
    /// Labels a worker's node must also carry (a distribution's GPU label, a node pool), from the job
    /// file's `backend.kubernetes.node_selector`.
    pub node_selector: BTreeMap<String, String>,
    /// Taints worker pods tolerate beyond `nvidia.com/gpu` (AKS GPU pools' `sku=gpu:NoSchedule`), from
    /// the job file's `backend.kubernetes.tolerations`.
    pub tolerations: Vec<k8s_openapi::api::core::v1::Toleration>,
    /// A pull secret for a private registry, in the namespace.
    pub image_pull_secret: Option<String>,
    /// The image GPU workers run (a [`WorkerSpec`] with `gpu`): the CUDA worker image
    /// (`worker-image/Dockerfile.cuda`). `None` runs the spec's image.
    pub gpu_image: Option<String>,
    /// Pod `fsGroup`: set it when the image runs as a non-root user, so the secret files (mode 0440, this
    /// group) are readable. Without it they are 0400, owned by root.
    pub fs_group: Option<i64>,
    /// The ServiceAccount the coordinator's Job runs as (`infra/k8s/rbac.yaml`).
    pub coordinator_service_account: String,
    /// Node pools start nodes for pending pods (a cluster autoscaler or Karpenter scaling a pool from
    /// zero): the preflight does not refuse a job because no node of the SKU's type runs now.
    pub scales_from_zero: bool,
    /// The cluster is AKS with workload identity: the coordinator's pod is labelled for its webhook
    /// (as it is anyway for an `az://` job store; [`objects::uses_azure_workload_identity`]).
    pub azure_workload_identity: Option<objects::AzureWorkloadIdentity>,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        KubernetesConfig {
            namespace: "physalia".into(),
            start_timeout: Duration::from_secs(900),
            poll_interval: Duration::from_secs(2),
            ttl_after_finished_s: Some(3600),
            gpu_product_label: "nvidia.com/gpu.product".into(),
            instance_type_label: "node.kubernetes.io/instance-type".into(),
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            image_pull_secret: None,
            gpu_image: None,
            fs_group: None,
            coordinator_service_account: "physalia-coordinator".into(),
            scales_from_zero: false,
            azure_workload_identity: None,
        }
    }
}

/// A toleration of the taint `key` (`operator` `Equal` by default, or `Exists`), of one `effect` or all.
pub fn toleration(
    key: &str,
    operator: Option<&str>,
    value: Option<&str>,
    effect: Option<&str>,
) -> k8s_openapi::api::core::v1::Toleration {
    k8s_openapi::api::core::v1::Toleration {
        key: Some(key.to_string()),
        operator: Some(operator.unwrap_or("Equal").to_string()),
        value: value.map(str::to_string),
        effect: effect.map(str::to_string),
        ..Default::default()
    }
}

pub struct KubernetesBackend {
    client: Client,
    cfg: KubernetesConfig,
}

/// The client configuration of `kubeconfig`'s context `context`, or an error that lists the contexts it
/// has.
pub async fn config_at_context(
    kubeconfig: kube::config::Kubeconfig,
    context: &str,
) -> Result<kube::Config> {
    if !kubeconfig.contexts.iter().any(|c| c.name == context) {
        let known: Vec<&str> = kubeconfig
            .contexts
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        return Err(Error::Config {
            backend: NAME,
            detail: format!(
                "backend.kubernetes.context: the kubeconfig has no context {context:?} (it has: {}); \
                 `kubectl config get-contexts` lists them",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ),
        });
    }
    let options = kube::config::KubeConfigOptions {
        context: Some(context.to_string()),
        ..Default::default()
    };
    kube::Config::from_custom_kubeconfig(kubeconfig, &options)
        .await
        .map_err(|e| Error::Config {
            backend: NAME,
            detail: format!("the kubeconfig's context {context:?}: {e}"),
        })
}

impl KubernetesBackend {
    /// A backend over any kube client (tests pass one over a mock service).
    pub fn new(client: Client, cfg: KubernetesConfig) -> KubernetesBackend {
        KubernetesBackend { client, cfg }
    }

    /// A backend with the ambient configuration: in a pod, its ServiceAccount; elsewhere `$KUBECONFIG` or
    /// `~/.kube/config`, at its current context or at `context` when one is named.
    pub async fn infer(cfg: KubernetesConfig, context: Option<&str>) -> Result<KubernetesBackend> {
        let client = match context {
            None => Client::try_default().await.map_err(|e| Error::Config {
                backend: NAME,
                detail: format!(
                    "no usable Kubernetes configuration (in-cluster service account, $KUBECONFIG or \
                     ~/.kube/config): {e}"
                ),
            })?,
            Some(context) => {
                let kubeconfig = kube::config::Kubeconfig::read().map_err(|e| Error::Config {
                    backend: NAME,
                    detail: format!(
                        "backend.kubernetes.context names {context:?}, but no kubeconfig could be \
                         read ($KUBECONFIG or ~/.kube/config): {e}"
                    ),
                })?;
                let config = config_at_context(kubeconfig, context).await?;
                Client::try_from(config).map_err(|e| Error::Config {
                    backend: NAME,
                    detail: format!("the kubeconfig's context {context:?}: {e}"),
                })?
            }
        };
        Ok(KubernetesBackend::new(client, cfg))
    }

    pub fn config(&self) -> &KubernetesConfig {
        &self.cfg
    }

    fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.cfg.namespace)
    }

    fn selector(name: &str) -> ListParams {
        ListParams::default().labels(&format!("{LABEL_LAUNCH}={name}"))
    }

    /// The pods of a launch, one per rank (the newest where a rank has several).
    async fn pods(&self, name: &str) -> Result<BTreeMap<usize, Pod>> {
        let pods = self
            .api::<Pod>()
            .list(&Self::selector(name))
            .await
            .map_err(|e| self.api_error(e, "list pods"))?;
        let mut by_rank: BTreeMap<usize, Pod> = BTreeMap::new();
        for pod in pods.items {
            let Some(rank) = pod_rank(&pod) else { continue };
            let newer = by_rank.get(&rank).is_none_or(|old| {
                old.metadata.creation_timestamp < pod.metadata.creation_timestamp
            });
            if newer {
                by_rank.insert(rank, pod);
            }
        }
        Ok(by_rank)
    }

    async fn pod_for(&self, launch: &LaunchId, rank: usize) -> Result<Pod> {
        self.pods(&launch.base_name())
            .await?
            .remove(&rank)
            .ok_or_else(|| Error::NoSuchWorker {
                backend: NAME,
                launch: launch.to_string(),
                rank,
            })
    }

    /// Pod-creation refusals the Job controller reported as events (a ResourceQuota, a LimitRange).
    /// Reading events is a nicety: when it is not allowed, nothing is reported.
    async fn creation_refusals(&self, job_name: &str) -> Vec<String> {
        let lp = ListParams::default().fields(&format!(
            "involvedObject.kind=Job,involvedObject.name={job_name}"
        ));
        match self.api::<Event>().list(&lp).await {
            Ok(events) => events
                .items
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some("FailedCreate"))
                .filter_map(|e| e.message)
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Waits until ranks `0..n` all run; `Err` on the first that cannot.
    async fn wait_running(
        &self,
        spec: &WorkerSpec,
        name: &str,
        n: usize,
    ) -> Result<Vec<WorkerStatus>> {
        let started = tokio::time::Instant::now();
        loop {
            let pods = self.pods(name).await?;
            let mut statuses = Vec::with_capacity(n);
            for (&rank, pod) in &pods {
                if let Some(reason) = image_error(pod) {
                    return Err(Error::ImageMissing {
                        backend: NAME,
                        image: spec.image_for(self.cfg.gpu_image.as_deref()).to_string(),
                        rank,
                        detail: reason,
                    });
                }
                let status = self.status(rank, pod);
                if status.state == WorkerState::Failed {
                    return Err(Error::WorkerFailed {
                        backend: NAME,
                        rank,
                        detail: status.detail.unwrap_or_else(|| "pod failed".into()),
                    });
                }
                if let Some(detail) = config_error(pod) {
                    return Err(Error::WorkerFailed {
                        backend: NAME,
                        rank,
                        detail,
                    });
                }
                statuses.push(status);
            }
            let missing: Vec<usize> = (0..n).filter(|r| !pods.contains_key(r)).collect();
            if !missing.is_empty() {
                let refusals = self.creation_refusals(name).await;
                if let Some(quota) = refusals.iter().find(|m| m.contains("exceeded quota")) {
                    return Err(Error::Quota {
                        backend: NAME,
                        rank: missing.first().copied(),
                        detail: quota.clone(),
                    });
                }
            }
            let running = statuses
                .iter()
                .filter(|s| matches!(s.state, WorkerState::Running | WorkerState::Succeeded))
                .count();
            if missing.is_empty() && running == n {
                return Ok(statuses);
            }
            let waited = started.elapsed();
            if waited >= self.cfg.start_timeout {
                let mut waiting: Vec<String> = missing
                    .iter()
                    .map(|r| format!("{r} (no pod yet)"))
                    .collect();
                waiting.extend(
                    statuses
                        .iter()
                        .filter(|s| s.state == WorkerState::Pending)
                        .map(|s| match &s.detail {
                            Some(d) => format!("{} ({d})", s.rank),
                            None => format!("{} (pending)", s.rank),
                        }),
                );
                return Err(Error::Timeout {
                    backend: NAME,
                    what: format!("workers {} to start", waiting.join(", ")),
                    waited_s: waited.as_secs(),
                });
            }
            tokio::time::sleep(self.cfg.poll_interval).await;
        }
    }

    fn status(&self, rank: usize, pod: &Pod) -> WorkerStatus {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let status = pod.status.as_ref();
        let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("");
        let state = match phase {
            "Pending" => WorkerState::Pending,
            "Running" => WorkerState::Running,
            "Succeeded" => WorkerState::Succeeded,
            "Failed" => WorkerState::Failed,
            _ => WorkerState::Unknown,
        };
        let ip = status
            .and_then(|s| s.pod_ip.as_deref())
            .and_then(|ip| ip.parse().ok());
        let dns_name = pod
            .spec
            .as_ref()
            .and_then(|s| Some((s.hostname.as_deref()?, s.subdomain.as_deref()?)))
            .map(|(h, d)| format!("{h}.{d}.{}.svc", self.cfg.namespace));
        WorkerStatus {
            rank,
            name,
            state,
            ip,
            dns_name,
            detail: pod_detail(pod),
        }
    }

    /// The newest pod of the coordinator's Job `name`, if it has one.
    async fn coordinator_pod(&self, name: &str) -> Result<Option<Pod>> {
        let pods = self
            .api::<Pod>()
            .list(&ListParams::default().labels(&format!("{LABEL_COORDINATOR}={name}")))
            .await
            .map_err(|e| self.api_error(e, "list pods"))?;
        Ok(pods.items.into_iter().max_by(|a, b| {
            a.metadata
                .creation_timestamp
                .cmp(&b.metadata.creation_timestamp)
        }))
    }

    /// The coordinator Job's name from its handle.
    fn coordinator_job_name(handle: &CoordinatorHandle) -> Result<String> {
        handle.check_backend(NAME)?;
        handle
            .object(KIND_JOB)
            .map(str::to_string)
            .ok_or_else(|| Error::Config {
                backend: NAME,
                detail: format!(
                    "the coordinator handle of job {} names no Job",
                    handle.job_id
                ),
            })
    }

    /// Waits until the coordinator's pod runs with an IP; `Err` when it cannot.
    async fn wait_coordinator(&self, spec: &CoordinatorSpec, name: &str) -> Result<()> {
        let started = tokio::time::Instant::now();
        loop {
            let pod = self.coordinator_pod(name).await?;
            let mut waiting = "no pod yet".to_string();
            if let Some(pod) = &pod {
                if let Some(reason) = image_error(pod) {
                    return Err(Error::CoordinatorFailed {
                        backend: NAME,
                        detail: format!("image {} could not be pulled: {reason}", spec.image),
                    });
                }
                if let Some(detail) = config_error(pod) {
                    return Err(Error::CoordinatorFailed {
                        backend: NAME,
                        detail,
                    });
                }
                let status = self.status(0, pod);
                match status.state {
                    WorkerState::Running if status.ip.is_some() => return Ok(()),
                    WorkerState::Succeeded => return Ok(()),
                    WorkerState::Failed => {
                        return Err(Error::CoordinatorFailed {
                            backend: NAME,
                            detail: status.detail.unwrap_or_else(|| "its pod failed".into()),
                        });
                    }
                    _ => waiting = status.detail.unwrap_or_else(|| "pending".into()),
                }
            } else if let Some(quota) = self
                .creation_refusals(name)
                .await
                .into_iter()
                .find(|m| m.contains("exceeded quota"))
            {
                return Err(Error::Quota {
                    backend: NAME,
                    rank: None,
                    detail: format!("the coordinator's pod: {quota}"),
                });
            }
            let waited = started.elapsed();
            if waited >= self.cfg.start_timeout {
                return Err(Error::Timeout {
                    backend: NAME,
                    what: format!("the coordinator to start ({waiting})"),
                    waited_s: waited.as_secs(),
                });
            }
            tokio::time::sleep(self.cfg.poll_interval).await;
        }
    }

    /// Deletes the coordinator's Job (its pod with it); what could not be deleted.
    async fn delete_coordinator_job(&self, name: &str) -> Vec<String> {
        match self
            .api::<Job>()
            .delete(name, &DeleteParams::background())
            .await
        {
            Ok(_) => Vec::new(),
            Err(e) if is_not_found(&e) => Vec::new(),
            Err(e) => vec![format!(
                "job.batch/{name} in namespace {} ({e})",
                self.cfg.namespace
            )],
        }
    }

    /// Deletes what a launch named `name` created; the names of what could not be deleted.
    async fn delete_objects(&self, name: &str, created: Created) -> Vec<String> {
        let ns = &self.cfg.namespace;
        let mut leftovers = Vec::new();
        let dp = DeleteParams::background();
        let mut note = |kind: &str, e: kube::Error| {
            if !is_not_found(&e) {
                leftovers.push(format!("{kind}/{name} in namespace {ns} ({e})"));
            }
        };
        if created.job
            && let Err(e) = self.api::<Job>().delete(name, &dp).await
        {
            note("job.batch", e);
        }
        if created.secret
            && let Err(e) = self.api::<Secret>().delete(name, &dp).await
        {
            note("secret", e);
        }
        if created.service
            && let Err(e) = self.api::<Service>().delete(name, &dp).await
        {
            note("service", e);
        }
        leftovers
    }

    async fn try_launch(
        &self,
        spec: &WorkerSpec,
        n: usize,
        objects: LaunchObjects,
        created: &mut Created,
    ) -> Result<Vec<WorkerStatus>> {
        let name = objects.job.metadata.name.clone().unwrap_or_default();
        let pp = PostParams::default();
        let mut job = objects.job;
        job.metadata.owner_references = self
            .coordinator_owner(&spec.job_id)
            .await?
            .map(|owner| vec![owner]);
        let job = self
            .api::<Job>()
            .create(&pp, &job)
            .await
            .map_err(|e| self.create_error(e, "jobs.batch", &name))?;
        created.job = true;
        let owner = objects::owned_by(&job).ok_or_else(|| Error::Api {
            backend: NAME,
            operation: format!("create job.batch/{name}"),
            status: None,
            detail: "the API server returned the Job without a uid".into(),
        })?;

        let mut secret = objects.secret;
        secret.metadata.owner_references = Some(vec![owner.clone()]);
        self.api::<Secret>()
            .create(&pp, &secret)
            .await
            .map_err(|e| self.create_error(e, "secrets", &name))?;
        created.secret = true;

        let mut service = objects.service;
        service.metadata.owner_references = Some(vec![owner]);
        self.api::<Service>()
            .create(&pp, &service)
            .await
            .map_err(|e| self.create_error(e, "services", &name))?;
        created.service = true;

        let resume = serde_json::json!({ "spec": { "suspend": false } });
        self.api::<Job>()
            .patch(&name, &PatchParams::default(), &Patch::Merge(&resume))
            .await
            .map_err(|e| self.api_error(e, "resume (patch) the job"))?;

        self.wait_running(spec, &name, n).await
    }

    /// The owner of a launch's Job in cluster mode: the coordinator's Job ([`LaunchId::coordinator_name`]
    /// of the same job id) while it runs, so that deleting it (`stop_coordinator`, `kubectl delete`,
    /// its TTL) garbage-collects every worker Job it started, and with them their pods, Secrets and
    /// Services. `None` in client mode (no such Job), once that Job has finished (a new coordinator is
    /// not owned by an old one's remains), and where the principal may not read Jobs.
    async fn coordinator_owner(
        &self,
        job_id: &str,
    ) -> Result<Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>> {
        let name = LaunchId::coordinator_name(job_id);
        match self.api::<Job>().get(&name).await {
            Ok(job) if job_finished(&job) => Ok(None),
            Ok(job) => Ok(objects::owned_by(&job)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(kube::Error::Api(s)) if s.code == 403 => Ok(None),
            Err(e) => Err(self.api_error(e, &format!("get job.batch/{name}"))),
        }
    }

    /// A kube error from creating `resource` named `name`.
    fn create_error(&self, e: kube::Error, resource: &str, name: &str) -> Error {
        if let kube::Error::Api(s) = &e {
            match s.code {
                409 if s.is_already_exists() => {
                    return Error::AlreadyExists {
                        backend: NAME,
                        what: format!("{resource}/{name} in namespace {}", self.cfg.namespace),
                    };
                }
                404 => {
                    return Error::Config {
                        backend: NAME,
                        detail: format!(
                            "namespace {} does not exist ({}); apply infra/k8s/namespace.yaml",
                            self.cfg.namespace, s.message
                        ),
                    };
                }
                _ => {}
            }
        }
        self.api_error(e, &format!("create {resource}"))
    }

    /// Capacity the cluster cannot offer, before anything is created: no node of the SKU's instance
    /// types (the well-known label) carrying the configuration's labels, or, for a GPU worker, none of
    /// them offering `nvidia.com/gpu` (no device plugin), or every such node tainted against the worker
    /// pods ([`Self::check_taints`]). Pods for such a node would stay Pending until
    /// the launch's timeout. Skipped where pools scale from zero
    /// ([`KubernetesConfig::scales_from_zero`]: no node of a type runs until a pod asks for it) and for
    /// a principal that may not list nodes (a namespaced Role).
    async fn check_nodes(&self, spec: &WorkerSpec) -> Result<()> {
        if self.cfg.scales_from_zero {
            return Ok(());
        }
        let nodes = match Api::<Node>::all(self.client.clone())
            .list(&ListParams::default())
            .await
        {
            Ok(list) => list.items,
            Err(kube::Error::Api(s)) if s.code == 403 => return Ok(()),
            Err(e) => return Err(self.api_error(e, "list nodes")),
        };
        let label = |n: &Node, key: &str| -> Option<String> {
            n.metadata.labels.as_ref()?.get(key).cloned()
        };
        let wanted = objects::node_labels(&self.cfg, spec);
        let fits = |n: &Node| {
            wanted
                .iter()
                .all(|(k, v)| label(n, k).as_deref() == Some(v.as_str()))
                && (spec.instance_types.is_empty()
                    || label(n, &self.cfg.instance_type_label)
                        .is_some_and(|t| spec.instance_types.contains(&t)))
        };
        let mut placed: Vec<&Node> = nodes.iter().filter(|n| fits(n)).collect();
        let mut what = Vec::new();
        if !spec.instance_types.is_empty() {
            what.push(format!(
                "{} {}",
                self.cfg.instance_type_label,
                spec.instance_types.join(" or ")
            ));
        }
        what.extend(wanted.iter().map(|(k, v)| format!("{k}={v}")));
        let refuse = |detail: String| Error::Config {
            backend: NAME,
            detail: format!(
                "{detail}; if a node pool of that kind starts nodes for pending pods, set \
                 backend.kubernetes.scales_from_zero: true; nothing was created"
            ),
        };
        if placed.is_empty() {
            if what.is_empty() {
                return Ok(());
            }
            let mut have = BTreeMap::<String, usize>::new();
            for n in &nodes {
                let ty = label(n, &self.cfg.instance_type_label).unwrap_or_else(|| "?".into());
                *have.entry(ty).or_default() += 1;
            }
            let have: Vec<String> = have.iter().map(|(t, c)| format!("{t} x{c}")).collect();
            return Err(refuse(format!(
                "no node of the cluster has {} (its nodes: {}): add a node pool of that type, or \
                 choose a SKU of the nodes it has",
                what.join(", "),
                if have.is_empty() {
                    "none".to_string()
                } else {
                    have.join(", ")
                }
            )));
        }
        if let Some(gpu) = &spec.gpu {
            let offers = |n: &&Node| {
                n.status
                    .as_ref()
                    .and_then(|s| s.allocatable.as_ref())
                    .and_then(|a| a.get(objects::GPU_RESOURCE))
                    .and_then(|q| q.0.parse::<u32>().ok())
                    .is_some_and(|c| c >= gpu.count)
            };
            if !placed.iter().any(offers) {
                return Err(refuse(format!(
                    "the cluster's {} node(s) with {} offer no {} x{} (allocatable): install \
                     NVIDIA's device plugin or GPU operator on that pool, or choose a SKU with fewer \
                     GPUs",
                    placed.len(),
                    what.join(", "),
                    objects::GPU_RESOURCE,
                    gpu.count
                )));
            }
            placed.retain(offers);
        }
        self.check_taints(spec, &placed, &what)
    }

    /// The nodes a worker could be placed on by their labels (and GPUs) must not all repel it with a
    /// taint (NoSchedule or NoExecute) its pod does not tolerate ([`objects::worker_tolerations`]):
    /// a GPU pool tainted `sku=gpu:NoSchedule` (AKS's usual set-up) takes no worker until the job
    /// file tolerates it, and the pods would stay Pending until the launch's timeout. Pools that scale
    /// from zero carry their taints on the nodes they start, which this cannot see.
    fn check_taints(&self, spec: &WorkerSpec, placed: &[&Node], what: &[String]) -> Result<()> {
        let tolerations = objects::worker_tolerations(&self.cfg, spec);
        let untolerated = |n: &Node| -> Vec<k8s_openapi::api::core::v1::Taint> {
            let taints = n.spec.as_ref().and_then(|s| s.taints.as_ref());
            taints
                .into_iter()
                .flatten()
                .filter(|t| objects::taint_repels(t) && !objects::tolerates(&tolerations, t))
                .cloned()
                .collect()
        };
        let mut repelled = BTreeMap::<String, (k8s_openapi::api::core::v1::Taint, usize)>::new();
        for node in placed {
            let taints = untolerated(node);
            if taints.is_empty() {
                return Ok(());
            }
            for t in taints {
                repelled.entry(objects::taint_text(&t)).or_insert((t, 0)).1 += 1;
            }
        }
        if repelled.is_empty() {
            return Ok(());
        }
        let taints: Vec<String> = repelled
            .iter()
            .map(|(text, (_, n))| format!("{text} on {n}"))
            .collect();
        let tolerations: Vec<String> = repelled
            .values()
            .map(|(t, _)| objects::toleration_text(t))
            .collect();
        Err(Error::Config {
            backend: NAME,
            detail: format!(
                "every node of the cluster with {} ({}) carries a taint the worker pods do not \
                 tolerate ({}), so they would stay Pending: add {} to the job file's \
                 backend.kubernetes.tolerations{}, or remove the taint from that node pool; nothing \
                 was created",
                if what.is_empty() {
                    "the workers' labels".to_string()
                } else {
                    what.join(", ")
                },
                placed.len(),
                taints.join(", "),
                tolerations.join(" and "),
                if self.cfg.tolerations.is_empty() {
                    ""
                } else {
                    " (beside the ones it has)"
                },
            ),
        })
    }

    /// Maps a kube error to the variant a user can act on.
    fn api_error(&self, e: kube::Error, action: &str) -> Error {
        let ns = &self.cfg.namespace;
        match e {
            kube::Error::Api(s) if s.code == 401 => Error::Credentials {
                backend: NAME,
                credential: "the kubeconfig user or the pod's service-account token".into(),
                detail: s.message.clone(),
                hint: "check `kubectl auth whoami`, refresh the kubeconfig's token or client \
                       certificate, or run the coordinator in-cluster as ServiceAccount \
                       physalia-coordinator"
                    .into(),
            },
            kube::Error::Api(s) if s.code == 403 && s.message.contains("exceeded quota") => {
                Error::Quota {
                    backend: NAME,
                    rank: None,
                    detail: s.message.clone(),
                }
            }
            kube::Error::Api(s) if s.code == 403 => Error::Permission {
                backend: NAME,
                action: format!("{action} in namespace {ns}"),
                detail: s.message.clone(),
                hint: "apply infra/k8s/rbac.yaml and run the coordinator as ServiceAccount \
                       physalia-coordinator (or bind its Role to your user)"
                    .into(),
            },
            kube::Error::Api(s) => Error::Api {
                backend: NAME,
                operation: action.into(),
                status: Some(s.code),
                detail: format!("{}: {}", s.reason, s.message),
            },
            kube::Error::Auth(a) => Error::Credentials {
                backend: NAME,
                credential: "the kubeconfig's auth provider".into(),
                detail: a.to_string(),
                hint: "check the kubeconfig's user entry (exec plugin, token file)".into(),
            },
            other => Error::Api {
                backend: NAME,
                operation: action.into(),
                status: None,
                detail: other.to_string(),
            },
        }
    }
}

/// What a launch has created so far (and so must delete if it fails).
#[derive(Clone, Copy, Default)]
struct Created {
    job: bool,
    secret: bool,
    service: bool,
}

#[async_trait]
impl Backend for KubernetesBackend {
    fn name(&self) -> BackendName {
        NAME
    }

    async fn launch(&self, spec: &WorkerSpec, n_workers: usize) -> Result<Launched> {
        spec.validate(n_workers)?;
        let objects = launch_objects(&self.cfg, spec, n_workers)?;
        let id = LaunchId::new(&spec.job_id, spec.segment);
        let name = id.base_name();
        let mut created = Created::default();
        match self
            .try_launch(spec, n_workers, objects, &mut created)
            .await
        {
            Ok(workers) => Ok(Launched { id, workers }),
            Err(err) => {
                let leftovers = self.delete_objects(&name, created).await;
                Err(err.after_cleanup(leftovers))
            }
        }
    }

    async fn list(&self, launch: &LaunchId) -> Result<Vec<WorkerStatus>> {
        let pods = self.pods(&launch.base_name()).await?;
        Ok(pods.iter().map(|(&r, p)| self.status(r, p)).collect())
    }

    async fn stop(&self, launch: &LaunchId, rank: usize) -> Result<()> {
        // backoffLimitPerIndex is 0: the Job controller marks the index failed and does not replace it.
        let pod = match self.pod_for(launch, rank).await {
            Err(Error::NoSuchWorker { .. }) => return Ok(()),
            other => other?,
        };
        let name = pod.metadata.name.unwrap_or_default();
        match self
            .api::<Pod>()
            .delete(&name, &DeleteParams::default())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(self.api_error(e, &format!("delete pod {name}"))),
        }
    }

    async fn stop_all(&self, launch: &LaunchId) -> Result<()> {
        let name = launch.base_name();
        let all = Created {
            job: true,
            secret: true,
            service: true,
        };
        let leftovers = self.delete_objects(&name, all).await;
        Error::stop_all_result(NAME, launch, leftovers)
    }

    async fn check(&self, spec: &WorkerSpec, demand: Demand) -> Result<()> {
        // Kubernetes takes any size and GPU request (a pod nobody can schedule times out at launch with
        // the scheduler's reason); what can be known now is whether the API server takes our
        // credentials and lets us list pods in the namespace: a 401 or 403 now, before anything exists.
        let _ = demand;
        self.api::<Pod>()
            .list(&ListParams::default().limit(1))
            .await
            .map_err(|e| self.api_error(e, "list pods"))?;
        self.check_nodes(spec).await
    }

    async fn launch_coordinator(&self, spec: &CoordinatorSpec) -> Result<CoordinatorHandle> {
        spec.validate()?;
        let job = coordinator_job(&self.cfg, spec);
        let name = LaunchId::coordinator_name(&spec.job_id);
        self.api::<Job>()
            .create(&PostParams::default(), &job)
            .await
            .map_err(|e| self.create_error(e, "jobs.batch", &name))?;
        match self.wait_coordinator(spec, &name).await {
            Ok(()) => Ok(CoordinatorHandle {
                backend: NAME.into(),
                job_id: spec.job_id.clone(),
                scope: self.cfg.namespace.clone(),
                objects: vec![PlatformObject {
                    kind: KIND_JOB.into(),
                    id: name,
                }],
            }),
            Err(e) => {
                let leftovers = self.delete_coordinator_job(&name).await;
                Err(e.after_cleanup(leftovers))
            }
        }
    }

    async fn coordinator_status(&self, handle: &CoordinatorHandle) -> Result<CoordinatorStatus> {
        let name = Self::coordinator_job_name(handle)?;
        if let Some(pod) = self.coordinator_pod(&name).await? {
            let mut s = self.status(0, &pod);
            if let Some(reason) = image_error(&pod).or_else(|| config_error(&pod)) {
                s.state = WorkerState::Failed;
                s.detail = Some(reason);
            }
            return Ok(CoordinatorStatus {
                state: s.state,
                detail: s.detail,
                ip: s.ip,
            });
        }
        // No pod: not created yet, or gone with its finished Job.
        match self.api::<Job>().get(&name).await {
            Ok(job) => {
                let failed = job
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .and_then(|c| {
                        c.iter()
                            .find(|c| c.type_ == "Failed" && c.status == "True")
                            .map(|c| c.message.clone().unwrap_or_else(|| "the Job failed".into()))
                    });
                let complete = job
                    .status
                    .as_ref()
                    .is_some_and(|s| s.succeeded.unwrap_or(0) > 0);
                Ok(match (failed, complete) {
                    (Some(why), _) => CoordinatorStatus {
                        state: WorkerState::Failed,
                        detail: Some(why),
                        ip: None,
                    },
                    (None, true) => CoordinatorStatus {
                        state: WorkerState::Succeeded,
                        detail: None,
                        ip: None,
                    },
                    (None, false) => CoordinatorStatus {
                        state: WorkerState::Pending,
                        detail: Some("no pod yet".into()),
                        ip: None,
                    },
                })
            }
            Err(e) if is_not_found(&e) => Ok(CoordinatorStatus {
                state: WorkerState::Unknown,
                detail: Some(format!(
                    "job.batch/{name} no longer exists in namespace {} (stopped, or deleted after \
                     its ttl)",
                    self.cfg.namespace
                )),
                ip: None,
            }),
            Err(e) => Err(self.api_error(e, &format!("get job.batch/{name}"))),
        }
    }

    async fn coordinator_logs(&self, handle: &CoordinatorHandle) -> Result<String> {
        let name = Self::coordinator_job_name(handle)?;
        let Some(pod) = self.coordinator_pod(&name).await? else {
            return Err(Error::Api {
                backend: NAME,
                operation: format!("read the logs of job.batch/{name}"),
                status: None,
                detail: "the coordinator has no pod (not started yet, or deleted)".into(),
            });
        };
        let pod_name = pod.metadata.name.unwrap_or_default();
        let lp = LogParams {
            container: Some(COORDINATOR_CONTAINER.into()),
            ..LogParams::default()
        };
        self.api::<Pod>()
            .logs(&pod_name, &lp)
            .await
            .map_err(|e| self.api_error(e, &format!("read the logs of pod {pod_name}")))
    }

    async fn stop_coordinator(&self, handle: &CoordinatorHandle) -> Result<()> {
        let name = Self::coordinator_job_name(handle)?;
        let leftovers = self.delete_coordinator_job(&name).await;
        if leftovers.is_empty() {
            Ok(())
        } else {
            Err(Error::Api {
                backend: NAME,
                operation: format!("stop the coordinator of job {}", handle.job_id),
                status: None,
                detail: format!("could not delete {}", leftovers.join(", ")),
            })
        }
    }

    async fn logs(&self, launch: &LaunchId, rank: usize) -> Result<String> {
        let pod = self.pod_for(launch, rank).await?;
        let name = pod.metadata.name.unwrap_or_default();
        let lp = LogParams {
            container: Some(CONTAINER.into()),
            ..LogParams::default()
        };
        self.api::<Pod>()
            .logs(&name, &lp)
            .await
            .map_err(|e| self.api_error(e, &format!("read the logs of pod {name}")))
    }
}

/// A Job with a true `Complete` or `Failed` condition: it runs no pod again.
fn job_finished(job: &Job) -> bool {
    let conditions = job.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions
        .into_iter()
        .flatten()
        .any(|c| matches!(c.type_.as_str(), "Complete" | "Failed") && c.status == "True")
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

fn pod_rank(pod: &Pod) -> Option<usize> {
    let from =
        |m: &Option<BTreeMap<String, String>>| m.as_ref()?.get(COMPLETION_INDEX)?.parse().ok();
    from(&pod.metadata.annotations).or_else(|| from(&pod.metadata.labels))
}

fn waiting_states(pod: &Pod) -> impl Iterator<Item = (&str, Option<&str>)> {
    pod.status
        .iter()
        .flat_map(|s| s.container_statuses.iter().flatten())
        .filter_map(|c| c.state.as_ref()?.waiting.as_ref())
        .filter_map(|w| Some((w.reason.as_deref()?, w.message.as_deref())))
}

fn image_error(pod: &Pod) -> Option<String> {
    waiting_states(pod)
        .find(|(reason, _)| IMAGE_ERRORS.contains(reason))
        .map(|(reason, message)| match message {
            Some(m) => format!("{reason}: {m}"),
            None => reason.to_string(),
        })
}

/// A container the kubelet cannot even create (a missing key, a bad mount): it will not fix itself.
fn config_error(pod: &Pod) -> Option<String> {
    waiting_states(pod)
        .find(|(reason, _)| {
            matches!(
                *reason,
                "CreateContainerConfigError" | "CreateContainerError"
            )
        })
        .map(|(reason, message)| format!("{reason}: {}", message.unwrap_or("")))
}

/// Why a pod is where it is: the container's waiting or terminated reason, or the scheduler's.
fn pod_detail(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    for c in status.container_statuses.iter().flatten() {
        let Some(state) = &c.state else { continue };
        if let Some(t) = &state.terminated {
            return Some(format!(
                "exit code {}{}",
                t.exit_code,
                t.reason
                    .as_ref()
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default()
            ));
        }
        if let Some(w) = &state.waiting {
            return w.reason.clone();
        }
    }
    status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .map(|c| {
            format!(
                "{}: {}",
                c.reason.as_deref().unwrap_or("unscheduled"),
                c.message.as_deref().unwrap_or("")
            )
        })
        .or_else(|| status.reason.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::batch::v1::{JobCondition, JobStatus};

    /// A finished coordinator's Job owns no new launch: its TTL would collect the launch with it.
    #[test]
    fn a_job_is_finished_by_a_true_complete_or_failed_condition() {
        let job = |conditions: &[(&str, &str)]| Job {
            status: Some(JobStatus {
                conditions: Some(
                    conditions
                        .iter()
                        .map(|(type_, status)| JobCondition {
                            type_: type_.to_string(),
                            status: status.to_string(),
                            ..JobCondition::default()
                        })
                        .collect(),
                ),
                ..JobStatus::default()
            }),
            ..Job::default()
        };
        assert!(!job_finished(&Job::default()));
        assert!(!job_finished(&job(&[("Suspended", "True")])));
        assert!(!job_finished(&job(&[("Complete", "False")])));
        assert!(job_finished(&job(&[("Complete", "True")])));
        assert!(job_finished(&job(&[("Failed", "True")])));
    }
}
