//! 1F1B, i.e. PipeDream-Flush (Narayanan et al. 2021) as in Megatron's non-interleaved schedule.
//!
//! Stage `s` runs `w = min(pp - s - 1, m)` warm-up forwards, then `m - w` pairs of one forward
//! and one backward, then `w` cool-down backwards, all in micro-batch order. Stage `s` therefore
//! holds at most `min(pp - s, m)` micro-batches' activations, against `m` for GPipe, with the
//! same bubble. This file only orders compute; send/receive placement is in `mod.rs`. No cost
//! model, no I/O.

/// Per stage, `(backward, mb, chunk)` in execution order.
pub(super) fn compute_order(pp: usize, m: usize) -> Vec<Vec<(bool, usize, usize)>> {
    (0..pp)
        .map(|s| {
            let warmup = (pp - s - 1).min(m);
            let mut order = Vec::with_capacity(2 * m);
            order.extend((0..warmup).map(|mb| (false, mb, 0)));
            for i in 0..m - warmup {
                order.push((false, warmup + i, 0));
                order.push((true, i, 0));
            }
            order.extend((m - warmup..m).map(|mb| (true, mb, 0)));
            order
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::*;

    #[test]
    fn schedule_1f1b_checks_over_grid() {
        for pp in 1..=8 {
            for m in 1..=16 {
                let s = build(ScheduleKind::OneFOneB, pp, m, 1).unwrap();
                s.check().unwrap_or_else(|e| panic!("pp={pp} m={m}: {e}"));
            }
        }
    }

    #[test]
    fn schedule_1f1b_peak_in_flight_is_pp_minus_stage() {
        for pp in 1..=8 {
            for m in 1..=16 {
                let s = build(ScheduleKind::OneFOneB, pp, m, 1).unwrap();
                for stage in 0..pp {
                    let want = (pp - stage).min(m);
                    assert_eq!(s.peak_in_flight(stage), want, "pp={pp} m={m} stage={stage}");
                }
            }
        }
    }

    #[test]
    fn schedule_1f1b_compute_order_matches_hand_written() {
        // pp = 3, m = 4: stage 0 warms up with 2 forwards, stage 2 with none.
        let s = build(ScheduleKind::OneFOneB, 3, 4, 1).unwrap();
        let compute = |st: usize| -> String {
            s.stages[st]
                .iter()
                .filter_map(|op| match op {
                    Op::Forward { mb, .. } => Some(format!("F{mb}")),
                    Op::Backward { mb, .. } => Some(format!("B{mb}")),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(compute(0), "F0 F1 F2 B0 F3 B1 B2 B3");
        assert_eq!(compute(1), "F0 F1 B0 F2 B1 F3 B2 B3");
        assert_eq!(compute(2), "F0 B0 F1 B1 F2 B2 F3 B3");
    }
}
