//! The job record's per-epoch line (`metrics.jsonl`), typed once: the coordinator and the single-worker
//! run write it, `submit --resume`, the scaling policy's replay and the report read it back, and a line
//! that does not parse is an error naming the file and line, never a silent default.

use std::path::Path;

use physalia_gnn::{EpochMetrics, ExchangeStats};
use serde::{Deserialize, Serialize};

/// What happened to a job after an epoch: a scaling policy's decision (with the rule that fired and the
/// values its condition saw), a retry, a resume; `summary.json`'s `scaling_events`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScalingEvent {
    /// The epoch after which it happened.
    pub epoch: usize,
    /// What happened, in words (`stop` when a policy stopped the job).
    pub event: String,
    /// The policy's rule that decided it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    /// The values the rule's condition saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub values: Option<serde_json::Value>,
}

/// One recorded epoch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsLine {
    /// Which of the job's runs (`train.runs` seeds one after another; a coordinated job has run 0 only).
    pub run: u64,
    pub seed: u64,
    /// Rank 0's metrics (loss and accuracies are global; `exchange` is rank 0's).
    pub metrics: EpochMetrics,
    /// Every worker's share of the epoch, by rank (empty for a single in-process worker).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workers: Vec<WorkerLine>,
    /// What the epoch cost: every worker's seconds times its price.
    #[serde(default)]
    pub usd: f64,
}

/// One worker's share of a recorded epoch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerLine {
    pub rank: usize,
    pub train_s: f64,
    pub exchange: ExchangeStats,
}

impl MetricsLine {
    /// The line of a coordinated epoch, from every worker's metrics by rank.
    pub fn coordinated(seed: u64, by_rank: &[EpochMetrics], usd: f64) -> MetricsLine {
        MetricsLine {
            run: 0,
            seed,
            metrics: by_rank[0].clone(),
            workers: by_rank
                .iter()
                .enumerate()
                .map(|(rank, m)| WorkerLine {
                    rank,
                    train_s: m.train_s,
                    exchange: m.exchange.clone(),
                })
                .collect(),
            usd,
        }
    }

    /// Workers that trained this epoch.
    pub fn worker_count(&self) -> usize {
        self.workers.len().max(1)
    }

    /// Every worker's metrics by rank: rank 0's global metrics with each worker's own time and exchange.
    pub fn by_rank(&self) -> Vec<EpochMetrics> {
        if self.workers.is_empty() {
            return vec![self.metrics.clone()];
        }
        self.workers
            .iter()
            .map(|w| {
                let mut m = self.metrics.clone();
                m.train_s = w.train_s;
                m.exchange = w.exchange.clone();
                m
            })
            .collect()
    }

    /// Every line of a `metrics.jsonl` file; blank lines are skipped, anything else that is not a metrics
    /// line is an error naming the file and line.
    pub fn read_all(path: &Path) -> Result<Vec<MetricsLine>, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        MetricsLine::parse_all(&text, &path.display().to_string())
    }

    /// [`MetricsLine::read_all`] on text already read; `name` is the file's name for errors.
    pub fn parse_all(text: &str, name: &str) -> Result<Vec<MetricsLine>, String> {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                serde_json::from_str(l)
                    .map_err(|e| format!("{name}:{}: not a metrics line: {e}", i + 1))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(epoch: usize, train_s: f64, sent: u64) -> EpochMetrics {
        EpochMetrics {
            epoch,
            loss: 1.0 / epoch as f64,
            train_acc: None,
            val_acc: Some(0.5),
            test_acc: None,
            train_s,
            eval_s: 0.01,
            exchange: ExchangeStats {
                bytes_sent: sent,
                ..Default::default()
            },
            batches: None,
            device: None,
        }
    }

    #[test]
    fn a_coordinated_line_round_trips_and_gives_back_every_rank() {
        let by_rank = vec![metrics(3, 0.5, 10), metrics(3, 0.7, 20)];
        let line = MetricsLine::coordinated(7, &by_rank, 0.25);
        let text = serde_json::to_string(&line).unwrap();
        let back = MetricsLine::parse_all(&format!("{text}\n\n{text}\n"), "m").unwrap();
        assert_eq!(back, vec![line.clone(), line.clone()]);
        assert_eq!(line.worker_count(), 2);
        assert_eq!(line.by_rank(), by_rank);
    }

    #[test]
    fn a_bad_line_names_the_file_and_line() {
        let good = serde_json::to_string(&MetricsLine::coordinated(0, &[metrics(1, 0.1, 0)], 0.0))
            .unwrap();
        let e =
            MetricsLine::parse_all(&format!("{good}\n{{\"run\": 0}}\n"), "jobs/x/metrics.jsonl")
                .unwrap_err();
        assert!(
            e.starts_with("jobs/x/metrics.jsonl:2: not a metrics line"),
            "{e}"
        );
    }
}

/// How often a running coordinator rewrites `status.json` (its heartbeat), at most.
pub const HEARTBEAT_S: f64 = 5.0;

/// `status.json`: what a job is doing, as its coordinator last wrote it (whole files, renamed into
/// place). A running coordinator rewrites it at least every [`HEARTBEAT_S`] seconds, so a reader can tell
/// a job that runs from one whose coordinator died (`running`, but silent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobStatus {
    pub state: JobState,
    /// Why a failed job failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The platform (`local`, `docker`, ...). Absent in records of older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Epochs recorded in `metrics.jsonl`, of `epochs`.
    #[serde(default)]
    pub epoch: usize,
    #[serde(default)]
    pub epochs: usize,
    /// Workers of the launch that trains now (0 between launches).
    #[serde(default)]
    pub workers: usize,
    /// The bill so far (USD).
    #[serde(default)]
    pub usd: f64,
    /// Unix seconds: when the coordinator started, and when it last wrote this.
    #[serde(default)]
    pub started_unix_s: f64,
    #[serde(default)]
    pub updated_unix_s: f64,
    /// Where the coordinator runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator: Option<CoordinatorRef>,
    /// The launches (segments) that may have workers running; with the job's id (its directory's name)
    /// they are the backend's launch ids: what `physalia cancel` stops when the coordinator is gone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub launches: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Running,
    Succeeded,
    Failed,
    /// Stopped by `physalia cancel`.
    Cancelled,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    /// The job will not change any more.
    pub fn is_final(self) -> bool {
        self != JobState::Running
    }
}

/// The process that coordinates a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoordinatorRef {
    /// The host's name (`/proc/sys/kernel/hostname`).
    pub host: String,
    pub pid: u32,
}

impl CoordinatorRef {
    /// This process.
    pub fn this_process() -> CoordinatorRef {
        CoordinatorRef {
            host: host_name(),
            pid: std::process::id(),
        }
    }

    /// Whether the process is known to be gone: it ran on this host and no process with its id is
    /// alive. `false` where that cannot be told (another host).
    pub fn is_gone_here(&self) -> bool {
        self.host == host_name() && !Path::new(&format!("/proc/{}", self.pid)).exists()
    }
}

/// This machine's name, or `localhost` where it cannot be read.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl JobStatus {
    /// A job that starts now on `backend`, coordinated by this process.
    pub fn starting(backend: &str, epoch: usize, epochs: usize) -> JobStatus {
        let now = unix_now();
        JobStatus {
            state: JobState::Running,
            error: None,
            backend: Some(backend.to_string()),
            epoch,
            epochs,
            workers: 0,
            usd: 0.0,
            started_unix_s: now,
            updated_unix_s: now,
            coordinator: Some(CoordinatorRef::this_process()),
            launches: Vec::new(),
        }
    }

    /// Reads `status.json`; an unreadable or malformed file is an error naming it.
    pub fn read(path: &Path) -> Result<JobStatus, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
        serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a job status: {e}", path.display()))
    }
}
