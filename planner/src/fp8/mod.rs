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

pub mod report;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::cost::gemm::Gemm;
use crate::error::Diagnostic;
use crate::model::Model;
use crate::spec::Cluster;

/// How FP8 scales are chosen and where they live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Recipe {
    /// 16-bit GEMMs (the precision policy's).
    #[default]
    None,
    /// torchao's dynamic per-tensor scaling: each operand's amax measured, then the cast.
    Tensorwise,
    /// torchao's dynamic per-row scaling (`recipe_name = "rowwise"`).
    Rowwise,
    /// Transformer Engine's delayed scaling: the scale from an amax history of earlier steps.
    Delayed,
    /// DeepSeek-V3's fine-grained scaling (report §3.3.1): 1×128 activation tiles and 128×128
    /// weight blocks, each with its own scale (Transformer Engine's `Float8BlockScaling`).
    Blockwise,
}

/// The recipes by their spec names, in the order errors list them.
pub const RECIPES: [(&str, Recipe); 5] = [
    ("none", Recipe::None),
    ("tensorwise", Recipe::Tensorwise),
    ("rowwise", Recipe::Rowwise),
    ("delayed", Recipe::Delayed),
    ("blockwise", Recipe::Blockwise),
];

/// Elements of one activation scale tile (1×128) and of one weight block (128×128), DeepSeek-V3
/// report §3.3.1 "Fine-Grained Quantization"; each carries one fp32 scale.
pub const ACTIVATION_TILE: f64 = 128.0;
pub const WEIGHT_BLOCK: f64 = 128.0 * 128.0;

/// The memory-bound traffic of one recipe's casts, in bytes per element of each GEMM operand
/// (the linear's input X (m × k), weight W (k × n), output gradient dY (m × n)), and the
/// kernels that move it.
///
/// An amax pass reads the 16-bit tensor (2 B); a cast pass reads it (2 B) and writes 1 B per
/// FP8 layout it produces (Hopper's FP8 GEMMs take only the TN layout, so a tensor that one
/// GEMM reads by rows and another by columns is written twice, or transposed).
/// - torchao's dynamic recipes, as torchao's own roofline counts them
///   (`torchao/testing/training/roofline_utils.py`, `get_tensor_memory_traffic_ovhd_s`, no
///   fusion with the producing op): tensorwise, X and dY each an amax (2) and one cast to both
///   layouts (2 + 1 + 1): 6 B in 2 kernels; W an amax (2) and a cast for each pass (2 + 1 twice):
///   8 B in 3 kernels, its backward cast in the backward. Rowwise, X and dY a cast that also
///   writes a 16-bit transposed copy (2 + 1 + 2) and a cast of that copy (2 + 1): 8 B in 2
///   kernels; W a cast (2 + 1), a transpose (2 + 2) and a cast (2 + 1): 10 B in 3 kernels, the
///   last two in the backward. torchao keeps no FP8 copy between micro-batches.
/// - Transformer Engine's delayed scaling (TE docs, "Using FP8 with Transformer Engine": the
///   scale comes from the amax history, and the cast kernel records the new amax as it goes):
///   one fused cast-transpose per operand writing both layouts, 2 + 1 + 1 = 4 B, for X in the
///   forward (the transposed copy is what the weight gradient reads: TE saves it) and dY in the
///   backward; W's FP8 copy and its transpose are cast once per step (`is_first_microbatch`)
///   and cached across micro-batches, 4 B per weight element per step.
/// - Blockwise (DeepSeek-V3 §3.3.1–3.3.3, §3.5.2; TE's `Float8BlockScaling`): the amax of a
///   tile is local, so one fused pass per operand like delayed, writing both layouts and an
///   fp32 scale per 1×128 tile (4/128 B per element and layout) or per 128×128 weight block
///   (4/16384); the scales are applied inside the GEMM (DeepSeek-V3's promotion to CUDA cores),
///   which the FP8 GEMM efficiency carries.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CastBytes {
    /// Forward: the input's casts and the weight's forward cast.
    pub input: f64,
    pub weight_fwd: f64,
    /// Backward: the output gradient's casts and the weight's backward cast (0 where the
    /// forward wrote both layouts).
    pub grad_output: f64,
    pub weight_bwd: f64,
    /// Kernels of each of the four above.
    pub kernels: [f64; 4],
    /// Whether the weight's FP8 copies are cast once per optimizer step and cached across the
    /// micro-batches (TE), rather than once per micro-batch (torchao).
    pub weight_per_step: bool,
}

impl Recipe {
    pub fn name(self) -> &'static str {
        RECIPES
            .iter()
            .find(|(_, r)| *r == self)
            .map_or("none", |(n, _)| n)
    }

    pub fn by_name(name: &str) -> Option<Recipe> {
        RECIPES.iter().find(|(n, _)| *n == name).map(|(_, r)| *r)
    }

    pub fn is_none(&self) -> bool {
        *self == Recipe::None
    }

    /// The cast traffic of the recipe ([`CastBytes`] says where each figure comes from); `None`
    /// for 16-bit training.
    pub fn cast_bytes(self) -> Option<CastBytes> {
        let tile = 2.0 * 4.0 / ACTIVATION_TILE;
        let te = |activation: f64, weight: f64| CastBytes {
            input: activation,
            weight_fwd: weight,
            grad_output: activation,
            weight_bwd: 0.0,
            kernels: [1.0, 1.0, 1.0, 0.0],
            weight_per_step: true,
        };
        match self {
            Recipe::None => None,
            Recipe::Tensorwise => Some(CastBytes {
                input: 6.0,
                weight_fwd: 5.0,
                grad_output: 6.0,
                weight_bwd: 3.0,
                kernels: [2.0, 2.0, 2.0, 1.0],
                weight_per_step: false,
            }),
            Recipe::Rowwise => Some(CastBytes {
                input: 8.0,
                weight_fwd: 3.0,
                grad_output: 8.0,
                weight_bwd: 7.0,
                kernels: [2.0, 1.0, 2.0, 2.0],
                weight_per_step: false,
            }),
            Recipe::Delayed => Some(te(4.0, 4.0)),
            Recipe::Blockwise => Some(te(4.0 + tile, 4.0 + 2.0 * 4.0 / WEIGHT_BLOCK)),
        }
    }

    /// Bytes per FP8-GEMM weight parameter the framework keeps across micro-batches: TE's FP8
    /// weight and its transpose (1 + 1 B) under delayed and blockwise scaling; torchao's dynamic
    /// recipes cast the weight inside each linear's forward and backward and keep no copy
    /// beyond the layer (`Float8Linear` holds only the 16-bit parameter).
    pub fn weight_cache_bytes(self) -> f64 {
        match self {
            Recipe::Delayed => 2.0,
            Recipe::Blockwise => 2.0 + 2.0 * 4.0 / WEIGHT_BLOCK,
            _ => 0.0,
        }
    }

    /// Whether the linears save their input for the weight gradient in FP8 (1 B instead of 2):
    /// Transformer Engine saves the FP8 (transposed) input it cast in the forward (delayed,
    /// blockwise; DeepSeek-V3 §3.3.3 "we cache the activations in FP8"); torchao saves the
    /// 16-bit input (`ctx.save_for_backward(input_hp, weight_hp_t)`), so its activations do not
    /// change.
    pub fn saves_fp8_inputs(self) -> bool {
        matches!(self, Recipe::Delayed | Recipe::Blockwise)
    }

    /// Whether FSDP (ZeRO-3) can all-gather the FP8 weights, 1 B per parameter instead of 2:
    /// torchao's `enable_fsdp_float8_all_gather`, for tensorwise scaling only (torchtitan
    /// 0.2.2 asserts it off with any `recipe_name`, rowwise included).
    pub fn float8_all_gather(self) -> bool {
        self == Recipe::Tensorwise
    }

    /// The framework that runs the recipe, for refusals.
    pub fn runs_on(self) -> &'static str {
        match self {
            Recipe::None => "every export",
            Recipe::Tensorwise => "the megatron and torchtitan exports",
            Recipe::Rowwise => "the torchtitan export (torchao's rowwise recipe)",
            Recipe::Delayed | Recipe::Blockwise => {
                "the megatron export (Transformer Engine's recipes)"
            }
        }
    }
}

impl std::fmt::Display for Recipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The FP8 side of a device for one job: the FP8 GEMMs and the casts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Device {
    pub recipe: Recipe,
    pub cast: CastBytes,
    /// The tile and wave model at `peak_tflops_fp8 ×` the FP8 GEMM efficiency.
    pub gemm: Gemm,
    /// Weight casts per micro-batch: 1, or 1/micro-batches where the copies are cached.
    pub weight_casts: f64,
}

/// The FP8 GEMM efficiency of a calibration: `gemm_efficiency_fp8`, else the 16-bit
/// `gemm_efficiency`, else the old curve's value at large sizes.
fn fp8_efficiency(cluster: &Cluster) -> f64 {
    let c = &cluster.calibration;
    c.gemm_efficiency_fp8
        .or(c.gemm_efficiency)
        .unwrap_or_else(|| c.matmul_efficiency_at(f64::MAX))
}

impl Fp8Device {
    /// The FP8 side of `cluster`'s device for `recipe`, with `microbatches` per step; `None`
    /// for 16-bit training or a device with no FP8 peak.
    pub fn of(recipe: Recipe, cluster: &Cluster, microbatches: u64) -> Option<Fp8Device> {
        let cast = recipe.cast_bytes()?;
        let peak = cluster.device.peak_tflops_fp8? * 1e12;
        let d = &cluster.device;
        Some(Fp8Device {
            recipe,
            cast,
            gemm: Gemm {
                peak,
                efficiency: fp8_efficiency(cluster),
                sms: d.sms as f64,
                bandwidth: d.memory_bandwidth_gbps * 1e9 * cluster.calibration.memory_efficiency,
                launch: d.kernel_launch_us * 1e-6,
            },
            weight_casts: if cast.weight_per_step {
                1.0 / microbatches.max(1) as f64
            } else {
                1.0
            },
        })
    }

    /// Seconds of the three FP8 GEMMs of `x (m × k) · w (k × n)`: (forward, backward).
    pub fn gemms(&self, m: f64, k: f64, n: f64) -> (f64, f64) {
        let g = &self.gemm;
        (
            g.time_fp8(m, k, n),
            g.time_fp8(m, n, k) + g.time_fp8(k, m, n),
        )
    }

    /// Seconds of the casts and scale reductions around those GEMMs, memory-bound at the
    /// device's achievable bandwidth plus a launch per kernel: (forward, backward).
    pub fn casts(&self, m: f64, k: f64, n: f64) -> (f64, f64) {
        let c = &self.cast;
        let (bw, launch) = (self.gemm.bandwidth, self.gemm.launch);
        // A weight cast once per step is charged to each micro-batch in its share.
        let wc = self.weight_casts;
        let [ki, kw, kg, kwb] = c.kernels;
        let fwd_bytes = c.input * m * k + c.weight_fwd * k * n * wc;
        let bwd_bytes = c.grad_output * m * n + c.weight_bwd * k * n * wc;
        (
            fwd_bytes / bw + (ki + kw * wc) * launch,
            bwd_bytes / bw + (kg + kwb * wc) * launch,
        )
    }

    /// Forward and backward of an FP8 linear: its GEMMs and its casts.
    pub fn linear(&self, m: f64, k: f64, n: f64) -> (f64, f64) {
        let (gf, gb) = self.gemms(m, k, n);
        let (cf, cb) = self.casts(m, k, n);
        (gf + cf, gb + cb)
    }
}

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

/// Bytes of the FP8 weight copies a rank's `dense` and `moe` layers keep
/// ([`Recipe::weight_cache_bytes`]).
pub fn weight_cache(model: &Model, tp: u64, dense: u64, moe: u64) -> f64 {
    let bpp = model.training.fp8.weight_cache_bytes();
    if bpp == 0.0 {
        return 0.0;
    }
    bpp * (linear_params(model, tp, false) * dense as f64
        + linear_params(model, tp, true) * moe as f64)
}

/// Why [`weight_cache`] is what it is, for the memory breakdown.
pub fn weight_cache_reason(model: &Model, tp: u64, dense: u64, moe: u64) -> String {
    let r = model.training.fp8;
    format!(
        "training.fp8 = \"{r}\": Transformer Engine keeps each FP8 linear's weight and its transpose in FP8 across the micro-batches of a step ({:.4} B per parameter) × {:.0} FP8-linear params per dense layer × {dense} + {:.0} per MoE layer (attention only) × {moe}; the fp32 master weights, gradients and optimizer states are the precision policy's",
        r.weight_cache_bytes(),
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
pub fn adjust_activations(model: &Model, stored: &mut [crate::memory::activations::Stored]) {
    if !model.training.fp8.saves_fp8_inputs() {
        return;
    }
    let w = crate::memory::activations::element_bytes(model);
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
