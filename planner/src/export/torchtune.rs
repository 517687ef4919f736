//! A torchtune recipe config (YAML, through serde_yaml_ng) for torchtune 0.6.1, its last
//! release: `tune run <recipe> --config FILE`, with the recipe named in the header. The model is
//! torchtune's own builder for the plan's architecture (`llama3_8b`, `lora_llama3_1_8b`,
//! `qlora_llama3_70b`, … where the plan is exactly that model, else the family's component
//! builder `llama3`/`lora_llama3`/`llama3_1`/`lora_llama3_1` with every dimension stated), the
//! batch, accumulation, dtype, activation checkpointing, optimizer and schedule the plan's.
//! The data (tokenizer file, checkpoint, dataset, output directory) is the user's: those keys
//! are OmegaConf's mandatory `???`, which torchtune refuses to run without.

use serde_yaml_ng::{Mapping, Value};

use super::offload::{self, Knob};
use super::{comment_text, refuse, refuse_moe_or_mla, ExportError, Target};
use crate::finetune::{Method, OptimizerStates, Target as Linear};
use crate::layout::Recompute;
use crate::model::{Architecture, Family, RopeType};
use crate::optimizer::{DecayOn, DecayShape};
use crate::plan::Plan;

/// OmegaConf's mandatory value: torchtune's `config.parse` loads it; reading it raises.
const MISSING: &str = "???";

pub(super) fn map(pairs: Vec<(&str, Value)>) -> Value {
    let mut m = Mapping::new();
    for (k, v) in pairs {
        m.insert(Value::from(k), v);
    }
    Value::Mapping(m)
}

fn int(v: u64) -> Value {
    Value::from(v)
}

/// A float as YAML reads it back exactly (serde's shortest round-trip form).
fn float(x: f64) -> Value {
    Value::from(x)
}

/// A named torchtune builder: (module, base name, the architecture it builds, max_seq_len).
struct Named {
    module: &'static str,
    name: &'static str,
    layers: u64,
    hidden: u64,
    heads: u64,
    ffn: u64,
    scaled: bool,
    max_seq_len: u64,
}

/// torchtune 0.6.1's Llama 3 / 3.1 builders (torchtune/models/llama3{,_1}/_model_builders.py):
/// vocab 128256, 8 KV heads, RoPE θ 500000, RMSNorm ε 1e-5, untied; 3.1's RoPE scaled by 8.
const NAMED: [Named; 4] = [
    Named {
        module: "llama3",
        name: "llama3_8b",
        layers: 32,
        hidden: 4096,
        heads: 32,
        ffn: 14336,
        scaled: false,
        max_seq_len: 8192,
    },
    Named {
        module: "llama3",
        name: "llama3_70b",
        layers: 80,
        hidden: 8192,
        heads: 64,
        ffn: 28672,
        scaled: false,
        max_seq_len: 8192,
    },
    Named {
        module: "llama3_1",
        name: "llama3_1_8b",
        layers: 32,
        hidden: 4096,
        heads: 32,
        ffn: 14336,
        scaled: true,
        max_seq_len: 131072,
    },
    Named {
        module: "llama3_1",
        name: "llama3_1_70b",
        layers: 80,
        hidden: 8192,
        heads: 64,
        ffn: 28672,
        scaled: true,
        max_seq_len: 131072,
    },
];

fn named(a: &Architecture, seq_len: u64) -> Option<&'static Named> {
    NAMED.iter().find(|n| {
        a.layers == n.layers
            && a.hidden == n.hidden
            && a.heads == n.heads
            && a.kv_heads == 8
            && a.ffn_hidden == n.ffn
            && a.vocab == 128_256
            && a.rope_theta == 500_000.0
            && a.norm_eps == 1e-5
            && a.rope_scaling.is_some() == n.scaled
            && a.rope_scaling.as_ref().is_none_or(|s| s.factor == 8.0)
            && seq_len <= n.max_seq_len
    })
}

/// The model: torchtune's builder and its arguments, or why torchtune has none for it.
fn model(plan: &Plan) -> Result<Value, ExportError> {
    let t = Target::Torchtune;
    let m = &plan.job.model;
    let a = &m.architecture;
    refuse_moe_or_mla(
        plan,
        t,
        "torchtune 0.6.1's MoE models are Llama 4's own builders, not a Llama with experts",
    )?;
    let no_builder = |what: String| {
        refuse(
            t,
            format!("{what}: torchtune 0.6.1's Llama 3 builders (llama3, lora_llama3, llama3_1, lora_llama3_1) build a bias-free, untied RMSNorm/SwiGLU/RoPE decoder with head_dim = embed_dim / num_heads"),
            "export to peft (transformers builds any Llama-family model) or to torchtitan",
        )
    };
    if a.family() != Family::Llama {
        return Err(no_builder(format!(
            "the {} family (not RoPE + RMSNorm + SwiGLU)",
            a.family().name()
        )));
    }
    if a.bias || a.qkv_bias {
        return Err(no_builder("biases on the linears".into()));
    }
    if a.tied_embeddings {
        return Err(no_builder("tied input and output embeddings".into()));
    }
    if a.head_dim * a.heads != a.hidden {
        return Err(no_builder(format!(
            "head_dim {} × {} heads ≠ hidden {}",
            a.head_dim, a.heads, a.hidden
        )));
    }
    if a.sliding_window.is_some() {
        return Err(no_builder("sliding-window attention".into()));
    }
    if a.rope_theta.fract() != 0.0 || a.rope_theta <= 0.0 {
        return Err(no_builder(format!(
            "RoPE θ {} (torchtune's rope_base is an integer)",
            a.rope_theta
        )));
    }
    let scale_factor = match &a.rope_scaling {
        None => None,
        Some(s)
            if s.rope_type == RopeType::Llama3
                && s.factor.fract() == 0.0
                && s.low_freq_factor == 1.0
                && s.high_freq_factor == 4.0
                && s.original_max_positions == 8192 =>
        {
            Some(s.factor as u64)
        }
        Some(s) => {
            return Err(no_builder(format!(
                "RoPE scaling {:?} (torchtune's Llama3ScaledRoPE takes an integer scale_factor, with low_freq_factor 1, high_freq_factor 4, old_context_len 8192)",
                s
            )))
        }
    };
    let seq_len = m.training.seq_len;
    let adapters = m.training.method.adapters();
    let mut args: Vec<(&str, Value)> = Vec::new();
    if let (true, Some(l)) = (adapters, &m.lora) {
        let attn: Vec<Value> = l
            .targets
            .iter()
            .filter_map(|t| match t {
                Linear::Q => Some("q_proj"),
                Linear::K => Some("k_proj"),
                Linear::V => Some("v_proj"),
                Linear::O => Some("output_proj"),
                _ => None,
            })
            .map(Value::from)
            .collect();
        let mlp: Vec<_> = l
            .targets
            .iter()
            .filter(|t| matches!(t, Linear::Gate | Linear::Up | Linear::Down))
            .collect();
        if !(mlp.is_empty() || mlp.len() == 3) {
            return Err(refuse(
                t,
                format!(
                    "adapters on only {} of the MLP (torchtune's apply_lora_to_mlp adapts gate, up and down together)",
                    mlp.iter().map(|t| t.name()).collect::<Vec<_>>().join(",")
                ),
                "re-plan with --lora-targets naming all of gate,up,down or none of them, or export to peft",
            ));
        }
        args.push(("lora_attn_modules", Value::Sequence(attn)));
        args.push(("apply_lora_to_mlp", Value::from(mlp.len() == 3)));
        args.push(("apply_lora_to_output", Value::from(false)));
        args.push(("lora_rank", int(l.rank)));
        args.push(("lora_alpha", float(l.alpha)));
        args.push(("lora_dropout", float(l.dropout)));
    }
    let prefix = match m.training.method {
        Method::Full => "",
        Method::Lora => "lora_",
        Method::Qlora => "qlora_",
    };
    let component = match named(a, seq_len) {
        Some(n) => format!("torchtune.models.{}.{prefix}{}", n.module, n.name),
        None => {
            let module = if scale_factor.is_some() {
                "llama3_1"
            } else {
                "llama3"
            };
            // The component builders have no qlora_ form: quantize_base says it.
            let lora = if adapters { "lora_" } else { "" };
            args.extend([
                ("vocab_size", int(a.vocab)),
                ("num_layers", int(a.layers)),
                ("num_heads", int(a.heads)),
                ("num_kv_heads", int(a.kv_heads)),
                ("embed_dim", int(a.hidden)),
                ("max_seq_len", int(seq_len)),
                ("intermediate_dim", int(a.ffn_hidden)),
                ("norm_eps", float(a.norm_eps)),
                ("rope_base", int(a.rope_theta as u64)),
            ]);
            if let Some(f) = scale_factor {
                args.push(("scale_factor", int(f)));
            }
            if m.training.method == Method::Qlora {
                args.push(("quantize_base", Value::from(true)));
            }
            format!("torchtune.models.{module}.{lora}{module}")
        }
    };
    let mut pairs = vec![("_component_", Value::from(component))];
    pairs.extend(args);
    Ok(map(pairs))
}

pub(super) fn torchtune(plan: &Plan) -> Result<String, ExportError> {
    let t = Target::Torchtune;
    let (m, p) = (&plan.job.model, &plan.parallel);
    let model = model(plan)?;
    let dtype = match m.training.precision.as_str() {
        "bf16" => "bf16",
        "fp32" => "fp32",
        other => {
            return Err(refuse(
                t,
                format!("the precision policy \"{other}\" (torchtune's recipes keep weights, gradients and optimizer states in one dtype, bf16 or fp32, with no fp32 master copy of bf16 weights)"),
                "set precision = \"bf16\" (pure bf16, torchtune's dtype: bf16) or \"fp32\" under [training] and re-plan",
            ))
        }
    };
    if p.tp > 1 || p.pp > 1 || p.cp > 1 {
        return Err(refuse(
            t,
            format!(
                "tensor, pipeline or context parallelism (TP {}, PP {}, CP {}): torchtune 0.6.1's LoRA recipes shard with FSDP2 only, and this export writes FSDP only (full_finetune_distributed's tensor_parallel_dim is not the plan's Megatron-style TP + SP)",
                p.tp, p.pp, p.cp
            ),
            "re-plan with --tp 1 --pp 1 --cp 1 (data parallel, ZeRO-3), or export to megatron or torchtitan",
        ));
    }
    let distributed = p.dp > 1;
    if distributed && (p.zero_stage < 2 || p.hybrid_shard) {
        return Err(refuse(
            t,
            format!(
                "ZeRO-{}{} over {} ranks (torchtune's distributed recipes shard parameters, gradients and optimizer states over every rank with FSDP2: ZeRO-3, or ZeRO-2 with fsdp_reshard_after_forward: False)",
                p.zero_stage,
                if p.hybrid_shard { " with hybrid sharding" } else { "" },
                p.dp
            ),
            "re-plan with --zero 3 --no-hybrid-shard",
        ));
    }
    let checkpointing = match (p.recompute, p.recompute_every) {
        (Recompute::None, _) => false,
        (Recompute::Full, 1) => true,
        _ => {
            return Err(refuse(
                t,
                "selective recompute, or full recompute of only some layers (torchtune's enable_activation_checkpointing recomputes every transformer layer: full)",
                "re-plan with --recompute full or none",
            ))
        }
    };
    offload::check(
        plan,
        t,
        &[
            (Knob::Optimizer, "torchtune 0.6.1's recipes offload with FSDP2's CPU offload (fsdp_cpu_offload), which moves the weights too: there is no optimizer-only offload in their configs", "re-plan with --offload params (DP > 1), or export to deepspeed or megatron"),
            (Knob::Nvme, "fsdp_cpu_offload offloads to host memory only", "re-plan with --offload-to cpu, or export to deepspeed"),
        ],
    )?;
    let off = offload::of(plan);
    if off.params() && !distributed {
        return Err(refuse(
            t,
            "parameter offload (parallel.offload = \"params\") on one device: torchtune's single-device recipes have no FSDP, and fsdp_cpu_offload is the distributed recipes' only",
            "re-plan with DP > 1 and --zero 3, or without --offload",
        ));
    }
    if off.activations && !checkpointing {
        // The recipes raise "enable_activation_offloading is True and
        // enable_activation_checkpointing is False".
        return Err(refuse(
            t,
            "activation offload without recompute (parallel.offload_activations = true: torchtune's recipes refuse enable_activation_offloading without enable_activation_checkpointing)",
            "re-plan with --recompute full, or without --offload-activations",
        ));
    }
    let o = &m.optimizer;
    let s = &m.schedule;
    let weight_decay = match o.decay_on {
        DecayOn::None => 0.0,
        // torchtune's optimizer takes model.parameters(): decay reaches norms too, unless only
        // adapters (matrices) train.
        DecayOn::Matrices if !m.training.method.adapters() && o.weight_decay > 0.0 => {
            return Err(refuse(
                t,
                "weight decay on matrices only (optimizer.decay_on = \"matrices\"): torchtune's recipes hand model.parameters() to the optimizer, so norm weights decay too",
                "set decay_on = \"all\" (or weight_decay = 0) under [optimizer] and re-plan",
            ))
        }
        _ => o.weight_decay,
    };
    let optimizer = match (m.training.optimizer_states, distributed) {
        (OptimizerStates::Policy, _) => "torch.optim.AdamW",
        (OptimizerStates::Bit8, false) => "bitsandbytes.optim.AdamW8bit",
        (OptimizerStates::Bit8, true) => {
            return Err(refuse(
                t,
                "8-bit optimizer states with FSDP (torchtune's configs use bitsandbytes' 8-bit AdamW on one device only; it does not take FSDP2's sharded DTensor parameters)",
                "re-plan with --optimizer-states policy, or on one device",
            ))
        }
    };
    // torchtune 0.6.1 has one schedule: linear warm-up, then half a cosine to 0 at the run's
    // last step (training/lr_schedulers.py, get_cosine_schedule_with_warmup).
    let schedule_ok = match s.decay {
        DecayShape::Cosine => o.min_lr == 0.0 && s.decay_steps.is_none(),
        DecayShape::Constant => s.warmup_steps == 0 && !m.training.method.adapters(),
        _ => false,
    };
    if !schedule_ok {
        return Err(refuse(
            t,
            format!(
                "the learning-rate schedule ({} decay to min_lr {}{}, {} warm-up steps): torchtune 0.6.1 has one, get_cosine_schedule_with_warmup, a linear warm-up then half a cosine to 0 at the run's last step (and its LoRA recipes require it)",
                s.decay.name(),
                o.min_lr,
                s.decay_steps.map(|d| format!(" at step {d}")).unwrap_or_default(),
                s.warmup_steps
            ),
            "set decay = \"cosine\" under [schedule] and min_lr = 0 under [optimizer], without decay_steps, and re-plan",
        ));
    }
    let recipe = match (m.training.method.adapters(), distributed) {
        (true, false) => "lora_finetune_single_device",
        (true, true) => "lora_finetune_distributed",
        (false, false) => "full_finetune_single_device",
        (false, true) => "full_finetune_distributed",
    };

    let mut pairs: Vec<(&str, Value)> = vec![
        ("output_dir", Value::from(MISSING)),
        ("model", model),
        (
            "tokenizer",
            map(vec![
                (
                    "_component_",
                    Value::from("torchtune.models.llama3.llama3_tokenizer"),
                ),
                ("path", Value::from(MISSING)),
                ("max_seq_len", int(m.training.seq_len)),
            ]),
        ),
        (
            "checkpointer",
            map(vec![
                (
                    "_component_",
                    Value::from("torchtune.training.FullModelHFCheckpointer"),
                ),
                ("checkpoint_dir", Value::from(MISSING)),
                ("checkpoint_files", Value::from(MISSING)),
                ("recipe_checkpoint", Value::Null),
                ("output_dir", Value::from("${output_dir}")),
                ("model_type", Value::from("LLAMA3")),
            ]),
        ),
        ("resume_from_checkpoint", Value::from(false)),
        ("dataset", Value::from(MISSING)),
        ("seed", Value::Null),
        ("shuffle", Value::from(true)),
        ("batch_size", int(p.micro_batch)),
        ("gradient_accumulation_steps", int(p.microbatches)),
        ("epochs", int(1)),
        ("max_steps_per_epoch", Value::Null),
        (
            "optimizer",
            map(vec![
                ("_component_", Value::from(optimizer)),
                ("lr", float(o.lr)),
                (
                    "betas",
                    Value::Sequence(vec![float(o.beta1), float(o.beta2)]),
                ),
                ("eps", float(o.eps)),
                ("weight_decay", float(weight_decay)),
            ]),
        ),
    ];
    if s.decay == DecayShape::Cosine {
        pairs.push((
            "lr_scheduler",
            map(vec![
                (
                    "_component_",
                    Value::from("torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup"),
                ),
                ("num_warmup_steps", int(s.warmup_steps)),
            ]),
        ));
    }
    pairs.extend([
        (
            "loss",
            map(vec![(
                "_component_",
                Value::from("torchtune.modules.loss.CEWithChunkedOutputLoss"),
            )]),
        ),
        (
            "clip_grad_norm",
            if o.clip_grad > 0.0 {
                float(o.clip_grad)
            } else {
                Value::Null
            },
        ),
        ("compile", Value::from(false)),
        ("device", Value::from("cuda")),
        ("dtype", Value::from(dtype)),
        (
            "enable_activation_checkpointing",
            Value::from(checkpointing),
        ),
        ("enable_activation_offloading", Value::from(off.activations)),
    ]);
    if distributed {
        pairs.push(("fsdp_reshard_after_forward", Value::from(p.zero_stage == 3)));
        // FSDP2's CPUOffloadPolicy: weights, gradients and optimizer states on the host. The
        // recipes' default (cfg.get("fsdp_cpu_offload", False)) is none: written only when on.
        if off.params() {
            pairs.push(("fsdp_cpu_offload", Value::from(true)));
        }
    }
    pairs.extend([
        (
            "metric_logger",
            map(vec![
                (
                    "_component_",
                    Value::from("torchtune.training.metric_logging.DiskLogger"),
                ),
                ("log_dir", Value::from("${output_dir}/logs")),
            ]),
        ),
        ("log_every_n_steps", int(1)),
        ("log_peak_memory_stats", Value::from(true)),
    ]);
    if recipe.starts_with("lora") {
        pairs.push(("save_adapter_weights_only", Value::from(false)));
    } else {
        // The optimizer steps inside backward: memory the plan does not count.
        pairs.push(("optimizer_in_bwd", Value::from(false)));
    }
    let launch = if distributed {
        let c = &plan.job.cluster;
        let nodes = p.world.div_ceil(c.gpus_per_node.max(1));
        if nodes > 1 {
            format!(
                "tune run --nnodes {nodes} --nproc_per_node {} {recipe} --config FILE",
                c.gpus_per_node
            )
        } else {
            format!(
                "tune run --nproc_per_node {} {recipe} --config FILE",
                p.world
            )
        }
    } else {
        format!("tune run {recipe} --config FILE")
    };
    let header = format!(
        "# torchtune 0.6.1 recipe config for {} (written by `tessera export --to torchtune` from plan.json).\n\
         # {launch}\n\
         # recipe: {recipe}\n\
         # The data is yours to give: output_dir, tokenizer.path, checkpointer.checkpoint_dir and\n\
         # checkpoint_files, and dataset are OmegaConf's mandatory ??? (e.g. dataset._component_=\n\
         # torchtune.datasets.alpaca_cleaned_dataset dataset.packed=True: packed sequences of\n\
         # tokenizer.max_seq_len tokens are what the plan costs). epochs: 1 is not the plan's.\n",
        comment_text(&m.name)
    );
    let body = serde_yaml_ng::to_string(&map(pairs)).expect("a YAML value serialises");
    Ok(header + &body)
}
