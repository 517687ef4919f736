//! TP collectives overlapped with their GEMMs from the command line (issue 41's validation of
//! Megatron-Bridge's and torchtitan's runs): `tessera plan --tp-comm-overlap` and
//! `training.tp_comm_overlap` in plan.json, the refusal under a framework without it, the
//! exports that write it and the ones that refuse it, and `tessera run`'s note.

mod common;

use std::path::PathBuf;

use common::*;

const LLAMA: &str = "specs/models/llama3-70b.toml";
const H100: &str = "specs/clusters/dgx-h100-80g.toml";

/// Llama-3 70B on eight DGX H100s: TP 8 with sequence parallelism, PP 4, DP 2 with ZeRO-1.
fn plan_with(dir: &Scratch, name: &str, extra: &[&str]) -> PathBuf {
    let mut args = vec![
        LLAMA,
        H100,
        "--nodes",
        "8",
        "--dp",
        "2",
        "--tp",
        "8",
        "--pp",
        "4",
        "--zero",
        "1",
        "--micro-batch",
        "1",
        "--recompute",
        "full",
        "--sp",
    ];
    args.extend(extra);
    plan_file(dir, name, &args)
}

fn json(path: &PathBuf) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn term(v: &serde_json::Value, name: &str) -> serde_json::Value {
    let terms = v["predicted"]["breakdown"].as_array().unwrap();
    terms.iter().find(|t| t["name"] == name).unwrap().clone()
}

#[test]
fn the_flag_overlaps_the_tp_collectives_and_the_plan_carries_it() {
    let dir = Scratch::new();
    let plain = json(&plan_with(&dir, "plain.json", &[]));
    let over = json(&plan_with(&dir, "over.json", &["--tp-comm-overlap"]));
    assert!(
        plain["job"]["model"]["training"]
            .get("tp_comm_overlap")
            .is_none(),
        "{}",
        plain["job"]["model"]["training"]
    );
    assert_eq!(over["job"]["model"]["training"]["tp_comm_overlap"], true);
    let (p, o) = (term(&plain, "tp_comm"), term(&over, "tp_comm"));
    let (ps, os) = (
        p["seconds"].as_f64().unwrap(),
        o["seconds"].as_f64().unwrap(),
    );
    // At least one ring step in eight stays exposed; the GEMMs hide most of the rest.
    assert!(os < 0.5 * ps && os > ps / 8.0, "{os} against {ps}");
    assert!(
        o["reason"].as_str().unwrap().contains("tp_comm_overlap"),
        "{o}"
    );
    let step = |v: &serde_json::Value| v["predicted"]["step_time_s"].as_f64().unwrap();
    assert!(step(&over) < step(&plain));
    // Each plan says what the setting changes: the plain plan's "with" is the overlapped
    // plan's own step, and the other way round.
    let (pc, oc) = (
        &plain["predicted"]["tp_overlap"],
        &over["predicted"]["tp_overlap"],
    );
    assert_eq!(pc["stated"], false);
    assert_eq!(oc["stated"], true);
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    assert_eq!(f(pc, "step_time_s_overlapped"), step(&over));
    assert_eq!(f(pc, "step_time_s_sequential"), step(&plain));
    assert_eq!(f(oc, "step_time_s_overlapped"), step(&over));
    assert_eq!(f(oc, "step_time_s_sequential"), step(&plain));
}

#[test]
fn a_framework_without_the_overlap_refuses_it() {
    let dir = Scratch::new();
    let r = run(&[
        "plan",
        LLAMA,
        H100,
        "--nodes",
        "8",
        "--framework",
        "llm-foundry",
        "--tp-comm-overlap",
        "-o",
        &s(&dir.path("refused.json")),
    ]);
    refused(&r, &["--tp-comm-overlap", "llm-foundry", "megatron-core"]);
    assert!(!dir.path("refused.json").exists());
}

#[test]
fn exports_write_the_overlap_or_refuse_it() {
    let dir = Scratch::new();
    let over = plan_with(&dir, "over.json", &["--tp-comm-overlap"]);
    let meg = export_text(&over, "megatron");
    assert!(meg.contains("--tp-comm-overlap\n"), "{meg}");
    assert!(meg.contains("--sequence-parallel"), "{meg}");
    let plain = plan_with(&dir, "plain.json", &[]);
    assert!(!export_text(&plain, "megatron").contains("--tp-comm-overlap"));
    // torchtitan's FSDP2 shards fully (ZeRO-3): DP 8 × TP 8.
    let compiled = plan_file(
        &dir,
        "compiled.json",
        &[
            LLAMA,
            H100,
            "--nodes",
            "8",
            "--dp",
            "8",
            "--tp",
            "8",
            "--pp",
            "1",
            "--zero",
            "3",
            "--recompute",
            "full",
            "--tp-comm-overlap",
            "--framework",
            "torchtitan-compile",
        ],
    );
    let tt = export_text(&compiled, "torchtitan");
    assert!(tt.contains("enable_async_tensor_parallel = true"), "{tt}");
    for (plan, to, words) in [
        (
            &over,
            "torchtitan",
            &["tp_comm_overlap", "torchtitan-compile"][..],
        ),
        (
            &over,
            "deepspeed",
            &["tp_comm_overlap", "no TP communication overlap"][..],
        ),
        (&over, "sbatch", &["tp_comm_overlap", "tessera run"][..]),
    ] {
        let out = dir.path(&format!("refused.{to}"));
        let r = run(&["export", &s(plan), "--to", to, "-o", &s(&out)]);
        refused(&r, words);
        assert!(!out.exists(), "{to} wrote a file");
    }
}

#[test]
fn run_says_the_runtime_does_not_overlap() {
    let dir = Scratch::new();
    let tiny = tiny_plan(&dir);
    assert_eq!(json(&tiny)["parallel"]["tp"], 2);
    let r = run(&["run", &s(&tiny), "--steps", "1"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(!r.stderr.contains("tp_comm_overlap"), "{}", r.stderr);
    edit_json(&tiny, |v| {
        v["job"]["model"]["training"]["tp_comm_overlap"] = true.into()
    });
    let r = run(&["run", &s(&tiny), "--steps", "1"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(
        r.stderr.contains("training.tp_comm_overlap") && r.stderr.contains("longer than predicted"),
        "{}",
        r.stderr
    );
}
