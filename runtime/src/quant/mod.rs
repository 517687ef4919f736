//! Quantized storage of frozen weights: QLoRA's NF4 with bitsandbytes' block-wise absmax and
//! double quantization (docs/finetuning.md, "NF4 (QLoRA)"). Checked against bitsandbytes' own
//! code by `tests/nf4_bitsandbytes.rs` (scripts/check_nf4.py). And FP8 E4M3 with tensorwise
//! scaling ([`fp8`]): the CPU reference of the CUDA backend's FP8 linear.

pub mod blockwise8;
pub mod fp8;
pub mod nf4;
pub mod shard;

pub use nf4::{Absmax, Nf4Tensor, BLOCKSIZE, NESTED_BLOCKSIZE, NF4_LEVELS};
pub use shard::{Nf4Shard, Nf4State};

/// Why a tensor cannot be quantized or dequantized.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum QuantError {
    #[error("shape {shape:?} holds {numel} elements but {len} were given")]
    Shape {
        shape: Vec<usize>,
        numel: usize,
        len: usize,
    },
    #[error("shape {shape:?} holds no elements: nothing to quantize")]
    Empty { shape: Vec<usize> },
    #[error("element {index} is {value}: only finite values can be quantized")]
    NonFinite { index: usize, value: f32 },
    #[error("the output buffer holds {len} elements but the tensor has {numel}")]
    OutputLength { numel: usize, len: usize },
    #[error("the tensor's block scales are f32: a shard keeps the double-quantized state (quantize with double_quant)")]
    NotDoubleQuantized,
    #[error("stored NF4 code {index} is {value}, not a 4-bit code 0..=15")]
    NotACode { index: usize, value: f32 },
}
