//! Streaming partitioning of a chunked dataset, reading its edge chunks in order and nothing else: what a
//! coordinator that never holds the graph does. Prints one JSON line (cut, balance, seconds, peak heap);
//! run under `/usr/bin/time -v` for the peak RSS.
//!
//! ```text
//! cargo run -p physalia-graph --example chunked_partition -- DIR --k 4 [--passes 1] [--ldg]
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use physalia_graph::chunked::ChunkedDataset;
use physalia_graph::chunked_partition::partition_chunked;
use physalia_graph::stream::{StreamAlgorithm, StreamParams, streamed_cut};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut dir: Option<PathBuf> = None;
    let mut params = StreamParams::new(4);
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--k" => {
                i += 1;
                params.k = args.get(i).ok_or("--k needs a value")?.parse()?;
            }
            "--passes" => {
                i += 1;
                params.passes = args.get(i).ok_or("--passes needs a value")?.parse()?;
            }
            "--ldg" => params.algorithm = StreamAlgorithm::Ldg,
            other if dir.is_none() => dir = Some(PathBuf::from(other)),
            other => return Err(format!("unexpected argument {other:?}").into()),
        }
        i += 1;
    }
    let dir = dir.ok_or("usage: chunked_partition DIR --k K [--passes P] [--ldg]")?;
    let ds = ChunkedDataset::open(&dir)?;
    let t0 = Instant::now();
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    let base = LIVE.load(Ordering::Relaxed);
    let out = partition_chunked(&ds, &params)?;
    let seconds = t0.elapsed().as_secs_f64();
    let peak = PEAK.load(Ordering::Relaxed) - base;
    let (_, total) = streamed_cut(&ds, &out.partitioning.parts)?;
    let p = &out.partitioning;
    println!(
        "{{\"dir\":{:?},\"k\":{},\"method\":{:?},\"edge_cut\":{},\"num_undirected_edges\":{total},\
         \"cut_fraction\":{:.4},\"balance\":{:.4},\"seconds\":{seconds:.3},\"pass_seconds\":{:?},\
         \"peak_heap_bytes\":{peak},\"data_bytes\":{}}}",
        dir.display().to_string(),
        p.k,
        p.method,
        p.edge_cut,
        p.edge_cut as f64 / total.max(1) as f64,
        p.balance,
        out.passes.iter().map(|s| s.seconds).collect::<Vec<_>>(),
        ds.manifest().data_bytes()
    );
    Ok(())
}
