//! The docker backend: one container per worker on a bridge network, through the Docker CLI.
//!
//! Docker has no secrets outside swarm, so a rank's files are streamed into its created (not yet started)
//! container as a tar archive (`docker cp -`), owned by the worker's user, mode 0400, under
//! [`DockerConfig::secrets_dir`]: never in an argument, the environment or the image. Workers need no
//! mount (they fetch their files over the control connection); [`DockerConfig::mounts`] exists for
//! callers that want one.
//!
//! The network: [`Backend::prepare`] creates the bridge network [`DockerConfig::network`] (labelled with
//! the job) unless it exists and answers its gateway, the address the coordinator's control endpoint
//! binds, which only the job's containers and this machine reach; [`Backend::release`] removes it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use crate::error::{BackendName, Error, Result};
use crate::spec::{ENV_RANK, ENV_SECRETS_DIR};
use crate::{Backend, LaunchId, Launched, Prepared, WorkerSpec, WorkerState, WorkerStatus};

const NAME: BackendName = "docker";
const LABEL_LAUNCH: &str = "physalia.dev/launch";
const LABEL_RANK: &str = "physalia.dev/rank";
/// The job id, for finding everything of a job whatever its launches (`docker ps --filter`).
const LABEL_JOB: &str = "physalia.job";

/// A host folder bind-mounted into every worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindMount {
    pub host: PathBuf,
    pub container: PathBuf,
    pub read_only: bool,
}

#[derive(Clone, Debug)]
pub struct DockerConfig {
    /// The bridge network the containers join ([`Backend::prepare`] creates it).
    pub network: String,
    /// `uid:gid` the workers run as; `None` takes the image's user.
    pub user: Option<(u32, u32)>,
    pub mounts: Vec<BindMount>,
    /// Where the rank's secret files appear in the container (the images create `/run/secrets`).
    pub secrets_dir: String,
    /// How long a started container may take to report running.
    pub start_timeout: Duration,
    /// The `docker` executable.
    pub docker: String,
    /// The image GPU workers run (a [`WorkerSpec`] with `gpu`): the CUDA worker image
    /// (`worker-image/Dockerfile.cuda`, `physalia image build --cuda`). `None` runs the spec's image.
    pub gpu_image: Option<String>,
}

impl DockerConfig {
    pub fn new(network: impl Into<String>) -> DockerConfig {
        DockerConfig {
            network: network.into(),
            user: None,
            mounts: Vec::new(),
            secrets_dir: "/run/secrets/physalia".into(),
            start_timeout: Duration::from_secs(60),
            docker: "docker".into(),
            gpu_image: None,
        }
    }
}

pub struct DockerBackend {
    cfg: DockerConfig,
}

impl DockerBackend {
    pub fn new(cfg: DockerConfig) -> Result<DockerBackend> {
        let parent_ok = cfg
            .secrets_dir
            .rsplit_once('/')
            .is_some_and(|(parent, leaf)| parent.starts_with('/') && !leaf.is_empty());
        if !parent_ok {
            return Err(Error::Config {
                backend: NAME,
                detail: format!(
                    "secrets_dir must be an absolute path below /, got {:?}",
                    cfg.secrets_dir
                ),
            });
        }
        if cfg.network.is_empty() {
            return Err(Error::Config {
                backend: NAME,
                detail: "network is empty".into(),
            });
        }
        Ok(DockerBackend { cfg })
    }

    /// Runs `docker args`, feeding `stdin`; its stdout, or an error with its stderr.
    async fn docker(&self, args: &[String], stdin: Option<&[u8]>) -> Result<String> {
        let op = args.first().cloned().unwrap_or_default();
        let mut cmd = Command::new(&self.cfg.docker);
        cmd.args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| Error::Config {
            backend: NAME,
            detail: format!(
                "running {}: {e} (is the Docker Engine installed?)",
                self.cfg.docker
            ),
        })?;
        if let Some(bytes) = stdin {
            let mut pipe = child.stdin.take().expect("piped stdin");
            pipe.write_all(bytes).await.map_err(|e| Error::Api {
                backend: NAME,
                operation: format!("docker {op}"),
                status: None,
                detail: format!("writing its input: {e}"),
            })?;
            drop(pipe);
        }
        let out = child.wait_with_output().await.map_err(|e| Error::Api {
            backend: NAME,
            operation: format!("docker {op}"),
            status: None,
            detail: e.to_string(),
        })?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        } else {
            Err(Error::Api {
                backend: NAME,
                operation: format!("docker {op}"),
                status: None,
                detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            })
        }
    }

    /// `docker create`'s arguments for rank `rank`: no secret among them.
    pub fn create_args(&self, spec: &WorkerSpec, n: usize, rank: usize) -> Vec<String> {
        let launch = LaunchId::new(&spec.job_id, spec.segment);
        let mut env = spec.base_env(n);
        env.insert(ENV_RANK.into(), rank.to_string());
        env.insert(ENV_SECRETS_DIR.into(), self.cfg.secrets_dir.clone());
        let mut args: Vec<String> = vec![
            "create".into(),
            "--name".into(),
            container_name(&launch, rank),
            "--network".into(),
            self.cfg.network.clone(),
            "--label".into(),
            format!("{LABEL_LAUNCH}={}", launch.base_name()),
            "--label".into(),
            format!("{LABEL_RANK}={rank}"),
            "--label".into(),
            format!("{LABEL_JOB}={}", spec.job_id),
            "--cpus".into(),
            format!("{}", spec.cpu),
            "--memory".into(),
            format!("{}m", (spec.memory_gib * 1024.0).ceil() as u64),
        ];
        if let Some((uid, gid)) = self.cfg.user {
            args.extend(["--user".into(), format!("{uid}:{gid}")]);
        }
        if let Some(gpu) = &spec.gpu {
            args.extend(["--gpus".into(), gpu.count.to_string()]);
        }
        for (k, v) in &env {
            args.extend(["--env".into(), format!("{k}={v}")]);
        }
        for m in &self.cfg.mounts {
            let mut v = format!("{}:{}", m.host.display(), m.container.display());
            if m.read_only {
                v.push_str(":ro");
            }
            args.extend(["--volume".into(), v]);
        }
        let image = spec.image_for(self.cfg.gpu_image.as_deref()).to_string();
        if let Some((argv0, rest)) = spec.command.split_first() {
            args.extend(["--entrypoint".into(), argv0.clone()]);
            args.push(image);
            args.extend(rest.iter().cloned());
        } else {
            args.push(image);
        }
        args
    }

    /// Rank `rank`'s secret files as a tar stream: the folder (mode 0500) and each file (0400), owned by
    /// the worker's user.
    fn secrets_tar(&self, spec: &WorkerSpec, rank: usize) -> Vec<u8> {
        let (uid, gid) = self.cfg.user.unwrap_or((0, 0));
        let leaf = self
            .cfg
            .secrets_dir
            .rsplit_once('/')
            .map(|(_, l)| l)
            .expect("checked in new");
        let mut tar = Vec::new();
        tar_entry(&mut tar, &format!("{leaf}/"), &[], 0o500, (uid, gid), true);
        for (name, value) in &spec.secrets {
            tar_entry(
                &mut tar,
                &format!("{leaf}/{name}"),
                value.for_rank(rank).expose(),
                0o400,
                (uid, gid),
                false,
            );
        }
        tar.extend_from_slice(&[0u8; 1024]);
        tar
    }

    async fn launch_one(&self, spec: &WorkerSpec, n: usize, rank: usize) -> Result<()> {
        let launch = LaunchId::new(&spec.job_id, spec.segment);
        let name = container_name(&launch, rank);
        self.docker(&self.create_args(spec, n, rank), None)
            .await
            .map_err(|e| match e {
                Error::Api { detail, .. }
                    if detail.contains("No such image")
                        || detail.contains("pull access denied") =>
                {
                    Error::ImageMissing {
                        backend: NAME,
                        image: spec.image_for(self.cfg.gpu_image.as_deref()).to_string(),
                        rank,
                        detail,
                    }
                }
                Error::Api { detail, .. } if detail.contains("is already in use") => {
                    Error::AlreadyExists {
                        backend: NAME,
                        what: format!("container {name}"),
                    }
                }
                other => other,
            })?;
        let parent = self
            .cfg
            .secrets_dir
            .rsplit_once('/')
            .map(|(p, _)| p)
            .expect("checked in new");
        let parent = if parent.is_empty() { "/" } else { parent };
        self.docker(
            &["cp".into(), "-".into(), format!("{name}:{parent}")],
            Some(&self.secrets_tar(spec, rank)),
        )
        .await?;
        self.docker(&["start".into(), name], None).await?;
        Ok(())
    }

    /// Every container of the launch, inspected (one `docker inspect` for all).
    async fn inspect_launch(&self, launch: &LaunchId) -> Result<Vec<Value>> {
        let names = self
            .docker(
                &[
                    "ps".into(),
                    "-a".into(),
                    "--filter".into(),
                    format!("label={LABEL_LAUNCH}={}", launch.base_name()),
                    "--format".into(),
                    "{{.Names}}".into(),
                ],
                None,
            )
            .await?;
        let names: Vec<String> = names.lines().map(str::to_string).collect();
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let mut args = vec!["inspect".into()];
        args.extend(names);
        let text = self.docker(&args, None).await?;
        serde_json::from_str::<Vec<Value>>(&text).map_err(|e| Error::Api {
            backend: NAME,
            operation: "docker inspect".into(),
            status: None,
            detail: format!("unreadable answer: {e}"),
        })
    }

    fn status(&self, c: &Value) -> Option<WorkerStatus> {
        let rank: usize = c["Config"]["Labels"][LABEL_RANK].as_str()?.parse().ok()?;
        let state = &c["State"];
        let code = state["ExitCode"].as_i64().unwrap_or(-1);
        let (st, detail) = match state["Status"].as_str().unwrap_or("") {
            "created" | "restarting" => (WorkerState::Pending, None),
            "running" | "paused" => (WorkerState::Running, None),
            "exited" | "dead" => {
                let detail = if state["OOMKilled"].as_bool() == Some(true) {
                    "container was killed: out of memory".to_string()
                } else if code > 128 {
                    format!("container exited with signal {}", code - 128)
                } else {
                    format!("container exited with code {code}")
                };
                let st = if code == 0 {
                    WorkerState::Succeeded
                } else {
                    WorkerState::Failed
                };
                (st, Some(detail))
            }
            _ => (WorkerState::Unknown, None),
        };
        let ip = c["NetworkSettings"]["Networks"][&self.cfg.network]["IPAddress"]
            .as_str()
            .and_then(|s| s.parse().ok());
        Some(WorkerStatus {
            rank,
            name: c["Name"]
                .as_str()
                .unwrap_or("")
                .trim_start_matches('/')
                .to_string(),
            state: st,
            ip,
            dns_name: None,
            detail,
        })
    }

    async fn remove(&self, names: &[String]) -> Vec<String> {
        let mut leftovers = Vec::new();
        for name in names {
            if let Err(e) = self
                .docker(&["rm".into(), "-f".into(), name.clone()], None)
                .await
                && !e.to_string().contains("No such container")
            {
                leftovers.push(format!("container {name} ({e})"));
            }
        }
        leftovers
    }
}

/// `<base>-<rank>`.
pub fn container_name(launch: &LaunchId, rank: usize) -> String {
    format!("{}-{rank}", launch.base_name())
}

/// One ustar header and its data, padded to 512 bytes.
fn tar_entry(
    tar: &mut Vec<u8>,
    name: &str,
    data: &[u8],
    mode: u32,
    (uid, gid): (u32, u32),
    dir: bool,
) {
    let mut h = [0u8; 512];
    let put = |h: &mut [u8; 512], at: usize, s: &[u8]| h[at..at + s.len()].copy_from_slice(s);
    put(&mut h, 0, name.as_bytes());
    put(&mut h, 100, format!("{mode:07o}\0").as_bytes());
    put(&mut h, 108, format!("{uid:07o}\0").as_bytes());
    put(&mut h, 116, format!("{gid:07o}\0").as_bytes());
    put(&mut h, 124, format!("{:011o}\0", data.len()).as_bytes());
    put(&mut h, 136, format!("{:011o}\0", 0).as_bytes());
    h[156] = if dir { b'5' } else { b'0' };
    put(&mut h, 257, b"ustar\0");
    put(&mut h, 263, b"00");
    put(&mut h, 148, b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    put(&mut h, 148, format!("{sum:06o}\0 ").as_bytes());
    tar.extend_from_slice(&h);
    tar.extend_from_slice(data);
    tar.resize(tar.len().div_ceil(512) * 512, 0);
}

#[async_trait]
impl Backend for DockerBackend {
    fn name(&self) -> BackendName {
        NAME
    }

    async fn prepare(&self, job_id: &str) -> Result<Prepared> {
        let net = self.cfg.network.clone();
        let s = |v: &[&str]| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        if self
            .docker(&s(&["network", "inspect", &net]), None)
            .await
            .is_err()
        {
            let label = format!("{LABEL_JOB}={job_id}");
            let created = self
                .docker(
                    &s(&[
                        "network", "create", "--driver", "bridge", "--label", &label, &net,
                    ]),
                    None,
                )
                .await;
            // another coordinator of the job may have created it meanwhile
            if let Err(e) = created
                && self
                    .docker(&s(&["network", "inspect", &net]), None)
                    .await
                    .is_err()
            {
                return Err(e);
            }
        }
        let gw = self
            .docker(
                &s(&[
                    "network",
                    "inspect",
                    "-f",
                    "{{range .IPAM.Config}}{{.Gateway}}{{end}}",
                    &net,
                ]),
                None,
            )
            .await?;
        let control_ip = gw.parse().map_err(|_| Error::Config {
            backend: NAME,
            detail: format!("network {net} has no usable gateway: {gw:?}"),
        })?;
        Ok(Prepared { control_ip })
    }

    async fn release(&self, _job_id: &str) -> Result<()> {
        let net = self.cfg.network.clone();
        let args = vec!["network".to_string(), "rm".into(), net.clone()];
        match self.docker(&args, None).await {
            Ok(_) => Ok(()),
            Err(e) if e.to_string().contains("not found") => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn launch(&self, spec: &WorkerSpec, n_workers: usize) -> Result<Launched> {
        spec.validate(n_workers)?;
        let launch = LaunchId::new(&spec.job_id, spec.segment);
        if self
            .inspect_launch(&launch)
            .await?
            .iter()
            .any(|c| c["State"]["Status"].as_str() != Some("exited"))
        {
            return Err(Error::AlreadyExists {
                backend: NAME,
                what: format!("containers of {}", launch.base_name()),
            });
        }
        // containers of an earlier, failed launch of this segment
        let stale: Vec<String> = (0..n_workers).map(|r| container_name(&launch, r)).collect();
        self.remove(&stale).await;

        let mut failure = None;
        for rank in 0..n_workers {
            if let Err(e) = self.launch_one(spec, n_workers, rank).await {
                failure = Some(e.at_rank(rank));
                break;
            }
        }
        if failure.is_none() {
            let started = tokio::time::Instant::now();
            loop {
                let workers: BTreeMap<usize, WorkerStatus> = self
                    .inspect_launch(&launch)
                    .await?
                    .iter()
                    .filter_map(|c| self.status(c))
                    .map(|s| (s.rank, s))
                    .collect();
                if let Some(dead) = workers
                    .values()
                    .find(|w| matches!(w.state, WorkerState::Failed | WorkerState::Succeeded))
                {
                    let logs = self
                        .logs(&launch, dead.rank)
                        .await
                        .unwrap_or_default()
                        .lines()
                        .rev()
                        .take(5)
                        .collect::<Vec<_>>()
                        .into_iter()
                        .rev()
                        .collect::<Vec<_>>()
                        .join(" | ");
                    failure = Some(Error::WorkerFailed {
                        backend: NAME,
                        rank: dead.rank,
                        detail: format!(
                            "{} while starting: {logs}",
                            dead.detail.as_deref().unwrap_or("stopped")
                        ),
                    });
                    break;
                }
                if workers.len() == n_workers
                    && workers
                        .values()
                        .all(|w| w.state == WorkerState::Running && w.ip.is_some())
                {
                    return Ok(Launched {
                        id: launch,
                        workers: workers.into_values().collect(),
                    });
                }
                if started.elapsed() > self.cfg.start_timeout {
                    failure = Some(Error::Timeout {
                        backend: NAME,
                        what: format!("{n_workers} containers to run"),
                        waited_s: started.elapsed().as_secs(),
                    });
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let err = failure.expect("a launch that did not return failed");
        let leftovers = self.remove(&stale).await;
        Err(err.after_cleanup(leftovers))
    }

    async fn list(&self, launch: &LaunchId) -> Result<Vec<WorkerStatus>> {
        let mut out: Vec<WorkerStatus> = self
            .inspect_launch(launch)
            .await?
            .iter()
            .filter_map(|c| self.status(c))
            .collect();
        out.sort_by_key(|w| w.rank);
        Ok(out)
    }

    async fn stop(&self, launch: &LaunchId, rank: usize) -> Result<()> {
        let name = container_name(launch, rank);
        match self.docker(&["kill".into(), name], None).await {
            Ok(_) => Ok(()),
            Err(e) if e.to_string().contains("is not running") => Ok(()),
            // already removed: gone is stopped
            Err(e) if e.to_string().contains("No such container") => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn stop_all(&self, launch: &LaunchId) -> Result<()> {
        let names: Vec<String> = self
            .inspect_launch(launch)
            .await?
            .iter()
            .filter_map(|c| Some(c["Name"].as_str()?.trim_start_matches('/').to_string()))
            .collect();
        let leftovers = self.remove(&names).await;
        Error::stop_all_result(NAME, launch, leftovers)
    }

    async fn logs(&self, launch: &LaunchId, rank: usize) -> Result<String> {
        let name = container_name(launch, rank);
        let out = Command::new(&self.cfg.docker)
            .args(["logs", &name])
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| Error::Api {
                backend: NAME,
                operation: "docker logs".into(),
                status: None,
                detail: e.to_string(),
            })?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            if err.contains("No such container") {
                return Err(Error::NoSuchWorker {
                    backend: NAME,
                    launch: launch.to_string(),
                    rank,
                });
            }
            return Err(Error::Api {
                backend: NAME,
                operation: "docker logs".into(),
                status: None,
                detail: err.trim().to_string(),
            });
        }
        let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&out.stderr));
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::tests::spec;
    use crate::{GpuRequest, SecretBytes, SecretValue};

    fn backend() -> DockerBackend {
        let mut cfg = DockerConfig::new("physalia-net");
        cfg.user = Some((65532, 65532));
        cfg.mounts = vec![BindMount {
            host: "/data/cora".into(),
            container: "/data/cora".into(),
            read_only: true,
        }];
        DockerBackend::new(cfg).unwrap()
    }

    #[test]
    fn create_args_translate_the_spec_and_hold_no_secret() {
        let mut s = spec();
        s.secrets.insert(
            "key.pem".into(),
            SecretValue::PerRank(vec![SecretBytes::new("KEY0"), SecretBytes::new("KEY1")]),
        );
        s.gpu = Some(GpuRequest {
            count: 2,
            kind: None,
        });
        s.command = vec!["/usr/local/bin/physalia-worker".into(), "--flag".into()];
        let args = backend().create_args(&s, 2, 1).join(" ");
        for want in [
            "--name physalia-cora-1732000000-s0-1",
            "--network physalia-net",
            "--label physalia.dev/rank=1",
            "--label physalia.job=cora-1732000000",
            "--user 65532:65532",
            "--gpus 2",
            "--cpus 2",
            "--memory 8192m",
            "--env PHYSALIA_RANK=1",
            "--env PHYSALIA_WORLD=2",
            "--env PHYSALIA_SECRETS_DIR=/run/secrets/physalia",
            "--env PHYSALIA_COORDINATOR_ADDR=10.0.0.4:7000",
            "--env RAYON_NUM_THREADS=2",
            "--volume /data/cora:/data/cora:ro",
            "--entrypoint /usr/local/bin/physalia-worker ghcr.io/physalia/worker:0.1.0 --flag",
        ] {
            assert!(args.contains(want), "{want:?} missing from {args}");
        }
        assert!(!args.contains("KEY"), "{args}");
    }

    #[test]
    fn gpu_workers_run_the_gpu_image() {
        let mut cfg = DockerConfig::new("physalia-net");
        cfg.gpu_image = Some("physalia-worker:0123456789abcdef-cuda".into());
        let backend = DockerBackend::new(cfg).unwrap();
        let mut s = spec();
        s.command = Vec::new();
        let cpu = backend.create_args(&s, 1, 0);
        assert_eq!(cpu.last().unwrap(), "ghcr.io/physalia/worker:0.1.0");
        assert!(!cpu.contains(&"--gpus".to_string()), "{cpu:?}");
        s.gpu = Some(GpuRequest {
            count: 1,
            kind: None,
        });
        let gpu = backend.create_args(&s, 1, 0);
        assert_eq!(gpu.last().unwrap(), "physalia-worker:0123456789abcdef-cuda");
        assert!(gpu.join(" ").contains("--gpus 1"), "{gpu:?}");
        assert!(!gpu.contains(&"ghcr.io/physalia/worker:0.1.0".to_string()));
        // with a command, the image still comes right after the entrypoint
        s.command = vec!["/usr/local/bin/physalia-worker".into(), "--flag".into()];
        let gpu = backend.create_args(&s, 1, 0).join(" ");
        assert!(
            gpu.ends_with(
                "--entrypoint /usr/local/bin/physalia-worker physalia-worker:0123456789abcdef-cuda --flag"
            ),
            "{gpu}"
        );
    }

    #[test]
    fn secrets_tar_holds_the_ranks_files_for_the_workers_user() {
        let mut s = spec();
        s.secrets.insert(
            "key.pem".into(),
            SecretValue::PerRank(vec![SecretBytes::new("KEY0"), SecretBytes::new("KEY1")]),
        );
        let tar = backend().secrets_tar(&s, 1);
        assert_eq!(tar.len() % 512, 0);
        // entries: the folder, ca.pem, key.pem; each a 512-byte header (+ one data block)
        let header = |i: usize| &tar[i * 512..(i + 1) * 512];
        let name = |h: &[u8]| {
            String::from_utf8_lossy(&h[..100])
                .trim_end_matches('\0')
                .to_string()
        };
        assert_eq!(name(header(0)), "physalia/");
        assert_eq!(name(header(1)), "physalia/ca.pem");
        assert_eq!(name(header(3)), "physalia/key.pem");
        assert_eq!(&tar[4 * 512..4 * 512 + 4], b"KEY1");
        assert_eq!(&header(3)[100..107], b"0000400");
        assert_eq!(&header(3)[108..115], format!("{:07o}", 65532).as_bytes());
        assert!(!tar.windows(4).any(|w| w == b"KEY0"));
    }

    #[test]
    fn config_is_checked() {
        let mut cfg = DockerConfig::new("n");
        cfg.secrets_dir = "relative".into();
        assert!(DockerBackend::new(cfg).is_err());
    }
}
