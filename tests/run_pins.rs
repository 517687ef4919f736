//! `tessera run` honours every field of the plan or refuses it before training: a plan whose
//! layout the executor would run differently is exit 2, naming the field and the fix.

mod common;

use common::*;

/// Hybrid sharding (ZeRO-3 inside a node, replicas across nodes) is planned, but the executor
/// shards over the whole DP group: the run is refused instead of measured against the wrong
/// prediction. For a CPU cluster `plan` already refuses it, as it refuses every plan the CPU
/// runtime cannot run.
#[test]
fn a_hybrid_sharded_plan_is_refused_not_run_as_full_sharding() {
    let dir = Scratch::new();
    let two_nodes = dir.copy_edit(
        "specs/clusters/cpu-8.toml",
        &[
            ("nodes = 1", "nodes = 2"),
            ("gpus_per_node = 8", "gpus_per_node = 4"),
        ],
    );
    let plan = dir.path("hsdp.json");
    let r = run(&[
        "plan",
        "specs/models/tiny.toml",
        &s(&two_nodes),
        "--dp",
        "8",
        "--tp",
        "1",
        "--pp",
        "1",
        "--micro-batch",
        "2",
        "--zero",
        "3",
        "--hybrid-shard",
        "-o",
        &s(&plan),
    ]);
    // `plan` refuses, for a CPU cluster, what the CPU runtime cannot run as written.
    refused(&r, &["parallel.hybrid_shard", "--no-hybrid-shard"]);
    assert!(!plan.exists(), "a refused plan was written");
}

/// Offload on a CPU cluster means nothing (the device memory is the host's): `plan` refuses to
/// pin it, and a plan edited by hand to offload is refused by `run` before anything starts,
/// naming the field and why (`Plan::load`'s check of every knob, `pins::effective`).
#[test]
fn a_cpu_plan_edited_to_offload_is_refused() {
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    edit_json(&plan, |v| v["parallel"]["offload"] = "optimizer".into());
    let r = run(&["run", &s(&plan), "--steps", "1"]);
    refused(
        &r,
        &[
            "`parallel.offload`",
            "on the CPU backend the device's memory is the host's",
            "set `parallel.offload` to agree",
        ],
    );
}
