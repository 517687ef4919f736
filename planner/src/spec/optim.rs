//! A model spec's `[optimizer]` and `[schedule]` tables: raw structs close to the file, resolved
//! into [`Optimizer`] and [`Schedule`]. The ranges (β in [0, 1), `min_lr ≤ lr`, …) are
//! `crate::optimizer::check`'s, which `Model::check` runs on every reader's result; this file
//! checks what needs the key's own span (types, signs, names).

use serde::Deserialize;

use super::fields::{Field, Fields, Num};
use crate::error::Diagnostic;
use crate::optimizer::{DecayOn, DecayShape, Optimizer, OptimizerName, Schedule};

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawOptimizer {
    pub name: Field<String>,
    pub lr: Field<Num>,
    pub min_lr: Field<Num>,
    pub beta1: Field<Num>,
    pub beta2: Field<Num>,
    pub eps: Field<Num>,
    pub weight_decay: Field<Num>,
    pub decay_on: Field<String>,
    pub clip_grad: Field<Num>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawSchedule {
    pub warmup_steps: Field<i64>,
    pub decay: Field<String>,
    pub decay_steps: Field<i64>,
    pub wsd_decay_fraction: Field<Num>,
}

fn num(f: &Fields, table: &str, field: &str, v: &Field<Num>) -> Result<Option<f64>, Diagnostic> {
    // Any finite number here; the ranges are `optimizer::check`'s (with the key's line).
    v.as_ref()
        .map(|s| {
            let x = s.get_ref().as_f64();
            if x.is_finite() {
                Ok(x)
            } else {
                Err(f.err(
                    Some(s.span()),
                    &format!("{table}.{field}"),
                    format!("must be a finite number, found {x}"),
                    format!("set `{field}` to a number"),
                ))
            }
        })
        .transpose()
}

pub(crate) fn resolve_optimizer(f: &Fields, o: &RawOptimizer) -> Result<Optimizer, Diagnostic> {
    const T: &str = "optimizer";
    let d = Optimizer::default();
    let name = f.choice(
        T,
        "name",
        &o.name,
        &[("adamw", OptimizerName::Adamw)],
        Some(OptimizerName::Adamw),
    )?;
    let lr = num(f, T, "lr", &o.lr)?.unwrap_or(d.lr);
    Ok(Optimizer {
        name,
        lr,
        min_lr: num(f, T, "min_lr", &o.min_lr)?.unwrap_or(crate::optimizer::default_min_lr(lr)),
        beta1: num(f, T, "beta1", &o.beta1)?.unwrap_or(d.beta1),
        beta2: num(f, T, "beta2", &o.beta2)?.unwrap_or(d.beta2),
        eps: num(f, T, "eps", &o.eps)?.unwrap_or(d.eps),
        weight_decay: num(f, T, "weight_decay", &o.weight_decay)?.unwrap_or(d.weight_decay),
        decay_on: f.choice(
            T,
            "decay_on",
            &o.decay_on,
            &[
                ("matrices", DecayOn::Matrices),
                ("all", DecayOn::All),
                ("none", DecayOn::None),
            ],
            Some(d.decay_on),
        )?,
        clip_grad: num(f, T, "clip_grad", &o.clip_grad)?.unwrap_or(d.clip_grad),
    })
}

pub(crate) fn resolve_schedule(f: &Fields, s: &RawSchedule) -> Result<Schedule, Diagnostic> {
    const T: &str = "schedule";
    let d = Schedule::default();
    let warmup_steps = match &s.warmup_steps {
        None => d.warmup_steps,
        Some(v) if *v.get_ref() < 0 => {
            return Err(f.err(
                Some(v.span()),
                "schedule.warmup_steps",
                format!("must be zero or more steps, found {}", v.get_ref()),
                "set `warmup_steps` to 0 (no warm-up) or more",
            ))
        }
        Some(v) => *v.get_ref() as u64,
    };
    let decay = f.choice(
        T,
        "decay",
        &s.decay,
        &DecayShape::ALL.map(|d| (d.name(), d)),
        Some(d.decay),
    )?;
    Ok(Schedule {
        warmup_steps,
        decay,
        decay_steps: f.opt_pos_int(T, "decay_steps", &s.decay_steps)?,
        wsd_decay_fraction: num(f, T, "wsd_decay_fraction", &s.wsd_decay_fraction)?
            .unwrap_or(d.wsd_decay_fraction),
    })
}
