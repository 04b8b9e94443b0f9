//! Generators: determinism, target degree and homophily, validity, and that the SBM rewards using the
//! graph (the property the GNN tests downstream depend on).

use physalia_graph::synth::{rmat, sbm};
use physalia_graph::{Csr, Error, OwnedDataset, RmatParams, SbmParams, Split};

fn feats(ds: &OwnedDataset) -> Vec<f32> {
    ds.features.view().to_f32().into_owned()
}

#[test]
fn sbm_is_deterministic_and_thread_independent() {
    let p = SbmParams {
        num_nodes: 40_000,
        seed: 7,
        ..Default::default()
    };
    let a = sbm(&p).unwrap();
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let b = one_thread.install(|| sbm(&p).unwrap());
    assert_eq!(a, b);

    // Same seed, same bytes on disk.
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (
        dir.path().join("a.safetensors"),
        dir.path().join("b.safetensors"),
    );
    a.write(&pa).unwrap();
    b.write(&pb).unwrap();
    assert_eq!(std::fs::read(&pa).unwrap(), std::fs::read(&pb).unwrap());

    let c = sbm(&SbmParams { seed: 8, ..p }).unwrap();
    assert_ne!(a.indices, c.indices);
    assert_ne!(a.labels, c.labels);
    assert_ne!(feats(&a), feats(&c));
}

fn edge_homophily(csr: Csr<'_>, labels: &[i64]) -> f64 {
    let mut same = 0usize;
    for v in 0..csr.num_nodes() {
        same += csr
            .neighbors(v)
            .iter()
            .filter(|&&u| labels[u as usize] == labels[v])
            .count();
    }
    same as f64 / csr.num_edges() as f64
}

#[test]
fn sbm_hits_degree_and_homophily_targets() {
    for (deg, h) in [(10.0, 0.8), (5.0, 0.3), (16.0, 1.0)] {
        let p = SbmParams {
            num_nodes: 20_000,
            avg_degree: deg,
            homophily: h,
            seed: 3,
            ..Default::default()
        };
        let ds = sbm(&p).unwrap();
        ds.validate().unwrap();
        let mean = ds.meta.num_edges as f64 / ds.meta.num_nodes as f64;
        assert!(
            (mean - deg).abs() / deg < 0.02,
            "degree {mean} vs target {deg}"
        );
        let got = edge_homophily(ds.csr(), &ds.labels);
        assert!((got - h).abs() < 0.02, "homophily {got} vs target {h}");
        assert!(!ds.meta.directed);
        let s = ds.stats();
        assert_eq!(s.train_size + s.val_size + s.test_size, 20_000);
        assert_eq!((s.train_size, s.val_size), (2_000, 2_000));
        // Balanced classes.
        let mut hist = vec![0usize; p.num_classes];
        ds.labels.iter().for_each(|&l| hist[l as usize] += 1);
        assert!(hist.iter().all(|&c| c == 2_500), "{hist:?}");
    }
}

/// Accuracy on the test split of a nearest-centroid classifier whose centroids are the means of the
/// training nodes' rows of `x`.
fn nearest_centroid_accuracy(ds: &OwnedDataset, x: &[f32]) -> f64 {
    let (f, k) = (ds.meta.feat_dim, ds.meta.num_classes);
    let mut cent = vec![0f64; k * f];
    let mut count = vec![0usize; k];
    for &v in ds.split(Split::Train) {
        let c = ds.labels[v as usize] as usize;
        count[c] += 1;
        for j in 0..f {
            cent[c * f + j] += x[v as usize * f + j] as f64;
        }
    }
    for c in 0..k {
        cent[c * f..(c + 1) * f]
            .iter_mut()
            .for_each(|m| *m /= count[c].max(1) as f64);
    }
    let test = ds.split(Split::Test);
    let correct = test
        .iter()
        .filter(|&&v| {
            let row = &x[v as usize * f..(v as usize + 1) * f];
            let best = (0..k)
                .min_by(|&a, &b| {
                    let d = |c: usize| -> f64 {
                        row.iter()
                            .zip(&cent[c * f..(c + 1) * f])
                            .map(|(r, m)| (*r as f64 - m).powi(2))
                            .sum()
                    };
                    d(a).total_cmp(&d(b))
                })
                .unwrap();
            best as i64 == ds.labels[v as usize]
        })
        .count();
    correct as f64 / test.len() as f64
}

#[test]
fn sbm_default_rewards_neighbour_averaging() {
    let ds = sbm(&SbmParams {
        num_nodes: 5_000,
        seed: 11,
        ..Default::default()
    })
    .unwrap();
    let x = feats(&ds);
    let f = ds.meta.feat_dim;
    // One mean-aggregation step over the closed neighbourhood: what a GCN layer does before its weights.
    let csr = ds.csr();
    let mut avg = vec![0f32; x.len()];
    for v in 0..csr.num_nodes() {
        let nb = csr.neighbors(v);
        let out = &mut avg[v * f..(v + 1) * f];
        for u in nb.iter().map(|&u| u as usize).chain([v]) {
            out.iter_mut()
                .zip(&x[u * f..(u + 1) * f])
                .for_each(|(o, xi)| *o += xi);
        }
        out.iter_mut().for_each(|o| *o /= (nb.len() + 1) as f32);
    }
    let raw = nearest_centroid_accuracy(&ds, &x);
    let smoothed = nearest_centroid_accuracy(&ds, &avg);
    eprintln!("nearest centroid: raw features {raw:.3}, neighbour-averaged {smoothed:.3}");
    assert!(raw > 1.5 / 8.0, "features should carry some signal: {raw}");
    assert!(raw < 0.6, "features alone should be weak: {raw}");
    assert!(
        smoothed > raw + 0.25,
        "graph should help a lot: raw {raw}, smoothed {smoothed}"
    );
}

#[test]
fn sbm_rejects_bad_parameters() {
    let msg = |p: SbmParams| sbm(&p).unwrap_err().to_string();
    assert!(
        msg(SbmParams {
            num_nodes: 0,
            ..Default::default()
        })
        .contains("invalid parameter 'num_nodes'")
    );
    assert!(
        msg(SbmParams {
            num_classes: 0,
            ..Default::default()
        })
        .contains("'num_classes'")
    );
    assert!(
        msg(SbmParams {
            homophily: 1.5,
            ..Default::default()
        })
        .contains("'homophily': 1.5 is not in 0..=1")
    );
    assert!(
        msg(SbmParams {
            avg_degree: f64::NAN,
            ..Default::default()
        })
        .contains("'avg_degree'")
    );
    assert!(
        msg(SbmParams {
            train_frac: 0.7,
            val_frac: 0.5,
            ..Default::default()
        })
        .contains("sum to at most 1")
    );
    assert!(matches!(
        sbm(&SbmParams {
            feature_noise: -1.0,
            ..Default::default()
        }),
        Err(Error::Param {
            param: "feature_noise",
            ..
        })
    ));
}

#[test]
fn rmat_is_valid_skewed_and_deterministic() {
    let p = RmatParams {
        scale: 14,
        edge_factor: 8,
        feat_dim: 16,
        seed: 5,
        ..Default::default()
    };
    let a = rmat(&p).unwrap();
    a.validate().unwrap();
    assert_eq!(a.meta.num_nodes, 1 << 14);
    let s = a.stats();
    assert!(
        s.degree_max as f64 > 20.0 * s.degree_mean,
        "power law expected: {s:?}"
    );
    assert!(s.isolated_nodes > 0);
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    assert_eq!(a, one_thread.install(|| rmat(&p).unwrap()));
    assert_ne!(
        a.indices,
        rmat(&RmatParams {
            seed: 6,
            ..p.clone()
        })
        .unwrap()
        .indices
    );

    let directed = rmat(&RmatParams {
        undirected: false,
        ..p
    })
    .unwrap();
    directed.validate().unwrap();
    assert!(directed.meta.directed);
    assert!(directed.meta.num_edges < a.meta.num_edges);

    let msg = rmat(&RmatParams {
        a: 0.9,
        b: 0.2,
        ..Default::default()
    })
    .unwrap_err()
    .to_string();
    assert!(msg.contains("sum to at most 1"), "{msg}");
    assert!(
        rmat(&RmatParams {
            scale: 31,
            ..Default::default()
        })
        .is_err()
    );
}
