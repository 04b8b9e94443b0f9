//! The dataset file: round trips, and one test per way a file can be bad, each checking that the message
//! names the file, the tensor or field, and the problem.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use physalia_graph::{
    Dataset, Error, FeatureDtype, FeatureView, Features, Metadata, OwnedDataset, Split, checksum,
    csr_from_edge_pairs,
};
use safetensors::tensor::{Dtype, TensorView};

/// 5 nodes, undirected path 0-1-2-3 plus isolated node 4; 2 features; 3 classes.
fn small() -> OwnedDataset {
    let csr = csr_from_edge_pairs(5, &[(0, 1), (1, 2), (2, 3)], true);
    let feats = vec![1.0, 0.0, 0.5, 0.5, 0.0, 1.0, 2.0, 2.0, -1.0, 3.0];
    OwnedDataset::from_parts(
        "small",
        "test",
        false,
        csr,
        Features::F32(feats),
        2,
        vec![0, 1, 2, 0, -1],
        [vec![0, 1], vec![2], vec![3]],
    )
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn round_trip_f32_f16_bf16() {
    let dir = tmp();
    for dtype in [FeatureDtype::F32, FeatureDtype::F16, FeatureDtype::BF16] {
        let ds = small().convert_features(dtype);
        let path = dir.path().join(format!("small-{dtype}.safetensors"));
        ds.write(&path).unwrap();
        let back = Dataset::open(&path).unwrap();
        assert_eq!(back.meta().num_nodes, 5);
        assert_eq!(back.meta().num_edges, 6);
        assert_eq!(back.meta().feature_dtype, dtype);
        assert_eq!(back.meta().checksums.len(), 7);
        assert_eq!(back.csr().indptr, &ds.indptr[..]);
        assert_eq!(back.csr().indices, &ds.indices[..]);
        assert_eq!(back.labels(), &ds.labels[..]);
        assert_eq!(back.split(Split::Train), &[0, 1]);
        assert_eq!(back.split(Split::Val), &[2]);
        assert_eq!(back.split(Split::Test), &[3]);
        assert_eq!(back.features().dtype(), dtype);
        assert_eq!(
            back.features_f32().as_ref(),
            ds.features.view().to_f32().as_ref()
        );
        if dtype == FeatureDtype::F32 {
            // Borrowed straight from the mapping, no copy.
            assert!(matches!(back.features_f32(), std::borrow::Cow::Borrowed(_)));
        }
        let mut owned = back.to_owned_dataset();
        owned.meta.checksums.clear();
        assert_eq!(owned, ds);
        Dataset::open_unverified(&path).unwrap();
    }
}

#[test]
fn stats_describe_the_graph() {
    let dir = tmp();
    let path = dir.path().join("s.safetensors");
    small().write(&path).unwrap();
    let s = Dataset::open(&path).unwrap().stats();
    assert_eq!(
        (s.num_nodes, s.num_edges, s.feat_dim, s.num_classes),
        (5, 6, 2, 3)
    );
    assert_eq!((s.degree_min, s.degree_max, s.isolated_nodes), (0, 2, 1));
    assert!((s.degree_mean - 1.2).abs() < 1e-12);
    assert_eq!((s.train_size, s.val_size, s.test_size), (2, 1, 1));
    assert_eq!(s.file_bytes, std::fs::metadata(&path).unwrap().len());
}

#[test]
fn tensors_are_aligned_in_the_file() {
    // The writer orders tensors by descending alignment after an 8-byte-padded header, so every mapped
    // slice is naturally aligned and nothing is copied.
    let dir = tmp();
    let path = dir.path().join("a.safetensors");
    small()
        .convert_features(FeatureDtype::F16)
        .write(&path)
        .unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(n % 8, 0);
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    for (name, info) in meta.tensors() {
        let align = info.dtype.bitsize() / 8;
        assert_eq!(
            (8 + n + info.data_offsets.0) % align,
            0,
            "{name} misaligned"
        );
    }
}

#[test]
fn write_replaces_atomically_and_leaves_no_temp_files() {
    let dir = tmp();
    let path = dir.path().join("d.safetensors");
    small().write(&path).unwrap();
    let mut other = small();
    other.meta.name = "second".into();
    other.write(&path).unwrap();
    assert_eq!(Dataset::open(&path).unwrap().meta().name, "second");
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("d.safetensors")]);
}

#[test]
fn write_refuses_an_invalid_dataset_and_leaves_nothing() {
    let dir = tmp();
    let path = dir.path().join("bad.safetensors");
    let mut ds = small();
    ds.indices[0] = 9;
    let err = ds.write(&path).unwrap_err().to_string();
    assert!(
        err.contains("bad.safetensors: tensor 'indices': entry 0 = 9 is out of range 0..5"),
        "{err}"
    );
    assert!(!path.exists());
}

fn expect_invalid(ds: OwnedDataset, needle: &str) {
    let err = ds.validate().unwrap_err().to_string();
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
    assert!(err.contains("in-memory dataset 'small'"), "{err}");
}

#[test]
fn validate_catches_each_content_error() {
    let mut d = small();
    d.indptr[2] = 0;
    expect_invalid(d, "tensor 'indptr': decreases at entry 2: 0 after 1");

    let mut d = small();
    d.indices.swap(1, 2);
    expect_invalid(d, "tensor 'indices': row 1 is not strictly ascending");

    let mut d = small();
    d.labels[1] = 3;
    expect_invalid(d, "tensor 'labels': entry 1 = 3 is out of range -1..3");

    let mut d = small();
    d.test_idx = vec![5];
    expect_invalid(d, "tensor 'test_idx': entry 0 = 5 is out of range 0..5");

    let mut d = small();
    d.train_idx = vec![0, 0];
    expect_invalid(d, "tensor 'train_idx': node 0 appears more than once");

    let mut d = small();
    d.test_idx = vec![1];
    expect_invalid(d, "node 1 is in both 'train_idx' and 'test_idx'");

    let mut d = small();
    d.val_idx = vec![4];
    expect_invalid(d, "tensor 'val_idx': node 4 (entry 0) is unlabelled");

    let mut d = small();
    d.meta.feat_dim = 3;
    expect_invalid(
        d,
        "tensor 'features': has 10 entries, expected num_nodes * feat_dim = 15",
    );

    let mut d = small();
    d.meta.feature_dtype = FeatureDtype::F16;
    expect_invalid(
        d,
        "tensor 'features': holds f32 values but metadata feature_dtype is f16",
    );

    let mut d = small();
    d.meta.num_edges = 7;
    expect_invalid(d, "tensor 'indices': has 6 entries, expected num_edges = 7");
}

// --- hand-made files, to reach every check on open --------------------------------------------------

struct Raw {
    tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
    meta: serde_json::Value,
}

impl Raw {
    /// The tensors and metadata `small()` would be written with, checksums included.
    fn from_small() -> Raw {
        let d = small();
        let b = |v: &[i64]| bytemuck::cast_slice::<i64, u8>(v).to_vec();
        let feats = match &d.features {
            Features::F32(v) => bytemuck::cast_slice::<f32, u8>(v).to_vec(),
            _ => unreachable!(),
        };
        let tensors = vec![
            ("indptr".into(), Dtype::I64, vec![6], b(&d.indptr)),
            (
                "indices".into(),
                Dtype::I32,
                vec![6],
                bytemuck::cast_slice::<i32, u8>(&d.indices).to_vec(),
            ),
            ("features".into(), Dtype::F32, vec![5, 2], feats),
            ("labels".into(), Dtype::I64, vec![5], b(&d.labels)),
            ("train_idx".into(), Dtype::I64, vec![2], b(&d.train_idx)),
            ("val_idx".into(), Dtype::I64, vec![1], b(&d.val_idx)),
            ("test_idx".into(), Dtype::I64, vec![1], b(&d.test_idx)),
        ];
        let meta = serde_json::to_value(&d.meta).unwrap();
        let mut raw = Raw { tensors, meta };
        raw.rehash();
        raw
    }

    fn rehash(&mut self) {
        let sums: serde_json::Map<String, serde_json::Value> = self
            .tensors
            .iter()
            .map(|(n, _, _, b)| (n.clone(), checksum(b).into()))
            .collect();
        self.meta["checksums"] = sums.into();
    }

    fn set(&mut self, name: &str, dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>) {
        let t = self.tensors.iter_mut().find(|t| t.0 == name).unwrap();
        *t = (name.into(), dtype, shape, bytes);
    }

    fn write(&self, path: &Path) {
        let views: Vec<(String, TensorView<'_>)> = self
            .tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        let info = HashMap::from([("physalia".to_string(), self.meta.to_string())]);
        let bytes = safetensors::serialize(views, Some(info)).unwrap();
        std::fs::write(path, bytes).unwrap();
    }
}

fn open_err(raw: &Raw) -> String {
    let dir = tmp();
    let path = dir.path().join("cora.safetensors");
    raw.write(&path);
    let err = Dataset::open(&path).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("cora.safetensors"),
        "message lacks the path: {msg}"
    );
    msg
}

fn assert_has(msg: &str, needle: &str) {
    assert!(msg.contains(needle), "expected {needle:?} in: {msg}");
}

#[test]
fn the_hand_made_baseline_opens() {
    let dir = tmp();
    let path = dir.path().join("ok.safetensors");
    Raw::from_small().write(&path);
    let ds = Dataset::open(&path).unwrap();
    assert_eq!(ds.labels(), &[0, 1, 2, 0, -1]);
}

#[test]
fn open_rejects_truncated_and_foreign_files() {
    let dir = tmp();
    let good = dir.path().join("good.safetensors");
    small().write(&good).unwrap();
    let bytes = std::fs::read(&good).unwrap();

    let p = dir.path().join("cora.safetensors");
    std::fs::write(&p, &bytes[..bytes.len() - 3]).unwrap();
    let msg = Dataset::open(&p).unwrap_err().to_string();
    assert_has(
        &msg,
        "cora.safetensors: not a valid dataset file: file truncated",
    );

    std::fs::write(&p, &bytes[..5]).unwrap();
    assert_has(
        &Dataset::open(&p).unwrap_err().to_string(),
        "file truncated: 5 bytes",
    );

    std::fs::write(&p, &bytes[..100]).unwrap();
    assert_has(
        &Dataset::open(&p).unwrap_err().to_string(),
        "truncated or not a safetensors file",
    );

    let mut longer = bytes.clone();
    longer.extend_from_slice(&[0; 4]);
    std::fs::write(&p, &longer).unwrap();
    assert_has(
        &Dataset::open(&p).unwrap_err().to_string(),
        "4 trailing bytes",
    );

    std::fs::write(&p, b"hello, this is a csv file\n1,2\n").unwrap();
    assert_has(
        &Dataset::open(&p).unwrap_err().to_string(),
        "not a valid dataset file",
    );

    let mut garbage = 16u64.to_le_bytes().to_vec();
    garbage.extend_from_slice(b"{not json at all");
    std::fs::write(&p, &garbage).unwrap();
    assert_has(
        &Dataset::open(&p).unwrap_err().to_string(),
        "not a valid dataset file",
    );

    let missing = dir.path().join("nope.safetensors");
    assert_has(
        &Dataset::open(&missing).unwrap_err().to_string(),
        "nope.safetensors: ",
    );
}

#[test]
fn open_rejects_missing_or_mistyped_tensors() {
    let mut raw = Raw::from_small();
    raw.tensors.retain(|t| t.0 != "labels");
    assert_has(&open_err(&raw), "tensor 'labels': is missing from the file");

    let mut raw = Raw::from_small();
    raw.set("indices", Dtype::I64, vec![6], vec![0; 48]);
    assert_has(
        &open_err(&raw),
        "tensor 'indices': has dtype I64, expected I32",
    );

    let mut raw = Raw::from_small();
    raw.set("features", Dtype::F32, vec![2, 5], vec![0; 40]);
    assert_has(
        &open_err(&raw),
        "tensor 'features': has shape [2, 5], expected [5, 2]",
    );

    let mut raw = Raw::from_small();
    raw.set("features", Dtype::F16, vec![5, 2], vec![0; 20]);
    assert_has(
        &open_err(&raw),
        "tensor 'features': has dtype F16, expected F32",
    );

    let mut raw = Raw::from_small();
    raw.set("labels", Dtype::I64, vec![4], vec![0; 32]);
    assert_has(
        &open_err(&raw),
        "tensor 'labels': has shape [4], expected [5]",
    );

    let mut raw = Raw::from_small();
    raw.set("indptr", Dtype::I64, vec![5], vec![0; 40]);
    assert_has(
        &open_err(&raw),
        "tensor 'indptr': has shape [5], expected [6]",
    );

    let mut raw = Raw::from_small();
    raw.set(
        "val_idx",
        Dtype::I64,
        vec![1, 1],
        2i64.to_le_bytes().to_vec(),
    );
    assert_has(
        &open_err(&raw),
        "tensor 'val_idx': has dtype I64 and shape [1, 1], expected I64 with one dimension",
    );
}

#[test]
fn open_rejects_bad_metadata() {
    let mut raw = Raw::from_small();
    raw.meta["format_version"] = 2.into();
    assert_has(
        &open_err(&raw),
        "metadata: format_version 2 is not supported",
    );

    let mut raw = Raw::from_small();
    raw.meta.as_object_mut().unwrap().remove("format_version");
    assert_has(
        &open_err(&raw),
        "metadata: field 'format_version' is missing",
    );

    let mut raw = Raw::from_small();
    raw.meta.as_object_mut().unwrap().remove("num_nodes");
    assert_has(
        &open_err(&raw),
        "metadata: invalid: missing field `num_nodes`",
    );

    let mut raw = Raw::from_small();
    raw.meta["num_nodes"] = u64::MAX.into();
    assert_has(
        &open_err(&raw),
        "metadata: num_nodes 18446744073709551615 exceeds",
    );

    let mut raw = Raw::from_small();
    raw.meta["feature_dtype"] = "f64".into();
    assert_has(&open_err(&raw), "metadata: invalid: unknown variant `f64`");

    // Not a physalia file at all: a plain safetensors file with no metadata.
    let dir = tmp();
    let p = dir.path().join("model.safetensors");
    let v = TensorView::new(Dtype::F32, vec![1], &[0u8; 4]).unwrap();
    std::fs::write(&p, safetensors::serialize([("w", v)], None).unwrap()).unwrap();
    assert_has(
        &Dataset::open(&p).unwrap_err().to_string(),
        "model.safetensors: metadata: no 'physalia' entry",
    );

    // Invalid JSON inside the metadata string.
    let mut raw = Raw::from_small();
    raw.meta = serde_json::Value::String("{oops".into());
    let dir = tmp();
    let p = dir.path().join("cora.safetensors");
    let views: Vec<(String, TensorView<'_>)> = raw
        .tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let info = HashMap::from([("physalia".to_string(), "{oops".to_string())]);
    std::fs::write(&p, safetensors::serialize(views, Some(info)).unwrap()).unwrap();
    assert_has(
        &Dataset::open(&p).unwrap_err().to_string(),
        "cora.safetensors: metadata: invalid JSON",
    );
}

#[test]
fn open_verifies_checksums_and_open_unverified_skips_them() {
    let mut raw = Raw::from_small();
    // Flip a feature value without updating its checksum: structurally fine, contents changed.
    raw.set("features", Dtype::F32, vec![5, 2], vec![0; 40]);
    let dir = tmp();
    let p = dir.path().join("cora.safetensors");
    raw.write(&p);
    let err = Dataset::open(&p).unwrap_err();
    assert!(matches!(&err, Error::Checksum { tensor, .. } if tensor == "features"));
    assert_has(
        &err.to_string(),
        "cora.safetensors: tensor 'features': checksum mismatch",
    );
    Dataset::open_unverified(&p).unwrap();

    let mut raw = Raw::from_small();
    raw.meta["checksums"]
        .as_object_mut()
        .unwrap()
        .remove("labels");
    assert_has(
        &open_err(&raw),
        "metadata: no checksum recorded for tensor 'labels'",
    );
}

#[test]
fn open_validates_contents() {
    let ints = |v: &[i32]| bytemuck::cast_slice::<i32, u8>(v).to_vec();
    let longs = |v: &[i64]| bytemuck::cast_slice::<i64, u8>(v).to_vec();

    let mut raw = Raw::from_small();
    raw.set("indices", Dtype::I32, vec![6], ints(&[1, 0, 5000, 1, 3, 2]));
    raw.rehash();
    assert_has(
        &open_err(&raw),
        "cora.safetensors: tensor 'indices': entry 2 = 5000 is out of range 0..5",
    );

    let mut raw = Raw::from_small();
    raw.set("indices", Dtype::I32, vec![6], ints(&[1, 2, 0, 1, 3, 2]));
    raw.rehash();
    assert_has(
        &open_err(&raw),
        "tensor 'indices': row 1 is not strictly ascending: unsorted entry 2 = 0 after 2",
    );

    let mut raw = Raw::from_small();
    raw.set("indptr", Dtype::I64, vec![6], longs(&[1, 1, 3, 5, 6, 6]));
    raw.rehash();
    assert_has(&open_err(&raw), "tensor 'indptr': entry 0 = 1, expected 0");

    let mut raw = Raw::from_small();
    raw.set("indptr", Dtype::I64, vec![6], longs(&[0, 1, 3, 5, 6, 5]));
    raw.rehash();
    assert_has(&open_err(&raw), "tensor 'indptr': decreases at entry 5");

    let mut raw = Raw::from_small();
    raw.set("labels", Dtype::I64, vec![5], longs(&[0, 1, 7, 0, -1]));
    raw.rehash();
    assert_has(
        &open_err(&raw),
        "tensor 'labels': entry 2 = 7 is out of range -1..3",
    );

    let mut raw = Raw::from_small();
    raw.set("test_idx", Dtype::I64, vec![1], longs(&[0]));
    raw.rehash();
    assert_has(
        &open_err(&raw),
        "tensor 'test_idx': node 0 is in both 'train_idx' and 'test_idx'",
    );

    let mut raw = Raw::from_small();
    raw.set("test_idx", Dtype::I64, vec![1], longs(&[4]));
    raw.rehash();
    assert_has(
        &open_err(&raw),
        "tensor 'test_idx': node 4 (entry 0) is unlabelled",
    );

    let mut raw = Raw::from_small();
    raw.set("val_idx", Dtype::I64, vec![2], longs(&[2, 2]));
    raw.rehash();
    assert_has(
        &open_err(&raw),
        "tensor 'val_idx': node 2 appears more than once (again at entry 1)",
    );

    let mut raw = Raw::from_small();
    raw.set("train_idx", Dtype::I64, vec![1], longs(&[-3]));
    raw.rehash();
    assert_has(
        &open_err(&raw),
        "tensor 'train_idx': entry 0 = -3 is out of range 0..5",
    );
}

#[test]
fn misaligned_tensors_are_copied_not_rejected() {
    // A file from another writer with a 2-byte tensor first pushes the 8-byte tensors off alignment.
    let mut raw = Raw::from_small();
    raw.tensors
        .push(("zz_extra".into(), Dtype::I16, vec![1], vec![7, 0]));
    let views: Vec<(String, Vec<u8>)> = raw
        .tensors
        .iter()
        .map(|t| (t.0.clone(), t.3.clone()))
        .collect();
    // Lay the file out by hand in the order given (extra first), which safetensors' writer would not do.
    let mut order: Vec<usize> = (0..raw.tensors.len()).collect();
    order.rotate_right(1);
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::json!({ "physalia": raw.meta.to_string() }),
    );
    let mut off = 0;
    let mut data = Vec::new();
    for &i in &order {
        let (name, dtype, shape, bytes) = &raw.tensors[i];
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + bytes.len()]}),
        );
        off += bytes.len();
        data.extend_from_slice(&views[i].1);
    }
    let mut h = serde_json::to_vec(&header).unwrap();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&h);
    file.extend_from_slice(&data);
    let dir = tmp();
    let p: PathBuf = dir.path().join("odd.safetensors");
    std::fs::write(&p, file).unwrap();
    let ds = Dataset::open(&p).unwrap();
    assert_eq!(ds.labels(), &[0, 1, 2, 0, -1]);
    assert_eq!(ds.csr().indices, &small().indices[..]);
    match ds.features() {
        FeatureView::F32(v) => assert_eq!(v[9], 3.0),
        _ => panic!("expected f32"),
    }
}

#[test]
fn metadata_json_uses_lowercase_dtype_names() {
    let m: Metadata = small().meta;
    let j = serde_json::to_value(&m).unwrap();
    assert_eq!(j["feature_dtype"], "f32");
    assert_eq!(serde_json::to_value(FeatureDtype::BF16).unwrap(), "bf16");
    assert_eq!(j["format_version"], 1);
}
