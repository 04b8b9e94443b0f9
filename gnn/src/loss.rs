//! Masked softmax cross-entropy and accuracy over a subset of rows (the training, validation or test nodes).

use rayon::prelude::*;

use crate::tensor::Matrix;

/// Sum of the cross-entropy over `rows` and the gradient of `sum / normalizer` with respect to the logits.
///
/// `normalizer` is the number of training nodes over all workers, so that partition-parallel gradients add up
/// to the single-worker mean. Rows outside `rows` get zero gradient.
pub fn cross_entropy(
    logits: &Matrix,
    labels: &[i64],
    rows: &[u32],
    normalizer: f64,
) -> (f64, Matrix) {
    let c = logits.cols();
    let mut grad = Matrix::zeros(logits.rows(), c);
    let scale = (1.0 / normalizer) as f32;
    // per-row losses written in place then summed in order: deterministic for any thread count
    let losses: Vec<f64> = rows
        .par_iter()
        .map(|&r| {
            let r = r as usize;
            let z = logits.row(r);
            let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = z.iter().map(|v| (v - max).exp()).sum();
            let lse = max + sum.ln();
            (lse - z[labels[r] as usize]) as f64
        })
        .collect();
    {
        let gd = grad.data_mut();
        for &r in rows {
            let r = r as usize;
            let z = logits.row(r);
            let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = z.iter().map(|v| (v - max).exp()).sum();
            let g = &mut gd[r * c..(r + 1) * c];
            for (gv, &zv) in g.iter_mut().zip(z) {
                *gv = (zv - max).exp() / sum * scale;
            }
            g[labels[r] as usize] -= scale;
        }
    }
    (losses.iter().sum(), grad)
}

/// Number of `rows` whose arg-max logit equals the label.
pub fn correct(logits: &Matrix, labels: &[i64], rows: &[u32]) -> usize {
    rows.par_iter()
        .filter(|&&r| {
            let z = logits.row(r as usize);
            let mut best = 0;
            for (k, &v) in z.iter().enumerate() {
                if v > z[best] {
                    best = k;
                }
            }
            best as i64 == labels[r as usize]
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_logits_give_log_classes() {
        let logits = Matrix::zeros(3, 4);
        let (loss, grad) = cross_entropy(&logits, &[0, 1, 2], &[0, 2], 2.0);
        assert!((loss / 2.0 - 4f64.ln()).abs() < 1e-6);
        assert_eq!(grad.row(1), &[0.0; 4]);
        assert!((grad.row(0)[0] - (0.25 - 1.0) / 2.0).abs() < 1e-7);
        assert_eq!(correct(&logits, &[0, 1, 2], &[0, 1, 2]), 1);
    }
}
