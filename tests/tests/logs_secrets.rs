//! Logs and secrets of a real multi-worker job (`physalia submit` with local `physalia-worker` processes):
//! a warning inside a worker (the mesh refusing a connection from outside the job) reaches that worker's log
//! file and the coordinator's, and with `submit -v` the terminal while the job runs (only then); the
//! private keys of the job's TLS identities appear in no worker's command line or environment, in no file
//! of the finished job's record and in nothing the CLI printed. The launch's secrets folder (the only
//! place the keys are) is gone when the job ends.

use std::collections::BTreeSet;
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use physalia_tests::{job_dirs, metrics, read_json, write_job};
use physalia_wire::quic::{QuicEndpoint, QuicOptions};
use physalia_wire::{JobCa, worker_name};
use tempfile::TempDir;

/// Enough epochs (a few seconds) that the workers still run while the test probes them.
const JOB: &str = "\
name: secrets
dataset:
  synth:
    kind: sbm
    nodes: 4000
    classes: 4
    feat_dim: 16
    avg_degree: 10
    homophily: 0.8
    seed: 1
model:
  kind: gcn
  layers: 2
  hidden: 16
train:
  epochs: 1500
  seed: 0
workers: 2
output:
  dir: jobs
";

/// `started worker R pid P` lines of the coordinator's log: (rank, pid).
fn started(log: &str) -> Vec<(usize, u32)> {
    log.lines()
        .filter_map(|l| l.strip_prefix("started worker "))
        .filter_map(|l| {
            let (rank, rest) = l.split_once(' ')?;
            let pid = rest.strip_prefix("pid ")?.split_whitespace().next()?;
            Some((rank.parse().ok()?, pid.parse().ok()?))
        })
        .collect()
}

/// The UDP ports `pid` has sockets bound on (from its descriptors and the network namespace's tables).
fn udp_ports(pid: u32) -> Vec<u16> {
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let inodes: BTreeSet<String> = fds
        .filter_map(|e| fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let mut ports = Vec::new();
    for table in ["udp", "udp6"] {
        let Ok(text) = fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.len() > 9
                && inodes.contains(cols[9])
                && let Some(port) = cols[1].rsplit(':').next()
                && let Ok(p) = u16::from_str_radix(port, 16)
            {
                ports.push(p);
            }
        }
    }
    ports
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            files_under(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// The forms a private key could leak in: the whole PEM, its base64 body on one line, and each body line.
fn key_needles(pem: &str) -> Vec<Vec<u8>> {
    let body: Vec<&str> = pem
        .lines()
        .filter(|l| !l.starts_with("-----") && !l.trim().is_empty())
        .collect();
    let mut needles = vec![pem.trim().as_bytes().to_vec(), body.concat().into_bytes()];
    needles.extend(
        body.iter()
            .filter(|l| l.len() >= 32)
            .map(|l| l.as_bytes().to_vec()),
    );
    needles
}

fn assert_no_key(what: &str, bytes: &[u8], keys: &[(PathBuf, Vec<Vec<u8>>)]) {
    for (key, needles) in keys {
        for n in needles {
            assert!(
                !bytes.windows(n.len()).any(|w| w == n.as_slice()),
                "{what} holds bytes of the private key {}",
                key.display()
            );
        }
    }
}

/// Whether a member of another job (its own CA, rank 0 of a world of two, dialling rank 1) joins the mesh
/// endpoint at `port` on loopback. A worker's mesh refuses it and warns.
fn stranger_joins(port: u16) -> bool {
    let other = JobCa::new("not-this-job").unwrap();
    let id = other.identity(&worker_name(0)).unwrap();
    let options = QuicOptions {
        join_timeout: Duration::from_millis(600),
        ..QuicOptions::default()
    };
    let ep = QuicEndpoint::bind(
        0,
        other.job_key(),
        &id,
        "127.0.0.1:0".parse().unwrap(),
        options,
    )
    .unwrap();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    ep.join(&[addr, addr]).is_ok()
}

/// A line of the mesh's refusal warning.
fn is_refusal(line: &str) -> bool {
    line.contains("WARN")
        && line.contains("refused connection")
        && line.contains("handshake failed")
}

#[test]
fn worker_warnings_reach_its_log_and_private_keys_reach_nothing_else() {
    let t = TempDir::new().unwrap();
    write_job(t.path(), "job.yaml", JOB);
    let (out_path, err_path) = (t.path().join("stdout"), t.path().join("stderr"));
    let mut child = Command::new(physalia_tests::physalia_bin())
        .current_dir(t.path())
        .args(["submit", "job.yaml"])
        .env_remove("PHYSALIA_LOG")
        .stdin(Stdio::null())
        .stdout(fs::File::create(&out_path).unwrap())
        .stderr(fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();

    // the workers, once both have started
    let deadline = Instant::now() + Duration::from_secs(120);
    let (job_dir, workers) = loop {
        assert!(Instant::now() < deadline, "the workers did not start");
        if let Some(dir) = job_dirs(&t.path().join("jobs")).into_iter().next() {
            let log = fs::read_to_string(dir.join("logs/coordinator.log")).unwrap_or_default();
            let w = started(&log);
            if w.len() == 2 {
                break (dir, w);
            }
        }
        assert!(child.try_wait().unwrap().is_none(), "submit ended early");
        std::thread::sleep(Duration::from_millis(20));
    };

    // while they run: their secrets, command lines and environments, and a stranger at their mesh ports
    let mut keys: Vec<(PathBuf, Vec<Vec<u8>>)> = Vec::new();
    let mut secret_dirs = Vec::new();
    let mut seen = Vec::new();
    for &(rank, pid) in &workers {
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).expect("the worker runs");
        let environ = fs::read(format!("/proc/{pid}/environ")).expect("the worker runs");
        let env = String::from_utf8_lossy(&environ).into_owned();
        let dir = env
            .split('\0')
            .find_map(|kv| kv.strip_prefix("PHYSALIA_SECRETS_DIR="))
            .expect("the worker's environment names its secrets folder");
        let dir = PathBuf::from(dir);
        let mut files = Vec::new();
        files_under(&dir, &mut files);
        for f in files {
            let text = fs::read_to_string(&f).unwrap_or_default();
            if text.contains("PRIVATE KEY") {
                keys.push((f, key_needles(&text)));
            }
        }
        secret_dirs.push(dir);
        seen.push((format!("worker {rank}'s command line"), cmdline));
        seen.push((format!("worker {rank}'s environment"), environ));
        // a connection from another job's CA: the worker's mesh refuses it and warns. A worker binds its
        // mesh port a little after it starts (slowly on a loaded machine): wait for it
        let ports = loop {
            let ports = udp_ports(pid);
            if !ports.is_empty() {
                break ports;
            }
            assert!(Instant::now() < deadline, "worker {rank} bound no UDP port");
            assert!(child.try_wait().unwrap().is_none(), "submit ended early");
            std::thread::sleep(Duration::from_millis(20));
        };
        for port in ports {
            assert!(!stranger_joins(port), "a stranger joined worker {rank}");
        }
    }
    let key_files: Vec<_> = keys.iter().map(|k| &k.0).collect();
    assert!(keys.len() >= 2, "a private key per worker: {key_files:?}");
    for (what, bytes) in &seen {
        assert_no_key(what, bytes, &keys);
    }

    let status = child.wait().unwrap();
    assert!(
        status.success(),
        "{}",
        fs::read_to_string(&err_path).unwrap()
    );
    assert_eq!(
        read_json(&job_dir.join("status.json"))["state"],
        "succeeded"
    );
    assert_eq!(metrics(&job_dir).len(), 1500);

    // the secrets are gone with the workers
    for dir in &secret_dirs {
        assert!(!dir.exists(), "{} is still there", dir.display());
    }
    // every file of the record (logs included) and everything the CLI printed
    let mut files = vec![out_path, err_path];
    files_under(&job_dir, &mut files);
    assert!(files.len() > 5, "{files:?}");
    for f in &files {
        assert_no_key(&f.display().to_string(), &fs::read(f).unwrap(), &keys);
    }
    // the refusal is in a worker's log, as the mesh's warning
    let logs: String = (0..2)
        .map(|r| {
            fs::read_to_string(job_dir.join(format!("logs/worker-{r}.log"))).unwrap_or_default()
        })
        .collect();
    assert!(
        logs.lines().any(is_refusal),
        "no refusal in the workers' logs:\n{logs}"
    );
    // and in the coordinator's, naming the worker; but not on the terminal without `-v`
    let coordinator = fs::read_to_string(job_dir.join("logs/coordinator.log")).unwrap();
    assert!(
        coordinator
            .lines()
            .any(|l| l.contains(": worker ") && is_refusal(l)),
        "no refusal in the coordinator's log:\n{coordinator}"
    );
    let printed = fs::read_to_string(t.path().join("stderr")).unwrap();
    assert!(
        !printed.contains("refused connection"),
        "a worker's warning on the terminal without -v:\n{printed}"
    );
}

/// `submit -v` shows a worker's warning on the terminal while the job runs (not only once its log is
/// read): a stranger knocks at worker 1's mesh port, and the refusal comes out of `submit`'s stderr,
/// naming the worker, before the job ends. The docker backend's workers forward the same way (their
/// warnings go over the control connection, not through the log file).
#[test]
fn submit_v_shows_a_worker_warning_live() {
    let t = TempDir::new().unwrap();
    write_job(t.path(), "job.yaml", JOB);
    let err_path = t.path().join("stderr");
    let mut child = Command::new(physalia_tests::physalia_bin())
        .current_dir(t.path())
        .args(["submit", "job.yaml", "-v"])
        .env_remove("PHYSALIA_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let (job_dir, pid) = loop {
        assert!(Instant::now() < deadline, "the workers did not start");
        if let Some(dir) = job_dirs(&t.path().join("jobs")).into_iter().next() {
            let log = fs::read_to_string(dir.join("logs/coordinator.log")).unwrap_or_default();
            if let Some(&(_, pid)) = started(&log).iter().find(|w| w.0 == 1) {
                break (dir, pid);
            }
        }
        assert!(child.try_wait().unwrap().is_none(), "submit ended early");
        std::thread::sleep(Duration::from_millis(20));
    };
    let ports = loop {
        let ports = udp_ports(pid);
        if !ports.is_empty() {
            break ports;
        }
        assert!(Instant::now() < deadline, "worker 1 bound no UDP port");
        assert!(child.try_wait().unwrap().is_none(), "submit ended early");
        std::thread::sleep(Duration::from_millis(20));
    };
    for port in ports {
        assert!(!stranger_joins(port), "a stranger joined worker 1");
    }
    // the warning on the terminal while the job still runs
    let line = loop {
        let printed = fs::read_to_string(&err_path).unwrap();
        if let Some(l) = printed
            .lines()
            .find(|l| l.contains("worker 1: WARN") && is_refusal(l))
        {
            break l.to_string();
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "submit ended before it showed worker 1's warning:\n{printed}"
        );
        assert!(
            Instant::now() < deadline,
            "no warning of worker 1 within 120 s:\n{printed}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!("live: {line}");
    let status = child.wait().unwrap();
    assert!(
        status.success(),
        "{}",
        fs::read_to_string(&err_path).unwrap()
    );
    let own = fs::read_to_string(job_dir.join("logs/worker-1.log")).unwrap();
    assert!(own.lines().any(is_refusal), "not in worker 1's log:\n{own}");
    let coordinator = fs::read_to_string(job_dir.join("logs/coordinator.log")).unwrap();
    assert!(
        coordinator
            .lines()
            .any(|l| l.contains("worker 1: WARN") && is_refusal(l)),
        "not in the coordinator's log:\n{coordinator}"
    );
}
