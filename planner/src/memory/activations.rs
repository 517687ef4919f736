//! Activation memory, counted per stored tensor.
//!
//! Each tensor a transformer layer keeps for its backward is listed with its size, its element
//! width and how tensor parallelism treats it. Korthikanti et al. 2022 ("Reducing Activation
//! Recomputation in Large Transformer Models", §4, Table 2) sum the same tensors for a GPT-3
//! layer with dropout and a materialised softmax: `s·b·h·(34 + 5·a·s/h)`. Flash attention, GQA,
//! SwiGLU, no dropout, sequence parallelism and recompute all fall out of this one list.
//! This module counts bytes only; it knows nothing of stages or schedules.

use crate::layout::Recompute;
use crate::model::{Activation, AttentionImpl, Model};

/// How tensor parallelism treats a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// The full tensor sits on every TP rank (norm inputs, block inputs, residual masks),
    /// unless sequence parallelism splits it along the sequence.
    Replicated,
    /// Each TP rank holds 1/t (its heads or its slice of the MLP).
    Sharded,
}

/// One tensor a layer keeps for backward.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub name: &'static str,
    /// Bytes for one micro-batch, before tensor parallelism.
    pub bytes: f64,
    pub split: Split,
    /// Part of the attention core that selective recompute drops (the s×s tensors).
    pub attention_core: bool,
    /// The layer's input: the only tensor full recompute keeps.
    pub layer_input: bool,
    /// A matrix multiply's output: per-op selective checkpointing (torchtitan's op SAC) keeps
    /// every second one.
    pub mm_output: bool,
    /// The fused attention kernel's output (and log-sum-exp): op SAC keeps it.
    pub sdpa_output: bool,
    /// Kept only by op SAC (a matmul output the backward needs no copy of otherwise).
    pub op_sac_only: bool,
}

/// What a recompute policy keeps of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    All,
    /// Everything but the attention core's s×s tensors (Korthikanti et al.'s selective).
    NoAttentionCore,
    /// torchtitan's per-op selective checkpointing (`selective_ac_option = "op"`): the
    /// outputs of matrix multiplies (every second one is recomputed, so half of their bytes),
    /// of the fused attention kernel and the layer's input; element-wise results are
    /// recomputed. What `selective` means under flash attention.
    OpSac,
    /// The layer's input only.
    Input,
}

impl Keep {
    /// The policy of `recompute` for this model's attention.
    pub fn of(recompute: Recompute, attention: AttentionImpl) -> Keep {
        match (recompute, attention) {
            (Recompute::None, _) => Keep::All,
            (Recompute::Selective, AttentionImpl::Eager) => Keep::NoAttentionCore,
            (Recompute::Selective, AttentionImpl::Flash) => Keep::OpSac,
            (Recompute::Full, _) => Keep::Input,
        }
    }
}

/// Bytes per stored activation element under the model's precision policy (2 for 16-bit
/// training, 4 for the CPU backend's f32).
pub(crate) fn element_bytes(model: &Model) -> f64 {
    crate::precision::Policy::by_name(&model.training.precision)
        .map_or(2.0, |p| f64::from(p.activation_bytes))
}

/// The tensors one transformer layer stores for one micro-batch of `b` sequences.
pub fn layer_tensors(model: &Model, b: u64) -> Vec<Stored> {
    let a = &model.architecture;
    let t = &model.training;
    let (s, b) = (t.seq_len as f64, b as f64);
    let sb = s * b;
    let h = a.hidden as f64;
    let heads = a.heads as f64;
    let q = a.q_dim() as f64;
    let kv = a.kv_dim() as f64;
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
    // Attention block.
    push("norm1_input", w * sb * h, Replicated, false, true);
    push("qkv_input", w * sb * h, Replicated, false, false);
    push("q", w * sb * q, Sharded, false, false);
    push("k", w * sb * kv, Sharded, false, false);
    push("v", w * sb * kv, Sharded, false, false);
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
    push("attn_proj_input", w * sb * q, Sharded, false, false);
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
    for x in &mut v {
        x.mm_output |= matches!(
            x.name,
            "q" | "k" | "v" | "gelu_input" | "gate_output" | "up_output"
        );
        x.sdpa_output = matches!(x.name, "softmax_lse_fp32" | "attn_proj_input");
    }
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
    let divided = sp || x.split == Split::Sharded;
    share
        * if divided {
            x.bytes / tp as f64
        } else {
            x.bytes
        }
}

/// Activation bytes of one layer for one micro-batch on one TP rank.
pub fn layer_bytes(model: &Model, b: u64, tp: u64, sp: bool, recompute: Recompute) -> f64 {
    let keep = Keep::of(recompute, model.training.attention);
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

/// Tensors of the head on the last stage: final norm input, output-layer input, fp32 logits.
pub fn head_terms(model: &Model, b: u64, tp: u64, sp: bool) -> [(&'static str, f64); 3] {
    let sb = model.training.seq_len as f64 * b as f64;
    let h = model.architecture.hidden as f64;
    let t = tp as f64;
    let rep = if sp { t } else { 1.0 };
    let w = element_bytes(model);
    [
        ("final_norm_input", w * sb * h / rep),
        ("head_input", w * sb * h / rep),
        (
            "logits_fp32",
            4.0 * sb * model.architecture.padded_vocab(tp) as f64 / t,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Architecture, Norm, Position, Training};

    /// A GPT-3-style layer as in Korthikanti et al.: dropout, materialised softmax, 4h MLP.
    fn gpt3(a: u64, h: u64, s: u64) -> Model {
        Model {
            name: "gpt3-style".into(),
            architecture: Architecture {
                layers: 4,
                hidden: h,
                heads: a,
                kv_heads: a,
                head_dim: h / a,
                ffn_hidden: 4 * h,
                vocab: 51200,
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
                dropout: 0.1,
            },
            optimizer: Default::default(),
            schedule: Default::default(),
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
}
