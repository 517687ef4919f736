//! NF4 without a reference implementation at hand: the levels as bitsandbytes prints them,
//! error bounds, exact recovery, the partial last block, double quantization and the storage
//! count. tests/nf4_bitsandbytes.rs compares with bitsandbytes itself.

use super::*;
use crate::testutil::randn;

/// The largest gap between adjacent levels (between 0.7229568 and 1.0).
fn largest_gap() -> f32 {
    NF4_LEVELS
        .windows(2)
        .map(|w| w[1] - w[0])
        .fold(0.0, f32::max)
}

#[test]
#[allow(clippy::excessive_precision)]
fn the_levels_are_bitsandbytes_values() {
    // bitsandbytes 0.50.2, bitsandbytes/functional.py lines 789-804 (`get_4bit_type("nf4")`),
    // the same digits as csrc/kernels.cu lines 27-42 (`nf4_dequantization_lut`), as f64.
    let source: [f64; 16] = [
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
    for (i, (&level, &want)) in NF4_LEVELS.iter().zip(&source).enumerate() {
        // Equal as f64: the source digits are an f32 value exactly, so nothing was rounded.
        assert_eq!(f64::from(level), want, "level {i}");
    }
    // The CUDA quantizer's decision tree (csrc/kernels.cu lines 114-150, `dQuantizeNF4`)
    // compares with these f32 literals. The CPU's midpoints, f32 `(a + b) / 2`, are the same
    // numbers but for four that are one ulp apart (the decimal literals sit almost exactly
    // halfway between two f32 values): a value exactly between them gets a different code on
    // the GPU.
    let cuda_tree: [f32; 15] = [
        -0.8480964004993439,
        -0.6106329262256622,
        -0.4599952697753906,
        -0.33967943489551544,
        -0.23460740596055984,
        -0.13791173323988914,
        -0.045525018125772476,
        0.03979014977812767,
        0.1202552504837513,
        0.2035212516784668,
        0.2920137718319893,
        0.3893125355243683,
        0.5016634166240692,
        0.6427869200706482,
        0.8614784181118011,
    ];
    let ulps: Vec<i64> = midpoints()
        .iter()
        .zip(&cuda_tree)
        .map(|(m, c)| i64::from(m.to_bits()) - i64::from(c.to_bits()))
        .collect();
    assert_eq!(ulps, [-1, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 1, 0, 1]);
}

#[test]
fn a_value_on_a_midpoint_takes_the_lower_level() {
    // absmax 1 (the block holds 1.0), so each value is its own scaled value.
    let mid = midpoints();
    let mut x = vec![1.0f32; 64];
    for (i, &m) in mid.iter().enumerate() {
        x[3 * i] = m;
        x[3 * i + 1] = m.next_up();
        x[3 * i + 2] = m.next_down();
    }
    let q = Nf4Tensor::quantize(&x, &[64], false).unwrap();
    for i in 0..15 {
        assert_eq!(q.code(3 * i), i as u8, "on midpoint {i}");
        assert_eq!(q.code(3 * i + 1), i as u8 + 1, "above midpoint {i}");
        assert_eq!(q.code(3 * i + 2), i as u8, "below midpoint {i}");
    }
    assert_eq!(q.code(63), 15);
}

#[test]
fn round_trip_error_is_within_half_the_largest_gap() {
    let half_gap = largest_gap() / 2.0;
    for (n, std) in [(64 * 40, 0.02), (1000, 1.0), (64 * 3 + 17, 300.0)] {
        let x = randn(n, 7 + n as u64, std);
        let q = Nf4Tensor::quantize(&x, &[n], false).unwrap();
        let back = q.dequantize();
        let absmax = q.block_absmax();
        for (i, (&v, &b)) in x.iter().zip(&back).enumerate() {
            let am = absmax[i / BLOCKSIZE];
            // Half the gap, plus the roundings of x·(1/absmax) and level·absmax.
            let bound = (half_gap + 4.0 * f32::EPSILON) * am;
            assert!(
                (v - b).abs() <= bound,
                "n {n} element {i}: {v} -> {b} (absmax {am})"
            );
        }
    }
}

#[test]
fn values_that_are_levels_times_absmax_come_back_exactly() {
    // Blocks of 64 and a partial block of 30; each holds its absmax (as +a or -a), so every
    // value is exactly level × absmax after one f32 product.
    for absmax in [1.0f32, 0.037, 3.3, 1e-3, 7.5e4] {
        let n = 64 * 3 + 30;
        let x: Vec<f32> = (0..n)
            .map(|i| match i % 64 {
                0 if (i / 64) % 2 == 0 => absmax,
                0 => -absmax,
                j => NF4_LEVELS[(j * 7 + i / 64) % 16] * absmax,
            })
            .collect();
        let q = Nf4Tensor::quantize(&x, &[n], false).unwrap();
        let back = q.dequantize();
        for (i, (v, b)) in x.iter().zip(&back).enumerate() {
            assert_eq!(v.to_bits(), b.to_bits(), "absmax {absmax} element {i}");
        }
    }
}

#[test]
fn a_partial_last_block_has_its_own_absmax_and_an_odd_count_is_padded() {
    let n = 64 * 2 + 9;
    let mut x = randn(n, 3, 1.0);
    // The last block is much smaller than the others: it must be scaled by its own absmax.
    for v in &mut x[128..] {
        *v *= 1e-3;
    }
    let q = Nf4Tensor::quantize(&x, &[n], false).unwrap();
    assert_eq!(q.packed().len(), n.div_ceil(2));
    let absmax = q.block_absmax();
    assert_eq!(absmax.len(), 3);
    assert_eq!(
        absmax[2],
        x[128..].iter().fold(0.0f32, |m, v| m.max(v.abs()))
    );
    // bitsandbytes pads the scaled values with a 0.0: code 7 in the last low nibble.
    assert_eq!(q.packed()[n / 2] & 0x0f, 7);
    let back = q.dequantize();
    let half_gap = largest_gap() / 2.0;
    for i in 128..n {
        assert!((x[i] - back[i]).abs() <= (half_gap + 4.0 * f32::EPSILON) * absmax[2]);
    }
    // A partial block of zeros keeps bitsandbytes' floor as its absmax; a full one keeps 0.
    let q = Nf4Tensor::quantize(&[0.0; 70], &[70], false).unwrap();
    assert_eq!(q.block_absmax(), vec![0.0, 1e-38_f64 as f32]);
    assert_eq!(q.dequantize(), vec![0.0; 70]);
}

#[test]
fn double_quantization_agrees_with_single_within_the_8bit_error() {
    // 600 blocks: three second-level blocks, the last partial; two magnitudes of weights.
    let n = 64 * 600;
    let mut x = randn(n, 11, 0.02);
    for v in &mut x[n / 2..] {
        *v *= 5.0;
    }
    let single = Nf4Tensor::quantize(&x, &[600, 64], false).unwrap();
    let double = Nf4Tensor::quantize(&x, &[600, 64], true).unwrap();
    assert_eq!(
        single.packed(),
        double.packed(),
        "the 4-bit codes do not depend on it"
    );
    let Absmax::Double {
        codes,
        absmax2,
        offset,
    } = double.absmax()
    else {
        panic!("double quantization keeps 8-bit codes")
    };
    assert_eq!((codes.len(), absmax2.len()), (600, 3));
    let exact = single.block_absmax();
    let mean = exact.iter().map(|&a| f64::from(a)).sum::<f64>() / 600.0;
    assert!((f64::from(*offset) - mean).abs() <= 1e-6 * mean);
    // The 8-bit code is within half the dynamic map's largest gap of (absmax - offset) /
    // absmax2, plus bitsandbytes' table step (1/65535), plus the f32 roundings.
    let gap = blockwise8::DYNAMIC_MAP
        .windows(2)
        .map(|w| w[1] - w[0])
        .fold(0.0, f32::max);
    let recovered = double.block_absmax();
    let (a, b) = (single.dequantize(), double.dequantize());
    for blk in 0..600 {
        let err = (gap / 2.0 + 1.0 / 65535.0) * absmax2[blk / NESTED_BLOCKSIZE]
            + 4.0 * f32::EPSILON * exact[blk];
        assert!(
            (recovered[blk] - exact[blk]).abs() <= err,
            "block {blk}: {} vs {}",
            recovered[blk],
            exact[blk]
        );
        for i in blk * 64..(blk + 1) * 64 {
            // |level| <= 1, so a value moves at most as far as its absmax.
            assert!((a[i] - b[i]).abs() <= err * 1.0001, "element {i}");
        }
    }
}

#[test]
fn storage_is_half_a_byte_plus_the_scales() {
    // 64 · 256 · 3 elements: 3072 blocks, 12 second-level blocks.
    let n = 64 * 256 * 3;
    let x = randn(n, 5, 1.0);
    let double = Nf4Tensor::quantize(&x, &[n], true).unwrap();
    let fixed = 16 * 4 + 256 * 4 + 4; // quant_map, nested_quant_map, offset
    assert_eq!(
        double.storage_bytes(),
        n / 2 + n / 64 + 4 * n / (64 * 256) + fixed
    );
    let per_param = (double.storage_bytes() - fixed) as f64 / n as f64;
    assert!((per_param - 0.51587).abs() < 1e-5, "{per_param}");
    let single = Nf4Tensor::quantize(&x, &[n], false).unwrap();
    assert_eq!(single.storage_bytes(), n / 2 + 4 * n / 64 + 16 * 4);
    // A partial block and an odd count round up.
    let q = Nf4Tensor::quantize(&x[..65], &[5, 13], true).unwrap();
    assert_eq!(q.storage_bytes(), 33 + 2 + 4 + fixed);
}

#[test]
fn bad_inputs_are_refused() {
    assert_eq!(
        Nf4Tensor::quantize(&[1.0; 6], &[2, 4], false),
        Err(QuantError::Shape {
            shape: vec![2, 4],
            numel: 8,
            len: 6
        })
    );
    assert!(matches!(
        Nf4Tensor::quantize(&[], &[0, 4], true),
        Err(QuantError::Empty { .. })
    ));
    let err = Nf4Tensor::quantize(&[1.0, f32::NAN, 2.0], &[3], false).unwrap_err();
    assert!(err.to_string().contains("element 1 is NaN"), "{err}");
    let q = Nf4Tensor::quantize(&[1.0; 8], &[8], true).unwrap();
    assert_eq!(
        q.dequantize_into(&mut [0.0; 7]),
        Err(QuantError::OutputLength { numel: 8, len: 7 })
    );
    // One block: the offset is its absmax, so it dequantizes exactly.
    assert_eq!(q.dequantize(), vec![1.0; 8]);
}
