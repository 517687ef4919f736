//! Mixture-of-experts and MLA keys of a TOML model spec (the rules every resolved MoE or MLA
//! model obeys are `moe_check`'s).
//!
//! The keys sit under `[architecture]` (`experts`, `experts_per_token`, `moe_ffn_hidden`, …)
//! and in the `[architecture.mla]` table; specs/README.md documents each with its source. They
//! are read, counted exactly and planned ([`crate::model::Model::plannable`] refuses none of them).

use super::fields::{Field, Fields};
use super::raw_arch::RawArchitecture;
use crate::error::Diagnostic;
use crate::model::{Mla, Moe, RouterScoring};

/// The Switch Transformer's load-balancing loss weight, α = 10⁻² (Fedus et al. 2021, §2.2),
/// the default of `router_aux_loss_coef`.
pub const DEFAULT_ROUTER_AUX_LOSS_COEF: f64 = 0.01;

const T: &str = "architecture";

/// `[architecture.mla]`, resolved; `None` without the table.
pub(crate) fn resolve_mla(f: &Fields, a: &RawArchitecture) -> Result<Option<Mla>, Diagnostic> {
    let Some(s) = &a.mla else {
        return Ok(None);
    };
    const M: &str = "architecture.mla";
    let m = s.get_ref();
    Ok(Some(Mla {
        q_lora_rank: f.opt_pos_int(M, "q_lora_rank", &m.q_lora_rank)?,
        kv_lora_rank: f.pos_int(M, "kv_lora_rank", &m.kv_lora_rank, "512")?,
        qk_nope_head_dim: f.pos_int(M, "qk_nope_head_dim", &m.qk_nope_head_dim, "128")?,
        qk_rope_head_dim: f.pos_int(M, "qk_rope_head_dim", &m.qk_rope_head_dim, "64")?,
        v_head_dim: f.pos_int(M, "v_head_dim", &m.v_head_dim, "128")?,
    }))
}

/// The MoE keys present in the file other than `experts`, with their spans.
fn moe_keys(a: &RawArchitecture) -> Vec<(&'static str, Option<std::ops::Range<usize>>)> {
    fn at<T>(v: &Field<T>) -> Option<Option<std::ops::Range<usize>>> {
        v.as_ref().map(|s| Some(s.span()))
    }
    [
        ("experts_per_token", at(&a.experts_per_token)),
        ("moe_ffn_hidden", at(&a.moe_ffn_hidden)),
        ("first_dense_layers", at(&a.first_dense_layers)),
        ("moe_layer_frequency", at(&a.moe_layer_frequency)),
        ("moe_layers", at(&a.moe_layers)),
        ("shared_experts", at(&a.shared_experts)),
        ("shared_expert_ffn_hidden", at(&a.shared_expert_ffn_hidden)),
        ("shared_expert_gate", at(&a.shared_expert_gate)),
        ("capacity_factor", at(&a.capacity_factor)),
        ("router_aux_loss_coef", at(&a.router_aux_loss_coef)),
        ("router_scoring", at(&a.router_scoring)),
        ("router_score_bias", at(&a.router_score_bias)),
        ("normalize_top_k", at(&a.normalize_top_k)),
        ("routed_scaling_factor", at(&a.routed_scaling_factor)),
        ("expert_groups", at(&a.expert_groups)),
        ("expert_groups_per_token", at(&a.expert_groups_per_token)),
    ]
    .into_iter()
    .filter_map(|(k, s)| s.map(|s| (k, s)))
    .collect()
}

/// The MoE keys under `[architecture]`, resolved; `None` for a dense model (`experts` absent
/// or 1). Each key is checked here with its span; the rules between keys are
/// [`check_architecture`]'s, which `Model::check` runs on every resolved model.
pub(crate) fn resolve_moe(
    f: &Fields,
    a: &RawArchitecture,
    ffn_hidden: u64,
) -> Result<Option<Moe>, Diagnostic> {
    let experts = f.opt_pos_int(T, "experts", &a.experts)?;
    let present = moe_keys(a);
    if experts.is_none_or(|e| e == 1) {
        let dense = match experts {
            None => "`experts` is absent",
            Some(_) => "experts = 1",
        };
        // experts_per_token = 1 beside a dense MLP says nothing new (specs written before MoE).
        let one = |k: &str| {
            k == "experts_per_token"
                && a.experts_per_token
                    .as_ref()
                    .is_some_and(|v| *v.get_ref() == 1)
        };
        if let Some((key, span)) = present.into_iter().find(|(k, _)| !one(k)) {
            return Err(f.err(
                span,
                &format!("architecture.{key}"),
                format!("`{key}` configures mixture-of-experts layers, but {dense}: the model is dense"),
                format!("add `experts = N` (N ≥ 2 routed experts per MoE layer) under [architecture], or remove `{key}`"),
            ));
        }
        return Ok(None);
    }
    let experts = experts.unwrap_or(2);
    let Some(top_k) = f.opt_pos_int(T, "experts_per_token", &a.experts_per_token)? else {
        return Err(Diagnostic::new(
            &f.src.path,
            "architecture.experts_per_token",
            format!("required key `experts_per_token` is missing: with {experts} experts, the router's top-k must be given"),
            "add `experts_per_token = 2` under [architecture] (Mixtral routes each token to 2 of 8 experts)",
        )
        .at(f.src.table_header(T)));
    };
    let moe_ffn_hidden = f
        .opt_pos_int(T, "moe_ffn_hidden", &a.moe_ffn_hidden)?
        .unwrap_or(ffn_hidden);
    let first_dense_layers = f
        .opt_nonneg_int(T, "first_dense_layers", &a.first_dense_layers)?
        .unwrap_or(0);
    let moe_layer_frequency = f
        .opt_pos_int(T, "moe_layer_frequency", &a.moe_layer_frequency)?
        .unwrap_or(1);
    let moe_layers = match &a.moe_layers {
        None => None,
        Some(list) => {
            let pattern = [
                ("first_dense_layers", &a.first_dense_layers),
                ("moe_layer_frequency", &a.moe_layer_frequency),
            ];
            if let Some((key, v)) = pattern.iter().find(|(_, v)| v.is_some()) {
                return Err(f.err(
                    v.as_ref().map(|s| s.span()),
                    &format!("architecture.{key}"),
                    format!("`{key}` and `moe_layers` both say which layers are MoE layers"),
                    format!("keep `moe_layers` (the list) or `{key}`, not both"),
                ));
            }
            let mut out = Vec::with_capacity(list.get_ref().len());
            for v in list.get_ref() {
                let value = *v.get_ref();
                if value < 0 {
                    return Err(f.err(
                        Some(v.span()),
                        "architecture.moe_layers",
                        format!("a layer index must be 0 or more, found {value}"),
                        "list 0-based layer indices (the first layer is 0)",
                    ));
                }
                out.push(value as u64);
            }
            Some(out)
        }
    };
    let shared_experts = f
        .opt_nonneg_int(T, "shared_experts", &a.shared_experts)?
        .unwrap_or(0);
    if shared_experts == 0 {
        let given = [
            (
                "shared_expert_ffn_hidden",
                a.shared_expert_ffn_hidden.as_ref().map(|s| s.span()),
            ),
            (
                "shared_expert_gate",
                a.shared_expert_gate.as_ref().map(|s| s.span()),
            ),
        ];
        if let Some((key, span)) = given.into_iter().find(|(_, s)| s.is_some()) {
            return Err(f.err(
                span,
                &format!("architecture.{key}"),
                format!("`{key}` describes shared experts, but the model has none (`shared_experts` is 0 or absent)"),
                format!("add `shared_experts = N`, or remove `{key}`"),
            ));
        }
    }
    let shared_expert_ffn_hidden = f
        .opt_pos_int(T, "shared_expert_ffn_hidden", &a.shared_expert_ffn_hidden)?
        .unwrap_or(moe_ffn_hidden);
    let expert_groups = f
        .opt_pos_int(T, "expert_groups", &a.expert_groups)?
        .unwrap_or(1);
    let expert_groups_per_token = f
        .opt_pos_int(T, "expert_groups_per_token", &a.expert_groups_per_token)?
        .unwrap_or(expert_groups);
    Ok(Some(Moe {
        experts,
        experts_per_token: top_k,
        moe_ffn_hidden,
        first_dense_layers,
        moe_layer_frequency,
        moe_layers,
        shared_experts,
        shared_expert_ffn_hidden,
        shared_expert_gate: f.opt_bool(&a.shared_expert_gate).unwrap_or(false),
        capacity_factor: f.opt_pos_num(T, "capacity_factor", &a.capacity_factor)?,
        router_aux_loss_coef: f
            .opt_nonneg_num(T, "router_aux_loss_coef", &a.router_aux_loss_coef)?
            .unwrap_or(DEFAULT_ROUTER_AUX_LOSS_COEF),
        router_scoring: f.choice(
            T,
            "router_scoring",
            &a.router_scoring,
            &[
                ("softmax", RouterScoring::Softmax),
                ("sigmoid", RouterScoring::Sigmoid),
            ],
            Some(RouterScoring::Softmax),
        )?,
        router_score_bias: f.opt_bool(&a.router_score_bias).unwrap_or(false),
        normalize_top_k: f.opt_bool(&a.normalize_top_k).unwrap_or(true),
        routed_scaling_factor: f
            .opt_pos_num(T, "routed_scaling_factor", &a.routed_scaling_factor)?
            .unwrap_or(1.0),
        expert_groups,
        expert_groups_per_token,
    }))
}
