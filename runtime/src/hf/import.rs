//! Reading an HF folder (`model.safetensors` + `config.json` of `GPT2LMHeadModel` or
//! `LlamaForCausalLM`) as the global tensors of a plan's model: the config is checked against
//! the model key by key, and every tensor is read back into Tessera's names and layouts.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors};
use serde_json::Value;
use tessera_planner::model::Architecture;

use crate::layers::dropout::DropoutRates;

use super::export::transpose;
use super::{family, mapping, rope_parameters, Family, HfError, CONFIG, WEIGHTS};

/// An HF model read as Tessera's global tensors.
#[derive(Debug, Clone)]
pub struct HfWeights {
    pub family: Family,
    /// By Tessera name: the global shape (the real vocabulary rows, no padding) and values.
    pub tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    /// The config's dropout rates, as the family's model applies them ([`ConfigDropout`]).
    pub dropout: ConfigDropout,
    /// The config's training settings this run does not apply, as `key value` (dropout
    /// probabilities above 0 of keys the causal LM does not read, GPT-2's
    /// `summary_first_dropout`).
    pub set_aside: Vec<String>,
}

/// The dropout of an HF config, site by site, as transformers' model applies it: GPT-2's
/// `embd_pdrop`, `attn_pdrop` and `resid_pdrop` (0.1 each where absent, `GPT2Config`'s
/// defaults); Llama's `attention_dropout` on the probabilities (0.0 where absent), and no
/// embedding or residual dropout (`LlamaModel` has none).
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigDropout {
    pub rates: DropoutRates,
    /// Each site's rate and the key it comes from, for the run's message.
    pub sites: Vec<String>,
}

impl ConfigDropout {
    /// The keys this reads: any other dropout key is set aside.
    fn keys(fam: Family) -> &'static [&'static str] {
        match fam {
            Family::Gpt2 => &["embd_pdrop", "attn_pdrop", "resid_pdrop"],
            Family::Llama => &["attention_dropout"],
        }
    }

    fn of(cfg: &Value, fam: Family) -> Self {
        let rate =
            |key: &str, default: f64| cfg.get(key).and_then(Value::as_f64).unwrap_or(default);
        let (embedding, attention, residual) = match fam {
            Family::Gpt2 => (
                rate("embd_pdrop", 0.1),
                rate("attn_pdrop", 0.1),
                rate("resid_pdrop", 0.1),
            ),
            Family::Llama => (0.0, rate("attention_dropout", 0.0), 0.0),
        };
        let sites = match fam {
            Family::Gpt2 => vec![
                format!("embedding {embedding} (embd_pdrop)"),
                format!("attention {attention} (attn_pdrop)"),
                format!("residual {residual} (resid_pdrop)"),
            ],
            Family::Llama => vec![
                "embedding 0 (LlamaModel has none)".into(),
                format!("attention {attention} (attention_dropout)"),
                "residual 0 (LlamaModel has none)".into(),
            ],
        };
        Self {
            rates: DropoutRates {
                embedding: embedding as f32,
                attention: attention as f32,
                residual: residual as f32,
                lora: 0.0,
            },
            sites,
        }
    }
}

/// The config's dropout probabilities above 0 (keys naming dropout, or GPT-2's `*_pdrop`) that
/// the family's causal LM does not read ([`ConfigDropout::keys`]), as `key value`: set aside
/// by a load.
fn dropouts(cfg: &Value, fam: Family) -> Vec<String> {
    let Some(map) = cfg.as_object() else {
        return Vec::new();
    };
    map.iter()
        .filter(|(k, _)| k.contains("dropout") || k.ends_with("_pdrop"))
        .filter(|(k, _)| !ConfigDropout::keys(fam).contains(&k.as_str()))
        .filter_map(|(k, v)| v.as_f64().filter(|p| *p != 0.0).map(|p| format!("{k} {p}")))
        .collect()
}

/// Reads the HF folder `dir` as the model `a` (a plan's), refusing a config that describes
/// another model (naming the key) and tensors of other names, shapes or types.
pub fn load(dir: &Path, a: &Architecture) -> Result<HfWeights, HfError> {
    let fam = family(a)?;
    let (set_aside, dropout) = check_config(&dir.join(CONFIG), a, fam)?;
    let path = dir.join(WEIGHTS);
    let bytes = fs::read(&path).map_err(|e| HfError::io(&path, "read", e))?;
    let bad = |problem: String| {
        HfError::Invalid {
        path: path.display().to_string(),
        problem,
        fix: format!("pass a folder saved by {}'s save_pretrained (safetensors) or by `tessera checkpoint export`", fam.class()),
    }
    };
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("not a readable safetensors file: {e}")))?;
    let model = crate::exec::StageModel::whole(a)
        .map_err(|e| bad(format!("the plan's model cannot be built: {e}")))?;
    let ours: BTreeMap<&str, &[usize]> = model
        .layout
        .entries()
        .iter()
        .map(|e| (e.name.as_str(), e.global_shape.as_slice()))
        .collect();
    let vocab = a.vocab as usize;
    let mut used = BTreeSet::new();
    let mut tensors = BTreeMap::new();
    for m in mapping(a, fam) {
        let key = [
            m.hf.clone(),
            m.hf.trim_start_matches("transformer.").to_string(),
        ]
        .into_iter()
        .find(|k| st.tensor(k).is_ok())
        .ok_or_else(|| bad(format!("lacks tensor {}", m.hf)))?;
        let view = st.tensor(&key).map_err(|e| bad(format!("{key}: {e}")))?;
        used.insert(key.clone());
        let shapes: Vec<Vec<usize>> = m
            .ours
            .iter()
            .map(|n| {
                let mut s = ours.get(n.as_str()).map(|s| s.to_vec()).unwrap_or_default();
                if m.vocab && !s.is_empty() {
                    s[0] = vocab;
                }
                s
            })
            .collect();
        let rows: usize = shapes.iter().map(|s| s.first().copied().unwrap_or(0)).sum();
        let cols: usize = shapes[0].iter().skip(1).product();
        let want = match (shapes[0].len(), m.conv1d) {
            (1, _) => vec![rows],
            (_, false) => vec![rows, cols],
            (_, true) => vec![cols, rows],
        };
        if view.shape() != want.as_slice() {
            return Err(bad(format!(
                "{key} has shape {:?}; the plan's model needs {want:?}",
                view.shape()
            )));
        }
        let values = to_f32(view.dtype(), view.data()).ok_or_else(|| {
            bad(format!(
                "{key} is {:?}; F32, BF16 and F16 are read",
                view.dtype()
            ))
        })?;
        let values = if m.conv1d && shapes[0].len() > 1 {
            transpose(&values, cols, rows)
        } else {
            values
        };
        let mut at = 0;
        for (name, shape) in m.ours.iter().zip(shapes) {
            let n: usize = shape.iter().product();
            tensors.insert(name.clone(), (shape, values[at..at + n].to_vec()));
            at += n;
        }
    }
    let ignorable = |n: &str| {
        n.ends_with(".attn.bias")
            || n.ends_with(".attn.masked_bias")
            || n.ends_with("rotary_emb.inv_freq")
            || (a.tied_embeddings && n == "lm_head.weight")
    };
    if let Some(extra) = st
        .names()
        .into_iter()
        .find(|n| !used.contains(*n) && !ignorable(n))
    {
        return Err(bad(format!(
            "holds tensor {extra}, which {} as Tessera reads it has no place for",
            fam.class()
        )));
    }
    Ok(HfWeights {
        set_aside,
        dropout,
        family: fam,
        tensors,
    })
}

fn to_f32(dtype: Dtype, data: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
        _ => return None,
    })
}

fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = (i32::from((h >> 10) & 0x1f), f32::from(h & 0x3ff));
    sign * match exp {
        0 => man * 2f32.powi(-24),
        31 if man == 0.0 => f32::INFINITY,
        31 => f32::NAN,
        e => (1.0 + man / 1024.0) * 2f32.powi(e - 15),
    }
}

/// θ of a config that names none (LlamaConfig's default).
const ROPE_THETA_DEFAULT: f64 = 10_000.0;

/// Checks `config.json` against the model, key by key.
fn check_config(
    path: &Path,
    a: &Architecture,
    fam: Family,
) -> Result<(Vec<String>, ConfigDropout), HfError> {
    let text = fs::read(path).map_err(|e| HfError::io(path, "read", e))?;
    let cfg: Value = serde_json::from_slice(&text).map_err(|e| HfError::Invalid {
        path: path.display().to_string(),
        problem: format!("not valid JSON: {e}"),
        fix: "pass a Hugging Face model folder".into(),
    })?;
    let mismatch = |key: &str, hf: String, plan: String| {
        Err(HfError::Mismatch {
            path: path.display().to_string(),
            key: key.into(),
            hf,
            plan,
            fix: "plan the model this config describes (`tessera plan` reads config.json as MODEL), or pass the folder of the plan's model".into(),
        })
    };
    let show = |v: Option<&Value>| v.map_or("absent".to_string(), |v| v.to_string());
    let model_type = cfg.get("model_type");
    if model_type.and_then(Value::as_str) != Some(fam.model_type()) {
        return mismatch(
            "model_type",
            show(model_type),
            format!("{:?} ({})", fam.model_type(), fam.class()),
        );
    }
    let heads_dim = a.hidden / a.heads.max(1);
    let ints: Vec<(&str, u64, Option<u64>)> = match fam {
        Family::Gpt2 => vec![
            ("n_layer", a.layers, None),
            ("n_embd", a.hidden, None),
            ("n_head", a.heads, None),
            ("n_inner", a.ffn_hidden, Some(4 * a.hidden)),
            ("vocab_size", a.vocab, None),
            ("n_positions", a.max_positions, None),
        ],
        Family::Llama => vec![
            ("num_hidden_layers", a.layers, None),
            ("hidden_size", a.hidden, None),
            ("num_attention_heads", a.heads, None),
            ("num_key_value_heads", a.kv_heads, Some(a.heads)),
            ("head_dim", a.head_dim, Some(heads_dim)),
            ("intermediate_size", a.ffn_hidden, None),
            ("vocab_size", a.vocab, None),
        ],
    };
    for (key, plan, default) in ints {
        let v = cfg.get(key).filter(|v| !v.is_null());
        let got = match v {
            Some(v) => v.as_u64(),
            None => default,
        };
        if got != Some(plan) {
            return mismatch(key, show(v), plan.to_string());
        }
    }
    let floats: Vec<(&str, f64, f64)> = match fam {
        Family::Gpt2 => vec![("layer_norm_epsilon", a.norm_eps, 1e-5)],
        Family::Llama => vec![("rms_norm_eps", a.norm_eps, 1e-6)],
    };
    for (key, plan, default) in floats {
        let v = cfg.get(key);
        let got = v.map_or(Some(default), Value::as_f64);
        if got.is_none_or(|g| (g - plan).abs() > 1e-12 * plan.abs()) {
            return mismatch(key, show(v), format!("{plan:e} (the plan's norm_eps)"));
        }
    }
    let flags: Vec<(&str, bool, bool)> = match fam {
        Family::Gpt2 => vec![
            ("tie_word_embeddings", true, true),
            ("scale_attn_weights", true, true),
            ("scale_attn_by_inverse_layer_idx", false, false),
        ],
        Family::Llama => vec![
            ("tie_word_embeddings", a.tied_embeddings, false),
            ("attention_bias", false, false),
            ("mlp_bias", false, false),
        ],
    };
    for (key, plan, default) in flags {
        let v = cfg.get(key);
        if v.map_or(Some(default), Value::as_bool) != Some(plan) {
            return mismatch(key, show(v), plan.to_string());
        }
    }
    let (act_key, acts): (&str, &[&str]) = match fam {
        Family::Gpt2 => ("activation_function", &["gelu_new", "gelu_pytorch_tanh"]),
        Family::Llama => ("hidden_act", &["silu"]),
    };
    let act = cfg.get(act_key);
    let act_str = act.and_then(Value::as_str).unwrap_or(acts[0]);
    if !acts.contains(&act_str) {
        return mismatch(act_key, show(act), format!("{:?}", acts[0]));
    }
    if fam == Family::Llama {
        // transformers 5 writes `rope_parameters`, earlier versions `rope_scaling` and a
        // top-level `rope_theta` (standardize_rope_params merges them): each given value must be
        // the plan's.
        let rope = cfg
            .get("rope_parameters")
            .or_else(|| cfg.get("rope_scaling"))
            .filter(|v| !v.is_null());
        let want = rope_parameters(a);
        let rope_type = rope.and_then(|r| r.get("rope_type").or_else(|| r.get("type")));
        let got_type = rope_type.and_then(Value::as_str).unwrap_or("default");
        if got_type != want["rope_type"] {
            return mismatch(
                "rope_parameters.rope_type",
                show(rope_type),
                format!("{} (the plan's rope_scaling)", want["rope_type"]),
            );
        }
        let theta = rope
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| cfg.get("rope_theta"));
        if theta.map_or(Some(ROPE_THETA_DEFAULT), Value::as_f64) != Some(a.rope_theta) {
            return mismatch(
                "rope_theta",
                show(theta),
                format!("{} (the plan's rope_theta)", a.rope_theta),
            );
        }
        if let Some(s) = &a.rope_scaling {
            let original = rope
                .and_then(|r| r.get("original_max_position_embeddings"))
                .or_else(|| cfg.get("max_position_embeddings"));
            let got = [
                ("factor", rope.and_then(|r| r.get("factor"))),
                (
                    "low_freq_factor",
                    rope.and_then(|r| r.get("low_freq_factor")),
                ),
                (
                    "high_freq_factor",
                    rope.and_then(|r| r.get("high_freq_factor")),
                ),
                ("original_max_position_embeddings", original),
            ];
            let plan = [
                s.factor,
                s.low_freq_factor,
                s.high_freq_factor,
                s.original_max_positions as f64,
            ];
            for ((key, v), p) in got.into_iter().zip(plan) {
                if v.and_then(Value::as_f64) != Some(p) {
                    return mismatch(
                        &format!("rope_parameters.{key}"),
                        show(v),
                        format!("{p} (the plan's rope_scaling)"),
                    );
                }
            }
        }
    }
    Ok((dropouts(&cfg, fam), ConfigDropout::of(&cfg, fam)))
}
