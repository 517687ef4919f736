//! `tessera-data.json`: what `tessera data prepare` wrote into a folder (the tokenizer, its
//! vocabulary, the shards), so that `tessera run` can check the model's vocabulary against it
//! and `tessera sample` can decode with the same tokenizer.
//!
//! A record is checked before its shards are read ([`DataMeta::check`]): against itself (a
//! tokenizer tessera knows, the vocabulary and separator of a named tokenizer, a token width
//! that holds the vocabulary) and against the token files beside it (each listed shard there
//! when the folder is read, each file read listed, its split as its name says, its width and
//! token count as its header says). Token ids at or above the vocabulary it declares are found
//! by the run's check of the ids against the model ([`super::Tokens::check`]), in the same scan.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::shard::{self, Width};
use super::tokenizer::{sha256_hex, Tokenizer, GPT2_EOT, GPT2_VOCAB};
use super::DataError;

/// The file's name in a prepared folder.
pub const META_FILE: &str = "tessera-data.json";
/// The value of its `format` field.
pub const META_FORMAT: &str = "tessera-data";

/// Which split a file's name puts it in, as llm.c names shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train,
    Val,
}

/// `*_val_*`, `*_val`, `val_*` (before the extension) are validation files; all else trains.
pub fn split_of(file_name: &str) -> Split {
    let stem = file_name.rsplit_once('.').map_or(file_name, |(s, _)| s);
    if stem.contains("_val_") || stem.ends_with("_val") || stem.starts_with("val_") {
        Split::Val
    } else {
        Split::Train
    }
}

/// The tokenizer a folder was prepared with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerRef {
    /// `bytes`, `gpt2`, or `tokenizer.json` (then `path` and `sha256` say which).
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

impl TokenizerRef {
    pub fn of(t: &Tokenizer) -> TokenizerRef {
        match t {
            Tokenizer::HuggingFace { path, sha256, .. } => TokenizerRef {
                name: "tokenizer.json".into(),
                path: Some(
                    std::fs::canonicalize(path)
                        .unwrap_or(path.clone())
                        .display()
                        .to_string(),
                ),
                sha256: Some(sha256.clone()),
            },
            other => TokenizerRef {
                name: other.name(),
                path: None,
                sha256: None,
            },
        }
    }

    /// The tokenizer this names, for what `record` (a file naming it, for messages) says: a
    /// tokenizer.json is loaded from its path and must still have the SHA-256 recorded.
    pub fn load(&self, record: &Path) -> Result<Tokenizer, DataError> {
        match (self.name.as_str(), &self.path) {
            ("tokenizer.json", Some(p)) => {
                let bytes = std::fs::read(p).map_err(|e| DataError::Invalid {
                    path: record.display().to_string(),
                    problem: format!("the data was tokenized with {p}, which cannot be read: {e}"),
                    fix: "put the tokenizer.json back at that path".into(),
                })?;
                let sum = sha256_hex(&bytes);
                if Some(&sum) != self.sha256.as_ref() {
                    return Err(DataError::Invalid {
                        path: record.display().to_string(),
                        problem: format!("{p} has changed since the data was tokenized with it (SHA-256 {sum}, recorded {})", self.sha256.as_deref().unwrap_or("none")),
                        fix: "restore the tokenizer.json the data was prepared with, or prepare the data again".into(),
                    });
                }
                Tokenizer::from_file(Path::new(p))
            }
            (name @ ("bytes" | "gpt2"), _) => Tokenizer::parse(name),
            (name, _) => Err(DataError::Invalid {
                path: record.display().to_string(),
                problem: format!("unknown tokenizer {name:?}"),
                fix: "prepare the data again with `tessera data prepare`".into(),
            }),
        }
    }

    /// Whether `other` names the same tokenizer (a tokenizer.json by its SHA-256, wherever
    /// it is).
    pub fn same_as(&self, other: &TokenizerRef) -> bool {
        self.name == other.name && (self.name != "tokenizer.json" || self.sha256 == other.sha256)
    }

    /// For messages: `the gpt2 tokenizer`, or `the tokenizer.json PATH (SHA-256 0123abcd…)`.
    pub fn describe(&self) -> String {
        match (&self.path, &self.sha256) {
            (Some(p), Some(sum)) => format!(
                "the {} {p} (SHA-256 {}…)",
                self.name,
                sum.get(..12).unwrap_or(sum)
            ),
            _ => format!("the {} tokenizer", self.name),
        }
    }

    /// Whether `t` is this tokenizer (a tokenizer.json by its SHA-256).
    pub fn matches(&self, t: &Tokenizer) -> bool {
        match t {
            Tokenizer::HuggingFace { sha256, .. } => self.sha256.as_ref() == Some(sha256),
            other => self.name == other.name(),
        }
    }
}

/// One shard of a prepared folder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// File name, in the folder.
    pub file: String,
    /// `train` or `val`.
    pub split: String,
    pub tokens: u64,
}

/// `tessera-data.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataMeta {
    /// Always `tessera-data`.
    pub format: String,
    /// 1.
    pub version: u32,
    pub tokenizer: TokenizerRef,
    /// Token ids are below this.
    pub vocab: u64,
    /// The token put before each document, if any.
    pub separator: Option<u32>,
    /// 2 (uint16 shards) or 4 (uint32).
    pub token_bytes: u32,
    pub shards: Vec<ShardEntry>,
}

impl DataMeta {
    /// The folder's `tessera-data.json`, if it has one.
    pub fn read(dir: &Path) -> Result<Option<DataMeta>, DataError> {
        let path = dir.join(META_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(DataError::Read {
                    path: path.display().to_string(),
                    source,
                })
            }
        };
        let invalid = |problem: String| {
            DataError::Invalid {
            path: path.display().to_string(),
            problem,
            fix: format!("prepare the folder again with `tessera data prepare`, or remove {META_FILE} to read the shards without it"),
        }
        };
        let meta: DataMeta =
            serde_json::from_str(&text).map_err(|e| invalid(format!("not a {META_FILE}: {e}")))?;
        if meta.format != META_FORMAT || meta.version != 1 {
            return Err(invalid(format!(
                "format {:?} version {}: this tessera reads {META_FORMAT:?} version 1",
                meta.format, meta.version
            )));
        }
        Ok(Some(meta))
    }

    /// Checks the record at `meta_path` against itself and against `files`, token files of
    /// its folder, field by field (the module's docs). `whole`: `files` are all the folder's
    /// token files (the folder was named), so every listed shard must be among them; otherwise
    /// (a glob pattern, one file) only the entries of `files` are checked. The refusal names
    /// the record and the field.
    pub fn check(&self, meta_path: &Path, files: &[PathBuf], whole: bool) -> Result<(), DataError> {
        let refuse = |problem: String| {
            DataError::Invalid {
            path: meta_path.display().to_string(),
            problem,
            fix: format!("prepare the folder again with `tessera data prepare` (or restore its {META_FILE}), or remove {META_FILE} to read the shards without it"),
        }
        };
        let t = &self.tokenizer;
        let (vocab, separator) = match (t.name.as_str(), &t.path, &t.sha256) {
            ("bytes", _, _) => (Some(256), Some(None)),
            ("gpt2", _, _) => (Some(GPT2_VOCAB), Some(Some(GPT2_EOT))),
            ("tokenizer.json", Some(_), Some(sum))
                if sum.len() == 64 && sum.bytes().all(|b| b.is_ascii_hexdigit()) =>
            {
                (None, None)
            }
            ("tokenizer.json", _, _) => {
                return Err(refuse(
                    "tokenizer.name is \"tokenizer.json\" without a tokenizer.path and the file's tokenizer.sha256 (64 hex digits)".into(),
                ))
            }
            (other, _, _) => {
                return Err(refuse(format!(
                    "tokenizer.name is {other:?}, which is not a tokenizer tessera prepares with (bytes, gpt2, tokenizer.json)"
                )))
            }
        };
        if let Some(v) = vocab.filter(|v| *v != self.vocab) {
            return Err(refuse(format!(
                "vocab is {}, and {} (tokenizer.name) has a vocabulary of {v}",
                self.vocab,
                t.describe()
            )));
        }
        if self.vocab == 0 || self.vocab > 1 << 32 {
            return Err(refuse(format!(
                "vocab is {}: token ids are 32-bit, so it is between 1 and 2^32",
                self.vocab
            )));
        }
        if let Some(sep) = separator.filter(|s| *s != self.separator) {
            let show = |s: Option<u32>| s.map_or("none".to_string(), |s| s.to_string());
            return Err(refuse(format!(
                "separator is {}, and {} (tokenizer.name) puts {} before each document",
                show(self.separator),
                t.describe(),
                show(sep)
            )));
        }
        if let Some(sep) = self.separator.filter(|s| u64::from(*s) >= self.vocab) {
            return Err(refuse(format!(
                "separator {sep} is not below vocab {}",
                self.vocab
            )));
        }
        let width = match self.token_bytes {
            2 if self.vocab <= 1 << 16 => Width::U16,
            4 => Width::U32,
            2 => {
                return Err(refuse(format!(
                    "token_bytes is 2, and vocab {} has ids above 65535, which need 4",
                    self.vocab
                )))
            }
            other => {
                return Err(refuse(format!(
                    "token_bytes is {other}: shards hold 2-byte (uint16) or 4-byte (uint32) tokens"
                )))
            }
        };
        let name_of = |p: &PathBuf| {
            p.file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned())
        };
        let mut listed = HashSet::new();
        for (i, e) in self.shards.iter().enumerate() {
            let plain =
                !e.file.is_empty() && !e.file.starts_with('.') && !e.file.contains(['/', '\\']);
            if !plain {
                return Err(refuse(format!(
                    "shards[{i}].file is {:?}, which is not the name of a file in the folder",
                    e.file
                )));
            }
            if !listed.insert(e.file.as_str()) {
                return Err(refuse(format!(
                    "shards[{i}].file {} is listed twice",
                    e.file
                )));
            }
            let split = match e.split.as_str() {
                "train" => Split::Train,
                "val" => Split::Val,
                other => {
                    return Err(refuse(format!(
                        "shards[{i}].split is {other:?}: \"train\" or \"val\""
                    )))
                }
            };
            if split != split_of(&e.file) {
                let named = if split == Split::Train {
                    "validation"
                } else {
                    "training"
                };
                return Err(refuse(format!(
                    "shards[{i}].split is {:?}, and the name {} makes it a {named} shard (files named *_val_* are the validation split)",
                    e.split, e.file
                )));
            }
            let Some(path) = files.iter().find(|f| name_of(f) == e.file) else {
                if whole {
                    return Err(refuse(format!(
                        "shards[{i}].file {} is not in the folder (removed or renamed?)",
                        e.file
                    )));
                }
                continue;
            };
            let Some(h) = shard_header(path)? else {
                return Err(refuse(format!(
                    "shards[{i}].file {} is not an llm.c shard (its first bytes are not the magic), and `tessera data prepare` writes only llm.c shards",
                    e.file
                )));
            };
            if h.width != width {
                return Err(refuse(format!(
                    "token_bytes is {}, and shards[{i}] {} holds {}-byte ({}) tokens",
                    self.token_bytes,
                    e.file,
                    h.width.bytes(),
                    h.width.name()
                )));
            }
            if h.tokens != e.tokens {
                return Err(refuse(format!(
                    "shards[{i}].tokens is {}, and the header of {} says {}",
                    e.tokens, e.file, h.tokens
                )));
            }
        }
        if let Some(extra) = files.iter().find(|f| !listed.contains(name_of(f).as_str())) {
            return Err(refuse(format!(
                "{} is in the folder and not listed in its shards (added by hand, or by another prepare?)",
                name_of(extra)
            )));
        }
        Ok(())
    }

    /// The tokenizer it names: a tokenizer.json is loaded from its path and must still have
    /// the SHA-256 recorded.
    pub fn tokenizer(&self, meta_path: &Path) -> Result<Tokenizer, DataError> {
        self.tokenizer.load(meta_path)
    }
}

/// The header of a token file, if it is an llm.c shard (its first four bytes are the magic);
/// a damaged header is refused, naming the file, as loading it would.
fn shard_header(path: &Path) -> Result<Option<shard::Header>, DataError> {
    use std::io::Read;
    let read_error = |source| DataError::Read {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let len = file.metadata().map_err(read_error)?.len();
    let mut head = Vec::with_capacity(shard::HEADER_BYTES);
    file.take(shard::HEADER_BYTES as u64)
        .read_to_end(&mut head)
        .map_err(read_error)?;
    if !shard::has_magic(&head) {
        return Ok(None);
    }
    shard::parse_header(&head, len)
        .map(Some)
        .map_err(|(problem, fix)| DataError::Invalid {
            path: path.display().to_string(),
            problem,
            fix,
        })
}
