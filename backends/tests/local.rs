//! The local backend against the real thing: processes on this machine.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use physalia_backends::local::{LocalBackend, LocalConfig, log_path};
use physalia_backends::{
    Backend, Error, LaunchId, NetworkSpec, SecretBytes, SecretValue, WorkerSpec, WorkerState,
    WorkerStatus,
};

const KEY0: &str = "RANK-0-PRIVATE-KEY-7f3a";
const KEY1: &str = "RANK-1-PRIVATE-KEY-9c1e";
const CA: &str = "SHARED-CA-PEM-41d2";

fn spec(segment: u32, script: &str) -> WorkerSpec {
    WorkerSpec {
        job_id: "sbm-1732000000".into(),
        segment,
        image: "/bin/sh".into(),
        command: vec!["/bin/sh".into(), "-c".into(), script.into()],
        cpu: 1.0,
        memory_gib: 1.0,
        gpu: None,
        instance_types: Vec::new(),
        env: BTreeMap::from([("RAYON_NUM_THREADS".into(), "3".into())]),
        secrets: BTreeMap::from([
            ("ca.pem".into(), SecretValue::Same(SecretBytes::new(CA))),
            (
                "key.pem".into(),
                SecretValue::PerRank(vec![SecretBytes::new(KEY0), SecretBytes::new(KEY1)]),
            ),
        ]),
        network: NetworkSpec {
            coordinator_addr: "127.0.0.1:7000".into(),
            mesh_port: 7100,
        },
    }
}

fn backend(root: &Path) -> LocalBackend {
    LocalBackend::new(LocalConfig::new(root.join("secrets"), root.join("logs")))
}

/// `list` until no worker runs (10 s at most).
async fn until_ended(b: &LocalBackend, id: &LaunchId) -> Vec<WorkerStatus> {
    let start = Instant::now();
    loop {
        let ws = b.list(id).await.unwrap();
        if ws.iter().all(|w| w.state != WorkerState::Running) {
            return ws;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{ws:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn pid(w: &WorkerStatus) -> u32 {
    w.name.strip_prefix("pid ").unwrap().parse().unwrap()
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[tokio::test]
async fn workers_get_the_contract_and_their_own_secrets_and_report_how_they_ended() {
    let t = tempfile::tempdir().unwrap();
    let b = backend(t.path());
    // every rank prints its environment and its files, on stdout and stderr; rank r exits with 3 r
    let script = r#"env; echo "on stderr" >&2; cat "$PHYSALIA_SECRETS_DIR/key.pem"; echo;
        ls -la "$PHYSALIA_SECRETS_DIR"; exit $((PHYSALIA_RANK * 3))"#;
    let launched = b.launch(&spec(0, script), 2).await.unwrap();
    assert_eq!(launched.id, LaunchId::new("sbm-1732000000", 0));
    assert_eq!(launched.workers.len(), 2);
    for (rank, w) in launched.workers.iter().enumerate() {
        assert_eq!(w.rank, rank);
        assert_eq!(w.state, WorkerState::Running);
        assert_eq!(w.ip, Some("127.0.0.1".parse().unwrap()));
        assert!(pid(w) > 0, "{w:?}");
    }

    let ws = until_ended(&b, &launched.id).await;
    assert_eq!(ws[0].state, WorkerState::Succeeded);
    assert_eq!(ws[0].detail.as_deref(), Some("exited with code 0"));
    assert_eq!(ws[1].state, WorkerState::Failed);
    assert_eq!(ws[1].detail.as_deref(), Some("exited with code 3"));
    assert_eq!(ws[1].name, launched.workers[1].name);

    let secrets = t.path().join("secrets/physalia-sbm-1732000000-s0");
    for rank in 0..2 {
        let log = b.logs(&launched.id, rank).await.unwrap();
        let dir = secrets.join(format!("worker-{rank}"));
        for want in [
            format!("PHYSALIA_RANK={rank}\n"),
            "PHYSALIA_WORLD=2\n".into(),
            "PHYSALIA_JOB_ID=sbm-1732000000\n".into(),
            "PHYSALIA_COORDINATOR_ADDR=127.0.0.1:7000\n".into(),
            format!("PHYSALIA_SECRETS_DIR={}\n", dir.display()),
            "RAYON_NUM_THREADS=3\n".into(),
            "on stderr\n".into(),
            [KEY0, KEY1][rank].into(),
        ] {
            assert!(
                log.contains(&want),
                "rank {rank}: {want:?} missing from\n{log}"
            );
        }
        // a rank sees its own key only; processes share the host's ports, so no fixed mesh port
        assert!(!log.contains([KEY1, KEY0][rank]), "{log}");
        assert!(!log.contains("PHYSALIA_MESH_PORT"), "{log}");
        assert!(!log.contains("PHYSALIA_ADVERTISE_IP"), "{log}");
        // the log is where the job keeps it
        assert_eq!(
            std::fs::read_to_string(t.path().join(format!("logs/worker-{rank}.log"))).unwrap(),
            log
        );
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("key.pem")), 0o400);
        assert_eq!(mode(&dir.join("ca.pem")), 0o400);
        assert_eq!(std::fs::read_to_string(dir.join("ca.pem")).unwrap(), CA);
    }
    assert_eq!(mode(&secrets), 0o700);

    b.stop_all(&launched.id).await.unwrap();
    assert!(!secrets.exists(), "stop_all leaves no secret behind");
    assert!(b.list(&launched.id).await.unwrap().is_empty());
    // the logs stay: they are the job's record
    assert!(b.logs(&launched.id, 1).await.unwrap().contains("on stderr"));
    // stopping what is gone succeeds
    b.stop_all(&launched.id).await.unwrap();
    b.stop(&launched.id, 0).await.unwrap();
}

#[tokio::test]
async fn later_segments_log_beside_the_first_and_a_launch_runs_once() {
    let t = tempfile::tempdir().unwrap();
    let b = backend(t.path());
    let s = spec(2, "echo segment two; sleep 30");
    let launched = b.launch(&s, 2).await.unwrap();
    let again = b.launch(&s, 2).await.unwrap_err();
    assert!(matches!(again, Error::AlreadyExists { .. }), "{again}");
    let start = Instant::now();
    while !b
        .logs(&launched.id, 1)
        .await
        .unwrap()
        .contains("segment two")
    {
        assert!(start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(log_path(&t.path().join("logs"), 2, 1).ends_with("logs/worker-1.seg2.log"));
    assert!(t.path().join("logs/worker-1.seg2.log").is_file());
    let err = b.logs(&launched.id, 5).await.unwrap_err();
    assert!(matches!(err, Error::NoSuchWorker { rank: 5, .. }), "{err}");
    assert!(err.to_string().contains("worker-5.seg2.log"), "{err}");
    let err = b.stop(&launched.id, 5).await.unwrap_err();
    assert!(matches!(err, Error::NoSuchWorker { rank: 5, .. }), "{err}");
    b.stop_all(&launched.id).await.unwrap();
}

#[tokio::test]
async fn a_stopped_worker_was_killed_with_its_children_and_reaped() {
    let t = tempfile::tempdir().unwrap();
    let b = backend(t.path());
    // the shell's child `sleep` is in the worker's process group and must die with it
    let launched = b
        .launch(&spec(0, "sleep 30 & echo child $!; wait"), 2)
        .await
        .unwrap();
    let child_pid = {
        let start = Instant::now();
        loop {
            let log = b.logs(&launched.id, 1).await.unwrap();
            if let Some(p) = log.lines().find_map(|l| l.strip_prefix("child ")) {
                break p.trim().parse::<u32>().unwrap();
            }
            assert!(start.elapsed() < Duration::from_secs(10), "{log}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    b.stop(&launched.id, 1).await.unwrap();
    let ws = b.list(&launched.id).await.unwrap();
    assert_eq!(ws[0].state, WorkerState::Running);
    assert_eq!(ws[1].state, WorkerState::Failed);
    assert_eq!(ws[1].detail.as_deref(), Some("exited with signal 9"));
    assert!(
        !Path::new(&format!("/proc/{}", pid(&ws[1]))).exists(),
        "reaped"
    );
    // the grandchild is reparented and reaped by init; give it a moment
    let start = Instant::now();
    while Path::new(&format!("/proc/{child_pid}/stat")).exists()
        && !std::fs::read_to_string(format!("/proc/{child_pid}/stat"))
            .unwrap_or_default()
            .contains(") Z")
    {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "sleep {child_pid} survived"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // stopping it again succeeds
    b.stop(&launched.id, 1).await.unwrap();
    let rank0 = pid(&ws[0]);
    b.stop_all(&launched.id).await.unwrap();
    assert!(
        !Path::new(&format!("/proc/{rank0}")).exists(),
        "killed and reaped"
    );
}

#[tokio::test]
async fn secrets_are_in_neither_the_command_line_nor_the_environment() {
    let t = tempfile::tempdir().unwrap();
    let b = backend(t.path());
    let launched = b.launch(&spec(0, "sleep 30"), 2).await.unwrap();
    for w in &launched.workers {
        let p = pid(w);
        let cmdline = std::fs::read(format!("/proc/{p}/cmdline")).unwrap();
        let environ = std::fs::read(format!("/proc/{p}/environ")).unwrap();
        assert!(cmdline.starts_with(b"/bin/sh\0-c\0sleep 30"), "{cmdline:?}");
        assert!(
            environ.windows(14).any(|x| x == b"PHYSALIA_RANK="),
            "the environment was read"
        );
        for secret in [KEY0, KEY1, CA] {
            for (what, bytes) in [("cmdline", &cmdline), ("environ", &environ)] {
                assert!(
                    !bytes.windows(secret.len()).any(|x| x == secret.as_bytes()),
                    "{secret} in {what} of rank {}",
                    w.rank
                );
            }
        }
    }
    b.stop_all(&launched.id).await.unwrap();
}

#[tokio::test]
async fn a_failed_launch_leaves_nothing_and_names_the_path() {
    let t = tempfile::tempdir().unwrap();
    let b = backend(t.path());
    let mut s = spec(0, "");
    s.command = vec!["/nonexistent/physalia-worker".into()];
    let err = b.launch(&s, 2).await.unwrap_err();
    assert!(matches!(err, Error::WorkerFailed { rank: 0, .. }), "{err}");
    assert!(
        err.to_string().contains("/nonexistent/physalia-worker"),
        "{err}"
    );
    assert!(
        !t.path().join("secrets/physalia-sbm-1732000000-s0").exists(),
        "secrets removed"
    );
    // the spec is checked first
    let mut s = spec(0, "true");
    s.env.insert("PHYSALIA_RANK".into(), "0".into());
    assert!(matches!(
        b.launch(&s, 2).await.unwrap_err(),
        Error::InvalidSpec(_)
    ));
    // an unwritable secrets root: the error names the folder
    let cfg = LocalConfig::new("/proc/physalia-no-such-root", t.path().join("logs"));
    let err = LocalBackend::new(cfg)
        .launch(&spec(0, "true"), 2)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("/proc/physalia-no-such-root"),
        "{err}"
    );
}

#[tokio::test]
async fn dropping_the_backend_kills_and_reaps_its_workers() {
    let t = tempfile::tempdir().unwrap();
    let b = backend(t.path());
    let launched = b.launch(&spec(0, "sleep 30"), 2).await.unwrap();
    let pids: Vec<u32> = launched.workers.iter().map(pid).collect();
    drop(b);
    for p in pids {
        assert!(
            !Path::new(&format!("/proc/{p}")).exists(),
            "pid {p} survived"
        );
    }
    assert!(!t.path().join("secrets/physalia-sbm-1732000000-s0").exists());
}

#[tokio::test]
async fn workers_inherit_this_processs_environment_less_what_is_withheld() {
    // cargo runs tests with its CARGO_* variables set
    if std::env::var("CARGO_PKG_NAME").is_err() || std::env::var("CARGO_MANIFEST_DIR").is_err() {
        eprintln!("note: not run by cargo; skipping");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let mut cfg = LocalConfig::new(t.path().join("secrets"), t.path().join("logs"));
    cfg.env_remove.push("CARGO_PKG_NAME".into());
    let b = LocalBackend::new(cfg);
    let script = r#"echo "name=${CARGO_PKG_NAME-unset} dir=${CARGO_MANIFEST_DIR-unset}""#;
    let launched = b.launch(&spec(0, script), 2).await.unwrap();
    until_ended(&b, &launched.id).await;
    let log = b.logs(&launched.id, 0).await.unwrap();
    assert_eq!(
        log,
        format!("name=unset dir={}\n", env!("CARGO_MANIFEST_DIR"))
    );
    b.stop_all(&launched.id).await.unwrap();
}
