//! The resolved model and training settings, and exact parameter counts.
//!
//! Specs (TOML presets or Hugging Face configs) resolve into these types; only resolved types
//! reach the memory model and the search, and plan.json embeds them. Nothing here reads files.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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
}

/// Training settings that the plan depends on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Training {
    pub seq_len: u64,
    /// Sequences per optimizer step.
    pub global_batch: u64,
    /// Name of the precision/optimizer policy (see `precision`).
    pub precision: String,
    pub attention: AttentionImpl,
    /// Dropout probability; masks are stored only when it is above zero.
    pub dropout: f64,
}

/// A model spec, resolved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Model {
    pub name: String,
    pub architecture: Architecture,
    pub training: Training,
}

/// Parameters of one transformer layer, split by how tensor parallelism treats them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerParams {
    /// Matrices and biases that TP divides (column- and row-parallel weights, column biases).
    pub sharded: u64,
    /// Norm weights and row-parallel biases, replicated on every TP rank.
    pub replicated: u64,
}

impl LayerParams {
    pub fn total(&self) -> u64 {
        self.sharded + self.replicated
    }
    /// Parameters one TP rank holds.
    pub fn per_tp_rank(&self, tp: u64) -> f64 {
        self.sharded as f64 / tp as f64 + self.replicated as f64
    }
}

impl Architecture {
    /// Width of the query projection (heads × head_dim); equals `hidden` unless head_dim is explicit.
    pub fn q_dim(&self) -> u64 {
        self.heads * self.head_dim
    }
    /// Width of each of the K and V projections.
    pub fn kv_dim(&self) -> u64 {
        self.kv_heads * self.head_dim
    }
    fn norm_params(&self) -> u64 {
        match self.norm {
            Norm::Layernorm => 2 * self.hidden,
            Norm::Rmsnorm => self.hidden,
        }
    }

    /// One transformer block: attention, MLP and its two norms.
    pub fn layer_params(&self) -> LayerParams {
        let h = self.hidden;
        let qkv_out = self.q_dim() + 2 * self.kv_dim();
        let mut sharded = h * qkv_out + self.q_dim() * h;
        let mut replicated = 2 * self.norm_params();
        if self.bias || self.qkv_bias {
            sharded += qkv_out;
        }
        if self.bias {
            replicated += h; // attention output (row-parallel) bias
        }
        let f = self.ffn_hidden;
        match self.activation {
            Activation::Gelu => {
                sharded += 2 * h * f;
                if self.bias {
                    sharded += f;
                    replicated += h;
                }
            }
            Activation::Swiglu => {
                sharded += 3 * h * f;
                if self.bias {
                    sharded += 2 * f;
                    replicated += h;
                }
            }
        }
        LayerParams {
            sharded,
            replicated,
        }
    }

    /// Token embedding (vocab-parallel) plus the learned position table (replicated).
    pub fn embedding_params(&self) -> LayerParams {
        let positions = match self.position {
            Position::Learned => self.max_positions * self.hidden,
            Position::Rope => 0,
        };
        LayerParams {
            sharded: self.vocab * self.hidden,
            replicated: positions,
        }
    }

    /// Final norm plus the output projection (absent when tied to the embedding on one stage).
    pub fn head_params(&self, shares_embedding: bool) -> LayerParams {
        let proj = if shares_embedding {
            0
        } else {
            self.vocab * self.hidden
        };
        LayerParams {
            sharded: proj,
            replicated: self.norm_params(),
        }
    }

    /// Exact parameter count of the model as published (tied weights counted once).
    pub fn param_count(&self) -> u64 {
        self.layers * self.layer_params().total()
            + self.embedding_params().total()
            + self.head_params(self.tied_embeddings).total()
    }
}
