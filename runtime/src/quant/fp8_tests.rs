//! E4M3 against hand-derived values and against a brute-force nearest-value search, and the
//! tensorwise FP8 linear's reference against a plain f32 GEMM within FP8's rounding error.

use super::*;
use crate::testutil::randn;

const SUB: f32 = 1.0 / 512.0; // 2⁻⁹, the smallest subnormal

#[test]
fn codes_decode_to_hand_derived_values() {
    assert_eq!(from_e4m3(0x00), 0.0);
    assert_eq!(from_e4m3(0x01), SUB);
    assert_eq!(from_e4m3(0x07), 7.0 * SUB);
    assert_eq!(from_e4m3(0x08), 1.0 / 64.0); // smallest normal, 2⁻⁶
    assert_eq!(from_e4m3(0x38), 1.0); // exponent 7 = bias
    assert_eq!(from_e4m3(0x3b), 1.375);
    assert_eq!(from_e4m3(0x7d), 416.0);
    assert_eq!(from_e4m3(0x7e), 448.0);
    assert_eq!(from_e4m3(0xfe), -448.0);
    assert_eq!(from_e4m3(0xb8), -1.0);
    assert_eq!(from_e4m3(0x80).to_bits(), (-0.0f32).to_bits());
    assert!(from_e4m3(0x7f).is_nan() && from_e4m3(0xff).is_nan());
    // 0x78 (exponent 15, mantissa 0) is finite in the "fn" format: 256.
    assert_eq!(from_e4m3(0x78), 256.0);
    // The positive codes increase strictly up to 448.
    for c in 0..0x7eu8 {
        assert!(from_e4m3(c) < from_e4m3(c + 1), "code {c:#x}");
    }
}

#[test]
fn every_code_round_trips() {
    let mut checked = 0;
    for c in 0..=255u8 {
        if c & 0x7f == 0x7f {
            // NaN decodes to NaN and encodes to the NaN code of the same sign.
            assert_eq!(to_e4m3(from_e4m3(c)), c & 0x80 | E4M3_NAN);
            continue;
        }
        assert_eq!(to_e4m3(from_e4m3(c)), c, "code {c:#04x}");
        checked += 1;
    }
    assert_eq!(checked, 254);
}

#[test]
fn saturates_at_448() {
    assert_eq!(to_e4m3(448.0), 0x7e);
    assert_eq!(to_e4m3(464.0), 0x7e); // a tie between 448 (even) and 480, which is NaN's slot
    assert_eq!(to_e4m3(464.1), 0x7e); // rounds towards 480: saturated
    assert_eq!(to_e4m3(480.0), 0x7e);
    assert_eq!(to_e4m3(1e30), 0x7e);
    assert_eq!(to_e4m3(f32::MAX), 0x7e);
    assert_eq!(to_e4m3(f32::INFINITY), 0x7e);
    assert_eq!(to_e4m3(-500.0), 0xfe);
    assert_eq!(to_e4m3(f32::NEG_INFINITY), 0xfe);
    assert_eq!(to_e4m3(432.0), 0x7e); // tie between 416 (odd mantissa 5) and 448 (6)
    assert_eq!(to_e4m3(431.9), 0x7d);
    assert_eq!(to_e4m3(f32::NAN), 0x7f);
    assert_eq!(to_e4m3(-f32::NAN), 0xff);
}

#[test]
fn subnormals_and_ties_round_to_even() {
    assert_eq!(to_e4m3(SUB), 0x01);
    assert_eq!(to_e4m3(SUB / 2.0), 0x00); // 2⁻¹⁰: tie between 0 and 2⁻⁹ → 0
    assert_eq!(to_e4m3(f32::from_bits((SUB / 2.0).to_bits() + 1)), 0x01);
    assert_eq!(to_e4m3(1.5 * SUB), 0x02); // tie between 1 and 2 → 2
    assert_eq!(to_e4m3(2.5 * SUB), 0x02); // tie between 2 and 3 → 2
    assert_eq!(to_e4m3(7.5 * SUB), 0x08); // tie between 7·2⁻⁹ and 2⁻⁶ → the normal 0x08
    assert_eq!(to_e4m3(1e-30), 0x00);
    assert_eq!(to_e4m3(f32::from_bits(1)), 0x00); // an f32 subnormal
                                                  // Normal ties: 1 + 2⁻⁴ lies halfway between 1.0 (mantissa 0) and 1.125 (1) → 1.0;
                                                  // 1.1875 halfway between 1.125 (1) and 1.25 (2) → 1.25.
    assert_eq!(to_e4m3(1.0625), 0x38);
    assert_eq!(to_e4m3(1.1875), 0x3a);
    assert_eq!(to_e4m3(-1.0625), 0xb8);
    assert_eq!(to_e4m3(1.0626), 0x39);
    assert_eq!(to_e4m3(1.6875 / 64.0), 0x0e); // 2⁻⁶ · 1.6875: tie of 0x0d, 0x0e → 0x0e
}

#[test]
fn negative_zero_keeps_its_sign() {
    assert_eq!(to_e4m3(-0.0), 0x80);
    assert_eq!(to_e4m3(0.0), 0x00);
    assert_eq!(to_e4m3(-1e-10), 0x80);
    assert_eq!(to_e4m3(-SUB / 2.0), 0x80);
}

/// The nearest finite E4M3 value by search over all codes (ties to the even code, which is the
/// even mantissa), saturating: an implementation that shares nothing with `to_e4m3`.
fn nearest_by_search(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = f64::from(x.abs());
    let mut best = 0u8;
    for c in 1..=0x7eu8 {
        let (d, db) = (
            (f64::from(from_e4m3(c)) - a).abs(),
            (f64::from(from_e4m3(best)) - a).abs(),
        );
        if d < db || (d == db && c % 2 == 0) {
            best = c;
        }
    }
    sign | best
}

#[test]
fn matches_a_nearest_value_search_over_a_float_sweep() {
    let mut n = 0;
    // Every f32 exponent from 2⁻¹² to 2⁹ with a spread of mantissas, both signs, plus every
    // midpoint between adjacent codes and its two f32 neighbours.
    let mut xs = Vec::new();
    for e in (127 - 12)..=(127 + 9) {
        for m in (0..(1u32 << 23)).step_by(4099) {
            xs.push(f32::from_bits((e << 23) | m));
        }
    }
    for c in 0..0x7eu8 {
        let mid = (from_e4m3(c) + from_e4m3(c + 1)) / 2.0; // exact in f32
        xs.extend([mid, f32::from_bits(mid.to_bits() - 1), mid.next_up()]);
    }
    for &x in &xs {
        for v in [x, -x] {
            assert_eq!(
                to_e4m3(v),
                nearest_by_search(v),
                "{v:e} ({:#010x})",
                v.to_bits()
            );
            n += 1;
        }
    }
    assert!(n > 10_000, "{n} values");
}

#[test]
fn tensorwise_scale_maps_amax_to_448() {
    let x = [0.5f32, -3.5, 1.25, 0.0];
    let q = quantize_tensorwise(&x).unwrap();
    assert_eq!(q.amax, 3.5);
    assert_eq!(q.scale, 128.0);
    assert_eq!(q.inverse_scale(), 1.0 / 128.0);
    // 0.5·128 = 64 = 2⁶ (exponent 13: 0x68), -3.5·128 = -448 (0xfe), 1.25·128 = 160 = 2⁷ · 1.25
    // (exponent 14, mantissa 2: 0x72), 0.
    assert_eq!(q.codes, [0x68, 0xfe, 0x72, 0x00]);
    assert_eq!(q.dequantize(), x);
    // amax 0 → scale 1; overflowing quotient → f32::MAX.
    assert_eq!(tensorwise_scale(0.0), 1.0);
    assert_eq!(tensorwise_scale(f32::from_bits(1)), f32::MAX);
    assert_eq!(
        quantize_tensorwise(&[0.0, -0.0]).unwrap().codes,
        [0x00, 0x80]
    );
    assert!(matches!(
        quantize_tensorwise(&[1.0, f32::NAN]),
        Err(QuantError::NonFinite { index: 1, .. })
    ));
    assert!(matches!(
        quantize_tensorwise(&[]),
        Err(QuantError::Empty { .. })
    ));
}

#[test]
fn packing_is_little_endian_bytes_in_order() {
    let codes = [0x01, 0x02, 0x03, 0x04, 0x05];
    let w = pack_codes(&codes);
    assert_eq!(w, [0x0403_0201, 0x0000_0005]);
    assert_eq!(&unpack_codes(&w)[..5], &codes);
}

/// `|dequant − x| ≤ 2⁻⁴ |x| + 2⁻¹⁰ / scale` (half a step of 3 mantissa bits, or half the
/// subnormal step 2⁻⁹ in scaled units), plus the f32 division's rounding.
fn element_error_bound(x: f32, scale: f32) -> f64 {
    (f64::from(x.abs()) / 16.0 + 1.0 / 1024.0 / f64::from(scale)) * (1.0 + 1e-6)
}

#[test]
fn dequantized_elements_are_within_fp8_rounding() {
    let x: Vec<f32> = randn(4096, 7, 2.0);
    let q = quantize_tensorwise(&x).unwrap();
    let d = q.dequantize();
    let mut worst = 0.0f64;
    for (a, b) in x.iter().zip(&d) {
        let err = f64::from((a - b).abs());
        let bound = element_error_bound(*a, q.scale);
        assert!(err <= bound, "{a} → {b}: error {err:e} > {bound:e}");
        worst = worst.max(err / bound);
    }
    println!("dequantized elements: worst error / bound = {worst:.3}");
    // The bound is not slack: some element uses most of it.
    assert!(worst > 0.5, "worst error / bound = {worst}");
}

/// The reference FP8 linear (quantize, dequantize, multiply) against the f32 product of the
/// unquantized inputs: `|ŷ − y| ≤ Σ_l (e_x,l · |ŵ_l| + |x_l| · e_w,l)` with `e` the element bound
/// above, plus 2⁻²⁰ of `Σ|x w|` for the f32 GEMM's own rounding (k = 512: k · 2⁻²⁴ = 2⁻¹⁵).
#[test]
fn reference_linear_is_within_fp8_error_of_the_f32_product() {
    let (m, k, n) = (32, 512, 48);
    let x = randn(m * k, 11, 1.0);
    let w: Vec<f32> = randn(n * k, 12, 0.02);
    let (qx, qw) = (
        quantize_tensorwise(&x).unwrap(),
        quantize_tensorwise(&w).unwrap(),
    );
    let (y, _) = linear_reference(&qx, &qw, m, k, n).unwrap();
    let (dx, dw) = (qx.dequantize(), qw.dequantize());
    let mut worst = 0.0f64;
    for i in 0..m {
        for j in 0..n {
            let (mut f32_y, mut deq_y, mut bound, mut abs) = (0.0f32, 0.0f64, 0.0f64, 0.0f64);
            for l in 0..k {
                let (a, b) = (x[i * k + l], w[j * k + l]);
                f32_y += a * b;
                deq_y += f64::from(dx[i * k + l]) * f64::from(dw[j * k + l]);
                bound += element_error_bound(a, qx.scale) * f64::from(dw[j * k + l].abs())
                    + f64::from(a.abs()) * element_error_bound(b, qw.scale);
                abs += f64::from((a * b).abs());
            }
            bound += abs / f64::from(1u32 << 20);
            // linear_reference multiplies by the inverse scales; dequantize divides by the
            // scales: the two agree to a few f32 roundings.
            let r = y[i * n + j];
            assert!((r - deq_y).abs() <= 1e-6 * abs, "({i},{j}): {r} vs {deq_y}");
            let err = (r - f64::from(f32_y)).abs();
            assert!(
                err <= bound,
                "({i},{j}): fp8 {r:e} vs f32 {f32_y:e}: error {err:e} > bound {bound:e}"
            );
            worst = worst.max(err / bound);
        }
    }
    println!("reference linear: worst error / bound = {worst:.3}");
    assert!(worst > 0.05, "worst error / bound = {worst}");
    assert!(matches!(
        linear_reference(&qx, &qw, m, k + 16, n),
        Err(QuantError::Shape { .. })
    ));
}
