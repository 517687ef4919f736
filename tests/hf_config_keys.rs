//! Every key of a model that changes the computation is carried into plan.json (and from there
//! into the runtime), or refused by `plan` with exit 2 naming the key: RoPE θ and Llama 3.1's
//! `llama3` scaling, the norm ε, and sliding-window attention (accepted only where the window
//! covers the sequence, which is then full causal attention). On the published config.json of
//! Llama 3 8B, Llama 3.1 8B, Mistral 7B v0.1 and v0.3, Qwen2 7B and GPT-2 (tests/fixtures/hf/),
//! and on TOML specs.

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

fn fixture(family: &str) -> PathBuf {
    root()
        .join("tests/fixtures/hf")
        .join(family)
        .join("config.json")
}

/// A fixture with `edits` applied (`null` removes a key) in `dir`.
fn edited(dir: &Path, family: &str, edits: &[(&str, Value)]) -> PathBuf {
    let mut v: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(family)).unwrap()).unwrap();
    for (k, x) in edits {
        match x {
            Value::Null => {
                v.as_object_mut().unwrap().remove(*k);
            }
            x => v[*k] = x.clone(),
        }
    }
    let sub = dir.join(family);
    std::fs::create_dir_all(&sub).unwrap();
    let path = sub.join("config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    path
}

fn plan(model: &Path, seq_len: u64) -> Output {
    tessera(&[
        "plan",
        model.to_str().unwrap(),
        "specs/clusters/dgx-h100-80g.toml",
        "--seq-len",
        &seq_len.to_string(),
        "--global-batch",
        "512",
        "--format",
        "json",
    ])
}

/// plan.json's `job.model.architecture` of an accepted model.
fn architecture(model: &Path, seq_len: u64) -> Value {
    let out = plan(model, seq_len);
    assert!(
        out.status.success(),
        "{} at {seq_len}: {}",
        model.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["job"]["model"]["architecture"].clone()
}

/// `plan` exits 2 naming each of `named` and a fix.
fn refused(model: &Path, seq_len: u64, named: &[&str]) {
    let out = plan(model, seq_len);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{} at {seq_len} was accepted",
        model.display()
    );
    assert!(!err.contains("panicked"), "{err}");
    for n in named.iter().chain(&["fix:"]) {
        assert!(err.contains(n), "no {n} in:\n{err}");
    }
}

#[test]
fn rope_theta_and_norm_eps_reach_the_plan() {
    let a = architecture(&fixture("llama3-8b"), 8192);
    assert_eq!(a["rope_theta"], 500000.0);
    assert_eq!(a["norm_eps"], 1e-5);
    assert!(a.get("rope_scaling").is_none(), "rope_scaling null: none");
    assert!(a.get("sliding_window").is_none());
    let a = architecture(&fixture("qwen2-7b"), 8192);
    assert_eq!(a["rope_theta"], 1e6);
    assert_eq!(a["norm_eps"], 1e-6);
    // use_sliding_window false: full attention at any length.
    assert!(a.get("sliding_window").is_none(), "{a}");
    let a = architecture(&fixture("gpt2"), 1024);
    assert_eq!(a["norm_eps"], 1e-5, "layer_norm_epsilon");
    // LlamaConfig's rms_norm_eps defaults to 1e-6, its rope_theta to 10000.
    let dir = tempfile::tempdir().unwrap();
    let p = edited(
        dir.path(),
        "llama3-8b",
        &[("rms_norm_eps", Value::Null), ("rope_theta", Value::Null)],
    );
    let a = architecture(&p, 8192);
    assert_eq!(a["norm_eps"], 1e-6);
    assert_eq!(a["rope_theta"], 10000.0);
    // transformers 5's rope_parameters carries θ as well.
    let p = edited(
        dir.path(),
        "mistral-7b-v0.3",
        &[
            ("rope_theta", Value::Null),
            (
                "rope_parameters",
                json!({"rope_type": "default", "rope_theta": 250000.0}),
            ),
        ],
    );
    assert_eq!(architecture(&p, 4096)["rope_theta"], 250000.0);
}

#[test]
fn llama3_rope_scaling_reaches_the_plan() {
    let a = architecture(&fixture("llama3.1-8b"), 8192);
    assert_eq!(a["rope_theta"], 500000.0);
    assert_eq!(
        a["rope_scaling"],
        json!({
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_positions": 8192
        })
    );
}

#[test]
fn other_rope_scaling_types_are_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    for kind in ["linear", "dynamic", "yarn", "longrope"] {
        let p = edited(
            dir.path(),
            "llama3-8b",
            &[("rope_scaling", json!({"rope_type": kind, "factor": 4.0}))],
        );
        refused(&p, 8192, &["rope_scaling", kind, "not implemented"]);
    }
    // The legacy spelling `type`.
    let p = edited(
        dir.path(),
        "qwen2-7b",
        &[("rope_scaling", json!({"type": "yarn", "factor": 4.0}))],
    );
    refused(&p, 4096, &["rope_scaling", "yarn"]);
    let p = edited(
        dir.path(),
        "llama3-8b",
        &[("partial_rotary_factor", json!(0.5))],
    );
    refused(&p, 8192, &["partial_rotary_factor", "0.5"]);
}

#[test]
fn sliding_window_narrower_than_the_sequence_is_refused() {
    // Mistral 7B v0.1: a 4096-position window.
    refused(
        &fixture("mistral-7b"),
        8192,
        &["sliding_window", "4096", "8192", "--seq-len 4096"],
    );
    assert_eq!(
        architecture(&fixture("mistral-7b"), 4096)["sliding_window"],
        4096
    );
    // v0.3: sliding_window null, full attention.
    let a = architecture(&fixture("mistral-7b-v0.3"), 8192);
    assert!(a.get("sliding_window").is_none(), "{a}");
    assert_eq!(a["rope_theta"], 1e6);
    // MistralConfig's default window is 4096 when the key is absent.
    let dir = tempfile::tempdir().unwrap();
    let p = edited(
        dir.path(),
        "mistral-7b-v0.3",
        &[("sliding_window", Value::Null)],
    );
    refused(&p, 8192, &["sliding_window", "4096"]);
    // Qwen2 with use_sliding_window: the layers from max_window_layers on slide.
    let p = edited(
        dir.path(),
        "qwen2-7b",
        &[
            ("use_sliding_window", json!(true)),
            ("sliding_window", json!(4096)),
            ("max_window_layers", json!(14)),
        ],
    );
    refused(&p, 8192, &["sliding_window", "4096"]);
    assert_eq!(architecture(&p, 4096)["sliding_window"], 4096);
    // ... and none slides when max_window_layers covers every layer (28 of 28).
    let p = edited(
        dir.path(),
        "qwen2-7b",
        &[
            ("use_sliding_window", json!(true)),
            ("sliding_window", json!(4096)),
        ],
    );
    assert!(architecture(&p, 8192).get("sliding_window").is_none());
}

/// A fixture, its edits, and what the refusal must name.
type Case<'a> = (&'a str, &'a [(&'a str, Value)], &'a [&'a str]);

#[test]
fn keys_that_change_the_computation_are_refused_or_read() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[Case] = &[
        // GPT-2's exact (erf) GELU is not the runtime's tanh approximation.
        (
            "gpt2",
            &[("activation_function", json!("gelu"))],
            &["activation_function", "gelu_new"],
        ),
        (
            "gpt2",
            &[("scale_attn_by_inverse_layer_idx", json!(true))],
            &["scale_attn_by_inverse_layer_idx"],
        ),
        (
            "llama3-8b",
            &[("attn_logit_softcapping", json!(50.0))],
            &["attn_logit_softcapping", "soft-caps"],
        ),
        (
            "qwen2-7b",
            &[("final_logit_softcapping", json!(30.0))],
            &["final_logit_softcapping"],
        ),
        (
            "mistral-7b-v0.3",
            &[("some_new_switch", json!(true))],
            &["some_new_switch", "unknown key"],
        ),
        // LlamaForCausalLM's attention_bias biases o_proj too: only with mlp_bias is it
        // Tessera's `bias`.
        (
            "llama3-8b",
            &[("attention_bias", json!(true))],
            &["attention_bias", "mlp_bias"],
        ),
        (
            "llama3-8b",
            &[("mlp_bias", json!(true))],
            &["mlp_bias", "attention_bias"],
        ),
        (
            "llama3-8b",
            &[("rope_theta", json!("1e6"))],
            &["rope_theta", "number"],
        ),
        (
            "qwen2-7b",
            &[("rms_norm_eps", json!(0))],
            &["rms_norm_eps", "positive"],
        ),
    ];
    for (family, edits, named) in cases {
        let p = edited(dir.path(), family, edits);
        let seq = if *family == "gpt2" { 1024 } else { 4096 };
        refused(&p, seq, named);
    }
    let p = edited(
        dir.path(),
        "llama3-8b",
        &[("attention_bias", json!(true)), ("mlp_bias", json!(true))],
    );
    let a = architecture(&p, 8192);
    assert_eq!(
        (a["bias"].clone(), a["qkv_bias"].clone()),
        (json!(true), json!(true))
    );
    // gelu_pytorch_tanh is the same function as gelu_new.
    let p = edited(
        dir.path(),
        "gpt2",
        &[("activation_function", json!("gelu_pytorch_tanh"))],
    );
    architecture(&p, 1024);
}

#[test]
fn toml_specs_carry_and_check_the_keys() {
    let dir = tempfile::tempdir().unwrap();
    let base = std::fs::read_to_string(root().join("tests/fixtures/tiny-llama.toml")).unwrap();
    let write = |name: &str, extra: &str| {
        let text = base.replace("bias = false\n", &format!("bias = false\n{extra}"));
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let p = write(
        "a.toml",
        "rope_theta = 1e6\nnorm_eps = 1e-6\nsliding_window = 64\nrope_scaling = { rope_type = \"llama3\", factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_positions = 16 }\n",
    );
    let a = architecture(&p, 32);
    assert_eq!(a["rope_theta"], 1e6);
    assert_eq!(a["norm_eps"], 1e-6);
    assert_eq!(a["sliding_window"], 64);
    assert_eq!(a["rope_scaling"]["original_max_positions"], 16);
    refused(&p, 128, &["architecture.sliding_window", "--seq-len 64"]);
    let p = write(
        "b.toml",
        "rope_scaling = { rope_type = \"yarn\", factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_positions = 16 }\n",
    );
    refused(
        &p,
        32,
        &["architecture.rope_scaling.rope_type", "yarn", "llama3"],
    );
    let p = write(
        "c.toml",
        "rope_scaling = { rope_type = \"llama3\", factor = 8.0, low_freq_factor = 4.0, high_freq_factor = 1.0, original_max_positions = 16 }\n",
    );
    refused(&p, 32, &["high_freq_factor"]);
    // Defaults: θ 10000, ε 1e-5 (the values the runtime used before the keys existed).
    let a = architecture(&root().join("tests/fixtures/tiny-llama.toml"), 32);
    assert_eq!(a["rope_theta"], 10000.0);
    assert_eq!(a["norm_eps"], 1e-5);
    // A learned-position model has no RoPE to set.
    let gpt = std::fs::read_to_string(root().join("specs/models/tiny.toml")).unwrap();
    let text = gpt.replace("[architecture]\n", "[architecture]\nrope_theta = 1e6\n");
    let p = dir.path().join("gpt.toml");
    std::fs::write(&p, text).unwrap();
    refused(&p, 32, &["architecture.rope_theta", "learned"]);
}
