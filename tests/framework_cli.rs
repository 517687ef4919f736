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

/// The plan succeeded and names `profile` as the stated one.
fn planned_for(r: &common::Ran, profile: &str) {
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let line = format!("framework profile \"{profile}\" (stated)");
    assert!(r.stdout.contains(&line), "{}", r.stdout);
}

/// `--compile` takes the profile's compiled variant (`compiled` in specs/frameworks/): of
/// `--framework`, or of the spec's `training.framework`; plan.json keeps the compiled name.
#[test]
fn compile_maps_a_pytorch_profile_to_its_compiled_variant() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("plan.json");
    let mut args = LLAMA_ONE_NODE.to_vec();
    let o = p.to_str().unwrap();
    args.extend([
        "--framework",
        "torchtitan",
        "--compile",
        "--zero",
        "3",
        "--top",
        "1",
        "-o",
        o,
    ]);
    let r = run(&args);
    planned_for(&r, "torchtitan-compile");
    let v = read_json(&p);
    assert_eq!(
        v["job"]["model"]["training"]["framework"],
        "torchtitan-compile"
    );

    let scratch = common::Scratch::new();
    let spec = scratch.copy_edit(
        "specs/models/llama3-8b.toml",
        &[("[training]", "[training]\nframework = \"pytorch-eager\"")],
    );
    let r = run(&[
        "plan",
        &common::s(&spec),
        "specs/clusters/dgx-h100-80g.toml",
        "--nodes",
        "1",
        "--compile",
        "--top",
        "1",
    ]);
    planned_for(&r, "pytorch-compile");
}

/// A profile without a compiled variant (the default megatron-core, or a named deepspeed) is
/// refused under `--compile`, naming it and the pairs that exist.
#[test]
fn compile_refuses_a_profile_without_a_compiled_variant() {
    for extra in [vec![], vec!["--framework", "deepspeed"]] {
        let mut args = vec![
            "plan",
            "specs/models/gpt3-2.7b.toml",
            "specs/clusters/dgx-a100-80g.toml",
            "--nodes",
            "1",
            "--compile",
        ];
        args.extend(extra.iter().copied());
        let name = extra.get(1).copied().unwrap_or("megatron-core");
        refused(
            &run(&args),
            &[
                "--compile",
                &format!("\"{name}\" has no compiled variant"),
                &format!("specs/frameworks/{name}.toml"),
                "pytorch-eager → pytorch-compile",
                "torchtitan → torchtitan-compile",
            ],
        );
    }
}

/// FSDP1's SHARD_GRAD_OP is ZeRO-2: pytorch-eager plans `--zero 2`; Megatron-LM of 2021
/// (megatron-legacy, no ZeRO) refuses it, naming the profile, the stage and the fix.
#[test]
fn zero_2_is_planned_for_pytorch_and_refused_by_a_framework_without_it() {
    let base = [
        "plan",
        "specs/models/gpt3-2.7b.toml",
        "specs/clusters/dgx-a100-80g.toml",
        "--nodes",
        "1",
        "--zero",
        "2",
        "--pp",
        "1",
        "--top",
        "1",
    ];
    let mut args = base.to_vec();
    args.extend(["--framework", "pytorch-eager"]);
    let r = run(&args);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let chosen = r
        .stdout
        .lines()
        .find(|l| l.starts_with("chosen:"))
        .unwrap_or_default();
    assert!(chosen.ends_with("zero2"), "{}", r.stdout);

    let mut args = base.to_vec();
    args.extend(["--framework", "megatron-legacy"]);
    refused(
        &run(&args),
        &["megatron-legacy cannot run ZeRO-2", "fix: use --zero 0"],
    );
}

/// A torchtitan-compile plan exports to torchtitan with `[compile]` on (the blocks and the
/// loss, as the profile predicts them; a torchtitan-compile-blocks plan the blocks alone), and
/// its ZeRO-2 as `fsdp_reshard_after_forward = "never"`; an eager ZeRO-3 plan writes neither.
#[test]
fn a_compiled_zero_2_plan_exports_to_torchtitan_with_compile_and_no_reshard() {
    let dir = tempfile::tempdir().unwrap();
    let export_as = |framework: &str, extra: &[&str]| -> toml::Table {
        let p = dir.path().join("plan.json");
        let mut args = LLAMA_ONE_NODE.to_vec();
        args.extend(["--framework", framework, "--top", "1", "-o"]);
        args.push(p.to_str().unwrap());
        args.extend(extra);
        let r = run(&args);
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        let o = run(&["export", p.to_str().unwrap(), "--to", "torchtitan"]);
        assert_eq!(o.code, Some(0), "{}", o.stderr);
        o.stdout.parse().unwrap()
    };
    let export = |extra: &[&str]| export_as("torchtitan", extra);
    let components = |t: &toml::Table| -> Vec<String> {
        t["compile"]["components"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    };
    let t = export(&["--compile", "--zero", "2"]);
    assert_eq!(t["compile"]["enable"].as_bool(), Some(true), "{t}");
    assert_eq!(components(&t), ["model", "loss"]);
    // The blocks compiled and the loss eager, as the profile predicts them.
    let blocks = export_as("torchtitan-compile-blocks", &["--zero", "3"]);
    assert_eq!(
        blocks["compile"]["enable"].as_bool(),
        Some(true),
        "{blocks}"
    );
    assert_eq!(components(&blocks), ["model"]);
    let par = &t["parallelism"];
    assert_eq!(par["fsdp_reshard_after_forward"].as_str(), Some("never"));
    assert_eq!(
        par["data_parallel_shard_degree"].as_integer(),
        Some(
            8 / par["tensor_parallel_degree"].as_integer().unwrap()
                / par["pipeline_parallel_degree"].as_integer().unwrap()
        )
    );

    let t = export(&["--zero", "3"]);
    assert!(t.get("compile").is_none(), "{t}");
    assert!(
        t["parallelism"].get("fsdp_reshard_after_forward").is_none(),
        "{t}"
    );
}
