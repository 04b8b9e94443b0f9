//! The drivers: the IO edge that carries the sans-IO core's actions out (feature `driver`).
//!
//! A job runs in the order of these modules: [`dataset`] resolves its `dataset:` section, [`plan`] asks
//! the planner (a `goal:` applied, a job as written predicted, a running job replanned), [`admission`]
//! refuses what cannot fit this machine, [`distributed`] coordinates it (the [`crate::job::Job`] state
//! machine fed by the control server and the backend, its record in a [`crate::jobdir::JobDir`]),
//! [`platform`] is the registry that knows each platform (its backend, worker spec, addresses, release),
//! and [`workers`] starts and follows the workers through `physalia_backends`. [`cluster`] runs the same
//! coordinator on a platform and follows it from the submitting machine; [`image`] builds the images
//! containers run; [`summary`] is what every job reports.
//!
//! Nothing here prints. What a person following the job should see goes to the [`Observer`] the caller
//! passes: the `physalia` CLI draws it on the terminal (bars, `--quiet`, `--output json`, the HTML
//! report); [`Plain`] writes plain lines to standard error.

pub mod admission;
pub mod cluster;
pub mod dataset;
pub mod distributed;
pub mod image;
pub mod inplace;
pub mod memory;
pub mod partitions;
pub mod plan;
pub mod platform;
pub mod resolved;
pub mod summary;
pub mod workers;

use std::path::{Path, PathBuf};

use anyhow::Result;

/// Where a driver reports what happens, and how the caller shows it.
pub trait Observer: Sync {
    /// What happens as the job runs: epoch lines, scaling events, a coordinator starting, a dataset
    /// uploaded. The CLI prints them on standard error unless `--quiet`.
    fn progress(&self, line: &str);
    /// What must be seen even with `--quiet`: warnings (the job goes on), a detach.
    fn notice(&self, line: &str);
    /// A step that takes a while begins ("partitioning into 4 parts"); it ends when the guard drops.
    fn step(&self, what: &str) -> Box<dyn Progress>;
    /// A transfer of `total` bytes begins ("importing the runtime base"); advanced through the guard.
    fn transfer(&self, what: &str, total: u64) -> Box<dyn Progress>;
    /// Renders the finished job's report (a view of its record `job_dir`) into `job_dir/report.html`;
    /// `None` where this observer renders none.
    fn write_report(&self, job_dir: &Path) -> Result<Option<PathBuf>>;
    /// A job ended well: its final lines.
    fn finished(&self, job: &Finished<'_>) -> Result<()>;
    /// A cluster-mode job runs on its platform and this process leaves it (`--detach`).
    fn detached(&self, job_id: &str, job_url: &str) -> Result<()>;
}

/// A step or transfer under way: dropped when it ends.
pub trait Progress {
    /// `bytes` more of a transfer are done.
    fn advance(&self, _bytes: u64) {}
}

/// A finished job as its final lines show it.
pub struct Finished<'a> {
    pub name: &'a str,
    /// `summary.json`.
    pub summary: &'a physalia_control::JobSummary,
    /// Where its record is: a folder, or a URL in a job store.
    pub location: &'a str,
    /// Its report, where one was written (in the record's store when it has one).
    pub report: Option<&'a str>,
}

/// Runs `f` as the step `what` of `obs`.
pub fn step<T>(obs: &dyn Observer, what: &str, f: impl FnOnce() -> T) -> T {
    let _step = obs.step(what);
    f()
}

/// An observer writing plain lines to standard error and nothing else: no bars, no report, the final
/// summary as one JSON line on standard output.
pub struct Plain {
    pub quiet: bool,
}

struct Silent;
impl Progress for Silent {}

impl Observer for Plain {
    fn progress(&self, line: &str) {
        if !self.quiet {
            eprintln!("{line}");
        }
    }
    fn notice(&self, line: &str) {
        eprintln!("{line}");
    }
    fn step(&self, _what: &str) -> Box<dyn Progress> {
        Box::new(Silent)
    }
    fn transfer(&self, _what: &str, _total: u64) -> Box<dyn Progress> {
        Box::new(Silent)
    }
    fn write_report(&self, _job_dir: &Path) -> Result<Option<PathBuf>> {
        Ok(None)
    }
    fn finished(&self, job: &Finished<'_>) -> Result<()> {
        println!("{}", serde_json::to_string(job.summary)?);
        Ok(())
    }
    fn detached(&self, job_id: &str, job_url: &str) -> Result<()> {
        println!(
            "{}",
            serde_json::json!({"job_id": job_id, "job_url": job_url, "state": "running"})
        );
        Ok(())
    }
}

/// A reader that advances `progress` by what it reads.
pub struct Counted<'a, R> {
    pub inner: R,
    pub progress: &'a dyn Progress,
}

impl<R: std::io::Read> std::io::Read for Counted<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.progress.advance(n as u64);
        Ok(n)
    }
}
