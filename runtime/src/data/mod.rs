//! Training data: tokenizers, token files (llm.c shards, nanoGPT's headerless tokens, text),
//! corpora of many files and a deterministic sampler.
//!
//! - `tokenizer`: bytes (vocabulary 256), GPT-2's BPE (r50k_base, offline), a Hugging Face
//!   `tokenizer.json`; encode and decode.
//! - `shard`: llm.c's shard format (a header of 256 int32s, then uint16 or uint32 tokens).
//! - `open`: what `--data` names (a file, a folder of shards, a glob pattern) and how each file
//!   is read (the detection rule is in its docs; docs/data.md for users).
//! - `corpus`: [`Tokens`], the corpus as parts that a sequence never crosses; token files are
//!   memory-mapped, only the sequences handed out are copied; fixed evaluation sequences; the
//!   checkpoint fingerprint.
//! - `sampler`: [`Sampler`]: sequence `i` of step `t` depends only on (seed, t, i), so every
//!   layout sees the same global batch. A DP replica takes its contiguous slice of the global
//!   batch, and a micro-batch its contiguous slice of that.
//! - `text`: what a text input is (the encoding rule, a `.jsonl` file's documents, no text
//!   refused), the same for `tessera run` and `tessera data prepare`.
//! - `meta`: a prepared folder's `tessera-data.json`, checked against its shards; `prepare`:
//!   the pieces of `tessera data prepare`.

mod corpus;
mod meta;
mod open;
pub mod prepare;
mod sampler;
pub mod shard;
pub mod text;
mod tokenizer;

pub use corpus::{Part, PartKind, Tokens, FULL_HASH_TOKENS};
pub use meta::{split_of, DataMeta, ShardEntry, Split, TokenizerRef, META_FILE, META_FORMAT};
pub use open::{DataFormat, DataSet, LoadOptions, MAX_STREAM_BYTES};
pub use sampler::Sampler;
pub use tokenizer::{sha256_hex, Tokenizer, GPT2_EOT, GPT2_VOCAB};

/// Why data cannot be used. Each message names the file, the problem and a fix.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: cannot read the data file: {source}\n  fix: check the path passed to --data (or --val-data)")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {problem}\n  fix: {fix}")]
    Invalid {
        path: String,
        problem: String,
        fix: String,
    },
}

#[cfg(test)]
mod tests;
