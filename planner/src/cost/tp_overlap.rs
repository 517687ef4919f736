//! Tensor-parallel collectives overlapped with their GEMMs (`training.tp_comm_overlap`):
//! Megatron-Core's `--tp-comm-overlap` (Transformer Engine's userbuffers) and torchtitan's async
//! TP (Inductor's micro-pipeline TP pass).
//!
//! Under sequence parallelism a layer's pass runs two all-gathers and two reduce-scatters of the
//! layer's activations (`layer_times`). Overlapped, each collective is cut into TP steps, one per
//! rank's 1/TP of the tokens, and each step's transfer runs while the GEMM works on the chunk in
//! hand (Wang et al. 2023, "Overlap communication with dependent computation via decomposition",
//! ASPLOS; TE's `ring_exchange` method):
//! - attention's all-gather feeds the column-parallel input projections (QKV; MLA's query and
//!   key-value up projections), its reduce-scatter follows the output projection;
//! - the MLP's all-gather feeds its input linears (fc1, or gate and up), its reduce-scatter
//!   follows its output linear (fc2, down);
//! - in the backward the same collectives (transposed) pair with the same linears' backward
//!   GEMMs, input and weight gradients.
//!
//! A collective of `c` seconds beside GEMMs of `g` seconds leaves `max(c − g, c / TP)` exposed:
//! what the GEMMs are too short to cover, and at least one step of the ring, a floor this model
//! sets for all four (a reduce-scatter's last partial sum can only leave after the last GEMM; an
//! all-gather's is taken to cost the same). The GEMMs run as TP pieces of
//! 1/TP of the tokens each: `TP · gemm(m / TP)` instead of `gemm(m)`, the pieces' wave
//! quantisation and launches charged as compute. The overlap's SMs (TE's bulk method takes a few
//! for its copies; the ring exchange and symmetric memory move data with the copy engines) are
//! not charged. Without sequence parallelism (all-reduces) and in MoE layers nothing is
//! overlapped: Megatron requires sequence parallelism for it, and its MoE layers' collectives are
//! the token dispatcher's.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::device::{Device, LinearShape};
use crate::layout::Layout;
use crate::model::Model;
use crate::spec::Cluster;

/// Whether a layout has collectives the overlap can hide: TP > 1 with sequence parallelism
/// (all-gathers and reduce-scatters; the all-reduces of TP without SP are not overlapped).
pub fn applies(layout: &Layout) -> bool {
    layout.tp > 1 && layout.sequence_parallel
}

/// A spec that asks for the overlap under a framework profile that has none is refused, naming
/// the profiles that have it.
pub fn check(
    model: &Model,
    cluster: &Cluster,
    model_file: &std::path::Path,
) -> Result<(), crate::Diagnostic> {
    if !model.training.tp_comm_overlap {
        return Ok(());
    }
    let profile = crate::framework::of(model, cluster);
    if profile.can_run.tp_comm_overlap {
        return Ok(());
    }
    let have: Vec<&str> = crate::framework::names()
        .into_iter()
        .filter(|n| crate::framework::by_name(n).is_some_and(|f| f.can_run.tp_comm_overlap))
        .collect();
    Err(crate::Diagnostic::new(
        model_file,
        "training.tp_comm_overlap",
        format!(
            "tp_comm_overlap = true, but the framework profile {} does not overlap TP collectives with GEMMs",
            profile.name
        ),
        format!(
            "set tp_comm_overlap = false, or plan for a framework that does: {}",
            have.join(" | ")
        ),
    ))
}

/// What overlapping the TP collectives changes for a layout (plan.json's
/// `predicted.tp_overlap`): the step with and without, the job's own being the one it states.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TpOverlapChange {
    /// The job states `training.tp_comm_overlap = true`.
    pub stated: bool,
    pub step_time_s_overlapped: f64,
    pub step_time_s_sequential: f64,
}

/// What the overlap changes for `layout`, where it can apply: TP > 1 with sequence
/// parallelism, under a framework profile that overlaps. `own` is the job's own step seconds,
/// `evaluate` gives them for the same job with the setting flipped.
pub fn change(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    own: f64,
    evaluate: &dyn Fn(&Model) -> f64,
) -> Option<TpOverlapChange> {
    if !applies(layout) || !crate::framework::of(model, cluster).can_run.tp_comm_overlap {
        return None;
    }
    let stated = model.training.tp_comm_overlap;
    let mut other = model.clone();
    other.training.tp_comm_overlap = !stated;
    let theirs = evaluate(&other);
    let (overlapped, sequential) = if stated { (own, theirs) } else { (theirs, own) };
    Some(TpOverlapChange {
        stated,
        step_time_s_overlapped: overlapped,
        step_time_s_sequential: sequential,
    })
}

/// The lines `plan` and `explain` print for a [`TpOverlapChange`].
pub fn lines(c: &TpOverlapChange) -> Vec<String> {
    let head = if c.stated {
        "TP communication overlap (training.tp_comm_overlap), for this layout:"
    } else {
        "TP communication overlap would change, for this layout (--tp-comm-overlap states it; Megatron-Core's --tp-comm-overlap, torchtitan's async TP):"
    };
    vec![
        head.to_string(),
        format!(
            "  step {:.3} s with the collectives overlapped, {:.3} s without ({:+.1}%)",
            c.step_time_s_overlapped,
            c.step_time_s_sequential,
            100.0 * (c.step_time_s_overlapped / c.step_time_s_sequential - 1.0),
        ),
    ]
}

/// One layer's TP time under the overlap, per pass: the collectives' exposed seconds and what
/// splitting the GEMMs adds to compute.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overlapped {
    pub fwd_exposed: f64,
    pub bwd_exposed: f64,
    pub fwd_split: f64,
    pub bwd_split: f64,
}

/// Which collective a linear sits beside: the all-gather before it, the reduce-scatter after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// Attention's input projections (after attention's all-gather).
    AttentionIn,
    /// Attention's output projection (before attention's reduce-scatter).
    AttentionOut,
    MlpIn,
    MlpOut,
}

impl Side {
    /// In the order of their index (`Side as usize`).
    const ALL: [Side; 4] = [
        Side::AttentionIn,
        Side::AttentionOut,
        Side::MlpIn,
        Side::MlpOut,
    ];
}

fn side(name: &str) -> Option<Side> {
    match name {
        "qkv" | "q_proj" | "q_up" | "kv_up" => Some(Side::AttentionIn),
        "proj" => Some(Side::AttentionOut),
        "fc1" | "gate_up" => Some(Side::MlpIn),
        "fc2" | "down" => Some(Side::MlpOut),
        // MLA's down projections are replicated and run on the rank's own tokens before the
        // gather: nothing to overlap.
        _ => None,
    }
}

/// Seconds of a collective of `c` seconds left exposed beside GEMMs of `g` seconds, cut into
/// `tp` steps (module docs).
pub fn exposed(c: f64, g: f64, tp: f64) -> f64 {
    (c - g).max(c / tp.max(1.0)).max(0.0)
}

/// One layer's overlapped TP time: `linears` are the layer's linear layers on one TP rank
/// (`ops::block_linears`), `all_gather` and `reduce_scatter` one collective's seconds.
pub fn layer(
    dev: &Device,
    linears: &[LinearShape],
    tp: u64,
    all_gather: f64,
    reduce_scatter: f64,
) -> Overlapped {
    let t = tp.max(1) as f64;
    let mut gemm = [(0.0, 0.0); 4];
    let (mut fwd_split, mut bwd_split) = (0.0, 0.0);
    for l in linears {
        let Some(s) = side(l.name) else { continue };
        // The GEMMs hide the transfer and are split; an FP8 linear's casts run whole beside
        // them (TE and torchao cast the weight once, the input before the exchange).
        let (f, b) = dev.block_gemms(l);
        let piece = LinearShape { m: l.m / t, ..*l };
        let (pf, pb) = dev.block_gemms(&piece);
        let i = s as usize;
        gemm[i].0 += f * l.count;
        gemm[i].1 += b * l.count;
        fwd_split += (t * pf - f).max(0.0) * l.count;
        bwd_split += (t * pb - b).max(0.0) * l.count;
    }
    let (mut fwd_exposed, mut bwd_exposed) = (0.0, 0.0);
    for (s, (gf, gb)) in Side::ALL.into_iter().zip(gemm) {
        let c = match s {
            Side::AttentionIn | Side::MlpIn => all_gather,
            Side::AttentionOut | Side::MlpOut => reduce_scatter,
        };
        fwd_exposed += exposed(c, gf, t);
        bwd_exposed += exposed(c, gb, t);
    }
    Overlapped {
        fwd_exposed,
        bwd_exposed,
        fwd_split,
        bwd_split,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Worked figures: a 4-way ring step is a quarter of the collective. 2 ms of all-gather
    /// beside 5 ms of GEMM: 0.5 ms exposed (one step). Beside 1.2 ms of GEMM: 0.8 ms (the GEMM
    /// covers 1.2 of the 2 ms, more than the three steps it can hide). Beside no GEMM: all 2 ms.
    #[test]
    fn a_collective_hides_behind_its_gemm_but_one_step() {
        let close = |a: f64, b: f64| assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        close(exposed(2e-3, 5e-3, 4.0), 0.5e-3);
        close(exposed(2e-3, 1.2e-3, 4.0), 0.8e-3);
        close(exposed(2e-3, 0.0, 4.0), 2e-3);
        // TP 1 has no ring: the whole collective (there is none in practice).
        close(exposed(2e-3, 5e-3, 1.0), 2e-3);
    }
}
