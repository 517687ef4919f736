//! Mixture-of-experts and MLA keys with bad values, in TOML specs and Hugging Face configs: each
//! is refused naming the file, the line (the config key), the key and a fix, never a panic; and
//! the TOML keys' defaults and counts. The fixtures are tests/moe_specs.rs's.

use std::path::{Path, PathBuf};

use tessera_planner::error::Diagnostic;
use tessera_planner::spec::{load_model, read_model, TrainingOverrides};

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

/// A tiny Llama with `extra` added under [architecture] and `tail` (an `[architecture.mla]`
/// table) after the file's last table.
fn spec(dir: &Path, extra: &str, tail: &str) -> PathBuf {
    let mut base = std::fs::read_to_string(root().join("tests/fixtures/tiny-llama.toml")).unwrap();
    if tail.contains("[architecture.mla]") {
        // MLA projects a key and a value per query head: no grouped-query kv_heads.
        base = base.replace("kv_heads = 2\n", "");
    }
    let text = base.replace("bias = false\n", &format!("bias = false\n{extra}")) + tail;
    let p = dir.join(format!("s{}.toml", text.len()));
    std::fs::write(&p, text).unwrap();
    p
}

fn refused(p: &Path, field: &str, says: &str) -> Diagnostic {
    let e = read_model(p, TrainingOverrides::default()).unwrap_err();
    assert_eq!(e.field, field, "{e}");
    assert!(e.problem.contains(says), "{says:?} not in {e}");
    assert!(e.location.is_some(), "no line: {e}");
    assert!(!e.fix.is_empty(), "{e}");
    e
}

#[test]
fn toml_moe_keys_resolve_with_their_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let p = spec(dir.path(), "experts = 4\nexperts_per_token = 2\n", "");
    let m = read_model(&p, TrainingOverrides::default()).unwrap();
    let moe = m.architecture.moe.clone().unwrap();
    assert_eq!(moe.moe_ffn_hidden, 128, "default: ffn_hidden");
    assert_eq!(moe.router_aux_loss_coef, 0.01);
    assert_eq!((moe.first_dense_layers, moe.moe_layer_frequency), (0, 1));
    assert!(moe.capacity_factor.is_none() && moe.normalize_top_k);
    // 2 layers × (attention 64·(64+2·32) + 64·64, norms 2·64, router 4·64, experts 4·3·64·128)
    // + embedding and head 2·250·64 + final norm 64.
    let layer = 64 * 128 + 64 * 64 + 2 * 64 + 4 * 64 + 4 * 3 * 64 * 128;
    let total = 2 * layer + 2 * 250 * 64 + 64;
    assert_eq!(m.architecture.param_count(), total);
    assert_eq!(
        m.architecture.active_param_count(),
        total - 2 * 2 * 3 * 64 * 128
    );
    let p = spec(
        dir.path(),
        "experts = 4\nexperts_per_token = 1\nmoe_layers = [1]\nshared_experts = 2\nshared_expert_ffn_hidden = 16\nshared_expert_gate = true\ncapacity_factor = 1.25\nqk_norm = true\n",
        "",
    );
    let a = read_model(&p, TrainingOverrides::default())
        .unwrap()
        .architecture;
    let moe = a.moe.clone().unwrap();
    assert_eq!(moe.moe_layers, Some(vec![1]));
    assert_eq!(moe.capacity_factor, Some(1.25));
    assert_eq!(a.moe_layer_count(), 1);
    assert!(a.qk_norm);
    // MoE layers and per-head q/k norms are both planned now: loading it to plan it gives the
    // same model.
    let planned = load_model(&p, TrainingOverrides::default()).unwrap();
    assert_eq!(planned.architecture, a);
}

#[test]
fn toml_moe_keys_refuse_bad_values_with_their_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cases: &[(&str, &str, &str, &str)] = &[
        (
            "experts = 4\nexperts_per_token = 5\n",
            "",
            "architecture.experts_per_token",
            "more than experts (4)",
        ),
        ("experts = 0\n", "", "architecture.experts", "positive"),
        (
            "experts = 4\n",
            "",
            "architecture.experts_per_token",
            "missing",
        ),
        (
            "experts_per_token = 2\n",
            "",
            "architecture.experts_per_token",
            "the model is dense",
        ),
        (
            "experts = 1\nmoe_ffn_hidden = 64\n",
            "",
            "architecture.moe_ffn_hidden",
            "experts = 1",
        ),
        (
            "experts = 4\nexperts_per_token = 2\nmoe_layers = [0, 2]\n",
            "",
            "architecture.moe_layers",
            "layer 2",
        ),
        (
            "experts = 4\nexperts_per_token = 2\nmoe_layers = [1, 0]\n",
            "",
            "architecture.moe_layers",
            "ascending",
        ),
        (
            "experts = 4\nexperts_per_token = 2\nmoe_layers = [-1]\n",
            "",
            "architecture.moe_layers",
            "0 or more",
        ),
        (
            "experts = 4\nexperts_per_token = 2\nmoe_layers = []\n",
            "",
            "architecture.moe_layers",
            "empty",
        ),
        (
            "experts = 4\nexperts_per_token = 2\nmoe_layers = [1]\nfirst_dense_layers = 1\n",
            "",
            "architecture.first_dense_layers",
            "both",
        ),
        (
            "experts = 4\nexperts_per_token = 2\nfirst_dense_layers = 2\n",
            "",
            "architecture.first_dense_layers",
            "leaves no MoE layer",
        ),
        (
            "experts = 4\nexperts_per_token = 2\nmoe_layer_frequency = 0\n",
            "",
            "architecture.moe_layer_frequency",
            "positive",
        ),
        (
            "experts = 4\nexperts_per_token = 2\nshared_expert_gate = true\n",
            "",
            "architecture.shared_expert_gate",
            "has none",
        ),
        (
            "experts = 4\nexperts_per_token = 2\ncapacity_factor = 0\n",
            "",
            "architecture.capacity_factor",
            "positive",
        ),
        (
            "experts = 4\nexperts_per_token = 2\nrouter_aux_loss_coef = -0.1\n",
            "",
            "architecture.router_aux_loss_coef",
            "zero or more",
        ),
        (
            "experts = 4\nexperts_per_token = 2\nrouter_scoring = \"sigmoide\"\n",
            "",
            "architecture.router_scoring",
            "unknown value",
        ),
        (
            "experts = 6\nexperts_per_token = 2\nexpert_groups = 4\n",
            "",
            "architecture.expert_groups",
            "groups of equal size",
        ),
        (
            "experts = 8\nexperts_per_token = 3\nexpert_groups = 4\nexpert_groups_per_token = 1\n",
            "",
            "architecture.experts_per_token",
            "only 2 can be chosen",
        ),
        (
            "",
            "\n[architecture.mla]\nkv_lora_rank = 16\nqk_nope_head_dim = 16\nqk_rope_head_dim = 7\nv_head_dim = 16\n",
            "architecture.mla.qk_rope_head_dim",
            "odd",
        ),
        (
            "",
            "\n[architecture.mla]\nkv_lora_rank = 16\nqk_nope_head_dim = 16\nqk_rope_head_dim = 8\n",
            "architecture.mla.v_head_dim",
            "missing",
        ),
        (
            "head_dim = 16\n",
            "\n[architecture.mla]\nkv_lora_rank = 16\nqk_nope_head_dim = 16\nqk_rope_head_dim = 8\nv_head_dim = 16\n",
            "architecture.head_dim",
            "qk_nope_head_dim + qk_rope_head_dim = 24",
        ),
    ];
    for (extra, tail, field, says) in cases {
        refused(&spec(d, extra, tail), field, says);
    }
}

#[test]
fn toml_mla_counts_like_deepseek() {
    let dir = tempfile::tempdir().unwrap();
    let p = spec(
        dir.path(),
        "",
        "\n[architecture.mla]\nq_lora_rank = 24\nkv_lora_rank = 16\nqk_nope_head_dim = 16\nqk_rope_head_dim = 8\nv_head_dim = 12\n",
    );
    let a = read_model(&p, TrainingOverrides::default())
        .unwrap()
        .architecture;
    assert_eq!(
        (a.head_dim, a.kv_heads),
        (24, 4),
        "MLA: head_dim = 16 + 8, a K/V head per head"
    );
    // q_a 64·24 + norm 24 + q_b 24·4·24, kv_a 64·(16+8) + norm 16 + kv_b 16·4·(16+12), o 4·12·64.
    let attention = 64 * 24 + 24 + 24 * 4 * 24 + 64 * 24 + 16 + 16 * 4 * 28 + 4 * 12 * 64;
    assert_eq!(a.attention_params().total(), attention);
    // MLA is planned now: loading the spec to plan it gives the same model.
    let planned = load_model(&p, TrainingOverrides::default()).unwrap();
    assert_eq!(planned.architecture, a);
}

/// A fixture with `edits` applied (`null` removes a key), written in `dir`.
fn edited(dir: &Path, name: &str, edits: &[(&str, serde_json::Value)]) -> PathBuf {
    let text = std::fs::read_to_string(fixture(name)).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (k, x) in edits {
        match x {
            serde_json::Value::Null => {
                v.as_object_mut().unwrap().remove(*k);
            }
            x => v[*k] = x.clone(),
        }
    }
    let sub = dir.join(format!("{name}-{}", edits.len() * 1000 + text.len() % 997));
    std::fs::create_dir_all(&sub).unwrap();
    let path = sub.join("config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    path
}

/// A fixture, its edits, the config key the refusal names and what it says.
type HfCase<'a> = (
    &'a str,
    &'a [(&'a str, serde_json::Value)],
    &'a str,
    &'a str,
);

#[test]
fn hf_moe_keys_refuse_bad_values_naming_the_key() {
    use serde_json::json;
    let dir = tempfile::tempdir().unwrap();
    let cases: &[HfCase] = &[
        (
            "mixtral-8x7b",
            &[("num_experts_per_tok", json!(9))],
            "num_experts_per_tok",
            "more than experts (8)",
        ),
        (
            "mixtral-8x7b",
            &[("num_local_experts", json!(0))],
            "num_local_experts",
            "positive",
        ),
        (
            "mixtral-8x7b",
            &[
                ("num_local_experts", json!(1)),
                ("num_experts_per_tok", json!(1)),
            ],
            "num_local_experts",
            "at least 2",
        ),
        (
            "mixtral-8x22b",
            &[("router_jitter_noise", json!(0.01))],
            "router_jitter_noise",
            "noise",
        ),
        (
            "mixtral-8x7b",
            &[("router_aux_loss_coef", json!("0.02"))],
            "router_aux_loss_coef",
            "the string",
        ),
        (
            "qwen3-30b-a3b",
            &[("mlp_only_layers", json!((0..48).collect::<Vec<u64>>()))],
            "mlp_only_layers",
            "empty",
        ),
        (
            "qwen3-30b-a3b",
            &[("mlp_only_layers", json!([1.5]))],
            "mlp_only_layers",
            "list of 0-based layer indices",
        ),
        (
            "qwen3-30b-a3b",
            &[("attention_bias", json!(true))],
            "attention_bias",
            "cannot express",
        ),
        (
            "qwen1.5-moe-a2.7b",
            &[("moe_intermediate_size", serde_json::Value::Null)],
            "moe_intermediate_size",
            "missing",
        ),
        (
            "deepseek-v3",
            &[("n_group", json!(3))],
            "n_group",
            "groups of equal size",
        ),
        (
            "deepseek-v3",
            &[("topk_group", json!(1)), ("num_experts_per_tok", json!(33))],
            "num_experts_per_tok",
            "only 32 can be chosen",
        ),
        (
            "deepseek-v3",
            &[("first_k_dense_replace", json!(61))],
            "first_k_dense_replace",
            "leaves no MoE layer",
        ),
        (
            "deepseek-v3",
            &[("moe_layer_freq", json!(2))],
            "moe_layer_freq",
            "transformers",
        ),
        (
            "deepseek-v3",
            &[("scoring_func", json!("softmax"))],
            "scoring_func",
            "sigmoid",
        ),
        (
            "deepseek-v3",
            &[("topk_method", json!("greedy"))],
            "topk_method",
            "noaux_tc",
        ),
        (
            "deepseek-v3",
            &[("qk_rope_head_dim", json!(63))],
            "qk_rope_head_dim",
            "odd",
        ),
        (
            "deepseek-v3",
            &[("num_key_value_heads", json!(8))],
            "num_key_value_heads",
            "per head",
        ),
        (
            "deepseek-v3",
            &[("rope_scaling", json!({"type": "yarn", "factor": 40}))],
            "rope_scaling.type",
            "not implemented",
        ),
        (
            "deepseek-v3",
            &[("model_type", json!("deepseek_v2"))],
            "model_type",
            "DeepSeek-V3",
        ),
        // Types as transformers' @strict config classes check them.
        (
            "mixtral-8x7b",
            &[("num_local_experts", json!(8.0))],
            "num_local_experts",
            "positive integer",
        ),
        (
            "qwen3-30b-a3b",
            &[("norm_topk_prob", json!("true"))],
            "norm_topk_prob",
            "boolean",
        ),
        (
            "deepseek-v3",
            &[("n_shared_experts", json!(-1))],
            "n_shared_experts",
            "0 or a positive integer",
        ),
        (
            "deepseek-v3",
            &[("first_k_dense_replace", json!(3.0))],
            "first_k_dense_replace",
            "0 or a positive integer",
        ),
        (
            "deepseek-v3",
            &[("q_lora_rank", json!("1536"))],
            "q_lora_rank",
            "positive integer",
        ),
    ];
    for (name, edits, key, says) in cases {
        let p = edited(dir.path(), name, edits);
        let e = read_model(&p, over()).unwrap_err();
        assert_eq!(e.field, *key, "{name} {edits:?}: {e}");
        assert!(e.problem.contains(says), "{says:?} not in {e}");
        assert!(!e.fix.is_empty());
    }
    // Qwen's mlp_only_layers makes the listed layers dense; the count drops by their experts.
    let p = edited(
        dir.path(),
        "qwen3-30b-a3b",
        &[("mlp_only_layers", json!([0, 47]))],
    );
    let a = read_model(&p, over()).unwrap().architecture;
    assert_eq!(a.moe_layer_count(), 46);
    assert_eq!(a.moe.as_ref().unwrap().moe_layers.as_ref().unwrap()[0], 1);
    // decoder_sparse_step 2: layers 1, 3, … (transformers' (i + 1) % step == 0).
    let p = edited(
        dir.path(),
        "qwen1.5-moe-a2.7b",
        &[("decoder_sparse_step", json!(2))],
    );
    let a = read_model(&p, over()).unwrap().architecture;
    let m = a.moe.as_ref().unwrap();
    assert!(!m.is_moe_layer(0) && m.is_moe_layer(1) && !m.is_moe_layer(2));
    assert_eq!(a.moe_layer_count(), 12);
}
