//! The streaming partitioner's memory bound, measured: a counting global allocator records the peak of
//! live heap bytes during `partition_stream`, which must stay within `4 n + 64 k + 64 KiB` (the
//! assignment, O(k) counters, a constant) on a graph whose CSR is many times that. A copy of the edges, a
//! transpose or a symmetrised graph (what METIS needs) would exceed it.
//!
//! One test in this binary, so no other test's allocations are counted.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use physalia_graph::stream::{StreamAlgorithm, StreamOrder, StreamParams, partition_stream};
use physalia_graph::{Csr, csr_from_edge_pairs, partition_metis};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::SeqCst) + layout.size();
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size > layout.size() {
                let now = LIVE.fetch_add(new_size - layout.size(), Ordering::SeqCst) + new_size
                    - layout.size();
                PEAK.fetch_max(now, Ordering::SeqCst);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::SeqCst);
            }
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Peak live heap bytes above the starting level while `f` runs, and its result.
fn peak_during<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let out = f();
    (PEAK.load(Ordering::SeqCst) - base, out)
}

#[test]
fn peak_heap_is_the_assignment_plus_o_k() {
    let n = 20_000;
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    // Average degree about 60: the CSR is ~4.9 MB, the assignment 80 kB.
    let edges: Vec<(u32, u32)> = (0..n * 30)
        .map(|_| (rng.random_range(0..n as u32), rng.random_range(0..n as u32)))
        .collect();
    let (indptr, indices) = csr_from_edge_pairs(n, &edges, true);
    drop(edges);
    let csr = Csr::new(&indptr, &indices);
    let csr_bytes = indptr.len() * 8 + indices.len() * 4;

    // Warm up rayon's global pool (its threads and queues are allocated once per process).
    let _ = partition_stream(csr, &StreamParams::new(2)).unwrap();

    for k in [2usize, 16, 1000] {
        for (algorithm, order, passes) in [
            (
                StreamAlgorithm::Fennel { gamma: 1.5 },
                StreamOrder::Natural,
                3,
            ),
            (StreamAlgorithm::Ldg, StreamOrder::Shuffled, 2),
        ] {
            let p = StreamParams {
                passes,
                algorithm,
                order,
                ..StreamParams::new(k)
            };
            let (peak, out) = peak_during(|| partition_stream(csr, &p).unwrap());
            let bound = 4 * n + 64 * k + 64 * 1024;
            assert!(
                peak <= bound,
                "{p:?}: peak heap {peak} B over the bound {bound} B (CSR {csr_bytes} B)"
            );
            // The assignment itself is there: the bound is not vacuous.
            assert!(
                peak >= 4 * n,
                "{p:?}: peak {peak} B below the assignment's {} B",
                4 * n
            );
            assert_eq!(out.partitioning.parts.len(), n);
        }
    }
    assert!(csr_bytes > 10 * (4 * n + 64 * 1000 + 64 * 1024));

    // The measurement catches an O(E) partitioner: METIS on the same graph holds the symmetrised copy.
    let (metis_peak, _) = peak_during(|| partition_metis(csr, 16, 0).unwrap());
    assert!(
        metis_peak > csr_bytes / 2,
        "METIS peaked at {metis_peak} B, CSR {csr_bytes} B: the counter misses allocations"
    );
}
