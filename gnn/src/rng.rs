//! Counter-based random numbers: a value is a pure function of (seed, stream, index).
//!
//! Dropout masks and initial weights are drawn this way so that they do not depend on the number of threads
//! or on the order rows are visited, and so backward can regenerate a dropout mask instead of storing it.
//! A partition-parallel worker draws the same numbers for a node as a single worker would, because the index
//! is the node's global id.

/// SplitMix64's finaliser: a bijection on u64 with good avalanche, used as a keyed hash.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A stream of random numbers identified by a key; `at(i)` is the i-th number.
#[derive(Clone, Copy, Debug)]
pub struct Stream {
    key: u64,
}

impl Stream {
    pub fn new(seed: u64, parts: &[u64]) -> Stream {
        let mut key = mix64(seed ^ 0x5048_5953_414C_4941); // "PHYSALIA"
        for &p in parts {
            key = mix64(key ^ p);
        }
        Stream { key }
    }

    /// The stream of a key taken from [`Stream::key`] (devices pass streams to their kernels as keys).
    pub fn from_key(key: u64) -> Stream {
        Stream { key }
    }

    pub fn key(&self) -> u64 {
        self.key
    }

    /// SplitMix64: the key is the stream's seed, the index its position.
    #[inline]
    pub fn at(&self, index: u64) -> u64 {
        mix64(
            self.key
                .wrapping_add(index.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        )
    }

    /// Uniform in [0, 1) with 24 bits of resolution.
    #[inline]
    pub fn uniform(&self, index: u64) -> f32 {
        (self.at(index) >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// True with probability `1 - p`: the keep decision of inverted dropout with rate `p`.
    #[inline]
    pub fn keep(&self, index: u64, threshold: u32) -> bool {
        (self.at(index) >> 32) as u32 >= threshold
    }
}

/// The `u32` threshold below which an element is dropped with rate `p`.
pub fn drop_threshold(p: f32) -> u32 {
    ((p as f64) * (u32::MAX as f64 + 1.0)).min(u32::MAX as f64) as u32
}

/// A dense dropout mask drawn four elements per hash (16 bits each, so rates resolve to 1/65536):
/// element `i` of the mask is kept when its 16-bit lane is at or above the threshold. Used on activations,
/// where one hash per element would cost as much as the layer's arithmetic.
#[derive(Clone, Copy, Debug)]
pub struct Mask {
    stream: Stream,
    threshold: u16,
}

impl Mask {
    pub fn new(stream: Stream, p: f32) -> Mask {
        Mask {
            stream,
            threshold: ((p as f64) * 65536.0).round().min(65535.0) as u16,
        }
    }

    /// Keep decisions for elements `start..start + out.len()`.
    #[inline]
    pub fn fill(&self, start: u64, out: &mut [bool]) {
        let thr = self.threshold;
        let head = (((4 - start % 4) % 4) as usize).min(out.len());
        let (head_out, rest) = out.split_at_mut(head);
        for (t, o) in head_out.iter_mut().enumerate() {
            *o = self.keep(start + t as u64);
        }
        let mut group = (start + head as u64) / 4;
        let mut chunks = rest.chunks_exact_mut(4);
        for c in &mut chunks {
            let h = self.stream.at(group);
            c[0] = h as u16 >= thr;
            c[1] = (h >> 16) as u16 >= thr;
            c[2] = (h >> 32) as u16 >= thr;
            c[3] = (h >> 48) as u16 >= thr;
            group += 1;
        }
        for (t, o) in chunks.into_remainder().iter_mut().enumerate() {
            *o = self.keep(group * 4 + t as u64);
        }
    }

    /// Inverted dropout in place on elements `start..start + values.len()`: kept values are scaled by
    /// `scale`, dropped ones zeroed. Same decisions as [`Mask::fill`].
    #[inline]
    pub fn apply(&self, start: u64, values: &mut [f32], scale: f32) {
        let thr = self.threshold;
        // `if keep { v * scale } else { 0.0 }` as a bit mask: a branch on a random half mispredicts
        let pick = |keep: bool, v: f32| {
            f32::from_bits((v * scale).to_bits() & u32::from(keep).wrapping_neg())
        };
        let head = (((4 - start % 4) % 4) as usize).min(values.len());
        let (head_vals, rest) = values.split_at_mut(head);
        for (t, v) in head_vals.iter_mut().enumerate() {
            *v = pick(self.keep(start + t as u64), *v);
        }
        let mut group = (start + head as u64) / 4;
        let mut chunks = rest.chunks_exact_mut(4);
        for c in &mut chunks {
            let h = self.stream.at(group);
            c[0] = pick(h as u16 >= thr, c[0]);
            c[1] = pick((h >> 16) as u16 >= thr, c[1]);
            c[2] = pick((h >> 32) as u16 >= thr, c[2]);
            c[3] = pick((h >> 48) as u16 >= thr, c[3]);
            group += 1;
        }
        for (t, v) in chunks.into_remainder().iter_mut().enumerate() {
            *v = pick(self.keep(group * 4 + t as u64), *v);
        }
    }

    #[inline]
    pub fn keep(&self, idx: u64) -> bool {
        let h = self.stream.at(idx / 4);
        ((h >> (16 * (idx % 4))) & 0xFFFF) as u16 >= self.threshold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_rate_matches_dropout_rate() {
        let s = Stream::new(7, &[1, 2]);
        let t = drop_threshold(0.3);
        let kept = (0..100_000u64).filter(|&i| s.keep(i, t)).count();
        assert!((kept as f64 / 100_000.0 - 0.7).abs() < 0.01, "kept {kept}");
    }

    #[test]
    fn mask_fill_matches_keep_and_rate() {
        let m = Mask::new(Stream::new(3, &[9]), 0.25);
        let mut out = vec![false; 1001];
        m.fill(7, &mut out);
        for (i, &k) in out.iter().enumerate() {
            assert_eq!(k, m.keep(7 + i as u64));
        }
        let mut v = vec![1.0f32; 1001];
        m.apply(7, &mut v, 2.0);
        for (i, &x) in v.iter().enumerate() {
            assert_eq!(x, if out[i] { 2.0 } else { 0.0 });
        }
        let mut big = vec![false; 200_000];
        m.fill(0, &mut big);
        let kept = big.iter().filter(|&&k| k).count() as f64 / 200_000.0;
        assert!((kept - 0.75).abs() < 0.01, "kept {kept}");
    }

    #[test]
    fn mask_apply_is_the_select_bit_for_bit() {
        let m = Mask::new(Stream::new(5, &[2]), 0.5);
        let vals: Vec<f32> = (0..999)
            .map(|i| match i % 5 {
                0 => -0.0,
                1 => f32::NAN,
                2 => -(i as f32) * 0.37,
                3 => f32::INFINITY,
                _ => i as f32 * 1e-3,
            })
            .collect();
        let mut keep = vec![false; vals.len()];
        m.fill(3, &mut keep);
        let mut v = vals.clone();
        m.apply(3, &mut v, 2.0);
        for i in 0..vals.len() {
            let want = if keep[i] { vals[i] * 2.0 } else { 0.0 };
            assert_eq!(v[i].to_bits(), want.to_bits(), "element {i}");
        }
    }

    #[test]
    fn streams_differ_by_key_and_repeat_by_index() {
        let a = Stream::new(1, &[0]);
        let b = Stream::new(1, &[1]);
        assert_eq!(a.at(5), a.at(5));
        assert_ne!(a.at(5), b.at(5));
        let u = a.uniform(3);
        assert!((0.0..1.0).contains(&u));
    }
}
