//! Activation memory, counted per stored tensor.
//!
//! Each tensor a transformer layer keeps for its backward is listed with its size, its element
//! width and how tensor parallelism treats it. Korthikanti et al. 2022 ("Reducing Activation
//! Recomputation in Large Transformer Models", §4, Table 2) sum the same tensors for a GPT-3
//! layer with dropout and a materialised softmax: `s·b·h·(34 + 5·a·s/h)`. Flash attention, GQA,
//! SwiGLU, no dropout, sequence parallelism and recompute all fall out of this one list.
//! This module counts bytes only; it knows nothing of stages or schedules.

use super::stored::{element_bytes, AttentionWidths, Split, Stored};
use crate::framework::SelectiveKind;
use crate::layout::Recompute;
use crate::model::{Activation, AttentionImpl, Model};

/// What a recompute policy keeps of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    All,
    /// Everything but the attention core's s×s tensors (Korthikanti et al.'s selective).
    NoAttentionCore,
    /// torchtitan's per-op selective checkpointing (`selective_ac_option = "op"`): the
    /// outputs of matrix multiplies (every second one is recomputed, so half of their bytes),
    /// of the fused attention kernel and the layer's input; element-wise results are
    /// recomputed. What `selective` means under flash attention where the framework's
    /// profile says `runs.selective = "op-sac"`.
    OpSac,
    /// The layer's input only.
    Input,
}

impl Keep {
    /// The policy of `recompute` for this model's attention and its framework's selective
    /// recompute ([`selective_kind`]).
    pub fn of(recompute: Recompute, attention: AttentionImpl, selective: SelectiveKind) -> Keep {
        match (recompute, attention, selective) {
            (Recompute::None, _, _) => Keep::All,
            (Recompute::Selective, AttentionImpl::Flash, SelectiveKind::OpSac) => Keep::OpSac,
            // Under flash attention no tensor is the attention core's: the layer keeps what it
            // keeps without recompute.
            (Recompute::Selective, _, _) => Keep::NoAttentionCore,
            (Recompute::Full, _, _) => Keep::Input,
        }
    }

    /// [`Keep::of`] for `model`'s attention and framework.
    pub fn for_model(recompute: Recompute, model: &Model) -> Keep {
        Keep::of(recompute, model.training.attention, selective_kind(model))
    }
}

/// What the model's framework re-runs under `recompute = "selective"` (`runs.selective`):
/// torchtitan's per-op checkpointing, or the attention core (Megatron, Tessera's runtime, and
/// an unstated framework, whose default profile is megatron-core).
pub(crate) fn selective_kind(model: &Model) -> SelectiveKind {
    model
        .training
        .framework
        .as_deref()
        .and_then(crate::framework::by_name)
        .map_or(SelectiveKind::CoreAttention, |p| p.runs.selective)
}

/// Whether the model's framework fuses a block's element-wise ops (`memory.fused_elementwise`).
/// The list below is what fused kernels keep: Megatron's fused bias-SwiGLU saves its input and
/// recomputes `silu(gate)`; under `torch.compile`, Inductor's partitioner
/// (torch/_functorch/partitioners.py `min_cut_rematerialization_partition`) recomputes in the
/// backward every pointwise result that no matmul or attention of the backward reads, so
/// `silu(gate)` is recomputed while the norms' outputs and SwiGLU's product, which the weight
/// gradients' matmuls read (`ban_recompute_materialized_backward`), stay saved. Eager PyTorch's
/// `F.silu(w1(x)) * w3(x)` (torchtitan's FeedForward, transformers' LlamaMLP) keeps
/// `silu(gate)` as well: the multiply's autograd node saves both of its operands. Its norms
/// are fused in eager too (torch 2.15's `nn.RMSNorm` runs `_fused_rms_norm` on CUDA, saving
/// the input and the per-row rstd; `F.layer_norm` likewise), so SwiGLU's activation is the one
/// difference. The profile is looked up by the stated name alone: the device defaults
/// (megatron-core, tessera) fuse, so an unstated framework costs no lookup on the search's path.
pub(crate) fn fuses_elementwise(model: &Model) -> bool {
    model
        .training
        .framework
        .as_deref()
        .and_then(crate::framework::by_name)
        .is_none_or(|p| p.memory.fused_elementwise)
}

/// The tensors one transformer layer stores for one micro-batch of `b` sequences.
pub fn layer_tensors(model: &Model, b: u64) -> Vec<Stored> {
    let a = &model.architecture;
    let t = &model.training;
    let (s, b) = (t.seq_len as f64, b as f64);
    let sb = s * b;
    let h = a.hidden as f64;
    let heads = a.heads as f64;
    let aw = AttentionWidths::of(a);
    let f = a.ffn_hidden as f64;
    let w = element_bytes(model);
    let dropout = t.dropout > 0.0;
    let mut v = Vec::new();
    let mut push = |name, bytes: f64, split, attention_core, layer_input| {
        if bytes > 0.0 {
            v.push(Stored {
                name,
                bytes,
                split,
                attention_core,
                layer_input,
                mm_output: false,
                sdpa_output: false,
                op_sac_only: false,
            })
        }
    };
    use Split::*;
    // Attention block. `qkv_input` is the first norm's output, the input of the QKV projection
    // (of MLA's down projections, or its direct query projection).
    push("norm1_input", w * sb * h, Replicated, false, true);
    push("qkv_input", w * sb * h, Replicated, false, false);
    if let Some(m) = &a.mla {
        // MLA, as Megatron-Core's `MLASelfAttention` runs it (transformers' `DeepseekV3Attention`
        // keeps the same tensors, but under flash-attention-2 pads V and the output to the
        // query/key head size; Transformer Engine's kernels take V as it is). The down projections are replicated over TP (`TELinear`,
        // `parallel_mode = "duplicated"`), run on the sequence-parallel shard under SP: their
        // outputs are `Replicated`, as the block's input is. The query latent (`q_a_proj`'s
        // output) is `q_layernorm`'s input, its output `q_up_proj`'s input; without a
        // `q_lora_rank` the query is projected from `qkv_input` directly.
        if let Some(r) = m.q_lora_rank {
            let r = r as f64;
            push("q_latent", w * sb * r, Replicated, false, false);
            push("q_up_input", w * sb * r, Replicated, false, false);
        }
        // `kv_a_proj_with_mqa`'s output, kv_lora_rank + qk_rope_head_dim wide: split (views,
        // one storage) into the latent, `kv_layernorm`'s input, and the shared RoPE key, which
        // RoPE's backward does not need (it keeps only cos and sin).
        let latent = m.kv_lora_rank as f64;
        let rope = m.qk_rope_head_dim as f64;
        push(
            "kv_latent",
            w * sb * (latent + rope),
            Replicated,
            false,
            false,
        );
        push("kv_up_input", w * sb * latent, Replicated, false, false);
        // The up projections' outputs are split, roped and concatenated into Q, K and V (new
        // tensors, column-parallel: each TP rank its heads); the attention keeps those.
    }
    // Per-head query and key norms (Qwen3's `q_norm`, `k_norm`; Megatron-Core's
    // `qk_layernorm`): unfused, as transformers, Megatron-Core and torchtitan run them, each
    // norm keeps its input (the projection's Q or K, before RoPE) beside the Q and K the
    // attention keeps: two more Q- and K-wide tensors. A fused norm+RoPE kernel could recompute
    // them; none of those three frameworks has one in its training path.
    if a.qk_norm {
        push("q_norm_input", w * sb * aw.q, Sharded, false, false);
        push("k_norm_input", w * sb * aw.k, Sharded, false, false);
    }
    push("q", w * sb * aw.q, Sharded, false, false);
    push("k", w * sb * aw.k, Sharded, false, false);
    push("v", w * sb * aw.v, Sharded, false, false);
    match t.attention {
        AttentionImpl::Eager => {
            push("softmax_output", w * heads * s * sb, Sharded, true, false);
            if dropout {
                push("softmax_dropout_mask", heads * s * sb, Sharded, true, false);
                push(
                    "softmax_dropout_output",
                    w * heads * s * sb,
                    Sharded,
                    true,
                    false,
                );
            }
        }
        // Flash attention keeps one fp32 log-sum-exp per row and regenerates dropout masks.
        AttentionImpl::Flash => push("softmax_lse_fp32", 4.0 * heads * sb, Sharded, false, false),
    }
    push("attn_proj_input", w * sb * aw.o, Sharded, false, false);
    if dropout {
        push("attn_dropout_mask", sb * h, Replicated, false, false);
    }
    // MLP block.
    push("norm2_input", w * sb * h, Replicated, false, false);
    push("mlp_input", w * sb * h, Replicated, false, false);
    match a.activation {
        Activation::Gelu => {
            push("gelu_input", w * sb * f, Sharded, false, false);
            push("mlp_down_input", w * sb * f, Sharded, false, false);
        }
        Activation::Swiglu => {
            push("gate_output", w * sb * f, Sharded, false, false);
            push("up_output", w * sb * f, Sharded, false, false);
            if !fuses_elementwise(model) {
                push("silu_output", w * sb * f, Sharded, false, false);
            }
            push("mlp_down_input", w * sb * f, Sharded, false, false);
        }
    }
    if dropout {
        push("mlp_dropout_mask", sb * h, Replicated, false, false);
    }
    // The projections' outputs the backward does not otherwise keep (op SAC saves them).
    for name in ["attn_out_proj_output", "mlp_down_output"] {
        v.push(Stored {
            name,
            bytes: w * sb * h,
            split: Replicated,
            attention_core: false,
            layer_input: false,
            mm_output: true,
            sdpa_output: false,
            op_sac_only: true,
        });
    }
    // Matrix multiplies' outputs, for op SAC. Q, K and V stand for the QKV (or MLA's up)
    // projections' outputs, the same sizes; with per-head norms the projection's Q and K are
    // the norms' inputs, and the normed, roped Q and K are element-wise results op SAC
    // recomputes. MLA's down projections' outputs are the two latents.
    for x in &mut v {
        x.mm_output |= match x.name {
            "q" | "k" => !a.qk_norm,
            "v" | "q_norm_input" | "k_norm_input" | "q_latent" | "kv_latent" => true,
            "gelu_input" | "gate_output" | "up_output" => true,
            _ => false,
        };
        x.sdpa_output = matches!(x.name, "softmax_lse_fp32" | "attn_proj_input");
    }
    super::adapters::adjust(model, b, &mut v);
    crate::fp8::adjust_activations(model, &mut v);
    v
}

/// Bytes one TP rank keeps for one tensor under the given parallelism and policy.
pub fn kept_bytes(x: &Stored, tp: u64, sp: bool, keep: Keep) -> f64 {
    let share = match keep {
        _ if x.op_sac_only && keep != Keep::OpSac => 0.0,
        Keep::All => 1.0,
        Keep::NoAttentionCore => f64::from(!x.attention_core),
        Keep::OpSac if x.layer_input || x.sdpa_output => 1.0,
        Keep::OpSac if x.mm_output => 0.5,
        Keep::OpSac => 0.0,
        Keep::Input => f64::from(x.layer_input),
    };
    let divided = x.split == Split::Sharded || (sp && x.split == Split::Replicated);
    share
        * if divided {
            x.bytes / tp as f64
        } else {
            x.bytes
        }
}

/// Activation bytes of one layer for one micro-batch on one TP rank.
pub fn layer_bytes(model: &Model, b: u64, tp: u64, sp: bool, recompute: Recompute) -> f64 {
    let keep = Keep::for_model(recompute, model);
    layer_tensors(model, b)
        .iter()
        .map(|x| kept_bytes(x, tp, sp, keep))
        .sum()
}

/// Tensors outside the layers: the embedding's dropout mask on the first stage.
pub fn embedding_bytes(model: &Model, b: u64, tp: u64, sp: bool) -> f64 {
    let t = &model.training;
    if t.dropout <= 0.0 {
        return 0.0;
    }
    // In f64: the u64 product can overflow for huge specs (exact below 2^53 either way).
    let bytes = t.seq_len as f64 * b as f64 * model.architecture.hidden as f64;
    if sp {
        bytes / tp as f64
    } else {
        bytes
    }
}

/// Tensors of the head on the last stage: final norm input, output-layer input, and the
/// logits' buffers of the framework's loss ([`super::logits::terms`]), as `(name, bytes, why)`.
pub fn head_terms(
    model: &Model,
    b: u64,
    tp: u64,
    sp: bool,
    loss: super::logits::Loss,
    pad_vocab: bool,
) -> Vec<(&'static str, f64, &'static str)> {
    let sb = model.training.seq_len as f64 * b as f64;
    let h = model.architecture.hidden as f64;
    let rep = if sp { tp as f64 } else { 1.0 };
    let w = element_bytes(model);
    let kept = super::logits::KEPT;
    let mut terms = vec![
        ("final_norm_input", w * sb * h / rep, kept),
        ("head_input", w * sb * h / rep, kept),
    ];
    terms.extend(super::logits::terms(model, sb, tp, loss, pad_vocab));
    terms
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Architecture, Mla, Position, Training};

    /// A GPT-3-style layer as in Korthikanti et al.: dropout, materialised softmax, 4h MLP.
    fn gpt3(a: u64, h: u64, s: u64) -> Model {
        Model {
            name: "gpt3-style".into(),
            architecture: Architecture::gpt(4, h, a, 51200, s),
            training: Training {
                seq_len: s,
                global_batch: 8,
                tokens: None,
                precision: "default".into(),
                attention: AttentionImpl::Eager,
                flash_kernel: Default::default(),
                dropout: 0.1,
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

    fn close(got: f64, want: f64) {
        assert!((got - want).abs() <= 1e-9 * want, "got {got}, want {want}");
    }

    // The paper's Table 2, each row written out from the paper, not from this module.
    #[test]
    fn reduces_to_korthikanti_table_2() {
        for &(a, h, s, b, t) in &[
            (96u64, 12288u64, 2048u64, 1u64, 8u64),
            (128, 20480, 2048, 2, 8),
            (16, 1024, 512, 4, 4),
        ] {
            let m = gpt3(a, h, s);
            let (sf, bf, hf, af, tf) = (s as f64, b as f64, h as f64, a as f64, t as f64);
            let sbh = sf * bf * hf;
            close(
                layer_bytes(&m, b, 1, false, Recompute::None),
                sbh * (34.0 + 5.0 * af * sf / hf),
            );
            close(
                layer_bytes(&m, b, t, false, Recompute::None),
                sbh * (10.0 + 24.0 / tf + 5.0 * af * sf / (hf * tf)),
            );
            close(
                layer_bytes(&m, b, t, true, Recompute::None),
                sbh / tf * (34.0 + 5.0 * af * sf / hf),
            );
            close(
                layer_bytes(&m, b, t, false, Recompute::Selective),
                sbh * (10.0 + 24.0 / tf),
            );
            close(
                layer_bytes(&m, b, t, true, Recompute::Selective),
                34.0 * sbh / tf,
            );
            close(layer_bytes(&m, b, t, false, Recompute::Full), 2.0 * sbh);
            close(layer_bytes(&m, b, t, true, Recompute::Full), 2.0 * sbh / tf);
        }
    }

    #[test]
    fn flash_attention_removes_the_quadratic_term() {
        let mut m = gpt3(96, 12288, 2048);
        m.training.attention = AttentionImpl::Flash;
        m.training.dropout = 0.0;
        let (s, h, a) = (2048.0, 12288.0, 96.0);
        // 34 − 2 dropout masks (1 byte each) = 32 s·b·h, plus an fp32 log-sum-exp per head and row.
        close(
            layer_bytes(&m, 1, 1, false, Recompute::None),
            s * h * 32.0 + 4.0 * a * s,
        );
    }

    #[test]
    fn gqa_and_swiglu_change_only_their_tensors() {
        let mut m = gpt3(32, 4096, 4096);
        m.training.attention = AttentionImpl::Flash;
        m.training.dropout = 0.0;
        let mha = layer_bytes(&m, 1, 1, false, Recompute::None);
        m.architecture.kv_heads = 8;
        let gqa = layer_bytes(&m, 1, 1, false, Recompute::None);
        // K and V shrink from h to h/4 wide: 2 tensors × 2 bytes × s × (h − h/4).
        close(mha - gqa, 2.0 * 2.0 * 4096.0 * (4096.0 - 1024.0));
        m.architecture.activation = Activation::Swiglu;
        m.architecture.ffn_hidden = 14336;
        let swiglu = layer_bytes(&m, 1, 1, false, Recompute::None);
        // GeLU MLP keeps 2 tensors of s×4h; SwiGLU keeps 3 of s×ffn.
        close(
            swiglu - gqa,
            2.0 * 4096.0 * (3.0 * 14336.0 - 2.0 * 4.0 * 4096.0),
        );
    }

    /// torchtitan's per-op checkpointing under flash attention (what `selective` means there),
    /// written out tensor by tensor for a GeLU layer without dropout, TP 1: the layer input
    /// (2sbh), the attention kernel's output (2sbh) and fp32 log-sum-exp (4·a·sb), and half of
    /// the matmul outputs: Q, K, V (6sbh), the output projection (2sbh), the MLP's up
    /// projection (8sbh) and its down projection (2sbh).
    #[test]
    fn op_sac_keeps_the_layer_input_the_attention_output_and_half_the_matmul_outputs() {
        let mut m = gpt3(16, 1024, 512);
        m.training.attention = AttentionImpl::Flash;
        m.training.dropout = 0.0;
        // torchtitan's selective (`runs.selective = "op-sac"`).
        m.training.framework = Some("torchtitan".into());
        let (s, b, h, a) = (512.0, 2.0, 1024.0, 16.0);
        let sbh = s * b * h;
        let want = 2.0 * sbh + 2.0 * sbh + 4.0 * a * s * b + 0.5 * (6.0 + 2.0 + 8.0 + 2.0) * sbh;
        close(layer_bytes(&m, 2, 1, false, Recompute::Selective), want);
        // Between full recompute (the input only) and none.
        let none = layer_bytes(&m, 2, 1, false, Recompute::None);
        let full = layer_bytes(&m, 2, 1, false, Recompute::Full);
        assert!(full < want && want < none, "{full} < {want} < {none}");
        // The op-SAC-only tensors never count in the other modes: none is the usual list,
        // 2sbh (norm1 input) + 2sbh (qkv input) + 6sbh (q, k, v) + 4·a·sb (lse) + 2sbh
        // (attention output) + 2sbh (norm2 input) + 2sbh (MLP input) + 8sbh (GeLU input) +
        // 8sbh (down-projection input).
        close(none, 32.0 * sbh + 4.0 * a * s * b);
    }

    /// Selective recompute is the framework's: torchtitan's per-op checkpointing under flash
    /// attention, but the attention core's for Megatron-Core (`--recompute-granularity
    /// selective`, `recompute_modules = ["core_attn"]`), Tessera and an unstated framework,
    /// where flash attention leaves the core nothing of its own to drop: the same bytes as no
    /// recompute, 32sbh + 4·a·sb for this GeLU layer (the list in the test above).
    #[test]
    fn selective_is_the_frameworks_own() {
        let mut m = gpt3(16, 1024, 512);
        m.training.attention = AttentionImpl::Flash;
        m.training.dropout = 0.0;
        let (s, b, h, a) = (512.0, 2.0, 1024.0, 16.0);
        let none_bytes = 32.0 * s * b * h + 4.0 * a * s * b;
        for framework in [None, Some("megatron-core"), Some("tessera")] {
            m.training.framework = framework.map(str::to_string);
            assert_eq!(
                Keep::for_model(Recompute::Selective, &m),
                Keep::NoAttentionCore,
                "{framework:?}"
            );
            close(
                layer_bytes(&m, 2, 1, false, Recompute::Selective),
                none_bytes,
            );
        }
        for framework in [
            "torchtitan",
            "torchtitan-compile",
            "torchtitan-compile-blocks",
        ] {
            m.training.framework = Some(framework.into());
            assert_eq!(Keep::for_model(Recompute::Selective, &m), Keep::OpSac);
            assert!(layer_bytes(&m, 2, 1, false, Recompute::Selective) < none_bytes);
        }
    }

    /// A small MLA layer, DeepSeek-V3's shape scaled down: hidden 64, 4 heads, q_lora_rank 24,
    /// kv_lora_rank 16, qk_nope 16 + qk_rope 8 (head_dim 24), v_head_dim 12; a GeLU MLP of
    /// 256; flash attention, no dropout, s = 32.
    fn small_mla() -> Model {
        let mut m = gpt3(4, 64, 32);
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
        m.training.attention = AttentionImpl::Flash;
        m.training.dropout = 0.0;
        m
    }

    /// The MLA layer's stored tensors for b = 2 (s·b = 64 tokens, 2 B each), written out one
    /// by one from Megatron-Core's `MLASelfAttention`:
    ///   norm1_input      64 × 64 × 2                = 8192  (replicated; the layer input)
    ///   qkv_input        64 × 64 × 2                = 8192  (replicated; down projections' input)
    ///   q_latent         64 × 24 × 2                = 3072  (replicated; q_layernorm's input)
    ///   q_up_input       64 × 24 × 2                = 3072  (replicated; q_up_proj's input)
    ///   kv_latent        64 × (16 + 8) × 2          = 3072  (replicated; latent + shared RoPE key)
    ///   kv_up_input      64 × 16 × 2                = 2048  (replicated; kv_up_proj's input)
    ///   q                64 × 4·(16 + 8) × 2        = 12288 (sharded)
    ///   k                64 × 4·(16 + 8) × 2        = 12288 (sharded)
    ///   v                64 × 4·12 × 2              = 6144  (sharded)
    ///   softmax_lse_fp32 64 × 4 × 4                 = 1024  (sharded)
    ///   attn_proj_input  64 × 4·12 × 2              = 6144  (sharded; the attention output)
    /// 65536 in all; the MLP adds norm2_input and mlp_input (8192 each, replicated) and the
    /// GeLU's input and the down projection's (64 × 256 × 2 = 32768 each, sharded): 147456.
    #[test]
    fn mla_layer_stores_its_latents_and_its_own_head_sizes() {
        use Split::*;
        let m = small_mla();
        let attention: Vec<(&str, f64, Split)> = layer_tensors(&m, 2)
            .iter()
            .take(11)
            .map(|x| (x.name, x.bytes, x.split))
            .collect();
        assert_eq!(
            attention,
            [
                ("norm1_input", 8192.0, Replicated),
                ("qkv_input", 8192.0, Replicated),
                ("q_latent", 3072.0, Replicated),
                ("q_up_input", 3072.0, Replicated),
                ("kv_latent", 3072.0, Replicated),
                ("kv_up_input", 2048.0, Replicated),
                ("q", 12288.0, Sharded),
                ("k", 12288.0, Sharded),
                ("v", 6144.0, Sharded),
                ("softmax_lse_fp32", 1024.0, Sharded),
                ("attn_proj_input", 6144.0, Sharded),
            ]
        );
        close(layer_bytes(&m, 2, 1, false, Recompute::None), 147456.0);
        // TP 2 without SP: the replicated tensors whole (8192·2 + 3072·3 + 2048 + 8192·2 =
        // 44032), the sharded halved (12288·2 + 6144·2 + 1024 + 32768·2 = 103424, /2 = 51712).
        close(layer_bytes(&m, 2, 2, false, Recompute::None), 95744.0);
        // With SP every tensor is split: 147456 / 2.
        close(layer_bytes(&m, 2, 2, true, Recompute::None), 73728.0);
        // Op SAC (torchtitan's selective under flash): the layer input (8192), the LSE and
        // attention output (1024 + 6144), and half of the matmul outputs: q_latent 3072,
        // kv_latent 3072, Q 12288, K 12288, V 6144, GeLU input 32768, and the two projections'
        // outputs 8192 each (86016 / 2 = 43008).
        let mut sac = m.clone();
        sac.training.framework = Some("torchtitan".into());
        close(
            layer_bytes(&sac, 2, 1, false, Recompute::Selective),
            8192.0 + 1024.0 + 6144.0 + 43008.0,
        );
        // Without q_lora_rank (DeepSeek-V2-Lite) the query is projected from qkv_input
        // directly: no q_latent, no q_up_input (3072 each).
        let mut lite = m.clone();
        lite.architecture.mla.as_mut().unwrap().q_lora_rank = None;
        close(
            layer_bytes(&lite, 2, 1, false, Recompute::None),
            147456.0 - 2.0 * 3072.0,
        );
    }

    /// Per-head query/key norms keep their inputs (the projection's Q and K) beside the Q and K
    /// the attention keeps. GQA layer: hidden 64, 4 heads and 2 KV heads of 16, s·b = 64:
    /// q_norm_input 64 × 64 × 2 = 8192, k_norm_input 64 × 32 × 2 = 4096.
    #[test]
    fn qk_norm_keeps_the_norms_inputs() {
        let mut m = gpt3(4, 64, 32);
        m.training.attention = AttentionImpl::Flash;
        m.training.dropout = 0.0;
        m.training.framework = Some("torchtitan".into());
        m.architecture.kv_heads = 2;
        let before = [Recompute::None, Recompute::Selective, Recompute::Full]
            .map(|r| layer_bytes(&m, 2, 1, false, r));
        m.architecture.qk_norm = true;
        let after = [Recompute::None, Recompute::Selective, Recompute::Full]
            .map(|r| layer_bytes(&m, 2, 1, false, r));
        close(after[0] - before[0], 8192.0 + 4096.0);
        // Op SAC keeps half of the matmul outputs: with the norms, the projection's outputs are
        // the norms' inputs (the same sizes as Q and K), and the normed, roped Q and K are
        // recomputed: nothing more is kept.
        close(after[1], before[1]);
        close(after[2], before[2]);
        // TP 2 halves them (they are the heads' share).
        let tp2 = layer_bytes(&m, 2, 2, false, Recompute::None);
        m.architecture.qk_norm = false;
        close(
            tp2 - layer_bytes(&m, 2, 2, false, Recompute::None),
            (8192.0 + 4096.0) / 2.0,
        );
    }
}
