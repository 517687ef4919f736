//! Generation on one CPU rank, for `tessera sample`: the model's own forward
//! ([`forward_logits`](super::forward_logits): the executor's layers on the whole model, TP 1,
//! one stage) run token by token. The weights come from a checkpoint (resharded onto the single
//! rank's layout by [`Checkpoint::restore`]) or from the seed (an untrained model, to compare
//! against).
//!
//! The model sees at most `seq_len` tokens (the length it was trained on); a longer context
//! keeps its last `seq_len` tokens.

use tessera_planner::model::Architecture;

use super::model::StageModel;
use super::{forward_logits, RunError};
use crate::checkpoint::Checkpoint;
use crate::rng;

/// A model's weights on one rank, ready to run forwards.
pub struct Generator {
    arch: Architecture,
    /// The flat parameter buffer of the single-rank layout (`StageModel::whole`).
    params: Vec<f32>,
    /// The longest context: the sequence length the model was trained on.
    window: usize,
}

impl Generator {
    /// The model in `ck` (saved under any layout), with the window it was trained on.
    pub fn from_checkpoint(ck: &Checkpoint) -> Result<Generator, RunError> {
        super::refuse_adapters(ck)?;
        let arch = ck.index().model.clone();
        let layout = StageModel::whole(&arch)?.layout;
        let params = ck.restore(&layout, &[])?.params;
        Generator::new(arch, params, ck.index().training.seq_len as usize)
    }

    /// The model `arch`, untrained: the weights a run with `seed` starts from.
    pub fn initialised(
        arch: &Architecture,
        seed: u64,
        window: usize,
    ) -> Result<Generator, RunError> {
        let layout = StageModel::whole(arch)?.layout;
        Generator::new(arch.clone(), layout.init(seed), window)
    }

    fn new(arch: Architecture, params: Vec<f32>, window: usize) -> Result<Generator, RunError> {
        let max = usize::try_from(arch.max_positions).unwrap_or(usize::MAX);
        if window == 0 || window > max {
            return Err(RunError::Unsupported {
                what: format!("a context window of {window} tokens for a model of {max} positions"),
                fix: "use a checkpoint whose seq_len is between 1 and max_positions".into(),
            });
        }
        Ok(Generator {
            arch,
            params,
            window,
        })
    }

    /// The context window: the sequence length the model was trained on.
    pub fn window(&self) -> usize {
        self.window
    }

    /// The real vocabulary size (token ids `0..vocab`).
    pub fn vocab(&self) -> usize {
        self.arch.vocab as usize
    }

    /// Logits `(ids.len(), vocab)` of the next token after each position of `ids` (1 to
    /// [`window`](Self::window) tokens, each below [`vocab`](Self::vocab)).
    pub fn logits(&self, ids: &[u32]) -> Result<Vec<f32>, RunError> {
        if ids.is_empty() || ids.len() > self.window {
            return Err(RunError::Unsupported {
                what: format!("{} tokens for a window of {}", ids.len(), self.window),
                fix: "pass between 1 and the window's tokens".into(),
            });
        }
        forward_logits(&self.arch, ids.len(), ids, |_| Ok(self.params.as_slice()))
    }

    /// Mean cross-entropy (nats per token) of `targets[i]` after `inputs[..=i]` (one
    /// sequence of at most [`window`](Self::window) tokens): the training loss of one sequence.
    pub fn cross_entropy(&self, inputs: &[u32], targets: &[u32]) -> Result<f64, RunError> {
        if targets.len() != inputs.len() || targets.iter().any(|&t| t as usize >= self.vocab()) {
            return Err(RunError::Unsupported {
                what: format!(
                    "{} targets for {} inputs, or a target outside the vocabulary",
                    targets.len(),
                    inputs.len()
                ),
                fix: "pass one target id below the vocabulary size per input".into(),
            });
        }
        let logits = self.logits(inputs)?;
        let sum: f64 = logits
            .chunks_exact(self.vocab())
            .zip(targets)
            .map(|(row, &t)| -log_softmax(row, t as usize))
            .sum();
        Ok(sum / inputs.len() as f64)
    }

    /// Mean cross-entropy (nats per token) of each token of `ids` after the ones before it,
    /// over windows of at most [`window`](Self::window) tokens of context.
    pub fn loss(&self, ids: &[u32]) -> Result<f64, RunError> {
        let (mut sum, mut n) = (0.0, 0usize);
        let mut start = 0;
        while start + 1 < ids.len() {
            let end = (start + self.window).min(ids.len() - 1);
            let k = end - start;
            sum += k as f64 * self.cross_entropy(&ids[start..end], &ids[start + 1..end + 1])?;
            n += k;
            start = end;
        }
        Ok(if n == 0 { 0.0 } else { sum / n as f64 })
    }

    /// Appends `n` tokens to `prompt`, each drawn from the model's next-token distribution at
    /// `temperature` (0: the most likely token) with draw `k` taking uniform number `k` of the
    /// stream of `seed`, so a seed gives the same text on every machine.
    pub fn generate(
        &self,
        prompt: &[u32],
        n: usize,
        temperature: f64,
        seed: u64,
    ) -> Result<Vec<u32>, RunError> {
        self.generate_each(prompt, n, temperature, seed, &mut |_| Ok(()))
    }

    /// [`Generator::generate`], handing each token to `each` as it is drawn (to show it at
    /// once); an error from `each` stops the generation and is returned.
    pub fn generate_each(
        &self,
        prompt: &[u32],
        n: usize,
        temperature: f64,
        seed: u64,
        each: &mut dyn FnMut(u32) -> Result<(), RunError>,
    ) -> Result<Vec<u32>, RunError> {
        let (t, v) = (self.window, self.vocab());
        let mut ids = prompt.to_vec();
        for k in 0..n {
            let context = &ids[ids.len().saturating_sub(t)..];
            let logits = self.logits(context)?;
            let last = &logits[(context.len() - 1) * v..];
            let u = rng::uniform(seed, rng::stream_id("sample"), k as u64);
            let token = pick(last, temperature, u);
            ids.push(token);
            each(token)?;
        }
        Ok(ids.split_off(prompt.len()))
    }
}

/// `log softmax(row)[target]`, in f64.
fn log_softmax(row: &[f32], target: usize) -> f64 {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    let sum: f64 = row.iter().map(|&x| (f64::from(x) - max).exp()).sum();
    f64::from(row[target]) - max - sum.ln()
}

/// The token drawn from `softmax(logits / temperature)` by the uniform number `u` in (0, 1)
/// (inverse CDF); at temperature 0 the most likely token (the first, on a tie).
pub fn pick(logits: &[f32], temperature: f64, u: f64) -> u32 {
    let argmax = logits
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bx), (i, &x)| {
            if x > bx {
                (i, x)
            } else {
                (bi, bx)
            }
        })
        .0;
    if temperature <= 0.0 {
        return argmax as u32;
    }
    let max = f64::from(logits[argmax]);
    let weights: Vec<f64> = logits
        .iter()
        .map(|&x| ((f64::from(x) - max) / temperature).exp())
        .collect();
    let mut target = u * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        if target < *w {
            return i as u32;
        }
        target -= w;
    }
    argmax as u32
}

#[cfg(test)]
mod tests {
    use super::pick;

    #[test]
    fn temperature_zero_is_greedy_and_draws_follow_the_weights() {
        let logits = [0.0f32, 2.0, 1.0, 2.0];
        assert_eq!(
            pick(&logits, 0.0, 0.99),
            1,
            "greedy takes the first maximum"
        );
        // At a very low temperature every draw is (nearly) a maximum.
        for u in [0.01, 0.3, 0.49] {
            assert_eq!(pick(&logits, 1e-3, u), 1);
        }
        assert_eq!(pick(&logits, 1e-3, 0.99), 3);
        // At temperature 1 the draws spread by the weights: u near 0 picks token 0.
        assert_eq!(pick(&logits, 1.0, 1e-4), 0);
        assert_eq!(pick(&logits, 1.0, 1.0 - 1e-9), 3);
    }
}
