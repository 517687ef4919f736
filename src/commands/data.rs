//! `tessera data prepare INPUT... -o DIR`: tokenizes text into llm.c shards (uint16 when the
//! vocabulary fits 16 bits, else uint32) and writes `DIR/tessera-data.json` naming the
//! tokenizer, its vocabulary and the shards. The first `--val-fraction` of each input's tokens
//! go to the validation shards (`PREFIX_val_000000.bin`, …), the rest to the training shards
//! (`PREFIX_train_000000.bin`, …). Each shard is written atomically (a temporary file in DIR,
//! fsynced, renamed); a failed prepare removes the shards it wrote. docs/data.md.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{anyhow, bail, Context};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use tessera_runtime::data::prepare::{val_count, Sharder};
use tessera_runtime::data::shard::{write_shard, Width, MAX_SHARD_TOKENS};
use tessera_runtime::data::{
    split_of, text, DataMeta, ShardEntry, Split, Tokenizer, TokenizerRef, META_FILE, META_FORMAT,
};

use crate::files::write_output;

#[derive(Args)]
pub struct DataArgs {
    #[command(subcommand)]
    command: DataCommand,
}

#[derive(Subcommand)]
enum DataCommand {
    /// Tokenize text files into llm.c shards and a tessera-data.json, for `tessera run --data`.
    Prepare(PrepareArgs),
}

#[derive(Args)]
struct PrepareArgs {
    /// UTF-8 text files; each is a document, except a .jsonl file, whose lines are JSON
    /// objects with a "text" field, one document each. A file with no text, or not in UTF-8
    /// (UTF-16, UTF-32, invalid bytes), is refused.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// The folder to write (created if missing; it may not hold shards already).
    #[arg(short = 'o', long)]
    out: PathBuf,
    /// bytes, gpt2 (GPT-2's BPE, r50k_base), or the path of a Hugging Face tokenizer.json.
    #[arg(long, default_value = "gpt2")]
    tokenizer: String,
    /// The fraction of each input's tokens (its first ones) that goes to the validation
    /// shards; 0 writes none.
    #[arg(long, default_value_t = 0.05, value_parser = fraction)]
    val_fraction: f64,
    /// Tokens per shard (llm.c writes 100M).
    #[arg(long, default_value_t = 100_000_000, value_parser = clap::value_parser!(u64).range(1..=MAX_SHARD_TOKENS))]
    shard_tokens: u64,
    /// The shards' name prefix: PREFIX_train_000000.bin, PREFIX_val_000000.bin.
    #[arg(long, default_value = "data")]
    name: String,
}

/// `--val-fraction`: a number in [0, 1).
fn fraction(text: &str) -> Result<f64, String> {
    let v: f64 = text
        .trim()
        .parse()
        .map_err(|e| format!("not a number ({e}); pass a fraction such as 0.05"))?;
    if !(0.0..1.0).contains(&v) {
        return Err(format!(
            "must be at least 0 and below 1 (the rest trains), found {v}"
        ));
    }
    Ok(v)
}

pub fn run(args: DataArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        DataCommand::Prepare(a) => prepare(a),
    }
}

/// Refuses a prefix that is not a plain name, or that would make a training shard look like
/// a validation one.
fn check_name(name: &str) -> anyhow::Result<()> {
    let plain = !name.is_empty()
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if !plain || split_of(&format!("{name}_train_000000.bin")) != Split::Train {
        bail!(
            "--name {name:?}: shard names are PREFIX_train_000000.bin and PREFIX_val_000000.bin, so the prefix must be letters, digits, '_', '-' or '.', not start with '.', and not contain _val_ or end in _val\n  fix: pass a plain name such as --name fineweb"
        );
    }
    Ok(())
}

/// The output folder: created if missing, refused if it holds shards or a tessera-data.json
/// already (a second prepare would mix its shards with the first one's).
fn check_out(out: &Path) -> anyhow::Result<()> {
    if out.exists() && !out.is_dir() {
        bail!(
            "-o {}: is not a folder\n  fix: name a folder (it is created if missing)",
            out.display()
        );
    }
    std::fs::create_dir_all(out).with_context(|| {
        format!(
            "-o {}: cannot create the folder\n  fix: choose a writable place",
            out.display()
        )
    })?;
    let taken: Vec<String> = std::fs::read_dir(out)
        .with_context(|| format!("-o {}: cannot read the folder", out.display()))?
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            !n.starts_with('.') && (n.ends_with(".bin") || n.ends_with(".u32") || n == META_FILE)
        })
        .collect();
    if let Some(first) = taken.first() {
        bail!(
            "-o {}: already holds prepared data ({first}{}), which `tessera run --data` would read together with the new shards\n  fix: write to an empty folder, or remove the old shards and {META_FILE}",
            out.display(),
            if taken.len() > 1 { format!(" and {} more", taken.len() - 1) } else { String::new() }
        );
    }
    crate::files::probe_dir(out).map_err(|e| {
        anyhow!(
            "-o {}: cannot write in it: {e}\n  fix: choose a writable folder",
            out.display()
        )
    })
}

/// Writes one shard atomically: a temporary file in the folder, fsynced, renamed.
fn write_atomically(dir: &Path, name: &str, tokens: &[u32], width: Width) -> anyhow::Result<()> {
    let path = dir.join(name);
    let fail = |e: std::io::Error| {
        anyhow!(
            "{}: cannot write: {e}\n  fix: check that the folder is writable and has free space",
            path.display()
        )
    };
    let prefix = format!(".{name}.");
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".tmp");
    // 0666 less the umask, as `File::create` gives (a temporary file would keep 0600).
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    let tmp = builder.tempfile_in(dir).map_err(fail)?;
    let mut w = BufWriter::with_capacity(1 << 20, tmp);
    write_shard(&mut w, tokens, width).map_err(fail)?;
    let tmp = w.into_inner().map_err(|e| fail(e.into_error()))?;
    tmp.as_file().sync_all().map_err(fail)?;
    tmp.persist(&path).map_err(|e| fail(e.error))?;
    Ok(())
}

fn prepare(args: PrepareArgs) -> anyhow::Result<ExitCode> {
    let start = Instant::now();
    check_name(&args.name)?;
    let tokenizer = Tokenizer::parse(&args.tokenizer).map_err(|e| anyhow!("--tokenizer: {e}"))?;
    let mut total_bytes = 0u64;
    for input in &args.inputs {
        let m = std::fs::metadata(input).map_err(|e| {
            anyhow!(
                "{}: cannot read it: {e}\n  fix: pass existing text files",
                input.display()
            )
        })?;
        if m.is_dir() {
            bail!(
                "{}: is a folder\n  fix: pass its text files (e.g. {}/*.txt)",
                input.display(),
                input.display()
            );
        }
        total_bytes += m.len();
    }
    let created = !args.out.exists();
    check_out(&args.out)?;
    let width = Width::for_vocab(tokenizer.vocab());
    let shard_tokens = args.shard_tokens as usize;
    let mut train = Sharder::new(&args.name, "train", shard_tokens);
    let mut val = Sharder::new(&args.name, "val", shard_tokens);
    let mut written: Vec<PathBuf> = Vec::new();
    let bar = ProgressBar::new(total_bytes);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {bytes}/{total_bytes} tokenized  {msg}")
            .expect("a valid template"),
    );
    let out = args.out.clone();
    let mut sink = |name: &str, tokens: &[u32]| -> anyhow::Result<()> {
        write_atomically(&out, name, tokens, width)?;
        written.push(out.join(name));
        Ok(())
    };
    let result = (|| -> anyhow::Result<(Vec<ShardEntry>, u64, u64)> {
        let (mut n_train, mut n_val) = (0u64, 0u64);
        for input in &args.inputs {
            let shown = input.display().to_string();
            bar.set_message(shown.clone());
            let bytes = std::fs::read(input).map_err(|e| {
                anyhow!("{shown}: cannot read it: {e}\n  fix: pass readable text files")
            })?;
            // The encoding rule, a .jsonl file's documents and the refusal of an input with no
            // text are the run's too (tessera_runtime::data::text).
            let ids = text::tokens_to_prepare(&shown, &bytes, &tokenizer)?;
            let v = val_count(ids.len(), args.val_fraction);
            val.push(&ids[..v], &mut sink)?;
            train.push(&ids[v..], &mut sink)?;
            n_val += v as u64;
            n_train += (ids.len() - v) as u64;
            bar.inc(bytes.len() as u64);
        }
        if n_train == 0 {
            bail!(
                "{}: the inputs hold no tokens to train on\n  fix: pass text files with text in them",
                args.inputs[0].display()
            );
        }
        if args.val_fraction > 0.0 && n_val == 0 {
            bail!(
                "--val-fraction {}: the validation split would be empty ({n_train} tokens in all, and the first {} of each input rounds to 0)\n  fix: pass more text, a larger --val-fraction, or --val-fraction 0",
                args.val_fraction,
                args.val_fraction
            );
        }
        let mut shards = val.finish(&mut sink)?;
        shards.extend(train.finish(&mut sink)?);
        Ok((shards, n_train, n_val))
    })();
    bar.finish_and_clear();
    let (shards, n_train, n_val) = match result {
        Ok(r) => r,
        Err(e) => {
            for p in &written {
                std::fs::remove_file(p).ok();
            }
            if created {
                // Only if it is empty: nothing but what this prepare wrote is removed.
                std::fs::remove_dir(&args.out).ok();
            }
            return Err(e);
        }
    };
    let meta = DataMeta {
        format: META_FORMAT.into(),
        version: 1,
        tokenizer: TokenizerRef::of(&tokenizer),
        vocab: tokenizer.vocab(),
        separator: tokenizer.separator(),
        token_bytes: width.bytes() as u32,
        shards,
    };
    let json = serde_json::to_string_pretty(&meta).expect("serializable") + "\n";
    write_output(&args.out.join(META_FILE), json.as_bytes())?;
    let count = |split: &str| match meta.shards.iter().filter(|s| s.split == split).count() {
        1 => "1 shard".to_string(),
        n => format!("{n} shards"),
    };
    let mut stdout = std::io::stdout().lock();
    writeln!(
        stdout,
        "wrote {n_train} training tokens in {} and {n_val} validation tokens in {} to {} ({} tokenizer, vocab {}, {} tokens) in {:.1} s",
        count("train"),
        count("val"),
        args.out.display(),
        tokenizer.name(),
        tokenizer.vocab(),
        width.name(),
        start.elapsed().as_secs_f64()
    )?;
    Ok(ExitCode::SUCCESS)
}
