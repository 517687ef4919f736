//! Counter-based random numbers: a value is a pure hash of (seed, stream, index).
//!
//! A weight's initial value depends only on (seed, tensor name, global element index), so a
//! tensor "initialised by global index, then sharded" is the same model under every TP/PP/DP
//! layout, and any shard can be initialised without generating the others. The hash is
//! SplitMix64's finaliser (Steele et al., "Fast splittable pseudorandom number generators",
//! 2014) applied to a combination of the three inputs; normals come from Box–Muller in f64.
//!
//! This module must not hold state or depend on thread/rank identity.

/// SplitMix64 finaliser: a bijective 64-bit mixer with good avalanche.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// Stable 64-bit id of a tensor name (FNV-1a, then mixed): the `stream` of its initialiser.
pub fn stream_id(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h)
}

/// 64 random bits for element `index` of `stream` under `seed`.
#[inline]
pub fn hash3(seed: u64, stream: u64, index: u64) -> u64 {
    let key = mix64(seed.wrapping_add(GOLDEN) ^ mix64(stream));
    mix64(key.wrapping_add(index.wrapping_mul(GOLDEN)))
}

/// Uniform in the open interval (0, 1), 53 bits.
#[inline]
pub fn uniform(seed: u64, stream: u64, index: u64) -> f64 {
    ((hash3(seed, stream, index) >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
}

/// Standard normal N(0, 1) for element `index` (Box–Muller on two independent uniforms drawn
/// from indices `2·index` and `2·index + 1`).
#[inline]
pub fn normal(seed: u64, stream: u64, index: u64) -> f64 {
    let u1 = uniform(seed, stream, index.wrapping_mul(2));
    let u2 = uniform(seed, stream, index.wrapping_mul(2).wrapping_add(1));
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// `out[i] = std · N(0,1)` for global indices `first..first + out.len()` of `stream`.
pub fn fill_normal(out: &mut [f32], seed: u64, stream: u64, first: u64, std: f32) {
    let std = f64::from(std);
    for (i, o) in (first..).zip(out.iter_mut()) {
        *o = (std * normal(seed, stream, i)) as f32;
    }
}

/// `out[i] = U(-bound, bound)` for global indices `first..first + out.len()` of `stream`.
pub fn fill_uniform(out: &mut [f32], seed: u64, stream: u64, first: u64, bound: f32) {
    let bound = f64::from(bound);
    for (i, o) in (first..).zip(out.iter_mut()) {
        *o = (bound * (2.0 * uniform(seed, stream, i) - 1.0)) as f32;
    }
}

/// Inverted dropout's factor for element `index` of `stream`: 0 where the element is dropped
/// (probability `p`), `1 / (1 − p)` where it is kept, as `torch.nn.functional.dropout` scales.
/// A pure function of its inputs, so a forward, its recompute and its backward draw the same
/// mask without keeping it.
#[inline]
pub fn dropout_scale(p: f32, seed: u64, stream: u64, index: u64) -> f32 {
    if uniform(seed, stream, index) < f64::from(p) {
        0.0
    } else {
        1.0 / (1.0 - p)
    }
}

/// 64-bit FNV-1a: a stable hash (std's hasher may change between Rust releases). Keys the
/// kernel compile cache and the rendezvous token.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_depend_only_on_seed_stream_index() {
        let s = stream_id("h.0.attn.wq");
        assert_eq!(normal(7, s, 12345), normal(7, s, 12345));
        assert_ne!(normal(7, s, 12345), normal(8, s, 12345));
        assert_ne!(
            normal(7, s, 12345),
            normal(7, stream_id("h.0.attn.wk"), 12345)
        );
        assert_ne!(stream_id("h.1.mlp.w1"), stream_id("h.10.mlp.w1"));
        // A shard filled from its first global index equals the slice of the full tensor.
        let mut full = vec![0.0; 100];
        fill_normal(&mut full, 3, s, 0, 0.02);
        let mut shard = vec![0.0; 30];
        fill_normal(&mut shard, 3, s, 40, 0.02);
        assert_eq!(shard[..], full[40..70]);
    }

    #[test]
    fn normal_has_unit_moments() {
        let n = 200_000u64;
        let xs: Vec<f64> = (0..n).map(|i| normal(1, 2, i)).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        let kurt = xs.iter().map(|x| (x - mean).powi(4)).sum::<f64>() / n as f64 / var / var;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "var {var}");
        assert!((kurt - 3.0).abs() < 0.05, "kurtosis {kurt}");
        let u: f64 = (0..n).map(|i| uniform(5, 6, i)).sum::<f64>() / n as f64;
        assert!((u - 0.5).abs() < 0.005, "uniform mean {u}");
    }
}
