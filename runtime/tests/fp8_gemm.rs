//! The CUDA backend's tensorwise FP8 linear (`Device::linear_fp8_tensorwise`: `fp8.cu`'s amax,
//! scale and cast kernels, then cuBLASLt's FP8 GEMM) against its CPU reference
//! (`tessera_runtime::quant::fp8`), on the kernel emulator (`emu/`, every build) and on a real
//! GPU (feature `cuda`; scripts/gpu-check.sh runs it as step `fp8-gemm`).
//!
//! Checked bit for bit: each operand's amax, scale and inverse scale on the device, and every
//! E4M3 code the device cast. Checked within a bound: `y` against the exact product of the
//! dequantized operands (`quant::fp8::linear_reference`, f64), element by element,
//!
//! `|y − ŷ| ≤ 2⁻⁸ · |ŷ| + 2⁻⁷ · Σ_l |x̂_l · ŵ_l|`
//!
//! - 2⁻⁸: the bf16 output's rounding (8 significant bits, round to nearest).
//! - 2⁻⁷ of the sum of absolute products: the accumulation. In f32 in any order, k = 512 terms
//!   cost at most k · 2⁻²⁴ = 2⁻¹⁵ of it; but Hopper's FP8 tensor cores keep partial sums at
//!   about 14 bits (DeepSeek-V3 report, §3.3.2) until cuBLASLt promotes them to f32 (fast
//!   accumulation is off), so a chunk of up to 128 terms may lose 128 · 2⁻¹⁴ = 2⁻⁷ of its absolute
//!   sum in the worst case. The inverse-scale multiplications add two f32 roundings (2⁻²³).
//!
//! The bound is loose for random data (errors partly cancel) and still far below what a wrong
//! layout, a missing or non-inverted scale, or swapped operands produce (errors of the order of
//! |ŷ| itself or of the scales, 10² to 10⁵ here). Each case prints how much of it was used.

#[allow(dead_code)]
mod emu;

use tessera_runtime::backend::cuda::{
    kernels, launch, DType, Device, GpuError, HostData, HostVec, KArg, Launcher, FP8_STATS,
};
use tessera_runtime::backend::{bf16, Backend, Storage};
use tessera_runtime::quant::fp8::{self, Fp8Tensor};
use tessera_runtime::rng;

/// bf16's unit roundoff.
const OUTPUT_ROUNDING: f64 = 1.0 / 256.0;
/// Of `Σ|x̂ ŵ|`: the accumulation's worst case (see the module docs).
const ACCUMULATION: f64 = 1.0 / 128.0;

struct Case {
    m: usize,
    k: usize,
    n: usize,
    x_std: f32,
    w_std: f32,
    /// x replaced by [`ties`]: values that land exactly on midpoints between E4M3 codes.
    ties: bool,
    /// x[0] set to this many standard deviations (an outlier: it sets the scale, and pushes the
    /// smallest values of x into E4M3's subnormals).
    outlier: f32,
    storage: Storage,
    seed: u64,
}

const CASES: &[Case] = &[
    Case {
        m: 256,
        k: 512,
        n: 384,
        x_std: 1.0,
        w_std: 0.02,
        ties: false,
        outlier: 0.0,
        storage: Storage::Bf16,
        seed: 41,
    },
    Case {
        m: 64,
        k: 128,
        n: 32,
        x_std: 1e-3,
        w_std: 50.0,
        ties: false,
        outlier: 3000.0,
        storage: Storage::F32,
        seed: 42,
    },
    // Every tie between adjacent codes, both signs (round to nearest even on the device).
    Case {
        m: 16,
        k: 16,
        n: 32,
        x_std: 1.0,
        w_std: 1.0,
        ties: true,
        outlier: 0.0,
        storage: Storage::Bf16,
        seed: 44,
    },
    // All zeros: amax 0, scale 1, every code 0, y 0.
    Case {
        m: 16,
        k: 16,
        n: 16,
        x_std: 0.0,
        w_std: 1.0,
        ties: false,
        outlier: 0.0,
        storage: Storage::Bf16,
        seed: 43,
    },
];

/// `len` values of N(0, std), rounded to the storage's precision (what the device holds).
fn values(len: usize, std: f32, seed: u64, storage: Storage) -> Vec<f32> {
    let mut v = vec![0.0; len];
    rng::fill_normal(&mut v, seed, 0xf8, 0, std);
    match storage {
        Storage::Bf16 => v.iter().map(|&x| bf16::round(x)).collect(),
        Storage::F32 => v,
    }
}

/// `len` (≥ 253) values whose quantization hits every midpoint between adjacent positive E4M3
/// codes exactly, with both signs: amax 3.5 makes the scale 448 / 3.5 = 128, a power of two, so
/// `x · scale` is exact; the midpoints have at most 5 significant bits, so bf16 holds them.
fn ties(len: usize) -> Vec<f32> {
    let mut v = vec![0.0; len];
    v[0] = 3.5;
    for c in 0..0x7eu8 {
        let mid = (fp8::from_e4m3(c) + fp8::from_e4m3(c + 1)) / 2.0 / 128.0;
        v[1 + 2 * c as usize] = mid;
        v[2 + 2 * c as usize] = -mid;
    }
    v
}

fn u32s<L: Launcher>(dev: &Device<L>, buf: &L::Buf) -> Vec<u32> {
    match dev.launcher().download(buf).unwrap() {
        HostVec::U32(v) => v,
        other => panic!("expected a u32 buffer, got {other:?}"),
    }
}

fn same_bits(what: &str, got: f32, want: f32) {
    assert_eq!(
        got.to_bits(),
        want.to_bits(),
        "{what}: device {got:e} vs CPU {want:e}"
    );
}

/// The codes, scales and product of one case on `dev` against the CPU reference; returns the
/// largest share of the bound used.
fn check_case<L: Launcher + Sync + 'static>(dev: &Device<L>, c: &Case) -> f64
where
    L::Buf: Send + Sync,
{
    let what = format!("m {} k {} n {} ({:?})", c.m, c.k, c.n, c.storage);
    let mut x = values(c.m * c.k, c.x_std, c.seed, c.storage);
    if c.ties {
        x = ties(c.m * c.k);
    }
    if c.outlier != 0.0 {
        x[0] = c.outlier * c.x_std;
    }
    let w = values(c.n * c.k, c.w_std, c.seed + 100, c.storage);
    let (xd, wd) = (
        dev.upload(c.storage, &x).unwrap(),
        dev.upload(c.storage, &w).unwrap(),
    );
    let v = |b| Device::<L>::view(b);
    let out = dev
        .linear_fp8_tensorwise(v(&xd), v(&wd), c.m, c.k, c.n)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let stats = dev.download(v(&out.stats)).unwrap();
    let y = dev.download(v(&out.y)).unwrap();
    let (qx, qw) = (
        fp8::quantize_tensorwise(&x).unwrap(),
        fp8::quantize_tensorwise(&w).unwrap(),
    );
    for (name, q, codes, s) in [
        ("x", &qx, &out.x_codes, &stats[..FP8_STATS]),
        ("w", &qw, &out.w_codes, &stats[FP8_STATS..]),
    ] {
        same_bits(&format!("{what}: {name}'s amax"), s[0], q.amax);
        same_bits(&format!("{what}: {name}'s scale"), s[1], q.scale);
        same_bits(
            &format!("{what}: {name}'s inverse scale"),
            s[2],
            q.inverse_scale(),
        );
        let got = fp8::unpack_codes(&u32s(dev, codes));
        assert_eq!(got.len(), q.codes.len(), "{what}: {name}'s code count");
        if let Some(i) = (0..got.len()).find(|&i| got[i] != q.codes[i]) {
            let src = if name == "x" { x[i] } else { w[i] };
            panic!(
                "{what}: {name}'s code {i} ({src:e} × scale {}) is {:#04x} on the device, {:#04x} on the CPU",
                q.scale, got[i], q.codes[i]
            );
        }
    }
    let used = check_product(&what, &qx, &qw, c, &y);
    let subnormal = qx
        .codes
        .iter()
        .filter(|&&b| b & 0x78 == 0 && b & 7 != 0)
        .count();
    println!(
        "{what}: amax x {:e} w {:e}, {} + {} codes bit-equal ({subnormal} of x subnormal), y within {:.4} of the bound",
        qx.amax,
        qw.amax,
        qx.codes.len(),
        qw.codes.len(),
        used
    );
    used
}

/// `y` against the exact product within the bound of the module docs; the share of it used.
fn check_product(what: &str, qx: &Fp8Tensor, qw: &Fp8Tensor, c: &Case, y: &[f32]) -> f64 {
    let (want, abs) = fp8::linear_reference(qx, qw, c.m, c.k, c.n).unwrap();
    let (mut used, mut rel, mut scale) = (0.0f64, 0.0f64, 0.0f64);
    for (i, ((&got, &want), &abs)) in y.iter().zip(&want).zip(&abs).enumerate() {
        let err = (f64::from(got) - want).abs();
        let bound = OUTPUT_ROUNDING * want.abs() + ACCUMULATION * abs;
        assert!(
            err <= bound,
            "{what}: y[{}, {}] = {got:e}, the reference {want:e}: error {err:e} > bound {bound:e}",
            i / c.n,
            i % c.n
        );
        if bound > 0.0 {
            used = used.max(err / bound);
        }
        rel = rel.max(err);
        scale = scale.max(want.abs());
    }
    if scale > 0.0 {
        println!(
            "{what}: max |y − ŷ| = {rel:.3e} = {:.3e} of max |ŷ|",
            rel / scale
        );
    }
    used
}

fn cases<L: Launcher + Sync + 'static>(dev: &Device<L>)
where
    L::Buf: Send + Sync,
{
    for c in CASES {
        check_case(dev, c);
    }
    // Sizes cuBLASLt's FP8 GEMM cannot take are typed errors, before any launch.
    let x = dev.upload(Storage::Bf16, &[0.5; 24 * 32]).unwrap();
    let w = dev.upload(Storage::Bf16, &[0.5; 16 * 32]).unwrap();
    let v = |b| Device::<L>::view(b);
    for (m, k, n) in [(24, 32, 16), (16, 40, 16), (16, 32, 20), (0, 32, 16)] {
        match dev.linear_fp8_tensorwise(v(&x), v(&w), m, k, n) {
            Err(GpuError::Unsupported { what, .. }) => assert!(what.contains("multiple of 16")),
            Err(e) => panic!("m {m} k {k} n {n}: {e}"),
            Ok(_) => panic!("m {m} k {k} n {n}: accepted"),
        }
    }
}

/// `fp8_cast_f32` launched directly with scale 1 over every bf16 bit pattern (every exponent,
/// ±∞, NaN, every midpoint between E4M3 codes) and the f32 neighbours of each midpoint: the
/// device's E4M3 conversion is `quant::fp8::to_e4m3` bit for bit, saturation included (which
/// the tensorwise linear never reaches: its scale maps amax to 448).
fn cast_sweep<L: Launcher>(l: &L) {
    let mut x: Vec<f32> = (0..=u16::MAX).map(bf16::to_f32).collect();
    for c in 0..0x7eu8 {
        let mid = (fp8::from_e4m3(c) + fp8::from_e4m3(c + 1)) / 2.0;
        for v in [mid.next_down(), mid.next_up()] {
            x.extend([v, -v]);
        }
    }
    x.resize(x.len().next_multiple_of(4), 0.0);
    let words = x.len() / 4;
    let xd = l.upload(HostData::F32(&x)).unwrap();
    let stats = l.upload(HostData::F32(&[0.0, 1.0, 1.0, 0.0])).unwrap();
    let out = l.alloc_zeros(DType::U32, words).unwrap();
    let module = kernels::module("fp8").expect("the fp8 module");
    l.launch(
        module,
        "fp8_cast_f32",
        &launch::elementwise(words as u64).unwrap(),
        &[
            KArg::Buf(&out),
            KArg::Buf(&xd),
            KArg::Buf(&stats),
            KArg::I64(words as i64),
        ],
    )
    .unwrap();
    let got = match l.download(&out).unwrap() {
        HostVec::U32(v) => fp8::unpack_codes(&v),
        other => panic!("expected u32 codes, got {other:?}"),
    };
    for (i, &v) in x.iter().enumerate() {
        assert_eq!(
            got[i],
            fp8::to_e4m3(v),
            "{v:e} ({:#010x}): device {:#04x}, CPU {:#04x}",
            v.to_bits(),
            got[i],
            fp8::to_e4m3(v)
        );
    }
    println!("fp8_cast_f32: {} values bit-equal to to_e4m3", x.len());
}

#[test]
fn fp8_linear_on_emulated_kernels_matches_the_cpu_reference() {
    let Some(emu) = emu::or_skip() else { return };
    cases(&Device::new(emu));
}

#[test]
fn fp8_cast_on_emulated_kernels_is_to_e4m3() {
    let Some(emu) = emu::or_skip() else { return };
    cast_sweep(&emu);
}

/// The same cases on a real GPU (feature `cuda`; scripts/gpu-check.sh runs it, and
/// compute-sanitizer memcheck over it). Skips, with the reason printed, where no GPU is usable;
/// `TESSERA_REQUIRE_GPU=1` turns the skip into a failure.
#[cfg(feature = "cuda")]
#[test]
fn fp8_linear_on_a_gpu_matches_the_cpu_reference() {
    match tessera_runtime::backend::cuda::CudaLauncher::open(0) {
        Ok(gpu) => {
            cast_sweep(&gpu);
            cases(&Device::new(gpu));
        }
        Err(e) if std::env::var_os("TESSERA_REQUIRE_GPU").is_some() => {
            panic!("TESSERA_REQUIRE_GPU is set and no GPU is usable: {e}")
        }
        Err(e) => eprintln!("skipped: no CUDA device ({e})"),
    }
}
