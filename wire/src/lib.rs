//! Tensor framing, the [`Link`] between workers, the collectives that run over it, and the mutually
//! authenticated QUIC mesh that implements it across machines.
//!
//! Partition-parallel training moves two things between workers: halo rows (each layer, forward and
//! backward) and weight gradients (all-reduced once per step). Both are `f32` buffers, so this crate knows
//! nothing about graphs or models: it moves rows with a [`Tag`] saying which epoch, layer and phase they
//! belong to, and checks on arrival that they are the rows that were expected.
//!
//! - [`frame`]: the versioned binary header every message carries, and 16-bit compression of payloads.
//! - [`link`]: the [`Link`] trait (blocking, every wait bounded by a timeout) and [`MemLink`], its in-memory
//!   twin over channels, which tests and single-machine runs use.
//! - [`collectives`]: [`halo_exchange`] and the deterministic [`all_reduce_sum`], generic over any `Link`.
//! - [`tls`]: the per-job certificate authority and the rustls configurations (mutual TLS, aws-lc-rs).
//! - [`quic`]: [`QuicEndpoint`] / [`QuicLink`], the `Link` over quinn; only holders of a certificate from
//!   the job's CA join the mesh (design invariant 5).
//!
//! Architecture Invariant: this crate is a leaf; it depends on no other Physalia crate.

pub mod collectives;
pub mod error;
pub mod frame;
pub mod link;
pub mod quic;
pub mod tls;

pub use collectives::{
    Tag, all_reduce_sum, all_reduce_sum_f64, all_to_all_bytes, fetch_rows, halo_exchange,
};
pub use error::WireError;
pub use frame::{
    Dtype, Frame, FrameHeader, HEADER_LEN, MAGIC, MAX_PAYLOAD_BYTES, Phase, VERSION, decode_f32,
    encode_f32,
};
pub use link::{Link, MemLink, Traffic, TrafficCounts, WaitGuard, Waiting};
pub use quic::{
    MeshAbort, QuicEndpoint, QuicLink, QuicOptions, Refusal, peer_certificates, read_frame_bounded,
};
pub use tls::{
    JobCa, TlsIdentity, check_cert_name, client_config, install_crypto_provider, job_key,
    server_config, worker_name,
};
