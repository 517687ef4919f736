//! FP8 training: the recipe a job states (`training.fp8`, `--fp8`), what its GEMMs cost at the
//! device's FP8 peak, what its casts and scale reductions cost as memory-bound kernels, and
//! what its framework keeps in memory.
//!
//! The precision policy (`crate::precision`) keeps deciding the bytes per parameter: master
//! weights, gradients and optimizer states are the policy's whatever the recipe. FP8 changes
//! the block's linear layers only (attention's QKV and output projections, the MLP's), as
//! torchao's `convert_to_float8_training` (torchtitan filters the `output` layer), Transformer
//! Engine's `te.Linear`/`LayerNormLinear`/`LayerNormMLP` and Megatron-Core's `TE*Linear`
//! modules do by default: the embedding, the LM head and the attention core (softmax(QKᵀ)V)
//! stay 16-bit. MoE expert GEMMs stay 16-bit here too (torchtitan's float8 grouped GEMM is a
//! prototype). The search never turns a recipe on: the user states it, and `plan` reports what
//! it would change (`report`).
//!
//! Nothing here knows about layouts beyond the shapes it is given.

pub mod device;
pub mod recipe;
pub mod report;

pub use recipe::{Recipe, RECIPES};

use crate::error::Diagnostic;
use crate::layout::Layout;
use crate::model::Model;
use crate::spec::Cluster;

/// An FP8 recipe runs only where the device states its FP8 peak, on a job that trains every
/// weight (an adapter job's frozen base is not cast: not modelled).
/// `model_file` and `cluster_file` are named in the error.
pub fn check(
    model: &Model,
    cluster: &Cluster,
    model_file: &std::path::Path,
    cluster_file: &std::path::Path,
) -> Result<(), Diagnostic> {
    let recipe = model.training.fp8;
    if recipe.is_none() {
        return Ok(());
    }
    if cluster.device.peak_tflops_fp8.is_none() {
        return Err(Diagnostic::new(
            cluster_file,
            "device.peak_tflops_fp8",
            format!(
                "training.fp8 = \"{recipe}\" needs the device's FP8 tensor-core peak, and {} states none (FP8 tensor cores came with Ada and Hopper: sm_89 and later)",
                cluster.device.name
            ),
            "plan with fp8 = \"none\" on this cluster, or use a cluster whose [device] states peak_tflops_fp8 (dgx-h100-80g, h800-deepseek, l40s-48g, l4-24g, rtx4090-24g)",
        ));
    }
    if model.training.method.adapters() {
        return Err(Diagnostic::new(
            model_file,
            "training.fp8",
            format!(
                "training.fp8 = \"{recipe}\" with method \"{}\": FP8 is modelled for full training only",
                model.training.method.name()
            ),
            "set fp8 = \"none\", or method = \"full\"",
        ));
    }
    Ok(())
}

/// Parameters of one layer's FP8 linears on a TP rank (weights only, biases stay 16-bit): all
/// of the block's, or attention's only (`attention_only`: an MoE layer, whose experts stay
/// 16-bit).
pub fn linear_params(model: &Model, tp: u64, attention_only: bool) -> f64 {
    crate::cost::ops::block_linears(model, tp, false, 1, 1)
        .iter()
        .filter(|l| !attention_only || !is_mlp(l.name))
        .map(|l| l.k * l.n * l.count)
        .sum()
}

/// The MLP's linears among [`crate::cost::ops::block_linears`].
fn is_mlp(name: &str) -> bool {
    matches!(name, "fc1" | "fc2" | "gate_up" | "down")
}

/// Bytes of the FP8 weight copies a rank's `dense` and `moe` layers keep on `layout`
/// ([`Recipe::weight_cache_bytes`]; none under ZeRO-3, [`crate::framework::fp8_engine_on`]).
pub fn weight_cache(model: &Model, layout: &Layout, dense: u64, moe: u64) -> f64 {
    let tp = layout.tp;
    let bpp = model
        .training
        .fp8
        .weight_cache_bytes(crate::framework::fp8_engine_on(model, layout));
    if bpp == 0.0 {
        return 0.0;
    }
    bpp * (linear_params(model, tp, false) * dense as f64
        + linear_params(model, tp, true) * moe as f64)
}

/// Why [`weight_cache`] is what it is, for the memory breakdown.
pub fn weight_cache_reason(model: &Model, layout: &Layout, dense: u64, moe: u64) -> String {
    let (r, tp) = (model.training.fp8, layout.tp);
    format!(
        "training.fp8 = \"{r}\": Transformer Engine keeps each FP8 linear's weight and its transpose in FP8 across the micro-batches of a step ({:.4} B per parameter) × {:.0} FP8-linear params per dense layer × {dense} + {:.0} per MoE layer (attention only) × {moe}; the fp32 master weights, gradients and optimizer states are the precision policy's",
        r.weight_cache_bytes(crate::framework::fp8_engine_on(model, layout)),
        linear_params(model, tp, false),
        linear_params(model, tp, true)
    )
}

/// The activations a layer saves that an FP8 recipe stores in 1 byte instead of the policy's
/// width ([`Recipe::saves_fp8_inputs`]): the inputs of the linears that Transformer Engine's
/// modules cast and keep for the weight gradient (the first norm's output, QKV's input and MLA's
/// latents' projections'; the MLP's input; the down projection's input). The output
/// projection's input is the attention's output, which the flash kernel's backward reads in
/// 16-bit: it stays.
pub fn adjust_activations(model: &Model, stored: &mut [crate::memory::stored::Stored]) {
    if !model
        .training
        .fp8
        .saves_fp8_inputs(crate::framework::fp8_engine(model))
    {
        return;
    }
    let w = crate::memory::stored::element_bytes(model);
    for x in stored.iter_mut() {
        if matches!(
            x.name,
            "qkv_input" | "q_up_input" | "kv_up_input" | "mlp_input" | "mlp_down_input"
        ) {
            x.bytes *= 1.0 / w;
        }
    }
}

#[cfg(test)]
mod tests;
