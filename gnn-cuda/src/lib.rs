//! The CUDA device of the Physalia GNN engine.
//!
//! - [`device`]: finding a GPU without panicking (no driver, no device, too little memory, missing NVRTC or
//!   cuBLAS are [`GpuError`]s) and choosing between it and the CPU from the worker's spec ([`select`]).
//! - [`kernels`]: the CUDA C source of every kernel (CSR SpMM forward and over the explicit transpose, GAT's
//!   messages, edge softmax and backward passes, elementwise, dropout with the engine's counter-based RNG,
//!   masked cross-entropy, Adam), compiled at run time by NVRTC, and the launch geometry.
//! - [`compile`]: NVRTC compiling the kernels for one device, to SASS for its own architecture (a cubin
//!   loads on any driver of NVRTC's CUDA major version, where PTX needs a driver as new as NVRTC), and the
//!   rule of what a driver loads, as pure functions a CPU test checks against the catalog's oldest driver.
//! - [`cpu_emulate`]: the SpMM kernels (light rows, chunked hub rows) executed thread by thread on the host,
//!   so the GPU's own SpMM algorithm is tested against `physalia_gnn` on machines without a GPU.
//! - [`ops`]: what this device adds to `physalia_gnn::device::Ops` (the trait of the operations a layer needs,
//!   implemented by [`CudaEngine`] and `physalia_gnn::device::Cpu`): the kernels' CSR layout.
//! - [`engine`]: [`CudaEngine`]: context, compute and copy streams, compiled module, cuBLAS, a buffer pool
//!   reused across epochs, pinned halo buffers.
//! - [`launch`]: kernel launches whose argument types are checked against the CUDA signatures.
//! - [`train`]: [`train_resumable_on`]: the full-graph training loop every device shares (`physalia_gnn`'s),
//!   run on a device, with this crate's error.
//!
//! The layer logic is not here: `physalia_gnn::device::DeviceModel` composes the model from the trait once,
//! for every device, and this crate implements the trait for the GPU.
//!
//! cudarc loads the CUDA libraries at run time, so this crate builds and its host tests run with no CUDA
//! installed; the GPU tests (`tests/gpu.rs`) skip with the reason when [`probe`] finds no device.

pub mod compile;
pub mod cpu_emulate;
pub mod device;
pub mod engine;
pub mod kernels;
pub mod launch;
pub mod ops;
pub mod train;

pub use device::{
    DeviceInfo, DevicePreference, GpuError, GpuInfo, Selected, decide, probe, select,
};
pub use engine::{
    CudaEngine, DeviceCsr, DeviceIdx, DeviceLabels, DeviceMatrix, HaloStaging, PoolMode, PoolStats,
};
pub use ops::HostCsr;
pub use train::{TrainError, train_resumable_on};
