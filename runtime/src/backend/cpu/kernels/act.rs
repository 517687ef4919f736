//! Element-wise activations: GELU (tanh approximation, as GPT-2) and SwiGLU (as LLaMA).
//!
//! SwiGLU input rows are `[gate (f) | up (f)]`: the layout a fused column-parallel gate/up
//! projection produces on every TP rank. Backward OVERWRITES `dinp`. Must not allocate.

const GELU_S: f32 = 0.797_884_6; // √(2/π)
const GELU_C: f32 = 0.044_715;

/// `tanh(u) = 1 − 2/(e^{2u} + 1)`: libm's `tanhf` is ~15× slower than `expf` here and GELU
/// runs on every MLP element; the absolute error (~1e-7 near 0) is harmless inside GELU, and
/// every layout uses this same function, so parity is unaffected.
#[inline]
fn fast_tanh(u: f32) -> f32 {
    1.0 - 2.0 / ((2.0 * u).exp() + 1.0)
}

/// `out = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`; `out, inp: (N·F)`.
pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    for (o, &x) in out.iter_mut().zip(inp) {
        *o = 0.5 * x * (1.0 + fast_tanh(GELU_S * (x + GELU_C * x * x * x)));
    }
}

/// `dinp = gelu'(inp) · dout`.
pub fn gelu_backward(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
    for ((d, &x), &g) in dinp.iter_mut().zip(inp).zip(dout) {
        let t = fast_tanh(GELU_S * (x + GELU_C * x * x * x));
        let local =
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_S * (1.0 + 3.0 * GELU_C * x * x);
        *d = local * g;
    }
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `out[n, j] = silu(inp[n, j]) · inp[n, f + j]`; `out: (N, f)`, `inp: (N, 2f)`.
pub fn swiglu_forward(out: &mut [f32], inp: &[f32], f: usize) {
    for (o, x) in out.chunks_exact_mut(f).zip(inp.chunks_exact(2 * f)) {
        let (gate, up) = x.split_at(f);
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            *o = g * sigmoid(g) * u;
        }
    }
}

/// `dinp: (N, 2f)` = [d gate | d up] from `dout: (N, f)`.
pub fn swiglu_backward(dinp: &mut [f32], inp: &[f32], dout: &[f32], f: usize) {
    let rows = dinp.chunks_exact_mut(2 * f).zip(inp.chunks_exact(2 * f));
    for ((d, x), dy) in rows.zip(dout.chunks_exact(f)) {
        let (gate, up) = x.split_at(f);
        let (dgate, dup) = d.split_at_mut(f);
        for ((dg, du), ((&g, &u), &dy)) in
            dgate.iter_mut().zip(dup).zip(gate.iter().zip(up).zip(dy))
        {
            let s = sigmoid(g);
            *dg = dy * u * s * (1.0 + g * (1.0 - s));
            *du = dy * g * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{fd_check, randn, weighted};

    #[test]
    fn fast_tanh_is_accurate() {
        for i in -2000..=2000 {
            let u = i as f32 * 0.01;
            assert!((fast_tanh(u) - u.tanh()).abs() < 2e-7, "{u}");
        }
        assert_eq!(fast_tanh(100.0), 1.0);
        assert_eq!(fast_tanh(-100.0), -1.0);
    }

    #[test]
    fn gelu_gradient_matches_finite_differences() {
        let x = randn(40, 1, 2.0);
        let gy = randn(40, 2, 1.0);
        let mut dx = vec![0.0; 40];
        gelu_backward(&mut dx, &x, &gy);
        fd_check("gelu", &x, &dx, 1.0 / 64.0, 1e-3, 40, |x| {
            let mut o = vec![0.0; 40];
            gelu_forward(&mut o, x);
            weighted(&o, &gy)
        });
    }

    #[test]
    fn swiglu_gradient_matches_finite_differences() {
        let (n, f) = (3, 5);
        let x = randn(n * 2 * f, 3, 2.0);
        let gy = randn(n * f, 4, 1.0);
        let mut dx = vec![0.0; n * 2 * f];
        swiglu_backward(&mut dx, &x, &gy, f);
        fd_check("swiglu", &x, &dx, 1.0 / 64.0, 1e-3, 40, |x| {
            let mut o = vec![0.0; n * f];
            swiglu_forward(&mut o, x, f);
            weighted(&o, &gy)
        });
    }
}

#[cfg(test)]
mod bench {
    use super::*;

    #[test]
    #[ignore]
    fn bench_activations() {
        let n = 1024 * 3072;
        let x = crate::testutil::randn(n, 1, 1.0);
        let mut o = vec![0.0; n];
        let mut d = vec![0.0; n];
        let t = |name: &str, f: &mut dyn FnMut()| {
            f();
            let t0 = std::time::Instant::now();
            f();
            println!(
                "{name}: {:.2} ns/elem",
                t0.elapsed().as_secs_f64() * 1e9 / n as f64
            );
        };
        use std::hint::black_box;
        t("gelu fwd", &mut || {
            gelu_forward(black_box(&mut o), black_box(&x))
        });
        t("gelu bwd", &mut || {
            gelu_backward(black_box(&mut d), &x, black_box(&o))
        });
        t("swiglu fwd", &mut || {
            swiglu_forward(black_box(&mut o[..n / 2]), &x, n / 2)
        });
    }
}
