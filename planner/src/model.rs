//! The resolved model and training settings, and exact parameter counts.
//!
//! Specs (TOML presets or Hugging Face configs) resolve into these types; only resolved types
//! reach the memory model and the search, and plan.json embeds them. Nothing here reads files.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

mod job;
mod moe;

pub use job::{Model, Training};
pub use moe::{Mla, Moe, MoeLayerParams, RouterScoring};

/// MLP activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// Two matrices, h→ffn→h.
    Gelu,
    /// Three matrices (gate, up, down), as in Llama.
    Swiglu,
}

/// Normalisation layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Norm {
    /// Weight and bias per channel.
    Layernorm,
    /// Weight only.
    Rmsnorm,
}

/// Position encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Position {
    /// A learned table of `max_positions × hidden`.
    Learned,
    /// Rotary embeddings: no parameters.
    Rope,
}

/// How attention scores are computed, which decides what the backward must keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AttentionImpl {
    /// Flash attention: no s×s matrix is stored, only a log-sum-exp per row.
    Flash,
    /// Materialised softmax (as in Megatron SC'21): the s×s matrices are stored.
    Eager,
}

/// Which flash-attention kernel runs, when `attention` is flash. The kernels do the same
/// arithmetic and keep the same tensors; they differ in speed, which the cost model takes as
/// the FlashAttention-2 paper measured it on the A100: fa1 2.35× and triton 1.83× the time of
/// FlashAttention-2 (`FlashKernel::slowdown`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum FlashKernel {
    /// FlashAttention-2 and kernels of its class (PyTorch's SDPA flash backend; cuDNN's fused
    /// attention where the cluster does not measure it apart): the cluster's
    /// `flash_attention_efficiency` is theirs. A framework whose profile runs cuDNN's fused
    /// attention (`runs.attention_kernel`) takes the cluster's `cudnn_attention_efficiency`.
    #[default]
    Fa2,
    /// FlashAttention (v1, CUDA; flash-attn < 2.0).
    Fa1,
    /// FlashAttention in Triton (`flash_attn.flash_attn_triton`, flash-attn 1.0; llm-foundry's
    /// `attn_impl: triton` in 2023).
    Triton,
}

impl FlashKernel {
    /// How many times longer this kernel takes than FlashAttention-2 for the same work, as the
    /// FlashAttention-2 paper measured it on the A100 (Dao 2023, §4.1, Figs. 4–6: sequence 512
    /// to 16k, head dimension 64 and 128, with and without the causal mask).
    pub fn slowdown(self) -> f64 {
        match self {
            FlashKernel::Fa2 => 1.0,
            // "1.7-3.0× faster than FlashAttention": the range's midpoint.
            FlashKernel::Fa1 => (1.7 + 3.0) / 2.0,
            // "around 1.3-1.5× faster than FlashAttention in Triton in the forward pass and
            // around 2× faster in the backward pass": 1.4 and 2, weighted by the forward's and
            // backward's FLOPs (1 : 2.5).
            FlashKernel::Triton => 1.0 / 3.5 * 1.4 + 2.5 / 3.5 * 2.0,
        }
    }
}

/// A decoder-only transformer, resolved and validated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Architecture {
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub ffn_hidden: u64,
    pub vocab: u64,
    pub activation: Activation,
    pub norm: Norm,
    pub position: Position,
    pub tied_embeddings: bool,
    /// Biases on every linear layer (GPT-2/GPT-3/Megatron style).
    pub bias: bool,
    /// Biases on the Q, K, V projections only (Qwen2 style); implied by `bias`.
    pub qkv_bias: bool,
    /// Rows of the learned position table (0 with RoPE).
    pub max_positions: u64,
    /// The embedding table and output layer are padded to a multiple of this × TP rows, as
    /// Megatron-LM's `--make-vocab-size-divisible-by` does (spec key
    /// `make_vocab_size_divisible_by`, default 128); 1 pads only as far as TP needs. Plans
    /// written before the key existed read as 1.
    #[serde(default = "one")]
    pub vocab_divisible_by: u64,
    /// RoPE base θ (spec key `rope_theta`, HF `rope_theta`; default 10000): pair `i` of a head
    /// of size `d` turns by `pos · θ^(−2i/d)`. Read only with `position = "rope"`. Plans written
    /// before the key existed read as 10000, the value the runtime used then.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// RoPE frequency scaling (spec table `rope_scaling`, HF `rope_scaling` /
    /// `rope_parameters`); absent: none. Only Llama 3.1's `llama3` type exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// ε of every LayerNorm/RMSNorm (spec key `norm_eps`, HF `rms_norm_eps` /
    /// `layer_norm_epsilon`; default 1e-5). Plans written before the key existed read as 1e-5,
    /// the value the runtime used then.
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    /// Sliding-window attention (spec key `sliding_window`, HF `sliding_window`): each query
    /// sees at most this many positions, itself included. The runtime has full causal attention
    /// only, which is the same computation when the window is at least `seq_len`: a smaller
    /// window is refused (`Model::check`). Absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<u64>,
    /// Mixture-of-experts MLPs (spec keys `experts`, `experts_per_token`, …); absent: every
    /// MLP is dense. Planned with expert parallelism (`Layout::ep`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<Moe>,
    /// Multi-head Latent Attention (spec table `[architecture.mla]`, DeepSeek-V2/V3); absent:
    /// standard attention. Planned; the runtime refuses it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<Mla>,
    /// A norm over each query and key head before RoPE (spec key `qk_norm`; Qwen3's `q_norm`
    /// and `k_norm`). Planned; the runtime refuses it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qk_norm: bool,
}

fn one() -> u64 {
    1
}

/// The RoPE base of a spec that names none (and of plans written before `rope_theta`).
pub const DEFAULT_ROPE_THETA: f64 = 10_000.0;
/// The norm ε of a spec that names none (and of plans written before `norm_eps`).
pub const DEFAULT_NORM_EPS: f64 = 1e-5;

fn default_rope_theta() -> f64 {
    DEFAULT_ROPE_THETA
}

fn default_norm_eps() -> f64 {
    DEFAULT_NORM_EPS
}

/// The family an architecture belongs to, as a framework profile's `can_run.architectures`
/// names it: what a framework's model code must build. Read from the architecture's features,
/// not from a name, so a TOML spec and a Hugging Face config of one model agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// Learned positions, LayerNorm, a GeLU MLP (GPT-2, GPT-3, Megatron-LM's GPT).
    Gpt,
    /// RoPE, RMSNorm, a SwiGLU MLP (Llama, Mistral, Qwen2, Mixtral, the Qwen MoE models).
    Llama,
    /// Multi-head Latent Attention (DeepSeek-V2/V3).
    Deepseek,
    /// Any other mix of positions, norm and MLP (a TOML spec may write one).
    Other,
}

impl Family {
    pub const ALL: [Family; 4] = [Family::Gpt, Family::Llama, Family::Deepseek, Family::Other];

    /// The name profiles and messages use.
    pub fn name(self) -> &'static str {
        match self {
            Family::Gpt => "gpt",
            Family::Llama => "llama",
            Family::Deepseek => "deepseek",
            Family::Other => "other",
        }
    }

    /// What the family is, for a message.
    pub fn what(self) -> &'static str {
        match self {
            Family::Gpt => "learned positions, LayerNorm, GeLU MLP",
            Family::Llama => "RoPE, RMSNorm, SwiGLU MLP",
            Family::Deepseek => "Multi-head Latent Attention",
            Family::Other => "a mix of GPT's and Llama's positions, norm and MLP",
        }
    }
}

/// The kind of RoPE frequency scaling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RopeType {
    /// Llama 3.1's (transformers' `_compute_llama3_parameters`): wavelengths above
    /// `original_max_positions / low_freq_factor` are stretched by `factor`, those below
    /// `original_max_positions / high_freq_factor` kept, those between interpolated.
    Llama3,
    /// Any other name in a plan.json (written by hand or by a later version): read so that the
    /// check can name it, and refused there (`Model::check`); never computed.
    #[serde(other)]
    Unknown,
}

/// RoPE frequency scaling, Llama 3.1's `rope_scaling` object.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    pub rope_type: RopeType,
    /// `factor` (8 for Llama 3.1).
    pub factor: f64,
    /// `low_freq_factor` (1 for Llama 3.1).
    pub low_freq_factor: f64,
    /// `high_freq_factor` (4 for Llama 3.1); above `low_freq_factor`.
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings` (8192 for Llama 3.1).
    pub original_max_positions: u64,
}

impl RopeScaling {
    /// The inverse frequency of a pair after scaling, from its unscaled one (f64), as
    /// transformers' `_compute_llama3_parameters` computes it.
    pub fn scale(&self, inv_freq: f64) -> f64 {
        match self.rope_type {
            // Refused by `Model::check`: no model with it reaches a kernel.
            RopeType::Unknown => inv_freq,
            RopeType::Llama3 => {
                let old = self.original_max_positions as f64;
                let low_wavelen = old / self.low_freq_factor;
                let high_wavelen = old / self.high_freq_factor;
                let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
                if wavelen < high_wavelen {
                    inv_freq
                } else if wavelen > low_wavelen {
                    inv_freq / self.factor
                } else {
                    let smooth = (old / wavelen - self.low_freq_factor)
                        / (self.high_freq_factor - self.low_freq_factor);
                    (1.0 - smooth) * inv_freq / self.factor + smooth * inv_freq
                }
            }
        }
    }
}

/// Parameters of one transformer layer, split by how tensor parallelism treats them.
///
/// Counts saturate: `u64::MAX` stands for "more than u64 can count" (a spec with widths near
/// 2^63), which the memory model reads as infinitely many bytes, so such a layout never fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerParams {
    /// Matrices and biases that TP divides (column- and row-parallel weights, column biases).
    pub sharded: u64,
    /// Norm weights and row-parallel biases, replicated on every TP rank.
    pub replicated: u64,
}

/// A saturated count as a number of parameters: `u64::MAX` (overflowed) is infinite.
fn count(x: u64) -> f64 {
    if x == u64::MAX {
        f64::INFINITY
    } else {
        x as f64
    }
}

impl LayerParams {
    /// Both parts (saturating at `u64::MAX`).
    pub fn total(&self) -> u64 {
        self.sharded.saturating_add(self.replicated)
    }
    /// Parameters one TP rank holds; infinite when a part overflowed u64.
    pub fn per_tp_rank(&self, tp: u64) -> f64 {
        count(self.sharded) / tp as f64 + count(self.replicated)
    }
}

impl Architecture {
    /// The family of this architecture (see [`Family`]).
    pub fn family(&self) -> Family {
        if self.mla.is_some() {
            return Family::Deepseek;
        }
        match (self.position, self.norm, self.activation) {
            (Position::Learned, Norm::Layernorm, Activation::Gelu) => Family::Gpt,
            (Position::Rope, Norm::Rmsnorm, Activation::Swiglu) => Family::Llama,
            _ => Family::Other,
        }
    }

    /// Grouped-query (or multi-query) attention: fewer K/V heads than query heads.
    pub fn grouped_query(&self) -> bool {
        self.mla.is_none() && self.kv_heads < self.heads
    }

    /// A GPT as GPT-2 and Megatron-LM build it: GeLU MLP of 4 × hidden, LayerNorm, learned
    /// positions up to `max_positions`, tied embeddings, biases, no vocabulary padding, no
    /// MoE/MLA/sliding window. Callers change what their model differs in.
    pub fn gpt(layers: u64, hidden: u64, heads: u64, vocab: u64, max_positions: u64) -> Self {
        Architecture {
            layers,
            hidden,
            heads,
            kv_heads: heads,
            head_dim: hidden / heads.max(1),
            ffn_hidden: 4 * hidden,
            vocab,
            activation: Activation::Gelu,
            norm: Norm::Layernorm,
            position: Position::Learned,
            tied_embeddings: true,
            bias: true,
            qkv_bias: true,
            max_positions,
            vocab_divisible_by: 1,
            rope_theta: DEFAULT_ROPE_THETA,
            rope_scaling: None,
            norm_eps: DEFAULT_NORM_EPS,
            sliding_window: None,
            moe: None,
            mla: None,
            qk_norm: false,
        }
    }

    /// Width of the query projection (heads × head_dim); equals `hidden` unless head_dim is
    /// explicit. Saturates at `u64::MAX`, as every count below does.
    pub fn q_dim(&self) -> u64 {
        self.heads.saturating_mul(self.head_dim)
    }
    /// Width of each of the K and V projections.
    pub fn kv_dim(&self) -> u64 {
        self.kv_heads.saturating_mul(self.head_dim)
    }
    fn norm_params(&self) -> u64 {
        self.norm_of(self.hidden)
    }

    /// One transformer block with the dense MLP: attention, MLP and its two norms (the MoE
    /// layers of an MoE model are [`Architecture::moe_layer_params`]). Saturating arithmetic:
    /// every count is min(exact, u64::MAX), never a wrapped number.
    pub fn layer_params(&self) -> LayerParams {
        let attention = self.attention_params();
        let mlp = self.mlp_params(self.ffn_hidden);
        LayerParams {
            sharded: attention.sharded.saturating_add(mlp.sharded),
            replicated: self
                .norm_params()
                .saturating_mul(2)
                .saturating_add(attention.replicated)
                .saturating_add(mlp.replicated),
        }
    }

    /// The vocabulary as the embedding table and output layer hold it under TP `tp`: `vocab`
    /// rounded up to a multiple of `vocab_divisible_by × tp` (Megatron-LM's
    /// `_vocab_size_with_padding`). Saturates at `u64::MAX`.
    pub fn padded_vocab(&self, tp: u64) -> u64 {
        let multiple = self.vocab_multiple(tp);
        self.vocab.div_ceil(multiple).saturating_mul(multiple)
    }

    /// What the vocabulary is padded to a multiple of under TP `tp`: `vocab_divisible_by × tp`.
    pub fn vocab_multiple(&self, tp: u64) -> u64 {
        self.vocab_divisible_by.max(1).saturating_mul(tp.max(1))
    }

    /// The vocabulary rows the embedding table and output layer hold under TP `tp`, over all TP
    /// ranks: [`Architecture::padded_vocab`] where the framework pads (`pad`, the profile's
    /// `runs.pad_vocab`), else `vocab` as it is, split into `tp` shards of `ceil(vocab / tp)`
    /// rows (PyTorch's `Shard(0)` of a DTensor gives the first ranks the larger shards; the
    /// largest is the one that bounds time and memory). Saturates at `u64::MAX`.
    pub fn vocab_rows(&self, tp: u64, pad: bool) -> u64 {
        if pad {
            self.padded_vocab(tp)
        } else {
            let tp = tp.max(1);
            self.vocab.div_ceil(tp).saturating_mul(tp)
        }
    }

    /// [`Architecture::embedding_params`] with the vocabulary of TP `tp` as the framework holds
    /// it ([`Architecture::vocab_rows`]): what a rank holds.
    pub fn embedding_params_at(&self, tp: u64, pad: bool) -> LayerParams {
        let mut p = self.embedding_params();
        p.sharded = self.vocab_rows(tp, pad).saturating_mul(self.hidden);
        p
    }

    /// [`Architecture::head_params`] with the vocabulary of TP `tp` as the framework holds it.
    pub fn head_params_at(&self, shares_embedding: bool, tp: u64, pad: bool) -> LayerParams {
        let mut p = self.head_params(shares_embedding);
        if !shares_embedding {
            p.sharded = self.vocab_rows(tp, pad).saturating_mul(self.hidden);
        }
        p
    }

    /// Token embedding (vocab-parallel) plus the learned position table (replicated), as
    /// published (no padding).
    pub fn embedding_params(&self) -> LayerParams {
        let positions = match self.position {
            Position::Learned => self.max_positions.saturating_mul(self.hidden),
            Position::Rope => 0,
        };
        LayerParams {
            sharded: self.vocab.saturating_mul(self.hidden),
            replicated: positions,
        }
    }

    /// Final norm plus the output projection (absent when tied to the embedding on one stage).
    pub fn head_params(&self, shares_embedding: bool) -> LayerParams {
        let proj = if shares_embedding {
            0
        } else {
            self.vocab.saturating_mul(self.hidden)
        };
        LayerParams {
            sharded: proj,
            replicated: self.norm_params(),
        }
    }

    /// Exact parameter count of the model as published (tied weights counted once); saturates
    /// at `u64::MAX` for a model too large to count (see [`Architecture::checked_param_count`]).
    pub fn param_count(&self) -> u64 {
        let moe_layers = self.moe_layer_count();
        let moe = self
            .moe_layer_params()
            .map_or(0, |p| moe_layers.saturating_mul(p.total()));
        (self.layers - moe_layers)
            .saturating_mul(self.layer_params().total())
            .saturating_add(moe)
            .saturating_add(self.embedding_params().total())
            .saturating_add(self.head_params(self.tied_embeddings).total())
    }

    /// The parameter count, or `None` when it does not fit in a u64.
    pub fn checked_param_count(&self) -> Option<u64> {
        Some(self.param_count()).filter(|p| *p != u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn tiny() -> Architecture {
        Architecture::gpt(4, 64, 4, 256, 128)
    }

    #[test]
    fn param_counts_saturate_instead_of_wrapping() {
        let a = tiny();
        // 4 · (12·64² + 13·64) + 256·64 + 128·64 + 2·64, written out.
        assert_eq!(
            a.param_count(),
            4 * (12 * 64 * 64 + 13 * 64) + 384 * 64 + 128
        );
        assert_eq!(a.checked_param_count(), Some(a.param_count()));
        let big = i64::MAX as u64;
        for set in [
            (|a: &mut Architecture, v| a.vocab = v) as fn(&mut Architecture, u64),
            |a, v| a.hidden = v,
            |a, v| a.layers = v,
            |a, v| a.ffn_hidden = v,
            |a, v| a.heads = v,
        ] {
            let mut a = tiny();
            set(&mut a, big);
            assert_eq!(a.param_count(), u64::MAX);
            assert_eq!(a.checked_param_count(), None);
        }
        let mut a = tiny();
        a.vocab = big;
        a.hidden = big;
        assert_eq!(a.layer_params().total(), u64::MAX);
        assert_eq!(a.layer_params().per_tp_rank(1 << 62), f64::INFINITY);
        assert_eq!(a.embedding_params().per_tp_rank(big), f64::INFINITY);
    }
}
