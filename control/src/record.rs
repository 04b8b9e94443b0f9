//! The job record's per-epoch line (`metrics.jsonl`), typed once: the coordinator and the single-worker
//! run write it, `submit --resume`, the scaling policy's replay and the report read it back, and a line
//! that does not parse is an error naming the file and line, never a silent default.

use std::path::Path;

use physalia_gnn::{EpochMetrics, ExchangeStats};
use serde::{Deserialize, Serialize};

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
