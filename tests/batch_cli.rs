//! `tessera plan`'s batch-size lines (issue 40): the tokens per optimizer step, the sentence
//! that the law needs a token budget, the sentence that no law applies to fine-tuning, and the
//! learning-rate rules when `--global-batch` changes the spec's batch. The law's own figures
//! are planner/src/batch_law.rs's unit tests.

mod common;

use common::*;

fn plan_ok(args: &[&str]) -> String {
    let mut all = vec!["plan"];
    all.extend(args);
    let r = run(&all);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    r.stdout
}

fn has(out: &str, parts: &[&str]) {
    for p in parts {
        assert!(out.contains(p), "lacks `{p}`:\n{out}");
    }
}

const TINY: [&str; 2] = ["specs/models/tiny.toml", "specs/clusters/cpu-8.toml"];

#[test]
fn plan_prints_the_tokens_per_step_and_that_the_law_needs_a_budget() {
    let out = plan_ok(&TINY);
    // tiny.toml: global_batch 16, seq_len 64: 16 × 64 = 1024 tokens.
    has(
        &out,
        &[
            "tokens per optimizer step: 1024 (global batch 16 × sequence 64)",
            "batch-size law: needs the training budget in tokens (`training.tokens`)",
            "DeepSeek LLM (DeepSeek-AI 2024, §3.1 Eq. 1)",
        ],
    );
    // The spec's own batch: no change to report.
    assert!(!out.contains("learning-rate rules"), "{out}");
    // plan.json's format is unchanged: the JSON on stdout is the document alone.
    let mut json = TINY.to_vec();
    json.extend(["--format", "json"]);
    let doc: serde_json::Value = serde_json::from_str(&plan_ok(&json)).expect("plan.json");
    assert!(doc.get("batch").is_none());
}

#[test]
fn plan_says_no_law_applies_to_fine_tuning() {
    let out = plan_ok(&[
        "specs/finetune/llama3-8b-lora-torchtune.toml",
        "specs/clusters/rtx4090-24g.toml",
        "--devices",
        "1",
        "--micro-batch",
        "2",
        "--recompute",
        "full",
    ]);
    // The spec: global_batch 16, seq_len 2048: 32768 tokens.
    has(
        &out,
        &[
            "tokens per optimizer step: 32768 (global batch 16 × sequence 2048)",
            "batch-size law: none for fine-tuning (training.method = \"lora\")",
            "no batch size or learning rate is given here",
        ],
    );
    assert!(!out.contains("B_opt"), "{out}");
}

#[test]
fn a_global_batch_flag_that_changes_the_spec_prints_the_learning_rate_rules() {
    let mut args = TINY.to_vec();
    args.extend(["--global-batch", "32"]);
    let out = plan_ok(&args);
    // 16 → 32: k = 2. tiny.toml states no [optimizer]: lr 3e-3, the default. Linear: 3e-3 · 2
    // = 6.000e-3; square root: 3e-3 · 1.41421 = 4.243e-3.
    has(
        &out,
        &[
            "tokens per optimizer step: 2048 (global batch 32 × sequence 64)",
            "global batch 16 → 32 (×2.0000)",
            "Goyal et al. 2017",
            "lr × 2.0000 = 6.000e-3 for SGD-like",
            "Malladi et al. 2022",
            "lr × 1.4142 = 4.243e-3 for Adam-like",
            "from optimizer.lr 0.003 (the default where the spec states none)",
        ],
    );
    // The flag at the spec's own value is no change.
    let mut same = TINY.to_vec();
    same.extend(["--global-batch", "16"]);
    assert!(!plan_ok(&same).contains("learning-rate rules"));
}

#[test]
fn replan_keeps_the_global_batch_and_prints_no_rule() {
    // replan plans the same job (its checkpoint refuses another global batch on resume), so
    // the rule line appears only where a new plan's batch differs; here it does not.
    let dir = Scratch::new();
    let plan = tiny_plan(&dir);
    let r = run(&["replan", &s(&plan), "--devices", "4"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(!r.stdout.contains("learning-rate rules"), "{}", r.stdout);
}
