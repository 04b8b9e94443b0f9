//! Partition sets kept beside a dataset in its object store, for cluster-mode coordinators.

use std::path::Path;

use anyhow::{Context, Result};

use crate::store::Remote;

/// A chunked dataset's URL ends with `/`: a folder of chunk files under its manifest (a file's does not).
pub(crate) fn is_chunked_url(url: &str) -> bool {
    url.ends_with('/')
}

/// The partition sets of a dataset in an object store, stored beside it as on a disk
/// (`<dataset URL without .safetensors>.parts/k<K>-seed<S>/`): computed by the first coordinator that
/// needs one, reused by every later job of the same dataset, worker count and seed.
pub struct StoredPartitions {
    /// The store folder holding the dataset.
    remote: Remote,
    /// `X.parts` for the dataset `X.safetensors`.
    folder: String,
}

impl StoredPartitions {
    /// Beside the dataset at `url` (a store URL): `X.parts` beside a file `X.safetensors`, `X/parts` in a
    /// chunked dataset's folder `X/` (its URL ends with `/`), as on a disk.
    pub fn beside(url: &str) -> Result<StoredPartitions> {
        let (base, name) = url
            .trim_end_matches('/')
            .rsplit_once('/')
            .with_context(|| format!("dataset.path: {url} names no file"))?;
        let folder = if is_chunked_url(url) {
            format!("{name}/parts")
        } else {
            physalia_graph::partition::partitions_dir(Path::new(name))
                .to_string_lossy()
                .into_owned()
        };
        Ok(StoredPartitions {
            remote: Remote::open(base)?,
            folder,
        })
    }

    /// Brings set `k`, `seed` from the store to `dataset`'s side here, unless it is here already or the
    /// store has no whole set (its `partition.safetensors`, put last, is the mark of a whole one).
    /// Returns whether it was fetched; `ensure_partitions` then checks it against the dataset as it
    /// checks any stored set.
    pub fn fetch(&self, dataset: &Path, k: usize, seed: u64) -> Result<bool> {
        use physalia_graph::partition::{PARTITION_FILE, partition_set_dir};
        let local = partition_set_dir(dataset, k, seed);
        if local.exists() {
            return Ok(false);
        }
        let set = format!("{}/k{k}-seed{seed}", self.folder);
        let files = self.remote.list("", &set)?;
        if !files.iter().any(|(f, _)| f == PARTITION_FILE) {
            return Ok(false);
        }
        // whole or absent: into a temporary folder, renamed into place
        let tmp = local.with_extension("download.tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        for (file, _) in &files {
            if file.contains('/') || file.starts_with('.') {
                continue;
            }
            self.remote
                .get_file("", &format!("{set}/{file}"), &tmp.join(file))?;
        }
        std::fs::rename(&tmp, &local).with_context(|| format!("writing {}", local.display()))?;
        Ok(true)
    }

    /// Puts a set computed here beside the dataset in the store: its part files first and the
    /// partitioning last, so a reader never takes a half-uploaded set for a whole one.
    pub fn store(&self, set: &physalia_graph::partition::PartitionSet) -> Result<()> {
        use physalia_graph::partition::PARTITION_FILE;
        let name = set
            .dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .context("a partition set names no folder")?;
        let last = set.dir.join(PARTITION_FILE);
        for file in set.part_files.iter().chain(std::iter::once(&last)) {
            let file_name = file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .context("a partition file names no file")?;
            self.remote
                .put_file("", &format!("{}/{name}/{file_name}", self.folder), file)?;
        }
        Ok(())
    }

    /// Where the sets are, for messages.
    pub fn url(&self) -> String {
        format!("{}/{}", self.remote.url(), self.folder)
    }
}

/// How long a worker may use the signed URL of a chunk file: it fetches its chunks as its launch starts.
const SIGNED_URL_TTL: std::time::Duration = std::time::Duration::from_secs(3600);

/// A chunked dataset in an object store whose coordinator downloaded only its structure: the workers
/// read the chunk files from the store themselves where it signs URLs ([`StoredChunks::signed_get`]),
/// otherwise they are streamed through the coordinator ([`physalia_control::Files::serve_from`]).
pub struct StoredChunks {
    /// The store folder holding the dataset's folder.
    pub(crate) remote: Remote,
    /// The dataset's folder in it.
    pub(crate) folder: String,
}

impl StoredChunks {
    /// The chunk file `file` (a manifest's relative path) as a source of bytes.
    pub fn source(&self, file: &str) -> std::sync::Arc<dyn physalia_control::Source> {
        self.remote.source(&self.folder, file)
    }

    /// The dataset's folder in the store, as a URL.
    pub fn url(&self) -> String {
        format!(
            "{}/{}/",
            self.remote.url(),
            self.folder.trim_end_matches('/')
        )
    }

    /// A signed URL of the chunk file `file` a worker GETs itself, or `None` where the store signs none.
    pub fn signed_get(&self, file: &str) -> anyhow::Result<Option<physalia_control::SignedUrl>> {
        self.remote.signed_get(&self.folder, file, SIGNED_URL_TTL)
    }
}

/// How a job computes the partition sets it does not find stored: the job file's `dataset.partitioner`,
/// or under `auto` the planner's partition step for the job's first part count.
#[derive(Debug, Clone)]
pub struct PartitionChoice {
    pub method: physalia_graph::partition::PartitionMethod,
    /// One line: which partitioner and why.
    pub why: String,
}

impl PartitionChoice {
    /// `metis` or `stream`.
    pub fn method_name(&self) -> &'static str {
        match self.method {
            physalia_graph::partition::PartitionMethod::Metis => "metis",
            physalia_graph::partition::PartitionMethod::Stream(_) => "stream",
        }
    }
}

/// The partitioner for `spec`'s job on `source`, whose coordinator has `memory_bytes` (this machine's
/// available memory, or a cluster-mode coordinator's container; `None`: the planner's assumption).
pub fn choose(
    spec: &crate::spec::JobSpec,
    source: &crate::driver::dataset::Source,
    memory_bytes: Option<f64>,
) -> Result<PartitionChoice> {
    use crate::spec::PartitionerSpec;
    use physalia_graph::partition::PartitionMethod;
    use physalia_graph::stream::StreamParams;
    use physalia_planner::Partitioner;
    let k = spec.parts().max(1);
    let stream = || PartitionMethod::Stream(StreamParams::refined(k as usize));
    let chunked = source.is_chunked();
    match spec.dataset.partitioner {
        PartitionerSpec::Metis if chunked => anyhow::bail!(
            "dataset.partitioner: metis needs the whole graph in memory, and {} is a chunked dataset; \
             use `stream` or `auto`",
            source.name()
        ),
        PartitionerSpec::Metis => Ok(PartitionChoice {
            method: PartitionMethod::Metis,
            why: "METIS (dataset.partitioner)".into(),
        }),
        PartitionerSpec::Stream => Ok(PartitionChoice {
            method: stream(),
            why: "streaming (dataset.partitioner)".into(),
        }),
        PartitionerSpec::Auto => {
            let mut req = crate::driver::plan::request(spec, source)?;
            if let Some(bytes) = memory_bytes {
                req.constraints.coordinator_memory_gib = Some(bytes / f64::from(1u32 << 30));
            }
            let catalog = physalia_planner::Catalog::builtin();
            // the job's own SKU where the catalog has one; the step only scales its compute time
            let w = crate::driver::plan::as_written(spec, &req, &catalog, None, None).or_else(
                |_| crate::driver::plan::as_written(spec, &req, &catalog, Some("local"), None),
            )?;
            let Some(step) = w.partition else {
                // one part, or model parallelism: nothing to partition (a chunked dataset's single
                // part is still cut from its chunks, never loaded)
                return Ok(PartitionChoice {
                    method: if chunked {
                        stream()
                    } else {
                        PartitionMethod::Metis
                    },
                    why: "one part: nothing to partition".into(),
                });
            };
            let method = match step.chosen.partitioner {
                Partitioner::Metis => PartitionMethod::Metis,
                Partitioner::Stream => stream(),
            };
            Ok(PartitionChoice {
                method,
                why: format!("the planner's choice: {}", step.reason),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A set computed by one coordinator goes beside the dataset in the store, whole (the partitioning
    /// last); the next coordinator of the same dataset fetches it and `ensure_partitions` reuses it
    /// instead of partitioning again. A set without its partitioning, or one already here, is not
    /// fetched.
    #[test]
    fn partitions_computed_once_are_reused_from_the_store() {
        use physalia_graph::partition::{PARTITION_FILE, ensure_partitions, partition_set_dir};
        let stored = StoredPartitions {
            remote: Remote::in_memory("memory://jobs/.datasets"),
            folder: "0123-g.parts".into(),
        };
        let ds = physalia_graph::synth::sbm(&physalia_graph::SbmParams {
            num_nodes: 400,
            num_classes: 3,
            feat_dim: 8,
            ..Default::default()
        })
        .unwrap();
        let first = tempfile::tempdir().unwrap();
        let path = first.path().join("0123-g.safetensors");
        ds.write(&path).unwrap();
        assert!(
            !stored.fetch(&path, 2, 0).unwrap(),
            "nothing in the store yet"
        );
        let set = ensure_partitions(&path, &[2], 0).unwrap().remove(0);
        assert!(!set.reused);
        stored.store(&set).unwrap();
        let mut listed: Vec<String> = stored
            .remote
            .list("", "0123-g.parts")
            .unwrap()
            .into_iter()
            .map(|(f, _)| f)
            .collect();
        listed.sort();
        assert_eq!(
            listed,
            [
                "k2-seed0/part0.safetensors",
                "k2-seed0/part1.safetensors",
                "k2-seed0/partition.safetensors"
            ]
        );

        // another coordinator, another disk: fetched, then reused as computed
        let second = tempfile::tempdir().unwrap();
        let path2 = second.path().join("0123-g.safetensors");
        std::fs::copy(&path, &path2).unwrap();
        assert!(stored.fetch(&path2, 2, 0).unwrap());
        assert!(!stored.fetch(&path2, 2, 0).unwrap(), "already here");
        let again = ensure_partitions(&path2, &[2], 0).unwrap().remove(0);
        assert!(again.reused, "the fetched set is not reused");
        assert_eq!(again.meta.checksums, set.meta.checksums);
        for (a, b) in again.part_files.iter().zip(&set.part_files) {
            assert_eq!(std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
        }

        // a set whose partitioning never arrived (an upload cut short) is not taken
        let third = tempfile::tempdir().unwrap();
        let path3 = third.path().join("0123-g.safetensors");
        std::fs::copy(&path, &path3).unwrap();
        stored
            .remote
            .put("", "0123-g.parts/k3-seed0/part0.safetensors", b"x".to_vec())
            .unwrap();
        assert!(!stored.fetch(&path3, 3, 0).unwrap());
        assert!(!partition_set_dir(&path3, 3, 0).exists());
        // nor is another seed's
        assert!(!stored.fetch(&path3, 2, 1).unwrap());
        assert!(
            partition_set_dir(&path, 2, 0)
                .join(PARTITION_FILE)
                .is_file()
        );
    }
}
