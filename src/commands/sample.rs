//! `tessera sample DIR --prompt TEXT`: generate text from a checkpoint on the CPU, to see what
//! the model learned. The checkpoint (any layout) is restored onto the single-rank layout of the
//! model it holds and run forward by the runtime's own layers (`tessera_runtime::exec::generate`),
//! token by token, with the tokenizer the run trained with (recorded in the checkpoint), and
//! written as the tokens come.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::bail;
use clap::Args;
use tessera_planner::Diagnostic;
use tessera_runtime::checkpoint::Checkpoint;
use tessera_runtime::data::Tokenizer;
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
    /// How many tokens to generate.
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

/// The tokenizer the checkpoint's run trained with: the one its index records, or, for a
/// checkpoint written before tokenizers were recorded, bytes (refused where the run read a
/// token file, whose tokenizer is unknown).
fn tokenizer_of(ck: &Checkpoint, index: &Path) -> anyhow::Result<Tokenizer> {
    let data = &ck.index().data;
    if let Some(t) = &data.tokenizer {
        return Ok(t.load(index)?);
    }
    let ext = Path::new(&data.source).extension().and_then(|e| e.to_str());
    if matches!(ext, Some("bin" | "u32")) {
        bail!(
            "{}: the run trained on the token file {}, and the checkpoint does not record which tokenizer made it\n  fix: sample from a checkpoint of a run on text or on a folder prepared by `tessera data prepare` (its tokenizer is recorded)",
            index.display(),
            data.source
        );
    }
    Ok(Tokenizer::Bytes)
}

/// Writes generated text as the tokens come: byte-level tokenizers (bytes, GPT-2) a token's
/// bytes at a time, holding back a character split across tokens; a tokenizer.json by decoding
/// all tokens so far and writing what is new.
struct Stream {
    tok: Tokenizer,
    ids: Vec<u32>,
    /// Decoded bytes not written yet (byte-level), or all decoded bytes (tokenizer.json).
    bytes: Vec<u8>,
    /// How many of `bytes` are written (tokenizer.json).
    written: usize,
}

impl Stream {
    fn push(&mut self, id: u32) -> anyhow::Result<()> {
        if u64::from(id) >= self.tok.vocab() {
            // A padding id of the model's vocabulary, past the tokenizer's: shown as U+FFFD.
            let mut out = std::io::stdout().lock();
            out.write_all("\u{fffd}".as_bytes())?;
            return Ok(out.flush()?);
        }
        self.ids.push(id);
        let whole = match self.tok {
            Tokenizer::HuggingFace { .. } => {
                self.bytes = self.tok.decode_bytes(&self.ids)?;
                &self.bytes[self.written.min(self.bytes.len())..]
            }
            _ => {
                self.bytes.extend(self.tok.decode_bytes(&[id])?);
                &self.bytes[..]
            }
        };
        // Write every whole character; an invalid byte sequence as U+FFFD; hold back only an
        // incomplete character at the end.
        let (mut text, mut used) = (Vec::new(), 0);
        loop {
            match std::str::from_utf8(&whole[used..]) {
                Ok(rest) => {
                    text.extend_from_slice(rest.as_bytes());
                    used = whole.len();
                    break;
                }
                Err(e) => {
                    text.extend_from_slice(&whole[used..used + e.valid_up_to()]);
                    used += e.valid_up_to();
                    match e.error_len() {
                        Some(bad) => {
                            text.extend_from_slice("\u{fffd}".as_bytes());
                            used += bad;
                        }
                        None => break,
                    }
                }
            }
        }
        let mut out = std::io::stdout().lock();
        out.write_all(&text)?;
        out.flush()?;
        match self.tok {
            Tokenizer::HuggingFace { .. } => self.written += used,
            _ => {
                self.bytes.drain(..used);
            }
        }
        Ok(())
    }

    /// Writes what is held back (a character never completed, as U+FFFD) and a newline.
    fn finish(self) -> anyhow::Result<()> {
        let rest = match self.tok {
            Tokenizer::HuggingFace { .. } => &self.bytes[self.written.min(self.bytes.len())..],
            _ => &self.bytes[..],
        };
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", String::from_utf8_lossy(rest))?;
        out.flush()?;
        Ok(())
    }
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
    tessera_runtime::exec::check_checkpoint(&ck).map_err(|e| anyhow::anyhow!("{e}"))?;
    let index_path = ck.dir().join(tessera_runtime::checkpoint::INDEX);
    let tok = tokenizer_of(&ck, &index_path)?;
    let vocab = ck.index().model.vocab;
    if vocab < tok.vocab() {
        bail!(
            "{}: the model's vocabulary is {vocab}, fewer than the {} tokens of its tokenizer ({})\n  fix: sample from a checkpoint whose model covers its tokenizer's vocabulary",
            index_path.display(),
            tok.vocab(),
            tok.name()
        );
    }
    let generator = Generator::from_checkpoint(&ck)?;
    let prompt = tok.encode(&args.prompt)?;
    if prompt.is_empty() {
        return Err(cli_error(
            "--prompt",
            format!("makes no token under the {} tokenizer", tok.name()),
            "pass --prompt with some text",
        ));
    }
    eprintln!(
        "{}: step {}, {} tokens at temperature {} (seed {}), {} tokenizer",
        ck.dir().display(),
        ck.step(),
        args.tokens,
        args.temperature,
        args.seed,
        tok.name()
    );
    print!("{}", args.prompt);
    std::io::stdout().flush()?;
    let mut stream = Stream {
        tok,
        ids: Vec::new(),
        bytes: Vec::new(),
        written: 0,
    };
    let mut failed = None;
    let drawn = generator.generate_each(
        &prompt,
        args.tokens as usize,
        args.temperature,
        args.seed,
        &mut |id| {
            stream.push(id).map_err(|e| {
                let shown = format!("{e:#}");
                failed = Some(e);
                tessera_runtime::exec::RunError::Unsupported {
                    what: shown,
                    fix: "see the error above".into(),
                }
            })
        },
    );
    if let Some(e) = failed {
        return Err(e);
    }
    drawn?;
    stream.finish()?;
    Ok(ExitCode::SUCCESS)
}
