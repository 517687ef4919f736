//! Full recompute of every N-th layer (`--recompute full --recompute-every N`): the losses are
//! those of keeping every activation (recompute re-runs the same functions on the same inputs),
//! and the memory lies between no recompute and full recompute of every layer.

mod tiny;

use tessera_planner::layout::{Layout, Recompute};
use tessera_planner::plan::Plan;
use tessera_runtime::alloc::TrackingAlloc;
use tessera_runtime::exec::TrainReport;

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fn layout(pp: u64, recompute: Recompute, every: u64) -> Layout {
    Layout {
        pp,
        recompute,
        recompute_every: every,
        ..Layout::without_pipeline(1, 1, 0, 2)
    }
}

fn plan(pp: u64, recompute: Recompute, every: u64) -> Plan {
    tiny::plan(&tiny::model(), &layout(pp, recompute, every))
}

fn run(plan: &Plan) -> TrainReport {
    tiny::run(plan, 3)
}

fn losses(r: &TrainReport) -> Vec<f64> {
    r.steps.iter().map(|s| s.loss).collect()
}

#[test]
fn every_second_layer_trains_like_no_recompute_in_between_memory() {
    // One rank, 4 layers: layers 2 and 4 are recomputed.
    let none = run(&plan(1, Recompute::None, 1));
    let half = run(&plan(1, Recompute::Full, 2));
    let full = run(&plan(1, Recompute::Full, 1));
    assert_eq!(losses(&half), losses(&none), "recompute is bit-exact");
    assert_eq!(losses(&full), losses(&none));
    let (n, h, f) = (none.peak_bytes[0], half.peak_bytes[0], full.peak_bytes[0]);
    assert!(
        f < h && h < n,
        "peak bytes: full {f}, every 2nd {h}, none {n}"
    );
    // The planner's prediction orders them the same way.
    let act = |p: &Plan| p.predicted.memory.peak_bytes;
    let (pn, ph, pf) = (
        act(&plan(1, Recompute::None, 1)),
        act(&plan(1, Recompute::Full, 2)),
        act(&plan(1, Recompute::Full, 1)),
    );
    assert!(
        pf < ph && ph < pn,
        "predicted: full {pf}, every 2nd {ph}, none {pn}"
    );
    // Across two stages the layer count runs on from the first stage (layers 0-1 on stage 0,
    // 2-3 on stage 1): the same losses again.
    let pp2 = run(&plan(2, Recompute::Full, 2));
    let pp2_none = run(&plan(2, Recompute::None, 1));
    assert_eq!(losses(&pp2), losses(&pp2_none));
}

#[test]
fn every_n_needs_full_recompute() {
    let l = Layout {
        recompute: Recompute::Selective,
        ..layout(1, Recompute::Full, 2)
    };
    let why = l.check(&tiny::model(), &tiny::cluster(1)).unwrap_err();
    assert!(
        why.to_string().contains("applies to full recompute"),
        "{why}"
    );
}
