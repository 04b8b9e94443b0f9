//! The kubernetes backend against a fake API server (kube-rs's `tower_test` mock pattern), and every object
//! it sends, plus `infra/k8s/`, validated against the Kubernetes OpenAPI schemas with `kubernetes-validate`.

mod fake_api;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fake_api::{FakeApi, NS, PodState, Script};
use physalia_backends::kubernetes::{
    KubernetesBackend, KubernetesConfig, coordinator_job, launch_objects,
};
use physalia_backends::{
    Backend, CoordinatorSpec, Demand, Error, GpuRequest, LaunchId, NetworkSpec, SecretBytes,
    SecretValue, WorkerSpec, WorkerState,
};
use serde_json::{Value, json};

const CA: &str = "-----BEGIN CERTIFICATE-----\nCA-CERT\n-----END CERTIFICATE-----\n";

fn key(rank: usize) -> String {
    format!("-----BEGIN PRIVATE KEY-----\nKEY-OF-RANK-{rank}\n-----END PRIVATE KEY-----\n")
}

fn spec(n: usize) -> WorkerSpec {
    WorkerSpec {
        job_id: "cora-1732000000".into(),
        segment: 0,
        image: "ghcr.io/physalia/worker:0.1.0".into(),
        command: vec!["physalia-worker".into()],
        cpu: 2.0,
        memory_gib: 7.5,
        gpu: None,
        instance_types: Vec::new(),
        env: BTreeMap::from([("RAYON_NUM_THREADS".into(), "2".into())]),
        secrets: BTreeMap::from([
            ("ca.pem".into(), SecretValue::Same(SecretBytes::new(CA))),
            (
                "cert.pem".into(),
                SecretValue::PerRank(
                    (0..n)
                        .map(|r| SecretBytes::new(format!("CERT-{r}")))
                        .collect(),
                ),
            ),
            (
                "key.pem".into(),
                SecretValue::PerRank((0..n).map(|r| SecretBytes::new(key(r))).collect()),
            ),
        ]),
        network: NetworkSpec {
            coordinator_addr: "10.244.0.5:7000".into(),
            mesh_port: 7100,
        },
    }
}

fn gpu_spec(n: usize) -> WorkerSpec {
    WorkerSpec {
        gpu: Some(GpuRequest {
            count: 1,
            kind: Some("NVIDIA-H100-80GB-HBM3".into()),
        }),
        ..spec(n)
    }
}

fn config() -> KubernetesConfig {
    KubernetesConfig {
        namespace: NS.into(),
        poll_interval: Duration::from_millis(1),
        start_timeout: Duration::from_secs(5),
        ..KubernetesConfig::default()
    }
}

fn backend(script: Script) -> (KubernetesBackend, FakeApi) {
    let (client, fake) = FakeApi::start(script);
    (KubernetesBackend::new(client, config()), fake)
}

const NAME: &str = "physalia-cora-1732000000-s0";

fn all_objects() -> Vec<String> {
    vec![
        format!("jobs/{NAME}"),
        format!("secrets/{NAME}"),
        format!("services/{NAME}"),
    ]
}

/// Everything the launch created was deleted, and nothing is left.
fn assert_cleaned_up(fake: &FakeApi) {
    let rec = fake.record();
    assert!(!rec.created.is_empty());
    for c in &rec.created {
        assert!(
            rec.deleted.contains(c),
            "{c} was created and never deleted: {:?}",
            rec.deleted
        );
    }
    assert!(rec.live.is_empty(), "left behind: {:?}", rec.live.keys());
    assert!(rec.unexpected.is_empty(), "{:?}", rec.unexpected);
}

#[tokio::test]
async fn launch_creates_a_suspended_indexed_job_and_resumes_it_once_its_secret_exists() {
    let (backend, fake) = backend(Script::default());
    let launched = backend.launch(&spec(3), 3).await.unwrap();

    assert_eq!(launched.id, LaunchId::new("cora-1732000000", 0));
    let ranks: Vec<_> = launched.workers.iter().map(|w| (w.rank, w.state)).collect();
    assert_eq!(
        ranks,
        [
            (0, WorkerState::Running),
            (1, WorkerState::Running),
            (2, WorkerState::Running)
        ]
    );
    assert_eq!(launched.workers[1].ip, Some("10.244.1.11".parse().unwrap()));
    assert_eq!(
        launched.workers[1].dns_name.as_deref(),
        Some(format!("{NAME}-1.{NAME}.{NS}.svc").as_str())
    );

    let rec = fake.record();
    assert_eq!(
        rec.created,
        all_objects(),
        "Job first, then Secret and Service"
    );
    let job = &rec.bodies[0];
    assert_eq!(job["spec"]["suspend"], json!(true));
    assert_eq!(job["spec"]["completionMode"], "Indexed");
    assert_eq!(job["spec"]["completions"], 3);
    assert_eq!(job["spec"]["parallelism"], 3);
    assert_eq!(job["spec"]["backoffLimitPerIndex"], 0);
    // a server before 1.29 drops backoffLimitPerIndex: no more replacement pods than ranks
    assert_eq!(job["spec"]["backoffLimit"], 3);
    // The Secret and the Service belong to the Job, by its uid.
    let job_uid = rec.live[&format!("jobs/{NAME}")]["metadata"]["uid"].clone();
    for dependant in &rec.bodies[1..] {
        let owner = &dependant["metadata"]["ownerReferences"][0];
        assert_eq!(
            (owner["kind"].as_str(), &owner["uid"]),
            (Some("Job"), &job_uid)
        );
    }
    // Resumed only after both exist.
    let resume = rec
        .requests
        .iter()
        .position(|r| r.starts_with("PATCH"))
        .unwrap();
    let last_create = rec
        .requests
        .iter()
        .rposition(|r| r.starts_with("POST"))
        .unwrap();
    assert!(resume > last_create, "{:?}", rec.requests);
    assert_eq!(
        rec.patches,
        [(NAME.to_string(), json!({"spec": {"suspend": false}}))]
    );

    // Rank from the completion index; the rank's own folder of the Secret mounted as the secrets dir.
    let pod = &job["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let env: BTreeMap<&str, &Value> = c["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap(), e))
        .collect();
    assert_eq!(
        env["PHYSALIA_RANK"]["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    );
    assert_eq!(
        env["PHYSALIA_SECRETS_DIR"]["value"],
        "/var/run/physalia/secrets"
    );
    assert_eq!(env["PHYSALIA_WORLD"]["value"], "3");
    assert_eq!(env["PHYSALIA_COORDINATOR_ADDR"]["value"], "10.244.0.5:7000");
    assert_eq!(c["volumeMounts"][0]["subPathExpr"], "$(PHYSALIA_RANK)");
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert_eq!(pod["subdomain"], NAME);
    let items = pod["volumes"][0]["secret"]["items"].as_array().unwrap();
    let paths: Vec<(&str, &str)> = items
        .iter()
        .map(|i| (i["key"].as_str().unwrap(), i["path"].as_str().unwrap()))
        .collect();
    assert!(
        paths.contains(&("rank-1.key.pem", "1/key.pem")),
        "{paths:?}"
    );
    assert!(paths.contains(&("shared.ca.pem", "2/ca.pem")), "{paths:?}");

    // The keys travel only in the Secret.
    let secret = &rec.bodies[1];
    assert_eq!(secret["kind"], "Secret");
    let b64 = |s: &str| {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(s)
    };
    assert_eq!(secret["data"]["rank-2.key.pem"], json!(b64(&key(2))));
    for other in [&rec.bodies[0], &rec.bodies[2]] {
        let text = other.to_string();
        assert!(
            !text.contains("KEY-OF-RANK") && !text.contains(&b64(&key(0))),
            "{text}"
        );
    }
    assert!(rec.deleted.is_empty());
}

#[tokio::test]
async fn gpu_workers_get_nvidia_limits_a_product_selector_and_the_gpu_toleration() {
    let (backend, fake) = backend(Script::default());
    backend.launch(&gpu_spec(2), 2).await.unwrap();
    let rec = fake.record();
    let pod = &rec.bodies[0]["spec"]["template"]["spec"];
    let res = &pod["containers"][0]["resources"];
    assert_eq!(res["limits"]["nvidia.com/gpu"], "1");
    assert_eq!(res["requests"]["nvidia.com/gpu"], "1");
    assert_eq!(res["requests"]["cpu"], "2000m");
    assert_eq!(res["requests"]["memory"], "7680Mi");
    assert_eq!(
        pod["nodeSelector"]["nvidia.com/gpu.product"],
        "NVIDIA-H100-80GB-HBM3"
    );
    assert_eq!(pod["tolerations"][0]["key"], "nvidia.com/gpu");
}

#[tokio::test]
async fn an_image_pull_failure_at_the_third_of_four_workers_deletes_everything() {
    let script = Script {
        pods: Box::new(|poll, rank| match (poll, rank) {
            (0, _) => PodState::Pending,
            (_, 2) => PodState::ImagePull("manifest unknown: ghcr.io/physalia/worker:0.1.0"),
            (_, 3) => PodState::Pending,
            _ => PodState::Running,
        }),
        ..Script::default()
    };
    let (backend, fake) = backend(script);
    let err = backend.launch(&spec(4), 4).await.unwrap_err();
    match &err {
        Error::ImageMissing {
            image,
            rank,
            detail,
            ..
        } => {
            assert_eq!(
                (image.as_str(), *rank),
                ("ghcr.io/physalia/worker:0.1.0", 2)
            );
            assert!(
                detail.contains("ErrImagePull: manifest unknown"),
                "{detail}"
            );
        }
        other => panic!("wanted ImageMissing, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "kubernetes: image ghcr.io/physalia/worker:0.1.0 could not be pulled for worker 2: \
         ErrImagePull: manifest unknown: ghcr.io/physalia/worker:0.1.0"
    );
    assert_eq!(fake.record().created, all_objects());
    assert_cleaned_up(&fake);
}

#[tokio::test]
async fn a_quota_refusing_the_fourth_pod_is_a_quota_error_and_deletes_everything() {
    let refusal = "pods \"physalia-cora-1732000000-s0-3-abcde\" is forbidden: exceeded quota: \
                   gpu-quota, requested: requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=3, \
                   limited: requests.nvidia.com/gpu=3";
    let script = Script {
        pods: Box::new(|_, rank| {
            if rank == 3 {
                PodState::Absent
            } else {
                PodState::Running
            }
        }),
        events: vec![json!({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": "e1", "namespace": NS},
            "involvedObject": {"kind": "Job", "name": NAME, "namespace": NS},
            "reason": "FailedCreate", "type": "Warning", "message": refusal
        })],
        ..Script::default()
    };
    let (backend, fake) = backend(script);
    let err = backend.launch(&gpu_spec(4), 4).await.unwrap_err();
    assert!(
        matches!(&err, Error::Quota { rank: Some(3), detail, .. } if detail == refusal),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .starts_with("kubernetes: quota exceeded launching worker 3: pods")
    );
    assert_cleaned_up(&fake);
    let rec = fake.record();
    let events = rec
        .requests
        .iter()
        .find(|r| r.contains("/events?"))
        .unwrap();
    assert!(
        events.contains("fieldSelector=involvedObject.kind%3DJob%2CinvolvedObject.name%3Dphysalia"),
        "{events}"
    );
}

#[tokio::test]
async fn a_failed_pod_names_its_rank_and_exit_code() {
    let script = Script {
        pods: Box::new(|_, rank| {
            if rank == 1 {
                PodState::Failed(3)
            } else {
                PodState::Running
            }
        }),
        ..Script::default()
    };
    let (backend, fake) = backend(script);
    let err = backend.launch(&spec(2), 2).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "kubernetes: worker 1 failed to start: exit code 3 (Error)"
    );
    assert_cleaned_up(&fake);
}

#[tokio::test]
async fn an_unschedulable_worker_times_out_naming_the_rank_and_the_schedulers_reason() {
    let script = Script {
        pods: Box::new(|_, rank| {
            if rank == 1 {
                PodState::Unschedulable("0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
            } else {
                PodState::Running
            }
        }),
        ..Script::default()
    };
    let (client, fake) = FakeApi::start(script);
    let cfg = KubernetesConfig {
        start_timeout: Duration::from_millis(50),
        ..config()
    };
    let err = KubernetesBackend::new(client, cfg)
        .launch(&gpu_spec(2), 2)
        .await
        .unwrap_err();
    assert!(
        err.to_string().starts_with(
            "kubernetes: gave up after 0 s waiting for workers 1 (Unschedulable: 0/3 nodes are \
             available: 3 Insufficient nvidia.com/gpu.) to start"
        ),
        "{err}"
    );
    assert_cleaned_up(&fake);
}

#[tokio::test]
async fn bad_credentials_are_a_credentials_error_and_create_nothing() {
    let script = Script {
        refuse_create: Some(("jobs", 401, "Unauthorized", "Unauthorized".into())),
        ..Script::default()
    };
    let (backend, fake) = backend(script);
    let err = backend.launch(&spec(2), 2).await.unwrap_err();
    assert!(matches!(err, Error::Credentials { .. }), "{err:?}");
    assert!(err.to_string().contains("kubectl auth whoami"), "{err}");
    let rec = fake.record();
    assert!(rec.created.is_empty() && rec.deleted.is_empty());
    assert!(
        !rec.requests.iter().any(|r| r.starts_with("DELETE")),
        "{:?}",
        rec.requests
    );
}

#[tokio::test]
async fn a_forbidden_secret_points_to_the_rbac_and_deletes_the_job() {
    let message = "secrets is forbidden: User \"system:serviceaccount:physalia:default\" cannot \
                   create resource \"secrets\" in API group \"\" in the namespace \"physalia\"";
    let script = Script {
        refuse_create: Some(("secrets", 403, "Forbidden", message.into())),
        ..Script::default()
    };
    let (backend, fake) = backend(script);
    let err = backend.launch(&spec(2), 2).await.unwrap_err();
    assert!(matches!(err, Error::Permission { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("create secrets in namespace physalia"),
        "{text}"
    );
    assert!(text.contains("infra/k8s/rbac.yaml"), "{text}");
    assert_eq!(fake.record().created, [format!("jobs/{NAME}")]);
    assert_cleaned_up(&fake);
}

#[tokio::test]
async fn a_quota_on_jobs_refuses_the_create_with_a_quota_error() {
    let message = "jobs.batch \"x\" is forbidden: exceeded quota: jobs, requested: count/jobs.batch=1, \
                   used: count/jobs.batch=10, limited: count/jobs.batch=10";
    let script = Script {
        refuse_create: Some(("jobs", 403, "Forbidden", message.into())),
        ..Script::default()
    };
    let (backend, fake) = backend(script);
    let err = backend.launch(&spec(2), 2).await.unwrap_err();
    assert!(
        matches!(&err, Error::Quota { detail, .. } if detail == message),
        "{err:?}"
    );
    assert!(fake.record().created.is_empty());
}

#[tokio::test]
async fn launching_the_same_segment_twice_deletes_nothing_of_the_first() {
    let (backend, fake) = backend(Script::default());
    backend.launch(&spec(2), 2).await.unwrap();
    let err = backend.launch(&spec(2), 2).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "kubernetes: jobs.batch/{NAME} in namespace physalia already exists; stop that launch \
             first or use a new segment"
        )
    );
    let rec = fake.record();
    assert!(rec.deleted.is_empty(), "{:?}", rec.deleted);
    assert_eq!(rec.live.len(), 3);
}

#[tokio::test]
async fn list_stop_logs_and_stop_all() {
    let (backend, fake) = backend(Script::default());
    let launched = backend.launch(&spec(2), 2).await.unwrap();
    let id = &launched.id;

    let listed = backend.list(id).await.unwrap();
    assert_eq!(listed, launched.workers);

    let logs = backend.logs(id, 1).await.unwrap();
    assert_eq!(logs, format!("log of {NAME}-1-x7k2p\n"));

    backend.stop(id, 1).await.unwrap();
    assert!(
        fake.record()
            .deleted
            .contains(&format!("pods/{NAME}-1-x7k2p"))
    );
    let after: Vec<usize> = backend
        .list(id)
        .await
        .unwrap()
        .iter()
        .map(|w| w.rank)
        .collect();
    assert_eq!(after, [0]);
    assert!(matches!(
        backend.logs(id, 1).await,
        Err(Error::NoSuchWorker { rank: 1, .. })
    ));

    backend.stop_all(id).await.unwrap();
    assert_cleaned_up(&fake);
    // Stopping again finds nothing and is fine.
    backend.stop(id, 1).await.unwrap();
    backend.stop_all(id).await.unwrap();
}

// ---------------------------------------------------------------------------------------------------
// Schema validation and golden objects
// ---------------------------------------------------------------------------------------------------

/// The Kubernetes versions every object must validate against: the oldest supported and the newest
/// schemas `kubernetes-validate` ships.
const K8S_VERSIONS: [&str; 2] = ["1.30.0", "1.37.0"];

/// Whether `kubernetes-validate` runs here. Where it is missing the schema tests say so and pass, unless
/// `PHYSALIA_REQUIRE_K8S_VALIDATE=1` (CI sets it) makes that a failure.
fn validator_available() -> bool {
    let found = match Command::new("kubernetes-validate")
        .arg("--version")
        .output()
    {
        Ok(out) => out.status.success(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => panic!("running kubernetes-validate: {e}"),
    };
    if !found {
        if std::env::var("PHYSALIA_REQUIRE_K8S_VALIDATE").as_deref() == Ok("1") {
            panic!("kubernetes-validate is required here: pip install kubernetes-validate");
        }
        println!("skipping: kubernetes-validate not installed (pip install kubernetes-validate)");
    }
    found
}

/// Runs `kubernetes-validate --strict` over `files` for every version in [`K8S_VERSIONS`].
fn validate(files: &[PathBuf]) {
    for version in K8S_VERSIONS {
        let out = Command::new("kubernetes-validate")
            .args(["--strict", "--no-warn", "-k", version])
            .args(files)
            .output()
            .expect("running kubernetes-validate");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "kubernetes {version}:\n{text}");
        assert!(!text.contains("ERROR"), "kubernetes {version}:\n{text}");
    }
}

fn infra_manifests() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../infra/k8s");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 2, "{files:?}");
    files
}

/// Every object a launch sends (as sent, owner references included: the worker Job's to the
/// coordinator's Job, the Secret's and Service's to the worker Job) and every manifest under
/// `infra/k8s/` validates against the Kubernetes 1.30 and 1.37 OpenAPI schemas, strictly (no unknown
/// fields).
#[tokio::test]
async fn every_generated_object_and_infra_manifest_validates_against_the_kubernetes_schemas() {
    if !validator_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut files = infra_manifests();
    for (label, n, spec) in [("cpu", 3, spec(3)), ("gpu", 4, gpu_spec(4))] {
        let (backend, fake) = backend(Script::default());
        // the coordinator's Job, as sent, then a launch of the workers it owns
        backend
            .launch_coordinator(&coordinator_spec())
            .await
            .unwrap();
        backend.launch(&spec, n).await.unwrap();
        let worker_job = fake.record().bodies[1].clone();
        assert_eq!(
            worker_job["metadata"]["ownerReferences"][0]["name"], COORDINATOR,
            "{worker_job}"
        );
        for (i, body) in fake.record().bodies.iter().enumerate() {
            let path = dir.path().join(format!("{label}-{i}.json"));
            std::fs::write(&path, serde_json::to_vec_pretty(body).unwrap()).unwrap();
            files.push(path);
        }
    }
    validate(&files);
}

/// The validator has teeth: a misspelt field and a wrong type are refused.
#[test]
fn the_schema_check_refuses_a_bad_object() {
    if !validator_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let bad = [
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
               "spec": {"clusterIp": "None"}}),
        json!({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
               "spec": {"completions": "3", "template": {"spec": {"containers": []}}}}),
    ];
    for (i, obj) in bad.iter().enumerate() {
        let path = dir.path().join(format!("bad-{i}.json"));
        std::fs::write(&path, obj.to_string()).unwrap();
        let out = Command::new("kubernetes-validate")
            .args(["--strict", "-k", "1.30.0"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{obj} was accepted");
    }
}

/// The coordinator's Job, as sent, against a golden file (`BLESS=1` rewrites it).
#[test]
fn golden_coordinator_job() {
    let actual = serde_json::to_string_pretty(&coordinator_job(&config(), &coordinator_spec()))
        .unwrap()
        + "\n";
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kubernetes/golden/coordinator.json");
    if std::env::var("BLESS").as_deref() == Ok("1") {
        std::fs::write(&path, &actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with BLESS=1 to create it)", path.display()));
    assert_eq!(expected, actual, "BLESS=1 rewrites {}", path.display());
}

/// The objects of a GPU launch, as they would be sent (before the Job's uid exists), against a golden
/// file. `BLESS=1 cargo test -p physalia-backends` rewrites it after a deliberate change.
#[test]
fn golden_launch_objects() {
    let objects = launch_objects(&config(), &gpu_spec(2), 2).unwrap();
    let actual = serde_json::to_string_pretty(&json!({
        "job": objects.job,
        "service": objects.service,
        "secret": objects.secret,
    }))
    .unwrap()
        + "\n";
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kubernetes/golden/launch-gpu.json");
    if std::env::var("BLESS").as_deref() == Ok("1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with BLESS=1 to create it)", path.display()));
    assert_eq!(
        expected,
        actual,
        "generated objects changed; BLESS=1 rewrites {}",
        path.display()
    );
}

// ---------------------------------------------------------------------------------------------------
// The coordinator (cluster mode)
// ---------------------------------------------------------------------------------------------------

const COORDINATOR: &str = "physalia-cora-1732000000-coordinator";

fn coordinator_spec() -> CoordinatorSpec {
    CoordinatorSpec {
        job_id: "cora-1732000000".into(),
        image: "ghcr.io/physalia/physalia:0.1.0".into(),
        command: vec![
            "physalia".into(),
            "coordinate".into(),
            "cora-1732000000".into(),
        ],
        env: BTreeMap::from([("RUST_LOG".into(), "info".into())]),
        cpu: 1.0,
        memory_gib: 2.0,
        control_port: 7000,
        labels: BTreeMap::from([("physalia.dev/team".into(), "graphs".into())]),
    }
}

#[tokio::test]
async fn the_coordinator_is_a_job_under_its_service_account_and_stop_deletes_it() {
    let (backend, fake) = backend(Script::default());
    let handle = backend
        .launch_coordinator(&coordinator_spec())
        .await
        .unwrap();
    assert_eq!(handle.backend, "kubernetes");
    assert_eq!(handle.scope, NS);
    assert_eq!(handle.object("job.batch"), Some(COORDINATOR));
    // plain data: the job store keeps it, another process reads it back
    let handle: physalia_backends::CoordinatorHandle =
        serde_json::from_str(&serde_json::to_string(&handle).unwrap()).unwrap();
    {
        let rec = fake.record();
        assert_eq!(rec.created, [format!("jobs/{COORDINATOR}")]);
        let job = &rec.bodies[0];
        assert_eq!(job["spec"]["backoffLimit"], 0);
        assert_eq!(job["spec"]["ttlSecondsAfterFinished"], 3600);
        let pod = &job["spec"]["template"]["spec"];
        assert_eq!(pod["serviceAccountName"], "physalia-coordinator");
        assert_eq!(pod["restartPolicy"], "Never");
        let c = &pod["containers"][0];
        assert_eq!(c["image"], "ghcr.io/physalia/physalia:0.1.0");
        assert_eq!(c["resources"]["requests"]["cpu"], "1000m");
        assert_eq!(c["resources"]["limits"]["memory"], "2048Mi");
        assert_eq!(c["ports"][0]["containerPort"], 7000);
        assert_eq!(c["ports"][0]["protocol"], "UDP");
        assert_eq!(job["metadata"]["labels"]["physalia.dev/team"], "graphs");
        assert_eq!(
            job["spec"]["template"]["metadata"]["labels"]["physalia.dev/coordinator"],
            COORDINATOR
        );
        // no secret anywhere: no Secret object, no secret volume, no env from a Secret
        let text = job.to_string();
        assert!(
            !text.contains("secretKeyRef") && !text.contains("\"secret\""),
            "{text}"
        );
        assert!(pod["volumes"].is_null(), "{pod}");
        let env: Vec<&str> = c["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        assert_eq!(env, ["PHYSALIA_ADVERTISE_IP", "RUST_LOG"]);
    }

    let status = backend.coordinator_status(&handle).await.unwrap();
    assert_eq!(status.state, WorkerState::Running);
    assert_eq!(status.ip, Some("10.244.0.5".parse().unwrap()));
    assert_eq!(
        backend.coordinator_logs(&handle).await.unwrap(),
        format!("log of {COORDINATOR}-c0d3r\n")
    );
    assert!(
        fake.record().requests.iter().any(|r| r.contains(&format!(
            "pods/{COORDINATOR}-c0d3r/log?&container=coordinator"
        )) || r.contains(&format!(
            "pods/{COORDINATOR}-c0d3r/log?container=coordinator"
        ))),
        "{:?}",
        fake.record().requests
    );

    backend.stop_coordinator(&handle).await.unwrap();
    assert_cleaned_up(&fake);
    let gone = backend.coordinator_status(&handle).await.unwrap();
    assert_eq!(gone.state, WorkerState::Unknown, "{gone:?}");
    assert!(gone.detail.unwrap().contains("no longer exists"));
    // stopping again is fine
    backend.stop_coordinator(&handle).await.unwrap();
}

/// Issue 30: in cluster mode each worker Job carries an owner reference to the coordinator's Job (its
/// uid, read at launch), so deleting the coordinator's Job garbage-collects every launch it made: their
/// Jobs, and through those their pods, Secrets and Services. In client mode, where no coordinator's Job
/// exists, the worker Job has no owner.
#[tokio::test]
async fn worker_jobs_are_owned_by_the_coordinators_job_and_collected_with_it() {
    let (backend, fake) = backend(Script::default());
    // client mode
    let launched = backend.launch(&spec(2), 2).await.unwrap();
    assert!(
        fake.record().bodies[0]["metadata"]["ownerReferences"].is_null(),
        "{}",
        fake.record().bodies[0]
    );
    backend.stop_all(&launched.id).await.unwrap();

    // cluster mode: the coordinator's Job runs, and launches segments 1 and 2
    let handle = backend
        .launch_coordinator(&coordinator_spec())
        .await
        .unwrap();
    let coordinator_uid =
        fake.record().live[&format!("jobs/{COORDINATOR}")]["metadata"]["uid"].clone();
    let mut names = Vec::new();
    for segment in [1, 2] {
        let mut s = spec(2);
        s.segment = segment;
        let launched = backend.launch(&s, 2).await.unwrap();
        names.push(launched.id.base_name());
    }
    {
        let rec = fake.record();
        for name in &names {
            let job = &rec.live[&format!("jobs/{name}")];
            assert_eq!(
                job["metadata"]["ownerReferences"],
                json!([{"apiVersion": "batch/v1", "kind": "Job", "name": COORDINATOR,
                        "uid": coordinator_uid, "controller": false}]),
                "{job}"
            );
            // the worker Job's own dependants are still its own
            let uid = &job["metadata"]["uid"];
            for kind in ["secrets", "services"] {
                let owners = &rec.live[&format!("{kind}/{name}")]["metadata"]["ownerReferences"];
                assert_eq!(&owners[0]["uid"], uid, "{kind}/{name}");
            }
        }
    }
    // deleting the coordinator's Job takes everything with it
    backend.stop_coordinator(&handle).await.unwrap();
    let rec = fake.record();
    assert!(rec.live.is_empty(), "left behind: {:?}", rec.live.keys());
    for name in &names {
        for kind in ["jobs", "secrets", "services"] {
            assert!(
                rec.deleted.contains(&format!("{kind}/{name}")),
                "{kind}/{name}: {:?}",
                rec.deleted
            );
        }
    }
    assert!(rec.unexpected.is_empty(), "{:?}", rec.unexpected);
}

#[tokio::test]
async fn a_coordinator_image_that_cannot_be_pulled_fails_the_launch_and_deletes_its_job() {
    let script = Script {
        coordinator: Box::new(|poll| {
            if poll == 0 {
                PodState::Pending
            } else {
                PodState::ImagePull("manifest unknown: ghcr.io/physalia/physalia:0.1.0")
            }
        }),
        ..Script::default()
    };
    let (backend, fake) = backend(script);
    let err = backend
        .launch_coordinator(&coordinator_spec())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::CoordinatorFailed { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "kubernetes: the coordinator could not start: image ghcr.io/physalia/physalia:0.1.0 could \
         not be pulled: ErrImagePull: manifest unknown: ghcr.io/physalia/physalia:0.1.0"
    );
    assert_cleaned_up(&fake);
}

#[tokio::test]
async fn a_missing_namespace_refuses_the_coordinator_and_creates_nothing() {
    let script = Script {
        refuse_create: Some((
            "jobs",
            404,
            "NotFound",
            "namespaces \"physalia\" not found".into(),
        )),
        ..Script::default()
    };
    let (backend, fake) = backend(script);
    let err = backend
        .launch_coordinator(&coordinator_spec())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config { .. }), "{err:?}");
    assert!(
        err.to_string().contains("infra/k8s/namespace.yaml"),
        "{err}"
    );
    assert!(fake.record().created.is_empty());
}

#[tokio::test]
async fn check_reports_refused_credentials_before_anything_is_created() {
    let (backend, fake) = backend(Script::default());
    backend.check(&spec(2), Demand::one(4.0)).await.unwrap();
    assert!(fake.record().created.is_empty());
    // a kube client whose every answer is 401
    let (service, mut handle) = tower_test::mock::pair::<
        http::Request<kube::client::Body>,
        http::Response<kube::client::Body>,
    >();
    tokio::spawn(async move {
        while let Some((_, send)) = handle.next_request().await {
            let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                "status": "Failure", "message": "Unauthorized", "reason": "Unauthorized", "code": 401});
            send.send_response(
                http::Response::builder()
                    .status(401)
                    .header("content-type", "application/json")
                    .body(kube::client::Body::from(serde_json::to_vec(&body).unwrap()))
                    .unwrap(),
            );
        }
    });
    let backend = KubernetesBackend::new(kube::Client::new(service, NS), config());
    let err = backend.check(&spec(2), Demand::one(4.0)).await.unwrap_err();
    assert!(matches!(err, Error::Credentials { .. }), "{err:?}");
    assert!(err.to_string().contains("kubectl auth whoami"), "{err}");
}

/// A node as GKE, EKS or AKS label it: the well-known instance type, the distribution's labels, and
/// `nvidia.com/gpu` allocatable where the device plugin runs.
fn node(name: &str, instance_type: &str, gpus: u32, labels: &[(&str, &str)]) -> Value {
    let mut all = serde_json::Map::new();
    all.insert(
        "node.kubernetes.io/instance-type".into(),
        instance_type.into(),
    );
    for (k, v) in labels {
        all.insert((*k).into(), (*v).into());
    }
    let mut alloc = json!({"cpu": "7910m", "memory": "29022Mi", "pods": "110"});
    if gpus > 0 {
        alloc["nvidia.com/gpu"] = gpus.to_string().into();
    }
    json!({"metadata": {"name": name, "labels": all}, "status": {"allocatable": alloc}})
}

/// The preflight refuses a worker no node of the cluster can take (no node of the SKU's instance type,
/// the type's nodes lacking the configured labels, GPU nodes with no `nvidia.com/gpu` allocatable) in
/// one line that names what was looked for and what the cluster has; nothing is created. Pools that
/// scale from zero, and a principal that may not list nodes, are not refused.
#[tokio::test]
async fn check_refuses_a_node_type_no_node_has() {
    let gke = vec![
        node(
            "gke-l4-0",
            "g2-standard-8",
            1,
            &[("cloud.google.com/gke-accelerator", "nvidia-l4")],
        ),
        node(
            "gke-l4-1",
            "g2-standard-8",
            1,
            &[("cloud.google.com/gke-accelerator", "nvidia-l4")],
        ),
        node("gke-cpu-0", "n2-standard-8", 0, &[]),
    ];
    let gpu_spec = |ty: &str| {
        let mut s = spec(2);
        s.gpu = Some(GpuRequest {
            count: 1,
            kind: Some("L4".into()),
        });
        s.instance_types = vec![ty.into()];
        s
    };
    let with = |nodes: Option<Vec<Value>>, cfg: KubernetesConfig| {
        let (client, fake) = FakeApi::start(Script {
            nodes,
            ..Script::default()
        });
        (KubernetesBackend::new(client, cfg), fake)
    };

    let (b, fake) = with(Some(gke.clone()), config());
    b.check(&gpu_spec("g2-standard-8"), Demand::one(8.0))
        .await
        .unwrap();
    let err = b
        .check(&gpu_spec("a2-highgpu-1g"), Demand::one(12.0))
        .await
        .unwrap_err();
    let line = err.to_string();
    assert!(matches!(err, Error::Config { .. }), "{line}");
    assert!(!line.contains('\n'), "{line}");
    for want in [
        "no node of the cluster has node.kubernetes.io/instance-type a2-highgpu-1g",
        "(its nodes: g2-standard-8 x2, n2-standard-8 x1)",
        "backend.kubernetes.scales_from_zero: true",
        "nothing was created",
    ] {
        assert!(line.contains(want), "{want:?} not in {line}");
    }
    assert!(fake.record().created.is_empty());

    // the type exists, but not with the section's node_selector
    let mut cfg = config();
    cfg.node_selector = BTreeMap::from([(
        "cloud.google.com/gke-accelerator".to_string(),
        "nvidia-h100-80gb".to_string(),
    )]);
    let (b, _) = with(Some(gke.clone()), cfg);
    let err = b
        .check(&gpu_spec("g2-standard-8"), Demand::one(8.0))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains(
            "no node of the cluster has node.kubernetes.io/instance-type g2-standard-8, \
             cloud.google.com/gke-accelerator=nvidia-h100-80gb"
        ),
        "{err}"
    );

    // GPU nodes of the type without the device plugin's resource
    let bare = vec![node("eks-a10g-0", "g5.xlarge", 0, &[])];
    let (b, _) = with(Some(bare), config());
    let err = b
        .check(&gpu_spec("g5.xlarge"), Demand::one(4.0))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("offer no nvidia.com/gpu x1 (allocatable): install NVIDIA's device plugin"),
        "{err}"
    );
    // a CPU worker on a CPU type is placed; on a missing one it is refused
    let mut cpu = spec(2);
    cpu.instance_types = vec!["n2-standard-8".into()];
    let (b, _) = with(Some(gke.clone()), config());
    b.check(&cpu, Demand::one(8.0)).await.unwrap();
    cpu.instance_types = vec!["e2-standard-4".into()];
    assert!(b.check(&cpu, Demand::one(4.0)).await.is_err());

    // pools that scale from zero, and no permission to list nodes: not refused
    let mut cfg = config();
    cfg.scales_from_zero = true;
    let (b, _) = with(Some(gke), cfg);
    b.check(&gpu_spec("a2-highgpu-1g"), Demand::one(12.0))
        .await
        .unwrap();
    let (b, fake) = with(None, config());
    b.check(&gpu_spec("a2-highgpu-1g"), Demand::one(12.0))
        .await
        .unwrap();
    assert!(
        fake.record()
            .requests
            .iter()
            .any(|r| r.starts_with("GET /api/v1/nodes")),
        "the preflight asked for the nodes"
    );
}

/// `node(..)` with taints (`key`, `value`, `effect`) on it, as a distribution's GPU pool has them.
fn tainted(mut node: Value, taints: &[(&str, &str, &str)]) -> Value {
    node["spec"]["taints"] = taints
        .iter()
        .map(|(key, value, effect)| json!({"key": key, "value": value, "effect": effect}))
        .collect();
    node
}

/// GKE's L4 pool (tainted `nvidia.com/gpu=present:NoSchedule`, as GKE taints every GPU pool) and an
/// AKS T4 pool tainted `sku=gpu:NoSchedule` (AKS's documented set-up for GPU pools), three nodes each.
fn gke_and_aks_gpu_pools() -> Vec<Value> {
    let gke = (0..3).map(|i| {
        tainted(
            node(
                &format!("gke-l4-{i}"),
                "g2-standard-8",
                1,
                &[("cloud.google.com/gke-accelerator", "nvidia-l4")],
            ),
            &[("nvidia.com/gpu", "present", "NoSchedule")],
        )
    });
    let aks = (0..3).map(|i| {
        tainted(
            node(
                &format!("aks-t4-{i}"),
                "Standard_NC4as_T4_v3",
                1,
                &[("kubernetes.azure.com/accelerator", "nvidia")],
            ),
            &[("sku", "gpu", "NoSchedule")],
        )
    });
    gke.chain(aks).collect()
}

/// A GPU worker of `instance_type`.
fn gpu_on(instance_type: &str, n: usize) -> WorkerSpec {
    let mut s = gpu_spec(n);
    s.gpu = Some(GpuRequest {
        count: 1,
        kind: None,
    });
    s.instance_types = vec![instance_type.into()];
    s
}

/// Issue 30: a GPU pool tainted against pods that do not tolerate it. The fake cluster's scheduler
/// refuses such a pod as kube-scheduler does (it stays Pending, Unschedulable, naming the taint, and
/// the launch gives up after its timeout), and the preflight refuses the job first, in one line naming
/// the taint and the job file's `backend.kubernetes.tolerations` entry that tolerates it. GPU pods
/// tolerate GKE's `nvidia.com/gpu` taint on their own; AKS's `sku=gpu` takes the job file's toleration.
#[tokio::test]
async fn a_gpu_pool_tainted_against_the_workers_is_refused_before_anything_is_created() {
    let with = |nodes: Vec<Value>, cfg: KubernetesConfig| {
        let (client, fake) = FakeApi::start(Script {
            nodes: Some(nodes),
            ..Script::default()
        });
        (KubernetesBackend::new(client, cfg), fake)
    };
    let short = || KubernetesConfig {
        start_timeout: Duration::from_millis(50),
        ..config()
    };

    // GKE: the pods' own toleration matches the pool's taint; placed and running
    let (b, _) = with(gke_and_aks_gpu_pools(), short());
    let gke = gpu_on("g2-standard-8", 2);
    b.check(&gke, Demand::one(8.0)).await.unwrap();
    b.launch(&gke, 2).await.unwrap();

    // AKS without the toleration: the preflight says why and creates nothing
    let aks = gpu_on("Standard_NC4as_T4_v3", 2);
    let (b, fake) = with(gke_and_aks_gpu_pools(), short());
    let err = b.check(&aks, Demand::one(4.0)).await.unwrap_err();
    let line = err.to_string();
    assert!(matches!(err, Error::Config { .. }), "{line}");
    assert!(!line.contains('\n'), "{line}");
    for want in [
        "every node of the cluster with node.kubernetes.io/instance-type Standard_NC4as_T4_v3 (3)",
        "carries a taint the worker pods do not tolerate (sku=gpu:NoSchedule on 3)",
        "add {key: sku, value: gpu, effect: NoSchedule} to the job file's \
         backend.kubernetes.tolerations",
        "nothing was created",
    ] {
        assert!(line.contains(want), "{want:?} not in {line}");
    }
    assert!(fake.record().created.is_empty());
    // and the launch the preflight spares the user: the fake scheduler keeps every pod Pending
    let err = b.launch(&aks, 2).await.unwrap_err();
    assert!(
        err.to_string().contains(
            "waiting for workers 0 (Unschedulable: 0/6 nodes are available: 3 node(s) didn't match \
             Pod's node affinity/selector, 3 node(s) had untolerated taint {sku: gpu}.), 1 \
             (Unschedulable:"
        ),
        "{err}"
    );
    assert_cleaned_up(&fake);

    // with the job file's toleration: through, and placed
    let mut cfg = short();
    cfg.tolerations = vec![physalia_backends::kubernetes::toleration(
        "sku",
        None,
        Some("gpu"),
        Some("NoSchedule"),
    )];
    let (b, _) = with(gke_and_aks_gpu_pools(), cfg.clone());
    b.check(&aks, Demand::one(4.0)).await.unwrap();
    b.launch(&aks, 2).await.unwrap();
    // a toleration of another value does not tolerate it; Exists tolerates any value
    let mut wrong = short();
    wrong.tolerations = vec![physalia_backends::kubernetes::toleration(
        "sku",
        None,
        Some("cpu"),
        Some("NoSchedule"),
    )];
    let (b, _) = with(gke_and_aks_gpu_pools(), wrong);
    let err = b.check(&aks, Demand::one(4.0)).await.unwrap_err();
    assert!(
        err.to_string().contains("(beside the ones it has)"),
        "{err}"
    );
    let mut exists = short();
    exists.tolerations = vec![physalia_backends::kubernetes::toleration(
        "sku",
        Some("Exists"),
        None,
        None,
    )];
    let (b, _) = with(gke_and_aks_gpu_pools(), exists);
    b.check(&aks, Demand::one(4.0)).await.unwrap();

    // NoExecute repels too; PreferNoSchedule only steers, and one untainted node is enough
    let pool = |effects: &[&str]| -> Vec<Value> {
        effects
            .iter()
            .enumerate()
            .map(|(i, effect)| {
                let n = node(&format!("eks-a10g-{i}"), "g5.xlarge", 1, &[]);
                if effect.is_empty() {
                    n
                } else {
                    tainted(n, &[("dedicated", "ml", effect)])
                }
            })
            .collect()
    };
    let eks = gpu_on("g5.xlarge", 1);
    let (b, _) = with(pool(&["NoExecute", "NoSchedule"]), config());
    let err = b.check(&eks, Demand::one(4.0)).await.unwrap_err();
    assert!(
        err.to_string().contains(
            "(dedicated=ml:NoExecute on 1, dedicated=ml:NoSchedule on 1), so they would stay \
             Pending: add {key: dedicated, value: ml, effect: NoExecute} and {key: dedicated, value: \
             ml, effect: NoSchedule}"
        ),
        "{err}"
    );
    let (b, _) = with(pool(&["PreferNoSchedule"]), config());
    b.check(&eks, Demand::one(4.0)).await.unwrap();
    let (b, _) = with(pool(&["NoSchedule", ""]), config());
    b.check(&eks, Demand::one(4.0)).await.unwrap();

    // a CPU worker sent to GKE's GPU machines does not tolerate their taint
    let mut cpu = spec(1);
    cpu.instance_types = vec!["g2-standard-8".into()];
    let (b, _) = with(gke_and_aks_gpu_pools(), config());
    let err = b.check(&cpu, Demand::one(8.0)).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("add {key: nvidia.com/gpu, value: present, effect: NoSchedule}"),
        "{err}"
    );
}

/// The fake cluster of `tests/kubernetes/kube_cluster.py` (the whole-job scenarios' API server) schedules
/// the pods this backend makes as kube-scheduler would, over its GKE-, EKS- and AKS-shaped GPU pools:
/// each pod of `launch_objects` (sized to fit the pool's allocatable) is placed on its own pool where it
/// tolerates the pool's taint, and stays Pending, Unschedulable, naming the taint, where it does not
/// (AKS's `sku=gpu` without the job file's toleration).
#[test]
fn the_fake_clusters_scheduler_places_the_backends_pods_only_where_they_tolerate_the_taints() {
    let python_ok = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !python_ok {
        if physalia_testkit::python_required() {
            panic!("python3 is required here");
        }
        println!("skipping: no python3");
        return;
    }
    let aks_toleration =
        physalia_backends::kubernetes::toleration("sku", None, Some("gpu"), Some("NoSchedule"));
    let cases = [
        ("gke", "g2-standard-8", 7.5, 27.0, Vec::new()),
        ("eks", "g5.xlarge", 3.5, 13.5, Vec::new()),
        ("aks", "Standard_NC4as_T4_v3", 3.5, 21.0, Vec::new()),
        (
            "aks-tolerated",
            "Standard_NC4as_T4_v3",
            3.5,
            21.0,
            vec![aks_toleration],
        ),
    ];
    let mut pods = serde_json::Map::new();
    for (name, ty, cpu, memory_gib, tolerations) in cases {
        let mut s = gpu_on(ty, 1);
        s.cpu = cpu;
        s.memory_gib = memory_gib;
        let cfg = KubernetesConfig {
            tolerations,
            ..config()
        };
        let job = launch_objects(&cfg, &s, 1).unwrap().job;
        let template = serde_json::to_value(job.spec.unwrap().template).unwrap();
        pods.insert(name.into(), template["spec"].clone());
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/kubernetes");
    let placed = physalia_testkit::python(&format!(
        r#"import json, sys, threading
        sys.path.insert(0, {root:?})
        import kube_cluster as k
        # the scheduler alone: no Docker, no API server
        c = k.Cluster.__new__(k.Cluster)
        c.lock, c.objects, c.version = threading.RLock(), {{}}, 0
        out = {{}}
        for name, spec in json.loads({pods:?}).items():
            pod = {{"metadata": {{"name": name}}, "spec": spec, "status": {{"phase": "Pending"}}}}
            bound = c.schedule(("physalia", "pods", name), pod)
            cond = pod["status"]["conditions"][0]
            out[name] = [bound, pod["spec"].get("nodeName"), cond.get("reason"), cond.get("message")]
        print(json.dumps(out))"#,
        root = root.display().to_string(),
        pods = Value::Object(pods).to_string(),
    ));
    let node_of = |name: &str| placed[name][1].as_str().unwrap_or("").to_string();
    assert!(node_of("gke").starts_with("gke-l4-"), "{placed}");
    assert!(node_of("eks").starts_with("eks-a10g-"), "{placed}");
    assert!(node_of("aks-tolerated").starts_with("aks-t4-"), "{placed}");
    assert_eq!(placed["aks"][0], json!(false), "{placed}");
    assert_eq!(placed["aks"][2], "Unschedulable", "{placed}");
    assert!(
        placed["aks"][3]
            .as_str()
            .unwrap()
            .contains("3 node(s) had untolerated taint {sku: gpu}"),
        "{placed}"
    );
}

// ---------------------------------------------------------------------------------------------------
// RBAC: the Role grants exactly what the code calls
// ---------------------------------------------------------------------------------------------------

/// `(apiGroup, resource, verb)` triples of the Role named `physalia-coordinator` in `rbac.yaml`, and
/// whether a RoleBinding binds it to the ServiceAccount of that name. The file keeps each rule's lists
/// in flow style (`verbs: ["create", "delete"]`); this reads that form and refuses any other.
fn role_rules(yaml: &str) -> (std::collections::BTreeSet<(String, String, String)>, bool) {
    let flow = |line: &str, key: &str| -> Option<Vec<String>> {
        let rest = line.trim().trim_start_matches("- ").strip_prefix(key)?;
        let rest = rest.trim().strip_prefix('[')?.strip_suffix(']')?;
        Some(
            rest.split(',')
                .map(|s| s.trim().trim_matches('"').to_string())
                .filter(|s| !s.is_empty() || rest.trim() == "\"\"")
                .collect(),
        )
    };
    let mut rules = std::collections::BTreeSet::new();
    let mut bound = false;
    for doc in yaml.split("\n---") {
        if doc.contains("\nkind: RoleBinding") {
            bound = doc.contains("  kind: Role\n  name: physalia-coordinator")
                && doc.contains("  - kind: ServiceAccount\n    name: physalia-coordinator");
            continue;
        }
        if !doc.contains("\nkind: Role\n") {
            continue;
        }
        assert!(doc.contains("\n  name: physalia-coordinator\n"), "{doc}");
        let body = doc.split("\nrules:\n").nth(1).expect("the Role has rules");
        let mut groups = Vec::new();
        let mut resources = Vec::new();
        let mut flush = |g: &[String], r: &[String], v: &[String]| {
            for g in g {
                for r in r {
                    for v in v {
                        rules.insert((g.clone(), r.clone(), v.clone()));
                    }
                }
            }
        };
        for line in body.lines().filter(|l| !l.trim().is_empty()) {
            if let Some(g) = flow(line, "apiGroups:") {
                groups = g;
            } else if let Some(r) = flow(line, "resources:") {
                resources = r;
            } else if let Some(v) = flow(line, "verbs:") {
                flush(&groups, &resources, &v);
            } else {
                panic!("rbac.yaml: a rule line this test cannot read: {line:?}");
            }
        }
    }
    (rules, bound)
}

/// Every API call a whole job makes (a worker launch, list, logs, stop, stop all; a launch refused by a
/// quota; the coordinator's launch, status, logs and stop; the preflight) is allowed by the Role in
/// `infra/k8s/rbac.yaml`, and the Role allows nothing else.
#[tokio::test]
async fn the_role_grants_exactly_the_verbs_the_backend_calls() {
    let mut called = std::collections::BTreeSet::new();
    {
        // the happy path, with the coordinator's pod absent at first (events are read then)
        let script = Script {
            coordinator: Box::new(|poll| match poll {
                0 => PodState::Absent,
                _ => PodState::Running,
            }),
            ..Script::default()
        };
        let (backend, fake) = backend(script);
        backend.check(&spec(2), Demand::one(4.0)).await.unwrap();
        let handle = backend
            .launch_coordinator(&coordinator_spec())
            .await
            .unwrap();
        backend.coordinator_status(&handle).await.unwrap();
        backend.coordinator_logs(&handle).await.unwrap();
        let launched = backend.launch(&spec(2), 2).await.unwrap();
        backend.list(&launched.id).await.unwrap();
        backend.logs(&launched.id, 0).await.unwrap();
        backend.stop(&launched.id, 1).await.unwrap();
        backend.stop_all(&launched.id).await.unwrap();
        backend.stop_coordinator(&handle).await.unwrap();
        backend.coordinator_status(&handle).await.unwrap();
        let rec = fake.record();
        assert!(rec.unexpected.is_empty(), "{:?}", rec.unexpected);
        called.extend(rec.access.iter().cloned());
    }
    {
        // a launch a quota refuses: the Job controller's events are read
        let script = Script {
            pods: Box::new(|_, rank| {
                if rank == 1 {
                    PodState::Absent
                } else {
                    PodState::Running
                }
            }),
            events: vec![json!({
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"name": "e1", "namespace": NS},
                "involvedObject": {"kind": "Job", "name": NAME, "namespace": NS},
                "reason": "FailedCreate", "type": "Warning", "message": "exceeded quota: q"
            })],
            ..Script::default()
        };
        let (backend, fake) = backend(script);
        backend.launch(&spec(2), 2).await.unwrap_err();
        called.extend(fake.record().access.iter().cloned());
    }
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../infra/k8s/rbac.yaml");
    let (granted, bound) = role_rules(&std::fs::read_to_string(&path).unwrap());
    let missing: Vec<_> = called.difference(&granted).collect();
    let extra: Vec<_> = granted.difference(&called).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "called but not granted: {missing:?}\ngranted but never called: {extra:?}"
    );
    assert!(
        bound,
        "rbac.yaml binds the Role to ServiceAccount physalia-coordinator"
    );
    assert_eq!(
        KubernetesConfig::default().coordinator_service_account,
        "physalia-coordinator"
    );
}

/// `backend.kubernetes.context` picks that context's cluster from the kubeconfig, not the current one; a context the kubeconfig lacks is refused naming those it has.
#[tokio::test]
async fn a_named_context_is_used_and_an_unknown_one_is_refused() {
    let kubeconfig = kube::config::Kubeconfig::from_yaml(
        "apiVersion: v1\nkind: Config\ncurrent-context: dev\nclusters:\n- name: dev\n  cluster: {server: \
         'https://127.0.0.1:6443'}\n- name: prod\n  cluster: {server: 'https://10.9.8.7:443'}\nusers:\n- name: \
         u\n  user: {token: not-a-secret}\ncontexts:\n- name: dev\n  context: {cluster: dev, user: u}\n- \
         name: prod\n  context: {cluster: prod, user: u, namespace: physalia}\n",
    )
    .unwrap();
    let config = physalia_backends::kubernetes::config_at_context(kubeconfig.clone(), "prod")
        .await
        .unwrap();
    assert_eq!(config.cluster_url.host(), Some("10.9.8.7"));
    assert_eq!(config.default_namespace, "physalia");
    let config = physalia_backends::kubernetes::config_at_context(kubeconfig.clone(), "dev")
        .await
        .unwrap();
    assert_eq!(
        (config.cluster_url.host(), config.cluster_url.port_u16()),
        (Some("127.0.0.1"), Some(6443))
    );
    let err = physalia_backends::kubernetes::config_at_context(kubeconfig, "staging")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no context \"staging\"") && err.contains("dev, prod"),
        "{err}"
    );
}
