//! What the `physalia-worker` process does: read its environment, register with the coordinator, join the
//! mesh, train its partition, report every epoch, and finish.
//!
//! Environment (set by the backend; certificates and keys are files, never values on the command line):
//! [`ENV_COORDINATOR`] (address of the coordinator's control endpoint), [`ENV_RANK`], [`ENV_WORLD`],
//! [`ENV_JOB_ID`], [`ENV_SECRETS_DIR`] (a folder holding `ca.pem`, `cert.pem` and `key.pem`).
//!
//! Test hook: with [`ENV_TEST_DIE_AT_EPOCH`]` = E` and [`ENV_TEST_DIE_RANK`]` = R`, rank `R` kills itself
//! with SIGKILL right after finishing epoch `E` (before reporting it), so tests can exercise a worker
//! crashing mid-training. Nothing else reads these variables.
//!
//! The worker never outlives its job: when the coordinator says stop, or its control connection ends
//! before training is done, the process exits at once (the coordinator also kills and reaps it).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use physalia_graph::partition::Part;
use physalia_wire::{Link, QuicEndpoint, QuicOptions, TlsIdentity, job_key};

use crate::control::{ControlClient, ToCoordinator, ToWorker};

pub const ENV_COORDINATOR: &str = "PHYSALIA_COORDINATOR_ADDR";
pub const ENV_RANK: &str = "PHYSALIA_RANK";
pub const ENV_WORLD: &str = "PHYSALIA_WORLD";
pub const ENV_JOB_ID: &str = "PHYSALIA_JOB_ID";
pub const ENV_SECRETS_DIR: &str = "PHYSALIA_SECRETS_DIR";
pub const ENV_TEST_DIE_AT_EPOCH: &str = "PHYSALIA_TEST_DIE_AT_EPOCH";
pub const ENV_TEST_DIE_RANK: &str = "PHYSALIA_TEST_DIE_RANK";

/// How long a worker waits for its assignment after registering (the coordinator waits for every worker).
const ASSIGNMENT_TIMEOUT: Duration = Duration::from_secs(300);

static DONE: AtomicBool = AtomicBool::new(false);

struct WorkerEnv {
    coordinator: SocketAddr,
    rank: usize,
    world: usize,
    job_id: String,
    secrets: PathBuf,
}

fn var(name: &str) -> Result<String> {
    std::env::var(name).with_context(|| {
        format!("{name} is not set (physalia-worker is started by `physalia submit`)")
    })
}

impl WorkerEnv {
    fn from_env() -> Result<WorkerEnv> {
        let coordinator = var(ENV_COORDINATOR)?
            .parse()
            .with_context(|| format!("{ENV_COORDINATOR}"))?;
        let rank: usize = var(ENV_RANK)?
            .parse()
            .with_context(|| format!("{ENV_RANK}"))?;
        let world: usize = var(ENV_WORLD)?
            .parse()
            .with_context(|| format!("{ENV_WORLD}"))?;
        if rank >= world {
            bail!("{ENV_RANK}={rank} is not below {ENV_WORLD}={world}");
        }
        Ok(WorkerEnv {
            coordinator,
            rank,
            world,
            job_id: var(ENV_JOB_ID)?,
            secrets: var(ENV_SECRETS_DIR)?.into(),
        })
    }
}

/// Reads `ca.pem`, `cert.pem` and `key.pem` from `dir`.
pub fn read_identity(dir: &Path) -> Result<TlsIdentity> {
    let read = |f: &str| {
        let p = dir.join(f);
        std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))
    };
    Ok(TlsIdentity {
        ca_pem: read("ca.pem")?,
        cert_pem: read("cert.pem")?,
        key_pem: read("key.pem")?,
    })
}

fn test_die_at(rank: usize) -> Option<usize> {
    let epoch = std::env::var(ENV_TEST_DIE_AT_EPOCH).ok()?.parse().ok()?;
    let r: usize = std::env::var(ENV_TEST_DIE_RANK).ok()?.parse().ok()?;
    (r == rank).then_some(epoch)
}

/// Peak resident set size of this process (Linux `VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The whole life of a worker process.
pub fn run_from_env() -> Result<()> {
    let env = WorkerEnv::from_env()?;
    let identity = read_identity(&env.secrets)?;
    let job = job_key(&env.job_id);
    let rank = env.rank;
    let endpoint = QuicEndpoint::bind(
        rank,
        job,
        &identity,
        "127.0.0.1:0".parse()?,
        QuicOptions::default(),
    )
    .context("binding the mesh endpoint")?;
    let mut control = ControlClient::connect(
        env.coordinator,
        &identity,
        rank,
        job,
        endpoint.local_addr(),
        Duration::from_secs(30),
    )?;
    eprintln!(
        "worker {rank}/{}: registered, mesh endpoint {}",
        env.world,
        endpoint.local_addr()
    );
    let assignment = match control.recv_timeout(ASSIGNMENT_TIMEOUT)? {
        ToWorker::Assign(a) => a,
        ToWorker::Stop { reason } => bail!("stopped by the coordinator before training: {reason}"),
    };
    if assignment.peers.len() != env.world {
        bail!(
            "the assignment names {} peers, the world is {}",
            assignment.peers.len(),
            env.world
        );
    }
    // From here on a stop or a lost coordinator ends the process, whatever training is doing.
    if let Some(incoming) = control.take_incoming() {
        std::thread::spawn(move || {
            let why = match incoming.recv() {
                Ok(Ok(ToWorker::Stop { reason })) => {
                    format!("stopped by the coordinator: {reason}")
                }
                Ok(Ok(other)) => format!("unexpected message from the coordinator: {other:?}"),
                Ok(Err(reason)) => reason,
                Err(_) => "the control connection is gone".into(),
            };
            if DONE.load(Ordering::SeqCst) {
                std::process::exit(0);
            }
            eprintln!("worker {rank}: {why}; exiting");
            std::process::exit(3);
        });
    }
    let die_at = test_die_at(rank);
    let trained = (|| -> Result<_> {
        let mut link = endpoint
            .join(&assignment.peers)
            .context("joining the mesh")?;
        link.set_timeout(Duration::from_secs_f64(assignment.epoch_timeout_s));
        let part = Part::load(&assignment.part_path)
            .with_context(|| format!("loading {}", assignment.part_path.display()))?;
        let mut report_error = None;
        let (model, summary) = crate::train_part(
            &mut link,
            &part,
            &assignment.model,
            assignment.seed,
            &assignment.train,
            &assignment.exchange,
            assignment.row_normalize,
            &mut |m| {
                if die_at == Some(m.epoch) {
                    eprintln!(
                        "worker {rank}: test hook: killing myself after epoch {}",
                        m.epoch
                    );
                    // SAFETY: kill(2) on our own pid has no memory effects.
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                }
                if let Err(e) = control.send(&ToCoordinator::Epoch {
                    rank,
                    metrics: m.clone(),
                }) {
                    report_error.get_or_insert(e);
                }
            },
        )?;
        if let Some(e) = report_error {
            return Err(e).context("reporting an epoch");
        }
        if let Some(path) = &assignment.model_out {
            physalia_gnn::save::save_model(&model, path, &[("seed", assignment.seed.to_string())])
                .with_context(|| format!("saving the model to {}", path.display()))?;
        }
        // Dropping the link waits for the peers to receive our last frames.
        drop(link);
        Ok(summary)
    })();
    match trained {
        Ok(summary) => {
            DONE.store(true, Ordering::SeqCst);
            control.send(&ToCoordinator::Done {
                rank,
                summary,
                peak_rss_bytes: peak_rss_bytes(),
            })?;
            control.finish(Duration::from_secs(5));
            eprintln!("worker {rank}: done");
            Ok(())
        }
        Err(e) => {
            let _ = control.send(&ToCoordinator::Failed {
                rank,
                error: format!("{e:#}"),
            });
            control.finish(Duration::from_secs(2));
            Err(e)
        }
    }
}
