//! The model spec in TOML: raw structs close to the file, then one resolved [`Model`].
//!
//! The keys are a contract documented in specs/README.md; add keys, never rename them.

use serde::Deserialize;
use toml::Spanned;

use super::fields::{toml_error, Field, Fields, Num};
use super::raw_arch::{RawArchitecture, RawRopeScaling};
use crate::error::Diagnostic;
use crate::model::{
    Activation, Architecture, AttentionImpl, FlashKernel, Model, Norm, Position, RopeScaling,
    RopeType, Training, DEFAULT_NORM_EPS, DEFAULT_ROPE_THETA,
};
use crate::source::Source;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    name: Field<String>,
    architecture: Option<RawArchitecture>,
    training: Option<RawTraining>,
    optimizer: Option<super::optim::RawOptimizer>,
    schedule: Option<super::optim::RawSchedule>,
    lora: Option<Spanned<super::finetune::RawLora>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTraining {
    pub seq_len: Field<i64>,
    pub global_batch: Field<i64>,
    /// The token budget of the whole run (`15e12`).
    pub tokens: Field<Num>,
    pub precision: Field<String>,
    pub attention: Field<String>,
    pub flash_kernel: Field<String>,
    pub dropout: Field<Num>,
    pub framework: Field<String>,
    /// `full` | `lora` | `qlora` (spec/finetune.rs).
    pub method: Field<String>,
    /// `policy` | `8bit`.
    pub optimizer_states: Field<String>,
    /// `none` | `tensorwise` | `rowwise` | `delayed` | `blockwise` (`crate::fp8`).
    pub fp8: Field<String>,
    /// TP collectives overlapped with their GEMMs (`crate::cost::tp_overlap`).
    pub tp_comm_overlap: Field<bool>,
}

/// All keys of a model spec, for near-key suggestions.
pub const MODEL_KEYS: &[&str] = &[
    "name",
    "architecture",
    "training",
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "ffn_hidden",
    "vocab",
    "activation",
    "norm",
    "position",
    "tied_embeddings",
    "bias",
    "qkv_bias",
    "max_positions",
    "make_vocab_size_divisible_by",
    "experts",
    "experts_per_token",
    "moe_ffn_hidden",
    "first_dense_layers",
    "moe_layer_frequency",
    "moe_layers",
    "shared_experts",
    "shared_expert_ffn_hidden",
    "shared_expert_gate",
    "capacity_factor",
    "router_aux_loss_coef",
    "router_scoring",
    "router_score_bias",
    "normalize_top_k",
    "routed_scaling_factor",
    "expert_groups",
    "expert_groups_per_token",
    "mla",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_norm",
    "rope_theta",
    "rope_scaling",
    "norm_eps",
    "sliding_window",
    "rope_type",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_positions",
    "seq_len",
    "global_batch",
    "tokens",
    "precision",
    "fp8",
    "tp_comm_overlap",
    "attention",
    "flash_kernel",
    "dropout",
    "framework",
    // [optimizer] and [schedule] (spec/optim.rs)
    "optimizer",
    "schedule",
    "lr",
    "min_lr",
    "beta1",
    "beta2",
    "eps",
    "weight_decay",
    "decay_on",
    "clip_grad",
    "warmup_steps",
    "decay",
    "decay_steps",
    "wsd_decay_fraction",
    // fine-tuning (spec/finetune.rs)
    "method",
    "optimizer_states",
    "lora",
    "rank",
    "alpha",
    "targets",
];

/// Training values given on the command line; they override the spec's `[training]`.
#[derive(Debug, Clone, Copy, Default)]
pub struct TrainingOverrides {
    pub seq_len: Option<u64>,
    pub global_batch: Option<u64>,
    /// `--tokens`: the token budget (`training.tokens`).
    pub tokens: Option<u64>,
    /// `--steps`: the budget in optimizer steps (tokens = steps × global batch × sequence).
    pub steps: Option<u64>,
}

impl TrainingOverrides {
    /// The command-line values must be at least 1 (a zero would plan an empty step).
    pub(crate) fn check(&self) -> Result<(), Diagnostic> {
        for (flag, v) in [
            ("--seq-len", self.seq_len),
            ("--global-batch", self.global_batch),
            ("--tokens", self.tokens),
            ("--steps", self.steps),
        ] {
            if v == Some(0) {
                return Err(Diagnostic::new(
                    "<command line>",
                    flag,
                    "must be at least 1, found 0",
                    format!("pass {flag} 1 or more"),
                ));
            }
        }
        Ok(())
    }
}

/// Parses and resolves a TOML model spec.
pub fn parse_model_toml(src: &Source, overrides: TrainingOverrides) -> Result<Model, Diagnostic> {
    let raw: RawModel = toml::from_str(&src.text).map_err(|e| toml_error(src, &e, MODEL_KEYS))?;
    let f = Fields { src };
    let name = f.string("", "name", &raw.name, "\"my-model\"")?;
    let Some(arch) = raw.architecture else {
        return Err(Diagnostic::new(
            &src.path,
            "architecture",
            "the [architecture] table is missing",
            "add an [architecture] table with layers, hidden, heads and vocab (see specs/README.md)",
        )
        .at(Some((1, 1))));
    };
    let architecture = resolve_architecture(&f, &arch)?;
    let raw_training = raw.training.unwrap_or_default();
    let mut training = resolve_training(&f, &raw_training, overrides)?;
    let (method, states, lora) = super::finetune::resolve(
        &f,
        &architecture,
        &raw_training.method,
        &raw_training.optimizer_states,
        raw.lora.as_ref(),
    )?;
    training.method = method;
    training.optimizer_states = states;
    let model = Model {
        name,
        architecture: finish_positions(architecture, &training),
        training,
        optimizer: super::optim::resolve_optimizer(&f, &raw.optimizer.unwrap_or_default())?,
        schedule: super::optim::resolve_schedule(&f, &raw.schedule.unwrap_or_default())?,
        lora,
    };
    model.check().map_err(|p| {
        // A training value given on the command line is blamed on its flag, not the file.
        let flag = match p.field.as_str() {
            "training.seq_len" if overrides.seq_len.is_some() => Some("--seq-len"),
            "training.global_batch" if overrides.global_batch.is_some() => Some("--global-batch"),
            _ => None,
        };
        match flag {
            Some(flag) => Diagnostic::new("<command line>", flag, p.problem, p.fix),
            None => p.in_toml(src),
        }
    })?;
    Ok(model)
}

/// A learned position table defaults to `seq_len` rows.
pub(crate) fn finish_positions(mut a: Architecture, t: &Training) -> Architecture {
    if a.position == Position::Learned && a.max_positions == 0 {
        a.max_positions = t.seq_len;
    }
    a
}

/// Megatron-LM's default `--make-vocab-size-divisible-by`.
pub const DEFAULT_VOCAB_DIVISIBLE_BY: u64 = 128;

pub(crate) fn resolve_architecture(
    f: &Fields,
    a: &RawArchitecture,
) -> Result<Architecture, Diagnostic> {
    const T: &str = "architecture";
    let layers = f.pos_int(T, "layers", &a.layers, "24")?;
    let hidden = f.pos_int(T, "hidden", &a.hidden, "2048")?;
    let heads = f.pos_int(T, "heads", &a.heads, "16")?;
    let vocab = f.pos_int(T, "vocab", &a.vocab, "50257")?;
    let kv_heads = f.opt_pos_int(T, "kv_heads", &a.kv_heads)?.unwrap_or(heads);
    if heads % kv_heads != 0 {
        let span = a.kv_heads.as_ref().map(|s| s.span());
        let divisors = crate::search::divisors::listed(heads);
        return Err(f.err(
            span,
            "architecture.kv_heads",
            format!("heads ({heads}) is not divisible by kv_heads ({kv_heads}); each KV head must serve a whole group of query heads"),
            format!("set kv_heads to a divisor of {heads}: {divisors}"),
        ));
    }
    let mla = super::moe::resolve_mla(f, a)?;
    let head_dim = match (f.opt_pos_int(T, "head_dim", &a.head_dim)?, mla) {
        (Some(d), _) => d,
        // MLA's query and key heads: the channels without and with RoPE.
        (None, Some(m)) => m.qk_nope_head_dim + m.qk_rope_head_dim,
        (None, None) => {
            if hidden % heads != 0 {
                return Err(f.err(
                    a.heads.as_ref().map(|s| s.span()),
                    "architecture.heads",
                    format!("hidden ({hidden}) is not divisible by heads ({heads})"),
                    "choose heads dividing hidden, or give head_dim explicitly",
                ));
            }
            hidden / heads
        }
    };
    let activation = f.choice(
        T,
        "activation",
        &a.activation,
        &[("gelu", Activation::Gelu), ("swiglu", Activation::Swiglu)],
        Some(Activation::Gelu),
    )?;
    let ffn_hidden =
        match f.opt_pos_int(T, "ffn_hidden", &a.ffn_hidden)? {
            Some(v) => v,
            None if activation == Activation::Gelu => 4 * hidden,
            None => return Err(Diagnostic::new(
                &f.src.path,
                "architecture.ffn_hidden",
                "required key `ffn_hidden` is missing: swiglu has no conventional default width",
                "add `ffn_hidden = …` under [architecture] (Llama-3-8B uses 14336)",
            )
            .at(f.src.table_header(T))),
        };
    let norm = f.choice(
        T,
        "norm",
        &a.norm,
        &[("layernorm", Norm::Layernorm), ("rmsnorm", Norm::Rmsnorm)],
        Some(Norm::Layernorm),
    )?;
    let position = f.choice(
        T,
        "position",
        &a.position,
        &[("learned", Position::Learned), ("rope", Position::Rope)],
        Some(Position::Learned),
    )?;
    let bias = a
        .bias
        .as_ref()
        .map_or(activation == Activation::Gelu, |s| *s.get_ref());
    let max_positions = match position {
        Position::Learned => f
            .opt_pos_int(T, "max_positions", &a.max_positions)?
            .unwrap_or(0),
        Position::Rope => 0,
    };
    let vocab_divisible_by = f
        .opt_pos_int(
            T,
            "make_vocab_size_divisible_by",
            &a.make_vocab_size_divisible_by,
        )?
        .unwrap_or(DEFAULT_VOCAB_DIVISIBLE_BY);
    let rope_theta = f.opt_pos_num(T, "rope_theta", &a.rope_theta)?;
    if position == Position::Learned {
        let given = [
            ("rope_theta", a.rope_theta.as_ref().map(|s| s.span())),
            ("rope_scaling", a.rope_scaling.as_ref().map(|s| s.span())),
        ];
        if let Some((key, span)) = given.into_iter().find(|(_, s)| s.is_some()) {
            return Err(f.err(
                span,
                &format!("architecture.{key}"),
                format!("{key} sets rotary embeddings, but position is \"learned\": the key would change nothing"),
                format!("remove {key}, or set position = \"rope\""),
            ));
        }
    }
    let rope_scaling = match &a.rope_scaling {
        None => None,
        Some(s) => Some(resolve_rope_scaling(f, s)?),
    };
    let norm_eps = f
        .opt_pos_num(T, "norm_eps", &a.norm_eps)?
        .unwrap_or(DEFAULT_NORM_EPS);
    let sliding_window = f.opt_pos_int(T, "sliding_window", &a.sliding_window)?;
    let moe = super::moe::resolve_moe(f, a, ffn_hidden)?;
    Ok(Architecture {
        layers,
        hidden,
        heads,
        kv_heads,
        head_dim,
        ffn_hidden,
        vocab,
        activation,
        norm,
        position,
        tied_embeddings: a.tied_embeddings.as_ref().is_some_and(|s| *s.get_ref()),
        bias,
        qkv_bias: bias || a.qkv_bias.as_ref().is_some_and(|s| *s.get_ref()),
        max_positions,
        vocab_divisible_by,
        rope_theta: rope_theta.unwrap_or(DEFAULT_ROPE_THETA),
        rope_scaling,
        norm_eps,
        sliding_window,
        moe,
        mla,
        qk_norm: f.opt_bool(&a.qk_norm).unwrap_or(false),
    })
}

/// `[architecture.rope_scaling]`: every key required (as transformers' llama3 type reads them).
fn resolve_rope_scaling(
    f: &Fields,
    s: &Spanned<RawRopeScaling>,
) -> Result<RopeScaling, Diagnostic> {
    const T: &str = "architecture.rope_scaling";
    let r = s.get_ref();
    let rope_type = f.choice(
        T,
        "rope_type",
        &r.rope_type,
        &[("llama3", RopeType::Llama3)],
        None,
    )?;
    let factor = f.pos_num(T, "factor", &r.factor, "8.0")?;
    let low_freq_factor = f.pos_num(T, "low_freq_factor", &r.low_freq_factor, "1.0")?;
    let high_freq_factor = f.pos_num(T, "high_freq_factor", &r.high_freq_factor, "4.0")?;
    let original_max_positions = f.pos_int(
        T,
        "original_max_positions",
        &r.original_max_positions,
        "8192",
    )?;
    let scaling = RopeScaling {
        rope_type,
        factor,
        low_freq_factor,
        high_freq_factor,
        original_max_positions,
    };
    if let Err(p) = super::check::rope_scaling(&scaling) {
        let key = p.field.rsplit('.').next().unwrap_or("").to_string();
        let span = match key.as_str() {
            "factor" => r.factor.as_ref().map(|v| v.span()),
            "high_freq_factor" => r.high_freq_factor.as_ref().map(|v| v.span()),
            _ => Some(s.span()),
        };
        return Err(f.err(span, &p.field, p.problem, p.fix));
    }
    Ok(scaling)
}

pub(crate) fn resolve_training(
    f: &Fields,
    t: &RawTraining,
    overrides: TrainingOverrides,
) -> Result<Training, Diagnostic> {
    const T: &str = "training";
    overrides.check()?;
    let seq_len = match overrides.seq_len {
        Some(v) => v,
        None => f.pos_int(T, "seq_len", &t.seq_len, "2048")?,
    };
    let global_batch = match overrides.global_batch {
        Some(v) => v,
        None => f.pos_int(T, "global_batch", &t.global_batch, "512")?,
    };
    let precision = match &t.precision {
        None => "default".to_string(),
        Some(s) => {
            let name = s.get_ref().as_str();
            if crate::precision::Policy::by_name(name).is_none() {
                let names = crate::precision::Policy::names();
                let fix = match crate::source::near_key(name, &names) {
                    Some(k) => format!("did you mean \"{k}\"? Policies: {}", names.join(" | ")),
                    None => format!("use one of: {}", names.join(" | ")),
                };
                return Err(f.err(
                    Some(s.span()),
                    "training.precision",
                    format!("unknown precision policy \"{name}\""),
                    fix,
                ));
            }
            name.to_string()
        }
    };
    let attention = f.choice(
        T,
        "attention",
        &t.attention,
        &[
            ("flash", AttentionImpl::Flash),
            ("eager", AttentionImpl::Eager),
        ],
        Some(AttentionImpl::Flash),
    )?;
    let flash_kernel = f.choice(
        T,
        "flash_kernel",
        &t.flash_kernel,
        &[
            ("fa2", FlashKernel::Fa2),
            ("fa1", FlashKernel::Fa1),
            ("triton", FlashKernel::Triton),
        ],
        Some(FlashKernel::Fa2),
    )?;
    if attention == AttentionImpl::Eager {
        if let Some(k) = &t.flash_kernel {
            return Err(f.err(
                Some(k.span()),
                "training.flash_kernel",
                "flash_kernel names the flash-attention kernel, but attention is \"eager\"",
                "remove flash_kernel, or set attention = \"flash\"",
            ));
        }
    }
    let dropout = f.opt_nonneg_num(T, "dropout", &t.dropout)?.unwrap_or(0.0);
    if dropout >= 1.0 {
        return Err(f.err(
            t.dropout.as_ref().map(|s| s.span()),
            "training.dropout",
            format!("a dropout probability must be below 1, found {dropout}"),
            "set dropout between 0.0 and 0.9",
        ));
    }
    let framework = match &t.framework {
        None => None,
        Some(s) => {
            let name = s.get_ref().as_str();
            if crate::framework::by_name(name).is_none() {
                return Err(f.err(
                    Some(s.span()),
                    "training.framework",
                    format!("unknown framework profile \"{name}\""),
                    format!(
                        "use one of: {} (specs/frameworks/)",
                        crate::framework::names().join(" | ")
                    ),
                ));
            }
            Some(name.to_string())
        }
    };
    let tokens = budget_tokens(f, t, overrides, seq_len, global_batch)?;
    let fp8 = f.choice(
        T,
        "fp8",
        &t.fp8,
        &crate::fp8::RECIPES,
        Some(Default::default()),
    )?;
    Ok(Training {
        seq_len,
        global_batch,
        tokens,
        precision,
        attention,
        flash_kernel,
        dropout,
        framework,
        method: Default::default(),
        optimizer_states: Default::default(),
        fp8,
        tp_comm_overlap: f.opt_bool(&t.tp_comm_overlap).unwrap_or(false),
    })
}

/// The run's token budget: `--tokens`, or `--steps` × global batch × sequence, or the spec's
/// `training.tokens` (a number of tokens, `15e12` allowed), rounded to a whole token. Both flags
/// at once are refused (the budget would be said twice).
pub(crate) fn budget_tokens(
    f: &Fields,
    t: &RawTraining,
    over: TrainingOverrides,
    seq_len: u64,
    global_batch: u64,
) -> Result<Option<u64>, Diagnostic> {
    if let Some(n) = cli_budget(over, seq_len, global_batch)? {
        return Ok(Some(n));
    }
    let Some(x) = f.opt_pos_num("training", "tokens", &t.tokens)? else {
        return Ok(None);
    };
    if !(1.0..9.2e18).contains(&x) {
        return Err(f.err(
            t.tokens.as_ref().map(|s| s.span()),
            "training.tokens",
            format!("a token budget must be between 1 and 9.2e18 tokens, found {x}"),
            "set `tokens` to the run's training tokens, e.g. 15e12",
        ));
    }
    Ok(Some(x.round() as u64))
}

/// The budget given on the command line (`--tokens`, or `--steps` × global batch × sequence).
pub(crate) fn cli_budget(
    over: TrainingOverrides,
    seq_len: u64,
    global_batch: u64,
) -> Result<Option<u64>, Diagnostic> {
    let cli = "<command line>";
    if over.tokens.is_some() && over.steps.is_some() {
        return Err(Diagnostic::new(
            cli,
            "--steps",
            "--tokens and --steps both set the run's budget",
            "pass one of them",
        ));
    }
    if let Some(n) = over.tokens {
        return Ok(Some(n));
    }
    over.steps
        .map(|steps| {
            steps
            .checked_mul(global_batch)
            .and_then(|x| x.checked_mul(seq_len))
            .ok_or_else(|| {
                Diagnostic::new(
                    cli,
                    "--steps",
                    format!("{steps} steps × {global_batch} sequences × {seq_len} tokens is more tokens than a 64-bit count holds"),
                    "pass fewer --steps",
                )
            })
        })
        .transpose()
}
