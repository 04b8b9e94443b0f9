//! The Physalia GNN engine.
//!
//! Dense row-major f32 tensors ([`Matrix`]), products parallelised over fixed row blocks ([`dense`]), sparse
//! aggregation operators with their transposes ([`sparse`]), GCN / GraphSAGE / GAT layers whose forward and
//! backward are split at the aggregation where rows owned by other workers enter ([`model`], [`exchange`]),
//! masked cross-entropy, Adam, and the full-graph training loop ([`mod@train`]).
//!
//! [`device`] is the seam between the layer logic and the hardware: the [`Ops`] trait every device implements
//! (here [`Cpu`], in `physalia-gnn-cuda` the GPU) and [`DeviceModel`], the layers composed from it once.
//!
//! Every kernel is deterministic for any number of threads: reductions run in fixed blocks and random
//! numbers are counter-based ([`rng`]).

pub mod config;
pub mod dense;
pub mod device;
pub mod exchange;
mod gat;
mod gather;
pub mod heap;
pub mod loss;
pub mod model;
pub mod optim;
pub mod order;
pub mod profile;
pub mod rng;
pub mod save;
pub mod sparse;
pub mod tensor;
pub mod train;

pub use config::{Activation, LayerKind, ModelConfig};
pub use device::{Cpu, CpuPrimitives, DeviceError, DeviceGraph, DeviceModel, Ops};
pub use exchange::{
    Exchange, ExchangeError, ExchangeStats, HaloGrads, HaloSeed, LayerBytes, LocalExchange,
    VisitRows,
};
pub use model::{LocalGraph, Model, Param, Pass};
pub use optim::Adam;
pub use order::RowOrder;
pub use tensor::Matrix;
pub use train::{
    BatchStats, EpochEnd, EpochMetrics, EpochStep, NodeSets, Progress, TrainConfig, TrainSummary,
    close_epoch, evaluate, global_accuracies, train, train_loop, train_resumable,
    train_resumable_owned,
};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid model configuration: {0}")]
    Config(String),
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("exchange with peers failed: {0}")]
    Exchange(ExchangeError),
    #[error("training diverged at epoch {epoch}: loss is {loss}")]
    Diverged { epoch: usize, loss: f64 },
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Format(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
