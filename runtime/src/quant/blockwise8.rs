//! bitsandbytes' 8-bit block-wise quantization with its dynamic map, as QLoRA's double
//! quantization uses it for the NF4 block absmax values (`compress_statistics=True`), and the
//! f32 mean that sets the offset subtracted first.
//!
//! Three things are reproduced bit for bit from bitsandbytes 0.50.2 on the CPU (x86-64 wheel):
//! - the code table, `create_dynamic_map(signed=True)` (bitsandbytes/functional.py) as torch
//!   computes it on the CPU in f32 (its `torch.linspace` is part of the values);
//! - the rounding to a code, `quantize_cpu_impl` in csrc/cpu_ops.cpp: not the nearest code but a
//!   65536-entry table over [-1, 1] built from the codes' midpoints, indexed by
//!   `(uint16)((v + 1) * 0.5 * 65535 + 0.5)`, whose last two operations the wheel's compiler
//!   fused into one FMA (`vfmadd213ss` in `libbitsandbytes_cpu.so`; `f32::mul_add` here; for
//!   every f32 in [-1, 1] the index is the same as with two roundings, checked exhaustively);
//! - `torch.mean` of an f32 tensor on the CPU, which bitsandbytes takes as the offset: torch's
//!   `cascade_sum` (aten/src/ATen/native/cpu/SumKernel.cpp) over 8-lane vectors (the AVX2 and
//!   default dispatch; AVX-512 uses 16), on one thread, then one f32 division by the count.
//!   Torch splits a sum of more than 32768 elements across threads, so bitsandbytes' own offset
//!   for a tensor of more than 32768 NF4 blocks depends on its thread count; this is its value
//!   with one thread.
//!
//! bitsandbytes' CUDA kernels round to the nearest code instead; the two agree except near the
//! table's bins (mostly for values near zero, where the codes are finer than the table).

use std::sync::OnceLock;

/// The positive half of the dynamic map (indices 128..=254), as f32 bits. Dumped from
/// `bitsandbytes.functional.create_dynamic_map()` (bitsandbytes 0.50.2, torch 2.15 CPU);
/// `scripts/check_nf4.py` reports the map bitsandbytes used and `tests/nf4_bitsandbytes.rs`
/// asserts it equals [`DYNAMIC_MAP`].
#[rustfmt::skip]
const DYNAMIC_POSITIVE: [u32; 127] = [
    0x3513_a3b7, 0x365a_1a94, 0x3702_05ff, 0x37b2_4206, 0x3837_8034, 0x388a_efb3, 0x38ba_1f4b,
    0x3923_d70b, 0x398c_e705, 0x39c7_e283, 0x3a01_6f01, 0x3a1e_ecc1, 0x3a3c_6a80, 0x3a59_e83e,
    0x3a77_65ff, 0x3aa7_ef9d, 0x3af1_a9fc, 0x3b1d_b22d, 0x3b42_8f5c, 0x3b67_6c8a, 0x3b86_24dd,
    0x3b98_9374, 0x3bab_020d, 0x3bbd_70a4, 0x3bcf_df3b, 0x3be2_4dd3, 0x3bf4_bc6a, 0x3c03_9581,
    0x3c0c_cccd, 0x3c16_0418, 0x3c1f_3b64, 0x3c3a_e148, 0x3c68_f5c3, 0x3c8b_851f, 0x3ca2_8f5d,
    0x3cb9_999a, 0x3cd0_a3d7, 0x3ce7_ae15, 0x3cfe_b852, 0x3d0a_e148, 0x3d16_6667, 0x3d21_eb85,
    0x3d2d_70a3, 0x3d38_f5c3, 0x3d44_7ae1, 0x3d50_0000, 0x3d5b_851f, 0x3d67_0a3d, 0x3d72_8f5d,
    0x3d7e_147b, 0x3d84_cccd, 0x3d8a_8f5d, 0x3d90_51eb, 0x3d96_147b, 0x3d9b_d70a, 0x3da1_999a,
    0x3da7_5c2a, 0x3dad_1eb8, 0x3db2_e148, 0x3db8_a3d7, 0x3dbe_6667, 0x3dc4_28f7, 0x3dc9_eb85,
    0x3ddb_3334, 0x3df8_0000, 0x3e0a_6666, 0x3e18_cccd, 0x3e27_3333, 0x3e35_999a, 0x3e44_0000,
    0x3e52_6666, 0x3e60_cccd, 0x3e6f_3333, 0x3e7d_9999, 0x3e86_0000, 0x3e8d_3334, 0x3e94_6666,
    0x3e9b_999a, 0x3ea2_cccc, 0x3eaa_0000, 0x3eb1_3333, 0x3eb8_6666, 0x3ebf_999a, 0x3ec6_cccc,
    0x3ece_0000, 0x3ed5_3333, 0x3edc_6666, 0x3ee3_999a, 0x3eea_cccc, 0x3ef2_0000, 0x3ef9_3332,
    0x3f00_3333, 0x3f03_cccc, 0x3f07_6666, 0x3f0b_0000, 0x3f0e_999a, 0x3f12_3334, 0x3f15_cccd,
    0x3f19_6666, 0x3f1d_0000, 0x3f20_999a, 0x3f24_3334, 0x3f27_cccd, 0x3f2b_6666, 0x3f2f_0000,
    0x3f32_999a, 0x3f36_3334, 0x3f39_cccd, 0x3f3d_6666, 0x3f41_0000, 0x3f44_999a, 0x3f48_3333,
    0x3f4b_cccd, 0x3f4f_6666, 0x3f53_0000, 0x3f56_999a, 0x3f5a_3333, 0x3f5d_cccd, 0x3f61_6666,
    0x3f65_0000, 0x3f68_999a, 0x3f6c_3333, 0x3f6f_cccd, 0x3f73_6666, 0x3f77_0000, 0x3f7a_999a,
    0x3f7e_3333,
];

const fn dynamic_map() -> [f32; 256] {
    let mut map = [0.0f32; 256];
    let mut i = 0;
    while i < 127 {
        map[128 + i] = f32::from_bits(DYNAMIC_POSITIVE[i]);
        map[126 - i] = f32::from_bits(DYNAMIC_POSITIVE[i] | 0x8000_0000);
        i += 1;
    }
    map[255] = 1.0;
    map
}

/// bitsandbytes' signed dynamic 8-bit map, sorted: 127 negative codes (the most negative
/// -0.99296875), 0.0 at index 127, the 127 positive codes mirrored, and 1.0 at index 255.
pub const DYNAMIC_MAP: [f32; 256] = dynamic_map();

/// Size of bitsandbytes' table from a normalized value to a code (`kLUTSize`).
const LUT_SIZE: usize = 65536;

/// The table bitsandbytes' CPU kernel builds (`build_quantize_lut`): entry `i` stands for
/// `-1 + 2i/65535` and holds the number of midpoints between adjacent codes below it.
fn lut() -> &'static [u8] {
    static LUT: OnceLock<Vec<u8>> = OnceLock::new();
    LUT.get_or_init(|| {
        let mid: Vec<f32> = DYNAMIC_MAP
            .windows(2)
            .map(|w| 0.5 * (w[0] + w[1]))
            .collect();
        let mut code = 0usize;
        (0..LUT_SIZE)
            .map(|i| {
                let val = -1.0 + (2.0 * i as f32) / (LUT_SIZE - 1) as f32;
                while code < mid.len() && mid[code] < val {
                    code += 1;
                }
                code as u8
            })
            .collect()
    })
}

/// The code of a value already divided by its block's absmax (`norm_to_lut_index`, then the
/// table).
fn code_of(v: f32) -> u8 {
    let v = v.clamp(-1.0, 1.0);
    let t = ((v + 1.0) * 0.5).mul_add((LUT_SIZE - 1) as f32, 0.5);
    lut()[t as usize]
}

/// `quantize_blockwise(x, code=DYNAMIC_MAP, blocksize)` as bitsandbytes computes it on the CPU:
/// per block its absmax (max |x|; a last block may be shorter) and each element's code. A block
/// whose absmax is 0 gets code 0 throughout (bitsandbytes' rule; its values dequantize to 0).
/// The values must be finite (the caller checks).
pub fn quantize_blockwise(x: &[f32], blocksize: usize) -> (Vec<u8>, Vec<f32>) {
    let mut codes = Vec::with_capacity(x.len());
    let mut absmax = Vec::with_capacity(x.len().div_ceil(blocksize));
    for block in x.chunks(blocksize) {
        let am = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        absmax.push(am);
        if am == 0.0 {
            codes.extend(std::iter::repeat_n(0u8, block.len()));
            continue;
        }
        let inv = 1.0 / am;
        codes.extend(block.iter().map(|&v| code_of(v * inv)));
    }
    (codes, absmax)
}

/// `dequantize_blockwise`: code value × its block's absmax, one f32 product each.
pub fn dequantize_blockwise(codes: &[u8], absmax: &[f32], blocksize: usize) -> Vec<f32> {
    codes
        .chunks(blocksize)
        .zip(absmax)
        .flat_map(|(block, &am)| block.iter().map(move |&c| DYNAMIC_MAP[c as usize] * am))
        .collect()
}

/// Lanes of torch's `Vectorized<float>` under the AVX2 and default dispatch.
const LANES: usize = 8;

/// An accumulator of torch's sum: one f32, or one vector of lanes added lane by lane.
trait Acc: Copy {
    const ZERO: Self;
    fn add(self, other: Self) -> Self;
}

impl Acc for f32 {
    const ZERO: Self = 0.0;
    fn add(self, other: Self) -> Self {
        self + other
    }
}

impl Acc for [f32; LANES] {
    const ZERO: Self = [0.0; LANES];
    fn add(mut self, other: Self) -> Self {
        for (a, b) in self.iter_mut().zip(other) {
            *a += b;
        }
        self
    }
}

/// c10's `CeilLog2` (1 for x <= 2).
fn ceil_log2(x: usize) -> u32 {
    if x <= 2 {
        1
    } else {
        usize::BITS - (x - 1).leading_zeros()
    }
}

/// torch's `multi_row_sum` with 4 rows: `size` rows of 4 loads, summed in up to 4 levels of
/// chunks of `2^level_power` rows so that only partial sums of similar size meet.
fn multi_row_sum<A: Acc>(load: impl Fn(usize) -> A, size: usize) -> [A; 4] {
    const LEVELS: usize = 4;
    let level_power = 4.max(ceil_log2(size) / LEVELS as u32);
    let level_step = 1usize << level_power;
    let level_mask = level_step - 1;
    let mut acc = [[A::ZERO; 4]; LEVELS];
    let load_row = |acc: &mut [A; 4], i: usize| {
        for (k, a) in acc.iter_mut().enumerate() {
            *a = a.add(load(4 * i + k));
        }
    };
    let add_row = |acc: &mut [A; 4], row: [A; 4]| {
        for (a, r) in acc.iter_mut().zip(row) {
            *a = a.add(r);
        }
    };
    let mut i = 0;
    while i + level_step <= size {
        for _ in 0..level_step {
            load_row(&mut acc[0], i);
            i += 1;
        }
        for j in 1..LEVELS {
            let lower = std::mem::replace(&mut acc[j - 1], [A::ZERO; 4]);
            add_row(&mut acc[j], lower);
            if i & (level_mask << (j as u32 * level_power)) != 0 {
                break;
            }
        }
    }
    for i in i..size {
        load_row(&mut acc[0], i);
    }
    let [mut total, rest @ ..] = acc;
    for level in rest {
        add_row(&mut total, level);
    }
    total
}

/// torch's `row_sum`: `size` loads as rows of 4, the tail into the first partial sum.
fn row_sum<A: Acc>(load: impl Fn(usize) -> A, size: usize) -> A {
    let rows = size / 4;
    let mut partial = multi_row_sum(&load, rows);
    for i in rows * 4..size {
        partial[0] = partial[0].add(load(i));
    }
    partial[1..].iter().fold(partial[0], |s, &p| s.add(p))
}

/// `torch.sum` of a contiguous f32 tensor on the CPU, one thread, 8-lane vectors.
pub(crate) fn torch_sum(x: &[f32]) -> f32 {
    if x.len() < LANES {
        return row_sum(|i| x[i], x.len());
    }
    let vectors = x.len() / LANES;
    let lanes = row_sum(
        |i| -> [f32; LANES] { x[i * LANES..(i + 1) * LANES].try_into().unwrap() },
        vectors,
    );
    let tail = x[vectors * LANES..].iter().fold(0.0f32, |s, &v| s + v);
    lanes.iter().fold(tail, |s, &v| s + v)
}

/// `torch.mean` of a contiguous f32 tensor on the CPU: its sum divided by the count, in f32.
pub(crate) fn torch_mean(x: &[f32]) -> f32 {
    torch_sum(x) / x.len() as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dynamic_map_has_bitsandbytes_shape() {
        assert!(DYNAMIC_MAP.windows(2).all(|w| w[0] < w[1]), "sorted");
        assert_eq!(DYNAMIC_MAP[127], 0.0);
        assert_eq!(DYNAMIC_MAP[255], 1.0);
        // Printed by `create_dynamic_map()[[0, 126, 128, 254]].tolist()`.
        assert_eq!(f64::from(DYNAMIC_MAP[0]), -0.992968738079071);
        assert_eq!(f64::from(DYNAMIC_MAP[126]), -5.500000384017767e-07);
        assert_eq!(f64::from(DYNAMIC_MAP[128]), 5.500000384017767e-07);
        assert_eq!(f64::from(DYNAMIC_MAP[254]), 0.992968738079071);
    }

    #[test]
    fn codes_are_near_and_a_zero_block_is_code_zero() {
        let x: Vec<f32> = (0..600)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let (codes, absmax) = quantize_blockwise(&x, 256);
        assert_eq!(absmax.len(), 3);
        let back = dequantize_blockwise(&codes, &absmax, 256);
        let gap = DYNAMIC_MAP
            .windows(2)
            .map(|w| w[1] - w[0])
            .fold(0.0, f32::max);
        for (i, (v, b)) in x.iter().zip(&back).enumerate() {
            let am = absmax[i / 256];
            assert!((v - b).abs() <= (gap / 2.0 + 1.0 / 65535.0) * am * 1.0001);
        }
        let (codes, absmax) = quantize_blockwise(&[0.0; 10], 256);
        assert_eq!((codes, absmax), (vec![0; 10], vec![0.0]));
    }

    #[test]
    fn small_values_take_bitsandbytes_table_code_not_the_nearest() {
        // `quantize_blockwise(torch.tensor(x), blocksize=256)[0].tolist()` with bitsandbytes
        // 0.50.2 on the CPU. The nearest codes would be 255, 127, 128, 129, 130, 124, 134,
        // 205, 21: below about 3e-5 the table's step is coarser than the codes (even 0.0 gets
        // code 131, 2.125e-5).
        let x = [1.0, 0.0, 1e-6, 5e-6, 1e-5, -1e-5, 1e-4, 0.3, -0.7];
        let (codes, absmax) = quantize_blockwise(&x, 256);
        assert_eq!(codes, [255, 131, 131, 131, 131, 123, 134, 205, 21]);
        assert_eq!(absmax, [1.0]);
    }

    #[test]
    fn the_sum_follows_torch_cascade_not_a_running_sum() {
        // Integers sum exactly in any order.
        let x: Vec<f32> = (1..=1000).map(|i| i as f32).collect();
        assert_eq!(torch_sum(&x), 500500.0);
        assert_eq!(torch_mean(&x[..5]), 3.0);
        // 2^24 then 4095 halves (a quarter of its ulp): a running sum never moves; torch's
        // lanes and levels keep most of them. The values torch 2.15 prints for
        // `x = torch.full((4096,), 0.5); x[0] = 2**24; x.sum()` and for
        // `torch.full((100000,), 0.1).sum()`.
        let mut x = vec![0.5f32; 4096];
        x[0] = 16777216.0;
        let running = x.iter().fold(0.0f32, |s, &v| s + v);
        assert_eq!(running, 16777216.0);
        assert_eq!(torch_sum(&x), 16779256.0);
        assert_eq!(f64::from(torch_sum(&[0.1; 100_000])), 10000.0009765625);
        assert_eq!(f64::from(torch_mean(&[0.1; 100_000])), 0.10000000894069672);
    }
}
