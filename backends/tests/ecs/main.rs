//! The ecs backend against moto's ECS, Secrets Manager, CloudWatch Logs and IAM server on loopback
//! (`moto_fixture.py`, PyPI `moto[server]`), one server per test. Moto does not run containers: it keeps
//! the API's state (task definitions, tasks and their ENIs and private IPs, secrets, log streams) and
//! answers as ECS does, which is what the backend talks to.
//!
//! Without moto the tests print `skipping` and pass, unless `PHYSALIA_REQUIRE_MOTO=1` (CI sets it).

mod proxy;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use aws_sdk_ecs::types as ecs;
use base64::Engine as _;
use physalia_backends::ecs::aws_config;
use physalia_backends::ecs::{Capacity, EcsBackend, EcsConfig, task};
use physalia_backends::{
    Backend, CoordinatorSpec, Demand, Error, GpuRequest, LaunchId, NetworkSpec, SecretBytes,
    SecretValue, WorkerSpec, WorkerState,
};
use physalia_testkit::{Emulator, Spawn};
use serde_json::Value;

const IMAGE: &str = "123456789012.dkr.ecr.us-east-1.amazonaws.com/physalia-worker:0.1.0";

/// moto's server, seeded; stopped on drop.
struct Moto {
    _server: Emulator,
    info: Value,
}

impl Moto {
    /// `None` (and a note) where moto is not installed and not required.
    fn start(args: &[&str]) -> Option<Moto> {
        let server = Spawn::new("backends/tests/ecs/moto_fixture.py")
            .args(args)
            .python(&["moto.server", "boto3"])
            .start()?;
        let info = server.info().clone();
        Some(Moto {
            _server: server,
            info,
        })
    }

    fn endpoint(&self) -> String {
        self.info["endpoint"].as_str().unwrap().to_string()
    }

    async fn sdk(&self) -> aws_config::SdkConfig {
        sdk_for(&self.endpoint(), "testing", "testing").await
    }

    fn config(&self) -> EcsConfig {
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_string())
                .collect()
        };
        let mut cfg = EcsConfig::new(
            self.info["cluster"].as_str().unwrap(),
            strings(&self.info["subnets"]),
            strings(&self.info["security_groups"]),
            self.info["execution_role_arn"].as_str().unwrap(),
            self.info["log_group"].as_str().unwrap(),
        );
        cfg.coordinator_task_role_arn = Some(
            self.info["coordinator_task_role_arn"]
                .as_str()
                .unwrap()
                .to_string(),
        );
        cfg.poll_interval = Duration::from_millis(20);
        cfg.start_timeout = Duration::from_secs(10);
        cfg.initial_backoff = Duration::from_millis(10);
        cfg.max_attempts = 3;
        cfg
    }

    async fn backend(&self, cfg: EcsConfig) -> EcsBackend {
        EcsBackend::new(cfg, &self.sdk().await).unwrap()
    }
}

async fn sdk_for(endpoint: &str, key: &str, secret: &str) -> aws_config::SdkConfig {
    aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .credentials_provider(aws_sdk_ecs::config::Credentials::new(
            key, secret, None, None, "test",
        ))
        .load()
        .await
}

fn key(rank: usize) -> String {
    format!("-----BEGIN PRIVATE KEY-----\nKEY-OF-RANK-{rank}\n-----END PRIVATE KEY-----\n")
}

fn spec(n: usize) -> WorkerSpec {
    WorkerSpec {
        job_id: "products-1732000000".into(),
        segment: 2,
        image: IMAGE.into(),
        command: vec![],
        cpu: 2.0,
        memory_gib: 6.0,
        gpu: None,
        instance_types: Vec::new(),
        env: BTreeMap::from([("RAYON_NUM_THREADS".into(), "2".into())]),
        secrets: BTreeMap::from([
            (
                "ca.pem".into(),
                SecretValue::Same(SecretBytes::new("-----BEGIN CERTIFICATE-----\nCA\n")),
            ),
            (
                "key.pem".into(),
                SecretValue::PerRank((0..n).map(|r| SecretBytes::new(key(r))).collect()),
            ),
        ]),
        network: NetworkSpec {
            coordinator_addr: "10.0.1.17:7000".into(),
            mesh_port: 7100,
        },
    }
}

/// What the account holds of a launch: running tasks, active task definitions, secrets.
struct Leftovers {
    running: usize,
    families: Vec<String>,
    secrets: Vec<String>,
}

async fn leftovers(sdk: &aws_config::SdkConfig, launch: &LaunchId) -> Leftovers {
    let ecs = aws_sdk_ecs::Client::new(sdk);
    let sm = aws_sdk_secretsmanager::Client::new(sdk);
    let running = ecs
        .list_tasks()
        .cluster("physalia")
        .desired_status(ecs::DesiredStatus::Running)
        .send()
        .await
        .unwrap()
        .task_arns()
        .len();
    // revisions still registered (ACTIVE) or deregistered but not deleted (INACTIVE), by family
    let mut families = Vec::new();
    let all = ecs
        .list_task_definition_families()
        .family_prefix(task::family_prefix(launch))
        .send()
        .await
        .unwrap();
    for family in all.families() {
        for status in [
            ecs::TaskDefinitionStatus::Active,
            ecs::TaskDefinitionStatus::Inactive,
        ] {
            let revisions = ecs
                .list_task_definitions()
                .family_prefix(family)
                .status(status.clone())
                .send()
                .await
                .unwrap();
            for arn in revisions.task_definition_arns() {
                families.push(format!("{arn} ({status:?})"));
            }
        }
    }
    let secrets = sm
        .list_secrets()
        .send()
        .await
        .unwrap()
        .secret_list()
        .iter()
        .filter_map(|s| s.name().map(str::to_string))
        .collect();
    Leftovers {
        running,
        families,
        secrets,
    }
}

fn assert_nothing_left(l: &Leftovers) {
    assert_eq!(l.running, 0, "tasks still running");
    assert!(
        l.families.is_empty(),
        "task definitions left: {:?}",
        l.families
    );
    assert!(l.secrets.is_empty(), "secrets left: {:?}", l.secrets);
}

fn env_of(c: &ecs::ContainerDefinition) -> BTreeMap<String, String> {
    c.environment()
        .iter()
        .map(|kv| {
            (
                kv.name().unwrap().to_string(),
                kv.value().unwrap().to_string(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fargate_launch_list_logs_stop() {
    let Some(moto) = Moto::start(&["--tasks-stay-running"]) else {
        return;
    };
    let sdk = moto.sdk().await;
    let backend = moto.backend(moto.config()).await;
    let n = 3;
    let spec = spec(n);
    let launched = backend.launch(&spec, n).await.unwrap();
    let launch = LaunchId::new(&spec.job_id, spec.segment);
    assert_eq!(launched.id, launch);
    assert_eq!(launched.workers.len(), n);
    let mut ips = Vec::new();
    for (r, w) in launched.workers.iter().enumerate() {
        assert_eq!(w.rank, r);
        assert_eq!(w.state, WorkerState::Running, "{w:?}");
        ips.push(w.ip.expect("the task's ENI address"));
    }
    ips.sort();
    ips.dedup();
    assert_eq!(ips.len(), n, "each worker has its own address");

    // What ECS was told, read back from it.
    let ecs_client = aws_sdk_ecs::Client::new(&sdk);
    let sm = aws_sdk_secretsmanager::Client::new(&sdk);
    let b64 = base64::engine::general_purpose::STANDARD;
    for rank in 0..n {
        let td = ecs_client
            .describe_task_definition()
            .task_definition(task::family(&launch, rank))
            .send()
            .await
            .unwrap();
        let td = td.task_definition().unwrap();
        assert_eq!(td.network_mode(), Some(&ecs::NetworkMode::Awsvpc));
        assert_eq!(td.requires_compatibilities(), [ecs::Compatibility::Fargate]);
        // 2 vCPU and 6 GiB + the unpacker's 64 MiB: Fargate's 2048 / 7168
        assert_eq!((td.cpu(), td.memory()), (Some("2048"), Some("7168")));
        let containers = td.container_definitions();
        let worker = containers
            .iter()
            .find(|c| c.name() == Some("worker"))
            .unwrap();
        let unpacker = containers
            .iter()
            .find(|c| c.name() == Some("secrets"))
            .unwrap();
        let env = env_of(worker);
        assert_eq!(env["PHYSALIA_RANK"], rank.to_string());
        assert_eq!(env["PHYSALIA_WORLD"], n.to_string());
        assert_eq!(env["PHYSALIA_COORDINATOR_ADDR"], "10.0.1.17:7000");
        assert_eq!(env["PHYSALIA_SECRETS_DIR"], "/var/run/physalia/secrets");
        assert_eq!(env["RAYON_NUM_THREADS"], "2");
        assert!(
            worker.secrets().is_empty(),
            "the worker gets no secret variable"
        );
        let mount = &worker.mount_points()[0];
        assert_eq!(mount.container_path(), Some("/var/run/physalia/secrets"));
        assert_eq!(mount.read_only(), Some(true));
        let dep = &worker.depends_on()[0];
        assert_eq!(dep.container_name(), "secrets");
        assert_eq!(dep.condition(), &ecs::ContainerCondition::Success);
        assert_eq!(worker.port_mappings()[0].container_port(), Some(7100));
        assert_eq!(
            worker.port_mappings()[0].protocol(),
            Some(&ecs::TransportProtocol::Udp)
        );
        assert_eq!(
            worker.log_configuration().unwrap().log_driver(),
            &ecs::LogDriver::Awslogs
        );
        assert_eq!(unpacker.essential(), Some(false));
        assert_eq!(
            unpacker.command(),
            ["unpack-secrets"],
            "the unpacker runs the worker binary's unpack-secrets"
        );
        assert_eq!(unpacker.mount_points()[0].read_only(), Some(false));
        // The rank's secret holds its own key and no other rank's.
        let secret_ref = &unpacker.secrets()[0];
        assert_eq!(secret_ref.name(), "PHYSALIA_SECRET_BUNDLE");
        let value = sm
            .get_secret_value()
            .secret_id(secret_ref.value_from())
            .send()
            .await
            .unwrap();
        assert!(value.name().unwrap().ends_with(&format!("/rank-{rank}")));
        let files: BTreeMap<String, String> =
            serde_json::from_str(value.secret_string().unwrap()).unwrap();
        assert_eq!(b64.decode(&files["key.pem"]).unwrap(), key(rank).as_bytes());
        assert!(files.contains_key("ca.pem"));
        // No key appears in any plain value of the task definition.
        let plain = format!("{td:?}");
        for r in 0..n {
            assert!(!plain.contains(&format!("KEY-OF-RANK-{r}")), "{plain}");
        }
    }

    // list: every rank running, with the launch's tags
    let listed = backend.list(&launch).await.unwrap();
    assert_eq!(
        listed.iter().map(|w| (w.rank, w.state)).collect::<Vec<_>>(),
        (0..n)
            .map(|r| (r, WorkerState::Running))
            .collect::<Vec<_>>()
    );

    // logs: the awslogs stream of rank 1's task
    let logs = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    let stream = format!("physalia/worker/{}", listed[1].name);
    logs.create_log_stream()
        .log_group_name("/physalia/workers")
        .log_stream_name(&stream)
        .send()
        .await
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let mut put = logs
        .put_log_events()
        .log_group_name("/physalia/workers")
        .log_stream_name(&stream);
    for (i, line) in ["worker 1: joined the mesh", "epoch 0 loss 1.9459"]
        .iter()
        .enumerate()
    {
        put = put.log_events(
            aws_sdk_cloudwatchlogs::types::InputLogEvent::builder()
                .timestamp(now + i as i64)
                .message(*line)
                .build()
                .unwrap(),
        );
    }
    put.send().await.unwrap();
    let text = backend.logs(&launch, 1).await.unwrap();
    assert_eq!(text, "worker 1: joined the mesh\nepoch 0 loss 1.9459\n");
    assert_eq!(backend.logs(&launch, 0).await.unwrap(), "", "no output yet");
    assert!(matches!(
        backend.logs(&launch, 7).await,
        Err(Error::NoSuchWorker { rank: 7, .. })
    ));

    // A second launch of the same segment is refused and touches nothing.
    let again = backend.launch(&spec, n).await.unwrap_err();
    assert!(matches!(again, Error::AlreadyExists { .. }), "{again}");
    assert_eq!(backend.list(&launch).await.unwrap().len(), n);

    // stop one: it shows stopped, the others run
    backend.stop(&launch, 1).await.unwrap();
    let listed = backend.list(&launch).await.unwrap();
    let one = listed.iter().find(|w| w.rank == 1).unwrap();
    assert_eq!(one.state, WorkerState::Failed);
    assert!(
        one.detail
            .as_deref()
            .unwrap_or("")
            .contains("stopped by the coordinator"),
        "{one:?}"
    );
    assert_eq!(
        listed
            .iter()
            .filter(|w| w.state == WorkerState::Running)
            .count(),
        n - 1
    );
    backend.stop(&launch, 1).await.unwrap();

    // stop all: no task runs, no task definition or secret remains; a second stop_all is fine
    backend.stop_all(&launch).await.unwrap();
    assert_nothing_left(&leftovers(&sdk, &launch).await);
    backend.stop_all(&launch).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_stopping_on_its_own() {
    // moto's default: each DescribeTasks moves a task one state towards STOPPED
    let Some(moto) = Moto::start(&[]) else {
        return;
    };
    let sdk = moto.sdk().await;
    let backend = moto.backend(moto.config()).await;
    let spec = spec(2);
    let launch = LaunchId::new(&spec.job_id, spec.segment);
    let err = backend.launch(&spec, 2).await.unwrap_err();
    match &err {
        Error::WorkerFailed { detail, .. } => {
            assert!(detail.contains("stopped on its own"), "{err}")
        }
        other => panic!("{other}"),
    }
    assert_nothing_left(&leftovers(&sdk, &launch).await);

    // After a successful launch, a task that exits shows as failed with ECS's reason.
    let Some(moto) = Moto::start(&["--tasks-stay-running"]) else {
        return;
    };
    let sdk = moto.sdk().await;
    let backend = moto.backend(moto.config()).await;
    let launched = backend.launch(&spec, 2).await.unwrap();
    let ecs_client = aws_sdk_ecs::Client::new(&sdk);
    let arn = ecs_client
        .list_tasks()
        .cluster("physalia")
        .send()
        .await
        .unwrap()
        .task_arns()
        .iter()
        .find(|a| a.ends_with(&launched.workers[0].name))
        .unwrap()
        .clone();
    ecs_client
        .stop_task()
        .cluster("physalia")
        .task(arn)
        .reason("Essential container in task exited")
        .send()
        .await
        .unwrap();
    let listed = backend.list(&launch).await.unwrap();
    assert_eq!(listed[0].state, WorkerState::Failed);
    assert!(
        listed[0]
            .detail
            .as_deref()
            .unwrap()
            .contains("Essential container in task exited"),
        "{listed:?}"
    );
    assert_eq!(listed[1].state, WorkerState::Running);
    backend.stop_all(&launch).await.unwrap();
    assert_nothing_left(&leftovers(&sdk, &launch).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_on_ec2_capacity_and_running_out_of_it() {
    // one g5.xlarge container instance: 4096 CPU units, 7482 MiB, so two 2-vCPU 2-GiB workers
    let Some(moto) = Moto::start(&["--tasks-stay-running", "--container-instances", "1"]) else {
        return;
    };
    let sdk = moto.sdk().await;
    let mut cfg = moto.config();
    cfg.capacity = Capacity::Ec2;
    cfg.max_parallel = 1; // ranks in order, so the failing one is known
    let backend = moto.backend(cfg).await;
    let mut spec = spec(4);
    spec.memory_gib = 2.0;
    spec.gpu = Some(GpuRequest {
        count: 1,
        kind: Some("A10G".into()),
    });
    spec.instance_types = vec!["g5.xlarge".into()];
    let launch = LaunchId::new(&spec.job_id, spec.segment);
    let err = backend.launch(&spec, 4).await.unwrap_err();
    match &err {
        Error::NoCapacity {
            rank: 2, detail, ..
        } => {
            assert!(detail.contains("launch type EC2"), "{err}")
        }
        other => panic!("expected no capacity at worker 2, got {other}"),
    }
    assert!(
        err.to_string().contains("no capacity for worker 2"),
        "{err}"
    );
    assert_nothing_left(&leftovers(&sdk, &launch).await);
    // Every task definition the launch registered is gone, not merely inactive.
    let ecs_client = aws_sdk_ecs::Client::new(&sdk);
    for rank in 0..3 {
        let family = task::family(&launch, rank);
        let active = ecs_client
            .list_task_definitions()
            .family_prefix(&family)
            .send()
            .await
            .unwrap();
        assert!(active.task_definition_arns().is_empty(), "{family}");
    }

    // Two fit: the GPU request, the placement constraint and the EC2 sizes are what ECS got.
    let spec = {
        let mut s = spec;
        s.secrets.insert(
            "key.pem".into(),
            SecretValue::PerRank((0..2).map(|r| SecretBytes::new(key(r))).collect()),
        );
        s
    };
    backend.launch(&spec, 2).await.unwrap();
    // the failed launch's stopped tasks are still listed by ECS; list reports each rank's newest
    let listed = backend.list(&launch).await.unwrap();
    assert_eq!(
        listed.iter().map(|w| (w.rank, w.state)).collect::<Vec<_>>(),
        [(0, WorkerState::Running), (1, WorkerState::Running)]
    );
    let td = ecs_client
        .describe_task_definition()
        .task_definition(task::family(&launch, 1))
        .send()
        .await
        .unwrap();
    let td = td.task_definition().unwrap();
    assert_eq!(td.requires_compatibilities(), [ecs::Compatibility::Ec2]);
    // the task is the spec's size (what the instance registers room for); the worker gets all of it
    // but the secrets container's 64 MiB
    assert_eq!((td.cpu(), td.memory()), (Some("2048"), Some("2048")));
    let worker = td
        .container_definitions()
        .iter()
        .find(|c| c.name() == Some("worker"))
        .unwrap();
    assert_eq!((worker.cpu(), worker.memory()), (2048, Some(1984)));
    let gpu = &worker.resource_requirements()[0];
    assert_eq!((gpu.r#type(), gpu.value()), (&ecs::ResourceType::Gpu, "1"));
    assert_eq!(
        td.placement_constraints()[0].expression(),
        Some("attribute:ecs.instance-type == g5.xlarge")
    );
    let volume = &td.volumes()[0];
    let docker = volume.docker_volume_configuration().unwrap();
    assert_eq!(docker.scope(), Some(&ecs::Scope::Task));
    assert_eq!(
        docker
            .driver_opts()
            .unwrap()
            .get("type")
            .map(String::as_str),
        Some("tmpfs"),
        "on EC2 the secret files live in memory"
    );
    backend.stop_all(&launch).await.unwrap();
    assert_nothing_left(&leftovers(&sdk, &launch).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_on_fargate_are_refused_before_any_call() {
    // an endpoint nothing listens on: any call would fail with a connection error instead
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let sdk = sdk_for(&format!("http://127.0.0.1:{port}"), "k", "s").await;
    let backend = EcsBackend::new(
        EcsConfig::new(
            "physalia",
            vec!["subnet-1".into()],
            vec![],
            "arn:aws:iam::123456789012:role/x",
            "/physalia/workers",
        ),
        &sdk,
    )
    .unwrap();
    let mut spec = spec(1);
    spec.gpu = Some(GpuRequest {
        count: 1,
        kind: None,
    });
    let err = backend.launch(&spec, 1).await.unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    assert!(err.to_string().contains("Fargate has no GPUs"), "{err}");
    // A size Fargate does not sell is refused the same way.
    spec.gpu = None;
    spec.cpu = 32.0;
    let err = backend.launch(&spec, 1).await.unwrap_err();
    assert!(
        err.to_string().contains("larger than any Fargate task"),
        "{err}"
    );
    // And an unreachable endpoint is an error that says so.
    spec.cpu = 1.0;
    let err = backend.launch(&spec, 1).await.unwrap_err();
    assert!(err.to_string().contains("reachable"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttling_is_retried_then_reported() {
    let Some(moto) = Moto::start(&["--tasks-stay-running"]) else {
        return;
    };
    let sdk = moto.sdk().await;
    // two throttled RunTask calls, then through: the SDK's retries absorb them
    let proxy = proxy::Throttle::start(moto.endpoint(), "RunTask", 2).await;
    let backend = EcsBackend::new(
        moto.config(),
        &sdk_for(&proxy.url(), "testing", "testing").await,
    )
    .unwrap();
    let mut spec = spec(1);
    spec.secrets.remove("key.pem");
    let launch = LaunchId::new(&spec.job_id, spec.segment);
    backend.launch(&spec, 1).await.unwrap();
    assert_eq!(proxy.seen(), 3, "RunTask sent three times");
    backend.stop_all(&launch).await.unwrap();
    assert_nothing_left(&leftovers(&sdk, &launch).await);

    // always throttled: reported after max_attempts, and the secret and task definition are gone
    let proxy = proxy::Throttle::start(moto.endpoint(), "RunTask", u32::MAX).await;
    let backend = EcsBackend::new(
        moto.config(),
        &sdk_for(&proxy.url(), "testing", "testing").await,
    )
    .unwrap();
    spec.segment = 3;
    let launch = LaunchId::new(&spec.job_id, spec.segment);
    let err = backend.launch(&spec, 1).await.unwrap_err();
    match &err {
        Error::Throttled { attempts: 3, .. } => {}
        other => panic!("expected throttled after 3 attempts, got {other}"),
    }
    assert!(err.to_string().contains("ThrottlingException"), "{err}");
    assert_eq!(proxy.seen(), 3);
    assert_nothing_left(&leftovers(&sdk, &launch).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_credentials_and_missing_permissions() {
    let Some(moto) = Moto::start(&["--tasks-stay-running", "--enforce-auth"]) else {
        return;
    };
    let users = &moto.info["users"];
    let user = |name: &str| {
        (
            users[name]["key"].as_str().unwrap().to_string(),
            users[name]["secret"].as_str().unwrap().to_string(),
        )
    };
    let spec = spec(2);
    let launch = LaunchId::new(&spec.job_id, spec.segment);

    let bogus = sdk_for(&moto.endpoint(), "AKIAUNKNOWNUNKNOWN00", "nope").await;
    let err = EcsBackend::new(moto.config(), &bogus)
        .unwrap()
        .launch(&spec, 2)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Credentials { .. }), "{err}");
    assert!(err.to_string().contains("AWS credential chain"), "{err}");

    // allowed to create the secret, not to register the task definition: the secret is deleted again
    let (k, s) = user("no-register");
    let limited = sdk_for(&moto.endpoint(), &k, &s).await;
    let err = EcsBackend::new(moto.config(), &limited)
        .unwrap()
        .launch(&spec, 2)
        .await
        .unwrap_err();
    match &err {
        Error::Permission { action, hint, .. } => {
            assert!(action.contains("register task definition"), "{err}");
            assert!(hint.contains("infra/ecs"), "{err}");
        }
        other => panic!("expected permission denied, got {other}"),
    }
    let (k, s) = user("launcher");
    let admin = sdk_for(&moto.endpoint(), &k, &s).await;
    assert_nothing_left(&leftovers(&admin, &launch).await);

    // the launcher may do it all
    let backend = EcsBackend::new(moto.config(), &admin).unwrap();
    let launched = backend.launch(&spec, 2).await.unwrap();
    assert_eq!(launched.workers.len(), 2);
    backend.stop_all(&launch).await.unwrap();
    assert_nothing_left(&leftovers(&admin, &launch).await);
}

// ---------------------------------------------------------------------------------------------------
// The coordinator (cluster mode), preflight, credentials from the environment, the IAM policy
// ---------------------------------------------------------------------------------------------------

const COORDINATOR: &str = "physalia-products-1732000000-coordinator";

fn coordinator_spec() -> CoordinatorSpec {
    CoordinatorSpec {
        job_id: "products-1732000000".into(),
        image: "123456789012.dkr.ecr.us-east-1.amazonaws.com/physalia:0.1.0".into(),
        command: vec!["physalia".into(), "coordinate".into()],
        env: BTreeMap::from([("RUST_LOG".into(), "info".into())]),
        cpu: 1.0,
        memory_gib: 2.0,
        control_port: 7000,
        labels: BTreeMap::from([("physalia.dev/team".into(), "graphs".into())]),
    }
}

/// Revisions of the coordinator's family still registered or not yet deleted, and tasks running.
async fn coordinator_leftovers(sdk: &aws_config::SdkConfig) -> (Vec<String>, usize) {
    let ecs_client = aws_sdk_ecs::Client::new(sdk);
    let mut defs = Vec::new();
    for status in [
        ecs::TaskDefinitionStatus::Active,
        ecs::TaskDefinitionStatus::Inactive,
    ] {
        let got = ecs_client
            .list_task_definitions()
            .family_prefix(COORDINATOR)
            .status(status)
            .send()
            .await
            .unwrap();
        defs.extend(got.task_definition_arns().iter().cloned());
    }
    let running = ecs_client
        .list_tasks()
        .cluster("physalia")
        .desired_status(ecs::DesiredStatus::Running)
        .send()
        .await
        .unwrap()
        .task_arns()
        .len();
    (defs, running)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_runs_as_a_fargate_task_with_its_role_and_stop_leaves_nothing() {
    let Some(moto) = Moto::start(&["--tasks-stay-running"]) else {
        return;
    };
    let sdk = moto.sdk().await;
    let backend = moto.backend(moto.config()).await;
    let handle = backend
        .launch_coordinator(&coordinator_spec())
        .await
        .unwrap();
    assert_eq!(
        (handle.backend.as_str(), handle.scope.as_str()),
        ("ecs", "physalia")
    );
    let handle: physalia_backends::CoordinatorHandle =
        serde_json::from_str(&serde_json::to_string(&handle).unwrap()).unwrap();
    let task_arn = handle.object("task").unwrap().to_string();

    // what ECS was told, read back from it
    let ecs_client = aws_sdk_ecs::Client::new(&sdk);
    let td = ecs_client
        .describe_task_definition()
        .task_definition(handle.object("task-definition").unwrap())
        .send()
        .await
        .unwrap();
    let td = td.task_definition().unwrap();
    assert_eq!(td.family(), Some(COORDINATOR));
    assert_eq!(
        td.task_role_arn(),
        moto.info["coordinator_task_role_arn"].as_str()
    );
    assert_eq!(td.requires_compatibilities(), [ecs::Compatibility::Fargate]);
    assert_eq!(td.network_mode(), Some(&ecs::NetworkMode::Awsvpc));
    assert_eq!((td.cpu(), td.memory()), (Some("1024"), Some("2048")));
    let c = &td.container_definitions()[0];
    assert_eq!(c.name(), Some("coordinator"));
    assert!(c.secrets().is_empty(), "the coordinator gets no secret");
    assert_eq!(env_of(c)["RUST_LOG"], "info");
    assert_eq!(c.port_mappings()[0].container_port(), Some(7000));
    let log = c.log_configuration().unwrap();
    assert_eq!(
        log.options()
            .unwrap()
            .get("awslogs-stream-prefix")
            .map(String::as_str),
        Some("physalia")
    );
    let task = ecs_client
        .describe_tasks()
        .cluster("physalia")
        .tasks(&task_arn)
        .include(ecs::TaskField::Tags)
        .send()
        .await
        .unwrap();
    let task = &task.tasks()[0];
    assert_eq!(task.started_by(), Some(COORDINATOR));
    assert!(
        task.tags()
            .iter()
            .any(|t| t.key() == Some("physalia.dev/team"))
    );

    let status = backend.coordinator_status(&handle).await.unwrap();
    assert_eq!(status.state, WorkerState::Running, "{status:?}");
    assert!(status.ip.is_some(), "the task's ENI address");

    // logs: the awslogs stream physalia/coordinator/<task id>
    let logs = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    let stream = format!(
        "physalia/coordinator/{}",
        task_arn.rsplit('/').next().unwrap()
    );
    logs.create_log_stream()
        .log_group_name("/physalia/workers")
        .log_stream_name(&stream)
        .send()
        .await
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    logs.put_log_events()
        .log_group_name("/physalia/workers")
        .log_stream_name(&stream)
        .log_events(
            aws_sdk_cloudwatchlogs::types::InputLogEvent::builder()
                .timestamp(now)
                .message("job products-1732000000: 3 workers")
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(
        backend.coordinator_logs(&handle).await.unwrap(),
        "job products-1732000000: 3 workers\n"
    );

    backend.stop_coordinator(&handle).await.unwrap();
    assert_eq!(coordinator_leftovers(&sdk).await, (vec![], 0));
    let stopped = backend.coordinator_status(&handle).await.unwrap();
    assert_eq!(stopped.state, WorkerState::Failed, "{stopped:?}");
    assert!(
        stopped
            .detail
            .unwrap()
            .contains("physalia: coordinator stopped"),
        "ECS's stopped reason"
    );
    backend.stop_coordinator(&handle).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_coordinator_settings_are_refused_with_the_platforms_reason_and_leave_nothing() {
    let Some(moto) = Moto::start(&["--tasks-stay-running"]) else {
        return;
    };
    let sdk = moto.sdk().await;

    // an unknown cluster: DescribeClusters says MISSING, nothing is registered
    let mut cfg = moto.config();
    cfg.cluster = "no-such-cluster".into();
    let err = moto
        .backend(cfg)
        .await
        .launch_coordinator(&coordinator_spec())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("cluster no-such-cluster") && text.contains("MISSING"),
        "{text}"
    );
    assert!(text.contains("infra/ecs"), "{text}");
    assert_eq!(coordinator_leftovers(&sdk).await, (vec![], 0));

    // a subnet that does not exist: RunTask's refusal, the task definition deleted again
    let mut cfg = moto.config();
    cfg.subnets = vec!["subnet-0000dead".into()];
    let err = moto
        .backend(cfg)
        .await
        .launch_coordinator(&coordinator_spec())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("subnet-0000dead") && text.contains("does not exist"),
        "{text}"
    );
    assert_eq!(coordinator_leftovers(&sdk).await, (vec![], 0));
    // workers too: the secrets and task definitions made before RunTask refused are deleted
    let mut cfg = moto.config();
    cfg.subnets = vec!["subnet-0000dead".into()];
    let spec = spec(2);
    let err = moto.backend(cfg).await.launch(&spec, 2).await.unwrap_err();
    assert!(matches!(err, Error::Config { .. }), "{err}");
    assert!(err.to_string().contains("subnet-0000dead"), "{err}");
    assert_nothing_left(&leftovers(&sdk, &LaunchId::new(&spec.job_id, spec.segment)).await);

    // no coordinator role configured: refused before any call
    let mut cfg = moto.config();
    cfg.coordinator_task_role_arn = None;
    let err = moto
        .backend(cfg)
        .await
        .launch_coordinator(&coordinator_spec())
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("coordinator_task_role_arn is not set"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_an_unknown_cluster_and_gpus_on_fargate_before_anything_is_created() {
    let Some(moto) = Moto::start(&["--tasks-stay-running"]) else {
        return;
    };
    let sdk = moto.sdk().await;
    moto.backend(moto.config())
        .await
        .check(&spec(2), Demand::one(4.0))
        .await
        .unwrap();
    let mut cfg = moto.config();
    cfg.cluster = "no-such-cluster".into();
    let err = moto
        .backend(cfg)
        .await
        .check(&spec(2), Demand::one(4.0))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("DescribeClusters: MISSING"),
        "{err}"
    );
    let mut gpu = spec(2);
    gpu.gpu = Some(GpuRequest {
        count: 1,
        kind: None,
    });
    let err = moto
        .backend(moto.config())
        .await
        .check(&gpu, Demand::one(4.0))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("Fargate has no GPUs"), "{err}");
    assert_nothing_left(&leftovers(&sdk, &LaunchId::new("products-1732000000", 2)).await);
}

/// A GPU worker spec of the catalog's `ecs-g5.xlarge` SKU.
fn g5_spec(n: usize) -> WorkerSpec {
    let mut spec = spec(n);
    spec.cpu = 4.0;
    spec.memory_gib = 15.0;
    spec.gpu = Some(GpuRequest {
        count: 1,
        kind: Some("A10G".into()),
    });
    spec.instance_types = vec!["g5.xlarge".into()];
    spec
}

/// Quotas and capacity the account or cluster cannot give are refused in preflight with one line that
/// names the quota (its code, value and the job's need) or the capacity, and nothing is created: a new
/// account's G and VT quota of 0, Fargate's vCPU quota below the job's peak, a capacity provider the
/// cluster does not have, launch type EC2 on a cluster with no instance of the SKU's type. Within the
/// quota (the default, read through GetAWSDefaultServiceQuota when none is applied) it passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preflight_refuses_quotas_and_capacity_the_job_cannot_have() {
    let Some(moto) = Moto::start(&[
        "--tasks-stay-running",
        "--quota",
        "L-DB2E81BA=0",
        "--quota",
        "L-3032A538=4",
        "--capacity-provider",
        "FARGATE",
        "--capacity-provider",
        "physalia-gpu",
        "--container-instances",
        "1",
    ]) else {
        return;
    };
    let sdk = moto.sdk().await;
    let three = Demand {
        workers: 3,
        overlap_workers: 0,
        machine_vcpus: 4.0,
    };
    let gpu_on = |capacity: Capacity| {
        let mut cfg = moto.config();
        cfg.capacity = capacity;
        cfg
    };

    // G and VT: an applied quota of 0 vCPUs, three g5.xlarge workers need 12
    let backend = moto
        .backend(gpu_on(Capacity::Provider("physalia-gpu".into())))
        .await;
    let err = backend.check(&g5_spec(3), three).await.unwrap_err();
    let line = err.to_string();
    assert!(matches!(err, Error::Quota { rank: None, .. }), "{line}");
    assert!(!line.contains('\n'), "{line}");
    for want in [
        "\"Running On-Demand G and VT instances\" (ec2 L-DB2E81BA) in us-east-1 is 0 vCPUs",
        // the idle g5.xlarge takes one worker; it runs, so its 4 vCPUs count already
        "needs 8 at its peak (3 workers on g5.xlarge, 4 vCPUs each, less the 4 of idle instances \
         of that type) and 4 are in use now (1 container instance of cluster physalia in that \
         family): 12 in all",
        "--quota-code L-DB2E81BA --desired-value 12",
        "nothing was created",
    ] {
        assert!(line.contains(want), "{want:?} not in {line}");
    }

    // P instances: no applied value, so AWS's default (384 vCPUs) decides: 3 x 12 fits, 40 x 12 not
    let mut p4d = g5_spec(3);
    p4d.instance_types = vec!["p4d.24xlarge".into()];
    let share = |workers| Demand {
        workers,
        overlap_workers: 0,
        machine_vcpus: 12.0,
    };
    backend.check(&p4d, share(3)).await.unwrap();
    let err = backend.check(&p4d, share(40)).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("(ec2 L-417A185B) in us-east-1 is 384 vCPUs")
            && err.to_string().contains("needs 480"),
        "{err}"
    );

    // Fargate: 4 vCPUs applied; three 2-vCPU tasks need 6, two need 4
    let fargate = moto.backend(moto.config()).await;
    let err = fargate.check(&spec(3), three).await.unwrap_err();
    assert!(
        err.to_string().contains(
            "\"Fargate On-Demand vCPU resource count\" (fargate L-3032A538) in us-east-1 is 4 vCPUs"
        ) && err
            .to_string()
            .contains("3 Fargate workers of 2 vCPUs each"),
        "{err}"
    );
    fargate
        .check(
            &spec(2),
            Demand {
                workers: 2,
                overlap_workers: 0,
                machine_vcpus: 2.0,
            },
        )
        .await
        .unwrap();

    // a capacity provider the cluster does not have, named with the ones it has
    let err = moto
        .backend(gpu_on(Capacity::Provider("gpu-pool".into())))
        .await
        .check(&g5_spec(1), Demand::one(4.0))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains(
            "cluster physalia in us-east-1 has no capacity provider gpu-pool (its providers: \
             FARGATE, physalia-gpu)"
        ),
        "{err}"
    );

    // launch type EC2: the one registered instance is a g5.xlarge
    let ec2 = moto.backend(gpu_on(Capacity::Ec2)).await;
    let mut g6 = g5_spec(1);
    g6.instance_types = vec!["g6.xlarge".into()];
    let err = ec2.check(&g6, Demand::one(4.0)).await.unwrap_err();
    assert!(
        err.to_string().contains(
            "cluster physalia in us-east-1 has no container instance of type g6.xlarge (the \
             SKU's; it has g5.xlarge)"
        ),
        "{err}"
    );
    let err = ec2.check(&g5_spec(1), three).await.unwrap_err();
    assert!(err.to_string().contains("L-DB2E81BA"), "{err}");
    assert_nothing_left(&leftovers(&sdk, &LaunchId::new("products-1732000000", 2)).await);

    // within every quota and capacity: through
    let Some(roomy) = Moto::start(&["--tasks-stay-running", "--container-instances", "1"]) else {
        return;
    };
    let mut cfg = roomy.config();
    cfg.capacity = Capacity::Ec2;
    roomy
        .backend(cfg)
        .await
        .check(&g5_spec(3), three)
        .await
        .unwrap();
    // and an EC2 cluster with no instance at all says so
    let Some(empty) = Moto::start(&["--tasks-stay-running"]) else {
        return;
    };
    let mut cfg = empty.config();
    cfg.capacity = Capacity::Ec2;
    let err = empty
        .backend(cfg)
        .await
        .check(&g5_spec(1), Demand::one(4.0))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains(
            "has no registered container instances, and launch type EC2 places tasks only on those"
        ),
        "{err}"
    );
}

/// The quota counts what already runs, as far as ECS shows it (issue 30): a job that fits the quota
/// alone is refused beside another job's running Fargate tasks, or beside the busy g5.xlarge container
/// instances of the cluster (idle ones of its type take its first workers), and a scaling policy's
/// prewarmed launch counts with the launch it replaces. Nothing of the refused job is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preflight_counts_running_tasks_instances_and_a_prewarmed_launch_against_the_quota() {
    let Some(moto) = Moto::start(&["--tasks-stay-running", "--quota", "L-3032A538=8"]) else {
        return;
    };
    let sdk = moto.sdk().await;
    let backend = moto.backend(moto.config()).await;
    let fargate = |workers, overlap_workers| Demand {
        workers,
        overlap_workers,
        machine_vcpus: 2.0,
    };
    // alone: three 2-vCPU tasks in a quota of 8
    backend.check(&spec(3), fargate(3, 0)).await.unwrap();

    // another job's two 2-vCPU workers run in the cluster
    let mut other = spec(2);
    other.job_id = "graphs-1732000000".into();
    let other_launch = LaunchId::new(&other.job_id, other.segment);
    backend.launch(&other, 2).await.unwrap();
    let err = backend.check(&spec(3), fargate(3, 0)).await.unwrap_err();
    let line = err.to_string();
    assert!(matches!(err, Error::Quota { rank: None, .. }), "{line}");
    assert!(!line.contains('\n'), "{line}");
    for want in [
        "\"Fargate On-Demand vCPU resource count\" (fargate L-3032A538) in us-east-1 is 8 vCPUs",
        "needs 6 at its peak (3 Fargate workers of 2 vCPUs each) and 4 are in use now (2 tasks of \
         cluster physalia on Fargate): 10 in all",
        "--quota-code L-3032A538 --desired-value 10",
        "nothing was created",
    ] {
        assert!(line.contains(want), "{want:?} not in {line}");
    }
    // two workers still fit beside them
    backend.check(&spec(2), fargate(2, 0)).await.unwrap();
    // stopped tasks hold nothing: the job fits again, but not with a prewarmed launch of 3 beside 2
    backend.stop_all(&other_launch).await.unwrap();
    backend.check(&spec(3), fargate(3, 0)).await.unwrap();
    let err = backend.check(&spec(3), fargate(3, 2)).await.unwrap_err();
    assert!(
        err.to_string().contains(
            "is 8 vCPUs and this job needs 10 at its peak (5 Fargate workers of 2 vCPUs each; a \
             prewarmed launch of 3 beside 2 still running); "
        ),
        "{err}"
    );
    backend.check(&spec(2), fargate(2, 1)).await.unwrap();
    assert_nothing_left(&leftovers(&sdk, &LaunchId::new("products-1732000000", 2)).await);

    // EC2: two registered g5.xlarge (4 vCPUs each) under a G and VT quota of 8
    let Some(moto) = Moto::start(&[
        "--tasks-stay-running",
        "--container-instances",
        "2",
        "--quota",
        "L-DB2E81BA=8",
    ]) else {
        return;
    };
    let mut cfg = moto.config();
    cfg.capacity = Capacity::Ec2;
    let backend = moto.backend(cfg).await;
    let g5 = |workers, overlap_workers| Demand {
        workers,
        overlap_workers,
        machine_vcpus: 4.0,
    };
    // both idle: two workers take them, no instance starts, 8 vCPUs at the peak
    backend.check(&g5_spec(2), g5(2, 0)).await.unwrap();
    // a prewarmed launch would start a third
    let err = backend.check(&g5_spec(2), g5(2, 1)).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("and 8 are in use now (2 container instances of cluster physalia in that family): 12 in all"),
        "{err}"
    );
    // one of them gets another job's worker: only one is left idle
    let mut busy = g5_spec(1);
    busy.job_id = "graphs-1732000000".into();
    busy.memory_gib = 2.0; // what moto's instances register room for
    backend.launch(&busy, 1).await.unwrap();
    let err = backend.check(&g5_spec(2), g5(2, 0)).await.unwrap_err();
    assert!(
        err.to_string().contains(
            "needs 4 at its peak (2 workers on g5.xlarge, 4 vCPUs each, less the 4 of idle \
             instances of that type) and 8 are in use now (2 container instances of cluster \
             physalia in that family): 12 in all"
        ),
        "{err}"
    );
    backend.check(&g5_spec(1), g5(1, 0)).await.unwrap();
    backend
        .stop_all(&LaunchId::new(&busy.job_id, busy.segment))
        .await
        .unwrap();
}

/// Runs this test binary's `from_env_child` with exactly `env` (no inherited AWS settings, no profile
/// files) and returns what it printed. A child that runs for over two minutes is killed: the credential
/// chain must not hang.
fn run_child(args: &Value) -> String {
    let home = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "from_env_child",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env_clear()
    .env("PATH", std::env::var_os("PATH").unwrap_or_default())
    .env("HOME", home.path())
    .env("AWS_CONFIG_FILE", home.path().join("none"))
    .env("AWS_SHARED_CREDENTIALS_FILE", home.path().join("none"))
    .env("PHYSALIA_ECS_CHILD", args.to_string())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for (k, v) in args["env"].as_object().unwrap() {
        cmd.env(k, v.as_str().unwrap());
    }
    let mut child = cmd.spawn().unwrap();
    let started = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("the child hung");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The child half of [`from_env_reads_the_endpoint_and_keys_from_the_environment`]: builds the backend
/// with `EcsBackend::from_env` and prints what happened.
#[tokio::test]
#[ignore = "run by its parent test with a prepared environment"]
async fn from_env_child() {
    let Ok(args) = std::env::var("PHYSALIA_ECS_CHILD") else {
        return;
    };
    let args: Value = serde_json::from_str(&args).unwrap();
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect()
    };
    let mut cfg = EcsConfig::new(
        "physalia",
        strings(&args["subnets"]),
        strings(&args["security_groups"]),
        args["execution_role_arn"].as_str().unwrap(),
        "/physalia/workers",
    );
    cfg.coordinator_task_role_arn = args["coordinator_task_role_arn"].as_str().map(String::from);
    cfg.poll_interval = Duration::from_millis(20);
    cfg.max_attempts = 1;
    match EcsBackend::from_env(cfg, None).await {
        Err(e) => println!("FROM_ENV ERROR: {e}"),
        Ok(backend) => {
            backend.check(&spec(1), Demand::one(4.0)).await.unwrap();
            let handle = backend
                .launch_coordinator(&coordinator_spec())
                .await
                .unwrap();
            backend.stop_coordinator(&handle).await.unwrap();
            println!("FROM_ENV OK");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_env_reads_the_endpoint_and_keys_from_the_environment() {
    let Some(moto) = Moto::start(&["--tasks-stay-running"]) else {
        return;
    };
    let mut args = moto.info.clone();
    args["env"] = serde_json::json!({
        "AWS_ENDPOINT_URL": moto.endpoint(),
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    });
    let out = run_child(&args);
    assert!(out.contains("FROM_ENV OK"), "{out}");

    // No credentials anywhere, and an instance-metadata endpoint that accepts connections and never
    // answers: a credentials error with the hint, not a hang.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let imds = format!("http://{}", silent.local_addr().unwrap());
    args["env"] = serde_json::json!({
        "AWS_ENDPOINT_URL": moto.endpoint(),
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds,
    });
    let out = run_child(&args);
    drop(silent);
    assert!(
        out.contains("FROM_ENV ERROR: ecs: the platform refused the credentials"),
        "{out}"
    );
    assert!(
        out.contains("aws configure") && out.contains("AWS_PROFILE"),
        "{out}"
    );
    let sdk = moto.sdk().await;
    assert_eq!(coordinator_leftovers(&sdk).await, (vec![], 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_credentials_are_refused_with_a_hint() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let sdk = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new("us-east-1"))
        .endpoint_url(format!("http://127.0.0.1:{port}"))
        .credentials_provider(aws_sdk_ecs::config::Credentials::new(
            "ASIAEXPIREDEXPIRED00",
            "s",
            Some("session".into()),
            Some(std::time::SystemTime::now() - Duration::from_secs(600)),
            "test",
        ))
        .load()
        .await;
    let backend = EcsBackend::new(
        EcsConfig::new(
            "physalia",
            vec!["subnet-1".into()],
            vec![],
            "arn:aws:iam::123456789012:role/x",
            "/physalia/workers",
        ),
        &sdk,
    )
    .unwrap();
    let err = backend.check(&spec(1), Demand::one(4.0)).await.unwrap_err();
    assert!(matches!(err, Error::Credentials { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("expired") && text.contains("aws configure"),
        "{text}"
    );
    assert!(!text.contains("ASIAEXPIREDEXPIRED00"), "{text}");
}

/// `actions = [...]` of every statement of `data "aws_iam_policy_document" "<name>"` in `tf`, and the
/// resources of the statement granting `iam:PassRole`.
fn policy_actions(tf: &str, name: &str) -> (std::collections::BTreeSet<String>, Vec<String>) {
    let start = tf
        .find(&format!("data \"aws_iam_policy_document\" \"{name}\" {{"))
        .unwrap_or_else(|| panic!("no policy document {name}"));
    // the block ends at the first line that is exactly "}"
    let body = &tf[start..];
    let end = body.find("\n}\n").unwrap();
    let body = &body[..end];
    let list = |text: &str| -> Vec<String> {
        text.split(',')
            .map(|s| s.trim().trim_matches('"').to_string())
            .filter(|s| !s.is_empty())
            .collect()
    };
    let mut actions = std::collections::BTreeSet::new();
    let mut pass_role = Vec::new();
    for statement in body.split("statement {").skip(1) {
        let field = |key: &str| -> Vec<String> {
            let Some(at) = statement.find(&format!("{key} ")) else {
                return Vec::new();
            };
            let rest = &statement[at..];
            let open = rest.find('[').unwrap();
            let close = rest.find(']').unwrap();
            list(&rest[open + 1..close])
        };
        let acts = field("actions");
        if acts.iter().any(|a| a == "iam:PassRole") {
            pass_role = field("resources");
        }
        actions.extend(acts);
    }
    (actions, pass_role)
}

/// infra/ecs's coordinator policy grants exactly the calls a coordinator makes: a whole worker job
/// (preflight, launch, list, logs, stop, stop all) through a recording proxy, plus the authorization-only
/// actions those calls imply (tagging at creation, passing the worker roles), and passes exactly the
/// roles the task definitions name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_policy_grants_exactly_the_calls_the_backend_makes() {
    let Some(moto) = Moto::start(&["--tasks-stay-running"]) else {
        return;
    };
    let proxy = proxy::Throttle::start(moto.endpoint(), "", 0).await;
    let mut cfg = moto.config();
    cfg.task_role_arn = Some("arn:aws:iam::123456789012:role/physalia-worker".into());
    let backend = EcsBackend::new(cfg, &sdk_for(&proxy.url(), "testing", "testing").await).unwrap();
    let spec = spec(2);
    let launch = LaunchId::new(&spec.job_id, spec.segment);
    backend.check(&spec, Demand::one(4.0)).await.unwrap();
    backend.launch(&spec, 2).await.unwrap();
    backend.list(&launch).await.unwrap();
    backend.logs(&launch, 0).await.unwrap();
    backend.stop(&launch, 1).await.unwrap();
    backend.stop_all(&launch).await.unwrap();
    let mut called = proxy.actions();
    // authorization-only actions: tags sent with RegisterTaskDefinition, RunTask and CreateSecret, and
    // the execution and task roles named in each task definition
    called.extend(
        [
            "ecs:TagResource",
            "secretsmanager:TagResource",
            "iam:PassRole",
        ]
        .map(String::from),
    );
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../infra/ecs");
    let tf = std::fs::read_to_string(root.join("main.tf")).unwrap();
    let (granted, passed) = policy_actions(&tf, "coordinator");
    let missing: Vec<_> = called.difference(&granted).collect();
    let extra: Vec<_> = granted.difference(&called).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "called but not granted: {missing:?}\ngranted but never called: {extra:?}"
    );
    // PassRole names exactly the roles behind the two EcsConfig fields a worker task definition uses
    // (infra/ecs's outputs have the fields' names)
    let outputs = std::fs::read_to_string(root.join("outputs.tf")).unwrap();
    let output = |name: &str| -> String {
        let at = outputs
            .find(&format!("output \"{name}\" {{"))
            .unwrap_or_else(|| panic!("no output {name}"));
        let rest = &outputs[at..];
        let v = rest.find("value").unwrap();
        let line = rest[v..].lines().next().unwrap();
        line.split('=').nth(1).unwrap().trim().to_string()
    };
    let mut want = vec![output("execution_role_arn"), output("task_role_arn")];
    want.sort();
    let mut passed = passed;
    passed.sort();
    assert_eq!(passed, want);
}

/// infra/ecs's submitter policy (output submitter_policy_json) grants exactly the calls a cluster-mode
/// `physalia submit` makes of ECS on the user's credentials: the preflight (Fargate, and launch type
/// EC2's container instances), the coordinator's task started, watched, its log read and stopped,
/// through a recording proxy, plus the authorization-only actions (tagging at creation, passing the
/// coordinator's execution and task roles); and the job store's actions as the coordinator's store
/// policy has them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_submitter_policy_grants_exactly_the_calls_a_submission_makes() {
    let Some(moto) = Moto::start(&["--tasks-stay-running", "--container-instances", "1"]) else {
        return;
    };
    let proxy = proxy::Throttle::start(moto.endpoint(), "", 0).await;
    let sdk = sdk_for(&proxy.url(), "testing", "testing").await;
    let backend = EcsBackend::new(moto.config(), &sdk).unwrap();
    backend.check(&spec(2), Demand::one(2.0)).await.unwrap();
    let mut ec2 = moto.config();
    ec2.capacity = Capacity::Ec2;
    EcsBackend::new(ec2, &sdk)
        .unwrap()
        .check(&g5_spec(2), Demand::one(4.0))
        .await
        .unwrap();
    let handle = backend
        .launch_coordinator(&coordinator_spec())
        .await
        .unwrap();
    backend.coordinator_status(&handle).await.unwrap();
    backend.coordinator_logs(&handle).await.unwrap();
    backend.stop_coordinator(&handle).await.unwrap();
    let mut called = proxy.actions();
    called.extend(["ecs:TagResource", "iam:PassRole"].map(String::from));

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../infra/ecs");
    let tf = std::fs::read_to_string(root.join("main.tf")).unwrap();
    let (granted, passed) = policy_actions(&tf, "submitter");
    let (store, _) = policy_actions(&tf, "coordinator_store");
    let granted_calls: std::collections::BTreeSet<String> = granted
        .iter()
        .filter(|a| !a.starts_with("s3:"))
        .cloned()
        .collect();
    let missing: Vec<_> = called.difference(&granted_calls).collect();
    let extra: Vec<_> = granted_calls.difference(&called).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "called but not granted: {missing:?}\ngranted but never called: {extra:?}"
    );
    // the user writes the store as the coordinator does: the submitter's document includes the
    // store's (its statements are the store's and no other s3 action)
    let submitter = &tf[tf
        .find("data \"aws_iam_policy_document\" \"submitter\" {")
        .unwrap()..];
    let submitter = &submitter[..submitter.find("\n}\n").unwrap()];
    assert!(
        submitter.contains(
            "source_policy_documents = [data.aws_iam_policy_document.coordinator_store.json]"
        ),
        "the user writes the store as the coordinator does"
    );
    assert!(granted.iter().all(|a| !a.starts_with("s3:")), "{granted:?}");
    assert!(store.contains("s3:PutObject"), "{store:?}");
    let mut passed = passed;
    passed.sort();
    assert_eq!(
        passed,
        ["aws_iam_role.coordinator.arn", "aws_iam_role.execution.arn"]
    );
    let outputs = std::fs::read_to_string(root.join("outputs.tf")).unwrap();
    assert!(
        outputs.contains("value       = data.aws_iam_policy_document.submitter.json"),
        "no submitter_policy_json output"
    );
}

/// infra/ecs gives the coordinator role the job store: list the bucket, and read, write (in one request
/// or in parts), delete and abort uploads of its objects (what orchestrator/src/store.rs does through
/// object_store), in a policy of its own; the outputs name the store as `output.dir` takes it.
#[test]
fn the_coordinator_role_reads_and_writes_the_job_store() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../infra/ecs");
    let tf = std::fs::read_to_string(root.join("main.tf")).unwrap();
    let (granted, passed) = policy_actions(&tf, "coordinator_store");
    let want: std::collections::BTreeSet<String> = [
        "s3:ListBucket",
        "s3:GetObject",
        "s3:PutObject",
        "s3:DeleteObject",
        "s3:AbortMultipartUpload",
    ]
    .map(String::from)
    .into();
    assert_eq!(granted, want);
    assert!(passed.is_empty(), "the store policy passes no role");
    let attached = tf
        .find("resource \"aws_iam_role_policy\" \"coordinator_store\"")
        .map(|at| &tf[at..at + tf[at..].find("\n}\n").unwrap()])
        .expect("the store policy is attached");
    assert!(
        attached.contains("aws_iam_role.coordinator.id")
            && attached.contains("data.aws_iam_policy_document.coordinator_store.json"),
        "{attached}"
    );
    let outputs = std::fs::read_to_string(root.join("outputs.tf")).unwrap();
    assert!(
        outputs.contains("value       = \"s3://${aws_s3_bucket.jobs.bucket}/jobs\""),
        "no job_store output"
    );
}
