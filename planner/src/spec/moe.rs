//! Mixture-of-experts and MLA keys of a TOML model spec, and the rules every resolved MoE or MLA
//! model obeys.
//!
//! The keys sit under `[architecture]` (`experts`, `experts_per_token`, `moe_ffn_hidden`, …)
//! and in the `[architecture.mla]` table; specs/README.md documents each with its source. They
//! are read, counted exactly and planned ([`Model::plannable`] refuses none of them).

use serde::Deserialize;

use super::check::Problem;
use super::fields::{Field, Fields};
use super::model::RawArchitecture;
use crate::error::Diagnostic;
use crate::model::{Architecture, Mla, Model, Moe, Position, RouterScoring};

/// The Switch Transformer's load-balancing loss weight, α = 10⁻² (Fedus et al. 2021, §2.2),
/// the default of `router_aux_loss_coef`.
pub const DEFAULT_ROUTER_AUX_LOSS_COEF: f64 = 0.01;

/// `[architecture.mla]`: DeepSeek-V2/V3's Multi-head Latent Attention, with HF's key names.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawMla {
    pub q_lora_rank: Field<i64>,
    pub kv_lora_rank: Field<i64>,
    pub qk_nope_head_dim: Field<i64>,
    pub qk_rope_head_dim: Field<i64>,
    pub v_head_dim: Field<i64>,
}

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

fn problem(field: &str, problem: String, fix: String) -> Problem {
    Problem::new(&format!("architecture.{field}"), problem, fix)
}

/// A positive count: a resolved model read from plan.json skips the parsers.
fn count(field: &str, v: u64) -> Result<(), Problem> {
    if v == 0 || v > i64::MAX as u64 {
        return Err(problem(
            field,
            format!("must be a positive integer, found {v}"),
            format!("set `{field}` to a value of at least 1"),
        ));
    }
    Ok(())
}

fn number(field: &str, v: f64, zero_ok: bool) -> Result<(), Problem> {
    if !v.is_finite() || v < 0.0 || (!zero_ok && v == 0.0) {
        let want = if zero_ok { "zero or more" } else { "positive" };
        return Err(problem(
            field,
            format!("must be a {want} number, found {v}"),
            format!("set `{field}` to a {want} number"),
        ));
    }
    Ok(())
}

/// The rules of the MoE keys, the MLA table and `qk_norm` on a resolved architecture, wherever
/// it was read from (the TOML spec, a Hugging Face config, plan.json's `job.model`).
pub(crate) fn check_architecture(a: &Architecture) -> Result<(), Problem> {
    if let Some(m) = &a.mla {
        check_mla(a, m)?;
    }
    let Some(m) = &a.moe else {
        return Ok(());
    };
    if m.experts < 2 {
        return Err(problem(
            "experts",
            format!(
                "a mixture of experts needs at least 2 routed experts, found {}",
                m.experts
            ),
            "set `experts` to 2 or more, or remove the MoE keys for a dense model".into(),
        ));
    }
    for (field, v) in [
        ("experts", m.experts),
        ("experts_per_token", m.experts_per_token),
        ("moe_ffn_hidden", m.moe_ffn_hidden),
        ("moe_layer_frequency", m.moe_layer_frequency),
        ("shared_expert_ffn_hidden", m.shared_expert_ffn_hidden),
        ("expert_groups", m.expert_groups),
        ("expert_groups_per_token", m.expert_groups_per_token),
    ] {
        count(field, v)?;
    }
    let (e, k) = (m.experts, m.experts_per_token);
    if k > e {
        return Err(problem(
            "experts_per_token",
            format!("experts_per_token ({k}) is more than experts ({e}): a token cannot be routed to more experts than the layer has"),
            format!("set experts_per_token to at most {e} (Mixtral routes to 2 of 8)"),
        ));
    }
    check_layers(a, m)?;
    if m.shared_expert_gate && m.shared_experts == 0 {
        return Err(problem(
            "shared_expert_gate",
            "shared_expert_gate gates the shared experts, but the model has none".into(),
            "add `shared_experts = N`, or remove `shared_expert_gate`".into(),
        ));
    }
    let g = m.expert_groups;
    if !e.is_multiple_of(g) {
        return Err(problem(
            "expert_groups",
            format!("{e} experts do not split into {g} groups of equal size"),
            format!(
                "set expert_groups to a divisor of {e}: {}",
                crate::search::divisors::listed(e)
            ),
        ));
    }
    let per_token = m.expert_groups_per_token;
    if per_token > g {
        return Err(problem(
            "expert_groups_per_token",
            format!("expert_groups_per_token ({per_token}) is more than expert_groups ({g})"),
            format!("set expert_groups_per_token to at most {g} ({g}: no group limit)"),
        ));
    }
    let reachable = per_token.saturating_mul(e / g);
    if k > reachable {
        return Err(problem(
            "experts_per_token",
            format!("each token's {k} experts are chosen within {per_token} of {g} groups of {} experts: only {reachable} can be chosen", e / g),
            format!("raise expert_groups_per_token (or lower experts_per_token to at most {reachable})"),
        ));
    }
    if let Some(c) = m.capacity_factor {
        number("capacity_factor", c, false)?;
    }
    number("router_aux_loss_coef", m.router_aux_loss_coef, true)?;
    number("routed_scaling_factor", m.routed_scaling_factor, false)?;
    Ok(())
}

/// Which layers are MoE layers: a list within the model, or a pattern that leaves some.
fn check_layers(a: &Architecture, m: &Moe) -> Result<(), Problem> {
    let layers = a.layers;
    let Some(list) = &m.moe_layers else {
        if m.first_dense_layers >= layers {
            return Err(problem(
                "first_dense_layers",
                format!("first_dense_layers ({}) leaves no MoE layer among the {layers} layers", m.first_dense_layers),
                format!("set first_dense_layers below {layers}, or remove the MoE keys for a dense model"),
            ));
        }
        return Ok(());
    };
    if m.first_dense_layers != 0 || m.moe_layer_frequency != 1 {
        return Err(problem(
            "moe_layers",
            "moe_layers lists the MoE layers, and first_dense_layers or moe_layer_frequency says otherwise".into(),
            "keep the list or the pattern, not both".into(),
        ));
    }
    if list.is_empty() {
        return Err(problem(
            "moe_layers",
            "moe_layers is empty: the model would have no MoE layer".into(),
            "list the 0-based indices of the MoE layers, or remove the MoE keys for a dense model"
                .into(),
        ));
    }
    if let Some(bad) = list.iter().find(|l| **l >= layers) {
        return Err(problem(
            "moe_layers",
            format!(
                "moe_layers lists layer {bad}, but the model's layers are 0 … {}",
                layers - 1
            ),
            format!("list 0-based layer indices below {layers}"),
        ));
    }
    if let Some(w) = list.windows(2).find(|w| w[0] >= w[1]) {
        return Err(problem(
            "moe_layers",
            format!(
                "moe_layers lists {} before {}: the list must be ascending, each layer once",
                w[0], w[1]
            ),
            "list each MoE layer once, in ascending order".into(),
        ));
    }
    Ok(())
}

fn check_mla(a: &Architecture, m: &Mla) -> Result<(), Problem> {
    let f = |k: &str| format!("mla.{k}");
    for (field, v) in [
        ("kv_lora_rank", m.kv_lora_rank),
        ("qk_nope_head_dim", m.qk_nope_head_dim),
        ("qk_rope_head_dim", m.qk_rope_head_dim),
        ("v_head_dim", m.v_head_dim),
    ]
    .into_iter()
    .chain(m.q_lora_rank.map(|r| ("q_lora_rank", r)))
    {
        count(&f(field), v)?;
    }
    if a.position != Position::Rope {
        return Err(problem(
            &f("qk_rope_head_dim"),
            "MLA carries positions in its qk_rope_head_dim channels by RoPE, but position is \"learned\"".into(),
            "set position = \"rope\"".into(),
        ));
    }
    if !m.qk_rope_head_dim.is_multiple_of(2) {
        return Err(problem(
            &f("qk_rope_head_dim"),
            format!(
                "RoPE rotates pairs of channels, and qk_rope_head_dim {} is odd",
                m.qk_rope_head_dim
            ),
            "use an even qk_rope_head_dim (DeepSeek-V3: 64)".into(),
        ));
    }
    let qk = m.qk_nope_head_dim.saturating_add(m.qk_rope_head_dim);
    if a.head_dim != qk {
        return Err(problem(
            "head_dim",
            format!("with MLA a query/key head is qk_nope_head_dim + qk_rope_head_dim = {qk} channels, but head_dim is {}", a.head_dim),
            format!("remove head_dim (it follows from the [architecture.mla] table) or set it to {qk}"),
        ));
    }
    if a.kv_heads != a.heads {
        return Err(problem(
            "kv_heads",
            format!(
                "MLA projects keys and values up per head ({} heads), but kv_heads is {}",
                a.heads, a.kv_heads
            ),
            format!("remove kv_heads, or set it to {}", a.heads),
        ));
    }
    if a.bias || a.qkv_bias {
        return Err(problem(
            "bias",
            "biases on MLA's projections are not modelled (DeepSeek-V3 has none)".into(),
            "set bias = false and qkv_bias = false".into(),
        ));
    }
    Ok(())
}

impl Model {
    /// Whether a plan can be made of the model. Every command that plans or runs calls it
    /// (`spec::load_model`, `Plan::load`); `spec::read_model` does not. MoE models are planned
    /// (expert parallelism), and so are Multi-head Latent Attention and per-head query/key
    /// norms: the memory model keeps their tensors (`memory::activations::layer_tensors`) and
    /// the cost model times their projections, norms and attention core (`cost::ops::layer_cp`).
    /// No architecture the spec rules accept is refused here now; the runtime refuses, when
    /// it loads the plan, what it does not compute.
    pub fn plannable(&self) -> Result<(), Problem> {
        Ok(())
    }
}
