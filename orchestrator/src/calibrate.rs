//! `physalia calibrate`: measures this machine's engine kernels, sampler and loopback QUIC once, and writes a
//! profile that `physalia plan --calibration FILE` uses for the `local` SKU instead of catalog peaks.
//!
//! Each rate is the median of a few repetitions of the engine's own code at GNN shapes: a tall-narrow GEMM,
//! GCN's SpMM on a generated SBM graph, an element-wise pass, the sampler through its loader, QUIC between two
//! endpoints over loopback (bulk one way, and half a small round trip), and the epoch time of a tiny graph
//! (what an epoch costs regardless of size). Each kernel is also reported as a fraction of the machine's
//! limit for it: GEMM of the cores' peak (fused multiply-adds in registers on every thread,
//! `physalia_gnn::dense::peak_gflop_s`), SpMM of the stream bandwidth. The planner takes GEMM's fraction as
//! the efficiency of CPU SKUs elsewhere.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use physalia_gnn::sparse::{Norm, SparseOp};
use physalia_gnn::{LayerKind, LocalExchange, LocalGraph, Matrix, Model, ModelConfig, NodeSets};
use physalia_planner::CalibrationProfile;
use physalia_wire::{
    Dtype, Frame, FrameHeader, JobCa, Link, Phase, QuicEndpoint, QuicOptions, worker_name,
};

#[derive(Args)]
pub struct CalibrateArgs {
    /// Where to write the profile (JSON).
    #[arg(long, short, default_value = "calibration.json")]
    out: PathBuf,
    /// Smaller problems (seconds instead of about a minute); rates are noisier.
    #[arg(long)]
    quick: bool,
}

pub fn run(a: &CalibrateArgs) -> Result<()> {
    let scale = if a.quick { 8 } else { 1 };
    let threads = rayon::current_num_threads();
    eprintln!("calibrating with {threads} threads...");
    let gemm = gemm_gflop_s(65_536 / scale);
    let peak = physalia_gnn::dense::peak_gflop_s();
    eprintln!(
        "  GEMM        {gemm:.1} GFLOP/s ({:.0}% of the cores' peak, {peak:.1} GFLOP/s)",
        100.0 * gemm / peak
    );
    let graph = physalia_graph::synth::sbm(&physalia_graph::SbmParams {
        num_nodes: 200_000 / scale,
        num_classes: 8,
        feat_dim: 16,
        seed: 0,
        ..Default::default()
    })
    .context("generating the calibration graph")?;
    let spmm = spmm_gb_s(&graph.indptr, &graph.indices);
    let stream = stream_gb_s(1 << (24 - if a.quick { 3 } else { 0 }));
    eprintln!(
        "  SpMM        {spmm:.1} GB/s ({:.0}% of stream)",
        100.0 * spmm / stream
    );
    eprintln!("  stream      {stream:.1} GB/s (element-wise passes: the memory's limit)");
    let sampler = sampler_edges_per_s(&graph.indptr, &graph.indices, threads)?;
    eprintln!("  sampler     {:.1} M edges/s", sampler / 1e6);
    let (gbit, latency_us) = loopback((64 << 20) / scale)?;
    eprintln!("  loopback    {gbit:.2} Gbit/s, {latency_us:.0} us one way");
    let overhead = epoch_overhead_s()?;
    eprintln!("  epoch       {:.2} ms fixed", overhead * 1e3);
    let profile = CalibrationProfile {
        machine: machine(),
        measured_on: today(),
        threads: threads as u32,
        gemm_gflop_s: gemm,
        peak_gflop_s: Some(peak),
        spmm_gb_s: spmm,
        stream_gb_s: stream,
        sampler_edges_per_s: sampler,
        loopback_gbit_s: gbit,
        loopback_latency_us: latency_us,
        epoch_overhead_s: overhead,
    };
    let text = serde_json::to_string_pretty(&profile)?;
    // the planner reads it back: refuse to write what it would not accept
    CalibrationProfile::from_yaml_str(&text, &a.out.display().to_string())?;
    let tmp = a.out.with_extension("json.tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &a.out).with_context(|| format!("writing {}", a.out.display()))?;
    println!("wrote {}", a.out.display());
    Ok(())
}

/// Median seconds of `reps` runs of `f`.
fn median_s(reps: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm up: page faults, thread pool
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2].max(1e-9)
}

fn filled(rows: usize, cols: usize) -> Matrix {
    Matrix::from_vec(
        rows,
        cols,
        (0..rows * cols).map(|i| (i % 97) as f32 * 0.01).collect(),
    )
}

fn gemm_gflop_s(n: usize) -> f64 {
    let (k, m) = (128, 256);
    let a = filled(n, k);
    let b = filled(k, m);
    let s = median_s(3, || {
        std::hint::black_box(physalia_gnn::dense::matmul(&a, &b));
    });
    2.0 * (n * k * m) as f64 / s / 1e9
}

fn spmm_gb_s(indptr: &[i64], indices: &[i32]) -> f64 {
    let n = indptr.len() - 1;
    let op = SparseOp::build(n, n, indptr, indices, Norm::Symmetric, None);
    let d = 128;
    let x = filled(n, d);
    let s = median_s(3, || {
        std::hint::black_box(op.spmm(&x));
    });
    // what the planner's roofline charges: index and weight per edge, the gathered row, the written row
    let bytes = op.nnz() as f64 * (8.0 + d as f64 * 4.0) + (n * d * 4) as f64;
    bytes / s / 1e9
}

fn stream_gb_s(len: usize) -> f64 {
    let mut a = filled(len / 64, 64);
    let b = filled(len / 64, 64);
    let s = median_s(5, || a.add_assign(&b));
    (3 * len * 4) as f64 / s / 1e9
}

fn sampler_edges_per_s(indptr: &[i64], indices: &[i32], threads: usize) -> Result<f64> {
    use physalia_graph::sample::{Sampler, with_prefetch};
    let sampler = Sampler::new(indptr, indices, &[Some(25), Some(10)])?;
    let n = (indptr.len() - 1) as u32;
    let batches: Vec<Vec<u32>> = (0..64u32)
        .map(|b| {
            (0..1024u32)
                .map(|i| (b * 7919 + i * 104_729) % n)
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect()
        })
        .collect();
    let mut edges = 0usize;
    let t0 = Instant::now();
    with_prefetch(
        &sampler,
        &batches,
        7,
        threads,
        2 * threads,
        |_, mb| mb.num_edges(),
        |it| {
            edges = it.sum();
        },
    );
    Ok(edges as f64 / t0.elapsed().as_secs_f64().max(1e-9))
}

/// QUIC between two endpoints of this process over loopback: bulk throughput one way and half the round trip
/// of a one-value frame.
fn loopback(bytes: usize) -> Result<(f64, f64)> {
    let ca = JobCa::new("calibration")?;
    let job = ca.job_key();
    let ids = [ca.identity(&worker_name(0))?, ca.identity(&worker_name(1))?];
    let loopback: SocketAddr = "127.0.0.1:0".parse()?;
    let options = QuicOptions {
        recv_timeout: Duration::from_secs(60),
        ..QuicOptions::default()
    };
    let eps = ids
        .iter()
        .enumerate()
        .map(|(r, id)| QuicEndpoint::bind(r, job, id, loopback, options.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let addrs: Vec<SocketAddr> = eps.iter().map(|e| e.local_addr()).collect();
    let chunk = 1 << 20; // floats per frame: 4 MiB
    let frames = (bytes / 4).div_ceil(chunk).max(1);
    let header = move |sender: u16, phase| FrameHeader {
        sender,
        job,
        epoch: 0,
        layer: 0,
        phase,
        dtype: Dtype::F32,
        rows: 0,
        cols: 0,
    };
    let mut eps = eps.into_iter();
    let (e0, e1) = (eps.next().expect("two"), eps.next().expect("two"));
    let a1 = addrs.clone();
    let peer = std::thread::spawn(move || -> Result<()> {
        let mut link = e1.join(&a1)?;
        for _ in 0..frames {
            link.recv(0)?;
        }
        link.send(0, Frame::tensor(header(1, Phase::Forward), &[0.0], 1, 1)?)?;
        for _ in 0..20 {
            let f = link.recv(0)?;
            link.send(
                0,
                Frame {
                    header: FrameHeader {
                        sender: 1,
                        ..f.header
                    },
                    payload: f.payload,
                },
            )?;
        }
        Ok(())
    });
    let mut link = e0.join(&addrs)?;
    let data = vec![1.0f32; chunk];
    let t0 = Instant::now();
    for _ in 0..frames {
        link.send(
            1,
            Frame::tensor(header(0, Phase::Forward), &data, chunk, 1)?,
        )?;
    }
    link.recv(1)?; // the peer got everything
    let bulk_s = t0.elapsed().as_secs_f64();
    let mut rtts = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        link.send(1, Frame::tensor(header(0, Phase::Backward), &[1.0], 1, 1)?)?;
        link.recv(1)?;
        rtts.push(t.elapsed().as_secs_f64());
    }
    peer.join()
        .map_err(|_| anyhow::anyhow!("the loopback peer panicked"))??;
    rtts.sort_by(f64::total_cmp);
    let gbit = (frames * chunk * 4 * 8) as f64 / bulk_s / 1e9;
    Ok((gbit, rtts[rtts.len() / 2] / 2.0 * 1e6))
}

/// The epoch time of a graph too small to cost anything but the fixed work of an epoch.
fn epoch_overhead_s() -> Result<f64> {
    let g = physalia_graph::synth::sbm(&physalia_graph::SbmParams {
        num_nodes: 64,
        num_classes: 2,
        feat_dim: 4,
        seed: 0,
        ..Default::default()
    })?;
    let cfg = ModelConfig::new(LayerKind::Gcn, 4, 8, 2);
    let graph = LocalGraph::whole(LayerKind::Gcn, &g.indptr, &g.indices);
    let x = Matrix::from_vec(64, 4, g.features.view().to_f32().into_owned());
    let sets = NodeSets {
        labels: g.labels.clone(),
        train: (0..64).collect(),
        val: vec![],
        test: vec![],
    };
    let tc = physalia_gnn::TrainConfig {
        epochs: 30,
        lr: 0.01,
        weight_decay: 0.0,
        eval_every: 1,
        patience: None,
    };
    let mut model = Model::new(&cfg, 0)?;
    let mut times = Vec::new();
    physalia_gnn::train(
        &mut model,
        &graph,
        &x,
        &sets,
        &tc,
        &mut LocalExchange,
        &mut |m| times.push(m.train_s + m.eval_s),
    )?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let cores = std::thread::available_parallelism()
        .map(|c| c.get())
        .unwrap_or(1);
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<f64>().ok())
        })
        .map(|kib| kib / (1 << 20) as f64);
    match mem_gib {
        Some(m) => format!("{cpu}, {cores} cores, {m:.0} GiB"),
        None => format!("{cpu}, {cores} cores"),
    }
}

/// Today's date (UTC) as YYYY-MM-DD.
fn today() -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() / 86_400)
        .unwrap_or(0) as i64;
    // civil-from-days (Howard Hinnant)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}
