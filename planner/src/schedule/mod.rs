//! Pipeline schedules as pure functions: `(kind, pp, microbatches, virtual_stages)` → the ordered
//! op list of every pipeline stage (PP rank), including where each send and receive goes.
//!
//! The planner simulates these lists ([`sim`]) and the runtime executes them literally, with
//! buffered (non-blocking) sends and blocking receives. Messages between two stages are matched in
//! order, like NCCL point-to-point: the k-th receive on stage `b` from `a` takes the k-th message
//! `a` sent to `b`. Every list built here satisfies that model, and [`Schedule::check`] verifies
//! it. This module must not hold a cost model (durations come from the caller) or do I/O.
//!
//! Layout: virtual stage of chunk `c` on stage `s` is `c * pp + s`; the model's layers are cut
//! into `pp * v` contiguous pieces in virtual-stage order (Megatron's interleaving).

mod gpipe;
mod interleaved;
mod one_f_one_b;
pub mod sim;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use sim::{bubble_formula, simulate, simulate_summary, SimCosts, SimResult};

/// Which pipeline schedule. Serialized names are a contract: "gpipe", "1f1b", "interleaved".
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema, PartialOrd, Ord,
)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (Huang et al. 2019).
    #[serde(rename = "gpipe")]
    Gpipe,
    /// PipeDream-Flush / Megatron's non-interleaved one-forward-one-backward.
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Megatron's interleaved 1F1B: `v` model chunks per stage (Narayanan et al. 2021).
    #[serde(rename = "interleaved")]
    Interleaved,
}

impl ScheduleKind {
    pub const ALL: [ScheduleKind; 3] = [
        ScheduleKind::Gpipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
    ];

    /// The serialized name, also accepted by [`FromStr`].
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Gpipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ScheduleKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| ScheduleError::UnknownKind {
                found: s.to_string(),
            })
    }
}

/// One step a pipeline stage (a PP rank) performs, in order. `mb` = micro-batch index 0..m,
/// `chunk` = model chunk index on this stage 0..v (v = 1 unless interleaved). In send and
/// receive ops `chunk` is always the chunk *on the stage holding the op*.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Op {
    Forward {
        mb: usize,
        chunk: usize,
    },
    Backward {
        mb: usize,
        chunk: usize,
    },
    /// send the forward output activation of (mb, chunk) to stage `peer`
    SendActivation {
        mb: usize,
        chunk: usize,
        peer: usize,
    },
    /// receive the forward input activation of (mb, chunk) from stage `peer`
    RecvActivation {
        mb: usize,
        chunk: usize,
        peer: usize,
    },
    /// send the input gradient of (mb, chunk) to stage `peer` (backward direction)
    SendGrad {
        mb: usize,
        chunk: usize,
        peer: usize,
    },
    /// receive the output gradient of (mb, chunk) from stage `peer`
    RecvGrad {
        mb: usize,
        chunk: usize,
        peer: usize,
    },
}

/// The op lists of one pipeline: `stages[s]` = ordered ops of PP rank `s`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub kind: ScheduleKind,
    pub pp: usize,
    pub microbatches: usize,
    pub virtual_stages: usize,
    pub stages: Vec<Vec<Op>>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ScheduleError {
    #[error("unknown pipeline schedule `{found}`; expected one of: gpipe, 1f1b, interleaved")]
    UnknownKind { found: String },
    #[error("{what} must be at least 1, found 0; set it to 1 or more")]
    ZeroDegree { what: &'static str },
    #[error(
        "the interleaved schedule needs at least 2 virtual stages (model chunks) per pipeline \
         stage, found {found}; set virtual_stages >= 2 or use the 1f1b schedule"
    )]
    InterleavedNeedsVirtualStages { found: usize },
    #[error(
        "the interleaved schedule needs micro-batches to be a multiple of pp (as in Megatron), \
         found {microbatches} micro-batches with pp = {pp}; use a multiple of {pp}"
    )]
    MicrobatchesNotMultipleOfPp { microbatches: usize, pp: usize },
    #[error(
        "the {kind} schedule runs one model chunk per stage, found virtual_stages = \
         {virtual_stages}; set virtual_stages = 1 or use the interleaved schedule"
    )]
    VirtualStagesWithoutInterleaving {
        kind: ScheduleKind,
        virtual_stages: usize,
    },
    #[error("malformed schedule: {reason}")]
    Malformed { reason: String },
    #[error(
        "pipeline deadlock: stage {stage} waits forever at op {index} ({op:?}); \
         {done} of {total} ops ran. Check the order of sends and receives"
    )]
    Deadlock {
        stage: usize,
        index: usize,
        op: Op,
        done: usize,
        total: usize,
    },
}

/// The one entry point, a pure function: validates the degrees and builds the op lists.
pub fn build(
    kind: ScheduleKind,
    pp: usize,
    microbatches: usize,
    virtual_stages: usize,
) -> Result<Schedule, ScheduleError> {
    for (what, n) in [
        ("pp", pp),
        ("microbatches", microbatches),
        ("virtual_stages", virtual_stages),
    ] {
        if n == 0 {
            return Err(ScheduleError::ZeroDegree { what });
        }
    }
    let orders = match kind {
        ScheduleKind::Gpipe | ScheduleKind::OneFOneB if virtual_stages != 1 => {
            return Err(ScheduleError::VirtualStagesWithoutInterleaving {
                kind,
                virtual_stages,
            });
        }
        ScheduleKind::Interleaved if virtual_stages < 2 => {
            return Err(ScheduleError::InterleavedNeedsVirtualStages {
                found: virtual_stages,
            });
        }
        ScheduleKind::Interleaved if !microbatches.is_multiple_of(pp) => {
            return Err(ScheduleError::MicrobatchesNotMultipleOfPp { microbatches, pp });
        }
        ScheduleKind::Gpipe => gpipe::compute_order(pp, microbatches),
        ScheduleKind::OneFOneB => one_f_one_b::compute_order(pp, microbatches),
        ScheduleKind::Interleaved => interleaved::compute_order(pp, microbatches, virtual_stages),
    };
    let stages = place_comm(pp, virtual_stages, &orders);
    Ok(Schedule {
        kind,
        pp,
        microbatches,
        virtual_stages,
        stages,
    })
}

/// An op taken apart: what it does, in which direction, on what, with whom.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Role {
    Compute,
    Send,
    Recv,
}

impl Op {
    /// `(role, backward, mb, chunk, peer)`; `peer` is `usize::MAX` for compute.
    fn parts(self) -> (Role, bool, usize, usize, usize) {
        use Role::*;
        match self {
            Op::Forward { mb, chunk } => (Compute, false, mb, chunk, usize::MAX),
            Op::Backward { mb, chunk } => (Compute, true, mb, chunk, usize::MAX),
            Op::SendActivation { mb, chunk, peer } => (Send, false, mb, chunk, peer),
            Op::RecvActivation { mb, chunk, peer } => (Recv, false, mb, chunk, peer),
            Op::SendGrad { mb, chunk, peer } => (Send, true, mb, chunk, peer),
            Op::RecvGrad { mb, chunk, peer } => (Recv, true, mb, chunk, peer),
        }
    }

    fn make(role: Role, backward: bool, mb: usize, chunk: usize, peer: usize) -> Op {
        match (role, backward) {
            (Role::Compute, false) => Op::Forward { mb, chunk },
            (Role::Compute, true) => Op::Backward { mb, chunk },
            (Role::Send, false) => Op::SendActivation { mb, chunk, peer },
            (Role::Recv, false) => Op::RecvActivation { mb, chunk, peer },
            (Role::Send, true) => Op::SendGrad { mb, chunk, peer },
            (Role::Recv, true) => Op::RecvGrad { mb, chunk, peer },
        }
    }
}

/// `(input, output)` of a compute op as `(stage, chunk)` of the producer and the consumer,
/// from the layout (virtual stage `chunk * pp + stage`); `None` at the ends of the model.
type Link = Option<(usize, usize)>;
fn edges(pp: usize, v: usize, stage: usize, chunk: usize, backward: bool) -> (Link, Link) {
    let vs = chunk * pp + stage;
    let at = |g: usize| (g % pp, g / pp);
    let prev = (vs > 0).then(|| at(vs - 1));
    let next = (vs + 1 < pp * v).then(|| at(vs + 1));
    if backward {
        (next, prev)
    } else {
        (prev, next)
    }
}

/// Turns per-stage compute orders (`(backward, mb, chunk)`) into op lists. A send goes right
/// after the compute producing it. A receive goes just before the compute consuming it, except
/// that receives on one channel must follow the sender's order: if the needed message is not
/// the next one on its channel, the earlier messages are received first (they were sent before
/// it, so this never waits longer than the needed message does). Only pp = 2 interleaved, where
/// one channel carries both activations and gradients, needs that.
fn place_comm(pp: usize, v: usize, orders: &[Vec<(bool, usize, usize)>]) -> Vec<Vec<Op>> {
    let mut channels: HashMap<(usize, usize), Vec<Op>> = HashMap::new();
    for (s, order) in orders.iter().enumerate() {
        for &(backward, mb, chunk) in order {
            if let (_, Some((to, c))) = edges(pp, v, s, chunk, backward) {
                if to != s {
                    let recv = Op::make(Role::Recv, backward, mb, c, s);
                    channels.entry((s, to)).or_default().push(recv);
                }
            }
        }
    }
    let mut stages = Vec::with_capacity(pp);
    for (s, order) in orders.iter().enumerate() {
        let mut ops = Vec::with_capacity(order.len() * 3);
        let mut received: HashSet<Op> = HashSet::new();
        let mut cursor: HashMap<usize, usize> = HashMap::new();
        for &(backward, mb, chunk) in order {
            let (input, output) = edges(pp, v, s, chunk, backward);
            if let Some((from, _)) = input.filter(|i| i.0 != s) {
                let needed = Op::make(Role::Recv, backward, mb, chunk, from);
                if !received.contains(&needed) {
                    let queue = channels.get(&(from, s)).map_or(&[][..], Vec::as_slice);
                    let at = cursor.entry(from).or_insert(0);
                    match queue[*at..].iter().position(|m| *m == needed) {
                        Some(k) => {
                            ops.extend_from_slice(&queue[*at..=*at + k]);
                            received.extend(&queue[*at..=*at + k]);
                            *at += k + 1;
                        }
                        // Cannot happen for the generators here; emit it so `check` reports it.
                        None => ops.push(needed),
                    }
                }
            }
            ops.push(Op::make(Role::Compute, backward, mb, chunk, s));
            if let Some((to, _)) = output.filter(|o| o.0 != s) {
                ops.push(Op::make(Role::Send, backward, mb, chunk, to));
            }
        }
        stages.push(ops);
    }
    stages
}

impl Schedule {
    /// Largest number of (micro-batch, chunk) forward passes whose activations are held at once
    /// on `stage` (forward done, backward not yet done). With interleaving each unit is one chunk,
    /// i.e. `1/v` of the stage's layers.
    pub fn peak_in_flight(&self, stage: usize) -> usize {
        let (mut live, mut peak) = (0usize, 0usize);
        for op in self.stages.get(stage).map_or(&[][..], Vec::as_slice) {
            match op {
                Op::Forward { .. } => {
                    live += 1;
                    peak = peak.max(live);
                }
                Op::Backward { .. } => live = live.saturating_sub(1),
                _ => {}
            }
        }
        peak
    }

    /// Check invariants; returns the first violation. Every (mb, chunk) runs Forward and
    /// Backward exactly once per stage, Backward after Forward; each input from another stage is
    /// received before the compute using it and each output is sent after the compute making it,
    /// to the stage the layout says; each channel's receives are exactly its sends, in order; and
    /// a simulation with unit durations under buffered sends / blocking receives terminates.
    pub fn check(&self) -> Result<(), String> {
        let (pp, m, v) = (self.pp, self.microbatches, self.virtual_stages);
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
                    (Role::Compute, ..) => {}
                    (Role::Recv, bw, mb, chunk, peer) => {
                        got.entry((peer, s)).or_default().push((bw, mb, chunk));
                    }
                    (Role::Send, bw, mb, chunk, peer) => {
                        let c = edges(pp, v, s, chunk, bw).1.map_or(usize::MAX, |o| o.1);
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
        let unit = |_: usize, _: usize| 1.0;
        let free = |_: usize, _: usize| 0.0;
        let costs = SimCosts {
            forward: &unit,
            backward: &unit,
            p2p: &free,
        };
        sim::simulate_summary(self, &costs)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// Data-flow checks of one stage's list: ranges, each compute once, every input received before
/// use from the right peer, every output sent after it is made, and no op that nothing needs.
fn check_stage(sched: &Schedule, s: usize, ops: &[Op]) -> Result<(), String> {
    let (pp, m, v) = (sched.pp, sched.microbatches, sched.virtual_stages);
    // (role, backward, mb, chunk) → (position, peer)
    let mut pos: HashMap<(Role, bool, usize, usize), (usize, usize)> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        let (role, bw, mb, chunk, peer) = op.parts();
        let bad_peer = role != Role::Compute && (peer >= pp || peer == s);
        if mb >= m || chunk >= v || bad_peer {
            return Err(format!(
                "stage {s} op {i} {op:?}: out of range or addressed to itself"
            ));
        }
        if pos.insert((role, bw, mb, chunk), (i, peer)).is_some() {
            return Err(format!("stage {s} op {i} {op:?}: appears more than once"));
        }
    }
    let mut needed = 0;
    for mb in 0..m {
        for chunk in 0..v {
            let at = |role, bw, c| pos.get(&(role, bw, mb, c)).copied();
            let who = format!("stage {s} (mb {mb}, chunk {chunk})");
            let (Some((f, _)), Some((b, _))) = (
                at(Role::Compute, false, chunk),
                at(Role::Compute, true, chunk),
            ) else {
                return Err(format!("{who}: Forward or Backward missing"));
            };
            if b < f {
                return Err(format!(
                    "{who}: Backward at op {b} before Forward at op {f}"
                ));
            }
            needed += 2;
            for (bw, run) in [(false, f), (true, b)] {
                let name = if bw { "Backward" } else { "Forward" };
                let (input, output) = edges(pp, v, s, chunk, bw);
                // Input made on this stage (pp = 1 interleaved): its producer ran earlier.
                // Input from another stage: received earlier, from that stage.
                if let Some((from, c)) = input {
                    let ok = if from == s {
                        matches!(at(Role::Compute, bw, c), Some((p, _)) if p < run)
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
    use proptest::prelude::*;

    /// Every valid (kind, pp, m, v) of the small grid.
    fn grid() -> Vec<(ScheduleKind, usize, usize, usize)> {
        let mut out = Vec::new();
        for pp in 1..=8 {
            for m in 1..=16 {
                out.push((ScheduleKind::Gpipe, pp, m, 1));
                out.push((ScheduleKind::OneFOneB, pp, m, 1));
                for v in (2..=4).filter(|_| m % pp == 0) {
                    out.push((ScheduleKind::Interleaved, pp, m, v));
                }
            }
        }
        out
    }

    #[test]
    fn schedule_kind_names_are_the_contract() {
        for (kind, name) in ScheduleKind::ALL
            .into_iter()
            .zip(["gpipe", "1f1b", "interleaved"])
        {
            assert_eq!(kind.name(), name);
            assert_eq!(name.parse::<ScheduleKind>(), Ok(kind));
            assert_eq!(serde_json::to_string(&kind).unwrap(), format!("\"{name}\""));
            assert_eq!(
                serde_json::from_str::<ScheduleKind>(&format!("\"{name}\"")).unwrap(),
                kind
            );
        }
        let err = "1F1B".parse::<ScheduleKind>().unwrap_err().to_string();
        assert!(
            err.contains("gpipe") && err.contains("1f1b") && err.contains("interleaved"),
            "{err}"
        );
    }

    #[test]
    fn schedule_build_rejects_bad_degrees() {
        use ScheduleError as E;
        use ScheduleKind::*;
        let zero = |what| E::ZeroDegree { what };
        let cases = [
            ((OneFOneB, 0, 4, 1), zero("pp")),
            ((Gpipe, 2, 0, 1), zero("microbatches")),
            ((Interleaved, 2, 4, 0), zero("virtual_stages")),
            (
                (Interleaved, 2, 4, 1),
                E::InterleavedNeedsVirtualStages { found: 1 },
            ),
        ];
        for ((kind, pp, m, v), want) in cases {
            assert_eq!(build(kind, pp, m, v), Err(want));
        }
        let e = build(OneFOneB, 2, 4, 2).unwrap_err();
        assert_eq!(
            e,
            E::VirtualStagesWithoutInterleaving {
                kind: OneFOneB,
                virtual_stages: 2
            }
        );
        let e = build(Interleaved, 4, 6, 2).unwrap_err();
        assert_eq!(
            e,
            E::MicrobatchesNotMultipleOfPp {
                microbatches: 6,
                pp: 4
            }
        );
        assert!(e.to_string().contains("multiple of 4"), "{e}");
    }

    /// Counted here, independently of `check`: each (mb, chunk) runs Forward and Backward once per
    /// stage, sends equal receives, and the number of p2p messages is what the layout implies.
    #[test]
    fn schedule_ops_counted_independently() {
        for (kind, pp, m, v) in grid() {
            let s = build(kind, pp, m, v).unwrap();
            let (mut sends, mut recvs) = (0, 0);
            for (st, ops) in s.stages.iter().enumerate() {
                let mut seen = HashMap::new();
                for op in ops {
                    match *op {
                        Op::Forward { mb, chunk } => *seen.entry((0, mb, chunk)).or_insert(0) += 1,
                        Op::Backward { mb, chunk } => *seen.entry((1, mb, chunk)).or_insert(0) += 1,
                        Op::SendActivation { .. } | Op::SendGrad { .. } => sends += 1,
                        Op::RecvActivation { .. } | Op::RecvGrad { .. } => recvs += 1,
                    }
                }
                assert_eq!(
                    seen.len(),
                    2 * m * v,
                    "{kind} pp={pp} m={m} v={v} stage {st}"
                );
                assert!(
                    seen.values().all(|&n| n == 1),
                    "{kind} pp={pp} m={m} v={v} stage {st}"
                );
            }
            // pp·v − 1 boundaries, each crossed by m activations and m gradients (none if pp = 1).
            let want = if pp == 1 { 0 } else { 2 * m * (pp * v - 1) };
            assert_eq!((sends, recvs), (want, want), "{kind} pp={pp} m={m} v={v}");
        }
    }

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
        let orders = vec![
            vec![(false, 0, 0), (false, 1, 0), (true, 0, 0), (true, 1, 0)],
            vec![(false, 1, 0), (false, 0, 0), (true, 1, 0), (true, 0, 0)],
        ];
        let stages = place_comm(2, 1, &orders);
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
        // 1F1B pp = 2, m = 2: move stage 0's first RecvGrad to the very front. Data flow and
        // channel order still hold, but stage 0 now waits for a gradient that needs its forward.
        let mut s = build(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
        let i = s.stages[0]
            .iter()
            .position(|op| matches!(op, Op::RecvGrad { .. }))
            .unwrap();
        let op = s.stages[0].remove(i);
        s.stages[0].insert(0, op);
        assert!(s.check().unwrap_err().contains("deadlock"));
    }

    #[test]
    fn schedule_peak_in_flight_out_of_range_stage_is_zero() {
        assert_eq!(
            build(ScheduleKind::Gpipe, 2, 3, 1)
                .unwrap()
                .peak_in_flight(5),
            0
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn schedule_check_holds_for_random_degrees(
            kind in 0usize..3, pp in 1usize..=24, groups in 1usize..=6, extra in 0usize..24, v in 2usize..=6,
        ) {
            let kind = ScheduleKind::ALL[kind];
            let (m, v) = match kind {
                ScheduleKind::Interleaved => (pp * groups, v),
                _ => (groups * 4 + extra, 1),
            };
            let s = build(kind, pp, m, v).unwrap();
            prop_assert_eq!(s.check(), Ok(()), "{} pp={} m={} v={}", kind, pp, m, v);
        }
    }
}
