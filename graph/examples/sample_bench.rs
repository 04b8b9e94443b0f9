//! Neighbour-sampling throughput, against a memory-bandwidth bound measured in the same run.
//!
//! ```text
//! cargo run --release -p physalia-graph --example sample_bench -- FILE.safetensors \
//!     [--fanouts 25,10] [--batch 1024] [--threads 2] [--depth 2*threads] [--seconds 5] [--key 0] \
//!     [--gen-sbm N]
//! ```
//!
//! Samples the training split, in file order and cut into `--batch`-sized seed lists, through
//! [`with_prefetch`] on `--threads` threads for about `--seconds` (whole epochs repeated, the last one cut
//! short), and prints one JSON object: sampled edges per second (edges summed over all blocks / wall time),
//! batches per second, a single-thread figure without the loader, and a bound. The bound: this run's
//! sequential read bandwidth (a `--threads`-thread sum over a 1 GiB array) divided by the bytes the sampler
//! must move per sampled edge, counted on the batches themselves: per destination row 16 B of `indptr`, its
//! neighbour list (4 B per neighbour when all are taken, else one 64 B line per draw), and per sampled edge a
//! 64 B line of the dedup table plus a 4 B output write. Random lines are charged at sequential bandwidth,
//! so the bound is optimistic. Fan-out `all` (or `-1`) takes every neighbour.
//!
//! `--gen-sbm N` writes a Rust-generated SBM (N nodes, mean degree 10, 16 classes, 16 features) to FILE
//! first if FILE does not exist, for machines without numpy to run `bench/gen_sbm.py`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use physalia_graph::sample::{Sampler, Scratch, batch_key, with_prefetch};
use physalia_graph::synth::sbm;
use physalia_graph::{Csr, Dataset, SbmParams, Split};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

struct Args {
    file: PathBuf,
    fanouts: Vec<Option<u32>>,
    batch: usize,
    threads: usize,
    depth: Option<usize>,
    seconds: f64,
    key: u64,
    gen_sbm: Option<usize>,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        file: PathBuf::new(),
        fanouts: vec![Some(25), Some(10)],
        batch: 1024,
        threads: 2,
        depth: None,
        seconds: 5.0,
        key: 0,
        gen_sbm: None,
    };
    let mut file = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--fanouts" => {
                a.fanouts = value()?
                    .split(',')
                    .map(|f| match f.trim() {
                        "all" | "-1" => Ok(None),
                        n => n.parse().map(Some),
                    })
                    .collect::<std::result::Result<_, _>>()?
            }
            "--batch" => a.batch = value()?.parse()?,
            "--threads" => a.threads = value()?.parse()?,
            "--depth" => a.depth = Some(value()?.parse()?),
            "--seconds" => a.seconds = value()?.parse()?,
            "--key" => a.key = value()?.parse()?,
            "--gen-sbm" => a.gen_sbm = Some(value()?.parse()?),
            "-h" | "--help" => {
                println!(
                    "usage: sample_bench FILE.safetensors [--fanouts 25,10] [--batch 1024] [--threads 2] \
                     [--depth N] [--seconds 5] [--key 0] [--gen-sbm N]"
                );
                std::process::exit(0);
            }
            s if s.starts_with('-') => return Err(format!("unknown option {s}").into()),
            s => file = Some(PathBuf::from(s)),
        }
    }
    a.file = file.ok_or("missing FILE.safetensors")?;
    if a.batch == 0 || a.threads == 0 {
        return Err("--batch and --threads must be at least 1".into());
    }
    Ok(a)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("sample_bench: error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let a = parse_args()?;
    if let (Some(n), false) = (a.gen_sbm, a.file.exists()) {
        eprintln!("generating an SBM with {n} nodes into {}", a.file.display());
        let ds = sbm(&SbmParams {
            num_nodes: n,
            num_classes: 16,
            avg_degree: 10.0,
            feat_dim: 16,
            ..Default::default()
        })?;
        if let Some(dir) = a.file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        ds.write(&a.file)?;
    }
    let ds = Dataset::open(&a.file).map_err(|e| format!("opening the dataset: {e}"))?;
    let csr = ds.csr();
    let train: Vec<u32> = ds.split(Split::Train).iter().map(|&v| v as u32).collect();
    if train.is_empty() {
        return Err("the dataset has no training nodes".into());
    }
    let batches: Vec<Vec<u32>> = train.chunks(a.batch).map(<[u32]>::to_vec).collect();
    let sampler = Sampler::new(csr.indptr, csr.indices, &a.fanouts)?;
    let depth = a.depth.unwrap_or(2 * a.threads);
    eprintln!(
        "{}: {} nodes, {} edges, {} training seeds in {} batches; fanouts {:?}, {} threads, depth {depth}",
        a.file.display(),
        csr.num_nodes(),
        csr.num_edges(),
        train.len(),
        batches.len(),
        a.fanouts,
        a.threads
    );

    // Warm-up: fault in the mapping and the scratch tables outside the timed runs.
    let warm = &batches[..batches.len().min(4 * a.threads)];
    with_prefetch(
        &sampler,
        warm,
        a.key,
        a.threads,
        depth,
        |_, mb| mb.num_edges(),
        |it| it.count(),
    );

    // The loader, as training would use it.
    let budget = Duration::from_secs_f64(a.seconds);
    let (mut n_batches, mut n_edges, mut n_nodes) = (0usize, 0usize, 0usize);
    let cpu0 = process_cpu_s();
    let t0 = Instant::now();
    let mut epoch = 0u64;
    while t0.elapsed() < budget {
        let key_base = a.key ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        with_prefetch(
            &sampler,
            &batches,
            key_base,
            a.threads,
            depth,
            |_, mb| (mb.num_edges(), mb.nodes.len()),
            |it| {
                for (e, v) in it {
                    n_batches += 1;
                    n_edges += e;
                    n_nodes += v;
                    if t0.elapsed() >= budget {
                        break;
                    }
                }
            },
        );
        epoch += 1;
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let cpu_s = process_cpu_s().zip(cpu0).map(|(b, a)| b - a);
    let edges_per_s = n_edges as f64 / wall_s;

    // One thread, no loader: the per-core rate.
    let mut scratch = Scratch::new(csr.num_nodes());
    let (mut st_edges, mut b) = (0usize, 0usize);
    let thread_cpu0 = thread_cpu_s();
    let t1 = Instant::now();
    while t1.elapsed() < Duration::from_secs_f64((a.seconds / 3.0).max(0.5)) {
        let mb = sampler.sample(
            &batches[b % batches.len()],
            batch_key(a.key, b),
            &mut scratch,
        );
        st_edges += mb.num_edges();
        b += 1;
    }
    let single_edges_per_s = st_edges as f64 / t1.elapsed().as_secs_f64();
    let single_cpu_s = thread_cpu_s().zip(thread_cpu0).map(|(b, a)| b - a);

    let bytes_per_edge = bytes_per_edge(&sampler, csr, &batches, a.key, &mut scratch);
    let bandwidth = read_bandwidth_bytes_per_s(a.threads, 1 << 30);
    let bound = bandwidth / bytes_per_edge;

    let out = serde_json::json!({
        "file": a.file.display().to_string(),
        "num_nodes": csr.num_nodes(),
        "num_edges": csr.num_edges(),
        "fanouts": a.fanouts,
        "batch": a.batch,
        "threads": a.threads,
        "depth": depth,
        "wall_s": wall_s,
        "batches": n_batches,
        "batches_per_s": n_batches as f64 / wall_s,
        "edges_per_batch": n_edges as f64 / n_batches as f64,
        "nodes_per_batch": n_nodes as f64 / n_batches as f64,
        "edges_per_s": edges_per_s,
        "cpu_s": cpu_s,
        "edges_per_cpu_s": cpu_s.map(|c| n_edges as f64 / c),
        "single_thread_edges_per_s": single_edges_per_s,
        "single_thread_edges_per_cpu_s": single_cpu_s.map(|c| st_edges as f64 / c),
        "bytes_per_edge": bytes_per_edge,
        "read_bandwidth_gib_per_s": bandwidth / (1u64 << 30) as f64,
        "bound_edges_per_s": bound,
        "ratio_to_bound": edges_per_s / bound,
    });
    println!("{out}");
    Ok(())
}

/// Bytes the sampler must move per sampled edge (see the module doc), averaged over up to 32 batches.
fn bytes_per_edge(
    sampler: &Sampler<'_>,
    csr: Csr<'_>,
    batches: &[Vec<u32>],
    key: u64,
    scratch: &mut Scratch,
) -> f64 {
    let fanouts = sampler.fanouts();
    let l = fanouts.len();
    let (mut bytes, mut edges) = (0f64, 0usize);
    for (b, seeds) in batches.iter().enumerate().take(32) {
        let mb = sampler.sample(seeds, batch_key(key, b), scratch);
        for (idx, block) in mb.blocks.iter().enumerate() {
            let fanout = fanouts[l - 1 - idx];
            for (i, &v) in mb.nodes[..block.n_dst].iter().enumerate() {
                let deg = csr.degree(v as usize);
                let taken = (block.indptr[i + 1] - block.indptr[i]) as usize;
                bytes += 16.0;
                bytes += match fanout {
                    Some(f) if deg > f as usize => 64.0 * f as f64,
                    _ => 4.0 * deg as f64,
                };
                bytes += (64 + 4) as f64 * taken as f64;
            }
            edges += block.num_edges();
        }
    }
    bytes / edges.max(1) as f64
}

/// Best of five `threads`-thread sums over a `len_bytes` array, in bytes per second.
fn read_bandwidth_bytes_per_s(threads: usize, len_bytes: usize) -> f64 {
    let data: Vec<u64> = (0..len_bytes / 8).map(|i| i as u64).collect();
    let chunk = data.len().div_ceil(threads);
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let parts: Vec<_> = data
                .chunks(chunk)
                .map(|c| s.spawn(move || sum(c)))
                .collect();
            parts
                .into_iter()
                .map(|h| h.join().expect("summing threads do not panic"))
                .fold(0u64, u64::wrapping_add)
        });
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(total);
    }
    len_bytes as f64 / best
}

/// Eight independent accumulators so the sum is bound by memory, not by one add chain.
fn sum(c: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut it = c.chunks_exact(8);
    for w in &mut it {
        for k in 0..8 {
            acc[k] = acc[k].wrapping_add(w[k]);
        }
    }
    let tail: u64 = it.remainder().iter().fold(0, |a, &x| a.wrapping_add(x));
    acc.iter().fold(tail, |a, &x| a.wrapping_add(x))
}

/// CPU time of the whole process (all threads), from /proc (Linux; `None` elsewhere). Reported next to wall
/// time because the wall-clock rate suffers when other processes share the cores.
fn process_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15 (1-based), in ticks
    // of (almost always) 1/100 s.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// CPU time of the calling thread, in seconds, from /proc (Linux; `None` elsewhere).
fn thread_cpu_s() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    Some(s.split_whitespace().next()?.parse::<f64>().ok()? / 1e9)
}
