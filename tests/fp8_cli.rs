//! FP8 training from the command line (issue 41): `tessera plan --fp8 RECIPE` and
//! `training.fp8` in plan.json, the "FP8 would change" section, the refusal of a device without
//! an FP8 peak, the exports that run a recipe and the ones that refuse it, and `tessera run`'s
//! refusal.

mod common;

use std::path::PathBuf;

use common::*;

const LLAMA: &str = "specs/models/llama3-8b.toml";
const H100: &str = "specs/clusters/dgx-h100-80g.toml";
const A100: &str = "specs/clusters/dgx-a100-80g.toml";

/// Llama-3 8B on one DGX H100, DP 8 with ZeRO-2 (which both Megatron-LM and torchtitan run), full recompute, with the given FP8 flags.
fn layout(cluster: &'static str, extra: &[&'static str]) -> Vec<&'static str> {
    let mut args = vec![
        LLAMA,
        cluster,
        "--dp",
        "8",
        "--tp",
        "1",
        "--pp",
        "1",
        "--zero",
        "2",
        "--micro-batch",
        "1",
        "--recompute",
        "full",
    ];
    args.extend(extra);
    args
}

fn plan_with(dir: &Scratch, name: &str, extra: &[&'static str]) -> PathBuf {
    plan_file(dir, name, &layout(H100, extra))
}

fn json(path: &PathBuf) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn the_flag_states_the_recipe_and_the_plan_carries_it() {
    let dir = Scratch::new();
    let p = plan_with(&dir, "delayed.json", &["--fp8", "delayed"]);
    let v = json(&p);
    assert_eq!(v["job"]["model"]["training"]["fp8"], "delayed");
    let c = &v["predicted"]["fp8"];
    assert_eq!(c["recipe"], "delayed");
    assert_eq!(c["stated"], true);
    // The plan's own step is the FP8 one; the 16-bit step beside it is longer on these GEMMs.
    assert_eq!(c["step_time_s_fp8"], v["predicted"]["step_time_s"]);
    assert!(c["step_time_s_bf16"].as_f64().unwrap() > c["step_time_s_fp8"].as_f64().unwrap());
    let names: Vec<&str> = (c["linears"].as_array().unwrap().iter())
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["qkv", "proj", "gate_up", "down"]);
    // Transformer Engine's FP8 weights and their transposes: a named memory term.
    let terms = v["predicted"]["memory"]["per_stage"][0]["terms"]
        .as_array()
        .unwrap();
    let cache = terms
        .iter()
        .find(|t| t["name"] == "fp8_weight_cache")
        .unwrap();
    // 2 B × 218,103,808 FP8-linear parameters × 32 layers.
    assert_eq!(cache["bytes"], 2 * 218_103_808u64 * 32);
    // The plan reads back, and `explain` shows the section.
    let r = run(&["explain", &s(&p)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(
        r.stdout.contains("FP8 (training.fp8 = \"delayed\")"),
        "{}",
        r.stdout
    );
}

#[test]
fn a_16_bit_plan_says_what_fp8_would_change_and_writes_no_key() {
    let dir = Scratch::new();
    let out = dir.path("bf16.json");
    let mut args = vec!["plan"];
    args.extend(layout(H100, &[]));
    let o = s(&out);
    args.extend(["-o", o.as_str()]);
    let r = run(&args);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains("FP8 would change"), "{}", r.stdout);
    assert!(r.stdout.contains("gate_up"), "{}", r.stdout);
    let v = json(&out);
    assert!(v["job"]["model"]["training"].get("fp8").is_none());
    let c = &v["predicted"]["fp8"];
    assert_eq!(
        (c["recipe"].as_str(), c["stated"].as_bool()),
        (Some("tensorwise"), Some(false))
    );
    assert_eq!(c["step_time_s_bf16"], v["predicted"]["step_time_s"]);
}

#[test]
fn a_device_without_an_fp8_peak_refuses_the_recipe() {
    let mut args = vec!["plan"];
    args.extend(layout(A100, &["--fp8", "tensorwise"]));
    let r = run(&args);
    refused(
        &r,
        &[A100, "device.peak_tflops_fp8", "\"tensorwise\"", "fix:"],
    );
    let r = run(&["plan", LLAMA, H100, "--fp8", "tensorwize"]);
    refused(
        &r,
        &[
            "--fp8",
            "tensorwize",
            "none | tensorwise | rowwise | delayed | blockwise",
        ],
    );
}

#[test]
fn exports_run_the_recipe_or_refuse_it() {
    let dir = Scratch::new();
    let delayed = plan_with(&dir, "delayed.json", &["--fp8", "delayed"]);
    let meg = export_text(&delayed, "megatron");
    assert!(
        meg.contains("--fp8-format hybrid\n  --fp8-recipe delayed\n"),
        "{meg}"
    );
    let blockwise = plan_with(&dir, "blockwise.json", &["--fp8", "blockwise"]);
    let meg = export_text(&blockwise, "megatron");
    assert!(
        meg.contains("--fp8-format e4m3\n  --fp8-recipe blockwise\n"),
        "{meg}"
    );
    let rowwise = plan_with(&dir, "rowwise.json", &["--fp8", "rowwise"]);
    let tt = export_text(&rowwise, "torchtitan");
    assert!(
        tt.contains("converters = [\"quantize.linear.float8\"]"),
        "{tt}"
    );
    assert!(tt.contains("recipe_name = \"rowwise\""), "{tt}");
    assert!(tt.contains("filter_fqns = [\"output\"]"), "{tt}");
    let tensorwise = plan_with(&dir, "tensorwise.json", &["--fp8", "tensorwise"]);
    let tt = export_text(&tensorwise, "torchtitan");
    assert!(!tt.contains("recipe_name"), "{tt}");
    for (plan, to, words) in [
        (
            &rowwise,
            "megatron",
            &["\"rowwise\"", "no rowwise", "torchtitan"][..],
        ),
        (
            &delayed,
            "torchtitan",
            &["\"delayed\"", "no delayed", "megatron"][..],
        ),
        (
            &tensorwise,
            "deepspeed",
            &["FP8", "\"tensorwise\"", "--fp8 none"][..],
        ),
        (&tensorwise, "sbatch", &["FP8", "no FP8 GEMM"][..]),
    ] {
        let out = dir.path(&format!("refused.{to}"));
        let r = run(&["export", &s(plan), "--to", to, "-o", &s(&out)]);
        refused(&r, words);
        assert!(!out.exists(), "{to} wrote a file");
    }
}

#[test]
fn run_refuses_an_fp8_plan() {
    let dir = Scratch::new();
    // On the GPU cluster: the CUDA backend has no FP8 GEMM yet.
    let p = plan_with(&dir, "tensorwise.json", &["--fp8", "tensorwise"]);
    let r = run(&["run", &s(&p), "--steps", "1"]);
    assert_ne!(r.code, Some(0));
    assert!(r.stderr.contains("no FP8 GEMM"), "{}", r.stderr);
    // The CPU backend: a CPU plan edited to state a recipe (and the CPU's default profile,
    // whose FP8 linears would be torchao's: the stored memory prediction still holds, so the
    // plan reads as undamaged and reaches the backend's refusal).
    let tiny = tiny_plan(&dir);
    edit_json(&tiny, |v| {
        v["job"]["model"]["training"]["fp8"] = "tensorwise".into();
        v["job"]["model"]["training"]["framework"] = "tessera".into();
    });
    let r = run(&["run", &s(&tiny), "--steps", "1"]);
    assert_ne!(r.code, Some(0));
    assert!(
        r.stderr
            .contains("CPU backend computes in f32 and has no FP8 GEMM"),
        "{}",
        r.stderr
    );
}
