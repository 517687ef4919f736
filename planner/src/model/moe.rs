//! Mixture-of-experts MLPs and Multi-head Latent Attention: the resolved settings and their
//! exact parameter counts.
//!
//! Both are read (TOML specs and Hugging Face configs), counted and planned: the memory model
//! holds each rank's E/EP experts and shards their states over the expert-data-parallel group
//! (`memory::moe`), the cost model times the router, the experts and the all-to-all
//! (`cost::moe`), and MLA's projections and head sizes (`memory::activations`, `cost::ops`).
//! The counts follow transformers' classes tensor by tensor (Mixtral, Qwen2-MoE, Qwen3-MoE,
//! DeepSeek-V3), checked by scripts/check_moe_counts.py.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Activation, Architecture, LayerParams, Norm};

/// How the router turns its logits into the scores the top-k is chosen by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RouterScoring {
    /// A softmax over all experts (Mixtral, Qwen-MoE, Switch, GShard).
    #[default]
    Softmax,
    /// A sigmoid per expert (DeepSeek-V3).
    Sigmoid,
}

/// Mixture-of-experts MLPs (spec keys `experts`, `experts_per_token`, …, specs/README.md). The
/// MoE layers replace the dense MLP by `experts` routed experts, `experts_per_token` of which
/// each token goes through, plus `shared_experts` every token goes through; the other layers
/// keep the dense MLP of `ffn_hidden`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Moe {
    /// Routed experts per MoE layer (≥ 2).
    pub experts: u64,
    /// Routed experts per token: the router's top-k (1 ..= `experts`).
    pub experts_per_token: u64,
    /// Each routed expert's FFN width (spec default: `ffn_hidden`).
    pub moe_ffn_hidden: u64,
    /// Layers `0 .. first_dense_layers` keep the dense MLP (DeepSeek's `first_k_dense_replace`).
    pub first_dense_layers: u64,
    /// From layer `first_dense_layers` on, every this many layers is an MoE layer: layers K,
    /// K + N, K + 2N, … with K = `first_dense_layers`, N = this (default 1: every layer).
    pub moe_layer_frequency: u64,
    /// The MoE layers listed (0-based, ascending); replaces the two keys above.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_layers: Option<Vec<u64>>,
    /// Experts every token goes through, besides the routed ones (default 0).
    pub shared_experts: u64,
    /// Each shared expert's FFN width (spec default: `moe_ffn_hidden`).
    pub shared_expert_ffn_hidden: u64,
    /// A sigmoid gate (`hidden → 1`) scales the shared experts' output (Qwen2-MoE).
    pub shared_expert_gate: bool,
    /// Tokens an expert takes per batch, as a multiple of its even share (`tokens × top-k /
    /// experts`); beyond it tokens are dropped. `None`: dropless.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_factor: Option<f64>,
    /// The weight of the load-balancing auxiliary loss in the training loss.
    pub router_aux_loss_coef: f64,
    /// Softmax or sigmoid scores.
    pub router_scoring: RouterScoring,
    /// A per-expert bias added to the scores only to choose the top-k, adjusted outside the
    /// gradient (DeepSeek-V3's auxiliary-loss-free balancing, `e_score_correction_bias`):
    /// `experts` more numbers per MoE layer.
    pub router_score_bias: bool,
    /// The chosen experts' weights are divided by their sum (Mixtral always; HF `norm_topk_prob`).
    pub normalize_top_k: bool,
    /// The routed experts' weighted sum is multiplied by this (DeepSeek-V3: 2.5).
    pub routed_scaling_factor: f64,
    /// The experts form this many groups of equal size (DeepSeek-V3: 8, one per node) …
    pub expert_groups: u64,
    /// … and each token's top-k is chosen among the experts of this many groups (DeepSeek-V3:
    /// 4, its node limit). Equal to `expert_groups`: no limit.
    pub expert_groups_per_token: u64,
}

/// Multi-head Latent Attention (DeepSeek-V2/V3; spec table `[architecture.mla]`): queries,
/// keys and values are projected down to low-rank latents and back up per head. Query and key
/// heads are `qk_nope_head_dim + qk_rope_head_dim` wide (`head_dim`), value heads
/// `v_head_dim`; the RoPE part of the key is one head shared by all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Mla {
    /// Rank of the query latent; `None`: the queries are projected directly (DeepSeek-V2-Lite).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub q_lora_rank: Option<u64>,
    /// Rank of the key-value latent.
    pub kv_lora_rank: u64,
    /// Per-head query/key channels without RoPE.
    pub qk_nope_head_dim: u64,
    /// Per-head query/key channels with RoPE.
    pub qk_rope_head_dim: u64,
    /// Per-head value channels.
    pub v_head_dim: u64,
}

/// The parameters of one MoE layer: what every token touches, and one routed expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeLayerParams {
    /// Attention, the two norms, the router (and its score bias), the shared experts and their
    /// gate. Shared experts are TP-sharded like a dense MLP; the router is replicated.
    pub common: LayerParams,
    /// One routed expert's MLP.
    pub expert: LayerParams,
    /// Routed experts in the layer.
    pub experts: u64,
}

impl MoeLayerParams {
    /// Every parameter of the layer (saturating at `u64::MAX`).
    pub fn total(&self) -> u64 {
        self.common
            .total()
            .saturating_add(self.experts.saturating_mul(self.expert.total()))
    }
    /// The parameters one token goes through: the common part and `top_k` routed experts.
    pub fn active(&self, top_k: u64) -> u64 {
        self.common
            .total()
            .saturating_add(top_k.min(self.experts).saturating_mul(self.expert.total()))
    }
}

impl Moe {
    /// Whether layer `layer` (0-based) is an MoE layer.
    pub fn is_moe_layer(&self, layer: u64) -> bool {
        match &self.moe_layers {
            Some(list) => list.contains(&layer),
            None => {
                layer >= self.first_dense_layers
                    && (layer - self.first_dense_layers)
                        .is_multiple_of(self.moe_layer_frequency.max(1))
            }
        }
    }

    /// How many of `layers` layers are MoE layers.
    pub fn moe_layer_count(&self, layers: u64) -> u64 {
        match &self.moe_layers {
            Some(list) => list.iter().filter(|l| **l < layers).count() as u64,
            None if layers <= self.first_dense_layers => 0,
            None => (layers - self.first_dense_layers - 1) / self.moe_layer_frequency.max(1) + 1,
        }
    }
}

fn sum(parts: &[LayerParams]) -> LayerParams {
    parts
        .iter()
        .fold(LayerParams::default(), |a, p| LayerParams {
            sharded: a.sharded.saturating_add(p.sharded),
            replicated: a.replicated.saturating_add(p.replicated),
        })
}

impl Architecture {
    /// Parameters of one norm over `width` channels.
    pub(super) fn norm_of(&self, width: u64) -> u64 {
        match self.norm {
            Norm::Layernorm => width.saturating_mul(2),
            Norm::Rmsnorm => width,
        }
    }

    /// One MLP of width `f` (a dense MLP, a routed or a shared expert), biases included.
    pub fn mlp_params(&self, f: u64) -> LayerParams {
        let h = self.hidden;
        let (matrices, column_biases) = match self.activation {
            Activation::Gelu => (2, 1),
            Activation::Swiglu => (3, 2),
        };
        let mut p = LayerParams {
            sharded: h.saturating_mul(f).saturating_mul(matrices),
            replicated: 0,
        };
        if self.bias {
            p.sharded = p.sharded.saturating_add(f.saturating_mul(column_biases));
            p.replicated = h; // the row-parallel output bias
        }
        p
    }

    /// The attention block's weights (without the layer's two norms): Q, K, V and the output
    /// projection with their biases, the per-head query and key norms (`qk_norm`), or MLA's
    /// projections and latent norms. MLA's down-projections and their norms are replicated over
    /// TP, as Megatron-Core builds them (`linear_q_down_proj`, `linear_kv_down_proj`).
    pub fn attention_params(&self) -> LayerParams {
        let h = self.hidden;
        let mut p = match &self.mla {
            Some(m) => {
                let heads = self.heads;
                let qk = m.qk_nope_head_dim.saturating_add(m.qk_rope_head_dim);
                let q_up = heads.saturating_mul(qk);
                let (q_sharded, q_replicated) = match m.q_lora_rank {
                    None => (h.saturating_mul(q_up), 0),
                    Some(r) => (
                        r.saturating_mul(q_up),
                        h.saturating_mul(r).saturating_add(self.norm_of(r)),
                    ),
                };
                let kv_down = h
                    .saturating_mul(m.kv_lora_rank.saturating_add(m.qk_rope_head_dim))
                    .saturating_add(self.norm_of(m.kv_lora_rank));
                let kv_up = m.kv_lora_rank.saturating_mul(
                    heads.saturating_mul(m.qk_nope_head_dim.saturating_add(m.v_head_dim)),
                );
                let out = heads.saturating_mul(m.v_head_dim).saturating_mul(h);
                LayerParams {
                    sharded: q_sharded.saturating_add(kv_up).saturating_add(out),
                    replicated: q_replicated.saturating_add(kv_down),
                }
            }
            None => {
                let qkv_out = self.q_dim().saturating_add(self.kv_dim().saturating_mul(2));
                let mut p = LayerParams {
                    sharded: h
                        .saturating_mul(qkv_out)
                        .saturating_add(self.q_dim().saturating_mul(h)),
                    replicated: 0,
                };
                if self.bias || self.qkv_bias {
                    p.sharded = p.sharded.saturating_add(qkv_out);
                }
                if self.bias {
                    p.replicated = h; // attention output (row-parallel) bias
                }
                p
            }
        };
        if self.qk_norm {
            p.replicated = p
                .replicated
                .saturating_add(self.norm_of(self.head_dim).saturating_mul(2));
        }
        p
    }

    /// One MoE layer, `None` for a dense model.
    pub fn moe_layer_params(&self) -> Option<MoeLayerParams> {
        let m = self.moe.as_ref()?;
        let h = self.hidden;
        let norms = LayerParams {
            sharded: 0,
            replicated: self.norm_of(h).saturating_mul(2),
        };
        let mut router = m.experts.saturating_mul(h);
        if m.router_score_bias {
            router = router.saturating_add(m.experts);
        }
        if m.shared_expert_gate && m.shared_experts > 0 {
            router = router.saturating_add(h);
        }
        let shared = self.mlp_params(m.shared_expert_ffn_hidden);
        let shared = LayerParams {
            sharded: shared.sharded.saturating_mul(m.shared_experts),
            replicated: shared.replicated.saturating_mul(m.shared_experts),
        };
        let router = LayerParams {
            sharded: 0,
            replicated: router,
        };
        Some(MoeLayerParams {
            common: sum(&[self.attention_params(), norms, router, shared]),
            expert: self.mlp_params(m.moe_ffn_hidden),
            experts: m.experts,
        })
    }

    /// MoE layers among the `layers` (0 for a dense model).
    pub fn moe_layer_count(&self) -> u64 {
        self.moe
            .as_ref()
            .map_or(0, |m| m.moe_layer_count(self.layers).min(self.layers))
    }

    /// Parameters one token goes through: every dense part (embedding and output layer
    /// included, as Mixtral's 12.9B and DeepSeek-V3's 37B count them), and in each MoE layer its
    /// common part and `experts_per_token` routed experts. Equal to `param_count` for a dense
    /// model. Saturates at `u64::MAX`.
    pub fn active_param_count(&self) -> u64 {
        let Some((m, moe)) = self.moe.as_ref().zip(self.moe_layer_params()) else {
            return self.param_count();
        };
        let routed = moe.total().saturating_sub(moe.active(m.experts_per_token));
        let idle = self.moe_layer_count().saturating_mul(routed);
        if self.param_count() == u64::MAX {
            return u64::MAX;
        }
        self.param_count().saturating_sub(idle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(experts: u64) -> Moe {
        Moe {
            experts,
            experts_per_token: 2,
            moe_ffn_hidden: 32,
            first_dense_layers: 0,
            moe_layer_frequency: 1,
            moe_layers: None,
            shared_experts: 0,
            shared_expert_ffn_hidden: 32,
            shared_expert_gate: false,
            capacity_factor: None,
            router_aux_loss_coef: 0.01,
            router_scoring: RouterScoring::Softmax,
            router_score_bias: false,
            normalize_top_k: true,
            routed_scaling_factor: 1.0,
            expert_groups: 1,
            expert_groups_per_token: 1,
        }
    }

    #[test]
    fn moe_layer_patterns_count_what_they_list() {
        let mut m = moe(4);
        m.first_dense_layers = 3;
        m.moe_layer_frequency = 2;
        let listed: Vec<u64> = (0..12).filter(|l| m.is_moe_layer(*l)).collect();
        assert_eq!(listed, [3, 5, 7, 9, 11]);
        for layers in 0..12 {
            let n = (0..layers).filter(|l| m.is_moe_layer(*l)).count() as u64;
            assert_eq!(m.moe_layer_count(layers), n, "{layers} layers");
        }
        m.moe_layers = Some(vec![0, 4]);
        assert!(m.is_moe_layer(4) && !m.is_moe_layer(3));
        assert_eq!(m.moe_layer_count(4), 1);
        // Huge counts are arithmetic, never enumerated.
        m.moe_layers = None;
        assert_eq!(m.moe_layer_count(u64::MAX), (u64::MAX - 4) / 2 + 1);
    }

    #[test]
    fn moe_counts_saturate_instead_of_wrapping() {
        let mut a = crate::model::tests::tiny();
        a.moe = Some(moe(u64::MAX / 2));
        assert_eq!(a.param_count(), u64::MAX);
        assert_eq!(a.active_param_count(), u64::MAX);
        assert_eq!(a.checked_param_count(), None);
    }
}
