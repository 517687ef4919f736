//! Hugging Face PEFT's `LoraConfig` as its `adapter_config.json` (JSON, through serde_json): the
//! adapters of a LoRA or QLoRA plan, with the target modules named as transformers names them
//! for the model's family ([`crate::finetune::Target::peft_name`]). PEFT's config holds the
//! adapters only: the 4-bit base of a QLoRA plan is transformers' `BitsAndBytesConfig`, which
//! [`peft_note`] prints beside the file; the layout and the batch are the trainer's.

use super::{refuse, ExportError, Target};
use crate::finetune::{Lora, Method};
use crate::model::Architecture;
use crate::model::Family;
use crate::plan::Plan;

/// A float that is a whole number as an integer (PEFT types `r` and `lora_alpha` as ints).
pub(super) fn number(x: f64) -> serde_json::Value {
    if x.fract() == 0.0 && x.abs() < 9.0e15 {
        serde_json::json!(x as i64)
    } else {
        serde_json::json!(x)
    }
}

pub(super) fn peft(plan: &Plan) -> Result<String, ExportError> {
    let t = Target::Peft;
    let m = &plan.job.model;
    let lora = match (m.training.method, &m.lora) {
        (Method::Full, _) | (_, None) => {
            return Err(refuse(
                t,
                "a full fine-tune (training.method = \"full\"): every weight trains, so there is no adapter for a LoraConfig to describe",
                "plan it with --method lora or qlora (and --lora-rank), or export the full plan to torchtune, torchtitan, megatron or deepspeed",
            ))
        }
        (_, Some(l)) => l,
    };
    let config = adapter_config(&m.architecture, lora).map_err(|why| {
        refuse(
            t,
            format!("the adapters' targets have no transformers module names: {why}"),
            "re-plan with targets of the model's family",
        )
    })?;
    Ok(serde_json::to_string_pretty(&config).expect("a JSON value serialises") + "\n")
}

/// PEFT's `LoraConfig` of the adapters `lora` on a model `a`, as its `adapter_config.json`
/// holds it (no base model named: `base_model_name_or_path` is null), or why the targets have
/// no transformers module names. `tessera export --to peft` writes it from a plan, `tessera
/// checkpoint export --to peft` beside the trained adapters.
pub fn adapter_config(a: &Architecture, lora: &Lora) -> Result<serde_json::Value, String> {
    let modules = lora.peft_modules(a)?;
    Ok(serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": number(lora.alpha),
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "bias": "none",
        // GPT-2's Conv1D stores its weight as (in, out): PEFT needs fan_in_fan_out for it.
        "fan_in_fan_out": a.family() == Family::Gpt,
        "use_rslora": false,
        "use_dora": false,
        "init_lora_weights": true,
        "modules_to_save": null,
        "base_model_name_or_path": null,
        "inference_mode": false,
    }))
}

/// What a PEFT `adapter_config.json` cannot hold of the plan, printed beside it by
/// `tessera export --to peft`: for QLoRA, the 4-bit base (transformers' `BitsAndBytesConfig`).
pub fn peft_note(plan: &Plan) -> Option<String> {
    let compute = match plan.job.model.training.precision.as_str() {
        "fp32" => "torch.float32",
        _ => "torch.bfloat16",
    };
    (plan.job.model.training.method == Method::Qlora).then(|| {
        format!(
            "the QLoRA base is not PEFT's: load the model with transformers' BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype={compute}) (NF4, blocks of 64, double quantization: what the plan's memory counts), then apply this LoraConfig"
        )
    })
}
