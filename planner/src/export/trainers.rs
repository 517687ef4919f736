//! What the two trainer-side targets, Hugging Face Accelerate's config and a Lightning
//! `Trainer`, share: which of PyTorch's data-parallel engines states the plan (DDP, FSDP, or
//! DeepSpeed's ZeRO), the transformers decoder layer FSDP wraps and checkpoints, and what
//! neither can state. Both wrap a model the user's script builds: the layout is data parallel
//! only (their tensor and pipeline plugins take a model written for them).

use super::{offload, refuse, refuse_moe_or_mla, ExportError, Launch, Target};
use crate::layout::{OffloadStates, Recompute};
use crate::model::Family;
use crate::plan::Plan;

/// The data-parallel engine that states the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Engine {
    /// ZeRO-0: DistributedDataParallel.
    Ddp,
    /// ZeRO-2/3 without optimizer-only or NVMe offload: FSDP with `strategy` (PyTorch's
    /// `ShardingStrategy` name); with hybrid sharding, `replicas` groups of `shard` ranks.
    Fsdp {
        strategy: &'static str,
        hybrid: Option<(u64, u64)>,
    },
    /// ZeRO-1 (FSDP has no stage that shards only the optimizer states), optimizer-only
    /// offload (FSDP's CPUOffload moves the weights too) and NVMe (FSDP offloads to host memory
    /// only): DeepSpeed's ZeRO at the plan's stage.
    DeepSpeed,
}

/// The engine for `plan`, or why neither trainer can state it.
pub(super) fn engine(plan: &Plan, target: Target, launch: &Launch) -> Result<Engine, ExportError> {
    let p = &plan.parallel;
    let t = target;
    refuse_moe_or_mla(
        plan,
        t,
        "the export wraps a transformers model whose experts the trainer does not parallelise",
    )?;
    if p.tp > 1 || p.pp > 1 || p.cp > 1 {
        return Err(refuse(
            t,
            format!(
                "tensor, pipeline or context parallelism (TP {}, PP {}, CP {}): the export writes data parallelism only (DDP, FSDP or DeepSpeed ZeRO); {}",
                p.tp,
                p.pp,
                p.cp,
                match t {
                    Target::Accelerate => "accelerate's MEGATRON_LM plugin needs a model written for Megatron-LM and has no virtual stages, uneven splits or ring attention, so this export does not write it",
                    _ => "Lightning's ModelParallelStrategy runs the user's own parallelize function, so the plan's TP and SP placement would be the user's code, not this file",
                }
            ),
            "re-plan with --tp 1 --pp 1 --cp 1, or export to megatron or torchtitan",
        ));
    }
    if p.recompute == Recompute::Selective || p.recompute_every > 1 {
        return Err(refuse(
            t,
            "selective recompute, or full recompute of only some layers (the trainer checkpoints every decoder layer: full)",
            "re-plan with --recompute full or none",
        ));
    }
    let mut lacks = vec![(
        offload::Knob::Activations,
        match t {
            Target::Accelerate => "accelerate's fsdp_activation_checkpointing_offload is FSDP2's, and DeepSpeed's cpu_checkpointing is not among accelerate's deepspeed_config keys; this export writes FSDP1",
            _ => "Lightning's DeepSpeedStrategy(cpu_checkpointing=True) applies to the model's own deepspeed.checkpointing calls, and FSDPStrategy has no activation offload",
        },
        "re-plan without --offload-activations, or export to deepspeed or torchtune",
    )];
    if t == Target::Accelerate {
        // accelerate 1.15's launcher passes the offload devices from the config to the
        // processes but not offload_*_nvme_path (prepare_deepspeed_cmd_env): DeepSpeedPlugin
        // would build nvme_path "none". The export matrix's check found it.
        lacks.push((
            offload::Knob::Nvme,
            "accelerate 1.15's launcher does not pass offload_optimizer_nvme_path or offload_param_nvme_path from the config to DeepSpeedPlugin, which then has no NVMe folder",
            "re-plan with --offload-to cpu, or export to deepspeed or lightning",
        ));
    }
    offload::check(plan, t, &lacks)?;
    if launch.uniform().is_none() {
        return Err(refuse(
            t,
            format!(
                "{} ranks on {} (the launcher starts the same number of processes on every node)",
                launch.world,
                launch.describe()
            ),
            "re-plan with a world size that fills whole nodes",
        ));
    }
    let off = offload::of(plan);
    let deepspeed = p.zero_stage == 1 || off.states == OffloadStates::Optimizer || off.nvme();
    if deepspeed {
        if p.hybrid_shard {
            return Err(refuse(
                t,
                "hybrid sharding with ZeRO-1 or optimizer or NVMe offload, which need DeepSpeed here (DeepSpeed's ZeRO shards over every DP rank; its ZeRO++ hpZ is not the plan's per-node sharding)",
                "re-plan with --no-hybrid-shard",
            ));
        }
        return Ok(Engine::DeepSpeed);
    }
    Ok(match p.zero_stage {
        0 => Engine::Ddp,
        z => {
            let hybrid = if p.hybrid_shard {
                // Sharded inside a node (mesh order tp-dp-pp, TP 1 here), replicated across.
                let shard = plan.job.cluster.gpus_per_node.clamp(1, p.dp);
                if !p.dp.is_multiple_of(shard) {
                    return Err(refuse(
                        t,
                        format!("hybrid sharding over {shard} ranks per node, which does not divide DP {}", p.dp),
                        "re-plan with --no-hybrid-shard",
                    ));
                }
                Some((p.dp / shard, shard))
            } else {
                None
            };
            let strategy = match (z, hybrid.is_some()) {
                (3, false) => "FULL_SHARD",
                (3, true) => "HYBRID_SHARD",
                (_, false) => "SHARD_GRAD_OP",
                (_, true) => "_HYBRID_SHARD_ZERO2",
            };
            Engine::Fsdp { strategy, hybrid }
        }
    })
}

/// transformers' decoder layer of the plan's model, as (module, class): what FSDP wraps and
/// checkpoints one by one.
pub(super) fn layer_class(
    plan: &Plan,
    target: Target,
) -> Result<(&'static str, &'static str), ExportError> {
    let a = &plan.job.model.architecture;
    match a.family() {
        Family::Gpt => Ok(("transformers.models.gpt2.modeling_gpt2", "GPT2Block")),
        // Q/K/V biases without the other biases: Qwen2's layer (as the peft check builds it).
        Family::Llama if a.qkv_bias && !a.bias => {
            Ok(("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer"))
        }
        Family::Llama => Ok(("transformers.models.llama.modeling_llama", "LlamaDecoderLayer")),
        Family::Deepseek | Family::Other => Err(refuse(
            target,
            "a model of no transformers family this export knows (GPT-2's or Llama's decoder layer is what FSDP wraps)",
            "export to megatron",
        )),
    }
}
