//! How the CLI shows a job: the output format, the terminal [`Observer`] the drivers report to (bars,
//! `--quiet`, the HTML report), and the final lines of a finished job.

use std::path::{Path, PathBuf};

use anyhow::Result;
use physalia_coordinator::driver::summary::{Summary, fmt_acc, fmt_bytes};
use physalia_coordinator::driver::{Finished, Observer, Progress};

/// How a command prints its result.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Text,
    /// A machine-readable summary as the last line of standard output.
    Json,
}

/// The drivers' observer on this terminal: progress on standard error (unless `quiet`), bars where
/// standard error is a terminal, the report rendered by [`crate::report`], final lines in `output`.
pub struct Terminal {
    pub output: OutputFormat,
    pub quiet: bool,
}

impl Terminal {
    pub fn new(output: OutputFormat, quiet: bool) -> Terminal {
        Terminal { output, quiet }
    }
}

/// A bar or spinner, cleared when the step ends.
struct Bar(indicatif::ProgressBar);

impl Progress for Bar {
    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

impl Observer for Terminal {
    fn progress(&self, line: &str) {
        if !self.quiet {
            eprintln!("{line}");
        }
    }
    fn notice(&self, line: &str) {
        eprintln!("{line}");
    }
    fn step(&self, what: &str) -> Box<dyn Progress> {
        Box::new(Bar(crate::progress::spinner(what)))
    }
    fn transfer(&self, what: &str, total: u64) -> Box<dyn Progress> {
        Box::new(Bar(crate::progress::bytes(what, total)))
    }
    fn write_report(&self, job_dir: &Path) -> Result<Option<PathBuf>> {
        let report = job_dir.join("report.html");
        crate::report::write(job_dir, &report)?;
        Ok(Some(report))
    }
    fn finished(&self, job: &Finished<'_>) -> Result<()> {
        print_finished(job, self.output)
    }
    fn detached(&self, job_id: &str, job_url: &str) -> Result<()> {
        match self.output {
            // the job's id and record, as the final line of a followed job names them
            OutputFormat::Json => println!(
                "{}",
                serde_json::json!({"job_id": job_id, "job_url": job_url, "state": "running"})
            ),
            OutputFormat::Text => println!("{job_id}"),
        }
        Ok(())
    }
}

/// A finished job's final lines (`summary.json` as JSON, or what it ran on, its loss and accuracy, its
/// report), the same whether this process coordinated it or followed it in a store.
pub fn print_finished(job: &Finished<'_>, output: OutputFormat) -> Result<()> {
    let s = job.summary;
    let c = s
        .coordinator_part("the final lines")
        .map_err(anyhow::Error::msg)?;
    match output {
        OutputFormat::Json => println!("{}", serde_json::to_string(s)?),
        OutputFormat::Text => {
            println!("job {} {}: {}", job.name, c.finished_on(), job.location);
            let run = s.run.runs.first();
            println!(
                "final loss {:.4}, test at best val {}, median epoch {:.4}s, {} exchanged",
                run.map_or(f64::NAN, |r| r.final_loss),
                run.and_then(|r| r.test_acc_at_best_val)
                    .map(|a| format!("{a:.4}"))
                    .unwrap_or("-".into()),
                s.run.median_epoch_s,
                fmt_bytes(c.bytes_exchanged)
            );
            if c.coordinator_usd_per_s > 0.0 {
                println!(
                    "billed ${:.6}: {:.1} worker-seconds and {:.1} coordinator-seconds",
                    s.run.usd_total, c.worker_seconds, c.coordinator_seconds
                );
            }
            if let Some(d) = &s.run.device {
                println!("rank 0 trained on {d}");
            }
            if let Some(r) = job.report {
                println!("report: {r}");
            }
        }
    }
    Ok(())
}

pub fn print_summary(s: &Summary, output: OutputFormat) -> Result<()> {
    match output {
        OutputFormat::Json => println!("{}", serde_json::to_string(s)?),
        OutputFormat::Text => {
            println!("job {} finished: {}", s.job, s.job_dir);
            if s.runs.len() > 1 {
                println!(
                    "test accuracy at best val over {} runs: {} +- {}",
                    s.runs.len(),
                    fmt_acc(s.mean_test_acc_at_best_val),
                    fmt_acc(s.std_test_acc_at_best_val)
                );
            } else if let Some(r) = s.runs.first() {
                println!(
                    "final: loss {:.4} train {} val {} test {}; best val {} at epoch {}, test there {}",
                    r.final_loss,
                    fmt_acc(r.final_train_acc),
                    fmt_acc(r.final_val_acc),
                    fmt_acc(r.final_test_acc),
                    fmt_acc(r.best_val_acc),
                    r.best_epoch.map(|e| e.to_string()).unwrap_or("-".into()),
                    fmt_acc(r.test_acc_at_best_val)
                );
            }
            println!(
                "median epoch {:.4}s, peak memory {}",
                s.median_epoch_s,
                s.peak_rss_bytes
                    .map(|b| format!("{:.1} MiB", b as f64 / (1 << 20) as f64))
                    .unwrap_or("unknown".into())
            );
            if let Some(d) = &s.device {
                println!("trained on {d}");
            }
        }
    }
    Ok(())
}
