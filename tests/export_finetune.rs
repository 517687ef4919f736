//! `tessera export --to peft|torchtune` for fine-tuning plans (issue 37): each text for
//! representative plans is a reviewed snapshot (tests/snapshots/export_finetune__*.snap), and a
//! plan the target cannot express is refused with exit 2, the reason named, and no file.
//! scripts/check-exports.sh reads the exports with PEFT's and torchtune's own code.

mod common;

use std::path::{Path, PathBuf};

use common::*;

const FT: &str = "specs/finetune/llama3-8b-lora-torchtune.toml";
const RTX4090: &str = "specs/clusters/rtx4090-24g.toml";
const H100: &str = "specs/clusters/dgx-h100-80g.toml";

/// The torchtune-shaped LoRA spec on one RTX 4090, with `extra` flags.
fn one_gpu(dir: &Scratch, name: &str, extra: &[&str]) -> PathBuf {
    let mut args = vec![
        FT,
        RTX4090,
        "--devices",
        "1",
        "--micro-batch",
        "2",
        "--recompute",
        "full",
    ];
    args.extend(extra);
    plan_file(dir, name, &args)
}

/// The same spec on a DGX H100, DP 8, with `extra` flags.
fn dgx(dir: &Scratch, name: &str, extra: &[&str]) -> PathBuf {
    let mut args = vec![
        FT,
        H100,
        "--nodes",
        "1",
        "--pp",
        "1",
        "--micro-batch",
        "2",
        "--recompute",
        "none",
    ];
    args.extend(extra);
    plan_file(dir, name, &args)
}

fn export_refused(plan: &Path, to: &str, parts: &[&str], dir: &Scratch) {
    let out = dir.path(&format!("refused.{to}"));
    let r = run(&["export", &s(plan), "--to", to, "-o", &s(&out)]);
    refused(&r, parts);
    assert!(!out.exists(), "{to} wrote a file for a refused plan");
}

#[test]
fn peft_lora_config_of_a_qlora_plan() {
    let dir = Scratch::new();
    let p = plan_file(
        &dir,
        "qlora.json",
        &[
            "specs/finetune/llama3-8b-qlora.toml",
            RTX4090,
            "--devices",
            "1",
        ],
    );
    let r = run(&["export", &s(&p), "--to", "peft"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    insta::assert_snapshot!("llama3_8b_qlora_peft", r.stdout);
    // What PEFT's config cannot hold is said beside it: the 4-bit base is transformers'.
    assert!(
        r.stderr.contains("BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\", bnb_4bit_use_double_quant=True"),
        "{}",
        r.stderr
    );
}

#[test]
fn peft_names_gpt2_modules_and_fan_in_fan_out() {
    let dir = Scratch::new();
    let p = plan_file(
        &dir,
        "gpt2.json",
        &[
            "tests/fixtures/hf/gpt2/config.json",
            RTX4090,
            "--devices",
            "1",
            "--seq-len",
            "1024",
            "--global-batch",
            "8",
            "--method",
            "lora",
            "--lora-rank",
            "4",
            "--lora-targets",
            "all",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&export_text(&p, "peft")).unwrap();
    assert_eq!(
        v["target_modules"],
        serde_json::json!(["c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"])
    );
    assert_eq!(v["fan_in_fan_out"], true, "GPT-2's Conv1D stores (in, out)");
    assert_eq!(v["r"], 4);
    // torchtune has no GPT-2 builder.
    export_refused(
        &p,
        "torchtune",
        &["the gpt family", "Llama 3 builders"],
        &dir,
    );
}

#[test]
fn torchtune_recipe_configs() {
    let dir = Scratch::new();
    let lora = one_gpu(&dir, "lora.json", &[]);
    insta::assert_snapshot!("llama3_8b_lora_torchtune", export_text(&lora, "torchtune"));
    let qlora = one_gpu(&dir, "qlora.json", &["--method", "qlora"]);
    let text = export_text(&qlora, "torchtune");
    assert!(
        text.contains("_component_: torchtune.models.llama3.qlora_llama3_8b"),
        "{text}"
    );
    assert!(
        text.contains("# tune run lora_finetune_single_device"),
        "{text}"
    );
    let bit8 = one_gpu(&dir, "bit8.json", &["--optimizer-states", "8bit"]);
    let text = export_text(&bit8, "torchtune");
    assert!(
        text.contains("_component_: bitsandbytes.optim.AdamW8bit"),
        "{text}"
    );
    let fsdp = dgx(
        &dir,
        "fsdp.json",
        &["--dp", "8", "--tp", "1", "--zero", "3", "--no-hybrid-shard"],
    );
    insta::assert_snapshot!(
        "llama3_8b_lora_fsdp_torchtune",
        export_text(&fsdp, "torchtune")
    );
}

/// A Llama-family model that is no torchtune model builder's: the component builder with every
/// dimension stated.
#[test]
fn torchtune_generic_builder_for_other_llamas() {
    let dir = Scratch::new();
    // RoPE θ 10⁶: no torchtune model builder has it.
    let spec = dir.copy_edit(FT, &[("rope_theta = 500000.0", "rope_theta = 1000000.0")]);
    let args = [
        &s(&spec),
        RTX4090,
        "--devices",
        "1",
        "--micro-batch",
        "2",
        "--recompute",
        "full",
    ];
    let p = plan_file(&dir, "lora.json", &args);
    let text = export_text(&p, "torchtune");
    for line in [
        "_component_: torchtune.models.llama3.lora_llama3\n",
        "num_layers: 32\n",
        "num_kv_heads: 8\n",
        "intermediate_dim: 14336\n",
        "max_seq_len: 2048\n",
        "rope_base: 1000000\n",
        "vocab_size: 128256\n",
    ] {
        assert!(text.contains(line), "no {line:?} in\n{text}");
    }
    let mut args = args.to_vec();
    args.extend(["--method", "qlora"]);
    let q = plan_file(&dir, "qlora.json", &args);
    assert!(export_text(&q, "torchtune").contains("quantize_base: true\n"));
}

#[test]
fn refusals_name_the_reason() {
    let dir = Scratch::new();
    // A full fine-tune has no adapters for PEFT.
    let full = plan_file(
        &dir,
        "full.json",
        &[
            "specs/models/llama3-8b.toml",
            H100,
            "--nodes",
            "1",
            "--dp",
            "8",
            "--tp",
            "1",
            "--pp",
            "1",
            "--zero",
            "3",
            "--no-hybrid-shard",
            "--micro-batch",
            "1",
            "--recompute",
            "full",
        ],
    );
    export_refused(&full, "peft", &["full fine-tune", "no adapter"], &dir);
    // … and its mixed precision (fp32 master weights) is not torchtune's.
    export_refused(
        &full,
        "torchtune",
        &["precision policy \"default\"", "no fp32 master"],
        &dir,
    );
    // TP, ZeRO-1 and 8-bit states under FSDP are not torchtune's.
    let tp = dgx(
        &dir,
        "tp.json",
        &[
            "--dp",
            "4",
            "--tp",
            "2",
            "--sp",
            "--zero",
            "3",
            "--no-hybrid-shard",
        ],
    );
    export_refused(
        &tp,
        "torchtune",
        &["tensor, pipeline or context parallelism (TP 2"],
        &dir,
    );
    let zero1 = dgx(
        &dir,
        "zero1.json",
        &["--dp", "8", "--tp", "1", "--zero", "1"],
    );
    export_refused(
        &zero1,
        "torchtune",
        &["ZeRO-1 over 8 ranks", "--zero 3"],
        &dir,
    );
    let bit8 = dgx(
        &dir,
        "bit8.json",
        &[
            "--dp",
            "8",
            "--tp",
            "1",
            "--zero",
            "3",
            "--no-hybrid-shard",
            "--optimizer-states",
            "8bit",
        ],
    );
    export_refused(
        &bit8,
        "torchtune",
        &["8-bit optimizer states with FSDP"],
        &dir,
    );
    // Adapters on part of the MLP: torchtune's apply_lora_to_mlp is all three or none.
    let part = one_gpu(&dir, "part.json", &["--lora-targets", "q,v,up,down"]);
    export_refused(&part, "torchtune", &["only up,down of the MLP"], &dir);
    assert!(export_text(&part, "peft").contains("\"up_proj\""));
    // Selective recompute is not torchtune's checkpointing; a min_lr above 0 not its schedule.
    let sel = plan_file(
        &dir,
        "sel.json",
        &[
            FT,
            H100,
            "--devices",
            "1",
            "--micro-batch",
            "2",
            "--recompute",
            "selective",
        ],
    );
    export_refused(&sel, "torchtune", &["selective recompute"], &dir);
    let spec = dir.copy_edit(FT, &[("min_lr = 0.0", "min_lr = 3e-5")]);
    let lora = plan_file(
        &dir,
        "min-lr.json",
        &[
            &s(&spec),
            RTX4090,
            "--devices",
            "1",
            "--micro-batch",
            "2",
            "--recompute",
            "full",
        ],
    );
    export_refused(
        &lora,
        "torchtune",
        &["get_cosine_schedule_with_warmup", "min_lr 0.00003"],
        &dir,
    );
    // The engines and launchers would train every weight of an adapter plan.
    for (to, why) in [
        ("megatron", "pretrain_gpt.py has no adapters"),
        ("deepspeed", "Megatron-DeepSpeed's config and flags"),
        ("torchtitan", "torchtitan 0.2 has no adapters"),
        ("sbatch", "`tessera run`"),
        ("kubernetes", "`tessera run`"),
    ] {
        export_refused(
            &part,
            to,
            &[
                "a lora fine-tune (adapters on a frozen base)",
                why,
                "export it to peft",
            ],
            &dir,
        );
    }
}
