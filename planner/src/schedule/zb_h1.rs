//! ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §3.1), in the order of the
//! authors' Megatron patch (sail-sg/zero-bubble-pipeline-parallelism, branch
//! `zb-h1-quick-start`, `forward_backward_pipelining_without_interleaving`).
//!
//! 1F1B's order, with some backwards split into B (input gradients, sent on at once) and W
//! (weight gradients, queued and run later, first in first out). Stage `r > 0` splits the
//! backwards of its first `r` steady steps, of its last steady step and of its whole cool-down,
//! runs one queued W after the last steady B and after each cool-down B (the cool-down's from
//! step `r` on), and the rest of the queue at the end: each stage's cool-down then moves at the
//! pace of B alone, and the `r` W it held back fill the bubble 1F1B leaves at its end. Stage 0
//! splits nothing (its cool-down bubble is the pipeline's last). The paper's bubble is
//! `(p − 1)(T_F + T_B − T_W)` against 1F1B's `(p − 1)(T_F + T_B + T_W)`. Stage `r` holds `p − r`
//! micro-batches' activations, as 1F1B, and up to `r` more W-stashes (what W still needs), so
//! counting a micro-batch until its W, every stage holds at most `p`: 1F1B's peak, stage 0's.
//! This file only orders compute; send/receive placement is in `mod.rs`. No cost model, no I/O.

use std::collections::VecDeque;

use super::{Pass, Step};

/// Per stage, `(pass, mb, chunk)` in execution order.
pub(super) fn compute_order(pp: usize, m: usize) -> Vec<Vec<Step>> {
    (0..pp).map(|r| stage_order(pp, m, r)).collect()
}

fn stage_order(pp: usize, m: usize, r: usize) -> Vec<Step> {
    let warmup = (pp - r - 1).min(m);
    let steady = m - warmup;
    let mut order = Vec::with_capacity(3 * m);
    // The W queue: micro-batches whose B ran and whose W has not, oldest first.
    let mut queue = VecDeque::new();
    let mut backward = |order: &mut Vec<Step>, mb: usize, split: bool, pop: bool| {
        if split {
            order.push((Pass::Input, mb, 0));
            queue.push_back(mb);
        } else {
            order.push((Pass::Backward, mb, 0));
        }
        if pop {
            let w = queue
                .pop_front()
                .expect("a W is popped right after a split B");
            order.push((Pass::Weight, w, 0));
        }
    };
    order.extend((0..warmup).map(|mb| (Pass::Forward, mb, 0)));
    for i in 0..steady {
        let last = i + 1 == steady;
        order.push((Pass::Forward, warmup + i, 0));
        backward(
            &mut order,
            i,
            r > 0 && (i < r || last),
            r > 0 && last && i >= r,
        );
    }
    for j in 0..warmup {
        backward(&mut order, steady + j, r > 0, r > 0 && steady + j >= r);
    }
    order.extend(queue.into_iter().map(|mb| (Pass::Weight, mb, 0)));
    order
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::*;

    /// Compute ops as text: `F` forward, `B` fused backward, `I` its B pass, `W` its W pass.
    pub(in super::super) fn compute(s: &Schedule, stage: usize) -> String {
        s.stages[stage]
            .iter()
            .filter_map(|op| match *op {
                Op::Forward { mb, chunk } => Some(format!("F{mb}.{chunk}")),
                Op::Backward { mb, chunk } => Some(format!("B{mb}.{chunk}")),
                Op::BackwardInput { mb, chunk } => Some(format!("I{mb}.{chunk}")),
                Op::BackwardWeight { mb, chunk } => Some(format!("W{mb}.{chunk}")),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Equal passes (F = B = W = 1, a fused backward 2), free p2p: the makespan of `kind`.
    pub(in super::super) fn unit_makespan(kind: ScheduleKind, pp: usize, m: usize) -> f64 {
        let v = kind.fixed_virtual_stages().unwrap_or(1);
        let s = build(kind, pp, m, v).unwrap();
        let (one, two, zero) = (|_, _| 1.0, |_, _| 2.0, |_, _| 0.0);
        let costs = SimCosts {
            forward: &one,
            backward: &two,
            backward_input: &one,
            backward_weight: &one,
            overlap: &|_, _, _| 0.0,
            p2p: &zero,
        };
        simulate(&s, &costs).unwrap().makespan
    }

    #[test]
    fn schedule_zb_h1_checks_over_grid() {
        for pp in 1..=8 {
            for m in 1..=16 {
                let s = build(ScheduleKind::ZbH1, pp, m, 1).unwrap();
                s.check().unwrap_or_else(|e| panic!("pp={pp} m={m}: {e}"));
            }
        }
    }

    #[test]
    fn schedule_zb_h1_order_matches_the_authors_patch() {
        // pp = 3, m = 4, by hand from the patch: stage r warms up with 2 − r forwards, then
        // runs 2 + r steady (F, B) steps; r > 0 splits the B of steps i < r and of the last,
        // pops a W after the last steady B if that step is >= r, then splits every cool-down B
        // and pops after each; the queue's rest runs at the end.
        let s = build(ScheduleKind::ZbH1, 3, 4, 1).unwrap();
        // Stage 0 is 1F1B.
        assert_eq!(compute(&s, 0), "F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 B2.0 B3.0");
        // Stage 1: steady i = 0 splits (I0), i = 1 fuses, i = 2 is last: I2 then W0; the
        // cool-down's I3 then W2; W3 at the end.
        assert_eq!(
            compute(&s, 1),
            "F0.0 F1.0 I0.0 F2.0 B1.0 F3.0 I2.0 W0.0 I3.0 W2.0 W3.0"
        );
        // Stage 2: steady i = 0, 1 split, i = 2 fuses, i = 3 last: I3 then W0; W1 W3 at the end.
        assert_eq!(
            compute(&s, 2),
            "F0.0 I0.0 F1.0 I1.0 F2.0 B2.0 F3.0 I3.0 W0.0 W1.0 W3.0"
        );
    }

    #[test]
    fn schedule_zb_h1_holds_what_1f1b_holds() {
        for pp in 1..=8 {
            for m in pp..=16 {
                let zb = build(ScheduleKind::ZbH1, pp, m, 1).unwrap();
                let one = build(ScheduleKind::OneFOneB, pp, m, 1).unwrap();
                for s in 0..pp {
                    // Whole activations (until B): 1F1B's p − s.
                    assert_eq!(zb.peak_held(s, 0.0), (pp - s) as f64, "pp={pp} m={m} s={s}");
                    // Counting a micro-batch until its W: p on every stage, 1F1B's stage-0 peak.
                    assert_eq!(zb.peak_in_flight(s), pp, "pp={pp} m={m} s={s}");
                }
                assert_eq!(one.peak_in_flight(0), pp);
            }
        }
    }

    #[test]
    fn schedule_zb_h1_bubble_is_the_papers() {
        // F = B = W = 1, so a micro-batch is 3 of busy time per stage. Qi et al.: the ZB-H1
        // bubble is (p − 1)(T_F + T_B − T_W) = (p − 1) · 1; 1F1B's is (p − 1)(T_F + T_B + T_W)
        // = (p − 1) · 3 (its backward fused, 2).
        for (pp, m, zb, one) in [
            (4, 8, 24.0 + 3.0, 24.0 + 9.0),
            (8, 32, 96.0 + 7.0, 96.0 + 21.0),
            (2, 5, 15.0 + 1.0, 15.0 + 3.0),
        ] {
            assert_eq!(
                unit_makespan(ScheduleKind::ZbH1, pp, m),
                zb,
                "pp={pp} m={m}"
            );
            assert_eq!(
                unit_makespan(ScheduleKind::OneFOneB, pp, m),
                one,
                "pp={pp} m={m}"
            );
        }
    }
}
