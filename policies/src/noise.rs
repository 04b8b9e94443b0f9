//! The gradient noise scale (McCandlish et al., "An Empirical Model of Large-Batch Training",
//! 2018, appendix A): the batch size above which a larger batch stops buying proportionally
//! fewer steps. It grows as training matures, so a policy can grow the effective batch (the
//! worker count, with a fixed batch per worker) with it.
//!
//! The squared norm of a gradient estimated on a batch of `B` samples has expectation
//! `E|G_B|^2 = |G|^2 + tr(S) / B`, where `G` is the true gradient and `S` the per-sample
//! covariance. Two measurements at batch sizes `b_small < b_big` (in data parallelism: each
//! worker's local gradient, and the all-reduced one) give unbiased estimates of both terms:
//!
//! ```text
//! |G|^2 ~ (b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small)
//! tr(S) ~ (|G_small|^2 - |G_big|^2) / (1 / b_small - 1 / b_big)
//! B_noise = tr(S) / |G|^2
//! ```
//!
//! Each estimate is noisy; the paper averages `|G|^2` and `tr(S)` separately over many steps
//! (an exponential moving average) and divides the averages. [`noise_scale_parts`] returns the
//! two terms for that; [`gradient_noise_scale`] divides one measurement's.

/// The two unbiased estimates behind the gradient noise scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NoiseScaleParts {
    /// Estimate of `|G|^2`, the squared norm of the true gradient (may come out negative on
    /// one noisy measurement).
    pub grad_sq_norm: f64,
    /// Estimate of `tr(S)`, the trace of the per-sample gradient covariance.
    pub trace_cov: f64,
}

impl NoiseScaleParts {
    /// `tr(S) / |G|^2`, or `None` unless both are positive and finite.
    pub fn noise_scale(&self) -> Option<f64> {
        let ok = |x: f64| x.is_finite() && x > 0.0;
        (ok(self.grad_sq_norm) && ok(self.trace_cov))
            .then(|| self.trace_cov / self.grad_sq_norm)
            .filter(|b| b.is_finite())
    }
}

/// The estimates of `|G|^2` and `tr(S)` from the squared gradient norms measured on batches of
/// `b_small` and `b_big` samples. `None` unless `0 < b_small < b_big` and every input is finite
/// and non-negative.
pub fn noise_scale_parts(
    b_small: f64,
    g_small_sq_norm: f64,
    b_big: f64,
    g_big_sq_norm: f64,
) -> Option<NoiseScaleParts> {
    let ok = |x: f64| x.is_finite() && x >= 0.0;
    if !(ok(b_small) && ok(b_big) && ok(g_small_sq_norm) && ok(g_big_sq_norm)) {
        return None;
    }
    if !(b_small > 0.0 && b_big > b_small) {
        return None;
    }
    let grad_sq_norm = (b_big * g_big_sq_norm - b_small * g_small_sq_norm) / (b_big - b_small);
    let trace_cov = (g_small_sq_norm - g_big_sq_norm) / (1.0 / b_small - 1.0 / b_big);
    (grad_sq_norm.is_finite() && trace_cov.is_finite()).then_some(NoiseScaleParts {
        grad_sq_norm,
        trace_cov,
    })
}

/// The simple gradient noise scale `B_noise = tr(S) / |G|^2`, in samples, from one pair of
/// measurements (see the module docs). `None` when the inputs are invalid or the estimates are
/// not both positive (too noisy to say).
pub fn gradient_noise_scale(
    b_small: f64,
    g_small_sq_norm: f64,
    b_big: f64,
    g_big_sq_norm: f64,
) -> Option<f64> {
    noise_scale_parts(b_small, g_small_sq_norm, b_big, g_big_sq_norm)?.noise_scale()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exact expectations: |G|^2 = 4, tr(S) = 100, so B_noise = 25.
    #[test]
    fn recovers_the_noise_scale_from_exact_expectations() {
        let expected = |b: f64| 4.0 + 100.0 / b;
        let parts = noise_scale_parts(10.0, expected(10.0), 100.0, expected(100.0)).unwrap();
        assert!((parts.grad_sq_norm - 4.0).abs() < 1e-12);
        assert!((parts.trace_cov - 100.0).abs() < 1e-9);
        let b = gradient_noise_scale(10.0, expected(10.0), 100.0, expected(100.0)).unwrap();
        assert!((b - 25.0).abs() < 1e-9, "{b}");
    }

    /// Per-sample gradients drawn around a known mean: averaging the two estimates over many
    /// steps, as the paper does, lands near tr(S) / |G|^2.
    #[test]
    fn estimates_the_noise_scale_of_sampled_gradients() {
        const DIM: usize = 16;
        let mean: Vec<f64> = (0..DIM)
            .map(|i| if i % 2 == 0 { 0.5 } else { -0.25 })
            .collect();
        let sigma = 2.0; // per coordinate: tr(S) = DIM * sigma^2
        let true_scale = DIM as f64 * sigma * sigma / mean.iter().map(|m| m * m).sum::<f64>();
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        let (b_small, workers) = (8usize, 8usize);
        let (mut g_sum, mut s_sum) = (0.0, 0.0);
        let steps = 400;
        for _ in 0..steps {
            let mut total = [0.0; DIM];
            let mut small_sq = 0.0;
            for _ in 0..workers {
                let mut local = [0.0; DIM];
                for _ in 0..b_small {
                    for (l, m) in local.iter_mut().zip(&mean) {
                        *l += m + sigma * rng.normal();
                    }
                }
                for (t, l) in total.iter_mut().zip(&local) {
                    *t += l;
                }
                small_sq += local
                    .iter()
                    .map(|l| (l / b_small as f64).powi(2))
                    .sum::<f64>();
            }
            let b_big = (b_small * workers) as f64;
            let big_sq = total.iter().map(|t| (t / b_big).powi(2)).sum::<f64>();
            let parts = noise_scale_parts(b_small as f64, small_sq / workers as f64, b_big, big_sq)
                .unwrap();
            g_sum += parts.grad_sq_norm;
            s_sum += parts.trace_cov;
        }
        let estimate = NoiseScaleParts {
            grad_sq_norm: g_sum / steps as f64,
            trace_cov: s_sum / steps as f64,
        }
        .noise_scale()
        .unwrap();
        let relative = (estimate - true_scale).abs() / true_scale;
        assert!(relative < 0.1, "estimate {estimate}, true {true_scale}");
    }

    #[test]
    fn rejects_invalid_inputs() {
        assert_eq!(gradient_noise_scale(10.0, 5.0, 10.0, 4.0), None);
        assert_eq!(gradient_noise_scale(100.0, 5.0, 10.0, 4.0), None);
        assert_eq!(gradient_noise_scale(0.0, 5.0, 10.0, 4.0), None);
        assert_eq!(gradient_noise_scale(1.0, f64::NAN, 10.0, 4.0), None);
        assert_eq!(gradient_noise_scale(1.0, 5.0, f64::INFINITY, 4.0), None);
        assert_eq!(gradient_noise_scale(1.0, -5.0, 10.0, 4.0), None);
        // The big batch's gradient is noisier than the small one's: no estimate.
        assert_eq!(gradient_noise_scale(1.0, 4.0, 10.0, 5.0), None);
        // Pure noise, no signal: |G|^2 estimates to 0.
        assert_eq!(gradient_noise_scale(1.0, 10.0, 10.0, 1.0), None);
    }

    /// xorshift64*, with Box-Muller normals: deterministic test noise without a dependency.
    struct XorShift(u64);

    impl XorShift {
        fn uniform(&mut self) -> f64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
            (bits as f64 + 0.5) / (1u64 << 53) as f64
        }
        fn normal(&mut self) -> f64 {
            let (u, v) = (self.uniform(), self.uniform());
            (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
        }
    }
}
