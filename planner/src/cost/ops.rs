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

use super::gemm::Gemm;
use crate::memory::activations::AttentionWidths;
use crate::model::{Activation, AttentionImpl, Model, Position};
use crate::spec::{Calibration, Cluster};

/// The device's peaks and calibration, in SI units.
#[derive(Debug, Clone, Copy)]
pub struct Device<'a> {
    /// FLOP/s.
    pub peak: f64,
    /// Bytes/s.
    pub bandwidth: f64,
    pub cal: &'a Calibration,
    /// The tile and wave GEMM model, when the calibration has a `gemm_efficiency`; else the
    /// `matmul_efficiency` curve times GEMMs.
    pub gemm: Option<Gemm>,
    /// Seconds per kernel launch, charged to every kernel when `gemm` is in use.
    pub launch: f64,
    /// Element-wise evaluations with one exponential per second (`transcendental_gops`), where
    /// they bound those kernels (the CPU backend); `None` on GPUs.
    pub exp_rate: Option<f64>,
}

impl<'a> Device<'a> {
    pub fn of(cluster: &'a Cluster) -> Device<'a> {
        let (peak, bandwidth) = (
            cluster.device.peak_tflops * 1e12,
            cluster.device.memory_bandwidth_gbps * 1e9,
        );
        let cal = &cluster.calibration;
        let launch = cluster.device.kernel_launch_us * 1e-6;
        let gemm = cal.gemm_efficiency.map(|efficiency| Gemm {
            peak,
            efficiency,
            sms: cluster.device.sms as f64,
            bandwidth: bandwidth * cal.memory_efficiency,
            launch,
        });
        Device {
            peak,
            bandwidth,
            cal,
            launch: if gemm.is_some() { launch } else { 0.0 },
            gemm,
            exp_rate: cluster.device.transcendental_gops.map(|g| g * 1e9),
        }
    }

    /// Seconds of `n` kernel launches (0 under the legacy curve).
    pub fn launches(&self, n: f64) -> f64 {
        n * self.launch
    }

    /// Seconds to move `bytes` through memory.
    pub fn memory(&self, bytes: f64) -> f64 {
        bytes / (self.bandwidth * self.cal.memory_efficiency)
    }

    /// Seconds of an element-wise kernel that moves `bytes` and evaluates one exponential for
    /// each of `exps` elements: the longer of the two (the exponentials count only where the
    /// device has a `transcendental_gops`).
    pub fn elementwise(&self, bytes: f64, exps: f64) -> f64 {
        let exp = self.exp_rate.map_or(0.0, |r| exps / r);
        self.memory(bytes).max(exp)
    }

    /// Seconds for `batch` multiplies of an (m × k) by a (k × n) 16-bit matrix.
    pub fn matmul(&self, m: f64, k: f64, n: f64, batch: f64) -> f64 {
        if let Some(g) = &self.gemm {
            return g.time(m, k, n, batch);
        }
        let flops = 2.0 * m * k * n * batch;
        let eff = self.cal.matmul_efficiency_at(m.min(k).min(n));
        let bytes = 2.0 * (m * k + k * n + m * n) * batch;
        (flops / (self.peak * eff)).max(self.memory(bytes))
    }

    /// Forward and backward (input gradient + weight gradient) of `x (m × k) · w (k × n)`.
    pub fn linear(&self, m: f64, k: f64, n: f64) -> (f64, f64) {
        let fwd = self.matmul(m, k, n, 1.0);
        let bwd = self.matmul(m, n, k, 1.0) + self.matmul(k, m, n, 1.0);
        (fwd, bwd)
    }
}

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
fn attention_linears(model: &Model, dev: &Device, x: &Shapes) -> Vec<((f64, f64), f64)> {
    let att = &x.att;
    let Some(m) = &model.architecture.mla else {
        return vec![
            (dev.linear(x.t, x.h, att.q + att.k + att.v), 1.0),
            (dev.linear(x.t, att.o, x.h), 1.0),
        ];
    };
    let mut v = Vec::with_capacity(5);
    match m.q_lora_rank {
        Some(r) => {
            let r = r as f64;
            v.push((dev.linear(x.t_rep, x.h, r), 1.0));
            v.push((dev.linear(x.t, r, att.q), 1.0));
        }
        None => v.push((dev.linear(x.t, x.h, att.q), 1.0)),
    }
    let latent = m.kv_lora_rank as f64;
    let (nope, rope) = (m.qk_nope_head_dim as f64, m.qk_rope_head_dim as f64);
    v.push((dev.linear(x.t_rep, x.h, latent + rope), 1.0));
    v.push((dev.linear(x.t, latent, x.heads * (nope + att.d_v)), 1.0));
    v.push((dev.linear(x.t, att.o, x.h), 1.0));
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
    // Linear layers (column-parallel in, row-parallel out).
    let mlp_in = match a.activation {
        Activation::Gelu => 1.0,
        Activation::Swiglu => 2.0,
    };
    // (forward, backward) of each linear layer, and how many of it a layer has.
    let mut linears = attention_linears(model, dev, &x);
    linears.push((dev.linear(x.t, x.h, x.f), mlp_in));
    linears.push((dev.linear(x.t, x.f, x.h), 1.0));
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
            // The calibrated efficiency is FlashAttention-2's; older kernels take longer by
            // the factor the FlashAttention-2 paper measured (`FlashKernel::slowdown`).
            let eff = dev.peak * dev.cal.flash_attention_efficiency
                / model.training.flash_kernel.slowdown();
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
    (
        dev.memory(x.t * x.h * fwd) + dev.launches(1.0),
        dev.memory(x.t * x.h * 10.0) + dev.launches(1.0),
    )
}

/// Final norm, output projection and loss on the last stage: forward and backward seconds for
/// one micro-batch. The vocabulary-parallel cross-entropy, unfused as PyTorch runs it under
/// autocast, works on fp32 logits: forward upcasts (read 2, write 4), log-softmax reads twice
/// and writes once (12); backward writes a zeroed gradient (4), log-softmax's backward reads two
/// and writes one (12), and the downcast reads 4 and writes 2: 40 B per logit. A fused loss
/// kernel reads the 16-bit logits twice (max, then sums) and writes their gradient once: 6 B.
pub fn head(
    model: &Model,
    dev: &Device,
    tp: u64,
    sp: bool,
    b: u64,
    fused_loss: bool,
) -> (f64, f64) {
    let x = shapes(model, tp, sp, b, 1);
    // The padded vocabulary: the padding rows are computed like the others.
    let v = model.architecture.padded_vocab(tp) as f64 / tp as f64;
    let (lf, lb) = dev.linear(x.t, x.h, v);
    let norm_f = dev.memory(x.t_rep * x.h * 4.0);
    let norm_b = dev.memory(x.t_rep * x.h * 6.0);
    let (ce_f, ce_b) = if fused_loss { (4.0, 2.0) } else { (18.0, 22.0) };
    // Kernels besides the GEMMs: the norm, and the loss (one fused, else about three each way).
    let k = if fused_loss { 1.0 } else { 3.0 };
    (
        // One exponential per logit each way (the backward recomputes the probabilities).
        norm_f + lf + dev.elementwise(x.t * v * ce_f, x.t * v) + dev.launches(1.0 + k),
        norm_b + lb + dev.elementwise(x.t * v * ce_b, x.t * v) + dev.launches(2.0 + k),
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
    let s = model.training.seq_len as f64;
    let attention = match &a.mla {
        None => 2.0 * (h * (q + 2.0 * kv) + q * h) + 4.0 * s * q,
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
            2.0 * (q_proj + kv_proj + out) + 2.0 * s * heads * (nope + rope + d_v)
        }
    };
    let dense_mlp = 2.0 * mlp * h * f;
    let moe_layers = a.moe_layer_count() as f64;
    a.layers as f64 * attention
        + (a.layers as f64 - moe_layers) * dense_mlp
        + moe_layers * moe_mlp_flops_per_token(model)
        + 2.0 * h * a.vocab as f64
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
mod tests {
    use super::*;
    use crate::model::{Architecture, Mla, Norm, Training};

    fn cal(eff: f64) -> Calibration {
        Calibration {
            matmul_efficiency: vec![[1.0, eff]],
            memory_efficiency: 1.0,
            gemm_efficiency: None,
            flash_attention_efficiency: 0.5,
            intra_node_efficiency: 1.0,
            inter_node_efficiency: 1.0,
        }
    }

    /// A device without the tile model (GEMMs by the efficiency curve) and without launches.
    fn curve_device(peak: f64, bandwidth: f64, cal: &Calibration) -> Device<'_> {
        Device {
            peak,
            bandwidth,
            cal,
            gemm: None,
            launch: 0.0,
            exp_rate: None,
        }
    }

    fn gpt(h: u64, heads: u64, s: u64, v: u64) -> Model {
        Model {
            name: "gpt".into(),
            architecture: Architecture {
                layers: 2,
                hidden: h,
                heads,
                kv_heads: heads,
                head_dim: h / heads,
                ffn_hidden: 4 * h,
                vocab: v,
                activation: Activation::Gelu,
                norm: Norm::Layernorm,
                position: Position::Learned,
                tied_embeddings: true,
                bias: true,
                qkv_bias: true,
                max_positions: s,
                vocab_divisible_by: 1,
                rope_theta: crate::model::DEFAULT_ROPE_THETA,
                rope_scaling: None,
                norm_eps: crate::model::DEFAULT_NORM_EPS,
                sliding_window: None,
                moe: None,
                mla: None,
                qk_norm: false,
            },
            training: Training {
                seq_len: s,
                global_batch: 8,
                precision: "default".into(),
                attention: AttentionImpl::Eager,
                flash_kernel: Default::default(),
                dropout: 0.0,
            },
            optimizer: Default::default(),
            schedule: Default::default(),
        }
    }

    #[test]
    fn cost_matmul_is_a_roofline() {
        let c = cal(0.5);
        let dev = curve_device(100e12, 1e12, &c);
        // 4096³: 2·4096³ FLOPs at 50 TFLOP/s, far above its 3·2·4096² bytes at 1 TB/s.
        let n = 4096.0;
        assert!((dev.matmul(n, n, n, 1.0) - 2.0 * n * n * n / 50e12).abs() < 1e-15);
        // A matrix-vector product is memory-bound: 2·(n·n + n + n) bytes.
        let mv = dev.matmul(n, n, 1.0, 1.0);
        assert!((mv - 2.0 * (n * n + 2.0 * n) / 1e12).abs() < 1e-15);
    }

    #[test]
    fn cost_model_flops_match_korthikanti_eq_7() {
        // Per token: 72·L·h²·(1 + s/(6h) + V/(12·h·L)) / 3 for the forward pass.
        let (l, h, s, v) = (96.0, 12288.0, 2048.0, 51200.0);
        let mut m = gpt(12288, 96, 2048, 51200);
        m.architecture.layers = 96;
        let want = 72.0 * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * h * l)) / 3.0;
        let got = model_flops_per_token(&m);
        assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
    }

    #[test]
    fn cost_layer_compute_at_full_efficiency_is_the_flop_count() {
        // With efficiency 1, infinite bandwidth and no TP, the forward matmuls of a GPT layer
        // take 24·T·h² + 4·T·s·h FLOPs (T tokens), the backward twice that.
        let c = cal(1.0);
        let dev = curve_device(1e15, f64::INFINITY, &c);
        let m = gpt(1024, 16, 512, 1000);
        let (t, h, s) = (2.0 * 512.0, 1024.0, 512.0);
        let l = layer(&m, &dev, 1, false, 2);
        let want = (24.0 * t * h * h + 4.0 * t * s * h) / 1e15;
        assert!((l.fwd - want).abs() <= 1e-9 * want, "{} vs {want}", l.fwd);
        assert!((l.bwd - 2.0 * want).abs() <= 1e-9 * want);
        assert!((l.attention_core_fwd - 4.0 * t * s * h / 1e15).abs() <= 1e-9 * want);
        // TP divides every matmul of the layer.
        let l4 = layer(&m, &dev, 4, false, 2);
        assert!((l4.fwd - want / 4.0).abs() <= 1e-9 * want);
    }

    #[test]
    fn cost_flash_kernels_take_the_papers_measured_slowdown() {
        // Flash attention at efficiency 0.5 of 1 PFLOP/s, infinite bandwidth: the causal forward
        // executes 2·b·heads·s²·d FLOPs (b = 2, 16 heads of 64, s = 512), the backward 2.5×
        // that. The Triton kernel takes (1/3.5)·1.4 + (2.5/3.5)·2 = 1.8286× as long: the paper
        // gives 1.3–1.5× (taken as 1.4) in the forward, 2× in the backward.
        let c = cal(1.0);
        let dev = curve_device(1e15, f64::INFINITY, &c);
        let mut m = gpt(1024, 16, 512, 1000);
        m.training.attention = AttentionImpl::Flash;
        let fa2 = layer(&m, &dev, 1, false, 2).attention_core_fwd;
        let want = 2.0 * 2.0 * 16.0 * 512.0 * 512.0 * 64.0 / 0.5e15;
        assert!((fa2 - want).abs() <= 1e-9 * want, "{fa2} vs {want}");
        m.training.flash_kernel = crate::model::FlashKernel::Triton;
        let triton = layer(&m, &dev, 1, false, 2).attention_core_fwd;
        assert!(
            (triton / fa2 - 1.828_571_4).abs() < 1e-6,
            "{}",
            triton / fa2
        );
        m.training.flash_kernel = crate::model::FlashKernel::Fa1;
        let fa1 = layer(&m, &dev, 1, false, 2).attention_core_fwd;
        assert!((fa1 / fa2 - 2.35).abs() < 1e-9, "{}", fa1 / fa2);
    }

    #[test]
    fn cost_exp_bound_kernels_take_the_longer_of_bytes_and_exponentials() {
        // 1 TB/s and 10^9 exponentials per second: 1 MB of bytes takes 1 µs, 10^4 elements
        // with one exponential each take 10 µs.
        let c = cal(1.0);
        let mut dev = curve_device(f64::INFINITY, 1e12, &c);
        assert_eq!(dev.elementwise(1e6, 1e4), 1e-6);
        dev.exp_rate = Some(1e9);
        assert!((dev.elementwise(1e6, 1e4) - 1e-5).abs() < 1e-18);
        assert!((dev.elementwise(1e8, 1e4) - 1e-4).abs() < 1e-18);
        // In a layer (GPT: GeLU MLP, eager softmax, no dropout, infinite peak): the forward's
        // exponential-bound part is the GeLU over t·f = 1024·4096 elements and the softmax
        // over b·heads·s² = 2·16·512² scores; the backward's only the GeLU's.
        let m = gpt(1024, 16, 512, 1000);
        let slow = Device {
            bandwidth: f64::INFINITY,
            exp_rate: Some(1e9),
            ..dev
        };
        let l = layer(&m, &slow, 1, false, 2);
        let gelu = 1024.0 * 4096.0 / 1e9;
        let softmax = 2.0 * 16.0 * 512.0 * 512.0 / 1e9;
        assert!((l.fwd - gelu - softmax).abs() < 1e-12, "{}", l.fwd);
        assert!((l.bwd - gelu).abs() < 1e-12, "{}", l.bwd);
    }

    #[test]
    fn cost_element_wise_bytes_shrink_with_sequence_parallelism() {
        let c = cal(1.0);
        let dev = curve_device(f64::INFINITY, 1e12, &c);
        let m = gpt(1024, 16, 512, 1000);
        let plain = layer(&m, &dev, 4, false, 1);
        let sp = layer(&m, &dev, 4, true, 1);
        // Norms and residual adds: (2·4 + 2·6) B/element forward over T·h, split 4 ways by SP.
        let t = 512.0 * 1024.0;
        let saved = t * 20.0 * (1.0 - 0.25) / 1e12;
        assert!((plain.fwd - sp.fwd - saved).abs() < 1e-12);
    }

    /// DeepSeek-V3's attention dimensions (its config.json: hidden 7168, 128 heads,
    /// q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head_dim 128) in a
    /// model of one layer with a dense SwiGLU MLP of 18432 (its `intermediate_size`) and its
    /// vocabulary of 129280, s = 4096.
    fn deepseek_v3_attention() -> Model {
        let mut m = gpt(7168, 128, 4096, 129280);
        let a = &mut m.architecture;
        a.layers = 1;
        a.head_dim = 192;
        a.ffn_hidden = 18432;
        a.activation = Activation::Swiglu;
        a.norm = Norm::Rmsnorm;
        a.position = Position::Rope;
        a.max_positions = 0;
        a.tied_embeddings = false;
        (a.bias, a.qkv_bias) = (false, false);
        a.mla = Some(Mla {
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
        });
        m
    }

    #[test]
    fn cost_mla_model_flops_count_its_projections_and_head_sizes() {
        // Per token, by hand (2 FLOPs per multiply-add):
        //   q down   7168 × 1536          =  11,010,048
        //   q up     1536 × 128·192       =  37,748,736
        //   kv down  7168 × (512 + 64)    =   4,128,768
        //   kv up    512 × 128·(128 + 128) = 16,777,216
        //   out      128·128 × 7168       = 117,440,512
        //   sum                             187,105,280 multiply-adds → 374,210,560 FLOPs
        //   scores and P·V: 2 · 4096 · 128 · (192 + 128) = 335,544,320
        //   attention: 709,754,880
        //   dense MLP 2 · 3 · 7168 · 18432 = 792,723,456; logits 2 · 7168 · 129280 =
        //   1,853,358,080. Total 3,355,836,416.
        let m = deepseek_v3_attention();
        assert_eq!(model_flops_per_token(&m), 3_355_836_416.0);
        // DeepSeek-V2-Lite's attention (no q_lora_rank, hidden 2048, 16 heads, the same
        // head sizes; MLP 10944, vocabulary 102400): q 2048 × 16·192 = 6,291,456, kv down
        // 2048 × 576 = 1,179,648, kv up 512 × 16·256 = 2,097,152, out 16·128 × 2048 =
        // 4,194,304: 13,762,560 → 27,525,120 FLOPs; scores and P·V 2 · 4096 · 16 · 320 =
        // 41,943,040; MLP 2 · 3 · 2048 · 10944 = 134,479,872; logits 2 · 2048 · 102400 =
        // 419,430,400. Total 623,378,432.
        let mut lite = m.clone();
        let a = &mut lite.architecture;
        (a.hidden, a.heads, a.kv_heads) = (2048, 16, 16);
        (a.ffn_hidden, a.vocab) = (10944, 102400);
        a.mla.as_mut().unwrap().q_lora_rank = None;
        assert_eq!(model_flops_per_token(&lite), 623_378_432.0);
    }

    /// A small MLA layer, DeepSeek-V3's shape scaled down: hidden 64, 4 heads, q_lora_rank 24,
    /// kv_lora_rank 16, qk_nope 16 + qk_rope 8 (head_dim 24), v_head_dim 12; a GeLU MLP of
    /// 256; s = 32.
    fn small_mla() -> Model {
        let mut m = gpt(64, 4, 32, 1000);
        let a = &mut m.architecture;
        a.head_dim = 24;
        a.position = Position::Rope;
        a.max_positions = 0;
        (a.bias, a.qkv_bias) = (false, false);
        a.mla = Some(Mla {
            q_lora_rank: Some(24),
            kv_lora_rank: 16,
            qk_nope_head_dim: 16,
            qk_rope_head_dim: 8,
            v_head_dim: 12,
        });
        m
    }

    #[test]
    fn cost_mla_layer_at_full_efficiency_is_its_flop_count() {
        // b = 2, s = 32: T = 64 tokens. Forward FLOPs, by hand:
        //   q down  2 · 64 · 64 · 24          = 196,608
        //   q up    2 · 64 · 24 · 4·24        = 294,912
        //   kv down 2 · 64 · 64 · (16 + 8)    = 196,608
        //   kv up   2 · 64 · 16 · 4·(16 + 12) = 229,376
        //   out     2 · 64 · 4·12 · 64        = 393,216
        //   MLP     2 · 2 · 64 · 64 · 256     = 4,194,304
        //   scores  2 · 2 · 4 · 32 · 32 · 24  = 393,216
        //   P·V     2 · 2 · 4 · 32 · 32 · 12  = 196,608
        //   total 6,094,848; the backward twice each.
        let c = cal(1.0);
        let dev = curve_device(1e15, f64::INFINITY, &c);
        let m = small_mla();
        let l = layer(&m, &dev, 1, false, 2);
        let close = |got: f64, flops: f64| {
            let want = flops / 1e15;
            assert!((got - want).abs() <= 1e-9 * want, "{got} vs {want}");
        };
        close(l.fwd, 6_094_848.0);
        close(l.bwd, 2.0 * 6_094_848.0);
        close(l.attention_core_fwd, 393_216.0 + 196_608.0);
        // TP 4 without SP: the down projections are replicated, every rank runs them on all 64
        // tokens (196,608 · 2 = 393,216); the rest is split by heads: (6,094,848 − 393,216) / 4
        // = 1,425,408. With SP they run on the rank's 16 tokens: 6,094,848 / 4 = 1,523,712.
        close(layer(&m, &dev, 4, false, 2).fwd, 1_818_624.0);
        close(layer(&m, &dev, 4, true, 2).fwd, 1_523_712.0);
        // Flash attention (efficiency 0.5): causal half of the scores and P·V,
        // 0.5 · (393,216 + 196,608) = 294,912 FLOPs at 0.5 PFLOP/s.
        let mut flash = m.clone();
        flash.training.attention = AttentionImpl::Flash;
        close(
            layer(&flash, &dev, 1, false, 2).attention_core_fwd,
            294_912.0 / 0.5,
        );
    }

    #[test]
    fn cost_mla_and_qk_norm_element_wise_bytes() {
        // 1 TB/s, infinite peak, no launches: `elementwise_fwd` is bytes / 1e12. The small MLA
        // layer over T = 64 tokens, per token:
        //   two norms and two residual adds   64 · (2·4 + 2·6)              = 1,280
        //   the query and key-value latent norms (24 + 16) · 4              =   160
        //   GeLU on 256 (read 2, write 2)      256 · 4                       = 1,024
        //   RoPE on Q's rope channels in place  4 heads · 8 · 4              =   128
        //   the key-value kernel: reads 4·(16 + 12) + 8, writes K 4·24 and V 4·12, 2 B each:
        //                                      2 · (112 + 8 + 96 + 48)       =   528
        //   3,120 B per token, 199,680 in all.
        let c = cal(1.0);
        let dev = curve_device(f64::INFINITY, 1e12, &c);
        let m = small_mla();
        let l = layer(&m, &dev, 1, false, 2);
        assert!(
            (l.elementwise_fwd - 199_680.0 / 1e12).abs() < 1e-18,
            "{}",
            l.elementwise_fwd * 1e12
        );
        // Per-head q/k norms on a GQA layer (4 heads and 2 KV heads of 16, RoPE): Q 64 and
        // K 32 wide over 64 tokens, 4 B per element forward (64 · 96 · 4 = 24,576), 6 backward
        // (36,864).
        let mut g = gpt(64, 4, 32, 1000);
        g.architecture.kv_heads = 2;
        g.architecture.position = Position::Rope;
        let plain = layer(&g, &dev, 1, false, 2);
        g.architecture.qk_norm = true;
        let normed = layer(&g, &dev, 1, false, 2);
        assert!((normed.elementwise_fwd - plain.elementwise_fwd - 24_576.0 / 1e12).abs() < 1e-18);
        assert!((normed.bwd - plain.bwd - 36_864.0 / 1e12).abs() < 1e-18);
    }
}
