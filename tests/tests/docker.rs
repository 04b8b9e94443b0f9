//! The docker backend for real: workers as containers of the locally built worker image on a private bridge
//! network, with no bind mount (they fetch their partitions and send checkpoints and the model over their
//! control connections). Cora on 3 containers trains exactly like 3 local processes, and a container killed
//! mid-training is recovered by retrying its epoch (every multi-worker job retries, with or without a
//! scaling policy), the loss curve unchanged; a scaling policy resizes the containers in place. Skipped,
//! with a note, where no Docker Engine answers.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use physalia_tests::{job_dirs, metrics, physalia, write_job};
use serde_json::Value;
use tempfile::TempDir;

fn docker_available() -> bool {
    let ok = Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipping: no Docker Engine answers");
    }
    ok
}

fn losses(dir: &Path) -> Vec<f64> {
    metrics(dir)
        .iter()
        .map(|m| m["metrics"]["loss"].as_f64().unwrap())
        .collect()
}

fn submit(cwd: &Path, sets: &[&str]) -> Value {
    let mut args = vec!["submit", "job.yaml", "-q", "--output", "json"];
    for s in sets {
        args.push("--set");
        args.push(s);
    }
    physalia(cwd, args).ok().last_json()
}

#[test]
fn cora_on_three_containers_trains_like_three_processes() {
    let Some(cora) = physalia_tests::cora_dir() else {
        eprintln!("skipping: Cora not found");
        return;
    };
    if !docker_available() {
        return;
    }
    let t = TempDir::new().unwrap();
    write_job(
        t.path(),
        "job.yaml",
        &format!(
            "name: dk\ndataset:\n  path: {}\n  row_normalize: true\nmodel: {{kind: gcn, layers: 2, hidden: 16}}\ntrain: {{epochs: 30, seed: 0}}\nworkers: 3\noutput: {{dir: jobs}}\n",
            cora.display()
        ),
    );
    let local = submit(t.path(), &[]);
    let docker = submit(t.path(), &["backend=docker"]);
    let (a, b) = (
        losses(&t.path().join(local["job_dir"].as_str().unwrap())),
        losses(&t.path().join(docker["job_dir"].as_str().unwrap())),
    );
    assert_eq!(a.len(), 30);
    for (e, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-4 * x.abs(),
            "epoch {}: local {x}, docker {y}",
            e + 1
        );
    }
    assert_eq!(
        local["runs"][0]["final_test_acc"],
        docker["runs"][0]["final_test_acc"]
    );
    let dir = t.path().join(docker["job_dir"].as_str().unwrap());
    // rank 0 sent the model and its last checkpoint back over its control connection
    let model = std::fs::read(dir.join("model.safetensors")).unwrap();
    let local_model = std::fs::read(
        t.path()
            .join(local["job_dir"].as_str().unwrap())
            .join("model.safetensors"),
    )
    .unwrap();
    assert_eq!(model.len(), local_model.len());
    assert!(dir.join("checkpoints/epoch-000030.safetensors").is_file());
    let log = std::fs::read_to_string(dir.join("logs/worker-1.log")).unwrap();
    assert!(
        log.contains("advertised 172.")
            || log.contains("advertised 10.")
            || log.contains("advertised 192.168."),
        "{log}"
    );
    assert_nothing_left(&dir);
}

/// Nothing of the job in `dir` is left behind: no container, no network.
fn assert_nothing_left(dir: &Path) {
    let job = dir.file_name().unwrap().to_string_lossy().to_string();
    let ps = Command::new("docker")
        .args([
            "ps",
            "-a",
            "-q",
            "--filter",
            &format!("label=physalia.job={job}"),
        ])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&ps.stdout).trim().is_empty(),
        "containers left: {}",
        String::from_utf8_lossy(&ps.stdout)
    );
    let nets = Command::new("docker")
        .args(["network", "ls", "--format", "{{.Name}}"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&nets.stdout).contains(&job),
        "network left"
    );
}

/// A chunked dataset on containers that share no disk with the coordinator (issue 31): each worker
/// fetches only the chunk files it reads (half of them each), the two cut their parts together over
/// the mesh and hand them back; the coordinator commits the set beside the dataset. The losses equal
/// local processes' on the same graph, and a second job reuses the set (served parts, nothing cut).
#[test]
fn containers_cut_a_chunked_dataset_fetching_only_their_share_of_its_files() {
    if !docker_available() {
        return;
    }
    let t = TempDir::new().unwrap();
    for out in ["a", "b"] {
        physalia_tests::synth_chunked_sbm(t.path(), out, (3000, 16, 8), 1, 512);
    }
    let job = |path: &str| {
        format!(
            "name: dkc\ndataset:\n  path: {path}\nmodel: {{kind: sage, layers: 2, hidden: 16}}\ntrain: {{epochs: 6, seed: 0}}\nworkers: 2\noutput: {{dir: jobs}}\n"
        )
    };
    write_job(t.path(), "job.yaml", &job("a"));
    let local = submit(t.path(), &[]);
    write_job(t.path(), "job.yaml", &job("b"));
    let docker = submit(t.path(), &["backend=docker"]);
    let dir = t.path().join(docker["job_dir"].as_str().unwrap());
    let (a, b) = (
        losses(&t.path().join(local["job_dir"].as_str().unwrap())),
        losses(&dir),
    );
    assert_eq!(a.len(), 6);
    for (e, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-4 * x.abs(),
            "epoch {}: local {x}, docker {y}",
            e + 1
        );
    }
    let data_bytes = physalia_tests::chunked_data_bytes(&t.path().join("b"));
    let mut read_mib = 0.0;
    for rank in 0..2 {
        let log = std::fs::read_to_string(dir.join(format!("logs/worker-{rank}.log"))).unwrap();
        assert!(
            log.contains(&format!("worker {rank}: cut part {rank} of 2")),
            "{log}"
        );
        // the dataset is on the coordinator's disk, not in a store: served by the coordinator
        assert!(
            log.contains("chunks, fetched through the coordinator)"),
            "{log}"
        );
        let mib = physalia_tests::cut_read_mib(&log);
        // each fetched its share, not the dataset
        assert!(
            mib * f64::from(1u32 << 20) < 0.75 * data_bytes as f64,
            "{log}"
        );
        read_mib += mib;
    }
    let data_mib = data_bytes as f64 / f64::from(1u32 << 20);
    assert!(
        (read_mib - data_mib).abs() <= 0.1,
        "read {read_mib} MiB of {data_mib} MiB"
    );
    // the parts came back into the set beside the dataset, which the coordinator committed
    let set = t.path().join("b/parts/k2-seed0");
    for f in [
        "partition.safetensors",
        "part0.safetensors",
        "part1.safetensors",
    ] {
        assert!(set.join(f).is_file(), "{f}");
    }
    assert!(!set.join("pending").exists());
    let coordinator = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    assert!(
        coordinator.contains("its 2 parts cut by the workers"),
        "{coordinator}"
    );
    // and they are the parts the local workers cut from the same graph
    for f in ["part0.safetensors", "part1.safetensors"] {
        assert_eq!(
            std::fs::read(set.join(f)).unwrap(),
            std::fs::read(t.path().join("a/parts/k2-seed0").join(f)).unwrap(),
            "{f}"
        );
    }
    let again = submit(t.path(), &["backend=docker"]);
    let again_dir = t.path().join(again["job_dir"].as_str().unwrap());
    let log = std::fs::read_to_string(again_dir.join("logs/worker-0.log")).unwrap();
    assert!(!log.contains("cut part"), "{log}");
    assert_eq!(losses(&again_dir), b);
}

#[test]
fn a_container_killed_mid_training_is_recovered() {
    if !docker_available() {
        return;
    }
    let t = TempDir::new().unwrap();
    let job = "name: dkill\ndataset:\n  synth: {kind: sbm, nodes: 12000, classes: 4, feat_dim: 16, avg_degree: 10, homophily: 0.8, seed: 1}\nmodel: {kind: gcn, layers: 2, hidden: 16}\ntrain: {epochs: 80, seed: 0}\nworkers: 2\noutput: {dir: jobs}\n";
    write_job(t.path(), "job.yaml", job);
    let fixed = submit(t.path(), &[]);
    let want = losses(&t.path().join(fixed["job_dir"].as_str().unwrap()));
    let first = fixed["job_dir"].as_str().unwrap().to_string();
    let child = Command::new(physalia_tests::physalia_bin())
        .current_dir(t.path())
        .args([
            "submit",
            "job.yaml",
            "-q",
            "--output",
            "json",
            "--set",
            "backend=docker",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(300);
    let dir = loop {
        assert!(Instant::now() < deadline, "the docker job never got going");
        let d = job_dirs(&t.path().join("jobs"))
            .into_iter()
            .find(|d| !first.ends_with(&*d.file_name().unwrap().to_string_lossy()));
        if let Some(d) = d
            && std::fs::read_to_string(d.join("metrics.jsonl"))
                .is_ok_and(|m| m.lines().count() >= 3)
        {
            break d;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // rank 1 of the job's first launch, by the labels the docker backend puts on every container
    let job = dir.file_name().unwrap().to_string_lossy().to_string();
    let ps = Command::new("docker")
        .args([
            "ps",
            "-q",
            "--filter",
            &format!("label=physalia.job={job}"),
            "--filter",
            "label=physalia.dev/rank=1",
        ])
        .output()
        .unwrap();
    let name = String::from_utf8_lossy(&ps.stdout).trim().to_string();
    assert_eq!(name.lines().count(), 1, "one running rank 1: {name:?}");
    // the containers share no disk with this machine
    let mounts = Command::new("docker")
        .args(["inspect", "--format", "{{json .Mounts}}", &name])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&mounts.stdout).trim(),
        "[]",
        "{}",
        String::from_utf8_lossy(&mounts.stderr)
    );
    let killed = Command::new("docker")
        .args(["kill", &name])
        .output()
        .unwrap();
    assert!(
        killed.status.success(),
        "{}",
        String::from_utf8_lossy(&killed.stderr)
    );
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the job failed after the kill");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let got = losses(&dir);
    assert_eq!(got.len(), 80, "every epoch exactly once");
    for (e, (x, y)) in got.iter().zip(&want).enumerate() {
        assert!(
            (x - y).abs() <= 1e-3 * y.abs(),
            "epoch {}: {x} vs fixed {y}",
            e + 1
        );
    }
    let events = v["scaling_events"].as_array().unwrap();
    assert!(
        events
            .iter()
            .any(|e| e["event"].as_str().unwrap_or("").contains("lost a worker")),
        "{events:?}"
    );
}

/// A scaling policy on containers resizes in place (issue 33): 1 -> 2 -> 1 workers, rank 0's container
/// trains from the first epoch to the last (one registration, "continuing in place" after each resize),
/// the joiner's container starts on the job's network and binds its mesh port there, and the curve is
/// the fixed run's.
#[test]
fn containers_resize_in_place_keeping_the_survivors() {
    if !docker_available() {
        return;
    }
    let t = TempDir::new().unwrap();
    let job = "name: dgrow\ndataset:\n  synth: {kind: sbm, nodes: 3000, classes: 4, feat_dim: 16, avg_degree: 10, homophily: 0.8, seed: 1}\nmodel: {kind: gcn, layers: 2, hidden: 16}\ntrain: {epochs: 8, seed: 0, threads: 1}\noutput: {dir: jobs}\n";
    write_job(t.path(), "job.yaml", job);
    let fixed = submit(t.path(), &[]);
    let want = losses(&t.path().join(fixed["job_dir"].as_str().unwrap()));
    write_job(
        t.path(),
        "policy.yaml",
        "min_workers: 1\nmax_workers: 2\ncooldown_epochs: 0\nrules:\n  - name: two-at-3\n    when: epoch == 3\n    then: {set_workers: 2}\n  - name: one-at-6\n    when: epoch == 6\n    then: {set_workers: 1}\n",
    );
    write_job(
        t.path(),
        "job.yaml",
        &format!("{job}scaling_file: policy.yaml\n"),
    );
    let v = submit(t.path(), &["backend=docker"]);
    let dir = t.path().join(v["job_dir"].as_str().unwrap());
    let got = losses(&dir);
    assert_eq!(got.len(), 8, "every epoch exactly once");
    for (e, (x, y)) in got.iter().zip(&want).enumerate() {
        assert!(
            (x - y).abs() <= 1e-3 * y.abs(),
            "epoch {}: {x} vs fixed {y}",
            e + 1
        );
    }
    let workers: Vec<usize> = metrics(&dir)
        .iter()
        .map(|m| m["workers"].as_array().map_or(1, Vec::len))
        .collect();
    assert_eq!(workers, [1, 1, 1, 2, 2, 2, 1, 1]);
    physalia_tests::assert_resized_in_place(&dir, &[(1, 2, 3), (2, 1, 6)]);
    let logs: Vec<String> = std::fs::read_dir(dir.join("logs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    // the joiner is rank 1 of the job in launch 1: its output is rank 1's
    let joiner = std::fs::read_to_string(dir.join("logs/worker-1.seg1.log"))
        .unwrap_or_else(|e| panic!("{e}: {logs:?}"));
    assert!(
        joiner.contains("advertised 172.")
            || joiner.contains("advertised 10.")
            || joiner.contains("advertised 192.168."),
        "{joiner}"
    );
    // a resize's deltas, prepared while the job trains, are fetched by the containers beside training
    let ahead = physalia_tests::assert_deltas_taken_ahead(&dir);
    eprintln!("deltas fetched ahead of their resize: {ahead}");
    // the ledger bills the pause: a launch per segment, the resized ones marked in place
    let summary = physalia_tests::read_json(&dir.join("summary.json"));
    let spans = summary["launches"].as_array().unwrap();
    let in_place = spans.iter().filter(|s| s["in_place"] == true).count();
    assert_eq!(in_place, 2, "{spans:?}");
    assert_nothing_left(&dir);
}

/// `backend.docker.image` names the image to run; one the engine does not have is refused naming the
/// field, and the job's record says it failed (nothing is pulled, no container is left).
#[test]
fn a_named_docker_image_that_is_not_there_is_refused() {
    if !docker_available() {
        return;
    }
    let t = TempDir::new().unwrap();
    write_job(
        t.path(),
        "job.yaml",
        "name: img\ndataset:\n  synth:\n    kind: sbm\n    nodes: 500\n    classes: 2\n    avg_degree: 4\n    \
         feat_dim: 8\nmodel:\n  kind: gcn\n  hidden: 8\ntrain:\n  epochs: 1\nworkers: 2\nbackend:\n  name: \
         docker\n  docker:\n    image: physalia-no-such-image:0\noutput:\n  dir: jobs\n",
    );
    let out = physalia(t.path(), ["submit", "job.yaml", "-q"]);
    let line = out.one_line_error(&["backend.docker.image", "physalia-no-such-image:0"]);
    assert!(line.contains("not in the Docker Engine"), "{line}");
    let dir = job_dirs(&t.path().join("jobs")).remove(0);
    let status = physalia_tests::read_json(&dir.join("status.json"));
    assert_eq!(status["state"], "failed", "{status}");
    let left = Command::new("docker")
        .args(["ps", "-aq", "--filter", "name=img-"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&left.stdout).trim().is_empty());
}

/// Runs `physalia image build ARGS` with the wheel cache `cache`; the tag it prints.
fn image_build(cwd: &Path, cache: &Path, args: &[&str]) -> String {
    let out = Command::new(physalia_tests::physalia_bin())
        .current_dir(cwd)
        .args(["image", "build"])
        .args(args)
        .env("PHYSALIA_WHEEL_CACHE", cache)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "image build {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The dynamic loader of the image (the runtime base copies the host's) listing what `lib` loads: each
/// dependency found, through the image's `LD_LIBRARY_PATH` for the CUDA ones.
fn loads_in_image(image: &str, lib: &str) -> String {
    let out = Command::new("docker")
        .args([
            "run",
            "--rm",
            "--entrypoint",
            "/lib64/ld-linux-x86-64.so.2",
            image,
        ])
        .args(["--list", lib])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && !text.contains("not found"),
        "{lib} does not load in {image}: {text}"
    );
    text
}

/// Every CUDA library the worker opens, by the names cudarc tries.
const CUDA_NAMES: [&str; 7] = [
    "libnvrtc.so",
    "libnvrtc.so.12",
    "libnvrtc-builtins.so.12.8",
    "libcublas.so",
    "libcublas.so.12",
    "libcublasLt.so",
    "libcublasLt.so.12",
];

fn remove_images(images: &[&str]) {
    let _ = Command::new("docker")
        .args(["image", "rm", "-f"])
        .args(images)
        .output();
}

/// The wiring of the CUDA image, cheaply: `physalia image build --cuda` builds Dockerfile.cuda on the
/// locally made runtime base (nothing pulled) from wheels found in the cache, here stand-ins whose
/// "CUDA libraries" are copies of a small host library (libdl): each lands in /usr/local/lib/physalia-cuda
/// with its unversioned link, loads with what it needs, the image sets LD_LIBRARY_PATH and the NVIDIA
/// toolkit's variables, and the worker runs (`--health`). The real wheels: the ignored test below.
#[test]
fn the_cuda_image_is_built_from_wheels_in_the_cache() {
    if !docker_available() {
        return;
    }
    let t = TempDir::new().unwrap();
    let cache = t.path().join("wheels");
    std::fs::create_dir_all(&cache).unwrap();
    let stand_in = Path::new("/lib/x86_64-linux-gnu/libdl.so.2");
    if !stand_in.is_file() {
        eprintln!("skipping: {} is absent", stand_in.display());
        return;
    }
    let stage = t.path().join("stage");
    for (wheel, package, libs) in [
        (
            "nvidia_cuda_nvrtc_cu12-12.8.93-py3-none-manylinux_2_12_x86_64.whl",
            "cuda_nvrtc",
            &["libnvrtc.so.12", "libnvrtc-builtins.so.12.8"][..],
        ),
        (
            "nvidia_cublas_cu12-12.8.4.1-py3-none-manylinux_2_27_x86_64.whl",
            "cublas",
            &["libcublas.so.12", "libcublasLt.so.12"][..],
        ),
    ] {
        let lib_dir = stage.join("nvidia").join(package).join("lib");
        std::fs::create_dir_all(&lib_dir).unwrap();
        for lib in libs {
            std::fs::copy(stand_in, lib_dir.join(lib)).unwrap();
        }
        let zipped = Command::new("python3")
            .args([
                "-c",
                "import os, sys, zipfile\nz = zipfile.ZipFile(sys.argv[1], 'w')\n\
                 for d, _, fs in os.walk(sys.argv[2]):\n    for f in fs:\n        \
                 p = os.path.join(d, f); z.write(p, os.path.relpath(p, sys.argv[2]))\nz.close()",
            ])
            .arg(cache.join(wheel))
            .arg(&stage)
            .status()
            .unwrap();
        assert!(zipped.success());
        std::fs::remove_dir_all(&stage).unwrap();
    }
    let tag = format!("physalia-test-cuda:wiring-{}", std::process::id());
    let base = format!("physalia-runtime:wiring-{}", std::process::id());
    let built = image_build(t.path(), &cache, &["--cuda", "--tag", &tag]);
    assert_eq!(built, tag);
    let checks = std::panic::catch_unwind(|| {
        for name in CUDA_NAMES {
            loads_in_image(&tag, &format!("/usr/local/lib/physalia-cuda/{name}"));
        }
        let env = Command::new("docker")
            .args(["image", "inspect", "--format", "{{json .Config.Env}}", &tag])
            .output()
            .unwrap();
        let env = String::from_utf8_lossy(&env.stdout);
        for want in [
            "LD_LIBRARY_PATH=/usr/local/lib/physalia-cuda",
            "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
        ] {
            assert!(env.contains(want), "{want} missing from {env}");
        }
        let health = Command::new("docker")
            .args(["run", "--rm", &tag, "--health"])
            .output()
            .unwrap();
        assert!(
            health.status.success(),
            "{}",
            String::from_utf8_lossy(&health.stderr)
        );
    });
    remove_images(&[&tag, &base]);
    if let Err(e) = checks {
        std::panic::resume_unwind(e);
    }
}

/// The CUDA image from NVIDIA's real wheels (about 680 MB downloaded once into ~/.cache/physalia/wheels,
/// a 1 GB image): NVRTC and cuBLAS load in it with their dependencies, cuBLASLt found through
/// LD_LIBRARY_PATH. Needs no GPU (nothing is run on one); too large for CI, so run it by hand:
///
///   cargo test -p physalia-tests --test docker the_cuda_image_from_the_real_wheels -- --ignored
///
/// It keeps the image it builds (`physalia-worker:<hash>-cuda`, what `physalia image build --cuda` makes).
#[test]
#[ignore = "downloads ~680 MB of CUDA wheels and builds a 1 GB image; run by hand"]
fn the_cuda_image_from_the_real_wheels() {
    if !docker_available() {
        return;
    }
    let t = TempDir::new().unwrap();
    let cache = std::env::var_os("PHYSALIA_WHEEL_CACHE")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| std::path::PathBuf::from(h).join(".cache/physalia/wheels"))
        })
        .unwrap();
    let tag = image_build(t.path(), &cache, &["--cuda"]);
    assert!(
        tag.starts_with("physalia-worker:") && tag.ends_with("-cuda"),
        "{tag}"
    );
    let cublas = loads_in_image(&tag, "/usr/local/lib/physalia-cuda/libcublas.so");
    assert!(
        cublas.contains("libcublasLt.so.12 => /usr/local/lib/physalia-cuda/libcublasLt.so.12"),
        "{cublas}"
    );
    for name in CUDA_NAMES {
        loads_in_image(&tag, &format!("/usr/local/lib/physalia-cuda/{name}"));
    }
    let health = Command::new("docker")
        .args(["run", "--rm", &tag, "--health"])
        .output()
        .unwrap();
    assert!(
        health.status.success(),
        "{}",
        String::from_utf8_lossy(&health.stderr)
    );
}
