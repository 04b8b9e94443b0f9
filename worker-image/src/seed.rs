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
/// then rounded to `dtype` as the wire rounds the rows it carries), then those of `old_halo` (the first
/// layer's kept input halo: the old part's halo ids and one row each, as the wire delivers them; ignored
/// unless `feat_dim` wide). Bitwise what a peer would send, so training is unchanged. In one step what
/// [`SeedAhead`] does in two.
pub fn input_halo_seed(
    new: &Part,
    raw: &[RawRows<'_>],
    old_halo: Option<(&[u32], &Matrix)>,
    row_normalize: bool,
    dtype: Dtype,
) -> HaloSeed {
    SeedAhead::gather(new, raw, old_halo.map(|(ids, _)| ids), row_normalize, dtype)
        .complete(old_halo)
}

/// The rows of a new part's input halo a survivor of an in-place resize holds, gathered ahead of the
/// resize, beside training: the rows of its old part and those its delta carried prepared as
/// [`input_halo_seed`] prepares them, with room left for the rows of its old part's halo, which its old
/// model keeps and only the pause can read ([`SeedAhead::complete`] fills them in). A joiner's (no old
/// part) is complete as gathered.
pub struct SeedAhead {
    gids: Vec<u32>,
    rows: Matrix,
    /// `(row of rows, row of the old part's halo)`: the rows the old model's kept halo fills in.
    later: Vec<(usize, usize)>,
    /// The old part's halo's length (the kept halo's rows are in its order).
    old_halo: usize,
}

impl SeedAhead {
    /// Gathers the rows of `new`'s halo that `raw` holds (the old part's own rows, the carried rows),
    /// in ascending node order (so the seed is built in one copy), leaving a row of zeros for each of
    /// `old_halo` (the old part's halo ids) that `raw` does not hold.
    pub fn gather(
        new: &Part,
        raw: &[RawRows<'_>],
        old_halo: Option<&[u32]>,
        row_normalize: bool,
        dtype: Dtype,
    ) -> SeedAhead {
        let d = new.feat_dim;
        let n_old = old_halo.map_or(0, <[u32]>::len);
        if d == 0 {
            return SeedAhead {
                gids: Vec::new(),
                rows: Matrix::zeros(0, 0),
                later: Vec::new(),
                old_halo: n_old,
            };
        }
        let raw: Vec<&RawRows<'_>> = raw
            .iter()
            .filter(|r| r.feat_dim == d && r.features.len() == r.ids.len() * d)
            .collect();
        // the old halo's ids sorted, with their row (the first of an id listed twice)
        let mut by_gid: Vec<(u32, usize)> = old_halo
            .unwrap_or_default()
            .iter()
            .enumerate()
            .map(|(i, &g)| (g, i))
            .collect();
        by_gid.sort_unstable();
        let in_old = |gid: u32| {
            let i = by_gid.partition_point(|&(g, _)| g < gid);
            by_gid
                .get(i)
                .filter(|&&(g, _)| g == gid)
                .map(|&(_, row)| row)
        };
        let mut held: Vec<(u32, Held)> = new
            .halo
            .iter()
            .filter_map(|&gid| {
                let found = raw
                    .iter()
                    .enumerate()
                    .find_map(|(s, r)| r.ids.binary_search(&gid).ok().map(|i| Held::Raw(s, i)));
                found
                    .or_else(|| in_old(gid).map(Held::Later))
                    .map(|h| (gid, h))
            })
            .collect();
        held.sort_unstable_by_key(|&(gid, _)| gid);
        // the held features as the engine prepares its rows, then the wire's rounding (the old halo's
        // rows are as the wire delivers them already)
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
        let mut later = Vec::new();
        for (row, (_, h)) in held.iter().enumerate() {
            match *h {
                Held::Raw(..) => {
                    data.extend_from_slice(prepared_next.next().expect("one row per raw row"))
                }
                Held::Later(i) => {
                    data.resize(data.len() + d, 0.0);
                    later.push((row, i));
                }
            }
        }
        SeedAhead {
            gids: held.iter().map(|&(gid, _)| gid).collect(),
            rows: Matrix::from_vec(held.len(), d, data),
            later,
            old_halo: n_old,
        }
    }

    /// Rows held now, before the old model's are filled in.
    pub fn gathered(&self) -> usize {
        self.gids.len() - self.later.len()
    }

    /// The seed: the rows gathered, with those of the old model's kept input halo (`old_halo`: the old
    /// part's halo ids and one row each, as the wire delivers them) filled in. Without it (the model
    /// kept none, or rows that are not the old halo's), the rows it would have brought are left out, to be
    /// fetched from their owners. Equal to [`input_halo_seed`] of the same rows in one step.
    pub fn complete(self, old_halo: Option<(&[u32], &Matrix)>) -> HaloSeed {
        let SeedAhead {
            gids,
            mut rows,
            later,
            old_halo: n_old,
        } = self;
        let d = rows.cols();
        match old_halo {
            _ if later.is_empty() => {}
            Some((ids, m)) if ids.len() == n_old && m.shape() == (n_old, d) => {
                for (row, i) in later {
                    rows.row_mut(row).copy_from_slice(m.row(i));
                }
            }
            _ => {
                // the rows it would have brought left out (the others keep their order)
                let mut drop = vec![false; gids.len()];
                for &(row, _) in &later {
                    drop[row] = true;
                }
                let mut kept_gids = Vec::with_capacity(gids.len() - later.len());
                let mut data = Vec::with_capacity(kept_gids.capacity() * d);
                for (row, &gid) in gids.iter().enumerate() {
                    if !drop[row] {
                        kept_gids.push(gid);
                        data.extend_from_slice(rows.row(row));
                    }
                }
                let n = kept_gids.len();
                return HaloSeed::new(kept_gids, Matrix::from_vec(n, d, data))
                    .expect("one row per id, built together");
            }
        }
        HaloSeed::new(gids, rows).expect("one row per id, built together")
    }
}

/// Where a held row of the new halo comes from: row `i` of raw source `s`, or row `i` of the old part's
/// halo, filled in later.
#[derive(Clone, Copy)]
enum Held {
    Raw(usize, usize),
    Later(usize),
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
