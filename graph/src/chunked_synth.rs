//! The synthetic generators, streaming into the chunked layout ([`crate::chunked`]) without holding the
//! graph.
//!
//! Same graphs as [`crate::synth::sbm`] and [`crate::synth::rmat`], byte for byte, for the same
//! parameters: the same per-chunk random streams draw the same edges, features, labels and splits; only
//! the assembly differs. Edges are drawn in parallel per generator chunk and spilled to disk by
//! destination row range ([`crate::spill`]), both directions of each; each range is then read back,
//! sorted and deduplicated into its CSR rows (the rows `csr_from_edges` builds), its features are drawn
//! from the generator's per-16Ki-row streams, and the chunks are written in parallel.
//!
//! Memory: `O(n)` small arrays (classes and class members, 4 bytes per node each; the split permutation,
//! 8 bytes per node; the writer's 1 byte per node) plus one bucket of spilled edges and its chunks per
//! thread. Never the edge list, the CSR or the features of the whole graph. Disk: the spill, 8 bytes
//! per stored edge, removed as it is consumed.

use std::ops::Range;
use std::path::Path;

use rayon::prelude::*;

use crate::chunked::{ChunkedHeader, ChunkedWriter, Manifest, NodeChunk};
use crate::error::Error;
use crate::format::{FeatureDtype, Features, Split};
use crate::spill::EdgeSpill;
use crate::synth::{
    self, EDGE_CHUNK, NODE_CHUNK, RmatGen, RmatParams, SbmParams, centroids, feature_block,
};

/// What phase 2 needs to make a node range's features and labels.
struct NodeGen<'a> {
    seed: u64,
    classes: &'a [u32],
    centroids: Vec<f32>,
    feat_dim: usize,
    noise: f64,
}

impl NodeGen<'_> {
    /// Features of rows `r`, exactly as the in-memory generator draws them (per `NODE_CHUNK` block).
    fn features(&self, r: Range<usize>) -> Vec<f32> {
        let f = self.feat_dim;
        let mut out = vec![0f32; r.len() * f];
        if f == 0 {
            return out;
        }
        let n = self.classes.len();
        let mut block = Vec::new();
        for ci in r.start / NODE_CHUNK..r.end.div_ceil(NODE_CHUNK) {
            let b = ci * NODE_CHUNK..((ci + 1) * NODE_CHUNK).min(n);
            let (lo, hi) = (r.start.max(b.start), r.end.min(b.end));
            let dst = &mut out[(lo - r.start) * f..(hi - r.start) * f];
            let classes = &self.classes[b.clone()];
            if lo == b.start && hi == b.end {
                feature_block(self.seed, ci, classes, &self.centroids, f, self.noise, dst);
            } else {
                block.resize(b.len() * f, 0.0);
                feature_block(
                    self.seed,
                    ci,
                    classes,
                    &self.centroids,
                    f,
                    self.noise,
                    &mut block,
                );
                dst.copy_from_slice(&block[(lo - b.start) * f..(hi - b.start) * f]);
            }
        }
        out
    }
}

/// Writes the stochastic block model of `p` to `dir` in the chunked layout, `chunk_rows` rows per chunk
/// (a multiple of 16384 avoids drawing feature blocks twice). Equal to [`crate::synth::sbm`]`(p)`.
pub fn sbm_chunked(p: &SbmParams, dir: &Path, chunk_rows: usize) -> Result<Manifest, Error> {
    synth::check_sbm(p)?;
    let n = p.num_nodes;
    let (name, source) = synth::sbm_name_source(p);
    let header = ChunkedHeader {
        name,
        source,
        num_nodes: n,
        feat_dim: p.feat_dim,
        feature_dtype: FeatureDtype::F32,
        num_classes: Some(p.num_classes),
        directed: false,
    };
    let mut w = ChunkedWriter::create(dir, header, chunk_rows)?;
    let mut spill = EdgeSpill::new(dir, n, chunk_rows)?;
    let (classes, members) = synth::sbm_classes(p);
    (0..n.div_ceil(NODE_CHUNK))
        .into_par_iter()
        .try_for_each(|ci| {
            let (src, dst) = synth::sbm_edges(p, ci, &classes, &members);
            spill.push(&src, &dst, true)
        })?;
    drop(members);
    spill.flush()?;
    let nodes = NodeGen {
        seed: p.seed,
        classes: &classes,
        centroids: centroids(p.seed, p.num_classes, p.feat_dim, p.feature_signal),
        feat_dim: p.feat_dim,
        noise: p.feature_noise,
    };
    write_nodes(&mut w, &spill, &nodes)?;
    drop(spill);
    finish(w, p.seed, n, p.train_frac, p.val_frac)
}

/// Writes the R-MAT graph of `p` to `dir` in the chunked layout. Equal to [`crate::synth::rmat`]`(p)`.
pub fn rmat_chunked(p: &RmatParams, dir: &Path, chunk_rows: usize) -> Result<Manifest, Error> {
    let (n, num_edges) = synth::check_rmat(p)?;
    let (name, source) = synth::rmat_name_source(p);
    let header = ChunkedHeader {
        name,
        source,
        num_nodes: n,
        feat_dim: p.feat_dim,
        feature_dtype: FeatureDtype::F32,
        num_classes: Some(p.num_classes),
        directed: !p.undirected,
    };
    let mut w = ChunkedWriter::create(dir, header, chunk_rows)?;
    let mut spill = EdgeSpill::new(dir, n, chunk_rows)?;
    let rmat = RmatGen::new(p);
    (0..num_edges.div_ceil(EDGE_CHUNK))
        .into_par_iter()
        .try_for_each(|ci| {
            let (src, dst) = rmat.edges(p, ci, num_edges);
            spill.push(&src, &dst, p.undirected)
        })?;
    drop(rmat);
    spill.flush()?;
    let classes = synth::rmat_classes(p);
    let nodes = NodeGen {
        seed: p.seed,
        classes: &classes,
        centroids: centroids(p.seed, p.num_classes, p.feat_dim, p.feature_signal),
        feat_dim: p.feat_dim,
        noise: p.feature_noise,
    };
    write_nodes(&mut w, &spill, &nodes)?;
    drop(spill);
    finish(w, p.seed, n, p.train_frac, p.val_frac)
}

/// Phase 2: the spill's buckets, a few at a time in parallel, into node chunks, appended in order.
fn write_nodes(w: &mut ChunkedWriter, spill: &EdgeSpill, nodes: &NodeGen<'_>) -> Result<(), Error> {
    let batch = rayon::current_num_threads().max(1);
    let buckets: Vec<usize> = (0..spill.num_buckets()).collect();
    let chunk_rows = w.chunk_rows();
    for group in buckets.chunks(batch) {
        let made: Vec<Vec<NodeChunk>> = group
            .par_iter()
            .map(|&b| bucket_chunks(spill, b, chunk_rows, nodes))
            .collect::<Result<_, Error>>()?;
        w.append(made.into_iter().flatten().collect())?;
    }
    Ok(())
}

/// Bucket `b` of the spill as node chunks of `chunk_rows` rows, with features and labels.
fn bucket_chunks(
    spill: &EdgeSpill,
    b: usize,
    chunk_rows: usize,
    nodes: &NodeGen<'_>,
) -> Result<Vec<NodeChunk>, Error> {
    let r = spill.bucket_range(b);
    let (indptr, indices) = spill.read_bucket(b)?;
    let mut out = Vec::with_capacity(r.len().div_ceil(chunk_rows));
    let mut lo = r.start;
    while lo < r.end {
        let hi = (lo + chunk_rows).min(r.end);
        let (a, z) = (indptr[lo - r.start], indptr[hi - r.start]);
        out.push(NodeChunk {
            indptr: indptr[lo - r.start..=hi - r.start]
                .iter()
                .map(|&x| x - a)
                .collect(),
            indices: indices[a as usize..z as usize].to_vec(),
            features: Features::F32(nodes.features(lo..hi)),
            labels: nodes.classes[lo..hi].iter().map(|&c| c as i64).collect(),
        });
        lo = hi;
    }
    Ok(out)
}

fn finish(
    mut w: ChunkedWriter,
    seed: u64,
    n: usize,
    train: f64,
    val: f64,
) -> Result<Manifest, Error> {
    let splits = synth::random_splits(seed, n, train, val);
    let step = w.chunk_rows();
    for (s, ids) in Split::ALL.iter().zip(&splits) {
        for part in ids.chunks(step) {
            w.append_split(*s, part)?;
        }
    }
    drop(splits);
    w.finish()
}
