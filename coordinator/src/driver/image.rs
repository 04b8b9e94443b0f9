//! The worker images (the docker platform's containers are in `platform/docker.rs`): built from the
//! `physalia-worker` beside this binary, through the Docker CLI.
//!
//! * Image: `physalia image build` makes a runtime base with no registry (the worker binary's shared libraries
//!   from this machine, `/etc/passwd` with the non-root user 65532, `/tmp`, `/run`) by `docker import`, then
//!   builds `worker-image/Dockerfile` on it (`BASE` is a build argument), adding the binary. A job uses the
//!   image tagged with the worker binary's content hash and builds it when missing.
//! * GPU image: `physalia image build --cuda` makes `physalia-worker:<hash>-cuda` the same way from
//!   `worker-image/Dockerfile.cuda`, adding the CUDA libraries the worker loads (NVRTC, cuBLAS) from
//!   NVIDIA's PyPI wheels, downloaded on this machine with `pip download` into a cache
//!   ([`wheel_cache`]) and unpacked into the build context; the runtime base then also holds the host
//!   libraries those need. No CUDA base image is pulled; the driver comes from the host at run time.
//!   The backend runs it for workers whose spec asks for a GPU (`DockerConfig::gpu_image`).
//! * Network: one bridge network per job (`physalia-<job>`), made and removed by the backend
//!   (`Backend::prepare` and `release`); the coordinator's control endpoint binds the network's gateway
//!   address, which only the job's containers and this machine reach. Each worker binds its mesh on port 7000
//!   of its own container address and advertises it.
//! * Containers: launched, listed, stopped and read through `physalia_backends::docker::DockerBackend`, the
//!   `Backend` trait every platform implements, from a `WorkerSpec` (DESIGN invariant 6); this module makes
//!   the image, and `crate::driver::workers::BackendWorkers` gives the coordinator a blocking view
//!   of it, as of every backend.
//! * Secrets: copied into each container before it starts as a tar stream (`docker cp -`) owned by the
//!   worker's user, mode 0400, under `/run/secrets/physalia`; never in the command line, the environment or
//!   the image.
//! * Data: nothing is mounted. A worker fetches the artifacts its assignment names (its partition, the
//!   dataset, a checkpoint) over its control connection into `/tmp`, and rank 0 sends its checkpoints and
//!   the model back the same way: the containers share no disk with this machine.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::Observer;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// The worker's user inside the image (non-root).
pub const WORKER_UID: u32 = 65532;

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
pub fn ensure_image(worker: &Path, obs: &dyn Observer) -> Result<String> {
    ensure_image_tagged(worker, &image_tag(worker)?, obs)
}

/// [`ensure_image`] under another tag.
pub fn ensure_image_tagged(worker: &Path, tag: &str, obs: &dyn Observer) -> Result<String> {
    tag_of(tag)?;
    let tag = tag.to_string();
    if docker(&["image", "inspect", "--format", "{{.Id}}", &tag]).is_ok() {
        return Ok(tag);
    }
    obs.progress(&format!("building the worker image {tag}..."));
    build_image(worker, &tag, obs)?;
    Ok(tag)
}

/// The coordinator's image for cluster mode: the worker image for `worker` with the `physalia` CLI
/// `cli` added (`worker-image/Dockerfile.cli`), tagged `tag` or `physalia-worker:<hashes>-cli`, built
/// when missing. Returns its tag.
pub fn ensure_cli_image(
    worker: &Path,
    cli: &Path,
    tag: Option<&str>,
    obs: &dyn Observer,
) -> Result<String> {
    let tag = match tag {
        Some(t) => t.to_string(),
        None => {
            let w =
                std::fs::read(worker).with_context(|| format!("reading {}", worker.display()))?;
            let c = std::fs::read(cli).with_context(|| format!("reading {}", cli.display()))?;
            format!(
                "physalia-worker:{}-{}-cli",
                &blake3_like(&w)[..8],
                &blake3_like(&c)[..8]
            )
        }
    };
    tag_of(&tag)?;
    if docker(&["image", "inspect", "--format", "{{.Id}}", &tag]).is_ok() {
        return Ok(tag);
    }
    let base = ensure_image(worker, obs)?;
    obs.progress(&format!("building the coordinator image {tag}..."));
    let stage = tempfile::tempdir().context("creating a staging folder")?;
    let ctx = stage.path();
    let root = ctx.join("rootfs");
    for lib in shared_libraries(cli)? {
        let dest = root.join(lib.strip_prefix("/").unwrap_or(&lib));
        std::fs::create_dir_all(dest.parent().expect("a library has a folder"))?;
        std::fs::copy(&lib, &dest).with_context(|| format!("copying {}", lib.display()))?;
    }
    // HTTPS to the job store and the platform's API
    let bundle = Path::new("/etc/ssl/certs/ca-certificates.crt");
    if bundle.is_file() {
        let dest = root.join("etc/ssl/certs");
        std::fs::create_dir_all(&dest)?;
        std::fs::copy(bundle, dest.join("ca-certificates.crt"))
            .with_context(|| format!("copying {}", bundle.display()))?;
    } else {
        obs.progress(&format!(
            "warning: {} is not here: the coordinator image has no CA bundle (HTTPS fails in it)",
            bundle.display()
        ));
    }
    std::fs::write(
        ctx.join("Dockerfile"),
        include_str!("../../../worker-image/Dockerfile.cli"),
    )?;
    let bin = ctx.join("physalia");
    let stripped = Command::new("strip")
        .arg("--strip-debug")
        .arg(cli)
        .arg("-o")
        .arg(&bin)
        .status()
        .is_ok_and(|s| s.success());
    if !stripped {
        std::fs::copy(cli, &bin)?;
    }
    let out = super::step(obs, &format!("building {tag}"), || {
        Command::new("docker")
            .args([
                "build",
                "--build-arg",
                &format!("WORKER={base}"),
                "-t",
                &tag,
            ])
            .arg(ctx)
            .env("DOCKER_BUILDKIT", "0")
            .output()
    })
    .context("running docker build")?;
    if !out.status.success() {
        bail!(
            "docker build of the coordinator image failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(tag)
}

/// `physalia-worker:<content hash of worker>`.
fn image_tag(worker: &Path) -> Result<String> {
    let bytes = std::fs::read(worker).with_context(|| format!("reading {}", worker.display()))?;
    Ok(format!("physalia-worker:{}", blake3_like(&bytes)))
}

/// The CUDA worker image's tag for `worker`: `physalia-worker:<content hash>-cuda`.
pub fn cuda_image_tag(worker: &Path) -> Result<String> {
    Ok(format!("{}{CUDA_SUFFIX}", image_tag(worker)?))
}

const CUDA_SUFFIX: &str = "-cuda";

/// The CUDA worker image for `worker` (`physalia-worker:<content hash>-cuda`, for GPU workers), built when
/// missing from `worker-image/Dockerfile.cuda` and the wheels of [`CUDA_WHEELS`] (downloaded into
/// [`wheel_cache`] when not there). Returns its tag.
pub fn ensure_cuda_image(worker: &Path, obs: &dyn Observer) -> Result<String> {
    ensure_cuda_image_tagged(worker, &cuda_image_tag(worker)?, obs)
}

/// [`ensure_cuda_image`] under another tag.
pub fn ensure_cuda_image_tagged(worker: &Path, tag: &str, obs: &dyn Observer) -> Result<String> {
    tag_of(tag)?;
    let tag = tag.to_string();
    if docker(&["image", "inspect", "--format", "{{.Id}}", &tag]).is_ok() {
        return Ok(tag);
    }
    let cache = wheel_cache()?;
    let wheels = cuda_wheels(&cache, obs)?;
    obs.progress(&format!("building the CUDA worker image {tag}..."));
    build(worker, &tag, Some(&wheels), obs)?;
    Ok(tag)
}

/// The image of GPU workers: the job file's `backend.docker.gpu_image` (checked to be in the engine), or
/// the CUDA image of `worker`, built when missing.
pub fn gpu_image(named: Option<&str>, worker: &Path, obs: &dyn Observer) -> Result<String> {
    match named {
        Some(image) => {
            docker(&["image", "inspect", "--format", "{{.Id}}", image]).with_context(|| {
                format!(
                    "backend.docker.gpu_image: {image} is not in the Docker Engine (build it, or leave \
                     the field out for `physalia image build --cuda`'s)"
                )
            })?;
            Ok(image.to_string())
        }
        None => ensure_cuda_image(worker, obs),
    }
}

/// The PyPI wheels the CUDA image's libraries come from (CUDA 12.8, what the worker's cudarc is built
/// for): `(distribution, version)`.
pub const CUDA_WHEELS: [(&str, &str); 2] = [
    ("nvidia-cuda-nvrtc-cu12", "12.8.93"),
    ("nvidia-cublas-cu12", "12.8.4.1"),
];

/// The shared libraries taken from the wheels (each under `nvidia/<package>/lib/` in its wheel) into
/// `/usr/local/lib/physalia-cuda`: NVRTC and the builtins it opens, cuBLAS and cuBLASLt.
pub const CUDA_LIBRARIES: [&str; 4] = [
    "libnvrtc.so.12",
    "libnvrtc-builtins.so.12.8",
    "libcublas.so.12",
    "libcublasLt.so.12",
];

/// Unversioned names beside them (link -> target): cudarc opens `libnvrtc.so` and `libcublas.so` first.
pub const CUDA_LINKS: [(&str, &str); 3] = [
    ("libnvrtc.so", "libnvrtc.so.12"),
    ("libcublas.so", "libcublas.so.12"),
    ("libcublasLt.so", "libcublasLt.so.12"),
];

/// Where downloaded wheels are kept: `$PHYSALIA_WHEEL_CACHE`, else `$XDG_CACHE_HOME/physalia/wheels`,
/// else `~/.cache/physalia/wheels` (outside any checkout).
pub fn wheel_cache() -> Result<PathBuf> {
    let nonempty = |v: &str| {
        std::env::var_os(v)
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = nonempty("PHYSALIA_WHEEL_CACHE") {
        return Ok(dir);
    }
    if let Some(dir) = nonempty("XDG_CACHE_HOME") {
        return Ok(dir.join("physalia/wheels"));
    }
    match nonempty("HOME") {
        Some(home) => Ok(home.join(".cache/physalia/wheels")),
        None => bail!("no HOME for the wheel cache; set PHYSALIA_WHEEL_CACHE to a folder"),
    }
}

/// The cached wheel file of `dist==version` in `cache`, if there: pip names it
/// `<dist with _>-<version>-<tags>.whl`.
fn cached_wheel(cache: &Path, dist: &str, version: &str) -> Option<PathBuf> {
    let prefix = format!("{}-{version}-", dist.replace('-', "_"));
    let mut found: Vec<PathBuf> = std::fs::read_dir(cache)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
        })
        .collect();
    found.sort();
    found.pop()
}

/// The wheels of [`CUDA_WHEELS`] in `cache`, each downloaded with `python3 -m pip download` when not
/// there (binary wheels for this machine, no dependencies: the libraries are all that is used).
pub fn cuda_wheels(cache: &Path, obs: &dyn Observer) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(cache).with_context(|| format!("creating {}", cache.display()))?;
    let mut wheels = Vec::new();
    for (dist, version) in CUDA_WHEELS {
        if let Some(w) = cached_wheel(cache, dist, version) {
            wheels.push(w);
            continue;
        }
        obs.progress(&format!(
            "downloading {dist}=={version} into {} (once)...",
            cache.display()
        ));
        let out = Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
            .arg("--dest")
            .arg(cache)
            .arg(format!("{dist}=={version}"))
            .stdin(Stdio::null())
            .output()
            .context("running python3 -m pip (the CUDA image's libraries come from PyPI wheels)")?;
        if !out.status.success() {
            bail!(
                "pip download {dist}=={version} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        wheels.push(cached_wheel(cache, dist, version).with_context(|| {
            format!(
                "pip downloaded {dist}=={version}, but no {}-{version}-*.whl is in {}",
                dist.replace('-', "_"),
                cache.display()
            )
        })?);
    }
    Ok(wheels)
}

/// Unpacks [`CUDA_LIBRARIES`] from `wheels` (zip files) into `dest`, mode 0755, and makes
/// [`CUDA_LINKS`]. Python's zipfile, as pip needs Python anyway.
pub fn unpack_cuda_libraries(wheels: &[PathBuf], dest: &Path) -> Result<()> {
    const UNPACK: &str = r#"
import os, shutil, sys, zipfile
dest, wanted = sys.argv[1], set(sys.argv[2].split(","))
for wheel in sys.argv[3:]:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if len(parts) == 4 and parts[0] == "nvidia" and parts[2] == "lib" and parts[3] in wanted:
                with z.open(info) as src, open(os.path.join(dest, parts[3]), "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
"#;
    std::fs::create_dir_all(dest)?;
    let out = Command::new("python3")
        .args(["-c", UNPACK])
        .arg(dest)
        .arg(CUDA_LIBRARIES.join(","))
        .args(wheels)
        .stdin(Stdio::null())
        .output()
        .context("running python3 to unpack the CUDA wheels")?;
    if !out.status.success() {
        bail!(
            "unpacking the CUDA wheels failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    use std::os::unix::fs::PermissionsExt;
    for lib in CUDA_LIBRARIES {
        let path = dest.join(lib);
        if !path.is_file() {
            bail!(
                "no nvidia/*/lib/{lib} in the wheels {}",
                wheels
                    .iter()
                    .map(|w| w.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    }
    for (link, target) in CUDA_LINKS {
        std::os::unix::fs::symlink(target, dest.join(link))
            .with_context(|| format!("linking {link} to {target}"))?;
    }
    Ok(())
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

/// Pushes the local image `local` (`NAME:TAG`) to `registry` (a registry host and optional path:
/// `123456789012.dkr.ecr.us-east-1.amazonaws.com`, `ghcr.io/team`) as `<registry>/<last part of
/// NAME>:<TAG>`, through the Docker Engine and its registry login (`docker login`), and returns that
/// reference: what a cloud section's `image` names. No credential passes through physalia.
pub fn push_image(local: &str, registry: &str) -> Result<String> {
    let registry = registry.trim().trim_end_matches('/');
    if registry.is_empty() || registry.contains("://") || registry.contains(char::is_whitespace) {
        bail!(
            "{registry:?}: not a registry: give its host and optional path, without a scheme \
             (123456789012.dkr.ecr.us-east-1.amazonaws.com, ghcr.io/team, myregistry.azurecr.io)"
        );
    }
    let (name, tag) = local
        .rsplit_once(':')
        .filter(|(n, _)| !n.is_empty())
        .with_context(|| format!("{local}: not a NAME:TAG image reference"))?;
    let base = name.rsplit('/').next().unwrap_or(name);
    let remote = format!("{registry}/{base}:{tag}");
    docker(&["tag", local, &remote]).with_context(|| format!("tagging {local} as {remote}"))?;
    let out = Command::new("docker")
        .args(["push", &remote])
        .stdin(Stdio::null())
        .output()
        .context("running docker (is the Docker Engine installed and running?)")?;
    if !out.status.success() {
        let host = registry.split('/').next().unwrap_or(registry);
        let said = String::from_utf8_lossy(&out.stderr);
        let said = said.trim();
        let hint = if said.contains("denied")
            || said.contains("unauthorized")
            || said.contains("authentication")
        {
            format!(
                "log the Docker Engine in first: `docker login {host}` (ECR: `aws ecr get-login-password | docker login --username AWS --password-stdin {host}`; ACR: `az acr login --name <registry>`)"
            )
        } else {
            format!("is {host} a registry this machine reaches?")
        };
        // the local tag for the registry is not left behind
        let _ = docker(&["rmi", &remote]);
        bail!("pushing {remote}: {said}\n  hint: {hint}");
    }
    Ok(remote)
}

/// The pushed image's content digest reference (`<repo>@sha256:...`) as the registry recorded it.
pub fn pushed_digest(remote: &str) -> Option<String> {
    let repo = remote.rsplit_once(':').map(|(r, _)| r)?;
    docker(&[
        "image",
        "inspect",
        "--format",
        "{{range .RepoDigests}}{{println .}}{{end}}",
        remote,
    ])
    .ok()?
    .lines()
    .find(|l| l.starts_with(&format!("{repo}@")))
    .map(String::from)
}

/// Builds the runtime base from this machine's libraries and the image from `worker-image/Dockerfile`.
pub fn build_image(worker: &Path, tag: &str, obs: &dyn Observer) -> Result<()> {
    build(worker, tag, None, obs)
}

/// Builds the runtime base and the image `tag`: from `worker-image/Dockerfile`, or with `cuda_wheels`
/// from `worker-image/Dockerfile.cuda` with the wheels' libraries in the context's `cuda/` folder and
/// the host libraries they need in the base.
fn build(
    worker: &Path,
    tag: &str,
    cuda_wheels: Option<&[PathBuf]>,
    obs: &dyn Observer,
) -> Result<()> {
    let stage = tempfile::tempdir().context("creating a staging folder")?;
    let ctx = stage.path().join("context");
    std::fs::create_dir_all(&ctx)?;
    let mut libs: BTreeSet<PathBuf> = shared_libraries(worker)?.into_iter().collect();
    if let Some(wheels) = cuda_wheels {
        let cuda = ctx.join("cuda");
        unpack_cuda_libraries(wheels, &cuda)?;
        for lib in CUDA_LIBRARIES {
            libs.extend(host_libraries_of(&cuda.join(lib), &cuda)?);
        }
    }
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
    for lib in libs {
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
    let base = format!("physalia-runtime:{}", tag_of(tag)?);
    import_base(&tar, &base, obs).context("importing the runtime base")?;
    // the build context: the Dockerfile and the stripped binary (and cuda/)
    let dockerfile = match cuda_wheels {
        None => crate_dockerfile()?,
        Some(_) => include_str!("../../../worker-image/Dockerfile.cuda"),
    };
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
    let out = super::step(obs, &format!("building {tag}"), || {
        Command::new("docker")
            .args(["build", "--build-arg", &format!("BASE={base}"), "-t", tag])
            .arg(&ctx)
            .env("DOCKER_BUILDKIT", "0")
            .output()
    })
    .context("running docker build")?;
    if !out.status.success() {
        bail!(
            "docker build of the worker image failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// `docker import` of the runtime base's tar as `base`, streamed through standard input so the bar
/// counts the bytes docker has taken.
fn import_base(tar: &Path, base: &str, obs: &dyn Observer) -> Result<()> {
    let size = std::fs::metadata(tar)
        .with_context(|| format!("reading {}", tar.display()))?
        .len();
    let mut child = Command::new("docker")
        .args(["import", "--change", "ENV PATH=/usr/local/bin", "-", base])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running docker")?;
    let bar = obs.transfer("importing the runtime base", size);
    let file = std::fs::File::open(tar).with_context(|| format!("reading {}", tar.display()))?;
    let mut stdin = child.stdin.take().expect("stdin is piped");
    // a write error is docker having stopped reading: its own message says why
    let mut counted = super::Counted {
        inner: file,
        progress: bar.as_ref(),
    };
    let copied = std::io::copy(&mut counted, &mut stdin);
    drop(stdin);
    drop(bar);
    let out = child.wait_with_output().context("running docker")?;
    if !out.status.success() {
        bail!(
            "docker import failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    copied.with_context(|| format!("sending {} to docker import", tar.display()))?;
    Ok(())
}

/// The tag part of an image reference `[registry/]name:tag`.
fn tag_of(image: &str) -> Result<&str> {
    let last = image.rsplit_once('/').map_or(image, |(_, l)| l);
    match last.split_once(':') {
        Some((name, tag)) if !name.is_empty() && !tag.is_empty() => Ok(tag),
        _ => bail!("the image {image:?} needs a tag: NAME:TAG"),
    }
}

/// `worker-image/Dockerfile`, embedded so an installed `physalia` can build images anywhere.
fn crate_dockerfile() -> Result<&'static str> {
    Ok(include_str!("../../../worker-image/Dockerfile"))
}

/// The host libraries `lib` (a CUDA library in `dir`) needs, from `ldd` with `dir` searched first: those
/// outside `dir`, which the runtime base must hold too. One the host lacks is an error naming it.
fn host_libraries_of(lib: &Path, dir: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(lib)
        .env("LD_LIBRARY_PATH", dir)
        .output()
        .context("running ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if let Some(missing) = text.lines().find(|l| l.contains("not found")) {
        bail!(
            "{} needs a library this machine lacks: {}",
            lib.display(),
            missing.trim()
        );
    }
    Ok(parse_ldd(&text)
        .into_iter()
        .filter(|p| !p.starts_with(dir))
        .collect())
}

/// The shared libraries `bin` loads (and the loader), from `ldd`.
fn shared_libraries(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .context("running ldd")?;
    let libs = parse_ldd(&String::from_utf8_lossy(&out.stdout));
    if libs.is_empty() {
        bail!("ldd found no libraries for {}", bin.display());
    }
    Ok(libs)
}

/// The absolute paths in `ldd`'s output.
fn parse_ldd(text: &str) -> Vec<PathBuf> {
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
    libs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wheel-shaped zip at `dir/name` holding `files` (path in the zip -> bytes), made with Python's
    /// zipfile like the real ones are read.
    fn zip(dir: &Path, name: &str, files: &[(&str, &[u8])]) -> PathBuf {
        let path = dir.join(name);
        let src = dir.join(format!("{name}.src"));
        std::fs::create_dir_all(&src).unwrap();
        let mut args = Vec::new();
        for (i, (inner, bytes)) in files.iter().enumerate() {
            let f = src.join(i.to_string());
            std::fs::write(&f, bytes).unwrap();
            args.push(f.display().to_string());
            args.push(inner.to_string());
        }
        let ok = Command::new("python3")
            .args([
                "-c",
                "import sys, zipfile\nz = zipfile.ZipFile(sys.argv[1], 'w')\n\
                 for f, name in zip(sys.argv[2::2], sys.argv[3::2]): z.write(f, name)\nz.close()",
            ])
            .arg(&path)
            .args(&args)
            .status()
            .unwrap()
            .success();
        assert!(ok);
        path
    }

    #[test]
    fn the_wheels_libraries_are_unpacked_with_their_unversioned_links() {
        let t = tempfile::tempdir().unwrap();
        let nvrtc = zip(
            t.path(),
            "nvidia_cuda_nvrtc_cu12-12.8.93-py3-none-manylinux_2_12_x86_64.whl",
            &[
                ("nvidia/cuda_nvrtc/lib/libnvrtc.so.12", b"nvrtc"),
                (
                    "nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so.12.8",
                    b"builtins",
                ),
                ("nvidia/cuda_nvrtc/lib/libnvrtc.alt.so.12", b"alt"),
                ("nvidia/cuda_nvrtc/include/nvrtc.h", b"header"),
            ],
        );
        let cublas = zip(
            t.path(),
            "nvidia_cublas_cu12-12.8.4.1-py3-none-manylinux_2_27_x86_64.whl",
            &[
                ("nvidia/cublas/lib/libcublas.so.12", b"cublas"),
                ("nvidia/cublas/lib/libcublasLt.so.12", b"cublasLt"),
                ("nvidia/cublas/lib/libnvblas.so.12", b"nvblas"),
            ],
        );
        // found in the cache by pip's file names, whatever the platform tag
        for (dist, version) in CUDA_WHEELS {
            assert!(cached_wheel(t.path(), dist, version).is_some(), "{dist}");
        }
        assert_eq!(
            cached_wheel(t.path(), "nvidia-cublas-cu12", "12.6.4.1"),
            None
        );
        let wheels = cuda_wheels(t.path(), &crate::driver::Plain { quiet: true }).unwrap();
        assert_eq!(wheels, [nvrtc.clone(), cublas.clone()]);

        let dest = t.path().join("cuda");
        unpack_cuda_libraries(&wheels, &dest).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(&dest)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "libcublas.so",
                "libcublas.so.12",
                "libcublasLt.so",
                "libcublasLt.so.12",
                "libnvrtc-builtins.so.12.8",
                "libnvrtc.so",
                "libnvrtc.so.12"
            ]
        );
        assert_eq!(std::fs::read(dest.join("libnvrtc.so")).unwrap(), b"nvrtc");
        assert_eq!(
            std::fs::read_link(dest.join("libcublas.so")).unwrap(),
            Path::new("libcublas.so.12")
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dest.join("libcublasLt.so.12"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);

        // a wheel without one of the libraries is an error naming it
        let dest = t.path().join("cuda2");
        let err = unpack_cuda_libraries(&[nvrtc], &dest)
            .unwrap_err()
            .to_string();
        assert!(err.contains("libcublas.so.12"), "{err}");
    }

    #[test]
    fn gpu_workers_of_a_docker_job_run_the_gpu_image() {
        let cfg = crate::driver::platform::docker::config(
            "cora 1",
            Some("physalia-worker:0123456789abcdef-cuda".into()),
        );
        assert_eq!(cfg.network, "physalia-cora-1");
        assert_eq!(
            cfg.gpu_image.as_deref(),
            Some("physalia-worker:0123456789abcdef-cuda")
        );
        let t = tempfile::tempdir().unwrap();
        let worker = t.path().join("physalia-worker");
        std::fs::write(&worker, b"a worker binary").unwrap();
        let cpu = image_tag(&worker).unwrap();
        let gpu = cuda_image_tag(&worker).unwrap();
        assert_eq!(gpu, format!("{cpu}-cuda"));
        assert!(cpu.starts_with("physalia-worker:") && cpu.len() == "physalia-worker:".len() + 16);
    }

    #[test]
    fn an_image_tag_is_the_part_after_the_names_colon() {
        assert_eq!(tag_of("physalia-worker:0123-cuda").unwrap(), "0123-cuda");
        assert_eq!(tag_of("localhost:5000/w:cuda").unwrap(), "cuda");
        for bad in ["localhost:5000/w", "w", "w:", ":t"] {
            assert!(tag_of(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ldd_output_gives_absolute_paths() {
        let text = "\tlinux-vdso.so.1 (0x00007f)\n\tlibcublasLt.so.12 => /ctx/cuda/libcublasLt.so.12 (0x1)\n\
                    \tlibrt.so.1 => /lib/x86_64-linux-gnu/librt.so.1 (0x2)\n\t/lib64/ld-linux-x86-64.so.2 (0x3)\n";
        assert_eq!(
            parse_ldd(text),
            [
                PathBuf::from("/ctx/cuda/libcublasLt.so.12"),
                PathBuf::from("/lib/x86_64-linux-gnu/librt.so.1"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
    }
}
