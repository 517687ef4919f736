//! A LoRA checkpoint for Hugging Face: its adapters as PEFT saves them (`adapter_model.safetensors`
//! and `adapter_config.json`, which `PeftModel.from_pretrained` applies to the base), or the
//! model with the adapters merged into the base's weights, `W' = W + (alpha/r)·B·A` (what
//! PEFT's `merge_and_unload` computes), written as [`export`](super::export) writes a model.
//!
//! An adapter is `{linear}.lora_A.weight (r, in)` and `{linear}.lora_B.weight (out, r)` under the
//! runtime's linear name (`layers::lora_attach`); PEFT's key is the HF module's path under
//! `base_model.model.` with the same suffix. Neither matrix is transposed for GPT-2's `Conv1D`
//! modules: PEFT's `lora_A` and `lora_B` are `nn.Linear`s whatever the base layer is, and
//! `fan_in_fan_out` only transposes the delta it merges. A fused `c_attn`'s B, stored
//! `(3, out_part, r)`, flattens to PEFT's `(3·out_part, r)`: rows in q, k, v order, as
//! `c_attn`'s outputs are.

use std::collections::BTreeMap;
use std::path::Path;

use tessera_planner::finetune::Lora;

use super::export::{
    check_target, damaged, export_globals, refuse_nf4, write_folder, Globals, Out, Tensor,
};
use super::{family, modules, ExportSummary, HfError, Module};
use crate::checkpoint::Checkpoint;

/// The adapters file of a PEFT folder.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The `LoraConfig` file of a PEFT folder.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// What PEFT's saved keys start with: the `PeftModel`'s `base_model` (a `LoraModel`) and its
/// `model`, the transformers model.
const PEFT_PREFIX: &str = "base_model.model.";

/// One linear's adapter, read from a checkpoint: `A (r, in)` and `B (out, r)` (flattened).
struct Pair<'a> {
    linear: Module,
    rank: usize,
    inputs: usize,
    outputs: usize,
    a: &'a [f32],
    b: &'a [f32],
}

/// The adapters of `ck` and its LoRA settings; a checkpoint of full training is refused.
fn adapters(ck: &Checkpoint) -> Result<(&Lora, Vec<Pair<'_>>), HfError> {
    let Some(lora) = ck.index().lora.as_ref() else {
        return Err(HfError::Invalid {
            path: ck.dir().display().to_string(),
            problem: "holds no LoRA adapters (every weight was trained): there is no adapter to export or merge".into(),
            fix: "export the model with --to hf (without --merge)".into(),
        });
    };
    let a = &ck.index().model;
    let fam = family(a)?;
    let damaged = damaged(ck);
    let mut modules = modules(a, fam);
    let globals: Globals = ck.params().map(|(n, s, v)| (n, (s, v))).collect();
    let mut halves: BTreeMap<&str, [Option<Tensor>; 2]> = BTreeMap::new();
    for (&name, &tensor) in &globals {
        let Some((linear, half)) = name.split_once(".lora_") else {
            continue;
        };
        let i = match half {
            "A.weight" => 0,
            "B.weight" => 1,
            _ => return Err(damaged(format!("holds {name}, which is no LoRA A or B"))),
        };
        halves.entry(linear).or_default()[i] = Some(tensor);
    }
    let mut pairs = Vec::new();
    for (name, [a_half, b_half]) in halves {
        let linear = modules.remove(name).ok_or_else(|| HfError::Inexpressible {
            field: "lora.targets".into(),
            value: format!("an adapter on {name}"),
            why: format!("{} has no module for it", fam.class()),
            fix: "train adapters on the targets of the model's family (qkv, o, up, down on GPT-2; q, k, v, o, gate, up, down on Llama)".into(),
        })?;
        let (Some((a_shape, a_values)), Some((b_shape, b_values))) = (a_half, b_half) else {
            return Err(damaged(format!(
                "holds only one of {name}'s lora_A and lora_B"
            )));
        };
        let (rank, inputs) = match a_shape {
            [r, i] => (*r, *i),
            _ => {
                return Err(damaged(format!(
                    "{name}.lora_A.weight has shape {a_shape:?}, not (r, in)"
                )))
            }
        };
        let outputs: usize = b_shape[..b_shape.len().saturating_sub(1)].iter().product();
        // The base's rows and columns: B's rows are the parts' rows together, A's columns each
        // part's columns.
        let mut rows = 0;
        for part in &linear.parts {
            // A QLoRA base holds the weight's NF4 codes, one per element, in its shape.
            let codes = format!("{part}.nf4_codes");
            match (globals.get(part.as_str())).or_else(|| globals.get(codes.as_str())) {
                Some(([r, c], _)) if *c == inputs => rows += r,
                _ => {
                    return Err(damaged(format!(
                    "the base weight {part} does not fit {name}.lora_A.weight of shape {a_shape:?}"
                )))
                }
            }
        }
        if b_shape.last() != Some(&rank) || outputs != rows || rank as u64 != lora.rank {
            return Err(damaged(format!(
                "{name}.lora_B.weight has shape {b_shape:?}; rank {} adapters on {rows} outputs need ({rows}, {})",
                lora.rank, lora.rank
            )));
        }
        pairs.push(Pair {
            linear,
            rank,
            inputs,
            outputs,
            a: a_values,
            b: b_values,
        });
    }
    Ok((lora, pairs))
}

/// Writes the adapters of the LoRA checkpoint `ck` as PEFT saves them to the folder `out` (which
/// must not exist, or be empty): `adapter_model.safetensors` with PEFT's keys and shapes, and
/// `adapter_config.json`, the `LoraConfig` that `tessera export --to peft` writes of the plan.
pub fn export_peft(ck: &Checkpoint, out: &Path) -> Result<ExportSummary, HfError> {
    let (lora, pairs) = adapters(ck)?;
    let a = &ck.index().model;
    let fam = family(a)?;
    check_target(out)?;
    let config =
        tessera_planner::export::adapter_config(a, lora).map_err(|why| HfError::Inexpressible {
            field: "lora.targets".into(),
            value: lora
                .targets
                .iter()
                .map(|t| t.name())
                .collect::<Vec<_>>()
                .join(","),
            why,
            fix: "train adapters on the targets of the model's family".into(),
        })?;
    let mut tensors = Vec::new();
    for p in &pairs {
        let key = |half: &str| format!("{PEFT_PREFIX}{}.lora_{half}.weight", p.linear.module);
        tensors.push(Out {
            name: key("A"),
            shape: vec![p.rank, p.inputs],
            values: p.a.to_vec(),
        });
        tensors.push(Out {
            name: key("B"),
            shape: vec![p.outputs, p.rank],
            values: p.b.to_vec(),
        });
    }
    let bytes = write_folder(out, (ADAPTER_WEIGHTS, &tensors), (ADAPTER_CONFIG, &config))?;
    Ok(ExportSummary {
        family: fam,
        dir: out.to_path_buf(),
        tensors: tensors.len(),
        params: tensors.iter().map(|t| t.values.len() as u64).sum(),
        bytes,
    })
}

/// Writes the LoRA checkpoint `ck` as its HF class with every adapter merged into its base
/// weight, `W + (alpha/r)·B·A`, to the folder `out` (which must not exist, or be empty).
pub fn export_merged(ck: &Checkpoint, out: &Path) -> Result<ExportSummary, HfError> {
    refuse_nf4(ck)?;
    let (lora, pairs) = adapters(ck)?;
    let scaling = lora.scaling();
    let base: Globals = ck
        .params()
        .filter(|(n, _, _)| !n.contains(".lora_"))
        .map(|(n, s, v)| (n, (s, v)))
        .collect();
    let mut merged: BTreeMap<&str, Vec<f32>> = BTreeMap::new();
    for p in &pairs {
        let delta = delta(p, scaling);
        let mut rows = delta.chunks_exact(p.inputs);
        for part in &p.linear.parts {
            let (_, w) = base[part.as_str()];
            let (name, _) = base
                .get_key_value(part.as_str())
                .expect("checked by adapters()");
            let weight = merged.entry(name).or_insert_with(|| w.to_vec());
            for (row, d) in weight.chunks_exact_mut(p.inputs).zip(&mut rows) {
                for (x, dx) in row.iter_mut().zip(d) {
                    *x = (f64::from(*x) + dx) as f32;
                }
            }
        }
    }
    let globals: Globals = base
        .iter()
        .map(|(&n, &(s, v))| (n, (s, merged.get(n).map_or(v, Vec::as_slice))))
        .collect();
    export_globals(ck, &globals, out)
}

/// `scaling · B·A (out, in)`, row-major, in f64.
fn delta(p: &Pair, scaling: f64) -> Vec<f64> {
    let mut d = vec![0.0; p.outputs * p.inputs];
    for (row, b) in d.chunks_exact_mut(p.inputs).zip(p.b.chunks_exact(p.rank)) {
        for (bk, a) in b.iter().zip(p.a.chunks_exact(p.inputs)) {
            let s = scaling * f64::from(*bk);
            for (x, ak) in row.iter_mut().zip(a) {
                *x += s * f64::from(*ak);
            }
        }
    }
    d
}
