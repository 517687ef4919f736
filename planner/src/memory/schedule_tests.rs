//! The memory of the issue-41 schedules, worked by hand against 1F1B on the same job: Llama-3
//! 8B (32 layers) on PP 2 of a DGX H100, DP 2, no recompute.

use std::path::Path;

use super::*;
use crate::layout::{Layout, Recompute};
use crate::spec::{load_cluster, load_model, ClusterOverrides, TrainingOverrides};

/// Llama-3 8B on 4 GPUs of a DGX H100 as DP 2 × PP 2 under `kind` (its fixed chunks), ZeRO
/// stage `zero`, recompute `recompute`; checked. The export tests' job too.
pub(crate) fn llama8b_pp2(
    kind: ScheduleKind,
    zero: u8,
    recompute: Recompute,
) -> (Model, Cluster, Layout) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let model = load_model(
        &root.join("specs/models/llama3-8b.toml"),
        TrainingOverrides::default(),
    )
    .unwrap();
    let mut cluster = load_cluster(
        &root.join("specs/clusters/dgx-h100-80g.toml"),
        ClusterOverrides::default(),
    )
    .unwrap();
    cluster.devices = 4;
    let layout = Layout {
        pp: 2,
        schedule: kind,
        virtual_stages: kind.fixed_virtual_stages().unwrap_or(1) as u64,
        recompute,
        ..Layout::without_pipeline(2, 1, zero, 1)
    };
    layout.check(&model, &cluster).unwrap();
    (model, cluster, layout)
}

fn report(kind: ScheduleKind) -> MemoryReport {
    let (model, cluster, layout) = llama8b_pp2(kind, 0, Recompute::None);
    estimate(&model, &cluster, &layout)
}

#[test]
fn memory_dualpipe_holds_two_model_stages() {
    let one = report(ScheduleKind::OneFOneB);
    let dual = report(ScheduleKind::DualPipe);
    // 1F1B: 16 layers a stage, the embedding on stage 0 and the head on stage 1. DualPipe:
    // each rank holds its model stage and the mirror one, so 32 layers, the embedding and the
    // head: the parameters of both 1F1B stages together (DeepSeek-V3 Table 2: 2× parameters).
    let both = one.per_stage[0].params_per_rank + one.per_stage[1].params_per_rank;
    for s in 0..2 {
        assert_eq!(
            (one.per_stage[s].layers, dual.per_stage[s].layers),
            (16, 32)
        );
        assert_eq!(dual.per_stage[s].params_per_rank, both, "stage {s}");
        // PP + 1 = 3 micro-batches of one model stage in flight (Table 2), against 1F1B's p − s.
        assert_eq!(dual.per_stage[s].in_flight, 3);
        assert_eq!(one.per_stage[s].in_flight, 2 - s as u64);
    }
}

#[test]
fn memory_zb_v_puts_the_head_on_rank_0_and_zb_h1_holds_1f1bs_peak() {
    let one = report(ScheduleKind::OneFOneB);
    let v = report(ScheduleKind::ZbV);
    // ZB-V: rank 0 holds pieces 0 and 3 (embedding and head), rank 1 the middle two: rank 0
    // has 1F1B stage 0's parameters plus the head's, rank 1 1F1B stage 1's less the head's.
    assert_eq!(
        v.per_stage[0].params_per_rank + v.per_stage[1].params_per_rank,
        one.per_stage[0].params_per_rank + one.per_stage[1].params_per_rank
    );
    assert!(v.per_stage[0].params_per_rank > one.per_stage[0].params_per_rank);
    assert!(v.per_stage[1].params_per_rank < one.per_stage[1].params_per_rank);
    // 2p = 4 chunks of half a stage in flight on each rank: 1F1B stage 0's p = 2 stages.
    assert_eq!((v.per_stage[0].in_flight, v.per_stage[1].in_flight), (4, 4));
    // ZB-H1 counts a micro-batch until its W: p = 2 on both stages, 1F1B's stage-0 peak.
    let h1 = report(ScheduleKind::ZbH1);
    assert_eq!(
        (h1.per_stage[0].in_flight, h1.per_stage[1].in_flight),
        (2, 2)
    );
    assert_eq!(h1.per_stage[0].total_bytes, one.per_stage[0].total_bytes);
    assert!(h1.per_stage[1].total_bytes > one.per_stage[1].total_bytes);
}
