//! Vocab-parallel softmax cross-entropy (Megatron's `vocab_parallel_cross_entropy`).
//!
//! The logits `(N, V_local)` are split over the vocabulary (the output of a column-parallel LM
//! head). Forward: all-reduce the row max (exact, as a max), then one all-reduce of
//! `[Σ exp(l − max) | target logit]` (each rank contributes the targets it owns). Backward is
//! local: every rank has the global max and sum-exp, so it forms its own slice of
//! `softmax − onehot`. The full logits are never gathered. Must not keep state.

use crate::comm::{all_reduce_max, Comm};
use crate::cpu;

use super::LayerError;

/// Per-row `losses (N)`, saving the GLOBAL row statistics `max, sumexp (N)` for backward.
/// `logits (N, V_local)` hold vocabulary entries `[vocab_start, vocab_start + V_local)`.
pub fn vocab_parallel_cross_entropy_forward(
    losses: &mut [f32],
    max: &mut [f32],
    sumexp: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    vocab_start: usize,
    comm: &dyn Comm,
) -> Result<(), LayerError> {
    let n = losses.len();
    let v = logits.len() / n;
    cpu::row_max(max, logits, v);
    all_reduce_max(comm, max)?;
    // One all-reduce for both sums: [sumexp (N) | target logit (N)].
    let mut both = vec![0.0f32; 2 * n];
    let (se, tl) = both.split_at_mut(n);
    cpu::row_sumexp(se, logits, max, v);
    cpu::target_logit(tl, logits, targets, vocab_start, v);
    comm.all_reduce_sum(&mut both)?;
    let (se, tl) = both.split_at(n);
    sumexp.copy_from_slice(se);
    for ((l, &m), (&s, &t)) in losses.iter_mut().zip(max.iter()).zip(se.iter().zip(tl)) {
        *l = s.ln() + m - t;
    }
    Ok(())
}

/// In place: `logits (N, V_local)` become `d loss / d logits` for the weights `dlosses (N)`
/// (e.g. `1 / global_tokens` for a mean). No communication.
pub fn vocab_parallel_cross_entropy_backward(
    logits: &mut [f32],
    max: &[f32],
    sumexp: &[f32],
    targets: &[u32],
    dlosses: &[f32],
    vocab_start: usize,
) {
    let v = logits.len() / max.len();
    cpu::crossentropy_backward(logits, max, sumexp, targets, dlosses, vocab_start, v);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::testkit::{full_cols, local_cols, on_tp};
    use crate::testutil::{assert_close, fd_check, randn};

    const N: usize = 5;
    const V: usize = 12;
    const TARGETS: [u32; N] = [0, 11, 4, 7, 7];

    fn run(t: usize, logits: &[f32], dl: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let ranks = on_tp(t, |comm, tp| {
            let local = local_cols(logits, &[V], tp);
            let (mut loss, mut m, mut s) = (vec![0.0; N], vec![0.0; N], vec![0.0; N]);
            let start = tp.rank * V / t;
            vocab_parallel_cross_entropy_forward(
                &mut loss, &mut m, &mut s, &local, &TARGETS, start, comm,
            )
            .unwrap();
            let mut d = local;
            vocab_parallel_cross_entropy_backward(&mut d, &m, &s, &TARGETS, dl, start);
            (loss, d)
        });
        for r in &ranks {
            assert_eq!(r.0, ranks[0].0, "losses identical on every rank");
        }
        let ds: Vec<Vec<f32>> = ranks.iter().map(|r| r.1.clone()).collect();
        (ranks[0].0.clone(), full_cols(&ds, &[V]))
    }

    #[test]
    fn vocab_parallel_cross_entropy_matches_fd_and_single_rank() {
        let logits = randn(N * V, 1, 3.0);
        let dl = randn(N, 2, 1.0);
        let (loss, dlogits) = run(1, &logits, &dl);
        fd_check(
            "vocab-parallel xent",
            &logits,
            &dlogits,
            1.0 / 64.0,
            1e-3,
            60,
            |x| {
                let (l, _) = run(1, x, &dl);
                l.iter()
                    .zip(&dl)
                    .map(|(&l, &d)| f64::from(l) * f64::from(d))
                    .sum()
            },
        );
        for t in [2, 3, 4] {
            let (lt, dt) = run(t, &logits, &dl);
            assert_close(&lt, &loss, 1e-6, "loss");
            assert_close(&dt, &dlogits, 1e-5, "dlogits");
        }
    }
}
