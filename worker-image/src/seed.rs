//! The input halo a worker resized in place already holds.
//!
//! With input dropout the first layer fetches its halo rows of the features once per training call and
//! keeps them (`physalia_gnn::DeviceModel`'s input halo). A worker that continues in place on a new part
//! holds most of its new halo: the rows it gave up are in the part it held, and rows of its old halo that
//! stay in the new one came with the old model. [`input_halo_seed`] gathers them, exactly as their new owners
//! would send them, so only the other rows cross the network ([`physalia_gnn::Exchange::forward_seeded`]).
//! A survivor of a growth holds every row of its new halo; a worker that keeps its part (a lost peer
//! replaced) holds its whole old halo.

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
    let old_halo =
        old_halo.filter(|h| h.shape() == (old.halo.len(), d) && old.feat_dim == d && d > 0);
    // the old halo's ids sorted, with their rows in `old_halo`
    let mut by_gid: Vec<(u32, usize)> = match old_halo {
        Some(_) => old.halo.iter().enumerate().map(|(i, &g)| (g, i)).collect(),
        None => Vec::new(),
    };
    by_gid.sort_unstable();
    let features = old.features.view();
    let (mut own_gids, mut own_rows) = (Vec::new(), Vec::new());
    let (mut halo_gids, mut halo_rows) = (Vec::new(), Vec::new());
    for &gid in &new.halo {
        if let Ok(r) = old.owned.binary_search(&gid) {
            if old.feat_dim == d {
                own_gids.push(gid);
                widen_row(features, r, d, &mut own_rows);
            }
        } else if let (Some(h), Ok(i)) = (old_halo, by_gid.binary_search_by_key(&gid, |&(g, _)| g))
        {
            halo_gids.push(gid);
            halo_rows.extend_from_slice(h.row(by_gid[i].1));
        }
    }
    // the held features as the engine prepares its rows, then the wire's rounding (the old halo's rows
    // crossed the wire already)
    let mut own = Matrix::from_vec(own_gids.len(), d, own_rows);
    if row_normalize {
        own.row_normalize();
    }
    let own = rounded(own, dtype);
    let mut gids = own_gids;
    gids.extend_from_slice(&halo_gids);
    let mut data = own.into_vec();
    data.extend_from_slice(&halo_rows);
    let rows = Matrix::from_vec(gids.len(), d, data);
    HaloSeed::new(gids, rows).expect("one row per id, built together")
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
