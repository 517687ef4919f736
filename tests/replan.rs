//! `tessera replan`: the README job trained on 8 ranks, re-planned for 4 devices, continues
//! from its step-4 checkpoint on the new plan with the uninterrupted run's losses (within the
//! parity tolerance, 1e-5 relative); a count no layout can use is refused, naming the flag.

mod common;

use common::*;

#[test]
fn a_checkpoint_continues_on_the_replanned_cluster() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let (ck, straight) = train_8_saving_at_4(&dir, &plan);
    assert_eq!(straight.len(), 8);

    let new = dir.path("new-plan.json");
    let inputs = Inputs::of(&[&plan]);
    let r = run(&["replan", &s(&plan), "--devices", "4", "-o", &s(&new)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    inputs.unchanged();
    // diff's view of what changed.
    for part in ["cluster.devices", "world", "predicted per step"] {
        assert!(r.stdout.contains(part), "lacks {part}:\n{}", r.stdout);
    }
    let p: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&new).unwrap()).unwrap();
    assert_eq!(p["parallel"]["world"], 4);
    assert_eq!(p["job"]["cluster"]["devices"], 4);
    let old: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    assert_eq!(p["job"]["model"], old["job"]["model"], "the same job");

    let b = dir.path("b.jsonl");
    let r = run(&[
        "run",
        &s(&new),
        "--steps",
        "8",
        "--resume",
        &s(&ck.join("step-4")),
        "--metrics",
        &s(&b),
    ]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let resumed = metrics_losses(&b);
    assert_eq!(resumed.len(), 4, "steps 5-8");
    for ((sa, la), (sb, lb)) in straight[4..].iter().zip(&resumed) {
        assert_eq!(sa, sb);
        assert!(
            (la - lb).abs() <= 1e-5 * la.abs(),
            "step {sa}: {la} straight vs {lb} resumed on 4 devices"
        );
    }
}

#[test]
fn a_count_no_layout_can_use_is_refused_naming_the_flag() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let out = dir.path("new.json");
    let r = run(&["replan", &s(&plan), "--devices", "7", "-o", &s(&out)]);
    refused(&r, &["--devices", "no layout of 7 devices", "fix:"]);
    assert!(!out.exists(), "a refused replan wrote its output");
    let r = run(&["replan", &s(&plan), "--nodes", "0"]);
    refused(&r, &["--nodes", "found 0"]);
    let r = run(&["replan", &s(&plan), "--devices", "4", "--tp", "3"]);
    refused(&r, &["--tp", "does not divide"]);
    // Neither count: clap's usage error, exit 2.
    let r = run(&["replan", &s(&plan)]);
    assert_eq!(r.code, Some(2), "{}", r.stderr);
}

#[test]
fn a_pin_no_layout_can_use_is_named_not_the_count() {
    // 8 devices suit the README job; TP 8 does not divide its 4 heads, PP 8 is more stages
    // than its 4 layers: the pin is at fault, and the message says so and how to free it.
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    for (pin, v) in [("--tp", "8"), ("--pp", "8")] {
        let r = run(&["replan", &s(&plan), "--devices", "8", pin, v]);
        refused(
            &r,
            &[
                &format!("`{pin}`"),
                &format!("{pin} {v} leaves no layout"),
                &format!("fix: drop {pin}"),
            ],
        );
        assert!(
            !r.stderr.contains("`--devices`"),
            "blames the count:\n{}",
            r.stderr
        );
    }
}
