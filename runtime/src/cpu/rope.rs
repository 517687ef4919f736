//! Rotary position embedding (RoPE), "rotate-half" convention (GPT-NeoX, Hugging Face LLaMA):
//! within a head of size `hd`, element `i < hd/2` pairs with `i + hd/2` and the pair is rotated
//! by `pos · θ^(−2i/hd)`.
//!
//! Applied in place to the first `heads` heads of every row of a `(B·T, width)` buffer (the q
//! and k heads of a fused qkv activation). Backward rotates the gradient back (by −angle).
//! Must not allocate (except [`rope_tables`]).

/// `(cos, sin)`, each `(T, hd/2)`, for positions `0..t`; computed in f64, stored in f32.
pub fn rope_tables(t: usize, hd: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    assert!(
        hd.is_multiple_of(2),
        "RoPE needs an even head size, got {hd}"
    );
    let half = hd / 2;
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for pos in 0..t {
        for i in 0..half {
            let angle = pos as f64 * theta.powf(-2.0 * i as f64 / hd as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

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
}
