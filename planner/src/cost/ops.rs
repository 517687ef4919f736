//! Compute time of one micro-batch through the model's parts on one device: a roofline per op.
//!
//! Each op is `max(FLOPs / (peak · efficiency), bytes / (bandwidth · memory efficiency))`.
//! Matrix multiplies are timed by the tile and wave model of [`super::gemm`] (output tiles in
//! waves over the SMs, the memory roofline, a launch each) when the calibration has a
//! `gemm_efficiency`; otherwise (older specs) they take their efficiency from the
//! `matmul_efficiency` curve at the op's smallest dimension. Element-wise ops are costed by the
//! bytes they read and write plus a launch per kernel (with the tile model); flash attention by the FLOPs it
//! executes (causal: half the score matrix) at its calibrated efficiency (FlashAttention-2's,
//! divided by the measured slowdown of an older kernel), with the backward
//! executing 2.5× the forward's FLOPs (it recomputes the scores; Dao 2023, FlashAttention-2 §3).
//! Byte counts per element are written out next to each op. No communication here (`comm`),
//! no schedules (`pipeline`), no I/O.

use super::device::LinearShape;
use crate::framework::LossKind;
use crate::memory::stored::AttentionWidths;
use crate::model::{Activation, AttentionImpl, Model, Position};

pub use super::device::Device;

/// Compute time of one transformer layer for one micro-batch on one TP rank, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LayerCompute {
    pub fwd: f64,
    pub bwd: f64,
    /// The attention core's forward (scores, softmax, dropout, scores × V): what selective
    /// recompute runs again in the backward.
    pub attention_core_fwd: f64,
    /// The linear layers' forward, and the element-wise kernels' forward (norms, residual
    /// adds, the activation, RoPE): what per-op selective checkpointing re-runs (half the
    /// former, all the latter).
    pub linear_fwd: f64,
    pub elementwise_fwd: f64,
}

/// Shapes of one layer on one TP rank, in elements.
struct Shapes {
    /// Tokens of the micro-batch.
    t: f64,
    /// Tokens a replicated op (norm, residual) touches: all, or 1/TP with sequence parallelism.
    t_rep: f64,
    h: f64,
    /// Per-rank widths of the attention core's Q, K, V and output ([`AttentionWidths`], its
    /// heads' share), and its per-head sizes (`d_qk`, `d_v`).
    att: AttentionWidths,
    /// Per-rank MLP width.
    f: f64,
    /// Query rows per sequence on this rank: the sequence, or its 1/CP share.
    s: f64,
    /// Keys each query row attends over: the whole sequence (ring attention visits every
    /// rank's keys).
    s_kv: f64,
    b: f64,
    heads: f64,
}

fn shapes(model: &Model, tp: u64, sp: bool, b: u64, cp: u64) -> Shapes {
    let a = &model.architecture;
    let s_kv = model.training.seq_len as f64;
    let s = s_kv / cp.max(1) as f64;
    let t = b as f64 * s;
    let tp = tp as f64;
    let w = AttentionWidths::of(a);
    Shapes {
        t,
        t_rep: if sp { t / tp } else { t },
        h: a.hidden as f64,
        att: AttentionWidths {
            q: w.q / tp,
            k: w.k / tp,
            v: w.v / tp,
            o: w.o / tp,
            ..w
        },
        f: a.ffn_hidden as f64 / tp,
        s,
        s_kv,
        b: b as f64,
        heads: a.heads as f64 / tp,
    }
}

/// One transformer layer: QKV (or MLA's projections), attention core, output projection, MLP,
/// two norms, two residual adds (with bias and dropout fused in, as in Megatron), the MLP
/// activation, RoPE; MLA's latent norms and the per-head query/key norms where the model has
/// them.
pub fn layer(model: &Model, dev: &Device, tp: u64, sp: bool, b: u64) -> LayerCompute {
    layer_cp(model, dev, tp, sp, b, 1)
}

/// The attention block's linear layers on one TP rank: (forward, backward) of each, and how
/// many of it the block has. Standard attention: the fused QKV projection (column-parallel)
/// and the output projection (row-parallel). MLA, as Megatron-Core's `MLASelfAttention` builds
/// it: the query's down projection (`hidden → q_lora_rank`) and up projection (`q_lora_rank →
/// heads·(qk_nope + qk_rope)`), or without `q_lora_rank` its direct projection (`hidden →
/// heads·(qk_nope + qk_rope)`); the key-value down projection (`hidden → kv_lora_rank +
/// qk_rope`, the latent and the shared RoPE key); its up projection (`kv_lora_rank →
/// heads·(qk_nope + v_head_dim)`); the output projection (`heads·v_head_dim → hidden`). The
/// down projections are replicated over TP (`TELinear`, `parallel_mode = "duplicated"`): every
/// rank runs them whole over the tokens it holds, all of them, or its 1/TP under sequence
/// parallelism (they run before the gather: `t_rep` rows); the others are split by heads.
fn attention_linears(model: &Model, x: &Shapes) -> Vec<LinearShape> {
    let att = &x.att;
    let frozen = model.training.method.adapters();
    let l = |name, m, k, n, frozen| LinearShape {
        name,
        m,
        k,
        n,
        count: 1.0,
        frozen,
    };
    let Some(m) = &model.architecture.mla else {
        return vec![
            l("qkv", x.t, x.h, att.q + att.k + att.v, frozen),
            l("proj", x.t, att.o, x.h, frozen),
        ];
    };
    let mut v = Vec::with_capacity(5);
    match m.q_lora_rank {
        Some(r) => {
            let r = r as f64;
            v.push(l("q_down", x.t_rep, x.h, r, false));
            v.push(l("q_up", x.t, r, att.q, false));
        }
        None => v.push(l("q_proj", x.t, x.h, att.q, false)),
    }
    let latent = m.kv_lora_rank as f64;
    let (nope, rope) = (m.qk_nope_head_dim as f64, m.qk_rope_head_dim as f64);
    v.push(l("kv_down", x.t_rep, x.h, latent + rope, false));
    v.push(l("kv_up", x.t, latent, x.heads * (nope + att.d_v), false));
    v.push(l("proj", x.t, att.o, x.h, false));
    v
}

/// The linear layers of one transformer layer on one TP rank, attention's then the MLP's (the
/// attention core and the adapters are not among them): what an FP8 recipe casts.
pub fn block_linears(model: &Model, tp: u64, sp: bool, b: u64, cp: u64) -> Vec<LinearShape> {
    linear_shapes(model, &shapes(model, tp, sp, b, cp))
}

fn linear_shapes(model: &Model, x: &Shapes) -> Vec<LinearShape> {
    let frozen = model.training.method.adapters();
    let mut v = attention_linears(model, x);
    let (name_in, name_out, mlp_in) = match model.architecture.activation {
        Activation::Gelu => ("fc1", "fc2", 1.0),
        Activation::Swiglu => ("gate_up", "down", 2.0),
    };
    v.push(LinearShape {
        name: name_in,
        m: x.t,
        k: x.h,
        n: x.f,
        count: mlp_in,
        frozen,
    });
    v.push(LinearShape {
        name: name_out,
        m: x.t,
        k: x.f,
        n: x.h,
        count: 1.0,
        frozen,
    });
    v
}

/// [`layer`] on one rank of a context-parallel group of `cp`: the rank's 1/CP of the tokens
/// through every linear and element-wise op, and its queries against the whole sequence's
/// keys in the attention core (the load-balanced chunks give every rank 1/CP of the causal
/// work).
pub fn layer_cp(model: &Model, dev: &Device, tp: u64, sp: bool, b: u64, cp: u64) -> LayerCompute {
    let x = shapes(model, tp, sp, b, cp);
    let a = &model.architecture;
    let att = x.att;
    let dropout = model.training.dropout > 0.0;
    let mut fwd = 0.0;
    let mut bwd = 0.0;
    let mut add = |(f, b): (f64, f64)| {
        fwd += f;
        bwd += b;
    };
    // Linear layers (column-parallel in, row-parallel out): (forward, backward) of each, and
    // how many of it a layer has.
    let mut linears: Vec<((f64, f64), f64)> = linear_shapes(model, &x)
        .iter()
        .map(|l| (dev.block_linear(l), l.count))
        .collect();
    // The adapters (and QLoRA's dequantization) beside the frozen linears.
    let adapters = super::adapters::layer(model, dev, tp, x.t);
    linears.push((adapters, 1.0));
    let linear_fwd: f64 = linears.iter().map(|((f, _), n)| f * n).sum();
    for ((f, b), n) in linears {
        add((f * n, b * n));
    }
    // Attention core. Scores take the query/key head size (`d_qk`), P·V the value head size
    // (`d_v`): equal in standard attention, qk_nope + qk_rope and v_head_dim under MLA.
    let (d_qk, d_v) = (att.d_qk, att.d_v);
    let core = match model.training.attention {
        AttentionImpl::Eager => {
            let bh = x.b * x.heads;
            // scores = Q·Kᵀ (s×d_qk by d_qk×s), out = P·V (s×s by s×d_v); backward: dQ = dS·K,
            // dK = dSᵀ·Q, dP = dO·Vᵀ, dV = Pᵀ·dO. Under CP, the rank's s/CP query rows
            // against all s keys.
            let (sq, sk) = (x.s, x.s_kv);
            let scores = dev.matmul(sq, d_qk, sk, bh);
            let pv = dev.matmul(sq, sk, d_v, bh);
            let scores_b = dev.matmul(sq, sk, d_qk, bh) + dev.matmul(sk, sq, d_qk, bh);
            let pv_b = dev.matmul(sq, d_v, sk, bh) + dev.matmul(sk, sq, d_v, bh);
            let elems = bh * sq * sk;
            // Fused scale-mask-softmax: read 2 + write 2 B/element; backward reads the output
            // and its gradient and writes one (6). Dropout: read 2, write 2 + a 1-byte mask;
            // backward reads gradient and mask, writes 2 (5).
            let (mut ew_f, mut ew_b) = (4.0 * elems, 6.0 * elems);
            if dropout {
                ew_f += 5.0 * elems;
                ew_b += 5.0 * elems;
            }
            // Kernels: softmax (and dropout) each way.
            let k = if dropout { 2.0 } else { 1.0 };
            // The softmax evaluates one exponential per score; its backward uses the stored
            // probabilities.
            let f = scores + pv + dev.elementwise(ew_f, elems) + dev.launches(k);
            add((f, scores_b + pv_b + dev.memory(ew_b) + dev.launches(k)));
            f
        }
        AttentionImpl::Flash => {
            // Causal: half of the 2·b·s²·(d_qk + d_v) FLOPs per head (scores and P·V; under
            // CP, the rank's s/CP queries against all s keys: 1/CP of it); reads Q, K, V and
            // writes O.
            let flops = 0.5 * 2.0 * x.b * x.heads * x.s * x.s_kv * (d_qk + d_v);
            // The calibrated efficiency is FlashAttention-2's (or cuDNN's fused attention's,
            // where the framework runs it and the cluster measures it: `Device::for_job`);
            // older kernels take longer by the factor the FlashAttention-2 paper measured
            // (`FlashKernel::slowdown`).
            let eff = dev.peak * dev.attention_efficiency / model.training.flash_kernel.slowdown();
            let io = dev.memory(2.0 * x.t * (att.q + att.k + att.v + att.o));
            // One forward kernel; the backward's three (FlashAttention-2: the `rowsum(dO ∘ O)`
            // pre-pass, the main kernel, the dQ conversion).
            let f = (flops / eff).max(io) + dev.launches(1.0);
            add((f, (2.5 * flops / eff).max(2.0 * io) + dev.launches(3.0)));
            f
        }
    };
    // Element-wise ops (16-bit activations). Norm: read 2, write 2; backward reads input and
    // gradient, writes one (6). Residual add with bias and dropout: read 2 + 2, write 2 (+ 1 mask);
    // backward the same. MLP activation on the f-wide tensor: GeLU read 2 write 2 (backward 6),
    // SwiGLU reads two, writes one (6; backward 10). RoPE rotates Q and K in place (4; same back).
    let drop = if dropout { 1.0 } else { 0.0 };
    let mut ew_f = x.t_rep * x.h * (2.0 * 4.0 + 2.0 * (6.0 + drop));
    let mut ew_b = x.t_rep * x.h * (2.0 * 6.0 + 2.0 * (6.0 + drop));
    // Kernels: forward two norms, two residual adds, the activation; backward each norm twice
    // (input gradient, then the weight gradient's reduction), the adds, the activation.
    let (mut kernels_f, mut kernels_b) = (5.0, 7.0);
    // More norms, costed as the layer's: MLA's on the query latent (with a q_lora_rank) and on
    // the key-value latent, replicated over TP like the layer's own (on `t_rep` tokens);
    // per-head norms on Q and K (`qk_norm`), on the rank's heads.
    let mut norm = |elems: f64, kernels: f64| {
        ew_f += elems * 4.0;
        ew_b += elems * 6.0;
        kernels_f += kernels;
        kernels_b += 2.0 * kernels;
    };
    if let Some(m) = &a.mla {
        let q_latent = m.q_lora_rank.map_or(0.0, |r| r as f64);
        let latent_norms = if m.q_lora_rank.is_some() { 2.0 } else { 1.0 };
        norm(x.t_rep * (q_latent + m.kv_lora_rank as f64), latent_norms);
    }
    if a.qk_norm {
        norm(x.t * (att.q + att.k), 2.0);
    }
    let (act_f, act_b) = match a.activation {
        Activation::Gelu => (4.0, 6.0),
        Activation::Swiglu => (6.0, 10.0),
    };
    // GeLU's tanh and SiLU's sigmoid: one exponential per element each way.
    let act = (
        dev.elementwise(x.t * x.f * act_f, x.t * x.f),
        dev.elementwise(x.t * x.f * act_b, x.t * x.f),
    );
    if a.position == Position::Rope {
        let (bytes, kernels) = match &a.mla {
            None => (x.t * (att.q + att.k) * 4.0, 1.0),
            // MLA, as Megatron-Core's fused kernels run it (`fused_apply_mla_rope_for_q`,
            // `fused_apply_mla_rope_for_kv`, megatron/core/fusions/fused_mla_yarn_rope_apply.py):
            // the query's qk_rope channels of each head rotated in place (4 B per element); the
            // key-value kernel reads the up projection's heads·(qk_nope + v_head_dim) and the
            // shared RoPE key (qk_rope), and writes K (heads·(qk_nope + qk_rope), the rotated
            // key copied into every head) and V (heads·v_head_dim), 2 B each. The backward
            // moves the same bytes the other way.
            Some(m) => {
                let (nope, rope) = (m.qk_nope_head_dim as f64, m.qk_rope_head_dim as f64);
                let q = x.heads * rope * 4.0;
                let kv = 2.0 * (x.heads * (nope + d_v) + rope + att.k + att.v);
                (x.t * (q + kv), 2.0)
            }
        };
        ew_f += bytes;
        ew_b += bytes;
        kernels_f += kernels;
        kernels_b += kernels;
    }
    let elementwise_fwd = dev.memory(ew_f) + act.0 + dev.launches(kernels_f);
    add((
        elementwise_fwd,
        dev.memory(ew_b) + act.1 + dev.launches(kernels_b),
    ));
    LayerCompute {
        fwd,
        bwd,
        attention_core_fwd: core,
        linear_fwd,
        elementwise_fwd,
    }
}

/// The token embedding (and learned positions, and dropout) on the first stage: forward and
/// backward seconds for one micro-batch. Forward: gather rows (read 2, write 2 per element);
/// learned positions add one more table (read 2 + 2, write 2); dropout writes a mask (1) and
/// reads, writes (4). Backward: scatter-add into the fp32 gradient rows (read 2, read and write
/// 4 + 4).
pub fn embedding(model: &Model, dev: &Device, tp: u64, sp: bool, b: u64) -> (f64, f64) {
    let x = shapes(model, tp, sp, b, 1);
    let mut fwd = 4.0;
    if model.architecture.position == Position::Learned {
        fwd += 6.0;
    }
    if model.training.dropout > 0.0 {
        fwd += 5.0;
    }
    // A frozen embedding (LoRA, QLoRA) has no gradient to scatter.
    let bwd = if model.training.method.adapters() {
        0.0
    } else {
        dev.memory(x.t * x.h * 10.0) + dev.launches(1.0)
    };
    (dev.memory(x.t * x.h * fwd) + dev.launches(1.0), bwd)
}

/// Final norm, output projection and loss on the last stage: forward and backward seconds for
/// one micro-batch. The output layer's GEMMs run over the vocabulary rows the framework holds
/// (`pad_vocab`: [`crate::model::Architecture::vocab_rows`]), slowed where those rows are not
/// 16-byte aligned ([`super::loss::gemm_slowdown`]); the loss moves the bytes per logit and
/// launches the kernels of its kind ([`super::loss::LossCost`]).
pub fn head(
    model: &Model,
    dev: &Device,
    tp: u64,
    sp: bool,
    b: u64,
    loss: LossKind,
    pad_vocab: bool,
) -> (f64, f64) {
    let x = shapes(model, tp, sp, b, 1);
    // The vocabulary rows of a rank: padding rows are computed like the others.
    let rows = model.architecture.vocab_rows(tp, pad_vocab) / tp.max(1);
    let v = rows as f64;
    let element = crate::memory::stored::element_bytes(model) as u64;
    let slow = super::loss::gemm_slowdown(rows, element, dev.tensor_cores);
    let (lf, lb) = dev.linear_of(model.training.method.adapters(), x.t, x.h, v);
    let (lf, lb) = (lf * slow, lb * slow);
    let norm_f = dev.memory(x.t_rep * x.h * 4.0);
    let norm_b = dev.memory(x.t_rep * x.h * 6.0);
    let c = super::loss::LossCost::of(loss);
    let ((ce_f, ce_b), (kf, kb)) = (c.bytes, c.kernels);
    (
        // One exponential per logit each way (the backward recomputes the probabilities).
        norm_f + lf + dev.elementwise(x.t * v * ce_f, x.t * v) + dev.launches(1.0 + kf),
        norm_b + lb + dev.elementwise(x.t * v * ce_b, x.t * v) + dev.launches(2.0 + kb),
    )
}

/// Model FLOPs of one token's forward pass: every matrix multiply of every layer (2 per
/// multiply-add), the attention scores and their product with V over the full sequence (no
/// causal halving), and the output layer. Training counts 3× this, without recompute: the
/// convention of Korthikanti et al. 2022 (Eq. 7) and PaLM's MFU, which for a GPT layer is
/// `24·h² + 4·s·h` per token, plus `2·h·V` for the logits. Under MLA the attention term is its
/// five (or four) projections and `2·s·heads·(d_qk + d_v)` for the scores and P·V, the same
/// conventions; per-head q/k norms and RoPE are element-wise and add no model FLOPs.
pub fn model_flops_per_token(model: &Model) -> f64 {
    let a = &model.architecture;
    let (h, q, kv, f) = (
        a.hidden as f64,
        a.q_dim() as f64,
        a.kv_dim() as f64,
        a.ffn_hidden as f64,
    );
    let mlp = match a.activation {
        Activation::Gelu => 2.0,
        Activation::Swiglu => 3.0,
    };
    let attention = match &a.mla {
        None => 2.0 * (h * (q + 2.0 * kv) + q * h) + attention_core_flops_per_token(model),
        // MLA: each projection's 2·in·out (the query's down and up projections, or its direct
        // one; the key-value down and up projections; the output projection), and the scores
        // and P·V over the full sequence with their own head sizes: 2·s·heads·(d_qk + d_v).
        Some(m) => {
            let heads = a.heads as f64;
            let (nope, rope, d_v) = (
                m.qk_nope_head_dim as f64,
                m.qk_rope_head_dim as f64,
                m.v_head_dim as f64,
            );
            let latent = m.kv_lora_rank as f64;
            let q_up = heads * (nope + rope);
            let q_proj = match m.q_lora_rank {
                Some(r) => h * r as f64 + r as f64 * q_up,
                None => h * q_up,
            };
            let kv_proj = h * (latent + rope) + latent * heads * (nope + d_v);
            let out = heads * d_v * h;
            2.0 * (q_proj + kv_proj + out) + attention_core_flops_per_token(model)
        }
    };
    let dense_mlp = 2.0 * mlp * h * f;
    let moe_layers = a.moe_layer_count() as f64;
    a.layers as f64 * attention
        + (a.layers as f64 - moe_layers) * dense_mlp
        + moe_layers * moe_mlp_flops_per_token(model)
        + 2.0 * h * a.vocab as f64
}

/// Model FLOPs of one token's training step: 3× the forward for full training. A LoRA or QLoRA
/// job computes no gradient for its frozen weights, so its step is the forward and the input
/// gradient of every frozen matrix multiply (2×), the attention core's forward and backward
/// (3×: its backward is the activations' gradient, whatever trains), and its adapters' three
/// passes (`2·r·(in + out)` per token and adapter forward). Counting the frozen weights'
/// gradients would report a LoRA job's MFU half again above the arithmetic it does.
pub fn training_flops_per_token(model: &Model) -> f64 {
    let forward = model_flops_per_token(model);
    let Some(l) = model.adapters() else {
        return 3.0 * forward;
    };
    let a = &model.architecture;
    let core = a.layers as f64 * attention_core_flops_per_token(model);
    let r = l.rank as f64;
    let adapters: f64 = (l.targets.iter())
        .map(|t| {
            let (i, o) = t.shape(a);
            2.0 * r * (i + o) as f64
        })
        .sum::<f64>()
        * a.layers as f64;
    2.0 * forward + core + 3.0 * adapters
}

/// The attention core's model FLOPs per token and layer: the scores and their product with V
/// over the full sequence (`model_flops_per_token`'s convention).
fn attention_core_flops_per_token(model: &Model) -> f64 {
    let a = &model.architecture;
    let s = model.training.seq_len as f64;
    match &a.mla {
        None => 4.0 * s * a.q_dim() as f64,
        Some(m) => {
            2.0 * s
                * a.heads as f64
                * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) as f64
        }
    }
}

/// Model FLOPs of one token's forward through an MoE layer's MLP part: the router (`h × E`),
/// the `experts_per_token` routed experts it goes through and the shared experts (and their
/// gate), each `2 · matrices · h · width`. Tokens dropped by a capacity factor are not
/// subtracted: model FLOPs count the model's arithmetic, as Megatron-Core's MoE MFU does
/// (its `num_floating_point_operations` counts top-k experts per token). 0 for a dense model.
pub fn moe_mlp_flops_per_token(model: &Model) -> f64 {
    let a = &model.architecture;
    let Some(m) = &a.moe else {
        return 0.0;
    };
    let h = a.hidden as f64;
    let matrices = match a.activation {
        Activation::Gelu => 2.0,
        Activation::Swiglu => 3.0,
    };
    let routed = m.experts_per_token as f64 * matrices * h * m.moe_ffn_hidden as f64;
    let shared = m.shared_experts as f64 * matrices * h * m.shared_expert_ffn_hidden as f64;
    let gate = if m.shared_expert_gate && m.shared_experts > 0 {
        h
    } else {
        0.0
    };
    2.0 * (h * m.experts as f64 + routed + shared + gate)
}

#[cfg(test)]
#[path = "ops_tests.rs"]
mod tests;
