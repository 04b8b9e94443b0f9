//! Seeded synthetic graphs: a stochastic block model for learnability tests and R-MAT for scale tests.
//!
//! Both are deterministic functions of their parameters: every random phase (classes, edges, features,
//! splits) reads its own ChaCha8 stream, and parallel work is cut into fixed-size chunks with one stream
//! per chunk, so the same seed gives a byte-identical dataset on any number of threads.
//!
//! The SBM is built so that *graph structure carries information the features alone do not*: each node's
//! features are its class centroid plus much larger isotropic noise, while most of its edges stay inside
//! its class. A feature-only model is then capped near the Bayes accuracy of the noisy features, and
//! averaging over neighbours (what a GNN layer does) shrinks the noise and recovers the class.

use rand::{Rng, RngCore};
use rayon::prelude::*;

use crate::csr::csr_from_edges;
use crate::error::Error;
use crate::format::{Features, OwnedDataset};
use crate::rng;

/// Nodes per parallel chunk. Fixed (not derived from the thread count) so output is thread-independent.
pub(crate) const NODE_CHUNK: usize = 1 << 14;
/// Edges per parallel chunk for R-MAT.
pub(crate) const EDGE_CHUNK: usize = 1 << 18;

/// Parameters of [`sbm`]. `Default` gives a 10k-node, 8-class graph that a 2-layer GCN learns well and an
/// MLP does not.
#[derive(Clone, Debug, PartialEq)]
pub struct SbmParams {
    pub num_nodes: usize,
    pub num_classes: usize,
    /// Target mean degree of the undirected graph (each node draws about half of it; the other half
    /// arrives from other nodes' draws). Self loops and repeats are dropped, so the realised mean is a
    /// hair lower on small graphs.
    pub avg_degree: f64,
    /// Fraction of edges whose endpoints share a class (edge homophily); the rest go to a uniformly random
    /// node of another class. Default 0.8.
    pub homophily: f64,
    pub feat_dim: usize,
    /// Euclidean norm of each class centroid (centroids point in independent random directions).
    pub feature_signal: f64,
    /// Standard deviation of the per-coordinate Gaussian noise added to every node. Default 1.0.
    pub feature_noise: f64,
    /// Fraction of nodes in the training split (default 0.1); `val_frac` likewise (0.1); the rest (0.8)
    /// is the test split. All nodes are labelled.
    pub train_frac: f64,
    pub val_frac: f64,
    pub seed: u64,
}

impl Default for SbmParams {
    fn default() -> Self {
        SbmParams {
            num_nodes: 10_000,
            num_classes: 8,
            avg_degree: 10.0,
            homophily: 0.8,
            feat_dim: 128,
            // With noise 1.0, random centroid directions are ~sqrt(2) * 1.5 apart, so a single node's
            // features give roughly 40-45% accuracy even to a Bayes-optimal classifier (8 classes),
            // while the mean over its ~11-node closed neighbourhood (80% same class, noise / sqrt(11))
            // gives over 95%. Checked in tests/synth.rs with a nearest-centroid classifier.
            feature_signal: 1.5,
            feature_noise: 1.0,
            train_frac: 0.1,
            val_frac: 0.1,
            seed: 0,
        }
    }
}

/// Parameters of [`rmat`].
#[derive(Clone, Debug, PartialEq)]
pub struct RmatParams {
    /// `num_nodes = 2^scale`; at most 30.
    pub scale: u32,
    /// Edges drawn = `edge_factor * num_nodes` (before dropping self loops and repeats, which in R-MAT's
    /// skewed corner can be a sizeable fraction).
    pub edge_factor: usize,
    /// Quadrant probabilities; `d = 1 - a - b - c`. Defaults 0.57, 0.19, 0.19 (Graph500).
    pub a: f64,
    pub b: f64,
    pub c: f64,
    pub feat_dim: usize,
    /// Labels are drawn uniformly at random, independent of the structure: R-MAT is for measuring speed
    /// and memory at scale, not accuracy.
    pub num_classes: usize,
    /// Features are class centroid (this norm) plus noise, as in the SBM, so training still has
    /// something to fit.
    pub feature_signal: f64,
    pub feature_noise: f64,
    /// Store both directions of every edge (default true).
    pub undirected: bool,
    pub train_frac: f64,
    pub val_frac: f64,
    pub seed: u64,
}

impl Default for RmatParams {
    fn default() -> Self {
        RmatParams {
            scale: 16,
            edge_factor: 8,
            a: 0.57,
            b: 0.19,
            c: 0.19,
            feat_dim: 128,
            num_classes: 8,
            feature_signal: 1.5,
            feature_noise: 1.0,
            undirected: true,
            train_frac: 0.1,
            val_frac: 0.1,
            seed: 0,
        }
    }
}

/// Generates a stochastic block model dataset (see [`SbmParams`]).
pub fn sbm(p: &SbmParams) -> Result<OwnedDataset, Error> {
    check_sbm(p)?;
    let (n, k) = (p.num_nodes, p.num_classes);
    let (classes, members) = sbm_classes(p);
    let chunks: Vec<(Vec<u32>, Vec<u32>)> = (0..n.div_ceil(NODE_CHUNK))
        .into_par_iter()
        .map(|ci| sbm_edges(p, ci, &classes, &members))
        .collect();
    let (src, dst) = concat_pairs(chunks);
    let csr = csr_from_edges(n, &src, &dst, true);
    drop((src, dst));

    let feats = class_features(
        p.seed,
        &classes,
        k,
        p.feat_dim,
        p.feature_signal,
        p.feature_noise,
    );
    let splits = random_splits(p.seed, n, p.train_frac, p.val_frac);
    let labels = classes.iter().map(|&c| c as i64).collect();
    let (name, source) = sbm_name_source(p);
    let mut ds = OwnedDataset::from_parts(
        name,
        source,
        false,
        csr,
        Features::F32(feats),
        p.feat_dim,
        labels,
        splits,
    );
    // Classes exist even if (in a tiny graph) the highest one were never drawn.
    ds.meta.num_classes = k;
    Ok(ds)
}

pub(crate) fn check_sbm(p: &SbmParams) -> Result<(), Error> {
    let n = p.num_nodes;
    let k = p.num_classes;
    if n == 0 || n > i32::MAX as usize {
        return Err(Error::param(
            "num_nodes",
            format!("{n} is not in 1..={}", i32::MAX),
        ));
    }
    if k == 0 || k > n {
        return Err(Error::param(
            "num_classes",
            format!("{k} must be in 1..=num_nodes ({n})"),
        ));
    }
    if !(p.avg_degree.is_finite() && p.avg_degree >= 0.0 && p.avg_degree < n as f64) {
        return Err(Error::param(
            "avg_degree",
            format!("{} must be finite and in 0..num_nodes", p.avg_degree),
        ));
    }
    if !(0.0..=1.0).contains(&p.homophily) {
        return Err(Error::param(
            "homophily",
            format!("{} is not in 0..=1", p.homophily),
        ));
    }
    if k == 1 && p.homophily < 1.0 {
        return Err(Error::param(
            "homophily",
            "must be 1 with a single class: there is no other class to connect to",
        ));
    }
    check_features(p.feat_dim, p.feature_signal, p.feature_noise)?;
    check_split(p.train_frac, p.val_frac)
}

/// Balanced classes (v mod k), shuffled so class is unrelated to id order; and each class's members.
pub(crate) fn sbm_classes(p: &SbmParams) -> (Vec<u32>, Vec<Vec<u32>>) {
    let (n, k) = (p.num_nodes, p.num_classes);
    let mut classes: Vec<u32> = (0..n).map(|v| (v % k) as u32).collect();
    shuffle(&mut classes, &mut rng::stream(p.seed, rng::CLASSES, 0));
    let mut members: Vec<Vec<u32>> = vec![Vec::with_capacity(n / k + 1); k];
    for (v, &c) in classes.iter().enumerate() {
        members[c as usize].push(v as u32);
    }
    (classes, members)
}

/// The edges drawn by the nodes of generator chunk `ci` (`NODE_CHUNK` nodes), as (src, dst) pairs.
pub(crate) fn sbm_edges(
    p: &SbmParams,
    ci: usize,
    classes: &[u32],
    members: &[Vec<u32>],
) -> (Vec<u32>, Vec<u32>) {
    let (n, k) = (p.num_nodes, p.num_classes);
    let half = p.avg_degree / 2.0;
    let (whole, frac) = (half.floor() as usize, half.fract());
    let mut r = rng::stream(p.seed, rng::EDGES, ci as u64);
    let lo = ci * NODE_CHUNK;
    let hi = (lo + NODE_CHUNK).min(n);
    let cap = ((hi - lo) as f64 * (half + 1.0)) as usize;
    let (mut src, mut dst) = (Vec::with_capacity(cap), Vec::with_capacity(cap));
    for (u, &c) in (lo..hi).zip(&classes[lo..hi]) {
        let m = whole + (r.random::<f64>() < frac) as usize;
        let c = c as usize;
        for _ in 0..m {
            let target_class = if r.random::<f64>() < p.homophily {
                c
            } else {
                (c + 1 + r.random_range(0..k - 1)) % k
            };
            let pool = &members[target_class];
            src.push(u as u32);
            dst.push(pool[r.random_range(0..pool.len())]);
        }
    }
    (src, dst)
}

pub(crate) fn sbm_name_source(p: &SbmParams) -> (String, String) {
    let (n, k) = (p.num_nodes, p.num_classes);
    let source = format!(
        "synth:sbm seed={} num_nodes={n} num_classes={k} avg_degree={} homophily={} feat_dim={} \
         feature_signal={} feature_noise={} train_frac={} val_frac={}",
        p.seed,
        p.avg_degree,
        p.homophily,
        p.feat_dim,
        p.feature_signal,
        p.feature_noise,
        p.train_frac,
        p.val_frac
    );
    (format!("sbm-n{n}-k{k}-s{}", p.seed), source)
}

/// Generates an R-MAT graph (see [`RmatParams`]). Node ids are randomly permuted after generation so the
/// high-degree nodes are not clustered at low ids (as Graph500 does), which would flatter any
/// partitioner that splits by id range.
pub fn rmat(p: &RmatParams) -> Result<OwnedDataset, Error> {
    let (n, num_edges) = check_rmat(p)?;
    let draw = RmatGen::new(p);
    let chunks: Vec<(Vec<u32>, Vec<u32>)> = (0..num_edges.div_ceil(EDGE_CHUNK))
        .into_par_iter()
        .map(|ci| draw.edges(p, ci, num_edges))
        .collect();
    drop(draw);
    let (src, dst) = concat_pairs(chunks);
    let csr = csr_from_edges(n, &src, &dst, p.undirected);
    drop((src, dst));

    let k = p.num_classes;
    let classes = rmat_classes(p);
    let feats = class_features(
        p.seed,
        &classes,
        k,
        p.feat_dim,
        p.feature_signal,
        p.feature_noise,
    );
    let splits = random_splits(p.seed, n, p.train_frac, p.val_frac);
    let labels = classes.iter().map(|&c| c as i64).collect();
    let (name, source) = rmat_name_source(p);
    let mut ds = OwnedDataset::from_parts(
        name,
        source,
        !p.undirected,
        csr,
        Features::F32(feats),
        p.feat_dim,
        labels,
        splits,
    );
    ds.meta.num_classes = k;
    Ok(ds)
}

/// Checks the parameters; returns the node count and the number of edges drawn.
pub(crate) fn check_rmat(p: &RmatParams) -> Result<(usize, usize), Error> {
    if p.scale == 0 || p.scale > 30 {
        return Err(Error::param(
            "scale",
            format!("{} is not in 1..=30", p.scale),
        ));
    }
    let n = 1usize << p.scale;
    let d = 1.0 - p.a - p.b - p.c;
    if [p.a, p.b, p.c].iter().any(|x| !(0.0..=1.0).contains(x)) || d < -1e-9 {
        return Err(Error::param(
            "a, b, c",
            format!(
                "quadrant probabilities {}, {}, {} must be in 0..=1 and sum to at most 1",
                p.a, p.b, p.c
            ),
        ));
    }
    let num_edges = p
        .edge_factor
        .checked_mul(n)
        .filter(|&e| e <= u32::MAX as usize)
        .ok_or_else(|| {
            Error::param(
                "edge_factor",
                format!("{} * 2^{} edges is too many", p.edge_factor, p.scale),
            )
        })?;
    if p.num_classes == 0 {
        return Err(Error::param("num_classes", "must be at least 1"));
    }
    check_features(p.feat_dim, p.feature_signal, p.feature_noise)?;
    check_split(p.train_frac, p.val_frac)?;
    Ok((n, num_edges))
}

/// What every R-MAT edge chunk needs: the quadrant thresholds and the id permutation.
pub(crate) struct RmatGen {
    thresholds: (u32, u32, u32),
    perm: Vec<u32>,
}

impl RmatGen {
    pub(crate) fn new(p: &RmatParams) -> RmatGen {
        // Integer thresholds: one 32-bit draw per level instead of a float.
        let scale32 = |x: f64| (x.clamp(0.0, 1.0) * 4_294_967_296.0).min(u32::MAX as f64) as u32;
        let thresholds = (scale32(p.a), scale32(p.a + p.b), scale32(p.a + p.b + p.c));
        let mut perm: Vec<u32> = (0..1u32 << p.scale).collect();
        shuffle(&mut perm, &mut rng::stream(p.seed, rng::PERMUTE, 0));
        RmatGen { thresholds, perm }
    }

    /// The (src, dst) pairs of edge chunk `ci` (`EDGE_CHUNK` draws).
    pub(crate) fn edges(
        &self,
        p: &RmatParams,
        ci: usize,
        num_edges: usize,
    ) -> (Vec<u32>, Vec<u32>) {
        let (ta, tab, tabc) = self.thresholds;
        let mut r = rng::stream(p.seed, rng::EDGES, ci as u64);
        let count = (num_edges - ci * EDGE_CHUNK).min(EDGE_CHUNK);
        let (mut src, mut dst) = (Vec::with_capacity(count), Vec::with_capacity(count));
        for _ in 0..count {
            let (mut s, mut t) = (0u32, 0u32);
            for _ in 0..p.scale {
                let x = r.next_u32();
                let (sb, tb) = if x < ta {
                    (0, 0)
                } else if x < tab {
                    (0, 1)
                } else if x < tabc {
                    (1, 0)
                } else {
                    (1, 1)
                };
                s = (s << 1) | sb;
                t = (t << 1) | tb;
            }
            src.push(self.perm[s as usize]);
            dst.push(self.perm[t as usize]);
        }
        (src, dst)
    }
}

/// Labels drawn uniformly, independent of the structure.
pub(crate) fn rmat_classes(p: &RmatParams) -> Vec<u32> {
    let k = p.num_classes;
    let mut cr = rng::stream(p.seed, rng::CLASSES, 0);
    (0..1usize << p.scale)
        .map(|_| cr.random_range(0..k as u32))
        .collect()
}

pub(crate) fn rmat_name_source(p: &RmatParams) -> (String, String) {
    let source = format!(
        "synth:rmat seed={} scale={} edge_factor={} a={} b={} c={} feat_dim={} num_classes={} \
         feature_signal={} feature_noise={} undirected={} train_frac={} val_frac={}",
        p.seed,
        p.scale,
        p.edge_factor,
        p.a,
        p.b,
        p.c,
        p.feat_dim,
        p.num_classes,
        p.feature_signal,
        p.feature_noise,
        p.undirected,
        p.train_frac,
        p.val_frac
    );
    (
        format!("rmat-s{}-e{}-s{}", p.scale, p.edge_factor, p.seed),
        source,
    )
}

fn check_features(feat_dim: usize, signal: f64, noise: f64) -> Result<(), Error> {
    if !(signal.is_finite() && signal >= 0.0) {
        return Err(Error::param(
            "feature_signal",
            format!("{signal} must be finite and >= 0"),
        ));
    }
    if !(noise.is_finite() && noise >= 0.0) {
        return Err(Error::param(
            "feature_noise",
            format!("{noise} must be finite and >= 0"),
        ));
    }
    if feat_dim == 0 && signal > 0.0 {
        return Err(Error::param(
            "feat_dim",
            "must be at least 1 when feature_signal > 0",
        ));
    }
    Ok(())
}

fn check_split(train: f64, val: f64) -> Result<(), Error> {
    let ok = |x: f64| (0.0..=1.0).contains(&x);
    if !ok(train) || !ok(val) || train + val > 1.0 {
        return Err(Error::param(
            "train_frac, val_frac",
            format!("{train} and {val} must be in 0..=1 and sum to at most 1"),
        ));
    }
    Ok(())
}

fn shuffle<T>(v: &mut [T], r: &mut impl Rng) {
    for i in (1..v.len()).rev() {
        let j = r.random_range(0..=i);
        v.swap(i, j);
    }
}

fn concat_pairs(chunks: Vec<(Vec<u32>, Vec<u32>)>) -> (Vec<u32>, Vec<u32>) {
    let total = chunks.iter().map(|c| c.0.len()).sum();
    let (mut src, mut dst) = (Vec::with_capacity(total), Vec::with_capacity(total));
    for (s, d) in chunks {
        src.extend_from_slice(&s);
        dst.extend_from_slice(&d);
    }
    (src, dst)
}

/// `features[v] = centroid[class[v]] + noise * N(0, I)`, centroids of norm `signal` in random directions.
fn class_features(
    seed: u64,
    classes: &[u32],
    k: usize,
    f: usize,
    signal: f64,
    noise: f64,
) -> Vec<f32> {
    if f == 0 {
        return Vec::new();
    }
    let centroids = centroids(seed, k, f, signal);
    let mut feats = vec![0f32; classes.len() * f];
    feats
        .par_chunks_mut(NODE_CHUNK * f)
        .enumerate()
        .for_each(|(ci, block)| {
            let rows = &classes[ci * NODE_CHUNK..ci * NODE_CHUNK + block.len() / f];
            feature_block(seed, ci, rows, &centroids, f, noise, block);
        });
    feats
}

/// `k` centroids of norm `signal` in random directions, row-major `k x f`.
pub(crate) fn centroids(seed: u64, k: usize, f: usize, signal: f64) -> Vec<f32> {
    let mut centroids = vec![0f32; k * f];
    let mut cr = rng::stream(seed, rng::CENTROIDS, 0);
    for c in centroids.chunks_exact_mut(f.max(1)) {
        rng::fill_normal(&mut cr, c);
        let norm = c.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let s = if norm > 0.0 { signal / norm } else { 0.0 };
        c.iter_mut().for_each(|x| *x = (*x as f64 * s) as f32);
    }
    centroids
}

/// The features of generator chunk `ci` (its `NODE_CHUNK` rows, fewer at the end): `out` holds
/// `classes.len() x f` values, drawn from chunk `ci`'s own stream.
pub(crate) fn feature_block(
    seed: u64,
    ci: usize,
    classes: &[u32],
    centroids: &[f32],
    f: usize,
    noise: f64,
    out: &mut [f32],
) {
    let noise = noise as f32;
    let mut r = rng::stream(seed, rng::FEATURES, ci as u64);
    rng::fill_normal(&mut r, out);
    for (row, &c) in out.chunks_exact_mut(f).zip(classes) {
        let c = c as usize;
        let centroid = &centroids[c * f..(c + 1) * f];
        for (x, m) in row.iter_mut().zip(centroid) {
            *x = *x * noise + m;
        }
    }
}

/// A random permutation cut into train / val / test by the given fractions; each split sorted ascending
/// (sequential ids read features with better locality).
pub(crate) fn random_splits(seed: u64, n: usize, train: f64, val: f64) -> [Vec<i64>; 3] {
    let mut perm: Vec<i64> = (0..n as i64).collect();
    shuffle(&mut perm, &mut rng::stream(seed, rng::SPLITS, 0));
    let n_train = ((n as f64 * train).round() as usize).min(n);
    let n_val = ((n as f64 * val).round() as usize).min(n - n_train);
    let mut test = perm.split_off(n_train + n_val);
    let mut val = perm.split_off(n_train);
    let mut train = perm;
    train.sort_unstable();
    val.sort_unstable();
    test.sort_unstable();
    [train, val, test]
}
