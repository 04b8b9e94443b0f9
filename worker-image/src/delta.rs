//! Part deltas: what a worker needs, beside the part it already holds, to train its part of a new
//! partitioning after an in-place resize (issue 33). Only the rows it gains travel, with their in-neighbour
//! lists (global ids), labels and split membership, plus the new part's halo bookkeeping (halo ids, their
//! degrees, what it receives from and sends to each peer); the rows it keeps stay where they are and the
//! rows it loses are named. A joiner holds no part: its delta carries every row it owns.
//!
//! [`diff`] cuts a delta from the new part (as `build_parts` makes it) and the old owner of every node;
//! [`apply`] rebuilds exactly that part from the held one and the delta (`apply(old, diff(..)) == new`,
//! tested on random graphs and partitionings), so training after the resize computes what it would have
//! computed on the part file.
//!
//! The file is a small self-describing binary (magic, a JSON header naming each array's element count and
//! byte length, then the arrays); the artifact transfer checks its size and checksum. The features travel
//! as the dataset stores them; every integer array travels as varints of each element's difference from
//! the one before ([`put_varints`]): ids ascending (the rows gained and lost, each row's in-neighbours,
//! the halo within each peer's group) and small counts take one to three bytes instead of four or eight,
//! so the bookkeeping beside the moved rows' features stays small (issue 33: bytes moved at most 1.2x the
//! rows that change owner).
//!
//! A delta may also carry rows of the new part's input halo ([`PartDelta::carry_halo_rows`]): the
//! features of the halo rows its worker will not hold after the resize ([`lacking_halo`]; every one for a
//! joiner), which a model keeping its first layer's input halo would otherwise fetch from its peers in
//! the resize's pause. They are not rows that change owner and are counted apart ([`DeltaBytes::halo`]).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use physalia_graph::partition::Part;
use physalia_graph::{Csr, FeatureDtype, FeatureView, Features};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

const MAGIC: &[u8; 8] = b"PHDELTA4";

/// What changes between the part a worker holds and its part of the new partitioning.
#[derive(Clone, Debug, PartialEq)]
pub struct PartDelta {
    pub part: usize,
    pub k: usize,
    pub feat_dim: usize,
    pub num_classes: usize,
    pub num_nodes_global: usize,
    pub num_train_global: usize,
    pub feature_dtype: FeatureDtype,
    /// How many rows the part it applies to holds (0: a joiner's).
    pub held: usize,
    /// Owned rows given up (global ids, ascending).
    pub lost: Vec<u32>,
    /// Owned rows gained (global ids, ascending).
    pub gained: Vec<u32>,
    /// Each gained row's in-neighbours: `gained_nbrs[gained_indptr[i]..gained_indptr[i + 1]]`, global ids,
    /// ascending within a row.
    pub gained_indptr: Vec<u64>,
    pub gained_nbrs: Vec<u32>,
    pub gained_labels: Vec<i64>,
    /// Indices into `gained` of the gained rows in the train, val and test splits, ascending.
    pub gained_splits: [Vec<u32>; 3],
    /// The gained rows' features, `gained.len() x feat_dim` in `feature_dtype`, little-endian bytes.
    pub gained_features: Vec<u8>,
    /// The new part's halo (global ids, in its order), the halo rows' global in-degrees, and what it
    /// receives from and sends to each peer, as in the part file.
    pub halo: Vec<u32>,
    pub halo_degree: Vec<u32>,
    pub recv: Vec<(u32, Range<usize>)>,
    pub send: Vec<(u32, Vec<u32>)>,
    /// Rows of the new part's halo carried for its input halo (global ids, ascending; empty unless
    /// [`PartDelta::carry_halo_rows`] added them) and their features, as `gained_features`.
    pub halo_rows: Vec<u32>,
    pub halo_features: Vec<u8>,
}

/// Rows of a part's halo with their features as the dataset stores them (ids ascending): what a delta
/// carries for its worker's input halo.
#[derive(Clone, Debug, PartialEq)]
pub struct HaloRows {
    pub ids: Vec<u32>,
    pub features: Features,
}

/// Sizes of a delta as written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeltaBytes {
    /// The gained rows: features, in-neighbour lists, labels, split membership, ids.
    pub rows: u64,
    /// The lost rows' ids and the halo bookkeeping.
    pub bookkeeping: u64,
    /// The input halo's rows carried ahead (ids and features): no rows that change owner.
    pub halo: u64,
    /// The whole file: the above, the magic and the header.
    pub file: u64,
}

/// The delta that takes whatever part rank `new.part` held under `old_owner` (node -> rank; a joiner's
/// rank owned nothing) to `new`, its part under `new_owner`.
pub fn diff(old_owner: &[u32], new_owner: &[u32], new: &Part) -> PartDelta {
    let me = new.part as u32;
    let n_owned = new.owned.len();
    let held = old_owner.iter().filter(|&&o| o == me).count();
    let lost: Vec<u32> = old_owner
        .iter()
        .zip(new_owner)
        .enumerate()
        .filter(|&(_, (&o, &n))| o == me && n != me)
        .map(|(v, _)| v as u32)
        .collect();
    let gained_local: Vec<usize> = (0..n_owned)
        .filter(|&i| old_owner[new.owned[i] as usize] != me)
        .collect();
    let global = |l: i32| -> u32 {
        let l = l as usize;
        if l < n_owned {
            new.owned[l]
        } else {
            new.halo[l - n_owned]
        }
    };
    let mut gained_indptr = Vec::with_capacity(gained_local.len() + 1);
    gained_indptr.push(0u64);
    let mut gained_nbrs = Vec::new();
    for &i in &gained_local {
        let row = &new.indices[new.indptr[i] as usize..new.indptr[i + 1] as usize];
        let start = gained_nbrs.len();
        gained_nbrs.extend(row.iter().map(|&l| global(l)));
        // ascending global ids travel as small differences (the part's local order is not global)
        gained_nbrs[start..].sort_unstable();
        gained_indptr.push(gained_nbrs.len() as u64);
    }
    // local row -> index among the gained rows
    let mut gained_at = vec![u32::MAX; n_owned];
    for (j, &i) in gained_local.iter().enumerate() {
        gained_at[i] = j as u32;
    }
    let gained_splits = [&new.train, &new.val, &new.test].map(|s| {
        s.iter()
            .map(|&i| gained_at[i as usize])
            .filter(|&j| j != u32::MAX)
            .collect()
    });
    let row_bytes = new.feat_dim * new.features.dtype().size_bytes();
    let all = new.features.view().as_bytes();
    let mut gained_features = Vec::with_capacity(gained_local.len() * row_bytes);
    for &i in &gained_local {
        gained_features.extend_from_slice(&all[i * row_bytes..(i + 1) * row_bytes]);
    }
    PartDelta {
        part: new.part,
        k: new.k,
        feat_dim: new.feat_dim,
        num_classes: new.num_classes,
        num_nodes_global: new.num_nodes_global,
        num_train_global: new.num_train_global,
        feature_dtype: new.features.dtype(),
        held,
        lost,
        gained: gained_local.iter().map(|&i| new.owned[i]).collect(),
        gained_indptr,
        gained_nbrs,
        gained_labels: gained_local.iter().map(|&i| new.labels[i]).collect(),
        gained_splits,
        gained_features,
        halo: new.halo.clone(),
        halo_degree: new.src_in_degree[n_owned..].to_vec(),
        recv: new.recv.clone(),
        send: new.send.clone(),
        halo_rows: Vec::new(),
        halo_features: Vec::new(),
    }
}

/// The rows of `new`'s halo that its rank will not hold once resized in place from `old_owner` (node ->
/// rank), ascending: those it did not own and, when its model kept its old part's input halo
/// (`old_halo_kept`), that were not in that halo either (`csr`: the graph the parts were cut from, whose
/// rows list each node's in-neighbours). Every halo row for a joiner.
pub fn lacking_halo(old_owner: &[u32], csr: Csr<'_>, new: &Part, old_halo_kept: bool) -> Vec<u32> {
    let me = new.part as u32;
    // the old part's halo, as `build_parts` collects it: the owned rows' in-neighbours
    let mut in_old_halo = Vec::new();
    if old_halo_kept {
        in_old_halo = vec![false; old_owner.len()];
        for (v, _) in old_owner.iter().enumerate().filter(|&(_, &o)| o == me) {
            for &u in csr.neighbors(v) {
                in_old_halo[u as usize] = true;
            }
        }
    }
    let mut lacking: Vec<u32> = new
        .halo
        .iter()
        .copied()
        .filter(|&u| {
            old_owner[u as usize] != me && !in_old_halo.get(u as usize).copied().unwrap_or(false)
        })
        .collect();
    lacking.sort_unstable();
    lacking
}

impl PartDelta {
    /// Carries rows `ids` (ascending) of the new part's halo with their features, gathered from
    /// `features` (the whole dataset's, `num_nodes_global x feat_dim`).
    pub fn carry_halo_rows(&mut self, ids: Vec<u32>, features: FeatureView<'_>) -> Result<()> {
        ensure!(
            features.dtype() == self.feature_dtype
                && features.len() == self.num_nodes_global * self.feat_dim,
            "the features are not the delta's dataset's"
        );
        ensure!(
            ids.windows(2).all(|w| w[0] < w[1]),
            "the carried halo rows are not ascending"
        );
        let row_bytes = self.feat_dim * self.feature_dtype.size_bytes();
        let all = features.as_bytes();
        let mut bytes = Vec::with_capacity(ids.len() * row_bytes);
        for &v in &ids {
            let at = v as usize * row_bytes;
            bytes.extend_from_slice(
                all.get(at..at + row_bytes)
                    .with_context(|| format!("node {v} is outside the dataset"))?,
            );
        }
        self.halo_rows = ids;
        self.halo_features = bytes;
        Ok(())
    }

    /// The carried rows of the input halo, checked (ascending ids of the dataset, one row each).
    pub fn halo_rows(&self) -> Result<HaloRows> {
        let row_bytes = self
            .feat_dim
            .checked_mul(self.feature_dtype.size_bytes())
            .context("the feature width overflows")?;
        ensure!(
            self.halo_rows.len().checked_mul(row_bytes) == Some(self.halo_features.len()),
            "{} bytes of features for {} carried halo rows of {row_bytes} bytes",
            self.halo_features.len(),
            self.halo_rows.len()
        );
        ensure!(
            self.halo_rows.windows(2).all(|w| w[0] < w[1])
                && self
                    .halo_rows
                    .last()
                    .is_none_or(|&v| (v as usize) < self.num_nodes_global),
            "the carried halo rows are not ascending ids of the dataset's {} nodes",
            self.num_nodes_global
        );
        let mut features =
            Features::zeros(self.feature_dtype, self.halo_rows.len() * self.feat_dim);
        features.as_bytes_mut().copy_from_slice(&self.halo_features);
        Ok(HaloRows {
            ids: self.halo_rows.clone(),
            features,
        })
    }
}

/// The new part: `old` (the part this worker held; `None` for a joiner) less the lost rows, plus the
/// gained ones, with the new halo bookkeeping. Fails when the delta was not cut for `old`.
pub fn apply(old: Option<&Part>, d: &PartDelta) -> Result<Part> {
    let n = d.num_nodes_global;
    let row_bytes = d.feat_dim * d.feature_dtype.size_bytes();
    ensure!(
        d.gained_indptr.len() == d.gained.len() + 1
            && d.gained_labels.len() == d.gained.len()
            && d.gained_features.len() == d.gained.len() * row_bytes
            && d.halo_degree.len() == d.halo.len()
            && d.gained_indptr.last().copied() == Some(d.gained_nbrs.len() as u64),
        "the delta's arrays disagree in length"
    );
    let empty: Vec<u32> = Vec::new();
    let (old_owned, old_halo) = match old {
        Some(p) => {
            ensure!(
                p.feat_dim == d.feat_dim
                    && p.num_nodes_global == n
                    && p.features.dtype() == d.feature_dtype,
                "the held part ({} nodes, {} features of {:?}) is not of the delta's dataset ({n}, {} of {:?})",
                p.num_nodes_global,
                p.feat_dim,
                p.features.dtype(),
                d.feat_dim,
                d.feature_dtype
            );
            (&p.owned, &p.halo)
        }
        None => (&empty, &empty),
    };
    ensure!(
        old_owned.len() == d.held,
        "the delta applies to a part of {} rows, this worker holds {}",
        d.held,
        old_owned.len()
    );
    // the rows kept: the held ones less the lost (both ascending), as old local ids
    let mut kept: Vec<usize> = Vec::with_capacity(old_owned.len());
    let mut lost = d.lost.iter().peekable();
    for (i, &v) in old_owned.iter().enumerate() {
        match lost.peek() {
            Some(&&l) if l == v => {
                lost.next();
            }
            Some(&&l) if l < v => {
                bail!("the delta gives up row {l}, which this worker does not hold")
            }
            _ => kept.push(i),
        }
    }
    if let Some(l) = lost.next() {
        bail!("the delta gives up row {l}, which this worker does not hold");
    }
    // new owned rows: kept and gained merged in ascending global id; each from where it comes
    enum Src {
        Kept(usize),
        Gained(usize),
    }
    let mut rows: Vec<(u32, Src)> = Vec::with_capacity(kept.len() + d.gained.len());
    let (mut a, mut b) = (0, 0);
    while a < kept.len() || b < d.gained.len() {
        let ka = kept.get(a).map(|&i| old_owned[i]);
        let gb = d.gained.get(b).copied();
        match (ka, gb) {
            (Some(x), Some(y)) if x == y => bail!("row {x} is both kept and gained"),
            (Some(x), Some(y)) if x < y => {
                rows.push((x, Src::Kept(kept[a])));
                a += 1;
            }
            (Some(x), None) => {
                rows.push((x, Src::Kept(kept[a])));
                a += 1;
            }
            (_, Some(y)) => {
                rows.push((y, Src::Gained(b)));
                b += 1;
            }
            (None, None) => unreachable!("the loop runs while one side has rows"),
        }
    }
    let n_owned = rows.len();
    // global id -> new local id (owned, then halo)
    let mut local = vec![u32::MAX; n];
    for (i, (v, _)) in rows.iter().enumerate() {
        *local
            .get_mut(*v as usize)
            .with_context(|| format!("row {v} is not a node of the {n}"))? = i as u32;
    }
    for (j, &h) in d.halo.iter().enumerate() {
        let slot = local
            .get_mut(h as usize)
            .with_context(|| format!("halo node {h} is not a node of the {n}"))?;
        ensure!(*slot == u32::MAX, "halo node {h} is also owned");
        *slot = (n_owned + j) as u32;
    }
    let to_local = |g: u32| -> Result<i32> {
        match local.get(g as usize) {
            Some(&l) if l != u32::MAX => Ok(l as i32),
            _ => bail!("in-neighbour {g} is neither owned nor in the delta's halo"),
        }
    };
    let old_global = |l: i32| -> u32 {
        let l = l as usize;
        if l < old_owned.len() {
            old_owned[l]
        } else {
            old_halo[l - old_owned.len()]
        }
    };
    // the rows' lengths first, so every row's neighbours and features have their place before any is
    // written, and the rows are filled on the worker's threads (single-threaded, this was 0.3-0.5 s of an
    // in-place resize's pause at SBM 1M: issue 33)
    let mut indptr = Vec::with_capacity(n_owned + 1);
    indptr.push(0i64);
    for (_, from) in &rows {
        let len = match *from {
            Src::Kept(i) => {
                let p = old.expect("kept rows come from a held part");
                (p.indptr[i + 1] - p.indptr[i]) as usize
            }
            Src::Gained(j) => (d.gained_indptr[j + 1] - d.gained_indptr[j]) as usize,
        };
        indptr.push(indptr.last().copied().unwrap_or(0) + len as i64);
    }
    let nnz = indptr.last().copied().unwrap_or(0) as usize;
    let mut indices = vec![0i32; nnz];
    let old_features = old.map(|p| p.features.view().as_bytes()).unwrap_or(&[]);
    let mut features = Features::zeros(d.feature_dtype, n_owned * d.feat_dim);
    {
        // each row's slice of the indices (rows are contiguous in `indices`, in row order)
        let mut slots: Vec<&mut [i32]> = Vec::with_capacity(n_owned);
        let mut rest = indices.as_mut_slice();
        for w in indptr.windows(2) {
            let (row, tail) = rest.split_at_mut((w[1] - w[0]) as usize);
            slots.push(row);
            rest = tail;
        }
        // one slice a row (empty ones when rows have no features: `zip` must not run out of them)
        let feature_rows: Vec<&mut [u8]> = if row_bytes == 0 {
            (0..n_owned).map(|_| <&mut [u8]>::default()).collect()
        } else {
            features.as_bytes_mut().chunks_mut(row_bytes).collect()
        };
        slots
            .into_par_iter()
            .zip(feature_rows)
            .zip(rows.par_iter())
            .try_for_each(|((out, feats), (_, from))| -> Result<()> {
                match *from {
                    Src::Kept(i) => {
                        let p = old.expect("kept rows come from a held part");
                        let nbrs = &p.indices[p.indptr[i] as usize..p.indptr[i + 1] as usize];
                        for (o, &l) in out.iter_mut().zip(nbrs) {
                            *o = to_local(old_global(l))?;
                        }
                        feats.copy_from_slice(&old_features[i * row_bytes..(i + 1) * row_bytes]);
                    }
                    Src::Gained(j) => {
                        let r = d.gained_indptr[j] as usize..d.gained_indptr[j + 1] as usize;
                        for (o, &g) in out.iter_mut().zip(&d.gained_nbrs[r]) {
                            *o = to_local(g)?;
                        }
                        feats.copy_from_slice(
                            &d.gained_features[j * row_bytes..(j + 1) * row_bytes],
                        );
                    }
                }
                out.sort_unstable();
                Ok(())
            })?;
    }
    // an owned row's global in-degree is its row's length: every in-neighbour is owned or halo
    let mut src_in_degree = Vec::with_capacity(n_owned + d.halo.len());
    src_in_degree.extend(indptr.windows(2).map(|w| (w[1] - w[0]) as u32));
    let labels: Vec<_> = rows
        .iter()
        .map(|(_, from)| match *from {
            Src::Kept(i) => old.expect("kept rows come from a held part").labels[i],
            Src::Gained(j) => d.gained_labels[j],
        })
        .collect();
    src_in_degree.extend_from_slice(&d.halo_degree);
    // split membership: the kept rows' from the held part, the gained rows' from the delta
    let mut new_of_old = vec![u32::MAX; old_owned.len()];
    let mut new_of_gained = vec![u32::MAX; d.gained.len()];
    for (i, (_, from)) in rows.iter().enumerate() {
        match *from {
            Src::Kept(o) => new_of_old[o] = i as u32,
            Src::Gained(j) => new_of_gained[j] = i as u32,
        }
    }
    let mut splits: [Vec<u32>; 3] = Default::default();
    for (s, split) in splits.iter_mut().enumerate() {
        if let Some(p) = old {
            let held = [&p.train, &p.val, &p.test][s];
            split.extend(
                held.iter()
                    .map(|&o| new_of_old[o as usize])
                    .filter(|&i| i != u32::MAX),
            );
        }
        for &j in &d.gained_splits[s] {
            let i = *new_of_gained
                .get(j as usize)
                .with_context(|| format!("split entry {j} is not a gained row"))?;
            split.push(i);
        }
        split.sort_unstable();
    }
    let [train, val, test] = splits;
    let part = Part {
        part: d.part,
        k: d.k,
        owned: rows.iter().map(|(v, _)| *v).collect(),
        halo: d.halo.clone(),
        indptr,
        indices,
        src_in_degree,
        recv: d.recv.clone(),
        send: d.send.clone(),
        labels,
        train,
        val,
        test,
        features,
        feat_dim: d.feat_dim,
        num_classes: d.num_classes,
        num_nodes_global: n,
        num_train_global: d.num_train_global,
    };
    part.validate()
        .context("the part rebuilt from the held one and the delta")?;
    Ok(part)
}

/// The header of a delta file.
#[derive(Serialize, Deserialize)]
struct Header {
    part: usize,
    k: usize,
    feat_dim: usize,
    num_classes: usize,
    num_nodes_global: usize,
    num_train_global: usize,
    feature_dtype: FeatureDtype,
    held: usize,
    /// Each array's name, element count and byte length, in the order the arrays follow the header.
    arrays: Vec<(String, usize, usize)>,
}

/// One array of a delta file: its name, element count and bytes on the wire.
struct Array<'a> {
    name: &'static str,
    count: usize,
    bytes: std::borrow::Cow<'a, [u8]>,
}

impl PartDelta {
    /// The file's arrays, in order: the features as stored, every integer array as varints.
    fn arrays(&self) -> Vec<Array<'_>> {
        let ints = |name: &'static str, values: &mut dyn Iterator<Item = i64>| {
            let mut bytes = Vec::new();
            let count = put_varints(values, &mut bytes);
            Array {
                name,
                count,
                bytes: bytes.into(),
            }
        };
        fn u32s(v: &[u32]) -> impl Iterator<Item = i64> + '_ {
            v.iter().map(|&x| i64::from(x))
        }
        // a gained row's in-degree, not the running offset
        let mut degrees = self.gained_indptr.windows(2).map(|w| (w[1] - w[0]) as i64);
        let mut recv = self
            .recv
            .iter()
            .flat_map(|(q, r)| [i64::from(*q), r.start as i64, r.end as i64]);
        let mut send_lens = self.send.iter().map(|(_, r)| r.len() as i64);
        let mut send_rows = self.send.iter().flat_map(|(_, r)| u32s(r));
        vec![
            ints("lost", &mut u32s(&self.lost)),
            ints("gained", &mut u32s(&self.gained)),
            ints("gained_degree", &mut degrees),
            ints("gained_nbrs", &mut u32s(&self.gained_nbrs)),
            ints("gained_labels", &mut self.gained_labels.iter().copied()),
            ints("gained_train", &mut u32s(&self.gained_splits[0])),
            ints("gained_val", &mut u32s(&self.gained_splits[1])),
            ints("gained_test", &mut u32s(&self.gained_splits[2])),
            Array {
                name: "gained_features",
                count: self.gained_features.len(),
                bytes: self.gained_features.as_slice().into(),
            },
            ints("halo", &mut u32s(&self.halo)),
            ints("halo_degree", &mut u32s(&self.halo_degree)),
            ints("recv", &mut recv),
            ints(
                "send_peers",
                &mut self.send.iter().map(|(q, _)| i64::from(*q)),
            ),
            ints("send_lens", &mut send_lens),
            ints("send_rows", &mut send_rows),
            ints("halo_rows", &mut u32s(&self.halo_rows)),
            Array {
                name: "halo_features",
                count: self.halo_features.len(),
                bytes: self.halo_features.as_slice().into(),
            },
        ]
    }

    /// Writes the delta to `path` (a temporary name, then renamed). Returns its sizes.
    pub fn write(&self, path: &Path) -> Result<DeltaBytes> {
        let arrays = self.arrays();
        let mut sizes = DeltaBytes::default();
        for a in &arrays {
            // the gained rows' own arrays are the `gained*` ones, the carried halo rows' `halo_rows` and
            // `halo_features`
            let size = a.bytes.len() as u64;
            match a.name {
                "halo_rows" | "halo_features" => sizes.halo += size,
                gained if gained.starts_with("gained") => sizes.rows += size,
                _ => sizes.bookkeeping += size,
            }
        }
        let header = Header {
            part: self.part,
            k: self.k,
            feat_dim: self.feat_dim,
            num_classes: self.num_classes,
            num_nodes_global: self.num_nodes_global,
            num_train_global: self.num_train_global,
            feature_dtype: self.feature_dtype,
            held: self.held,
            arrays: arrays
                .iter()
                .map(|a| (a.name.to_string(), a.count, a.bytes.len()))
                .collect(),
        };
        let json = serde_json::to_vec(&header)?;
        // the arrays written as they are (no copy of the whole file in memory)
        let tmp = path.with_extension("tmp");
        let written = (|| -> std::io::Result<()> {
            use std::io::Write;
            let mut out = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
            out.write_all(MAGIC)?;
            out.write_all(&(json.len() as u64).to_le_bytes())?;
            out.write_all(&json)?;
            for a in &arrays {
                out.write_all(&a.bytes)?;
            }
            out.flush()
        })();
        written.with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))?;
        sizes.file = (16 + json.len() + arrays.iter().map(|a| a.bytes.len()).sum::<usize>()) as u64;
        Ok(sizes)
    }

    /// Reads a delta written by [`PartDelta::write`].
    pub fn read(path: &Path) -> Result<PartDelta> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&bytes).with_context(|| format!("reading the part delta {}", path.display()))
    }

    fn parse(bytes: &[u8]) -> Result<PartDelta> {
        ensure!(
            bytes.len() >= 16 && &bytes[..8] == MAGIC,
            "not a part delta"
        );
        let len = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")) as usize;
        let json = bytes
            .get(16..16usize.saturating_add(len))
            .context("the header runs past the end")?;
        let h: Header = serde_json::from_slice(json).context("the header")?;
        let mut at = 16 + len;
        let mut raw: BTreeMap<String, (usize, &[u8])> = BTreeMap::new();
        for (name, count, size) in &h.arrays {
            let end = at.checked_add(*size).context("an array's size overflows")?;
            let slice = bytes
                .get(at..end)
                .with_context(|| format!("array {name} runs past the end"))?;
            ensure!(
                raw.insert(name.clone(), (*count, slice)).is_none(),
                "array {name} appears twice"
            );
            at = end;
        }
        ensure!(
            at == bytes.len(),
            "{} bytes after the last array",
            bytes.len() - at
        );
        let get = |name: &str| -> Result<(usize, &[u8])> {
            raw.get(name)
                .copied()
                .with_context(|| format!("no array {name}"))
        };
        let ints = |name: &str| -> Result<Vec<i64>> {
            let (count, bytes) = get(name)?;
            get_varints(bytes, count).with_context(|| format!("array {name}"))
        };
        let conv = |name: &str| narrow::<u32>(name, ints(name)?);
        let usizes = |name: &str| narrow::<usize>(name, ints(name)?);
        let recv_flat = usizes("recv")?;
        ensure!(recv_flat.len() % 3 == 0, "recv is not in triples");
        let recv = recv_flat
            .chunks_exact(3)
            .map(|c| -> Result<_> {
                let q = u32::try_from(c[0]).context("recv names a peer beyond u32")?;
                Ok((q, c[1]..c[2]))
            })
            .collect::<Result<_>>()?;
        let send_peers = conv("send_peers")?;
        let send_lens = usizes("send_lens")?;
        let send_rows = conv("send_rows")?;
        ensure!(
            send_lens.len() == send_peers.len()
                && send_lens.iter().try_fold(0usize, |a, &l| a.checked_add(l))
                    == Some(send_rows.len()),
            "send_lens do not add up to the length of send_rows"
        );
        let mut gained_indptr = vec![0u64];
        for d in usizes("gained_degree")? {
            let next = gained_indptr
                .last()
                .expect("starts at 0")
                .checked_add(d as u64)
                .context("the gained rows' degrees overflow")?;
            gained_indptr.push(next);
        }
        let mut rest = send_rows.as_slice();
        let send = send_peers
            .iter()
            .zip(&send_lens)
            .map(|(&q, &l)| {
                let (rows, tail) = rest.split_at(l);
                rest = tail;
                (q, rows.to_vec())
            })
            .collect();
        let (features_len, features) = get("gained_features")?;
        ensure!(
            features_len == features.len(),
            "gained_features names {features_len} bytes and holds {}",
            features.len()
        );
        let (halo_len, halo_features) = get("halo_features")?;
        ensure!(
            halo_len == halo_features.len(),
            "halo_features names {halo_len} bytes and holds {}",
            halo_features.len()
        );
        Ok(PartDelta {
            part: h.part,
            k: h.k,
            feat_dim: h.feat_dim,
            num_classes: h.num_classes,
            num_nodes_global: h.num_nodes_global,
            num_train_global: h.num_train_global,
            feature_dtype: h.feature_dtype,
            held: h.held,
            lost: conv("lost")?,
            gained: conv("gained")?,
            gained_indptr,
            gained_nbrs: conv("gained_nbrs")?,
            gained_labels: ints("gained_labels")?,
            gained_splits: [
                conv("gained_train")?,
                conv("gained_val")?,
                conv("gained_test")?,
            ],
            gained_features: features.to_vec(),
            halo: conv("halo")?,
            halo_degree: conv("halo_degree")?,
            recv,
            send,
            halo_rows: conv("halo_rows")?,
            halo_features: halo_features.to_vec(),
        })
    }
}

/// `values` of array `name` as `T`, each in its range.
fn narrow<T: TryFrom<i64>>(name: &str, values: Vec<i64>) -> Result<Vec<T>> {
    values
        .into_iter()
        .map(|x| {
            T::try_from(x).map_err(|_| {
                anyhow::anyhow!("array {name}: {x} is not a {}", std::any::type_name::<T>())
            })
        })
        .collect()
}

/// Appends each value as the zig-zag LEB128 varint of its difference from the value before (the first
/// from 0): an ascending run of ids costs the bytes of its gaps, a value close to the one before one byte.
/// Returns how many values it wrote.
fn put_varints(values: &mut dyn Iterator<Item = i64>, out: &mut Vec<u8>) -> usize {
    let (mut prev, mut count) = (0i64, 0);
    for v in values {
        count += 1;
        let d = v.wrapping_sub(prev);
        prev = v;
        let mut z = ((d << 1) ^ (d >> 63)) as u64;
        while z >= 0x80 {
            out.push((z as u8) | 0x80);
            z >>= 7;
        }
        out.push(z as u8);
    }
    count
}

/// Reads `count` values written by [`put_varints`] that fill `bytes` exactly; anything else (a truncated
/// or overlong varint, bytes left over, fewer bytes than values) is an error.
fn get_varints(bytes: &[u8], count: usize) -> Result<Vec<i64>> {
    // every value takes at least one byte: a count beyond the bytes cannot be right (and must not size
    // an allocation)
    ensure!(
        count <= bytes.len(),
        "{count} values in {} bytes",
        bytes.len()
    );
    let mut out = Vec::with_capacity(count);
    let (mut at, mut prev) = (0usize, 0i64);
    for _ in 0..count {
        let mut z = 0u64;
        let mut shift = 0u32;
        loop {
            let b = *bytes.get(at).context("a value runs past the end")?;
            at += 1;
            ensure!(
                shift < 64 && (shift < 63 || b <= 1),
                "a varint longer than 64 bits"
            );
            z |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                break;
            }
            shift += 7;
        }
        let d = ((z >> 1) as i64) ^ -((z & 1) as i64);
        prev = prev.wrapping_add(d);
        out.push(prev);
    }
    ensure!(
        at == bytes.len(),
        "{} bytes after the last of {count} values",
        bytes.len() - at
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use physalia_graph::partition::{Partitioning, build_parts};

    /// A small SBM dataset with `n` nodes, in memory.
    fn dataset(n: usize, seed: u64) -> physalia_graph::OwnedDataset {
        physalia_graph::synth::sbm(&physalia_graph::synth::SbmParams {
            num_nodes: n,
            num_classes: 3,
            feat_dim: 5,
            seed,
            ..Default::default()
        })
        .expect("a small SBM")
    }

    fn parts(ds: &physalia_graph::OwnedDataset, owner: &[u32], k: usize) -> Vec<Part> {
        let p = Partitioning::from_assignment(ds.csr(), k, owner.to_vec(), "test", 0).unwrap();
        build_parts(ds, &p).unwrap()
    }

    /// `apply(old, diff(old_owner, new_owner, new))` is the part `build_parts` cuts, for every rank of
    /// every pair of random partitionings (growing, shrinking, same size), joiners and survivors alike;
    /// and it survives a write and a read.
    #[test]
    fn applying_a_delta_to_the_held_part_gives_the_new_part() {
        let dir = tempfile::tempdir().unwrap();
        for seed in 0..6u64 {
            let ds = dataset(300, seed);
            let n = 300;
            let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut draw = |k: usize| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % k as u64) as u32
            };
            for (k_old, k_new) in [(1, 2), (2, 4), (4, 2), (3, 3), (2, 1)] {
                let old_owner: Vec<u32> = (0..n).map(|_| draw(k_old)).collect();
                let new_owner: Vec<u32> = (0..n).map(|_| draw(k_new)).collect();
                let old = parts(&ds, &old_owner, k_old);
                let new = parts(&ds, &new_owner, k_new);
                for want in &new {
                    let held = old.get(want.part);
                    let mut d = diff(&old_owner, &new_owner, want);
                    // the halo rows it will not hold: not its own before, nor (when its model kept
                    // it) in its old halo
                    for kept in [false, true] {
                        let lacking = lacking_halo(&old_owner, ds.csr(), want, kept);
                        let holds = |u: &u32| {
                            held.is_some_and(|p| {
                                p.owned.contains(u) || (kept && p.halo.contains(u))
                            })
                        };
                        let mut want_lacking: Vec<u32> =
                            want.halo.iter().copied().filter(|u| !holds(u)).collect();
                        want_lacking.sort_unstable();
                        assert_eq!(lacking, want_lacking, "seed {seed}, {k_old} -> {k_new}");
                        if kept {
                            d.carry_halo_rows(lacking, ds.features.view()).unwrap();
                        }
                    }
                    let path = dir.path().join("d.bin");
                    let size = d.write(&path).unwrap();
                    assert_eq!(size.file, std::fs::metadata(&path).unwrap().len());
                    assert!(size.rows >= d.gained_features.len() as u64);
                    assert!(size.rows + size.bookkeeping < size.file);
                    // the carried rows are counted apart: their features and a varint an id
                    let (carried, ids) = (d.halo_features.len() as u64, d.halo_rows.len() as u64);
                    assert!(size.halo >= carried + ids && size.halo <= carried + 5 * ids);
                    let read = PartDelta::read(&path).unwrap();
                    assert_eq!(read, d);
                    // the carried rows are the dataset's rows
                    let carried = read.halo_rows().unwrap();
                    let row_bytes = 5 * 4;
                    for (i, &v) in carried.ids.iter().enumerate() {
                        let v = v as usize;
                        assert_eq!(
                            &carried.features.view().as_bytes()[i * row_bytes..(i + 1) * row_bytes],
                            &ds.features.view().as_bytes()[v * row_bytes..(v + 1) * row_bytes]
                        );
                    }
                    let got = apply(held, &read).unwrap();
                    assert_eq!(
                        &got, want,
                        "seed {seed}, {k_old} -> {k_new}, part {}",
                        want.part
                    );
                    // only what changes owner travels as rows
                    let moved = (0..n)
                        .filter(|&v| {
                            new_owner[v] == want.part as u32 && old_owner[v] != want.part as u32
                        })
                        .count();
                    assert_eq!(d.gained.len(), moved);
                }
            }
        }
    }

    #[test]
    fn varints_round_trip_and_refuse_what_they_did_not_write() {
        let values = [
            0,
            1,
            -1,
            5,
            4,
            i64::from(u32::MAX),
            0,
            i64::MAX,
            i64::MIN,
            -7,
            i64::MIN,
        ];
        let mut bytes = Vec::new();
        put_varints(&mut values.iter().copied(), &mut bytes);
        assert_eq!(get_varints(&bytes, values.len()).unwrap(), values);
        // ascending ids cost their gaps: one byte each under 64 apart
        let mut small = Vec::new();
        put_varints(&mut (1000..1100).map(|x| x * 3), &mut small);
        assert_eq!(small.len(), 2 + 99);
        // too few values, too many, a truncated one, an overlong one
        assert!(get_varints(&bytes, values.len() - 1).is_err());
        assert!(get_varints(&bytes, values.len() + 1).is_err());
        assert!(get_varints(&bytes[..bytes.len() - 1], values.len()).is_err());
        assert!(get_varints(&[0xff; 11], 1).is_err());
        assert!(get_varints(&[0x80; 3], usize::MAX).is_err());
    }

    #[test]
    fn a_delta_cut_for_another_part_is_refused() {
        let ds = dataset(200, 1);
        let old_owner: Vec<u32> = (0..200).map(|v| (v % 2) as u32).collect();
        let new_owner: Vec<u32> = (0..200).map(|v| (v % 3) as u32).collect();
        let old = parts(&ds, &old_owner, 2);
        let new = parts(&ds, &new_owner, 3);
        // rank 0's delta applied to rank 1's part: it gives up rows rank 1 does not hold
        let d = diff(&old_owner, &new_owner, &new[0]);
        assert!(apply(Some(&old[1]), &d).is_err());
        // garbage is an error, not a panic
        assert!(PartDelta::parse(b"PHDELTA1\xff\xff\xff\xff\xff\xff\xff\xff").is_err());
        assert!(PartDelta::parse(b"PHDELTA3\xff\xff\xff\xff\xff\xff\xff\xff").is_err());
        assert!(PartDelta::parse(b"nothing").is_err());
    }
}
