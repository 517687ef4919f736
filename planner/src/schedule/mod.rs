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

mod check;
mod gpipe;
pub mod graph;
mod interleaved;
mod one_f_one_b;
pub mod sim;

use std::collections::HashMap;
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
    #[error(
        "pipeline deadlock: stage {stage} op {index} ({op:?}) waits on itself through a cycle \
         of sends and receives. Check the order of sends and receives"
    )]
    Cycle { stage: usize, index: usize, op: Op },
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
///
/// Linear in the ops (no hashing per op), so that a million micro-batch passes build in a
/// fraction of a second: a channel is found among its sender's (at most two) peers, and a
/// receive that was pulled ahead of its turn waits in a short list until its compute needs it
/// (each message is needed exactly once, so that list is the "already received" test).
fn place_comm(pp: usize, v: usize, orders: &[Vec<(bool, usize, usize)>]) -> Vec<Vec<Op>> {
    // channels[from]: (to, messages in send order).
    let mut channels: Vec<Vec<(usize, Vec<Op>)>> = vec![Vec::new(); pp];
    for (s, order) in orders.iter().enumerate() {
        for &(backward, mb, chunk) in order {
            if let (_, Some((to, c))) = edges(pp, v, s, chunk, backward) {
                if to != s {
                    let recv = Op::make(Role::Recv, backward, mb, c, s);
                    let out = &mut channels[s];
                    match out.iter_mut().find(|(t, _)| *t == to) {
                        Some((_, queue)) => queue.push(recv),
                        None => out.push((to, vec![recv])),
                    }
                }
            }
        }
    }
    let mut stages = Vec::with_capacity(pp);
    for (s, order) in orders.iter().enumerate() {
        let mut ops = Vec::with_capacity(order.len() * 3);
        let mut early: Vec<Op> = Vec::new();
        let mut cursor = vec![0usize; pp];
        for &(backward, mb, chunk) in order {
            let (input, output) = edges(pp, v, s, chunk, backward);
            if let Some((from, _)) = input.filter(|i| i.0 != s) {
                let needed = Op::make(Role::Recv, backward, mb, chunk, from);
                if let Some(i) = early.iter().position(|m| *m == needed) {
                    early.swap_remove(i);
                } else {
                    let queue = channels[from]
                        .iter()
                        .find(|(t, _)| *t == s)
                        .map_or(&[][..], |(_, q)| q.as_slice());
                    let at = &mut cursor[from];
                    match queue[*at..].iter().position(|m| *m == needed) {
                        Some(k) => {
                            ops.extend_from_slice(&queue[*at..=*at + k]);
                            early.extend_from_slice(&queue[*at..*at + k]);
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
