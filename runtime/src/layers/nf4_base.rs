//! QLoRA's frozen base linears (Dettmers et al. 2023): a linear of the transformer blocks
//! whose weight is stored in NF4 (blocks of 64, double quantization) instead of the flat
//! parameter buffer, and dequantized into a transient f32 buffer just before each GEMM that
//! reads it (the forward's `x·Wᵀ` and the input gradient's `dy·W`; a frozen weight has no
//! weight-gradient GEMM). One linear is dequantized at a time and its buffer freed after the
//! GEMM: the plan's `qlora_dequantized_weight`, the largest linear of a block on the rank.
//!
//! The weight's tensors keep their names and global shapes (`h.0.attn.q.weight (out, in)`),
//! but live outside the [`ParamLayout`](crate::params::ParamLayout): no gradient, optimizer
//! or ZeRO range sees them. The model is built with empty slots; the executor fills them
//! once it knows the initial weights (`exec::nf4`), each from the GLOBAL tensor quantized
//! whole ([`crate::quant::shard`]), so every layout computes with the same values.
//!
//! CPU backend only (host memory), as the adapters on it.

use std::sync::OnceLock;

use crate::backend::cpu::kernels as cpu;
use crate::backend::Backend;
use crate::params::ParamInfo;
use crate::quant::Nf4Shard;

use super::LayerError;

/// The NF4 weight of one linear on this rank: one tensor per fused part, in the order their
/// rows are stacked (`[q_local | k_local | v_local]`).
#[derive(Debug, Default)]
pub struct Nf4Weights {
    /// Each part's name, global shape and this rank's box of it.
    pub parts: Vec<ParamInfo>,
    shards: OnceLock<Vec<Nf4Shard>>,
}

fn unavailable(what: &str) -> LayerError {
    LayerError::Config(format!(
        "QLoRA's NF4 base {what}: it runs on the CPU backend only, after the executor quantized it"
    ))
}

impl Nf4Weights {
    pub fn new(parts: Vec<ParamInfo>) -> Self {
        Nf4Weights {
            parts,
            shards: OnceLock::new(),
        }
    }

    /// Fills the slots (once), one shard per part.
    pub fn load(&self, shards: Vec<Nf4Shard>) -> Result<(), LayerError> {
        let fits = shards.len() == self.parts.len()
            && shards
                .iter()
                .zip(&self.parts)
                .all(|(s, p)| s.numel() == p.len);
        if !fits {
            return Err(LayerError::Config(format!(
                "NF4 shards for {} do not match its parts",
                self.parts[0].name
            )));
        }
        self.shards
            .set(shards)
            .map_err(|_| unavailable("was loaded twice"))
    }

    /// The parts' shards, once loaded.
    pub fn shards(&self) -> Option<&[Nf4Shard]> {
        self.shards.get().map(Vec::as_slice)
    }

    /// Bytes held: every part's codes and state.
    pub fn bytes(&self) -> usize {
        self.shards()
            .map_or(0, |s| s.iter().map(Nf4Shard::bytes).sum())
    }

    /// Each part's shard dequantized, stacked: the `(out_local, in_local)` weight.
    pub fn dequantize(&self) -> Result<Vec<f32>, LayerError> {
        let shards = self.shards().ok_or_else(|| unavailable("is not loaded"))?;
        let mut w = vec![0.0; self.parts.iter().map(|p| p.len).sum()];
        let mut at = 0;
        for (s, p) in shards.iter().zip(&self.parts) {
            s.dequantize_into(p, &mut w[at..at + p.len])?;
            at += p.len;
        }
        Ok(w)
    }

    /// `y (N, m) = x (N, k) · Wᵀ` (overwritten).
    pub fn forward<B: Backend>(
        &self,
        x: B::Ref<'_>,
        y: B::Mut<'_>,
        k: usize,
        m: usize,
    ) -> Result<(), LayerError> {
        let x = B::host(x).ok_or_else(|| unavailable("is on a device"))?;
        let y = B::host_mut(y).ok_or_else(|| unavailable("is on a device"))?;
        let w = self.dequantize()?;
        cpu::matmul_bt(y, x, &w, x.len() / k, k, m, false);
        Ok(())
    }

    /// `dx (N, k) = dy (N, m) · W` (overwritten).
    pub fn input_grad<B: Backend>(
        &self,
        dy: B::Ref<'_>,
        dx: B::Mut<'_>,
        k: usize,
        m: usize,
    ) -> Result<(), LayerError> {
        let dy = B::host(dy).ok_or_else(|| unavailable("is on a device"))?;
        let dx = B::host_mut(dx).ok_or_else(|| unavailable("is on a device"))?;
        let w = self.dequantize()?;
        cpu::matmul(dx, dy, &w, dy.len() / m, m, k, false);
        Ok(())
    }
}
