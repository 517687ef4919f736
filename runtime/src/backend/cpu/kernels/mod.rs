//! CPU backend kernels, f32, row-major: the reference every other backend is tested against.
//!
//! Kernels come in pairs `x_forward` / `x_backward` (llm.c style) and work on plain slices with
//! their shapes in comments; they allocate nothing except where noted. Conventions:
//! - parameter gradients (`dweight`, `dbias`, embedding rows) are ACCUMULATED (`+=`), so
//!   micro-batches add up without extra passes;
//! - input gradients are OVERWRITTEN (`=`) unless the doc says `+=` (norms accumulate into
//!   `dinp` so the residual gradient can be pre-loaded).
//!
//! Kernels must not communicate, know about ranks, or read parameters from anywhere but their
//! arguments. Determinism: every reduction runs in a fixed order, so the same call on the same
//! inputs gives the same bits (recompute relies on this).
#![allow(clippy::too_many_arguments)]

pub mod act;
pub mod adamw;
pub mod attention;
pub mod attention_dropout;
pub mod crossentropy;
pub mod embedding;
pub mod matmul;
pub mod norm;
pub mod ring_attention;
pub mod rope;
pub mod rows;
pub mod vmath;

pub use act::{gelu_backward, gelu_forward, swiglu_backward, swiglu_forward};
pub use adamw::adamw_update;
pub use attention::{
    attention_backward, attention_forward, attention_probs, attention_scratch_len,
    attention_values, AttnShape,
};
pub use crossentropy::{
    crossentropy_backward, crossentropy_forward, row_max, row_sumexp, target_logit,
};
pub use embedding::{
    embedding_backward, embedding_forward, pos_embedding_backward, pos_embedding_forward,
};
pub use matmul::{
    add_bias, bias_backward, gemm, matmul, matmul_at, matmul_bt, set_threads, MatMut, MatRef,
};
pub use norm::{layernorm_backward, layernorm_forward, rmsnorm_backward, rmsnorm_forward};
pub use rope::{rope_backward, rope_forward, rope_inv_freq, rope_tables, rope_tables_scaled};
pub use rows::{gather_rows, scatter_add_rows};

/// Σ a·b with 8 independent lanes (vectorises; fixed order, so deterministic).
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    lanes(acc) + tail
}

/// Σ a with 8 independent lanes.
#[inline]
pub(crate) fn sum(a: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let c = a.chunks_exact(8);
    let tail: f32 = c.remainder().iter().sum();
    for x in c {
        for i in 0..8 {
            acc[i] += x[i];
        }
    }
    lanes(acc) + tail
}

#[inline]
fn lanes(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}
