//! Importing an OGB node-property folder straight into the chunked layout ([`crate::chunked`]) without
//! holding the graph: the same dataset as [`crate::import::ogb`] (same checks, same errors with file and
//! line), assembled as a stream.
//!
//! The edge list is read once and spilled to disk by destination row range ([`crate::spill`]); then the
//! feature and label files are read in step, one chunk of rows at a time, joined with that range's
//! sorted rows and written. Memory: one chunk of features and one bucket of edges, the writer's byte per
//! node and the split lists; never the edge list or the feature matrix.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use flate2::read::GzDecoder;

use crate::chunked::{ChunkedHeader, ChunkedWriter, Manifest, NodeChunk};
use crate::error::Error;
use crate::format::{Features, Split};
use crate::import::{
    ImportOptions, check_node_count, name_source, node_id, parse_feature_line, parse_label_line,
    pick_split_dir, read_ids_text, read_node_count, require, row_normalize, two_ints,
};
use crate::spill::EdgeSpill;

/// Edges spilled per batch.
const EDGE_BATCH: usize = 1 << 20;

/// A gzipped text file read line by line on demand (blank lines skipped, numbers 1-based).
struct Lines {
    path: PathBuf,
    reader: BufReader<GzDecoder<File>>,
    buf: Vec<u8>,
    no: usize,
}

impl Lines {
    fn open(path: &Path) -> Result<Lines, Error> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        Ok(Lines {
            path: path.to_path_buf(),
            reader: BufReader::with_capacity(1 << 16, GzDecoder::new(file)),
            buf: Vec::new(),
            no: 0,
        })
    }

    /// The next non-blank line and its number, or `None` at the end.
    fn next_line(&mut self) -> Result<Option<(usize, &str)>, Error> {
        loop {
            self.buf.clear();
            let read = self.reader.read_until(b'\n', &mut self.buf).map_err(|e| {
                Error::input(
                    &self.path,
                    format!("read failed after line {}: {e}", self.no),
                )
            })?;
            if read == 0 {
                return Ok(None);
            }
            self.no += 1;
            let blank = std::str::from_utf8(&self.buf)
                .map_err(|_| Error::line(&self.path, self.no, "not valid UTF-8"))?
                .trim()
                .is_empty();
            if !blank {
                break;
            }
        }
        let line = std::str::from_utf8(&self.buf)
            .expect("checked in the loop")
            .trim_end_matches(['\n', '\r']);
        Ok(Some((self.no, line)))
    }

    fn err(&self, no: usize, problem: String) -> Error {
        Error::line(&self.path, no, problem)
    }
}

/// Imports the OGB raw layout in `dir` (see [`crate::import::ogb`]) into a chunked dataset at `out`,
/// `chunk_rows` rows per chunk. Loading the result gives exactly what `import::ogb(dir, opts)` returns.
pub fn ogb_chunked(
    dir: &Path,
    opts: &ImportOptions,
    out: &Path,
    chunk_rows: usize,
) -> Result<Manifest, Error> {
    if !dir.is_dir() {
        return Err(Error::input(dir, "is not a directory"));
    }
    let raw = dir.join("raw");
    let feat_path = require(raw.join("node-feat.csv.gz"))?;
    let label_path = require(raw.join("node-label.csv.gz"))?;
    let edge_path = require(raw.join("edge.csv.gz"))?;
    let (n, f) = count_feature_rows(&feat_path)?;
    let count_path = raw.join("num-node-list.csv.gz");
    if count_path.is_file() {
        let d = read_node_count(&count_path)?;
        if d != n {
            return Err(Error::input(
                &feat_path,
                format!("has {n} rows but {} says {d} nodes", count_path.display()),
            ));
        }
    }
    check_node_count(&feat_path, n)?;
    let split_dir = pick_split_dir(&dir.join("split"), opts.split_name.as_deref())?;
    let (name, source) = name_source(dir, "import:ogb", opts);
    let header = ChunkedHeader {
        name,
        source,
        num_nodes: n,
        feat_dim: f,
        feature_dtype: opts.feature_dtype,
        num_classes: None,
        directed: !opts.undirected,
    };
    let mut w = ChunkedWriter::create(out, header, chunk_rows)?;
    let mut spill = EdgeSpill::new(out, n, chunk_rows)?;
    spill_edges(&edge_path, n, opts.undirected, &spill)?;
    spill.flush()?;
    let mut feats = Lines::open(&feat_path)?;
    let mut labels = Lines::open(&label_path)?;
    for b in 0..spill.num_buckets() {
        let chunks = bucket_chunks(&spill, b, chunk_rows, f, opts, &mut feats, &mut labels)?;
        w.append(chunks)?;
    }
    let extra = labels.next_line()?.map(|(no, _)| no);
    if let Some(no) = extra {
        return Err(labels.err(no, format!("more labels than the {n} nodes")));
    }
    drop(spill);
    for (file, s) in ["train.csv.gz", "valid.csv.gz", "test.csv.gz"]
        .iter()
        .zip(Split::ALL)
    {
        let ids = read_ids_text(&require(split_dir.join(file))?, n)?;
        for part in ids.chunks(chunk_rows) {
            w.append_split(s, part)?;
        }
    }
    w.finish()
}

/// The feature file's row count and width, in one streaming pass (the width from the first row).
fn count_feature_rows(path: &Path) -> Result<(usize, usize), Error> {
    let mut lines = Lines::open(path)?;
    let mut rows = 0;
    let mut dim = 0;
    let mut scratch = Vec::new();
    while let Some((no, line)) = lines.next_line()? {
        if rows == 0 {
            dim = parse_feature_line(line, &mut scratch).map_err(|p| lines.err(no, p))?;
        }
        rows += 1;
    }
    Ok((rows, dim))
}

fn spill_edges(path: &Path, n: usize, undirected: bool, spill: &EdgeSpill) -> Result<(), Error> {
    let mut lines = Lines::open(path)?;
    let (mut src, mut dst) = (
        Vec::with_capacity(EDGE_BATCH),
        Vec::with_capacity(EDGE_BATCH),
    );
    while let Some((no, line)) = lines.next_line()? {
        let (s, d) = two_ints(line, "src,dst")
            .and_then(|(s, d)| Ok((node_id(s, n, "source")?, node_id(d, n, "destination")?)))
            .map_err(|p| lines.err(no, p))?;
        src.push(s as u32);
        dst.push(d as u32);
        if src.len() == EDGE_BATCH {
            spill.push(&src, &dst, undirected)?;
            src.clear();
            dst.clear();
        }
    }
    spill.push(&src, &dst, undirected)
}

/// Bucket `b`'s rows joined with the next feature and label lines, as chunks.
fn bucket_chunks(
    spill: &EdgeSpill,
    b: usize,
    chunk_rows: usize,
    f: usize,
    opts: &ImportOptions,
    feats: &mut Lines,
    labels: &mut Lines,
) -> Result<Vec<NodeChunk>, Error> {
    let r = spill.bucket_range(b);
    let (indptr, indices) = spill.read_bucket(b)?;
    let mut out = Vec::new();
    let mut lo = r.start;
    while lo < r.end {
        let hi = (lo + chunk_rows).min(r.end);
        let mut values = Vec::with_capacity((hi - lo) * f);
        let mut labs = Vec::with_capacity(hi - lo);
        for v in lo..hi {
            let Some((no, line)) = feats.next_line()? else {
                return Err(Error::input(&feats.path, format!("ends at row {v}")));
            };
            let got = parse_feature_line(line, &mut values).map_err(|p| feats.err(no, p))?;
            if got != f {
                return Err(feats.err(
                    no,
                    format!(
                        "expected {f} comma-separated floats (as on the first row), got {got} (line {no})"
                    ),
                ));
            }
            let Some((no, line)) = labels.next_line()? else {
                return Err(Error::input(
                    &labels.path,
                    format!("has {v} labels, expected one per node"),
                ));
            };
            labs.push(parse_label_line(line).map_err(|p| labels.err(no, p))?);
        }
        if opts.row_normalize {
            row_normalize(&mut values, f);
        }
        let (a, z) = (indptr[lo - r.start], indptr[hi - r.start]);
        out.push(NodeChunk {
            indptr: indptr[lo - r.start..=hi - r.start]
                .iter()
                .map(|&x| x - a)
                .collect(),
            indices: indices[a as usize..z as usize].to_vec(),
            features: Features::F32(values).convert(opts.feature_dtype),
            labels: labs,
        });
        lo = hi;
    }
    Ok(out)
}
