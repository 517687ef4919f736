//! LayerNorm and RMSNorm over the last dimension C, forward and backward.
//!
//! Shapes: `inp, out, dinp, dout: (N, C)`; `mean, rstd: (N)`; `weight, bias: (C)`.
//! Backward ACCUMULATES into `dinp` (so the caller can pre-load the residual gradient) and into
//! the parameter gradients. Must not allocate.

use super::{dot, sum};

/// `out = (inp − mean) · rstd · weight + bias`, saving `mean` and `rstd` per row.
pub fn layernorm_forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    c: usize,
    eps: f32,
) {
    let rows = out.chunks_exact_mut(c).zip(inp.chunks_exact(c));
    for ((o, x), (m, r)) in rows.zip(mean.iter_mut().zip(rstd.iter_mut())) {
        let mu = sum(x) / c as f32;
        let var = x.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / c as f32;
        let rs = 1.0 / (var + eps).sqrt();
        for ((o, &x), &w) in o.iter_mut().zip(x).zip(weight) {
            *o = (x - mu) * rs * w;
        }
        if let Some(b) = bias {
            o.iter_mut().zip(b).for_each(|(o, b)| *o += b);
        }
        (*m, *r) = (mu, rs);
    }
}

/// Gradients of [`layernorm_forward`]: `dinp += …`, `dweight += Σ dout·x̂`, `dbias += Σ dout`.
pub fn layernorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    mut dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    c: usize,
) {
    let rows = dinp
        .chunks_exact_mut(c)
        .zip(dout.chunks_exact(c))
        .zip(inp.chunks_exact(c));
    for (((dx, dy), x), (&mu, &rs)) in rows.zip(mean.iter().zip(rstd)) {
        // x̂ = (x − μ)·rstd; g = w·dy; dx = rstd·(g − mean(g) − x̂·mean(g·x̂))
        let (mut g_mean, mut gx_mean) = (0.0f32, 0.0f32);
        for ((&dy, &w), &x) in dy.iter().zip(weight).zip(x) {
            let g = w * dy;
            g_mean += g;
            gx_mean += g * (x - mu) * rs;
        }
        g_mean /= c as f32;
        gx_mean /= c as f32;
        for (((dx, &dy), &w), (&x, dw)) in dx
            .iter_mut()
            .zip(dy)
            .zip(weight)
            .zip(x.iter().zip(dweight.iter_mut()))
        {
            let xh = (x - mu) * rs;
            *dw += dy * xh;
            *dx += rs * (w * dy - g_mean - xh * gx_mean);
        }
        if let Some(db) = dbias.as_deref_mut() {
            db.iter_mut().zip(dy).for_each(|(d, g)| *d += g);
        }
    }
}

/// `out = inp · rstd · weight` with `rstd = 1/√(mean(inp²) + eps)`, saving `rstd` per row.
pub fn rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    c: usize,
    eps: f32,
) {
    for ((o, x), r) in out
        .chunks_exact_mut(c)
        .zip(inp.chunks_exact(c))
        .zip(rstd.iter_mut())
    {
        let rs = 1.0 / (dot(x, x) / c as f32 + eps).sqrt();
        for ((o, &x), &w) in o.iter_mut().zip(x).zip(weight) {
            *o = x * rs * w;
        }
        *r = rs;
    }
}

/// Gradients of [`rmsnorm_forward`]: `dinp += rstd·w·dy − rstd³·x·mean(w·dy·x)`,
/// `dweight += Σ dy·x·rstd`.
pub fn rmsnorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    c: usize,
) {
    let rows = dinp
        .chunks_exact_mut(c)
        .zip(dout.chunks_exact(c))
        .zip(inp.chunks_exact(c));
    for (((dx, dy), x), &rs) in rows.zip(rstd) {
        let gx_mean = dy
            .iter()
            .zip(weight)
            .zip(x)
            .map(|((&dy, &w), &x)| w * dy * x)
            .sum::<f32>()
            / c as f32;
        let k = rs * rs * rs * gx_mean;
        for (((dx, &dy), &w), (&x, dw)) in dx
            .iter_mut()
            .zip(dy)
            .zip(weight)
            .zip(x.iter().zip(dweight.iter_mut()))
        {
            *dw += dy * x * rs;
            *dx += rs * w * dy - k * x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{fd_check, randn, weighted};

    const N: usize = 3;
    const C: usize = 10;

    #[test]
    fn layernorm_gradients_match_finite_differences() {
        let x = randn(N * C, 1, 1.0);
        let w = randn(C, 2, 1.0);
        let b = randn(C, 3, 1.0);
        let gy = randn(N * C, 4, 1.0);
        let fwd = |x: &[f32], w: &[f32], b: &[f32]| {
            let (mut o, mut m, mut r) = (vec![0.0; N * C], vec![0.0; N], vec![0.0; N]);
            layernorm_forward(&mut o, &mut m, &mut r, x, w, Some(b), C, 1e-5);
            (o, m, r)
        };
        let (_, m, r) = fwd(&x, &w, &b);
        let (mut dx, mut dw, mut db) = (vec![0.0; N * C], vec![0.0; C], vec![0.0; C]);
        layernorm_backward(&mut dx, &mut dw, Some(&mut db), &gy, &x, &w, &m, &r, C);
        let h = 1.0 / 64.0;
        fd_check("ln dx", &x, &dx, h, 1e-3, 100, |x| {
            weighted(&fwd(x, &w, &b).0, &gy)
        });
        fd_check("ln dw", &w, &dw, h, 1e-3, 100, |w| {
            weighted(&fwd(&x, w, &b).0, &gy)
        });
        fd_check("ln db", &b, &db, h, 1e-3, 100, |b| {
            weighted(&fwd(&x, &w, b).0, &gy)
        });
    }

    #[test]
    fn rmsnorm_gradients_match_finite_differences() {
        let x = randn(N * C, 5, 1.0);
        let w = randn(C, 6, 1.0);
        let gy = randn(N * C, 7, 1.0);
        let fwd = |x: &[f32], w: &[f32]| {
            let (mut o, mut r) = (vec![0.0; N * C], vec![0.0; N]);
            rmsnorm_forward(&mut o, &mut r, x, w, C, 1e-5);
            (o, r)
        };
        let (_, r) = fwd(&x, &w);
        let (mut dx, mut dw) = (vec![0.0; N * C], vec![0.0; C]);
        rmsnorm_backward(&mut dx, &mut dw, &gy, &x, &w, &r, C);
        let h = 1.0 / 64.0;
        fd_check("rms dx", &x, &dx, h, 1e-3, 100, |x| {
            weighted(&fwd(x, &w).0, &gy)
        });
        fd_check("rms dw", &w, &dw, h, 1e-3, 100, |w| {
            weighted(&fwd(&x, w).0, &gy)
        });
    }
}
