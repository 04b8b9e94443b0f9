//! Neighbour sampler and prefetching loader: exact neighbourhoods against a plain BFS reference, the
//! properties of sampled rows, the layout invariants the engine relies on, uniformity of the draws,
//! determinism independent of the loader's thread count, and that splitting a batch changes no seed's
//! sampled neighbourhood.

use std::collections::HashSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;

use physalia_graph::sample::{
    MiniBatch, Sampler, Scratch, batch_key, with_prefetch, with_prefetch_keyed,
};
use physalia_graph::synth::{rmat, sbm};
use physalia_graph::{Csr, OwnedDataset, RmatParams, SbmParams};

fn sbm_graph(n: usize, seed: u64) -> OwnedDataset {
    sbm(&SbmParams {
        num_nodes: n,
        avg_degree: 12.0,
        feat_dim: 0,
        feature_signal: 0.0,
        seed,
        ..Default::default()
    })
    .unwrap()
}

/// A skewed graph: hubs with hundreds of neighbours exercise the large fan-out path.
fn rmat_graph() -> OwnedDataset {
    rmat(&RmatParams {
        scale: 11,
        edge_factor: 16,
        feat_dim: 0,
        feature_signal: 0.0,
        seed: 3,
        ..Default::default()
    })
    .unwrap()
}

/// `count` distinct node ids spread over the graph, in a scrambled order.
fn seeds(n: usize, count: usize, salt: u64) -> Vec<u32> {
    let mut picked = HashSet::new();
    let mut out = Vec::new();
    let mut x = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while out.len() < count {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = (x % n as u64) as u32;
        if picked.insert(v) {
            out.push(v);
        }
    }
    out
}

/// The obvious implementation of a full (unsampled) L-hop computation graph in the same layout.
fn bfs_reference(csr: Csr<'_>, seeds: &[u32], layers: usize) -> MiniBatch {
    let mut nodes: Vec<u32> = seeds.to_vec();
    let mut local: std::collections::HashMap<u32, usize> =
        seeds.iter().enumerate().map(|(i, &s)| (s, i)).collect();
    let mut blocks = Vec::new();
    for _ in 0..layers {
        let n_dst = nodes.len();
        let mut indptr = vec![0i64];
        let mut indices = Vec::new();
        for i in 0..n_dst {
            let mut row: Vec<i32> = csr
                .neighbors(nodes[i] as usize)
                .iter()
                .map(|&u| {
                    let next = nodes.len();
                    let l = *local.entry(u as u32).or_insert(next);
                    if l == next {
                        nodes.push(u as u32);
                    }
                    l as i32
                })
                .collect();
            row.sort();
            indices.extend(row);
            indptr.push(indices.len() as i64);
        }
        blocks.push(physalia_graph::sample::Block {
            n_dst,
            n_src: nodes.len(),
            indptr,
            indices,
        });
    }
    blocks.reverse();
    MiniBatch { nodes, blocks }
}

/// Every structural invariant of a batch, and that each row is a correctly sized subset of the true
/// in-neighbourhood. Returns the number of rows that were subsampled (deg > fan-out).
fn check_batch(csr: Csr<'_>, fanouts: &[Option<u32>], seeds: &[u32], mb: &MiniBatch) -> usize {
    let l = fanouts.len();
    assert_eq!(mb.blocks.len(), l);
    assert_eq!(mb.seeds(), seeds);
    assert_eq!(&mb.nodes[..seeds.len()], seeds);
    assert_eq!(mb.input_nodes(), &mb.nodes[..]);
    assert_eq!(
        mb.nodes.iter().collect::<HashSet<_>>().len(),
        mb.nodes.len(),
        "nodes are distinct"
    );
    assert_eq!(mb.blocks[l - 1].n_dst, seeds.len());
    assert_eq!(mb.blocks[0].n_src, mb.nodes.len());
    for w in mb.blocks.windows(2) {
        assert_eq!(w[1].n_src, w[0].n_dst, "blocks chain");
    }
    let mut subsampled = 0;
    for (idx, block) in mb.blocks.iter().enumerate() {
        // blocks[idx] was drawn at hop L - idx with fanouts[L - 1 - idx].
        let fanout = fanouts[l - 1 - idx];
        assert!(block.n_dst <= block.n_src);
        assert_eq!(block.indptr.len(), block.n_dst + 1);
        assert_eq!(block.indptr[0], 0);
        assert_eq!(*block.indptr.last().unwrap() as usize, block.indices.len());
        // New sources (n_dst..n_src) get their local ids in order of first appearance, row by row.
        let mut next_new = block.n_dst;
        let mut seen_new = HashSet::new();
        for i in 0..block.n_dst {
            let row = &block.indices[block.indptr[i] as usize..block.indptr[i + 1] as usize];
            assert!(
                row.windows(2).all(|p| p[0] < p[1]),
                "row {i} strictly ascending"
            );
            assert!(row.iter().all(|&x| x >= 0 && (x as usize) < block.n_src));
            let truth = csr.neighbors(mb.nodes[i] as usize);
            let expect_len = match fanout {
                Some(f) => truth.len().min(f as usize),
                None => truth.len(),
            };
            assert_eq!(row.len(), expect_len, "row {i} of block {idx}");
            subsampled += (row.len() < truth.len()) as usize;
            for &x in row {
                let g = mb.nodes[x as usize] as i32;
                assert!(truth.binary_search(&g).is_ok(), "{g} is not a neighbour");
            }
            let mut fresh: Vec<usize> = row
                .iter()
                .map(|&x| x as usize)
                .filter(|&x| x >= block.n_dst && seen_new.insert(x))
                .collect();
            fresh.sort();
            let expect: Vec<usize> = (next_new..next_new + fresh.len()).collect();
            assert_eq!(fresh, expect, "first appearances in row {i} of block {idx}");
            next_new += fresh.len();
        }
        assert_eq!(next_new, block.n_src, "every new source is reached");
    }
    subsampled
}

#[test]
fn full_fanout_reproduces_exact_neighbourhoods() {
    let ds = sbm_graph(3000, 1);
    let csr = ds.csr();
    let mut scratch = Scratch::new(csr.num_nodes());
    for layers in 1..=3 {
        let fanouts = vec![None; layers];
        let sampler = Sampler::new(csr.indptr, csr.indices, &fanouts).unwrap();
        for (salt, count) in [(1, 1), (2, 17), (3, 200)] {
            let s = seeds(csr.num_nodes(), count, salt);
            let mb = sampler.sample(&s, 99, &mut scratch);
            assert_eq!(mb, bfs_reference(csr, &s, layers), "layers {layers}");
            check_batch(csr, &fanouts, &s, &mb);
        }
    }
}

#[test]
fn a_fanout_at_least_the_max_degree_equals_none() {
    let ds = sbm_graph(2000, 2);
    let csr = ds.csr();
    let max_deg = csr.degrees().into_iter().max().unwrap() as u32;
    let s = seeds(csr.num_nodes(), 64, 5);
    let mut scratch = Scratch::new(0); // grows on first use
    let full = Sampler::new(csr.indptr, csr.indices, &[None, None]).unwrap();
    let capped = Sampler::new(csr.indptr, csr.indices, &[Some(max_deg), Some(max_deg)]).unwrap();
    assert_eq!(
        capped.sample(&s, 1, &mut scratch),
        full.sample(&s, 2, &mut scratch)
    );
}

#[test]
fn sampled_rows_are_sorted_distinct_subsets_of_the_right_size() {
    let ds = sbm_graph(5000, 3);
    let csr = ds.csr();
    let mut scratch = Scratch::new(csr.num_nodes());
    for fanouts in [
        vec![Some(5), Some(3)],
        vec![Some(1)],
        vec![Some(10), None, Some(4)],
    ] {
        let sampler = Sampler::new(csr.indptr, csr.indices, &fanouts).unwrap();
        for key in 0..5 {
            let s = seeds(csr.num_nodes(), 300, key + 10);
            let mb = sampler.sample(&s, key, &mut scratch);
            let subsampled = check_batch(csr, &fanouts, &s, &mb);
            assert!(subsampled > 0, "the test exercises subsampling");
        }
    }

    // Hubs with a fan-out above the linear-scan limit take the hashed path.
    let ds = rmat_graph();
    let csr = ds.csr();
    assert!(csr.degrees().into_iter().max().unwrap() > 200);
    let fanouts = [Some(40), Some(100), Some(2)];
    let sampler = Sampler::new(csr.indptr, csr.indices, &fanouts).unwrap();
    let mut scratch = Scratch::new(csr.num_nodes());
    for key in 0..3 {
        let s = seeds(csr.num_nodes(), 100, key + 20);
        let mb = sampler.sample(&s, key, &mut scratch);
        assert!(check_batch(csr, &fanouts, &s, &mb) > 0);
    }
}

#[test]
fn self_loops_are_ordinary_neighbours() {
    // In-neighbours: 0 <- {0, 1}, 1 <- {2}, 2 <- {}.
    let indptr = [0i64, 2, 3, 3];
    let indices = [0i32, 1, 2];
    let sampler = Sampler::new(&indptr, &indices, &[None, None]).unwrap();
    let mb = sampler.sample(&[0], 0, &mut Scratch::new(3));
    assert_eq!(mb.nodes, vec![0, 1, 2]);
    let seeds_block = &mb.blocks[1];
    assert_eq!((seeds_block.n_dst, seeds_block.n_src), (1, 2));
    assert_eq!(seeds_block.indices, vec![0, 1]);
    let input_block = &mb.blocks[0];
    assert_eq!((input_block.n_dst, input_block.n_src), (2, 3));
    assert_eq!(input_block.indptr, vec![0, 2, 3]);
    assert_eq!(input_block.indices, vec![0, 1, 2]);
    assert_eq!(mb.num_edges(), 5);
}

#[test]
fn draws_are_uniform_without_replacement() {
    // A star: node 0's in-neighbours are 1..=deg. Over many keys each neighbour should be drawn with
    // probability fanout / deg; checked for both the linear-scan and the hashed path.
    for (deg, fanout) in [(10u32, 3u32), (12, 11), (100, 40)] {
        let indptr: Vec<i64> = std::iter::once(0)
            .chain(std::iter::repeat_n(deg as i64, deg as usize + 1))
            .collect();
        let indices: Vec<i32> = (1..=deg as i32).collect();
        let sampler = Sampler::new(&indptr, &indices, &[Some(fanout)]).unwrap();
        let mut scratch = Scratch::new(deg as usize + 1);
        let trials = 20_000;
        let mut counts = vec![0u32; deg as usize + 1];
        for key in 0..trials {
            let mb = sampler.sample(&[0], key, &mut scratch);
            let block = &mb.blocks[0];
            assert_eq!(block.indices.len(), fanout as usize);
            for &x in &block.indices {
                counts[mb.nodes[x as usize] as usize] += 1;
            }
        }
        let p = fanout as f64 / deg as f64;
        let sd = (trials as f64 * p * (1.0 - p)).sqrt();
        for (v, &c) in counts.iter().enumerate().skip(1) {
            let z = (c as f64 - trials as f64 * p) / sd.max(1.0);
            assert!(
                z.abs() < 5.0,
                "deg {deg} fanout {fanout}: neighbour {v} drawn {c} times, z = {z:.1}"
            );
        }
    }
}

#[test]
fn same_key_same_batch_other_key_other_batch() {
    let ds = sbm_graph(4000, 4);
    let csr = ds.csr();
    let sampler = Sampler::new(csr.indptr, csr.indices, &[Some(4), Some(3)]).unwrap();
    let s = seeds(csr.num_nodes(), 256, 7);
    let mut used = Scratch::new(csr.num_nodes());
    let a = sampler.sample(&s, 42, &mut used);
    // A scratch that has seen other batches gives the same result as a fresh one.
    for key in 0..10 {
        sampler.sample(&seeds(csr.num_nodes(), 300, key), key, &mut used);
    }
    let b = sampler.sample(&s, 42, &mut used);
    let c = sampler.sample(&s, 42, &mut Scratch::new(csr.num_nodes()));
    assert_eq!(a, b);
    assert_eq!(a, c);
    assert_ne!(a, sampler.sample(&s, 43, &mut used));
}

/// Per hop (seeds' hop first), every destination's sampled in-neighbours as global ids, sorted.
fn rows_by_hop(mb: &MiniBatch) -> Vec<std::collections::BTreeMap<u32, Vec<u32>>> {
    mb.blocks
        .iter()
        .rev()
        .map(|b| {
            (0..b.n_dst)
                .map(|i| {
                    let row = &b.indices[b.indptr[i] as usize..b.indptr[i + 1] as usize];
                    let mut g: Vec<u32> = row.iter().map(|&x| mb.nodes[x as usize]).collect();
                    g.sort_unstable();
                    (mb.nodes[i], g)
                })
                .collect()
        })
        .collect()
}

/// A node's draw at a hop depends only on (key, hop, node): sampling seeds as one batch or split into
/// parts (any split, same key) gives every node each part reaches the same sampled row, and the parts
/// together reach exactly what the whole batch reaches. Data parallelism and P3 split a step's global
/// batch over workers on this.
#[test]
fn splitting_a_batch_gives_every_seed_the_same_neighbourhood() {
    let sbm = sbm_graph(4000, 8);
    let rmat = rmat_graph();
    let cases: [(&OwnedDataset, Vec<Option<u32>>); 3] = [
        (&sbm, vec![Some(5), Some(3)]),
        (&sbm, vec![Some(2), None, Some(4)]),
        // hubs take the hashed path
        (&rmat, vec![Some(40), Some(3)]),
    ];
    for (ds, fanouts) in cases {
        let csr = ds.csr();
        let sampler = Sampler::new(csr.indptr, csr.indices, &fanouts).unwrap();
        let mut scratch = Scratch::new(csr.num_nodes());
        for key in [3u64, 77] {
            let s = seeds(csr.num_nodes(), 240, key);
            let mb = sampler.sample(&s, key, &mut scratch);
            assert!(
                check_batch(csr, &fanouts, &s, &mb) > 0,
                "the test exercises subsampling"
            );
            let whole = rows_by_hop(&mb);
            // two halves, an uneven split, and one seed at a time for a few seeds
            let splits: Vec<Vec<&[u32]>> = vec![
                vec![&s[..120], &s[120..]],
                vec![&s[..7], &s[7..200], &s[200..]],
                s[..5].chunks(1).collect(),
            ];
            for parts in splits {
                let mut reached = vec![std::collections::BTreeSet::new(); fanouts.len()];
                for part in &parts {
                    // a scratch that sampled the whole batch (and others) gives the same rows
                    let mb = sampler.sample(part, key, &mut scratch);
                    check_batch(csr, &fanouts, part, &mb);
                    for (hop, rows) in rows_by_hop(&mb).into_iter().enumerate() {
                        for (v, row) in rows {
                            assert_eq!(
                                whole[hop].get(&v),
                                Some(&row),
                                "fan-outs {fanouts:?} key {key} hop {hop}: node {v} drew other in-neighbours \
                                 in a part of {} seeds",
                                part.len()
                            );
                            reached[hop].insert(v);
                        }
                    }
                }
                if parts.iter().map(|p| p.len()).sum::<usize>() == s.len() {
                    for (hop, r) in reached.iter().enumerate() {
                        assert!(
                            r.iter().eq(whole[hop].keys()),
                            "hop {hop}: the parts reach other nodes than the whole batch"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn sampler_rejects_bad_fanouts_and_graphs() {
    let indptr = [0i64, 1, 1];
    let indices = [1i32];
    let msg = |f: &[Option<u32>]| Sampler::new(&indptr, &indices, f).unwrap_err().to_string();
    assert!(msg(&[]).contains("'fanouts': is empty"), "{}", msg(&[]));
    let zero = msg(&[Some(3), Some(0)]);
    assert!(zero.contains("fan-out 1 is 0"), "{zero}");
    assert!(
        Sampler::new(&[], &indices, &[None])
            .unwrap_err()
            .to_string()
            .contains("'indptr': is empty")
    );
    assert!(
        Sampler::new(&[0, 2], &indices, &[None])
            .unwrap_err()
            .to_string()
            .contains("expected 0 to the length of indices (1)")
    );
}

#[test]
#[should_panic(expected = "seed 3 appears twice")]
fn duplicate_seeds_panic() {
    let indptr = [0i64, 0, 0, 0, 0];
    let sampler = Sampler::new(&indptr, &[], &[None]).unwrap();
    sampler.sample(&[1, 3, 0, 3], 0, &mut Scratch::new(4));
}

#[test]
#[should_panic(expected = "seed 9 is not a node of the graph (0..4)")]
fn out_of_range_seeds_panic() {
    let indptr = [0i64, 0, 0, 0, 0];
    let sampler = Sampler::new(&indptr, &[], &[None]).unwrap();
    sampler.sample(&[9], 0, &mut Scratch::new(4));
}

fn batches(n: usize, count: usize, size: usize) -> Vec<Vec<u32>> {
    let all = seeds(n, count * size, 77);
    all.chunks(size).map(|c| c.to_vec()).collect()
}

#[test]
fn loader_output_does_not_depend_on_threads_or_depth() {
    let ds = sbm_graph(6000, 5);
    let csr = ds.csr();
    let sampler = Sampler::new(csr.indptr, csr.indices, &[Some(5), Some(5)]).unwrap();
    let bs = batches(csr.num_nodes(), 23, 100);
    let mut scratch = Scratch::new(csr.num_nodes());
    let expect: Vec<(usize, MiniBatch)> = bs
        .iter()
        .enumerate()
        .map(|(b, s)| (b, sampler.sample(s, batch_key(9, b), &mut scratch)))
        .collect();
    for threads in [1, 2, 3, 8] {
        for depth in [1, 2, 5, 100] {
            let got = with_prefetch(
                &sampler,
                &bs,
                9,
                threads,
                depth,
                |b, mb| (b, mb),
                |it| it.collect::<Vec<_>>(),
            );
            assert!(got == expect, "threads {threads} depth {depth}");
        }
    }
    let other_key = with_prefetch(&sampler, &bs, 10, 2, 2, |_, mb| mb, |it| it.next());
    assert_ne!(other_key.as_ref(), Some(&expect[0].1));
    // No batches: the consumer sees an empty iterator.
    let none = with_prefetch(&sampler, &[], 9, 4, 2, |_, mb| mb, |it| it.count());
    assert_eq!(none, 0);
}

#[test]
fn loader_stops_when_the_consumer_stops_early() {
    let ds = sbm_graph(6000, 6);
    let csr = ds.csr();
    let sampler = Sampler::new(csr.indptr, csr.indices, &[Some(10), Some(10)]).unwrap();
    let bs = batches(csr.num_nodes(), 50, 100);
    let prepared = Mutex::new(0usize);
    let first = with_prefetch(
        &sampler,
        &bs,
        1,
        3,
        2,
        |b, mb| {
            *prepared.lock().unwrap() += 1;
            (b, mb.num_edges())
        },
        |it| it.take(2).map(|(b, _)| b).collect::<Vec<_>>(),
    );
    assert_eq!(first, vec![0, 1]);
    // At most `depth` batches ahead of the two consumed, plus one per thread that was mid-batch.
    let prepared = *prepared.lock().unwrap();
    assert!(prepared <= 2 + 2 + 3, "{prepared} batches prepared");

    // A consumer that panics also returns control (the panic propagates; no hang).
    let r = catch_unwind(AssertUnwindSafe(|| {
        with_prefetch(
            &sampler,
            &bs,
            1,
            2,
            3,
            |_, mb| mb,
            |it| {
                it.next();
                panic!("consumer gives up")
            },
        )
    }));
    assert!(r.is_err());
}

#[test]
fn loader_reraises_a_prepare_panic_in_order() {
    let ds = sbm_graph(3000, 7);
    let csr = ds.csr();
    let sampler = Sampler::new(csr.indptr, csr.indices, &[Some(3)]).unwrap();
    let bs = batches(csr.num_nodes(), 10, 50);
    let seen = Mutex::new(Vec::new());
    let r = catch_unwind(AssertUnwindSafe(|| {
        with_prefetch(
            &sampler,
            &bs,
            0,
            2,
            4,
            |b, _| {
                assert!(b != 4, "prepare failed on batch {b}");
                b
            },
            |it| {
                for b in it {
                    seen.lock().unwrap().push(b);
                }
            },
        )
    }));
    let payload = r.unwrap_err();
    let msg = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .unwrap_or("");
    assert!(msg.contains("prepare failed on batch 4"), "{msg}");
    assert_eq!(*seen.lock().unwrap(), vec![0, 1, 2, 3]);
}

#[test]
fn keyed_loader_samples_each_batch_with_its_own_key() {
    let ds = sbm_graph(3000, 9);
    let csr = ds.csr();
    let sampler = Sampler::new(csr.indptr, csr.indices, &[Some(4), Some(2)]).unwrap();
    let bs = batches(csr.num_nodes(), 9, 40);
    // three batches per key, as three workers' parts of one global batch
    let key = |b: usize| batch_key(5, b / 3);
    let mut scratch = Scratch::new(csr.num_nodes());
    let expect: Vec<MiniBatch> = bs
        .iter()
        .enumerate()
        .map(|(b, s)| sampler.sample(s, key(b), &mut scratch))
        .collect();
    for threads in [1, 3] {
        let got = with_prefetch_keyed(
            &sampler,
            &bs,
            key,
            threads,
            2,
            |_, mb| mb,
            |it| it.collect::<Vec<_>>(),
        );
        assert!(got == expect, "threads {threads}");
    }
    // with_prefetch is the keyed loader with batch_key(key_base, b)
    let plain = with_prefetch(
        &sampler,
        &bs,
        5,
        2,
        2,
        |_, mb| mb,
        |it| it.collect::<Vec<_>>(),
    );
    let keyed = with_prefetch_keyed(
        &sampler,
        &bs,
        |b| batch_key(5, b),
        2,
        2,
        |_, mb| mb,
        |it| it.collect::<Vec<_>>(),
    );
    assert!(plain == keyed);
}
