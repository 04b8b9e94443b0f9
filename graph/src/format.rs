//! The dataset file: one safetensors file holding a graph, its features, labels and split.
//!
//! This module owns the on-disk format (tensor names, dtypes, the `physalia` metadata JSON), writing it
//! atomically, opening it with mmap, and every validity check. A training job memory-maps the file and
//! hands out borrowed slices, so a 1M-node dataset costs no parse time and no second copy; the validation
//! done once on open is what lets the engine index with the slices afterwards without re-checking.
//!
//! Layout (see `graph/README.md`): `indptr` I64 [N+1], `indices` I32 [E], `features` F32|F16|BF16 [N, F],
//! `labels` I64 [N] (-1 = unlabelled), `train_idx`/`val_idx`/`test_idx` I64 [k]. The safetensors
//! `__metadata__` map holds one key, `physalia`, whose value is the JSON of [`Metadata`].

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors};
use serde::{Deserialize, Serialize};

use crate::csr::Csr;
use crate::error::Error;

/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Key of our JSON inside the safetensors `__metadata__` map.
pub const METADATA_KEY: &str = "physalia";

/// Names of the seven tensors, in the order checks and checksums visit them.
pub const TENSOR_NAMES: [&str; 7] = [
    "indptr",
    "indices",
    "features",
    "labels",
    "train_idx",
    "val_idx",
    "test_idx",
];

/// Element type of the `features` tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FeatureDtype {
    F32,
    F16,
    BF16,
}

impl FeatureDtype {
    pub fn size_bytes(self) -> usize {
        match self {
            FeatureDtype::F32 => 4,
            FeatureDtype::F16 | FeatureDtype::BF16 => 2,
        }
    }

    pub(crate) fn safetensors_dtype(self) -> Dtype {
        match self {
            FeatureDtype::F32 => Dtype::F32,
            FeatureDtype::F16 => Dtype::F16,
            FeatureDtype::BF16 => Dtype::BF16,
        }
    }
}

impl std::fmt::Display for FeatureDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FeatureDtype::F32 => "f32",
            FeatureDtype::F16 => "f16",
            FeatureDtype::BF16 => "bf16",
        })
    }
}

/// What the file says about itself; stored as JSON under the `physalia` metadata key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    pub format_version: u32,
    pub name: String,
    pub num_nodes: usize,
    /// Directed CSR entries (an undirected edge counts twice).
    pub num_edges: usize,
    pub feat_dim: usize,
    pub num_classes: usize,
    pub feature_dtype: FeatureDtype,
    /// `false`: the CSR holds both directions of every undirected edge.
    pub directed: bool,
    /// Provenance, e.g. `import:generic /data/cora` or `synth:sbm seed=1 ...`.
    pub source: String,
    /// Tensor name -> xxh3-64 of its raw bytes, 16 lowercase hex digits. Filled in by `write`.
    #[serde(default)]
    pub checksums: BTreeMap<String, String>,
}

/// Node features held in memory, row-major `num_nodes x feat_dim`.
#[derive(Clone, Debug, PartialEq)]
pub enum Features {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl Features {
    pub fn dtype(&self) -> FeatureDtype {
        match self {
            Features::F32(_) => FeatureDtype::F32,
            Features::F16(_) => FeatureDtype::F16,
            Features::BF16(_) => FeatureDtype::BF16,
        }
    }

    /// `len` zero values of `dtype`.
    pub fn zeros(dtype: FeatureDtype, len: usize) -> Features {
        match dtype {
            FeatureDtype::F32 => Features::F32(vec![0.0; len]),
            FeatureDtype::F16 => Features::F16(vec![f16::ZERO; len]),
            FeatureDtype::BF16 => Features::BF16(vec![bf16::ZERO; len]),
        }
    }

    /// The values' bytes, to write in place (little-endian, as [`FeatureView::as_bytes`] reads them).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Features::F32(v) => bytemuck::cast_slice_mut(v),
            Features::F16(v) => bytemuck::cast_slice_mut(v),
            Features::BF16(v) => bytemuck::cast_slice_mut(v),
        }
    }

    pub fn len(&self) -> usize {
        self.view().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn view(&self) -> FeatureView<'_> {
        match self {
            Features::F32(v) => FeatureView::F32(v),
            Features::F16(v) => FeatureView::F16(v),
            Features::BF16(v) => FeatureView::BF16(v),
        }
    }

    /// Rounds to `dtype` (or widens to f32); a no-op when already `dtype`.
    pub fn convert(self, dtype: FeatureDtype) -> Features {
        if self.dtype() == dtype {
            return self;
        }
        let f32s = match self {
            Features::F32(v) => v,
            other => other.view().to_f32().into_owned(),
        };
        match dtype {
            FeatureDtype::F32 => Features::F32(f32s),
            FeatureDtype::F16 => Features::F16(f32s.iter().map(|&x| f16::from_f32(x)).collect()),
            FeatureDtype::BF16 => Features::BF16(f32s.iter().map(|&x| bf16::from_f32(x)).collect()),
        }
    }
}

/// Borrowed features, row-major `num_nodes x feat_dim`.
#[derive(Clone, Copy, Debug)]
pub enum FeatureView<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl<'a> FeatureView<'a> {
    pub fn dtype(&self) -> FeatureDtype {
        match self {
            FeatureView::F32(_) => FeatureDtype::F32,
            FeatureView::F16(_) => FeatureDtype::F16,
            FeatureView::BF16(_) => FeatureDtype::BF16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            FeatureView::F32(v) => v.len(),
            FeatureView::F16(v) => v.len(),
            FeatureView::BF16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The raw little-endian bytes, exactly as stored in the file.
    pub fn as_bytes(&self) -> &'a [u8] {
        match *self {
            FeatureView::F32(v) => bytemuck::cast_slice(v),
            FeatureView::F16(v) => bytemuck::cast_slice(v),
            FeatureView::BF16(v) => bytemuck::cast_slice(v),
        }
    }

    /// The first value that is NaN or infinite, as (element index, value widened to f32).
    pub fn first_non_finite(&self) -> Option<(usize, f32)> {
        fn find<T: Copy>(v: &[T], f: impl Fn(T) -> f32) -> Option<(usize, f32)> {
            v.iter()
                .position(|&x| !f(x).is_finite())
                .map(|i| (i, f(v[i])))
        }
        match *self {
            FeatureView::F32(v) => find(v, |x| x),
            FeatureView::F16(v) => find(v, |x| x.to_f32()),
            FeatureView::BF16(v) => find(v, |x| x.to_f32()),
        }
    }

    /// Borrowed when already f32, widened otherwise.
    pub fn to_f32(&self) -> Cow<'a, [f32]> {
        match *self {
            FeatureView::F32(v) => Cow::Borrowed(v),
            FeatureView::F16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
            FeatureView::BF16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        }
    }
}

/// One of the three node splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    Train,
    Val,
    Test,
}

impl Split {
    pub const ALL: [Split; 3] = [Split::Train, Split::Val, Split::Test];

    /// The tensor holding this split's node ids.
    pub fn tensor_name(self) -> &'static str {
        match self {
            Split::Train => "train_idx",
            Split::Val => "val_idx",
            Split::Test => "test_idx",
        }
    }
}

/// Summary numbers for planners, logs and `physalia inspect`-style output.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GraphStats {
    pub num_nodes: usize,
    pub num_edges: usize,
    pub feat_dim: usize,
    pub num_classes: usize,
    pub feature_dtype: FeatureDtype,
    pub directed: bool,
    /// In-degree (row length) statistics; all 0 for an empty graph.
    pub degree_min: usize,
    pub degree_mean: f64,
    pub degree_max: usize,
    /// Nodes with an empty row.
    pub isolated_nodes: usize,
    pub train_size: usize,
    pub val_size: usize,
    pub test_size: usize,
    /// Size of the dataset file; 0 for an in-memory dataset.
    pub file_bytes: u64,
}

/// A dataset held in memory: what importers and generators return and what [`OwnedDataset::write`] stores.
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedDataset {
    pub meta: Metadata,
    pub indptr: Vec<i64>,
    pub indices: Vec<i32>,
    pub features: Features,
    pub labels: Vec<i64>,
    pub train_idx: Vec<i64>,
    pub val_idx: Vec<i64>,
    pub test_idx: Vec<i64>,
}

impl OwnedDataset {
    /// Assembles a dataset and derives the metadata counts from the parts: `num_nodes` from `labels`,
    /// `num_edges` from `indices`, `num_classes` = max label + 1. Does not validate; `write` does.
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        name: impl Into<String>,
        source: impl Into<String>,
        directed: bool,
        (indptr, indices): (Vec<i64>, Vec<i32>),
        features: Features,
        feat_dim: usize,
        labels: Vec<i64>,
        [train_idx, val_idx, test_idx]: [Vec<i64>; 3],
    ) -> Self {
        let num_classes = labels
            .iter()
            .copied()
            .max()
            .map_or(0, |m| (m + 1).max(0) as usize);
        let meta = Metadata {
            format_version: FORMAT_VERSION,
            name: name.into(),
            num_nodes: labels.len(),
            num_edges: indices.len(),
            feat_dim,
            num_classes,
            feature_dtype: features.dtype(),
            directed,
            source: source.into(),
            checksums: BTreeMap::new(),
        };
        OwnedDataset {
            meta,
            indptr,
            indices,
            features,
            labels,
            train_idx,
            val_idx,
            test_idx,
        }
    }

    pub fn csr(&self) -> Csr<'_> {
        Csr::new(&self.indptr, &self.indices)
    }

    pub fn split(&self, s: Split) -> &[i64] {
        match s {
            Split::Train => &self.train_idx,
            Split::Val => &self.val_idx,
            Split::Test => &self.test_idx,
        }
    }

    pub fn stats(&self) -> GraphStats {
        compute_stats(
            &self.meta,
            self.csr(),
            [&self.train_idx, &self.val_idx, &self.test_idx],
            0,
        )
    }

    /// Checks the metadata against the tensors and every content invariant (see [`Dataset::open`]).
    pub fn validate(&self) -> Result<(), Error> {
        let origin = PathBuf::from(format!("<in-memory dataset '{}'>", self.meta.name));
        self.validate_at(&origin)
    }

    pub(crate) fn validate_at(&self, origin: &Path) -> Result<(), Error> {
        let m = &self.meta;
        if m.format_version != FORMAT_VERSION {
            return Err(Error::metadata(
                origin,
                format!(
                    "format_version {} is not supported (this build writes version {FORMAT_VERSION})",
                    m.format_version
                ),
            ));
        }
        check_node_limit(origin, m)?;
        if self.features.dtype() != m.feature_dtype {
            return Err(Error::tensor(
                origin,
                "features",
                format!(
                    "holds {} values but metadata feature_dtype is {}",
                    self.features.dtype(),
                    m.feature_dtype
                ),
            ));
        }
        let feat_len = m
            .num_nodes
            .checked_mul(m.feat_dim)
            .ok_or_else(|| Error::metadata(origin, "num_nodes * feat_dim overflows".to_string()))?;
        let expect_len = |tensor: &str, got: usize, want: usize, what: &str| {
            if got == want {
                Ok(())
            } else {
                Err(Error::tensor(
                    origin,
                    tensor,
                    format!("has {got} entries, expected {what} = {want}"),
                ))
            }
        };
        expect_len(
            "indptr",
            self.indptr.len(),
            m.num_nodes + 1,
            "num_nodes + 1",
        )?;
        expect_len("indices", self.indices.len(), m.num_edges, "num_edges")?;
        expect_len(
            "features",
            self.features.len(),
            feat_len,
            "num_nodes * feat_dim",
        )?;
        expect_len("labels", self.labels.len(), m.num_nodes, "num_nodes")?;
        validate_contents(
            origin,
            m,
            Csr::new(&self.indptr, &self.indices),
            &self.labels,
            [&self.train_idx, &self.val_idx, &self.test_idx],
        )
    }

    /// Rounds (or widens) the features to `dtype` and updates the metadata.
    pub fn convert_features(mut self, dtype: FeatureDtype) -> Self {
        self.features = self.features.convert(dtype);
        self.meta.feature_dtype = dtype;
        // Checksums describe bytes that no longer exist; `write` recomputes them.
        self.meta.checksums.clear();
        self
    }

    /// Validates, computes checksums, and writes the file atomically: the bytes go to a temporary file in
    /// the destination directory, are synced, and the file is renamed over `path`. A crash leaves either
    /// the old file or the new one, never a half-written one, and an existing file that someone has
    /// mapped is replaced rather than truncated under them.
    pub fn write(&self, path: &Path) -> Result<(), Error> {
        self.validate_at(path)?;
        let feats = self.features.view();
        let tensors: Vec<(&str, Dtype, Vec<usize>, &[u8])> = vec![
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
                "features",
                feats.dtype().safetensors_dtype(),
                vec![self.meta.num_nodes, self.meta.feat_dim],
                feats.as_bytes(),
            ),
            (
                "labels",
                Dtype::I64,
                vec![self.labels.len()],
                bytemuck::cast_slice(&self.labels),
            ),
            (
                "train_idx",
                Dtype::I64,
                vec![self.train_idx.len()],
                bytemuck::cast_slice(&self.train_idx),
            ),
            (
                "val_idx",
                Dtype::I64,
                vec![self.val_idx.len()],
                bytemuck::cast_slice(&self.val_idx),
            ),
            (
                "test_idx",
                Dtype::I64,
                vec![self.test_idx.len()],
                bytemuck::cast_slice(&self.test_idx),
            ),
        ];
        let mut meta = self.meta.clone();
        meta.checksums = tensors
            .iter()
            .map(|(name, _, _, bytes)| (name.to_string(), checksum(bytes)))
            .collect();
        let meta_json =
            serde_json::to_string(&meta).expect("Metadata serialises: plain fields only");
        write_safetensors(path, &meta_json, tensors)
    }
}

/// xxh3-64 of `bytes` as 16 lowercase hex digits.
pub fn checksum(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

/// Writes a safetensors file by hand (rather than through `safetensors::serialize_to_file`) so it can be
/// streamed from borrowed slices and fsynced before the rename. Tensors are laid out in descending
/// alignment, as the safetensors crate does, and the header is padded to 8 bytes, so every tensor
/// starts at an offset that is a multiple of its element size: a page-aligned mmap then yields aligned
/// slices with no copy.
pub(crate) fn write_safetensors(
    path: &Path,
    meta_json: &str,
    mut tensors: Vec<(&str, Dtype, Vec<usize>, &[u8])>,
) -> Result<(), Error> {
    tensors.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::json!({ METADATA_KEY: meta_json }),
    );
    let mut offset = 0usize;
    for (name, dtype, shape, bytes) in &tensors {
        header.insert(
            (*name).into(),
            serde_json::json!({
                "dtype": dtype,
                "shape": shape,
                "data_offsets": [offset, offset + bytes.len()],
            }),
        );
        offset += bytes.len();
    }
    let mut header_bytes = serde_json::to_vec(&header).expect("header JSON serialises");
    let padded = header_bytes.len().next_multiple_of(8);
    header_bytes.resize(padded, b' ');

    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let tmp = tempfile::Builder::new()
        .prefix(".physalia-write-")
        .tempfile_in(dir)
        .map_err(|e| Error::io(dir, e))?;
    let io_err = |e| Error::io(tmp.path(), e);
    {
        let mut w = BufWriter::with_capacity(1 << 20, tmp.as_file());
        w.write_all(&(padded as u64).to_le_bytes())
            .map_err(io_err)?;
        w.write_all(&header_bytes).map_err(io_err)?;
        for (_, _, _, bytes) in &tensors {
            w.write_all(bytes).map_err(io_err)?;
        }
        w.flush().map_err(io_err)?;
    }
    // a temporary file is created 0600; a dataset is meant to be shared like any other output
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o644))
            .map_err(io_err)?;
    }
    tmp.as_file().sync_all().map_err(io_err)?;
    tmp.persist(path).map_err(|e| Error::io(path, e.error))?;
    Ok(())
}

/// Where a tensor's elements live: in the mapping (the normal case) or, if the file placed the tensor
/// at an offset not aligned for its type, in an aligned owned copy.
#[derive(Debug)]
enum Slot<T> {
    Mapped { start: usize, len_bytes: usize },
    Owned(Vec<T>),
}

#[derive(Debug)]
enum FeatureSlot {
    F32(Slot<f32>),
    F16(Slot<f16>),
    BF16(Slot<bf16>),
}

/// A dataset file opened with mmap and validated. Accessors return slices into the mapping.
#[derive(Debug)]
pub struct Dataset {
    path: PathBuf,
    mmap: Mmap,
    meta: Metadata,
    indptr: Slot<i64>,
    indices: Slot<i32>,
    features: FeatureSlot,
    labels: Slot<i64>,
    splits: [Slot<i64>; 3],
}

impl Dataset {
    /// Opens, validates every invariant, and verifies every tensor's checksum.
    pub fn open(path: &Path) -> Result<Dataset, Error> {
        Self::open_inner(path, true)
    }

    /// Opens and validates structure and contents but skips the checksum pass (which reads every byte of
    /// the features); for tools that only need the header or trust the file.
    pub fn open_unverified(path: &Path) -> Result<Dataset, Error> {
        Self::open_inner(path, false)
    }

    pub fn meta(&self) -> &Metadata {
        &self.meta
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn csr(&self) -> Csr<'_> {
        Csr::new(self.slice(&self.indptr), self.slice(&self.indices))
    }

    pub fn labels(&self) -> &[i64] {
        self.slice(&self.labels)
    }

    pub fn split(&self, s: Split) -> &[i64] {
        let i = match s {
            Split::Train => 0,
            Split::Val => 1,
            Split::Test => 2,
        };
        self.slice(&self.splits[i])
    }

    pub fn features(&self) -> FeatureView<'_> {
        match &self.features {
            FeatureSlot::F32(s) => FeatureView::F32(self.slice(s)),
            FeatureSlot::F16(s) => FeatureView::F16(self.slice(s)),
            FeatureSlot::BF16(s) => FeatureView::BF16(self.slice(s)),
        }
    }

    /// Features as f32: borrowed from the mapping when stored as f32, widened otherwise.
    pub fn features_f32(&self) -> Cow<'_, [f32]> {
        self.features().to_f32()
    }

    pub fn stats(&self) -> GraphStats {
        compute_stats(
            &self.meta,
            self.csr(),
            [
                self.split(Split::Train),
                self.split(Split::Val),
                self.split(Split::Test),
            ],
            self.mmap.len() as u64,
        )
    }

    /// Copies everything into memory, e.g. to modify and write back.
    pub fn to_owned_dataset(&self) -> OwnedDataset {
        let features = match self.features() {
            FeatureView::F32(v) => Features::F32(v.to_vec()),
            FeatureView::F16(v) => Features::F16(v.to_vec()),
            FeatureView::BF16(v) => Features::BF16(v.to_vec()),
        };
        OwnedDataset {
            meta: self.meta.clone(),
            indptr: self.csr().indptr.to_vec(),
            indices: self.csr().indices.to_vec(),
            features,
            labels: self.labels().to_vec(),
            train_idx: self.split(Split::Train).to_vec(),
            val_idx: self.split(Split::Val).to_vec(),
            test_idx: self.split(Split::Test).to_vec(),
        }
    }

    fn slice<'a, T: bytemuck::Pod>(&'a self, slot: &'a Slot<T>) -> &'a [T] {
        match slot {
            // Alignment and bounds were checked when the slot was made.
            Slot::Mapped { start, len_bytes } => {
                bytemuck::cast_slice(&self.mmap[*start..*start + *len_bytes])
            }
            Slot::Owned(v) => v,
        }
    }

    fn open_inner(path: &Path, verify: bool) -> Result<Dataset, Error> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let not_st = |reason: String| Error::NotSafetensors {
            path: path.to_path_buf(),
            reason,
        };
        if file_len < 8 {
            return Err(not_st(format!(
                "file truncated: {file_len} bytes, shorter than the 8-byte header length field"
            )));
        }
        // SAFETY: the mapping is read-only and this crate only ever replaces dataset files by rename, never
        // rewrites them in place. Another process truncating the file under us could still fault; that is
        // the usual, accepted mmap caveat.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let header_len = u64::from_le_bytes(mmap[..8].try_into().expect("8 bytes checked above"));
        if header_len > file_len - 8 {
            return Err(not_st(format!(
                "header length field says {header_len} bytes but only {} bytes follow; the file is \
                 truncated or not a safetensors file",
                file_len - 8
            )));
        }
        let (n, st_meta) = SafeTensors::read_metadata(&mmap).map_err(|e| match e {
            SafeTensorError::MetadataIncompleteBuffer => not_st(size_mismatch(&mmap, header_len)),
            other => not_st(other.to_string()),
        })?;
        let data_start = 8 + n;

        let meta = parse_metadata(path, st_meta.metadata())?;

        let info = |name: &str| {
            st_meta
                .info(name)
                .ok_or_else(|| Error::tensor(path, name, "is missing from the file"))
        };
        let check = |name: &str,
                     dtype: Dtype,
                     shape: &[usize],
                     why: &str|
         -> Result<(usize, usize), Error> {
            let i = info(name)?;
            if i.dtype != dtype {
                return Err(Error::tensor(
                    path,
                    name,
                    format!("has dtype {:?}, expected {dtype:?}", i.dtype),
                ));
            }
            if i.shape != shape {
                return Err(Error::tensor(
                    path,
                    name,
                    format!("has shape {:?}, expected {shape:?} ({why})", i.shape),
                ));
            }
            // read_metadata checked that offsets tile the data section exactly.
            Ok((
                data_start + i.data_offsets.0,
                i.data_offsets.1 - i.data_offsets.0,
            ))
        };
        let (nn, ne, nf) = (meta.num_nodes, meta.num_edges, meta.feat_dim);
        let indptr_r = check(
            "indptr",
            Dtype::I64,
            &[nn + 1],
            "num_nodes + 1 from metadata",
        )?;
        let indices_r = check("indices", Dtype::I32, &[ne], "num_edges from metadata")?;
        let feats_r = check(
            "features",
            meta.feature_dtype.safetensors_dtype(),
            &[nn, nf],
            "num_nodes, feat_dim from metadata",
        )?;
        let labels_r = check("labels", Dtype::I64, &[nn], "num_nodes from metadata")?;
        let mut split_r = [(0, 0); 3];
        for (s, r) in Split::ALL.iter().zip(split_r.iter_mut()) {
            let name = s.tensor_name();
            let i = info(name)?;
            if i.dtype != Dtype::I64 || i.shape.len() != 1 {
                return Err(Error::tensor(
                    path,
                    name,
                    format!(
                        "has dtype {:?} and shape {:?}, expected I64 with one dimension",
                        i.dtype, i.shape
                    ),
                ));
            }
            *r = (
                data_start + i.data_offsets.0,
                i.data_offsets.1 - i.data_offsets.0,
            );
        }

        if verify {
            let all = [
                ("indptr", indptr_r),
                ("indices", indices_r),
                ("features", feats_r),
                ("labels", labels_r),
                ("train_idx", split_r[0]),
                ("val_idx", split_r[1]),
                ("test_idx", split_r[2]),
            ];
            for (name, (start, len)) in all {
                let Some(expected) = meta.checksums.get(name) else {
                    return Err(Error::metadata(
                        path,
                        format!("no checksum recorded for tensor '{name}'"),
                    ));
                };
                let actual = checksum(&mmap[start..start + len]);
                if !expected.eq_ignore_ascii_case(&actual) {
                    return Err(Error::Checksum {
                        path: path.to_path_buf(),
                        tensor: name.to_string(),
                        expected: expected.clone(),
                        actual,
                    });
                }
            }
        }

        let features = match meta.feature_dtype {
            FeatureDtype::F32 => FeatureSlot::F32(make_slot(&mmap, feats_r)),
            FeatureDtype::F16 => FeatureSlot::F16(make_slot(&mmap, feats_r)),
            FeatureDtype::BF16 => FeatureSlot::BF16(make_slot(&mmap, feats_r)),
        };
        let ds = Dataset {
            path: path.to_path_buf(),
            indptr: make_slot(&mmap, indptr_r),
            indices: make_slot(&mmap, indices_r),
            features,
            labels: make_slot(&mmap, labels_r),
            splits: split_r.map(|r| make_slot(&mmap, r)),
            mmap,
            meta,
        };
        validate_contents(
            path,
            &ds.meta,
            ds.csr(),
            ds.labels(),
            [
                ds.split(Split::Train),
                ds.split(Split::Val),
                ds.split(Split::Test),
            ],
        )?;
        Ok(ds)
    }
}

fn make_slot<T: bytemuck::Pod>(mmap: &Mmap, (start, len_bytes): (usize, usize)) -> Slot<T> {
    let bytes = &mmap[start..start + len_bytes];
    match bytemuck::try_cast_slice::<u8, T>(bytes) {
        Ok(_) => Slot::Mapped { start, len_bytes },
        // Files from other writers may place a tensor at an unaligned offset; copy it once into an aligned
        // buffer instead of failing. The length is a whole number of elements (safetensors checked it).
        Err(_) => Slot::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}

/// Explains why the tensor data does not end at the end of the file: truncated, or trailing bytes.
fn size_mismatch(file: &[u8], header_len: u64) -> String {
    let header = &file[8..8 + header_len as usize];
    let end = serde_json::from_slice::<HashMap<String, serde_json::Value>>(header)
        .ok()
        .and_then(|h| {
            h.values()
                .filter_map(|v| v.get("data_offsets")?.get(1)?.as_u64())
                .max()
        });
    match end {
        Some(end) => {
            let needed = 8 + header_len + end;
            let have = file.len() as u64;
            if have < needed {
                format!(
                    "file truncated: the header describes {needed} bytes but the file has {have}"
                )
            } else {
                format!("{} trailing bytes after the last tensor", have - needed)
            }
        }
        None => "tensor data does not cover the file exactly".to_string(),
    }
}

fn parse_metadata(path: &Path, map: &Option<HashMap<String, String>>) -> Result<Metadata, Error> {
    let Some(json) = map.as_ref().and_then(|m| m.get(METADATA_KEY)) else {
        return Err(Error::metadata(
            path,
            format!(
                "no '{METADATA_KEY}' entry in the safetensors __metadata__; not a physalia dataset file"
            ),
        ));
    };
    let value: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| Error::metadata(path, format!("invalid JSON: {e}")))?;
    // Check the version before the fields, so a future file says "unsupported version" rather than
    // complaining about a field it renamed.
    match value.get("format_version").and_then(|v| v.as_u64()) {
        None => {
            return Err(Error::metadata(
                path,
                "field 'format_version' is missing or not a number",
            ));
        }
        Some(v) if v != FORMAT_VERSION as u64 => {
            return Err(Error::metadata(
                path,
                format!(
                    "format_version {v} is not supported (this build reads version {FORMAT_VERSION})"
                ),
            ));
        }
        Some(_) => {}
    }
    let meta: Metadata = serde_json::from_value(value)
        .map_err(|e| Error::metadata(path, format!("invalid: {e}")))?;
    check_node_limit(path, &meta)?;
    Ok(meta)
}

/// Node ids are i32 in `indices`; also keeps `num_nodes + 1` from overflowing on a hostile header.
fn check_node_limit(origin: &Path, meta: &Metadata) -> Result<(), Error> {
    let limit = i32::MAX as usize + 1;
    if meta.num_nodes > limit {
        return Err(Error::metadata(
            origin,
            format!(
                "num_nodes {} exceeds the {limit} nodes that i32 ids can address",
                meta.num_nodes
            ),
        ));
    }
    Ok(())
}

/// Content invariants shared by [`Dataset::open`] and [`OwnedDataset::validate`]; lengths have already
/// been checked against the metadata.
fn validate_contents(
    origin: &Path,
    meta: &Metadata,
    csr: Csr<'_>,
    labels: &[i64],
    splits: [&[i64]; 3],
) -> Result<(), Error> {
    csr.validate_at(origin)?;
    let n = meta.num_nodes;
    let c = meta.num_classes as i64;
    if let Some((i, &l)) = labels.iter().enumerate().find(|&(_, &l)| l < -1 || l >= c) {
        return Err(Error::tensor(
            origin,
            "labels",
            format!("entry {i} = {l} is out of range -1..{c} (-1 marks an unlabelled node)"),
        ));
    }
    // One byte per node: which split (1-based) claimed it first.
    let mut owner = vec![0u8; n];
    for (k, (split, ids)) in Split::ALL.iter().zip(splits).enumerate() {
        let tensor = split.tensor_name();
        for (i, &v) in ids.iter().enumerate() {
            if v < 0 || v as u64 >= n as u64 {
                return Err(Error::tensor(
                    origin,
                    tensor,
                    format!("entry {i} = {v} is out of range 0..{n}"),
                ));
            }
            let slot = &mut owner[v as usize];
            if *slot == k as u8 + 1 {
                return Err(Error::tensor(
                    origin,
                    tensor,
                    format!("node {v} appears more than once (again at entry {i})"),
                ));
            }
            if *slot != 0 {
                let other = Split::ALL[*slot as usize - 1].tensor_name();
                return Err(Error::tensor(
                    origin,
                    tensor,
                    format!(
                        "node {v} is in both '{other}' and '{tensor}'; splits must not overlap"
                    ),
                ));
            }
            *slot = k as u8 + 1;
            if labels[v as usize] < 0 {
                return Err(Error::tensor(
                    origin,
                    tensor,
                    format!(
                        "node {v} (entry {i}) is unlabelled (label -1); split nodes need a label"
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn compute_stats(
    meta: &Metadata,
    csr: Csr<'_>,
    splits: [&[i64]; 3],
    file_bytes: u64,
) -> GraphStats {
    let n = csr.num_nodes();
    let (mut dmin, mut dmax, mut isolated) = (usize::MAX, 0usize, 0usize);
    for w in csr.indptr.windows(2) {
        let d = (w[1] - w[0]) as usize;
        dmin = dmin.min(d);
        dmax = dmax.max(d);
        isolated += (d == 0) as usize;
    }
    GraphStats {
        num_nodes: n,
        num_edges: csr.num_edges(),
        feat_dim: meta.feat_dim,
        num_classes: meta.num_classes,
        feature_dtype: meta.feature_dtype,
        directed: meta.directed,
        degree_min: if n == 0 { 0 } else { dmin },
        degree_mean: if n == 0 {
            0.0
        } else {
            csr.num_edges() as f64 / n as f64
        },
        degree_max: dmax,
        isolated_nodes: isolated,
        train_size: splits[0].len(),
        val_size: splits[1].len(),
        test_size: splits[2].len(),
        file_bytes,
    }
}
