//! An export states the plan or refuses: the world size and ranks per node, GPUs or none, the
//! batch per forward and micro-batches per step, the layers of every (virtual) stage, the
//! recomputed layers, the job token, and a plan marked infeasible, each derived from the plan
//! (docs/exports.md). The engines' own parsers read these in scripts/check-exports.sh matrix.

mod common;

use std::path::PathBuf;

use common::*;

const LLAMA: &str = "specs/models/llama3-8b.toml";
const H100: &str = "specs/clusters/dgx-h100-80g.toml";

/// Plans Llama-3 8B on `cluster` with `pins` (flags separated by spaces) into `dir/name`.
fn llama_on(dir: &Scratch, name: &str, cluster: &str, pins: &str) -> PathBuf {
    let mut args = vec![LLAMA, cluster];
    args.extend(pins.split_whitespace());
    plan_file(dir, name, &args)
}

/// [`llama_on`] the DGX H100 preset.
fn llama(dir: &Scratch, name: &str, pins: &str) -> PathBuf {
    llama_on(dir, name, H100, pins)
}

/// Llama-3 8B on 12 H100s of two DGX nodes (a node and a half): DP 2 × TP 2 × PP 3, ZeRO-1.
fn twelve(dir: &Scratch) -> PathBuf {
    let two_nodes = dir.copy_edit(H100, &[("nodes = 1", "nodes = 2")]);
    let c = s(&two_nodes);
    llama_on(dir, "twelve.json", &c, "--devices 12 --tp 2 --pp 3 --dp 2 --micro-batch 1 --sp --schedule 1f1b --zero 1 --recompute full")
}

#[test]
fn a_world_that_leaves_the_last_node_part_full_is_stated_or_refused() {
    let dir = Scratch::new();
    let p = twelve(&dir);
    // Megatron's launch line names both node sizes; nothing says 2 × 8 = 16.
    let text = export_text(&p, "megatron");
    assert!(
        text.contains("Launch 12 ranks on 1 node × 8 GPUs and 1 node × 4 GPUs")
            && text.contains("--nproc-per-node 8 (on the last node: 4)"),
        "{text}"
    );
    // One task count per node cannot place 8 + 4 ranks as the mesh does.
    for to in ["sbatch", "kubernetes"] {
        let r = run(&["export", &s(&p), "--to", to]);
        refused(
            &r,
            &["12 ranks", "1 node × 4 GPUs", "--devices a multiple of 8"],
        );
    }
}

#[test]
fn multi_node_exports_have_the_plans_world_and_a_job_token() {
    let dir = Scratch::new();
    let p = llama(
        &dir,
        "two-nodes.json",
        "--nodes 2 --tp 2 --pp 1 --dp 8 --micro-batch 1 --sp --zero 1 --recompute full",
    );
    let sb = export_text(&p, "sbatch");
    for line in [
        "#SBATCH --nodes=2\n",
        "#SBATCH --ntasks=16\n",
        "#SBATCH --ntasks-per-node=8\n",
        "#SBATCH --gpus-per-node=8\n",
    ] {
        assert!(sb.contains(line), "{line}{sb}");
    }
    let k8s = export_text(&p, "kubernetes");
    let docs: Vec<serde_yaml_ng::Value> = k8s
        .split("\n---\n")
        .map(|d| serde_yaml_ng::from_str(d).unwrap())
        .collect();
    let job = &docs[1];
    assert_eq!(job["spec"]["completions"].as_u64(), Some(2));
    let c = &job["spec"]["template"]["spec"]["containers"][0];
    let cmd: Vec<&str> = c["command"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let at = |flag: &str| cmd[cmd.iter().position(|a| *a == flag).unwrap() + 1];
    assert_eq!(
        (at("--nnodes"), at("--nproc"), at("--node-rank")),
        ("2", "8", "$(JOB_COMPLETION_INDEX)")
    );
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"].as_u64(), Some(8));
    let env = &c["env"][0];
    assert_eq!(env["name"].as_str(), Some("TESSERA_JOB_TOKEN"), "{k8s}");
    assert_eq!(
        env["valueFrom"]["secretKeyRef"]["name"].as_str(),
        Some("tessera-llama3-8b-token")
    );
    assert!(k8s.contains("kubectl create secret generic tessera-llama3-8b-token"));
}

#[test]
fn a_cpu_plan_asks_for_no_gpus_and_the_gpu_engines_refuse_it() {
    let dir = Scratch::new();
    let p = tiny_plan(&dir);
    let sb = export_text(&p, "sbatch");
    assert!(
        !sb.contains("gpu")
            && sb.contains("#SBATCH --ntasks=1\n")
            && sb.contains("#SBATCH --nodes=1\n"),
        "{sb}"
    );
    let k8s = export_text(&p, "kubernetes");
    assert!(
        !k8s.contains("nvidia.com/gpu") && !k8s.contains("launch"),
        "{k8s}"
    );
    let job: serde_yaml_ng::Value = serde_yaml_ng::from_str(&k8s).unwrap();
    assert_eq!(job["spec"]["completions"].as_u64(), Some(1));
    for to in ["megatron", "deepspeed", "torchtitan"] {
        let r = run(&["export", &s(&p), "--to", to]);
        refused(&r, &["CPU cluster", "cpu-8", "tessera run"]);
    }
}

#[test]
fn an_infeasible_plan_is_refused_unless_forced() {
    let dir = Scratch::new();
    // Llama-3 8B without any sharding on one H100 per replica does not fit in 80 GiB.
    let p = llama(
        &dir,
        "oom.json",
        "--nodes 1 --tp 1 --pp 1 --dp 8 --micro-batch 8 --zero 0 --recompute none --force",
    );
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    assert_eq!(v["feasible"], false);
    for to in [
        "megatron",
        "deepspeed",
        "torchtitan",
        "sbatch",
        "kubernetes",
    ] {
        let out = dir.path(&format!("oom.{to}"));
        let r = run(&["export", &s(&p), "--to", to, "-o", &s(&out)]);
        refused(&r, &["\"feasible\": false", "--force"]);
        assert!(!out.exists());
    }
    let r = run(&["export", &s(&p), "--to", "sbatch", "--force"]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
}

/// torchtitan 0.2's trainer: accumulation = global / (local × DP); with PP, local / micro-batch
/// pipeline micro-batches.
#[test]
fn torchtitan_batches_are_the_plans_micro_batches() {
    let dir = Scratch::new();
    // PP 1: 512 sequences on DP 4 at micro-batch 2 is 64 accumulation steps of 2.
    let pp1 = llama(
        &dir,
        "pp1.json",
        "--nodes 1 --tp 2 --pp 1 --dp 4 --micro-batch 2 --sp --zero 3 --recompute full",
    );
    let v: toml::Table = toml::from_str(&export_text(&pp1, "torchtitan")).unwrap();
    let t = &v["training"];
    assert_eq!(
        (
            t["local_batch_size"].as_integer(),
            t["global_batch_size"].as_integer()
        ),
        (Some(2), Some(512))
    );
    // PP 2: one accumulation step, split into the plan's 256 pipeline micro-batches of 1.
    let pp2 = llama(&dir, "pp2.json", "--nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --schedule 1f1b --zero 3 --recompute full");
    let v: toml::Table = toml::from_str(&export_text(&pp2, "torchtitan")).unwrap();
    assert_eq!(v["training"]["local_batch_size"].as_integer(), Some(256));
    assert_eq!(
        v["parallelism"]["pipeline_parallel_microbatch_size"].as_integer(),
        Some(1)
    );
}

/// Unequal model chunks: Megatron gets every virtual stage's layers, never
/// layers / (PP · v) per virtual stage; DeepSpeed, which balances the layers itself, refuses.
#[test]
fn unequal_chunks_are_stated_exactly_or_refused() {
    let dir = Scratch::new();
    // 32 layers on PP 2 × 3 virtual stages: six chunks that cannot all be equal.
    let p = llama(&dir, "uneven.json", "--nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --schedule interleaved --virtual-stages 3 --zero 1 --recompute full");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let mut chunks: Vec<(u64, u64, bool, bool)> = doc["stages"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["chunks"].as_array().unwrap().clone())
        .map(|c| {
            (
                c["virtual_stage"].as_u64().unwrap(),
                c["layers"][1].as_u64().unwrap() - c["layers"][0].as_u64().unwrap(),
                c["embedding"].as_bool().unwrap(),
                c["head"].as_bool().unwrap(),
            )
        })
        .collect();
    chunks.sort();
    let want: Vec<String> = chunks
        .iter()
        .map(|&(_, n, e, h)| {
            format!(
                "{}{}{}",
                if e { "E" } else { "" },
                "t".repeat(n as usize),
                if h { "L" } else { "" }
            )
        })
        .collect();
    let text = export_text(&p, "megatron");
    assert!(
        text.contains(&format!(
            "--pipeline-model-parallel-layout '{}'",
            want.join("|")
        )),
        "{text}"
    );
    assert!(
        !text.contains("--num-layers-per-virtual-pipeline-stage"),
        "{text}"
    );
    // The planner splits 32 layers on two 1F1B stages as 17 + 15 (the embedding and the head
    // weigh on the end stages); Megatron-DeepSpeed's PipelineModule would run 16 + 16.
    let p = llama(&dir, "split.json", "--nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --schedule 1f1b --zero 1 --recompute full");
    let r = run(&["export", &s(&p), "--to", "deepspeed"]);
    refused(
        &r,
        &["uneven stage split [17, 15]", "type:transformer", "fix:"],
    );
}

/// torchtitan counts each rank's layers from 1 (`_apply_layer_sac`): on a split whose second
/// stage starts at layer 17 it would recompute layers 20, 24, 28, where the plan recomputes
/// 19, 23, 27, 31. The planner no longer writes such a plan (the chunks must hold multiples of
/// N), so the writer is fed one directly.
#[test]
fn writers_refuse_every_nth_layer_they_would_count_differently() {
    use tessera_planner::export::{export, Target};
    use tessera_planner::plan::Plan;
    let dir = Scratch::new();
    let p = llama(&dir, "every.json", "--nodes 1 --tp 2 --pp 2 --dp 2 --micro-batch 1 --sp --schedule 1f1b --zero 3 --recompute full --recompute-every 4");
    let mut plan: Plan = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    assert!(export(&plan, Target::Torchtitan).is_ok());
    plan.stages[0].chunks[0].layers = [0, 17];
    plan.stages[1].chunks[0].layers = [17, 32];
    let e = export(&plan, Target::Torchtitan).unwrap_err().to_string();
    assert!(
        e.contains("every 4th layer") && e.contains("[3, 7, 11, 15, 20, 24, 28]"),
        "{e}"
    );
    // Megatron-LM's block method recomputes the same K layers in every chunk: 4 and 4 would
    // be charged 4 and 3.
    plan.parallel.zero_stage = 1;
    let e = export(&plan, Target::Megatron).unwrap_err().to_string();
    assert!(
        e.contains("every 4th layer") && e.contains("[17, 15]"),
        "{e}"
    );
}
