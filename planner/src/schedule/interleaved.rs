//! Megatron's interleaved 1F1B (Narayanan et al. 2021, `forward_backward_pipelining_with_
//! interleaving` in `megatron/core/pipeline_parallel/schedules.py`, default
//! `microbatch_group_size_per_vp_stage = pp`).
//!
//! Each stage holds `v` model chunks; chunk `c` of stage `s` is virtual stage `c * pp + s`. A
//! stage walks `m * v` "virtual micro-batches" `k`: micro-batches go in groups of `pp` through
//! chunk 0, then the same group through chunk 1, and so on (`get_model_chunk_id`,
//! `get_microbatch_id_in_model_chunk`); backwards walk the same table with chunks reversed.
//! Stage `s` warms up with `min((pp - s - 1) * 2 + (v - 1) * pp, m * v)` forwards, then
//! alternates forward `k + warmup` / backward `k`, then cools down. This file only orders
//! compute; send/receive placement is in `mod.rs`. No cost model, no I/O.

/// Megatron's warm-up count for stage `s`, in chunk forwards.
pub(super) fn warmup(pp: usize, m: usize, v: usize, s: usize) -> usize {
    ((pp - s - 1) * 2 + (v - 1) * pp).min(m * v)
}

/// `(mb, chunk)` of virtual micro-batch `k`; `m % pp == 0` is checked by the caller.
fn table(pp: usize, v: usize, k: usize, backward: bool) -> (usize, usize) {
    let group = k / (pp * v);
    let chunk = (k % (pp * v)) / pp;
    let mb = group * pp + k % pp;
    (mb, if backward { v - 1 - chunk } else { chunk })
}

/// Per stage, `(backward, mb, chunk)` in execution order.
pub(super) fn compute_order(pp: usize, m: usize, v: usize) -> Vec<Vec<(bool, usize, usize)>> {
    let total = m * v;
    let fwd = |k| {
        let (mb, c) = table(pp, v, k, false);
        (false, mb, c)
    };
    let bwd = |k| {
        let (mb, c) = table(pp, v, k, true);
        (true, mb, c)
    };
    (0..pp)
        .map(|s| {
            let w = warmup(pp, m, v, s);
            let mut order = Vec::with_capacity(2 * total);
            order.extend((0..w).map(fwd));
            for k in 0..total - w {
                order.push(fwd(k + w));
                order.push(bwd(k));
            }
            order.extend((total - w..total).map(bwd));
            order
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::*;

    fn compute(s: &Schedule, stage: usize) -> String {
        s.stages[stage]
            .iter()
            .filter_map(|op| match op {
                Op::Forward { mb, chunk } => Some(format!("F{mb}.{chunk}")),
                Op::Backward { mb, chunk } => Some(format!("B{mb}.{chunk}")),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn schedule_interleaved_checks_over_grid() {
        for pp in 1..=8 {
            for m in (pp..=16).step_by(pp) {
                for v in 2..=4 {
                    let s = build(ScheduleKind::Interleaved, pp, m, v).unwrap();
                    s.check()
                        .unwrap_or_else(|e| panic!("pp={pp} m={m} v={v}: {e}"));
                }
            }
        }
    }

    #[test]
    fn schedule_interleaved_peak_matches_megatron_warmup() {
        // Megatron: stage s holds its warm-up forwards plus the one forward of the first steady
        // 1F1B pair, i.e. min((pp - s - 1) * 2 + (v - 1) * pp + 1, m * v) chunk activations.
        // On stage 0 that is v*pp + pp - 1 chunks = pp * (1 + (pp - 1) / (pp * v)) stage-sized
        // activations when m is large (Korthikanti et al. 2022, §4.2.3).
        for pp in 1..=8 {
            for m in (pp..=16).step_by(pp) {
                for v in 2..=4 {
                    let s = build(ScheduleKind::Interleaved, pp, m, v).unwrap();
                    for stage in 0..pp {
                        let want = ((pp - stage - 1) * 2 + (v - 1) * pp + 1).min(m * v);
                        assert_eq!(
                            s.peak_in_flight(stage),
                            want,
                            "pp={pp} m={m} v={v} s={stage}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn schedule_interleaved_order_matches_hand_written() {
        // pp = 2, v = 2, m = 4 worked out by hand from Megatron's table: warm-up 4 on stage 0,
        // 2 on stage 1; mb groups of 2 go through chunk 0, then chunk 1.
        let s = build(ScheduleKind::Interleaved, 2, 4, 2).unwrap();
        assert_eq!(
            compute(&s, 0),
            "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0"
        );
        assert_eq!(
            compute(&s, 1),
            "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0"
        );
    }

    #[test]
    fn schedule_interleaved_wraps_last_stage_to_first() {
        let s = build(ScheduleKind::Interleaved, 4, 4, 2).unwrap();
        // Stage 3 chunk 0 (virtual stage 3) feeds stage 0 chunk 1 (virtual stage 4).
        assert!(s.stages[3].contains(&Op::SendActivation {
            mb: 0,
            chunk: 0,
            peer: 0
        }));
        assert!(s.stages[0].contains(&Op::RecvActivation {
            mb: 0,
            chunk: 1,
            peer: 3
        }));
        assert!(s.stages[0].contains(&Op::SendGrad {
            mb: 0,
            chunk: 1,
            peer: 3
        }));
        assert!(s.stages[3].contains(&Op::RecvGrad {
            mb: 0,
            chunk: 0,
            peer: 0
        }));
        // The last virtual stage sends nothing forward; the first receives no activation.
        assert!(!s.stages[3]
            .iter()
            .any(|op| matches!(op, Op::SendActivation { chunk: 1, .. })));
        assert!(!s.stages[0]
            .iter()
            .any(|op| matches!(op, Op::RecvActivation { chunk: 0, .. })));
    }

    #[test]
    fn schedule_interleaved_single_stage_has_no_comm() {
        let s = build(ScheduleKind::Interleaved, 1, 3, 3).unwrap();
        assert_eq!(s.stages[0].len(), 2 * 3 * 3);
        assert_eq!(compute(&s, 0), "F0.0 F0.1 F0.2 B0.2 F1.0 B0.1 F1.1 B0.0 F1.2 B1.2 F2.0 B1.1 F2.1 B1.0 F2.2 B2.2 B2.1 B2.0");
        s.check().unwrap();
    }
}
