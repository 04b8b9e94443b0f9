//! Neighbour sampling for mini-batch training (GraphSAGE / SALIENT style), and a loader that prepares
//! batches on a pool of threads while the consumer trains on earlier ones.
//!
//! [`Sampler::sample`] turns a list of seed nodes into a [`MiniBatch`]: the seeds' `L`-hop computation graph
//! with at most `fanouts[h]` in-neighbours drawn per node at hop `h`, laid out the way DGL and PyG lay out
//! message-flow graphs: every node the batch touches gets a local index, seeds first, then nodes in order of
//! the hop that first reached them, and each model layer gets one bipartite [`Block`] whose destinations are
//! a prefix of its sources. A layer then reads its input rows `0..n_src` and writes rows `0..n_dst`, and the
//! next layer's sources are exactly those rows, with no gather in between.
//!
//! Sampling follows GraphSAGE's minibatch algorithm (and SALIENT's and DGL's samplers): hop `h` draws
//! neighbours for *every* node reached so far (the destinations of that hop's block), not only for the
//! nodes first reached at hop `h - 1`, so every destination row of every block is a proper (sampled)
//! neighbourhood; a seed's row in the input layer is drawn independently of its row in the output layer.
//!
//! Determinism: a batch is a function of (graph, fanouts, seeds, key) alone. Each (hop, node) pair draws
//! from its own counter-based stream derived from the key, and a batch is sampled on one thread, so neither
//! the number of loader threads nor their timing can change a batch. [`with_prefetch`] derives each batch's
//! key from its index ([`batch_key`]) and hands results over in batch order; [`with_prefetch_keyed`] takes
//! the keys from the caller.
//!
//! Splitting a batch: the in-neighbours a node draws at hop `h` are a pure function of (key, `h`, node):
//! not of the other seeds, the order in which the hop's frontier lists the node, or the dedup table. So
//! sampling seeds `S` with key `k` as one batch or as any split `S = S1 + S2` (each part with the same `k`)
//! gives every seed the same computation graph: each node reached from a seed within `h` hops has the same
//! sampled row in every part that reaches it. Only the local numbering differs. Data parallelism and P3
//! rely on this to split a global batch over workers without changing what is learned.
//!
//! Performance: the work is dominated by random reads (a node's `indptr` entry, its neighbour list, and one
//! dedup-table entry per sampled edge), so the hot path is flat arrays and nothing else: deduplication uses
//! a per-thread table of one `u64` per graph node holding (generation stamp, local index) in a single cache
//! line access, reset between batches by bumping the generation instead of clearing; each hop runs as a
//! sampling pass and a mapping pass so both can prefetch the random lines a few iterations ahead; nothing is
//! allocated per node.

use std::panic::{self, AssertUnwindSafe};
use std::sync::{Condvar, Mutex, MutexGuard};

use crate::error::Error;

/// Errors from [`Sampler::new`]: the crate's error type, reporting a bad parameter.
pub type SampleError = Error;

/// Fan-outs above this use a small hash set instead of a linear scan to reject repeated draws.
const LINEAR_SCAN_MAX: usize = 32;
/// How many rows ahead the sampling pass prefetches `indptr` entries.
const INDPTR_AHEAD: usize = 64;
/// How many rows ahead the sampling pass prefetches neighbour lists.
const ROWS_AHEAD: usize = 16;
/// How many edges ahead the mapping pass prefetches dedup-table entries.
const EDGES_AHEAD: usize = 128;

/// Samples computation graphs from a borrowed in-neighbour CSR.
///
/// Fan-outs follow the PyG convention: `fanouts[0]` is the number of in-neighbours drawn per destination of
/// the seeds' block (the output layer), `fanouts[1]` per destination of the next block out, and so on;
/// `None` takes every neighbour. Drawing is without replacement and uniform: a node with in-degree at most
/// the fan-out keeps all its in-neighbours.
#[derive(Clone, Debug)]
pub struct Sampler<'g> {
    indptr: &'g [i64],
    indices: &'g [i32],
    fanouts: Vec<Option<u32>>,
}

impl<'g> Sampler<'g> {
    /// A sampler over `indptr` / `indices` (row `v` lists the in-neighbours of `v`, strictly ascending, as
    /// [`crate::Csr`] guarantees for a validated dataset).
    ///
    /// Only O(1) checks are made on the graph (the rows are not re-validated; a graph from
    /// [`crate::Dataset::open`] already was). Rejects empty `fanouts` and a fan-out of `Some(0)`, which would
    /// give a layer with no messages.
    pub fn new(
        indptr: &'g [i64],
        indices: &'g [i32],
        fanouts: &[Option<u32>],
    ) -> Result<Self, SampleError> {
        if fanouts.is_empty() {
            return Err(Error::param(
                "fanouts",
                "is empty; give one fan-out per layer (None takes every neighbour)",
            ));
        }
        if let Some(h) = fanouts.iter().position(|f| *f == Some(0)) {
            return Err(Error::param(
                "fanouts",
                format!(
                    "fan-out {h} is 0, which would leave that layer with no messages; use at least 1, \
                     or None to take every neighbour"
                ),
            ));
        }
        let Some(&last) = indptr.last() else {
            return Err(Error::param(
                "indptr",
                "is empty; it needs num_nodes + 1 entries",
            ));
        };
        if indptr[0] != 0 || last != indices.len() as i64 {
            return Err(Error::param(
                "indptr",
                format!(
                    "runs from {} to {last}, expected 0 to the length of indices ({})",
                    indptr[0],
                    indices.len()
                ),
            ));
        }
        let n = indptr.len() - 1;
        if n > i32::MAX as usize {
            return Err(Error::param(
                "indptr",
                format!("{n} nodes exceed the i32 range of local indices"),
            ));
        }
        Ok(Sampler {
            indptr,
            indices,
            fanouts: fanouts.to_vec(),
        })
    }

    pub fn num_nodes(&self) -> usize {
        self.indptr.len() - 1
    }

    /// Number of layers (blocks per batch).
    pub fn num_layers(&self) -> usize {
        self.fanouts.len()
    }

    pub fn fanouts(&self) -> &[Option<u32>] {
        &self.fanouts
    }

    /// Samples the computation graph of `seeds` (global node ids). The result depends only on the graph,
    /// the fan-outs, `seeds` and `key`; `scratch` only saves allocation (any scratch gives the same batch).
    ///
    /// # Panics
    /// If a seed is not a node of the graph or appears twice.
    pub fn sample(&self, seeds: &[u32], key: u64, scratch: &mut Scratch) -> MiniBatch {
        let n = self.num_nodes();
        let stamp = scratch.begin(n);
        let slots = &mut scratch.slots[..n];

        let mut nodes: Vec<u32> = Vec::with_capacity(seeds.len() * 8);
        for &s in seeds {
            let slot = slots
                .get_mut(s as usize)
                .unwrap_or_else(|| panic!("seed {s} is not a node of the graph (0..{n})"));
            assert!(
                (*slot >> 32) as u32 != stamp,
                "seed {s} appears twice; seeds must be distinct"
            );
            *slot = pack(stamp, nodes.len() as u32);
            nodes.push(s);
        }

        // Built from the seeds outwards, i.e. output layer first; reversed at the end.
        let mut blocks = Vec::with_capacity(self.fanouts.len());
        for (hop, &fanout) in self.fanouts.iter().enumerate() {
            let n_dst = nodes.len();
            let hop_key = mix64(key ^ (hop as u64 + 1).wrapping_mul(0xa076_1d64_78bd_642f));
            let mut indptr = Vec::with_capacity(n_dst + 1);
            let est = fanout.map_or(16, |f| f.min(64) as usize);
            let mut indices: Vec<i32> = Vec::with_capacity(n_dst * est);
            self.sample_rows(
                &nodes,
                fanout,
                hop_key,
                &mut indptr,
                &mut indices,
                &mut scratch.bufs,
            );
            map_to_local(slots, stamp, &mut nodes, &mut indices);
            // Local ids of a row are distinct (the row's global ids are) but not ordered: new nodes get
            // ids in order of first appearance, so sort each row.
            for w in indptr.windows(2) {
                sort_row(&mut indices[w[0] as usize..w[1] as usize]);
            }
            blocks.push(Block {
                n_dst,
                n_src: nodes.len(),
                indptr,
                indices,
            });
        }
        blocks.reverse();
        MiniBatch { nodes, blocks }
    }

    /// Appends, for each node of `dst`, its sampled in-neighbours (global ids) to `out` and the row ends to
    /// `indptr` (which gets a leading 0).
    fn sample_rows(
        &self,
        dst: &[u32],
        fanout: Option<u32>,
        hop_key: u64,
        indptr: &mut Vec<i64>,
        out: &mut Vec<i32>,
        bufs: &mut RowBuffers,
    ) {
        let (gp, gi) = (self.indptr, self.indices);
        // First the rows' extents, a loop of independent loads that prefetches far ahead; then the rows,
        // whose neighbour lists are prefetched from the extents without a dependent load.
        let spans = &mut bufs.spans;
        spans.clear();
        spans.extend(dst.iter().enumerate().map(|(i, &v)| {
            if let Some(&w) = dst.get(i + INDPTR_AHEAD) {
                prefetch(gp, w as usize);
            }
            let v = v as usize;
            (gp[v] as usize, gp[v + 1] as usize)
        }));
        indptr.push(0);
        for (i, (&v, &(s, e))) in dst.iter().zip(spans.iter()).enumerate() {
            if let Some(&(s, e)) = spans.get(i + ROWS_AHEAD) {
                prefetch(gi, s);
                prefetch(gi, e.wrapping_sub(1));
            }
            let v = v as usize;
            let row = &gi[s..e];
            match fanout {
                Some(k) if row.len() > k as usize => {
                    let start = out.len();
                    let mut rng = NodeRng::new(hop_key, v as u64);
                    let deg = row.len() as u32;
                    if k as usize <= LINEAR_SCAN_MAX {
                        floyd_linear(&mut rng, deg, k, out);
                    } else {
                        floyd_hashed(&mut rng, deg, k, out, &mut bufs.table);
                    }
                    for x in &mut out[start..] {
                        *x = row[*x as usize];
                    }
                }
                // A push loop: `extend_from_slice` calls memcpy, whose fixed cost dominates rows this short.
                _ if row.len() <= 16 => {
                    for &u in row {
                        out.push(u);
                    }
                }
                _ => out.extend_from_slice(row),
            }
            indptr.push(out.len() as i64);
        }
    }
}

/// Replaces each global id in `ids` by its local index, giving nodes not seen yet in this batch the next
/// local index (appending them to `nodes`), in order of first appearance.
fn map_to_local(slots: &mut [u64], stamp: u32, nodes: &mut Vec<u32>, ids: &mut [i32]) {
    for i in 0..ids.len() {
        if let Some(&ahead) = ids.get(i + EDGES_AHEAD) {
            prefetch(slots, ahead as usize);
        }
        let u = ids[i] as usize;
        let slot = &mut slots[u];
        let local = if (*slot >> 32) as u32 == stamp {
            *slot as u32
        } else {
            let local = nodes.len() as u32;
            *slot = pack(stamp, local);
            nodes.push(u as u32);
            local
        };
        ids[i] = local as i32;
    }
}

/// Sorts a row of distinct values. Short rows (nearly all) use a rank sort: each value's position is the
/// number of smaller values, counted branch-free over a padded copy so the compares vectorise; a comparison
/// sort on such short random rows is dominated by mispredicted branches.
fn sort_row(row: &mut [i32]) {
    const MAX: usize = 32;
    let k = row.len();
    if k <= 1 {
        return;
    }
    if k > MAX {
        row.sort_unstable();
        return;
    }
    let mut tmp = [i32::MAX; MAX];
    tmp[..k].copy_from_slice(row);
    let padded = &tmp[..k.next_multiple_of(8)];
    for &x in &tmp[..k] {
        let rank: u32 = padded.iter().map(|&y| (y < x) as u32).sum();
        row[rank as usize] = x;
    }
}

/// Floyd's algorithm: appends `k` distinct positions drawn uniformly from `0..deg` (`k < deg`), rejecting
/// repeats by a linear scan of the positions drawn so far (branch-free, so it vectorises; fine for small k).
fn floyd_linear(rng: &mut NodeRng, deg: u32, k: u32, out: &mut Vec<i32>) {
    let start = out.len();
    for j in deg - k..deg {
        let t = rng.below(j + 1) as i32;
        let seen = out[start..].iter().fold(false, |a, &p| a | (p == t));
        out.push(if seen { j as i32 } else { t });
    }
}

/// Floyd's algorithm with an open-addressing set (in `table`, reused) for large fan-outs.
fn floyd_hashed(rng: &mut NodeRng, deg: u32, k: u32, out: &mut Vec<i32>, table: &mut Vec<u32>) {
    let cap = (2 * k as usize).next_power_of_two();
    let shift = 64 - cap.trailing_zeros();
    table.clear();
    table.resize(cap, u32::MAX);
    // Inserts x; false if it was already there.
    let mut insert = |x: u32| {
        let mut h = ((x as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> shift) as usize;
        loop {
            match table[h] {
                u32::MAX => {
                    table[h] = x;
                    return true;
                }
                y if y == x => return false,
                _ => h = (h + 1) & (cap - 1),
            }
        }
    };
    for j in deg - k..deg {
        let t = rng.below(j + 1);
        let pick = if insert(t) {
            t
        } else {
            insert(j);
            j
        };
        out.push(pick as i32);
    }
}

#[inline(always)]
fn pack(stamp: u32, local: u32) -> u64 {
    ((stamp as u64) << 32) | local as u64
}

/// Hints the CPU to fetch `slice[i]` into cache; a no-op where there is no such hint or `i` is out of range.
#[inline(always)]
fn prefetch<T>(slice: &[T], i: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(x) = slice.get(i) {
        // SAFETY: a prefetch is only a hint: it never faults and has no effect on program semantics; the
        // pointer is in bounds anyway.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                (x as *const T).cast::<i8>(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (slice, i);
}

/// The SplitMix64 output function: a bijective 64-bit mixer.
#[inline(always)]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SplitMix64 started at a state derived from (hop key, node): each node of each hop gets its own stream, so
/// a row's draws do not depend on which rows were drawn before it.
struct NodeRng(u64);

impl NodeRng {
    #[inline(always)]
    fn new(hop_key: u64, node: u64) -> Self {
        NodeRng(mix64(hop_key ^ node.wrapping_mul(0xd1b5_4a32_d192_ed03)))
    }

    #[inline(always)]
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.0)
    }

    /// Uniform in `0..n` by Lemire's multiply-shift on 64 bits; the bias is below `n / 2^64`, i.e. nil.
    #[inline(always)]
    fn below(&mut self, n: u32) -> u32 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u32
    }
}

/// Reusable per-thread state for [`Sampler::sample`]: for every graph node a `u64` holding the generation
/// stamp of the batch that last saw it (high half) and its local index in that batch (low half), so one
/// random access both deduplicates and maps a node. Starting a batch bumps the generation instead of
/// clearing the table.
#[derive(Clone, Debug, Default)]
pub struct Scratch {
    slots: Vec<u64>,
    generation: u32,
    bufs: RowBuffers,
}

/// Per-hop working buffers of the sampling pass.
#[derive(Clone, Debug, Default)]
struct RowBuffers {
    /// `(start, end)` of each destination's row in the graph's `indices`.
    spans: Vec<(usize, usize)>,
    /// Open-addressing set for Floyd's algorithm with large fan-outs.
    table: Vec<u32>,
}

impl Scratch {
    /// Scratch for a graph of `num_nodes` nodes (a smaller one grows on first use).
    pub fn new(num_nodes: usize) -> Scratch {
        Scratch {
            // All-zero, so the allocator hands out lazily zeroed pages; generation 0 is never used.
            slots: vec![0; num_nodes],
            generation: 0,
            bufs: RowBuffers::default(),
        }
    }

    /// Starts a batch on a graph of `n` nodes; returns its stamp (never 0, so fresh slots are unseen).
    fn begin(&mut self, n: usize) -> u32 {
        if self.slots.len() < n {
            self.slots.resize(n, 0);
        }
        if self.generation == u32::MAX {
            self.slots.fill(0);
            self.generation = 0;
        }
        self.generation += 1;
        self.generation
    }
}

/// A sampled computation graph in the DGL / PyG "nodes ordered by hop" layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MiniBatch {
    /// Global ids of every node the batch touches: the seeds first (in the given order), then the nodes
    /// first reached at hop 1 in order of first appearance, then hop 2, ...
    pub nodes: Vec<u32>,
    /// `blocks[l]` for `l = 0..L` is the bipartite graph of model layer `l`, input layer first: `blocks[0]`
    /// was drawn with `fanouts[L-1]`, `blocks[L-1]` is the seeds' block (`fanouts[0]`). Consecutive blocks
    /// chain: `blocks[l + 1].n_src == blocks[l].n_dst`.
    pub blocks: Vec<Block>,
}

impl MiniBatch {
    /// The seeds, in the order given to [`Sampler::sample`] (destinations of the last block).
    pub fn seeds(&self) -> &[u32] {
        &self.nodes[..self.blocks.last().map_or(0, |b| b.n_dst)]
    }

    /// Sampled edges over all blocks.
    pub fn num_edges(&self) -> usize {
        self.blocks.iter().map(Block::num_edges).sum()
    }

    /// The nodes whose input features the first layer reads, `nodes[..blocks[0].n_src]` (all of them).
    pub fn input_nodes(&self) -> &[u32] {
        &self.nodes[..self.blocks.first().map_or(0, |b| b.n_src)]
    }
}

/// One model layer's bipartite graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// Destinations are `nodes[..n_dst]`, sources `nodes[..n_src]`: destinations are a prefix of sources.
    pub n_dst: usize,
    pub n_src: usize,
    /// CSR over destinations: the sampled in-neighbours of destination `i` are
    /// `indices[indptr[i]..indptr[i + 1]]`, local source indices (`< n_src`), strictly ascending.
    pub indptr: Vec<i64>,
    pub indices: Vec<i32>,
}

impl Block {
    pub fn num_edges(&self) -> usize {
        self.indices.len()
    }
}

/// The key [`with_prefetch`] samples batch `batch_idx` with: `key_base` mixed with the index, so each batch
/// has its own stream and a batch can be reproduced alone with [`Sampler::sample`].
pub fn batch_key(key_base: u64, batch_idx: usize) -> u64 {
    key_base ^ mix64((batch_idx as u64).wrapping_add(0x632b_e59b_d9b4_e019))
}

/// Samples `batches` (seed lists) on `threads` threads, at most `depth` batches ahead of the consumer, and
/// runs `consume` on an iterator that yields `prepare(batch_idx, minibatch)` for every batch, in batch order.
///
/// Batch `b` is sampled with [`batch_key`]`(key_base, b)`, so what `consume` sees does not depend on
/// `threads` or timing. `prepare` runs on the loader threads too (gather features there, say), overlapping
/// the consumer's work. The threads are scoped: the graph and `prepare` may borrow, and all of them have
/// stopped when this returns, also when `consume` stops early (it may drop the iterator half way) or panics.
/// A panic in `prepare` or in sampling is re-raised on the consumer's thread at the batch it hit.
///
/// `threads` and `depth` are taken as at least 1.
pub fn with_prefetch<T, R>(
    sampler: &Sampler<'_>,
    batches: &[Vec<u32>],
    key_base: u64,
    threads: usize,
    depth: usize,
    prepare: impl Fn(usize, MiniBatch) -> T + Sync,
    consume: impl FnOnce(&mut dyn Iterator<Item = T>) -> R,
) -> R
where
    T: Send,
{
    with_prefetch_keyed(
        sampler,
        batches,
        |b| batch_key(key_base, b),
        threads,
        depth,
        prepare,
        consume,
    )
}

/// [`with_prefetch`] with batch `b` sampled with key `key(b)`: several batches may share a key, e.g. the
/// parts of one global batch split over workers (see the module doc on splitting a batch).
pub fn with_prefetch_keyed<T, R>(
    sampler: &Sampler<'_>,
    batches: &[Vec<u32>],
    key: impl Fn(usize) -> u64 + Sync,
    threads: usize,
    depth: usize,
    prepare: impl Fn(usize, MiniBatch) -> T + Sync,
    consume: impl FnOnce(&mut dyn Iterator<Item = T>) -> R,
) -> R
where
    T: Send,
{
    let depth = depth.max(1);
    let threads = threads.max(1).min(batches.len().max(1));
    let queue = Queue {
        state: Mutex::new(QueueState {
            next_claim: 0,
            next_yield: 0,
            ready: (0..depth).map(|_| None).collect(),
            stop: false,
        }),
        filled: Condvar::new(),
        space: Condvar::new(),
    };
    std::thread::scope(|scope| {
        for _ in 0..threads {
            let (queue, prepare, key) = (&queue, &prepare, &key);
            scope.spawn(move || {
                let mut scratch = Scratch::new(sampler.num_nodes());
                while let Some(b) = queue.claim(batches.len(), depth) {
                    let result = panic::catch_unwind(AssertUnwindSafe(|| {
                        let mb = sampler.sample(&batches[b], key(b), &mut scratch);
                        prepare(b, mb)
                    }));
                    let failed = result.is_err();
                    queue.put(b, depth, result);
                    if failed {
                        break;
                    }
                }
            });
        }
        // Stops the workers however `consume` ends (return, early drop of the iterator, or panic); the scope
        // then joins them.
        let _stop = StopOnDrop(&queue);
        let mut iter = Ordered {
            queue: &queue,
            len: batches.len(),
            depth,
        };
        consume(&mut iter)
    })
}

type Outcome<T> = std::thread::Result<T>;

struct Queue<T> {
    state: Mutex<QueueState<T>>,
    /// Signalled when a result lands (the consumer waits on it).
    filled: Condvar,
    /// Signalled when the consumer takes a result or stops (workers wait on it).
    space: Condvar,
}

struct QueueState<T> {
    /// Next batch index a worker will take.
    next_claim: usize,
    /// Next batch index the consumer will yield; batches `next_yield..next_yield + depth` may be in flight.
    next_yield: usize,
    /// Results by `batch_idx % depth`.
    ready: Vec<Option<Outcome<T>>>,
    stop: bool,
}

impl<T> Queue<T> {
    fn lock(&self) -> MutexGuard<'_, QueueState<T>> {
        // A panic never happens while the lock is held (user code runs outside it), but stay usable anyway.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next batch index for a worker, waiting while the window ahead of the consumer is full; `None`
    /// when all are taken or the consumer has stopped.
    fn claim(&self, len: usize, depth: usize) -> Option<usize> {
        let mut st = self.lock();
        loop {
            if st.stop || st.next_claim >= len {
                return None;
            }
            if st.next_claim < st.next_yield + depth {
                st.next_claim += 1;
                return Some(st.next_claim - 1);
            }
            st = self.space.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn put(&self, b: usize, depth: usize, result: Outcome<T>) {
        let mut st = self.lock();
        if !st.stop {
            st.ready[b % depth] = Some(result);
            self.filled.notify_one();
        }
    }
}

struct StopOnDrop<'a, T>(&'a Queue<T>);

impl<T> Drop for StopOnDrop<'_, T> {
    fn drop(&mut self) {
        self.0.lock().stop = true;
        self.0.space.notify_all();
    }
}

/// The consumer's side: yields results in batch order.
struct Ordered<'a, T> {
    queue: &'a Queue<T>,
    len: usize,
    depth: usize,
}

impl<T> Iterator for Ordered<'_, T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        let mut st = self.queue.lock();
        let b = st.next_yield;
        if b >= self.len {
            return None;
        }
        loop {
            if let Some(outcome) = st.ready[b % self.depth].take() {
                st.next_yield += 1;
                drop(st);
                self.queue.space.notify_all();
                return Some(outcome.unwrap_or_else(|payload| panic::resume_unwind(payload)));
            }
            st = self
                .queue
                .filled
                .wait(st)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.len.saturating_sub(self.queue.lock().next_yield);
        (left, Some(left))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_wraparound_clears_the_table() {
        // 0 <- {1, 2}, 1 <- {2}, 2 <- {}.
        let (indptr, indices) = ([0i64, 2, 3, 3], [1i32, 2, 2]);
        let sampler = Sampler::new(&indptr, &indices, &[None, None]).unwrap();
        let expect = sampler.sample(&[0], 0, &mut Scratch::new(3));
        let mut scratch = Scratch::new(3);
        scratch.generation = u32::MAX - 2;
        for _ in 0..5 {
            assert_eq!(sampler.sample(&[0], 0, &mut scratch), expect);
        }
        assert_eq!(scratch.generation, 3);
    }

    #[test]
    fn batch_keys_differ() {
        let keys: std::collections::HashSet<u64> = (0..1000).map(|b| batch_key(5, b)).collect();
        assert_eq!(keys.len(), 1000);
    }
}
