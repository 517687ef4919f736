//! Deterministic batches: the same global batch at every step whatever the layout.
//!
//! Sequence `i` of step `t` starts at a valid start drawn from (seed, t, i) alone (a
//! counter-based mix, no state), so a DP replica takes its contiguous slice of the global
//! batch, a micro-batch its contiguous slice of that, and a resumed run continues exactly.

use super::Tokens;

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
    /// The random draw of global sequence `i` at `step`.
    fn draw(&self, step: u64, i: usize) -> u64 {
        mix(mix(self.seed ^ step.wrapping_mul(0xA24B_AED4_963E_E407)) ^ i as u64)
    }

    /// Start offset of global sequence `i` at `step` in a corpus of one part of
    /// `corpus_len` tokens.
    pub fn offset(&self, corpus_len: usize, step: u64, i: usize) -> usize {
        let span = corpus_len - self.seq_len - 1;
        (self.draw(step, i) % (span as u64 + 1)) as usize
    }

    /// Inputs and targets of global sequences `first..first + count` at `step`, row-major
    /// `(count, seq_len)`. Only these windows are read from the corpus.
    pub fn sequences(
        &self,
        data: &Tokens,
        step: u64,
        first: usize,
        count: usize,
    ) -> (Vec<u32>, Vec<u32>) {
        let counts = data.start_counts(self.seq_len);
        let total = counts.last().copied().unwrap_or(0);
        assert!(total > 0, "the corpus was checked to hold a sequence");
        let mut inputs = Vec::with_capacity(count * self.seq_len);
        let mut targets = Vec::with_capacity(count * self.seq_len);
        let mut window = Vec::with_capacity(self.seq_len + 1);
        for i in first..first + count {
            window.clear();
            data.window(
                &counts,
                self.draw(step, i) % total,
                self.seq_len,
                &mut window,
            );
            inputs.extend_from_slice(&window[..self.seq_len]);
            targets.extend_from_slice(&window[1..]);
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
    fn one_text_samples_as_earlier_versions_did() {
        // The offsets of earlier versions: draw % (len - seq_len), a slice at that offset.
        let text = "the quick brown fox jumps over the lazy dog. ".repeat(7);
        let data = Tokens::from_text(&text);
        let s = Sampler {
            seed: 1234,
            seq_len: 16,
            global_batch: 4,
        };
        for step in 0..5 {
            let (x, y) = s.sequences(&data, step, 0, 4);
            for i in 0..4 {
                let o = s.offset(text.len(), step, i);
                let b = &text.as_bytes()[o..o + 17];
                let want: Vec<u32> = b.iter().map(|c| u32::from(*c)).collect();
                assert_eq!(&x[i * 16..i * 16 + 16], &want[..16]);
                assert_eq!(&y[i * 16..i * 16 + 16], &want[1..]);
            }
        }
    }

    #[test]
    fn sequences_never_cross_a_part_boundary() {
        // Two parts whose ids differ by part: a window mixing them would mix the ranges.
        let mut data = Tokens::from_ids((0..40).collect(), "a");
        data.parts
            .extend(Tokens::from_ids((1000..1013).collect(), "b").parts);
        let s = Sampler {
            seed: 9,
            seq_len: 6,
            global_batch: 64,
        };
        let counts = data.start_counts(6);
        assert_eq!(counts, vec![34, 41]);
        let mut seen_b = false;
        for step in 0..20 {
            let (x, y) = s.sequences(&data, step, 0, 64);
            for w in 0..64 {
                let row: Vec<u32> = x[w * 6..w * 6 + 6]
                    .iter()
                    .chain(&y[w * 6 + 5..w * 6 + 6])
                    .copied()
                    .collect();
                let in_b = row[0] >= 1000;
                seen_b |= in_b;
                assert!(row.iter().all(|t| (*t >= 1000) == in_b), "{row:?}");
                assert!(row.windows(2).all(|p| p[1] == p[0] + 1), "{row:?}");
            }
        }
        assert!(seen_b, "the second part is sampled too");
    }
}
