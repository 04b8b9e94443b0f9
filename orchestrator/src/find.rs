//! Finding a job's directory on this machine: a path to one, its directory name, or its name (the
//! newest of that name) under a root folder. `status`, `logs`, `cancel`, `list` and `report` name jobs
//! this way.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use physalia_control::JobStatus;

/// A job's id: its directory's name.
pub(crate) fn job_id(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string())
}

/// Whether `dir` holds a job record.
fn is_job_dir(dir: &Path) -> bool {
    dir.join("job.json").is_file() && dir.join("status.json").is_file()
}

/// The job directory `job` names: a path to one, a directory name under `root`, or a job name under
/// `root` (its newest job).
pub(crate) fn resolve(job: &str, root: &Path) -> Result<PathBuf> {
    let as_path = Path::new(job);
    if is_job_dir(as_path) {
        return Ok(as_path.to_path_buf());
    }
    let under = root.join(job);
    if is_job_dir(&under) {
        return Ok(under);
    }
    // `<name>-<unix seconds>[-k]`: the newest of that name
    let newest = job_dirs(root)
        .into_iter()
        .filter(|d| {
            let id = job_id(d);
            id.strip_prefix(job)
                .and_then(|rest| rest.strip_prefix('-'))
                .is_some_and(|rest| rest.split('-').all(|p| p.parse::<u64>().is_ok()))
        })
        .max_by_key(|d| started(d));
    match newest {
        Some(d) => Ok(d),
        None if as_path.exists() => {
            bail!("{job}: not a job directory (no job.json and status.json)")
        }
        None => bail!(
            "{job}: no such job (neither a job directory nor a job under {}; `physalia list --dir DIR` \
             shows the jobs of another folder)",
            root.display()
        ),
    }
}

pub(crate) fn job_dirs(root: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| is_job_dir(p))
        .collect()
}

/// Unix seconds the job started (0 where its status does not say).
fn started(dir: &Path) -> (u64, String) {
    let s = JobStatus::read(&dir.join("status.json"))
        .map(|s| s.started_unix_s)
        .unwrap_or(0.0);
    (s as u64, job_id(dir))
}
