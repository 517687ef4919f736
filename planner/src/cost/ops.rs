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
    /// Per-rank widths: query, key/value, MLP.
    q: f64,
    kv: f64,
    f: f64,
    /// Query rows per sequence on this rank: the sequence, or its 1/CP share.
    s: f64,
    /// Keys each query row attends over: the whole sequence (ring attention visits every
    /// rank's keys).
    s_kv: f64,
    b: f64,
    heads: f64,
    d: f64,
}

fn shapes(model: &Model, tp: u64, sp: bool, b: u64, cp: u64) -> Shapes {
    let a = &model.architecture;
    let s_kv = model.training.seq_len as f64;
    let s = s_kv / cp.max(1) as f64;
    let t = b as f64 * s;
    let tp = tp as f64;
    Shapes {
        t,
        t_rep: if sp { t / tp } else { t },
        h: a.hidden as f64,
        q: a.q_dim() as f64 / tp,
        kv: a.kv_dim() as f64 / tp,
        f: a.ffn_hidden as f64 / tp,
        s,
        s_kv,
        b: b as f64,
        heads: a.heads as f64 / tp,
        d: a.head_dim as f64,
    }
}

/// One transformer layer: QKV, attention core, output projection, MLP, two norms, two
/// residual adds (with bias and dropout fused in, as in Megatron), the MLP activation, RoPE.
pub fn layer(model: &Model, dev: &Device, tp: u64, sp: bool, b: u64) -> LayerCompute {
    layer_cp(model, dev, tp, sp, b, 1)
}

/// [`layer`] on one rank of a context-parallel group of `cp`: the rank's 1/CP of the tokens
/// through every linear and element-wise op, and its queries against the whole sequence's
/// keys in the attention core (the load-balanced chunks give every rank 1/CP of the causal
/// work).
pub fn layer_cp(model: &Model, dev: &Device, tp: u64, sp: bool, b: u64, cp: u64) -> LayerCompute {
    let x = shapes(model, tp, sp, b, cp);
    let a = &model.architecture;
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
    let linears = [
        (dev.linear(x.t, x.h, x.q + 2.0 * x.kv), 1.0),
        (dev.linear(x.t, x.q, x.h), 1.0),
        (dev.linear(x.t, x.h, x.f), mlp_in),
        (dev.linear(x.t, x.f, x.h), 1.0),
    ];
    let linear_fwd: f64 = linears.iter().map(|((f, _), n)| f * n).sum();
    for ((f, b), n) in linears {
        add((f * n, b * n));
    }
    // Attention core.
    let core = match model.training.attention {
        AttentionImpl::Eager => {
            let bh = x.b * x.heads;
            // scores = Q·Kᵀ (s×d by d×s), out = P·V (s×s by s×d); backward: two each. Under
            // CP, the rank's s/CP query rows against all s keys.
            let (sq, sk) = (x.s, x.s_kv);
            let scores = dev.matmul(sq, x.d, sk, bh);
            let pv = dev.matmul(sq, sk, x.d, bh);
            let scores_b = dev.matmul(sq, sk, x.d, bh) + dev.matmul(sk, sq, x.d, bh);
            let pv_b = dev.matmul(sq, x.d, sk, bh) + dev.matmul(sk, sq, x.d, bh);
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
            // Causal: half of the 4·b·s²·d FLOPs per head (under CP, the rank's s/CP queries
            // against all s keys: 1/CP of it); reads Q, K, V and writes O.
            let flops = 0.5 * 4.0 * x.b * x.heads * x.s * x.s_kv * x.d;
            // The calibrated efficiency is FlashAttention-2's; older kernels take longer by
            // the factor the FlashAttention-2 paper measured (`FlashKernel::slowdown`).
            let eff = dev.peak * dev.cal.flash_attention_efficiency
                / model.training.flash_kernel.slowdown();
            let io = dev.memory(2.0 * x.t * (2.0 * x.q + 2.0 * x.kv));
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
        ew_f += x.t * (x.q + x.kv) * 4.0;
        ew_b += x.t * (x.q + x.kv) * 4.0;
    }
    // Element-wise kernels: forward two norms, two residual adds, the activation (and RoPE);
    // backward each norm twice (input gradient, then the weight gradient's reduction).
    let rope = if a.position == Position::Rope {
        1.0
    } else {
        0.0
    };
    let elementwise_fwd = dev.memory(ew_f) + act.0 + dev.launches(5.0 + rope);
    add((
        elementwise_fwd,
        dev.memory(ew_b) + act.1 + dev.launches(7.0 + rope),
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
/// `24·h² + 4·s·h` per token, plus `2·h·V` for the logits.
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
    let layer = 2.0 * (h * (q + 2.0 * kv) + q * h + mlp * h * f) + 4.0 * s * q;
    a.layers as f64 * layer + 2.0 * h * a.vocab as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Architecture, Norm, Training};

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
}
