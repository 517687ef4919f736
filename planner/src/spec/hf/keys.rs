//! The architecture keys of a Hugging Face `config.json`, typed and shaped as transformers'
//! own classes read them (checked against transformers 5.24.0 and huggingface_hub's `@strict`
//! dataclasses):
//!
//! - Types (huggingface_hub `dataclasses._validate_simple_type`): an `int` key holds a JSON
//!   integer, not a float (`4096.0`), a string (`"4096"`) or a boolean; a `bool` key holds
//!   `true` or `false`, not `"true"` or `1`; a `str` key holds a string. `int | None` keys
//!   (`num_key_value_heads`, `head_dim`, `n_inner`) may be `null`, meaning the class's
//!   default. Counts must also be positive: a zero or negative width builds no model.
//! - Shapes: `LlamaConfig.validate_architecture` raises "The hidden size (…) is not a multiple
//!   of the number of attention heads (…)" whether or not `head_dim` is given;
//!   `GPT2Attention.__init__` raises "`embed_dim` must be divisible by num_heads"; Mistral and
//!   Qwen2 take `head_dim` when given and otherwise floor `hidden_size // num_attention_heads`,
//!   a head size that would not tile the hidden size, which is refused here rather than
//!   truncated; every family's attention repeats each KV head over
//!   `num_attention_heads // num_key_value_heads` query heads (`repeat_kv`), so the KV heads
//!   must divide the heads.
//! - Defaults are the classes': `num_key_value_heads` is `num_attention_heads` for Llama, 8
//!   for Mistral (`MistralConfig.num_key_value_heads: int = 8`) and 32 for Qwen2
//!   (`Qwen2Config.num_key_value_heads: int | None = 32`); `tie_word_embeddings` is false except
//!   for GPT-2. Biases: Llama reads `mlp_bias` and `attention_bias`; MistralAttention and the
//!   Mistral and Qwen2 MLPs are built with `bias=False` and Qwen2's Q, K, V projections with
//!   `bias=True`, whatever the config says.

use serde_json::Value;

use crate::error::Diagnostic;
use crate::model::{
    Activation, Architecture, Norm, Position, RopeScaling, RopeType, DEFAULT_ROPE_THETA,
};
use crate::source::Source;

mod moe;

/// The `model_type` values read, as messages list them.
pub(super) const SUPPORTED: &str =
    "llama, mistral, qwen2, gpt2, mixtral, qwen2_moe, qwen3_moe or deepseek_v3";

// Every top-level key of a config is one of: read (it sets a value of the resolved model, or is
// checked to hold the only value the runtime computes), listed below as changing nothing Tessera
// computes, or refused (exit 2, naming the key). A key set to `null` is absent.

/// Keys of every family that change nothing Tessera plans or computes: bookkeeping, token ids,
/// tokenizer and task metadata, generation defaults, output switches, and the attention kernel
/// choice (eager, SDPA and flash attention compute the same function). `initializer_range`: the
/// runtime initialises as GPT-2 does (std 0.02, residual projections 0.02/√(2·layers)), and
/// `--init-from` replaces the initial weights anyway. `pretraining_tp`: transformers 5 ignores
/// it (before, it split the matmuls into slices summed back: the same product).
/// `architectures` is checked against `model_type` only (`Keys::architectures_agree`).
/// `max_position_embeddings` of the Llama family: the context length the model was trained for;
/// RoPE has no table, so it bounds nothing (it is read only as the default
/// `original_max_position_embeddings` of a `llama3` `rope_scaling`).
const NO_EFFECT: &[&str] = &[
    "_name_or_path",
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "id2label",
    "label2id",
    "num_labels",
    "problem_type",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "torchscript",
    "use_bfloat16",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "is_decoder",
    "tie_encoder_decoder",
    "tokenizer_class",
    "prefix",
    "finetuning_task",
    "task_specific_params",
    "initializer_range",
    "_attn_implementation",
    "attn_implementation",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "pruned_heads",
];

/// Dropout probabilities: training settings, not the architecture. A Hugging Face config is
/// planned with the documented training settings (dropout 0.0, specs/README.md), not these.
const TRAINING_SETTINGS: &[&str] = &[
    "attention_dropout",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
    "summary_first_dropout",
];

/// Keys of the Llama family read (or checked) by `Keys::llama`.
const LLAMA_READ: &[&str] = &[
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "hidden_act",
    "tie_word_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "original_max_position_embeddings",
    "max_position_embeddings",
    "pretraining_tp",
];

/// Keys of GPT2Config read (or checked) by `Keys::gpt2`, and those of GPT2DoubleHeadsModel's
/// summary head and the legacy `n_ctx`, which GPT2LMHeadModel does not read.
const GPT2_READ: &[&str] = &[
    "n_layer",
    "num_hidden_layers",
    "n_embd",
    "hidden_size",
    "n_head",
    "num_attention_heads",
    "n_inner",
    "vocab_size",
    "n_positions",
    "max_position_embeddings",
    "tie_word_embeddings",
    "layer_norm_epsilon",
    "activation_function",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "add_cross_attention",
    // Upcasts the attention scores to fp32 before the softmax: the runtime's are fp32 already.
    "reorder_and_upcast_attn",
    "n_ctx",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
];

/// Keys known to change the computation of the models that read them, which neither these
/// families' classes nor Tessera's runtime implement: a more precise refusal than "unknown".
const UNSUPPORTED: &[(&str, &str)] = &[
    (
        "attn_logit_softcapping",
        "soft-caps the attention scores (Gemma 2)",
    ),
    (
        "final_logit_softcapping",
        "soft-caps the output logits (Gemma 2)",
    ),
    ("query_pre_attn_scalar", "rescales the queries (Gemma 2)"),
    ("quantization_config", "quantizes the weights"),
    ("logits_scaling", "rescales the output logits (Granite)"),
    ("embedding_multiplier", "rescales the embeddings (Granite)"),
    (
        "residual_multiplier",
        "rescales the residual branches (Granite)",
    ),
    (
        "attention_multiplier",
        "replaces the attention scale (Granite)",
    ),
    ("use_qk_norm", "normalises the queries and keys"),
    ("qk_layernorm", "normalises the queries and keys"),
    ("no_rope_layers", "leaves RoPE out of some layers"),
    ("alibi", "replaces RoPE by ALiBi biases"),
    ("parallel_attn", "runs attention and the MLP in parallel"),
    ("num_local_experts", "makes the MLPs mixtures of experts"),
    ("num_experts", "makes the MLPs mixtures of experts"),
];

/// The keys a `rope_scaling` / `rope_parameters` object may hold; the llama3 ones are ignored
/// by transformers under the `default` type.
const ROPE_KEYS: &[&str] = &[
    "rope_type",
    "type",
    "rope_theta",
    "partial_rotary_factor",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
];

/// The model families read, by `model_type`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Family {
    Llama,
    Mistral,
    Qwen2,
    Gpt2,
    /// The mixture-of-experts families (keys/moe.rs): read and counted, not planned yet.
    Mixtral,
    Qwen2Moe,
    Qwen3Moe,
    DeepseekV3,
}

impl Family {
    /// The family of a `model_type`, `None` for one not read.
    pub(super) fn of(model_type: &str) -> Option<Family> {
        Some(match model_type {
            "llama" => Family::Llama,
            "mistral" => Family::Mistral,
            "qwen2" => Family::Qwen2,
            "gpt2" => Family::Gpt2,
            "mixtral" => Family::Mixtral,
            "qwen2_moe" => Family::Qwen2Moe,
            "qwen3_moe" => Family::Qwen3Moe,
            "deepseek_v3" => Family::DeepseekV3,
            _ => return None,
        })
    }

    /// The prefix of every transformers class of the family (`LlamaForCausalLM`,
    /// `LlamaModel`, `GPT2LMHeadModel`, …).
    fn class_prefix(self) -> &'static str {
        match self {
            Family::Llama => "Llama",
            Family::Mistral => "Mistral",
            Family::Qwen2 => "Qwen2",
            Family::Gpt2 => "GPT2",
            Family::Mixtral => "Mixtral",
            Family::Qwen2Moe => "Qwen2Moe",
            Family::Qwen3Moe => "Qwen3Moe",
            Family::DeepseekV3 => "DeepseekV3",
        }
    }

    /// Whether `class` is one of the family's transformers classes: the prefix, then `For…`
    /// (`ForCausalLM`, `ForSequenceClassification`, …), `Model`, or GPT-2's `LMHeadModel` and
    /// `DoubleHeadsModel`. `Qwen2MoeForCausalLM` is not Qwen2's.
    fn has_class(self, class: &str) -> bool {
        class.strip_prefix(self.class_prefix()).is_some_and(|rest| {
            rest.starts_with("For")
                || rest == "Model"
                || rest == "PreTrainedModel"
                || rest == "LMHeadModel"
                || rest == "DoubleHeadsModel"
        })
    }

    /// The transformers class that builds the family's causal LM.
    fn class(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Gpt2 => "GPT2LMHeadModel",
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen2Moe => "Qwen2MoeForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
            Family::DeepseekV3 => "DeepseekV3ForCausalLM",
        }
    }
}

/// Typed access to the top-level keys of one config.
pub(super) struct Keys<'a> {
    pub src: &'a Source,
    pub v: &'a Value,
    pub model_type: &'a str,
}

/// A JSON value as an error message names it.
fn describe(x: &Value) -> String {
    match x {
        Value::String(_) => format!("the string {x}"),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Null => "null".into(),
        Value::Number(n) if n.is_f64() => format!("{n}, a number with a fraction or an exponent"),
        Value::Number(n) => n.to_string(),
        Value::Array(_) => format!("the list {x}"),
        Value::Object(_) => "an object".into(),
    }
}

impl<'a> Keys<'a> {
    fn err(&self, key: &str, problem: String, fix: String) -> Diagnostic {
        Diagnostic::new(&self.src.path, key, problem, fix).at(self.src.json_key(key))
    }

    /// The first of `keys` present (GPT-2's attribute map gives some two names; both given,
    /// they must agree).
    fn find(&self, keys: &[&'a str]) -> Result<Option<(&'a str, &'a Value)>, Diagnostic> {
        let mut present = keys.iter().filter_map(|k| self.v.get(*k).map(|x| (*k, x)));
        let first = present.next();
        if let (Some((k, x)), Some((k2, x2))) = (first, present.next()) {
            if x != x2 {
                return Err(self.err(
                    k,
                    format!("\"{k}\" is {x} and \"{k2}\" is {x2}: two names of one setting that disagree"),
                    format!("keep one of \"{k}\" and \"{k2}\", or give both the same value"),
                ));
            }
        }
        Ok(first)
    }

    fn missing(&self, key: &str) -> Diagnostic {
        Diagnostic::new(
            &self.src.path,
            key,
            format!(
                "required key `{key}` is missing (model_type \"{}\")",
                self.model_type
            ),
            format!("add \"{key}\" to the config; supported families: {SUPPORTED}"),
        )
    }

    /// A positive integer under the first of `keys`. `nullable`: an `int | None` key, where
    /// `null` (or absence) means the class's default (`None` here).
    fn int(
        &self,
        keys: &[&'a str],
        required: bool,
        nullable: bool,
    ) -> Result<Option<u64>, Diagnostic> {
        let Some((k, x)) = self.find(keys)? else {
            return if required {
                Err(self.missing(keys[0]))
            } else {
                Ok(None)
            };
        };
        if x.is_null() && nullable {
            return Ok(None);
        }
        if let Some(n) = x.as_u64().filter(|n| *n > 0 && !x.is_f64()) {
            return Ok(Some(n));
        }
        let example = match x {
            Value::Number(n) => n
                .as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 1.0 && *f < 9.2e18)
                .map(|f| format!("{}", f as u64)),
            Value::String(s) => s
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .map(|n| n.to_string()),
            _ => None,
        };
        let fix = match example {
            Some(n) => format!("write \"{k}\": {n}, a JSON integer (no quotes, no decimal point)"),
            None => format!("set \"{k}\" to a positive JSON integer (no quotes, no decimal point)"),
        };
        let null_ok = if nullable {
            ", or null for the default"
        } else {
            ""
        };
        Err(self.err(
            k,
            format!("must be a positive integer{null_ok}, found {}", describe(x)),
            fix,
        ))
    }

    /// A required positive integer.
    fn count(&self, keys: &[&'a str]) -> Result<u64, Diagnostic> {
        Ok(self.int(keys, true, false)?.unwrap_or(0))
    }

    /// A boolean, `default` when absent.
    fn boolean(&self, key: &'a str, default: bool) -> Result<bool, Diagnostic> {
        match self.v.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(x) => {
                let fix = match x.as_str().map(str::trim) {
                    Some(s @ ("true" | "false")) => {
                        format!("write \"{key}\": {s}, a JSON boolean (without quotes)")
                    }
                    _ => format!("set \"{key}\" to true or false, a JSON boolean (without quotes)"),
                };
                Err(self.err(
                    key,
                    format!("must be a boolean (true or false), found {}", describe(x)),
                    fix,
                ))
            }
        }
    }

    /// A string, `default` when absent.
    fn string(&self, key: &'a str, default: &'a str) -> Result<&'a str, Diagnostic> {
        match self.v.get(key) {
            None => Ok(default),
            Some(Value::String(s)) => Ok(s),
            Some(x) => Err(self.err(
                key,
                format!("must be a string, found {}", describe(x)),
                format!("write \"{key}\": \"{default}\", a JSON string"),
            )),
        }
    }

    /// The value of `key`, `None` when absent or `null`.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.v.get(key).filter(|x| !x.is_null())
    }

    /// A positive number (a JSON integer or float) under `key` of `obj` (named `name` in
    /// messages), `None` when absent or `null`.
    fn number_in(&self, obj: &Value, key: &str, name: &str) -> Result<Option<f64>, Diagnostic> {
        match obj.get(key).filter(|x| !x.is_null()) {
            None => Ok(None),
            Some(x) => match x.as_f64().filter(|f| f.is_finite() && *f > 0.0) {
                Some(f) if !x.is_boolean() => Ok(Some(f)),
                _ => Err(self.err(
                    name,
                    format!("must be a positive number, found {}", describe(x)),
                    format!("set \"{key}\" to a positive JSON number (no quotes)"),
                )),
            },
        }
    }

    /// A positive number at the top level, `default` when absent or `null`.
    fn number(&self, key: &str, default: f64) -> Result<f64, Diagnostic> {
        Ok(self.number_in(self.v, key, key)?.unwrap_or(default))
    }

    /// `architectures` names classes of the `model_type`'s family: a config whose
    /// `architectures` says another model (`"model_type": "gpt2"` with `LlamaForCausalLM`)
    /// contradicts itself, and transformers would build whichever the loader reads.
    fn architectures_agree(&self, family: Family) -> Result<(), Diagnostic> {
        let Some(x) = self.get("architectures") else {
            return Ok(());
        };
        let classes = x
            .as_array()
            .and_then(|a| a.iter().map(Value::as_str).collect::<Option<Vec<&str>>>());
        let Some(classes) = classes else {
            return Err(self.err(
                "architectures",
                format!(
                    "must be a list of transformers class names, found {}",
                    describe(x)
                ),
                format!(
                    "write \"architectures\": [\"{}\"], or remove it",
                    family.class()
                ),
            ));
        };
        match classes.into_iter().find(|c| !family.has_class(c)) {
            None => Ok(()),
            Some(c) => Err(self.err(
                "architectures",
                format!(
                    "\"architectures\" names {c}, and \"model_type\" is \"{}\", whose classes are {}…: the two keys name different models",
                    self.model_type,
                    family.class_prefix()
                ),
                format!(
                    "make them agree: \"architectures\": [\"{}\"] for model_type \"{}\", or the model_type of {c}'s family",
                    family.class(),
                    self.model_type
                ),
            )),
        }
    }

    /// Every top-level key is read by `family`, listed as changing nothing, or refused.
    fn known_keys(&self, family: Family) -> Result<(), Diagnostic> {
        let Some(obj) = self.v.as_object() else {
            return Err(self.err(
                "-",
                "a config.json must be a JSON object".into(),
                "write the config as { \"model_type\": …, … }".into(),
            ));
        };
        let family_keys: &[&str] = match family {
            Family::Gpt2 => GPT2_READ,
            Family::Llama => &["mlp_bias", "attention_bias"],
            // MistralAttention and the Mistral and Qwen2 MLPs are built without biases and
            // Qwen2's Q, K, V with them, whatever these keys say.
            Family::Mistral => &["sliding_window", "mlp_bias", "attention_bias"],
            Family::Qwen2 => &[
                "sliding_window",
                "use_sliding_window",
                "max_window_layers",
                "layer_types",
                "mlp_bias",
                "attention_bias",
            ],
            Family::Mixtral => moe::MIXTRAL_READ,
            Family::Qwen2Moe => moe::QWEN2_MOE_READ,
            Family::Qwen3Moe => moe::QWEN3_MOE_READ,
            Family::DeepseekV3 => moe::DEEPSEEK_V3_READ,
        };
        let llama = family != Family::Gpt2;
        for (key, x) in obj {
            let k = key.as_str();
            let known = NO_EFFECT.contains(&k)
                || TRAINING_SETTINGS.contains(&k)
                || family_keys.contains(&k)
                || (llama && LLAMA_READ.contains(&k));
            if known || x.is_null() {
                continue;
            }
            let class = family.class();
            let problem = match UNSUPPORTED.iter().find(|(u, _)| *u == k) {
                Some((_, what)) => format!("\"{k}\" {what}, which neither {class} nor Tessera's runtime computes"),
                None => format!("unknown key \"{k}\" for model_type \"{}\": Tessera reads the keys that change a {class}'s computation and ignores a known list of those that do not (specs/README.md); it cannot tell what this one does", self.model_type),
            };
            return Err(self.err(
                k,
                problem,
                format!("remove \"{k}\" if the model does not depend on it, or write a TOML model spec (specs/README.md)"),
            ));
        }
        Ok(())
    }

    /// RoPE θ and scaling of a Llama-family config: `rope_theta` and the `rope_parameters`
    /// (transformers 5) or `rope_scaling` (before) object, as transformers'
    /// `standardize_rope_params` merges them. Only the `default` and `llama3` types are
    /// computed; a partial rotary factor other than 1 is refused.
    fn rope(&self) -> Result<(f64, Option<RopeScaling>), Diagnostic> {
        let objects: Vec<(&str, &Value)> = ["rope_parameters", "rope_scaling"]
            .into_iter()
            .filter_map(|k| self.get(k).map(|x| (k, x)))
            .collect();
        for (k, x) in &objects {
            let Some(o) = x.as_object() else {
                return Err(self.err(
                    k,
                    format!("must be an object or null, found {}", describe(x)),
                    format!("write \"{k}\": null, or an object such as {{\"rope_type\": \"llama3\", \"factor\": 8.0, …}}"),
                ));
            };
            if let Some(sub) = o.keys().find(|s| !ROPE_KEYS.contains(&s.as_str())) {
                return Err(self.err(
                    &format!("{k}.{sub}"),
                    format!("unknown key \"{sub}\" in \"{k}\": Tessera computes the default and llama3 RoPE only"),
                    format!("remove \"{sub}\" from \"{k}\" (keys read: {})", ROPE_KEYS.join(", ")),
                ));
            }
        }
        if let [(k1, a), (k2, b)] = objects[..] {
            for (sub, x) in a.as_object().into_iter().flatten() {
                if let Some(y) = b.get(sub).filter(|y| *y != x && !y.is_null()) {
                    return Err(self.err(
                        k1,
                        format!("\"{k1}.{sub}\" is {x} and \"{k2}.{sub}\" is {y}: two spellings of one setting that disagree"),
                        format!("keep one of \"{k1}\" and \"{k2}\""),
                    ));
                }
            }
        }
        let field = |sub: &str| -> Option<(String, &'a Value)> {
            objects.iter().find_map(|(k, o)| {
                o.get(sub)
                    .filter(|x| !x.is_null())
                    .map(|x| (format!("{k}.{sub}"), x))
            })
        };
        let theta = match (
            field("rope_theta"),
            self.number_in(self.v, "rope_theta", "rope_theta")?,
        ) {
            (Some((name, x)), top) => {
                let inner = self.number_in(&serde_json::json!({"v": x}), "v", &name)?;
                if let (Some(i), Some(t)) = (inner, top) {
                    if i != t {
                        return Err(self.err(
                            "rope_theta",
                            format!("\"rope_theta\" is {t} and \"{name}\" is {i}: two spellings of one setting that disagree"),
                            "give both the same value, or keep one".into(),
                        ));
                    }
                }
                inner.unwrap_or(DEFAULT_ROPE_THETA)
            }
            (None, top) => top.unwrap_or(DEFAULT_ROPE_THETA),
        };
        for (name, x) in [
            field("partial_rotary_factor"),
            self.get("partial_rotary_factor")
                .map(|x| ("partial_rotary_factor".to_string(), x)),
        ]
        .into_iter()
        .flatten()
        {
            if x.as_f64() != Some(1.0) {
                return Err(self.err(
                    &name,
                    format!("partial rotary embeddings (a factor of {x}) are not implemented: Tessera rotates every channel of a head"),
                    format!("remove \"{name}\" or set it to 1.0"),
                ));
            }
        }
        let Some((type_key, kind)) = field("rope_type").or_else(|| field("type")) else {
            return Ok((theta, None));
        };
        let kind_str = kind.as_str().unwrap_or("");
        match kind_str {
            "default" => Ok((theta, None)),
            "llama3" => {
                let num = |sub: &str| -> Result<f64, Diagnostic> {
                    match field(sub) {
                        Some((name, x)) => Ok(self
                            .number_in(&serde_json::json!({"v": x}), "v", &name)?
                            .unwrap_or(0.0)),
                        None => Err(self.err(
                            &type_key,
                            format!("rope type \"llama3\" needs \"{sub}\", which is missing"),
                            format!("add \"{sub}\" to the rope object (Llama 3.1: factor 8.0, low_freq_factor 1.0, high_freq_factor 4.0, original_max_position_embeddings 8192)"),
                        )),
                    }
                };
                let factor = num("factor")?;
                let low_freq_factor = num("low_freq_factor")?;
                let high_freq_factor = num("high_freq_factor")?;
                let original = match field("original_max_position_embeddings") {
                    Some((name, _)) => Some(name),
                    None => ["original_max_position_embeddings", "max_position_embeddings"]
                        .into_iter()
                        .find(|k| self.get(k).is_some())
                        .map(str::to_string),
                };
                let Some(original) = original else {
                    return Err(self.err(
                        &type_key,
                        "rope type \"llama3\" needs \"original_max_position_embeddings\" (or \"max_position_embeddings\"), which is missing".into(),
                        "add \"original_max_position_embeddings\": 8192 to the rope object".into(),
                    ));
                };
                let x = field("original_max_position_embeddings")
                    .map(|(_, x)| x)
                    .or_else(|| self.get(&original))
                    .unwrap_or(&Value::Null);
                let Some(original_max_positions) = x.as_u64().filter(|n| *n > 0 && !x.is_f64())
                else {
                    return Err(self.err(
                        &original,
                        format!("must be a positive integer, found {}", describe(x)),
                        format!("set \"{original}\" to a positive JSON integer"),
                    ));
                };
                let scaling = RopeScaling {
                    rope_type: RopeType::Llama3,
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_positions,
                };
                if let Err(p) = crate::spec::check::rope_scaling(&scaling) {
                    return Err(self.err(&type_key, p.problem, p.fix));
                }
                Ok((theta, Some(scaling)))
            }
            _ => Err(self.err(
                &type_key,
                format!("RoPE scaling of type {kind} is not implemented: Tessera computes the default RoPE and Llama 3.1's \"llama3\" scaling only"),
                format!("use a config whose \"{}\" is null or of type \"default\" or \"llama3\"", type_key.split('.').next().unwrap_or("rope_scaling")),
            )),
        }
    }

    /// The attention window of a Mistral or Qwen2 config, as transformers applies it: Mistral's
    /// `sliding_window` (default 4096, `null` for none) on every layer; Qwen2's only with
    /// `use_sliding_window` and on the layers `layer_types` (or `max_window_layers`) make
    /// sliding. `None`: full attention everywhere.
    fn sliding_window(&self, family: Family, layers: u64) -> Result<Option<u64>, Diagnostic> {
        let window = || -> Result<Option<u64>, Diagnostic> {
            match self.v.get("sliding_window") {
                None => Ok(Some(4096)),
                Some(_) => self.int(&["sliding_window"], false, true),
            }
        };
        match family {
            Family::Mistral => window(),
            // MixtralConfig's sliding_window defaults to None, Mistral's to 4096.
            Family::Mixtral => self.int(&["sliding_window"], false, true),
            Family::Qwen2Moe | Family::Qwen3Moe => self.moe_family_window(family, layers),
            Family::Qwen2 => {
                let window = window()?;
                if !self.boolean("use_sliding_window", false)? {
                    return Ok(None);
                }
                // Qwen2Config makes the layers from `max_window_layers` on sliding.
                let sliding_layers = match self.layer_types_slide(layers)? {
                    Some(slides) => slides,
                    None => self.max_window_layers(layers)? < layers,
                };
                Ok(window.filter(|_| sliding_layers))
            }
            _ => Ok(None),
        }
    }

    /// `max_window_layers` (default 28), a layer index read with `use_sliding_window`: one past
    /// the config's layers is refused, naming both (no layer it could name exists).
    pub(super) fn max_window_layers(&self, layers: u64) -> Result<u64, Diagnostic> {
        let Some(n) = self.int(&["max_window_layers"], false, false)? else {
            return Ok(28);
        };
        if n > layers {
            return Err(self.err(
                "max_window_layers",
                format!("is {n}, past the config's {layers} layers (num_hidden_layers): with use_sliding_window it names the layer where sliding-window attention starts or stops, and layer {n} does not exist"),
                format!("set \"max_window_layers\" to a layer index of 0 … {layers}, or \"use_sliding_window\" to false"),
            ));
        }
        Ok(n)
    }

    /// Whether the config's `layer_types` (one entry per layer, `"full_attention"` or
    /// `"sliding_attention"`) make any layer sliding; `None` without the key.
    pub(super) fn layer_types_slide(&self, layers: u64) -> Result<Option<bool>, Diagnostic> {
        let Some(x) = self.get("layer_types") else {
            return Ok(None);
        };
        let types = x.as_array().filter(|t| t.len() as u64 == layers);
        let ok = |t: &Value| matches!(t.as_str(), Some("full_attention" | "sliding_attention"));
        let Some(types) = types.filter(|t| t.iter().all(ok)) else {
            return Err(self.err(
                "layer_types",
                format!(
                    "must be a list of {layers} \"full_attention\" or \"sliding_attention\", found {}",
                    describe(x)
                ),
                "give one entry per layer, or remove \"layer_types\"".into(),
            ));
        };
        Ok(Some(types.iter().any(|t| t == "sliding_attention")))
    }

    /// The architecture of a Llama, Mistral or Qwen2 config.
    fn llama(&self, family: Family) -> Result<Architecture, Diagnostic> {
        let hidden = self.count(&["hidden_size"])?;
        let heads = self.count(&["num_attention_heads"])?;
        let kv_default = match family {
            Family::Mistral | Family::Mixtral => 8,
            Family::Qwen2 => 32,
            Family::Qwen2Moe => 16,
            Family::Qwen3Moe => 4,
            _ => heads,
        };
        let kv_heads = match self.v.get("num_key_value_heads") {
            None => kv_default,
            Some(_) => self
                .int(&["num_key_value_heads"], false, true)?
                .unwrap_or(heads),
        };
        let head_dim = self.int(&["head_dim"], false, true)?;
        if !hidden.is_multiple_of(heads) && (family == Family::Llama || head_dim.is_none()) {
            let why = match family {
                Family::Llama => "LlamaConfig refuses it (validate_architecture), head_dim or not",
                _ => "without head_dim, transformers would floor hidden_size / num_attention_heads to a head size that does not tile the hidden size",
            };
            let fix = match family {
                Family::Llama => format!("set \"num_attention_heads\" to a divisor of {hidden}, or \"hidden_size\" to a multiple of {heads}"),
                _ => format!("give \"head_dim\" explicitly, or set \"num_attention_heads\" to a divisor of {hidden}"),
            };
            return Err(self.err(
                "hidden_size",
                format!("hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}): {why}"),
                fix,
            ));
        }
        if !heads.is_multiple_of(kv_heads) {
            let given = if self.v.get("num_key_value_heads").is_some() {
                ""
            } else {
                " (absent: the class's default)"
            };
            return Err(self.err(
                "num_key_value_heads",
                format!("num_attention_heads ({heads}) is not divisible by num_key_value_heads ({kv_heads}{given}): each KV head serves a whole group of query heads"),
                format!(
                    "set \"num_key_value_heads\" to a divisor of {heads}: {}",
                    crate::search::divisors::listed(heads)
                ),
            ));
        }
        let act = self.string("hidden_act", "silu")?;
        if act != "silu" && act != "swish" {
            return Err(self.err(
                "hidden_act",
                format!("unsupported hidden_act \"{act}\" for a gated MLP"),
                "use \"silu\" (SwiGLU)".into(),
            ));
        }
        let tied_embeddings = self.boolean("tie_word_embeddings", false)?;
        let (bias, qkv_bias) = match family {
            Family::Llama => {
                let mlp = self.boolean("mlp_bias", false)?;
                let attention = self.boolean("attention_bias", false)?;
                if mlp != attention {
                    let (key, other) = if attention {
                        ("attention_bias", "mlp_bias")
                    } else {
                        ("mlp_bias", "attention_bias")
                    };
                    return Err(self.err(
                        key,
                        format!("{key} is true and {other} false: LlamaForCausalLM then has biases on {}, which Tessera's layers cannot express (biases on every linear, `bias`, or on q, k and v only, `qkv_bias`)", if attention { "q, k, v and o_proj but not the MLP" } else { "the MLP but not the attention" }),
                        format!("set \"{key}\" and \"{other}\" alike"),
                    ));
                }
                (mlp, mlp)
            }
            Family::Qwen2 => (false, true),
            Family::Qwen2Moe | Family::Qwen3Moe => self.moe_family_biases(family)?,
            _ => (false, false),
        };
        let layers = self.count(&["num_hidden_layers"])?;
        let (rope_theta, rope_scaling) = self.rope()?;
        // LlamaConfig, MistralConfig and Qwen2Config all default rms_norm_eps to 1e-6.
        let norm_eps = self.number("rms_norm_eps", 1e-6)?;
        let sliding_window = self.sliding_window(family, layers)?;
        Ok(Architecture {
            layers,
            hidden,
            heads,
            kv_heads,
            head_dim: head_dim.unwrap_or(hidden / heads),
            ffn_hidden: self.count(&["intermediate_size"])?,
            vocab: self.count(&["vocab_size"])?,
            activation: Activation::Swiglu,
            norm: Norm::Rmsnorm,
            position: Position::Rope,
            tied_embeddings,
            bias,
            qkv_bias,
            max_positions: 0,
            vocab_divisible_by: crate::spec::DEFAULT_VOCAB_DIVISIBLE_BY,
            rope_theta,
            rope_scaling,
            norm_eps,
            sliding_window,
            moe: None,
            mla: None,
            qk_norm: false,
        })
    }

    /// The architecture of a GPT-2 config (`hidden_size`, `num_attention_heads`,
    /// `num_hidden_layers` and `max_position_embeddings` are GPT2Config's other names).
    fn gpt2(&self) -> Result<Architecture, Diagnostic> {
        let hidden = self.count(&["n_embd", "hidden_size"])?;
        let heads = self.count(&["n_head", "num_attention_heads"])?;
        if !hidden.is_multiple_of(heads) {
            return Err(self.err(
                "n_embd",
                format!("n_embd ({hidden}) is not divisible by n_head ({heads}): GPT2Attention raises \"embed_dim must be divisible by num_heads\""),
                format!("set \"n_head\" to a divisor of {hidden}: {}", crate::search::divisors::listed(hidden)),
            ));
        }
        // transformers' ACT2FN: gelu_new and gelu_pytorch_tanh are the tanh approximation the
        // runtime computes; "gelu" is the exact (erf) GELU, which it does not.
        let act = self.string("activation_function", "gelu_new")?;
        if act != "gelu_new" && act != "gelu_pytorch_tanh" {
            return Err(self.err(
                "activation_function",
                format!("activation_function \"{act}\" is not computed: Tessera's GELU is the tanh approximation (gelu_new)"),
                "use \"gelu_new\" (or \"gelu_pytorch_tanh\", the same function)".into(),
            ));
        }
        for (key, want, default) in [
            ("scale_attn_weights", true, true),
            ("scale_attn_by_inverse_layer_idx", false, false),
            ("add_cross_attention", false, false),
        ] {
            if self.boolean(key, default)? != want {
                return Err(self.err(
                    key,
                    format!("{key} = {} changes GPT-2's attention in a way Tessera's runtime does not compute", !want),
                    format!("set \"{key}\" to {want} (or remove it)"),
                ));
            }
        }
        let norm_eps = self.number("layer_norm_epsilon", 1e-5)?;
        Ok(Architecture {
            layers: self.count(&["n_layer", "num_hidden_layers"])?,
            hidden,
            heads,
            kv_heads: heads,
            head_dim: hidden / heads,
            ffn_hidden: self
                .int(&["n_inner"], false, true)?
                .unwrap_or(hidden.saturating_mul(4)),
            vocab: self.count(&["vocab_size"])?,
            activation: Activation::Gelu,
            norm: Norm::Layernorm,
            position: Position::Learned,
            tied_embeddings: self.boolean("tie_word_embeddings", true)?,
            bias: true,
            qkv_bias: true,
            max_positions: self.count(&["n_positions", "max_position_embeddings"])?,
            vocab_divisible_by: crate::spec::DEFAULT_VOCAB_DIVISIBLE_BY,
            rope_theta: DEFAULT_ROPE_THETA,
            rope_scaling: None,
            norm_eps,
            sliding_window: None,
            moe: None,
            mla: None,
            qk_norm: false,
        })
    }

    /// The config key a resolved field was read from (for a rule of `Model::check`).
    pub fn key_of(&self, field: &str, family: Family) -> Option<&'static str> {
        if let Some(key) = moe::key_of(field, family) {
            return Some(key);
        }
        let gpt2 = family == Family::Gpt2;
        Some(match field.strip_prefix("architecture.")? {
            "layers" if gpt2 => "n_layer",
            "layers" => "num_hidden_layers",
            "hidden" if gpt2 => "n_embd",
            "hidden" => "hidden_size",
            "heads" | "kv_heads" if gpt2 => "n_head",
            "heads" => "num_attention_heads",
            "kv_heads" => "num_key_value_heads",
            "head_dim" if self.v.get("head_dim").is_some_and(|x| !x.is_null()) => "head_dim",
            "head_dim" if gpt2 => "n_head",
            "head_dim" => "num_attention_heads",
            "ffn_hidden" if gpt2 => "n_inner",
            "ffn_hidden" => "intermediate_size",
            "vocab" => "vocab_size",
            "sliding_window" => "sliding_window",
            "norm_eps" if gpt2 => "layer_norm_epsilon",
            "norm_eps" => "rms_norm_eps",
            "rope_theta" => "rope_theta",
            _ => return None,
        })
    }

    /// The architecture of the config's family.
    pub fn architecture(&self, family: Family) -> Result<Architecture, Diagnostic> {
        self.known_keys(family)?;
        self.architectures_agree(family)?;
        match family {
            Family::Gpt2 => self.gpt2(),
            Family::DeepseekV3 => self.deepseek_v3(),
            f @ (Family::Mixtral | Family::Qwen2Moe | Family::Qwen3Moe) => {
                let mut a = self.llama(f)?;
                a.moe = Some(self.routed_experts(f, a.layers, a.ffn_hidden)?);
                a.qk_norm = f == Family::Qwen3Moe;
                Ok(a)
            }
            f => self.llama(f),
        }
    }
}

/// The command-line flag a training field came from (a config has no training settings).
pub(super) fn flag_of(field: &str) -> Option<&'static str> {
    match field {
        "training.seq_len" => Some("--seq-len"),
        "training.global_batch" => Some("--global-batch"),
        _ => None,
    }
}
