//! What one checkpoint of a plan writes, and how long the write takes: the state a run needs
//! to resume, per rank, summed per node and divided by the node's write bandwidth to the
//! checkpoint filesystem (`[storage] write_gbps`).
//!
//! The state is the trainable parameters' weights as the policy keeps them (its `Param`-class
//! states: the 16-bit copy of mixed precision, the fp32 weights of the `fp32` policy) and their
//! optimizer states (`Optim` class: the fp32 master weights and Adam's moments, 8-bit where the
//! job asks for bitsandbytes' moments): 14 B per parameter under the default policy (2 + 4 + 8),
//! 12 B under `fp32` — what Tessera's own checkpoint holds (docs/checkpoints.md: the f32 master,
//! `exp_avg`, `exp_avg_sq`; 1,494,029,410 B measured for GPT-2 124M, against 12 × 124,439,808 =
//! 1,493,277,696 B of tensors). The last stage's copy of a tied embedding is not saved. Gradients are not saved (a save follows an optimizer step).
//! A LoRA or QLoRA job saves its adapters and their moments only: the frozen base is reloaded
//! from where it came from, as PEFT's `save_pretrained` and torchtune's adapter checkpoints do.
//!
//! Replicas are written once, and the writing is spread over them: each rank of the DP × CP
//! group that holds the same weights writes an equal share of them (PyTorch Distributed
//! Checkpoint's `dedup_save_plans` gives each replicated item to one rank, balancing the bytes;
//! Megatron-Core's `--ckpt-fully-parallel-save` splits replicas' writes over the DP ranks).
//! Tessera's own save has DP rank 0 write replicas; on one node, the case its bench measures,
//! the node's bytes are the same. Every rank of one node shares the node's bandwidth; the save
//! takes as long as the busiest node.

use crate::layout::Layout;
use crate::memory::MemoryReport;
use crate::model::Model;
use crate::precision::{Policy, StateClass};
use crate::spec::Cluster;

/// Bytes one checkpoint writes: in all, and on the node that writes the most.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaveBytes {
    pub total: f64,
    pub busiest_node: f64,
    /// Bytes saved per trainable parameter (weights as kept plus optimizer states).
    pub per_parameter: f64,
}

/// The bytes `layout` writes per checkpoint of `model` (see the module's rule).
pub fn save_bytes(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    memory: &MemoryReport,
) -> SaveBytes {
    let model = crate::precision::for_device(model, cluster);
    let (mut param_b, mut optim_b) = (0.0, 0.0);
    // A resolved model names a known policy (`Model::check`); an unknown one saves nothing.
    let terms = Policy::by_name(&model.training.precision)
        .map(|p| p.terms(model.training.optimizer_states))
        .unwrap_or_default();
    for t in terms {
        match t.class {
            StateClass::Param => param_b += t.bytes,
            StateClass::Optim => optim_b += t.bytes,
            StateClass::Grad => {}
        }
    }
    let counts = crate::finetune::counts(
        &model.architecture,
        model.training.method,
        model.lora.as_ref(),
    );
    let all = (counts.trainable + counts.frozen).max(1) as f64;
    let trainable_share = counts.trainable as f64 / all;
    let mesh = layout.mesh(cluster);
    let replicas = (mesh.dp * mesh.cp.max(1)).max(1) as f64;
    let nodes = mesh.world().div_ceil(mesh.gpus_per_node).max(1) as usize;
    // The last stage's copy of a tied embedding table is the first stage's, not saved twice.
    let a = &model.architecture;
    let tied_copy = if a.tied_embeddings && layout.pp > 1 {
        let pad = crate::framework::of(&model, cluster).runs.pad_vocab;
        let tp = layout.tp.max(1);
        a.head_params_at(false, tp, pad).per_tp_rank(tp)
            - a.head_params_at(true, tp, pad).per_tp_rank(tp)
    } else {
        0.0
    };
    let mut per_node = vec![0.0f64; nodes];
    let mut total = 0.0;
    for rank in 0..mesh.world() {
        let c = mesh.coord(rank);
        let Some(stage) = memory.per_stage.get(c.pp as usize) else {
            continue;
        };
        let mut params = stage.params_per_rank as f64;
        if c.pp + 1 == layout.pp {
            params = (params - tied_copy).max(0.0);
        }
        let bytes = params * trainable_share * (param_b + optim_b) / replicas;
        per_node[mesh.node(rank) as usize] += bytes;
        total += bytes;
    }
    SaveBytes {
        total,
        busiest_node: per_node.iter().copied().fold(0.0, f64::max),
        per_parameter: param_b + optim_b,
    }
}
