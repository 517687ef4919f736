//! A DeepSpeed config (JSON, through serde_json). Megatron-DeepSpeed takes the TP and PP
//! degrees as its own flags, which a JSON config cannot carry: [`deepspeed_flags`] prints them.

use super::{offload, refuse, refuse_moe_or_mla, stage_layers, ExportError, Target};
use crate::layout::Recompute;
use crate::optimizer::{DecayOn, DecayShape};
use crate::plan::Plan;
use crate::schedule::ScheduleKind;

pub(super) fn deepspeed(plan: &Plan) -> Result<String, ExportError> {
    let t = Target::DeepSpeed;
    let p = &plan.parallel;
    refuse_moe_or_mla(
        plan,
        t,
        "DeepSpeed-MoE's layer and its expert groups are not what the plan costs: Megatron-Core's all-to-all dispatcher with EP cut from DP × CP",
    )?;
    if p.cp > 1 {
        return Err(refuse(
            t,
            format!("context parallelism {} (Megatron-DeepSpeed splits sequences with DeepSpeed-Ulysses' all-to-all over heads, not the plan's ring attention)", p.cp),
            "export to megatron (--context-parallel-size) or torchtitan (context_parallel_degree)",
        ));
    }
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
    let per = stage_layers(plan);
    if p.pp > 1 && per.iter().any(|&l| l != per[0]) {
        // Megatron-DeepSpeed builds its PipelineModule with partition_method
        // "type:transformer", which balances the transformer layers over the stages itself:
        // equal stages, whatever the plan's split.
        return Err(refuse(
            t,
            format!("the uneven stage split {per:?} (Megatron-DeepSpeed's PipelineModule, partition_method \"type:transformer\", balances the transformer layers over the stages itself: equal stages)"),
            "re-plan with a --pp that divides the layers, or export to megatron or torchtitan",
        ));
    }
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
    let o = &plan.job.model.optimizer;
    let weight_decay = optimizer_checks(plan)?;
    let mut config = serde_json::json!({
        "train_batch_size": plan.job.model.training.global_batch,
        "train_micro_batch_size_per_gpu": p.micro_batch,
        "gradient_accumulation_steps": p.microbatches,
        "zero_optimization": { "stage": p.zero_stage },
        "bf16": { "enabled": true },
        // DeepSpeed's AdamW over the client's parameter groups (Megatron-DeepSpeed's: no decay
        // for biases and norm weights); the schedule is the client's (`deepspeed_flags`).
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": o.lr,
                "betas": [o.beta1, o.beta2],
                "eps": o.eps,
                "weight_decay": weight_decay,
            },
        },
        "gradient_clipping": o.clip_grad,
    });
    let off = offload::of(plan);
    if off.activations && p.recompute != Recompute::Full {
        // DeepSpeed moves to the host only the inputs it checkpoints (`cpu_checkpointing`):
        // without recompute nothing is checkpointed, and nothing moves.
        return Err(refuse(
            t,
            "activation offload without recompute (parallel.offload_activations = true: DeepSpeed's cpu_checkpointing moves the checkpointed layer inputs to the host, and without activation checkpointing there are none)",
            "re-plan with --recompute full, or without --offload-activations",
        ));
    }
    if p.recompute == Recompute::Full {
        config["activation_checkpointing"] = serde_json::json!({
            "partition_activations": false,
            "contiguous_memory_optimization": false,
            "cpu_checkpointing": off.activations,
        });
    }
    // ZeRO-Offload and ZeRO-Infinity: the optimizer (fp32 master weights, moments, the step on
    // DeepSpeed's CPU-Adam) and, for params, the sharded weights on the host or on NVMe.
    let tier = |nvme: bool| {
        let mut section = serde_json::json!({
            "device": off.to.name(),
            "pin_memory": true,
        });
        if nvme {
            section["nvme_path"] = serde_json::json!(offload::NVME_PATH);
        }
        section
    };
    if off.optimizer() {
        config["zero_optimization"]["offload_optimizer"] = tier(off.nvme());
    }
    if off.params() {
        config["zero_optimization"]["offload_param"] = tier(off.nvme());
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
    // The learning-rate schedule: Megatron-DeepSpeed's own scheduler, which it hands to
    // DeepSpeed (the config has no `scheduler` section). Its decay ends at --train-iters
    // unless --lr-decay-iters says otherwise, as the plan's ends at the run's steps.
    let (o, s) = (&plan.job.model.optimizer, &plan.job.model.schedule);
    flags += &format!(
        " --lr {} --min-lr {} --lr-warmup-iters {} --lr-decay-style {}",
        o.lr,
        o.min_lr,
        s.warmup_steps,
        s.decay.name()
    );
    if let Some(d) = s.decay_steps {
        flags += &format!(" --lr-decay-iters {d}");
    }
    flags
}

/// What a DeepSpeed config (with Megatron-DeepSpeed as the client) cannot state of the
/// optimizer and schedule; the weight decay to write.
fn optimizer_checks(plan: &Plan) -> Result<f64, ExportError> {
    let t = Target::DeepSpeed;
    let (o, s) = (&plan.job.model.optimizer, &plan.job.model.schedule);
    if s.decay == DecayShape::Wsd {
        return Err(refuse(
            t,
            "the WSD learning-rate decay (DeepSpeed's schedulers and Megatron-DeepSpeed's --lr-decay-style have none: constant, linear, cosine)",
            "set decay = \"cosine\", \"linear\" or \"constant\" under [schedule], or export to megatron or torchtitan",
        ));
    }
    match o.decay_on {
        DecayOn::None => Ok(0.0),
        DecayOn::All if o.weight_decay > 0.0 => Err(refuse(
            t,
            "weight decay on every tensor (optimizer.decay_on = \"all\"): Megatron-DeepSpeed's parameter groups never decay biases and norm weights",
            "set decay_on = \"matrices\" (or weight_decay = 0) under [optimizer] and re-plan",
        )),
        _ => Ok(o.weight_decay),
    }
}
