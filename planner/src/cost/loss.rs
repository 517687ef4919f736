//! The loss as the framework computes it ([`LossKind`]): the bytes each kind moves per logit and
//! the kernels it launches, forward and backward; and the output layer's GEMMs when the
//! vocabulary is not padded to an aligned width.
//!
//! Byte counts per logit, counted in the kernels each framework runs:
//! - **Fused** (llm.c `train_gpt2.cu` `fused_classifier`: one kernel reads the row of 16-bit
//!   logits for the max and the sum of exponentials, reads it again and writes the gradient in
//!   place): forward 4 (two reads of 2 B), backward 2 (the gradient written over the logits).
//! - **Compiled** (torch.compile's generated loss: one fused reduction forward, one fused
//!   kernel backward, as torch 2.15's Inductor generates them for
//!   `F.cross_entropy(pred.float(), labels)`, read in the code it generates for the CPU; the
//!   GPU's Triton code was not read):
//!   forward 4 (the max and the sum of exponentials over the 16-bit row), backward 4 (the saved
//!   logits read once, the gradient written to a new 16-bit buffer).
//! - **VocabParallelFp32** (Megatron `megatron/core/tensor_parallel/cross_entropy.py` on an
//!   fp32 copy): forward 18 (upcast 2 + 4, log-softmax's reads and write 12), backward 22
//!   (a zeroed gradient 4, the softmax's backward 12, the downcast 4 + 2). Today's charge, kept.
//! - **UnfusedFp32** (PyTorch `F.cross_entropy(logits.float())`, aten's composite
//!   `cross_entropy_loss` = `log_softmax` then `nll_loss`; V × 4 B exceeds the 48 KiB of
//!   shared memory a block gets by default, so `aten/src/ATen/native/cuda/SoftMax.cu` runs
//!   `cunn_SoftMaxForward` and `cunn_SoftMaxBackward`, not their shared-memory variants):
//!   - forward: the upcast reads 2 and writes 4 (6); `cunn_SoftMaxForward` reads the row three
//!     times (`ilpReduce` for the max, `ilpReduce` for the sum of exponentials, then
//!     `WriteFpropResults`) and writes it once (16); `nll_loss` gathers one logit per row
//!     (negligible): **22 B**, 3 kernels;
//!   - backward: `nll_loss_backward` (`aten/src/ATen/native/cuda/Loss.cu`/`LossNLL.cu`) zeroes
//!     an N × V fp32 gradient (4) and scatters −1/N at the targets; `cunn_SoftMaxBackward`
//!     reads the incoming gradient for its sum (4), then reads the saved output and the
//!     gradient and writes the input gradient (12); the downcast's backward reads 4 and writes
//!     2 (6): **26 B**, 4 kernels.
//!
//! Check (../shared/gpu/README.md, one H100, 3350 GB/s): `F.cross_entropy(L.float(), T)
//! .backward()` at 8192 × 50257 took 8.3 ms. 48 B × 411.7 M logits = 19.8 GB, plus the
//! benchmark's own accumulation into `L.grad` (bf16 read 2 + 2, write 2) = 22.2 GB: 2.68 TB/s,
//! 0.80 of the peak (the H100 preset's `memory_efficiency` is 0.726; its device copy measured
//! 0.90). The count is not fitted to it.

use crate::framework::LossKind;

/// What one kind of loss costs per logit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossCost {
    /// Bytes moved per logit in the forward and in the backward.
    pub bytes: (f64, f64),
    /// Kernels launched in the forward and in the backward, besides the GEMMs and the norm.
    pub kernels: (f64, f64),
}

impl LossCost {
    /// The bytes and kernels of `kind` (the counts and their sources are in the module doc).
    pub fn of(kind: LossKind) -> LossCost {
        match kind {
            LossKind::Fused => LossCost {
                bytes: (4.0, 2.0),
                kernels: (1.0, 1.0),
            },
            LossKind::Compiled => LossCost {
                bytes: (4.0, 4.0),
                kernels: (1.0, 1.0),
            },
            LossKind::VocabParallelFp32 => LossCost {
                bytes: (18.0, 22.0),
                kernels: (3.0, 3.0),
            },
            LossKind::UnfusedFp32 | LossKind::UnfusedFp32Freed => LossCost {
                bytes: (22.0, 26.0),
                kernels: (3.0, 4.0),
            },
        }
    }
}

/// cuBLAS's vectorised tensor-core kernels need every leading dimension to be a multiple of 16
/// bytes (NVIDIA, "Matrix Multiplication Background User's Guide", § Tensor Core Requirements:
/// multiples of 8 elements for FP16/BF16; "Linear/Fully-Connected Layers User's Guide" §1:
/// "choose ... the number of inputs and outputs to be divisible by 8"). The logits (N × V) are
/// the output of the forward GEMM and an operand of both backward GEMMs, so all three are
/// unaligned when a rank's vocabulary rows × the element size are not a multiple of this.
pub const ALIGN_BYTES: u64 = 16;

/// The throughput of an unaligned 16-bit GEMM as a fraction of the aligned one: cuBLAS falls
/// back to `align1` kernels. pytorch/pytorch issue #181718 (RTX 4090, bf16 square GEMMs,
/// cuBLAS's own choice): aligned N = 2040 runs 155.9 TFLOP/s (`…_ldg8_…` kernel); the odd
/// N = 2055, 2057, 2071, 2073 run `cutlass_75_…_align1` kernels at 115.6, 106.8, 110.9 and
/// 112.0 TFLOP/s, a mean of 111.3: 0.71 of the aligned rate. A published per-GEMM figure, but
/// on sm_89, not an H100; no H100 measurement of an unaligned GEMM was at hand.
pub const UNALIGNED_GEMM_EFFICIENCY: f64 = 0.71;

/// Whether a GEMM dimension of `cols` elements of `element_bytes` each is 16-byte aligned.
pub fn aligned(cols: u64, element_bytes: u64) -> bool {
    cols.saturating_mul(element_bytes)
        .is_multiple_of(ALIGN_BYTES)
}

/// The factor the output layer's GEMM times take for `rows` vocabulary rows on a rank: 1 where
/// aligned or where the device has no tensor cores, else `1 / UNALIGNED_GEMM_EFFICIENCY`.
pub fn gemm_slowdown(rows: u64, element_bytes: u64, tensor_cores: bool) -> f64 {
    if !tensor_cores || aligned(rows, element_bytes) {
        1.0
    } else {
        1.0 / UNALIGNED_GEMM_EFFICIENCY
    }
}
