//! The local backend: worker processes on this machine.
//!
//! Each worker is the `physalia-worker` binary next to the current executable, started with its rank, the
//! job and the coordinator's address in its environment and its TLS identity as files under
//! `secrets/worker-<rank>/` (mode 0600, folder 0700; paths only, never PEM, in the environment). Its
//! stdout and stderr go to `logs/worker-<rank>.log`. A worker is killed (SIGKILL) if the coordinator
//! process dies (`PR_SET_PDEATHSIG`), and [`LocalWorkers`] kills and reaps every child still running when
//! it is dropped, so no path out of the coordinator leaves an orphan.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};
use physalia_wire::TlsIdentity;
use physalia_worker::run::{ENV_COORDINATOR, ENV_JOB_ID, ENV_RANK, ENV_SECRETS_DIR, ENV_WORLD};

/// The worker binary: `physalia-worker` beside this executable.
pub fn worker_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the physalia executable")?;
    let bin = exe.with_file_name("physalia-worker");
    if !bin.is_file() {
        bail!(
            "multi-worker jobs need the physalia-worker binary beside {}, and it is not there; \
             build it with `cargo build -p physalia-worker` (same profile as physalia)",
            exe.display()
        );
    }
    Ok(bin)
}

/// Writes `ca.pem`, `cert.pem` and `key.pem` (mode 0600) into `dir` (mode 0700).
pub fn write_identity(dir: &Path, identity: &TlsIdentity) -> Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    for (name, pem) in [
        ("ca.pem", &identity.ca_pem),
        ("cert.pem", &identity.cert_pem),
        ("key.pem", &identity.key_pem),
    ] {
        let path = dir.join(name);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        f.write_all(pem.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

pub struct WorkerLaunch<'a> {
    pub binary: &'a Path,
    pub job_id: &'a str,
    pub coordinator: SocketAddr,
    pub world: usize,
    pub secrets_root: &'a Path,
    pub logs: &'a Path,
    pub threads: usize,
    /// Launches of the same job so far (rescales, retries): later ones log to `worker-<rank>.seg<N>.log`
    /// and never inherit the test hooks that make a worker kill itself.
    pub segment: usize,
}

pub struct LocalWorkers {
    children: Vec<Option<Child>>,
}

impl LocalWorkers {
    /// Starts ranks `0..world`.
    pub fn spawn(l: &WorkerLaunch) -> Result<LocalWorkers> {
        fs::create_dir_all(l.logs).with_context(|| format!("creating {}", l.logs.display()))?;
        let mut workers = LocalWorkers {
            children: Vec::new(),
        };
        for rank in 0..l.world {
            let log_path = match l.segment {
                0 => l.logs.join(format!("worker-{rank}.log")),
                s => l.logs.join(format!("worker-{rank}.seg{s}.log")),
            };
            let log = File::create(&log_path)
                .with_context(|| format!("creating {}", log_path.display()))?;
            let mut cmd = Command::new(l.binary);
            cmd.env(ENV_COORDINATOR, l.coordinator.to_string())
                .env(ENV_RANK, rank.to_string())
                .env(ENV_WORLD, l.world.to_string())
                .env(ENV_JOB_ID, l.job_id)
                .env(
                    ENV_SECRETS_DIR,
                    l.secrets_root.join(physalia_wire::worker_name(rank)),
                )
                .env("RAYON_NUM_THREADS", l.threads.to_string())
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log);
            if l.segment > 0 {
                cmd.env_remove(physalia_worker::run::ENV_TEST_DIE_AT_EPOCH);
            }
            // SAFETY: prctl is async-signal-safe; it only asks the kernel to SIGKILL the child when this
            // thread (the coordinator's main thread, which outlives every worker) exits.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
            let child = cmd
                .spawn()
                .with_context(|| format!("starting worker {rank} ({})", l.binary.display()))?;
            workers.children.push(Some(child));
        }
        Ok(workers)
    }

    pub fn pids(&self) -> Vec<Option<u32>> {
        self.children
            .iter()
            .map(|c| c.as_ref().map(Child::id))
            .collect()
    }

    /// Workers that ended since the last call: `(rank, how, by_signal)`.
    pub fn poll_exits(&mut self) -> Vec<(usize, String, bool)> {
        let mut out = Vec::new();
        for (rank, slot) in self.children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            if let Ok(Some(status)) = child.try_wait() {
                let (how, by_signal) = describe(status);
                out.push((rank, how, by_signal));
                *slot = None;
            }
        }
        out
    }

    pub fn all_exited(&self) -> bool {
        self.children.iter().all(Option::is_none)
    }

    /// SIGKILLs and reaps every child still running.
    pub fn kill_all(&mut self) {
        for child in self.children.iter_mut().filter_map(Option::take) {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for LocalWorkers {
    fn drop(&mut self) {
        self.kill_all();
    }
}

fn describe(status: std::process::ExitStatus) -> (String, bool) {
    match (status.code(), status.signal()) {
        (Some(code), _) => (format!("exited with code {code}"), false),
        (None, Some(sig)) => (format!("exited with signal {sig}"), true),
        _ => ("exited".into(), false),
    }
}
