//! The CUDA device of the Physalia GNN engine.
//!
//! - [`device`]: finding a GPU without panicking (no driver, no device, too little memory, missing NVRTC or
//!   cuBLAS are [`GpuError`]s) and choosing between it and the CPU from the worker's spec ([`select`]).
//! - [`kernels`]: the CUDA C source of every kernel (CSR SpMM forward and over the explicit transpose, GAT's
//!   messages, edge softmax and backward passes, elementwise, dropout with the engine's counter-based RNG,
//!   masked cross-entropy, Adam), compiled at run time by NVRTC, and the launch geometry.
//! - [`cpu_emulate`]: the same kernels executed thread by thread on the host, so their algorithms are tested
//!   against `physalia_gnn` on machines without a GPU.
//! - [`ops`]: the operations a layer needs, as a trait implemented by [`CudaEngine`] and [`Emulator`].
//! - [`engine`]: [`CudaEngine`]: context, compute and copy streams, compiled module, cuBLAS, a buffer pool
//!   reused across epochs, pinned halo buffers.
//! - [`launch`]: kernel launches whose argument types are checked against the CUDA signatures.
//! - [`model`]: [`DeviceModel`]: `physalia_gnn::Model`'s forward, backward and Adam composed from [`Ops`], on the
//!   whole graph or a worker's partition (halo rows through a `physalia_gnn::Exchange`).
//! - [`train`]: [`train_resumable_on`]: the CPU's full-graph training loop on a device.
//!
//! cudarc loads the CUDA libraries at run time, so this crate builds and its host tests run with no CUDA
//! installed; the GPU tests (`tests/gpu.rs`) skip with the reason when [`probe`] finds no device.

pub mod cpu_emulate;
pub mod device;
pub mod engine;
pub mod kernels;
pub mod launch;
pub mod model;
pub mod ops;
pub mod train;

pub use device::{
    DeviceInfo, DevicePreference, GpuError, GpuInfo, Selected, decide, probe, select,
};
pub use engine::{
    CudaEngine, DeviceCsr, DeviceIdx, DeviceLabels, DeviceMatrix, HaloStaging, PoolStats,
};
pub use model::{AdamConfig, DeviceGraph, DeviceModel};
pub use ops::{Emulator, HostCsr, Ops, View};
pub use train::{TrainError, train_resumable_on};
