//! The `[architecture]` table of a TOML model spec as read, before resolution: the dense keys,
//! the mixture-of-experts keys and the `[architecture.mla]` table. Both readers, the dense one
//! (`model`) and the MoE/MLA one (`moe`), take it from here.

use serde::Deserialize;
use toml::Spanned;

use super::fields::{Field, Num};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawArchitecture {
    pub layers: Field<i64>,
    pub hidden: Field<i64>,
    pub heads: Field<i64>,
    pub kv_heads: Field<i64>,
    pub head_dim: Field<i64>,
    pub ffn_hidden: Field<i64>,
    pub vocab: Field<i64>,
    pub activation: Field<String>,
    pub norm: Field<String>,
    pub position: Field<String>,
    pub tied_embeddings: Field<bool>,
    pub bias: Field<bool>,
    pub qkv_bias: Field<bool>,
    pub max_positions: Field<i64>,
    /// Megatron-LM's `--make-vocab-size-divisible-by`: the vocabulary is padded to a multiple
    /// of this × TP.
    pub make_vocab_size_divisible_by: Field<i64>,
    /// Mixture-of-experts: experts per MoE layer, how many each token is routed to, and the
    /// other keys of spec/moe.rs (specs/README.md, "Mixture of experts").
    pub experts: Field<i64>,
    pub experts_per_token: Field<i64>,
    pub moe_ffn_hidden: Field<i64>,
    pub first_dense_layers: Field<i64>,
    pub moe_layer_frequency: Field<i64>,
    pub moe_layers: Field<Vec<Spanned<i64>>>,
    pub shared_experts: Field<i64>,
    pub shared_expert_ffn_hidden: Field<i64>,
    pub shared_expert_gate: Field<bool>,
    pub capacity_factor: Field<Num>,
    pub router_aux_loss_coef: Field<Num>,
    pub router_scoring: Field<String>,
    pub router_score_bias: Field<bool>,
    pub normalize_top_k: Field<bool>,
    pub routed_scaling_factor: Field<Num>,
    pub expert_groups: Field<i64>,
    pub expert_groups_per_token: Field<i64>,
    /// Multi-head Latent Attention (DeepSeek-V2/V3).
    pub mla: Option<Spanned<RawMla>>,
    /// A norm over each query and key head (Qwen3).
    pub qk_norm: Field<bool>,
    /// RoPE base θ (default 10000); only with `position = "rope"`.
    pub rope_theta: Field<Num>,
    /// RoPE frequency scaling (Llama 3.1's `llama3` type); only with `position = "rope"`.
    pub rope_scaling: Option<Spanned<RawRopeScaling>>,
    /// ε of every norm (default 1e-5).
    pub norm_eps: Field<Num>,
    /// Sliding-window attention's window; refused when narrower than `seq_len`.
    pub sliding_window: Field<i64>,
}

/// `[architecture.rope_scaling]`: the keys of Llama 3.1's `rope_scaling` object.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRopeScaling {
    pub rope_type: Field<String>,
    pub factor: Field<Num>,
    pub low_freq_factor: Field<Num>,
    pub high_freq_factor: Field<Num>,
    pub original_max_positions: Field<i64>,
}

/// `[architecture.mla]`: DeepSeek-V2/V3's Multi-head Latent Attention, with HF's key names.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawMla {
    pub q_lora_rank: Field<i64>,
    pub kv_lora_rank: Field<i64>,
    pub qk_nope_head_dim: Field<i64>,
    pub qk_rope_head_dim: Field<i64>,
    pub v_head_dim: Field<i64>,
}
