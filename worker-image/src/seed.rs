//! The input halo a worker resized in place already holds.
//!
//! With input dropout the first layer fetches its halo rows of the features once per training call and
//! keeps them (`physalia_gnn::DeviceModel`'s input halo). A worker that continues in place on a new part
//! holds most of its new halo: the rows it gave up are in the part it held, and rows of its old halo that
//! stay in the new one came with the old model. [`input_halo_seed`] gathers them, exactly as their new owners
//! would send them, so only the other rows cross the network ([`physalia_gnn::Exchange::forward_seeded`]).
//! A survivor of a growth holds every row of its new halo, one of a shrink most of them; the others, and
//! a joiner's whole input halo, its part delta carries (the coordinator has the features:
//! [`crate::delta::lacking_halo`]), fetched beside training when the delta is sent ahead. A worker that
//! keeps its part while a lost peer is replaced holds none: its own rows are no halo rows, and the
//! cancelled epoch's model, with the halo rows it kept, is gone (the checkpoint's model holds none).

use crate::delta::HaloRows;
use physalia_gnn::{HaloSeed, Matrix};
use physalia_graph::FeatureView;
use physalia_graph::partition::Part;
use physalia_wire::Dtype;

pub use physalia_control::SeedAs;

/// Rows of features a worker holds, as the dataset stores them: its old part's owned rows, or the rows of
/// its input halo a part delta carried ([`crate::delta::HaloRows`]).
#[derive(Clone, Copy)]
pub struct RawRows<'a> {
    /// Global ids, ascending.
    pub ids: &'a [u32],
    /// `ids.len() x feat_dim`, in `ids`' order.
    pub features: FeatureView<'a>,
    pub feat_dim: usize,
}

impl<'a> RawRows<'a> {
    /// A part's owned rows.
    pub fn owned(part: &'a Part) -> RawRows<'a> {
        RawRows {
            ids: &part.owned,
            features: part.features.view(),
            feat_dim: part.feat_dim,
        }
    }

    /// The rows a delta carried.
    pub fn carried(rows: &'a HaloRows, feat_dim: usize) -> RawRows<'a> {
        RawRows {
            ids: &rows.ids,
            features: rows.features.view(),
            feat_dim,
        }
    }
}

/// The rows of `new`'s halo this worker holds: the rows of `raw` (its old part's own, those a delta
/// carried; widened to f32 and row-normalised when `row_normalize`, as the engine prepares its own rows,
/// then rounded to `dtype` as the wire rounds the rows it carries) and the rows of `ready` (rows as the
/// wire delivers them, each source node ids and one row each, ignored unless `feat_dim` wide: the first
/// layer's kept input halo in the old part's halo order, or a seed built earlier from raw rows). Bitwise
/// what a peer would send, so training is unchanged.
pub fn input_halo_seed(
    new: &Part,
    raw: &[RawRows<'_>],
    ready: &[(&[u32], &Matrix)],
    row_normalize: bool,
    dtype: Dtype,
) -> HaloSeed {
    let d = new.feat_dim;
    if d == 0 {
        return HaloSeed::default();
    }
    let ready: Vec<&(&[u32], &Matrix)> = ready
        .iter()
        .filter(|(ids, h)| h.shape() == (ids.len(), d))
        .collect();
    // the ready rows' ids sorted, with their source and row
    let mut by_gid: Vec<(u32, usize, usize)> = ready
        .iter()
        .enumerate()
        .flat_map(|(s, (ids, _))| ids.iter().enumerate().map(move |(i, &g)| (g, s, i)))
        .collect();
    by_gid.sort_unstable();
    let raw: Vec<&RawRows<'_>> = raw
        .iter()
        .filter(|r| r.feat_dim == d && r.features.len() == r.ids.len() * d)
        .collect();
    // the held rows of the new halo in ascending node order (so the seed is built in one copy)
    let mut held: Vec<(u32, Held)> = new
        .halo
        .iter()
        .filter_map(|&gid| {
            let found = raw
                .iter()
                .enumerate()
                .find_map(|(s, r)| r.ids.binary_search(&gid).ok().map(|i| Held::Raw(s, i)));
            found
                .or_else(|| {
                    let i = by_gid.partition_point(|&(g, _, _)| g < gid);
                    let &(g, s, row) = by_gid.get(i)?;
                    (g == gid).then_some(Held::Ready(s, row))
                })
                .map(|h| (gid, h))
        })
        .collect();
    held.sort_unstable_by_key(|&(gid, _)| gid);
    // the held features as the engine prepares its rows, then the wire's rounding (the ready rows are
    // as the wire delivers them already)
    let mut raw_rows = Vec::new();
    for (_, h) in &held {
        if let Held::Raw(s, i) = *h {
            widen_row(raw[s].features, i, d, &mut raw_rows);
        }
    }
    let mut prepared = Matrix::from_vec(raw_rows.len() / d, d, raw_rows);
    if row_normalize {
        prepared.row_normalize();
    }
    let prepared = rounded(prepared, dtype);
    let mut prepared_next = prepared.data().chunks_exact(d);
    let mut data = Vec::with_capacity(held.len() * d);
    for (_, h) in &held {
        match *h {
            Held::Raw(..) => {
                data.extend_from_slice(prepared_next.next().expect("one row per raw row"))
            }
            Held::Ready(s, i) => data.extend_from_slice(ready[s].1.row(i)),
        }
    }
    let gids: Vec<u32> = held.iter().map(|&(gid, _)| gid).collect();
    let rows = Matrix::from_vec(gids.len(), d, data);
    HaloSeed::new(gids, rows).expect("one row per id, built together")
}

/// Where a held row of the new halo comes from: row `i` of raw source `s`, or row `i` of ready source `s`.
#[derive(Clone, Copy)]
enum Held {
    Raw(usize, usize),
    Ready(usize, usize),
}

/// Row `r` of `features` (`d` wide), widened to f32, appended to `out`.
fn widen_row(features: FeatureView<'_>, r: usize, d: usize, out: &mut Vec<f32>) {
    let span = r * d..(r + 1) * d;
    match features {
        FeatureView::F32(v) => out.extend_from_slice(&v[span]),
        FeatureView::F16(v) => out.extend(v[span].iter().map(|x| x.to_f32())),
        FeatureView::BF16(v) => out.extend(v[span].iter().map(|x| x.to_f32())),
    }
}

/// `m`'s values as they arrive after crossing the wire in `dtype`.
fn rounded(m: Matrix, dtype: Dtype) -> Matrix {
    if dtype == Dtype::F32 {
        return m;
    }
    let (r, c) = m.shape();
    let bytes = physalia_wire::encode_f32(m.data(), dtype);
    let values = physalia_wire::decode_f32(&bytes, dtype).expect("decodes what it encoded");
    Matrix::from_vec(r, c, values)
}
