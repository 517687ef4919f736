//! The fine-tuning keys of a model spec (`training.method`, `training.optimizer_states`, the
//! `[lora]` table) and the command-line flags that override them (`--method`, `--lora-rank`,
//! `--lora-alpha`, `--lora-dropout`, `--lora-targets`, `--optimizer-states`).

use serde::Deserialize;
use toml::Spanned;

use super::fields::{Field, Fields, Num};
use crate::error::Diagnostic;
use crate::finetune::{Lora, Method, OptimizerStates, Target, DEFAULT_RANK};
use crate::model::{Architecture, Family, Model};

/// `[lora]`: PEFT's `LoraConfig` under Tessera's names.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLora {
    pub rank: Field<i64>,
    pub alpha: Field<Num>,
    pub dropout: Field<Num>,
    pub targets: Field<Vec<Spanned<String>>>,
}

/// PEFT's targets when `target_modules` is not given, for the families Tessera names
/// (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING` in peft/utils/constants.py: llama,
/// mistral and qwen2 take `q_proj, v_proj`; gpt2 takes `c_attn`).
pub fn peft_default_targets(a: &Architecture) -> Vec<Target> {
    match a.family() {
        Family::Gpt => vec![Target::Qkv],
        _ => vec![Target::Q, Target::V],
    }
}

/// The targets named in a list (`q,k,v` on the command line, or the spec's array), sorted and
/// without repeats; `all` stands for every linear of the block.
pub fn parse_targets(a: &Architecture, names: &[&str]) -> Result<Vec<Target>, String> {
    let mut v = Vec::new();
    for n in names {
        let n = n.trim();
        if n == "all" {
            v.extend(Lora::all_linear(a));
            continue;
        }
        match Target::by_name(n) {
            Some(t) => v.push(t),
            None => {
                let names: Vec<&str> = Target::ALL.iter().map(|t| t.name()).collect();
                return Err(format!(
                    "unknown target \"{n}\"; targets are {} (or all)",
                    names.join(",")
                ));
            }
        }
    }
    v.sort();
    v.dedup();
    Ok(v)
}

/// The spec's fine-tuning keys, resolved: the method, the optimizer's moments and the adapters.
pub(crate) fn resolve(
    f: &Fields,
    a: &Architecture,
    method: &Field<String>,
    states: &Field<String>,
    lora: Option<&Spanned<RawLora>>,
) -> Result<(Method, OptimizerStates, Option<Lora>), Diagnostic> {
    let m = f.choice(
        "training",
        "method",
        method,
        &[
            ("full", Method::Full),
            ("lora", Method::Lora),
            ("qlora", Method::Qlora),
        ],
        Some(Method::Full),
    )?;
    let s = f.choice(
        "training",
        "optimizer_states",
        states,
        &[
            ("policy", OptimizerStates::Policy),
            ("8bit", OptimizerStates::Bit8),
        ],
        Some(OptimizerStates::Policy),
    )?;
    let lora = match lora {
        None if m.adapters() => Some(default_lora(a)),
        None => None,
        Some(t) if !m.adapters() => {
            return Err(f.err(
                Some(t.span()),
                "lora",
                "a [lora] table configures adapters, but training.method is \"full\", which trains every parameter",
                "set training.method = \"lora\" or \"qlora\" under [training], or remove the [lora] table",
            ))
        }
        Some(t) => {
            let r = t.get_ref();
            let rank = f.opt_pos_int("lora", "rank", &r.rank)?.unwrap_or(DEFAULT_RANK);
            let alpha = f.opt_pos_num("lora", "alpha", &r.alpha)?.unwrap_or(rank as f64);
            let dropout = f.opt_nonneg_num("lora", "dropout", &r.dropout)?.unwrap_or(0.0);
            let targets = match &r.targets {
                None => peft_default_targets(a),
                Some(list) => {
                    let mut v = Vec::new();
                    for n in list.get_ref() {
                        let one = parse_targets(a, &[n.get_ref().as_str()]).map_err(|e| {
                            f.err(
                                Some(n.span()),
                                "lora.targets",
                                e,
                                "name the block's linears: targets = [\"q\", \"k\", \"v\", \"o\", \"gate\", \"up\", \"down\"] (gpt family: \"qkv\", \"o\", \"up\", \"down\")",
                            )
                        })?;
                        v.extend(one);
                    }
                    v.sort();
                    v.dedup();
                    v
                }
            };
            Some(Lora {
                rank,
                alpha,
                dropout,
                targets,
            })
        }
    };
    Ok((m, s, lora))
}

/// PEFT's defaults: rank 8, alpha 8, no dropout, the family's default targets.
fn default_lora(a: &Architecture) -> Lora {
    Lora {
        rank: DEFAULT_RANK,
        alpha: DEFAULT_RANK as f64,
        dropout: 0.0,
        targets: peft_default_targets(a),
    }
}

/// Fine-tuning values given on the command line; they override the spec's.
#[derive(Debug, Clone, Default)]
pub struct FineTuneOverrides {
    pub method: Option<Method>,
    pub lora_rank: Option<u64>,
    pub lora_alpha: Option<f64>,
    pub lora_dropout: Option<f64>,
    /// Comma-separated target names, as given.
    pub lora_targets: Option<String>,
    pub optimizer_states: Option<OptimizerStates>,
}

impl FineTuneOverrides {
    fn lora_flags(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.lora_rank.is_some() {
            v.push("--lora-rank");
        }
        if self.lora_alpha.is_some() {
            v.push("--lora-alpha");
        }
        if self.lora_dropout.is_some() {
            v.push("--lora-dropout");
        }
        if self.lora_targets.is_some() {
            v.push("--lora-targets");
        }
        v
    }

    /// Applies the flags to a resolved model; a flag that contradicts the method is refused
    /// naming the flag.
    pub fn apply(&self, model: &mut Model) -> Result<(), Diagnostic> {
        let cli = "<command line>";
        if let Some(m) = self.method {
            model.training.method = m;
        }
        if let Some(s) = self.optimizer_states {
            model.training.optimizer_states = s;
        }
        let method = model.training.method;
        let flags = self.lora_flags();
        if !method.adapters() {
            if let Some(flag) = flags.first() {
                return Err(Diagnostic::new(
                    cli,
                    *flag,
                    format!("{flag} configures adapters, but the method is \"full\", which trains every parameter"),
                    "add --method lora (or qlora), or set training.method in the spec",
                ));
            }
            model.lora = None;
            return Ok(());
        }
        let a = &model.architecture;
        let mut l = model.lora.take().unwrap_or_else(|| default_lora(a));
        if let Some(r) = self.lora_rank {
            if r == 0 {
                return Err(Diagnostic::new(
                    cli,
                    "--lora-rank",
                    "must be at least 1, found 0",
                    "pass --lora-rank 16 (PEFT's default is 8)",
                ));
            }
            // The spec's alpha stays; a rank without an alpha anywhere keeps alpha = rank.
            if self.lora_alpha.is_none() && l.alpha == l.rank as f64 {
                l.alpha = r as f64;
            }
            l.rank = r;
        }
        if let Some(x) = self.lora_alpha {
            if !(x > 0.0 && x.is_finite()) {
                return Err(Diagnostic::new(
                    cli,
                    "--lora-alpha",
                    format!("must be a positive number, found {x}"),
                    "pass --lora-alpha 32 (2 × rank is common), or equal to the rank",
                ));
            }
            l.alpha = x;
        }
        if let Some(d) = self.lora_dropout {
            if !(0.0..1.0).contains(&d) {
                return Err(Diagnostic::new(
                    cli,
                    "--lora-dropout",
                    format!("a dropout probability must be in [0, 1), found {d}"),
                    "pass --lora-dropout 0.05 (PEFT's default is 0.0)",
                ));
            }
            l.dropout = d;
        }
        if let Some(t) = &self.lora_targets {
            let names: Vec<&str> = t.split(',').filter(|s| !s.trim().is_empty()).collect();
            l.targets = parse_targets(a, &names).map_err(|e| {
                Diagnostic::new(
                    cli,
                    "--lora-targets",
                    e,
                    "pass --lora-targets q,k,v,o,gate,up,down (gpt family: qkv,o,up,down), or all",
                )
            })?;
        }
        model.lora = Some(l);
        crate::finetune::check(&model.architecture, method, model.lora.as_ref()).map_err(|p| {
            let flag = match p.field.as_str() {
                "lora.targets" if self.lora_targets.is_some() => Some("--lora-targets"),
                "lora.rank" if self.lora_rank.is_some() => Some("--lora-rank"),
                "training.method" if self.method.is_some() => Some("--method"),
                _ => None,
            };
            Diagnostic::new(cli, flag.unwrap_or(&p.field), p.problem, p.fix)
        })
    }
}
