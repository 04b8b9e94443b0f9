//! The inputs of a decision: the metrics of the epochs so far ([`EpochRecord`]), the plan that
//! is running ([`PlanState`]), and the variables a CEL condition can read, derived from both
//! ([`METRICS`]).
//!
//! A variable is either a number or *missing*: no validation accuracy has been recorded yet, the
//! history is shorter than the window, the job has no budget. A rule whose condition reads a
//! missing variable does not fire (the decision says which variable was missing); this is never
//! an error. Non-finite inputs (a NaN loss after divergence) count as missing too.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::schema::{Objective, PolicySet};

/// What one epoch measured, as the coordinator records it after the epoch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EpochRecord {
    /// Number of the epoch; the first is 1. Records are in order, one per epoch.
    pub epoch: u32,
    /// Training loss of the epoch.
    pub loss: f64,
    /// Validation accuracy in [0, 1], on epochs that evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_acc: Option<f64>,
    /// Wall-clock seconds of the epoch.
    pub epoch_s: f64,
    /// Share of the epoch the workers spent waiting on peers, in [0, 1] (mean over workers).
    #[serde(default)]
    pub wait_share: f64,
    /// Bytes exchanged between workers during the epoch, all workers together.
    #[serde(default)]
    pub bytes: u64,
    /// Workers that ran the epoch.
    pub workers: u32,
    /// USD spent by the job so far, this epoch included.
    pub usd_spent: f64,
    /// Training samples (nodes) processed per USD during the epoch; absent when the epoch cost
    /// nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throughput_per_usd: Option<f64>,
    /// Gradient noise scale estimated during the epoch (see [`crate::gradient_noise_scale`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_noise_scale: Option<f64>,
}

/// The part of the running plan (and of the job) that conditions read and actions change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PlanState {
    /// Workers running now.
    pub workers: u32,
    /// The job's budget in USD, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_usd: Option<f64>,
    /// Epochs the job trains for, if fixed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epochs_total: Option<u32>,
    /// Boundary-node sampling rate, in (0, 1]; 1 sends every boundary row.
    #[serde(default = "one")]
    pub boundary_sampling: f64,
    /// Staleness bound of halo rows in epochs; 0 is always fresh.
    #[serde(default)]
    pub staleness: u32,
    /// What the planner optimises.
    #[serde(default)]
    pub objective: Objective,
    /// Mini-batch size of each worker in data-parallel training; absent for full-graph
    /// training. The global batch is this times `workers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_per_worker: Option<u32>,
}

fn one() -> f64 {
    1.0
}

impl PlanState {
    /// A plan with `workers` workers and every other setting at its default.
    pub fn new(workers: u32) -> Self {
        PlanState {
            workers,
            budget_usd: None,
            epochs_total: None,
            boundary_sampling: 1.0,
            staleness: 0,
            objective: Objective::MinCost,
            batch_per_worker: None,
        }
    }
}

/// The value of a variable: an integer, a real number, a string, or missing. Serialises as a
/// JSON number, string or `null`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MetricValue {
    Int(i64),
    Float(f64),
    Text(String),
    Missing,
}

impl MetricValue {
    fn float(x: Option<f64>) -> MetricValue {
        match x {
            Some(x) if x.is_finite() => MetricValue::Float(x),
            _ => MetricValue::Missing,
        }
    }

    fn int(x: Option<i64>) -> MetricValue {
        x.map_or(MetricValue::Missing, MetricValue::Int)
    }

    /// Whether the value is missing.
    pub fn is_missing(&self) -> bool {
        matches!(self, MetricValue::Missing)
    }

    pub(crate) fn to_cel(&self) -> cel::Value {
        match self {
            MetricValue::Int(i) => cel::Value::Int(*i),
            MetricValue::Float(x) => cel::Value::Float(*x),
            MetricValue::Text(s) => cel::Value::String(std::sync::Arc::new(s.clone())),
            MetricValue::Missing => cel::Value::Null,
        }
    }
}

/// CEL type of a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricType {
    /// CEL `int`.
    Int,
    /// CEL `double`.
    Double,
    /// CEL `string`.
    String,
}

/// A variable conditions can read.
#[derive(Debug, Clone, Copy)]
pub struct MetricDoc {
    pub name: &'static str,
    pub ty: MetricType,
    /// What it is and when it is missing.
    pub doc: &'static str,
}

const fn m(name: &'static str, ty: MetricType, doc: &'static str) -> MetricDoc {
    MetricDoc { name, ty, doc }
}

/// Every variable a condition can read. `e` is the last epoch of the history and `w` the
/// policy's `window_epochs`; "`w` records earlier" counts records, one per epoch.
///
/// CEL does not mix `int` and `double` in arithmetic (`workers * 1.5` is an error, comparisons
/// such as `workers > 2.5` are fine): convert with `double(workers)`.
pub const METRICS: &[MetricDoc] = &[
    m(
        "epoch",
        MetricType::Int,
        "number of the last epoch (the first is 1)",
    ),
    m(
        "loss",
        MetricType::Double,
        "training loss of the last epoch",
    ),
    m(
        "val_acc",
        MetricType::Double,
        "the latest validation accuracy, in [0, 1]; missing until an epoch evaluated",
    ),
    m(
        "delta_loss",
        MetricType::Double,
        "relative change of the loss over the window: (loss[e] - loss[e-w]) / |loss[e-w]|; \
         negative while the loss falls, so `delta_loss > -0.01` is a plateau (less than 1% \
         better over w epochs); missing until the history has w + 1 records",
    ),
    m(
        "delta_val_acc",
        MetricType::Double,
        "absolute change of val_acc over the window: val_acc[e] - val_acc[e-w], in accuracy \
         as a fraction (0.01 is one point); each side is the latest value at or before its \
         epoch; missing until both are known",
    ),
    m(
        "epoch_s",
        MetricType::Double,
        "wall-clock seconds of the last epoch",
    ),
    m(
        "wait_share",
        MetricType::Double,
        "share of the last epoch spent waiting on peers, in [0, 1]",
    ),
    m(
        "bytes",
        MetricType::Int,
        "bytes exchanged between workers in the last epoch",
    ),
    m(
        "workers",
        MetricType::Int,
        "workers running now (the plan's count)",
    ),
    m("min_workers", MetricType::Int, "the policy's min_workers"),
    m("max_workers", MetricType::Int, "the policy's max_workers"),
    m("usd_spent", MetricType::Double, "USD spent so far"),
    m(
        "usd_per_epoch",
        MetricType::Double,
        "USD spent by the last epoch",
    ),
    m(
        "budget_usd",
        MetricType::Double,
        "the job's budget in USD; missing when it has none",
    ),
    m(
        "budget_left_usd",
        MetricType::Double,
        "budget_usd - usd_spent; missing when the job has no budget",
    ),
    m(
        "epochs_left",
        MetricType::Int,
        "epochs still to train: epochs_total - epoch (at least 0); missing when the job has no \
         fixed epoch count",
    ),
    m(
        "throughput_per_usd",
        MetricType::Double,
        "samples processed per USD in the last epoch; missing when it cost nothing",
    ),
    m(
        "grad_noise_scale",
        MetricType::Double,
        "the latest gradient noise scale estimate (samples); missing until one is recorded",
    ),
    m(
        "batch_size",
        MetricType::Int,
        "global mini-batch size: the plan's batch_per_worker times workers; missing for \
         full-graph training",
    ),
    m(
        "boundary_sampling",
        MetricType::Double,
        "the plan's boundary-node sampling rate, in (0, 1]",
    ),
    m(
        "staleness",
        MetricType::Int,
        "the plan's staleness bound in epochs",
    ),
    m(
        "objective",
        MetricType::String,
        "the plan's objective: 'min_cost' or 'min_time'",
    ),
    m(
        "epochs_since_change",
        MetricType::Int,
        "epochs run since the last change (since the start when there was none)",
    ),
];

/// Whether `name` is a variable conditions can read.
pub fn is_metric(name: &str) -> bool {
    METRICS.iter().any(|m| m.name == name)
}

/// The values of every variable after the last epoch of `history`; empty when `history` is.
pub fn variables(
    policy: &PolicySet,
    history: &[EpochRecord],
    plan: &PlanState,
    last_change_epoch: Option<u32>,
) -> BTreeMap<&'static str, MetricValue> {
    let mut vars = BTreeMap::new();
    let Some(last) = history.last() else {
        return vars;
    };
    let n = history.len();
    let window = usize::try_from(policy.window_epochs.max(1)).unwrap_or(usize::MAX);
    let earlier = n.checked_sub(window + 1).map(|i| &history[i]);
    let finite = |x: f64| x.is_finite().then_some(x);
    // The latest finite value at or before index `end` (inclusive).
    let latest = |end: usize, get: fn(&EpochRecord) -> Option<f64>| {
        history[..=end]
            .iter()
            .rev()
            .find_map(|r| get(r).and_then(finite))
    };

    let epoch = i64::from(last.epoch);
    let val_acc = latest(n - 1, |r| r.val_acc);
    let delta_loss = earlier.and_then(|before| {
        let (now, before) = (finite(last.loss)?, finite(before.loss)?);
        (before != 0.0).then(|| (now - before) / before.abs())
    });
    let delta_val_acc = earlier.and_then(|_| {
        let before = latest(n - 1 - window, |r| r.val_acc)?;
        Some(val_acc? - before)
    });
    let usd_per_epoch = match n {
        1 => finite(last.usd_spent),
        _ => finite(last.usd_spent - history[n - 2].usd_spent),
    };
    let budget = plan.budget_usd.and_then(finite);
    let usd_spent = finite(last.usd_spent);

    let mut put = |name: &'static str, value: MetricValue| {
        debug_assert!(is_metric(name), "{name} is listed in METRICS");
        vars.insert(name, value);
    };
    put("epoch", MetricValue::Int(epoch));
    put("loss", MetricValue::float(Some(last.loss)));
    put("val_acc", MetricValue::float(val_acc));
    put("delta_loss", MetricValue::float(delta_loss));
    put("delta_val_acc", MetricValue::float(delta_val_acc));
    put("epoch_s", MetricValue::float(Some(last.epoch_s)));
    put("wait_share", MetricValue::float(Some(last.wait_share)));
    put(
        "bytes",
        MetricValue::Int(i64::try_from(last.bytes).unwrap_or(i64::MAX)),
    );
    put("workers", MetricValue::Int(i64::from(plan.workers)));
    put(
        "min_workers",
        MetricValue::Int(i64::from(policy.min_workers)),
    );
    put(
        "max_workers",
        MetricValue::Int(i64::from(policy.max_workers)),
    );
    put("usd_spent", MetricValue::float(usd_spent));
    put("usd_per_epoch", MetricValue::float(usd_per_epoch));
    put("budget_usd", MetricValue::float(budget));
    put(
        "budget_left_usd",
        MetricValue::float(budget.zip(usd_spent).map(|(b, s)| b - s)),
    );
    put(
        "epochs_left",
        MetricValue::int(
            plan.epochs_total
                .map(|total| (i64::from(total) - epoch).max(0)),
        ),
    );
    put(
        "throughput_per_usd",
        MetricValue::float(last.throughput_per_usd),
    );
    put(
        "grad_noise_scale",
        MetricValue::float(latest(n - 1, |r| r.grad_noise_scale)),
    );
    put(
        "batch_size",
        MetricValue::int(
            plan.batch_per_worker
                .map(|b| i64::from(b).saturating_mul(i64::from(plan.workers))),
        ),
    );
    put(
        "boundary_sampling",
        MetricValue::float(Some(plan.boundary_sampling)),
    );
    put("staleness", MetricValue::Int(i64::from(plan.staleness)));
    put(
        "objective",
        MetricValue::Text(plan.objective.as_str().to_string()),
    );
    put(
        "epochs_since_change",
        MetricValue::Int(match last_change_epoch {
            Some(change) => (epoch - i64::from(change)).max(0),
            None => epoch,
        }),
    );
    vars
}

/// Representative non-missing values of every variable, used to type-check conditions: a
/// condition that fails on these (an `int` times a `double`, an unknown function, a result
/// that is not a bool) fails on real metrics too.
pub(crate) fn sample_variables() -> BTreeMap<&'static str, MetricValue> {
    METRICS
        .iter()
        .map(|m| {
            let value = match m.ty {
                MetricType::Int => MetricValue::Int(7),
                MetricType::Double => MetricValue::Float(0.37),
                MetricType::String => MetricValue::Text("min_cost".to_string()),
            };
            (m.name, value)
        })
        .collect()
}
