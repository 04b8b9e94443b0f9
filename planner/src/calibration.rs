//! What `physalia calibrate` measured on this machine, in place of catalog peaks for the
//! `local` backend's SKUs.
//!
//! The measuring is the CLI's (it runs the engine's kernels, the sampler and a loopback QUIC
//! link once and stores the result as JSON or YAML); this module only defines the profile and
//! checks it. The cost model uses achieved rates directly, with no efficiency factor, so a
//! profile measured with the same thread count as the job predicts that machine.

use serde::{Deserialize, Serialize};

use crate::catalog::{non_negative, parse_located, positive, positive_opt};
use crate::error::PlanError;

/// Achieved rates of the engine and the loopback network on one machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CalibrationProfile {
    /// A description of the machine (CPU model, cores, memory); no host names.
    pub machine: String,
    /// When it was measured (YYYY-MM-DD).
    pub measured_on: String,
    /// Compute threads the kernels ran with.
    pub threads: u32,
    /// Dense products at GNN shapes (tall and narrow, `n x 128 x 256`).
    #[serde(deserialize_with = "positive")]
    pub gemm_gflop_s: f64,
    /// The cores' peak rate (fused multiply-adds in registers on every thread), the limit GEMM is held
    /// against; absent in profiles from before it was measured.
    #[serde(
        default,
        deserialize_with = "positive_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub peak_gflop_s: Option<f64>,
    /// SpMM, counted as bytes the roofline charges (index, weight, gathered row, written row).
    #[serde(deserialize_with = "positive")]
    pub spmm_gb_s: f64,
    /// Streaming element-wise passes (bias, activation, dropout, optimizer).
    #[serde(deserialize_with = "positive")]
    pub stream_gb_s: f64,
    /// Neighbour sampler through the loader, all `threads` threads.
    #[serde(deserialize_with = "positive")]
    pub sampler_edges_per_s: f64,
    /// QUIC over loopback between two worker processes, one direction.
    #[serde(deserialize_with = "positive")]
    pub loopback_gbit_s: f64,
    /// Round trip of a small message over that link, halved.
    #[serde(deserialize_with = "non_negative")]
    pub loopback_latency_us: f64,
    /// Per-epoch cost that does not scale with the graph (barriers, metrics, allocation).
    #[serde(deserialize_with = "non_negative")]
    pub epoch_overhead_s: f64,
}

impl CalibrationProfile {
    /// What the engine's dense products reach of the cores' peak here (`None`: no peak measured): the
    /// planner takes it as the GEMM efficiency of CPU SKUs elsewhere, whose catalog gives their peak.
    pub fn gemm_fraction_of_peak(&self) -> Option<f64> {
        self.peak_gflop_s
            .map(|peak| (self.gemm_gflop_s / peak).clamp(0.01, 1.0))
    }

    /// The numbers of bench/RESULTS.md for the 2-core development VM (2026-11-21): GEMM
    /// ~60 GFLOP/s, sampler 230.7 M edges/s on 2 threads, 31.6 GiB/s read bandwidth. SpMM,
    /// loopback and overhead were not measured there: estimates, until `physalia calibrate`
    /// runs.
    pub fn dev_vm_2026_11() -> CalibrationProfile {
        CalibrationProfile {
            machine: "2-core KVM VM, Sapphire Rapids class, 24 GiB (bench/RESULTS.md)".into(),
            measured_on: "2026-11-21".into(),
            threads: 2,
            gemm_gflop_s: 60.0,
            peak_gflop_s: None,
            spmm_gb_s: 17.0,
            stream_gb_s: 17.0,
            sampler_edges_per_s: 230.7e6,
            loopback_gbit_s: 8.0,
            loopback_latency_us: 30.0,
            epoch_overhead_s: 0.01,
        }
    }

    /// Parses a stored profile (YAML or JSON; JSON is YAML); `origin` names it in messages.
    pub fn from_yaml_str(text: &str, origin: &str) -> Result<CalibrationProfile, PlanError> {
        let p: CalibrationProfile = parse_located(text, origin)?;
        if p.threads == 0 {
            return Err(PlanError::Parse {
                origin: origin.to_string(),
                location: None,
                path: "threads".into(),
                message: "must be at least 1".into(),
            });
        }
        Ok(p)
    }
}
