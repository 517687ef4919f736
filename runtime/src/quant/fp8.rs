//! FP8 E4M3 on the CPU: the bit-exact reference of the CUDA backend's FP8 linear
//! (`backend/cuda/kernels/fp8.cu`, `Device::linear_fp8_tensorwise`), and its tensorwise scaling.
//!
//! The format is OCP FP8 E4M3 "fn" (`torch.float8_e4m3fn`, CUDA's `__nv_fp8_e4m3`): a sign bit,
//! 4 exponent bits with bias 7, 3 mantissa bits; no infinities; NaN is `0x7f` / `0xff` (the only
//! codes with all exponent and mantissa bits set), so the largest finite value is
//! `0x7e` = 1.75 · 2⁸ = 448. Subnormals (exponent field 0) are `m · 2⁻⁹`, m = 1..7.
//!
//! [`to_e4m3`] rounds to nearest, ties to even, and SATURATES: every finite value (and ±∞) past
//! ±448 becomes ±448, never NaN. That is what torchao's and Transformer Engine's scaled casts do
//! (they clamp to ±448 before the cast) and what CUDA's `__nv_cvt_float_to_fp8(x,
//! __NV_SATFINITE, __NV_E4M3)` does; a plain `tensor.to(torch.float8_e4m3fn)` differs only past
//! the saturation point (it maps ±∞ and values rounding beyond 448 to NaN). NaN maps to NaN
//! (`0x7f` with the sign kept). Values whose magnitude rounds below the smallest subnormal become
//! a zero of the same sign.
//!
//! Tensorwise scaling (torchao's `Float8LinearConfig` "tensorwise", Transformer Engine's per-tensor
//! current scaling): `amax = max |x|`, `scale = 448 / amax` in f32 (1 when amax is 0; `f32::MAX`
//! when the quotient overflows, as Transformer Engine clamps it), `q = to_e4m3(x · scale)` (one f32
//! product, rounded), and dequantization `from_e4m3(q) / scale`. The GEMM instead multiplies its
//! f32 accumulator by the inverse scales `1 / scale` (cuBLASLt's A/B scale pointers).

use super::QuantError;

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// The canonical NaN code (`0xff` is NaN too).
pub const E4M3_NAN: u8 = 0x7f;
/// Code of +448.
const MAX_CODE: u8 = 0x7e;
/// f32 bit patterns: 448, and 2⁻⁶ (E4M3's smallest normal), and 2⁻¹⁰ (half the smallest
/// subnormal: at or below it everything rounds to zero).
const F32_448: u32 = 0x43e0_0000;
const F32_MIN_NORMAL: u32 = 121 << 23;
const F32_HALF_MIN_SUB: u32 = 117 << 23;

/// `v >> s` rounded to nearest, ties to even (0 < s < 32).
fn shift_rne(v: u32, s: u32) -> u32 {
    let q = v >> s;
    let rem = v & ((1 << s) - 1);
    let half = 1 << (s - 1);
    if rem > half || (rem == half && q & 1 == 1) {
        q + 1
    } else {
        q
    }
}

/// `x` as an E4M3 code: round to nearest even, saturating to ±448 (see the module docs). The same
/// bit operations as `to_e4m3` in `backend/cuda/kernels/fp8.cu`.
pub fn to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7fff_ffff;
    if abs > 0x7f80_0000 {
        return sign | E4M3_NAN;
    }
    if abs >= F32_448 {
        return sign | MAX_CODE;
    }
    if abs >= F32_MIN_NORMAL {
        // Keep 3 of f32's 23 mantissa bits; a carry out of the mantissa moves into the exponent
        // (at most 448 from below 448: 0x43dfffff rounds to 0x43e00000). Then rebias 127 → 7.
        return sign | (shift_rne(abs, 20) - (120 << 3)) as u8;
    }
    if abs <= F32_HALF_MIN_SUB {
        // At most 2⁻¹⁰: 0 or a tie between 0 and 2⁻⁹, which rounds to the even 0.
        return sign;
    }
    // A subnormal result m · 2⁻⁹: abs = (1.f) · 2^(e-127) with e in 117..=120, so
    // m = round((2²³ + f) · 2^(e-150) · 2⁹) = round((2²³ + f) >> (141 - e)). m = 8 is 2⁻⁶, the
    // smallest normal, whose code is 0x08: the carry lands right.
    let e = abs >> 23;
    let mant = (abs & 0x7f_ffff) | 0x80_0000;
    sign | shift_rne(mant, 141 - e) as u8
}

/// The value of E4M3 code `b` (exact in f32; the NaN codes give a NaN of their sign).
pub fn from_e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xf);
    let m = f32::from(b & 7);
    if e == 15 && b & 7 == 7 {
        return f32::NAN.copysign(sign);
    }
    let magnitude = if e == 0 {
        m * 2f32.powi(-9)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    sign * magnitude
}

/// `max |x|` (0 for an empty slice).
pub fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |a, v| a.max(v.abs()))
}

/// The tensorwise scale for `amax`: `448 / amax`, 1 when amax is 0, `f32::MAX` when the quotient
/// overflows.
pub fn tensorwise_scale(amax: f32) -> f32 {
    if amax == 0.0 {
        return 1.0;
    }
    let s = E4M3_MAX / amax;
    if s.is_infinite() {
        f32::MAX
    } else {
        s
    }
}

/// A tensor quantized to E4M3 with one scale.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Tensor {
    /// One code per element, in the input's order.
    pub codes: Vec<u8>,
    /// `max |x|` of the input.
    pub amax: f32,
    /// `448 / amax` (see [`tensorwise_scale`]).
    pub scale: f32,
}

impl Fp8Tensor {
    /// `1 / scale` in f32: what dequantizes, and what cuBLASLt's scale pointers hold.
    pub fn inverse_scale(&self) -> f32 {
        1.0 / self.scale
    }

    /// `from_e4m3(q) / scale` per element.
    pub fn dequantize(&self) -> Vec<f32> {
        self.codes
            .iter()
            .map(|&q| from_e4m3(q) / self.scale)
            .collect()
    }
}

/// Tensorwise quantization of `x` (finite values only: a NaN or ±∞ would make amax meaningless).
pub fn quantize_tensorwise(x: &[f32]) -> Result<Fp8Tensor, QuantError> {
    if x.is_empty() {
        return Err(QuantError::Empty { shape: vec![0] });
    }
    if let Some((index, &value)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(QuantError::NonFinite { index, value });
    }
    let amax = amax(x);
    let scale = tensorwise_scale(amax);
    let codes = x.iter().map(|&v| to_e4m3(v * scale)).collect();
    Ok(Fp8Tensor { codes, amax, scale })
}

/// Codes packed four to a little-endian u32 word (byte `i` of the tensor is byte `i % 4` of word
/// `i / 4`): the device's layout of E4M3 bytes in a u32 buffer. The last word is zero-padded.
pub fn pack_codes(codes: &[u8]) -> Vec<u32> {
    codes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect()
}

/// The bytes of words packed by [`pack_codes`].
pub fn unpack_codes(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// The FP8 linear's exact product: `y[i, j] = inv_x · inv_w · Σ_l from_e4m3(x[i, l]) ·
/// from_e4m3(w[j, l])` in f64, for `x` (m × k) and `w` (n × k) row-major, `y` (m × n)
/// row-major; also `Σ_l |x[i, l] · w[j, l]|` (dequantized), the scale of the accumulation error.
/// The products and their sum are exact in f64 for k < 2¹⁷ (each product is a multiple of 2⁻¹⁸
/// below 2¹⁸, so k of them span fewer than 53 bits), so only the multiplication by the inverse
/// scales rounds.
pub fn linear_reference(
    x: &Fp8Tensor,
    w: &Fp8Tensor,
    m: usize,
    k: usize,
    n: usize,
) -> Result<(Vec<f64>, Vec<f64>), QuantError> {
    for (t, rows) in [(x, m), (w, n)] {
        if t.codes.len() != rows * k {
            return Err(QuantError::Shape {
                shape: vec![rows, k],
                numel: rows * k,
                len: t.codes.len(),
            });
        }
    }
    let xv: Vec<f64> = x.codes.iter().map(|&q| f64::from(from_e4m3(q))).collect();
    let wv: Vec<f64> = w.codes.iter().map(|&q| f64::from(from_e4m3(q))).collect();
    let s = f64::from(x.inverse_scale()) * f64::from(w.inverse_scale());
    let (mut y, mut abs) = (vec![0.0; m * n], vec![0.0; m * n]);
    for i in 0..m {
        let xr = &xv[i * k..(i + 1) * k];
        for j in 0..n {
            let wr = &wv[j * k..(j + 1) * k];
            let (mut acc, mut acc_abs) = (0.0, 0.0);
            for (a, b) in xr.iter().zip(wr) {
                acc += a * b;
                acc_abs += (a * b).abs();
            }
            y[i * n + j] = acc * s;
            abs[i * n + j] = acc_abs * s;
        }
    }
    Ok((y, abs))
}

#[cfg(test)]
#[path = "fp8_tests.rs"]
mod tests;
