//! The real Cora, imported from `shared/data/cora`, checked against its published numbers, written and
//! mapped back. Skips (with a note) where the shared data folder is absent.

use std::path::Path;

use physalia_graph::{Dataset, FeatureView, ImportOptions, Split, import};

const CORA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/data/cora");

#[test]
fn cora_imports_with_published_numbers_and_round_trips() {
    let dir = Path::new(CORA);
    if !dir.is_dir() {
        eprintln!("skipping: {CORA} is absent");
        return;
    }
    let ds = import::generic(
        dir,
        &ImportOptions {
            name: Some("cora".into()),
            ..Default::default()
        },
    )
    .unwrap();
    let m = &ds.meta;
    assert_eq!(
        (m.num_nodes, m.num_edges, m.feat_dim, m.num_classes),
        (2708, 10556, 1433, 7)
    );
    assert_eq!(
        (ds.train_idx.len(), ds.val_idx.len(), ds.test_idx.len()),
        (140, 500, 1000)
    );
    let mut hist = [0usize; 7];
    ds.labels.iter().for_each(|&l| hist[l as usize] += 1);
    assert_eq!(hist, [351, 217, 418, 818, 426, 298, 180]);
    let FeatureView::F32(f) = ds.features.view() else {
        panic!("f32 expected")
    };
    assert_eq!(f.iter().filter(|&&x| x != 0.0).count(), 49216);
    assert!(f.iter().all(|&x| x == 0.0 || x == 1.0));
    // Undirected: the CSR is its own transpose.
    assert_eq!(
        ds.csr().transpose(),
        (ds.indptr.clone(), ds.indices.clone())
    );

    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("cora.safetensors");
    ds.write(&path).unwrap();
    let back = Dataset::open(&path).unwrap();
    assert_eq!(back.meta().name, "cora");
    assert_eq!(back.csr().indptr, &ds.indptr[..]);
    assert_eq!(back.csr().indices, &ds.indices[..]);
    assert_eq!(back.labels(), &ds.labels[..]);
    assert_eq!(back.split(Split::Train), &ds.train_idx[..]);
    assert_eq!(back.split(Split::Val), &ds.val_idx[..]);
    assert_eq!(back.split(Split::Test), &ds.test_idx[..]);
    assert_eq!(back.features_f32().as_ref(), f);
    let s = back.stats();
    assert_eq!((s.degree_min, s.degree_max, s.isolated_nodes), (1, 168, 0));
    eprintln!("cora stats: {s:?}");

    // Row-normalised variant: every row sums to 1 (Cora has no empty feature rows).
    let norm = import::generic(
        dir,
        &ImportOptions {
            row_normalize: true,
            ..Default::default()
        },
    )
    .unwrap();
    let FeatureView::F32(nf) = norm.features.view() else {
        panic!("f32 expected")
    };
    for row in nf.chunks_exact(1433) {
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
    }
}
