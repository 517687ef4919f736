//! Rotary position embedding (RoPE), "rotate-half" convention (GPT-NeoX, Hugging Face LLaMA):
//! within a head of size `hd`, element `i < hd/2` pairs with `i + hd/2` and the pair is rotated
//! by `pos · θ^(−2i/hd)`.
//!
//! Applied in place to the first `heads` heads of every row of a `(B·T, width)` buffer (the q
//! and k heads of a fused qkv activation). Backward rotates the gradient back (by −angle).
//! Must not allocate (the tables are built by `backend::rope_tables`).
//!
//! The base θ is the model's `rope_theta`; with a `rope_scaling` (Llama 3.1's `llama3` type)
//! each pair's frequency `θ^(−2i/hd)` is rescaled first, as transformers'
//! `_compute_llama3_parameters` does ([`RopeScaling::scale`]).

// The tables are host math shared by every backend: `backend::rope_tables`.
pub use crate::backend::rope_tables::{rope_inv_freq, rope_tables, rope_tables_scaled};

fn rotate(
    x: &mut [f32],
    t: usize,
    width: usize,
    heads: usize,
    hd: usize,
    cos: &[f32],
    sin: &[f32],
    dir: f32,
) {
    let half = hd / 2;
    for (row, r) in x.chunks_exact_mut(width).enumerate() {
        let pos = row % t;
        let (c, s) = (
            &cos[pos * half..(pos + 1) * half],
            &sin[pos * half..(pos + 1) * half],
        );
        for head in r[..heads * hd].chunks_exact_mut(hd) {
            let (x1, x2) = head.split_at_mut(half);
            for ((a, b), (&c, &s)) in x1.iter_mut().zip(x2.iter_mut()).zip(c.iter().zip(s)) {
                let s = dir * s;
                (*a, *b) = (*a * c - *b * s, *b * c + *a * s);
            }
        }
    }
}

/// In place: rotate the first `heads` heads of each row; `x: (B·T, width)`, row `n` has
/// position `n % t`.
pub fn rope_forward(
    x: &mut [f32],
    t: usize,
    width: usize,
    heads: usize,
    hd: usize,
    cos: &[f32],
    sin: &[f32],
) {
    rotate(x, t, width, heads, hd, cos, sin, 1.0);
}

/// In place: the gradient w.r.t. the un-rotated input (the transpose rotation).
pub fn rope_backward(
    dx: &mut [f32],
    t: usize,
    width: usize,
    heads: usize,
    hd: usize,
    cos: &[f32],
    sin: &[f32],
) {
    rotate(dx, t, width, heads, hd, cos, sin, -1.0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{fd_check, randn, weighted};
    use tessera_planner::model::RopeScaling;

    #[test]
    fn rope_gradient_matches_finite_differences_and_leaves_other_columns() {
        let (b, t, hd, heads, width) = (2, 5, 4, 2, 12);
        let (cos, sin) = rope_tables(t, hd, 10000.0);
        let x = randn(b * t * width, 1, 1.0);
        let gy = randn(b * t * width, 2, 1.0);
        let fwd = |x: &[f32]| {
            let mut y = x.to_vec();
            rope_forward(&mut y, t, width, heads, hd, &cos, &sin);
            y
        };
        let y = fwd(&x);
        // Position 0 is the identity, columns past `heads·hd` are untouched.
        assert_eq!(y[..width], x[..width]);
        assert!((0..b * t)
            .all(|r| y[r * width + 8..(r + 1) * width] == x[r * width + 8..(r + 1) * width]));
        let mut dx = gy.clone();
        rope_backward(&mut dx, t, width, heads, hd, &cos, &sin);
        fd_check("rope", &x, &dx, 1.0 / 64.0, 1e-3, 200, |x| {
            weighted(&fwd(x), &gy)
        });
    }

    /// The tables follow θ: with θ = 1e6 the angles are `pos · 1e6^(−2i/hd)`, written out here
    /// for hd = 4 (pair 0: 1, pair 1: 1e6^(−1/2) = 1e-3), not those of θ = 1e4 (pair 1: 1e-2).
    #[test]
    fn rope_tables_follow_theta() {
        let (t, hd) = (3, 4);
        let (cos6, sin6) = rope_tables(t, hd, 1e6);
        let (cos4, sin4) = rope_tables(t, hd, 1e4);
        let freq6 = [1.0f64, 1e-3];
        let freq4 = [1.0f64, 1e-2];
        for pos in 0..t {
            for i in 0..2 {
                let k = pos * 2 + i;
                let (a6, a4) = (pos as f64 * freq6[i], pos as f64 * freq4[i]);
                assert!(
                    (f64::from(cos6[k]) - a6.cos()).abs() < 1e-7,
                    "cos θ=1e6 {pos} {i}"
                );
                assert!(
                    (f64::from(sin6[k]) - a6.sin()).abs() < 1e-7,
                    "sin θ=1e6 {pos} {i}"
                );
                assert!(
                    (f64::from(cos4[k]) - a4.cos()).abs() < 1e-7,
                    "cos θ=1e4 {pos} {i}"
                );
                assert!(
                    (f64::from(sin4[k]) - a4.sin()).abs() < 1e-7,
                    "sin θ=1e4 {pos} {i}"
                );
            }
        }
        assert_ne!(sin6, sin4, "θ changes the tables");
        // Position 2, pair 1: sin(2e-3) against sin(2e-2).
        assert!((f64::from(sin6[5]) - 0.002f64.sin()).abs() < 1e-9);
    }

    /// Llama 3.1's scaling (factor 8, low 1, high 4, original context 8192), with the
    /// wavelength bands written out: a pair whose wavelength 2π/f is below 8192/4 keeps f, one
    /// above 8192/1 gets f/8, one between is interpolated with s = (8192/λ − 1)/(4 − 1).
    #[test]
    fn llama3_scaling_follows_transformers_bands() {
        use tessera_planner::model::RopeType;
        let s = RopeScaling {
            rope_type: RopeType::Llama3,
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_positions: 8192,
        };
        let (hd, theta) = (128, 500_000.0f64);
        let plain = rope_inv_freq(hd, theta, None);
        let scaled = rope_inv_freq(hd, theta, Some(&s));
        let (mut kept, mut divided, mut mixed) = (0, 0, 0);
        for (i, (&f, &g)) in plain.iter().zip(&scaled).enumerate() {
            assert_eq!(f, theta.powf(-2.0 * i as f64 / hd as f64));
            let wavelen = 2.0 * std::f64::consts::PI / f;
            let want = if wavelen < 8192.0 / 4.0 {
                kept += 1;
                f
            } else if wavelen > 8192.0 {
                divided += 1;
                f / 8.0
            } else {
                mixed += 1;
                let sm = (8192.0 / wavelen - 1.0) / 3.0;
                (1.0 - sm) * f / 8.0 + sm * f
            };
            assert!((g - want).abs() <= 1e-15 * want, "pair {i}: {g} vs {want}");
        }
        assert!(
            kept > 0 && divided > 0 && mixed > 0,
            "{kept} {divided} {mixed}"
        );
        let (c0, _) = rope_tables(5, hd, theta);
        let (c1, _) = rope_tables_scaled(5, hd, theta, None);
        assert_eq!(c0, c1, "no scaling: the same tables, bit for bit");
    }
}
