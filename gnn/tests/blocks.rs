//! Mini-batch blocks: with every neighbour kept, a batch's gradients equal full-graph training's on the same
//! seeds; with neighbours dropped, the block backward still matches finite differences.

use physalia_gnn::loss::cross_entropy;
use physalia_gnn::{
    Activation, LayerKind, LocalExchange, LocalGraph, Matrix, Model, ModelConfig, Pass,
};

mod common;
use common::{Problem, problem};

/// Blocks of `seeds`' `layers`-hop computation graph (input layer first), keeping at most `keep` in-neighbours
/// of each node (the first ones: a deterministic stand-in for sampling), and the global ids of block 0's
/// sources.
fn blocks(
    p: &Problem,
    kind: LayerKind,
    seeds: &[u32],
    layers: usize,
    keep: usize,
) -> (Vec<LocalGraph>, Vec<u32>) {
    let n = p.indptr.len() - 1;
    let mut pos = vec![u32::MAX; n];
    let mut nodes: Vec<u32> = seeds.to_vec();
    for (i, &s) in seeds.iter().enumerate() {
        pos[s as usize] = i as u32;
    }
    let mut hops = Vec::new();
    for _ in 0..layers {
        let n_dst = nodes.len();
        let mut indptr = vec![0i64];
        let mut indices = Vec::new();
        for i in 0..n_dst {
            let v = nodes[i] as usize;
            let nb = &p.indices[p.indptr[v] as usize..p.indptr[v + 1] as usize];
            let mut row: Vec<i32> = nb
                .iter()
                .take(keep)
                .map(|&u| {
                    if pos[u as usize] == u32::MAX {
                        pos[u as usize] = nodes.len() as u32;
                        nodes.push(u as u32);
                    }
                    pos[u as usize] as i32
                })
                .collect();
            row.sort();
            indices.extend(row);
            indptr.push(indices.len() as i64);
        }
        hops.push((n_dst, nodes.len(), indptr, indices));
    }
    let deg = |v: u32| (p.indptr[v as usize + 1] - p.indptr[v as usize]) as u32;
    let graphs = hops
        .into_iter()
        .rev()
        .map(|(n_dst, n_src, indptr, indices)| {
            let ids = nodes[..n_src].to_vec();
            let degs: Vec<u32> = ids.iter().map(|&v| deg(v)).collect();
            LocalGraph::block(kind, n_dst, n_src, &indptr, &indices, &degs, ids)
        })
        .collect::<Vec<_>>();
    let input = nodes[..graphs[0].n_src()].to_vec();
    (graphs, input)
}

fn gather(x: &Matrix, ids: &[u32]) -> Matrix {
    let d = x.cols();
    let mut out = Matrix::zeros(ids.len(), d);
    for (r, &v) in ids.iter().enumerate() {
        out.row_mut(r).copy_from_slice(x.row(v as usize));
    }
    out
}

fn cfg(kind: LayerKind, in_dim: usize, hidden: usize, layers: usize, dropout: f32) -> ModelConfig {
    let mut c = ModelConfig::new(kind, in_dim, hidden, 3);
    c.layers = layers;
    c.activation = Activation::Elu;
    c.dropout = dropout;
    c.input_dropout = dropout;
    c.attn_dropout = dropout;
    c.heads = 2;
    c.out_heads = 2;
    c
}

fn batch_grads(
    model: &mut Model,
    p: &Problem,
    bl: &[LocalGraph],
    input: &[u32],
    seeds: &[u32],
    pass: Pass,
) -> (f64, Vec<Matrix>) {
    let x = gather(&p.x, input);
    let fwd = model.forward_blocks(bl, &x, pass).unwrap();
    let labels: Vec<i64> = seeds.iter().map(|&s| p.labels[s as usize]).collect();
    let rows: Vec<u32> = (0..seeds.len() as u32).collect();
    let (loss, d) = cross_entropy(&fwd.logits, &labels, &rows, seeds.len() as f64);
    let grads = model
        .backward_blocks(bl, fwd, d, &mut LocalExchange)
        .unwrap();
    (loss, grads)
}

#[test]
fn full_neighbourhood_batch_equals_full_graph_gradients() {
    let p = problem(300, 6, 3, 21);
    let seeds: Vec<u32> = (0..300u32).filter(|v| v % 7 == 3).collect();
    for kind in [LayerKind::Gcn, LayerKind::Sage, LayerKind::Gat] {
        // in < hidden aggregates first, in > hidden transforms first; GAT always transforms
        for (hidden, layers) in [(8, 2), (4, 3)] {
            let c = cfg(kind, 6, hidden, layers, 0.3);
            let pass = Pass::Train { epoch: 4 };
            let mut model = Model::new(&c, 5).unwrap();
            let g = LocalGraph::whole(kind, &p.indptr, &p.indices);
            let fwd = model.forward(&g, &p.x, pass, &mut LocalExchange).unwrap();
            let (full_loss, d) = cross_entropy(&fwd.logits, &p.labels, &seeds, seeds.len() as f64);
            let full = model.backward(&g, fwd, d, &mut LocalExchange).unwrap();

            let (bl, input) = blocks(&p, kind, &seeds, layers, usize::MAX);
            let (loss, grads) = batch_grads(&mut model, &p, &bl, &input, &seeds, pass);
            assert!(
                (loss - full_loss).abs() <= 1e-5 * full_loss.abs(),
                "{kind:?} h={hidden}: loss {loss} vs {full_loss}"
            );
            for (k, (a, b)) in grads.iter().zip(&full).enumerate() {
                let scale = b.max_abs().max(1e-6);
                let rel = a.max_abs_diff(b) / scale;
                assert!(
                    rel <= 1e-4,
                    "{kind:?} h={hidden} layers={layers}: {} differs by {rel:e} (relative)",
                    model.params[k].name
                );
            }
        }
    }
}

#[test]
fn sampled_block_gradients_match_finite_differences() {
    let p = problem(120, 5, 3, 8);
    let seeds: Vec<u32> = (0..120u32).filter(|v| v % 5 == 1).collect();
    for kind in [LayerKind::Gcn, LayerKind::Sage, LayerKind::Gat] {
        for hidden in [7, 3] {
            let mut c = cfg(kind, 5, hidden, 2, 0.2);
            c.negative_slope = 1.0; // no LeakyReLU kink for the finite difference to straddle
            let pass = Pass::Train { epoch: 2 };
            let mut model = Model::new(&c, 3).unwrap();
            // at most 2 neighbours per node: GCN's weights are rescaled by degree / kept
            let (bl, input) = blocks(&p, kind, &seeds, 2, 2);
            let (_, grads) = batch_grads(&mut model, &p, &bl, &input, &seeds, pass);
            let eps = 1e-2f32;
            let mut bad = Vec::new();
            let mut total = 0;
            assert_eq!(grads.len(), model.params.len());
            for (pi, grad) in grads.iter().enumerate() {
                for k in 0..model.params[pi].value.data().len() {
                    let orig = model.params[pi].value.data()[k];
                    model.params[pi].value.data_mut()[k] = orig + eps;
                    let up = batch_grads(&mut model, &p, &bl, &input, &seeds, pass).0;
                    model.params[pi].value.data_mut()[k] = orig - eps;
                    let down = batch_grads(&mut model, &p, &bl, &input, &seeds, pass).0;
                    model.params[pi].value.data_mut()[k] = orig;
                    let fd = (up - down) / seeds.len() as f64 / (2.0 * eps as f64);
                    let an = grad.data()[k] as f64;
                    total += 1;
                    if (fd - an).abs() > 2e-3 + 2e-2 * an.abs().max(fd.abs()) {
                        bad.push(format!("{}[{k}]: {an} vs {fd}", model.params[pi].name));
                    }
                }
            }
            assert!(
                bad.is_empty(),
                "{kind:?} h={hidden}: {} of {total}: {bad:?}",
                bad.len()
            );
        }
    }
}

#[test]
fn sampled_gcn_rescales_kept_neighbours() {
    // one destination with four neighbours of which two are kept: neighbour weights double
    let indptr = [0i64, 2];
    let indices = [1i32, 2];
    let degs = [4u32, 1, 1];
    let g = LocalGraph::block(
        LayerKind::Gcn,
        1,
        3,
        &indptr,
        &indices,
        &degs,
        vec![0, 1, 2],
    );
    let x = Matrix::from_vec(3, 1, vec![1.0, 1.0, 1.0]);
    let mut c = ModelConfig::new(LayerKind::Gcn, 1, 1, 1);
    c.layers = 1;
    c.dropout = 0.0;
    c.input_dropout = 0.0;
    let mut model = Model::new(&c, 1).unwrap();
    model.params[0].value = Matrix::from_vec(1, 1, vec![1.0]);
    let out = model
        .forward_blocks(std::slice::from_ref(&g), &x, Pass::Eval)
        .unwrap();
    // self: 1/5; each kept neighbour: (4/2) / sqrt(5 * 2)
    let want = 1.0 / 5.0 + 2.0 * 2.0 / (10f32).sqrt();
    assert!(
        (out.logits.data()[0] - want).abs() < 1e-6,
        "{:?}",
        out.logits
    );
}

/// Column ranges of `d` input columns over `w` workers (the first `d % w` get one more).
fn slices(d: usize, w: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut c0 = 0;
    for k in 0..w {
        let len = d / w + usize::from(k < d % w);
        out.push(c0..c0 + len);
        c0 += len;
    }
    out
}

fn columns(x: &Matrix, r: &std::ops::Range<usize>) -> Matrix {
    let mut out = Matrix::zeros(x.rows(), r.len());
    for i in 0..x.rows() {
        out.row_mut(i).copy_from_slice(&x.row(i)[r.clone()]);
    }
    out
}

fn rel_diff(a: &Matrix, b: &Matrix) -> f32 {
    a.max_abs_diff(b) / b.max_abs().max(1e-6)
}

#[test]
fn p3_column_split_equals_unsplit_first_layer() {
    let p = problem(300, 10, 3, 33);
    let seeds: Vec<u32> = (0..300u32).filter(|v| v % 4 == 0).collect();
    for kind in [LayerKind::Gcn, LayerKind::Sage] {
        // hidden 16 > every slice: aggregate the slice first; hidden 2 < slices: transform first
        for hidden in [16, 2] {
            let c = cfg(kind, 10, hidden, 3, 0.3);
            let pass = Pass::Train { epoch: 7 };
            let mut model = Model::new(&c, 9).unwrap();
            let (bl, input) = blocks(&p, kind, &seeds, 3, 4);
            let x = gather(&p.x, &input);
            let labels: Vec<i64> = seeds.iter().map(|&s| p.labels[s as usize]).collect();
            let rows: Vec<u32> = (0..seeds.len() as u32).collect();
            let fwd = model.forward_blocks(&bl, &x, pass).unwrap();
            let want_logits = fwd.logits.clone();
            let (_, d) = cross_entropy(&fwd.logits, &labels, &rows, seeds.len() as f64);
            let want = model
                .backward_blocks(&bl, fwd, d, &mut LocalExchange)
                .unwrap();
            for workers in 1..=4 {
                let parts = slices(10, workers);
                let mut z0 = Matrix::zeros(bl[0].n_dst(), hidden);
                for r in &parts {
                    let part = model
                        .first_layer_partial(&bl[0], &columns(&x, r), r.start, pass)
                        .unwrap();
                    z0.add_assign(&part);
                }
                let fwd = model.forward_after_first_blocks(&bl, z0, pass).unwrap();
                let what = format!("{kind:?} hidden={hidden} workers={workers}");
                assert!(
                    rel_diff(&fwd.logits, &want_logits) <= 1e-4,
                    "{what}: logits"
                );
                let (_, d) = cross_entropy(&fwd.logits, &labels, &rows, seeds.len() as f64);
                let (mut grads, d_z) = model.backward_after_first_blocks(&bl, fwd, d).unwrap();
                for r in &parts {
                    model
                        .first_layer_partial_backward(
                            &bl[0],
                            &columns(&x, r),
                            r.start,
                            pass,
                            &d_z,
                            &mut grads,
                        )
                        .unwrap();
                }
                for (k, (a, b)) in grads.iter().zip(&want).enumerate() {
                    let rel = rel_diff(a, b);
                    assert!(
                        rel <= 1e-4,
                        "{what}: {} differs by {rel:e}",
                        model.params[k].name
                    );
                }
            }
        }
    }
}

#[test]
fn p3_whole_graph_inference_equals_unsplit() {
    let p = problem(200, 9, 3, 4);
    for kind in [LayerKind::Gcn, LayerKind::Sage] {
        let c = cfg(kind, 9, 5, 2, 0.5);
        let mut model = Model::new(&c, 2).unwrap();
        let g = LocalGraph::whole(kind, &p.indptr, &p.indices);
        let want = model
            .forward(&g, &p.x, Pass::Eval, &mut LocalExchange)
            .unwrap()
            .logits;
        let mut z0 = Matrix::zeros(200, 5);
        for r in slices(9, 3) {
            z0.add_assign(
                &model
                    .first_layer_partial(&g, &columns(&p.x, &r), r.start, Pass::Eval)
                    .unwrap(),
            );
        }
        let got = model
            .forward_after_first(&g, z0, Pass::Eval, &mut LocalExchange)
            .unwrap()
            .logits;
        assert!(rel_diff(&got, &want) <= 1e-4, "{kind:?}");
    }
}

#[test]
fn p3_refuses_gat_and_bad_slices() {
    let p = problem(30, 4, 3, 1);
    let g = LocalGraph::whole(LayerKind::Gat, &p.indptr, &p.indices);
    let model = Model::new(&cfg(LayerKind::Gat, 4, 3, 2, 0.0), 1).unwrap();
    let err = model
        .first_layer_partial(&g, &p.x, 0, Pass::Eval)
        .unwrap_err()
        .to_string();
    assert!(err.contains("GAT"), "{err}");
    let g = LocalGraph::whole(LayerKind::Gcn, &p.indptr, &p.indices);
    let model = Model::new(&cfg(LayerKind::Gcn, 4, 3, 2, 0.0), 1).unwrap();
    let err = model
        .first_layer_partial(&g, &p.x, 2, Pass::Eval)
        .unwrap_err()
        .to_string();
    assert!(err.contains("column slice 2..6"), "{err}");
}
