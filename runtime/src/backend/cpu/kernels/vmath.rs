//! Element-wise math written so LLVM vectorises it: a branch-free `exp` (no libm call, so a
//! loop over a slice becomes SIMD) and reductions in eight independent lanes.
//!
//! Every reduction runs in a fixed order, so the same inputs give the same bits on every call,
//! rank and layout. Must not allocate.

/// `e^x` in f32 (Cephes' `expf` polynomial, within 2 ulp of the exact value on
/// `[-87, 88.37]`); `0` below `-87` (where `e^x < 1.7e-38`), `+∞` above `88.37`, NaN for NaN.
/// Branch-free, so loops over slices of it vectorise (libm's `expf` is a call per element).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding then subtracting 1.5·2^23 rounds to the nearest integer (|t| < 2^22), and leaves
    // that integer in the low bits of `k`.
    const ROUND: f32 = 12_582_912.0;
    let t = x * LOG2E;
    let k = t + ROUND;
    let n = k - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 0.166_666_65;
    let p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let ni = (k.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let pow2 = f32::from_bits((ni.wrapping_add(127) as u32).wrapping_shl(23));
    let v = y * pow2;
    let v = if x > 88.37 { f32::INFINITY } else { v };
    if x < -87.0 {
        0.0
    } else {
        v
    }
}

/// `max_i a[i]` (−∞ for an empty slice), eight lanes; NaNs are skipped as `f32::max` does.
#[inline]
pub fn max(a: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let c = a.chunks_exact(8);
    let tail = c
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for x in c {
        for i in 0..8 {
            acc[i] = if x[i] > acc[i] { x[i] } else { acc[i] };
        }
    }
    acc.iter().fold(tail, |m, &v| m.max(v))
}

/// `Σ e^(a[i] − shift)` accumulated in f64 (eight lanes), `a` untouched.
#[inline]
pub fn sum_exp_shifted_f64(a: &[f32], shift: f32) -> f64 {
    let mut acc = [0.0f64; 8];
    let c = a.chunks_exact(8);
    let tail: f64 = c
        .remainder()
        .iter()
        .map(|&x| f64::from(exp(x - shift)))
        .sum();
    for x in c {
        for i in 0..8 {
            acc[i] += f64::from(exp(x[i] - shift));
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `Σ a[i]²` in f64, eight lanes.
#[inline]
pub fn sum_squares_f64(a: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let c = a.chunks_exact(8);
    let tail: f64 = c
        .remainder()
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum();
    for x in c {
        for i in 0..8 {
            acc[i] += f64::from(x[i]) * f64::from(x[i]);
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_f64() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.3 {
            let want = f64::from(x).exp();
            let got = f64::from(exp(x));
            let ulp = f64::from(f32::EPSILON) * want;
            worst = worst.max((got - want).abs() / ulp);
            x += 0.000_731;
        }
        assert!(worst <= 2.0, "worst {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn lane_reductions_match_plain_ones() {
        let a: Vec<f32> = (0..37)
            .map(|i| ((i * 7919) % 101) as f32 * 0.1 - 5.0)
            .collect();
        assert_eq!(max(&a), a.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)));
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        let want: f64 = a.iter().map(|&x| (f64::from(x) - 1.0).exp()).sum();
        assert!((sum_exp_shifted_f64(&a, 1.0) - want).abs() < 1e-5 * want);
        let sq: f64 = a.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        assert!((sum_squares_f64(&a) - sq).abs() < 1e-9 * sq);
    }
}
