//! Cutting this worker's part of a chunked dataset (`PartSource::Cut`): alone (reading every edge
//! chunk: [`physalia_graph::chunked_partition::cut_part`]) or together with the job's other workers
//! ([`physalia_graph::chunked_shuffle`]'s all-to-alls over the job's mesh, each reading `1/k` of the
//! chunk files); reading the dataset in place where this worker shares the coordinator's disk, or
//! fetching just the files it reads by name and handing the part back where it does not.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use physalia_control::{Artifact, PartCut, Upload};
use physalia_graph::chunked::{ChunkedDataset, MANIFEST_FILE};
use physalia_graph::chunked_shuffle::{Shuffle, ShuffleStats, chunks_read_by, cut_part_shuffled};
use physalia_graph::partition::Part;
use physalia_wire::{Link, Phase, Tag, WireError, all_to_all_bytes};

use crate::run::Coordinator;

/// Cuts this worker's part as `c` says, logging what it read and moved.
pub fn cut<L: Link + ?Sized>(link: &mut L, io: &mut dyn Coordinator, c: &PartCut) -> Result<Part> {
    let rank = link.rank();
    let t = Instant::now();
    let fetched = match &c.served {
        Some(_) => Some(Fetched::get(io, c, link.world())?),
        None => None,
    };
    let local = fetched
        .as_ref()
        .map_or_else(|| c.clone(), |f| f.cut.clone());
    let part = if c.shuffle {
        let (part, stats) = cut_together(link, &local)?;
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        eprintln!(
            "worker {rank}: cut part {} of {} from {} with the other workers ({} rows, {} halo rows): \
             read {:.1} MiB of the dataset's files ({} chunks{}), sent {:.1} MiB and received {:.1} MiB \
             of rows, in {:.3} s{}",
            part.part,
            part.k,
            dataset_name(c),
            part.owned.len(),
            part.halo.len(),
            mib(stats.read_bytes),
            stats.chunks_read,
            fetched.as_ref().map_or(String::new(), Fetched::how),
            mib(stats.sent_bytes),
            mib(stats.received_bytes),
            t.elapsed().as_secs_f64(),
            if stats.wrote {
                ""
            } else {
                "; its part file, written by an earlier try, kept"
            }
        );
        if stats.wrote && crate::run::test_die_at(rank) == Some(0) {
            eprintln!("worker {rank}: test hook: killing myself after writing my part");
            crate::run::test_die(rank);
        }
        part
    } else {
        let part = physalia_graph::chunked_partition::cut_part(
            &local.dataset,
            &local.assignment,
            local.part,
            &local.out,
        )
        .with_context(|| format!("cutting part {} of {}", c.part, c.dataset.display()))?;
        eprintln!(
            "worker {rank}: cut part {} of {} from {} ({} rows, {} halo rows{}) in {:.3} s",
            part.part,
            part.k,
            dataset_name(c),
            part.owned.len(),
            part.halo.len(),
            fetched.as_ref().map_or(String::new(), Fetched::how),
            t.elapsed().as_secs_f64()
        );
        part
    };
    if let Some(f) = fetched {
        f.hand_back(io, c.part)?;
    }
    Ok(part)
}

/// The dataset as the job's user knows it: the store folder (or the coordinator's path) a served cut
/// names, else the folder read in place.
fn dataset_name(c: &PartCut) -> String {
    match &c.served {
        Some(s) if !s.source.is_empty() => s.source.clone(),
        _ => c.dataset.display().to_string(),
    }
}

/// The files a worker away from the coordinator's disk fetched to cut its part: the manifest and the
/// chunk files it reads, laid out as the dataset's folder, and the assignment. Removed when dropped.
struct Fetched {
    root: PathBuf,
    /// `c` with this machine's paths.
    cut: PartCut,
    /// Chunk files fetched, and how many of them from their signed URLs (not through the coordinator).
    chunks: usize,
    direct: u64,
}

impl Fetched {
    fn get(io: &mut dyn Coordinator, c: &PartCut, world: usize) -> Result<Fetched> {
        let served = c.served.as_ref().context("the part is served")?;
        let root = io.scratch().join(format!("cut-part{}", c.part));
        let dataset = root.join("dataset");
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&dataset)
            .with_context(|| format!("creating {}", dataset.display()))?;
        let mut fetched = Fetched {
            chunks: 0,
            direct: 0,
            root: root.clone(),
            cut: PartCut {
                dataset: dataset.clone(),
                assignment: io.artifact(&served.assignment)?,
                part: c.part,
                out: root.join(format!("part{}.safetensors", c.part)),
                shuffle: c.shuffle,
                served: None,
            },
        };
        let manifest = io.artifact(&served.manifest)?;
        std::fs::copy(&manifest, dataset.join(MANIFEST_FILE))
            .with_context(|| format!("copying {}", manifest.display()))?;
        let ds = ChunkedDataset::open(&dataset)?;
        let m = ds.manifest();
        let files = match c.shuffle {
            true => chunks_read_by(m, c.part, world),
            false => m
                .tensors
                .all()
                .iter()
                .flat_map(|(_, t)| &t.chunks)
                .collect(),
        };
        let direct_before = io.fetched_directly();
        for entry in files {
            let xxh3 = u64::from_str_radix(&entry.xxh3, 16)
                .with_context(|| format!("{}: the checksum of {}", MANIFEST_FILE, entry.file))?;
            let got = io.artifact(&Artifact {
                name: format!("{}{}", served.chunk_prefix, entry.file),
                size: entry.bytes,
                xxh3,
                path: None,
                url: served.direct.get(&entry.file).cloned(),
            })?;
            fetched.chunks += 1;
            let dest = dataset.join(&entry.file);
            if let Some(dir) = dest.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            std::fs::rename(&got, &dest)
                .with_context(|| format!("moving {} to {}", got.display(), dest.display()))?;
        }
        fetched.direct = io.fetched_directly() - direct_before;
        Ok(fetched)
    }

    /// How the chunk files came, for the cut's line.
    fn how(&self) -> String {
        match self.direct {
            0 => ", fetched through the coordinator".into(),
            d => format!(", fetched: {d} of {} from the store directly", self.chunks),
        }
    }

    /// Hands the part file back to the coordinator, which stores it in the set.
    fn hand_back(self, io: &mut dyn Coordinator, part: usize) -> Result<()> {
        io.keep(Upload::Part { part }, &self.cut.out)
            .with_context(|| format!("handing part {part} to the coordinator"))
    }
}

impl Drop for Fetched {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// The mesh as a [`Shuffle`]: stage and round become the frames' layer and epoch under
/// [`Phase::Shuffle`]. A failed exchange is kept, so the caller can say the peer failed, not the data.
struct MeshShuffle<'a, L: Link + ?Sized> {
    link: &'a mut L,
    failed: Option<WireError>,
}

impl<L: Link + ?Sized> Shuffle for MeshShuffle<'_, L> {
    fn me(&self) -> usize {
        self.link.rank()
    }

    fn k(&self) -> usize {
        self.link.world()
    }

    fn all_to_all(
        &mut self,
        stage: u16,
        round: u32,
        out: Vec<Vec<u8>>,
    ) -> Result<Vec<Vec<u8>>, physalia_graph::Error> {
        all_to_all_bytes(self.link, Tag::new(round, stage, Phase::Shuffle), out).map_err(|e| {
            let problem = format!("moving rows between the workers: {e}");
            self.failed = Some(e);
            physalia_graph::Error::Partition { problem }
        })
    }
}

/// Cuts part `c.part` (this worker's rank) with every other worker of the mesh and writes it to `c.out`.
/// A failure of the mesh (a peer lost or silent) is an exchange error, which the coordinator blames on
/// the peer; anything else (the dataset, the assignment) is this worker's.
fn cut_together<L: Link + ?Sized>(link: &mut L, c: &PartCut) -> Result<(Part, ShuffleStats)> {
    let mut mesh = MeshShuffle { link, failed: None };
    if mesh.me() != c.part {
        anyhow::bail!(
            "worker {} was asked to cut part {} with the other workers, which cuts the part of its rank",
            mesh.me(),
            c.part
        );
    }
    let cut = cut_part_shuffled(&c.dataset, &c.assignment, &c.out, &mut mesh);
    let context = || {
        format!(
            "cutting part {} of {} with the other workers",
            c.part,
            c.dataset.display()
        )
    };
    match (cut, mesh.failed) {
        (Ok(done), _) => Ok(done),
        (Err(_), Some(wire)) => Err(anyhow::Error::new(physalia_gnn::Error::Exchange(Box::new(
            wire,
        ))))
        .with_context(context),
        (Err(e), None) => Err(e).with_context(context),
    }
}
