//! The logits' buffers at the loss's peak, by how the framework computes the loss
//! ([`LossKind`]), over the vocabulary rows it holds ([`crate::model::Architecture::vocab_rows`]).
//!
//! - **Fused** (llm.c `fused_classifier`, torch.compile's generated loss): no fp32 N × V buffer;
//!   the 16-bit logits, whose gradient the kernel writes in place (`logits_16bit`).
//! - **VocabParallelFp32** (Megatron's `cross_entropy.py`): one fp32 N × V/TP buffer, the
//!   softmax computed in place in the fp32 copy and kept for the backward (`logits_fp32`, the
//!   name and the bytes of today's term).
//! - **UnfusedFp32** (PyTorch's `F.cross_entropy(logits.float())`): when
//!   `log_softmax_backward` runs (aten `cunn_SoftMaxBackward`), three fp32 N × V buffers are
//!   alive: the log-softmax output autograd saved (`logits_fp32`), the gradient
//!   `nll_loss_backward` wrote into a zeroed N × V tensor (`logits_fp32_grad`), and the input
//!   gradient being written (`logits_fp32_grad_input`); the fp32 upcast itself is freed after
//!   the forward (the conversion saves no input). Plus the 16-bit logits (`logits_16bit`),
//!   which a training loop that keeps them through the backward holds (nanoGPT's
//!   `logits, loss = model(X, Y)`); a loop that frees them first (torchtitan's `del pred`:
//!   **UnfusedFp32Freed**) peaks 2 B per logit lower.

use crate::framework::LossKind;
use crate::model::Model;

/// The reason of the terms kept for the output layer's backward (today's wording).
pub const KEPT: &str = "kept for the output layer's backward";

/// The logits' buffers on one TP rank for `tokens` tokens: `(name, bytes, why)`.
pub fn terms(
    model: &Model,
    tokens: f64,
    tp: u64,
    loss: LossKind,
    pad_vocab: bool,
) -> Vec<(&'static str, f64, &'static str)> {
    let rows = (model.architecture.vocab_rows(tp, pad_vocab) / tp.max(1)) as f64;
    let logits = tokens * rows;
    let w = super::stored::element_bytes(model);
    let fp32 = 4.0 * logits;
    match loss {
        LossKind::Fused => vec![(
            "logits_16bit",
            w * logits,
            "the 16-bit logits; the fused loss writes their gradient in place (no fp32 copy)",
        )],
        LossKind::VocabParallelFp32 => vec![("logits_fp32", fp32, KEPT)],
        LossKind::UnfusedFp32 | LossKind::UnfusedFp32Freed => {
            let mut t = vec![
            (
                "logits_fp32",
                fp32,
                "the fp32 log-softmax output autograd saves for the backward (F.cross_entropy on an fp32 upcast)",
            ),
            (
                "logits_fp32_grad",
                fp32,
                "nll_loss's backward: the fp32 gradient of the log-softmax, a zeroed N × V tensor, alive while log_softmax's backward runs",
            ),
            (
                "logits_fp32_grad_input",
                fp32,
                "log_softmax's backward: the fp32 gradient of the upcast logits, written while its two inputs are alive",
            ),
            ];
            if loss == LossKind::UnfusedFp32 {
                t.push((
                    "logits_16bit",
                    w * logits,
                    "the output layer's 16-bit logits, held by the training loop through the backward",
                ));
            }
            t
        }
    }
}
