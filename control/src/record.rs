//! The job record, typed once: its per-epoch line (`metrics.jsonl`), its status (`status.json`), its
//! scaling events and its summary (`summary.json`). The coordinator and the single-worker run write them;
//! `submit --resume`, the scaling policy's replay, `plan --replay`, `status`, `list` and the report read
//! them back through these types, and a record that does not parse is an error naming the file (and line),
//! never a silent default.

use std::path::Path;

use physalia_gnn::{EpochMetrics, ExchangeStats, ModelConfig};
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

/// `summary.json`: what every job reports ([`Summary`]) and, for a job the coordinator ran, what it
/// measured and billed over its launches ([`Coordinated`]; absent for repeated seeds trained in the
/// submitting process).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSummary {
    #[serde(flatten)]
    pub run: Summary,
    #[serde(flatten)]
    pub coordinated: Option<Coordinated>,
}

impl JobSummary {
    /// Reads `summary.json` at `path`; an error names the file.
    pub fn read(path: &Path) -> Result<JobSummary, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
        serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a job summary: {e}", path.display()))
    }

    /// The coordinator's part, or an error saying the job has none (`what` needs it).
    pub fn coordinator_part(&self, what: &str) -> Result<&Coordinated, String> {
        self.coordinated.as_ref().ok_or_else(|| {
            format!(
                "{what} needs a job the coordinator ran; {} ran in the submitting process (train.runs > 1)",
                self.run.job
            )
        })
    }
}

/// What every job reports, however it ran.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub job: String,
    pub job_dir: String,
    pub dataset: String,
    pub nodes: usize,
    pub edges: usize,
    pub model: ModelConfig,
    pub parameters: usize,
    pub epochs: u32,
    pub runs: Vec<RunSummary>,
    /// Over runs: mean and population standard deviation of the test accuracy at the best validation epoch.
    pub mean_test_acc_at_best_val: Option<f64>,
    pub std_test_acc_at_best_val: Option<f64>,
    pub mean_final_test_acc: Option<f64>,
    /// Median over all epochs of all runs of the training time per epoch (forward, backward, step).
    pub median_epoch_s: f64,
    /// Training time per epoch of the first run.
    pub epoch_times_s: Vec<f64>,
    pub load_s: f64,
    pub peak_rss_bytes: Option<u64>,
    /// Every worker's seconds times its container's price, over all runs; a coordinated job's bill
    /// (every launch's workers from start to stop, and the coordinator).
    pub usd_total: f64,
    /// The workers' container (a catalog SKU) and its price.
    pub sku: String,
    pub usd_per_worker_hour: f64,
    /// Rank 0's device when it is not the CPU that was asked for (a GPU, or the CPU a GPU job fell back to).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

/// One run (seed) of a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    pub seed: u64,
    pub final_epoch: usize,
    pub final_loss: f64,
    pub final_train_acc: Option<f64>,
    pub final_val_acc: Option<f64>,
    pub final_test_acc: Option<f64>,
    pub best_epoch: Option<usize>,
    pub best_val_acc: Option<f64>,
    pub test_acc_at_best_val: Option<f64>,
    pub stopped_early: bool,
    pub median_epoch_s: f64,
}

/// What the coordinator measured and billed over a job's launches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Coordinated {
    /// Workers of the last launch.
    pub workers: u32,
    pub bytes_exchanged: u64,
    /// Peak memory by rank of the launch that finished.
    pub worker_peak_rss_bytes: Vec<Option<u64>>,
    /// What the coordinator holds while its workers train (its peak was reached loading the dataset).
    pub coordinator_rss_bytes: Option<u64>,
    /// Worker-seconds billed (every launch, prewarmed and idle workers included).
    pub worker_seconds: f64,
    /// Seconds the coordinator was billed for, and its price.
    pub coordinator_seconds: f64,
    pub coordinator_usd_per_s: f64,
    pub scaling_events: Vec<ScalingEvent>,
    /// When each launch ran and each epoch ended: `plan --replay` fits its model to them.
    pub launches: Vec<LaunchSpan>,
    pub epoch_ends: Vec<EpochEnd>,
    pub workers_range: Option<[u32; 2]>,
    /// The record's URL when it is kept in a job store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_url: Option<String>,
    /// The partition set of each part count the job trained on, in the order first used.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<PartitionRecord>,
}

/// A partition set a job trained on: how it was made, its quality and what it cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartitionRecord {
    pub parts: usize,
    /// The method the set records (`metis`, `fennel-x20~0.001-lp8-il`, ...).
    pub method: String,
    /// Stored beside the dataset before the job (this job computed nothing).
    pub reused: bool,
    /// Why the job's partitioner, when this job computed the set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    pub edge_cut: usize,
    /// `edge_cut` over the graph's undirected edges.
    pub cut_fraction: f64,
    /// The largest part's nodes over the mean part's.
    pub balance: f64,
    /// Seconds of the node -> part assignment alone, and of the whole set (assignment, cutting and
    /// writing the parts), when it was computed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition_seconds: Option<f64>,
    pub compute_seconds: f64,
    /// Bytes of the dataset's files read to compute the set, by every process together (a chunked
    /// dataset's; absent for a file or a reused set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_read: Option<u64>,
}

impl Coordinated {
    /// "finished on 4 workers (1-4 during the job)": the workers of the last launch, and the range its
    /// recorded epochs used when it changed.
    pub fn finished_on(&self) -> String {
        let workers = self.workers;
        let mut line = format!(
            "finished on {workers} worker{}",
            if workers == 1 { "" } else { "s" }
        );
        if let Some([lo, hi]) = self.workers_range
            && lo != hi
        {
            line.push_str(&format!(" ({lo}-{hi} during the job)"));
        }
        line
    }
}

/// One launch of a job: its workers, from the platform's start to the job's stop (seconds since the
/// job started).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LaunchSpan {
    pub launch: usize,
    pub workers: usize,
    /// Started ahead of a relaunch (a policy's `prewarm`).
    pub prewarm: bool,
    /// Continues the launch before it, resized in place (issue 33): its survivors did not start again.
    #[serde(default)]
    pub in_place: bool,
    pub start_s: f64,
    /// `None` while it runs.
    pub stop_s: Option<f64>,
}

/// When every worker had reported an epoch (seconds since the job started).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochEnd {
    pub epoch: usize,
    pub end_s: f64,
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
    /// line is an error naming the file and line. A last line without its newline is one being appended
    /// (a reader can see the first page of a write before the rest) or one a killed coordinator left
    /// half-written; it is not a recorded epoch and is not read.
    pub fn read_all(path: &Path) -> Result<Vec<MetricsLine>, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        MetricsLine::parse_all(&text, &path.display().to_string())
    }

    /// [`MetricsLine::read_all`] on text already read; `name` is the file's name for errors.
    pub fn parse_all(text: &str, name: &str) -> Result<Vec<MetricsLine>, String> {
        let whole = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
        whole
            .lines()
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

    /// `summary.json` reads back as written, with and without the coordinator's part; a summary that
    /// is not one is an error naming the file.
    #[test]
    fn job_summaries_read_back_typed() {
        let run = Summary {
            job: "j".into(),
            job_dir: "jobs/j-1".into(),
            dataset: "cora".into(),
            nodes: 10,
            edges: 20,
            model: ModelConfig::new(physalia_gnn::LayerKind::Gcn, 4, 8, 2),
            parameters: 50,
            epochs: 3,
            runs: vec![RunSummary {
                seed: 0,
                final_epoch: 3,
                final_loss: 0.5,
                final_train_acc: Some(0.9),
                final_val_acc: None,
                final_test_acc: None,
                best_epoch: None,
                best_val_acc: None,
                test_acc_at_best_val: None,
                stopped_early: false,
                median_epoch_s: 0.1,
            }],
            mean_test_acc_at_best_val: None,
            std_test_acc_at_best_val: None,
            mean_final_test_acc: None,
            median_epoch_s: 0.1,
            epoch_times_s: vec![0.1, 0.1, 0.1],
            load_s: 0.0,
            peak_rss_bytes: Some(1),
            usd_total: 0.0,
            sku: "local".into(),
            usd_per_worker_hour: 0.0,
            device: None,
        };
        let coordinated = Coordinated {
            workers: 2,
            bytes_exchanged: 7,
            worker_peak_rss_bytes: vec![Some(1), None],
            coordinator_rss_bytes: None,
            worker_seconds: 1.5,
            coordinator_seconds: 0.0,
            coordinator_usd_per_s: 0.0,
            scaling_events: vec![],
            launches: vec![LaunchSpan {
                launch: 0,
                workers: 2,
                prewarm: false,
                in_place: false,
                start_s: 0.0,
                stop_s: Some(1.0),
            }],
            epoch_ends: vec![EpochEnd {
                epoch: 1,
                end_s: 0.5,
            }],
            workers_range: Some([2, 2]),
            job_url: None,
            partitions: Vec::new(),
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("summary.json");
        for s in [
            JobSummary {
                run: run.clone(),
                coordinated: Some(coordinated.clone()),
            },
            JobSummary {
                run: run.clone(),
                coordinated: None,
            },
        ] {
            std::fs::write(&path, serde_json::to_vec(&s).unwrap()).unwrap();
            assert_eq!(JobSummary::read(&path).unwrap(), s);
        }
        let single = JobSummary {
            run,
            coordinated: None,
        };
        assert!(
            single
                .coordinator_part("replay")
                .unwrap_err()
                .contains("replay needs a job the coordinator ran")
        );
        std::fs::write(&path, b"{\"job\": 3}").unwrap();
        let err = JobSummary::read(&path).unwrap_err();
        assert!(err.contains("summary.json: not a job summary"), "{err}");
    }

    /// The final line's "finished on ..." (moved from the CLI with `finished_on`, now read from the typed
    /// summary; the same lines asserted).
    #[test]
    fn the_final_line_names_the_last_workers_and_the_range_used() {
        let line = |workers: u32, workers_range: Option<[u32; 2]>| {
            Coordinated {
                workers,
                bytes_exchanged: 0,
                worker_peak_rss_bytes: Vec::new(),
                coordinator_rss_bytes: None,
                worker_seconds: 0.0,
                coordinator_seconds: 0.0,
                coordinator_usd_per_s: 0.0,
                scaling_events: Vec::new(),
                launches: Vec::new(),
                epoch_ends: Vec::new(),
                workers_range,
                job_url: None,
                partitions: Vec::new(),
            }
            .finished_on()
        };
        assert_eq!(
            line(4, Some([1, 4])),
            "finished on 4 workers (1-4 during the job)"
        );
        assert_eq!(
            line(2, Some([2, 4])),
            "finished on 2 workers (2-4 during the job)"
        );
        assert_eq!(line(1, Some([1, 1])), "finished on 1 worker");
        assert_eq!(line(3, None), "finished on 3 workers");
    }

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
            prepare_s: None,
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

    /// A line still being appended (no newline yet: a reader of `metrics.jsonl` saw part of the write;
    /// the CI of stop 45 failed on one in `status` of a running job) is not read, and not an error.
    #[test]
    fn a_line_still_being_appended_is_not_read() {
        let line = MetricsLine::coordinated(0, &[metrics(1, 0.1, 0)], 0.0);
        let text = serde_json::to_string(&line).unwrap();
        let partial = &text[..text.len() / 2];
        let back = MetricsLine::parse_all(&format!("{text}\n{partial}"), "m").unwrap();
        assert_eq!(back, vec![line.clone()]);
        assert_eq!(MetricsLine::parse_all(partial, "m").unwrap(), vec![]);
        // the whole line, once its newline is there, is read
        let back = MetricsLine::parse_all(&format!("{text}\n{text}\n"), "m").unwrap();
        assert_eq!(back.len(), 2);
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
