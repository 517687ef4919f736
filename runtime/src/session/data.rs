//! The data a run reads: `--data`, `--val-data`, `--tokenizer` and `--data-format`, resolved.
//! The formats, the detection rule and the memory mapping live in `crate::data`
//! (docs/data.md); this file turns the options into a loaded corpus, or an error that names the
//! file. Without `data` the run trains on the bundled text, built into the binary.

use std::path::{Path, PathBuf};

use crate::data::{
    DataFormat, DataSet, LoadOptions, PartKind, Tokenizer, TokenizerRef, Tokens, META_FILE,
};

use super::{refused, Observer, SessionError};

/// The text the default run trains on, by its name in the repository.
pub const BUNDLED_DATA_NAME: &str = "examples/data/parallelism.txt";

/// Its bytes, built into the binary: the default works offline, from any working directory and
/// from an installed binary.
pub const BUNDLED_DATA: &str = include_str!("../../../examples/data/parallelism.txt");

/// Where a run's tokens come from (`tessera run`'s data flags, with the `cli` feature).
#[derive(Debug, Clone, Default)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct DataOptions {
    /// Training data: UTF-8 text, a token file (an llm.c shard, nanoGPT's headerless uint16
    /// .bin, a .u32), a folder of shards (its *_val_* shards are the validation data) or a
    /// quoted glob pattern [default: examples/data/parallelism.txt, built into tessera]
    #[cfg_attr(feature = "cli", arg(long))]
    pub data: Option<PathBuf>,
    /// Validation data, in any form --data takes [default: the --data folder's val shards]
    #[cfg_attr(feature = "cli", arg(long))]
    pub val_data: Option<PathBuf>,
    /// The tokenizer of text data: bytes, gpt2, or the path of a Hugging Face tokenizer.json
    /// [default: bytes, or the one a prepared folder was made with]
    #[cfg_attr(feature = "cli", arg(long))]
    pub tokenizer: Option<String>,
    /// How data files are read: auto (by extension and llm.c's magic; docs/data.md), llmc,
    /// nanogpt or text [default: auto]
    #[cfg_attr(
        feature = "cli",
        arg(long = "data-format", value_name = "DATA_FORMAT", value_enum)
    )]
    pub format: Option<DataFormat>,
}

/// The corpora a run reads.
pub struct Loaded {
    pub train: Tokens,
    /// The validation corpus (`--val-data`, or the `--data` folder's val shards).
    pub val: Option<Tokens>,
}

/// Whether `path` may be a glob pattern the loader expands.
fn is_pattern(path: &Path) -> bool {
    path.to_string_lossy().contains(['*', '?', '['])
}

impl DataOptions {
    /// Whether the run trains on the bundled text (no `--data`).
    pub fn bundled(&self) -> bool {
        self.data.is_none()
    }

    /// Refuses, before anything starts, a data path that does not exist (and is no pattern),
    /// a tokenizer file that does not, and a --data-format with no data file to read.
    pub fn check(&self) -> Result<(), SessionError> {
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
                return Err(refused(
                    format!("{flag} {}: cannot read it: {e}{cwd}", path.display()),
                    fix,
                ));
            }
        }
        if let (Some(f), None, None) = (self.format, &self.data, &self.val_data) {
            return Err(refused(
                format!("--data-format {}: says how --data and --val-data files are read, and neither is given (the bundled text is read as text), so it would be ignored", f.name()),
                "drop --data-format, or add --data",
            ));
        }
        if let Some(t) = self
            .tokenizer
            .as_deref()
            .filter(|t| !matches!(*t, "bytes" | "gpt2" | "r50k_base"))
        {
            if let Err(e) = std::fs::metadata(t) {
                return Err(refused(
                    format!("--tokenizer {t}: cannot read it: {e}"),
                    "pass bytes, gpt2, or the path of a Hugging Face tokenizer.json",
                ));
            }
        }
        Ok(())
    }

    /// Loads the training data (and the validation data, if any), and says what was loaded
    /// (the bundled text is announced with the run's first line). `run_bytes`: the host
    /// memory the run itself needs; text is tokenized into memory (4 bytes per token besides
    /// the text), token files are mapped and need none.
    pub fn load(&self, run_bytes: f64, obs: &mut dyn Observer) -> Result<Loaded, SessionError> {
        let tokenizer = match self.tokenizer.as_deref() {
            None => None,
            Some(spec) => Some(Tokenizer::parse(spec).map_err(|e| SessionError::Data {
                context: "--tokenizer".into(),
                source: e,
            })?),
        };
        let opts = LoadOptions {
            format: self.format.unwrap_or(DataFormat::Auto),
            tokenizer: tokenizer.clone(),
        };
        for path in [&self.data, &self.val_data].into_iter().flatten() {
            check_memory(path, opts.format, run_bytes)?;
        }
        let (train, val, meta) = match &self.data {
            None => {
                let tok = tokenizer.clone().unwrap_or(Tokenizer::Bytes);
                let ids = tok.encode(BUNDLED_DATA)?;
                let mut t = Tokens::from_ids(ids, BUNDLED_DATA_NAME);
                t.tokenizer = Some(TokenizerRef::of(&tok));
                (t, None, None)
            }
            Some(path) => {
                let set = DataSet::open(path, &opts).map_err(|e| SessionError::Data {
                    context: "cannot load the training data (--data)".into(),
                    source: e,
                })?;
                (set.train, set.val, set.meta)
            }
        };
        if let (Some(tok), Some(path)) = (&tokenizer, &self.data) {
            let all_tokens = train.parts().iter().all(|p| p.kind != PartKind::Text);
            match &meta {
                Some(m) if !m.tokenizer.matches(tok) => {
                    // The same tokenizer.json path with other contents: say that the file
                    // changed, not that another tokenizer was passed.
                    if let (Tokenizer::HuggingFace { path: now, sha256, .. }, Some(was)) =
                        (tok, m.tokenizer.path.as_deref())
                    {
                        let same = std::fs::canonicalize(now).ok().as_deref() == Some(Path::new(was));
                        if same {
                            return Err(refused(
                                format!(
                                    "--tokenizer {}: this file has changed since {} was prepared with it (SHA-256 now {sha256}, recorded {} in {META_FILE})",
                                    now.display(),
                                    path.display(),
                                    m.tokenizer.sha256.as_deref().unwrap_or("none")
                                ),
                                "restore the tokenizer.json the data was prepared with, or prepare the data again with this one",
                            ));
                        }
                    }
                    return Err(refused(
                        format!(
                            "--tokenizer {}: {} was prepared with the {} tokenizer ({META_FILE})",
                            tok.name(),
                            path.display(),
                            m.tokenizer.path.as_deref().unwrap_or(&m.tokenizer.name)
                        ),
                        "drop --tokenizer, or pass the one the data was prepared with",
                    ))
                }
                None if all_tokens => {
                    return Err(refused(
                        format!(
                            "--tokenizer {}: {} holds token ids already (the tokenizer reads text), so it would be ignored",
                            tok.name(),
                            path.display()
                        ),
                        "drop --tokenizer, or pass text data",
                    ))
                }
                _ => {}
            }
        }
        let val = match &self.val_data {
            None => val,
            Some(path) => {
                // Text validation data is read with the training data's tokenizer when
                // --tokenizer does not say (a prepared folder's: the one --tokenizer's help
                // names as the default).
                let mut val_opts = opts.clone();
                if let (None, Some(made_by)) = (&tokenizer, &train.tokenizer) {
                    if is_text(path, opts.format) && made_by.name != "bytes" {
                        let record = Path::new(&train.source);
                        val_opts.tokenizer =
                            Some(made_by.load(record).map_err(|e| SessionError::Data {
                                context: "cannot load the training data's tokenizer to read the text of --val-data".into(),
                                source: e,
                            })?);
                    }
                }
                let v = Tokens::open_val(path, &val_opts).map_err(|e| SessionError::Data {
                    context: "cannot load the validation data (--val-data)".into(),
                    source: e,
                })?;
                same_tokenizer(&train, &v, path)?;
                Some(v)
            }
        };
        if !self.bundled() {
            obs.say(&format!("data: {}", train.describe()));
        }
        if let Some(v) = &val {
            obs.say(&format!("validation data: {}", v.describe()));
        }
        Ok(Loaded { train, val })
    }
}

/// Whether `path` is read as text: a regular file that is not a token file (a folder or a
/// pattern is read by its token files).
fn is_text(path: &Path, format: DataFormat) -> bool {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    path.is_file()
        && (format == DataFormat::Text
            || (format == DataFormat::Auto && !matches!(ext, "bin" | "u32")))
}

/// Refuses validation data made by another tokenizer than the training data, where both are
/// known: a loss on another tokenizer's ids measures nothing.
fn same_tokenizer(train: &Tokens, val: &Tokens, val_path: &Path) -> Result<(), SessionError> {
    let (Some(t), Some(v)) = (&train.tokenizer, &val.tokenizer) else {
        return Ok(());
    };
    if t.same_as(v) {
        return Ok(());
    }
    Err(refused(
        format!(
            "--val-data {}: its tokens are made by {}, and the training data's ({}) by {}: the validation loss would be measured on another tokenizer's ids",
            val_path.display(),
            v.describe(),
            train.source,
            t.describe()
        ),
        "pass validation data made with the training data's tokenizer (`tessera data prepare --tokenizer`), or, where the data is text, --tokenizer to read it with the other one",
    ))
}

/// Text is held in memory as u32 tokens: refuses a text file that would not fit beside the run
/// (a stream's size is unknown, and it is bounded by the loader).
fn check_memory(path: &Path, format: DataFormat, run_bytes: f64) -> Result<(), SessionError> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let text =
        format == DataFormat::Text || (format == DataFormat::Auto && !matches!(ext, "bin" | "u32"));
    let (Ok(m), Some(have)) = (
        std::fs::metadata(path),
        crate::calibrate::available_memory_bytes(),
    ) else {
        return Ok(());
    };
    // The text's bytes and up to one u32 token per byte.
    let need_data = m.len() as f64 * 5.0;
    if text && m.is_file() && run_bytes + need_data > have {
        let bytes = tessera_planner::units::bytes;
        return Err(refused(
            format!(
                "{}: loading this text file of {} needs about {} of host memory besides the {} of the run, and {} is available",
                path.display(),
                bytes(m.len() as f64),
                bytes(need_data),
                bytes(run_bytes),
                bytes(have)
            ),
            "tokenize it once with `tessera data prepare` (shards are memory-mapped), or train on a slice of it",
        ));
    }
    Ok(())
}
