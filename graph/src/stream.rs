//! Streaming vertex partitioning with bounded memory: Fennel or LDG over the CSR rows, one pass plus
//! optional restreaming passes, then optional label-propagation refinement, under a hard balance cap.
//!
//! The first building block for graphs larger than one machine (issue 31): METIS needs the symmetrised
//! graph and its own coarsening hierarchy in memory (several times the CSR), while a streaming partitioner
//! reads each CSR row once per pass, in order, and keeps only the node -> part assignment. The CSR may be
//! memory-mapped ([`crate::Dataset::csr`]): pages are read sequentially and the kernel may drop them again.
//!
//! # Algorithm
//!
//! Nodes arrive in the stream order ([`StreamOrder`]). Node `v` goes to the part `p` that maximises
//!
//! - Fennel (Tsourakakis et al., WSDM 2014): `|N(v) ∩ P_p| - alpha * gamma * |P_p|^(gamma - 1)`, with
//!   `alpha = sqrt(k) * m / n^gamma` (`m` undirected edges, `n` nodes; `gamma` default 1.5, the paper's);
//! - LDG (Stanton & Kliot, KDD 2012): `|N(v) ∩ P_p| * (1 - |P_p| / C)`;
//!
//! among the parts below the hard capacity `C = ceil((1 + eps) * n / k)` (a full part is never chosen, so
//! every part ends at most `C` nodes: since `k * C >= n` some part always has room). Ties go to the
//! smaller part, then to the first part in a rotation that starts at a seeded hash of `v`.
//!
//! `N(v)` is row `v` of the CSR: the in-neighbours. For an undirected dataset (both directions stored)
//! that is the whole neighbourhood; for a directed one the partitioner sees only in-edges (reading
//! out-edges would need the transpose, an O(E) structure), so it optimises the in-edge half of the cut.
//!
//! Restreaming (Nishimura & Ugander, KDD 2013): pass `t > 1` streams the nodes again in the same order;
//! part sizes start from zero each pass, and a neighbour counts in the part the current pass gave it if
//! already seen, else in the part the previous pass gave it. One assignment array updated in place is
//! exactly that. The result is the last pass's assignment; the cap holds for every pass. With
//! [`StreamParams::converged_below`] restreaming stops once a pass moves few nodes: on an SBM the passes
//! move many nodes for a while (a phase transition to the planted blocks; at 1M nodes, k = 4, about
//! eight passes) and then none, so a fixed small number of passes stops short of it.
//!
//! Refinement (label propagation in the style of Spinner / XtraPuLP, run sequentially so every move
//! sees the moves before it): `refine_passes` more passes over the rows; node `v` moves to the part
//! holding most of its neighbours if that part holds strictly more than `v`'s own part and has room
//! under the cap (part sizes are now the live sizes of the assignment). On an undirected graph every
//! move lowers the cut by its gain, so the cut never rises and the passes converge; they stop after a
//! pass that moves nothing (a fixed point). It repairs what restreaming left, e.g. when restreaming is
//! capped before it converges.
//!
//! Isolated nodes ([`StreamParams::isolated_last`]): nodes with an empty row take no part in the passes
//! and are dealt to the smallest parts at the end, as [`crate::partition_metis`] deals the nodes METIS
//! never sees; the cap then bounds the nodes with edges (counted by the first pass, which uses the cap on
//! all `n`). Without it an R-MAT graph, about 45% isolated at 1M nodes, gets one part with most edges,
//! filled up to balance with isolated nodes.
//!
//! [`StreamParams::refined`] is the out-of-core default (restreamed Fennel until converged, at most 20
//! passes; then refinement; isolated nodes last): measured against METIS at 1M nodes in
//! `bench/RESULTS.md` (issue 31). [`StreamParams::new`] is plain one-pass Fennel.
//!
//! # Memory bound
//!
//! Besides the caller's CSR (read only, never copied), [`partition_stream`] allocates the assignment,
//! `4 * n` bytes (returned inside the [`Partitioning`]), plus `O(k)`: part sizes and per-node neighbour
//! counts (`24 * k` bytes), the refinement's live sizes and the final deal's heap, and the pass
//! statistics (`O(passes)`). Nothing is proportional to the number of edges or to the feature width
//! (the function never sees features). The final edge cut is computed by
//! [`Partitioning::from_assignment`] with the same bound (a parallel count over rows). Checked in
//! `tests/stream_memory.rs` with a counting global allocator: the peak of live heap bytes during the call stays
//! under `4 n + 64 k + 64 KiB` on a graph whose CSR is far larger.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

use crate::csr::Csr;
use crate::error::Error;
use crate::partition::{Partitioning, balance_of, check_k, cut_and_total, part_sizes};
use crate::rng::splitmix64;

/// Most streaming passes of [`StreamParams::refined`].
pub const RESTREAM_PASSES: usize = 20;
/// [`StreamParams::refined`]'s restreaming stops after a pass that moves at most this fraction of the
/// nodes.
pub const CONVERGED_BELOW: f64 = 1e-3;
/// Refinement passes allowed in [`StreamParams::refined`].
pub const REFINE_PASSES: usize = 8;

/// The scoring rule of a streaming pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StreamAlgorithm {
    /// Fennel with exponent `gamma` (> 1; the paper uses 1.5).
    Fennel { gamma: f64 },
    /// Linear deterministic greedy.
    Ldg,
}

/// The order in which nodes arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamOrder {
    /// Ascending node id: CSR rows are read front to back, so a memory-mapped file is read sequentially,
    /// once per pass (the out-of-core case). The default. Quality depends on how ids were assigned: ids
    /// in BFS or crawl order help, an adversarial order (e.g. sorted by class) can hurt.
    Natural,
    /// A seeded pseudo-random permutation of the ids, computed on the fly (a Feistel network with cycle
    /// walking), so it costs no memory. Reads rows in random order: use it when the ids are known to be
    /// adversarially ordered and the CSR is in memory.
    Shuffled,
}

/// Parameters of [`partition_stream`].
#[derive(Clone, Debug, PartialEq)]
pub struct StreamParams {
    /// Number of parts, at least 1 and at most the number of nodes (k = 1 on an empty graph is allowed).
    pub k: usize,
    /// Imbalance tolerance: every part holds at most `ceil((1 + eps) * n / k)` nodes. Default 0.05.
    pub eps: f64,
    /// Passes over the stream: 1 is plain Fennel/LDG, more are restreaming passes. Default 1.
    pub passes: usize,
    /// Restreaming stops early after a pass (the second or later) that moves at most this fraction of
    /// the nodes; `None` always runs `passes` passes (the default of [`StreamParams::new`]). A pass that
    /// moves no node is a fixed point: every later pass would repeat it exactly.
    pub converged_below: Option<f64>,
    /// Label-propagation refinement passes after the streaming passes (0: none, the default of
    /// [`StreamParams::new`]; [`StreamParams::refined`] uses [`REFINE_PASSES`]). Refinement stops early
    /// after a pass that moves no node.
    pub refine_passes: usize,
    /// Leave nodes with an empty row (no in-edge: isolated, for an undirected graph) out of the passes
    /// and deal them to the smallest parts at the end, as [`crate::partition_metis`] does; the cap then
    /// bounds the nodes with edges, and isolated nodes cannot stand in for their balance (on an R-MAT
    /// graph nearly half the nodes are isolated: without this one part can take most of the edges).
    /// `false` in [`StreamParams::new`], `true` in [`StreamParams::refined`].
    pub isolated_last: bool,
    pub algorithm: StreamAlgorithm,
    pub order: StreamOrder,
    /// Seeds the tie-breaking and the [`StreamOrder::Shuffled`] permutation.
    pub seed: u64,
}

impl StreamParams {
    /// Plain Fennel (gamma 1.5), eps 0.05, one pass, no refinement, natural order, seed 0: the
    /// building block, and what `data partition --method stream` starts from.
    pub fn new(k: usize) -> StreamParams {
        StreamParams {
            k,
            eps: 0.05,
            passes: 1,
            converged_below: None,
            refine_passes: 0,
            isolated_last: false,
            algorithm: StreamAlgorithm::Fennel { gamma: 1.5 },
            order: StreamOrder::Natural,
            seed: 0,
        }
    }

    /// The out-of-core default: Fennel restreamed until a pass moves at most [`CONVERGED_BELOW`] of the
    /// nodes (at most [`RESTREAM_PASSES`] passes), then up to [`REFINE_PASSES`] label-propagation passes;
    /// eps 0.05, natural order, seed 0. Measured against METIS in `bench/RESULTS.md` (issue 31,
    /// out-of-core cut).
    pub fn refined(k: usize) -> StreamParams {
        StreamParams {
            passes: RESTREAM_PASSES,
            converged_below: Some(CONVERGED_BELOW),
            refine_passes: REFINE_PASSES,
            isolated_last: true,
            ..StreamParams::new(k)
        }
    }

    /// The largest part size allowed on an `n`-node graph: `ceil((1 + eps) * n / k)`, and at least
    /// `ceil(n / k)` so that rounding can never make the cap infeasible.
    pub fn capacity(&self, n: usize) -> usize {
        let k = self.k.max(1);
        let cap = ((1.0 + self.eps) * n as f64 / k as f64).ceil();
        (cap as usize).max(n.div_ceil(k))
    }

    fn check(&self) -> Result<(), Error> {
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(Error::param(
                "eps",
                format!("{} must be finite and at least 0", self.eps),
            ));
        }
        if self.passes == 0 {
            return Err(Error::param("passes", "at least one pass is needed"));
        }
        if let Some(f) = self.converged_below
            && !(f.is_finite() && (0.0..=1.0).contains(&f))
        {
            return Err(Error::param(
                "converged_below",
                format!("{f} must be a fraction in 0..=1"),
            ));
        }
        if let StreamAlgorithm::Fennel { gamma } = self.algorithm
            && !(gamma.is_finite() && gamma > 1.0)
        {
            return Err(Error::param(
                "gamma",
                format!("{gamma} must be finite and greater than 1"),
            ));
        }
        if self.k > u32::MAX as usize {
            return Err(Error::param(
                "k",
                format!("{} parts do not fit the u32 part ids", self.k),
            ));
        }
        Ok(())
    }

    /// The name a partition set records, every setting that changes the result but `k`, `eps` and the
    /// seed: `fennel`, `ldg-x3` (three passes), `fennel-x20~0.001` (at most 20, stopping once a pass
    /// moves at most 0.1% of the nodes), then `-lp8` (up to eight refinement passes) and `-il`
    /// (`isolated_last`). [`StreamParams::refined`] is `fennel-x20~0.001-lp8-il`.
    pub(crate) fn method(&self) -> String {
        let mut name = match self.algorithm {
            StreamAlgorithm::Fennel { .. } => "fennel".to_string(),
            StreamAlgorithm::Ldg => "ldg".to_string(),
        };
        if self.passes > 1 {
            name.push_str(&format!("-x{}", self.passes));
            if let Some(f) = self.converged_below {
                name.push_str(&format!("~{f}"));
            }
        }
        if self.refine_passes > 0 {
            name.push_str(&format!("-lp{}", self.refine_passes));
        }
        if self.isolated_last {
            name.push_str("-il");
        }
        name
    }
}

/// What one pass did.
#[derive(Clone, Debug, PartialEq)]
pub struct PassStats {
    /// Nodes whose part differs from the previous pass's (all nodes in the first pass).
    pub moved: usize,
    pub seconds: f64,
}

/// A streaming partitioning and how it was reached.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamOutcome {
    pub partitioning: Partitioning,
    /// The streaming passes run: `params.passes`, fewer when restreaming converged
    /// ([`StreamParams::converged_below`]).
    pub passes: Vec<PassStats>,
    /// The refinement passes run: at most `params.refine_passes`, fewer when one moved nothing.
    pub refine_passes: Vec<PassStats>,
}

/// Edge cut and balance of a partitioning, as fractions.
#[derive(Clone, Debug, PartialEq)]
pub struct PartitionQuality {
    pub k: usize,
    /// Undirected edges across parts (see [`crate::partition`]'s conventions).
    pub edge_cut: usize,
    /// Undirected edges in the graph.
    pub num_undirected_edges: usize,
    /// `edge_cut / num_undirected_edges` (0 for a graph without edges). A uniformly random assignment
    /// gives about `1 - 1/k`.
    pub cut_fraction: f64,
    pub max_part: usize,
    pub min_part: usize,
    /// `max_part` over the mean part size.
    pub balance: f64,
}

/// Cut fraction and balance of `parts` on `csr` (any partitioner's: METIS, streaming, random).
/// O(k) memory besides the inputs.
pub fn quality(csr: Csr<'_>, parts: &Partitioning) -> Result<PartitionQuality, Error> {
    if parts.parts.len() != csr.num_nodes() {
        return Err(Error::partition(format!(
            "assigns {} nodes but the graph has {}",
            parts.parts.len(),
            csr.num_nodes()
        )));
    }
    let (edge_cut, total) = cut_and_total(csr, &parts.parts);
    let sizes = part_sizes(parts.k, &parts.parts);
    Ok(PartitionQuality {
        k: parts.k,
        edge_cut,
        num_undirected_edges: total,
        cut_fraction: if total == 0 {
            0.0
        } else {
            edge_cut as f64 / total as f64
        },
        max_part: sizes.iter().copied().max().unwrap_or(0),
        min_part: sizes.iter().copied().min().unwrap_or(0),
        balance: balance_of(&sizes),
    })
}

/// Partitions `csr` into `params.k` parts by streaming its rows (see the module doc for the algorithm,
/// the stream order and the memory bound). Deterministic: the result is a function of the graph and
/// `params` alone (single-threaded passes; the seed drives tie-breaking and the shuffled order).
///
/// Errors: `k` is 0 or exceeds the number of nodes (k = 1 on an empty graph gives the empty
/// partitioning); `eps` is negative or not finite; `passes` is 0; Fennel's `gamma` is not above 1; the
/// CSR is invalid.
pub fn partition_stream(csr: Csr<'_>, params: &StreamParams) -> Result<StreamOutcome, Error> {
    let n = csr.num_nodes();
    check_k(params.k, n)?;
    params.check()?;
    csr.validate()?;
    let order = Order::new(params.order, n, params.seed);
    let mut rows = |f: &mut dyn FnMut(usize, &[i32])| -> Result<(), Error> {
        for i in 0..n {
            let v = order.at(i);
            f(v, csr.neighbors(v));
        }
        Ok(())
    };
    // The number of non-empty rows is left for the first pass to count, as a streamed source must:
    // the two entry points then give the same assignment.
    let Passes {
        parts,
        passes,
        refine_passes,
    } = run_passes(params, n, csr.num_edges(), &mut rows)?;
    let partitioning =
        Partitioning::from_assignment(csr, params.k, parts, params.method(), params.seed)?;
    Ok(StreamOutcome {
        partitioning,
        passes,
        refine_passes,
    })
}

/// Streams every row once per call of `each_row`'s argument.
type RowStream<'a> = dyn FnMut(&mut dyn FnMut(usize, &[i32])) -> Result<(), Error> + 'a;

/// The assignment and what each pass did.
struct Passes {
    parts: Vec<u32>,
    passes: Vec<PassStats>,
    refine_passes: Vec<PassStats>,
}

/// The streaming passes, then the refinement passes, then the deal of the nodes left out, over
/// whatever `each_row` streams.
fn run_passes(
    params: &StreamParams,
    n: usize,
    num_edges: usize,
    each_row: &mut RowStream<'_>,
) -> Result<Passes, Error> {
    let mut st = Streamer::new(params, n, num_edges);
    let mut stats = Vec::with_capacity(params.passes);
    for pass in 0..params.passes {
        let t0 = Instant::now();
        st.start_pass();
        each_row(&mut |v, row| st.place(v, row))?;
        let s = st.end_pass(t0);
        let converged = pass > 0
            && params
                .converged_below
                .is_some_and(|f| s.moved as f64 <= f * n as f64);
        stats.push(s);
        if converged {
            break;
        }
    }
    let mut refine = Vec::with_capacity(params.refine_passes);
    if params.refine_passes > 0 {
        let mut r = Refiner::new(st);
        for _ in 0..params.refine_passes {
            let t0 = Instant::now();
            r.st.moved = 0;
            each_row(&mut |v, row| r.visit(v, row))?;
            let pass = r.st.end_pass(t0);
            let moved = pass.moved;
            refine.push(pass);
            if moved == 0 {
                break;
            }
        }
        st = r.st;
    }
    st.deal_unplaced();
    Ok(Passes {
        parts: st.parts,
        passes: stats,
        refine_passes: refine,
    })
}

/// A graph whose rows can be streamed in ascending node order, once per pass, without random access:
/// e.g. a chunked dataset on disk ([`crate::chunked::ChunkedDataset`]).
pub trait RowSource {
    fn num_nodes(&self) -> usize;
    /// CSR entries (an undirected edge counts twice).
    fn num_edges(&self) -> usize;
    /// Whether both directions of every edge are stored.
    fn symmetric(&self) -> bool;
    /// Calls `f(v, row v)` for `v = 0, 1, ...`, every row exactly once, each row strictly ascending and
    /// its ids in `0..num_nodes` (the source checks that, as a valid CSR guarantees it).
    fn for_each_row(&self, f: &mut dyn FnMut(usize, &[i32])) -> Result<(), Error>;
}

/// [`partition_stream`] over a [`RowSource`]: the same passes, in [`StreamOrder::Natural`] (the only
/// order a sequential source can give; another order is an error), and the same assignment as
/// [`partition_stream`] on the same graph and parameters. Memory: the assignment (`4 n` bytes), `O(k)`,
/// and whatever the source holds while streaming (a chunked dataset: two chunks of edges).
///
/// The edge cut is counted in one more streaming pass: for a symmetric source, crossing entries / 2
/// (exactly [`Partitioning::from_assignment`]'s count); for a directed one every crossing entry counts as
/// one undirected edge, an upper bound that is exact when no edge is stored in both directions
/// (deciding reciprocity would need random access).
pub fn partition_stream_rows(
    src: &dyn RowSource,
    params: &StreamParams,
) -> Result<StreamOutcome, Error> {
    let n = src.num_nodes();
    check_k(params.k, n)?;
    params.check()?;
    if params.order != StreamOrder::Natural {
        return Err(Error::param(
            "order",
            "a streamed source is read in ascending node order only (StreamOrder::Natural)",
        ));
    }
    let Passes {
        parts,
        passes,
        refine_passes,
    } = run_passes(params, n, src.num_edges(), &mut |f| src.for_each_row(f))?;
    let (edge_cut, _) = streamed_cut(src, &parts)?;
    let balance = balance_of(&part_sizes(params.k, &parts));
    Ok(StreamOutcome {
        partitioning: Partitioning {
            k: params.k,
            parts,
            edge_cut,
            balance,
            method: params.method(),
            seed: params.seed,
        },
        passes,
        refine_passes,
    })
}

/// `(cut, total)` undirected edges of a streamed source under `parts` (see [`partition_stream_rows`]
/// for how a directed source is counted).
pub fn streamed_cut(src: &dyn RowSource, parts: &[u32]) -> Result<(usize, usize), Error> {
    if parts.len() != src.num_nodes() {
        return Err(Error::partition(format!(
            "assigns {} nodes but the graph has {}",
            parts.len(),
            src.num_nodes()
        )));
    }
    let (mut cut, mut total) = (0usize, 0usize);
    src.for_each_row(&mut |v, row| {
        for &u in row {
            if u as usize != v {
                total += 1;
                cut += (parts[u as usize] != parts[v]) as usize;
            }
        }
    })?;
    Ok(if src.symmetric() {
        (cut / 2, total / 2)
    } else {
        (cut, total)
    })
}

/// The state of the streaming passes: the assignment, part sizes, per-part neighbour counts.
struct Streamer {
    parts: Vec<u32>,
    sizes: Vec<usize>,
    counts: Vec<u32>,
    touched: Vec<u32>,
    scorer: Scorer,
    params: StreamParams,
    num_edges: usize,
    /// Nodes the passes place: all of them, or with [`StreamParams::isolated_last`] those with a
    /// non-empty row (counted by the first pass).
    placed: Option<usize>,
    /// Nodes with a non-empty row seen in the current pass.
    seen_active: usize,
    moved: usize,
    cap: usize,
}

const UNASSIGNED: u32 = u32::MAX;

impl Streamer {
    fn new(params: &StreamParams, n: usize, num_edges: usize) -> Streamer {
        let k = params.k;
        let placed = if params.isolated_last { None } else { Some(n) };
        let cap = params.capacity(placed.unwrap_or(n));
        Streamer {
            parts: vec![UNASSIGNED; n],
            sizes: vec![0; k],
            counts: vec![0; k],
            touched: Vec::with_capacity(k),
            scorer: Scorer::new(params.algorithm, placed.unwrap_or(n), num_edges, k, cap),
            params: params.clone(),
            num_edges,
            placed,
            seen_active: 0,
            moved: 0,
            cap,
        }
    }

    /// Resets the pass's part sizes; the cap and Fennel's alpha follow the number of nodes placed,
    /// once known (with `isolated_last` the first pass uses all `n` nodes).
    fn start_pass(&mut self) {
        self.sizes.fill(0);
        self.moved = 0;
        self.seen_active = 0;
        let placed = self.placed.unwrap_or(self.parts.len());
        self.cap = self.params.capacity(placed);
        self.scorer = Scorer::new(
            self.params.algorithm,
            placed,
            self.num_edges,
            self.params.k,
            self.cap,
        );
    }

    fn end_pass(&mut self, t0: Instant) -> PassStats {
        debug_assert!(self.sizes.iter().all(|&s| s <= self.cap));
        if self.params.isolated_last && self.placed.is_none() {
            self.placed = Some(self.seen_active);
        }
        PassStats {
            moved: self.moved,
            seconds: t0.elapsed().as_secs_f64(),
        }
    }

    /// Places node `v`, whose row is `row`.
    fn place(&mut self, v: usize, row: &[i32]) {
        if self.params.isolated_last && row.is_empty() {
            return;
        }
        self.seen_active += 1;
        let k = self.sizes.len();
        for &u in row {
            let p = self.parts[u as usize];
            if p != UNASSIGNED && u as usize != v {
                if self.counts[p as usize] == 0 {
                    self.touched.push(p);
                }
                self.counts[p as usize] += 1;
            }
        }
        let start = rotation_start(self.params.seed, v, k);
        let best = self.scorer.choose(&self.counts, &self.sizes, start);
        for &p in &self.touched {
            self.counts[p as usize] = 0;
        }
        self.touched.clear();
        self.sizes[best] += 1;
        if self.parts[v] != best as u32 {
            self.moved += 1;
            self.parts[v] = best as u32;
        }
    }

    /// The current assignment's part sizes, nodes not yet placed left out.
    fn live_sizes(&self) -> Vec<usize> {
        let mut sizes = vec![0usize; self.params.k];
        for &p in &self.parts {
            if p != UNASSIGNED {
                sizes[p as usize] += 1;
            }
        }
        sizes
    }

    /// Deals the nodes the passes left out (empty rows, with `isolated_last`), in ascending id order,
    /// each to the currently smallest part, ties to the lower part id: as [`crate::partition_metis`]
    /// deals the nodes METIS never saw. A part that receives one was the smallest, so no part ends above
    /// `max(largest placed part, ceil(n / k))`, within the cap on all `n` nodes.
    fn deal_unplaced(&mut self) {
        if !self.parts.contains(&UNASSIGNED) {
            return;
        }
        let mut heap: BinaryHeap<Reverse<(usize, u32)>> = self
            .live_sizes()
            .into_iter()
            .enumerate()
            .map(|(p, size)| Reverse((size, p as u32)))
            .collect();
        for p in self.parts.iter_mut().filter(|p| **p == UNASSIGNED) {
            let Reverse((size, part)) = heap.pop().expect("the heap holds k >= 1 entries");
            *p = part;
            heap.push(Reverse((size + 1, part)));
        }
    }
}

/// Label-propagation refinement over the streamed rows (see the module doc): the streamer's assignment
/// and part sizes, now the live sizes of the current assignment rather than one pass's.
struct Refiner {
    st: Streamer,
}

impl Refiner {
    fn new(mut st: Streamer) -> Refiner {
        st.sizes = st.live_sizes();
        Refiner { st }
    }

    /// Moves `v` to the part holding most of its neighbours, if that part holds strictly more than
    /// `v`'s own and has room under the cap; ties go to the smaller part, then the first in a seeded
    /// rotation. Every move lowers the cut of an undirected graph by its gain, so the passes converge.
    fn visit(&mut self, v: usize, row: &[i32]) {
        let st = &mut self.st;
        let k = st.sizes.len();
        if st.parts[v] == UNASSIGNED {
            // Left for the deal (`isolated_last`): an empty row.
            return;
        }
        for &u in row {
            let p = st.parts[u as usize];
            if u as usize != v && p != UNASSIGNED {
                if st.counts[p as usize] == 0 {
                    st.touched.push(p);
                }
                st.counts[p as usize] += 1;
            }
        }
        let cur = st.parts[v] as usize;
        let here = st.counts[cur];
        let start = rotation_start(st.params.seed, v, k);
        let rank = |p: usize| (p + k - start) % k;
        let mut best = cur;
        let mut best_count = here;
        for &p in &st.touched {
            let (p, c) = (p as usize, st.counts[p as usize]);
            if p == cur || c <= here || st.sizes[p] >= st.cap {
                continue;
            }
            let better = best == cur
                || c > best_count
                || (c == best_count && (st.sizes[p], rank(p)) < (st.sizes[best], rank(best)));
            if better {
                best = p;
                best_count = c;
            }
        }
        for &p in &st.touched {
            st.counts[p as usize] = 0;
        }
        st.touched.clear();
        if best != cur {
            st.sizes[cur] -= 1;
            st.sizes[best] += 1;
            st.parts[v] = best as u32;
            st.moved += 1;
        }
    }
}

/// The per-part score of one node, and the choice among parts with room.
struct Scorer {
    algorithm: StreamAlgorithm,
    cap: usize,
    /// Fennel's `alpha * gamma`.
    alpha_gamma: f64,
}

impl Scorer {
    fn new(algorithm: StreamAlgorithm, n: usize, num_edges: usize, k: usize, cap: usize) -> Scorer {
        let n = n.max(1) as f64;
        // Undirected edges, approximately: an undirected dataset stores each edge twice. For a directed
        // one this halves m, which is also what the in-edge-only view sees of it.
        let m = num_edges as f64 / 2.0;
        let alpha_gamma = match algorithm {
            StreamAlgorithm::Fennel { gamma } => (k as f64).sqrt() * m / n.powf(gamma) * gamma,
            StreamAlgorithm::Ldg => 0.0,
        };
        Scorer {
            algorithm,
            cap,
            alpha_gamma,
        }
    }

    /// The best part with room: highest score, then smaller size, then first in rotation from `start`.
    fn choose(&self, counts: &[u32], sizes: &[usize], start: usize) -> usize {
        let k = sizes.len();
        let mut best = usize::MAX;
        let mut best_score = f64::NEG_INFINITY;
        for j in 0..k {
            let p = (start + j) % k;
            let size = sizes[p];
            if size >= self.cap {
                continue;
            }
            let c = counts[p] as f64;
            let score = match self.algorithm {
                StreamAlgorithm::Fennel { gamma } => {
                    let penalty = if gamma == 1.5 {
                        (size as f64).sqrt()
                    } else {
                        (size as f64).powf(gamma - 1.0)
                    };
                    c - self.alpha_gamma * penalty
                }
                StreamAlgorithm::Ldg => c * (1.0 - size as f64 / self.cap as f64),
            };
            if best == usize::MAX
                || score > best_score
                || (score == best_score && size < sizes[best])
            {
                best = p;
                best_score = score;
            }
        }
        assert!(
            best != usize::MAX,
            "every part is full, yet k * capacity >= n: a bug in the capacity"
        );
        best
    }
}

/// Where node `v`'s tie-breaking rotation over the `k` parts starts: a seeded hash, so that ties do not
/// all go to part 0.
fn rotation_start(seed: u64, v: usize, k: usize) -> usize {
    (splitmix64(seed ^ (v as u64).wrapping_mul(0x9e37_79b9)) % k as u64) as usize
}

/// A stream order: `at(i)` is the `i`-th node to arrive.
enum Order {
    Natural,
    /// A Feistel permutation of `0..2^(2 * half_bits)` restricted to `0..n` by cycle walking.
    Shuffled {
        n: usize,
        half_bits: u32,
        keys: [u64; ROUNDS],
    },
}

const ROUNDS: usize = 4;

impl Order {
    fn new(order: StreamOrder, n: usize, seed: u64) -> Order {
        match order {
            StreamOrder::Natural => Order::Natural,
            StreamOrder::Shuffled => {
                let bits = usize::BITS - n.max(2).saturating_sub(1).leading_zeros();
                let half_bits = bits.div_ceil(2).max(1);
                let mut keys = [0u64; ROUNDS];
                let mut x = seed ^ 0x5851_f42d_4c95_7f2d;
                for key in &mut keys {
                    x = splitmix64(x);
                    *key = x;
                }
                Order::Shuffled { n, half_bits, keys }
            }
        }
    }

    fn at(&self, i: usize) -> usize {
        match *self {
            Order::Natural => i,
            Order::Shuffled {
                n,
                half_bits,
                ref keys,
            } => {
                // The domain is at most 4n (2 * half_bits <= bits + 1), so the walk takes < 4 steps on
                // average; it ends because the permutation's cycle through `i < n` returns to `0..n`.
                let mut x = i as u64;
                loop {
                    x = feistel(x, half_bits, keys);
                    if (x as usize) < n {
                        return x as usize;
                    }
                }
            }
        }
    }
}

fn feistel(x: u64, half_bits: u32, keys: &[u64; ROUNDS]) -> u64 {
    let mask = (1u64 << half_bits) - 1;
    let (mut l, mut r) = (x >> half_bits, x & mask);
    for &key in keys {
        let f = splitmix64(r ^ key) & mask;
        (l, r) = (r, l ^ f);
    }
    (l << half_bits) | r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffled_order_is_a_permutation() {
        for n in [0usize, 1, 2, 3, 5, 17, 64, 65, 1000, 4097] {
            let order = Order::new(StreamOrder::Shuffled, n, 7);
            let mut seen = vec![false; n];
            for i in 0..n {
                let v = order.at(i);
                assert!(!seen[v], "n = {n}: node {v} arrives twice");
                seen[v] = true;
            }
            if n >= 64 {
                let moved = (0..n).filter(|&i| order.at(i) != i).count();
                assert!(moved > n / 2, "n = {n}: only {moved} nodes moved");
            }
        }
    }

    #[test]
    fn capacity_is_feasible_and_tight() {
        let mut p = StreamParams::new(3);
        p.eps = 0.0;
        assert_eq!(p.capacity(10), 4);
        p.eps = 0.1;
        assert_eq!(p.capacity(300), 110);
        p.k = 7;
        for n in 0..200 {
            assert!(p.capacity(n) * 7 >= n);
        }
    }
}
