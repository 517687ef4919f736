//! bf16 on the host: conversions to and from f32 as 16-bit patterns, rounding to nearest with ties
//! to even — bit for bit what `f2bf` in `backend/cuda/kernels/common.cuh` does on the device, so a
//! value uploaded from the host and one produced by a kernel round the same way.

/// The bf16 bit pattern nearest to `x` (ties to even); NaN stays a (quiet) NaN.
pub fn from_f32(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    let rounded = u.wrapping_add(0x7fff + ((u >> 16) & 1));
    (rounded >> 16) as u16
}

/// The f32 value of a bf16 bit pattern (exact).
pub fn to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Converts a slice.
pub fn encode(xs: &[f32]) -> Vec<u16> {
    xs.iter().map(|&x| from_f32(x)).collect()
}

/// Converts a slice back.
pub fn decode(bs: &[u16]) -> Vec<f32> {
    bs.iter().map(|&b| to_f32(b)).collect()
}

/// `x` rounded through bf16: what a value looks like after a bf16 round trip.
pub fn round(x: f32) -> f32 {
    to_f32(from_f32(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_values_round_trip() {
        for x in [
            0.0f32,
            -0.0,
            1.0,
            -2.5,
            0.15625,
            65536.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ] {
            assert_eq!(round(x).to_bits(), x.to_bits(), "{x}");
        }
        assert_eq!(from_f32(1.0), 0x3f80);
        assert_eq!(from_f32(-2.0), 0xc000);
    }

    #[test]
    fn rounds_to_nearest_ties_to_even() {
        // 1 + 2^-8 is half way between 1 (even mantissa) and 1 + 2^-7: rounds down to 1.
        assert_eq!(from_f32(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3·2^-8 is half way between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
        assert_eq!(from_f32(1.0 + 3.0 / 256.0), 0x3f82);
        // Just above half way rounds up.
        assert_eq!(from_f32(f32::from_bits(0x3f80_8001)), 0x3f81);
        // Just below rounds down.
        assert_eq!(from_f32(f32::from_bits(0x3f80_7fff)), 0x3f80);
        // The largest finite f32 overflows to infinity, as in IEEE rounding.
        assert_eq!(from_f32(f32::MAX), 0x7f80);
    }

    #[test]
    fn nan_stays_nan_and_relative_error_is_bounded() {
        assert!(to_f32(from_f32(f32::NAN)).is_nan());
        assert!(to_f32(from_f32(f32::from_bits(0x7f80_0001))).is_nan());
        let mut x = 1.0e-3f32;
        while x < 1.0e6 {
            let r = round(x);
            assert!(((r - x) / x).abs() <= 1.0 / 256.0, "{x} -> {r}");
            x *= 1.37;
        }
    }
}
