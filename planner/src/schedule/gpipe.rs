//! GPipe (Huang et al. 2019): every stage runs all forwards, then all backwards.
//!
//! Backwards run in ascending micro-batch order, as `torch.distributed.pipelining.ScheduleGPipe`
//! does (descending would give the same makespan for equal stages). Every stage holds all `m`
//! micro-batches' activations at the peak. This file only orders compute; send/receive placement
//! is in `mod.rs`, durations belong to the caller. No cost model, no I/O.

/// Per stage, `(backward, mb, chunk)` in execution order.
pub(super) fn compute_order(pp: usize, m: usize) -> Vec<Vec<(bool, usize, usize)>> {
    let one_stage: Vec<_> = (0..m)
        .map(|mb| (false, mb, 0))
        .chain((0..m).map(|mb| (true, mb, 0)))
        .collect();
    vec![one_stage; pp]
}

#[cfg(test)]
mod tests {
    use super::super::*;

    #[test]
    fn schedule_gpipe_checks_over_grid() {
        for pp in 1..=8 {
            for m in 1..=16 {
                let s = build(ScheduleKind::Gpipe, pp, m, 1).unwrap();
                s.check().unwrap_or_else(|e| panic!("pp={pp} m={m}: {e}"));
            }
        }
    }

    #[test]
    fn schedule_gpipe_holds_all_microbatches() {
        for (pp, m) in [(1, 1), (4, 8), (8, 3)] {
            let s = build(ScheduleKind::Gpipe, pp, m, 1).unwrap();
            for stage in 0..pp {
                assert_eq!(s.peak_in_flight(stage), m, "pp={pp} m={m} stage={stage}");
            }
        }
    }

    #[test]
    fn schedule_gpipe_order_is_forwards_then_backwards() {
        // pp = 2, m = 2, written out by hand.
        let s = build(ScheduleKind::Gpipe, 2, 2, 1).unwrap();
        use Op::*;
        assert_eq!(
            s.stages[0],
            vec![
                Forward { mb: 0, chunk: 0 },
                SendActivation {
                    mb: 0,
                    chunk: 0,
                    peer: 1
                },
                Forward { mb: 1, chunk: 0 },
                SendActivation {
                    mb: 1,
                    chunk: 0,
                    peer: 1
                },
                RecvGrad {
                    mb: 0,
                    chunk: 0,
                    peer: 1
                },
                Backward { mb: 0, chunk: 0 },
                RecvGrad {
                    mb: 1,
                    chunk: 0,
                    peer: 1
                },
                Backward { mb: 1, chunk: 0 },
            ]
        );
        assert_eq!(
            s.stages[1],
            vec![
                RecvActivation {
                    mb: 0,
                    chunk: 0,
                    peer: 0
                },
                Forward { mb: 0, chunk: 0 },
                RecvActivation {
                    mb: 1,
                    chunk: 0,
                    peer: 0
                },
                Forward { mb: 1, chunk: 0 },
                Backward { mb: 0, chunk: 0 },
                SendGrad {
                    mb: 0,
                    chunk: 0,
                    peer: 0
                },
                Backward { mb: 1, chunk: 0 },
                SendGrad {
                    mb: 1,
                    chunk: 0,
                    peer: 0
                },
            ]
        );
    }
}
