//! The ecs backend's secret hand-over end to end: the bundle `physalia_backends::ecs` stores in Secrets
//! Manager, given to the real `physalia-worker unpack-secrets` as ECS gives it (an environment variable),
//! becomes the files the worker reads, each rank getting exactly its own.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use physalia_backends::ecs::task::{ENV_SECRET_BUNDLE, secret_bundle};
use physalia_backends::{NetworkSpec, SecretBytes, SecretValue, WorkerSpec};
use physalia_tests::physalia_bin;

fn spec() -> WorkerSpec {
    WorkerSpec {
        job_id: "cora-1".into(),
        segment: 0,
        image: "physalia-worker:local".into(),
        command: vec![],
        cpu: 1.0,
        memory_gib: 2.0,
        gpu: None,
        instance_types: Vec::new(),
        env: BTreeMap::new(),
        secrets: BTreeMap::from([
            (
                "ca.pem".into(),
                SecretValue::Same(SecretBytes::new("CA PEM\n")),
            ),
            (
                "key.pem".into(),
                SecretValue::PerRank(vec![
                    SecretBytes::new("KEY 0\n"),
                    SecretBytes::new(vec![0u8, 255, 10, 13]),
                ]),
            ),
        ]),
        network: NetworkSpec {
            coordinator_addr: "10.0.0.2:7000".into(),
            mesh_port: 7100,
        },
    }
}

#[test]
fn worker_unpacks_what_the_ecs_backend_stores() {
    let worker = physalia_bin().with_file_name("physalia-worker");
    let spec = spec();
    let tmp = tempfile::tempdir().unwrap();
    for rank in 0..2 {
        let dir = tmp.path().join(format!("rank-{rank}/secrets"));
        let out = Command::new(&worker)
            .arg("unpack-secrets")
            .env(ENV_SECRET_BUNDLE, secret_bundle(&spec, rank).unwrap())
            .env("PHYSALIA_SECRETS_DIR", &dir)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("unpacked ca.pem, key.pem"), "{stdout}");
        assert!(
            !stdout.contains("KEY"),
            "the contents are never printed: {stdout}"
        );
        for (name, value) in &spec.secrets {
            let path = dir.join(name);
            assert_eq!(
                std::fs::read(&path).unwrap(),
                value.for_rank(rank).expose(),
                "{}",
                path.display()
            );
            let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o400, "{}", path.display());
        }
    }
    // a damaged bundle: exit 1, a message naming the variable, no files
    let dir = tmp.path().join("bad");
    let out = Command::new(&worker)
        .arg("unpack-secrets")
        .env(ENV_SECRET_BUNDLE, "{\"key.pem\": 5}")
        .env("PHYSALIA_SECRETS_DIR", &dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains(ENV_SECRET_BUNDLE));
    assert!(!dir.exists());
}
