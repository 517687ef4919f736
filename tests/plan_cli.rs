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

/// Runs `tessera plan` on the tiny model and the 8-device CPU cluster with `extra`.
fn tiny(extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
        .args([
            "plan",
            "specs/models/tiny.toml",
            "specs/clusters/cpu-8.toml",
        ])
        .args(extra)
        .output()
        .expect("the tessera binary runs")
}

/// `extra` is refused with exit 2, no panic, and a message that names every one of `named`
/// and a fix.
fn refused(extra: &[&str], named: &[&str]) {
    let o = tiny(extra);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{extra:?} was accepted:\n{err}");
    assert!(!err.contains("panicked"), "{extra:?}: {err}");
    for n in named.iter().chain(&["fix:"]) {
        assert!(
            err.contains(n),
            "{extra:?}: the message does not name {n}:\n{err}"
        );
    }
}

fn tiny_json(extra: &[&str]) -> serde_json::Value {
    let mut args = extra.to_vec();
    args.extend(["--format", "json"]);
    let o = tiny(&args);
    assert!(
        o.status.success(),
        "{extra:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("--format json prints JSON")
}

#[test]
fn recompute_every_needs_full_recompute() {
    for r in ["none", "selective"] {
        refused(
            &["--recompute", r, "--recompute-every", "2"],
            &["`--recompute-every`", "--recompute full"],
        );
        refused(
            &["--recompute", r, "--recompute-every", "1"],
            &["`--recompute-every`"],
        );
    }
}

/// The runtime recomputes layers N, 2N, … counted over the whole model; the planner charges
/// 1/N of every layer. The two agree exactly when every model chunk holds a multiple of N
/// layers: anything else is refused, and a search with N pinned splits in multiples of N.
#[test]
fn recompute_every_is_what_the_runtime_recomputes() {
    // tiny has 4 layers: N = 5 recomputes nothing, N = 3 one layer where 4/3 are charged.
    for n in ["5", "3"] {
        refused(
            &["--recompute", "full", "--recompute-every", n],
            &["`--recompute-every`", "4 layers"],
        );
    }
    // 4 stages of one layer: every 2nd layer is layer 2 and 4, half the stages.
    refused(
        &["--recompute", "full", "--recompute-every", "2", "--pp", "4"],
        &["--recompute-every", "--pp"],
    );
    for pp in ["1", "2"] {
        let p = tiny_json(&["--recompute", "full", "--recompute-every", "2", "--pp", pp]);
        assert_eq!(p["parallel"]["recompute_every"], 2);
        for st in p["stages"].as_array().unwrap() {
            for ch in st["chunks"].as_array().unwrap() {
                let l = &ch["layers"];
                let n = l[1].as_u64().unwrap() - l[0].as_u64().unwrap();
                assert_eq!(n % 2, 0, "PP {pp}: a chunk of {n} layers");
            }
        }
    }
}

#[test]
fn pins_that_would_not_take_effect_are_refused() {
    refused(
        &["--virtual-stages", "2", "--schedule", "1f1b"],
        &["`--virtual-stages`", "--schedule interleaved"],
    );
    refused(
        &["--virtual-stages", "2", "--schedule", "gpipe"],
        &["`--virtual-stages`"],
    );
    refused(
        &["--virtual-stages", "1", "--schedule", "interleaved"],
        &["--virtual-stages", "--schedule"],
    );
    refused(
        &["--virtual-stages", "2", "--pp", "1"],
        &["--virtual-stages", "--pp"],
    );
    refused(
        &["--schedule", "interleaved", "--pp", "1"],
        &["--schedule", "--pp"],
    );
    refused(&["--sp", "--tp", "1"], &["`--sp`", "--tp"]);
    refused(
        &["--hybrid-shard", "--zero", "0"],
        &["`--hybrid-shard`", "--zero"],
    );
    // cpu-8 is one node: sharding within a node is sharding over the whole DP group.
    refused(&["--hybrid-shard"], &["`--hybrid-shard`", "node"]);
    refused(&["--hybrid-shard", "--zero", "3"], &["`--hybrid-shard`"]);
    refused(&["--top", "0"], &["`--top`"]);
    // --force writes a plan: without -o or --format json there is none to write.
    refused(
        &["--force", "--dp", "8", "--tp", "1", "--pp", "1"],
        &["`--force`", "-o"],
    );
    // --force writes one pinned layout that does not fit: a search has none to force.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.json");
    refused(
        &["--force", "-o", out.to_str().unwrap()],
        &["`--force`", "layouts"],
    );
    assert!(!out.exists());
}

#[test]
fn pins_that_take_effect_are_kept() {
    // A pinned --virtual-stages alone implies the interleaved schedule.
    let p = tiny_json(&["--virtual-stages", "2", "--pp", "2"]);
    assert_eq!(p["parallel"]["schedule"], "interleaved");
    assert_eq!(p["parallel"]["virtual_stages"], 2);
    // --sp alone picks a TP above 1.
    let p = tiny_json(&["--sp"]);
    assert!(p["parallel"]["tp"].as_u64().unwrap() > 1);
    assert_eq!(p["parallel"]["sequence_parallel"], true);
    // Overrides of the spec's training settings are the plan's.
    let p = tiny_json(&["--seq-len", "32", "--global-batch", "32"]);
    assert_eq!(p["job"]["model"]["training"]["seq_len"], 32);
    assert_eq!(p["job"]["model"]["training"]["global_batch"], 32);
}

/// A tiny plan with `extra` pins, edited by `edit`, then validated: the refusal's stderr.
fn edited_plan_refused(extra: &[&str], edit: impl Fn(&mut serde_json::Value)) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let mut args = extra.to_vec();
    args.extend(["-o", out.to_str().unwrap()]);
    let o = tiny(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&out, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
        .args(["validate", out.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(
        o.status.code(),
        Some(2),
        "an edited plan was accepted:\n{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("fix:"), "{err}");
    err
}

#[test]
fn plan_json_fields_that_contradict_each_other_are_refused_by_name() {
    let pins = ["--dp", "4", "--tp", "1", "--pp", "2", "--micro-batch", "1"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut a = pins.to_vec();
        a.extend_from_slice(extra);
        a
    };
    // recompute_every without full recompute.
    let err = edited_plan_refused(&with(&["--recompute", "selective"]), |v| {
        v["parallel"]["recompute_every"] = 2.into();
    });
    assert!(err.contains("`parallel.recompute_every`"), "{err}");
    // Every 4th layer of two stages of 2 layers: the runtime recomputes layer 4 only.
    let err = edited_plan_refused(
        &with(&["--recompute", "full", "--recompute-every", "2"]),
        |v| v["parallel"]["recompute_every"] = 4.into(),
    );
    assert!(err.contains("`parallel.recompute_every`"), "{err}");
    assert!(err.contains("multiple of 4 layers"), "{err}");
    // Every 2nd layer of stages of 1 and 3 layers: 0 and 2 recomputed where 0.5 and 1.5 are
    // charged.
    let err = edited_plan_refused(
        &with(&["--recompute", "full", "--recompute-every", "2"]),
        |v| {
            v["stages"][0]["chunks"][0]["layers"] = serde_json::json!([0, 1]);
            v["stages"][1]["chunks"][0]["layers"] = serde_json::json!([1, 4]);
        },
    );
    assert!(err.contains("`parallel.recompute_every`"), "{err}");
    assert!(err.contains("[1, 3]"), "{err}");
    // Hybrid sharding without ZeRO, and inside one node.
    let err = edited_plan_refused(&with(&["--zero", "0"]), |v| {
        v["parallel"]["hybrid_shard"] = true.into();
    });
    assert!(err.contains("`parallel.hybrid_shard`"), "{err}");
    let err = edited_plan_refused(&with(&["--zero", "1"]), |v| {
        v["parallel"]["hybrid_shard"] = true.into();
    });
    assert!(err.contains("`parallel.hybrid_shard`"), "{err}");
    // Virtual stages without the interleaved schedule.
    let err = edited_plan_refused(&with(&["--schedule", "1f1b"]), |v| {
        v["parallel"]["virtual_stages"] = 2.into();
    });
    assert!(
        err.contains("`parallel.virtual_stages`") || err.contains("`parallel.schedule`"),
        "{err}"
    );
}
