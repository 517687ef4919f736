//! Event simulation of pipeline op lists: how long a [`Schedule`] takes given per-op durations.
//!
//! Model (the runtime's): each stage runs its ops in order; Forward/Backward take their duration;
//! a send is asynchronous (free for the sender, arrives `p2p(from, to)` after it is issued); a
//! receive completes at `max(now, arrival)`. One pass over the ops with a worklist of stages that
//! may progress: O(total ops), one flat array of arrival times. Messages are matched by identity
//! (micro-batch and pipeline boundary), which equals in-order matching for any schedule that
//! passes [`Schedule::check`]. This module must not know where durations come from (no cost
//! model) and does no I/O.

use super::{Geometry, Op, Schedule, ScheduleError, ScheduleKind};

/// Per-op durations in seconds, supplied by the cost model.
pub struct SimCosts<'a> {
    /// `(stage, chunk)` → forward time of one micro-batch.
    pub forward: &'a dyn Fn(usize, usize) -> f64,
    /// `(stage, chunk)` → backward time of one micro-batch (B and W fused: `Op::Backward`).
    pub backward: &'a dyn Fn(usize, usize) -> f64,
    /// `(stage, chunk)` → time of the B pass of a split backward (`Op::BackwardInput`).
    pub backward_input: &'a dyn Fn(usize, usize) -> f64,
    /// `(stage, chunk)` → time of the W pass of a split backward (`Op::BackwardWeight`).
    pub backward_weight: &'a dyn Fn(usize, usize) -> f64,
    /// `(stage, forward chunk, backward chunk)` → seconds a fused `Backward` saves when it
    /// follows a `Forward` of another chunk on its stage with nothing to wait for in between:
    /// DualPipe's overlapped "F&B" step, whose communication of one pass hides under the
    /// other's compute. Only DualPipe schedules ask; clamped to the backward's duration.
    pub overlap: &'a dyn Fn(usize, usize, usize) -> f64,
    /// `(from, to)` → transfer time of one activation or gradient.
    pub p2p: &'a dyn Fn(usize, usize) -> f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SimResult {
    /// End of the last op on any stage.
    pub makespan: f64,
    /// Compute (Forward, Backward, B and W) time per stage.
    pub busy: Vec<f64>,
    /// `1 - mean(busy) / makespan`; 0 when nothing runs.
    pub bubble_fraction: f64,
    /// Per stage: `(op, start, end)` in list order; empty from [`simulate_summary`].
    pub timeline: Vec<Vec<(Op, f64, f64)>>,
}

/// Simulates `schedule`, recording the full timeline. Errors on a deadlock or malformed op.
pub fn simulate(schedule: &Schedule, costs: &SimCosts) -> Result<SimResult, ScheduleError> {
    run(schedule, costs, true)
}

/// Like [`simulate`] but without the timeline, for the search's inner loop.
pub fn simulate_summary(schedule: &Schedule, costs: &SimCosts) -> Result<SimResult, ScheduleError> {
    run(schedule, costs, false)
}

/// The textbook bubble, as bubble time / ideal time: `(p − 1) / m` for GPipe and 1F1B,
/// `(p − 1) / (v · m)` for interleaved. The split schedules' papers state theirs in the pass
/// times; with B and W taking equal times and F = B (`T_F = T_B = T_W`, a fused backward
/// `2 T_F`) they are: ZB-H1 `(p − 1)(T_F + T_B − T_W) / (m (T_F + T_B + T_W)) = (p − 1) / (3m)`,
/// ZB-V 0, DualPipe `(p/2 − 1)(T_F&B + T_B − 3 T_W) / (m (T_F + T_B + T_W)) = (p/2 − 1) / (3m)`
/// (DeepSeek-V3 Table 2, with `T_F&B = T_F + T_B + T_W`, nothing overlapped). A test oracle
/// for [`simulate`] and a line of the explanation, not a cost model.
pub fn bubble_formula(
    kind: ScheduleKind,
    pp: usize,
    microbatches: usize,
    virtual_stages: usize,
) -> f64 {
    let (p, m) = (pp.saturating_sub(1) as f64, microbatches.max(1) as f64);
    match kind {
        ScheduleKind::Interleaved => p / (virtual_stages.max(1) as f64 * m),
        ScheduleKind::Gpipe | ScheduleKind::OneFOneB => p / m,
        ScheduleKind::ZbH1 => p / (3.0 * m),
        ScheduleKind::ZbV => 0.0,
        ScheduleKind::DualPipe => (pp / 2).saturating_sub(1) as f64 / (3.0 * m),
    }
}

/// Slot of a message in the arrival array: direction, micro-batch, and the boundary between
/// pieces `b` and `b + 1` it crosses. Under DualPipe a micro-batch takes one direction only, so
/// the micro-batch also names the direction (the pipeline) its message belongs to.
pub(super) struct Keys {
    geo: Geometry,
    m: usize,
}

impl Keys {
    pub(super) fn for_schedule(schedule: &Schedule) -> Keys {
        Keys {
            geo: Geometry::of(schedule),
            m: schedule.microbatches,
        }
    }

    pub(super) fn len(&self) -> usize {
        2 * self.m * self.geo.pieces().saturating_sub(1)
    }

    /// Slot of a send or receive on `stage` (compute ops have none and are an error here).
    pub(super) fn of(&self, stage: usize, op: &Op) -> Result<usize, ScheduleError> {
        let (grad, send, mb, chunk, peer) = match *op {
            Op::Forward { .. }
            | Op::Backward { .. }
            | Op::BackwardInput { .. }
            | Op::BackwardWeight { .. } => (false, false, usize::MAX, 0, 0),
            Op::SendActivation { mb, chunk, peer } => (false, true, mb, chunk, peer),
            Op::RecvActivation { mb, chunk, peer } => (false, false, mb, chunk, peer),
            Op::SendGrad { mb, chunk, peer } => (true, true, mb, chunk, peer),
            Op::RecvGrad { mb, chunk, peer } => (true, false, mb, chunk, peer),
        };
        let (pp, v) = (self.geo.pp, self.geo.v);
        let vs = if chunk < v {
            self.geo.piece(stage, chunk)
        } else {
            0
        };
        // Activations cross boundary vs (send) / vs - 1 (recv); gradients the reverse.
        let boundary = match (grad, send) {
            (false, true) | (true, false) => Some(vs),
            (false, false) | (true, true) => vs.checked_sub(1),
        };
        let bounds = self.geo.pieces().saturating_sub(1);
        match boundary {
            Some(b) if b < bounds && mb < self.m && chunk < v && peer < pp => {
                Ok((usize::from(grad) * self.m + mb) * bounds + b)
            }
            _ => Err(ScheduleError::Malformed {
                reason: format!(
                    "stage {stage}: {op:?} crosses no pipeline boundary or is out of range"
                ),
            }),
        }
    }
}

impl SimCosts<'_> {
    /// Duration of a compute op on `stage`; 0 for a send or receive.
    pub fn compute(&self, stage: usize, op: &Op) -> f64 {
        match *op {
            Op::Forward { chunk, .. } => (self.forward)(stage, chunk),
            Op::Backward { chunk, .. } => (self.backward)(stage, chunk),
            Op::BackwardInput { chunk, .. } => (self.backward_input)(stage, chunk),
            Op::BackwardWeight { chunk, .. } => (self.backward_weight)(stage, chunk),
            _ => 0.0,
        }
    }
}

fn run(schedule: &Schedule, costs: &SimCosts, record: bool) -> Result<SimResult, ScheduleError> {
    let pp = schedule.pp;
    if pp == 0 || schedule.stages.len() != pp || schedule.virtual_stages == 0 {
        return Err(ScheduleError::Malformed {
            reason: format!(
                "expected pp >= 1 stage op lists and virtual_stages >= 1, found {} and {}",
                schedule.stages.len(),
                schedule.virtual_stages
            ),
        });
    }
    let keys = Keys::for_schedule(schedule);
    let mut arrival = vec![f64::NAN; keys.len()]; // NaN: not sent yet
    let mut pc = vec![0usize; pp];
    let mut clock = vec![0.0f64; pp];
    let mut busy = vec![0.0f64; pp];
    let mut waiting = vec![false; pp];
    // Per stage: (chunk, end) of its last compute op if that was a forward (DualPipe's F&B).
    let mut after_forward: Vec<Option<(usize, f64)>> = vec![None; pp];
    let pairs = schedule.kind == ScheduleKind::DualPipe;
    let mut timeline: Vec<Vec<(Op, f64, f64)>> = if record {
        schedule
            .stages
            .iter()
            .map(|ops| Vec::with_capacity(ops.len()))
            .collect()
    } else {
        Vec::new()
    };
    let mut ready: Vec<usize> = (0..pp).rev().collect();
    while let Some(s) = ready.pop() {
        let ops = &schedule.stages[s];
        while pc[s] < ops.len() {
            let op = ops[pc[s]];
            let start = clock[s];
            match op {
                Op::Forward { .. }
                | Op::Backward { .. }
                | Op::BackwardInput { .. }
                | Op::BackwardWeight { .. } => {
                    let mut d = costs.compute(s, &op);
                    if let (true, Op::Backward { chunk, .. }, Some((f, end))) =
                        (pairs, op, after_forward[s])
                    {
                        if f != chunk && end == start {
                            d -= (costs.overlap)(s, f, chunk).clamp(0.0, d);
                        }
                    }
                    after_forward[s] = match op {
                        Op::Forward { chunk, .. } => Some((chunk, start + d)),
                        _ => None,
                    };
                    clock[s] += d;
                    busy[s] += d;
                }
                Op::SendActivation { peer, .. } | Op::SendGrad { peer, .. } => {
                    let slot = keys.of(s, &op)?;
                    arrival[slot] = start + (costs.p2p)(s, peer);
                    if waiting[peer] {
                        waiting[peer] = false;
                        ready.push(peer);
                    }
                }
                Op::RecvActivation { .. } | Op::RecvGrad { .. } => {
                    let slot = keys.of(s, &op)?;
                    if arrival[slot].is_nan() {
                        waiting[s] = true;
                        break;
                    }
                    clock[s] = start.max(arrival[slot]);
                }
            }
            if record {
                timeline[s].push((op, start, clock[s]));
            }
            pc[s] += 1;
        }
    }
    if let Some(stage) = (0..pp).find(|&s| pc[s] < schedule.stages[s].len()) {
        return Err(ScheduleError::Deadlock {
            stage,
            index: pc[stage],
            op: schedule.stages[stage][pc[stage]],
            done: pc.iter().sum(),
            total: schedule.stages.iter().map(Vec::len).sum(),
        });
    }
    let makespan = clock.iter().copied().fold(0.0, f64::max);
    let mean_busy = busy.iter().sum::<f64>() / pp.max(1) as f64;
    let bubble_fraction = if makespan > 0.0 {
        1.0 - mean_busy / makespan
    } else {
        0.0
    };
    Ok(SimResult {
        makespan,
        busy,
        bubble_fraction,
        timeline,
    })
}

#[cfg(test)]
mod tests {
    use super::super::build;
    use super::*;

    fn costs_equal<'a>(
        f: &'a dyn Fn(usize, usize) -> f64,
        b: &'a dyn Fn(usize, usize) -> f64,
        p2p: &'a dyn Fn(usize, usize) -> f64,
    ) -> SimCosts<'a> {
        SimCosts {
            forward: f,
            backward: b,
            backward_input: &|_, _| f64::NAN,
            backward_weight: &|_, _| f64::NAN,
            overlap: &|_, _, _| 0.0,
            p2p,
        }
    }

    /// Equal stages, forward 1 and backward 2 per stage (split evenly over the v chunks), free
    /// p2p: (makespan − ideal) / ideal must be the textbook bubble, written out here.
    #[test]
    fn schedule_sim_matches_textbook_bubble() {
        let cases: &[(ScheduleKind, usize, usize, usize, f64)] = &[
            (ScheduleKind::Gpipe, 4, 8, 1, 3.0 / 8.0),
            (ScheduleKind::Gpipe, 8, 32, 1, 7.0 / 32.0),
            (ScheduleKind::OneFOneB, 2, 1, 1, 1.0),
            (ScheduleKind::OneFOneB, 4, 8, 1, 3.0 / 8.0),
            (ScheduleKind::OneFOneB, 8, 64, 1, 7.0 / 64.0),
            (ScheduleKind::OneFOneB, 1, 5, 1, 0.0),
            (ScheduleKind::Interleaved, 4, 8, 2, 3.0 / 16.0),
            (ScheduleKind::Interleaved, 4, 16, 4, 3.0 / 64.0),
            (ScheduleKind::Interleaved, 8, 32, 3, 7.0 / 96.0),
            (ScheduleKind::Interleaved, 2, 4, 2, 1.0 / 8.0),
        ];
        for &(kind, pp, m, v, want) in cases {
            let s = build(kind, pp, m, v).unwrap();
            let vf = v as f64;
            let (f, b, p2p) = (move |_, _| 1.0 / vf, move |_, _| 2.0 / vf, |_, _| 0.0);
            let r = simulate(&s, &costs_equal(&f, &b, &p2p)).unwrap();
            let ideal = 3.0 * m as f64;
            assert!(
                (r.busy[0] - ideal).abs() < 1e-9,
                "{kind} busy {} != {ideal}",
                r.busy[0]
            );
            let got = (r.makespan - ideal) / ideal;
            assert!(
                (got - want).abs() <= 0.01 * want.max(1e-9),
                "{kind} pp={pp} m={m} v={v}: simulated bubble {got}, textbook {want}"
            );
            assert!((bubble_formula(kind, pp, m, v) - want).abs() < 1e-12);
        }
    }

    #[test]
    fn schedule_sim_uneven_stages_by_hand() {
        // 1F1B, pp = 2, m = 2. Stage 0: F 1, B 2; stage 1: F 2, B 4; free p2p.
        // s0: F0 [0,1] F1 [1,2]; s1: F0 [1,3] B0 [3,7] F1 [7,9] B1 [9,13];
        // s0: B0 [7,9] B1 [13,15]. Busy 6 and 12, makespan 15, bubble 1 - 9/15.
        let s = build(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
        let f = |st: usize, _| if st == 0 { 1.0 } else { 2.0 };
        let b = |st: usize, _| if st == 0 { 2.0 } else { 4.0 };
        let r = simulate(&s, &costs_equal(&f, &b, &|_, _| 0.0)).unwrap();
        assert_eq!(r.makespan, 15.0);
        assert_eq!(r.busy, vec![6.0, 12.0]);
        assert!((r.bubble_fraction - 0.4).abs() < 1e-12);
        let b0 = r.timeline[0]
            .iter()
            .find(|t| t.0 == Op::Backward { mb: 0, chunk: 0 });
        assert_eq!(b0.map(|t| (t.1, t.2)), Some((7.0, 9.0)));
    }

    #[test]
    fn schedule_sim_p2p_latency_adds_on_the_critical_path() {
        // 1F1B, pp = 2, m = 1, F 1, B 2, p2p 0.5: F, hop, F, B, hop, B = 7.
        let s = build(ScheduleKind::OneFOneB, 2, 1, 1).unwrap();
        let c = costs_equal(&|_, _| 1.0, &|_, _| 2.0, &|_, _| 0.5);
        let r = simulate(&s, &c).unwrap();
        assert_eq!(r.makespan, 7.0);
        // Sends are free for the sender and ops on a stage never overlap.
        for stage in &r.timeline {
            for w in stage.windows(2) {
                assert!(w[0].2 <= w[1].1);
            }
            for (op, start, end) in stage {
                if matches!(op, Op::SendActivation { .. } | Op::SendGrad { .. }) {
                    assert_eq!(start, end);
                }
            }
        }
        assert!(simulate_summary(&s, &c).unwrap().timeline.is_empty());
    }

    #[test]
    fn schedule_sim_reports_deadlock() {
        // Both stages wait for each other first.
        let s = Schedule {
            kind: ScheduleKind::OneFOneB,
            pp: 2,
            microbatches: 1,
            virtual_stages: 1,
            stages: vec![
                vec![
                    Op::RecvGrad {
                        mb: 0,
                        chunk: 0,
                        peer: 1,
                    },
                    Op::Forward { mb: 0, chunk: 0 },
                    Op::SendActivation {
                        mb: 0,
                        chunk: 0,
                        peer: 1,
                    },
                    Op::Backward { mb: 0, chunk: 0 },
                ],
                vec![
                    Op::RecvActivation {
                        mb: 0,
                        chunk: 0,
                        peer: 0,
                    },
                    Op::Forward { mb: 0, chunk: 0 },
                    Op::Backward { mb: 0, chunk: 0 },
                    Op::SendGrad {
                        mb: 0,
                        chunk: 0,
                        peer: 0,
                    },
                ],
            ],
        };
        let unit = |_: usize, _: usize| 1.0;
        let err = simulate(&s, &costs_equal(&unit, &unit, &unit)).unwrap_err();
        assert!(matches!(
            err,
            ScheduleError::Deadlock {
                stage: 0,
                index: 0,
                done: 0,
                total: 8,
                ..
            }
        ));
        assert!(s.check().unwrap_err().contains("deadlock"));
    }

    #[test]
    fn schedule_sim_large_pipeline_runs() {
        let unit = |_: usize, _: usize| 1.0;
        let c = costs_equal(&unit, &unit, &unit);
        for (kind, v) in [(ScheduleKind::OneFOneB, 1), (ScheduleKind::Interleaved, 2)] {
            let s = build(kind, 64, 3072, v).unwrap();
            let r = simulate_summary(&s, &c).unwrap();
            assert!(r.makespan >= 2.0 * 3072.0);
        }
        let s = build(ScheduleKind::Gpipe, 128, 2048, 1).unwrap();
        assert!(simulate(&s, &c).is_ok());
    }
}
