//! A Hugging Face Accelerate config (YAML, through serde_yaml_ng) for `accelerate launch
//! --config_file FILE train.py`, accelerate 1.15: the processes, the mixed precision, and the
//! data-parallel engine ([`trainers::engine`]) as accelerate's MULTI_GPU, FSDP (its
//! `fsdp_config`) or DEEPSPEED (its `deepspeed_config`) plugin. The model, data, batch size per
//! device and loop are the training script's; what the config cannot hold is in its header.

use serde_yaml_ng::Value;

use super::offload;
use super::torchtune::map;
use super::trainers::{self, Engine};
use super::{comment_text, refuse, ExportError, Launch, Target};
use crate::layout::Recompute;
use crate::plan::Plan;

/// accelerate's `mixed_precision` for the plan's precision policy: bf16 autocast over fp32
/// master weights for the mixed policies, none for fp32.
fn mixed_precision(plan: &Plan, t: Target) -> Result<&'static str, ExportError> {
    match plan.job.model.training.precision.as_str() {
        "default" | "megatron" | "mixed16" => Ok("bf16"),
        "fp32" => Ok("no"),
        other => Err(refuse(
            t,
            format!("the precision policy \"{other}\" (accelerate's mixed_precision is autocast over the model's own dtype: bf16 over fp32 master weights, or none; pure bf16 is the dtype the script loads the model in, which the config does not hold)"),
            "set precision = \"default\" (mixed bf16) or \"fp32\" under [training] and re-plan, or export to lightning (precision \"bf16-true\") or torchtune",
        )),
    }
}

pub(super) fn accelerate(plan: &Plan, launch: &Launch) -> Result<String, ExportError> {
    let t = Target::Accelerate;
    let p = &plan.parallel;
    let engine = trainers::engine(plan, t, launch)?;
    let precision = mixed_precision(plan, t)?;
    let off = offload::of(plan);
    let o = &plan.job.model.optimizer;
    let distributed_type = match engine {
        Engine::Ddp if launch.world == 1 => "NO",
        Engine::Ddp => "MULTI_GPU",
        Engine::Fsdp { .. } => "FSDP",
        Engine::DeepSpeed => "DEEPSPEED",
    };
    let mut pairs: Vec<(&str, Value)> = vec![
        ("compute_environment", Value::from("LOCAL_MACHINE")),
        ("distributed_type", Value::from(distributed_type)),
        ("mixed_precision", Value::from(precision)),
        ("num_machines", Value::from(launch.nodes)),
        ("num_processes", Value::from(launch.world)),
        ("machine_rank", Value::from(0)),
    ];
    if launch.nodes > 1 {
        // Placeholders: the first node's address (every node's config names it) and a free port;
        // each node also changes machine_rank (or passes --machine_rank).
        pairs.push(("main_process_ip", Value::from("FIRST_NODE_ADDRESS")));
        pairs.push(("main_process_port", Value::from(29500)));
        pairs.push(("same_network", Value::from(true)));
    }
    pairs.extend([
        ("rdzv_backend", Value::from("static")),
        ("gpu_ids", Value::from("all")),
        ("use_cpu", Value::from(false)),
        ("debug", Value::from(false)),
        ("main_training_function", Value::from("main")),
    ]);
    match engine {
        Engine::Ddp => {}
        Engine::Fsdp { strategy, .. } => {
            let (_, class) = trainers::layer_class(plan, t)?;
            pairs.push((
                "fsdp_config",
                map(vec![
                    ("fsdp_version", Value::from(1)),
                    ("fsdp_sharding_strategy", Value::from(strategy)),
                    // FSDP's CPUOffload(offload_params=True): the sharded weights, gradients and
                    // the optimizer step on the host (the plan's params offload).
                    ("fsdp_offload_params", Value::from(off.params())),
                    (
                        "fsdp_auto_wrap_policy",
                        Value::from("TRANSFORMER_BASED_WRAP"),
                    ),
                    ("fsdp_transformer_layer_cls_to_wrap", Value::from(class)),
                    (
                        "fsdp_activation_checkpointing",
                        Value::from(p.recompute == Recompute::Full),
                    ),
                    ("fsdp_state_dict_type", Value::from("SHARDED_STATE_DICT")),
                    ("fsdp_backward_prefetch", Value::from("BACKWARD_PRE")),
                    ("fsdp_forward_prefetch", Value::from(false)),
                    ("fsdp_use_orig_params", Value::from(true)),
                    ("fsdp_cpu_ram_efficient_loading", Value::from(true)),
                    ("fsdp_sync_module_states", Value::from(true)),
                ]),
            ));
        }
        Engine::DeepSpeed => {
            let device = |on: bool| if on { off.to.name() } else { "none" };
            // NVMe is refused (trainers::engine): the devices are cpu or none.
            let mut ds = vec![
                ("zero_stage", Value::from(p.zero_stage)),
                (
                    "offload_optimizer_device",
                    Value::from(device(off.optimizer())),
                ),
                ("offload_param_device", Value::from(device(off.params()))),
            ];
            ds.extend([
                ("gradient_accumulation_steps", Value::from(p.microbatches)),
                ("gradient_clipping", Value::from(o.clip_grad)),
                ("zero3_init_flag", Value::from(p.zero_stage == 3)),
            ]);
            if launch.nodes > 1 {
                ds.push(("deepspeed_multinode_launcher", Value::from("standard")));
            }
            pairs.push(("deepspeed_config", map(ds)));
        }
    }
    let mut header = format!(
        "# Accelerate config for {} on {} × {} (dp {}, ZeRO-{}{}), written by tessera export.\n\
         # Run on each node: accelerate launch --config_file FILE{} train.py\n\
         # The script's part: a batch of {} sequences per device, {} micro-batches per step (Accelerator(gradient_accumulation_steps={})){}.\n",
        comment_text(&plan.job.model.name),
        p.world,
        comment_text(&plan.job.cluster.device.name),
        p.dp,
        p.zero_stage,
        off.label(),
        if launch.nodes > 1 {
            " --machine_rank N (N = 0 on the first node), with main_process_ip set to the first node's address"
        } else {
            ""
        },
        p.micro_batch,
        p.microbatches,
        p.microbatches,
        if o.clip_grad > 0.0 && engine != Engine::DeepSpeed {
            format!(", accelerator.clip_grad_norm_(params, {:?})", o.clip_grad)
        } else {
            String::new()
        },
    );
    if p.recompute == Recompute::Full && !matches!(engine, Engine::Fsdp { .. }) {
        header += "# The plan recomputes every layer: call model.gradient_checkpointing_enable() (this plugin's config has no such key).\n";
    }
    let body = serde_yaml_ng::to_string(&map(pairs)).expect("a YAML value serialises");
    Ok(header + &quote_yaml11_booleans(&body))
}

/// accelerate reads its config with PyYAML, a YAML 1.1 reader, to which a bare `NO` or `no` is
/// the boolean false; serde_yaml_ng writes YAML 1.2, where they are strings, unquoted. The two
/// values this writer can produce so (`distributed_type: NO`, `mixed_precision: no`) are
/// quoted. The export matrix's check found `distributed_type: false`.
fn quote_yaml11_booleans(body: &str) -> String {
    body.lines()
        .map(|l| match l {
            "distributed_type: NO" => "distributed_type: 'NO'".to_string(),
            "mixed_precision: no" => "mixed_precision: 'no'".to_string(),
            other => other.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}
