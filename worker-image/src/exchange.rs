//! The engine's [`Exchange`] over a wire [`Link`]: halo rows forward, halo gradients backward, weight
//! gradients all-reduced, for one partition of a partition-parallel job.
//!
//! Options trade exactness for bytes, all decided by counter-based draws every worker computes alike, so no
//! indices travel:
//!
//! * boundary sampling (BNS-GCN): in each training epoch a boundary node's row is sent with probability `p`
//!   (the draw is keyed by epoch and global node id, the same for every layer and every peer); the others drop
//!   out of this epoch's aggregation (zero rows). Optionally sampled rows are scaled by `1/p`, an unbiased but
//!   high-variance estimate: at p = 0.1 it cost 2 points of accuracy on SBM 1M where plain dropping cost none
//!   (`bench/RESULTS.md`). Gradients flow back for sampled rows only.
//! * bounded staleness (Sancus): on a fixed schedule, a layer's halo rows are refreshed every `s + 1` training
//!   epochs and reused from the cache in between; with a threshold, each sender decides per peer and layer,
//!   re-sending rows once they are `s` epochs old or changed by at least the threshold (relative L2 norm) since
//!   it last sent them, and tells the peer with a one-value flag frame. Stale rows are constants, so no gradient
//!   is returned for them.
//! * 16-bit rows: halo rows and gradients travel as f16 or bf16.
//! * rematerialisation (SAR): [`Exchange::forward_each`] moves halo rows in `k - 1` rounds, round `r` sending
//!   to part `p + r` and receiving from part `p - r` (mod `k`), so a worker holds one peer's rows at a time
//!   and hands each range to the layer before the next round; [`Exchange::refetch_each`] repeats the rounds
//!   in backward (counted as the layer's `refetch` bytes) and [`Exchange::backward_each`] returns gradients in
//!   the same rounds, one peer's at a time.
//!
//! Evaluation passes always exchange exactly.

use std::time::Instant;

use physalia_gnn::rng::Stream;
use physalia_gnn::{
    Exchange, ExchangeError, ExchangeStats, HaloGrads, HaloSeed, LayerBytes, Matrix, Pass,
    VisitRows,
};
use physalia_graph::partition::Part;
use physalia_wire::{
    Dtype, Link, Phase, Tag, Traffic, all_reduce_sum, all_reduce_sum_f64, fetch_rows, halo_exchange,
};
use serde::{Deserialize, Serialize};

pub use physalia_control::ExchangeOptions;

/// Time spent by one worker in an epoch, split by what it waited for.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExchangeTimes {
    /// Sending and waiting for halo rows and gradients.
    pub halo_s: f64,
    /// All-reducing weight gradients and scalar statistics.
    pub all_reduce_s: f64,
}

/// The epoch a peer was last sent a layer's rows, and those rows (threshold staleness).
type LastSent = (u64, Vec<f32>);

pub struct MeshExchange<'a, L: Link + ?Sized> {
    link: &'a mut L,
    part: &'a Part,
    opts: ExchangeOptions,
    pass: Pass,
    /// Per layer: the halo rows last received (for staleness) and the epoch they were received in.
    cache: Vec<Option<(u64, Matrix)>>,
    /// Per layer: whether the current training pass reused the cache (then backward returns nothing).
    stale_now: Vec<bool>,
    /// Threshold staleness, per layer: per send peer the epoch and rows last sent; and for the current
    /// training pass which send peers got fresh rows and which receive peers sent fresh rows.
    last_sent: Vec<Vec<Option<LastSent>>>,
    fresh: Vec<Option<(Vec<bool>, Vec<bool>)>>,
    /// Scalar all-reduces in this epoch, for distinct tags.
    scalar_calls: u16,
    pub times: ExchangeTimes,
    /// Traffic at the previous `take_stats`.
    last: Traffic,
    /// Rank of part 0 of this worker's replica group: with `r` replicas of `k` parts, rank = replica * k + part.
    rank_base: usize,
}

impl<'a, L: Link + ?Sized> MeshExchange<'a, L> {
    /// The exchange of `part` over `link`. With more ranks than parts (`r` replicas of a `k`-way partitioning,
    /// rank = replica * k + part), halo rows stay inside the replica group and all-reduces span every rank.
    pub fn new(link: &'a mut L, part: &'a Part, opts: ExchangeOptions) -> Self {
        let rank_base = link.rank().saturating_sub(part.part);
        MeshExchange {
            rank_base,
            link,
            part,
            opts,
            pass: Pass::Eval,
            cache: Vec::new(),
            stale_now: Vec::new(),
            last_sent: Vec::new(),
            fresh: Vec::new(),
            scalar_calls: 0,
            times: ExchangeTimes::default(),
            last: Traffic::default(),
        }
    }

    /// [`halo_exchange`] with this group's part numbers as peers.
    fn exchange_rows<S: AsRef<[f32]>>(
        &mut self,
        tag: Tag,
        send: &[(usize, S)],
        recv: &[(usize, usize)],
        cols: usize,
        dtype: Dtype,
    ) -> Result<Vec<(usize, Vec<f32>)>, physalia_wire::WireError> {
        let b = self.rank_base;
        let send: Vec<(usize, &[f32])> = send.iter().map(|(p, r)| (p + b, r.as_ref())).collect();
        let recv: Vec<(usize, usize)> = recv.iter().map(|&(p, n)| (p + b, n)).collect();
        let mut got = halo_exchange(self.link, tag, &send, &recv, cols, dtype)?;
        for (p, _) in &mut got {
            *p -= b;
        }
        Ok(got)
    }

    /// Rank of this replica group's part 0 (0 without replicas).
    pub fn rank_base(&self) -> usize {
        self.rank_base
    }

    pub fn link(&self) -> &L {
        self.link
    }

    pub fn link_mut(&mut self) -> &mut L {
        self.link
    }

    /// Zeroes the per-epoch timers.
    pub fn take_times(&mut self) -> ExchangeTimes {
        std::mem::take(&mut self.times)
    }

    fn epoch(&self) -> u64 {
        match self.pass {
            Pass::Train { epoch } => epoch,
            Pass::Eval => 0,
        }
    }

    fn tag(&self, layer: usize, phase: Phase) -> Tag {
        // evaluation passes are tagged as epoch 0 of their own stream of messages: frames are ordered per peer,
        // so a tag only has to tell neighbouring messages apart
        Tag::new(self.epoch() as u32, layer as u16, phase)
    }

    /// Whether boundary node `gid` is sent in this pass.
    fn sampled(&self, gid: u32) -> bool {
        match self.pass {
            Pass::Train { epoch } if self.opts.boundary_sampling < 1.0 => {
                Stream::new(self.opts.seed, &[0xB45, epoch]).uniform(gid as u64)
                    < self.opts.boundary_sampling
            }
            _ => true,
        }
    }

    fn stale(&self, layer: usize) -> bool {
        let s = self.opts.staleness_epochs as u64;
        match self.pass {
            Pass::Train { epoch } if s > 0 => {
                (epoch - 1) % (s + 1) != 0 && self.cache.get(layer).is_some_and(|c| c.is_some())
            }
            _ => false,
        }
    }

    /// Gradients flow back only for rows that were sent fresh in this pass.
    fn backward_adaptive(
        &mut self,
        layer: usize,
        halo_grad: Matrix,
        own_grad: &mut Matrix,
        sent_fresh: &[bool],
        recv_fresh: &[bool],
    ) -> Result<(), ExchangeError> {
        let t = Instant::now();
        let cols = halo_grad.cols();
        let send: Vec<(usize, Vec<f32>)> = self
            .part
            .recv
            .iter()
            .zip(recv_fresh)
            .map(|((p, range), &fresh)| {
                let rows = if fresh {
                    halo_grad.data()[range.start * cols..range.end * cols].to_vec()
                } else {
                    vec![]
                };
                (*p as usize, rows)
            })
            .collect();
        let recv: Vec<(usize, usize)> = self
            .part
            .send
            .iter()
            .zip(sent_fresh)
            .map(|((p, rows), &fresh)| (*p as usize, if fresh { rows.len() } else { 0 }))
            .collect();
        let got = self
            .exchange_rows(
                self.tag(layer, Phase::Backward),
                &send,
                &recv,
                cols,
                self.opts.dtype,
            )
            .map_err(err)?;
        for (((_, rows), (_, grads)), &fresh) in self.part.send.iter().zip(got).zip(sent_fresh) {
            if !fresh {
                continue;
            }
            for (&r, g) in rows.iter().zip(grads.chunks_exact(cols.max(1))) {
                for (o, v) in own_grad.row_mut(r as usize).iter_mut().zip(g) {
                    *o += v;
                }
            }
        }
        self.times.halo_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    fn ensure_layer(&mut self, layer: usize) {
        if self.cache.len() <= layer {
            self.cache.resize_with(layer + 1, || None);
            self.stale_now.resize(layer + 1, false);
            self.last_sent
                .resize_with(layer + 1, || vec![None; self.part.send.len()]);
            self.fresh.resize_with(layer + 1, || None);
        }
    }

    /// The peer part of round `r` of `k - 1`: (sends to, receives from).
    fn round_peers(&self, r: usize) -> (usize, usize) {
        let (k, me) = (self.part.k, self.part.part);
        ((me + r) % k, (me + k - r) % k)
    }

    /// Rematerialisation's forward (and, with `refetch`, its backward fetch): `k - 1` rounds, each sending our
    /// rows to one peer and receiving one peer's rows, which `visit` consumes before the next round.
    fn forward_rounds(
        &mut self,
        layer: usize,
        own: &Matrix,
        refetch: bool,
        visit: &mut VisitRows<'_>,
    ) -> Result<(), ExchangeError> {
        let cols = own.cols();
        let flag = if refetch { REFETCH_LAYER } else { ROUND_LAYER };
        let tag = self.tag(layer | flag as usize, Phase::Forward);
        for r in 1..self.part.k {
            let t = Instant::now();
            let (to, from) = self.round_peers(r);
            let send: Vec<(usize, Vec<f32>)> = self
                .part
                .send
                .iter()
                .filter(|(p, _)| *p as usize == to)
                .map(|(p, rows)| {
                    let mut buf = Vec::with_capacity(rows.len() * cols);
                    for &row in rows {
                        buf.extend_from_slice(own.row(row as usize));
                    }
                    (*p as usize, buf)
                })
                .collect();
            let range = self
                .part
                .recv
                .iter()
                .find(|(p, _)| *p as usize == from)
                .map(|(_, range)| range.clone());
            let recv: Vec<(usize, usize)> = range.iter().map(|r| (from, r.len())).collect();
            let got = self
                .exchange_rows(tag, &send, &recv, cols, self.opts.dtype)
                .map_err(err)?;
            drop(send);
            self.times.halo_s += t.elapsed().as_secs_f64();
            if let (Some(range), Some((_, rows))) = (range, got.into_iter().next()) {
                visit(range.clone(), Matrix::from_vec(range.len(), cols, rows))?;
            }
        }
        Ok(())
    }

    fn forward_adaptive(
        &mut self,
        layer: usize,
        own: &Matrix,
        threshold: f32,
    ) -> Result<Matrix, ExchangeError> {
        let t = Instant::now();
        let epoch = self.epoch();
        let cols = own.cols();
        let max_age = self.opts.staleness_epochs as u64;
        let mut flags = Vec::with_capacity(self.part.send.len());
        let mut send = Vec::with_capacity(self.part.send.len());
        let mut sent_fresh = Vec::with_capacity(self.part.send.len());
        for (i, (peer, rows)) in self.part.send.iter().enumerate() {
            let mut buf = Vec::with_capacity(rows.len() * cols);
            for &r in rows {
                buf.extend_from_slice(own.row(r as usize));
            }
            let fresh = match &self.last_sent[layer][i] {
                Some((at, last)) if last.len() == buf.len() && epoch - at <= max_age => {
                    relative_change(&buf, last) >= threshold
                }
                _ => true,
            };
            flags.push((*peer as usize, vec![if fresh { 1.0f32 } else { 0.0 }]));
            if fresh {
                self.last_sent[layer][i] = Some((epoch, buf.clone()));
                send.push((*peer as usize, buf));
            } else {
                send.push((*peer as usize, Vec::new()));
            }
            sent_fresh.push(fresh);
        }
        let ones: Vec<(usize, usize)> = self
            .part
            .recv
            .iter()
            .map(|(p, _)| (*p as usize, 1))
            .collect();
        let flag_tag = Tag::new(epoch as u32, FLAG_LAYER | layer as u16, Phase::Forward);
        let got_flags = self
            .exchange_rows(flag_tag, &flags, &ones, 1, Dtype::F32)
            .map_err(err)?;
        let recv_fresh: Vec<bool> = got_flags
            .iter()
            .map(|(_, f)| f.first().is_some_and(|&v| v > 0.5))
            .collect();
        let recv: Vec<(usize, usize)> = self
            .part
            .recv
            .iter()
            .zip(&recv_fresh)
            .map(|((p, range), &fresh)| (*p as usize, if fresh { range.len() } else { 0 }))
            .collect();
        let got = self
            .exchange_rows(
                self.tag(layer, Phase::Forward),
                &send,
                &recv,
                cols,
                self.opts.dtype,
            )
            .map_err(err)?;
        let mut halo = match &self.cache[layer] {
            Some((_, c)) if c.shape() == (self.part.halo.len(), cols) => c.clone(),
            _ => Matrix::zeros(self.part.halo.len(), cols),
        };
        for (((_, range), (_, rows)), &fresh) in self.part.recv.iter().zip(got).zip(&recv_fresh) {
            if fresh {
                halo.data_mut()[range.start * cols..range.end * cols].copy_from_slice(&rows);
            }
        }
        self.cache[layer] = Some((epoch, halo.clone()));
        self.fresh[layer] = Some((sent_fresh, recv_fresh));
        self.stale_now[layer] = false;
        self.times.halo_s += t.elapsed().as_secs_f64();
        Ok(halo)
    }
}

/// Layer ids at and above this tag the staleness flags of layer `id - FLAG_LAYER`.
const FLAG_LAYER: u16 = 0x8000;
/// Rematerialisation's rounds of layer `id & LAYER_BITS`: with this bit, the rows fetched again in backward.
const REFETCH_LAYER: u16 = 0x4000;
/// ... and with this one, the rounds of forward and backward (apart from the one-shot exchanges they follow).
const ROUND_LAYER: u16 = 0x2000;
/// A seeded fetch of layer `id & LAYER_BITS`'s halo rows ([`Exchange::forward_seeded`]; phase `Fetch`).
const SEEDED_LAYER: u16 = 0x1000;
const LAYER_BITS: u16 = 0x0FFF;

/// `|a - b| / |b|` in the L2 norm (`inf` when `b` is zero and `a` is not).
fn relative_change(a: &[f32], b: &[f32]) -> f32 {
    let (mut diff, mut base) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        diff += ((x - y) as f64).powi(2);
        base += (*y as f64).powi(2);
    }
    if base == 0.0 {
        return if diff == 0.0 { 0.0 } else { f32::INFINITY };
    }
    (diff / base).sqrt() as f32
}

fn err(e: impl std::error::Error + Send + Sync + 'static) -> ExchangeError {
    Box::new(e)
}

impl<L: Link + ?Sized> Exchange for MeshExchange<'_, L> {
    fn begin_pass(&mut self, pass: Pass) {
        self.pass = pass;
        self.scalar_calls = 0;
    }

    fn forward(&mut self, layer: usize, own: &Matrix) -> Result<Option<Matrix>, ExchangeError> {
        self.ensure_layer(layer);
        self.fresh[layer] = None;
        if let (Pass::Train { .. }, Some(threshold), true) = (
            self.pass,
            self.opts.staleness_threshold,
            self.opts.staleness_epochs > 0,
        ) {
            return self.forward_adaptive(layer, own, threshold).map(Some);
        }
        let n_halo = self.part.halo.len();
        let cols = own.cols();
        if self.stale(layer) {
            self.stale_now[layer] = true;
            let (_, rows) = self.cache[layer]
                .as_ref()
                .expect("stale only with a cached copy");
            if rows.cols() == cols {
                return Ok(Some(rows.clone()));
            }
        }
        self.stale_now[layer] = false;
        let t = Instant::now();
        let scale = if self.opts.boundary_rescale {
            1.0 / self.opts.boundary_sampling
        } else {
            1.0
        };
        let sampling = matches!(self.pass, Pass::Train { .. }) && self.opts.boundary_sampling < 1.0;
        // gather the rows each peer needs (only the sampled ones when sampling)
        let mut send = Vec::with_capacity(self.part.send.len());
        for (peer, rows) in &self.part.send {
            let mut buf = Vec::with_capacity(rows.len() * cols);
            for &r in rows {
                if self.sampled(self.part.owned[r as usize]) {
                    buf.extend_from_slice(own.row(r as usize));
                }
            }
            send.push((*peer as usize, buf));
        }
        let recv: Vec<(usize, usize)> = self
            .part
            .recv
            .iter()
            .map(|(peer, range)| {
                let n = self.part.halo[range.clone()]
                    .iter()
                    .filter(|&&g| self.sampled(g))
                    .count();
                (*peer as usize, n)
            })
            .collect();
        let tag = self.tag(layer, Phase::Forward);
        let got = self
            .exchange_rows(tag, &send, &recv, cols, self.opts.dtype)
            .map_err(err)?;
        let mut halo = Matrix::zeros(n_halo, cols);
        for ((peer, range), (from, rows)) in self.part.recv.iter().zip(got) {
            debug_assert_eq!(*peer as usize, from);
            let mut src = rows.chunks_exact(cols.max(1));
            for h in range.clone() {
                if self.sampled(self.part.halo[h]) {
                    let row = src.next().expect("halo_exchange checked the row count");
                    let dst = halo.row_mut(h);
                    dst.copy_from_slice(row);
                    if sampling {
                        dst.iter_mut().for_each(|v| *v *= scale);
                    }
                }
            }
        }
        self.times.halo_s += t.elapsed().as_secs_f64();
        if self.opts.staleness_epochs > 0 && matches!(self.pass, Pass::Train { .. }) {
            self.cache[layer] = Some((self.epoch(), halo.clone()));
        }
        Ok(Some(halo))
    }

    fn backward(
        &mut self,
        layer: usize,
        halo_grad: Matrix,
        own_grad: &mut Matrix,
    ) -> Result<(), ExchangeError> {
        if self.stale_now.get(layer).copied().unwrap_or(false) {
            // stale halo rows were constants: nothing flows back
            return Ok(());
        }
        if let Some((sent_fresh, recv_fresh)) = self.fresh.get(layer).cloned().flatten() {
            return self.backward_adaptive(layer, halo_grad, own_grad, &sent_fresh, &recv_fresh);
        }
        let t = Instant::now();
        let cols = halo_grad.cols();
        let sampling = self.opts.boundary_sampling < 1.0 && matches!(self.pass, Pass::Train { .. });
        let scale = if self.opts.boundary_rescale {
            1.0 / self.opts.boundary_sampling
        } else {
            1.0
        };
        let mut send = Vec::with_capacity(self.part.recv.len());
        for (peer, range) in &self.part.recv {
            let mut buf = Vec::new();
            for h in range.clone() {
                if self.sampled(self.part.halo[h]) {
                    let row = halo_grad.row(h);
                    if sampling {
                        buf.extend(row.iter().map(|v| v * scale));
                    } else {
                        buf.extend_from_slice(row);
                    }
                }
            }
            send.push((*peer as usize, buf));
        }
        let recv: Vec<(usize, usize)> = self
            .part
            .send
            .iter()
            .map(|(peer, rows)| {
                let n = rows
                    .iter()
                    .filter(|&&r| self.sampled(self.part.owned[r as usize]))
                    .count();
                (*peer as usize, n)
            })
            .collect();
        let tag = self.tag(layer, Phase::Backward);
        let got = self
            .exchange_rows(tag, &send, &recv, cols, self.opts.dtype)
            .map_err(err)?;
        // peers in ascending order: the sum order is fixed
        for ((_, rows), (_, grads)) in self.part.send.iter().zip(got) {
            let mut src = grads.chunks_exact(cols.max(1));
            for &r in rows {
                if self.sampled(self.part.owned[r as usize]) {
                    let g = src.next().expect("halo_exchange checked the row count");
                    for (o, v) in own_grad.row_mut(r as usize).iter_mut().zip(g) {
                        *o += v;
                    }
                }
            }
        }
        self.times.halo_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    fn rematerializes(&self) -> bool {
        self.opts.rematerialize && self.part.k > 1
    }

    /// The halo rows `seed` lacks are asked of their owners by global id (4 bytes each, one request and
    /// one reply per peer) and come back in the exchange's dtype, rounded as [`Exchange::forward`] rounds
    /// them; an owner refuses an id it does not own.
    fn forward_seeded(
        &mut self,
        layer: usize,
        own: &Matrix,
        seed: &HaloSeed,
    ) -> Result<Option<Matrix>, ExchangeError> {
        let t = Instant::now();
        let cols = own.cols();
        let part = self.part;
        let mut halo = Matrix::zeros(part.halo.len(), cols);
        let mut requests = vec![Vec::new(); self.link.world()];
        // per peer in `part.recv`'s order: the halo rows asked of it
        let mut asked: Vec<(usize, Vec<usize>)> = Vec::with_capacity(part.recv.len());
        for (peer, range) in &part.recv {
            let rank = self.rank_base + *peer as usize;
            let mut rows = Vec::new();
            for h in range.clone() {
                let gid = part.halo[h];
                match seed.row(gid) {
                    Some(row) if row.len() == cols => halo.row_mut(h).copy_from_slice(row),
                    _ => {
                        requests[rank].push(gid);
                        rows.push(h);
                    }
                }
            }
            asked.push((rank, rows));
        }
        let serve = |peer: usize, ids: &[u32]| {
            let mut out = Vec::with_capacity(ids.len() * cols);
            for &gid in ids {
                let Ok(r) = part.owned.binary_search(&gid) else {
                    return Err(physalia_wire::WireError::Usage(format!(
                        "rank {peer} asked for node {gid}'s row, which part {} does not own",
                        part.part
                    )));
                };
                out.extend_from_slice(own.row(r));
            }
            Ok(out)
        };
        let tag = Tag::new(0, SEEDED_LAYER | layer as u16, Phase::Fetch);
        let got =
            fetch_rows(self.link, tag, &requests, cols, self.opts.dtype, serve).map_err(err)?;
        for (rank, rows) in asked {
            for (&h, row) in rows.iter().zip(got[rank].chunks_exact(cols.max(1))) {
                halo.row_mut(h).copy_from_slice(row);
            }
        }
        self.times.halo_s += t.elapsed().as_secs_f64();
        Ok(Some(halo))
    }

    fn forward_each(
        &mut self,
        layer: usize,
        own: &Matrix,
        visit: &mut VisitRows<'_>,
    ) -> Result<(), ExchangeError> {
        if !self.rematerializes() {
            if let Some(halo) = self.forward(layer, own)? {
                visit(0..halo.rows(), halo)?;
            }
            return Ok(());
        }
        self.forward_rounds(layer, own, false, visit)
    }

    fn refetch_each(
        &mut self,
        layer: usize,
        own: &Matrix,
        visit: &mut VisitRows<'_>,
    ) -> Result<(), ExchangeError> {
        if !self.rematerializes() {
            return Err(format!(
                "layer {layer}: halo rows are fetched again only with exchange.rematerialize"
            )
            .into());
        }
        self.forward_rounds(layer, own, true, visit)
    }

    fn backward_each(
        &mut self,
        layer: usize,
        n_halo: usize,
        own_grad: &mut Matrix,
        grad: &mut HaloGrads<'_>,
    ) -> Result<(), ExchangeError> {
        if !self.rematerializes() {
            let halo = grad(0..n_halo);
            return self.backward(layer, halo, own_grad);
        }
        let tag = self.tag(layer | ROUND_LAYER as usize, Phase::Backward);
        let cols = own_grad.cols();
        // round r returns the gradients of the rows received in forward's round r, and gets back those of
        // the rows we sent in it
        for r in 1..self.part.k {
            let (to, from) = self.round_peers(r);
            let send: Vec<(usize, Vec<f32>)> = self
                .part
                .recv
                .iter()
                .filter(|(p, _)| *p as usize == from)
                .map(|(p, range)| (*p as usize, grad(range.clone()).into_vec()))
                .collect();
            let t = Instant::now();
            let rows = self
                .part
                .send
                .iter()
                .find(|(p, _)| *p as usize == to)
                .map(|(_, rows)| rows);
            let recv: Vec<(usize, usize)> = rows.iter().map(|rows| (to, rows.len())).collect();
            let got = self
                .exchange_rows(tag, &send, &recv, cols, self.opts.dtype)
                .map_err(err)?;
            drop(send);
            if let (Some(rows), Some((_, grads))) = (rows, got.into_iter().next()) {
                for (&row, g) in rows.iter().zip(grads.chunks_exact(cols.max(1))) {
                    for (o, v) in own_grad.row_mut(row as usize).iter_mut().zip(g) {
                        *o += v;
                    }
                }
            }
            self.times.halo_s += t.elapsed().as_secs_f64();
        }
        Ok(())
    }

    fn all_reduce(&mut self, grads: &mut [Matrix]) -> Result<(), ExchangeError> {
        let t = Instant::now();
        // one message for all parameters
        let total: usize = grads.iter().map(|g| g.data().len()).sum();
        let mut flat = Vec::with_capacity(total);
        for g in grads.iter() {
            flat.extend_from_slice(g.data());
        }
        all_reduce_sum(
            self.link,
            Tag::all_reduce(self.epoch() as u32, u16::MAX),
            &mut flat,
        )
        .map_err(err)?;
        let mut off = 0;
        for g in grads.iter_mut() {
            let n = g.data().len();
            g.data_mut().copy_from_slice(&flat[off..off + n]);
            off += n;
        }
        self.times.all_reduce_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    fn is_local(&self) -> bool {
        // one worker: no peers, every collective is the identity
        self.link.world() == 1
    }

    fn take_stats(&mut self) -> ExchangeStats {
        let now = self.link.traffic().clone();
        let times = self.take_times();
        let mut per_layer = Vec::new();
        for (&(layer, phase), &(sent, recv)) in &now.by_layer_phase {
            let (ps, pr) = self.last.get(layer, phase);
            let (sent, received) = (
                sent.payload_bytes - ps.payload_bytes,
                recv.payload_bytes - pr.payload_bytes,
            );
            if sent + received == 0 {
                continue;
            }
            // staleness flags and rematerialisation's rounds count as their layer's traffic, rows fetched
            // again in backward as its `refetch`
            let refetch = layer & FLAG_LAYER == 0 && layer & REFETCH_LAYER != 0;
            let seeded = phase == Phase::Fetch && layer & SEEDED_LAYER != 0;
            let layer = if layer & FLAG_LAYER != 0 {
                layer & !FLAG_LAYER
            } else {
                layer & LAYER_BITS
            };
            let (layer, phase) = match phase {
                Phase::Forward if refetch => (Some(layer), "refetch"),
                Phase::Forward => (Some(layer), "forward"),
                // a seeded fetch of halo rows (the requests and the rows) is its layer's forward traffic
                Phase::Fetch if seeded => (Some(layer), "forward"),
                Phase::Backward => (Some(layer), "backward"),
                Phase::AllReduce => (None, "all_reduce"),
                Phase::Control => (None, "control"),
                Phase::Fetch => (None, "fetch"),
                Phase::Shuffle => (None, "shuffle"),
            };
            match per_layer
                .iter_mut()
                .find(|b: &&mut LayerBytes| b.layer == layer && b.phase == phase)
            {
                Some(b) => {
                    b.sent += sent;
                    b.received += received;
                }
                None => per_layer.push(LayerBytes {
                    layer,
                    phase: phase.to_string(),
                    sent,
                    received,
                }),
            }
        }
        let stats = ExchangeStats {
            bytes_sent: now.sent.bytes() - self.last.sent.bytes(),
            bytes_received: now.received.bytes() - self.last.received.bytes(),
            per_layer,
            halo_s: times.halo_s,
            all_reduce_s: times.all_reduce_s,
        };
        self.last = now;
        stats
    }

    fn all_reduce_scalars(&mut self, values: &mut [f64]) -> Result<(), ExchangeError> {
        let t = Instant::now();
        self.scalar_calls += 1;
        let tag = Tag::all_reduce(self.epoch() as u32, u16::MAX - self.scalar_calls);
        all_reduce_sum_f64(self.link, tag, values).map_err(err)?;
        self.times.all_reduce_s += t.elapsed().as_secs_f64();
        Ok(())
    }
}
