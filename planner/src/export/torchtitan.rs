//! A torchtitan job config (TOML, through the `toml` serializer), for torchtitan 0.2.x.

use toml::{Table, Value};

use super::offload::{self, Knob};
use super::{comment_text, recomputed_layers, refuse, refuse_moe_or_mla, ExportError, Target};
use crate::layout::Recompute;
use crate::model::AttentionImpl;
use crate::optimizer::{DecayOn, DecayShape};
use crate::plan::Plan;
use crate::schedule::ScheduleKind;

fn int(v: u64) -> Value {
    Value::Integer(i64::try_from(v).unwrap_or(i64::MAX))
}

/// The layers torchtitan 0.2's layer-wise selective checkpointing (`selective_ac_option = "N"`)
/// recomputes: `_apply_layer_sac` counts the transformer blocks it wraps with one counter per
/// process, across the model parts that rank builds (its chunks, in order), and checkpoints a
/// block when the count is a multiple of N.
fn torchtitan_layer_sac(plan: &Plan, every: u64) -> Vec<u64> {
    let mut out = Vec::new();
    for stage in &plan.stages {
        let mut chunks: Vec<_> = stage.chunks.iter().collect();
        chunks.sort_by_key(|c| c.virtual_stage);
        let mut count = 0u64;
        for c in chunks {
            for l in c.layers[0]..c.layers[1] {
                count += 1;
                if count.is_multiple_of(every) {
                    out.push(l);
                }
            }
        }
    }
    out.sort_unstable();
    out
}

pub(super) fn torchtitan(plan: &Plan) -> Result<String, ExportError> {
    let t = Target::Torchtitan;
    let p = &plan.parallel;
    refuse_moe_or_mla(
        plan,
        t,
        "the export writes torchtitan's dense Llama job; its MoE models are their own model code",
    )?;
    let (shard, replicate) = match (p.zero_stage, p.hybrid_shard) {
        (0, _) => (1, p.dp),
        (2 | 3, false) => (p.dp, 1),
        (2 | 3, true) => {
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
                format!("ZeRO-{z} (torchtitan shards with FSDP2, ZeRO-3, or ZeRO-2 when its parameters stay gathered after the forward, or replicates with DDP: no optimizer-only sharding)"),
                "re-plan with --zero 3, --zero 2 or --zero 0",
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
        // torch's `ScheduleZBVZeroBubble`, the order of `schedule::zb_v`; torchtitan places
        // its two model parts per rank in a V (`pipeline_module_split`, style "v"), which is
        // the plan's piece order below.
        (_, ScheduleKind::ZbV) => "ZBVZeroBubble",
        (_, ScheduleKind::ZbH1) => {
            return Err(refuse(
                t,
                "the zb-h1 pipeline schedule (torch 2's pipelining has no one-chunk zero-bubble schedule: its zero-bubble schedules are InterleavedZeroBubble, ZBVZeroBubble and DualPipeV, all with two or more chunks per rank)",
                "re-plan with --schedule zb-v (torchtitan's ZBVZeroBubble) or 1f1b",
            ))
        }
        (_, ScheduleKind::DualPipe) => {
            return Err(refuse(
                t,
                "the dualpipe pipeline schedule (torchtitan runs DualPipeV, DeepSeek's one-direction variant with one copy of the parameters, not DualPipe's two directions)",
                "re-plan with --schedule zb-v or 1f1b",
            ))
        }
    };
    // Under flash attention the plan's selective recompute is torchtitan's per-op checkpointing
    // (`selective_ac_option = "op"`), and full recompute of every N-th layer its layer option.
    // Under eager attention, selective recompute is of the attention scores (Megatron's), which
    // torchtitan's SDPA kernels never store: mode "none" does that there.
    let flash = plan.job.model.training.attention == AttentionImpl::Flash;
    let mut note = "";
    let (mode, option) = match p.recompute {
        Recompute::None => ("none", None),
        Recompute::Selective if flash => ("selective", Some("op".to_string())),
        Recompute::Selective => {
            note = "# The plan recomputes the attention scores (Megatron's selective recompute); torchtitan's\n# SDPA never stores them, so no checkpointing mode is needed for that.\n";
            ("none", None)
        }
        Recompute::Full if p.recompute_every > 1 => {
            let n = p.recompute_every;
            let (theirs, ours) = (torchtitan_layer_sac(plan, n), recomputed_layers(plan));
            if theirs != ours {
                return Err(refuse(
                    t,
                    format!("full recompute of every {n}th layer on this split: torchtitan counts the layers of each rank's model parts from 1, so it would recompute layers {theirs:?} where the plan recomputes {ours:?} (0-based)"),
                    "re-plan with a --recompute-every that divides the layers of every pipeline stage, or with --recompute full",
                ));
            }
            ("selective", Some(n.to_string()))
        }
        Recompute::Full => ("full", None),
    };
    offload::check(
        plan,
        t,
        &[
            (Knob::Optimizer, "torchtitan offloads with FSDP2's CPUOffloadPolicy, which moves the weights, gradients and optimizer states together: there is no optimizer-only offload", "re-plan with --offload params, or export to deepspeed or megatron"),
            (Knob::Nvme, "FSDP2's CPUOffloadPolicy offloads to host memory only", "re-plan with --offload-to cpu, or export to deepspeed"),
            (Knob::Activations, "torchtitan 0.2 has no activation offload", "re-plan without --offload-activations, or export to deepspeed"),
        ],
    )?;
    let tr = &plan.job.model.training;
    // torchtitan 0.2 (train.py): gradient accumulation steps = global_batch_size /
    // (local_batch_size × DP degree); with PP, each local batch is split into
    // local_batch_size / pipeline_parallel_microbatch_size micro-batches. So the plan's
    // micro-batches are accumulation steps without PP, and the pipeline's with it.
    let local = if p.pp > 1 {
        p.micro_batch * p.microbatches
    } else {
        p.micro_batch
    };
    let mut training = Table::new();
    training.insert("local_batch_size".into(), int(local));
    training.insert("global_batch_size".into(), int(tr.global_batch));
    training.insert("seq_len".into(), int(tr.seq_len));
    if offload::of(plan).params() {
        // FSDP2's CPUOffloadPolicy (`apply_fsdp(..., cpu_offload=True)`): the sharded weights,
        // gradients and optimizer states on the host, the step on the CPU. Parameter offload
        // needs ZeRO-3, so FSDP is on.
        training.insert("enable_cpu_offload".into(), Value::Boolean(true));
    }
    let mut par = Table::new();
    par.insert("data_parallel_replicate_degree".into(), int(replicate));
    par.insert("data_parallel_shard_degree".into(), int(shard));
    if p.zero_stage == 2 {
        // ZeRO-2: each block's gathered parameters kept from its forward to the end of its
        // backward (`reshard_after_forward=False`), gradients and optimizer states sharded.
        par.insert(
            "fsdp_reshard_after_forward".into(),
            Value::String("never".into()),
        );
    }
    par.insert("tensor_parallel_degree".into(), int(p.tp));
    if plan.job.model.training.tp_comm_overlap && p.tp > 1 {
        // Async TP (torchtitan 0.2.2 distributed/tensor_parallel.py maybe_enable_async_tp:
        // Inductor's micro-pipeline TP pass); it needs the compiled model, which
        // `super::tp_overlap_supported` checked.
        par.insert("enable_async_tensor_parallel".into(), Value::Boolean(true));
    }
    par.insert("pipeline_parallel_degree".into(), int(p.pp));
    par.insert(
        "pipeline_parallel_schedule".into(),
        Value::String(schedule.into()),
    );
    par.insert(
        "pipeline_parallel_microbatch_size".into(),
        int(p.micro_batch),
    );
    // Ring attention over the CP group (torchtitan's `context_parallel`, load-balanced chunks).
    par.insert("context_parallel_degree".into(), int(p.cp));
    if p.cp > 1 {
        // How torchtitan's context_parallel passes K and V: a ring ("alltoall") or all-gathered.
        let method = match p.cp_comm {
            crate::layout::CpComm::P2p => "alltoall",
            crate::layout::CpComm::AllGather => "allgather",
        };
        par.insert(
            "context_parallel_rotate_method".into(),
            toml::Value::String(method.into()),
        );
    }
    if p.pp > 1 {
        // The plan's exact split, as the modules of each model part in pipeline order (the
        // names of torchtitan's Llama-family models): torchtitan's own split would differ.
        let parts = super::chunks_in_order(plan)
            .iter()
            .map(|c| {
                let mut names: Vec<Value> = Vec::new();
                if c.embedding {
                    names.push(Value::String("tok_embeddings".into()));
                }
                names.extend(
                    (c.layers[0]..c.layers[1]).map(|l| Value::String(format!("layers.{l}"))),
                );
                if c.head {
                    names.push(Value::String("norm".into()));
                    names.push(Value::String("output".into()));
                }
                Value::Array(names)
            })
            .collect();
        par.insert("module_fqns_per_model_part".into(), Value::Array(parts));
    }
    let mut ac = Table::new();
    ac.insert("mode".into(), Value::String(mode.into()));
    if let Some(option) = option {
        ac.insert("selective_ac_option".into(), Value::String(option));
    }
    let (optimizer, lr_scheduler, decay_note) = optimizer_tables(plan, &mut training)?;
    let mut doc = Table::new();
    let components = compile_components(plan);
    let compiled = !components.is_empty();
    if compiled && p.schedule == ScheduleKind::ZbV && p.pp > 1 {
        // torch's ZBVZeroBubble raises on compiled stage modules
        // (`_check_torch_compile_compatibility`: it does not split compiled backwards).
        return Err(refuse(
            t,
            "the zb-v schedule under torch.compile (torch's ZBVZeroBubble refuses compiled stage modules)",
            "re-plan with --framework torchtitan (eager), or --schedule 1f1b or interleaved",
        ));
    }
    if compiled {
        // The plan was predicted compiled: torchtitan 0.2's `[compile]` with the components
        // its profile compiles (`["model", "loss"]` is the default).
        let mut compile = Table::new();
        compile.insert("enable".into(), Value::Boolean(true));
        compile.insert(
            "components".into(),
            Value::Array(
                components
                    .iter()
                    .map(|c| Value::String((*c).into()))
                    .collect(),
            ),
        );
        doc.insert("compile".into(), Value::Table(compile));
    }
    // The whole run: the budget's steps, and the plan's checkpoint cadence (torchtitan 0.2's
    // `[checkpoint] enable`, `interval` in steps).
    if let Some(w) = &plan.predicted.whole_run {
        training.insert("steps".into(), int(w.steps));
    }
    if let Some(c) = &plan.predicted.checkpoint {
        let mut ck = Table::new();
        ck.insert("enable".into(), Value::Boolean(true));
        ck.insert("interval".into(), int(c.save_every));
        doc.insert("checkpoint".into(), Value::Table(ck));
    }
    if let Some((model, quantize)) = float8_tables(plan, shard) {
        doc.insert("model".into(), Value::Table(model));
        doc.insert("quantize".into(), Value::Table(quantize));
    }
    doc.insert("training".into(), Value::Table(training));
    doc.insert("optimizer".into(), Value::Table(optimizer));
    doc.insert("lr_scheduler".into(), Value::Table(lr_scheduler));
    doc.insert("parallelism".into(), Value::Table(par));
    doc.insert("activation_checkpoint".into(), Value::Table(ac));
    let body = toml::to_string(&doc).expect("a TOML table serialises");
    Ok(format!(
        "# torchtitan job config for {} on {} devices (dp {} × tp {} × pp {}), written by tessera export.\n\
         # Model and data sections are the user's: this file sets the layout.\n{note}{decay_note}\n{body}",
        comment_text(&plan.job.model.name),
        p.world,
        p.dp,
        p.tp,
        p.pp
    ))
}

/// The plan's torchtitan compile components: each block and the loss (torchtitan-compile), or
/// the blocks alone (torchtitan-compile-blocks: the loss eager); none for an eager plan.
pub(super) fn compile_components(plan: &Plan) -> &'static [&'static str] {
    match crate::framework::of(&plan.job.model, &plan.job.cluster)
        .name
        .as_str()
    {
        "torchtitan-compile" => &["model", "loss"],
        "torchtitan-compile-blocks" => &["model"],
        _ => &[],
    }
}

/// torchtitan 0.2.2's float8 training for an FP8 plan (`None` without): `[model] converters`
/// with its registered `quantize.linear.float8`, and `[quantize.linear.float8]`. Tensorwise is
/// the converter's default recipe (no `recipe_name`), with float8 all-gather under FSDP
/// (`shard` > 1) and its precomputed scales, as torchtitan's docs recommend; rowwise names its
/// recipe, with which torchtitan asserts the all-gather off. The output layer is filtered, as
/// the plan keeps the LM head in 16-bit.
fn float8_tables(plan: &Plan, shard: u64) -> Option<(Table, Table)> {
    use crate::fp8::Recipe;
    let r = plan.job.model.training.fp8;
    if r.is_none() {
        return None;
    }
    let mut float8 = Table::new();
    if r == Recipe::Tensorwise {
        let fsdp = shard > 1;
        float8.insert("enable_fsdp_float8_all_gather".into(), Value::Boolean(fsdp));
        float8.insert(
            "precompute_float8_dynamic_scale_for_fsdp".into(),
            Value::Boolean(fsdp),
        );
    } else {
        float8.insert("recipe_name".into(), Value::String(r.name().into()));
    }
    float8.insert(
        "filter_fqns".into(),
        Value::Array(vec![Value::String("output".into())]),
    );
    let mut linear = Table::new();
    linear.insert("float8".into(), Value::Table(float8));
    let mut quantize = Table::new();
    quantize.insert("linear".into(), Value::Table(linear));
    let mut model = Table::new();
    model.insert(
        "converters".into(),
        Value::Array(vec![Value::String("quantize.linear.float8".into())]),
    );
    Some((model, quantize))
}

/// torchtitan 0.2's `[optimizer]` and `[lr_scheduler]` for the plan's optimizer and schedule,
/// and `training.max_norm`. torchtitan's AdamW decays every parameter (one group of
/// `model.parameters()`); its warm-up-stable-decay lambda (`build_lr_schedulers`) decays
/// after the warm-up (`decay_ratio` absent), over the last `decay_ratio` of the steps (WSD), or
/// not at all (`decay_ratio = 0`), to `lr × min_lr_factor`.
fn optimizer_tables(
    plan: &Plan,
    training: &mut Table,
) -> Result<(Table, Table, &'static str), ExportError> {
    let t = Target::Torchtitan;
    let (o, s) = (&plan.job.model.optimizer, &plan.job.model.schedule);
    // torchtitan 0.2 cannot leave the norm weights and biases out of the decay. The plan's
    // default (matrices only) is still exported, as torchtitan's own default is the same
    // weight decay on every parameter, and the difference is stated at the top of the file.
    let (weight_decay, note) = match o.decay_on {
        DecayOn::None => (0.0, ""),
        DecayOn::Matrices if o.weight_decay > 0.0 => (
            o.weight_decay,
            "# optimizer.weight_decay: the plan decays matrices and embeddings only (decay_on =\n# \"matrices\"); torchtitan's AdamW decays every parameter, the norm weights (and any\n# biases) too.\n",
        ),
        _ => (o.weight_decay, ""),
    };
    if o.clip_grad == 0.0 {
        return Err(refuse(
            t,
            "no gradient clipping (optimizer.clip_grad = 0): torchtitan always clips to training.max_norm",
            "set clip_grad above 0 under [optimizer] and re-plan",
        ));
    }
    training.insert("max_norm".into(), Value::Float(o.clip_grad));
    let mut opt = Table::new();
    opt.insert("name".into(), Value::String("AdamW".into()));
    opt.insert("lr".into(), Value::Float(o.lr));
    opt.insert("beta1".into(), Value::Float(o.beta1));
    opt.insert("beta2".into(), Value::Float(o.beta2));
    opt.insert("eps".into(), Value::Float(o.eps));
    opt.insert("weight_decay".into(), Value::Float(weight_decay));
    let mut lr = Table::new();
    lr.insert("warmup_steps".into(), int(s.warmup_steps));
    if let Some(d) = s.decay_steps {
        lr.insert("total_steps".into(), int(d));
    }
    let (decay_type, ratio) = match s.decay {
        DecayShape::Cosine => ("cosine", None),
        DecayShape::Linear => ("linear", None),
        DecayShape::Constant => ("linear", Some(0.0)),
        DecayShape::Wsd => ("linear", Some(s.wsd_decay_fraction)),
    };
    lr.insert("decay_type".into(), Value::String(decay_type.into()));
    if let Some(r) = ratio {
        lr.insert("decay_ratio".into(), Value::Float(r));
    }
    let factor = crate::optimizer::round_sig12(o.min_lr / o.lr);
    lr.insert("min_lr_factor".into(), Value::Float(factor));
    Ok((opt, lr, note))
}
