//! The gather kernel under every CPU SpMM: an output row is the weighted sum of source rows named by a CSR
//! row's entries, `out[i] = sum_k w_k x[j_k]`, for a block of consecutive output rows.
//!
//! Random source rows make SpMM wait on memory, so the kernel holds a tile of the output row in registers
//! while it walks the row's entries (one load per source vector, no read-modify-write of the output per
//! entry), and prefetches the source rows of the entries a fixed distance ahead into L2, so many cache
//! misses are in flight at once. An output it overwrites is written with non-temporal stores where rows
//! start on a line (no read for ownership of lines it writes whole, and no eviction of the source rows),
//! and need not be initialised. The vector path is picked at run time from what the CPU has (AVX-512F,
//! AVX2, or the portable loop), once per process; [`Path::detect`] names it.
//!
//! Architecture Invariant: every path computes each output element as the same chain of operations,
//! `((0 + w_0 x_0) + w_1 x_1) + ...` in entry order with a separate multiply and add (never a fused
//! multiply-add, which rounds once instead of twice), so all paths give bit for bit the same result and the
//! exactness tests (distributed against single-worker, SAR against whole aggregation) hold on any x86 CPU.

use std::mem::MaybeUninit;
use std::sync::OnceLock;

/// A vector instruction set the gather kernel can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// 16 floats a register, 32 registers.
    Avx512,
    /// 8 floats a register, 16 registers.
    Avx2,
    /// Plain Rust loops (what the compiler's baseline target makes of them).
    Portable,
}

impl Path {
    /// The widest path this CPU runs, detected on the first call. `PHYSALIA_SIMD=avx2|portable` caps it
    /// (to compare paths on one machine).
    pub fn detect() -> Path {
        static PATH: OnceLock<Path> = OnceLock::new();
        *PATH.get_or_init(|| {
            let cap = std::env::var("PHYSALIA_SIMD").ok();
            let best = Path::available()[0];
            match cap.as_deref() {
                Some("portable") => Path::Portable,
                Some("avx2") if best == Path::Avx512 => Path::Avx2,
                _ => best,
            }
        })
    }

    /// Every path this CPU can run, widest first (always ends with [`Path::Portable`]).
    pub fn available() -> Vec<Path> {
        let mut v = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Path::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                v.push(Path::Avx2);
            }
        }
        v.push(Path::Portable);
        v
    }

    pub fn name(self) -> &'static str {
        match self {
            Path::Avx512 => "avx512f",
            Path::Avx2 => "avx2",
            Path::Portable => "portable",
        }
    }
}

/// Bytes of source rows prefetched ahead of the current entry, into L2: enough misses in flight to cover
/// memory latency on a random gather (measured on an Emerald Rapids VM, issue 34: 8 KiB ahead into L1, the
/// first kernel's, gave 0.7x the rate of 32 rows ahead into L2 at widths 64 and 256), a small part of L2.
const PREFETCH_BYTES: usize = 32 << 10;

/// Source entries ahead of the current one whose rows are prefetched, for rows of `d` floats: the rows
/// within [`PREFETCH_BYTES`], at least 4 and at most 32. `PHYSALIA_PREFETCH=N` sets it (0: no software
/// prefetch), to measure its effect.
fn prefetch_entries(d: usize) -> usize {
    static N: OnceLock<Option<usize>> = OnceLock::new();
    let set = *N.get_or_init(|| {
        std::env::var("PHYSALIA_PREFETCH")
            .ok()
            .and_then(|v| v.parse().ok())
    });
    set.unwrap_or_else(|| (PREFETCH_BYTES / (d * 4).max(1)).clamp(4, 32))
}

/// Whether an overwritten output is written with non-temporal stores where it can be
/// (`PHYSALIA_NT_STORES=0`: never, to measure their effect).
fn nt_stores() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("PHYSALIA_NT_STORES").map_or(true, |v| v != "0"))
}

/// Prefetches the lines of the `bytes` bytes from `p` into L2, for kernels that gather rows at random
/// outside [`gather`] (GAT's); `p` need not be valid (a prefetch never faults). A no-op off x86-64.
#[inline(always)]
pub(crate) fn prefetch_l2(p: *const f32, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    x86::prefetch_span(p, bytes);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
}

/// `out` as possibly-uninitialised floats, for a [`Block`] that accumulates into it (or overwrites it).
pub(crate) fn as_uninit(out: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: same layout; the kernels only ever write initialised floats through it, so `out` stays
    // initialised.
    unsafe { &mut *(out as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

/// One block of output rows for [`gather`].
pub(crate) struct Block<'a, E, W, R> {
    /// The output rows, `d` floats each; row `r` of it is output row `first + r`. Must be initialised
    /// when `accumulate`; otherwise every float of it is written.
    pub out: &'a mut [MaybeUninit<f32>],
    pub first: usize,
    pub d: usize,
    /// Add to what `out` holds (true) or overwrite it (false; `out` is not read).
    pub accumulate: bool,
    /// Output row `i`'s entries `lo..hi`.
    pub entries: E,
    /// Every entry's source row index.
    pub indices: &'a [u32],
    /// Entry `k`'s weight, given `k` and its source row.
    pub weight: W,
    /// Source row `j`'s `d` floats.
    pub row: R,
    /// Non-temporal stores allowed (the caller's call: for an output too large to stay in cache for its
    /// next reader); taken only where the output is overwritten and its rows are whole, aligned lines.
    pub stream: bool,
    /// Prefetch the rows of entries ahead: only where every entry of the block's span has a source row
    /// (`row` must accept `indices[k]` for every `k` from the first row's `lo` to the last row's `hi`).
    pub prefetch: bool,
}

/// Runs one block on `path` (which must be one of [`Path::available`]).
pub(crate) fn gather<'a, E, W, R>(path: Path, b: Block<'a, E, W, R>)
where
    E: Fn(usize) -> (usize, usize),
    W: Fn(usize, usize) -> f32,
    R: Fn(usize) -> &'a [f32],
{
    if b.d == 0 || b.out.is_empty() {
        return;
    }
    match path {
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => {
            assert!(std::arch::is_x86_feature_detected!("avx512f"));
            // SAFETY: the CPU has AVX-512F (checked above).
            unsafe { x86::gather_avx512(b) }
        }
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => {
            assert!(std::arch::is_x86_feature_detected!("avx2"));
            // SAFETY: the CPU has AVX2 (checked above).
            unsafe { x86::gather_avx2(b) }
        }
        _ => gather_portable(b),
    }
}

fn gather_portable<'a, E, W, R>(b: Block<'a, E, W, R>)
where
    E: Fn(usize) -> (usize, usize),
    W: Fn(usize, usize) -> f32,
    R: Fn(usize) -> &'a [f32],
{
    let d = b.d;
    for (r, orow) in b.out.chunks_exact_mut(d).enumerate() {
        if !b.accumulate {
            orow.fill(MaybeUninit::new(0.0));
        }
        // SAFETY: initialised: by the caller when accumulating, just above otherwise.
        let orow = unsafe { &mut *(orow as *mut [MaybeUninit<f32>] as *mut [f32]) };
        let (lo, hi) = (b.entries)(b.first + r);
        for (k, &j) in (lo..hi).zip(&b.indices[lo..hi]) {
            let j = j as usize;
            let w = (b.weight)(k, j);
            for (o, &v) in orow.iter_mut().zip((b.row)(j)) {
                *o += w * v;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Block, nt_stores, prefetch_entries};
    use std::arch::x86_64::*;

    /// Prefetches the lines of the `bytes` bytes from `p` into L2 (`p` need not be valid: prefetches never
    /// fault). L2, not L1: the distance that covers memory latency holds more rows than L1's fill buffers
    /// and capacity take.
    #[inline(always)]
    pub(super) fn prefetch_span(p: *const f32, bytes: usize) {
        let p = p as *const i8;
        let end = p as usize + bytes;
        // from the line `p` is on to the line of the last byte
        let mut line = p.wrapping_sub(p as usize & 63);
        while (line as usize) < end {
            // SAFETY: a prefetch is a hint; it reads nothing and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line) };
            line = line.wrapping_add(64);
        }
    }

    /// One kernel per vector width: `$t` registers of `$lanes` floats per tile at most, then halving tiles,
    /// then a scalar tail narrower than a register.
    macro_rules! kernel {
        ($name:ident, $feat:literal, $v:ty, $lanes:expr, $max_tile:expr,
         $zero:ident, $load:ident, $store:ident, $stream:ident, $set1:ident, $mul:ident, $add:ident) => {
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $name<'a, E, W, R>(b: Block<'a, E, W, R>)
            where
                E: Fn(usize) -> (usize, usize),
                W: Fn(usize, usize) -> f32,
                R: Fn(usize) -> &'a [f32],
            {
                const L: usize = $lanes;
                let d = b.d;
                let rows = b.out.len() / d;
                let span_end = (b.entries)(b.first + rows - 1).1;
                let out = b.out.as_mut_ptr() as *mut f32;
                let ahead = prefetch_entries(d);
                // non-temporal stores write whole lines past the cache: only where every vector store is
                // aligned (rows start on a line, a row is whole lines) and the output is overwritten
                let stream = b.stream
                    && !b.accumulate
                    && nt_stores()
                    && out as usize % 64 == 0
                    && (d * 4) % 64 == 0;

                /// Columns `col..col + T * L` of output row `orow` over entries `lo..hi`.
                #[target_feature(enable = $feat)]
                #[inline]
                unsafe fn tile<'a, const T: usize, E, W, R>(
                    orow: *mut f32,
                    col: usize,
                    (lo, hi): (usize, usize),
                    b: &Block<'a, E, W, R>,
                    prefetch_to: usize,
                    ahead: usize,
                    stream: bool,
                ) where
                    W: Fn(usize, usize) -> f32,
                    R: Fn(usize) -> &'a [f32],
                {
                    let mut acc: [$v; T] = [$zero(); T];
                    if b.accumulate {
                        for (t, a) in acc.iter_mut().enumerate() {
                            // SAFETY: `col + T * L <= d`: within the output row, initialised when
                            // accumulating.
                            *a = unsafe { $load(orow.add(col + t * L)) };
                        }
                    }
                    for k in lo..hi {
                        if k + ahead < prefetch_to {
                            let j = b.indices[k + ahead] as usize;
                            prefetch_span((b.row)(j).as_ptr(), b.d * 4);
                        }
                        let j = b.indices[k] as usize;
                        let w = $set1((b.weight)(k, j));
                        let src = (b.row)(j);
                        assert!(src.len() >= col + T * L, "a source row is d floats");
                        let src = src.as_ptr();
                        for (t, a) in acc.iter_mut().enumerate() {
                            // SAFETY: checked above: within the source row.
                            let x = unsafe { $load(src.add(col + t * L)) };
                            *a = $add(*a, $mul(w, x));
                        }
                    }
                    for (t, a) in acc.iter().enumerate() {
                        // SAFETY: within the output row, as above; aligned to the vector where `stream`.
                        unsafe {
                            if stream {
                                $stream(orow.add(col + t * L), *a)
                            } else {
                                $store(orow.add(col + t * L), *a)
                            }
                        };
                    }
                }

                for r in 0..rows {
                    let (lo, hi) = (b.entries)(b.first + r);
                    // SAFETY: row `r` of `out` (which holds `rows * d` floats).
                    let orow = unsafe { out.add(r * d) };
                    let mut col = 0;
                    // the first tile of a row prefetches for every column
                    let mut pf = if b.prefetch && ahead > 0 { span_end } else { 0 };
                    macro_rules! tiles {
                        ($n:expr) => {
                            while d - col >= $n * L {
                                unsafe {
                                    tile::<{ $n }, E, W, R>(
                                        orow,
                                        col,
                                        (lo, hi),
                                        &b,
                                        pf,
                                        ahead,
                                        stream,
                                    )
                                };
                                col += $n * L;
                                pf = 0;
                            }
                        };
                    }
                    tiles!($max_tile);
                    tiles!($max_tile / 2);
                    tiles!($max_tile / 4);
                    tiles!($max_tile / 8);
                    tiles!(1);
                    if col < d {
                        // narrower than one register: scalar, same chain of operations
                        if !b.accumulate {
                            // SAFETY: columns `col..d` of row `r`, within `out`.
                            unsafe { orow.add(col).write_bytes(0, d - col) };
                        }
                        // SAFETY: as above, and initialised now
                        let o = unsafe { std::slice::from_raw_parts_mut(orow.add(col), d - col) };
                        for k in lo..hi {
                            if k + ahead < pf {
                                let j = b.indices[k + ahead] as usize;
                                prefetch_span((b.row)(j).as_ptr(), d * 4);
                            }
                            let j = b.indices[k] as usize;
                            let w = (b.weight)(k, j);
                            for (o, &v) in o.iter_mut().zip(&(b.row)(j)[col..]) {
                                *o += w * v;
                            }
                        }
                    }
                }
                if stream {
                    // non-temporal stores are weakly ordered: visible to other threads before the block
                    // is handed back
                    _mm_sfence();
                }
            }
        };
    }

    kernel!(
        gather_avx512,
        "avx512f",
        __m512,
        16,
        16,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_stream_ps,
        _mm512_set1_ps,
        _mm512_mul_ps,
        _mm512_add_ps
    );
    kernel!(
        gather_avx2,
        "avx2",
        __m256,
        8,
        8,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_stream_ps,
        _mm256_set1_ps,
        _mm256_mul_ps,
        _mm256_add_ps
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A random CSR of `rows` rows over `cols` sources (some rows empty, repeated columns allowed) and its
    /// source matrix of width `d`, from a fixed linear congruential stream.
    fn problem(
        rows: usize,
        cols: usize,
        d: usize,
        seed: u64,
    ) -> (Vec<usize>, Vec<u32>, Vec<f32>, Vec<f32>) {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let mut indptr = vec![0];
        let mut indices = vec![];
        for _ in 0..rows {
            let len = (next() % 9) as usize; // 0..8 entries, some rows empty
            for _ in 0..len {
                indices.push(next() % cols as u32);
            }
            indptr.push(indices.len());
        }
        let mut val = || (next() % 2001) as f32 / 1000.0 - 1.0;
        let weights = (0..indices.len()).map(|_| val()).collect();
        let x = (0..cols * d).map(|_| val()).collect();
        (indptr, indices, weights, x)
    }

    /// A cache line of floats, so an output can start on a line (where the kernels stream their stores).
    #[derive(Clone, Copy)]
    #[repr(C, align(64))]
    struct Line([f32; 16]);

    /// Runs two blocks of a random problem on `path`; the output starts on a cache line, or one float past
    /// it (`line_aligned`).
    fn run_at(
        path: Path,
        d: usize,
        accumulate: bool,
        prefetch: bool,
        seed: u64,
        line_aligned: bool,
    ) -> Vec<f32> {
        let (rows, cols) = (37, 23);
        let (indptr, indices, weights, x) = problem(rows, cols, d, seed);
        let mut lines = vec![Line([0.0; 16]); (rows * d).div_ceil(16) + 1];
        // SAFETY: `lines` is plain floats, `16 * lines.len()` of them
        let all: &mut [f32] =
            unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast(), 16 * lines.len()) };
        let out = &mut all[usize::from(!line_aligned)..][..rows * d];
        // a non-zero start, so accumulating differs from overwriting (and an unwritten float shows)
        for (i, o) in out.iter_mut().enumerate() {
            *o = (i % 7) as f32 * 0.25 - 0.5;
        }
        // two blocks, as rayon would hand them out
        let split = 16 * d;
        let (a, b) = out.split_at_mut(split);
        for (first, block) in [(0, a), (16, b)] {
            gather(
                path,
                Block {
                    out: as_uninit(block),
                    first,
                    d,
                    accumulate,
                    entries: |i| (indptr[i], indptr[i + 1]),
                    indices: &indices,
                    weight: |k, _| weights[k],
                    row: |j| &x[j * d..(j + 1) * d],
                    stream: true,
                    prefetch,
                },
            );
        }
        out.to_vec()
    }

    fn run(path: Path, d: usize, accumulate: bool, prefetch: bool, seed: u64) -> Vec<f32> {
        run_at(path, d, accumulate, prefetch, seed, false)
    }

    #[test]
    fn every_path_this_cpu_has_equals_the_portable_loop_bit_for_bit() {
        let paths = Path::available();
        assert_eq!(paths.last(), Some(&Path::Portable));
        for d in [
            1, 3, 8, 15, 16, 17, 31, 32, 48, 64, 100, 128, 200, 256, 257, 300,
        ] {
            for accumulate in [false, true] {
                let want = run(Path::Portable, d, accumulate, false, d as u64);
                for &path in &paths {
                    // on a line, whole-line rows take the non-temporal stores
                    for (prefetch, line_aligned) in [(false, false), (true, false), (true, true)] {
                        let got = run_at(path, d, accumulate, prefetch, d as u64, line_aligned);
                        let same = got
                            .iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{} differs at d={d}, accumulate={accumulate}, prefetch={prefetch}, \
                             line_aligned={line_aligned}",
                            path.name()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_portable_loop_is_the_weighted_sum_in_entry_order() {
        let d = 5;
        let (indptr, indices, weights, x) = problem(37, 23, d, 7);
        let got = run(Path::Portable, d, false, false, 7);
        for i in 0..37 {
            for c in 0..d {
                let mut want = 0f32;
                for k in indptr[i]..indptr[i + 1] {
                    want += weights[k] * x[indices[k] as usize * d + c];
                }
                assert_eq!(
                    got[i * d + c].to_bits(),
                    want.to_bits(),
                    "row {i} column {c}"
                );
            }
        }
    }

    #[test]
    fn a_cap_never_picks_a_path_the_cpu_lacks() {
        assert!(Path::available().contains(&Path::detect()));
    }
}
