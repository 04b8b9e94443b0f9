//! What every job reports, whichever way it ran: the model configuration a job file asks for, the
//! per-epoch line on the terminal, the cost of a worker-second, and the summary (`summary.json` and the
//! final lines). The single-worker run (`submit.rs`) and the coordinator (`distributed.rs`) both use it.

use std::path::Path;

use anyhow::{Result, bail};
use physalia_gnn::{Activation, EpochMetrics, LayerKind, Model, ModelConfig};

use crate::spec::{self, JobSpec, ModelKind, Priced};

pub use crate::elastic::RunResult;

pub fn epoch_line(runs: u64, run: u64, epochs: usize, m: &EpochMetrics) -> String {
    let prefix = if runs > 1 {
        format!("run {run} ")
    } else {
        String::new()
    };
    let w = epochs.to_string().len();
    let mut line = format!(
        "{prefix}epoch {:>w$}/{epochs}  loss {:.4}  train {}  val {}  test {}  {:.3}s",
        m.epoch,
        m.loss,
        fmt_acc(m.train_acc),
        fmt_acc(m.val_acc),
        fmt_acc(m.test_acc),
        m.train_s
    );
    if let Some(b) = &m.batches {
        line.push_str(&format!(
            "  steps {}  sample wait {:.3}s  fetch {:.3}s",
            b.steps, b.sample_wait_s, b.fetch_s
        ));
        if let Some(h) = b.hit_rate() {
            line.push_str(&format!("  cache hit {:.1}%", 100.0 * h));
        }
    }
    if let Some(d) = &m.device {
        line.push_str(&format!("  on {d}"));
    }
    line
}

pub fn fmt_acc(a: Option<f64>) -> String {
    a.map(|a| format!("{:.4}", a))
        .unwrap_or_else(|| "  -   ".into())
}

/// `b` bytes in KiB, MiB or GiB.
pub fn fmt_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.2} MiB", b / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", b / 1024.0)
    }
}

pub fn model_config(spec: &JobSpec, in_dim: usize, classes: usize) -> Result<ModelConfig> {
    let m = &spec.model;
    if classes < 2 {
        bail!("the dataset has {classes} class(es); node classification needs at least 2");
    }
    let kind = match m.kind {
        ModelKind::Gcn => LayerKind::Gcn,
        ModelKind::Sage => LayerKind::Sage,
        ModelKind::Gat => LayerKind::Gat,
    };
    Ok(ModelConfig {
        kind,
        in_dim,
        hidden: m.hidden as usize,
        out_dim: classes,
        layers: m.layers as usize,
        heads: m.heads() as usize,
        out_heads: m.out_heads() as usize,
        dropout: m.dropout as f32,
        input_dropout: m.input_dropout() as f32,
        attn_dropout: if kind == LayerKind::Gat {
            m.attn_dropout() as f32
        } else {
            0.0
        },
        activation: match m.activation {
            spec::Activation::Relu => Activation::Relu,
            spec::Activation::Elu => Activation::Elu,
        },
        negative_slope: m.negative_slope() as f32,
    })
}

pub use physalia_control::record::{Coordinated, JobSummary, RunSummary, Summary};

/// The job's worker container (its platform's SKU) and its price per worker-second, from the planner's
/// built-in catalog. Validation made sure the job names one (a `goal:` job gets the planner's).
pub fn price(spec: &JobSpec) -> Result<Priced> {
    spec.backend
        .priced(&physalia_planner::Catalog::builtin(), None)
        .map_err(|e| anyhow::anyhow!("{e}"))
}

#[allow(clippy::too_many_arguments)]
pub fn summarize(
    name: &str,
    data_name: &str,
    stats: &physalia_graph::GraphStats,
    cfg: &ModelConfig,
    spec: &JobSpec,
    runs: &[RunResult],
    dir: &Path,
    load_s: f64,
    price: &Priced,
) -> Summary {
    let run_summaries: Vec<RunSummary> = runs
        .iter()
        .map(|r| {
            let last = r
                .summary
                .epochs
                .last()
                .expect("a run trains at least one epoch");
            RunSummary {
                seed: r.seed,
                final_epoch: last.epoch,
                final_loss: last.loss,
                final_train_acc: last.train_acc,
                final_val_acc: last.val_acc,
                final_test_acc: last.test_acc,
                best_epoch: r.summary.best_epoch,
                best_val_acc: r.summary.best_val_acc,
                test_acc_at_best_val: r.summary.test_acc_at_best_val,
                stopped_early: r.summary.stopped_early,
                median_epoch_s: median(r.summary.epochs.iter().map(|e| e.train_s).collect()),
            }
        })
        .collect();
    let (mean, std) = mean_std(
        run_summaries
            .iter()
            .filter_map(|r| r.test_acc_at_best_val)
            .collect(),
    );
    let (mean_final, _) = mean_std(
        run_summaries
            .iter()
            .filter_map(|r| r.final_test_acc)
            .collect(),
    );
    let all_times: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.summary.epochs.iter().map(|e| e.train_s))
        .collect();
    Summary {
        job: name.to_string(),
        job_dir: dir.display().to_string(),
        dataset: data_name.to_string(),
        nodes: stats.num_nodes,
        edges: stats.num_edges,
        model: cfg.clone(),
        parameters: Model::new(cfg, 0).map(|m| m.num_parameters()).unwrap_or(0),
        epochs: spec.train.epochs,
        runs: run_summaries,
        mean_test_acc_at_best_val: mean,
        std_test_acc_at_best_val: std,
        mean_final_test_acc: mean_final,
        median_epoch_s: median(all_times),
        epoch_times_s: runs[0].summary.epochs.iter().map(|e| e.train_s).collect(),
        load_s,
        peak_rss_bytes: peak_rss_bytes(),
        usd_total: runs
            .iter()
            .flat_map(|r| &r.summary.epochs)
            .map(|e| e.train_s + e.eval_s)
            .sum::<f64>()
            * price.usd_per_worker_s,
        sku: price.sku.clone(),
        usd_per_worker_hour: price.usd_per_worker_s * 3600.0,
        device: runs
            .iter()
            .flat_map(|r| &r.summary.epochs)
            .find_map(|e| e.device.clone()),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn mean_std(v: Vec<f64>) -> (Option<f64>, Option<f64>) {
    if v.is_empty() {
        return (None, None);
    }
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / n;
    (Some(mean), Some(var.sqrt()))
}

/// Peak resident set size of this process (Linux `VmHWM`).
fn peak_rss_bytes() -> Option<u64> {
    status_bytes("VmHWM:")
}

/// This process's resident set now (Linux `VmRSS`): a coordinator's while its workers train.
pub fn rss_bytes() -> Option<u64> {
    status_bytes("VmRSS:")
}

fn status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
