//! Workers on any [`Backend`]: the one launch path for every platform (DESIGN invariant 6).
//!
//! A launch (`distributed.rs`) issues the job CA, turns it into the launch's secrets ([`identities`]),
//! builds one [`WorkerSpec`] ([`worker_spec`]) and hands it to a backend: [`local_launch`] for processes
//! on this machine (`physalia_backends::local`), `docker.rs` for containers.
//! [`BackendWorkers`] is the coordinator's blocking view of that backend: exits, pids, logs, kill.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use physalia_backends::local::{LocalBackend, LocalConfig};
use physalia_backends::{
    Backend, LaunchId, NetworkSpec, SecretBytes, SecretValue, WorkerSpec, WorkerState, WorkerStatus,
};
use physalia_wire::{JobCa, worker_name};

/// The command that runs a worker process on this machine: this executable's hidden `worker` subcommand
/// (the CLI links the worker), so a build of `physalia` alone runs every local job.
pub fn local_worker_command() -> Result<Vec<String>> {
    let exe = std::env::current_exe().context("locating the physalia executable")?;
    Ok(vec![exe.display().to_string(), "worker".into()])
}

/// The worker binary the container image is built from: `physalia-worker` beside this executable.
pub fn worker_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the physalia executable")?;
    let bin = exe.with_file_name("physalia-worker");
    if !bin.is_file() {
        bail!(
            "the worker image is built from the physalia-worker binary beside {}, and it is not \
             there; build it with `cargo build -p physalia-worker` (same profile as physalia)",
            exe.display()
        );
    }
    Ok(bin)
}

/// The launch's secret files from its CA: `ca.pem` (the same for every rank), and each rank's
/// `cert.pem` (naming `worker-<rank>`) and `key.pem`, for the mesh ranks `ranks` (a launch of joiners:
/// the ranks they take in the mesh they join), in the launch's order.
pub fn identities(ca: &JobCa, ranks: &[usize]) -> Result<BTreeMap<String, SecretValue>> {
    let mut certs = Vec::with_capacity(ranks.len());
    let mut keys = Vec::with_capacity(ranks.len());
    for &rank in ranks {
        let id = ca
            .identity(&worker_name(rank))
            .with_context(|| format!("issuing {}'s certificate", worker_name(rank)))?;
        certs.push(SecretBytes::new(id.cert_pem));
        keys.push(SecretBytes::new(id.key_pem));
    }
    Ok(BTreeMap::from([
        (
            "ca.pem".to_string(),
            SecretValue::Same(SecretBytes::new(ca.cert_pem())),
        ),
        ("cert.pem".to_string(), SecretValue::PerRank(certs)),
        ("key.pem".to_string(), SecretValue::PerRank(keys)),
    ]))
}

/// What every backend is asked to run for one launch of the job: `command` from `image`, `threads` cores
/// each (`RAYON_NUM_THREADS`), the coordinator at `coordinator`, the mesh on `mesh_port`.
#[allow(clippy::too_many_arguments)]
pub fn worker_spec(
    job_id: &str,
    segment: usize,
    image: String,
    command: Vec<String>,
    coordinator: SocketAddr,
    threads: usize,
    secrets: BTreeMap<String, SecretValue>,
    mesh_port: u16,
) -> WorkerSpec {
    WorkerSpec {
        job_id: job_id.to_string(),
        segment: segment as u32,
        image,
        command,
        cpu: threads as f64,
        // no limit beyond the machine's: the planner's memory estimate is not a hard bound
        memory_gib: machine_memory_gib(),
        gpu: None,
        instance_types: Vec::new(),
        env: BTreeMap::from([("RAYON_NUM_THREADS".to_string(), threads.to_string())]),
        secrets,
        network: NetworkSpec {
            coordinator_addr: coordinator.to_string(),
            mesh_port,
        },
    }
}

/// The port in the spec of local workers. The local backend sets no mesh port (processes share the
/// host's ports; each worker binds an ephemeral loopback one), but a spec always names one.
const LOCAL_MESH_PORT: u16 = 7000;

/// The local backend for launch `segment` of a job: worker processes on this machine, secrets under
/// `job_dir/secrets/`, output in `job_dir/logs/`.
pub fn local_backend(job_dir: &Path, segment: usize) -> Box<dyn Backend> {
    let mut cfg = LocalConfig::new(job_dir.join("secrets"), job_dir.join("logs"));
    if segment > 0 {
        // relaunched workers must not kill themselves again at the test hook's epoch
        cfg.env_remove
            .push(physalia_control::env::ENV_TEST_DIE_AT_EPOCH.into());
        cfg.env_remove
            .push(physalia_control::env::ENV_TEST_DIE_AT_JOIN.into());
    }
    Box::new(LocalBackend::new(cfg))
}

/// The spec of a local launch: `command` (program first) as N processes.
pub fn local_spec(
    command: &[String],
    job_id: &str,
    segment: usize,
    coordinator: SocketAddr,
    threads: usize,
    secrets: BTreeMap<String, SecretValue>,
) -> WorkerSpec {
    worker_spec(
        job_id,
        segment,
        command.first().cloned().unwrap_or_default(),
        command.to_vec(),
        coordinator,
        threads,
        secrets,
        LOCAL_MESH_PORT,
    )
}

/// Runs one call of the async [`Backend`] trait to its end, on the backends' runtime.
pub fn block_on<T>(f: impl std::future::Future<Output = T>) -> Result<T> {
    Ok(backend_runtime()?.block_on(f))
}

/// The backends' runtime, one for the life of the process. A platform client may keep tasks on the
/// runtime it was made on (kube's request buffer does: every request goes through it), so a client
/// made in one call and used in the next needs that runtime alive and driven between the calls: a
/// runtime per call left the Kubernetes client dead after its first call ("buffer's worker closed
/// unexpectedly").
fn backend_runtime() -> Result<&'static tokio::runtime::Runtime> {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("physalia-backend")
        .enable_all()
        .build()
        .context("starting the backends' runtime")?;
    // another thread may have made one meanwhile: the first stays, this one is dropped
    Ok(RT.get_or_init(|| rt))
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

/// The workers of one launch on a [`physalia_backends::Backend`]: the coordinator's blocking view of the
/// async trait (on the backends' runtime, [`block_on`]), polling `list` for exits and keeping each worker's output
/// in the job's `logs/`.
pub struct BackendWorkers {
    backend: std::sync::Arc<dyn Backend>,
    launch: LaunchId,
    /// The platform's name for each worker, from the launch (`pid 1234` for a local process).
    names: Vec<String>,
    /// Where to copy each rank's output when it ends; `None` where the backend writes it there itself.
    logs: Option<Vec<PathBuf>>,
    poll_every: Duration,
    exited: Vec<bool>,
    last_poll: Instant,
    /// The platform's answer to the last `list`, asked on the backends' runtime: the coordinator's loop
    /// (which sends each epoch's word to gated workers) never waits on the platform's API, however slowly
    /// or throttled it answers.
    listing: Option<tokio::task::JoinHandle<physalia_backends::Result<Vec<WorkerStatus>>>>,
}

impl BackendWorkers {
    /// Starts `n` workers from `spec`. `logs[rank]` is where rank's output is kept (`None`: the backend
    /// keeps it there already, as the local one does); `poll_every` is how often the platform is asked
    /// for exits.
    pub fn launch(
        backend: Box<dyn Backend>,
        spec: &WorkerSpec,
        n: usize,
        logs: Option<Vec<PathBuf>>,
        poll_every: Duration,
    ) -> Result<BackendWorkers> {
        let launched = block_on(backend.launch(spec, n))?
            .with_context(|| format!("launching {n} workers on {}", backend.name()))?;
        let mut names = vec![String::new(); n];
        for w in launched.workers {
            if let Some(slot) = names.get_mut(w.rank) {
                *slot = w.name;
            }
        }
        Ok(BackendWorkers {
            backend: backend.into(),
            launch: launched.id,
            names,
            logs,
            poll_every,
            exited: vec![false; n],
            last_poll: Instant::now(),
            listing: None,
        })
    }

    /// Process ids, where the platform names a worker by one (`pid 1234`: local processes); containers
    /// report `None`.
    pub fn pids(&self) -> Vec<Option<u32>> {
        self.names
            .iter()
            .map(|n| n.strip_prefix("pid ")?.parse().ok())
            .collect()
    }

    /// Workers that stopped, as the platform's latest answer says, since the last call: `(rank, how,
    /// by_signal)`. The platform is asked at most once per `poll_every`, in the background: a call
    /// returns at once, with what an answer that arrived meanwhile says (a throttled or slow API delays
    /// the exits it reports, not the caller).
    pub fn poll_exits(&mut self) -> Vec<(usize, String, bool)> {
        let listed = match self.listing.take() {
            Some(h) if h.is_finished() => {
                block_on(h).ok().and_then(|r| r.ok()).and_then(|r| r.ok())
            }
            Some(h) => {
                self.listing = Some(h);
                None
            }
            None => None,
        };
        if self.listing.is_none() && self.last_poll.elapsed() >= self.poll_every {
            self.last_poll = Instant::now();
            let (backend, launch) = (self.backend.clone(), self.launch.clone());
            self.listing = backend_runtime()
                .ok()
                .map(|rt| rt.spawn(async move { backend.list(&launch).await }));
        }
        // the platform did not answer (yet): ask again next time rather than declare workers lost
        let Some(listed) = listed else {
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

    /// Stops worker `rank` of the launch (a silent one being replaced: its process may still run),
    /// keeping its output; from here its exit is not reported. A worker that already stopped is left.
    pub fn stop(&mut self, rank: usize) -> Result<()> {
        if self.exited.get(rank).is_none_or(|&e| e) {
            return Ok(());
        }
        self.save_logs(rank);
        self.exited[rank] = true;
        block_on(self.backend.stop(&self.launch, rank))?
            .with_context(|| format!("stopping worker {rank} on {}", self.backend.name()))
    }

    pub fn all_exited(&self) -> bool {
        self.exited.iter().all(|&e| e)
    }

    fn save_logs(&self, rank: usize) {
        let Some(logs) = &self.logs else { return };
        if let Ok(text) = block_on(self.backend.logs(&self.launch, rank)).and_then(|r| Ok(r?))
            && let Ok(mut f) = std::fs::File::create(&logs[rank])
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
        if let Err(e) = block_on(self.backend.stop_all(&self.launch)).and_then(|r| Ok(r?)) {
            tracing::warn!("{e:#}");
        }
    }
}

impl Drop for BackendWorkers {
    /// Nothing of a launch outlives it: its stopped workers are removed too.
    fn drop(&mut self) {
        self.kill_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use physalia_backends::{Launched, WorkerStatus};

    use super::*;

    #[test]
    fn identities_give_each_rank_its_own_certificate_and_one_ca() {
        let ca = JobCa::new("job").unwrap();
        let s = identities(&ca, &[0, 1, 2]).unwrap();
        assert_eq!(
            s.keys().collect::<Vec<_>>(),
            ["ca.pem", "cert.pem", "key.pem"]
        );
        assert!(matches!(s["ca.pem"], SecretValue::Same(_)));
        let key = |r| s["key.pem"].for_rank(r).expose().to_vec();
        assert_ne!(key(0), key(2));
        assert!(s.values().all(|v| match v {
            SecretValue::PerRank(v) => v.len() == 3,
            SecretValue::Same(_) => true,
        }));
    }

    /// A platform in memory: the test sets each rank's state; calls are counted.
    #[derive(Default)]
    struct Fake {
        workers: Mutex<Vec<WorkerStatus>>,
        list_fails: Mutex<bool>,
        stopped_all: Mutex<u32>,
        /// Set: `list` answers only once the test sends on it (a throttled API); whether it was
        /// released (rather than giving up after 30 s) is kept in `released`.
        slow_list: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
        released: Mutex<Option<bool>>,
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
                    name: if rank == 0 {
                        "pid 4242".into()
                    } else {
                        format!("w{rank}")
                    },
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
            if let Some(rx) = self.0.slow_list.lock().unwrap().take() {
                let released = rx.recv_timeout(Duration::from_secs(30)).is_ok();
                *self.0.released.lock().unwrap() = Some(released);
            }
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
        worker_spec(
            "j",
            0,
            "img".into(),
            vec![],
            "127.0.0.1:1".parse().unwrap(),
            1,
            BTreeMap::new(),
            7000,
        )
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
            Some(logs.clone()),
            Duration::from_millis(500),
        )
        .unwrap();
        assert_eq!(w.pids(), [Some(4242), None, None]);
        // the platform is asked in the background: a call asks, and the call after the answer arrived
        // reports what it says
        let poll = |w: &mut BackendWorkers| {
            w.last_poll = Instant::now() - Duration::from_secs(1);
            let mut exits = w.poll_exits();
            assert!(
                w.listing.is_some(),
                "a poll past its interval asks the platform"
            );
            while w.listing.as_ref().is_some_and(|h| !h.is_finished()) {
                std::thread::sleep(Duration::from_millis(1));
            }
            exits.extend(w.poll_exits());
            assert!(w.listing.is_none(), "not asked again within the interval");
            exits
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

    #[test]
    fn a_slow_platform_does_not_hold_the_poll() {
        // the coordinator's loop polls for exits between the workers' words: an API that is slow to
        // answer (throttled) must not hold it
        let fake = Arc::new(Fake::default());
        let mut w = BackendWorkers::launch(
            Box::new(FakeBackend(fake.clone())),
            &spec(),
            2,
            None,
            Duration::from_millis(500),
        )
        .unwrap();
        fake.workers.lock().unwrap()[1].state = WorkerState::Failed;
        let (release, rx) = std::sync::mpsc::channel();
        *fake.slow_list.lock().unwrap() = Some(rx);
        w.last_poll = Instant::now() - Duration::from_secs(1);
        assert!(w.poll_exits().is_empty(), "no answer yet");
        assert!(w.poll_exits().is_empty(), "still none, and not asked twice");
        // only now does the platform answer: the polls above returned without it
        release.send(()).unwrap();
        let mut exits = Vec::new();
        while exits.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
            exits = w.poll_exits();
        }
        assert_eq!(exits, [(1, "worker stopped".to_string(), false)]);
        assert_eq!(
            *fake.released.lock().unwrap(),
            Some(true),
            "the list answered after the test released it, so no poll waited for it"
        );
    }

    /// Real processes through the local backend: pids, exits with their wording, logs left where the
    /// backend wrote them, nothing left after the launch.
    #[test]
    fn local_processes_through_the_backend() {
        let dir = tempfile::tempdir().unwrap();
        let ca = JobCa::new("job").unwrap();
        let backend = local_backend(dir.path(), 0);
        // local workers reach the coordinator on loopback
        let prepared = block_on(backend.prepare("job")).unwrap().unwrap();
        assert!(prepared.control_ip.is_loopback());
        let mut spec = local_spec(
            &["/bin/sh".to_string()],
            "job",
            0,
            "127.0.0.1:9".parse().unwrap(),
            1,
            identities(&ca, &[0, 1]).unwrap(),
        );
        spec.command.extend([
            "-c".into(),
            r#"echo "rank $PHYSALIA_RANK threads $RAYON_NUM_THREADS"; test -s "$PHYSALIA_SECRETS_DIR/key.pem" || exit 7; [ "$PHYSALIA_RANK" = 1 ] && kill -9 $$; exit 0"#.into(),
        ]);
        let mut w =
            BackendWorkers::launch(backend, &spec, 2, None, Duration::from_millis(10)).unwrap();
        let pids = w.pids();
        assert!(pids.iter().all(Option::is_some), "{pids:?}");
        let mut exits = Vec::new();
        let start = Instant::now();
        while !w.all_exited() {
            assert!(start.elapsed() < Duration::from_secs(10), "{exits:?}");
            exits.extend(w.poll_exits());
            std::thread::sleep(Duration::from_millis(10));
        }
        exits.sort();
        assert_eq!(
            exits,
            [
                (0, "exited with code 0".to_string(), false),
                (1, "exited with signal 9".to_string(), true),
            ]
        );
        for rank in 0..2 {
            let log = std::fs::read_to_string(dir.path().join(format!("logs/worker-{rank}.log")))
                .unwrap();
            assert_eq!(log, format!("rank {rank} threads 1\n"));
        }
        let secrets = dir.path().join("secrets");
        assert_eq!(std::fs::read_dir(&secrets).unwrap().count(), 1);
        drop(w);
        assert_eq!(
            std::fs::read_dir(&secrets).unwrap().count(),
            0,
            "the launch's secrets are gone"
        );
        for pid in pids.into_iter().flatten() {
            assert!(!Path::new(&format!("/proc/{pid}")).exists());
        }
    }
}
