//! The sans-IO planner: hardware and price catalog, cost model, candidate search, objective,
//! explanations.
//!
//! ```text
//! PlanRequest (graph stats, partition stats, model, training, constraints, assumptions)
//!     + Catalog (infra/catalog/*.yaml or the user's)  + Option<CalibrationProfile>
//!     ──plan()──▶ Plan { chosen, alternatives, rejected, explanation }  or  Err(Infeasible)
//! ```
//!
//! Everything is a pure function of its inputs: no files, no clock, no randomness. The only
//! text handling is [`Catalog::from_yaml_str`] and [`CalibrationProfile::from_yaml_str`],
//! which take text the caller read. The same inputs give the same plan, in the same order.
//!
//! A plan maps back to a job file: `parallelism` = `chosen.candidate.mode`, `workers`,
//! `replicas` (hybrids), `exchange` (partition modes), `minibatch.cache_rows` (data modes),
//! `backend`; [`Plan::sku`] carries the resources for the worker spec (vCPUs, memory, GPU).
//! [`predict`] prices a job's own settings the same way, for `physalia plan` to show next to
//! the plan.
//!
//! - [`catalog`]: container SKUs per backend with their sources; the built-in files.
//! - [`cost`]: the cost model, [`predict`] for one candidate.
//! - [`partition`]: the partition step before a launch: METIS or streaming, by time and memory.
//! - [`search`]: candidate enumeration, constraints, ranking and explanations, [`plan`].
//! - [`render`]: a plan as text (what `physalia plan` prints and the golden files hold).

pub mod assumptions;
pub mod calibration;
pub mod catalog;
pub mod cost;
pub mod error;
pub mod input;
pub mod partition;
pub mod render;
pub mod search;

pub use assumptions::Assumptions;
pub use calibration::CalibrationProfile;
pub use catalog::{Backend, Catalog, Gpu, GpuDriver, MajorMinor, Price, Sku, Sources};
pub use cost::{Candidate, MemoryBreakdown, Prediction, TimeBreakdown, predict};
pub use error::{Location, PlanError};
pub use input::{
    Constraints, ExchangeOptions, GraphStats, Mode, ModelKind, ModelShape, Objective,
    PartitionStats, PlanRequest, RowDtype, TrainShape,
};
pub use partition::{PartitionCost, PartitionStep, Partitioner, partition_step};
pub use search::{Choice, ClassReason, MemoryKind, Plan, Reason, Rejected, candidates, plan};

impl PlanRequest {
    /// Parses a request written as YAML or JSON (tests, `physalia plan --request`); `origin`
    /// names the text in messages. Values are checked by [`plan`] (or [`PlanRequest::validate`]).
    pub fn from_yaml_str(text: &str, origin: &str) -> Result<PlanRequest, PlanError> {
        catalog::parse_located(text, origin)
    }
}
