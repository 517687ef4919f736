//! AdamW with decoupled weight decay (Loshchilov & Hutter 2019), global-norm gradient clipping,
//! and a learning-rate schedule: warm-up, then cosine, linear, constant or WSD decay.
//!
//! The optimizer works on a contiguous range of the flat parameter buffer (the whole buffer, or
//! this rank's ZeRO shard `[offset, offset + len)`). The update is element-wise given two
//! scalars (learning rate, clip factor), so the update of a shard equals the same elements of
//! the full update bit for bit: that is what makes ZeRO parity hold. The clip factor comes from
//! the norm of the FULL model's gradient: [`grad_norm`] sums this rank's share (tensors
//! replicated over TP counted on TP rank 0 only) and a caller-supplied reduction adds the other
//! ranks' shares (over TP and PP, and over DP when gradients are sharded).
//!
//! This module must not communicate by itself or know about layers.

use std::ops::Range;

use crate::backend::cpu::kernels::adamw_update;
use crate::backend::AdamWStep;
use crate::comm::CommError;
use crate::params::ParamLayout;
use tessera_planner::optimizer::{DecayOn, DecayShape, Optimizer, Schedule};

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Applied to the tensors `decay_on` names.
    pub weight_decay: f32,
    /// Which tensors weight decay applies to: `Matrices` follows each registered tensor's
    /// `decay` flag (matrices and embeddings; not biases or norm gains, `params.rs`), `All` and
    /// `None` override it.
    pub decay_on: DecayOn,
}

impl Default for AdamWConfig {
    /// GPT-3 / nanoGPT defaults: β = (0.9, 0.95), ε = 1e-8, weight decay 0.1 on matrices.
    fn default() -> Self {
        Self::of(&Optimizer::default())
    }
}

impl AdamWConfig {
    /// The AdamW settings of a plan's (or a run's) `optimizer`.
    pub fn of(o: &Optimizer) -> Self {
        Self {
            beta1: o.beta1 as f32,
            beta2: o.beta2 as f32,
            eps: o.eps as f32,
            weight_decay: o.weight_decay as f32,
            decay_on: o.decay_on,
        }
    }

    /// Whether a tensor registered with `decay` gets weight decay.
    pub fn decays(&self, decay: bool) -> bool {
        match self.decay_on {
            DecayOn::Matrices => decay,
            DecayOn::All => true,
            DecayOn::None => false,
        }
    }
}

/// The learning rate after the warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decay {
    /// Half a cosine from `max_lr` to `min_lr` at `total_steps`.
    Cosine,
    /// A straight line from `max_lr` to `min_lr` at `total_steps`.
    Linear,
    /// `max_lr` to the end.
    Constant,
    /// Warm-up, stable, decay: `max_lr` until `decay_steps` before `total_steps`, then a
    /// straight line to `min_lr` at `total_steps`.
    Wsd { decay_steps: usize },
}

/// Linear warm-up from 0 to `max_lr` over `warmup_steps`, then the `decay` to `min_lr` at
/// `total_steps`; `min_lr` afterwards (`max_lr` for `Constant`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub max_lr: f32,
    pub min_lr: f32,
    pub warmup_steps: usize,
    /// The step at which the decay ends (the run's steps, or `schedule.decay_steps`).
    pub total_steps: usize,
    pub decay: Decay,
}

impl LrSchedule {
    /// The schedule of `optimizer` and `schedule` for a run of `steps` steps.
    pub fn of(o: &Optimizer, s: &Schedule, steps: usize) -> Self {
        let total = s
            .decay_steps
            .map_or(steps, |d| usize::try_from(d).unwrap_or(usize::MAX));
        let decay = match s.decay {
            DecayShape::Cosine => Decay::Cosine,
            DecayShape::Linear => Decay::Linear,
            DecayShape::Constant => Decay::Constant,
            DecayShape::Wsd => Decay::Wsd {
                decay_steps: usize::try_from(s.wsd_decay_steps(total as u64)).unwrap_or(usize::MAX),
            },
        };
        Self {
            max_lr: o.lr as f32,
            min_lr: o.min_lr as f32,
            warmup_steps: usize::try_from(s.warmup_steps).unwrap_or(usize::MAX),
            total_steps: total,
            decay,
        }
    }

    /// Learning rate of (0-based) `step`.
    pub fn lr(&self, step: usize) -> f32 {
        let (max, min) = (f64::from(self.max_lr), f64::from(self.min_lr));
        if step < self.warmup_steps {
            return (max * (step + 1) as f64 / self.warmup_steps as f64) as f32;
        }
        // Progress through the decay, 0 at its start and 1 at `total_steps` and after.
        let progress = |start: usize| {
            let span = self.total_steps.saturating_sub(start).max(1);
            (step.saturating_sub(start) as f64 / span as f64).min(1.0)
        };
        let lr = match self.decay {
            Decay::Constant => max,
            Decay::Cosine => {
                let p = progress(self.warmup_steps);
                min + 0.5 * (1.0 + (std::f64::consts::PI * p).cos()) * (max - min)
            }
            Decay::Linear => min + (1.0 - progress(self.warmup_steps)) * (max - min),
            Decay::Wsd { decay_steps } => {
                let start = self
                    .total_steps
                    .saturating_sub(decay_steps)
                    .max(self.warmup_steps);
                min + (1.0 - progress(start)) * (max - min)
            }
        };
        lr as f32
    }

    /// The decay's name, as a plan's `schedule.decay` says it.
    pub fn decay_name(&self) -> &'static str {
        match self.decay {
            Decay::Cosine => "cosine",
            Decay::Linear => "linear",
            Decay::Constant => "constant",
            Decay::Wsd { .. } => "wsd",
        }
    }
}

/// AdamW state for one range of the flat buffer; the moments `m`, `v` are `S` (host vectors,
/// or a backend's buffers in the executor).
#[derive(Debug, Clone)]
pub struct AdamW<S = Vec<f32>> {
    pub cfg: AdamWConfig,
    /// The flat-buffer range this state covers.
    pub range: Range<usize>,
    /// First and second moments, `(range.len())`.
    pub m: S,
    pub v: S,
    /// Updates done so far.
    pub t: u64,
    /// `(sub-range relative to range.start, decay)`: tensor boundaries inside the range.
    segments: Vec<(Range<usize>, bool)>,
}

impl AdamW {
    /// State for the elements `range` of the flat buffer described by `layout`.
    pub fn new(cfg: AdamWConfig, layout: &ParamLayout, range: Range<usize>) -> Self {
        let n = range.len();
        Self::with_state(cfg, layout, range, vec![0.0; n], vec![0.0; n])
    }

    /// One update of `params` and `grads` (both `range.len()`: the range's elements), with the
    /// gradient multiplied by `grad_scale` (the clip factor; 1.0 for none).
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32, grad_scale: f32) {
        let n = self.range.len();
        assert!(
            params.len() == n && grads.len() == n,
            "optimizer buffers are not the range's length"
        );
        for (r, s) in self.begin_step(lr, grad_scale) {
            self.update(r.clone(), &mut params[r.clone()], &grads[r], &s);
        }
    }

    /// The update of one piece `r` that [`AdamW::begin_step`] returned, `params` and `grads`
    /// being its elements: what [`AdamW::step`] does to each piece, for a caller that holds the
    /// weights and gradients piece by piece (the executor's optimizer offload streams them one
    /// tensor at a time).
    pub fn update(&mut self, r: Range<usize>, params: &mut [f32], grads: &[f32], s: &AdamWStep) {
        adamw_update(params, grads, &mut self.m[r.clone()], &mut self.v[r], s);
    }
}

impl<S> AdamW<S> {
    /// State for `range` with zeroed moments `m`, `v` of `range.len()` elements.
    pub fn with_state(
        cfg: AdamWConfig,
        layout: &ParamLayout,
        range: Range<usize>,
        m: S,
        v: S,
    ) -> Self {
        assert!(
            range.end <= layout.len(),
            "optimizer range past the parameter buffer"
        );
        let s = range.start;
        let segments = layout
            .segments(range.clone())
            .map(|(r, e)| (r.start - s..r.end - s, cfg.decays(e.decay)))
            .collect();
        Self {
            cfg,
            range,
            m,
            v,
            t: 0,
            segments,
        }
    }

    /// Counts one more update and returns its pieces: each tensor segment of the range
    /// (relative to `range.start`) with the update to apply there.
    pub fn begin_step(&mut self, lr: f32, grad_scale: f32) -> Vec<(Range<usize>, AdamWStep)> {
        self.t += 1;
        let c = self.cfg;
        self.segments
            .iter()
            .map(|(r, decay)| {
                let step = AdamWStep {
                    lr,
                    beta1: c.beta1,
                    beta2: c.beta2,
                    eps: c.eps,
                    weight_decay: if *decay { c.weight_decay } else { 0.0 },
                    t: self.t,
                    grad_scale,
                };
                (r.clone(), step)
            })
            .collect()
    }
}

/// Σ g² (f64) over the elements `range` of the flat `grads` (full buffer) that this rank
/// contributes to the global norm: tensors replicated over TP count only where `tp_rank == 0`.
pub fn local_grad_sq(
    layout: &ParamLayout,
    grads: &[f32],
    range: Range<usize>,
    tp_rank: usize,
) -> f64 {
    layout
        .segments(range)
        .filter(|(_, e)| e.tp_sharded || tp_rank == 0)
        .map(|(r, _)| {
            grads[r]
                .iter()
                .map(|&g| f64::from(g) * f64::from(g))
                .sum::<f64>()
        })
        .sum()
}

/// The global gradient norm: `sqrt(sum_ranks(local_grad_sq))`, where `sum_ranks` adds the
/// value over every group holding other parts of the model (e.g. `comm::all_reduce_f64` over
/// TP, then PP, then DP under ZeRO); `&|x| Ok(x)` on a single rank.
pub fn grad_norm(
    layout: &ParamLayout,
    grads: &[f32],
    range: Range<usize>,
    tp_rank: usize,
    sum_ranks: &dyn Fn(f64) -> Result<f64, CommError>,
) -> Result<f64, CommError> {
    Ok(sum_ranks(local_grad_sq(layout, grads, range, tp_rank))?.sqrt())
}

/// Gradient multiplier for clipping to `max_norm` (1.0 when the norm is within it).
pub fn clip_scale(norm: f64, max_norm: f64) -> f32 {
    if max_norm > 0.0 && norm > max_norm {
        (max_norm / (norm + 1e-6)) as f32
    } else {
        1.0
    }
}

#[cfg(test)]
#[path = "optim_tests.rs"]
mod tests;
