//! The contract between the coordinator and its workers, in one place: the worker's environment
//! ([`env`]), the messages and assignment ([`messages`]), the per-epoch record both sides and the report
//! read ([`record`]), and the mutually authenticated QUIC control connection that carries the messages and
//! the job's files ([`channel`], [`transfer`]).
//!
//! The worker, the coordinator, the backends and the report depend on this crate; it depends on the engine
//! (for its metrics and configuration types) and the wire (frames and TLS), never on them.

pub mod channel;
pub mod env;
pub mod memory;
pub mod messages;
pub mod record;
pub mod transfer;

pub use channel::{
    COORDINATOR_NAME, ControlClient, ControlError, ControlServer, Heartbeat, LogSender, Outbox,
    Prefetcher, ServerEvent,
};
pub use messages::{
    Artifact, Assignment, DeviceRequest, ExchangeOptions, MiniBatchOptions, PartCut, PartSource,
    ReadyAs, SeedAs, ServedCut, SignedUrl, ToCoordinator, ToWorker, TrainMode, Upload,
    checkpoint_path,
};
pub use record::{
    Coordinated, CoordinatorRef, EpochEnd, HEARTBEAT_S, JobState, JobStatus, JobSummary,
    LaunchSpan, MetricsLine, RunSummary, ScalingEvent, Summary, WorkerLine,
};
pub use transfer::{Bytes, Files, Source};
