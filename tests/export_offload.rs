//! Offload in the exports (issue 38), and the trainer targets `--to accelerate` and
//! `--to lightning`: the keys each target writes for each offload knob, read back in the
//! target's language (JSON, TOML, YAML, the Megatron argument array), with the expected values
//! written here by hand or taken from plan.json; and the refusals, which name the target, the
//! knob and why. scripts/check-exports.sh reads the same exports with the targets' own code.
//!
//! The plans are `tessera plan` layouts with the offload fields set in plan.json and a `[host]`
//! tier in its cluster, their prediction derived again (`tessera repredict`), so that each
//! offload mode sits on the same base layout whichever framework profile would run it.

mod common;

use std::path::{Path, PathBuf};

use common::*;

const LLAMA: &str = "specs/models/llama3-8b.toml";
const H100: &str = "specs/clusters/dgx-h100-80g.toml";
const TINY_LLAMA: &str = "tests/fixtures/tiny-llama.toml";

/// A tiny Llama (tests/fixtures/tiny-llama.toml) on one DGX H100, DP 8, ZeRO-`zero`, with
/// `recompute`, and `offload` (`none`, `optimizer`, `params`) to `to` and activation offload
/// `act`. Tiny, so that every ZeRO stage fits.
fn offload_plan_with(
    dir: &Scratch,
    name: &str,
    zero: &str,
    recompute: &str,
    knobs: (&str, &str, bool),
) -> PathBuf {
    let p = plan_words(
        dir,
        name,
        &format!("{TINY_LLAMA} {H100} --nodes 1 --dp 8 --tp 1 --pp 1 --zero {zero} --no-hybrid-shard --micro-batch 1 --recompute {recompute}"),
    );
    set_offload(&p, knobs);
    p
}

/// [`offload_plan_with`] with full recompute.
fn offload_plan(dir: &Scratch, name: &str, zero: &str, knobs: (&str, &str, bool)) -> PathBuf {
    offload_plan_with(dir, name, zero, "full", knobs)
}

/// Sets the plan's offload fields and gives its cluster a host tier (the offload rules need
/// one).
fn set_offload(p: &Path, (offload, to, act): (&str, &str, bool)) {
    edit_json(p, |v| {
        v["parallel"]["offload"] = offload.into();
        v["parallel"]["offload_to"] = to.into();
        v["parallel"]["offload_activations"] = act.into();
        v["job"]["cluster"]["host"] = serde_json::json!({
            "memory_gib": 2048.0, "link_gbps": 55.0, "nvme_gbps": 50.0,
            "nvme_gib": 28000.0, "adamw_gparams_per_s": 2.0,
        });
    });
    // The prediction follows the layout: derive it again, as `tessera plan --offload` would.
    let tmp = p.with_extension("repredicted.json");
    let r = run(&["repredict", &s(p), "-o", &s(&tmp)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    std::fs::rename(&tmp, p).unwrap();
}

/// `tessera plan` with the arguments of one string (none holds a space).
fn plan_words(dir: &Scratch, name: &str, words: &str) -> PathBuf {
    let args: Vec<&str> = words.split_whitespace().collect();
    plan_file(dir, name, &args)
}

fn plan_json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn export_refused(plan: &Path, to: &str, parts: &[&str], dir: &Scratch) {
    let out = dir.path(&format!("refused.{to}"));
    let r = run(&["export", &s(plan), "--to", to, "-o", &s(&out)]);
    refused(&r, parts);
    assert!(!out.exists(), "{to} wrote a file for a refused plan");
}

fn yaml(text: &str) -> serde_yaml_ng::Value {
    serde_yaml_ng::from_str(text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

#[test]
fn deepspeed_writes_zero_offload_and_cpu_checkpointing() {
    let dir = Scratch::new();
    let cpu = |o: &str| serde_json::json!({ "device": o, "pin_memory": true });
    let nvme =
        serde_json::json!({ "device": "nvme", "pin_memory": true, "nvme_path": "/local_nvme" });
    let cases = [
        ("params", "cpu", Some(cpu("cpu")), Some(cpu("cpu"))),
        ("optimizer", "cpu", Some(cpu("cpu")), None),
        ("params", "nvme", Some(nvme.clone()), Some(nvme.clone())),
        ("none", "cpu", None, None),
    ];
    for (offload, to, optimizer, param) in cases {
        let p = offload_plan(
            &dir,
            &format!("{offload}-{to}.json"),
            "3",
            (offload, to, false),
        );
        let r = run(&["export", &s(&p), "--to", "deepspeed"]);
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        let c: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
        let z = &c["zero_optimization"];
        assert_eq!(z["stage"], 3);
        let opt = z.get("offload_optimizer").cloned();
        assert_eq!(opt, optimizer, "{offload} to {to}: offload_optimizer");
        assert_eq!(
            z.get("offload_param").cloned(),
            param,
            "{offload} to {to}: offload_param"
        );
        assert_eq!(c["activation_checkpointing"]["cpu_checkpointing"], false);
        // The NVMe folder is a placeholder, and the export says so.
        assert_eq!(
            r.stderr.contains("\"/local_nvme\""),
            to == "nvme",
            "{}",
            r.stderr
        );
    }
    let p = offload_plan(&dir, "act.json", "3", ("none", "cpu", true));
    let c: serde_json::Value = serde_json::from_str(&export_text(&p, "deepspeed")).unwrap();
    assert_eq!(c["activation_checkpointing"]["cpu_checkpointing"], true);
    // Without recompute there is nothing checkpointed to move.
    let p = offload_plan_with(&dir, "act-none.json", "3", "none", ("none", "cpu", true));
    export_refused(
        &p,
        "deepspeed",
        &[
            "deepspeed cannot",
            "activation offload",
            "without recompute",
            "--recompute full",
        ],
        &dir,
    );
}

#[test]
fn torchtitan_offloads_params_with_fsdp_only() {
    let dir = Scratch::new();
    let p = offload_plan(&dir, "params.json", "3", ("params", "cpu", false));
    let t: toml::Table = toml::from_str(&export_text(&p, "torchtitan")).unwrap();
    assert_eq!(t["training"]["enable_cpu_offload"].as_bool(), Some(true));
    let p = offload_plan(&dir, "none.json", "3", ("none", "cpu", false));
    let t: toml::Table = toml::from_str(&export_text(&p, "torchtitan")).unwrap();
    assert!(t["training"].get("enable_cpu_offload").is_none());
    let refusals = [
        (
            ("optimizer", "cpu", false),
            "optimizer offload",
            "no optimizer-only offload",
        ),
        (
            ("params", "nvme", false),
            "offload to NVMe",
            "host memory only",
        ),
        (
            ("none", "cpu", true),
            "activation offload",
            "no activation offload",
        ),
    ];
    for (knobs, what, why) in refusals {
        let p = offload_plan(&dir, "refused.json", "3", knobs);
        export_refused(
            &p,
            "torchtitan",
            &["torchtitan cannot", what, why, "fix:"],
            &dir,
        );
    }
}

/// The words of `MEGATRON_ARGS=(...)` (the flags looked for here are never quoted).
fn megatron_words(text: &str) -> Vec<String> {
    let body = text
        .split("MEGATRON_ARGS=(")
        .nth(1)
        .unwrap()
        .split("\n)")
        .next()
        .unwrap();
    body.split_whitespace().map(str::to_string).collect()
}

#[test]
fn megatron_offloads_the_distributed_optimizer() {
    let dir = Scratch::new();
    let p = offload_plan(&dir, "opt.json", "1", ("optimizer", "cpu", false));
    let words = megatron_words(&export_text(&p, "megatron"));
    let at = words
        .iter()
        .position(|w| w == "--optimizer-offload-fraction")
        .unwrap();
    assert_eq!(words[at + 1], "1.0");
    for f in [
        "--optimizer-cpu-offload",
        "--use-precision-aware-optimizer",
        "--use-distributed-optimizer",
    ] {
        assert!(words.iter().any(|w| w == f), "{f} missing: {words:?}");
    }
    let p = offload_plan(&dir, "none.json", "1", ("none", "cpu", false));
    let words = megatron_words(&export_text(&p, "megatron"));
    assert!(!words
        .iter()
        .any(|w| w.contains("offload") || w.contains("precision-aware")));
    let p = offload_plan(&dir, "act.json", "1", ("none", "cpu", true));
    export_refused(
        &p,
        "megatron",
        &[
            "megatron cannot",
            "activation offload",
            "Transformer Engine",
        ],
        &dir,
    );
}

#[test]
fn torchtune_offloads_params_and_activations_in_its_distributed_recipes() {
    let dir = Scratch::new();
    // The torchtune-shaped spec as a full fine-tune on a DGX H100 with FSDP (ZeRO-3).
    let spec = dir.copy_edit(
        "specs/finetune/llama3-8b-lora-torchtune.toml",
        &[
            ("method = \"lora\"", "method = \"full\""),
            ("weight_decay = 0.01", "weight_decay = 0.01\ndecay_on = \"all\""),
            ("[lora]\nrank = 8\nalpha = 16\ndropout = 0.0\ntargets = [\"q\", \"v\", \"o\", \"gate\", \"up\", \"down\"]", ""),
        ],
    );
    let spec = s(&spec);
    let full_ft = |name: &str, recompute: &str| {
        plan_words(
            &dir,
            name,
            &format!("{spec} {H100} --nodes 1 --dp 8 --tp 1 --pp 1 --zero 3 --no-hybrid-shard --micro-batch 2 --recompute {recompute}"),
        )
    };
    let p = full_ft("full.json", "full");
    let y = yaml(&export_text(&p, "torchtune"));
    // Absent is the recipes' default: no offload (existing exports stay as they were).
    assert!(y.get("fsdp_cpu_offload").is_none());
    assert_eq!(
        y["enable_activation_offloading"],
        serde_yaml_ng::Value::from(false)
    );
    set_offload(&p, ("params", "cpu", true));
    let y = yaml(&export_text(&p, "torchtune"));
    assert_eq!(y["fsdp_cpu_offload"], serde_yaml_ng::Value::from(true));
    assert_eq!(
        y["enable_activation_offloading"],
        serde_yaml_ng::Value::from(true)
    );
    set_offload(&p, ("optimizer", "cpu", false));
    export_refused(
        &p,
        "torchtune",
        &["torchtune cannot", "optimizer offload", "fsdp_cpu_offload"],
        &dir,
    );
    // torchtune's recipes raise on activation offload without activation checkpointing.
    let p = full_ft("full-none.json", "none");
    set_offload(&p, ("none", "cpu", true));
    export_refused(
        &p,
        "torchtune",
        &["activation offload", "enable_activation_checkpointing"],
        &dir,
    );
}

#[test]
fn the_schedulers_refuse_offload() {
    let dir = Scratch::new();
    for knobs in [("optimizer", "cpu", false), ("none", "cpu", true)] {
        let p = offload_plan(&dir, "p.json", "3", knobs);
        for to in ["sbatch", "kubernetes"] {
            export_refused(
                &p,
                to,
                &[&format!("{to} cannot"), "offload", "`tessera run`"],
                &dir,
            );
        }
    }
}

#[test]
fn accelerate_states_the_engine_of_each_plan() {
    let dir = Scratch::new();
    // ZeRO-3: FSDP, full sharding; params offload is FSDP's CPUOffload.
    for (offload, want) in [("none", false), ("params", true)] {
        let p = offload_plan(&dir, "fsdp.json", "3", (offload, "cpu", false));
        let y = yaml(&export_text(&p, "accelerate"));
        assert_eq!(y["distributed_type"].as_str(), Some("FSDP"));
        assert_eq!(y["num_processes"].as_u64(), Some(8));
        assert_eq!(y["num_machines"].as_u64(), Some(1));
        assert_eq!(y["mixed_precision"].as_str(), Some("bf16"));
        let f = &y["fsdp_config"];
        assert_eq!(f["fsdp_sharding_strategy"].as_str(), Some("FULL_SHARD"));
        assert_eq!(f["fsdp_offload_params"].as_bool(), Some(want), "{offload}");
        assert_eq!(
            f["fsdp_auto_wrap_policy"].as_str(),
            Some("TRANSFORMER_BASED_WRAP")
        );
        assert_eq!(
            f["fsdp_transformer_layer_cls_to_wrap"].as_str(),
            Some("LlamaDecoderLayer")
        );
        assert_eq!(f["fsdp_activation_checkpointing"].as_bool(), Some(true));
    }
    // Optimizer-only offload: DeepSpeed's ZeRO (FSDP's offload moves the weights too).
    let p = offload_plan(&dir, "opt.json", "3", ("optimizer", "cpu", false));
    let plan = plan_json(&p);
    let y = yaml(&export_text(&p, "accelerate"));
    assert_eq!(y["distributed_type"].as_str(), Some("DEEPSPEED"));
    let d = &y["deepspeed_config"];
    assert_eq!(d["zero_stage"].as_u64(), Some(3));
    assert_eq!(d["offload_optimizer_device"].as_str(), Some("cpu"));
    assert_eq!(d["offload_param_device"].as_str(), Some("none"));
    assert_eq!(
        d["gradient_accumulation_steps"].as_u64(),
        plan["parallel"]["microbatches"].as_u64()
    );
    // ZeRO-1 is DeepSpeed's too; ZeRO-0 is DDP.
    let p = offload_plan(&dir, "z1.json", "1", ("none", "cpu", false));
    let y = yaml(&export_text(&p, "accelerate"));
    assert_eq!(y["distributed_type"].as_str(), Some("DEEPSPEED"));
    assert_eq!(y["deepspeed_config"]["zero_stage"].as_u64(), Some(1));
    let p = offload_plan(&dir, "z0.json", "0", ("none", "cpu", false));
    let y = yaml(&export_text(&p, "accelerate"));
    assert_eq!(y["distributed_type"].as_str(), Some("MULTI_GPU"));
    assert!(y.get("fsdp_config").is_none() && y.get("deepspeed_config").is_none());
    // accelerate's launcher drops the NVMe folder; activations have no key.
    let p = offload_plan(&dir, "nvme.json", "3", ("params", "nvme", false));
    export_refused(
        &p,
        "accelerate",
        &["accelerate cannot", "offload to NVMe", "nvme_path"],
        &dir,
    );
    let p = offload_plan(&dir, "act.json", "3", ("none", "cpu", true));
    export_refused(
        &p,
        "accelerate",
        &["accelerate cannot", "activation offload"],
        &dir,
    );
}

#[test]
fn accelerate_hsdp_on_two_nodes() {
    let dir = Scratch::new();
    let p = plan_words(
        &dir,
        "hsdp.json",
        &format!("{LLAMA} {H100} --nodes 2 --dp 16 --tp 1 --pp 1 --zero 3 --hybrid-shard --micro-batch 1 --recompute full"),
    );
    let y = yaml(&export_text(&p, "accelerate"));
    assert_eq!(y["num_machines"].as_u64(), Some(2));
    assert_eq!(y["num_processes"].as_u64(), Some(16));
    assert_eq!(y["main_process_ip"].as_str(), Some("FIRST_NODE_ADDRESS"));
    assert_eq!(
        y["fsdp_config"]["fsdp_sharding_strategy"].as_str(),
        Some("HYBRID_SHARD")
    );
    let l = export_text(&p, "lightning");
    assert!(
        l.contains("    sharding_strategy=\"HYBRID_SHARD\",\n"),
        "{l}"
    );
    assert!(l.contains("    device_mesh=(2, 8),\n"), "{l}");
    assert!(
        l.contains("    num_nodes=2,\n") && l.contains("    devices=8,\n"),
        "{l}"
    );
}

#[test]
fn accelerate_writes_the_lora_config_beside_it() {
    let dir = Scratch::new();
    let p = plan_file(
        &dir,
        "qlora.json",
        &[
            "specs/finetune/llama3-8b-qlora.toml",
            "specs/clusters/rtx4090-24g.toml",
            "--devices",
            "1",
        ],
    );
    let out = dir.path("acc");
    let r = run(&["export", &s(&p), "--to", "accelerate", "-o", &s(&out)]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    // The LoraConfig exactly as --to peft writes it, and the QLoRA base's note.
    let lora = std::fs::read_to_string(out.join("adapter_config.json")).unwrap();
    assert_eq!(lora, export_text(&p, "peft"));
    assert!(
        r.stderr.contains("BitsAndBytesConfig(load_in_4bit=True"),
        "{}",
        r.stderr
    );
    let text = std::fs::read_to_string(out.join("accelerate_config.yaml")).unwrap();
    let y = yaml(&text);
    assert_eq!(y["distributed_type"].as_str(), Some("NO"));
    // accelerate's PyYAML (YAML 1.1) would read a bare NO as false.
    assert!(text.contains("\ndistributed_type: 'NO'\n"), "{text}");
    assert_eq!(y["num_processes"].as_u64(), Some(1));
    // Two files need a folder; a folder that holds anything is never written into.
    let r = run(&["export", &s(&p), "--to", "accelerate"]);
    refused(&r, &["two files", "-o FOLDER"]);
    let r = run(&["export", &s(&p), "--to", "accelerate", "-o", &s(&out)]);
    refused(&r, &["not empty", "never overwrites"]);
    // Lightning's snippet has no place for adapters.
    export_refused(&p, "lightning", &["lightning cannot", "adapters"], &dir);
}

#[test]
fn lightning_builds_each_strategy() {
    let dir = Scratch::new();
    let p = offload_plan(&dir, "params.json", "3", ("params", "cpu", false));
    let plan = plan_json(&p);
    let l = export_text(&p, "lightning");
    for line in [
        "strategy = FSDPStrategy(\n",
        "    sharding_strategy=\"FULL_SHARD\",\n",
        "    cpu_offload=True,\n",
        "    auto_wrap_policy={LlamaDecoderLayer},\n",
        "    activation_checkpointing_policy={LlamaDecoderLayer},\n",
        "from transformers.models.llama.modeling_llama import LlamaDecoderLayer\n",
        "    devices=8,\n",
        "    num_nodes=1,\n",
        "    precision=\"bf16-mixed\",\n",
        &format!(
            "    accumulate_grad_batches={},\n",
            plan["parallel"]["microbatches"]
        ),
        "    gradient_clip_val=1.0,\n",
    ] {
        assert!(l.contains(line), "missing {line:?}:\n{l}");
    }
    let p = offload_plan(&dir, "nvme.json", "3", ("params", "nvme", false));
    let l = export_text(&p, "lightning");
    for line in [
        "strategy = DeepSpeedStrategy(\n",
        "    stage=3,\n",
        "    offload_optimizer=True,\n",
        "    offload_parameters=True,\n",
        "    offload_optimizer_device=\"nvme\",\n",
        "    offload_params_device=\"nvme\",\n",
        "    nvme_path=\"/local_nvme\",\n",
    ] {
        assert!(l.contains(line), "missing {line:?}:\n{l}");
    }
    let p = offload_plan(&dir, "ddp.json", "0", ("none", "cpu", false));
    assert!(export_text(&p, "lightning").contains("strategy = DDPStrategy(\n)\n"));
    // TP has no truthful Lightning strategy here.
    let tp = plan_words(
        &dir,
        "tp.json",
        &format!("{LLAMA} {H100} --nodes 1 --dp 4 --tp 2 --pp 1 --sp --zero 3 --no-hybrid-shard --micro-batch 1 --recompute full"),
    );
    export_refused(
        &tp,
        "lightning",
        &[
            "lightning cannot",
            "tensor, pipeline or context",
            "ModelParallelStrategy",
        ],
        &dir,
    );
    export_refused(
        &tp,
        "accelerate",
        &[
            "accelerate cannot",
            "tensor, pipeline or context",
            "MEGATRON_LM",
        ],
        &dir,
    );
}

#[test]
fn accelerate_quotes_what_yaml_1_1_reads_as_booleans() {
    let dir = Scratch::new();
    let spec = dir.copy_edit(
        TINY_LLAMA,
        &[("precision = \"default\"", "precision = \"fp32\"")],
    );
    let p = plan_file(
        &dir,
        "fp32.json",
        &[
            &s(&spec),
            H100,
            "--devices",
            "1",
            "--micro-batch",
            "1",
            "--recompute",
            "none",
        ],
    );
    let text = export_text(&p, "accelerate");
    assert!(text.contains("\nmixed_precision: 'no'\n"), "{text}");
    assert!(text.contains("\ndistributed_type: 'NO'\n"), "{text}");
    assert!(export_text(&p, "lightning").contains("    precision=\"32-true\",\n"));
}
