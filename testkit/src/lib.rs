//! Dev-only helpers shared by the workspace's tests (`tests/`, `backends/tests/`, `coordinator/tests/`):
//! one spawner for the Python emulators the tests run against, and a way to ask them (or boto3)
//! something from a test.
//!
//! Every emulator speaks one protocol: it binds a free port itself (port 0) and prints one JSON line
//! saying where it listens (and what it seeded) once it is ready; it serves until its standard input
//! closes, then removes what it made (containers, volumes, Docker networks). [`Spawn`] starts one,
//! skipping the test (with a note) where what it needs is absent, waits for that line, and gives an
//! [`Emulator`] that stops it on drop; its standard error (and anything it prints after the first
//! line) is kept in a file and shown when the test fails, or as it goes with `PHYSALIA_EMULATOR_LOG=1`.
//!
//! `PHYSALIA_REQUIRE_MOTO` (set, and neither empty nor `0`; CI sets it to `1`) makes a missing Python
//! package fail the test instead of skipping it. A missing Docker Engine, or root for the fakes that
//! bind a fixed address, still skips.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The workspace root: every emulator's script is named relative to it.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit/ has a parent")
        .to_path_buf()
}

/// Whether a missing Python package fails the test (`PHYSALIA_REQUIRE_MOTO`).
pub fn python_required() -> bool {
    std::env::var("PHYSALIA_REQUIRE_MOTO").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Whether a Docker Engine answers.
pub fn docker_answers() -> bool {
    Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// How to start one emulator: `Spawn::new("tests/ecs/ecs_agent.py").args(..).python(..).docker()`.
#[derive(Debug, Clone)]
pub struct Spawn {
    script: PathBuf,
    args: Vec<String>,
    modules: Vec<String>,
    install: String,
    docker: bool,
    root: Option<String>,
    ready_within: Duration,
    stop_within: Duration,
}

impl Spawn {
    /// The emulator `script`, a path relative to the workspace root.
    pub fn new(script: &str) -> Spawn {
        Spawn {
            script: repo_root().join(script),
            args: Vec::new(),
            modules: Vec::new(),
            install: "pip install 'moto[server]==5.2.1'".to_string(),
            docker: false,
            root: None,
            ready_within: Duration::from_secs(180),
            stop_within: Duration::from_secs(120),
        }
    }

    /// Its command-line arguments.
    pub fn args<S: AsRef<str>>(mut self, args: &[S]) -> Spawn {
        self.args
            .extend(args.iter().map(|a| a.as_ref().to_string()));
        self
    }

    /// The Python modules it imports beyond the standard library (`moto.server`, `boto3`,
    /// `cryptography`): without them the test skips, or fails where they are required.
    pub fn python(mut self, modules: &[&str]) -> Spawn {
        self.modules.extend(modules.iter().map(|m| m.to_string()));
        self
    }

    /// It runs containers: without a Docker Engine the test skips.
    pub fn docker(mut self) -> Spawn {
        self.docker = true;
        self
    }

    /// It needs root (`why`): elsewhere the test skips.
    pub fn root(mut self, why: &str) -> Spawn {
        self.root = Some(why.to_string());
        self
    }

    /// What it needs, or why it cannot run here (`None`: it can). Panics where a required Python
    /// package is missing.
    fn missing(&self) -> Option<String> {
        if self.docker && !docker_answers() {
            return Some("no Docker Engine answers".into());
        }
        if let Some(why) = &self.root {
            let root = Command::new("id")
                .arg("-u")
                .output()
                .is_ok_and(|o| o.stdout.trim_ascii() == b"0");
            if !root {
                return Some(format!("{why}, which needs root"));
            }
        }
        if !self.modules.is_empty() {
            let have = Command::new("python3")
                .args(["-c", &format!("import {}", self.modules.join(", "))])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !have {
                let why = format!(
                    "python3 cannot import {} ({})",
                    self.modules.join(", "),
                    self.install
                );
                assert!(!python_required(), "PHYSALIA_REQUIRE_MOTO is set but {why}");
                return Some(why);
            }
        }
        None
    }

    /// Starts it and waits for its line: `None` (and a note) where it cannot run here.
    pub fn start(self) -> Option<Emulator> {
        let name = self
            .script
            .file_name()
            .map_or_else(|| "emulator".into(), |n| n.to_string_lossy().into_owned());
        if let Some(why) = self.missing() {
            eprintln!("skipping: {why} ({name})");
            return None;
        }
        let live = std::env::var("PHYSALIA_EMULATOR_LOG").is_ok_and(|v| v == "1");
        let log = tempfile::NamedTempFile::new().expect("a file for the emulator's log");
        // both writers append: the emulator's standard error, and its later output below
        let append = || {
            std::fs::OpenOptions::new()
                .append(true)
                .open(log.path())
                .expect("opening the emulator's log")
        };
        let stderr = if live {
            Stdio::inherit()
        } else {
            Stdio::from(append())
        };
        let mut child = Command::new("python3")
            .arg(&self.script)
            .args(&self.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", self.script.display()));
        let stdout = child.stdout.take().unwrap();
        let mut rest = append();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout);
            let mut first = String::new();
            let n = lines.read_line(&mut first).unwrap_or(0);
            let _ = tx.send((n, first));
            // what it prints later joins its log (a closed pipe would fail its next print)
            for line in lines.lines().map_while(Result::ok) {
                let _ = writeln!(rest, "[stdout] {line}");
            }
        });
        let mut emulator = Emulator {
            name,
            child,
            stdin: None,
            info: Value::Null,
            log,
            log_shown: false,
            stop_within: self.stop_within,
        };
        emulator.stdin = emulator.child.stdin.take();
        let line = match rx.recv_timeout(self.ready_within) {
            Ok((n, line)) if n > 0 => line,
            Ok(_) => emulator.fail("exited before it was ready"),
            Err(_) => emulator.fail(&format!("not ready within {:?}", self.ready_within)),
        };
        emulator.info = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => emulator.fail(&format!("said {line:?}, not JSON: {e}")),
        };
        Some(emulator)
    }
}

/// A running emulator: what it said when ready, and its log. Dropping it closes its standard input
/// and waits for it to clean up (killing it after a while).
#[derive(Debug)]
pub struct Emulator {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    info: Value,
    log: tempfile::NamedTempFile,
    /// The log was shown already (in a failure's message).
    log_shown: bool,
    stop_within: Duration,
}

impl Emulator {
    /// Its ready line.
    pub fn info(&self) -> &Value {
        &self.info
    }

    /// A string field of its ready line.
    #[track_caller]
    pub fn str(&self, key: &str) -> &str {
        self.info[key]
            .as_str()
            .unwrap_or_else(|| panic!("{} said no {key}: {}", self.name, self.info))
    }

    /// What it wrote to its standard error so far (and its standard output after the ready line).
    pub fn log(&self) -> String {
        let mut text = String::new();
        if let Ok(mut f) = self.log.reopen() {
            let _ = f.read_to_string(&mut text);
        }
        text
    }

    /// Fails the test saying what went wrong, with the emulator's log.
    #[track_caller]
    fn fail(&mut self, what: &str) -> ! {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.log_shown = true;
        panic!("{} {what}; its log:\n{}", self.name, tail(&self.log(), 200));
    }
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

impl Drop for Emulator {
    fn drop(&mut self) {
        if std::thread::panicking() && !self.log_shown {
            eprintln!(
                "--- {}'s log (last 200 lines) ---\n{}\n--- end of {}'s log ---",
                self.name,
                tail(&self.log(), 200),
                self.name
            );
        }
        // closing its standard input stops it, and it removes what it made
        drop(self.stdin.take());
        let deadline = Instant::now() + self.stop_within;
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!(
            "{} did not stop within {:?}: killed",
            self.name, self.stop_within
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `code` with `python3 -c` (its lines after the first lose the indentation they share, so a
/// Rust string literal may indent them) and returns its last line of output as JSON; fails the test
/// with its standard error unless it succeeds.
#[track_caller]
pub fn python(code: &str) -> Value {
    let out = Command::new("python3")
        .args(["-c", &dedent(code)])
        .output()
        .expect("running python3");
    assert!(
        out.status.success(),
        "python3 failed: {}\n{code}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or("null");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("python3 printed {last:?}: {e}"))
}

/// `code` without the indentation its lines after the first share (the first follows the literal's
/// quote).
pub fn dedent(code: &str) -> String {
    let mut lines = code.lines();
    let first = lines.next().unwrap_or("");
    let rest: Vec<&str> = lines.collect();
    let indent = rest
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    std::iter::once(first.to_string())
        .chain(
            rest.iter()
                .map(|l| l.get(indent..).unwrap_or("").to_string()),
        )
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dedent_keeps_the_first_line_and_relative_indentation() {
        assert_eq!(
            dedent("a = 1\n    if a:\n        print(a)\n"),
            "a = 1\nif a:\n    print(a)"
        );
    }

    #[test]
    fn an_emulator_that_dies_before_its_line_fails_with_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("dies.py");
        std::fs::write(
            &script,
            "import sys\nsys.stderr.write('no port for you\\n')\nsys.exit(3)\n",
        )
        .unwrap();
        let spawn = Spawn::new(script.to_str().unwrap());
        let err = std::panic::catch_unwind(|| spawn.start()).unwrap_err();
        let msg = err.downcast_ref::<String>().unwrap();
        assert!(msg.contains("exited before it was ready"), "{msg}");
        assert!(msg.contains("no port for you"), "{msg}");
    }

    #[test]
    fn an_emulator_says_its_line_and_stops_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("serves.py");
        std::fs::write(
            &script,
            "import json, sys\nprint(json.dumps({'port': 1234}), flush=True)\nsys.stdin.read()\nprint('bye')\n",
        )
        .unwrap();
        let e = Spawn::new(script.to_str().unwrap()).start().unwrap();
        assert_eq!(e.info()["port"], 1234);
        let t0 = Instant::now();
        drop(e);
        assert!(t0.elapsed() < Duration::from_secs(10));
    }
}
