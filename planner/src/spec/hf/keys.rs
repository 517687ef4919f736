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
use crate::model::{Activation, Architecture, Norm, Position};
use crate::source::Source;

/// The model families read, by `model_type`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Family {
    Llama,
    Mistral,
    Qwen2,
    Gpt2,
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
            format!("add \"{key}\" to the config; supported families: llama, mistral, qwen2, gpt2"),
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

    /// The architecture of a Llama, Mistral or Qwen2 config.
    fn llama(&self, family: Family) -> Result<Architecture, Diagnostic> {
        let hidden = self.count(&["hidden_size"])?;
        let heads = self.count(&["num_attention_heads"])?;
        let kv_default = match family {
            Family::Mistral => 8,
            Family::Qwen2 => 32,
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
            Family::Llama => (
                self.boolean("mlp_bias", false)?,
                self.boolean("attention_bias", false)?,
            ),
            Family::Qwen2 => (false, true),
            _ => (false, false),
        };
        Ok(Architecture {
            layers: self.count(&["num_hidden_layers"])?,
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
        })
    }

    /// The config key a resolved field was read from (for a rule of `Model::check`).
    pub fn key_of(&self, field: &str, family: Family) -> Option<&'static str> {
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
            _ => return None,
        })
    }

    /// The architecture of the config's family.
    pub fn architecture(&self, family: Family) -> Result<Architecture, Diagnostic> {
        match family {
            Family::Gpt2 => self.gpt2(),
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
