//! The batch size and learning rate a published compute-optimal law gives a pretraining job,
//! and the learning-rate rules for a changed global batch. Advice for `tessera plan` to print:
//! nothing here changes a plan.
//!
//! The law is DeepSeek LLM's (DeepSeek-AI 2024, "DeepSeek LLM: Scaling Open-Source Language
//! Models with Longtermism", arXiv 2401.02954, §3.1, Eq. 1), fitted on their own pretraining
//! data with AdamW and a multi-step schedule:
//!
//! - B_opt = 0.2920 · C^0.3271 tokens per optimizer step,
//! - η_opt = 0.3118 · C^−0.1250 peak learning rate,
//!
//! with C = M · D, D the training tokens and M the non-embedding FLOPs per token (§3.2):
//! M = 72 · n_layer · d_model² + 12 · n_layer · d_model · l_seq for their architecture. The fit
//! covers compute budgets from 1e17 to 2e19 FLOPs; the paper checked it at 1e20 (Fig. 2b) and
//! took its 7B and 67B settings (Table 2, at about 8e22 and 9e23 FLOPs by this M) from it. Anything else is an
//! extrapolation, and is said to be one.
//!
//! What is not claimed: the law was fitted on one data set, one optimizer and one schedule; the
//! paper notes that the optimum also moves with the model/data split at a fixed budget, and
//! that the critical batch size of McCandlish et al. (2018) depends on the loss reached rather
//! than on C alone. No number here is ours.

use crate::finetune::Method;
use crate::model::Architecture;
use crate::Model;

/// B_opt = 0.2920 · C^0.3271 (DeepSeek LLM, Eq. 1), in tokens per optimizer step.
pub const BATCH_COEF: f64 = 0.2920;
pub const BATCH_EXP: f64 = 0.3271;
/// η_opt = 0.3118 · C^−0.1250 (DeepSeek LLM, Eq. 1).
pub const LR_COEF: f64 = 0.3118;
pub const LR_EXP: f64 = -0.1250;
/// The compute budgets the law was fitted over, FLOPs (DeepSeek LLM §3.1: "compute budgets
/// ranging from 1e17 to 2e19").
pub const FITTED_FLOPS: (f64, f64) = (1e17, 2e19);
/// The budget the paper validated the fit at (§3.1, Fig. 2b: 2.94B FLOPs/token at 1e20).
pub const VALIDATED_FLOPS: f64 = 1e20;
/// The band around B_opt the job's global batch is held to: a factor of 2 either way. The paper
/// calls near-optimal every setting within 0.25% of the best generalization error and shows
/// those settings in a broad band (§3.1, Figs. 2–3); it states no width, so this factor is our
/// conservative reading of its figures, not a number the paper gives.
pub const BAND: f64 = 2.0;

/// Where the source is cited in what `plan` prints.
pub const SOURCE: &str = "DeepSeek LLM (DeepSeek-AI 2024, §3.1 Eq. 1)";

/// Why a batch size far from the law's matters, and why it is not a hard limit: a cited
/// sentence, no number of ours.
pub const CRITICAL_BATCH: &str = "beyond the critical batch size more tokens per step buy \
little progress per step (McCandlish et al. 2018, \"An Empirical Model of Large-Batch \
Training\"), and that size grows with the training data rather than the model (Zhang et al. \
2024, \"How Does Critical Batch Size Scale in Pre-training?\")";

/// M, the non-embedding FLOPs of one token's forward and backward (DeepSeek LLM §3.2, Eq. 2),
/// from the architecture's own counts: 6 FLOPs per parameter a token goes through in the
/// transformer blocks, plus 6 · l_seq · (query-key width + value width) per layer for the
/// attention scores and their weighted sum (forward 2 · 2, backward twice that, over the full
/// l_seq as Eq. 2 counts it). The embedding, final norm and output layer (the vocabulary's
/// computation) are left out, as Eq. 2 leaves them out.
///
/// For the paper's architecture (multi-head attention, 12 · d_model² weights a layer) this is
/// Eq. 2 plus the norm weights (6 · 2 · d_model a layer, under 0.01% at 7B). Grouped-query
/// attention counts its narrower K and V projections; Multi-head Latent Attention its
/// projections and per-head widths; an MoE layer its active parameters only: the attention,
/// norms, router and shared experts every token passes, and `experts_per_token` routed experts.
pub fn flops_per_token(arch: &Architecture, seq_len: u64) -> f64 {
    let moe_layers = arch.moe_layer_count();
    let dense = (arch.layers - moe_layers) as f64 * arch.layer_params().total() as f64;
    let moe = match (&arch.moe, arch.moe_layer_params()) {
        (Some(m), Some(p)) => moe_layers as f64 * p.active(m.experts_per_token) as f64,
        _ => 0.0,
    };
    let v_head_dim = arch.mla.map_or(arch.head_dim, |m| m.v_head_dim);
    let scores = 6.0
        * arch.layers as f64
        * seq_len as f64
        * arch.heads as f64
        * (arch.head_dim + v_head_dim) as f64;
    6.0 * (dense + moe) + scores
}

/// What the law gives at one compute budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Optimum {
    /// C = M · D, FLOPs.
    pub compute: f64,
    /// B_opt, tokens per optimizer step.
    pub batch_tokens: f64,
    /// η_opt, the peak learning rate.
    pub lr: f64,
}

impl Optimum {
    /// The law at compute `c` FLOPs.
    pub fn at(c: f64) -> Optimum {
        Optimum {
            compute: c,
            batch_tokens: BATCH_COEF * c.powf(BATCH_EXP),
            lr: LR_COEF * c.powf(LR_EXP),
        }
    }

    /// Whether C lies within the budgets the law was fitted over.
    pub fn fitted(&self) -> bool {
        (FITTED_FLOPS.0..=FITTED_FLOPS.1).contains(&self.compute)
    }

    /// The band the global batch is held to: [B_opt / 2, 2 · B_opt] tokens.
    pub fn band(&self) -> (f64, f64) {
        (self.batch_tokens / BAND, self.batch_tokens * BAND)
    }

    /// Where `tokens` per step lies against the band.
    pub fn place(&self, tokens: f64) -> Place {
        let (low, high) = self.band();
        if tokens < low {
            Place::Below
        } else if tokens > high {
            Place::Above
        } else {
            Place::Within
        }
    }
}

/// A global batch against the band.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Below,
    Within,
    Above,
}

/// What can be said of a job's batch size and learning rate.
#[derive(Debug, Clone, PartialEq)]
pub enum Advice {
    /// A LoRA or QLoRA job: the law is for pretraining from scratch, and no such law for
    /// fine-tuning is published.
    FineTuning(Method),
    /// Pretraining without a token budget: C needs D.
    NeedsBudget,
    /// Pretraining with a budget of `tokens`.
    Law {
        /// M, FLOPs per token.
        flops_per_token: f64,
        tokens: f64,
        optimum: Optimum,
    },
}

/// The advice for `model` trained on `budget` tokens (`training.tokens`, `--tokens`). A budget
/// that is not a finite number above zero reads as none: the spec reader refuses it first.
pub fn advise(model: &Model, budget: Option<f64>) -> Advice {
    if model.training.method != Method::Full {
        return Advice::FineTuning(model.training.method);
    }
    let Some(tokens) = budget.filter(|d| d.is_finite() && *d > 0.0) else {
        return Advice::NeedsBudget;
    };
    let m = flops_per_token(&model.architecture, model.training.seq_len);
    Advice::Law {
        flops_per_token: m,
        tokens,
        optimum: Optimum::at(m * tokens),
    }
}

/// A global batch changed from `from` to `to` sequences, and the learning-rate rules that keep
/// training comparable: linear for SGD-like optimizers (Goyal et al. 2017), square root for
/// Adam-like ones (Malladi et al. 2022; Hoffer et al. 2017).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchChange {
    pub from: u64,
    pub to: u64,
}

impl BatchChange {
    /// k = to / from.
    pub fn ratio(&self) -> f64 {
        self.to as f64 / self.from as f64
    }
    /// The SGD-like rule's learning-rate factor: k (Goyal et al. 2017, "Accurate, Large
    /// Minibatch SGD: Training ImageNet in 1 Hour").
    pub fn linear(&self) -> f64 {
        self.ratio()
    }
    /// The Adam-like rule's factor: √k (Malladi et al. 2022, "On the SDEs and Scaling Rules for
    /// Adaptive Gradient Algorithms"; Hoffer et al. 2017, "Train longer, generalize better").
    pub fn square_root(&self) -> f64 {
        self.ratio().sqrt()
    }

    /// The change and both rules in one line; with the run's peak learning rate `lr`, the rates
    /// each rule gives.
    pub fn describe(&self, lr: Option<f64>) -> String {
        let at = |f: f64| lr.map_or(String::new(), |lr| format!(" = {:.3e}", lr * f));
        format!(
            "global batch {} → {} (×{:.4}): learning-rate rules: linear (Goyal et al. 2017, \
             'Accurate, Large Minibatch SGD') lr × {:.4}{} for SGD-like; square root (Malladi et \
             al. 2022, 'On the SDEs and Scaling Rules for Adaptive Gradient Algorithms'; Hoffer \
             et al. 2017) lr × {:.4}{} for Adam-like",
            self.from,
            self.to,
            self.ratio(),
            self.linear(),
            at(self.linear()),
            self.square_root(),
            at(self.square_root()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Activation, Norm, Position};

    /// A DeepSeek LLM architecture as Table 2 of the paper and the released configs give it:
    /// SwiGLU FFN of 8/3 · d_model rounded (11008 at 7B, 22016 at 67B), RMSNorm, RoPE,
    /// vocabulary 102400, no biases.
    fn deepseek(layers: u64, hidden: u64, heads: u64, kv_heads: u64, ffn: u64) -> Architecture {
        let mut a = Architecture::gpt(layers, hidden, heads, 102_400, 0);
        a.kv_heads = kv_heads;
        a.ffn_hidden = ffn;
        a.activation = Activation::Swiglu;
        a.norm = Norm::Rmsnorm;
        a.position = Position::Rope;
        a.tied_embeddings = false;
        a.bias = false;
        a.qkv_bias = false;
        a
    }

    fn near(got: f64, want: f64, rel: f64) -> bool {
        (got / want - 1.0).abs() <= rel
    }

    // The published settings are the law's at the published budgets: the paper says it chose
    // Table 2's batch sizes and learning rates from §3. Tolerance: 10% on the batch and 5% on
    // the learning rate (Table 2 rounds the rate to two digits and the batch to a multiple of
    // 256 sequences); the figures below were worked out by hand, not by this code.

    #[test]
    fn deepseek_llm_7b_at_2t_tokens_gets_table_2s_batch_and_rate() {
        // 7B: 30 layers, d 4096, 32 heads of 128 (MHA), FFN 11008, l_seq 4096, D = 2.0e12.
        // One layer: attention 4 · 4096² = 67,108,864; SwiGLU 3 · 4096 · 11008 = 135,266,304;
        // two RMSNorms 8,192; sum 202,383,360. 6 · 30 · 202,383,360 = 36,429,004,800.
        // Scores: 12 · 30 · 4096 · 4096 = 6,039,797,760. M = 42,468,802,560.
        let a = deepseek(30, 4096, 32, 32, 11008);
        assert_eq!(flops_per_token(&a, 4096), 42_468_802_560.0);
        // C = 4.24688e10 · 2e12 = 8.49376e22; ln C = 52.7962.
        // B = 0.2920 · e^(0.3271 · 52.7962) = 0.2920 · e^17.2696 = 9.236e6 tokens.
        // η = 0.3118 · e^(−0.125 · 52.7962) = 0.3118 · e^−6.5995 = 4.244e-4.
        let o = Optimum::at(42_468_802_560.0 * 2.0e12);
        assert!(near(o.batch_tokens, 9.236e6, 0.001), "{o:?}");
        assert!(near(o.lr, 4.244e-4, 0.001), "{o:?}");
        // Table 2: 2304 sequences of 4096 = 9,437,184 tokens (the law: 2.1% fewer); 4.2e-4
        // (the law: 1.0% more).
        assert!(near(o.batch_tokens, 2304.0 * 4096.0, 0.10), "{o:?}");
        assert!(near(o.lr, 4.2e-4, 0.05), "{o:?}");
        assert!(!o.fitted(), "8.5e22 is outside 1e17..2e19");
        assert_eq!(o.place(2304.0 * 4096.0), Place::Within);
    }

    #[test]
    fn deepseek_llm_67b_at_2t_tokens_gets_table_2s_batch_and_rate() {
        // 67B: 95 layers, d 8192, 64 query heads and 8 K/V heads of 128 (GQA), FFN 22016.
        // One layer: Q and O 2 · 8192² = 134,217,728; K and V 2 · 8192 · 1024 = 16,777,216;
        // SwiGLU 3 · 8192 · 22016 = 541,065,216; norms 16,384; sum 692,076,544.
        // 6 · 95 · 692,076,544 = 394,483,630,080. Scores: 12 · 95 · 8192 · 4096 =
        // 38,252,052,480. M = 432,735,682,560.
        let a = deepseek(95, 8192, 64, 8, 22016);
        assert_eq!(flops_per_token(&a, 4096), 432_735_682_560.0);
        // C = 4.32736e11 · 2e12 = 8.65471e23; ln C = 55.1176.
        // B = 0.2920 · e^(0.3271 · 55.1176) = 0.2920 · e^18.0290 = 1.9736e7 tokens.
        // η = 0.3118 · e^(−0.125 · 55.1176) = 0.3118 · e^−6.8897 = 3.175e-4.
        let o = Optimum::at(432_735_682_560.0 * 2.0e12);
        assert!(near(o.batch_tokens, 1.9736e7, 0.001), "{o:?}");
        assert!(near(o.lr, 3.175e-4, 0.001), "{o:?}");
        // Table 2: 4608 · 4096 = 18,874,368 tokens (the law: 4.6% more); 3.2e-4 (0.8% less).
        assert!(near(o.batch_tokens, 4608.0 * 4096.0, 0.10), "{o:?}");
        assert!(near(o.lr, 3.2e-4, 0.05), "{o:?}");
    }

    #[test]
    fn the_band_is_a_factor_of_two_each_way() {
        // At C = 1e18: B = 0.2920 · 10^(18 · 0.3271) = 0.2920 · 10^5.8878 = 2.2552e5 tokens.
        let o = Optimum::at(1e18);
        assert!(near(o.batch_tokens, 2.2552e5, 0.001), "{o:?}");
        assert!(o.fitted());
        let b = o.batch_tokens;
        assert_eq!(o.place(b), Place::Within);
        assert_eq!(o.place(b * 1.9), Place::Within);
        assert_eq!(o.place(b / 1.9), Place::Within);
        assert_eq!(o.place(b * 2.1), Place::Above);
        assert_eq!(o.place(b / 2.1), Place::Below);
        assert!(!Optimum::at(5e16).fitted() && !Optimum::at(3e19).fitted());
    }

    #[test]
    fn the_moe_count_is_the_active_parameters() {
        // 2 layers, d 64, 4 MHA heads of 16, both layers MoE with 8 experts of FFN 32, top-2,
        // SwiGLU, RMSNorm, l_seq 8. Per layer: attention 4 · 64² = 16,384; norms 128; router
        // 8 · 64 = 512; one expert 3 · 64 · 32 = 6,144, two = 12,288; active 29,312.
        // 6 · 2 · 29,312 = 351,744; scores 12 · 2 · 64 · 8 = 12,288; M = 364,032. All 8
        // experts would give 6 · 2 · (17,024 + 49,152) = 794,112 + 12,288.
        let mut a = deepseek(2, 64, 4, 4, 128);
        a.moe = Some(crate::model::Moe {
            experts: 8,
            experts_per_token: 2,
            moe_ffn_hidden: 32,
            first_dense_layers: 0,
            moe_layer_frequency: 1,
            moe_layers: None,
            shared_experts: 0,
            shared_expert_ffn_hidden: 32,
            shared_expert_gate: false,
            capacity_factor: None,
            router_aux_loss_coef: 0.01,
            router_scoring: Default::default(),
            router_score_bias: false,
            normalize_top_k: true,
            routed_scaling_factor: 1.0,
            expert_groups: 1,
            expert_groups_per_token: 1,
        });
        assert_eq!(flops_per_token(&a, 8), 364_032.0);
    }

    #[test]
    fn the_square_root_rule_is_the_root_of_k() {
        // 512 → 2048 sequences: k = 4; linear × 4, square root × 2. At lr 3e-4: 1.2e-3 and
        // 6e-4.
        let c = BatchChange {
            from: 512,
            to: 2048,
        };
        assert_eq!((c.ratio(), c.linear(), c.square_root()), (4.0, 4.0, 2.0));
        let text = c.describe(Some(3e-4));
        for part in [
            "global batch 512 → 2048 (×4.0000)",
            "lr × 4.0000 = 1.200e-3 for SGD-like",
            "lr × 2.0000 = 6.000e-4 for Adam-like",
        ] {
            assert!(text.contains(part), "{part} not in {text}");
        }
        // Halving: × 0.5 linear; the square-root factor squares back to 0.5 (0.7071).
        let c = BatchChange { from: 16, to: 8 };
        assert_eq!(c.linear(), 0.5);
        assert!((c.square_root().powi(2) - 0.5).abs() < 1e-15);
        assert!(c.describe(None).contains("lr × 0.7071 for Adam-like"));
    }
}
