//! Presets: parameter counts against the published ones; cluster presets against their
//! datasheets, and every GPU cluster preset planning a small model.

use std::path::Path;

mod common;

use tessera_planner::spec::{
    load_cluster, load_model, read_model, ClusterOverrides, DeviceKind, TrainingOverrides,
};

fn preset(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("specs/models")
        .join(format!("{name}.toml"))
}

fn cluster_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/clusters")
}

fn params(name: &str) -> u64 {
    load_model(&preset(name), TrainingOverrides::default())
        .unwrap_or_else(|e| panic!("{e}"))
        .architecture
        .param_count()
}

/// Total and active parameters of a preset read for its counts (an MoE model is not planned).
fn counts(name: &str) -> (u64, u64) {
    let a = read_model(&preset(name), TrainingOverrides::default())
        .unwrap_or_else(|e| panic!("{e}"))
        .architecture;
    (a.param_count(), a.active_param_count())
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

#[test]
fn mistral_and_qwen2_presets_match_the_published_counts() {
    // The totals of the Hugging Face safetensors indexes of mistralai/Mistral-7B-v0.1 and
    // Qwen/Qwen2-7B; the same counts as the HF configs in tests/fixtures (tests/hf_config.rs).
    assert_eq!(params("mistral-7b"), 7_241_732_096);
    assert_eq!(params("qwen2-7b"), 7_615_616_512);
}

#[test]
fn gpt3_family_within_the_papers_rounding() {
    // Brown et al. 2020, Table 2.1, "n_params": 2.7B and 6.7B, one decimal.
    assert!((params("gpt3-2.7b") as f64 / 1e9 - 2.7).abs() < 0.05);
    assert!((params("gpt3-6.7b") as f64 / 1e9 - 6.7).abs() < 0.05);
    // "13.0B": the table's d_model 5140 is not its 40 heads × 128, so no exact count follows
    // from it; with attention width 40 × 128 and d_model 5140 the count is 12.94B, 0.5% under.
    let b13 = params("gpt3-13b") as f64 / 1e9;
    assert!((b13 - 13.0).abs() / 13.0 < 0.01, "{b13}");
}

/// The MoE presets' totals are the published ones; every total and active count was computed
/// independently by transformers' own classes on the meta device from the HF configs
/// (scripts/check_moe_counts.py, transformers 5.24.0): parameters plus persistent buffers (what
/// the checkpoints hold), and for the active count each MoE layer's routed experts cut to the
/// top-k. Active counts include the embedding and the output layer, as Mistral's 12.9B and
/// DeepSeek's 36.7B ("including 0.9B for Embedding and 0.9B for the output Head") do.
#[test]
fn moe_presets_match_the_published_counts() {
    // HF mistralai/Mixtral-8x7B-v0.1: 46,702,792,704 in the checkpoint; "12.9B active".
    assert_eq!(counts("mixtral-8x7b"), (46_702_792_704, 12_879_925_248));
    // HF mistral-community/Mixtral-8x22B-v0.1 (32000-token vocabulary): 140,620,634,112;
    // Mistral: "39B active parameters out of 141B".
    assert_eq!(counts("mixtral-8x22b"), (140_620_634_112, 39_152_031_744));
    // DeepSeek-V3 Technical Report: "671B total parameters with 37B activated for each token"
    // (the main model; the HF checkpoint's MTP module, 14B more, is not counted).
    assert_eq!(counts("deepseek-v3"), (671_026_419_200, 37_552_297_472));
    // Qwen3 (arXiv 2505.09388 Table 2): "30.5B total, 3.3B activated" and "235B total, 22B
    // activated"; transformers 5.23's Qwen3MoeForCausalLM on the meta device from the HF
    // configs' values counts 30,532,122,624 / 3,353,032,704 and 235,093,634,560 /
    // 22,190,763,520 (experts cut to 8 of 128).
    assert_eq!(counts("qwen3-30b-a3b"), (30_532_122_624, 3_353_032_704));
    assert_eq!(counts("qwen3-235b-a22b"), (235_093_634_560, 22_190_763_520));
}

#[test]
fn dense_presets_have_no_idle_parameters() {
    for name in ["llama3-8b", "gpt2-124m", "qwen2-7b"] {
        let (total, active) = counts(name);
        assert_eq!(total, active, "{name}");
        assert_eq!(total, params(name), "{name}");
    }
}

/// The MoE presets load to plan (their counts above): `Model::plannable` refuses none of them.
#[test]
fn moe_presets_load_to_plan() {
    for name in [
        "mixtral-8x7b",
        "mixtral-8x22b",
        "deepseek-v3",
        "qwen3-30b-a3b",
        "qwen3-235b-a22b",
    ] {
        let m = load_model(&preset(name), TrainingOverrides::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(m.architecture.moe.is_some(), "{name}");
    }
}

/// The single-node presets for the GPUs fine-tuners own hold their datasheets' memory and
/// dense bf16 peak. The expected values are the published figures, written here from the
/// sources named, not read from the presets.
#[test]
fn finetuning_cluster_presets_match_their_datasheets() {
    let table: [(&str, f64, f64); 6] = [
        // NVIDIA Ada GPU Architecture whitepaper, Appendix A (GeForce RTX 4090): 24 GB GDDR6X;
        // "Peak BF16 Tensor TFLOPS with FP32 Accumulate 165.2/330.4" (dense/sparse).
        ("rtx4090-24g", 24.0, 165.2),
        // NVIDIA publishes no A10G datasheet; Baseten's A10 vs A10G spec sheet
        // (baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference): 24 GB GDDR6, BF16 70 TFLOPS.
        ("a10g-24g", 24.0, 70.0),
        // NVIDIA L4 datasheet: 24 GB GDDR6; BF16 Tensor Core 242 TFLOPS with sparsity, 121 dense.
        ("l4-24g", 24.0, 121.0),
        // NVIDIA L40S datasheet: 48 GB GDDR6; "BFLOAT16 Tensor Core TFLOPS 362.05 | 733*"
        // (* with sparsity).
        ("l40s-48g", 48.0, 362.05),
        // NVIDIA A100 datasheet, A100 40GB SXM: 40 GB HBM2; "BFLOAT16 Tensor Core 312 TFLOPS |
        // 624 TFLOPS*" (* with sparsity).
        ("a100-40g", 40.0, 312.0),
        // NVIDIA H100 PCIe: 80 GB; BF16 Tensor Core 1,513 TFLOPS with sparsity, 756 dense
        // (stas00/ml-engineering compute/accelerator/README.md; ../shared/groundtruth s6).
        ("h100-pcie-80g", 80.0, 756.0),
    ];
    for (name, memory_gib, peak_tflops) in table {
        let path = cluster_dir().join(format!("{name}.toml"));
        let c = load_cluster(&path, ClusterOverrides::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(c.device.memory_gib, memory_gib, "{name}: memory_gib");
        assert_eq!(c.device.peak_tflops, peak_tflops, "{name}: peak_tflops");
        assert!(
            c.calibrated,
            "{name}: a GPU preset carries its [calibration]"
        );
    }
}

/// Every GPU cluster preset in specs/clusters/ plans GPT-2 124M on one of its devices, with its
/// own calibration: a preset added to the folder is covered without being listed here.
#[test]
fn every_gpu_cluster_preset_plans_gpt2_on_one_device() {
    let model = common::s(&preset("gpt2-124m"));
    let mut planned = Vec::new();
    for entry in std::fs::read_dir(cluster_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let c = load_cluster(&path, ClusterOverrides::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        if c.device.kind != DeviceKind::Gpu {
            continue;
        }
        let cluster = common::s(&path);
        let out = common::run(&[
            "plan",
            &model,
            &cluster,
            "--devices",
            "1",
            "--format",
            "json",
        ]);
        assert_eq!(out.code, Some(0), "{name}: {}", out.stderr);
        let plan: serde_json::Value = serde_json::from_str(&out.stdout).expect("plan.json");
        assert_eq!(plan["feasible"], true, "{name}");
        let step = plan["predicted"]["step_time_s"].as_f64().unwrap();
        assert!(step > 0.0 && step.is_finite(), "{name}: step {step}");
        let caveats = plan["predicted"]["caveats"].to_string();
        assert!(
            !caveats.contains("uncalibrated_cluster"),
            "{name}: {caveats}"
        );
        planned.push(name);
    }
    for name in [
        "rtx4090-24g",
        "a10g-24g",
        "l4-24g",
        "l40s-48g",
        "a100-40g",
        "h100-pcie-80g",
    ] {
        assert!(
            planned.iter().any(|p| p == name),
            "{name} not planned: {planned:?}"
        );
    }
}
