//! The docker backend: workers as containers of the worker image on a private bridge network, driven through
//! the Docker CLI.
//!
//! * Image: `physalia image build` makes a runtime base with no registry (the worker binary's shared libraries
//!   from this machine, `/etc/passwd` with the non-root user 65532, `/tmp`, `/run`) by `docker import`, then
//!   builds `worker-image/Dockerfile` on it (`BASE` is a build argument), adding the binary. A job uses the
//!   image tagged with the worker binary's content hash and builds it when missing.
//! * Network: one bridge network per job (`physalia-<job>`); the coordinator's control endpoint binds the
//!   network's gateway address, which only the job's containers and this machine reach. Each worker binds its
//!   mesh on port 7000 of its own container address and advertises it.
//! * Containers: launched, listed, stopped and read through `physalia_backends::docker::DockerBackend`, the
//!   `Backend` trait every platform implements, from a `WorkerSpec` (DESIGN invariant 6); this module makes
//!   the image and the network, and [`BackendWorkers`] gives the coordinator a blocking view of any backend.
//! * Secrets: copied into each container before it starts as a tar stream (`docker cp -`) owned by the
//!   worker's user, mode 0400, under `/run/secrets/physalia`; never in the command line, the environment or
//!   the image.
//! * Data: the dataset's folder (read-only) and the job directory are bind-mounted at their own paths, so an
//!   assignment names the same files inside and outside.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use physalia_backends::docker::{BindMount, DockerBackend, DockerConfig};
use physalia_backends::{
    Backend, LaunchId, NetworkSpec, SecretBytes, SecretValue, WorkerSpec, WorkerState,
};

/// The worker's user inside the image (non-root).
pub const WORKER_UID: u32 = 65532;
/// The mesh port every worker binds in its own container.
const MESH_PORT: u16 = 7000;
const SECRETS_IN_CONTAINER: &str = "/run/secrets/physalia";

fn docker(args: &[&str]) -> Result<String> {
    let out = Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running docker (is the Docker Engine installed and running?)")?;
    if !out.status.success() {
        bail!(
            "docker {}: {}",
            args.first().copied().unwrap_or(""),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Whether a Docker Engine answers.
pub fn available() -> bool {
    Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The worker image for `worker` (the physalia-worker binary): `physalia-worker:<content hash>`, built when
/// missing. Returns its tag.
pub fn ensure_image(worker: &Path, quiet: bool) -> Result<String> {
    let bytes = std::fs::read(worker).with_context(|| format!("reading {}", worker.display()))?;
    let hash = blake3_like(&bytes);
    let tag = format!("physalia-worker:{hash}");
    if docker(&["image", "inspect", "--format", "{{.Id}}", &tag]).is_ok() {
        return Ok(tag);
    }
    if !quiet {
        eprintln!("building the worker image {tag}...");
    }
    build_image(worker, &tag)?;
    Ok(tag)
}

/// A short content hash (xxh3 via std's hasher is not stable across releases; FNV-1a 64 is, and is enough
/// to tell binaries apart).
fn blake3_like(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Builds the runtime base from this machine's libraries and the image from `worker-image/Dockerfile`.
pub fn build_image(worker: &Path, tag: &str) -> Result<()> {
    let stage = tempfile::tempdir().context("creating a staging folder")?;
    let root = stage.path().join("rootfs");
    for d in ["etc", "tmp", "run/secrets", "usr/local/bin"] {
        std::fs::create_dir_all(root.join(d))?;
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(root.join("tmp"), std::fs::Permissions::from_mode(0o1777))?;
    std::fs::set_permissions(
        root.join("run/secrets"),
        std::fs::Permissions::from_mode(0o1777),
    )?;
    std::fs::write(
        root.join("etc/passwd"),
        format!(
            "root:x:0:0::/root:/sbin/nologin\nphysalia:x:{WORKER_UID}:{WORKER_UID}::/tmp:/sbin/nologin\n"
        ),
    )?;
    std::fs::write(
        root.join("etc/group"),
        format!("root:x:0:\nphysalia:x:{WORKER_UID}:\n"),
    )?;
    for lib in shared_libraries(worker)? {
        let dest = root.join(lib.strip_prefix("/").unwrap_or(&lib));
        std::fs::create_dir_all(dest.parent().expect("a library has a folder"))?;
        std::fs::copy(&lib, &dest).with_context(|| format!("copying {}", lib.display()))?;
    }
    // the base: libraries and files only, as a tar with the right modes
    let tar = stage.path().join("base.tar");
    let status = Command::new("tar")
        .args(["--numeric-owner", "--owner=0", "--group=0", "-C"])
        .arg(&root)
        .args(["-cf"])
        .arg(&tar)
        .arg(".")
        .status()
        .context("running tar")?;
    if !status.success() {
        bail!("tar could not pack the runtime base");
    }
    let base = format!("physalia-runtime:{}", &tag[tag.len() - 16..]);
    docker(&[
        "import",
        "--change",
        "ENV PATH=/usr/local/bin",
        &tar.to_string_lossy(),
        &base,
    ])
    .context("importing the runtime base")?;
    // the build context: the Dockerfile and the stripped binary
    let ctx = stage.path().join("context");
    std::fs::create_dir_all(&ctx)?;
    let dockerfile = crate_dockerfile()?;
    std::fs::write(ctx.join("Dockerfile"), dockerfile)?;
    let bin = ctx.join("physalia-worker");
    let stripped = Command::new("strip")
        .arg("--strip-debug")
        .arg(worker)
        .arg("-o")
        .arg(&bin)
        .status()
        .is_ok_and(|s| s.success());
    if !stripped {
        std::fs::copy(worker, &bin)?;
    }
    let out = Command::new("docker")
        .args(["build", "--build-arg", &format!("BASE={base}"), "-t", tag])
        .arg(&ctx)
        .env("DOCKER_BUILDKIT", "0")
        .output()
        .context("running docker build")?;
    if !out.status.success() {
        bail!(
            "docker build of the worker image failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// `worker-image/Dockerfile`, embedded so an installed `physalia` can build images anywhere.
fn crate_dockerfile() -> Result<&'static str> {
    Ok(include_str!("../../worker-image/Dockerfile"))
}

/// The shared libraries `bin` loads (and the loader), from `ldd`.
fn shared_libraries(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .context("running ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut libs = Vec::new();
    for line in text.lines() {
        // "libm.so.6 => /lib/x86_64-linux-gnu/libm.so.6 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    if libs.is_empty() {
        bail!("ldd found no libraries for {}", bin.display());
    }
    Ok(libs)
}

/// The job's bridge network and the gateway address its containers reach this machine at.
pub struct Network {
    pub name: String,
    pub gateway: IpAddr,
}

impl Network {
    pub fn create(job_id: &str) -> Result<Network> {
        if !available() {
            bail!(
                "backend docker: no Docker Engine answers (`docker info` failed); start it or use `backend: local`"
            );
        }
        let name = format!("physalia-{}", sanitize(job_id));
        if docker(&["network", "inspect", &name]).is_err() {
            docker(&[
                "network",
                "create",
                "--driver",
                "bridge",
                "--label",
                "physalia.job",
                &name,
            ])
            .with_context(|| format!("creating the network {name}"))?;
        }
        let gw = docker(&[
            "network",
            "inspect",
            "-f",
            "{{range .IPAM.Config}}{{.Gateway}}{{end}}",
            &name,
        ])?;
        let gateway = gw
            .parse()
            .with_context(|| format!("network {name} has no usable gateway: {gw:?}"))?;
        Ok(Network { name, gateway })
    }

    /// Removes the job's network (after its last launch).
    pub fn remove_for(job_id: &str) {
        let _ = docker(&["network", "rm", &format!("physalia-{}", sanitize(job_id))]);
    }
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

/// The user workers run as: [`WORKER_UID`] when this process is root (it then hands the job directory's
/// writable folders to that user), else this process's own user, so bind-mounted folders stay writable.
pub fn worker_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if me == 0 { WORKER_UID } else { me }
}

/// Lets the workers' user write `dirs` (when this process is root; otherwise they are already its own).
pub fn hand_over(dirs: &[&Path], uid: u32) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(());
    }
    for d in dirs {
        std::os::unix::fs::chown(d, Some(uid), Some(uid))
            .with_context(|| format!("letting the workers write {}", d.display()))?;
    }
    Ok(())
}

/// The workers of one launch on a [`physalia_backends::Backend`]: the coordinator's blocking view of the
/// async trait (its own current-thread runtime), polling `list` for exits and keeping each worker's output
/// in the job's `logs/`.
pub struct BackendWorkers {
    rt: tokio::runtime::Runtime,
    backend: Box<dyn Backend>,
    launch: LaunchId,
    logs: Vec<PathBuf>,
    exited: Vec<bool>,
    last_poll: Instant,
}

impl BackendWorkers {
    /// Starts `n` workers from `spec`; `logs[rank]` is where rank's output is kept.
    pub fn launch(
        backend: Box<dyn Backend>,
        spec: &WorkerSpec,
        n: usize,
        logs: Vec<PathBuf>,
    ) -> Result<BackendWorkers> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the backend's runtime")?;
        let launched = rt
            .block_on(backend.launch(spec, n))
            .with_context(|| format!("launching {n} workers on {}", backend.name()))?;
        Ok(BackendWorkers {
            rt,
            backend,
            launch: launched.id,
            logs,
            exited: vec![false; n],
            last_poll: Instant::now(),
        })
    }

    /// Containers have no process id here: every rank reports `None`.
    pub fn pids(&self) -> Vec<Option<u32>> {
        vec![None; self.exited.len()]
    }

    /// Workers that stopped since the last call: `(rank, how, by_signal)`; asked at most twice a second.
    pub fn poll_exits(&mut self) -> Vec<(usize, String, bool)> {
        if self.last_poll.elapsed() < Duration::from_millis(500) {
            return Vec::new();
        }
        self.last_poll = Instant::now();
        let Ok(listed) = self.rt.block_on(self.backend.list(&self.launch)) else {
            // the platform did not answer: ask again next time rather than declare workers lost
            return Vec::new();
        };
        let mut out = Vec::new();
        for rank in 0..self.exited.len() {
            if self.exited[rank] {
                continue;
            }
            let how = match listed.iter().find(|w| w.rank == rank) {
                None => Some(("worker disappeared".to_string(), true)),
                Some(w) if matches!(w.state, WorkerState::Failed | WorkerState::Succeeded) => {
                    let how = w.detail.clone().unwrap_or_else(|| "worker stopped".into());
                    let by_signal = how.contains("signal") || how.contains("killed");
                    Some((how, by_signal))
                }
                Some(_) => None,
            };
            if let Some((how, by_signal)) = how {
                self.save_logs(rank);
                self.exited[rank] = true;
                out.push((rank, how, by_signal));
            }
        }
        out
    }

    pub fn all_exited(&self) -> bool {
        self.exited.iter().all(|&e| e)
    }

    fn save_logs(&self, rank: usize) {
        if let Ok(text) = self.rt.block_on(self.backend.logs(&self.launch, rank))
            && let Ok(mut f) = std::fs::File::create(&self.logs[rank])
        {
            let _ = f.write_all(text.as_bytes());
        }
    }

    /// Stops and removes every worker of the launch, keeping the output of those still running.
    pub fn kill_all(&mut self) {
        for rank in 0..self.exited.len() {
            if !self.exited[rank] {
                self.save_logs(rank);
                self.exited[rank] = true;
            }
        }
        if let Err(e) = self.rt.block_on(self.backend.stop_all(&self.launch)) {
            eprintln!("warning: {e:#}");
        }
    }
}

impl Drop for BackendWorkers {
    /// Nothing of a launch outlives it: its stopped containers are removed too.
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// The spec and backend of a docker launch: containers of `image` on `network`, secrets from
/// `secrets_root/<worker>/`, `mounts` at their own paths.
#[allow(clippy::too_many_arguments)]
pub fn docker_launch(
    image: &str,
    job_id: &str,
    segment: usize,
    network: &Network,
    coordinator: SocketAddr,
    world: usize,
    secrets_root: &Path,
    threads: usize,
    mounts: Vec<(PathBuf, bool)>,
    uid: u32,
) -> Result<(Box<dyn Backend>, WorkerSpec)> {
    let read = |rank: usize, file: &str| -> Result<SecretBytes> {
        let path = secrets_root
            .join(physalia_wire::worker_name(rank))
            .join(file);
        Ok(SecretBytes::new(
            std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?,
        ))
    };
    let mut secrets = BTreeMap::new();
    secrets.insert("ca.pem".to_string(), SecretValue::Same(read(0, "ca.pem")?));
    for file in ["cert.pem", "key.pem"] {
        let per_rank = (0..world)
            .map(|r| read(r, file))
            .collect::<Result<Vec<_>>>()?;
        secrets.insert(file.to_string(), SecretValue::PerRank(per_rank));
    }
    let spec = WorkerSpec {
        job_id: job_id.to_string(),
        segment: segment as u32,
        image: image.to_string(),
        command: Vec::new(),
        cpu: threads as f64,
        // no limit beyond the machine's: the planner's memory estimate is not a hard bound
        memory_gib: machine_memory_gib(),
        gpu: None,
        env: BTreeMap::from([("RAYON_NUM_THREADS".to_string(), threads.to_string())]),
        secrets,
        network: NetworkSpec {
            coordinator_addr: coordinator.to_string(),
            mesh_port: MESH_PORT,
        },
    };
    let mut cfg = DockerConfig::new(network.name.clone());
    cfg.user = Some((uid, uid));
    cfg.secrets_dir = SECRETS_IN_CONTAINER.into();
    cfg.mounts = mounts
        .into_iter()
        .map(|(path, writable)| BindMount {
            host: path.clone(),
            container: path,
            read_only: !writable,
        })
        .collect();
    Ok((Box::new(DockerBackend::new(cfg)?), spec))
}

/// This machine's memory, GiB (8 if it cannot be read).
fn machine_memory_gib() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
            let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib / (1024.0 * 1024.0))
        })
        .unwrap_or(8.0)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use physalia_backends::{Launched, WorkerStatus};

    use super::*;

    /// A platform in memory: the test sets each rank's state; calls are counted.
    #[derive(Default)]
    struct Fake {
        workers: Mutex<Vec<WorkerStatus>>,
        list_fails: Mutex<bool>,
        stopped_all: Mutex<u32>,
    }

    struct FakeBackend(Arc<Fake>);

    #[async_trait::async_trait]
    impl Backend for FakeBackend {
        fn name(&self) -> &'static str {
            "fake"
        }
        async fn launch(&self, spec: &WorkerSpec, n: usize) -> physalia_backends::Result<Launched> {
            let workers: Vec<WorkerStatus> = (0..n)
                .map(|rank| WorkerStatus {
                    rank,
                    name: format!("w{rank}"),
                    state: WorkerState::Running,
                    ip: None,
                    dns_name: None,
                    detail: None,
                })
                .collect();
            *self.0.workers.lock().unwrap() = workers.clone();
            Ok(Launched {
                id: LaunchId::new(&spec.job_id, spec.segment),
                workers,
            })
        }
        async fn list(&self, _: &LaunchId) -> physalia_backends::Result<Vec<WorkerStatus>> {
            if *self.0.list_fails.lock().unwrap() {
                return Err(physalia_backends::Error::Config {
                    backend: "fake",
                    detail: "unreachable".into(),
                });
            }
            Ok(self.0.workers.lock().unwrap().clone())
        }
        async fn stop(&self, _: &LaunchId, _: usize) -> physalia_backends::Result<()> {
            Ok(())
        }
        async fn stop_all(&self, _: &LaunchId) -> physalia_backends::Result<()> {
            *self.0.stopped_all.lock().unwrap() += 1;
            Ok(())
        }
        async fn logs(&self, _: &LaunchId, rank: usize) -> physalia_backends::Result<String> {
            Ok(format!("output of rank {rank}\n"))
        }
    }

    fn spec() -> WorkerSpec {
        WorkerSpec {
            job_id: "j".into(),
            segment: 0,
            image: "img".into(),
            command: vec![],
            cpu: 1.0,
            memory_gib: 1.0,
            gpu: None,
            env: BTreeMap::new(),
            secrets: BTreeMap::new(),
            network: NetworkSpec {
                coordinator_addr: "127.0.0.1:1".into(),
                mesh_port: 7000,
            },
        }
    }

    #[test]
    fn exits_are_reported_once_with_their_logs_and_nothing_outlives_the_launch() {
        let fake = Arc::new(Fake::default());
        let dir = tempfile::tempdir().unwrap();
        let logs: Vec<PathBuf> = (0..3)
            .map(|r| dir.path().join(format!("w{r}.log")))
            .collect();
        let mut w = BackendWorkers::launch(
            Box::new(FakeBackend(fake.clone())),
            &spec(),
            3,
            logs.clone(),
        )
        .unwrap();
        let poll = |w: &mut BackendWorkers| {
            w.last_poll = Instant::now() - Duration::from_secs(1);
            w.poll_exits()
        };
        assert!(poll(&mut w).is_empty());
        {
            let mut ws = fake.workers.lock().unwrap();
            ws[1].state = WorkerState::Failed;
            ws[1].detail = Some("container exited with signal 9".into());
            ws.remove(2); // rank 2 vanished from the platform
        }
        // the platform not answering is not a loss
        *fake.list_fails.lock().unwrap() = true;
        assert!(poll(&mut w).is_empty());
        *fake.list_fails.lock().unwrap() = false;
        let exits = poll(&mut w);
        assert_eq!(
            exits,
            [
                (1, "container exited with signal 9".to_string(), true),
                (2, "worker disappeared".to_string(), true),
            ]
        );
        assert_eq!(
            std::fs::read_to_string(&logs[1]).unwrap(),
            "output of rank 1\n"
        );
        assert!(poll(&mut w).is_empty(), "each exit once");
        assert!(!w.all_exited());
        fake.workers.lock().unwrap()[0].state = WorkerState::Succeeded;
        assert_eq!(poll(&mut w), [(0, "worker stopped".to_string(), false)]);
        assert!(w.all_exited());
        drop(w);
        assert_eq!(*fake.stopped_all.lock().unwrap(), 1, "removed on drop");
    }
}
