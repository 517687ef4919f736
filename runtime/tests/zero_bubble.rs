//! The zero-bubble schedules (Qi et al. 2023) on the CPU runtime: ZB-H1 and ZB-V split each
//! backward into B (input gradients, sent on) and W (weight gradients, later), and every layout
//! must still train exactly like the single rank: the same per-step losses, validation losses
//! and final parameters within 1e-5 relative, over 5 steps, as `parity.rs` checks the others.
//!
//! ZB-V places two model pieces per PP rank in a V (rank 0 holds the first and the last, so
//! the embedding and the head), and needs at least 2·PP layers: PP 4 runs on the tiny model
//! deepened to 8 layers, against that model's own single-rank run.

mod tiny;

use tessera_planner::layout::{Layout, Recompute};
use tessera_planner::model::Model;
use tessera_planner::plan::Plan;
use tessera_planner::schedule::{self, Op, ScheduleKind};
use tessera_runtime::exec::TrainReport;
use tiny::layout;

const STEPS: usize = 5;

fn run(plan: &Plan) -> TrainReport {
    tiny::run_evaluated(plan, STEPS)
}

/// The single-rank run of `model` (which learns).
fn reference(model: &Model) -> TrainReport {
    let one = layout(1, 1, 1, 0, ScheduleKind::OneFOneB, 1, Recompute::None);
    let r = run(&tiny::plan(model, &one));
    let (first, last) = (r.steps[0].loss, r.steps[STEPS - 1].loss);
    assert!(last < first, "the single-rank run learns: {first} → {last}");
    r
}

/// The tiny model with 8 layers: enough for ZB-V's two pieces per rank at PP 4.
fn deep_model() -> Model {
    let mut m = tiny::model();
    m.architecture.layers = 8;
    m
}

/// One layout of these tests: `(dp, pp, tp, zero, recompute, sequence parallel)`.
type Case = (u64, u64, u64, u8, Recompute, bool);

/// Every case of `kind` (with `v` chunks per stage) on `model` against its single rank, each
/// plan checked to really split backwards (ZB-H1 splits some, as the authors' patch: stage 0
/// none, stage `r` those of its first `r` steady steps and its cool-down).
fn parity(model: &Model, kind: ScheduleKind, v: u64, cases: &[Case]) {
    let want = reference(model);
    for &(dp, pp, tp, zero, recompute, sp) in cases {
        let p = tiny::plan(
            model,
            &Layout {
                sequence_parallel: sp,
                ..layout(dp, pp, tp, zero, kind, v, recompute)
            },
        );
        let what = format!("{kind} zero{zero} {recompute:?} sp{sp} dp{dp} pp{pp} tp{tp}");
        let s = &p.parallel;
        let ops = schedule::build(kind, pp as usize, s.microbatches as usize, v as usize)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let all = ops.stages.iter().flatten();
        let w = all
            .filter(|o| matches!(o, Op::BackwardWeight { .. }))
            .count();
        assert!(w >= pp as usize - 1, "{what}: {w} W passes");
        tiny::assert_same_run(&run(&p), &want, STEPS, &what);
    }
}

/// ZB-H1 on every DP × PP × TP layout up to 8 ranks with PP ≥ 2 that `parity.rs` runs under
/// 1F1B (its `every_dp_pp_tp_layout_up_to_8_ranks`).
#[test]
fn zb_h1_every_dp_pp_tp_layout_up_to_8_ranks() {
    let none = Recompute::None;
    let mut cases = Vec::new();
    for (dp, pp, tp) in [1u64, 2, 4]
        .iter()
        .flat_map(|&dp| [2u64, 4].map(|pp| (dp, pp)))
        .flat_map(|(dp, pp)| [1u64, 2, 4].map(|tp| (dp, pp, tp)))
    {
        if dp * pp * tp <= 8 {
            cases.push((dp, pp, tp, 0, none, false));
        }
    }
    assert_eq!(cases.len(), 9);
    parity(&tiny::model(), ScheduleKind::ZbH1, 1, &cases);
}

/// ZB-H1 under ZeRO 1 to 3 on `parity.rs`'s pipelined ZeRO layouts, and with sequence
/// parallelism and recompute (the W pass reads what B stashed, not the block's workspace).
#[test]
fn zb_h1_zero_stages_sequence_parallel_and_recompute() {
    let mut cases: Vec<Case> = Vec::new();
    for zero in 1..=3u8 {
        for (dp, pp, tp) in [(2, 2, 2), (4, 2, 1)] {
            cases.push((dp, pp, tp, zero, Recompute::None, false));
        }
    }
    cases.push((1, 2, 2, 0, Recompute::Full, true));
    cases.push((2, 2, 2, 1, Recompute::Selective, true));
    parity(&tiny::model(), ScheduleKind::ZbH1, 1, &cases);
}

/// ZB-V on the tiny model (4 layers: PP 2 at most) and on the 8-layer one (PP 4 too): every
/// DP × PP × TP layout up to 8 ranks of `parity.rs` (the 8-layer model's list holds all nine),
/// with ZeRO 1 to 3, sequence parallelism and recompute. Rank 0 holds the embedding and
/// the head (and the tied table's two copies, summed on the rank).
#[test]
fn zb_v_layouts() {
    let none = Recompute::None;
    let p = tiny::plan(
        &deep_model(),
        &layout(1, 4, 1, 0, ScheduleKind::ZbV, 2, none),
    );
    let first = &p.stages[0].chunks;
    assert!(first[0].embedding && first[1].head, "ZB-V's V: {first:?}");
    parity(
        &tiny::model(),
        ScheduleKind::ZbV,
        2,
        &[(1, 2, 1, 0, none, false), (2, 2, 2, 1, none, false)],
    );
    parity(
        &deep_model(),
        ScheduleKind::ZbV,
        2,
        &[
            (1, 2, 1, 0, none, false),
            (1, 2, 2, 0, none, false),
            (2, 2, 1, 0, none, false),
            (4, 2, 1, 0, none, false),
            (1, 4, 1, 0, none, false),
            (1, 4, 2, 0, none, false),
            (2, 4, 1, 0, none, false),
            (2, 2, 2, 0, none, false),
            (2, 2, 2, 2, none, false),
            (2, 2, 2, 3, none, false),
            (1, 2, 4, 0, Recompute::Full, true),
        ],
    );
}

/// A mixture of experts (tiny-moe: layers 1 to 3 route over 4 experts) under both schedules:
/// the experts' backward runs whole in B (W has none of their gradients), attention splits.
#[test]
fn zero_bubble_with_experts() {
    let (model, none) = (tiny::moe_model(), Recompute::None);
    let h1: [Case; 2] = [(2, 2, 1, 0, none, false), (1, 4, 2, 1, none, true)];
    parity(&model, ScheduleKind::ZbH1, 1, &h1);
    let v: [Case; 2] = [(2, 2, 1, 0, none, false), (1, 2, 2, 0, none, true)];
    parity(&model, ScheduleKind::ZbV, 2, &v);
}

/// A plan whose schedule the executor cannot run (DualPipe: two pipelines in opposite
/// directions) is refused before any rank starts, naming the schedule and the fix.
#[test]
fn dualpipe_is_refused_with_the_fix() {
    let model = tiny::model();
    let mut p = tiny::plan(
        &model,
        &layout(1, 2, 1, 0, ScheduleKind::ZbV, 2, Recompute::None),
    );
    // A hand-edited plan (`tessera plan` writes none for a CPU cluster).
    p.parallel.schedule = ScheduleKind::DualPipe;
    let err = tessera_runtime::exec::check_supported(&p)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("dualpipe") && err.contains("--schedule zb-v"),
        "{err}"
    );
    let err = tessera_runtime::exec::train(&p, &tiny::data(), &Default::default(), &mut |_| {})
        .expect_err("refused")
        .to_string();
    assert!(err.contains("dualpipe"), "{err}");
}
