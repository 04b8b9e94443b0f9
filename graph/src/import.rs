//! Importers: turn datasets in common on-disk layouts into an [`OwnedDataset`].
//!
//! Two layouts are supported:
//! - [`generic`]: a folder of plain files (CSV/txt/npy + a raw float32 `.bin`), the layout of
//!   `shared/data/cora`, easy to produce from any tool;
//! - [`ogb`]: the raw layout of an OGB node-property dataset (`raw/*.csv.gz`, `split/<name>/*.csv.gz`).
//!
//! Parsing happens only here, once; errors name the file and, for text files, the 1-based line, because
//! the person fixing a broken export needs exactly that. Node counts come from the features (or OGB's
//! `num-node-list`), so every id in edges, labels and splits is range-checked against them with its line.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use flate2::read::GzDecoder;
use half::f16;
use rayon::prelude::*;

use crate::csr::csr_from_edges;
use crate::error::Error;
use crate::format::{FeatureDtype, Features, OwnedDataset};
use crate::npy;

/// How to turn the input into a dataset.
#[derive(Clone, Debug, PartialEq)]
pub struct ImportOptions {
    /// Dataset name; defaults to the input folder's name.
    pub name: Option<String>,
    /// Store each edge in both directions (default `true`): the usual treatment of citation graphs for
    /// node classification, and what PyG's Planetoid/OGB loaders with `to_undirected` give.
    pub undirected: bool,
    /// Element type of the stored features (default f32).
    pub feature_dtype: FeatureDtype,
    /// Divide each feature row by its sum when the sum is nonzero (Kipf & Welling's preprocessing).
    /// Default `false`, so the stored file keeps the raw values; the engine can also normalise at train
    /// time.
    pub row_normalize: bool,
    /// OGB only: which subfolder of `split/` to use. `None` picks the only one and fails if there are
    /// several.
    pub split_name: Option<String>,
}

impl Default for ImportOptions {
    fn default() -> Self {
        ImportOptions {
            name: None,
            undirected: true,
            feature_dtype: FeatureDtype::F32,
            row_normalize: false,
            split_name: None,
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// generic layout

/// Imports the generic folder layout (see `shared/data/README.md`):
///
/// - edges: `edges.csv` (header `src,dst`) or `edges.npy` (int32/int64, shape [E, 2]);
/// - features: `features.json` naming a raw little-endian row-major `.bin` (float32 or float16) with
///   `num_nodes` and `feat_dim`, or `features.npy` (float16/32/64, shape [N, F]);
/// - labels: `labels.csv` (header `node,label`, one row per node, -1 = unlabelled) or `labels.npy` ([N]);
/// - splits: `train_idx`, `val_idx`, `test_idx` as `.txt` (one id per line) or `.npy`.
///
/// `num_classes` is the largest label + 1. Having both forms of one input is an error, not a guess.
pub fn generic(dir: &Path, opts: &ImportOptions) -> Result<OwnedDataset, Error> {
    if !dir.is_dir() {
        return Err(Error::input(dir, "is not a directory"));
    }
    let (n, f, mut feats) = match choose(dir, "features.json", "features.npy", "features")? {
        Either::A(p) => read_features_json(&p)?,
        Either::B(p) => read_features_npy(&p)?,
    };
    check_node_count(&dir.join("features"), n)?;

    let labels = match choose(dir, "labels.csv", "labels.npy", "labels")? {
        Either::A(p) => read_labels_csv(&p, n)?,
        Either::B(p) => read_labels_npy(&p, n)?,
    };
    let (src, dst) = match choose(dir, "edges.csv", "edges.npy", "edges")? {
        Either::A(p) => read_edges_text(&p, n, true)?,
        Either::B(p) => read_edges_npy(&p, n)?,
    };
    let mut splits: [Vec<i64>; 3] = Default::default();
    for (stem, out) in ["train_idx", "val_idx", "test_idx"]
        .iter()
        .zip(splits.iter_mut())
    {
        *out = match choose(dir, &format!("{stem}.txt"), &format!("{stem}.npy"), stem)? {
            Either::A(p) => read_ids_text(&p, n)?,
            Either::B(p) => read_ids_npy(&p, n)?,
        };
    }

    if opts.row_normalize {
        row_normalize(&mut feats, f);
    }
    finish(
        dir,
        "import:generic",
        opts,
        n,
        f,
        feats,
        labels,
        (src, dst),
        splits,
    )
}

enum Either {
    A(PathBuf),
    B(PathBuf),
}

/// Picks whichever of two alternative files exists.
fn choose(dir: &Path, a: &str, b: &str, what: &str) -> Result<Either, Error> {
    let (pa, pb) = (dir.join(a), dir.join(b));
    match (pa.is_file(), pb.is_file()) {
        (true, false) => Ok(Either::A(pa)),
        (false, true) => Ok(Either::B(pb)),
        (true, true) => Err(Error::input(
            dir,
            format!("both {a} and {b} exist; keep only one {what} file"),
        )),
        (false, false) => Err(Error::input(
            dir,
            format!("no {what} file: expected {a} or {b}"),
        )),
    }
}

pub(crate) fn check_node_count(origin: &Path, n: usize) -> Result<(), Error> {
    if n > i32::MAX as usize {
        return Err(Error::input(
            origin,
            format!("{n} nodes exceed the limit of i32 node ids ({})", i32::MAX),
        ));
    }
    Ok(())
}

#[derive(serde::Deserialize)]
struct FeaturesJson {
    file: String,
    num_nodes: usize,
    feat_dim: usize,
    #[serde(default = "default_float32")]
    dtype: String,
    #[serde(default)]
    byte_order: Option<String>,
}

fn default_float32() -> String {
    "float32".into()
}

fn read_features_json(path: &Path) -> Result<(usize, usize, Vec<f32>), Error> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let j: FeaturesJson = serde_json::from_str(&text)
        .map_err(|e| Error::input(path, format!("invalid features description: {e}")))?;
    if let Some(bo) = &j.byte_order
        && bo != "little"
    {
        return Err(Error::input(
            path,
            format!("byte_order '{bo}' is not supported, expected 'little'"),
        ));
    }
    let size = match j.dtype.as_str() {
        "float32" => 4,
        "float16" => 2,
        other => {
            return Err(Error::input(
                path,
                format!("dtype '{other}' is not supported, expected 'float32' or 'float16'"),
            ));
        }
    };
    // Only a bare file name beside the JSON: the description must not point elsewhere on disk.
    let Some(dir) = path.parent() else {
        return Err(Error::input(path, "has no parent directory"));
    };
    if Path::new(&j.file).components().count() != 1 {
        return Err(Error::input(
            path,
            format!(
                "'file' = {:?} must be a file name in the same folder",
                j.file
            ),
        ));
    }
    let bin = dir.join(&j.file);
    let expected = j
        .num_nodes
        .checked_mul(j.feat_dim)
        .and_then(|x| x.checked_mul(size))
        .ok_or_else(|| Error::input(path, "num_nodes * feat_dim overflows"))?;
    let actual = std::fs::metadata(&bin)
        .map_err(|e| Error::io(&bin, e))?
        .len();
    if actual != expected as u64 {
        return Err(Error::input(
            &bin,
            format!(
                "is {actual} bytes, expected num_nodes * feat_dim * {size} = {} * {} * {size} = {expected} \
                 bytes (from {})",
                j.num_nodes,
                j.feat_dim,
                path.display()
            ),
        ));
    }
    let mut bytes = Vec::with_capacity(expected);
    File::open(&bin)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| Error::io(&bin, e))?;
    if bytes.len() != expected {
        return Err(Error::input(
            &bin,
            format!(
                "changed size while reading: {} bytes, expected {expected}",
                bytes.len()
            ),
        ));
    }
    let values = if size == 4 {
        bytes
            .par_chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("chunk of 4")))
            .collect()
    } else {
        bytes
            .par_chunks_exact(2)
            .map(|c| f16::from_le_bytes(c.try_into().expect("chunk of 2")).to_f32())
            .collect()
    };
    Ok((j.num_nodes, j.feat_dim, values))
}

fn read_features_npy(path: &Path) -> Result<(usize, usize, Vec<f32>), Error> {
    let arr = npy::read(path)?;
    let &[n, f] = arr.shape.as_slice() else {
        return Err(Error::input(
            path,
            format!(
                "has shape {:?}, expected two dimensions [num_nodes, feat_dim]",
                arr.shape
            ),
        ));
    };
    let values = match arr.data {
        npy::NpyData::F32(v) => v,
        npy::NpyData::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
        npy::NpyData::Int(_) => {
            return Err(Error::input(
                path,
                "holds integers, expected float16, float32 or float64",
            ));
        }
    };
    Ok((n, f, values))
}

fn read_labels_csv(path: &Path, n: usize) -> Result<Vec<i64>, Error> {
    let mut labels = vec![-1i64; n];
    // Line of each node's row, 0 = not seen yet: lets a duplicate name both lines.
    let mut seen_at = vec![0usize; n];
    for_each_line(path, false, |no, line| {
        if no == 1 {
            return expect_header(line, "node,label");
        }
        let (node, label) = two_ints(line, "node,label")?;
        let v = node_id(node, n, "node")?;
        if seen_at[v] != 0 {
            return Err(format!(
                "node {v} already has a label on line {}",
                seen_at[v]
            ));
        }
        if label < -1 {
            return Err(format!(
                "label {label} is negative; use -1 for an unlabelled node"
            ));
        }
        seen_at[v] = no;
        labels[v] = label;
        Ok(())
    })?;
    let mut missing = seen_at
        .iter()
        .enumerate()
        .filter(|(_, l)| **l == 0)
        .map(|(v, _)| v);
    if let Some(first) = missing.next() {
        let more = missing.count();
        return Err(Error::input(
            path,
            format!(
                "no label for node {first}{}; every node 0..{n} needs a row (-1 for unlabelled)",
                if more > 0 {
                    format!(" (and {more} more nodes)")
                } else {
                    String::new()
                }
            ),
        ));
    }
    Ok(labels)
}

fn read_labels_npy(path: &Path, n: usize) -> Result<Vec<i64>, Error> {
    let (shape, labels) = npy::read(path)?.into_ints(path)?;
    if shape != [n] && shape != [n, 1] {
        return Err(Error::input(
            path,
            format!("has shape {shape:?}, expected [{n}] (num_nodes from the features)"),
        ));
    }
    if let Some((i, l)) = labels.iter().enumerate().find(|(_, l)| **l < -1) {
        return Err(Error::input(
            path,
            format!("entry {i} = {l} is negative; use -1 for an unlabelled node"),
        ));
    }
    Ok(labels)
}

/// Reads `src,dst` lines (after a `src,dst` header when `header`); ids are checked against `n`.
fn read_edges_text(path: &Path, n: usize, header: bool) -> Result<(Vec<u32>, Vec<u32>), Error> {
    let gz = is_gz(path);
    let (mut src, mut dst) = (Vec::new(), Vec::new());
    for_each_line(path, gz, |no, line| {
        if header && no == 1 {
            return expect_header(line, "src,dst");
        }
        let (s, d) = two_ints(line, "src,dst")?;
        src.push(node_id(s, n, "source node")? as u32);
        dst.push(node_id(d, n, "destination node")? as u32);
        Ok(())
    })?;
    Ok((src, dst))
}

fn read_edges_npy(path: &Path, n: usize) -> Result<(Vec<u32>, Vec<u32>), Error> {
    let (shape, flat) = npy::read(path)?.into_ints(path)?;
    let &[e, 2] = shape.as_slice() else {
        return Err(Error::input(
            path,
            format!("has shape {shape:?}, expected [num_edges, 2] (one src,dst pair per row)"),
        ));
    };
    let (mut src, mut dst) = (Vec::with_capacity(e), Vec::with_capacity(e));
    for (row, pair) in flat.chunks_exact(2).enumerate() {
        for (&id, out) in pair.iter().zip([&mut src, &mut dst]) {
            let v = node_id(id, n, "node")
                .map_err(|p| Error::input(path, format!("row {row}: {p}")))?;
            out.push(v as u32);
        }
    }
    Ok((src, dst))
}

/// One node id per line; range and duplicates are checked with the line.
pub(crate) fn read_ids_text(path: &Path, n: usize) -> Result<Vec<i64>, Error> {
    let gz = is_gz(path);
    let mut ids = Vec::new();
    let mut seen_at = std::collections::HashMap::new();
    for_each_line(path, gz, |no, line| {
        let t = line.trim();
        let id: i64 = t
            .parse()
            .map_err(|_| format!("expected one node id, got {t:?}"))?;
        let v = node_id(id, n, "node")?;
        if let Some(prev) = seen_at.insert(v, no) {
            return Err(format!("node {v} is listed twice (also on line {prev})"));
        }
        ids.push(v as i64);
        Ok(())
    })?;
    Ok(ids)
}

fn read_ids_npy(path: &Path, n: usize) -> Result<Vec<i64>, Error> {
    let (shape, ids) = npy::read(path)?.into_ints(path)?;
    if shape.len() != 1 {
        return Err(Error::input(
            path,
            format!("has shape {shape:?}, expected one dimension"),
        ));
    }
    for (i, &id) in ids.iter().enumerate() {
        node_id(id, n, "node").map_err(|p| Error::input(path, format!("entry {i}: {p}")))?;
    }
    // Duplicates and overlaps are reported by the final validation, which names the split and node.
    Ok(ids)
}

// ---------------------------------------------------------------------------------------------------
// OGB raw layout

/// Imports an OGB node-property dataset from its raw layout:
///
/// - `raw/edge.csv.gz`: `src,dst` per line, no header;
/// - `raw/node-feat.csv.gz`: one row of comma-separated floats per node;
/// - `raw/node-label.csv.gz`: one label per line, `nan` for unlabelled (stored as -1);
/// - `raw/num-node-list.csv.gz` (optional): the node count, checked against the feature rows;
/// - `split/<name>/{train,valid,test}.csv.gz`: one node id per line. With several split folders,
///   `opts.split_name` must say which one.
pub fn ogb(dir: &Path, opts: &ImportOptions) -> Result<OwnedDataset, Error> {
    if !dir.is_dir() {
        return Err(Error::input(dir, "is not a directory"));
    }
    let raw = dir.join("raw");
    let count_path = raw.join("num-node-list.csv.gz");
    let declared = if count_path.is_file() {
        Some(read_node_count(&count_path)?)
    } else {
        None
    };

    let feat_path = require(raw.join("node-feat.csv.gz"))?;
    let (n, f, mut feats) = read_ogb_features(&feat_path)?;
    if let Some(d) = declared
        && d != n
    {
        return Err(Error::input(
            &feat_path,
            format!("has {n} rows but {} says {d} nodes", count_path.display()),
        ));
    }
    check_node_count(&feat_path, n)?;

    let labels = read_ogb_labels(&require(raw.join("node-label.csv.gz"))?, n)?;
    let (src, dst) = read_edges_text(&require(raw.join("edge.csv.gz"))?, n, false)?;

    let split_dir = pick_split_dir(&dir.join("split"), opts.split_name.as_deref())?;
    let mut splits: [Vec<i64>; 3] = Default::default();
    for (file, out) in ["train.csv.gz", "valid.csv.gz", "test.csv.gz"]
        .iter()
        .zip(splits.iter_mut())
    {
        *out = read_ids_text(&require(split_dir.join(file))?, n)?;
    }

    if opts.row_normalize {
        row_normalize(&mut feats, f);
    }
    finish(
        dir,
        "import:ogb",
        opts,
        n,
        f,
        feats,
        labels,
        (src, dst),
        splits,
    )
}

pub(crate) fn require(path: PathBuf) -> Result<PathBuf, Error> {
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::input(path, "is missing"))
    }
}

pub(crate) fn pick_split_dir(split: &Path, wanted: Option<&str>) -> Result<PathBuf, Error> {
    if let Some(name) = wanted {
        let p = split.join(name);
        return if p.is_dir() {
            Ok(p)
        } else {
            Err(Error::input(p, "is not a directory (from split_name)"))
        };
    }
    let entries = std::fs::read_dir(split).map_err(|e| Error::io(split, e))?;
    let mut dirs = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(split, e))?;
        if entry.path().is_dir() {
            dirs.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    dirs.sort();
    match dirs.as_slice() {
        [one] => Ok(split.join(one)),
        [] => Err(Error::input(split, "contains no split folder")),
        many => Err(Error::input(
            split,
            format!(
                "contains several split folders ({}); choose one with split_name",
                many.join(", ")
            ),
        )),
    }
}

pub(crate) fn read_node_count(path: &Path) -> Result<usize, Error> {
    let mut count = None;
    for_each_line(path, true, |no, line| {
        if count.is_some() {
            return Err(format!(
                "expected a single node count (one graph); this line is the second value (line {no})"
            ));
        }
        let t = line.trim();
        count = Some(
            t.parse::<usize>()
                .map_err(|_| format!("expected a node count, got {t:?}"))?,
        );
        Ok(())
    })?;
    count.ok_or_else(|| Error::input(path, "is empty, expected a node count"))
}

fn read_ogb_features(path: &Path) -> Result<(usize, usize, Vec<f32>), Error> {
    let mut values = Vec::new();
    let mut dim = None;
    let mut rows = 0usize;
    for_each_line(path, true, |no, line| {
        let got = parse_feature_line(line, &mut values)?;
        match dim {
            None => dim = Some(got),
            Some(d) if d != got => {
                return Err(format!(
                    "expected {d} comma-separated floats (as on the first row), got {got} (line {no})"
                ));
            }
            _ => {}
        }
        rows += 1;
        Ok(())
    })?;
    Ok((rows, dim.unwrap_or(0), values))
}

fn read_ogb_labels(path: &Path, n: usize) -> Result<Vec<i64>, Error> {
    let mut labels = Vec::with_capacity(n);
    for_each_line(path, true, |_, line| {
        labels.push(parse_label_line(line)?);
        Ok(())
    })?;
    if labels.len() != n {
        return Err(Error::input(
            path,
            format!("has {} labels, expected one per node = {n}", labels.len()),
        ));
    }
    Ok(labels)
}

/// Appends one OGB feature row's comma-separated floats to `values`; returns how many.
pub(crate) fn parse_feature_line(line: &str, values: &mut Vec<f32>) -> Result<usize, String> {
    let before = values.len();
    for field in line.split(',') {
        let t = field.trim();
        let x: f32 = t.parse().map_err(|_| {
            format!(
                "expected a float, got {t:?} (field {})",
                values.len() - before + 1
            )
        })?;
        values.push(x);
    }
    Ok(values.len() - before)
}

/// One OGB label line: an integer (or integral float), or `nan` for unlabelled (-1).
pub(crate) fn parse_label_line(line: &str) -> Result<i64, String> {
    {
        let t = line.trim();
        if t.contains(',') {
            return Err(format!(
                "expected one label per line, got {t:?}; multi-task labels are not supported"
            ));
        }
        let label = if t.eq_ignore_ascii_case("nan") {
            -1
        } else if let Ok(v) = t.parse::<i64>() {
            v
        } else {
            // Some exports write integral labels as floats ("3.0").
            match t.parse::<f64>() {
                Ok(x) if x.fract() == 0.0 && x >= 0.0 && x < i64::MAX as f64 => x as i64,
                _ => return Err(format!("expected an integer label or nan, got {t:?}")),
            }
        };
        if label < 0 && !t.eq_ignore_ascii_case("nan") {
            return Err(format!(
                "label {label} is negative; write nan for an unlabelled node"
            ));
        }
        Ok(label)
    }
}

// ---------------------------------------------------------------------------------------------------
// shared helpers

#[allow(clippy::too_many_arguments)]
fn finish(
    dir: &Path,
    kind: &str,
    opts: &ImportOptions,
    n: usize,
    f: usize,
    feats: Vec<f32>,
    labels: Vec<i64>,
    (src, dst): (Vec<u32>, Vec<u32>),
    splits: [Vec<i64>; 3],
) -> Result<OwnedDataset, Error> {
    let (name, source) = name_source(dir, kind, opts);
    let csr = csr_from_edges(n, &src, &dst, opts.undirected);
    let features = Features::F32(feats).convert(opts.feature_dtype);
    let ds = OwnedDataset::from_parts(
        name,
        source,
        !opts.undirected,
        csr,
        features,
        f,
        labels,
        splits,
    );
    ds.validate_at(dir)?;
    Ok(ds)
}

/// The dataset's name (the option, else the folder's name) and its provenance string.
pub(crate) fn name_source(dir: &Path, kind: &str, opts: &ImportOptions) -> (String, String) {
    let name = opts.name.clone().unwrap_or_else(|| {
        dir.canonicalize()
            .ok()
            .as_deref()
            .unwrap_or(dir)
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "dataset".into())
    });
    let mut source = format!("{kind} {}", dir.display());
    if opts.row_normalize {
        source.push_str(" row_normalize");
    }
    (name, source)
}

pub(crate) fn row_normalize(feats: &mut [f32], f: usize) {
    if f == 0 {
        return;
    }
    feats.par_chunks_mut(f).for_each(|row| {
        let sum: f32 = row.iter().sum();
        if sum != 0.0 {
            row.iter_mut().for_each(|x| *x /= sum);
        }
    });
}

fn is_gz(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "gz")
}

/// Calls `f(line_number, line)` for every non-blank line (numbers are 1-based and count blank lines, so
/// they match an editor). `f` returns a problem description; this attaches the file and line.
fn for_each_line(
    path: &Path,
    gz: bool,
    mut f: impl FnMut(usize, &str) -> Result<(), String>,
) -> Result<(), Error> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut reader: Box<dyn BufRead> = if gz {
        Box::new(BufReader::with_capacity(1 << 16, GzDecoder::new(file)))
    } else {
        Box::new(BufReader::with_capacity(1 << 16, file))
    };
    let mut buf = Vec::new();
    let mut no = 0usize;
    loop {
        buf.clear();
        let read = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| Error::input(path, format!("read failed after line {no}: {e}")))?;
        if read == 0 {
            return Ok(());
        }
        no += 1;
        let line =
            std::str::from_utf8(&buf).map_err(|_| Error::line(path, no, "not valid UTF-8"))?;
        let line = line.trim_end_matches(['\n', '\r']);
        if line.trim().is_empty() {
            continue;
        }
        f(no, line).map_err(|p| Error::line(path, no, p))?;
    }
}

fn expect_header(line: &str, header: &str) -> Result<(), String> {
    let got: String = line.chars().filter(|c| !c.is_whitespace()).collect();
    // Tolerate a UTF-8 byte order mark, which spreadsheet exports add.
    if got.trim_start_matches('\u{feff}') == header {
        Ok(())
    } else {
        Err(format!("expected header '{header}', got {line:?}"))
    }
}

pub(crate) fn two_ints(line: &str, what: &str) -> Result<(i64, i64), String> {
    let bad = || format!("expected two integers '{what}', got {line:?}");
    let mut it = line.split(',');
    let (Some(a), Some(b), None) = (it.next(), it.next(), it.next()) else {
        return Err(bad());
    };
    match (a.trim().parse(), b.trim().parse()) {
        (Ok(a), Ok(b)) => Ok((a, b)),
        _ => Err(bad()),
    }
}

pub(crate) fn node_id(id: i64, n: usize, what: &str) -> Result<usize, String> {
    if id < 0 || id as u64 >= n as u64 {
        Err(format!("{what} id {id} is out of range 0..{n} (num_nodes)"))
    } else {
        Ok(id as usize)
    }
}

#[cfg(test)]
#[path = "import_tests.rs"]
mod tests;
