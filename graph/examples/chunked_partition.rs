//! Streaming partitioning of a chunked dataset, reading its edge chunks in order and nothing else: what a
//! coordinator that never holds the graph does. Prints one JSON line (cut, balance, seconds, peak heap);
//! run under `/usr/bin/time -v` for the peak RSS.
//!
//! ```text
//! cargo run -p physalia-graph --example chunked_partition -- DIR --k 4 [--refined] [--passes 1] \
//!     [--refine 0] [--ldg]
//! cargo run -p physalia-graph --example chunked_partition -- DIR --gen-sbm N | --gen-rmat SCALE \
//!     [--feat-dim 128] [--chunk-rows 65536]
//! ```
//!
//! `--refined` starts from `StreamParams::refined` (the out-of-core default: restreamed Fennel until
//! converged, then label-propagation refinement), else from plain one-pass Fennel; `--passes` and
//! `--refine` override the pass counts. `--gen-sbm N` writes the issue's SBM (8 classes, homophily 0.8,
//! average degree 20) to DIR as chunks and exits; `--gen-rmat SCALE` an R-MAT graph of `2^SCALE`
//! nodes (Graph500 quadrants, edge factor 10, undirected).

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use physalia_graph::chunked::ChunkedDataset;
use physalia_graph::chunked_partition::partition_chunked;
use physalia_graph::chunked_synth::{rmat_chunked, sbm_chunked};
use physalia_graph::stream::{StreamAlgorithm, StreamParams, streamed_cut};
use physalia_graph::{RmatParams, SbmParams};

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
    let (mut refined, mut passes, mut refine) = (false, None, None);
    let (mut gen_sbm, mut gen_rmat, mut feat_dim, mut chunk_rows) =
        (None::<usize>, None::<u32>, 128usize, 65536usize);
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].clone();
        let mut value = |flag: &str| -> Result<String> {
            i += 1;
            Ok(args.get(i).ok_or(format!("{flag} needs a value"))?.clone())
        };
        match flag.as_str() {
            "--refined" => refined = true,
            "--refine" => refine = Some(value("--refine")?.parse()?),
            "--gen-sbm" => gen_sbm = Some(value("--gen-sbm")?.parse()?),
            "--gen-rmat" => gen_rmat = Some(value("--gen-rmat")?.parse()?),
            "--feat-dim" => feat_dim = value("--feat-dim")?.parse()?,
            "--chunk-rows" => chunk_rows = value("--chunk-rows")?.parse()?,
            "--k" => params.k = value("--k")?.parse()?,
            "--passes" => passes = Some(value("--passes")?.parse()?),
            "--ldg" => params.algorithm = StreamAlgorithm::Ldg,
            other if dir.is_none() => dir = Some(PathBuf::from(other)),
            other => return Err(format!("unexpected argument {other:?}").into()),
        }
        i += 1;
    }
    let dir = dir.ok_or("usage: chunked_partition DIR --k K [--refined] [--passes P] [--ldg]")?;
    if gen_sbm.is_some() || gen_rmat.is_some() {
        let t0 = Instant::now();
        if let Some(n) = gen_sbm {
            let p = SbmParams {
                num_nodes: n,
                num_classes: 8,
                avg_degree: 20.0,
                feat_dim,
                ..SbmParams::default()
            };
            sbm_chunked(&p, &dir, chunk_rows)?;
        } else if let Some(scale) = gen_rmat {
            let p = RmatParams {
                scale,
                edge_factor: 10,
                feat_dim,
                ..RmatParams::default()
            };
            rmat_chunked(&p, &dir, chunk_rows)?;
        }
        eprintln!(
            "wrote {} in {:.1} s",
            dir.display(),
            t0.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    if refined {
        params = StreamParams {
            algorithm: params.algorithm,
            ..StreamParams::refined(params.k)
        };
    }
    params.passes = passes.unwrap_or(params.passes);
    params.refine_passes = refine.unwrap_or(params.refine_passes);
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
         \"refine_seconds\":{:?},\"peak_heap_bytes\":{peak},\"data_bytes\":{}}}",
        dir.display().to_string(),
        p.k,
        p.method,
        p.edge_cut,
        p.edge_cut as f64 / total.max(1) as f64,
        p.balance,
        out.passes.iter().map(|s| s.seconds).collect::<Vec<_>>(),
        out.refine_passes
            .iter()
            .map(|s| s.seconds)
            .collect::<Vec<_>>(),
        ds.manifest().data_bytes()
    );
    Ok(())
}
