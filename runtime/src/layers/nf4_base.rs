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
//! The GEMMs are the backend's own; the session refuses QLoRA on a device (the NF4 codes are
//! dequantized on the host), so it trains on the CPU backend.

use std::sync::OnceLock;

use crate::backend::{Backend, Storage};
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
        let mut w = vec![0.0; self.numel()];
        self.dequantize_into(&mut w)?;
        Ok(w)
    }

    fn numel(&self) -> usize {
        self.parts.iter().map(|p| p.len).sum()
    }

    fn dequantize_into(&self, w: &mut [f32]) -> Result<(), LayerError> {
        let shards = self.shards().ok_or_else(|| unavailable("is not loaded"))?;
        let mut at = 0;
        for (s, p) in shards.iter().zip(&self.parts) {
            s.dequantize_into(p, &mut w[at..at + p.len])?;
            at += p.len;
        }
        Ok(())
    }

    /// The dequantized weight in a transient backend buffer: written in place where the
    /// backend's buffers are host memory (the CPU's: one buffer, as before), else uploaded.
    fn weight_on<B: Backend>(&self, be: &B) -> Result<B::Buf, LayerError> {
        let mut buf = be.alloc(Storage::Bf16, self.numel())?;
        match B::host_mut(B::view_mut(&mut buf)) {
            Some(w) => self.dequantize_into(w)?,
            None => buf = be.upload(Storage::Bf16, &self.dequantize()?)?,
        }
        Ok(buf)
    }

    /// `y (N, m) = x (N, k) · Wᵀ` (overwritten).
    pub fn forward<B: Backend>(
        &self,
        be: &B,
        x: B::Ref<'_>,
        y: B::Mut<'_>,
        k: usize,
        m: usize,
    ) -> Result<(), LayerError> {
        let w = self.weight_on(be)?;
        let n = B::len(B::rr(&x)) / k;
        be.matmul_bt(y, x, B::view(&w), n, k, m, false)?;
        Ok(())
    }

    /// `dx (N, k) = dy (N, m) · W` (overwritten).
    pub fn input_grad<B: Backend>(
        &self,
        be: &B,
        dy: B::Ref<'_>,
        dx: B::Mut<'_>,
        k: usize,
        m: usize,
    ) -> Result<(), LayerError> {
        let w = self.weight_on(be)?;
        let n = B::len(B::rr(&dy)) / m;
        be.matmul(dx, dy, B::view(&w), n, m, k, false)?;
        Ok(())
    }
}
