//! Whole jobs on AWS ECS, without an AWS account: `physalia submit` with `backend: ecs` against moto's
//! ECS, Secrets Manager, CloudWatch Logs and IAM on loopback, while `tests/ecs/ecs_agent.py` does what
//! ECS's container agent would: it runs every task moto starts as real containers of the locally built
//! worker image (the `secrets` init container, then the worker, at the task's ENI address on a Docker
//! network of the VPC's range) and stops the task in moto when its worker exits. The CLI is the
//! coordinator (client mode), reached by the workers at this machine's address.
//!
//! Skipped, with a note, where no Docker Engine answers or moto is not installed; with
//! `PHYSALIA_REQUIRE_MOTO=1` (CI installs moto) a missing moto fails instead.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use physalia_tests::{job_dirs, metrics, physalia_bin, read_json, repo_root, write_job};
use serde_json::Value;
use tempfile::TempDir;

/// The catalog SKU the test jobs run on: a Fargate task of 2 vCPU and 8 GiB.
const SKU: &str = "ecs-fargate-2x8";

/// moto with the ECS agent, for the life of a test.
struct Agent {
    child: Child,
    stdin: Option<ChildStdin>,
    info: Value,
}

impl Agent {
    /// `None` (and a note) where the test cannot run here.
    fn start() -> Option<Agent> {
        let required = std::env::var("PHYSALIA_REQUIRE_MOTO").as_deref() == Ok("1");
        let docker = Command::new("docker")
            .args(["info", "--format", "{{.ServerVersion}}"])
            .output()
            .is_ok_and(|o| o.status.success());
        let moto = Command::new("python3")
            .args(["-c", "import moto, boto3"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !docker {
            // the agent runs the tasks as containers; the docker backend's tests skip the same way
            eprintln!("skipping: no Docker Engine answers");
            return None;
        }
        if !moto {
            let why = "moto is not installed (pip install 'moto[server]==5.2.1')";
            assert!(!required, "PHYSALIA_REQUIRE_MOTO=1 but {why}");
            eprintln!("skipping: {why}");
            return None;
        }
        let mut child = Command::new("python3")
            .arg(repo_root().join("tests/ecs/ecs_agent.py"))
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
            .unwrap_or_else(|e| panic!("the ECS agent said {line:?}: {e}"));
        let stdin = child.stdin.take();
        Some(Agent { child, stdin, info })
    }

    /// What a user's AWS configuration would say, pointed at moto.
    fn env(&self, cmd: &mut Command) {
        cmd.env("AWS_ENDPOINT_URL", self.info["endpoint"].as_str().unwrap())
            .env("AWS_ACCESS_KEY_ID", "testing")
            .env("AWS_SECRET_ACCESS_KEY", "testing")
            .env("AWS_REGION", self.info["region"].as_str().unwrap())
            // moto speaks plain HTTP on loopback
            .env("AWS_ALLOW_HTTP", "true")
            .env_remove("AWS_PROFILE");
    }

    /// The job file's `backend:` section for this moto (infra/ecs's outputs) and `image`.
    fn backend(&self, image: &str) -> String {
        let list = |k: &str| {
            self.info[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "backend:\n  name: ecs\n  ecs:\n    cluster: {}\n    subnets: [{}]\n    security_groups: [{}]\n    execution_role_arn: {}\n    log_group: {}\n    image: {image}\n    sku: {SKU}\n",
            self.info["cluster"].as_str().unwrap(),
            list("subnets"),
            list("security_groups"),
            self.info["execution_role_arn"].as_str().unwrap(),
            self.info["log_group"].as_str().unwrap(),
        )
    }

    /// Runs `code` with boto3 clients `ecs`, `sm` (Secrets Manager) and `logs` on moto; its last line of
    /// output is JSON.
    fn query(&self, code: &str) -> Value {
        let prelude = format!(
            "import boto3, json\nkw = dict(endpoint_url={:?}, region_name='us-east-1', aws_access_key_id='testing', aws_secret_access_key='testing')\necs = boto3.client('ecs', **kw)\nsm = boto3.client('secretsmanager', **kw)\nlogs = boto3.client('logs', **kw)\n",
            self.info["endpoint"].as_str().unwrap()
        );
        let out = Command::new("python3")
            .args(["-c", &format!("{prelude}{code}")])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(text.lines().last().unwrap_or("null")).unwrap()
    }

    /// What is left on the platform: running tasks, active task definitions, secrets.
    fn leftovers(&self) -> Value {
        self.query(
            "tasks = ecs.list_tasks(cluster='physalia', desiredStatus='RUNNING')['taskArns']\n\
             tds = ecs.list_task_definitions(status='ACTIVE')['taskDefinitionArns']\n\
             secrets = [s['Name'] for s in sm.list_secrets()['SecretList']]\n\
             print(json.dumps({'tasks': tasks, 'task_definitions': tds, 'secrets': secrets}))",
        )
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // closing its standard input stops it, and it removes its containers, volumes and network
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

fn assert_nothing_left(agent: &Agent) {
    let left = agent.leftovers();
    for k in ["tasks", "task_definitions", "secrets"] {
        assert_eq!(left[k], Value::Array(vec![]), "{k} left on ECS: {left}");
    }
}

/// The worker image, built from the `physalia-worker` beside the tested `physalia`.
fn image() -> String {
    let out = Command::new(physalia_bin())
        .args(["image", "build"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

fn submit(cwd: &Path, agent: Option<&Agent>, sets: &[&str]) -> Value {
    let mut cmd = Command::new(physalia_bin());
    cmd.current_dir(cwd)
        .args(["submit", "job.yaml", "-q", "--output", "json"]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    if let Some(a) = agent {
        a.env(&mut cmd);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "submit failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap()).unwrap()
}

fn losses(dir: &Path) -> Vec<f64> {
    metrics(dir)
        .iter()
        .map(|m| m["metrics"]["loss"].as_f64().unwrap())
        .collect()
}

fn assert_same_losses(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "every epoch exactly once");
    for (e, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs(),
            "epoch {}: ecs {a}, local {b}",
            e + 1
        );
    }
}

/// The SKU's catalog price per worker-second, as `physalia plan` reads the catalog.
fn price_per_s() -> f64 {
    let text = std::fs::read_to_string(repo_root().join("infra/catalog/aws-ecs.yaml")).unwrap();
    let at = text
        .find(&format!("name: {SKU}"))
        .expect("the SKU is in the catalog");
    let rest = &text[at..];
    let field = |name: &str| -> f64 {
        let i = rest.find(name).unwrap() + name.len();
        rest[i..]
            .trim_start_matches([':', ' '])
            .split([',', '}', '\n'])
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    let (vcpus, gib) = (field("vcpus"), field("memory_gib"));
    vcpus * field("usd_per_vcpu_second") + gib * field("usd_per_gib_second")
}

#[test]
fn cora_on_three_ecs_tasks_trains_like_three_local_processes() {
    let Some(cora) = physalia_tests::cora_dir() else {
        return;
    };
    let Some(agent) = Agent::start() else {
        return;
    };
    let t = TempDir::new().unwrap();
    let job = format!(
        "name: ecs\ndataset:\n  path: {}\n  row_normalize: true\nmodel: {{kind: gcn, layers: 2, hidden: 16}}\ntrain: {{epochs: 20, seed: 0, threads: 1}}\nworkers: 3\noutput: {{dir: jobs}}\n",
        cora.display()
    );
    write_job(t.path(), "job.yaml", &job);
    let local = submit(t.path(), None, &[]);
    write_job(
        t.path(),
        "job.yaml",
        &format!("{job}{}", agent.backend(&image())),
    );
    let ecs = submit(t.path(), Some(&agent), &[]);
    let dir = t.path().join(ecs["job_dir"].as_str().unwrap());
    assert_same_losses(
        &losses(&dir),
        &losses(&t.path().join(local["job_dir"].as_str().unwrap())),
    );
    assert_eq!(read_json(&dir.join("status.json"))["state"], "succeeded");
    // rank 0 sent the model back over its control connection: no disk is shared
    assert!(dir.join("model.safetensors").is_file());
    // each worker's output came back through CloudWatch Logs
    let log = std::fs::read_to_string(dir.join("logs/worker-1.log")).unwrap();
    assert!(log.contains("advertised 172.31."), "{log}");
    // the bill is the SKU's catalog price for every worker-second, coordinator's time at 0 (this machine)
    let (usd, ws) = (
        ecs["usd_total"].as_f64().unwrap(),
        ecs["worker_seconds"].as_f64().unwrap(),
    );
    assert!(ws > 0.0 && usd > 0.0, "{ecs}");
    let want = ws * price_per_s();
    assert!((usd - want).abs() <= 1e-9 + 1e-6 * want, "{usd} vs {want}");
    assert_nothing_left(&agent);
}

/// A 2 -> 3 worker policy, one worker's container killed mid-job (its epoch retried from the last
/// checkpoint), the record in moto's S3 read by `status`, `logs` and `report` from second processes, then
/// a second job cancelled through the store while it runs.
#[test]
fn an_ecs_job_grows_survives_a_killed_container_and_cancels_cleanly() {
    let Some(agent) = Agent::start() else {
        return;
    };
    let t = TempDir::new().unwrap();
    let job = "name: grow\ndataset:\n  synth: {kind: sbm, nodes: 4000, classes: 4, feat_dim: 16, avg_degree: 10, homophily: 0.8, seed: 1}\nmodel: {kind: gcn, layers: 2, hidden: 16}\ntrain: {epochs: 12, seed: 0, threads: 1}\nworkers: 2\n";
    write_job(
        t.path(),
        "job.yaml",
        &format!("{job}output: {{dir: jobs}}\n"),
    );
    let fixed = submit(t.path(), None, &[]);
    let want = losses(&t.path().join(fixed["job_dir"].as_str().unwrap()));
    write_job(
        t.path(),
        "policy.yaml",
        "min_workers: 2\nmax_workers: 3\ncooldown_epochs: 0\nrules:\n  - name: three-at-4\n    when: epoch == 4\n    then: {set_workers: 3}\n",
    );
    let store = format!("s3://{}/jobs", agent.info["bucket"].as_str().unwrap());
    write_job(
        t.path(),
        "job.yaml",
        &format!(
            "{job}output: {{dir: {store}}}\nscaling_file: policy.yaml\n{}",
            agent.backend(&image())
        ),
    );
    // the coordinator stages the record under $XDG_CACHE_HOME/physalia/staging
    let cache = t.path().join("cache");
    let staging = cache.join("physalia/staging");
    let command = |args: &[&str]| {
        let mut cmd = Command::new(physalia_bin());
        cmd.current_dir(t.path())
            .args(args)
            .env("XDG_CACHE_HOME", &cache)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        agent.env(&mut cmd);
        cmd
    };
    let child = command(&["submit", "job.yaml", "-q", "--output", "json"])
        .spawn()
        .unwrap();
    let staged = wait_for_epochs(&staging, 6, &[]);
    // kill one running worker's container: ECS reports its task stopped, the epoch is retried
    let ps = Command::new("docker")
        .args([
            "ps",
            "-q",
            "--filter",
            &format!("network={}", agent.info["network"].as_str().unwrap()),
        ])
        .output()
        .unwrap();
    let containers = String::from_utf8_lossy(&ps.stdout).to_string();
    let victim = containers
        .lines()
        .next()
        .expect("a running worker container");
    let killed = Command::new("docker")
        .args(["kill", victim])
        .output()
        .unwrap();
    assert!(
        killed.status.success(),
        "{}",
        String::from_utf8_lossy(&killed.stderr)
    );
    // a second process reads the job from the store while it runs
    let status = command(&["status", "grow", "--dir", &store, "--output", "json"])
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let view: Value = serde_json::from_slice(&status.stdout).unwrap();
    assert!(
        ["running", "succeeded"].contains(&view["state"].as_str().unwrap()),
        "{view}"
    );
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the job failed after the kill: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(v["workers"], 3, "{v}");
    let id = staged.file_name().unwrap().to_string_lossy().to_string();
    assert_eq!(v["job_url"], format!("{store}/{id}"));
    let got = losses(&staged);
    assert_eq!(got.len(), want.len(), "every epoch exactly once");
    for (e, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-3 * b.abs(),
            "epoch {}: {a} vs fixed {b}",
            e + 1
        );
    }
    let events = v["scaling_events"].to_string();
    assert!(events.contains("three-at-4"), "{events}");
    assert!(
        events.contains("retr"),
        "the killed worker's epoch was retried: {events}"
    );
    // from the store alone: the final state, a rank's output, the report
    let status = command(&["status", &id, "--dir", &store, "--output", "json"])
        .output()
        .unwrap();
    let view: Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(view["state"], "succeeded", "{view}");
    let logs = command(&["logs", "grow", "--dir", &store, "--rank", "1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&logs.stdout);
    assert!(text.contains("advertised 172.31."), "{text}");
    let report = command(&["report", &format!("{store}/{id}"), "--out", "r.html"])
        .output()
        .unwrap();
    assert!(
        report.status.success(),
        "{}",
        String::from_utf8_lossy(&report.stderr)
    );
    assert!(
        std::fs::read_to_string(t.path().join("r.html"))
            .unwrap()
            .contains("<svg")
    );
    assert_nothing_left(&agent);

    // a job cancelled through the store while it runs leaves no task, task definition or secret
    let done = job_dirs(&staging);
    let mut child = command(&[
        "submit",
        "job.yaml",
        "-q",
        "--set",
        "train.epochs=100000",
        "--set",
        "name=cancelme",
    ])
    .spawn()
    .unwrap();
    let running = wait_for_epochs(&staging, 2, &done);
    let id = running.file_name().unwrap().to_string_lossy().to_string();
    // the store has the running job once the coordinator's mirror made a pass
    let deadline = Instant::now() + Duration::from_secs(30);
    while !command(&["status", &id, "--dir", &store])
        .output()
        .unwrap()
        .status
        .success()
    {
        assert!(Instant::now() < deadline, "the job never reached the store");
        std::thread::sleep(Duration::from_millis(200));
    }
    let cancel = command(&["cancel", &id, "--dir", &store]).output().unwrap();
    assert!(
        cancel.status.success(),
        "{}",
        String::from_utf8_lossy(&cancel.stderr)
    );
    let status = child.wait().unwrap();
    assert!(!status.success(), "a cancelled submit exits non-zero");
    assert_eq!(
        read_json(&running.join("status.json"))["state"],
        "cancelled"
    );
    let status = command(&["status", &id, "--dir", &store, "--output", "json"])
        .output()
        .unwrap();
    let view: Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(view["state"], "cancelled", "the store's record says so too");
    assert_nothing_left(&agent);
}

/// The first job directory under `jobs` (not one of `except`) with at least `n` recorded epochs.
fn wait_for_epochs(jobs: &Path, n: usize, except: &[PathBuf]) -> PathBuf {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        assert!(Instant::now() < deadline, "the ECS job never got going");
        for d in job_dirs(jobs) {
            if except.contains(&d) {
                continue;
            }
            if std::fs::read_to_string(d.join("metrics.jsonl"))
                .is_ok_and(|m| m.lines().count() >= n)
            {
                return d;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
