//! The pipeline part of the step time: per-chunk op durations, a lower bound, and the makespan
//! of the event simulation of the planner's own schedule op lists (`schedule::simulate_summary`).
//!
//! The lower bound lets the search skip simulations that cannot matter: stage `s` cannot start
//! before the first micro-batch's forward has crossed virtual stages `0..s`, is busy for the sum
//! of its ops, and its last backward still has to cross virtual stages `s−1..0`, so
//! `makespan ≥ max_s (Σ_{j<s} (F_j + p2p_j) + busy_s + Σ_{j<s} (B_j + p2p_j))`. For equal stages
//! and free p2p this is the textbook makespan, `(1 + (p−1)/(v·m))` times the busy time; tests
//! check both the bound and that equality against the simulator. This module does not cost ops.

use std::collections::HashMap;

use crate::layout::MAX_SIMULATED_PASSES;
use crate::schedule::{self, Schedule, ScheduleKind, SimCosts};

/// Seconds of one micro-batch through one model chunk, in named parts.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Parts {
    /// Matmuls, attention and element-wise ops (including the embedding and the head).
    pub compute: f64,
    /// The forward ops that recompute runs again inside the backward.
    pub recompute: f64,
    /// Tensor-parallel collectives.
    pub tp: f64,
    /// ZeRO-3 parameter gathers and gradient scatters that compute does not hide.
    pub zero3: f64,
    /// Context parallelism's ring exchange that the attention does not hide.
    pub cp: f64,
    /// Expert parallelism's all-to-all token dispatch and combine.
    pub ep: f64,
    /// What the host's per-op dispatch adds beyond the GPU's time (`cost::host`).
    pub host: f64,
    /// What overlapped collectives add to the compute they slow (`cost::interference`).
    pub interference: f64,
    /// Blocking pipeline sends the sender waits for (`Options::blocking_p2p`).
    pub p2p: f64,
    /// Offload's host copies that the pass does not hide (`cost::offload`).
    pub offload: f64,
}

impl Parts {
    pub fn total(&self) -> f64 {
        self.compute
            + self.recompute
            + self.tp
            + self.zero3
            + self.cp
            + self.ep
            + self.host
            + self.interference
            + self.p2p
            + self.offload
    }

    pub fn add(&self, o: &Parts) -> Parts {
        Parts {
            compute: self.compute + o.compute,
            recompute: self.recompute + o.recompute,
            tp: self.tp + o.tp,
            zero3: self.zero3 + o.zero3,
            cp: self.cp + o.cp,
            ep: self.ep + o.ep,
            host: self.host + o.host,
            interference: self.interference + o.interference,
            p2p: self.p2p + o.p2p,
            offload: self.offload + o.offload,
        }
    }

    pub fn scale(&self, k: f64) -> Parts {
        Parts {
            compute: self.compute * k,
            recompute: self.recompute * k,
            tp: self.tp * k,
            zero3: self.zero3 * k,
            cp: self.cp * k,
            ep: self.ep * k,
            host: self.host * k,
            interference: self.interference * k,
            p2p: self.p2p * k,
            offload: self.offload * k,
        }
    }
}

/// Forward and backward of one micro-batch through one chunk (virtual stage).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ChunkTime {
    pub fwd: Parts,
    pub bwd: Parts,
    /// Seconds of `bwd.compute` that are the weight-gradient GEMMs: what a split backward's W
    /// pass runs; its B pass runs the rest of `bwd` (`Pipeline::backward_input`).
    pub wgrad: f64,
}

/// The op durations of one layout's pipeline: what the simulator needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Pipeline {
    pub kind: ScheduleKind,
    pub pp: usize,
    pub microbatches: usize,
    pub virtual_stages: usize,
    /// By layer piece, in model order (`schedule::virtual_stage` says which stage and chunk
    /// holds each: `chunk · pp + stage` unless zb-v or dualpipe).
    pub chunks: Vec<ChunkTime>,
    /// `p2p_next[s]`: one activation or gradient between stage `s` and `(s + 1) % pp`.
    pub p2p_next: Vec<f64>,
}

impl Pipeline {
    /// The durations of chunk `chunk` of stage `stage`.
    pub fn chunk(&self, stage: usize, chunk: usize) -> &ChunkTime {
        let piece = schedule::virtual_stage(self.kind, self.pp, self.virtual_stages, stage, chunk);
        &self.chunks[piece]
    }

    /// Seconds of the B pass of a split backward of chunk `chunk` of stage `stage`: the
    /// backward without its weight-gradient GEMMs. B carries the backward's communication,
    /// recompute and overheads; W is GEMMs alone.
    pub fn backward_input(&self, stage: usize, chunk: usize) -> f64 {
        let c = self.chunk(stage, chunk);
        c.bwd.total() - c.wgrad
    }

    /// Seconds a DualPipe backward of chunk `bwd` saves when it runs as one "F&B" step with the
    /// forward of chunk `fwd` just before it (`SimCosts::overlap`): each pass's expert
    /// all-to-all hides under the other's compute (DeepSeek-V3 §3.2.1, Fig. 4), at most that
    /// compute. Its pipeline sends are asynchronous anyway (the simulator's sends cost the
    /// sender nothing); its tensor-parallel collectives are not hidden (DeepSeek-V3 trains
    /// without TP).
    pub fn overlap(&self, stage: usize, fwd: usize, bwd: usize) -> f64 {
        if self.kind != ScheduleKind::DualPipe {
            return 0.0;
        }
        let (f, b) = (&self.chunk(stage, fwd).fwd, &self.chunk(stage, bwd).bwd);
        f.ep.min(b.compute) + b.ep.min(f.compute)
    }

    /// Seconds of the W pass of a split backward of chunk `chunk` of stage `stage`.
    pub fn backward_weight(&self, stage: usize, chunk: usize) -> f64 {
        self.chunk(stage, chunk).wgrad
    }

    /// Seconds for a message between two stages (the link is the same both ways).
    pub fn p2p(&self, from: usize, to: usize) -> f64 {
        if (from + 1) % self.pp == to {
            self.p2p_next[from]
        } else {
            self.p2p_next[to]
        }
    }

    /// Micro-batches through each chunk of a stage: all, or under DualPipe the half that
    /// takes that chunk's direction.
    fn runs_per_chunk(&self) -> f64 {
        match self.kind {
            ScheduleKind::DualPipe => (self.microbatches / 2) as f64,
            _ => self.microbatches as f64,
        }
    }

    /// Busy seconds of every stage over the step (all micro-batches, all its chunks).
    pub fn busy(&self) -> Vec<f64> {
        (0..self.pp)
            .map(|s| {
                (0..self.virtual_stages)
                    .map(|c| self.chunk(s, c).fwd.total() + self.chunk(s, c).bwd.total())
                    .sum::<f64>()
                    * self.runs_per_chunk()
            })
            .collect()
    }

    /// The least time stage `s` needs after its last backward: that micro-batch's gradient
    /// still crosses virtual stages `s−1..0`. Zero for the split schedules (a stage's W fill
    /// the end of the step, so its gradients are complete only near the makespan) and for
    /// DualPipe (whose reverse direction ends at the other end).
    pub fn drain(&self, stage: usize) -> f64 {
        if self.kind.splits_backward() {
            return 0.0;
        }
        (0..stage)
            .map(|j| self.chunks[j].bwd.total() + self.p2p(j + 1, j))
            .sum()
    }

    /// A lower bound of the simulated makespan (module docs). Under DualPipe each stage's busy
    /// time less the most its F&B steps could save, with no fill (micro-batches enter at both
    /// ends).
    pub fn lower_bound(&self) -> f64 {
        let busy = self.busy();
        let dual = self.kind == ScheduleKind::DualPipe;
        let mut fill = 0.0;
        let mut best: f64 = 0.0;
        for (s, b) in busy.iter().enumerate() {
            if dual {
                let saved: f64 = (0..self.virtual_stages.min(2))
                    .map(|c| self.overlap(s, 1 - c, c))
                    .sum();
                best = best.max(b - saved * self.runs_per_chunk());
                continue;
            }
            if s > 0 {
                fill += self.chunks[s - 1].fwd.total() + self.p2p(s - 1, s);
            }
            best = best.max(fill + b + self.drain(s));
        }
        best
    }

    /// Bit patterns of every duration: equal keys simulate to equal makespans.
    fn key(&self) -> Vec<u64> {
        let mut k = vec![
            self.kind as u64,
            self.pp as u64,
            self.microbatches as u64,
            self.virtual_stages as u64,
        ];
        for c in &self.chunks {
            k.push(c.fwd.total().to_bits());
            k.push(c.bwd.total().to_bits());
            k.push(c.wgrad.to_bits());
        }
        k.extend(self.p2p_next.iter().map(|x| x.to_bits()));
        k
    }
}

/// What a simulation gives: the makespan and each stage's busy time.
#[derive(Debug, Clone, PartialEq)]
pub struct Simulated {
    pub makespan: f64,
    pub busy: Vec<f64>,
}

/// Simulates pipelines, building each schedule's op lists once and remembering results, so
/// layouts with identical op durations (ZeRO stages, hybrid sharding…) share one simulation.
#[derive(Default)]
pub struct Simulator {
    schedules: Vec<((ScheduleKind, usize, usize, usize), Schedule)>,
    results: HashMap<Vec<u64>, Simulated>,
    /// Simulations actually run (not served from memory).
    pub runs: u64,
}

/// Built schedules kept at once (each can hold a few hundred thousand ops).
const KEEP_SCHEDULES: usize = 4;

/// Micro-batch passes above which a schedule is large (tens of MB of ops): at most one large
/// schedule is kept, so the cache holds no more than one near [`MAX_SIMULATED_PASSES`].
const LARGE_SCHEDULE: usize = 1 << 16;

fn large(id: &(ScheduleKind, usize, usize, usize)) -> bool {
    id.1.saturating_mul(id.2).saturating_mul(id.3) > LARGE_SCHEDULE
}

impl Simulator {
    pub fn new() -> Self {
        Self::default()
    }

    /// The simulated makespan of `p`. A pipeline that cannot be simulated, because its op
    /// lists would exceed [`MAX_SIMULATED_PASSES`] micro-batch passes or its schedule cannot be
    /// built (no micro-batch), gets its lower bound as the makespan instead: `Layout::check`
    /// rejects such layouts, so only a caller costing an unchecked layout sees that.
    pub fn run(&mut self, p: &Pipeline) -> Simulated {
        let key = p.key();
        if let Some(r) = self.results.get(&key) {
            return r.clone();
        }
        let passes = p.microbatches as u128 * p.pp as u128 * p.virtual_stages as u128;
        let unbounded = || Simulated {
            makespan: p.lower_bound(),
            busy: p.busy(),
        };
        if passes > u128::from(MAX_SIMULATED_PASSES) {
            return unbounded();
        }
        // A NaN duration (from an infinite size) would read as "not sent yet" in the
        // simulator's arrival table: it is infinitely long instead.
        let finite = |x: f64| if x.is_nan() { f64::INFINITY } else { x };
        if let Some(out) = one_stage(
            p,
            finite(p.chunks[0].fwd.total()),
            finite(p.chunks[0].bwd.total()),
        ) {
            self.runs += 1;
            self.results.insert(key, out.clone());
            return out;
        }
        let id = (p.kind, p.pp, p.microbatches, p.virtual_stages);
        let at = match self.schedules.iter().position(|(k, _)| *k == id) {
            Some(i) => i,
            None => {
                let Ok(s) = schedule::build(p.kind, p.pp, p.microbatches, p.virtual_stages) else {
                    return unbounded();
                };
                if large(&id) {
                    self.schedules.retain(|(k, _)| !large(k));
                }
                if self.schedules.len() >= KEEP_SCHEDULES {
                    self.schedules.remove(0);
                }
                self.schedules.push((id, s));
                self.schedules.len() - 1
            }
        };
        let fwd = |s: usize, c: usize| finite(p.chunk(s, c).fwd.total());
        let bwd = |s: usize, c: usize| finite(p.chunk(s, c).bwd.total());
        let bwd_in = |s: usize, c: usize| finite(p.backward_input(s, c));
        let bwd_w = |s: usize, c: usize| finite(p.backward_weight(s, c));
        let overlap = |s: usize, f: usize, b: usize| finite(p.overlap(s, f, b));
        let p2p = |a: usize, b: usize| finite(p.p2p(a, b));
        let costs = SimCosts {
            forward: &fwd,
            backward: &bwd,
            backward_input: &bwd_in,
            backward_weight: &bwd_w,
            overlap: &overlap,
            p2p: &p2p,
        };
        let r = schedule::simulate_summary(&self.schedules[at].1, &costs)
            .expect("schedules built by `schedule::build` do not deadlock");
        self.runs += 1;
        let out = Simulated {
            makespan: r.makespan,
            busy: r.busy,
        };
        self.results.insert(key, out.clone());
        out
    }
}

/// The simulation of a one-stage pipeline without building its op list: no messages, so the
/// stage's clock is its ops' durations added in the schedule's order (all forwards, then all
/// backwards for GPipe; forward, backward per micro-batch for 1F1B), the same additions the
/// simulator makes. `None` for other pipelines.
fn one_stage(p: &Pipeline, fwd: f64, bwd: f64) -> Option<Simulated> {
    if p.pp != 1 || p.virtual_stages != 1 || p.microbatches == 0 {
        return None;
    }
    let mut clock = 0.0f64;
    match p.kind {
        ScheduleKind::Gpipe => {
            for _ in 0..p.microbatches {
                clock += fwd;
            }
            for _ in 0..p.microbatches {
                clock += bwd;
            }
        }
        ScheduleKind::OneFOneB => {
            for _ in 0..p.microbatches {
                clock += fwd;
                clock += bwd;
            }
        }
        _ => return None,
    }
    Some(Simulated {
        makespan: clock.max(0.0),
        busy: vec![clock],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-stage shortcut gives the simulator's numbers, to the bit.
    #[test]
    fn cost_one_stage_pipelines_equal_their_simulation() {
        for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
            for m in [1, 2, 7, 100, 1000] {
                let p = uniform(kind, 1, m, 1, 0.1 + 1e-9, 0.3 - 1e-7);
                let fast = one_stage(&p, p.chunks[0].fwd.total(), p.chunks[0].bwd.total())
                    .expect("one stage");
                let s = schedule::build(kind, 1, m, 1).unwrap();
                let f = |_: usize, _: usize| p.chunks[0].fwd.total();
                let b = |_: usize, _: usize| p.chunks[0].bwd.total();
                let costs = SimCosts {
                    forward: &f,
                    backward: &b,
                    backward_input: &|_, _| f64::NAN,
                    backward_weight: &|_, _| f64::NAN,
                    overlap: &|_, _, _| 0.0,
                    p2p: &|_, _| 0.0,
                };
                let slow = schedule::simulate_summary(&s, &costs).unwrap();
                assert_eq!(
                    fast.makespan.to_bits(),
                    slow.makespan.to_bits(),
                    "{kind} {m}"
                );
                assert_eq!(fast.busy, slow.busy, "{kind} {m}");
            }
        }
    }

    fn uniform(kind: ScheduleKind, pp: usize, m: usize, v: usize, f: f64, b: f64) -> Pipeline {
        let part = |x: f64| Parts {
            compute: x,
            ..Parts::default()
        };
        Pipeline {
            kind,
            pp,
            microbatches: m,
            virtual_stages: v,
            chunks: vec![
                ChunkTime {
                    fwd: part(f),
                    bwd: part(b),
                    wgrad: 0.0,
                };
                schedule::pieces(kind, pp, v)
            ],
            p2p_next: vec![0.0; pp],
        }
    }

    /// Equal stages, free p2p: the bound is the textbook makespan, busy · (1 + bubble), and the
    /// simulation of the real op lists lands on it.
    #[test]
    fn cost_lower_bound_equals_simulation_for_equal_stages() {
        let mut sim = Simulator::new();
        for (kind, pp, m, v) in [
            (ScheduleKind::Gpipe, 4, 8, 1),
            (ScheduleKind::OneFOneB, 8, 32, 1),
            (ScheduleKind::OneFOneB, 1, 5, 1),
            (ScheduleKind::Interleaved, 4, 16, 2),
            (ScheduleKind::Interleaved, 8, 24, 3),
        ] {
            let p = uniform(kind, pp, m, v, 1.0 / v as f64, 2.0 / v as f64);
            let busy = 3.0 * m as f64;
            let textbook = busy * (1.0 + schedule::bubble_formula(kind, pp, m, v));
            let lb = p.lower_bound();
            let got = sim.run(&p).makespan;
            assert!(
                (lb - textbook).abs() < 1e-9,
                "{kind} {pp} {m} {v}: {lb} vs {textbook}"
            );
            assert!(
                (got - textbook).abs() <= 0.01 * textbook,
                "{kind}: sim {got} vs {textbook}"
            );
        }
    }

    /// Uneven stages and p2p costs: the bound never exceeds the simulated makespan.
    #[test]
    fn cost_lower_bound_never_exceeds_simulation() {
        let mut seed = 5u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut sim = Simulator::new();
        for case in 0..240 {
            let kind = ScheduleKind::ALL[case % 6];
            let dual = kind == ScheduleKind::DualPipe;
            let pp = if dual {
                2 + 2 * (case % 3)
            } else {
                1 + case % 6
            };
            let v = match kind.fixed_virtual_stages() {
                Some(v) => v,
                None => 2 + case % 3,
            };
            let m = if dual { 2 * pp } else { pp } * (1 + case % 4);
            let mut p = uniform(kind, pp, m, v, 1.0, 2.0);
            for c in p.chunks.iter_mut() {
                c.fwd.compute = 0.1 + rnd();
                c.bwd.tp = 0.1 + 2.0 * rnd();
                // W, and all-to-alls DualPipe's F&B steps hide.
                c.wgrad = c.bwd.compute * rnd();
                c.fwd.ep = 0.3 * rnd();
                c.bwd.ep = 0.3 * rnd();
            }
            for x in p.p2p_next.iter_mut() {
                *x = 0.2 * rnd();
            }
            let lb = p.lower_bound();
            let got = sim.run(&p).makespan;
            assert!(
                lb <= got * (1.0 + 1e-12),
                "case {case}: bound {lb} > simulated {got}"
            );
        }
    }

    #[test]
    fn cost_simulator_remembers_equal_pipelines() {
        let mut sim = Simulator::new();
        let p = uniform(ScheduleKind::OneFOneB, 4, 8, 1, 1.0, 2.0);
        let a = sim.run(&p);
        let b = sim.run(&p.clone());
        assert_eq!(a, b);
        assert_eq!(sim.runs, 1);
        let mut q = p.clone();
        q.chunks[3].bwd.compute = 5.0;
        assert!(sim.run(&q).makespan > a.makespan);
        assert_eq!(sim.runs, 2);
    }
}
