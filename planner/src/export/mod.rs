//! A plan in the languages of the engines and schedulers users run: Megatron-LM's
//! `pretrain_gpt.py` arguments, a DeepSpeed config, a torchtitan job config, a Slurm batch
//! script and a Kubernetes indexed Job; and for fine-tuning, PEFT's `LoraConfig` and a torchtune
//! recipe config; for the trainers, a Hugging Face Accelerate config (with PEFT's `LoraConfig`
//! beside it for adapters) and a Lightning `Trainer` snippet. Each writer states the plan exactly or refuses: a plan
//! feature the target lacks is an [`ExportError`] naming it, never a file that silently means
//! something else. Pure: text in, text out.
//!
//! Two rules keep an export from launching anything but the plan:
//! - **No language is built by concatenation.** Shell words are quoted by `shlex`, YAML and
//!   TOML are written by serde serializers, JSON by serde_json; a string from a spec that
//!   appears in a comment is written as one line of printable ASCII ([`comment_text`]). The
//!   specs' names are also restricted at load (`spec::check`), but the writers do not rely on
//!   it: tests/export_injection.rs feeds hostile strings straight into every writer.
//! - **Every launch number comes from the plan** ([`launch::Launch`]): the world size, the
//!   nodes and ranks per node, GPUs or none, the batch per forward and micro-batches per step,
//!   the layers of every (virtual) stage and the recomputed layers of every chunk. A plan
//!   marked infeasible is refused unless forced.

mod accelerate;
mod deepspeed;
pub mod framework;
mod launch;
mod lightning;
mod megatron;
mod offload;
mod peft;
#[cfg(test)]
mod schedule_tests;
mod scheduler;
mod torchtitan;
mod torchtune;
mod trainers;

pub use deepspeed::deepspeed_flags;
pub use launch::Launch;
pub use offload::{offload_note, NVME_PATH};
pub use peft::{adapter_config, peft_note};

use crate::plan::Plan;
use crate::spec::DeviceKind;

/// The targets `tessera export --to` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Megatron,
    DeepSpeed,
    Torchtitan,
    Sbatch,
    Kubernetes,
    Peft,
    Torchtune,
    Accelerate,
    Lightning,
}

impl Target {
    pub fn name(self) -> &'static str {
        match self {
            Target::Megatron => "megatron",
            Target::DeepSpeed => "deepspeed",
            Target::Torchtitan => "torchtitan",
            Target::Sbatch => "sbatch",
            Target::Kubernetes => "kubernetes",
            Target::Peft => "peft",
            Target::Torchtune => "torchtune",
            Target::Accelerate => "accelerate",
            Target::Lightning => "lightning",
        }
    }

    pub const ALL: [Target; 9] = [
        Target::Megatron,
        Target::DeepSpeed,
        Target::Torchtitan,
        Target::Sbatch,
        Target::Kubernetes,
        Target::Peft,
        Target::Torchtune,
        Target::Accelerate,
        Target::Lightning,
    ];
}

/// The plan asks for something the target cannot express.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{target} cannot express this plan: {what}\n  fix: {fix}")]
pub struct ExportError {
    pub target: &'static str,
    pub what: String,
    pub fix: String,
}

fn refuse(target: Target, what: impl Into<String>, fix: impl Into<String>) -> ExportError {
    ExportError {
        target: target.name(),
        what: what.into(),
        fix: fix.into(),
    }
}

/// The refusal of a target that writes a dense model with standard attention (DeepSpeed's and
/// torchtitan's exports) for a plan with MLA, per-head q/k norms or MoE layers; `moe_why` says
/// why the target's own MoE is not the plan's. Megatron's export writes all three.
fn refuse_moe_or_mla(plan: &Plan, target: Target, moe_why: &str) -> Result<(), ExportError> {
    let a = &plan.job.model.architecture;
    if a.mla.is_some() || a.qk_norm {
        return Err(refuse(
            target,
            "Multi-head Latent Attention or per-head query/key norms (the export writes a standard attention model)",
            "export to megatron (--multi-latent-attention, --qk-layernorm)",
        ));
    }
    if a.moe.is_some() {
        return Err(refuse(
            target,
            format!("a mixture-of-experts model ({moe_why})"),
            "export to megatron (--num-experts, --expert-model-parallel-size)",
        ));
    }
    Ok(())
}

/// The plan in `target`'s language; a plan marked infeasible is refused.
pub fn export(plan: &Plan, target: Target) -> Result<String, ExportError> {
    export_with(plan, target, false)
}

/// [`export`]; with `force`, a plan marked infeasible (written by `tessera plan --force`) is
/// exported too.
pub fn export_with(plan: &Plan, target: Target, force: bool) -> Result<String, ExportError> {
    if !plan.feasible && !force {
        return Err(refuse(
            target,
            "the plan is marked \"feasible\": false (its layout does not fit in device memory; it was written with `tessera plan --force`)",
            "re-plan without --force, or export it anyway with `tessera export --force`",
        ));
    }
    // Adapters on a frozen base: PEFT's config and torchtune's LoRA recipes state them; the
    // other targets would launch a job that trains every weight.
    let m = &plan.job.model;
    if m.training.method.adapters() {
        if let Some(why) = adapters_missing(target) {
            return Err(refuse(
                target,
                format!(
                    "a {} fine-tune (adapters on a frozen base): {why}, so its job would train every weight",
                    m.training.method.name()
                ),
                "export it to peft (the adapters' LoraConfig) or torchtune (a LoRA recipe config)",
            ));
        }
    }
    fp8_supported(plan, target)?;
    tp_overlap_supported(plan, target)?;
    let gpu_engine = matches!(
        target,
        Target::Megatron
            | Target::DeepSpeed
            | Target::Torchtitan
            | Target::Torchtune
            | Target::Accelerate
            | Target::Lightning
    );
    if gpu_engine && plan.job.cluster.device.kind == DeviceKind::Cpu {
        return Err(refuse(
            target,
            format!(
                "a plan for the CPU cluster {} ({} trains on GPUs)",
                comment_text(&plan.job.cluster.name),
                target.name()
            ),
            "run it with `tessera run plan.json`, or export it to sbatch or kubernetes",
        ));
    }
    framework::check(plan, target)?;
    if matches!(target, Target::Sbatch | Target::Kubernetes) {
        offload::none(
            plan,
            target,
            "the script runs `tessera run`, whose runtime keeps every state on the device: it has no offload",
            "re-plan without --offload and --offload-activations, or export to deepspeed",
        )?;
    }
    let launch = Launch::of(plan);
    match target {
        Target::Megatron => megatron::megatron(plan, &launch),
        Target::DeepSpeed => deepspeed::deepspeed(plan),
        Target::Torchtitan => torchtitan::torchtitan(plan),
        Target::Sbatch => scheduler::sbatch(plan, &launch),
        Target::Kubernetes => scheduler::kubernetes(plan, &launch),
        Target::Peft => peft::peft(plan),
        Target::Torchtune => torchtune::torchtune(plan),
        Target::Accelerate => accelerate::accelerate(plan, &launch),
        Target::Lightning => lightning::lightning(plan, &launch),
    }
}

/// An FP8 plan exports only to an engine that runs its recipe: Megatron-LM 0.19's
/// `--fp8-recipe` (Transformer Engine: delayed, tensorwise, blockwise; also mxfp8, Blackwell's)
/// and torchtitan 0.2.2's float8 converter (torchao: tensorwise, rowwise).
fn fp8_supported(plan: &Plan, target: Target) -> Result<(), ExportError> {
    use crate::fp8::Recipe;
    let r = plan.job.model.training.fp8;
    let why = match (target, r) {
        (_, Recipe::None) => return Ok(()),
        (Target::Megatron, Recipe::Delayed | Recipe::Tensorwise | Recipe::Blockwise) => return Ok(()),
        (Target::Torchtitan, Recipe::Tensorwise | Recipe::Rowwise) => return Ok(()),
        (Target::Megatron, _) => "Megatron-LM 0.19's --fp8-recipe takes tensorwise, delayed, mxfp8, blockwise or custom: no rowwise",
        (Target::Torchtitan, _) => "torchtitan 0.2.2's float8 converter (torchao) takes recipe_name tensorwise (the default), rowwise or rowwise_with_gw_hp: no delayed or blockwise scaling",
        (Target::Sbatch | Target::Kubernetes, _) => "the script runs `tessera run`, which has no FP8 GEMM",
        _ => "this export writes no FP8 recipe",
    };
    Err(refuse(
        target,
        format!("FP8 training with the \"{r}\" recipe (training.fp8): {why}"),
        format!("export to {}, or re-plan with --fp8 none", r.runs_on()),
    ))
}

/// A plan whose TP collectives are overlapped with their GEMMs (`training.tp_comm_overlap`,
/// with TP > 1) exports only where the engine overlaps them: Megatron-LM's `--tp-comm-overlap`
/// (it asserts `--sequence-parallel`), torchtitan 0.2.2's async TP (it raises without the
/// compiled model). Elsewhere the job would run them one after the other, slower than the plan.
fn tp_overlap_supported(plan: &Plan, target: Target) -> Result<(), ExportError> {
    let p = &plan.parallel;
    if !plan.job.model.training.tp_comm_overlap || p.tp <= 1 {
        return Ok(());
    }
    let why = match target {
        Target::Megatron if p.sequence_parallel => return Ok(()),
        Target::Megatron => "Megatron-LM asserts --sequence-parallel with --tp-comm-overlap, and the plan's layout has none",
        // Async TP needs the model compiled (torchtitan raises otherwise).
        Target::Torchtitan if torchtitan::compile_components(plan).contains(&"model") => {
            return Ok(())
        }
        Target::Torchtitan => "torchtitan 0.2.2's async TP needs the compiled model (compile.enable), and the plan was not made for compiled torchtitan (--framework torchtitan-compile)",
        Target::Sbatch | Target::Kubernetes => "the script runs `tessera run`, whose runtime runs the TP collectives between the GEMMs",
        _ => "this engine has no TP communication overlap",
    };
    Err(refuse(
        target,
        format!("TP collectives overlapped with their GEMMs (training.tp_comm_overlap, TP {}): {why}", p.tp),
        "export to megatron (with sequence parallelism) or torchtitan (compiled), or re-plan without --tp-comm-overlap",
    ))
}

/// Why `target` cannot state adapters on a frozen base; `None` where it can.
fn adapters_missing(target: Target) -> Option<&'static str> {
    match target {
        Target::Megatron => Some("Megatron-LM's pretrain_gpt.py has no adapters (LoRA on Megatron-Core is NeMo's PEFT, not its arguments)"),
        // A PEFT run reaches DeepSpeed through accelerate or the HF Trainer; this export's
        // client is Megatron-DeepSpeed, whose flags it prints and which has no adapters.
        Target::DeepSpeed => Some("the DeepSpeed export is Megatron-DeepSpeed's config and flags, which have no adapters (a PEFT run's ZeRO config is accelerate's, with the LoRA part PEFT's)"),
        Target::Torchtitan => Some("torchtitan 0.2 has no adapters"),
        Target::Sbatch | Target::Kubernetes => Some("the script launches `tessera run` on the cluster's GPUs, and the runtime trains adapters on the CPU backend only (it refuses an adapter plan on GPUs)"),
        Target::Lightning => Some("the snippet builds the Trainer and its strategy; the model and its adapters are the user's LightningModule (export the adapters' LoraConfig with --to peft or --to accelerate)"),
        Target::Peft | Target::Torchtune | Target::Accelerate => None,
    }
}

/// Layers of every model chunk, in pipeline (virtual-stage) order.
fn chunk_layers(plan: &Plan) -> Vec<u64> {
    chunks_in_order(plan)
        .iter()
        .map(|c| c.layers[1] - c.layers[0])
        .collect()
}

/// The model chunks in pipeline (virtual-stage) order.
fn chunks_in_order(plan: &Plan) -> Vec<&crate::plan::Chunk> {
    let mut chunks: Vec<_> = plan.stages.iter().flat_map(|s| &s.chunks).collect();
    chunks.sort_by_key(|c| c.virtual_stage);
    chunks
}

/// Layers per pipeline stage (all chunks of a stage).
fn stage_layers(plan: &Plan) -> Vec<u64> {
    plan.stages
        .iter()
        .map(|s| s.chunks.iter().map(|c| c.layers[1] - c.layers[0]).sum())
        .collect()
}

/// The layers (0-based) the plan recomputes: with full recompute of every N-th layer, layers
/// N, 2N, … counting from 1 (the runtime's rule, `exec::rank`); all layers with full recompute.
fn recomputed_layers(plan: &Plan) -> Vec<u64> {
    let every = plan.parallel.recompute_every.max(1);
    (0..plan.job.model.architecture.layers)
        .filter(|l| (l + 1).is_multiple_of(every))
        .collect()
}

/// `s` as one line of printable ASCII, safe inside a comment of any of the targets' languages:
/// newlines, control and non-ASCII characters, quotes and backslashes are escaped (Rust's
/// `escape_default`), so a comment can never end early.
pub fn comment_text(s: &str) -> String {
    s.escape_default().to_string()
}

/// A name usable in Kubernetes and Slurm: lowercase letters, digits and dashes, starting with a
/// letter or digit, at most 40 characters.
fn dns_name(name: &str) -> String {
    let s: String = name
        .to_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let s: String = s.trim_matches('-').chars().take(40).collect();
    let s = s.trim_end_matches('-');
    if s.is_empty() {
        "job".into()
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comment_text_is_one_printable_line() {
        let hostile = "x\nrm -rf ~\r\u{2028}\u{0}'\"\\`$(id)";
        let t = comment_text(hostile);
        assert!(t.chars().all(|c| (' '..='~').contains(&c)), "{t}");
        assert!(!t.contains('\n'));
    }

    #[test]
    fn dns_names_are_labels() {
        assert_eq!(dns_name("Llama3.1-405B"), "llama3-1-405b");
        assert_eq!(dns_name("\n;rm -rf /"), "rm--rf");
        assert_eq!(dns_name("!!!"), "job");
        // Truncation never leaves a trailing dash.
        let n = dns_name(&format!("{}-{}", "a".repeat(39), "b".repeat(10)));
        assert!(!n.ends_with('-') && n.len() <= 40, "{n}");
    }
}
