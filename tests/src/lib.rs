//! End-to-end tests live in `tests/tests/`; this library holds helpers they share.
//!
//! The `physalia` binary belongs to another package, so Cargo does not hand its path to these tests
//! (`CARGO_BIN_EXE_physalia` is only set for a package's own binaries, and a dev-dependency on a
//! binary-only package is ignored). [`physalia_bin`] therefore builds it once per test process with the
//! same Cargo and profile, and takes the executable's path from Cargo's JSON messages. Set
//! `PHYSALIA_BIN` to test a prebuilt binary instead.

pub mod cluster;
pub mod decode;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use serde_json::Value;

/// The workspace root (`/work/main`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// The shared raw Cora folder, if this checkout has it.
pub fn cora_dir() -> Option<PathBuf> {
    let p = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/data/cora"
    ));
    if p.join("edges.csv").is_file() {
        Some(p)
    } else {
        eprintln!("note: {} is absent; skipping the Cora test", p.display());
        None
    }
}

/// Path of an up-to-date `physalia` binary (built on first use, together with the `physalia-worker` it
/// starts for multi-worker jobs, in the same profile and folder).
pub fn physalia_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("PHYSALIA_BIN") {
            return PathBuf::from(p);
        }
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(repo_root())
            .args([
                "build",
                "--quiet",
                "-p",
                "physalia",
                "-p",
                "physalia-worker",
                "--message-format=json",
            ])
            .stderr(Stdio::inherit());
        if !cfg!(debug_assertions) {
            cmd.arg("--release");
        }
        let out = cmd
            .output()
            .expect("running cargo build -p physalia -p physalia-worker");
        assert!(
            out.status.success(),
            "cargo build -p physalia -p physalia-worker failed"
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = stdout.lines().collect();
        lines
            .into_iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "physalia")
            .filter_map(|m| m["executable"].as_str().map(PathBuf::from))
            .next_back()
            .expect("cargo reported no physalia executable")
    })
}

/// What one run of the CLI did.
#[derive(Debug)]
pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// Panics unless the run succeeded.
    #[track_caller]
    pub fn ok(self) -> Self {
        assert!(
            self.success(),
            "physalia failed ({:?}):\nstdout:\n{}\nstderr:\n{}",
            self.code,
            self.stdout,
            self.stderr
        );
        self
    }

    /// The last non-empty stdout line, parsed as JSON.
    #[track_caller]
    pub fn last_json(&self) -> Value {
        let line = self
            .stdout
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .expect("stdout is empty");
        serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("last stdout line is not JSON ({e}): {line}"))
    }

    /// Asserts the failure shape every error must have: exit code 1 and exactly one stderr line,
    /// starting with `error: `, containing every needle. Returns that line.
    #[track_caller]
    pub fn one_line_error(&self, needles: &[&str]) -> String {
        assert_eq!(
            self.code,
            Some(1),
            "expected exit code 1\nstdout:\n{}\nstderr:\n{}",
            self.stdout,
            self.stderr
        );
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(
            lines.len(),
            1,
            "expected exactly one stderr line, got:\n{}",
            self.stderr
        );
        let line = lines[0];
        assert!(
            line.starts_with("error: "),
            "stderr does not start with `error: `: {line}"
        );
        for n in needles {
            assert!(
                line.contains(n),
                "error line does not mention {n:?}: {line}"
            );
        }
        line.to_string()
    }
}

/// A chunked SBM written by `physalia data synth` into `cwd/out`: `nodes` nodes in 4 classes, `feat`
/// features, average degree `degree`, seed `seed`, `chunk_rows` rows a chunk (the cluster tests' dataset).
pub fn synth_chunked_sbm(
    cwd: &Path,
    out: &str,
    (nodes, feat, degree): (usize, usize, usize),
    seed: u64,
    chunk_rows: usize,
) {
    let [nodes, feat, degree, seed, rows] =
        [nodes, feat, degree, seed as usize, chunk_rows].map(|v| v.to_string());
    physalia(
        cwd,
        [
            "data",
            "synth",
            "sbm",
            "--nodes",
            &nodes,
            "--classes",
            "4",
            "--feat-dim",
            &feat,
            "--avg-degree",
            &degree,
            "--seed",
            &seed,
            "--layout",
            "chunked",
            "--chunk-rows",
            &rows,
            "-o",
            out,
        ],
    )
    .ok();
}

/// Runs `physalia args...` in `cwd`.
pub fn physalia<I, S>(cwd: &Path, args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let out = Command::new(physalia_bin())
        .current_dir(cwd)
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .output()
        .expect("spawning physalia");
    Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Every file and directory under `dir` (recursively, hidden ones included) with its bytes
/// (`None` for directories), for "nothing changed" assertions.
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Option<Vec<u8>>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Option<Vec<u8>>>) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for e in entries {
            let p = e.expect("read_dir entry").path();
            let rel = p.strip_prefix(root).unwrap().to_path_buf();
            if p.is_dir() {
                out.insert(rel, None);
                walk(root, &p, out);
            } else {
                out.insert(rel, Some(fs::read(&p).expect("reading a file")));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// Writes a small, valid generic-layout dataset folder: 8 nodes in two classes (a cycle plus chords),
/// 3 features as `features.json` + `features.bin` (float32), labels, and a 4/2/2 split.
pub fn write_tiny_generic(dir: &Path) {
    fs::create_dir_all(dir).unwrap();
    let n = 8;
    let f = 3;
    let mut edges = String::from("src,dst\n");
    for i in 0..n {
        edges.push_str(&format!("{},{}\n", i, (i + 1) % n));
    }
    edges.push_str("0,2\n1,3\n4,6\n5,7\n");
    fs::write(dir.join("edges.csv"), edges).unwrap();
    let mut bin = Vec::new();
    for i in 0..n {
        for j in 0..f {
            let v: f32 = if (i % 2) == (j % 2) {
                1.0
            } else {
                0.25 * j as f32
            };
            bin.extend_from_slice(&v.to_le_bytes());
        }
    }
    fs::write(dir.join("features.bin"), bin).unwrap();
    fs::write(
        dir.join("features.json"),
        format!(r#"{{"file": "features.bin", "num_nodes": {n}, "feat_dim": {f}, "dtype": "float32", "byte_order": "little"}}"#),
    )
    .unwrap();
    let mut labels = String::from("node,label\n");
    for i in 0..n {
        labels.push_str(&format!("{},{}\n", i, i % 2));
    }
    fs::write(dir.join("labels.csv"), labels).unwrap();
    fs::write(dir.join("train_idx.txt"), "0\n1\n2\n3\n").unwrap();
    fs::write(dir.join("val_idx.txt"), "4\n5\n").unwrap();
    fs::write(dir.join("test_idx.txt"), "6\n7\n").unwrap();
}

/// A parsed safetensors header: its length field and JSON.
pub struct Header {
    /// Value of the leading 8-byte little-endian length field.
    pub len: usize,
    pub json: Value,
}

impl Header {
    /// Byte range of tensor `name`'s data within the whole file.
    pub fn tensor_range(&self, name: &str) -> std::ops::Range<usize> {
        let t = &self.json[name];
        let off = t["data_offsets"]
            .as_array()
            .unwrap_or_else(|| panic!("no tensor {name} in header"));
        let (a, b) = (
            off[0].as_u64().unwrap() as usize,
            off[1].as_u64().unwrap() as usize,
        );
        8 + self.len + a..8 + self.len + b
    }

    /// Tensor names, sorted, without `__metadata__`.
    pub fn tensor_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .json
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| *k != "__metadata__")
            .cloned()
            .collect();
        v.sort();
        v
    }
}

/// Parses the header of the safetensors file `bytes`.
pub fn safetensors_header(bytes: &[u8]) -> Header {
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let json = serde_json::from_slice(&bytes[8..8 + len]).expect("safetensors header is JSON");
    Header { len, json }
}

/// Writes `text` to the new file `path` with permission bits `mode` from its creation on (a secret: 0400,
/// or 0500 for a credential process), never readable by others in between; fails if `path` exists.
pub fn secret_file(path: &Path, text: &str, mode: u32) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
    f.write_all(text.as_bytes())
        .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// Writes `text` as a job file `name` in `dir` and returns its path.
pub fn write_job(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, text).unwrap();
    p
}

/// The job directories directly under `root` (empty when `root` does not exist).
pub fn job_dirs(root: &Path) -> Vec<PathBuf> {
    let Ok(rd) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    v.sort();
    v
}

/// Lines of a job directory's `metrics.jsonl`, parsed.
pub fn metrics(job_dir: &Path) -> Vec<Value> {
    fs::read_to_string(job_dir.join("metrics.jsonl"))
        .expect("reading metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("metrics line is JSON"))
        .collect()
}

/// Checks job `dir`'s deltas offered ahead of their resize (the coordinator's "rank R fetches <name>"
/// lines, `ToWorker::Prefetch`): each offered before the resize that then took its count was fetched
/// ("prefetched <name>") or applied ("applied <name>": by a joiner while it waited, by a survivor
/// beside training) by its worker, and each applied one made the part its worker trained on next.
/// Returns how many were taken; timing decides which were offered in time, the check holds for all.
pub fn assert_deltas_taken_ahead(dir: &Path) -> usize {
    let coord = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    let mut workers_log = String::new();
    for e in std::fs::read_dir(dir.join("logs")).unwrap() {
        let e = e.unwrap();
        if e.file_name().to_string_lossy().starts_with("worker-") {
            workers_log.push_str(&std::fs::read_to_string(e.path()).unwrap());
        }
    }
    let lines: Vec<&str> = coord.lines().collect();
    let (mut ahead, mut applied) = (0, 0);
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = line
            .split(" fetches ")
            .nth(1)
            .filter(|_| line.contains("its delta for"))
            .and_then(|r| r.split_whitespace().next())
        else {
            continue;
        };
        // part-prep<L>-k<K>-<rank>: taken when the next resize after the offer goes to K workers
        let k = name
            .split("-k")
            .nth(1)
            .and_then(|r| r.split('-').next())
            .unwrap_or_else(|| panic!("{line}"));
        let next = lines[i..]
            .iter()
            .find(|l| l.contains("resizing in place after epoch"));
        if next.is_some_and(|l| l.contains(&format!("-> {k} workers"))) {
            assert!(
                workers_log.contains(&format!("prefetched {name} "))
                    || workers_log.contains(&format!("applied {name} ")),
                "{name} offered before its resize, not taken ahead:\n{coord}\n{workers_log}"
            );
            ahead += 1;
            applied += usize::from(workers_log.contains(&format!("applied {name} ")));
        }
    }
    // a delta applied ahead is the part its assignment trains on, with the engine's graph built beside
    // it (a part trained on without a pause before it, a lost peer's, builds its own)
    let made = workers_log.matches("made from its delta ahead").count();
    assert!(
        made >= applied,
        "{applied} deltas applied ahead, fewer parts made from them:\n{workers_log}"
    );
    assert_eq!(
        workers_log
            .matches("(the graph ahead, with the part)")
            .count(),
        made,
        "a part made from its delta ahead without its graph, or a graph without its part:\n{workers_log}"
    );
    ahead
}

/// Asserts that job `dir` resized in place at each `(from, to, epoch)` and at nothing else: the
/// coordinator's log says so once per resize, rank 0 registered once (one process from the first
/// epoch to the last) and went on from the state it held after each of those epochs.
pub fn assert_resized_in_place(dir: &Path, resizes: &[(usize, usize, usize)]) {
    let log = std::fs::read_to_string(dir.join("logs/coordinator.log")).unwrap();
    for (from, to, epoch) in resizes {
        assert!(
            log.contains(&format!(
                "in place, {from} -> {to} workers after epoch {epoch}"
            )),
            "{log}"
        );
    }
    assert_eq!(
        log.matches("in-place resize ready").count(),
        resizes.len(),
        "{log}"
    );
    assert_eq!(
        log.matches("worker 0 (pid").count(),
        1,
        "rank 0 registered once: {log}"
    );
    let rank0 = std::fs::read_to_string(dir.join("logs/worker-0.log")).unwrap();
    for (_, _, epoch) in resizes {
        assert!(
            rank0.contains(&format!("continuing in place after epoch {epoch}")),
            "{rank0}"
        );
    }
}

/// Reads a JSON file.
pub fn read_json(path: &Path) -> Value {
    let text =
        fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// `physalia image build ARGS` (the image's reference), one build at a time across test binaries: the
/// cloud end-to-end tests (ecs_job, kubernetes_job, aci_job) run the image as their workers and
/// coordinator.
pub fn build_image(args: &[&str]) -> String {
    let lock = fs::File::create(std::env::temp_dir().join("physalia-ecs-image.lock")).unwrap();
    lock.lock().unwrap();
    let out = Command::new(physalia_bin())
        .args(["image", "build"])
        .args(args)
        .output()
        .unwrap();
    drop(lock);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Runs a command that must succeed; its standard output and error.
pub fn ok_output(cmd: &mut Command) -> (String, String) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{:?} failed: {}",
        cmd.get_args().collect::<Vec<_>>(),
        String::from_utf8_lossy(&out.stderr)
    );
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The last line of `text` as JSON (the final line of `--output json`).
pub fn last_json(text: &str) -> Value {
    serde_json::from_str(text.lines().last().unwrap_or("null"))
        .unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// The per-epoch losses of a `metrics.jsonl`'s text.
pub fn losses(metrics: &str) -> Vec<f64> {
    metrics
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["metrics"]["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

/// Every epoch exactly once, each loss of `platform`'s run within `tol` (relative) of the local run's.
pub fn assert_same_losses(platform: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "every epoch exactly once");
    for (e, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * b.abs(),
            "epoch {}: {platform} {a}, local {b}",
            e + 1
        );
    }
}

/// The per-epoch losses of `job` (a job file's text without `output:`) trained by local processes in
/// `dir`, written there as `file`: the reference a cloud run of the same job must equal.
pub fn local_losses(dir: &Path, file: &str, job: &str) -> Vec<f64> {
    write_job(dir, file, &format!("{job}output: {{dir: jobs}}\n"));
    let (out, _) = ok_output(
        Command::new(physalia_bin())
            .current_dir(dir)
            .args(["submit", file, "-q", "--output", "json"]),
    );
    let job_dir = dir.join(last_json(&out)["job_dir"].as_str().unwrap());
    losses(&std::fs::read_to_string(job_dir.join("metrics.jsonl")).unwrap())
}

/// Polls `physalia status ID --dir STORE --output json` (run by `cli`, with the platform's environment)
/// until `done(state, last epoch)` holds, for at most 300 s; returns that state and epoch. A job whose
/// record cannot be read yet is `absent` at epoch 0.
pub fn wait_for_job(
    cli: &dyn Fn(&[&str]) -> Command,
    store: &str,
    id: &str,
    done: &dyn Fn(&str, u64) -> bool,
) -> (String, u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    loop {
        let out = cli(&["status", id, "--dir", store, "--output", "json"])
            .output()
            .unwrap();
        let (state, e) = if out.status.success() {
            let v: Value = serde_json::from_slice(&out.stdout).unwrap();
            (
                v["state"].as_str().unwrap_or("").to_string(),
                v["last_epoch"]["epoch"].as_u64().unwrap_or(0),
            )
        } else {
            ("absent".to_string(), 0)
        };
        if done(&state, e) {
            return (state, e);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "job {id}: still {state} at epoch {e}"
        );
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
}

/// The job id at the end of a job URL.
pub fn job_id(url: &str) -> String {
    url.rsplit('/').next().unwrap().to_string()
}

/// The bytes of a chunked dataset's files (every chunk of every tensor), from its manifest.
pub fn chunked_data_bytes(dataset: &Path) -> u64 {
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(dataset.join("manifest.json")).unwrap()).unwrap();
    manifest["tensors"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|t| t["chunks"].as_array().unwrap())
        .map(|c| c["bytes"].as_u64().unwrap())
        .sum()
}

/// The MiB of the dataset's files a worker read to cut its part with the others, from its log line
/// (`... read X MiB of the dataset's files ...`).
pub fn cut_read_mib(log: &str) -> f64 {
    log.split("read ")
        .nth(1)
        .and_then(|r| r.split(" MiB of the dataset's files").next())
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("no bytes read in {log}"))
}
