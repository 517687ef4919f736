//! Vocab-parallel softmax cross-entropy (Megatron's `vocab_parallel_cross_entropy`).
//!
//! The logits `(N, V_local)` are split over the vocabulary (the output of a column-parallel LM
//! head). Forward: all-reduce the row max (exact, as a max), then one all-reduce of
//! `[Σ exp(l − max) | target logit]` (each rank contributes the targets it owns). Backward is
//! local: every rank has the global max and sum-exp, so it forms its own slice of
//! `softmax − onehot`. The full logits are never gathered. Must not keep state.

use crate::backend::{Backend, Collective};

use super::LayerError;

/// Forward: `losses (N)`, saving the GLOBAL row `max (N)` and `sumexp (N)`; `both (2N)` is
/// scratch for the one all-reduce of `[Σ exp(l − max) | target logit]`. Identical on every rank.
pub fn vocab_parallel_cross_entropy_forward<B: Backend, C: Collective<B> + ?Sized>(
    be: &B,
    mut losses: B::Mut<'_>,
    mut max: B::Mut<'_>,
    sumexp: B::Mut<'_>,
    mut both: B::Mut<'_>,
    logits: B::Ref<'_>,
    targets: &B::Ids,
    vocab_start: usize,
    comm: &C,
) -> Result<(), LayerError> {
    let n = B::len_mut(&losses);
    let v = B::len(logits) / n;
    be.row_max(B::rb(&mut max), logits, v)?;
    comm.all_reduce_max(B::rb(&mut max))?;
    let max = B::ro(&max);
    be.ce_partials(B::rb(&mut both), logits, max, targets, vocab_start, v)?;
    comm.all_reduce_sum(B::rb(&mut both))?;
    be.ce_losses(B::rb(&mut losses), sumexp, max, B::ro(&both))?;
    Ok(())
}

/// Backward, in place: `logits ← (softmax − onehot) · dlosses` from the global statistics; no
/// communication.
pub fn vocab_parallel_cross_entropy_backward<B: Backend>(
    be: &B,
    logits: B::Mut<'_>,
    max: B::Ref<'_>,
    sumexp: B::Ref<'_>,
    targets: &B::Ids,
    dlosses: B::Ref<'_>,
    vocab_start: usize,
) -> Result<(), LayerError> {
    let v = B::len_mut(&logits) / B::len(max);
    be.crossentropy_backward(logits, max, sumexp, targets, dlosses, vocab_start, v)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use crate::layers::testkit::{full_cols, local_cols, on_tp};
    use crate::testutil::{assert_close, fd_check, randn};

    const N: usize = 5;
    const V: usize = 12;
    const TARGETS: [u32; N] = [0, 11, 4, 7, 7];

    fn run(t: usize, logits: &[f32], dl: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let ranks = on_tp(t, |comm, tp| {
            let local = local_cols(logits, &[V], tp);
            let (mut loss, mut m, mut s) = (vec![0.0; N], vec![0.0; N], vec![0.0; N]);
            let mut both = vec![0.0; 2 * N];
            let start = tp.rank * V / t;
            let targets = TARGETS.to_vec();
            vocab_parallel_cross_entropy_forward(
                &Cpu, &mut loss, &mut m, &mut s, &mut both, &local, &targets, start, comm,
            )
            .unwrap();
            let mut d = local;
            vocab_parallel_cross_entropy_backward(&Cpu, &mut d, &m, &s, &targets, dl, start)
                .unwrap();
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
