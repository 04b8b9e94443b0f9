//! METIS against streaming partitioning (Fennel/LDG with restreaming) on one dataset file: cut fraction,
//! balance, seconds and peak memory, one method per process so `/usr/bin/time -v` reports each one's
//! peak RSS alone.
//!
//! ```text
//! cargo run --release -p physalia-graph --example partition_compare -- FILE.safetensors \
//!     --k 4 --method metis|refined|fennel|ldg|random [--passes 3] [--refine 8] [--eps 0.05] \
//!     [--order natural|shuffled] [--seed 0] \
//!     [--gen-sbm N --classes 8 --avg-degree 20 --feat-dim 128] [--gen-rmat SCALE --edge-factor 10]
//! ```
//!
//! `--method refined` is `StreamParams::refined` (restreaming Fennel, then label-propagation
//! refinement: the out-of-core default); `--passes` and `--refine` override its pass counts. `fennel`
//! and `ldg` default to one pass and no refinement.
//!
//! `--gen-sbm N` writes an SBM (`synth::sbm`, homophily 0.8) to FILE and exits; `--gen-rmat SCALE`
//! writes an R-MAT graph of `2^SCALE` nodes (`synth::rmat`, Graph500 quadrants, undirected, ids
//! permuted); run it once, then partition in separate processes. The file is opened with `Dataset::open_unverified` (memory-mapped,
//! structure checked, features not read), so the partitioner's RSS is the CSR pages it touches plus what
//! it allocates. Prints one JSON line; `peak_heap_bytes` is the peak of live Rust heap bytes during the
//! partition call (a counting allocator: METIS's own C allocations are not in it, RSS is).

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use physalia_graph::partition::Partitioning;
use physalia_graph::stream::{
    StreamAlgorithm, StreamOrder, StreamParams, partition_stream, quality,
};
use physalia_graph::synth::{rmat, sbm};
use physalia_graph::{Dataset, RmatParams, SbmParams, partition_metis};

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

fn value<'a>(args: &'a [String], i: &mut usize, flag: &str) -> Result<&'a str> {
    *i += 1;
    args.get(*i)
        .map(String::as_str)
        .ok_or_else(|| format!("{flag} needs a value").into())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut file = None;
    let (mut k, mut method, mut eps, mut seed) = (4usize, "fennel".to_string(), 0.05, 0);
    let (mut passes, mut refine): (Option<usize>, Option<usize>) = (None, None);
    let mut order = StreamOrder::Natural;
    let (mut gen_sbm, mut classes, mut avg_degree, mut feat_dim) = (None, 8, 20.0, 128);
    let (mut gen_rmat, mut edge_factor) = (None::<u32>, 10usize);
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        match a {
            "--k" => k = value(&args, &mut i, a)?.parse()?,
            "--method" => method = value(&args, &mut i, a)?.to_string(),
            "--passes" => passes = Some(value(&args, &mut i, a)?.parse()?),
            "--refine" => refine = Some(value(&args, &mut i, a)?.parse()?),
            "--eps" => eps = value(&args, &mut i, a)?.parse()?,
            "--seed" => seed = value(&args, &mut i, a)?.parse()?,
            "--order" => {
                order = match value(&args, &mut i, a)? {
                    "natural" => StreamOrder::Natural,
                    "shuffled" => StreamOrder::Shuffled,
                    o => return Err(format!("--order {o}: expected natural or shuffled").into()),
                }
            }
            "--gen-sbm" => gen_sbm = Some(value(&args, &mut i, a)?.parse()?),
            "--classes" => classes = value(&args, &mut i, a)?.parse()?,
            "--avg-degree" => avg_degree = value(&args, &mut i, a)?.parse()?,
            "--feat-dim" => feat_dim = value(&args, &mut i, a)?.parse()?,
            "--gen-rmat" => gen_rmat = Some(value(&args, &mut i, a)?.parse()?),
            "--edge-factor" => edge_factor = value(&args, &mut i, a)?.parse()?,
            _ if !a.starts_with("--") && file.is_none() => file = Some(PathBuf::from(a)),
            _ => return Err(format!("unexpected argument '{a}'").into()),
        }
        i += 1;
    }
    let file = file.ok_or("expected a dataset file")?;
    if let Some(n) = gen_sbm {
        let t0 = Instant::now();
        let ds = sbm(&SbmParams {
            num_nodes: n,
            num_classes: classes,
            avg_degree,
            feat_dim,
            ..SbmParams::default()
        })?;
        ds.write(&file)?;
        eprintln!(
            "wrote {} in {:.1} s",
            file.display(),
            t0.elapsed().as_secs_f64()
        );
        return Ok(());
    }
    if let Some(scale) = gen_rmat {
        let t0 = Instant::now();
        let ds = rmat(&RmatParams {
            scale,
            edge_factor,
            feat_dim,
            num_classes: classes,
            ..RmatParams::default()
        })?;
        ds.write(&file)?;
        eprintln!(
            "wrote {} in {:.1} s",
            file.display(),
            t0.elapsed().as_secs_f64()
        );
        return Ok(());
    }

    let ds = Dataset::open_unverified(&file)?;
    let csr = ds.csr();
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let t0 = Instant::now();
    let mut moved: Vec<usize> = Vec::new();
    let (part, pass_seconds, refine_seconds): (Partitioning, Vec<f64>, Vec<f64>) = match method
        .as_str()
    {
        "metis" => (partition_metis(csr, k, seed)?, vec![], vec![]),
        "random" => {
            let parts = (0..csr.num_nodes())
                .map(|v| (physalia_hash(seed ^ v as u64) % k as u64) as u32)
                .collect();
            (
                Partitioning::from_assignment(csr, k, parts, "random", seed)?,
                vec![],
                vec![],
            )
        }
        "refined" | "fennel" | "ldg" => {
            let base = if method == "refined" {
                StreamParams::refined(k)
            } else {
                StreamParams::new(k)
            };
            let p = StreamParams {
                eps,
                passes: passes.unwrap_or(base.passes),
                refine_passes: refine.unwrap_or(base.refine_passes),
                order,
                seed,
                algorithm: if method == "ldg" {
                    StreamAlgorithm::Ldg
                } else {
                    StreamAlgorithm::Fennel { gamma: 1.5 }
                },
                ..base
            };
            let out = partition_stream(csr, &p)?;
            moved = out
                .passes
                .iter()
                .chain(&out.refine_passes)
                .map(|s| s.moved)
                .collect();
            let secs =
                |s: &[physalia_graph::stream::PassStats]| s.iter().map(|s| s.seconds).collect();
            (
                out.partitioning,
                secs(&out.passes),
                secs(&out.refine_passes),
            )
        }
        m => {
            return Err(
                format!("--method {m}: expected metis, refined, fennel, ldg or random").into(),
            );
        }
    };
    let seconds = t0.elapsed().as_secs_f64();
    let peak_heap = PEAK.load(Ordering::Relaxed) - base;
    let q = quality(csr, &part)?;
    // Work balance: the largest part's CSR entries (in-edges of its rows) over the mean; and how many
    // nodes have no edge (they balance node counts for free, see the README's table).
    let mut entries = vec![0usize; k];
    let mut isolated = 0usize;
    for v in 0..csr.num_nodes() {
        entries[part.parts[v] as usize] += csr.degree(v);
        isolated += (csr.degree(v) == 0) as usize;
    }
    let mean_entries = csr.num_edges() as f64 / k as f64;
    let edge_balance = if csr.num_edges() == 0 {
        1.0
    } else {
        *entries.iter().max().expect("k >= 1") as f64 / mean_entries
    };
    println!(
        "{}",
        serde_json::json!({
            "file": file.display().to_string(),
            "num_nodes": csr.num_nodes(),
            "num_undirected_edges": q.num_undirected_edges,
            "k": k,
            "method": part.method,
            "order": format!("{order:?}").to_lowercase(),
            "eps": eps,
            "seconds": seconds,
            "pass_seconds": pass_seconds,
            "refine_seconds": refine_seconds,
            "moved": moved,
            "cut_fraction": q.cut_fraction,
            "edge_cut": q.edge_cut,
            "balance": q.balance,
            "max_part": q.max_part,
            "edge_balance": edge_balance,
            "isolated_nodes": isolated,
            "min_part": q.min_part,
            "peak_heap_bytes": peak_heap,
        })
    );
    Ok(())
}

/// A seeded hash for the random baseline.
fn physalia_hash(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
