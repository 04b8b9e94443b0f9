//! Streaming partitioning (`stream.rs`): the balance cap on random graphs, errors, determinism, quality
//! on a planted-partition SBM against a random assignment and the planted blocks, restreaming, and the
//! hub, isolated-node and empty-graph corners. The memory bound is tested in `tests/stream_memory.rs`.

use physalia_graph::partition::{Partitioning, build_parts};
use physalia_graph::stream::{
    StreamAlgorithm, StreamOrder, StreamParams, partition_stream, quality,
};
use physalia_graph::synth::sbm;
use physalia_graph::{Csr, Error, SbmParams, csr_from_edge_pairs};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const FENNEL: StreamAlgorithm = StreamAlgorithm::Fennel { gamma: 1.5 };

fn params(k: usize, passes: usize, algorithm: StreamAlgorithm, order: StreamOrder) -> StreamParams {
    StreamParams {
        passes,
        algorithm,
        order,
        ..StreamParams::new(k)
    }
}

fn random_graph(
    rng: &mut ChaCha8Rng,
    n: usize,
    m: usize,
    undirected: bool,
) -> (Vec<i64>, Vec<i32>) {
    let edges: Vec<(u32, u32)> = (0..m)
        .map(|_| (rng.random_range(0..n as u32), rng.random_range(0..n as u32)))
        .collect();
    csr_from_edge_pairs(n, &edges, undirected)
}

fn cut_fraction(csr: Csr<'_>, p: &Partitioning) -> f64 {
    quality(csr, p).unwrap().cut_fraction
}

#[test]
fn balance_cap_holds_on_random_graphs() {
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for case in 0..150 {
        let n = rng.random_range(1..400usize);
        let k = rng.random_range(1..=n.min(24));
        // From edgeless to dense, with a hub now and then.
        let m = rng.random_range(0..n * 8);
        let undirected = rng.random_bool(0.7);
        let (mut indptr, mut indices) = random_graph(&mut rng, n, m, undirected);
        if rng.random_bool(0.2) && n > 1 {
            let star: Vec<(u32, u32)> = (1..n as u32).map(|v| (0, v)).collect();
            (indptr, indices) = csr_from_edge_pairs(n, &star, true);
        }
        let csr = Csr::new(&indptr, &indices);
        let p = StreamParams {
            eps: [0.0, 0.03, 0.1, 0.5][rng.random_range(0..4)],
            passes: rng.random_range(1..=3),
            algorithm: if rng.random_bool(0.5) {
                FENNEL
            } else {
                StreamAlgorithm::Ldg
            },
            order: if rng.random_bool(0.5) {
                StreamOrder::Natural
            } else {
                StreamOrder::Shuffled
            },
            seed: rng.random(),
            ..StreamParams::new(k)
        };
        let out = partition_stream(csr, &p).unwrap_or_else(|e| panic!("case {case} {p:?}: {e}"));
        let part = &out.partitioning;
        let cap = p.capacity(n);
        assert!(cap * k >= n && cap <= ((1.0 + p.eps) * n as f64 / k as f64).ceil() as usize + 1);
        let sizes = part.part_sizes();
        assert_eq!(sizes.len(), k);
        assert_eq!(sizes.iter().sum::<usize>(), n);
        let max = *sizes.iter().max().unwrap();
        assert!(
            max <= cap,
            "case {case} n={n} k={k} {p:?}: part of {max} nodes over the cap {cap}: {sizes:?}"
        );
        assert!(part.balance <= cap as f64 * k as f64 / n as f64 + 1e-9);
        assert_eq!(out.passes.len(), p.passes);
        assert_eq!(out.passes[0].moved, n);
        // The reported cut is the cut of the returned assignment.
        let again = Partitioning::from_assignment(csr, k, part.parts.clone(), "x", 0).unwrap();
        assert_eq!(again.edge_cut, part.edge_cut);
    }
}

#[test]
fn bad_parameters_are_clear_errors() {
    let (indptr, indices) = csr_from_edge_pairs(5, &[(0, 1), (1, 2), (3, 4)], true);
    let csr = Csr::new(&indptr, &indices);
    let expect = |p: StreamParams, param: &str, words: &str| {
        let e = partition_stream(csr, &p).expect_err("must fail");
        let msg = e.to_string();
        assert!(
            matches!(&e, Error::Param { param: got, .. } if *got == param) && msg.contains(words),
            "{p:?}: got '{msg}', expected an error on '{param}' saying '{words}'"
        );
    };
    expect(StreamParams::new(0), "k", "at least 1");
    expect(
        StreamParams::new(6),
        "k",
        "6 parts exceed the graph's 5 nodes",
    );
    expect(
        StreamParams {
            eps: -0.1,
            ..StreamParams::new(2)
        },
        "eps",
        "at least 0",
    );
    expect(
        StreamParams {
            eps: f64::NAN,
            ..StreamParams::new(2)
        },
        "eps",
        "finite",
    );
    expect(
        StreamParams {
            passes: 0,
            ..StreamParams::new(2)
        },
        "passes",
        "at least one pass",
    );
    expect(
        params(
            2,
            1,
            StreamAlgorithm::Fennel { gamma: 1.0 },
            StreamOrder::Natural,
        ),
        "gamma",
        "greater than 1",
    );

    // An invalid CSR (an entry out of range) is refused, not partitioned.
    let bad_indices = [0i32, 7];
    let bad = Csr::new(&[0, 1, 2], &bad_indices);
    let e = partition_stream(bad, &StreamParams::new(2)).expect_err("invalid CSR");
    assert!(e.to_string().contains("out of range"), "{e}");
}

#[test]
fn empty_graph_k_one_is_empty_and_more_parts_are_refused() {
    let indptr = [0i64];
    let csr = Csr::new(&indptr, &[]);
    let out = partition_stream(csr, &StreamParams::new(1)).unwrap();
    assert!(out.partitioning.parts.is_empty());
    assert_eq!(out.partitioning.edge_cut, 0);
    assert_eq!(out.partitioning.balance, 1.0);
    let q = quality(csr, &out.partitioning).unwrap();
    assert_eq!((q.cut_fraction, q.num_undirected_edges), (0.0, 0));
    let e = partition_stream(csr, &StreamParams::new(2)).expect_err("2 parts of nothing");
    assert!(e.to_string().contains("exceed the graph's 0 nodes"), "{e}");
}

#[test]
fn k_equal_to_n_and_k_one() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (indptr, indices) = random_graph(&mut rng, 50, 200, true);
    let csr = Csr::new(&indptr, &indices);
    for algorithm in [FENNEL, StreamAlgorithm::Ldg] {
        // k = n with eps 0: exactly one node per part.
        let p = StreamParams {
            eps: 0.0,
            ..params(50, 2, algorithm, StreamOrder::Shuffled)
        };
        let out = partition_stream(csr, &p).unwrap();
        assert!(out.partitioning.part_sizes().iter().all(|&s| s == 1));
        let one = partition_stream(csr, &params(1, 2, algorithm, StreamOrder::Natural)).unwrap();
        assert!(one.partitioning.parts.iter().all(|&p| p == 0));
        assert_eq!(one.partitioning.edge_cut, 0);
    }
}

#[test]
fn deterministic_for_a_seed() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (indptr, indices) = random_graph(&mut rng, 3000, 15000, true);
    let csr = Csr::new(&indptr, &indices);
    for order in [StreamOrder::Natural, StreamOrder::Shuffled] {
        for algorithm in [FENNEL, StreamAlgorithm::Ldg] {
            let p = StreamParams {
                seed: 42,
                ..params(8, 3, algorithm, order)
            };
            let a = partition_stream(csr, &p).unwrap();
            let b = partition_stream(csr, &p).unwrap();
            assert_eq!(a.partitioning, b.partitioning, "{p:?}");
            assert_eq!(
                a.passes.iter().map(|s| s.moved).collect::<Vec<_>>(),
                b.passes.iter().map(|s| s.moved).collect::<Vec<_>>()
            );
        }
    }
    // The seed matters where it should: the shuffled order.
    let p = |seed| StreamParams {
        seed,
        ..params(8, 1, FENNEL, StreamOrder::Shuffled)
    };
    let a = partition_stream(csr, &p(1)).unwrap().partitioning;
    let b = partition_stream(csr, &p(2)).unwrap().partitioning;
    assert_ne!(a.parts, b.parts);
}

/// A 4-block SBM with homophily 0.9: random cut is about 0.75, the planted blocks cut about 0.1.
fn planted() -> physalia_graph::OwnedDataset {
    sbm(&SbmParams {
        num_nodes: 20_000,
        num_classes: 4,
        avg_degree: 20.0,
        homophily: 0.9,
        feat_dim: 1,
        seed: 5,
        ..SbmParams::default()
    })
    .unwrap()
}

#[test]
fn sbm_cut_far_below_random_and_restreaming_approaches_the_planted_blocks() {
    let ds = planted();
    let csr = ds.csr();
    let n = csr.num_nodes();
    let k = 4;
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let random: Vec<u32> = (0..n).map(|_| rng.random_range(0..k as u32)).collect();
    let random = Partitioning::from_assignment(csr, k, random, "random", 0).unwrap();
    let random_cut = cut_fraction(csr, &random);
    assert!((random_cut - 0.75).abs() < 0.02, "random cut {random_cut}");
    let labels: Vec<u32> = ds.labels.iter().map(|&c| c as u32).collect();
    let planted = Partitioning::from_assignment(csr, k, labels, "planted", 0).unwrap();
    let planted_cut = cut_fraction(csr, &planted);
    assert!(
        (planted_cut - 0.1).abs() < 0.02,
        "planted cut {planted_cut}"
    );

    let mut improved = 0;
    let mut cases = 0;
    for algorithm in [FENNEL, StreamAlgorithm::Ldg] {
        for order in [StreamOrder::Natural, StreamOrder::Shuffled] {
            for seed in [1, 2] {
                let p = |passes| StreamParams {
                    seed,
                    eps: 0.05,
                    ..params(k, passes, algorithm, order)
                };
                let one = partition_stream(csr, &p(1)).unwrap().partitioning;
                let three = partition_stream(csr, &p(3)).unwrap().partitioning;
                let six = partition_stream(csr, &p(6)).unwrap();
                let (c1, c3) = (cut_fraction(csr, &one), cut_fraction(csr, &three));
                let c6 = cut_fraction(csr, &six.partitioning);
                let what = format!(
                    "{algorithm:?} {order:?} seed {seed}: cut after 1 pass {c1:.3}, 3 passes {c3:.3}, \
                     6 passes {c6:.3}"
                );
                // One pass places the first nodes blind (no neighbour assigned yet), so parts start as
                // block mixtures; it still beats random clearly. Measured: about 0.5-0.6 here.
                assert!(
                    c1 < 0.85 * random_cut,
                    "{what}: not below random {random_cut:.3}"
                );
                assert!(
                    c3 <= c1 * 1.05 + 0.005,
                    "{what}: restreaming made the cut worse"
                );
                assert!(
                    c6 <= c3 * 1.05 + 0.005,
                    "{what}: restreaming made the cut worse"
                );
                // Restreamed: far below random, close to the planted blocks...
                assert!(
                    c6 < 0.5 * random_cut,
                    "{what}: not far below random {random_cut:.3}"
                );
                assert!(
                    c6 < 1.3 * planted_cut,
                    "{what}: planted cut is {planted_cut:.3}"
                );
                // ...and each part mostly one block.
                let mut tally = vec![[0usize; 4]; k];
                for (v, &part) in six.partitioning.parts.iter().enumerate() {
                    tally[part as usize][ds.labels[v] as usize] += 1;
                }
                let majority: usize = tally.iter().map(|t| *t.iter().max().unwrap()).sum();
                assert!(
                    majority as f64 > 0.85 * n as f64,
                    "{what}: parts are only {:.2} pure",
                    majority as f64 / n as f64
                );
                // The assignment settles: the last pass moves fewer nodes than the second.
                let moved: Vec<usize> = six.passes.iter().map(|s| s.moved).collect();
                assert!(
                    moved[5] < moved[1] && moved[1] < n,
                    "{what}: moved {moved:?}"
                );
                cases += 1;
                improved += (c6 < c1 - 0.05) as usize;
            }
        }
    }
    assert_eq!(
        improved, cases,
        "restreaming improved the cut in only {improved} of {cases} cases"
    );
}

#[test]
fn streamed_partitioning_feeds_build_parts() {
    let ds = sbm(&SbmParams {
        num_nodes: 2000,
        num_classes: 4,
        feat_dim: 4,
        ..SbmParams::default()
    })
    .unwrap();
    let out = partition_stream(ds.csr(), &params(4, 2, FENNEL, StreamOrder::Natural)).unwrap();
    let parts = build_parts(&ds, &out.partitioning).unwrap();
    assert_eq!(parts.len(), 4);
    let owned: usize = parts.iter().map(|p| p.n_owned()).sum();
    assert_eq!(owned, 2000);
    assert_eq!(out.partitioning.method, "fennel-x2");
}

#[test]
fn star_graph_hub_part_is_capped() {
    let n = 1001;
    let star: Vec<(u32, u32)> = (1..n as u32).map(|v| (0, v)).collect();
    let (indptr, indices) = csr_from_edge_pairs(n, &star, true);
    let csr = Csr::new(&indptr, &indices);
    for order in [StreamOrder::Natural, StreamOrder::Shuffled] {
        for algorithm in [FENNEL, StreamAlgorithm::Ldg] {
            let p = params(4, 2, algorithm, order);
            let cap = p.capacity(n);
            let part = partition_stream(csr, &p).unwrap().partitioning;
            let sizes = part.part_sizes();
            assert!(
                sizes.iter().all(|&s| s <= cap),
                "{p:?}: {sizes:?} over {cap}"
            );
            // Every edge touches the hub: the cut is the leaves outside the hub's part.
            let hub_part = sizes[part.parts[0] as usize];
            assert_eq!(part.edge_cut, n - hub_part, "{p:?}");
            if algorithm == StreamAlgorithm::Ldg && order == StreamOrder::Natural {
                // LDG puts a leaf with the hub while there is room: the best cut the cap allows.
                assert_eq!(hub_part, cap, "{p:?}: {sizes:?}");
            }
        }
    }
}

#[test]
fn isolated_nodes_are_spread_evenly() {
    // Only isolated nodes: every choice is a tie on neighbours, so the smallest part wins each time.
    let n = 103;
    let indptr = vec![0i64; n + 1];
    let csr = Csr::new(&indptr, &[]);
    for algorithm in [FENNEL, StreamAlgorithm::Ldg] {
        let out = partition_stream(csr, &params(4, 2, algorithm, StreamOrder::Shuffled)).unwrap();
        let sizes = out.partitioning.part_sizes();
        let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
        assert!(max - min <= 1, "{algorithm:?}: {sizes:?}");
        assert_eq!(out.partitioning.edge_cut, 0);
    }
    // A clique on 0..20 plus 80 isolated nodes: the clique stays whole with k = 2, isolated nodes fill
    // up the rest.
    let clique: Vec<(u32, u32)> = (0..20u32)
        .flat_map(|a| (a + 1..20).map(move |b| (a, b)))
        .collect();
    let (indptr, indices) = csr_from_edge_pairs(100, &clique, true);
    let csr = Csr::new(&indptr, &indices);
    let part = partition_stream(csr, &params(2, 1, FENNEL, StreamOrder::Natural))
        .unwrap()
        .partitioning;
    assert_eq!(part.edge_cut, 0, "{:?}", &part.parts[..20]);
    assert!(part.part_sizes().iter().all(|&s| s <= 53));
}

#[test]
fn directed_graphs_partition_on_in_edges() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let (indptr, indices) = random_graph(&mut rng, 500, 3000, false);
    let csr = Csr::new(&indptr, &indices);
    let out = partition_stream(csr, &params(5, 3, FENNEL, StreamOrder::Natural)).unwrap();
    let q = quality(csr, &out.partitioning).unwrap();
    assert!(q.max_part <= StreamParams::new(5).capacity(500));
    assert!(q.num_undirected_edges > 2900 && q.edge_cut <= q.num_undirected_edges);
}

#[test]
fn quality_by_hand() {
    // Triangle 0-1-2 and edge 3-4, one-way edge 2 -> 3: 5 undirected edges.
    let (mut indptr, mut indices) = csr_from_edge_pairs(5, &[(0, 1), (1, 2), (0, 2), (3, 4)], true);
    // Add 2 -> 3 (row 3 gains in-neighbour 2).
    indices.insert(indptr[3] as usize, 2);
    for p in &mut indptr[4..] {
        *p += 1;
    }
    let csr = Csr::new(&indptr, &indices);
    let p = Partitioning::from_assignment(csr, 2, vec![0, 0, 1, 1, 1], "hand", 0).unwrap();
    let q = quality(csr, &p).unwrap();
    assert_eq!((q.edge_cut, q.num_undirected_edges), (2, 5));
    assert!((q.cut_fraction - 0.4).abs() < 1e-12);
    assert_eq!((q.max_part, q.min_part), (3, 2));
    assert!((q.balance - 1.2).abs() < 1e-12);
    let wrong = Partitioning {
        parts: vec![0; 4],
        ..p
    };
    assert!(quality(csr, &wrong).is_err());
}
