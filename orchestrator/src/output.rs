//! How the CLI shows a job: the output format, the terminal [`Observer`] the drivers report to (bars,
//! `--quiet`, the HTML report), and the final lines of a finished job.

use std::path::{Path, PathBuf};

use anyhow::Result;
use physalia_coordinator::driver::summary::{Summary, fmt_acc, fmt_bytes};
use physalia_coordinator::driver::{Finished, Observer, Progress};
use serde_json::Value;

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
    let v: &Value = job.summary;
    match output {
        OutputFormat::Json => println!("{}", serde_json::to_string(v)?),
        OutputFormat::Text => {
            println!("job {} {}: {}", job.name, finished_on(v), job.location);
            println!(
                "final loss {:.4}, test at best val {}, median epoch {:.4}s, {} exchanged",
                v["runs"][0]["final_loss"].as_f64().unwrap_or(f64::NAN),
                v["runs"][0]["test_acc_at_best_val"]
                    .as_f64()
                    .map(|a| format!("{a:.4}"))
                    .unwrap_or("-".into()),
                v["median_epoch_s"].as_f64().unwrap_or(0.0),
                fmt_bytes(v["bytes_exchanged"].as_u64().unwrap_or(0))
            );
            if v["coordinator_usd_per_s"].as_f64().unwrap_or(0.0) > 0.0 {
                println!(
                    "billed ${:.6}: {:.1} worker-seconds and {:.1} coordinator-seconds",
                    v["usd_total"].as_f64().unwrap_or(0.0),
                    v["worker_seconds"].as_f64().unwrap_or(0.0),
                    v["coordinator_seconds"].as_f64().unwrap_or(0.0)
                );
            }
            if let Some(d) = v["device"].as_str() {
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

/// The final line's "finished on 4 workers (1-4 during the job)" from a coordinated job's summary: the
/// workers of the last launch, and the range its recorded epochs used when it changed.
pub fn finished_on(v: &serde_json::Value) -> String {
    let workers = v["workers"].as_u64().unwrap_or(0);
    let mut line = format!(
        "finished on {workers} worker{}",
        if workers == 1 { "" } else { "s" }
    );
    if let (Some(lo), Some(hi)) = (
        v["workers_range"][0].as_u64(),
        v["workers_range"][1].as_u64(),
    ) && lo != hi
    {
        line.push_str(&format!(" ({lo}-{hi} during the job)"));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::finished_on;
    use serde_json::json;

    #[test]
    fn the_final_line_names_the_last_workers_and_the_range_used() {
        let line = |v| finished_on(&v);
        assert_eq!(
            line(json!({"workers": 4, "workers_range": [1, 4]})),
            "finished on 4 workers (1-4 during the job)"
        );
        assert_eq!(
            line(json!({"workers": 2, "workers_range": [2, 4]})),
            "finished on 2 workers (2-4 during the job)"
        );
        assert_eq!(
            line(json!({"workers": 1, "workers_range": [1, 1]})),
            "finished on 1 worker"
        );
        assert_eq!(line(json!({"workers": 3})), "finished on 3 workers");
    }
}
