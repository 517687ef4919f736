//! ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024, and §6 of "Zero
//! Bubble Pipeline Parallelism"), in the order of PyTorch's `ScheduleZBVZeroBubble`
//! (`torch/distributed/pipelining/schedules.py`, `_calculate_single_rank_operations`), so that
//! an export to torchtitan's `ZBVZeroBubble` runs this very schedule.
//!
//! Two chunks per stage in a V ([`super::virtual_stage`]): chunk 0 of rank `r` holds piece `r`,
//! chunk 1 piece `2p − 1 − r`, so a micro-batch goes down the ranks and back up, and rank 0
//! computes the loss. Rank `r` warms up with `2(p − r) − 1` chunk-0 forwards, then `r` pairs
//! (F chunk 1, F chunk 0), then `p − r` triples (F, B, W of chunk 1); the steady state runs
//! F B W on chunk 0 then on chunk 1; the cool-down runs the remaining B of both chunks first and
//! the W after them. Torch plans `max(2p − 1, m)` micro-batches and drops the ops of those past
//! `m`; dropping every op of a micro-batch keeps a schedule deadlock-free, and so does this file.
//! With `T_F = T_B = T_W` the bubble is near zero, and rank 0 holds at most `2p` chunk
//! activations (`p` micro-batches of a whole stage: 1F1B's peak). This file only orders compute;
//! send/receive placement is in `mod.rs`. No cost model, no I/O.

use super::{Pass, Step};

/// Per stage, `(pass, mb, chunk)` in execution order.
pub(super) fn compute_order(pp: usize, m: usize) -> Vec<Vec<Step>> {
    (0..pp).map(|r| stage_order(pp, m, r)).collect()
}

fn stage_order(pp: usize, m: usize, r: usize) -> Vec<Step> {
    let n = m.max(2 * pp - 1);
    let mut order: Vec<Step> = Vec::with_capacity(6 * n);
    // Counters as torch names them: forwards and backwards (B) of chunk 0 and chunk 1.
    let (mut f0, mut f1, mut b0, mut b1) = (0, 0, 0, 0);
    for _ in 0..2 * (pp - r) - 1 {
        forward(&mut order, &mut f0, 0);
    }
    for _ in 0..r {
        forward(&mut order, &mut f1, 1);
        forward(&mut order, &mut f0, 0);
    }
    for _ in 0..pp - r {
        forward(&mut order, &mut f1, 1);
        order_b_w(&mut order, &mut b1, 1);
    }
    while f1 < f0 || f0 < n {
        if f0 < n {
            forward(&mut order, &mut f0, 0);
        }
        order_b_w(&mut order, &mut b0, 0);
        forward(&mut order, &mut f1, 1);
        order_b_w(&mut order, &mut b1, 1);
    }
    let (mut w0, w1) = (b0, b1);
    for _ in 0..r {
        order.push((Pass::Input, b0, 0));
        order.push((Pass::Input, b1, 1));
        b0 += 1;
        b1 += 1;
    }
    for _ in 0..pp - r {
        order.push((Pass::Input, b0, 0));
        order.push((Pass::Weight, w0, 0));
        b0 += 1;
        w0 += 1;
    }
    order.extend((w1..b1).map(|mb| (Pass::Weight, mb, 1)));
    order.extend((w0..b0).map(|mb| (Pass::Weight, mb, 0)));
    debug_assert!(f0 == n && f1 == n && b0 == n && b1 == n);
    order.retain(|&(_, mb, _)| mb < m);
    order
}

/// The forward of the next micro-batch on `chunk`.
fn forward(order: &mut Vec<Step>, f: &mut usize, chunk: usize) {
    order.push((Pass::Forward, *f, chunk));
    *f += 1;
}

/// B then W of the next micro-batch on `chunk`.
fn order_b_w(order: &mut Vec<Step>, b: &mut usize, chunk: usize) {
    order.push((Pass::Input, *b, chunk));
    order.push((Pass::Weight, *b, chunk));
    *b += 1;
}

#[cfg(test)]
mod tests {
    use super::super::zb_h1::tests::{compute, unit_makespan};
    use super::super::*;

    #[test]
    fn schedule_zb_v_checks_over_grid() {
        for pp in 1..=8 {
            for m in 1..=16 {
                let s = build(ScheduleKind::ZbV, pp, m, 2).unwrap();
                s.check().unwrap_or_else(|e| panic!("pp={pp} m={m}: {e}"));
            }
        }
    }

    #[test]
    fn schedule_zb_v_order_matches_torch() {
        // pp = 2, m = 2, by hand from `ScheduleZBVZeroBubble._calculate_single_rank_operations`
        // (which plans max(2p − 1, m) = 3 micro-batches; those of micro-batch 2 are dropped).
        // Rank 0: 3 F of chunk 0; no pairs; 2 triples F I W of chunk 1; steady: no F0 left,
        // I W of chunk 0, F I W of chunk 1; cool-down: 2 × (I, W) of chunk 0.
        let s = build(ScheduleKind::ZbV, 2, 2, 2).unwrap();
        assert_eq!(
            compute(&s, 0),
            "F0.0 F1.0 F0.1 I0.1 W0.1 F1.1 I1.1 W1.1 I0.0 W0.0 I1.0 W1.0"
        );
        // Rank 1: 1 F of chunk 0; 1 pair (F chunk 1, F chunk 0); 1 triple; steady F2.0, I W of
        // chunk 0, F2.1, I W of chunk 1; cool-down: I of both, then I W of chunk 0, then the
        // W left of chunk 1 and of chunk 0.
        assert_eq!(
            compute(&s, 1),
            "F0.0 F0.1 F1.0 F1.1 I0.1 W0.1 I0.0 W0.0 I1.1 W1.1 I1.0 W1.0"
        );
        // Rank 1 runs pieces 1 and 2 back to back: no message between its two chunks.
        assert!(!s.stages[1].iter().any(|op| matches!(
            op,
            Op::SendActivation { chunk: 0, .. } | Op::SendGrad { chunk: 1, .. }
        )));
        // Rank 0's chunk 1 (the last piece) sends its gradient to rank 1's chunk 1.
        assert!(s.stages[0].contains(&Op::SendGrad {
            mb: 0,
            chunk: 1,
            peer: 1
        }));
    }

    #[test]
    fn schedule_zb_v_holds_p_stages_of_activations() {
        // Each unit is one chunk, half a stage: 2p units = p micro-batches of a whole stage,
        // 1F1B's stage-0 peak.
        for pp in 1..=8 {
            for m in 2 * pp..=16.max(2 * pp) {
                let s = build(ScheduleKind::ZbV, pp, m, 2).unwrap();
                for r in 0..pp {
                    assert_eq!(s.peak_in_flight(r), 2 * pp, "pp={pp} m={m} r={r}");
                }
            }
        }
    }

    #[test]
    fn schedule_zb_v_bubble_is_the_fill_alone() {
        // F = B = W = 1 per chunk: 2 chunks × 3 = 6 busy per micro-batch on every rank. The
        // last rank cannot start before micro-batch 0 crossed pieces 0..p−1 (p − 1 forwards);
        // ZB-V then keeps every rank busy, so the makespan is 6m + (p − 1).
        for (pp, m) in [(4, 8), (4, 16), (8, 16), (2, 3)] {
            let want = 6.0 * m as f64 + (pp - 1) as f64;
            assert_eq!(
                unit_makespan(ScheduleKind::ZbV, pp, m),
                want,
                "pp={pp} m={m}"
            );
        }
    }
}
