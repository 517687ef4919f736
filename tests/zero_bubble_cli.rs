//! `tessera run` of the zero-bubble schedules' plans (ZB-H1, ZB-V) on the CPU backend, end to
//! end (the same losses as 1F1B's), and DualPipe refused on a CPU cluster by `tessera plan` and
//! `tessera run` alike.

mod common;

use common::{metrics_losses, plan_file, refused, run, s, Scratch, README_TINY_LAYOUT};
use tessera_planner::layout::Layout;
use tessera_planner::plan::Plan;
use tessera_planner::schedule::ScheduleKind;

/// The README's job (tiny on cpu-8 as DP 2 × PP 2 × TP 2) under `schedule`.
fn layout(schedule: &str) -> Vec<&str> {
    let pick = |a: &&'static str| if *a == "1f1b" { schedule } else { a };
    README_TINY_LAYOUT.iter().map(pick).collect()
}

#[test]
fn zero_bubble_plans_train_and_dualpipe_is_refused() {
    let dir = Scratch::new();
    let mut runs = Vec::new();
    for kind in ["1f1b", "zb-h1", "zb-v"] {
        let plan = plan_file(&dir, &format!("{kind}.json"), &layout(kind));
        let metrics = dir.path(&format!("{kind}.jsonl"));
        let r = run(&["run", &s(&plan), "--steps", "6", "--metrics", &s(&metrics)]);
        assert_eq!(r.code, Some(0), "{kind}: {}", r.stderr);
        let losses = metrics_losses(&metrics);
        assert_eq!(losses.len(), 6, "{kind}: a loss per step");
        assert!(
            losses[5].1 < losses[0].1,
            "{kind}: the loss falls: {losses:?}"
        );
        runs.push((kind, losses));
    }
    // The same training as 1F1B's (runtime/tests/zero_bubble.rs checks the parameters too).
    let (_, want) = &runs[0];
    for (kind, got) in &runs[1..] {
        for ((step, a), (_, b)) in got.iter().zip(want) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "{kind}: step {step}: {a} vs {b}"
            );
        }
    }
    // DualPipe on a CPU cluster: `tessera plan` refuses it (tessera's framework profile does
    // not list it).
    let mut args = vec!["plan"];
    args.extend(layout("dualpipe"));
    let out = s(&dir.path("dualpipe.json"));
    args.extend(["-o", &out]);
    refused(&run(&args), &["dualpipe"]);
    // `tessera run` of a DualPipe plan file (the ZB-V plan re-planned as DualPipe by the
    // library, which writes what `tessera plan` does not) is refused by the runtime's check.
    let zbv = Plan::load(&dir.path("zb-v.json")).unwrap();
    let layout = Layout {
        schedule: ScheduleKind::DualPipe,
        ..zbv.parallel.layout()
    };
    let dualpipe = Plan::new(
        &zbv.job.model,
        &zbv.job.cluster,
        &layout,
        zbv.search.clone(),
    );
    let plan = dir.path("dualpipe.json");
    std::fs::write(&plan, dualpipe.to_json()).unwrap();
    refused(
        &run(&["run", &s(&plan), "--steps", "1"]),
        &["dualpipe", "--schedule zb-v"],
    );
}
