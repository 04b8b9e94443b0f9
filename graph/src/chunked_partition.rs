//! Partitioning a chunked dataset ([`crate::chunked`]) without loading it: the streaming partitioner over
//! its rows, then the per-worker parts built one at a time from chunk reads, stored as the usual
//! partition set (`X/parts/k<K>-seed<S>/` inside the dataset's directory, see
//! [`crate::partition::partitions_dir`]).
//!
//! Memory: the assignment and two more per-node arrays (local ids, in-degrees: 12 bytes per node), the
//! split lists, and one part at a time (its rows, halo and features, about `1/k` of the dataset plus its
//! halo). Each part costs one streaming pass over the edge chunks and one over the feature chunks that
//! hold its rows. The parts equal what [`crate::partition::build_parts`] cuts from the loaded dataset.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::chunked::ChunkedDataset;
use crate::error::Error;
use crate::format::{Features, Split};
use crate::partition::{
    PARTITION_FILE, Part, PartitionMeta, Partitioning, SetTiming, load_assignment, part_files,
    part_summary, partition_set_dir, write_part, write_partition_file,
};
use crate::stream::{StreamOutcome, StreamParams, partition_stream_rows, streamed_cut};

/// Streams the dataset's rows through the partitioner ([`partition_stream_rows`]): the same assignment
/// as [`crate::stream::partition_stream`] on the loaded graph, reading two edge chunks at a time.
pub fn partition_chunked(
    ds: &ChunkedDataset,
    params: &StreamParams,
) -> Result<StreamOutcome, Error> {
    partition_stream_rows(ds, params)
}

/// What building every part needs, computed once: O(n) arrays, never the graph.
pub struct PartContext<'a> {
    ds: &'a ChunkedDataset,
    p: &'a Partitioning,
    /// Node -> its index among its part's nodes (owned rows are ascending by id).
    local_of: Vec<u32>,
    degrees: Vec<u32>,
    splits: [Vec<i64>; 3],
}

impl<'a> PartContext<'a> {
    /// Reads the in-degrees and splits; checks the assignment against the dataset.
    pub fn new(ds: &'a ChunkedDataset, p: &'a Partitioning) -> Result<Self, Error> {
        let n = ds.num_nodes();
        if p.parts.len() != n {
            return Err(Error::partition(format!(
                "assigns {} nodes but {} has {n}",
                p.parts.len(),
                ds.dir().display()
            )));
        }
        if let Some((v, q)) = p
            .parts
            .iter()
            .enumerate()
            .find(|(_, q)| **q as usize >= p.k)
        {
            return Err(Error::partition(format!(
                "node {v} is assigned to part {q}, outside 0..{}",
                p.k
            )));
        }
        let mut next = vec![0u32; p.k];
        let local_of = p
            .parts
            .iter()
            .map(|&q| {
                next[q as usize] += 1;
                next[q as usize] - 1
            })
            .collect();
        let splits = [
            ds.read_split(Split::Train)?,
            ds.read_split(Split::Val)?,
            ds.read_split(Split::Test)?,
        ];
        Ok(PartContext {
            ds,
            p,
            local_of,
            degrees: ds.degrees()?,
            splits,
        })
    }

    /// Part `me`, equal to `build_parts(loaded dataset, p)[me]`.
    pub fn build(&self, me: usize) -> Result<Part, Error> {
        let parts = &self.p.parts;
        let me32 = me as u32;
        let scan = self.scan_edges(me32)?;
        let n_owned = scan.owned.len();
        let mut indices = Vec::with_capacity(scan.rows.len());
        for w in scan.indptr.windows(2) {
            let start = indices.len();
            for &u in &scan.rows[w[0] as usize..w[1] as usize] {
                let owner = parts[u as usize];
                let local = if owner == me32 {
                    self.local_of[u as usize] as usize
                } else {
                    let j = scan
                        .halo_keys
                        .binary_search(&(owner, u as u32))
                        .expect("every foreign in-neighbour was collected into the halo");
                    n_owned + j
                };
                indices.push(local as i32);
            }
            indices[start..].sort_unstable();
        }
        let recv = crate::partition::recv_ranges(&scan.halo_keys);
        let mut send: Vec<(u32, Vec<u32>)> = Vec::new();
        for &(peer, u) in &scan.send_keys {
            let row = self.local_of[u as usize];
            match send.last_mut() {
                Some((q, rows)) if *q == peer => rows.push(row),
                _ => send.push((peer, vec![row])),
            }
        }
        let halo: Vec<u32> = scan.halo_keys.iter().map(|&(_, u)| u).collect();
        let src_in_degree = scan
            .owned
            .iter()
            .chain(&halo)
            .map(|&u| self.degrees[u as usize])
            .collect();
        let [train, val, test] = [0, 1, 2].map(|s| self.local_split(s, me32));
        let (features, labels) = self.gather_nodes(&scan.owned)?;
        let m = self.ds.manifest();
        Ok(Part {
            part: me,
            k: self.p.k,
            owned: scan.owned,
            halo,
            indptr: scan.indptr,
            indices,
            src_in_degree,
            recv,
            send,
            labels,
            train,
            val,
            test,
            features,
            feat_dim: m.feat_dim,
            num_classes: m.num_classes,
            num_nodes_global: m.num_nodes,
            num_train_global: self.splits[0].len(),
        })
    }

    fn local_split(&self, s: usize, me: u32) -> Vec<u32> {
        let mut local: Vec<u32> = self.splits[s]
            .iter()
            .filter(|&&v| self.p.parts[v as usize] == me)
            .map(|&v| self.local_of[v as usize])
            .collect();
        local.sort_unstable();
        local
    }

    /// One pass over the edge chunks: part `me`'s rows (global ids), its halo keys, and which of its
    /// nodes each peer's rows read (the send lists).
    fn scan_edges(&self, me: u32) -> Result<EdgeScan, Error> {
        let parts = &self.p.parts;
        let mut s = EdgeScan {
            owned: Vec::new(),
            indptr: vec![0],
            rows: Vec::new(),
            halo_keys: Vec::new(),
            send_keys: Vec::new(),
        };
        self.ds.for_each_row(|v, row| {
            let owner = parts[v];
            if owner == me {
                s.owned.push(v as u32);
                s.rows.extend_from_slice(row);
                s.indptr.push(s.rows.len() as i64);
                for &u in row {
                    let q = parts[u as usize];
                    if q != me {
                        s.halo_keys.push((q, u as u32));
                    }
                }
            } else {
                for &u in row {
                    if parts[u as usize] == me {
                        s.send_keys.push((owner, u as u32));
                    }
                }
            }
        })?;
        // (owner, global id) sorts into the halo order of the ordering contract; (peer, id) into the
        // order each peer stores our rows in its halo.
        s.halo_keys.sort_unstable();
        s.halo_keys.dedup();
        s.send_keys.sort_unstable();
        s.send_keys.dedup();
        Ok(s)
    }

    /// Features and labels of `owned` (ascending), reading only the chunks that hold some of them.
    fn gather_nodes(&self, owned: &[u32]) -> Result<(Features, Vec<i64>), Error> {
        let m = self.ds.manifest();
        let f = m.feat_dim;
        let mut feats = Features::F32(Vec::new()).convert(m.feature_dtype);
        reserve(&mut feats, owned.len() * f);
        let mut labels = Vec::with_capacity(owned.len());
        let mut at = 0;
        for i in 0..m.num_chunks() {
            let r = self.ds.chunk_range(i);
            let end = at + owned[at..].partition_point(|&v| (v as usize) < r.end);
            if end == at {
                continue;
            }
            let (chunk_feats, chunk_labels) = self.ds.read_chunk_nodes(i)?;
            for &v in &owned[at..end] {
                let j = v as usize - r.start;
                labels.push(chunk_labels[j]);
                extend_row(&mut feats, &chunk_feats, j * f..(j + 1) * f);
            }
            at = end;
        }
        Ok((feats, labels))
    }
}

struct EdgeScan {
    owned: Vec<u32>,
    /// Local offsets into `rows`.
    indptr: Vec<i64>,
    /// The owned rows, global ids.
    rows: Vec<i32>,
    halo_keys: Vec<(u32, u32)>,
    send_keys: Vec<(u32, u32)>,
}

fn reserve(f: &mut Features, n: usize) {
    match f {
        Features::F32(v) => v.reserve_exact(n),
        Features::F16(v) => v.reserve_exact(n),
        Features::BF16(v) => v.reserve_exact(n),
    }
}

fn extend_row(out: &mut Features, src: &Features, r: Range<usize>) {
    match (out, src) {
        (Features::F32(o), Features::F32(s)) => o.extend_from_slice(&s[r]),
        (Features::F16(o), Features::F16(s)) => o.extend_from_slice(&s[r]),
        (Features::BF16(o), Features::BF16(s)) => o.extend_from_slice(&s[r]),
        _ => unreachable!("a chunk's features have the manifest's dtype (checked on read)"),
    }
}

/// Computes and stores the partition set `dir` for a chunked dataset: the streamed assignment, then each
/// part built and written in turn, then `partition.safetensors` (the commit marker).
pub(crate) fn compute_set_chunked(
    ds: &ChunkedDataset,
    dir: &Path,
    k: usize,
    seed: u64,
    params: &StreamParams,
) -> Result<PartitionMeta, Error> {
    let t0 = Instant::now();
    let read_before = ds.bytes_read();
    let params = StreamParams {
        k,
        seed,
        ..params.clone()
    };
    let p = partition_chunked(ds, &params)?.partitioning;
    let partition_seconds = t0.elapsed().as_secs_f64();
    let ctx = PartContext::new(ds, &p)?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut summaries = Vec::with_capacity(k);
    for (me, path) in part_files(dir, k).iter().enumerate() {
        let part = ctx.build(me)?;
        summaries.push(write_part(&part, path)?);
    }
    drop(ctx);
    let (_, total) = streamed_cut(ds, &p.parts)?;
    let checksums = BTreeMap::from([("manifest".to_string(), ds.manifest().fingerprint())]);
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
            bytes_read: Some(ds.bytes_read() - read_before),
        },
    )
}

/// The folder of a set's pending assignment, inside the set's folder.
const PENDING_DIR: &str = "pending";

/// A chunked dataset's partition set whose assignment is stored and whose parts are still to be cut:
/// each by the worker that trains on it ([`cut_part`]), in parallel and reading the dataset in place, so
/// that the process that partitioned holds the assignment (4 bytes a node), never a part. The set's
/// commit marker is written by [`PendingSet::commit`] once every part file is there; until then the set
/// is missing to every reader (`ensure_partitions` computes it again).
#[derive(Clone, Debug)]
pub struct PendingSet {
    /// The set's folder (`X/parts/k<K>-seed<S>`).
    pub dir: PathBuf,
    pub k: usize,
    /// The assignment: `pending/partition.safetensors` in `dir`, describing no parts.
    pub assignment: PathBuf,
    /// Where each part is to be written (`part<P>.safetensors` in `dir`).
    pub part_files: Vec<PathBuf>,
    /// Whether the assignment is an earlier launch's, kept ([`begin_set_chunked`]).
    pub resumed: bool,
    dataset: PathBuf,
    started: Instant,
    started_at: std::time::SystemTime,
    partition_seconds: f64,
}

/// Streams the chunked dataset at `dataset_dir` into `k` parts ([`partition_chunked`]) and stores the
/// assignment in the set's `pending/` folder; any commit marker of an earlier set of the same name is
/// removed first, so no reader pairs it with the parts about to be cut. A pending assignment already
/// there for the same dataset version, seed and method (a launch whose workers failed before the set
/// was committed) is taken as it is: a retried launch neither partitions again nor rewrites it, and
/// the parts its workers wrote are kept ([`cut_part`], [`crate::chunked_shuffle::cut_part_shuffled`]).
pub fn begin_set_chunked(
    dataset_dir: &Path,
    k: usize,
    seed: u64,
    params: &StreamParams,
) -> Result<PendingSet, Error> {
    let ds = ChunkedDataset::open(dataset_dir)?;
    let params = StreamParams {
        k,
        seed,
        ..params.clone()
    };
    let dir = partition_set_dir(dataset_dir, k, seed);
    let pending = dir.join(PENDING_DIR);
    let assignment = pending.join(PARTITION_FILE);
    let fingerprint = ds.manifest().fingerprint();
    if let Some(set) = resume_pending(&assignment, &fingerprint, &params, &dir, dataset_dir) {
        return Ok(set);
    }
    let started = Instant::now();
    let started_at = std::time::SystemTime::now();
    let p = partition_chunked(&ds, &params)?.partitioning;
    let partition_seconds = started.elapsed().as_secs_f64();
    std::fs::create_dir_all(&pending).map_err(|e| Error::io(&pending, e))?;
    let marker = dir.join(PARTITION_FILE);
    match std::fs::remove_file(&marker) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(&marker, e)),
    }
    // parts of an earlier assignment must not pass for this one's
    for f in part_files(&dir, k) {
        match std::fs::remove_file(&f) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&f, e)),
        }
    }
    let checksums = BTreeMap::from([("manifest".to_string(), fingerprint)]);
    write_partition_file(
        &pending,
        &p,
        0,
        Vec::new(),
        checksums,
        SetTiming {
            started,
            partition_seconds,
            compute_seconds: None,
            // the assignment's passes over the edges: the workers' reads are added at the commit
            bytes_read: Some(ds.bytes_read()),
        },
    )?;
    Ok(PendingSet {
        assignment,
        part_files: part_files(&dir, k),
        dir,
        k,
        resumed: false,
        dataset: dataset_dir.to_path_buf(),
        started,
        started_at,
        partition_seconds,
    })
}

/// The pending set whose assignment is stored at `assignment`, if it was made for this dataset version
/// (`fingerprint`), seed, number of parts and method; its start is when the assignment began.
fn resume_pending(
    assignment: &Path,
    fingerprint: &str,
    params: &StreamParams,
    dir: &Path,
    dataset_dir: &Path,
) -> Option<PendingSet> {
    let (meta, _) = load_assignment(assignment).ok()?;
    let same = meta.dataset_checksums.get("manifest").map(String::as_str) == Some(fingerprint)
        && meta.k == params.k
        && meta.seed == params.seed
        && meta.method == params.method();
    if !same {
        return None;
    }
    let partition_seconds = meta.partition_seconds.unwrap_or(0.0);
    let written = std::fs::metadata(assignment)
        .and_then(|m| m.modified())
        .ok()?;
    let started_at = written - std::time::Duration::from_secs_f64(partition_seconds);
    let ago = std::time::SystemTime::now()
        .duration_since(started_at)
        .unwrap_or_default();
    Some(PendingSet {
        assignment: assignment.to_path_buf(),
        part_files: part_files(dir, params.k),
        dir: dir.to_path_buf(),
        k: params.k,
        resumed: true,
        dataset: dataset_dir.to_path_buf(),
        started: Instant::now().checked_sub(ago).unwrap_or_else(Instant::now),
        started_at,
        partition_seconds,
    })
}

/// Whether the part file at `out` is already `part`, cut from this pending assignment by an earlier try:
/// then it is not written again.
pub(crate) fn already_written(part: &Part, out: &Path) -> bool {
    Part::load(out).is_ok_and(|old| old == *part)
}

/// Cuts part `me` of the pending assignment at `assignment` from the chunked dataset at `dataset_dir`
/// (one pass over the edge chunks, the feature chunks holding its rows) and writes it to `out` (by
/// rename: never half-written). Returns the part, equal to what [`PartContext::build`] cuts in one
/// process. Refuses an assignment made for another version of the dataset.
pub fn cut_part(
    dataset_dir: &Path,
    assignment: &Path,
    me: usize,
    out: &Path,
) -> Result<Part, Error> {
    let (ds, p) = open_pending(dataset_dir, assignment)?;
    if me >= p.k {
        return Err(Error::partition(format!(
            "part {me} of an assignment into {} parts",
            p.k
        )));
    }
    let part = PartContext::new(&ds, &p)?.build(me)?;
    if !already_written(&part, out) {
        write_part(&part, out)?;
    }
    Ok(part)
}

/// The chunked dataset at `dataset_dir` and the pending assignment at `assignment`, which must have been
/// made for this version of it.
pub(crate) fn open_pending(
    dataset_dir: &Path,
    assignment: &Path,
) -> Result<(ChunkedDataset, Partitioning), Error> {
    let ds = ChunkedDataset::open(dataset_dir)?;
    let (meta, p) = load_assignment(assignment)?;
    let fingerprint = ds.manifest().fingerprint();
    if meta.dataset_checksums.get("manifest") != Some(&fingerprint) {
        return Err(Error::metadata(
            assignment,
            format!(
                "was made for another version of {} (its manifest's fingerprint differs)",
                dataset_dir.display()
            ),
        ));
    }
    Ok((ds, p))
}

impl PendingSet {
    /// Commits the set once every part file is written: reads each part's header (never its tensors),
    /// counts the cut edges in one streaming pass, writes `partition.safetensors` and removes the
    /// pending assignment. A part file that is missing or of another set is an error, and the set
    /// stays uncommitted.
    pub fn commit(&self) -> Result<PartitionMeta, Error> {
        let ds = ChunkedDataset::open(&self.dataset)?;
        let (meta, p) = load_assignment(&self.assignment)?;
        let summaries = self
            .part_files
            .iter()
            .enumerate()
            .map(|(i, f)| part_summary(f, i, self.k))
            .collect::<Result<Vec<_>, _>>()?;
        // from the assignment's start to the last part written (the commit may come much later)
        let mut cut_seconds = self.partition_seconds;
        for f in &self.part_files {
            let written = std::fs::metadata(f)
                .and_then(|m| m.modified())
                .map_err(|e| Error::io(f, e))?;
            if let Ok(d) = written.duration_since(self.started_at) {
                cut_seconds = cut_seconds.max(d.as_secs_f64());
            }
        }
        let (_, total) = streamed_cut(&ds, &p.parts)?;
        // the assignment's reads, this pass's, and the workers': together they read every chunk file
        // once (`chunked_shuffle::chunks_read_by`); one part cut alone reads the indptr chunks twice
        // (the rows, then the degrees)
        let m = ds.manifest();
        let indptr: u64 = m.tensors.indptr.chunks.iter().map(|c| c.bytes).sum();
        let workers = m.data_bytes() + if self.k == 1 { indptr } else { 0 };
        let bytes_read = meta.bytes_read.map(|b| b + ds.bytes_read() + workers);
        let meta = write_partition_file(
            &self.dir,
            &p,
            total,
            summaries,
            meta.dataset_checksums,
            SetTiming {
                started: self.started,
                partition_seconds: self.partition_seconds,
                compute_seconds: Some(cut_seconds),
                bytes_read,
            },
        )?;
        let pending = self.dir.join(PENDING_DIR);
        let _ = std::fs::remove_dir_all(&pending);
        Ok(meta)
    }
}
