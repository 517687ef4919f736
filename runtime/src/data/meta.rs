//! `tessera-data.json`: what `tessera data prepare` wrote into a folder (the tokenizer, its
//! vocabulary, the shards), so that `tessera run` can check the model's vocabulary against it
//! and `tessera sample` can decode with the same tokenizer.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::tokenizer::{sha256_hex, Tokenizer};
use super::DataError;

/// The file's name in a prepared folder.
pub const META_FILE: &str = "tessera-data.json";
/// The value of its `format` field.
pub const META_FORMAT: &str = "tessera-data";

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

    /// The tokenizer it names: a tokenizer.json is loaded from its path and must still have
    /// the SHA-256 recorded.
    pub fn tokenizer(&self, meta_path: &Path) -> Result<Tokenizer, DataError> {
        self.tokenizer.load(meta_path)
    }
}
