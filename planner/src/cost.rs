//! The cost model: for one candidate (mode, workers, parts, replicas, SKU, exchange options) it
//! predicts memory per worker, epoch time and money. Pure arithmetic on the request, the SKU,
//! the [`Assumptions`] and an optional [`CalibrationProfile`].
//!
//! Each kernel is charged on the SKU's roofline, `max(flops / gemm rate, bytes / memory
//! rate)`; each transfer as `bytes / min(NIC goodput, peers x per-connection cap) + latency`.
//! The work itself follows what the engine does (docs/ARCHITECTURE.md,
//! worker-image/src/minibatch.rs):
//!
//! - partition: each worker computes its part every epoch; per layer it receives its halo rows
//!   forward and returns their gradients backward at the layer's exchange width (GCN and SAGE
//!   aggregate the narrower of input and output, so the first layer transforms first when
//!   `feat_dim > hidden`); with no input dropout the first layer's `A X` and its halo rows are
//!   computed and sent once per run; weight gradients are all-reduced once per epoch.
//! - data: every worker holds the whole CSR and the feature rows of its METIS part, samples
//!   blocks for its own seeds, fetches remote input rows the cache misses, and all-reduces
//!   gradients every step; loader threads overlap sampling with training on a GPU SKU.
//!   Evaluation is the partition-parallel full-graph forward.
//! - model (P3): features split by column; every worker samples every batch of the step and
//!   computes the first layer's partial products of its columns, sends them to the batch
//!   owners and gets their gradients back; the other layers are data-parallel. Evaluation runs
//!   the whole graph on every worker after an all-reduce of the first layer's output.
//! - hybrid: `replicas` groups of `parts` workers. Partition replicas split the training nodes
//!   but each still runs the forward and backward over its whole part; data replicas split the
//!   seeds over `parts x replicas` workers while features are split only `parts` ways.
//!
//! Evaluation is a full-graph forward; when the first layer aggregates raw features its `A X`
//! is computed once (with its feature-wide halo rows) and kept, whatever training does. A P3
//! worker's first-layer gradient recomputes the aggregation of its column slice. A CPU loader
//! samples, builds each block's CSR and transpose, and fills the zeroed input matrix row by row.
//!
//! A shared host (`shared_host` in the catalog: the local machine) runs a job's `n` workers as
//! `n` processes on one machine, so each gets `1/n` of its compute, memory bandwidth, sampler,
//! loading rate and memory, every process pays the fixed per-epoch cost, and the workers share
//! its loopback: one calibrated flow (sender and receiver) occupies about two cores, so the host
//! carries `vcpus / 2` of them, split among the `n` workers that all send at once. The machine
//! is paid once. On this repository's 2-core machine exchanges in which every worker sends and
//! receives at once measured about half to three quarters of that rate (bench/RESULTS.md,
//! grounding): the profile measures one flow in one direction only.

use serde::{Deserialize, Serialize};

use crate::assumptions::Assumptions;
use crate::calibration::CalibrationProfile;
use crate::catalog::{Backend, Sku};
use crate::error::PlanError;
use crate::input::{ExchangeOptions, Mode, ModelKind, PlanRequest};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
/// Bytes of an f32, the engine's compute type.
const F32: f64 = 4.0;

/// One way to run the job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Candidate {
    pub mode: Mode,
    /// Containers, `parts x replicas`.
    pub workers: u32,
    /// METIS parts of a replica group (partition), feature parts (data), or column slices
    /// (model).
    pub parts: u32,
    /// Replica groups; above 1 this is a hybrid.
    pub replicas: u32,
    pub sku: String,
    pub backend: Backend,
    /// Halo exchange options (partition modes; the job's options elsewhere, unused).
    pub exchange: ExchangeOptions,
    /// Remote feature rows cached per worker (data modes; 0 elsewhere). The planner picks it
    /// unless the request fixed it.
    pub cache_rows: u64,
}

impl Candidate {
    /// `partition`, `data`, `model`, `hybrid-partition` or `hybrid-data`.
    pub fn kind(&self) -> &'static str {
        match (self.mode, self.replicas > 1) {
            (Mode::Partition, false) => "partition",
            (Mode::Data, false) => "data",
            (Mode::Model, _) => "model",
            (Mode::Partition, true) => "hybrid-partition",
            (Mode::Data, true) => "hybrid-data",
        }
    }

    /// `hybrid-data 4x2 on ecs-g5.xlarge`, `partition 8 on local (bf16)`.
    pub fn describe(&self) -> String {
        let shape = if self.replicas > 1 {
            format!("{}x{}", self.parts, self.replicas)
        } else {
            self.workers.to_string()
        };
        let mut out = format!("{} {} on {}", self.kind(), shape, self.sku);
        if self.mode == Mode::Partition
            && self.parts > 1
            && (!self.exchange.is_exact() || self.exchange.rematerialize)
        {
            out.push_str(&format!(" ({})", self.exchange.label()));
        }
        out
    }
}

/// Predicted bytes per worker, by what they hold. On a GPU SKU the items split between the
/// GPU (`device_bytes`) and the host (`host_bytes`); on a CPU SKU both totals are the same.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    /// Input feature rows (owned, halo inputs, or a column slice), f32.
    pub features_bytes: f64,
    /// CSR structure (local with its transpose, or the whole graph's for sampling).
    pub structure_bytes: f64,
    /// Saved activations and gradient buffers of the largest pass (training or evaluation).
    pub activations_bytes: f64,
    /// Halo rows received and boundary rows to send.
    pub halo_bytes: f64,
    /// Weights, gradients and Adam's two moments.
    pub optimizer_bytes: f64,
    /// `A X` of the first layer, stale halo rows, or the remote-row cache.
    pub cache_bytes: f64,
    /// Fixed cost of the process (and the CUDA context on a GPU).
    pub runtime_bytes: f64,
    /// What the kernels' device must hold, and its usable size.
    pub device_bytes: f64,
    pub device_usable_bytes: f64,
    /// What host memory must hold, and its usable size.
    pub host_bytes: f64,
    pub host_usable_bytes: f64,
}

/// Predicted seconds. Per-epoch terms are summed over the epoch's steps; sampling overlaps
/// training on a GPU SKU, so the terms need not add up to `epoch_s`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TimeBreakdown {
    /// Kernels of training (dense, sparse, element-wise, optimizer).
    pub compute_s: f64,
    /// Sampling and gathering batch inputs on loader threads.
    pub sample_s: f64,
    /// Halo rows, remote feature rows, or P3 partials and their gradients.
    pub exchange_s: f64,
    /// Gradient all-reduces.
    pub allreduce_s: f64,
    /// Full-graph evaluation, per epoch (one pass every `eval_every` epochs).
    pub eval_s: f64,
    /// Fixed per-epoch cost.
    pub overhead_s: f64,
    /// One training epoch, steady state.
    pub epoch_s: f64,
    /// Once per run: cold start, loading the worker's data, precomputing `A X`.
    pub setup_s: f64,
    /// `setup_s + epochs x epoch_s`.
    pub total_s: f64,
}

/// What the cost model predicts for one candidate.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub memory: MemoryBreakdown,
    pub time: TimeBreakdown,
    /// Optimizer steps per epoch (1 for full-graph training).
    pub steps_per_epoch: u64,
    /// Bytes one worker sends per training epoch: halo rows and their gradients (partition),
    /// remote feature rows and their ids (data), partials and their gradients (model).
    pub exchange_bytes_per_epoch: f64,
    /// Bytes one worker sends in gradient all-reduces per epoch.
    pub allreduce_bytes_per_epoch: f64,
    /// Bytes one worker sends for evaluation, per epoch (amortised over `eval_every`).
    pub eval_bytes_per_epoch: f64,
    /// Remote feature rows cached (data modes).
    pub cache_rows: u64,
    /// Share of remote input rows the cache serves (data modes).
    pub cache_hit_rate: f64,
    /// Halo rows of the largest part (partition modes and the evaluation of data modes).
    pub halo_rows: u64,
    /// Whether the partitioning's numbers come from the cut model rather than artifacts.
    pub partition_estimated: bool,
    /// USD per second for all workers.
    pub usd_per_s: f64,
    /// `epoch_s x usd_per_s`.
    pub usd_per_epoch: f64,
    /// `total_s x usd_per_s`.
    pub usd_total: f64,
}

/// Achieved rates of one SKU.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rates {
    gemm_flop_s: f64,
    mem_byte_s: f64,
    sampler_edges_s: f64,
    nic_byte_s: f64,
    flow_byte_s: f64,
    latency_s: f64,
    h2d_byte_s: Option<f64>,
    load_byte_s: f64,
    overhead_s: f64,
    gpu: bool,
    /// Sweeps over each layer's output per epoch (the CPU's or the GPU's count).
    passes: f64,
    /// A GAT layer's forward and backward in SpMM passes of its width (1 on the CPU, whose
    /// attention terms are the `stream`s of [`layer_work`]).
    gat_gathers: (f64, f64),
}

impl Rates {
    /// The rates one of `workers` workers gets. On a shared host (the local machine) the workers
    /// are processes splitting the machine: each gets `1/workers` of its compute, memory
    /// bandwidth, sampler and loading throughput, and of its loopback (see
    /// [`Rates::loopback_share`]); the fixed per-epoch cost is work of every process, paid at
    /// that share too. Elsewhere every worker has a whole SKU.
    pub(crate) fn of(
        sku: &Sku,
        a: &Assumptions,
        profile: Option<&CalibrationProfile>,
        workers: u32,
    ) -> Rates {
        let r = Rates::whole(sku, a, profile);
        if !sku.shared_host || workers <= 1 {
            return r;
        }
        let share = 1.0 / f64::from(workers);
        // a profile knows the machine's cores better than the catalog
        let vcpus = profile.map_or(sku.vcpus, |p| f64::from(p.threads));
        let net = Rates::loopback_share(vcpus, workers);
        Rates {
            gemm_flop_s: r.gemm_flop_s * share,
            mem_byte_s: r.mem_byte_s * share,
            sampler_edges_s: r.sampler_edges_s * share,
            nic_byte_s: r.nic_byte_s * net,
            flow_byte_s: r.flow_byte_s * net,
            load_byte_s: r.load_byte_s * share,
            overhead_s: r.overhead_s / share,
            ..r
        }
    }

    /// Share of the measured loopback rate one of `workers` processes gets when all of them
    /// send and receive at once. Moving a byte over loopback QUIC is CPU work on both ends
    /// (encryption, packets, copies): the calibration's one flow occupies about two cores, so the
    /// host carries `vcpus / 2` such flows, shared by the workers.
    fn loopback_share(vcpus: f64, workers: u32) -> f64 {
        (vcpus / 2.0 / f64::from(workers)).min(1.0)
    }

    /// The rates of one whole SKU.
    fn whole(sku: &Sku, a: &Assumptions, profile: Option<&CalibrationProfile>) -> Rates {
        let nic = sku.network_gbit_s * 1e9 / 8.0 * a.network_efficiency;
        let flow_gbit = sku
            .single_flow_gbit_s
            .map_or(a.quic_flow_gbit_s, |f| f.min(a.quic_flow_gbit_s));
        let latency_s = sku.network_latency_us.unwrap_or(a.network_latency_us) * 1e-6;
        let load_byte_s = if sku.backend.on_this_machine() {
            a.local_load_gb_s * 1e9
        } else {
            nic
        };
        if let Some(p) = profile.filter(|_| sku.backend.on_this_machine()) {
            return Rates {
                gemm_flop_s: p.gemm_gflop_s * 1e9,
                mem_byte_s: p.spmm_gb_s * 1e9,
                sampler_edges_s: p.sampler_edges_per_s,
                nic_byte_s: p.loopback_gbit_s * 1e9 / 8.0,
                flow_byte_s: p.loopback_gbit_s * 1e9 / 8.0,
                latency_s: p.loopback_latency_us * 1e-6,
                h2d_byte_s: None,
                load_byte_s,
                overhead_s: p.epoch_overhead_s,
                gpu: false,
                passes: a.elementwise_passes,
                gat_gathers: (1.0, 1.0),
            };
        }
        let gpu = sku.is_gpu();
        let (gemm_eff, mem_eff) = if gpu {
            (a.gpu_gemm_efficiency, a.gpu_memory_efficiency)
        } else {
            // the engine's products reach the same share of a CPU's peak wherever they run: a profile
            // that measured it here says what it is, better than the assumption
            let gemm = profile
                .and_then(CalibrationProfile::gemm_fraction_of_peak)
                .unwrap_or(a.cpu_gemm_efficiency);
            (gemm, a.cpu_memory_efficiency)
        };
        Rates {
            gemm_flop_s: sku.fp32_tflops * 1e12 * gemm_eff,
            mem_byte_s: sku.memory_bandwidth_gb_s * 1e9 * mem_eff,
            // One vCPU drives the trainer; the others sample (a CPU SKU shares them with
            // compute, which `step` charges by not overlapping).
            sampler_edges_s: a.sampler_edges_per_s_per_vcpu
                * if gpu {
                    (sku.vcpus - 1.0).max(1.0)
                } else {
                    sku.vcpus
                },
            nic_byte_s: nic,
            flow_byte_s: flow_gbit * 1e9 / 8.0,
            latency_s,
            h2d_byte_s: gpu.then_some(a.host_to_device_gb_s * 1e9),
            load_byte_s,
            overhead_s: a.epoch_overhead_s,
            gpu,
            passes: if gpu {
                a.gpu_elementwise_passes
            } else {
                a.elementwise_passes
            },
            gat_gathers: if gpu {
                (a.gpu_gat_forward_gathers, a.gpu_gat_backward_gathers)
            } else {
                (1.0, 1.0)
            },
        }
    }

    /// Seconds to send `bytes` spread over `peers` connections (and receive as many).
    fn transfer(&self, bytes: f64, peers: f64, rounds: f64) -> f64 {
        if peers <= 0.0 || bytes <= 0.0 {
            return 0.0;
        }
        bytes / self.nic_byte_s.min(peers * self.flow_byte_s) + rounds * self.latency_s
    }
}

/// Time of a set of kernels on one roofline.
#[derive(Debug, Default, Clone, Copy)]
struct Work {
    s: f64,
}

impl Work {
    fn kernel(&mut self, r: &Rates, flops: f64, bytes: f64) {
        self.s += (flops / r.gemm_flop_s).max(bytes / r.mem_byte_s);
    }
    /// `rows x k` times `k x n`.
    fn gemm(&mut self, r: &Rates, rows: f64, k: f64, n: f64) {
        self.kernel(r, 2.0 * rows * k * n, F32 * (rows * k + k * n + rows * n));
    }
    /// Aggregation over `edges` into `dst` rows of `width`: index and weight per edge, the
    /// gathered row, the written row.
    fn spmm(&mut self, r: &Rates, dst: f64, edges: f64, width: f64) {
        self.spmm_times(r, dst, edges, width, 1.0);
    }
    /// `times` passes of [`Work::spmm`] (a GAT layer's, see [`Rates::gat_gathers`]).
    fn spmm_times(&mut self, r: &Rates, dst: f64, edges: f64, width: f64, times: f64) {
        self.kernel(
            r,
            2.0 * edges * width * times,
            (edges * 8.0 + edges * width * F32 + dst * width * F32) * times,
        );
    }
    fn stream(&mut self, r: &Rates, bytes: f64) {
        self.kernel(r, 0.0, bytes);
    }
}

/// One layer's widths.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layer {
    input: f64,
    output: f64,
    /// Width of the aggregated rows, and of the exchanged rows.
    agg: f64,
    exch: f64,
    /// GCN/SAGE: aggregate the input, then transform (`(A H) W`).
    agg_first: bool,
    /// Dense products of the layer's width (SAGE: root and neighbour).
    gemms: f64,
    heads: f64,
    gat: bool,
    self_loops: bool,
}

pub(crate) fn layers(req: &PlanRequest) -> Vec<Layer> {
    let m = &req.model;
    let n_layers = m.layers as usize;
    let gat = m.kind == ModelKind::Gat;
    let hidden_out = f64::from(m.hidden) * if gat { f64::from(m.heads) } else { 1.0 };
    (0..n_layers)
        .map(|l| {
            let input = if l == 0 {
                f64::from(req.graph.feat_dim)
            } else {
                hidden_out
            };
            let last = l + 1 == n_layers;
            let (output, heads) = if last {
                let h = if gat { f64::from(m.out_heads) } else { 1.0 };
                (f64::from(req.graph.classes) * h, h)
            } else {
                (hidden_out, if gat { f64::from(m.heads) } else { 1.0 })
            };
            if gat {
                Layer {
                    input,
                    output,
                    agg: output,
                    exch: output + heads,
                    agg_first: false,
                    gemms: 1.0,
                    heads,
                    gat,
                    self_loops: true,
                }
            } else {
                let agg = input.min(output);
                Layer {
                    input,
                    output,
                    agg,
                    exch: agg,
                    agg_first: input <= output,
                    gemms: if m.kind == ModelKind::Sage { 2.0 } else { 1.0 },
                    heads: 1.0,
                    gat,
                    self_loops: m.kind == ModelKind::Gcn,
                }
            }
        })
        .collect()
}

/// Weights of the model (biases and attention vectors included).
pub(crate) fn parameters(layers: &[Layer]) -> f64 {
    layers
        .iter()
        .map(|l| l.input * l.output * l.gemms + l.output + if l.gat { 2.0 * l.output } else { 0.0 })
        .sum()
}

/// Whether the first layer's `A X` is computed once per run.
fn first_layer_cached(req: &PlanRequest, layers: &[Layer]) -> bool {
    req.model.input_dropout == 0.0 && layers.first().is_some_and(|l| l.agg_first)
}

/// Whether evaluation reuses a stored `A X`: a full-graph forward of a first layer that
/// aggregates raw features computes it once (no dropout in evaluation) and keeps it, whatever
/// training does.
fn first_layer_cached_in_eval(layers: &[Layer]) -> bool {
    layers.first().is_some_and(|l| l.agg_first)
}

/// The cut-fraction model: `c(k) = c_max (1 - 1/sqrt k)`.
pub fn estimated_cut_fraction(k: u32, a: &Assumptions) -> f64 {
    a.cut_fraction_max * (1.0 - 1.0 / f64::from(k.max(1)).sqrt())
}

/// The largest part of a k-way partitioning: owned rows, halo rows, local CSR entries, cut
/// fraction; and whether it was estimated.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PartShape {
    owned: f64,
    halo: f64,
    edges: f64,
    pub(crate) cut: f64,
    estimated: bool,
}

pub(crate) fn part_shape(req: &PlanRequest, k: u32) -> PartShape {
    let n = req.graph.nodes as f64;
    let e = req.graph.edges as f64;
    if let Some(p) = req.partitions.iter().find(|p| p.parts == k) {
        let max = |v: &[u64]| v.iter().copied().max().unwrap_or(0) as f64;
        return PartShape {
            owned: max(&p.owned_rows),
            halo: max(&p.halo_rows),
            edges: max(&p.local_edges),
            cut: if e > 0.0 {
                (p.edge_cut as f64 / (e / 2.0)).min(1.0)
            } else {
                0.0
            },
            estimated: false,
        };
    }
    if k <= 1 {
        return PartShape {
            owned: n,
            halo: 0.0,
            edges: e,
            cut: 0.0,
            estimated: false,
        };
    }
    let a = &req.assumptions;
    let kf = f64::from(k);
    let owned = (n / kf * a.partition_imbalance).min(n);
    let cut = estimated_cut_fraction(k, a);
    // Each cut edge puts one halo entry in each of its two parts; distinct halo nodes are
    // those entries landing on `remote` nodes, drawn uniformly (balls into bins). On the SBM
    // 1M graph of bench/RESULTS.md this gives 295k rows per part against 294.7k measured.
    let entries = e * cut / kf;
    let remote = n - owned;
    let halo = if remote > 0.0 {
        remote * (1.0 - (-entries / remote).exp())
    } else {
        0.0
    };
    PartShape {
        owned,
        halo,
        edges: (e / kf * a.partition_imbalance).min(e),
        cut,
        estimated: true,
    }
}

/// Nodes reached (cumulative, hop 0 = seeds) and edges drawn per hop for one batch.
fn sample_sizes(req: &PlanRequest, batch: f64) -> (Vec<f64>, Vec<f64>) {
    let n = req.graph.nodes as f64;
    let mean_degree = req.graph.edges as f64 / n;
    let fanouts = req.train.fanouts_for(req.model.layers);
    let mut reached = vec![batch.min(n)];
    let mut edges = vec![0.0];
    for f in fanouts {
        let prev = *reached.last().expect("starts with the seeds");
        // min(fan-out, mean degree): within 6% of the sampler's measured edges per batch on
        // the SBM of bench/RESULTS.md; it overestimates a power-law graph (conservative).
        let per_node = f.map_or(mean_degree, |f| f64::from(f).min(mean_degree));
        let drawn = prev * per_node;
        let new = (n - prev) * (1.0 - (-drawn / n).exp());
        edges.push(drawn);
        reached.push(prev + new);
    }
    (reached, edges)
}

/// Forward (and backward) of one layer over `dst` destination rows, `src` source rows and
/// `edges` sampled or local edges.
#[allow(clippy::too_many_arguments)]
fn layer_work(
    w: &mut Work,
    r: &Rates,
    l: &Layer,
    input: f64,
    dst: f64,
    src: f64,
    edges: f64,
    first: bool,
    cached: bool,
    backward: bool,
) {
    let edges = edges + if l.self_loops { dst } else { 0.0 };
    let agg_first = input <= l.output && !l.gat;
    let agg = if l.gat { l.output } else { input.min(l.output) };
    // Messages are computed for every source row a worker holds (in a block, all of them;
    // full-graph, its own rows: halo rows arrive transformed).
    let msg_rows = if agg_first { dst } else { src };
    let fwd = |w: &mut Work| {
        if !(first && cached) {
            w.spmm_times(
                r,
                dst,
                edges,
                agg,
                if l.gat { r.gat_gathers.0 } else { 1.0 },
            );
        }
        w.gemm(r, msg_rows, input, l.output);
        if l.gemms > 1.0 {
            w.gemm(r, dst, input, l.output);
        }
        if l.gat {
            w.stream(r, edges * l.heads * F32 * 4.0);
        }
        w.stream(r, dst * l.output * F32 * r.passes / 2.0);
    };
    fwd(w);
    if !backward {
        return;
    }
    // dW, and dX except for the input layer.
    let products = if first { 1.0 } else { 2.0 };
    for _ in 0..products as usize {
        w.gemm(r, msg_rows, input, l.output);
        if l.gemms > 1.0 {
            w.gemm(r, dst, input, l.output);
        }
    }
    if !(first && agg_first) {
        w.spmm_times(
            r,
            src,
            edges,
            agg,
            if l.gat { r.gat_gathers.1 } else { 1.0 },
        );
    }
    if l.gat {
        w.stream(r, edges * l.heads * F32 * 8.0);
    }
    w.stream(r, dst * l.output * F32 * r.passes / 2.0);
}

/// One full-graph pass over a part: the kernels' seconds and the halo bytes sent per pass
/// (layer 0's excluded when its `A X` is cached, or when its halo rows are kept: `input_kept`).
#[allow(clippy::too_many_arguments)]
fn full_graph_pass(
    r: &Rates,
    layers: &[Layer],
    p: &PartShape,
    cached: bool,
    input_kept: bool,
    backward: bool,
) -> (f64, f64, f64) {
    let mut w = Work::default();
    let mut halo_bytes = 0.0;
    let mut rounds = 0.0;
    for (i, l) in layers.iter().enumerate() {
        let first = i == 0;
        layer_work(
            &mut w, r, l, l.input, p.owned, p.owned, p.edges, first, cached, backward,
        );
        if !(first && (cached || input_kept)) {
            halo_bytes += p.halo * l.exch * F32;
            rounds += 1.0;
        }
        if backward && !(first && l.agg_first) {
            halo_bytes += p.halo * l.exch * F32;
            rounds += 1.0;
        }
    }
    (w.s, halo_bytes, rounds)
}

impl Candidate {
    /// Checks the shape of a candidate built in code: at least one part and one replica,
    /// `workers = parts x replicas`, no replicas in model parallelism, the SKU's name.
    pub fn validate(&self, sku: &Sku) -> Result<(), PlanError> {
        let bad = |m: String| Err(PlanError::invalid("candidate", m));
        if self.parts == 0 || self.replicas == 0 {
            return bad(format!(
                "needs at least one part and one replica, got {} x {}",
                self.parts, self.replicas
            ));
        }
        if u64::from(self.parts) * u64::from(self.replicas) != u64::from(self.workers) {
            return bad(format!(
                "{} workers are not {} parts x {} replicas",
                self.workers, self.parts, self.replicas
            ));
        }
        if self.mode == Mode::Model && self.replicas != 1 {
            return bad("model parallelism has no replicas".into());
        }
        if self.sku != sku.name || self.backend != sku.backend {
            return bad(format!(
                "names SKU `{}` on {}, but the SKU given is `{}` on {}",
                self.sku,
                self.backend.as_str(),
                sku.name,
                sku.backend.as_str()
            ));
        }
        Ok(())
    }
}

/// Predicts one candidate: for `physalia plan` on a job file's own settings, or to compare a
/// hand-made candidate with the plan. Checks the request, the SKU and the candidate first.
/// For data modes `candidate.cache_rows` is ignored: the request's `train.cache_rows` is used
/// when set, else the prediction picks the cache (and reports it).
pub fn predict(
    req: &PlanRequest,
    sku: &Sku,
    candidate: &Candidate,
    profile: Option<&CalibrationProfile>,
) -> Result<Prediction, PlanError> {
    req.validate()?;
    sku.validate()?;
    candidate.validate(sku)?;
    if let Some(why) = crate::search::unsupported(req, candidate) {
        return Err(PlanError::invalid("candidate", why));
    }
    Ok(predict_checked(req, sku, candidate, profile))
}

/// [`predict`] on inputs already checked.
pub(crate) fn predict_checked(
    req: &PlanRequest,
    sku: &Sku,
    candidate: &Candidate,
    profile: Option<&CalibrationProfile>,
) -> Prediction {
    let a = &req.assumptions;
    let r = Rates::of(sku, a, profile, candidate.workers);
    let ls = layers(req);
    let params = parameters(&ls);
    let mut pred = match candidate.mode {
        Mode::Partition => partition(req, candidate, &r, &ls, params),
        Mode::Data => data(req, sku, candidate, &r, &ls, params),
        Mode::Model => model(req, candidate, &r, &ls, params),
    };
    let m = &mut pred.memory;
    let host_runtime_gib = if !r.gpu && candidate.mode == Mode::Partition {
        a.cpu_partition_runtime_gib
    } else {
        a.host_runtime_gib
    };
    m.runtime_bytes = host_runtime_gib * GIB + if r.gpu { a.gpu_runtime_gib * GIB } else { 0.0 };
    m.host_bytes += host_runtime_gib * GIB;
    if r.gpu {
        m.device_bytes += a.gpu_runtime_gib * GIB;
    } else {
        m.device_bytes = m.host_bytes;
    }
    // processes on a shared host split its memory
    let memory_share = if sku.shared_host {
        1.0 / f64::from(candidate.workers)
    } else {
        1.0
    };
    m.device_usable_bytes = sku.device_memory_bytes() * a.memory_headroom * memory_share;
    m.host_usable_bytes = sku.host_memory_bytes() * a.memory_headroom * memory_share;

    let t = &mut pred.time;
    t.overhead_s = r.overhead_s;
    t.epoch_s += t.overhead_s;
    t.setup_s += sku.cold_start_s;
    t.total_s = t.setup_s + f64::from(req.train.epochs) * t.epoch_s;
    // a shared host is paid once, whatever runs on it
    pred.usd_per_s = sku.usd_per_s()
        * if sku.shared_host {
            1.0
        } else {
            f64::from(candidate.workers)
        };
    pred.usd_per_epoch = t.epoch_s * pred.usd_per_s;
    pred.usd_total = t.total_s * pred.usd_per_s;
    pred
}

/// Adds an item to the totals: on the device, the host, or (CPU SKU) the one memory.
fn place(m: &mut MemoryBreakdown, gpu: bool, bytes: f64, on_device: bool) {
    if gpu && on_device {
        m.device_bytes += bytes;
    } else {
        m.host_bytes += bytes;
    }
}

/// Bytes of a CSR with its transpose and per-edge weights (`dst` rows, `src` columns).
fn local_csr_bytes(dst: f64, src: f64, edges: f64) -> f64 {
    (dst + 1.0) * 8.0 + (src + 1.0) * 8.0 + edges * 16.0
}

/// Bytes of the CPU engine's operator for `kind` (`gnn::sparse::SparseOp`): the CSR and its
/// transpose, each with an index per entry; a weight per entry forward, and per entry (GCN's
/// symmetric weights) or per destination row (GraphSAGE's mean, GAT's structure) transposed; GAT's
/// attention also maps each transposed entry to its forward one. GCN and GAT add self-loops.
fn cpu_operator_bytes(kind: ModelKind, dst: f64, src: f64, edges: f64) -> f64 {
    let pointers = (dst + 1.0) * 8.0 + (src + 1.0) * 8.0;
    match kind {
        ModelKind::Gcn => pointers + (edges + dst) * 16.0,
        ModelKind::Sage => pointers + edges * 12.0 + dst * F32,
        ModelKind::Gat => pointers + (edges + dst) * 16.0 + dst * F32,
    }
}

/// What the CPU engine holds for GCN and GraphSAGE layers at the peak of a training epoch, besides
/// the features, the cached `A X`, the operator and the halo rows (`gnn::model`): every hidden
/// layer's output (the next layer's input, activation and dropout in place) and the `A H` of an
/// aggregate-first layer after the first, kept for backward; then the larger of one layer's
/// forward products (transform-first: `H [W | W_root]` and its aggregation; the last layer's
/// logits) and backward's gradient buffers (a layer's output gradient and its aggregation over
/// owned and halo rows). With a first layer that aggregates its input, the second layer's input
/// gradient is formed a row block at a time, never whole. The forward products coexist with the
/// halo rows (`halo_buffers` bytes, counted apart); backward's buffers already cover the halo rows'
/// gradients, so they are charged only for what exceeds the halo buffers.
fn cpu_full_graph_training_activations(
    layers: &[Layer],
    rows: f64,
    halo: f64,
    halo_buffers: f64,
) -> f64 {
    let last = layers.len().saturating_sub(1);
    let mut kept = 0.0;
    let mut forward: f64 = 0.0;
    for (i, l) in layers.iter().enumerate() {
        if i < last {
            kept += rows * l.output;
        }
        if l.agg_first && i > 0 {
            kept += rows * l.input;
        }
        let products = if l.agg_first {
            0.0
        } else {
            rows * l.output * l.gemms
        };
        let output = if i == last { rows * l.output } else { 0.0 };
        forward = forward.max(products + output);
    }
    // fused: the first layer's output gradient (the second's input gradient) is never whole
    let fused = layers.len() > 1 && layers[0].agg_first;
    let widest = layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let output = if fused && i == 0 { 0.0 } else { l.output };
            let input = if i == 0 || (fused && i == 1) {
                0.0
            } else {
                l.input
            };
            output.max(input)
        })
        .fold(0.0, f64::max);
    let backward = 2.0 * (rows + halo) * widest * F32 - halo_buffers;
    (kept + forward) * F32 + (backward - forward * F32).max(0.0)
}

/// Widest gradient buffer of a backward pass: every layer's output, and every input but the
/// first layer's (no gradient flows into the features).
fn widest_gradient(layers: &[Layer]) -> f64 {
    layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            if i == 0 {
                l.output
            } else {
                l.input.max(l.output)
            }
        })
        .fold(0.0, f64::max)
}

/// Saved activations of a full-graph pass over `rows` owned and `halo` rows (the features
/// themselves are counted apart).
///
/// With rematerialisation `halo` is the halo rows held at once (one peer's), and GAT keeps
/// per destination its softmax's maximum and sum and per halo row its scores instead of a
/// coefficient per edge; backward's per-edge buffers exist one layer at a time.
fn full_graph_activations(
    layers: &[Layer],
    rows: f64,
    halo: f64,
    edges: f64,
    backward: bool,
    remat: Option<f64>,
) -> f64 {
    if !backward {
        // Layer-wise inference keeps one layer's input (owned and halo rows; the first
        // layer's is the features), its messages and its output.
        return layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let input = if i == 0 { 0.0 } else { (rows + halo) * l.input };
                (input + (rows + halo) * l.output + rows * l.agg) * F32
            })
            .fold(0.0, f64::max);
    }
    let mut bytes = 0.0;
    let mut edge_buffers: f64 = 0.0;
    for l in layers {
        bytes += rows * (l.agg + 2.0 * l.output) * F32;
        if l.gat {
            match remat {
                None => bytes += (edges + rows) * l.heads * F32 * 2.0,
                Some(all_halo) => {
                    bytes += (3.0 * rows + all_halo) * l.heads * F32;
                    edge_buffers = edge_buffers.max((edges + rows) * l.heads * F32 * 2.0);
                }
            }
        }
    }
    // Gradient buffers over owned and halo rows.
    bytes + edge_buffers + 2.0 * (rows + halo) * widest_gradient(layers) * F32
}

fn partition(req: &PlanRequest, c: &Candidate, r: &Rates, ls: &[Layer], params: f64) -> Prediction {
    let a = &req.assumptions;
    let g = &req.graph;
    let feat = f64::from(g.feat_dim);
    let p = part_shape(req, c.parts);
    let cached = first_layer_cached(req, ls);
    let x = &c.exchange;
    let peers = f64::from(c.parts - 1);
    let workers = f64::from(c.workers);

    // Rematerialisation (SAR): every exchange runs in `peers` rounds of one peer each; a worker
    // holds one peer's halo rows at a time; GAT sends its scores ahead of its rows and its rows
    // again in backward, and recomputes its attention there.
    let remat = x.rematerialize && c.parts > 1;
    // With input dropout a first layer that aggregates first changes every epoch, but its halo
    // rows are the peers' features: the engine fetches them once (setup, every row whatever the
    // exchange samples) and draws their dropout mask itself (its kept input halo).
    let input_kept = !cached && ls[0].agg_first && !remat;
    // Training epoch.
    let (compute_s, halo_f32, rounds) = full_graph_pass(r, ls, &p, cached, input_kept, true);
    let (remat_f32, remat_s) = if remat {
        let mut w = Work::default();
        let mut extra = 0.0;
        for l in ls.iter().filter(|l| l.gat) {
            extra += p.halo * (l.exch + l.heads) * F32;
            w.stream(r, (p.edges + p.owned) * l.heads * F32 * 4.0);
        }
        (extra, w.s)
    } else {
        (0.0, 0.0)
    };
    let compute_s = compute_s + remat_s;
    let rounds = if remat { rounds * peers } else { rounds };
    let halo_scale = x.boundary_sampling / f64::from(x.staleness + 1) * x.dtype.bytes() / F32;
    let halo_bytes = (halo_f32 + remat_f32) * halo_scale;
    let exchange_s = r.transfer(halo_bytes, peers, rounds);
    // the halo rows a worker holds at once
    let held = if remat { p.halo / peers } else { p.halo };
    // Adam: read weight, gradient and both moments, write three of them.
    let mut opt = Work::default();
    opt.stream(r, params * F32 * 7.0);
    let allreduce_bytes = if workers > 1.0 {
        2.0 * (workers - 1.0) / workers * params * F32
    } else {
        0.0
    };
    let allreduce_s = r.transfer(allreduce_bytes, workers - 1.0, 2.0);
    // Evaluation: exact forward (f32, every row, no staleness).
    let eval_cached = first_layer_cached_in_eval(ls);
    let (eval_compute, eval_halo, eval_rounds) =
        full_graph_pass(r, ls, &p, eval_cached, false, false);
    let eval_rounds = if remat {
        eval_rounds * peers
    } else {
        eval_rounds
    };
    let eval_s = (eval_compute + r.transfer(eval_halo, peers, eval_rounds))
        / f64::from(req.train.eval_every);
    let compute_s = compute_s + opt.s;
    let hidden = a.partition_overlap * compute_s.min(exchange_s);
    let epoch_s = compute_s + exchange_s + allreduce_s - hidden + eval_s;

    // Setup: load the part, precompute A X and send its halo rows once (for training, or
    // at the first evaluation).
    let first = ls[0];
    let halo_inputs = if first.agg_first { held } else { 0.0 };
    let structure_bytes = local_csr_bytes(p.owned, p.owned + p.halo, p.edges + p.owned);
    let load_bytes = p.owned * feat * f64::from(g.feature_bytes_per_value) + p.edges * 4.0;
    let mut setup_s = load_bytes / r.load_byte_s;
    let cached = cached || eval_cached;
    if cached {
        let mut w = Work::default();
        w.spmm(r, p.owned, p.edges + p.owned, feat);
        setup_s += w.s + r.transfer(p.halo * feat * F32, peers, 1.0);
    }

    // Memory. The CPU engine's GCN and GraphSAGE layers are modelled on what it holds (measured,
    // bench/RESULTS.md); GAT and the GPU engine keep the general model.
    let kind = req.model.kind;
    let cpu_layers = !r.gpu && kind != ModelKind::Gat;
    let train_cached = first_layer_cached(req, ls);
    let widest_exch = |skip: usize| ls.iter().skip(skip).map(|l| l.exch).fold(0.0, f64::max);
    let (features_bytes, activations_bytes, halo_buffer_bytes) = if cpu_layers {
        // the CPU engine holds one layer's halo rows at a time, and the rows it sends for them
        // (`skip`: the first layer, whose halo rows only `A X`'s computation reads)
        let skip = usize::from(train_cached);
        let halo = 2.0 * held * widest_exch(skip) * F32;
        let activations = cpu_full_graph_training_activations(ls, p.owned, held, halo);
        // With `A X` cached, the first layer's halo rows exist only while it is computed, before
        // the first epoch, three times over (the rows gathered for the peers, their frames, the
        // rows received), and GCN's features are freed then: what only that moment holds counts
        // where it outweighs what the epochs hold.
        let owned_x = p.owned * feat * F32;
        let halo_x = 3.0 * held * feat * F32;
        let (resident_x, setup_only) = match (train_cached, kind) {
            (true, ModelKind::Gcn) => (0.0, owned_x + halo_x),
            (true, _) => (owned_x, halo_x),
            (false, _) => (owned_x + halo_inputs * feat * F32, 0.0),
        };
        let features = resident_x + (setup_only - activations - halo).max(0.0);
        (features, activations, halo)
    } else {
        (
            (p.owned + halo_inputs) * feat * F32,
            full_graph_activations(ls, p.owned, held, p.edges, true, remat.then_some(p.halo)),
            if remat {
                // one round's rows received and one peer's sent
                2.0 * held * widest_exch(0) * F32
            } else {
                ls.iter().map(|l| p.halo * l.exch * F32).sum::<f64>()
                    + p.halo * widest_exch(0) * F32
            },
        )
    };
    let structure_bytes = if r.gpu {
        structure_bytes
    } else {
        cpu_operator_bytes(kind, p.owned, p.owned + p.halo, p.edges)
    };
    let mut m = MemoryBreakdown {
        features_bytes,
        structure_bytes,
        activations_bytes,
        halo_bytes: halo_buffer_bytes,
        optimizer_bytes: params * F32 * 4.0,
        cache_bytes: if cached { p.owned * feat * F32 } else { 0.0 }
            + if x.staleness > 0 {
                ls.iter().map(|l| p.halo * l.exch * F32).sum::<f64>()
            } else {
                0.0
            },
        ..MemoryBreakdown::default()
    };
    let device_items = m.features_bytes
        + m.structure_bytes
        + m.activations_bytes
        + m.halo_bytes
        + m.optimizer_bytes
        + m.cache_bytes;
    if r.gpu {
        m.device_bytes = device_items;
        // The loaded part stays in host memory (the worker reads the part file there).
        m.host_bytes = p.owned * feat * f64::from(g.feature_bytes_per_value) + structure_bytes;
    } else {
        m.host_bytes = device_items;
    }
    Prediction {
        memory: m,
        time: TimeBreakdown {
            compute_s,
            sample_s: 0.0,
            exchange_s,
            allreduce_s,
            eval_s,
            overhead_s: 0.0,
            epoch_s,
            setup_s,
            total_s: 0.0,
        },
        steps_per_epoch: 1,
        exchange_bytes_per_epoch: halo_bytes,
        allreduce_bytes_per_epoch: allreduce_bytes,
        eval_bytes_per_epoch: eval_halo / f64::from(req.train.eval_every),
        cache_rows: 0,
        cache_hit_rate: 0.0,
        halo_rows: p.halo.round() as u64,
        partition_estimated: p.estimated && c.parts > 1,
        ..Prediction::default()
    }
}

/// Training kernels of one batch over `layers[from..]`, block sizes from `reached`/`edges`.
fn batch_work(r: &Rates, ls: &[Layer], reached: &[f64], edges: &[f64], from: usize) -> f64 {
    let n_layers = ls.len();
    let mut w = Work::default();
    for (i, l) in ls.iter().enumerate().skip(from) {
        let dst = reached[n_layers - 1 - i];
        let src = reached[n_layers - i];
        let e = edges[n_layers - i];
        layer_work(&mut w, r, l, l.input, dst, src, e, i == 0, false, true);
    }
    w.s
}

/// Saved activations of one batch over `layers[from..]`.
fn batch_activations(ls: &[Layer], reached: &[f64], edges: &[f64], from: usize) -> f64 {
    let n_layers = ls.len();
    ls.iter()
        .enumerate()
        .skip(from)
        .map(|(i, l)| {
            let dst = reached[n_layers - 1 - i];
            let src = reached[n_layers - i];
            let e = edges[n_layers - i];
            src * l.agg.max(l.input.min(l.output)) * F32
                + dst * (l.agg + 2.0 * l.output) * F32
                + if l.gat {
                    (e + dst) * l.heads * F32 * 2.0
                } else {
                    0.0
                }
                + 2.0
                    * src
                    * if i == 0 {
                        l.output
                    } else {
                        l.input.max(l.output)
                    }
                    * F32
        })
        .sum()
}

/// Host time to gather a batch's input rows (and copy them to the GPU). On the CPU the input
/// matrix is zero-filled, then every row is read and written: three passes over its bytes.
fn gather_s(r: &Rates, rows: f64, width: f64) -> f64 {
    let bytes = rows * width * F32;
    match r.h2d_byte_s {
        Some(h2d) => bytes / h2d,
        None => 3.0 * bytes / r.mem_byte_s,
    }
}

/// Bytes a loader touches to turn a sampled batch into the engine's blocks: per block a CSR
/// with weights and its transpose (per edge: the index read, index and weight written, the
/// transpose's count, position, index, permutation and weight, about 60 bytes) and per source
/// its id and whole-graph degree plus the transpose's row pointers (about 48 bytes).
fn block_bytes(reached: &[f64], edges: &[f64]) -> f64 {
    (1..reached.len())
        .map(|j| edges[j] * 60.0 + reached[j] * 48.0)
        .sum()
}

/// Seconds of one step from the loader's and the trainer's sides: overlapped on a GPU SKU,
/// sharing the cores on a CPU SKU.
fn step_s(r: &Rates, loader_s: f64, trainer_s: f64) -> f64 {
    if r.gpu {
        loader_s.max(trainer_s)
    } else {
        loader_s + trainer_s
    }
}

fn data(
    req: &PlanRequest,
    sku: &Sku,
    c: &Candidate,
    r: &Rates,
    ls: &[Layer],
    params: f64,
) -> Prediction {
    let a = &req.assumptions;
    let g = &req.graph;
    let n = g.nodes as f64;
    let feat = f64::from(g.feat_dim);
    let workers = f64::from(c.workers);
    let k = c.parts;
    let p = part_shape(req, k);
    let batch = f64::from(req.train.batch_size);
    let steps = (g.train_nodes as f64 / (batch * workers)).ceil().max(1.0);
    let (reached, edges) = sample_sizes(req, batch);
    let n_layers = ls.len();
    let inputs = reached[n_layers];

    // Memory that does not depend on the cache, then the cache from what is left.
    let structure_bytes = (n + 1.0) * 8.0
        + g.edges as f64 * 4.0
        + local_csr_bytes(p.owned, p.owned + p.halo, p.edges + p.owned);
    let features_bytes = p.owned * feat * F32;
    let loader_bytes = 3.0 * inputs * feat * F32;
    let train_act = batch_activations(ls, &reached, &edges, 0) + inputs * feat * F32;
    let eval_act = full_graph_activations(ls, p.owned, p.halo, p.edges, false, None);
    let activations_bytes = train_act.max(eval_act);
    let halo_bytes = p.halo * ls.iter().map(|l| l.exch).fold(feat, f64::max) * F32;
    let optimizer_bytes = params * F32 * 4.0;
    // evaluation keeps its first layer's `A X` between epochs
    let eval_cached = first_layer_cached_in_eval(ls);
    let eval_agg_bytes = if eval_cached {
        p.owned * feat * F32
    } else {
        0.0
    };
    let mut m = MemoryBreakdown {
        features_bytes,
        structure_bytes,
        activations_bytes,
        halo_bytes,
        optimizer_bytes,
        ..MemoryBreakdown::default()
    };
    place(
        &mut m,
        r.gpu,
        structure_bytes + features_bytes + loader_bytes,
        false,
    );
    place(
        &mut m,
        r.gpu,
        activations_bytes + halo_bytes + optimizer_bytes + eval_agg_bytes,
        true,
    );
    let remote_universe = (n - p.owned).max(0.0);
    let cache_rows = if k <= 1 {
        0.0
    } else if let Some(fixed) = req.train.cache_rows {
        (fixed as f64).min(remote_universe)
    } else {
        let usable = sku.host_memory_bytes() * a.memory_headroom
            / if sku.shared_host { workers } else { 1.0 }
            - a.host_runtime_gib * GIB;
        let left = (usable - m.host_bytes).max(0.0);
        (left * a.cache_memory_fraction / (feat * F32))
            .floor()
            .min(remote_universe)
    };
    let cache_bytes = cache_rows * feat * F32;
    m.cache_bytes = cache_bytes + eval_agg_bytes;
    place(&mut m, r.gpu, cache_bytes, false);

    // Per step: sampling and gathering (loader), kernels, fetch, all-reduce (trainer).
    let sampled: f64 = edges.iter().sum();
    let loader_s = sampled / r.sampler_edges_s
        + block_bytes(&reached, &edges) / r.mem_byte_s
        + gather_s(r, inputs, feat);
    let compute_s = batch_work(r, ls, &reached, &edges, 0) + params * F32 * 7.0 / r.mem_byte_s;
    let hit = if remote_universe > 0.0 {
        (cache_rows / remote_universe)
            .min(1.0)
            .powf(a.cache_hit_exponent)
    } else {
        0.0
    };
    let remote_rows: f64 = if k <= 1 {
        0.0
    } else {
        (1..=n_layers)
            .map(|j| (reached[j] - reached[j - 1]) * (1.0 - (1.0 - p.cut).powi(j as i32)))
            .sum()
    };
    let fetch_bytes = remote_rows * (1.0 - hit) * (feat * F32 + 4.0);
    let fetch_s = if k > 1 {
        r.transfer(fetch_bytes, f64::from(k - 1), 2.0)
    } else {
        0.0
    };
    let allreduce_bytes = if workers > 1.0 {
        2.0 * (workers - 1.0) / workers * params * F32
    } else {
        0.0
    };
    let allreduce_s = r.transfer(allreduce_bytes, workers - 1.0, 2.0);
    let step = step_s(r, loader_s, compute_s + fetch_s + allreduce_s);

    // Evaluation: the partition-parallel full-graph forward over the k feature parts; its
    // first layer's `A X` (and the halo rows it needs) once per run.
    let (eval_compute, eval_halo, eval_rounds) =
        full_graph_pass(r, ls, &p, eval_cached, false, false);
    let eval_s = (eval_compute + r.transfer(eval_halo, f64::from(k - 1), eval_rounds))
        / f64::from(req.train.eval_every);
    let eval_setup_s = if eval_cached {
        let mut w = Work::default();
        w.spmm(r, p.owned, p.edges, feat);
        w.s + r.transfer(p.halo * feat * F32, f64::from(k - 1), 1.0)
    } else {
        0.0
    };

    let load_bytes = p.owned * feat * f64::from(g.feature_bytes_per_value)
        + (n + 1.0) * 8.0
        + g.edges as f64 * 4.0;
    let cache_fill_s = r.transfer(cache_rows * feat * F32, f64::from(k.max(2) - 1), 1.0);
    let setup_s = load_bytes / r.load_byte_s + cache_fill_s + eval_setup_s;
    Prediction {
        memory: m,
        time: TimeBreakdown {
            compute_s: steps * compute_s,
            sample_s: steps * loader_s,
            exchange_s: steps * fetch_s,
            allreduce_s: steps * allreduce_s,
            eval_s,
            overhead_s: 0.0,
            epoch_s: steps * step + eval_s,
            setup_s,
            total_s: 0.0,
        },
        steps_per_epoch: steps as u64,
        exchange_bytes_per_epoch: steps * fetch_bytes,
        allreduce_bytes_per_epoch: steps * allreduce_bytes,
        eval_bytes_per_epoch: eval_halo / f64::from(req.train.eval_every),
        cache_rows: cache_rows as u64,
        cache_hit_rate: hit,
        halo_rows: p.halo.round() as u64,
        partition_estimated: p.estimated && k > 1,
        ..Prediction::default()
    }
}

fn model(req: &PlanRequest, c: &Candidate, r: &Rates, ls: &[Layer], params: f64) -> Prediction {
    let g = &req.graph;
    let n = g.nodes as f64;
    let e = g.edges as f64;
    let feat = f64::from(g.feat_dim);
    let workers = f64::from(c.workers);
    let cols = (feat / workers).ceil();
    let batch = f64::from(req.train.batch_size);
    let steps = (g.train_nodes as f64 / (batch * workers)).ceil().max(1.0);
    let (reached, edges) = sample_sizes(req, batch);
    let n_layers = ls.len();
    let inputs = reached[n_layers];
    let first = ls[0];
    let dst0 = reached[n_layers - 1];
    let e0 = edges[n_layers];

    // Every worker: the first layer's partials of its columns for every batch of the step.
    let mut w0 = Work::default();
    layer_work(
        &mut w0, r, &first, cols, dst0, inputs, e0, true, false, true,
    );
    // Its gradient recomputes the aggregation of the slice (`A X` of its columns, or `A^T dZ`
    // when the slice is wider than the output): nothing is kept between the two.
    let loops = if first.self_loops { dst0 } else { 0.0 };
    if cols <= first.output {
        w0.spmm(r, dst0, e0 + loops, cols);
    } else {
        w0.spmm(r, inputs, e0 + loops, first.output);
    }
    let compute_s =
        workers * w0.s + batch_work(r, ls, &reached, &edges, 1) + params * F32 * 7.0 / r.mem_byte_s;
    let sampled: f64 = edges.iter().sum();
    // every batch's blocks are built whole, though only its owner keeps more than the first
    let loader_s = workers
        * (sampled / r.sampler_edges_s
            + block_bytes(&reached, &edges) / r.mem_byte_s
            + gather_s(r, inputs, cols));
    let partial_bytes = 2.0 * (workers - 1.0) * dst0 * first.output * F32;
    let exchange_s = r.transfer(partial_bytes, workers - 1.0, 2.0);
    let first_params = first.input * first.output * first.gemms;
    let shared = (params - first_params).max(0.0);
    let allreduce_bytes = 2.0 * (workers - 1.0) / workers * shared * F32;
    let allreduce_s = r.transfer(allreduce_bytes, workers - 1.0, 2.0);
    let step = step_s(r, loader_s, compute_s + exchange_s + allreduce_s);

    // Evaluation: partials over every node, all-reduced, then the other layers over the whole
    // graph on every worker.
    let whole = PartShape {
        owned: n,
        halo: 0.0,
        edges: e,
        cut: 0.0,
        estimated: false,
    };
    let mut we = Work::default();
    layer_work(&mut we, r, &first, cols, n, n, e, true, false, false);
    let (rest_s, _, _) = full_graph_pass(r, &ls[1..], &whole, false, false, false);
    let z0_bytes = n * first.output * F32;
    let eval_allreduce = 2.0 * (workers - 1.0) / workers * z0_bytes;
    let eval_s = (we.s + rest_s + r.transfer(eval_allreduce, workers - 1.0, 2.0))
        / f64::from(req.train.eval_every);

    let structure_bytes = (n + 1.0) * 8.0 + e * 4.0 + local_csr_bytes(n, n, e + n);
    let features_bytes = n * cols * F32;
    let loader_bytes = 3.0 * workers * inputs * cols * F32;
    let train_act = workers * (inputs * cols + dst0 * first.output * 2.0) * F32
        + batch_activations(ls, &reached, &edges, 1);
    let eval_act = z0_bytes + full_graph_activations(&ls[1..], n, 0.0, e, false, None);
    let activations_bytes = train_act.max(eval_act);
    let optimizer_bytes = params * F32 * 4.0;
    let mut m = MemoryBreakdown {
        features_bytes,
        structure_bytes,
        activations_bytes,
        optimizer_bytes,
        ..MemoryBreakdown::default()
    };
    place(
        &mut m,
        r.gpu,
        structure_bytes + features_bytes + loader_bytes,
        false,
    );
    place(&mut m, r.gpu, activations_bytes + optimizer_bytes, true);

    let load_bytes = n * cols * f64::from(g.feature_bytes_per_value) + (n + 1.0) * 8.0 + e * 4.0;
    Prediction {
        memory: m,
        time: TimeBreakdown {
            compute_s: steps * compute_s,
            sample_s: steps * loader_s,
            exchange_s: steps * exchange_s,
            allreduce_s: steps * allreduce_s,
            eval_s,
            overhead_s: 0.0,
            epoch_s: steps * step + eval_s,
            setup_s: load_bytes / r.load_byte_s,
            total_s: 0.0,
        },
        steps_per_epoch: steps as u64,
        exchange_bytes_per_epoch: steps * partial_bytes,
        allreduce_bytes_per_epoch: steps * allreduce_bytes,
        eval_bytes_per_epoch: eval_allreduce / f64::from(req.train.eval_every),
        ..Prediction::default()
    }
}
