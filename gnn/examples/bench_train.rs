//! Our side of `bench/compare.py` without the CLI: trains the benchmark jobs' model (`bench/jobs/sbm-*.yaml`)
//! on one dataset file in one process, the way a single CPU worker does (the binaries' allocator and heap
//! settings, features moved into the engine and freed once the model stops reading them, no evaluation inside
//! the timed epochs), and prints one JSON line like `physalia submit --output json`'s (`median_epoch_s`,
//! `epoch_times_s`, `final_loss`, `peak_rss_bytes`), and each epoch's process CPU seconds (`median_epoch_cpu_s`,
//! as `bench/pyg_train.py` reports them: on a shared machine less skewed by other processes than wall time).
//!
//! It exists because the `physalia` binary builds the cloud backends (the AWS and Azure SDKs), half an hour
//! on a small machine, while this builds the engine alone. It has no coordinator process, so its peak RSS is
//! the worker's alone (`physalia submit`'s adds the coordinator's resident set during training).
//!
//! ```text
//! bench_train import GRAPH_DIR OUT.safetensors      # what `physalia data import --format generic` writes
//! bench_train train DATA.safetensors MODEL EPOCHS DROPOUT INPUT_DROPOUT THREADS [HIDDEN [HEADS]]
//! ```
//! MODEL is `gcn`, `sage` or `gat`; HIDDEN (default 256) is the hidden layer's width, for GAT the total of
//! its HEADS heads (default 4, concatenated; one output head; no attention dropout).
//!
//! `PHYSALIA_ROW_ORDER=locality` holds the engine's rows in [`physalia_gnn::RowOrder::locality`]'s order
//! (`labels`: the planted classes, an upper bound for experiments; `identity`: the cost of holding an
//! order; default: the dataset's order); the JSON line's `graph_build_s` includes the ordering.
//! `PHYSALIA_PROFILE=1` prints where epochs 2..E went, per operation, on stderr.

use std::path::Path;

use physalia_gnn::{
    Adam, LayerKind, LocalExchange, LocalGraph, Matrix, Model, ModelConfig, NodeSets, Progress,
    TrainConfig,
};
use physalia_graph::{Dataset, ImportOptions, Split};

/// The allocator the binaries run the engine with (`physalia`, `physalia-worker`).
#[global_allocator]
static ALLOC: physalia_gnn::heap::LineAligned = physalia_gnn::heap::LineAligned;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("import") if args.len() == 3 => {
            let d = physalia_graph::import::generic(Path::new(&args[1]), &ImportOptions::default())
                .expect("the generic layout imports");
            d.write(Path::new(&args[2]))
                .expect("the dataset is written");
        }
        Some("train") if (7..=9).contains(&args.len()) => train(&args[1..]),
        _ => {
            eprintln!(
                "usage: bench_train import GRAPH_DIR OUT.safetensors\n       bench_train train \
                 DATA.safetensors gcn|sage|gat EPOCHS DROPOUT INPUT_DROPOUT THREADS [HIDDEN [HEADS]]"
            );
            std::process::exit(2);
        }
    }
}

fn train(args: &[String]) {
    let kind = match args[1].as_str() {
        "gcn" => LayerKind::Gcn,
        "sage" => LayerKind::Sage,
        "gat" => LayerKind::Gat,
        other => panic!("unknown model {other} (gcn, sage, gat)"),
    };
    let epochs: usize = args[2].parse().expect("EPOCHS is a number");
    let dropout: f32 = args[3].parse().expect("DROPOUT is a number");
    let input_dropout: f32 = args[4].parse().expect("INPUT_DROPOUT is a number");
    let threads: usize = args[5].parse().expect("THREADS is a number");
    let hidden: usize = args
        .get(6)
        .map_or(256, |h| h.parse().expect("HIDDEN is a number"));
    let heads: usize = args
        .get(7)
        .map_or(4, |h| h.parse().expect("HEADS is a number"));
    // as the binaries do: large buffers from the heap, never trimmed, so epochs reuse pages
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_MAX: i32 = -4;
        // SAFETY: only tunes glibc's allocator, before any large allocation.
        unsafe {
            mallopt(M_MMAP_MAX, 0);
            mallopt(M_TRIM_THRESHOLD, i32::MAX);
        }
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .expect("the global pool is built once");

    let graph_s;
    let (g, x, sets, feat_dim, classes) = {
        let d = Dataset::open_unverified(Path::new(&args[0])).expect("the dataset opens");
        let csr = d.csr();
        let n = d.labels().len();
        let feat_dim = d.features().len() / n.max(1);
        let x = Matrix::from_vec(n, feat_dim, d.features_f32().into_owned());
        // PHYSALIA_ROW_ORDER=locality holds the engine's rows in a locality order (`labels`, `identity`:
        // experiments), before/after runs of one binary; the graph's build, ordering included, is timed
        let t = std::time::Instant::now();
        let how = std::env::var("PHYSALIA_ROW_ORDER").unwrap_or_default();
        let n = csr.indptr.len() - 1;
        let ordered = |o: physalia_gnn::RowOrder| {
            LocalGraph::with_order(kind, n, n, csr.indptr, csr.indices, None, None, o)
        };
        let labels = d.labels();
        let g = match how.as_str() {
            "" | "none" => LocalGraph::whole(kind, csr.indptr, csr.indices),
            "locality" => LocalGraph::whole_local(kind, csr.indptr, csr.indices),
            // the cost of holding an order that moves nothing
            "identity" => ordered(physalia_gnn::RowOrder::from_engine_order(
                (0..n as u32).collect(),
            )),
            // an experiment's upper bound: the planted classes as the order (the labels, which no real
            // ordering could read)
            "labels" => {
                let mut rows: Vec<u32> = (0..n as u32).collect();
                rows.sort_by_key(|&r| labels[r as usize]);
                ordered(physalia_gnn::RowOrder::from_engine_order(rows))
            }
            other => panic!("PHYSALIA_ROW_ORDER={other}: none, locality, identity or labels"),
        };
        graph_s = t.elapsed().as_secs_f64();
        if let Some(o) = g.row_order() {
            for b in [10, 13, 16, 18] {
                eprintln!(
                    "[bench_train] edges within a block of {} engine rows: {:.3}",
                    1 << b,
                    o.block_locality(csr.indptr, csr.indices, 1 << b)
                );
            }
        }
        let rows = |v: &[i64]| v.iter().map(|&i| i as u32).collect::<Vec<_>>();
        let sets = NodeSets {
            labels: d.labels().to_vec(),
            train: rows(d.split(Split::Train)),
            val: rows(d.split(Split::Val)),
            test: rows(d.split(Split::Test)),
        };
        let classes = d.labels().iter().copied().max().unwrap_or(0) as usize + 1;
        (g, x, sets, feat_dim, classes)
    };
    // the mapping is closed: the engine holds its own copies, as a worker does after building its inputs
    physalia_gnn::heap::release_freed_memory();
    eprintln!(
        "[bench_train] loaded: {}; graph built in {graph_s:.2}s ({})",
        memory_line(),
        if g.row_order().is_some() {
            "rows in a locality order"
        } else {
            "rows in the dataset's order"
        }
    );

    let mut cfg = ModelConfig::new(kind, feat_dim, hidden, classes);
    cfg.dropout = dropout;
    cfg.input_dropout = input_dropout;
    if kind == LayerKind::Gat {
        assert!(
            hidden.is_multiple_of(heads),
            "HIDDEN is HEADS heads of equal width"
        );
        cfg.heads = heads;
        cfg.hidden = hidden / heads;
        cfg.attn_dropout = 0.0;
    }
    let tc = TrainConfig {
        epochs,
        lr: 0.01,
        weight_decay: 5e-4,
        eval_every: epochs + 1,
        patience: None,
    };
    let mut model = Model::new(&cfg, 0).expect("valid model");
    let mut opt = Adam::new(&model.params, tc.lr, tc.weight_decay);
    let mut times = Vec::new();
    let mut cpu_times = Vec::new();
    let mut losses = Vec::new();
    let mut cpu_mark = process_cpu_s();
    let profile = std::env::var_os("PHYSALIA_PROFILE").is_some();
    physalia_gnn::train_resumable_owned(
        &mut model,
        &mut opt,
        Progress::default(),
        &g,
        x,
        &sets,
        &tc,
        &mut LocalExchange,
        &mut |e| {
            times.push(e.metrics.train_s);
            // PHYSALIA_PROFILE=1: where epochs 2..E went, per operation (stderr)
            if profile && times.len() == 1 {
                physalia_gnn::profile::enable();
            }
            if profile && times.len() == epochs {
                let spans = physalia_gnn::profile::take();
                let steady = (epochs - 1).max(1) as f64;
                for (name, s, calls) in spans {
                    eprintln!(
                        "[profile] {name:<22} {:8.4} s/epoch {:6.1} calls/epoch",
                        s / steady,
                        calls as f64 / steady
                    );
                }
            }
            let now = process_cpu_s();
            cpu_times.push(now - cpu_mark);
            cpu_mark = now;
            losses.push(e.metrics.loss);
            eprintln!(
                "[bench_train] epoch {}: loss {:.4} {:.3}s; {}; so far (minor page faults, user ticks, system ticks) {:?}",
                times.len(),
                e.metrics.loss,
                e.metrics.train_s,
                memory_line(),
                minor_faults()
            );
            true
        },
    )
    .expect("training runs");
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied();
    let mut cpu_sorted = cpu_times.clone();
    cpu_sorted.sort_by(f64::total_cmp);
    println!(
        "{}",
        serde_json::json!({
            "impl": "ours-engine",
            "model": args[1],
            "median_epoch_s": median,
            "epoch_times_s": times,
            "median_epoch_cpu_s": cpu_sorted.get(cpu_sorted.len() / 2),
            "epoch_cpu_s": cpu_times,
            "final_loss": losses.last(),
            "peak_rss_bytes": peak_rss_bytes(),
            "simd": physalia_gnn::sparse::Path::detect().name(),
            "graph_build_s": graph_s,
            "row_order": g.row_order().is_some(),
        })
    );
}

/// CPU seconds this process has used, all threads (`CLOCK_PROCESS_CPUTIME_ID`).
fn process_cpu_s() -> f64 {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    unsafe extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_PROCESS_CPUTIME_ID: i32 = 2;
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: `t` is a valid timespec for the call to fill.
    let rc = unsafe { clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "the process CPU clock exists on Linux");
    t.sec as f64 + t.nsec as f64 * 1e-9
}

/// Minor page faults (pages the kernel mapped, and zeroed for fresh memory, on first touch), user and system
/// CPU time in clock ticks of this process so far (`/proc/self/stat`).
fn minor_faults() -> (u64, u64, u64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // the command name, in parentheses, may hold spaces: count fields after its closing parenthesis
    let f: Vec<u64> = stat
        .rsplit_once(')')
        .map(|(_, rest)| {
            rest.split_whitespace()
                .map(|x| x.parse().unwrap_or(0))
                .collect()
        })
        .unwrap_or_default();
    let at = |i: usize| f.get(i).copied().unwrap_or(0);
    (at(7), at(11), at(12))
}

/// A `/proc/self/status` field in bytes (`VmHWM`: the peak resident set; `VmRSS`: the current one).
fn status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn peak_rss_bytes() -> Option<u64> {
    status_bytes("VmHWM:")
}

/// The resident set now and at its peak, for the log.
fn memory_line() -> String {
    let mib = |b: Option<u64>| b.map_or("?".into(), |b| format!("{} MiB", b >> 20));
    format!(
        "RSS {}, peak {}",
        mib(status_bytes("VmRSS:")),
        mib(peak_rss_bytes())
    )
}
