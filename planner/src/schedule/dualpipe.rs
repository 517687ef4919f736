//! DualPipe (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, §3.2.1 and Fig. 5), in the
//! order of DeepSeek's public code (deepseek-ai/DualPipe, `dualpipe/dualpipe.py`, `step`'s
//! eight steps).
//!
//! Two pipelines in opposite directions over the same `p` model pieces: chunk 0 of rank `r`
//! holds piece `r` (the forward direction, micro-batches `0..m/2` enter at rank 0), chunk 1
//! holds piece `p − 1 − r` (the reverse direction, micro-batches `m/2..m` enter at rank
//! `p − 1`). The code speaks of phases: on the first half of the ranks phase 0 is the forward
//! direction, on the second half the reverse one, so chunk = phase xor (rank ≥ p/2).
//! Its overlapped "F&B" steps (`_forward_backward_chunk`: a forward of one direction beside a
//! backward of the other) are here a `Forward` followed by a `Backward`; what the overlap hides
//! is the cost model's business. Backwards are fused, except where the code enables zero
//! bubble (steps 3, 6 and 7), whose W queue runs first in first out as its `WeightGradStore`.
//! This file only orders compute; send/receive placement is in `mod.rs`. No cost model, no I/O.

use std::collections::VecDeque;

use super::{Pass, Step};

/// Per stage, `(pass, mb, chunk)` in execution order. `pp` and `m` are even and `m >= 2 pp`
/// (checked by the caller, as DualPipe asserts).
pub(super) fn compute_order(pp: usize, m: usize) -> Vec<Vec<Step>> {
    (0..pp).map(|r| Rank::new(pp, m, r).order()).collect()
}

struct Rank {
    half: usize,
    half_rank: usize,
    half_m: usize,
    second_half: bool,
    /// Forwards and backwards (fused or B) done so far, per chunk.
    f: [usize; 2],
    b: [usize; 2],
    /// (mb, chunk) of the B passes whose W is pending, oldest first.
    queue: VecDeque<(usize, usize)>,
    out: Vec<Step>,
}

impl Rank {
    fn new(pp: usize, m: usize, r: usize) -> Rank {
        Rank {
            half: pp / 2,
            half_rank: r.min(pp - 1 - r),
            half_m: m / 2,
            second_half: r >= pp / 2,
            f: [0; 2],
            b: [0; 2],
            queue: VecDeque::new(),
            out: Vec::with_capacity(3 * m),
        }
    }

    fn chunk(&self, phase: usize) -> usize {
        phase ^ usize::from(self.second_half)
    }

    fn forward(&mut self, phase: usize) {
        let c = self.chunk(phase);
        self.out
            .push((Pass::Forward, c * self.half_m + self.f[c], c));
        self.f[c] += 1;
    }

    fn backward(&mut self, phase: usize, zero_bubble: bool) {
        let c = self.chunk(phase);
        let mb = c * self.half_m + self.b[c];
        self.b[c] += 1;
        if zero_bubble {
            self.out.push((Pass::Input, mb, c));
            self.queue.push_back((mb, c));
        } else {
            self.out.push((Pass::Backward, mb, c));
        }
    }

    fn weight(&mut self) {
        let (mb, c) = self
            .queue
            .pop_front()
            .expect("DualPipe pops a W only after enqueueing one");
        self.out.push((Pass::Weight, mb, c));
    }

    fn order(mut self) -> Vec<Step> {
        let (half, hr) = (self.half, self.half_rank);
        // Step 1: nF0.
        for _ in 0..(half - hr - 1) * 2 {
            self.forward(0);
        }
        // Step 2: nF0F1.
        for _ in 0..=hr {
            self.forward(0);
            self.forward(1);
        }
        // Step 3: nB1W1F1, zero bubble.
        for _ in 0..half - hr - 1 {
            self.backward(1, true);
            self.weight();
            self.forward(1);
        }
        // Step 4 (main): nF0B1F1B0, each F with the other direction's B overlapped.
        for _ in 0..self.half_m + hr + 1 - 2 * half {
            self.forward(0);
            self.backward(1, false);
            self.forward(1);
            self.backward(0, false);
        }
        // Step 5: nB1F1B0.
        for _ in 0..half - hr - 1 {
            self.backward(1, false);
            self.forward(1);
            self.backward(0, false);
        }
        // Step 6: nB1B0, the second half of them zero bubble.
        // DualPipe's `step_6 // 2` with step_6 = hr + 1.
        let middle = hr.div_ceil(2);
        let mut zero_bubble = false;
        for i in 0..=hr {
            if i == middle && hr % 2 == 1 {
                zero_bubble = true;
            }
            self.backward(1, zero_bubble);
            if i == middle && hr % 2 == 0 {
                zero_bubble = true;
            }
            self.backward(0, zero_bubble);
        }
        // Step 7: nWB0, zero bubble.
        for _ in 0..half - hr - 1 {
            self.weight();
            self.backward(0, true);
        }
        // Step 8: nW.
        for _ in 0..=hr {
            self.weight();
        }
        debug_assert!(self.queue.is_empty());
        debug_assert!(self.f == [self.half_m; 2] && self.b == [self.half_m; 2]);
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::super::zb_h1::tests::{compute, unit_makespan};
    use super::super::*;

    #[test]
    fn schedule_dualpipe_checks_over_grid() {
        for pp in (2..=8).step_by(2) {
            for m in (2 * pp..=24).step_by(2) {
                let s = build(ScheduleKind::DualPipe, pp, m, 2).unwrap();
                s.check().unwrap_or_else(|e| panic!("pp={pp} m={m}: {e}"));
            }
        }
    }

    #[test]
    fn schedule_dualpipe_order_matches_deepseeks_steps() {
        // pp = 2, m = 4, by hand from `DualPipe.step`: half-rank 0 on both ranks; steps 1, 3,
        // 5 and 7 are empty; step 2 one F0 F1; step 4 one F0 B1 F1 B0; step 6 one B1 B0, the
        // B0 zero bubble; step 8 its W. Rank 0's phase 0 is chunk 0 (micro-batches 0, 1),
        // rank 1's is chunk 1 (micro-batches 2, 3 enter there).
        let s = build(ScheduleKind::DualPipe, 2, 4, 2).unwrap();
        assert_eq!(
            compute(&s, 0),
            "F0.0 F2.1 F1.0 B2.1 F3.1 B0.0 B3.1 I1.0 W1.0"
        );
        assert_eq!(
            compute(&s, 1),
            "F2.1 F0.0 F3.1 B0.0 F1.0 B2.1 B1.0 I3.1 W3.1"
        );
        // The reverse direction: rank 1's chunk 1 (piece 0) sends to rank 0's chunk 1.
        assert!(s.stages[1].contains(&Op::SendActivation {
            mb: 2,
            chunk: 1,
            peer: 0
        }));
    }

    #[test]
    fn schedule_dualpipe_holds_pp_plus_one() {
        // DeepSeek-V3 Table 2: PP + 1 micro-batches of a model stage's activations per rank.
        for pp in (2..=8).step_by(2) {
            for m in (2 * pp..=24).step_by(2) {
                let s = build(ScheduleKind::DualPipe, pp, m, 2).unwrap();
                for r in 0..pp {
                    assert_eq!(s.peak_in_flight(r), pp + 1, "pp={pp} m={m} r={r}");
                }
            }
        }
    }

    #[test]
    fn schedule_dualpipe_bubble_is_table_2s() {
        // DeepSeek-V3 Table 2: (PP/2 − 1)(T_F&B + T_B − 3 T_W). With F = B = W = 1 and nothing
        // overlapped, T_F&B = F + fused B = 3: (PP/2 − 1) · 1. Busy: m chunk passes of 3.
        for (pp, m) in [(4, 8), (8, 20), (6, 12), (8, 32)] {
            let want = 3.0 * m as f64 + (pp / 2 - 1) as f64;
            assert_eq!(
                unit_makespan(ScheduleKind::DualPipe, pp, m),
                want,
                "pp={pp} m={m}"
            );
        }
    }

    #[test]
    fn schedule_dualpipe_f_and_b_steps_overlap() {
        // pp = 2, m = 4 (the order above), F = 1, fused B = 2, B = W = 1, free p2p, and each
        // F&B step saves 0.5. By hand: rank 0 runs F0.0 [0,1], F2.1 [1,2], F1.0 [2,3], then
        // B2.1 right after it (another chunk, nothing to wait for): [3,4.5]; rank 1 runs F2.1
        // [0,1], F0.0 [1,2], F3.1 [2,3], B0.0 [3,4.5], F1.0 [4.5,5.5] (act at 3), B2.1
        // [5.5,7] (grad at 4.5), B1.0 [7,9] (after a backward: no saving), I3.1 [9,10] (grad
        // at 9), W3.1 [10,11]; rank 0: F3.1 [4.5,5.5] (act at 3), B0.0 [5.5,7], B3.1 [7,9],
        // I1.0 [9,10] (grad at 9), W1.0 [10,11]. Four F&B steps, 0.5 each: busy 12 − 1.
        let s = build(ScheduleKind::DualPipe, 2, 4, 2).unwrap();
        let (one, two) = (|_, _| 1.0, |_, _| 2.0);
        let costs = |x: f64| SimCosts {
            forward: &one,
            backward: &two,
            backward_input: &one,
            backward_weight: &one,
            overlap: Box::leak(Box::new(move |_, _, _| x)),
            p2p: &|_, _| 0.0,
        };
        let r = simulate(&s, &costs(0.5)).unwrap();
        assert_eq!((r.makespan, r.busy.clone()), (11.0, vec![11.0, 11.0]));
        let r = simulate(&s, &costs(0.0)).unwrap();
        assert_eq!(r.busy, vec![12.0, 12.0]);
        // Other schedules have no F&B step: the same costs change nothing.
        let one_f = build(ScheduleKind::OneFOneB, 2, 4, 1).unwrap();
        assert_eq!(
            simulate(&one_f, &costs(0.5)).unwrap().makespan,
            simulate(&one_f, &costs(0.0)).unwrap().makespan
        );
    }
}
