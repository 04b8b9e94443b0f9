//! Importer tests: small inputs written to temp folders, checked exactly; then one test per kind of bad
//! input, checking that the message names the file and (for text) the line.

use std::io::Write;
use std::path::Path;

use flate2::Compression;
use flate2::write::GzEncoder;

use super::*;
use crate::format::{Features, Split};
use crate::npy;

fn put(dir: &Path, name: &str, text: &str) {
    let p = dir.join(name);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, text).unwrap();
}

fn put_gz(dir: &Path, name: &str, text: &str) {
    let p = dir.join(name);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    let mut enc = GzEncoder::new(File::create(p).unwrap(), Compression::fast());
    enc.write_all(text.as_bytes()).unwrap();
    enc.finish().unwrap();
}

const FEATS: [f32; 12] = [1., 0., 1., 0., 2., 2., 0., 0., 0., 3., 0., 1.];

/// 4 nodes, 3 features, 3 classes, edges 0-1, 1-2, 2-0 (given twice), 3-1, one self loop.
fn generic_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    put(p, "edges.csv", "src,dst\n0,1\n1,2\n2,0\n0,2\n3,1\n3,3\n");
    put(p, "labels.csv", "node,label\n0,0\n1,2\n3,-1\n2,1\n");
    let bin: Vec<u8> = FEATS.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(p.join("feat.bin"), bin).unwrap();
    put(
        p,
        "features.json",
        r#"{"file": "feat.bin", "num_nodes": 4, "feat_dim": 3, "dtype": "float32", "byte_order": "little"}"#,
    );
    put(p, "train_idx.txt", "0\n1\n");
    put(p, "val_idx.txt", "2\n");
    put(p, "test_idx.txt", "\n");
    d
}

fn err_of(r: Result<OwnedDataset, Error>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

fn assert_has(msg: &str, needle: &str) {
    assert!(msg.contains(needle), "expected {needle:?} in: {msg}");
}

#[test]
fn generic_imports_exactly() {
    let d = generic_dir();
    let ds = generic(d.path(), &ImportOptions::default()).unwrap();
    // Undirected: 0:{1,2} 1:{0,2,3} 2:{0,1} 3:{1}; the self loop 3-3 and the repeated 0-2 are dropped.
    assert_eq!(ds.indptr, vec![0, 2, 5, 7, 8]);
    assert_eq!(ds.indices, vec![1, 2, 0, 2, 3, 0, 1, 1]);
    assert_eq!(ds.features, Features::F32(FEATS.to_vec()));
    assert_eq!(ds.labels, vec![0, 2, 1, -1]);
    assert_eq!(ds.split(Split::Train), &[0, 1]);
    assert_eq!(ds.split(Split::Val), &[2]);
    assert!(ds.split(Split::Test).is_empty());
    let m = &ds.meta;
    assert_eq!(
        (m.num_nodes, m.num_edges, m.feat_dim, m.num_classes),
        (4, 8, 3, 3)
    );
    assert!(!m.directed);
    assert!(m.source.starts_with("import:generic "));
    assert_eq!(m.name, d.path().file_name().unwrap().to_string_lossy());
    ds.validate().unwrap();
}

#[test]
fn generic_directed_normalized_and_f16() {
    let d = generic_dir();
    let opts = ImportOptions {
        name: Some("tiny".into()),
        undirected: false,
        feature_dtype: FeatureDtype::F16,
        row_normalize: true,
        split_name: None,
    };
    let ds = generic(d.path(), &opts).unwrap();
    // Row v = in-neighbours: edges 0->1, 1->2, 2->0, 0->2, 3->1.
    assert_eq!(ds.indptr, vec![0, 1, 3, 5, 5]);
    assert_eq!(ds.indices, vec![2, 0, 3, 0, 1]);
    assert!(ds.meta.directed);
    assert_eq!(ds.meta.name, "tiny");
    let f = ds.features.view().to_f32().into_owned();
    // Row 2 (all zero) stays zero; others sum to 1.
    let expect = [0.5, 0., 0.5, 0., 0.5, 0.5, 0., 0., 0., 0.75, 0., 0.25];
    assert_eq!(f, expect);
    assert_eq!(ds.meta.feature_dtype, FeatureDtype::F16);
}

#[test]
fn generic_reads_npy_inputs() {
    let d = generic_dir();
    let p = d.path();
    for f in [
        "edges.csv",
        "labels.csv",
        "features.json",
        "feat.bin",
        "train_idx.txt",
        "val_idx.txt",
    ] {
        std::fs::remove_file(p.join(f)).unwrap();
    }
    let e: Vec<u8> = [0i64, 1, 1, 2, 2, 0, 0, 2, 3, 1]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    npy::write(&p.join("edges.npy"), "<i8", &[5, 2], &e).unwrap();
    let l: Vec<u8> = [0i32, 2, 1, -1]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    npy::write(&p.join("labels.npy"), "<i4", &[4], &l).unwrap();
    let f: Vec<u8> = FEATS
        .iter()
        .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
        .collect();
    npy::write(&p.join("features.npy"), "<f2", &[4, 3], &f).unwrap();
    npy::write(
        &p.join("train_idx.npy"),
        "<i8",
        &[2],
        &[0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
    )
    .unwrap();
    npy::write(&p.join("val_idx.npy"), "<i4", &[1], &[2, 0, 0, 0]).unwrap();
    let ds = generic(p, &ImportOptions::default()).unwrap();
    assert_eq!(ds.indptr, vec![0, 2, 5, 7, 8]);
    assert_eq!(ds.indices, vec![1, 2, 0, 2, 3, 0, 1, 1]);
    assert_eq!(ds.features, Features::F32(FEATS.to_vec()));
    assert_eq!(ds.labels, vec![0, 2, 1, -1]);
    assert_eq!(ds.train_idx, vec![0, 1]);
    assert_eq!(ds.val_idx, vec![2]);
}

#[test]
fn generic_bad_edges() {
    let d = generic_dir();
    let p = d.path();
    put(p, "edges.csv", "src,dst\n0,1\n3;4\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "edges.csv:3: expected two integers 'src,dst', got \"3;4\"",
    );
    put(p, "edges.csv", "src,dst\n0,1\n\n1,7\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "edges.csv:4: destination node id 7 is out of range 0..4",
    );
    put(p, "edges.csv", "a,b\n0,1\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "edges.csv:1: expected header 'src,dst'",
    );
    put(p, "edges.csv", "src,dst\n-1,1\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "edges.csv:2: source node id -1 is out of range",
    );
    put(p, "edges.csv", "src,dst\n0,1,2\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "edges.csv:2: expected two integers",
    );

    std::fs::remove_file(p.join("edges.csv")).unwrap();
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "no edges file: expected edges.csv or edges.npy",
    );
    npy::write(
        &p.join("edges.npy"),
        "<i4",
        &[1, 2],
        &[0, 0, 0, 0, 9, 0, 0, 0],
    )
    .unwrap();
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "edges.npy: row 0: node id 9 is out of range 0..4",
    );
    npy::write(&p.join("edges.npy"), "<i4", &[2], &[0; 8]).unwrap();
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "edges.npy: has shape [2], expected [num_edges, 2]",
    );
    npy::write(&p.join("edges.npy"), "<f4", &[1, 2], &[0; 8]).unwrap();
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "edges.npy: holds floating-point values",
    );
    put(p, "edges.csv", "src,dst\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "both edges.csv and edges.npy exist",
    );
}

#[test]
fn generic_bad_features() {
    let d = generic_dir();
    let p = d.path();
    std::fs::write(p.join("feat.bin"), [0u8; 44]).unwrap();
    let msg = err_of(generic(p, &ImportOptions::default()));
    assert_has(
        &msg,
        "feat.bin: is 44 bytes, expected num_nodes * feat_dim * 4 = 4 * 3 * 4 = 48 bytes",
    );
    assert_has(&msg, "features.json");

    put(
        p,
        "features.json",
        r#"{"file": "feat.bin", "num_nodes": 4, "feat_dim": 3, "dtype": "float64"}"#,
    );
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "features.json: dtype 'float64' is not supported",
    );
    put(
        p,
        "features.json",
        r#"{"file": "feat.bin", "num_nodes": 4}"#,
    );
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "features.json: invalid features description: missing field `feat_dim`",
    );
    put(
        p,
        "features.json",
        r#"{"file": "../x.bin", "num_nodes": 4, "feat_dim": 3}"#,
    );
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "must be a file name in the same folder",
    );
    put(
        p,
        "features.json",
        r#"{"file": "feat.bin", "num_nodes": 4, "feat_dim": 3, "byte_order": "big"}"#,
    );
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "byte_order 'big' is not supported",
    );

    std::fs::remove_file(p.join("features.json")).unwrap();
    npy::write(&p.join("features.npy"), "<i4", &[4, 3], &[0; 48]).unwrap();
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "features.npy: holds integers",
    );
    npy::write(&p.join("features.npy"), "<f4", &[12], &[0; 48]).unwrap();
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "features.npy: has shape [12], expected two dimensions",
    );
}

#[test]
fn generic_bad_labels() {
    let d = generic_dir();
    let p = d.path();
    put(p, "labels.csv", "node,label\n0,0\n1,2\n2,1\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "labels.csv: no label for node 3; every node 0..4 needs a row",
    );
    put(p, "labels.csv", "node,label\n0,0\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "no label for node 1 (and 2 more nodes)",
    );
    put(p, "labels.csv", "node,label\n0,0\n1,2\n0,1\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "labels.csv:4: node 0 already has a label on line 2",
    );
    put(p, "labels.csv", "node,label\n0,0\n1,x\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "labels.csv:3: expected two integers 'node,label', got \"1,x\"",
    );
    put(p, "labels.csv", "node,label\n9,0\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "labels.csv:2: node id 9 is out of range 0..4",
    );
    put(p, "labels.csv", "node,label\n0,-2\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "labels.csv:2: label -2 is negative",
    );
}

#[test]
fn generic_bad_splits() {
    let d = generic_dir();
    let p = d.path();
    put(p, "val_idx.txt", "2\nx\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "val_idx.txt:2: expected one node id, got \"x\"",
    );
    put(p, "val_idx.txt", "2\n4\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "val_idx.txt:2: node id 4 is out of range 0..4",
    );
    put(p, "val_idx.txt", "2\n2\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "val_idx.txt:2: node 2 is listed twice (also on line 1)",
    );
    put(p, "val_idx.txt", "1\n");
    let msg = err_of(generic(p, &ImportOptions::default()));
    assert_has(
        &msg,
        "tensor 'val_idx': node 1 is in both 'train_idx' and 'val_idx'",
    );
    assert_has(&msg, &p.display().to_string());
    put(p, "val_idx.txt", "3\n");
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "tensor 'val_idx': node 3 (entry 0) is unlabelled",
    );
    std::fs::remove_file(p.join("test_idx.txt")).unwrap();
    assert_has(
        &err_of(generic(p, &ImportOptions::default())),
        "no test_idx file: expected test_idx.txt or test_idx.npy",
    );
    assert_has(
        &err_of(generic(&p.join("nope"), &ImportOptions::default())),
        "nope: is not a directory",
    );
}

/// 5 nodes, 2 features, labels with a nan; split folder "random".
fn ogb_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    put_gz(p, "raw/edge.csv.gz", "0,1\n1,2\n4,3\n2,0\n");
    put_gz(
        p,
        "raw/node-feat.csv.gz",
        "0.5,1\n-1,2.25\n3,0\n0,0\n1e-3,4\n",
    );
    put_gz(p, "raw/node-label.csv.gz", "1\n0\n2\nnan\n1\n");
    put_gz(p, "raw/num-node-list.csv.gz", "5\n");
    put_gz(p, "split/random/train.csv.gz", "0\n1\n");
    put_gz(p, "split/random/valid.csv.gz", "2\n");
    put_gz(p, "split/random/test.csv.gz", "4\n");
    d
}

#[test]
fn ogb_imports_exactly() {
    let d = ogb_dir();
    let ds = ogb(d.path(), &ImportOptions::default()).unwrap();
    // 0:{1,2} 1:{0,2} 2:{0,1} 3:{4} 4:{3}
    assert_eq!(ds.indptr, vec![0, 2, 4, 6, 7, 8]);
    assert_eq!(ds.indices, vec![1, 2, 0, 2, 0, 1, 4, 3]);
    assert_eq!(
        ds.features,
        Features::F32(vec![0.5, 1., -1., 2.25, 3., 0., 0., 0., 1e-3, 4.])
    );
    assert_eq!(ds.labels, vec![1, 0, 2, -1, 1]);
    assert_eq!(
        (
            ds.train_idx.clone(),
            ds.val_idx.clone(),
            ds.test_idx.clone()
        ),
        (vec![0, 1], vec![2], vec![4])
    );
    assert_eq!(
        (ds.meta.num_nodes, ds.meta.feat_dim, ds.meta.num_classes),
        (5, 2, 3)
    );
    assert!(ds.meta.source.starts_with("import:ogb "));

    let directed = ogb(
        d.path(),
        &ImportOptions {
            undirected: false,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(directed.indptr, vec![0, 1, 2, 3, 4, 4]);
    assert_eq!(directed.indices, vec![2, 0, 1, 4]);
}

#[test]
fn ogb_split_selection() {
    let d = ogb_dir();
    let p = d.path();
    put_gz(p, "split/time/train.csv.gz", "4\n");
    put_gz(p, "split/time/valid.csv.gz", "2\n");
    put_gz(p, "split/time/test.csv.gz", "0\n");
    assert_has(
        &err_of(ogb(p, &ImportOptions::default())),
        "contains several split folders (random, time); choose one with split_name",
    );
    let ds = ogb(
        p,
        &ImportOptions {
            split_name: Some("time".into()),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!((ds.train_idx, ds.test_idx), (vec![4], vec![0]));
    assert_has(
        &err_of(ogb(
            p,
            &ImportOptions {
                split_name: Some("nope".into()),
                ..Default::default()
            },
        )),
        "nope: is not a directory (from split_name)",
    );
    std::fs::remove_dir_all(p.join("split")).unwrap();
    std::fs::create_dir(p.join("split")).unwrap();
    assert_has(
        &err_of(ogb(p, &ImportOptions::default())),
        "split: contains no split folder",
    );
}

#[test]
fn ogb_bad_inputs() {
    let opts = ImportOptions::default();
    let d = ogb_dir();
    let p = d.path();
    put_gz(p, "raw/edge.csv.gz", "0,1\n1,9\n");
    assert_has(
        &err_of(ogb(p, &opts)),
        "edge.csv.gz:2: destination node id 9 is out of range 0..5",
    );
    put_gz(p, "raw/edge.csv.gz", "0,1\n1 2\n");
    assert_has(
        &err_of(ogb(p, &opts)),
        "edge.csv.gz:2: expected two integers 'src,dst', got \"1 2\"",
    );

    let d = ogb_dir();
    let p = d.path();
    put_gz(p, "raw/node-feat.csv.gz", "0.5,1\n-1\n3,0\n0,0\n1,4\n");
    assert_has(
        &err_of(ogb(p, &opts)),
        "node-feat.csv.gz:2: expected 2 comma-separated floats (as on the first row), got 1",
    );
    put_gz(p, "raw/node-feat.csv.gz", "0.5,1\n-1,abc\n3,0\n0,0\n1,4\n");
    assert_has(
        &err_of(ogb(p, &opts)),
        "node-feat.csv.gz:2: expected a float, got \"abc\" (field 2)",
    );
    put_gz(p, "raw/node-feat.csv.gz", "0.5,1\n3,0\n0,0\n1,4\n");
    assert_has(&err_of(ogb(p, &opts)), "node-feat.csv.gz: has 4 rows but");
    std::fs::write(p.join("raw/node-feat.csv.gz"), b"not gzip at all").unwrap();
    assert_has(
        &err_of(ogb(p, &opts)),
        "node-feat.csv.gz: read failed after line 0",
    );

    let d = ogb_dir();
    let p = d.path();
    put_gz(p, "raw/node-label.csv.gz", "1\n0\n2\nnan\n");
    assert_has(
        &err_of(ogb(p, &opts)),
        "node-label.csv.gz: has 4 labels, expected one per node = 5",
    );
    put_gz(p, "raw/node-label.csv.gz", "1\n0\ncat\nnan\n1\n");
    assert_has(
        &err_of(ogb(p, &opts)),
        "node-label.csv.gz:3: expected an integer label or nan, got \"cat\"",
    );
    put_gz(p, "raw/node-label.csv.gz", "1\n0,1\n2\nnan\n1\n");
    assert_has(
        &err_of(ogb(p, &opts)),
        "node-label.csv.gz:2: expected one label per line",
    );

    let d = ogb_dir();
    let p = d.path();
    put_gz(p, "split/random/test.csv.gz", "4\n3\n");
    assert_has(
        &err_of(ogb(p, &opts)),
        "tensor 'test_idx': node 3 (entry 1) is unlabelled",
    );
    put_gz(p, "split/random/test.csv.gz", "4\n-1\n");
    assert_has(
        &err_of(ogb(p, &opts)),
        "test.csv.gz:2: node id -1 is out of range 0..5",
    );
    std::fs::remove_file(p.join("split/random/valid.csv.gz")).unwrap();
    assert_has(&err_of(ogb(p, &opts)), "valid.csv.gz: is missing");
    std::fs::remove_file(p.join("raw/edge.csv.gz")).unwrap();
    assert_has(&err_of(ogb(p, &opts)), "edge.csv.gz: is missing");
    put_gz(p, "raw/num-node-list.csv.gz", "5\n6\n");
    assert_has(
        &err_of(ogb(p, &opts)),
        "num-node-list.csv.gz:2: expected a single node count",
    );
}
