//! A Hugging Face `config.json` as a model spec (Llama, Mistral, Qwen2 and GPT-2 families, and
//! the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3, which are read and
//! counted but not planned yet).
//!
//! The training settings are not in such a file; they come from `--seq-len` and
//! `--global-batch`. Only the architecture keys that change the plan are read.

use serde_json::Value;

use super::model::TrainingOverrides;
use super::problem::Problem;
use crate::error::Diagnostic;
use crate::model::{AttentionImpl, Model, Training};
use crate::source::Source;

mod keys;

use keys::{Family, Keys};

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
                format!("set \"model_type\" to the family name: {}", keys::SUPPORTED),
            )
            .at(src.json_key("model_type")))
        }
        None => {
            return Err(err(
                "model_type",
                "required key `model_type` is missing: it names the model family".into(),
                format!(
                    "add \"model_type\": \"llama\" (or another of {}) to the config",
                    keys::SUPPORTED
                ),
            ))
        }
    };
    let family = match Family::of(&model_type) {
        Some(f) => f,
        None if model_type == "deepseek_v2" => {
            return Err(err(
                "model_type",
                "\"deepseek_v2\" (DeepSeek-V2's MLA and mixture of experts) is not read: its router (softmax, group-limited greedy, no score bias) differs from DeepSeek-V3's, which is".into(),
                "write a TOML model spec with [architecture.mla] and the MoE keys (specs/README.md)".into(),
            )
            .at(src.json_key("model_type")))
        }
        None => {
            return Err(err(
                "model_type",
                format!("unsupported model_type \"{model_type}\""),
                format!("use a config of model_type {}, or write a TOML model spec (specs/README.md)", keys::SUPPORTED),
            )
            .at(src.json_key("model_type")))
        }
    };
    // Every key read is typed and shaped as transformers' own classes read it (keys.rs).
    let keys = Keys {
        src,
        v: &v,
        model_type: &model_type,
    };
    let arch = keys.architecture(family)?;
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
    let seq_len = over.seq_len.ok_or_else(|| need("--seq-len"))?;
    let global_batch = over.global_batch.ok_or_else(|| need("--global-batch"))?;
    let training = Training {
        seq_len,
        global_batch,
        tokens: super::model::cli_budget(over, seq_len, global_batch)?,
        precision: "default".into(),
        attention: AttentionImpl::Flash,
        flash_kernel: Default::default(),
        dropout: 0.0,
        framework: None,
        method: Default::default(),
        optimizer_states: Default::default(),
        fp8: Default::default(),
        tp_comm_overlap: false,
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
        optimizer: Default::default(),
        schedule: Default::default(),
        lora: None,
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
        } else if let Some(flag) = keys::flag_of(&p.field) {
            Diagnostic::new("<command line>", flag, p.problem, p.fix)
        } else if let Some(key) = keys.key_of(&p.field, family) {
            let fix = format!("{} (in the config: \"{key}\")", p.fix);
            Diagnostic::new(&src.path, key, p.problem, fix).at(src.json_key(key))
        } else {
            p.in_json(src, "")
        }
    })?;
    Ok(model)
}

/// The diagnostic of a rule a config's resolved model breaks ([`Model::plannable`]), at the
/// config key the field was read from.
pub(super) fn locate(src: &Source, p: Problem) -> Diagnostic {
    let v: Value = serde_json::from_str(&src.text).unwrap_or(Value::Null);
    let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or("");
    let keys = Keys {
        src,
        v: &v,
        model_type,
    };
    match Family::of(model_type).and_then(|f| keys.key_of(&p.field, f)) {
        Some(key) => Diagnostic::new(
            &src.path,
            key,
            p.problem,
            format!("{} (in the config: \"{key}\")", p.fix),
        )
        .at(src.json_key(key)),
        None => p.in_json(src, ""),
    }
}
