//! NF4 (4-bit NormalFloat), QLoRA's storage of frozen base weights (Dettmers et al., "QLoRA",
//! 2023, Appendix E), in bitsandbytes' layout: blocks of 64 elements in row-major order, each
//! scaled by its absmax; two codes a byte, the first in the high nibble; the absmax values kept
//! as f32, or double-quantized (their mean subtracted, then 8-bit codes in blocks of 256 with
//! an f32 absmax each: [`super::blockwise8`]).
//!
//! The rounding is bitsandbytes 0.50.2's on the CPU (`quantize_4bit` of
//! bitsandbytes/backends/default/ops.py; the CPU backend registers no kernel of its own):
//! a full block is scaled by `x * (1 / max(absmax, 1e-38))`, a last, partial block by
//! `x / max(absmax, 1e-38)` (and keeps that clamped absmax), the result clamped to [-1, 1];
//! its code is the number of midpoints between adjacent levels (f32 `(a + b) / 2`) strictly
//! below it (`torch.bucketize`, `right=False`), so a value exactly on a midpoint takes the
//! lower level. (bitsandbytes' CUDA kernel compares with f32 literals of the same midpoints,
//! four of them one ulp away: the tests name them.) An odd element count is padded with a 0.0,
//! code 7, in the last low nibble. Dequantization is one f32 product, level × absmax, where
//! the double-quantized absmax is first `code × absmax2` then `+ offset` (two roundings, as
//! torch computes them).

use super::blockwise8;
use super::QuantError;

/// The 16 NF4 levels, in code order. Copied from bitsandbytes 0.50.2,
/// bitsandbytes/functional.py `get_4bit_type("nf4")` (the same values, as f32 literals, in
/// csrc/cpu_ops.cpp `nf4_lut` and csrc/kernels.cu `dDequantizeNF4`). Each is exactly an f32.
#[allow(clippy::excessive_precision)]
pub const NF4_LEVELS: [f32; 16] = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
];

/// Elements per NF4 block (QLoRA's and bitsandbytes' default).
pub const BLOCKSIZE: usize = 64;
/// NF4 blocks per block of the double quantization (bitsandbytes' `blocksize=256`).
pub const NESTED_BLOCKSIZE: usize = 256;
/// bitsandbytes' floor on a block's absmax before dividing by it (`clamp(min=1e-38)`, an f32
/// subnormal).
const ABSMAX_FLOOR: f32 = 1e-38_f64 as f32;

/// Bytes of the tables bitsandbytes stores with every tensor: `quant_map`, the 16 f32 levels.
const QUANT_MAP_BYTES: usize = 16 * 4;
/// With double quantization also `nested_quant_map` (256 f32) and the f32 offset.
const NESTED_TABLE_BYTES: usize = 256 * 4 + 4;

/// The scale of each NF4 block.
#[derive(Debug, Clone, PartialEq)]
pub enum Absmax {
    /// One f32 per block (`compress_statistics=False`).
    F32(Vec<f32>),
    /// Double quantization (`compress_statistics=True`): block `b`'s absmax is
    /// `blockwise8::DYNAMIC_MAP[codes[b]] * absmax2[b / 256] + offset`.
    Double {
        /// One 8-bit code of the dynamic map per block.
        codes: Vec<u8>,
        /// One f32 per 256 blocks: the absmax of (absmax - offset) over them.
        absmax2: Vec<f32>,
        /// The mean of the blocks' absmax values, subtracted before the 8-bit quantization.
        offset: f32,
    },
}

/// A tensor stored in NF4. See the module documentation for the format.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4Tensor {
    packed: Vec<u8>,
    blocksize: usize,
    numel: usize,
    shape: Vec<usize>,
    absmax: Absmax,
}

/// The code of a value already scaled into [-1, 1]: how many midpoints lie strictly below it.
fn code_of(scaled: f32, midpoints: &[f32; 15]) -> u8 {
    midpoints.iter().take_while(|&&m| m < scaled).count() as u8
}

fn midpoints() -> [f32; 15] {
    std::array::from_fn(|i| (NF4_LEVELS[i] + NF4_LEVELS[i + 1]) / 2.0)
}

impl Nf4Tensor {
    /// Quantizes `data` (row-major, `shape`) into NF4 blocks of 64 as bitsandbytes'
    /// `quantize_4bit(data, blocksize=64, quant_type="nf4", compress_statistics=double_quant)`
    /// does on the CPU. A last block shorter than 64 is scaled by its own absmax. Refuses a
    /// shape that does not hold `data.len()` elements, an empty tensor and a value that is not
    /// finite.
    pub fn quantize(data: &[f32], shape: &[usize], double_quant: bool) -> Result<Self, QuantError> {
        let numel: usize = shape.iter().product();
        if numel != data.len() {
            return Err(QuantError::Shape {
                shape: shape.to_vec(),
                numel,
                len: data.len(),
            });
        }
        if numel == 0 {
            return Err(QuantError::Empty {
                shape: shape.to_vec(),
            });
        }
        if let Some(index) = data.iter().position(|v| !v.is_finite()) {
            return Err(QuantError::NonFinite {
                index,
                value: data[index],
            });
        }
        let mid = midpoints();
        let mut codes = Vec::with_capacity(numel + 1);
        let mut absmax = Vec::with_capacity(numel.div_ceil(BLOCKSIZE));
        for block in data.chunks(BLOCKSIZE) {
            let am = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            if block.len() == BLOCKSIZE {
                let inv = 1.0 / am.max(ABSMAX_FLOOR);
                codes.extend(
                    block
                        .iter()
                        .map(|&v| code_of((v * inv).clamp(-1.0, 1.0), &mid)),
                );
                absmax.push(am);
            } else {
                let am = am.max(ABSMAX_FLOOR);
                codes.extend(
                    block
                        .iter()
                        .map(|&v| code_of((v / am).clamp(-1.0, 1.0), &mid)),
                );
                absmax.push(am);
            }
        }
        if !codes.len().is_multiple_of(2) {
            codes.push(code_of(0.0, &mid));
        }
        let packed = codes.chunks(2).map(|p| (p[0] << 4) | p[1]).collect();
        let absmax = if double_quant {
            let offset = blockwise8::torch_mean(&absmax);
            let centered: Vec<f32> = absmax.iter().map(|&a| a - offset).collect();
            let (codes, absmax2) = blockwise8::quantize_blockwise(&centered, NESTED_BLOCKSIZE);
            Absmax::Double {
                codes,
                absmax2,
                offset,
            }
        } else {
            Absmax::F32(absmax)
        };
        Ok(Nf4Tensor {
            packed,
            blocksize: BLOCKSIZE,
            numel,
            shape: shape.to_vec(),
            absmax,
        })
    }

    /// The tensor in f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.numel];
        self.dequantize_into(&mut out)
            .expect("the buffer has numel elements");
        out
    }

    /// Dequantizes into `out`, which must hold exactly `numel` elements.
    pub fn dequantize_into(&self, out: &mut [f32]) -> Result<(), QuantError> {
        if out.len() != self.numel {
            return Err(QuantError::OutputLength {
                numel: self.numel,
                len: out.len(),
            });
        }
        let absmax = self.block_absmax();
        for (b, (block, &am)) in out.chunks_mut(self.blocksize).zip(&absmax).enumerate() {
            let first = b * self.blocksize;
            for (j, o) in block.iter_mut().enumerate() {
                *o = NF4_LEVELS[self.code(first + j) as usize] * am;
            }
        }
        Ok(())
    }

    /// Each block's absmax as dequantization uses it (for double quantization, recovered from
    /// its 8-bit code, the second-level absmax and the offset).
    pub fn block_absmax(&self) -> Vec<f32> {
        match &self.absmax {
            Absmax::F32(a) => a.clone(),
            Absmax::Double {
                codes,
                absmax2,
                offset,
            } => blockwise8::dequantize_blockwise(codes, absmax2, NESTED_BLOCKSIZE)
                .into_iter()
                .map(|a| a + offset)
                .collect(),
        }
    }

    /// The 4-bit code of element `i` (row-major).
    pub fn code(&self, i: usize) -> u8 {
        unpack(&self.packed, i)
    }

    /// Bytes as bitsandbytes stores the tensor (`Params4bit` with `QuantState.as_dict`): the
    /// packed codes (`ceil(numel / 2)`), the absmax (4 bytes a block, or 1 with double
    /// quantization plus 4 per 256 blocks), the 16-level `quant_map`, and with double
    /// quantization the 256-entry `nested_quant_map` and the f32 offset. The JSON of shape,
    /// dtype and block sizes bitsandbytes also writes is not counted.
    pub fn storage_bytes(&self) -> usize {
        let scales = match &self.absmax {
            Absmax::F32(a) => 4 * a.len(),
            Absmax::Double { codes, absmax2, .. } => {
                codes.len() + 4 * absmax2.len() + NESTED_TABLE_BYTES
            }
        };
        self.packed.len() + scales + QUANT_MAP_BYTES
    }

    /// The packed codes, two a byte, element `2k` in the high nibble of byte `k`.
    pub fn packed(&self) -> &[u8] {
        &self.packed
    }

    /// The block scales as stored.
    pub fn absmax(&self) -> &Absmax {
        &self.absmax
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn numel(&self) -> usize {
        self.numel
    }

    pub fn blocksize(&self) -> usize {
        self.blocksize
    }
}

/// The 4-bit code of element `i` of `packed` (two a byte, the first in the high nibble, as
/// bitsandbytes packs them).
pub(super) fn unpack(packed: &[u8], i: usize) -> u8 {
    let byte = packed[i / 2];
    if i.is_multiple_of(2) {
        byte >> 4
    } else {
        byte & 0x0f
    }
}

#[cfg(test)]
#[path = "nf4_tests.rs"]
mod tests;
