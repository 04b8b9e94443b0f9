//! `physalia image push REGISTRY` against a registry on loopback (`tests/registry/registry.py`: the OCI
//! distribution API's push and pull, digests checked): the image `image build` makes arrives under
//! `REGISTRY/physalia-worker:<tag>`, pulls back from there, and a registry that cannot be reached or a
//! malformed one is a clear error that leaves no tag behind. Skipped where no Docker Engine answers.

use std::process::Command;

use physalia_testkit::Spawn;
use physalia_tests::physalia_bin;

fn docker(args: &[&str]) -> std::process::Output {
    Command::new("docker").args(args).output().unwrap()
}

#[test]
fn image_push_puts_the_worker_image_in_a_registry_that_pulls_it_back() {
    let Some(registry) = Spawn::new("tests/registry/registry.py").docker().start() else {
        return;
    };
    let info = registry.info();
    let host = info["registry"].as_str().unwrap().to_string();

    let out = Command::new(physalia_bin())
        .args(["image", "push", &format!("{host}/team/")])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let remote = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let prefix = format!("{host}/team/physalia-worker:");
    assert!(remote.starts_with(&prefix), "{remote}");
    assert!(
        stderr.contains("@sha256:"),
        "the digest is reported: {stderr}"
    );
    let tags = Command::new("python3")
        .args([
            "-c",
            &format!("import urllib.request; print(urllib.request.urlopen('http://{host}/_fake/tags').read().decode())"),
        ])
        .output()
        .unwrap();
    let tags: Vec<String> = serde_json::from_slice(&tags.stdout).unwrap();
    assert_eq!(
        tags,
        [remote.trim_start_matches(&format!("{host}/")).to_string()]
    );
    // the registry holds the whole image: it pulls back
    assert!(docker(&["rmi", &remote]).status.success());
    let pulled = docker(&["pull", &remote]);
    assert!(
        pulled.status.success(),
        "{}",
        String::from_utf8_lossy(&pulled.stderr)
    );
    let _ = docker(&["rmi", &remote]);
    drop(registry);

    // nothing listens there: one error naming the reference and what to check, no tag left
    let out = Command::new(physalia_bin())
        .args(["image", "push", "127.0.0.1:1/team"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("pushing 127.0.0.1:1/team/physalia-worker:") && err.contains("hint:"),
        "{err}"
    );
    let tag = remote.rsplit(':').next().unwrap();
    assert!(
        !docker(&[
            "image",
            "inspect",
            &format!("127.0.0.1:1/team/physalia-worker:{tag}")
        ])
        .status
        .success(),
        "the failed push's tag was removed"
    );
    // a URL is not a registry
    let out = Command::new(physalia_bin())
        .args(["image", "push", "https://ghcr.io/team"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("without a scheme"),
        "{err}"
    );
}
