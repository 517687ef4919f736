//! A rank's share of a tensor quantized to NF4 WHOLE: QLoRA under tensor parallelism.
//!
//! bitsandbytes quantizes an `nn.Linear`'s whole weight, `(out, in)` flattened row-major, in
//! blocks of 64, and double-quantizes the block scales with one mean offset for the tensor and
//! groups of 256 blocks. A TP rank holds a box of that tensor (column-parallel: rows;
//! row-parallel: input columns), whose edges need not fall on block edges (a row-parallel
//! rank of the tiny model's `attn.o` holds 32-element halves of 64-element blocks). So the
//! global tensor is quantized once, exactly as the single rank quantizes it, and each rank
//! keeps the 4-bit codes of its own elements plus the tensor's whole `QuantState` (the 8-bit
//! block codes, the f32 group scales and the offset): 1/64 B per element of the GLOBAL tensor,
//! which TP does not divide. Keeping only the blocks a shard touches would save that
//! (1.5% of a TP-2 rank's NF4 bytes) at the price of a per-layout block map and a checkpoint
//! that no longer holds the state whole (`exec::nf4` writes the state replicated, once).
//!
//! Every element is dequantized with the single rank's arithmetic (the block's absmax as
//! `code × absmax2 + offset`, two f32 roundings, then one f32 product with its level), so a
//! shard's values are exactly the corresponding elements of the whole tensor's dequantization
//! under any layout.

use super::blockwise8::DYNAMIC_MAP;
use super::nf4::{Absmax, Nf4Tensor, BLOCKSIZE, NESTED_BLOCKSIZE, NF4_LEVELS};
use super::QuantError;
use crate::params::ParamInfo;

/// A tensor's double-quantized block scales (bitsandbytes' `QuantState` of `compress_statistics
/// = True`): `absmax[b] = DYNAMIC_MAP[codes[b]] · absmax2[b / 256] + offset`.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4State {
    /// One 8-bit code per block of 64 elements of the whole tensor.
    pub codes: Vec<u8>,
    /// One f32 per 256 blocks.
    pub absmax2: Vec<f32>,
    pub offset: f32,
}

impl Nf4State {
    /// Bytes held: a byte a block, four per group and the offset.
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * self.absmax2.len() + 4
    }

    /// Block `b`'s absmax, as `Nf4Tensor::block_absmax` computes it.
    fn absmax(&self, b: usize) -> f32 {
        DYNAMIC_MAP[self.codes[b] as usize] * self.absmax2[b / NESTED_BLOCKSIZE] + self.offset
    }
}

/// One rank's box of a tensor stored in NF4: the codes of its elements (two a byte, in the
/// box's row-major order, the first in the high nibble as bitsandbytes packs) and the whole
/// tensor's [`Nf4State`].
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4Shard {
    packed: Vec<u8>,
    numel: usize,
    pub state: Nf4State,
}

fn pack(codes: impl ExactSizeIterator<Item = u8>) -> Vec<u8> {
    let mut packed = vec![0u8; codes.len().div_ceil(2)];
    for (i, c) in codes.enumerate() {
        packed[i / 2] |= if i.is_multiple_of(2) { c << 4 } else { c };
    }
    packed
}

impl Nf4Shard {
    /// The box `info` describes of `whole` (quantized with double quantization).
    pub fn of(whole: &Nf4Tensor, info: &ParamInfo) -> Result<Self, QuantError> {
        let Absmax::Double {
            codes,
            absmax2,
            offset,
        } = whole.absmax()
        else {
            return Err(QuantError::NotDoubleQuantized);
        };
        let numel = info.shard_shape.iter().product();
        let global: Vec<usize> = info.runs().flat_map(|(_, g, n)| g..g + n).collect();
        if global.len() != numel || whole.shape() != info.global_shape.as_slice() {
            return Err(QuantError::Shape {
                shape: whole.shape().to_vec(),
                numel: whole.numel(),
                len: global.len(),
            });
        }
        Ok(Nf4Shard {
            packed: pack(global.iter().map(|&g| whole.code(g))),
            numel,
            state: Nf4State {
                codes: codes.clone(),
                absmax2: absmax2.clone(),
                offset: *offset,
            },
        })
    }

    /// A shard from stored codes (one a value, `0..16`, in the box's order) and state, as a
    /// checkpoint holds them; refuses a code that is not a 4-bit value.
    pub fn from_codes(codes: &[f32], state: Nf4State) -> Result<Self, QuantError> {
        if let Some(index) = codes
            .iter()
            .position(|&c| !(0.0..16.0).contains(&c) || c.fract() != 0.0)
        {
            return Err(QuantError::NotACode {
                index,
                value: codes[index],
            });
        }
        Ok(Nf4Shard {
            packed: pack(codes.iter().map(|&c| c as u8)),
            numel: codes.len(),
            state,
        })
    }

    /// The 4-bit code of the box's element `i`.
    pub fn code(&self, i: usize) -> u8 {
        super::nf4::unpack(&self.packed, i)
    }

    /// Elements of the box.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Bytes this rank holds for the tensor: its packed codes and the whole state.
    pub fn bytes(&self) -> usize {
        self.packed.len() + self.state.bytes()
    }

    /// Dequantizes the box `info` describes into `out` (`numel` elements, row-major in the
    /// box): each element is the whole tensor's dequantized element of the same global index.
    pub fn dequantize_into(&self, info: &ParamInfo, out: &mut [f32]) -> Result<(), QuantError> {
        if out.len() != self.numel {
            return Err(QuantError::OutputLength {
                numel: self.numel,
                len: out.len(),
            });
        }
        // Runs are short (a row's part) and blocks straddle them: the block's absmax is
        // recomputed where it changes, with the same two roundings each time.
        let mut block = (usize::MAX, 0.0f32);
        for (l, g, n) in info.runs() {
            for j in 0..n {
                let b = (g + j) / BLOCKSIZE;
                if b != block.0 {
                    block = (b, self.state.absmax(b));
                }
                out[l + j] = NF4_LEVELS[self.code(l + j) as usize] * block.1;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::{Init, ParamLayout, ParamSpec, Shard};
    use crate::testutil::randn;

    fn info(shape: [usize; 2], shard: Shard) -> ParamInfo {
        let mut l = ParamLayout::new();
        l.add(ParamSpec {
            name: "w".into(),
            global_shape: shape.to_vec(),
            shard,
            decay: true,
            init: Init::Const(0.0),
        })
        .unwrap();
        l.entries()[0].clone()
    }

    /// Every TP box of tensors whose rows do not fall on block edges (48 and 32 columns split
    /// in 2 and 4), with more than 256 blocks (two groups): the shards' values are the whole
    /// tensor's, bit for bit. Quantizing each shard on its own would give other block scales.
    #[test]
    fn shards_dequantize_to_the_whole_tensors_elements() {
        for (shape, parts) in [([400, 48], 2), ([520, 32], 4), ([64, 64], 2)] {
            let n = shape[0] * shape[1];
            let data = randn(n, 7, 1.0);
            let whole = Nf4Tensor::quantize(&data, &shape, true).unwrap();
            let want = whole.dequantize();
            for dim in 0..2 {
                let mut rebuilt = vec![f32::NAN; n];
                for rank in 0..parts {
                    let e = info(shape, Shard::Split { dim, rank, parts });
                    let s = Nf4Shard::of(&whole, &e).unwrap();
                    let mut got = vec![0.0; e.len];
                    s.dequantize_into(&e, &mut got).unwrap();
                    e.copy_shard_to_global(&got, &mut rebuilt);
                    let blocks = n.div_ceil(BLOCKSIZE);
                    let state = blocks + 4 * blocks.div_ceil(NESTED_BLOCKSIZE) + 4;
                    assert_eq!(s.bytes(), e.len / 2 + state, "{shape:?}");
                    // The state survives a checkpoint's f32 codes.
                    let codes: Vec<f32> = (0..e.len).map(|i| f32::from(s.code(i))).collect();
                    assert_eq!(Nf4Shard::from_codes(&codes, s.state.clone()).unwrap(), s);
                }
                let same = rebuilt
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{shape:?} split on {dim} into {parts}");
            }
        }
    }

    #[test]
    fn refusals() {
        let whole = Nf4Tensor::quantize(&randn(128, 1, 1.0), &[2, 64], false).unwrap();
        let e = info([2, 64], Shard::Replicated);
        assert_eq!(
            Nf4Shard::of(&whole, &e),
            Err(QuantError::NotDoubleQuantized)
        );
        let state = Nf4State {
            codes: vec![0],
            absmax2: vec![1.0],
            offset: 0.0,
        };
        assert_eq!(
            Nf4Shard::from_codes(&[3.0, 16.0], state),
            Err(QuantError::NotACode {
                index: 1,
                value: 16.0
            })
        );
    }
}
