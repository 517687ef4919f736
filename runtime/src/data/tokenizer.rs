//! Tokenizers: bytes (one token per byte, vocabulary 256), GPT-2's BPE (r50k_base, through
//! `tiktoken-rs`, whose vocabulary is built into the crate: no download), and a Hugging Face
//! `tokenizer.json` by path (through `tokenizers`, built without its C regex library or
//! downloads). Each encodes and decodes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::DataError;

/// GPT-2's vocabulary size.
pub const GPT2_VOCAB: u64 = 50257;
/// GPT-2's `<|endoftext|>`.
pub const GPT2_EOT: u32 = 50256;

/// Names a `tokenizer.json` may give its document separator, in the order they are looked for.
const HF_SEPARATORS: [&str; 5] = [
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<s>",
    "</s>",
    "<|end_of_text|>",
];

/// A tokenizer: text to token ids and back.
#[derive(Clone)]
pub enum Tokenizer {
    /// One token per UTF-8 byte (vocabulary 256): the runtime's default for text.
    Bytes,
    /// GPT-2's byte-level BPE (tiktoken's r50k_base), vocabulary 50257, `<|endoftext|>` 50256.
    Gpt2,
    /// A Hugging Face `tokenizer.json`.
    HuggingFace {
        path: PathBuf,
        /// SHA-256 of the file, hex.
        sha256: String,
        inner: Arc<tokenizers::Tokenizer>,
        vocab: u64,
        separator: Option<u32>,
    },
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

impl PartialEq for Tokenizer {
    fn eq(&self, other: &Tokenizer) -> bool {
        match (self, other) {
            (Tokenizer::Bytes, Tokenizer::Bytes) | (Tokenizer::Gpt2, Tokenizer::Gpt2) => true,
            (
                Tokenizer::HuggingFace { sha256: a, .. },
                Tokenizer::HuggingFace { sha256: b, .. },
            ) => a == b,
            _ => false,
        }
    }
}

fn gpt2() -> &'static tiktoken_rs::CoreBPE {
    tiktoken_rs::r50k_base_singleton()
}

/// SHA-256 of bytes, hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

impl Tokenizer {
    /// `bytes`, `gpt2` (or `r50k_base`), or the path of a `tokenizer.json`.
    pub fn parse(spec: &str) -> Result<Tokenizer, DataError> {
        match spec {
            "bytes" => Ok(Tokenizer::Bytes),
            "gpt2" | "r50k_base" => Ok(Tokenizer::Gpt2),
            path => Tokenizer::from_file(Path::new(path)),
        }
    }

    /// A Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer, DataError> {
        let name = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| DataError::Invalid {
            path: name.clone(),
            problem: format!("cannot read the tokenizer: {e}"),
            fix: "pass --tokenizer gpt2, bytes, or the path of a Hugging Face tokenizer.json"
                .into(),
        })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| DataError::Invalid {
            path: name.clone(),
            problem: format!("not a Hugging Face tokenizer.json: {e}"),
            fix: "pass the tokenizer.json of a Hugging Face model folder, or --tokenizer gpt2"
                .into(),
        })?;
        let vocab = inner
            .get_vocab(true)
            .values()
            .copied()
            .max()
            .map_or(0, |m| u64::from(m) + 1);
        let separator = HF_SEPARATORS.iter().find_map(|t| inner.token_to_id(t));
        Ok(Tokenizer::HuggingFace {
            path: path.to_path_buf(),
            sha256: sha256_hex(&bytes),
            inner: Arc::new(inner),
            vocab,
            separator,
        })
    }

    /// `bytes`, `gpt2`, or the tokenizer file's path.
    pub fn name(&self) -> String {
        match self {
            Tokenizer::Bytes => "bytes".into(),
            Tokenizer::Gpt2 => "gpt2".into(),
            Tokenizer::HuggingFace { path, .. } => path.display().to_string(),
        }
    }

    /// Token ids are below this.
    pub fn vocab(&self) -> u64 {
        match self {
            Tokenizer::Bytes => 256,
            Tokenizer::Gpt2 => GPT2_VOCAB,
            Tokenizer::HuggingFace { vocab, .. } => *vocab,
        }
    }

    /// The token put before each document when a corpus is prepared: GPT-2's
    /// `<|endoftext|>` (as llm.c and nanoGPT do), a tokenizer.json's first of
    /// `<|endoftext|>`, `<|begin_of_text|>`, `<s>`, `</s>`, `<|end_of_text|>`; none for bytes.
    pub fn separator(&self) -> Option<u32> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::Gpt2 => Some(GPT2_EOT),
            Tokenizer::HuggingFace { separator, .. } => *separator,
        }
    }

    /// Token ids of `text` (special tokens are not recognised in it: `<|endoftext|>` in the
    /// text is ordinary text).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::Gpt2 => Ok(gpt2().encode_ordinary(text)),
            Tokenizer::HuggingFace { path, inner, .. } => inner
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| DataError::Invalid {
                    path: path.display().to_string(),
                    problem: format!("the tokenizer failed to encode text: {e}"),
                    fix: "check the tokenizer.json, or use --tokenizer gpt2".into(),
                }),
        }
    }

    /// The bytes of `ids` (a byte-level tokenizer may end mid-character). An id outside the
    /// vocabulary is an error.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, DataError> {
        let bad = |id: u32| DataError::Invalid {
            path: self.name(),
            problem: format!(
                "token id {id} is outside the tokenizer's vocabulary of {}",
                self.vocab()
            ),
            fix: "decode with the tokenizer the tokens were made with".into(),
        };
        match self {
            Tokenizer::Bytes => ids
                .iter()
                .map(|&t| u8::try_from(t).map_err(|_| bad(t)))
                .collect(),
            Tokenizer::Gpt2 => gpt2().decode_bytes(ids).map_err(|e| bad(e.token)),
            Tokenizer::HuggingFace { .. } => self.decode(ids).map(String::into_bytes),
        }
    }

    /// The text of `ids`; bytes that are not UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        match self {
            Tokenizer::HuggingFace { path, inner, .. } => {
                if let Some(&id) = ids.iter().find(|&&t| u64::from(t) >= self.vocab()) {
                    return Err(DataError::Invalid {
                        path: path.display().to_string(),
                        problem: format!(
                            "token id {id} is outside the tokenizer's vocabulary of {}",
                            self.vocab()
                        ),
                        fix: "decode with the tokenizer the tokens were made with".into(),
                    });
                }
                inner.decode(ids, false).map_err(|e| DataError::Invalid {
                    path: path.display().to_string(),
                    problem: format!("the tokenizer failed to decode: {e}"),
                    fix: "check the tokenizer.json".into(),
                })
            }
            _ => Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_encodes_as_r50k_offline() {
        let t = Tokenizer::parse("gpt2").unwrap();
        assert_eq!(t.encode("Hello world").unwrap(), vec![15496, 995]);
        assert_eq!(t.vocab(), 50257);
        assert_eq!(t.separator(), Some(50256));
        let text = "Pipeline parallelism splits the layers; ünïcödé too.";
        let ids = t.encode(text).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), text);
        assert_eq!(t.decode(&[50256]).unwrap(), "<|endoftext|>");
        assert!(t.decode(&[50257]).is_err());
    }

    #[test]
    fn bytes_are_one_token_per_byte() {
        let t = Tokenizer::Bytes;
        assert_eq!(t.encode("aé").unwrap(), vec![97, 0xc3, 0xa9]);
        assert_eq!(t.decode(&[97, 0xc3, 0xa9]).unwrap(), "aé");
        assert!(t.decode(&[256]).is_err());
        assert_eq!(t.separator(), None);
    }

    #[test]
    fn a_tokenizer_json_by_path() {
        let dir = std::env::temp_dir().join(format!("tessera-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("tokenizer.json");
        std::fs::write(
            &p,
            r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,
            "decoder":null,"model":{"type":"WordLevel","vocab":{"hello":0,"world":1,"</s>":2,"[UNK]":3},
            "unk_token":"[UNK]"}}"#,
        )
        .unwrap();
        let t = Tokenizer::parse(p.to_str().unwrap()).unwrap();
        assert_eq!(t.encode("hello world nope").unwrap(), vec![0, 1, 3]);
        assert_eq!((t.vocab(), t.separator()), (4, Some(2)));
        assert_eq!(t.decode(&[0, 1]).unwrap(), "hello world");
        assert!(t.decode(&[9]).is_err());
        let e = Tokenizer::parse(dir.join("missing.json").to_str().unwrap()).unwrap_err();
        assert!(e.to_string().contains("missing.json"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
