//! The keys of the mixture-of-experts families, read as transformers 5.24.0's classes build
//! their models (checked tensor by tensor by scripts/check_moe_counts.py):
//!
//! - `mixtral` (MixtralForCausalLM): Mistral's attention; every layer has `num_local_experts`
//!   SwiGLU experts of `intermediate_size`, `num_experts_per_tok` per token, softmax scores,
//!   the top-k weights always renormalised; `router_jitter_noise` (multiplicative noise on the
//!   router input in training) must be 0; `sliding_window` defaults to none.
//! - `qwen2_moe`, `qwen3_moe` (Qwen2MoeForCausalLM, Qwen3MoeForCausalLM): layer `i` is an MoE
//!   layer when it is not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`;
//!   `num_experts` experts of `moe_intermediate_size`, top-`num_experts_per_tok`, renormalised
//!   when `norm_topk_prob` (default false). Qwen2-MoE adds one shared expert of
//!   `shared_expert_intermediate_size` behind a sigmoid gate and has Q, K, V biases
//!   (`qkv_bias`, default true); Qwen3-MoE has no shared expert, and a norm over each query and
//!   key head (`q_norm`, `k_norm`).
//! - `deepseek_v3` (DeepseekV3ForCausalLM): MLA attention (`q_lora_rank`, `kv_lora_rank`,
//!   `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`); layers from
//!   `first_k_dense_replace` on are MoE layers of `n_routed_experts` experts of
//!   `moe_intermediate_size` and one shared expert of `n_shared_experts ×
//!   moe_intermediate_size`; the router is sigmoid scores plus the `e_score_correction_bias`
//!   buffer (counted: it is in the checkpoint), top-`num_experts_per_tok` within `topk_group` of
//!   `n_group` groups, renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`.
//!   The multi-token-prediction module (`num_nextn_predict_layers`, the checkpoint's
//!   `model.layers.61`) is not built by the class, so it is not counted: the counts are the
//!   671B main model's.
//!
//! Keys that select among router variants transformers does not implement are refused
//! (`scoring_func` other than sigmoid, `topk_method` other than noaux_tc, `moe_layer_freq` other
//! than 1: DeepSeek's remote code reads it, transformers does not).

use serde_json::Value;

use super::{describe, Family, Keys};
use crate::error::Diagnostic;
use crate::model::{Activation, Architecture, Mla, Moe, Norm, Position, RouterScoring};

/// Mixtral's keys besides the Llama family's.
pub(super) const MIXTRAL_READ: &[&str] = &[
    "sliding_window",
    "num_local_experts",
    "num_experts_per_tok",
    "router_aux_loss_coef",
    "router_jitter_noise",
    "output_router_logits",
];

/// Qwen2-MoE's keys besides the Llama family's.
pub(super) const QWEN2_MOE_READ: &[&str] = &[
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "qkv_bias",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
    "router_aux_loss_coef",
    "output_router_logits",
];

/// Qwen3-MoE's keys besides the Llama family's (`max_window_layers` is in the published
/// configs, and Qwen3MoeConfig does not read it).
pub(super) const QWEN3_MOE_READ: &[&str] = &[
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "attention_bias",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
    "router_aux_loss_coef",
    "output_router_logits",
];

/// DeepSeek-V3's keys besides the Llama family's. `auto_map` names the repository's own code,
/// which Tessera does not run; `ep_size` is that code's inference expert parallelism and
/// `seq_aux` its sequence-wise balance-loss switch; `rope_interleave` is the layout of the RoPE
/// channels (MLA is not computed by Tessera); `num_nextn_predict_layers` / `num_mtp_layers`
/// count the MTP modules, which the class does not build.
pub(super) const DEEPSEEK_V3_READ: &[&str] = &[
    "attention_bias",
    "n_routed_experts",
    "num_local_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "first_k_dense_replace",
    "moe_layer_freq",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_group",
    "topk_group",
    "topk_method",
    "scoring_func",
    "routed_scaling_factor",
    "norm_topk_prob",
    "aux_loss_alpha",
    "seq_aux",
    "ep_size",
    "num_nextn_predict_layers",
    "num_mtp_layers",
    "rope_interleave",
    "auto_map",
    "output_router_logits",
];

/// An explicit MoE layer list (Qwen's `mlp_only_layers`) is built only for models up to this
/// many layers: a list of more would be a config no model has.
const MAX_LISTED_LAYERS: u64 = 1 << 16;

/// The config key a resolved MoE or MLA field was read from.
pub(super) fn key_of(field: &str, family: Family) -> Option<&'static str> {
    use Family::*;
    let moe = matches!(family, Mixtral | Qwen2Moe | Qwen3Moe | DeepseekV3);
    let name = field.strip_prefix("architecture.").filter(|_| moe)?;
    Some(match (family, name) {
        (Mixtral, "experts") => "num_local_experts",
        (DeepseekV3, "experts") => "n_routed_experts",
        (_, "experts") => "num_experts",
        (_, "experts_per_token") => "num_experts_per_tok",
        (Mixtral, "moe_ffn_hidden") => "intermediate_size",
        (_, "moe_ffn_hidden") => "moe_intermediate_size",
        (DeepseekV3, "first_dense_layers" | "moe_layer_frequency") => "first_k_dense_replace",
        (_, "first_dense_layers" | "moe_layer_frequency") => "decoder_sparse_step",
        (_, "moe_layers") => "mlp_only_layers",
        (DeepseekV3, "shared_experts" | "shared_expert_ffn_hidden") => "n_shared_experts",
        (_, "shared_experts" | "shared_expert_ffn_hidden") => "shared_expert_intermediate_size",
        (DeepseekV3, "router_aux_loss_coef") => "aux_loss_alpha",
        (_, "router_aux_loss_coef") => "router_aux_loss_coef",
        (_, "expert_groups") => "n_group",
        (_, "expert_groups_per_token") => "topk_group",
        (_, "routed_scaling_factor") => "routed_scaling_factor",
        (_, "mla.q_lora_rank") => "q_lora_rank",
        (_, "mla.kv_lora_rank") => "kv_lora_rank",
        (_, "mla.qk_nope_head_dim" | "head_dim") if family == DeepseekV3 => "qk_nope_head_dim",
        (_, "mla.qk_rope_head_dim") => "qk_rope_head_dim",
        (_, "mla.v_head_dim") => "v_head_dim",
        (_, "qk_norm") => "model_type",
        _ => return None,
    })
}

impl Keys<'_> {
    /// An integer that may be 0 under `key`; `default` when absent or `null`.
    fn count_or_zero(&self, key: &str, default: u64) -> Result<u64, Diagnostic> {
        match self.get(key) {
            None => Ok(default),
            Some(x) => match x.as_u64().filter(|_| !x.is_f64()) {
                Some(n) => Ok(n),
                None => Err(self.err(
                    key,
                    format!("must be 0 or a positive integer, found {}", describe(x)),
                    format!("set \"{key}\" to a JSON integer of 0 or more"),
                )),
            },
        }
    }

    /// A number of 0 or more under `key`; `default` when absent or `null`.
    fn weight(&self, key: &str, default: f64) -> Result<f64, Diagnostic> {
        match self.get(key) {
            None => Ok(default),
            Some(x) => match x.as_f64().filter(|f| f.is_finite() && *f >= 0.0) {
                Some(f) if !x.is_boolean() => Ok(f),
                _ => Err(self.err(
                    key,
                    format!("must be a number of 0 or more, found {}", describe(x)),
                    format!("set \"{key}\" to a JSON number of 0 or more (no quotes)"),
                )),
            },
        }
    }

    /// A string key that must hold `want` when given (the only variant the class computes).
    fn only(&self, key: &str, want: &str, what: &str) -> Result<(), Diagnostic> {
        match self.get(key) {
            Some(x) if x.as_str() != Some(want) => Err(self.err(
                key,
                format!("{key} {} is not computed: {what}", describe(x)),
                format!("set \"{key}\": \"{want}\" (or remove it)"),
            )),
            _ => Ok(()),
        }
    }

    /// The biases of Qwen2-MoE (`qkv_bias`, default true: Q, K and V) and Qwen3-MoE
    /// (`attention_bias`, default false: Q, K, V and O, which no Tessera key expresses).
    pub(super) fn moe_family_biases(&self, family: Family) -> Result<(bool, bool), Diagnostic> {
        if family == Family::Qwen2Moe {
            return Ok((false, self.boolean("qkv_bias", true)?));
        }
        if self.boolean("attention_bias", false)? {
            return Err(self.err(
                "attention_bias",
                "attention_bias is true: Qwen3MoeForCausalLM then has biases on q, k, v and o_proj but not the experts, which Tessera's layers cannot express (biases on every linear, `bias`, or on q, k and v only, `qkv_bias`)".into(),
                "set \"attention_bias\" to false".into(),
            ));
        }
        Ok((false, false))
    }

    /// The attention window of a Qwen2-MoE or Qwen3-MoE config: none without
    /// `use_sliding_window`; with it, `sliding_window` (default 4096) on Qwen3-MoE's every layer,
    /// and on the Qwen2-MoE layers `layer_types` make sliding (by default the even-numbered
    /// layers below `max_window_layers`, default 28, as Qwen2MoeConfig builds them).
    pub(super) fn moe_family_window(
        &self,
        family: Family,
        layers: u64,
    ) -> Result<Option<u64>, Diagnostic> {
        if !self.boolean("use_sliding_window", false)? {
            return Ok(None);
        }
        let window = match self.v.get("sliding_window") {
            None => Some(4096),
            Some(_) => self.int(&["sliding_window"], false, true)?,
        };
        if family == Family::Qwen3Moe {
            return Ok(window);
        }
        let slides = match self.layer_types_slide(layers)? {
            Some(slides) => slides,
            None => self.max_window_layers(layers)? > 0,
        };
        Ok(window.filter(|_| slides))
    }

    /// The routed (and shared) experts of a Mixtral, Qwen2-MoE or Qwen3-MoE config.
    pub(super) fn routed_experts(
        &self,
        family: Family,
        layers: u64,
        ffn_hidden: u64,
    ) -> Result<Moe, Diagnostic> {
        let mixtral = family == Family::Mixtral;
        let experts = self.count(&[if mixtral {
            "num_local_experts"
        } else {
            "num_experts"
        }])?;
        let experts_per_token = self.count(&["num_experts_per_tok"])?;
        let mut moe = Moe {
            experts,
            experts_per_token,
            moe_ffn_hidden: ffn_hidden,
            first_dense_layers: 0,
            moe_layer_frequency: 1,
            moe_layers: None,
            shared_experts: 0,
            shared_expert_ffn_hidden: ffn_hidden,
            shared_expert_gate: false,
            capacity_factor: None,
            router_aux_loss_coef: self.weight("router_aux_loss_coef", 0.001)?,
            router_scoring: RouterScoring::Softmax,
            router_score_bias: false,
            normalize_top_k: true,
            routed_scaling_factor: 1.0,
            expert_groups: 1,
            expert_groups_per_token: 1,
        };
        if mixtral {
            if self.weight("router_jitter_noise", 0.0)? != 0.0 {
                return Err(self.err(
                    "router_jitter_noise",
                    "router_jitter_noise multiplies the router's input by uniform noise in training, which Tessera does not model".into(),
                    "set \"router_jitter_noise\" to 0.0 (or remove it)".into(),
                ));
            }
            return Ok(moe);
        }
        moe.moe_ffn_hidden = self.count(&["moe_intermediate_size"])?;
        moe.normalize_top_k = self.boolean("norm_topk_prob", false)?;
        if family == Family::Qwen2Moe {
            moe.shared_experts = 1;
            moe.shared_expert_gate = true;
            moe.shared_expert_ffn_hidden = self.count(&["shared_expert_intermediate_size"])?;
        } else {
            moe.shared_expert_ffn_hidden = moe.moe_ffn_hidden;
        }
        let step = self
            .int(&["decoder_sparse_step"], false, false)?
            .unwrap_or(1);
        // (i + 1) % step == 0: layers step − 1, 2·step − 1, …
        moe.first_dense_layers = step - 1;
        moe.moe_layer_frequency = step;
        let dense = match self.get("mlp_only_layers") {
            None => Vec::new(),
            Some(x) => {
                let list = x.as_array().and_then(|a| {
                    a.iter()
                        .map(|l| l.as_u64().filter(|_| !l.is_f64()))
                        .collect::<Option<Vec<u64>>>()
                });
                list.ok_or_else(|| {
                    self.err(
                        "mlp_only_layers",
                        format!(
                            "must be a list of 0-based layer indices, found {}",
                            describe(x)
                        ),
                        "write \"mlp_only_layers\": [] or a list of JSON integers".into(),
                    )
                })?
            }
        };
        if let Some(past) = dense.iter().find(|l| **l >= layers) {
            return Err(self.err(
                "mlp_only_layers",
                format!(
                    "lists layer {past}, and the config has {layers} layers (num_hidden_layers), numbered 0 … {}",
                    layers.saturating_sub(1)
                ),
                format!(
                    "remove {past} from \"mlp_only_layers\" (its entries are 0-based layer indices below {layers}), or correct \"num_hidden_layers\""
                ),
            ));
        }
        if !dense.is_empty() {
            if layers > MAX_LISTED_LAYERS {
                return Err(self.err(
                    "mlp_only_layers",
                    format!("an explicit list of MoE layers is built for at most {MAX_LISTED_LAYERS} layers, and the config has {layers}"),
                    "remove \"mlp_only_layers\", or write a TOML model spec with `moe_layers`".into(),
                ));
            }
            let listed = (0..layers)
                .filter(|l| moe.is_moe_layer(*l) && !dense.contains(l))
                .collect();
            moe.first_dense_layers = 0;
            moe.moe_layer_frequency = 1;
            moe.moe_layers = Some(listed);
        }
        Ok(moe)
    }

    /// The architecture of a DeepSeek-V3 config: MLA attention and the MoE layers.
    pub(super) fn deepseek_v3(&self) -> Result<Architecture, Diagnostic> {
        let hidden = self.count(&["hidden_size"])?;
        let heads = self.count(&["num_attention_heads"])?;
        let kv_heads = self
            .int(&["num_key_value_heads"], false, true)?
            .unwrap_or(heads);
        let act = self.string("hidden_act", "silu")?;
        if act != "silu" && act != "swish" {
            return Err(self.err(
                "hidden_act",
                format!("unsupported hidden_act \"{act}\" for a gated MLP"),
                "use \"silu\" (SwiGLU)".into(),
            ));
        }
        if self.boolean("attention_bias", false)? {
            return Err(self.err(
                "attention_bias",
                "attention_bias is true: biases on MLA's q_a, kv_a and o projections are not modelled".into(),
                "set \"attention_bias\" to false (DeepSeek-V3 has none)".into(),
            ));
        }
        // q_lora_rank: int | None = 1536: absent is the class's 1536, null a direct projection.
        let q_lora_rank = match self.v.get("q_lora_rank") {
            None => Some(1536),
            Some(_) => self.int(&["q_lora_rank"], false, true)?,
        };
        let mla = Mla {
            q_lora_rank,
            kv_lora_rank: self.count(&["kv_lora_rank"])?,
            qk_nope_head_dim: self.count(&["qk_nope_head_dim"])?,
            qk_rope_head_dim: self.count(&["qk_rope_head_dim"])?,
            v_head_dim: self.count(&["v_head_dim"])?,
        };
        self.only(
            "scoring_func",
            "sigmoid",
            "DeepseekV3TopkRouter scores by a sigmoid",
        )?;
        self.only("topk_method", "noaux_tc", "DeepseekV3TopkRouter chooses the top-k within the top groups, with the score-correction bias (noaux_tc)")?;
        if self.int(&["moe_layer_freq"], false, true)?.unwrap_or(1) != 1 {
            return Err(self.err(
                "moe_layer_freq",
                "moe_layer_freq is not 1: DeepSeek's own code then makes every moe_layer_freq-th layer an MoE layer, and transformers' DeepseekV3 every layer from first_k_dense_replace on".into(),
                "set \"moe_layer_freq\" to 1, or write a TOML model spec with `moe_layer_frequency`".into(),
            ));
        }
        self.int(&["ep_size"], false, true)?;
        self.find(&["num_nextn_predict_layers", "num_mtp_layers"])?;
        self.count_or_zero("num_nextn_predict_layers", 0)?;
        self.count_or_zero("num_mtp_layers", 0)?;
        for key in ["seq_aux", "rope_interleave"] {
            if self.get(key).is_some() {
                self.boolean(key, false)?;
            }
        }
        let ffn_hidden = self.count(&["intermediate_size"])?;
        let moe_ffn_hidden = self.count(&["moe_intermediate_size"])?;
        let shared_experts = self.count_or_zero("n_shared_experts", 1)?;
        let expert_groups = self.int(&["n_group"], false, true)?.unwrap_or(8);
        let moe = Moe {
            experts: self.count(&["n_routed_experts", "num_local_experts"])?,
            experts_per_token: self.count(&["num_experts_per_tok"])?,
            moe_ffn_hidden,
            first_dense_layers: self.count_or_zero("first_k_dense_replace", 3)?,
            moe_layer_frequency: 1,
            moe_layers: None,
            shared_experts,
            // One MLP of n_shared_experts × moe_intermediate_size: the same parameters as
            // n_shared_experts experts of moe_intermediate_size.
            shared_expert_ffn_hidden: moe_ffn_hidden,
            shared_expert_gate: false,
            capacity_factor: None,
            router_aux_loss_coef: self.weight("aux_loss_alpha", 0.001)?,
            router_scoring: RouterScoring::Sigmoid,
            router_score_bias: true,
            // bool | None = True: null is None, which the router reads as false.
            normalize_top_k: match self.v.get("norm_topk_prob") {
                Some(Value::Null) => false,
                _ => self.boolean("norm_topk_prob", true)?,
            },
            routed_scaling_factor: self.number("routed_scaling_factor", 2.5)?,
            expert_groups,
            expert_groups_per_token: self.int(&["topk_group"], false, true)?.unwrap_or(4),
        };
        let (rope_theta, rope_scaling) = self.rope()?;
        Ok(Architecture {
            layers: self.count(&["num_hidden_layers"])?,
            hidden,
            heads,
            kv_heads,
            head_dim: mla.qk_nope_head_dim.saturating_add(mla.qk_rope_head_dim),
            ffn_hidden,
            vocab: self.count(&["vocab_size"])?,
            activation: Activation::Swiglu,
            norm: Norm::Rmsnorm,
            position: Position::Rope,
            tied_embeddings: self.boolean("tie_word_embeddings", false)?,
            bias: false,
            qkv_bias: false,
            max_positions: 0,
            vocab_divisible_by: crate::spec::DEFAULT_VOCAB_DIVISIBLE_BY,
            rope_theta,
            rope_scaling,
            norm_eps: self.number("rms_norm_eps", 1e-6)?,
            sliding_window: None,
            moe: Some(moe),
            mla: Some(mla),
            qk_norm: false,
        })
    }
}
