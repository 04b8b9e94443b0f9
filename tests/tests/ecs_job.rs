//! Whole jobs on AWS ECS, without an AWS account: `physalia submit` with `backend: ecs` against moto's
//! ECS, Secrets Manager, CloudWatch Logs and IAM on loopback, while `tests/ecs/ecs_agent.py` does what
//! ECS's container agent would: it runs every task moto starts as real containers of the locally built
//! worker image (the `secrets` init container, then the worker, at the task's ENI address on a Docker
//! network of the VPC's range) and stops the task in moto when its worker exits.
//!
//! The client-mode tests (`backend.mode: client`) keep the CLI as the coordinator, reached by the
//! workers at this machine's address. The shared cluster-mode scenario (`physalia_tests::cluster`,
//! issue 14) lets `submit` start the coordinator as an ECS task too, which the agent runs as the
//! coordinator image (`physalia image build --with-cli`) with its task role's credentials from a
//! container credentials endpoint: this machine only hands it the job through the S3 job store and
//! follows it there.
//!
//! Skipped, with a note, where no Docker Engine answers or moto is not installed; with
//! `PHYSALIA_REQUIRE_MOTO=1` (CI installs moto) a missing moto fails instead.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use physalia_testkit::{Emulator, Spawn, dedent, python};
use physalia_tests::cluster::{
    Cloud, Followed, MotoS3, Refusal, Scenario, catalog_number, docker_kill,
};
use physalia_tests::{
    build_image, job_dirs, metrics, ok_output, physalia_bin, read_json, write_job,
};
use serde_json::Value;
use tempfile::TempDir;

/// The catalog SKU the test jobs run on: a Fargate task of 2 vCPU and 8 GiB.
const SKU: &str = "ecs-fargate-2x8";

/// moto with the ECS agent, for the life of a test.
struct Ecs {
    agent: Emulator,
    s3: MotoS3,
}

impl Ecs {
    /// The agent with `args` (`--g5-instances N`: N container instances registered as a g5.xlarge;
    /// `--region R`: the cluster and the bucket in R).
    fn start_with(args: &[&str]) -> Option<Ecs> {
        let agent = Spawn::new("tests/ecs/ecs_agent.py")
            .args(args)
            .docker()
            .python(&["moto", "boto3"])
            .start()?;
        let s3 = MotoS3 {
            endpoint: agent.str("endpoint").to_string(),
            bucket: agent.str("bucket").to_string(),
        };
        Some(Ecs { agent, s3 })
    }

    fn info(&self) -> &Value {
        self.agent.info()
    }

    /// What a user's AWS configuration would say, pointed at moto.
    fn env(&self, cmd: &mut Command) {
        self.s3.user_env(cmd, self.agent.str("region"));
    }

    /// The job file's `backend:` section of a client-mode job: these jobs keep the CLI as their
    /// coordinator.
    fn client_backend(&self, image: &str) -> String {
        self.backend(image)
            .replace("  ecs:\n", "  mode: client\n  ecs:\n")
    }

    /// Runs `code` (its lines' common indentation removed, so a Rust string literal may indent them)
    /// with boto3 clients `ecs`, `sm` (Secrets Manager), `logs` and `s3` on moto; its last line of
    /// output is JSON.
    fn query(&self, code: &str) -> Value {
        let prelude = format!(
            "import boto3, json\nkw = dict(endpoint_url={:?}, region_name={:?}, aws_access_key_id='testing', aws_secret_access_key='testing')\necs = boto3.client('ecs', **kw)\nsm = boto3.client('secretsmanager', **kw)\nlogs = boto3.client('logs', **kw)\ns3 = boto3.client('s3', **kw)\n",
            self.agent.str("endpoint"),
            self.agent.str("region"),
        );
        python(&format!("{prelude}{}", dedent(code)))
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

    fn assert_nothing_left(&self) {
        let left = self.leftovers();
        for k in ["tasks", "task_definitions", "secrets"] {
            assert_eq!(left[k], Value::Array(vec![]), "{k} left on ECS: {left}");
        }
    }

    /// A command of the CLI under test with the agent's AWS settings (what a user's would say).
    fn command(&self, cwd: &Path, args: &[&str]) -> Command {
        let mut cmd = Command::new(physalia_bin());
        cmd.current_dir(cwd)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        self.env(&mut cmd);
        cmd
    }

    /// Every container on the agent's network (workers' and coordinators').
    fn containers(&self) -> Vec<String> {
        physalia_tests::cluster::containers_on(self.agent.str("network"), &|_| true)
    }
}

impl Cloud for Ecs {
    const NAME: &'static str = "ecs";
    const WORKER_NET: &'static str = "172.31.";

    fn start() -> Option<Ecs> {
        Ecs::start_with(&[])
    }

    fn cli(&self, cwd: &Path, args: &[&str]) -> Command {
        self.command(cwd, args)
    }

    fn store(&self) -> String {
        format!("s3://{}/jobs", self.s3.bucket)
    }

    fn record(&self, id: &str, file: &str) -> Option<String> {
        self.s3.object(&format!("jobs/{id}/{file}"))
    }

    fn stored(&self, prefix: &str) -> Vec<(String, String)> {
        self.s3.stored("jobs", prefix)
    }

    /// The `backend:` section of a cluster-mode job (the default mode on ecs), infra/ecs's outputs:
    /// with the coordinator's task role, and `image` as both the workers' and the coordinator's image.
    fn backend(&self, image: &str) -> String {
        let list = |k: &str| {
            self.info()[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "backend:\n  name: ecs\n  ecs:\n    cluster: {}\n    subnets: [{}]\n    security_groups: [{}]\n    execution_role_arn: {}\n    coordinator_task_role_arn: {}\n    log_group: {}\n    image: {image}\n    sku: {SKU}\n",
            self.agent.str("cluster"),
            list("subnets"),
            list("security_groups"),
            self.agent.str("execution_role_arn"),
            self.agent.str("coordinator_task_role_arn"),
            self.agent.str("log_group"),
        )
    }

    /// The SKU's catalog price per worker-second, and the coordinator's container (1 vCPU, 2 GiB of
    /// Fargate) at the same prices.
    fn prices(&self) -> (f64, f64) {
        let field = |f: &str| catalog_number("aws-ecs.yaml", SKU, f);
        let (per_vcpu, per_gib) = (field("usd_per_vcpu_second"), field("usd_per_gib_second"));
        (
            field("vcpus") * per_vcpu + field("memory_gib") * per_gib,
            per_vcpu + 2.0 * per_gib,
        )
    }

    fn worker_containers(&self) -> Vec<String> {
        // the agent labels each task's main container by its name in the task definition
        let ps = Command::new("docker")
            .args([
                "ps",
                "--format",
                "{{.Names}}",
                "--filter",
                &format!("network={}", self.agent.str("network")),
                "--filter",
                "label=physalia.ecs-agent.container=worker",
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&ps.stdout)
            .lines()
            .map(String::from)
            .collect()
    }

    /// Waits (up to a minute) until ECS holds nothing of the test's jobs: a detached job's
    /// coordinator deletes its own task definition as it ends, and its task stops with its container
    /// (so nothing of a `detached` job stays either).
    fn wait_nothing_left(&self, _detached: &[&str]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = self.leftovers();
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

    /// Refused before anything is made: an unknown cluster, no coordinator role, a local store.
    fn refusals(&self, s: &Scenario<'_, Self>, job: &str) -> Vec<Refusal> {
        let backend = self.backend(&s.image);
        let store = &s.store;
        let refusal = |text: String, needles: &[&str]| Refusal {
            text,
            sets: vec![],
            needles: needles.iter().map(|n| n.to_string()).collect(),
        };
        vec![
            refusal(
                format!(
                    "{job}output: {{dir: {store}}}\n{}",
                    backend.replace("cluster: physalia", "cluster: nope")
                ),
                &["bad.yaml", "nope"],
            ),
            refusal(
                format!(
                    "{job}output: {{dir: {store}}}\n{}",
                    backend
                        .lines()
                        .filter(|l| !l.contains("coordinator_task_role_arn"))
                        .collect::<Vec<_>>()
                        .join("\n")
                ),
                &["bad.yaml", "backend.ecs.coordinator_task_role_arn"],
            ),
            refusal(
                format!("{job}output: {{dir: jobs}}\n{backend}"),
                &["bad.yaml", "output.dir", "s3://"],
            ),
        ]
    }

    fn check_coordinator_host(&self, _id: &str, _host: &str) {
        // not this machine's (the scenario checks), and nothing more to say of a Fargate task's
    }

    /// Nothing in the store after the refusals; then a coordinator image without the CLI: the job
    /// fails with the platform's reason, its record says so, and nothing is left.
    fn after_refusals(&self, s: &Scenario<'_, Self>) {
        assert!(self.s3.keys("jobs/").is_empty(), "nothing in the store");
        write_job(
            s.path(),
            "nocli.yaml",
            &format!(
                "{}output: {{dir: {}}}\n{}",
                physalia_tests::cluster::HEAL,
                s.store,
                self.backend(&build_image(&[]))
            ),
        );
        let t_fail = Instant::now();
        let out = s.cli(&["submit", "nocli.yaml"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        eprintln!(
            "a coordinator image without the CLI failed in {:.1} s: {err}",
            t_fail.elapsed().as_secs_f64()
        );
        assert!(!out.status.success(), "{err}");
        assert!(err.contains("coordinator"), "{err}");
        let failed = self
            .s3
            .keys("jobs/")
            .into_iter()
            .find(|k| k.ends_with("/status.json"))
            .expect("the failed job's record");
        let status: Value = serde_json::from_str(&self.s3.object(&failed).unwrap()).unwrap();
        assert_eq!(status["state"], "failed", "{status}");
        self.wait_nothing_left(&[]);
    }

    /// The dataset is in the store once, content-addressed, with the coordinator's partitions beside
    /// it, and a second job reuses both.
    fn check_followed(&self, s: &Scenario<'_, Self>, _run: &Followed) {
        let is_dataset = |k: &String| !k.contains(".parts/");
        let datasets: Vec<String> = self
            .s3
            .keys("jobs/.datasets/")
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
        let parts = self.s3.written(&parts_dir);
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
        let (again, _) = s.ok(&["submit", "job.yaml", "--set", "train.epochs=1"]);
        assert!(again.contains("finished on 3 workers"), "{again}");
        assert_eq!(
            self.s3
                .keys("jobs/.datasets/")
                .into_iter()
                .filter(is_dataset)
                .collect::<Vec<_>>(),
            datasets,
            "the second job reused the uploaded dataset"
        );
        // and the partitions the first coordinator computed: fetched, not computed and written again
        assert_eq!(
            self.s3.written(&parts_dir),
            parts,
            "the second job rewrote the stored partitions"
        );
        physalia_tests::cluster::chunked_cluster_job(self, s);
    }

    /// The coordinator's identity is its task role (no key in its task definition), and the workers
    /// dial the port its task definition declares.
    fn while_running(&self, _s: &Scenario<'_, Self>, id: &str) {
        let td = self.query(&format!(
            "arns = ecs.list_task_definitions(familyPrefix='physalia-{id}-coordinator')['taskDefinitionArns']\n\
             print(json.dumps(ecs.describe_task_definition(taskDefinition=arns[0])['taskDefinition']))"
        ));
        assert_eq!(
            td["taskRoleArn"],
            self.info()["coordinator_task_role_arn"],
            "{td}"
        );
        let container = &td["containerDefinitions"][0];
        assert_eq!(container["name"], "coordinator", "{td}");
        // the workers dial a port the task definition declares (the coordinator binds those: the
        // first for a launch, the next for joiners of a resize in place or a prewarm beside it)
        let declared: Vec<u64> = container["portMappings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["containerPort"].as_u64().unwrap())
            .collect();
        let mut dialled = Vec::new();
        for c in self.containers() {
            let env = Command::new("docker")
                .args([
                    "inspect",
                    "-f",
                    "{{range .Config.Env}}{{println .}}{{end}}",
                    &c,
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
            let port: u64 = addr.rsplit_once(':').unwrap().1.parse().unwrap();
            assert!(
                declared.contains(&port),
                "a worker dials {addr}, the coordinator's task declares {declared:?}"
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
    }
}

physalia_tests::cluster_scenario!(crate::Ecs);

/// The worker image with the CLI (the coordinator's image; it runs workers too), built from the
/// `physalia-worker` and `physalia` under test; one test builds it while the others wait.
fn image() -> String {
    build_image(&["--with-cli"])
}

fn submit(cwd: &Path, ecs: Option<&Ecs>, sets: &[&str]) -> Value {
    let mut cmd = Command::new(physalia_bin());
    cmd.current_dir(cwd)
        .args(["submit", "job.yaml", "-q", "--output", "json"]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    if let Some(e) = ecs {
        e.env(&mut cmd);
    }
    let (out, _) = ok_output(&mut cmd);
    physalia_tests::last_json(&out)
}

/// A client-side job file of GCN 2 x 16 on Cora (row-normalized, one thread a worker), its record under
/// `jobs/`.
fn cora_job(cora: &Path, name: &str, epochs: usize, workers: usize) -> String {
    format!(
        "name: {name}\ndataset:\n  path: {}\n  row_normalize: true\nmodel: {{kind: gcn, layers: 2, hidden: 16}}\ntrain: {{epochs: {epochs}, seed: 0, threads: 1}}\nworkers: {workers}\noutput: {{dir: jobs}}\n",
        cora.display()
    )
}

fn losses(dir: &Path) -> Vec<f64> {
    metrics(dir)
        .iter()
        .map(|m| m["metrics"]["loss"].as_f64().unwrap())
        .collect()
}

fn assert_same_losses(got: &[f64], want: &[f64]) {
    physalia_tests::assert_same_losses("ecs", got, want, 1e-4);
}

#[test]
fn cora_on_three_ecs_tasks_trains_like_three_local_processes() {
    let Some(cora) = physalia_tests::cora_dir() else {
        return;
    };
    let Some(ecs) = Ecs::start() else {
        return;
    };
    let t = TempDir::new().unwrap();
    let job = cora_job(&cora, "ecs", 20, 3);
    write_job(t.path(), "job.yaml", &job);
    let local = submit(t.path(), None, &[]);
    write_job(
        t.path(),
        "job.yaml",
        &format!("{job}{}", ecs.client_backend(&image())),
    );
    let run = submit(t.path(), Some(&ecs), &[]);
    let dir = t.path().join(run["job_dir"].as_str().unwrap());
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
        run["usd_total"].as_f64().unwrap(),
        run["worker_seconds"].as_f64().unwrap(),
    );
    assert!(ws > 0.0 && usd > 0.0, "{run}");
    let want = ws * ecs.prices().0;
    assert!((usd - want).abs() <= 1e-9 + 1e-6 * want, "{usd} vs {want}");
    ecs.assert_nothing_left();
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
    let Some(ecs) = Ecs::start_with(&["--g5-instances", "3"]) else {
        return;
    };
    // what the worker asks for is what the catalog's placement says, and it fits the registered size
    let catalog = physalia_planner::Catalog::builtin();
    let sku = catalog.get("ecs-g5.xlarge").unwrap();
    assert_eq!(sku.instance_types(), ["g5.xlarge"]);
    let registered = ecs.info()["g5_xlarge"]["MEMORY"].as_f64().unwrap();
    assert!(
        sku.request_memory_gib() * 1024.0 <= registered,
        "{registered}"
    );
    assert!(
        sku.memory_gib * 1024.0 + 64.0 > registered,
        "the whole instance must not fit"
    );

    // the fake refuses what ECS refuses: today's request and today's constraint
    let refused = ecs.query(&format!(
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
        subnets = ecs.info()["subnets"]
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
    let backend = ecs.client_backend(&image()).replace(
        &format!("sku: {SKU}"),
        "sku: ecs-g5.xlarge
    capacity: ec2",
    );
    // a client-mode job the platform refuses (a cluster ECS does not have) is refused by the preflight
    // before its record is written: `list` shows no failed job for a submit that never ran
    write_job(
        t.path(),
        "job.yaml",
        &format!(
            "{job}{}",
            backend.replace("cluster: physalia", "cluster: nope")
        ),
    );
    let before = job_dirs(&t.path().join("jobs"));
    let out = ecs
        .command(t.path(), &["submit", "job.yaml", "-q"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("preflight") && err.contains("nope"), "{err}");
    assert_eq!(job_dirs(&t.path().join("jobs")), before, "{err}");
    ecs.assert_nothing_left();

    write_job(t.path(), "job.yaml", &format!("{job}{backend}"));
    let run = submit(t.path(), Some(&ecs), &[]);
    let dir = t.path().join(run["job_dir"].as_str().unwrap());
    assert_same_losses(
        &losses(&dir),
        &losses(&t.path().join(local["job_dir"].as_str().unwrap())),
    );
    assert_eq!(read_json(&dir.join("status.json"))["state"], "succeeded");
    // the tasks were placed on the g5.xlarge instances
    let placed = ecs.query(
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
    ecs.assert_nothing_left();
}

/// Issue 30: the harness's tasks are reached only where infra/ecs's security group opens (the agent
/// copies its ingress rules from infra/ecs/main.tf into moto's EC2 and guards each task's address with
/// its ENI's groups). infra/ecs applied with `-var mesh_port=7200`: a job on the default mesh port (7100)
/// fails, its error naming the port the workers could not reach; the same job with the output's
/// `mesh_port: 7200` in its `backend.ecs` trains as the local run does.
#[test]
fn issue_30_a_port_the_security_group_closes_fails_the_job_naming_it() {
    let Some(cora) = physalia_tests::cora_dir() else {
        return;
    };
    let Some(ecs) = Ecs::start_with(&["--infra-var", "mesh_port=7200"]) else {
        return;
    };
    let t = TempDir::new().unwrap();
    // a silent worker is given up after 20 s, not the default minute: the closed port stalls the mesh
    let job = cora_job(&cora, "ecs-ports", 3, 2) + "max_retries: 0\ntimeouts: {epoch_s: 20}\n";
    write_job(t.path(), "job.yaml", &job);
    let local = submit(t.path(), None, &[]);
    let backend = ecs.client_backend(&image());
    write_job(t.path(), "job.yaml", &format!("{job}{backend}"));
    let before = job_dirs(&t.path().join("jobs"));
    let out = ecs
        .command(t.path(), &["submit", "job.yaml", "-q"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    let after = job_dirs(&t.path().join("jobs"));
    let failed: Vec<_> = after.iter().filter(|d| !before.contains(d)).collect();
    assert_eq!(failed.len(), 1, "{err}");
    let status = read_json(&failed[0].join("status.json"));
    assert_eq!(status["state"], "failed", "{status}");
    // worker 0 dialled worker 1's mesh endpoint on the closed port until the coordinator stopped
    // the job: the error names the endpoint and the port
    let said = format!("{err}\n{status}");
    assert!(
        said.contains("worker 0 waited on it at its mesh endpoint 172.31.")
            && said.contains(":7100")
            && said.contains("does not open UDP port 7100"),
        "{said}"
    );
    ecs.assert_nothing_left();

    let backend = backend.replace("  ecs:\n", "  ecs:\n    mesh_port: 7200\n");
    write_job(t.path(), "job.yaml", &format!("{job}{backend}"));
    let run = submit(t.path(), Some(&ecs), &[]);
    let dir = t.path().join(run["job_dir"].as_str().unwrap());
    assert_eq!(read_json(&dir.join("status.json"))["state"], "succeeded");
    assert_same_losses(
        &losses(&dir),
        &losses(&t.path().join(local["job_dir"].as_str().unwrap())),
    );
    ecs.assert_nothing_left();
}

/// A 2 -> 3 worker policy (in place, the joiner prewarmed), one worker's container killed mid-job (its epoch retried from the last
/// checkpoint), the record in moto's S3 read by `status`, `logs` and `report` from second processes, then
/// a second job cancelled through the store while it runs.
#[test]
fn an_ecs_job_grows_survives_a_killed_container_and_cancels_cleanly() {
    let Some(ecs) = Ecs::start() else {
        return;
    };
    let t = TempDir::new().unwrap();
    let job = "name: grow\ndataset:\n  synth: {kind: sbm, nodes: 4000, classes: 4, feat_dim: 16, avg_degree: 10, homophily: 0.8, seed: 1}\nmodel: {kind: gcn, layers: 2, hidden: 16}\ntrain: {epochs: 30, seed: 0, threads: 1}\nworkers: 2\n";
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
        "min_workers: 2\nmax_workers: 3\ncooldown_epochs: 0\nprewarm: {when: epoch == 2, rule: three-at-4}\nrules:\n  - name: three-at-4\n    when: epoch == 4\n    then: {set_workers: 3}\n",
    );
    let store = format!("s3://{}/jobs", ecs.info()["bucket"].as_str().unwrap());
    write_job(
        t.path(),
        "job.yaml",
        &format!(
            "{job}output: {{dir: {store}}}\nscaling_file: policy.yaml\n{}",
            ecs.client_backend(&image())
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
        ecs.env(&mut cmd);
        cmd
    };
    let child = command(&["submit", "job.yaml", "-q", "--output", "json"])
        .spawn()
        .unwrap();
    let staged = wait_for_epochs(&staging, 6, &[]);
    // kill one running worker's container: ECS reports its task stopped, the epoch is retried
    let containers = ecs.worker_containers();
    assert_eq!(containers.len(), 3, "grown to three tasks: {containers:?}");
    let victim = containers.first().expect("a running worker container");
    docker_kill(victim);
    // the job resizes in place, so only the killed task is replaced (issue 33): when its replacement's
    // container appears, the other two tasks' containers still run (a relaunch stops them first)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let running = loop {
        let now = ecs.worker_containers();
        if now.iter().any(|c| !containers.contains(c)) {
            break now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no replacement task within 120 s: {now:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    for survivor in &containers[1..] {
        assert!(
            running.contains(survivor),
            "task {survivor} was stopped by the kill of {victim}: {running:?}\n{}",
            std::fs::read_to_string(staged.join("logs/coordinator.log")).unwrap_or_default()
        );
    }
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
    // the growth was in place (issue 33): the two running tasks went on, one task joined them, started
    // by the policy's prewarm while the job trained (no epoch waited for its start)
    let log = std::fs::read_to_string(staged.join("logs/coordinator.log")).unwrap();
    assert!(
        log.contains("in place, 2 -> 3 workers after epoch 4 (joiners prewarmed as launch"),
        "{log}"
    );
    assert_eq!(log.matches("in-place resize ready").count(), 1, "{log}");
    assert!(
        events.contains("retr"),
        "the killed worker's epoch was retried: {events}"
    );
    assert!(
        events.contains("alone") && log.contains("in-place replacement ready"),
        "the killed task was replaced alone: {events}\n{log}"
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
    ecs.assert_nothing_left();
    cancel_a_client_mode_job(&ecs, &command, &staging, &store);
}

/// A client-mode job cancelled through the store while it runs: its `submit` exits non-zero, its
/// staged and stored records say cancelled, and no task, task definition or secret is left.
fn cancel_a_client_mode_job(
    ecs: &Ecs,
    command: &dyn Fn(&[&str]) -> Command,
    staging: &Path,
    store: &str,
) {
    let done = job_dirs(staging);
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
    let running = wait_for_epochs(staging, 2, &done);
    let id = running.file_name().unwrap().to_string_lossy().to_string();
    // the store has the running job once the coordinator's mirror made a pass
    let deadline = Instant::now() + Duration::from_secs(30);
    while !command(&["status", &id, "--dir", store])
        .output()
        .unwrap()
        .status
        .success()
    {
        assert!(Instant::now() < deadline, "the job never reached the store");
        std::thread::sleep(Duration::from_millis(200));
    }
    let cancel = command(&["cancel", &id, "--dir", store]).output().unwrap();
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
    let status = command(&["status", &id, "--dir", store, "--output", "json"])
        .output()
        .unwrap();
    let view: Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(view["state"], "cancelled", "the store's record says so too");
    ecs.assert_nothing_left();
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

/// Issue 30: a user signed in with a named profile alone (`AWS_CONFIG_FILE` and
/// `AWS_SHARED_CREDENTIALS_FILE`, `AWS_PROFILE`; no keys and no region in the environment; the region,
/// eu-west-2, only in the profile, where the cluster and the bucket are) submits a cluster-mode job: it
/// trains to the local run's losses, and `status`, `logs` and `report` read it back from the store. The
/// same with a profile whose credentials come from a `credential_process`. Without the profile's region
/// the calls would go to us-east-1, where this cluster is not; without its keys nothing is signed.
#[test]
fn issue_30_a_cluster_job_submitted_with_a_named_profile_alone_trains_and_reads_back() {
    let Some(ecs) = Ecs::start_with(&["--region", "eu-west-2"]) else {
        return;
    };
    let t = TempDir::new().unwrap();
    let head = "dataset:\n  synth: {kind: sbm, nodes: 2000, classes: 4, feat_dim: 16, avg_degree: 8, homophily: 0.8, seed: 1}\nmodel: {kind: gcn, layers: 2, hidden: 16}\ntrain: {epochs: 3, seed: 0, threads: 1}\nworkers: 2\n";
    let want =
        physalia_tests::local_losses(t.path(), "local.yaml", &format!("name: local\n{head}"));

    // the user's AWS files: secrets, so 0400; the credential process prints the same keys
    let secret_file = |name: &str, text: &str, mode: u32| -> PathBuf {
        let path = t.path().join(name);
        physalia_tests::secret_file(&path, text, mode);
        path
    };
    let process = secret_file(
        "aws-credentials.sh",
        "#!/bin/sh\nprintf '{\"Version\": 1, \"AccessKeyId\": \"testing\", \"SecretAccessKey\": \"testing\"}\\n'\n",
        0o500,
    );
    let config = secret_file(
        "aws-config",
        &format!(
            "[default]\nregion = us-east-1\n\n[profile signed-in]\nregion = eu-west-2\n\n[profile by-process]\nregion = eu-west-2\ncredential_process = {}\n",
            process.display()
        ),
        0o400,
    );
    let credentials = secret_file(
        "aws-credentials",
        "[signed-in]\naws_access_key_id = testing\naws_secret_access_key = testing\n",
        0o400,
    );
    let store = ecs.store();
    let cli = |profile: &str, args: &[&str]| -> (String, String) {
        let mut cmd = Command::new(physalia_bin());
        cmd.current_dir(t.path())
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for key in [
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "AWS_REGION",
            "AWS_DEFAULT_REGION",
        ] {
            cmd.env_remove(key);
        }
        // moto stands in for AWS's endpoints (plain HTTP on this machine)
        cmd.env("AWS_CONFIG_FILE", &config)
            .env("AWS_SHARED_CREDENTIALS_FILE", &credentials)
            .env("AWS_PROFILE", profile)
            .env("AWS_ENDPOINT_URL", ecs.agent.str("endpoint"))
            .env("AWS_ALLOW_HTTP", "true");
        ok_output(&mut cmd)
    };
    for profile in ["signed-in", "by-process"] {
        write_job(
            t.path(),
            "job.yaml",
            &format!(
                "name: {profile}\n{head}output: {{dir: {store}}}\n{}",
                ecs.backend(&image())
            ),
        );
        let (out, _) = cli(profile, &["submit", "job.yaml", "-q", "--output", "json"]);
        let id =
            physalia_tests::job_id(physalia_tests::last_json(&out)["job_url"].as_str().unwrap());
        let (status, _) = cli(
            profile,
            &["status", &id, "--dir", &store, "--output", "json"],
        );
        let status: Value = serde_json::from_str(&status).unwrap();
        assert_eq!(status["state"], "succeeded", "{profile}: {status}");
        let metrics = ecs
            .record(&id, "metrics.jsonl")
            .expect("metrics in the store");
        physalia_tests::assert_same_losses("ecs", &physalia_tests::losses(&metrics), &want, 1e-4);
        let (logs, _) = cli(profile, &["logs", &id, "--dir", &store, "--rank", "1"]);
        assert!(logs.contains("advertised 172.31."), "{profile}: {logs}");
        cli(
            profile,
            &["report", &format!("{store}/{id}"), "--out", "report.html"],
        );
        let html = std::fs::read_to_string(t.path().join("report.html")).unwrap();
        assert!(html.contains("<svg"), "{profile}");
    }
    ecs.assert_nothing_left();
}
