//! The FP8 recipes a job can state, by name, and what each one's casts and caches cost per
//! element: plain data that the model spec holds, kept below the cost and memory models that
//! read it.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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
///   last two in the backward. torchao keeps no FP8 copy between micro-batches. Both recipes
///   run the backward GEMMs without fast accumulation (`Float8LinearConfig`'s
///   `gemm_config_grad_input` and `gemm_config_grad_weight`); with row-wise scales that is
///   cuBLAS's tensorwise GEMM at unit scales followed by `output *= a_scale⁻¹ · b_scale⁻¹`
///   (`torchao/float8/float8_ops.py`, `addmm_float8_unwrapped`: "the rowwise CUTLASS-based
///   kernel is so slow without fast-accum"), one more kernel per GEMM under torch.compile
///   (pytorch/ao#2184), reading and writing the 16-bit output: 2 + 2 B per element of the
///   input gradient (m × k) and of the weight gradient (k × n).
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
    /// Backward: bytes per element of the two backward GEMMs' outputs (the input gradient,
    /// m × k, and the weight gradient, k × n) rescaled after the GEMM, and its kernels.
    pub rescale: f64,
    pub rescale_kernels: f64,
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
            rescale: 0.0,
            rescale_kernels: 0.0,
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
                rescale: 0.0,
                rescale_kernels: 0.0,
                weight_per_step: false,
            }),
            Recipe::Rowwise => Some(CastBytes {
                input: 8.0,
                weight_fwd: 3.0,
                grad_output: 8.0,
                weight_bwd: 7.0,
                kernels: [2.0, 1.0, 2.0, 2.0],
                rescale: 4.0,
                rescale_kernels: 2.0,
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
