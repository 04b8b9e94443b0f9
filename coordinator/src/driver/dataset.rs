//! Resolves a job's `dataset:` section into the arrays training needs, whatever the source: a dataset file
//! (memory-mapped), a raw folder imported on the fly, a synthetic graph generated from its seed, or a
//! chunked dataset directory (`manifest.json` and chunk files) of which only the manifest is read: the
//! coordinator partitions it by streaming and each worker reads its own part.

use std::borrow::Cow;
use std::path::Path;

use anyhow::{Context, Result, bail};
use physalia_graph::{
    ChunkedDataset, Dataset, GraphStats, ImportOptions, OwnedDataset, RmatParams, SbmParams, Split,
    import, is_chunked, synth,
};

use super::Observer;
use crate::spec::{DatasetFormat, DatasetSource, DatasetSpec, JobSpec, Parallelism, SynthKind};

/// A job's dataset as the coordinator holds it.
pub enum Source {
    File(Dataset),
    Memory(OwnedDataset),
    /// A chunked dataset directory: its manifest only. Partition parallelism trains on it without any
    /// process loading it whole; see [`check_parallelism`] and [`Source::into_whole`].
    Chunked(ChunkedDataset),
}

/// A dataset whose arrays are all at hand: what single-process training reads.
pub enum Whole {
    File(Dataset),
    Memory(OwnedDataset),
}

impl Source {
    pub fn stats(&self) -> GraphStats {
        match self {
            Source::File(d) => d.stats(),
            Source::Memory(d) => d.stats(),
            Source::Chunked(d) => chunked_stats(d),
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Source::File(d) => &d.meta().name,
            Source::Memory(d) => &d.meta.name,
            Source::Chunked(d) => &d.manifest().name,
        }
    }

    /// Labelled training nodes.
    pub fn train_nodes(&self) -> usize {
        match self {
            Source::File(d) => d.split(Split::Train).len(),
            Source::Memory(d) => d.split(Split::Train).len(),
            Source::Chunked(d) => d.manifest().splits.train,
        }
    }

    /// Whether this is a chunked dataset directory (partition parallelism only).
    pub fn is_chunked(&self) -> bool {
        matches!(self, Source::Chunked(_))
    }

    /// The whole dataset in this process, for training in it (repeated seeds, `train.runs` > 1). A
    /// chunked dataset is loaded whole (and its chunks' checksums verified): the process trains on all
    /// of it anyway, so this needs as much memory as the single file would.
    pub fn into_whole(self, obs: &dyn Observer) -> Result<Whole> {
        Ok(match self {
            Source::File(d) => Whole::File(d),
            Source::Memory(d) => Whole::Memory(d),
            Source::Chunked(d) => Whole::Memory(
                super::step(obs, "loading the chunked dataset", || d.load())
                    .with_context(|| format!("dataset.path: loading {}", d.dir().display()))?,
            ),
        })
    }

    /// What training needs beyond the file's own invariants (which opening it checked): finite features
    /// and a non-empty training split. The error names the tensor and the first bad row. A chunked
    /// dataset is checked from its manifest (its features are read by the workers, part by part).
    pub fn check_trainable(&self) -> Result<()> {
        let features = match self {
            Source::File(d) => Some(d.features()),
            Source::Memory(d) => Some(d.features.view()),
            Source::Chunked(_) => None,
        };
        let dim = self.stats().feat_dim.max(1);
        if let Some((i, v)) = features.and_then(|f| f.first_non_finite()) {
            bail!(
                "tensor 'features': row {} column {} is {v}; features must be finite numbers (replace \
                 missing values before importing)",
                i / dim,
                i % dim
            );
        }
        if self.train_nodes() == 0 {
            bail!("tensor 'train_idx' is empty: training needs labelled training nodes");
        }
        Ok(())
    }
}

/// A chunked dataset's statistics from its manifest alone: the degree extremes and the isolated nodes,
/// which need every row, are 0; the mean degree is exact.
fn chunked_stats(d: &ChunkedDataset) -> GraphStats {
    let m = d.manifest();
    GraphStats {
        num_nodes: m.num_nodes,
        num_edges: m.num_edges,
        feat_dim: m.feat_dim,
        num_classes: m.num_classes,
        feature_dtype: m.feature_dtype,
        directed: m.directed,
        degree_min: 0,
        degree_mean: if m.num_nodes == 0 {
            0.0
        } else {
            m.num_edges as f64 / m.num_nodes as f64
        },
        degree_max: 0,
        isolated_nodes: 0,
        train_size: m.splits.train,
        val_size: m.splits.val,
        test_size: m.splits.test,
        file_bytes: m.data_bytes(),
    }
}

impl Whole {
    pub fn stats(&self) -> GraphStats {
        match self {
            Whole::File(d) => d.stats(),
            Whole::Memory(d) => d.stats(),
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Whole::File(d) => &d.meta().name,
            Whole::Memory(d) => &d.meta.name,
        }
    }

    pub fn indptr(&self) -> &[i64] {
        match self {
            Whole::File(d) => d.csr().indptr,
            Whole::Memory(d) => &d.indptr,
        }
    }

    pub fn indices(&self) -> &[i32] {
        match self {
            Whole::File(d) => d.csr().indices,
            Whole::Memory(d) => &d.indices,
        }
    }

    pub fn labels(&self) -> &[i64] {
        match self {
            Whole::File(d) => d.labels(),
            Whole::Memory(d) => &d.labels,
        }
    }

    pub fn split(&self, s: Split) -> &[i64] {
        match self {
            Whole::File(d) => d.split(s),
            Whole::Memory(d) => d.split(s),
        }
    }

    pub fn features_f32(&self) -> Cow<'_, [f32]> {
        match self {
            Whole::File(d) => d.features_f32(),
            Whole::Memory(d) => d.features.view().to_f32(),
        }
    }
}

/// Refuses a chunked dataset for a job whose workers would each need the whole dataset file: data and
/// model parallelism ship it to every worker. Partition parallelism streams the partitioning and hands
/// each worker its own part, so no process holds the graph.
pub fn check_parallelism(spec: &JobSpec, source: &Source) -> Result<()> {
    if let Source::Chunked(d) = source
        && spec.mode() != Parallelism::Partition
    {
        bail!(
            "dataset.path: {} is a chunked dataset (manifest.json and chunk files), which only partition \
             parallelism trains on: each worker reads its own part and no process loads the whole graph. \
             parallelism: {} sends the whole dataset file to every worker; use `parallelism: partition` \
             (or `{{partition: K, replicas: R}}`), or write the graph as one file (`physalia data synth \
             ... --layout file`) for mini-batch training",
            d.dir().display(),
            spec.mode().as_str()
        );
    }
    Ok(())
}

/// The dataset `spec` names, checked to be trainable; `obs` shows the steps that take a while.
pub fn load(spec: &DatasetSpec, obs: &dyn Observer) -> Result<Source> {
    let source = load_unchecked(spec, obs)?;
    if let Err(e) = source.check_trainable() {
        let what = match &spec.path {
            Some(p) => format!("dataset.path: {}", p.display()),
            None => "dataset.synth".to_string(),
        };
        return Err(e.context(what));
    }
    Ok(source)
}

fn load_unchecked(spec: &DatasetSpec, obs: &dyn Observer) -> Result<Source> {
    match spec.source() {
        Some(DatasetSource::Stats(st)) => bail!(
            "dataset.stats: {} describes a graph that is not here, for `physalia plan`; training needs \
             the graph itself (`dataset.path`, or `dataset.synth` to generate one)",
            st.name.as_deref().unwrap_or("the statistics")
        ),
        Some(DatasetSource::Path(path)) => load_path(path, spec.format, obs),
        Some(DatasetSource::Synth(s)) => {
            let ds = match s.kind {
                SynthKind::Sbm => {
                    let mut p = SbmParams {
                        num_nodes: s.nodes.unwrap_or(10_000) as usize,
                        num_classes: s.classes as usize,
                        feat_dim: s.feat_dim as usize,
                        seed: s.seed,
                        ..SbmParams::default()
                    };
                    if let Some(d) = s.avg_degree {
                        p.avg_degree = d;
                    }
                    if let Some(h) = s.homophily {
                        p.homophily = h;
                    }
                    super::step(obs, "generating the SBM graph", || synth::sbm(&p))
                        .context("generating dataset.synth (sbm)")?
                }
                SynthKind::Rmat => {
                    let mut p = RmatParams {
                        num_classes: s.classes as usize,
                        feat_dim: s.feat_dim as usize,
                        seed: s.seed,
                        ..RmatParams::default()
                    };
                    if let Some(sc) = s.scale {
                        p.scale = sc;
                    }
                    if let Some(e) = s.edge_factor {
                        p.edge_factor = e as usize;
                    }
                    super::step(obs, "generating the R-MAT graph", || synth::rmat(&p))
                        .context("generating dataset.synth (rmat)")?
                }
            };
            Ok(Source::Memory(ds))
        }
        None => bail!("dataset: exactly one of `path` or `synth` must be set"),
    }
}

fn load_path(path: &Path, format: DatasetFormat, obs: &dyn Observer) -> Result<Source> {
    if !path.exists() {
        bail!("{}", missing_path(path));
    }
    if format == DatasetFormat::Auto && is_chunked(path) {
        let ds = ChunkedDataset::open(path).context("dataset.path")?;
        return Ok(Source::Chunked(ds));
    }
    let format = match format {
        DatasetFormat::Auto if path.is_file() => DatasetFormat::Safetensors,
        DatasetFormat::Auto => detect_format(path).context("dataset.path")?,
        f => f,
    };
    let opts = ImportOptions::default();
    Ok(match format {
        DatasetFormat::Safetensors | DatasetFormat::Auto => Source::File(
            super::step(obs, "verifying the dataset", || Dataset::open(path))
                .context("dataset.path")?,
        ),
        DatasetFormat::Generic => Source::Memory(
            super::step(obs, "importing the dataset", || {
                import::generic(path, &opts)
            })
            .with_context(|| format!("dataset.path: importing {}", path.display()))?,
        ),
        DatasetFormat::Ogb => Source::Memory(
            super::step(obs, "importing the OGB dataset", || {
                import::ogb(path, &opts)
            })
            .with_context(|| format!("dataset.path: importing {}", path.display()))?,
        ),
    })
}

/// Which raw layout the folder `dir` holds: [`DatasetFormat::Ogb`] when it has `raw/edge.csv.gz`,
/// [`DatasetFormat::Generic`] when it has `edges.csv` or `edges.npy`.
pub fn detect_format(dir: &Path) -> Result<DatasetFormat> {
    if dir.join("raw").join("edge.csv.gz").is_file() {
        Ok(DatasetFormat::Ogb)
    } else if dir.join("edges.csv").is_file() || dir.join("edges.npy").is_file() {
        Ok(DatasetFormat::Generic)
    } else if !dir.is_dir() {
        bail!("{}: no such directory", dir.display())
    } else {
        bail!(
            "{}: not a recognised dataset folder: expected edges.csv or edges.npy (generic layout), \
             raw/edge.csv.gz (OGB layout) or manifest.json (a chunked dataset)",
            dir.display()
        )
    }
}

/// Why `dataset.path` names nothing, and, when its last component is a dataset known by name, the
/// `{stats: NAME}` form that plans it without its files.
fn missing_path(path: &Path) -> String {
    let mut message = format!(
        "dataset.path: {}: no such file or directory",
        path.display()
    );
    let known = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(crate::spec::known_graph_named);
    if let Some(name) = known {
        message.push_str(&format!(
            "; {name} is known by its published sizes: `dataset: {{stats: {name}}}` plans it without its \
             files (`physalia plan`), and training needs the graph itself (`physalia data import` of its \
             OGB folder)"
        ));
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::Plain;

    fn job(path: &Path, parallelism: &str) -> JobSpec {
        let text = format!(
            "dataset: {{path: {}}}\nmodel: {{kind: gcn, layers: 2, hidden: 8}}\nworkers: 2\n\
             parallelism: {parallelism}\n",
            path.display()
        );
        crate::spec::parse_str(&text, "job.yaml", &[]).unwrap()
    }

    /// A chunked directory is read by its manifest alone and describes the same graph to the planner as
    /// the single file (the stored sets beside it included), limited to partition parallelism; data
    /// parallelism on it is refused naming `dataset.path`.
    #[test]
    fn a_chunked_directory_is_its_manifest_and_trains_partition_parallel_only() {
        let ds = synth::sbm(&SbmParams {
            num_nodes: 600,
            num_classes: 3,
            feat_dim: 8,
            ..SbmParams::default()
        })
        .unwrap();
        let t = tempfile::tempdir().unwrap();
        let (dir, file) = (t.path().join("g"), t.path().join("f.safetensors"));
        physalia_graph::write_chunked(&ds, &dir, 256).unwrap();
        ds.write(&file).unwrap();
        physalia_graph::ensure_partitions(&dir, &[2], 0).unwrap();
        let obs = Plain { quiet: true };
        let (spec, fspec) = (job(&dir, "partition"), job(&file, "partition"));
        let chunked = load(&spec.dataset, &obs).unwrap();
        assert!(chunked.is_chunked());
        let single = load(&fspec.dataset, &obs).unwrap();
        let (c, f) = (chunked.stats(), single.stats());
        assert_eq!(
            (c.num_nodes, c.num_edges, c.feat_dim, c.num_classes),
            (f.num_nodes, f.num_edges, f.feat_dim, f.num_classes)
        );
        assert_eq!(
            (c.train_size, c.val_size, c.test_size),
            (f.train_size, f.val_size, f.test_size)
        );
        assert_eq!(chunked.train_nodes(), single.train_nodes());
        assert_eq!(chunked.name(), single.name());
        check_parallelism(&spec, &chunked).unwrap();
        let req = crate::driver::plan::request(&spec, &chunked).unwrap();
        let freq = crate::driver::plan::request(&fspec, &single).unwrap();
        // the same graph; only the chunked one says so (the planner streams it)
        assert!(req.graph.chunked && !freq.graph.chunked);
        assert_eq!(
            physalia_planner::GraphStats {
                chunked: false,
                ..req.graph.clone()
            },
            freq.graph
        );
        assert_eq!(req.constraints.modes, vec![Parallelism::Partition]);
        assert!(freq.constraints.modes.is_empty());
        assert_eq!(
            req.partitions.len(),
            1,
            "the set stored beside the directory"
        );
        assert_eq!(req.partitions[0].parts, 2);
        // repeated seeds load it whole: the same arrays as the file
        let whole = chunked.into_whole(&obs).unwrap();
        let fwhole = single.into_whole(&obs).unwrap();
        assert_eq!(whole.indptr(), fwhole.indptr());
        assert_eq!(whole.indices(), fwhole.indices());
        assert_eq!(whole.labels(), fwhole.labels());
        for mode in ["data", "model"] {
            let spec = job(&dir, mode);
            let source = load(&spec.dataset, &obs).unwrap();
            let e = format!("{:#}", check_parallelism(&spec, &source).unwrap_err());
            assert!(e.starts_with("dataset.path: "), "{e}");
            assert!(e.contains(&format!("parallelism: {mode}")), "{e}");
            assert!(e.contains("parallelism: partition"), "{e}");
        }
    }
}
