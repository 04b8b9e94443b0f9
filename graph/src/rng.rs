//! Seeded random streams for the generators.
//!
//! Each generator phase and each parallel chunk gets its own ChaCha8 stream derived from
//! (seed, purpose, chunk), so output depends only on the seed, never on the thread count or scheduling.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Purposes: distinct constants keep phases from sharing a stream when they use the same chunk index.
pub(crate) const CLASSES: u64 = 1;
pub(crate) const EDGES: u64 = 2;
pub(crate) const CENTROIDS: u64 = 3;
pub(crate) const FEATURES: u64 = 4;
pub(crate) const SPLITS: u64 = 5;
pub(crate) const PERMUTE: u64 = 6;

pub(crate) fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The stream for `chunk` of phase `purpose` under `seed`.
pub(crate) fn stream(seed: u64, purpose: u64, chunk: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    let mut x = seed ^ purpose.wrapping_mul(0xd1b5_4a32_d192_ed03);
    for part in key.chunks_exact_mut(8) {
        x = splitmix64(x);
        part.copy_from_slice(&x.to_le_bytes());
    }
    let mut rng = ChaCha8Rng::from_seed(key);
    rng.set_stream(chunk);
    rng
}

/// A standard normal sample pair (Box-Muller): two per call halves the transcendental work.
#[inline]
pub(crate) fn normal_pair(rng: &mut impl Rng) -> (f32, f32) {
    // 1 - u in (0, 1] keeps ln away from 0.
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    let r = (-2.0 * u1.ln()).sqrt();
    let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
    ((r * c) as f32, (r * s) as f32)
}

/// Fills `out` with standard normal samples.
pub(crate) fn fill_normal(rng: &mut impl Rng, out: &mut [f32]) {
    let mut pairs = out.chunks_exact_mut(2);
    for p in &mut pairs {
        let (a, b) = normal_pair(rng);
        p[0] = a;
        p[1] = b;
    }
    if let [last] = pairs.into_remainder() {
        *last = normal_pair(rng).0;
    }
}
