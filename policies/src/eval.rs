//! The evaluator: a pure function from (policy, metrics history, running plan, last change) to
//! a [`Decision`], and [`simulate`], which replays a history epoch by epoch.
//!
//! Rules are tried in order. For each, in this order: a rule in its cooldown is skipped; a rule
//! whose condition reads a missing metric does not fire; a condition that is false, or that
//! fails at run time (a division by zero), does not fire; a rule whose action would change
//! nothing (doubling at `max_workers`) does not fire and the next rule is tried. The first rule
//! left fires. The decision records what each rule tried came to, and the values the
//! conditions read. Nothing here does IO, reads a clock or draws a random number.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::conditions::{self, Condition};
use crate::metrics::{EpochRecord, MetricValue, PlanState, variables};
use crate::schema::{Action, Objective, PolicySet};

/// What the policy decided after an epoch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// The epoch whose metrics were evaluated; `None` for an empty history.
    pub epoch: Option<u32>,
    /// Workers of the plan when the decision was made.
    pub workers: u32,
    /// The change to make; `None` keeps the plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub change: Option<Change>,
    /// Spare containers to keep warm for a coming scale-up (see [`crate::Prewarm`]), beyond
    /// the plan's workers after the change.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub prewarm_workers: u32,
    /// What each rule tried came to, in order, up to the one that fired.
    pub checks: Vec<RuleCheck>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl Decision {
    /// Whether the plan stays as it is.
    pub fn is_keep(&self) -> bool {
        self.change.is_none()
    }

    /// Whether training stops.
    pub fn is_stop(&self) -> bool {
        matches!(
            self.change,
            Some(Change {
                effect: Effect::Stop,
                ..
            })
        )
    }
}

/// A change of plan and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Change {
    /// The rule that fired.
    pub rule: String,
    /// Its action, as written.
    pub action: Action,
    /// What the action does to the running plan.
    pub effect: Effect,
    /// The metrics its condition read, with their values.
    pub values: BTreeMap<String, MetricValue>,
}

/// What an action does to the running plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Effect {
    /// Run `to` workers instead of `from`.
    Workers {
        from: u32,
        to: u32,
        /// What the action asked for before clamping.
        requested: i64,
        /// The bound `requested` was clamped to, if it was.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        clamped_to: Option<Bound>,
    },
    /// Change the boundary-node sampling rate.
    BoundarySampling { from: f64, to: f64 },
    /// Change the staleness bound.
    Staleness { from: u32, to: u32 },
    /// Re-plan under another objective.
    Replan { from: Objective, to: Objective },
    /// Stop training.
    Stop,
}

/// A bound of the worker count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    MinWorkers,
    MaxWorkers,
}

/// What one rule came to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RuleCheck {
    pub rule: String,
    #[serde(flatten)]
    pub outcome: RuleOutcome,
}

/// Why a rule fired or did not.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum RuleOutcome {
    /// The rule fired; the values are in the [`Change`].
    Fired,
    /// The condition was false on these values.
    False {
        values: BTreeMap<String, MetricValue>,
    },
    /// The rule is in its cooldown; it may fire after this epoch.
    Cooldown { until_epoch: u32 },
    /// The condition reads metrics that are not known yet.
    Missing { metrics: Vec<String> },
    /// The condition held but the action would change nothing.
    NoEffect { reason: String },
    /// The condition could not be evaluated (a division by zero; or a policy that was not
    /// checked). The rule does not fire.
    Error { message: String },
}

/// Decides what to do after the last epoch of `history`, given the running `plan` and the
/// epoch after which the plan last changed. Pure: the same inputs give the same decision.
pub fn evaluate(
    policy: &PolicySet,
    history: &[EpochRecord],
    plan: &PlanState,
    last_change_epoch: Option<u32>,
) -> Decision {
    let mut decision = Decision {
        epoch: history.last().map(|r| r.epoch),
        workers: plan.workers,
        change: None,
        prewarm_workers: 0,
        checks: Vec::new(),
    };
    let Some(epoch) = decision.epoch else {
        return decision;
    };
    let vars = variables(policy, history, plan, last_change_epoch);
    for rule in &policy.rules {
        let cooldown = rule.cooldown_epochs.unwrap_or(policy.cooldown_epochs);
        let (outcome, change) = match last_change_epoch.map(|c| c.saturating_add(cooldown)) {
            Some(until) if epoch < until => (RuleOutcome::Cooldown { until_epoch: until }, None),
            _ => try_rule(policy, plan, &vars, &rule.when, &rule.then),
        };
        decision.checks.push(RuleCheck {
            rule: rule.name.clone(),
            outcome,
        });
        if let Some((effect, values)) = change {
            decision.change = Some(Change {
                rule: rule.name.clone(),
                action: rule.then,
                effect,
                values,
            });
            break;
        }
    }
    decision.prewarm_workers = prewarm(policy, history, plan, last_change_epoch, &decision);
    decision
}

type Values = BTreeMap<String, MetricValue>;

fn try_rule(
    policy: &PolicySet,
    plan: &PlanState,
    vars: &BTreeMap<&'static str, MetricValue>,
    when: &str,
    then: &Action,
) -> (RuleOutcome, Option<(Effect, Values)>) {
    let condition = match conditions::compile(when, false) {
        Ok(condition) => condition,
        Err(problems) => {
            let message = problems
                .first()
                .map_or_else(|| "invalid condition".to_string(), |p| p.message.clone());
            return (RuleOutcome::Error { message }, None);
        }
    };
    let missing: Vec<String> = condition
        .reads
        .iter()
        .filter(|name| vars.get(*name).is_none_or(MetricValue::is_missing))
        .map(|name| name.to_string())
        .collect();
    if !missing.is_empty() {
        return (RuleOutcome::Missing { metrics: missing }, None);
    }
    let values = read_values(&condition, vars);
    match condition.run(vars) {
        Ok(false) => (RuleOutcome::False { values }, None),
        Ok(true) => match effect(policy, plan, then) {
            Ok(effect) => (RuleOutcome::Fired, Some((effect, values))),
            Err(reason) => (RuleOutcome::NoEffect { reason }, None),
        },
        Err(message) => (RuleOutcome::Error { message }, None),
    }
}

fn read_values(condition: &Condition, vars: &BTreeMap<&'static str, MetricValue>) -> Values {
    condition
        .reads
        .iter()
        .map(|name| {
            let value = vars.get(name).cloned().unwrap_or(MetricValue::Missing);
            (name.to_string(), value)
        })
        .collect()
}

/// What `action` does to `plan`, or why it does nothing.
pub fn effect(policy: &PolicySet, plan: &PlanState, action: &Action) -> Result<Effect, String> {
    let from = plan.workers;
    let lo = policy.min_workers.max(1);
    let hi = policy.max_workers.max(lo);
    let requested: i64 = match *action {
        Action::SetWorkers(n) => i64::from(n),
        Action::AddWorkers(d) => i64::from(from) + i64::from(d),
        Action::MultiplyWorkers(x) => {
            if !(x.is_finite() && x > 0.0) {
                return Err(format!("invalid factor {x}"));
            }
            let raw = f64::from(from) * x;
            // `as` saturates: a huge factor asks for i64::MAX, then clamps to max_workers.
            if x > 1.0 {
                (raw.ceil() as i64).max(i64::from(from) + 1)
            } else if x < 1.0 {
                (raw.floor() as i64).min(i64::from(from) - 1)
            } else {
                i64::from(from)
            }
        }
        Action::BoundarySampling(to) => {
            if !(to.is_finite() && to > 0.0 && to <= 1.0) {
                return Err(format!("invalid boundary_sampling {to}"));
            }
            if to == plan.boundary_sampling {
                return Err(format!("boundary_sampling is already {to}"));
            }
            return Ok(Effect::BoundarySampling {
                from: plan.boundary_sampling,
                to,
            });
        }
        Action::Staleness(to) => {
            if to == plan.staleness {
                return Err(format!("staleness is already {to}"));
            }
            return Ok(Effect::Staleness {
                from: plan.staleness,
                to,
            });
        }
        Action::Replan(to) => {
            if to == plan.objective {
                return Err(format!("objective is already {}", to.as_str()));
            }
            return Ok(Effect::Replan {
                from: plan.objective,
                to,
            });
        }
        Action::Stop => return Ok(Effect::Stop),
    };
    let (to, clamped_to) = if requested > i64::from(hi) {
        (hi, Some(Bound::MaxWorkers))
    } else if requested < i64::from(lo) {
        (lo, Some(Bound::MinWorkers))
    } else {
        // In [lo, hi], so it fits a u32.
        (u32::try_from(requested).unwrap_or(hi), None)
    };
    if to == from {
        return Err(match clamped_to {
            Some(Bound::MaxWorkers) => format!("already at max_workers ({hi})"),
            Some(Bound::MinWorkers) => format!("already at min_workers ({lo})"),
            None => format!("already at {from} workers"),
        });
    }
    Ok(Effect::Workers {
        from,
        to,
        requested,
        clamped_to,
    })
}

impl PlanState {
    /// The plan after `effect` (unchanged for [`Effect::Stop`]).
    pub fn apply(&self, effect: &Effect) -> PlanState {
        let mut next = self.clone();
        match *effect {
            Effect::Workers { to, .. } => next.workers = to,
            Effect::BoundarySampling { to, .. } => next.boundary_sampling = to,
            Effect::Staleness { to, .. } => next.staleness = to,
            Effect::Replan { to, .. } => next.objective = to,
            Effect::Stop => {}
        }
        next
    }
}

/// Spares to keep warm after `decision`: the prewarm condition is evaluated on the plan the
/// decision leaves, whatever the cooldown, and the spares never take the plan above
/// `max_workers`. A stop needs none; a missing metric or an error means none.
fn prewarm(
    policy: &PolicySet,
    history: &[EpochRecord],
    plan: &PlanState,
    last_change_epoch: Option<u32>,
    decision: &Decision,
) -> u32 {
    let Some(prewarm) = &policy.prewarm else {
        return 0;
    };
    let (plan, last_change) = match &decision.change {
        Some(Change {
            effect: Effect::Stop,
            ..
        }) => return 0,
        Some(change) => (plan.apply(&change.effect), decision.epoch),
        None => (plan.clone(), last_change_epoch),
    };
    let vars = variables(policy, history, &plan, last_change);
    let Ok(condition) = conditions::compile(&prewarm.when, false) else {
        return 0;
    };
    if condition
        .reads
        .iter()
        .any(|name| vars.get(name).is_none_or(MetricValue::is_missing))
        || condition.run(&vars) != Ok(true)
    {
        return 0;
    }
    let wanted = match (prewarm.workers, &prewarm.rule) {
        (Some(n), _) => n,
        (None, Some(name)) => {
            let Some(rule) = policy.rules.iter().find(|r| &r.name == name) else {
                return 0;
            };
            match effect(policy, &plan, &rule.then) {
                Ok(Effect::Workers { from, to, .. }) => to.saturating_sub(from),
                _ => 0,
            }
        }
        (None, None) => 0,
    };
    let room = policy.max_workers.saturating_sub(plan.workers);
    wanted.min(room)
}

/// Replays `history` epoch by epoch from the plan `start`: after each epoch the policy is
/// evaluated on the records so far and its change, if any, is applied to the plan for the
/// next epoch. Stops after a stop decision. The records are inputs as recorded: a change does
/// not alter later records (a synthetic history is written to match the decisions it leads to).
pub fn simulate(policy: &PolicySet, history: &[EpochRecord], start: &PlanState) -> Vec<Decision> {
    let mut plan = start.clone();
    let mut last_change = None;
    let mut trace = Vec::with_capacity(history.len());
    for end in 1..=history.len() {
        let decision = evaluate(policy, &history[..end], &plan, last_change);
        if let Some(change) = &decision.change {
            plan = plan.apply(&change.effect);
            last_change = decision.epoch;
        }
        let stop = decision.is_stop();
        trace.push(decision);
        if stop {
            break;
        }
    }
    trace
}
