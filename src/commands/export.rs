//! `tessera export plan.json --to megatron|deepspeed|torchtitan|sbatch|kubernetes|peft|torchtune|accelerate|lightning [-o FILE]`:
//! the plan in the language of the engine or scheduler that will run it (docs/exports.md). A
//! plan the target cannot express exactly is refused with exit 2; no file is written. A plan
//! marked infeasible is refused unless `--force`. An adapter plan's accelerate export is two
//! files, so `-o` names a folder then (`accelerate_config.yaml` and PEFT's `adapter_config.json`),
//! as `tessera checkpoint export --to peft` writes its folder.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::bail;
use clap::{Args, ValueEnum};
use tessera_planner::export::{deepspeed_flags, export_with, offload_note, peft_note, Target};
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
    /// A Hugging Face Accelerate config (YAML): DDP, FSDP or DeepSpeed; for a LoRA or QLoRA
    /// plan, a folder with PEFT's adapter_config.json beside it.
    Accelerate,
    /// A Lightning snippet (Python): the Trainer's arguments and its DDP, FSDP or DeepSpeed
    /// strategy.
    Lightning,
}

/// The accelerate config's name in the folder of an adapter plan's export.
const ACCELERATE_CONFIG: &str = "accelerate_config.yaml";

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
    let plan = Plan::load(&args.plan)?;
    // An adapter plan's accelerate export is a folder (checked by write_folder); every other
    // export is one file.
    let folder = matches!(args.to, To::Accelerate) && plan.job.model.training.method.adapters();
    if !folder {
        check_outputs(&[named("PLAN", &args.plan)], &outputs)?;
    }
    let target = match args.to {
        To::Megatron => Target::Megatron,
        To::Deepspeed => Target::DeepSpeed,
        To::Torchtitan => Target::Torchtitan,
        To::Sbatch => Target::Sbatch,
        To::Kubernetes => Target::Kubernetes,
        To::Peft => Target::Peft,
        To::Torchtune => Target::Torchtune,
        To::Accelerate => Target::Accelerate,
        To::Lightning => Target::Lightning,
    };
    let text = export_with(&plan, target, args.force)
        .map_err(|e| anyhow::anyhow!("{}: {e}", args.plan.display()))?;
    if let Some(w) = tessera_planner::export::framework::warning(&plan, target) {
        eprintln!("{}: {w}", args.plan.display());
    }
    if let Some(note) = offload_note(&plan, target) {
        eprintln!("{}: note: {note}", args.plan.display());
    }
    if folder {
        // The adapters are PEFT's LoraConfig, exactly as `--to peft` writes it.
        let lora = export_with(&plan, Target::Peft, args.force)
            .map_err(|e| anyhow::anyhow!("{}: {e}", args.plan.display()))?;
        let Some(dir) = &args.output else {
            bail!(
                "{}: an adapter plan's accelerate export is two files ({ACCELERATE_CONFIG} and {})
  fix: pass -o FOLDER (a new or empty folder)",
                args.plan.display(),
                tessera_runtime::hf::ADAPTER_CONFIG
            );
        };
        write_folder(
            dir,
            &[
                (ACCELERATE_CONFIG, &text),
                (tessera_runtime::hf::ADAPTER_CONFIG, &lora),
            ],
        )?;
        if let Some(note) = peft_note(&plan) {
            eprintln!("{}: note: {note}", args.plan.display());
        }
        println!(
            "wrote {} ({}: {ACCELERATE_CONFIG} and {})",
            dir.display(),
            target.name(),
            tessera_runtime::hf::ADAPTER_CONFIG
        );
        return Ok(ExitCode::SUCCESS);
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

/// Writes `files` into the folder `dir`, created if missing; an existing folder must be empty
/// (an export never overwrites).
fn write_folder(dir: &std::path::Path, files: &[(&str, &String)]) -> anyhow::Result<()> {
    match std::fs::symlink_metadata(dir) {
        Err(_) => {}
        Ok(m) if !m.is_dir() => bail!(
            "{}: exists and is not a folder
  fix: name a new folder (it is created), or an empty one",
            dir.display()
        ),
        Ok(_) => {
            let mut entries = std::fs::read_dir(dir)
                .map_err(|e| anyhow::anyhow!("{}: cannot list: {e}", dir.display()))?;
            if entries.next().is_some() {
                bail!(
                    "{}: is a folder that is not empty; an export never overwrites
  fix: name a new folder (it is created), or remove this one first",
                    dir.display()
                );
            }
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| {
        anyhow::anyhow!(
            "{}: cannot create: {e}
  fix: check that its parent exists and is writable",
            dir.display()
        )
    })?;
    for (name, text) in files {
        write_output(&dir.join(name), text.as_bytes())?;
    }
    Ok(())
}
