//! The aci backend against an ARM endpoint on loopback ([`arm`]) that validates every request body against
//! `shared/specs/aci-containerInstance-2026-05-01.json` ([`swagger`]) and plays back long-running
//! operations and failures.

mod arm;
mod swagger;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use arm::{
    ArmServer, COORDINATOR_RANK, Failure, Lro, RESOURCE_GROUP, SUBSCRIPTION, Script, TOKEN,
    Throttle,
};
use base64::Engine as _;
use physalia_backends::aci::{
    AciBackend, AciConfig, AzCliToken, DefaultAzureToken, ManagedIdentityToken, StaticToken,
    TokenProvider, body,
};
use physalia_backends::{
    Backend, CoordinatorSpec, Demand, Error, GpuRequest, LaunchId, NetworkSpec, SecretBytes,
    SecretValue, WorkerSpec, WorkerState,
};
use serde_json::{Value, json};

const IMAGE: &str = "physalia.azurecr.io/worker:0.1.0";
const SUBNET: &str = "/subscriptions/00000000-0000-0000-0000-00000000beef/resourceGroups/physalia-rg/providers/Microsoft.Network/virtualNetworks/physalia/subnets/workers";

/// The ContainerInstance swagger of api-version 2026-05-01, vendored from `shared/specs/` (Azure REST API
/// specs, MIT licence) so the tests run wherever the repository is checked out.
fn spec_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/aci/spec/aci-containerInstance-2026-05-01.json")
}

/// The vendored spec is the shared one, where the shared folder is present.
#[test]
fn the_vendored_spec_is_the_shared_one() {
    let shared = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/specs/aci-containerInstance-2026-05-01.json");
    match std::fs::read(&shared) {
        Ok(bytes) => assert!(
            bytes == std::fs::read(spec_path()).unwrap(),
            "{} changed",
            shared.display()
        ),
        Err(_) => println!(
            "note: {} not present; using the vendored copy",
            shared.display()
        ),
    }
}

fn key(rank: usize) -> String {
    format!("-----BEGIN PRIVATE KEY-----\nKEY-OF-RANK-{rank}\n-----END PRIVATE KEY-----\n")
}

fn spec(n: usize) -> WorkerSpec {
    WorkerSpec {
        job_id: "arxiv-1732000000".into(),
        segment: 1,
        image: IMAGE.into(),
        command: vec![],
        cpu: 4.0,
        memory_gib: 15.9,
        gpu: None,
        instance_types: Vec::new(),
        env: BTreeMap::from([("RAYON_NUM_THREADS".into(), "4".into())]),
        secrets: BTreeMap::from([
            (
                "ca.pem".into(),
                SecretValue::Same(SecretBytes::new("CA-CERT")),
            ),
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
            coordinator_addr: "10.1.0.4:7000".into(),
            mesh_port: 7100,
        },
    }
}

fn config(server: &ArmServer, max_parallel: usize) -> AciConfig {
    AciConfig {
        endpoint: server.endpoint.clone(),
        max_parallel,
        poll_interval: Duration::from_millis(1),
        ..AciConfig::new(SUBSCRIPTION, RESOURCE_GROUP, "eastus", SUBNET)
    }
}

fn backend_with(server: &ArmServer, max_parallel: usize, token: &str) -> AciBackend {
    let token = Arc::new(StaticToken::new(token, "the test"));
    AciBackend::new(config(server, max_parallel), token).unwrap()
}

fn backend(server: &ArmServer) -> AciBackend {
    backend_with(server, 4, TOKEN)
}

fn launch_id() -> LaunchId {
    LaunchId::new("arxiv-1732000000", 1)
}

fn group(rank: usize) -> String {
    body::group_name(&launch_id(), rank)
}

/// Every request body was valid, every group created was deleted, none is left.
fn assert_cleaned_up(server: &ArmServer) {
    let rec = server.record();
    assert!(rec.violations.is_empty(), "{:#?}", rec.violations);
    for c in &rec.created {
        assert!(
            rec.deleted.contains(c),
            "{c} was created and never deleted: {:?}",
            rec.deleted
        );
    }
    assert!(
        rec.groups.is_empty(),
        "left running: {:?}",
        rec.groups.keys()
    );
}

fn puts(server: &ArmServer) -> Vec<String> {
    server
        .record()
        .requests
        .iter()
        .filter(|r| r.starts_with("PUT"))
        .map(|r| {
            r.split('?')
                .next()
                .unwrap()
                .rsplit('/')
                .next()
                .unwrap()
                .to_string()
        })
        .collect()
}

#[test]
fn the_validator_refuses_what_arm_would_silently_ignore_or_reject() {
    let swagger = swagger::Swagger::load(&spec_path());
    let good = json!({
        "location": "eastus",
        "properties": {
            "containers": [{"name": "w", "properties": {
                "image": "x", "resources": {"requests": {"cpu": 1, "memoryInGB": 1.5}}}}],
            "osType": "Linux"
        }
    });
    assert_eq!(
        swagger.validate("ContainerGroup", &good),
        Vec::<String>::new()
    );
    let cases = [
        (
            "/properties/containers/0/properties/resources/requests/memoryInGb",
            json!(1),
            "$.properties.containers[0].properties.resources.requests.memoryInGb: not a property the spec declares",
        ),
        (
            "/properties/osType",
            json!("Plan9"),
            "$.properties.osType: \"Plan9\" is not one of [\"Windows\",\"Linux\"]",
        ),
        (
            "/properties/provisioningState",
            json!("Succeeded"),
            "$.properties.provisioningState: read-only property sent in a request",
        ),
        (
            "/properties/ipAddress",
            json!({"type": "Private", "ports": [{"port": "7100"}]}),
            "$.properties.ipAddress.ports[0].port: expected an integer, got \"7100\"",
        ),
        (
            "/properties/ipAddress",
            json!({"type": "Private", "ports": [{"port": 4294967296u64}]}),
            "$.properties.ipAddress.ports[0].port: 4294967296 does not fit int32",
        ),
        (
            "/id",
            json!("x"),
            "$.id: read-only property sent in a request",
        ),
        (
            "/properties/volumes",
            json!([{"name": "s", "secret": {"a": 1}}]),
            "$.properties.volumes[0].secret.a: expected a string, got 1",
        ),
    ];
    for (pointer, value, want) in cases {
        let mut bad = good.clone();
        let (parent, last) = pointer.rsplit_once('/').unwrap();
        let target = if parent.is_empty() {
            &mut bad
        } else {
            bad.pointer_mut(parent).unwrap()
        };
        target[last] = value;
        assert_eq!(
            swagger.validate("ContainerGroup", &bad),
            [want.to_string()],
            "{pointer}"
        );
    }
    let mut missing = good.clone();
    missing["properties"]["containers"][0]["properties"]["resources"]["requests"]
        .as_object_mut()
        .unwrap()
        .remove("cpu");
    assert_eq!(
        swagger.validate("ContainerGroup", &missing),
        [
            "$.properties.containers[0].properties.resources.requests: required property cpu is missing"
        ]
    );
}

#[tokio::test]
async fn launch_creates_one_valid_group_per_worker_and_follows_each_operation() {
    let server = ArmServer::start(Script::default()).await;
    let launched = backend(&server).launch(&spec(4), 4).await.unwrap();

    assert_eq!(launched.id, launch_id());
    let got: Vec<_> = launched
        .workers
        .iter()
        .map(|w| (w.rank, w.name.clone(), w.state, w.ip))
        .collect();
    let want: Vec<_> = (0..4)
        .map(|r| {
            (
                r,
                group(r),
                WorkerState::Running,
                Some(format!("10.1.0.{}", 4 + r).parse().unwrap()),
            )
        })
        .collect();
    assert_eq!(got, want);

    let rec = server.record();
    assert!(rec.violations.is_empty(), "{:#?}", rec.violations);
    assert_eq!(rec.created.len(), 4);
    // Each operation was polled until it ended (2 InProgress + 1 Succeeded), then the group was read.
    let polls = rec
        .requests
        .iter()
        .filter(|r| r.starts_with("GET /operations/"))
        .count();
    assert_eq!(polls, 4 * 3);
    assert!(rec.deleted.is_empty());

    let b64 = base64::engine::general_purpose::STANDARD;
    for rank in 0..4 {
        let body = &rec.bodies[&group(rank)];
        assert_eq!(body["location"], "eastus");
        assert_eq!(body["tags"]["physalia-rank"], rank.to_string());
        let props = &body["properties"];
        assert_eq!(props["restartPolicy"], "Never");
        assert_eq!(props["ipAddress"]["type"], "Private");
        assert_eq!(props["subnetIds"][0]["id"], SUBNET);
        let c = &props["containers"][0]["properties"];
        assert_eq!(c["image"], IMAGE);
        assert_eq!(
            c["resources"]["requests"],
            json!({"cpu": 4.0, "memoryInGB": 15.9})
        );
        assert!(
            c.get("command").is_none(),
            "empty command keeps the image's entrypoint"
        );
        let env: BTreeMap<&str, &Value> = c["environmentVariables"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["name"].as_str().unwrap(), &e["value"]))
            .collect();
        assert_eq!(env["PHYSALIA_RANK"], &json!(rank.to_string()));
        assert_eq!(env["PHYSALIA_WORLD"], &json!("4"));
        assert_eq!(
            env["PHYSALIA_SECRETS_DIR"],
            &json!("/var/run/physalia/secrets")
        );
        assert_eq!(env["PHYSALIA_COORDINATOR_ADDR"], &json!("10.1.0.4:7000"));
        assert_eq!(
            c["volumeMounts"][0]["mountPath"],
            "/var/run/physalia/secrets"
        );
        // This rank's key, and no other rank's, in its secret volume; no secret in any env value.
        let secret = &props["volumes"][0]["secret"];
        assert_eq!(secret["key.pem"], json!(b64.encode(key(rank))));
        assert_eq!(secret["ca.pem"], json!(b64.encode("CA-CERT")));
        let text = body.to_string();
        for other in (0..4).filter(|&r| r != rank) {
            assert!(
                !text.contains(&b64.encode(key(other))),
                "rank {rank} carries rank {other}'s key"
            );
        }
        let env_text = c["environmentVariables"].to_string();
        assert!(!env_text.contains("KEY-OF-RANK") && !env_text.contains(&b64.encode(key(rank))));
    }
}

#[tokio::test]
async fn location_header_operations_are_followed_for_create_and_delete() {
    let server = ArmServer::start(Script {
        lro: Lro::Location,
        polls: 3,
        ..Script::default()
    })
    .await;
    let b = backend(&server);
    let launched = b.launch(&spec(2), 2).await.unwrap();
    assert!(
        launched
            .workers
            .iter()
            .all(|w| w.state == WorkerState::Running)
    );
    b.stop_all(&launched.id).await.unwrap();
    assert_cleaned_up(&server);
    let rec = server.record();
    // Two creates and two deletes, each polled 3 times at 202 and once more at its end.
    let polls = rec
        .requests
        .iter()
        .filter(|r| r.starts_with("GET /operationResults/"))
        .count();
    assert_eq!(polls, 4 * 4);
}

/// Issue 7: a failure at worker 3 of 4 leaves nothing running. Sequential launches, so ranks 0 and 1
/// exist when rank 2 is refused, and rank 3 is never tried.
#[tokio::test]
async fn a_quota_refusal_at_the_third_of_four_workers_deletes_every_group_created() {
    let server = ArmServer::start(Script {
        failures: BTreeMap::from([(2, Failure::Quota)]),
        ..Script::default()
    })
    .await;
    let err = backend_with(&server, 1, TOKEN)
        .launch(&spec(4), 4)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Quota { rank: Some(2), .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "aci: quota exceeded launching worker 2: ContainerGroupQuotaReached: Resource type \
         'Microsoft.ContainerInstance/containerGroups' container group quota 'StandardCores' exceeded \
         in region 'eastus'. Limit: '10', Usage: '8', Requested: '2'. (request more under Quotas > \
         Container Instances for eastus)"
    );
    assert_eq!(server.record().created, [group(0), group(1)]);
    assert_eq!(puts(&server), [group(0), group(1), group(2)]);
    assert_cleaned_up(&server);
}

/// The same with all four launched at once: whatever was created by the time rank 2 failed is deleted.
#[tokio::test]
async fn a_quota_refusal_during_a_parallel_launch_deletes_every_group_created() {
    let server = ArmServer::start(Script {
        failures: BTreeMap::from([(2, Failure::Quota)]),
        ..Script::default()
    })
    .await;
    let err = backend_with(&server, 4, TOKEN)
        .launch(&spec(4), 4)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Quota { rank: Some(2), .. }), "{err:?}");
    assert!(!server.record().created.is_empty());
    assert_cleaned_up(&server);
}

#[tokio::test]
async fn an_image_that_fails_to_pull_fails_its_group_and_the_launch_deletes_everything() {
    for lro in [Lro::AsyncOperation, Lro::Location] {
        let server = ArmServer::start(Script {
            lro,
            failures: BTreeMap::from([(2, Failure::ImagePullFails)]),
            ..Script::default()
        })
        .await;
        let err = backend_with(&server, 1, TOKEN)
            .launch(&spec(4), 4)
            .await
            .unwrap_err();
        match &err {
            Error::ImageMissing {
                image,
                rank,
                detail,
                ..
            } => {
                assert_eq!((image.as_str(), *rank), (IMAGE, 2));
                assert!(
                    detail.starts_with(&format!(
                        "Failed to pull image \"{IMAGE}\": manifest unknown"
                    )),
                    "{detail}"
                );
            }
            other => panic!("{lro:?}: wanted ImageMissing, got {other:?}"),
        }
        assert_eq!(
            server.record().created,
            [group(0), group(1), group(2)],
            "{lro:?}"
        );
        assert_cleaned_up(&server);
    }
}

#[tokio::test]
async fn an_image_refused_at_create_is_an_image_error() {
    let server = ArmServer::start(Script {
        failures: BTreeMap::from([(0, Failure::ImageRefused)]),
        ..Script::default()
    })
    .await;
    let err = backend_with(&server, 1, TOKEN)
        .launch(&spec(2), 2)
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "aci: image {IMAGE} could not be pulled for worker 0: InaccessibleImage: The image \
             '{IMAGE}' in container group '{}' is not accessible. Please check the image and registry \
             credential.",
            group(0)
        )
    );
    assert!(server.record().created.is_empty());
    assert_cleaned_up(&server);
}

#[tokio::test]
async fn bad_credentials_are_a_credentials_error_that_names_the_token() {
    let server = ArmServer::start(Script::default()).await;
    let err = backend_with(&server, 4, "tok-9f8e7d-wrong")
        .launch(&spec(4), 4)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Credentials { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.starts_with(
            "aci: the platform refused the credentials (the bearer token from the test): \
             InvalidAuthenticationToken: The access token is invalid.; the token is missing"
        ),
        "{text}"
    );
    assert!(
        !text.contains("tok-9f8e7d"),
        "the token itself never appears: {text}"
    );
    assert!(server.record().created.is_empty());
    assert_cleaned_up(&server);
}

#[tokio::test]
async fn a_gpu_request_is_refused_before_any_call_and_points_to_aks_or_ecs() {
    let server = ArmServer::start(Script::default()).await;
    let mut s = spec(2);
    s.gpu = Some(GpuRequest {
        count: 1,
        kind: Some("T4".into()),
    });
    let err = backend(&server).launch(&s, 2).await.unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("no GPUs since 14 July 2025"), "{text}");
    assert!(text.contains("1 x T4"), "{text}");
    assert!(
        text.contains("kubernetes backend on AKS") && text.contains("ecs backend"),
        "{text}"
    );
    assert!(server.record().requests.is_empty());
}

#[tokio::test]
async fn list_logs_stop_and_stop_all_follow_pages_and_leave_nothing() {
    let server = ArmServer::start(Script {
        page_size: 2,
        ..Script::default()
    })
    .await;
    let b = backend(&server);
    let launched = b.launch(&spec(3), 3).await.unwrap();
    let id = &launched.id;

    let listed = b.list(id).await.unwrap();
    assert_eq!(listed, launched.workers);
    assert!(
        server
            .record()
            .requests
            .iter()
            .any(|r| r.contains("$skiptoken=2")),
        "the second page was read"
    );

    assert_eq!(
        b.logs(id, 1).await.unwrap(),
        format!("log of {}/worker\n", group(1))
    );

    b.stop(id, 1).await.unwrap();
    let ranks: Vec<usize> = b.list(id).await.unwrap().iter().map(|w| w.rank).collect();
    assert_eq!(ranks, [0, 2]);
    assert!(matches!(
        b.logs(id, 1).await,
        Err(Error::NoSuchWorker { rank: 1, .. })
    ));

    b.stop_all(id).await.unwrap();
    assert_cleaned_up(&server);
    b.stop(id, 1).await.unwrap();
    b.stop_all(id).await.unwrap();
}

/// Issue 30: ARM throttles every third request of the principal (429, or 503 with `Retry-After: 0`),
/// and the first of each distinct request, so that every call path (PUT, the operation polls, GET,
/// list and its pages, logs, DELETE) meets it. Each is retried until it goes through: the launch,
/// list, logs, stop and stop_all come out as without throttling.
#[tokio::test]
async fn every_call_is_retried_while_arm_throttles_every_third_request() {
    for (lro, status) in [(Lro::AsyncOperation, 429), (Lro::Location, 503)] {
        let server = ArmServer::start(Script {
            lro,
            page_size: 2,
            throttle: Throttle {
                every: 3,
                status,
                first_of_each: true,
                ..Throttle::default()
            },
            ..Script::default()
        })
        .await;
        let b = backend(&server);
        let launched = b.launch(&spec(3), 3).await.unwrap();
        assert!(
            launched
                .workers
                .iter()
                .all(|w| w.state == WorkerState::Running),
            "{launched:?}"
        );
        assert_eq!(b.list(&launched.id).await.unwrap(), launched.workers);
        assert_eq!(
            b.logs(&launched.id, 1).await.unwrap(),
            format!("log of {}/worker\n", group(1))
        );
        b.check(&spec(3), Demand::one(4.0)).await.unwrap();
        b.stop(&launched.id, 1).await.unwrap();
        b.stop_all(&launched.id).await.unwrap();
        assert_cleaned_up(&server);
        let rec = server.record();
        assert_eq!(rec.created.len(), 3, "each group PUT once carried out");
        // every distinct request was throttled once, then sent again and answered
        let distinct: std::collections::BTreeSet<&String> = rec.requests.iter().collect();
        for r in &distinct {
            assert!(
                rec.throttled.contains(r),
                "{lro:?}: {r} was never throttled"
            );
            assert!(
                rec.requests.iter().filter(|q| q == r).count() >= 2,
                "{lro:?}: {r} was not sent again"
            );
        }
        for kind in ["PUT ", "GET /operation", "DELETE ", "/logs?", "$skiptoken="] {
            assert!(
                distinct.iter().any(|r| r.contains(kind)),
                "{lro:?}: no {kind:?} request: {distinct:#?}"
            );
        }
        assert!(
            rec.throttled.len() >= rec.requests.len() / 3,
            "every third request too"
        );
    }
}

/// The coordinator's calls (its PUT, polls, status, logs, delete) are retried alike.
#[tokio::test]
async fn the_coordinators_calls_are_retried_while_arm_throttles() {
    let server = ArmServer::start(Script {
        throttle: Throttle {
            every: 2,
            ..Throttle::default()
        },
        ..Script::default()
    })
    .await;
    let backend = coordinator_backend(&server, test_token());
    let handle = backend
        .launch_coordinator(&coordinator_spec())
        .await
        .unwrap();
    let status = backend.coordinator_status(&handle).await.unwrap();
    assert_eq!(status.state, WorkerState::Running);
    assert_eq!(
        backend.coordinator_logs(&handle).await.unwrap(),
        format!("log of {COORDINATOR}/coordinator\n")
    );
    backend.stop_coordinator(&handle).await.unwrap();
    assert_cleaned_up(&server);
    assert!(server.record().throttled.len() >= 4);
}

/// `Retry-After` is waited for, and capped by `max_poll_interval`; without one, the backoff applies.
#[tokio::test]
async fn retry_after_is_honoured_up_to_the_cap_and_backoff_applies_without_it() {
    for (retry_after, cap, min, max) in [
        (Some("1"), Duration::from_secs(30), 1.0, 10.0),
        (Some("3600"), Duration::from_millis(300), 0.3, 10.0),
        (None, Duration::from_secs(30), 0.0, 10.0),
    ] {
        let server = ArmServer::start(Script {
            throttle: Throttle {
                every: 1,
                retry_after,
                limit: Some(1),
                ..Throttle::default()
            },
            ..Script::default()
        })
        .await;
        let cfg = AciConfig {
            max_poll_interval: cap,
            throttle_backoff: Duration::from_millis(20),
            ..config(&server, 1)
        };
        let b = AciBackend::new(cfg, test_token()).unwrap();
        let t0 = std::time::Instant::now();
        b.check(&spec(1), Demand::one(4.0)).await.unwrap();
        let took = t0.elapsed().as_secs_f64();
        assert!(
            (min..max).contains(&took),
            "Retry-After {retry_after:?}, cap {cap:?}: {took} s"
        );
        let rec = server.record();
        assert_eq!(rec.throttled.len(), 1);
        // the throttled list sent again once, then the preflight's usage read
        let lists = rec
            .requests
            .iter()
            .filter(|r| r.contains("/containerGroups?"))
            .count();
        assert_eq!(
            (lists, rec.requests.len()),
            (2, 3),
            "sent again once: {:?}",
            rec.requests
        );
    }
}

/// Throttling that never ends fails the call with an error that says so: the status, the attempts, the
/// time spent; by the attempt limit or by the time budget. A 503 without `Retry-After` is an ordinary
/// error, not retried.
#[tokio::test]
async fn throttling_that_never_ends_is_a_throttled_error_naming_status_attempts_and_time() {
    let forever = |status, retry_after| Script {
        throttle: Throttle {
            every: 1,
            status,
            retry_after,
            limit: None,
            first_of_each: false,
        },
        ..Script::default()
    };
    // by attempts
    let server = ArmServer::start(forever(429, Some("0"))).await;
    let cfg = AciConfig {
        throttle_attempts: 4,
        ..config(&server, 1)
    };
    let b = AciBackend::new(cfg, test_token()).unwrap();
    let err = b.check(&spec(1), Demand::one(4.0)).await.unwrap_err();
    assert!(
        matches!(err, Error::Throttled { attempts: 4, .. }),
        "{err:?}"
    );
    let text = err.to_string();
    for needle in [
        "throttled",
        "after 4 attempts",
        "HTTP 429 Too Many Requests",
        "TooManyRequests",
        "4 attempts are the most allowed",
        "x-ms-ratelimit-remaining-subscription-reads=0",
        "list container groups in resource group physalia-rg",
    ] {
        assert!(text.contains(needle), "{needle:?} not in {text}");
    }
    assert_eq!(server.record().requests.len(), 4);
    // a delete (stop) likewise
    let err = b.stop(&launch_id(), 0).await.unwrap_err();
    assert!(matches!(err, Error::Throttled { .. }), "{err}");
    assert!(err.to_string().contains("delete container group"), "{err}");

    // by time: Retry-After 1 s, a budget of 1.5 s: the second wait would pass it
    let server = ArmServer::start(forever(503, Some("1"))).await;
    let cfg = AciConfig {
        throttle_budget: Duration::from_millis(1500),
        ..config(&server, 1)
    };
    let b = AciBackend::new(cfg, test_token()).unwrap();
    let t0 = std::time::Instant::now();
    let err = b.check(&spec(1), Demand::one(4.0)).await.unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(err, Error::Throttled { attempts: 2, .. }),
        "{err:?}"
    );
    let text = err.to_string();
    for needle in [
        "HTTP 503 Service Unavailable",
        "would pass the throttle budget of 1.5 s",
        "for 1.",
    ] {
        assert!(text.contains(needle), "{needle:?} not in {text}");
    }

    // a launch throttled to the end fails with the throttling, and creates nothing
    let server = ArmServer::start(forever(429, Some("0"))).await;
    let cfg = AciConfig {
        throttle_attempts: 3,
        ..config(&server, 2)
    };
    let err = AciBackend::new(cfg, test_token())
        .unwrap()
        .launch(&spec(2), 2)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("throttled"), "{err}");
    assert!(server.record().created.is_empty());

    // 503 without Retry-After: not ARM's throttling, one attempt
    let server = ArmServer::start(forever(503, None)).await;
    let err = backend(&server)
        .check(&spec(1), Demand::one(4.0))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Api {
                status: Some(503),
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(server.record().requests.len(), 1);
}

#[tokio::test]
async fn the_token_is_never_sent_to_an_operation_url_on_another_host() {
    let server = ArmServer::start(Script {
        foreign_operation_url: true,
        ..Script::default()
    })
    .await;
    let err = backend_with(&server, 1, TOKEN)
        .launch(&spec(1), 1)
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("the server pointed to http://203.0.113.7, outside http://127.0.0.1:"),
        "{err}"
    );
    assert_cleaned_up(&server);
}

#[tokio::test]
async fn a_registry_identity_is_sent_as_a_user_assigned_identity() {
    let server = ArmServer::start(Script::default()).await;
    let identity = "/subscriptions/00000000-0000-0000-0000-00000000beef/resourceGroups/physalia-rg/providers/Microsoft.ManagedIdentity/userAssignedIdentities/physalia-pull";
    let cfg = AciConfig {
        registry: Some(physalia_backends::aci::RegistryPull {
            server: "physalia.azurecr.io".into(),
            identity_id: identity.into(),
        }),
        ..config(&server, 1)
    };
    let b = AciBackend::new(cfg, Arc::new(StaticToken::new(TOKEN, "the test"))).unwrap();
    b.launch(&spec(1), 1).await.unwrap();
    let rec = server.record();
    assert!(rec.violations.is_empty(), "{:#?}", rec.violations);
    let body = &rec.bodies[&group(0)];
    assert_eq!(
        body["properties"]["imageRegistryCredentials"],
        json!([{"server": "physalia.azurecr.io", "identity": identity}])
    );
    assert_eq!(body["identity"]["type"], "UserAssigned");
    assert_eq!(
        body["identity"]["userAssignedIdentities"][identity],
        json!({})
    );
}

// ---------------------------------------------------------------------------------------------------
// The coordinator (cluster mode)
// ---------------------------------------------------------------------------------------------------

const IDENTITY: &str = "/subscriptions/00000000-0000-0000-0000-00000000beef/resourceGroups/physalia-rg/providers/Microsoft.ManagedIdentity/userAssignedIdentities/physalia-coordinator";
const COORDINATOR: &str = "physalia-arxiv-1732000000-coordinator";

fn coordinator_spec() -> CoordinatorSpec {
    CoordinatorSpec {
        job_id: "arxiv-1732000000".into(),
        image: "physalia.azurecr.io/physalia:0.1.0".into(),
        command: vec!["physalia".into(), "coordinate".into()],
        env: BTreeMap::from([("AZURE_CLIENT_ID".into(), "0000-client".into())]),
        cpu: 1.0,
        memory_gib: 2.0,
        control_port: 7000,
        labels: BTreeMap::from([("physalia.dev/team".into(), "graphs".into())]),
    }
}

fn coordinator_backend(server: &ArmServer, token: Arc<dyn TokenProvider>) -> AciBackend {
    let cfg = AciConfig {
        coordinator_identity_id: Some(IDENTITY.into()),
        ..config(server, 4)
    };
    AciBackend::new(cfg, token).unwrap()
}

fn test_token() -> Arc<dyn TokenProvider> {
    Arc::new(StaticToken::new(TOKEN, "the test"))
}

#[tokio::test]
async fn the_coordinator_is_a_valid_group_with_its_managed_identity_and_stop_deletes_it() {
    let server = ArmServer::start(Script::default()).await;
    let backend = coordinator_backend(&server, test_token());
    let handle = backend
        .launch_coordinator(&coordinator_spec())
        .await
        .unwrap();
    assert_eq!(
        (handle.backend.as_str(), handle.scope.as_str()),
        ("aci", RESOURCE_GROUP)
    );
    assert_eq!(handle.object("container-group"), Some(COORDINATOR));
    {
        let rec = server.record();
        assert!(rec.violations.is_empty(), "{:#?}", rec.violations);
        assert_eq!(rec.created, [COORDINATOR]);
        let b = &rec.bodies[COORDINATOR];
        assert_eq!(b["identity"]["type"], "UserAssigned");
        assert_eq!(b["identity"]["userAssignedIdentities"][IDENTITY], json!({}));
        let p = &b["properties"];
        assert_eq!(p["subnetIds"][0]["id"], SUBNET);
        assert_eq!(p["restartPolicy"], "Never");
        assert_eq!(p["ipAddress"]["type"], "Private");
        assert_eq!(
            p["ipAddress"]["ports"][0],
            json!({"port": 7000, "protocol": "UDP"})
        );
        let c = &p["containers"][0];
        assert_eq!(c["name"], "coordinator");
        assert_eq!(
            c["properties"]["image"],
            "physalia.azurecr.io/physalia:0.1.0"
        );
        assert_eq!(
            c["properties"]["resources"]["requests"],
            json!({"cpu": 1.0, "memoryInGB": 2.0})
        );
        assert!(p["volumes"].is_null(), "no secret volume: {p}");
        assert_eq!(b["tags"]["physalia.dev_team"], "graphs");
        assert_eq!(b["tags"]["physalia-coordinator"], COORDINATOR);
    }
    let status = backend.coordinator_status(&handle).await.unwrap();
    assert_eq!(status.state, WorkerState::Running);
    assert_eq!(status.ip, Some("10.1.0.254".parse().unwrap()));
    assert_eq!(
        backend.coordinator_logs(&handle).await.unwrap(),
        format!("log of {COORDINATOR}/coordinator\n")
    );
    backend.stop_coordinator(&handle).await.unwrap();
    assert_cleaned_up(&server);
    let gone = backend.coordinator_status(&handle).await.unwrap();
    assert_eq!(gone.state, WorkerState::Unknown);
    backend.stop_coordinator(&handle).await.unwrap();
}

#[tokio::test]
async fn a_coordinator_image_that_fails_to_pull_is_refused_and_its_group_deleted() {
    for (failure, created) in [
        (Failure::ImagePullFails, true),
        (Failure::ImageRefused, false),
    ] {
        let server = ArmServer::start(Script {
            failures: BTreeMap::from([(COORDINATOR_RANK, failure.clone())]),
            ..Script::default()
        })
        .await;
        let err = coordinator_backend(&server, test_token())
            .launch_coordinator(&coordinator_spec())
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::CoordinatorFailed { .. }),
            "{failure:?}: {err:?}"
        );
        let text = err.to_string();
        assert!(
            text.starts_with(
                "aci: the coordinator could not start: image physalia.azurecr.io/physalia:0.1.0 \
                 could not be pulled"
            ),
            "{text}"
        );
        assert_eq!(!server.record().created.is_empty(), created, "{failure:?}");
        assert_cleaned_up(&server);
    }
}

#[tokio::test]
async fn a_coordinator_without_an_identity_is_refused_before_any_call() {
    let server = ArmServer::start(Script::default()).await;
    let err = backend(&server)
        .launch_coordinator(&coordinator_spec())
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("coordinator_identity_id is not set"),
        "{err}"
    );
    assert!(server.record().requests.is_empty());
}

#[tokio::test]
async fn check_refuses_gpus_and_bad_credentials_before_anything_is_created() {
    let server = ArmServer::start(Script::default()).await;
    backend(&server)
        .check(&spec(2), Demand::one(4.0))
        .await
        .unwrap();
    let mut gpu = spec(2);
    gpu.gpu = Some(GpuRequest {
        count: 1,
        kind: None,
    });
    let before = server.record().requests.len();
    let err = backend(&server)
        .check(&gpu, Demand::one(4.0))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    assert_eq!(
        server.record().requests.len(),
        before,
        "no call for a GPU spec"
    );
    let err = backend_with(&server, 4, "expired-token")
        .check(&spec(2), Demand::one(4.0))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Credentials { .. }), "{err}");
    assert!(err.to_string().contains("az login"), "{err}");
    assert!(server.record().created.is_empty());
}

/// ACI's regional quotas (Location - List Usage) the job's peak does not fit are refused in preflight
/// with one line naming the quota, its limit and use, and the need; nothing is created. Within them it
/// passes, and a principal that may not read usage is not refused for it.
#[tokio::test]
async fn check_refuses_a_job_over_the_regional_core_or_group_quota() {
    let three = Demand {
        workers: 3,
        overlap_workers: 0,
        machine_vcpus: 4.0,
    };
    let server = ArmServer::start(Script {
        usage: vec![
            ("ContainerGroups", "Container Groups", 1, 100),
            ("StandardCores", "Standard Cores", 4, 10),
        ],
        ..Script::default()
    })
    .await;
    let err = backend(&server).check(&spec(3), three).await.unwrap_err();
    let line = err.to_string();
    assert!(matches!(err, Error::Quota { rank: None, .. }), "{line}");
    assert!(!line.contains('\n'), "{line}");
    assert!(
        line.contains(
            "the subscription's ACI quota \"Standard Cores\" (StandardCores) in eastus is 10 with 4 in \
             use, and this job needs 12 at its peak (3 workers of 4 cores each)"
        ) && line.contains("nothing was created"),
        "{line}"
    );
    // one worker of 4 cores fits the 6 left
    backend(&server)
        .check(&spec(1), Demand::one(4.0))
        .await
        .unwrap();
    // but not when a prewarmed launch of one starts beside the one running: 8 cores at the peak
    let prewarmed = Demand {
        overlap_workers: 1,
        ..Demand::one(4.0)
    };
    let err = backend(&server)
        .check(&spec(1), prewarmed)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains(
            "this job needs 8 at its peak (2 workers of 4 cores each; a prewarmed launch of 1 \
             beside 1 still running)"
        ),
        "{err}"
    );

    let server = ArmServer::start(Script {
        usage: vec![
            ("ContainerGroups", "Container Groups", 99, 100),
            ("StandardCores", "Standard Cores", 0, 100),
        ],
        ..Script::default()
    })
    .await;
    let err = backend(&server).check(&spec(3), three).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("\"Container Groups\" (ContainerGroups) in eastus is 100 with 99 in use"),
        "{err}"
    );
    assert!(server.record().created.is_empty());
    assert!(
        server.record().violations.is_empty(),
        "{:?}",
        server.record().violations
    );
}

/// A fake `az` that prints `stdout` and exits with `code`.
fn fake_az(
    dir: &std::path::Path,
    name: &str,
    stdout: &str,
    stderr: &str,
    code: i32,
) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!("#!/bin/sh\ncat <<'EOF'\n{stdout}\nEOF\necho '{stderr}' >&2\nexit {code}\n"),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[tokio::test]
async fn the_azure_cli_token_is_used_and_absent_or_expired_ones_say_az_login() {
    let dir = tempfile::tempdir().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let token_json = |expires: u64| {
        format!(
            r#"{{"accessToken": "{TOKEN}", "expires_on": {expires}, "subscription": "{SUBSCRIPTION}", "tokenType": "Bearer"}}"#
        )
    };
    let server = ArmServer::start(Script::default()).await;
    let with = |program: std::path::PathBuf| -> AciBackend {
        AciBackend::new(
            config(&server, 4),
            Arc::new(AzCliToken::with_program(program)),
        )
        .unwrap()
    };
    // signed in: the CLI's token reaches ARM
    let good = fake_az(dir.path(), "az-good", &token_json(now + 3600), "", 0);
    with(good).check(&spec(1), Demand::one(4.0)).await.unwrap();
    // not signed in, expired, not installed: a credentials error that says what to do, no request
    let before = server.record().requests.len();
    let cases = [
        (
            fake_az(
                dir.path(),
                "az-out",
                "",
                "ERROR: Please run az login to setup account.",
                1,
            ),
            "Please run az login to setup account.",
        ),
        (
            fake_az(dir.path(), "az-expired", &token_json(now - 60), "", 0),
            "token expired",
        ),
        (
            dir.path().join("no-such-az"),
            "is not installed or not on PATH",
        ),
    ];
    for (program, needle) in cases {
        let err = with(program)
            .check(&spec(1), Demand::one(4.0))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Credentials { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains(needle) && text.contains("az login"), "{text}");
        assert!(!text.contains(TOKEN), "{text}");
    }
    assert_eq!(server.record().requests.len(), before);
}

/// One HTTP answer per connection on loopback: the instance metadata service's token endpoint.
async fn identity_endpoint(body: String) -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let mut buf = vec![0u8; 4096];
            let n = s.read(&mut buf).await.unwrap_or(0);
            log.lock()
                .unwrap()
                .push(String::from_utf8_lossy(&buf[..n]).to_string());
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(reply.as_bytes()).await;
        }
    });
    (url, seen)
}

#[tokio::test]
async fn a_managed_identity_token_is_used_and_without_one_the_chain_says_az_login() {
    let expires = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let (url, seen) = identity_endpoint(format!(
        r#"{{"access_token": "{TOKEN}", "expires_on": "{expires}", "token_type": "Bearer"}}"#
    ))
    .await;
    let server = ArmServer::start(Script::default()).await;
    let identity = ManagedIdentityToken::with_endpoint(&url, Some("0000-client".into()));
    AciBackend::new(config(&server, 4), Arc::new(identity))
        .unwrap()
        .check(&spec(1), Demand::one(4.0))
        .await
        .unwrap();
    let req = seen.lock().unwrap()[0].clone();
    assert!(req.starts_with("GET /metadata/identity/oauth2/token?api-version=2018-02-01&resource=https%3A%2F%2Fmanagement.azure.com%2F&client_id=0000-client "), "{req}");
    assert!(req.to_ascii_lowercase().contains("metadata: true"), "{req}");
    // by resource id: the coordinator's group may hold the registry's pull identity as well
    seen.lock().unwrap().clear();
    let by_id = ManagedIdentityToken::with_endpoint(&url, None)
        .resource_id(Some("/subscriptions/s/id/coordinator".into()));
    AciBackend::new(config(&server, 4), Arc::new(by_id))
        .unwrap()
        .check(&spec(1), Demand::one(4.0))
        .await
        .unwrap();
    let req = seen.lock().unwrap()[0].clone();
    assert!(
        req.contains("&msi_res_id=%2Fsubscriptions%2Fs%2Fid%2Fcoordinator "),
        "{req}"
    );

    // nothing listening for the identity, no az: one credentials error naming both
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let dir = tempfile::tempdir().unwrap();
    let chain = DefaultAzureToken::new(
        ManagedIdentityToken::with_endpoint(closed_url, None),
        AzCliToken::with_program(dir.path().join("az")),
    );
    let err = AciBackend::new(config(&server, 4), Arc::new(chain))
        .unwrap()
        .check(&spec(1), Demand::one(4.0))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::Credentials { .. }), "{text}");
    assert!(
        text.contains("no managed identity answered")
            && text.contains("not installed")
            && text.contains("az login"),
        "{text}"
    );
}

#[tokio::test]
async fn the_chain_remembers_that_the_cli_gave_the_token() {
    let (url, seen) = identity_endpoint(r#"{"error": "invalid_request"}"#.into()).await;
    let dir = tempfile::tempdir().unwrap();
    let expires = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let az = fake_az(
        dir.path(),
        "az",
        &format!(r#"{{"accessToken": "{TOKEN}", "expires_on": {expires}}}"#),
        "",
        0,
    );
    let chain = DefaultAzureToken::new(
        ManagedIdentityToken::with_endpoint(url, None),
        AzCliToken::with_program(az),
    );
    assert_eq!(chain.token().await.unwrap(), TOKEN);
    assert_eq!(chain.token().await.unwrap(), TOKEN);
    assert_eq!(
        seen.lock().unwrap().len(),
        1,
        "the identity endpoint is asked once, then the CLI first"
    );
}
