//! The cloud platforms a job's workers run on (`backend: ecs`, ...): each platform's backend, built
//! from the job file's section and the platform's standard credential chain, the worker container the
//! SKU pays for, and the address its workers reach the coordinator at.
//!
//! In client mode the coordinator is the `physalia submit` process, which must run where the workers'
//! network reaches it (a machine in the VPC, or a test's Docker network). In cluster mode it is
//! `physalia coordinate` inside the platform (`cluster.rs`), on the port its platform object declares
//! ([`set_control_port`]). Either way it binds every interface and gives the workers one address:
//! `backend.coordinator_address`, or the one this machine's default route leaves from.
//!
//! Credentials never come from the job file, an argument or the environment values this module
//! reads: the platform's SDK reads its own chain (`AWS_PROFILE`, `AWS_ACCESS_KEY_ID`, a task role,
//! `AWS_ENDPOINT_URL` for a private endpoint).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use physalia_backends::aci::{AciBackend, AciConfig, RegistryPull};
use physalia_backends::ecs::{Capacity, EcsBackend, EcsConfig};
use physalia_backends::kubernetes::{KubernetesBackend, KubernetesConfig};
use physalia_backends::{Backend, SecretValue, WorkerSpec};

use crate::spec::{AciSettings, BackendKind, EcsSettings, JobSpec, KubernetesSettings};

/// The UDP port a cluster-mode coordinator's control endpoint listens on: the one its platform object
/// declares (the ECS task definition's port mapping, the pod's container port) and infra/'s
/// `coordinator_port` opens (7000 in infra/ecs, infra/k8s and infra/azure).
pub(crate) const COORDINATOR_PORT: u16 = 7000;

/// How many ports from the declared one a launch tries when it is taken (a prewarmed launch's control
/// endpoint lives beside the running one's): all that the coordinator's platform object declares.
const PORT_TRIES: u16 = physalia_backends::CONTROL_PORTS;

static CONTROL_PORT: OnceLock<u16> = OnceLock::new();

/// Makes this process's control endpoints bind `port` (the next free of a few after it), as a
/// cluster-mode coordinator must: the platform declared it. Set once, before the first launch.
pub(crate) fn set_control_port(port: u16) {
    let _ = CONTROL_PORT.set(port);
}

/// The control endpoint's ports to try in order: `[0]` (any) unless [`set_control_port`] was called.
pub(crate) fn control_ports() -> Vec<u16> {
    match CONTROL_PORT.get() {
        Some(&p) => (0..PORT_TRIES).map(|i| p.saturating_add(i)).collect(),
        None => vec![0],
    }
}

/// The port every container worker's mesh listens on (each has its own address): infra/ecs's
/// `mesh_port`, which its security group opens among the tasks.
pub(crate) const MESH_PORT: u16 = 7100;

/// How often the coordinator asks a cloud platform whether workers ended.
pub(crate) const POLL_EVERY: Duration = Duration::from_secs(1);

/// Whether the job's workers run on a cloud platform (kubernetes, ecs, aci) rather than this machine.
pub(crate) fn is_cloud(kind: BackendKind) -> bool {
    matches!(
        kind,
        BackendKind::Kubernetes | BackendKind::Ecs | BackendKind::Aci
    )
}

/// The job's cloud backend, its credentials from the platform's standard chain.
pub(crate) fn backend(spec: &JobSpec) -> Result<Box<dyn Backend>> {
    match spec.backend.name {
        BackendKind::Ecs => {
            let e = ecs_settings(spec)?;
            let cfg = ecs_config(e, crate::distributed::gpu_request(spec).is_some());
            let backend = crate::workers::block_on(EcsBackend::from_env(cfg, e.region.clone()))?
                .context("connecting to AWS ECS")?;
            Ok(Box::new(backend))
        }
        BackendKind::Kubernetes => {
            let k = kubernetes_settings(spec)?;
            let backend = crate::workers::block_on(KubernetesBackend::infer(
                kubernetes_config(k),
                k.context.as_deref(),
            ))?
            .context("connecting to Kubernetes")?;
            Ok(Box::new(backend))
        }
        BackendKind::Aci => {
            let a = aci_settings(spec)?;
            let token = std::sync::Arc::new(physalia_backends::aci::DefaultAzureToken::from_env());
            let backend = AciBackend::new(aci_config(a), token).context("connecting to Azure")?;
            Ok(Box::new(backend))
        }
        other => bail!("{} is not a cloud backend", other.as_str()),
    }
}

fn kubernetes_settings(spec: &JobSpec) -> Result<&KubernetesSettings> {
    spec.backend.kubernetes.as_ref().context(
        "backend.kubernetes: the kubernetes backend needs its settings (namespace, image, sku)",
    )
}

fn aci_settings(spec: &JobSpec) -> Result<&AciSettings> {
    spec.backend
        .aci
        .as_ref()
        .context("backend.aci: the aci backend needs its settings (infra/azure's outputs)")
}

/// `backend.kubernetes` as the Kubernetes backend's configuration: the image's non-root user is the
/// pods' `fsGroup`, so the secret files are readable by it.
pub(crate) fn kubernetes_config(k: &KubernetesSettings) -> KubernetesConfig {
    KubernetesConfig {
        namespace: k.namespace.clone(),
        image_pull_secret: k.image_pull_secret.clone(),
        gpu_image: k.gpu_image.clone(),
        fs_group: Some(i64::from(crate::docker::WORKER_UID)),
        poll_interval: Duration::from_secs(1),
        node_selector: k.node_selector.clone(),
        tolerations: (k.tolerations.iter())
            .map(|t| {
                let (op, value, effect) = (
                    t.operator.as_deref(),
                    t.value.as_deref(),
                    t.effect.as_deref(),
                );
                physalia_backends::kubernetes::toleration(&t.key, op, value, effect)
            })
            .collect(),
        ..KubernetesConfig::default()
    }
}

/// `backend.aci` as the ACI backend's configuration (`arm_endpoint`: another cloud's Resource Manager).
pub(crate) fn aci_config(a: &AciSettings) -> AciConfig {
    let mut cfg = AciConfig::new(
        &a.subscription_id,
        &a.resource_group,
        &a.location,
        &a.subnet_id,
    );
    cfg.registry = a.registry.as_ref().map(|r| RegistryPull {
        server: r.server.clone(),
        identity_id: r.identity_id.clone(),
    });
    cfg.coordinator_identity_id = a.coordinator_identity_id.clone();
    if let Some(endpoint) = &a.arm_endpoint {
        cfg.endpoint = endpoint.trim_end_matches('/').to_string();
    }
    cfg
}

fn ecs_settings(spec: &JobSpec) -> Result<&EcsSettings> {
    spec.backend
        .ecs
        .as_ref()
        .context("backend.ecs: the ecs backend needs its settings (infra/ecs's outputs)")
}

/// `backend.ecs` as the ECS backend's configuration.
pub(crate) fn ecs_config(e: &EcsSettings, gpu: bool) -> EcsConfig {
    let mut cfg = EcsConfig::new(
        &e.cluster,
        e.subnets.clone(),
        e.security_groups.clone(),
        &e.execution_role_arn,
        &e.log_group,
    );
    cfg.capacity = match e.capacity.as_deref() {
        None if gpu => Capacity::Provider("physalia-gpu".into()),
        None => Capacity::Fargate,
        Some(c) if c.eq_ignore_ascii_case("fargate") => Capacity::Fargate,
        Some(c) if c.eq_ignore_ascii_case("ec2") => Capacity::Ec2,
        // FARGATE_SPOT and the cluster's own providers
        Some(c) => Capacity::Provider(c.to_string()),
    };
    cfg.task_role_arn = e.task_role_arn.clone();
    cfg.coordinator_task_role_arn = e.coordinator_task_role_arn.clone();
    cfg.gpu_image = e.gpu_image.clone();
    // a worker that does not run within a second or two of RUNNING is seen a poll later; ECS's own
    // placement takes far longer than this
    cfg.poll_interval = Duration::from_secs(1);
    cfg
}

/// Where the control endpoint binds and the address the workers are given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reach {
    pub bind: IpAddr,
    pub advertise: IpAddr,
}

/// Client mode: bind every interface, advertise `backend.coordinator_address` or the address this
/// machine's default route leaves from.
pub(crate) fn reach(spec: &JobSpec) -> Result<Reach> {
    let advertise = match spec.backend.coordinator_address {
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

/// The worker container of a cloud launch: the platform section's image (its `gpu_image` for GPU
/// workers, which the backend picks), the SKU's vCPUs and memory, a thread per vCPU unless
/// `train.threads` says otherwise, the mesh on [`MESH_PORT`].
pub(crate) fn worker_spec(
    spec: &JobSpec,
    job_id: &str,
    segment: usize,
    coordinator: SocketAddr,
    secrets: BTreeMap<String, SecretValue>,
) -> Result<WorkerSpec> {
    let priced = crate::summary::price(spec)?;
    let catalog = physalia_planner::Catalog::builtin();
    let sku = catalog
        .get(&priced.sku)
        .with_context(|| format!("the SKU {} is not in the catalog", priced.sku))?;
    let image = match spec.backend.name {
        BackendKind::Ecs => ecs_settings(spec)?.image.clone(),
        BackendKind::Kubernetes => spec
            .backend
            .kubernetes
            .as_ref()
            .map(|k| k.image.clone())
            .unwrap_or_default(),
        BackendKind::Aci => spec
            .backend
            .aci
            .as_ref()
            .map(|a| a.image.clone())
            .unwrap_or_default(),
        other => bail!("{} is not a cloud backend", other.as_str()),
    };
    let threads = spec
        .train
        .threads
        .map(|t| t as usize)
        .unwrap_or((sku.vcpus.floor() as usize).max(1));
    let mut worker = crate::workers::worker_spec(
        job_id,
        segment,
        image,
        // the image's entry point, `physalia-worker`
        Vec::new(),
        coordinator,
        threads,
        secrets,
        MESH_PORT,
    );
    worker.cpu = sku.request_vcpus();
    worker.memory_gib = sku.request_memory_gib();
    worker.instance_types = sku.instance_types();
    worker.gpu = crate::distributed::gpu_request(spec);
    Ok(worker)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(capacity: Option<&str>) -> EcsSettings {
        EcsSettings {
            region: None,
            cluster: "physalia".into(),
            subnets: vec!["subnet-1".into()],
            security_groups: vec!["sg-1".into()],
            execution_role_arn: "arn:aws:iam::123456789012:role/x".into(),
            task_role_arn: None,
            coordinator_task_role_arn: None,
            coordinator_image: None,
            log_group: "/physalia/workers".into(),
            capacity: capacity.map(String::from),
            image: "img".into(),
            gpu_image: None,
            sku: None,
        }
    }

    /// The kubernetes and aci sections become their backends' configurations (cluster mode's generic
    /// path builds both from them).
    #[test]
    fn kubernetes_and_aci_sections_become_backend_configs() {
        let k = KubernetesSettings {
            context: None,
            namespace: "ml".into(),
            image: "img".into(),
            gpu_image: Some("img-cuda".into()),
            sku: None,
            image_pull_secret: Some("pull".into()),
            coordinator_image: None,
            node_selector: Default::default(),
            tolerations: Vec::new(),
        };
        let cfg = kubernetes_config(&k);
        assert_eq!(cfg.namespace, "ml");
        assert_eq!(cfg.gpu_image.as_deref(), Some("img-cuda"));
        assert_eq!(cfg.image_pull_secret.as_deref(), Some("pull"));
        assert_eq!(cfg.fs_group, Some(i64::from(crate::docker::WORKER_UID)));
        assert_eq!(cfg.coordinator_service_account, "physalia-coordinator");
        let a = AciSettings {
            subscription_id: "sub".into(),
            resource_group: "rg".into(),
            location: "eastus".into(),
            subnet_id: "/subscriptions/sub/x/subnets/w".into(),
            registry: Some(crate::spec::AciRegistry {
                server: "r.azurecr.io".into(),
                identity_id: "/subscriptions/sub/pull".into(),
            }),
            image: "img".into(),
            coordinator_identity_id: Some("/subscriptions/sub/coordinator".into()),
            coordinator_image: None,
            sku: None,
            arm_endpoint: Some("https://management.chinacloudapi.cn/".into()),
        };
        let cfg = aci_config(&a);
        assert_eq!(cfg.endpoint, "https://management.chinacloudapi.cn");
        let public = aci_config(&AciSettings {
            arm_endpoint: None,
            ..a.clone()
        });
        assert_eq!(public.endpoint, "https://management.azure.com");
        assert_eq!(
            (cfg.subscription_id.as_str(), cfg.resource_group.as_str()),
            ("sub", "rg")
        );
        assert_eq!(cfg.subnet_id, "/subscriptions/sub/x/subnets/w");
        assert_eq!(cfg.registry.unwrap().server, "r.azurecr.io");
        assert_eq!(
            cfg.coordinator_identity_id.as_deref(),
            Some("/subscriptions/sub/coordinator")
        );
    }

    #[test]
    fn ecs_capacity_follows_the_section_and_the_gpu() {
        let cap = |c, gpu| ecs_config(&settings(c), gpu).capacity;
        assert_eq!(cap(None, false), Capacity::Fargate);
        assert_eq!(cap(None, true), Capacity::Provider("physalia-gpu".into()));
        assert_eq!(cap(Some("FARGATE"), false), Capacity::Fargate);
        assert_eq!(cap(Some("ec2"), true), Capacity::Ec2);
        assert_eq!(
            cap(Some("FARGATE_SPOT"), false),
            Capacity::Provider("FARGATE_SPOT".into())
        );
        assert_eq!(
            cap(Some("physalia-gpu"), true),
            Capacity::Provider("physalia-gpu".into())
        );
    }
}
