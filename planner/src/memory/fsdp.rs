//! FSDP's memory, as the framework profile's `[memory]` table selects it: FSDP2's 16 B/param
//! states and the bf16 copies of the modules in flight, the root module held unsharded through
//! the backward, the fp32 reduce-scatter buffer, and the working set of the layer that full
//! recompute re-runs. The default profiles (`megatron-core`, `tessera`: `sharding = "zero"`,
//! `unsharded_root = false`) select none of them.
//!
//! Sources: pytorch/pytorch torch/distributed/fsdp/_fully_shard/ (`fully_shard`,
//! `MixedPrecisionPolicy`; `_fsdp_param.py` keeps the sharded parameter in its original dtype
//! and all-gathers a `param_dtype` copy; `_fsdp_collectives.py` `foreach_reduce` casts the
//! unsharded gradients to `reduce_dtype` into one reduce-scatter input of the module's unsharded
//! size); pytorch/torchtitan torchtitan/models/llama3/infra/parallelize.py (`fully_shard` per
//! block, then on the whole model, the root, which holds the token embedding, final norm and
//! output layer; `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`).

use super::{activations, moe, per_layer_act};
use crate::framework::{self, Reports, ShardingPolicy};
use crate::layout::{Layout, Recompute};
use crate::model::Model;
use crate::precision::{Policy, State, StateClass};
use crate::spec::Cluster;

/// FSDP2 with `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: the sharded
/// parameter is the fp32 original (the optimizer updates it in place: no separate master copy),
/// its gradient is fp32 (reduce-scattered in fp32 into the sharded `.grad`), and Adam keeps two
/// fp32 moments: 4 + 4 + 8 = 16 B/param, all sharded. The bf16 copies exist only while a module
/// is gathered ([`stage_terms`]). Not a spec-selectable policy: the profile selects it.
pub static FSDP2: Policy = Policy {
    name: "fsdp2",
    summary: "FSDP2 mixed precision, 16 B/param sharded: fp32 parameter 4 + fp32 gradient 4 + Adam m, v 8; bf16 copies only while gathered",
    states: &[
        State {
            name: "params_fp32_sharded",
            bytes: 4,
            class: StateClass::Param,
            why: "FSDP2's sharded fp32 parameter (the optimizer updates it; forward and backward read a gathered bf16 copy)",
        },
        State {
            name: "grads_fp32_sharded",
            bytes: 4,
            class: StateClass::Grad,
            why: "FSDP2's sharded fp32 gradient (reduce_dtype=fp32), accumulated across micro-batches",
        },
        State {
            name: "adam_m_fp32",
            bytes: 4,
            class: StateClass::Optim,
            why: "Adam first moment (fp32)",
        },
        State {
            name: "adam_v_fp32",
            bytes: 4,
            class: StateClass::Optim,
            why: "Adam second moment (fp32)",
        },
    ],
    activation_bytes: 2,
};

/// Bytes per element of FSDP2's gathered parameters and unsharded gradients (`param_dtype`).
const BF16: f64 = 2.0;
/// Bytes per element of the reduce-scatter input (`reduce_dtype=float32`).
const FP32: f64 = 4.0;

/// Which of this module's mechanisms a layout's profile selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Fsdp {
    /// FSDP2 under ZeRO-3 (FULL_SHARD): the 16 B/param states, the gathered blocks and the fp32
    /// reduce-scatter buffer.
    pub fsdp2: bool,
    /// The root module (embedding, final norm, output layer) unsharded through the backward.
    pub unsharded_root: bool,
    /// Full recompute by PyTorch's checkpoint (FSDP profiles): one layer's activations alive.
    pub working_set: bool,
    /// The framework reports the caching allocator's reserved bytes.
    pub reserved: bool,
    /// The stage is charged the caching allocator's slack, `allocator_reserved`: a framework
    /// that allocates through PyTorch's caching allocator on a GPU and reports what it reserves.
    /// At a steady step each transient block reuses the cached block of its own size that the
    /// step before freed, so a framework measured by its allocated bytes is charged none (the
    /// published runs that ran: docs/validation.md, feasibility); the reserved figures that
    /// torchtitan publishes hold one segment more (docs/frameworks.md).
    pub caching: bool,
    /// ZeRO-3's gather unit outside FSDP2 (the profile's `memory.zero3_fetch`).
    pub zero3_fetch: framework::Zero3Fetch,
    /// DeepSpeed's pipeline buffers (the profile's `memory.pipe_buffers`).
    pub pipe_buffers: bool,
    /// The profile's vocabulary padding and loss (`runs.pad_vocab`, `runs.loss`), which size
    /// the root module and the output layer's buffers (the memory model reads them here, from
    /// its one lookup of the profile).
    pub pad_vocab: bool,
    pub loss: super::logits::Loss,
}

impl Fsdp {
    pub fn of(model: &Model, cluster: &Cluster, layout: &Layout) -> Fsdp {
        let profile = framework::of(model, cluster);
        let m = &profile.memory;
        let zero3 = layout.sharding.zero_stage == 3;
        Fsdp {
            fsdp2: zero3 && m.sharding == ShardingPolicy::Fsdp2,
            unsharded_root: zero3 && m.unsharded_root,
            working_set: m.sharding != ShardingPolicy::Zero && layout.recompute == Recompute::Full,
            reserved: m.reports == Reports::Reserved,
            caching: m.allocator == framework::Allocator::Caching
                && m.reports == Reports::Reserved
                && cluster.device.kind == crate::spec::DeviceKind::Gpu,
            zero3_fetch: m.zero3_fetch,
            pipe_buffers: m.pipe_buffers && layout.pp > 1,
            pad_vocab: profile.runs.pad_vocab,
            loss: super::logits::Loss {
                kind: profile.runs.loss,
                parallel: profile.runs.loss_parallel,
            },
        }
    }

    /// The precision policy the stage's states follow: FSDP2's, or the model's.
    pub fn policy(&self, model: &Model) -> &'static Policy {
        if self.fsdp2 {
            &FSDP2
        } else {
            Policy::by_name(&model.training.precision)
                .expect("the precision policy is validated when the spec is resolved")
        }
    }
}

/// Parameters of one FSDP unit on a rank (one transformer block after TP; the larger of a
/// dense and an MoE block).
fn block_params(model: &Model, layout: &Layout) -> f64 {
    let (common, experts) = moe::moe_layer_params_per_rank(model, layout);
    model
        .architecture
        .layer_params()
        .per_tp_rank(layout.tp)
        .max(common + experts)
}

/// Parameters of the root module on `stage` (after TP): the token embedding on the first stage,
/// the final norm and output layer on the last.
pub(super) fn root_params(model: &Model, layout: &Layout, stage: u64, pad: bool) -> f64 {
    let a = &model.architecture;
    let tp = layout.tp;
    let mut p = 0.0;
    if stage == 0 {
        p += a.embedding_params_at(tp, pad).per_tp_rank(tp);
    }
    if stage == layout.pp - 1 {
        p += a
            .head_params_at(a.tied_embeddings && layout.pp == 1, tp, pad)
            .per_tp_rank(tp);
    }
    p
}

/// One layer's full activations for one micro-batch on a rank: what full recompute re-creates
/// in the backward on top of the checkpoints (PyTorch's `checkpoint` re-runs the block's forward
/// and holds its saved tensors until the block's backward frees them).
fn working_set_bytes(model: &Model, layout: &Layout) -> f64 {
    let none = Layout {
        recompute: Recompute::None,
        recompute_every: 1,
        ..*layout
    };
    let dense = per_layer_act(model, &none);
    if model.architecture.moe.is_some() {
        dense.max(moe::moe_layer_act(model, &none))
    } else {
        dense
    }
}

/// DeepSpeed's pipeline buffers on `stage`: the stage output of each micro-batch in flight
/// (all but the last stage), and one receive buffer for activations (all but the first) and one
/// for gradients (all but the last), each a whole micro-batch's b × s × hidden activation on a
/// TP rank (the engine sends whole tensors).
fn pipe_buffer_bytes(model: &Model, layout: &Layout, stage: u64) -> f64 {
    let local = layout.rank_tokens(model);
    let one = (layout.micro_batch * local.training.seq_len * local.architecture.hidden) as f64
        * super::stored::element_bytes(model);
    let pp = layout.pp;
    let flight = super::in_flight(
        layout.schedule,
        pp,
        layout.microbatches(model),
        layout.virtual_stages,
        stage,
    ) as f64;
    let outputs = if stage + 1 < pp { flight } else { 0.0 };
    let recv = if stage > 0 { 1.0 } else { 0.0 };
    let grad = if stage + 1 < pp { 1.0 } else { 0.0 };
    one * (outputs + recv + grad)
}

/// The terms this module adds to `stage`, as `(name, kind, bytes)`; empty when the profile
/// selects none.
pub(super) fn stage_terms(
    f: &Fsdp,
    model: &Model,
    layout: &Layout,
    stage: u64,
) -> Vec<(&'static str, &'static str, f64)> {
    let mut t = Vec::new();
    if f.pipe_buffers {
        let bytes = pipe_buffer_bytes(model, layout, stage);
        if bytes > 0.0 {
            t.push(("pipeline_buffers", "activations", bytes));
        }
    }
    if !(f.fsdp2 || f.unsharded_root || f.working_set) {
        // The default profiles select none: nothing to size (the search's hot path).
        return t;
    }
    let root = root_params(model, layout, stage, f.pad_vocab);
    if f.fsdp2 {
        let block = block_params(model, layout);
        t.push((
            "fsdp2_gathered_blocks",
            "model_states",
            block * (2.0 * BF16 + BF16),
        ));
        t.push((
            "fsdp2_reduce_scatter_fp32",
            "model_states",
            block.max(root) * FP32,
        ));
    }
    if f.unsharded_root && root > 0.0 {
        t.push(("unsharded_root", "model_states", root * (BF16 + BF16)));
    }
    if f.working_set {
        t.push((
            "recompute_working_set",
            "activations",
            working_set_bytes(model, layout),
        ));
    }
    t
}

/// Why a term of [`stage_terms`] is there, for `tessera explain`.
pub(super) fn reason(f: &Fsdp, name: &str, model: &Model, layout: &Layout, stage: u64) -> String {
    let block = block_params(model, layout);
    let root = root_params(model, layout, stage, f.pad_vocab);
    match name {
        "fsdp2_gathered_blocks" => format!(
            "FSDP2 all-gathers the current and the prefetched block's bf16 parameters (param_dtype=bf16, 2 × 2 B) and holds the current block's unsharded bf16 gradient before its reduce-scatter (2 B): 6 B × {block:.0} params of one block"
        ),
        "fsdp2_reduce_scatter_fp32" => format!(
            "FSDP2's reduce-scatter input in fp32 (reduce_dtype=float32), unsharded, of the largest module reduced on this stage: 4 B × {:.0} params ({})",
            block.max(root),
            if root > block { "the root module" } else { "one block" }
        ),
        "unsharded_root" => format!(
            "the root module (token embedding, final norm, output layer on this stage: {root:.0} params) stays gathered from the backward's start to the root's post-backward at its end: its bf16 parameters and its bf16 unsharded gradient, 2 + 2 B/param, not 1/DP"
        ),
        "recompute_working_set" => format!(
            "full recompute re-runs one layer's forward in the backward: that layer's activations ({} recompute's checkpoints aside) for one micro-batch",
            layout.recompute.name()
        ),
        "pipeline_buffers" => {
            let flight = super::in_flight(
                layout.schedule,
                layout.pp,
                layout.microbatches(model),
                layout.virtual_stages,
                stage,
            );
            format!(
                "DeepSpeed's pipeline engine keeps each in-flight micro-batch's stage output until its backward ({} here) and one receive buffer each for activations and gradients (pipe_buffers['outputs'], pipe_recv_buf, grad_layer), each a whole b × s × hidden tensor",
                if stage + 1 < layout.pp { flight } else { 0 }
            )
        }
        _ => String::new(),
    }
}

/// The two moments of an FSDP2 step whose live tensors differ, over which a stage's peak is
/// taken ([`phased`]): the sum of every term counts tensors that are never alive together.
///
/// - **The start of the backward** (the loss's backward on the stage that holds the head): every
///   layer's activations and the loss's buffers are alive, but no layer's recomputed forward
///   (full recompute re-runs it inside that layer's backward); the last block's bf16 parameters are
///   still gathered (torchtitan keeps the last block unsharded after its forward: no prefetch or
///   unsharded gradient yet), the root module holds its bf16 parameters but not yet its
///   gradient, no reduce-scatter has run (no fp32 reduce-scatter buffer), and with one
///   micro-batch a step no sharded gradient exists yet (the optimizer's `zero_grad` sets them to
///   `None`; FSDP2 creates them in the backward's reduce-scatters).
/// - **The end of the backward**: every sharded gradient, the root's fp32 reduce-scatter input,
///   its bf16 parameters and gradient, the gathered block with its prefetch, and one layer's
///   activations (the first layer's, its backward running); the loss's buffers are freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    BackwardStart,
    BackwardEnd,
}

impl Phase {
    pub(super) const BOTH: [Phase; 2] = [Phase::BackwardStart, Phase::BackwardEnd];

    /// How the report names the moment, in a scaled term's reason.
    pub(super) fn name(self) -> &'static str {
        match self {
            Phase::BackwardStart => "at the start of the backward, the step's peak",
            Phase::BackwardEnd => "at the end of the backward, the step's peak",
        }
    }
}

/// Whether the stage's peak is the larger of the two [`Phase`]s rather than the sum of every
/// term: FSDP2 under ZeRO-3 on a GPU, one pipeline stage, a dense model trained in full without
/// offload (the layouts whose phases are modelled; every other keeps the sum, an upper bound).
pub(super) fn phased(f: &Fsdp, model: &Model, layout: &Layout, gpu: bool) -> bool {
    f.fsdp2
        && gpu
        && layout.pp == 1
        && model.architecture.moe.is_none()
        && model.adapters().is_none()
        && !layout.offload.any()
}

/// The share of the term `name` alive at `phase` (1: all of it, 0: none). `head` names the
/// output layer's buffers ([`activations::head_terms`]); `layers`, the stage's layers.
pub(super) fn phase_share(
    phase: Phase,
    name: &str,
    microbatches: u64,
    layers: u64,
    head: &[&str],
) -> f64 {
    match (phase, name) {
        (Phase::BackwardStart, "grads_fp32_sharded") if microbatches == 1 => 0.0,
        (Phase::BackwardStart, "fsdp2_reduce_scatter_fp32") => 0.0,
        // One block's bf16 parameters of the 2 + 2 + 2 B (parameters, prefetch, gradient).
        (Phase::BackwardStart, "fsdp2_gathered_blocks") => 1.0 / 3.0,
        // The bf16 parameters of the 2 + 2 B (parameters, gradient).
        (Phase::BackwardStart, "unsharded_root") => 0.5,
        // Full recompute re-runs a layer's forward inside that layer's backward, which begins
        // only after the loss's backward has finished and freed its buffers.
        (Phase::BackwardStart, "recompute_working_set") => 0.0,
        (Phase::BackwardEnd, "layer_activations") => 1.0 / layers.max(1) as f64,
        (Phase::BackwardEnd, n) if head.contains(&n) => 0.0,
        _ => 1.0,
    }
}

/// The stage's transient blocks (allocated and freed within the step), for the allocator's
/// reserved bytes: FSDP2's all-gather output of one block and its reduce-scatter input, the
/// recomputed layer's activations, and on the last stage the output layer's buffers.
pub(super) fn transient_blocks(f: &Fsdp, model: &Model, layout: &Layout, stage: u64) -> Vec<f64> {
    let mut t: Vec<f64> = stage_terms(f, model, layout, stage)
        .into_iter()
        .map(|(name, _, bytes)| match name {
            // One all-gather output (one block's bf16 parameters) is one block of the allocator.
            "fsdp2_gathered_blocks" => bytes / 3.0,
            // The root's parameters and gradient are two tensors lists held through the
            // backward: not transient.
            "unsharded_root" => 0.0,
            // Held from forward to backward, or for the whole step: not transient.
            "pipeline_buffers" => 0.0,
            _ => bytes,
        })
        .collect();
    if layout.sharding.zero_stage == 3 && !f.fsdp2 {
        // One gathered unit of ZeRO-3 outside FSDP2: a block's, or DeepSpeed's largest module's,
        // 16-bit weights.
        let unit = match f.zero3_fetch {
            framework::Zero3Fetch::Block => block_params(model, layout),
            framework::Zero3Fetch::Submodule => {
                super::zero3::largest_submodule(&model.architecture, layout.tp)
            }
        };
        t.push(unit * BF16);
    }
    if stage == layout.pp - 1 {
        let local = layout.rank_tokens(model);
        let (b, tp, sp) = (layout.micro_batch, layout.tp, layout.sequence_parallel);
        t.extend(
            activations::head_terms(&local, b, tp, sp, f.loss, f.pad_vocab)
                .iter()
                .map(|(_, x, _)| *x),
        );
    }
    t
}

#[cfg(test)]
#[path = "fsdp_tests.rs"]
mod tests;
