//! Mixture-of-experts and MLA specs: the Hugging Face configs of Mixtral 8x7B and 8x22B,
//! Qwen1.5-MoE-A2.7B (qwen2_moe), Qwen3-30B-A3B (qwen3_moe) and DeepSeek-V3 read to the counts of
//! the TOML presets and the published totals, and `tessera plan` refuses an MoE model after
//! reading it, at `experts` (or its config key), with its counts. The keys' bad values are
//! tests/moe_spec_errors.rs's.
//!
//! The fixtures in tests/fixtures/hf/ are the published config.json files: mistralai/
//! Mixtral-8x7B-v0.1, Mixtral-8x22B-v0.1 (the mistral-community conversion of the original
//! release, as quoted in public code), Qwen/Qwen1.5-MoE-A2.7B, Qwen/Qwen3-30B-A3B and
//! deepseek-ai/DeepSeek-V3, the last without its `quantization_config` (the FP8 checkpoint's
//! format, refused like any quantized checkpoint) and `rope_scaling` (the YaRN context extension
//! applied after pre-training, refused like every RoPE scaling but Llama 3.1's). Every count
//! asserted here was computed independently by transformers' classes (scripts/check_moe_counts.py).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tessera_planner::model::Model;
use tessera_planner::spec::{read_model, TrainingOverrides};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str) -> PathBuf {
    root()
        .join("tests/fixtures/hf")
        .join(name)
        .join("config.json")
}

fn over() -> TrainingOverrides {
    TrainingOverrides {
        seq_len: Some(4096),
        global_batch: Some(512),
        ..Default::default()
    }
}

fn hf(name: &str) -> Model {
    read_model(&fixture(name), over()).unwrap_or_else(|e| panic!("{e}"))
}

fn preset(name: &str) -> Model {
    let path = root().join("specs/models").join(format!("{name}.toml"));
    read_model(&path, TrainingOverrides::default()).unwrap_or_else(|e| panic!("{e}"))
}

fn counts(m: &Model) -> (u64, u64) {
    (
        m.architecture.param_count(),
        m.architecture.active_param_count(),
    )
}

#[test]
fn hf_configs_read_to_the_presets_counts() {
    for (config, toml, total, active) in [
        (
            "mixtral-8x7b",
            "mixtral-8x7b",
            46_702_792_704,
            12_879_925_248,
        ),
        (
            "mixtral-8x22b",
            "mixtral-8x22b",
            140_620_634_112,
            39_152_031_744,
        ),
        (
            "deepseek-v3",
            "deepseek-v3",
            671_026_419_200,
            37_552_297_472,
        ),
    ] {
        let (from_hf, from_toml) = (hf(config), preset(toml));
        assert_eq!(counts(&from_hf), (total, active), "{config}");
        assert_eq!(counts(&from_toml), (total, active), "{toml}");
        let (a, b) = (&from_hf.architecture, &from_toml.architecture);
        assert_eq!(
            (a.layers, a.hidden, a.heads, a.kv_heads),
            (b.layers, b.hidden, b.heads, b.kv_heads)
        );
        assert_eq!(
            (a.head_dim, a.ffn_hidden, a.vocab),
            (b.head_dim, b.ffn_hidden, b.vocab)
        );
        assert_eq!(a.mla, b.mla, "{config}");
        assert_eq!(
            (a.rope_theta, a.norm_eps),
            (b.rope_theta, b.norm_eps),
            "{config}"
        );
        let (m, n) = (a.moe.clone().unwrap(), b.moe.clone().unwrap());
        // The auxiliary-loss weight is the one field the presets take from the papers where
        // they differ from the configs (DeepSeek-V3: α = 0.0001 in §4.2, 0.001 in the config).
        let n = tessera_planner::model::Moe {
            router_aux_loss_coef: m.router_aux_loss_coef,
            ..n
        };
        assert_eq!(m, n, "{config}");
    }
}

#[test]
fn qwen_moe_configs_count_exactly() {
    // Qwen1.5-MoE-A2.7B: "14.3B parameters in total and 2.7B activated"; the checkpoint's total.
    // 60 experts of 1408, 4 per token, one gated shared expert of 5632, Q/K/V biases.
    let q2 = hf("qwen1.5-moe-a2.7b");
    assert_eq!(counts(&q2), (14_315_784_192, 2_689_173_504));
    let m = q2.architecture.moe.as_ref().unwrap();
    assert_eq!((m.shared_experts, m.shared_expert_gate), (1, true));
    assert!(q2.architecture.qkv_bias && !m.normalize_top_k);
    // Qwen3-30B-A3B: "30.5B total, 3.3B activated"; per-head q/k norms, no shared expert.
    let q3 = hf("qwen3-30b-a3b");
    assert_eq!(counts(&q3), (30_532_122_624, 3_353_032_704));
    assert!(q3.architecture.qk_norm);
    assert_eq!(q3.architecture.head_dim, 128);
}

#[test]
fn deepseek_v3_layers_router_and_mla_are_read() {
    let a = hf("deepseek-v3").architecture;
    let m = a.moe.as_ref().unwrap();
    assert_eq!(a.moe_layer_count(), 58, "61 layers, the first 3 dense");
    assert!(!m.is_moe_layer(2) && m.is_moe_layer(3) && m.is_moe_layer(60));
    assert_eq!((m.expert_groups, m.expert_groups_per_token), (8, 4));
    assert!(m.router_score_bias && m.normalize_top_k);
    assert_eq!(m.routed_scaling_factor, 2.5);
    assert_eq!(
        a.head_dim, 192,
        "qk_nope_head_dim 128 + qk_rope_head_dim 64"
    );
    let p = a.moe_layer_params().unwrap();
    // Router 256 × 7168 and its 256 score-correction biases are part of every MoE layer.
    assert_eq!(p.expert.total(), 3 * 7168 * 2048);
    let no_bias = {
        let mut b = a.clone();
        b.moe.as_mut().unwrap().router_score_bias = false;
        b.param_count()
    };
    assert_eq!(a.param_count() - no_bias, 58 * 256);
}

/// Dense models are unchanged: no MoE field in their plan.json, and the same counts.
#[test]
fn dense_architectures_serialize_without_the_new_keys() {
    let m = read_model(&fixture("llama3-8b"), over()).unwrap();
    let v = serde_json::to_value(&m.architecture).unwrap();
    for key in ["moe", "mla", "qk_norm"] {
        assert!(v.get(key).is_none(), "{key} in {v}");
    }
    assert_eq!(m.architecture.param_count(), 8_030_261_248);
    assert_eq!(m.architecture.active_param_count(), 8_030_261_248);
}

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(root())
        .args(args)
        .output()
        .expect("the tessera binary runs")
}

/// `tessera plan` reads an MoE model (a preset or an HF config) and plans it with expert
/// parallelism: exit 0, the table's EP column, and a chosen layout with EP above 1 (Mixtral's
/// 8 experts on 8 nodes, DeepSeek-V3's 256 on 128).
#[test]
fn plan_plans_moe_with_expert_parallelism() {
    let cases: [(&[&str], &str, &str); 3] = [
        (
            &["specs/models/mixtral-8x7b.toml"],
            "specs/models/mixtral-8x7b.toml:21:1: `architecture.experts`",
            "46702792704 (46.70B) parameters, 12879925248 (12.88B) active per token",
        ),
        (
            &[
                "tests/fixtures/hf/mixtral-8x7b/config.json",
                "--seq-len",
                "4096",
                "--global-batch",
                "512",
            ],
            "`num_local_experts`",
            "46702792704 (46.70B) parameters",
        ),
        (
            &[
                "tests/fixtures/hf/deepseek-v3/config.json",
                "--seq-len",
                "4096",
                "--global-batch",
                "512",
            ],
            "`n_routed_experts`",
            "in 58 of 61 layers",
        ),
    ];
    for (model, _, _) in cases {
        // DeepSeek-V3's 671B parameters need more than 8 nodes of 80 GiB.
        let nodes = if model[0].contains("deepseek") {
            "128"
        } else {
            "8"
        };
        let mut args = vec![
            "plan",
            model[0],
            "specs/clusters/dgx-h100-80g.toml",
            "--nodes",
            nodes,
        ];
        args.extend(&model[1..]);
        let out = tessera(&args);
        let text = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{err}");
        assert!(text.contains(" ep "), "no EP column: {text}");
        let chosen = text
            .lines()
            .find(|l| l.starts_with("chosen: "))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(chosen.contains("·ep"), "{chosen}");
    }
}

/// `validate` reads an MoE spec and prints both counts.
#[test]
fn validate_prints_the_counts_of_an_moe_spec() {
    let out = tessera(&["validate", "specs/models/mixtral-8x7b.toml"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("46702792704 parameters, 12879925248 active per token"),
        "{text}"
    );
    assert!(!text.contains("refuses"), "{text}");
    let out = tessera(&["validate", "specs/models/llama3-8b.toml"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.ends_with("model llama3-8b: 8030261248 parameters\n"),
        "{text}"
    );
}
