//! A dense row-major f32 matrix: the one tensor type the CPU engine needs.
//!
//! Node features, activations, weights and gradients are all 2-D; a bias is a `1 x n` matrix. Keeping one
//! plain type (no strides, no views) keeps every kernel a loop over contiguous rows.

use rayon::prelude::*;

/// Rows processed per rayon task by the elementwise kernels: large enough to amortise scheduling,
/// small enough to balance two to sixteen threads.
pub(crate) const ELEMENTWISE_CHUNK: usize = 1 << 14;

#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    data: Vec<f32>,
}

impl Matrix {
    pub fn zeros(rows: usize, cols: usize) -> Matrix {
        Matrix {
            rows,
            cols,
            data: vec![0.0; rows * cols],
        }
    }

    /// Wraps `data` (row-major). Panics if the length is not `rows * cols`: callers build it from the shape.
    pub fn from_vec(rows: usize, cols: usize, data: Vec<f32>) -> Matrix {
        assert_eq!(
            data.len(),
            rows * cols,
            "matrix data length must equal rows * cols"
        );
        Matrix { rows, cols, data }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    pub fn data(&self) -> &[f32] {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }

    pub fn into_vec(self) -> Vec<f32> {
        self.data
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }

    pub fn row_mut(&mut self, i: usize) -> &mut [f32] {
        &mut self.data[i * self.cols..(i + 1) * self.cols]
    }

    pub fn fill(&mut self, v: f32) {
        self.data
            .par_iter_mut()
            .with_min_len(ELEMENTWISE_CHUNK)
            .for_each(|x| *x = v);
    }

    /// `self += other`, elementwise.
    pub fn add_assign(&mut self, other: &Matrix) {
        assert_eq!(self.shape(), other.shape(), "add_assign shapes differ");
        self.data
            .par_iter_mut()
            .with_min_len(ELEMENTWISE_CHUNK)
            .zip(other.data.par_iter())
            .for_each(|(a, b)| *a += *b);
    }

    /// `self *= s`, elementwise.
    pub fn scale(&mut self, s: f32) {
        self.data
            .par_iter_mut()
            .with_min_len(ELEMENTWISE_CHUNK)
            .for_each(|x| *x *= s);
    }

    /// `[a | b]`: the columns of `a` followed by those of `b`.
    pub fn concat_cols(a: &Matrix, b: &Matrix) -> Matrix {
        assert_eq!(a.rows, b.rows, "concat_cols row counts differ");
        let cols = a.cols + b.cols;
        let mut out = Matrix::zeros(a.rows, cols);
        out.data
            .par_chunks_mut(cols.max(1))
            .enumerate()
            .with_min_len(256)
            .for_each(|(i, row)| {
                row[..a.cols].copy_from_slice(a.row(i));
                row[a.cols..].copy_from_slice(b.row(i));
            });
        out
    }

    /// Splits into the first `left` columns and the rest.
    pub fn split_cols(&self, left: usize) -> (Matrix, Matrix) {
        assert!(left <= self.cols, "split_cols beyond the last column");
        let right = self.cols - left;
        let mut a = Matrix::zeros(self.rows, left);
        let mut b = Matrix::zeros(self.rows, right);
        a.data
            .par_chunks_mut(left.max(1))
            .zip(b.data.par_chunks_mut(right.max(1)))
            .enumerate()
            .with_min_len(256)
            .for_each(|(i, (ra, rb))| {
                let row = self.row(i);
                ra.copy_from_slice(&row[..left]);
                rb.copy_from_slice(&row[left..]);
            });
        (a, b)
    }

    /// [`Matrix::split_cols`] reusing this matrix's buffer for the left columns: only the right columns are
    /// allocated, so the split never holds both halves twice (a wide activation's transient peak).
    pub fn split_off_cols(self, left: usize) -> (Matrix, Matrix) {
        assert!(left <= self.cols, "split_off_cols beyond the last column");
        let (rows, cols) = (self.rows, self.cols);
        let right = cols - left;
        let mut b = Matrix::zeros(rows, right);
        b.data
            .par_chunks_mut(right.max(1))
            .enumerate()
            .with_min_len(256)
            .for_each(|(i, rb)| rb.copy_from_slice(&self.row(i)[left..]));
        let mut data = self.data;
        // row i's left part moves from i * cols to i * left, never past a row not yet moved
        for i in 1..rows {
            data.copy_within(i * cols..i * cols + left, i * left);
        }
        data.truncate(rows * left);
        data.shrink_to_fit();
        (Matrix::from_vec(rows, left, data), b)
    }

    /// Divides each row by its sum where the sum is nonzero (Kipf & Welling's feature preprocessing).
    pub fn row_normalize(&mut self) {
        let cols = self.cols.max(1);
        self.data
            .par_chunks_mut(cols)
            .with_min_len(256)
            .for_each(|row| {
                let s: f32 = row.iter().sum();
                if s != 0.0 {
                    row.iter_mut().for_each(|v| *v /= s);
                }
            });
    }

    /// Rows `r0..r1` as a new matrix.
    pub fn row_block(&self, r0: usize, r1: usize) -> Matrix {
        Matrix::from_vec(
            r1 - r0,
            self.cols,
            self.data[r0 * self.cols..r1 * self.cols].to_vec(),
        )
    }

    /// `self += other` on the calling thread (for small matrices inside parallel tasks).
    pub fn add_assign_serial(&mut self, other: &Matrix) {
        assert_eq!(self.shape(), other.shape(), "add_assign shapes differ");
        for (a, b) in self.data.iter_mut().zip(&other.data) {
            *a += *b;
        }
    }

    /// Column sums on the calling thread.
    pub fn column_sums_serial(&self) -> Matrix {
        let mut acc = vec![0f64; self.cols];
        for row in self.data.chunks_exact(self.cols.max(1)) {
            for (a, &v) in acc.iter_mut().zip(row) {
                *a += v as f64;
            }
        }
        Matrix::from_vec(1, self.cols, acc.into_iter().map(|v| v as f32).collect())
    }

    /// Rows `0..n` as a new matrix.
    pub fn top_rows(&self, n: usize) -> Matrix {
        Matrix::from_vec(n, self.cols, self.data[..n * self.cols].to_vec())
    }

    /// Sum over rows: a `1 x cols` matrix. Summed in fixed row blocks so the result does not depend on
    /// the number of threads.
    pub fn column_sums(&self) -> Matrix {
        let cols = self.cols;
        if cols == 0 {
            return Matrix::zeros(1, 0);
        }
        let partials: Vec<Vec<f64>> = self
            .data
            .par_chunks(ELEMENTWISE_CHUNK.max(cols) / cols * cols)
            .map(|chunk| {
                let mut acc = vec![0f64; cols];
                for row in chunk.chunks_exact(cols) {
                    for (a, &v) in acc.iter_mut().zip(row) {
                        *a += v as f64;
                    }
                }
                acc
            })
            .collect();
        let mut out = vec![0f64; cols];
        for p in partials {
            for (o, v) in out.iter_mut().zip(p) {
                *o += v;
            }
        }
        Matrix::from_vec(1, cols, out.into_iter().map(|v| v as f32).collect())
    }

    /// Largest absolute elementwise difference, for tests and exactness checks.
    pub fn max_abs_diff(&self, other: &Matrix) -> f32 {
        assert_eq!(self.shape(), other.shape(), "max_abs_diff shapes differ");
        self.data
            .iter()
            .zip(&other.data)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max)
    }

    pub fn max_abs(&self) -> f32 {
        self.data.iter().map(|a| a.abs()).fold(0.0, f32::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_off_cols_equals_split_cols() {
        for &(rows, cols, left) in &[(0, 3, 1), (1, 5, 2), (1000, 32, 16), (999, 7, 6)] {
            let m = Matrix::from_vec(
                rows,
                cols,
                (0..rows * cols).map(|v| v as f32 * 0.25).collect(),
            );
            let want = m.split_cols(left);
            assert_eq!(m.split_off_cols(left), want);
        }
    }
}
