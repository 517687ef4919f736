//! Reading a corpus from what `--data` names: a file, a folder of shards, or a glob pattern.
//!
//! The rule for a single file (`DataFormat::Auto`):
//! - `.bin` whose first int32 is one of llm.c's magics (20240520, 20240801): an llm.c shard,
//!   checked as one (header, version, token count against the file's size);
//! - any other `.bin`: nanoGPT's headerless uint16 tokens; `.u32`: headerless uint32 tokens;
//! - anything else: UTF-8 text, tokenized at load (bytes unless a tokenizer is given).
//!
//! `--data-format llmc|nanogpt|text` forces one reading (`llmc` refuses a file without the
//! magic instead of reading it as headerless tokens). A folder's `.bin`/`.u32` files, sorted by
//! name, are the corpus; those named like llm.c's validation shards (`*_val_*`, `*_val.bin`)
//! are the validation split, the others the training set. A glob pattern's matches are read
//! the same way. Token files are memory-mapped: nothing is read whole. Text is read by
//! `data::text`'s rule, as `tessera data prepare` reads it.
//!
//! A token file beside a `tessera-data.json` is read as that record says: the record is
//! checked against the files (`DataMeta::check`), and the corpus takes its tokenizer and
//! vocabulary. A corpus whose files were made by two different tokenizers (text read with one,
//! folders prepared with another) is refused.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::corpus::{Backing, Part, PartKind, Store, Tokens};
use super::meta::{split_of, DataMeta, Split, TokenizerRef};
use super::shard::{self, Width};
use super::text;
use super::tokenizer::Tokenizer;
use super::DataError;

/// How token files are read (`--data-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum DataFormat {
    /// `.bin` starting with llm.c's magic: a shard; other `.bin`: headerless uint16 (nanoGPT);
    /// `.u32`: headerless uint32; anything else: UTF-8 text.
    #[default]
    Auto,
    /// llm.c shards only (a file without the magic is refused).
    Llmc,
    /// Headerless tokens: uint16, or uint32 for `.u32`.
    Nanogpt,
    /// UTF-8 text, tokenized with --tokenizer.
    Text,
}

impl DataFormat {
    pub fn name(self) -> &'static str {
        match self {
            DataFormat::Auto => "auto",
            DataFormat::Llmc => "llmc",
            DataFormat::Nanogpt => "nanogpt",
            DataFormat::Text => "text",
        }
    }
}

/// How to read a corpus.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    pub format: DataFormat,
    /// The tokenizer of text files [default: bytes].
    pub tokenizer: Option<Tokenizer>,
}

/// A training corpus, its validation split if it has one, and its folder's
/// `tessera-data.json` if it has one.
#[derive(Debug, Clone)]
pub struct DataSet {
    pub train: Tokens,
    pub val: Option<Tokens>,
    pub meta: Option<DataMeta>,
}

/// The most bytes read from a data source that is not a regular file (a FIFO, a device such
/// as /dev/zero): its size is not known in advance, so the read stops here.
pub const MAX_STREAM_BYTES: u64 = 1 << 30;

/// Reads anything that is not a regular file up to [`MAX_STREAM_BYTES`].
fn read_bounded(file: std::fs::File) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    file.take(MAX_STREAM_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_STREAM_BYTES {
        return Err(std::io::Error::other(format!(
            "more than {} MiB from a stream that is not a regular file",
            MAX_STREAM_BYTES >> 20
        )));
    }
    Ok(bytes)
}

fn has_glob_chars(s: &str) -> bool {
    s.contains(['*', '?', '['])
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map_or(String::new(), |n| n.to_string_lossy().into_owned())
}

fn extension(p: &Path) -> &str {
    p.extension().and_then(|e| e.to_str()).unwrap_or("")
}

/// What a path names.
enum Named {
    File(PathBuf),
    /// A folder's token files, or a glob's matches, sorted by name.
    Many {
        files: Vec<PathBuf>,
        folder: Option<PathBuf>,
    },
}

/// A path that exists is a file or a folder; one that does not and has `*`, `?` or `[` is a
/// glob pattern.
fn resolve(path: &Path) -> Result<Named, DataError> {
    let shown = path.display().to_string();
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => {
            let entries = std::fs::read_dir(path).map_err(|source| DataError::Read {
                path: shown.clone(),
                source,
            })?;
            let mut files: Vec<PathBuf> = entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| {
                    !file_name(p).starts_with('.')
                        && matches!(extension(p), "bin" | "u32")
                        && p.is_file()
                })
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(DataError::Invalid {
                    path: shown,
                    problem: "a folder with no token files (.bin or .u32) in it".into(),
                    fix: "pass a folder of llm.c shards (`tessera data prepare` writes one), a file, or a glob pattern such as 'dir/*_train_*.bin' (quoted)".into(),
                });
            }
            Ok(Named::Many {
                files,
                folder: Some(path.to_path_buf()),
            })
        }
        Ok(_) => Ok(Named::File(path.to_path_buf())),
        Err(source) if !has_glob_chars(&shown) => Err(DataError::Read {
            path: shown,
            source,
        }),
        Err(_) => {
            let matches = glob::glob(&shown).map_err(|e| DataError::Invalid {
                path: shown.clone(),
                problem: format!("not a valid glob pattern: {e}"),
                fix: "pass a file, a folder, or a pattern such as 'dir/*_train_*.bin'".into(),
            })?;
            let mut files: Vec<PathBuf> = matches
                .filter_map(Result::ok)
                .filter(|p| p.is_file())
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(DataError::Invalid {
                    path: shown,
                    problem: "no file matches this pattern".into(),
                    fix: "check the pattern (quote it, so that the shell passes it on)".into(),
                });
            }
            Ok(Named::Many {
                files,
                folder: None,
            })
        }
    }
}

/// Opens one file as a part of a corpus.
fn open_file(path: &Path, opts: &LoadOptions) -> Result<Part, DataError> {
    let name = path.display().to_string();
    let read_error = |source| DataError::Read {
        path: name.clone(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let meta = file.metadata().map_err(read_error)?;
    let backing = if !meta.is_file() {
        Backing::Read(read_bounded(file).map_err(read_error)?)
    } else if meta.len() == 0 {
        Backing::Read(Vec::new())
    } else {
        // SAFETY: the map is read-only; tessera never writes the file, and a file changed by
        // another process during a run is outside what a training run can defend against
        // (as with llm.c's and nanoGPT's loaders, which read or map it the same way).
        Backing::Mapped(unsafe { memmap2::Mmap::map(&file) }.map_err(read_error)?)
    };
    let file_bytes = backing.bytes().len() as u64;
    let ext = extension(path);
    let kind = match opts.format {
        DataFormat::Text => PartKind::Text,
        DataFormat::Llmc => PartKind::Llmc,
        DataFormat::Nanogpt => PartKind::Headerless,
        DataFormat::Auto => match ext {
            "bin" if shard::has_magic(backing.bytes()) => PartKind::Llmc,
            "bin" | "u32" => PartKind::Headerless,
            _ => PartKind::Text,
        },
    };
    let invalid = |problem: String, fix: &str| DataError::Invalid {
        path: name.clone(),
        problem,
        fix: fix.into(),
    };
    let store = match kind {
        PartKind::Text => {
            // As `tessera data prepare` reads it: the encoding rule, a .jsonl file's
            // documents, and no text refused (data::text).
            let tokenizer = opts.tokenizer.as_ref().unwrap_or(&Tokenizer::Bytes);
            let ids = text::tokens_to_run(&name, backing.bytes(), tokenizer)?;
            Store::Memory(Arc::new(ids))
        }
        PartKind::Llmc => {
            let h = shard::parse_header(backing.bytes(), file_bytes)
                .map_err(|(problem, fix)| invalid(problem, &fix))?;
            Store::File {
                bytes: Arc::new(backing),
                offset: shard::HEADER_BYTES,
                width: h.width,
            }
        }
        PartKind::Headerless => {
            let width = if ext == "u32" { Width::U32 } else { Width::U16 };
            let w = width.bytes() as u64;
            if !file_bytes.is_multiple_of(w) {
                return Err(invalid(
                    format!(
                        "{file_bytes} bytes is not a whole number of {w}-byte tokens (truncated?)"
                    ),
                    "re-create the token file",
                ));
            }
            Store::File {
                bytes: Arc::new(backing),
                offset: 0,
                width,
            }
        }
    };
    Ok(Part::new(name, kind, file_bytes, store))
}

/// The folder a file is in (`.` for a bare name).
fn dir_of(f: &Path) -> PathBuf {
    match f.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// The `tessera-data.json` of each folder that token files are in, checked against them
/// ([`DataMeta::check`]); `folder`: the folder named, whose token files are all of `files`.
/// Files read as text have none.
fn records(
    files: &[PathBuf],
    folder: Option<&Path>,
    opts: &LoadOptions,
) -> Result<Vec<(PathBuf, DataMeta)>, DataError> {
    if opts.format == DataFormat::Text {
        return Ok(Vec::new());
    }
    let mut dirs: Vec<(PathBuf, Vec<PathBuf>)> = Vec::new();
    for f in files
        .iter()
        .filter(|f| matches!(extension(f), "bin" | "u32"))
    {
        let dir = dir_of(f);
        match dirs.iter_mut().find(|(d, _)| *d == dir) {
            Some((_, fs)) => fs.push(f.clone()),
            None => dirs.push((dir, vec![f.clone()])),
        }
    }
    let mut out = Vec::new();
    for (dir, fs) in dirs {
        if let Some(meta) = DataMeta::read(&dir)? {
            meta.check(&dir.join(super::META_FILE), &fs, folder.is_some())?;
            out.push((dir, meta));
        }
    }
    Ok(out)
}

/// The corpus of `files`, labelled with its tokenizer: text is made by the options'
/// tokenizer (bytes by default), a token file by its folder's record's; token files without
/// one are of no known tokenizer. Tokens of two different tokenizers are refused.
fn corpus(
    files: &[PathBuf],
    source: String,
    opts: &LoadOptions,
    records: &[(PathBuf, DataMeta)],
) -> Result<Tokens, DataError> {
    let parts = files
        .iter()
        .map(|f| open_file(f, opts))
        .collect::<Result<Vec<Part>, DataError>>()?;
    let text_tokenizer = TokenizerRef::of(opts.tokenizer.as_ref().unwrap_or(&Tokenizer::Bytes));
    let mut known: Option<(TokenizerRef, String)> = None;
    let mut unknown = false;
    let mut declared_vocab: Option<u64> = None;
    for (f, p) in files.iter().zip(&parts) {
        let record = records.iter().find(|(d, _)| *d == dir_of(f));
        let (t, said) = match (p.kind, record) {
            (PartKind::Text, _) => (
                text_tokenizer.clone(),
                format!(
                    "{} is text read with {}",
                    f.display(),
                    text_tokenizer.describe()
                ),
            ),
            (_, Some((dir, m))) => {
                declared_vocab = declared_vocab.max(Some(m.vocab));
                (
                    m.tokenizer.clone(),
                    format!(
                        "{} was prepared with {}",
                        dir.display(),
                        m.tokenizer.describe()
                    ),
                )
            }
            (_, None) => {
                unknown = true;
                continue;
            }
        };
        match &known {
            None => known = Some((t, said)),
            Some((k, first)) if !k.same_as(&t) => {
                return Err(DataError::Invalid {
                    path: source,
                    problem: format!("mixes the tokens of two tokenizers: {first}, and {said}"),
                    fix: "pass the data of one tokenizer (a folder, or a pattern within one prepared folder), or prepare the text again with one tokenizer".into(),
                });
            }
            Some(_) => {}
        }
    }
    Ok(Tokens {
        parts,
        source,
        declared_vocab,
        tokenizer: if unknown { None } else { known.map(|k| k.0) },
    })
}

/// A validation corpus with no token is refused, naming its files.
fn non_empty_val(val: Tokens) -> Result<Tokens, DataError> {
    if !val.is_empty() {
        return Ok(val);
    }
    let files: Vec<&str> = val.parts.iter().map(|p| p.path.as_str()).collect();
    Err(DataError::Invalid {
        path: files.join(", "),
        problem: "the validation split is empty (0 tokens)".into(),
        fix: "prepare the data with a --val-fraction above 0 on more text, pass --val-data with tokens in it, or remove the empty val shards".into(),
    })
}

impl DataSet {
    /// The corpus `path` names (see the module's rule), with its validation split when it is
    /// a folder or pattern with val shards. The `tessera-data.json` of each folder read is
    /// checked against its token files.
    pub fn open(path: &Path, opts: &LoadOptions) -> Result<DataSet, DataError> {
        let shown = path.display().to_string();
        match resolve(path)? {
            Named::File(f) => {
                let records = records(std::slice::from_ref(&f), None, opts)?;
                Ok(DataSet {
                    train: corpus(&[f], shown, opts, &records)?,
                    val: None,
                    meta: None,
                })
            }
            Named::Many { files, folder } => {
                let records = records(&files, folder.as_deref(), opts)?;
                let meta = match &folder {
                    Some(_) => records.first().map(|(_, m)| m.clone()),
                    None => None,
                };
                let (val, train): (Vec<PathBuf>, Vec<PathBuf>) = files
                    .into_iter()
                    .partition(|f| split_of(&file_name(f)) == Split::Val);
                if train.is_empty() {
                    return Err(DataError::Invalid {
                        path: shown,
                        problem: format!(
                            "holds only validation files ({}), no training ones",
                            val.iter().map(|f| file_name(f)).collect::<Vec<_>>().join(", ")
                        ),
                        fix: "pass the folder or pattern of the training shards (named *_train_*.bin by llm.c and `tessera data prepare`) as --data, and these as --val-data".into(),
                    });
                }
                let train = corpus(&train, shown.clone(), opts, &records)?;
                let val = if val.is_empty() {
                    None
                } else {
                    Some(non_empty_val(corpus(
                        &val,
                        format!("{shown} (val)"),
                        opts,
                        &records,
                    )?)?)
                };
                Ok(DataSet { train, val, meta })
            }
        }
    }
}

impl Tokens {
    /// Loads the training corpus `path` names, by the module's rule, text as byte tokens.
    pub fn load(path: &Path) -> Result<Tokens, DataError> {
        Ok(DataSet::open(path, &LoadOptions::default())?.train)
    }

    /// A validation corpus (`--val-data`): a file, a pattern's matches, or a folder's val
    /// shards (all its token files if none is named as one). An empty one is refused.
    pub fn open_val(path: &Path, opts: &LoadOptions) -> Result<Tokens, DataError> {
        let shown = path.display().to_string();
        let (files, records) = match resolve(path)? {
            Named::File(f) => {
                let records = records(std::slice::from_ref(&f), None, opts)?;
                (vec![f], records)
            }
            Named::Many { files, folder } => {
                let records = records(&files, folder.as_deref(), opts)?;
                let val: Vec<PathBuf> = files
                    .iter()
                    .filter(|f| split_of(&file_name(f)) == Split::Val)
                    .cloned()
                    .collect();
                match folder {
                    Some(_) if !val.is_empty() => (val, records),
                    _ => (files, records),
                }
            }
        };
        non_empty_val(corpus(&files, shown, opts, &records)?)
    }
}
