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

/// The library a framework's FP8 linears run on (`runs.fp8_linear`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fp8Linear {
    /// torchao's `Float8Linear` (torchtitan's float8 converter): dynamic scaling cast inside
    /// each linear's forward and backward, the 16-bit input saved.
    #[default]
    Torchao,
    /// Transformer Engine's modules (Megatron-Core, llm-foundry's `fc_type = "te"`): fused
    /// cast-transposes writing both FP8 layouts, the FP8 input saved for the weight gradient.
    TransformerEngine,
}

/// How a framework runs its FP8 linears: the library, and whether the FP8 weights are kept
/// across a step's micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fp8Engine {
    pub linear: Fp8Linear,
    pub weight_cache: bool,
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
/// - Transformer Engine's current scaling (tensorwise under a framework whose FP8 linears are
///   TE's, `runs.fp8_linear`; `Float8CurrentScalingQuantizer`): an amax pass (2 B) and the fused
///   cast-transpose (2 + 1 + 1 B) per operand, 6 B in 2 kernels, the weight's in the forward only
///   (its transpose is written there), cached across micro-batches as below where the framework
///   passes `is_first_microbatch` (Megatron-Core: `set_is_first_microbatch`, and TE's
///   `Linear.forward` keeps the quantized weight in `_fp8_workspaces["weight"]` for any recipe).
/// - Transformer Engine's delayed scaling (TE docs, "Using FP8 with Transformer Engine": the
///   scale comes from the amax history, and the cast kernel records the new amax as it goes):
///   one fused cast-transpose per operand writing both layouts, 2 + 1 + 1 = 4 B, for X in the
///   forward (the transposed copy is what the weight gradient reads: TE saves it) and dY in the
///   backward; W's FP8 copy and its transpose are cast once per step (`is_first_microbatch`)
///   and cached across micro-batches, 4 B per weight element per step, where the framework
///   passes that flag (llm-foundry does not: there the weight is cast in every forward).
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

    /// Whether `engine` runs the recipe's casts as Transformer Engine does: delayed and
    /// blockwise scaling are TE's own recipes; tensorwise under TE is its current scaling
    /// (Megatron's `--fp8-recipe tensorwise`); rowwise is torchao's alone.
    fn on_te(self, engine: Fp8Engine) -> bool {
        match self {
            Recipe::Delayed | Recipe::Blockwise => true,
            Recipe::Tensorwise => engine.linear == Fp8Linear::TransformerEngine,
            Recipe::None | Recipe::Rowwise => false,
        }
    }

    /// Whether the FP8 weights are cast once per step and kept across its micro-batches: TE's
    /// recipes where the framework passes `is_first_microbatch` (`engine.weight_cache`).
    fn caches_weight(self, engine: Fp8Engine) -> bool {
        self.on_te(engine) && engine.weight_cache
    }

    /// The cast traffic of the recipe on `engine` ([`CastBytes`] says where each figure comes
    /// from); `None` for 16-bit training.
    pub fn cast_bytes(self, engine: Fp8Engine) -> Option<CastBytes> {
        let tile = 2.0 * 4.0 / ACTIVATION_TILE;
        let per_step = self.caches_weight(engine);
        // TE: one fused cast-transpose per operand (2 + 1 + 1 B), after an amax pass (2 B, one
        // kernel more) where the scale is the current tensor's.
        let te = |activation: f64, weight: f64, kernels: f64| CastBytes {
            input: activation,
            weight_fwd: weight,
            grad_output: activation,
            weight_bwd: 0.0,
            kernels: [kernels, kernels, kernels, 0.0],
            rescale: 0.0,
            rescale_kernels: 0.0,
            weight_per_step: per_step,
        };
        match self {
            Recipe::None => None,
            Recipe::Tensorwise if self.on_te(engine) => Some(te(6.0, 6.0, 2.0)),
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
            Recipe::Delayed => Some(te(4.0, 4.0, 1.0)),
            Recipe::Blockwise => Some(te(4.0 + tile, 4.0 + 2.0 * 4.0 / WEIGHT_BLOCK, 1.0)),
        }
    }

    /// Bytes per FP8-GEMM weight parameter the framework keeps across micro-batches: TE's FP8
    /// weight and its transpose (1 + 1 B, with blockwise's block scales) where it caches them
    /// (`engine.weight_cache`); torchao's dynamic recipes cast the weight inside each linear's
    /// forward and backward and keep no copy beyond the layer (`Float8Linear` holds only the
    /// 16-bit parameter), and TE without `is_first_microbatch` recasts it in every forward.
    pub fn weight_cache_bytes(self, engine: Fp8Engine) -> f64 {
        if !self.caches_weight(engine) {
            return 0.0;
        }
        match self {
            Recipe::Blockwise => 2.0 + 2.0 * 4.0 / WEIGHT_BLOCK,
            _ => 2.0,
        }
    }

    /// Whether the linears save their input for the weight gradient in FP8 (1 B instead of 2):
    /// Transformer Engine saves the FP8 (transposed) input it cast in the forward, whatever the
    /// recipe (DeepSeek-V3 §3.3.3 "we cache the activations in FP8"); torchao saves the 16-bit
    /// input (`ctx.save_for_backward(input_hp, weight_hp_t)`), so its activations do not
    /// change.
    pub fn saves_fp8_inputs(self, engine: Fp8Engine) -> bool {
        self.on_te(engine)
    }

    /// Whether FSDP (ZeRO-3) can all-gather the FP8 weights, 1 B per parameter instead of 2:
    /// torchao's `enable_fsdp_float8_all_gather`, for tensorwise scaling only (torchtitan
    /// 0.2.2 asserts it off with any `recipe_name`, rowwise included). Transformer Engine's
    /// linears gather the 16-bit weights (Megatron's `--fp8-param-gather` is opt-in).
    pub fn float8_all_gather(self, engine: Fp8Engine) -> bool {
        self == Recipe::Tensorwise && engine.linear == Fp8Linear::Torchao
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
