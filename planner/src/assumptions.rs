//! The cost model's constants, each with where its default comes from. A request may override
//! any of them (`assumptions:` in a plan request); `physalia calibrate` replaces the engine's
//! rates for the local machine (see [`crate::CalibrationProfile`]).

use serde::{Deserialize, Serialize};

use crate::error::PlanError;

/// Efficiencies, rates and model parameters the cost model does not get from the catalog.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Assumptions {
    /// Achieved GEMM rate over the GPU's FP32 peak: the CUDA engine's cuBLAS products took 9.8 ms
    /// of an SBM 2M GCN epoch for 311 GFLOP on an H200 (67 TFLOP/s peak), 0.47; 0.57 alone
    /// (bench/RESULTS.md, issue 32's third GPU session).
    pub gpu_gemm_efficiency: f64,
    /// Achieved bandwidth of sparse gathers and element-wise passes over the GPU's peak: SpMM
    /// reaches 73-80% of the H200's measured copy bandwidth (4.2 of 4.8 TB/s peak), the fused
    /// element-wise kernels about as much; 0.65 reproduces the measured GCN and GraphSAGE epochs
    /// at 1M and 2M nodes within 2% (bench/RESULTS.md).
    pub gpu_memory_efficiency: f64,
    /// [`Assumptions::elementwise_passes`] of the CUDA engine: the hidden layer's bias, activation
    /// and dropout fused into one read and one write forward; backward the activation's gradient
    /// written over the layer (three sweeps) and the bias's column sums (one).
    pub gpu_elementwise_passes: f64,
    /// A GAT layer's forward on the GPU in SpMM passes of its width: scores, softmax and the
    /// weighted gather, 1.7 (27 ms of an SBM 2M epoch where the SpMM model gives 16).
    pub gpu_gat_forward_gathers: f64,
    /// A GAT layer's backward on the GPU in SpMM passes: the per-edge score gradients and the
    /// transposed gather of the output's gradient, 6.3 (101 ms of the same epoch, 99 of them the two
    /// backward kernels, after `gat_backward_edges` took a row's edges across its lanes). The kernels
    /// reach under a third of SpMM's bandwidth there: where GAT's GPU time can be won.
    pub gpu_gat_backward_gathers: f64,
    /// Achieved GEMM rate over the catalog's CPU peak: 60 GFLOP/s measured on 2 vCPUs
    /// (bench/RESULTS.md) over 2 x 96 GFLOP/s (AVX-512, 2 FMA units, 3 GHz, 2 vCPUs per core).
    pub cpu_gemm_efficiency: f64,
    /// Achieved SpMM and element-wise bandwidth over the catalog's CPU memory bandwidth; the
    /// SBM 1M GCN epoch of bench/RESULTS.md (2.8 s) is reproduced with 0.5.
    pub cpu_memory_efficiency: f64,
    /// Sampler rate per loader thread: 230.7 M edges/s on 2 threads (bench/RESULTS.md).
    pub sampler_edges_per_s_per_vcpu: f64,
    /// Goodput over the NIC's line rate (headers, QUIC, TLS).
    pub network_efficiency: f64,
    /// Throughput of one QUIC connection (quinn, user-space crypto and pacing); it caps each
    /// peer link below fast NICs. An estimate: not measured in this repository yet.
    pub quic_flow_gbit_s: f64,
    /// One-way latency between two workers of a cloud SKU without its own figure.
    pub network_latency_us: f64,
    /// Host-to-GPU copies of mini-batch inputs (PCIe 4 x16 is 32 GB/s raw; pinned copies
    /// reach 12-25).
    pub host_to_device_gb_s: f64,
    /// Reading the dataset at start on the local machine (page cache or NVMe); cloud workers
    /// load at their network rate.
    pub local_load_gb_s: f64,
    /// Cut fraction model when a k-way partitioning was not measured:
    /// `c(k) = cut_fraction_max (1 - 1/sqrt k)`. 0.3 gives 0.15 at k = 4, the SBM 1M METIS
    /// cut of bench/RESULTS.md (748,159 of 5,000,000 edges).
    pub cut_fraction_max: f64,
    /// Largest part over the mean part (METIS's default tolerance is 1.03).
    pub partition_imbalance: f64,
    /// Cache hit rate of data parallelism: `(cached / remote rows) ^ exponent`. 0.7 matches the
    /// measured 25.1% for 2,000 of 15,000 remote rows (bench/RESULTS.md, modes table).
    pub cache_hit_exponent: f64,
    /// Share of the host memory left over that the planner gives to the remote-row cache.
    pub cache_memory_fraction: f64,
    /// Usable share of a memory (fragmentation, allocator slack, the OS).
    pub memory_headroom: f64,
    /// Fixed device memory of a GPU worker (CUDA context, cuBLAS workspace).
    pub gpu_runtime_gib: f64,
    /// Fixed host memory of a worker (binary, QUIC buffers, loader threads). Not measured; a
    /// full-graph CPU worker uses [`Assumptions::cpu_partition_runtime_gib`] instead.
    pub host_runtime_gib: f64,
    /// Fixed memory of a partition-parallel CPU worker: its binary, QUIC, the allocator's
    /// per-thread arenas and slack. Measured on SBM 1M GraphSAGE at 1, 2 and 4 workers
    /// (bench/RESULTS.md, issue 17): the peak RSS less what the engine holds at its peak, 0.09 to
    /// 0.14 GiB.
    pub cpu_partition_runtime_gib: f64,
    /// Sweeps (a read or a write) over each layer's output per epoch: forward bias and
    /// activation fused (2) and dropout (2), backward the same.
    pub elementwise_passes: f64,
    /// Per-epoch fixed cost of a cloud worker (barrier, metrics to the coordinator).
    pub epoch_overhead_s: f64,
    /// Share of halo exchange hidden behind compute in partition parallelism. 0: the engine
    /// waits for a layer's halo rows before it aggregates.
    pub partition_overlap: f64,
    /// METIS's seconds per CSR entry on one core: 15-24 s for the 20M entries of SBM and R-MAT at
    /// 1M nodes on the 2-vCPU development VM, less opening and validating the file
    /// (bench/RESULTS.md, issue 31).
    pub metis_s_per_entry: f64,
    /// METIS's peak bytes per CSR entry (the graph, its weights and the coarsening hierarchy):
    /// 1.3-1.4 GiB for those 20M entries, whatever the feature width.
    pub metis_bytes_per_entry: f64,
    /// Passes the streaming partitioner makes over the edges: restreaming until at most 0.1% of
    /// the nodes move (at most 20) and up to 8 refinement passes; 10 on SBM 1M, 22 on R-MAT.
    pub stream_passes: f64,
    /// Seconds per CSR entry of one streaming pass (12.7 ns fitted to SBM 1M at k = 4 and 16).
    pub stream_s_per_entry: f64,
    /// Seconds per node and part of one streaming pass (each node scores every part; 8.8 ns).
    pub stream_s_per_node_part: f64,
    /// The streaming partitioner's bytes per node (the assignment and the previous pass's);
    /// 29 MiB at 1M nodes and 50 MiB at 4M measured with the fixed part below.
    pub stream_bytes_per_node: f64,
    /// Its fixed memory: two edge chunks read ahead, counters, the binary.
    pub stream_fixed_mib: f64,
    /// Its cut over METIS's: 1.00 on SBM 1M, 0.72 on R-MAT 2^20 at k = 4, 0.71-1.00 at 8 and 16.
    pub stream_cut_factor: f64,
    /// Its largest part's edges over METIS's largest part's (both balance nodes; METIS also
    /// balances edges): 1.00 on SBM, 1.23 on R-MAT 2^20 at k = 4. The power-law figure, so the
    /// planner leans to METIS where the time allows.
    pub stream_edge_imbalance: f64,
    /// Memory of the process that partitions: a cluster-mode coordinator is at most 8 GiB
    /// (Fargate's largest for 1 vCPU). A request's `constraints.coordinator_memory_gib` replaces it.
    pub coordinator_memory_gib: f64,
    /// The coordinator's price while it partitions: Fargate, 1 vCPU and 8 GiB in us-east-1
    /// ($0.04048 per vCPU-hour and $0.004445 per GB-hour).
    pub coordinator_usd_per_h: f64,
}

impl Default for Assumptions {
    fn default() -> Self {
        Assumptions {
            gpu_gemm_efficiency: 0.5,
            gpu_memory_efficiency: 0.65,
            gpu_elementwise_passes: 6.0,
            gpu_gat_forward_gathers: 1.7,
            gpu_gat_backward_gathers: 6.3,
            cpu_gemm_efficiency: 0.31,
            cpu_memory_efficiency: 0.5,
            sampler_edges_per_s_per_vcpu: 115e6,
            network_efficiency: 0.7,
            quic_flow_gbit_s: 4.0,
            network_latency_us: 100.0,
            host_to_device_gb_s: 12.0,
            local_load_gb_s: 2.0,
            cut_fraction_max: 0.3,
            partition_imbalance: 1.03,
            cache_hit_exponent: 0.7,
            cache_memory_fraction: 0.5,
            memory_headroom: 0.9,
            gpu_runtime_gib: 1.0,
            host_runtime_gib: 0.5,
            cpu_partition_runtime_gib: 0.125,
            elementwise_passes: 8.0,
            epoch_overhead_s: 0.05,
            partition_overlap: 0.0,
            metis_s_per_entry: 1.0e-6,
            metis_bytes_per_entry: 68.0,
            stream_passes: 20.0,
            stream_s_per_entry: 12.7e-9,
            stream_s_per_node_part: 8.8e-9,
            stream_bytes_per_node: 8.0,
            stream_fixed_mib: 24.0,
            stream_cut_factor: 1.0,
            stream_edge_imbalance: 1.23,
            coordinator_memory_gib: 8.0,
            coordinator_usd_per_h: 0.07604,
        }
    }
}

impl Assumptions {
    /// The first constant out of range.
    pub fn validate(&self) -> Result<(), PlanError> {
        let fractions = [
            ("gpu_gemm_efficiency", self.gpu_gemm_efficiency),
            ("gpu_memory_efficiency", self.gpu_memory_efficiency),
            ("cpu_gemm_efficiency", self.cpu_gemm_efficiency),
            ("cpu_memory_efficiency", self.cpu_memory_efficiency),
            ("network_efficiency", self.network_efficiency),
            ("cache_memory_fraction", self.cache_memory_fraction),
            ("memory_headroom", self.memory_headroom),
        ];
        for (name, v) in fractions {
            if !(v > 0.0 && v <= 1.0) {
                return Err(PlanError::invalid(
                    format!("assumptions.{name}"),
                    format!("must be in (0, 1], got {v}"),
                ));
            }
        }
        let positive = [
            (
                "sampler_edges_per_s_per_vcpu",
                self.sampler_edges_per_s_per_vcpu,
            ),
            ("quic_flow_gbit_s", self.quic_flow_gbit_s),
            ("host_to_device_gb_s", self.host_to_device_gb_s),
            ("local_load_gb_s", self.local_load_gb_s),
            ("cache_hit_exponent", self.cache_hit_exponent),
            ("elementwise_passes", self.elementwise_passes),
            ("gpu_elementwise_passes", self.gpu_elementwise_passes),
            ("gpu_gat_forward_gathers", self.gpu_gat_forward_gathers),
            ("gpu_gat_backward_gathers", self.gpu_gat_backward_gathers),
            ("metis_s_per_entry", self.metis_s_per_entry),
            ("metis_bytes_per_entry", self.metis_bytes_per_entry),
            ("stream_passes", self.stream_passes),
            ("stream_s_per_entry", self.stream_s_per_entry),
            ("stream_bytes_per_node", self.stream_bytes_per_node),
            ("stream_cut_factor", self.stream_cut_factor),
            ("coordinator_memory_gib", self.coordinator_memory_gib),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(PlanError::invalid(
                    format!("assumptions.{name}"),
                    format!("must be a finite number above 0, got {v}"),
                ));
            }
        }
        let non_negative = [
            ("network_latency_us", self.network_latency_us),
            ("gpu_runtime_gib", self.gpu_runtime_gib),
            ("host_runtime_gib", self.host_runtime_gib),
            ("cpu_partition_runtime_gib", self.cpu_partition_runtime_gib),
            ("epoch_overhead_s", self.epoch_overhead_s),
            ("stream_s_per_node_part", self.stream_s_per_node_part),
            ("stream_fixed_mib", self.stream_fixed_mib),
            ("coordinator_usd_per_h", self.coordinator_usd_per_h),
        ];
        for (name, v) in non_negative {
            if !(v.is_finite() && v >= 0.0) {
                return Err(PlanError::invalid(
                    format!("assumptions.{name}"),
                    format!("must be a finite number at least 0, got {v}"),
                ));
            }
        }
        if !(self.cut_fraction_max >= 0.0 && self.cut_fraction_max <= 1.0) {
            return Err(PlanError::invalid(
                "assumptions.cut_fraction_max",
                format!("must be in [0, 1], got {}", self.cut_fraction_max),
            ));
        }
        if !(self.partition_overlap >= 0.0 && self.partition_overlap <= 1.0) {
            return Err(PlanError::invalid(
                "assumptions.partition_overlap",
                format!("must be in [0, 1], got {}", self.partition_overlap),
            ));
        }
        if !(self.stream_edge_imbalance.is_finite() && self.stream_edge_imbalance >= 1.0) {
            return Err(PlanError::invalid(
                "assumptions.stream_edge_imbalance",
                format!(
                    "must be a finite number at least 1, got {}",
                    self.stream_edge_imbalance
                ),
            ));
        }
        if !(self.partition_imbalance.is_finite() && self.partition_imbalance >= 1.0) {
            return Err(PlanError::invalid(
                "assumptions.partition_imbalance",
                format!(
                    "must be a finite number at least 1, got {}",
                    self.partition_imbalance
                ),
            ));
        }
        Ok(())
    }
}
