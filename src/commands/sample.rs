//! `tessera sample DIR --prompt TEXT`: generate text from a checkpoint on the CPU, to see what
//! the model learned. The checkpoint (any layout) is restored onto the single-rank layout of the
//! model it holds and run forward by the runtime's own layers (`tessera_runtime::exec::generate`),
//! token by token, with the byte tokenizer the run trained with.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::bail;
use clap::Args;
use tessera_planner::Diagnostic;
use tessera_runtime::checkpoint::Checkpoint;
use tessera_runtime::exec::generate::Generator;

/// The most tokens one command generates.
const MAX_TOKENS: u64 = 1_000_000;

#[derive(Args)]
pub struct SampleArgs {
    /// A checkpoint: a save directory of `tessera run --save-dir` (its newest) or one of its
    /// step-N directories.
    dir: PathBuf,
    /// The text the model continues.
    #[arg(long)]
    prompt: String,
    /// How many tokens (bytes) to generate.
    #[arg(long, default_value_t = 200)]
    tokens: u64,
    /// Sampling temperature: 0 takes the most likely token each time; higher is more varied.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f64,
    /// Seed of the draws: the same seed gives the same text.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn cli_error(field: &str, problem: String, fix: &str) -> anyhow::Error {
    anyhow::anyhow!(Diagnostic::new("<command line>", field, problem, fix))
}

/// The byte tokenizer is the only one: a checkpoint trained on a token file (`.bin`, `.u32`)
/// cannot be decoded.
fn check_bytes(source: &str, index: &Path) -> anyhow::Result<()> {
    let ext = Path::new(source).extension().and_then(|e| e.to_str());
    if matches!(ext, Some("bin" | "u32")) {
        bail!(
            "{}: the run trained on the token file {source}, and sample encodes and decodes bytes only\n  fix: sample from a checkpoint trained on a text file (read as bytes)",
            index.display()
        );
    }
    Ok(())
}

pub fn run(args: SampleArgs) -> anyhow::Result<ExitCode> {
    if args.tokens == 0 || args.tokens > MAX_TOKENS {
        return Err(cli_error(
            "--tokens",
            format!("must be between 1 and {MAX_TOKENS}, found {}", args.tokens),
            "pass --tokens 1 or more (200 by default)",
        ));
    }
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        return Err(cli_error(
            "--temperature",
            format!(
                "must be a finite number 0 or above, found {}",
                args.temperature
            ),
            "pass --temperature 0 for the most likely text, or e.g. 0.8",
        ));
    }
    if args.prompt.is_empty() {
        return Err(cli_error(
            "--prompt",
            "is empty: the model needs at least one byte to continue".into(),
            "pass --prompt with some text",
        ));
    }
    let ck = Checkpoint::open(&args.dir)?;
    let index_path = ck.dir().join(tessera_runtime::checkpoint::INDEX);
    check_bytes(&ck.index().data.source, &index_path)?;
    let vocab = ck.index().model.vocab;
    if vocab < 256 {
        bail!(
            "{}: the model's vocabulary is {vocab}, fewer than the 256 bytes the tokenizer needs\n  fix: sample from a checkpoint of a byte-level model (vocab 256 or more)",
            index_path.display()
        );
    }
    let generator = Generator::from_checkpoint(&ck)?;
    let prompt: Vec<u32> = args.prompt.bytes().map(u32::from).collect();
    let out = generator.generate(&prompt, args.tokens as usize, args.temperature, args.seed)?;
    // Every id is below 256 here (a byte-level vocabulary may have padding ids above: shown
    // as the replacement character).
    let bytes: Vec<u8> = out
        .iter()
        .flat_map(|&t| match u8::try_from(t) {
            Ok(b) => vec![b],
            Err(_) => "\u{fffd}".as_bytes().to_vec(),
        })
        .collect();
    eprintln!(
        "{}: step {}, {} tokens at temperature {} (seed {})",
        ck.dir().display(),
        ck.step(),
        args.tokens,
        args.temperature,
        args.seed
    );
    println!("{}{}", args.prompt, String::from_utf8_lossy(&bytes));
    Ok(ExitCode::SUCCESS)
}
