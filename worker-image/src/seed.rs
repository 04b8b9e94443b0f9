//! The input halo a worker resized in place already holds.
//!
//! With input dropout the first layer fetches its halo rows of the features once per training call and
//! keeps them (`physalia_gnn::DeviceModel`'s input halo). A worker that continues in place on a new part
//! holds most of its new halo: the rows it gave up are in the part it held, and rows of its old halo that
//! stay in the new one came with the old model. [`input_halo_seed`] gathers them, exactly as their new owners
//! would send them, so only the other rows cross the network ([`physalia_gnn::Exchange::forward_seeded`]).
//! A survivor of a growth holds every row of its new halo, one of a shrink most of them. A worker that
//! keeps its part while a lost peer is replaced holds none: its own rows are no halo rows, and the
//! cancelled epoch's model, with the halo rows it kept, is gone (the checkpoint's model holds none).

use physalia_gnn::{HaloSeed, Matrix};
use physalia_graph::FeatureView;
use physalia_graph::partition::Part;
use physalia_wire::Dtype;

/// The rows of `new`'s halo this worker holds: the features of `old`'s owned nodes (widened to f32 and
/// row-normalised when `row_normalize`, as the engine prepares its own rows) and the rows of `old`'s halo
/// that `old_halo` holds (the first layer's kept input halo, in `old.halo`'s order; ignored unless it is
/// `old.halo.len() x feat_dim`), every row rounded to `dtype` as the wire rounds the rows it carries.
/// Bitwise what a peer would send, so training is unchanged.
pub fn input_halo_seed(
    new: &Part,
    old: &Part,
    old_halo: Option<&Matrix>,
    row_normalize: bool,
    dtype: Dtype,
) -> HaloSeed {
    let d = new.feat_dim;
    if d == 0 {
        return HaloSeed::default();
    }
    let old_halo = old_halo.filter(|h| h.shape() == (old.halo.len(), d) && old.feat_dim == d);
    // the old halo's ids sorted, with their rows in `old_halo`
    let mut by_gid: Vec<(u32, usize)> = match old_halo {
        Some(_) => old.halo.iter().enumerate().map(|(i, &g)| (g, i)).collect(),
        None => Vec::new(),
    };
    by_gid.sort_unstable();
    // the held rows of the new halo in ascending node order (so the seed is built in one copy)
    let mut held: Vec<(u32, Held)> = new
        .halo
        .iter()
        .filter_map(|&gid| match old.owned.binary_search(&gid) {
            Ok(r) if old.feat_dim == d => Some((gid, Held::Own(r))),
            Ok(_) => None,
            Err(_) => {
                let i = by_gid.binary_search_by_key(&gid, |&(g, _)| g).ok()?;
                Some((gid, Held::Halo(by_gid[i].1)))
            }
        })
        .collect();
    held.sort_unstable_by_key(|&(gid, _)| gid);
    // the held features as the engine prepares its rows, then the wire's rounding (the old halo's rows
    // crossed the wire already)
    let features = old.features.view();
    let mut own_rows = Vec::new();
    for (_, h) in &held {
        if let Held::Own(r) = *h {
            widen_row(features, r, d, &mut own_rows);
        }
    }
    let mut own = Matrix::from_vec(own_rows.len() / d, d, own_rows);
    if row_normalize {
        own.row_normalize();
    }
    let own = rounded(own, dtype);
    let mut own_next = own.data().chunks_exact(d);
    let mut data = Vec::with_capacity(held.len() * d);
    for (_, h) in &held {
        match *h {
            Held::Own(_) => data.extend_from_slice(own_next.next().expect("one row per own")),
            Held::Halo(i) => {
                data.extend_from_slice(old_halo.expect("halo rows only with it").row(i))
            }
        }
    }
    let gids: Vec<u32> = held.iter().map(|&(gid, _)| gid).collect();
    let rows = Matrix::from_vec(gids.len(), d, data);
    HaloSeed::new(gids, rows).expect("one row per id, built together")
}

/// Where a held row of the new halo comes from: the old part's row `r`, or the old halo's row `i`.
#[derive(Clone, Copy)]
enum Held {
    Own(usize),
    Halo(usize),
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
