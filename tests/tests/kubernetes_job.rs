//! Whole jobs on Kubernetes, without a cluster: `physalia submit` with `backend: kubernetes` against
//! `tests/kubernetes/kube_cluster.py`, an API server (HTTPS, bearer tokens) with the Job controller and
//! a kubelet whose pods are real containers of the locally built image on a Docker pod network. The
//! CLI reaches it through a kubeconfig, as a user's would; the coordinator's pod reaches it in-cluster
//! (its ServiceAccount token, `KUBERNETES_SERVICE_HOST`) and the S3 job store (moto) through EKS Pod
//! Identity's credentials endpoint. The shared cluster-mode scenario (`physalia_tests::cluster`) runs
//! here as `cluster_scenario::*`, with the API server throttling every fifth request of each principal
//! (429, `Retry-After: 1`): every object is still created once.
//!
//! The fake enforces infra/k8s's NetworkPolicy on the pods (netfilter rules, so it runs as root);
//! `issue_30_a_network_policy_closing_the_mesh_port_fails_the_job_naming_it` applies a tighter one.
//!
//! Skipped, with a note, where no Docker Engine answers or moto is not installed (or not as root); with
//! `PHYSALIA_REQUIRE_MOTO=1` (CI installs moto) a missing moto fails instead.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use physalia_testkit::{Emulator, Spawn, python};
use physalia_tests::cluster::{
    Cloud, Followed, MotoS3, Refusal, Scenario, catalog_number, containers_on, docker_kill,
};
use physalia_tests::{
    assert_same_losses, build_image, job_id, last_json, local_losses, losses, ok_output,
    physalia_bin, write_job,
};
use serde_json::Value;
use tempfile::TempDir;

/// The catalog SKU of the test jobs: a 16-vCPU AKS node per worker (the fake schedules anything).
const SKU: &str = "aks-d16s-v5";
/// What `tests/kubernetes/kube_cluster.py` calls the coordinator's ServiceAccount token.
const COORDINATOR_TOKEN: &str = "sa.physalia.physalia-coordinator";

/// Every how many requests of a principal the API server throttles (429, `Retry-After: 1`, as API
/// Priority and Fairness does): the CLI's and the coordinator's clients retry them (issue 30).
const THROTTLE_EVERY: &str = "5";

/// The fake cluster, for the life of a test.
struct Kubernetes {
    fake: Emulator,
    s3: MotoS3,
}

impl Kubernetes {
    /// The fake with `args` besides the scenario's throttling (`--network-policy FILE`: FILE applied
    /// instead of infra/k8s's NetworkPolicy).
    fn start_with(args: &[&str]) -> Option<Kubernetes> {
        let fake = Spawn::new("tests/kubernetes/kube_cluster.py")
            .args(&[&["--throttle-every", THROTTLE_EVERY], args].concat())
            .docker()
            .root("the pods' NetworkPolicy rules are netfilter rules (iptables)")
            .python(&["moto", "boto3", "cryptography"])
            .start()?;
        let s3 = MotoS3 {
            endpoint: fake.str("endpoint").to_string(),
            bucket: fake.str("bucket").to_string(),
        };
        Some(Kubernetes { fake, s3 })
    }

    fn info(&self) -> &Value {
        self.fake.info()
    }

    /// The fake's `/_fake/PATH` (the live objects, the requests it served).
    fn fake(&self, path: &str) -> Value {
        python(&format!(
            "import json, ssl, urllib.request\nctx = ssl.create_default_context()\nctx.check_hostname = False\nctx.verify_mode = ssl.CERT_NONE\nprint(urllib.request.urlopen({:?}, context=ctx).read().decode())",
            format!("{}/_fake/{path}", self.fake.str("api"))
        ))
    }

    /// An object of moto's S3 bucket, `None` where it is not there.
    fn s3_object(&self, key: &str) -> Option<String> {
        self.s3.object(key)
    }
}

impl Cloud for Kubernetes {
    const NAME: &'static str = "kubernetes";
    const WORKER_NET: &'static str = "10.244.";

    fn start() -> Option<Kubernetes> {
        Kubernetes::start_with(&[])
    }

    /// A CLI command with a user's settings: the kubeconfig, and AWS (for the S3 job store) at moto.
    fn cli(&self, cwd: &Path, args: &[&str]) -> Command {
        let mut cmd = Command::new(physalia_bin());
        cmd.current_dir(cwd)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("KUBECONFIG", self.fake.str("kubeconfig"));
        self.s3.user_env(&mut cmd, self.fake.str("region"));
        cmd
    }

    fn store(&self) -> String {
        format!("s3://{}/jobs", self.s3.bucket)
    }

    fn record(&self, id: &str, file: &str) -> Option<String> {
        self.s3_object(&format!("jobs/{id}/{file}"))
    }

    fn stored(&self, prefix: &str) -> Vec<(String, String)> {
        self.s3.stored("jobs", prefix)
    }

    fn backend(&self, image: &str) -> String {
        format!(
            "backend:\n  name: kubernetes\n  kubernetes:\n    namespace: physalia\n    image: {image}\n    sku: {SKU}\n"
        )
    }

    /// A node's hourly price per worker-second, and the coordinator's one-vCPU share of it.
    fn prices(&self) -> (f64, f64) {
        let per_s = catalog_number("kubernetes.yaml", SKU, "usd_per_hour:") / 3600.0;
        (per_s, per_s / 16.0)
    }

    /// The running containers of worker pods (every pod but the coordinator's).
    fn worker_containers(&self) -> Vec<String> {
        containers_on(self.fake.str("network"), &|n| {
            n.starts_with("kube-physalia-") && !n.contains("-coordinator-")
        })
    }

    /// Waits (up to a minute) until the cluster holds none of the test's objects but the finished
    /// coordinator Jobs of `detached` jobs (and their pods): a detached job's coordinator Job stays, its
    /// pod completed, for its `ttlSecondsAfterFinished` (an hour; the fake has no TTL controller), so
    /// `logs --rank coordinator` still reads it.
    fn wait_nothing_left(&self, detached: &[&str]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut left = self.fake("objects");
            left.as_array_mut().unwrap().retain(|o| {
                let name = o["name"].as_str().unwrap();
                !detached
                    .iter()
                    .any(|id| name.starts_with(&format!("physalia-{id}-coordinator")))
            });
            if left == Value::Array(vec![]) {
                for id in detached {
                    let job = self.fake(&format!("object/jobs/physalia-{id}-coordinator"));
                    assert!(
                        job["spec"]["ttlSecondsAfterFinished"].as_i64().is_some(),
                        "{job}"
                    );
                    assert_eq!(job["status"]["conditions"][0]["type"], "Complete", "{job}");
                }
                return;
            }
            assert!(Instant::now() < deadline, "left on the cluster: {left}");
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// A namespace that does not exist, an image that is not there: the platform's reason.
    fn refusals(&self, s: &Scenario<'_, Self>, job: &str) -> Vec<Refusal> {
        let text = format!(
            "{job}output: {{dir: {}}}\n{}",
            s.store,
            self.backend(&s.image)
        );
        [
            (
                "backend.kubernetes.namespace=nope",
                ["namespaces \"nope\" not found", "nope"],
            ),
            (
                "backend.kubernetes.image=physalia-worker:not-built",
                ["physalia-worker:not-built", "ErrImageNeverPull"],
            ),
        ]
        .into_iter()
        .map(|(set, needles)| Refusal {
            text: text.clone(),
            sets: vec![set.to_string()],
            needles: needles.iter().map(|n| n.to_string()).collect(),
        })
        .collect()
    }

    /// The coordinator ran in a pod: its hostname is the pod's.
    fn check_coordinator_host(&self, _id: &str, host: &str) {
        assert!(host.starts_with("physalia-"), "{host}");
    }

    fn mark(&self) -> usize {
        self.fake("requests").as_array().unwrap().len()
    }

    /// Who made what: the user the coordinator's Job, the coordinator's ServiceAccount the workers'.
    fn check_followed(&self, _s: &Scenario<'_, Self>, run: &Followed) {
        let requests = self.fake("requests");
        let creates: Vec<(String, String)> = requests.as_array().unwrap()[run.mark..]
            .iter()
            .filter(|r| r["verb"] == "create")
            .map(|r| {
                (
                    r["who"].as_str().unwrap().to_string(),
                    r["resource"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let by = |who: &str| -> Vec<&str> {
            creates
                .iter()
                .filter(|(w, _)| w == who)
                .map(|(_, r)| r.as_str())
                .collect()
        };
        assert_eq!(by(self.fake.str("user_token")), ["jobs"], "{creates:?}");
        assert_eq!(
            by(COORDINATOR_TOKEN),
            ["jobs", "secrets", "services"],
            "{creates:?}"
        );
        // each object above was created once although both principals were throttled on the way
        let throttled = self.fake("throttled");
        for who in [self.fake.str("user_token"), COORDINATOR_TOKEN] {
            assert!(
                throttled[who].as_u64().unwrap_or(0) > 0,
                "the API server never throttled {who}: {throttled}"
            );
        }
    }
}

physalia_tests::cluster_scenario!(crate::Kubernetes);

/// The image of the workers and the coordinator (`physalia image build --with-cli`).
fn image() -> String {
    build_image(&["--with-cli"])
}
/// Issue 14 on Kubernetes: a job whose coordinator pod dies (its container killed) is resumed from the
/// store with `submit --resume STORE/JOB` (refused while the dead coordinator still runs): its workers
/// and the dead pod's Job are deleted, a new coordinator continues from the newest checkpoint, and the
/// job ends with every epoch recorded once and a fixed run's losses; nothing is left.
#[test]
fn issue_14_a_kubernetes_job_whose_coordinator_died_resumes_from_the_store() {
    let Some(cluster) = Kubernetes::start() else {
        return;
    };
    let t = TempDir::new().unwrap();
    // long enough (about 10 s here) that the coordinator is still running when the test kills it: the
    // store's copy trails the job by up to the mirror's 2 s, and 40 epochs could end first
    let job = "name: phoenix\ndataset:\n  synth: {kind: sbm, nodes: 20000, classes: 4, feat_dim: 32, avg_degree: 10, homophily: 0.8, seed: 1}\nmodel: {kind: gcn, layers: 2, hidden: 32}\ntrain: {epochs: 120, seed: 0, threads: 1}\nworkers: 2\n";
    let want = local_losses(t.path(), "job.yaml", job);
    let store = cluster.store();
    write_job(
        t.path(),
        "job.yaml",
        &format!(
            "{job}output: {{dir: {store}}}\n{}",
            cluster.backend(&image())
        ),
    );
    let (out, _) = ok_output(&mut cluster.cli(
        t.path(),
        &["submit", "job.yaml", "--detach", "--output", "json"],
    ));
    let url = last_json(&out)["job_url"].as_str().unwrap().to_string();
    let id = job_id(&url);
    let epochs = || {
        cluster
            .s3_object(&format!("jobs/{id}/metrics.jsonl"))
            .map_or(0, |m| m.lines().count())
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    while epochs() < 3 {
        assert!(Instant::now() < deadline, "the job never reached epoch 3");
        std::thread::sleep(Duration::from_millis(300));
    }
    // while its coordinator runs, resuming is refused
    let out = cluster
        .cli(t.path(), &["submit", "--resume", &url])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("still runs"), "{err}");
    let ps = Command::new("docker")
        .args(["ps", "--format", "{{.Names}}"])
        .output()
        .unwrap();
    let coordinator = String::from_utf8_lossy(&ps.stdout)
        .lines()
        .find(|n| n.starts_with("kube-") && n.contains(&id) && n.contains("-coordinator"))
        .map(String::from)
        .expect("the coordinator's container");
    docker_kill(&coordinator);
    let killed_after = epochs();
    // the platform notices the dead pod within moments; until then resuming is refused as above
    let deadline = Instant::now() + Duration::from_secs(60);
    let resumed = loop {
        let out = cluster
            .cli(t.path(), &["submit", "--resume", &url, "--output", "json"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        if out.status.success() {
            break (String::from_utf8_lossy(&out.stdout).into_owned(), err);
        }
        assert!(
            err.contains("still runs") && Instant::now() < deadline,
            "resume failed: {err}"
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(resumed.1.contains("resuming"), "{}", resumed.1);
    // it succeeded (a failed or cancelled job is an error) and printed the job's summary
    assert_eq!(
        last_json(&resumed.0)["job_url"],
        url.as_str(),
        "{}",
        resumed.0
    );
    let metrics = cluster
        .s3_object(&format!("jobs/{id}/metrics.jsonl"))
        .unwrap();
    let got = losses(&metrics);
    // every epoch once, in order, and the fixed run's losses (training is exact across the resume)
    let numbered: Vec<u64> = metrics
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["metrics"]["epoch"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(numbered, (1..=120).collect::<Vec<u64>>());
    assert_same_losses("kubernetes", &got, &want, 1e-3);
    eprintln!("resumed after its coordinator died at epoch {killed_after}");
    cluster.wait_nothing_left(&[]);
}

/// Issue 30: GPU SKU jobs on GKE-, EKS- and AKS-shaped GPU nodes (the fake schedules by allocatable,
/// labels and taints as those distributions document them) are placed and train, each worker falling
/// back to the CPU in its container: every epoch once, the local run's losses. The GKE job also selects
/// on GKE's accelerator label and the AKS job tolerates AKS's `sku=gpu` taint, as a user's job file
/// would. Today's pods (the whole node, selected by `nvidia.com/gpu.product: <model>`) stay unplaced:
/// the fake bites.
#[test]
fn issue_30_gpu_sku_jobs_are_placed_on_gke_eks_and_aks_gpu_nodes_and_train() {
    let Some(cora) = physalia_tests::cora_dir() else {
        return;
    };
    let Some(cluster) = Kubernetes::start() else {
        return;
    };
    // today's worker pods: the SKU's whole machine, placed by the GPU model's product label
    let today = [
        ("today-gke", "8", "32Gi", "nvidia.com/gpu.product", "L4"),
        ("today-eks", "4", "16Gi", "nvidia.com/gpu.product", "A10G"),
        ("today-aks", "4", "28Gi", "nvidia.com/gpu.product", "T4"),
        // the whole node on the right label is still too big
        (
            "whole-gke",
            "8",
            "32Gi",
            "node.kubernetes.io/instance-type",
            "g2-standard-8",
        ),
        (
            "whole-eks",
            "4",
            "16Gi",
            "node.kubernetes.io/instance-type",
            "g5.xlarge",
        ),
        (
            "whole-aks",
            "4",
            "28Gi",
            "node.kubernetes.io/instance-type",
            "Standard_NC4as_T4_v3",
        ),
    ];
    let pods: Vec<String> = today
        .iter()
        .map(|(name, cpu, mem, key, value)| {
            format!(
                "{{'metadata': {{'name': '{name}'}}, 'spec': {{'containers': [{{'name': 'w', 'image': 'x', \
                 'resources': {{'requests': {{'cpu': '{cpu}', 'memory': '{mem}', 'nvidia.com/gpu': '1'}}, \
                 'limits': {{'nvidia.com/gpu': '1'}}}}}}], 'nodeSelector': {{'{key}': '{value}'}}, \
                 'tolerations': [{{'key': 'nvidia.com/gpu', 'operator': 'Exists', 'effect': 'NoSchedule'}}, \
                 {{'key': 'sku', 'operator': 'Exists'}}]}}}}"
            )
        })
        .collect();
    let code = format!(
        "import json, ssl, time, urllib.error, urllib.request\nctx = ssl.create_default_context()\nctx.check_hostname = False\nctx.verify_mode = ssl.CERT_NONE\n\
         def call(method, path, body=None):\n\
         \x20   req = urllib.request.Request({api:?} + '/api/v1/namespaces/physalia/pods' + path, method=method,\n\
         \x20       data=json.dumps(body).encode() if body else None,\n\
         \x20       headers={{'Authorization': 'Bearer ' + {token:?}, 'Content-Type': 'application/json'}})\n\
         \x20   for _ in range(10):\n\
         \x20       try:\n\
         \x20           return json.loads(urllib.request.urlopen(req, context=ctx).read())\n\
         \x20       except urllib.error.HTTPError as e:\n\
         \x20           # the API server throttles (THROTTLE_EVERY): wait as it says, as clients do\n\
         \x20           if e.code != 429: raise\n\
         \x20           time.sleep(float(e.headers.get('Retry-After', '1')))\n\
         \x20   raise SystemExit('throttled ten times')\n\
         pods = [{pods}]\n\
         for p in pods: call('POST', '', p)\n\
         time.sleep(2)\n\
         out = {{}}\n\
         for p in pods:\n\
         \x20   o = call('GET', '/' + p['metadata']['name'])\n\
         \x20   c = (o['status'].get('conditions') or [{{}}])[0]\n\
         \x20   out[p['metadata']['name']] = [o['spec'].get('nodeName'), o['status']['phase'], c.get('reason')]\n\
         \x20   call('DELETE', '/' + p['metadata']['name'])\n\
         print(json.dumps(out))",
        api = cluster.info()["api"].as_str().unwrap(),
        token = cluster.info()["user_token"].as_str().unwrap(),
        pods = pods.join(", "),
    );
    let placed = python(&code);
    for (name, ..) in today {
        assert_eq!(
            placed[name],
            serde_json::json!([null, "Pending", "Unschedulable"]),
            "{name}: {placed}"
        );
    }

    let t = TempDir::new().unwrap();
    ok_output(
        Command::new(physalia_bin())
            .current_dir(t.path())
            .args(["data", "import"])
            .arg(&cora)
            .args(["--out", "cora.safetensors"]),
    );
    let job = "name: kube-gpu\ndataset:\n  path: cora.safetensors\n  row_normalize: true\nmodel: {kind: gcn, layers: 2, hidden: 16}\ntrain: {epochs: 3, seed: 0, threads: 1}\nworkers: 2\nresources: {gpu: {count: 1}, gpu_fallback: cpu}\n";
    let want = local_losses(t.path(), "local.yaml", job);
    let store = cluster.store();
    for (sku, extra) in [
        (
            "gke-g2-standard-8",
            "    node_selector: {cloud.google.com/gke-accelerator: nvidia-l4}\n",
        ),
        ("eks-g5.xlarge", ""),
        (
            "aks-nc4as-t4-v3",
            "    tolerations: [{key: sku, value: gpu, effect: NoSchedule}]\n",
        ),
    ] {
        let section = cluster
            .backend(&image())
            .replace(&format!("sku: {SKU}"), &format!("sku: {sku}"));
        write_job(
            t.path(),
            "job.yaml",
            &format!("{job}output: {{dir: {store}}}\n{section}{extra}"),
        );
        let (stdout, _) =
            ok_output(&mut cluster.cli(t.path(), &["submit", "job.yaml", "--output", "json"]));
        let id = job_id(last_json(&stdout)["job_url"].as_str().unwrap());
        let metrics = cluster
            .s3_object(&format!("jobs/{id}/metrics.jsonl"))
            .expect("metrics in S3");
        assert_same_losses(sku, &losses(&metrics), &want, 1e-4);
    }
    cluster.wait_nothing_left(&[]);
}

/// Issue 30: the fake enforces NetworkPolicy as the cluster's network plugin would. Under a policy that
/// admits physalia's pods to the coordinator's ports only (a tightened infra/k8s/network-policy.yaml),
/// the workers reach the coordinator but not each other's mesh port: the job fails, naming the endpoint
/// and the port. (The scenario's jobs train under infra/k8s's own policy, which the fake applies by
/// default: it admits them.)
#[test]
fn issue_30_a_network_policy_closing_the_mesh_port_fails_the_job_naming_it() {
    let t = TempDir::new().unwrap();
    let policy = t.path().join("coordinator-ports-only.yaml");
    std::fs::write(
        &policy,
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: physalia-coordinator-ports-only, namespace: physalia}\nspec:\n  podSelector: {matchLabels: {app.kubernetes.io/name: physalia}}\n  policyTypes: [Ingress]\n  ingress:\n    - from: [{podSelector: {matchLabels: {app.kubernetes.io/name: physalia}}}]\n      ports: [{protocol: UDP, port: 7000, endPort: 7007}]\n",
    )
    .unwrap();
    let Some(cluster) = Kubernetes::start_with(&["--network-policy", policy.to_str().unwrap()])
    else {
        return;
    };
    let job = "name: k8s-ports\ndataset:\n  synth: {kind: sbm, nodes: 2000, classes: 4, feat_dim: 16, avg_degree: 8, homophily: 0.8, seed: 1}\nmodel: {kind: gcn, layers: 2, hidden: 16}\ntrain: {epochs: 2, seed: 0, threads: 1}\nworkers: 2\nmax_retries: 0\n\
         timeouts: {epoch_s: 20}\n";
    write_job(
        t.path(),
        "job.yaml",
        &format!(
            "{job}output: {{dir: {}}}\n{}",
            cluster.store(),
            cluster.backend(&image())
        ),
    );
    let out = cluster
        .cli(t.path(), &["submit", "job.yaml"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("waited on it at its mesh endpoint ")
            && err.contains(":7100")
            && err.contains("NetworkPolicy that does not open UDP port 7100"),
        "{err}"
    );
    cluster.wait_nothing_left(&[]);
}
