//! Compressed sparse row adjacency: the borrowed view every consumer reads, and the builders that make one.
//!
//! Convention, fixed crate-wide: row `v` lists the *in-neighbours* of `v` (the sources of edges `u -> v`),
//! sorted strictly ascending. Message passing aggregates over a row, so a GNN layer reads one contiguous
//! slice per destination node. Undirected graphs store both directions of each edge, so rows are then
//! simply neighbour lists. Self loops are never stored: the engine adds them itself when a model wants
//! them, and storing them here would double-count.

use std::path::Path;

use rayon::prelude::*;

use crate::error::Error;

/// A borrowed CSR graph: `indptr` has `num_nodes + 1` entries, `indices[indptr[v]..indptr[v+1]]` are the
/// in-neighbours of `v`.
///
/// The accessors assume a valid CSR (as returned by [`crate::Dataset::csr`], which validated it on open); on
/// a hand-built invalid one they panic like slice indexing does. Call [`Csr::validate`] first when unsure.
#[derive(Clone, Copy, Debug)]
pub struct Csr<'a> {
    pub indptr: &'a [i64],
    pub indices: &'a [i32],
}

impl<'a> Csr<'a> {
    pub fn new(indptr: &'a [i64], indices: &'a [i32]) -> Self {
        Csr { indptr, indices }
    }

    pub fn num_nodes(&self) -> usize {
        self.indptr.len().saturating_sub(1)
    }

    /// Number of stored (directed) entries; an undirected edge counts twice.
    pub fn num_edges(&self) -> usize {
        self.indices.len()
    }

    /// In-degree of `v` (the degree, for an undirected graph).
    pub fn degree(&self, v: usize) -> usize {
        (self.indptr[v + 1] - self.indptr[v]) as usize
    }

    /// In-neighbours of `v`, ascending.
    pub fn neighbors(&self, v: usize) -> &'a [i32] {
        &self.indices[self.indptr[v] as usize..self.indptr[v + 1] as usize]
    }

    /// In-degree of every node.
    pub fn degrees(&self) -> Vec<usize> {
        self.indptr
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .collect()
    }

    /// Checks every CSR invariant: `indptr` starts at 0, never decreases and ends at `indices.len()`; every
    /// entry is a node id; each row is strictly ascending (sorted, no duplicates).
    pub fn validate(&self) -> Result<(), Error> {
        self.validate_at(Path::new("<csr>"))
    }

    /// [`Csr::validate`], with errors naming `origin` (the dataset file) instead of a placeholder.
    pub(crate) fn validate_at(&self, origin: &Path) -> Result<(), Error> {
        check_csr(self.indptr, self.indices)
            .map_err(|(tensor, problem)| Error::tensor(origin, tensor, problem))
    }

    /// The reverse graph: row `u` of the result lists the nodes `v` with `u` in row `v` of `self`, ascending.
    ///
    /// Only meaningful for directed graphs (an undirected CSR is its own transpose). Requires a valid CSR.
    pub fn transpose(&self) -> (Vec<i64>, Vec<i32>) {
        let n = self.num_nodes();
        let mut counts = vec![0i64; n + 1];
        for &u in self.indices {
            counts[u as usize + 1] += 1;
        }
        for i in 0..n {
            counts[i + 1] += counts[i];
        }
        let indptr = counts;
        let mut cursor: Vec<i64> = indptr[..n].to_vec();
        let mut out = vec![0i32; self.indices.len()];
        // Visiting rows in ascending order makes every output row ascending without a sort.
        for v in 0..n {
            for &u in self.neighbors(v) {
                let slot = &mut cursor[u as usize];
                out[*slot as usize] = v as i32;
                *slot += 1;
            }
        }
        (indptr, out)
    }
}

/// Returns the offending tensor name and the problem, so callers can attach the file path.
fn check_csr(indptr: &[i64], indices: &[i32]) -> Result<(), (&'static str, String)> {
    let Some((&first, _)) = indptr.split_first() else {
        return Err(("indptr", "is empty; it needs num_nodes + 1 entries".into()));
    };
    let n = indptr.len() - 1;
    if n > i32::MAX as usize + 1 {
        return Err((
            "indptr",
            format!("{n} nodes do not fit the i32 node ids of 'indices'"),
        ));
    }
    if first != 0 {
        return Err(("indptr", format!("entry 0 = {first}, expected 0")));
    }
    for (i, w) in indptr.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err((
                "indptr",
                format!("decreases at entry {}: {} after {}", i + 1, w[1], w[0]),
            ));
        }
    }
    let last = indptr[n];
    if last != indices.len() as i64 {
        return Err((
            "indptr",
            format!(
                "last entry = {last}, expected the length of 'indices' = {}",
                indices.len()
            ),
        ));
    }
    // Range and order checks are independent per row; rows are many and short, so split them across
    // threads and report the first bad row found in row order.
    let bad = (0..n)
        .into_par_iter()
        .with_min_len(4096)
        .find_map_first(|v| {
            let (s, e) = (indptr[v] as usize, indptr[v + 1] as usize);
            let row = &indices[s..e];
            for (k, &u) in row.iter().enumerate() {
                if u < 0 || u as usize >= n {
                    return Some(format!("entry {} = {u} is out of range 0..{n}", s + k));
                }
                if k > 0 && row[k - 1] >= u {
                    let what = if row[k - 1] == u {
                        "duplicate"
                    } else {
                        "unsorted"
                    };
                    return Some(format!(
                        "row {v} is not strictly ascending: {what} entry {} = {u} after {}",
                        s + k,
                        row[k - 1]
                    ));
                }
            }
            None
        });
    match bad {
        Some(problem) => Err(("indices", problem)),
        None => Ok(()),
    }
}

/// Builds a CSR from edges `src[i] -> dst[i]`: row = destination, entries = sources.
///
/// With `undirected`, each edge is also stored as `dst -> src`. Self loops are dropped and duplicate edges
/// kept once; every row comes out strictly ascending. Runs in O(N + E) (counting sort by row, then a sort of
/// each short row), so it scales to tens of millions of edges.
///
/// # Panics
/// If `src` and `dst` differ in length, an endpoint is `>= num_nodes`, or `num_nodes` exceeds the i32 id
/// range. Importers check ids against `num_nodes` (with file and line) before calling this.
pub fn csr_from_edges(
    num_nodes: usize,
    src: &[u32],
    dst: &[u32],
    undirected: bool,
) -> (Vec<i64>, Vec<i32>) {
    assert_eq!(
        src.len(),
        dst.len(),
        "csr_from_edges: src and dst lengths differ"
    );
    assert!(
        num_nodes <= i32::MAX as usize + 1,
        "csr_from_edges: {num_nodes} nodes exceed the i32 id range"
    );
    let n = num_nodes;
    let mut counts = vec![0i64; n + 1];
    for (&s, &d) in src.iter().zip(dst) {
        assert!(
            (s as usize) < n && (d as usize) < n,
            "csr_from_edges: edge {s} -> {d} is out of range 0..{n}"
        );
        if s == d {
            continue;
        }
        counts[d as usize + 1] += 1;
        if undirected {
            counts[s as usize + 1] += 1;
        }
    }
    for i in 0..n {
        counts[i + 1] += counts[i];
    }
    let raw_ptr = counts;
    let total = raw_ptr[n] as usize;
    let mut cursor: Vec<i64> = raw_ptr[..n].to_vec();
    let mut raw = vec![0i32; total];
    for (&s, &d) in src.iter().zip(dst) {
        if s == d {
            continue;
        }
        let c = &mut cursor[d as usize];
        raw[*c as usize] = s as i32;
        *c += 1;
        if undirected {
            let c = &mut cursor[s as usize];
            raw[*c as usize] = d as i32;
            *c += 1;
        }
    }
    drop(cursor);

    // Sort and dedupe each row in place, in parallel; remember each row's deduplicated length.
    let mut rows: Vec<&mut [i32]> = Vec::with_capacity(n);
    let mut rest: &mut [i32] = &mut raw;
    for v in 0..n {
        let len = (raw_ptr[v + 1] - raw_ptr[v]) as usize;
        let (row, tail) = rest.split_at_mut(len);
        rows.push(row);
        rest = tail;
    }
    let kept: Vec<usize> = rows
        .par_iter_mut()
        .with_min_len(1024)
        .map(|row| {
            row.sort_unstable();
            let mut w = 0;
            for r in 0..row.len() {
                if w == 0 || row[r] != row[w - 1] {
                    row[w] = row[r];
                    w += 1;
                }
            }
            w
        })
        .collect();
    drop(rows);

    let mut indptr = Vec::with_capacity(n + 1);
    indptr.push(0i64);
    let mut acc = 0i64;
    for &k in &kept {
        acc += k as i64;
        indptr.push(acc);
    }
    if acc as usize == total {
        return (indptr, raw);
    }
    let mut indices = Vec::with_capacity(acc as usize);
    for v in 0..n {
        let s = raw_ptr[v] as usize;
        indices.extend_from_slice(&raw[s..s + kept[v]]);
    }
    (indptr, indices)
}

/// [`csr_from_edges`] for a list of `(src, dst)` pairs.
pub fn csr_from_edge_pairs(
    num_nodes: usize,
    edges: &[(u32, u32)],
    undirected: bool,
) -> (Vec<i64>, Vec<i32>) {
    let (src, dst): (Vec<u32>, Vec<u32>) = edges.iter().copied().unzip();
    csr_from_edges(num_nodes, &src, &dst, undirected)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_sorted_deduplicated_rows_without_self_loops() {
        let edges = [(0, 1), (2, 1), (0, 1), (1, 1), (3, 0), (2, 0)];
        let (indptr, indices) = csr_from_edge_pairs(4, &edges, false);
        assert_eq!(indptr, vec![0, 2, 4, 4, 4]);
        assert_eq!(indices, vec![2, 3, 0, 2]);
        Csr::new(&indptr, &indices).validate().unwrap();

        let (indptr, indices) = csr_from_edge_pairs(4, &edges, true);
        // 0: {1,2,3}  1: {0,2}  2: {0,1}  3: {0}
        assert_eq!(indptr, vec![0, 3, 5, 7, 8]);
        assert_eq!(indices, vec![1, 2, 3, 0, 2, 0, 1, 0]);
        let csr = Csr::new(&indptr, &indices);
        assert_eq!(csr.degrees(), vec![3, 2, 2, 1]);
        assert_eq!(csr.neighbors(1), &[0, 2]);
    }

    #[test]
    fn transpose_reverses_edges_and_keeps_rows_sorted() {
        let edges = [(0, 1), (2, 1), (3, 0), (2, 0), (1, 3)];
        let (p, i) = csr_from_edge_pairs(4, &edges, false);
        let (tp, ti) = Csr::new(&p, &i).transpose();
        // out-neighbours: 0 -> {1}, 1 -> {3}, 2 -> {0,1}, 3 -> {0}
        assert_eq!(tp, vec![0, 1, 2, 4, 5]);
        assert_eq!(ti, vec![1, 3, 0, 1, 0]);
        let (bp, bi) = Csr::new(&tp, &ti).transpose();
        assert_eq!((bp, bi), (p, i));
    }

    #[test]
    fn validate_names_the_problem() {
        let msg = |p: &[i64], i: &[i32]| Csr::new(p, i).validate().unwrap_err().to_string();
        assert!(msg(&[], &[]).contains("'indptr': is empty"));
        assert!(msg(&[1, 1], &[0]).contains("'indptr': entry 0 = 1, expected 0"));
        assert!(msg(&[0, 2, 1], &[0]).contains("decreases at entry 2"));
        assert!(msg(&[0, 1, 1], &[]).contains("last entry = 1"));
        assert!(msg(&[0, 1, 2], &[1, 5]).contains("'indices': entry 1 = 5 is out of range 0..2"));
        assert!(msg(&[0, 2, 2], &[1, 1]).contains("row 0 is not strictly ascending: duplicate"));
        assert!(msg(&[0, 0, 2], &[1, 0]).contains("row 1 is not strictly ascending: unsorted"));
    }
}
