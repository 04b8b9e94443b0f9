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
/// Port the mesh endpoint binds on every interface (containers); unset: loopback, any port (local processes).
pub const ENV_MESH_PORT: &str = "PHYSALIA_MESH_PORT";
/// The IP peers reach this worker at (a pod's IP); unset: the local address of the route to the coordinator.
pub const ENV_ADVERTISE_IP: &str = "PHYSALIA_ADVERTISE_IP";
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
            .with_context(|| format!("{ENV_COORDINATOR} is not ip:port"))?;
        let rank: usize = var(ENV_RANK)?
            .parse()
            .with_context(|| format!("{ENV_RANK} is not a number"))?;
        let world: usize = var(ENV_WORLD)?
            .parse()
            .with_context(|| format!("{ENV_WORLD} is not a number"))?;
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
/// Trains what the coordinator assigned, in the assigned mode.
pub fn train_assigned<L: physalia_wire::Link + ?Sized>(
    link: &mut L,
    a: &crate::control::Assignment,
    on_epoch: &mut dyn FnMut(&physalia_gnn::EpochMetrics),
) -> Result<(physalia_gnn::Model, physalia_gnn::TrainSummary)> {
    use crate::control::TrainMode;
    use crate::minibatch::{ColumnShard, ShardData, column_features, column_slice};
    use physalia_graph::{Dataset, Split};
    let dataset = || -> Result<Dataset> {
        let path = a
            .dataset_path
            .as_ref()
            .context("the assignment names no dataset (needed for data and model parallelism)")?;
        Dataset::open(path).with_context(|| format!("opening {}", path.display()))
    };
    let ids = |ds: &Dataset, s: Split| ds.split(s).iter().map(|&i| i as u32).collect::<Vec<u32>>();
    let options = || a.minibatch.clone().unwrap_or_default();
    Ok(match a.mode {
        TrainMode::Partition => {
            let part = Part::load(&a.part_path)
                .with_context(|| format!("loading {}", a.part_path.display()))?;
            let resume = match &a.resume_from {
                Some(path) => {
                    let (model, opt, progress) = physalia_gnn::save::load_checkpoint(path)
                        .with_context(|| format!("resuming from {}", path.display()))?;
                    Some(crate::Resume {
                        model,
                        opt,
                        progress,
                    })
                }
                None => None,
            };
            let rank = link.rank();
            let mut save_err = None;
            let (model, summary, _) = crate::train_part_from(
                link,
                &part,
                &a.model,
                a.seed,
                &a.train,
                &a.exchange,
                a.row_normalize,
                resume,
                &mut |e| {
                    if rank == 0
                        && let Some(dir) = &a.checkpoint_dir
                    {
                        let path = crate::control::checkpoint_path(dir, e.metrics.epoch);
                        if let Err(err) =
                            physalia_gnn::save::save_checkpoint(e.model, e.opt, e.progress, &path)
                        {
                            save_err = Some(err);
                            return false;
                        }
                    }
                    on_epoch(e.metrics);
                    true
                },
            )?;
            if let Some(e) = save_err {
                return Err(e).context("writing a checkpoint");
            }
            (model, summary)
        }
        TrainMode::Data => {
            let part = Part::load(&a.part_path)
                .with_context(|| format!("loading {}", a.part_path.display()))?;
            let set = a
                .part_path
                .parent()
                .context("a part file lies in its set's folder")?;
            let (_, partitioning) =
                physalia_graph::partition::load_partitioning(&set.join("partition.safetensors"))?;
            let ds = dataset()?;
            let csr = ds.csr();
            let (replicas, replica) = crate::replica_of(&part, link.rank(), link.world())?;
            let data = ShardData::from_part(
                &part,
                &partitioning.parts,
                &ids(&ds, Split::Train),
                &a.model,
                a.row_normalize,
                replicas,
                replica,
            );
            let shard = data.shard(csr.indptr, csr.indices);
            let mut mesh = crate::MeshExchange::new(link, &part, a.exchange.clone());
            crate::minibatch::train_minibatch(
                &mut mesh,
                &shard,
                &a.model,
                a.seed,
                &a.train,
                &options(),
                on_epoch,
            )?
        }
        TrainMode::Model => {
            let ds = dataset()?;
            let d = ds.meta().feat_dim;
            let cols = column_slice(d, link.world(), link.rank());
            let x_cols = column_features(ds.features(), d, cols.clone(), a.row_normalize);
            let sets = physalia_gnn::NodeSets {
                labels: ds.labels().to_vec(),
                train: ids(&ds, Split::Train),
                val: ids(&ds, Split::Val),
                test: ids(&ds, Split::Test),
            };
            let csr = ds.csr();
            let shard = ColumnShard {
                indptr: csr.indptr,
                indices: csr.indices,
                x_cols: &x_cols,
                cols,
                sets: &sets,
            };
            crate::minibatch::train_p3(
                link,
                &shard,
                &a.model,
                a.seed,
                &a.train,
                &options(),
                on_epoch,
            )?
        }
    })
}

/// The mesh address peers should dial: the bound one, with an unspecified IP replaced by
/// [`ENV_ADVERTISE_IP`] or by the local address of the route to the coordinator.
fn advertised(bound: SocketAddr, coordinator: SocketAddr) -> Result<SocketAddr> {
    if !bound.ip().is_unspecified() {
        return Ok(bound);
    }
    let ip = match std::env::var(ENV_ADVERTISE_IP) {
        Ok(ip) => ip
            .parse()
            .with_context(|| format!("{ENV_ADVERTISE_IP}: not an IP address: {ip:?}"))?,
        Err(_) => {
            let probe = std::net::UdpSocket::bind((std::net::Ipv4Addr::UNSPECIFIED, 0))?;
            probe
                .connect(coordinator)
                .with_context(|| format!("finding the route to the coordinator {coordinator}"))?;
            probe.local_addr()?.ip()
        }
    };
    Ok(SocketAddr::new(ip, bound.port()))
}

pub fn run_from_env() -> Result<()> {
    let env = WorkerEnv::from_env()?;
    let identity = read_identity(&env.secrets)?;
    let job = job_key(&env.job_id);
    let rank = env.rank;
    let bind: std::net::SocketAddr = match std::env::var(ENV_MESH_PORT) {
        Ok(port) => {
            let port: u16 = port
                .parse()
                .with_context(|| format!("{ENV_MESH_PORT}: not a port: {port:?}"))?;
            (std::net::Ipv4Addr::UNSPECIFIED, port).into()
        }
        Err(_) => "127.0.0.1:0".parse()?,
    };
    let endpoint = QuicEndpoint::bind(rank, job, &identity, bind, QuicOptions::default())
        .context("binding the mesh endpoint")?;
    let mesh_addr = advertised(endpoint.local_addr(), env.coordinator)?;
    let mut control = ControlClient::connect(
        env.coordinator,
        &identity,
        rank,
        job,
        mesh_addr,
        Duration::from_secs(30),
    )?;
    eprintln!(
        "worker {rank}/{}: registered, mesh endpoint {} (advertised {mesh_addr})",
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
        let mut report_error = None;
        let mut on_epoch = |m: &physalia_gnn::EpochMetrics| {
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
        };
        let (model, summary) = train_assigned(&mut link, &assignment, &mut on_epoch)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_advertises_a_dialable_mesh_address() {
        let coordinator: SocketAddr = "127.0.0.1:9".parse().unwrap();
        // bound to one address: that one
        let bound: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        assert_eq!(advertised(bound, coordinator).unwrap(), bound);
        // bound to every interface: the route to the coordinator (unless PHYSALIA_ADVERTISE_IP says)
        if std::env::var(ENV_ADVERTISE_IP).is_err() {
            let any: SocketAddr = "0.0.0.0:4001".parse().unwrap();
            assert_eq!(
                advertised(any, coordinator).unwrap(),
                "127.0.0.1:4001".parse::<SocketAddr>().unwrap()
            );
        }
    }
}
