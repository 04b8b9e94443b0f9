//! The ecs backend: AWS Elastic Container Service through aws-sdk-ecs, one task per worker in awsvpc mode.
//!
//! A launch, for each rank (at most [`EcsConfig::max_parallel`] at a time):
//! 1. creates a Secrets Manager secret `physalia/<base>/rank-<r>` holding the rank's secret files (see
//!    [`task::secret_bundle`]);
//! 2. registers a task definition `<base>_rank<r>` with two containers: `secrets`, which receives that
//!    secret as an environment variable (the only way ECS injects secrets) and writes it out as files to
//!    a task volume (`physalia-worker unpack-secrets`), and `worker`, which starts once `secrets` has
//!    exited 0, mounts the volume read-only at [`crate::CONTAINER_SECRETS_DIR`] and has no secret in its
//!    environment. One family per rank because ECS cannot override `secrets` per task, and a rank must
//!    not hold another rank's key;
//! 3. runs the task (`RunTask`, awsvpc, no public IP, `startedBy` = the launch's base name, tags
//!    `physalia.dev/launch` and `physalia.dev/rank`).
//!
//! Then it polls `DescribeTasks` until every task is `RUNNING` with a private IP. The first failure stops
//! new ranks; then every task is stopped, every task definition deregistered and deleted and every secret
//! deleted (without the recovery window), so a failed launch leaves nothing running, billing or holding a
//! key.
//!
//! GPUs need EC2 capacity (Fargate has none): a GPU request with `capacity: fargate` is refused before
//! any call. Credentials come from the standard AWS chain (environment, web identity, the ECS task role,
//! the instance profile), never from the job file.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_ecs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_ecs::types as ecs;
use futures_util::StreamExt;

use crate::error::{BackendName, Error, Result};
use crate::spec::{ENV_RANK, ENV_SECRETS_DIR};
use crate::{
    Backend, CONTAINER_SECRETS_DIR, CoordinatorHandle, CoordinatorSpec, CoordinatorStatus, Demand,
    LaunchId, Launched, PlatformObject, WorkerSpec, WorkerState, WorkerStatus,
};

pub mod preflight;
pub mod task;

pub use aws_config;

const NAME: BackendName = "ecs";
const TAG_LAUNCH: &str = "physalia.dev/launch";
const TAG_RANK: &str = "physalia.dev/rank";
const VOLUME: &str = "physalia-secrets";
const WORKER: &str = "worker";
const UNPACKER: &str = "secrets";
/// The coordinator's container: its awslogs stream is `physalia/coordinator/<task id>`.
const COORDINATOR: &str = "coordinator";
const TAG_COORDINATOR: &str = "physalia.dev/coordinator";
/// Kinds of the coordinator's objects in its [`CoordinatorHandle`].
const KIND_TASK_DEFINITION: &str = "task-definition";
const KIND_TASK: &str = "task";
/// How long the credential chain may look for credentials (environment, profile, web identity, the ECS
/// container endpoint, EC2 instance metadata) before `from_env` says there are none. Off EC2 the
/// instance-metadata lookup would otherwise retry for seconds per call.
const CREDENTIALS_TIMEOUT: Duration = Duration::from_secs(10);
/// One try, one second, for the instance-metadata service: where it exists it answers in milliseconds.
const IMDS_TIMEOUT: Duration = Duration::from_secs(1);
const CREDENTIALS_HINT: &str = "run `aws configure` or set AWS_PROFILE (or AWS_ACCESS_KEY_ID and \
     AWS_SECRET_ACCESS_KEY); inside AWS, give the coordinator its task role (infra/ecs output \
     coordinator_task_role_arn)";
/// Memory the `secrets` container may use, MiB (it decodes a few kilobytes).
const UNPACKER_MIB: u32 = 64;
/// The awslogs stream prefix: a worker's stream is `physalia/worker/<task id>`.
const LOG_PREFIX: &str = "physalia";

/// Where the workers' tasks are placed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Capacity {
    /// `launchType: FARGATE`. CPU only; sizes are rounded up to what Fargate sells.
    Fargate,
    /// `launchType: EC2`: the cluster's registered container instances.
    Ec2,
    /// A capacity provider of the cluster (an Auto Scaling group of GPU instances, `infra/ecs`'s
    /// `gpu_capacity_provider`), which ECS scales out for the tasks.
    Provider(String),
}

impl Capacity {
    /// Fargate itself or one of its capacity providers (`FARGATE`, `FARGATE_SPOT`): no GPUs, fixed sizes.
    pub fn is_fargate(&self) -> bool {
        match self {
            Capacity::Fargate => true,
            Capacity::Ec2 => false,
            Capacity::Provider(p) => p == "FARGATE" || p == "FARGATE_SPOT",
        }
    }
}

/// One of the cluster's active container instances, as the preflight sees it.
struct Instance {
    /// Its `ecs.instance-type` attribute.
    instance_type: Option<String>,
    /// Registered CPU units / 1024.
    vcpus: f64,
    /// A task runs or waits on it.
    busy: bool,
}

#[derive(Clone, Debug)]
pub struct EcsConfig {
    /// Cluster name or ARN.
    pub cluster: String,
    /// Private subnets of the workers (and the coordinator); `infra/ecs` output `subnets`.
    pub subnets: Vec<String>,
    /// Security groups; `infra/ecs` output `security_groups` (only the QUIC ports, only from itself).
    pub security_groups: Vec<String>,
    pub capacity: Capacity,
    /// The role ECS uses to pull the image, write logs and read the rank's secret.
    pub execution_role_arn: String,
    /// The role the worker's own calls run as (none today).
    pub task_role_arn: Option<String>,
    /// The coordinator's task role in cluster mode (`infra/ecs` output `coordinator_task_role_arn`): its
    /// credentials are the coordinator's, through the container credentials endpoint.
    pub coordinator_task_role_arn: Option<String>,
    /// CloudWatch Logs group of the awslogs driver.
    pub log_group: String,
    /// `uid:gid` the secret files are given to: the worker image's user.
    pub secrets_owner: String,
    /// The `secrets` container's command (argv); the worker image's binary.
    pub unpack_command: Vec<String>,
    /// The image GPU workers run (a [`WorkerSpec`] with `gpu`), both containers of their tasks: the
    /// CUDA worker image (`worker-image/Dockerfile.cuda`) in ECR. `None` runs the spec's image.
    pub gpu_image: Option<String>,
    /// Ranks launched at once.
    pub max_parallel: usize,
    /// Wait between `DescribeTasks` polls.
    pub poll_interval: Duration,
    /// How long tasks may take to reach RUNNING (an Auto Scaling group starting GPU instances from zero
    /// takes minutes).
    pub start_timeout: Duration,
    /// Attempts per API call, throttling and transient errors included (the SDK's standard retry).
    pub max_attempts: u32,
    /// First retry delay; later ones back off exponentially with jitter.
    pub initial_backoff: Duration,
}

impl EcsConfig {
    /// The defaults for a cluster, its subnets and security groups, and the execution role and log group
    /// (all `infra/ecs` outputs).
    pub fn new(
        cluster: impl Into<String>,
        subnets: Vec<String>,
        security_groups: Vec<String>,
        execution_role_arn: impl Into<String>,
        log_group: impl Into<String>,
    ) -> EcsConfig {
        EcsConfig {
            cluster: cluster.into(),
            subnets,
            security_groups,
            capacity: Capacity::Fargate,
            execution_role_arn: execution_role_arn.into(),
            task_role_arn: None,
            coordinator_task_role_arn: None,
            log_group: log_group.into(),
            secrets_owner: "65532:65532".into(),
            unpack_command: vec![
                "/usr/local/bin/physalia-worker".into(),
                "unpack-secrets".into(),
            ],
            gpu_image: None,
            max_parallel: 8,
            poll_interval: Duration::from_secs(5),
            start_timeout: Duration::from_secs(900),
            max_attempts: 5,
            initial_backoff: Duration::from_secs(1),
        }
    }
}

pub struct EcsBackend {
    credentials: Option<aws_sdk_ecs::config::SharedCredentialsProvider>,
    ecs: aws_sdk_ecs::Client,
    secrets: aws_sdk_secretsmanager::Client,
    logs: aws_sdk_cloudwatchlogs::Client,
    quotas: aws_sdk_servicequotas::Client,
    region: String,
    cfg: EcsConfig,
}

/// What a launch has created so far, for the cleanup of a failed one.
#[derive(Default)]
struct Created {
    secrets: Vec<String>,
    task_definitions: Vec<String>,
    /// (rank, task ARN)
    tasks: Vec<(usize, String)>,
}

enum RankFailure {
    Failed(Error),
    Skipped,
}

impl EcsBackend {
    /// Loads credentials, the region and the endpoint from the standard AWS chain (`AWS_PROFILE`,
    /// `AWS_ACCESS_KEY_ID`, web identity, the ECS task role, the instance profile; `AWS_REGION`;
    /// `AWS_ENDPOINT_URL`), never from arguments. `region` overrides the chain's. The instance-metadata
    /// lookup is bounded (one try, 1 s per phase) and so is the whole chain, and the credentials are
    /// resolved here: absent or expired ones are an [`Error::Credentials`] naming what to do, now, not
    /// a hang or an error at the first launch.
    pub async fn from_env(cfg: EcsConfig, region: Option<String>) -> Result<EcsBackend> {
        use aws_config::meta::region::RegionProviderChain;
        let imds = aws_config::imds::Client::builder()
            .max_attempts(1)
            .connect_timeout(IMDS_TIMEOUT)
            .read_timeout(IMDS_TIMEOUT)
            .operation_timeout(IMDS_TIMEOUT * 2)
            .build();
        let region_chain = RegionProviderChain::first_try(region.map(aws_config::Region::new))
            .or_else(aws_config::environment::region::EnvironmentVariableRegionProvider::new())
            .or_else(aws_config::profile::ProfileFileRegionProvider::new())
            .or_else(
                aws_config::imds::region::ImdsRegionProvider::builder()
                    .imds_client(imds.clone())
                    .build(),
            );
        let credentials =
            aws_config::default_provider::credentials::DefaultCredentialsChain::builder()
                .imds_client(imds)
                .build()
                .await;
        let load = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .region(region_chain)
            .credentials_provider(credentials)
            .load();
        let sdk = tokio::time::timeout(CREDENTIALS_TIMEOUT, load)
            .await
            .map_err(|_| Error::Credentials {
                backend: NAME,
                credential: "the AWS credential chain".into(),
                detail: format!(
                    "loading the AWS configuration took over {} s",
                    CREDENTIALS_TIMEOUT.as_secs()
                ),
                hint: CREDENTIALS_HINT.into(),
            })?;
        let backend = EcsBackend::new(cfg, &sdk)?;
        backend.verify_credentials().await?;
        Ok(backend)
    }

    /// Resolves the credentials once: none, or expired ones, are an [`Error::Credentials`] with a hint.
    /// (Keys AWS does not know are found at the first call: only AWS can tell.)
    pub async fn verify_credentials(&self) -> Result<()> {
        use aws_sdk_ecs::config::ProvideCredentials;
        let refused = |detail: String| Error::Credentials {
            backend: NAME,
            credential: "the AWS credential chain".into(),
            detail,
            hint: CREDENTIALS_HINT.into(),
        };
        let Some(provider) = &self.credentials else {
            return Err(refused("no credentials provider is configured".into()));
        };
        let creds = tokio::time::timeout(CREDENTIALS_TIMEOUT, provider.provide_credentials())
            .await
            .map_err(|_| {
                refused(format!(
                    "no credentials were found within {} s",
                    CREDENTIALS_TIMEOUT.as_secs()
                ))
            })?
            .map_err(|e| {
                refused(format!(
                    "no credentials were found: {}",
                    DisplayErrorContext(&e)
                ))
            })?;
        if let Some(expiry) = creds.expiry()
            && expiry <= std::time::SystemTime::now()
        {
            let ago = std::time::SystemTime::now()
                .duration_since(expiry)
                .unwrap_or_default()
                .as_secs();
            return Err(refused(format!(
                "the credentials expired {ago} s ago (access key {}...)",
                creds.access_key_id().chars().take(4).collect::<String>()
            )));
        }
        Ok(())
    }

    /// The cluster exists and is active (DescribeClusters), before anything is created in it.
    async fn check_cluster(&self) -> Result<ecs::Cluster> {
        let cluster = &self.cfg.cluster;
        let out = self
            .ecs
            .describe_clusters()
            .clusters(cluster)
            .send()
            .await
            .map_err(|e| self.sdk_error(&format!("describe cluster {cluster}"), e))?;
        if let Some(active) = out.clusters().iter().find(|c| c.status() == Some("ACTIVE")) {
            return Ok(active.clone());
        }
        let reason = out
            .failures()
            .iter()
            .filter_map(|f| f.reason())
            .chain(out.clusters().iter().filter_map(|c| c.status()))
            .collect::<Vec<_>>()
            .join(", ");
        Err(Error::Config {
            backend: NAME,
            detail: format!(
                "cluster {cluster} is not usable in region {} (DescribeClusters: {}); create it \
                 with infra/ecs, or set the backend's cluster to infra/ecs's output `cluster`",
                self.region,
                if reason.is_empty() {
                    "not found"
                } else {
                    &reason
                }
            ),
        })
    }

    /// What the spec asks for that this capacity cannot give, before any call.
    fn check_capacity(&self, spec: &WorkerSpec) -> Result<()> {
        if spec.gpu.is_some() && self.cfg.capacity.is_fargate() {
            return Err(Error::Unsupported {
                backend: NAME,
                detail: "Fargate has no GPUs: set the backend's capacity to `ec2` or to a GPU \
                         capacity provider (infra/ecs output gpu_capacity_provider)"
                    .into(),
            });
        }
        // a size Fargate does not sell is refused here
        self.task_size(spec).map(|_| ())
    }

    /// A worker task's CPU units and MiB: on Fargate the smallest size it sells that holds the worker
    /// plus the unpacker's share; on EC2 the spec's size, which the SKU chose to fit the instance's
    /// registered resources (the worker gets all of it but the unpacker's share).
    fn task_size(&self, spec: &WorkerSpec) -> Result<(u32, u32)> {
        Ok(if self.cfg.capacity.is_fargate() {
            task::fargate_size(spec.cpu, spec.memory_gib + f64::from(UNPACKER_MIB) / 1024.0)?
        } else {
            task::ec2_size(spec.cpu, spec.memory_gib)
        })
    }

    /// Capacity the cluster cannot offer, before anything is created: a capacity provider the cluster
    /// does not have (RunTask refuses a strategy naming it), or, with launch type EC2, no registered
    /// container instance of the SKU's instance types (RunTask places only on instances already
    /// registered; nothing starts one).
    async fn check_placement(&self, cluster: &ecs::Cluster, spec: &WorkerSpec) -> Result<()> {
        let name = &self.cfg.cluster;
        let refuse = |detail: String| Error::Config {
            backend: NAME,
            detail: format!("{detail}; nothing was created"),
        };
        match &self.cfg.capacity {
            Capacity::Fargate => Ok(()),
            Capacity::Provider(p) => {
                let has = cluster.capacity_providers();
                if has.iter().any(|h| h == p) {
                    return Ok(());
                }
                Err(refuse(format!(
                    "cluster {name} in {} has no capacity provider {p} (its providers: {}): set the \
                     backend's capacity to one it has (infra/ecs output gpu_capacity_provider), or \
                     attach {p} with `aws ecs put-cluster-capacity-providers`",
                    self.region,
                    if has.is_empty() {
                        "none".to_string()
                    } else {
                        has.join(", ")
                    }
                )))
            }
            Capacity::Ec2 => {
                let types: std::collections::BTreeSet<String> = match self.instances(name).await {
                    Ok(instances) => instances
                        .into_iter()
                        .filter_map(|i| i.instance_type)
                        .collect(),
                    // a principal that may not list container instances: RunTask says it if it must
                    Err(Error::Permission { .. }) => return Ok(()),
                    Err(e) => return Err(e),
                };
                let wanted = &spec.instance_types;
                if types.is_empty() {
                    return Err(refuse(format!(
                        "cluster {name} in {} has no registered container instances, and launch \
                         type EC2 places tasks only on those: start instances into the cluster, or \
                         set the backend's capacity to a capacity provider that starts them \
                         (infra/ecs output gpu_capacity_provider)",
                        self.region
                    )));
                }
                if wanted.is_empty() || types.iter().any(|t| wanted.contains(t)) {
                    return Ok(());
                }
                Err(refuse(format!(
                    "cluster {name} in {} has no container instance of type {} (the SKU's; it has {}): \
                     register instances of that type, or choose the SKU of the instances it has",
                    self.region,
                    wanted.join(" or "),
                    types.into_iter().collect::<Vec<_>>().join(", ")
                )))
            }
        }
    }

    /// The cluster's active container instances: type (attribute `ecs.instance-type`), vCPUs (registered
    /// CPU units / 1024: the agent registers all of the instance's CPU) and whether a task runs or
    /// waits on it.
    async fn instances(&self, cluster: &str) -> Result<Vec<Instance>> {
        let mut arns = Vec::new();
        let mut pages = self
            .ecs
            .list_container_instances()
            .cluster(cluster)
            .status(ecs::ContainerInstanceStatus::Active)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| {
                self.sdk_error(&format!("list container instances of {cluster}"), e)
            })?;
            arns.extend(page.container_instance_arns().iter().cloned());
        }
        let mut instances = Vec::new();
        // DescribeContainerInstances takes at most 100
        for batch in arns.chunks(100) {
            let out = self
                .ecs
                .describe_container_instances()
                .cluster(cluster)
                .set_container_instances(Some(batch.to_vec()))
                .send()
                .await
                .map_err(|e| {
                    self.sdk_error(&format!("describe container instances of {cluster}"), e)
                })?;
            for ci in out.container_instances() {
                let cpu_units = ci
                    .registered_resources()
                    .iter()
                    .find(|r| r.name() == Some("CPU"))
                    .map_or(0, |r| r.integer_value());
                instances.push(Instance {
                    instance_type: ci
                        .attributes()
                        .iter()
                        .find(|a| a.name() == "ecs.instance-type")
                        .and_then(|a| a.value().map(str::to_string)),
                    vcpus: f64::from(cpu_units) / 1024.0,
                    busy: ci.running_tasks_count() + ci.pending_tasks_count() > 0,
                });
            }
        }
        Ok(instances)
    }

    /// What already counts against `need`'s quota, as the ECS API shows it in the backend's cluster:
    /// Fargate's, the vCPUs of its tasks that run or are about to (desired status RUNNING) on that
    /// quota (launch type FARGATE or capacity provider FARGATE for On-Demand, FARGATE_SPOT for Spot);
    /// EC2's, the vCPUs of its container instances of the quota's families, and which of the SKU's
    /// type are idle. Nothing (an empty [`preflight::Usage`]) where the principal may not list them:
    /// the quota is then compared with the job's peak alone, as AWS's usage metrics cannot be read
    /// here.
    async fn quota_usage(
        &self,
        need: &preflight::Need,
        spec: &WorkerSpec,
    ) -> Result<preflight::Usage> {
        let cluster = &self.cfg.cluster;
        let counted = if need.quota.service == "fargate" {
            self.fargate_usage(need.quota).await
        } else {
            self.instances(cluster).await.map(|instances| {
                let mut usage = preflight::Usage::default();
                let mut n = 0;
                for i in instances {
                    let Some(ty) = i.instance_type else { continue };
                    if preflight::ec2_quota(&ty) != Some(need.quota) {
                        continue;
                    }
                    n += 1;
                    usage.vcpus += i.vcpus;
                    if !i.busy && spec.instance_types.contains(&ty) {
                        usage.idle_vcpus += i.vcpus;
                    }
                }
                usage.what = format!(
                    "{n} container instance{} of cluster {cluster} in that family",
                    if n == 1 { "" } else { "s" }
                );
                usage
            })
        };
        match counted {
            Ok(usage) => Ok(usage),
            Err(Error::Permission { .. }) => Ok(preflight::Usage::default()),
            Err(e) => Err(e),
        }
    }

    /// The vCPUs of the cluster's tasks that hold (or are about to hold) Fargate capacity of `quota`.
    async fn fargate_usage(&self, quota: preflight::Quota) -> Result<preflight::Usage> {
        let cluster = &self.cfg.cluster;
        let mut arns = Vec::new();
        let mut pages = self
            .ecs
            .list_tasks()
            .cluster(cluster)
            .desired_status(ecs::DesiredStatus::Running)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| self.sdk_error(&format!("list tasks of {cluster}"), e))?;
            arns.extend(page.task_arns().iter().cloned());
        }
        let mut usage = preflight::Usage::default();
        let mut n = 0;
        // DescribeTasks takes at most 100
        for batch in arns.chunks(100) {
            let out = self
                .ecs
                .describe_tasks()
                .cluster(cluster)
                .set_tasks(Some(batch.to_vec()))
                .send()
                .await
                .map_err(|e| self.sdk_error(&format!("describe tasks of {cluster}"), e))?;
            for task in out.tasks() {
                let provider = task.capacity_provider_name();
                let on = if provider == Some("FARGATE_SPOT") {
                    preflight::FARGATE_SPOT
                } else if provider == Some("FARGATE")
                    || task.launch_type() == Some(&ecs::LaunchType::Fargate)
                {
                    preflight::FARGATE
                } else {
                    continue;
                };
                if on != quota {
                    continue;
                }
                // a Fargate task's size is its task-level CPU, in units of 1/1024 vCPU
                let Some(units) = task.cpu().and_then(|c| c.parse::<f64>().ok()) else {
                    continue;
                };
                n += 1;
                usage.vcpus += units / 1024.0;
            }
        }
        usage.what = format!(
            "{n} task{} of cluster {cluster} on Fargate",
            if n == 1 { "" } else { "s" }
        );
        Ok(usage)
    }

    /// The account's Service Quotas quota the workers count against (EC2's instance family quota, or
    /// Fargate's), against what the job needs at its peak beside what already runs in the cluster
    /// ([`Self::quota_usage`]). A quota this principal may not read (`servicequotas:GetServiceQuota`
    /// denied) or that Service Quotas does not know here is not checked: the launch then fails or
    /// waits with the platform's own reason.
    async fn check_quota(&self, spec: &WorkerSpec, demand: Demand) -> Result<()> {
        let task_vcpus = f64::from(self.task_size(spec)?.0) / 1024.0;
        let Some(need) =
            preflight::need(&self.cfg.capacity, task_vcpus, &spec.instance_types, demand)
        else {
            return Ok(());
        };
        let Some(value) = self.quota_value(need.quota).await? else {
            return Ok(());
        };
        let usage = self.quota_usage(&need, spec).await?;
        match preflight::refusal(&need, &usage, value, &self.region) {
            None => Ok(()),
            Some(detail) => Err(Error::Quota {
                backend: NAME,
                rank: None,
                detail,
            }),
        }
    }

    /// A quota's applied value in this region, else its AWS default (Service Quotas answers
    /// `NoSuchResourceException` for a quota whose applied value it does not have); `None` when
    /// neither can be read.
    async fn quota_value(&self, q: preflight::Quota) -> Result<Option<f64>> {
        let what = format!("read the quota {} ({} {})", q.name, q.service, q.code);
        match self
            .quotas
            .get_service_quota()
            .service_code(q.service)
            .quota_code(q.code)
            .send()
            .await
        {
            Ok(out) => return Ok(out.quota().and_then(|q| q.value())),
            Err(e) if e.code() == Some("NoSuchResourceException") => {}
            Err(e) => return self.unreadable_quota(&what, e),
        }
        match self
            .quotas
            .get_aws_default_service_quota()
            .service_code(q.service)
            .quota_code(q.code)
            .send()
            .await
        {
            Ok(out) => Ok(out.quota().and_then(|q| q.value())),
            Err(e) if e.code() == Some("NoSuchResourceException") => Ok(None),
            Err(e) => self.unreadable_quota(&what, e),
        }
    }

    /// A quota that cannot be read: not checked where the principal may not read it (a coordinator
    /// role or a user policy without Service Quotas), an error otherwise (bad credentials, an
    /// unreachable endpoint: the rest of the preflight would fail on them too).
    fn unreadable_quota<E>(&self, what: &str, e: SdkError<E>) -> Result<Option<f64>>
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        match self.sdk_error(what, e) {
            Error::Permission { .. } => Ok(None),
            other => Err(other),
        }
    }

    /// The coordinator's task definition and task ARNs from its handle.
    fn coordinator_objects(handle: &CoordinatorHandle) -> Result<(String, Option<String>)> {
        handle.check_backend(NAME)?;
        let td = handle
            .object(KIND_TASK_DEFINITION)
            .ok_or_else(|| Error::Config {
                backend: NAME,
                detail: format!(
                    "the coordinator handle of job {} names no task definition",
                    handle.job_id
                ),
            })?;
        Ok((td.to_string(), handle.object(KIND_TASK).map(str::to_string)))
    }

    /// The coordinator's task definition: one `coordinator` container on Fargate, awsvpc, with the
    /// coordinator's task role and the workers' execution role, logs to the workers' group.
    fn coordinator_input(
        &self,
        spec: &CoordinatorSpec,
        role: &str,
    ) -> Result<aws_sdk_ecs::operation::register_task_definition::builders::RegisterTaskDefinitionInputBuilder>
    {
        let name = LaunchId::coordinator_name(&spec.job_id);
        let (cpu, mib) = task::fargate_size(spec.cpu, spec.memory_gib)?;
        let mut container = ecs::ContainerDefinition::builder()
            .name(COORDINATOR)
            .image(&spec.image)
            .essential(true)
            .set_environment(Some(
                spec.env
                    .iter()
                    .map(|(k, v)| ecs::KeyValuePair::builder().name(k).value(v).build())
                    .collect(),
            ))
            .set_port_mappings(Some(
                spec.control_ports()
                    .map(|port| {
                        ecs::PortMapping::builder()
                            .container_port(i32::from(port))
                            .protocol(ecs::TransportProtocol::Udp)
                            .build()
                    })
                    .collect(),
            ))
            .memory(mib as i32)
            .log_configuration(self.log_configuration(LOG_PREFIX)?);
        if let Some((argv0, rest)) = spec.command.split_first() {
            container = container
                .entry_point(argv0)
                .set_command(Some(rest.to_vec()));
        }
        let mut input =
            aws_sdk_ecs::operation::register_task_definition::RegisterTaskDefinitionInput::builder(
            )
            .family(&name)
            .network_mode(ecs::NetworkMode::Awsvpc)
            .requires_compatibilities(ecs::Compatibility::Fargate)
            .cpu(cpu.to_string())
            .memory(mib.to_string())
            .execution_role_arn(&self.cfg.execution_role_arn)
            .task_role_arn(role)
            .container_definitions(container.build());
        for tag in self.coordinator_tags(spec) {
            input = input.tags(tag);
        }
        Ok(input)
    }

    fn coordinator_tags(&self, spec: &CoordinatorSpec) -> Vec<ecs::Tag> {
        let name = LaunchId::coordinator_name(&spec.job_id);
        let mut tags: BTreeMap<&str, &str> = spec
            .labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        tags.insert(TAG_COORDINATOR, &name);
        tags.into_iter()
            .map(|(k, v)| ecs::Tag::builder().key(k).value(v).build())
            .collect()
    }

    /// Registers the coordinator's task definition and runs it; records each object in `objects`.
    async fn start_coordinator(
        &self,
        spec: &CoordinatorSpec,
        role: &str,
        objects: &mut Vec<PlatformObject>,
    ) -> Result<()> {
        let name = LaunchId::coordinator_name(&spec.job_id);
        let op = format!("register task definition {name}");
        let registered = self
            .coordinator_input(spec, role)?
            .send_with(&self.ecs)
            .await
            .map_err(|e| self.sdk_error(&op, e))?;
        let td_arn = registered
            .task_definition()
            .and_then(|t| t.task_definition_arn())
            .ok_or_else(|| Error::Api {
                backend: NAME,
                operation: op.clone(),
                status: None,
                detail: "the answer has no task definition ARN".into(),
            })?
            .to_string();
        objects.push(PlatformObject {
            kind: KIND_TASK_DEFINITION.into(),
            id: td_arn.clone(),
        });
        let network = ecs::NetworkConfiguration::builder()
            .awsvpc_configuration(
                ecs::AwsVpcConfiguration::builder()
                    .set_subnets(Some(self.cfg.subnets.clone()))
                    .set_security_groups(Some(self.cfg.security_groups.clone()))
                    .assign_public_ip(ecs::AssignPublicIp::Disabled)
                    .build()
                    .map_err(build_error)?,
            )
            .build();
        let mut run = self
            .ecs
            .run_task()
            .cluster(&self.cfg.cluster)
            .task_definition(&td_arn)
            .count(1)
            .launch_type(ecs::LaunchType::Fargate)
            .started_by(&name)
            .network_configuration(network);
        for tag in self.coordinator_tags(spec) {
            run = run.tags(tag);
        }
        let op = "run the coordinator's task".to_string();
        let ran = run.send().await.map_err(|e| self.sdk_error(&op, e))?;
        let Some(arn) = ran.tasks().first().and_then(|t| t.task_arn()) else {
            let reasons: Vec<String> = ran
                .failures()
                .iter()
                .map(|f| {
                    format!(
                        "{}{}",
                        f.reason().unwrap_or("no reason given"),
                        f.detail().map(|d| format!(" ({d})")).unwrap_or_default()
                    )
                })
                .collect();
            return Err(Error::CoordinatorFailed {
                backend: NAME,
                detail: format!(
                    "ECS started no task on FARGATE in cluster {}: {}",
                    self.cfg.cluster,
                    if reasons.is_empty() {
                        "no reason given".to_string()
                    } else {
                        reasons.join("; ")
                    }
                ),
            });
        };
        objects.push(PlatformObject {
            kind: KIND_TASK.into(),
            id: arn.to_string(),
        });
        let arn = arn.to_string();
        let started = tokio::time::Instant::now();
        loop {
            let task = self.describe(std::slice::from_ref(&arn)).await?.pop();
            let Some(t) = task else {
                return Err(Error::CoordinatorFailed {
                    backend: NAME,
                    detail: format!("ECS no longer knows task {arn}"),
                });
            };
            let status = task_status(0, &t, COORDINATOR);
            match status.state {
                WorkerState::Running if status.ip.is_some() => return Ok(()),
                WorkerState::Succeeded => return Ok(()),
                WorkerState::Failed => return Err(coordinator_stopped_error(&spec.image, &t)),
                _ if started.elapsed() >= self.cfg.start_timeout => {
                    return Err(Error::Timeout {
                        backend: NAME,
                        what: format!(
                            "the coordinator's task to run ({})",
                            t.last_status().unwrap_or("no status")
                        ),
                        waited_s: started.elapsed().as_secs(),
                    });
                }
                _ => tokio::time::sleep(self.cfg.poll_interval).await,
            }
        }
    }

    /// Stops the coordinator's task and deletes its task definition; what could not be.
    async fn delete_coordinator(&self, td_arn: &str, task_arn: Option<&str>) -> Vec<String> {
        let mut leftovers = Vec::new();
        if let Some(arn) = task_arn
            && let Err(e) = self.stop_task(arn, "coordinator stopped").await
        {
            leftovers.push(format!("task {arn} ({e})"));
        }
        leftovers.extend(self.delete_task_definitions(&[td_arn.to_string()]).await);
        leftovers
    }

    /// Every page of an awslogs stream, from the head; empty when the stream does not exist yet.
    async fn read_stream(&self, stream: &str) -> Result<String> {
        let mut out = String::new();
        let mut token: Option<String> = None;
        loop {
            let page = match self
                .logs
                .get_log_events()
                .log_group_name(&self.cfg.log_group)
                .log_stream_name(stream)
                .start_from_head(true)
                .set_next_token(token.clone())
                .send()
                .await
            {
                Ok(p) => p,
                // nothing written yet
                Err(e) if e.code() == Some("ResourceNotFoundException") => return Ok(out),
                Err(e) => {
                    return Err(self.sdk_error(&format!("read log stream {stream}"), e));
                }
            };
            for event in page.events() {
                out.push_str(event.message().unwrap_or(""));
                out.push('\n');
            }
            let next = page.next_forward_token().map(str::to_string);
            // the same token again means the end of the stream
            if next.is_none() || next == token || page.events().is_empty() {
                return Ok(out);
            }
            token = next;
        }
    }

    /// Uses the given SDK configuration (credentials, region, endpoint), with this backend's retries.
    pub fn new(cfg: EcsConfig, sdk: &aws_config::SdkConfig) -> Result<EcsBackend> {
        let config_err = |detail: String| Error::Config {
            backend: NAME,
            detail,
        };
        for (field, value) in [
            ("cluster", &cfg.cluster),
            ("execution_role_arn", &cfg.execution_role_arn),
            ("log_group", &cfg.log_group),
        ] {
            if value.trim().is_empty() {
                return Err(config_err(format!(
                    "{field} is empty (infra/ecs's outputs give it)"
                )));
            }
        }
        if cfg.subnets.is_empty() {
            return Err(config_err(
                "subnets is empty: awsvpc tasks need at least one (infra/ecs output `subnets`)"
                    .into(),
            ));
        }
        if cfg.max_parallel == 0 || cfg.max_attempts == 0 {
            return Err(config_err(
                "max_parallel and max_attempts must be at least 1".into(),
            ));
        }
        if cfg.unpack_command.is_empty() {
            return Err(config_err("unpack_command is empty".into()));
        }
        let region = sdk.region().map(|r| r.to_string()).ok_or_else(|| {
            config_err(
                "no AWS region: set AWS_REGION or the profile's region, or the job file's \
                     backend.region"
                    .into(),
            )
        })?;
        let retry = aws_config::retry::RetryConfig::standard()
            .with_max_attempts(cfg.max_attempts)
            .with_initial_backoff(cfg.initial_backoff);
        let ecs = aws_sdk_ecs::Client::from_conf(
            aws_sdk_ecs::config::Builder::from(sdk)
                .retry_config(retry.clone())
                .build(),
        );
        let secrets = aws_sdk_secretsmanager::Client::from_conf(
            aws_sdk_secretsmanager::config::Builder::from(sdk)
                .retry_config(retry.clone())
                .build(),
        );
        let logs = aws_sdk_cloudwatchlogs::Client::from_conf(
            aws_sdk_cloudwatchlogs::config::Builder::from(sdk)
                .retry_config(retry.clone())
                .build(),
        );
        let quotas = aws_sdk_servicequotas::Client::from_conf(
            aws_sdk_servicequotas::config::Builder::from(sdk)
                .retry_config(retry)
                .build(),
        );
        Ok(EcsBackend {
            credentials: sdk.credentials_provider(),
            ecs,
            secrets,
            logs,
            quotas,
            region,
            cfg,
        })
    }

    /// An SDK error as the variant a user can act on.
    fn sdk_error<E>(&self, operation: &str, err: SdkError<E>) -> Error
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let status = err.raw_response().map(|r| r.status().as_u16());
        // An error body the SDK could not read (a front end answering XML or HTML for a JSON API) may
        // still name the error: `<Code>InvalidClientTokenId</Code>`.
        let body_code = || -> Option<(String, Option<String>)> {
            let body = std::str::from_utf8(err.raw_response()?.body().bytes()?).ok()?;
            let between = |open: &str, close: &str| -> Option<String> {
                let start = body.find(open)? + open.len();
                let len = body[start..].find(close)?;
                Some(body[start..start + len].trim().to_string())
            };
            Some((
                between("<Code>", "</Code>")?,
                between("<Message>", "</Message>"),
            ))
        };
        let (code, message) = match err.code() {
            Some(c) => (c.to_string(), err.message().map(str::to_string)),
            None => body_code().unwrap_or_default(),
        };
        let detail = match (code.as_str(), message) {
            ("", _) => DisplayErrorContext(&err).to_string(),
            (c, Some(m)) => format!("{c}: {m}"),
            (c, None) => c.to_string(),
        };
        let lc = detail.to_ascii_lowercase();
        let cluster = &self.cfg.cluster;
        match code.as_str() {
            "UnrecognizedClientException"
            | "InvalidClientTokenId"
            | "InvalidSignatureException"
            | "SignatureDoesNotMatch"
            | "ExpiredTokenException"
            | "ExpiredToken"
            | "MissingAuthenticationToken"
            | "IncompleteSignature" => Error::Credentials {
                backend: NAME,
                credential: "the AWS credential chain".into(),
                detail,
                hint: "the access key is unknown, expired or for another account: check \
                       AWS_PROFILE / AWS_ACCESS_KEY_ID, or the coordinator's task role"
                    .into(),
            },
            "AccessDeniedException" | "AccessDenied" | "UnauthorizedOperation" => {
                Error::Permission {
                    backend: NAME,
                    action: operation.into(),
                    detail,
                    hint: "attach infra/ecs's coordinator policy (output coordinator_policy_json) \
                           to the coordinator's role"
                        .into(),
                }
            }
            "ThrottlingException"
            | "Throttling"
            | "TooManyRequestsException"
            | "RequestLimitExceeded" => Error::Throttled {
                backend: NAME,
                operation: operation.into(),
                attempts: self.cfg.max_attempts,
                detail,
                hint: "lower the backend's max_parallel, raise max_attempts, or ask AWS for a \
                       higher API rate"
                    .into(),
            },
            "InvalidSubnetID.NotFound" | "InvalidGroup.NotFound" => Error::Config {
                backend: NAME,
                detail: format!(
                    "{detail} (subnets {:?}, security groups {:?}: use infra/ecs's outputs `subnets` \
                     and `security_groups`, in region {})",
                    self.cfg.subnets, self.cfg.security_groups, self.region
                ),
            },
            "InvalidParameterException"
                if (lc.contains("subnet") || lc.contains("security group"))
                    && lc.contains("does not exist") =>
            {
                Error::Config {
                    backend: NAME,
                    detail: format!(
                        "{detail} (use infra/ecs's outputs `subnets` and `security_groups`, in \
                         region {})",
                        self.region
                    ),
                }
            }
            "ClusterNotFoundException" => Error::Config {
                backend: NAME,
                detail: format!("{detail} (cluster {cluster}; infra/ecs creates it)"),
            },
            "LimitExceededException" => Error::Quota {
                backend: NAME,
                rank: None,
                detail,
            },
            "ResourceExistsException" => Error::AlreadyExists {
                backend: NAME,
                what: operation.trim_start_matches("create ").to_string(),
            },
            _ if matches!(
                err,
                SdkError::DispatchFailure(_) | SdkError::TimeoutError(_)
            ) =>
            {
                Error::Api {
                    backend: NAME,
                    operation: operation.into(),
                    status,
                    detail: format!("{detail} (is the AWS endpoint reachable?)"),
                }
            }
            _ if lc.contains("credentials") || lc.contains("identity") => Error::Credentials {
                backend: NAME,
                credential: "the AWS credential chain".into(),
                detail,
                hint: "no credentials were found: set AWS_PROFILE or AWS_ACCESS_KEY_ID, or run \
                       the coordinator with a task role"
                    .into(),
            },
            _ => Error::Api {
                backend: NAME,
                operation: operation.into(),
                status,
                detail,
            },
        }
    }

    fn tags(&self, launch: &LaunchId, rank: usize) -> (ecs::Tag, ecs::Tag) {
        (
            ecs::Tag::builder()
                .key(TAG_LAUNCH)
                .value(launch.base_name())
                .build(),
            ecs::Tag::builder()
                .key(TAG_RANK)
                .value(rank.to_string())
                .build(),
        )
    }

    fn log_configuration(&self, stream_prefix: &str) -> Result<ecs::LogConfiguration> {
        ecs::LogConfiguration::builder()
            .log_driver(ecs::LogDriver::Awslogs)
            .options("awslogs-group", &self.cfg.log_group)
            .options("awslogs-region", &self.region)
            .options("awslogs-stream-prefix", stream_prefix)
            .build()
            .map_err(build_error)
    }

    /// Rank `rank`'s task definition: the `secrets` and `worker` containers, sized for the capacity.
    fn register_input(
        &self,
        spec: &WorkerSpec,
        n: usize,
        rank: usize,
        secret_arn: &str,
    ) -> Result<aws_sdk_ecs::operation::register_task_definition::builders::RegisterTaskDefinitionInputBuilder>
    {
        let launch = LaunchId::new(&spec.job_id, spec.segment);
        let fargate = self.cfg.capacity.is_fargate();
        let (task_cpu, task_mib) = self.task_size(spec)?;
        let (worker_cpu, worker_mib) = (
            task_cpu,
            task_mib
                .checked_sub(UNPACKER_MIB)
                .filter(|&m| m >= 4)
                .ok_or_else(|| {
                    Error::InvalidSpec(format!(
                        "memory_gib {} leaves the worker container nothing beside the secrets \
                 container's {UNPACKER_MIB} MiB",
                        spec.memory_gib
                    ))
                })?,
        );

        let mut env = spec.base_env(n);
        env.insert(ENV_RANK.into(), rank.to_string());
        // one image for both containers: a GPU task pulls only the CUDA image
        let image = spec.image_for(self.cfg.gpu_image.as_deref());
        let mut worker = ecs::ContainerDefinition::builder()
            .name(WORKER)
            .image(image)
            .essential(true)
            .set_environment(Some(
                env.iter()
                    .map(|(k, v)| ecs::KeyValuePair::builder().name(k).value(v).build())
                    .collect(),
            ))
            .mount_points(
                ecs::MountPoint::builder()
                    .source_volume(VOLUME)
                    .container_path(CONTAINER_SECRETS_DIR)
                    .read_only(true)
                    .build(),
            )
            .depends_on(
                ecs::ContainerDependency::builder()
                    .container_name(UNPACKER)
                    .condition(ecs::ContainerCondition::Success)
                    .build()
                    .map_err(build_error)?,
            )
            .port_mappings(
                ecs::PortMapping::builder()
                    .container_port(i32::from(spec.network.mesh_port))
                    .protocol(ecs::TransportProtocol::Udp)
                    .build(),
            )
            .log_configuration(self.log_configuration(LOG_PREFIX)?);
        if let Some((argv0, rest)) = spec.command.split_first() {
            worker = worker.entry_point(argv0).set_command(Some(rest.to_vec()));
        }
        // Every container gets a hard memory limit (moto insists, like EC2 without task-level memory):
        // on Fargate the worker may use all of the task's memory but the unpacker's share.
        worker = if fargate {
            worker.memory(worker_mib as i32)
        } else {
            worker.cpu(worker_cpu as i32).memory(worker_mib as i32)
        };
        if let Some(gpu) = &spec.gpu {
            worker = worker.resource_requirements(
                ecs::ResourceRequirement::builder()
                    .r#type(ecs::ResourceType::Gpu)
                    .value(gpu.count.to_string())
                    .build()
                    .map_err(build_error)?,
            );
        }

        let (argv0, rest) = self
            .cfg
            .unpack_command
            .split_first()
            .expect("checked in new");
        let unpacker = ecs::ContainerDefinition::builder()
            .name(UNPACKER)
            .image(image)
            .essential(false)
            // root, to chown the files to the worker's user on a volume root owns
            .user("0")
            .entry_point(argv0)
            .set_command(Some(rest.to_vec()))
            .environment(
                ecs::KeyValuePair::builder()
                    .name(ENV_SECRETS_DIR)
                    .value(CONTAINER_SECRETS_DIR)
                    .build(),
            )
            .environment(
                ecs::KeyValuePair::builder()
                    .name(task::ENV_SECRETS_OWNER)
                    .value(&self.cfg.secrets_owner)
                    .build(),
            )
            .secrets(
                ecs::Secret::builder()
                    .name(task::ENV_SECRET_BUNDLE)
                    .value_from(secret_arn)
                    .build()
                    .map_err(build_error)?,
            )
            .mount_points(
                ecs::MountPoint::builder()
                    .source_volume(VOLUME)
                    .container_path(CONTAINER_SECRETS_DIR)
                    .read_only(false)
                    .build(),
            )
            .memory(UNPACKER_MIB as i32)
            .log_configuration(self.log_configuration(LOG_PREFIX)?)
            .build();

        // On EC2 the files live in a task-scoped tmpfs; Fargate offers only its (encrypted) ephemeral
        // storage for a volume shared between containers.
        let volume = if fargate {
            ecs::Volume::builder().name(VOLUME).build()
        } else {
            ecs::Volume::builder()
                .name(VOLUME)
                .docker_volume_configuration(
                    ecs::DockerVolumeConfiguration::builder()
                        .scope(ecs::Scope::Task)
                        .driver("local")
                        .driver_opts("type", "tmpfs")
                        .driver_opts("device", "tmpfs")
                        .driver_opts("o", "size=1m,mode=0700")
                        .build(),
                )
                .build()
        };
        let (t_launch, t_rank) = self.tags(&launch, rank);
        let mut input =
            aws_sdk_ecs::operation::register_task_definition::RegisterTaskDefinitionInput::builder(
            )
            .family(task::family(&launch, rank))
            .network_mode(ecs::NetworkMode::Awsvpc)
            .requires_compatibilities(if fargate {
                ecs::Compatibility::Fargate
            } else {
                ecs::Compatibility::Ec2
            })
            .cpu(task_cpu.to_string())
            .memory(task_mib.to_string())
            .execution_role_arn(&self.cfg.execution_role_arn)
            .set_task_role_arn(self.cfg.task_role_arn.clone())
            .container_definitions(unpacker)
            .container_definitions(worker.build())
            .volumes(volume)
            .tags(t_launch)
            .tags(t_rank);
        // Fargate has no instances to choose (and refuses memberOf constraints)
        if let Some(expression) = task::instance_type_constraint(&spec.instance_types)
            && !fargate
        {
            input = input.placement_constraints(
                ecs::TaskDefinitionPlacementConstraint::builder()
                    .r#type(ecs::TaskDefinitionPlacementConstraintType::MemberOf)
                    .expression(expression)
                    .build(),
            );
        }
        Ok(input)
    }

    /// Creates rank `rank`'s secret, task definition and task.
    async fn launch_one(
        &self,
        spec: &WorkerSpec,
        n: usize,
        rank: usize,
        bundle: String,
        created: &Mutex<Created>,
        failed: &AtomicBool,
    ) -> Result<(), RankFailure> {
        if failed.load(Ordering::SeqCst) {
            return Err(RankFailure::Skipped);
        }
        let fail = |e: Error| {
            failed.store(true, Ordering::SeqCst);
            RankFailure::Failed(e.at_rank(rank))
        };
        let launch = LaunchId::new(&spec.job_id, spec.segment);
        let secret_name = task::secret_name(&launch, rank);
        let op = format!("create secret {secret_name}");
        let secret = self
            .secrets
            .create_secret()
            .name(&secret_name)
            .description(format!(
                "physalia worker {rank}'s certificates for job {:?} (deleted with the launch)",
                spec.job_id
            ))
            .secret_string(bundle)
            .tags(
                aws_sdk_secretsmanager::types::Tag::builder()
                    .key(TAG_LAUNCH)
                    .value(launch.base_name())
                    .build(),
            )
            .tags(
                aws_sdk_secretsmanager::types::Tag::builder()
                    .key(TAG_RANK)
                    .value(rank.to_string())
                    .build(),
            )
            .send()
            .await
            .map_err(|e| fail(self.sdk_error(&op, e)))?;
        let secret_arn = secret.arn().unwrap_or(&secret_name).to_string();
        lock(created).secrets.push(secret_arn.clone());

        let input = self
            .register_input(spec, n, rank, &secret_arn)
            .map_err(fail)?;
        let op = format!("register task definition {}", task::family(&launch, rank));
        let registered = input
            .send_with(&self.ecs)
            .await
            .map_err(|e| fail(self.sdk_error(&op, e)))?;
        let td_arn = registered
            .task_definition()
            .and_then(|t| t.task_definition_arn())
            .ok_or_else(|| {
                fail(Error::Api {
                    backend: NAME,
                    operation: op.clone(),
                    status: None,
                    detail: "the answer has no task definition ARN".into(),
                })
            })?
            .to_string();
        lock(created).task_definitions.push(td_arn.clone());

        let network = ecs::NetworkConfiguration::builder()
            .awsvpc_configuration(
                ecs::AwsVpcConfiguration::builder()
                    .set_subnets(Some(self.cfg.subnets.clone()))
                    .set_security_groups(Some(self.cfg.security_groups.clone()))
                    .assign_public_ip(ecs::AssignPublicIp::Disabled)
                    .build()
                    .map_err(|e| fail(build_error(e)))?,
            )
            .build();
        let (t_launch, t_rank) = self.tags(&launch, rank);
        let mut run = self
            .ecs
            .run_task()
            .cluster(&self.cfg.cluster)
            .task_definition(&td_arn)
            .count(1)
            .started_by(launch.base_name())
            .network_configuration(network)
            .tags(t_launch)
            .tags(t_rank);
        run = match &self.cfg.capacity {
            Capacity::Fargate => run.launch_type(ecs::LaunchType::Fargate),
            Capacity::Ec2 => run.launch_type(ecs::LaunchType::Ec2),
            Capacity::Provider(p) => run.capacity_provider_strategy(
                ecs::CapacityProviderStrategyItem::builder()
                    .capacity_provider(p)
                    .weight(1)
                    .build()
                    .map_err(|e| fail(build_error(e)))?,
            ),
        };
        let op = format!("run task for worker {rank}");
        let ran = run.send().await.map_err(|e| fail(self.sdk_error(&op, e)))?;
        match ran.tasks().first().and_then(|t| t.task_arn()) {
            Some(arn) => {
                lock(created).tasks.push((rank, arn.to_string()));
                Ok(())
            }
            None => {
                let reasons: Vec<String> = ran
                    .failures()
                    .iter()
                    .map(|f| {
                        let mut s = f.reason().unwrap_or("no reason given").to_string();
                        if let Some(d) = f.detail() {
                            s.push_str(&format!(" ({d})"));
                        }
                        s
                    })
                    .collect();
                let detail = if reasons.is_empty() {
                    "ECS placed no task and gave no reason".to_string()
                } else {
                    reasons.join("; ")
                };
                Err(fail(Error::NoCapacity {
                    backend: NAME,
                    rank,
                    detail: format!(
                        "{detail} ({}: {}; a capacity provider with managed scaling starts \
                         instances, infra/ecs `gpu_capacity_provider`)",
                        match &self.cfg.capacity {
                            Capacity::Fargate => "launch type FARGATE".to_string(),
                            Capacity::Ec2 => "launch type EC2".to_string(),
                            Capacity::Provider(p) => format!("capacity provider {p}"),
                        },
                        self.cfg.cluster
                    ),
                }))
            }
        }
    }

    /// Every task ARN of `arns`, described (with tags), 100 per call.
    async fn describe(&self, arns: &[String]) -> Result<Vec<ecs::Task>> {
        let mut out = Vec::with_capacity(arns.len());
        for chunk in arns.chunks(100) {
            let got = self
                .ecs
                .describe_tasks()
                .cluster(&self.cfg.cluster)
                .set_tasks(Some(chunk.to_vec()))
                .include(ecs::TaskField::Tags)
                .send()
                .await
                .map_err(|e| self.sdk_error("describe tasks", e))?;
            out.extend(got.tasks().iter().cloned());
        }
        Ok(out)
    }

    /// Waits until every task of `tasks` (rank, ARN) runs and has its private IP.
    async fn wait_running(
        &self,
        spec: &WorkerSpec,
        tasks: &[(usize, String)],
    ) -> Result<Vec<WorkerStatus>> {
        let started = tokio::time::Instant::now();
        loop {
            let described = self
                .describe(&tasks.iter().map(|t| t.1.clone()).collect::<Vec<_>>())
                .await?;
            let by_arn: BTreeMap<&str, &ecs::Task> = described
                .iter()
                .filter_map(|t| Some((t.task_arn()?, t)))
                .collect();
            let mut statuses = Vec::with_capacity(tasks.len());
            let mut waiting = Vec::new();
            for (rank, arn) in tasks {
                let Some(t) = by_arn.get(arn.as_str()) else {
                    return Err(Error::WorkerFailed {
                        backend: NAME,
                        rank: *rank,
                        detail: format!("ECS no longer knows task {arn}"),
                    });
                };
                let status = worker_status(*rank, t);
                match status.state {
                    WorkerState::Running if status.ip.is_some() => statuses.push(status),
                    WorkerState::Pending | WorkerState::Running | WorkerState::Unknown => {
                        waiting.push(format!(
                            "worker {rank} ({})",
                            t.last_status().unwrap_or("no status")
                        ));
                    }
                    WorkerState::Succeeded | WorkerState::Failed => {
                        return Err(stopped_error(
                            spec.image_for(self.cfg.gpu_image.as_deref()),
                            *rank,
                            t,
                        ));
                    }
                }
            }
            if waiting.is_empty() {
                statuses.sort_by_key(|s| s.rank);
                return Ok(statuses);
            }
            if started.elapsed() >= self.cfg.start_timeout {
                return Err(Error::Timeout {
                    backend: NAME,
                    what: format!("{} to run: {}", waiting.len(), waiting.join(", ")),
                    waited_s: started.elapsed().as_secs(),
                });
            }
            tokio::time::sleep(self.cfg.poll_interval).await;
        }
    }

    /// Deletes what a failed launch created; the names of what could not be deleted.
    async fn cleanup(&self, created: Created) -> Vec<String> {
        let mut leftovers = Vec::new();
        for (_, arn) in &created.tasks {
            if let Err(e) = self.stop_task(arn, "launch failed").await {
                leftovers.push(format!("task {arn} ({e})"));
            }
        }
        leftovers.extend(
            self.delete_task_definitions(&created.task_definitions)
                .await,
        );
        for arn in &created.secrets {
            if let Err(e) = self.delete_secret(arn).await {
                leftovers.push(format!("secret {arn} ({e})"));
            }
        }
        leftovers
    }

    async fn stop_task(&self, arn: &str, why: &str) -> Result<()> {
        match self
            .ecs
            .stop_task()
            .cluster(&self.cfg.cluster)
            .task(arn)
            .reason(format!("physalia: {why}"))
            .send()
            .await
        {
            Ok(_) => Ok(()),
            // stopping a task ECS no longer has is done
            Err(e) if e.code() == Some("InvalidParameterException") && is_gone(&e) => Ok(()),
            Err(e) => Err(self.sdk_error(&format!("stop task {arn}"), e)),
        }
    }

    /// Deregisters and deletes task definitions; what could not be.
    async fn delete_task_definitions(&self, arns: &[String]) -> Vec<String> {
        let mut leftovers = Vec::new();
        for arn in arns {
            if let Err(e) = self
                .ecs
                .deregister_task_definition()
                .task_definition(arn)
                .send()
                .await
                && !is_gone(&e)
            {
                leftovers.push(format!(
                    "task definition {arn} ({})",
                    self.sdk_error("deregister task definition", e)
                ));
            }
        }
        for chunk in arns.chunks(10) {
            match self
                .ecs
                .delete_task_definitions()
                .set_task_definitions(Some(chunk.to_vec()))
                .send()
                .await
            {
                Ok(out) => {
                    for f in out.failures() {
                        let reason = f.reason().unwrap_or("");
                        let lc = reason.to_ascii_lowercase();
                        if !lc.contains("not found")
                            && !lc.contains("does not exist")
                            && !reason.contains("DELETE_IN_PROGRESS")
                        {
                            leftovers.push(format!(
                                "task definition {} ({reason})",
                                f.arn().unwrap_or("?")
                            ));
                        }
                    }
                }
                Err(e) => leftovers.push(format!(
                    "task definitions {} ({})",
                    chunk.join(", "),
                    self.sdk_error("delete task definitions", e)
                )),
            }
        }
        leftovers
    }

    async fn delete_secret(&self, arn: &str) -> Result<()> {
        match self
            .secrets
            .delete_secret()
            .secret_id(arn)
            .force_delete_without_recovery(true)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("ResourceNotFoundException") => Ok(()),
            Err(e) => Err(self.sdk_error(&format!("delete secret {arn}"), e)),
        }
    }

    /// The launch's tasks ECS still lists (running, and stopped ones for about an hour), described.
    async fn launch_tasks(&self, launch: &LaunchId) -> Result<Vec<ecs::Task>> {
        let mut arns = Vec::new();
        for desired in [ecs::DesiredStatus::Running, ecs::DesiredStatus::Stopped] {
            let page = self
                .ecs
                .list_tasks()
                .cluster(&self.cfg.cluster)
                .started_by(launch.base_name())
                .desired_status(desired)
                .into_paginator()
                .items()
                .send()
                .try_collect()
                .await
                .map_err(|e| self.sdk_error("list tasks", e))?;
            arns.extend(page);
        }
        arns.sort();
        arns.dedup();
        if arns.is_empty() {
            return Ok(Vec::new());
        }
        let base = launch.base_name();
        Ok(self
            .describe(&arns)
            .await?
            .into_iter()
            .filter(|t| tag(t, TAG_LAUNCH) == Some(base.as_str()))
            .collect())
    }
}

#[async_trait]
impl Backend for EcsBackend {
    fn name(&self) -> BackendName {
        NAME
    }

    async fn launch(&self, spec: &WorkerSpec, n_workers: usize) -> Result<Launched> {
        spec.validate(n_workers)?;
        self.check_capacity(spec)?;
        // Every bundle and size before the first call: a spec ECS cannot take creates nothing.
        let bundles = (0..n_workers)
            .map(|r| task::secret_bundle(spec, r))
            .collect::<Result<Vec<_>>>()?;
        let launch = LaunchId::new(&spec.job_id, spec.segment);
        // Stopped tasks of an earlier, failed launch stay listed for about an hour; only live ones clash.
        let live = self.launch_tasks(&launch).await?;
        if live.iter().any(|t| t.desired_status() != Some("STOPPED")) {
            return Err(Error::AlreadyExists {
                backend: NAME,
                what: format!("tasks started by {}", launch.base_name()),
            });
        }

        let created = Mutex::new(Created::default());
        let failed = AtomicBool::new(false);
        let results: Vec<Result<(), RankFailure>> =
            futures_util::stream::iter(bundles.into_iter().enumerate())
                .map(|(rank, bundle)| {
                    self.launch_one(spec, n_workers, rank, bundle, &created, &failed)
                })
                .buffer_unordered(self.cfg.max_parallel)
                .collect()
                .await;
        let mut first = None;
        for r in results {
            if let Err(RankFailure::Failed(e)) = r
                && first.is_none()
            {
                first = Some(e);
            }
        }
        let mut created = created.into_inner().expect("launch bookkeeping lock");
        created.tasks.sort();
        let outcome = match first {
            Some(e) => Err(e),
            None => self.wait_running(spec, &created.tasks).await,
        };
        match outcome {
            Ok(workers) => Ok(Launched {
                id: launch,
                workers,
            }),
            Err(e) => {
                let leftovers = self.cleanup(created).await;
                Err(e.after_cleanup(leftovers))
            }
        }
    }

    async fn list(&self, launch: &LaunchId) -> Result<Vec<WorkerStatus>> {
        // A rank relaunched in the same segment (after a failed launch) has its stopped task listed too
        // for a while: report the newest task of each rank.
        let tasks = self.launch_tasks(launch).await?;
        let mut newest: BTreeMap<usize, &ecs::Task> = BTreeMap::new();
        for t in &tasks {
            let Some(rank) = tag(t, TAG_RANK).and_then(|r| r.parse::<usize>().ok()) else {
                continue;
            };
            let created = |t: &ecs::Task| t.created_at().map(|d| (d.secs(), d.subsec_nanos()));
            if newest
                .get(&rank)
                .is_none_or(|old| created(t) >= created(old))
            {
                newest.insert(rank, t);
            }
        }
        Ok(newest
            .into_iter()
            .map(|(rank, t)| worker_status(rank, t))
            .collect())
    }

    async fn stop(&self, launch: &LaunchId, rank: usize) -> Result<()> {
        let tasks = self.launch_tasks(launch).await?;
        let mine: Vec<&ecs::Task> = tasks
            .iter()
            .filter(|t| tag(t, TAG_RANK) == Some(rank.to_string().as_str()))
            .collect();
        // no task at all: it is gone (ECS forgets stopped tasks after about an hour), which is stopped
        for t in mine {
            if t.desired_status() != Some("STOPPED")
                && let Some(arn) = t.task_arn()
            {
                self.stop_task(arn, "stopped by the coordinator").await?;
            }
        }
        Ok(())
    }

    async fn stop_all(&self, launch: &LaunchId) -> Result<()> {
        let mut leftovers = Vec::new();
        for t in self.launch_tasks(launch).await? {
            if t.desired_status() != Some("STOPPED")
                && let Some(arn) = t.task_arn()
                && let Err(e) = self.stop_task(arn, "job stopped").await
            {
                leftovers.push(format!("task {arn} ({e})"));
            }
        }
        // task definitions: every revision of every rank's family
        let prefix = task::family_prefix(launch);
        let families = self
            .ecs
            .list_task_definition_families()
            .family_prefix(&prefix)
            .status(ecs::TaskDefinitionFamilyStatus::All)
            .into_paginator()
            .items()
            .send()
            .try_collect()
            .await
            .map_err(|e| self.sdk_error("list task definition families", e))?;
        let mut definitions = Vec::new();
        for family in families.iter().filter(|f| {
            f.strip_prefix(&prefix)
                .is_some_and(|r| r.parse::<usize>().is_ok())
        }) {
            for status in [
                ecs::TaskDefinitionStatus::Active,
                ecs::TaskDefinitionStatus::Inactive,
            ] {
                let arns = self
                    .ecs
                    .list_task_definitions()
                    .family_prefix(family)
                    .status(status)
                    .into_paginator()
                    .items()
                    .send()
                    .try_collect()
                    .await
                    .map_err(|e| self.sdk_error("list task definitions", e))?;
                definitions.extend(arns);
            }
        }
        leftovers.extend(self.delete_task_definitions(&definitions).await);
        // secrets: every one named under the launch's prefix
        let secret_prefix = task::secret_prefix(launch);
        let listed = self
            .secrets
            .list_secrets()
            .filters(
                aws_sdk_secretsmanager::types::Filter::builder()
                    .key(aws_sdk_secretsmanager::types::FilterNameStringType::Name)
                    .values(&secret_prefix)
                    .build(),
            )
            .into_paginator()
            .send()
            .try_collect()
            .await
            .map_err(|e| self.sdk_error("list secrets", e))?;
        // the name filter ignores case (and may match more than a prefix): keep exactly the launch's own
        let secrets = listed
            .iter()
            .flat_map(|page| page.secret_list())
            .filter(|s| s.name().is_some_and(|n| n.starts_with(&secret_prefix)))
            .filter_map(|s| s.arn().map(str::to_string));
        for arn in secrets {
            if let Err(e) = self.delete_secret(&arn).await {
                leftovers.push(format!("secret {arn} ({e})"));
            }
        }
        Error::stop_all_result(NAME, launch, leftovers)
    }

    async fn logs(&self, launch: &LaunchId, rank: usize) -> Result<String> {
        let tasks = self.launch_tasks(launch).await?;
        let Some(task) = tasks
            .iter()
            .filter(|t| tag(t, TAG_RANK) == Some(rank.to_string().as_str()))
            .max_by_key(|t| t.created_at().map(|d| (d.secs(), d.subsec_nanos())))
        else {
            return Err(Error::NoSuchWorker {
                backend: NAME,
                launch: launch.to_string(),
                rank,
            });
        };
        let id = task
            .task_arn()
            .and_then(|a| a.rsplit('/').next())
            .unwrap_or_default();
        self.read_stream(&format!("{LOG_PREFIX}/{WORKER}/{id}"))
            .await
    }

    async fn check(&self, spec: &WorkerSpec, demand: Demand) -> Result<()> {
        self.check_capacity(spec)?;
        self.verify_credentials().await?;
        let cluster = self.check_cluster().await?;
        self.check_placement(&cluster, spec).await?;
        self.check_quota(spec, demand).await
    }

    async fn launch_coordinator(&self, spec: &CoordinatorSpec) -> Result<CoordinatorHandle> {
        spec.validate()?;
        let role = self
            .cfg
            .coordinator_task_role_arn
            .clone()
            .filter(|r| !r.trim().is_empty())
            .ok_or_else(|| Error::Config {
                backend: NAME,
                detail: "coordinator_task_role_arn is not set: cluster mode runs the coordinator \
                         with infra/ecs's coordinator task role (output coordinator_task_role_arn)"
                    .into(),
            })?;
        task::fargate_size(spec.cpu, spec.memory_gib)?;
        self.check_cluster().await?;
        let mut objects = Vec::new();
        match self.start_coordinator(spec, &role, &mut objects).await {
            Ok(()) => Ok(CoordinatorHandle {
                backend: NAME.into(),
                job_id: spec.job_id.clone(),
                scope: self.cfg.cluster.clone(),
                objects,
            }),
            Err(e) => {
                let td = objects
                    .iter()
                    .find(|o| o.kind == KIND_TASK_DEFINITION)
                    .map(|o| o.id.clone());
                let task = objects
                    .iter()
                    .find(|o| o.kind == KIND_TASK)
                    .map(|o| o.id.as_str());
                let leftovers = match td {
                    Some(td) => self.delete_coordinator(&td, task).await,
                    None => Vec::new(),
                };
                Err(e.after_cleanup(leftovers))
            }
        }
    }

    async fn coordinator_status(&self, handle: &CoordinatorHandle) -> Result<CoordinatorStatus> {
        let (_, task) = Self::coordinator_objects(handle)?;
        let gone = || CoordinatorStatus {
            state: WorkerState::Unknown,
            detail: Some(
                "ECS no longer lists the coordinator's task (stopped over an hour ago)".into(),
            ),
            ip: None,
        };
        let Some(arn) = task else { return Ok(gone()) };
        let Some(t) = self.describe(std::slice::from_ref(&arn)).await?.pop() else {
            return Ok(gone());
        };
        let s = task_status(0, &t, COORDINATOR);
        Ok(CoordinatorStatus {
            state: s.state,
            detail: s.detail,
            ip: s.ip,
        })
    }

    async fn coordinator_logs(&self, handle: &CoordinatorHandle) -> Result<String> {
        let (_, task) = Self::coordinator_objects(handle)?;
        let Some(arn) = task else {
            return Ok(String::new());
        };
        let id = arn.rsplit('/').next().unwrap_or_default();
        self.read_stream(&format!("{LOG_PREFIX}/{COORDINATOR}/{id}"))
            .await
    }

    async fn stop_coordinator(&self, handle: &CoordinatorHandle) -> Result<()> {
        let (td, task) = Self::coordinator_objects(handle)?;
        let leftovers = self.delete_coordinator(&td, task.as_deref()).await;
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
}

fn lock(m: &Mutex<Created>) -> std::sync::MutexGuard<'_, Created> {
    m.lock().expect("launch bookkeeping lock")
}

fn build_error(e: aws_sdk_ecs::error::BuildError) -> Error {
    Error::InvalidSpec(format!("building the ECS request: {e}"))
}

/// ECS's answer for a task or task definition that no longer exists.
fn is_gone<E: ProvideErrorMetadata>(e: &E) -> bool {
    let m = e.message().unwrap_or("").to_ascii_lowercase();
    m.contains("not found")
        || m.contains("could not find")
        || m.contains("does not exist")
        || m.contains("unable to describe task definition")
}

fn tag<'a>(t: &'a ecs::Task, key: &str) -> Option<&'a str> {
    t.tags()
        .iter()
        .find(|tag| tag.key() == Some(key))
        .and_then(|tag| tag.value())
}

/// The exit code of the task's container `name`, when it has one.
fn exit_of(t: &ecs::Task, name: &str) -> Option<i32> {
    t.containers()
        .iter()
        .find(|c| c.name() == Some(name))
        .and_then(|c| c.exit_code())
}

fn worker_status(rank: usize, t: &ecs::Task) -> WorkerStatus {
    task_status(rank, t, WORKER)
}

/// A task as a status, judged by its main container `main` (its exit code says succeeded or failed).
fn task_status(rank: usize, t: &ecs::Task, main: &str) -> WorkerStatus {
    let worker_exit = |t: &ecs::Task| exit_of(t, main);
    let last = t.last_status().unwrap_or("");
    let stopping = matches!(
        last,
        "DEACTIVATING" | "STOPPING" | "DEPROVISIONING" | "STOPPED" | "DELETED"
    );
    // Stopped by a StopTask (ours say "physalia: ..."), whatever the exit code of a SIGTERM: stopped is
    // not succeeded.
    let stopped_by_user = t.stop_code() == Some(&ecs::TaskStopCode::UserInitiated)
        || t.stopped_reason()
            .is_some_and(|r| r.starts_with("physalia: "));
    let state = match last {
        "PROVISIONING" | "PENDING" | "ACTIVATING" => WorkerState::Pending,
        "RUNNING" if t.desired_status() != Some("STOPPED") => WorkerState::Running,
        "RUNNING" => WorkerState::Failed,
        _ if stopping && worker_exit(t) == Some(0) && !stopped_by_user => WorkerState::Succeeded,
        _ if stopping => WorkerState::Failed,
        _ => WorkerState::Unknown,
    };
    let mut detail = Vec::new();
    if let Some(r) = t.stopped_reason().filter(|r| !r.is_empty()) {
        detail.push(r.to_string());
    }
    if let Some(code) = t.stop_code() {
        detail.push(code.as_str().to_string());
    }
    for c in t.containers() {
        if let Some(r) = c.reason().filter(|r| !r.is_empty()) {
            detail.push(format!("{}: {r}", c.name().unwrap_or("container")));
        }
    }
    if let Some(code) = worker_exit(t) {
        detail.push(format!("exit code {code}"));
    }
    if stopping && detail.is_empty() {
        detail.push(format!("the task is {last}"));
    }
    WorkerStatus {
        rank,
        name: t
            .task_arn()
            .and_then(|a| a.rsplit('/').next())
            .unwrap_or_default()
            .to_string(),
        state,
        ip: task::eni_ip(t),
        dns_name: None,
        detail: (!detail.is_empty()).then(|| detail.join("; ")),
    }
}

/// Why the coordinator's task stopped while its launch waited for it: an image ECS could not pull is named.
fn coordinator_stopped_error(image: &str, t: &ecs::Task) -> Error {
    let detail = task_status(0, t, COORDINATOR)
        .detail
        .unwrap_or_else(|| "stopped without a reason".into());
    let detail = if detail.contains("CannotPullContainer") || detail.contains("pull image") {
        format!("image {image} could not be pulled: {detail}")
    } else {
        format!("its task stopped while starting: {detail}")
    };
    Error::CoordinatorFailed {
        backend: NAME,
        detail,
    }
}

/// Why a task stopped while the launch waited for it, as the variant a user can act on.
/// `image` is the one the task runs.
fn stopped_error(image: &str, rank: usize, t: &ecs::Task) -> Error {
    let status = worker_status(rank, t);
    let detail = status
        .detail
        .unwrap_or_else(|| "stopped without a reason".into());
    if detail.contains("CannotPullContainer") || detail.contains("pull image") {
        return Error::ImageMissing {
            backend: NAME,
            image: image.to_string(),
            rank,
            detail,
        };
    }
    let hint = if detail.contains("ResourceInitializationError") && detail.contains("secret") {
        " (the execution role cannot read the worker's secret: infra/ecs grants \
         secretsmanager:GetSecretValue on physalia/*)"
    } else {
        ""
    };
    Error::WorkerFailed {
        backend: NAME,
        rank,
        detail: format!("the task stopped on its own while starting: {detail}{hint}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::tests::spec;

    fn stopped(reason: &str, container_reason: Option<&str>) -> ecs::Task {
        let mut worker = ecs::Container::builder().name(WORKER);
        if let Some(r) = container_reason {
            worker = worker.reason(r);
        }
        ecs::Task::builder()
            .last_status("STOPPED")
            .desired_status("STOPPED")
            .stopped_reason(reason)
            .stop_code(ecs::TaskStopCode::TaskFailedToStart)
            .containers(worker.build())
            .build()
    }

    /// Both containers of a GPU worker's task definition run the GPU image; a CPU worker's run the spec's.
    #[tokio::test]
    async fn gpu_task_definitions_run_the_gpu_image() {
        let sdk = aws_config::SdkConfig::builder()
            .behavior_version(aws_config::BehaviorVersion::latest())
            .region(aws_config::Region::new("us-east-1"))
            .build();
        let mut cfg = EcsConfig::new(
            "physalia",
            vec!["subnet-1".into()],
            vec!["sg-1".into()],
            "arn:aws:iam::123456789012:role/x",
            "/physalia/workers",
        );
        cfg.capacity = Capacity::Provider("physalia-gpu".into());
        cfg.gpu_image =
            Some("123456789012.dkr.ecr.us-east-1.amazonaws.com/physalia:0.1.0-cuda".into());
        let backend = EcsBackend::new(cfg, &sdk).unwrap();
        let images = |s: &WorkerSpec| {
            let input = backend
                .register_input(s, 1, 0, "arn:aws:secretsmanager:us-east-1:1:secret:x")
                .unwrap()
                .build()
                .unwrap();
            input
                .container_definitions()
                .iter()
                .map(|c| {
                    (
                        c.name().unwrap().to_string(),
                        c.image().unwrap().to_string(),
                    )
                })
                .collect::<Vec<_>>()
        };
        let mut s = spec();
        let cpu = "ghcr.io/physalia/worker:0.1.0";
        assert_eq!(
            images(&s),
            [(UNPACKER.into(), cpu.into()), (WORKER.into(), cpu.into())]
        );
        s.gpu = Some(crate::GpuRequest {
            count: 1,
            kind: None,
        });
        let gpu = "123456789012.dkr.ecr.us-east-1.amazonaws.com/physalia:0.1.0-cuda";
        assert_eq!(
            images(&s),
            [(UNPACKER.into(), gpu.into()), (WORKER.into(), gpu.into())]
        );
    }

    #[test]
    fn why_a_task_stopped_is_named() {
        let s = spec();
        let pull = stopped(
            "CannotPullContainerError: pull image manifest has been retried 7 time(s): not found",
            None,
        );
        let err = stopped_error(&s.image, 3, &pull);
        assert!(
            matches!(&err, Error::ImageMissing { rank: 3, image, .. } if image == &s.image),
            "{err}"
        );
        let secrets = stopped(
            "ResourceInitializationError: unable to pull secrets or registry auth",
            None,
        );
        let err = stopped_error(&s.image, 0, &secrets).to_string();
        assert!(err.contains("execution role"), "{err}");
        let exited = stopped(
            "Essential container in task exited",
            Some("OutOfMemoryError"),
        );
        let err = stopped_error(&s.image, 1, &exited).to_string();
        assert!(
            err.contains("Essential container in task exited")
                && err.contains("worker: OutOfMemoryError")
                && err.contains("TaskFailedToStart"),
            "{err}"
        );
        assert_eq!(worker_status(1, &exited).state, WorkerState::Failed);
    }

    #[test]
    fn a_coordinator_image_ecs_cannot_pull_is_named() {
        let pull = stopped(
            "CannotPullContainerError: pull image manifest has been retried 7 time(s): not found",
            None,
        );
        let err = coordinator_stopped_error("ecr/physalia:0.1.0", &pull).to_string();
        assert!(
            err.starts_with(
                "ecs: the coordinator could not start: image ecr/physalia:0.1.0 could not be pulled: \
                 CannotPullContainerError"
            ),
            "{err}"
        );
        let exited = stopped("Essential container in task exited", None);
        let err = coordinator_stopped_error("x", &exited).to_string();
        assert!(
            err.contains("its task stopped while starting: Essential container"),
            "{err}"
        );
        // stopped by a StopTask: failed, even with exit code 0
        let c = ecs::Container::builder()
            .name(COORDINATOR)
            .exit_code(0)
            .build();
        let by_us = ecs::Task::builder()
            .last_status("STOPPED")
            .desired_status("STOPPED")
            .stopped_reason("physalia: coordinator stopped")
            .containers(c)
            .build();
        assert_eq!(
            task_status(0, &by_us, COORDINATOR).state,
            WorkerState::Failed
        );
        let done = ecs::Task::builder()
            .last_status("STOPPED")
            .desired_status("STOPPED")
            .stopped_reason("Essential container in task exited")
            .containers(
                ecs::Container::builder()
                    .name(COORDINATOR)
                    .exit_code(0)
                    .build(),
            )
            .build();
        assert_eq!(
            task_status(0, &done, COORDINATOR).state,
            WorkerState::Succeeded
        );
    }

    #[test]
    fn states_map_from_ecs_statuses() {
        let task = |last: &str, desired: &str, exit: Option<i32>| {
            let mut c = ecs::Container::builder().name(WORKER);
            if let Some(code) = exit {
                c = c.exit_code(code);
            }
            ecs::Task::builder()
                .last_status(last)
                .desired_status(desired)
                .containers(c.build())
                .build()
        };
        let cases = [
            ("PROVISIONING", "RUNNING", None, WorkerState::Pending),
            ("PENDING", "RUNNING", None, WorkerState::Pending),
            ("RUNNING", "RUNNING", None, WorkerState::Running),
            ("RUNNING", "STOPPED", None, WorkerState::Failed),
            ("STOPPED", "STOPPED", Some(0), WorkerState::Succeeded),
            ("STOPPED", "STOPPED", Some(3), WorkerState::Failed),
            ("DEACTIVATING", "RUNNING", None, WorkerState::Failed),
            ("SOMETHING_NEW", "RUNNING", None, WorkerState::Unknown),
        ];
        for (last, desired, exit, want) in cases {
            assert_eq!(
                worker_status(0, &task(last, desired, exit)).state,
                want,
                "{last}/{desired}/{exit:?}"
            );
        }
    }
}
