//! The ops' compute times against FLOPs and bytes written out by hand.
use super::*;
use crate::model::{Architecture, Mla, Norm, Training};
use crate::spec::Calibration;

fn cal(eff: f64) -> Calibration {
    Calibration {
        matmul_efficiency: vec![[1.0, eff]],
        memory_efficiency: 1.0,
        gemm_efficiency: None,
        gemm_efficiency_fp8: None,
        flash_attention_efficiency: 0.5,
        cudnn_attention_efficiency: None,
        intra_node_efficiency: 1.0,
        inter_node_efficiency: 1.0,
        host_op_us: None,
        host_dispatch_us: None,
        host_launch_us: None,
        nccl_ctas: None,
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
        tensor_cores: true,
        fp8: None,
        attention_efficiency: cal.flash_attention_efficiency,
    }
}

fn gpt(h: u64, heads: u64, s: u64, v: u64) -> Model {
    Model {
        name: "gpt".into(),
        architecture: Architecture::gpt(2, h, heads, v, s),
        training: Training {
            seq_len: s,
            global_batch: 8,
            tokens: None,
            precision: "default".into(),
            attention: AttentionImpl::Eager,
            flash_kernel: Default::default(),
            dropout: 0.0,
            framework: None,
            method: Default::default(),
            optimizer_states: Default::default(),
            fp8: Default::default(),
            tp_comm_overlap: false,
        },
        optimizer: Default::default(),
        schedule: Default::default(),
        lora: None,
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

/// A LoRA job's training FLOPs, by hand for one GPT layer of hidden 4, one head, sequence 2,
/// vocabulary 8 (ffn 16): forward per token = attention 2·4·(12 + 4) + core 4·2·4 = 160, MLP
/// 2·2·4·16 = 256, logits 2·4·8 = 64: 480. Full training 3 × 480 = 1440. LoRA r = 1 on qkv
/// (4 → 12): 2·1·(4 + 12) = 32 per pass, so 2 × 480 + core 32 + 3 × 32 = 1088.
#[test]
fn cost_lora_training_flops_skip_the_frozen_weight_gradients() {
    let mut m = gpt(4, 1, 2, 8);
    m.architecture.layers = 1;
    assert_eq!(model_flops_per_token(&m), 480.0);
    assert_eq!(training_flops_per_token(&m), 1440.0);
    m.training.method = crate::finetune::Method::Lora;
    m.lora = Some(crate::finetune::Lora {
        rank: 1,
        alpha: 1.0,
        dropout: 0.0,
        targets: vec![crate::finetune::Target::Qkv],
    });
    assert_eq!(training_flops_per_token(&m), 1088.0);
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
