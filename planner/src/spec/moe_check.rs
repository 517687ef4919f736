//! The rules every resolved MoE or MLA architecture obeys, wherever it was read from (the TOML
//! spec, a Hugging Face config, plan.json's `job.model`): the resolved side of `moe`'s keys.

use super::problem::Problem;
use crate::model::{Architecture, Mla, Model, Moe, Position};

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
