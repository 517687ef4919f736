//! The tensorwise-scaled FP8 linear on the device: `y = x · wᵀ` with both operands cast to
//! E4M3 with one scale each (`kernels/fp8.cu`), multiplied by cuBLASLt's FP8 GEMM
//! ([`Launcher::gemm_fp8`]). CUDA-only on purpose: it is not a [`Backend`](crate::backend::Backend)
//! op (the CPU backend has no FP8 GEMM to be bit-identical with, and nothing in the executor
//! uses FP8 yet); `crate::quant::fp8` is its CPU reference.

use super::launch::{self, n64, Geometry};
use super::views::{need, DRef};
use super::{DType, Device, GpuError, KArg, Launcher};
use crate::backend::GemmShape;

/// cuBLASLt's FP8 GEMM needs every dimension (and so every leading dimension) a multiple of 16.
pub const FP8_ALIGN: usize = 16;

/// Slots of one tensor in [`Fp8Linear::stats`]: amax, scale, 1 / scale, unused.
pub const FP8_STATS: usize = 4;

/// What [`Device::linear_fp8_tensorwise`] leaves on the device.
#[derive(Debug)]
pub struct Fp8Linear<B> {
    /// `y`, m × n row-major, bf16.
    pub y: B,
    /// x's E4M3 codes (m × k), four a u32 word, little-endian (`quant::fp8::pack_codes`).
    pub x_codes: B,
    /// w's E4M3 codes (n × k), packed the same way.
    pub w_codes: B,
    /// f32: x's [amax, scale, 1 / scale, 0], then w's.
    pub stats: B,
}

impl<L: Launcher> Device<L> {
    /// `y (m × n) = x (m × k) · w (n × k)ᵀ`, row-major, in FP8 with tensorwise scaling:
    /// `amax` of each operand on the device, `scale = 448 / amax`, the operands cast to E4M3
    /// (saturating, round to nearest even), then cuBLASLt multiplies the codes with f32
    /// accumulation, scales the result by both inverse scales and writes it as bf16. `x` and
    /// `w` are bf16 or f32 views. Every dimension must be a positive multiple of 16 (an
    /// [`GpuError::Unsupported`] otherwise).
    ///
    /// NOT YET RUN ON A GPU (docs/cuda.md): the kernels and the host side are checked on the
    /// kernel emulator; the cuBLASLt call has only been compiled.
    pub fn linear_fp8_tensorwise(
        &self,
        x: DRef<'_, L::Buf>,
        w: DRef<'_, L::Buf>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Fp8Linear<L::Buf>, GpuError> {
        for (name, d) in [("m", m), ("k", k), ("n", n)] {
            if d == 0 || !d.is_multiple_of(FP8_ALIGN) {
                return Err(GpuError::Unsupported {
                    what: format!(
                        "FP8 linear: {name} = {d} is not a positive multiple of {FP8_ALIGN} (cuBLASLt's FP8 GEMM needs 16-aligned dimensions)"
                    ),
                    fix: "pad the dimension to a multiple of 16, or use the bf16 linear".into(),
                });
            }
        }
        need("FP8 linear x", x.len, m * k)?;
        need("FP8 linear w", w.len, n * k)?;
        let l = self.launcher();
        let stats = l.alloc_zeros(DType::F32, 2 * FP8_STATS)?;
        let x_codes = self.cast_fp8(x, &stats, 0)?;
        let w_codes = self.cast_fp8(w, &stats, FP8_STATS)?;
        let y = l.alloc_zeros(DType::Bf16, m * n)?;
        // Row-major y = x · wᵀ is, column-major, yᵀ (n × m) = (w as stored)ᵀ · (x as stored):
        // first = w with TRANSA = T, second = x with TRANSB = N, both leading dimensions k, ldc
        // n: the "TN" layout Hopper's FP8 GEMM requires.
        let g = GemmShape {
            m,
            k,
            n,
            trans_a: false,
            trans_b: true,
        }
        .to_col_major()?;
        self.count_gemm();
        l.gemm_fp8(
            &g,
            &w_codes,
            (&stats, FP8_STATS + 2),
            &x_codes,
            (&stats, 2),
            &y,
        )?;
        Ok(Fp8Linear {
            y,
            x_codes,
            w_codes,
            stats,
        })
    }

    /// amax of `x` into `stats[at]`, its scale and inverse into `stats[at + 1..at + 3]`, and its
    /// codes (a new u32 buffer of `x.len / 4` words; `x.len` is a multiple of 4 here).
    fn cast_fp8(&self, x: DRef<'_, L::Buf>, stats: &L::Buf, at: usize) -> Result<L::Buf, GpuError> {
        let (amax, cast) = match L::dtype(x.buf) {
            DType::Bf16 => ("fp8_amax_bf16", "fp8_cast_bf16"),
            DType::F32 => ("fp8_amax_f32", "fp8_cast_f32"),
            DType::U32 => return Err(GpuError::shape("FP8 cast", "a u32 buffer is not a tensor")),
        };
        let words = x.len / 4;
        let codes = self.launcher().alloc_zeros(DType::U32, words)?;
        self.run(
            "fp8",
            amax,
            launch::elementwise(x.len as u64),
            &[KArg::At(stats, at), x.arg(), KArg::I64(n64(x.len))],
        )?;
        let one_warp = Geometry {
            grid: (1, 1, 1),
            block: (32, 1, 1),
            shared_bytes: 0,
        };
        self.run("fp8", "fp8_scale", Some(one_warp), &[KArg::At(stats, at)])?;
        self.run(
            "fp8",
            cast,
            launch::elementwise(words as u64),
            &[
                KArg::Buf(&codes),
                x.arg(),
                KArg::At(stats, at),
                KArg::I64(n64(words)),
            ],
        )?;
        Ok(codes)
    }
}
