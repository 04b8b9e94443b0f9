//! Whole jobs on Azure Container Instances, without Azure: `physalia submit` with `backend: aci`
//! against `tests/aci/aci_cloud.py`, Resource Manager for container groups (every PUT validated against
//! the published ContainerGroup schema) whose containers run the locally built image on a Docker
//! network with the subnet's addresses, the managed identities' metadata service, and Blob Storage for
//! the `az://` job store. The CLI signs in as a user would (`az`, first on PATH); the coordinator's
//! container group creates the workers' groups and writes the record with its managed identity.
//!
//! Skipped, with a note, where no Docker Engine answers or python3 lacks `cryptography` (installed with
//! moto); with `PHYSALIA_REQUIRE_MOTO=1` (CI) a missing python package fails instead. The fake's
//! metadata service listens on 169.254.169.254:80 and needs root; without it the test skips too.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use physalia_tests::{
    assert_same_losses, build_image, job_id, last_json, local_losses, losses, ok_output,
    physalia_bin, repo_root, wait_for_job, write_job,
};
use serde_json::Value;
use tempfile::TempDir;

/// The worker container of the test jobs (the fake does not limit resources).
const SKU: &str = "aci-cpu-2x8";

/// The fake Azure, for the life of a test.
struct Azure {
    child: Child,
    stdin: Option<ChildStdin>,
    info: Value,
}

impl Azure {
    /// `None` (and a note) where the test cannot run here. `args` go to the fake
    /// (`--throttle-every N`).
    fn start(args: &[&str]) -> Option<Azure> {
        let required = std::env::var("PHYSALIA_REQUIRE_MOTO").as_deref() == Ok("1");
        let docker = Command::new("docker")
            .args(["info", "--format", "{{.ServerVersion}}"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !docker {
            eprintln!("skipping: no Docker Engine answers");
            return None;
        }
        let root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.trim_ascii() == b"0");
        if !root {
            eprintln!(
                "skipping: the fake metadata service binds 169.254.169.254:80, which needs root"
            );
            return None;
        }
        let python = Command::new("python3")
            .args(["-c", "import cryptography"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !python {
            let why = "python3 has no `cryptography` (pip install 'moto[server]==5.2.1' brings it)";
            assert!(!required, "PHYSALIA_REQUIRE_MOTO=1 but {why}");
            eprintln!("skipping: {why}");
            return None;
        }
        let mut child = Command::new("python3")
            .arg(repo_root().join("tests/aci/aci_cloud.py"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let info: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("the fake Azure said {line:?}: {e}"));
        let stdin = child.stdin.take();
        Some(Azure { child, stdin, info })
    }

    fn s(&self, key: &str) -> &str {
        self.info[key].as_str().unwrap()
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

    /// The fake ARM's `/_fake/PATH` (`groups`, `requests`, `violations`).
    fn fake(&self, path: &str) -> Value {
        self.get(&format!("{}/_fake/{path}", self.s("arm")))
    }

    fn get(&self, url: &str) -> Value {
        let code = format!(
            "import urllib.request\nprint(urllib.request.urlopen({url:?}).read().decode())"
        );
        let out = Command::new("python3")
            .args(["-c", &code])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// A blob of the job store as the user reads it, `None` where there is none.
    fn blob(&self, name: &str) -> Option<String> {
        let url = format!("{}/{}/{name}", self.s("blob"), self.s("container"));
        let code = format!(
            "import json, urllib.request, urllib.error\nreq = urllib.request.Request({url:?}, headers={{'Authorization': 'Bearer user.storage'}})\ntry:\n    print(json.dumps(urllib.request.urlopen(req).read().decode()))\nexcept urllib.error.HTTPError as e:\n    assert e.code == 404, e\n    print('null')"
        );
        let out = Command::new("python3")
            .args(["-c", &code])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<Value>(&out.stdout)
            .unwrap()
            .as_str()
            .map(String::from)
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

    /// The running worker containers (every group's but the coordinators').
    fn worker_containers(&self) -> Vec<String> {
        let ps = Command::new("docker")
            .args([
                "ps",
                "--format",
                "{{.Names}}",
                "--filter",
                &format!("network={}", self.s("network")),
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&ps.stdout)
            .lines()
            .filter(|n| n.starts_with("aci-physalia-") && !n.contains("-coordinator"))
            .map(String::from)
            .collect()
    }

    fn assert_no_violations(&self) {
        let v = self.fake("violations");
        assert_eq!(v, Value::Array(vec![]), "requests the ARM schema refuses");
    }
}

impl Drop for Azure {
    fn drop(&mut self) {
        // closing its standard input stops it; it removes its containers and network
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

/// The fake's metadata service address is one per machine: its tests run one at a time.
fn one_fake_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static FAKE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    FAKE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The catalog's ACI prices: (per vCPU-second, per GiB-second) of [`SKU`], and its vCPUs and GiB.
fn aci_price() -> (f64, f64, f64, f64) {
    let text = std::fs::read_to_string(repo_root().join("infra/catalog/azure-aci.yaml")).unwrap();
    let at = text.find(&format!("name: {SKU}")).unwrap();
    let rest = &text[at..];
    let num = |key: &str| -> f64 {
        let i = rest.find(key).unwrap() + key.len();
        rest[i..]
            .trim_start()
            .split(['}', ',', '\n'])
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    (
        num("usd_per_vcpu_second:"),
        num("usd_per_gib_second:"),
        num("vcpus:"),
        num("memory_gib:"),
    )
}

/// Issue 14 on ACI, cluster mode, in one test (the metadata service's address is one per machine):
///
/// 1. `submit` (followed) uploads Cora to the Blob job store, creates the coordinator's container group
///    as the signed-in user; the coordinator, with its managed identity, creates 3 workers' groups and
///    trains to a local 3-process run's losses; the record is in Blob Storage; the ledger is
///    worker-seconds at the SKU's price plus the coordinator's 1 vCPU / 2 GiB; nothing is left.
/// 2. Bad settings are refused with ARM's reason, before anything is created: a subnet that does not
///    exist, an image that is not there.
/// 3. A detached job whose worker container is killed has its epoch retried from the checkpoint and
///    ends with a fixed run's losses; `status`, `logs` and `report` read the store.
/// 4. A running job is cancelled: no container group is left.
#[test]
fn issue_14_jobs_in_cluster_mode_on_azure_container_instances() {
    let Some(cora) = physalia_tests::cora_dir() else {
        return;
    };
    let _one = one_fake_at_a_time();
    let Some(azure) = Azure::start(&[]) else {
        return;
    };
    let image = build_image(&["--with-cli"]);
    let t = TempDir::new().unwrap();
    ok_output(
        Command::new(physalia_bin())
            .current_dir(t.path())
            .args(["data", "import"])
            .arg(&cora)
            .args(["--out", "cora.safetensors"]),
    );
    let job = "name: aci\ndataset:\n  path: cora.safetensors\n  row_normalize: true\nmodel: {kind: gcn, layers: 2, hidden: 16}\ntrain: {epochs: 20, seed: 0, threads: 1}\nworkers: 3\n";
    let want = local_losses(t.path(), "job.yaml", job);
    let store = azure.store();
    write_job(
        t.path(),
        "job.yaml",
        &format!("{job}output: {{dir: {store}}}\n{}", azure.backend(&image)),
    );

    // 1. followed
    let t0 = Instant::now();
    let (stdout, stderr) =
        ok_output(&mut azure.cli(t.path(), &["submit", "job.yaml", "--output", "json"]));
    let took = t0.elapsed();
    assert_eq!(
        stderr.lines().filter(|l| l.starts_with("epoch ")).count(),
        20,
        "the per-epoch lines of a local job: {stderr}"
    );
    let id = job_id(last_json(&stdout)["job_url"].as_str().unwrap());
    let metrics = azure
        .blob(&format!("runs/{id}/metrics.jsonl"))
        .expect("metrics in the Blob store");
    assert_same_losses("aci", &losses(&metrics), &want, 1e-4);
    let status: Value =
        serde_json::from_str(&azure.blob(&format!("runs/{id}/status.json")).unwrap()).unwrap();
    assert_eq!(status["state"], "succeeded", "{status}");
    // the coordinator ran in its container group (its hostname), not here
    let host = status["coordinator"]["host"].as_str().unwrap();
    assert!(host.starts_with(&format!("physalia-{id}")), "{status}");
    // who made what: the user the coordinator's group, the coordinator's identity the workers'
    let requests = azure.fake("requests");
    let puts: Vec<(String, String)> = requests
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["method"] == "PUT")
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
    // the record was written by the coordinator's identity (the user only started the job)
    let blob_requests = azure.get(&format!(
        "{}/_fake/requests",
        azure.s("blob").rsplit_once('/').unwrap().0
    ));
    assert!(
        blob_requests
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["who"] == "physalia-coordinator"
                && r["method"] == "PUT"
                && r["path"].as_str().unwrap().ends_with("/summary.json")),
        "the coordinator wrote its summary with its managed identity"
    );
    // the ledger: worker-seconds at the SKU's price plus the coordinator's 1 vCPU / 2 GiB
    let summary: Value =
        serde_json::from_str(&azure.blob(&format!("runs/{id}/summary.json")).unwrap()).unwrap();
    let (usd, ws, cs, cp) = (
        summary["usd_total"].as_f64().unwrap(),
        summary["worker_seconds"].as_f64().unwrap(),
        summary["coordinator_seconds"].as_f64().unwrap(),
        summary["coordinator_usd_per_s"].as_f64().unwrap(),
    );
    let (per_vcpu, per_gib, vcpus, gib) = aci_price();
    let worker_per_s = per_vcpu * vcpus + per_gib * gib;
    assert!(ws > 0.0 && cs > 0.0, "{summary}");
    assert!((cp - (per_vcpu + 2.0 * per_gib)).abs() < 1e-15, "{cp}");
    let want_usd = ws * worker_per_s + cs * cp;
    assert!(
        (usd - want_usd).abs() <= 1e-9 + 1e-6 * want_usd,
        "{usd} vs {want_usd}"
    );
    eprintln!(
        "aci cluster-mode Cora: {:.1} s end to end, {ws:.1} worker-s, {cs:.1} coordinator-s, ${usd:.6}",
        took.as_secs_f64()
    );
    azure.wait_nothing_left(&[]);

    // 2. bad settings: ARM's reason, nothing created
    let sub = azure
        .s("subnet_id")
        .replace("/subnets/workers", "/subnets/nope");
    for (set, needles) in [
        (
            format!("backend.aci.subnet_id={sub}"),
            vec!["InvalidSubnet", "subnets/nope"],
        ),
        (
            "backend.aci.image=physalia-worker:not-built".to_string(),
            vec!["physalia-worker:not-built", "InaccessibleImage"],
        ),
    ] {
        let out = azure
            .cli(t.path(), &["submit", "job.yaml", "--set", &set])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{set}: {err}");
        for n in needles {
            assert!(err.contains(n), "{set}: {err}");
        }
        azure.wait_nothing_left(&[]);
    }

    // 3. detached, a worker lost and its epoch retried
    let heal = "name: heal\ndataset:\n  synth: {kind: sbm, nodes: 20000, classes: 4, feat_dim: 32, avg_degree: 10, homophily: 0.8, seed: 1}\nmodel: {kind: gcn, layers: 2, hidden: 32}\ntrain: {epochs: 200, seed: 0, threads: 1}\nworkers: 2\n";
    let want = local_losses(t.path(), "heal.yaml", heal);
    write_job(
        t.path(),
        "heal.yaml",
        &format!("{heal}output: {{dir: {store}}}\n{}", azure.backend(&image)),
    );
    let (out, _) = ok_output(&mut azure.cli(
        t.path(),
        &["submit", "heal.yaml", "--detach", "--output", "json"],
    ));
    let id = job_id(last_json(&out)["job_url"].as_str().unwrap());
    let cli = |args: &[&str]| azure.cli(t.path(), args);
    let wait = |id: &str, done: &dyn Fn(&str, u64) -> bool| wait_for_job(&cli, &store, id, done);
    wait(&id, &|_, e| e >= 3);
    let running = azure.worker_containers();
    assert!(!running.is_empty(), "no worker container runs");
    let killed = Command::new("docker")
        .args(["kill", &running[0]])
        .output()
        .unwrap();
    assert!(killed.status.success());
    let (state, _) = wait(&id, &|s, _| s != "running" && s != "absent");
    assert_eq!(state, "succeeded");
    let metrics = azure.blob(&format!("runs/{id}/metrics.jsonl")).unwrap();
    assert_same_losses("aci", &losses(&metrics), &want, 1e-3);
    let summary: Value =
        serde_json::from_str(&azure.blob(&format!("runs/{id}/summary.json")).unwrap()).unwrap();
    let events = summary["scaling_events"].to_string();
    assert!(
        events.contains("retr"),
        "the lost worker's epoch was retried: {events}"
    );
    let (text, _) =
        ok_output(&mut azure.cli(t.path(), &["logs", &id, "--dir", &store, "--rank", "1"]));
    assert!(text.contains("advertised 10.246."), "{text}");
    let (text, _) = ok_output(&mut azure.cli(
        t.path(),
        &["logs", &id, "--dir", &store, "--rank", "coordinator"],
    ));
    assert!(!text.is_empty());
    ok_output(&mut azure.cli(
        t.path(),
        &["report", &format!("{store}/{id}"), "--out", "r.html"],
    ));
    assert!(
        std::fs::read_to_string(t.path().join("r.html"))
            .unwrap()
            .contains("<svg")
    );
    azure.wait_nothing_left(&[&id]);
    let finished = id;

    // 4. a running job, cancelled through the store
    let (out, _) = ok_output(&mut azure.cli(
        t.path(),
        &[
            "submit",
            "heal.yaml",
            "--detach",
            "--output",
            "json",
            "--set",
            "train.epochs=100000",
            "--set",
            "name=cancelme",
        ],
    ));
    let id = job_id(last_json(&out)["job_url"].as_str().unwrap());
    wait(&id, &|_, e| e >= 2);
    ok_output(&mut azure.cli(t.path(), &["cancel", &id, "--dir", &store]));
    let (state, _) = wait(&id, &|s, _| s != "running");
    assert_eq!(state, "cancelled");
    azure.wait_nothing_left(&[&finished]);
    azure.assert_no_violations();
}

/// Issue 30 on ACI: Resource Manager throttles every third request of each principal (429,
/// `Retry-After: 1`), the signed-in user's (the coordinator's group: its PUT, polls, status, logs,
/// delete) and the coordinator identity's (the workers' groups). A followed cluster-mode Cora job
/// trains to a local run's losses all the same, nothing is left, and the fake's counters show that
/// both principals were throttled (so the test cannot pass without retries being exercised).
#[test]
fn issue_30_a_job_trains_alike_while_arm_throttles_every_third_request() {
    let Some(cora) = physalia_tests::cora_dir() else {
        return;
    };
    let _one = one_fake_at_a_time();
    let Some(azure) = Azure::start(&["--throttle-every", "3"]) else {
        return;
    };
    let image = build_image(&["--with-cli"]);
    let t = TempDir::new().unwrap();
    ok_output(
        Command::new(physalia_bin())
            .current_dir(t.path())
            .args(["data", "import"])
            .arg(&cora)
            .args(["--out", "cora.safetensors"]),
    );
    let job = "name: throttled\ndataset:\n  path: cora.safetensors\n  row_normalize: true\nmodel: {kind: gcn, layers: 2, hidden: 16}\ntrain: {epochs: 5, seed: 0, threads: 1}\nworkers: 2\n";
    let want = local_losses(t.path(), "job.yaml", job);
    let store = azure.store();
    write_job(
        t.path(),
        "job.yaml",
        &format!("{job}output: {{dir: {store}}}\n{}", azure.backend(&image)),
    );
    let t0 = Instant::now();
    let (stdout, stderr) =
        ok_output(&mut azure.cli(t.path(), &["submit", "job.yaml", "--output", "json"]));
    let took = t0.elapsed();
    let id = job_id(last_json(&stdout)["job_url"].as_str().unwrap());
    let metrics = azure
        .blob(&format!("runs/{id}/metrics.jsonl"))
        .unwrap_or_else(|| panic!("no metrics in the Blob store: {stderr}"));
    assert_same_losses("aci throttled", &losses(&metrics), &want, 1e-4);
    let status: Value =
        serde_json::from_str(&azure.blob(&format!("runs/{id}/status.json")).unwrap()).unwrap();
    assert_eq!(status["state"], "succeeded", "{status}");
    azure.wait_nothing_left(&[]);
    azure.assert_no_violations();

    let throttled = azure.fake("throttled");
    let count = |who: &str| throttled[who].as_u64().unwrap_or(0);
    assert!(
        count("user") > 0 && count("physalia-coordinator") > 0,
        "both principals were throttled: {throttled}"
    );
    // every throttled request was sent again: each group the job made was PUT and carried out once
    let requests = azure.fake("requests");
    let requests = requests.as_array().unwrap();
    let throttled_puts = requests
        .iter()
        .filter(|r| r["method"] == "PUT" && r["throttled"] == true)
        .count();
    let puts = requests.iter().filter(|r| r["method"] == "PUT").count();
    assert_eq!(
        puts - throttled_puts,
        3,
        "the coordinator's group and 2 workers' groups, each carried out once: {requests:?}"
    );
    eprintln!(
        "aci cluster-mode Cora under throttling: {:.1} s end to end, throttled {throttled} of {} ARM requests",
        took.as_secs_f64(),
        requests.len()
    );
}
