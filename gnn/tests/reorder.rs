//! Row reordering for locality is invisible to the model (`physalia_gnn::order`'s invariant): a graph whose
//! owned rows are held in another order trains to the same losses and predicts the same logits (1e-4) as
//! the graph in the caller's order, on one worker and on two partitions exchanging halo rows, with dropout
//! on (masks are keyed by global id); the permutation round-trips; and a permutation applied wrongly (the
//! features left in the caller's order) is caught.

use std::sync::mpsc::{Receiver, Sender, channel};

use physalia_gnn::exchange::ExchangeError;
use physalia_gnn::rng::Stream;
use physalia_gnn::{
    Adam, EpochMetrics, Exchange, LayerKind, LocalExchange, LocalGraph, Matrix, Model, ModelConfig,
    NodeSets, Pass, Progress, RowOrder, TrainConfig, train_resumable, train_resumable_owned,
};

mod common;
use common::{Problem, problem};

const N: usize = 240;
const F: usize = 6;
const CLASSES: usize = 3;

fn sets(p: &Problem) -> NodeSets {
    NodeSets {
        labels: p.labels.clone(),
        train: p.train.clone(),
        val: (0..N as u32).filter(|v| v % 3 == 2).collect(),
        test: (0..N as u32).filter(|v| v % 6 == 5).collect(),
    }
}

fn config(kind: LayerKind) -> ModelConfig {
    let mut cfg = ModelConfig::new(kind, F, 8, CLASSES);
    cfg.heads = 2;
    cfg.dropout = 0.5;
    cfg.input_dropout = 0.3;
    if kind == LayerKind::Gat {
        cfg.attn_dropout = 0.2;
    }
    cfg
}

fn train_config() -> TrainConfig {
    TrainConfig {
        epochs: 6,
        lr: 0.01,
        weight_decay: 5e-4,
        eval_every: 3,
        patience: None,
    }
}

/// A seeded random permutation of `0..n` (engine row -> caller row).
fn shuffled(n: usize, seed: u64) -> Vec<u32> {
    let s = Stream::new(seed, &[7]);
    let mut v: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        let j = (s.at(i as u64) % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

fn assert_close_losses(a: &[EpochMetrics], b: &[EpochMetrics], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: epochs");
    for (x, y) in a.iter().zip(b) {
        let rel = (x.loss - y.loss).abs() / x.loss.abs().max(1e-12);
        assert!(
            rel < 1e-4,
            "{what}: epoch {} loss {} vs {}",
            x.epoch,
            x.loss,
            y.loss
        );
        for (p, q) in [
            (x.train_acc, y.train_acc),
            (x.val_acc, y.val_acc),
            (x.test_acc, y.test_acc),
        ] {
            match (p, q) {
                (Some(p), Some(q)) => assert!(
                    (p - q).abs() <= 1.0 / N as f64 + 1e-12,
                    "{what}: accuracy {p} vs {q}"
                ),
                (None, None) => {}
                _ => panic!("{what}: one run evaluated, the other did not"),
            }
        }
    }
}

/// Trains on `g` (owned features handed in the caller's order) and returns the epochs and the model.
fn train_whole(g: &LocalGraph, p: &Problem, cfg: &ModelConfig) -> (Vec<EpochMetrics>, Model) {
    let tc = train_config();
    let mut model = Model::new(cfg, 3).unwrap();
    let mut opt = Adam::new(&model.params, tc.lr, tc.weight_decay);
    let mut seen = vec![];
    train_resumable_owned(
        &mut model,
        &mut opt,
        Progress::default(),
        g,
        p.x.clone(),
        &sets(p),
        &tc,
        &mut LocalExchange,
        &mut |e| {
            seen.push(e.metrics.clone());
            true
        },
    )
    .unwrap();
    (seen, model)
}

#[test]
fn the_permutation_round_trips() {
    let to_caller = shuffled(N, 1);
    let o = RowOrder::from_engine_order(to_caller.clone());
    for (e, &c) in to_caller.iter().enumerate() {
        assert_eq!(o.engine_row(o.caller_row(e)), e);
        assert_eq!(o.caller_row(e), c as usize);
    }
    let p = problem(N, F, CLASSES, 5);
    // two extra rows stand for halo rows: they keep their place
    let mut data = p.x.data().to_vec();
    data.extend((0..2 * F).map(|i| i as f32 + 100.0));
    let m = Matrix::from_vec(N + 2, F, data);
    let e = o.rows_to_engine(&m);
    assert_ne!(e.data(), m.data(), "a random order moves rows");
    for (r, &c) in to_caller.iter().enumerate() {
        assert_eq!(e.row(r), m.row(c as usize));
    }
    assert_eq!(e.row(N), m.row(N));
    assert_eq!(o.rows_to_caller(&e).data(), m.data());
    let s = o.sets_to_engine(&sets(&p));
    for (r, &l) in s.labels.iter().enumerate() {
        assert_eq!(l, p.labels[o.caller_row(r)]);
    }
    let mut back: Vec<u32> = s
        .train
        .iter()
        .map(|&r| o.caller_row(r as usize) as u32)
        .collect();
    back.sort_unstable();
    assert_eq!(back, p.train);
    // the CSR: row e of the engine's graph is the caller's row to_caller[e], renumbered
    let (ip, ix) = o.csr_to_engine(&p.indptr, &p.indices);
    for r in 0..N {
        let c = o.caller_row(r);
        let mut want: Vec<i32> = p.indices[p.indptr[c] as usize..p.indptr[c + 1] as usize]
            .iter()
            .map(|&j| o.engine_row(j as usize) as i32)
            .collect();
        want.sort_unstable();
        assert_eq!(&ix[ip[r] as usize..ip[r + 1] as usize], want.as_slice());
    }
}

#[test]
#[should_panic(expected = "out of range or repeated")]
fn a_repeated_row_is_no_order() {
    RowOrder::from_engine_order(vec![0, 2, 2]);
}

#[test]
fn a_clustered_order_is_a_permutation_that_groups_the_graph() {
    let p = problem(N, F, CLASSES, 9);
    let o = RowOrder::clustered(N, &p.indptr, &p.indices, 40);
    let mut seen = o.to_caller().to_vec();
    seen.sort_unstable();
    assert_eq!(seen, (0..N as u32).collect::<Vec<_>>());
    assert_ne!(o.to_caller(), seen.as_slice(), "the clusters move rows");
    // more edges fall inside blocks of 40 rows than in the caller's order (which is random here)
    let identity = RowOrder::from_engine_order(seen);
    let (near, before) = (
        o.block_locality(&p.indptr, &p.indices, 40),
        identity.block_locality(&p.indptr, &p.indices, 40),
    );
    assert!(near > 1.5 * before, "locality {near} against {before}");
    assert!(
        RowOrder::locality(N, &p.indptr, &p.indices).is_none(),
        "one block: no order"
    );
}

/// One worker: every kind, dropout on, a random order and a locality order, against the caller's order.
#[test]
fn an_ordered_whole_graph_trains_and_predicts_as_the_unordered_one() {
    let p = problem(N, F, CLASSES, 11);
    for kind in [LayerKind::Gcn, LayerKind::Sage, LayerKind::Gat] {
        let cfg = config(kind);
        let plain = LocalGraph::whole(kind, &p.indptr, &p.indices);
        let (want, mut want_model) = train_whole(&plain, &p, &cfg);
        let orders = [
            RowOrder::from_engine_order(shuffled(N, 2)),
            RowOrder::clustered(N, &p.indptr, &p.indices, 40),
        ];
        for order in orders {
            let g = LocalGraph::with_order(kind, N, N, &p.indptr, &p.indices, None, None, order);
            let (got, mut model) = train_whole(&g, &p, &cfg);
            assert_close_losses(&want, &got, &format!("{kind:?}"));
            for (a, b) in want_model.params.iter().zip(&model.params) {
                assert!(
                    a.value.max_abs_diff(&b.value) < 1e-4,
                    "{kind:?}: {}",
                    a.name
                );
            }
            // predictions: the engine's rows mapped out equal the unordered engine's
            let o = g.row_order().unwrap().clone();
            let pass = Pass::Train { epoch: 3 };
            let want_logits = want_model
                .forward(&plain, &p.x, pass, &mut LocalExchange)
                .unwrap()
                .logits;
            let x = o.rows_to_engine(&p.x);
            let got_logits = model
                .forward(&g, &x, pass, &mut LocalExchange)
                .unwrap()
                .logits;
            let diff = want_logits.max_abs_diff(&o.rows_to_caller(&got_logits));
            assert!(diff < 1e-4, "{kind:?}: logits differ by {diff}");
            // the test catches a permutation applied wrongly: features left in the caller's order
            let wrong = model
                .forward(&g, &p.x, pass, &mut LocalExchange)
                .unwrap()
                .logits;
            let off = want_logits.max_abs_diff(&o.rows_to_caller(&wrong));
            assert!(
                off > 1e-2,
                "{kind:?}: unpermuted features went unnoticed ({off})"
            );
        }
    }
}

/// The borrowed-features entry point and `evaluate` take the caller's order too.
#[test]
fn borrowed_features_and_evaluate_cross_the_edge() {
    let p = problem(N, F, CLASSES, 13);
    let kind = LayerKind::Sage;
    let cfg = config(kind);
    let tc = train_config();
    let plain = LocalGraph::whole(kind, &p.indptr, &p.indices);
    let g = LocalGraph::with_order(
        kind,
        N,
        N,
        &p.indptr,
        &p.indices,
        None,
        None,
        RowOrder::from_engine_order(shuffled(N, 3)),
    );
    let mut runs = vec![];
    for graph in [&plain, &g] {
        let mut model = Model::new(&cfg, 3).unwrap();
        let mut opt = Adam::new(&model.params, tc.lr, tc.weight_decay);
        let (summary, _) = train_resumable(
            &mut model,
            &mut opt,
            Progress::default(),
            graph,
            &p.x,
            &sets(&p),
            &tc,
            &mut LocalExchange,
            &mut |_| true,
        )
        .unwrap();
        let acc =
            physalia_gnn::evaluate(&mut model, graph, &p.x, &sets(&p), &mut LocalExchange).unwrap();
        runs.push((summary.epochs, acc));
    }
    assert_close_losses(&runs[0].0, &runs[1].0, "borrowed");
    assert_eq!(runs[0].1, runs[1].1, "evaluate");
}

/// Two workers, each owning half the nodes (a random split), exchanging halo rows, gradients and
/// all-reduces over channels, as the mesh does; the send lists index owned rows in the caller's order.
struct Peer {
    send: Sender<Vec<f32>>,
    recv: Receiver<Vec<f32>>,
    /// Local (caller-order) rows the peer needs, in the order of the peer's halo rows.
    send_rows: Vec<usize>,
    n_halo: usize,
}

impl Peer {
    fn swap(&mut self, v: Vec<f32>) -> Result<Vec<f32>, ExchangeError> {
        self.send.send(v)?;
        Ok(self.recv.recv()?)
    }
}

impl Exchange for Peer {
    fn forward(&mut self, _layer: usize, own: &Matrix) -> Result<Option<Matrix>, ExchangeError> {
        let c = own.cols();
        let mut out = Vec::with_capacity(self.send_rows.len() * c);
        for &r in &self.send_rows {
            out.extend_from_slice(own.row(r));
        }
        let halo = self.swap(out)?;
        Ok(Some(Matrix::from_vec(self.n_halo, c, halo)))
    }

    fn backward(
        &mut self,
        _layer: usize,
        halo_grad: Matrix,
        own_grad: &mut Matrix,
    ) -> Result<(), ExchangeError> {
        let c = own_grad.cols();
        let theirs = self.swap(halo_grad.into_vec())?;
        for (k, &r) in self.send_rows.iter().enumerate() {
            for (o, g) in own_grad
                .row_mut(r)
                .iter_mut()
                .zip(&theirs[k * c..(k + 1) * c])
            {
                *o += g;
            }
        }
        Ok(())
    }

    fn all_reduce(&mut self, grads: &mut [Matrix]) -> Result<(), ExchangeError> {
        for g in grads {
            let theirs = self.swap(g.data().to_vec())?;
            for (a, b) in g.data_mut().iter_mut().zip(theirs) {
                *a += b;
            }
        }
        Ok(())
    }

    fn all_reduce_scalars(&mut self, values: &mut [f64]) -> Result<(), ExchangeError> {
        let bits = values.iter().flat_map(|v| {
            let b = v.to_bits();
            [f32::from_bits(b as u32), f32::from_bits((b >> 32) as u32)]
        });
        let theirs = self.swap(bits.collect())?;
        for (k, v) in values.iter_mut().enumerate() {
            let lo = theirs[2 * k].to_bits() as u64;
            let hi = theirs[2 * k + 1].to_bits() as u64;
            *v += f64::from_bits(lo | (hi << 32));
        }
        Ok(())
    }
}

/// One worker's partition: owned nodes, halo nodes, local CSR, degrees, features, sets.
struct Part {
    owned: Vec<u32>,
    halo: Vec<u32>,
    indptr: Vec<i64>,
    indices: Vec<i32>,
    degree: Vec<u32>,
    x: Matrix,
    sets: NodeSets,
}

fn parts(p: &Problem) -> [Part; 2] {
    let s = Stream::new(21, &[]);
    let owner: Vec<usize> = (0..N).map(|v| (s.at(v as u64) % 2) as usize).collect();
    let deg = |v: usize| (p.indptr[v + 1] - p.indptr[v]) as u32;
    let all = sets(p);
    [0, 1].map(|k| {
        let owned: Vec<u32> = (0..N as u32).filter(|&v| owner[v as usize] == k).collect();
        let mut local = vec![u32::MAX; N];
        for (i, &v) in owned.iter().enumerate() {
            local[v as usize] = i as u32;
        }
        let mut halo = vec![];
        for &v in &owned {
            for &j in &p.indices[p.indptr[v as usize] as usize..p.indptr[v as usize + 1] as usize] {
                if owner[j as usize] != k && local[j as usize] == u32::MAX {
                    local[j as usize] = (owned.len() + halo.len()) as u32;
                    halo.push(j as u32);
                }
            }
        }
        let mut indptr = vec![0i64];
        let mut indices = vec![];
        for &v in &owned {
            let mut row: Vec<i32> = p.indices
                [p.indptr[v as usize] as usize..p.indptr[v as usize + 1] as usize]
                .iter()
                .map(|&j| local[j as usize] as i32)
                .collect();
            row.sort_unstable();
            indices.extend(row);
            indptr.push(indices.len() as i64);
        }
        let degree = owned
            .iter()
            .chain(&halo)
            .map(|&v| deg(v as usize))
            .collect();
        let x = Matrix::from_vec(
            owned.len(),
            F,
            owned
                .iter()
                .flat_map(|&v| p.x.row(v as usize).to_vec())
                .collect(),
        );
        let rows = |set: &[u32]| -> Vec<u32> {
            set.iter()
                .filter(|&&v| owner[v as usize] == k)
                .map(|&v| local[v as usize])
                .collect()
        };
        let sets = NodeSets {
            labels: owned.iter().map(|&v| p.labels[v as usize]).collect(),
            train: rows(&all.train),
            val: rows(&all.val),
            test: rows(&all.test),
        };
        Part {
            owned,
            halo,
            indptr,
            indices,
            degree,
            x,
            sets,
        }
    })
}

/// Trains the two parts on two threads; `ordered` holds each part's owned rows in a random order.
fn train_parts(p: &Problem, cfg: &ModelConfig, ordered: bool) -> Vec<EpochMetrics> {
    let ps = parts(p);
    let (s0, r1) = channel();
    let (s1, r0) = channel();
    let ends = [(s0, r0), (s1, r1)];
    let results: Vec<Vec<EpochMetrics>> = std::thread::scope(|scope| {
        let handles: Vec<_> = ends
            .into_iter()
            .enumerate()
            .map(|(k, (send, recv))| {
                let me = &ps[k];
                let peer = &ps[1 - k];
                scope.spawn(move || {
                    // the rows the peer's halo needs, as my caller-order local rows
                    let send_rows = peer
                        .halo
                        .iter()
                        .map(|v| {
                            me.owned
                                .binary_search(v)
                                .expect("a peer's halo row is mine")
                        })
                        .collect();
                    let mut ex = Peer {
                        send,
                        recv,
                        send_rows,
                        n_halo: me.halo.len(),
                    };
                    let n_dst = me.owned.len();
                    let n_src = n_dst + me.halo.len();
                    let gids: Vec<u32> = me.owned.iter().chain(&me.halo).copied().collect();
                    let g = if ordered {
                        LocalGraph::with_order(
                            cfg.kind,
                            n_dst,
                            n_src,
                            &me.indptr,
                            &me.indices,
                            Some(&me.degree),
                            Some(gids),
                            RowOrder::from_engine_order(shuffled(n_dst, 30 + k as u64)),
                        )
                    } else {
                        LocalGraph::new(
                            cfg.kind,
                            n_dst,
                            n_src,
                            &me.indptr,
                            &me.indices,
                            Some(&me.degree),
                            Some(gids),
                        )
                    };
                    let tc = train_config();
                    let mut model = Model::new(cfg, 3).unwrap();
                    let mut opt = Adam::new(&model.params, tc.lr, tc.weight_decay);
                    let mut seen = vec![];
                    train_resumable_owned(
                        &mut model,
                        &mut opt,
                        Progress::default(),
                        &g,
                        me.x.clone(),
                        &me.sets,
                        &tc,
                        &mut ex,
                        &mut |e| {
                            seen.push(e.metrics.clone());
                            true
                        },
                    )
                    .unwrap();
                    seen
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    results.into_iter().next().unwrap()
}

/// Two partitions, owned rows in a random order on each, halo rows from the peer: the same losses as the
/// same partitions unordered, and as one worker holding the whole graph.
#[test]
fn ordered_partitions_exchanging_halo_rows_train_as_unordered_ones() {
    let p = problem(N, F, CLASSES, 17);
    for kind in [LayerKind::Gcn, LayerKind::Sage, LayerKind::Gat] {
        let cfg = config(kind);
        let (whole, _) = train_whole(&LocalGraph::whole(kind, &p.indptr, &p.indices), &p, &cfg);
        let plain = train_parts(&p, &cfg, false);
        assert_close_losses(
            &whole,
            &plain,
            &format!("{kind:?}: partitions vs one worker"),
        );
        let ordered = train_parts(&p, &cfg, true);
        assert_close_losses(&plain, &ordered, &format!("{kind:?}: ordered partitions"));
    }
}
