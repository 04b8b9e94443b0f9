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
    /// The cluster's node pools start nodes for pending pods (GKE's, EKS's or AKS's autoscaler, or
    /// Karpenter, scaling a pool from zero): `submit` then does not refuse a job because no node of
    /// the SKU's type runs now.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub scales_from_zero: bool,
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
    /// The UDP port every worker's mesh listens on: infra/ecs's `mesh_port` (output `mesh_port`), the
    /// one port its security group opens between the tasks. Default 7100, infra/ecs's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mesh_port: Option<u16>,
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
    /// The UDP port every worker's mesh listens on: one inside infra/azure's `quic_ports` (default
    /// 7000-7199), the range its network security group opens within the subnet. Default 7100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mesh_port: Option<u16>,
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

/// A section's `mesh_port`: a fixed port (0 would be any, which no firewall rule can name).
fn mesh_port(field: &str, port: Option<u16>, which: &str) -> Result<(), SpecError> {
    if port == Some(0) {
        return Err(invalid(field, format!("must be {which}, got 0")));
    }
    Ok(())
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

/// One platform as the job file sees it: its section's settings and what the job file's checks know
/// of the platform. Each platform's section type implements it; [`BackendSpec::section`] chooses one,
/// the only place in this crate where a platform's name picks code (the CLI's drivers have the same
/// one place, `coordinator/src/driver/platform/mod.rs`).
pub trait Section: std::fmt::Debug + Sync {
    /// The platform.
    fn kind(&self) -> BackendKind;
    /// The SKU its workers are billed as (`None`: the section names none, a `goal:` may choose).
    fn sku(&self) -> Option<&str>;
    /// Whether a job can train in the `physalia` process itself (repeated seeds, `train.runs`).
    fn trains_in_this_process(&self) -> bool {
        false
    }
    /// Forgets what only the submitting machine means (its kubeconfig context): the coordinator now
    /// runs inside the platform, as the identity its platform object gives it.
    fn coordinate_inside(&mut self) {}
    /// Where the planner's chosen SKU is written (`None`: the platform has one SKU, this machine).
    fn sku_mut(&mut self) -> Option<&mut Option<String>> {
        None
    }
    /// The image GPU workers run (`None`: the platform's default, see each section).
    fn gpu_image(&self) -> Option<&str> {
        None
    }
    /// The coordinator's image in cluster mode: `coordinator_image`, else the worker image (built
    /// `--with-cli`). `None`: the platform runs no coordinator (local, docker).
    fn coordinator_image(&self) -> Option<&str> {
        None
    }
    /// Checks the section's fields: every list non-empty and every name well-formed.
    fn validate(&self) -> Result<(), SpecError> {
        Ok(())
    }
    /// Refuses a SKU the platform's section cannot run (a GPU where the capacity has none).
    fn check_sku(&self, _sku: &physalia_planner::Sku) -> Result<(), SpecError> {
        Ok(())
    }
    /// What cluster mode needs of the section beyond [`Section::validate`] (the coordinator's
    /// identity), as `field: why`.
    fn check_cluster(&self) -> Result<(), SpecError> {
        Err(invalid(
            "backend.mode",
            format!(
                "cluster mode starts the coordinator on a cloud platform (kubernetes, ecs, aci); on \
                 {} the `physalia` process is the coordinator: leave `mode` out or say `client`",
                self.kind().as_str()
            ),
        ))
    }
}

/// `backend: local`: worker processes on this machine; nothing to set.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LocalSettings;

impl Section for LocalSettings {
    fn kind(&self) -> BackendKind {
        BackendKind::Local
    }
    fn sku(&self) -> Option<&str> {
        Some("local")
    }
    fn trains_in_this_process(&self) -> bool {
        true
    }
}

impl Section for DockerSettings {
    fn kind(&self) -> BackendKind {
        BackendKind::Docker
    }
    fn sku(&self) -> Option<&str> {
        // containers on this machine
        Some("local")
    }
    fn gpu_image(&self) -> Option<&str> {
        self.gpu_image.as_deref()
    }
    fn validate(&self) -> Result<(), SpecError> {
        if let Some(image) = &self.image {
            not_blank("backend.docker.image", image)?;
        }
        if let Some(image) = &self.gpu_image {
            not_blank("backend.docker.gpu_image", image)?;
        }
        Ok(())
    }
}

impl Section for KubernetesSettings {
    fn kind(&self) -> BackendKind {
        BackendKind::Kubernetes
    }
    fn sku(&self) -> Option<&str> {
        self.sku.as_deref()
    }
    fn sku_mut(&mut self) -> Option<&mut Option<String>> {
        Some(&mut self.sku)
    }
    fn gpu_image(&self) -> Option<&str> {
        self.gpu_image.as_deref()
    }
    fn coordinator_image(&self) -> Option<&str> {
        Some(self.coordinator_image.as_deref().unwrap_or(&self.image))
    }
    fn validate(&self) -> Result<(), SpecError> {
        dns_label("backend.kubernetes.namespace", &self.namespace)?;
        not_blank("backend.kubernetes.image", &self.image)?;
        if let Some(image) = &self.gpu_image {
            not_blank("backend.kubernetes.gpu_image", image)?;
        }
        if let Some(image) = &self.coordinator_image {
            not_blank("backend.kubernetes.coordinator_image", image)?;
        }
        for (key, value) in &self.node_selector {
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
        for (i, t) in self.tolerations.iter().enumerate() {
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
        Ok(())
    }
    fn check_cluster(&self) -> Result<(), SpecError> {
        // the coordinator's service account comes from infra/k8s's manifests
        Ok(())
    }
    fn coordinate_inside(&mut self) {
        // in its pod, the coordinator is its ServiceAccount
        self.context = None;
    }
}

impl Section for EcsSettings {
    fn kind(&self) -> BackendKind {
        BackendKind::Ecs
    }
    fn sku(&self) -> Option<&str> {
        self.sku.as_deref()
    }
    fn sku_mut(&mut self) -> Option<&mut Option<String>> {
        Some(&mut self.sku)
    }
    fn gpu_image(&self) -> Option<&str> {
        self.gpu_image.as_deref()
    }
    fn coordinator_image(&self) -> Option<&str> {
        Some(self.coordinator_image.as_deref().unwrap_or(&self.image))
    }
    fn validate(&self) -> Result<(), SpecError> {
        not_blank("backend.ecs.cluster", &self.cluster)?;
        not_empty("backend.ecs.subnets", &self.subnets, "subnet-")?;
        not_empty("backend.ecs.security_groups", &self.security_groups, "sg-")?;
        arn("backend.ecs.execution_role_arn", &self.execution_role_arn)?;
        if let Some(r) = &self.task_role_arn {
            arn("backend.ecs.task_role_arn", r)?;
        }
        if let Some(r) = &self.coordinator_task_role_arn {
            arn("backend.ecs.coordinator_task_role_arn", r)?;
        }
        if let Some(image) = &self.coordinator_image {
            not_blank("backend.ecs.coordinator_image", image)?;
        }
        not_blank("backend.ecs.log_group", &self.log_group)?;
        not_blank("backend.ecs.image", &self.image)?;
        if let Some(image) = &self.gpu_image {
            not_blank("backend.ecs.gpu_image", image)?;
        }
        if let Some(c) = &self.capacity {
            not_blank("backend.ecs.capacity", c)?;
        }
        mesh_port(
            "backend.ecs.mesh_port",
            self.mesh_port,
            "the port infra/ecs's security group opens (its output mesh_port)",
        )
    }
    fn check_sku(&self, sku: &physalia_planner::Sku) -> Result<(), SpecError> {
        if let (Some(gpu), Some(c)) = (&sku.gpu, self.capacity.as_deref())
            && is_fargate(c)
        {
            return Err(invalid(
                "backend.ecs.capacity",
                format!(
                    "{c} runs no GPUs, and the SKU {} has one ({}): use the GPU capacity provider \
                     (infra/ecs's `gpu_capacity_provider`, `physalia-gpu`) or `ec2`",
                    sku.name, gpu.model
                ),
            ));
        }
        Ok(())
    }
    fn check_cluster(&self) -> Result<(), SpecError> {
        if self.coordinator_task_role_arn.is_none() {
            return Err(invalid(
                "backend.ecs.coordinator_task_role_arn",
                "cluster mode (the default on ecs) runs the coordinator as a task with infra/ecs's \
                 coordinator task role (`terraform output coordinator_task_role_arn`); set it, or \
                 backend.mode: client",
            ));
        }
        Ok(())
    }
}

impl Section for AciSettings {
    fn kind(&self) -> BackendKind {
        BackendKind::Aci
    }
    fn sku(&self) -> Option<&str> {
        self.sku.as_deref()
    }
    fn sku_mut(&mut self) -> Option<&mut Option<String>> {
        Some(&mut self.sku)
    }
    fn coordinator_image(&self) -> Option<&str> {
        Some(self.coordinator_image.as_deref().unwrap_or(&self.image))
    }
    fn validate(&self) -> Result<(), SpecError> {
        not_blank("backend.aci.subscription_id", &self.subscription_id)?;
        not_blank("backend.aci.resource_group", &self.resource_group)?;
        not_blank("backend.aci.location", &self.location)?;
        if !self.subnet_id.starts_with("/subscriptions/") {
            return Err(invalid(
                "backend.aci.subnet_id",
                format!(
                    "must be a subnet's resource id (/subscriptions/.../subnets/NAME, infra/azure's \
                     `subnet_id`), got {:?}",
                    one_line(&self.subnet_id)
                ),
            ));
        }
        not_blank("backend.aci.image", &self.image)?;
        if let Some(id) = &self.coordinator_identity_id
            && !id.starts_with("/subscriptions/")
        {
            return Err(invalid(
                "backend.aci.coordinator_identity_id",
                format!(
                    "must be a user-assigned identity's resource id (/subscriptions/.../\
                     userAssignedIdentities/NAME, infra/azure's `coordinator_identity_id`), got {:?}",
                    one_line(id)
                ),
            ));
        }
        if let Some(image) = &self.coordinator_image {
            not_blank("backend.aci.coordinator_image", image)?;
        }
        if let Some(endpoint) = &self.arm_endpoint {
            arm_endpoint(endpoint)?;
        }
        mesh_port(
            "backend.aci.mesh_port",
            self.mesh_port,
            "a port of infra/azure's quic_ports, which its network security group opens",
        )
    }
    fn check_cluster(&self) -> Result<(), SpecError> {
        if self.coordinator_identity_id.is_none() {
            return Err(invalid(
                "backend.aci.coordinator_identity_id",
                "cluster mode (the default on aci) runs the coordinator with infra/azure's managed \
                 identity (`terraform output coordinator_identity_id`); set it, or backend.mode: \
                 client",
            ));
        }
        Ok(())
    }
}

fn arm_endpoint(endpoint: &str) -> Result<(), SpecError> {
    let host = endpoint
        .strip_prefix("https://")
        .or_else(|| endpoint.strip_prefix("http://"))
        .map(|rest| rest.split('/').next().unwrap_or(""));
    let ok =
        host.is_some_and(|h| !h.is_empty() && !h.contains(|c: char| c.is_whitespace() || c == '@'));
    if !ok {
        return Err(invalid(
            "backend.aci.arm_endpoint",
            format!(
                "must be Azure Resource Manager's URL (https://management.azure.com, or a sovereign \
                 cloud's), got {:?}",
                one_line(endpoint)
            ),
        ));
    }
    Ok(())
}

/// docker's section when the job file has none: the worker image built from this physalia-worker.
static DOCKER_DEFAULTS: DockerSettings = DockerSettings {
    image: None,
    gpu_image: None,
};

impl BackendSpec {
    /// The named platform's section, or why the job file lacks it: the one place a platform's name
    /// chooses its code in this crate.
    pub fn section(&self) -> Result<&dyn Section, SpecError> {
        let missing = |what: &str, infra: &str| {
            invalid(
                &format!("backend.{}", self.name.as_str()),
                format!(
                    "the {} backend needs its settings: {what} (`terraform output` of infra/{infra} \
                     gives most of them; see infra/README.md)",
                    self.name.as_str(),
                ),
            )
        };
        Ok(match self.name {
            BackendKind::Local => &LocalSettings,
            BackendKind::Docker => self.docker.as_ref().unwrap_or(&DOCKER_DEFAULTS),
            BackendKind::Kubernetes => self
                .kubernetes
                .as_ref()
                .ok_or_else(|| missing("namespace, image, sku", "k8s"))?,
            BackendKind::Ecs => self.ecs.as_ref().ok_or_else(|| {
                missing(
                    "cluster, subnets, security_groups, execution_role_arn, image, sku",
                    "ecs",
                )
            })?,
            BackendKind::Aci => self.aci.as_ref().ok_or_else(|| {
                missing(
                    "subscription_id, resource_group, location, subnet_id, image, sku",
                    "azure",
                )
            })?,
        })
    }

    /// [`BackendSpec::section`], to write the planner's SKU into (`None`: no section to write).
    fn section_mut(&mut self) -> Option<&mut dyn Section> {
        match self.name {
            BackendKind::Local => None,
            BackendKind::Docker => self.docker.as_mut().map(|s| s as &mut dyn Section),
            BackendKind::Kubernetes => self.kubernetes.as_mut().map(|s| s as &mut dyn Section),
            BackendKind::Ecs => self.ecs.as_mut().map(|s| s as &mut dyn Section),
            BackendKind::Aci => self.aci.as_mut().map(|s| s as &mut dyn Section),
        }
    }

    /// Bills the job's workers as `sku` (the planner's choice) where the section names SKUs.
    pub fn set_sku(&mut self, sku: &str) {
        if let Some(slot) = self.section_mut().and_then(|s| s.sku_mut()) {
            *slot = Some(sku.to_string());
        }
    }

    /// The job as a coordinator inside the platform runs it (cluster mode): no address of the
    /// submitting machine (the coordinator advertises its own), nothing of its local sign-in.
    pub fn coordinate_inside(&mut self) {
        self.coordinator_address = None;
        if let Some(section) = self.section_mut() {
            section.coordinate_inside();
        }
    }

    /// Where the coordinator runs: `backend.mode`, else cluster on a cloud platform and client on
    /// this machine.
    pub fn mode(&self) -> Mode {
        match self.mode {
            Some(m) => m,
            None if self.name.on_this_machine() => Mode::Client,
            None => Mode::Cluster,
        }
    }

    /// The coordinator's image in cluster mode (see [`Section::coordinator_image`]).
    pub fn coordinator_image(&self) -> Option<&str> {
        self.section().ok()?.coordinator_image()
    }

    /// The named platform's `gpu_image` setting, the image its GPU workers run (`None`: the platform's
    /// default, see each section; ACI runs no GPUs).
    pub fn gpu_image(&self) -> Option<&str> {
        self.section().ok()?.gpu_image()
    }

    /// The named platform's SKU setting (`local` and `docker` run on this machine: the `local` SKU).
    pub fn sku(&self) -> Option<&str> {
        self.section().ok()?.sku()
    }

    /// The platform's SKU and its catalog price, or why there is none. `planned` is the SKU the planner
    /// chose (a job with a `goal:`), used when the section names none.
    pub fn priced(
        &self,
        catalog: &physalia_planner::Catalog,
        planned: Option<&str>,
    ) -> Result<Priced, SpecError> {
        let field = format!("backend.{}.sku", self.name.as_str());
        let skus = || skus_of(catalog, self.name).join(", ");
        let Some(name) = self.sku().or(planned) else {
            return Err(invalid(
                &field,
                format!(
                    "name the worker container: one of {} (infra/catalog), or add a `goal:` for the \
                     planner to choose",
                    skus()
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
                    skus()
                ),
            ));
        };
        if sku.backend != self.name.sku_platform() {
            return Err(invalid(
                &field,
                format!(
                    "the SKU {name} is one of the {} backend's, not {}; the {} backend's are {}",
                    sku.backend.as_str(),
                    self.name.as_str(),
                    self.name.as_str(),
                    skus()
                ),
            ));
        }
        if let Some(gpu) = sku.gpu.as_ref().filter(|_| !self.name.runs_gpus()) {
            return Err(invalid(
                &field,
                format!(
                    "{name} has a GPU ({}); Azure Container Instances runs no GPUs since July 2025: \
                     pick a CPU SKU, or run GPU workers on kubernetes (AKS) or ecs",
                    gpu.model
                ),
            ));
        }
        self.section()?.check_sku(sku)?;
        Ok(Priced {
            sku: sku.name.clone(),
            usd_per_worker_s: sku.usd_per_s(),
        })
    }

    /// Checks the named platform's section: present where the platform needs settings, every list
    /// non-empty and every name well-formed. The SKU is checked by [`BackendSpec::priced`].
    pub(super) fn validate(&self) -> Result<(), SpecError> {
        let section = self.section()?;
        if self.mode == Some(Mode::Cluster) && self.name.on_this_machine() {
            section.check_cluster()?;
        }
        section.validate()
    }

    /// What cluster mode needs of the job's platform section beyond [`BackendSpec::validate`].
    pub fn check_cluster(&self) -> Result<(), SpecError> {
        self.section()?.check_cluster()
    }
}

/// `fargate`, or one of Fargate's capacity providers.
pub fn is_fargate(capacity: &str) -> bool {
    capacity.eq_ignore_ascii_case("fargate") || capacity == "FARGATE_SPOT"
}

fn skus_of(catalog: &physalia_planner::Catalog, backend: BackendKind) -> Vec<String> {
    catalog
        .skus
        .iter()
        .filter(|s| s.backend == backend.sku_platform())
        .map(|s| s.name.clone())
        .collect()
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
