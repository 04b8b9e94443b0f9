//! `physalia-coordinator`: what a job is and how it runs, without the command line.
//!
//! - [`spec`]: the job file (the `JobSpec` tree, its defaults, its JSON Schema, `--set` overrides and
//!   validation with the field named). It reads the one job file and nothing else.
//! - The sans-IO core, fed events with the time they happened and answering with actions: [`coordinator`]
//!   (one launch: registrations, epochs, failure attribution, timeouts), [`elastic`] (the scaling policy's
//!   state between launches, the cost ledger, replaying a record on resume) and [`job`] (the whole job
//!   joining them: launches, assignments, retries, prewarm, replans, resume), each with its seeded
//!   simulation in virtual time beside it.
//! - [`jobdir`]: the job directory (`job.json`, `status.json`, `metrics.jsonl`, ...) and [`store`]
//!   (feature `store`, on by default): job stores at URLs through `object_store`, mirrored from a
//!   staging folder.
//!
//! - [`driver`] (feature `driver`): the IO edge that carries the core's actions out over a platform's
//!   backend, the control server and the job directory, in client and cluster mode, reporting to an
//!   [`driver::Observer`] instead of printing. The `physalia` CLI is its caller.
//!
//! Module imports have no cycle among the core: `job -> {coordinator, elastic}`, `elastic -> spec`,
//! `store -> jobdir`; `spec`, `coordinator` and `jobdir` import no other module of this crate. The
//! drivers import the core, never the other way.

pub mod coordinator;
#[cfg(feature = "driver")]
pub mod driver;
pub mod elastic;
pub mod job;
pub mod jobdir;
pub mod spec;
#[cfg(feature = "store")]
pub mod store;
