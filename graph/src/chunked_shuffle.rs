//! Cutting the parts of a chunked dataset ([`crate::chunked`]) with the `k` workers that train on them,
//! each reading only `1/k` of the dataset: worker `r` reads chunks `r, r + k, r + 2k, ...` (every tensor
//! of them: edges, features, labels, and the split lists' chunks alike) and sends each row to the worker
//! that owns it under the assignment; the rows arrive at their owner, which builds its part from them.
//! What [`crate::chunked_partition::cut_part`] gets by reading every edge chunk and most feature chunks
//! in each worker, this gets by reading each chunk once in the whole job (the bytes a worker reads are
//! its share of the files, not the dataset), the rest moving between workers over a [`Shuffle`].
//!
//! The exchange runs in rounds, the same number on every worker (`ceil(chunks / k)` for the node chunks,
//! then per split list), each an all-to-all of byte records: memory beyond the part being built is one
//! chunk read and the records of one round. Then two small all-to-alls settle the halo: each worker asks
//! every owner for the in-degrees of the halo rows it needs (the request is the owner's send list for
//! it), and the owner answers with them.
//!
//! The part equals [`crate::partition::build_parts`]`(loaded dataset, assignment)[me]`: the same owned
//! rows, halo, local CSR, send and receive lists, degrees, splits and features (tested against it).
//! A record for a row this worker does not own, a row received twice or never, or a malformed record is
//! an error naming the sending worker; nothing is written until the part is whole.

use std::path::Path;

use crate::chunked::{ChunkEntry, ChunkedDataset, Manifest};
use crate::error::Error;
use crate::format::{FeatureDtype, Features, Split};
use crate::partition::{Part, Partitioning, write_part};

/// An all-to-all of byte records between the `k` workers cutting one partition set, worker `r` cutting
/// part `r`. Every worker calls [`Shuffle::all_to_all`] the same number of times with the same
/// `(stage, round)` sequence.
pub trait Shuffle {
    /// This worker's index, which is the part it cuts.
    fn me(&self) -> usize;
    /// The number of workers (parts).
    fn k(&self) -> usize;
    /// Sends `out[q]` to every other worker `q` and returns what every worker sent to this one, by
    /// worker (this worker's own entry is `out[me]`).
    fn all_to_all(
        &mut self,
        stage: u16,
        round: u32,
        out: Vec<Vec<u8>>,
    ) -> Result<Vec<Vec<u8>>, Error>;
}

/// What cutting a part by shuffle read and moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShuffleStats {
    /// Bytes of the dataset's chunk files this worker read (the assignment and manifest not counted).
    pub read_bytes: u64,
    /// Chunk files read.
    pub chunks_read: usize,
    /// Record bytes this worker sent to other workers and received from them.
    pub sent_bytes: u64,
    pub received_bytes: u64,
    /// Whether this call wrote the part file (false: an earlier try of the same assignment had).
    pub wrote: bool,
}

/// The exchange stages, in order: the tag of every message says which one it belongs to.
const STAGE_ROWS: u16 = 1;
const STAGE_SPLIT: [u16; 3] = [2, 3, 4];
const STAGE_HALO: u16 = 5;
const STAGE_DEGREES: u16 = 6;

/// Cuts part `shuffle.me()` of the pending assignment at `assignment` from the chunked dataset at
/// `dataset_dir` together with the other workers ([`shuffle_part`]) and writes it to `out` (by rename:
/// never half-written) unless an earlier try of the same assignment wrote it already. Refuses an assignment made for another version of the dataset or into another
/// number of parts than there are workers.
pub fn cut_part_shuffled(
    dataset_dir: &Path,
    assignment: &Path,
    out: &Path,
    shuffle: &mut dyn Shuffle,
) -> Result<(Part, ShuffleStats), Error> {
    let (ds, p) = crate::chunked_partition::open_pending(dataset_dir, assignment)?;
    let (part, mut stats) = shuffle_part(&ds, &p, shuffle)?;
    // a retried launch's worker whose part an earlier try wrote keeps that file
    stats.wrote = !crate::chunked_partition::already_written(&part, out);
    if stats.wrote {
        write_part(&part, out)?;
    }
    Ok((part, stats))
}

/// Builds part `shuffle.me()` of `p` from the rows the workers read and send each other (see the
/// module doc). Every worker must call it with the same dataset and assignment.
pub fn shuffle_part(
    ds: &ChunkedDataset,
    p: &Partitioning,
    shuffle: &mut dyn Shuffle,
) -> Result<(Part, ShuffleStats), Error> {
    let (me, k) = (shuffle.me(), shuffle.k());
    let m = ds.manifest();
    let n = m.num_nodes;
    if p.k != k || me >= k {
        return Err(Error::partition(format!(
            "an assignment into {} parts cut by worker {me} of {k}",
            p.k
        )));
    }
    if p.parts.len() != n {
        return Err(Error::partition(format!(
            "assigns {} nodes but {} has {n}",
            p.parts.len(),
            ds.dir().display()
        )));
    }
    if let Some((v, q)) = p.parts.iter().enumerate().find(|(_, q)| **q as usize >= k) {
        return Err(Error::partition(format!(
            "node {v} is assigned to part {q}, outside 0..{k}"
        )));
    }
    let me32 = me as u32;
    let owned: Vec<u32> = (0..n as u32)
        .filter(|&v| p.parts[v as usize] == me32)
        .collect();
    let reads = chunks_read_by(m, me, k);
    let mut stats = ShuffleStats {
        read_bytes: reads.iter().map(|c| c.bytes).sum(),
        chunks_read: reads.len(),
        ..ShuffleStats::default()
    };
    let mut ex = Exchange {
        shuffle,
        stats: &mut stats,
    };
    let mut rows = OwnedRows::new(&owned, n, m.feat_dim, m.feature_dtype);
    let node_chunks = m.num_chunks();
    for round in 0..node_chunks.div_ceil(k) {
        let i = round * k + me;
        let mut out = vec![Vec::new(); k];
        if i < node_chunks {
            let (indptr, indices) = ds.read_chunk_edges(i)?;
            let (features, labels) = ds.read_chunk_nodes(i)?;
            let feats = feature_bytes(&features);
            let row_bytes = feats.len() / labels.len().max(1);
            let lo = ds.chunk_range(i).start;
            for (j, w) in indptr.windows(2).enumerate() {
                let v = lo + j;
                let row = &indices[w[0] as usize..w[1] as usize];
                let rec = &mut out[p.parts[v] as usize];
                rec.extend_from_slice(&(v as u32).to_le_bytes());
                rec.extend_from_slice(&(row.len() as u32).to_le_bytes());
                rec.extend_from_slice(&labels[j].to_le_bytes());
                rec.extend_from_slice(bytemuck::cast_slice(row));
                rec.extend_from_slice(&feats[j * row_bytes..(j + 1) * row_bytes]);
            }
        }
        for (from, records) in ex.all(STAGE_ROWS, round as u32, out)?.iter().enumerate() {
            rows.take(records)
                .map_err(|problem| record_error(from, "rows", problem))?;
        }
    }
    let rows = rows.finish()?;

    let mut splits: [Vec<u32>; 3] = Default::default();
    for (s, split) in Split::ALL.into_iter().enumerate() {
        let chunks = &m.tensors.split(split).chunks;
        for round in 0..chunks.len().div_ceil(k) {
            let j = round * k + me;
            let mut out = vec![Vec::new(); k];
            if j < chunks.len() {
                for v in ds.read_split_chunk(split, j)? {
                    out[p.parts[v as usize] as usize].extend_from_slice(&(v as u32).to_le_bytes());
                }
            }
            for (from, ids) in ex
                .all(STAGE_SPLIT[s], round as u32, out)?
                .iter()
                .enumerate()
            {
                for v in
                    u32s(ids).map_err(|problem| record_error(from, split.tensor_name(), problem))?
                {
                    let local = owned.binary_search(&v).map_err(|_| {
                        record_error(
                            from,
                            split.tensor_name(),
                            format!("node {v} is not this part's"),
                        )
                    })?;
                    splits[s].push(local as u32);
                }
            }
        }
        splits[s].sort_unstable();
    }

    // the halo: (owner, id) of every foreign in-neighbour, in the order of the ordering contract
    let n_owned = owned.len();
    let mut halo_keys: Vec<(u32, u32)> = rows
        .indices
        .iter()
        .map(|&u| (p.parts[u as usize], u as u32))
        .filter(|&(q, _)| q != me32)
        .collect();
    halo_keys.sort_unstable();
    halo_keys.dedup();
    let mut indices = rows.indices;
    for w in rows.indptr.windows(2) {
        let row = &mut indices[w[0] as usize..w[1] as usize];
        for u in row.iter_mut() {
            let owner = p.parts[*u as usize];
            *u = if owner == me32 {
                owned
                    .binary_search(&(*u as u32))
                    .expect("an owned row's id is in owned") as i32
            } else {
                let j = halo_keys
                    .binary_search(&(owner, *u as u32))
                    .expect("every foreign in-neighbour was collected into the halo");
                (n_owned + j) as i32
            };
        }
        row.sort_unstable();
    }
    let recv = crate::partition::recv_ranges(&halo_keys);
    let halo: Vec<u32> = halo_keys.iter().map(|&(_, u)| u).collect();

    // each owner learns which of its rows this worker reads (its send list) and answers their degrees
    let mut asks = vec![Vec::new(); k];
    for (q, r) in &recv {
        asks[*q as usize] = bytemuck::cast_slice(&halo[r.clone()]).to_vec();
    }
    let own_degree: Vec<u32> = rows
        .indptr
        .windows(2)
        .map(|w| (w[1] - w[0]) as u32)
        .collect();
    let mut send: Vec<(u32, Vec<u32>)> = Vec::new();
    let mut answers = vec![Vec::new(); k];
    for (from, ids) in ex.all(STAGE_HALO, 0, asks)?.iter().enumerate() {
        if from == me || ids.is_empty() {
            continue;
        }
        let mut local = Vec::new();
        for v in u32s(ids).map_err(|problem| record_error(from, "halo request", problem))? {
            let l = owned.binary_search(&v).map_err(|_| {
                record_error(from, "halo request", format!("node {v} is not this part's"))
            })?;
            local.push(l as u32);
            answers[from].extend_from_slice(&own_degree[l].to_le_bytes());
        }
        send.push((from as u32, local));
    }
    let mut src_in_degree = own_degree;
    let replies = ex.all(STAGE_DEGREES, 0, answers)?;
    for (q, r) in &recv {
        let degrees = u32s(&replies[*q as usize])
            .map_err(|problem| record_error(*q as usize, "degrees", problem))?;
        if degrees.len() != r.len() {
            return Err(record_error(
                *q as usize,
                "degrees",
                format!("{} degrees for {} halo rows", degrees.len(), r.len()),
            ));
        }
        src_in_degree.extend(degrees);
    }

    let [train, val, test] = splits;
    Ok((
        Part {
            part: me,
            k,
            owned,
            halo,
            indptr: rows.indptr,
            indices,
            src_in_degree,
            recv,
            send,
            labels: rows.labels,
            train,
            val,
            test,
            features: rows.features,
            feat_dim: m.feat_dim,
            num_classes: m.num_classes,
            num_nodes_global: n,
            num_train_global: m.splits.train,
        },
        stats,
    ))
}

/// The chunk files worker `me` of `k` reads in [`shuffle_part`]: node chunks `me, me + k, me + 2k, ...`
/// of every node tensor, and the split lists' chunks alike. Every chunk file is some worker's, once.
pub fn chunks_read_by(m: &Manifest, me: usize, k: usize) -> Vec<&ChunkEntry> {
    let t = &m.tensors;
    let mut out = Vec::new();
    for i in (me..m.num_chunks()).step_by(k.max(1)) {
        for tensor in [&t.indptr, &t.indices, &t.features, &t.labels] {
            out.push(&tensor.chunks[i]);
        }
    }
    for s in Split::ALL {
        let chunks = &t.split(s).chunks;
        out.extend((me..chunks.len()).step_by(k.max(1)).map(|j| &chunks[j]));
    }
    out
}

/// The [`Shuffle`] with the bytes moved counted.
struct Exchange<'a> {
    shuffle: &'a mut dyn Shuffle,
    stats: &'a mut ShuffleStats,
}

impl Exchange<'_> {
    fn all(&mut self, stage: u16, round: u32, out: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, Error> {
        let me = self.shuffle.me();
        let sent: usize = out
            .iter()
            .enumerate()
            .filter(|(q, _)| *q != me)
            .map(|(_, b)| b.len())
            .sum();
        let got = self.shuffle.all_to_all(stage, round, out)?;
        if got.len() != self.shuffle.k() {
            return Err(Error::partition(format!(
                "the shuffle returned {} workers' records for {} workers",
                got.len(),
                self.shuffle.k()
            )));
        }
        self.stats.sent_bytes += sent as u64;
        self.stats.received_bytes += got
            .iter()
            .enumerate()
            .filter(|(q, _)| *q != me)
            .map(|(_, b)| b.len() as u64)
            .sum::<u64>();
        Ok(got)
    }
}

fn record_error(from: usize, what: &str, problem: impl std::fmt::Display) -> Error {
    Error::partition(format!(
        "cutting the part by shuffle: the {what} records from worker {from}: {problem}"
    ))
}

fn u32s(bytes: &[u8]) -> Result<Vec<u32>, String> {
    if !bytes.len().is_multiple_of(4) {
        return Err(format!(
            "{} bytes is not a whole number of ids",
            bytes.len()
        ));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn feature_bytes(f: &Features) -> &[u8] {
    match f {
        Features::F32(v) => bytemuck::cast_slice(v),
        Features::F16(v) => bytemuck::cast_slice(v),
        Features::BF16(v) => bytemuck::cast_slice(v),
    }
}

fn feature_bytes_mut(f: &mut Features) -> &mut [u8] {
    match f {
        Features::F32(v) => bytemuck::cast_slice_mut(v),
        Features::F16(v) => bytemuck::cast_slice_mut(v),
        Features::BF16(v) => bytemuck::cast_slice_mut(v),
    }
}

/// The owned rows as they arrive, in any order: each placed at its local index.
struct OwnedRows<'a> {
    owned: &'a [u32],
    num_nodes: usize,
    /// Each owned row's neighbours (global ids), once it arrived.
    rows: Vec<Option<Box<[i32]>>>,
    labels: Vec<i64>,
    features: Features,
    row_bytes: usize,
}

/// The owned rows, complete: the local CSR still in global ids.
struct Rows {
    indptr: Vec<i64>,
    indices: Vec<i32>,
    labels: Vec<i64>,
    features: Features,
}

impl<'a> OwnedRows<'a> {
    fn new(owned: &'a [u32], num_nodes: usize, feat_dim: usize, dtype: FeatureDtype) -> Self {
        let len = owned.len() * feat_dim;
        let features = match dtype {
            FeatureDtype::F32 => Features::F32(vec![0.0; len]),
            FeatureDtype::F16 => Features::F16(vec![half::f16::ZERO; len]),
            FeatureDtype::BF16 => Features::BF16(vec![half::bf16::ZERO; len]),
        };
        let row_bytes = feature_bytes(&features).len() / owned.len().max(1);
        OwnedRows {
            owned,
            num_nodes,
            rows: vec![None; owned.len()],
            labels: vec![-1; owned.len()],
            features,
            row_bytes,
        }
    }

    /// Places every record of `bytes`: `[id u32, len u32, label i64, len x i32, the feature row]`.
    fn take(&mut self, mut bytes: &[u8]) -> Result<(), String> {
        let feats = feature_bytes_mut(&mut self.features);
        while !bytes.is_empty() {
            let head = bytes
                .get(..16)
                .ok_or_else(|| format!("a record cut short after {} bytes", bytes.len()))?;
            let v = u32::from_le_bytes(head[0..4].try_into().expect("4 bytes"));
            let len = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes")) as usize;
            let label = i64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
            let body = 16 + len * 4 + self.row_bytes;
            let rec = bytes
                .get(..body)
                .ok_or_else(|| format!("the record of node {v} is cut short"))?;
            let local = self
                .owned
                .binary_search(&v)
                .map_err(|_| format!("node {v} is not this part's"))?;
            let slot = &mut self.rows[local];
            if slot.is_some() {
                return Err(format!("node {v} arrived twice"));
            }
            let row: Vec<i32> = rec[16..16 + len * 4]
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if let Some(u) = row.iter().find(|&&u| u < 0 || u as usize >= self.num_nodes) {
                return Err(format!(
                    "node {v} lists neighbour {u}, outside 0..{}",
                    self.num_nodes
                ));
            }
            *slot = Some(row.into_boxed_slice());
            self.labels[local] = label;
            feats[local * self.row_bytes..(local + 1) * self.row_bytes]
                .copy_from_slice(&rec[16 + len * 4..]);
            bytes = &bytes[body..];
        }
        Ok(())
    }

    fn finish(self) -> Result<Rows, Error> {
        let missing = self.rows.iter().filter(|r| r.is_none()).count();
        if let Some(at) = self.rows.iter().position(|r| r.is_none()) {
            return Err(Error::partition(format!(
                "cutting the part by shuffle: {missing} of its {} rows never arrived (the first: node {})",
                self.owned.len(),
                self.owned[at]
            )));
        }
        let total: usize = self.rows.iter().flatten().map(|r| r.len()).sum();
        let mut indptr = Vec::with_capacity(self.owned.len() + 1);
        let mut indices = Vec::with_capacity(total);
        indptr.push(0);
        for row in self.rows.into_iter().flatten() {
            indices.extend_from_slice(&row);
            indptr.push(indices.len() as i64);
        }
        Ok(Rows {
            indptr,
            indices,
            labels: self.labels,
            features: self.features,
        })
    }
}
