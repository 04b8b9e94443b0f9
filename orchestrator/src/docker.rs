//! The docker backend: workers as containers of the worker image on a private bridge network, driven through
//! the Docker CLI.
//!
//! * Image: `physalia image build` makes a runtime base with no registry (the worker binary's shared libraries
//!   from this machine, `/etc/passwd` with the non-root user 65532, `/tmp`, `/run`) by `docker import`, then
//!   builds `worker-image/Dockerfile` on it (`BASE` is a build argument), adding the binary. A job uses the
//!   image tagged with the worker binary's content hash and builds it when missing.
//! * Network: one bridge network per job (`physalia-<job>`), made and removed by the backend
//!   (`Backend::prepare` and `release`); the coordinator's control endpoint binds the network's gateway
//!   address, which only the job's containers and this machine reach. Each worker binds its mesh on port 7000
//!   of its own container address and advertises it.
//! * Containers: launched, listed, stopped and read through `physalia_backends::docker::DockerBackend`, the
//!   `Backend` trait every platform implements, from a `WorkerSpec` (DESIGN invariant 6); this module makes
//!   the image, and `crate::workers::BackendWorkers` gives the coordinator a blocking view
//!   of it, as of every backend.
//! * Secrets: copied into each container before it starts as a tar stream (`docker cp -`) owned by the
//!   worker's user, mode 0400, under `/run/secrets/physalia`; never in the command line, the environment or
//!   the image.
//! * Data: nothing is mounted. A worker fetches the artifacts its assignment names (its partition, the
//!   dataset, a checkpoint) over its control connection into `/tmp`, and rank 0 sends its checkpoints and
//!   the model back the same way: the containers share no disk with this machine.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use physalia_backends::docker::{DockerBackend, DockerConfig};
use physalia_backends::{Backend, SecretValue, WorkerSpec};

/// The worker's user inside the image (non-root).
pub const WORKER_UID: u32 = 65532;
/// The mesh port every worker binds in its own container.
const MESH_PORT: u16 = 7000;
const SECRETS_IN_CONTAINER: &str = "/run/secrets/physalia";

fn docker(args: &[&str]) -> Result<String> {
    let out = Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running docker (is the Docker Engine installed and running?)")?;
    if !out.status.success() {
        bail!(
            "docker {}: {}",
            args.first().copied().unwrap_or(""),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Whether a Docker Engine answers.
pub fn available() -> bool {
    Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The job file's own worker image (`backend.docker.image`), checked to be in the engine: no registry is
/// pulled from, so an image that is not there is an error naming the field, before anything is started.
pub fn named_image(image: &str) -> Result<String> {
    docker(&["image", "inspect", "--format", "{{.Id}}", image]).with_context(|| {
        format!(
            "backend.docker.image: {image} is not in the Docker Engine (build it, or leave the field out \
             for the image built from this physalia)"
        )
    })?;
    Ok(image.to_string())
}

/// The worker image for `worker` (the physalia-worker binary): `physalia-worker:<content hash>`, built when
/// missing. Returns its tag.
pub fn ensure_image(worker: &Path, quiet: bool) -> Result<String> {
    let bytes = std::fs::read(worker).with_context(|| format!("reading {}", worker.display()))?;
    let hash = blake3_like(&bytes);
    let tag = format!("physalia-worker:{hash}");
    if docker(&["image", "inspect", "--format", "{{.Id}}", &tag]).is_ok() {
        return Ok(tag);
    }
    if !quiet {
        eprintln!("building the worker image {tag}...");
    }
    build_image(worker, &tag)?;
    Ok(tag)
}

/// A short content hash (xxh3 via std's hasher is not stable across releases; FNV-1a 64 is, and is enough
/// to tell binaries apart).
fn blake3_like(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Builds the runtime base from this machine's libraries and the image from `worker-image/Dockerfile`.
pub fn build_image(worker: &Path, tag: &str) -> Result<()> {
    let stage = tempfile::tempdir().context("creating a staging folder")?;
    let root = stage.path().join("rootfs");
    for d in ["etc", "tmp", "run/secrets", "usr/local/bin"] {
        std::fs::create_dir_all(root.join(d))?;
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(root.join("tmp"), std::fs::Permissions::from_mode(0o1777))?;
    std::fs::set_permissions(
        root.join("run/secrets"),
        std::fs::Permissions::from_mode(0o1777),
    )?;
    std::fs::write(
        root.join("etc/passwd"),
        format!(
            "root:x:0:0::/root:/sbin/nologin\nphysalia:x:{WORKER_UID}:{WORKER_UID}::/tmp:/sbin/nologin\n"
        ),
    )?;
    std::fs::write(
        root.join("etc/group"),
        format!("root:x:0:\nphysalia:x:{WORKER_UID}:\n"),
    )?;
    for lib in shared_libraries(worker)? {
        let dest = root.join(lib.strip_prefix("/").unwrap_or(&lib));
        std::fs::create_dir_all(dest.parent().expect("a library has a folder"))?;
        std::fs::copy(&lib, &dest).with_context(|| format!("copying {}", lib.display()))?;
    }
    // the base: libraries and files only, as a tar with the right modes
    let tar = stage.path().join("base.tar");
    let status = Command::new("tar")
        .args(["--numeric-owner", "--owner=0", "--group=0", "-C"])
        .arg(&root)
        .args(["-cf"])
        .arg(&tar)
        .arg(".")
        .status()
        .context("running tar")?;
    if !status.success() {
        bail!("tar could not pack the runtime base");
    }
    let base = format!("physalia-runtime:{}", &tag[tag.len() - 16..]);
    docker(&[
        "import",
        "--change",
        "ENV PATH=/usr/local/bin",
        &tar.to_string_lossy(),
        &base,
    ])
    .context("importing the runtime base")?;
    // the build context: the Dockerfile and the stripped binary
    let ctx = stage.path().join("context");
    std::fs::create_dir_all(&ctx)?;
    let dockerfile = crate_dockerfile()?;
    std::fs::write(ctx.join("Dockerfile"), dockerfile)?;
    let bin = ctx.join("physalia-worker");
    let stripped = Command::new("strip")
        .arg("--strip-debug")
        .arg(worker)
        .arg("-o")
        .arg(&bin)
        .status()
        .is_ok_and(|s| s.success());
    if !stripped {
        std::fs::copy(worker, &bin)?;
    }
    let out = Command::new("docker")
        .args(["build", "--build-arg", &format!("BASE={base}"), "-t", tag])
        .arg(&ctx)
        .env("DOCKER_BUILDKIT", "0")
        .output()
        .context("running docker build")?;
    if !out.status.success() {
        bail!(
            "docker build of the worker image failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// `worker-image/Dockerfile`, embedded so an installed `physalia` can build images anywhere.
fn crate_dockerfile() -> Result<&'static str> {
    Ok(include_str!("../../worker-image/Dockerfile"))
}

/// The shared libraries `bin` loads (and the loader), from `ldd`.
fn shared_libraries(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .context("running ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut libs = Vec::new();
    for line in text.lines() {
        // "libm.so.6 => /lib/x86_64-linux-gnu/libm.so.6 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    if libs.is_empty() {
        bail!("ldd found no libraries for {}", bin.display());
    }
    Ok(libs)
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

/// The docker backend of a job: its containers on the job's own bridge network (made by
/// `Backend::prepare`), running as the image's non-root user, secrets copied in, nothing mounted.
pub fn backend(job_id: &str) -> Result<Box<dyn Backend>> {
    if !available() {
        bail!(
            "backend docker: no Docker Engine answers (`docker info` failed); start it or use `backend: local`"
        );
    }
    let mut cfg = DockerConfig::new(format!("physalia-{}", sanitize(job_id)));
    cfg.user = Some((WORKER_UID, WORKER_UID));
    cfg.secrets_dir = SECRETS_IN_CONTAINER.into();
    Ok(Box::new(DockerBackend::new(cfg)?))
}

/// The spec of a docker launch: containers of `image`, each binding the mesh on its own address.
pub fn spec(
    image: &str,
    job_id: &str,
    segment: usize,
    coordinator: SocketAddr,
    secrets: BTreeMap<String, SecretValue>,
    threads: usize,
) -> WorkerSpec {
    crate::workers::worker_spec(
        job_id,
        segment,
        image.to_string(),
        Vec::new(),
        coordinator,
        threads,
        secrets,
        MESH_PORT,
    )
}
