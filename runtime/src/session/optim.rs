//! The run's optimisation settings: `--lr --min-lr --warmup-steps --decay --decay-steps
//! --wsd-decay-fraction --weight-decay --beta1 --beta2 --eps --clip-grad`, resolved. Each
//! overrides the plan's value (`job.model.optimizer` and `job.model.schedule`, from the model
//! spec's `[optimizer]` and `[schedule]` tables) for this run; the plan itself is not changed.
//! The rules are the spec's (`tessera_planner::optimizer::check`), blamed on the flag.

use tessera_planner::optimizer::{DecayShape, Optimizer, Schedule};
use tessera_planner::plan::Plan;

use crate::checkpoint::Checkpoint;
use crate::exec::TrainOptions;

use super::{refused, SessionError};

/// Values that override the plan's optimizer and schedule for one run; `None` keeps the plan's
/// (`tessera run`'s optimisation flags, with the `cli` feature).
#[derive(Debug, Clone, Default)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct OptimOverrides {
    /// Peak learning rate, after the warm-up [default: the plan's optimizer.lr, 3e-3 unless the
    /// model spec sets it]. Without --min-lr, the minimum keeps the plan's ratio to the peak (a
    /// tenth by default).
    #[cfg_attr(feature = "cli", arg(long, value_parser = positive))]
    pub lr: Option<f64>,
    /// The learning rate the decay ends at (at most the peak) [default: the plan's]
    #[cfg_attr(feature = "cli", arg(long, value_parser = non_negative))]
    pub min_lr: Option<f64>,
    /// Steps of linear warm-up from 0 to the peak (0: none) [default: the plan's]
    #[cfg_attr(feature = "cli", arg(long, value_parser = clap::value_parser!(u64).range(0..=1_000_000_000)))]
    pub warmup_steps: Option<u64>,
    /// The decay after the warm-up [default: the plan's schedule.decay, cosine by default]
    #[cfg_attr(feature = "cli", arg(long, value_parser = decay_shape()))]
    pub decay: Option<DecayShape>,
    /// The step at which the decay reaches --min-lr, counted from step 0 [default: the plan's
    /// schedule.decay_steps, else --steps]
    #[cfg_attr(feature = "cli", arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000)))]
    pub decay_steps: Option<u64>,
    /// With --decay wsd: the final fraction of the steps over which the rate decays, in (0, 1]
    /// [default: the plan's, 0.2]
    #[cfg_attr(feature = "cli", arg(long, value_parser = non_negative))]
    pub wsd_decay_fraction: Option<f64>,
    /// AdamW's decoupled weight decay (0 or more) [default: the plan's, 0.1]
    #[cfg_attr(feature = "cli", arg(long, value_parser = non_negative))]
    pub weight_decay: Option<f64>,
    /// Adam's β1, in [0, 1) [default: the plan's, 0.9]
    #[cfg_attr(feature = "cli", arg(long, value_parser = non_negative))]
    pub beta1: Option<f64>,
    /// Adam's β2, in [0, 1) [default: the plan's, 0.95]
    #[cfg_attr(feature = "cli", arg(long, value_parser = non_negative))]
    pub beta2: Option<f64>,
    /// Adam's ε (above 0) [default: the plan's, 1e-8]
    #[cfg_attr(feature = "cli", arg(long, value_parser = positive))]
    pub eps: Option<f64>,
    /// Clip the global gradient norm to this (0: no clipping) [default: the plan's, 1.0]
    #[cfg_attr(feature = "cli", arg(long, value_parser = non_negative))]
    pub clip_grad: Option<f64>,
}

/// `--decay`'s values, by their names in the spec.
#[cfg(feature = "cli")]
fn decay_shape() -> impl clap::builder::TypedValueParser<Value = DecayShape> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(DecayShape::ALL.map(DecayShape::name)).map(|s| {
        DecayShape::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .unwrap_or_default()
    })
}

#[cfg(feature = "cli")]
fn number(text: &str) -> Result<f64, String> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|e| format!("not a number ({e}); pass one such as 3e-4"))?;
    if !v.is_finite() {
        return Err(format!("must be a finite number, found {v}"));
    }
    Ok(v)
}

/// A finite number above zero (`--lr`, `--eps`).
#[cfg(feature = "cli")]
fn positive(text: &str) -> Result<f64, String> {
    let v = number(text)?;
    if v <= 0.0 {
        return Err(format!(
            "must be a finite number above 0, found {v}; pass one such as 3e-4"
        ));
    }
    Ok(v)
}

/// A finite number of zero or more.
#[cfg(feature = "cli")]
fn non_negative(text: &str) -> Result<f64, String> {
    let v = number(text)?;
    if v < 0.0 {
        return Err(format!("must be zero or more, found {v}"));
    }
    Ok(v)
}

/// The flag that sets a field of the settings.
fn flag_of(field: &str) -> &'static str {
    match field {
        "optimizer.lr" => "--lr",
        "optimizer.min_lr" => "--min-lr",
        "optimizer.beta1" => "--beta1",
        "optimizer.beta2" => "--beta2",
        "optimizer.eps" => "--eps",
        "optimizer.weight_decay" => "--weight-decay",
        "optimizer.clip_grad" => "--clip-grad",
        "schedule.warmup_steps" => "--warmup-steps",
        "schedule.decay_steps" => "--decay-steps",
        "schedule.wsd_decay_fraction" => "--wsd-decay-fraction",
        _ => "--decay",
    }
}

impl OptimOverrides {
    /// The plan's settings with these overrides applied, checked by the spec's rules; a value
    /// out of range is blamed on its flag (or on the plan, where no flag set it).
    pub fn settings(&self, plan: &Plan) -> Result<(Optimizer, Schedule), SessionError> {
        let (mut o, mut s) = (
            plan.job.model.optimizer.clone(),
            plan.job.model.schedule.clone(),
        );
        if let Some(lr) = self.lr {
            // The minimum keeps its ratio to the peak unless --min-lr says otherwise: the
            // default plan's tenth, as `--lr` always had.
            o.min_lr = o.min_lr / o.lr * lr;
            o.lr = lr;
        }
        let set = |dst: &mut f64, v: Option<f64>| {
            if let Some(v) = v {
                *dst = v;
            }
        };
        set(&mut o.min_lr, self.min_lr);
        set(&mut o.weight_decay, self.weight_decay);
        set(&mut o.beta1, self.beta1);
        set(&mut o.beta2, self.beta2);
        set(&mut o.eps, self.eps);
        set(&mut o.clip_grad, self.clip_grad);
        set(&mut s.wsd_decay_fraction, self.wsd_decay_fraction);
        if let Some(w) = self.warmup_steps {
            s.warmup_steps = w;
        }
        if let Some(d) = self.decay {
            s.decay = d;
        }
        if self.decay_steps.is_some() {
            s.decay_steps = self.decay_steps;
        } else if s.decay_steps.is_none() {
            // A plan with a token budget decays over the budget's steps, whatever --steps
            // runs now: the first steps of a long run (or a run resumed piece by piece) follow
            // the whole run's schedule.
            s.decay_steps = plan.predicted.whole_run.as_ref().map(|w| w.steps);
        }
        if let Err(p) = tessera_planner::optimizer::check(&o, &s) {
            let flag = flag_of(&p.field);
            let given = match flag {
                "--lr" => self.lr.is_some(),
                "--min-lr" => self.min_lr.is_some() || self.lr.is_some(),
                "--beta1" => self.beta1.is_some(),
                "--beta2" => self.beta2.is_some(),
                "--eps" => self.eps.is_some(),
                "--weight-decay" => self.weight_decay.is_some(),
                "--clip-grad" => self.clip_grad.is_some(),
                "--warmup-steps" => self.warmup_steps.is_some(),
                "--decay-steps" => self.decay_steps.is_some() || self.warmup_steps.is_some(),
                "--wsd-decay-fraction" => self.wsd_decay_fraction.is_some(),
                _ => self.decay.is_some(),
            };
            if given {
                return Err(refused(format!("{flag}: {}", p.problem), p.fix));
            }
            return Err(refused(
                format!("job.model.{}: {}", p.field, p.problem),
                p.fix,
            ));
        }
        if s.decay != DecayShape::Wsd && self.wsd_decay_fraction.is_some() {
            return Err(refused(
                format!("--wsd-decay-fraction: only the wsd decay reads it, and this run decays by {}; it would be ignored", s.decay.name()),
                "drop --wsd-decay-fraction, or add --decay wsd",
            ));
        }
        Ok((o, s))
    }
}

/// The optimisation settings a resumed run changes against those its checkpoint was saved
/// with, as `name was -> now`: a resumed run continues under its own settings, as it always
/// has, and says so once, so that it is not a surprise.
pub fn resume_changes(ck: &Checkpoint, opts: &TrainOptions, plan: &Plan) -> Vec<String> {
    let i = ck.index();
    let (lr, adam, clip) = (opts.lr_schedule(plan), opts.adamw(plan), opts.clip(plan));
    let mut changed = Vec::new();
    let mut differs = |name: &str, was: String, now: String| {
        if was != now {
            changed.push(format!("{name} {was} -> {now}"));
        }
    };
    differs("lr", i.lr.max_lr.to_string(), lr.max_lr.to_string());
    differs("min_lr", i.lr.min_lr.to_string(), lr.min_lr.to_string());
    differs(
        "warmup_steps",
        i.lr.warmup_steps.to_string(),
        lr.warmup_steps.to_string(),
    );
    differs(
        "decay end (step)",
        i.lr.total_steps.to_string(),
        lr.total_steps.to_string(),
    );
    differs("decay", i.lr.decay.clone(), lr.decay_name().into());
    differs(
        "beta1",
        i.optimizer.beta1.to_string(),
        adam.beta1.to_string(),
    );
    differs(
        "beta2",
        i.optimizer.beta2.to_string(),
        adam.beta2.to_string(),
    );
    differs("eps", i.optimizer.eps.to_string(), adam.eps.to_string());
    differs(
        "weight_decay",
        i.optimizer.weight_decay.to_string(),
        adam.weight_decay.to_string(),
    );
    differs(
        "decay_on",
        i.optimizer.decay_on.clone(),
        adam.decay_on.name().into(),
    );
    differs("clip_grad", i.optimizer.clip.to_string(), clip.to_string());
    changed
}
