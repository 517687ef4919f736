//! Attention dropout: dropout on the softmax probabilities before they multiply V (GPT-2's
//! `attn_pdrop`, Llama's `attention_dropout`), as `attention.rs`'s forward and backward with
//! the mask in between.
//!
//! `att` keeps the probabilities `P` undropped (what the softmax backward needs, and what
//! selective recompute regenerates); the mask is never stored: [`AttnMask::scale`] draws it
//! from the counter RNG by the element's global (sequence, head, query, key) index wherever it
//! is needed, so the forward, a recompute and the backward see the same mask on every layout.
//! The masked products run as plain loops over the causal rows (no room for a dropped copy of
//! a `P` block: the forward has no scratch); the probabilities and `dS` are `attention.rs`'s.
//! Must not allocate; must not know about TP beyond the head offset it is given.

use super::attention::{blocks, AttnShape};
use super::matmul::{gemm, MatMut, MatRef};
use crate::rng::dropout_scale;

/// Where one call's attention probabilities sit in the global batch, and the draw they use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnMask {
    /// Dropout probability.
    pub p: f32,
    /// The run's seed mixed with the optimizer step.
    pub seed: u64,
    /// The site's stream (its layer's `h.{l}.attn.drop`).
    pub stream: u64,
    /// Global index of the call's first sequence in the global batch.
    pub first_sequence: u64,
    /// Global index of the call's first (local) query head, and the model's query heads.
    pub head0: usize,
    pub heads: usize,
}

impl AttnMask {
    /// The factor of probability `(b, h, i, j)` of a call of `t` tokens per sequence: `0`
    /// or `1 / (1 − p)`.
    #[inline]
    pub fn scale(&self, t: usize, b: usize, h: usize, i: usize, j: usize) -> f32 {
        let seq = self.first_sequence + b as u64;
        let head = (self.head0 + h) as u64;
        let (t, i, j) = (t as u64, i as u64, j as u64);
        let index = ((seq * self.heads as u64 + head) * t + i) * t + j;
        dropout_scale(self.p, self.seed, self.stream, index)
    }
}

/// `y = (P ⊙ M) · v` for every (batch, head); `y: (B, T, hq·hd)` overwritten.
pub fn attention_values_dropout(
    y: &mut [f32],
    att: &[f32],
    qkv: &[f32],
    s: AttnShape,
    m: &AttnMask,
) {
    s.check();
    let (t, w, hd, yw) = (s.t, s.qkv_width(), s.hd, s.y_width());
    for b in 0..s.b {
        for h in 0..s.hq {
            let (_, _, vo) = s.heads(b, h);
            let ao = (b * s.hq + h) * t * t;
            for i in 0..t {
                let yo = (b * t + i) * yw + h * hd;
                let yr = &mut y[yo..yo + hd];
                yr.fill(0.0);
                for j in 0..=i {
                    let pm = att[ao + i * t + j] * m.scale(t, b, h, i, j);
                    if pm != 0.0 {
                        let v = &qkv[vo + j * w..vo + j * w + hd];
                        yr.iter_mut().zip(v).for_each(|(y, &v)| *y += pm * v);
                    }
                }
            }
        }
    }
}

/// [`super::attention::attention_backward`] through the mask: `dV += (P ⊙ M)ᵀ·dY`, and the
/// softmax sees `dP = (dY·Vᵀ) ⊙ M`. `dqkv` OVERWRITTEN; `scratch` as there.
pub fn attention_backward_dropout(
    dqkv: &mut [f32],
    scratch: &mut [f32],
    dy: &[f32],
    qkv: &[f32],
    att: &[f32],
    s: AttnShape,
    m: &AttnMask,
) {
    s.check();
    let (t, w, hd, yw, scale) = (s.t, s.qkv_width(), s.hd, s.y_width(), s.scale());
    assert!(
        scratch.len() >= super::attention_scratch_len(&s),
        "attention scratch too small"
    );
    dqkv.fill(0.0);
    for b in 0..s.b {
        for h in 0..s.hq {
            let (qo, ko, vo) = s.heads(b, h);
            let ao = (b * s.hq + h) * t * t;
            for (r0, r1) in blocks(t) {
                let rows = r1 - r0;
                let dyo = (b * t + r0) * yw + h * hd;
                let dyb = MatRef::new(dy, dyo, rows, hd, yw, 1);
                // dP' = dY·Vᵀ  (rows × r1, row stride r1 in scratch)
                let vt = MatRef::new(qkv, vo, r1, hd, w, 1).t();
                gemm(
                    MatMut::new(scratch, 0, rows, r1, r1, 1),
                    dyb,
                    vt,
                    1.0,
                    false,
                );
                for (i, ds) in scratch[..rows * r1].chunks_exact_mut(r1).enumerate() {
                    let row = r0 + i;
                    let pr = &att[ao + row * t..ao + row * t + r1];
                    let dyr = &dy[dyo + i * yw..dyo + i * yw + hd];
                    let (live, masked) = ds.split_at_mut(row + 1);
                    // dV += (P ⊙ M)ᵀ·dY, and dP = dP' ⊙ M, row by row.
                    for (j, d) in live.iter_mut().enumerate() {
                        let k = m.scale(t, b, h, row, j);
                        *d *= k;
                        let pm = pr[j] * k;
                        if pm != 0.0 {
                            let dv = &mut dqkv[vo + j * w..vo + j * w + hd];
                            dv.iter_mut().zip(dyr).for_each(|(v, &g)| *v += pm * g);
                        }
                    }
                    // dS = P ⊙ (dP − Σ_j P·dP), zero above the diagonal
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
    use super::super::attention::{attention_probs, attention_scratch_len};
    use super::*;
    use crate::testutil::{assert_close, fd_check, randn, weighted};

    fn mask(p: f32) -> AttnMask {
        AttnMask {
            p,
            seed: 11,
            stream: 12,
            first_sequence: 3,
            head0: 2,
            heads: 8,
        }
    }

    fn forward(qkv: &[f32], s: AttnShape, m: &AttnMask) -> (Vec<f32>, Vec<f32>) {
        let (mut y, mut att) = (vec![0.0; s.b * s.t * s.y_width()], vec![0.0; s.att_len()]);
        attention_probs(&mut att, qkv, s);
        attention_values_dropout(&mut y, &att, qkv, s, m);
        (y, att)
    }

    /// An f64 reference written from the definition: `y_i = Σ_j softmax(q_i·K/√hd)_j · M_ij ·
    /// v_j`, with `M` drawn by global index as torch would apply a mask tensor.
    fn reference(qkv: &[f32], s: AttnShape, m: &AttnMask) -> Vec<f32> {
        let (t, w, hd) = (s.t, s.qkv_width(), s.hd);
        let g = s.hq / s.hkv;
        let mut y = vec![0.0; s.b * t * s.y_width()];
        for b in 0..s.b {
            for h in 0..s.hq {
                let base = b * t * w;
                let (qo, ko, vo) = (
                    base + h * hd,
                    base + (s.hq + h / g) * hd,
                    base + (s.hq + s.hkv + h / g) * hd,
                );
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
                    let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = sc.iter().map(|v| (v - mx).exp()).sum();
                    for d in 0..hd {
                        let acc: f64 = (0..=i)
                            .map(|j| {
                                let keep = crate::rng::uniform(
                                    m.seed,
                                    m.stream,
                                    (((m.first_sequence + b as u64) * 8 + (2 + h) as u64)
                                        * t as u64
                                        + i as u64)
                                        * t as u64
                                        + j as u64,
                                ) >= f64::from(m.p);
                                let k = if keep {
                                    1.0 / (1.0 - f64::from(m.p))
                                } else {
                                    0.0
                                };
                                (sc[j] - mx).exp() / z * k * f64::from(qkv[vo + j * w + d])
                            })
                            .sum();
                        y[(b * t + i) * s.y_width() + h * hd + d] = acc as f32;
                    }
                }
            }
        }
        y
    }

    #[test]
    fn dropped_attention_matches_the_definition_and_finite_differences() {
        for s in [
            AttnShape {
                b: 2,
                t: 6,
                hq: 4,
                hkv: 2,
                hd: 3,
            },
            AttnShape {
                b: 1,
                t: 70,
                hq: 2,
                hkv: 1,
                hd: 4,
            },
        ] {
            let m = mask(0.3);
            let qkv = randn(s.b * s.t * s.qkv_width(), 1, 1.0);
            let (y, att) = forward(&qkv, s, &m);
            assert_close(&y, &reference(&qkv, s, &m), 1e-5, "dropped forward");
            let gy = randn(y.len(), 2, 1.0);
            let mut dqkv = vec![f32::NAN; qkv.len()];
            let mut scratch = vec![0.0; attention_scratch_len(&s)];
            attention_backward_dropout(&mut dqkv, &mut scratch, &gy, &qkv, &att, s, &m);
            // The mask is a pure function of the indices: the same on every perturbed forward.
            fd_check(
                "dropped attention dqkv",
                &qkv,
                &dqkv,
                1.0 / 64.0,
                1e-3,
                300,
                |x| weighted(&forward(x, s, &m).0, &gy),
            );
        }
    }

    #[test]
    fn p_zero_is_plain_attention() {
        let s = AttnShape {
            b: 2,
            t: 5,
            hq: 2,
            hkv: 1,
            hd: 4,
        };
        let qkv = randn(s.b * s.t * s.qkv_width(), 3, 1.0);
        let (y, att) = forward(&qkv, s, &mask(0.0));
        let mut plain = vec![0.0; y.len()];
        super::super::attention::attention_values(&mut plain, &att, &qkv, s);
        assert_close(&y, &plain, 1e-6, "p = 0");
    }
}
