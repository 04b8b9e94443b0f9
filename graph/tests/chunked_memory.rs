//! The chunked layout's memory claims, measured with a counting global allocator (as in
//! `stream_memory.rs`): generating an SBM graph straight into chunks, and partitioning the chunked
//! dataset by streaming, each peak far below the size of the graph they produce or read; loading the
//! same dataset whole peaks above it (so the counter sees the allocations).
//!
//! One test in this binary, so no other test's allocations are counted.

use physalia_graph::SbmParams;
use physalia_graph::chunked::ChunkedDataset;
use physalia_graph::chunked_partition::partition_chunked;
use physalia_graph::chunked_synth::sbm_chunked;
use physalia_graph::stream::StreamParams;

mod common;

use common::{Counting, peak_during};

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn streamed_synth_and_partition_peak_far_below_the_graph() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sbm");
    let n = 200_000;
    let p = SbmParams {
        num_nodes: n,
        avg_degree: 20.0,
        feat_dim: 64,
        seed: 1,
        ..SbmParams::default()
    };
    // Warm up rayon's global pool (its threads and queues are allocated once per process).
    rayon::broadcast(|_| ());

    let (synth_peak, m) = peak_during(|| sbm_chunked(&p, &dir, 16_384).unwrap());
    let graph_bytes =
        (m.num_nodes + 1) * 8 + m.num_edges * 4 + m.num_nodes * m.feat_dim * 4 + m.num_nodes * 8;
    assert_eq!(
        m.data_bytes() as usize,
        graph_bytes + 8 * (m.num_chunks() - 1) + 8 * n
    );
    eprintln!(
        "graph {} MB, streamed synth peak {} MB",
        graph_bytes >> 20,
        synth_peak >> 20
    );
    assert!(
        synth_peak < graph_bytes / 3,
        "streamed synth peaked at {synth_peak} B, the graph is {graph_bytes} B"
    );

    let ds = ChunkedDataset::open(&dir).unwrap();
    let params = StreamParams {
        passes: 2,
        ..StreamParams::new(8)
    };
    let (part_peak, out) = peak_during(|| partition_chunked(&ds, &params).unwrap());
    let edge_chunk = 16_384 * 8 + (m.num_edges / m.num_chunks()) * 4 * 2;
    let bound = 4 * n + 3 * edge_chunk + 64 * 1024;
    eprintln!("streamed partition peak {part_peak} B, bound {bound} B");
    assert!(part_peak <= bound, "peak {part_peak} B over {bound} B");
    assert!(part_peak < graph_bytes / 10);
    assert_eq!(out.partitioning.parts.len(), n);

    let (load_peak, whole) = peak_during(|| ds.load().unwrap());
    assert!(
        load_peak >= graph_bytes,
        "loading peaked at {load_peak} B, below the graph's {graph_bytes} B: the counter misses allocations"
    );
    drop(whole);
}
