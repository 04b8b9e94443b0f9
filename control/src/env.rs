//! The worker's environment contract, written once: every backend sets these variables (and refuses a
//! [`WorkerSpec`](../../physalia_backends/struct.WorkerSpec.html) that sets one itself), and the worker
//! reads them with [`WorkerEnv::from_env`]. Secrets are never values here: [`ENV_SECRETS_DIR`] names a
//! folder of files.

use std::net::SocketAddr;
use std::path::PathBuf;

/// Address of the coordinator's control endpoint (`host:port`); the worker dials it.
pub const ENV_COORDINATOR: &str = "PHYSALIA_COORDINATOR_ADDR";
/// The worker's rank, `0..world`.
pub const ENV_RANK: &str = "PHYSALIA_RANK";
/// The number of workers in this launch.
pub const ENV_WORLD: &str = "PHYSALIA_WORLD";
/// The job's id (the coordinator's, not a platform name).
pub const ENV_JOB_ID: &str = "PHYSALIA_JOB_ID";
/// The folder holding the worker's secret files (`ca.pem`, `cert.pem`, `key.pem`).
pub const ENV_SECRETS_DIR: &str = "PHYSALIA_SECRETS_DIR";
/// The port the worker's mesh endpoint listens on (UDP, QUIC), on every interface. Unset (local
/// processes): loopback, any port.
pub const ENV_MESH_PORT: &str = "PHYSALIA_MESH_PORT";
/// The IP address peers reach this worker at, where the platform can tell it before the process starts
/// (kubernetes: the pod IP). Where it is absent the worker advertises the local address of its route to
/// the coordinator.
pub const ENV_ADVERTISE_IP: &str = "PHYSALIA_ADVERTISE_IP";
/// A folder the worker may write: fetched artifacts (its partition, the dataset, a checkpoint) and the
/// files it uploads are kept there. Unset: a folder of its own under the system's temporary directory
/// (named after the job, the rank and the process, so two jobs' workers on one machine never share one),
/// which the worker removes when it ends.
pub const ENV_WORK_DIR: &str = "PHYSALIA_WORK_DIR";

/// Ranks of this launch start here: a launch of joiners for an in-place resize (`issue 33`) starts its
/// processes as ranks `0..n` of their launch, and they are ranks `base..base + n` of the job's mesh (their
/// certificates name those ranks). Set in the worker spec's environment by the coordinator, not by the
/// backend; unset: 0.
pub const ENV_RANK_BASE: &str = "PHYSALIA_RANK_BASE";

/// The ranks of the job's mesh a launch's workers take, where they are not consecutive (the replacements
/// of workers lost together, `issue 33`): ascending, comma-separated; the launch's rank `i` is the mesh's
/// rank `ranks[i]`. Set by the coordinator like [`ENV_RANK_BASE`], instead of it.
pub const ENV_RANKS: &str = "PHYSALIA_RANKS";

/// The variable and value that tell a launch's workers their mesh ranks `ranks` (by launch rank,
/// ascending): none for `0..n`, [`ENV_RANK_BASE`] for consecutive ranks, [`ENV_RANKS`] otherwise.
pub fn rank_env(ranks: &[usize]) -> Option<(&'static str, String)> {
    let first = *ranks.first()?;
    if ranks.windows(2).all(|w| w[1] == w[0] + 1) {
        return (first > 0).then(|| (ENV_RANK_BASE, first.to_string()));
    }
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    Some((ENV_RANKS, list.join(",")))
}

/// The mesh rank of a launch's worker `rank` (of `world`) under the environment `get` reads
/// ([`ENV_RANKS`], else [`ENV_RANK_BASE`], else `rank` itself), and the mesh's size as far as the
/// launch knows (its highest rank's plus one). An error names the variable.
pub fn mesh_rank(
    get: impl Fn(&str) -> Option<String>,
    rank: usize,
    world: usize,
) -> Result<(usize, usize), String> {
    if let Some(list) = get(ENV_RANKS) {
        let ranks: Vec<usize> = list
            .split(',')
            .map(|r| r.trim().parse())
            .collect::<Result<_, _>>()
            .map_err(|_| format!("{ENV_RANKS} is not a list of ranks: {list:?}"))?;
        if ranks.len() != world || !ranks.windows(2).all(|w| w[0] < w[1]) {
            return Err(format!(
                "{ENV_RANKS}={list} is not {world} ascending ranks ({ENV_WORLD}={world})"
            ));
        }
        let last = ranks.last().copied().unwrap_or(0);
        let mine = ranks
            .get(rank)
            .copied()
            .ok_or_else(|| format!("{ENV_RANKS}={list} has no rank for launch rank {rank}"))?;
        return Ok((mine, last + 1));
    }
    let base: usize = match get(ENV_RANK_BASE) {
        Some(b) => b
            .parse()
            .map_err(|_| format!("{ENV_RANK_BASE} is not a number: {b:?}"))?,
        None => 0,
    };
    Ok((rank + base, world + base))
}

/// The variables a backend sets itself; a worker spec naming one of them is refused.
pub const RESERVED_ENV: [&str; 7] = [
    ENV_COORDINATOR,
    ENV_RANK,
    ENV_WORLD,
    ENV_JOB_ID,
    ENV_SECRETS_DIR,
    ENV_MESH_PORT,
    ENV_ADVERTISE_IP,
];

/// Test hook: with `PHYSALIA_TEST_DIE_AT_EPOCH=E` and `PHYSALIA_TEST_DIE_RANK=R` (or `R1,R2,..`), rank `R` kills itself with
/// SIGKILL right after finishing epoch `E` (before reporting it). Nothing else reads these variables.
pub const ENV_TEST_DIE_AT_EPOCH: &str = "PHYSALIA_TEST_DIE_AT_EPOCH";
pub const ENV_TEST_DIE_RANK: &str = "PHYSALIA_TEST_DIE_RANK";
/// Test hook: with `PHYSALIA_TEST_DIE_AT_JOIN=J` and `PHYSALIA_TEST_DIE_RANK=R`, rank `R` kills itself with
/// SIGKILL as it starts joining its `J`-th mesh (from 0: the first launch's; 1: after its first in-place
/// resize), leaving its peers joining a mesh it will never complete.
pub const ENV_TEST_DIE_AT_JOIN: &str = "PHYSALIA_TEST_DIE_AT_JOIN";
/// Test hook: with several ranks in `PHYSALIA_TEST_DIE_RANK` and this set to a folder on the workers'
/// machine, those ranks die together: each leaves its pid there and waits, and the last to arrive kills
/// them all at once (a loaded machine cannot spread the deaths apart).
pub const ENV_TEST_DIE_TOGETHER_DIR: &str = "PHYSALIA_TEST_DIE_TOGETHER_DIR";
/// Test hook: a worker takes this many bytes for its memory headroom instead of measuring it (a survivor
/// applies its next delta beside training only where the headroom holds it).
pub const ENV_TEST_MEMORY_HEADROOM: &str = "PHYSALIA_TEST_MEMORY_HEADROOM";
/// Test hook: `1` makes a worker asked for a GPU train on the CUDA engine's host emulation instead of
/// looking for one, so the GPU path of a whole job runs on machines without a GPU (slowly).
pub const ENV_TEST_EMULATE_GPU: &str = "PHYSALIA_TEST_EMULATE_GPU";

/// What a worker process learns from its environment.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerEnv {
    pub coordinator: SocketAddr,
    pub rank: usize,
    pub world: usize,
    pub job_id: String,
    pub secrets: PathBuf,
    pub mesh_port: Option<u16>,
    pub advertise_ip: Option<std::net::IpAddr>,
    pub work_dir: PathBuf,
    /// The work folder is the worker's own (not the platform's): it is removed at the end.
    pub work_dir_owned: bool,
}

impl WorkerEnv {
    /// Reads the contract from this process's environment.
    pub fn from_env() -> Result<WorkerEnv, String> {
        WorkerEnv::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the contract through `get` (tests pass a map); every error names the variable.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<WorkerEnv, String> {
        let var = |name: &str| {
            get(name).ok_or_else(|| {
                format!("{name} is not set (physalia-worker is started by `physalia submit`)")
            })
        };
        let coordinator = var(ENV_COORDINATOR)?
            .parse()
            .map_err(|_| format!("{ENV_COORDINATOR} is not ip:port"))?;
        let rank: usize = var(ENV_RANK)?
            .parse()
            .map_err(|_| format!("{ENV_RANK} is not a number"))?;
        let world: usize = var(ENV_WORLD)?
            .parse()
            .map_err(|_| format!("{ENV_WORLD} is not a number"))?;
        if rank >= world {
            return Err(format!(
                "{ENV_RANK}={rank} is not below {ENV_WORLD}={world}"
            ));
        }
        let (rank, world) = mesh_rank(&get, rank, world)?;
        let job_id = var(ENV_JOB_ID)?;
        let mesh_port = match get(ENV_MESH_PORT) {
            Some(p) => Some(
                p.parse()
                    .map_err(|_| format!("{ENV_MESH_PORT}: not a port: {p:?}"))?,
            ),
            None => None,
        };
        let advertise_ip = match get(ENV_ADVERTISE_IP) {
            Some(ip) => Some(
                ip.parse()
                    .map_err(|_| format!("{ENV_ADVERTISE_IP}: not an IP address: {ip:?}"))?,
            ),
            None => None,
        };
        let (work_dir, work_dir_owned) = match get(ENV_WORK_DIR) {
            Some(d) if !d.is_empty() => (PathBuf::from(d), false),
            _ => (
                std::env::temp_dir().join(format!(
                    "physalia-{}-worker-{rank}-{}",
                    sanitize(&job_id),
                    std::process::id()
                )),
                true,
            ),
        };
        Ok(WorkerEnv {
            coordinator,
            rank,
            world,
            job_id,
            secrets: var(ENV_SECRETS_DIR)?.into(),
            mesh_port,
            advertise_ip,
            work_dir,
            work_dir_owned,
        })
    }
}

/// A job id as a file name part: anything but `[A-Za-z0-9._-]` becomes `_`.
fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    const BASE: [(&str, &str); 5] = [
        (ENV_COORDINATOR, "10.0.0.1:7000"),
        (ENV_RANK, "1"),
        (ENV_WORLD, "3"),
        (ENV_JOB_ID, "cora/1"),
        (ENV_SECRETS_DIR, "/s"),
    ];

    #[test]
    fn the_contract_reads_back_what_a_backend_sets() {
        let mut pairs = BASE.to_vec();
        pairs.push((ENV_MESH_PORT, "7001"));
        pairs.push((ENV_WORK_DIR, "/work"));
        let e = WorkerEnv::from_lookup(env(&pairs)).unwrap();
        assert_eq!(e.coordinator, "10.0.0.1:7000".parse().unwrap());
        assert_eq!((e.rank, e.world, e.mesh_port), (1, 3, Some(7001)));
        assert_eq!(e.work_dir, PathBuf::from("/work"));
        assert!(!e.work_dir_owned, "the platform's folder is not removed");
        // without a work dir: a private folder under the temporary directory, named safely and per process
        let e = WorkerEnv::from_lookup(env(&BASE)).unwrap();
        let name = e
            .work_dir
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert_eq!(
            name,
            format!("physalia-cora_1-worker-1-{}", std::process::id()),
            "{e:?}"
        );
        assert!(e.work_dir.starts_with(std::env::temp_dir()) && e.work_dir_owned);
        // a joiner of an in-place resize: its launch's rank 1 of 3 is the mesh's rank 5 of 7
        let mut pairs = BASE.to_vec();
        pairs.push((ENV_RANK_BASE, "4"));
        let e = WorkerEnv::from_lookup(env(&pairs)).unwrap();
        assert_eq!((e.rank, e.world), (5, 7));
        // replacements of workers 0, 2 and 6 lost together: launch rank 1 is the mesh's rank 2
        let mut pairs = BASE.to_vec();
        pairs.push((ENV_RANKS, "0,2,6"));
        let e = WorkerEnv::from_lookup(env(&pairs)).unwrap();
        assert_eq!((e.rank, e.world), (2, 7));
        // what the coordinator sets for each shape of ranks
        assert_eq!(rank_env(&[0, 1, 2]), None);
        assert_eq!(rank_env(&[4, 5]), Some((ENV_RANK_BASE, "4".to_string())));
        assert_eq!(rank_env(&[0, 2, 6]), Some((ENV_RANKS, "0,2,6".to_string())));
    }

    #[test]
    fn every_error_names_the_variable() {
        let missing = WorkerEnv::from_lookup(env(&BASE[1..])).unwrap_err();
        assert!(missing.contains(ENV_COORDINATOR), "{missing}");
        let mut pairs = BASE.to_vec();
        pairs[1] = (ENV_RANK, "3");
        let e = WorkerEnv::from_lookup(env(&pairs)).unwrap_err();
        assert!(
            e.contains("PHYSALIA_RANK=3 is not below PHYSALIA_WORLD=3"),
            "{e}"
        );
        let mut pairs = BASE.to_vec();
        pairs.push((ENV_RANK_BASE, "two"));
        let e = WorkerEnv::from_lookup(env(&pairs)).unwrap_err();
        assert!(e.contains(ENV_RANK_BASE), "{e}");
        for bad in ["0,x,2", "0,2", "2,1,0"] {
            let mut pairs = BASE.to_vec();
            pairs.push((ENV_RANKS, bad));
            let e = WorkerEnv::from_lookup(env(&pairs)).unwrap_err();
            assert!(e.contains(ENV_RANKS), "{bad}: {e}");
        }
        let mut pairs = BASE.to_vec();
        pairs.push((ENV_MESH_PORT, "x"));
        let e = WorkerEnv::from_lookup(env(&pairs)).unwrap_err();
        assert!(e.contains(ENV_MESH_PORT), "{e}");
    }
}
