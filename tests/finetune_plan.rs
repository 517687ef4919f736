//! Fine-tuning plans: trainable and frozen parameter counts of LoRA jobs against PEFT's own count
//! (tests/fixtures/peft-counts.toml, produced by scripts/peft_counts.py with transformers and
//! peft: the command and versions are at the top of that file), and the fine-tuning keys'
//! refusals.

mod common;

use std::path::Path;

use tessera_planner::finetune::{self, Method};
use tessera_planner::spec::{load_model, FineTuneOverrides, TrainingOverrides};

struct Case {
    fixture: String,
    rank: u64,
    targets: Vec<String>,
    peft_target_modules: Vec<String>,
    trainable: u64,
    frozen: u64,
}

fn cases(text: &str) -> Vec<Case> {
    let v: toml::Value = toml::from_str(text).unwrap();
    let strings = |c: &toml::Value, k: &str| -> Vec<String> {
        c[k].as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect()
    };
    v["case"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            fixture: c["fixture"].as_str().unwrap().to_string(),
            rank: c["rank"].as_integer().unwrap() as u64,
            targets: strings(c, "targets"),
            peft_target_modules: strings(c, "peft_target_modules"),
            trainable: c["trainable"].as_integer().unwrap() as u64,
            frozen: c["frozen"].as_integer().unwrap() as u64,
        })
        .collect()
}

#[test]
fn lora_counts_equal_pefts() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("tests/fixtures/peft-counts.toml")).unwrap();
    let mut seen = Vec::new();
    for c in &cases(&text) {
        let config = root
            .join("tests/fixtures/hf")
            .join(&c.fixture)
            .join("config.json");
        let mut model = load_model(
            &config,
            TrainingOverrides {
                seq_len: Some(512),
                global_batch: Some(8),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        FineTuneOverrides {
            method: Some(Method::Lora),
            lora_rank: Some(c.rank),
            // PEFT's `all-linear` is our `all`; its defaults (no target_modules) are ours when
            // no targets are given.
            lora_targets: match c.targets.join(",").as_str() {
                "default" => None,
                "all-linear" => Some("all".into()),
                t => Some(t.into()),
            },
            ..Default::default()
        }
        .apply(&mut model)
        .unwrap_or_else(|e| panic!("{}: {e}", c.fixture));
        let lora = model.lora.as_ref().unwrap();
        let counts = finetune::counts(&model.architecture, model.training.method, Some(lora));
        let what = format!("{} r={} {:?}", c.fixture, c.rank, c.targets);
        assert_eq!(counts.trainable, c.trainable, "trainable, {what}");
        assert_eq!(counts.frozen, c.frozen, "frozen, {what}");
        // PEFT's own resolution of `all-linear` and of its defaults names modules its way
        // (GPT-2's one `c_proj` for both projections): names are compared where we name them.
        if matches!(c.targets[0].as_str(), "all-linear" | "default") {
            seen.push(c.fixture.clone());
            continue;
        }
        let mut names: Vec<String> = lora
            .peft_modules(&model.architecture)
            .unwrap()
            .into_iter()
            .map(String::from)
            .collect();
        names.sort();
        let mut want = c.peft_target_modules.clone();
        want.sort();
        assert_eq!(names, want, "PEFT module names, {what}");
        seen.push(c.fixture.clone());
    }
    // The three at r = 16 on every linear, and GPT-2's fused projection.
    for name in ["llama3-8b", "qwen2-7b", "mistral-7b", "gpt2"] {
        assert!(
            seen.iter().any(|s| s == name),
            "{name} missing from the fixture"
        );
    }
}

fn plan(args: &[&str]) -> std::process::Output {
    common::bin().arg("plan").args(args).output().unwrap()
}

/// `plan` with `args` must refuse with exit 2 and no panic; its stderr.
fn plan_refused(args: &[&str]) -> String {
    let out = plan(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn a_target_the_family_lacks_is_refused_naming_the_family() {
    let err = plan_refused(&[
        "specs/models/gpt2-124m.toml",
        "specs/clusters/dgx-h100-80g.toml",
        "--devices",
        "1",
        "--method",
        "lora",
        "--lora-targets",
        "qkv,gate",
    ]);
    assert!(err.contains("--lora-targets"), "{err}");
    assert!(
        err.contains("gpt family") && err.contains("no gate"),
        "{err}"
    );
    assert!(err.contains("qkv,o,up,down"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn lora_flags_without_an_adapter_method_are_refused() {
    let err = plan_refused(&[
        "specs/models/gpt2-124m.toml",
        "specs/clusters/dgx-h100-80g.toml",
        "--devices",
        "1",
        "--lora-rank",
        "16",
    ]);
    assert!(
        err.contains("--lora-rank") && err.contains("--method lora"),
        "{err}"
    );
}

#[test]
fn a_lora_table_under_a_full_method_is_refused_at_its_line() {
    let s = common::Scratch::new();
    let spec = s.copy_edit(
        "specs/models/gpt2-124m.toml",
        &[("[training]", "[lora]\nrank = 8\n\n[training]")],
    );
    let out = common::bin()
        .args([
            "plan",
            spec.to_str().unwrap(),
            "specs/clusters/dgx-h100-80g.toml",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("[lora]") && err.contains("training.method"),
        "{err}"
    );
    assert!(
        err.contains("gpt2-124m.toml:"),
        "names the file and line: {err}"
    );
}

#[test]
fn a_full_job_that_fits_nowhere_is_told_what_lora_and_qlora_need() {
    // Without offload: with it, the optimizer's states in host memory let 8B train on one H100.
    let out = plan(&[
        "specs/models/llama3-8b.toml",
        "specs/clusters/dgx-h100-80g.toml",
        "--devices",
        "1",
        "--offload",
        "none",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    let line = err
        .lines()
        .find(|l| l.contains("fine-tuning:"))
        .unwrap_or_else(|| panic!("no fine-tuning line: {err}"));
    assert!(line.contains("full: "), "{line}");
    assert!(line.contains("LoRA r=16 fits at"), "{line}");
    assert!(line.contains("QLoRA r=16 fits at"), "{line}");
    // The job's own method never changes: no plan is written.
    assert!(!String::from_utf8_lossy(&out.stdout).contains("chosen:"));
}

/// Llama 3 8B on one 24 GB GPU (the RTX 4090 preset), sequence 2048, micro-batch 1, global
/// batch 8, no recompute, LoRA and QLoRA at rank 16 on all seven linears: every term worked
/// out by hand from the shapes (hidden 4096, KV width 1024, MLP 14336, 32 heads, vocab 128256,
/// 32 layers; 2-byte activations):
/// - adapters: 41,943,040 params (PEFT's count, above) × 20 B (the default policy) =
///   838,860,800 B;
/// - frozen base, LoRA: 8,030,261,248 × 2 B = 16,060,522,496 B; QLoRA: the seven projections'
///   6,979,321,856 weights in NF4 at 0.5 + 1/64 + 4/16384 B = 3,600,416,768 B, and the other
///   1,050,939,392 (embedding, head, norms) × 2 B = 2,101,878,784 B (transformers' 4-bit
///   quantizer converts exactly those seven per block: docs/finetune-notes.md);
/// - one layer's activations, s·b = 2048 rows × 2 B: norm1 input, QKV input, attention output,
///   norm2 input and MLP input 4096 wide each (5 × 16,777,216), Q 4096 wide (16,777,216), K and
///   V 1024 wide (2 × 4,194,304), flash attention's fp32 log-sum-exp (4 × 32 × 2048 = 262,144),
///   gate output, up output and down input 14336 wide (3 × 58,720,256), and seven rank-16
///   intermediates (7 × 65,536): 285,933,568 B; × 32 layers = 9,149,874,176 B;
/// - head: final-norm input and head input (2 × 16,777,216) and fp32 logits (4 × 2048 × 128256
///   = 1,050,673,152);
/// - QLoRA's one dequantized 4096 × 14336 weight: 117,440,512 B;
/// - CUDA context 274 MiB, cuBLAS workspace 12.125 MiB: 300,023,808 B; no allocator slack
///   (the default profile reports its allocated bytes: a steady step reuses each cached block).
///
/// LoRA: 27,133,485,056 B of tensors → 27,433,508,864 B = 25.55 GiB: over the 24 GiB.
/// QLoRA: 16,892,698,624 B of tensors → 17,192,722,432 B = 16.01 GiB.
#[test]
fn worked_memory_of_llama3_8b_lora_and_qlora_on_one_24gb_gpu() {
    use tessera_planner::spec::{load_cluster, ClusterOverrides};
    use tessera_planner::{memory, Layout};
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cluster = load_cluster(
        &root.join("specs/clusters/rtx4090-24g.toml"),
        ClusterOverrides {
            nodes: None,
            devices: Some(1),
        },
    )
    .unwrap();
    for (method, tensors, total) in [
        (Method::Lora, 27_133_485_056u64, 27_433_508_864u64),
        (Method::Qlora, 16_892_698_624, 17_192_722_432),
    ] {
        let mut model = load_model(
            &root.join("specs/models/llama3-8b.toml"),
            TrainingOverrides {
                seq_len: Some(2048),
                global_batch: Some(8),
                ..Default::default()
            },
        )
        .unwrap();
        FineTuneOverrides {
            method: Some(method),
            lora_rank: Some(16),
            lora_targets: Some("all".into()),
            ..Default::default()
        }
        .apply(&mut model)
        .unwrap();
        let layout = Layout::without_pipeline(1, 1, 0, 1);
        let r = memory::estimate(&model, &cluster, &layout);
        let term = |name: &str| {
            r.per_stage[0]
                .terms
                .iter()
                .find(|t| t.name == name)
                .map_or(0, |t| t.bytes)
        };
        let states: u64 = [
            "weights_bf16",
            "grads_bf16",
            "grads_fp32",
            "master_fp32",
            "adam_m_fp32",
            "adam_v_fp32",
        ]
        .iter()
        .map(|n| term(n))
        .sum();
        assert_eq!(states, 838_860_800, "{method:?} adapter states");
        assert_eq!(term("layer_activations"), 9_149_874_176, "{method:?}");
        match method {
            Method::Lora => {
                assert_eq!(term("frozen_weights"), 16_060_522_496);
                assert_eq!(term("frozen_weights_nf4"), 0);
                assert_eq!(term("qlora_dequantized_weight"), 0);
            }
            _ => {
                assert_eq!(term("frozen_weights"), 2_101_878_784);
                assert_eq!(term("frozen_weights_nf4"), 3_600_416_768);
                assert_eq!(term("qlora_dequantized_weight"), 117_440_512);
            }
        }
        assert_eq!(term("allocator_fragmentation"), 0, "{method:?}");
        assert_eq!(term("allocator_reserved"), 0, "{method:?}");
        let overhead = 287_309_824 + 12_713_984;
        assert_eq!(total - tensors, overhead, "{method:?}");
        let total_got = r.peak_bytes;
        assert!(
            total_got.abs_diff(total) <= 2,
            "{method:?}: {total_got} vs {total}"
        );
    }
}

/// `run` trains a LoRA or QLoRA plan's adapters on the CPU backend (runtime/tests/lora_parity.rs
/// and qlora_parity.rs check how; tests/qlora_cli.rs saves and resumes QLoRA), and every
/// export that would launch full training refuses an adapter plan (the peft and torchtune exports
/// state the adapters: tests/export_finetune.rs), never written as full training.
#[test]
fn an_adapter_plan_runs_and_is_refused_by_export_not_trained_in_full() {
    let s = common::Scratch::new();
    let plan_file = s.path("lora.json");
    let out = plan(&[
        "specs/models/gpt2-124m.toml",
        "specs/clusters/cpu-8.toml",
        "--devices",
        "1",
        "--method",
        "lora",
        "--seq-len",
        "128",
        "--global-batch",
        "8",
        "-o",
        plan_file.to_str().unwrap(),
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&plan_file).unwrap();
    assert!(
        text.contains("\"method\": \"lora\""),
        "the plan carries the method"
    );
    for method in ["lora", "qlora"] {
        let tiny = s.path(&format!("tiny-{method}.json"));
        let out = plan(&[
            "specs/models/tiny.toml",
            "specs/clusters/cpu-8.toml",
            "--devices",
            "1",
            "--method",
            method,
            "-o",
            tiny.to_str().unwrap(),
        ]);
        assert_eq!(out.status.code(), Some(0), "{method}");
        let run = common::bin()
            .args(["run", tiny.to_str().unwrap(), "--steps", "2"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(0), "{method}: {err}");
    }
    for to in [
        "deepspeed",
        "torchtitan",
        "megatron",
        "sbatch",
        "kubernetes",
    ] {
        let ex = common::bin()
            .args(["export", plan_file.to_str().unwrap(), "--to", to])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&ex.stderr);
        assert_eq!(ex.status.code(), Some(2), "{to}: {err}");
        assert!(err.contains("lora fine-tune"), "{to}: {err}");
    }
}

#[test]
fn validate_prints_pefts_counts() {
    let out = common::bin()
        .args(["validate", "specs/finetune/llama3-8b-qlora.toml"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    // PEFT's print_trainable_parameters for the same LoraConfig (tests/fixtures/peft-counts.toml).
    assert!(
        text.contains("trainable params: 41943040 || all params: 8072204288 || trainable%: 0.5196"),
        "{text}"
    );
}

/// A plan whose optimizer keeps 8-bit moments is refused by `run`, whose AdamW keeps them in the
/// policy's width: never trained as something other than planned.
#[test]
fn eight_bit_optimizer_states_are_refused_by_run() {
    let s = common::Scratch::new();
    let plan_file = s.path("8bit.json");
    let out = plan(&[
        "specs/models/gpt2-124m.toml",
        "specs/clusters/cpu-8.toml",
        "--devices",
        "1",
        "--optimizer-states",
        "8bit",
        "--seq-len",
        "128",
        "--global-batch",
        "8",
        "-o",
        plan_file.to_str().unwrap(),
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = common::bin()
        .args(["run", plan_file.to_str().unwrap(), "--steps", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{err}");
    assert!(
        err.contains("8 bits") && err.contains("--optimizer-states policy"),
        "{err}"
    );
}

/// LoRA dropout is planned and run: a CPU plan with `--lora-dropout` trains (the parity of
/// every layout is runtime/tests/dropout_parity.rs's).
#[test]
fn lora_dropout_plans_and_runs() {
    let s = common::Scratch::new();
    let plan_file = s.path("lora.json");
    let out = plan(&[
        "specs/models/tiny.toml",
        "specs/clusters/cpu-8.toml",
        "--devices",
        "1",
        "--method",
        "lora",
        "--lora-dropout",
        "0.1",
        "-o",
        plan_file.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let text = std::fs::read_to_string(&plan_file).unwrap();
    assert!(text.contains("\"dropout\": 0.1"), "the plan carries it");
    let run = common::bin()
        .args(["run", plan_file.to_str().unwrap(), "--steps", "2"])
        .output()
        .unwrap();
    let (stdout, err) = (
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr),
    );
    assert_eq!(run.status.code(), Some(0), "{err}");
    assert!(stdout.contains("loss"), "{stdout}");
}

/// LoRA on a mixture-of-experts base: adapters on attention, the routed experts frozen with the
/// rest of the base. `plan` lays it out with expert parallelism and `run` trains it on the CPU;
/// adapters on the experts' MLP and QLoRA are refused, each with its fix.
#[test]
fn lora_on_attention_of_a_moe_base_plans_and_runs() {
    let s = common::Scratch::new();
    let plan_file = s.path("moe-lora.json");
    let base = [
        "specs/models/tiny-moe.toml",
        "specs/clusters/cpu-8.toml",
        "--devices",
        "4",
        "--method",
        "lora",
    ];
    let mut args = base.to_vec();
    let file = plan_file.to_str().unwrap();
    args.extend([
        "--lora-targets",
        "qkv,o",
        "--dp",
        "4",
        "--ep",
        "2",
        "-o",
        file,
    ]);
    let out = plan(&args);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan_file).unwrap()).unwrap();
    assert_eq!(p["parallel"]["ep"], 2, "{}", p["parallel"]);
    let run = common::bin()
        .args(["run", file, "--steps", "2"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert_eq!(
        run.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );

    let mut args = base.to_vec();
    args.extend(["--lora-targets", "qkv,up"]);
    let err = plan_refused(&args);
    assert!(
        err.contains("\"up\"") && err.contains("mixture-of-experts") && err.contains("attention"),
        "{err}"
    );
    let mut args = base.to_vec();
    args[5] = "qlora";
    let err = plan_refused(&args);
    assert!(
        err.contains("QLoRA on a mixture-of-experts base") && err.contains("\"lora\""),
        "{err}"
    );
}
