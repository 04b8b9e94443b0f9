//! Shared fixtures of the engine's tests.

use physalia_gnn::Matrix;
use physalia_gnn::rng::Stream;

#[allow(dead_code)] // not every test binary reads every field
pub struct Problem {
    pub indptr: Vec<i64>,
    pub indices: Vec<i32>,
    pub x: Matrix,
    pub labels: Vec<i64>,
    pub train: Vec<u32>,
}

/// A random undirected graph with `n` nodes (node 0 isolated), features and labels.
pub fn problem(n: usize, f: usize, classes: usize, seed: u64) -> Problem {
    let s = Stream::new(seed, &[]);
    let mut adj = vec![Vec::new(); n];
    for k in 0..(n * 2) as u64 {
        let a = 1 + (s.at(2 * k) % (n as u64 - 1)) as usize;
        let b = 1 + (s.at(2 * k + 1) % (n as u64 - 1)) as usize;
        if a != b && !adj[a].contains(&(b as i32)) {
            adj[a].push(b as i32);
            adj[b].push(a as i32);
        }
    }
    let mut indptr = vec![0i64];
    let mut indices = Vec::new();
    for row in &mut adj {
        row.sort();
        indices.extend_from_slice(row);
        indptr.push(indices.len() as i64);
    }
    let xs = Stream::new(seed, &[1]);
    let x = Matrix::from_vec(
        n,
        f,
        (0..n * f)
            .map(|i| xs.uniform(i as u64) * 2.0 - 1.0)
            .collect(),
    );
    let labels = (0..n)
        .map(|i| (s.at(1000 + i as u64) % classes as u64) as i64)
        .collect();
    let train = (0..n as u32).filter(|i| i % 3 != 2).collect();
    Problem {
        indptr,
        indices,
        x,
        labels,
        train,
    }
}
