//! One step's predicted time on every pipeline stage, in four parts: compute, exposed
//! communication, the pipeline bubble and the optimizer (what `tessera plan --svg` draws).
//!
//! The plan's breakdown names the terms of one stage only, the bottleneck's; this reads the
//! same evaluation and simulation for every stage, with the breakdown's grouping, so that the
//! bottleneck's row is the breakdown regrouped. It predicts nothing new: every number is a term
//! `Evaluation::predict` already adds.

use super::pipeline::{Parts, Simulated};
use super::Evaluation;

/// One pipeline stage's share of a step, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageTime {
    pub stage: u64,
    /// Matmuls, attention, element-wise ops, recompute, and what the host's dispatch and the
    /// overlapped collectives add to them (the breakdown's `compute`, `recompute`,
    /// `host_floor`, `nccl_interference`).
    pub compute: f64,
    /// Communication nothing hides: TP, CP and EP collectives, blocking pipeline sends,
    /// ZeRO-3 gathers, offload's host copies, and the step's DP sync past the makespan (the
    /// breakdown's `tp_comm`, `cp_comm`, `ep_comm`, `pp_p2p_blocking`, `offload_copies`,
    /// `dp_exposed`).
    pub comm: f64,
    /// The stage idle inside the pipeline's makespan (`pipeline_bubble`).
    pub bubble: f64,
    /// The optimizer step past the makespan (`optimizer` or `host_optimizer`).
    pub optimizer: f64,
}

impl StageTime {
    pub fn total(&self) -> f64 {
        self.compute + self.comm + self.bubble + self.optimizer
    }
}

/// Which of [`StageTime`]'s parts a breakdown term (`cost::TimeTerm::name`) belongs to:
/// `compute`, `comm`, `bubble` or `optimizer`; `None` for a name the cost model does not write.
pub fn part_of(term: &str) -> Option<&'static str> {
    match term {
        "compute" | "recompute" | "host_floor" | "nccl_interference" => Some("compute"),
        "tp_comm" | "cp_comm" | "ep_comm" | "pp_p2p_blocking" | "offload_copies" | "dp_exposed" => {
            Some("comm")
        }
        "pipeline_bubble" => Some("bubble"),
        "optimizer" | "host_optimizer" => Some("optimizer"),
        _ => None,
    }
}

fn split(stage: u64, parts: &Parts) -> StageTime {
    StageTime {
        stage,
        compute: parts.compute + parts.recompute + parts.host + parts.interference,
        comm: parts.tp + parts.cp + parts.ep + parts.p2p + parts.zero3 + parts.offload,
        bubble: 0.0,
        optimizer: 0.0,
    }
}

impl Evaluation {
    /// Every stage's share of the step predicted from `sim` (the simulation of
    /// [`Evaluation::pipeline`]), in pipeline order.
    ///
    /// What follows the makespan (the exposed DP sync and the optimizer step) is the step's
    /// tail, the same on every row: the stage whose sync and optimizer end last sets it, and
    /// the next step's first forward waits for it whichever stage a row is, so the breakdown
    /// too charges the tail's stage's numbers to the step. Each row then sums to the step time.
    /// Where a node's ranks share fewer cores (the CPU backend), the step is the mean stage's
    /// busy time or the whole-core makespan, whichever is longer: a stage busier than that
    /// has no bubble and its row runs past the step by the difference, since its busy time is
    /// costed at a whole core per rank (the breakdown shows the mean stage there, not the
    /// bottleneck).
    pub fn stage_times(&self, sim: &Simulated) -> Vec<StageTime> {
        let p = &self.pipeline;
        let m = p.microbatches as f64;
        let (tail, dp_tail) = self.tail();
        let mean_busy = super::mean(&sim.busy);
        let inside = self.shared_step(sim.makespan, mean_busy, tail) - tail;
        (0..p.pp)
            .map(|s| {
                // The same sums, in the same order, as `predict`'s `stage_parts`.
                let parts = (0..p.virtual_stages)
                    .map(|c| {
                        let ch = p.chunk(s, c);
                        ch.fwd.add(&ch.bwd)
                    })
                    .fold(Parts::default(), |acc, x| acc.add(&x))
                    .scale(m);
                let mut t = split(s as u64, &parts);
                t.comm += dp_tail;
                t.bubble = (inside - sim.busy[s]).max(0.0);
                t.optimizer = tail - dp_tail;
                t
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{job, layout};
    use super::super::{evaluate, layer_times, Options};
    use super::*;
    use crate::cost::comm::Links;
    use crate::cost::pipeline::Simulator;
    use crate::schedule::ScheduleKind;

    /// The bottleneck stage's row is the breakdown regrouped, term by term, and every row adds
    /// up to the step time: for plain, interleaved, ZeRO-3 and GPipe layouts, with the
    /// framework behaviours that add the less common terms (blocking sends, interference).
    #[test]
    fn cost_stage_times_regroup_the_breakdown() {
        let (m, c) = job("gpt3-175b.toml", 16);
        let blocking = Options {
            blocking_p2p: true,
            overlap_slows_compute: true,
            ..Options::default()
        };
        for (l, o) in [
            (
                layout(2, 8, 8, 1, ScheduleKind::OneFOneB, 1),
                Options::default(),
            ),
            (
                layout(2, 8, 8, 0, ScheduleKind::Interleaved, 3),
                Options::default(),
            ),
            (
                layout(4, 4, 8, 3, ScheduleKind::Gpipe, 1),
                Options::default(),
            ),
            (
                layout(16, 1, 8, 0, ScheduleKind::OneFOneB, 1),
                Options::default(),
            ),
            (layout(4, 4, 8, 1, ScheduleKind::OneFOneB, 1), blocking),
        ] {
            let links = Links::new(&c, &l.mesh(&c));
            let t = layer_times(&m, &c, &l, &links, o);
            let split = l.split_layers(m.architecture.layers);
            let e = evaluate(&m, &c, &l, &split, &links, &t, o);
            let sim = Simulator::new().run(&e.pipeline);
            let p = e.predict(&sim);
            let rows = e.stage_times(&sim);
            assert_eq!(rows.len() as u64, l.pp, "{}", l.label());
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * p.step_time_s;
            for r in &rows {
                assert!(
                    close(r.total(), p.step_time_s),
                    "{} stage {}: {} s against the step's {} s",
                    l.label(),
                    r.stage,
                    r.total(),
                    p.step_time_s
                );
            }
            let b = &rows[p.bottleneck_stage as usize];
            for (part, got) in [
                ("compute", b.compute),
                ("comm", b.comm),
                ("bubble", b.bubble),
                ("optimizer", b.optimizer),
            ] {
                let want: f64 = p
                    .breakdown
                    .iter()
                    .filter(|t| part_of(&t.name).expect("a known term") == part)
                    .map(|t| t.seconds)
                    .sum();
                assert!(
                    close(got, want),
                    "{} {part}: {got} against {want}",
                    l.label()
                );
            }
        }
    }
}
