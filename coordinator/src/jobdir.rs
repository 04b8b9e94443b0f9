//! The job directory: the record of one submitted job.
//!
//! Layout: `job.json` (the resolved job spec), `status.json` (`physalia_control::JobStatus`: running,
//! succeeded, failed with the error, or cancelled; rewritten by a running coordinator at least every
//! `HEARTBEAT_S` seconds), `metrics.jsonl` (one line per epoch, flushed as it happens), `model.safetensors`
//! and `summary.json` (written when training ends), `cancel` (a request from `physalia cancel`, which the
//! coordinator acts on). Whole files are written to a temporary name and renamed, so a reader never sees
//! half a file.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use std::time::Instant;

use anyhow::{Context, Result};
use physalia_control::{HEARTBEAT_S, JobState, JobStatus};
use serde::Serialize;

/// The file `physalia cancel` writes to ask the job's coordinator to stop.
pub const CANCEL_FILE: &str = "cancel";

/// A job stopped because `physalia cancel` asked.
#[derive(Debug, thiserror::Error)]
#[error("cancelled by `physalia cancel`")]
pub struct Cancelled;

/// Claims the job id (the directory's name) on this machine: job ids name platform objects (the docker
/// backend's network and container labels, which `cancel` and cleanup select by), so two jobs of one name
/// started in the same second under different `output.dir`s must not share one. The claim is an empty
/// file in the temporary folder, made with `create_new`; where that folder is unusable the claim is
/// skipped (ids stay unique under their root).
fn reserve_id(dir: &Path) -> bool {
    let Some(id) = dir.file_name() else {
        return true;
    };
    let claims = std::env::temp_dir().join("physalia-job-ids");
    if fs::create_dir_all(&claims).is_err() {
        return true;
    }
    match OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(claims.join(id))
    {
        Ok(_) => true,
        Err(e) => e.kind() != std::io::ErrorKind::AlreadyExists,
    }
}

pub struct JobDir {
    path: PathBuf,
    metrics: File,
    /// What `status.json` says, and when it was last written.
    status: Option<(JobStatus, Instant)>,
}

impl JobDir {
    /// Creates `<root>/<name>-<unix seconds>[-k]`, never reusing an existing directory.
    pub fn create(root: &Path, name: &str) -> Result<JobDir> {
        fs::create_dir_all(root)
            .with_context(|| format!("output.dir: creating {}", root.display()))?;
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let safe: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let mut k = 0;
        let path = loop {
            let p = if k == 0 {
                root.join(format!("{safe}-{secs}"))
            } else {
                root.join(format!("{safe}-{secs}-{k}"))
            };
            match fs::create_dir(&p) {
                Ok(()) if reserve_id(&p) => break p,
                // another job of this name started this second under another output.dir on this
                // machine: its platform objects (docker network, labels) would be shared with ours
                Ok(()) => {
                    let _ = fs::remove_dir(&p);
                    k += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => k += 1,
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("creating job directory {}", p.display()));
                }
            }
        };
        let metrics_path = path.join("metrics.jsonl");
        let metrics = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&metrics_path)
            .with_context(|| format!("creating {}", metrics_path.display()))?;
        Ok(JobDir {
            path,
            metrics,
            status: None,
        })
    }

    /// Creates `<root>/<id>` for a job whose id was chosen elsewhere (a cluster-mode coordinator stages
    /// the job `submit` named); an existing directory of that id is an error.
    pub fn create_exact(root: &Path, id: &str) -> Result<JobDir> {
        fs::create_dir_all(root)
            .with_context(|| format!("creating the staging folder {}", root.display()))?;
        let path = root.join(id);
        fs::create_dir(&path)
            .with_context(|| format!("creating job directory {}", path.display()))?;
        let metrics_path = path.join("metrics.jsonl");
        let metrics = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&metrics_path)
            .with_context(|| format!("creating {}", metrics_path.display()))?;
        Ok(JobDir {
            path,
            metrics,
            status: None,
        })
    }

    /// Reopens an existing job directory to continue it, keeping `metrics.jsonl`'s first `keep` lines (the
    /// epochs its checkpoint covers; later lines were recorded after it and are retrained).
    pub fn reopen(path: &Path, keep: usize) -> Result<JobDir> {
        let metrics_path = path.join("metrics.jsonl");
        let text = fs::read_to_string(&metrics_path)
            .with_context(|| format!("{}: not a job directory", path.display()))?;
        let kept: String = text.lines().take(keep).map(|l| format!("{l}\n")).collect();
        write_atomic(&metrics_path, kept.as_bytes())?;
        let metrics = OpenOptions::new()
            .append(true)
            .open(&metrics_path)
            .with_context(|| format!("opening {}", metrics_path.display()))?;
        Ok(JobDir {
            path: path.to_path_buf(),
            metrics,
            status: None,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn append_metrics(&mut self, line: &physalia_control::MetricsLine) -> Result<()> {
        let mut s = serde_json::to_string(line)?;
        s.push('\n');
        self.metrics
            .write_all(s.as_bytes())
            .context("appending to metrics.jsonl")?;
        self.metrics.flush()?;
        Ok(())
    }

    /// Records that this process now coordinates the job (on `backend`, `epoch` of `epochs` recorded),
    /// and clears a cancel request left by an earlier coordinator of it.
    pub fn begin(&mut self, backend: &str, epoch: usize, epochs: usize) -> Result<()> {
        let _ = fs::remove_file(self.path.join(CANCEL_FILE));
        self.status = Some((JobStatus::starting(backend, epoch, epochs), Instant::now()));
        self.write_status()
    }

    /// Changes the status and writes it.
    pub fn update(&mut self, f: impl FnOnce(&mut JobStatus)) -> Result<()> {
        if let Some((status, _)) = &mut self.status {
            f(status);
        }
        self.write_status()
    }

    /// Changes the status and rewrites it when it is older than the heartbeat, so readers see the
    /// coordinator alive.
    pub fn update_if_stale(&mut self, f: impl FnOnce(&mut JobStatus)) -> Result<()> {
        match &mut self.status {
            Some((status, at)) if at.elapsed().as_secs_f64() >= HEARTBEAT_S => {
                f(status);
                self.write_status()
            }
            _ => Ok(()),
        }
    }

    /// The job's last status: it will not change any more.
    pub fn end(&mut self, state: JobState, error: Option<String>) -> Result<()> {
        self.update(|s| {
            s.state = state;
            s.error = error;
            s.workers = 0;
            s.launches.clear();
        })
    }

    /// Whether `physalia cancel` asked this job to stop.
    pub fn cancel_requested(&self) -> bool {
        self.path.join(CANCEL_FILE).exists()
    }

    fn write_status(&mut self) -> Result<()> {
        let Some((status, at)) = &mut self.status else {
            return Ok(());
        };
        status.updated_unix_s = physalia_control::record::unix_now();
        *at = Instant::now();
        let status = status.clone();
        self.write_json("status.json", &status)
    }

    pub fn write_json(&self, name: &str, value: &impl Serialize) -> Result<()> {
        write_json(&self.path.join(name), value)
    }
}

/// `value` as pretty JSON, whole or not at all.
pub fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let mut bytes = serde_json::to_vec_pretty(value)?;
    bytes.push(b'\n');
    write_atomic(path, &bytes)
}

pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    let mut f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.sync_all()?;
    fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seconds(dir: &Path) -> String {
        let id = dir.file_name().unwrap().to_string_lossy().to_string();
        id.split('-').nth(1).unwrap().to_string()
    }

    #[test]
    fn two_roots_never_hand_out_one_job_id() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        // a unique name, so that no other test's claim interferes
        let name = format!("idtest{}", std::process::id());
        loop {
            let x = JobDir::create(a.path(), &name).unwrap();
            let y = JobDir::create(b.path(), &name).unwrap();
            let (x, y) = (x.path().to_path_buf(), y.path().to_path_buf());
            if seconds(&x) != seconds(&y) {
                continue; // the second ticked between them: try again within one second
            }
            assert_ne!(x.file_name(), y.file_name());
            break;
        }
    }
}
