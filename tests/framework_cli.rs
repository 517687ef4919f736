//! Framework profiles at the command line: `--framework` and `training.framework` name a
//! profile of specs/frameworks/, the search offers only what it can run, plan.json keeps it, and
//! an export to an engine that runs another framework is refused (a stated profile) or warned
//! about (the default profile).

mod common;

use std::path::Path;

use common::{refused, run};

const LLAMA_ONE_NODE: [&str; 5] = [
    "plan",
    "specs/models/llama3-8b.toml",
    "specs/clusters/dgx-h100-80g.toml",
    "--nodes",
    "1",
];

fn plan_json(framework: Option<&str>, out: &Path) {
    let mut args = LLAMA_ONE_NODE.to_vec();
    let o = out.to_str().unwrap();
    // ZeRO-3: a layout both megatron-core and torchtitan run (torchtitan's FSDP2).
    args.extend(["--top", "1", "--zero", "3", "-o", o]);
    if let Some(f) = framework {
        args.extend(["--framework", f]);
    }
    let r = run(&args);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
}

/// plan.json as JSON.
fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

#[test]
fn a_stated_framework_limits_the_search_and_is_kept_in_plan_json() {
    let mut args = LLAMA_ONE_NODE.to_vec();
    args.extend(["--framework", "pytorch-eager", "--top", "3"]);
    let o = run(&args);
    let out = &o.stdout;
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert!(
        out.contains("framework profile \"pytorch-eager\" (stated)"),
        "{out}"
    );
    // pytorch-eager runs data parallelism only: the layouts it cannot run are refused by name,
    // and every ranked layout is TP 1 × PP 1.
    assert!(
        out.contains("the framework cannot run this layout"),
        "{out}"
    );
    assert!(out.contains("pytorch-eager cannot run"), "{out}");
    let rows: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("#  dp"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(rows.len(), 3, "{out}");
    for r in rows {
        let cols: Vec<&str> = r.split_whitespace().collect();
        assert_eq!((cols[2], cols[3]), ("1", "1"), "tp, pp of {r}");
    }

    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("plan.json");
    plan_json(Some("torchtitan"), &p);
    let v = read_json(&p);
    assert_eq!(v["job"]["model"]["training"]["framework"], "torchtitan");
}

#[test]
fn the_default_profile_is_named_and_not_written() {
    let o = run(&LLAMA_ONE_NODE);
    let out = &o.stdout;
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert!(
        out.contains("framework profile \"megatron-core\" (the default;"),
        "{out}"
    );
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("plan.json");
    plan_json(None, &p);
    let v = read_json(&p);
    assert!(v["job"]["model"]["training"].get("framework").is_none());
}

#[test]
fn an_unknown_framework_is_refused_with_the_known_names() {
    let mut args = LLAMA_ONE_NODE.to_vec();
    args.extend(["--framework", "jax"]);
    refused(
        &run(&args),
        &["--framework", "\"jax\"", "torchtitan", "megatron-core"],
    );

    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("m.toml");
    let base = std::fs::read_to_string("specs/models/tiny.toml").unwrap();
    let with = base.replacen("[training]", "[training]\nframework = \"torchtitn\"", 1);
    std::fs::write(&spec, with).unwrap();
    refused(
        &run(&["plan", spec.to_str().unwrap(), "specs/clusters/cpu-8.toml"]),
        &["training.framework", "torchtitn", "torchtitan", "m.toml"],
    );
}

#[test]
fn an_export_to_another_framework_is_refused_or_warned() {
    let dir = tempfile::tempdir().unwrap();
    let titan = dir.path().join("titan.json");
    plan_json(Some("torchtitan"), &titan);
    let t = titan.to_str().unwrap();

    let o = run(&["export", t, "--to", "megatron"]);
    refused(&o, &["\"torchtitan\"", "--framework megatron-core"]);
    assert!(o.stdout.is_empty());

    let o = run(&["export", t, "--to", "torchtitan"]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert!(!o.stderr.contains("warning"), "{}", o.stderr);

    let default = dir.path().join("default.json");
    plan_json(None, &default);
    let o = run(&["export", default.to_str().unwrap(), "--to", "torchtitan"]);
    let err = &o.stderr;
    assert_eq!(o.code, Some(0), "{err}");
    assert!(
        err.contains("warning") && err.contains("\"megatron-core\" (the default)"),
        "{err}"
    );
    assert!(err.contains("--framework torchtitan"), "{err}");
}

#[test]
fn a_profile_refuses_a_model_or_devices_its_framework_cannot_build_naming_the_key() {
    // llm.c builds GPT-2 only: a Llama is refused by `--framework`, naming the key and a fix.
    let mut args = LLAMA_ONE_NODE.to_vec();
    args.extend(["--framework", "llm.c"]);
    refused(
        &run(&args),
        &[
            "--framework",
            "\"llm.c\"",
            "can_run.architectures = [\"gpt\"]",
            "llama3-8b is a llama model",
            "fix:",
            "torchtitan",
        ],
    );
    // llm-foundry builds Llamas but not mixtures of experts.
    refused(
        &run(&[
            "plan",
            "specs/models/mixtral-8x7b.toml",
            "specs/clusters/dgx-h100-80g.toml",
            "--nodes",
            "4",
            "--framework",
            "llm-foundry",
        ]),
        &[
            "\"llm-foundry\"",
            "can_run.moe = false",
            "mixture of experts",
            "fix:",
        ],
    );
    // A 2021 Megatron-LM has no grouped-query attention.
    let dir = common::Scratch::new();
    let gqa = dir.copy_edit(
        "specs/models/gpt3-2.7b.toml",
        &[("kv_heads = 32", "kv_heads = 8")],
    );
    refused(
        &run(&[
            "plan",
            &common::s(&gqa),
            "specs/clusters/dgx-a100-80g.toml",
            "--nodes",
            "1",
            "--framework",
            "megatron-legacy",
        ]),
        &[
            "\"megatron-legacy\"",
            "can_run.gqa = false",
            "8 K/V heads",
            "fix:",
        ],
    );
    // A GPU framework on a CPU cluster, from the flag and from the spec's training.framework.
    refused(
        &run(&[
            "plan",
            "specs/models/tiny.toml",
            "specs/clusters/cpu-8.toml",
            "--framework",
            "megatron-core",
        ]),
        &[
            "--framework",
            "can_run.devices = [\"gpu\"]",
            "cpu devices",
            "--framework tessera",
        ],
    );
    let spec = dir.copy_edit(
        "specs/models/tiny.toml",
        &[("[training]", "[training]\nframework = \"pytorch-eager\"")],
    );
    refused(
        &run(&["plan", &common::s(&spec), "specs/clusters/cpu-8.toml"]),
        &[
            "tiny.toml",
            "training.framework",
            "\"pytorch-eager\"",
            "can_run.devices",
        ],
    );
}

#[test]
fn a_plan_whose_stated_framework_cannot_build_it_is_refused_on_load() {
    // tests/fixtures/plan-cpu-megatron-core.json: the README's tiny job on cpu-8 stated for
    // megatron-core, written by `tessera plan --framework megatron-core` before profiles said
    // where they run (every other part of it consistent). Every command that loads it refuses
    // it, and `run` does not compare a CPU run with a GPU framework's predictions.
    let plan = "tests/fixtures/plan-cpu-megatron-core.json";
    for args in [vec!["explain", plan], vec!["run", plan, "--steps", "1"]] {
        refused(
            &run(&args),
            &[
                "plan-cpu-megatron-core.json",
                "job.model.training.framework",
                "\"megatron-core\"",
                "can_run.devices = [\"gpu\"]",
                "fix:",
            ],
        );
    }
}
