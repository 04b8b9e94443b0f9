//! The scaling-policy schema: what a policy file (or the `scaling:` section of a job file)
//! holds, its defaults and its JSON Schema.
//!
//! ```yaml
//! min_workers: 1
//! max_workers: 16
//! cooldown_epochs: 3          # default 3
//! window_epochs: 3            # default 3: the span of delta_loss and delta_val_acc
//! rules:                      # tried in order; the first that fires wins
//!   - name: double-on-plateau
//!     when: delta_loss > -0.02
//!     then: {multiply_workers: 2}
//!   - name: stop-at-target
//!     when: val_acc >= 0.95
//!     then: stop
//!     cooldown_epochs: 0      # this rule ignores the cooldown
//! ```
//!
//! Actions are written `{set_workers: 4}`, `{multiply_workers: 2}`, `{add_workers: -1}`,
//! `{boundary_sampling: 0.1}`, `{staleness: 2}`, `{replan: min_cost}` or `stop`. Unknown
//! fields are errors everywhere. The types here only say what was written; the semantic
//! checks are in [`crate::check`].

use std::fmt;

use schemars::JsonSchema;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};

/// Default of [`PolicySet::cooldown_epochs`].
pub const DEFAULT_COOLDOWN_EPOCHS: u32 = 3;
/// Default of [`PolicySet::window_epochs`].
pub const DEFAULT_WINDOW_EPOCHS: u32 = 3;

/// A scaling policy: bounds on the worker count and the rules that change the plan between
/// epochs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PolicySet {
    /// Fewest workers any rule may leave (at least 1). Default 1.
    #[serde(default = "default_min_workers")]
    pub min_workers: u32,
    /// Most workers any rule may start (at least `min_workers`). Worker-count changes are
    /// clamped to `[min_workers, max_workers]`.
    pub max_workers: u32,
    /// After a change, no rule fires until this many epochs have run with the new plan
    /// (unless the rule sets its own `cooldown_epochs`). 0: a rule may fire after every
    /// epoch. Default 3.
    #[serde(default = "default_cooldown_epochs")]
    pub cooldown_epochs: u32,
    /// Number of epochs that `delta_loss` and `delta_val_acc` span (at least 1). Default 3.
    #[serde(default = "default_window_epochs")]
    pub window_epochs: u32,
    /// Start containers ahead of a scale-up so that it pays no cold start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prewarm: Option<Prewarm>,
    /// How a worker-count change is carried out: `in_place` (the default) keeps the surviving
    /// workers' processes and training state and moves only what changes owner, where the job's
    /// mode allows it (partition parallelism, today); `restart` stops every worker and relaunches
    /// the new count from the last checkpoint. An in-place resize that fails restarts.
    #[serde(default, skip_serializing_if = "Resize::is_default")]
    pub resize: Resize,
    /// The rules, tried in order after every epoch; the first whose condition holds and whose
    /// action changes something wins.
    pub rules: Vec<Rule>,
}

/// How a resize is carried out ([`PolicySet::resize`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Resize {
    /// Survivors keep their processes and state; joiners join, leavers stop.
    #[default]
    InPlace,
    /// Every worker stops; the new count starts from the last checkpoint.
    Restart,
}

impl Resize {
    fn is_default(&self) -> bool {
        *self == Resize::InPlace
    }
}

/// One rule: when its condition holds, its action changes the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Name of the rule, unique in the policy; decisions name the rule that fired.
    pub name: String,
    /// Condition in CEL over the metrics of the epochs so far, e.g. `delta_loss > -0.01 &&
    /// wait_share < 0.3`. A rule whose condition reads a metric that is not known yet (no
    /// validation accuracy yet, a history shorter than the window) does not fire.
    pub when: String,
    /// What to do when the condition holds.
    pub then: Action,
    /// This rule's own cooldown, in place of the policy's `cooldown_epochs` (0 for a guard
    /// that must be able to fire right after another change, such as a budget stop).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cooldown_epochs: Option<u32>,
}

/// What a rule does. In YAML: `{set_workers: 4}`, `{multiply_workers: 2}`,
/// `{add_workers: -1}`, `{boundary_sampling: 0.1}`, `{staleness: 2}`, `{replan: min_cost}` or
/// `stop`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Run this many workers (within `[min_workers, max_workers]`).
    SetWorkers(u32),
    /// Multiply the worker count by this factor (> 0, not 1). Growing rounds up and shrinking
    /// rounds down, so the count always moves by at least one; the result is clamped to
    /// `[min_workers, max_workers]`.
    MultiplyWorkers(f64),
    /// Add this many workers (negative removes), clamped to `[min_workers, max_workers]`.
    AddWorkers(i32),
    /// Set the boundary-node sampling rate of partition parallelism, in (0, 1] (BNS-GCN).
    BoundarySampling(f64),
    /// Set the staleness bound of halo rows in epochs (Sancus); 0 is always fresh.
    Staleness(u32),
    /// Ask the planner for a new plan under this objective.
    Replan(Objective),
    /// Stop training after this epoch (the model of this epoch is the result).
    Stop,
}

/// What the planner optimises.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// The cheapest plan.
    #[default]
    MinCost,
    /// The fastest plan.
    MinTime,
}

impl Objective {
    /// The name used in YAML and in CEL (`objective == 'min_cost'`).
    pub fn as_str(self) -> &'static str {
        match self {
            Objective::MinCost => "min_cost",
            Objective::MinTime => "min_time",
        }
    }
}

/// Spare containers started ahead of a scale-up (idle, outside the mesh) so that the change
/// pays no cold start. Give exactly one of `workers` and `rule`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Prewarm {
    /// CEL condition under which spares are kept warm, usually a looser form of the growing
    /// rule's condition (`delta_loss > -0.04` ahead of `delta_loss > -0.02`).
    pub when: String,
    /// Keep this many spares (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<u32>,
    /// Keep as many spares as this rule's action would add to the current plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
}

fn default_min_workers() -> u32 {
    1
}
fn default_cooldown_epochs() -> u32 {
    DEFAULT_COOLDOWN_EPOCHS
}
fn default_window_epochs() -> u32 {
    DEFAULT_WINDOW_EPOCHS
}

/// The JSON Schema (draft 2020-12) of a policy file, with the field docs as descriptions.
pub fn json_schema() -> serde_json::Value {
    schemars::schema_for!(PolicySet).to_value()
}

// ---------------------------------------------------------------------------------------------
// Action: written by hand so that `set_workers` without a value, or `set_workers:` with a null
// one, says what is missing instead of serde's "invalid type: unit variant".
// ---------------------------------------------------------------------------------------------

const ACTION_NAMES: &[&str] = &[
    "set_workers",
    "multiply_workers",
    "add_workers",
    "boundary_sampling",
    "staleness",
    "replan",
    "stop",
];

fn example(action: &str) -> &'static str {
    match action {
        "set_workers" => "`set_workers: 4`",
        "multiply_workers" => "`multiply_workers: 2`",
        "add_workers" => "`add_workers: -1`",
        "boundary_sampling" => "`boundary_sampling: 0.1`",
        "staleness" => "`staleness: 2`",
        "replan" => "`replan: min_cost` or `replan: min_time`",
        _ => "`stop`",
    }
}

fn unknown_action(name: &str) -> String {
    format!(
        "unknown action `{}`, expected one of {}",
        crate::error::one_line(name),
        ACTION_NAMES
            .iter()
            .map(|n| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

fn needs_target(name: &str) -> String {
    format!(
        "action `{name}` needs a target, e.g. {{{}}}",
        example(name).trim_matches('`')
    )
}

impl<'de> Deserialize<'de> for Action {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ActionVisitor;

        impl<'de> Visitor<'de> for ActionVisitor {
            type Value = Action;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an action: `stop` or a mapping with one key such as `set_workers: 4`")
            }

            fn visit_str<E: de::Error>(self, name: &str) -> Result<Action, E> {
                match name {
                    "stop" => Ok(Action::Stop),
                    n if ACTION_NAMES.contains(&n) => Err(E::custom(needs_target(n))),
                    n => Err(E::custom(unknown_action(n))),
                }
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Action, A::Error> {
                let Some(name) = map.next_key::<String>()? else {
                    return Err(de::Error::custom(
                        "empty action: write `stop` or one key such as `set_workers: 4`",
                    ));
                };
                let action = match name.as_str() {
                    "set_workers" => Action::SetWorkers(target(&mut map, &name)?),
                    "multiply_workers" => Action::MultiplyWorkers(target(&mut map, &name)?),
                    "add_workers" => Action::AddWorkers(target(&mut map, &name)?),
                    "boundary_sampling" => Action::BoundarySampling(target(&mut map, &name)?),
                    "staleness" => Action::Staleness(target(&mut map, &name)?),
                    "replan" => Action::Replan(target(&mut map, &name)?),
                    "stop" => {
                        // `stop:` with no value, or `stop: true`, reads as stop too.
                        let value: Option<bool> = map.next_value()?;
                        if value == Some(false) {
                            return Err(de::Error::custom(
                                "`stop: false` does nothing; remove the rule or write `stop`",
                            ));
                        }
                        Action::Stop
                    }
                    other => return Err(de::Error::custom(unknown_action(other))),
                };
                if let Some(extra) = map.next_key::<String>()? {
                    return Err(de::Error::custom(format!(
                        "an action has one key, found `{name}` and `{}`; use one rule per action",
                        crate::error::one_line(&extra)
                    )));
                }
                Ok(action)
            }
        }

        fn target<'de, A: MapAccess<'de>, T: Deserialize<'de>>(
            map: &mut A,
            name: &str,
        ) -> Result<T, A::Error> {
            match map.next_value::<Option<T>>()? {
                Some(value) => Ok(value),
                None => Err(de::Error::custom(needs_target(name))),
            }
        }

        deserializer.deserialize_any(ActionVisitor)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::SetWorkers(n) => write!(f, "set_workers: {n}"),
            Action::MultiplyWorkers(x) => write!(f, "multiply_workers: {x}"),
            Action::AddWorkers(n) => write!(f, "add_workers: {n}"),
            Action::BoundarySampling(p) => write!(f, "boundary_sampling: {p}"),
            Action::Staleness(s) => write!(f, "staleness: {s}"),
            Action::Replan(o) => write!(f, "replan: {}", o.as_str()),
            Action::Stop => f.write_str("stop"),
        }
    }
}

impl Action {
    /// The action's key in YAML (`set_workers`, ..., `stop`).
    pub fn name(&self) -> &'static str {
        match self {
            Action::SetWorkers(_) => "set_workers",
            Action::MultiplyWorkers(_) => "multiply_workers",
            Action::AddWorkers(_) => "add_workers",
            Action::BoundarySampling(_) => "boundary_sampling",
            Action::Staleness(_) => "staleness",
            Action::Replan(_) => "replan",
            Action::Stop => "stop",
        }
    }

    /// Whether the action changes the worker count.
    pub fn changes_workers(&self) -> bool {
        matches!(
            self,
            Action::SetWorkers(_) | Action::MultiplyWorkers(_) | Action::AddWorkers(_)
        )
    }
}
