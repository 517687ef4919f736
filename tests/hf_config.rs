//! Hugging Face `config.json` files as model specs.
//!
//! The fixtures in tests/fixtures/hf/ are the published config.json files of
//! meta-llama/Meta-Llama-3-8B, mistralai/Mistral-7B-v0.1, Qwen/Qwen2-7B and
//! openai-community/gpt2, unchanged.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tessera_planner::model::{Model, Position};
use tessera_planner::spec::{load_model, TrainingOverrides};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str) -> PathBuf {
    root()
        .join("tests/fixtures/hf")
        .join(name)
        .join("config.json")
}

fn hf(name: &str, seq_len: u64, global_batch: u64) -> Model {
    let over = TrainingOverrides {
        seq_len: Some(seq_len),
        global_batch: Some(global_batch),
        ..Default::default()
    };
    load_model(&fixture(name), over).unwrap_or_else(|e| panic!("{e}"))
}

fn preset(name: &str) -> Model {
    let path = root().join("specs/models").join(format!("{name}.toml"));
    load_model(&path, TrainingOverrides::default()).unwrap_or_else(|e| panic!("{e}"))
}

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(root())
        .args(args)
        .output()
        .expect("the tessera binary runs")
}

#[test]
fn llama3_8b_config_resolves_to_the_preset() {
    let from_hf = hf("llama3-8b", 8192, 512);
    let from_toml = preset("llama3-8b");
    assert_eq!(from_hf.architecture, from_toml.architecture);
    assert_eq!(from_hf.training, from_toml.training);
    assert_eq!(from_hf.architecture.param_count(), 8_030_261_248);
    assert_eq!(from_toml.architecture.param_count(), 8_030_261_248);
}

#[test]
fn llama3_8b_config_plans_like_the_preset() {
    let run = |model: &str| -> serde_json::Value {
        let out = tessera(&[
            "plan",
            model,
            "specs/clusters/dgx-h100-80g.toml",
            "--seq-len",
            "8192",
            "--global-batch",
            "512",
            "--format",
            "json",
        ]);
        assert!(
            out.status.success(),
            "tessera plan {model} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("--format json prints one JSON document")
    };
    let from_hf = run("tests/fixtures/hf/llama3-8b/config.json");
    let from_toml = run("specs/models/llama3-8b.toml");
    assert!(from_hf["parallel"].is_object());
    assert!(from_hf["predicted"].is_object());
    assert_eq!(from_hf["parallel"], from_toml["parallel"]);
    assert_eq!(from_hf["predicted"], from_toml["predicted"]);
}

#[test]
fn mistral_7b_parameter_count() {
    let m = hf("mistral-7b", 4096, 512);
    assert_eq!(m.architecture.param_count(), 7_241_732_096);
    assert_eq!(m.architecture.kv_heads, 8);
    assert!(!m.architecture.tied_embeddings);
}

#[test]
fn qwen2_7b_parameter_count_includes_the_qkv_biases() {
    let m = hf("qwen2-7b", 4096, 512);
    let a = &m.architecture;
    assert!(a.qkv_bias, "Qwen2 has biases on its Q, K and V projections");
    assert!(!a.bias, "and on no other linear layer");
    assert_eq!(a.param_count(), 7_615_616_512);
    // The biases are q_dim + 2·kv_dim per layer: without them the count is short by exactly that.
    let mut no_bias = a.clone();
    no_bias.qkv_bias = false;
    assert_eq!(
        a.param_count() - no_bias.param_count(),
        a.layers * (a.q_dim() + 2 * a.kv_dim())
    );
}

#[test]
fn gpt2_parameter_count_and_preset() {
    let m = hf("gpt2", 1024, 512);
    let a = &m.architecture;
    assert_eq!(a.param_count(), 124_439_808);
    assert!(a.tied_embeddings);
    assert_eq!(a.position, Position::Learned);
    assert_eq!(a.max_positions, 1024, "n_positions sets the learned table");
    assert_eq!(*a, preset("gpt2-124m").architecture);
}

#[test]
fn hf_config_without_seq_len_is_a_usage_error() {
    let out = tessera(&[
        "plan",
        "tests/fixtures/hf/llama3-8b/config.json",
        "specs/clusters/dgx-h100-80g.toml",
        "--global-batch",
        "512",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("--seq-len"), "{stderr}");
    assert!(stderr.contains("fix: pass --seq-len"), "{stderr}");
}
