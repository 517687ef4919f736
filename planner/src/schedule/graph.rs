//! A schedule as a happens-before graph (petgraph): one node per op, an edge from each op to
//! the next op of its stage, and an edge from each send to the receive that takes its message.
//!
//! Under the runtime's model (buffered sends, blocking receives), the op lists can run to the
//! end exactly when this graph has no cycle, and with per-op durations the time of the whole
//! pipeline is the longest path through it. That gives [`Schedule::check`] a deadlock test that
//! names an op on the cycle, and gives the event simulation ([`super::sim`]) an independent
//! oracle: the two compute the same makespan by different means.

use petgraph::algo::toposort;
use petgraph::graph::{DiGraph, NodeIndex};

use super::sim::{Keys, SimCosts};
use super::{Op, Schedule, ScheduleError};

/// One op of the schedule: `(stage, position in its list)`.
pub type OpRef = (usize, usize);

/// The happens-before graph; edge weights say whether the edge carries a message (from the
/// sending stage to the receiving one) or is program order.
pub struct DependencyGraph {
    pub graph: DiGraph<OpRef, Option<(usize, usize)>>,
}

impl DependencyGraph {
    /// Builds the graph. Errors when a receive has no matching send or an op crosses no
    /// pipeline boundary (what [`Schedule::check`] reports in more detail).
    pub fn new(schedule: &Schedule) -> Result<Self, ScheduleError> {
        let keys = Keys::for_schedule(schedule);
        let mut graph = DiGraph::new();
        let mut sender: Vec<Option<(NodeIndex, usize)>> = vec![None; keys.len()];
        let mut receivers = Vec::new();
        for (s, ops) in schedule.stages.iter().enumerate() {
            let mut prev = None;
            for (i, op) in ops.iter().enumerate() {
                let n = graph.add_node((s, i));
                if let Some(p) = prev {
                    graph.add_edge(p, n, None);
                }
                prev = Some(n);
                match op {
                    Op::SendActivation { .. } | Op::SendGrad { .. } => {
                        sender[keys.of(s, op)?] = Some((n, s));
                    }
                    Op::RecvActivation { .. } | Op::RecvGrad { .. } => {
                        receivers.push((keys.of(s, op)?, n, s, *op));
                    }
                    Op::Forward { .. }
                    | Op::Backward { .. }
                    | Op::BackwardInput { .. }
                    | Op::BackwardWeight { .. } => {}
                }
            }
        }
        for (slot, n, s, op) in receivers {
            let (from, sender_stage) = sender[slot].ok_or_else(|| ScheduleError::Malformed {
                reason: format!("stage {s}: {op:?} has no matching send"),
            })?;
            graph.add_edge(from, n, Some((sender_stage, s)));
        }
        Ok(DependencyGraph { graph })
    }

    /// The ops in an order that respects every dependency, or a deadlock error naming an op
    /// that waits on itself through a cycle.
    pub fn order(&self, schedule: &Schedule) -> Result<Vec<NodeIndex>, ScheduleError> {
        toposort(&self.graph, None).map_err(|cycle| {
            let (stage, index) = self.graph[cycle.node_id()];
            ScheduleError::Cycle {
                stage,
                index,
                op: schedule.stages[stage][index],
            }
        })
    }
}

/// The longest path through the dependency graph, with compute ops weighted by their
/// durations and message edges by their transfer time: the pipeline's makespan. Without
/// DualPipe's F&B overlap (`SimCosts::overlap`), which depends on when ops start: an oracle
/// for the simulation where that is zero.
pub fn critical_path(schedule: &Schedule, costs: &SimCosts) -> Result<f64, ScheduleError> {
    let deps = DependencyGraph::new(schedule)?;
    let g = &deps.graph;
    let mut finish = vec![0.0f64; g.node_count()];
    for n in deps.order(schedule)? {
        let ready = g
            .edges_directed(n, petgraph::Direction::Incoming)
            .map(|e| {
                use petgraph::visit::EdgeRef;
                let hop = e.weight().map_or(0.0, |(a, b)| (costs.p2p)(a, b));
                finish[e.source().index()] + hop
            })
            .fold(0.0, f64::max);
        let (s, i) = g[n];
        let d = costs.compute(s, &schedule.stages[s][i]);
        finish[n.index()] = ready + d;
    }
    Ok(finish.into_iter().fold(0.0, f64::max))
}

#[cfg(test)]
mod tests {
    use super::super::{build, simulate, ScheduleKind};
    use super::*;

    /// A small deterministic pseudo-random duration in [0.5, 1.5) per (seed, a, b).
    fn dur(seed: u64, a: usize, b: usize) -> f64 {
        let mut x = seed ^ ((a as u64) << 32) ^ (b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        0.5 + (x % 1000) as f64 / 1000.0
    }

    #[test]
    fn critical_path_equals_the_event_simulation() {
        let cases = [
            (ScheduleKind::Gpipe, 1, 3, 1),
            (ScheduleKind::Gpipe, 4, 6, 1),
            (ScheduleKind::OneFOneB, 2, 1, 1),
            (ScheduleKind::OneFOneB, 4, 8, 1),
            (ScheduleKind::OneFOneB, 8, 5, 1),
            (ScheduleKind::Interleaved, 2, 4, 2),
            (ScheduleKind::Interleaved, 4, 8, 3),
            (ScheduleKind::Interleaved, 3, 9, 4),
            (ScheduleKind::ZbH1, 4, 8, 1),
            (ScheduleKind::ZbH1, 5, 3, 1),
            (ScheduleKind::ZbV, 4, 8, 2),
            (ScheduleKind::ZbV, 3, 2, 2),
            (ScheduleKind::DualPipe, 4, 8, 2),
            (ScheduleKind::DualPipe, 6, 14, 2),
        ];
        for (kind, pp, m, v) in cases {
            let s = build(kind, pp, m, v).unwrap();
            for seed in 0..5u64 {
                let f = |st: usize, c: usize| dur(seed, st, c);
                let b = |st: usize, c: usize| 2.0 * dur(seed + 100, st, c);
                let p2p = |a: usize, b: usize| 0.1 * dur(seed + 200, a, b);
                let costs = SimCosts {
                    forward: &f,
                    backward: &b,
                    backward_input: &|st, c| 1.2 * dur(seed + 300, st, c),
                    backward_weight: &|st, c| 0.8 * dur(seed + 400, st, c),
                    overlap: &|_, _, _| 0.0,
                    p2p: &p2p,
                };
                let sim = simulate(&s, &costs).unwrap().makespan;
                let path = critical_path(&s, &costs).unwrap();
                assert!(
                    (sim - path).abs() <= 1e-9 * sim,
                    "{kind} pp={pp} m={m} v={v} seed={seed}: simulated {sim}, critical path {path}"
                );
            }
        }
    }

    #[test]
    fn a_cycle_is_a_deadlock_naming_an_op_on_it() {
        let s = super::super::check::recv_grad_first(1);
        let deps = DependencyGraph::new(&s).unwrap();
        match deps.order(&s) {
            Err(ScheduleError::Cycle { stage, index, op }) => {
                assert!(stage < 2 && s.stages[stage][index] == op);
            }
            other => panic!("expected a deadlock, got {other:?}"),
        }
        let unit = |_: usize, _: usize| 1.0;
        let costs = SimCosts {
            forward: &unit,
            backward: &unit,
            backward_input: &unit,
            backward_weight: &unit,
            overlap: &|_, _, _| 0.0,
            p2p: &unit,
        };
        assert!(critical_path(&s, &costs).is_err());
    }
}
