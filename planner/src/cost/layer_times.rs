//! The per-micro-batch times of a layout's parts: one dense layer, one MoE layer, the
//! embedding and the head, with their TP, CP and EP communication, recompute and ZeRO-3
//! traffic (what `evaluate` scales by each chunk's layers).

use super::comm::Links;
use super::interference;
use super::ops::{self, Device};
use super::pipeline::{ChunkTime, Parts};
use super::{moe, LayerTimes, Options};
use crate::layout::{Layout, Recompute};
use crate::model::Model;
use crate::precision::{dtype_bytes, Policy};
use crate::spec::Cluster;

/// The per-micro-batch times of a layout's parts.
pub fn layer_times(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    links: &Links,
    options: Options,
) -> LayerTimes {
    let dev = Device::for_job(cluster, model, layout, options.attention_kernel);
    let (tp, sp, b) = (layout.tp, layout.sequence_parallel, layout.micro_batch);
    let cp = layout.cp.max(1);
    let lc = ops::layer_cp(model, &dev, tp, sp, b, cp);
    // Under context parallelism a rank holds 1/CP of every sequence's tokens: what the
    // embedding, the head and the TP collectives move (`local`).
    let local = &*layout.rank_tokens(model);
    let a = &model.architecture;
    let act = b as f64 * local.training.seq_len as f64 * a.hidden as f64 * 2.0;
    let t = &links.tp;
    // Two collectives per layer each way: all-reduces, or all-gather + reduce-scatter with SP.
    let per_pass = if sp {
        2.0 * (t.all_gather(act) + t.reduce_scatter(act))
    } else {
        2.0 * t.all_reduce(act)
    };
    // Overlapped with their GEMMs (`training.tp_comm_overlap`, under sequence parallelism): what
    // stays exposed each way, and the split GEMMs' extra time as compute (`tp_overlap`).
    let mut dense_lc = lc;
    let dense_tp = if model.training.tp_comm_overlap && super::tp_overlap::applies(layout) {
        let linears = ops::block_linears(model, tp, sp, b, cp);
        let o =
            super::tp_overlap::layer(&dev, &linears, tp, t.all_gather(act), t.reduce_scatter(act));
        dense_lc.fwd += o.fwd_split;
        dense_lc.bwd += o.bwd_split;
        (o.fwd_exposed, o.bwd_exposed)
    } else {
        (per_pass, per_pass)
    };
    let ring = ring_exposed(model, layout, links, &lc);
    let zero3 = layout.sharding.zero_stage == 3 && layout.shard_degree(cluster) > 1;
    let (grad, weight, _) = dtype_bytes(model);
    let (dp_group, expert_group) = if layout.sharding.hybrid {
        (&links.dp_in_node, &links.expert_dp_in_node)
    } else {
        (&links.dp, &links.expert_dp)
    };
    // ZeRO-3 gathers a layer's weights before its forward (and backward) and reduce-scatters
    // its gradients after the backward: the dense weights over DP × CP, the experts over the
    // expert-data-parallel group.
    // A LoRA or QLoRA block: ZeRO-3 gathers the frozen weights (QLoRA's linears in NF4) and the
    // adapters, and reduce-scatters only the adapters' gradients.
    let adapters = model.adapters().map(|l| {
        let nf4 = if model.training.method == crate::finetune::Method::Qlora {
            crate::finetune::linear_weights(a).per_tp_rank(tp)
        } else {
            0.0
        };
        (l.layer_params(a).per_tp_rank(tp), nf4)
    });
    // torchao's float8 all-gather (tensorwise): FSDP gathers the FP8 linears' weights (`fp8`
    // of them) in FP8, 1 B per parameter instead of the policy's weight bytes.
    let float8_gather = model
        .training
        .fp8
        .float8_all_gather(crate::framework::fp8_engine(model))
        && dev.fp8.is_some();
    let gathers = |dense: f64, experts: f64, fp8: f64| {
        let fp8_gather_saving = if float8_gather {
            fp8 * (weight - 1.0)
        } else {
            0.0
        };
        if let Some((trainable, nf4)) = adapters {
            let bytes =
                (dense - nf4 + trainable) * weight + nf4 * crate::finetune::NF4_BYTES_PER_PARAM;
            return (
                dp_group.all_gather(bytes),
                dp_group.reduce_scatter(trainable * grad),
            );
        }
        let (xg, xs) = if experts > 0.0 {
            (
                expert_group.all_gather(experts * weight),
                expert_group.reduce_scatter(experts * grad),
            )
        } else {
            (0.0, 0.0)
        };
        (
            dp_group.all_gather(dense * weight - fp8_gather_saving) + xg,
            dp_group.reduce_scatter(dense * grad) + xs,
        )
    };
    let dense_params = a.layer_params().per_tp_rank(tp);
    // Offload's copies move the rank's ZeRO shard of each layer (`offload`).
    let policy = Policy::by_name(&model.training.precision)
        .expect("the precision policy is validated when the spec is resolved");
    let zero_shard = |n: u64| {
        if layout.sharding.zero_stage >= 1 {
            n.max(1) as f64
        } else {
            1.0
        }
    };
    let shard = zero_shard(layout.shard_degree(cluster));
    // Activation offload moves each layer's saved activations down and back up.
    let act_bytes = if layout.offload.activations {
        crate::memory::per_layer_act(model, layout)
    } else {
        0.0
    };
    let expert_shard = zero_shard(crate::memory::moe::expert_shard_degree(layout, cluster));
    let sm_share = if options.overlap_slows_compute {
        interference::sm_share(cluster)
    } else {
        0.0
    };
    // `params`: the layer's dense and expert parameters on the rank, and those of its FP8 linears.
    let chunk = |lc: &ops::LayerCompute,
                 (tp_fwd, tp_bwd): (f64, f64),
                 ep_pass: f64,
                 params: (f64, f64, f64)| {
        let mut layer = ChunkTime {
            fwd: Parts {
                compute: lc.fwd,
                tp: tp_fwd,
                cp: ring.0,
                ep: ep_pass,
                ..Parts::default()
            },
            bwd: Parts {
                compute: lc.bwd,
                tp: tp_bwd,
                cp: ring.1,
                ep: ep_pass,
                ..Parts::default()
            },
            // The weight-gradient GEMMs: one per linear layer, with its forward GEMM's FLOPs
            // and shapes transposed (dW = Xᵀ·dY for Y = X·W), so they cost the linears'
            // forward. A frozen base (LoRA, QLoRA) has none; its adapters' are negligible
            // and stay in B.
            wgrad: if model.training.method.adapters() {
                0.0
            } else {
                lc.linear_fwd
            },
        };
        match layout.recompute {
            Recompute::None => {}
            // Under flash attention, torchtitan's selective is per-op checkpointing (op SAC):
            // every second matmul and every element-wise kernel run again
            // (`memory::activations::Keep`); other frameworks' re-run the attention core.
            Recompute::Selective
                if crate::memory::activations::Keep::for_model(Recompute::Selective, model)
                    == crate::memory::activations::Keep::OpSac =>
            {
                layer.bwd.recompute = 0.5 * lc.linear_fwd + lc.elementwise_fwd
            }
            Recompute::Selective => layer.bwd.recompute = lc.attention_core_fwd,
            Recompute::Full => {
                // Every N-th layer: the average layer re-runs 1/N of a forward.
                let share = 1.0 / layout.recompute_every.max(1) as f64;
                layer.bwd.recompute = lc.fwd * share;
                layer.bwd.tp += tp_fwd * share;
                layer.bwd.cp += ring.0 * share;
                layer.bwd.ep += ep_pass * share;
            }
        }
        let recomputed = match layout.recompute {
            Recompute::Full => 1.0 / layout.recompute_every.max(1) as f64,
            _ => 0.0,
        };
        options.host.apply(cluster, &mut layer, recomputed);
        let mut first_gather = 0.0;
        if zero3 {
            let (gather, scatter) = gathers(params.0, params.1, params.2);
            // The next layer's gather runs beside this layer's forward, the gather and the
            // gradient scatter beside its backward: they slow its compute (`interference`).
            layer.fwd.interference = interference::slowdown(layer.fwd.compute, gather, sm_share);
            layer.bwd.interference = interference::slowdown(
                layer.bwd.compute + layer.bwd.recompute,
                gather + scatter,
                sm_share,
            );
            layer.fwd.zero3 = (gather - layer.fwd.total()).max(0.0);
            layer.bwd.zero3 = (gather + scatter - layer.bwd.total()).max(0.0);
            first_gather = gather;
        }
        if layout.offload.any() {
            let shard_params = params.0 / shard + params.1 / expert_shard;
            let c = super::offload::layer_copies(policy, cluster, layout, shard_params, act_bytes);
            layer.fwd.offload =
                super::offload::exposed(c.fwd, layer.fwd.total(), options.offload_overlap);
            layer.bwd.offload =
                super::offload::exposed(c.bwd, layer.bwd.total(), options.offload_overlap);
        }
        (layer, first_gather)
    };
    let fp8_linears = crate::fp8::linear_params(model, tp, false);
    let (layer, mut zero3_first_gather) =
        chunk(&dense_lc, dense_tp, 0.0, (dense_params, 0.0, fp8_linears));
    let pair = |bytes: f64| {
        if sp {
            t.all_gather(bytes) + t.reduce_scatter(bytes)
        } else {
            t.all_reduce(bytes)
        }
    };
    let moe_layer = a.moe.is_some().then(|| {
        let mc = moe::moe_layer_compute(model, &dev, layout, &lc);
        let tp_pass = moe::tp_per_pass(model, layout, &pair, act);
        let ep_pass = moe::all_to_all_per_pass(model, layout, links);
        let (common, experts) = crate::memory::moe::moe_layer_params_per_rank(model, layout);
        let fp8 = crate::fp8::linear_params(model, tp, true);
        let (c, gather) = chunk(&mc, (tp_pass, tp_pass), ep_pass, (common, experts, fp8));
        zero3_first_gather = zero3_first_gather.max(gather);
        c
    });
    let moe_share = a.moe_layer_count() as f64 / a.layers.max(1) as f64;
    let (ef, eb) = ops::embedding(local, &dev, tp, sp, b);
    let (hf, hb) = ops::head(local, &dev, tp, sp, b, options.loss, options.pad_vocab);
    let (emb_tp_f, emb_tp_b, head_tp_f, head_tp_b) = if sp {
        (
            t.reduce_scatter(act),
            t.all_gather(act),
            t.all_gather(act),
            t.reduce_scatter(act),
        )
    } else {
        (t.all_reduce(act), 0.0, 0.0, 0.0)
    };
    // Vocabulary-parallel cross-entropy all-reduces the max, the sum and the target logit.
    let ce = 3.0 * t.all_reduce(4.0 * (b as f64 * local.training.seq_len as f64));
    let part = |compute, tp| Parts {
        compute,
        tp,
        ..Parts::default()
    };
    LayerTimes {
        layer,
        moe_layer,
        moe_share,
        // The embedding's and the head's weight gradients stay in B (a lookup's scatter-add;
        // the head's one GEMM beside the loss): W is the transformer layers' linears.
        embedding: ChunkTime {
            fwd: part(ef, emb_tp_f),
            bwd: part(eb, emb_tp_b),
            wgrad: 0.0,
        },
        head: ChunkTime {
            fwd: part(hf, head_tp_f + ce),
            bwd: part(hb, head_tp_b),
            wgrad: 0.0,
        },
        zero3_first_gather,
    }
}

/// Seconds of one layer's ring-attention exchange (forward, backward) that its attention does
/// not hide, for one micro-batch. Megatron-Core's CP (Transformer Engine's
/// `AttnFuncWithCPAndKVP2P`) passes each rank's K and V around the CP ring in CP − 1 steps,
/// each overlapped with the attention of the block in hand; the backward passes K, V and their
/// gradients. A step's exposed time is what its transfer takes beyond its share of the
/// attention core (1/CP of the rank's).
fn ring_exposed(
    model: &Model,
    layout: &Layout,
    links: &Links,
    lc: &ops::LayerCompute,
) -> (f64, f64) {
    let cp = layout.cp;
    if cp <= 1 {
        return (0.0, 0.0);
    }
    // K and V of this rank's tokens and its KV heads.
    let kv = layout.cp_kv_block_bytes(model, crate::memory::stored::element_bytes(model));
    if layout.cp_comm == crate::layout::CpComm::AllGather {
        // Llama 3's: K and V of the whole sequence all-gathered before the attention, on the
        // critical path (Dubey et al. 2024 §3.3.2: "the all-gather communication latency is
        // exposed"); the backward gathers them again and reduce-scatters their gradients.
        let full = kv * cp as f64;
        let g = links.cp.all_gather(full);
        return (g, g + links.cp.reduce_scatter(full));
    }
    let steps = (cp - 1) as f64;
    let fwd_step = links.cp.p2p(kv);
    let bwd_step = links.cp.p2p(2.0 * kv);
    let core_f = lc.attention_core_fwd / cp as f64;
    let core_b = 2.5 * core_f;
    (
        steps * (fwd_step - core_f).max(0.0),
        steps * (bwd_step - core_b).max(0.0),
    )
}
