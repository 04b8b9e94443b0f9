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

    #[inline]
    pub fn at(&self, index: u64) -> u64 {
        mix64(self.key ^ mix64(index))
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
    fn streams_differ_by_key_and_repeat_by_index() {
        let a = Stream::new(1, &[0]);
        let b = Stream::new(1, &[1]);
        assert_eq!(a.at(5), a.at(5));
        assert_ne!(a.at(5), b.at(5));
        let u = a.uniform(3);
        assert!((0.0..1.0).contains(&u));
    }
}
