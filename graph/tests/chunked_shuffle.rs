//! Parts cut by shuffle (`chunked_shuffle`): `k` workers, each reading `1/k` of a chunked dataset and
//! sending every row to its owner, build exactly the parts `build_parts` cuts from the loaded dataset;
//! together they read every chunk file once; a lost record is an error, never a wrong part.

use std::sync::mpsc::{Receiver, Sender, channel};

use physalia_graph::chunked::{ChunkedDataset, write_chunked};
use physalia_graph::chunked_partition::{begin_set_chunked, partition_chunked};
use physalia_graph::chunked_shuffle::{
    Shuffle, ShuffleStats, chunks_read_by, cut_part_shuffled, shuffle_part,
};
use physalia_graph::partition::{Part, Partitioning, build_parts};
use physalia_graph::stream::StreamParams;
use physalia_graph::synth::sbm;
use physalia_graph::{Error, FeatureDtype, SbmParams};

type Message = (u16, u32, Vec<u8>);

/// `k` workers' all-to-all over channels, one thread each and one channel per ordered pair, as a mesh
/// has one stream per peer: a worker that returned (done or failed) drops its ends, and a peer waiting
/// for it gets an error, as over a real mesh. `drop_to` loses every rows record (stage 1) sent to that
/// worker by the next one.
struct ChannelShuffle {
    me: usize,
    to: Vec<Option<Sender<Message>>>,
    from: Vec<Option<Receiver<Message>>>,
    drop_to: Option<usize>,
}

fn mesh(k: usize, drop_to: Option<usize>) -> Vec<ChannelShuffle> {
    let mut to: Vec<Vec<Option<Sender<Message>>>> =
        (0..k).map(|_| (0..k).map(|_| None).collect()).collect();
    let mut from: Vec<Vec<Option<Receiver<Message>>>> =
        (0..k).map(|_| (0..k).map(|_| None).collect()).collect();
    for a in 0..k {
        for b in (0..k).filter(|&b| b != a) {
            let (tx, rx) = channel();
            to[a][b] = Some(tx);
            from[b][a] = Some(rx);
        }
    }
    to.into_iter()
        .zip(from)
        .enumerate()
        .map(|(me, (to, from))| ChannelShuffle {
            me,
            to,
            from,
            drop_to,
        })
        .collect()
}

impl Shuffle for ChannelShuffle {
    fn me(&self) -> usize {
        self.me
    }

    fn k(&self) -> usize {
        self.to.len()
    }

    fn all_to_all(
        &mut self,
        stage: u16,
        round: u32,
        mut out: Vec<Vec<u8>>,
    ) -> Result<Vec<Vec<u8>>, Error> {
        let k = self.to.len();
        let gone = |q: usize| Error::Partition {
            problem: format!("worker {q} is gone"),
        };
        let mut got = vec![Vec::new(); k];
        got[self.me] = std::mem::take(&mut out[self.me]);
        for (q, bytes) in out.into_iter().enumerate().filter(|(q, _)| *q != self.me) {
            let lost = stage == 1 && self.drop_to == Some(q) && self.me == (q + 1) % k;
            let bytes = if lost { Vec::new() } else { bytes };
            let tx = self.to[q].as_ref().expect("a sender to every peer");
            tx.send((stage, round, bytes)).map_err(|_| gone(q))?;
        }
        for (q, slot) in got.iter_mut().enumerate().filter(|(q, _)| *q != self.me) {
            let rx = self.from[q].as_ref().expect("a receiver from every peer");
            let (s, r, bytes) = rx.recv().map_err(|_| gone(q))?;
            assert_eq!((s, r), (stage, round), "worker {q} is in step");
            *slot = bytes;
        }
        Ok(got)
    }
}

fn shuffled(
    ds: &ChunkedDataset,
    p: &Partitioning,
    drop_to: Option<usize>,
) -> Vec<Result<(Part, ShuffleStats), Error>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = mesh(p.k, drop_to)
            .into_iter()
            .map(|mut sh| s.spawn(move || shuffle_part(ds, p, &mut sh)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Three and four workers over six chunks (the last round leaves two of four idle), f32 and bf16
/// features: every part equals build_parts', every chunk file is read once in all.
#[test]
fn parts_cut_by_shuffle_equal_build_parts_and_read_the_dataset_once() {
    let tmp = tempfile::tempdir().unwrap();
    for (k, dtype) in [
        (3, FeatureDtype::F32),
        (4, FeatureDtype::BF16),
        (1, FeatureDtype::F32),
    ] {
        let mem = sbm(&SbmParams {
            num_nodes: 3000,
            avg_degree: 8.0,
            feat_dim: 16,
            seed: 9,
            ..SbmParams::default()
        })
        .unwrap()
        .convert_features(dtype);
        let dir = tmp.path().join(format!("sbm-{k}"));
        write_chunked(&mem, &dir, 512).unwrap();
        let ds = ChunkedDataset::open(&dir).unwrap();
        assert_eq!(ds.manifest().num_chunks(), 6);
        let p = partition_chunked(&ds, &StreamParams::new(k))
            .unwrap()
            .partitioning;
        let want = build_parts(&mem, &p).unwrap();
        let got = shuffled(&ds, &p, None);
        let mut read = 0;
        for (me, r) in got.into_iter().enumerate() {
            let (part, stats) = r.unwrap();
            assert_eq!(part, want[me], "k {k}: part {me}");
            read += stats.read_bytes;
            if k > 1 {
                assert!(
                    stats.sent_bytes > 0 && stats.received_bytes > 0,
                    "{stats:?}"
                );
            }
        }
        assert_eq!(
            read,
            ds.manifest().data_bytes(),
            "k {k}: every chunk read once in all"
        );
        // the files each worker reads, which a worker away from the dataset's disk fetches: every one
        // is some worker's, once
        let mut files: Vec<&str> = (0..k)
            .flat_map(|me| chunks_read_by(ds.manifest(), me, k))
            .map(|c| c.file.as_str())
            .collect();
        let n_files = files.len();
        files.sort_unstable();
        files.dedup();
        assert_eq!(files.len(), n_files, "k {k}: no file read twice");
        let all: usize = ds
            .manifest()
            .tensors
            .all()
            .iter()
            .map(|(_, t)| t.chunks.len())
            .sum();
        assert_eq!(n_files, all, "k {k}: every file read");
    }
}

/// The pending assignment on disk, cut by shuffle and written: the file holds the part; a worker whose
/// records from a peer were lost fails naming the rows that never came, and its part is not written.
#[test]
fn a_pending_set_cut_by_shuffle_is_written_and_a_lost_record_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let mem = sbm(&SbmParams {
        num_nodes: 2000,
        avg_degree: 8.0,
        feat_dim: 16,
        seed: 3,
        ..SbmParams::default()
    })
    .unwrap();
    let dir = tmp.path().join("sbm");
    write_chunked(&mem, &dir, 300).unwrap();
    let pending = begin_set_chunked(&dir, 2, 0, &StreamParams::new(2)).unwrap();
    let (_, p) = physalia_graph::partition::load_assignment(&pending.assignment).unwrap();
    let want = build_parts(&mem, &p).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = mesh(2, None)
            .into_iter()
            .map(|mut sh| {
                let (dir, pending) = (&dir, &pending);
                s.spawn(move || {
                    let out = &pending.part_files[sh.me];
                    cut_part_shuffled(dir, &pending.assignment, out, &mut sh)
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap().unwrap();
        }
    });
    for (me, f) in pending.part_files.iter().enumerate() {
        assert_eq!(Part::load(f).unwrap(), want[me]);
    }
    // a retried launch (the set was never committed) keeps the assignment and the parts written: the
    // workers cut again, to train, but nothing is written twice
    let modified = |f: &std::path::Path| std::fs::metadata(f).unwrap().modified().unwrap();
    let before: Vec<_> = pending.part_files.iter().map(|f| modified(f)).collect();
    let assigned = modified(&pending.assignment);
    std::thread::sleep(std::time::Duration::from_millis(20));
    let again = begin_set_chunked(&dir, 2, 0, &StreamParams::new(2)).unwrap();
    assert!(again.resumed && !pending.resumed);
    assert_eq!(
        modified(&again.assignment),
        assigned,
        "the assignment is not made again"
    );
    let wrote: Vec<bool> = std::thread::scope(|s| {
        let hs: Vec<_> = mesh(2, None)
            .into_iter()
            .map(|mut sh| {
                let (dir, again, want) = (&dir, &again, &want);
                s.spawn(move || {
                    let out = &again.part_files[sh.me];
                    let (part, stats) =
                        cut_part_shuffled(dir, &again.assignment, out, &mut sh).unwrap();
                    assert_eq!(part, want[sh.me]);
                    stats.wrote
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(wrote, [false, false]);
    let after: Vec<_> = again.part_files.iter().map(|f| modified(f)).collect();
    assert_eq!(after, before, "no part file written twice");
    // the set records what was read to make it: the assignment's passes over the edges, the commit's
    // one, and the workers' cut, which read every chunk file once
    let (pending_meta, _) = physalia_graph::partition::load_assignment(&again.assignment).unwrap();
    let assigning = pending_meta.bytes_read.unwrap();
    let m = ChunkedDataset::open(&dir).unwrap().manifest().clone();
    let edges: u64 = [&m.tensors.indptr, &m.tensors.indices]
        .iter()
        .flat_map(|t| &t.chunks)
        .map(|c| c.bytes)
        .sum();
    assert!(
        assigning >= edges,
        "the assignment streams the edges at least once"
    );
    let meta = again.commit().unwrap();
    assert_eq!(meta.bytes_read, Some(assigning + edges + m.data_bytes()));
    // another seed is another set; a new assignment for this one (the dataset rewritten) removes the
    // parts of the old one, so none of them passes for the new assignment's
    write_chunked(&mem, &dir, 300).unwrap();
    let fresh = begin_set_chunked(&dir, 2, 0, &StreamParams::new(2)).unwrap();
    assert!(!fresh.resumed);
    assert!(fresh.part_files.iter().all(|f| !f.exists()));
    let ds = ChunkedDataset::open(&dir).unwrap();
    let got = shuffled(&ds, &p, Some(0));
    let err = got[0].as_ref().unwrap_err().to_string();
    assert!(err.contains("never arrived"), "{err}");
    // worker 1 finished its rows but then waited for worker 0, which stopped there
    let err = got[1].as_ref().unwrap_err().to_string();
    assert!(err.contains("worker 0 is gone"), "{err}");
}
