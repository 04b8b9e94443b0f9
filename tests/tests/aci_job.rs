//! Whole jobs on Azure Container Instances, without Azure: `physalia submit` with `backend: aci`
//! against `tests/aci/aci_cloud.py`, Resource Manager for container groups (every PUT validated against
//! the published ContainerGroup schema) whose containers run the locally built image on a Docker
//! network with the subnet's addresses, the managed identities' metadata service, and Blob Storage for
//! the `az://` job store. The CLI signs in as a user would (`az`, first on PATH); the coordinator's
//! container group creates the workers' groups and writes the record with its managed identity.
//!
//! The shared cluster-mode scenario (`physalia_tests::cluster`) runs here as `cluster_scenario::*`,
//! with Resource Manager throttling every fourth request of each principal (issue 30: 429,
//! `Retry-After: 1`), the signed-in user's (the coordinator's group: its PUT, polls, status, logs,
//! delete) and the coordinator identity's (the workers' groups): every job trains alike all the same,
//! each group the job makes is carried out once, and the fake's counters show that both principals
//! were throttled (so the scenario cannot pass without retries being exercised).
//!
//! `a_port_the_network_security_group_closes_fails_the_job_naming_it` runs the fake with infra/azure
//! applied with narrower `quic_ports`: the NSG the fake enforces is the Terraform's (tests/firewall.py).
//!
//! Skipped, with a note, where no Docker Engine answers or python3 lacks `cryptography` (installed with
//! moto); with `PHYSALIA_REQUIRE_MOTO=1` (CI) a missing python package fails instead. The fake's
//! metadata service listens on 169.254.169.254:80 and needs root; without it the test skips too.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use physalia_testkit::{Emulator, Spawn, python};
use physalia_tests::cluster::{Cloud, Followed, Refusal, Scenario, catalog_number, containers_on};
use physalia_tests::{assert_same_losses, job_id, last_json, local_losses, losses, physalia_bin};
use serde_json::Value;

/// The worker container of the test jobs (the fake does not limit resources).
const SKU: &str = "aci-cpu-2x8";

/// Every how many requests of a principal Resource Manager throttles.
const THROTTLE_EVERY: &str = "4";

/// The fake Azure, for the life of a test; one at a time (its metadata service's address is one per
/// machine).
struct Azure {
    fake: Emulator,
    _one: MutexGuard<'static, ()>,
}

impl Azure {
    /// The fake with `args` besides the scenario's throttling (`--infra-var NAME=VALUE`: infra/azure
    /// as applied with that variable; a `--throttle-every N` of its own replaces the scenario's).
    fn start_with(args: &[&str]) -> Option<Azure> {
        let one = one_fake_at_a_time();
        let mut all = vec!["--throttle-every", THROTTLE_EVERY];
        all.extend_from_slice(args);
        let fake = Spawn::new("tests/aci/aci_cloud.py")
            .args(&all)
            .docker()
            .root("the fake metadata service binds 169.254.169.254:80")
            .python(&["cryptography"])
            .start()?;
        Some(Azure { fake, _one: one })
    }

    fn s(&self, key: &str) -> &str {
        self.fake.str(key)
    }

    /// The fake ARM's `/_fake/PATH` (`groups`, `requests`, `violations`, `throttled`).
    fn fake(&self, path: &str) -> Value {
        self.get(&format!("{}/_fake/{path}", self.s("arm")))
    }

    fn get(&self, url: &str) -> Value {
        python(&format!(
            "import urllib.request\nprint(urllib.request.urlopen({url:?}).read().decode())"
        ))
    }

    /// A blob of the job store as the user reads it, `None` where there is none.
    fn blob(&self, name: &str) -> Option<String> {
        let url = format!("{}/{}/{name}", self.s("blob"), self.s("container"));
        python(&format!(
            "import json, urllib.request, urllib.error\nreq = urllib.request.Request({url:?}, headers={{'Authorization': 'Bearer user.storage'}})\ntry:\n    print(json.dumps(urllib.request.urlopen(req).read().decode()))\nexcept urllib.error.HTTPError as e:\n    assert e.code == 404, e\n    print('null')"
        ))
        .as_str()
        .map(String::from)
    }

    /// What the fake's Blob Storage was asked, in order (`who`, `method`, `path`, `comp`, `bytes`).
    fn blob_requests(&self) -> Vec<Value> {
        let url = format!(
            "{}/_fake/requests",
            self.s("blob").rsplit_once('/').unwrap().0
        );
        serde_json::from_value(self.get(&url)).expect("a list of requests")
    }

    fn assert_no_violations(&self) {
        let v = self.fake("violations");
        assert_eq!(v, Value::Array(vec![]), "requests the ARM schema refuses");
    }
}

/// The fake's metadata service address is one per machine: its tests run one at a time.
fn one_fake_at_a_time() -> MutexGuard<'static, ()> {
    static FAKE: Mutex<()> = Mutex::new(());
    FAKE.lock().unwrap_or_else(|e| e.into_inner())
}

impl Cloud for Azure {
    const NAME: &'static str = "aci";
    const WORKER_NET: &'static str = "10.246.";

    fn start() -> Option<Azure> {
        Azure::start_with(&[])
    }

    /// A CLI command as a signed-in user runs it: `az` on PATH, the storage account named.
    fn cli(&self, cwd: &Path, args: &[&str]) -> Command {
        let mut cmd = Command::new(physalia_bin());
        let path = format!(
            "{}:{}",
            self.s("bin"),
            std::env::var("PATH").unwrap_or_default()
        );
        cmd.current_dir(cwd)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("PATH", path)
            .env("AZURE_STORAGE_ACCOUNT_NAME", self.s("account"))
            // the test's Blob Storage is the fake, in plain HTTP
            .env("AZURE_STORAGE_ENDPOINT", self.s("blob"))
            .env("AZURE_ALLOW_HTTP", "true");
        for key in [
            "AZURE_CLIENT_ID",
            "AZURE_USE_AZURE_CLI",
            "AZURE_STORAGE_ACCOUNT_KEY",
            "AZURE_MSI_RESOURCE_ID",
        ] {
            cmd.env_remove(key);
        }
        cmd
    }

    fn store(&self) -> String {
        format!("az://{}/runs", self.s("container"))
    }

    fn record(&self, id: &str, file: &str) -> Option<String> {
        self.blob(&format!("runs/{id}/{file}"))
    }

    /// The blobs under `runs/<prefix>` with their ETags (List Blobs as the user, page by page).
    fn stored(&self, prefix: &str) -> Vec<(String, String)> {
        let url = format!(
            "{}/{}?restype=container&comp=list&prefix=runs/{prefix}",
            self.s("blob"),
            self.s("container")
        );
        let v = python(&format!(
            "import json, urllib.parse, urllib.request
from xml.etree import ElementTree
out, marker = [], ''
while True:
    req = urllib.request.Request({url:?} + '&marker=' + urllib.parse.quote(marker), headers={{'Authorization': 'Bearer user.storage'}})
    root = ElementTree.fromstring(urllib.request.urlopen(req).read())
    out += [[b.findtext('Name')[len('runs/'):], b.findtext('Properties/Etag')] for b in root.iter('Blob')]
    marker = root.findtext('NextMarker') or ''
    if not marker:
        break
print(json.dumps(out))"
        ));
        serde_json::from_value(v).unwrap()
    }

    fn backend(&self, image: &str) -> String {
        format!(
            "backend:\n  name: aci\n  aci:\n    subscription_id: {}\n    resource_group: {}\n    location: {}\n    subnet_id: {}\n    image: {image}\n    coordinator_identity_id: {}\n    sku: {SKU}\n    arm_endpoint: {}\n",
            self.s("subscription"),
            self.s("resource_group"),
            self.s("location"),
            self.s("subnet_id"),
            self.s("coordinator_identity_id"),
            self.s("arm"),
        )
    }

    /// The SKU's vCPUs and GiB at the catalog's prices, and the coordinator's 1 vCPU / 2 GiB.
    fn prices(&self) -> (f64, f64) {
        let num = |key: &str| catalog_number("azure-aci.yaml", SKU, key);
        let (per_vcpu, per_gib) = (num("usd_per_vcpu_second:"), num("usd_per_gib_second:"));
        (
            per_vcpu * num("vcpus:") + per_gib * num("memory_gib:"),
            per_vcpu + 2.0 * per_gib,
        )
    }

    /// The running worker containers (every group's but the coordinators').
    fn worker_containers(&self) -> Vec<String> {
        containers_on(self.s("network"), &|n| {
            n.starts_with("aci-physalia-") && !n.contains("-coordinator")
        })
    }

    /// Waits (up to a minute) until no container group is left but the finished coordinator groups of
    /// `detached` jobs, which stay (stopped: ACI bills nothing for them) so that `logs --rank
    /// coordinator` still reads them; a followed or cancelled job's are deleted.
    fn wait_nothing_left(&self, detached: &[&str]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let groups = self.fake("groups");
            let left: Vec<(&String, &Value)> = groups
                .as_object()
                .unwrap()
                .iter()
                .filter(|(name, _)| {
                    !detached
                        .iter()
                        .any(|id| name.starts_with(&format!("physalia-{id}-coordinator")))
                })
                .collect();
            if left.is_empty() {
                for (name, g) in groups.as_object().unwrap() {
                    assert_eq!(
                        g["properties"]["instanceView"]["state"], "Succeeded",
                        "{name}: {g}"
                    );
                }
                return;
            }
            let names: Vec<&String> = left.iter().map(|(n, _)| *n).collect();
            assert!(
                Instant::now() < deadline,
                "left in the resource group: {names:?}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// ARM's reason, nothing created: a subnet that does not exist, an image that is not there.
    fn refusals(&self, s: &Scenario<'_, Self>, job: &str) -> Vec<Refusal> {
        let text = format!(
            "{job}output: {{dir: {}}}\n{}",
            s.store,
            self.backend(&s.image)
        );
        let sub = self
            .s("subnet_id")
            .replace("/subnets/workers", "/subnets/nope");
        [
            (
                format!("backend.aci.subnet_id={sub}"),
                ["InvalidSubnet", "subnets/nope"],
            ),
            (
                "backend.aci.image=physalia-worker:not-built".to_string(),
                ["physalia-worker:not-built", "InaccessibleImage"],
            ),
        ]
        .into_iter()
        .map(|(set, needles)| Refusal {
            text: text.clone(),
            sets: vec![set],
            needles: needles.iter().map(|n| n.to_string()).collect(),
        })
        .collect()
    }

    /// The coordinator ran in its container group (its hostname), not here.
    fn check_coordinator_host(&self, id: &str, host: &str) {
        assert!(host.starts_with(&format!("physalia-{id}")), "{host}");
    }

    fn mark(&self) -> usize {
        self.fake("requests").as_array().unwrap().len()
    }

    /// Who made what: the user the coordinator's group, the coordinator's identity the 3 workers',
    /// each carried out once however often it was throttled; the coordinator's identity wrote the
    /// record (the user only started the job). Then the chunked dataset's job (issue 31), whose workers
    /// read their chunk files from Blob Storage with the coordinator identity's user delegation SAS.
    fn check_followed(&self, s: &Scenario<'_, Self>, run: &Followed) {
        let id = &run.id;
        let requests = self.fake("requests");
        let requests = &requests.as_array().unwrap()[run.mark..];
        let puts: Vec<(String, String)> = requests
            .iter()
            .filter(|r| r["method"] == "PUT" && r["throttled"] != true)
            .map(|r| {
                (
                    r["who"].as_str().unwrap_or("?").to_string(),
                    r["path"]
                        .as_str()
                        .unwrap()
                        .rsplit('/')
                        .next()
                        .unwrap()
                        .to_string(),
                )
            })
            .collect();
        let by = |who: &str| -> Vec<&str> {
            puts.iter()
                .filter(|(w, _)| w == who)
                .map(|(_, g)| g.as_str())
                .collect()
        };
        assert_eq!(
            by("user"),
            [format!("physalia-{id}-coordinator")],
            "{puts:?}"
        );
        let mut workers = by("physalia-coordinator");
        workers.sort();
        assert_eq!(workers.len(), 3, "{puts:?}");
        assert!(
            workers
                .iter()
                .all(|g| g.starts_with(&format!("physalia-{id}")))
        );
        // every throttled request was sent again: each group the job made was PUT and carried out once
        assert_eq!(
            puts.len(),
            4,
            "the coordinator's group and 3 workers' groups, each carried out once: {requests:?}"
        );
        let blob_requests = self.blob_requests();
        assert!(
            blob_requests
                .iter()
                .any(|r| r["who"] == "physalia-coordinator"
                    && r["method"] == "PUT"
                    && r["path"].as_str().unwrap().ends_with("/summary.json")),
            "the coordinator wrote its summary with its managed identity"
        );
        physalia_tests::cluster::chunked_cluster_job(self, s);
        // the workers' chunk reads went to Blob Storage with the coordinator identity's user
        // delegation SAS, no token of their own
        let blob_requests = self.blob_requests();
        let sas_reads = blob_requests
            .iter()
            .filter(|r| {
                r["who"] == "sas:physalia-coordinator"
                    && r["method"] == "GET"
                    && r["path"].as_str().unwrap().contains("-sbm/")
            })
            .count();
        assert!(sas_reads > 0, "no chunk was read with a SAS");
        // one user delegation key per coordinator, cached for the SAS it signs (not one per chunk)
        let keys = blob_requests
            .iter()
            .filter(|r| r["method"] == "POST" && r["comp"] == "userdelegationkey")
            .count();
        assert!(
            (1..=2).contains(&keys),
            "{keys} delegation keys for {sas_reads} chunk reads by 2 jobs' coordinators"
        );
    }

    /// No request the ARM schema refuses; both principals were throttled.
    fn finish(&self) {
        self.assert_no_violations();
        let throttled = self.fake("throttled");
        let count = |who: &str| throttled[who].as_u64().unwrap_or(0);
        assert!(
            count("user") > 0 && count("physalia-coordinator") > 0,
            "both principals were throttled: {throttled}"
        );
        let requests = self.fake("requests");
        eprintln!(
            "aci: Resource Manager throttled {throttled} of {} requests",
            requests.as_array().unwrap().len()
        );
    }
}

physalia_tests::cluster_scenario!(crate::Azure);

/// Issue 30: the fake's network security group is infra/azure's as applied. With `quic_ports`
/// narrowed to 7000-7099 the default mesh port 7100 is closed between the workers' groups: the job
/// fails, and says which endpoint and port; `backend.aci.mesh_port` inside the range trains it to the
/// local run's losses. Resource Manager throttles every third request of each principal here (the
/// scenario's every fourth), and both principals are throttled.
#[test]
fn a_port_the_network_security_group_closes_fails_the_job_naming_it() {
    let Some(cloud) = Azure::start_with(&[
        "--throttle-every",
        "3",
        "--infra-var",
        "quic_ports=7000-7099",
    ]) else {
        return;
    };
    let s = Scenario::new(&cloud);
    let job = "name: aci-ports\ndataset:\n  synth: {kind: sbm, nodes: 2000, classes: 4, feat_dim: 16, avg_degree: 8, homophily: 0.8, seed: 1}\nmodel: {kind: gcn, layers: 2, hidden: 16}\ntrain: {epochs: 2, seed: 0, threads: 1}\nworkers: 2\nmax_retries: 0\n\
         timeouts: {epoch_s: 20}\n";
    let want = local_losses(s.path(), "local.yaml", job);

    s.write_cluster_job("job.yaml", job);
    let out = s.cli(&["submit", "job.yaml"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    // worker 0 dialled worker 1's mesh endpoint on the closed port until the coordinator stopped the
    // job: the error names the endpoint and the port
    assert!(
        err.contains("waited on it at its mesh endpoint 10.246.")
            && err.contains(":7100")
            && err.contains("does not open UDP port 7100"),
        "{err}"
    );
    let (list, _) = s.ok(&["list", &s.store, "--output", "json"]);
    let list = last_json(&list);
    let failed: Vec<&Value> = list.as_array().unwrap().iter().collect();
    assert_eq!(failed.len(), 1, "{list}");
    let status = s.status(failed[0]["job"].as_str().unwrap());
    assert_eq!(status["state"], "failed", "{status}");
    cloud.wait_nothing_left(&[]);

    let path = s.path().join("job.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("  aci:\n", "  aci:\n    mesh_port: 7050\n"),
    )
    .unwrap();
    let (stdout, _) = s.ok(&["submit", "job.yaml", "--output", "json"]);
    let id = job_id(last_json(&stdout)["job_url"].as_str().unwrap());
    assert_eq!(s.status(&id)["state"], "succeeded");
    let metrics = cloud
        .record(&id, "metrics.jsonl")
        .expect("metrics in the store");
    assert_same_losses("aci", &losses(&metrics), &want, 1e-4);
    cloud.wait_nothing_left(&[]);
    cloud.finish();
}
