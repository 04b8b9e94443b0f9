//! `backend:`: where a job runs, and each platform's settings.
//!
//! A job file names the platform it runs on (`backend: docker`, or `backend: {name: ecs, ...}`) and may
//! hold a section for each platform it can run on (`ecs:`, `kubernetes:`, `aci:`, `docker:`), so the same
//! file runs anywhere with `submit --backend NAME`. The platform's section says where its workers go (the
//! `infra/` outputs: cluster or namespace, subnets and security groups, resource group), which image they
//! run, and which container SKU of `infra/catalog/` they are: the SKU's catalog price is what the job
//! costs per worker-second.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{BackendKind, SpecError, invalid, one_line};

/// Where a job runs: the platform (`name`) and, per platform, its settings. A bare platform name is
/// short for `{name: NAME}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BackendSpec {
    /// The platform this job runs on (default `local`); `submit --backend NAME` and `plan --backend
    /// NAME` pick another, whose section must then be here.
    #[serde(default)]
    pub name: BackendKind,
    /// Where the job's coordinator runs. `cluster` (the default on kubernetes, ecs and aci): `submit`
    /// starts it on the platform, next to its workers, hands it the job through the job store
    /// (`output.dir` must be an `s3://`, `az://` or `gs://` URL) and follows it. `client` (the only mode
    /// of local and docker): the `physalia` process is the coordinator, so it must run where the
    /// workers' network reaches it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// Where the workers reach the coordinator when it is this CLI on a cloud platform (client mode):
    /// an address of this machine that the workers' subnets route to. Default: the address this
    /// machine's default route leaves from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator_address: Option<std::net::IpAddr>,
    /// Containers on this machine's Docker Engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub docker: Option<DockerSettings>,
    /// Pods of an Indexed Job on a Kubernetes cluster (`infra/k8s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<KubernetesSettings>,
    /// AWS ECS tasks (`infra/ecs`'s outputs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ecs: Option<EcsSettings>,
    /// Azure Container Instances container groups (`infra/azure`'s outputs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aci: Option<AciSettings>,
}

/// `backend.mode`: where the coordinator runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// On the platform, next to the workers (kubernetes, ecs, aci).
    Cluster,
    /// In the `physalia` process that submits the job.
    Client,
}

/// `backend.docker`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DockerSettings {
    /// The worker image. Default: built on this machine from the `physalia-worker` beside `physalia`
    /// (`physalia image build`); an image named here must already be in the engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The image of GPU workers: the CUDA worker image (`worker-image/Dockerfile.cuda`). Default: built on
    /// this machine by `physalia image build --cuda` (`physalia-worker:<hash>-cuda`, its CUDA libraries
    /// from NVIDIA's PyPI wheels); an image named here must already be in the engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_image: Option<String>,
}

/// `backend.kubernetes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KubernetesSettings {
    /// The kubeconfig context; default: the current one (or the in-cluster ServiceAccount).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
    /// Namespace of every object (`infra/k8s/namespace.yaml` makes `physalia`).
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// The worker image as the cluster pulls it (`physalia image push REGISTRY` prints it).
    pub image: String,
    /// The image of GPU workers as the cluster pulls it: the CUDA worker image
    /// (`worker-image/Dockerfile.cuda`, `physalia image build --cuda`). Default: `image`, which must
    /// then be a CUDA image for a GPU SKU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_image: Option<String>,
    /// The worker container, a SKU of `infra/catalog/kubernetes.yaml` (or a `--catalog`); its price is
    /// the job's cost per worker-second. May be left out when the job has a `goal:` (the planner picks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sku: Option<String>,
    /// A pull secret in the namespace, for a private registry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secret: Option<String>,
    /// Cluster mode: the image of the coordinator's Job, holding the `physalia` CLI (`physalia image
    /// build --with-cli`). Default: `image`, which must then be built `--with-cli`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator_image: Option<String>,
    /// Node labels the worker pods also select on, beyond the SKU's instance type
    /// (`node.kubernetes.io/instance-type`, which every distribution sets): a GPU product label where a
    /// cluster has several GPU pools of one machine type (GKE: `cloud.google.com/gke-accelerator:
    /// nvidia-l4`; NVIDIA GPU feature discovery: `nvidia.com/gpu.product: NVIDIA-L4`), or a node pool.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub node_selector: std::collections::BTreeMap<String, String>,
    /// Taints the worker pods tolerate, beyond `nvidia.com/gpu` (which GPU pods always tolerate: GKE
    /// taints GPU nodes `nvidia.com/gpu=present:NoSchedule`): AKS's GPU pools are commonly tainted
    /// `sku=gpu:NoSchedule`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<KubernetesToleration>,
}

/// A taint worker pods tolerate (a Kubernetes toleration): `{key: sku, value: gpu, effect: NoSchedule}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KubernetesToleration {
    pub key: String,
    /// `Equal` (the default, with `value`) or `Exists` (any value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute`; none tolerates every effect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<String>,
}

/// `backend.ecs`: `terraform output` of `infra/ecs` gives every field but `image` and `sku`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EcsSettings {
    /// AWS region; default: the standard chain's (`AWS_REGION`, the profile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// Cluster name or ARN.
    pub cluster: String,
    /// Private subnets of the workers and the coordinator.
    pub subnets: Vec<String>,
    /// Security groups (only the QUIC ports, only from themselves).
    pub security_groups: Vec<String>,
    /// The role ECS pulls the image, writes logs and reads each rank's secret with.
    pub execution_role_arn: String,
    /// The workers' task role (no permissions: workers hold no cloud credentials).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_role_arn: Option<String>,
    /// Cluster mode: the coordinator's task role (infra/ecs output `coordinator_task_role_arn`), its
    /// only credentials. Required in cluster mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator_task_role_arn: Option<String>,
    /// Cluster mode: the coordinator's image as ECS pulls it, holding the `physalia` CLI (`physalia
    /// image build --with-cli`). Default: `image`, which must then be built `--with-cli`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator_image: Option<String>,
    /// CloudWatch Logs group of the workers' output.
    #[serde(default = "default_log_group")]
    pub log_group: String,
    /// `fargate` (CPU only), `ec2` (the cluster's registered instances), or a capacity provider's name
    /// (`physalia-gpu`, infra/ecs's `gpu_capacity_provider`, scales GPU instances from zero; `FARGATE`
    /// and `FARGATE_SPOT` are Fargate). Default: the GPU capacity provider `physalia-gpu` for a GPU SKU,
    /// `fargate` otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<String>,
    /// The worker image as ECS pulls it (an ECR reference).
    pub image: String,
    /// The image of GPU workers as ECS pulls it (an ECR reference of the CUDA worker image,
    /// `worker-image/Dockerfile.cuda`). Default: `image`, which must then be a CUDA image for a GPU SKU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_image: Option<String>,
    /// The worker container, a SKU of `infra/catalog/aws-ecs.yaml` (or a `--catalog`). May be left out
    /// when the job has a `goal:`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sku: Option<String>,
}

/// `backend.aci`: `terraform output` of `infra/azure` gives every field but `image` and `sku`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AciSettings {
    pub subscription_id: String,
    pub resource_group: String,
    /// Azure region of the container groups, e.g. `eastus`; the subnet must be in it.
    pub location: String,
    /// Resource id of the subnet delegated to `Microsoft.ContainerInstance/containerGroups`.
    pub subnet_id: String,
    /// A private registry the groups pull from with a user-assigned identity (no password).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry: Option<AciRegistry>,
    /// The worker image as ACI pulls it (a CPU image: ACI runs no GPUs, so there is no `gpu_image`).
    pub image: String,
    /// Cluster mode: the resource id of the coordinator's user-assigned managed identity (infra/azure
    /// output `coordinator_identity_id`), its only credentials. Required in cluster mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator_identity_id: Option<String>,
    /// Cluster mode: the coordinator's image as ACI pulls it, holding the `physalia` CLI (`physalia
    /// image build --with-cli`). Default: `image`, which must then be built `--with-cli`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator_image: Option<String>,
    /// The worker container, a SKU of `infra/catalog/azure-aci.yaml` (or a `--catalog`). May be left out
    /// when the job has a `goal:`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sku: Option<String>,
    /// Azure Resource Manager's endpoint: `https://management.azure.com` (the default), or a sovereign
    /// cloud's (`https://management.usgovcloudapi.net`, `https://management.chinacloudapi.cn`). The
    /// coordinator reads it from the job as this machine does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arm_endpoint: Option<String>,
}

/// `backend.aci.registry`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AciRegistry {
    /// e.g. `physalia.azurecr.io`.
    pub server: String,
    /// Resource id of the user-assigned identity holding `AcrPull` (infra/azure's `pull_identity_id`).
    pub identity_id: String,
}

fn default_namespace() -> String {
    "physalia".into()
}

fn default_log_group() -> String {
    "/physalia/workers".into()
}

/// `backend: NAME` as well as the mapping.
pub(super) fn backend_or_name<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BackendSpec, D::Error> {
    struct Visitor;
    impl<'de> serde::de::Visitor<'de> for Visitor {
        type Value = BackendSpec;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(
                "a backend name (local, docker, kubernetes, ecs, aci), or a mapping with `name` and \
                 the platforms' sections",
            )
        }

        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<BackendSpec, E> {
            let name = BackendKind::deserialize(serde::de::value::StrDeserializer::<E>::new(v))?;
            Ok(BackendSpec {
                name,
                ..BackendSpec::default()
            })
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<BackendSpec, A::Error> {
            BackendSpec::deserialize(serde::de::value::MapAccessDeserializer::new(map))
        }
    }
    d.deserialize_any(Visitor)
}

pub(super) fn backend_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let name = g.subschema_for::<BackendKind>();
    let full = g.subschema_for::<BackendSpec>();
    schemars::json_schema!({ "anyOf": [name, full] })
}

/// What a job is billed per worker-second on its platform, and the SKU that price comes from.
#[derive(Debug, Clone, PartialEq)]
pub struct Priced {
    pub sku: String,
    pub usd_per_worker_s: f64,
}

impl BackendSpec {
    /// The named platform's `gpu_image` setting, the image its GPU workers run (`None`: the platform's
    /// default, see each section; ACI runs no GPUs).
    /// Where the coordinator runs: `backend.mode`, else cluster on kubernetes, ecs and aci and client
    /// on local and docker.
    pub fn mode(&self) -> Mode {
        match (self.mode, self.name) {
            (Some(m), _) => m,
            (None, BackendKind::Kubernetes | BackendKind::Ecs | BackendKind::Aci) => Mode::Cluster,
            (None, _) => Mode::Client,
        }
    }

    /// The image of the coordinator in cluster mode: the platform section's `coordinator_image`, else
    /// its worker `image` (built `--with-cli`).
    pub fn coordinator_image(&self) -> Option<&str> {
        match self.name {
            BackendKind::Kubernetes => self
                .kubernetes
                .as_ref()
                .map(|k| k.coordinator_image.as_deref().unwrap_or(&k.image)),
            BackendKind::Ecs => self
                .ecs
                .as_ref()
                .map(|e| e.coordinator_image.as_deref().unwrap_or(&e.image)),
            BackendKind::Aci => self
                .aci
                .as_ref()
                .map(|a| a.coordinator_image.as_deref().unwrap_or(&a.image)),
            BackendKind::Local | BackendKind::Docker => None,
        }
    }

    pub fn gpu_image(&self) -> Option<&str> {
        match self.name {
            BackendKind::Local | BackendKind::Aci => None,
            BackendKind::Docker => self.docker.as_ref()?.gpu_image.as_deref(),
            BackendKind::Kubernetes => self.kubernetes.as_ref()?.gpu_image.as_deref(),
            BackendKind::Ecs => self.ecs.as_ref()?.gpu_image.as_deref(),
        }
    }

    /// The named platform's SKU setting (`local` and `docker` run on this machine: the `local` SKU).
    pub fn sku(&self) -> Option<&str> {
        match self.name {
            BackendKind::Local | BackendKind::Docker => Some("local"),
            BackendKind::Kubernetes => self.kubernetes.as_ref()?.sku.as_deref(),
            BackendKind::Ecs => self.ecs.as_ref()?.sku.as_deref(),
            BackendKind::Aci => self.aci.as_ref()?.sku.as_deref(),
        }
    }

    /// The platform's SKU and its catalog price, or why there is none. `planned` is the SKU the planner
    /// chose (a job with a `goal:`), used when the section names none.
    pub fn priced(
        &self,
        catalog: &physalia_planner::Catalog,
        planned: Option<&str>,
    ) -> Result<Priced, SpecError> {
        let field = format!("backend.{}.sku", self.name.as_str());
        let Some(name) = self.sku().or(planned) else {
            return Err(invalid(
                &field,
                format!(
                    "name the worker container: one of {} (infra/catalog), or add a `goal:` for the \
                     planner to choose",
                    skus_of(catalog, self.name).join(", ")
                ),
            ));
        };
        let Some(sku) = catalog.get(name) else {
            return Err(invalid(
                &field,
                format!(
                    "no SKU named {:?} in the catalog; the {} backend's are {}",
                    one_line(name),
                    self.name.as_str(),
                    skus_of(catalog, self.name).join(", ")
                ),
            ));
        };
        if sku.backend.as_str() != self.name.as_str()
            && !(self.name == BackendKind::Docker && sku.backend.as_str() == "local")
        {
            return Err(invalid(
                &field,
                format!(
                    "the SKU {name} is one of the {} backend's, not {}; the {} backend's are {}",
                    sku.backend.as_str(),
                    self.name.as_str(),
                    self.name.as_str(),
                    skus_of(catalog, self.name).join(", ")
                ),
            ));
        }
        if let Some(gpu) = &sku.gpu {
            match self.name {
                BackendKind::Aci => {
                    return Err(invalid(
                        &field,
                        format!(
                            "{name} has a GPU ({}); Azure Container Instances runs no GPUs since July \
                             2025: pick a CPU SKU, or run GPU workers on kubernetes (AKS) or ecs",
                            gpu.model
                        ),
                    ));
                }
                BackendKind::Ecs => {
                    let capacity = self.ecs.as_ref().and_then(|e| e.capacity.as_deref());
                    if let Some(c) = capacity
                        && is_fargate(c)
                    {
                        return Err(invalid(
                            "backend.ecs.capacity",
                            format!(
                                "{c} runs no GPUs, and the SKU {name} has one ({}): use the GPU capacity \
                                 provider (infra/ecs's `gpu_capacity_provider`, `physalia-gpu`) or `ec2`",
                                gpu.model
                            ),
                        ));
                    }
                }
                _ => {}
            }
        }
        Ok(Priced {
            sku: sku.name.clone(),
            usd_per_worker_s: sku.usd_per_s(),
        })
    }

    /// Checks the named platform's section: present where the platform needs settings, every list
    /// non-empty and every name well-formed. The SKU is checked by [`BackendSpec::priced`].
    pub(super) fn validate(&self) -> Result<(), SpecError> {
        let missing = |what: &str| {
            invalid(
                &format!("backend.{}", self.name.as_str()),
                format!(
                    "the {} backend needs its settings: {what} (`terraform output` of infra/{} gives \
                     most of them; see infra/README.md)",
                    self.name.as_str(),
                    match self.name {
                        BackendKind::Kubernetes => "k8s",
                        BackendKind::Aci => "azure",
                        _ => self.name.as_str(),
                    }
                ),
            )
        };
        if self.mode == Some(Mode::Cluster)
            && matches!(self.name, BackendKind::Local | BackendKind::Docker)
        {
            return Err(invalid(
                "backend.mode",
                format!(
                    "cluster mode starts the coordinator on a cloud platform (kubernetes, ecs, aci); \
                     on {} the `physalia` process is the coordinator: leave `mode` out or say `client`",
                    self.name.as_str()
                ),
            ));
        }
        match self.name {
            BackendKind::Local => {}
            BackendKind::Docker => {
                if let Some(d) = &self.docker {
                    if let Some(image) = &d.image {
                        not_blank("backend.docker.image", image)?;
                    }
                    if let Some(image) = &d.gpu_image {
                        not_blank("backend.docker.gpu_image", image)?;
                    }
                }
            }
            BackendKind::Kubernetes => {
                let Some(k) = &self.kubernetes else {
                    return Err(missing("namespace, image, sku"));
                };
                dns_label("backend.kubernetes.namespace", &k.namespace)?;
                not_blank("backend.kubernetes.image", &k.image)?;
                if let Some(image) = &k.gpu_image {
                    not_blank("backend.kubernetes.gpu_image", image)?;
                }
                if let Some(image) = &k.coordinator_image {
                    not_blank("backend.kubernetes.coordinator_image", image)?;
                }
                for (key, value) in &k.node_selector {
                    let field = format!("backend.kubernetes.node_selector.{}", one_line(key));
                    if !is_label_key(key) {
                        return Err(invalid(&field, "must be a label key (PREFIX/NAME)"));
                    }
                    if !is_label_value(value) {
                        return Err(invalid(
                            &field,
                            format!(
                                "must be a label value (at most 63 of [A-Za-z0-9._-]), got {:?}",
                                one_line(value)
                            ),
                        ));
                    }
                }
                for (i, t) in k.tolerations.iter().enumerate() {
                    let field = |f: &str| format!("backend.kubernetes.tolerations[{i}].{f}");
                    if !is_label_key(&t.key) {
                        return Err(invalid(&field("key"), "must be a taint key (PREFIX/NAME)"));
                    }
                    match t.operator.as_deref() {
                        None | Some("Equal") => {}
                        Some("Exists") if t.value.is_none() => {}
                        Some("Exists") => {
                            return Err(invalid(&field("value"), "must be left out with Exists"));
                        }
                        Some(other) => {
                            return Err(invalid(
                                &field("operator"),
                                format!("must be Equal or Exists, got {:?}", one_line(other)),
                            ));
                        }
                    }
                    if let Some(v) = &t.value
                        && !is_label_value(v)
                    {
                        return Err(invalid(&field("value"), "must be a label value"));
                    }
                    if let Some(e) = t.effect.as_deref()
                        && !matches!(e, "NoSchedule" | "PreferNoSchedule" | "NoExecute")
                    {
                        return Err(invalid(
                            &field("effect"),
                            format!(
                                "must be NoSchedule, PreferNoSchedule or NoExecute, got {:?}",
                                one_line(e)
                            ),
                        ));
                    }
                }
            }
            BackendKind::Ecs => {
                let Some(e) = &self.ecs else {
                    return Err(missing(
                        "cluster, subnets, security_groups, execution_role_arn, image, sku",
                    ));
                };
                not_blank("backend.ecs.cluster", &e.cluster)?;
                not_empty("backend.ecs.subnets", &e.subnets, "subnet-")?;
                not_empty("backend.ecs.security_groups", &e.security_groups, "sg-")?;
                arn("backend.ecs.execution_role_arn", &e.execution_role_arn)?;
                if let Some(r) = &e.task_role_arn {
                    arn("backend.ecs.task_role_arn", r)?;
                }
                if let Some(r) = &e.coordinator_task_role_arn {
                    arn("backend.ecs.coordinator_task_role_arn", r)?;
                }
                if let Some(image) = &e.coordinator_image {
                    not_blank("backend.ecs.coordinator_image", image)?;
                }
                not_blank("backend.ecs.log_group", &e.log_group)?;
                not_blank("backend.ecs.image", &e.image)?;
                if let Some(image) = &e.gpu_image {
                    not_blank("backend.ecs.gpu_image", image)?;
                }
                if let Some(c) = &e.capacity {
                    not_blank("backend.ecs.capacity", c)?;
                }
            }
            BackendKind::Aci => {
                let Some(a) = &self.aci else {
                    return Err(missing(
                        "subscription_id, resource_group, location, subnet_id, image, sku",
                    ));
                };
                not_blank("backend.aci.subscription_id", &a.subscription_id)?;
                not_blank("backend.aci.resource_group", &a.resource_group)?;
                not_blank("backend.aci.location", &a.location)?;
                if !a.subnet_id.starts_with("/subscriptions/") {
                    return Err(invalid(
                        "backend.aci.subnet_id",
                        format!(
                            "must be a subnet's resource id (/subscriptions/.../subnets/NAME, \
                             infra/azure's `subnet_id`), got {:?}",
                            one_line(&a.subnet_id)
                        ),
                    ));
                }
                not_blank("backend.aci.image", &a.image)?;
                if let Some(id) = &a.coordinator_identity_id
                    && !id.starts_with("/subscriptions/")
                {
                    return Err(invalid(
                        "backend.aci.coordinator_identity_id",
                        format!(
                            "must be a user-assigned identity's resource id (/subscriptions/.../\
                             userAssignedIdentities/NAME, infra/azure's `coordinator_identity_id`), \
                             got {:?}",
                            one_line(id)
                        ),
                    ));
                }
                if let Some(image) = &a.coordinator_image {
                    not_blank("backend.aci.coordinator_image", image)?;
                }
                if let Some(endpoint) = &a.arm_endpoint {
                    let host = endpoint
                        .strip_prefix("https://")
                        .or_else(|| endpoint.strip_prefix("http://"))
                        .map(|rest| rest.split('/').next().unwrap_or(""));
                    let ok = host.is_some_and(|h| {
                        !h.is_empty() && !h.contains(|c: char| c.is_whitespace() || c == '@')
                    });
                    if !ok {
                        return Err(invalid(
                            "backend.aci.arm_endpoint",
                            format!(
                                "must be Azure Resource Manager's URL (https://management.azure.com, \
                                 or a sovereign cloud's), got {:?}",
                                one_line(endpoint)
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// `fargate`, or one of Fargate's capacity providers.
pub fn is_fargate(capacity: &str) -> bool {
    capacity.eq_ignore_ascii_case("fargate") || capacity == "FARGATE_SPOT"
}

fn skus_of(catalog: &physalia_planner::Catalog, backend: BackendKind) -> Vec<String> {
    let of = |b: &str| {
        catalog
            .skus
            .iter()
            .filter(|s| s.backend.as_str() == b)
            .map(|s| s.name.clone())
            .collect::<Vec<_>>()
    };
    match backend {
        BackendKind::Docker => of("local"),
        b => of(b.as_str()),
    }
}

fn not_blank(field: &str, value: &str) -> Result<(), SpecError> {
    if value.trim().is_empty() {
        return Err(invalid(field, "must not be empty"));
    }
    if value.chars().any(char::is_control) {
        return Err(invalid(
            field,
            format!("must be one line, got {:?}", one_line(value)),
        ));
    }
    Ok(())
}

fn not_empty(field: &str, values: &[String], prefix: &str) -> Result<(), SpecError> {
    if values.is_empty() {
        return Err(invalid(
            field,
            format!("must name at least one ({prefix}...)"),
        ));
    }
    for (i, v) in values.iter().enumerate() {
        not_blank(&format!("{field}[{i}]"), v)?;
    }
    Ok(())
}

fn arn(field: &str, value: &str) -> Result<(), SpecError> {
    if !value.starts_with("arn:") || value.split(':').count() < 6 {
        return Err(invalid(
            field,
            format!(
                "must be an IAM role ARN (arn:aws:iam::ACCOUNT:role/NAME), got {:?}",
                one_line(value)
            ),
        ));
    }
    Ok(())
}

/// A Kubernetes label value: at most 63 of `[A-Za-z0-9._-]`, alphanumeric at both ends (or empty).
fn is_label_value(s: &str) -> bool {
    s.is_empty()
        || (s.len() <= 63
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && s.starts_with(|c: char| c.is_ascii_alphanumeric())
            && s.ends_with(|c: char| c.is_ascii_alphanumeric()))
}

/// A Kubernetes label (or taint) key: an optional DNS-subdomain prefix and `/`, then a name.
fn is_label_key(s: &str) -> bool {
    let (prefix, name) = s.rsplit_once('/').map_or((None, s), |(p, n)| (Some(p), n));
    prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            })
    }) && !name.is_empty()
        && is_label_value(name)
}

fn dns_label(field: &str, value: &str) -> Result<(), SpecError> {
    let ok = !value.is_empty()
        && value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !value.starts_with('-')
        && !value.ends_with('-');
    if !ok {
        return Err(invalid(
            field,
            format!(
                "must be a DNS label (lowercase letters, digits and '-', at most 63), got {:?}",
                one_line(value)
            ),
        ));
    }
    Ok(())
}
