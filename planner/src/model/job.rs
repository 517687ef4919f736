//! The resolved job: the architecture with its training settings, optimizer and adapters. It
//! sits above the fine-tuning, FP8 and optimizer types it holds, which themselves read only the
//! architecture (`super`), so none of them imports the model back.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Architecture, AttentionImpl, FlashKernel};

/// Training settings that the plan depends on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Training {
    pub seq_len: u64,
    /// Sequences per optimizer step.
    pub global_batch: u64,
    /// The whole run's token budget (`training.tokens`, `--tokens`, `--steps`); absent: the plan
    /// is for one step. Plans written before it existed read as absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// Name of the precision/optimizer policy (see `precision`).
    pub precision: String,
    pub attention: AttentionImpl,
    /// The flash kernel (spec key `flash_kernel`, default `fa2`); plans written before the key
    /// existed read as `fa2`.
    #[serde(default)]
    pub flash_kernel: FlashKernel,
    /// Dropout probability; masks are stored only when it is above zero.
    pub dropout: f64,
    /// The framework profile the run is predicted for (spec key `framework`, `--framework`;
    /// `crate::framework`); absent: the planner's default for the device (`megatron-core` on
    /// GPUs, `tessera` on CPUs). Plans written before the key existed read as absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub framework: Option<String>,
    /// How the job fine-tunes (`training.method`, `--method`; `crate::finetune`): plans written
    /// before the key existed, and plans of `full`, carry no key.
    #[serde(default, skip_serializing_if = "crate::finetune::Method::is_full")]
    pub method: crate::finetune::Method,
    /// The optimizer's moments: the policy's own, or bitsandbytes' 8-bit ones
    /// (`training.optimizer_states`, `--optimizer-states`).
    #[serde(
        default,
        skip_serializing_if = "crate::finetune::OptimizerStates::is_policy"
    )]
    pub optimizer_states: crate::finetune::OptimizerStates,
    /// The FP8 recipe of the block's linears (`training.fp8`, `--fp8`; `crate::fp8`): plans
    /// written before the key existed, and plans of `none`, carry no key.
    #[serde(default, skip_serializing_if = "crate::fp8::Recipe::is_none")]
    pub fp8: crate::fp8::Recipe,
    /// Tensor-parallel collectives overlapped with the GEMMs they feed or follow
    /// (`training.tp_comm_overlap`, `--tp-comm-overlap`; `crate::cost::tp_overlap`): Megatron-Core's
    /// `--tp-comm-overlap` (Transformer Engine's userbuffers), torchtitan's async TP. Plans written
    /// before the key existed, and plans without it, carry no key.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tp_comm_overlap: bool,
}

/// A model spec, resolved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Model {
    pub name: String,
    pub architecture: Architecture,
    pub training: Training,
    /// The optimizer (spec table `[optimizer]`); plans written before it existed read with
    /// the defaults (`crate::optimizer`).
    #[serde(default)]
    pub optimizer: crate::optimizer::Optimizer,
    /// The learning-rate schedule (spec table `[schedule]`); defaults as `optimizer`.
    #[serde(default)]
    pub schedule: crate::optimizer::Schedule,
    /// The adapters of a LoRA or QLoRA job (spec table `[lora]`); absent for `full`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<crate::finetune::Lora>,
}

impl Model {
    /// The adapters of a LoRA or QLoRA job; `None` for a full one (a `[lora]` table under
    /// `full` is refused when the spec is read).
    pub fn adapters(&self) -> Option<&crate::finetune::Lora> {
        self.lora
            .as_ref()
            .filter(|_| self.training.method.adapters())
    }
}
