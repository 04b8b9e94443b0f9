//! Physalia's graph data: the dataset file format, importers for common on-disk layouts, seeded synthetic
//! generators, and the CSR view the training engine reads.
//!
//! Everything produces an [`OwnedDataset`]; [`OwnedDataset::write`] stores it as one safetensors file and
//! [`Dataset::open`] maps it back, validated, so the rest of the system never parses text formats or
//! re-checks indices at training time. [`partition`] cuts a dataset into per-worker parts (METIS) and
//! stores them beside the dataset file; [`stream`] partitions by streaming the CSR rows (Fennel/LDG with
//! restreaming) in O(n) memory, for graphs METIS cannot hold. [`sample`] draws GraphSAGE-style mini-batches (sampled
//! computation graphs) and prefetches them on a thread pool.
//!
//! Crate-wide conventions: node ids are `i32` in the CSR and `i64` in labels and splits (the dtypes
//! PyTorch/NumPy users expect); CSR row `v` lists the in-neighbours of `v`; label `-1` means unlabelled.

pub mod chunked;
pub mod chunked_import;
pub mod chunked_partition;
pub mod chunked_shuffle;
pub mod chunked_synth;
pub mod csr;
pub mod error;
pub mod format;
pub mod import;
mod npy;
pub mod partition;
mod rng;
pub mod sample;
mod spill;
pub mod stream;
pub mod synth;

pub use chunked::{
    ChunkedDataset, ChunkedHeader, ChunkedWriter, DEFAULT_CHUNK_ROWS, Manifest, NodeChunk,
    is_chunked, write_chunked,
};
pub use csr::{Csr, csr_from_edge_pairs, csr_from_edges};
pub use error::Error;
pub use format::{
    Dataset, FORMAT_VERSION, FeatureDtype, FeatureView, Features, GraphStats, Metadata,
    OwnedDataset, Split, TENSOR_NAMES, checksum,
};
pub use import::ImportOptions;
pub use partition::{
    Part, PartitionSet, PartitionSummary, Partitioning, build_parts, ensure_partitions,
    list_partitions, partition_metis,
};
pub use stream::{
    PartitionQuality, RowSource, StreamAlgorithm, StreamOrder, StreamOutcome, StreamParams,
    partition_stream, partition_stream_rows,
};
pub use synth::{RmatParams, SbmParams};
