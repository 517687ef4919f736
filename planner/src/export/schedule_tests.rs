//! The pipeline schedules of issue 41 through the engine exports: torchtitan writes ZB-V as
//! torch's `ZBVZeroBubble` with its model parts in the V; every engine that cannot run ZB-H1 or
//! DualPipe refuses it, naming the schedule. Plans are built directly (`Plan::new`), without a
//! framework profile's admission, as a hand-edited or another tool's plan.json could be.

use super::*;
use crate::layout::Recompute;
use crate::memory::schedule_tests::llama8b_pp2;
use crate::plan::SearchSummary;
use crate::schedule::ScheduleKind;

/// Llama-3 8B on one DGX H100: DP 2 × PP 2, ZeRO-3, full recompute, under `kind`.
fn plan(kind: ScheduleKind) -> Plan {
    let (model, cluster, layout) = llama8b_pp2(kind, 3, Recompute::Full);
    Plan::new(&model, &cluster, &layout, SearchSummary::pinned())
}

#[test]
fn export_zb_v_is_torchtitans_zbv_zero_bubble_in_a_v() {
    let text = export(&plan(ScheduleKind::ZbV), Target::Torchtitan).unwrap();
    assert!(
        text.contains("pipeline_parallel_schedule = \"ZBVZeroBubble\""),
        "{text}"
    );
    // 32 layers in 4 pieces of 8, in model order: torchtitan's V puts parts 0 and 3 on rank 0.
    let parts = text
        .lines()
        .find(|l| l.starts_with("module_fqns_per_model_part"))
        .unwrap();
    let first = parts.find("\"layers.0\"").unwrap();
    let last = parts.find("\"output\"").unwrap();
    assert!(
        first < parts.find("\"layers.8\"").unwrap() && last > first,
        "{parts}"
    );
    assert_eq!(parts.matches("tok_embeddings").count(), 1, "{parts}");
}

#[test]
fn export_refuses_the_schedules_an_engine_cannot_run() {
    for (kind, target, says) in [
        (ScheduleKind::ZbH1, Target::Torchtitan, "zb-h1"),
        (ScheduleKind::DualPipe, Target::Torchtitan, "dualpipe"),
        (ScheduleKind::ZbH1, Target::Megatron, "zb-h1"),
        (ScheduleKind::ZbV, Target::Megatron, "zb-v"),
        (ScheduleKind::DualPipe, Target::Megatron, "dualpipe"),
        (ScheduleKind::ZbV, Target::DeepSpeed, "zb-v"),
    ] {
        // DualPipe needs an even count of at least 2 × PP micro-batches: the preset's global
        // batch gives that on DP 2. Its twice the parameters do not fit on 4 GPUs: exported
        // as a forced plan, so that the schedule is what is refused.
        let e = export_with(&plan(kind), target, true)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(says) && e.contains("fix"),
            "{kind} → {target:?}: {e}"
        );
    }
}
