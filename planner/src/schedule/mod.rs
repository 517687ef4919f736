//! Pipeline schedules as pure functions: `(kind, pp, microbatches, virtual_stages)` → the ordered
//! op list of every pipeline stage (PP rank), including where each send and receive goes.
//!
//! The planner simulates these lists ([`sim`]) and the runtime executes them literally, with
//! buffered (non-blocking) sends and blocking receives. Messages between two stages are matched in
//! order, like NCCL point-to-point: the k-th receive on stage `b` from `a` takes the k-th message
//! `a` sent to `b`. Every list built here satisfies that model, and [`Schedule::check`] verifies
//! it. This module must not hold a cost model (durations come from the caller) or do I/O.
//!
//! Layout ([`virtual_stage`]): the model's layers are cut into contiguous pieces in model order,
//! and chunk `c` of stage `s` holds one of them: piece `c * pp + s` for Megatron's interleaving
//! (and the one-chunk schedules), a V for ZB-V (stage 0 holds the first and the last piece), and
//! for DualPipe two pipelines in opposite directions over the same `pp` pieces.

mod check;
mod dualpipe;
mod gpipe;
pub mod graph;
mod interleaved;
mod one_f_one_b;
pub mod sim;
mod zb_h1;
mod zb_v;

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use sim::{bubble_formula, simulate, simulate_summary, SimCosts, SimResult};

/// Which pipeline schedule. Serialized names are a contract: "gpipe", "1f1b", "interleaved",
/// "zb-h1", "zb-v", "dualpipe".
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
    /// Zero bubble ZB-H1 (Qi et al. 2024, §3.1): 1F1B with each backward split into B (input
    /// gradients) and W (weight gradients), some W delayed into the cool-down bubble.
    #[serde(rename = "zb-h1")]
    ZbH1,
    /// Zero bubble ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): two
    /// chunks per stage in a V, B and W split, as `torch`'s `ScheduleZBVZeroBubble`.
    #[serde(rename = "zb-v")]
    ZbV,
    /// DeepSeek-V3's DualPipe (DeepSeek-AI 2024, §3.2.1): two pipelines in opposite directions,
    /// each stage holding two model stages' parameters.
    #[serde(rename = "dualpipe")]
    DualPipe,
}

impl ScheduleKind {
    pub const ALL: [ScheduleKind; 6] = [
        ScheduleKind::Gpipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbV,
        ScheduleKind::DualPipe,
    ];

    /// The serialized name, also accepted by [`FromStr`].
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Gpipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
            ScheduleKind::ZbV => "zb-v",
            ScheduleKind::DualPipe => "dualpipe",
        }
    }

    /// Whether the schedule splits backwards into B and W ops.
    pub fn splits_backward(self) -> bool {
        matches!(
            self,
            ScheduleKind::ZbH1 | ScheduleKind::ZbV | ScheduleKind::DualPipe
        )
    }

    /// The virtual stages (chunks per stage) the schedule fixes, if it fixes them: 1 for
    /// gpipe, 1f1b and zb-h1, 2 for zb-v and dualpipe; `None` for interleaved (any v >= 2).
    pub fn fixed_virtual_stages(self) -> Option<usize> {
        match self {
            ScheduleKind::Gpipe | ScheduleKind::OneFOneB | ScheduleKind::ZbH1 => Some(1),
            ScheduleKind::ZbV | ScheduleKind::DualPipe => Some(2),
            ScheduleKind::Interleaved => None,
        }
    }
}

/// The index of the contiguous layer piece (model order, 0 = the embedding end) that chunk
/// `chunk` of PP rank `stage` holds. Interleaved, 1f1b, gpipe and zb-h1: `chunk * pp + stage`.
/// ZB-V (v = 2): chunk 0 holds piece `stage`, chunk 1 piece `2 * pp - 1 - stage`, so rank 0
/// holds the embedding and the head and the last rank runs pieces `pp - 1` and `pp` back to
/// back. DualPipe (v = 2): chunk 0 holds piece `stage` (the forward direction), chunk 1 piece
/// `pp - 1 - stage` (the reverse direction); the model is cut into `pp` pieces, each held twice.
/// (`_v` is there so that callers need not know which kinds ignore it.)
pub fn virtual_stage(
    kind: ScheduleKind,
    pp: usize,
    _v: usize,
    stage: usize,
    chunk: usize,
) -> usize {
    match kind {
        ScheduleKind::ZbV if chunk == 1 => 2 * pp - 1 - stage,
        ScheduleKind::DualPipe if chunk == 1 => pp - 1 - stage,
        ScheduleKind::ZbV | ScheduleKind::DualPipe => stage,
        _ => chunk * pp + stage,
    }
}

/// How many contiguous layer pieces the model is cut into: `pp * v`, except DualPipe's `pp`
/// (its two directions hold the same pieces).
pub fn pieces(kind: ScheduleKind, pp: usize, v: usize) -> usize {
    match kind {
        ScheduleKind::DualPipe => pp,
        _ => pp * v,
    }
}

/// Whether micro-batch `mb` of `m` passes through chunk `chunk` of every stage. Always, except
/// under DualPipe, where the first `m / 2` micro-batches take the forward direction (chunk 0)
/// and the rest the reverse one (chunk 1).
pub fn runs_through(kind: ScheduleKind, m: usize, mb: usize, chunk: usize) -> bool {
    match kind {
        ScheduleKind::DualPipe => chunk == usize::from(mb >= m / 2),
        _ => true,
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
/// `chunk` = model chunk index on this stage 0..v (v = 1 unless interleaved, zb-v or dualpipe).
/// In send and receive ops `chunk` is always the chunk *on the stage holding the op*. A stage
/// runs, for every (mb, chunk) it computes, one `Forward` and either one `Backward` or one
/// `BackwardInput` followed later by one `BackwardWeight`.
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
    /// The B pass of a split backward: the input gradients only (sent on like a `Backward`'s).
    BackwardInput {
        mb: usize,
        chunk: usize,
    },
    /// The W pass of a split backward: the weight gradients of (mb, chunk); no communication.
    BackwardWeight {
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
    #[error(
        "unknown pipeline schedule `{found}`; expected one of: gpipe, 1f1b, interleaved, zb-h1, \
         zb-v, dualpipe"
    )]
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
    #[error(
        "the {kind} schedule runs exactly {want} model chunks per stage, found virtual_stages = \
         {found}; set virtual_stages = {want}"
    )]
    FixedVirtualStages {
        kind: ScheduleKind,
        want: usize,
        found: usize,
    },
    #[error(
        "the dualpipe schedule needs an even pp and an even number of micro-batches, at least \
         2 * pp (half go each way, as DeepSeek's DualPipe asserts), found pp = {pp} and \
         {microbatches} micro-batches"
    )]
    DualPipeNeedsEven { pp: usize, microbatches: usize },
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
    let fused = |orders: Vec<Vec<(bool, usize, usize)>>| -> Vec<Vec<Step>> {
        orders
            .into_iter()
            .map(|o| {
                o.into_iter()
                    .map(|(bw, mb, c)| (if bw { Pass::Backward } else { Pass::Forward }, mb, c))
                    .collect()
            })
            .collect()
    };
    let orders = match kind {
        ScheduleKind::Gpipe | ScheduleKind::OneFOneB if virtual_stages != 1 => {
            return Err(ScheduleError::VirtualStagesWithoutInterleaving {
                kind,
                virtual_stages,
            });
        }
        ScheduleKind::ZbH1 | ScheduleKind::ZbV | ScheduleKind::DualPipe
            if kind.fixed_virtual_stages() != Some(virtual_stages) =>
        {
            return Err(ScheduleError::FixedVirtualStages {
                kind,
                want: kind.fixed_virtual_stages().unwrap_or(1),
                found: virtual_stages,
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
        ScheduleKind::DualPipe
            if !pp.is_multiple_of(2)
                || !microbatches.is_multiple_of(2)
                || microbatches < 2 * pp =>
        {
            return Err(ScheduleError::DualPipeNeedsEven { pp, microbatches });
        }
        ScheduleKind::Gpipe => fused(gpipe::compute_order(pp, microbatches)),
        ScheduleKind::OneFOneB => fused(one_f_one_b::compute_order(pp, microbatches)),
        ScheduleKind::Interleaved => {
            fused(interleaved::compute_order(pp, microbatches, virtual_stages))
        }
        ScheduleKind::ZbH1 => zb_h1::compute_order(pp, microbatches),
        ScheduleKind::ZbV => zb_v::compute_order(pp, microbatches),
        ScheduleKind::DualPipe => dualpipe::compute_order(pp, microbatches),
    };
    let geo = Geometry {
        kind,
        pp,
        v: virtual_stages,
    };
    let stages = place_comm(geo, &orders);
    Ok(Schedule {
        kind,
        pp,
        microbatches,
        virtual_stages,
        stages,
    })
}

/// A compute op's pass: what the generators order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Pass {
    Forward,
    /// B and W fused.
    Backward,
    /// B: input gradients.
    Input,
    /// W: weight gradients.
    Weight,
}

/// One compute op of a generator's order: `(pass, mb, chunk)`.
pub(crate) type Step = (Pass, usize, usize);

/// Where the pieces sit: what [`virtual_stage`] says, and its inverse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub kind: ScheduleKind,
    pub pp: usize,
    pub v: usize,
}

impl Geometry {
    pub(crate) fn of(s: &Schedule) -> Geometry {
        Geometry {
            kind: s.kind,
            pp: s.pp,
            v: s.virtual_stages,
        }
    }

    pub(crate) fn piece(&self, stage: usize, chunk: usize) -> usize {
        virtual_stage(self.kind, self.pp, self.v, stage, chunk)
    }

    pub(crate) fn pieces(&self) -> usize {
        pieces(self.kind, self.pp, self.v)
    }

    /// `(stage, chunk)` holding piece `g` in the pipeline that chunk `chunk` belongs to (DualPipe
    /// has two, one per direction; the other layouts one).
    fn holder(&self, g: usize, chunk: usize) -> (usize, usize) {
        let pp = self.pp;
        match self.kind {
            ScheduleKind::ZbV if g >= pp => (2 * pp - 1 - g, 1),
            ScheduleKind::ZbV => (g, 0),
            ScheduleKind::DualPipe if chunk == 1 => (pp - 1 - g, 1),
            ScheduleKind::DualPipe => (g, 0),
            _ => (g % pp, g / pp),
        }
    }

    /// `(input, output)` of a compute op as `(stage, chunk)` of the producer and the consumer;
    /// `None` at the ends of the model.
    fn edges(&self, stage: usize, chunk: usize, backward: bool) -> (Link, Link) {
        let g = self.piece(stage, chunk);
        let prev = (g > 0).then(|| self.holder(g - 1, chunk));
        let next = (g + 1 < self.pieces()).then(|| self.holder(g + 1, chunk));
        if backward {
            (next, prev)
        } else {
            (prev, next)
        }
    }
}

/// An op taken apart: what it does, in which direction, on what, with whom.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Role {
    /// A forward, or a fused backward.
    Compute,
    /// The B of a split backward.
    Input,
    /// The W of a split backward.
    Weight,
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
            Op::BackwardInput { mb, chunk } => (Input, true, mb, chunk, usize::MAX),
            Op::BackwardWeight { mb, chunk } => (Weight, true, mb, chunk, usize::MAX),
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
            (Role::Input, _) => Op::BackwardInput { mb, chunk },
            (Role::Weight, _) => Op::BackwardWeight { mb, chunk },
            (Role::Send, false) => Op::SendActivation { mb, chunk, peer },
            (Role::Recv, false) => Op::RecvActivation { mb, chunk, peer },
            (Role::Send, true) => Op::SendGrad { mb, chunk, peer },
            (Role::Recv, true) => Op::RecvGrad { mb, chunk, peer },
        }
    }

    /// Whether the op computes (forward, backward, B or W) rather than communicates.
    pub fn is_compute(&self) -> bool {
        matches!(self.parts().0, Role::Compute | Role::Input | Role::Weight)
    }
}

impl Pass {
    /// `(role, backward)` of the compute op; `backward` picks the direction of its messages.
    fn role(self) -> (Role, bool) {
        match self {
            Pass::Forward => (Role::Compute, false),
            Pass::Backward => (Role::Compute, true),
            Pass::Input => (Role::Input, true),
            Pass::Weight => (Role::Weight, true),
        }
    }
}

/// `(stage, chunk)` of a producer or consumer; `None` at the ends of the model.
type Link = Option<(usize, usize)>;

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
fn place_comm(geo: Geometry, orders: &[Vec<Step>]) -> Vec<Vec<Op>> {
    let pp = geo.pp;
    // A W pass moves nothing; every other pass sends and receives along the layout.
    let links = |s: usize, (pass, _, chunk): Step| match pass {
        Pass::Weight => (None, None),
        _ => geo.edges(s, chunk, pass.role().1),
    };
    // channels[from]: (to, messages in send order).
    let mut channels: Vec<Vec<(usize, Vec<Op>)>> = vec![Vec::new(); pp];
    for (s, order) in orders.iter().enumerate() {
        for &step in order {
            if let (_, Some((to, c))) = links(s, step) {
                if to != s {
                    let recv = Op::make(Role::Recv, step.0.role().1, step.1, c, s);
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
        for &step in order {
            let (pass, mb, chunk) = step;
            let (role, backward) = pass.role();
            let (input, output) = links(s, step);
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
            ops.push(Op::make(role, backward, mb, chunk, s));
            if let Some((to, _)) = output.filter(|o| o.0 != s) {
                ops.push(Op::make(Role::Send, backward, mb, chunk, to));
            }
        }
        stages.push(ops);
    }
    stages
}

impl Schedule {
    /// Largest number of (micro-batch, chunk) forward passes held at once on `stage`: from the
    /// forward until the last backward op of that (mb, chunk), its `Backward` or, split, its
    /// `BackwardWeight` (W still needs what B kept). With two or more chunks each unit is one
    /// chunk, i.e. `1/v` of the stage's layers (DualPipe: one of its two model stages).
    pub fn peak_in_flight(&self, stage: usize) -> usize {
        // A W-stash counted as a whole micro-batch: the peak is a count.
        self.peak_held(stage, 1.0).round() as usize
    }

    /// The largest `full + stash · waiting` over `stage`'s list, where `full` counts the
    /// (mb, chunk) whose forward ran and whose backward (fused, or B) has not, and `waiting`
    /// those whose B ran and whose W has not: between B and W a micro-batch keeps only what W
    /// needs (the linear layers' inputs and output gradients), `stash` of its activations.
    pub fn peak_held(&self, stage: usize, stash: f64) -> f64 {
        let (mut full, mut waiting, mut peak) = (0usize, 0usize, 0.0f64);
        for op in self.stages.get(stage).map_or(&[][..], Vec::as_slice) {
            match op {
                Op::Forward { .. } => full += 1,
                Op::Backward { .. } => full = full.saturating_sub(1),
                Op::BackwardInput { .. } => {
                    full = full.saturating_sub(1);
                    waiting += 1;
                }
                Op::BackwardWeight { .. } => waiting = waiting.saturating_sub(1),
                _ => continue,
            }
            peak = peak.max(full as f64 + stash * waiting as f64);
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
                out.push((ScheduleKind::ZbH1, pp, m, 1));
                out.push((ScheduleKind::ZbV, pp, m, 2));
                if pp % 2 == 0 && m % 2 == 0 && m >= 2 * pp {
                    out.push((ScheduleKind::DualPipe, pp, m, 2));
                }
            }
        }
        out
    }

    #[test]
    fn schedule_kind_names_are_the_contract() {
        let names = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe"];
        for (kind, name) in ScheduleKind::ALL.into_iter().zip(names) {
            assert_eq!(kind.name(), name);
            assert_eq!(name.parse::<ScheduleKind>(), Ok(kind));
            assert_eq!(serde_json::to_string(&kind).unwrap(), format!("\"{name}\""));
            assert_eq!(
                serde_json::from_str::<ScheduleKind>(&format!("\"{name}\"")).unwrap(),
                kind
            );
        }
        let err = "1F1B".parse::<ScheduleKind>().unwrap_err().to_string();
        assert!(names.iter().all(|n| err.contains(n)), "{err}");
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
        for (kind, v) in [(ZbH1, 2), (ZbV, 1), (ZbV, 3), (DualPipe, 1)] {
            let want = kind.fixed_virtual_stages().unwrap();
            let e = build(kind, 4, 8, v).unwrap_err();
            assert_eq!(
                e,
                E::FixedVirtualStages {
                    kind,
                    want,
                    found: v
                }
            );
            assert!(e.to_string().contains(kind.name()), "{e}");
        }
        for (pp, m) in [(3, 8), (4, 9), (4, 6)] {
            let e = build(DualPipe, pp, m, 2).unwrap_err();
            assert_eq!(
                e,
                E::DualPipeNeedsEven {
                    pp,
                    microbatches: m
                }
            );
            assert!(e.to_string().contains("2 * pp"), "{e}");
        }
    }

    /// The layouts of the shared API, written out: pp = 3.
    #[test]
    fn schedule_virtual_stage_layouts() {
        use ScheduleKind::*;
        let table = |kind, v| -> Vec<Vec<usize>> {
            (0..3)
                .map(|s| (0..v).map(|c| virtual_stage(kind, 3, v, s, c)).collect())
                .collect()
        };
        assert_eq!(table(Interleaved, 2), [[0, 3], [1, 4], [2, 5]]);
        assert_eq!(table(OneFOneB, 1), [[0], [1], [2]]);
        assert_eq!(table(ZbH1, 1), [[0], [1], [2]]);
        // The V: rank 0 holds the embedding's piece and the head's.
        assert_eq!(table(ZbV, 2), [[0, 5], [1, 4], [2, 3]]);
        // Two directions over 3 pieces, each held twice.
        assert_eq!(table(DualPipe, 2), [[0, 2], [1, 1], [2, 0]]);
        assert_eq!((pieces(ZbV, 3, 2), pieces(DualPipe, 3, 2)), (6, 3));
        assert!(runs_through(DualPipe, 8, 3, 0) && !runs_through(DualPipe, 8, 3, 1));
        assert!(runs_through(DualPipe, 8, 4, 1) && !runs_through(DualPipe, 8, 4, 0));
        assert!(runs_through(ZbV, 8, 4, 0) && runs_through(ZbV, 8, 4, 1));
    }

    /// `peak_held` weighs a micro-batch between its B and its W by `stash`: a hand-made stage
    /// F0 F1 B0(split) F2 W0 B1 B2 holds 2 full, then 1 full + 1 stash, then 2 full + 1 stash.
    #[test]
    fn schedule_peak_held_weighs_the_w_stash() {
        use Op::*;
        let s = Schedule {
            kind: ScheduleKind::ZbH1,
            pp: 1,
            microbatches: 3,
            virtual_stages: 1,
            stages: vec![vec![
                Forward { mb: 0, chunk: 0 },
                Forward { mb: 1, chunk: 0 },
                BackwardInput { mb: 0, chunk: 0 },
                Forward { mb: 2, chunk: 0 },
                BackwardWeight { mb: 0, chunk: 0 },
                Backward { mb: 1, chunk: 0 },
                Backward { mb: 2, chunk: 0 },
            ]],
        };
        assert_eq!(s.check(), Ok(()));
        assert_eq!(s.peak_held(0, 0.0), 2.0);
        assert_eq!(s.peak_held(0, 0.25), 2.25);
        assert_eq!(s.peak_in_flight(0), 3);
    }

    /// Counted here, independently of `check`: each (mb, chunk) a stage computes runs Forward
    /// once and either Backward or B and W once, sends equal receives, and the number of p2p
    /// messages is what the layout implies.
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
                        Op::BackwardInput { mb, chunk } => {
                            *seen.entry((1, mb, chunk)).or_insert(0) += 1
                        }
                        Op::BackwardWeight { mb, chunk } => {
                            *seen.entry((2, mb, chunk)).or_insert(0) += 1
                        }
                        Op::SendActivation { .. } | Op::SendGrad { .. } => sends += 1,
                        Op::RecvActivation { .. } | Op::RecvGrad { .. } => recvs += 1,
                    }
                }
                // DualPipe: each micro-batch through one of the two chunks; else through all.
                let units = if kind == ScheduleKind::DualPipe {
                    m
                } else {
                    m * v
                };
                let splits = ops
                    .iter()
                    .filter(|o| matches!(o, Op::BackwardInput { .. }))
                    .count();
                let ws = ops
                    .iter()
                    .filter(|o| matches!(o, Op::BackwardWeight { .. }))
                    .count();
                assert_eq!(splits, ws, "{kind} pp={pp} m={m} v={v} stage {st}");
                assert_eq!(
                    seen.len(),
                    2 * units + splits,
                    "{kind} pp={pp} m={m} v={v} stage {st}"
                );
                assert!(
                    seen.values().all(|&n| n == 1),
                    "{kind} pp={pp} m={m} v={v} stage {st}"
                );
            }
            // Boundaries between pieces, each crossed by every micro-batch's activation and
            // gradient: pp·v − 1 of them (DualPipe: pp − 1 per direction, each crossed by the
            // m/2 micro-batches going that way, so 2 · (m/2) · (pp − 1) · 2 messages). ZB-V's
            // boundary pp − 1 | pp lies inside the last stage: no message.
            let want = match kind {
                _ if pp == 1 => 0,
                ScheduleKind::DualPipe => 2 * m * (pp - 1),
                ScheduleKind::ZbV => 2 * m * (2 * pp - 2),
                _ => 2 * m * (pp * v - 1),
            };
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
            kind in 0usize..6, pp in 1usize..=24, groups in 1usize..=6, extra in 0usize..24, v in 2usize..=6,
        ) {
            let kind = ScheduleKind::ALL[kind];
            let (pp, m, v) = match kind {
                ScheduleKind::Interleaved => (pp, pp * groups, v),
                // An even pp and an even m of at least 2 pp.
                ScheduleKind::DualPipe => (2 * pp, 4 * pp + 2 * extra, 2),
                _ => (pp, groups * 4 + extra, kind.fixed_virtual_stages().unwrap_or(1)),
            };
            let s = build(kind, pp, m, v).unwrap();
            prop_assert_eq!(s.check(), Ok(()), "{} pp={} m={} v={}", kind, pp, m, v);
        }
    }
}
