//! The search: every candidate the constraints allow, predicted, checked (memory, deadline,
//! budget), ranked by the objective, and explained.
//!
//! Candidates per SKU: worker counts are the powers of two up to the limit (the smaller of
//! `max_workers` and the SKU's `max_containers`) and the limit itself; partition, data and
//! model parallelism at each count; hybrids `parts x replicas` (both powers of two, at least
//! two replicas; partition hybrids at least two parts); partition candidates with the job's
//! exchange options, and with bf16 rows and BNS p = 0.1 when inexact exchange is allowed; on CPU
//! SKUs each exact-or-compressed partition exchange also with rematerialisation (SAR), which
//! only a plan short of memory picks (it costs rounds, and GAT bytes and compute).
//! The order of everything returned is a function of the inputs alone.

use std::cmp::Ordering;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::calibration::CalibrationProfile;
use crate::catalog::{Catalog, Sku};
use crate::cost::{
    Candidate, MemoryBreakdown, Prediction, estimated_cut_fraction, predict_checked,
};
use crate::error::PlanError;
use crate::input::{ExchangeOptions, Mode, ModelKind, Objective, PlanRequest, RowDtype};
use crate::render::{bytes, epoch_terms, secs, usd};

/// A candidate with its prediction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    pub candidate: Candidate,
    pub prediction: Prediction,
}

/// Which memory a candidate overflows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryKind {
    /// The GPU's (or, on a CPU SKU, the container's) memory.
    Device,
    /// The container's host memory on a GPU SKU.
    Host,
}

/// Why a candidate was not taken.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reason {
    /// A worker needs more memory than the SKU has (after headroom).
    Memory {
        memory: MemoryKind,
        need_bytes: f64,
        usable_bytes: f64,
        /// The largest item of the breakdown (`activations`) and its bytes.
        largest: String,
        largest_bytes: f64,
    },
    /// The run would end after the deadline.
    Deadline { total_s: f64, deadline_s: f64 },
    /// The run would cost more than the budget.
    Budget { usd_total: f64, budget_usd: f64 },
    /// The engine cannot run it.
    Unsupported { why: String },
}

impl Reason {
    /// How far from fitting: need over limit (above 1); unsupported is infinitely far.
    pub fn excess(&self) -> f64 {
        match self {
            Reason::Memory {
                need_bytes,
                usable_bytes,
                ..
            } => need_bytes / usable_bytes,
            Reason::Deadline {
                total_s,
                deadline_s,
            } => total_s / deadline_s,
            Reason::Budget {
                usd_total,
                budget_usd,
            } => {
                if *budget_usd > 0.0 {
                    usd_total / budget_usd
                } else {
                    f64::INFINITY
                }
            }
            Reason::Unsupported { .. } => f64::INFINITY,
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Memory {
                memory,
                need_bytes,
                usable_bytes,
                largest,
                largest_bytes,
            } => {
                let which = match memory {
                    MemoryKind::Device => "device",
                    MemoryKind::Host => "host",
                };
                write!(
                    f,
                    "needs {} of {which} memory per worker, {} usable (largest: {largest} {})",
                    bytes(*need_bytes),
                    bytes(*usable_bytes),
                    bytes(*largest_bytes)
                )
            }
            Reason::Deadline {
                total_s,
                deadline_s,
            } => write!(
                f,
                "takes {}, deadline {}",
                secs(*total_s),
                secs(*deadline_s)
            ),
            Reason::Budget {
                usd_total,
                budget_usd,
            } => write!(f, "costs {}, budget {}", usd(*usd_total), usd(*budget_usd)),
            Reason::Unsupported { why } => f.write_str(why),
        }
    }
}

/// A candidate not taken, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rejected {
    pub candidate: Candidate,
    pub reason: Reason,
}

/// Why no candidate of one class (kind and SKU) fits: the rejection of the one that came
/// closest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClassReason {
    /// `partition`, `data`, `model`, `hybrid-partition` or `hybrid-data`.
    pub kind: String,
    pub sku: String,
    /// Candidates of the class, all rejected.
    pub candidates: u32,
    pub closest: Candidate,
    pub reason: Reason,
}

impl fmt::Display for ClassReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} on {} ({} candidates): closest is {}: {}",
            self.kind,
            self.sku,
            self.candidates,
            self.closest.describe(),
            self.reason
        )
    }
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub objective: Objective,
    pub chosen: Choice,
    /// The chosen SKU's catalog entry (resources for the worker spec).
    pub sku: Sku,
    /// Every other feasible candidate, best first.
    pub alternatives: Vec<Choice>,
    /// Every infeasible candidate, in catalog and candidate order.
    pub rejected: Vec<Rejected>,
    /// The partition step before the launch (partition and data modes with more than one part).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<crate::partition::PartitionStep>,
    /// Why this plan: one sentence per line.
    pub explanation: Vec<String>,
}

/// Plans `request` on `catalog`. `calibration` replaces catalog peaks for local SKUs. Pure:
/// the same inputs give the same plan, byte for byte once serialised.
pub fn plan(
    request: &PlanRequest,
    catalog: &Catalog,
    calibration: Option<&CalibrationProfile>,
) -> Result<Plan, PlanError> {
    request.validate()?;
    let c = &request.constraints;
    if let Some(name) = c.skus.iter().find(|n| catalog.get(n).is_none()) {
        return Err(PlanError::invalid(
            "constraints.skus",
            format!("no SKU named `{name}` in the catalog"),
        ));
    }
    let skus: Vec<&Sku> = catalog
        .skus
        .iter()
        .filter(|s| c.backends.is_empty() || c.backends.contains(&s.backend))
        .filter(|s| c.skus.is_empty() || c.skus.contains(&s.name))
        .collect();
    if skus.is_empty() {
        return Err(PlanError::invalid(
            "constraints",
            format!(
                "no SKU of the catalog ({} SKUs) matches the backend and SKU filters",
                catalog.skus.len()
            ),
        ));
    }
    for sku in &skus {
        sku.validate()?;
    }

    let mut feasible: Vec<Choice> = Vec::new();
    let mut rejected: Vec<Rejected> = Vec::new();
    let mut seen_classes: Vec<(String, String, u32)> = Vec::new();
    for sku in &skus {
        for candidate in candidates(request, sku) {
            let key = (candidate.kind().to_string(), sku.name.clone());
            match seen_classes
                .iter_mut()
                .find(|(k, s, _)| *k == key.0 && *s == key.1)
            {
                Some(entry) => entry.2 += 1,
                None => seen_classes.push((key.0, key.1, 1)),
            }
            if let Some(why) = unsupported(request, &candidate) {
                rejected.push(Rejected {
                    candidate,
                    reason: Reason::Unsupported { why },
                });
                continue;
            }
            let prediction = predict_checked(request, sku, &candidate, calibration);
            let mut candidate = candidate;
            candidate.cache_rows = prediction.cache_rows;
            match check(request, &candidate, sku.is_gpu(), &prediction) {
                Some(reason) => rejected.push(Rejected { candidate, reason }),
                None => feasible.push(Choice {
                    candidate,
                    prediction,
                }),
            }
        }
    }

    if feasible.is_empty() {
        let reasons = seen_classes
            .iter()
            .filter_map(|(kind, sku, count)| {
                let closest = rejected
                    .iter()
                    .filter(|r| r.candidate.kind() == kind && r.candidate.sku == *sku)
                    .min_by(|a, b| a.reason.excess().total_cmp(&b.reason.excess()))?;
                Some(ClassReason {
                    kind: kind.clone(),
                    sku: sku.clone(),
                    candidates: *count,
                    closest: closest.candidate.clone(),
                    reason: closest.reason.clone(),
                })
            })
            .collect();
        return Err(PlanError::Infeasible { reasons });
    }

    let objective = c.objective;
    feasible.sort_by(|a, b| rank(objective, a, b));
    let mut feasible = feasible.into_iter();
    let chosen = feasible.next().expect("checked non-empty above");
    let alternatives: Vec<Choice> = feasible.collect();
    let sku = catalog
        .get(&chosen.candidate.sku)
        .expect("candidates come from the catalog")
        .clone();
    let partition =
        crate::partition::partition_step(request, &chosen.candidate, &chosen.prediction);
    let mut explanation = explain(
        request,
        &chosen,
        &sku,
        &alternatives,
        &rejected,
        &skus,
        calibration,
    );
    if let Some(step) = &partition {
        explanation.insert(1, format!("partition step: {}", step.why));
    }
    Ok(Plan {
        objective,
        chosen,
        sku,
        alternatives,
        rejected,
        partition,
        explanation,
    })
}

/// Every candidate for one SKU, in a fixed order.
pub fn candidates(request: &PlanRequest, sku: &Sku) -> Vec<Candidate> {
    let c = &request.constraints;
    let limit = c
        .max_workers
        .min(sku.max_containers.unwrap_or(u32::MAX))
        .max(1);
    let mut counts: Vec<u32> = (0..32)
        .map(|i| 1u32 << i)
        .take_while(|&n| n <= limit)
        .collect();
    if counts.last() != Some(&limit) {
        counts.push(limit);
    }
    let allowed = |m: Mode| c.modes.is_empty() || c.modes.contains(&m);
    let mut exchanges = vec![request.train.exchange.clone()];
    if c.allow_inexact_exchange {
        for x in [
            ExchangeOptions {
                dtype: RowDtype::Bf16,
                ..request.train.exchange.clone()
            },
            ExchangeOptions {
                boundary_sampling: 0.1,
                dtype: RowDtype::Bf16,
                ..request.train.exchange.clone()
            },
        ] {
            if !exchanges.contains(&x) {
                exchanges.push(x);
            }
        }
    }
    if !sku.is_gpu() {
        let remat: Vec<ExchangeOptions> = exchanges
            .iter()
            .filter(|x| x.boundary_sampling >= 1.0 && x.staleness == 0 && !x.rematerialize)
            .map(|x| ExchangeOptions {
                rematerialize: true,
                ..x.clone()
            })
            .collect();
        for x in remat {
            if !exchanges.contains(&x) {
                exchanges.push(x);
            }
        }
    }
    let base = |mode: Mode, parts: u32, replicas: u32, exchange: &ExchangeOptions| Candidate {
        mode,
        workers: parts * replicas,
        parts,
        replicas,
        sku: sku.name.clone(),
        backend: sku.backend,
        exchange: exchange.clone(),
        cache_rows: 0,
    };
    let exact = request.train.exchange.clone();
    let mut out = Vec::new();
    for &n in &counts {
        if allowed(Mode::Partition) {
            for x in if n > 1 {
                &exchanges[..]
            } else {
                &exchanges[..1]
            } {
                out.push(base(Mode::Partition, n, 1, x));
            }
        }
        if allowed(Mode::Data) {
            out.push(base(Mode::Data, n, 1, &exact));
        }
        if allowed(Mode::Model) && n > 1 {
            out.push(base(Mode::Model, n, 1, &exact));
        }
    }
    let pow2: Vec<u32> = counts
        .iter()
        .copied()
        .filter(|n| c.hybrids && n.is_power_of_two())
        .collect();
    for &parts in &pow2 {
        for &replicas in pow2.iter().filter(|&&r| r >= 2) {
            if parts * replicas > limit {
                continue;
            }
            if allowed(Mode::Partition) && parts >= 2 {
                for x in &exchanges {
                    out.push(base(Mode::Partition, parts, replicas, x));
                }
            }
            if allowed(Mode::Data) {
                out.push(base(Mode::Data, parts, replicas, &exact));
            }
        }
    }
    out
}

pub(crate) fn unsupported(request: &PlanRequest, c: &Candidate) -> Option<String> {
    if c.mode == Mode::Model {
        if request.model.kind == ModelKind::Gat {
            return Some("P3 does not split GAT's first layer (attention needs whole rows)".into());
        }
        if c.workers > request.graph.feat_dim {
            return Some(format!(
                "{} column slices of {} features",
                c.workers, request.graph.feat_dim
            ));
        }
    }
    if c.parts as u64 > request.graph.nodes {
        return Some(format!(
            "{} parts of {} nodes",
            c.parts, request.graph.nodes
        ));
    }
    None
}

/// The largest item of a memory breakdown among those held in `memory`: on a GPU SKU the
/// host holds the features, structure and cache (all of partition parallelism is on the GPU
/// too, the host keeping the loaded part); a CPU SKU has one memory.
fn largest_item(m: &MemoryBreakdown, memory: MemoryKind, gpu: bool, mode: Mode) -> (String, f64) {
    let items = [
        ("features", m.features_bytes, true),
        ("structure", m.structure_bytes, true),
        ("activations", m.activations_bytes, false),
        ("halo", m.halo_bytes, false),
        ("optimizer", m.optimizer_bytes, false),
        ("cache", m.cache_bytes, true),
        ("runtime", m.runtime_bytes, false),
    ];
    items
        .into_iter()
        .filter(|&(_, _, on_host)| match memory {
            MemoryKind::Host => !gpu || on_host,
            MemoryKind::Device => !gpu || mode == Mode::Partition || !on_host,
        })
        .fold((String::new(), f64::MIN), |best, (name, b, _)| {
            if b > best.1 {
                (name.to_string(), b)
            } else {
                best
            }
        })
}

/// The first constraint a prediction breaks.
fn check(request: &PlanRequest, c: &Candidate, gpu: bool, p: &Prediction) -> Option<Reason> {
    let m = &p.memory;
    if m.device_bytes > m.device_usable_bytes {
        let (largest, largest_bytes) = largest_item(m, MemoryKind::Device, gpu, c.mode);
        return Some(Reason::Memory {
            memory: MemoryKind::Device,
            need_bytes: m.device_bytes,
            usable_bytes: m.device_usable_bytes,
            largest,
            largest_bytes,
        });
    }
    if m.host_bytes > m.host_usable_bytes {
        let (largest, largest_bytes) = largest_item(m, MemoryKind::Host, gpu, c.mode);
        return Some(Reason::Memory {
            memory: MemoryKind::Host,
            need_bytes: m.host_bytes,
            usable_bytes: m.host_usable_bytes,
            largest,
            largest_bytes,
        });
    }
    let c = &request.constraints;
    if let Some(deadline_s) = c.deadline_s
        && p.time.total_s > deadline_s
    {
        return Some(Reason::Deadline {
            total_s: p.time.total_s,
            deadline_s,
        });
    }
    if let Some(budget_usd) = c.budget_usd
        && p.usd_total > budget_usd
    {
        return Some(Reason::Budget {
            usd_total: p.usd_total,
            budget_usd,
        });
    }
    None
}

/// Objective first, the other measure second, then fewer workers, then names: a total order.
fn rank(objective: Objective, a: &Choice, b: &Choice) -> Ordering {
    let (pa, pb) = (&a.prediction, &b.prediction);
    let cost = pa.usd_total.total_cmp(&pb.usd_total);
    let time = pa.time.total_s.total_cmp(&pb.time.total_s);
    let primary = if objective.cost_first() {
        cost.then(time)
    } else {
        time.then(cost)
    };
    primary
        .then(a.candidate.workers.cmp(&b.candidate.workers))
        .then_with(|| a.candidate.sku.cmp(&b.candidate.sku))
        .then_with(|| a.candidate.kind().cmp(b.candidate.kind()))
        .then(a.candidate.parts.cmp(&b.candidate.parts))
        .then_with(|| {
            a.candidate
                .exchange
                .label()
                .cmp(&b.candidate.exchange.label())
        })
}

/// The largest term of an epoch, named.
fn dominant(p: &Prediction) -> (&'static str, f64) {
    let t = &p.time;
    let terms = [
        ("compute", t.compute_s),
        ("sampling", t.sample_s),
        ("exchange", t.exchange_s),
        ("all-reduce", t.allreduce_s),
        ("evaluation", t.eval_s),
        ("fixed overhead", t.overhead_s),
    ];
    terms.into_iter().fold(
        ("compute", f64::MIN),
        |best, t| if t.1 > best.1 { t } else { best },
    )
}

const KINDS: [&str; 5] = [
    "partition",
    "data",
    "model",
    "hybrid-partition",
    "hybrid-data",
];

fn explain(
    request: &PlanRequest,
    chosen: &Choice,
    sku: &Sku,
    alternatives: &[Choice],
    rejected: &[Rejected],
    skus: &[&Sku],
    calibration: Option<&CalibrationProfile>,
) -> Vec<String> {
    let objective = request.constraints.objective;
    let c = &chosen.candidate;
    let p = &chosen.prediction;
    let t = &p.time;
    let mut out = Vec::new();
    let goal = match objective {
        Objective::MinCost => "the cheapest plan".to_string(),
        Objective::MinTime => "the fastest plan".to_string(),
        Objective::Deadline => format!(
            "the cheapest plan within the deadline of {}",
            secs(request.constraints.deadline_s.unwrap_or(0.0))
        ),
        Objective::Budget => format!(
            "the fastest plan within the budget of {}",
            usd(request.constraints.budget_usd.unwrap_or(0.0))
        ),
    };
    let resources = if sku.shared_host && c.workers > 1 {
        format!("{} processes sharing {}", c.workers, sku.device_label())
    } else {
        format!("{} x {}", c.workers, sku.device_label())
    };
    out.push(format!(
        "{goal}: {} ({resources}), {} in {} ({} epochs of {} after {} of cold start and loading)",
        c.describe(),
        usd(p.usd_total),
        secs(t.total_s),
        request.train.epochs,
        secs(t.epoch_s),
        secs(t.setup_s)
    ));
    let m = &p.memory;
    let on = if sku.is_gpu() {
        "GPU memory".to_string()
    } else if sku.shared_host && c.workers > 1 {
        format!("memory (1/{} of the host's)", c.workers)
    } else {
        "container memory".to_string()
    };
    let mut mem = format!(
        "memory per worker: {} of {} usable {on}",
        bytes(m.device_bytes),
        bytes(m.device_usable_bytes)
    );
    if sku.is_gpu() {
        mem.push_str(&format!(
            ", {} of {} usable host memory",
            bytes(m.host_bytes),
            bytes(m.host_usable_bytes)
        ));
    }
    mem.push_str(&format!(
        " (features {}, structure {}, activations {}, halo {}, optimizer {}, cache {})",
        bytes(m.features_bytes),
        bytes(m.structure_bytes),
        bytes(m.activations_bytes),
        bytes(m.halo_bytes),
        bytes(m.optimizer_bytes),
        bytes(m.cache_bytes)
    ));
    out.push(mem);
    let (dom, dom_s) = dominant(p);
    out.push(format!(
        "epoch: {}; {dom} dominates ({:.0}% of the epoch){}",
        epoch_terms(t),
        100.0 * dom_s / t.epoch_s.max(f64::MIN_POSITIVE),
        if t.sample_s > 0.0 && sku.is_gpu() {
            "; sampling runs on loader threads beside the GPU"
        } else if t.sample_s > 0.0 {
            "; sampling shares the cores with compute"
        } else if t.exchange_s > 0.0 && request.assumptions.partition_overlap == 0.0 {
            "; each layer waits for its halo rows (no overlap)"
        } else {
            ""
        }
    ));

    if c.exchange.rematerialize && c.parts > 1 {
        let without = ExchangeOptions {
            rematerialize: false,
            ..c.exchange.clone()
        };
        let twin = |x: &Candidate| {
            x.mode == c.mode
                && x.parts == c.parts
                && x.replicas == c.replicas
                && x.sku == c.sku
                && x.exchange == without
        };
        let mut line = format!(
            "rematerialisation (SAR) on: a worker holds one peer's halo rows at a time ({} of halo \
             buffers){}",
            bytes(m.halo_bytes),
            if request.model.kind == ModelKind::Gat {
                "; GAT fetches them again in backward and recomputes its attention"
            } else {
                ""
            }
        );
        if let Some(r) = rejected.iter().find(|r| twin(&r.candidate)) {
            line.push_str(&format!("; without it: {}", r.reason));
        } else if let Some(a) = alternatives.iter().find(|a| twin(&a.candidate)) {
            line.push_str(&format!(
                "; without it: {} per worker in {}",
                bytes(a.prediction.memory.device_bytes),
                secs(a.prediction.time.total_s)
            ));
        }
        out.push(line);
    }

    // Why this mode: the best of every other kind, or why none fits.
    for kind in KINDS {
        if kind == c.kind() {
            if let Some(b) = alternatives.iter().find(|a| a.candidate.kind() == kind) {
                out.push(format!(
                    "next {kind}: {} at {} in {}",
                    b.candidate.describe(),
                    usd(b.prediction.usd_total),
                    secs(b.prediction.time.total_s)
                ));
            }
            continue;
        }
        if let Some(b) = alternatives.iter().find(|a| a.candidate.kind() == kind) {
            let bp = &b.prediction;
            let (dom, dom_s) = dominant(bp);
            let ratio = ratio_text(bp, p, objective.cost_first());
            out.push(format!(
                "{kind} loses: best is {} at {} in {} ({ratio}); its epoch {} ({dom} {}), \
                 setup {}",
                b.candidate.describe(),
                usd(bp.usd_total),
                secs(bp.time.total_s),
                secs(bp.time.epoch_s),
                secs(dom_s),
                secs(bp.time.setup_s)
            ));
        } else if let Some(r) = rejected
            .iter()
            .filter(|r| r.candidate.kind() == kind)
            .min_by(|a, b| a.reason.excess().total_cmp(&b.reason.excess()))
        {
            out.push(format!(
                "{kind} does not fit: closest is {}: {}",
                r.candidate.describe(),
                r.reason
            ));
        }
    }

    // Where the partition numbers come from.
    let considered = |k: u32| {
        alternatives
            .iter()
            .map(|a| &a.candidate)
            .chain(rejected.iter().map(|r| &r.candidate))
            .chain(std::iter::once(c))
            .any(|x| x.parts == k && x.mode != Mode::Model)
    };
    let measured: Vec<String> = request
        .partitions
        .iter()
        .map(|p| p.parts)
        .filter(|&k| considered(k))
        .map(|k| k.to_string())
        .collect();
    if p.partition_estimated
        || alternatives
            .iter()
            .any(|a| a.prediction.partition_estimated)
    {
        let a = &request.assumptions;
        let mut line = format!(
            "halo rows and cut estimated for unmeasured k with c(k) = {} (1 - 1/sqrt k) (c(4) = {:.3}, \
             c(64) = {:.3}) and balls-into-bins halo counts",
            a.cut_fraction_max,
            estimated_cut_fraction(4, a),
            estimated_cut_fraction(64, a)
        );
        if measured.is_empty() {
            line.push_str("; pass measured partition stats to replace them");
        } else {
            line.push_str(&format!("; measured for k = {}", measured.join(", ")));
        }
        out.push(line);
    } else if !measured.is_empty() {
        out.push(format!(
            "halo rows and cut measured from the partition artifacts for k = {}",
            measured.join(", ")
        ));
    }
    if skus.iter().any(|s| s.backend.on_this_machine()) {
        out.push(match calibration {
            Some(p) => format!(
                "local SKUs use the calibration profile of {} ({}, {} threads)",
                p.machine, p.measured_on, p.threads
            ),
            None => "local SKUs use catalog peaks x efficiency: run `physalia calibrate` for \
                     measured rates"
                .to_string(),
        });
    }
    if sku.is_gpu() {
        out.push(
            "GPU times assume the CUDA engine at the assumed efficiencies (its measured compute on an \
             H100 came within 40% of them, bench/RESULTS.md); GPU workers train full-graph and \
             data-parallel, P3 runs on the CPU"
                .to_string(),
        );
    }
    if !c.exchange.is_exact() && c.mode == Mode::Partition && c.parts > 1 {
        out.push(format!(
            "the chosen exchange ({}) is inexact: losses differ from one worker's (bench/RESULTS.md \
             measured no accuracy loss for bf16 rows and BNS p = 0.1 on SBM)",
            c.exchange.label()
        ));
    }
    if c.replicas > 1 && c.mode == Mode::Partition {
        out.push(
            "partition replicas split the training nodes, but each group still runs the forward \
             and backward over every node of its parts"
                .to_string(),
        );
    }
    out
}

fn ratio_text(other: &Prediction, chosen: &Prediction, cost_first: bool) -> String {
    let ratio = |a: f64, b: f64| if b > 0.0 { Some(a / b) } else { None };
    let cost = ratio(other.usd_total, chosen.usd_total);
    let time = ratio(other.time.total_s, chosen.time.total_s);
    match (cost_first, cost, time) {
        (true, Some(c), _) => format!("{c:.2}x the cost"),
        (true, None, Some(t)) if other.usd_total <= 0.0 => format!("same cost, {t:.2}x the time"),
        (true, None, _) => "costs money where the chosen plan is free".to_string(),
        (false, _, Some(t)) if (t - 1.0).abs() >= 0.005 => format!("{t:.2}x the time"),
        (false, Some(c), _) => format!("same time, {c:.2}x the cost"),
        (false, _, _) => "same time".to_string(),
    }
}
