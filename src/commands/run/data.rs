//! `tessera run`'s data flags: `--data`, `--val-data`, `--tokenizer` and `--data-format`. The
//! formats, the detection rule and the memory mapping live in `tessera_runtime::data`
//! (docs/data.md); this file turns the flags into a loaded corpus, or an error that names the
//! file. Without `--data` the run trains on the bundled text, built into the binary.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail};
use clap::{Args, ValueEnum};
use tessera_runtime::data::{
    DataFormat, DataSet, LoadOptions, PartKind, Tokenizer, Tokens, META_FILE,
};

use crate::files::{named, Named};

/// The text the default run trains on, by its name in the repository.
pub const BUNDLED_DATA_NAME: &str = "examples/data/parallelism.txt";

/// Its bytes, built into the binary: the default works offline, from any working directory and
/// from an installed binary.
pub const BUNDLED_DATA: &str = include_str!("../../../examples/data/parallelism.txt");

/// `--data-format`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Debug)]
pub enum FormatArg {
    /// `.bin` starting with llm.c's magic: a shard; other `.bin`: headerless uint16 (nanoGPT);
    /// `.u32`: headerless uint32; anything else: UTF-8 text.
    Auto,
    /// llm.c shards only (a file without the magic is refused).
    Llmc,
    /// Headerless tokens: uint16, or uint32 for `.u32`.
    Nanogpt,
    /// UTF-8 text, tokenized with --tokenizer.
    Text,
}

impl FormatArg {
    fn format(self) -> DataFormat {
        match self {
            FormatArg::Auto => DataFormat::Auto,
            FormatArg::Llmc => DataFormat::Llmc,
            FormatArg::Nanogpt => DataFormat::Nanogpt,
            FormatArg::Text => DataFormat::Text,
        }
    }
}

#[derive(Args, Clone, Default)]
pub struct DataArgs {
    /// Training data: UTF-8 text, a token file (an llm.c shard, nanoGPT's headerless uint16
    /// .bin, a .u32), a folder of shards (its *_val_* shards are the validation data) or a
    /// quoted glob pattern [default: examples/data/parallelism.txt, built into tessera]
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Validation data, in any form --data takes [default: the --data folder's val shards]
    #[arg(long)]
    pub val_data: Option<PathBuf>,
    /// The tokenizer of text data: bytes, gpt2, or the path of a Hugging Face tokenizer.json
    /// [default: bytes, or the one a prepared folder was made with]
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// How data files are read: auto (by extension and llm.c's magic; docs/data.md), llmc,
    /// nanogpt or text [default: auto]
    #[arg(long, value_enum)]
    pub data_format: Option<FormatArg>,
}

/// The corpora a run reads.
pub struct Loaded {
    pub train: Tokens,
    /// The validation corpus (`--val-data`, or the `--data` folder's val shards).
    pub val: Option<Tokens>,
}

impl Loaded {
    /// Says what was loaded (the bundled text is announced with the run's first line).
    pub fn announce(&self, bundled: bool) {
        if !bundled {
            println!("data: {}", self.train.describe());
        }
        if let Some(v) = &self.val {
            println!("validation data: {}", v.describe());
        }
    }
}

/// Whether `path` may be a glob pattern the loader expands.
fn is_pattern(path: &Path) -> bool {
    path.to_string_lossy().contains(['*', '?', '['])
}

impl DataArgs {
    /// The data files named on the command line that exist, as inputs no output may replace.
    pub fn inputs(&self) -> Vec<Named<'_>> {
        [("--data", &self.data), ("--val-data", &self.val_data)]
            .into_iter()
            .filter_map(|(flag, p)| p.as_deref().map(|p| named(flag, p)))
            .collect()
    }

    /// Refuses, before anything starts, a data path that does not exist (and is no pattern),
    /// a tokenizer file that does not, and a --data-format with no data file to read.
    pub fn check(&self) -> anyhow::Result<()> {
        for (flag, path) in [("--data", &self.data), ("--val-data", &self.val_data)] {
            let Some(path) = path else { continue };
            if let Err(e) = std::fs::metadata(path) {
                if is_pattern(path) {
                    continue;
                }
                let cwd = std::env::current_dir()
                    .map(|d| format!(" (relative paths start in {})", d.display()))
                    .unwrap_or_default();
                let fix = if flag == "--data" {
                    format!("pass an existing file, folder or pattern, or leave --data out to train on the bundled {BUNDLED_DATA_NAME}")
                } else {
                    "pass an existing file, folder or pattern".to_string()
                };
                bail!(
                    "{flag} {}: cannot read it: {e}{cwd}\n  fix: {fix}",
                    path.display()
                );
            }
        }
        if let (Some(f), None, None) = (self.data_format, &self.data, &self.val_data) {
            bail!(
                "--data-format {}: says how --data and --val-data files are read, and neither is given (the bundled text is read as text), so it would be ignored\n  fix: drop --data-format, or add --data",
                f.format().name()
            );
        }
        if let Some(t) = self
            .tokenizer
            .as_deref()
            .filter(|t| !matches!(*t, "bytes" | "gpt2" | "r50k_base"))
        {
            if let Err(e) = std::fs::metadata(t) {
                bail!("--tokenizer {t}: cannot read it: {e}\n  fix: pass bytes, gpt2, or the path of a Hugging Face tokenizer.json");
            }
        }
        Ok(())
    }

    /// Loads the training data (and the validation data, if any). `run_bytes`: the host
    /// memory the run itself needs; text is tokenized into memory (4 bytes per token besides
    /// the text), token files are mapped and need none.
    pub fn load(&self, run_bytes: f64) -> anyhow::Result<Loaded> {
        let tokenizer = match self.tokenizer.as_deref() {
            None => None,
            Some(spec) => Some(Tokenizer::parse(spec).map_err(|e| anyhow!("--tokenizer: {e}"))?),
        };
        let opts = LoadOptions {
            format: self.data_format.map_or(DataFormat::Auto, FormatArg::format),
            tokenizer: tokenizer.clone(),
        };
        for path in [&self.data, &self.val_data].into_iter().flatten() {
            self.check_memory(path, opts.format, run_bytes)?;
        }
        let (train, val, meta) = match &self.data {
            None => {
                let tok = tokenizer.clone().unwrap_or(Tokenizer::Bytes);
                let ids = tok.encode(BUNDLED_DATA)?;
                (Tokens::from_ids(ids, BUNDLED_DATA_NAME), None, None)
            }
            Some(path) => {
                let set = DataSet::open(path, &opts)
                    .map_err(|e| anyhow!("cannot load the training data (--data): {e}"))?;
                (set.train, set.val, set.meta)
            }
        };
        if let (Some(tok), Some(path)) = (&tokenizer, &self.data) {
            let all_tokens = train.parts().iter().all(|p| p.kind != PartKind::Text);
            match &meta {
                Some(m) if !m.tokenizer.matches(tok) => bail!(
                    "--tokenizer {}: {} was prepared with the {} tokenizer ({META_FILE})\n  fix: drop --tokenizer, or pass the one the data was prepared with",
                    tok.name(),
                    path.display(),
                    m.tokenizer.path.as_deref().unwrap_or(&m.tokenizer.name)
                ),
                None if all_tokens => bail!(
                    "--tokenizer {}: {} holds token ids already (the tokenizer reads text), so it would be ignored\n  fix: drop --tokenizer, or pass text data",
                    tok.name(),
                    path.display()
                ),
                _ => {}
            }
        }
        let val = match &self.val_data {
            None => val,
            Some(path) => Some(
                Tokens::open_val(path, &opts)
                    .map_err(|e| anyhow!("cannot load the validation data (--val-data): {e}"))?,
            ),
        };
        Ok(Loaded { train, val })
    }

    /// Text is held in memory as u32 tokens: refuses a text file that would not fit beside
    /// the run (a stream's size is unknown, and it is bounded by the loader).
    fn check_memory(&self, path: &Path, format: DataFormat, run_bytes: f64) -> anyhow::Result<()> {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let text = format == DataFormat::Text
            || (format == DataFormat::Auto && !matches!(ext, "bin" | "u32"));
        let (Ok(m), Some(have)) = (
            std::fs::metadata(path),
            tessera_runtime::calibrate::available_memory_bytes(),
        ) else {
            return Ok(());
        };
        // The text's bytes and up to one u32 token per byte.
        let need_data = m.len() as f64 * 5.0;
        if text && m.is_file() && run_bytes + need_data > have {
            bail!(
                "{}: loading this text file of {} needs about {} of host memory besides the {} of the run, and {} is available\n  fix: tokenize it once with `tessera data prepare` (shards are memory-mapped), or train on a slice of it",
                path.display(),
                tessera_planner::units::bytes(m.len() as f64),
                tessera_planner::units::bytes(need_data),
                tessera_planner::units::bytes(run_bytes),
                tessera_planner::units::bytes(have)
            );
        }
        Ok(())
    }
}
