//! A plan in the languages of the engines and schedulers users run: Megatron-LM's
//! `pretrain_gpt.py` arguments, a DeepSpeed config, a torchtitan job config, a Slurm batch
//! script and a Kubernetes indexed Job. Each writer states the plan exactly or refuses: a plan
//! feature the target lacks is an [`ExportError`] naming it, never a file that silently means
//! something else. Pure: text in, text out.

use crate::layout::Recompute;
use crate::model::{Activation, AttentionImpl, Norm, Position};
use crate::plan::Plan;
use crate::schedule::ScheduleKind;

/// The targets `tessera export --to` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Megatron,
    DeepSpeed,
    Torchtitan,
    Sbatch,
    Kubernetes,
}

impl Target {
    pub fn name(self) -> &'static str {
        match self {
            Target::Megatron => "megatron",
            Target::DeepSpeed => "deepspeed",
            Target::Torchtitan => "torchtitan",
            Target::Sbatch => "sbatch",
            Target::Kubernetes => "kubernetes",
        }
    }
}

/// The plan asks for something the target cannot express.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{target} cannot express this plan: {what}\n  fix: {fix}")]
pub struct ExportError {
    pub target: &'static str,
    pub what: String,
    pub fix: String,
}

fn refuse(target: Target, what: impl Into<String>, fix: impl Into<String>) -> ExportError {
    ExportError {
        target: target.name(),
        what: what.into(),
        fix: fix.into(),
    }
}

/// The plan in `target`'s language.
pub fn export(plan: &Plan, target: Target) -> Result<String, ExportError> {
    match target {
        Target::Megatron => megatron(plan),
        Target::DeepSpeed => deepspeed(plan),
        Target::Torchtitan => torchtitan(plan),
        Target::Sbatch => Ok(sbatch(plan)),
        Target::Kubernetes => Ok(kubernetes(plan)),
    }
}

/// Layers per pipeline stage (all chunks of a stage).
fn stage_layers(plan: &Plan) -> Vec<u64> {
    plan.stages
        .iter()
        .map(|s| s.chunks.iter().map(|c| c.layers[1] - c.layers[0]).sum())
        .collect()
}

/// Megatron-LM `pretrain_gpt.py` arguments, one per line, for a shell array.
fn megatron(plan: &Plan) -> Result<String, ExportError> {
    let t = Target::Megatron;
    let (a, tr, p) = (
        &plan.job.model.architecture,
        &plan.job.model.training,
        &plan.parallel,
    );
    if p.schedule == ScheduleKind::Gpipe && p.pp > 1 {
        return Err(refuse(
            t,
            "the GPipe schedule (Megatron-LM runs 1F1B, or interleaved 1F1B)",
            "re-plan with --schedule 1f1b or --schedule interleaved",
        ));
    }
    if p.zero_stage == 3 || p.hybrid_shard {
        return Err(refuse(
            t,
            format!(
                "ZeRO-{}{} (Megatron-LM's distributed optimizer shards the optimizer state and gradients over the whole DP group: ZeRO-1/2)",
                p.zero_stage,
                if p.hybrid_shard { " with hybrid sharding" } else { "" }
            ),
            "re-plan with --zero 1 (or 2) --no-hybrid-shard, or export to deepspeed",
        ));
    }
    let mut args: Vec<String> = vec![
        format!("--num-layers {}", a.layers),
        format!("--hidden-size {}", a.hidden),
        format!("--num-attention-heads {}", a.heads),
        format!("--ffn-hidden-size {}", a.ffn_hidden),
        format!("--seq-length {}", tr.seq_len),
        format!(
            "--max-position-embeddings {}",
            if a.position == Position::Learned {
                a.max_positions
            } else {
                tr.seq_len
            }
        ),
    ];
    if a.head_dim * a.heads != a.hidden {
        args.push(format!("--kv-channels {}", a.head_dim));
    }
    if a.kv_heads != a.heads {
        args.push("--group-query-attention".into());
        args.push(format!("--num-query-groups {}", a.kv_heads));
    }
    if a.activation == Activation::Swiglu {
        args.push("--swiglu".into());
    }
    args.push(format!(
        "--normalization {}",
        match a.norm {
            Norm::Rmsnorm => "RMSNorm",
            Norm::Layernorm => "LayerNorm",
        }
    ));
    args.push(format!(
        "--position-embedding-type {}",
        match a.position {
            Position::Rope => "rope",
            Position::Learned => "learned_absolute",
        }
    ));
    if !a.tied_embeddings {
        args.push("--untie-embeddings-and-output-weights".into());
    }
    if !a.bias {
        args.push("--disable-bias-linear".into());
        if a.qkv_bias {
            args.push("--add-qkv-bias".into());
        }
    }
    args.push(format!("--attention-dropout {}", tr.dropout));
    args.push(format!("--hidden-dropout {}", tr.dropout));
    // Megatron pads the tokenizer's vocabulary itself; the same divisor gives the plan's rows.
    args.push(format!(
        "--make-vocab-size-divisible-by {}",
        a.vocab_divisible_by
    ));
    args.push(format!("--tensor-model-parallel-size {}", p.tp));
    args.push(format!("--pipeline-model-parallel-size {}", p.pp));
    if p.virtual_stages > 1 {
        args.push(format!(
            "--num-layers-per-virtual-pipeline-stage {}",
            a.layers / (p.pp * p.virtual_stages)
        ));
    } else if p.pp > 1 {
        let per = stage_layers(plan);
        let middle = &per[1..per.len() - 1];
        let even = |v: &[u64]| v.windows(2).all(|w| w[0] == w[1]);
        if !even(&per) {
            if !even(middle) {
                return Err(refuse(
                    t,
                    format!("the uneven stage split {per:?} (Megatron-LM's flags set the first and last stages; the others must be equal)"),
                    "re-plan, or edit the split so that only the first and last stages differ",
                ));
            }
            args.push(format!("--decoder-first-pipeline-num-layers {}", per[0]));
            args.push(format!(
                "--decoder-last-pipeline-num-layers {}",
                per[per.len() - 1]
            ));
        }
    }
    if p.sequence_parallel {
        args.push("--sequence-parallel".into());
    }
    args.push(format!("--micro-batch-size {}", p.micro_batch));
    args.push(format!("--global-batch-size {}", tr.global_batch));
    match p.recompute {
        Recompute::None => {}
        Recompute::Selective if plan.job.model.training.attention == AttentionImpl::Flash => {
            return Err(refuse(
                t,
                "selective recompute under flash attention, which the plan costs as torchtitan's per-op checkpointing (Megatron-LM's selective recompute is of the attention core, which flash attention never stores)",
                "re-plan with --recompute none or full, or export to torchtitan",
            ));
        }
        Recompute::Selective => args.push("--recompute-granularity selective".into()),
        Recompute::Full if p.recompute_every > 1 => {
            // Megatron's block method recomputes the first K layers of each stage (of each
            // model chunk when interleaved), the same K in all: K = a chunk's layers / N keeps
            // the plan's share only if every chunk has N·K layers (an uneven split does not).
            let chunks: Vec<u64> = plan
                .stages
                .iter()
                .flat_map(|s| s.chunks.iter().map(|c| c.layers[1] - c.layers[0]))
                .collect();
            let n = p.recompute_every;
            if chunks
                .iter()
                .any(|c| !c.is_multiple_of(n) || *c != chunks[0])
            {
                return Err(refuse(
                    t,
                    format!("full recompute of every {n}th layer with model chunks of {chunks:?} layers (Megatron-LM's block method recomputes the same number of layers in every chunk)"),
                    "re-plan with --recompute-every dividing the layers of every chunk, on an even split",
                ));
            }
            args.push("--recompute-granularity full".into());
            args.push("--recompute-method block".into());
            args.push(format!("--recompute-num-layers {}", chunks[0] / n));
        }
        Recompute::Full => {
            args.push("--recompute-granularity full".into());
            args.push("--recompute-method uniform".into());
            args.push("--recompute-num-layers 1".into());
        }
    }
    if p.zero_stage >= 1 {
        args.push("--use-distributed-optimizer".into());
    }
    args.push("--bf16".into());
    let c = &plan.job.cluster;
    let mut out = format!(
        "# Megatron-LM pretrain_gpt.py arguments for {} on {} × {} (dp {} × tp {} × pp {}), written by tessera export.\n\
         # Launch on {} nodes × {} GPUs, e.g.: {}torchrun --nnodes {} --nproc-per-node {} pretrain_gpt.py \"${{MEGATRON_ARGS[@]}}\" <data and tokenizer arguments>\n\
         MEGATRON_ARGS=(\n",
        plan.job.model.name,
        p.world,
        c.device.name,
        p.dp,
        p.tp,
        p.pp,
        c.nodes,
        c.gpus_per_node.min(c.devices),
        // Megatron-LM's validate_args asserts it with TP > 1 (its TP communication overlap
        // relies on one hardware queue).
        if p.tp > 1 {
            "CUDA_DEVICE_MAX_CONNECTIONS=1 "
        } else {
            ""
        },
        c.nodes,
        c.gpus_per_node.min(c.devices)
    );
    for arg in args {
        out += &format!("  {arg}\n");
    }
    out += ")\n";
    Ok(out)
}

/// A DeepSpeed config (Megatron-DeepSpeed takes the TP and PP degrees as its own flags, which
/// a JSON comment cannot carry: they are in the `tessera export` message).
fn deepspeed(plan: &Plan) -> Result<String, ExportError> {
    let t = Target::DeepSpeed;
    let p = &plan.parallel;
    if p.recompute == Recompute::Selective || p.recompute_every > 1 {
        return Err(refuse(
            t,
            "selective recompute, or full recompute of only some layers (DeepSpeed's activation checkpointing is of every layer: full)",
            "re-plan with --recompute full or none",
        ));
    }
    if p.pp > 1 && p.schedule != ScheduleKind::OneFOneB {
        return Err(refuse(
            t,
            format!("the {} schedule (DeepSpeed's pipeline engine runs its own 1F1B-style schedule, without virtual stages)", p.schedule.name()),
            "re-plan with --schedule 1f1b, or export to megatron",
        ));
    }
    if p.zero_stage >= 2 && p.pp > 1 {
        return Err(refuse(
            t,
            format!("ZeRO-{} with pipeline parallelism (DeepSpeed's pipeline engine supports ZeRO stages 0 and 1)", p.zero_stage),
            "re-plan with --zero 1, or with --pp 1",
        ));
    }
    let mut config = serde_json::json!({
        "train_batch_size": plan.job.model.training.global_batch,
        "train_micro_batch_size_per_gpu": p.micro_batch,
        "gradient_accumulation_steps": p.microbatches,
        "zero_optimization": { "stage": p.zero_stage },
        "bf16": { "enabled": true },
    });
    if p.hybrid_shard {
        // ZeRO++'s hierarchical partitioning (hpZ) is not this: it keeps the states sharded
        // over every DP rank and adds a per-node copy of the parameters; DeepSpeed 0.19 no
        // longer takes MiCS's `mics_shard_size`.
        return Err(refuse(
            t,
            "hybrid sharding (the plan shards inside a node and replicates across nodes; DeepSpeed's ZeRO++ hpZ shards the states over all DP ranks and adds a per-node copy of the parameters)",
            "re-plan with --no-hybrid-shard, or export to torchtitan",
        ));
    }
    if p.recompute == Recompute::Full {
        config["activation_checkpointing"] = serde_json::json!({
            "partition_activations": false,
            "contiguous_memory_optimization": false,
            "cpu_checkpointing": false,
        });
    }
    Ok(serde_json::to_string_pretty(&config).expect("a JSON value serialises") + "\n")
}

/// The Megatron-DeepSpeed flags a DeepSpeed config cannot hold. The config's
/// `activation_checkpointing` section only configures DeepSpeed's checkpointing; Megatron-DeepSpeed
/// recomputes every layer with `--checkpoint-activations` and hands it to DeepSpeed with
/// `--deepspeed-activation-checkpointing` (megatron/model/transformer.py, `_checkpointed_forward`,
/// at f4157bea).
pub fn deepspeed_flags(plan: &Plan) -> String {
    let p = &plan.parallel;
    // Megatron-DeepSpeed keeps its own `--zero-stage` (default 1) beside the config's.
    let mut flags = format!(
        "--tensor-model-parallel-size {} --pipeline-model-parallel-size {} --zero-stage {}",
        p.tp, p.pp, p.zero_stage
    );
    if p.sequence_parallel {
        flags += " --sequence-parallel";
    }
    if p.recompute == Recompute::Full {
        flags += " --checkpoint-activations --deepspeed-activation-checkpointing";
    }
    flags
}

/// A torchtitan job config (TOML).
fn torchtitan(plan: &Plan) -> Result<String, ExportError> {
    let t = Target::Torchtitan;
    let p = &plan.parallel;
    let (shard, replicate) = match (p.zero_stage, p.hybrid_shard) {
        (0, _) => (1, p.dp),
        (3, false) => (p.dp, 1),
        (3, true) => {
            // Shard over the DP ranks inside a node (mesh order tp-dp-pp), replicate across.
            let gpn = plan.job.cluster.gpus_per_node;
            let shard = (gpn / p.tp).clamp(1, p.dp);
            if !p.dp.is_multiple_of(shard) {
                return Err(refuse(
                    t,
                    format!("hybrid sharding over {shard} ranks per node, which does not divide DP {}", p.dp),
                    "re-plan with --no-hybrid-shard",
                ));
            }
            (shard, p.dp / shard)
        }
        (z, _) => {
            return Err(refuse(
                t,
                format!("ZeRO-{z} (torchtitan shards everything with FSDP2, which is ZeRO-3, or replicates with DDP)"),
                "re-plan with --zero 3 or --zero 0",
            ))
        }
    };
    if p.tp > 1 && !p.sequence_parallel {
        return Err(refuse(
            t,
            "tensor parallelism without sequence parallelism (torchtitan's TP always shards the norms and dropouts by sequence)",
            "re-plan with --sp",
        ));
    }
    let schedule = match (p.pp, p.schedule) {
        (1, _) => "1F1B",
        (_, ScheduleKind::Gpipe) => "GPipe",
        (_, ScheduleKind::OneFOneB) => "1F1B",
        (_, ScheduleKind::Interleaved) => "Interleaved1F1B",
    };
    // Under flash attention the plan's selective recompute is torchtitan's per-op checkpointing
    // (`selective_ac_option = "op"`), and full recompute of every N-th layer its layer option.
    // Under eager attention, selective recompute is of the attention scores (Megatron's), which
    // torchtitan's SDPA kernels never store: mode "none" does that there.
    let flash = plan.job.model.training.attention == AttentionImpl::Flash;
    let (mode, note, option) = match p.recompute {
        Recompute::None => ("none", "", None),
        Recompute::Selective if flash => ("selective", "", Some("op".to_string())),
        Recompute::Selective => (
            "none",
            "# The plan recomputes the attention scores (Megatron's selective recompute); torchtitan's\n# SDPA never stores them, so no checkpointing mode is needed for that.\n",
            None,
        ),
        Recompute::Full if p.recompute_every > 1 => {
            ("selective", "", Some(p.recompute_every.to_string()))
        }
        Recompute::Full => ("full", "", None),
    };
    let tr = &plan.job.model.training;
    let mut out = format!(
        "# torchtitan job config for {} on {} devices (dp {} × tp {} × pp {}), written by tessera export.\n\
         # Model and data sections are the user's: this file sets the layout.\n\n",
        plan.job.model.name, p.world, p.dp, p.tp, p.pp
    );
    out += &format!(
        "[training]\nlocal_batch_size = {}\nseq_len = {}\n\n",
        tr.global_batch / p.dp,
        tr.seq_len
    );
    out += &format!(
        "[parallelism]\ndata_parallel_replicate_degree = {replicate}\ndata_parallel_shard_degree = {shard}\ntensor_parallel_degree = {}\npipeline_parallel_degree = {}\npipeline_parallel_schedule = \"{schedule}\"\npipeline_parallel_microbatch_size = {}\ncontext_parallel_degree = 1\n\n",
        p.tp, p.pp, p.micro_batch
    );
    if p.pp > 1 {
        // The plan's exact split, as the modules of each model part in pipeline order (the
        // names of torchtitan's Llama-family models): torchtitan's own split would differ.
        let chunks = p.pp * p.virtual_stages;
        let mut parts: Vec<String> = Vec::new();
        for vs in 0..chunks {
            let c = plan
                .stages
                .iter()
                .flat_map(|s| &s.chunks)
                .find(|c| c.virtual_stage == vs)
                .expect("a checked plan has every virtual stage");
            let mut names: Vec<String> = Vec::new();
            if c.embedding {
                names.push("\"tok_embeddings\"".into());
            }
            names.extend((c.layers[0]..c.layers[1]).map(|l| format!("\"layers.{l}\"")));
            if c.head {
                names.push("\"norm\"".into());
                names.push("\"output\"".into());
            }
            parts.push(format!("  [{}],", names.join(", ")));
        }
        out = out.replace(
            "context_parallel_degree = 1\n",
            &format!(
                "context_parallel_degree = 1\nmodule_fqns_per_model_part = [\n{}\n]\n",
                parts.join("\n")
            ),
        );
    }
    out += &format!("[activation_checkpoint]\n{note}mode = \"{mode}\"\n");
    if let Some(option) = option {
        out += &format!("selective_ac_option = \"{option}\"\n");
    }
    Ok(out)
}

/// A Slurm batch script: one task per GPU, each a `tessera run` rank (it reads Slurm's
/// variables and meets the others at the first node).
fn sbatch(plan: &Plan) -> String {
    let c = &plan.job.cluster;
    let per_node = c.gpus_per_node.min(c.devices);
    format!(
        "#!/bin/bash\n\
         # Slurm batch script for {} on {} devices (dp {} × tp {} × pp {}), written by tessera export.\n\
         #SBATCH --job-name=tessera-{}\n\
         #SBATCH --nodes={}\n\
         #SBATCH --ntasks-per-node={per_node}\n\
         #SBATCH --gpus-per-node={per_node}\n\
         #SBATCH --exclusive\n\
         set -euo pipefail\n\
         export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n\
         export MASTER_PORT=${{MASTER_PORT:-29500}}\n\
         # One task per rank; each reads SLURM_PROCID / SLURM_NTASKS (docs/cuda.md, \"Launching\").\n\
         srun tessera run \"${{PLAN:-plan.json}}\" \"$@\"\n",
        plan.job.model.name,
        plan.parallel.world,
        plan.parallel.dp,
        plan.parallel.tp,
        plan.parallel.pp,
        dns_name(&plan.job.model.name),
        c.nodes
    )
}

/// A name usable in Kubernetes and Slurm: lowercase letters, digits and dashes.
fn dns_name(name: &str) -> String {
    let s: String = name
        .to_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let s = s.trim_matches('-').to_string();
    if s.is_empty() {
        "job".into()
    } else {
        s.chars().take(40).collect()
    }
}

/// A Kubernetes indexed Job (one pod per node) and the headless Service that gives pod 0 the
/// name the others meet at; each pod runs `tessera launch` for its node.
fn kubernetes(plan: &Plan) -> String {
    let c = &plan.job.cluster;
    let per_node = c.gpus_per_node.min(c.devices);
    let name = format!("tessera-{}", dns_name(&plan.job.model.name));
    format!(
        "# Kubernetes manifest for {model} on {world} devices (dp {dp} × tp {tp} × pp {pp}), written by tessera export.\n\
         # The plan is mounted from the ConfigMap `{name}-plan` (kubectl create configmap {name}-plan --from-file=plan.json).\n\
         apiVersion: v1\n\
         kind: Service\n\
         metadata:\n\
         \x20 name: {name}\n\
         spec:\n\
         \x20 clusterIP: None\n\
         \x20 selector:\n\
         \x20   job-name: {name}\n\
         ---\n\
         apiVersion: batch/v1\n\
         kind: Job\n\
         metadata:\n\
         \x20 name: {name}\n\
         spec:\n\
         \x20 completionMode: Indexed\n\
         \x20 completions: {nodes}\n\
         \x20 parallelism: {nodes}\n\
         \x20 backoffLimit: 0\n\
         \x20 template:\n\
         \x20   spec:\n\
         \x20     subdomain: {name}\n\
         \x20     restartPolicy: Never\n\
         \x20     containers:\n\
         \x20       - name: tessera\n\
         \x20         image: tessera:latest\n\
         \x20         command:\n\
         \x20           - sh\n\
         \x20           - -c\n\
         \x20           - >-\n\
         \x20             tessera launch /plan/plan.json --nnodes {nodes} --nproc {per_node}\n\
         \x20             --node-rank $JOB_COMPLETION_INDEX --master-addr {name}-0.{name} --master-port 29500\n\
         \x20         resources:\n\
         \x20           limits:\n\
         \x20             nvidia.com/gpu: {per_node}\n\
         \x20         volumeMounts:\n\
         \x20           - name: plan\n\
         \x20             mountPath: /plan\n\
         \x20     volumes:\n\
         \x20       - name: plan\n\
         \x20         configMap:\n\
         \x20           name: {name}-plan\n",
        model = plan.job.model.name,
        world = plan.parallel.world,
        dp = plan.parallel.dp,
        tp = plan.parallel.tp,
        pp = plan.parallel.pp,
        nodes = c.nodes,
    )
}
