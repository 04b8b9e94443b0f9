//! `physalia data import | synth | inspect | partition`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use physalia_graph::chunked::{ChunkedDataset, DEFAULT_CHUNK_ROWS, Manifest};
use physalia_graph::partition::{
    ArtifactStatus, PartitionMeta, PartitionMethod, PartitionSet, PartitionSummary,
};
use physalia_graph::stream::{StreamAlgorithm, StreamParams};
use physalia_graph::{
    Dataset, FeatureDtype, ImportOptions, OwnedDataset, RmatParams, SbmParams, chunked_synth,
    import, partition, synth,
};

use physalia_coordinator::driver::dataset;
use physalia_coordinator::spec::DatasetFormat;

use crate::output::OutputFormat;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ImportFormat {
    /// `generic` when the folder has `edges.csv` or `edges.npy`, `ogb` when it has `raw/edge.csv.gz`.
    Auto,
    Generic,
    Ogb,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    F32,
    F16,
    Bf16,
}

impl From<DtypeArg> for FeatureDtype {
    fn from(d: DtypeArg) -> FeatureDtype {
        match d {
            DtypeArg::F32 => FeatureDtype::F32,
            DtypeArg::F16 => FeatureDtype::F16,
            DtypeArg::Bf16 => FeatureDtype::BF16,
        }
    }
}

/// How a dataset is stored.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LayoutArg {
    /// One `.safetensors` file, loaded (memory-mapped) whole.
    File,
    /// A directory: `manifest.json` plus the tensors in chunk files of `--chunk-rows` rows each; written
    /// and partitioned without holding the graph.
    Chunked,
}

/// Where and how a command writes its dataset.
#[derive(Args)]
pub struct LayoutArgs {
    #[arg(long, value_enum, default_value_t = LayoutArg::File)]
    pub layout: LayoutArg,
    /// Rows per chunk with `--layout chunked` (a multiple of 16384 suits the generators).
    #[arg(long, default_value_t = DEFAULT_CHUNK_ROWS)]
    pub chunk_rows: usize,
}

#[derive(Args)]
pub struct ImportArgs {
    /// The raw dataset folder.
    pub dir: PathBuf,
    /// The dataset file to write (`.safetensors`), or the directory with `--layout chunked`.
    #[arg(long, short)]
    pub out: PathBuf,
    #[command(flatten)]
    pub layout: LayoutArgs,
    #[arg(long, value_enum, default_value_t = ImportFormat::Auto)]
    pub format: ImportFormat,
    /// Dataset name (default: the folder's name).
    #[arg(long)]
    pub name: Option<String>,
    /// Keep edges one-way instead of storing both directions.
    #[arg(long)]
    pub directed: bool,
    #[arg(long, value_enum, default_value_t = DtypeArg::F32)]
    pub feature_dtype: DtypeArg,
    /// Divide each feature row by its sum (Kipf & Welling's preprocessing) before storing.
    #[arg(long)]
    pub row_normalize: bool,
    /// OGB: the subfolder of `split/` to use when there are several.
    #[arg(long)]
    pub split: Option<String>,
}

#[derive(Subcommand)]
pub enum SynthCommand {
    /// Stochastic block model with class-correlated features: a GNN learns it, features alone are weak.
    Sbm(SbmArgs),
    /// R-MAT power-law graph for scale tests.
    Rmat(RmatArgs),
}

#[derive(Args)]
pub struct SbmArgs {
    #[arg(long, default_value_t = 10_000)]
    pub nodes: usize,
    #[arg(long, default_value_t = 8)]
    pub classes: usize,
    #[arg(long, default_value_t = 10.0)]
    pub avg_degree: f64,
    /// Fraction of a node's edges inside its own class.
    #[arg(long, default_value_t = 0.8)]
    pub homophily: f64,
    #[arg(long, default_value_t = 128)]
    pub feat_dim: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The dataset file, or the directory with `--layout chunked`.
    #[arg(long, short)]
    pub out: PathBuf,
    #[command(flatten)]
    pub layout: LayoutArgs,
}

#[derive(Args)]
pub struct RmatArgs {
    /// log2 of the number of nodes.
    #[arg(long, default_value_t = 16)]
    pub scale: u32,
    #[arg(long, default_value_t = 8)]
    pub edge_factor: usize,
    #[arg(long, default_value_t = 8)]
    pub classes: usize,
    #[arg(long, default_value_t = 128)]
    pub feat_dim: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The dataset file, or the directory with `--layout chunked`.
    #[arg(long, short)]
    pub out: PathBuf,
    #[command(flatten)]
    pub layout: LayoutArgs,
}

#[derive(Args)]
pub struct InspectArgs {
    /// A dataset file, or a chunked dataset directory.
    pub file: PathBuf,
    /// Chunked dataset: show the manifest without reading (and checksumming) every chunk.
    #[arg(long)]
    pub manifest_only: bool,
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

#[derive(Args)]
pub struct PartitionArgs {
    /// The dataset file or chunked dataset directory; partitions go to `<name>.parts/k<K>-seed<S>/` beside a file, `<dir>/parts/k<K>-seed<S>/` inside a directory.
    pub file: PathBuf,
    /// Numbers of parts, comma-separated, e.g. `2,4,8`.
    #[arg(long, value_delimiter = ',', required = true, num_args = 1..)]
    pub k: Vec<usize>,
    /// METIS seed (streaming: the tie-breaking seed).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// `metis` (the default for a file) or `stream` (Fennel on bounded memory, the default and only choice
    /// for a chunked dataset, which is never loaded). A stored set made by the other method is recomputed.
    #[arg(long, value_enum)]
    pub method: Option<MethodArg>,
    /// Streaming passes. By default Fennel restreams until a pass moves at most 0.1% of the nodes (at
    /// most 20 passes), then label propagation refines the parts; `--passes N` runs exactly N passes
    /// (1 = plain one-pass Fennel) and refines only with `--refine`.
    #[arg(long)]
    pub passes: Option<usize>,
    /// Streaming: label-propagation refinement passes after the streaming passes (default 8, or 0 with
    /// `--passes`).
    #[arg(long)]
    pub refine: Option<usize>,
    /// Streaming: the scoring rule.
    #[arg(long, value_enum, default_value_t = StreamAlgoArg::Fennel)]
    pub algorithm: StreamAlgoArg,
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MethodArg {
    Metis,
    Stream,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StreamAlgoArg {
    Fennel,
    Ldg,
}

pub fn import(a: &ImportArgs) -> Result<()> {
    let opts = ImportOptions {
        name: a.name.clone(),
        undirected: !a.directed,
        feature_dtype: a.feature_dtype.into(),
        row_normalize: a.row_normalize,
        split_name: a.split.clone(),
    };
    let format = match a.format {
        ImportFormat::Auto => detect_format(&a.dir)?,
        f => f,
    };
    if format == ImportFormat::Ogb && a.layout.layout == LayoutArg::Chunked {
        // Streamed: the edges are spilled to disk by row range, features and labels read in step.
        let m = crate::progress::step("importing the dataset into chunks", || {
            physalia_graph::chunked_import::ogb_chunked(&a.dir, &opts, &a.out, a.layout.chunk_rows)
        })
        .with_context(|| format!("importing {}", a.dir.display()))?;
        return report_chunked(&a.out, &m);
    }
    // The generic layout is read whole (its inputs include .npy and raw .bin files), then written in
    // either layout.
    let ds = crate::progress::step("importing the dataset", || match format {
        ImportFormat::Ogb => import::ogb(&a.dir, &opts),
        _ => import::generic(&a.dir, &opts),
    })
    .with_context(|| format!("importing {}", a.dir.display()))?;
    write_layout(&ds, &a.out, &a.layout)
}

/// Which raw layout a folder holds (the coordinator's detection, as a job's `dataset.path` uses it).
fn detect_format(dir: &Path) -> Result<ImportFormat> {
    Ok(match dataset::detect_format(dir)? {
        DatasetFormat::Ogb => ImportFormat::Ogb,
        _ => ImportFormat::Generic,
    })
}

pub fn synth(c: &SynthCommand) -> Result<()> {
    match c {
        SynthCommand::Sbm(a) => {
            let p = SbmParams {
                num_nodes: a.nodes,
                num_classes: a.classes,
                avg_degree: a.avg_degree,
                homophily: a.homophily,
                feat_dim: a.feat_dim,
                seed: a.seed,
                ..SbmParams::default()
            };
            if a.layout.layout == LayoutArg::Chunked {
                let m = crate::progress::step("generating the SBM graph into chunks", || {
                    chunked_synth::sbm_chunked(&p, &a.out, a.layout.chunk_rows)
                })
                .context("generating the SBM graph")?;
                return report_chunked(&a.out, &m);
            }
            write(
                &crate::progress::step("generating the SBM graph", || synth::sbm(&p))
                    .context("generating the SBM graph")?,
                &a.out,
            )
        }
        SynthCommand::Rmat(a) => {
            let p = RmatParams {
                scale: a.scale,
                edge_factor: a.edge_factor,
                num_classes: a.classes,
                feat_dim: a.feat_dim,
                seed: a.seed,
                ..RmatParams::default()
            };
            if a.layout.layout == LayoutArg::Chunked {
                let m = crate::progress::step("generating the R-MAT graph into chunks", || {
                    chunked_synth::rmat_chunked(&p, &a.out, a.layout.chunk_rows)
                })
                .context("generating the R-MAT graph")?;
                return report_chunked(&a.out, &m);
            }
            write(
                &crate::progress::step("generating the R-MAT graph", || synth::rmat(&p))
                    .context("generating the R-MAT graph")?,
                &a.out,
            )
        }
    }
}

fn write_layout(ds: &OwnedDataset, out: &Path, layout: &LayoutArgs) -> Result<()> {
    match layout.layout {
        LayoutArg::File => write(ds, out),
        LayoutArg::Chunked => {
            let m = crate::progress::step(&format!("writing {} in chunks", out.display()), || {
                physalia_graph::write_chunked(ds, out, layout.chunk_rows)
            })?;
            report_chunked(out, &m)
        }
    }
}

fn report_chunked(out: &Path, m: &Manifest) -> Result<()> {
    eprintln!(
        "wrote {} (chunked): {} nodes, {} directed edges, {} features ({}), {} classes, split {}/{}/{}, \
         {} chunks of {} rows, {} bytes",
        out.display(),
        m.num_nodes,
        m.num_edges,
        m.feat_dim,
        m.feature_dtype,
        m.num_classes,
        m.splits.train,
        m.splits.val,
        m.splits.test,
        m.num_chunks(),
        m.chunk_rows,
        m.data_bytes()
    );
    Ok(())
}

fn write(ds: &OwnedDataset, out: &Path) -> Result<()> {
    crate::progress::step(&format!("writing {}", out.display()), || ds.write(out))?;
    let s = ds.stats();
    eprintln!(
        "wrote {}: {} nodes, {} directed edges, {} features ({:?}), {} classes, split {}/{}/{}",
        out.display(),
        s.num_nodes,
        s.num_edges,
        s.feat_dim,
        s.feature_dtype,
        s.num_classes,
        s.train_size,
        s.val_size,
        s.test_size
    );
    Ok(())
}

pub fn inspect(a: &InspectArgs) -> Result<()> {
    if a.file.is_dir() {
        return inspect_chunked(a);
    }
    let ds = Dataset::open(&a.file)?;
    let stats = ds.stats();
    let partitions = partition::list_partitions(&a.file)?;
    match a.output {
        OutputFormat::Json => {
            let partitions: Vec<_> = partitions.iter().map(summary_json).collect();
            let v = serde_json::json!({
                "path": a.file,
                "metadata": ds.meta(),
                "stats": stats,
                "partitions": partitions,
            });
            println!("{}", serde_json::to_string(&v)?);
        }
        OutputFormat::Text => {
            let m = ds.meta();
            println!(
                "file           {} ({} bytes, checksums verified)",
                a.file.display(),
                stats.file_bytes
            );
            println!("name           {}", m.name);
            println!("source         {}", m.source);
            println!("nodes          {}", stats.num_nodes);
            println!(
                "edges          {} directed CSR entries ({})",
                stats.num_edges,
                if m.directed {
                    "directed"
                } else {
                    "undirected, both directions stored"
                }
            );
            println!(
                "features       {} x {:?}",
                stats.feat_dim, stats.feature_dtype
            );
            println!("classes        {}", stats.num_classes);
            println!(
                "degree         min {} mean {:.2} max {}, {} isolated",
                stats.degree_min, stats.degree_mean, stats.degree_max, stats.isolated_nodes
            );
            println!(
                "split          train {} / val {} / test {}",
                stats.train_size, stats.val_size, stats.test_size
            );
            if partitions.is_empty() {
                println!("partitions     none (`physalia data partition` makes them)");
            }
            for (i, s) in partitions.iter().enumerate() {
                let label = if i == 0 { "partitions" } else { "" };
                println!("{label:<15}{}", summary_line(s));
            }
        }
    }
    Ok(())
}

/// `inspect` of a chunked dataset: the manifest's summary, every chunk checksummed unless
/// `--manifest-only`, and the stored partition sets.
fn inspect_chunked(a: &InspectArgs) -> Result<()> {
    let ds = ChunkedDataset::open(&a.file)?;
    if !a.manifest_only {
        crate::progress::step("checksumming every chunk", || ds.verify())?;
    }
    let m = ds.manifest();
    let partitions = partition::list_partitions(&a.file)?;
    match a.output {
        OutputFormat::Json => {
            let mut manifest = serde_json::to_value(m)?;
            // The per-chunk lists can run to thousands of entries; counts and sizes say enough here.
            for (name, t) in m.tensors.all() {
                manifest["tensors"][name] = serde_json::json!({
                    "dtype": t.dtype,
                    "chunks": t.chunks.len(),
                    "bytes": t.chunks.iter().map(|c| c.bytes).sum::<u64>(),
                });
            }
            let v = serde_json::json!({
                "path": a.file,
                "layout": "chunked",
                "verified": !a.manifest_only,
                "manifest": manifest,
                "data_bytes": m.data_bytes(),
                "partitions": partitions.iter().map(summary_json).collect::<Vec<_>>(),
            });
            println!("{}", serde_json::to_string(&v)?);
        }
        OutputFormat::Text => print_manifest(a, m, &partitions),
    }
    Ok(())
}

fn print_manifest(a: &InspectArgs, m: &Manifest, partitions: &[PartitionSummary]) {
    println!(
        "directory      {} (chunked layout v{}, {} bytes of data, {})",
        a.file.display(),
        m.format_version,
        m.data_bytes(),
        if a.manifest_only {
            "manifest only, chunks not read"
        } else {
            "every chunk checksum verified"
        }
    );
    println!("name           {}", m.name);
    println!("source         {}", m.source);
    println!("nodes          {}", m.num_nodes);
    println!(
        "edges          {} directed CSR entries ({})",
        m.num_edges,
        if m.directed {
            "directed"
        } else {
            "undirected, both directions stored"
        }
    );
    println!("features       {} x {}", m.feat_dim, m.feature_dtype);
    println!("classes        {}", m.num_classes);
    println!(
        "split          train {} / val {} / test {}",
        m.splits.train, m.splits.val, m.splits.test
    );
    println!(
        "chunks         {} node chunks of {} rows",
        m.num_chunks(),
        m.chunk_rows
    );
    for (name, t) in m.tensors.all() {
        let bytes: u64 = t.chunks.iter().map(|c| c.bytes).sum();
        println!(
            "  {name:<12} {:<5} {:>6} files {:>14} bytes",
            t.dtype,
            t.chunks.len(),
            bytes
        );
    }
    if partitions.is_empty() {
        println!("partitions     none (`physalia data partition` makes them)");
    }
    for (i, s) in partitions.iter().enumerate() {
        let label = if i == 0 { "partitions" } else { "" };
        println!("{label:<15}{}", summary_line(s));
    }
}

/// One line per stored partition set for `inspect`: k, cut, balance, largest halo, and whether usable.
fn summary_line(s: &PartitionSummary) -> String {
    let head = format!("k={} seed={}", s.k, s.seed);
    let body = s.meta.as_ref().map(|m| {
        format!(
            "  {} parts  {}  edge cut {} ({:.2}%)  balance {:.3}  max halo {}  computed in {:.2} s{}",
            m.parts.len(),
            m.method,
            m.edge_cut,
            100.0 * m.cut_fraction(),
            m.balance,
            m.parts.iter().map(|p| p.n_halo).max().unwrap_or(0),
            m.compute_seconds,
            m.bytes_read.map_or_else(String::new, |b| format!(
                ", reading {:.1} MiB of the dataset",
                b as f64 / (1u64 << 20) as f64
            ))
        )
    });
    let status = match &s.status {
        ArtifactStatus::Current => String::new(),
        other => format!("  [{other}; `physalia data partition` recomputes it]"),
    };
    format!("{head}{}{status}", body.unwrap_or_default())
}

fn summary_json(s: &PartitionSummary) -> serde_json::Value {
    let mut v = serde_json::json!({
        "dir": s.dir,
        "k": s.k,
        "seed": s.seed,
        "status": match &s.status {
            ArtifactStatus::Current => "current",
            ArtifactStatus::Stale => "stale",
            ArtifactStatus::Invalid(_) => "invalid",
        },
    });
    if let ArtifactStatus::Invalid(why) = &s.status {
        v["problem"] = why.clone().into();
    }
    if let Some(m) = &s.meta {
        v["method"] = m.method.clone().into();
        v["edge_cut"] = m.edge_cut.into();
        v["num_undirected_edges"] = m.num_undirected_edges.into();
        v["balance"] = m.balance.into();
        v["compute_seconds"] = m.compute_seconds.into();
        v["partition_seconds"] = m.partition_seconds.into();
        v["bytes_read"] = m.bytes_read.into();
        v["parts"] = parts_json(m);
    }
    v
}

fn parts_json(m: &PartitionMeta) -> serde_json::Value {
    m.parts
        .iter()
        .map(|p| {
            serde_json::json!({
                "part": p.part,
                "owned": p.n_owned,
                "halo": p.n_halo,
                "local_edges": p.n_local_edges,
            })
        })
        .collect()
}

/// `physalia data partition`: computes the missing or stale partition sets, reuses the rest, and reports
/// each one.
pub fn partition(a: &PartitionArgs) -> Result<()> {
    let chunked = a.file.is_dir();
    let method = match a.method {
        Some(MethodArg::Metis) => Some(PartitionMethod::Metis),
        Some(MethodArg::Stream) => Some(stream_method(a)),
        None if chunked => Some(stream_method(a)),
        None => None,
    };
    let what = match &method {
        Some(PartitionMethod::Stream(_)) => "partitioning (streaming)",
        _ => "partitioning (METIS)",
    };
    let sets = crate::progress::step(what, || {
        partition::ensure_partitions_with(&a.file, &a.k, a.seed, method.as_ref())
    })?;
    match a.output {
        OutputFormat::Json => {
            let v = serde_json::json!({
                "path": a.file,
                "seed": a.seed,
                "partitions": sets.iter().map(set_json).collect::<Vec<_>>(),
            });
            println!("{}", serde_json::to_string(&v)?);
        }
        OutputFormat::Text => {
            for s in &sets {
                print_set(s);
            }
        }
    }
    Ok(())
}

fn stream_method(a: &PartitionArgs) -> PartitionMethod {
    let base = match a.passes {
        None => StreamParams::refined(1),
        Some(passes) => StreamParams {
            passes,
            ..StreamParams::new(1)
        },
    };
    PartitionMethod::Stream(StreamParams {
        refine_passes: a.refine.unwrap_or(base.refine_passes),
        algorithm: match a.algorithm {
            StreamAlgoArg::Fennel => StreamAlgorithm::Fennel { gamma: 1.5 },
            StreamAlgoArg::Ldg => StreamAlgorithm::Ldg,
        },
        ..base
    })
}

fn set_json(s: &PartitionSet) -> serde_json::Value {
    let m = &s.meta;
    serde_json::json!({
        "k": m.k,
        "seed": m.seed,
        "method": m.method,
        "dir": s.dir,
        "reused": s.reused,
        "seconds": s.seconds,
        "compute_seconds": m.compute_seconds,
        "partition_seconds": m.partition_seconds,
        "bytes_read": m.bytes_read,
        "edge_cut": m.edge_cut,
        "num_undirected_edges": m.num_undirected_edges,
        "balance": m.balance,
        "parts": parts_json(m),
    })
}

fn print_set(s: &PartitionSet) {
    let m = &s.meta;
    let how = if s.reused {
        format!(
            "reused (checked in {:.3} s; computed in {:.2} s)",
            s.seconds, m.compute_seconds
        )
    } else {
        format!("computed in {:.2} s", s.seconds)
    };
    // the assignment alone (the rest is reading the graph and writing the parts)
    let how = match m.partition_seconds {
        Some(p) => format!("{how}, {p:.2} s of it partitioning"),
        None => how,
    };
    let how = match m.bytes_read {
        Some(b) => format!(
            "{how}, reading {:.1} MiB of the dataset",
            b as f64 / (1u64 << 20) as f64
        ),
        None => how,
    };
    println!(
        "k={} seed={} ({}): {how}: edge cut {} of {} undirected edges ({:.2}%), balance {:.3}",
        m.k,
        m.seed,
        m.method,
        m.edge_cut,
        m.num_undirected_edges,
        100.0 * m.cut_fraction(),
        m.balance
    );
    for p in &m.parts {
        println!(
            "  part {:<4} owned {:<10} halo {:<10} local edges {}",
            p.part, p.n_owned, p.n_halo, p.n_local_edges
        );
    }
    println!("  in {}", s.dir.display());
}
