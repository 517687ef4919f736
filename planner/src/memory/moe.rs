//! Mixture-of-experts memory: which layers of a stage are MoE layers, the expert weights a rank
//! holds under expert parallelism, the ZeRO shard of the expert states (over the
//! expert-data-parallel group), and the activations an MoE layer keeps.
//!
//! Megatron-Core's layout (`--expert-model-parallel-size`, expert TP equal to TP): each MoE
//! layer's E routed experts are split over EP ranks cut from the DP × CP ranks, so a rank holds
//! E/EP whole experts, each TP-sharded like a dense MLP; the ranks that hold the same experts,
//! DP × CP / EP of them, sum their gradients and shard their optimizer states
//! (`expert_data_parallel_group`). Everything else of an MoE layer (attention, norms, router,
//! shared experts) is a dense weight, replicated over DP × CP as before.

use super::activations::{kept_bytes, layer_tensors, Keep};
use super::stored::{element_bytes, Split, Stored};
use crate::layout::Layout;
use crate::model::{Activation, Model};
use crate::spec::Cluster;

/// Dense and MoE layers among the layers `start .. start + n` (0-based).
pub fn layer_mix(model: &Model, start: u64, n: u64) -> (u64, u64) {
    let Some(m) = &model.architecture.moe else {
        return (n, 0);
    };
    let moe = m
        .moe_layer_count(start.saturating_add(n))
        .saturating_sub(m.moe_layer_count(start));
    (n - moe.min(n), moe.min(n))
}

/// Dense and MoE layers on pipeline `stage` (all its chunks) for a split given as layers per
/// virtual stage in pipeline order (chunk `c` of stage `s` is `c·PP + s`, and the chunks hold
/// consecutive layers in that order).
pub fn stage_mix(model: &Model, layout: &Layout, split: &[u64], stage: u64) -> (u64, u64) {
    stage_mixes(model, layout, split)
        .get(stage as usize)
        .copied()
        .unwrap_or((0, 0))
}

/// [`stage_mix`] of every stage, in one pass over the split.
pub fn stage_mixes(model: &Model, layout: &Layout, split: &[u64]) -> Vec<(u64, u64)> {
    let (pp, v) = (layout.pp.max(1) as usize, layout.virtual_stages as usize);
    let starts = crate::partition::chunk_starts(split);
    let mut mixes = vec![(0, 0); pp];
    for (s, mix) in mixes.iter_mut().enumerate() {
        for c in 0..v {
            let g = layout.piece(s, c);
            if let (Some(&start), Some(&n)) = (starts.get(g), split.get(g)) {
                let (d, m) = layer_mix(model, start, n);
                mix.0 += d;
                mix.1 += m;
            }
        }
    }
    mixes
}

/// Parameters of one MoE layer on one rank, after TP and EP: `(dense part, experts)`. The
/// dense part is attention, norms, router and shared experts; the experts are E/EP routed
/// experts, each TP-sharded. `(0, 0)` for a dense model.
pub fn moe_layer_params_per_rank(model: &Model, layout: &Layout) -> (f64, f64) {
    let Some(p) = model.architecture.moe_layer_params() else {
        return (0.0, 0.0);
    };
    let local = (p.experts / layout.ep.max(1)) as f64;
    (
        p.common.per_tp_rank(layout.tp),
        local * p.expert.per_tp_rank(layout.tp),
    )
}

/// The ranks a ZeRO shard of the expert states is spread over: the expert-data-parallel group
/// (DP × CP / EP), or its members in one node under hybrid sharding. The expert-DP group of
/// rank 0 is the ranks `k·TP·EP` (k < DP·CP/EP), so ⌈gpus_per_node / (TP·EP)⌉ of them share a
/// node.
pub fn expert_shard_degree(layout: &Layout, cluster: &Cluster) -> u64 {
    if layout.sharding.zero_stage == 0 {
        return 1;
    }
    let group = (layout.dp.saturating_mul(layout.cp.max(1)) / layout.ep.max(1)).max(1);
    if !layout.sharding.hybrid {
        return group;
    }
    let stride = layout.tp.max(1).saturating_mul(layout.ep.max(1));
    group.min(cluster.gpus_per_node.max(1).div_ceil(stride))
}

/// Routed token copies a rank's experts process per token the rank holds, at most: each token
/// goes to `experts_per_token` experts; an expert takes at most `capacity_factor` times its
/// even share (Megatron's and GShard's token dropping), so the busiest rank sees that many.
/// Dropless routing (no capacity factor) is counted at the even share: the load-balancing
/// loss keeps the experts near it, and the imbalance it leaves is not modelled.
pub fn routed_copies(model: &Model) -> f64 {
    model.architecture.moe.as_ref().map_or(0.0, |m| {
        m.experts_per_token as f64 * m.capacity_factor.unwrap_or(1.0).max(1.0)
    })
}

/// The dense MLP's own tensors in [`layer_tensors`]: an MoE layer replaces them by its
/// experts'. The MLP's input, its norm's input and its dropout mask stay (the router and the
/// shared experts read the same input).
const DENSE_MLP_ONLY: [&str; 6] = [
    "gelu_input",
    "gate_output",
    "up_output",
    "silu_output",
    "mlp_down_input",
    "mlp_down_output",
];

/// The tensors one MoE layer stores for one micro-batch of `b` sequences, before TP: the
/// attention block and MLP input as in a dense layer, then the router's fp32 logits and
/// probabilities (`s·b·E` each), the routed token copies as the experts receive them (the
/// all-to-all's output, `s·b·k'·h`, with `k'` = [`routed_copies`]), the experts' hidden
/// activations (as a dense MLP's, for `s·b·k'` tokens of width `moe_ffn_hidden`), their
/// outputs before the weighted combine (`s·b·k'·h`, needed for the routing weights'
/// gradient), and the shared experts' hidden activations.
pub fn moe_layer_tensors(model: &Model, b: u64) -> Vec<Stored> {
    let a = &model.architecture;
    let Some(m) = &a.moe else {
        return layer_tensors(model, b);
    };
    let mut v: Vec<Stored> = layer_tensors(model, b)
        .into_iter()
        .filter(|x| !DENSE_MLP_ONLY.contains(&x.name))
        .collect();
    let w = element_bytes(model);
    let sb = model.training.seq_len as f64 * b as f64;
    let h = a.hidden as f64;
    let copies = sb * routed_copies(model);
    let stored = |name, bytes, split, mm_output, op_sac_only| Stored {
        name,
        bytes,
        split,
        attention_core: false,
        layer_input: false,
        mm_output,
        sdpa_output: false,
        op_sac_only,
    };
    use Split::*;
    // The router is replicated over TP: every TP rank scores the tokens it holds.
    v.push(stored(
        "router_logits_fp32",
        4.0 * sb * m.experts as f64,
        Replicated,
        true,
        false,
    ));
    v.push(stored(
        "router_probs_fp32",
        4.0 * sb * m.experts as f64,
        Replicated,
        false,
        false,
    ));
    v.push(stored(
        "expert_input",
        w * copies * h,
        Replicated,
        false,
        false,
    ));
    // Eager PyTorch's experts (torchtitan's GroupedExperts, `silu(w1 x) * (w3 x)`) keep
    // `silu(gate)` too, as a dense eager MLP does (`activations::fuses_elementwise`).
    let eager = !super::activations::fuses_elementwise(model);
    let mut mlp = |prefix: [&'static str; 4], tokens: f64, f: f64| {
        let hidden = match a.activation {
            Activation::Gelu => vec![(prefix[0], true), (prefix[2], false)],
            Activation::Swiglu if eager => vec![
                (prefix[0], true),
                (prefix[1], true),
                (prefix[3], false),
                (prefix[2], false),
            ],
            Activation::Swiglu => vec![(prefix[0], true), (prefix[1], true), (prefix[2], false)],
        };
        for (name, mm) in hidden {
            v.push(stored(name, w * tokens * f, Sharded, mm, false));
        }
    };
    mlp(
        [
            "expert_gate_output",
            "expert_up_output",
            "expert_down_input",
            "expert_silu_output",
        ],
        copies,
        m.moe_ffn_hidden as f64,
    );
    if m.shared_experts > 0 {
        mlp(
            [
                "shared_gate_output",
                "shared_up_output",
                "shared_down_input",
                "shared_silu_output",
            ],
            sb,
            (m.shared_experts * m.shared_expert_ffn_hidden) as f64,
        );
    }
    v.push(stored(
        "expert_output",
        w * copies * h,
        Replicated,
        true,
        false,
    ));
    v.push(stored(
        "moe_combine_output",
        w * sb * h,
        Replicated,
        true,
        true,
    ));
    v
}

/// Activation bytes of one MoE layer for one micro-batch on one rank, under the layout's TP,
/// SP, recompute and CP, as [`super::per_layer_act`] counts a dense layer.
pub fn moe_layer_act(model: &Model, layout: &Layout) -> f64 {
    if model.architecture.moe.is_none() {
        return super::per_layer_act(model, layout);
    }
    let tensors = moe_layer_tensors(model, layout.micro_batch);
    super::layer_act_with(layout, &|r| {
        let keep = Keep::for_model(r, model);
        tensors
            .iter()
            .map(|x| kept_bytes(x, layout.tp, layout.sequence_parallel, keep))
            .sum::<f64>()
    })
}

/// Bytes of the all-to-all's buffers on a rank: the permuted token copies it sends and the
/// ones it receives, for one MoE layer at a time (`2 · s·b·k'·h / CP` elements; under SP a
/// TP rank dispatches its 1/TP of the tokens). 0 without MoE or without EP.
pub fn dispatch_buffer_bytes(model: &Model, layout: &Layout) -> f64 {
    if model.architecture.moe.is_none() || layout.ep <= 1 {
        return 0.0;
    }
    2.0 * routed_elements(model, layout) * element_bytes(model)
}

/// Elements one all-to-all moves per rank: the `k'` copies ([`routed_copies`]) of each token
/// the rank routes (its 1/CP of the micro-batch, 1/TP of that under SP), `hidden` wide.
pub fn routed_elements(model: &Model, layout: &Layout) -> f64 {
    let tokens = layout.micro_batch as f64 * (model.training.seq_len / layout.cp.max(1)) as f64;
    let tokens = if layout.sequence_parallel {
        tokens / layout.tp.max(1) as f64
    } else {
        tokens
    };
    tokens * routed_copies(model) * model.architecture.hidden as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Moe, RouterScoring};

    fn mixtral_like(layers: u64) -> Model {
        let src = crate::source::Source::from_text(
            "specs/models/mixtral-8x7b.toml",
            include_str!("../../../specs/models/mixtral-8x7b.toml"),
        );
        let mut m = crate::spec::parse_model_toml(&src, Default::default()).unwrap();
        m.architecture.layers = layers;
        m
    }

    fn pattern(m: &mut Model, first_dense: u64, every: u64) {
        let moe: &mut Moe = m.architecture.moe.as_mut().unwrap();
        moe.first_dense_layers = first_dense;
        moe.moe_layer_frequency = every;
        assert_eq!(moe.router_scoring, RouterScoring::Softmax);
    }

    #[test]
    fn stage_mix_counts_the_moe_layers_each_stage_holds() {
        let mut m = mixtral_like(10);
        // Layers 0-2 dense, then 3, 5, 7, 9 MoE.
        pattern(&mut m, 3, 2);
        let mut l = Layout::without_pipeline(1, 1, 0, 1);
        l.pp = 2;
        // Stage 0 holds layers 0-3 (one MoE layer: 3), stage 1 layers 4-9 (5, 7, 9).
        assert_eq!(stage_mix(&m, &l, &[4, 6], 0), (3, 1));
        assert_eq!(stage_mix(&m, &l, &[4, 6], 1), (3, 3));
        // Interleaved, 2 chunks per stage: chunks 0,1,2,3 hold layers 0-1, 2-4, 5-6, 7-9;
        // stage 0 has chunks 0 and 2 (layers 0, 1, 5, 6: MoE 5), stage 1 chunks 1 and 3
        // (2, 3, 4, 7, 8, 9: MoE 3, 7, 9).
        l.virtual_stages = 2;
        assert_eq!(stage_mix(&m, &l, &[2, 3, 2, 3], 0), (3, 1));
        assert_eq!(stage_mix(&m, &l, &[2, 3, 2, 3], 1), (3, 3));
        // A dense model: every layer dense.
        m.architecture.moe = None;
        assert_eq!(stage_mix(&m, &l, &[2, 3, 2, 3], 1), (6, 0));
    }

    /// Mixtral-8x7B's MoE layer, written out: attention 4096·(4096 + 2·1024) + 4096·4096
    /// = 41,943,040; two RMSNorms 8192; router 8·4096 = 32,768; one expert 3·4096·14336 =
    /// 176,160,768. Under TP 2 and EP 4 a rank holds half of the sharded attention and of its
    /// 2 experts, all of the norms and router.
    #[test]
    fn a_rank_holds_its_share_of_the_experts() {
        let m = mixtral_like(32);
        let mut l = Layout::without_pipeline(8, 2, 1, 1);
        l.ep = 4;
        let (common, experts) = moe_layer_params_per_rank(&m, &l);
        assert_eq!(common, 41_943_040.0 / 2.0 + 8192.0 + 32_768.0);
        assert_eq!(experts, 2.0 * 176_160_768.0 / 2.0);
    }

    #[test]
    fn expert_states_shard_over_dp_cp_over_ep() {
        let src = crate::source::Source::from_text(
            "specs/clusters/dgx-h100-80g.toml",
            include_str!("../../../specs/clusters/dgx-h100-80g.toml"),
        );
        let cluster = crate::spec::parse_cluster_toml(&src, Default::default()).unwrap();
        assert_eq!(cluster.gpus_per_node, 8);
        let mut l = Layout::without_pipeline(16, 2, 1, 1);
        l.cp = 2;
        l.ep = 8;
        // DP 16 × CP 2 = 32 ranks hold the same dense weights; EP 8 leaves 4 per expert shard.
        assert_eq!(expert_shard_degree(&l, &cluster), 4);
        // Hybrid: the expert-DP group of rank 0 is ranks 0, 32, 64, 96 (stride TP·EP = 16):
        // one of them per 8-rank node.
        l.sharding.hybrid = true;
        assert_eq!(expert_shard_degree(&l, &cluster), 1);
        l.sharding.zero_stage = 0;
        assert_eq!(expert_shard_degree(&l, &cluster), 1);
    }

    /// An MoE layer's MLP tensors, written out for a GeLU model with top-2 of 4 experts and a
    /// capacity factor of 1.5 (3 copies per token), at TP 1 without recompute: the dense
    /// layer's tensors minus its MLP's (gelu_input and mlp_down_input, 2 × w·sb·f), plus the
    /// router's two fp32 tensors (2 × 4·sb·E), the expert input and output (2 × w·3sb·h) and
    /// two hidden tensors (2 × w·3sb·f_moe).
    #[test]
    fn moe_layer_bytes_replace_the_mlp() {
        let mut m = mixtral_like(2);
        let a = &mut m.architecture;
        a.activation = Activation::Gelu;
        a.hidden = 64;
        a.heads = 4;
        a.kv_heads = 4;
        a.head_dim = 16;
        a.ffn_hidden = 256;
        let moe = a.moe.as_mut().unwrap();
        moe.experts = 4;
        moe.experts_per_token = 2;
        moe.moe_ffn_hidden = 96;
        moe.capacity_factor = Some(1.5);
        m.training.seq_len = 32;
        m.training.dropout = 0.0;
        let l = Layout::without_pipeline(1, 1, 0, 2);
        let mut dense = m.clone();
        dense.architecture.moe = None;
        let sb = 64.0;
        let w = element_bytes(&m);
        let want = super::super::per_layer_act(&dense, &l) - 2.0 * w * sb * 256.0
            + 2.0 * 4.0 * sb * 4.0
            + 2.0 * w * 3.0 * sb * 64.0
            + 2.0 * w * 3.0 * sb * 96.0;
        let got = moe_layer_act(&m, &l);
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }
}
