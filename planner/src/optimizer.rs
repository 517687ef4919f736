//! The optimisation settings of a run: the optimizer (`[optimizer]` in a model spec) and the
//! learning-rate schedule (`[schedule]`), resolved. plan.json carries them in
//! `job.model.optimizer` and `job.model.schedule`, so that a plan states the whole run;
//! `tessera run` trains with them (its flags override them for one run) and `tessera export`
//! passes them to the engines that express them.
//!
//! Every key is optional; the defaults are what the runtime did before the keys existed
//! (nanoGPT's and GPT-3's AdamW settings): peak learning rate 3e-3, minimum a tenth of it,
//! 5 warm-up steps, cosine decay over the run, weight decay 0.1 on matrices and embeddings,
//! β = (0.9, 0.95), ε = 1e-8, gradient clipping at a global norm of 1.0. Plans written before
//! the keys existed read with these defaults.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::spec::Problem;

/// The optimizer's algorithm. AdamW only, for now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerName {
    /// Adam with decoupled weight decay (Loshchilov & Hutter 2019).
    #[default]
    Adamw,
}

/// Which tensors weight decay applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DecayOn {
    /// Weight matrices and embedding tables; not biases or norm gains (GPT-3, nanoGPT,
    /// Megatron-LM).
    #[default]
    Matrices,
    /// Every parameter (PyTorch's AdamW over `model.parameters()`, torchtitan).
    All,
    /// No parameter (the same as `weight_decay = 0`).
    None,
}

impl DecayOn {
    pub fn name(self) -> &'static str {
        match self {
            DecayOn::Matrices => "matrices",
            DecayOn::All => "all",
            DecayOn::None => "none",
        }
    }
}

/// The shape of the learning rate after the warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DecayShape {
    /// Half a cosine from the peak to `min_lr` at `decay_steps`.
    #[default]
    Cosine,
    /// A straight line from the peak to `min_lr` at `decay_steps`.
    Linear,
    /// The peak until the end (`min_lr` is not used).
    Constant,
    /// Warm-up, stable, decay: the peak until the last `wsd_decay_fraction` of `decay_steps`,
    /// then a straight line to `min_lr` (Hu et al. 2024, MiniCPM).
    Wsd,
}

impl DecayShape {
    pub fn name(self) -> &'static str {
        match self {
            DecayShape::Cosine => "cosine",
            DecayShape::Linear => "linear",
            DecayShape::Constant => "constant",
            DecayShape::Wsd => "wsd",
        }
    }

    pub const ALL: [DecayShape; 4] = [
        DecayShape::Cosine,
        DecayShape::Linear,
        DecayShape::Constant,
        DecayShape::Wsd,
    ];
}

/// The optimizer and its hyper-parameters (spec table `[optimizer]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Optimizer {
    pub name: OptimizerName,
    /// Peak learning rate (after the warm-up).
    pub lr: f64,
    /// The learning rate the decay ends at (default `lr / 10`).
    pub min_lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Decoupled weight decay, on the tensors `decay_on` names.
    pub weight_decay: f64,
    pub decay_on: DecayOn,
    /// Global gradient-norm clipping threshold; 0 for no clipping.
    pub clip_grad: f64,
}

/// The default peak learning rate.
pub const DEFAULT_LR: f64 = 3e-3;

/// `x` rounded to 12 significant digits, for a ratio of settings written where people read it:
/// 3e-3 / 10 is 0.00030000000000000003 in binary, and 3e-4 / 3e-3 is 0.09999999999999999 (the
/// f32 the runtime uses is the same either way).
pub fn round_sig12(x: f64) -> f64 {
    format!("{x:.11e}").parse().unwrap_or(x)
}

/// The default minimum learning rate of a peak `lr`: a tenth of it (nanoGPT, GPT-3).
pub fn default_min_lr(lr: f64) -> f64 {
    round_sig12(lr / 10.0)
}

impl Default for Optimizer {
    fn default() -> Self {
        Optimizer {
            name: OptimizerName::Adamw,
            lr: DEFAULT_LR,
            min_lr: default_min_lr(DEFAULT_LR),
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            decay_on: DecayOn::Matrices,
            clip_grad: 1.0,
        }
    }
}

/// The learning-rate schedule (spec table `[schedule]`): a linear warm-up from 0 to `lr`, then
/// the decay shape down to `min_lr` at step `decay_steps`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// Steps of linear warm-up (0: none).
    pub warmup_steps: u64,
    pub decay: DecayShape,
    /// The step at which the decay reaches `min_lr`, counted from step 0 with the warm-up
    /// (Megatron-LM's `--lr-decay-iters`); `null`: the run's `--steps`.
    pub decay_steps: Option<u64>,
    /// With `decay = "wsd"`: the final fraction of `decay_steps` over which the rate decays.
    pub wsd_decay_fraction: f64,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule {
            warmup_steps: 5,
            decay: DecayShape::Cosine,
            decay_steps: None,
            wsd_decay_fraction: 0.2,
        }
    }
}

impl Schedule {
    /// The steps of WSD's final decay when the decay ends at step `decay_steps`: the fraction
    /// of it, rounded, at least 1.
    pub fn wsd_decay_steps(&self, decay_steps: u64) -> u64 {
        ((self.wsd_decay_fraction * decay_steps as f64).round() as u64).clamp(1, decay_steps.max(1))
    }
}

/// The largest step count: what TOML can write.
const MAX_STEPS: u64 = i64::MAX as u64;

fn problem(field: &str, problem: String, fix: impl Into<String>) -> Problem {
    Problem {
        field: field.to_string(),
        problem,
        fix: fix.into(),
    }
}

/// The rules of the optimisation settings, wherever they come from (a spec, a plan, the flags
/// of `tessera run`); fields are named as in a model spec (`optimizer.beta1`).
pub fn check(o: &Optimizer, s: &Schedule) -> Result<(), Problem> {
    if !(o.lr.is_finite() && o.lr > 0.0) {
        return Err(problem(
            "optimizer.lr",
            format!(
                "the learning rate must be a finite number above 0, found {}",
                o.lr
            ),
            "set lr to the peak learning rate, such as 3e-4",
        ));
    }
    if !(o.min_lr.is_finite() && o.min_lr >= 0.0 && o.min_lr <= o.lr) {
        return Err(problem(
            "optimizer.min_lr",
            format!(
                "the minimum learning rate must be between 0 and lr ({}), found {}",
                o.lr, o.min_lr
            ),
            format!(
                "set min_lr to at most lr (or remove it: it defaults to lr / 10 = {})",
                default_min_lr(o.lr)
            ),
        ));
    }
    for (field, v, usual) in [
        ("optimizer.beta1", o.beta1, "0.9"),
        ("optimizer.beta2", o.beta2, "0.95"),
    ] {
        if !(0.0..1.0).contains(&v) {
            return Err(problem(
                field,
                format!("an Adam β must be at least 0 and below 1, found {v}"),
                format!("set it in [0, 1), such as {usual}"),
            ));
        }
    }
    if !(o.eps.is_finite() && o.eps > 0.0) {
        return Err(problem(
            "optimizer.eps",
            format!("ε must be a finite number above 0, found {}", o.eps),
            "set eps to a small positive number, such as 1e-8",
        ));
    }
    for (field, v, usual) in [
        ("optimizer.weight_decay", o.weight_decay, "0.1"),
        ("optimizer.clip_grad", o.clip_grad, "1.0 (0: no clipping)"),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(problem(
                field,
                format!("must be a finite number of zero or more, found {v}"),
                format!("set it to zero or more, such as {usual}"),
            ));
        }
    }
    if s.warmup_steps > MAX_STEPS {
        return Err(problem(
            "schedule.warmup_steps",
            format!(
                "{} warm-up steps is more than a step count holds",
                s.warmup_steps
            ),
            "set warmup_steps to a step count (0: no warm-up)",
        ));
    }
    if let Some(d) = s.decay_steps {
        if d == 0 || d > MAX_STEPS || d <= s.warmup_steps {
            return Err(problem(
                "schedule.decay_steps",
                format!(
                    "the decay must end after the warm-up's {} steps, found decay_steps {d}",
                    s.warmup_steps
                ),
                "set decay_steps above warmup_steps (it counts from step 0, warm-up included), or remove it: it defaults to the run's --steps",
            ));
        }
    }
    if !(s.wsd_decay_fraction > 0.0 && s.wsd_decay_fraction <= 1.0) {
        return Err(problem(
            "schedule.wsd_decay_fraction",
            format!(
                "must be a fraction in (0, 1], found {}",
                s.wsd_decay_fraction
            ),
            "set it to the final fraction of the steps that decay, such as 0.2",
        ));
    }
    Ok(())
}
