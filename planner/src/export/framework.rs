//! Which framework profiles each export target runs: a plan predicted for one framework is
//! not exported to another as if the prediction held there.

use super::{refuse, ExportError, Target};
use crate::framework;
use crate::plan::Plan;

/// The profiles whose runs `target` launches: Megatron-LM's arguments serve every Megatron era,
/// DeepSpeed's config DeepSpeed, torchtitan's TOML torchtitan; the schedulers' scripts run
/// `tessera run`.
pub fn profiles(target: Target) -> &'static [&'static str] {
    match target {
        Target::Megatron => &["megatron-core", "megatron-lm-2022", "megatron-legacy"],
        Target::DeepSpeed => &["deepspeed"],
        Target::Torchtitan => &[
            "torchtitan",
            "torchtitan-compile",
            "torchtitan-compile-blocks",
        ],
        Target::Sbatch | Target::Kubernetes => &["tessera"],
        // A LoraConfig launches nothing: any plan's adapters are the same adapters. Tessera has
        // no torchtune profile: its plans are predicted for the default one (a warning says so).
        Target::Peft => &[],
        Target::Torchtune => &["megatron-core"],
        // Both run PyTorch's DDP or FSDP, or DeepSpeed's ZeRO, over a transformers model.
        Target::Accelerate | Target::Lightning => &["pytorch-eager", "deepspeed"],
    }
}

/// The profile a plan was predicted for.
fn plan_profile(plan: &Plan) -> &'static str {
    framework::of(&plan.job.model, &plan.job.cluster)
        .name
        .as_str()
}

/// A plan whose spec stated a framework the engine target does not run is refused: its
/// predicted time and memory are that framework's (`tessera plan --framework`).
pub(super) fn check(plan: &Plan, target: Target) -> Result<(), ExportError> {
    let engine = !matches!(target, Target::Sbatch | Target::Kubernetes | Target::Peft);
    let used = plan_profile(plan);
    if engine && framework::stated(&plan.job.model) && !profiles(target).contains(&used) {
        return Err(refuse(
            target,
            format!(
                "the plan was made for the framework profile \"{used}\": its layout was searched among what {used} runs, and its step time and memory are {used}'s"
            ),
            if target == Target::Torchtune {
                "re-plan without --framework (Tessera has no torchtune profile) and export that plan".to_string()
            } else {
                format!(
                    "re-plan with `tessera plan ... --framework {}` and export that plan",
                    profiles(target)[0]
                )
            },
        ));
    }
    Ok(())
}

/// A warning for an export whose target runs another framework than the one the plan was
/// predicted for, where the export still proceeds: a default-profile plan exported to
/// DeepSpeed or torchtitan, or any non-Tessera plan exported to a scheduler script that runs
/// `tessera run`.
pub fn warning(plan: &Plan, target: Target) -> Option<String> {
    let used = plan_profile(plan);
    if target == Target::Peft {
        return None;
    }
    if target == Target::Torchtune {
        return Some(format!(
            "warning: this plan's step time and memory were predicted for the framework profile \"{used}\"; Tessera has no torchtune profile, so torchtune's own run (its FSDP2, its kernels) may differ"
        ));
    }
    if profiles(target).contains(&used) {
        return None;
    }
    Some(format!(
        "warning: this plan's step time and memory were predicted for the framework profile \"{used}\"{}; {} runs {}: re-plan with `--framework {}` to predict that run",
        if framework::stated(&plan.job.model) {
            ""
        } else {
            " (the default)"
        },
        target.name(),
        profiles(target).join(" / "),
        profiles(target)[0]
    ))
}
