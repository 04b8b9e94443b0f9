//! The streaming partitioner's memory bound, measured: a counting global allocator records the peak of
//! live heap bytes during `partition_stream` (plain, and `StreamParams::refined`), which must stay
//! within `4 n + 64 k + 64 KiB` (the assignment, O(k) counters, a constant) on a graph whose CSR is many
//! times that. A copy of the edges, a transpose or a symmetrised graph (what METIS needs) would exceed
//! it.
//!
//! One test in this binary, so no other test's allocations are counted.

use physalia_graph::stream::{StreamAlgorithm, StreamOrder, StreamParams, partition_stream};
use physalia_graph::{Csr, csr_from_edge_pairs, partition_metis};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod common;

use common::{Counting, peak_during};

#[global_allocator]
static GLOBAL: Counting = Counting;

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
        for (algorithm, order, passes, refined) in [
            (
                StreamAlgorithm::Fennel { gamma: 1.5 },
                StreamOrder::Natural,
                3,
                false,
            ),
            (StreamAlgorithm::Ldg, StreamOrder::Shuffled, 2, false),
            // The out-of-core default: restreaming, refinement, isolated nodes dealt last.
            (
                StreamAlgorithm::Fennel { gamma: 1.5 },
                StreamOrder::Natural,
                StreamParams::refined(k).passes,
                true,
            ),
        ] {
            let base = if refined {
                StreamParams::refined(k)
            } else {
                StreamParams::new(k)
            };
            let p = StreamParams {
                passes,
                algorithm,
                order,
                ..base
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
