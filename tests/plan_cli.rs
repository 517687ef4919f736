//! `tessera plan` pins: with every knob pinned, the plan is that one layout.

mod common;

use std::path::Path;
use std::process::Command;

use common::GPT3_MEGATRON_LAYOUT;

fn plan_json(extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["plan"];
    args.extend_from_slice(GPT3_MEGATRON_LAYOUT);
    args.extend(["--format", "json"]);
    args.extend_from_slice(extra);
    let o = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
        .args(&args)
        .output()
        .expect("the tessera binary runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("--format json prints JSON")
}

#[test]
fn every_knob_pinned_evaluates_exactly_one_layout() {
    for (flag, hybrid) in [("--no-hybrid-shard", false), ("--hybrid-shard", true)] {
        let p = plan_json(&[flag]);
        assert_eq!(p["search"]["evaluated"], 1, "{flag}");
        let par = &p["parallel"];
        assert_eq!(
            (&par["dp"], &par["tp"], &par["pp"], &par["zero_stage"]),
            (&16.into(), &8.into(), &8.into(), &1.into()),
            "{flag}"
        );
        assert_eq!(par["hybrid_shard"], hybrid, "{flag}");
        assert_eq!(par["sequence_parallel"], true);
        assert_eq!(par["virtual_stages"], 2);
    }
    // Leaving hybrid sharding open searches both.
    assert_eq!(plan_json(&[])["search"]["evaluated"], 2);
}
