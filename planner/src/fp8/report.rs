//! What FP8 would change for a plan's layout: the step and the peak memory with and without the
//! recipe, and each linear of a layer with its 16-bit time against its FP8 GEMMs plus casts.
//!
//! FP8 wins on a linear only where the GEMMs' saving beats the casts' cost (torchao's float8
//! README: "float8 ... speedups ... when M, K, N are large enough"; small linears lose to the
//! memory-bound casts), so the rows say "wins" or "loses" one by one. The layout is the plan's:
//! the search never switches FP8 on.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::device::Fp8Device;
use super::Recipe;
use crate::cost::ops::{self, Device};
use crate::layout::Layout;
use crate::model::Model;
use crate::spec::Cluster;

/// One linear of a layer on one rank, for one micro-batch, forward and backward together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Fp8Linear {
    /// `qkv`, `proj`, `fc1`, `fc2`, `gate_up`, `down`, or MLA's projections.
    pub name: String,
    /// `x (m × k) · w (k × n)` on the rank: tokens, input and output width after TP, SP and CP.
    pub m: f64,
    pub k: f64,
    pub n: f64,
    /// GEMMs of this shape in the layer (SwiGLU's gate and up: 2).
    pub count: f64,
    /// Seconds of its three 16-bit GEMMs.
    pub bf16_s: f64,
    /// Seconds of its three FP8 GEMMs.
    pub fp8_gemm_s: f64,
    /// Seconds of its casts and scale reductions (memory-bound).
    pub cast_s: f64,
    /// Whether `fp8_gemm_s + cast_s < bf16_s`.
    pub wins: bool,
}

/// What FP8 changes for the plan's layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Fp8Change {
    /// The recipe compared: the job's, or `tensorwise` as the example where the job is 16-bit.
    pub recipe: Recipe,
    /// Whether the job runs the recipe (else it is the example).
    pub stated: bool,
    pub step_time_s_bf16: f64,
    pub step_time_s_fp8: f64,
    pub peak_bytes_bf16: u64,
    pub peak_bytes_fp8: u64,
    /// Each linear of one layer, in the layer's order.
    pub linears: Vec<Fp8Linear>,
    /// What the memory model counts under the recipe.
    pub memory: String,
}

/// The linears of one layer of `model` (whose `training.fp8` is the recipe) on `layout`'s rank.
pub fn linears(model: &Model, cluster: &Cluster, layout: &Layout) -> Vec<Fp8Linear> {
    let dev = Device::of(cluster);
    let engine = crate::framework::fp8_engine_on(model, layout);
    let Some(f8) = Fp8Device::of(
        model.training.fp8,
        engine,
        cluster,
        layout.microbatches(model),
    ) else {
        return Vec::new();
    };
    let shapes = ops::block_linears(
        model,
        layout.tp,
        layout.sequence_parallel,
        layout.micro_batch,
        layout.cp.max(1),
    );
    shapes
        .iter()
        .map(|l| {
            let sum = |(f, b): (f64, f64)| (f + b) * l.count;
            let bf16_s = sum(dev.linear_of(l.frozen, l.m, l.k, l.n));
            let fp8_gemm_s = sum(f8.gemms(l.m, l.k, l.n));
            let cast_s = sum(f8.casts(l.m, l.k, l.n));
            Fp8Linear {
                name: l.name.to_string(),
                m: l.m,
                k: l.k,
                n: l.n,
                count: l.count,
                bf16_s,
                fp8_gemm_s,
                cast_s,
                wins: fp8_gemm_s + cast_s < bf16_s,
            }
        })
        .collect()
}

/// What the memory model counts under `recipe` run on `engine`.
pub fn memory_counted(recipe: Recipe, engine: crate::fp8::recipe::Fp8Engine) -> String {
    let mut parts = vec![
        "master weights, gradients and optimizer states as the precision policy says".to_string(),
    ];
    let cache = recipe.weight_cache_bytes(engine);
    if cache > 0.0 {
        parts.push(format!("fp8_weight_cache: the FP8 weight and its transpose, {cache:.4} B per FP8-linear parameter (Transformer Engine)"));
    } else {
        parts.push(
            "no FP8 weight copy kept across micro-batches (the weight cast inside each linear's forward)".into(),
        );
    }
    if recipe.saves_fp8_inputs(engine) {
        parts.push("the linears' saved inputs in FP8 (1 B per element)".into());
    } else {
        parts.push(
            "the linears' saved inputs in 16-bit (torchao saves the high-precision input)".into(),
        );
    }
    if recipe.float8_all_gather(engine) {
        parts.push("under ZeRO-3/FSDP the linears' weights gathered in FP8, 1 B per parameter (float8 all-gather)".into());
    }
    parts.join("; ")
}

/// What FP8 changes for `layout`, where the device has an FP8 peak and the job trains every
/// weight: `own` is the job's own (step seconds, peak bytes), `evaluate` gives them for another
/// model on the same layout and split.
pub fn change(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    own: (f64, u64),
    evaluate: &dyn Fn(&Model) -> (f64, u64),
) -> Option<Fp8Change> {
    if cluster.device.peak_tflops_fp8.is_none() || model.training.method.adapters() {
        return None;
    }
    let stated = !model.training.fp8.is_none();
    let mut other = model.clone();
    other.training.fp8 = if stated {
        Recipe::None
    } else {
        Recipe::Tensorwise
    };
    let theirs = evaluate(&other);
    let (bf16, fp8, fp8_model) = if stated {
        (theirs, own, model)
    } else {
        (own, theirs, &other)
    };
    let recipe = fp8_model.training.fp8;
    Some(Fp8Change {
        recipe,
        stated,
        step_time_s_bf16: bf16.0,
        step_time_s_fp8: fp8.0,
        peak_bytes_bf16: bf16.1,
        peak_bytes_fp8: fp8.1,
        linears: linears(fp8_model, cluster, layout),
        memory: memory_counted(recipe, crate::framework::fp8_engine_on(fp8_model, layout)),
    })
}

/// The "FP8 would change" lines `plan` and `explain` print.
/// The report's lines; `capacity` is the device's memory in bytes, which a peak beyond is named.
pub fn lines(c: &Fp8Change, capacity: u64) -> Vec<String> {
    let head = if c.stated {
        format!(
            "FP8 (training.fp8 = \"{}\") against 16-bit GEMMs, for this layout:",
            c.recipe
        )
    } else {
        format!("FP8 would change, for this layout (recipe \"{}\" as the example; --fp8 RECIPE states one):", c.recipe)
    };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let over = |b: u64| {
        if b > capacity {
            format!(
                " (over the device's {:.2} GiB: does not fit)",
                gib(capacity)
            )
        } else {
            String::new()
        }
    };
    let mut out = vec![
        head,
        format!(
            "  step {:.3} s with FP8, {:.3} s without ({:+.1}%); peak memory {:.2} GiB with{}, {:.2} GiB without{}",
            c.step_time_s_fp8,
            c.step_time_s_bf16,
            100.0 * (c.step_time_s_fp8 / c.step_time_s_bf16 - 1.0),
            gib(c.peak_bytes_fp8),
            over(c.peak_bytes_fp8),
            gib(c.peak_bytes_bf16),
            over(c.peak_bytes_bf16),
        ),
    ];
    for l in &c.linears {
        let shape = format!("{:.0}×{:.0}×{:.0}", l.m, l.k, l.n);
        let count = if l.count > 1.0 {
            format!(" (×{})", l.count)
        } else {
            String::new()
        };
        out.push(format!(
            "  {:<8} {:<24} bf16 {:>9.1} µs; fp8 {:>9.1} µs GEMMs + {:>8.1} µs casts: {}",
            l.name,
            format!("{shape}{count}"),
            l.bf16_s * 1e6,
            l.fp8_gemm_s * 1e6,
            l.cast_s * 1e6,
            if l.wins { "wins" } else { "loses" }
        ));
    }
    out.push(format!("  memory counts: {}", c.memory));
    out
}
