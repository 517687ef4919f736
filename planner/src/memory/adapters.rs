//! What a LoRA or QLoRA layer keeps for its backward, beside or instead of pretraining's list
//! (`activations::layer_tensors`).
//!
//! A frozen linear needs only its weight for the input gradient: autograd saves a linear's input
//! only when the weight's gradient is wanted (PyTorch's generated `MmBackward` saves `self` only
//! if `mat2` requires grad). So a group of linears that share an input (Q, K and V; gate and up;
//! down; the output projection) keeps that input only when one of them carries an adapter,
//! whose A needs it for its gradient. Each adapter keeps its rank-r intermediate (B's input),
//! whole on every TP rank; with LoRA dropout, each adapter also keeps its dropped copy of the
//! input and a 1-byte mask (PEFT gives every adapted module its own `lora_dropout`; with
//! dropout 0 it is `nn.Identity` and the input itself serves).

use super::stored::{Split, Stored};
use crate::finetune::Target;
use crate::model::Model;

/// The pretraining tensor that is the input of a linear group, and the group's targets.
const GROUPS: [(&str, &[Target]); 4] = [
    ("qkv_input", &[Target::Q, Target::K, Target::V, Target::Qkv]),
    ("attn_proj_input", &[Target::O]),
    ("mlp_input", &[Target::Gate, Target::Up]),
    ("mlp_down_input", &[Target::Down]),
];

/// Adjusts a layer's stored tensors for adapters on a frozen base (nothing for `full`).
pub(crate) fn adjust(model: &Model, b: f64, v: &mut Vec<Stored>) {
    let Some(l) = model.adapters() else {
        return;
    };
    let a = &model.architecture;
    for (input, targets) in GROUPS {
        if targets.iter().any(|t| l.targets.contains(t)) {
            continue;
        }
        // The output projection's input is also the attention kernel's output, which its
        // backward reads (flash attention's `O`): it stays.
        if input == "attn_proj_input" {
            continue;
        }
        // A GeLU MLP's down input is the activation's output, which GeLU's backward does not
        // read (it reads `gelu_input`); SwiGLU's is the product, which nothing else reads.
        v.retain(|x| x.name != input);
    }
    let w = super::stored::element_bytes(model);
    let sb = model.training.seq_len as f64 * b;
    let r = l.rank as f64;
    for t in &l.targets {
        let (i, _) = t.shape(a);
        let stored = |name, bytes, split, mm| Stored {
            name,
            bytes,
            split,
            attention_core: false,
            layer_input: false,
            mm_output: mm,
            sdpa_output: false,
            op_sac_only: false,
        };
        // B's input: A's output, r wide on every TP rank (a row-parallel A's partial sums are
        // summed over TP before B).
        v.push(stored("lora_intermediate", w * sb * r, Split::Whole, true));
        if l.dropout > 0.0 {
            // A column-parallel linear's input is whole on every rank (gathered under SP); a
            // row-parallel one's is the rank's 1/TP of the features.
            let split = if t.column_parallel() {
                Split::Whole
            } else {
                Split::Sharded
            };
            v.push(stored(
                "lora_dropout_output",
                w * sb * i as f64,
                split,
                false,
            ));
            v.push(stored("lora_dropout_mask", sb * i as f64, split, false));
        }
    }
}
