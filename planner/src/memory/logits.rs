//! The logits' buffers at the loss's peak, by how the framework computes the loss
//! ([`LossKind`]), over the vocabulary rows it holds ([`crate::model::Architecture::vocab_rows`]).
//!
//! - **Fused** (llm.c `fused_classifier`): no fp32 N × V buffer; the 16-bit logits, whose
//!   gradient the kernel writes in place (`logits_16bit`).
//! - **Compiled** (torch.compile's generated loss): no fp32 N × V buffer either, but two 16-bit
//!   ones at the backward's kernel: the saved logits and the new gradient
//!   (`logits_16bit_grad`). The code Inductor generates for
//!   `F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))` (torch 2.15, for the
//!   CPU; its buffer plan is the graph's, whichever device) saves
//!   `pred` with the rows' max and log-sum-exp, and its backward allocates the bf16 gradient
//!   (`empty_strided(..., torch.bfloat16)`) before the fused kernel that reads `pred`, which it
//!   frees only after.
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
//!   **UnfusedFp32Freed**) peaks 2 B per logit lower. Where the profile runs its loss as
//!   DTensor's `loss_parallel` under TP (`runs.loss_parallel`: torchtitan), the fused
//!   nll/log-softmax backward `(grad_input + exp(x)) * grad_output` holds a fourth fp32
//!   N × V/TP buffer beside an unfused loss's, the exponential (`logits_fp32_exp`).

use crate::framework::LossKind;
use crate::model::Model;

/// How a framework computes its loss: the kind, and whether it runs as `loss_parallel` under
/// TP (the profile's `runs.loss` and `runs.loss_parallel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loss {
    pub kind: LossKind,
    pub parallel: bool,
}

/// The reason of the terms kept for the output layer's backward (today's wording).
pub const KEPT: &str = "kept for the output layer's backward";

/// The logits' buffers on one TP rank for `tokens` tokens: `(name, bytes, why)`.
pub fn terms(
    model: &Model,
    tokens: f64,
    tp: u64,
    loss: Loss,
    pad_vocab: bool,
) -> Vec<(&'static str, f64, &'static str)> {
    let Loss {
        kind: loss,
        parallel,
    } = loss;
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
        LossKind::Compiled => vec![
            (
                "logits_16bit",
                w * logits,
                "the 16-bit logits the compiled loss saves for its backward (no fp32 copy)",
            ),
            (
                "logits_16bit_grad",
                w * logits,
                "the compiled loss's backward writes the logits' 16-bit gradient into a new buffer while the saved logits are alive (Inductor's generated code: the output is allocated, the saved input freed after the kernel)",
            ),
        ],
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
            if parallel && tp > 1 {
                // torchtitan runs its loss under `loss_parallel` whenever TP is on
                // (parallelism.disable_loss_parallel defaults to false): DTensor's
                // `_nll_loss_and_log_softmax_backward` (torch/distributed/tensor/parallel/loss.py)
                // returns `(grad_input + torch.exp(x)) * grad_output`, where `grad_input` is the
                // zeroed N × V/TP tensor and `x` the saved log-softmax: the exponential is a
                // fourth fp32 buffer alive while the sum is written.
                t.push((
                    "logits_fp32_exp",
                    fp32,
                    "loss_parallel's backward: torch.exp of the saved log-softmax, an fp32 N × V/TP temporary alive beside the zeroed gradient while their sum is written (torch/distributed/tensor/parallel/loss.py)",
                ));
            }
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
