//! Softmax cross-entropy over (a shard of) the vocabulary, forward and backward.
//!
//! Split into row statistics so the vocab-parallel layer can all-reduce them between steps:
//! `loss[n] = ln Σ_v exp(l[n,v] − max[n]) + max[n] − l[n, target[n]]`. The probabilities are
//! never stored: backward recomputes them from the logits and the two saved statistics, and
//! writes the gradient over the logits IN PLACE (the logits are dead after the loss).
//! Shapes: `logits: (N, V_local)`, `max, sumexp, losses, dlosses: (N)`, `targets: (N)`.
//! Must not allocate or communicate.

use super::vmath;

/// `max[n] = max_v logits[n, v]`.
pub fn row_max(max: &mut [f32], logits: &[f32], v: usize) {
    for (m, l) in max.iter_mut().zip(logits.chunks_exact(v)) {
        *m = vmath::max(l);
    }
}

/// `sumexp[n] = Σ_v exp(logits[n, v] − max[n])` (in f64 lanes, stored in f32).
pub fn row_sumexp(sumexp: &mut [f32], logits: &[f32], max: &[f32], v: usize) {
    for ((s, l), &m) in sumexp.iter_mut().zip(logits.chunks_exact(v)).zip(max) {
        *s = vmath::sum_exp_shifted_f64(l, m) as f32;
    }
}

/// `out[n] = logits[n, targets[n] − vocab_start]`, or 0 when the target is in another shard.
pub fn target_logit(
    out: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    vocab_start: usize,
    v: usize,
) {
    for ((o, l), &tgt) in out.iter_mut().zip(logits.chunks_exact(v)).zip(targets) {
        *o = (tgt as usize)
            .checked_sub(vocab_start)
            .filter(|&i| i < v)
            .map_or(0.0, |i| l[i]);
    }
}

/// Single-shard forward: per-row `losses`, saving `max` and `sumexp` for backward.
pub fn crossentropy_forward(
    losses: &mut [f32],
    max: &mut [f32],
    sumexp: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    v: usize,
) {
    row_max(max, logits, v);
    row_sumexp(sumexp, logits, max, v);
    target_logit(losses, logits, targets, 0, v);
    for ((l, &m), &s) in losses.iter_mut().zip(max.iter()).zip(sumexp.iter()) {
        *l = s.ln() + m - *l;
    }
}

/// In place: `logits[n, v] ← (softmax[n, v] − [v = target]) · dlosses[n]`, where `max` and
/// `sumexp` are the GLOBAL (all shards) row statistics and `vocab_start` this shard's offset.
pub fn crossentropy_backward(
    logits: &mut [f32],
    max: &[f32],
    sumexp: &[f32],
    targets: &[u32],
    dlosses: &[f32],
    vocab_start: usize,
    v: usize,
) {
    let rows = logits.chunks_exact_mut(v).zip(max.iter().zip(sumexp));
    for ((l, (&m, &s)), (&tgt, &dl)) in rows.zip(targets.iter().zip(dlosses)) {
        let inv = 1.0 / s;
        l.iter_mut()
            .for_each(|x| *x = vmath::exp(*x - m) * inv * dl);
        if let Some(i) = (tgt as usize).checked_sub(vocab_start).filter(|&i| i < v) {
            l[i] -= dl;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{fd_check, randn};

    #[test]
    fn crossentropy_gradient_matches_finite_differences() {
        let (n, v) = (4, 7);
        let logits = randn(n * v, 1, 2.0);
        let targets = [0u32, 6, 3, 3];
        let dl = [0.25f32, -1.0, 0.5, 2.0];
        let fwd = |x: &[f32]| {
            let (mut loss, mut m, mut s) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            crossentropy_forward(&mut loss, &mut m, &mut s, x, &targets, v);
            (loss, m, s)
        };
        let (loss, m, s) = fwd(&logits);
        // Row 0 by hand.
        let z: f64 = logits[..v].iter().map(|&x| f64::from(x).exp()).sum();
        assert!((f64::from(loss[0]) - (z.ln() - f64::from(logits[0]))).abs() < 1e-5);
        let mut g = logits.clone();
        crossentropy_backward(&mut g, &m, &s, &targets, &dl, 0, v);
        fd_check("xent", &logits, &g, 1.0 / 64.0, 1e-3, 100, |x| {
            fwd(x)
                .0
                .iter()
                .zip(dl)
                .map(|(&l, d)| f64::from(l) * f64::from(d))
                .sum()
        });
    }
}
