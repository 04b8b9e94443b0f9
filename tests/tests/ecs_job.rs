//! Whole jobs on AWS ECS, without an AWS account: `physalia submit` with `backend: ecs` against moto's
//! ECS, Secrets Manager, CloudWatch Logs and IAM on loopback, while `tests/ecs/ecs_agent.py` does what
//! ECS's container agent would: it runs every task moto starts as real containers of the locally built
//! worker image (the `secrets` init container, then the worker, at the task's ENI address on a Docker
//! network of the VPC's range) and stops the task in moto when its worker exits.
//!
//! The first two tests run in client mode (`backend.mode: client`): the CLI is the coordinator, reached
//! by the workers at this machine's address. The cluster-mode tests (issue 14) let `submit` start the
//! coordinator as an ECS task too, which the agent runs as the coordinator image (`physalia image build
//! --with-cli`) with its task role's credentials from a container credentials endpoint: this machine only
//! hands it the job through the S3 job store and follows it there.
//!
//! Skipped, with a note, where no Docker Engine answers or moto is not installed; with
//! `PHYSALIA_REQUIRE_MOTO=1` (CI installs moto) a missing moto fails instead.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use physalia_tests::{
    build_image, job_dirs, metrics, physalia_bin, read_json, repo_root, write_job,
};
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
        Agent::start_with(&[])
    }

    /// The agent with `args` (`--g5-instances N`: N container instances registered as a g5.xlarge).
    fn start_with(args: &[&str]) -> Option<Agent> {
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
        // these jobs keep the CLI as their coordinator
        self.cluster_backend(image)
            .replace("  ecs:\n", "  mode: client\n  ecs:\n")
    }

    /// The `backend:` section of a cluster-mode job (the default mode on ecs): with the coordinator's
    /// task role, and `image` as both the workers' and the coordinator's image.
    fn cluster_backend(&self, image: &str) -> String {
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
            "backend:\n  name: ecs\n  ecs:\n    cluster: {}\n    subnets: [{}]\n    security_groups: [{}]\n    execution_role_arn: {}\n    coordinator_task_role_arn: {}\n    log_group: {}\n    image: {image}\n    sku: {SKU}\n",
            self.info["cluster"].as_str().unwrap(),
            list("subnets"),
            list("security_groups"),
            self.info["execution_role_arn"].as_str().unwrap(),
            self.info["coordinator_task_role_arn"].as_str().unwrap(),
            self.info["log_group"].as_str().unwrap(),
        )
    }

    /// Runs `code` (its lines' common indentation removed, so a Rust string literal may indent them)
    /// with boto3 clients `ecs`, `sm` (Secrets Manager) and `logs` on moto; its last line of
    /// output is JSON.
    fn query(&self, code: &str) -> Value {
        let prelude = format!(
            "import boto3, json\nkw = dict(endpoint_url={:?}, region_name='us-east-1', aws_access_key_id='testing', aws_secret_access_key='testing')\necs = boto3.client('ecs', **kw)\nsm = boto3.client('secretsmanager', **kw)\nlogs = boto3.client('logs', **kw)\ns3 = boto3.client('s3', **kw)\n",
            self.info["endpoint"].as_str().unwrap()
        );
        let out = Command::new("python3")
            .args(["-c", &format!("{prelude}{}", dedent(code))])
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

/// The worker image with the CLI (the coordinator's image; it runs workers too), built from the
/// `physalia-worker` and `physalia` under test; one test builds it while the others wait.
fn image() -> String {
    build_image(&["--with-cli"])
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

/// Issue 30: a GPU SKU's job is placed on g5.xlarge-faithful container instances (4096 CPU units,
/// 15,785 MiB registered, one GPU, `ecs.instance-type` g5.xlarge) and trains, each worker falling back to
/// the CPU in its container; every epoch once, the local run's losses. Today's task (the whole
/// instance, 4096 units and 16,448 MiB, placed by `=~ A10G`) is refused by the same harness, for its
/// memory and for its constraint: the fake bites.
#[test]
fn issue_30_a_gpu_sku_job_is_placed_on_g5_xlarge_instances_and_trains() {
    let Some(cora) = physalia_tests::cora_dir() else {
        return;
    };
    let Some(agent) = Agent::start_with(&["--g5-instances", "3"]) else {
        return;
    };
    // what the worker asks for is what the catalog's placement says, and it fits the registered size
    let catalog = physalia_planner::Catalog::builtin();
    let sku = catalog.get("ecs-g5.xlarge").unwrap();
    assert_eq!(sku.instance_types(), ["g5.xlarge"]);
    let registered = agent.info["g5_xlarge"]["MEMORY"].as_f64().unwrap();
    assert!(
        sku.request_memory_gib() * 1024.0 <= registered,
        "{registered}"
    );
    assert!(
        sku.memory_gib * 1024.0 + 64.0 > registered,
        "the whole instance must not fit"
    );

    // the fake refuses what ECS refuses: today's request and today's constraint
    let refused = agent.query(&format!(
        "net = {{'awsvpcConfiguration': {{'subnets': {subnets}, 'securityGroups': []}}}}
         def run(mem, expr):
             c = [dict(name='secrets', image='x', memory=64, essential=False),
                  dict(name='worker', image='x', cpu=4096, memory=mem - 64,
                       resourceRequirements=[{{'type': 'GPU', 'value': '1'}}])]
             td = ecs.register_task_definition(family='today', networkMode='awsvpc',
                 requiresCompatibilities=['EC2'], cpu='4096', memory=str(mem), containerDefinitions=c,
                 placementConstraints=[{{'type': 'memberOf', 'expression': expr}}])['taskDefinition']
             r = ecs.run_task(cluster='physalia', taskDefinition=td['taskDefinitionArn'], networkConfiguration=net)
             ecs.deregister_task_definition(taskDefinition=td['taskDefinitionArn'])
             return [len(r['tasks'])] + sorted({{f['reason'] for f in r['failures']}})
         print(json.dumps([run(16448, 'attribute:ecs.instance-type == g5.xlarge'),
                           run(15155, 'attribute:ecs.instance-type =~ A10G')]))",
        subnets = agent.info["subnets"]
    ));
    assert_eq!(
        refused,
        serde_json::json!([
            [0, "RESOURCE:MEMORY"],
            [0, "MemberOf placement constraint unsatisfied."]
        ])
    );

    let t = TempDir::new().unwrap();
    let job = format!(
        "name: ecs-gpu
dataset:
  path: {}
  row_normalize: true
model: {{kind: gcn, layers: 2, hidden: 16}}
train: {{epochs: 5, seed: 0, threads: 1}}
workers: 3
output: {{dir: jobs}}
resources: {{gpu: {{count: 1}}, gpu_fallback: cpu}}
",
        cora.display()
    );
    write_job(t.path(), "job.yaml", &job);
    let local = submit(t.path(), None, &[]);
    let backend = agent.backend(&image()).replace(
        &format!("sku: {SKU}"),
        "sku: ecs-g5.xlarge
    capacity: ec2",
    );
    write_job(t.path(), "job.yaml", &format!("{job}{backend}"));
    let ecs = submit(t.path(), Some(&agent), &[]);
    let dir = t.path().join(ecs["job_dir"].as_str().unwrap());
    assert_same_losses(
        &losses(&dir),
        &losses(&t.path().join(local["job_dir"].as_str().unwrap())),
    );
    assert_eq!(read_json(&dir.join("status.json"))["state"], "succeeded");
    // the tasks were placed on the g5.xlarge instances
    let placed = agent.query(
        "arns = ecs.list_tasks(cluster='physalia', desiredStatus='STOPPED')['taskArns']
         ts = ecs.describe_tasks(cluster='physalia', tasks=arns)['tasks']
         def itype(t):
             if not t.get('containerInstanceArn'):
                 return None
             ci = ecs.describe_container_instances(cluster='physalia', containerInstances=[t['containerInstanceArn']])
             return [a.get('value') for a in ci['containerInstances'][0]['attributes'] if a['name'] == 'ecs.instance-type'][0]
         print(json.dumps(sorted({itype(t) for t in ts}, key=str)))",
    );
    // every worker task ran on a g5.xlarge (the task definitions are deregistered with the job, so the
    // tasks' container instances tell; the harness placed them only because their size fits one)
    assert_eq!(placed, serde_json::json!(["g5.xlarge"]));
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

/// A command of the CLI under test with the agent's AWS settings (what a user's would say).
fn cli(agent: &Agent, cwd: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(physalia_bin());
    cmd.current_dir(cwd)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    agent.env(&mut cmd);
    cmd
}

/// Runs `cmd` and returns its standard output, failing the test with its standard error unless it
/// succeeds.
fn ok_output(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{:?} failed: {}",
        cmd.get_args().collect::<Vec<_>>(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An object of moto's S3 bucket, `None` where it is not there.
fn s3_object(agent: &Agent, key: &str) -> Option<String> {
    let v = agent.query(&format!(
        "try:\n    body = s3.get_object(Bucket={:?}, Key={key:?})['Body'].read().decode()\nexcept s3.exceptions.NoSuchKey:\n    body = None\nprint(json.dumps(body))",
        agent.info["bucket"].as_str().unwrap()
    ));
    v.as_str().map(String::from)
}

/// The keys of moto's S3 bucket under `prefix`.
fn s3_keys(agent: &Agent, prefix: &str) -> Vec<String> {
    let v = agent.query(&format!(
        "r = s3.list_objects_v2(Bucket={:?}, Prefix={prefix:?})\nprint(json.dumps([o['Key'] for o in r.get('Contents', [])]))",
        agent.info["bucket"].as_str().unwrap()
    ));
    serde_json::from_value(v).unwrap()
}

/// The objects of moto's S3 bucket under `prefix`, with when each was last written.
fn s3_written(agent: &Agent, prefix: &str) -> Vec<(String, String)> {
    let v = agent.query(&format!(
        "r = s3.list_objects_v2(Bucket={:?}, Prefix={prefix:?})\nprint(json.dumps([[o['Key'], o['LastModified'].isoformat()] for o in r.get('Contents', [])]))",
        agent.info["bucket"].as_str().unwrap()
    ));
    serde_json::from_value(v).unwrap()
}

/// What the coordinator's container (1 vCPU, 2 GiB of Fargate) costs a second at the catalog's prices.
fn coordinator_price_per_s() -> f64 {
    let text = std::fs::read_to_string(repo_root().join("infra/catalog/aws-ecs.yaml")).unwrap();
    let at = text.find(&format!("name: {SKU}")).unwrap();
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
    field("usd_per_vcpu_second") + 2.0 * field("usd_per_gib_second")
}

/// Waits (up to a minute) until ECS holds nothing of the test's jobs: a detached job's coordinator
/// deletes its own task definition as it ends, and its task stops with its container.
fn wait_nothing_left(agent: &Agent) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = agent.leftovers();
        let empty = ["tasks", "task_definitions", "secrets"]
            .iter()
            .all(|k| left[*k] == Value::Array(vec![]));
        if empty {
            return;
        }
        assert!(Instant::now() < deadline, "left on ECS: {left}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Issue 14, cluster mode: `submit` uploads the dataset to the S3 store once, starts the coordinator as
/// an ECS task with its task role, and follows it there; the coordinator trains Cora on 3 ECS workers
/// to a local 3-process run's losses, its record in moto's S3, its own seconds billed at Fargate's
/// price, and nothing of the job is left on ECS afterwards.
#[test]
fn issue_14_cora_in_cluster_mode_on_ecs_trains_like_three_local_processes() {
    let Some(cora) = physalia_tests::cora_dir() else {
        return;
    };
    let Some(agent) = Agent::start() else {
        return;
    };
    let t = TempDir::new().unwrap();
    // cluster mode uploads a dataset file (a raw folder is imported first)
    ok_output(
        Command::new(physalia_bin())
            .current_dir(t.path())
            .args(["data", "import"])
            .arg(&cora)
            .args(["--out", "cora.safetensors"]),
    );
    let job = "name: cluster\ndataset:\n  path: cora.safetensors\n  row_normalize: true\nmodel: {kind: gcn, layers: 2, hidden: 16}\ntrain: {epochs: 20, seed: 0, threads: 1}\nworkers: 3\n";
    write_job(
        t.path(),
        "job.yaml",
        &format!("{job}output: {{dir: jobs}}\n"),
    );
    let local = submit(t.path(), None, &[]);
    let want = losses(&t.path().join(local["job_dir"].as_str().unwrap()));
    let bucket = agent.info["bucket"].as_str().unwrap();
    let store = format!("s3://{bucket}/jobs");
    write_job(
        t.path(),
        "job.yaml",
        &format!(
            "{job}output: {{dir: {store}}}\n{}",
            agent.cluster_backend(&image())
        ),
    );
    let t0 = Instant::now();
    let out = cli(
        &agent,
        t.path(),
        &["submit", "job.yaml", "--output", "json"],
    )
    .output()
    .unwrap();
    let took = t0.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "cluster-mode submit failed: {stderr}");
    // the per-epoch lines a local job prints, from the store's record
    let epochs = stderr.lines().filter(|l| l.starts_with("epoch ")).count();
    assert_eq!(epochs, 20, "{stderr}");
    assert!(stderr.contains("uploading the dataset"), "{stderr}");
    let v: Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    let id = v["job_url"]
        .as_str()
        .unwrap()
        .rsplit('/')
        .next()
        .unwrap()
        .to_string();
    let metrics = s3_object(&agent, &format!("jobs/{id}/metrics.jsonl")).expect("metrics in S3");
    let got: Vec<f64> = metrics
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["metrics"]["loss"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_same_losses(&got, &want);
    let max_diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    let status: Value =
        serde_json::from_str(&s3_object(&agent, &format!("jobs/{id}/status.json")).unwrap())
            .unwrap();
    assert_eq!(status["state"], "succeeded", "{status}");
    // the coordinator ran in a container, not here
    assert_ne!(
        status["coordinator"]["host"].as_str().unwrap(),
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap()
            .trim()
    );
    let summary: Value =
        serde_json::from_str(&s3_object(&agent, &format!("jobs/{id}/summary.json")).unwrap())
            .unwrap();
    let (usd, ws, cs, cp) = (
        summary["usd_total"].as_f64().unwrap(),
        summary["worker_seconds"].as_f64().unwrap(),
        summary["coordinator_seconds"].as_f64().unwrap(),
        summary["coordinator_usd_per_s"].as_f64().unwrap(),
    );
    assert!(ws > 0.0 && cs > 0.0, "{summary}");
    assert!((cp - coordinator_price_per_s()).abs() < 1e-15, "{cp}");
    let want_usd = ws * price_per_s() + cs * cp;
    assert!(
        (usd - want_usd).abs() <= 1e-9 + 1e-6 * want_usd,
        "{usd} vs {want_usd}"
    );
    assert_eq!(v["usd_total"], summary["usd_total"], "what submit printed");
    // the dataset is in the store once, content-addressed, and a second job reuses it
    let is_dataset = |k: &String| !k.contains(".parts/");
    let datasets: Vec<String> = s3_keys(&agent, "jobs/.datasets/")
        .into_iter()
        .filter(is_dataset)
        .collect();
    assert_eq!(datasets.len(), 1, "{datasets:?}");
    assert!(datasets[0].ends_with("-cora.safetensors"), "{datasets:?}");
    // the coordinator's partitions are beside it: every part and the partitioning (put last)
    let parts_dir = format!(
        "{}.parts/k3-seed0/",
        datasets[0].trim_end_matches(".safetensors")
    );
    let parts = s3_written(&agent, &parts_dir);
    let names: Vec<&str> = parts
        .iter()
        .map(|(k, _)| k.trim_start_matches(&parts_dir))
        .collect();
    assert_eq!(
        names,
        [
            "part0.safetensors",
            "part1.safetensors",
            "part2.safetensors",
            "partition.safetensors"
        ],
        "{parts:?}"
    );
    assert!(
        s3_object(&agent, &format!("jobs/{id}/coordinator.json")).is_some(),
        "the coordinator's handle is in the record"
    );
    let again = ok_output(
        cli(
            &agent,
            t.path(),
            &["submit", "job.yaml", "--set", "train.epochs=1"],
        )
        .stderr(Stdio::inherit()),
    );
    assert!(again.contains("finished on 3 workers"), "{again}");
    assert_eq!(
        s3_keys(&agent, "jobs/.datasets/")
            .into_iter()
            .filter(is_dataset)
            .collect::<Vec<_>>(),
        datasets,
        "the second job reused the uploaded dataset"
    );
    // and the partitions the first coordinator computed: fetched, not computed and written again
    assert_eq!(
        s3_written(&agent, &parts_dir),
        parts,
        "the second job rewrote the stored partitions"
    );
    eprintln!(
        "cluster-mode Cora: {:.1} s end to end, {ws:.1} worker-s, {cs:.1} coordinator-s, ${usd:.6}, \
         losses within {max_diff:.2e} of the local run's",
        took.as_secs_f64()
    );
    assert_nothing_left(&agent);
}

/// Issue 14, cluster mode: bad settings are refused before anything is made; `--detach` returns with
/// the job's id while its coordinator runs on; `logs --rank coordinator --follow` and `status` follow
/// it from the store; `cancel` of a running detached job stops its workers and its coordinator, and
/// nothing of either job is left on ECS.
#[test]
fn issue_14_an_ecs_cluster_job_refuses_bad_settings_detaches_and_cancels() {
    let Some(agent) = Agent::start() else {
        return;
    };
    let t = TempDir::new().unwrap();
    let store = format!("s3://{}/jobs", agent.info["bucket"].as_str().unwrap());
    let job = "name: detached\ndataset:\n  synth: {kind: sbm, nodes: 2000, classes: 4, feat_dim: 16, avg_degree: 8, homophily: 0.8, seed: 1}\nmodel: {kind: gcn, layers: 2, hidden: 16}\ntrain: {epochs: 5, seed: 0, threads: 1}\nworkers: 2\n";
    let image = image();
    let backend = agent.cluster_backend(&image);
    // refused before anything is made: an unknown cluster, no coordinator role, a local store
    let refused = |text: String, needles: &[&str]| {
        write_job(t.path(), "bad.yaml", &text);
        let out = cli(&agent, t.path(), &["submit", "bad.yaml"])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        for n in needles {
            assert!(err.contains(n), "{err:?} lacks {n:?}");
        }
    };
    refused(
        format!(
            "{job}output: {{dir: {store}}}\n{}",
            backend.replace("cluster: physalia", "cluster: nope")
        ),
        &["bad.yaml", "nope"],
    );
    refused(
        format!(
            "{job}output: {{dir: {store}}}\n{}",
            backend
                .lines()
                .filter(|l| !l.contains("coordinator_task_role_arn"))
                .collect::<Vec<_>>()
                .join("\n")
        ),
        &["bad.yaml", "backend.ecs.coordinator_task_role_arn"],
    );
    refused(
        format!("{job}output: {{dir: jobs}}\n{backend}"),
        &["bad.yaml", "output.dir", "s3://"],
    );
    assert!(s3_keys(&agent, "jobs/").is_empty(), "nothing in the store");
    wait_nothing_left(&agent);

    // a coordinator image without the CLI: the job fails with the platform's reason, its record says
    // so, and nothing is left
    write_job(
        t.path(),
        "nocli.yaml",
        &format!(
            "{job}output: {{dir: {store}}}\n{}",
            agent.cluster_backend(&build_image(&[]))
        ),
    );
    let t_fail = Instant::now();
    let out = cli(&agent, t.path(), &["submit", "nocli.yaml"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!(
        "a coordinator image without the CLI failed in {:.1} s: {err}",
        t_fail.elapsed().as_secs_f64()
    );
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("coordinator"), "{err}");
    let failed = s3_keys(&agent, "jobs/")
        .into_iter()
        .find(|k| k.ends_with("/status.json"))
        .expect("the failed job's record");
    let status: Value = serde_json::from_str(&s3_object(&agent, &failed).unwrap()).unwrap();
    assert_eq!(status["state"], "failed", "{status}");
    wait_nothing_left(&agent);

    write_job(
        t.path(),
        "job.yaml",
        &format!("{job}output: {{dir: {store}}}\n{backend}"),
    );
    let t0 = Instant::now();
    let out = ok_output(&mut cli(
        &agent,
        t.path(),
        &["submit", "job.yaml", "--detach"],
    ));
    let id = out.lines().next().unwrap().trim().to_string();
    assert!(id.starts_with("detached-"), "{out}");
    // it returned while the job runs (the coordinator has its job to train yet)
    let view: Value = serde_json::from_str(&ok_output(&mut cli(
        &agent,
        t.path(),
        &["status", &id, "--dir", &store, "--output", "json"],
    )))
    .unwrap();
    assert_eq!(view["state"], "running", "{view}");
    assert_eq!(view["platform_coordinator"]["backend"], "ecs", "{view}");
    let logs = ok_output(&mut cli(
        &agent,
        t.path(),
        &[
            "logs",
            &id,
            "--dir",
            &store,
            "--rank",
            "coordinator",
            "--follow",
        ],
    ));
    assert!(logs.contains("epoch 5/5"), "{logs}");
    if std::env::var_os("PHYSALIA_SHOW_COORDINATOR_LOG").is_some() {
        eprintln!("{logs}");
    }
    let view: Value = serde_json::from_str(&ok_output(&mut cli(
        &agent,
        t.path(),
        &["status", &id, "--dir", &store, "--output", "json"],
    )))
    .unwrap();
    assert_eq!(view["state"], "succeeded", "{view}");
    wait_nothing_left(&agent);
    eprintln!(
        "detached cluster-mode job: {:.1} s to the end of the follow",
        t0.elapsed().as_secs_f64()
    );

    // Ctrl-C while following detaches: the job goes on (until it is cancelled below)
    let mut child = cli(
        &agent,
        t.path(),
        &[
            "submit",
            "job.yaml",
            "--set",
            "train.epochs=100000",
            "--set",
            "name=cancelme",
        ],
    )
    .spawn()
    .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "submit ended before an epoch: {seen}"
        );
        seen.push_str(&line);
        if line.starts_with("epoch ") {
            break;
        }
    }
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    assert!(child.wait().unwrap().success(), "{seen}{rest}");
    assert!(
        rest.contains("detached") && rest.contains("--rank coordinator --follow"),
        "{rest}"
    );
    let id = seen
        .lines()
        .find_map(|l| l.strip_prefix("job ")?.split(':').next())
        .unwrap()
        .to_string();
    assert!(id.starts_with("cancelme-"), "{seen}");
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let view: Value = serde_json::from_str(&ok_output(&mut cli(
            &agent,
            t.path(),
            &["status", &id, "--dir", &store, "--output", "json"],
        )))
        .unwrap();
        if view["status"]["epoch"].as_u64().unwrap_or(0) >= 2 {
            break;
        }
        assert!(Instant::now() < deadline, "the job never trained: {view}");
        std::thread::sleep(Duration::from_millis(500));
    }
    // the coordinator's identity is its task role: no key in its task definition
    let td = agent.query(&format!(
        "arns = ecs.list_task_definitions(familyPrefix='physalia-{id}-coordinator')['taskDefinitionArns']\n\
         print(json.dumps(ecs.describe_task_definition(taskDefinition=arns[0])['taskDefinition']))"
    ));
    assert_eq!(
        td["taskRoleArn"], agent.info["coordinator_task_role_arn"],
        "{td}"
    );
    let container = &td["containerDefinitions"][0];
    assert_eq!(container["name"], "coordinator", "{td}");
    // the workers dial the port the task definition declares (the coordinator binds that one)
    let declared = container["portMappings"][0]["containerPort"]
        .as_u64()
        .unwrap();
    let ps = Command::new("docker")
        .args([
            "ps",
            "-q",
            "--filter",
            &format!("network={}", agent.info["network"].as_str().unwrap()),
        ])
        .output()
        .unwrap();
    let mut dialled = Vec::new();
    for c in String::from_utf8_lossy(&ps.stdout).lines() {
        let env = Command::new("docker")
            .args([
                "inspect",
                "-f",
                "{{range .Config.Env}}{{println .}}{{end}}",
                c,
            ])
            .output()
            .unwrap();
        dialled.extend(
            String::from_utf8_lossy(&env.stdout)
                .lines()
                .filter_map(|l| l.strip_prefix("PHYSALIA_COORDINATOR_ADDR="))
                .map(String::from),
        );
    }
    assert!(!dialled.is_empty(), "no running worker container");
    for addr in &dialled {
        assert!(
            addr.ends_with(&format!(":{declared}")),
            "a worker dials {addr}, the coordinator's task declares {declared}"
        );
    }
    let text = container.to_string();
    for word in [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "\"testing\"",
    ] {
        assert!(
            !text.contains(word),
            "{word} in the coordinator's task: {text}"
        );
    }
    ok_output(&mut cli(
        &agent,
        t.path(),
        &["cancel", &id, "--dir", &store],
    ));
    let view: Value = serde_json::from_str(&ok_output(&mut cli(
        &agent,
        t.path(),
        &["status", &id, "--dir", &store, "--output", "json"],
    )))
    .unwrap();
    assert_eq!(view["state"], "cancelled", "{view}");
    wait_nothing_left(&agent);
}

/// `code` without the indentation its lines after the first share (the first follows the literal's quote).
fn dedent(code: &str) -> String {
    let mut lines = code.lines();
    let first = lines.next().unwrap_or("");
    let rest: Vec<&str> = lines.collect();
    let indent = rest
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    std::iter::once(first.to_string())
        .chain(
            rest.iter()
                .map(|l| l.get(indent..).unwrap_or("").to_string()),
        )
        .collect::<Vec<_>>()
        .join("\n")
}
