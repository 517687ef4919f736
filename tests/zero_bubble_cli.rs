//! `tessera run` of the zero-bubble schedules' plans (ZB-H1, ZB-V) on the CPU backend, end to
//! end, and `tessera plan` refusing DualPipe on a CPU cluster.

mod common;

use common::{metrics_losses, plan_file, refused, run, s, Scratch};

/// Tiny on 4 of cpu-8's ranks as PP 2 × TP 2 under `schedule`.
fn layout(schedule: &str) -> Vec<&str> {
    let mut args = vec![
        "specs/models/tiny.toml",
        "specs/clusters/cpu-8.toml",
        "--devices",
        "4",
        "--pp",
        "2",
        "--tp",
        "2",
        "--no-sp",
        "--micro-batch",
        "2",
        "--schedule",
    ];
    args.push(schedule);
    args
}

#[test]
fn zero_bubble_plans_train_and_dualpipe_is_refused() {
    let dir = Scratch::new();
    for kind in ["zb-h1", "zb-v"] {
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
    }
    // DualPipe on a CPU cluster: `tessera plan` refuses it (tessera's framework profile does
    // not list it).
    let mut args = vec!["plan"];
    args.extend(layout("dualpipe"));
    let out = s(&dir.path("dualpipe.json"));
    args.extend(["-o", &out]);
    refused(&run(&args), &["dualpipe"]);
    // (`tessera run` of a DualPipe plan file is refused by the runtime's check: runtime/tests/
    // zero_bubble.rs shows the message; `Plan::load` does not read one yet, see the report.)
}
