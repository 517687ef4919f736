//! Expert parallelism at the command line: the search picks EP for an MoE model and plan.json
//! carries it; an impossible EP names the rule it breaks (Megatron-Core's) and the fix.

mod common;

use std::path::Path;
use std::process::{Command, Output};

fn plan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
        .arg("plan")
        .args(args)
        .output()
        .expect("the tessera binary runs")
}

const MIXTRAL: [&str; 8] = [
    "specs/models/mixtral-8x7b.toml",
    "specs/clusters/dgx-h100-80g.toml",
    "--nodes",
    "8",
    "--seq-len",
    "4096",
    "--global-batch",
    "256",
];

/// `plan ARGS` refused as bad input: exit 2, no panic, and a message holding every one of
/// `named` (`common::refused`).
fn refused(args: &[&str], named: &[&str]) {
    common::refused(&common::run(&[&["plan"], args].concat()), named);
}

#[test]
fn mixtral_plans_with_expert_parallelism_in_plan_json() {
    let mut args = MIXTRAL.to_vec();
    args.extend(["--format", "json"]);
    let o = plan(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let p: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ep = p["parallel"]["ep"].as_u64().unwrap();
    let dp = p["parallel"]["dp"].as_u64().unwrap();
    assert!(
        ep > 1 && 8u64.is_multiple_of(ep) && dp.is_multiple_of(ep),
        "EP {ep}, DP {dp}"
    );
    // EP adds no rank: the world is still DP × TP × PP.
    let world = ["dp", "tp", "pp"]
        .iter()
        .map(|k| p["parallel"][k].as_u64().unwrap())
        .product::<u64>();
    assert_eq!(world, 64);
    assert_eq!(p["parallel"]["mesh_order"], "tp-dp-pp");
    assert!(p["predicted"]["breakdown"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["name"] == "ep_comm"));
    // A dense model's plan leaves the key out.
    let o = plan(&[
        "specs/models/llama3-8b.toml",
        "specs/clusters/dgx-h100-80g.toml",
        "--format",
        "json",
    ]);
    let p: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(p["parallel"].get("ep").is_none());
}

#[test]
fn an_impossible_ep_names_its_rule_and_fix() {
    let mut args = MIXTRAL.to_vec();
    args.extend(["--ep", "16", "--dp", "16", "--tp", "1"]);
    refused(
        &args,
        &[
            "EP 16 does not divide the 8 routed experts",
            "fix:",
            "1, 2, 4, 8",
        ],
    );
    let mut args = MIXTRAL.to_vec();
    args.extend(["--ep", "8", "--dp", "4", "--tp", "4", "--pp", "4"]);
    refused(
        &args,
        &["EP 8 is cut from the DP 4", "does not divide them", "fix:"],
    );
    let mut args = MIXTRAL.to_vec();
    args.extend(["--ep", "2", "--tp", "2", "--no-sp"]);
    refused(&args, &["sequence parallelism", "add --sp"]);
    refused(
        &[
            "specs/models/llama3-8b.toml",
            "specs/clusters/dgx-h100-80g.toml",
            "--ep",
            "2",
        ],
        &["EP 2 splits routed experts", "llama3-8b is dense", "--ep 1"],
    );
}
