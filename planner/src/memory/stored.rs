//! The vocabulary of activation memory: a stored tensor, how tensor parallelism splits it, the
//! attention core's widths and the bytes per element. The cost model, FP8 and the adapters'
//! memory read these without the per-layer lists of `activations`, which read them back.

use crate::model::{Architecture, Mla, Model};

/// Per-token widths (elements, before TP) of the tensors the attention core reads and writes,
/// and the per-head sizes of its two products. Standard attention: Q and the output are
/// `heads × head_dim`, K and V `kv_heads × head_dim`. MLA (DeepSeek-V2 §2.1; Megatron-Core's
/// `MLASelfAttention`, `k_channels = qk_head_dim + qk_pos_emb_head_dim`, `v_channels =
/// v_head_dim`): Q and K are `heads × (qk_nope + qk_rope)` (the shared RoPE key is expanded to
/// every head before the kernel), V and the output `heads × v_head_dim`. The memory and cost
/// models take them from here, never from `q_dim()`/`kv_dim()`, which describe only standard
/// attention (under MLA `kv_dim()` is K's width, not V's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionWidths {
    pub q: f64,
    pub k: f64,
    pub v: f64,
    /// The attention output: the output projection's input.
    pub o: f64,
    /// Channels per head of Q·Kᵀ (the scores' inner dimension) and of P·V (the output's).
    pub d_qk: f64,
    pub d_v: f64,
}

impl AttentionWidths {
    pub fn of(a: &Architecture) -> AttentionWidths {
        let heads = a.heads as f64;
        match &a.mla {
            None => AttentionWidths {
                q: a.q_dim() as f64,
                k: a.kv_dim() as f64,
                v: a.kv_dim() as f64,
                o: a.q_dim() as f64,
                d_qk: a.head_dim as f64,
                d_v: a.head_dim as f64,
            },
            Some(m) => {
                let d_qk = mla_qk(m);
                let d_v = m.v_head_dim as f64;
                AttentionWidths {
                    q: heads * d_qk,
                    k: heads * d_qk,
                    v: heads * d_v,
                    o: heads * d_v,
                    d_qk,
                    d_v,
                }
            }
        }
    }
}

/// MLA's query/key head: `qk_nope_head_dim + qk_rope_head_dim` channels.
fn mla_qk(m: &Mla) -> f64 {
    m.qk_nope_head_dim as f64 + m.qk_rope_head_dim as f64
}

/// How tensor parallelism treats a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// The full tensor sits on every TP rank (norm inputs, block inputs, residual masks),
    /// unless sequence parallelism splits it along the sequence.
    Replicated,
    /// Each TP rank holds 1/t (its heads or its slice of the MLP).
    Sharded,
    /// Whole on every TP rank, with or without sequence parallelism (a LoRA adapter's rank-r
    /// intermediate, and its dropped copy of a gathered input).
    Whole,
}

/// One tensor a layer keeps for backward.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub name: &'static str,
    /// Bytes for one micro-batch, before tensor parallelism.
    pub bytes: f64,
    pub split: Split,
    /// Part of the attention core that selective recompute drops (the s×s tensors).
    pub attention_core: bool,
    /// The layer's input: the only tensor full recompute keeps.
    pub layer_input: bool,
    /// A matrix multiply's output: per-op selective checkpointing (torchtitan's op SAC) keeps
    /// every second one.
    pub mm_output: bool,
    /// The fused attention kernel's output (and log-sum-exp): op SAC keeps it.
    pub sdpa_output: bool,
    /// Kept only by op SAC (a matmul output the backward needs no copy of otherwise).
    pub op_sac_only: bool,
}

/// Bytes per stored activation element under the model's precision policy (2 for 16-bit
/// training, 4 for the CPU backend's f32).
pub(crate) fn element_bytes(model: &Model) -> f64 {
    crate::precision::Policy::by_name(&model.training.precision)
        .map_or(2.0, |p| f64::from(p.activation_bytes))
}
