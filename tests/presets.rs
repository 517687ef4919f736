//! Presets: parameter counts against the published ones.

use std::path::Path;

use tessera_planner::spec::{load_model, TrainingOverrides};

fn params(name: &str) -> u64 {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("specs/models")
        .join(format!("{name}.toml"));
    load_model(&path, TrainingOverrides::default())
        .unwrap_or_else(|e| panic!("{e}"))
        .architecture
        .param_count()
}

#[test]
fn llama_parameter_counts_are_exact() {
    // Meta's published counts (Hugging Face model cards / safetensors index totals).
    assert_eq!(params("llama3-8b"), 8_030_261_248);
    assert_eq!(params("llama3-70b"), 70_553_706_496);
    assert_eq!(params("llama3.1-405b"), 405_853_388_800);
}

#[test]
fn gpt_parameter_counts() {
    // GPT-2 small with its 50257-token vocabulary and 1024 positions.
    assert_eq!(params("gpt2-124m"), 124_439_808);
    // GPT-3 175B as the paper rounds it (Brown et al. 2020: 175.0B; Megatron's padded vocab).
    assert!((params("gpt3-175b") as f64 / 1e9 - 175.0).abs() < 0.5);
}

#[test]
fn megatron_table_1_within_its_rounding() {
    // Narayanan et al. SC'21 Table 1, "Number of parameters (billion)".
    let table = [
        ("1.7b", 1.7),
        ("3.6b", 3.6),
        ("7.5b", 7.5),
        ("18b", 18.4),
        ("39b", 39.1),
        ("76b", 76.1),
        ("146b", 145.6),
        ("310b", 310.1),
        ("530b", 529.6),
        ("1t", 1008.0),
    ];
    for (name, billions) in table {
        let got = params(&format!("megatron-{name}")) as f64 / 1e9;
        // One decimal printed: within half a unit of the last digit, plus the final LayerNorm
        // that the paper's Eq. 2 leaves out.
        assert!(
            (got - billions).abs() <= 0.05 + 1e-6,
            "megatron-{name}: {got:.3}B vs {billions}B"
        );
    }
}
