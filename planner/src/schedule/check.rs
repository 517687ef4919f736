//! `Schedule::check`: the invariants every op list must satisfy before anything executes it.
//!
//! Every (mb, chunk) a stage computes runs Forward once and then either Backward once, or
//! BackwardInput and later BackwardWeight once each; sends and receives pair up in channel
//! order; and the happens-before graph ([`graph`]) has no cycle, so under buffered sends and
//! blocking receives every op list runs to its end. This module only checks; it builds nothing.

use super::*;

impl Schedule {
    /// Check invariants; returns the first violation. Every (mb, chunk) the stage computes
    /// ([`runs_through`]) runs Forward once, then Backward once or BackwardInput and later
    /// BackwardWeight once each, and no other (mb, chunk) runs anything; each input from another stage is
    /// received before the compute using it and each output is sent after the compute making it,
    /// to the stage the layout says; each channel's receives are exactly its sends, in order; and
    /// the happens-before graph has no cycle (no deadlock under buffered sends / blocking
    /// receives).
    pub fn check(&self) -> Result<(), String> {
        let (pp, m, v) = (self.pp, self.microbatches, self.virtual_stages);
        let geo = Geometry::of(self);
        if pp == 0 || m == 0 || v == 0 || self.stages.len() != pp {
            let n = self.stages.len();
            return Err(format!(
                "need pp, m, v >= 1 and pp op lists: pp={pp} m={m} v={v}, {n} lists"
            ));
        }
        for (s, ops) in self.stages.iter().enumerate() {
            check_stage(self, s, ops)?;
        }
        // Per channel (from, to): messages in list order, named by the receiver as
        // (backward, mb, receiver chunk); the two sides must agree element by element.
        type Msg = (bool, usize, usize);
        let mut sent: HashMap<(usize, usize), Vec<Msg>> = HashMap::new();
        let mut got: HashMap<(usize, usize), Vec<Msg>> = HashMap::new();
        for (s, ops) in self.stages.iter().enumerate() {
            for op in ops {
                match op.parts() {
                    (Role::Compute | Role::Input | Role::Weight, ..) => {}
                    (Role::Recv, bw, mb, chunk, peer) => {
                        got.entry((peer, s)).or_default().push((bw, mb, chunk));
                    }
                    (Role::Send, bw, mb, chunk, peer) => {
                        let c = geo.edges(s, chunk, bw).1.map_or(usize::MAX, |o| o.1);
                        sent.entry((s, peer)).or_default().push((bw, mb, c));
                    }
                }
            }
        }
        let mut channels: Vec<_> = sent.keys().chain(got.keys()).copied().collect();
        channels.sort_unstable();
        channels.dedup();
        for (from, to) in channels {
            let a = sent.get(&(from, to)).map_or(&[][..], Vec::as_slice);
            let b = got.get(&(from, to)).map_or(&[][..], Vec::as_slice);
            if let Some(k) = (0..a.len().max(b.len())).find(|&k| a.get(k) != b.get(k)) {
                return Err(format!(
                    "channel stage {from} -> {to}: message {k} sent is {:?} but received is {:?} \
                     (as (backward, mb, receiver chunk)); receives must follow send order",
                    a.get(k),
                    b.get(k)
                ));
            }
        }
        let deps = graph::DependencyGraph::new(self).map_err(|e| e.to_string())?;
        deps.order(self).map(|_| ()).map_err(|e| e.to_string())
    }
}

/// 1F1B with pp = 2 and `m` micro-batches, with stage 0's first gradient receive moved to
/// the very front of its list: a schedule that deadlocks although its data flow is consistent.
#[cfg(test)]
pub(super) fn recv_grad_first(m: usize) -> Schedule {
    let mut s = build(ScheduleKind::OneFOneB, 2, m, 1).expect("valid degrees");
    let i = s.stages[0]
        .iter()
        .position(|op| matches!(op, Op::RecvGrad { .. }))
        .expect("stage 0 receives gradients");
    let op = s.stages[0].remove(i);
    s.stages[0].insert(0, op);
    s
}

fn check_stage(sched: &Schedule, s: usize, ops: &[Op]) -> Result<(), String> {
    let (pp, m, v) = (sched.pp, sched.microbatches, sched.virtual_stages);
    let geo = Geometry::of(sched);
    // (role, backward, mb, chunk) → (position, peer)
    let mut pos: HashMap<(Role, bool, usize, usize), (usize, usize)> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        let (role, bw, mb, chunk, peer) = op.parts();
        let bad_peer = matches!(role, Role::Send | Role::Recv) && (peer >= pp || peer == s);
        if mb >= m || chunk >= v || bad_peer {
            return Err(format!(
                "stage {s} op {i} {op:?}: out of range or addressed to itself"
            ));
        }
        if !runs_through(sched.kind, m, mb, chunk) {
            return Err(format!(
                "stage {s} op {i} {op:?}: micro-batch {mb} does not pass through chunk {chunk} \
                 under {}",
                sched.kind
            ));
        }
        if pos.insert((role, bw, mb, chunk), (i, peer)).is_some() {
            return Err(format!("stage {s} op {i} {op:?}: appears more than once"));
        }
    }
    let mut needed = 0;
    for mb in 0..m {
        for chunk in (0..v).filter(|&c| runs_through(sched.kind, m, mb, c)) {
            let at = |role, bw, c| pos.get(&(role, bw, mb, c)).copied();
            // The op that makes the input gradient of (mb, c): its Backward or its B.
            let grad_at = |c| at(Role::Compute, true, c).or(at(Role::Input, true, c));
            let who = format!("stage {s} (mb {mb}, chunk {chunk})");
            let fused = at(Role::Compute, true, chunk);
            let split = (at(Role::Input, true, chunk), at(Role::Weight, true, chunk));
            let (Some((f, _)), b) = (at(Role::Compute, false, chunk), fused) else {
                return Err(format!("{who}: Forward missing"));
            };
            let b = match (b, split) {
                (Some((b, _)), (None, None)) => b,
                (None, (Some((i, _)), Some((w, _)))) => {
                    if w < i {
                        return Err(format!(
                            "{who}: BackwardWeight at op {w} before BackwardInput at op {i}"
                        ));
                    }
                    needed += 1;
                    i
                }
                _ => {
                    return Err(format!(
                        "{who}: needs one Backward, or one BackwardInput and one BackwardWeight"
                    ))
                }
            };
            if b < f {
                return Err(format!(
                    "{who}: Backward at op {b} before Forward at op {f}"
                ));
            }
            needed += 2;
            for (bw, run) in [(false, f), (true, b)] {
                let name = if bw { "Backward" } else { "Forward" };
                let (input, output) = geo.edges(s, chunk, bw);
                // Input made on this stage (pp = 1 interleaved, the tip of ZB-V's V): its
                // producer ran earlier. Input from another stage: received earlier, from it.
                if let Some((from, c)) = input {
                    let ok = if from == s {
                        let made = if bw {
                            grad_at(c)
                        } else {
                            at(Role::Compute, false, c)
                        };
                        matches!(made, Some((p, _)) if p < run)
                    } else {
                        needed += 1;
                        matches!(at(Role::Recv, bw, chunk), Some((r, p)) if r < run && p == from)
                    };
                    if !ok {
                        return Err(format!(
                            "{who}: {name} has no input from stage {from} before it"
                        ));
                    }
                }
                if let Some((to, _)) = output.filter(|o| o.0 != s) {
                    if !matches!(at(Role::Send, bw, chunk), Some((w, p)) if w > run && p == to) {
                        return Err(format!("{who}: no send to stage {to} after its {name}"));
                    }
                    needed += 1;
                }
            }
        }
    }
    if needed != ops.len() {
        let extra = ops.len() - needed;
        return Err(format!(
            "stage {s}: {extra} send/receive ops that no data flow needs"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_check_catches_swapped_receives() {
        let mut s = build(ScheduleKind::OneFOneB, 3, 4, 1).unwrap();
        // Stage 2's first two receives are RecvActivation mb 0 then mb 1; swap them.
        let idx: Vec<usize> = (0..s.stages[2].len())
            .filter(|&i| matches!(s.stages[2][i], Op::RecvActivation { .. }))
            .collect();
        s.stages[2].swap(idx[0], idx[1]);
        let err = s.check().unwrap_err();
        assert!(err.contains("stage 2"), "{err}");
    }

    #[test]
    fn schedule_check_catches_dropped_send() {
        let mut s = build(ScheduleKind::Interleaved, 4, 8, 2).unwrap();
        let i = s.stages[3]
            .iter()
            .position(|op| matches!(op, Op::SendActivation { .. }))
            .unwrap();
        s.stages[3].remove(i);
        assert!(s.check().unwrap_err().contains("no send"));
        // Dropping the matching receive too leaves the data flow broken on the receiver.
        let j = s.stages[0]
            .iter()
            .position(|op| matches!(op, Op::RecvActivation { .. }))
            .unwrap();
        s.stages[0].remove(j);
        assert!(s.check().is_err());
    }

    #[test]
    fn schedule_check_catches_misplaced_and_mixed_channel_order() {
        // A receive moved after the Forward that needs it.
        let mut s = build(ScheduleKind::Gpipe, 2, 2, 1).unwrap();
        s.stages[1].swap(0, 1);
        assert!(s.check().unwrap_err().contains("no input from stage 0"));
        // pp = 2 interleaved: one channel carries activations and gradients. Stage 0 sends
        // activation (mb 2, chunk 0) before gradient (mb 0, chunk 1); stage 1 receiving the
        // gradient first keeps data flow intact but breaks in-order matching.
        let mut s = build(ScheduleKind::Interleaved, 2, 4, 2).unwrap();
        let find = |ops: &[Op], op: Op| ops.iter().position(|o| *o == op).unwrap();
        let g = find(
            &s.stages[1],
            Op::RecvGrad {
                mb: 0,
                chunk: 0,
                peer: 0,
            },
        );
        let a = find(
            &s.stages[1],
            Op::RecvActivation {
                mb: 2,
                chunk: 0,
                peer: 0,
            },
        );
        assert!(a < g);
        let op = s.stages[1].remove(g);
        s.stages[1].insert(a, op);
        assert!(s.check().unwrap_err().contains("send order"));
    }

    #[test]
    fn schedule_receives_follow_the_senders_channel_order() {
        // No built-in schedule needs it, so a hand-made order: stage 1 runs micro-batch 1 before
        // 0 in both directions. Stage 1 must still receive activation 0 first (it was sent
        // first), and stage 0 gradient 1 first.
        let (f, b) = (Pass::Forward, Pass::Backward);
        let orders = vec![
            vec![(f, 0, 0), (f, 1, 0), (b, 0, 0), (b, 1, 0)],
            vec![(f, 1, 0), (f, 0, 0), (b, 1, 0), (b, 0, 0)],
        ];
        let geo = Geometry {
            kind: ScheduleKind::Gpipe,
            pp: 2,
            v: 1,
        };
        let stages = place_comm(geo, &orders);
        use Op::*;
        assert_eq!(
            stages[1][..4],
            [
                RecvActivation {
                    mb: 0,
                    chunk: 0,
                    peer: 0
                },
                RecvActivation {
                    mb: 1,
                    chunk: 0,
                    peer: 0
                },
                Forward { mb: 1, chunk: 0 },
                Forward { mb: 0, chunk: 0 },
            ]
        );
        assert_eq!(
            stages[0][4..],
            [
                RecvGrad {
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
                Backward { mb: 1, chunk: 0 },
            ]
        );
        let s = Schedule {
            kind: ScheduleKind::Gpipe,
            pp: 2,
            microbatches: 2,
            virtual_stages: 1,
            stages,
        };
        assert_eq!(s.check(), Ok(()));
    }

    #[test]
    fn schedule_check_catches_deadlock_with_consistent_data_flow() {
        // Data flow and channel order still hold, but stage 0 waits for a gradient that needs
        // its own forward.
        let s = recv_grad_first(2);
        assert!(s.check().unwrap_err().contains("deadlock"));
    }

    #[test]
    fn schedule_check_catches_split_backward_bugs() {
        let s = build(ScheduleKind::ZbH1, 3, 4, 1).unwrap();
        let pos = |s: &Schedule, st: usize, op: Op| s.stages[st].iter().position(|o| *o == op);
        // A W moved before its B.
        let mut bad = s.clone();
        let w = pos(&bad, 2, Op::BackwardWeight { mb: 0, chunk: 0 }).unwrap();
        let op = bad.stages[2].remove(w);
        bad.stages[2].insert(0, op);
        assert!(bad.check().unwrap_err().contains("before BackwardInput"));
        // A W dropped: the split backward is incomplete.
        let mut bad = s.clone();
        bad.stages[2].remove(w);
        assert!(bad
            .check()
            .unwrap_err()
            .contains("one BackwardInput and one"));
        // A B fused as well as split.
        let mut bad = s.clone();
        bad.stages[2].push(Op::Backward { mb: 0, chunk: 0 });
        assert!(bad.check().is_err());
        // DualPipe: a micro-batch of the forward direction run on the reverse chunk.
        let mut d = build(ScheduleKind::DualPipe, 2, 4, 2).unwrap();
        d.stages[0].push(Op::Forward { mb: 0, chunk: 1 });
        assert!(d
            .check()
            .unwrap_err()
            .contains("does not pass through chunk 1"));
        // ZB-V: the last rank's chunk 1 forward put before the chunk 0 forward feeding it.
        let mut v = build(ScheduleKind::ZbV, 2, 2, 2).unwrap();
        let a = pos(&v, 1, Op::Forward { mb: 0, chunk: 0 }).unwrap();
        let b = pos(&v, 1, Op::Forward { mb: 0, chunk: 1 }).unwrap();
        v.stages[1].swap(a, b);
        assert!(v.check().unwrap_err().contains("no input"));
    }
}
