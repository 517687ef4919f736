//! Compute time a LoRA or QLoRA layer adds to a frozen block's, per micro-batch on one TP rank:
//! the adapters' thin GEMMs (rank r, timed by the same GEMM model, so their poor efficiency
//! and launch cost are charged as they are), the scale-and-add of each adapter's output, LoRA
//! dropout, and QLoRA's dequantization of every NF4 linear before each of its GEMMs (a
//! memory-bound kernel: read 4 bits and the scales, write the 16-bit weight).
//!
//! The frozen linears themselves run their forward and their input-gradient GEMM only
//! (`ops::layer_cp`); the row-parallel adapters' all-reduce of the rank-r intermediate
//! (t·r elements per adapter) is not modelled.

use super::device::Device;
use crate::finetune::{self, Method};
use crate::model::Model;

/// `(forward, backward)` seconds the adapters of one block add on a TP rank of `tp`, for `t`
/// tokens.
pub fn layer(model: &Model, dev: &Device, tp: u64, t: f64) -> (f64, f64) {
    let Some(l) = model.adapters() else {
        return (0.0, 0.0);
    };
    let a = &model.architecture;
    let w = crate::memory::stored::element_bytes(model);
    let tp = tp.max(1) as f64;
    let r = l.rank as f64;
    let (mut fwd, mut bwd) = (0.0, 0.0);
    for target in &l.targets {
        let (i, o) = target.shape(a);
        let (i, o) = if target.column_parallel() {
            (i as f64, o as f64 / tp)
        } else {
            (i as f64 / tp, o as f64)
        };
        let (af, ab) = dev.linear(t, i, r);
        let (bf, bb) = dev.linear(t, r, o);
        // `result + lora_B(lora_A(x)) * scaling`: the scale (read, write) and the add (read
        // two, write one) on the output; backward scales the output gradient (read, write).
        fwd += af + bf + dev.memory(5.0 * w * t * o) + dev.launches(2.0);
        bwd += ab + bb + dev.memory(2.0 * w * t * o) + dev.launches(1.0);
        if l.dropout > 0.0 {
            // Dropout on A's input: read, write and a 1-byte mask; backward reads the gradient
            // and the mask, writes one.
            fwd += dev.memory((2.0 * w + 1.0) * t * i) + dev.launches(1.0);
            bwd += dev.memory((2.0 * w + 1.0) * t * i) + dev.launches(1.0);
        }
    }
    if model.training.method == Method::Qlora {
        // Each pass that multiplies by a weight (the forward, the input gradient) first
        // dequantizes it: one kernel per linear.
        let linears = match a.activation {
            crate::model::Activation::Gelu => 4.0,
            crate::model::Activation::Swiglu => 5.0,
        };
        let q = finetune::linear_weights(a).per_tp_rank(tp as u64);
        let dequant = dev.memory(q * (finetune::NF4_BYTES_PER_PARAM + w)) + dev.launches(linears);
        fwd += dequant;
        bwd += dequant;
    }
    (fwd, bwd)
}
