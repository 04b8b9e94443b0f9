//! The chunked dataset layout, for graphs too large to hold (or to write) as one file: a directory with a
//! `manifest.json` and the tensors cut into chunk files by node range.
//!
//! ```text
//! <dir>/manifest.json              what follows, checksums included; written last (the commit point)
//! <dir>/data-<token>/indptr-000000.bin     rows [lo, hi): hi - lo + 1 global CSR offsets, i64
//! <dir>/data-<token>/indices-000000.bin    the entries of rows [lo, hi) (indptr[lo]..indptr[hi]), i32
//! <dir>/data-<token>/features-000000.bin   rows [lo, hi) x feat_dim, the feature dtype
//! <dir>/data-<token>/labels-000000.bin     rows [lo, hi), i64 (-1 = unlabelled)
//! <dir>/data-<token>/train_idx-000000.bin  entries [a, b) of the train split's node ids, i64 (val, test alike)
//! ```
//!
//! Every chunk file is raw little-endian data, no header; the manifest says for each chunk its file, its
//! row range (entry range for the split lists), for `indices` also its edge range, its size in bytes and
//! the xxh3-64 of its bytes (the checksum the single-file format uses). The four node tensors share the
//! same row ranges, so chunk `i` of each describes the same nodes. Row `v` of the CSR lists the
//! neighbours of `v` exactly as in the single file ([`crate::format`]): the in-neighbours, which for an
//! undirected dataset (both directions stored; the writer checks the symmetry) are all of them.
//!
//! [`ChunkedWriter`] streams: the caller appends node-range chunks in order and never hands over the whole
//! graph; chunk files are written and checksummed in parallel (rayon); the writer keeps one byte per node
//! (for the split checks). Chunk files go to a fresh `data-<token>` folder and the manifest is written to a
//! temporary name and renamed last, so a crash leaves the previous dataset (or none), never a half one;
//! after the rename the folders the old manifest used are removed.
//!
//! [`ChunkedDataset`] reads: [`ChunkedDataset::open`] parses and checks the manifest only, and every chunk
//! read checks the file's size and checksum (an error names the chunk file, expected and actual) and the
//! chunk's contents (ids in range, rows strictly ascending), so bad data is an error, never a panic later.
//! It can read one node range (what a worker needs), stream the rows in order (what the streaming
//! partitioner needs: [`crate::stream::partition_stream_rows`]), or load everything into an
//! [`OwnedDataset`] for graphs that fit.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::format::{FeatureDtype, Features, Metadata, OwnedDataset, Split, checksum};

/// The `format` field of every manifest.
pub const CHUNKED_FORMAT: &str = "physalia-chunked";
/// The manifest version this build writes and reads.
pub const CHUNKED_FORMAT_VERSION: u32 = 1;
/// The manifest's file name inside the dataset directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Rows per chunk unless the caller says otherwise: 64 Ki rows (32 MiB of 128-wide f32 features).
pub const DEFAULT_CHUNK_ROWS: usize = 1 << 16;

/// The node tensors, in chunk order within a node range.
pub const NODE_TENSORS: [&str; 4] = ["indptr", "indices", "features", "labels"];

/// One chunk file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkEntry {
    /// Path relative to the dataset directory.
    pub file: String,
    /// Node rows `[lo, hi)` (for a split list: its entries `[a, b)`).
    pub rows: [usize; 2],
    /// `indices` only: the chunk's positions `[indptr[lo], indptr[hi])` in the whole edge array.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edges: Option<[usize; 2]>,
    pub bytes: u64,
    /// xxh3-64 of the file's bytes, 16 lowercase hex digits.
    pub xxh3: String,
}

impl ChunkEntry {
    pub fn row_range(&self) -> Range<usize> {
        self.rows[0]..self.rows[1]
    }
}

/// One tensor's chunks, in order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorChunks {
    /// `i64`, `i32`, `f32`, `f16` or `bf16`.
    pub dtype: String,
    pub chunks: Vec<ChunkEntry>,
}

/// Every tensor of a chunked dataset.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ManifestTensors {
    pub indptr: TensorChunks,
    pub indices: TensorChunks,
    pub features: TensorChunks,
    pub labels: TensorChunks,
    pub train_idx: TensorChunks,
    pub val_idx: TensorChunks,
    pub test_idx: TensorChunks,
}

impl ManifestTensors {
    /// `(name, chunks)` in [`crate::TENSOR_NAMES`] order.
    pub fn all(&self) -> [(&'static str, &TensorChunks); 7] {
        [
            ("indptr", &self.indptr),
            ("indices", &self.indices),
            ("features", &self.features),
            ("labels", &self.labels),
            ("train_idx", &self.train_idx),
            ("val_idx", &self.val_idx),
            ("test_idx", &self.test_idx),
        ]
    }

    pub fn split(&self, s: Split) -> &TensorChunks {
        match s {
            Split::Train => &self.train_idx,
            Split::Val => &self.val_idx,
            Split::Test => &self.test_idx,
        }
    }
}

/// Sizes of the three splits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitSizes {
    pub train: usize,
    pub val: usize,
    pub test: usize,
}

/// `manifest.json`: everything about a chunked dataset except the data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`CHUNKED_FORMAT`].
    pub format: String,
    pub format_version: u32,
    pub name: String,
    /// Provenance, as in [`Metadata::source`].
    pub source: String,
    pub num_nodes: usize,
    /// Directed CSR entries (an undirected edge counts twice).
    pub num_edges: usize,
    pub feat_dim: usize,
    pub feature_dtype: FeatureDtype,
    pub num_classes: usize,
    /// `false`: both directions of every edge are stored (checked by the writer).
    pub directed: bool,
    /// The row count of every node chunk but the last (which may be shorter).
    pub chunk_rows: usize,
    pub splits: SplitSizes,
    pub tensors: ManifestTensors,
}

impl Manifest {
    /// Parses and checks a manifest read from elsewhere than a folder (a store's object); `origin`
    /// names it in errors.
    pub fn parse(origin: &Path, text: &str) -> Result<Manifest, Error> {
        parse_manifest(origin, text)
    }

    /// The single-file [`Metadata`] this dataset loads as (checksums empty: they describe a file).
    pub fn metadata(&self) -> Metadata {
        Metadata {
            format_version: crate::format::FORMAT_VERSION,
            name: self.name.clone(),
            num_nodes: self.num_nodes,
            num_edges: self.num_edges,
            feat_dim: self.feat_dim,
            num_classes: self.num_classes,
            feature_dtype: self.feature_dtype,
            directed: self.directed,
            source: self.source.clone(),
            checksums: BTreeMap::new(),
        }
    }

    /// Number of node chunks.
    pub fn num_chunks(&self) -> usize {
        self.tensors.indptr.chunks.len()
    }

    /// Total bytes of all chunk files.
    pub fn data_bytes(&self) -> u64 {
        self.tensors
            .all()
            .iter()
            .flat_map(|(_, t)| &t.chunks)
            .map(|c| c.bytes)
            .sum()
    }

    /// One hash over every chunk's checksum and the counts: changes whenever any byte of the data does.
    /// Partition sets record it to notice a changed dataset.
    pub fn fingerprint(&self) -> String {
        let json = serde_json::to_string(&(
            self.num_nodes,
            self.num_edges,
            self.feat_dim,
            self.feature_dtype,
            &self.tensors,
        ))
        .expect("manifest parts serialise: plain fields only");
        checksum(json.as_bytes())
    }
}

pub(crate) fn dtype_name(d: FeatureDtype) -> &'static str {
    match d {
        FeatureDtype::F32 => "f32",
        FeatureDtype::F16 => "f16",
        FeatureDtype::BF16 => "bf16",
    }
}

/// Whether `path` is a chunked dataset directory (holds a `manifest.json`).
pub fn is_chunked(path: &Path) -> bool {
    path.is_dir() && path.join(MANIFEST_FILE).is_file()
}

// ---------------------------------------------------------------------------------------------------
// Chunk files
// ---------------------------------------------------------------------------------------------------

/// Writes `bytes` to `path` (a fresh name inside a fresh folder) and returns its entry.
fn write_chunk_file(
    dir: &Path,
    file: String,
    rows: [usize; 2],
    edges: Option<[usize; 2]>,
    bytes: &[u8],
) -> Result<ChunkEntry, Error> {
    let path = dir.join(&file);
    let io = |e| Error::io(&path, e);
    let mut f = File::create(&path).map_err(io)?;
    f.write_all(bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    Ok(ChunkEntry {
        file,
        rows,
        edges,
        bytes: bytes.len() as u64,
        xxh3: checksum(bytes),
    })
}

/// Reads a chunk file into `out` (exactly `out`'s size), checking its size and checksum first.
fn read_chunk_into<T: bytemuck::Pod>(
    dir: &Path,
    tensor: &str,
    entry: &ChunkEntry,
    out: &mut [T],
) -> Result<(), Error> {
    let path = dir.join(&entry.file);
    let want = std::mem::size_of_val(out) as u64;
    if entry.bytes != want {
        return Err(Error::tensor(
            &path,
            tensor,
            format!(
                "the manifest says {} bytes, but rows {}..{} need {want}",
                entry.bytes, entry.rows[0], entry.rows[1]
            ),
        ));
    }
    let mut f = File::open(&path).map_err(|e| Error::io(&path, e))?;
    let len = f.metadata().map_err(|e| Error::io(&path, e))?.len();
    if len != want {
        return Err(Error::tensor(
            &path,
            tensor,
            format!(
                "chunk file has {len} bytes, the manifest says {want} (truncated or replaced?)"
            ),
        ));
    }
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
    f.read_exact(bytes).map_err(|e| Error::io(&path, e))?;
    let actual = checksum(bytes);
    if !entry.xxh3.eq_ignore_ascii_case(&actual) {
        return Err(Error::Checksum {
            path,
            tensor: tensor.to_string(),
            expected: entry.xxh3.clone(),
            actual,
        });
    }
    Ok(())
}

fn read_chunk<T: bytemuck::Pod>(
    dir: &Path,
    tensor: &str,
    entry: &ChunkEntry,
    len: usize,
) -> Result<Vec<T>, Error> {
    let mut v = vec![T::zeroed(); len];
    read_chunk_into(dir, tensor, entry, &mut v)?;
    Ok(v)
}

// ---------------------------------------------------------------------------------------------------
// Writer
// ---------------------------------------------------------------------------------------------------

/// What a chunked dataset is, fixed before the first chunk.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkedHeader {
    pub name: String,
    pub source: String,
    pub num_nodes: usize,
    pub feat_dim: usize,
    pub feature_dtype: FeatureDtype,
    /// `None`: the largest label + 1, known at [`ChunkedWriter::finish`].
    pub num_classes: Option<usize>,
    pub directed: bool,
}

/// The rows of one node range, in memory: what the writer takes and [`ChunkedDataset::read_rows`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeChunk {
    /// Local offsets: `rows + 1` entries starting at 0.
    pub indptr: Vec<i64>,
    /// Global node ids, each row strictly ascending.
    pub indices: Vec<i32>,
    /// `rows x feat_dim`, row-major.
    pub features: Features,
    pub labels: Vec<i64>,
}

impl NodeChunk {
    pub fn rows(&self) -> usize {
        self.indptr.len().saturating_sub(1)
    }

    /// Row `i` (local) of the CSR.
    pub fn neighbors(&self, i: usize) -> &[i32] {
        &self.indices[self.indptr[i] as usize..self.indptr[i + 1] as usize]
    }
}

/// Streams a chunked dataset to disk (see the module doc). Dropping it before [`ChunkedWriter::finish`]
/// removes the chunk files written so far.
pub struct ChunkedWriter {
    dir: PathBuf,
    /// `data-<token>`, relative to `dir`.
    data_name: String,
    header: ChunkedHeader,
    chunk_rows: usize,
    next_row: usize,
    next_edge: usize,
    node: [Vec<ChunkEntry>; 4],
    splits: [Vec<ChunkEntry>; 3],
    /// Per node: bit 0 labelled, bit `1 + s` in split `s`.
    flags: Vec<u8>,
    max_label: i64,
    /// Order-independent hashes of every entry and of its reverse: equal for a symmetric graph.
    sym: (u64, u64),
    finished: bool,
}

impl ChunkedWriter {
    /// Starts a dataset in `dir` (created if missing; an existing chunked dataset there stays readable
    /// until [`ChunkedWriter::finish`] replaces it). `chunk_rows` is the row count of every node chunk
    /// but the last: [`ChunkedWriter::append`] refuses chunks of another size.
    pub fn create(dir: &Path, header: ChunkedHeader, chunk_rows: usize) -> Result<Self, Error> {
        if chunk_rows == 0 {
            return Err(Error::param("chunk_rows", "must be at least 1"));
        }
        if header.num_nodes > i32::MAX as usize {
            return Err(Error::param(
                "num_nodes",
                format!("{} exceeds the i32 node id range", header.num_nodes),
            ));
        }
        if dir.exists() && !dir.is_dir() {
            return Err(Error::input(
                dir,
                "exists and is not a directory; a chunked dataset is a directory",
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let data = tempfile::Builder::new()
            .prefix("data-")
            .rand_bytes(8)
            .tempdir_in(dir)
            .map_err(|e| Error::io(dir, e))?
            .keep();
        let data_name = data
            .file_name()
            .expect("a temp dir has a name")
            .to_string_lossy()
            .into_owned();
        let n = header.num_nodes;
        Ok(ChunkedWriter {
            dir: dir.to_path_buf(),
            data_name,
            header,
            chunk_rows,
            next_row: 0,
            next_edge: 0,
            node: Default::default(),
            splits: Default::default(),
            flags: vec![0; n],
            max_label: -1,
            sym: (0, 0),
            finished: false,
        })
    }

    /// Rows appended so far.
    pub fn rows_written(&self) -> usize {
        self.next_row
    }

    pub fn chunk_rows(&self) -> usize {
        self.chunk_rows
    }

    /// Appends the next node ranges, in order: each chunk holds `chunk_rows` rows (the last one of the
    /// dataset may hold fewer). Checks every chunk, then writes and checksums all their files in parallel.
    pub fn append(&mut self, chunks: Vec<NodeChunk>) -> Result<(), Error> {
        let mut lo = self.next_row;
        let mut edge = self.next_edge;
        let mut plan = Vec::with_capacity(chunks.len());
        for c in &chunks {
            let rows = c.rows();
            self.check_chunk(lo, c)?;
            plan.push((lo, edge));
            lo += rows;
            edge += c.indices.len();
        }
        // The checks above are serial per chunk but parallel within; the symmetry hashes and flags below
        // are cheap.
        for (c, &(lo, _)) in chunks.iter().zip(&plan) {
            self.note_chunk(lo, c);
        }
        let dir = self.dir.join(&self.data_name);
        let index0 = self.node[0].len();
        let written: Vec<[ChunkEntry; 4]> = chunks
            .par_iter()
            .zip(&plan)
            .enumerate()
            .map(|(i, (c, &(lo, e0)))| write_node_chunk(&dir, index0 + i, lo, e0, c))
            .collect::<Result<_, Error>>()?;
        for entries in written {
            for (list, e) in self.node.iter_mut().zip(entries) {
                list.push(e);
            }
        }
        self.next_row = lo;
        self.next_edge = edge;
        Ok(())
    }

    fn check_chunk(&self, lo: usize, c: &NodeChunk) -> Result<(), Error> {
        let h = &self.header;
        let n = h.num_nodes;
        let rows = c.rows();
        let at = |tensor: &str, problem: String| {
            Error::tensor(&self.dir, tensor, format!("chunk at row {lo}: {problem}"))
        };
        if rows == 0 || lo + rows > n || (rows != self.chunk_rows && lo + rows != n) {
            return Err(at(
                "indptr",
                format!(
                    "holds {rows} rows; expected {} (or the remaining rows, {})",
                    self.chunk_rows,
                    n - lo.min(n)
                ),
            ));
        }
        check_local_csr(c, n).map_err(|p| at("indices", p))?;
        if c.features.dtype() != h.feature_dtype || c.features.len() != rows * h.feat_dim {
            return Err(at(
                "features",
                format!(
                    "holds {} {} values, expected rows x feat_dim = {} {}",
                    c.features.len(),
                    c.features.dtype(),
                    rows * h.feat_dim,
                    h.feature_dtype
                ),
            ));
        }
        if c.labels.len() != rows {
            return Err(at(
                "labels",
                format!("holds {} labels for {rows} rows", c.labels.len()),
            ));
        }
        let max = h.num_classes.map_or(i64::MAX, |k| k as i64);
        if let Some((i, l)) = c
            .labels
            .iter()
            .enumerate()
            .find(|(_, l)| **l < -1 || **l >= max)
        {
            return Err(at(
                "labels",
                format!("node {} has label {l}, outside -1..{max}", lo + i),
            ));
        }
        Ok(())
    }

    fn note_chunk(&mut self, lo: usize, c: &NodeChunk) {
        for (i, &l) in c.labels.iter().enumerate() {
            if l >= 0 {
                self.flags[lo + i] |= 1;
                self.max_label = self.max_label.max(l);
            }
        }
        let (a, b) = (0..c.rows())
            .into_par_iter()
            .with_min_len(1024)
            .map(|i| {
                let v = (lo + i) as u64;
                c.neighbors(i).iter().fold((0u64, 0u64), |(a, b), &u| {
                    let u = u as u64;
                    (
                        a.wrapping_add(pair_hash(u, v)),
                        b.wrapping_add(pair_hash(v, u)),
                    )
                })
            })
            .reduce(
                || (0, 0),
                |x, y| (x.0.wrapping_add(y.0), x.1.wrapping_add(y.1)),
            );
        self.sym = (self.sym.0.wrapping_add(a), self.sym.1.wrapping_add(b));
    }

    /// Appends node ids to a split list (after every node row: split nodes must carry a label). May be
    /// called several times per split; each call writes one chunk file.
    pub fn append_split(&mut self, split: Split, ids: &[i64]) -> Result<(), Error> {
        let tensor = split.tensor_name();
        let n = self.header.num_nodes;
        if self.next_row != n {
            return Err(Error::tensor(
                &self.dir,
                tensor,
                format!(
                    "appended after {} of {n} rows; splits come after every row",
                    self.next_row
                ),
            ));
        }
        let s = split as usize;
        let start: usize = self.splits[s].last().map_or(0, |e| e.rows[1]);
        let bit = 2u8 << s;
        for (i, &v) in ids.iter().enumerate() {
            let entry = start + i;
            if v < 0 || v as u64 >= n as u64 {
                return Err(Error::tensor(
                    &self.dir,
                    tensor,
                    format!("entry {entry} = {v} is out of range 0..{n}"),
                ));
            }
            let f = &mut self.flags[v as usize];
            if *f & 0b1110 != 0 {
                let other = Split::ALL
                    .iter()
                    .find(|o| *f & (2u8 << (**o as usize)) != 0)
                    .expect("a split bit is set")
                    .tensor_name();
                return Err(Error::tensor(
                    &self.dir,
                    tensor,
                    format!(
                        "node {v} (entry {entry}) is already in '{other}'; splits must not overlap or repeat"
                    ),
                ));
            }
            if *f & 1 == 0 {
                return Err(Error::tensor(
                    &self.dir,
                    tensor,
                    format!(
                        "node {v} (entry {entry}) is unlabelled (label -1); split nodes need a label"
                    ),
                ));
            }
            *f |= bit;
        }
        if ids.is_empty() {
            return Ok(());
        }
        let file = format!(
            "{}/{tensor}-{:06}.bin",
            self.data_name,
            self.splits[s].len()
        );
        let e = write_chunk_file(
            &self.dir,
            file,
            [start, start + ids.len()],
            None,
            bytemuck::cast_slice(ids),
        )?;
        self.splits[s].push(e);
        Ok(())
    }

    /// Checks that every row was written and the edges are symmetric if undirected, writes the manifest
    /// (temporary name, then rename) and removes the data folders of the dataset it replaced.
    pub fn finish(mut self) -> Result<Manifest, Error> {
        let h = &self.header;
        let n = h.num_nodes;
        if self.next_row != n {
            return Err(Error::tensor(
                &self.dir,
                "indptr",
                format!("only {} of {n} rows were written", self.next_row),
            ));
        }
        if !h.directed && self.sym.0 != self.sym.1 {
            return Err(Error::tensor(
                &self.dir,
                "indices",
                "the dataset is undirected but some edge is stored in one direction only",
            ));
        }
        let num_classes = h.num_classes.unwrap_or((self.max_label + 1) as usize);
        let split_len = |s: usize| self.splits[s].last().map_or(0, |e| e.rows[1]);
        let t = |dtype: &str, chunks: Vec<ChunkEntry>| TensorChunks {
            dtype: dtype.to_string(),
            chunks,
        };
        let [indptr, indices, features, labels] = std::mem::take(&mut self.node);
        let splits = SplitSizes {
            train: split_len(0),
            val: split_len(1),
            test: split_len(2),
        };
        let [train, val, test] = std::mem::take(&mut self.splits);
        let manifest = Manifest {
            format: CHUNKED_FORMAT.to_string(),
            format_version: CHUNKED_FORMAT_VERSION,
            name: h.name.clone(),
            source: h.source.clone(),
            num_nodes: n,
            num_edges: self.next_edge,
            feat_dim: h.feat_dim,
            feature_dtype: h.feature_dtype,
            num_classes,
            directed: h.directed,
            chunk_rows: self.chunk_rows,
            splits,
            tensors: ManifestTensors {
                indptr: t("i64", indptr),
                indices: t("i32", indices),
                features: t(dtype_name(h.feature_dtype), features),
                labels: t("i64", labels),
                train_idx: t("i64", train),
                val_idx: t("i64", val),
                test_idx: t("i64", test),
            },
        };
        check_manifest(&self.dir.join(MANIFEST_FILE), &manifest)?;
        let old = ChunkedDataset::open(&self.dir).ok();
        write_manifest(&self.dir, &manifest)?;
        self.finished = true;
        if let Some(old) = old {
            remove_old_data(&self.dir, &old.manifest, &self.data_name);
        }
        Ok(manifest)
    }
}

impl Drop for ChunkedWriter {
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_dir_all(self.dir.join(&self.data_name));
        }
    }
}

/// A hash of the ordered pair `(a, b)`; summed over all entries, and over all reversed entries, the two
/// sums agree for a symmetric edge set (and differ otherwise, but for a 2^-64 chance).
fn pair_hash(a: u64, b: u64) -> u64 {
    crate::rng::splitmix64(crate::rng::splitmix64(a) ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// A chunk's local CSR: offsets from 0, monotone, ending at the entry count; ids in `0..n`; rows strictly
/// ascending.
fn check_local_csr(c: &NodeChunk, n: usize) -> Result<(), String> {
    let ip = &c.indptr;
    if ip.first() != Some(&0) {
        return Err(format!(
            "local indptr starts at {:?}, expected 0",
            ip.first()
        ));
    }
    if let Some(i) = ip.windows(2).position(|w| w[1] < w[0]) {
        return Err(format!("local indptr decreases at entry {}", i + 1));
    }
    if *ip.last().expect("non-empty") != c.indices.len() as i64 {
        return Err(format!(
            "local indptr ends at {}, but the chunk holds {} entries",
            ip.last().expect("non-empty"),
            c.indices.len()
        ));
    }
    let bad = (0..c.rows())
        .into_par_iter()
        .with_min_len(1024)
        .find_map_first(|i| {
            let row = c.neighbors(i);
            for (j, &u) in row.iter().enumerate() {
                if u < 0 || u as usize >= n {
                    return Some(format!(
                        "row {i} of the chunk: id {u} is out of range 0..{n}"
                    ));
                }
                if j > 0 && row[j - 1] >= u {
                    return Some(format!(
                        "row {i} of the chunk is not strictly ascending ({u} after {})",
                        row[j - 1]
                    ));
                }
            }
            None
        });
    bad.map_or(Ok(()), Err)
}

/// One chunk file to write: tensor name, edge range (indices only), bytes.
type ChunkJob<'a> = (&'static str, Option<[usize; 2]>, &'a [u8]);

/// Writes the four files of node chunk `index` (rows from `lo`, edges from `e0`), in parallel.
fn write_node_chunk(
    data: &Path,
    index: usize,
    lo: usize,
    e0: usize,
    c: &NodeChunk,
) -> Result<[ChunkEntry; 4], Error> {
    let root = data
        .parent()
        .expect("the data folder is inside the dataset");
    let data_name = data
        .file_name()
        .expect("named")
        .to_string_lossy()
        .into_owned();
    let rows = [lo, lo + c.rows()];
    let e1 = e0 + c.indices.len();
    let global: Vec<i64> = c.indptr.iter().map(|&x| x + e0 as i64).collect();
    let feats = c.features.view();
    let jobs: [ChunkJob<'_>; 4] = [
        ("indptr", None, bytemuck::cast_slice(&global)),
        ("indices", Some([e0, e1]), bytemuck::cast_slice(&c.indices)),
        ("features", None, feats.as_bytes()),
        ("labels", None, bytemuck::cast_slice(&c.labels)),
    ];
    let out: Vec<ChunkEntry> = jobs
        .par_iter()
        .map(|(name, edges, bytes)| {
            let file = format!("{data_name}/{name}-{index:06}.bin");
            write_chunk_file(root, file, rows, *edges, bytes)
        })
        .collect::<Result<_, Error>>()?;
    Ok(out.try_into().expect("four jobs, four entries"))
}

fn write_manifest(dir: &Path, m: &Manifest) -> Result<(), Error> {
    let json = serde_json::to_vec_pretty(m).expect("Manifest serialises: plain fields only");
    let tmp = tempfile::Builder::new()
        .prefix(".manifest-")
        .tempfile_in(dir)
        .map_err(|e| Error::io(dir, e))?;
    let io = |e| Error::io(tmp.path(), e);
    tmp.as_file().write_all(&json).map_err(io)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o644)).map_err(io)?;
    }
    tmp.as_file().sync_all().map_err(io)?;
    let path = dir.join(MANIFEST_FILE);
    tmp.persist(&path).map_err(|e| Error::io(&path, e.error))?;
    // The rename is durable once the directory is synced.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Removes the data folders an old manifest referenced, except `keep`. Best effort: a leftover folder
/// wastes space but breaks nothing.
fn remove_old_data(dir: &Path, old: &Manifest, keep: &str) {
    let all = old.tensors.all();
    let mut folders: Vec<&str> = all
        .iter()
        .flat_map(|(_, t)| &t.chunks)
        .filter_map(|c| c.file.split_once('/').map(|(d, _)| d))
        .filter(|d| *d != keep && d.starts_with("data-"))
        .collect();
    folders.sort_unstable();
    folders.dedup();
    for f in folders {
        let _ = std::fs::remove_dir_all(dir.join(f));
    }
}

/// Writes a dataset held in memory in the chunked layout (validated first), `chunk_rows` rows per chunk.
pub fn write_chunked(ds: &OwnedDataset, dir: &Path, chunk_rows: usize) -> Result<Manifest, Error> {
    ds.validate()?;
    let m = &ds.meta;
    let header = ChunkedHeader {
        name: m.name.clone(),
        source: m.source.clone(),
        num_nodes: m.num_nodes,
        feat_dim: m.feat_dim,
        feature_dtype: m.feature_dtype,
        num_classes: Some(m.num_classes),
        directed: m.directed,
    };
    let mut w = ChunkedWriter::create(dir, header, chunk_rows)?;
    let n = m.num_nodes;
    let batch = rayon::current_num_threads().max(1);
    let mut lo = 0;
    while lo < n {
        let mut chunks = Vec::with_capacity(batch);
        while chunks.len() < batch && lo < n {
            let hi = (lo + chunk_rows).min(n);
            chunks.push(slice_rows(ds, lo..hi));
            lo = hi;
        }
        w.append(chunks)?;
    }
    for s in Split::ALL {
        for part in ds.split(s).chunks(chunk_rows.max(1)) {
            w.append_split(s, part)?;
        }
    }
    w.finish()
}

/// Rows `r` of an in-memory dataset as a [`NodeChunk`].
pub fn slice_rows(ds: &OwnedDataset, r: Range<usize>) -> NodeChunk {
    let (a, b) = (ds.indptr[r.start], ds.indptr[r.end]);
    let f = ds.meta.feat_dim;
    let fr = r.start * f..r.end * f;
    let features = match &ds.features {
        Features::F32(v) => Features::F32(v[fr].to_vec()),
        Features::F16(v) => Features::F16(v[fr].to_vec()),
        Features::BF16(v) => Features::BF16(v[fr].to_vec()),
    };
    NodeChunk {
        indptr: ds.indptr[r.start..=r.end].iter().map(|&x| x - a).collect(),
        indices: ds.indices[a as usize..b as usize].to_vec(),
        features,
        labels: ds.labels[r].to_vec(),
    }
}

// ---------------------------------------------------------------------------------------------------
// Reader
// ---------------------------------------------------------------------------------------------------

/// A chunked dataset whose manifest has been read and checked; chunks are read on demand.
#[derive(Clone, Debug)]
pub struct ChunkedDataset {
    dir: PathBuf,
    manifest: Manifest,
    /// Bytes of chunk files read through this handle and its clones.
    read: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl ChunkedDataset {
    /// Reads and checks `dir/manifest.json` (structure only: no chunk file is opened).
    pub fn open(dir: &Path) -> Result<Self, Error> {
        let path = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let manifest = parse_manifest(&path, &text)?;
        Ok(ChunkedDataset {
            dir: dir.to_path_buf(),
            manifest,
            read: Default::default(),
        })
    }

    /// Bytes of chunk files read so far through this handle and its clones (every read counts, a file
    /// read twice twice): what partitioning a chunked dataset records it read.
    pub fn bytes_read(&self) -> u64 {
        self.read.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// [`read_chunk`], counted in [`Self::bytes_read`].
    fn chunk<T: bytemuck::Pod>(
        &self,
        tensor: &str,
        entry: &ChunkEntry,
        len: usize,
    ) -> Result<Vec<T>, Error> {
        let v = read_chunk(&self.dir, tensor, entry, len)?;
        self.read
            .fetch_add(entry.bytes, std::sync::atomic::Ordering::Relaxed);
        Ok(v)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn num_nodes(&self) -> usize {
        self.manifest.num_nodes
    }

    /// Node rows of chunk `i`.
    pub fn chunk_range(&self, i: usize) -> Range<usize> {
        self.manifest.tensors.indptr.chunks[i].row_range()
    }

    /// The CSR rows of chunk `i` (local offsets from 0), checksums and contents checked.
    pub fn read_chunk_edges(&self, i: usize) -> Result<(Vec<i64>, Vec<i32>), Error> {
        let t = &self.manifest.tensors;
        let (pe, ie) = (&t.indptr.chunks[i], &t.indices.chunks[i]);
        let rows = pe.rows[1] - pe.rows[0];
        let mut indptr: Vec<i64> = self.chunk("indptr", pe, rows + 1)?;
        let [e0, e1] = ie.edges.expect("checked when the manifest was read");
        let path = self.dir.join(&pe.file);
        if indptr.first() != Some(&(e0 as i64)) || indptr.last() != Some(&(e1 as i64)) {
            return Err(Error::tensor(
                &path,
                "indptr",
                format!(
                    "runs from {:?} to {:?}, but the manifest places the chunk's edges at {e0}..{e1}",
                    indptr.first(),
                    indptr.last()
                ),
            ));
        }
        indptr.iter_mut().for_each(|x| *x -= e0 as i64);
        let indices: Vec<i32> = self.chunk("indices", ie, e1 - e0)?;
        let chunk = NodeChunk {
            indptr,
            indices,
            features: Features::F32(Vec::new()),
            labels: Vec::new(),
        };
        check_local_csr(&chunk, self.manifest.num_nodes)
            .map_err(|p| Error::tensor(self.dir.join(&ie.file), "indices", p))?;
        Ok((chunk.indptr, chunk.indices))
    }

    /// Every tensor of chunk `i`.
    pub fn read_chunk(&self, i: usize) -> Result<NodeChunk, Error> {
        let (indptr, indices) = self.read_chunk_edges(i)?;
        let (features, labels) = self.read_chunk_nodes(i)?;
        Ok(NodeChunk {
            indptr,
            indices,
            features,
            labels,
        })
    }

    /// The features and labels of chunk `i` (not its edges).
    pub fn read_chunk_nodes(&self, i: usize) -> Result<(Features, Vec<i64>), Error> {
        let m = &self.manifest;
        let fe = &m.tensors.features.chunks[i];
        let rows = fe.rows[1] - fe.rows[0];
        let len = rows * m.feat_dim;
        let features = match m.feature_dtype {
            FeatureDtype::F32 => Features::F32(self.chunk::<f32>("features", fe, len)?),
            FeatureDtype::F16 => Features::F16(self.chunk::<f16>("features", fe, len)?),
            FeatureDtype::BF16 => Features::BF16(self.chunk::<bf16>("features", fe, len)?),
        };
        let le = &m.tensors.labels.chunks[i];
        let labels: Vec<i64> = self.chunk("labels", le, rows)?;
        check_labels(&self.dir.join(&le.file), le.rows[0], &labels, m.num_classes)?;
        Ok((features, labels))
    }

    /// Rows `r` (any range inside `0..num_nodes`): the chunks that overlap it, read in parallel and cut.
    pub fn read_rows(&self, r: Range<usize>) -> Result<NodeChunk, Error> {
        let n = self.manifest.num_nodes;
        if r.start > r.end || r.end > n {
            return Err(Error::param(
                "rows",
                format!("{}..{} is not inside 0..{n}", r.start, r.end),
            ));
        }
        let chunks = &self.manifest.tensors.indptr.chunks;
        let first = chunks.partition_point(|c| c.rows[1] <= r.start);
        let last = chunks.partition_point(|c| c.rows[0] < r.end);
        let parts: Vec<(usize, NodeChunk)> = (first..last)
            .into_par_iter()
            .map(|i| -> Result<(usize, NodeChunk), Error> {
                Ok((chunks[i].rows[0], self.read_chunk(i)?))
            })
            .collect::<Result<_, Error>>()?;
        Ok(concat_cut(
            parts,
            r,
            self.manifest.feat_dim,
            self.manifest.feature_dtype,
        ))
    }

    /// Calls `f(v, neighbours of v)` for every node in ascending order, reading the edge chunks one
    /// after the other (the next one is read on a second thread while `f` works through the current
    /// one). Holds at most two chunks' edges; never reads the features.
    pub fn for_each_row(&self, mut f: impl FnMut(usize, &[i32])) -> Result<(), Error> {
        let n_chunks = self.manifest.num_chunks();
        std::thread::scope(|s| {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            s.spawn(move || {
                for i in 0..n_chunks {
                    let r = self.read_chunk_edges(i);
                    let stop = r.is_err();
                    if tx.send(r).is_err() || stop {
                        return;
                    }
                }
            });
            for i in 0..n_chunks {
                let (indptr, indices) = rx
                    .recv()
                    .expect("the reader sends every chunk or an error")?;
                let lo = self.chunk_range(i).start;
                for (j, w) in indptr.windows(2).enumerate() {
                    f(lo + j, &indices[w[0] as usize..w[1] as usize]);
                }
            }
            Ok(())
        })
    }

    /// Every node's row length (in-degree), read from the `indptr` chunks only.
    pub fn degrees(&self) -> Result<Vec<u32>, Error> {
        let mut out = Vec::with_capacity(self.manifest.num_nodes);
        for e in &self.manifest.tensors.indptr.chunks {
            let ip: Vec<i64> = self.chunk("indptr", e, e.rows[1] - e.rows[0] + 1)?;
            if let Some(i) = ip.windows(2).position(|w| w[1] < w[0]) {
                return Err(Error::tensor(
                    self.dir.join(&e.file),
                    "indptr",
                    format!("decreases at entry {}", i + 1),
                ));
            }
            out.extend(ip.windows(2).map(|w| (w[1] - w[0]) as u32));
        }
        Ok(out)
    }

    /// One split's node ids (range checked; overlap and labels are checked by [`ChunkedDataset::load`]).
    pub fn read_split(&self, s: Split) -> Result<Vec<i64>, Error> {
        let parts: Vec<Vec<i64>> = (0..self.manifest.tensors.split(s).chunks.len())
            .into_par_iter()
            .map(|j| self.read_split_chunk(s, j))
            .collect::<Result<_, Error>>()?;
        Ok(parts.concat())
    }

    /// Chunk `j` of one split's node ids (range checked).
    pub fn read_split_chunk(&self, s: Split, j: usize) -> Result<Vec<i64>, Error> {
        let e = &self.manifest.tensors.split(s).chunks[j];
        let n = self.manifest.num_nodes as i64;
        let v: Vec<i64> = self.chunk(s.tensor_name(), e, e.rows[1] - e.rows[0])?;
        if let Some((i, x)) = v.iter().enumerate().find(|(_, x)| **x < 0 || **x >= n) {
            return Err(Error::tensor(
                self.dir.join(&e.file),
                s.tensor_name(),
                format!("entry {} = {x} is out of range 0..{n}", e.rows[0] + i),
            ));
        }
        Ok(v)
    }

    /// Reads every chunk (in parallel, each checksum verified) into one in-memory dataset, validated as
    /// [`OwnedDataset::validate`] does: for graphs that fit, so every existing code path works on them.
    pub fn load(&self) -> Result<OwnedDataset, Error> {
        let m = &self.manifest;
        let all = self.read_rows(0..m.num_nodes)?;
        let [train_idx, val_idx, test_idx]: [Vec<i64>; 3] = Split::ALL
            .map(|s| self.read_split(s))
            .into_iter()
            .collect::<Result<Vec<_>, Error>>()?
            .try_into()
            .expect("three splits");
        let ds = OwnedDataset {
            meta: m.metadata(),
            indptr: all.indptr,
            indices: all.indices,
            features: all.features,
            labels: all.labels,
            train_idx,
            val_idx,
            test_idx,
        };
        ds.validate_at(&self.dir)?;
        Ok(ds)
    }

    /// Reads every chunk file and checks its size and checksum, in parallel, holding one chunk per
    /// thread: what `physalia data inspect` runs.
    pub fn verify(&self) -> Result<(), Error> {
        let tensors = self.manifest.tensors.all();
        let jobs: Vec<(&str, &ChunkEntry)> = tensors
            .iter()
            .flat_map(|(name, t)| t.chunks.iter().map(move |c| (*name, c)))
            .collect();
        jobs.par_iter().try_for_each(|(name, e)| {
            let mut buf = vec![0u8; e.bytes as usize];
            read_chunk_into(&self.dir, name, e, &mut buf)
        })
    }
}

impl crate::stream::RowSource for ChunkedDataset {
    fn num_nodes(&self) -> usize {
        self.manifest.num_nodes
    }
    fn num_edges(&self) -> usize {
        self.manifest.num_edges
    }
    fn symmetric(&self) -> bool {
        !self.manifest.directed
    }
    fn for_each_row(&self, f: &mut dyn FnMut(usize, &[i32])) -> Result<(), Error> {
        ChunkedDataset::for_each_row(self, f)
    }
}

fn check_labels(path: &Path, lo: usize, labels: &[i64], k: usize) -> Result<(), Error> {
    match labels.iter().position(|&l| l < -1 || l >= k as i64) {
        None => Ok(()),
        Some(i) => Err(Error::tensor(
            path,
            "labels",
            format!(
                "node {} has label {}, outside -1..{k} (-1 marks an unlabelled node)",
                lo + i,
                labels[i]
            ),
        )),
    }
}

/// Joins consecutive chunks (each with its first row) and cuts rows `r` out of them.
fn concat_cut(
    parts: Vec<(usize, NodeChunk)>,
    r: Range<usize>,
    f: usize,
    dtype: FeatureDtype,
) -> NodeChunk {
    let mut out = NodeChunk {
        indptr: vec![0],
        indices: Vec::new(),
        features: Features::F32(Vec::new()).convert(dtype),
        labels: Vec::with_capacity(r.len()),
    };
    let mut feats: Vec<Features> = Vec::with_capacity(parts.len());
    for (lo, c) in parts {
        let (a, b) = (r.start.max(lo) - lo, r.end.min(lo + c.rows()) - lo);
        let (ea, eb) = (c.indptr[a] as usize, c.indptr[b] as usize);
        let base = out.indices.len() as i64;
        out.indptr
            .extend(c.indptr[a + 1..=b].iter().map(|&x| x - ea as i64 + base));
        out.indices.extend_from_slice(&c.indices[ea..eb]);
        out.labels.extend_from_slice(&c.labels[a..b]);
        feats.push(slice_features(c.features, a * f..b * f));
    }
    out.features = concat_features(feats, dtype);
    out
}

fn slice_features(f: Features, r: Range<usize>) -> Features {
    let whole = r.start == 0 && r.end == f.len();
    match f {
        Features::F32(v) if whole => Features::F32(v),
        Features::F16(v) if whole => Features::F16(v),
        Features::BF16(v) if whole => Features::BF16(v),
        Features::F32(v) => Features::F32(v[r].to_vec()),
        Features::F16(v) => Features::F16(v[r].to_vec()),
        Features::BF16(v) => Features::BF16(v[r].to_vec()),
    }
}

fn concat_features(parts: Vec<Features>, dtype: FeatureDtype) -> Features {
    fn cat<T: Clone>(parts: Vec<Vec<T>>) -> Vec<T> {
        if parts.len() == 1 {
            return parts.into_iter().next().expect("one part");
        }
        parts.concat()
    }
    match dtype {
        FeatureDtype::F32 => Features::F32(cat(parts
            .into_iter()
            .filter_map(|p| match p {
                Features::F32(v) => Some(v),
                _ => None,
            })
            .collect())),
        FeatureDtype::F16 => Features::F16(cat(parts
            .into_iter()
            .filter_map(|p| match p {
                Features::F16(v) => Some(v),
                _ => None,
            })
            .collect())),
        FeatureDtype::BF16 => Features::BF16(cat(parts
            .into_iter()
            .filter_map(|p| match p {
                Features::BF16(v) => Some(v),
                _ => None,
            })
            .collect())),
    }
}

// ---------------------------------------------------------------------------------------------------
// Manifest checks
// ---------------------------------------------------------------------------------------------------

/// Parses the manifest text; a truncated file is reported with the field it ends in, a missing or
/// mistyped field by name, and then every structural rule is checked ([`check_manifest`]).
fn parse_manifest(path: &Path, text: &str) -> Result<Manifest, Error> {
    let value: serde_json::Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) if e.is_eof() => {
            let field = truncated_field(text);
            return Err(Error::metadata(
                path,
                format!(
                    "the manifest ends early (truncated?) inside field '{field}', after {} bytes: {e}",
                    text.len()
                ),
            ));
        }
        Err(e) => return Err(Error::metadata(path, format!("invalid JSON: {e}"))),
    };
    match value.get("format").and_then(|f| f.as_str()) {
        Some(CHUNKED_FORMAT) => {}
        other => {
            return Err(Error::metadata(
                path,
                format!("field 'format' is {other:?}, expected \"{CHUNKED_FORMAT}\""),
            ));
        }
    }
    match value.get("format_version").and_then(|v| v.as_u64()) {
        Some(v) if v == CHUNKED_FORMAT_VERSION as u64 => {}
        other => {
            return Err(Error::metadata(
                path,
                format!(
                    "field 'format_version' is {other:?}; this build reads version {CHUNKED_FORMAT_VERSION}"
                ),
            ));
        }
    }
    let m: Manifest = serde_json::from_value(value)
        .map_err(|e| Error::metadata(path, format!("invalid: {e}")))?;
    check_manifest(path, &m)?;
    Ok(m)
}

/// Where a truncated manifest stopped, as a field path (`tensors.features.chunks[3].bytes`) when the cut
/// falls inside the tensor lists, else the last key.
fn truncated_field(text: &str) -> String {
    let key = last_key(text).unwrap_or_else(|| "format".to_string());
    let tensor = crate::format::TENSOR_NAMES
        .iter()
        .filter_map(|t| text.rfind(&format!("\"{t}\":")).map(|at| (at, *t)))
        .max();
    let Some((at, t)) = tensor else {
        return key;
    };
    let chunks = text[at..].matches("\"file\":").count();
    match key.as_str() {
        k if k == t => format!("tensors.{t}"),
        "dtype" => format!("tensors.{t}.dtype"),
        "chunks" => format!("tensors.{t}.chunks"),
        _ if chunks > 0 => format!("tensors.{t}.chunks[{}].{key}", chunks - 1),
        _ => key,
    }
}

/// The last `"key":` in a JSON text: where a truncated manifest stopped.
fn last_key(text: &str) -> Option<String> {
    let b = text.as_bytes();
    let mut i = b.len();
    while i > 0 {
        i -= 1;
        if b[i] != b':' {
            continue;
        }
        let before = text[..i].trim_end();
        let Some(inner) = before.strip_suffix('"') else {
            continue;
        };
        let start = inner.rfind('"')?;
        let key = &inner[start + 1..];
        if !key.is_empty() && key.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_') {
            return Some(key.to_string());
        }
    }
    None
}

/// Structural rules of a manifest: counts fit, node chunks tile `0..num_nodes` with the same ranges in
/// every node tensor, `indices` chunks tile `0..num_edges`, split chunks tile their lists, sizes match,
/// file names stay inside the directory. Errors name the field.
fn check_manifest(path: &Path, m: &Manifest) -> Result<(), Error> {
    let bad = |field: String, problem: String| {
        Error::metadata(path, format!("field '{field}': {problem}"))
    };
    if m.num_nodes > i32::MAX as usize {
        return Err(bad(
            "num_nodes".into(),
            format!("{} exceeds the i32 id range", m.num_nodes),
        ));
    }
    if m.chunk_rows == 0 {
        return Err(bad("chunk_rows".into(), "must be at least 1".into()));
    }
    let t = &m.tensors;
    let want_dtypes = [
        ("indptr", "i64"),
        ("indices", "i32"),
        ("features", dtype_name(m.feature_dtype)),
        ("labels", "i64"),
        ("train_idx", "i64"),
        ("val_idx", "i64"),
        ("test_idx", "i64"),
    ];
    for ((name, tc), (_, want)) in t.all().iter().zip(want_dtypes) {
        if tc.dtype != want {
            return Err(bad(
                format!("tensors.{name}.dtype"),
                format!("is \"{}\", expected \"{want}\"", tc.dtype),
            ));
        }
        for (i, c) in tc.chunks.iter().enumerate() {
            let safe = !c.file.is_empty()
                && !c.file.starts_with('/')
                && c.file.split('/').all(|p| !p.is_empty() && p != "..");
            if !safe {
                return Err(bad(
                    format!("tensors.{name}.chunks[{i}].file"),
                    format!("\"{}\" is not a relative path inside the dataset", c.file),
                ));
            }
            if c.rows[0] > c.rows[1] {
                return Err(bad(
                    format!("tensors.{name}.chunks[{i}].rows"),
                    format!("{:?} is not a range", c.rows),
                ));
            }
        }
    }
    check_node_chunks(m).map_err(|(f, p)| bad(f, p))?;
    for s in Split::ALL {
        let want = match s {
            Split::Train => m.splits.train,
            Split::Val => m.splits.val,
            Split::Test => m.splits.test,
        };
        let name = s.tensor_name();
        let mut at = 0;
        for (i, c) in t.split(s).chunks.iter().enumerate() {
            if c.rows[0] != at || c.bytes != 8 * (c.rows[1] - c.rows[0]) as u64 {
                return Err(bad(
                    format!("tensors.{name}.chunks[{i}]"),
                    format!(
                        "rows {:?} and {} bytes do not continue at entry {at} with 8 bytes per entry",
                        c.rows, c.bytes
                    ),
                ));
            }
            at = c.rows[1];
        }
        if at != want {
            return Err(bad(
                format!("tensors.{name}.chunks"),
                format!("cover {at} entries, but field 'splits' says {want}"),
            ));
        }
    }
    Ok(())
}

/// The node tensors' chunks: same row ranges, tiling `0..num_nodes`; byte sizes; edge ranges tiling
/// `0..num_edges`.
fn check_node_chunks(m: &Manifest) -> Result<(), (String, String)> {
    let t = &m.tensors;
    let n_chunks = t.indptr.chunks.len();
    for (name, tc) in &t.all()[1..4] {
        if tc.chunks.len() != n_chunks {
            return Err((
                format!("tensors.{name}.chunks"),
                format!("{} chunks, but 'indptr' has {n_chunks}", tc.chunks.len()),
            ));
        }
    }
    let (mut row, mut edge) = (0usize, 0usize);
    let fsize = m.feat_dim as u64 * m.feature_dtype.size_bytes() as u64;
    for i in 0..n_chunks {
        let r = t.indptr.chunks[i].rows;
        let rows = (r[1] - r[0]) as u64;
        if r[0] != row || r[1] == r[0] {
            return Err((
                format!("tensors.indptr.chunks[{i}].rows"),
                format!("{r:?} does not continue at row {row} with at least one row"),
            ));
        }
        let sizes = [8 * (rows + 1), 0, rows * fsize, 8 * rows];
        for (j, (name, tc)) in t.all()[..4].iter().enumerate() {
            let c = &tc.chunks[i];
            if c.rows != r {
                return Err((
                    format!("tensors.{name}.chunks[{i}].rows"),
                    format!("{:?} differs from indptr's {r:?}", c.rows),
                ));
            }
            if j != 1 && c.bytes != sizes[j] {
                return Err((
                    format!("tensors.{name}.chunks[{i}].bytes"),
                    format!("is {}, expected {} for {rows} rows", c.bytes, sizes[j]),
                ));
            }
        }
        let c = &t.indices.chunks[i];
        let Some([e0, e1]) = c.edges else {
            return Err((
                format!("tensors.indices.chunks[{i}].edges"),
                "is missing".into(),
            ));
        };
        if e0 != edge || e1 < e0 || c.bytes != 4 * (e1 - e0) as u64 {
            return Err((
                format!("tensors.indices.chunks[{i}].edges"),
                format!(
                    "[{e0}, {e1}] with {} bytes does not continue at edge {edge} with 4 bytes per edge",
                    c.bytes
                ),
            ));
        }
        row = r[1];
        edge = e1;
    }
    if row != m.num_nodes {
        return Err((
            "tensors.indptr.chunks".into(),
            format!(
                "cover {row} rows, but field 'num_nodes' says {}",
                m.num_nodes
            ),
        ));
    }
    if edge != m.num_edges {
        return Err((
            "tensors.indices.chunks".into(),
            format!(
                "cover {edge} edges, but field 'num_edges' says {}",
                m.num_edges
            ),
        ));
    }
    Ok(())
}
