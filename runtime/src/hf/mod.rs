//! Hugging Face transformers' layout of a model: the two classes a Tessera model can be written
//! as and read from, `GPT2LMHeadModel` and `LlamaForCausalLM`, as a `model.safetensors` (f32)
//! beside a `config.json` (docs/checkpoints.md, "Hugging Face"); and a LoRA checkpoint's
//! adapters as PEFT's folder, or merged into the model (`peft.rs`).
//!
//! Which class is decided by the architecture: learned positions, LayerNorm, GELU, biases
//! and a tied output layer are GPT-2; RoPE, RMSNorm, SwiGLU and no biases are Llama. Anything
//! else is refused, naming the field. The tensors map one to one, except that
//! - GPT-2's linears are `Conv1D`s, whose weight is stored `(in, out)`, the transpose of ours
//!   (`nn.Linear`'s `(out, in)`), and its `c_attn` is q, k and v fused along `out`;
//! - the vocabulary's padding rows (`Architecture::padded_vocab`) are dropped;
//! - a tied output layer is not stored (HF ties `lm_head` to the embedding on load).
//!
//! Our RoPE is the rotate-half convention (`cpu/rope.rs`), as HF Llama's `rotate_half`, and our
//! GQA maps q head `h` to kv head `h / (heads / kv_heads)` as HF's `repeat_kv`, so q and k
//! rows are not permuted.

mod export;
mod import;
mod peft;

use tessera_planner::model::{Activation, Architecture, Norm, Position};

pub use export::{export, ExportSummary};
pub use import::{load, HfWeights};
pub use peft::{export_merged, export_peft, ADAPTER_CONFIG, ADAPTER_WEIGHTS};

/// The weights file of an HF folder.
pub const WEIGHTS: &str = "model.safetensors";
/// The config file of an HF folder.
pub const CONFIG: &str = "config.json";
/// The normalisation ε of a model that names none (`Architecture::norm_eps`'s default); each
/// export writes its model's own.
pub const NORM_EPS: f64 = tessera_planner::model::DEFAULT_NORM_EPS;
/// The RoPE base of a model that names none (`Architecture::rope_theta`'s default); each export
/// writes its model's own.
pub const ROPE_THETA: f64 = crate::layers::config::DEFAULT_ROPE_THETA;

/// `config.json`'s `rope_parameters` of `a` (transformers 5; `rope_scaling` before): the type,
/// θ and, for `llama3`, its four numbers.
pub fn rope_parameters(a: &Architecture) -> serde_json::Value {
    use serde_json::json;
    match &a.rope_scaling {
        None => json!({"rope_type": "default", "rope_theta": a.rope_theta}),
        Some(s) => match s.rope_type {
            // Refused by `Model::check` before any export.
            tessera_planner::model::RopeType::Unknown => json!({"rope_type": "unknown"}),
            tessera_planner::model::RopeType::Llama3 => json!({
                "rope_type": "llama3",
                "rope_theta": a.rope_theta,
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_positions,
            }),
        },
    }
}

/// The HF class a model is written as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Gpt2,
    Llama,
}

impl Family {
    /// The class in `config.json`'s `architectures`.
    pub fn class(self) -> &'static str {
        match self {
            Family::Gpt2 => "GPT2LMHeadModel",
            Family::Llama => "LlamaForCausalLM",
        }
    }

    /// `config.json`'s `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Gpt2 => "gpt2",
            Family::Llama => "llama",
        }
    }
}

/// Why a model cannot be written in, or read from, HF's layout.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// The model has something neither class can express.
    #[error("model.{field} is {value}: {why}\n  fix: {fix}")]
    Inexpressible {
        field: String,
        value: String,
        why: String,
        fix: String,
    },
    #[error("{path}: cannot {what}: {source}")]
    Io {
        path: String,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{path}: {problem}\n  fix: {fix}")]
    Invalid {
        path: String,
        problem: String,
        fix: String,
    },
    /// An HF config that does not describe the plan's model.
    #[error("{path}: `{key}` is {hf}, but the plan's model has {plan}\n  fix: {fix}")]
    Mismatch {
        path: String,
        key: String,
        hf: String,
        plan: String,
        fix: String,
    },
}

impl HfError {
    fn io(path: &std::path::Path, what: &'static str, source: std::io::Error) -> Self {
        HfError::Io {
            path: path.display().to_string(),
            what,
            source,
        }
    }
}

/// The class `a` is written as, or which field neither class can express.
pub fn family(a: &Architecture) -> Result<Family, HfError> {
    let refuse = |field: &str, value: String, why: &str| {
        Err(HfError::Inexpressible {
            field: field.into(),
            value,
            why: why.into(),
            fix: "export a GPT-2-like model (learned positions, layernorm, gelu, biases, tied embeddings) or a Llama-like one (rope, rmsnorm, swiglu, no biases)".into(),
        })
    };
    if let Some(m) = &a.moe {
        return Err(HfError::Inexpressible {
            field: "experts".into(),
            value: m.experts.to_string(),
            why: "the export writes GPT2LMHeadModel or LlamaForCausalLM, which have no mixture-of-experts layers".into(),
            fix: "keep the checkpoint in tessera's format (resume and `tessera sample` read it); an MoE export (Mixtral, Qwen2-MoE) is not built yet".into(),
        });
    }
    let fam = match a.position {
        Position::Learned => Family::Gpt2,
        Position::Rope => Family::Llama,
    };
    let show = |v: &dyn std::fmt::Debug| format!("{v:?}").to_lowercase();
    match fam {
        Family::Gpt2 => {
            if a.norm != Norm::Layernorm {
                return refuse(
                    "norm",
                    show(&a.norm),
                    "GPT2LMHeadModel (learned positions) has LayerNorm only",
                );
            }
            if a.activation != Activation::Gelu {
                return refuse(
                    "activation",
                    show(&a.activation),
                    "GPT2LMHeadModel (learned positions) has a GELU MLP only",
                );
            }
            if !a.bias {
                return refuse(
                    "bias",
                    "false".into(),
                    "GPT2LMHeadModel has biases on every linear",
                );
            }
            if !a.tied_embeddings {
                return refuse(
                    "tied_embeddings",
                    "false".into(),
                    "GPT2LMHeadModel ties its output layer to the token embedding",
                );
            }
            if a.kv_heads != a.heads {
                return refuse(
                    "kv_heads",
                    a.kv_heads.to_string(),
                    "GPT2LMHeadModel has no grouped-query attention (kv_heads = heads)",
                );
            }
            if a.head_dim * a.heads != a.hidden {
                return refuse(
                    "head_dim",
                    a.head_dim.to_string(),
                    "GPT2LMHeadModel's head size is hidden / heads",
                );
            }
        }
        Family::Llama => {
            if a.norm != Norm::Rmsnorm {
                return refuse(
                    "norm",
                    show(&a.norm),
                    "LlamaForCausalLM (rope) has RMSNorm only",
                );
            }
            if a.activation != Activation::Swiglu {
                return refuse(
                    "activation",
                    show(&a.activation),
                    "LlamaForCausalLM (rope) has a SwiGLU MLP only",
                );
            }
            if a.bias {
                return refuse(
                    "bias",
                    "true".into(),
                    "LlamaForCausalLM's layers as Tessera exports them have no biases",
                );
            }
            if a.qkv_bias {
                return refuse("qkv_bias", "true".into(), "LlamaForCausalLM has no q/k/v-only biases (attention_bias adds one to o_proj too)");
            }
        }
    }
    Ok(fam)
}

/// One HF tensor and the Tessera tensors it is made of.
#[derive(Debug, Clone)]
pub(crate) struct Map {
    /// The HF name.
    pub hf: String,
    /// Tessera's global tensors, concatenated along their first dimension (`c_attn`: q, k, v).
    pub ours: Vec<String>,
    /// Stored transposed (GPT-2's `Conv1D`).
    pub conv1d: bool,
    /// Rows are the vocabulary: HF has the real rows only.
    pub vocab: bool,
}

/// Every tensor of `a` as class `fam` stores it (a tied output layer is not stored).
pub(crate) fn mapping(a: &Architecture, fam: Family) -> Vec<Map> {
    let m = |hf: String, ours: &[String], conv1d: bool, vocab: bool| Map {
        hf,
        ours: ours.to_vec(),
        conv1d,
        vocab,
    };
    let one = |hf: String, ours: String| m(hf, &[ours], false, false);
    let mut out = Vec::new();
    match fam {
        Family::Gpt2 => {
            let t = "transformer";
            out.push(m(
                format!("{t}.wte.weight"),
                &["wte.weight".into()],
                false,
                true,
            ));
            out.push(one(format!("{t}.wpe.weight"), "wpe.weight".into()));
            for l in 0..a.layers {
                let (hf, us) = (format!("{t}.h.{l}"), format!("h.{l}"));
                for ln in ["ln_1", "ln_2"] {
                    for s in ["weight", "bias"] {
                        out.push(one(format!("{hf}.{ln}.{s}"), format!("{us}.{ln}.{s}")));
                    }
                }
                let qkv = |s: &str| ["q", "k", "v"].map(|p| format!("{us}.attn.{p}.{s}"));
                out.push(m(
                    format!("{hf}.attn.c_attn.weight"),
                    &qkv("weight"),
                    true,
                    false,
                ));
                out.push(m(
                    format!("{hf}.attn.c_attn.bias"),
                    &qkv("bias"),
                    false,
                    false,
                ));
                let pairs = [
                    ("attn.c_proj", "attn.o"),
                    ("mlp.c_fc", "mlp.fc"),
                    ("mlp.c_proj", "mlp.proj"),
                ];
                for (h, o) in pairs {
                    out.push(m(
                        format!("{hf}.{h}.weight"),
                        &[format!("{us}.{o}.weight")],
                        true,
                        false,
                    ));
                    out.push(one(format!("{hf}.{h}.bias"), format!("{us}.{o}.bias")));
                }
            }
            out.push(one(format!("{t}.ln_f.weight"), "ln_f.weight".into()));
            out.push(one(format!("{t}.ln_f.bias"), "ln_f.bias".into()));
        }
        Family::Llama => {
            out.push(m(
                "model.embed_tokens.weight".into(),
                &["wte.weight".into()],
                false,
                true,
            ));
            for l in 0..a.layers {
                let (hf, us) = (format!("model.layers.{l}"), format!("h.{l}"));
                let pairs = [
                    ("input_layernorm", "ln_1"),
                    ("post_attention_layernorm", "ln_2"),
                    ("self_attn.q_proj", "attn.q"),
                    ("self_attn.k_proj", "attn.k"),
                    ("self_attn.v_proj", "attn.v"),
                    ("self_attn.o_proj", "attn.o"),
                    ("mlp.gate_proj", "mlp.gate"),
                    ("mlp.up_proj", "mlp.up"),
                    ("mlp.down_proj", "mlp.proj"),
                ];
                for (h, o) in pairs {
                    out.push(one(format!("{hf}.{h}.weight"), format!("{us}.{o}.weight")));
                }
            }
            out.push(one("model.norm.weight".into(), "ln_f.weight".into()));
            if !a.tied_embeddings {
                out.push(m(
                    "lm_head.weight".into(),
                    &["lm_head.weight".into()],
                    false,
                    true,
                ));
            }
        }
    }
    out
}

/// A module of the HF class that has a weight: its path (no `.weight`) and the Tessera weights
/// it is made of, concatenated along their rows (`c_attn`: q, k, v).
#[derive(Debug, Clone)]
pub(crate) struct Module {
    pub module: String,
    pub parts: Vec<String>,
}

/// The HF class's modules of `a` that have a weight (the linears, and the norms and embeddings
/// beside them), by the runtime's name: the weight's name without `.weight`, or for fused
/// weights their parent and their names joined (`h.3.attn.q`, `.k`, `.v` are `h.3.attn.qkv`,
/// GPT-2's `c_attn`). A LoRA adapter `{linear}.lora_A.weight` (`layers::lora_attach`) sits on
/// the module of its linear.
pub(crate) fn modules(a: &Architecture, fam: Family) -> std::collections::BTreeMap<String, Module> {
    let mut out = std::collections::BTreeMap::new();
    for m in mapping(a, fam) {
        let (Some(module), Some(parts)) = (
            m.hf.strip_suffix(".weight"),
            m.ours
                .iter()
                .map(|n| n.strip_suffix(".weight"))
                .collect::<Option<Vec<_>>>(),
        ) else {
            continue;
        };
        let name = match parts.as_slice() {
            [one] => one.to_string(),
            [first, ..] => {
                let parent = first.rsplit_once('.').map_or("", |(p, _)| p);
                let leaves: Option<String> = parts
                    .iter()
                    .map(|p| p.strip_prefix(parent)?.strip_prefix('.'))
                    .collect();
                match leaves {
                    Some(l) => format!("{parent}.{l}"),
                    None => continue,
                }
            }
            [] => continue,
        };
        let parts = m.ours.clone();
        out.insert(
            name,
            Module {
                module: module.to_string(),
                parts,
            },
        );
    }
    out
}

/// `config.json` of `a` as class `fam`; `max_positions` is the RoPE model's context length
/// (its training sequence length).
pub fn config(a: &Architecture, fam: Family, max_positions: u64) -> serde_json::Value {
    use serde_json::json;
    match fam {
        Family::Gpt2 => json!({
            "architectures": [fam.class()],
            "model_type": fam.model_type(),
            "vocab_size": a.vocab,
            "n_positions": a.max_positions,
            "n_embd": a.hidden,
            "n_layer": a.layers,
            "n_head": a.heads,
            "n_inner": a.ffn_hidden,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": a.norm_eps,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "initializer_range": 0.02,
            "scale_attn_weights": true,
            "scale_attn_by_inverse_layer_idx": false,
            "reorder_and_upcast_attn": false,
            "tie_word_embeddings": true,
            "bos_token_id": null,
            "eos_token_id": null,
            "use_cache": true,
            "dtype": "float32",
        }),
        Family::Llama => json!({
            "architectures": [fam.class()],
            "model_type": fam.model_type(),
            "vocab_size": a.vocab,
            "hidden_size": a.hidden,
            "intermediate_size": a.ffn_hidden,
            "num_hidden_layers": a.layers,
            "num_attention_heads": a.heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": max_positions,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_parameters": rope_parameters(a),
            "attention_bias": false,
            "attention_dropout": 0.0,
            "mlp_bias": false,
            "tie_word_embeddings": a.tied_embeddings,
            "initializer_range": 0.02,
            "use_cache": true,
            "dtype": "float32",
        }),
    }
}

#[cfg(test)]
mod tests;
