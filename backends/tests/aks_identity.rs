//! The coordinator's pod on AKS reaches Azure through workload identity (issue 30): AKS's webhook
//! mutates only pods labelled `azure.workload.identity/use: "true"` (its MutatingWebhookConfiguration's
//! `objectSelector`), injecting the federated token and the `AZURE_*` variables; an unlabelled pod gets
//! nothing and an `az://` job store cannot be reached. The label is set when the job store is Azure or
//! the configuration says the cluster is AKS with workload identity; the configuration's client id
//! reaches the container as `AZURE_CLIENT_ID` (the webhook adds only variables a container lacks, so
//! it stands where the ServiceAccount carries no `azure.workload.identity/client-id` annotation).
//!
//! The Job is checked against a golden file (`BLESS=1` rewrites it) and validated by
//! `kubernetes-validate --strict` (1.30 and 1.37), skipped where it is not installed unless
//! `PHYSALIA_REQUIRE_K8S_VALIDATE=1`.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use physalia_backends::CoordinatorSpec;
use physalia_backends::kubernetes::objects::{
    AZURE_WORKLOAD_IDENTITY_USE, AzureWorkloadIdentity, uses_azure_workload_identity,
};
use physalia_backends::kubernetes::{KubernetesConfig, coordinator_job};
use serde_json::Value;

const CLIENT_ID: &str = "c0000000-0000-0000-0000-00000000c001";

fn spec(store: &str, env: &[(&str, &str)]) -> CoordinatorSpec {
    CoordinatorSpec {
        job_id: "cora-1732000000".into(),
        image: "ghcr.io/physalia/physalia:0.1.0".into(),
        command: vec![
            "physalia".into(),
            "coordinate".into(),
            format!("{store}/cora-1732000000"),
            "--control-port".into(),
            "7000".into(),
        ],
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        cpu: 1.0,
        memory_gib: 2.0,
        control_port: 7000,
        labels: BTreeMap::new(),
    }
}

fn aks() -> KubernetesConfig {
    KubernetesConfig {
        azure_workload_identity: Some(AzureWorkloadIdentity {
            client_id: Some(CLIENT_ID.into()),
        }),
        ..KubernetesConfig::default()
    }
}

fn job(cfg: &KubernetesConfig, spec: &CoordinatorSpec) -> Value {
    serde_json::to_value(coordinator_job(cfg, spec)).unwrap()
}

/// The pod template's label for the webhook (`None` where it is absent).
fn pod_label(job: &Value) -> Option<&str> {
    job["spec"]["template"]["metadata"]["labels"][AZURE_WORKLOAD_IDENTITY_USE].as_str()
}

fn env(job: &Value, name: &str) -> Option<String> {
    job["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
        .map(|e| e["value"].as_str().unwrap().to_string())
}

/// Issue 30: an `az://` job store labels the coordinator's pod, on any cluster; an S3 or GCS store on a
/// cluster not configured as AKS does not.
#[test]
fn issue_30_an_az_job_store_labels_the_coordinator_pod_for_workload_identity() {
    let cfg = KubernetesConfig::default();
    for store in [
        "az://jobs/runs",
        "abfss://jobs@physaliastore.dfs.core.windows.net/runs",
        "https://physaliastore.blob.core.windows.net/jobs/runs",
    ] {
        let j = job(&cfg, &spec(store, &[]));
        assert_eq!(pod_label(&j), Some("true"), "{store}");
        // the webhook selects pods: the Job itself is not labelled
        assert!(
            j["metadata"]["labels"][AZURE_WORKLOAD_IDENTITY_USE].is_null(),
            "{store}"
        );
        // no client id configured: the ServiceAccount's annotation gives it, nothing here sets it
        assert_eq!(env(&j, "AZURE_CLIENT_ID"), None, "{store}");
    }
    // the account submit hands on only for an Azure store
    let j = job(
        &cfg,
        &spec("az://jobs/runs", &[("AZURE_STORAGE_ACCOUNT_NAME", "acct")]),
    );
    assert_eq!(pod_label(&j), Some("true"));
    for store in ["s3://physalia-jobs/runs", "gs://physalia-jobs/runs"] {
        let s = spec(store, &[]);
        assert!(!uses_azure_workload_identity(&cfg, &s), "{store}");
        assert_eq!(pod_label(&job(&cfg, &s)), None, "{store}");
    }
}

/// Issue 30: a cluster configured as AKS with workload identity labels the pod whatever the store, and
/// its identity's client id is the container's `AZURE_CLIENT_ID` unless the spec sets one.
#[test]
fn issue_30_an_aks_config_labels_the_pod_and_gives_the_identity_client_id() {
    let j = job(&aks(), &spec("s3://physalia-jobs/runs", &[]));
    assert_eq!(pod_label(&j), Some("true"));
    assert_eq!(env(&j, "AZURE_CLIENT_ID").as_deref(), Some(CLIENT_ID));
    let j = job(
        &aks(),
        &spec("az://jobs/runs", &[("AZURE_CLIENT_ID", "from-the-spec")]),
    );
    assert_eq!(env(&j, "AZURE_CLIENT_ID").as_deref(), Some("from-the-spec"));
    let names: Vec<&Value> = j["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "AZURE_CLIENT_ID")
        .collect();
    assert_eq!(names.len(), 1, "one AZURE_CLIENT_ID: {names:?}");
    // AKS without a client id: labelled, the ServiceAccount's annotation names the identity
    let cfg = KubernetesConfig {
        azure_workload_identity: Some(AzureWorkloadIdentity::default()),
        ..KubernetesConfig::default()
    };
    let j = job(&cfg, &spec("gs://physalia-jobs/runs", &[]));
    assert_eq!(pod_label(&j), Some("true"));
    assert_eq!(env(&j, "AZURE_CLIENT_ID"), None);
}

/// The AKS coordinator's Job against a golden file, valid against the Kubernetes schemas.
#[test]
fn golden_aks_coordinator_job() {
    let j = coordinator_job(
        &aks(),
        &spec("az://jobs/runs", &[("AZURE_STORAGE_ACCOUNT_NAME", "acct")]),
    );
    let actual = serde_json::to_string_pretty(&j).unwrap() + "\n";
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kubernetes/golden/coordinator-aks.json");
    if std::env::var("BLESS").as_deref() == Ok("1") {
        std::fs::write(&path, &actual).unwrap();
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with BLESS=1 to create it)", path.display()));
    assert_eq!(expected, actual, "BLESS=1 rewrites {}", path.display());

    let found = Command::new("kubernetes-validate")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert_ne!(
            std::env::var("PHYSALIA_REQUIRE_K8S_VALIDATE").as_deref(),
            Ok("1"),
            "kubernetes-validate is required here: pip install kubernetes-validate"
        );
        println!("skipping the schema check: kubernetes-validate not installed");
        return;
    }
    let mut obj: Value = serde_json::from_str(&actual).unwrap();
    obj["apiVersion"] = "batch/v1".into();
    obj["kind"] = "Job".into();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("coordinator-aks.json");
    std::fs::write(&file, obj.to_string()).unwrap();
    for version in ["1.30.0", "1.37.0"] {
        let out = Command::new("kubernetes-validate")
            .args(["--strict", "--no-warn", "-k", version])
            .arg(&file)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && !text.contains("ERROR"),
            "kubernetes {version}:\n{text}"
        );
    }
}
