//! The next partitioning of an in-place resize (issue 33), made while the job trains: a launch's owner
//! (node -> rank) is fixed while it trains, so after its first recorded epoch, a background thread per
//! worker count the policy may choose next cuts that count's partitioning (the set stored for it, or one
//! computed by the job's partitioner, its parts
//! matched to the current ranks by overlap: [`overlapping_owner`]) and writes one part delta per rank
//! (`physalia_worker::delta`: the rows the rank gains, the rows it gives up, its new halo bookkeeping),
//! checksummed for serving. The resize's pause then only pauses, hands over and loads: it takes the
//! prepared deltas (waiting for the thread if it has not finished, cutting them itself if the count was
//! not foreseen).
//!
//! Deltas, not part files: a survivor keeps the rows it holds, so it is sent only the rows it gains;
//! a joiner's delta carries its whole part. The bytes a resize moves are the deltas' sizes.
//!
//! When the job's model keeps its first layer's input halo (input dropout: the features' halo rows are
//! fetched once per launch), each delta also carries the rows of its rank's new halo the rank will not
//! hold (`physalia_worker::delta::lacking_halo`: a joiner's whole halo, a shrink's survivor's rows from the
//! leavers' parts), so the workers seed their input halo with them instead of fetching them from their
//! peers in the pause. Counted apart: they are no rows that change owner, and without them the first
//! epoch after the resize fetches the same rows over the mesh.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{Context, Result};
use physalia_control::Files;

/// A resize's partitioning, made and written: one delta file per rank of the new count.
#[derive(Debug)]
pub struct Prepared {
    pub k: usize,
    /// Node -> rank of the new partitioning.
    pub owner: Vec<u32>,
    /// By rank.
    pub deltas: Vec<PathBuf>,
    /// Rows that change owner.
    pub moved: usize,
    /// Their feature bytes.
    pub moved_feature_bytes: u64,
    /// What the deltas carry: the gained rows (features, in-neighbour lists, labels, splits, ids) and
    /// the bookkeeping (lost rows' ids, halo ids and degrees, receive and send lists); the files' sizes.
    pub row_bytes: u64,
    pub bookkeeping_bytes: u64,
    /// The input halo's rows the deltas carry (ids and features; 0 unless [`Input::input_halo`]).
    pub halo_bytes: u64,
    pub file_bytes: u64,
    /// Seconds it took to make, and where they went (stage, seconds).
    pub seconds: f64,
    pub stages: Vec<(&'static str, f64)>,
    /// The new partitioning's undirected cut edges, their share of all, and its balance.
    pub edge_cut: usize,
    pub cut_fraction: f64,
    pub balance: f64,
}

/// What making a resize's partitioning needs; owned, so that a thread can take it.
#[derive(Clone)]
pub struct Input {
    pub dataset: PathBuf,
    pub seed: u64,
    /// How a missing set for the new count is computed (the job's partitioner); a stored one is reused.
    pub method: physalia_graph::partition::PartitionMethod,
    /// Node -> rank of the launch that trains now.
    pub owner: Arc<Vec<u32>>,
    pub k_old: usize,
    /// What the deltas are served under (checksummed here, out of the pause).
    pub files: Files,
    /// The artifacts' names: `part-<tag>-<rank>`.
    pub tag: String,
    /// Whether the job's model keeps its first layer's input halo (then each delta carries the rows of
    /// it its rank will not hold).
    pub input_halo: bool,
}

/// Cuts the partitioning for `k_new` workers that overlaps `input.owner` and writes its deltas into `dir`.
pub fn prepare(input: &Input, k_new: usize, dir: &Path) -> Result<Prepared> {
    let t = Instant::now();
    let mut stages = Vec::new();
    let mut lap = Instant::now();
    let mut stage = |name: &'static str| {
        stages.push((name, lap.elapsed().as_secs_f64()));
        lap = Instant::now();
    };
    let Input {
        dataset,
        seed,
        method,
        owner,
        k_old,
        files,
        tag,
        input_halo,
    } = input;
    let sets =
        physalia_graph::partition::ensure_partitions_reusing(dataset, &[k_new], *seed, method)
            .with_context(|| format!("partitioning into {k_new} parts"))?;
    let set = sets.into_iter().next().expect("one set per k");
    // the graph's undirected edges, the cut fraction's denominator, as the set recorded them
    let undirected = set.meta.num_undirected_edges;
    let target = set.partitioning()?;
    let new_owner = overlapping_owner(owner, *k_old, &target.parts, k_new);
    drop(target);
    stage("the set read");
    // checksums were verified when the job loaded the dataset
    let ds = physalia_graph::Dataset::open_unverified(dataset)
        .with_context(|| format!("opening {}", dataset.display()))?;
    let p = in_place_partitioning(&ds, k_new, new_owner, *seed)?;
    stage("matched");
    let parts = physalia_graph::partition::build_parts(&ds, &p)?;
    stage("parts built");
    let feature_row_bytes = (ds.meta().feat_dim * ds.features().dtype().size_bytes()) as u64;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut prepared = Prepared {
        k: k_new,
        owner: Vec::new(),
        deltas: Vec::with_capacity(k_new),
        moved: owner.iter().zip(&p.parts).filter(|(a, b)| a != b).count(),
        moved_feature_bytes: 0,
        row_bytes: 0,
        bookkeeping_bytes: 0,
        halo_bytes: 0,
        file_bytes: 0,
        seconds: 0.0,
        stages: Vec::new(),
        edge_cut: p.edge_cut,
        cut_fraction: if undirected == 0 {
            0.0
        } else {
            p.edge_cut as f64 / undirected as f64
        },
        balance: p.balance,
    };
    prepared.moved_feature_bytes = prepared.moved as u64 * feature_row_bytes;
    for part in &parts {
        let mut delta = physalia_worker::delta::diff(owner, &p.parts, part);
        stage("deltas cut");
        // alone a worker has no halo; with peers, its old model kept the old part's halo rows
        if *input_halo && k_new > 1 {
            let lacking = physalia_worker::delta::lacking_halo(owner, ds.csr(), part, *k_old > 1);
            delta.carry_halo_rows(lacking, ds.features())?;
            stage("halo rows gathered");
        }
        let path = dir.join(format!("delta{}.bin", part.part));
        let bytes = delta
            .write(&path)
            .with_context(|| format!("writing {}", path.display()))?;
        stage("written");
        prepared.row_bytes += bytes.rows;
        prepared.bookkeeping_bytes += bytes.bookkeeping;
        prepared.halo_bytes += bytes.halo;
        prepared.file_bytes += bytes.file;
        // the checksum the artifact carries, computed now rather than in the pause
        files
            .serve(&format!("part-{tag}-{}", part.part), &path)
            .with_context(|| format!("serving {}", path.display()))?;
        stage("checksummed");
        prepared.deltas.push(path);
    }
    drop(parts);
    prepared.owner = p.parts;
    // each stage's seconds summed over the parts, in the order they first came
    for (name, s) in stages {
        match prepared.stages.iter_mut().find(|(n, _)| *n == name) {
            Some((_, total)) => *total += s,
            None => prepared.stages.push((name, s)),
        }
    }
    prepared.seconds = t.elapsed().as_secs_f64();
    Ok(prepared)
}

/// Cuts part `rank` of the partitioning `owner` (node -> rank, `k` parts) from the dataset and writes it
/// to `path`: the part of a lost worker whose partitioning an in-place resize made (no stored set has
/// it), for its replacement.
pub fn cut_part(
    dataset: &Path,
    seed: u64,
    owner: &[u32],
    k: usize,
    rank: usize,
    path: &Path,
) -> Result<()> {
    // checksums were verified when the job loaded the dataset
    let ds = physalia_graph::Dataset::open_unverified(dataset)
        .with_context(|| format!("opening {}", dataset.display()))?;
    let p = in_place_partitioning(&ds, k, owner.to_vec(), seed)?;
    let part = physalia_graph::partition::build_parts(&ds, &p)?
        .into_iter()
        .nth(rank)
        .with_context(|| format!("the partitioning has no part {rank}"))?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    part.write(path)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The partitioning `owner` (node -> rank, `k` parts) of `ds`, its cut counted without reverse lookups
/// when the graph is undirected.
fn in_place_partitioning(
    ds: &physalia_graph::Dataset,
    k: usize,
    owner: Vec<u32>,
    seed: u64,
) -> Result<physalia_graph::partition::Partitioning> {
    use physalia_graph::partition::Partitioning;
    let csr = ds.csr();
    Ok(match ds.meta().directed {
        true => Partitioning::from_assignment(csr, k, owner, "in-place", seed)?,
        false => Partitioning::from_symmetric_assignment(csr, k, owner, "in-place", seed)?,
    })
}

/// Whose turn it is: a preparation holds its [`Turn`] while it works and lets it go when it is done,
/// and the next one waits for that before it starts.
pub struct Turn(std::sync::mpsc::Receiver<()>);

/// A resize's partitioning being made on a thread of its own.
pub struct Preparing {
    pub k: usize,
    handle: Option<JoinHandle<Result<Prepared>>>,
    /// What the thread made, once [`Preparing::made`] saw it done.
    result: Option<Result<Prepared>>,
    /// Set when the resize went elsewhere: the thread removes what it wrote.
    unused: Arc<AtomicBool>,
    pub dir: PathBuf,
}

impl Preparing {
    /// Starts making the partitioning for `k_new` workers into `dir` once the preparation holding
    /// `after` is done: one at a time, the most likely count first. Cutting the counts at once would
    /// share the cores (on a cloud the coordinator has one vCPU) and delay the likeliest, which the
    /// next resize waits for, to about when the last is made; one that is no longer wanted when its
    /// turn comes is not made. Returns it and the turn the next one waits for.
    pub fn start(
        input: Input,
        k_new: usize,
        dir: PathBuf,
        after: Option<Turn>,
    ) -> (Preparing, Turn) {
        let unused = Arc::new(AtomicBool::new(false));
        let (flag, out) = (unused.clone(), dir.clone());
        let (done, next) = std::sync::mpsc::channel::<()>();
        let handle = std::thread::Builder::new()
            .name(format!("prepare-k{k_new}"))
            .spawn(move || {
                // the sender goes when this thread ends, which is what the next one waits for
                let _done = done;
                if let Some(Turn(before)) = after {
                    // Err: the one before is done (its sender dropped)
                    let _ = before.recv();
                }
                if flag.load(Ordering::SeqCst) {
                    anyhow::bail!("the resize went elsewhere before this partitioning's turn");
                }
                let made = prepare(&input, k_new, &out);
                if flag.load(Ordering::SeqCst) {
                    let _ = std::fs::remove_dir_all(&out);
                }
                made
            })
            .ok();
        let preparing = Preparing {
            k: k_new,
            handle,
            result: None,
            unused,
            dir,
        };
        (preparing, Turn(next))
    }

    /// The partitioning, once the thread made it (waiting for it if it has not).
    pub fn wait(mut self) -> Result<Prepared> {
        if let Some(made) = self.result.take() {
            return made;
        }
        // taken: nothing of it is removed on drop
        match self.handle.take() {
            Some(h) => h
                .join()
                .map_err(|_| anyhow::anyhow!("preparing the partitioning panicked"))?,
            None => anyhow::bail!("the thread preparing the partitioning could not start"),
        }
    }

    /// The partitioning if the thread is done and made it (without waiting): what the resize to `k` would
    /// take, known before it (its deltas can be fetched ahead by the workers that will apply them).
    pub fn made(&mut self) -> Option<&Prepared> {
        if self.result.is_none() && self.handle.as_ref().is_some_and(JoinHandle::is_finished) {
            let h = self.handle.take().expect("checked above");
            self.result = Some(
                h.join()
                    .map_err(|_| anyhow::anyhow!("preparing the partitioning panicked"))
                    .and_then(|r| r),
            );
        }
        self.result.as_ref().and_then(|r| r.as_ref().ok())
    }

    /// Whether the thread is done.
    pub fn is_ready(&self) -> bool {
        self.handle.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

impl Drop for Preparing {
    /// Not used: what it wrote goes (now if the thread is done, else when it is).
    fn drop(&mut self) {
        // still running, or done and not taken (what it wrote, whole or in part, goes)
        if self.handle.is_some() || self.result.is_some() {
            self.unused.store(true, Ordering::SeqCst);
            if self.is_ready() {
                let _ = std::fs::remove_dir_all(&self.dir);
            }
        }
    }
}

/// Where each node goes when `k_old` parts (`owner`, node -> rank) become `k_new`, given a good
/// partitioning into `k_new` parts (`metis`, node -> part). The parts of `metis` are matched to ranks
/// by how many nodes they share with the survivors' parts (largest overlap first); joiners take the
/// parts left. A node stays with its survivor unless its matched part is a joiner's; a leaver's node
/// goes to its matched part. So a shrink moves only the leavers' rows and a growth only the joiners'.
pub fn overlapping_owner(owner: &[u32], k_old: usize, metis: &[u32], k_new: usize) -> Vec<u32> {
    let keep = k_old.min(k_new);
    let mut overlap = vec![vec![0usize; k_old]; k_new];
    for (&o, &m) in owner.iter().zip(metis) {
        overlap[m as usize][o as usize] += 1;
    }
    let mut pairs: Vec<(usize, usize, usize)> = (0..k_new)
        .flat_map(|m| (0..keep).map(move |r| (m, r)))
        .map(|(m, r)| (overlap[m][r], m, r))
        .collect();
    // largest overlap first; ties in part and rank order, so the choice is deterministic
    pairs.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut rank_of = vec![None; k_new];
    let mut taken = vec![false; keep];
    for (_, m, r) in pairs {
        if rank_of[m].is_none() && !taken[r] {
            rank_of[m] = Some(r);
            taken[r] = true;
        }
    }
    let mut joiner = keep;
    let rank_of: Vec<u32> = rank_of
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                joiner += 1;
                joiner - 1
            }) as u32
        })
        .collect();
    owner
        .iter()
        .zip(metis)
        .map(|(&o, &m)| {
            let matched = rank_of[m as usize];
            if o as usize >= k_new || matched as usize >= k_old {
                matched
            } else {
                o
            }
        })
        .collect()
}
