//! Straightforward f64 references of every kernel in `tessera_runtime::backend::ops::Kernels`: loops as
//! the formulas are written, no blocking, no fusion. The oracle of `tests/ops.rs`.
#![allow(clippy::too_many_arguments, dead_code)]

use tessera_runtime::backend::cpu::kernels::AttnShape;

pub fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// `op(a)·op(b)` row-major.
pub fn gemm(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, ta: bool, tb: bool) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k)
                .map(|l| {
                    let x = if ta { a[l * m + i] } else { a[i * k + l] };
                    let y = if tb { b[j * k + l] } else { b[l * n + j] };
                    f64::from(x) * f64::from(y)
                })
                .sum();
        }
    }
    c
}

pub fn layernorm(
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    c: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let n = x.len() / c;
    let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    for r in 0..n {
        let row = &x[r * c..(r + 1) * c];
        let mu = row.iter().map(|&v| f64::from(v)).sum::<f64>() / c as f64;
        let var = row
            .iter()
            .map(|&v| (f64::from(v) - mu).powi(2))
            .sum::<f64>()
            / c as f64;
        let rs = 1.0 / (var + eps).sqrt();
        for i in 0..c {
            out[r * c + i] = (f64::from(row[i]) - mu) * rs * f64::from(w[i])
                + b.map_or(0.0, |b| f64::from(b[i]));
        }
        (mean[r], rstd[r]) = (mu, rs);
    }
    (out, mean, rstd)
}

/// Gradients of [`layernorm`] w.r.t. x, w, b (not accumulated).
pub fn layernorm_backward(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    c: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let n = x.len() / c;
    let (_, mean, rstd) = layernorm(x, w, None, c, eps);
    let (mut dx, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
    for r in 0..n {
        let xh: Vec<f64> = (0..c)
            .map(|i| (f64::from(x[r * c + i]) - mean[r]) * rstd[r])
            .collect();
        let g: Vec<f64> = (0..c)
            .map(|i| f64::from(w[i]) * f64::from(dy[r * c + i]))
            .collect();
        let gm = g.iter().sum::<f64>() / c as f64;
        let gxm = g.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / c as f64;
        for i in 0..c {
            dx[r * c + i] = rstd[r] * (g[i] - gm - xh[i] * gxm);
            dw[i] += f64::from(dy[r * c + i]) * xh[i];
            db[i] += f64::from(dy[r * c + i]);
        }
    }
    (dx, dw, db)
}

pub fn rmsnorm(x: &[f32], w: &[f32], c: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
    let n = x.len() / c;
    let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
    for r in 0..n {
        let ms = (0..c).map(|i| f64::from(x[r * c + i]).powi(2)).sum::<f64>() / c as f64;
        rstd[r] = 1.0 / (ms + eps).sqrt();
        for i in 0..c {
            out[r * c + i] = f64::from(x[r * c + i]) * rstd[r] * f64::from(w[i]);
        }
    }
    (out, rstd)
}

pub fn rmsnorm_backward(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    c: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>) {
    let n = x.len() / c;
    let (_, rstd) = rmsnorm(x, w, c, eps);
    let (mut dx, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
    for r in 0..n {
        let rs = rstd[r];
        let gx = (0..c)
            .map(|i| f64::from(w[i]) * f64::from(dy[r * c + i]) * f64::from(x[r * c + i]))
            .sum::<f64>()
            / c as f64;
        for i in 0..c {
            let (xi, dyi) = (f64::from(x[r * c + i]), f64::from(dy[r * c + i]));
            dx[r * c + i] = rs * f64::from(w[i]) * dyi - rs.powi(3) * gx * xi;
            dw[i] += dyi * xi * rs;
        }
    }
    (dx, dw)
}

fn heads(s: &AttnShape, b: usize, h: usize) -> (usize, usize, usize) {
    let w = s.qkv_width();
    let g = h / (s.hq / s.hkv);
    (
        b * s.t * w + h * s.hd,
        b * s.t * w + (s.hq + g) * s.hd,
        b * s.t * w + (s.hq + s.hkv + g) * s.hd,
    )
}

/// Causal softmax probabilities of one (b, h): `p[i][j]`, j ≤ i.
fn probs(qkv: &[f32], s: &AttnShape, b: usize, h: usize) -> Vec<Vec<f64>> {
    let (w, hd) = (s.qkv_width(), s.hd);
    let (qo, ko, _) = heads(s, b, h);
    (0..s.t)
        .map(|i| {
            let sc: Vec<f64> = (0..=i)
                .map(|j| {
                    (0..hd)
                        .map(|d| f64::from(qkv[qo + i * w + d]) * f64::from(qkv[ko + j * w + d]))
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let m = sc.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = sc.iter().map(|v| (v - m).exp()).sum();
            sc.iter().map(|v| (v - m).exp() / z).collect()
        })
        .collect()
}

pub fn attention(qkv: &[f32], s: &AttnShape) -> Vec<f64> {
    let (w, hd, yw) = (s.qkv_width(), s.hd, s.y_width());
    let mut y = vec![0.0; s.b * s.t * yw];
    for b in 0..s.b {
        for h in 0..s.hq {
            let p = probs(qkv, s, b, h);
            let (_, _, vo) = heads(s, b, h);
            for i in 0..s.t {
                for d in 0..hd {
                    y[(b * s.t + i) * yw + h * hd + d] = (0..=i)
                        .map(|j| p[i][j] * f64::from(qkv[vo + j * w + d]))
                        .sum();
                }
            }
        }
    }
    y
}

/// d/dqkv of Σ y·dy.
pub fn attention_backward(qkv: &[f32], dy: &[f32], s: &AttnShape) -> Vec<f64> {
    let (w, hd, yw) = (s.qkv_width(), s.hd, s.y_width());
    let scale = 1.0 / (hd as f64).sqrt();
    let mut dqkv = vec![0.0; qkv.len()];
    for b in 0..s.b {
        for h in 0..s.hq {
            let p = probs(qkv, s, b, h);
            let (qo, ko, vo) = heads(s, b, h);
            let dyo = |i: usize, d: usize| f64::from(dy[(b * s.t + i) * yw + h * hd + d]);
            for i in 0..s.t {
                let dp: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..hd)
                            .map(|d| dyo(i, d) * f64::from(qkv[vo + j * w + d]))
                            .sum()
                    })
                    .collect();
                let pd: f64 = (0..=i).map(|j| p[i][j] * dp[j]).sum();
                for j in 0..=i {
                    let ds = p[i][j] * (dp[j] - pd);
                    for d in 0..hd {
                        dqkv[vo + j * w + d] += p[i][j] * dyo(i, d);
                        dqkv[qo + i * w + d] += scale * ds * f64::from(qkv[ko + j * w + d]);
                        dqkv[ko + j * w + d] += scale * ds * f64::from(qkv[qo + i * w + d]);
                    }
                }
            }
        }
    }
    dqkv
}

const S2PI: f64 = 0.797_884_560_802_865_4;

pub fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + (S2PI * (x + 0.044715 * x.powi(3))).tanh())
}

pub fn gelu_grad(x: f64) -> f64 {
    let t = (S2PI * (x + 0.044715 * x.powi(3))).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * S2PI * (1.0 + 3.0 * 0.044715 * x * x)
}

pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Per-row loss and the gradient `(softmax − onehot)·dl` of a single-shard cross-entropy.
pub fn crossentropy(logits: &[f32], targets: &[u32], dl: &[f32], v: usize) -> (Vec<f64>, Vec<f64>) {
    let n = targets.len();
    let (mut loss, mut grad) = (vec![0.0; n], vec![0.0; n * v]);
    for r in 0..n {
        let row = &logits[r * v..(r + 1) * v];
        let m = row.iter().map(|&x| f64::from(x)).fold(f64::MIN, f64::max);
        let z: f64 = row.iter().map(|&x| (f64::from(x) - m).exp()).sum();
        let t = targets[r] as usize;
        loss[r] = z.ln() + m - f64::from(row[t]);
        for i in 0..v {
            let p = (f64::from(row[i]) - m).exp() / z;
            grad[r * v + i] = (p - if i == t { 1.0 } else { 0.0 }) * f64::from(dl[r]);
        }
    }
    (loss, grad)
}
