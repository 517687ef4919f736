//! `tessera checkpoint inspect DIR` and `tessera checkpoint export DIR --to hf|peft -o OUT`: what
//! a checkpoint of `tessera run --save-dir` holds, and the model as a Hugging Face folder, a LoRA
//! checkpoint's adapters as a PEFT folder or its model with the adapters merged (`--to hf
//! --merge`) (`tessera_runtime::hf`; docs/checkpoints.md). `tessera checkpoint logits` (hidden)
//! prints the runtime's forward (through the adapters of a LoRA checkpoint) on given token ids,
//! for scripts/check_hf_export.py and scripts/check_peft_export.py.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{anyhow, bail};
use clap::{Args, Subcommand, ValueEnum};
use tessera_runtime::checkpoint::{Checkpoint, Kind};

use crate::output::table;

#[derive(Args)]
pub struct CheckpointArgs {
    #[command(subcommand)]
    command: CheckpointCommand,
}

#[derive(Subcommand)]
enum CheckpointCommand {
    /// Print a checkpoint's step, the layout that saved it, its tensors and their coverage.
    Inspect {
        /// A save directory (its newest checkpoint) or one of its step-N directories.
        dir: PathBuf,
    },
    /// Write the model as a Hugging Face folder (model.safetensors and config.json), or a LoRA
    /// checkpoint's adapters as a PEFT folder (adapter_model.safetensors, adapter_config.json).
    Export {
        /// A save directory (its newest checkpoint) or one of its step-N directories.
        dir: PathBuf,
        /// The format: `hf` (GPT2LMHeadModel or LlamaForCausalLM, by the architecture) or
        /// `peft` (a LoRA checkpoint's adapters, for PeftModel.from_pretrained on the base).
        #[arg(long, value_enum)]
        to: ExportFormat,
        /// With `--to hf`, of a LoRA checkpoint: merge the adapters into the base's weights
        /// (W + alpha/r·B·A), as PEFT's merge_and_unload does.
        #[arg(long)]
        merge: bool,
        /// The folder to create (it must not exist, or be empty).
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Print the model's logits on token ids as JSON (the runtime's forward, one rank).
    #[command(hide = true)]
    Logits {
        dir: PathBuf,
        /// Comma-separated token ids, `--seq-len` per sequence.
        #[arg(long, value_delimiter = ',', required = true)]
        tokens: Vec<u32>,
        /// Tokens per sequence [default: all of them, one sequence].
        #[arg(long)]
        seq_len: Option<usize>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum ExportFormat {
    Hf,
    Peft,
}

/// The checkpoint in `dir`, checked against itself (its index's fields against each other and
/// its model against the tensors).
fn open(dir: &std::path::Path) -> anyhow::Result<Checkpoint> {
    let ck = Checkpoint::open(dir).map_err(|e| anyhow!("{e}"))?;
    tessera_runtime::exec::check_checkpoint(&ck).map_err(|e| anyhow!("{e}"))?;
    Ok(ck)
}

pub fn run(args: CheckpointArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        CheckpointCommand::Inspect { dir } => inspect(&open(&dir)?)?,
        CheckpointCommand::Export {
            dir,
            to,
            merge,
            output,
        } => export(&dir, to, merge, &output)?,
        CheckpointCommand::Logits {
            dir,
            tokens,
            seq_len,
        } => {
            let ck = open(&dir)?;
            let t = seq_len.unwrap_or(tokens.len());
            if t == 0 {
                bail!("--seq-len 0: a sequence needs at least one token\n  fix: pass --seq-len N with N > 0");
            }
            let (a, lora) = (&ck.index().model, ck.index().lora.as_ref());
            let logits =
                tessera_runtime::exec::forward_logits_with(a, lora, t, &tokens, |layout| {
                    Ok(ck.restore(layout, &[])?.params)
                })
                .map_err(|e| anyhow!("{}: {e}", dir.display()))?;
            let rows: Vec<&[f32]> = logits.chunks(a.vocab as usize).collect();
            let doc = serde_json::json!({ "seq_len": t, "vocab": a.vocab, "logits": rows });
            println!("{doc}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn export(
    dir: &std::path::Path,
    to: ExportFormat,
    merge: bool,
    output: &std::path::Path,
) -> anyhow::Result<()> {
    use tessera_runtime::hf;
    if merge && matches!(to, ExportFormat::Peft) {
        bail!("--merge with --to peft: a PEFT folder holds the adapters apart from the base, so there is nothing to merge\n  fix: pass --to hf --merge for the merged model, or drop --merge");
    }
    let ck = open(dir)?;
    let (out, files) = match (to, merge) {
        (ExportFormat::Hf, false) => (hf::export(&ck, output), [hf::WEIGHTS, hf::CONFIG]),
        (ExportFormat::Hf, true) => (hf::export_merged(&ck, output), [hf::WEIGHTS, hf::CONFIG]),
        (ExportFormat::Peft, _) => (
            hf::export_peft(&ck, output),
            [hf::ADAPTER_WEIGHTS, hf::ADAPTER_CONFIG],
        ),
    };
    let out = out.map_err(|e| anyhow!("{e}"))?;
    let what = match (to, merge) {
        (ExportFormat::Hf, false) => out.family.class().to_string(),
        (ExportFormat::Hf, true) => format!("{}, LoRA adapters merged", out.family.class()),
        (ExportFormat::Peft, _) => format!("PEFT LoRA adapters for {}", out.family.class()),
    };
    println!(
        "wrote {} ({what}): {} tensors, {} parameters, {} bytes of {}, and {}",
        out.dir.display(),
        out.tensors,
        out.params,
        out.bytes,
        files[0],
        files[1]
    );
    Ok(())
}

fn inspect(ck: &Checkpoint) -> anyhow::Result<()> {
    let ix = ck.index();
    let (a, p) = (&ix.model, &ix.parallel);
    println!(
        "checkpoint {}: step {} ({} Adam updates), written by {}",
        ck.dir().display(),
        ix.step,
        ix.optimizer.updates,
        ix.generator
    );
    println!(
        "model: {} layers, hidden {}, heads {} (kv {}), ffn {}, vocab {}, {:?} positions, {:?}, {:?}{}{}",
        a.layers,
        a.hidden,
        a.heads,
        a.kv_heads,
        a.ffn_hidden,
        a.vocab,
        a.position,
        a.norm,
        a.activation,
        if a.bias { ", biases" } else { "" },
        if a.tied_embeddings { ", tied embeddings" } else { "" }
    );
    println!(
        "saved from: world {} = dp {} × tp {} × pp {}, ZeRO-{}, micro-batch {} × {} micro-batches, {} virtual stages, schedule {}{}",
        p.world,
        p.dp,
        p.tp,
        p.pp,
        p.zero_stage,
        p.micro_batch,
        p.microbatches,
        p.virtual_stages,
        p.schedule.name(),
        if p.sequence_parallel { ", sequence parallel" } else { "" }
    );
    println!(
        "training: seq_len {}, global batch {}, data {} ({} tokens), next step {}, next lr {}",
        ix.training.seq_len,
        ix.training.global_batch,
        ix.data.source,
        ix.data.tokens,
        ix.lr.next_step,
        ix.lr.next_lr
    );
    let mut t = table(&["tensor", "shape", "dtype", "elements"], &[3]);
    let mut elements = 0u64;
    let mut count = 0;
    for (name, shape, _) in ck.params() {
        let n: usize = shape.iter().product();
        elements += n as u64;
        count += 1;
        t.add_row(vec![
            name.to_string(),
            format!("{shape:?}"),
            ix.dtype.clone(),
            n.to_string(),
        ]);
    }
    println!("{t}");
    let bytes: u64 = ix.shards.iter().map(|s| s.bytes).sum();
    let kinds: Vec<&str> = Kind::ALL.iter().map(|k| k.as_str()).collect();
    println!(
        "{count} tensors, {elements} parameters ({}); {} shard files, {bytes} bytes in all",
        kinds.join(" + "),
        ix.shards.len()
    );
    println!(
        "coverage: ok: every element of the {count} tensors' {} is held by exactly one shard",
        kinds.join(", ")
    );
    Ok(())
}
