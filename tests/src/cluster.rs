//! One cluster-mode scenario, written once and run on every platform's fake: `tests/tests/ecs_job.rs`,
//! `kubernetes_job.rs` and `aci_job.rs` each implement [`Cloud`] for their fake and instantiate the
//! scenario with [`cluster_scenario!`](crate::cluster_scenario), which makes two tests:
//!
//! - `cluster_scenario::cora_followed`: `submit` (followed) uploads Cora to the job store and starts
//!   the coordinator on the platform, which trains on 3 workers to a local 3-process run's losses; the
//!   record is in the store (the coordinator's handle among it), the coordinator ran there and not
//!   here, the ledger is worker-seconds at the SKU's price plus the coordinator's seconds at its
//!   price, what `submit` printed is the record's, and nothing is left on the platform.
//! - `cluster_scenario::refusals_a_killed_worker_and_cancel`: bad settings are refused with the
//!   platform's reason and leave nothing; a detached job runs on (`status` says `running` at once),
//!   it grows 2 -> 3 workers in place (issue 33), one of its worker containers is killed, replaced
//!   alone (the others run on) and its epoch retried from the checkpoint; `logs --rank coordinator --follow` follows it to its end, with the
//!   same-policy local run's losses; `status`, `logs` (a worker's, the coordinator's) and `report`
//!   read the store; then a followed job is detached from with Ctrl-C, runs on, and `cancel` through
//!   the store leaves nothing on the platform.
//!
//! What only one platform has (who created what, the store's dataset reuse, the coordinator's task
//! definition, throttling counters) is checked by the platform's hooks; [`chunked_cluster_job`] (a
//! chunked dataset whose workers read the store through signed URLs) is run from the hooks of the
//! platforms whose store signs them (ECS on S3, ACI on Blob Storage).

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use physalia_testkit::python;
use serde_json::Value;
use tempfile::TempDir;

use crate::{
    assert_same_losses, build_image, job_id, last_json, local_losses, losses, ok_output,
    physalia_bin, repo_root, wait_for_job, write_job,
};

/// The followed job: Cora on 3 workers, 20 epochs.
pub const CORA: &str = "name: cora\ndataset:\n  path: cora.safetensors\n  row_normalize: true\nmodel: {kind: gcn, layers: 2, hidden: 16}\ntrain: {epochs: 20, seed: 0, threads: 1}\nworkers: 3\n";

/// The detached job: long enough (200 epochs of 20,000 nodes on 2 workers) that a worker is killed
/// while it trains.
pub const HEAL: &str = "name: heal\ndataset:\n  synth: {kind: sbm, nodes: 20000, classes: 4, feat_dim: 32, avg_degree: 10, homophily: 0.8, seed: 1}\nmodel: {kind: gcn, layers: 2, hidden: 32}\ntrain: {epochs: 200, seed: 0, threads: 1}\nworkers: 2\n";

/// The detached job's policy: it grows once, 2 -> 3 workers after epoch 2, in place (issue 33) on every
/// platform here.
pub const GROW: &str = "scaling:\n  min_workers: 2\n  max_workers: 3\n  cooldown_epochs: 0\n  rules:\n    - name: three-at-2\n      when: epoch == 2\n      then: {set_workers: 3}\n";

/// A job file the platform refuses before it makes anything: submitted as `bad.yaml` with `--set
/// sets`, its error must contain every needle.
pub struct Refusal {
    pub text: String,
    pub sets: Vec<String>,
    pub needles: Vec<String>,
}

/// The followed Cora job, for the platform's own checks.
pub struct Followed {
    pub id: String,
    pub stdout: String,
    pub stderr: String,
    /// [`Cloud::mark`] just before it was submitted.
    pub mark: usize,
}

/// A platform's fake, as the scenario drives it.
pub trait Cloud: Sized {
    /// `backend.name`, and the platform in messages.
    const NAME: &'static str;
    /// How a worker's address starts on the platform's network (`advertised 10.244.`).
    const WORKER_NET: &'static str;
    /// Starts the fake: `None` (and a note) where it cannot run here.
    fn start() -> Option<Self>;
    /// A CLI command as a user with this platform's settings runs it, in `cwd`.
    fn cli(&self, cwd: &Path, args: &[&str]) -> Command;
    /// The job store's URL.
    fn store(&self) -> String;
    /// `file` of job `id`'s record in the store, as the user reads it; `None` where it is not there.
    fn record(&self, id: &str, file: &str) -> Option<String>;
    /// The objects under `prefix` of the store (relative to [`Cloud::store`]'s URL), each with a mark
    /// that changes when it is written again (its time or ETag), in key order.
    fn stored(&self, prefix: &str) -> Vec<(String, String)>;
    /// A cluster-mode job file's `backend:` section, `image` the workers' and the coordinator's.
    fn backend(&self, image: &str) -> String;
    /// The catalog's prices per second: (a worker of the SKU, the coordinator).
    fn prices(&self) -> (f64, f64);
    /// The running workers' containers (not the coordinator's).
    fn worker_containers(&self) -> Vec<String>;
    /// Waits until the platform holds nothing of the test's jobs but what `detached` jobs keep there
    /// by design; fails the test when something is left.
    fn wait_nothing_left(&self, detached: &[&str]);
    /// Settings the platform refuses, made from `job` (a job file's head, without `output` and
    /// `backend`).
    fn refusals(&self, s: &Scenario<'_, Self>, job: &str) -> Vec<Refusal>;
    /// Checks that `host`, the coordinator's hostname in job `id`'s record, is the platform's.
    fn check_coordinator_host(&self, id: &str, host: &str);
    /// A position in the fake's request log (the Cora job's requests are those after it).
    fn mark(&self) -> usize {
        0
    }
    /// After the refusals.
    fn after_refusals(&self, _s: &Scenario<'_, Self>) {}
    /// After the followed Cora job's shared checks.
    fn check_followed(&self, _s: &Scenario<'_, Self>, _run: &Followed) {}
    /// While the job `id` to be cancelled runs.
    fn while_running(&self, _s: &Scenario<'_, Self>, _id: &str) {}
    /// At the end of each half.
    fn finish(&self) {}
}

/// Makes the scenario's two tests for `$cloud` (a [`Cloud`]), in a module `cluster_scenario`.
#[macro_export]
macro_rules! cluster_scenario {
    ($cloud:ty) => {
        mod cluster_scenario {
            /// The shared scenario's followed Cora job (see `physalia_tests::cluster`).
            #[test]
            fn cora_followed() {
                $crate::cluster::cora_followed::<$cloud>();
            }

            /// The shared scenario's refusals, killed worker, detach and cancel (see
            /// `physalia_tests::cluster`).
            #[test]
            fn refusals_a_killed_worker_and_cancel() {
                $crate::cluster::refusals_a_killed_worker_and_cancel::<$cloud>();
            }
        }
    };
}

/// The scenario's first test.
pub fn cora_followed<C: Cloud>() {
    let Some(cora) = crate::cora_dir() else {
        return;
    };
    let Some(cloud) = C::start() else {
        return;
    };
    let s = Scenario::new(&cloud);
    let run = s.cora(&cora);
    cloud.check_followed(&s, &run);
    cloud.wait_nothing_left(&[]);
    cloud.finish();
}

/// The scenario's second test.
pub fn refusals_a_killed_worker_and_cancel<C: Cloud>() {
    let Some(cloud) = C::start() else {
        return;
    };
    let s = Scenario::new(&cloud);
    s.refusals();
    cloud.after_refusals(&s);
    let finished = s.heal();
    s.cancel(&finished);
    cloud.finish();
}

/// One run of the scenario on `cloud`: its folder, the image under test, the store.
pub struct Scenario<'a, C: Cloud> {
    pub cloud: &'a C,
    pub dir: TempDir,
    /// The workers' and the coordinator's image (`physalia image build --with-cli`).
    pub image: String,
    pub store: String,
}

impl<'a, C: Cloud> Scenario<'a, C> {
    pub fn new(cloud: &'a C) -> Self {
        Scenario {
            cloud,
            dir: TempDir::new().unwrap(),
            image: build_image(&["--with-cli"]),
            store: cloud.store(),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A CLI command in the scenario's folder, with the platform's settings.
    pub fn cli(&self, args: &[&str]) -> Command {
        self.cloud.cli(self.path(), args)
    }

    /// Runs a CLI command that must succeed: its standard output and error.
    pub fn ok(&self, args: &[&str]) -> (String, String) {
        ok_output(&mut self.cli(args))
    }

    /// Writes `job` (a head) as the cluster-mode job file `name`: the store, the platform's backend.
    pub fn write_cluster_job(&self, name: &str, job: &str) {
        let text = format!(
            "{job}output: {{dir: {}}}\n{}",
            self.store,
            self.cloud.backend(&self.image)
        );
        write_job(self.path(), name, &text);
    }

    /// `status ID --output json`, from the store.
    pub fn status(&self, id: &str) -> Value {
        let (out, _) = self.ok(&["status", id, "--dir", &self.store, "--output", "json"]);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
    }

    /// Polls job `id`'s status until `done(state, epoch)`: see [`wait_for_job`].
    pub fn wait(&self, id: &str, done: &dyn Fn(&str, u64) -> bool) -> (String, u64) {
        wait_for_job(&|args| self.cli(args), &self.store, id, done)
    }

    /// A JSON file of job `id`'s record.
    pub fn record_json(&self, id: &str, file: &str) -> Value {
        let text = self
            .cloud
            .record(id, file)
            .unwrap_or_else(|| panic!("no {file} in job {id}'s record"));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}: {text}"))
    }

    /// Cora, followed: see the module's documentation.
    fn cora(&self, cora: &Path) -> Followed {
        // cluster mode uploads a dataset file (a raw folder is imported first)
        ok_output(
            Command::new(physalia_bin())
                .current_dir(self.path())
                .args(["data", "import"])
                .arg(cora)
                .args(["--out", "cora.safetensors"]),
        );
        let want = local_losses(self.path(), "job.yaml", CORA);
        self.write_cluster_job("job.yaml", CORA);
        let mark = self.cloud.mark();
        let t0 = Instant::now();
        let (stdout, stderr) = self.ok(&["submit", "job.yaml", "--output", "json"]);
        let took = t0.elapsed();
        assert_eq!(
            stderr.lines().filter(|l| l.starts_with("epoch ")).count(),
            20,
            "the per-epoch lines of a local job: {stderr}"
        );
        assert!(stderr.contains("uploading the dataset"), "{stderr}");
        let v = last_json(&stdout);
        let id = job_id(v["job_url"].as_str().unwrap());
        let metrics = self
            .cloud
            .record(&id, "metrics.jsonl")
            .expect("metrics in the store");
        let got = losses(&metrics);
        assert_same_losses(C::NAME, &got, &want, 1e-4);
        let max_diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        let status = self.record_json(&id, "status.json");
        assert_eq!(status["state"], "succeeded", "{status}");
        // the coordinator ran on the platform, not here
        let host = status["coordinator"]["host"].as_str().unwrap();
        assert_ne!(host, local_hostname(), "{status}");
        self.cloud.check_coordinator_host(&id, host);
        assert!(
            self.cloud.record(&id, "coordinator.json").is_some(),
            "the coordinator's handle is in the record"
        );
        let (ws, cs, usd) = self.check_ledger(&id);
        assert_eq!(v["usd_total"], usd, "what submit printed");
        eprintln!(
            "{} cluster-mode Cora: {:.1} s end to end, {ws:.1} worker-s, {cs:.1} coordinator-s, {usd}, \
             losses within {max_diff:.2e} of the local run's",
            C::NAME,
            took.as_secs_f64()
        );
        Followed {
            id,
            stdout,
            stderr,
            mark,
        }
    }

    /// The ledger of job `id`: its worker-seconds at the SKU's price plus its coordinator's seconds at
    /// the coordinator's; (worker-seconds, coordinator-seconds, the summary's `usd_total`).
    fn check_ledger(&self, id: &str) -> (f64, f64, Value) {
        let summary = self.record_json(id, "summary.json");
        let (usd, ws, cs, cp) = (
            summary["usd_total"].as_f64().unwrap(),
            summary["worker_seconds"].as_f64().unwrap(),
            summary["coordinator_seconds"].as_f64().unwrap(),
            summary["coordinator_usd_per_s"].as_f64().unwrap(),
        );
        let (worker_per_s, coordinator_per_s) = self.cloud.prices();
        assert!(ws > 0.0 && cs > 0.0, "{summary}");
        assert!((cp - coordinator_per_s).abs() < 1e-15, "{cp}");
        let want_usd = ws * worker_per_s + cs * cp;
        assert!(
            (usd - want_usd).abs() <= 1e-9 + 1e-6 * want_usd,
            "{usd} vs {want_usd}"
        );
        (ws, cs, summary["usd_total"].clone())
    }

    /// Bad settings: the platform's reason, nothing made.
    fn refusals(&self) {
        for r in self.cloud.refusals(self, HEAL) {
            write_job(self.path(), "bad.yaml", &r.text);
            let mut args = vec!["submit", "bad.yaml"];
            for set in &r.sets {
                args.extend(["--set", set.as_str()]);
            }
            let out = self.cli(&args).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{:?}: {err}", r.sets);
            for n in &r.needles {
                assert!(
                    err.contains(n.as_str()),
                    "{:?}: {err:?} lacks {n:?}",
                    r.sets
                );
            }
            self.cloud.wait_nothing_left(&[]);
        }
    }

    /// The detached job with a worker killed: see the module's documentation. Returns its id.
    fn heal(&self) -> String {
        let job = format!("{HEAL}{GROW}");
        let want = local_losses(self.path(), "heal.yaml", &job);
        self.write_cluster_job("heal.yaml", &job);
        let t0 = Instant::now();
        let (out, _) = self.ok(&["submit", "heal.yaml", "--detach", "--output", "json"]);
        let id = job_id(last_json(&out)["job_url"].as_str().unwrap());
        assert!(id.starts_with("heal-"), "{out}");
        // it returned while the job runs (the coordinator has its job to train yet)
        let view = self.status(&id);
        assert_eq!(view["state"], "running", "{view}");
        assert_eq!(view["platform_coordinator"]["backend"], C::NAME, "{view}");
        self.wait(&id, &|_, e| e >= 3);
        let workers = self.cloud.worker_containers();
        assert!(!workers.is_empty(), "no worker container runs");
        docker_kill(&workers[0]);
        let (logs, _) = self.ok(&[
            "logs",
            &id,
            "--dir",
            &self.store,
            "--rank",
            "coordinator",
            "--follow",
        ]);
        assert!(logs.contains("epoch 200/200"), "{logs}");
        if std::env::var_os("PHYSALIA_SHOW_COORDINATOR_LOG").is_some() {
            eprintln!("{logs}");
        }
        let (state, _) = self.wait(&id, &|s, _| s != "running" && s != "absent");
        assert_eq!(state, "succeeded");
        assert_eq!(self.status(&id)["state"], "succeeded");
        eprintln!(
            "{} detached job with a killed worker: {:.1} s to the end of the follow",
            C::NAME,
            t0.elapsed().as_secs_f64()
        );
        let metrics = self.cloud.record(&id, "metrics.jsonl").unwrap();
        assert_same_losses(C::NAME, &losses(&metrics), &want, 1e-3);
        let summary = self.record_json(&id, "summary.json");
        let events = summary["scaling_events"].to_string();
        assert!(
            events.contains("retr"),
            "the killed worker's epoch was retried: {events}"
        );
        // the growth kept the two workers running and started one, and the killed worker was replaced
        // alone, the other two running on (issue 33): the ledger marks both launches they made in place
        assert!(events.contains("three-at-2"), "{events}");
        assert!(
            events.contains("replacing worker") && events.contains("alone"),
            "the killed worker was not replaced alone: {events}"
        );
        let spans = summary["launches"].as_array().unwrap();
        let (log, _) = self.ok(&["logs", &id, "--dir", &self.store, "--rank", "coordinator"]);
        assert_eq!(
            spans.iter().filter(|s| s["in_place"] == true).count(),
            2,
            "the growth and the replacement: {spans:?}\n{events}\n{log}"
        );
        assert!(log.contains("after epoch 2: workers 2 -> 3"), "{log}");
        self.read_from_the_store(&id);
        self.cloud.wait_nothing_left(&[&id]);
        id
    }

    /// From the store alone: a worker's output, the coordinator's, the report.
    fn read_from_the_store(&self, id: &str) {
        let (text, _) = self.ok(&["logs", id, "--dir", &self.store, "--rank", "1"]);
        assert!(
            text.contains(&format!("advertised {}", C::WORKER_NET)),
            "{text}"
        );
        let (text, _) = self.ok(&["logs", id, "--dir", &self.store, "--rank", "coordinator"]);
        assert!(!text.is_empty());
        self.ok(&["report", &format!("{}/{id}", self.store), "--out", "r.html"]);
        let html = std::fs::read_to_string(self.path().join("r.html")).unwrap();
        assert!(html.contains("<svg"));
    }

    /// Ctrl-C while following detaches; the job runs on until `cancel`, which leaves nothing but the
    /// `finished` detached job's keepings.
    fn cancel(&self, finished: &str) {
        let mut child = self
            .cli(&[
                "submit",
                "heal.yaml",
                "--set",
                "train.epochs=100000",
                "--set",
                "name=cancelme",
            ])
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
        stderr.read_to_string(&mut rest).unwrap();
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
        self.wait(&id, &|_, e| e >= 2);
        self.cloud.while_running(self, &id);
        self.ok(&["cancel", &id, "--dir", &self.store]);
        let view = self.status(&id);
        assert_eq!(view["state"], "cancelled", "{view}");
        self.cloud.wait_nothing_left(&[finished]);
    }
}

/// This machine's hostname.
pub fn local_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_string()
}

/// `docker kill NAME`, which must succeed.
pub fn docker_kill(name: &str) {
    let killed = Command::new("docker")
        .args(["kill", name])
        .output()
        .unwrap();
    assert!(
        killed.status.success(),
        "{}",
        String::from_utf8_lossy(&killed.stderr)
    );
}

/// The names of the running containers on Docker network `network` that pass `keep`.
pub fn containers_on(network: &str, keep: &dyn Fn(&str) -> bool) -> Vec<String> {
    let ps = Command::new("docker")
        .args([
            "ps",
            "--format",
            "{{.Names}}",
            "--filter",
            &format!("network={network}"),
        ])
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    String::from_utf8_lossy(&ps.stdout)
        .lines()
        .filter(|n| keep(n))
        .map(String::from)
        .collect()
}

/// A number of SKU `sku`'s entry in the catalog `file` (`infra/catalog/…`): the value after `field`.
pub fn catalog_number(file: &str, sku: &str, field: &str) -> f64 {
    let text = std::fs::read_to_string(repo_root().join("infra/catalog").join(file)).unwrap();
    let at = text
        .find(&format!("name: {sku}"))
        .unwrap_or_else(|| panic!("{sku} is not in {file}"));
    let rest = &text[at..];
    let i = rest
        .find(field)
        .unwrap_or_else(|| panic!("{sku} has no {field}"))
        + field.len();
    rest[i..]
        .trim_start_matches([':', ' '])
        .split([',', '}', '\n'])
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// A job store in moto's S3 (the ECS agent's and the Kubernetes fake's), as boto3 reads it.
pub struct MotoS3 {
    pub endpoint: String,
    pub bucket: String,
}

impl MotoS3 {
    /// Runs `code` after a prelude that makes `s3` (boto3, moto's test keys); its last line is JSON.
    fn query(&self, code: &str) -> Value {
        python(&format!(
            "import boto3, json\ns3 = boto3.client('s3', endpoint_url={:?}, region_name='us-east-1', aws_access_key_id='testing', aws_secret_access_key='testing')\n{code}",
            self.endpoint
        ))
    }

    /// An object of the bucket, `None` where it is not there.
    pub fn object(&self, key: &str) -> Option<String> {
        let v = self.query(&format!(
            "try:\n    body = s3.get_object(Bucket={:?}, Key={key:?})['Body'].read().decode()\nexcept s3.exceptions.NoSuchKey:\n    body = None\nprint(json.dumps(body))",
            self.bucket
        ));
        v.as_str().map(String::from)
    }

    /// The keys under `prefix`.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        let v = self.query(&format!(
            "r = s3.list_objects_v2(Bucket={:?}, Prefix={prefix:?})\nprint(json.dumps([o['Key'] for o in r.get('Contents', [])]))",
            self.bucket
        ));
        serde_json::from_value(v).unwrap()
    }

    /// The objects under `prefix`, with when each was last written.
    pub fn written(&self, prefix: &str) -> Vec<(String, String)> {
        let v = self.query(&format!(
            "r = s3.list_objects_v2(Bucket={:?}, Prefix={prefix:?})\nprint(json.dumps([[o['Key'], o['LastModified'].isoformat()] for o in r.get('Contents', [])]))",
            self.bucket
        ));
        serde_json::from_value(v).unwrap()
    }

    /// [`MotoS3::written`] under `prefix` of the store `s3://BUCKET/root`, the keys relative to it.
    pub fn stored(&self, root: &str, prefix: &str) -> Vec<(String, String)> {
        let root = format!("{}/", root.trim_end_matches('/'));
        self.written(&format!("{root}{prefix}"))
            .into_iter()
            .map(|(k, at)| (k.strip_prefix(&root).unwrap_or(&k).to_string(), at))
            .collect()
    }

    /// What a user's AWS configuration would say, pointed at moto (plain HTTP on this machine).
    pub fn user_env(&self, cmd: &mut Command, region: &str) {
        cmd.env("AWS_ENDPOINT_URL", &self.endpoint)
            .env("AWS_ACCESS_KEY_ID", "testing")
            .env("AWS_SECRET_ACCESS_KEY", "testing")
            .env("AWS_REGION", region)
            .env("AWS_ALLOW_HTTP", "true")
            .env_remove("AWS_PROFILE");
    }
}

/// A chunked dataset in cluster mode (issue 31), run by a platform's [`Cloud::check_followed`]:
/// `submit` uploads its chunk files under its manifest; the coordinator downloads the manifest and the
/// graph's structure, never the features; each worker reads the chunks it reads from the store itself,
/// through the signed URLs the coordinator hands it (S3's presigned GETs, Azure's user delegation SAS:
/// every chunk file once over the workers, none through the coordinator), cuts its part with the
/// others and hands it back; the losses are the local run's. A second job uploads nothing and takes
/// the stored partition set.
///
/// `PHYSALIA_<NAME>_CHUNKED=NODES,FEATURES,DEGREE,CHUNK_ROWS,WORKERS` (`PHYSALIA_ECS_CHUNKED`,
/// `PHYSALIA_ACI_CHUNKED`) runs it at that size as a manual benchmark (issue 31's 4M job:
/// `4000000,128,20,65536,4`): no local reference run, two epochs, and each worker's bytes read printed
/// against the dataset's files.
pub fn chunked_cluster_job<C: Cloud>(cloud: &C, s: &Scenario<'_, C>) {
    let name = C::NAME;
    let var = format!("PHYSALIA_{}_CHUNKED", name.to_uppercase());
    let size = std::env::var(&var).ok().map(|v| {
        let n: Vec<usize> = v
            .split(',')
            .map(|x| {
                x.trim()
                    .parse()
                    .unwrap_or_else(|e| panic!("{var}: five numbers: {e}"))
            })
            .collect();
        assert_eq!(
            n.len(),
            5,
            "{var}: NODES,FEATURES,DEGREE,CHUNK_ROWS,WORKERS"
        );
        n
    });
    let [nodes, feat, degree, rows, workers] = match &size {
        Some(n) => [n[0], n[1], n[2], n[3], n[4]],
        None => [3000, 16, 8, 800, 2],
    };
    crate::synth_chunked_sbm(s.path(), "sbm", (nodes, feat, degree), 3, rows);
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(s.path().join("sbm/manifest.json")).unwrap())
            .unwrap();
    let chunks: usize = manifest["tensors"]
        .as_object()
        .unwrap()
        .values()
        .map(|t| t["chunks"].as_array().unwrap().len())
        .sum();
    let epochs = if size.is_some() { 2 } else { 3 };
    let job = format!(
        "name: chunked\ndataset: {{path: sbm}}\nmodel: {{kind: sage, layers: 2, hidden: 16}}\n\
         train: {{epochs: {epochs}, seed: 0}}\nworkers: {workers}\n"
    );
    let job = job.as_str();
    let file_bytes: u64 = manifest["tensors"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|t| t["chunks"].as_array().unwrap().iter())
        .map(|c| c["bytes"].as_u64().unwrap())
        .sum();
    let want = size
        .is_none()
        .then(|| crate::local_losses(s.path(), "chunked-local.yaml", job));
    s.write_cluster_job("chunked.yaml", job);
    let (stdout, stderr) = s.ok(&["submit", "chunked.yaml", "--output", "json"]);
    assert!(stderr.contains("uploading the chunked dataset"), "{stderr}");
    let id = crate::job_id(crate::last_json(&stdout)["job_url"].as_str().unwrap());
    let got = crate::losses(&cloud.record(&id, "metrics.jsonl").unwrap());
    match &want {
        Some(want) => assert_same_losses(name, &got, want, 1e-4),
        None => assert_eq!(got.len(), epochs, "every epoch once"),
    }
    let folder = format!("-sbm/{}", "manifest.json");
    let uploaded: Vec<String> = cloud
        .stored(".datasets/")
        .into_iter()
        .map(|(k, _)| k)
        .filter(|k| k.contains("-sbm/") && !k.contains("/parts/"))
        .collect();
    assert_eq!(uploaded.len(), chunks + 1, "{uploaded:?}");
    assert!(
        uploaded.iter().any(|k| k.ends_with(&folder)),
        "{uploaded:?}"
    );
    // each worker fetched the chunks it reads; together every chunk file once
    let (mut fetched, mut read_mib) = (0, 0.0);
    for rank in 0..workers {
        let log = cloud
            .record(&id, &format!("logs/worker-{rank}.log"))
            .unwrap_or_else(|| panic!("no log of worker {rank}"));
        let line = log
            .lines()
            .find(|l| l.contains(" chunks, fetched"))
            .unwrap_or_else(|| panic!("worker {rank} fetched no chunks: {log}"));
        let n: usize = line
            .split(" chunks, fetched")
            .next()
            .and_then(|h| h.rsplit('(').next())
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        // every one of them from the store directly (its signed URLs), none relayed by the coordinator
        assert!(
            line.contains(&format!(
                "chunks, fetched: {n} of {n} from the store directly)"
            )),
            "{line}"
        );
        fetched += n;
        read_mib += line
            .split(" MiB of the dataset's files")
            .next()
            .and_then(|h| h.rsplit(' ').next())
            .and_then(|x| x.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{line}"));
        eprintln!(
            "{name} cluster-mode chunked SBM, worker {rank}: {}",
            line.trim()
        );
    }
    assert_eq!(
        fetched, chunks,
        "every chunk file fetched once over the workers"
    );
    let parts_dir = uploaded[0]
        .split_once("-sbm/")
        .map(|(head, _)| format!("{head}-sbm/parts/k{workers}-seed0/"))
        .unwrap();
    eprintln!(
        "{name} cluster-mode chunked SBM: {nodes} nodes, {workers} workers, the workers read {read_mib:.1} MiB \
         of the dataset's {:.1} MiB of files ({:.2}x)",
        file_bytes as f64 / f64::from(1 << 20),
        read_mib * f64::from(1 << 20) / file_bytes as f64
    );
    // the coordinator in its task holds no graph: its peak (VmHWM) stays under a GiB whatever the size
    let summary: Value = serde_json::from_str(&cloud.record(&id, "summary.json").unwrap()).unwrap();
    let mib = |v: &Value| v.as_f64().unwrap_or(f64::NAN) / f64::from(1 << 20);
    let coordinator = mib(&summary["peak_rss_bytes"]);
    eprintln!(
        "{name} cluster-mode chunked SBM: coordinator peak {coordinator:.0} MiB, worker peaks {:?} MiB",
        summary["worker_peak_rss_bytes"]
            .as_array()
            .map(|a| a.iter().map(|b| mib(b).round()).collect::<Vec<_>>())
    );
    assert!(coordinator < 1024.0, "{summary}");
    let parts = cloud.stored(&parts_dir);
    assert_eq!(
        parts.len(),
        workers + 1,
        "the parts and the partitioning: {parts:?}"
    );
    // again: nothing uploaded, the set taken from the store
    let (_, again) = s.ok(&["submit", "chunked.yaml", "--set", "train.epochs=1"]);
    assert!(again.contains("dataset already in the store"), "{again}");
    assert_eq!(
        cloud.stored(&parts_dir),
        parts,
        "the stored set was rewritten"
    );
}
