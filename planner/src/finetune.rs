//! How a job fine-tunes: the whole model (`full`, as pretraining does), or low-rank adapters on a
//! frozen base (`lora`), or on a base stored in NF4 (`qlora`). This module holds the method, the
//! `[lora]` settings, the targets' names as Hugging Face PEFT spells them per family, and the
//! counts: trainable (adapter) and frozen (base) parameters, exactly as PEFT counts them, and
//! what one rank holds of each under tensor parallelism.
//!
//! Adapters shard as the base linear does (NeMo's rule, docs/finetuning.md): on a
//! column-parallel linear (Q, K, V, gate, up) B is split by output columns and A is replicated;
//! on a row-parallel linear (O, down) A is split by input rows, B is replicated, and the rank-r
//! intermediate is summed over TP.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::model::{Activation, Architecture, Family, LayerParams};
use crate::spec::Problem;

/// How the job trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Every parameter trains (pretraining's accounting).
    #[default]
    Full,
    /// Low-rank adapters on a frozen 16-bit base (Hu et al. 2021; PEFT's `LoraConfig`).
    Lora,
    /// Low-rank adapters on a frozen NF4 base (Dettmers et al. 2023).
    Qlora,
}

impl Method {
    pub const NAMES: [&'static str; 3] = ["full", "lora", "qlora"];

    pub fn by_name(name: &str) -> Option<Method> {
        match name {
            "full" => Some(Method::Full),
            "lora" => Some(Method::Lora),
            "qlora" => Some(Method::Qlora),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Method::Full => "full",
            Method::Lora => "lora",
            Method::Qlora => "qlora",
        }
    }

    pub fn is_full(&self) -> bool {
        *self == Method::Full
    }

    /// Adapters on a frozen base.
    pub fn adapters(self) -> bool {
        self != Method::Full
    }
}

/// The precision of the optimizer's moments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub enum OptimizerStates {
    /// The precision policy's own moments.
    #[default]
    #[serde(rename = "policy")]
    Policy,
    /// bitsandbytes' AdamW8bit: 1 B per moment, plus an fp32 absmax per block of 256.
    #[serde(rename = "8bit")]
    Bit8,
}

impl OptimizerStates {
    pub fn by_name(name: &str) -> Option<OptimizerStates> {
        match name {
            "policy" => Some(OptimizerStates::Policy),
            "8bit" => Some(OptimizerStates::Bit8),
            _ => None,
        }
    }
    pub fn is_policy(&self) -> bool {
        *self == OptimizerStates::Policy
    }
}

/// Elements per absmax block of bitsandbytes' 8-bit optimizers (`blocksize=256` in
/// `bitsandbytes/optim/optimizer.py`, `Optimizer8bit`).
pub const BNB_8BIT_BLOCK: f64 = 256.0;

/// A linear layer of a transformer block that can carry an adapter.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    Q,
    K,
    V,
    /// The fused Q, K, V projection (GPT-2's `c_attn`).
    Qkv,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 8] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::Qkv,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Target::Q => "q",
            Target::K => "k",
            Target::V => "v",
            Target::Qkv => "qkv",
            Target::O => "o",
            Target::Gate => "gate",
            Target::Up => "up",
            Target::Down => "down",
        }
    }

    pub fn by_name(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Column-parallel under Megatron's TP (split by output columns); else row-parallel.
    pub fn column_parallel(self) -> bool {
        !matches!(self, Target::O | Target::Down)
    }

    /// `(in, out)` features of the linear in `a`.
    pub fn shape(self, a: &Architecture) -> (u64, u64) {
        let (h, q, kv, f) = (a.hidden, a.q_dim(), a.kv_dim(), a.ffn_hidden);
        match self {
            Target::Q => (h, q),
            Target::K | Target::V => (h, kv),
            Target::Qkv => (h, q.saturating_add(kv.saturating_mul(2))),
            Target::O => (q, h),
            Target::Gate | Target::Up => (h, f),
            Target::Down => (f, h),
        }
    }

    /// The module name PEFT's `target_modules` takes for this linear in a model of `family`
    /// (transformers' module names: `LlamaAttention.q_proj`, `GPT2Attention.c_attn`, …), or why
    /// the family has none.
    pub fn peft_name(self, family: Family) -> Result<&'static str, String> {
        match (family, self) {
            (Family::Llama, Target::Q) => Ok("q_proj"),
            (Family::Llama, Target::K) => Ok("k_proj"),
            (Family::Llama, Target::V) => Ok("v_proj"),
            (Family::Llama, Target::O) => Ok("o_proj"),
            (Family::Llama, Target::Gate) => Ok("gate_proj"),
            (Family::Llama, Target::Up) => Ok("up_proj"),
            (Family::Llama, Target::Down) => Ok("down_proj"),
            (Family::Llama, Target::Qkv) => Err("the llama family projects Q, K and V apart (q_proj, k_proj, v_proj): name them q,k,v".into()),
            (Family::Gpt, Target::Qkv) => Ok("c_attn"),
            (Family::Gpt, Target::O) => Ok("attn.c_proj"),
            (Family::Gpt, Target::Up) => Ok("mlp.c_fc"),
            (Family::Gpt, Target::Down) => Ok("mlp.c_proj"),
            (Family::Gpt, Target::Q | Target::K | Target::V) => Err("the gpt family fuses Q, K and V into one projection (GPT-2's c_attn): name it qkv".into()),
            (Family::Gpt, Target::Gate) => Err("the gpt family's MLP has no gate (a GeLU MLP: c_fc, c_proj): target up,down".into()),
            (Family::Deepseek, _) => Err("adapters on Multi-head Latent Attention are not supported yet: its projections (q_a_proj, kv_a_proj_with_mqa, …) have no targets here".into()),
            (Family::Other, _) => Err("the architecture is neither the gpt family (learned positions, LayerNorm, GeLU) nor the llama family (RoPE, RMSNorm, SwiGLU), so its Hugging Face module names are unknown".into()),
        }
    }
}

/// The `[lora]` settings (PEFT's `LoraConfig`: `r`, `lora_alpha`, `lora_dropout`,
/// `target_modules`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Lora {
    pub rank: u64,
    pub alpha: f64,
    pub dropout: f64,
    /// Sorted, without repeats.
    pub targets: Vec<Target>,
}

/// PEFT's default rank and alpha (`LoraConfig`: `r = 8`, `lora_alpha = 8`).
pub const DEFAULT_RANK: u64 = 8;

impl Lora {
    /// The adapter's output scale, `alpha / rank` (PEFT's `scaling`).
    pub fn scaling(&self) -> f64 {
        self.alpha / self.rank.max(1) as f64
    }

    /// Every linear a block of `a` has (the default targets: PEFT's `all-linear`, less the
    /// output head).
    pub fn all_linear(a: &Architecture) -> Vec<Target> {
        match (a.family(), a.activation) {
            (Family::Gpt, _) | (_, Activation::Gelu) => {
                vec![Target::Qkv, Target::O, Target::Up, Target::Down]
            }
            _ => vec![
                Target::Q,
                Target::K,
                Target::V,
                Target::O,
                Target::Gate,
                Target::Up,
                Target::Down,
            ],
        }
    }

    /// The targets' PEFT module names for `a`'s family.
    pub fn peft_modules(&self, a: &Architecture) -> Result<Vec<&'static str>, String> {
        self.targets
            .iter()
            .map(|t| t.peft_name(a.family()))
            .collect()
    }

    /// Adapter parameters of one transformer block, split as TP splits them (see the module
    /// documentation): `sharded` divides by TP, `replicated` sits whole on every TP rank.
    pub fn layer_params(&self, a: &Architecture) -> LayerParams {
        let r = self.rank;
        let mut p = LayerParams::default();
        for t in &self.targets {
            let (i, o) = t.shape(a);
            let (split, whole) = if t.column_parallel() {
                (o, i) // B (out × r) split by rows; A (r × in) replicated
            } else {
                (i, o) // A (r × in) split by columns; B (out × r) replicated
            };
            p.sharded = p.sharded.saturating_add(r.saturating_mul(split));
            p.replicated = p.replicated.saturating_add(r.saturating_mul(whole));
        }
        p
    }

    /// Trainable parameters of the whole model: every block's adapters (PEFT's count).
    pub fn trainable(&self, a: &Architecture) -> u64 {
        self.layer_params(a).total().saturating_mul(a.layers)
    }
}

/// Parameters of one block's linear weights (not biases, norms or embeddings): what QLoRA
/// stores in NF4 (every `nn.Linear` of the blocks; transformers keeps the output head in 16
/// bits), split as TP splits them.
pub fn linear_weights(a: &Architecture) -> LayerParams {
    let (h, q, kv, f) = (a.hidden, a.q_dim(), a.kv_dim(), a.ffn_hidden);
    let mlp_in = match a.activation {
        Activation::Gelu => 1,
        Activation::Swiglu => 2,
    };
    LayerParams {
        sharded: h
            .saturating_mul(q.saturating_add(kv.saturating_mul(2)))
            .saturating_add(q.saturating_mul(h))
            .saturating_add(h.saturating_mul(f).saturating_mul(mlp_in + 1)),
        replicated: 0,
    }
}

/// The largest linear weight of a block on one TP rank, in parameters: what QLoRA holds
/// dequantized at once.
pub fn largest_linear(a: &Architecture, tp: u64) -> f64 {
    [Target::Qkv, Target::O, Target::Up, Target::Down]
        .iter()
        .map(|t| {
            let (i, o) = t.shape(a);
            i as f64 * o as f64 / tp.max(1) as f64
        })
        .fold(0.0, f64::max)
}

/// Bytes per parameter of NF4 storage with bitsandbytes' double quantization: 4 bits per
/// weight, one 8-bit absmax per block of 64, and one fp32 second-level absmax per 256 of those
/// (`quantize_4bit(blocksize=64, compress_statistics=True)`; QLoRA §3, "Double Quantization":
/// 0.127 bits per parameter of constants): 0.5 + 1/64 + 4/16384.
pub const NF4_BYTES_PER_PARAM: f64 = 0.5 + 1.0 / 64.0 + 4.0 / (64.0 * 256.0);

/// Trainable and frozen parameter counts, as PEFT's `get_nb_trainable_parameters` reports them
/// (`all` = trainable + frozen).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub trainable: u64,
    pub frozen: u64,
}

/// The job's counts: a full fine-tune trains everything.
pub fn counts(a: &Architecture, method: Method, lora: Option<&Lora>) -> Counts {
    let base = a.param_count();
    match (method, lora) {
        (Method::Full, _) | (_, None) => Counts {
            trainable: base,
            frozen: 0,
        },
        (_, Some(l)) => Counts {
            trainable: l.trainable(a),
            frozen: base,
        },
    }
}

/// The method's settings against the architecture: adapters need a `[lora]` table, targets the
/// family has, and a dense base.
pub fn check(a: &Architecture, method: Method, lora: Option<&Lora>) -> Result<(), Problem> {
    let Some(l) = lora else {
        if method.adapters() {
            return Err(Problem::new(
                "lora",
                format!(
                    "training.method = \"{}\" trains adapters, but the spec has no [lora] table",
                    method.name()
                ),
                "add a [lora] table (rank, alpha, targets), or pass --lora-rank",
            ));
        }
        return Ok(());
    };
    if !method.adapters() {
        return Err(Problem::new(
            "lora",
            "a [lora] table configures adapters, but training.method is \"full\", which trains every parameter",
            "set training.method = \"lora\" or \"qlora\", or remove the [lora] table",
        ));
    }
    if l.rank == 0 {
        return Err(Problem::new(
            "lora.rank",
            "must be at least 1, found 0",
            "set rank = 16 (PEFT's default is 8)",
        ));
    }
    if !(l.alpha > 0.0 && l.alpha.is_finite()) {
        return Err(Problem::new(
            "lora.alpha",
            format!("must be a positive number, found {}", l.alpha),
            "set alpha = 2 × rank (e.g. 32 for rank 16), or equal to rank",
        ));
    }
    if !(0.0..1.0).contains(&l.dropout) {
        return Err(Problem::new(
            "lora.dropout",
            format!(
                "a dropout probability must be in [0, 1), found {}",
                l.dropout
            ),
            "set dropout between 0.0 and 0.1 (PEFT's default is 0.0)",
        ));
    }
    if l.targets.is_empty() {
        return Err(Problem::new(
            "lora.targets",
            "no targets: the adapters would train nothing",
            format!(
                "name the linears to adapt, e.g. targets = [{}]",
                Lora::all_linear(a)
                    .iter()
                    .map(|t| format!("\"{}\"", t.name()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    if a.mla.is_some() {
        return Err(Problem::new(
            "training.method",
            format!(
                "adapters on multi-head latent attention (DeepSeek's MLA) are not supported yet (\"{}\")",
                method.name()
            ),
            "fine-tune it with training.method = \"full\"",
        ));
    }
    if a.moe.is_some() {
        // The routed experts are frozen with the rest of the base; adapters go on attention.
        if method == Method::Qlora {
            return Err(Problem::new(
                "training.method",
                "QLoRA on a mixture-of-experts base is not supported yet: its NF4 accounting covers dense blocks only",
                "fine-tune it with training.method = \"lora\" (adapters on attention)",
            ));
        }
        if let Some(t) = l
            .targets
            .iter()
            .find(|t| matches!(t, Target::Gate | Target::Up | Target::Down))
        {
            return Err(Problem::new(
                "lora.targets",
                format!(
                    "target \"{}\": adapters on the MLP of a mixture-of-experts base (one per routed expert, as PEFT adapts each expert's linears) are not supported yet",
                    t.name()
                ),
                "target attention only, e.g. targets = [\"qkv\", \"o\"] (GPT family) or [\"q\", \"k\", \"v\", \"o\"]",
            ));
        }
    }
    let family = a.family();
    for t in &l.targets {
        if let Err(why) = t.peft_name(family) {
            let has = Lora::all_linear(a)
                .iter()
                .filter(|t| t.peft_name(family).is_ok())
                .map(|t| t.name())
                .collect::<Vec<_>>();
            let fix = if has.is_empty() {
                "fine-tune it with training.method = \"full\"".to_string()
            } else {
                format!(
                    "use targets of the {} family: {}",
                    family.name(),
                    has.join(",")
                )
            };
            return Err(Problem::new(
                "lora.targets",
                format!("target \"{}\": {why}", t.name()),
                fix,
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama3_8b() -> Architecture {
        let mut a = Architecture::gpt(32, 4096, 32, 128256, 0);
        a.kv_heads = 8;
        a.ffn_hidden = 14336;
        a.activation = Activation::Swiglu;
        a.norm = crate::model::Norm::Rmsnorm;
        a.position = crate::model::Position::Rope;
        a.tied_embeddings = false;
        a.bias = false;
        a.qkv_bias = false;
        a
    }

    #[test]
    fn hand_counted_llama3_8b_adapters() {
        // r·(in + out) per linear, written out: q 4096+4096, k and v 4096+1024 each, o
        // 4096+4096, gate and up 4096+14336 each, down 14336+4096; × 16 × 32 layers.
        let a = llama3_8b();
        let l = Lora {
            rank: 16,
            alpha: 32.0,
            dropout: 0.0,
            targets: Lora::all_linear(&a),
        };
        let per_layer = 8192 + 5120 + 5120 + 8192 + 3 * 18432;
        assert_eq!(l.trainable(&a), 16 * per_layer * 32);
        // Under TP 8 a rank holds B of the column-parallel ones and A of the row-parallel
        // ones split, the rest whole.
        let p = l.layer_params(&a);
        assert_eq!(
            p.sharded,
            16 * (4096 + 1024 + 1024 + 14336 + 14336 + 4096 + 14336)
        );
        assert_eq!(p.replicated, 16 * (4096 * 5 + 4096 + 4096));
    }

    #[test]
    fn nf4_bytes_per_param() {
        // QLoRA §3: double quantization costs 8/64 + 32/(64·256) = 0.127 bits per parameter.
        let bits = (NF4_BYTES_PER_PARAM - 0.5) * 8.0;
        assert!((bits - 0.127).abs() < 0.0005, "{bits}");
    }

    #[test]
    fn family_targets() {
        let gpt = Architecture::gpt(2, 64, 4, 100, 32);
        let l = Lora {
            rank: 4,
            alpha: 8.0,
            dropout: 0.0,
            targets: vec![Target::Gate],
        };
        let e = check(&gpt, Method::Lora, Some(&l)).unwrap_err();
        assert_eq!(e.field, "lora.targets");
        assert!(e.problem.contains("no gate"), "{}", e.problem);
        assert!(e.fix.contains("qkv,o,up,down"), "{}", e.fix);
        let l = Lora {
            targets: vec![Target::Q],
            ..l
        };
        assert!(check(&llama3_8b(), Method::Lora, Some(&l)).is_ok());
        assert!(check(&gpt, Method::Lora, Some(&l)).is_err());
        assert!(check(&gpt, Method::Lora, None).is_err());
        assert!(check(&gpt, Method::Full, Some(&l)).is_err());
    }
}
