//! Why a layout lost to the chosen one, read off the difference of their step-time breakdowns.
//!
//! The term that grew most names the cause, and the knob that differs says why it grew
//! ("TP=16 crosses the node boundary: +38% tp_comm"). Nothing here predicts anything: the
//! breakdowns come from the cost model.

use super::{Candidate, NEAR_TIE};
use crate::layout::Layout;
use crate::model::Model;
use crate::spec::Cluster;

const TERMS: [&str; 6] = [
    "compute",
    "recompute",
    "tp_comm",
    "pipeline_bubble",
    "dp_exposed",
    "optimizer",
];

/// The knobs on which two layouts differ, as `name value` words of `alt`.
fn differences(best: &Layout, alt: &Layout) -> Vec<String> {
    let mut d = Vec::new();
    let mut cmp = |name: &str, a: String, b: String| {
        if a != b {
            d.push(format!("{name} {b} vs {a}"));
        }
    };
    cmp("PP", best.pp.to_string(), alt.pp.to_string());
    cmp("TP", best.tp.to_string(), alt.tp.to_string());
    cmp("DP", best.dp.to_string(), alt.dp.to_string());
    cmp(
        "micro-batch",
        best.micro_batch.to_string(),
        alt.micro_batch.to_string(),
    );
    cmp(
        "ZeRO",
        best.sharding.zero_stage.to_string(),
        alt.sharding.zero_stage.to_string(),
    );
    cmp(
        "hybrid",
        best.sharding.hybrid.to_string(),
        alt.sharding.hybrid.to_string(),
    );
    cmp(
        "recompute",
        best.recompute.name().into(),
        alt.recompute.name().into(),
    );
    cmp(
        "SP",
        best.sequence_parallel.to_string(),
        alt.sequence_parallel.to_string(),
    );
    cmp(
        "schedule",
        best.schedule.name().into(),
        alt.schedule.name().into(),
    );
    cmp(
        "chunks",
        best.virtual_stages.to_string(),
        alt.virtual_stages.to_string(),
    );
    d
}

/// The cause of a grown term, from the knobs.
fn cause(term: &str, best: &Layout, alt: &Layout, cluster: &Cluster, model: &Model) -> String {
    let gpn = cluster.gpus_per_node;
    match term {
        "tp_comm" if alt.tp > gpn && best.tp <= gpn => {
            format!("TP={} crosses the node boundary", alt.tp)
        }
        "tp_comm" if alt.tp > best.tp => format!("TP={} instead of {}", alt.tp, best.tp),
        "tp_comm" if alt.recompute != best.recompute => format!(
            "{} recompute repeats the forward's TP collectives",
            alt.recompute.name()
        ),
        "tp_comm" => "more tensor-parallel traffic on the busiest stage".into(),
        "pipeline_bubble" => format!(
            "PP={} with {} micro-batches{} idles longer",
            alt.pp,
            alt.microbatches(model),
            if alt.virtual_stages > 1 {
                format!(" and {} chunks per stage", alt.virtual_stages)
            } else {
                String::new()
            }
        ),
        "recompute" => format!(
            "{} recompute re-runs the forward in the backward",
            alt.recompute.name()
        ),
        "compute" if alt.tp > best.tp => format!(
            "TP={} shrinks the per-GPU matmuls, which run less efficiently",
            alt.tp
        ),
        "compute" if best.sequence_parallel && !alt.sequence_parallel => {
            "without sequence parallelism every TP rank runs the norms and residuals in full".into()
        }
        "compute" if alt.micro_batch < best.micro_batch => format!(
            "micro-batch {} makes smaller matmuls than {}",
            alt.micro_batch, best.micro_batch
        ),
        "compute" if alt.pp != best.pp || alt.dp != best.dp => format!(
            "DP={}·PP={} leaves more layers × micro-batches on the busiest stage",
            alt.dp, alt.pp
        ),
        "compute" => "more compute on the busiest stage".into(),
        "dp_exposed" if alt.sharding.zero_stage == 3 && best.sharding.zero_stage < 3 => {
            "ZeRO-3 gathers the weights for every micro-batch".into()
        }
        "dp_exposed" if alt.sharding.zero_stage > best.sharding.zero_stage => format!(
            "ZeRO-{} adds a parameter all-gather after the optimizer step",
            alt.sharding.zero_stage
        ),
        "dp_exposed" => format!(
            "DP={} gradient sync that the backward does not hide",
            alt.dp
        ),
        "optimizer" if alt.sharding.zero_stage < best.sharding.zero_stage => format!(
            "ZeRO-{} leaves every DP rank updating all its parameters",
            alt.sharding.zero_stage
        ),
        "optimizer" => "a longer optimizer step on the busiest stage".into(),
        _ => format!("more {term}"),
    }
}

/// One line saying why `alt` ranks below `best` (both simulated).
pub fn lost(best: &Candidate, alt: &Candidate, cluster: &Cluster, model: &Model) -> String {
    let (Some(pb), Some(pa)) = (&best.prediction, &alt.prediction) else {
        return "not simulated".into();
    };
    let rel = pa.step_time_s / pb.step_time_s - 1.0;
    if rel <= NEAR_TIE {
        let diff = differences(&best.layout, &alt.layout);
        let speed = if rel < 0.0 {
            format!("{:.1}% faster", -100.0 * rel)
        } else {
            format!("{:.1}% slower", 100.0 * rel)
        };
        return format!(
            "{speed}, within {:.0}% of the fastest: the simpler layout is preferred ({})",
            100.0 * NEAR_TIE,
            if diff.is_empty() {
                "same knobs".to_string()
            } else {
                diff.join(", ")
            }
        );
    }
    let (term, delta) = TERMS
        .iter()
        .map(|t| (*t, pa.term(t) - pb.term(t)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .expect("TERMS is not empty");
    let base = pb.term(term);
    let grew = if base > 0.0 {
        format!("+{:.0}% {term}", 100.0 * delta / base)
    } else {
        format!("+{delta:.3} s {term}")
    };
    format!(
        "{}: {grew}; step +{:.1}%",
        cause(term, &best.layout, &alt.layout, cluster, model),
        100.0 * rel
    )
}
