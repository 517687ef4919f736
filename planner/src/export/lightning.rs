//! A Lightning snippet (Python): the `lightning.Trainer` arguments and their strategy
//! (`DDPStrategy`, `FSDPStrategy` or `DeepSpeedStrategy`, [`trainers::engine`]) for the plan,
//! as `trainer_kwargs`; the LightningModule and the data are the user's. Every value is a
//! Python literal written from a JSON value ([`py`]) or a name from a fixed table; a string
//! from a spec appears only in a comment ([`comment_text`]).

use super::offload::{self, NVME_PATH};
use super::trainers::{self, Engine};
use super::{comment_text, refuse, ExportError, Launch, Target};
use crate::layout::Recompute;
use crate::plan::Plan;

/// A Python expression: a literal, or code from this file's fixed tables.
enum Py {
    Lit(serde_json::Value),
    Code(String),
}

/// `v` as a Python literal: JSON's numbers and strings are Python's (serde_json escapes
/// control characters as `\uXXXX`, which Python reads the same); true, false and null are
/// spelt True, False and None.
fn py(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Bool(true) => "True".into(),
        serde_json::Value::Bool(false) => "False".into(),
        serde_json::Value::Null => "None".into(),
        other => other.to_string(),
    }
}

fn lit(v: impl Into<serde_json::Value>) -> Py {
    Py::Lit(v.into())
}

/// `name(\n    key=value,\n ...)`.
fn call(name: &str, args: &[(&str, Py)]) -> String {
    let mut s = format!("{name}(\n");
    for (k, v) in args {
        let v = match v {
            Py::Lit(j) => py(j),
            Py::Code(c) => c.clone(),
        };
        s += &format!("    {k}={v},\n");
    }
    s + ")"
}

/// Lightning's `precision` for the plan's precision policy.
fn precision(plan: &Plan, t: Target) -> Result<&'static str, ExportError> {
    match plan.job.model.training.precision.as_str() {
        "default" | "megatron" | "mixed16" => Ok("bf16-mixed"),
        "bf16" => Ok("bf16-true"),
        "fp32" => Ok("32-true"),
        other => Err(refuse(
            t,
            format!("the precision policy \"{other}\" (Lightning's precisions are bf16-mixed, bf16-true and 32-true)"),
            "set precision = \"default\", \"bf16\" or \"fp32\" under [training] and re-plan",
        )),
    }
}

pub(super) fn lightning(plan: &Plan, launch: &Launch) -> Result<String, ExportError> {
    let t = Target::Lightning;
    let p = &plan.parallel;
    let engine = trainers::engine(plan, t, launch)?;
    let precision = precision(plan, t)?;
    let off = offload::of(plan);
    let o = &plan.job.model.optimizer;
    let full = p.recompute == Recompute::Full;
    let mut imports = vec!["import lightning as L".to_string()];
    let strategy = match engine {
        Engine::Ddp => {
            imports.push("from lightning.pytorch.strategies import DDPStrategy".into());
            call("DDPStrategy", &[])
        }
        Engine::Fsdp { strategy, hybrid } => {
            let (module, class) = trainers::layer_class(plan, t)?;
            imports.push("from lightning.pytorch.strategies import FSDPStrategy".into());
            imports.push(format!("from {module} import {class}"));
            let mut args = vec![
                ("sharding_strategy", lit(strategy)),
                // FSDP's CPUOffload(offload_params=True): weights, gradients and the
                // optimizer step on the host (the plan's params offload).
                ("cpu_offload", lit(off.params())),
                ("auto_wrap_policy", Py::Code(format!("{{{class}}}"))),
            ];
            if full {
                args.push((
                    "activation_checkpointing_policy",
                    Py::Code(format!("{{{class}}}")),
                ));
            }
            if let Some((replicas, shard)) = hybrid {
                // (replication size, sharding size): sharded in a node, replicated across.
                args.push(("device_mesh", Py::Code(format!("({replicas}, {shard})"))));
            }
            args.push(("state_dict_type", lit("sharded")));
            call("FSDPStrategy", &args)
        }
        Engine::DeepSpeed => {
            imports.push("from lightning.pytorch.strategies import DeepSpeedStrategy".into());
            let mut args = vec![
                ("stage", lit(p.zero_stage)),
                ("offload_optimizer", lit(off.optimizer())),
                ("offload_parameters", lit(off.params())),
            ];
            if off.optimizer() {
                args.push(("offload_optimizer_device", lit(off.to.name())));
            }
            if off.params() {
                args.push(("offload_params_device", lit(off.to.name())));
            }
            if off.nvme() {
                args.push(("nvme_path", lit(NVME_PATH)));
            }
            args.push(("pin_memory", lit(true)));
            call("DeepSpeedStrategy", &args)
        }
    };
    let clip = if o.clip_grad > 0.0 {
        lit(o.clip_grad)
    } else {
        lit(serde_json::Value::Null)
    };
    let trainer = call(
        "dict",
        &[
            ("accelerator", lit("gpu")),
            ("devices", lit(launch.uniform().unwrap_or(1))),
            ("num_nodes", lit(launch.nodes)),
            ("strategy", Py::Code("strategy".into())),
            ("precision", lit(precision)),
            ("accumulate_grad_batches", lit(p.microbatches)),
            ("gradient_clip_val", clip),
        ],
    );
    let mut notes = format!(
        "# Lightning Trainer for {} on {} × {} (dp {}, ZeRO-{}{}), written by tessera export.\n\
         # Use: L.Trainer(**trainer_kwargs).fit(model, data): the LightningModule and the data are yours,\n\
         # with a batch of {} sequences per device ({} micro-batches per step accumulate).\n",
        comment_text(&plan.job.model.name),
        p.world,
        comment_text(&plan.job.cluster.device.name),
        p.dp,
        p.zero_stage,
        off.label(),
        p.micro_batch,
        p.microbatches,
    );
    if full && !matches!(engine, Engine::Fsdp { .. }) {
        notes += "# The plan recomputes every layer: checkpoint each decoder layer in your module (this strategy has no such argument).\n";
    }
    if off.nvme() {
        notes += &format!(
            "# \"{NVME_PATH}\" is a placeholder: a folder on each node's local NVMe drive.\n"
        );
    }
    Ok(format!(
        "{notes}{}\n\nstrategy = {strategy}\n\ntrainer_kwargs = {trainer}\n\nif __name__ == \"__main__\":\n    trainer = L.Trainer(**trainer_kwargs)\n",
        imports.join("\n")
    ))
}
