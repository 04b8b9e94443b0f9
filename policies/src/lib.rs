//! Scaling policies, sans IO: the YAML schema of a policy, its CEL conditions, and a pure
//! evaluator from the metrics of the epochs so far to a [`Decision`] with its reasons.
//!
//! Between epochs the coordinator calls [`evaluate`] with the policy, the [`EpochRecord`]s so
//! far, the running [`PlanState`] and the epoch of the last change; it gets back either "keep"
//! or a [`Change`] (the rule that fired, its action, the resolved [`Effect`] such as a worker
//! count clamped to `[min_workers, max_workers]`, and the metric values its condition read),
//! plus how many spare containers to prewarm. [`simulate`] replays a whole history the same
//! way; the golden tests replay the example policies of `examples/policies/` through it.
//!
//! Reading a policy: [`parse_str`] parses a policy file and runs [`check`]; every problem comes
//! back with `file:line:column`, inside the CEL condition where that is where it is. For a
//! policy embedded in a larger document (the `scaling:` section of a job file), deserialize
//! [`PolicySet`] as part of that document, run [`check`], and place the errors with
//! [`locate`].
//!
//! The variables a condition can read are listed in [`METRICS`], with when each is missing.
//! A rule that reads a missing variable does not fire; a valid policy never errors at run time.
//!
//! Architecture Invariant: nothing in this crate does IO, reads a clock or draws a random
//! number; [`evaluate`] is a function of its arguments.

mod check;
mod conditions;
mod error;
mod eval;
mod locate;
mod metrics;
mod noise;
mod parse;
mod schema;

pub use check::{MAX_RULE_NAME_CHARS, MAX_WORKERS, check};
pub use conditions::{MAX_CONDITION_CHARS, MAX_CONDITION_DEPTH};
pub use error::{Location, PolicyError, PolicyErrors};
pub use eval::{
    Bound, Change, Decision, Effect, RuleCheck, RuleOutcome, effect, evaluate, simulate,
};
pub use locate::locate;
pub use metrics::{
    EpochRecord, METRICS, MetricDoc, MetricType, MetricValue, PlanState, is_metric, variables,
};
pub use noise::{NoiseScaleParts, gradient_noise_scale, noise_scale_parts};
pub use parse::parse_str;
pub use schema::{
    Action, DEFAULT_COOLDOWN_EPOCHS, DEFAULT_WINDOW_EPOCHS, Objective, PolicySet, Prewarm, Resize,
    Rule, json_schema,
};
