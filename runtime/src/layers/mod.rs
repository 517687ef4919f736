//! Model layers with Megatron-style tensor parallelism, forward and backward written out.
//!
//! Every module registers its parameter shards in a [`ParamLayout`](crate::params::ParamLayout)
//! at construction and keeps only [`ParamRef`](crate::params::ParamRef)s; `forward` reads the
//! flat parameter buffer, `backward` ACCUMULATES into the flat gradient buffer (same offsets), so
//! micro-batches add up and optimizer / ZeRO / checkpoints see one flat buffer per rank.
//! Layers are generic over the [`Backend`](crate::backend::Backend) that runs their kernels,
//! and collectives take the TP group's [`Collective`](crate::backend::Collective); with t = 1 they are no-ops and the layer is
//! the plain single-device layer (the parity oracle).
//!
//! Layers must not own activations across calls (the caller, i.e. the pipeline executor, keeps
//! one activation set per in-flight micro-batch), decide parallel layouts, or talk to groups
//! other than the TP group they are given.
#![allow(clippy::too_many_arguments)] // explicit llm.c-style forward/backward signatures

pub mod attention;
pub mod block;
mod block_alloc;
mod block_bufs;
mod block_mlp;
pub mod config;
pub mod context_parallel;
pub mod dropout;
pub mod embedding;
pub mod linear;
pub mod lora;
pub mod lora_attach;
pub mod loss;
pub mod mlp;
pub mod moe;
pub mod nf4_base;
pub mod norm;
pub mod tp;
pub mod wgrad;

#[cfg(test)]
mod gpt_tests;
#[cfg(test)]
mod modules_tests;
#[cfg(test)]
pub(crate) mod testkit;

pub use attention::ParallelAttention;
pub use block::{BlockActs, BlockWorkspace, Mlp, TransformerBlock};
pub use config::BlockConfig;
pub use embedding::{PositionEmbedding, VocabParallelEmbedding};
pub use linear::{ColumnParallelLinear, RowParallelLinear};
pub use loss::{vocab_parallel_cross_entropy_backward, vocab_parallel_cross_entropy_forward};
pub use mlp::ParallelMlp;
pub use moe::{EpShard, MoeMlp, MoeWorkspace};
pub use norm::Norm;
/// What a block keeps from forward to backward: the planner's own type, so the plan's choice
/// reaches the runtime unchanged.
pub use tessera_planner::layout::Recompute;
pub use tp::TpShard;
pub use wgrad::WeightStash;

use crate::comm::CommError;
use crate::params::ParamError;

/// MLP non-linearity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// GPT-2: `W2 · gelu(W1 · x)`, tanh approximation.
    Gelu,
    /// LLaMA: `W2 · (silu(Wgate · x) ⊙ (Wup · x))`.
    SwiGlu,
}

/// Normalisation layer kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// Weight and bias.
    LayerNorm,
    /// Weight only.
    RmsNorm,
}

/// Micro-batch geometry: `b` sequences of `t` tokens (activations are `(b·t, hidden)` rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub b: usize,
    pub t: usize,
}

impl Dims {
    /// Rows of an activation: `b · t`.
    pub fn n(&self) -> usize {
        self.b * self.t
    }

    /// Rows a rank holds outside the TP regions: all `n`, or its `n / tp` share under sequence
    /// parallelism.
    pub fn rows(&self, tp: usize, sequence_parallel: bool) -> usize {
        if sequence_parallel {
            self.n() / tp
        } else {
            self.n()
        }
    }
}

/// Why a layer cannot be built or run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LayerError {
    #[error("{what} = {n} is not divisible by the tensor-parallel degree {tp}; pick a TP degree that divides it")]
    NotDivisible {
        what: &'static str,
        n: usize,
        tp: usize,
    },
    #[error("invalid layer configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Param(#[from] ParamError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    #[error(transparent)]
    Quant(#[from] crate::quant::QuantError),
}
