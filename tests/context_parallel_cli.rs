//! Context parallelism at the command line: the search splits long sequences, an impossible
//! CP names what it fails to divide, an exchange pinned without CP is refused, and the CPU
//! runtime refuses the all-gather exchange it does not run.

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

const LLAMA405: [&str; 4] = [
    "specs/models/llama3.1-405b.toml",
    "specs/clusters/dgx-h100-80g.toml",
    "--nodes",
    "2048",
];

/// `plan ARGS` refused as bad input: exit 2, no panic, and a message holding every one of
/// `named` (`common::refused`).
fn refused(args: &[&str], named: &[&str]) {
    common::refused(&common::run(&[&["plan"], args].concat()), named);
}

#[test]
fn llama3_405b_at_131k_tokens_plans_with_context_parallelism() {
    let mut args = LLAMA405.to_vec();
    args.extend([
        "--seq-len",
        "131072",
        "--global-batch",
        "128",
        "--format",
        "json",
    ]);
    let o = plan(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let p: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let cp = p["parallel"]["cp"].as_u64().unwrap();
    assert!(cp > 1, "CP {cp}");
    assert_eq!(p["parallel"]["mesh_order"], "tp-cp-dp-pp");
    let world = ["dp", "cp", "tp", "pp"]
        .iter()
        .map(|k| p["parallel"][k].as_u64().unwrap())
        .product::<u64>();
    assert_eq!(world, 16384);
    // At 8,192 tokens the search keeps CP 1 and plan.json leaves the key out.
    let mut args = LLAMA405.to_vec();
    args.extend(["--format", "json"]);
    let o = plan(&args);
    let p: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(p["parallel"].get("cp").is_none(), "{}", p["parallel"]);
}

#[test]
fn impossible_context_parallel_pins_are_refused_by_name() {
    // A CP that divides the devices but not the sequence into 2·CP chunks (24 GPUs).
    refused(
        &[
            "specs/models/llama3-8b.toml",
            "specs/clusters/dgx-h100-80g.toml",
            "--nodes",
            "3",
            "--cp",
            "3",
        ],
        &[
            "CP 3 needs seq_len 8192 to split into 2 × CP = 6 equal chunks",
            "fix: use a CP with 2 × CP dividing seq_len 8192",
        ],
    );
    // One that does not divide the devices.
    let mut args = LLAMA405.to_vec();
    args.extend(["--cp", "3"]);
    refused(&args, &["--cp 3 does not divide the 16384 devices"]);
    let mut args = LLAMA405.to_vec();
    args.extend(["--cp", "1", "--cp-comm", "all-gather"]);
    refused(
        &args,
        &["--cp-comm", "CP 1 has one rank", "fix: pin --cp 2 or more"],
    );
}

#[test]
fn the_cpu_runtime_refuses_the_all_gather_exchange() {
    refused(
        &[
            "specs/models/tiny.toml",
            "specs/clusters/cpu-8.toml",
            "--dp",
            "1",
            "--cp",
            "2",
            "--cp-comm",
            "all-gather",
            "--tp",
            "1",
            "--pp",
            "1",
            "--devices",
            "2",
        ],
        &["parallel.cp_comm all_gather", "ring attention (p2p) only"],
    );
}

#[test]
fn an_exchange_pinned_without_cp_is_honoured_or_refused() {
    // With --cp free, a pinned exchange makes the search try CP > 1 only: a small Llama at
    // 16,384 tokens, whose unpinned plan keeps CP 1, plans CP 2 with the ring it asked for.
    let base = [
        "tests/fixtures/tiny-llama.toml",
        "specs/clusters/dgx-h100-80g.toml",
        "--devices",
        "8",
        "--seq-len",
        "16384",
        "--global-batch",
        "8",
        "--format",
        "json",
    ];
    let cp_of = |extra: &[&str]| {
        let o = plan(&[&base[..], extra].concat());
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let p: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let cp = p["parallel"]
            .get("cp")
            .and_then(|c| c.as_u64())
            .unwrap_or(1);
        let comm = p["parallel"]
            .get("cp_comm")
            .and_then(|c| c.as_str())
            .map(str::to_string);
        (cp, comm.unwrap_or_else(|| "p2p".into()))
    };
    assert_eq!(cp_of(&[]).0, 1, "the unpinned search keeps CP 1 here");
    let (cp, comm) = cp_of(&["--cp-comm", "p2p"]);
    assert!(cp > 1 && comm == "p2p", "CP {cp} {comm}");
    let (cp, comm) = cp_of(&["--cp-comm", "all-gather"]);
    assert!(cp > 1 && comm == "all_gather", "CP {cp} {comm}");
    // Where no CP > 1 is possible (2,048 tokens), or --cp 1 is pinned, the flag is refused.
    refused(
        &[
            "specs/models/tiny.toml",
            "specs/clusters/cpu-8.toml",
            "--cp-comm",
            "p2p",
        ],
        &[
            "--cp-comm p2p",
            "--cp is not pinned",
            "seq_len 64",
            "fix: pin --cp 2 or more",
        ],
    );
    refused(
        &[
            "specs/models/tiny.toml",
            "specs/clusters/cpu-8.toml",
            "--cp",
            "1",
            "--cp-comm",
            "p2p",
        ],
        &["--cp-comm", "CP 1 has one rank", "fix: pin --cp 2 or more"],
    );
}

/// The degrees a "CP does not divide the sequence" refusal suggests each pass that rule (an
/// odd sequence gets CP 1): a suggestion never fails with the same error.
#[test]
fn the_cp_degrees_a_refusal_suggests_pass_its_rule() {
    let plan = |cp: &str, seq: &str| {
        common::run(&[
            "plan",
            "specs/models/tiny.toml",
            "specs/clusters/cpu-8.toml",
            "--cp",
            cp,
            "--seq-len",
            seq,
        ])
    };
    let r = plan("4", "35");
    common::refused(&r, &["2 × CP", "use CP 1"]);
    assert!(!r.stderr.contains("17"), "{}", r.stderr);
    let r = plan("4", "36");
    common::refused(&r, &["2 × CP"]);
    let fix = r.stderr.lines().find(|l| l.contains("fix:")).unwrap();
    let list = &fix[fix.rfind('(').unwrap() + 1..fix.rfind(')').unwrap()];
    let degrees: Vec<&str> = list.split(", ").collect();
    assert!(!degrees.is_empty() && !degrees.contains(&"9"), "{fix}");
    for cp in degrees {
        let r = plan(cp, "36");
        assert!(
            !r.stderr.contains("2 × CP") && !r.stderr.contains("does not divide the 8 devices"),
            "--cp {cp}, suggested by `{fix}`, fails the same way:\n{}",
            r.stderr
        );
    }
}
