//! Dropout, as Hugging Face's models place it (GPT-2: `embd_pdrop` after the token and position
//! embeddings, `attn_pdrop` on the softmax probabilities, `resid_pdrop` on the attention's and
//! the MLP's output projections before each residual add; PEFT's `lora_dropout` on an adapter's
//! input before `lora_A`), inverted: kept values are scaled by `1 / (1 − p)` as torch does.
//!
//! A mask is never stored: it is a pure function of the counter RNG (`crate::rng`) keyed by
//! the run's seed mixed with the optimizer step ([`DropCall::seed`]), the site's stream (from a
//! name carrying the GLOBAL layer index, `h.3.attn.drop`) and the element's GLOBAL index: its
//! sequence in the global batch, its token position, its feature (or head). Every layout — DP
//! replicas and gradient accumulation (which sequence), pipeline stages (which layer), tensor
//! and sequence parallelism (which feature, head and row) — therefore draws the single rank's
//! mask for the same element, and a recompute or a backward regenerates it.
//!
//! A layer's linears and attention are called through signatures other layers share, so the
//! micro-batch's [`DropCall`] reaches them as state armed on their [`Site`] by the block before
//! each forward, recompute and backward ([`Site::arm`]); a site that is not armed (evaluation,
//! generation, `checkpoint logits`) does not drop. Runs on host memory (the CPU backend): the
//! CUDA backend refuses a plan with dropout (`Session::prepare`).

use std::sync::Mutex;

use crate::backend::Backend;
use crate::rng::{dropout_scale, stream_id};

use super::LayerError;

/// The host memory behind a write view: dropout runs on the CPU backend only.
pub fn host_mut<'a, B: Backend>(v: B::Mut<'a>) -> Result<&'a mut [f32], LayerError> {
    B::host_mut(v).ok_or_else(off_host)
}

/// [`host_mut`] for a read view.
pub fn host<'a, B: Backend>(v: B::Ref<'a>) -> Result<&'a [f32], LayerError> {
    B::host(v).ok_or_else(off_host)
}

fn off_host() -> LayerError {
    LayerError::Config("dropout runs on the CPU backend only (host memory)".into())
}

/// The rate of each dropout site of a run.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DropoutRates {
    /// After the token (+ position) embedding.
    pub embedding: f32,
    /// On the attention probabilities.
    pub attention: f32,
    /// On the attention's and the MLP's outputs, before each residual add.
    pub residual: f32,
    /// On each LoRA adapter's input.
    pub lora: f32,
}

impl DropoutRates {
    /// The plan's: `training.dropout` on the embedding, attention and residual sites,
    /// `[lora] dropout` on the adapters.
    pub fn of_plan(m: &tessera_planner::model::Model) -> Self {
        let p = m.training.dropout as f32;
        Self {
            embedding: p,
            attention: p,
            residual: p,
            lora: m.lora.as_ref().map_or(0.0, |l| l.dropout as f32),
        }
    }

    pub fn any(&self) -> bool {
        [self.embedding, self.attention, self.residual, self.lora]
            .iter()
            .any(|&p| p > 0.0)
    }
}

/// What one micro-batch's masks are drawn from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DropCall {
    /// The run's seed mixed with the optimizer step.
    pub seed: u64,
    /// Global index of the micro-batch's first sequence in the global batch.
    pub first_sequence: u64,
    /// Tokens of each sequence (whole sequences: context parallelism is refused with dropout).
    pub seq_len: u64,
}

impl DropCall {
    /// The draw of `step` under the run's `seed`, for the micro-batch whose first sequence is
    /// `first_sequence`.
    pub fn new(seed: u64, step: u64, first_sequence: usize, seq_len: usize) -> Self {
        Self {
            seed: crate::rng::hash3(seed, stream_id("dropout"), step),
            first_sequence: first_sequence as u64,
            seq_len: seq_len as u64,
        }
    }

    /// Global row (sequence × T + position) of the micro-batch's first token.
    pub fn first_row(&self) -> u64 {
        self.first_sequence * self.seq_len
    }
}

/// A dropout site of a layer: its rate, its stream, where this rank's features sit among the
/// global ones, and the micro-batch armed on it.
#[derive(Debug, Default)]
pub struct Site {
    pub p: f32,
    pub stream: u64,
    /// This rank's first feature (or head), how many it holds, and the global count (TP
    /// shards them).
    pub offset: u64,
    pub local: u64,
    pub width: u64,
    armed: Mutex<Option<DropCall>>,
}

impl Clone for Site {
    fn clone(&self) -> Self {
        Self {
            p: self.p,
            stream: self.stream,
            offset: self.offset,
            local: self.local,
            width: self.width,
            armed: Mutex::new(self.armed()),
        }
    }
}

/// The armed call is per-call state, not part of what a layer is.
impl PartialEq for Site {
    fn eq(&self, o: &Self) -> bool {
        let key = |s: &Self| (s.p, s.stream, s.offset, s.local, s.width);
        key(self) == key(o)
    }
}

impl Site {
    /// A site named `name` (global layer index in it) of rate `p`, for features
    /// `offset..offset + local` of `width`.
    pub fn new(name: &str, p: f32, offset: usize, local: usize, width: usize) -> Self {
        Self {
            p,
            stream: stream_id(name),
            offset: offset as u64,
            local: local as u64,
            width: width as u64,
            armed: Mutex::new(None),
        }
    }

    /// Sets (or with `None` clears) the micro-batch the next calls draw for.
    pub fn arm(&self, call: Option<DropCall>) {
        *self.armed.lock().unwrap_or_else(|e| e.into_inner()) = call;
    }

    fn armed(&self) -> Option<DropCall> {
        *self.armed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The mask to apply now: `None` with rate 0 or nothing armed.
    pub fn mask(&self) -> Option<Mask> {
        let call = self.armed().filter(|_| self.p > 0.0)?;
        Some(Mask {
            p: self.p,
            seed: call.seed,
            stream: self.stream,
            first_row: call.first_row(),
            offset: self.offset,
            local: self.local,
            width: self.width,
            call,
        })
    }
}

/// A site's mask for one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mask {
    pub p: f32,
    pub seed: u64,
    pub stream: u64,
    /// Global row of the micro-batch's first token.
    pub first_row: u64,
    pub offset: u64,
    pub local: u64,
    pub width: u64,
    pub call: DropCall,
}

impl Mask {
    /// A mask for the embedding site (features `0..width`), outside any layer.
    pub fn embedding(p: f32, call: DropCall, width: usize) -> Option<Self> {
        (p > 0.0).then(|| Mask {
            p,
            seed: call.seed,
            stream: stream_id("wte.drop"),
            first_row: call.first_row(),
            offset: 0,
            local: width as u64,
            width: width as u64,
            call,
        })
    }

    /// `x (rows, local) *= mask` for rows `row..` of the micro-batch (row `row` of its
    /// `b·T` tokens first), this rank's features: the forward's dropout, and its backward.
    pub fn apply(&self, x: &mut [f32], row: usize) {
        for (r, xr) in x.chunks_exact_mut(self.local as usize).enumerate() {
            let base = (self.first_row + (row + r) as u64) * self.width + self.offset;
            for (j, v) in xr.iter_mut().enumerate() {
                *v *= dropout_scale(self.p, self.seed, self.stream, base + j as u64);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call() -> DropCall {
        DropCall::new(1234, 3, 4, 16)
    }

    /// The fraction dropped is p, and the kept values are scaled by exactly 1 / (1 − p).
    #[test]
    fn drops_a_fraction_p_and_scales_the_rest() {
        for p in [0.1f32, 0.5] {
            let m = Mask::embedding(p, call(), 64).unwrap();
            let mut x = vec![1.0f32; 64 * 2000];
            m.apply(&mut x, 0);
            let dropped = x.iter().filter(|&&v| v == 0.0).count() as f64 / x.len() as f64;
            assert!(
                (dropped - f64::from(p)).abs() < 0.005,
                "p {p}: dropped {dropped}"
            );
            let kept = 1.0 / (1.0 - p);
            assert!(x.iter().all(|&v| v == 0.0 || v == kept), "p {p}");
            // The mean is kept (inverted dropout).
            let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / x.len() as f64;
            assert!((mean - 1.0).abs() < 0.01, "p {p}: mean {mean}");
        }
        assert!(
            Mask::embedding(0.0, call(), 64).is_none(),
            "p = 0 is no mask"
        );
    }

    /// A shard (rows of SP, features of TP) draws the slice of the whole tensor's mask, and the
    /// step, the micro-batch's place and the site all change it.
    #[test]
    fn a_shard_draws_the_slice_of_the_whole_mask() {
        let whole = Site::new("h.1.mlp.resid_drop", 0.3, 0, 8, 8);
        whole.arm(Some(call()));
        let mut full = vec![1.0f32; 6 * 8];
        whole.mask().unwrap().apply(&mut full, 0);
        // TP 2, rank 1: features 4..8; SP: rows 3..6.
        let shard = Site::new("h.1.mlp.resid_drop", 0.3, 4, 4, 8);
        shard.arm(Some(call()));
        let mut part = vec![1.0f32; 3 * 4];
        shard.mask().unwrap().apply(&mut part, 3);
        for r in 0..3 {
            assert_eq!(
                part[r * 4..r * 4 + 4],
                full[(3 + r) * 8 + 4..(3 + r) * 8 + 8]
            );
        }
        // A micro-batch starting one sequence later (another DP replica, or the next
        // micro-batch) draws, for its first rows, what the whole batch draws at those rows.
        let later = Site::new("h.1.mlp.resid_drop", 0.3, 0, 8, 8);
        later.arm(Some(DropCall::new(1234, 3, 5, 16)));
        let mut x = vec![1.0f32; 6 * 8];
        later.mask().unwrap().apply(&mut x, 0);
        let mut y = vec![1.0f32; 22 * 8];
        whole.mask().unwrap().apply(&mut y, 0);
        assert_eq!(x[..], y[16 * 8..], "the same global rows, the same mask");
        assert_ne!(x[..], y[..6 * 8], "other rows, another mask");
        let mut z = vec![1.0f32; 6 * 8];
        whole.arm(Some(DropCall::new(1234, 4, 4, 16)));
        whole.mask().unwrap().apply(&mut z, 0);
        assert_ne!(z, full, "another step, another mask");
        whole.arm(None);
        assert!(whole.mask().is_none(), "disarmed: no dropout (evaluation)");
    }
}
