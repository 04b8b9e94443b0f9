//! Graph partitioning for partition-parallel training: which worker owns which node, what each worker
//! needs to train its part, and storing both beside the dataset so they are computed once.
//!
//! Three layers, each usable alone:
//!
//! - [`partition_metis`] assigns every node to one of `k` parts (METIS k-way on the symmetrised graph,
//!   deterministic for a seed) and reports the edge cut and balance ([`Partitioning`]).
//! - [`build_parts`] cuts a dataset along a partitioning into one [`Part`] per worker: its owned rows,
//!   its halo (in-neighbours owned by peers), a local in-neighbour CSR over both, and the send/receive
//!   lists that say which rows travel between which pair of workers and in what order.
//! - [`ensure_partitions`] stores those beside the dataset file `X.safetensors` as
//!   `X.parts/k<K>-seed<S>/{partition.safetensors, part<P>.safetensors}`, reusing what is already there
//!   unless the dataset changed since. [`list_partitions`] reports what is stored.
//!
//! A worker loads only its own part file ([`Part::load`]), so no worker ever maps the whole dataset.
//!
//! Conventions. "Edge cut" counts *undirected* edges: unordered node pairs `{u, v}`, `u != v`, joined by
//! an edge in either direction, whose endpoints lie in different parts. For an undirected dataset that is
//! half the crossing CSR entries; it is also what METIS minimises on the symmetrised graph. "Balance" is
//! the largest part's node count over the mean (`num_nodes / k`), 1.0 being perfect.
//!
//! Ordering contract the engine relies on: `halo` is grouped by owner part ascending and ascending by
//! global id within a group, and owned rows are ascending by global id. A sender's local row ids are then
//! monotone in global id, so the rows peer `b` needs from `a` are listed (in `a.send`) in exactly the
//! order `b` stores them (in `b.halo`): a message can be copied into place with no index exchange.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::tensor::{Dtype, SafeTensors};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::csr::Csr;
use crate::error::Error;
use crate::format::{
    Dataset, FeatureDtype, FeatureView, Features, METADATA_KEY, Metadata, OwnedDataset, Split,
    checksum, write_safetensors,
};
use crate::stream::{StreamParams, partition_stream};

/// Version of the partition and part files this build writes and reads.
pub const PARTITION_FORMAT_VERSION: u32 = 1;

const KIND_PARTITIONING: &str = "partitioning";
const KIND_PART: &str = "part";
/// The commit marker of a partition set: written after every part file.
pub const PARTITION_FILE: &str = "partition.safetensors";

// ---------------------------------------------------------------------------------------------------
// Node -> part assignment
// ---------------------------------------------------------------------------------------------------

/// A node -> part assignment for `k` parts.
#[derive(Clone, Debug, PartialEq)]
pub struct Partitioning {
    pub k: usize,
    /// `parts[v]` is the part owning node `v`, in `0..k`.
    pub parts: Vec<u32>,
    /// Undirected edges whose endpoints lie in different parts (see the module doc).
    pub edge_cut: usize,
    /// Largest part size over the mean part size (`num_nodes / k`); 1.0 for an empty graph.
    pub balance: f64,
    /// `"metis"` or `"single"` (k = 1), or whatever a caller of [`Partitioning::from_assignment`] named.
    pub method: String,
    pub seed: u64,
}

impl Partitioning {
    /// Wraps a given assignment (e.g. a random one, for comparison), checking it against `csr` and
    /// computing its edge cut and balance.
    pub fn from_assignment(
        csr: Csr<'_>,
        k: usize,
        parts: Vec<u32>,
        method: impl Into<String>,
        seed: u64,
    ) -> Result<Partitioning, Error> {
        Self::counted(csr, k, parts, method.into(), seed, |csr, parts| {
            cut_and_total(csr, parts).0
        })
    }

    /// [`Partitioning::from_assignment`] of a CSR that holds both directions of every edge (a dataset
    /// that is not `directed`): the same edge cut, counted as crossing entries / 2 without looking up
    /// each entry's reverse (a random access per edge).
    pub fn from_symmetric_assignment(
        csr: Csr<'_>,
        k: usize,
        parts: Vec<u32>,
        method: impl Into<String>,
        seed: u64,
    ) -> Result<Partitioning, Error> {
        Self::counted(csr, k, parts, method.into(), seed, symmetric_cut)
    }

    /// The assignment checked, its edge cut counted by `cut`, its balance.
    fn counted(
        csr: Csr<'_>,
        k: usize,
        parts: Vec<u32>,
        method: String,
        seed: u64,
        cut: fn(Csr<'_>, &[u32]) -> usize,
    ) -> Result<Partitioning, Error> {
        check_assignment(csr.num_nodes(), k, &parts)?;
        let edge_cut = cut(csr, &parts);
        let balance = balance_of(&part_sizes(k, &parts));
        Ok(Partitioning {
            k,
            parts,
            edge_cut,
            balance,
            method,
            seed,
        })
    }

    /// Number of nodes in each part.
    pub fn part_sizes(&self) -> Vec<usize> {
        part_sizes(self.k, &self.parts)
    }
}

/// Partitions `csr` into `k` parts with METIS k-way (minimising the edge cut, default imbalance
/// tolerance: METIS's `ufactor` 30, i.e. parts up to 1.03 x the mean).
///
/// METIS needs a symmetric graph without self loops, so it runs on the union of `csr` and its transpose
/// (an undirected dataset is its own transpose). Nodes with no edge in either direction are left out of
/// METIS's input and then dealt, in ascending id order, to the currently smallest part: they cost no
/// communication wherever they go, and this keeps them from skewing the balance. `k == 1` gives the
/// trivial partitioning (method `"single"`). The result is a deterministic function of the graph, `k` and
/// `seed` (METIS is serial; its `seed` option is `seed` folded to 31 bits).
///
/// Errors: `k` is 0 or exceeds the number of nodes; the CSR is invalid; the symmetrised graph has more
/// entries than METIS's 32-bit indices address; METIS fails.
pub fn partition_metis(csr: Csr<'_>, k: usize, seed: u64) -> Result<Partitioning, Error> {
    let n = csr.num_nodes();
    check_k(k, n)?;
    csr.validate()?;
    if k == 1 {
        return Ok(Partitioning {
            k,
            parts: vec![0; n],
            edge_cut: 0,
            balance: 1.0,
            method: "single".into(),
            seed,
        });
    }
    let g = symmetric_graph(csr)?;
    let n_kept = g.kept.len();
    let mut part: Vec<metis::Idx> = vec![0; n_kept];
    if n_kept >= k {
        let nparts = metis::Idx::try_from(k)
            .map_err(|_| Error::partition(format!("k = {k} does not fit METIS's index type")))?;
        let fail = |e: &dyn std::fmt::Display| {
            Error::partition(format!(
                "METIS failed to split {n_kept} connected nodes into {k} parts: {e}"
            ))
        };
        // GKlib keeps its random generator in process-global state (`random.c`: `static uint64_t mt[]`),
        // so two METIS calls on different threads draw from one stream: both results then depend on the
        // interleaving, and the C code races. One call at a time keeps a seed meaning one partitioning.
        let _serial = METIS_LOCK
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        metis::Graph::new(1, nparts, &g.xadj, &g.adjncy)
            .map_err(|e| fail(&e))?
            .set_option(metis::option::Seed(metis_seed(seed)))
            .part_kway(&mut part)
            .map_err(|e| fail(&e))?;
    } else {
        // Fewer connected nodes than parts: one each (METIS is not meant for nparts > nvtxs).
        for (i, p) in part.iter_mut().enumerate() {
            *p = i as metis::Idx;
        }
    }

    let mut parts = vec![u32::MAX; n];
    for (&v, &p) in g.kept.iter().zip(&part) {
        if p < 0 || p as usize >= k {
            return Err(Error::partition(format!(
                "METIS returned part {p} for node {v}, outside 0..{k}"
            )));
        }
        parts[v as usize] = p as u32;
    }
    // Isolated nodes: smallest part first, ties to the lower part id.
    let mut sizes = vec![0usize; k];
    for &v in &g.kept {
        sizes[parts[v as usize] as usize] += 1;
    }
    let mut heap: BinaryHeap<Reverse<(usize, u32)>> =
        (0..k).map(|p| Reverse((sizes[p], p as u32))).collect();
    for p in parts.iter_mut().filter(|p| **p == u32::MAX) {
        let Reverse((size, part)) = heap.pop().expect("the heap holds k >= 1 entries");
        *p = part;
        heap.push(Reverse((size + 1, part)));
    }

    let (edge_cut, _) = cut_and_total(csr, &parts);
    let balance = balance_of(&part_sizes(k, &parts));
    Ok(Partitioning {
        k,
        parts,
        edge_cut,
        balance,
        method: "metis".into(),
        seed,
    })
}

/// Serialises calls into METIS (see [`partition_metis`]).
static METIS_LOCK: Mutex<()> = Mutex::new(());

/// Folds a 64-bit seed into the non-negative 31-bit range of METIS's `seed` option.
fn metis_seed(seed: u64) -> metis::Idx {
    let folded = seed ^ (seed >> 31) ^ (seed >> 62);
    (folded & 0x7fff_ffff) as metis::Idx
}

pub(crate) fn check_k(k: usize, n: usize) -> Result<(), Error> {
    if k == 0 {
        return Err(Error::param("k", "the number of parts must be at least 1"));
    }
    if k > 1 && k > n {
        return Err(Error::param(
            "k",
            format!("{k} parts exceed the graph's {n} nodes"),
        ));
    }
    Ok(())
}

fn check_assignment(n: usize, k: usize, parts: &[u32]) -> Result<(), Error> {
    if k == 0 {
        return Err(Error::param("k", "the number of parts must be at least 1"));
    }
    if parts.len() != n {
        return Err(Error::partition(format!(
            "assigns {} nodes but the graph has {n}",
            parts.len()
        )));
    }
    if let Some((v, &p)) = parts.iter().enumerate().find(|(_, p)| **p as usize >= k) {
        return Err(Error::partition(format!(
            "node {v} is assigned to part {p}, outside 0..{k}"
        )));
    }
    Ok(())
}

pub(crate) fn part_sizes(k: usize, parts: &[u32]) -> Vec<usize> {
    let mut sizes = vec![0usize; k];
    for &p in parts {
        sizes[p as usize] += 1;
    }
    sizes
}

pub(crate) fn balance_of(sizes: &[usize]) -> f64 {
    let n: usize = sizes.iter().sum();
    if n == 0 {
        return 1.0;
    }
    let max = *sizes.iter().max().expect("n > 0 implies a part");
    max as f64 * sizes.len() as f64 / n as f64
}

/// `(cut, total)` undirected edges of `csr` under `parts` (see the module doc). An entry `u -> v` whose
/// reverse is also stored is half of an undirected edge, a one-way entry a whole one; doubled counts keep
/// the sum in integers.
pub(crate) fn cut_and_total(csr: Csr<'_>, parts: &[u32]) -> (usize, usize) {
    let (cut2, total2) = (0..csr.num_nodes())
        .into_par_iter()
        .with_min_len(4096)
        .map(|v| {
            let (mut cut2, mut total2) = (0usize, 0usize);
            for &u in csr.neighbors(v) {
                let u = u as usize;
                if u == v {
                    continue;
                }
                let reciprocal = csr.neighbors(u).binary_search(&(v as i32)).is_ok();
                let w = if reciprocal { 1 } else { 2 };
                total2 += w;
                if parts[u] != parts[v] {
                    cut2 += w;
                }
            }
            (cut2, total2)
        })
        .reduce(|| (0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    (cut2 / 2, total2 / 2)
}

/// [`cut_and_total`]'s cut of a CSR holding both directions of every edge: crossing entries / 2 (self
/// loops left out), with no lookup of each entry's reverse.
fn symmetric_cut(csr: Csr<'_>, parts: &[u32]) -> usize {
    let cut2: usize = (0..csr.num_nodes())
        .into_par_iter()
        .with_min_len(4096)
        .map(|v| {
            csr.neighbors(v)
                .iter()
                .filter(|&&u| u as usize != v && parts[u as usize] != parts[v])
                .count()
        })
        .sum();
    cut2 / 2
}

/// METIS's input: the symmetrised graph over the nodes that have an edge, renumbered densely.
struct MetisGraph {
    /// METIS vertex -> node id, ascending.
    kept: Vec<u32>,
    xadj: Vec<metis::Idx>,
    adjncy: Vec<metis::Idx>,
}

fn symmetric_graph(csr: Csr<'_>) -> Result<MetisGraph, Error> {
    let n = csr.num_nodes();
    let (tp, ti) = csr.transpose();
    let out_neighbors = |v: usize| &ti[tp[v] as usize..tp[v + 1] as usize];
    let mut dense = vec![-1i64; n];
    let mut kept = Vec::new();
    for v in 0..n {
        if csr.degree(v) > 0 || tp[v + 1] > tp[v] {
            dense[v] = kept.len() as i64;
            kept.push(v as u32);
        }
    }
    let too_large = |what: &str| {
        Error::partition(format!(
            "the symmetrised graph has more {what} than METIS's index type can address"
        ))
    };
    let mut xadj: Vec<metis::Idx> = Vec::with_capacity(kept.len() + 1);
    xadj.push(0);
    let mut adjncy: Vec<metis::Idx> = Vec::with_capacity(csr.num_edges());
    for &v in &kept {
        let v = v as usize;
        let (a, b) = (csr.neighbors(v), out_neighbors(v));
        // Sorted union of in- and out-neighbours, without `v` itself.
        let (mut i, mut j) = (0, 0);
        while i < a.len() || j < b.len() {
            let next = if j == b.len() || (i < a.len() && a[i] < b[j]) {
                i += 1;
                a[i - 1]
            } else if i == a.len() || b[j] < a[i] {
                j += 1;
                b[j - 1]
            } else {
                i += 1;
                j += 1;
                a[i - 1]
            };
            if next as usize != v {
                let id = dense[next as usize];
                adjncy.push(metis::Idx::try_from(id).map_err(|_| too_large("nodes"))?);
            }
        }
        xadj.push(metis::Idx::try_from(adjncy.len()).map_err(|_| too_large("edges"))?);
    }
    Ok(MetisGraph { kept, xadj, adjncy })
}

// ---------------------------------------------------------------------------------------------------
// Per-worker parts
// ---------------------------------------------------------------------------------------------------

/// The dataset arrays [`build_parts`] reads, borrowed from a [`Dataset`] or an [`OwnedDataset`].
#[derive(Clone, Copy, Debug)]
pub struct DatasetRef<'a> {
    pub csr: Csr<'a>,
    /// Row-major `num_nodes x feat_dim`.
    pub features: FeatureView<'a>,
    pub feat_dim: usize,
    pub num_classes: usize,
    pub labels: &'a [i64],
    /// Train, val, test node ids.
    pub splits: [&'a [i64]; 3],
}

impl<'a> From<&'a Dataset> for DatasetRef<'a> {
    fn from(ds: &'a Dataset) -> Self {
        DatasetRef {
            csr: ds.csr(),
            features: ds.features(),
            feat_dim: ds.meta().feat_dim,
            num_classes: ds.meta().num_classes,
            labels: ds.labels(),
            splits: Split::ALL.map(|s| ds.split(s)),
        }
    }
}

impl<'a> From<&'a OwnedDataset> for DatasetRef<'a> {
    fn from(ds: &'a OwnedDataset) -> Self {
        DatasetRef {
            csr: ds.csr(),
            features: ds.features.view(),
            feat_dim: ds.meta.feat_dim,
            num_classes: ds.meta.num_classes,
            labels: &ds.labels,
            splits: Split::ALL.map(|s| ds.split(s)),
        }
    }
}

/// What one worker needs to train its part. Everything is in local ids except `owned` and `halo`, which
/// list global ids.
///
/// Local ids: owned row `i` is global node `owned[i]`; source `n_owned + j` is halo node `halo[j]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Part {
    pub part: usize,
    pub k: usize,
    /// Global ids of owned nodes, ascending.
    pub owned: Vec<u32>,
    /// Global ids of halo nodes (in-neighbours of owned nodes that other parts own), grouped by owner part
    /// ascending, ascending within a group.
    pub halo: Vec<u32>,
    /// Local in-neighbour CSR over the owned destination rows: `owned.len() + 1` entries.
    pub indptr: Vec<i64>,
    /// Local source ids (owned `0..n_owned`, halo `n_owned..`), each row strictly ascending.
    pub indices: Vec<i32>,
    /// Global in-degree (row length in the full CSR) of every local source, owned then halo. GCN's
    /// normalisation needs the source's degree, which for a halo node is not visible locally.
    pub src_in_degree: Vec<u32>,
    /// Per peer part, ascending: the range of `halo` (0-based halo index) that peer sends us.
    pub recv: Vec<(u32, Range<usize>)>,
    /// Per peer part, ascending: local owned row ids whose rows that peer needs, in the order of that
    /// peer's `halo` group for us.
    pub send: Vec<(u32, Vec<u32>)>,
    /// Labels of owned rows (-1 = unlabelled).
    pub labels: Vec<i64>,
    /// Split membership as local row ids, ascending.
    pub train: Vec<u32>,
    pub val: Vec<u32>,
    pub test: Vec<u32>,
    /// Owned rows only, row-major `n_owned x feat_dim`, in the dataset's dtype.
    pub features: Features,
    pub feat_dim: usize,
    pub num_classes: usize,
    pub num_nodes_global: usize,
    /// Size of the global training split (the loss is a mean over all of it, across workers).
    pub num_train_global: usize,
}

/// Cuts a dataset along `p` into one [`Part`] per part, in part order.
///
/// Expects a valid dataset (as [`Dataset::open`] or [`OwnedDataset::validate`] guarantee); checks that
/// the partitioning and the arrays fit together.
pub fn build_parts<'a>(
    ds: impl Into<DatasetRef<'a>>,
    p: &Partitioning,
) -> Result<Vec<Part>, Error> {
    let ds = ds.into();
    let csr = ds.csr;
    let n = csr.num_nodes();
    let k = p.k;
    check_assignment(n, k, &p.parts)?;
    let mismatch = |what: &str, got: usize, want: usize| {
        Error::partition(format!(
            "the dataset's {what} has {got} entries, expected {want}"
        ))
    };
    if ds.labels.len() != n {
        return Err(mismatch("labels", ds.labels.len(), n));
    }
    if ds.features.len() != n * ds.feat_dim {
        return Err(mismatch("features", ds.features.len(), n * ds.feat_dim));
    }
    for (s, ids) in Split::ALL.iter().zip(ds.splits) {
        if let Some(&v) = ids.iter().find(|&&v| v < 0 || v as usize >= n) {
            return Err(Error::partition(format!(
                "'{}' holds node {v}, outside 0..{n}",
                s.tensor_name()
            )));
        }
    }

    let mut owned_of: Vec<Vec<u32>> = vec![Vec::new(); k];
    let mut local_of = vec![0u32; n];
    for (v, &q) in p.parts.iter().enumerate() {
        let list = &mut owned_of[q as usize];
        local_of[v] = list.len() as u32;
        list.push(v as u32);
    }
    let parts = &p.parts;
    let local_of = &local_of;

    let mut built: Vec<Part> = owned_of
        .into_par_iter()
        .enumerate()
        .map(|(me, owned)| {
            let me32 = me as u32;
            let n_owned = owned.len();
            // (owner, global id) sorts into the halo order of the ordering contract.
            let mut halo_keys: Vec<(u32, u32)> = owned
                .iter()
                .flat_map(|&v| csr.neighbors(v as usize))
                .filter(|&&u| parts[u as usize] != me32)
                .map(|&u| (parts[u as usize], u as u32))
                .collect();
            halo_keys.sort_unstable();
            halo_keys.dedup();

            let mut indptr = Vec::with_capacity(n_owned + 1);
            indptr.push(0i64);
            let mut indices = Vec::new();
            for &v in &owned {
                let start = indices.len();
                for &u in csr.neighbors(v as usize) {
                    let owner = parts[u as usize];
                    let local = if owner == me32 {
                        local_of[u as usize] as usize
                    } else {
                        let j = halo_keys
                            .binary_search(&(owner, u as u32))
                            .expect("every foreign in-neighbour was collected into the halo");
                        n_owned + j
                    };
                    indices.push(local as i32);
                }
                indices[start..].sort_unstable();
                indptr.push(indices.len() as i64);
            }

            let recv = recv_ranges(&halo_keys);
            let halo: Vec<u32> = halo_keys.iter().map(|&(_, u)| u).collect();
            let src_in_degree: Vec<u32> = owned
                .iter()
                .chain(&halo)
                .map(|&u| csr.degree(u as usize) as u32)
                .collect();
            let labels: Vec<i64> = owned.iter().map(|&v| ds.labels[v as usize]).collect();
            let [train, val, test] = ds.splits.map(|ids| {
                let mut local: Vec<u32> = ids
                    .iter()
                    .filter(|&&v| parts[v as usize] == me32)
                    .map(|&v| local_of[v as usize])
                    .collect();
                local.sort_unstable();
                local
            });
            let features = gather_rows(ds.features, &owned, ds.feat_dim);
            Part {
                part: me,
                k,
                owned,
                halo,
                indptr,
                indices,
                src_in_degree,
                recv,
                send: Vec::new(),
                labels,
                train,
                val,
                test,
                features,
                feat_dim: ds.feat_dim,
                num_classes: ds.num_classes,
                num_nodes_global: n,
                num_train_global: ds.splits[0].len(),
            }
        })
        .collect();

    // What b receives from a, a sends to b. Receivers visited in ascending order make each sender's list
    // ascending by peer.
    let mut sends: Vec<Vec<(u32, Vec<u32>)>> = vec![Vec::new(); k];
    for b in &built {
        for (a, range) in &b.recv {
            let rows = b.halo[range.clone()]
                .iter()
                .map(|&g| local_of[g as usize])
                .collect();
            sends[*a as usize].push((b.part as u32, rows));
        }
    }
    for (part, send) in built.iter_mut().zip(sends) {
        part.send = send;
    }
    Ok(built)
}

fn gather_rows(features: FeatureView<'_>, rows: &[u32], dim: usize) -> Features {
    fn gather<T: Copy>(src: &[T], rows: &[u32], dim: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(rows.len() * dim);
        for &r in rows {
            let r = r as usize;
            out.extend_from_slice(&src[r * dim..(r + 1) * dim]);
        }
        out
    }
    match features {
        FeatureView::F32(v) => Features::F32(gather(v, rows, dim)),
        FeatureView::F16(v) => Features::F16(gather(v, rows, dim)),
        FeatureView::BF16(v) => Features::BF16(gather(v, rows, dim)),
    }
}

/// Checks that a stored part (read from `part_path`) was cut from `ds`, the dataset a worker opened beside
/// it: the node count, feature width and class count agree, every owned and halo id is a node of `ds`, and
/// every owned row's label is the dataset's. With `partitioning` (read from `partitioning_path`, as a
/// data-parallel worker gets it), its assignment must cover every node of `ds` and give every owned node to
/// this part. Errors name the artifact, the tensor and the first bad row, so a part left over from another
/// dataset (or another partitioning) is refused before training instead of indexing out of bounds.
pub fn check_part_matches_dataset(
    part: &Part,
    part_path: &Path,
    partitioning: Option<(&Partitioning, &Path)>,
    ds: &Dataset,
) -> Result<(), Error> {
    let meta = ds.meta();
    let n = meta.num_nodes;
    let bad = |tensor: &str, problem: String| {
        Error::tensor(
            part_path,
            tensor,
            format!(
                "{problem}; the part does not match the dataset {}",
                ds.path().display()
            ),
        )
    };
    if part.num_nodes_global != n {
        return Err(bad(
            "owned",
            format!(
                "cut from a graph of {} nodes, the dataset has {n}",
                part.num_nodes_global
            ),
        ));
    }
    if part.feat_dim != meta.feat_dim {
        return Err(bad(
            "features",
            format!(
                "rows of {} features, the dataset's have {}",
                part.feat_dim, meta.feat_dim
            ),
        ));
    }
    if part.num_classes != meta.num_classes {
        return Err(bad(
            "labels",
            format!(
                "{} classes, the dataset has {}",
                part.num_classes, meta.num_classes
            ),
        ));
    }
    for (tensor, ids) in [("owned", &part.owned), ("halo", &part.halo)] {
        if let Some((i, v)) = ids.iter().enumerate().find(|(_, v)| **v as usize >= n) {
            return Err(bad(tensor, format!("row {i}: node {v} is outside 0..{n}")));
        }
    }
    let labels = ds.labels();
    if let Some((i, (&v, &l))) = part
        .owned
        .iter()
        .zip(&part.labels)
        .enumerate()
        .find(|(_, (v, l))| labels[**v as usize] != **l)
    {
        return Err(bad(
            "labels",
            format!(
                "row {i} (node {v}) has label {l}, the dataset says {}",
                labels[v as usize]
            ),
        ));
    }
    if let Some((p, path)) = partitioning {
        if p.parts.len() != n {
            return Err(Error::tensor(
                path,
                "parts",
                format!(
                    "assigns {} nodes, the dataset {} has {n}",
                    p.parts.len(),
                    ds.path().display()
                ),
            ));
        }
        if p.k != part.k {
            return Err(bad(
                "owned",
                format!(
                    "one of {} parts, the partitioning {} has {}",
                    part.k,
                    path.display(),
                    p.k
                ),
            ));
        }
        if let Some((i, v)) = part
            .owned
            .iter()
            .enumerate()
            .find(|(_, v)| p.parts[**v as usize] as usize != part.part)
        {
            return Err(bad(
                "owned",
                format!(
                    "row {i}: node {v} belongs to part {} in {}, this is part {}",
                    p.parts[*v as usize],
                    path.display(),
                    part.part
                ),
            ));
        }
    }
    Ok(())
}

impl Part {
    pub fn n_owned(&self) -> usize {
        self.owned.len()
    }

    pub fn n_halo(&self) -> usize {
        self.halo.len()
    }

    /// Local sources: owned then halo.
    pub fn n_sources(&self) -> usize {
        self.owned.len() + self.halo.len()
    }

    /// Checks every invariant a worker indexes with: shapes, id ranges, orderings, the recv ranges tiling
    /// `halo`. What only the whole partitioning can tell (that `halo[j]` really is owned by the recv peer,
    /// that peers' send and recv lists match) is checked by the tests, not here.
    pub fn validate(&self) -> Result<(), Error> {
        self.validate_at(Path::new("<in-memory part>"))
    }

    fn validate_at(&self, origin: &Path) -> Result<(), Error> {
        let bad = |tensor: &str, problem: String| Err(Error::tensor(origin, tensor, problem));
        let (k, me, n) = (self.k, self.part, self.num_nodes_global);
        if me >= k {
            return Err(Error::metadata(
                origin,
                format!("part {me} is outside 0..k = 0..{k}"),
            ));
        }
        let n_owned = self.owned.len();
        let n_src = self.n_sources();
        if n_src > i32::MAX as usize {
            return bad(
                "halo",
                format!("{n_src} local sources exceed i32 local ids"),
            );
        }
        if let Some(problem) = strictly_ascending_below(&self.owned, n as u64) {
            return bad("owned", problem);
        }
        // recv ranges tile halo in order; peers ascending, not us.
        let mut at = 0usize;
        let mut prev_peer: Option<u32> = None;
        for (i, (q, r)) in self.recv.iter().enumerate() {
            if *q as usize >= k || *q as usize == me || prev_peer.is_some_and(|p| p >= *q) {
                return bad(
                    "recv",
                    format!(
                        "entry {i}: peer {q} must be a part in 0..{k} other than {me}, after the previous peer"
                    ),
                );
            }
            if r.start != at || r.end <= r.start || r.end > self.halo.len() {
                return bad(
                    "recv",
                    format!(
                        "entry {i}: range {}..{} does not continue the tiling of 'halo' ({} entries) at {at}",
                        r.start,
                        r.end,
                        self.halo.len()
                    ),
                );
            }
            if let Some(problem) = strictly_ascending_below(&self.halo[r.clone()], n as u64) {
                return bad("halo", format!("group from part {q}: {problem}"));
            }
            prev_peer = Some(*q);
            at = r.end;
        }
        if at != self.halo.len() {
            return bad(
                "recv",
                format!(
                    "ranges cover {at} halo entries, but 'halo' has {}",
                    self.halo.len()
                ),
            );
        }
        let mut all_halo = self.halo.clone();
        all_halo.sort_unstable();
        if let Some(w) = all_halo.windows(2).find(|w| w[0] == w[1]) {
            return bad("halo", format!("node {} appears twice", w[0]));
        }
        if let Some(v) = self
            .halo
            .iter()
            .find(|v| self.owned.binary_search(v).is_ok())
        {
            return bad("halo", format!("node {v} is also owned"));
        }

        if self.indptr.len() != n_owned + 1 {
            return bad(
                "indptr",
                format!(
                    "has {} entries, expected n_owned + 1 = {}",
                    self.indptr.len(),
                    n_owned + 1
                ),
            );
        }
        if self.indptr[0] != 0
            || *self.indptr.last().expect("n_owned + 1 >= 1 entries") != self.indices.len() as i64
        {
            return bad(
                "indptr",
                format!(
                    "must run from 0 to the length of 'indices' ({}), runs from {} to {}",
                    self.indices.len(),
                    self.indptr[0],
                    self.indptr[n_owned]
                ),
            );
        }
        if let Some(i) = self.indptr.windows(2).position(|w| w[1] < w[0]) {
            return bad("indptr", format!("decreases at entry {}", i + 1));
        }
        if self.src_in_degree.len() != n_src {
            return bad(
                "src_in_degree",
                format!(
                    "has {} entries, expected n_owned + n_halo = {n_src}",
                    self.src_in_degree.len()
                ),
            );
        }
        for i in 0..n_owned {
            let row = &self.indices[self.indptr[i] as usize..self.indptr[i + 1] as usize];
            for (j, &u) in row.iter().enumerate() {
                if u < 0 || u as usize >= n_src {
                    return bad(
                        "indices",
                        format!("row {i}: source {u} is outside 0..{n_src}"),
                    );
                }
                if u as usize == i {
                    return bad("indices", format!("row {i} holds a self loop"));
                }
                if j > 0 && row[j - 1] >= u {
                    return bad("indices", format!("row {i} is not strictly ascending"));
                }
            }
            // Every in-neighbour of an owned node is local, so its global in-degree is its row length.
            if self.src_in_degree[i] as usize != row.len() {
                return bad(
                    "src_in_degree",
                    format!(
                        "owned row {i} has {} in-neighbours, but its entry says {}",
                        row.len(),
                        self.src_in_degree[i]
                    ),
                );
            }
        }

        let mut prev_peer: Option<u32> = None;
        for (i, (q, rows)) in self.send.iter().enumerate() {
            if *q as usize >= k || *q as usize == me || prev_peer.is_some_and(|p| p >= *q) {
                return bad(
                    "send_peers",
                    format!(
                        "entry {i}: peer {q} must be a part in 0..{k} other than {me}, after the previous peer"
                    ),
                );
            }
            if let Some(problem) = strictly_ascending_below(rows, n_owned as u64) {
                return bad("send_rows", format!("rows for part {q}: {problem}"));
            }
            prev_peer = Some(*q);
        }

        if self.labels.len() != n_owned {
            return bad(
                "labels",
                format!(
                    "has {} entries, expected n_owned = {n_owned}",
                    self.labels.len()
                ),
            );
        }
        let c = self.num_classes as i64;
        if let Some((i, l)) = self
            .labels
            .iter()
            .enumerate()
            .find(|&(_, &l)| l < -1 || l >= c)
        {
            return bad("labels", format!("entry {i} = {l} is outside -1..{c}"));
        }
        let mut in_split = vec![false; n_owned];
        for (name, ids) in [
            ("train", &self.train),
            ("val", &self.val),
            ("test", &self.test),
        ] {
            if let Some(problem) = strictly_ascending_below(ids, n_owned as u64) {
                return bad(name, problem);
            }
            for &i in ids.iter() {
                if std::mem::replace(&mut in_split[i as usize], true) {
                    return bad(name, format!("row {i} is in more than one split"));
                }
                if self.labels[i as usize] < 0 {
                    return bad(name, format!("row {i} is unlabelled"));
                }
            }
        }
        if self.train.len() > self.num_train_global {
            return Err(Error::metadata(
                origin,
                format!(
                    "{} local training rows exceed num_train_global = {}",
                    self.train.len(),
                    self.num_train_global
                ),
            ));
        }
        let want = n_owned * self.feat_dim;
        if self.features.len() != want {
            return bad(
                "features",
                format!(
                    "has {} values, expected n_owned x feat_dim = {want}",
                    self.features.len()
                ),
            );
        }
        Ok(())
    }

    /// Validates and writes the part as one safetensors file, atomically (temporary file + rename).
    pub fn write(&self, path: &Path) -> Result<(), Error> {
        self.write_fingerprinted(path).map(|_| ())
    }

    /// [`Part::write`], returning the fingerprint (hash of the tensor checksums) the partition file
    /// records to tell its own part files from strays.
    pub(crate) fn write_fingerprinted(&self, path: &Path) -> Result<String, Error> {
        self.validate_at(path)?;
        let recv_flat: Vec<u64> = self
            .recv
            .iter()
            .flat_map(|(q, r)| [*q as u64, r.start as u64, r.end as u64])
            .collect();
        let send_peers: Vec<u32> = self.send.iter().map(|(q, _)| *q).collect();
        let mut send_indptr = vec![0u64];
        let mut send_rows = Vec::new();
        for (_, rows) in &self.send {
            send_rows.extend_from_slice(rows);
            send_indptr.push(send_rows.len() as u64);
        }
        let feats = self.features.view();
        let tensors: Vec<(&str, Dtype, Vec<usize>, &[u8])> = vec![
            (
                "owned",
                Dtype::U32,
                vec![self.owned.len()],
                bytemuck::cast_slice(&self.owned),
            ),
            (
                "halo",
                Dtype::U32,
                vec![self.halo.len()],
                bytemuck::cast_slice(&self.halo),
            ),
            (
                "indptr",
                Dtype::I64,
                vec![self.indptr.len()],
                bytemuck::cast_slice(&self.indptr),
            ),
            (
                "indices",
                Dtype::I32,
                vec![self.indices.len()],
                bytemuck::cast_slice(&self.indices),
            ),
            (
                "src_in_degree",
                Dtype::U32,
                vec![self.src_in_degree.len()],
                bytemuck::cast_slice(&self.src_in_degree),
            ),
            (
                "recv",
                Dtype::U64,
                vec![self.recv.len(), 3],
                bytemuck::cast_slice(&recv_flat),
            ),
            (
                "send_peers",
                Dtype::U32,
                vec![send_peers.len()],
                bytemuck::cast_slice(&send_peers),
            ),
            (
                "send_indptr",
                Dtype::U64,
                vec![send_indptr.len()],
                bytemuck::cast_slice(&send_indptr),
            ),
            (
                "send_rows",
                Dtype::U32,
                vec![send_rows.len()],
                bytemuck::cast_slice(&send_rows),
            ),
            (
                "labels",
                Dtype::I64,
                vec![self.labels.len()],
                bytemuck::cast_slice(&self.labels),
            ),
            (
                "train",
                Dtype::U32,
                vec![self.train.len()],
                bytemuck::cast_slice(&self.train),
            ),
            (
                "val",
                Dtype::U32,
                vec![self.val.len()],
                bytemuck::cast_slice(&self.val),
            ),
            (
                "test",
                Dtype::U32,
                vec![self.test.len()],
                bytemuck::cast_slice(&self.test),
            ),
            (
                "features",
                feats.dtype().safetensors_dtype(),
                vec![self.owned.len(), self.feat_dim],
                feats.as_bytes(),
            ),
        ];
        let checksums: BTreeMap<String, String> = tensors
            .iter()
            .map(|(name, _, _, bytes)| (name.to_string(), checksum(bytes)))
            .collect();
        let fingerprint = fingerprint(&checksums);
        let meta = PartFileMeta {
            format_version: PARTITION_FORMAT_VERSION,
            kind: KIND_PART.into(),
            part: self.part,
            k: self.k,
            n_owned: self.owned.len(),
            n_halo: self.halo.len(),
            feat_dim: self.feat_dim,
            num_classes: self.num_classes,
            num_nodes_global: self.num_nodes_global,
            num_train_global: self.num_train_global,
            feature_dtype: feats.dtype(),
            checksums,
        };
        let json =
            serde_json::to_string(&meta).expect("PartFileMeta serialises: plain fields only");
        write_safetensors(path, &json, tensors)?;
        Ok(fingerprint)
    }

    /// Reads a part file written by [`Part::write`]: verifies every tensor's checksum and validates the
    /// contents ([`Part::validate`]); errors name the file and the tensor.
    pub fn load(path: &Path) -> Result<Part, Error> {
        let f = StFile::open(path)?;
        let meta: PartFileMeta = f.physalia_json(KIND_PART)?;
        let sums = &meta.checksums;
        let n_owned = meta.n_owned;
        let owned: Vec<u32> = f.tensor("owned", Dtype::U32, &[Some(n_owned)], sums)?;
        let halo: Vec<u32> = f.tensor("halo", Dtype::U32, &[Some(meta.n_halo)], sums)?;
        let indptr: Vec<i64> = f.tensor("indptr", Dtype::I64, &[Some(n_owned + 1)], sums)?;
        let indices: Vec<i32> = f.tensor("indices", Dtype::I32, &[None], sums)?;
        let src_in_degree: Vec<u32> = f.tensor(
            "src_in_degree",
            Dtype::U32,
            &[Some(n_owned + meta.n_halo)],
            sums,
        )?;
        let recv_flat: Vec<u64> = f.tensor("recv", Dtype::U64, &[None, Some(3)], sums)?;
        let send_peers: Vec<u32> = f.tensor("send_peers", Dtype::U32, &[None], sums)?;
        let send_indptr: Vec<u64> = f.tensor(
            "send_indptr",
            Dtype::U64,
            &[Some(send_peers.len() + 1)],
            sums,
        )?;
        let send_rows: Vec<u32> = f.tensor("send_rows", Dtype::U32, &[None], sums)?;
        let labels: Vec<i64> = f.tensor("labels", Dtype::I64, &[Some(n_owned)], sums)?;
        let train: Vec<u32> = f.tensor("train", Dtype::U32, &[None], sums)?;
        let val: Vec<u32> = f.tensor("val", Dtype::U32, &[None], sums)?;
        let test: Vec<u32> = f.tensor("test", Dtype::U32, &[None], sums)?;
        let fshape = [Some(n_owned), Some(meta.feat_dim)];
        let features = match meta.feature_dtype {
            FeatureDtype::F32 => {
                Features::F32(f.tensor::<f32>("features", Dtype::F32, &fshape, sums)?)
            }
            FeatureDtype::F16 => {
                Features::F16(f.tensor::<f16>("features", Dtype::F16, &fshape, sums)?)
            }
            FeatureDtype::BF16 => {
                Features::BF16(f.tensor::<bf16>("features", Dtype::BF16, &fshape, sums)?)
            }
        };

        let bad = |tensor: &str, problem: String| Error::tensor(path, tensor, problem);
        let as_usize = |x: u64, tensor: &str| {
            usize::try_from(x).map_err(|_| bad(tensor, format!("value {x} does not fit usize")))
        };
        let mut recv = Vec::with_capacity(recv_flat.len() / 3);
        for c in recv_flat.chunks_exact(3) {
            let peer = u32::try_from(c[0])
                .map_err(|_| bad("recv", format!("peer {} is not a part id", c[0])))?;
            recv.push((peer, as_usize(c[1], "recv")?..as_usize(c[2], "recv")?));
        }
        if send_indptr[0] != 0
            || send_indptr.windows(2).any(|w| w[1] < w[0])
            || send_indptr[send_peers.len()] != send_rows.len() as u64
        {
            return Err(bad(
                "send_indptr",
                format!(
                    "must rise from 0 to the length of 'send_rows' ({})",
                    send_rows.len()
                ),
            ));
        }
        let send = send_peers
            .iter()
            .enumerate()
            .map(|(i, &q)| {
                let r = send_indptr[i] as usize..send_indptr[i + 1] as usize;
                (q, send_rows[r].to_vec())
            })
            .collect();
        let part = Part {
            part: meta.part,
            k: meta.k,
            owned,
            halo,
            indptr,
            indices,
            src_in_degree,
            recv,
            send,
            labels,
            train,
            val,
            test,
            features,
            feat_dim: meta.feat_dim,
            num_classes: meta.num_classes,
            num_nodes_global: meta.num_nodes_global,
            num_train_global: meta.num_train_global,
        };
        part.validate_at(path)?;
        Ok(part)
    }
}

/// `None` when `ids` is strictly ascending and below `bound`, else the problem.
fn strictly_ascending_below(ids: &[u32], bound: u64) -> Option<String> {
    for (i, &v) in ids.iter().enumerate() {
        if v as u64 >= bound {
            return Some(format!("entry {i} = {v} is outside 0..{bound}"));
        }
        if i > 0 && ids[i - 1] >= v {
            return Some(format!(
                "entry {i} = {v} after {}: not strictly ascending",
                ids[i - 1]
            ));
        }
    }
    None
}

/// The `physalia` metadata JSON of a part file.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct PartFileMeta {
    format_version: u32,
    kind: String,
    part: usize,
    k: usize,
    n_owned: usize,
    n_halo: usize,
    feat_dim: usize,
    num_classes: usize,
    num_nodes_global: usize,
    num_train_global: usize,
    feature_dtype: FeatureDtype,
    /// Tensor name -> xxh3-64 of its bytes.
    checksums: BTreeMap<String, String>,
}

fn fingerprint(checksums: &BTreeMap<String, String>) -> String {
    checksum(
        serde_json::to_string(checksums)
            .expect("a string map serialises")
            .as_bytes(),
    )
}

// ---------------------------------------------------------------------------------------------------
// Stored partition sets
// ---------------------------------------------------------------------------------------------------

/// The metadata of a stored partition set (`partition.safetensors`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PartitionMeta {
    pub format_version: u32,
    /// Always `"partitioning"`.
    pub kind: String,
    pub k: usize,
    pub seed: u64,
    pub method: String,
    pub edge_cut: usize,
    /// Undirected edges of the graph, the denominator of the cut fraction.
    pub num_undirected_edges: usize,
    pub balance: f64,
    pub num_nodes: usize,
    pub parts: Vec<PartSummary>,
    /// The dataset's tensor checksums when this set was computed; a different map means the dataset
    /// changed and the set is stale.
    pub dataset_checksums: BTreeMap<String, String>,
    /// Wall time of the computation (partitioning, building, writing).
    pub compute_seconds: f64,
    /// Wall time of the node -> part assignment alone (METIS, or the streaming and refinement passes),
    /// the part of `compute_seconds` that depends on the method. Absent in sets written before it was
    /// recorded.
    #[serde(default)]
    pub partition_seconds: Option<f64>,
    /// Bytes of a chunked dataset's files read to compute the set, by every process together (the
    /// coordinator's streaming passes and the workers' cut); absent for a dataset file, which is
    /// read whole, and in sets written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_read: Option<u64>,
    /// Checksum of the `parts` tensor.
    pub checksums: BTreeMap<String, String>,
}

impl PartitionMeta {
    /// The cut as a fraction of all undirected edges (0 for an edgeless graph).
    pub fn cut_fraction(&self) -> f64 {
        if self.num_undirected_edges == 0 {
            0.0
        } else {
            self.edge_cut as f64 / self.num_undirected_edges as f64
        }
    }
}

/// One part of a stored set, as the partition file records it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PartSummary {
    pub part: usize,
    pub n_owned: usize,
    pub n_halo: usize,
    /// Entries of the local CSR (in-edges of owned rows).
    pub n_local_edges: usize,
    /// Hash of the part file's tensor checksums.
    pub fingerprint: String,
}

/// A stored partition set that is current for the dataset.
#[derive(Clone, Debug)]
pub struct PartitionSet {
    /// `X.parts/k<K>-seed<S>`.
    pub dir: PathBuf,
    pub meta: PartitionMeta,
    /// `part<P>.safetensors` for `P` in `0..k`.
    pub part_files: Vec<PathBuf>,
    /// Whether it was already there (`false`: computed by this call).
    pub reused: bool,
    /// Time this call spent on it (checking, or computing and writing).
    pub seconds: f64,
}

impl PartitionSet {
    /// The node -> part assignment, read back from `partition.safetensors`.
    pub fn partitioning(&self) -> Result<Partitioning, Error> {
        load_partitioning(&self.dir.join(PARTITION_FILE)).map(|(_, p)| p)
    }
}

/// Whether a stored set can be used.
#[derive(Clone, Debug, PartialEq)]
pub enum ArtifactStatus {
    Current,
    /// The dataset changed since the set was computed.
    Stale,
    /// Missing or unreadable files, or files from different runs; the reason.
    Invalid(String),
}

impl std::fmt::Display for ArtifactStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ArtifactStatus::Current => f.write_str("current"),
            ArtifactStatus::Stale => f.write_str("stale: the dataset changed since"),
            ArtifactStatus::Invalid(why) => write!(f, "invalid: {why}"),
        }
    }
}

/// A stored set, as [`list_partitions`] finds it.
#[derive(Clone, Debug)]
pub struct PartitionSummary {
    pub dir: PathBuf,
    /// From the folder name.
    pub k: usize,
    pub seed: u64,
    pub status: ArtifactStatus,
    /// `None` when the partition file could not be read.
    pub meta: Option<PartitionMeta>,
}

/// `X.parts` for the dataset file `X.safetensors` (`X.ext.parts` for any other name); `X/parts` inside
/// a chunked dataset directory `X`, so that the directory `X` and a file `X.safetensors` of the same
/// graph (or another) never share a folder of sets.
pub fn partitions_dir(dataset_path: &Path) -> PathBuf {
    if crate::chunked::is_chunked(dataset_path) {
        return dataset_path.join("parts");
    }
    let name = dataset_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name.strip_suffix(".safetensors").unwrap_or(&name);
    dataset_path.with_file_name(format!("{stem}.parts"))
}

/// `X.parts/k<K>-seed<S>`.
pub fn partition_set_dir(dataset_path: &Path, k: usize, seed: u64) -> PathBuf {
    partitions_dir(dataset_path).join(format!("k{k}-seed{seed}"))
}

/// How a partition set's assignment is computed.
#[derive(Clone, Debug, PartialEq)]
pub enum PartitionMethod {
    /// [`partition_metis`]: the whole graph in memory, the best cut.
    Metis,
    /// [`crate::stream::partition_stream`] (a chunked dataset: [`crate::stream::partition_stream_rows`],
    /// never loading it) with these parameters; `k` and `seed` come from the set.
    Stream(StreamParams),
}

impl PartitionMethod {
    /// Whether a stored set's `method` field is what this method writes.
    fn matches(&self, stored: &str) -> bool {
        match self {
            PartitionMethod::Metis => stored == "metis" || stored == "single",
            PartitionMethod::Stream(p) => stored == p.method(),
        }
    }
}

/// Makes sure a current partition set exists beside the dataset for every `k` in `ks`, computing what is
/// missing, stale (the dataset's checksums changed) or damaged, and reusing the rest. Returns the sets in
/// the order of `ks` (repeats dropped). The same as [`ensure_partitions_with`] with no method.
///
/// Reuse costs reading a few headers; the dataset itself is opened (and its checksums verified) only if
/// something must be computed. Part files are written first and `partition.safetensors` last, each
/// atomically, so an interrupted run leaves a set that the next call recognises as incomplete.
pub fn ensure_partitions(
    dataset_path: &Path,
    ks: &[usize],
    seed: u64,
) -> Result<Vec<PartitionSet>, Error> {
    ensure_partitions_with(dataset_path, ks, seed, None)
}

/// [`ensure_partitions`] for a dataset file or a chunked dataset directory ([`crate::chunked`]), with a
/// choice of method. `None` reuses any current set, and computes a missing one with METIS for a file and
/// by streaming ([`StreamParams::refined`]: restreamed Fennel, then label-propagation refinement) for a
/// chunked dataset, which is never loaded whole. `Some(method)` also recomputes a set that another
/// method made. METIS on a chunked dataset is an error.
pub fn ensure_partitions_with(
    dataset_path: &Path,
    ks: &[usize],
    seed: u64,
    method: Option<&PartitionMethod>,
) -> Result<Vec<PartitionSet>, Error> {
    ensure_sets(dataset_path, ks, seed, method, method.is_none())
}

/// [`ensure_partitions`] that computes a missing, stale or damaged set with `method` and reuses any
/// current set whichever method made it (a job's choice of partitioner applies to what it must compute;
/// a set already beside the dataset, METIS's or streamed, is as good to train on).
pub fn ensure_partitions_reusing(
    dataset_path: &Path,
    ks: &[usize],
    seed: u64,
    method: &PartitionMethod,
) -> Result<Vec<PartitionSet>, Error> {
    ensure_sets(dataset_path, ks, seed, Some(method), true)
}

/// The set of `k` parts for `seed` stored beside the dataset if it is current, whichever method made
/// it (headers only: nothing is computed).
pub fn current_set(
    dataset_path: &Path,
    k: usize,
    seed: u64,
) -> Result<Option<PartitionSet>, Error> {
    let (_, dataset_checksums) = dataset_identity(dataset_path)?;
    Ok(stored_set(dataset_path, k, seed, &dataset_checksums))
}

/// The set of `k` parts for `seed` beside the dataset whose checksums are `dataset_checksums`, if it is
/// current.
fn stored_set(
    dataset_path: &Path,
    k: usize,
    seed: u64,
    dataset_checksums: &BTreeMap<String, String>,
) -> Option<PartitionSet> {
    let t0 = Instant::now();
    let dir = partition_set_dir(dataset_path, k, seed);
    match check_set(&dir, k, seed, dataset_checksums) {
        (Some(meta), ArtifactStatus::Current) => Some(PartitionSet {
            part_files: part_files(&dir, k),
            dir,
            meta,
            reused: true,
            seconds: t0.elapsed().as_secs_f64(),
        }),
        _ => None,
    }
}

fn ensure_sets(
    dataset_path: &Path,
    ks: &[usize],
    seed: u64,
    method: Option<&PartitionMethod>,
    reuse_any: bool,
) -> Result<Vec<PartitionSet>, Error> {
    let (num_nodes, dataset_checksums) = dataset_identity(dataset_path)?;
    let chunked = dataset_path.is_dir();
    if chunked && method == Some(&PartitionMethod::Metis) {
        return Err(Error::param(
            "method",
            format!(
                "METIS needs the whole graph in memory; {} is a chunked dataset, partitioned by \
                 streaming (method stream)",
                dataset_path.display()
            ),
        ));
    }
    for &k in ks {
        check_k(k, num_nodes).map_err(|e| match e {
            Error::Param { param, problem } => Error::Param {
                param,
                problem: format!("{problem} ({})", dataset_path.display()),
            },
            other => other,
        })?;
    }
    let mut ds: Option<Dataset> = None;
    let mut out: Vec<PartitionSet> = Vec::new();
    for &k in ks {
        if out.iter().any(|s| s.meta.k == k) {
            continue;
        }
        if let Some(set) = stored_set(dataset_path, k, seed, &dataset_checksums)
            && (reuse_any || method.is_none_or(|m| m.matches(&set.meta.method)))
        {
            out.push(set);
            continue;
        }
        let t0 = Instant::now();
        let dir = partition_set_dir(dataset_path, k, seed);
        let meta = if chunked {
            let params = match method {
                Some(PartitionMethod::Stream(p)) => p.clone(),
                _ => StreamParams::refined(k),
            };
            let cds = crate::chunked::ChunkedDataset::open(dataset_path)?;
            crate::chunked_partition::compute_set_chunked(&cds, &dir, k, seed, &params)?
        } else {
            if ds.is_none() {
                ds = Some(Dataset::open(dataset_path)?);
            }
            let ds = ds.as_ref().expect("opened just above");
            compute_set(ds, &dir, k, seed, method)?
        };
        out.push(PartitionSet {
            part_files: part_files(&dir, k),
            dir,
            meta,
            reused: false,
            seconds: t0.elapsed().as_secs_f64(),
        });
    }
    Ok(out)
}

/// The node count and the checksum map a partition set records of its dataset: the file's tensor
/// checksums, or for a chunked dataset `{"manifest": fingerprint}` (see
/// [`crate::chunked::Manifest::fingerprint`]). Reads a header or the manifest only.
pub fn dataset_identity(dataset_path: &Path) -> Result<(usize, BTreeMap<String, String>), Error> {
    // A directory is a chunked dataset or an error naming its missing manifest.
    if dataset_path.is_dir() {
        let m = crate::chunked::ChunkedDataset::open(dataset_path)?;
        let fp = m.manifest().fingerprint();
        return Ok((
            m.manifest().num_nodes,
            BTreeMap::from([("manifest".to_string(), fp)]),
        ));
    }
    let header: Metadata = read_physalia_json(dataset_path)?;
    Ok((header.num_nodes, header.checksums))
}

/// Every partition set stored beside the dataset (folders `X.parts/k<K>-seed<S>`), by k then seed, with
/// whether each is current. An absent `X.parts` gives an empty list.
pub fn list_partitions(dataset_path: &Path) -> Result<Vec<PartitionSummary>, Error> {
    let (_, dataset_checksums) = dataset_identity(dataset_path)?;
    let root = partitions_dir(dataset_path);
    let entries = match std::fs::read_dir(&root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(&root, e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(&root, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((k, seed)) = parse_set_name(&name) else {
            continue;
        };
        let dir = entry.path();
        let (meta, status) = check_set(&dir, k, seed, &dataset_checksums);
        out.push(PartitionSummary {
            dir,
            k,
            seed,
            status,
            meta,
        });
    }
    out.sort_by_key(|s| (s.k, s.seed));
    Ok(out)
}

/// Reads `partition.safetensors`: its metadata and the assignment, checksum verified and range checked.
pub fn load_partitioning(path: &Path) -> Result<(PartitionMeta, Partitioning), Error> {
    read_partitioning(path, true)
}

/// A pending set's assignment (`pending/partition.safetensors`, see
/// [`crate::chunked_partition::begin_set_chunked`]): a partitioning whose parts are not cut yet, so it
/// describes none.
pub fn load_assignment(path: &Path) -> Result<(PartitionMeta, Partitioning), Error> {
    read_partitioning(path, false)
}

fn read_partitioning(
    path: &Path,
    parts_described: bool,
) -> Result<(PartitionMeta, Partitioning), Error> {
    let f = StFile::open(path)?;
    let meta: PartitionMeta = f.physalia_json(KIND_PARTITIONING)?;
    let parts: Vec<u32> = f.tensor(
        "parts",
        Dtype::U32,
        &[Some(meta.num_nodes)],
        &meta.checksums,
    )?;
    let described = if parts_described { meta.k } else { 0 };
    if meta.k == 0 || meta.parts.len() != described {
        return Err(Error::metadata(
            path,
            format!(
                "k = {} but {} parts are described (expected {described})",
                meta.k,
                meta.parts.len()
            ),
        ));
    }
    if let Some((v, p)) = parts
        .iter()
        .enumerate()
        .find(|(_, p)| **p as usize >= meta.k)
    {
        return Err(Error::tensor(
            path,
            "parts",
            format!("node {v} is assigned to part {p}, outside 0..{}", meta.k),
        ));
    }
    let p = Partitioning {
        k: meta.k,
        parts,
        edge_cut: meta.edge_cut,
        balance: meta.balance,
        method: meta.method.clone(),
        seed: meta.seed,
    };
    Ok((meta, p))
}

fn parse_set_name(name: &str) -> Option<(usize, u64)> {
    let (k, seed) = name.strip_prefix('k')?.split_once("-seed")?;
    Some((k.parse().ok()?, seed.parse().ok()?))
}

pub(crate) fn part_files(dir: &Path, k: usize) -> Vec<PathBuf> {
    (0..k)
        .map(|p| dir.join(format!("part{p}.safetensors")))
        .collect()
}

/// Reads the headers of a stored set and says whether it is current for `dataset_checksums`.
fn check_set(
    dir: &Path,
    k: usize,
    seed: u64,
    dataset_checksums: &BTreeMap<String, String>,
) -> (Option<PartitionMeta>, ArtifactStatus) {
    let file = dir.join(PARTITION_FILE);
    if !file.is_file() {
        return (
            None,
            ArtifactStatus::Invalid(format!("{} is missing", file.display())),
        );
    }
    let meta: PartitionMeta = match read_physalia_json(&file).and_then(|m: PartitionMeta| {
        check_kind(&file, &m.kind, m.format_version, KIND_PARTITIONING).map(|()| m)
    }) {
        Ok(m) => m,
        Err(e) => return (None, ArtifactStatus::Invalid(e.to_string())),
    };
    let invalid = |why: String| ArtifactStatus::Invalid(why);
    if meta.k != k || meta.seed != seed || meta.parts.len() != k {
        let why = format!(
            "{}: describes k = {} seed = {} with {} parts, but the folder name says k = {k} seed = {seed}",
            file.display(),
            meta.k,
            meta.seed,
            meta.parts.len()
        );
        return (Some(meta), invalid(why));
    }
    if &meta.dataset_checksums != dataset_checksums {
        return (Some(meta), ArtifactStatus::Stale);
    }
    for (p, path) in part_files(dir, k).iter().enumerate() {
        let pm: PartFileMeta = match read_physalia_json(path).and_then(|m: PartFileMeta| {
            check_kind(path, &m.kind, m.format_version, KIND_PART).map(|()| m)
        }) {
            Ok(m) => m,
            Err(e) => return (Some(meta), invalid(e.to_string())),
        };
        if pm.part != p || pm.k != k || fingerprint(&pm.checksums) != meta.parts[p].fingerprint {
            let why = format!(
                "{}: is not the part {p} that {} describes (written by another run)",
                path.display(),
                file.display()
            );
            return (Some(meta), invalid(why));
        }
    }
    (Some(meta), ArtifactStatus::Current)
}

fn compute_set(
    ds: &Dataset,
    dir: &Path,
    k: usize,
    seed: u64,
    method: Option<&PartitionMethod>,
) -> Result<PartitionMeta, Error> {
    let t0 = Instant::now();
    let p = match method {
        None | Some(PartitionMethod::Metis) => partition_metis(ds.csr(), k, seed)?,
        Some(PartitionMethod::Stream(params)) => {
            let params = StreamParams {
                k,
                seed,
                ..params.clone()
            };
            partition_stream(ds.csr(), &params)?.partitioning
        }
    };
    let partition_seconds = t0.elapsed().as_secs_f64();
    let parts = build_parts(ds, &p)?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let files = part_files(dir, k);
    let mut summaries = Vec::with_capacity(k);
    for (part, path) in parts.iter().zip(&files) {
        summaries.push(write_part(part, path)?);
    }
    drop(parts);
    let (_, total) = cut_and_total(ds.csr(), &p.parts);
    let checksums = ds.meta().checksums.clone();
    write_partition_file(
        dir,
        &p,
        total,
        summaries,
        checksums,
        SetTiming {
            started: t0,
            partition_seconds,
            compute_seconds: None,
            bytes_read: None,
        },
    )
}

/// Writes one part file and returns its summary for the partition file.
/// The summary a set's commit marker keeps of part `part` of `k`, from its file's header alone (the
/// checksums its writer recorded; the tensors are not read).
/// The receive list of a part whose halo keys `(owner, id)` are sorted: per owner, the range of the
/// halo it sends.
pub(crate) fn recv_ranges(halo_keys: &[(u32, u32)]) -> Vec<(u32, Range<usize>)> {
    let mut recv: Vec<(u32, Range<usize>)> = Vec::new();
    for (j, &(owner, _)) in halo_keys.iter().enumerate() {
        match recv.last_mut() {
            Some((q, r)) if *q == owner => r.end = j + 1,
            _ => recv.push((owner, j..j + 1)),
        }
    }
    recv
}

pub(crate) fn part_summary(path: &Path, part: usize, k: usize) -> Result<PartSummary, Error> {
    let f = StFile::open(path)?;
    let meta: PartFileMeta = f.physalia_json(KIND_PART)?;
    if meta.part != part || meta.k != k {
        return Err(Error::metadata(
            path,
            format!(
                "is part {} of {}, expected part {part} of {k}",
                meta.part, meta.k
            ),
        ));
    }
    let n_local_edges = f
        .header
        .info("indices")
        .map(|i| i.shape.iter().product())
        .ok_or_else(|| Error::tensor(path, "indices", "is missing from the file"))?;
    Ok(PartSummary {
        part,
        n_owned: meta.n_owned,
        n_halo: meta.n_halo,
        n_local_edges,
        fingerprint: fingerprint(&meta.checksums),
    })
}

pub(crate) fn write_part(part: &Part, path: &Path) -> Result<PartSummary, Error> {
    let fingerprint = part.write_fingerprinted(path)?;
    Ok(PartSummary {
        part: part.part,
        n_owned: part.n_owned(),
        n_halo: part.n_halo(),
        n_local_edges: part.indices.len(),
        fingerprint,
    })
}

/// When a set's computation started, and how long its assignment took (for [`PartitionMeta`]).
pub(crate) struct SetTiming {
    pub(crate) started: Instant,
    pub(crate) partition_seconds: f64,
    /// The whole computation, where it ended before the commit (parts cut by workers, committed after
    /// they trained an epoch); else the time from `started` to the commit.
    pub(crate) compute_seconds: Option<f64>,
    /// Bytes of the dataset's files read to compute the set ([`PartitionMeta::bytes_read`]).
    pub(crate) bytes_read: Option<u64>,
}

/// Writes `partition.safetensors`, the commit marker of a set whose part files are already written.
pub(crate) fn write_partition_file(
    dir: &Path,
    p: &Partitioning,
    num_undirected_edges: usize,
    summaries: Vec<PartSummary>,
    dataset_checksums: BTreeMap<String, String>,
    timing: SetTiming,
) -> Result<PartitionMeta, Error> {
    let parts_bytes: &[u8] = bytemuck::cast_slice(&p.parts);
    let mut meta = PartitionMeta {
        format_version: PARTITION_FORMAT_VERSION,
        kind: KIND_PARTITIONING.into(),
        k: p.k,
        seed: p.seed,
        method: p.method.clone(),
        edge_cut: p.edge_cut,
        num_undirected_edges,
        balance: p.balance,
        num_nodes: p.parts.len(),
        parts: summaries,
        dataset_checksums,
        compute_seconds: 0.0,
        partition_seconds: Some(timing.partition_seconds),
        bytes_read: timing.bytes_read,
        checksums: BTreeMap::from([("parts".to_string(), checksum(parts_bytes))]),
    };
    meta.compute_seconds = timing
        .compute_seconds
        .unwrap_or_else(|| timing.started.elapsed().as_secs_f64());
    let json = serde_json::to_string(&meta).expect("PartitionMeta serialises: plain fields only");
    write_safetensors(
        &dir.join(PARTITION_FILE),
        &json,
        vec![("parts", Dtype::U32, vec![p.parts.len()], parts_bytes)],
    )?;
    Ok(meta)
}

fn check_kind(path: &Path, kind: &str, version: u32, want: &str) -> Result<(), Error> {
    if kind != want {
        return Err(Error::metadata(
            path,
            format!("holds a '{kind}', expected a '{want}' file"),
        ));
    }
    if version != PARTITION_FORMAT_VERSION {
        return Err(Error::metadata(
            path,
            format!(
                "format_version {version} is not supported (this build reads version {PARTITION_FORMAT_VERSION})"
            ),
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------
// Reading safetensors files
// ---------------------------------------------------------------------------------------------------

/// Largest header we read; the safetensors crate's own limit.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Reads only the header of a safetensors file and parses its `physalia` metadata JSON as `T`: enough to
/// decide reuse without touching tensor data.
fn read_physalia_json<T: DeserializeOwned>(path: &Path) -> Result<T, Error> {
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let not_st = |reason: String| Error::NotSafetensors {
        path: path.to_path_buf(),
        reason,
    };
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|_| not_st("shorter than the 8-byte header length field".into()))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER_BYTES {
        return Err(not_st(format!("header length field says {len} bytes")));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header)
        .map_err(|_| not_st(format!("file truncated inside its {len}-byte header")))?;
    let value: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| not_st(format!("header is not JSON: {e}")))?;
    let Some(json) = value
        .get("__metadata__")
        .and_then(|m| m.get(METADATA_KEY))
        .and_then(|j| j.as_str())
    else {
        return Err(Error::metadata(
            path,
            format!("no '{METADATA_KEY}' entry in the safetensors __metadata__"),
        ));
    };
    serde_json::from_str(json).map_err(|e| Error::metadata(path, format!("invalid: {e}")))
}

/// A mapped safetensors file whose tensors are copied out on request, checksum verified.
struct StFile {
    path: PathBuf,
    mmap: Mmap,
    data_start: usize,
    header: safetensors::tensor::Metadata,
}

impl StFile {
    fn open(path: &Path) -> Result<StFile, Error> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let not_st = |reason: String| Error::NotSafetensors {
            path: path.to_path_buf(),
            reason,
        };
        if len < 8 {
            return Err(not_st(format!(
                "file truncated: {len} bytes, shorter than the 8-byte header length field"
            )));
        }
        // SAFETY: read-only mapping of a file this crate only ever replaces by rename (see format.rs).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let (n, header) = SafeTensors::read_metadata(&mmap).map_err(|e| not_st(e.to_string()))?;
        Ok(StFile {
            path: path.to_path_buf(),
            mmap,
            data_start: 8 + n,
            header,
        })
    }

    /// The `physalia` metadata JSON as `T`, checked to be of `kind` and this build's version.
    fn physalia_json<T: DeserializeOwned>(&self, kind: &str) -> Result<T, Error> {
        let Some(json) = self
            .header
            .metadata()
            .as_ref()
            .and_then(|m| m.get(METADATA_KEY))
        else {
            return Err(Error::metadata(
                &self.path,
                format!("no '{METADATA_KEY}' entry in the safetensors __metadata__"),
            ));
        };
        let value: serde_json::Value = serde_json::from_str(json)
            .map_err(|e| Error::metadata(&self.path, format!("invalid JSON: {e}")))?;
        let got_kind = value
            .get("kind")
            .and_then(|k| k.as_str())
            .unwrap_or("dataset");
        let version = value
            .get("format_version")
            .and_then(|v| v.as_u64())
            .unwrap_or(0);
        check_kind(&self.path, got_kind, version as u32, kind)?;
        serde_json::from_value(value)
            .map_err(|e| Error::metadata(&self.path, format!("invalid: {e}")))
    }

    /// Tensor `name` copied out as `T`, after checking dtype, shape (`None` = any length) and checksum.
    fn tensor<T: bytemuck::Pod>(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[Option<usize>],
        checksums: &BTreeMap<String, String>,
    ) -> Result<Vec<T>, Error> {
        let path = &self.path;
        let info = self
            .header
            .info(name)
            .ok_or_else(|| Error::tensor(path, name, "is missing from the file"))?;
        if info.dtype != dtype {
            return Err(Error::tensor(
                path,
                name,
                format!("has dtype {:?}, expected {dtype:?}", info.dtype),
            ));
        }
        let shape_ok = info.shape.len() == shape.len()
            && info
                .shape
                .iter()
                .zip(shape)
                .all(|(&got, want)| want.is_none_or(|w| w == got));
        if !shape_ok {
            let want: Vec<String> = shape
                .iter()
                .map(|d| d.map_or("_".to_string(), |d| d.to_string()))
                .collect();
            return Err(Error::tensor(
                path,
                name,
                format!(
                    "has shape {:?}, expected [{}] (from the metadata)",
                    info.shape,
                    want.join(", ")
                ),
            ));
        }
        let (a, b) = info.data_offsets;
        let bytes = &self.mmap[self.data_start + a..self.data_start + b];
        let Some(expected) = checksums.get(name) else {
            return Err(Error::metadata(
                path,
                format!("no checksum recorded for tensor '{name}'"),
            ));
        };
        let actual = checksum(bytes);
        if !expected.eq_ignore_ascii_case(&actual) {
            return Err(Error::Checksum {
                path: path.clone(),
                tensor: name.to_string(),
                expected: expected.clone(),
                actual,
            });
        }
        Ok(bytemuck::pod_collect_to_vec(bytes))
    }
}
