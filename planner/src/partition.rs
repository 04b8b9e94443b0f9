//! The partition step before a launch: which partitioner cuts the graph into a plan's parts, in how
//! long, in how much of the coordinator's memory, and what its parts cost the epochs.
//!
//! Two partitioners (`physalia_graph`): METIS holds the whole graph and its coarsening hierarchy in
//! memory (about 68 bytes per CSR entry measured); the out-of-core streaming partitioner (Fennel
//! restreamed to convergence, then label-propagation refinement) holds 4 bytes per node and reads the
//! edges once per pass. At 1M nodes its cut matched METIS's on an SBM graph and beat it on R-MAT
//! (bench/RESULTS.md, issue 31), in a sixth of the time, but its largest part held 1.23x the edges of
//! METIS's largest on R-MAT (both balance nodes, only METIS also balances edges). So: METIS where it fits
//! in the coordinator's memory and its longer run costs less than the slower epochs the streamed parts
//! would cost over the job; streaming otherwise. A set stored beside the dataset for the part count is
//! reused whichever made it.

use serde::{Deserialize, Serialize};

use crate::cost::{Candidate, Prediction, part_shape};
use crate::input::{Mode, PlanRequest};
use crate::render::{bytes, secs};

/// A partitioner of the graph into a plan's parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Partitioner {
    /// METIS k-way, the whole graph in memory.
    Metis,
    /// The out-of-core streaming partitioner (restreamed Fennel, then label propagation).
    Stream,
}

impl Partitioner {
    pub fn as_str(self) -> &'static str {
        match self {
            Partitioner::Metis => "metis",
            Partitioner::Stream => "stream",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Partitioner::Metis => "METIS",
            Partitioner::Stream => "streaming (Fennel restreamed, then label propagation)",
        }
    }
}

/// One partitioner's figures for a part count.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PartitionCost {
    pub partitioner: Partitioner,
    /// Seconds of the assignment on the coordinator (cutting and writing the parts is not counted:
    /// both partitioners read the dataset once more for it).
    pub seconds: f64,
    /// Peak bytes the assignment holds.
    pub memory_bytes: f64,
    /// Cut edges over all edges the parts are expected to have.
    pub cut_fraction: f64,
    /// Seconds the job's epochs take beyond their time on METIS's parts (the largest part's extra
    /// edges, over every epoch).
    pub epochs_extra_s: f64,
}

impl PartitionCost {
    /// The partition step and what its parts add to the epochs.
    fn total_s(&self) -> f64 {
        self.seconds + self.epochs_extra_s
    }
}

/// The partition step of a plan: which partitioner, its cost, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartitionStep {
    pub parts: u32,
    /// A set for `parts` is stored beside the dataset: it is reused and nothing is computed.
    pub stored: bool,
    /// The partitioner chosen (for a stored set: the one that would compute it were it gone).
    pub chosen: PartitionCost,
    /// The other one, with why it was not taken.
    pub other: PartitionCost,
    /// Memory the coordinator has for the step.
    pub memory_usable_bytes: f64,
    /// The chosen step's seconds at the coordinator's price (0 when stored).
    pub usd: f64,
    /// One sentence: what was chosen and why.
    pub why: String,
    /// Why alone (the part of `why` after what was chosen).
    pub reason: String,
}

/// The partition step for `candidate` (a partition or data mode with more than one part; `None`
/// otherwise), given its prediction (whose compute time the streamed parts' extra edges scale).
pub fn partition_step(
    req: &PlanRequest,
    candidate: &Candidate,
    prediction: &Prediction,
) -> Option<PartitionStep> {
    let k = candidate.parts;
    if k <= 1 || matches!(candidate.mode, Mode::Model) {
        return None;
    }
    let a = &req.assumptions;
    let g = &req.graph;
    let n = g.nodes as f64;
    let e = g.edges as f64;
    let kf = f64::from(k);
    let cut = part_shape(req, k).cut;
    let metis = PartitionCost {
        partitioner: Partitioner::Metis,
        seconds: a.metis_s_per_entry * e,
        memory_bytes: a.metis_bytes_per_entry * e,
        cut_fraction: cut,
        epochs_extra_s: 0.0,
    };
    let stream = PartitionCost {
        partitioner: Partitioner::Stream,
        seconds: a.stream_passes * (a.stream_s_per_entry * e + a.stream_s_per_node_part * n * kf),
        memory_bytes: a.stream_bytes_per_node * n + a.stream_fixed_mib * MIB,
        cut_fraction: (cut * a.stream_cut_factor).min(1.0),
        epochs_extra_s: f64::from(req.train.epochs)
            * prediction.time.compute_s
            * (a.stream_edge_imbalance - 1.0),
    };
    let usable = req
        .constraints
        .coordinator_memory_gib
        .unwrap_or(a.coordinator_memory_gib)
        * GIB
        * a.memory_headroom;
    let stored = req.partitions.iter().any(|p| p.parts == k);
    let (chosen, other, why) = if g.chunked {
        (
            stream,
            metis,
            "the dataset is chunked: METIS would load the whole graph".to_string(),
        )
    } else if metis.memory_bytes > usable {
        (
            stream,
            metis,
            format!(
                "METIS would need {} of the coordinator's {} usable",
                bytes(metis.memory_bytes),
                bytes(usable)
            ),
        )
    } else if stream.total_s() < metis.total_s() {
        (
            stream,
            metis,
            format!(
                "it saves {} against METIS ({}), more than the {} its parts' less even edges add to \
                 the {} epochs",
                secs(metis.seconds - stream.seconds),
                secs(metis.seconds),
                secs(stream.epochs_extra_s),
                req.train.epochs
            ),
        )
    } else {
        (
            metis,
            stream,
            format!(
                "its edge-balanced parts save {} over the {} epochs, more than its longer run ({} \
                 against {} streaming) costs",
                secs(stream.epochs_extra_s),
                req.train.epochs,
                secs(metis.seconds),
                secs(stream.seconds)
            ),
        )
    };
    let reason = why;
    let why = if stored {
        format!(
            "{k} parts stored beside the dataset are reused; computing them again would use {}: {reason}",
            chosen.partitioner.label()
        )
    } else {
        format!(
            "{k} parts by {}: {}, {} on the coordinator; {reason}",
            chosen.partitioner.label(),
            secs(chosen.seconds),
            bytes(chosen.memory_bytes)
        )
    };
    let usd = if stored {
        0.0
    } else {
        chosen.seconds * a.coordinator_usd_per_h / 3600.0
    };
    Some(PartitionStep {
        parts: k,
        stored,
        chosen,
        other,
        memory_usable_bytes: usable,
        usd,
        why,
        reason,
    })
}

const MIB: f64 = (1u64 << 20) as f64;
const GIB: f64 = (1u64 << 30) as f64;
