//! `tessera export`: each target's text for representative plans is a reviewed snapshot
//! (tests/snapshots/exports__*.snap), and a plan a target cannot express is refused with exit 2
//! and no file. docs/exports.md says how each plan field maps to each target.

mod common;

use std::path::{Path, PathBuf};

use common::*;

const LLAMA: &str = "specs/models/llama3-8b.toml";
const H100: &str = "specs/clusters/dgx-h100-80g.toml";

fn plan(dir: &Scratch, name: &str, args: &[&str]) -> PathBuf {
    plan_file(dir, name, args)
}

/// GPT-3 175B as Megatron-LM trained it (SC'21), without hybrid sharding.
fn megatron_layout(dir: &Scratch) -> PathBuf {
    let mut args = GPT3_MEGATRON_LAYOUT.to_vec();
    args.push("--no-hybrid-shard");
    plan(dir, "gpt3.json", &args)
}

/// `args` with `flag`'s value set to `value`, or with the flag and its value removed (`None`).
fn repin<'a>(args: &[&'a str], flag: &str, value: Option<&'a str>) -> Vec<&'a str> {
    let at = args
        .iter()
        .position(|a| *a == flag)
        .unwrap_or_else(|| panic!("no {flag}"));
    let mut out = args.to_vec();
    match value {
        Some(v) => out[at + 1] = v,
        None => {
            out.drain(at..at + 2);
        }
    }
    out
}

/// [`megatron_layout`] on the 1F1B schedule (no virtual stages): DeepSpeed's pipeline engine
/// runs only its own 1F1B-style schedule.
fn deepspeed_layout(dir: &Scratch) -> PathBuf {
    let mut args = repin(GPT3_MEGATRON_LAYOUT, "--schedule", Some("1f1b"));
    args = repin(&args, "--virtual-stages", None);
    args.push("--no-hybrid-shard");
    plan(dir, "gpt3-1f1b.json", &args)
}

/// Llama-3 8B on one DGX H100: DP 2 × TP 2 with SP × PP 2 (1F1B), micro-batch 1.
const LLAMA_2X2X2: [&str; 15] = [
    LLAMA,
    H100,
    "--nodes",
    "1",
    "--tp",
    "2",
    "--pp",
    "2",
    "--dp",
    "2",
    "--micro-batch",
    "1",
    "--sp",
    "--schedule",
    "1f1b",
];

/// [`LLAMA_2X2X2`] with ZeRO stage `zero` and `extra` flags.
fn llama(dir: &Scratch, name: &str, zero: &str, extra: &[&str]) -> PathBuf {
    let mut args = LLAMA_2X2X2.to_vec();
    args.extend(["--zero", zero]);
    args.extend_from_slice(extra);
    plan(dir, name, &args)
}

/// Llama-3 8B on one DGX H100 with FSDP (ZeRO-3) and TP 2 with SP, two pipeline stages.
fn fsdp_layout(dir: &Scratch) -> PathBuf {
    llama(dir, "llama.json", "3", &["--recompute", "full"])
}

fn export(plan: &Path, to: &str) -> String {
    export_text(plan, to)
}

#[test]
fn megatron_layout_exports() {
    let dir = Scratch::new();
    let p = megatron_layout(&dir);
    insta::assert_snapshot!("gpt3_megatron", export(&p, "megatron"));
    insta::assert_snapshot!(
        "gpt3_deepspeed",
        export(&deepspeed_layout(&dir), "deepspeed")
    );
    insta::assert_snapshot!("gpt3_sbatch", export(&p, "sbatch"));
    insta::assert_snapshot!("gpt3_kubernetes", export(&p, "kubernetes"));
}

#[test]
fn fsdp_layout_exports_to_torchtitan_with_the_exact_split() {
    let dir = Scratch::new();
    let p = fsdp_layout(&dir);
    let text = export(&p, "torchtitan");
    // The plan's split, module by module: stage 0 starts with the embedding, stage 1 ends
    // with the norm and the output layer.
    assert!(text.contains("[\"tok_embeddings\", \"layers.0\""), "{text}");
    assert!(
        text.contains("\"layers.31\", \"norm\", \"output\"]"),
        "{text}"
    );
    insta::assert_snapshot!("llama3_8b_torchtitan", text);
}

#[test]
fn what_a_target_cannot_express_is_refused_without_a_file() {
    let dir = Scratch::new();
    let fsdp = fsdp_layout(&dir);
    let megatron = megatron_layout(&dir);
    for (plan, to, says) in [
        (&fsdp, "megatron", "ZeRO-3"),
        (&fsdp, "deepspeed", "ZeRO-3 with pipeline parallelism"),
        (&megatron, "torchtitan", "ZeRO-1"),
        (&megatron, "deepspeed", "interleaved schedule"),
    ] {
        let out = dir.path(&format!("{to}.out"));
        let before = Inputs::of(&[plan]);
        let r = run(&["export", &s(plan), "--to", to, "-o", &s(&out)]);
        refused(&r, &[&s(plan), to, says, "fix:"]);
        assert!(!out.exists(), "{to}: a refused export wrote a file");
        before.unchanged();
    }
    // The output may not be the plan itself.
    let r = run(&["export", &s(&fsdp), "--to", "sbatch", "-o", &s(&fsdp)]);
    refused(&r, &["-o/--output", "PLAN"]);
}

#[test]
fn deepspeed_export_is_json_with_the_plan_batch() {
    let dir = Scratch::new();
    let p = deepspeed_layout(&dir);
    let v: serde_json::Value = serde_json::from_str(&export(&p, "deepspeed")).unwrap();
    assert_eq!(v["train_batch_size"], 1536);
    assert_eq!(v["train_micro_batch_size_per_gpu"], 1);
    // 1536 sequences over DP 16 with micro-batch 1: 96 micro-batches per step.
    assert_eq!(v["gradient_accumulation_steps"], 96);
    assert_eq!(v["zero_optimization"]["stage"], 1);
    // The flags the config cannot hold, recompute included (Megatron-DeepSpeed turns it on).
    let r = run(&["export", &s(&p), "--to", "deepspeed"]);
    assert!(
        r.stderr.contains("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 --zero-stage 1 --sequence-parallel --checkpoint-activations --deepspeed-activation-checkpointing"),
        "{}",
        r.stderr
    );
    // The plan's hybrid sharding (HSDP) is not DeepSpeed's hpZ.
    let hsdp = plan(
        &dir,
        "hsdp.json",
        &[
            LLAMA,
            H100,
            "--nodes",
            "2",
            "--dp",
            "16",
            "--tp",
            "1",
            "--pp",
            "1",
            "--zero",
            "3",
            "--hybrid-shard",
            "--micro-batch",
            "1",
        ],
    );
    let r = run(&["export", &s(&hsdp), "--to", "deepspeed"]);
    refused(&r, &["hybrid sharding", "hpZ", "fix:"]);
}

/// Runs `program args…` with `input` on stdin; `None` when the program is not installed.
fn check_with(program: &str, args: &[&str], input: &str) -> Option<std::process::Output> {
    use std::io::Write;
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(input.as_bytes()).ok()?;
    child.wait_with_output().ok()
}

#[test]
fn each_export_parses_in_its_own_language() {
    let dir = Scratch::new();
    let gpt3 = megatron_layout(&dir);
    let llama = fsdp_layout(&dir);
    // torchtitan reads TOML.
    let t: toml::Table = toml::from_str(&export(&llama, "torchtitan")).expect("valid TOML");
    assert_eq!(
        t["parallelism"]["tensor_parallel_degree"].as_integer(),
        Some(2)
    );
    // The Megatron arguments and the Slurm script are bash.
    for to in ["megatron", "sbatch"] {
        match check_with("bash", &["-n"], &export(&gpt3, to)) {
            Some(o) => assert!(
                o.status.success(),
                "{to}: {}",
                String::from_utf8_lossy(&o.stderr)
            ),
            None => eprintln!("skipped: no bash to check the {to} export"),
        }
    }
    // The Kubernetes manifest is two YAML documents: a Service and an indexed Job.
    let yaml = "import sys, yaml\nd = list(yaml.safe_load_all(sys.stdin))\nassert [x['kind'] for x in d] == ['Service', 'Job'], d\nassert d[1]['spec']['completionMode'] == 'Indexed'\nassert d[1]['spec']['completions'] == 128\n";
    match check_with("python3", &["-c", yaml], &export(&gpt3, "kubernetes")) {
        Some(o) if String::from_utf8_lossy(&o.stderr).contains("No module named 'yaml'") => {
            eprintln!("skipped: no PyYAML to check the kubernetes export")
        }
        Some(o) => assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr)),
        None => eprintln!("skipped: no python3 to check the kubernetes export"),
    }
}

/// The recompute policies as the engines name them: under flash attention the plan's
/// selective recompute is torchtitan's per-op checkpointing, and full recompute of every N-th
/// layer is torchtitan's layer option and Megatron-LM's block method.
#[test]
fn recompute_policies_export_as_the_engines_name_them() {
    let dir = Scratch::new();
    // torchtitan shards with FSDP2 (ZeRO-3); Megatron-LM with its distributed optimizer (1).
    let with = |name: &str, zero: &str, extra: &[&str]| llama(&dir, name, zero, extra);
    let op = with("op.json", "3", &["--recompute", "selective"]);
    let text = export(&op, "torchtitan");
    assert!(
        text.contains("mode = \"selective\"\nselective_ac_option = \"op\""),
        "{text}"
    );
    // Megatron's selective recompute is of the attention core, which flash never stores.
    let op1 = with("op1.json", "1", &["--recompute", "selective"]);
    let r = run(&["export", &s(&op1), "--to", "megatron"]);
    refused(&r, &["per-op checkpointing", "fix:"]);
    // Llama-3 8B: 32 layers, 16 per stage under ZeRO-3; every 4th layer is 4 of each
    // stage's 16, and torchtitan's count (each rank's layers from 1) picks the plan's.
    let every = with(
        "every.json",
        "3",
        &["--recompute", "full", "--recompute-every", "4"],
    );
    let text = export(&every, "torchtitan");
    assert!(
        text.contains("mode = \"selective\"\nselective_ac_option = \"4\""),
        "{text}"
    );
    // Megatron-LM recomputes the same number of layers in every stage (its block method):
    // the planner keeps every chunk a multiple of N layers, 16 + 16 here, 4 of each; one stage
    // of 32 layers recomputes 8 (tests/export_plan.rs feeds an uneven split to the writer).
    let every1 = with(
        "every1.json",
        "1",
        &["--recompute", "full", "--recompute-every", "4"],
    );
    let text = export(&every1, "megatron");
    assert!(
        text.contains("--recompute-method block") && text.contains("--recompute-num-layers 4"),
        "{text}"
    );
    let mut one_stage = repin(&LLAMA_2X2X2, "--pp", Some("1"));
    one_stage = repin(&one_stage, "--dp", Some("4"));
    one_stage.extend([
        "--zero",
        "1",
        "--recompute",
        "full",
        "--recompute-every",
        "4",
    ]);
    let one_stage = plan(&dir, "every-pp1.json", &one_stage);
    let text = export(&one_stage, "megatron");
    assert!(
        text.contains("--recompute-granularity full")
            && text.contains("--recompute-method block")
            && text.contains("--recompute-num-layers 8")
            && text.contains("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun"),
        "{text}"
    );
    let r = run(&["export", &s(&every1), "--to", "deepspeed"]);
    refused(&r, &["only some layers", "fix:"]);
}
