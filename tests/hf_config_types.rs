//! Hugging Face `config.json` values: every key read is type-checked as transformers' own
//! config classes check it (`@strict` dataclasses: an `int` is an integer, not a float, a
//! string or a boolean; a `bool` is `true` or `false`), and the shapes are refused where the
//! model classes refuse them (GPT2Attention: "embed_dim must be divisible by num_heads";
//! LlamaConfig: hidden_size a multiple of num_attention_heads). Each refusal names the file,
//! the key, the value and the fix, and exits 2.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{json, Value};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
        .current_dir(root())
        .args(args)
        .output()
        .expect("the tessera binary runs")
}

/// A fixture's config.json with `edits` applied (`null` removes a key), in `dir`.
fn config(dir: &Path, family: &str, edits: &[(&str, Value)]) -> PathBuf {
    let text = std::fs::read_to_string(
        root()
            .join("tests/fixtures/hf")
            .join(family)
            .join("config.json"),
    )
    .unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    for (k, x) in edits {
        match x {
            Value::Null => {
                v.as_object_mut().unwrap().remove(*k);
            }
            x => v[*k] = x.clone(),
        }
    }
    let sub = dir.join(format!("{family}-{}", edits.len()));
    std::fs::create_dir_all(&sub).unwrap();
    let path = sub.join("config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    path
}

fn plan(path: &Path) -> Output {
    tessera(&[
        "plan",
        path.to_str().unwrap(),
        "specs/clusters/dgx-h100-80g.toml",
        "--seq-len",
        "1024",
        "--global-batch",
        "512",
        "--format",
        "json",
    ])
}

/// `plan` and `validate` both refuse the config, naming the file, each of `named`, and a fix.
fn refused(family: &str, edits: &[(&str, Value)], named: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let path = config(dir.path(), family, edits);
    for out in [plan(&path), tessera(&["validate", path.to_str().unwrap()])] {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{family} {edits:?} was accepted:\n{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
        for n in named
            .iter()
            .copied()
            .chain([path.to_str().unwrap(), "fix:"])
        {
            assert!(err.contains(n), "{family} {edits:?}: no {n} in:\n{err}");
        }
    }
}

/// `plan` accepts the config; its plan.json.
fn accepted(family: &str, edits: &[(&str, Value)]) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let out = plan(&config(dir.path(), family, edits));
    assert!(
        out.status.success(),
        "{family} {edits:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_string_is_not_a_boolean() {
    for family in ["llama3-8b", "mistral-7b", "qwen2-7b", "gpt2"] {
        refused(
            family,
            &[("tie_word_embeddings", json!("true"))],
            &["`tie_word_embeddings`", "boolean", "\"true\""],
        );
        refused(
            family,
            &[("tie_word_embeddings", json!(1))],
            &["`tie_word_embeddings`", "boolean"],
        );
    }
    for key in ["mlp_bias", "attention_bias"] {
        refused(
            "llama3-8b",
            &[(key, json!("false"))],
            &[&format!("`{key}`"), "boolean", "\"false\""],
        );
    }
}

#[test]
fn integers_are_integers() {
    let llama_keys = [
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "intermediate_size",
        "vocab_size",
    ];
    for key in llama_keys {
        for bad in [json!(4096.0), json!("32"), json!(true), json!(-8), json!(0)] {
            refused(
                "llama3-8b",
                &[(key, bad.clone())],
                &[&format!("`{key}`"), "integer"],
            );
        }
    }
    refused(
        "llama3-8b",
        &[("head_dim", json!(128.5))],
        &["`head_dim`", "integer", "128.5"],
    );
    refused("llama3-8b", &[("head_dim", json!(0))], &["`head_dim`"]);
    for key in [
        "n_embd",
        "n_head",
        "n_layer",
        "n_positions",
        "vocab_size",
        "n_inner",
    ] {
        refused(
            "gpt2",
            &[(key, json!("768"))],
            &[&format!("`{key}`"), "integer", "\"768\""],
        );
        refused(
            "gpt2",
            &[(key, json!(768.5))],
            &[&format!("`{key}`"), "integer"],
        );
    }
    refused(
        "llama3-8b",
        &[("hidden_act", json!(5))],
        &["`hidden_act`", "string"],
    );
}

#[test]
fn shapes_are_refused_where_transformers_refuses_them() {
    // GPT2Attention: "`embed_dim` must be divisible by num_heads".
    refused(
        "gpt2",
        &[("n_embd", json!(770))],
        &["`n_embd`", "770", "n_head", "12", "divisible"],
    );
    // Every KV head serves a whole group of query heads (repeat_kv).
    for family in ["llama3-8b", "mistral-7b", "qwen2-7b"] {
        refused(
            family,
            &[("num_key_value_heads", json!(5))],
            &["`num_key_value_heads`", "5"],
        );
    }
    // Without head_dim, the head size is hidden_size / num_attention_heads.
    for family in ["llama3-8b", "mistral-7b", "qwen2-7b"] {
        refused(
            family,
            &[("hidden_size", json!(4100))],
            &["hidden_size", "4100", "num_attention_heads", "divisible"],
        );
    }
    // LlamaConfig.validate_architecture refuses it even with head_dim given.
    refused(
        "llama3-8b",
        &[("hidden_size", json!(4100)), ("head_dim", json!(128))],
        &["hidden_size", "4100"],
    );
    // Mistral reads head_dim as given.
    let p = accepted(
        "mistral-7b",
        &[("hidden_size", json!(4100)), ("head_dim", json!(128))],
    );
    assert_eq!(p["job"]["model"]["architecture"]["head_dim"], 128);
    // Two spellings of one GPT-2 key that disagree.
    refused(
        "gpt2",
        &[("num_attention_heads", json!(16))],
        &["n_head", "num_attention_heads"],
    );
}

#[test]
fn keys_a_family_does_not_read_change_nothing() {
    // MistralAttention and Qwen2's MLP have no biases whatever the config says (only
    // LlamaConfig has mlp_bias and attention_bias).
    let plain = accepted("mistral-7b", &[]);
    let with = accepted(
        "mistral-7b",
        &[("attention_bias", json!(true)), ("mlp_bias", json!(true))],
    );
    assert_eq!(plain["job"]["parameters"], with["job"]["parameters"]);
    let plain = accepted("qwen2-7b", &[]);
    let with = accepted("qwen2-7b", &[("mlp_bias", json!(true))]);
    assert_eq!(plain["job"]["parameters"], with["job"]["parameters"]);
}

#[test]
fn absent_keys_take_the_classes_defaults() {
    // MistralConfig.num_key_value_heads defaults to 8, Qwen2Config's to 32, LlamaConfig's to
    // num_attention_heads.
    let p = accepted("mistral-7b", &[("num_key_value_heads", Value::Null)]);
    assert_eq!(p["job"]["model"]["architecture"]["kv_heads"], 8);
    let p = accepted("llama3-8b", &[("num_key_value_heads", Value::Null)]);
    assert_eq!(p["job"]["model"]["architecture"]["kv_heads"], 32);
    // Qwen2-7B has 28 heads: the default 32 KV heads cannot serve them.
    refused(
        "qwen2-7b",
        &[("num_key_value_heads", Value::Null)],
        &["`num_key_value_heads`", "32", "default"],
    );
}

#[test]
fn layer_indices_past_the_layer_count_are_refused() {
    // Qwen3-30B-A3B has 48 layers, numbered 0 … 47.
    refused(
        "qwen3-30b-a3b",
        &[("mlp_only_layers", json!([0, 48]))],
        &["mlp_only_layers", "layer 48", "48 layers", "0 … 47"],
    );
    // Qwen2 7B has 28: with use_sliding_window, max_window_layers names a layer.
    refused(
        "qwen2-7b",
        &[
            ("use_sliding_window", json!(true)),
            ("max_window_layers", json!(40)),
        ],
        &["max_window_layers", "40", "28 layers"],
    );
    accepted("qwen3-30b-a3b", &[("mlp_only_layers", json!([0, 47]))]);
    accepted(
        "qwen2-7b",
        &[
            ("use_sliding_window", json!(true)),
            ("max_window_layers", json!(28)),
        ],
    );
}

#[test]
fn a_model_type_that_contradicts_architectures_is_refused() {
    refused(
        "gpt2",
        &[("architectures", json!(["LlamaForCausalLM"]))],
        &[
            "architectures",
            "LlamaForCausalLM",
            "model_type",
            "\"gpt2\"",
            "GPT2LMHeadModel",
        ],
    );
    refused(
        "qwen2-7b",
        &[("architectures", json!(["Qwen2MoeForCausalLM"]))],
        &["architectures", "Qwen2MoeForCausalLM", "\"qwen2\""],
    );
    refused(
        "llama3-8b",
        &[("architectures", json!("LlamaForCausalLM"))],
        &["architectures", "must be a list"],
    );
    accepted(
        "gpt2",
        &[(
            "architectures",
            json!(["GPT2LMHeadModel", "GPT2DoubleHeadsModel"]),
        )],
    );
    accepted(
        "llama3-8b",
        &[("architectures", json!(["LlamaForSequenceClassification"]))],
    );
}
