//! Megatron-LM `pretrain_gpt.py` arguments: a bash array, one argument line per flag, every
//! word quoted by `shlex`.

use super::offload::{self, Knob};
use super::{chunk_layers, comment_text, refuse, stage_layers, ExportError, Launch, Target};
use crate::layout::Recompute;
use crate::model::{Activation, AttentionImpl, Norm, Position};
use crate::optimizer::{DecayOn, DecayShape};
use crate::plan::Plan;
use crate::schedule::ScheduleKind;

/// One argument line: a flag and its value, if any.
fn arg(flag: &str, value: impl ToString) -> Vec<String> {
    vec![flag.to_string(), value.to_string()]
}

fn flag(flag: &str) -> Vec<String> {
    vec![flag.to_string()]
}

/// Megatron-Core's MoE arguments for the plan's model and EP (megatron/training/arguments.py,
/// `_add_moe_args`): the all-to-all token dispatcher the plan costs, the router as the model
/// spec states it, and the layer pattern (`--moe-layer-freq` takes an integer or a Python list
/// expression of 0/1 per layer).
fn moe_args(plan: &Plan, m: &crate::model::Moe) -> Result<Vec<Vec<String>>, ExportError> {
    let t = Target::Megatron;
    let a = &plan.job.model.architecture;
    if m.shared_experts > 0 && m.shared_expert_gate {
        return Err(refuse(
            t,
            "a sigmoid gate on the shared experts (Qwen2-MoE's `shared_expert_gate`)",
            "export the plan's parallel layout by hand, or plan the model without the gate",
        ));
    }
    if let Some(layers) = &m.moe_layers {
        if layers.iter().any(|l| *l >= a.layers) {
            return Err(refuse(
                t,
                "an MoE layer list naming layers past the model's last",
                "fix architecture.moe_layers",
            ));
        }
    }
    let mut out = vec![
        arg("--num-experts", m.experts),
        arg("--moe-router-topk", m.experts_per_token),
        arg("--moe-ffn-hidden-size", m.moe_ffn_hidden),
        arg("--moe-token-dispatcher-type", "alltoall"),
        arg("--moe-router-load-balancing-type", "aux_loss"),
        arg("--moe-aux-loss-coeff", m.router_aux_loss_coef),
    ];
    if plan.parallel.ep > 1 {
        out.push(arg("--expert-model-parallel-size", plan.parallel.ep));
    }
    let every_layer = m.moe_layers.is_none() && m.first_dense_layers == 0;
    if every_layer {
        if m.moe_layer_frequency > 1 {
            out.push(arg("--moe-layer-freq", m.moe_layer_frequency));
        }
    } else {
        let pattern: Vec<&str> = (0..a.layers)
            .map(|l| if m.is_moe_layer(l) { "1" } else { "0" })
            .collect();
        out.push(arg("--moe-layer-freq", format!("[{}]", pattern.join(","))));
    }
    if m.shared_experts > 0 {
        out.push(arg(
            "--moe-shared-expert-intermediate-size",
            m.shared_experts * m.shared_expert_ffn_hidden,
        ));
    }
    if let Some(cf) = m.capacity_factor {
        out.push(arg("--moe-expert-capacity-factor", cf));
    }
    match m.router_scoring {
        crate::model::RouterScoring::Softmax => {
            // Megatron's default takes the top-k of the logits and softmaxes them, which is
            // the softmax's top-k renormalised; without renormalisation the softmax comes
            // first.
            if !m.normalize_top_k {
                out.push(flag("--moe-router-pre-softmax"));
            }
        }
        crate::model::RouterScoring::Sigmoid => {
            out.push(arg("--moe-router-score-function", "sigmoid"));
        }
    }
    if m.router_score_bias {
        out.push(flag("--moe-router-enable-expert-bias"));
    }
    if m.routed_scaling_factor != 1.0 {
        out.push(arg(
            "--moe-router-topk-scaling-factor",
            m.routed_scaling_factor,
        ));
    }
    if m.expert_groups > 1 {
        out.push(arg("--moe-router-num-groups", m.expert_groups));
        out.push(arg("--moe-router-group-topk", m.expert_groups_per_token));
    }
    Ok(out)
}

/// Megatron-LM's `--pipeline-model-parallel-layout`: every virtual stage in pipeline order
/// (virtual stage v·PP + p is model chunk v of stage p, as the plan numbers them), separated by
/// `|`; `E` the embedding, `t` a decoder layer, `L` the output layer and loss
/// (megatron/core/transformer/pipeline_parallel_layer_layout.py).
fn layout_string(plan: &Plan) -> String {
    super::chunks_in_order(plan)
        .iter()
        .map(|c| {
            let mut s = String::new();
            if c.embedding {
                s.push('E');
            }
            s.push_str(&"t".repeat((c.layers[1] - c.layers[0]) as usize));
            if c.head {
                s.push('L');
            }
            s
        })
        .collect::<Vec<_>>()
        .join("|")
}

/// Megatron-LM's `--fp8-format` for a recipe (`None`: no FP8); the recipe itself was checked
/// against Megatron's choices (`super::fp8_supported`).
fn fp8_format(r: crate::fp8::Recipe) -> Option<&'static str> {
    match r {
        crate::fp8::Recipe::None => None,
        crate::fp8::Recipe::Blockwise => Some("e4m3"),
        _ => Some("hybrid"),
    }
}

pub(super) fn megatron(plan: &Plan, launch: &Launch) -> Result<String, ExportError> {
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
    if p.schedule.splits_backward() && p.pp > 1 {
        // Megatron-Core 0.19's pipeline schedules (pipeline_parallel/schedules.py) are 1F1B
        // and interleaved 1F1B; its `delay_wgrad_compute` only defers MoE expert weight
        // gradients for the all-to-all overlap, not a zero-bubble pipeline schedule.
        return Err(refuse(
            t,
            format!(
                "the {} schedule (Megatron-Core 0.19 runs 1F1B and interleaved 1F1B; the zero-bubble and DualPipe schedules are in forks: sail-sg/zero-bubble-pipeline-parallelism, deepseek-ai/DualPipe)",
                p.schedule.name()
            ),
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
    let mut args: Vec<Vec<String>> = vec![
        arg("--num-layers", a.layers),
        arg("--hidden-size", a.hidden),
        arg("--num-attention-heads", a.heads),
        arg("--ffn-hidden-size", a.ffn_hidden),
        arg("--seq-length", tr.seq_len),
        arg(
            "--max-position-embeddings",
            if a.position == Position::Learned {
                a.max_positions
            } else {
                tr.seq_len
            },
        ),
    ];
    if a.head_dim * a.heads != a.hidden {
        args.push(arg("--kv-channels", a.head_dim));
    }
    if let Some(mla) = &a.mla {
        // Megatron-Core's MLA (megatron/core/transformer/multi_latent_attention.py), its
        // latent norms switched on by --qk-layernorm, as DeepSeek-V3's Megatron recipes do.
        args.push(flag("--multi-latent-attention"));
        if let Some(r) = mla.q_lora_rank {
            args.push(arg("--q-lora-rank", r));
        }
        args.push(arg("--kv-lora-rank", mla.kv_lora_rank));
        args.push(arg("--qk-head-dim", mla.qk_nope_head_dim));
        args.push(arg("--qk-pos-emb-head-dim", mla.qk_rope_head_dim));
        args.push(arg("--v-head-dim", mla.v_head_dim));
        args.push(flag("--qk-layernorm"));
    } else if a.qk_norm {
        args.push(flag("--qk-layernorm"));
    }
    if a.kv_heads != a.heads && a.mla.is_none() {
        args.push(flag("--group-query-attention"));
        args.push(arg("--num-query-groups", a.kv_heads));
    }
    if a.activation == Activation::Swiglu {
        args.push(flag("--swiglu"));
    }
    args.push(arg(
        "--normalization",
        match a.norm {
            Norm::Rmsnorm => "RMSNorm",
            Norm::Layernorm => "LayerNorm",
        },
    ));
    args.push(arg(
        "--position-embedding-type",
        match a.position {
            Position::Rope => "rope",
            Position::Learned => "learned_absolute",
        },
    ));
    if !a.tied_embeddings {
        args.push(flag("--untie-embeddings-and-output-weights"));
    }
    if !a.bias {
        args.push(flag("--disable-bias-linear"));
        if a.qkv_bias {
            args.push(flag("--add-qkv-bias"));
        }
    }
    args.push(arg("--attention-dropout", tr.dropout));
    args.push(arg("--hidden-dropout", tr.dropout));
    // Megatron pads the tokenizer's vocabulary itself; the same divisor gives the plan's rows.
    args.push(arg("--make-vocab-size-divisible-by", a.vocab_divisible_by));
    args.push(arg("--tensor-model-parallel-size", p.tp));
    args.push(arg("--pipeline-model-parallel-size", p.pp));
    if p.cp > 1 {
        // Megatron-Core's ring attention (TE's `attn_func_with_cp`, p2p K/V exchange).
        args.push(arg("--context-parallel-size", p.cp));
        if p.cp_comm == crate::layout::CpComm::AllGather {
            args.push(arg("--cp-comm-type", "all_gather"));
        }
    }
    if let Some(m) = &a.moe {
        args.extend(moe_args(plan, m)?);
    }
    let chunks = chunk_layers(plan);
    if p.virtual_stages > 1 {
        if chunks.iter().all(|&c| c == chunks[0]) {
            args.push(arg("--num-layers-per-virtual-pipeline-stage", chunks[0]));
        } else {
            // Unequal model chunks (e.g. Llama 3's first and last stages a layer short): the
            // layout flag states every virtual stage's layers; `--num-layers-per-virtual-
            // pipeline-stage` would build a different number of virtual stages.
            args.push(arg("--pipeline-model-parallel-layout", layout_string(plan)));
        }
    } else if p.pp > 1 {
        let per = stage_layers(plan);
        let middle = &per[1..per.len() - 1];
        let even = |v: &[u64]| v.windows(2).all(|w| w[0] == w[1]);
        if !even(&per) {
            if even(middle) {
                args.push(arg("--decoder-first-pipeline-num-layers", per[0]));
                args.push(arg(
                    "--decoder-last-pipeline-num-layers",
                    per[per.len() - 1],
                ));
            } else {
                args.push(arg("--pipeline-model-parallel-layout", layout_string(plan)));
            }
        }
    }
    if p.sequence_parallel {
        args.push(flag("--sequence-parallel"));
    }
    args.push(arg("--micro-batch-size", p.micro_batch));
    args.push(arg("--global-batch-size", tr.global_batch));
    match p.recompute {
        Recompute::None => {}
        Recompute::Selective if tr.attention == AttentionImpl::Flash => {
            return Err(refuse(
                t,
                "selective recompute under flash attention, which the plan costs as torchtitan's per-op checkpointing (Megatron-LM's selective recompute is of the attention core, which flash attention never stores)",
                "re-plan with --recompute none or full, or export to torchtitan",
            ));
        }
        Recompute::Selective => args.push(arg("--recompute-granularity", "selective")),
        Recompute::Full if p.recompute_every > 1 => {
            // Megatron's block method recomputes the first K layers of each stage (of each
            // model chunk when interleaved), the same K in all: K = a chunk's layers / N keeps
            // the plan's count per chunk only if every chunk has N·K layers.
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
            args.push(arg("--recompute-granularity", "full"));
            args.push(arg("--recompute-method", "block"));
            args.push(arg("--recompute-num-layers", chunks[0] / n));
        }
        Recompute::Full => {
            args.push(arg("--recompute-granularity", "full"));
            args.push(arg("--recompute-method", "uniform"));
            args.push(arg("--recompute-num-layers", 1));
        }
    }
    if p.zero_stage >= 1 {
        args.push(flag("--use-distributed-optimizer"));
    }
    offload::check(
        plan,
        t,
        &[
            (Knob::Params, "Megatron-LM offloads the distributed optimizer's states and step only (--optimizer-cpu-offload); its weights stay on the device", "re-plan with --offload optimizer, or export to deepspeed or torchtitan"),
            (Knob::Nvme, "Megatron-LM's optimizer offload is to host memory only", "re-plan with --offload-to cpu, or export to deepspeed"),
            (Knob::Activations, "this export writes no activation offload: Megatron-LM's --cpu-offloading-num-layers is Transformer Engine's, per layer, not the plan's", "re-plan without --offload-activations, or export to deepspeed or torchtune"),
        ],
    )?;
    if offload::of(plan).optimizer() {
        // The hybrid-device optimizer: all of the distributed optimizer's shard on the host
        // (fraction 1.0, the plan's). validate_args asserts the precision-aware optimizer with
        // it ("the hybrid device optimizer reuses the code path of this flag"); its main
        // weights and moments stay fp32 by default, as the plan's.
        args.push(flag("--optimizer-cpu-offload"));
        args.push(arg("--optimizer-offload-fraction", "1.0"));
        args.push(flag("--use-precision-aware-optimizer"));
    }
    optimizer_args(plan, &mut args)?;
    // The whole run: the budget's iterations (Megatron decays the rate over them unless
    // --lr-decay-iters says otherwise) and the plan's checkpoint cadence.
    if let Some(w) = &plan.predicted.whole_run {
        args.push(arg("--train-iters", w.steps));
    }
    if let Some(c) = &plan.predicted.checkpoint {
        args.push(arg("--save-interval", c.save_every));
    }
    args.push(flag("--bf16"));
    // FP8 on top of bf16 (Transformer Engine): E4M3 forward and E5M2 gradients ("hybrid", TE's
    // default format), or E4M3 everywhere for DeepSeek-V3's blockwise recipe (report §3.3.2).
    if let Some(format) = fp8_format(tr.fp8) {
        args.push(arg("--fp8-format", format));
        args.push(arg("--fp8-recipe", tr.fp8.name()));
    }
    // TP collectives overlapped with the GEMMs (Transformer Engine's userbuffers), which
    // Megatron asserts sequence parallelism for (`super::tp_overlap_supported` checked it).
    if tr.tp_comm_overlap && p.tp > 1 {
        args.push(flag("--tp-comm-overlap"));
    }
    // Megatron-LM's validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1 (its TP
    // communication overlap relies on one hardware queue).
    let env = if p.tp > 1 {
        "CUDA_DEVICE_MAX_CONNECTIONS=1 "
    } else {
        ""
    };
    let nproc = match launch.uniform() {
        Some(n) => n.to_string(),
        None => format!(
            "{} (on the last node: {})",
            launch.per_node[0],
            launch.per_node[launch.per_node.len() - 1]
        ),
    };
    let mut out = format!(
        "# Megatron-LM pretrain_gpt.py arguments for {} on {} × {} (dp {} × tp {} × pp {}), written by tessera export.\n\
         # Launch {} ranks on {}: on each node, {env}torchrun --nnodes {} --nproc-per-node {nproc} pretrain_gpt.py \"${{MEGATRON_ARGS[@]}}\" <data and tokenizer arguments>\n\
         MEGATRON_ARGS=(\n",
        comment_text(&plan.job.model.name),
        p.world,
        comment_text(&plan.job.cluster.device.name),
        p.dp,
        p.tp,
        p.pp,
        launch.world,
        launch.describe(),
        launch.nodes,
    );
    for words in args {
        let line =
            shlex::try_join(words.iter().map(String::as_str)).expect("arguments hold no NUL byte");
        out += &format!("  {line}\n");
    }
    out += ")\n";
    Ok(out)
}

/// The optimizer and the learning-rate schedule (plan.json's `job.model.optimizer` and
/// `schedule`) as Megatron-LM's flags (megatron/training/config/training_config.py). Megatron
/// never decays biases and 1-D weights (norm gains): the plan's `decay_on = "matrices"`.
fn optimizer_args(plan: &Plan, args: &mut Vec<Vec<String>>) -> Result<(), ExportError> {
    let t = Target::Megatron;
    let (o, s) = (&plan.job.model.optimizer, &plan.job.model.schedule);
    let weight_decay = match o.decay_on {
        DecayOn::None => 0.0,
        DecayOn::All if o.weight_decay > 0.0 => {
            return Err(refuse(
                t,
                "weight decay on every tensor (optimizer.decay_on = \"all\"): Megatron-LM never decays biases and norm weights",
                "set decay_on = \"matrices\" (or weight_decay = 0) under [optimizer] and re-plan",
            ))
        }
        _ => o.weight_decay,
    };
    args.push(arg("--lr", o.lr));
    args.push(arg("--min-lr", o.min_lr));
    args.push(arg("--lr-warmup-iters", s.warmup_steps));
    let style = match s.decay {
        DecayShape::Cosine => "cosine",
        DecayShape::Linear => "linear",
        DecayShape::Constant => "constant",
        DecayShape::Wsd => "WSD",
    };
    args.push(arg("--lr-decay-style", style));
    if let Some(d) = s.decay_steps {
        args.push(arg("--lr-decay-iters", d));
    }
    if s.decay == DecayShape::Wsd {
        let Some(d) = s.decay_steps else {
            return Err(refuse(
                t,
                "the WSD decay over the run's --steps (Megatron-LM's --lr-wsd-decay-iters is a number of iterations, which needs the decay's end)",
                "set decay_steps under [schedule] and re-plan",
            ));
        };
        args.push(arg("--lr-wsd-decay-style", "linear"));
        args.push(arg("--lr-wsd-decay-iters", s.wsd_decay_steps(d)));
    }
    args.push(arg("--weight-decay", weight_decay));
    args.push(arg("--adam-beta1", o.beta1));
    args.push(arg("--adam-beta2", o.beta2));
    args.push(arg("--adam-eps", o.eps));
    args.push(arg("--clip-grad", o.clip_grad));
    Ok(())
}
