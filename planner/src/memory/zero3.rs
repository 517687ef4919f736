//! ZeRO-3's gathered parameters outside FSDP2, by the framework's gather unit (the profile's
//! `memory.zero3_fetch`).
//!
//! - `block` (Megatron's distributed optimizer, FSDP1): the current and the prefetched block's
//!   16-bit weights, and one block's 16-bit gradient before its reduce-scatter.
//! - `submodule` (DeepSpeed's stage 3): microsoft/DeepSpeed
//!   deepspeed/runtime/zero/partitioned_param_coordinator.py fetches each leaf module's
//!   parameters when its forward or backward hook fires and releases them after, prefetching
//!   at most `min(stage3_max_live_parameters − available, stage3_prefetch_bucket_size)`
//!   elements ahead and keeping those reused within `stage3_max_reuse_distance`; the
//!   parameters resident at once are bounded by `stage3_max_live_parameters` ("the maximum
//!   number of parameters resident per GPU before releasing", runtime/zero/config.py), or by
//!   the one module in use when that alone is larger. Gradients leave through the stage-3
//!   optimizer's IPG bucket of `reduce_bucket_size` elements (stage3.py), beside the gradient
//!   of the module whose backward just ran. DeepSpeed's defaults (runtime/zero/config.py):
//!   `stage3_max_live_parameters` 1e9, `reduce_bucket_size` 5e8.

use crate::framework::Zero3Fetch;
use crate::layout::Layout;
use crate::model::{Activation, Architecture, Model};

/// DeepSpeed's `stage3_max_live_parameters` default (runtime/zero/config.py).
pub const DS_MAX_LIVE_PARAMETERS: f64 = 1e9;
/// DeepSpeed's `reduce_bucket_size` default, in elements (runtime/zero/config.py).
pub const DS_REDUCE_BUCKET: f64 = 5e8;
/// Bytes per element of the 16-bit gradients ZeRO-3 reduce-scatters.
const GRAD_BYTES: f64 = 2.0;

/// The largest leaf module of the model on a TP rank, in parameters: Megatron's fused QKV
/// projection (hidden × (q + 2 kv)), its MLP's first linear (hidden × ffn, twice that with the
/// gate fused under SwiGLU), the second, the attention's output projection, and the word
/// embedding (vocab × hidden), each split over TP.
pub fn largest_submodule(a: &Architecture, tp: u64) -> f64 {
    let h = a.hidden as f64;
    let gated = if a.activation == Activation::Swiglu {
        2.0
    } else {
        1.0
    };
    let qkv = h * (a.q_dim() + 2 * a.kv_dim()) as f64;
    let fc1 = h * a.ffn_hidden as f64 * gated;
    let fc2 = a.ffn_hidden as f64 * h;
    let proj = a.q_dim() as f64 * h;
    let embedding = a.vocab as f64 * h;
    [qkv, fc1, fc2, proj, embedding]
        .into_iter()
        .fold(0.0, f64::max)
        / tp.max(1) as f64
}

/// The bytes ZeRO-3 holds gathered on a rank: `block` is one block's parameters on the rank
/// (the larger of a dense and an MoE block), `stage_params` the rank's unsharded parameters
/// of its stage, `wb` the bytes of a gathered weight.
pub fn gathered_bytes(
    fetch: Zero3Fetch,
    a: &Architecture,
    tp: u64,
    block: f64,
    stage_params: f64,
    wb: f64,
) -> f64 {
    match fetch {
        Zero3Fetch::Block => block * (2.0 * wb + GRAD_BYTES),
        Zero3Fetch::Submodule => {
            let unit = largest_submodule(a, tp);
            let live = unit.max(DS_MAX_LIVE_PARAMETERS.min(stage_params));
            live * wb + (unit + DS_REDUCE_BUCKET.min(stage_params)) * GRAD_BYTES
        }
    }
}

/// Why [`gathered_bytes`] is what it is, for `tessera explain`.
pub fn reason(fetch: Zero3Fetch, a: &Architecture, tp: u64, stage_params: f64) -> String {
    match fetch {
        Zero3Fetch::Block => "ZeRO-3 all-gathers the current and the prefetched layer's weights, and holds one layer's 16-bit gradient before its reduce-scatter".into(),
        Zero3Fetch::Submodule => format!(
            "DeepSpeed ZeRO-3 gathers one leaf module at a time: resident parameters max(the largest module, {:.0} elements, min(stage3_max_live_parameters 1e9, the stage's {:.0})), and 16-bit gradients of the largest module plus the reduce bucket (min(reduce_bucket_size 5e8, the stage's))",
            largest_submodule(a, tp),
            stage_params
        ),
    }
}

/// A rank's unsharded parameters of its stage: the model's over PP stages and TP ranks (the
/// even share; DeepSpeed's pipeline engine does not run ZeRO-3, so PP is 1 where it matters).
pub fn stage_params(model: &Model, layout: &Layout) -> f64 {
    model.architecture.param_count() as f64 / (layout.pp.max(1) * layout.tp.max(1)) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Megatron SC'21's 530B (h 20480, 105 layers, 128 heads, vocabulary 51,200) under DeepSpeed
    /// ZeRO-3 on 640 GPUs, TP 1: the largest module is the MLP's first linear, 20480 × 81920 =
    /// 1,677,721,600 parameters (QKV 20480 × 61440 = 1,258,291,200; the embedding 51,200 ×
    /// 20480 = 1,048,576,000). Resident: max(1,677,721,600, min(1e9, 529.6e9)) × 2 B =
    /// 3,355,443,200; gradients (1,677,721,600 + 5e8) × 2 B = 4,355,443,200; together
    /// 7,710,886,400 B (7.18 GiB), where the block rule holds 3 × 2 B × 5,033,431,040 (one
    /// layer: 12 h² + 13 h = 5,033,164,800 + 266,240) = 30,200,586,240 B.
    #[test]
    fn deepspeed_gathers_a_module_not_a_block() {
        let a = Architecture::gpt(105, 20480, 128, 51200, 2048);
        assert_eq!(largest_submodule(&a, 1), 1_677_721_600.0);
        let block = a.layer_params().per_tp_rank(1);
        assert_eq!(block, 5_033_431_040.0);
        let stage = 529.6e9;
        assert_eq!(
            gathered_bytes(Zero3Fetch::Submodule, &a, 1, block, stage, 2.0),
            7_710_886_400.0
        );
        assert_eq!(
            gathered_bytes(Zero3Fetch::Block, &a, 1, block, stage, 2.0),
            30_200_586_240.0
        );
        // A model smaller than stage3_max_live_parameters stays gathered whole (its parameters
        // are reused within stage3_max_reuse_distance): GPT-2 124M's 124,439,808 parameters at
        // 2 B, and its gradients through a bucket of the same size (below 5e8), plus the largest
        // module's (the embedding, 50,257 × 768 = 38,597,376).
        let g = Architecture::gpt(12, 768, 12, 50257, 1024);
        let p = 124_439_808.0;
        assert_eq!(largest_submodule(&g, 1), 38_597_376.0);
        assert_eq!(
            gathered_bytes(Zero3Fetch::Submodule, &g, 1, 0.0, p, 2.0),
            p * 2.0 + (38_597_376.0 + p) * 2.0
        );
    }
}
