//! Model states of a fine-tune with adapters (`lora`, `qlora`): the adapters carry the
//! precision policy's full state; the frozen base carries only its weights, with no gradient,
//! master copy or optimizer state: 16-bit (the policy's weight width: f32 on the CPU backend),
//! or, under QLoRA, the blocks' linear weights in NF4 with bitsandbytes' double quantization
//! and the rest (embeddings, norms, biases, the output head) in the weight width. ZeRO-3 (FSDP)
//! shards the frozen base over the data-parallel group; below it every rank holds it whole.

use crate::finetune::{self, Lora, Method};
use crate::layout::Layout;
use crate::model::{Architecture, Model};
use crate::precision::{Policy, StateClass, Term};

/// Per-parameter bytes of a fine-tune's states on one rank.
pub(crate) struct Adapters<'a> {
    pub lora: &'a Lora,
    pub method: Method,
    /// The trainable states: the policy's, with the optimizer's moments as the job keeps them.
    pub terms: Vec<Term>,
    /// Bytes per trainable parameter, ZeRO applied.
    pub trainable_bpp: f64,
    /// Bytes per frozen 16-bit (or f32) weight, ZeRO-3 applied.
    pub frozen_bpp: f64,
    /// Bytes per NF4 weight, ZeRO-3 applied.
    pub nf4_bpp: f64,
    /// The weights' width (2, or 4 on the CPU backend).
    pub weight_bytes: f64,
    /// The CPU runtime: each TP rank keeps the codes of its shard and the whole tensor's
    /// block scales (its `QuantState`), which TP does not divide (runtime/src/quant/shard.rs).
    pub nf4_state_whole: bool,
}

impl<'a> Adapters<'a> {
    /// `None` for a full fine-tune.
    pub fn of(model: &'a Model, policy: &Policy, zero: u8, shard: u64, cpu: bool) -> Option<Self> {
        let method = model.training.method;
        let lora = model.adapters()?;
        let terms = policy.terms(model.training.optimizer_states);
        let trainable_bpp = terms.iter().map(|t| per_term(t, zero, shard)).sum();
        let weight_bytes = f64::from(policy.class_bytes(StateClass::Param));
        let base_shard = if zero >= 3 { shard.max(1) as f64 } else { 1.0 };
        Some(Adapters {
            lora,
            method,
            terms,
            trainable_bpp,
            frozen_bpp: weight_bytes / base_shard,
            nf4_bpp: finetune::NF4_BYTES_PER_PARAM / base_shard,
            weight_bytes,
            nf4_state_whole: cpu,
        })
    }

    /// Bytes of `q` NF4 weights of a TP rank (of `tp`), ZeRO-3 applied: 4 bits each plus the
    /// block scales, of the rank's elements, or on the CPU runtime of the whole tensors'.
    pub fn nf4_bytes(&self, q: f64, tp: u64) -> f64 {
        match self.nf4_state_whole {
            false => q * self.nf4_bpp,
            true => {
                let scales = finetune::NF4_BYTES_PER_PARAM - 0.5;
                (q * 0.5 + q * tp.max(1) as f64 * scales) * self.nf4_bpp
                    / finetune::NF4_BYTES_PER_PARAM
            }
        }
    }

    /// Adapter parameters of one block on a TP rank.
    pub fn layer_trainable(&self, a: &Architecture, tp: u64) -> f64 {
        self.lora.layer_params(a).per_tp_rank(tp)
    }

    /// The frozen base of one block on a TP rank: `(16-bit params, NF4 params)`.
    pub fn layer_frozen(&self, a: &Architecture, tp: u64) -> (f64, f64) {
        let all = a.layer_params().per_tp_rank(tp);
        match self.method {
            Method::Qlora => {
                let q = finetune::linear_weights(a).per_tp_rank(tp);
                (all - q, q)
            }
            _ => (all, 0.0),
        }
    }

    /// Bytes of one block's states on a TP rank.
    pub fn layer_bytes(&self, a: &Architecture, tp: u64) -> f64 {
        let (w, q) = self.layer_frozen(a, tp);
        self.layer_trainable(a, tp) * self.trainable_bpp
            + w * self.frozen_bpp
            + self.nf4_bytes(q, tp)
    }

    /// Bytes per frozen routed-expert weight: ZeRO-3 shards the experts over the
    /// expert-data-parallel group of `eshard` ranks.
    pub fn expert_bpp(&self, zero: u8, eshard: u64) -> f64 {
        match zero >= 3 {
            true => self.weight_bytes / eshard.max(1) as f64,
            false => self.weight_bytes,
        }
    }

    /// Bytes of one MoE block's states on a rank: the adapters (on attention), its frozen dense
    /// part `common` (attention, router, shared experts, norms) and its frozen routed `experts`.
    pub fn moe_layer_bytes(
        &self,
        a: &Architecture,
        tp: u64,
        (common, experts): (f64, f64),
        zero: u8,
        eshard: u64,
    ) -> f64 {
        self.layer_trainable(a, tp) * self.trainable_bpp
            + common * self.frozen_bpp
            + experts * self.expert_bpp(zero, eshard)
    }

    /// The weights ZeRO-3 gathers for one block (the current and the prefetched one), with no
    /// gradient to hold: the frozen base in its stored widths, and the adapters' weights. An
    /// MoE block's frozen weights are `moe_block` when larger than a dense block's.
    pub fn gathered_layers(&self, a: &Architecture, tp: u64, moe_block: f64) -> f64 {
        let (w, q) = self.layer_frozen(a, tp);
        let w = w.max(moe_block);
        2.0 * (w * self.weight_bytes
            + q * finetune::NF4_BYTES_PER_PARAM
            + self.layer_trainable(a, tp) * self.weight_bytes)
    }

    /// QLoRA's transient: the largest linear of a block dequantized into the activations'
    /// width, once at a time (0 for LoRA).
    pub fn dequantized(&self, model: &Model, layout: &Layout) -> f64 {
        if self.method != Method::Qlora {
            return 0.0;
        }
        finetune::largest_linear(&model.architecture, layout.tp)
            * super::stored::element_bytes(model)
    }
}

/// Bytes per parameter one rank keeps of a state under ZeRO over `shard` ranks (as
/// [`super::per_param`] for a policy's whole-byte states).
pub(crate) fn per_term(t: &Term, zero: u8, shard: u64) -> f64 {
    if zero >= t.class.sharded_from_stage() {
        t.bytes / shard as f64
    } else {
        t.bytes
    }
}
