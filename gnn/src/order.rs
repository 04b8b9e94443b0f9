//! Row reordering for locality: a permutation of a worker's owned rows that the model never sees.
//!
//! Every aggregation gathers the rows of a destination's neighbours. When node ids are random (a generator
//! that numbers nodes at random, a crawl), every gathered row is a random one of the whole matrix.
//! [`RowOrder::locality`] numbers the owned rows so that nodes with many edges between them are close:
//! [`RowOrder::clustered`] clusters them level by level (Louvain's local moving with a size cap, then
//! contraction, as Rabbit order and KaHIP's coarsening do) and numbers every cluster of every level as one
//! contiguous block. On `bench/gen_sbm.py`'s 1M-node SBM it puts 51% of the edges inside blocks of 65536
//! rows (a random order 6.5%, the planted classes 80%) in about 11 s; measured in `bench/RESULTS.md`
//! (issue 34, fourth round), neither it nor the planted classes as the order made a GAT, GCN or GraphSAGE
//! epoch faster on a 2-core EPYC: at average degree 10 the gathers are not where those epochs' time
//! goes. Ordering is therefore opt-in ([`crate::LocalGraph::new_local`], [`crate::LocalGraph::with_order`]).
//!
//! # Invariant
//!
//! A [`crate::LocalGraph`] built with an order ([`crate::LocalGraph::with_order`]) holds its operators, its
//! sources' degrees and global ids in *engine order*: engine row `e` is the caller's owned row
//! `to_caller[e]`. Halo rows (sources after the owned rows) are never permuted: the exchange fills them in
//! its own order. The training entry points ([`crate::train_resumable`], [`crate::train_resumable_owned`],
//! [`crate::evaluate`], [`crate::device::train_resumable_on`]) take features and node sets in the caller's
//! order and permute them in once; an exchange that moves rows sees the owned rows in the caller's order
//! ([`Reordered`]). Dropout masks are keyed by global node id, so a reordered engine draws the same masks
//! as an unordered one and its losses equal the unordered engine's up to float reordering (the tests in
//! `tests/reorder.rs` hold it at 1e-4, for the whole graph and for two partitions exchanging halo rows).

use std::sync::Arc;

use rayon::prelude::*;

use crate::exchange::{Exchange, ExchangeError, ExchangeStats, HaloGrads, HaloSeed, VisitRows};
use crate::model::Pass;
use crate::tensor::Matrix;
use crate::train::NodeSets;

/// The largest cluster of [`RowOrder::locality`], in rows: 64k rows of 32 floats (a GAT layer's messages)
/// are 8 MiB, of 128 floats 32 MiB, about the last-level cache.
pub const ROWS_PER_PART: usize = 1 << 16;

/// A permutation of `n` owned rows: engine row `e` holds the caller's row `to_caller[e]`, and
/// `to_engine[to_caller[e]] == e`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowOrder {
    to_engine: Vec<u32>,
    to_caller: Vec<u32>,
}

impl RowOrder {
    /// The order whose engine row `e` is the caller's row `to_caller[e]`. Panics unless `to_caller` is a
    /// permutation of `0..len`.
    pub fn from_engine_order(to_caller: Vec<u32>) -> RowOrder {
        let n = to_caller.len();
        let mut to_engine = vec![u32::MAX; n];
        for (e, &c) in to_caller.iter().enumerate() {
            assert!(
                (c as usize) < n && to_engine[c as usize] == u32::MAX,
                "row order: {c} is out of range or repeated"
            );
            to_engine[c as usize] = e as u32;
        }
        RowOrder {
            to_engine,
            to_caller,
        }
    }

    /// A locality order of the `n_dst` owned rows of an in-neighbour CSR whose sources below `n_dst` are the
    /// owned rows (halo sources, at `n_dst` and above, are ignored): [`RowOrder::clustered`] with clusters
    /// of at most [`ROWS_PER_PART`] rows. `None` when the rows fit one such block (nothing to gain).
    pub fn locality(n_dst: usize, indptr: &[i64], indices: &[i32]) -> Option<RowOrder> {
        (n_dst > ROWS_PER_PART).then(|| RowOrder::clustered(n_dst, indptr, indices, ROWS_PER_PART))
    }

    /// A hierarchical community order of the `n_dst` owned rows (halo sources ignored): size-constrained
    /// label propagation clusters the rows (a row joins the cluster it has the most edges into, as long as
    /// that cluster stays within `cap` rows), the clusters are contracted into a weighted graph, and the same
    /// runs again on it, level after level, until a level merges less than a tenth of its nodes. The rows
    /// are then numbered cluster by cluster, top level first, so every cluster of every level is one
    /// contiguous block of rows: most gathers of a graph with communities fall inside the block the row
    /// being computed lies in (the idea of Rabbit order and of KaHIP's coarsening).
    pub fn clustered(n_dst: usize, indptr: &[i64], indices: &[i32], cap: usize) -> RowOrder {
        // level 0: the owned subgraph, unit weights
        let mut ptr: Vec<usize> = Vec::with_capacity(n_dst + 1);
        let mut adj: Vec<u32> = Vec::with_capacity(indices.len());
        ptr.push(0);
        for v in 0..n_dst {
            adj.extend(
                indices[indptr[v] as usize..indptr[v + 1] as usize]
                    .iter()
                    .filter(|&&j| (j as usize) < n_dst && j as usize != v)
                    .map(|&j| j as u32),
            );
            ptr.push(adj.len());
        }
        let mut wts: Vec<u32> = vec![1; adj.len()];
        let mut node_w: Vec<u32> = vec![1; n_dst];
        // a node's volume: its edges' weight, the edges inside it (after contraction) counted too
        let mut vol: Vec<f64> = (0..n_dst).map(|v| (ptr[v + 1] - ptr[v]) as f64).collect();
        // parents[l][v]: the level-(l+1) node of level-l node v
        let mut parents: Vec<Vec<u32>> = Vec::new();
        let mut n = n_dst;
        for level in 0..8u64 {
            let label = cluster_level(n, &ptr, &adj, &wts, &node_w, &vol, cap, level);
            // renumber the labels densely
            let mut id = vec![u32::MAX; n];
            let mut m = 0u32;
            for &l in &label {
                if id[l as usize] == u32::MAX {
                    id[l as usize] = m;
                    m += 1;
                }
            }
            let parent: Vec<u32> = label.iter().map(|&l| id[l as usize]).collect();
            let m = m as usize;
            let shrunk = m * 10 < n * 9;
            // contract: the clusters' weighted graph
            let mut members_start = vec![0usize; m + 1];
            for &p in &parent {
                members_start[p as usize + 1] += 1;
            }
            for q in 0..m {
                members_start[q + 1] += members_start[q];
            }
            let mut members = vec![0u32; n];
            let mut fill = members_start.clone();
            for (v, &p) in parent.iter().enumerate() {
                members[fill[p as usize]] = v as u32;
                fill[p as usize] += 1;
            }
            let mut acc = vec![0u32; m];
            let mut touched: Vec<u32> = Vec::new();
            let mut nptr = Vec::with_capacity(m + 1);
            let mut nadj = Vec::new();
            let mut nwts = Vec::new();
            let mut nw = vec![0u32; m];
            let mut nvol = vec![0f64; m];
            nptr.push(0usize);
            for c in 0..m {
                for &v in &members[members_start[c]..members_start[c + 1]] {
                    nw[c] += node_w[v as usize];
                    nvol[c] += vol[v as usize];
                    for k in ptr[v as usize]..ptr[v as usize + 1] {
                        let d = parent[adj[k] as usize];
                        if d as usize == c {
                            continue;
                        }
                        if acc[d as usize] == 0 {
                            touched.push(d);
                        }
                        acc[d as usize] += wts[k];
                    }
                }
                for &d in &touched {
                    nadj.push(d);
                    nwts.push(acc[d as usize]);
                    acc[d as usize] = 0;
                }
                touched.clear();
                nptr.push(nadj.len());
            }
            parents.push(parent);
            (ptr, adj, wts, node_w, vol, n) = (nptr, nadj, nwts, nw, nvol, m);
            if !shrunk {
                break;
            }
        }
        // number the top level's nodes in order, then expand level by level: a level's nodes grouped by
        // their parent's position, stable
        let mut pos: Vec<u32> = (0..n as u32).collect();
        for parent in parents.iter().rev() {
            let m = pos.len();
            let mut start = vec![0usize; m + 1];
            for &p in parent {
                start[pos[p as usize] as usize + 1] += 1;
            }
            for q in 0..m {
                start[q + 1] += start[q];
            }
            let mut next = vec![0u32; parent.len()];
            for (v, &p) in parent.iter().enumerate() {
                let q = pos[p as usize] as usize;
                next[v] = start[q] as u32;
                start[q] += 1;
            }
            pos = next;
        }
        // pos[c] is the engine row of the caller's row c
        let mut to_caller = vec![0u32; n_dst];
        for (c, &e) in pos.iter().enumerate() {
            to_caller[e as usize] = c as u32;
        }
        RowOrder::from_engine_order(to_caller)
    }

    pub fn len(&self) -> usize {
        self.to_caller.len()
    }

    pub fn is_empty(&self) -> bool {
        self.to_caller.is_empty()
    }

    /// Engine row of the caller's row `c`.
    pub fn engine_row(&self, c: usize) -> usize {
        self.to_engine[c] as usize
    }

    /// The caller's row of engine row `e`.
    pub fn caller_row(&self, e: usize) -> usize {
        self.to_caller[e] as usize
    }

    /// `to_caller`: engine row `e` is the caller's row `to_caller()[e]`.
    pub fn to_caller(&self) -> &[u32] {
        &self.to_caller
    }

    /// `to_engine`: the caller's row `c` is engine row `to_engine()[c]`.
    pub fn to_engine(&self) -> &[u32] {
        &self.to_engine
    }

    /// The rows of `m` (the caller's order; rows past [`RowOrder::len`], halo rows, keep their place) in
    /// engine order.
    pub fn rows_to_engine(&self, m: &Matrix) -> Matrix {
        gather_rows(m, &self.to_caller)
    }

    /// The rows of `m` (engine order; rows past [`RowOrder::len`] keep their place) in the caller's order:
    /// logits, embeddings, gradients handed out of the engine.
    pub fn rows_to_caller(&self, m: &Matrix) -> Matrix {
        gather_rows(m, &self.to_engine)
    }

    /// The rows of `m` (the caller's order, at least [`RowOrder::len`] rows) put in engine order in place,
    /// by following the permutation's cycles with one spare row: no second matrix, so a worker's features
    /// cost no more memory in a locality order than in the caller's.
    pub fn permute_to_engine_in_place(&self, m: &mut Matrix) {
        let n = self.len();
        let cols = m.cols();
        assert!(m.rows() >= n, "the matrix has a row per ordered row");
        if cols == 0 {
            return;
        }
        let data = m.data_mut();
        let mut done = vec![false; n];
        let mut spare = vec![0f32; cols];
        for start in 0..n {
            if done[start] {
                continue;
            }
            // engine row j takes the caller's row to_caller[j]: walk j -> to_caller[j] until the cycle closes
            spare.copy_from_slice(&data[start * cols..(start + 1) * cols]);
            let mut j = start;
            loop {
                done[j] = true;
                let from = self.to_caller[j] as usize;
                if from == start {
                    data[j * cols..(j + 1) * cols].copy_from_slice(&spare);
                    break;
                }
                data.copy_within(from * cols..(from + 1) * cols, j * cols);
                j = from;
            }
        }
    }

    /// The fraction of the edges of an in-neighbour CSR (caller's order; halo sources ignored) whose two
    /// owned ends lie in the same block of `block` engine rows: how many gathers stay near the row being
    /// computed (a random order gives about `block / n`).
    pub fn block_locality(&self, indptr: &[i64], indices: &[i32], block: usize) -> f64 {
        let n = self.len();
        let (mut near, mut all) = (0usize, 0usize);
        for c in 0..n {
            let b = self.to_engine[c] as usize / block;
            for &j in &indices[indptr[c] as usize..indptr[c + 1] as usize] {
                if (j as usize) < n {
                    all += 1;
                    near += (self.to_engine[j as usize] as usize / block == b) as usize;
                }
            }
        }
        near as f64 / all.max(1) as f64
    }

    /// The caller's node sets in engine order: labels permuted, every row list mapped and sorted (so the
    /// loss reads rows front to back).
    pub fn sets_to_engine(&self, sets: &NodeSets) -> NodeSets {
        assert_eq!(sets.labels.len(), self.len(), "one label per owned row");
        let map = |rows: &[u32]| {
            let mut r: Vec<u32> = rows.iter().map(|&c| self.to_engine[c as usize]).collect();
            r.sort_unstable();
            r
        };
        NodeSets {
            labels: self
                .to_caller
                .iter()
                .map(|&c| sets.labels[c as usize])
                .collect(),
            train: map(&sets.train),
            val: map(&sets.val),
            test: map(&sets.test),
        }
    }

    /// An in-neighbour CSR of `n_dst = len()` destination rows in engine order: rows permuted, owned sources
    /// renumbered, halo sources (at `len()` and above) unchanged, every row's sources sorted.
    pub fn csr_to_engine(&self, indptr: &[i64], indices: &[i32]) -> (Vec<i64>, Vec<i32>) {
        let n = self.len();
        assert_eq!(indptr.len(), n + 1, "indptr has n_dst + 1 entries");
        let mut out_ptr = Vec::with_capacity(n + 1);
        out_ptr.push(0i64);
        for &c in &self.to_caller {
            let c = c as usize;
            let len = indptr[c + 1] - indptr[c];
            out_ptr.push(out_ptr.last().copied().unwrap_or(0) + len);
        }
        let mut out = vec![0i32; out_ptr[n] as usize];
        // split the output into its rows, then fill them in parallel
        let mut rows: Vec<&mut [i32]> = Vec::with_capacity(n);
        let mut rest = out.as_mut_slice();
        for e in 0..n {
            let (row, tail) = rest.split_at_mut((out_ptr[e + 1] - out_ptr[e]) as usize);
            rows.push(row);
            rest = tail;
        }
        rows.into_par_iter().enumerate().for_each(|(e, row)| {
            let c = self.to_caller[e] as usize;
            let src = &indices[indptr[c] as usize..indptr[c + 1] as usize];
            for (o, &j) in row.iter_mut().zip(src) {
                *o = if (j as usize) < n {
                    self.to_engine[j as usize] as i32
                } else {
                    j
                };
            }
            row.sort_unstable();
        });
        (out_ptr, out)
    }

    /// A per-source array (`n_src` entries: owned rows then halo rows) in engine order.
    pub fn sources_to_engine<T: Copy>(&self, per_source: &[T]) -> Vec<T> {
        let n = self.len();
        assert!(per_source.len() >= n, "one entry per source row");
        self.to_caller
            .iter()
            .map(|&c| per_source[c as usize])
            .chain(per_source[n..].iter().copied())
            .collect()
    }
}

/// `out[i] = m[from[i]]` for `i < from.len()`, rows after that copied in place.
fn gather_rows(m: &Matrix, from: &[u32]) -> Matrix {
    let (rows, cols) = m.shape();
    assert!(rows >= from.len(), "the matrix has a row per ordered row");
    let mut out = Matrix::zeros(rows, cols);
    if cols == 0 {
        return out;
    }
    let src = m.data();
    out.data_mut()
        .par_chunks_mut(cols)
        .enumerate()
        .for_each(|(i, row)| {
            let r = from.get(i).map_or(i, |&r| r as usize);
            row.copy_from_slice(&src[r * cols..(r + 1) * cols]);
        });
    out
}

/// An exchange seen through a [`RowOrder`]: the engine hands it owned rows in engine order, the exchange
/// underneath (which indexes owned rows by the caller's local index: its send lists) sees them in the
/// caller's order. Halo rows pass through unchanged. A local exchange moves nothing and is called as is.
pub struct Reordered<'a> {
    pub inner: &'a mut dyn Exchange,
    pub order: Arc<RowOrder>,
}

impl Reordered<'_> {
    /// Runs `f` on `own` in the caller's order (as it is for a local exchange, which moves nothing).
    fn on_own<R>(&mut self, own: &Matrix, f: impl FnOnce(&mut dyn Exchange, &Matrix) -> R) -> R {
        if self.inner.is_local() {
            return f(&mut *self.inner, own);
        }
        let caller = self.order.rows_to_caller(own);
        f(&mut *self.inner, &caller)
    }

    /// Runs `f` on `own_grad` in the caller's order and puts the result back in engine order (as it
    /// is for a local exchange).
    fn on_grad<R>(
        &mut self,
        own_grad: &mut Matrix,
        f: impl FnOnce(&mut dyn Exchange, &mut Matrix) -> R,
    ) -> R {
        if self.inner.is_local() {
            return f(&mut *self.inner, own_grad);
        }
        let mut caller = self.order.rows_to_caller(own_grad);
        let r = f(&mut *self.inner, &mut caller);
        *own_grad = self.order.rows_to_engine(&caller);
        r
    }
}

impl Exchange for Reordered<'_> {
    fn begin_pass(&mut self, pass: Pass) {
        self.inner.begin_pass(pass)
    }

    fn forward(&mut self, layer: usize, own: &Matrix) -> Result<Option<Matrix>, ExchangeError> {
        self.on_own(own, |ex, own| ex.forward(layer, own))
    }

    fn backward(
        &mut self,
        layer: usize,
        halo_grad: Matrix,
        own_grad: &mut Matrix,
    ) -> Result<(), ExchangeError> {
        self.on_grad(own_grad, |ex, g| ex.backward(layer, halo_grad, g))
    }

    fn forward_seeded(
        &mut self,
        layer: usize,
        own: &Matrix,
        seed: &HaloSeed,
    ) -> Result<Option<Matrix>, ExchangeError> {
        self.on_own(own, |ex, own| ex.forward_seeded(layer, own, seed))
    }

    fn rematerializes(&self) -> bool {
        self.inner.rematerializes()
    }

    fn forward_each(
        &mut self,
        layer: usize,
        own: &Matrix,
        visit: &mut VisitRows<'_>,
    ) -> Result<(), ExchangeError> {
        self.on_own(own, |ex, own| ex.forward_each(layer, own, visit))
    }

    fn refetch_each(
        &mut self,
        layer: usize,
        own: &Matrix,
        visit: &mut VisitRows<'_>,
    ) -> Result<(), ExchangeError> {
        self.on_own(own, |ex, own| ex.refetch_each(layer, own, visit))
    }

    fn backward_each(
        &mut self,
        layer: usize,
        n_halo: usize,
        own_grad: &mut Matrix,
        grad: &mut HaloGrads<'_>,
    ) -> Result<(), ExchangeError> {
        self.on_grad(own_grad, |ex, g| ex.backward_each(layer, n_halo, g, grad))
    }

    fn all_reduce(&mut self, grads: &mut [Matrix]) -> Result<(), ExchangeError> {
        self.inner.all_reduce(grads)
    }

    fn all_reduce_scalars(&mut self, values: &mut [f64]) -> Result<(), ExchangeError> {
        self.inner.all_reduce_scalars(values)
    }

    fn take_stats(&mut self) -> ExchangeStats {
        self.inner.take_stats()
    }

    fn is_local(&self) -> bool {
        self.inner.is_local()
    }
}

/// One level of local moving (Louvain's first phase, with a size cap): every node starts in its own
/// cluster; passes over the nodes move a node to the neighbouring cluster with the largest modularity gain
/// (edge weight into the cluster less the node's volume times the cluster's over twice the total weight),
/// if positive and the cluster's node weight stays within `cap`; ties broken by a seeded hash; at most 8
/// passes, stopping once a pass moves fewer than one node in a hundred. Returns each node's cluster (a node
/// id). The volume term is what keeps clusters from growing into one: plain label propagation with a cap
/// merges across communities once clusters are large.
#[allow(clippy::too_many_arguments)]
fn cluster_level(
    n: usize,
    ptr: &[usize],
    adj: &[u32],
    wts: &[u32],
    node_w: &[u32],
    vol: &[f64],
    cap: usize,
    level: u64,
) -> Vec<u32> {
    let two_m: f64 = vol.iter().sum::<f64>().max(1.0);
    let mut label: Vec<u32> = (0..n as u32).collect();
    let mut size: Vec<u64> = node_w.iter().map(|&w| u64::from(w)).collect();
    let mut tot: Vec<f64> = vol.to_vec();
    let mut acc = vec![0u64; n];
    let mut touched: Vec<u32> = Vec::new();
    for pass in 0..8u64 {
        let mut moved = 0usize;
        for v in 0..n {
            let own = label[v];
            for k in ptr[v]..ptr[v + 1] {
                let l = label[adj[k] as usize];
                if acc[l as usize] == 0 {
                    touched.push(l);
                }
                acc[l as usize] += u64::from(wts[k]);
            }
            let w = u64::from(node_w[v]);
            let kv = vol[v] / two_m;
            let stay = acc[own as usize] as f64 - kv * (tot[own as usize] - vol[v]);
            let (mut best, mut best_s, mut best_h) = (own, stay, 0u64);
            for &l in &touched {
                if l == own || size[l as usize] + w > cap as u64 {
                    continue;
                }
                let s = acc[l as usize] as f64 - kv * tot[l as usize];
                let h = crate::rng::mix64(
                    (v as u64) << 32
                        ^ u64::from(l)
                        ^ (pass ^ level << 8).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                ) | 1;
                if s > best_s || (s == best_s && best != own && h < best_h) {
                    (best, best_s, best_h) = (l, s, h);
                }
            }
            for &l in &touched {
                acc[l as usize] = 0;
            }
            touched.clear();
            if best != own {
                size[own as usize] -= w;
                size[best as usize] += w;
                tot[own as usize] -= vol[v];
                tot[best as usize] += vol[v];
                label[v] = best;
                moved += 1;
            }
        }
        if moved * 100 < n {
            break;
        }
    }
    label
}
