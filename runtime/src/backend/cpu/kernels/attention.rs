//! Causal multi-head attention with grouped-query heads (GQA), forward and backward.
//!
//! Layout (what a fused qkv projection writes, on every TP rank with its local heads):
//! `qkv: (B, T, W)` with `W = (hq + 2·hkv)·hd`, each row `[q heads | k heads | v heads]`;
//! q head `h` reads kv head `h / (hq / hkv)`. `att: (B, hq, T, T)` holds the softmax
//! probabilities (row `t` nonzero only in columns `0..=t`; zero up to the end of its causal
//! block, and the columns past that are never written nor read); `y: (B, T, hq·hd)`.
//!
//! Every product is a gemm on strided views of these buffers (no copies, no transposes); rows
//! go in blocks of [`BLOCK`] so only the causal lower part (plus a diagonal block) is computed.
//! The forward is split into [`attention_probs`] and [`attention_values`] so selective
//! recompute can redo the probabilities alone with the very same code (bitwise identical).
//! Must not allocate; must not know about TP (it sees local heads only).

use super::matmul::{gemm, MatMut, MatRef};
use super::vmath;

/// Rows per causal block.
pub const BLOCK: usize = 64;

/// Sizes of one attention call (local heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub b: usize,
    pub t: usize,
    /// Query heads.
    pub hq: usize,
    /// Key/value heads; divides `hq`.
    pub hkv: usize,
    /// Head size.
    pub hd: usize,
}

impl AttnShape {
    /// Row width of the fused qkv buffer.
    pub fn qkv_width(&self) -> usize {
        (self.hq + 2 * self.hkv) * self.hd
    }
    /// Elements of `att`.
    pub fn att_len(&self) -> usize {
        self.b * self.hq * self.t * self.t
    }
    /// Row width of `y`.
    pub fn y_width(&self) -> usize {
        self.hq * self.hd
    }
    pub(super) fn scale(&self) -> f32 {
        1.0 / (self.hd as f32).sqrt()
    }
    /// Offsets of the q, k, v heads serving q head `h` of batch `b` in `qkv`.
    pub(super) fn heads(&self, b: usize, h: usize) -> (usize, usize, usize) {
        let base = b * self.t * self.qkv_width();
        let g = h / (self.hq / self.hkv);
        (
            base + h * self.hd,
            base + (self.hq + g) * self.hd,
            base + (self.hq + self.hkv + g) * self.hd,
        )
    }
    pub(super) fn check(&self) {
        assert!(
            self.hkv > 0 && self.hq.is_multiple_of(self.hkv),
            "GQA needs hkv dividing hq, got hq={} hkv={}",
            self.hq,
            self.hkv
        );
    }
}

/// Scratch elements [`attention_backward`] needs.
pub fn attention_scratch_len(s: &AttnShape) -> usize {
    BLOCK.min(s.t) * s.t
}

pub(super) fn blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t)
        .step_by(BLOCK)
        .map(move |r0| (r0, (r0 + BLOCK).min(t)))
}

/// `att = causal_softmax(q·kᵀ / √hd)` for every (batch, head).
pub fn attention_probs(att: &mut [f32], qkv: &[f32], s: AttnShape) {
    s.check();
    let (t, w, hd) = (s.t, s.qkv_width(), s.hd);
    assert_eq!(att.len(), s.att_len(), "att buffer");
    for b in 0..s.b {
        for h in 0..s.hq {
            let (qo, ko, _) = s.heads(b, h);
            let ao = (b * s.hq + h) * t * t;
            for (r0, r1) in blocks(t) {
                let q = MatRef::new(qkv, qo + r0 * w, r1 - r0, hd, w, 1);
                let kt = MatRef::new(qkv, ko, r1, hd, w, 1).t();
                gemm(
                    MatMut::new(att, ao + r0 * t, r1 - r0, r1, t, 1),
                    q,
                    kt,
                    s.scale(),
                    false,
                );
                // Columns past the block's end (`r1..t`) are never read: they stay as
                // allocated (zero), so only the block's own upper triangle is zeroed.
                for row in r0..r1 {
                    let p = &mut att[ao + row * t..ao + row * t + r1];
                    let (live, masked) = p.split_at_mut(row + 1);
                    let max = vmath::max(live);
                    // libm's `exp` in order, as before: `vmath::exp` (≤ 2 ulp) moved the
                    // layouts' rounding noise past the parity tests' tolerance.
                    let mut z = 0.0f32;
                    for v in live.iter_mut() {
                        *v = (*v - max).exp();
                        z += *v;
                    }
                    let inv = 1.0 / z;
                    live.iter_mut().for_each(|v| *v *= inv);
                    masked.fill(0.0);
                }
            }
        }
    }
}

/// `y = att · v` for every (batch, head); `y: (B, T, hq·hd)` overwritten.
pub fn attention_values(y: &mut [f32], att: &[f32], qkv: &[f32], s: AttnShape) {
    s.check();
    let (t, w, hd, yw) = (s.t, s.qkv_width(), s.hd, s.y_width());
    for b in 0..s.b {
        for h in 0..s.hq {
            let (_, _, vo) = s.heads(b, h);
            let ao = (b * s.hq + h) * t * t;
            for (r0, r1) in blocks(t) {
                let p = MatRef::new(att, ao + r0 * t, r1 - r0, r1, t, 1);
                let v = MatRef::new(qkv, vo, r1, hd, w, 1);
                let yo = (b * t + r0) * yw + h * hd;
                gemm(MatMut::new(y, yo, r1 - r0, hd, yw, 1), p, v, 1.0, false);
            }
        }
    }
}

/// Forward: `att` (saved for backward) and `y`.
pub fn attention_forward(y: &mut [f32], att: &mut [f32], qkv: &[f32], s: AttnShape) {
    attention_probs(att, qkv, s);
    attention_values(y, att, qkv, s);
}

/// Backward: `dqkv: (B, T, W)` OVERWRITTEN with the gradient w.r.t. `qkv` (kv-head gradients
/// summed over their q heads); `scratch`: at least [`attention_scratch_len`] elements.
pub fn attention_backward(
    dqkv: &mut [f32],
    scratch: &mut [f32],
    dy: &[f32],
    qkv: &[f32],
    att: &[f32],
    s: AttnShape,
) {
    s.check();
    let (t, w, hd, yw, scale) = (s.t, s.qkv_width(), s.hd, s.y_width(), s.scale());
    assert!(
        scratch.len() >= attention_scratch_len(&s),
        "attention scratch too small"
    );
    dqkv.fill(0.0);
    for b in 0..s.b {
        for h in 0..s.hq {
            let (qo, ko, vo) = s.heads(b, h);
            let ao = (b * s.hq + h) * t * t;
            for (r0, r1) in blocks(t) {
                let rows = r1 - r0;
                let dyb = MatRef::new(dy, (b * t + r0) * yw + h * hd, rows, hd, yw, 1);
                let p = MatRef::new(att, ao + r0 * t, rows, r1, t, 1);
                // dP = dY·Vᵀ  (rows × r1, row stride r1 in scratch)
                let vt = MatRef::new(qkv, vo, r1, hd, w, 1).t();
                gemm(
                    MatMut::new(scratch, 0, rows, r1, r1, 1),
                    dyb,
                    vt,
                    1.0,
                    false,
                );
                // dV += Pᵀ·dY
                gemm(MatMut::new(dqkv, vo, r1, hd, w, 1), p.t(), dyb, 1.0, true);
                // dS = P ⊙ (dP − Σ_j P·dP), zero above the diagonal
                for (i, ds) in scratch[..rows * r1].chunks_exact_mut(r1).enumerate() {
                    let row = r0 + i;
                    let pr = &att[ao + row * t..ao + row * t + r1];
                    let (live, masked) = ds.split_at_mut(row + 1);
                    let pd = super::dot(&pr[..row + 1], live);
                    live.iter_mut()
                        .zip(pr)
                        .for_each(|(d, &p)| *d = p * (*d - pd));
                    masked.fill(0.0);
                }
                let ds = MatRef::new(scratch, 0, rows, r1, r1, 1);
                // dQ = scale · dS·K ;  dK += scale · dSᵀ·Q
                let k = MatRef::new(qkv, ko, r1, hd, w, 1);
                gemm(
                    MatMut::new(dqkv, qo + r0 * w, rows, hd, w, 1),
                    ds,
                    k,
                    scale,
                    false,
                );
                let q = MatRef::new(qkv, qo + r0 * w, rows, hd, w, 1);
                gemm(MatMut::new(dqkv, ko, r1, hd, w, 1), ds.t(), q, scale, true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{assert_close, fd_check, randn, weighted};

    /// Straightforward f64 reference (no blocking, no gemm).
    fn reference(qkv: &[f32], s: AttnShape) -> Vec<f32> {
        let (t, w, hd) = (s.t, s.qkv_width(), s.hd);
        let mut y = vec![0.0; s.b * t * s.y_width()];
        for b in 0..s.b {
            for h in 0..s.hq {
                let (qo, ko, vo) = s.heads(b, h);
                for i in 0..t {
                    let sc: Vec<f64> = (0..=i)
                        .map(|j| {
                            (0..hd)
                                .map(|d| {
                                    f64::from(qkv[qo + i * w + d]) * f64::from(qkv[ko + j * w + d])
                                })
                                .sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = sc.iter().map(|v| (v - m).exp()).sum();
                    for d in 0..hd {
                        let acc: f64 = (0..=i)
                            .map(|j| (sc[j] - m).exp() / z * f64::from(qkv[vo + j * w + d]))
                            .sum();
                        y[(b * t + i) * s.y_width() + h * hd + d] = acc as f32;
                    }
                }
            }
        }
        y
    }

    fn run(s: AttnShape, fd: bool) {
        let qkv = randn(s.b * s.t * s.qkv_width(), 1, 1.0);
        let fwd = |qkv: &[f32]| {
            let (mut y, mut att) = (vec![0.0; s.b * s.t * s.y_width()], vec![0.0; s.att_len()]);
            attention_forward(&mut y, &mut att, qkv, s);
            (y, att)
        };
        let (y, att) = fwd(&qkv);
        assert_close(&y, &reference(&qkv, s), 1e-5, "attention forward");
        let gy = randn(y.len(), 2, 1.0);
        let mut dqkv = vec![f32::NAN; qkv.len()];
        let mut scratch = vec![0.0; attention_scratch_len(&s)];
        attention_backward(&mut dqkv, &mut scratch, &gy, &qkv, &att, s);
        if fd {
            fd_check("attention dqkv", &qkv, &dqkv, 1.0 / 64.0, 1e-3, 300, |x| {
                weighted(&fwd(x).0, &gy)
            });
        }
    }

    #[test]
    fn attention_matches_reference_and_finite_differences() {
        // Multi-head and GQA (2 q heads per kv head), one block.
        run(
            AttnShape {
                b: 2,
                t: 5,
                hq: 2,
                hkv: 2,
                hd: 4,
            },
            true,
        );
        run(
            AttnShape {
                b: 2,
                t: 6,
                hq: 4,
                hkv: 2,
                hd: 3,
            },
            true,
        );
        run(
            AttnShape {
                b: 1,
                t: 7,
                hq: 3,
                hkv: 1,
                hd: 2,
            },
            true,
        );
    }

    #[test]
    fn attention_over_several_causal_blocks() {
        run(
            AttnShape {
                b: 1,
                t: 2 * BLOCK + 9,
                hq: 2,
                hkv: 1,
                hd: 4,
            },
            true,
        );
    }
}
