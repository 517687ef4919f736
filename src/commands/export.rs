//! `tessera export plan.json --to megatron|deepspeed|torchtitan|sbatch|kubernetes|peft|torchtune [-o FILE]`:
//! the plan in the language of the engine or scheduler that will run it (docs/exports.md). A
//! plan the target cannot express exactly is refused with exit 2; no file is written. A plan
//! marked infeasible is refused unless `--force`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use tessera_planner::export::{deepspeed_flags, export_with, peft_note, Target};
use tessera_planner::plan::Plan;

use crate::files::{check_outputs, named, write_output};

#[derive(Clone, Copy, ValueEnum)]
enum To {
    /// Megatron-LM `pretrain_gpt.py` arguments (a shell array).
    Megatron,
    /// A DeepSpeed config (JSON); the Megatron-DeepSpeed TP/PP flags are printed.
    Deepspeed,
    /// A torchtitan job config (TOML): the parallelism, checkpointing and batch sections.
    Torchtitan,
    /// A Slurm batch script that runs `tessera run` as one task per GPU.
    Sbatch,
    /// A Kubernetes indexed Job and headless Service that run `tessera launch` per node.
    Kubernetes,
    /// Hugging Face PEFT's LoraConfig (adapter_config.json) of a LoRA or QLoRA plan.
    Peft,
    /// A torchtune 0.6.1 recipe config (YAML): LoRA, QLoRA or full, one device or FSDP.
    Torchtune,
}

#[derive(Args)]
pub struct ExportArgs {
    /// A plan written by `tessera plan -o`.
    plan: PathBuf,
    /// The target.
    #[arg(long, value_enum)]
    to: To,
    /// Write here instead of stdout.
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Export a plan marked `"feasible": false` (written by `tessera plan --force`) too.
    #[arg(long)]
    force: bool,
}

pub fn run(args: ExportArgs) -> anyhow::Result<ExitCode> {
    let outputs: Vec<_> = args
        .output
        .iter()
        .map(|p| named("-o/--output", p))
        .collect();
    check_outputs(&[named("PLAN", &args.plan)], &outputs)?;
    let plan = Plan::load(&args.plan)?;
    let target = match args.to {
        To::Megatron => Target::Megatron,
        To::Deepspeed => Target::DeepSpeed,
        To::Torchtitan => Target::Torchtitan,
        To::Sbatch => Target::Sbatch,
        To::Kubernetes => Target::Kubernetes,
        To::Peft => Target::Peft,
        To::Torchtune => Target::Torchtune,
    };
    let text = export_with(&plan, target, args.force)
        .map_err(|e| anyhow::anyhow!("{}: {e}", args.plan.display()))?;
    if let Some(w) = tessera_planner::export::framework::warning(&plan, target) {
        eprintln!("{}: {w}", args.plan.display());
    }
    match &args.output {
        Some(path) => {
            write_output(path, text.as_bytes())?;
            println!("wrote {} ({})", path.display(), target.name());
        }
        None => print!("{text}"),
    }
    if target == Target::DeepSpeed {
        eprintln!(
            "Megatron-DeepSpeed flags the config cannot hold: {}",
            deepspeed_flags(&plan)
        );
    }
    if target == Target::Peft {
        if let Some(note) = peft_note(&plan) {
            eprintln!("{}: note: {note}", args.plan.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}
