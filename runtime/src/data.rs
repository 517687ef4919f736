//! Training data: a token file and a deterministic sampler.
//!
//! Data is a binary token file (u16 or u32, little-endian; `.bin` = u16, `.u32` = u32) or a UTF-8
//! text file read with a byte-level tokenizer (one token per byte, vocabulary 256). The sampler
//! hands out the same global batch in the same order under every plan: sequence `i` of step `t`
//! starts at an offset that depends only on (seed, t, i). A DP replica takes its contiguous slice
//! of the global batch, and a micro-batch its contiguous slice of that. Nothing here knows about
//! ranks beyond those two indices.

use std::path::Path;

/// Why data cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: cannot read the data file: {source}\n  fix: check the path passed to --data")]
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

/// A tokenized corpus held in memory.
#[derive(Debug, Clone)]
pub struct Tokens {
    pub tokens: Vec<u32>,
    /// Largest token id + 1 that the file may contain (256 for bytes).
    pub vocab_used: u64,
    pub source: String,
}

/// The most bytes read from a data source that is not a regular file (a FIFO, a device such
/// as /dev/zero): its size is not known in advance, so the read stops here.
pub const MAX_STREAM_BYTES: u64 = 1 << 30;

/// Reads a regular file whole, and anything else up to [`MAX_STREAM_BYTES`].
fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    if file.metadata()?.is_file() {
        return std::fs::read(path);
    }
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

impl Tokens {
    /// Loads a token file (by extension `.bin` u16, `.u32` u32) or a text file (anything else).
    pub fn load(path: &Path) -> Result<Tokens, DataError> {
        let name = path.display().to_string();
        let bytes = read_bounded(path).map_err(|source| DataError::Read {
            path: name.clone(),
            source,
        })?;
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let width = match ext {
            "bin" => 2,
            "u32" => 4,
            _ => 0,
        };
        let tokens: Vec<u32> = if width == 0 {
            if std::str::from_utf8(&bytes).is_err() {
                return Err(DataError::Invalid {
                    path: name,
                    problem: "not UTF-8 text, and not a .bin (u16) or .u32 token file".into(),
                    fix: "pass a UTF-8 text file, or name a token file .bin (u16 LE) or .u32 (u32 LE)".into(),
                });
            }
            bytes.iter().map(|b| *b as u32).collect()
        } else {
            if bytes.len() % width != 0 {
                return Err(DataError::Invalid {
                    path: name,
                    problem: format!(
                        "{} bytes is not a whole number of {width}-byte tokens (truncated?)",
                        bytes.len()
                    ),
                    fix: "re-create the token file".into(),
                });
            }
            bytes
                .chunks_exact(width)
                .map(|c| {
                    if width == 2 {
                        u16::from_le_bytes([c[0], c[1]]) as u32
                    } else {
                        u32::from_le_bytes([c[0], c[1], c[2], c[3]])
                    }
                })
                .collect()
        };
        let vocab_used = tokens.iter().copied().max().map_or(0, |m| u64::from(m) + 1);
        Ok(Tokens {
            tokens,
            vocab_used,
            source: name,
        })
    }

    pub fn from_text(text: &str) -> Tokens {
        let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
        let vocab_used = tokens.iter().copied().max().map_or(0, |m| u64::from(m) + 1);
        Tokens {
            tokens,
            vocab_used,
            source: "<text>".into(),
        }
    }

    /// Checks the corpus against a model's vocabulary and sequence length.
    pub fn check(&self, vocab: u64, seq_len: u64) -> Result<(), DataError> {
        if self.vocab_used > vocab {
            return Err(DataError::Invalid {
                path: self.source.clone(),
                problem: format!(
                    "token id {} does not fit the model's vocabulary of {vocab}",
                    self.vocab_used - 1
                ),
                fix: "use a model whose vocab covers the data (bytes need 256), or re-tokenize"
                    .into(),
            });
        }
        if (self.tokens.len() as u64) < seq_len.saturating_add(2) {
            return Err(DataError::Invalid {
                path: self.source.clone(),
                problem: format!(
                    "{} tokens is shorter than one sequence of {seq_len} plus its target",
                    self.tokens.len()
                ),
                fix: "use a longer data file or a shorter seq_len".into(),
            });
        }
        Ok(())
    }
}

/// SplitMix64: a counter-based mix, so sample offsets depend only on their indices.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Deterministic batches: the same global batch at every step whatever the layout.
#[derive(Debug, Clone, Copy)]
pub struct Sampler {
    pub seed: u64,
    pub seq_len: usize,
    pub global_batch: usize,
}

impl Sampler {
    /// Start offset of global sequence `i` at `step`.
    pub fn offset(&self, corpus_len: usize, step: u64, i: usize) -> usize {
        let span = corpus_len - self.seq_len - 1;
        (mix(mix(self.seed ^ step.wrapping_mul(0xA24B_AED4_963E_E407)) ^ i as u64)
            % (span as u64 + 1)) as usize
    }

    /// Inputs and targets of global sequences `first..first + count` at `step`, row-major
    /// `(count, seq_len)`.
    pub fn sequences(
        &self,
        data: &Tokens,
        step: u64,
        first: usize,
        count: usize,
    ) -> (Vec<u32>, Vec<u32>) {
        let mut inputs = Vec::with_capacity(count * self.seq_len);
        let mut targets = Vec::with_capacity(count * self.seq_len);
        for i in first..first + count {
            let o = self.offset(data.tokens.len(), step, i);
            inputs.extend_from_slice(&data.tokens[o..o + self.seq_len]);
            targets.extend_from_slice(&data.tokens[o + 1..o + 1 + self.seq_len]);
        }
        (inputs, targets)
    }

    /// The global sequence index where micro-batch `mb` of DP replica `dp_rank` starts.
    pub fn first_sequence(
        &self,
        dp: usize,
        dp_rank: usize,
        micro_batch: usize,
        mb: usize,
    ) -> usize {
        dp_rank * (self.global_batch / dp) + mb * micro_batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_sees_the_same_global_batch() {
        let data = Tokens::from_text(&"the quick brown fox jumps over the lazy dog. ".repeat(20));
        let s = Sampler {
            seed: 7,
            seq_len: 8,
            global_batch: 8,
        };
        let (whole, _) = s.sequences(&data, 3, 0, 8);
        for (dp, mbs) in [(1usize, 4usize), (2, 2), (4, 1), (2, 1)] {
            let mut got = Vec::new();
            for r in 0..dp {
                for mb in 0..8 / dp / mbs {
                    let (x, _) = s.sequences(&data, 3, s.first_sequence(dp, r, mbs, mb), mbs);
                    got.extend(x);
                }
            }
            assert_eq!(got, whole, "dp {dp} micro-batch {mbs}");
        }
    }

    #[test]
    fn targets_are_inputs_shifted_by_one() {
        let data = Tokens::from_text("abcdefghijklmnopqrstuvwxyz");
        let s = Sampler {
            seed: 1,
            seq_len: 5,
            global_batch: 2,
        };
        let (x, y) = s.sequences(&data, 0, 0, 2);
        for r in 0..2 {
            assert_eq!(&x[r * 5 + 1..r * 5 + 5], &y[r * 5..r * 5 + 4]);
        }
        assert_ne!(
            s.offset(26, 0, 0),
            s.offset(26, 1, 0),
            "different steps sample different text"
        );
    }

    #[test]
    fn token_files_are_read_little_endian_and_checked() {
        let dir = std::env::temp_dir().join(format!("tessera-data-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.bin");
        std::fs::write(&p, [1u8, 0, 0, 1, 255, 255]).unwrap();
        let t = Tokens::load(&p).unwrap();
        assert_eq!(t.tokens, vec![1, 256, 65535]);
        assert!(
            t.check(50257, 1).is_err(),
            "65535 does not fit a 50257 vocabulary"
        );
        std::fs::write(&p, [1u8, 0, 0]).unwrap();
        assert!(
            Tokens::load(&p).is_err(),
            "odd byte count is a damaged u16 file"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
