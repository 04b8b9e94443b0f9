//! The local backend: worker processes on this machine.
//!
//! Each rank runs the spec's command (argv[0] first; an empty command runs [`WorkerSpec::image`], which is
//! the worker executable's path here) with this process's environment, less the [`RESERVED_ENV`] variables
//! and [`LocalConfig::env_remove`], plus the spec's `env` and the worker contract's variables set as every
//! backend sets them. Its stdout and stderr go to one file, [`log_path`]: `worker-<rank>.log` for segment
//! 0, `worker-<rank>.seg<segment>.log` after.
//!
//! How the spec translates to processes sharing one host:
//! - Secrets: rank r's files are written under `<secrets_root>/<launch base name>/worker-<r>/` (folders
//!   mode 0700, files 0400), and [`ENV_SECRETS_DIR`] names that folder: only the path reaches the
//!   environment, never the bytes. Ranks run as the same user, so this keeps other users out, not other
//!   ranks (as on every platform, a rank's folder holds only its own files). Rank r's scratch
//!   ([`ENV_WORK_DIR`](crate::ENV_WORK_DIR)) is `<launch folder>/work-<r>/`. `stop_all` deletes the launch's
//!   folder, scratch included, even of workers killed before they could clean up.
//! - Mesh port: a port is per container on the other platforms; N processes cannot all bind one port of
//!   one host, so [`ENV_MESH_PORT`] is not set and each worker binds an ephemeral loopback port and
//!   registers it. Workers are reached at 127.0.0.1.
//! - `cpu`, `memory_gib`, `gpu`: not enforced. The processes share the machine (thread counts come through
//!   `env`, e.g. `RAYON_NUM_THREADS`) and see all of its devices.
//!
//! No worker outlives its launch: each is the leader of its own process group, which `stop`, `stop_all`
//! and dropping the backend SIGKILL and then reap; and each asks the kernel (`PR_SET_PDEATHSIG`) for a
//! SIGKILL when the thread that launched it exits, which covers the coordinator dying without unwinding.
//! Launch from a thread that lives as long as the workers should (the coordinator's main thread).

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;

use async_trait::async_trait;

use crate::error::{BackendName, Error, Result};
use crate::spec::{ENV_MESH_PORT, ENV_RANK, ENV_SECRETS_DIR, ENV_WORK_DIR, RESERVED_ENV};
use crate::{Backend, LaunchId, Launched, WorkerSpec, WorkerState, WorkerStatus};

const NAME: BackendName = "local";

#[derive(Clone, Debug)]
pub struct LocalConfig {
    /// Each launch's secrets go to `<secrets_root>/<launch base name>/worker-<rank>/`.
    pub secrets_root: PathBuf,
    /// Where each rank's output goes ([`log_path`]).
    pub logs_dir: PathBuf,
    /// Variables of this process's environment the workers do not inherit (the [`RESERVED_ENV`] ones
    /// they never inherit).
    pub env_remove: Vec<String>,
}

impl LocalConfig {
    pub fn new(secrets_root: impl Into<PathBuf>, logs_dir: impl Into<PathBuf>) -> LocalConfig {
        LocalConfig {
            secrets_root: secrets_root.into(),
            logs_dir: logs_dir.into(),
            env_remove: Vec::new(),
        }
    }
}

/// Rank `rank`'s output file: `worker-<rank>.log` for segment 0, `worker-<rank>.seg<segment>.log` after.
/// `rank` is the job's (the mesh's): a launch of joiners names its workers from its rank base up.
pub fn log_path(logs_dir: &Path, segment: u32, rank: usize) -> PathBuf {
    logs_dir.join(match segment {
        0 => format!("worker-{rank}.log"),
        s => format!("worker-{rank}.seg{s}.log"),
    })
}

pub struct LocalBackend {
    cfg: LocalConfig,
    launches: Mutex<HashMap<LaunchId, Running>>,
    /// Each launch's workers' ranks in the job (its joiners' `PHYSALIA_RANK_BASE` or `PHYSALIA_RANKS`),
    /// for their log files.
    rank_maps: Mutex<HashMap<LaunchId, Vec<usize>>>,
}

/// The job's rank of each of a launch's `n` workers: as the coordinator's `PHYSALIA_RANK_BASE` or
/// `PHYSALIA_RANKS` say (joiners of a resize in place, replacements), else `0..n`.
fn mesh_ranks(spec: &WorkerSpec, n: usize) -> Vec<usize> {
    (0..n)
        .map(|i| {
            physalia_control::env::mesh_rank(|k| spec.env.get(k).cloned(), i, n)
                .map_or(i, |(rank, _)| rank)
        })
        .collect()
}

/// One launch's processes, by rank, and its secrets folder.
struct Running {
    secrets: PathBuf,
    procs: Vec<Proc>,
}

struct Proc {
    child: Child,
    /// Set once the process is reaped.
    exit: Option<ExitStatus>,
}

impl Proc {
    /// Its exit status, reaping it if it ended.
    fn poll(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none()
            && let Ok(Some(status)) = self.child.try_wait()
        {
            self.exit = Some(status);
        }
        self.exit
    }

    /// SIGKILLs its process group (unless already reaped: the group id could then name someone else's) and
    /// reaps it.
    fn kill(&mut self) {
        if self.exit.is_some() {
            return;
        }
        let pgid = self.child.id() as libc::pid_t;
        // SAFETY: kill has no memory-safety preconditions; the child is not reaped yet, so its pid (the
        // group's id) is still ours.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
        let _ = self.child.kill();
        if let Ok(status) = self.child.wait() {
            self.exit = Some(status);
        }
    }
}

impl Running {
    /// Kills and reaps every process, then deletes the secrets; what could not be deleted.
    fn end(&mut self) -> Vec<String> {
        for p in &mut self.procs {
            p.kill();
        }
        remove_dir(&self.secrets)
    }
}

/// Deletes `dir` and everything in it; a description of it if that failed.
fn remove_dir(dir: &Path) -> Vec<String> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Vec::new(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => vec![format!("{} ({e})", dir.display())],
    }
}

/// `exited with code 3`, `exited with signal 9`: the wording the coordinator's errors quote.
fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => format!("exited with signal {sig}"),
        _ => "exited".into(),
    }
}

fn io_error(operation: String, e: std::io::Error) -> Error {
    Error::Api {
        backend: NAME,
        operation,
        status: None,
        detail: e.to_string(),
    }
}

impl LocalBackend {
    pub fn new(cfg: LocalConfig) -> LocalBackend {
        LocalBackend {
            cfg,
            launches: Mutex::new(HashMap::new()),
            rank_maps: Mutex::new(HashMap::new()),
        }
    }

    fn launches(&self) -> std::sync::MutexGuard<'_, HashMap<LaunchId, Running>> {
        // a panic while holding the lock leaves plain data behind; the processes in it still need killing
        self.launches
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn launch_dir(&self, launch: &LaunchId) -> Result<PathBuf> {
        std::path::absolute(self.cfg.secrets_root.join(launch.base_name()))
            .map_err(|e| io_error(format!("resolving {}", self.cfg.secrets_root.display()), e))
    }

    /// Writes rank `rank`'s secret files (0400) into `dir` (0700).
    fn write_secrets(spec: &WorkerSpec, rank: usize, dir: &Path) -> Result<()> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| io_error(format!("creating {}", dir.display()), e))?;
        for (name, value) in &spec.secrets {
            let path = dir.join(name);
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o400)
                .open(&path)
                .map_err(|e| io_error(format!("creating {}", path.display()), e))?;
            f.write_all(value.for_rank(rank).expose())
                .map_err(|e| io_error(format!("writing {}", path.display()), e))?;
        }
        Ok(())
    }

    /// Starts rank `rank` (`mesh_rank` in the job), its secrets already in `secrets`.
    fn spawn(
        &self,
        spec: &WorkerSpec,
        n: usize,
        (rank, mesh_rank): (usize, usize),
        secrets: &Path,
    ) -> Result<Child> {
        let log = log_path(&self.cfg.logs_dir, spec.segment, mesh_rank);
        let out =
            File::create(&log).map_err(|e| io_error(format!("creating {}", log.display()), e))?;
        let err = out
            .try_clone()
            .map_err(|e| io_error(format!("opening {}", log.display()), e))?;
        let (program, args) = match spec.command.split_first() {
            Some((p, rest)) => (p.as_str(), rest),
            None => (spec.image.as_str(), &[][..]),
        };
        let mut env = spec.base_env(n);
        env.remove(ENV_MESH_PORT);
        env.insert(ENV_RANK.into(), rank.to_string());
        env.insert(ENV_SECRETS_DIR.into(), secrets.display().to_string());
        // scratch beside the rank's secrets, in the launch's folder: `stop_all` deletes both, even when
        // the worker was killed before it could clean up
        if let Some(launch_dir) = secrets.parent() {
            let work = launch_dir.join(format!("work-{rank}"));
            env.insert(ENV_WORK_DIR.into(), work.display().to_string());
        }
        let mut cmd = Command::new(program);
        cmd.args(args);
        for name in RESERVED_ENV
            .iter()
            .copied()
            .chain(self.cfg.env_remove.iter().map(String::as_str))
        {
            cmd.env_remove(name);
        }
        cmd.envs(&env)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        // SAFETY: getpid (before the fork) and prctl/getppid (in the child) are async-signal-safe and touch
        // no memory of ours.
        let parent = unsafe { libc::getpid() };
        unsafe {
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                // the launching process died between the fork and the prctl: nobody would kill us
                if libc::getppid() != parent {
                    return Err(std::io::Error::other("the launching process is gone"));
                }
                Ok(())
            });
        }
        cmd.spawn().map_err(|e| Error::WorkerFailed {
            backend: NAME,
            rank,
            detail: format!("starting {program}: {e}"),
        })
    }
}

#[async_trait]
impl Backend for LocalBackend {
    fn name(&self) -> BackendName {
        NAME
    }

    async fn launch(&self, spec: &WorkerSpec, n_workers: usize) -> Result<Launched> {
        spec.validate(n_workers)?;
        let id = LaunchId::new(&spec.job_id, spec.segment);
        if self.launches().contains_key(&id) {
            return Err(Error::AlreadyExists {
                backend: NAME,
                what: format!("processes of {}", id.base_name()),
            });
        }
        fs::create_dir_all(&self.cfg.logs_dir)
            .map_err(|e| io_error(format!("creating {}", self.cfg.logs_dir.display()), e))?;
        let dir = self.launch_dir(&id)?;
        // left by an earlier coordinator of this job (a resumed job): its processes died with it
        if let Some(stale) = remove_dir(&dir).pop() {
            return Err(Error::Api {
                backend: NAME,
                operation: "removing a stale secrets folder".into(),
                status: None,
                detail: stale,
            });
        }
        let ranks = mesh_ranks(spec, n_workers);
        self.rank_maps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id.clone(), ranks.clone());
        let mut running = Running {
            secrets: dir.clone(),
            procs: Vec::with_capacity(n_workers),
        };
        for rank in 0..n_workers {
            let secrets = dir.join(format!("worker-{rank}"));
            let started = Self::write_secrets(spec, rank, &secrets)
                .and_then(|()| self.spawn(spec, n_workers, (rank, ranks[rank]), &secrets));
            match started {
                Ok(child) => running.procs.push(Proc { child, exit: None }),
                Err(e) => {
                    let leftovers = running.end();
                    return Err(e.after_cleanup(leftovers));
                }
            }
        }
        let workers = running
            .procs
            .iter()
            .enumerate()
            .map(|(rank, p)| WorkerStatus {
                rank,
                name: format!("pid {}", p.child.id()),
                state: WorkerState::Running,
                ip: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
                dns_name: None,
                detail: None,
            })
            .collect();
        self.launches().insert(id.clone(), running);
        Ok(Launched { id, workers })
    }

    async fn list(&self, launch: &LaunchId) -> Result<Vec<WorkerStatus>> {
        let mut launches = self.launches();
        let Some(running) = launches.get_mut(launch) else {
            return Ok(Vec::new());
        };
        Ok(running
            .procs
            .iter_mut()
            .enumerate()
            .map(|(rank, p)| {
                let (state, detail) = match p.poll() {
                    None => (WorkerState::Running, None),
                    Some(status) => (
                        if status.success() {
                            WorkerState::Succeeded
                        } else {
                            WorkerState::Failed
                        },
                        Some(describe(status)),
                    ),
                };
                WorkerStatus {
                    rank,
                    name: format!("pid {}", p.child.id()),
                    state,
                    ip: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
                    dns_name: None,
                    detail,
                }
            })
            .collect())
    }

    async fn stop(&self, launch: &LaunchId, rank: usize) -> Result<()> {
        let mut launches = self.launches();
        // a launch this backend does not hold is gone: its processes died with whoever started them
        let Some(running) = launches.get_mut(launch) else {
            return Ok(());
        };
        let n = running.procs.len();
        let p = running.procs.get_mut(rank).ok_or(Error::NoSuchWorker {
            backend: NAME,
            launch: format!("{launch} ({n} workers)"),
            rank,
        })?;
        p.kill();
        Ok(())
    }

    async fn stop_all(&self, launch: &LaunchId) -> Result<()> {
        let running = self.launches().remove(launch);
        let leftovers = match running {
            Some(mut r) => r.end(),
            // not ours (an earlier coordinator's): its secrets may still be on disk
            None => remove_dir(&self.launch_dir(launch)?),
        };
        Error::stop_all_result(NAME, launch, leftovers)
    }

    async fn logs(&self, launch: &LaunchId, rank: usize) -> Result<String> {
        let mesh_rank = self
            .rank_maps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(launch)
            .and_then(|ranks| ranks.get(rank).copied())
            .unwrap_or(rank);
        let path = log_path(&self.cfg.logs_dir, launch.segment, mesh_rank);
        match fs::read(&path) {
            Ok(bytes) => Ok(String::from_utf8_lossy(&bytes).into_owned()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::NoSuchWorker {
                backend: NAME,
                launch: format!("{launch} (no {})", path.display()),
                rank,
            }),
            Err(e) => Err(io_error(format!("reading {}", path.display()), e)),
        }
    }
}

impl Drop for LocalBackend {
    /// Nothing of any launch outlives the backend.
    fn drop(&mut self) {
        for running in self.launches().values_mut() {
            running.end();
        }
    }
}
