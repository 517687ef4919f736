//! What Tessera's own CPU runtime keeps on a rank besides the policy's states and the stored
//! activations (`tessera run` on a CPU cluster; docs/performance.md, "CPU memory"): one
//! layer's backward workspace, the ZeRO shard buffers, the thread communicator's pooled
//! messages and the GEMM crate's packing slab. Each follows a buffer of the runtime, named with
//! its file. GPU clusters count none of these (their frameworks' temporaries are the cluster's
//! allocator slack).

use std::borrow::Cow;

use crate::finetune::Method;
use crate::layout::Layout;
use crate::model::{Activation, Model};
use crate::precision::{Policy, StateClass};
use crate::spec::Cluster;

/// The model whose layer activations a rank keeps: on the CPU runtime (`cpu`), an adapter
/// plan's layers keep what full training's keep, and a plan with dropout keeps what one
/// without keeps. The runtime saves the same tensors whatever trains (a frozen linear group
/// keeps its input, unlike autograd's `MmBackward`), and each adapter recomputes its rank-r
/// intermediate from that input in the backward (runtime/src/layers/lora.rs) instead of
/// keeping it; it keeps no dropout mask nor dropped copy, but draws each mask again from the
/// counter RNG where it is needed (runtime/src/layers/dropout.rs), as flash attention does.
pub(crate) fn activation_model(model: &Model, cpu: bool) -> Cow<'_, Model> {
    if cpu && (model.training.method.adapters() || model.training.dropout > 0.0) {
        let mut m = model.clone();
        m.training.method = Method::Full;
        m.training.dropout = 0.0;
        Cow::Owned(m)
    } else {
        Cow::Borrowed(model)
    }
}

/// The CPU runtime's backward workspace on a rank (`tessera run` on a CPU cluster): one set of
/// gradient buffers for one micro-batch, shared by the stage's layers (runtime/src/layers/
/// block_bufs.rs `BlockWorkspace`): the two norms' output gradients (`rows × h`), the MLP's
/// pre-activation and activation gradients, the attention's q/k/v and output gradients, its
/// f32 score scratch (64 query rows × T), and under sequence parallelism three full-row
/// buffers; and the two layer-boundary gradients the executor's backward loop holds while a
/// layer runs, the one coming in and the one it writes (`dx`, `din`: `rows × h` each,
/// runtime/src/exec/rank.rs). GPU frameworks' temporaries are not modelled here (their
/// allocator's slack is the cluster's `overhead.fragmentation`); 0 for a GPU cluster.
pub fn workspace_bytes(model: &Model, cpu: bool, b: u64, tp: u64, sp: bool) -> f64 {
    if !cpu {
        return 0.0;
    }
    let a = &model.architecture;
    let w = crate::memory::stored::element_bytes(model);
    let n = model.training.seq_len as f64 * b as f64;
    let t = tp as f64;
    let h = a.hidden as f64;
    let f = a.ffn_hidden as f64 / t;
    let pre = match a.activation {
        Activation::Gelu => f,
        Activation::Swiglu => 2.0 * f,
    };
    let rows = if sp { n / t } else { n };
    let (q, kv) = (a.q_dim() as f64 / t, a.kv_dim() as f64 / t);
    let seq = model.training.seq_len as f64;
    let scratch = 4.0 * seq.min(64.0) * seq;
    let sp_rows = if sp && tp > 1 { 3.0 * n * h } else { 0.0 };
    w * (2.0 * rows * h
        + 2.0 * rows * h
        + n * (pre + f)
        + n * (q + 2.0 * kv)
        + n * q
        + sp_rows
        + lora_dropout(model, n, tp))
        + scratch
}

/// LoRA dropout's per-call temporary (runtime/src/layers/lora.rs), in elements: the dropped
/// copy of an adapter's input, `N · in`, `in` the widest adapted input on the rank (whole for a
/// column-parallel linear, 1/TP for a row-parallel one), made in the forward and again in the
/// backward. 0 without LoRA dropout.
fn lora_dropout(model: &Model, n: f64, tp: u64) -> f64 {
    let Some(l) = model.adapters().filter(|l| l.dropout > 0.0) else {
        return 0.0;
    };
    let widest = l.targets.iter().map(|t| {
        let (i, _) = t.shape(&model.architecture);
        match t.column_parallel() {
            true => i as f64,
            false => i as f64 / tp as f64,
        }
    });
    n * widest.fold(0.0, f64::max)
}

/// The ZeRO stage a rank's weights and gradients follow: the one planned, except on the CPU
/// runtime, which keeps one whole weight buffer and one whole gradient buffer under every
/// stage (runtime/src/exec/sync.rs: ZeRO-2 reduce-scatters into a shard buffer beside the
/// whole gradient, ZeRO-3 zero-fills the other ranks' parts after each use instead of freeing
/// them) and shards only the Adam moments: ZeRO-1's states there, with ZeRO-2/3's
/// communication.
pub(crate) fn states_zero(cluster: &Cluster, zero: u8) -> u8 {
    match cluster.device.kind {
        crate::spec::DeviceKind::Cpu => zero.min(1),
        crate::spec::DeviceKind::Gpu => zero,
    }
}

/// Micro-batch-chunks of activations a rank of `stage` holds on the CPU runtime: it keeps each
/// chunk's activations in a pool of their own for reuse (runtime/src/exec/rank.rs `pool`), so
/// it holds, chunk by chunk, the most of that chunk's in flight at once in the schedule's op
/// list, summed: under interleaving more than the most in flight at once over all chunks
/// (chunk 0 peaks in the warm-up, the last chunk in the cool-down). The op list is the one the
/// runtime executes (`schedule::build`); [`super::in_flight`]'s count where it cannot be built.
pub(crate) fn pooled_in_flight(layout: &Layout, microbatches: u64, stage: u64) -> u64 {
    let (pp, v) = (layout.pp as usize, layout.virtual_stages as usize);
    let fallback = super::in_flight(
        layout.schedule,
        layout.pp,
        microbatches,
        layout.virtual_stages,
        stage,
    );
    let Ok(schedule) = crate::schedule::build(layout.schedule, pp, microbatches as usize, v) else {
        return fallback;
    };
    let ops = schedule
        .stages
        .get(stage as usize)
        .map_or(&[][..], Vec::as_slice);
    let (mut live, mut most) = (vec![0u64; v.max(1)], vec![0u64; v.max(1)]);
    for op in ops {
        match *op {
            crate::schedule::Op::Forward { chunk, .. } => {
                live[chunk] += 1;
                most[chunk] = most[chunk].max(live[chunk]);
            }
            // A split backward holds the micro-batch until its W.
            crate::schedule::Op::Backward { chunk, .. }
            | crate::schedule::Op::BackwardWeight { chunk, .. } => {
                live[chunk] = live[chunk].saturating_sub(1)
            }
            _ => {}
        }
    }
    most.iter().sum()
}

/// The CPU runtime's ZeRO scratch (runtime/src/exec/sync.rs): a gradient shard and a
/// parameter shard of the largest chunk's region (one of `chunks` of the stage's `params`),
/// in the policy's gradient and weight widths, when ZeRO shards over more than one rank.
pub(crate) fn zero_buffers(policy: &Policy, params: f64, zero: u8, shard: u64, chunks: u64) -> f64 {
    if zero == 0 || shard <= 1 {
        return 0.0;
    }
    let widths = f64::from(policy.class_bytes(StateClass::Grad).min(4))
        + f64::from(policy.class_bytes(StateClass::Param));
    params / chunks.max(1) as f64 / shard as f64 * widths
}

/// The thread communicator's pooled messages of the DP gradient sync on a rank holding
/// `params` in `chunks` chunks (runtime/src/comm/local.rs keeps sent buffers for reuse): an
/// all-reduce of a chunk's fp32 gradients sends every chunk of it but its own and keeps the
/// reduced one, the chunk's size in all; a ZeRO reduce-scatter sends the `dp − 1` chunks of
/// the others (the step's all-gather reuses one of them), and ZeRO-3's all-gathers, one per
/// forward and backward, find the previous one's message still held by a peer: one more.
pub(crate) fn dp_messages(params: f64, dp: u64, zero: u8, chunks: u64) -> f64 {
    if dp <= 1 {
        return 0.0;
    }
    let region = 4.0 * params / chunks.max(1) as f64;
    match zero {
        0 => region,
        3 => region,
        _ => region / dp as f64 * (dp - 1) as f64,
    }
}

/// The thread communicator's pooled messages of the activations on a rank of `stage`
/// (runtime/src/comm/local.rs keeps every message buffer it sends for reuse, f32 whatever the
/// policy): TP's all-reduce of a layer's output (or, under sequence parallelism, its
/// all-gather and reduce-scatter) sends `TP − 1` chunks of `1/TP` of the micro-batch's `b·s·h`
/// and keeps the reduced chunk, and the next collective finds the previous reduced chunk still
/// held by a peer that has not copied it yet, so the pool settles at `TP + 1` chunks; the
/// pipeline's sends copy a boundary's activation (or its gradient) into one message each way
/// the stage sends, which its neighbour takes before the next one (one each way: the first
/// stage sends activations, the last gradients, the others and every interleaved stage both).
pub(crate) fn activation_messages(model: &Model, layout: &Layout, stage: u64) -> f64 {
    let local = layout.rank_tokens(model);
    let t = layout.tp as f64;
    let elements =
        (layout.micro_batch * local.training.seq_len) as f64 * local.architecture.hidden as f64;
    let tp = if layout.tp > 1 {
        (t + 1.0) / t * elements
    } else {
        0.0
    };
    let ways = match (layout.pp, layout.virtual_stages) {
        (1, _) => 0,
        (_, v) if v > 1 => 2,
        (pp, _) => u64::from(stage + 1 < pp) + u64::from(stage > 0),
    };
    let rows = if layout.sequence_parallel {
        elements / t
    } else {
        elements
    };
    4.0 * (tp + ways as f64 * rows)
}

/// The `gemm` crate's packing slab on a rank's thread (gemm-common 0.19 `L2_SLAB`: a
/// thread-local buffer of the host's L2 cache per core, allocated at the thread's first GEMM
/// and kept until the thread ends): the cluster's `[device] l2_cache_kib`, 0 where the spec
/// does not state it.
pub(crate) fn gemm_slab(cluster: &Cluster) -> f64 {
    cluster.device.l2_cache_kib.unwrap_or(0.0) * 1024.0
}

/// The pooled messages of the tied embedding's gradient sum between stage 0 and the last
/// stage (a two-rank all-reduce of the rank's fp32 table shard), on those two stages.
pub(crate) fn tied_messages(model: &Model, layout: &Layout, stage: u64) -> f64 {
    let a = &model.architecture;
    let end = stage == 0 || stage + 1 == layout.pp;
    if !(a.tied_embeddings && layout.pp > 1 && end) {
        return 0.0;
    }
    4.0 * (a.padded_vocab(layout.tp) / layout.tp) as f64 * a.hidden as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Layout;
    use crate::spec::{self, ClusterOverrides, TrainingOverrides};
    use std::path::Path;

    fn tiny() -> Model {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
        let m =
            spec::load_model(&root.join("models/tiny.toml"), TrainingOverrides::default()).unwrap();
        let c = spec::load_cluster(
            &root.join("clusters/cpu-8.toml"),
            ClusterOverrides::default(),
        )
        .unwrap();
        crate::precision::for_device(&m, &c).into_owned()
    }

    /// The tiny model (h 64, FFN 256, 4 heads of 64/4, T 64) at micro-batch 2 in f32, by hand:
    /// dln + dx2 2·128·64, the executor's dx + din 2·128·64, dh + da 128·(256 + 256), dqkv
    /// 128·192, dy 128·64 floats, and the score scratch 64·64 f32.
    #[test]
    fn workspace_of_the_tiny_model_by_hand() {
        let m = tiny();
        assert_eq!(m.training.precision, "fp32");
        let floats = 4.0 * 128.0 * 64.0 + 128.0 * 512.0 + 128.0 * 192.0 + 128.0 * 64.0;
        let want = 4.0 * floats + 4.0 * 64.0 * 64.0;
        assert_eq!(workspace_bytes(&m, true, 2, 1, false), want);
        assert_eq!(workspace_bytes(&m, false, 2, 1, false), 0.0, "GPU: none");
        // TP 2 halves the sharded buffers, not the norms' rows nor the boundary gradients; SP
        // adds three full-row buffers and splits the norms' rows and the boundary gradients.
        let tp2 = 4.0 * 128.0 * 64.0 + (128.0 * 512.0 + 128.0 * 192.0 + 128.0 * 64.0) / 2.0;
        assert_eq!(
            workspace_bytes(&m, true, 2, 2, false),
            4.0 * tp2 + 4.0 * 64.0 * 64.0
        );
        let sp = tp2 - 2.0 * 128.0 * 64.0 + 3.0 * 128.0 * 64.0;
        assert_eq!(
            workspace_bytes(&m, true, 2, 2, true),
            4.0 * sp + 4.0 * 64.0 * 64.0
        );
    }

    /// 1000 parameters in one chunk over DP 4: ZeRO keeps a 250-float gradient shard and a
    /// 250-float weight shard (8 B each in fp32 = 2000 B) and sends 3 chunks of 250 floats
    /// (3000 B); an all-reduce's messages add up to the whole 4000 B.
    #[test]
    fn zero_buffers_and_dp_messages_by_hand() {
        let fp32 = Policy::by_name("fp32").unwrap();
        assert_eq!(zero_buffers(fp32, 1000.0, 1, 4, 1), 2000.0);
        assert_eq!(zero_buffers(fp32, 1000.0, 0, 4, 1), 0.0);
        assert_eq!(
            zero_buffers(fp32, 1000.0, 1, 4, 2),
            1000.0,
            "two chunks: the larger half"
        );
        assert_eq!(dp_messages(1000.0, 4, 1, 1), 3000.0);
        assert_eq!(dp_messages(1000.0, 4, 0, 1), 4000.0);
        assert_eq!(dp_messages(1000.0, 1, 0, 1), 0.0);
        assert_eq!(
            dp_messages(1000.0, 4, 3, 1),
            4000.0,
            "ZeRO-3: one more chunk"
        );
        // The tied table between the end stages: vocab 256 × hidden 64 at TP 1, f32.
        let m = tiny();
        let layout = |pp| Layout {
            pp,
            ..Layout::without_pipeline(1, 1, 0, 1)
        };
        assert_eq!(tied_messages(&m, &layout(2), 1), 4.0 * 256.0 * 64.0);
        assert_eq!(tied_messages(&m, &layout(1), 0), 0.0);
    }

    /// A LoRA plan with frozen groups (PEFT's default for GPT-2: c_attn only): the CPU runtime
    /// keeps full training's layer list (measured: tiny, 1 rank, micro-batch 16, 27.1 MiB; the
    /// autograd list predicted 22.6, this one 27.5); a GPU plan keeps autograd's.
    #[test]
    fn cpu_adapter_layers_keep_full_trainings_activations() {
        let full = tiny();
        let mut lora = full.clone();
        lora.training.method = Method::Lora;
        lora.lora = Some(crate::finetune::Lora {
            rank: 8,
            alpha: 8.0,
            dropout: 0.0,
            targets: vec![crate::finetune::Target::Qkv],
        });
        let l = Layout::without_pipeline(1, 1, 0, 2);
        let act = |m: &Model| crate::memory::per_layer_act(m, &l);
        assert_eq!(act(&activation_model(&lora, true)), act(&full));
        assert!(
            act(&activation_model(&lora, false)) < act(&full),
            "autograd drops frozen inputs"
        );
    }

    /// The README's layout (TP 2, PP 2, no SP, micro-batch 2 of T 64, h 64): TP's pool holds
    /// 3 chunks of 8192/2 floats, and each end stage one 8192-float pipeline message (the
    /// first sends activations, the last gradients); 4 B each.
    #[test]
    fn activation_messages_of_the_readme_layout_by_hand() {
        let m = tiny();
        let layout = Layout {
            pp: 2,
            ..Layout::without_pipeline(2, 2, 1, 2)
        };
        let want = 4.0 * (3.0 * 4096.0 + 8192.0);
        assert_eq!(activation_messages(&m, &layout, 0), want);
        assert_eq!(activation_messages(&m, &layout, 1), want);
        let single = Layout::without_pipeline(1, 1, 0, 2);
        assert_eq!(activation_messages(&m, &single, 0), 0.0);
    }

    /// The runtime's per-chunk pools: 1F1B's count is the schedule's; interleaved PP 2 × 2
    /// chunks with 8 micro-batches keeps 6 chunk activations on stage 0 where at most 5 are in
    /// flight at once (measured: 1,211,356 B of forward allocations at the peak, 6 × 196,608
    /// and 32 KiB besides).
    #[test]
    fn pooled_chunks_of_an_interleaved_stage() {
        let one = Layout {
            pp: 4,
            ..Layout::without_pipeline(1, 1, 0, 1)
        };
        for s in 0..4 {
            assert_eq!(
                pooled_in_flight(&one, 8, s),
                crate::memory::in_flight(one.schedule, 4, 8, 1, s)
            );
        }
        let il = Layout {
            pp: 2,
            virtual_stages: 2,
            schedule: crate::schedule::ScheduleKind::Interleaved,
            ..Layout::without_pipeline(2, 2, 2, 1)
        };
        assert_eq!(crate::memory::in_flight(il.schedule, 2, 8, 2, 0), 5);
        assert_eq!(pooled_in_flight(&il, 8, 0), 6);
    }
}
