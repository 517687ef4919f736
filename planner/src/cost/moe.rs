//! Mixture-of-experts compute and communication of one MoE layer for one micro-batch on one
//! rank: the router, the routed experts this rank holds, the shared experts, the token
//! permutation, the expert-parallel all-to-all and the TP collectives around the experts.
//!
//! Megatron-Core's MoE layer with the all-to-all token dispatcher (expert TP equal to TP,
//! sequence parallelism under TP): each TP rank routes its 1/TP of the tokens, permutes the
//! `k` copies of each by destination expert, sends them to the EP rank holding that expert
//! (all-to-all), the TP group all-gathers them so that every TP rank runs its slice of the
//! experts, reduce-scatters the experts' outputs, sends them back (all-to-all) and sums each
//! token's `k` outputs weighted by the router. The backward runs the same steps reversed.
//! The all-to-alls are not overlapped with compute (Megatron-Core's default; DeepSeek-V3's
//! DualPipe overlap is not modelled).

use super::comm::Links;
use super::ops::{Device, LayerCompute};
use crate::layout::Layout;
use crate::memory::moe::routed_copies;
use crate::model::{Activation, Model};

/// Forward and backward seconds of an MLP (the two or three linears and the activation) on
/// `tokens` tokens, `width` channels wide on this rank, in 16 bits (frozen under adapters),
/// without the activation's launch (the layer's launch count has it), split into `(fwd, bwd,
/// linear forward, element-wise forward)`: the routed and shared experts, which stay 16-bit
/// under an FP8 recipe (docs/fp8.md).
pub(crate) fn mlp_time(model: &Model, dev: &Device, tokens: f64, width: f64) -> [f64; 4] {
    mlp_time_with(model, tokens, width, dev, &|k, n| {
        dev.linear_of(model.training.method.adapters(), tokens, k, n)
    })
}

/// [`mlp_time`] of the dense MLP exactly as [`super::ops::layer_cp`] costs it, its linears
/// through [`Device::block_linear`] (FP8 GEMMs and casts under an FP8 recipe): what an MoE
/// layer takes out of the dense layer's time before adding its experts.
pub(crate) fn dense_mlp_time(model: &Model, dev: &Device, tokens: f64, width: f64) -> [f64; 4] {
    mlp_time_with(model, tokens, width, dev, &|k, n| {
        dev.block_linear(&super::device::LinearShape {
            name: "mlp",
            m: tokens,
            k,
            n,
            count: 1.0,
            frozen: model.training.method.adapters(),
        })
    })
}

/// The MLP's time with each linear `(k, n)` costed by `linear` (forward, backward).
fn mlp_time_with(
    model: &Model,
    tokens: f64,
    width: f64,
    dev: &Device,
    linear: &dyn Fn(f64, f64) -> (f64, f64),
) -> [f64; 4] {
    let a = &model.architecture;
    let h = a.hidden as f64;
    let (inputs, act_f, act_b) = match a.activation {
        Activation::Gelu => (1.0, 4.0, 6.0),
        Activation::Swiglu => (2.0, 6.0, 10.0),
    };
    // A frozen base's (LoRA) MLPs and experts compute no weight gradient (`linear` knows).
    let (up_f, up_b) = linear(h, width);
    let (down_f, down_b) = linear(width, h);
    let elems = tokens * width;
    let (ew_f, ew_b) = (
        dev.elementwise(elems * act_f, elems),
        dev.elementwise(elems * act_b, elems),
    );
    let linear_f = inputs * up_f + down_f;
    [
        linear_f + ew_f,
        inputs * up_b + down_b + ew_b,
        linear_f,
        ew_f,
    ]
}

/// The compute of one MoE layer on one rank: the dense layer's (`dense`, from
/// [`super::ops::layer_cp`]) with its MLP replaced by the router, the rank's E/EP experts on
/// the routed copies they receive, the shared experts and the permutation kernels.
///
/// - Router: a `hidden × E` linear on the tokens the rank routes (1/TP of them under SP),
///   then softmax and top-k over fp32 scores (read 4 + write 4 + read 4 B per score forward,
///   12 backward; two kernels each way).
/// - Experts: the rank's experts receive `t·k'` token copies (`t` the rank's tokens, `k'` the
///   top-k times the capacity factor, [`routed_copies`]: the busiest expert's share sets the
///   pace of an all-to-all-synchronised group), `t·k'·EP/E` per expert, through E/EP MLPs of
///   `moe_ffn_hidden / TP` channels, one GEMM per expert (a grouped GEMM's launches).
/// - Shared experts: one MLP of `shared_experts × shared_expert_ffn_hidden / TP` channels on
///   every token (Megatron-Core's `SharedExpertMLP` fuses them).
/// - Permute and unpermute: the copies gathered into expert order (read and write 2 B per
///   element) and scattered back with the routing weights (read `k'` copies, write one):
///   `2·k' + 1 + k'` element passes of `h` each way, two kernels each way.
pub fn moe_layer_compute(
    model: &Model,
    dev: &Device,
    layout: &Layout,
    dense: &LayerCompute,
) -> LayerCompute {
    let a = &model.architecture;
    let Some(m) = &a.moe else {
        return *dense;
    };
    let tp = layout.tp.max(1) as f64;
    let t = layout.micro_batch as f64 * (model.training.seq_len / layout.cp.max(1)) as f64;
    let t_rep = if layout.sequence_parallel { t / tp } else { t };
    let h = a.hidden as f64;
    let e = m.experts as f64;
    let k = routed_copies(model);
    let local = (m.experts / layout.ep.max(1)).max(1) as f64;
    let [dense_f, dense_b, dense_lin, dense_ew] =
        dense_mlp_time(model, dev, t, a.ffn_hidden as f64 / tp);
    // The rank's experts, one GEMM set each.
    let per_expert = t * k / local;
    let [ex_f, ex_b, ex_lin, ex_ew] =
        mlp_time(model, dev, per_expert, m.moe_ffn_hidden as f64 / tp);
    let mut fwd = local * ex_f;
    let mut bwd = local * ex_b;
    let mut linear_fwd = local * ex_lin;
    let mut elementwise_fwd = local * ex_ew;
    if m.shared_experts > 0 {
        let width = (m.shared_experts * m.shared_expert_ffn_hidden) as f64 / tp;
        let [f, b, lin, ew] = mlp_time(model, dev, t, width);
        fwd += f;
        bwd += b;
        linear_fwd += lin;
        elementwise_fwd += ew;
    }
    let (router_f, router_b) = dev.linear_of(model.training.method.adapters(), t_rep, h, e);
    let scores = t_rep * e;
    let topk_f = dev.elementwise(12.0 * scores, scores) + dev.launches(2.0);
    let topk_b = dev.memory(12.0 * scores) + dev.launches(2.0);
    let w = 2.0;
    let permute = dev.memory(w * t_rep * h * (3.0 * k + 1.0)) + dev.launches(2.0);
    fwd += router_f + topk_f + permute;
    bwd += router_b + topk_b + permute;
    linear_fwd += router_f;
    elementwise_fwd += topk_f + permute;
    LayerCompute {
        fwd: dense.fwd - dense_f + fwd,
        bwd: dense.bwd - dense_b + bwd,
        attention_core_fwd: dense.attention_core_fwd,
        linear_fwd: dense.linear_fwd - dense_lin + linear_fwd,
        elementwise_fwd: dense.elementwise_fwd - dense_ew + elementwise_fwd,
    }
}

/// Bytes of one all-to-all per rank: the `k'` copies of each token the rank routes, `h` wide,
/// 16-bit.
pub fn dispatch_bytes(model: &Model, layout: &Layout) -> f64 {
    2.0 * crate::memory::moe::routed_elements(model, layout)
}

/// Seconds of one MoE layer's all-to-alls in one pass (forward: dispatch and combine;
/// backward: the same two, reversed), for one micro-batch. 0 without EP.
pub fn all_to_all_per_pass(model: &Model, layout: &Layout, links: &Links) -> f64 {
    if layout.ep <= 1 || model.architecture.moe.is_none() {
        return 0.0;
    }
    2.0 * links.ep.time(dispatch_bytes(model, layout))
}

/// Seconds of one MoE layer's TP collectives in one pass, where a dense layer's would take
/// `attention + mlp` (each one collective pair on the layer's activations): under sequence
/// parallelism the experts' all-gather and reduce-scatter move the `k'` routed copies instead
/// of the tokens, and the shared experts add a pair of their own; without it (TP without
/// EP), the layer's output is all-reduced once, as a dense MLP's.
pub fn tp_per_pass(model: &Model, layout: &Layout, pair: &dyn Fn(f64) -> f64, act: f64) -> f64 {
    let Some(m) = &model.architecture.moe else {
        return 2.0 * pair(act);
    };
    if !layout.sequence_parallel {
        return 2.0 * pair(act);
    }
    let shared = if m.shared_experts > 0 { pair(act) } else { 0.0 };
    pair(act) + pair(act * routed_copies(model)) + shared
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::ops::layer_cp;

    /// Two dense layers that differ only in their FFN width (`f` and `2f` per TP-2 rank) differ
    /// by exactly the difference of `mlp`'s times for the two widths; the narrower layer, `f`
    /// and the tokens for further checks.
    fn widening_matches(
        m: &Model,
        dev: &Device,
        mlp: &dyn Fn(&Model, &Device, f64, f64) -> [f64; 4],
    ) -> (LayerCompute, f64, f64) {
        let t = (m.training.seq_len) as f64;
        let a = layer_cp(m, dev, 2, false, 1, 1);
        let mut wide = m.clone();
        wide.architecture.ffn_hidden *= 2;
        let b = layer_cp(&wide, dev, 2, false, 1, 1);
        let f = m.architecture.ffn_hidden as f64 / 2.0;
        let (x, y) = (mlp(m, dev, t, f), mlp(m, dev, t, 2.0 * f));
        let close = |u: f64, v: f64| (u - v).abs() <= 1e-12 + 1e-9 * v.abs();
        assert!(
            close(b.fwd - a.fwd, y[0] - x[0]),
            "{} vs {}",
            b.fwd - a.fwd,
            y[0] - x[0]
        );
        assert!(close(b.bwd - a.bwd, y[1] - x[1]));
        assert!(close(b.linear_fwd - a.linear_fwd, y[2] - x[2]));
        assert!(close(b.elementwise_fwd - a.elementwise_fwd, y[3] - x[3]));
        (a, f, t)
    }

    fn job() -> (Model, crate::spec::Cluster) {
        let (mut m, c) = crate::cost::tests::job_on("mixtral-8x7b.toml", "dgx-h100-80g.toml", 8);
        m.training.seq_len = 4096;
        (m, c)
    }

    /// [`mlp_time`] is the dense MLP as `layer_cp` costs it: two dense layers that differ only
    /// in their FFN width differ by exactly the difference of their `mlp_time`s.
    #[test]
    fn mlp_time_is_the_dense_layers_mlp() {
        let (mut m, c) = job();
        m.architecture.moe = None;
        let dev = Device::of(&c);
        widening_matches(&m, &dev, &mlp_time);
    }

    /// Under an FP8 recipe `layer_cp` costs the dense MLP's linears as FP8 GEMMs with their
    /// casts, so an MoE layer must take out exactly that ([`dense_mlp_time`]), not the 16-bit
    /// MLP ([`mlp_time`]), before adding its experts: two FP8 dense layers that differ only in
    /// their FFN width differ by the difference of their `dense_mlp_time`s, and not of their
    /// `mlp_time`s (the 16-bit GEMMs are longer: subtracting them under-charged every FP8 MoE
    /// layer by the difference).
    #[test]
    fn the_dense_mlp_taken_out_is_the_one_layer_cp_put_in_under_fp8() {
        let (mut m, c) = job();
        m.architecture.moe = None;
        m.training.fp8 = crate::fp8::Recipe::Tensorwise;
        let layout = crate::layout::Layout::without_pipeline(8, 1, 1, 1);
        let dev = Device::for_job(&c, &m, &layout, crate::framework::AttentionKernel::Cudnn);
        assert!(dev.fp8.is_some());
        let (a, f, t) = widening_matches(&m, &dev, &dense_mlp_time);
        let x = dense_mlp_time(&m, &dev, t, f);
        let (p, q) = (mlp_time(&m, &dev, t, f), mlp_time(&m, &dev, t, 2.0 * f));
        let y = dense_mlp_time(&m, &dev, t, 2.0 * f);
        assert!(
            (q[0] - p[0]) > 1.2 * (y[0] - x[0]),
            "16-bit MLP {} against FP8 {}",
            q[0] - p[0],
            y[0] - x[0]
        );
        // One expert of the dense width, top-1: the MoE layer is the dense FP8 layer with its
        // MLP swapped for the same MLP in 16 bits (experts stay 16-bit), plus the router and
        // the permutation, so it is longer than the dense layer by at least the 16-bit MLP's
        // excess over the FP8 one (equal with the 16-bit MLP taken out instead).
        let mut one = m.clone();
        let mut moe = job().0.architecture.moe.unwrap();
        moe.experts = 1;
        moe.experts_per_token = 1;
        moe.moe_ffn_hidden = one.architecture.ffn_hidden;
        moe.shared_experts = 0;
        moe.capacity_factor = None;
        one.architecture.moe = Some(moe);
        let l = Layout::without_pipeline(8, 2, 0, 1);
        let mc = moe_layer_compute(&one, &dev, &l, &a);
        let excess = p[0] - x[0];
        assert!(excess > 0.0);
        assert!(
            mc.fwd - a.fwd > excess,
            "MoE {} - dense {} against the 16-bit MLP's excess {excess}",
            mc.fwd,
            a.fwd
        );
    }

    /// Mixtral's MoE layer does top-2 of 8 experts of Mixtral's own FFN width: about twice
    /// the dense MLP's work per token, so the layer takes longer than the dense one and less
    /// than a dense layer with three times the MLP; EP 8 leaves each rank one expert with
    /// 8× the tokens per expert of EP 1, the same FLOPs in fewer, larger GEMMs.
    #[test]
    fn an_moe_layer_costs_its_top_k_experts() {
        let (m, c) = job();
        let dev = Device::of(&c);
        let mut dense = m.clone();
        dense.architecture.moe = None;
        let l = Layout::without_pipeline(64, 1, 0, 1);
        let d = layer_cp(&dense, &dev, 1, false, 1, 1);
        let moe = moe_layer_compute(&m, &dev, &l, &d);
        let mut wide = dense.clone();
        wide.architecture.ffn_hidden *= 3;
        let w = layer_cp(&wide, &dev, 1, false, 1, 1);
        assert!(
            d.fwd < moe.fwd && moe.fwd < w.fwd,
            "{} {} {}",
            d.fwd,
            moe.fwd,
            w.fwd
        );
        let mut l8 = l;
        l8.ep = 8;
        let moe8 = moe_layer_compute(&m, &dev, &l8, &d);
        assert!(moe8.fwd <= moe.fwd * 1.001, "{} vs {}", moe8.fwd, moe.fwd);
    }

    /// The all-to-all moves `k'` copies of the rank's tokens twice per pass: Mixtral at seq
    /// 4096, micro-batch 1, top-2, h 4096 sends 2 · 4096 · 2 · 4096 = 67,108,864 bytes per
    /// all-to-all; EP 1 sends nothing.
    #[test]
    fn dispatch_moves_the_routed_copies() {
        let (m, c) = job();
        let mut l = Layout::without_pipeline(64, 1, 0, 1);
        assert_eq!(m.training.seq_len, 4096);
        let links = Links::new(&c, &l.mesh(&c));
        assert_eq!(all_to_all_per_pass(&m, &l, &links), 0.0);
        l.ep = 8;
        assert_eq!(dispatch_bytes(&m, &l), 67_108_864.0);
        let links = Links::new(&c, &l.mesh(&c));
        let one = links.ep.time(67_108_864.0);
        assert!(one > 0.0);
        assert_eq!(all_to_all_per_pass(&m, &l, &links), 2.0 * one);
    }
}
