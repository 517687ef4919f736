//! The corpus: token files (memory-mapped) or tokenized text (in memory), as parts that a
//! sequence never crosses.
//!
//! The sampler draws a start position among every part's valid starts, concatenated: a part
//! of `n` tokens has `n - seq_len` of them (a window of `seq_len + 1` tokens, the inputs and
//! their shifted targets, fits from each). A corpus of one part therefore samples exactly as
//! the in-memory corpus of earlier versions did. Only the windows handed out are copied.

use std::sync::{Arc, OnceLock};

use rayon::prelude::*;

use super::meta::TokenizerRef;
use super::shard::Width;
use super::DataError;

/// The bytes of a token file: mapped, or read whole (a FIFO or device cannot be mapped).
#[derive(Debug)]
pub(super) enum Backing {
    Mapped(memmap2::Mmap),
    Read(Vec<u8>),
}

impl Backing {
    pub(super) fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m,
            Backing::Read(v) => v,
        }
    }
}

/// Where a part's tokens are.
#[derive(Debug, Clone)]
pub(super) enum Store {
    /// Tokenized text, in memory.
    Memory(Arc<Vec<u32>>),
    /// A token file: `offset` header bytes, then tokens of `width`, little-endian.
    File {
        bytes: Arc<Backing>,
        offset: usize,
        width: Width,
    },
}

/// What kind of source a part was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartKind {
    /// UTF-8 text, tokenized at load.
    Text,
    /// Headerless tokens (nanoGPT's `.bin`, uint16; `.u32`, uint32).
    Headerless,
    /// An llm.c shard (header of 256 int32s, then the tokens).
    Llmc,
}

/// One file of a corpus (or one text).
#[derive(Debug, Clone)]
pub struct Part {
    /// The file, as named (text given in memory: `<text>`).
    pub path: String,
    pub kind: PartKind,
    /// Bytes of the file (0 for text given in memory).
    pub file_bytes: u64,
    pub(super) store: Store,
    len: usize,
    /// The largest id, found by one scan when first asked.
    max: Arc<OnceLock<Option<u32>>>,
}

impl Part {
    pub(super) fn new(path: String, kind: PartKind, file_bytes: u64, store: Store) -> Part {
        let len = match &store {
            Store::Memory(v) => v.len(),
            Store::File {
                bytes,
                offset,
                width,
            } => (bytes.bytes().len() - offset) / width.bytes(),
        };
        Part {
            path,
            kind,
            file_bytes,
            store,
            len,
            max: Arc::new(OnceLock::new()),
        }
    }

    /// Tokens in the part.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes per token as stored (text: 4, in memory).
    pub fn width(&self) -> Width {
        match &self.store {
            Store::Memory(_) => Width::U32,
            Store::File { width, .. } => *width,
        }
    }

    /// The file's first bytes (an llm.c shard's header), at most `n`.
    pub(super) fn head_bytes(&self, n: usize) -> &[u8] {
        match &self.store {
            Store::Memory(_) => &[],
            Store::File { bytes, .. } => &bytes.bytes()[..n.min(bytes.bytes().len())],
        }
    }

    /// Appends tokens `start..start + n` to `out`.
    pub fn copy_to(&self, start: usize, n: usize, out: &mut Vec<u32>) {
        match &self.store {
            Store::Memory(v) => out.extend_from_slice(&v[start..start + n]),
            Store::File {
                bytes,
                offset,
                width,
            } => {
                let w = width.bytes();
                let b = &bytes.bytes()[offset + start * w..offset + (start + n) * w];
                match width {
                    Width::U16 => out.extend(
                        b.chunks_exact(2)
                            .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))),
                    ),
                    Width::U32 => out.extend(
                        b.chunks_exact(4)
                            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                    ),
                }
            }
        }
    }

    /// The largest id (one scan of the whole part, in parallel, then remembered).
    pub fn max_id(&self) -> Option<u32> {
        *self.max.get_or_init(|| match &self.store {
            Store::Memory(v) => v.iter().copied().max(),
            Store::File {
                bytes,
                offset,
                width,
            } => {
                let b = &bytes.bytes()[*offset..];
                const CHUNK: usize = 1 << 20;
                match width {
                    Width::U16 => b[..self.len * 2]
                        .par_chunks(CHUNK * 2)
                        .map(|c| {
                            c.chunks_exact(2)
                                .map(|t| u16::from_le_bytes([t[0], t[1]]))
                                .max()
                                .map(u32::from)
                        })
                        .reduce(|| None, Option::max),
                    Width::U32 => b[..self.len * 4]
                        .par_chunks(CHUNK * 4)
                        .map(|c| {
                            c.chunks_exact(4)
                                .map(|t| u32::from_le_bytes([t[0], t[1], t[2], t[3]]))
                                .max()
                        })
                        .reduce(|| None, Option::max),
                }
            }
        })
    }

    /// The position of the first id at or above `limit`, if any.
    fn first_at_or_above(&self, limit: u32) -> Option<usize> {
        const CHUNK: usize = 1 << 16;
        let mut buf = Vec::with_capacity(CHUNK);
        (0..self.len).step_by(CHUNK).find_map(|s| {
            buf.clear();
            self.copy_to(s, CHUNK.min(self.len - s), &mut buf);
            buf.iter().position(|&t| t >= limit).map(|i| s + i)
        })
    }
}

/// A tokenized corpus: one or more parts (text, token files, llm.c shards).
#[derive(Debug, Clone)]
pub struct Tokens {
    pub(super) parts: Vec<Part>,
    /// What the corpus was read from (a file, a folder, a glob pattern), for messages.
    pub source: String,
    /// The vocabulary the data was prepared for (its folder's `tessera-data.json`), checked
    /// against the model's; `None` when unknown.
    pub declared_vocab: Option<u64>,
    /// The tokenizer that made the tokens, where known: the one a prepared folder records,
    /// or the one text was read with; `None` for token files without a `tessera-data.json`.
    /// A checkpoint records it, and `tessera sample` decodes with it.
    pub tokenizer: Option<TokenizerRef>,
}

impl Tokens {
    /// A corpus of tokens held in memory.
    pub fn from_ids(tokens: Vec<u32>, source: &str) -> Tokens {
        Tokens {
            parts: vec![Part::new(
                source.to_string(),
                PartKind::Text,
                0,
                Store::Memory(Arc::new(tokens)),
            )],
            source: source.to_string(),
            declared_vocab: None,
            tokenizer: None,
        }
    }

    /// Text with byte tokens (one token per UTF-8 byte).
    pub fn from_text(text: &str) -> Tokens {
        Tokens::from_ids(text.bytes().map(u32::from).collect(), "<text>")
    }

    /// The parts, in sampling order.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// Tokens in every part.
    pub fn len(&self) -> usize {
        self.parts.iter().map(Part::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `n` tokens (of the parts in order), or all of them if fewer.
    pub fn head(&self, n: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(n.min(self.len()));
        for p in &self.parts {
            let take = (n - out.len()).min(p.len());
            p.copy_to(0, take, &mut out);
            if out.len() == n {
                break;
            }
        }
        out
    }

    /// Largest token id + 1 (0 for an empty corpus): scans every part once.
    pub fn vocab_used(&self) -> u64 {
        self.parts
            .iter()
            .filter_map(Part::max_id)
            .max()
            .map_or(0, |m| u64::from(m) + 1)
    }

    /// Cumulative counts of valid sequence starts, part by part (see the module's docs).
    pub(super) fn start_counts(&self, seq_len: usize) -> Vec<u64> {
        let mut total = 0u64;
        self.parts
            .iter()
            .map(|p| {
                total += p.len().saturating_sub(seq_len) as u64;
                total
            })
            .collect()
    }

    /// The window of `seq_len + 1` tokens at valid start `u` (an index into
    /// [`Tokens::start_counts`]), appended to `out`.
    pub(super) fn window(&self, counts: &[u64], u: u64, seq_len: usize, out: &mut Vec<u32>) {
        let p = counts.partition_point(|&c| c <= u);
        let before = if p == 0 { 0 } else { counts[p - 1] };
        self.parts[p].copy_to((u - before) as usize, seq_len + 1, out);
    }

    /// Checks the corpus against a model's vocabulary and sequence length: every id is below
    /// `vocab` (one scan of each file), and at least two windows of `seq_len + 1` tokens fit.
    pub fn check(&self, vocab: u64, seq_len: u64) -> Result<(), DataError> {
        if let Some(declared) = self.declared_vocab.filter(|d| *d > vocab) {
            return Err(DataError::Invalid {
                path: self.source.clone(),
                problem: format!(
                    "the data was prepared for a vocabulary of {declared} (its tessera-data.json), and the model's is {vocab}"
                ),
                fix: "plan a model whose vocab covers the tokenizer's (GPT-2: vocab = 50257), or prepare the data with a smaller tokenizer".into(),
            });
        }
        let first_at = |p: &Part, limit: u64| {
            p.first_at_or_above(limit.min(u64::from(u32::MAX)) as u32)
                .map_or(String::new(), |i| format!(" (first at token {i})"))
        };
        for p in &self.parts {
            let Some(max) = p.max_id() else { continue };
            if u64::from(max) >= vocab {
                return Err(DataError::Invalid {
                    path: p.path.clone(),
                    problem: format!(
                        "token id {max} does not fit the model's vocabulary of {vocab}{}",
                        first_at(p, vocab)
                    ),
                    fix: "use a model whose vocab covers the data (bytes need 256, GPT-2 50257), or re-tokenize"
                        .into(),
                });
            }
            // The same scan finds the ids that the folder's record says cannot be there.
            if let Some(declared) = self.declared_vocab.filter(|d| u64::from(max) >= *d) {
                return Err(DataError::Invalid {
                    path: p.path.clone(),
                    problem: format!(
                        "token id {max} is outside the vocabulary of {declared} that its folder's tessera-data.json declares (\"vocab\"){}",
                        first_at(p, declared)
                    ),
                    fix: "prepare the folder again with `tessera data prepare`: its shards do not hold what its record says".into(),
                });
            }
        }
        let seq = usize::try_from(seq_len).unwrap_or(usize::MAX);
        let starts = self.start_counts(seq).last().copied().unwrap_or(0);
        if starts < 2 {
            let (path, problem) = match self.parts.as_slice() {
                [one] => (
                    one.path.clone(),
                    format!(
                        "{} tokens is shorter than one sequence of {seq_len} plus its target",
                        one.len()
                    ),
                ),
                _ => (
                    self.source.clone(),
                    format!(
                        "its {} files hold {} tokens, and no sequence of {seq_len} plus its target fits in a file (a sequence never crosses a shard boundary)",
                        self.parts.len(),
                        self.len()
                    ),
                ),
            };
            return Err(DataError::Invalid {
                path,
                problem,
                fix: "use more data or a shorter seq_len".into(),
            });
        }
        Ok(())
    }

    /// Whole non-overlapping windows of `seq_len + 1` tokens from each part's start.
    pub fn eval_windows(&self, seq_len: usize) -> usize {
        self.parts.iter().map(|p| p.len() / (seq_len + 1)).sum()
    }

    /// Fixed evaluation sequences: the first `count` non-overlapping windows of `seq_len + 1`
    /// tokens, taken from the start of each part in order (never across a part's end), as
    /// row-major `(count, seq_len)` inputs and targets (the inputs shifted by one). The same
    /// whatever the layout; fewer than `count` when the corpus holds fewer
    /// ([`Tokens::eval_windows`]).
    pub fn eval_sequences(&self, seq_len: usize, count: usize) -> (Vec<u32>, Vec<u32>) {
        let n = count.min(self.eval_windows(seq_len));
        let mut inputs = Vec::with_capacity(n * seq_len);
        let mut targets = Vec::with_capacity(n * seq_len);
        let mut window = Vec::with_capacity(seq_len + 1);
        let mut left = n;
        for p in &self.parts {
            for w in 0..(p.len() / (seq_len + 1)).min(left) {
                window.clear();
                p.copy_to(w * (seq_len + 1), seq_len + 1, &mut window);
                inputs.extend_from_slice(&window[..seq_len]);
                targets.extend_from_slice(&window[1..]);
                left -= 1;
            }
        }
        (inputs, targets)
    }

    /// A fingerprint for checkpoints (16 hex digits). A corpus of one text or headerless file
    /// of at most [`FULL_HASH_TOKENS`] tokens is hashed whole: FNV-1a over its tokens as
    /// little-endian u32s (as every earlier version did, so their checkpoints resume).
    /// Anything else is fingerprinted without reading it all: each file's name, size, first
    /// 1024 bytes (an llm.c shard's header) and 64 windows of 64 tokens spread over it.
    pub fn fingerprint(&self) -> String {
        let mut h = Fnv::new();
        match self.parts.as_slice() {
            [p] if p.kind != PartKind::Llmc && p.len() as u64 <= FULL_HASH_TOKENS => {
                let mut buf = Vec::new();
                for s in (0..p.len()).step_by(1 << 16) {
                    buf.clear();
                    p.copy_to(s, (1 << 16).min(p.len() - s), &mut buf);
                    for t in &buf {
                        h.bytes(&t.to_le_bytes());
                    }
                }
            }
            parts => {
                h.bytes(b"tessera sampled fingerprint 1");
                let mut buf = Vec::new();
                for p in parts {
                    let name = std::path::Path::new(&p.path)
                        .file_name()
                        .map_or(p.path.clone(), |n| n.to_string_lossy().into_owned());
                    h.bytes(name.as_bytes());
                    h.bytes(&p.file_bytes.to_le_bytes());
                    h.bytes(&(p.len() as u64).to_le_bytes());
                    h.bytes(p.head_bytes(1024));
                    const SAMPLES: usize = 64;
                    let w = 64.min(p.len());
                    for k in 0..SAMPLES {
                        let at = (p.len() - w) * k / (SAMPLES - 1);
                        buf.clear();
                        p.copy_to(at, w, &mut buf);
                        for t in &buf {
                            h.bytes(&t.to_le_bytes());
                        }
                    }
                }
            }
        }
        format!("{:016x}", h.0)
    }

    /// One line: what the corpus is and how many tokens it holds.
    pub fn describe(&self) -> String {
        let kinds = |k: PartKind| self.parts.iter().filter(|p| p.kind == k).count();
        let what = match (
            kinds(PartKind::Text),
            kinds(PartKind::Headerless),
            kinds(PartKind::Llmc),
        ) {
            (1, 0, 0) => "text".to_string(),
            (0, 1, 0) => format!("headerless {} tokens", self.parts[0].width().name()),
            (0, 0, 1) => format!("an llm.c shard ({})", self.parts[0].width().name()),
            (0, 0, n) => format!("{n} llm.c shards"),
            _ => format!("{} files", self.parts.len()),
        };
        format!("{} ({what}, {} tokens)", self.source, self.len())
    }
}

/// Corpora of at most this many tokens in one text or headerless file are fingerprinted whole.
pub const FULL_HASH_TOKENS: u64 = 1 << 24;

/// FNV-1a, 64 bits.
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn bytes(&mut self, b: &[u8]) {
        for x in b {
            self.0 = (self.0 ^ u64::from(*x)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}
