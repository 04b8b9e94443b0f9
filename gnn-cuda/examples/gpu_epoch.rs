//! Times the CUDA engine on a large graph: SpMM's achieved bandwidth against a measured device copy, the
//! dense product, and full training epochs (forward, loss, backward, Adam) of GCN and GraphSAGE.
//!
//! ```sh
//! # the benchmark graph of bench/gen_sbm.py (what gnn-cuda/bench/gpu_bench.py runs PyG on)
//! gpu_epoch --data bench/out/sbm-2000000-d20 --models gcn,sage --hidden 256 --epochs 10
//! # or an SBM drawn in Rust (same size and shape, not the same edges)
//! gpu_epoch --nodes 2000000 --degree 20 --features 128 --classes 16
//! ```
//!
//! Prints one JSON object per model on stdout and a readable line per measurement on stderr. Exit code 2
//! when no usable GPU is found (the reason is printed).

use std::time::Instant;

use physalia_gnn::device::{AdamConfig, DeviceGraph, DeviceModel, Ops, View};
use physalia_gnn::model::Pass;
use physalia_gnn::sparse::{Norm, SparseOp};
use physalia_gnn::{Activation, LayerKind, LocalExchange, Matrix, Model, ModelConfig};
use physalia_gnn_cuda::CudaEngine;

struct Args {
    data: Option<String>,
    nodes: usize,
    degree: f64,
    features: usize,
    classes: usize,
    hidden: usize,
    /// GAT's width per head where it differs from `hidden` (bench's GAT: 8 heads of 32).
    gat_hidden: Option<usize>,
    models: Vec<LayerKind>,
    epochs: usize,
    gpu: usize,
    dropout: f32,
    /// Epochs run after the timed ones with every operation timed apart (`physalia_gnn::profile`).
    profile: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        data: None,
        nodes: 2_000_000,
        degree: 20.0,
        features: 128,
        classes: 16,
        hidden: 256,
        gat_hidden: None,
        models: vec![LayerKind::Gcn, LayerKind::Sage],
        epochs: 10,
        gpu: 0,
        dropout: 0.5,
        profile: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value"));
        let num = |v: String| v.parse::<f64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--data" => a.data = Some(val()?),
            "--nodes" => a.nodes = num(val()?)? as usize,
            "--degree" => a.degree = num(val()?)?,
            "--features" => a.features = num(val()?)? as usize,
            "--classes" => a.classes = num(val()?)? as usize,
            "--hidden" => a.hidden = num(val()?)? as usize,
            "--gat-hidden" => a.gat_hidden = Some(num(val()?)? as usize),
            "--epochs" => a.epochs = num(val()?)? as usize,
            "--gpu" => a.gpu = num(val()?)? as usize,
            "--dropout" => a.dropout = num(val()?)? as f32,
            "--profile" => a.profile = num(val()?)? as usize,
            "--models" => {
                a.models = val()?
                    .split(',')
                    .map(|m| match m {
                        "gcn" => Ok(LayerKind::Gcn),
                        "sage" => Ok(LayerKind::Sage),
                        "gat" => Ok(LayerKind::Gat),
                        o => Err(format!("unknown model {o}")),
                    })
                    .collect::<Result<_, _>>()?
            }
            "-h" | "--help" => {
                return Err(
                    "usage: gpu_epoch [--data DIR] [--nodes N] [--degree D] [--features F] \
                            [--classes C] [--hidden H] [--gat-hidden H] [--models gcn,sage] [--epochs E] [--gpu I] \
                            [--dropout P] [--profile EPOCHS]"
                        .into(),
                );
            }
            o => return Err(format!("unknown argument {o}")),
        }
    }
    Ok(a)
}

struct Graph {
    indptr: Vec<i64>,
    indices: Vec<i32>,
    x: Matrix,
    labels: Vec<i64>,
    train: Vec<u32>,
    test: Vec<u32>,
    source: String,
}

fn load(a: &Args) -> Result<Graph, String> {
    let t0 = Instant::now();
    let ds = match &a.data {
        Some(dir) => {
            physalia_graph::import::generic(std::path::Path::new(dir), &Default::default())
                .map_err(|e| e.to_string())?
        }
        None => physalia_graph::synth::sbm(&physalia_graph::SbmParams {
            num_nodes: a.nodes,
            num_classes: a.classes,
            avg_degree: a.degree,
            feat_dim: a.features,
            seed: 0,
            ..Default::default()
        })
        .map_err(|e| e.to_string())?,
    };
    let n = ds.meta.num_nodes;
    let idx = |v: &[i64]| v.iter().map(|&i| i as u32).collect::<Vec<_>>();
    let g = Graph {
        x: Matrix::from_vec(
            n,
            ds.meta.feat_dim,
            ds.features.view().to_f32().into_owned(),
        ),
        train: idx(&ds.train_idx),
        test: idx(&ds.test_idx),
        indptr: ds.indptr,
        indices: ds.indices,
        labels: ds.labels,
        source: a.data.clone().unwrap_or_else(|| "synth::sbm".into()),
    };
    eprintln!(
        "graph {}: {n} nodes, {} directed edges, {} features, loaded in {:.1}s",
        g.source,
        g.indices.len(),
        g.x.cols(),
        t0.elapsed().as_secs_f64()
    );
    Ok(g)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

fn run(a: &Args) -> Result<(), String> {
    let mut e = match CudaEngine::new(a.gpu) {
        Ok(e) => e,
        Err(err) => {
            eprintln!("no usable GPU: {err}");
            std::process::exit(2);
        }
    };
    let dev = e.device().clone();
    eprintln!(
        "gpu {}: {} (compute {}.{}, {:.1} GiB), driver {}",
        dev.index,
        dev.name,
        dev.compute_capability.0,
        dev.compute_capability.1,
        dev.total_bytes as f64 / (1u64 << 30) as f64,
        e.driver_version()
    );
    let err = |x: physalia_gnn_cuda::GpuError| x.to_string();
    let copy_gbs = e.copy_bandwidth_gbs(4 << 30, 20).map_err(err)?;
    eprintln!("device copy: {copy_gbs:.0} GB/s (read + write)");
    let g = load(a)?;
    let n = g.x.rows();
    let labels = e.upload_labels(&g.labels).map_err(err)?;
    let train = e.upload_idx(&g.train).map_err(err)?;
    let test = e.upload_idx(&g.test).map_err(err)?;
    let classes = g.labels.iter().copied().max().unwrap_or(0) as usize + 1;
    for &kind in &a.models {
        let hidden = match (kind, a.gat_hidden) {
            (LayerKind::Gat, Some(h)) => h,
            _ => a.hidden,
        };
        let norm = match kind {
            LayerKind::Gcn => Norm::Symmetric,
            LayerKind::Sage => Norm::Mean,
            LayerKind::Gat => Norm::SelfLoopsOnly,
        };
        // SpMM alone, forward and over the transpose, at the input and hidden widths
        let op = SparseOp::build(n, n, &g.indptr, &g.indices, norm, None);
        let csr = e.upload_csr(&op).map_err(err)?;
        drop(op);
        let mut spmm = Vec::new();
        for d in [g.x.cols(), hidden] {
            let xin = e.alloc(n, d).map_err(err)?;
            let mut y = e.alloc(n, d).map_err(err)?;
            for transpose in [false, true] {
                let ms = e
                    .time_ms(10, |e| e.spmm_only(&csr, &xin, &mut y, transpose))
                    .map_err(err)?;
                let (unique, gathered) = csr.spmm_bytes(d, transpose);
                let gbs = gathered as f64 / (ms / 1e3) / 1e9;
                let frac = gbs / copy_gbs;
                eprintln!(
                    "{kind:?} spmm{} d={d}: {ms:.3} ms, {gbs:.0} GB/s of gathered rows ({:.0}% of copy; \
                     {:.0} GB/s counting each row once)",
                    if transpose { "_t" } else { "" },
                    100.0 * frac,
                    unique as f64 / (ms / 1e3) / 1e9
                );
                spmm.push(format!(
                    "{{\"d\":{d},\"transpose\":{transpose},\"ms\":{ms:.4},\"gathered_gbs\":{gbs:.1},\
                     \"fraction_of_copy\":{frac:.3}}}"
                ));
            }
            e.recycle(xin);
            e.recycle(y);
        }
        // the first layer's dense product
        let mut x = e.upload(&g.x).map_err(err)?;
        let w = e.alloc(g.x.cols(), hidden).map_err(err)?;
        let mut out = e.alloc(n, hidden).map_err(err)?;
        let f = g.x.cols();
        let gemm_ms = e
            .time_ms(10, |e| {
                e.gemm(
                    View::full(&x, n, f),
                    View::full(&w, f, hidden),
                    0.0,
                    &mut out,
                )
            })
            .map_err(err)?;
        let tflops = 2.0 * n as f64 * f as f64 * hidden as f64 / (gemm_ms / 1e3) / 1e12;
        eprintln!(
            "{kind:?} gemm {n}x{f} x {f}x{}: {gemm_ms:.3} ms, {tflops:.1} TFLOP/s",
            hidden
        );
        e.recycle(w);
        e.recycle(out);
        drop(csr);
        // the measurements' buffers go back to the driver, so the peak below is the training's alone
        e.trim_pool();

        // training epochs as physalia_gnn::train runs them (dropout between layers only, like PyG's model)
        let mut cfg = ModelConfig::new(kind, f, hidden, classes);
        cfg.dropout = a.dropout;
        cfg.input_dropout = 0.0;
        cfg.activation = Activation::Relu;
        let model = Model::new(&cfg, 0).map_err(|x| x.to_string())?;
        let dg = DeviceGraph::whole(&mut e, kind, &g.indptr, &g.indices).map_err(err)?;
        let mut dm = DeviceModel::from_model(&mut e, &model).map_err(err)?;
        // as the worker's loop does: a constant `A X` first, and the features freed when nothing reads them
        dm.cache_input_aggregation_ex(
            &mut e,
            &dg,
            &x,
            Pass::Train { epoch: 1 },
            &mut LocalExchange,
        )
        .map_err(err)?;
        if !dm.needs_input() {
            x = e.alloc(0, 0).map_err(err)?;
        }
        let adam = AdamConfig::new(0.01, 5e-4);
        let mut times = Vec::new();
        let mut losses = Vec::new();
        let mut min_free = u64::MAX;
        let mut phases = Vec::new();
        for epoch in 1..=(a.epochs + 2) as u64 {
            e.synchronize().map_err(err)?;
            let t = Instant::now();
            let loss = if epoch == 2 {
                // where the memory peaks: the same steps as train_epoch, each phase's peak apart (the
                // second epoch: the pool holds what the first left, as in every later one)
                let (loss, p) = phased_epoch(
                    &mut e,
                    &mut dm,
                    &dg,
                    &x,
                    &labels,
                    &train,
                    g.train.len(),
                    epoch,
                    adam,
                )?;
                phases = p;
                loss
            } else {
                dm.train_epoch(&mut e, &dg, &x, &labels, &train, g.train.len(), epoch, adam)
                    .map_err(err)?
            };
            e.synchronize().map_err(err)?;
            let s = t.elapsed().as_secs_f64();
            min_free = min_free.min(e.memory().map_err(err)?.0);
            if epoch > 2 {
                times.push(s);
            }
            losses.push(loss);
            eprintln!("{kind:?} epoch {epoch}: loss {loss:.4}, {:.1} ms", s * 1e3);
        }
        // then epochs with each operation's device time apart: the stream waited for around every one, so
        // their sum is near the epoch less the gaps between launches (which these epochs no longer hide)
        let mut ops = Vec::new();
        if a.profile > 0 {
            e.synchronize().map_err(err)?;
            let t = Instant::now();
            physalia_gnn::profile::enable();
            for p in 0..a.profile as u64 {
                let epoch = a.epochs as u64 + 3 + p;
                dm.train_epoch(&mut e, &dg, &x, &labels, &train, g.train.len(), epoch, adam)
                    .map_err(err)?;
            }
            e.synchronize().map_err(err)?;
            let per = a.profile as f64;
            let total = t.elapsed().as_secs_f64() / per;
            for (name, s, calls) in physalia_gnn::profile::take() {
                eprintln!(
                    "{kind:?} profile {name}: {:.3} ms an epoch in {} calls",
                    s / per * 1e3,
                    calls as f64 / per
                );
                ops.push(format!(
                    "{{\"op\":\"{name}\",\"ms\":{:.4},\"calls\":{}}}",
                    s / per * 1e3,
                    calls as f64 / per
                ));
            }
            eprintln!("{kind:?} profiled epoch: {:.1} ms", total * 1e3);
            ops.push(format!(
                "{{\"op\":\"(profiled epoch)\",\"ms\":{:.4},\"calls\":1}}",
                total * 1e3
            ));
        }
        let correct = dm
            .evaluate(&mut e, &dg, &x, &labels, &[&test])
            .map_err(err)?[0];
        let test_acc = correct as f64 / g.test.len().max(1) as f64;
        let (_, total) = e.memory().map_err(err)?;
        let epoch_s = median(times.clone());
        let peak = e.pool_stats().peak_used_bytes.max(total - min_free);
        eprintln!(
            "{kind:?}: median epoch {:.1} ms over {} epochs, test accuracy {test_acc:.4}, device memory in use \
             {:.2} GiB at the peak, pool {:?}",
            epoch_s * 1e3,
            times.len(),
            peak as f64 / (1u64 << 30) as f64,
            e.pool_stats()
        );
        println!(
            "{{\"impl\":\"physalia-cuda\",\"model\":\"{}\",\"gpu\":\"{}\",\"nodes\":{n},\"edges\":{},\
             \"hidden\":{},\"epochs\":{},\"median_epoch_s\":{epoch_s:.6},\"epoch_s\":{:?},\"final_loss\":{:.6},\
             \"test_acc\":{test_acc:.4},\"device_used_bytes\":{},\"copy_gbs\":{copy_gbs:.1},\
             \"gemm_ms\":{gemm_ms:.4},\"spmm\":[{}],\"phases\":[{}],\"ops\":[{}],\"graph\":\"{}\"}}",
            format!("{kind:?}").to_lowercase(),
            dev.name,
            g.indices.len(),
            hidden,
            times.len(),
            times,
            losses.last().copied().unwrap_or(f64::NAN),
            peak,
            spmm.join(","),
            phases.join(","),
            ops.join(","),
            g.source
        );
        drop(dm);
        drop(dg);
        drop(x);
        e.trim_pool();
        e.reset_peak();
    }
    Ok(())
}

/// One `train_epoch`, its phases apart: for each, the memory in use at its end and the peak inside it (the
/// context and every buffer counted), what the pool held cached at that peak, and the allocation that set
/// it, as JSON objects.
#[allow(clippy::too_many_arguments)]
fn phased_epoch(
    e: &mut CudaEngine,
    dm: &mut DeviceModel<CudaEngine>,
    dg: &DeviceGraph<CudaEngine>,
    x: &<CudaEngine as Ops>::Mat,
    labels: &<CudaEngine as Ops>::Labels,
    train: &<CudaEngine as Ops>::Idx,
    n_train: usize,
    epoch: u64,
    adam: AdamConfig,
) -> Result<(f64, Vec<String>), String> {
    let err = |x: physalia_gnn_cuda::GpuError| x.to_string();
    let mut phases = Vec::new();
    let mut mark = |e: &mut CudaEngine, name: &str| -> Result<(), String> {
        e.synchronize().map_err(err)?;
        let (free, total) = e.memory().map_err(err)?;
        let s = e.pool_stats();
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        eprintln!(
            "  {name}: in use {:.2} GiB at its end, peak {:.2} GiB (pool cached {:.2} GiB then; set by an \
             allocation of {:.2} GiB)",
            gib(total - free),
            gib(s.peak_used_bytes),
            gib(s.cached_at_peak),
            gib(s.peak_alloc_len * 4)
        );
        phases.push(format!(
            "{{\"phase\":\"{name}\",\"end_used_bytes\":{},\"peak_used_bytes\":{},\"cached_at_peak\":{},\
             \"peak_alloc_bytes\":{}}}",
            total - free,
            s.peak_used_bytes,
            s.cached_at_peak,
            s.peak_alloc_len * 4
        ));
        e.reset_peak();
        Ok(())
    };
    e.synchronize().map_err(err)?;
    e.reset_peak();
    let fwd = dm
        .forward_ex(e, dg, x, Pass::Train { epoch }, &mut LocalExchange)
        .map_err(err)?;
    mark(e, "forward")?;
    let (r, c) = e.dims(&fwd.logits);
    let mut d_logits = e.alloc(r, c).map_err(err)?;
    let loss = e
        .cross_entropy(&fwd.logits, labels, train, n_train as f64, &mut d_logits)
        .map_err(err)?;
    mark(e, "loss")?;
    let grads = dm
        .backward_ex(e, dg, fwd, d_logits, &mut LocalExchange)
        .map_err(err)?;
    mark(e, "backward")?;
    dm.adam_step(e, grads, adam).map_err(err)?;
    mark(e, "adam")?;
    Ok((loss / n_train as f64, phases))
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = run(&a) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
