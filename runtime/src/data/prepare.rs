//! The pieces of `tessera data prepare`: documents out of input files, tokens out of
//! documents, and shards out of tokens. The command writes the shards (atomically) and the
//! folder's `tessera-data.json`.

use rayon::prelude::*;

use super::meta::ShardEntry;
use super::tokenizer::Tokenizer;
use super::DataError;

pub use super::text::documents;

/// The tokens of `docs`, each document preceded by the tokenizer's separator if it has one
/// (GPT-2: `<|endoftext|>`, as llm.c's and nanoGPT's preparation scripts do). Documents are
/// encoded in parallel; the order is kept.
pub fn encode_documents<S: AsRef<str> + Sync>(
    tokenizer: &Tokenizer,
    docs: &[S],
) -> Result<Vec<u32>, DataError> {
    let encoded: Vec<Vec<u32>> = docs
        .par_iter()
        .map(|d| tokenizer.encode(d.as_ref()))
        .collect::<Result<_, _>>()?;
    let sep = tokenizer.separator();
    let mut out = Vec::with_capacity(encoded.iter().map(Vec::len).sum::<usize>() + docs.len());
    for e in encoded {
        out.extend(sep);
        out.extend(e);
    }
    Ok(out)
}

/// How many of an input's `tokens` go to the validation split: its first `fraction` of them.
pub fn val_count(tokens: usize, fraction: f64) -> usize {
    ((tokens as f64 * fraction).round() as usize).min(tokens)
}

/// Cuts one split's token stream into shards of `shard_tokens` (the last one shorter),
/// named `{prefix}_{split}_{index:06}.bin` as llm.c names them.
pub struct Sharder {
    prefix: String,
    split: &'static str,
    shard_tokens: usize,
    buf: Vec<u32>,
    written: Vec<ShardEntry>,
}

impl Sharder {
    pub fn new(prefix: &str, split: &'static str, shard_tokens: usize) -> Sharder {
        assert!(shard_tokens > 0);
        Sharder {
            prefix: prefix.to_string(),
            split,
            shard_tokens,
            buf: Vec::new(),
            written: Vec::new(),
        }
    }

    fn name(&self) -> String {
        format!(
            "{}_{}_{:06}.bin",
            self.prefix,
            self.split,
            self.written.len()
        )
    }

    fn emit<E>(
        &mut self,
        n: usize,
        sink: &mut impl FnMut(&str, &[u32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let name = self.name();
        sink(&name, &self.buf[..n])?;
        self.written.push(ShardEntry {
            file: name,
            split: self.split.to_string(),
            tokens: n as u64,
        });
        self.buf.drain(..n);
        Ok(())
    }

    /// Adds tokens, writing every shard that fills.
    pub fn push<E>(
        &mut self,
        tokens: &[u32],
        sink: &mut impl FnMut(&str, &[u32]) -> Result<(), E>,
    ) -> Result<(), E> {
        self.buf.extend_from_slice(tokens);
        while self.buf.len() >= self.shard_tokens {
            self.emit(self.shard_tokens, sink)?;
        }
        Ok(())
    }

    /// Writes what is left as the last shard (if anything is), and returns the shards.
    pub fn finish<E>(
        mut self,
        sink: &mut impl FnMut(&str, &[u32]) -> Result<(), E>,
    ) -> Result<Vec<ShardEntry>, E> {
        if !self.buf.is_empty() {
            self.emit(self.buf.len(), sink)?;
        }
        Ok(self.written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_fill_in_order_and_the_last_is_shorter() {
        let mut s = Sharder::new("x", "train", 4);
        let mut got: Vec<(String, Vec<u32>)> = Vec::new();
        let mut sink = |n: &str, t: &[u32]| -> Result<(), ()> {
            got.push((n.to_string(), t.to_vec()));
            Ok(())
        };
        s.push(&[1, 2, 3], &mut sink).unwrap();
        s.push(&[4, 5, 6, 7, 8, 9], &mut sink).unwrap();
        let entries = s.finish(&mut sink).unwrap();
        assert_eq!(
            got,
            vec![
                ("x_train_000000.bin".to_string(), vec![1, 2, 3, 4]),
                ("x_train_000001.bin".to_string(), vec![5, 6, 7, 8]),
                ("x_train_000002.bin".to_string(), vec![9]),
            ]
        );
        assert_eq!(
            entries.iter().map(|e| e.tokens).collect::<Vec<_>>(),
            [4, 4, 1]
        );
    }

    #[test]
    fn documents_are_separated_by_gpt2_end_of_text() {
        let t = Tokenizer::Gpt2;
        let ids = encode_documents(&t, &["Hello world", "Hello world"]).unwrap();
        assert_eq!(ids, vec![50256, 15496, 995, 50256, 15496, 995]);
        let bytes = encode_documents(&Tokenizer::Bytes, &["ab"]).unwrap();
        assert_eq!(bytes, vec![97, 98], "bytes have no separator");
        let docs = documents("d.jsonl", "{\"text\":\"a\"}\n\n{\"text\":\"b\"}\n").unwrap();
        assert_eq!(docs, vec!["a", "b"]);
        let e = documents("d.jsonl", "{\"txt\":1}").unwrap_err();
        assert!(e.to_string().contains("d.jsonl:1"), "{e}");
        assert_eq!(documents("d.txt", "{\"txt\":1}").unwrap().len(), 1);
        assert_eq!(
            (val_count(100, 0.05), val_count(10, 0.0), val_count(3, 1.0)),
            (5, 0, 3)
        );
    }
}
