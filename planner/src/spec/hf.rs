//! A Hugging Face `config.json` as a model spec (Llama, Mistral, Qwen2 and GPT-2 families).
//!
//! The training settings are not in such a file; they come from `--seq-len` and
//! `--global-batch`. Only the architecture keys that change the plan are read.

use serde_json::Value;

use super::model::TrainingOverrides;
use crate::error::Diagnostic;
use crate::model::{Activation, Architecture, AttentionImpl, Model, Norm, Position, Training};
use crate::source::Source;

/// Parses a Hugging Face config into a resolved model.
pub fn parse_hf_config(src: &Source, over: TrainingOverrides) -> Result<Model, Diagnostic> {
    let v: Value = serde_json::from_str(&src.text).map_err(|e| {
        Diagnostic::new(
            &src.path,
            "-",
            format!("invalid JSON: {e}"),
            "fix the JSON syntax at the location shown",
        )
        .at(Some((e.line(), e.column())))
    })?;
    let err =
        |field: &str, problem: String, fix: String| Diagnostic::new(&src.path, field, problem, fix);
    let model_type = match v.get("model_type") {
        Some(Value::String(t)) => t.clone(),
        Some(other) => {
            return Err(err(
                "model_type",
                format!("must be a string, found {other}"),
                "set \"model_type\" to the family name: llama, mistral, qwen2 or gpt2".into(),
            )
            .at(src.json_key("model_type")))
        }
        None => {
            return Err(err(
                "model_type",
                "required key `model_type` is missing: it names the model family".into(),
                "add \"model_type\": \"llama\" (or mistral, qwen2, gpt2) to the config".into(),
            ))
        }
    };
    let get = |keys: &[&str]| -> Option<(String, &Value)> {
        keys.iter().find_map(|k| {
            v.get(*k)
                .filter(|x| !x.is_null())
                .map(|x| (k.to_string(), x))
        })
    };
    let int = |keys: &[&str], required: bool| -> Result<Option<u64>, Diagnostic> {
        match get(keys) {
            None if required => Err(err(
                keys[0],
                format!(
                    "required key `{}` is missing (model_type \"{model_type}\")",
                    keys[0]
                ),
                format!(
                    "add \"{}\" to the config; supported families: llama, mistral, qwen2, gpt2",
                    keys[0]
                ),
            )),
            None => Ok(None),
            Some((k, x)) => match x.as_u64().filter(|n| *n > 0) {
                Some(n) => Ok(Some(n)),
                None => Err(err(
                    &k,
                    format!("must be a positive integer, found {x}"),
                    format!("set \"{k}\" to a positive integer"),
                )),
            },
        }
    };
    let family = match model_type.as_str() {
        "llama" | "mistral" | "qwen2" => Family::Llama,
        "gpt2" => Family::Gpt2,
        "mixtral" | "qwen2_moe" | "deepseek_v2" | "deepseek_v3" => {
            return Err(err(
                "model_type",
                format!("\"{model_type}\" is a mixture-of-experts model, which is not supported yet: the memory and cost models, the search and the runtime are for dense layers"),
                "plan a dense model (llama, mistral, qwen2, gpt2)".into(),
            )
            .at(src.json_key("model_type")))
        }
        other => {
            return Err(err(
                "model_type",
                format!("unsupported model_type \"{other}\""),
                "use a llama, mistral, qwen2 or gpt2 config, or write a TOML model spec (specs/README.md)".into(),
            ))
        }
    };
    let arch = match family {
        Family::Llama => {
            let hidden = int(&["hidden_size"], true)?.unwrap_or(0);
            let heads = int(&["num_attention_heads"], true)?.unwrap_or(0);
            let kv_heads = int(&["num_key_value_heads"], false)?.unwrap_or(heads);
            let head_dim = match int(&["head_dim"], false)? {
                Some(d) => d,
                None if hidden.is_multiple_of(heads) => hidden / heads,
                None => {
                    return Err(err(
                        "num_attention_heads",
                        format!(
                        "hidden_size ({hidden}) is not divisible by num_attention_heads ({heads})"
                    ),
                        "give \"head_dim\" explicitly, or fix the head count".into(),
                    ))
                }
            };
            let act = v
                .get("hidden_act")
                .and_then(Value::as_str)
                .unwrap_or("silu");
            if act != "silu" && act != "swish" {
                return Err(err(
                    "hidden_act",
                    format!("unsupported hidden_act \"{act}\" for a gated MLP"),
                    "use \"silu\" (SwiGLU)".into(),
                ));
            }
            Architecture {
                layers: int(&["num_hidden_layers"], true)?.unwrap_or(0),
                hidden,
                heads,
                kv_heads,
                head_dim,
                ffn_hidden: int(&["intermediate_size"], true)?.unwrap_or(0),
                vocab: int(&["vocab_size"], true)?.unwrap_or(0),
                activation: Activation::Swiglu,
                norm: Norm::Rmsnorm,
                position: Position::Rope,
                tied_embeddings: v
                    .get("tie_word_embeddings")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
                bias: v.get("mlp_bias").and_then(Value::as_bool).unwrap_or(false),
                qkv_bias: model_type == "qwen2"
                    || v.get("attention_bias")
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                max_positions: 0,
                vocab_divisible_by: crate::spec::DEFAULT_VOCAB_DIVISIBLE_BY,
            }
        }
        Family::Gpt2 => {
            let hidden = int(&["n_embd", "hidden_size"], true)?.unwrap_or(0);
            Architecture {
                layers: int(&["n_layer", "num_hidden_layers"], true)?.unwrap_or(0),
                hidden,
                heads: int(&["n_head", "num_attention_heads"], true)?.unwrap_or(0),
                kv_heads: int(&["n_head", "num_attention_heads"], true)?.unwrap_or(0),
                head_dim: hidden / int(&["n_head", "num_attention_heads"], true)?.unwrap_or(1),
                ffn_hidden: int(&["n_inner"], false)?.unwrap_or(4 * hidden),
                vocab: int(&["vocab_size"], true)?.unwrap_or(0),
                activation: Activation::Gelu,
                norm: Norm::Layernorm,
                position: Position::Learned,
                tied_embeddings: v
                    .get("tie_word_embeddings")
                    .and_then(Value::as_bool)
                    .unwrap_or(true),
                bias: true,
                qkv_bias: true,
                max_positions: int(&["n_positions", "max_position_embeddings"], true)?.unwrap_or(0),
                vocab_divisible_by: crate::spec::DEFAULT_VOCAB_DIVISIBLE_BY,
            }
        }
    };
    if arch.heads % arch.kv_heads != 0 {
        return Err(err(
            "num_key_value_heads",
            format!(
                "num_attention_heads ({}) is not divisible by num_key_value_heads ({})",
                arch.heads, arch.kv_heads
            ),
            "set num_key_value_heads to a divisor of num_attention_heads".into(),
        ));
    }
    over.check()?;
    let cli = std::path::Path::new("<command line>");
    let need = |flag: &str| {
        Diagnostic::new(
            cli,
            flag,
            format!("a Hugging Face config has no training settings, and {flag} was not given"),
            format!("pass {flag} N (e.g. --seq-len 8192 --global-batch 512)"),
        )
    };
    let training = Training {
        seq_len: over.seq_len.ok_or_else(|| need("--seq-len"))?,
        global_batch: over.global_batch.ok_or_else(|| need("--global-batch"))?,
        precision: "default".into(),
        attention: AttentionImpl::Flash,
        flash_kernel: Default::default(),
        dropout: 0.0,
    };
    let name = v
        .get("_name_or_path")
        .and_then(Value::as_str)
        .map(|s| s.rsplit('/').next().unwrap_or(s).to_string())
        .or_else(|| {
            src.path
                .parent()
                .and_then(|p| p.file_name())
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| model_type.clone());
    let model = Model {
        name,
        architecture: arch,
        training,
    };
    model.check().map_err(|p| {
        // A config names the position table `n_positions` (GPT-2) or `max_position_embeddings`.
        if p.field == "architecture.max_positions" {
            Diagnostic::new(&src.path, "n_positions", p.problem, p.fix)
                .at(src.json_key("n_positions"))
        } else if p.field == "name" {
            // The name is `_name_or_path`'s last component, else the config's directory.
            let fix = format!(
                "set \"_name_or_path\" to a name of {}",
                super::check::NAME_CHARS
            );
            Diagnostic::new(&src.path, "_name_or_path", p.problem, fix)
                .at(src.json_key("_name_or_path"))
        } else {
            p.in_json(src, "")
        }
    })?;
    Ok(model)
}

enum Family {
    Llama,
    Gpt2,
}
