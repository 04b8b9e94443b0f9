//! Sparse aggregation operators: a rectangular CSR matrix from source nodes to destination nodes, with its
//! transpose, and SpMM in both directions.
//!
//! Rows are destination nodes, columns source nodes. By convention the first `n_dst` source nodes are the
//! destination nodes themselves (a single worker: all nodes; a partition: owned nodes first, halo nodes
//! after), so a self-loop of destination `i` is source column `i`. Both directions are parallel over output
//! rows and never scatter, so results are identical for any thread count; the transpose exists for that.

use std::sync::OnceLock;

use rayon::prelude::*;

pub use crate::gather::Path;
use crate::gather::{Block, as_uninit, gather};
use crate::tensor::Matrix;

/// Destination rows per rayon task in SpMM.
const SPMM_ROWS: usize = 256;

/// Outputs of this many bytes and more are written past the cache (non-temporal stores): smaller ones
/// (the 16-wide aggregations of an epoch at 300k nodes are 19 MiB) may still be in L2 or L3 for the
/// operation that reads them next.
const STREAM_OUTPUT_BYTES: usize = 64 << 20;

/// How edge weights are derived from the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    /// GCN: self-loops added, weight `1 / sqrt(deg(i) deg(j))` with degrees counting the self-loop.
    Symmetric,
    /// GraphSAGE mean: no self-loops, weight `1 / deg(i)` (a node without neighbours aggregates zero).
    Mean,
    /// GAT's structure: self-loops added, weight 1 (attention supplies the weights).
    SelfLoopsOnly,
}

#[derive(Clone, Debug)]
pub struct SparseOp {
    n_dst: usize,
    n_src: usize,
    indptr: Vec<usize>,
    indices: Vec<u32>,
    values: Vec<f32>,
    /// Empty when `symmetric`.
    t_indptr: Vec<usize>,
    /// Empty when `symmetric`.
    t_indices: Vec<u32>,
    /// The operator equals its transpose entry for entry and weight for weight (GCN's normalised adjacency
    /// of an undirected graph): the transposed arrays are the forward ones, not held twice (issue 34: 96 MB
    /// at 1M nodes), and `A^T X` is `A X` bit for bit.
    symmetric: bool,
    /// For each transposed entry, its position in the forward arrays (to read per-edge values, e.g. attention).
    /// Built on first use: only GAT's attention reads it, and GCN and GraphSAGE would hold it for nothing
    /// (4 bytes an edge).
    t_perm: OnceLock<Vec<u32>>,
    t_values: TValues,
}

/// The transpose's weights: one per entry, or (when every entry of a forward row has the same weight, as
/// in GraphSAGE's mean and GAT's structure) one per forward row, read through the entry's row index, so
/// the transpose holds no weight per edge. Either way an entry's weight is the same `f32`.
#[derive(Clone, Debug)]
enum TValues {
    Entry(Vec<f32>),
    Row(Vec<f32>),
}

impl SparseOp {
    /// Builds the operator for `n_dst` destination rows of an in-neighbour CSR (`indptr[i]..indptr[i+1]` are the
    /// sources of edges into `i`, as source indices below `n_src`). `src_in_degree` gives the in-degree (without
    /// self-loop) of every source node when some sources are not destination rows here (halo nodes); `None`
    /// takes it from the rows, which requires `n_src == n_dst`.
    pub fn build(
        n_dst: usize,
        n_src: usize,
        indptr: &[i64],
        indices: &[i32],
        norm: Norm,
        src_in_degree: Option<&[u32]>,
    ) -> SparseOp {
        assert!(
            n_dst <= n_src,
            "destinations must be a prefix of the sources"
        );
        assert_eq!(
            indptr.len(),
            n_dst + 1,
            "indptr must have n_dst + 1 entries"
        );
        let self_loops = norm != Norm::Mean;
        let mut out_indptr = Vec::with_capacity(n_dst + 1);
        out_indptr.push(0usize);
        let extra = if self_loops { n_dst } else { 0 };
        let mut out_indices: Vec<u32> = Vec::with_capacity(indices.len() + extra);
        for i in 0..n_dst {
            let row = &indices[indptr[i] as usize..indptr[i + 1] as usize];
            let mut placed = !self_loops;
            for &j in row {
                let j = j as u32;
                if j as usize == i {
                    // the graph format has no self-loops; tolerate one instead of doubling it
                    if self_loops && !placed {
                        out_indices.push(j);
                        placed = true;
                    }
                    continue;
                }
                if !placed && j as usize > i {
                    out_indices.push(i as u32);
                    placed = true;
                }
                out_indices.push(j);
            }
            if !placed {
                out_indices.push(i as u32);
            }
            out_indptr.push(out_indices.len());
        }
        let row_deg =
            |i: usize| (indptr[i + 1] - indptr[i]) as u32 - row_has_self(indptr, indices, i) as u32;
        let values: Vec<f32> = match norm {
            Norm::SelfLoopsOnly => vec![1.0; out_indices.len()],
            Norm::Mean => {
                let mut v = Vec::with_capacity(out_indices.len());
                for i in 0..n_dst {
                    let len = out_indptr[i + 1] - out_indptr[i];
                    let w = if len == 0 { 0.0 } else { 1.0 / len as f32 };
                    v.extend(std::iter::repeat_n(w, len));
                }
                v
            }
            Norm::Symmetric => {
                let src_deg: Vec<f32> = (0..n_src)
                    .map(|j| {
                        let d = match src_in_degree {
                            Some(d) => d[j],
                            None => {
                                assert_eq!(
                                    n_src, n_dst,
                                    "source degrees are needed when n_src > n_dst"
                                );
                                row_deg(j)
                            }
                        };
                        1.0 / ((d + 1) as f32).sqrt()
                    })
                    .collect();
                let mut v = Vec::with_capacity(out_indices.len());
                for i in 0..n_dst {
                    let di = src_deg[i];
                    for &j in &out_indices[out_indptr[i]..out_indptr[i + 1]] {
                        v.push(di * src_deg[j as usize]);
                    }
                }
                v
            }
        };
        SparseOp::from_parts(n_dst, n_src, out_indptr, out_indices, values)
    }

    /// Builds from explicit CSR arrays (sorted rows) and computes the transpose.
    pub fn from_parts(
        n_dst: usize,
        n_src: usize,
        indptr: Vec<usize>,
        indices: Vec<u32>,
        values: Vec<f32>,
    ) -> SparseOp {
        assert_eq!(indptr.len(), n_dst + 1);
        assert_eq!(indices.len(), values.len());
        let nnz = indices.len();
        let mut counts = vec![0usize; n_src + 1];
        for &j in &indices {
            counts[j as usize + 1] += 1;
        }
        for j in 0..n_src {
            counts[j + 1] += counts[j];
        }
        let t_indptr = counts.clone();
        let mut next = counts;
        let uniform_rows = (0..n_dst).all(|i| {
            let row = &values[indptr[i]..indptr[i + 1]];
            row.iter().all(|v| v.to_bits() == row[0].to_bits())
        });
        let mut t_indices = vec![0u32; nnz];
        let mut entry_values = if uniform_rows {
            Vec::new()
        } else {
            vec![0f32; nnz]
        };
        for i in 0..n_dst {
            for k in indptr[i]..indptr[i + 1] {
                let j = indices[k] as usize;
                let pos = next[j];
                next[j] += 1;
                t_indices[pos] = i as u32;
                if !uniform_rows {
                    entry_values[pos] = values[k];
                }
            }
        }
        let symmetric = !uniform_rows
            && n_dst == n_src
            && t_indptr == indptr
            && t_indices == indices
            && entry_values
                .iter()
                .zip(&values)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        let (t_indptr, t_indices, t_values) = if symmetric {
            (Vec::new(), Vec::new(), TValues::Entry(Vec::new()))
        } else if uniform_rows {
            let rows = (0..n_dst)
                .map(|i| values.get(indptr[i]).copied().unwrap_or(0.0))
                .collect();
            (t_indptr, t_indices, TValues::Row(rows))
        } else {
            (t_indptr, t_indices, TValues::Entry(entry_values))
        };
        SparseOp {
            n_dst,
            n_src,
            indptr,
            indices,
            values,
            t_indptr,
            t_indices,
            symmetric,
            t_perm: OnceLock::new(),
            t_values,
        }
    }

    /// Scales every entry of row `i` except its self-loop (column `i`) by `scale[i]`.
    pub fn rescale_neighbours(self, scale: &[f32]) -> SparseOp {
        assert_eq!(scale.len(), self.n_dst, "one scale per destination row");
        let SparseOp {
            n_dst,
            n_src,
            indptr,
            indices,
            mut values,
            ..
        } = self;
        for i in 0..n_dst {
            if scale[i] == 1.0 {
                continue;
            }
            for k in indptr[i]..indptr[i + 1] {
                if indices[k] as usize != i {
                    values[k] *= scale[i];
                }
            }
        }
        SparseOp::from_parts(n_dst, n_src, indptr, indices, values)
    }

    pub fn n_dst(&self) -> usize {
        self.n_dst
    }
    pub fn n_src(&self) -> usize {
        self.n_src
    }
    pub fn nnz(&self) -> usize {
        self.indices.len()
    }
    pub fn indptr(&self) -> &[usize] {
        &self.indptr
    }
    pub fn indices(&self) -> &[u32] {
        &self.indices
    }
    pub fn values(&self) -> &[f32] {
        &self.values
    }
    pub fn t_indptr(&self) -> &[usize] {
        if self.symmetric {
            &self.indptr
        } else {
            &self.t_indptr
        }
    }
    pub fn t_indices(&self) -> &[u32] {
        if self.symmetric {
            &self.indices
        } else {
            &self.t_indices
        }
    }
    /// Whether the operator is its own transpose (see the field).
    pub fn is_symmetric(&self) -> bool {
        self.symmetric
    }
    /// For each transposed entry, its position in the forward arrays; built on the first call, in the order
    /// the transpose was filled (rows ascending, entries in row order).
    pub fn t_perm(&self) -> &[u32] {
        self.t_perm.get_or_init(|| {
            let mut next = self.t_indptr().to_vec();
            let mut t_perm = vec![0u32; self.nnz()];
            for i in 0..self.n_dst {
                for k in self.indptr[i]..self.indptr[i + 1] {
                    let j = self.indices[k] as usize;
                    t_perm[next[j]] = k as u32;
                    next[j] += 1;
                }
            }
            t_perm
        })
    }

    /// Bytes held, for memory accounting.
    pub fn memory_bytes(&self) -> usize {
        let t_perm = self.t_perm.get().map_or(0, |p| p.len() * 4);
        let t_values = match &self.t_values {
            TValues::Entry(v) | TValues::Row(v) => v.len() * 4,
        };
        let t_indices = self.t_indices.len() * 4;
        (self.indptr.len() + self.t_indptr.len()) * 8
            + self.nnz() * 4 * 2
            + t_indices
            + t_values
            + t_perm
    }

    /// `Y = A X`: X has `n_src` rows, Y `n_dst` rows.
    pub fn spmm(&self, x: &Matrix) -> Matrix {
        assert_eq!(x.rows(), self.n_src, "spmm input rows must equal n_src");
        self.spmm_ext(x, None)
    }

    /// `Y = A [own; halo]`: the sources are the owned rows followed by the halo rows, without copying them
    /// into one matrix.
    pub fn spmm_ext(&self, own: &Matrix, halo: Option<&Matrix>) -> Matrix {
        let d = own.cols();
        let halo_data: &[f32] = halo.map(|h| h.data()).unwrap_or(&[]);
        assert_eq!(
            own.rows() + halo_data.len() / d.max(1),
            self.n_src,
            "spmm sources must be n_src rows"
        );
        if let Some(h) = halo {
            assert_eq!(h.cols(), d, "halo rows must have the width of owned rows");
        }
        let src = Src {
            own: own.data(),
            halo: halo_data,
            n_own: own.rows(),
            d,
        };
        spmm_rows(&self.indptr, &self.indices, |k, _| self.values[k], &src)
    }

    /// `Y += A[:, col0..col0 + X.rows()] X`: the part of the aggregation over one contiguous range of source
    /// columns (sequential aggregation: owned rows, then one peer's halo rows at a time). Rows are sorted, so
    /// each row's entries in the range are contiguous, and adding the ranges in ascending order sums every
    /// row's terms in the order [`SparseOp::spmm`] does.
    pub fn spmm_cols_into(&self, x: &Matrix, col0: usize, y: &mut Matrix) {
        let d = x.cols();
        let col1 = col0 + x.rows();
        assert!(col1 <= self.n_src, "source columns beyond n_src");
        assert_eq!(y.shape(), (self.n_dst, d), "spmm_cols_into output shape");
        if d == 0 {
            return;
        }
        let (indptr, indices, values) = (&self.indptr, &self.indices, &self.values);
        let xd = x.data();
        let path = Path::detect();
        y.data_mut()
            .par_chunks_mut(SPMM_ROWS * d)
            .enumerate()
            .for_each(|(chunk, out)| {
                gather(
                    path,
                    Block {
                        out: as_uninit(out),
                        first: chunk * SPMM_ROWS,
                        d,
                        accumulate: true,
                        entries: |i| col_range(indices, indptr[i], indptr[i + 1], col0, col1),
                        indices,
                        weight: |k, _| values[k],
                        row: |j| &xd[(j - col0) * d..(j - col0 + 1) * d],
                        stream: false,
                        // entries outside the column range have no row here
                        prefetch: false,
                    },
                )
            });
    }

    /// Rows `src0..src1` of `A^T X` (X has `n_dst` rows): the gradients of one range of sources.
    pub fn spmm_t_range(&self, x: &Matrix, src0: usize, src1: usize) -> Matrix {
        assert_eq!(x.rows(), self.n_dst, "spmm_t input rows must equal n_dst");
        assert!(
            src0 <= src1 && src1 <= self.n_src,
            "source range beyond n_src"
        );
        let src = Src {
            own: x.data(),
            halo: &[],
            n_own: x.rows(),
            d: x.cols(),
        };
        self.spmm_t_rows(&self.t_indptr()[src0..=src1], &src)
    }

    /// `Y = A^T X`: X has `n_dst` rows, Y `n_src` rows.
    pub fn spmm_t(&self, x: &Matrix) -> Matrix {
        assert_eq!(x.rows(), self.n_dst, "spmm_t input rows must equal n_dst");
        let src = Src {
            own: x.data(),
            halo: &[],
            n_own: x.rows(),
            d: x.cols(),
        };
        self.spmm_t_rows(self.t_indptr(), &src)
    }
}

impl SparseOp {
    /// The transpose's rows `t_indptr` (a window of it) times `x`, with the transpose's weights.
    fn spmm_t_rows(&self, t_indptr: &[usize], x: &Src<'_>) -> Matrix {
        if self.symmetric {
            return spmm_rows(t_indptr, &self.indices, |k, _| self.values[k], x);
        }
        match &self.t_values {
            TValues::Entry(v) => spmm_rows(t_indptr, &self.t_indices, |k, _| v[k], x),
            TValues::Row(v) => spmm_rows(t_indptr, &self.t_indices, |_, i| v[i], x),
        }
    }
}

/// The entries `lo..hi` of a sorted row whose columns lie in `col0..col1`.
#[inline]
pub(crate) fn col_range(
    indices: &[u32],
    start: usize,
    end: usize,
    col0: usize,
    col1: usize,
) -> (usize, usize) {
    let row = &indices[start..end];
    let lo = row.partition_point(|&j| (j as usize) < col0);
    let hi = lo + row[lo..].partition_point(|&j| (j as usize) < col1);
    (start + lo, start + hi)
}

fn row_has_self(indptr: &[i64], indices: &[i32], i: usize) -> bool {
    indices[indptr[i] as usize..indptr[i + 1] as usize]
        .binary_search(&(i as i32))
        .is_ok()
}

/// Source rows split into owned rows and halo rows.
pub(crate) struct Src<'a> {
    pub own: &'a [f32],
    pub halo: &'a [f32],
    pub n_own: usize,
    pub d: usize,
}

impl Src<'_> {
    #[inline]
    pub fn row(&self, j: usize) -> &[f32] {
        if j < self.n_own {
            &self.own[j * self.d..(j + 1) * self.d]
        } else {
            let j = j - self.n_own;
            &self.halo[j * self.d..(j + 1) * self.d]
        }
    }
}

/// `A x` over the rows `indptr` of a CSR; `weight(k, j)` is entry `k`'s weight (`j` its column).
///
/// The output is never zeroed: the kernel overwrites every float of it, so zeroing first would be a whole
/// extra pass over it (a serial `memset` on a reused heap block).
fn spmm_rows<W: Fn(usize, usize) -> f32 + Sync>(
    indptr: &[usize],
    indices: &[u32],
    weight: W,
    x: &Src<'_>,
) -> Matrix {
    let (rows, d) = (indptr.len() - 1, x.d);
    if d == 0 || rows == 0 {
        return Matrix::zeros(rows, d);
    }
    let path = Path::detect();
    let mut y: Vec<f32> = Vec::with_capacity(rows * d);
    y.spare_capacity_mut()[..rows * d]
        .par_chunks_mut(SPMM_ROWS * d)
        .enumerate()
        .for_each(|(chunk, out)| {
            gather(
                path,
                Block {
                    out,
                    first: chunk * SPMM_ROWS,
                    d,
                    accumulate: false,
                    entries: |i| (indptr[i], indptr[i + 1]),
                    indices,
                    weight: &weight,
                    row: |j| x.row(j),
                    stream: rows * d * 4 >= STREAM_OUTPUT_BYTES,
                    prefetch: true,
                },
            )
        });
    // SAFETY: the gather overwrote every float of the `rows * d` (`accumulate: false`)
    unsafe { y.set_len(rows * d) };
    Matrix::from_vec(rows, d, y)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Path 0-1-2 plus isolated node 3, as an in-neighbour CSR.
    fn path() -> (Vec<i64>, Vec<i32>) {
        (vec![0, 1, 3, 4, 4], vec![1, 0, 2, 1])
    }

    #[test]
    fn symmetric_norm_matches_definition() {
        let (p, i) = path();
        let a = SparseOp::build(4, 4, &p, &i, Norm::Symmetric, None);
        // degrees with self-loops: 2, 3, 2, 1
        assert_eq!(a.indptr(), &[0, 2, 5, 7, 8]);
        assert_eq!(a.indices(), &[0, 1, 0, 1, 2, 1, 2, 3]);
        let want = [
            0.5,
            1.0 / 6f32.sqrt(),
            1.0 / 6f32.sqrt(),
            1.0 / 3.0,
            1.0 / 6f32.sqrt(),
        ];
        for (got, want) in a.values().iter().zip(want) {
            assert!((got - want).abs() < 1e-6);
        }
        assert_eq!(a.values()[7], 1.0);
    }

    #[test]
    fn mean_norm_and_transpose() {
        let (p, i) = path();
        let a = SparseOp::build(4, 4, &p, &i, Norm::Mean, None);
        assert_eq!(a.values(), &[1.0, 0.5, 0.5, 1.0]);
        let x = Matrix::from_vec(4, 2, vec![1., 2., 3., 4., 5., 6., 7., 8.]);
        let y = a.spmm(&x);
        assert_eq!(y.data(), &[3., 4., 3., 4., 3., 4., 0., 0.]);
        // <A x, z> == <x, A^T z>
        let z = Matrix::from_vec(4, 2, vec![1., -1., 2., 0.5, -3., 1., 0.25, 2.]);
        let lhs: f32 = y.data().iter().zip(z.data()).map(|(a, b)| a * b).sum();
        let atz = a.spmm_t(&z);
        let rhs: f32 = x.data().iter().zip(atz.data()).map(|(a, b)| a * b).sum();
        assert!((lhs - rhs).abs() < 1e-5);
    }

    #[test]
    fn column_ranges_sum_to_the_whole_product() {
        // two owned rows, three halo sources in two ranges (as two peers would send them)
        let a = SparseOp::build(
            2,
            5,
            &[0, 3, 6],
            &[1, 2, 4, 0, 3, 4],
            Norm::Symmetric,
            Some(&[2, 2, 3, 1, 4]),
        );
        let x = Matrix::from_vec(5, 2, (0..10).map(|v| v as f32 * 0.5 - 1.0).collect());
        let whole = a.spmm(&x);
        let mut y = Matrix::zeros(2, 2);
        a.spmm_cols_into(&x.row_block(0, 2), 0, &mut y);
        a.spmm_cols_into(&x.row_block(2, 4), 2, &mut y);
        a.spmm_cols_into(&x.row_block(4, 5), 4, &mut y);
        assert_eq!(
            y.data(),
            whole.data(),
            "ascending ranges add terms in spmm's order"
        );
        let z = Matrix::from_vec(2, 2, vec![1.0, -2.0, 0.5, 3.0]);
        let t = a.spmm_t(&z);
        let mut parts = a.spmm_t_range(&z, 0, 2).into_vec();
        parts.extend(a.spmm_t_range(&z, 2, 4).into_vec());
        parts.extend(a.spmm_t_range(&z, 4, 5).into_vec());
        assert_eq!(parts, t.data());
    }

    /// `A X` and `A^T X` over many row blocks (the output never zeroed first) are each output float's
    /// weighted sum in entry order, bit for bit, on the path this CPU picks.
    #[test]
    fn spmm_over_many_blocks_is_the_weighted_sum_in_entry_order() {
        let n = 3 * SPMM_ROWS + 17;
        let mut s = 12345u64;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let mut indptr = vec![0i64];
        let mut indices = vec![];
        for i in 0..n {
            let mut row: Vec<i32> = (0..next() % 12)
                .map(|_| (next() % n as u32) as i32)
                .filter(|&j| j != i as i32)
                .collect();
            row.sort_unstable();
            row.dedup();
            indices.extend(row);
            indptr.push(indices.len() as i64);
        }
        let a = SparseOp::build(n, n, &indptr, &indices, Norm::Symmetric, None);
        for d in [1, 16, 40] {
            let x = Matrix::from_vec(
                n,
                d,
                (0..n * d)
                    .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                    .collect(),
            );
            let (y, yt) = (a.spmm(&x), a.spmm_t(&x));
            let mut want = vec![0f32; n * d];
            let mut want_t = vec![0f32; n * d];
            for i in 0..n {
                for k in a.indptr()[i]..a.indptr()[i + 1] {
                    let j = a.indices()[k] as usize;
                    for c in 0..d {
                        want[i * d + c] += a.values()[k] * x.row(j)[c];
                    }
                }
            }
            for j in 0..n {
                for t in a.t_indptr()[j]..a.t_indptr()[j + 1] {
                    let (i, k) = (a.t_indices()[t] as usize, a.t_perm()[t] as usize);
                    for c in 0..d {
                        want_t[j * d + c] += a.values()[k] * x.row(i)[c];
                    }
                }
            }
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(y.data()), bits(&want), "A X at width {d}");
            assert_eq!(bits(yt.data()), bits(&want_t), "A^T X at width {d}");
        }
    }

    #[test]
    fn rectangular_with_halo_degrees() {
        // two owned nodes 0,1; halo node 2 (global degree 5) feeds node 1
        let a = SparseOp::build(
            2,
            3,
            &[0, 1, 3],
            &[1, 0, 2],
            Norm::Symmetric,
            Some(&[1, 2, 5]),
        );
        assert_eq!(a.indices(), &[0, 1, 0, 1, 2]);
        let w = a.values()[4];
        assert!((w - 1.0 / (3f32 * 6.0).sqrt()).abs() < 1e-6);
        assert_eq!(a.t_indptr(), &[0, 2, 4, 5]);
        // built on first use: each transposed entry names its forward entry
        for j in 0..3 {
            for t in a.t_indptr()[j]..a.t_indptr()[j + 1] {
                let k = a.t_perm()[t] as usize;
                assert_eq!(a.indices()[k] as usize, j);
                let i = a.t_indices()[t] as usize;
                assert!((a.indptr()[i]..a.indptr()[i + 1]).contains(&k));
            }
        }
    }

    #[test]
    fn a_symmetric_operator_holds_its_transpose_once_and_multiplies_it_alike() {
        // GCN's normalised adjacency of an undirected graph (both directions of every edge) is symmetric
        let edges = [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2), (4, 1)];
        let n = 5;
        let mut rows = vec![Vec::new(); n];
        for &(a, b) in &edges {
            rows[a].push(b as i32);
            rows[b].push(a as i32);
        }
        let mut indptr = vec![0i64];
        let mut indices = Vec::new();
        for r in &mut rows {
            r.sort();
            indices.extend_from_slice(r);
            indptr.push(indices.len() as i64);
        }
        let gcn = SparseOp::build(n, n, &indptr, &indices, Norm::Symmetric, None);
        assert!(gcn.is_symmetric());
        assert_eq!(gcn.t_indptr(), gcn.indptr());
        assert_eq!(gcn.t_indices(), gcn.indices());
        let x = Matrix::from_vec(n, 3, (0..n * 3).map(|i| i as f32 * 0.37 - 1.0).collect());
        assert_eq!(gcn.spmm_t(&x), gcn.spmm(&x));
        assert_eq!(
            gcn.spmm_t_range(&x, 1, 4).data(),
            &gcn.spmm(&x).data()[3..12]
        );
        // the transposed entry `t` is forward entry `t_perm[t]` of the mirrored position
        let perm = gcn.t_perm();
        for j in 0..n {
            for t in gcn.t_indptr()[j]..gcn.t_indptr()[j + 1] {
                let i = gcn.t_indices()[t] as usize;
                let k = perm[t] as usize;
                assert!((gcn.indptr()[i]..gcn.indptr()[i + 1]).contains(&k));
                assert_eq!(gcn.indices()[k] as usize, j);
            }
        }
        // the mean is not: its rows hold 1 / degree
        let sage = SparseOp::build(n, n, &indptr, &indices, Norm::Mean, None);
        assert!(!sage.is_symmetric());
        assert!(sage.memory_bytes() > gcn.memory_bytes() - gcn.nnz() * 4);
    }
}
