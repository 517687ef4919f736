//! Row-major matrix products expressed as cuBLAS (column-major) calls.
//!
//! cuBLAS reads matrices column-major. A row-major `r × c` matrix with row stride `c` is, byte for
//! byte, the column-major `c × r` matrix of its transpose. So row-major `C = op(A)·op(B)` is
//! column-major `Cᵀ = op(B)ᵀ·op(A)ᵀ`: pass B first and A second, swap m and n, and keep each
//! operand's transpose flag (its row-major stored width becomes its leading dimension).
//!
//! [`gemm_ex_reference`] computes what `cublasGemmEx` computes, on the host, straight from the
//! column-major arguments: the unit tests and the CPU emulator of the kernels use it to check
//! the mapping without a GPU.

/// The row-major product (defined with the `Kernels` surface that takes it; mapped here).
pub use crate::backend::shapes::RowMajorGemm;
use crate::backend::GpuError;

/// Which row-major operand a column-major argument slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    A,
    B,
}

/// The arguments of one column-major GEMM call (`cublasGemmEx` order):
/// `C (m×n, ldc) = op(first) (m×k) · op(second) (k×n)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColMajorGemm {
    pub trans_first: bool,
    pub trans_second: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    /// Which row-major operand goes in the first slot (always B) and the second (always A).
    pub first: Operand,
    pub second: Operand,
    pub ld_first: i32,
    pub ld_second: i32,
    pub ldc: i32,
}

impl RowMajorGemm {
    /// Elements of the stored A, B and C.
    pub fn lens(&self) -> (usize, usize, usize) {
        (self.m * self.k, self.k * self.n, self.m * self.n)
    }

    /// The column-major call computing this product; errors when a size does not fit cuBLAS's
    /// 32-bit arguments or is zero.
    pub fn to_col_major(&self) -> Result<ColMajorGemm, GpuError> {
        let (m, k, n) = (self.m, self.k, self.n);
        if m == 0 || k == 0 || n == 0 {
            return Err(GpuError::shape(
                "gemm",
                format!("empty product m={m} k={k} n={n}; skip the call instead"),
            ));
        }
        let fit = |x: usize, what: &str| {
            i32::try_from(x).map_err(|_| GpuError::Unsupported {
                what: format!("gemm {what} = {x} exceeds cuBLAS's 32-bit sizes"),
                fix: "split the product (smaller micro-batch or more tensor parallelism)".into(),
            })
        };
        // Stored row-major widths: A is m×k (or k×m), B is k×n (or n×k).
        let a_width = if self.trans_a { m } else { k };
        let b_width = if self.trans_b { k } else { n };
        Ok(ColMajorGemm {
            trans_first: self.trans_b,
            trans_second: self.trans_a,
            m: fit(n, "n")?,
            n: fit(m, "m")?,
            k: fit(k, "k")?,
            first: Operand::B,
            second: Operand::A,
            ld_first: fit(b_width, "B's row width")?,
            ld_second: fit(a_width, "A's row width")?,
            ldc: fit(n, "C's row width")?,
        })
    }
}

impl ColMajorGemm {
    /// Whether cuBLASLt's FP8 GEMM takes this call: "TN" (first transposed, second not) and
    /// every size and leading dimension a positive multiple of 16.
    pub fn check_fp8(&self) -> Result<(), GpuError> {
        let unsupported = |what: String| GpuError::Unsupported {
            what: format!("FP8 GEMM: {what}"),
            fix: "FP8 operands must be passed TN (x · wᵀ) with 16-aligned sizes".into(),
        };
        if !self.trans_first || self.trans_second {
            return Err(unsupported(format!(
                "op(first) = {}, op(second) = {}; cuBLASLt's FP8 GEMM needs T, N",
                if self.trans_first { "T" } else { "N" },
                if self.trans_second { "T" } else { "N" }
            )));
        }
        for (name, d) in [
            ("m", self.m),
            ("n", self.n),
            ("k", self.k),
            ("lda", self.ld_first),
            ("ldb", self.ld_second),
            ("ldc", self.ldc),
        ] {
            if d <= 0 || d % 16 != 0 {
                return Err(unsupported(format!(
                    "{name} = {d} is not a positive multiple of 16"
                )));
            }
        }
        Ok(())
    }
}

/// `C = alpha·op(first)·op(second) + beta·C`, column-major, with f32 accumulation: what
/// `cublasGemmEx` computes for these arguments. `first`, `second`, `c` are element reads and
/// writes through closures so any storage type (bf16 bits, f32) can be used.
pub fn gemm_ex_reference(
    g: &ColMajorGemm,
    alpha: f32,
    first: &dyn Fn(usize) -> f32,
    second: &dyn Fn(usize) -> f32,
    beta: f32,
    c: &mut dyn FnMut(usize, Option<f32>) -> f32,
) {
    let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
    let (lda, ldb, ldc) = (g.ld_first as usize, g.ld_second as usize, g.ldc as usize);
    // Column-major element (i, j) of op(X): X[i + j·ld], or X[j + i·ld] when transposed.
    let a_at = |i: usize, l: usize| {
        if g.trans_first {
            first(l + i * lda)
        } else {
            first(i + l * lda)
        }
    };
    let b_at = |l: usize, j: usize| {
        if g.trans_second {
            second(j + l * ldb)
        } else {
            second(l + j * ldb)
        }
    };
    for j in 0..n {
        for i in 0..m {
            let mut acc = 0.0f32;
            for l in 0..k {
                acc += a_at(i, l) * b_at(l, j);
            }
            let at = i + j * ldc;
            let old = if beta != 0.0 { c(at, None) } else { 0.0 };
            c(at, Some(alpha * acc + beta * old));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive_row_major(g: &RowMajorGemm, a: &[f32], b: &[f32]) -> Vec<f32> {
        let mut c = vec![0.0; g.m * g.n];
        for i in 0..g.m {
            for j in 0..g.n {
                let mut acc = 0.0f64;
                for l in 0..g.k {
                    let x = if g.trans_a {
                        a[l * g.m + i]
                    } else {
                        a[i * g.k + l]
                    };
                    let y = if g.trans_b {
                        b[j * g.k + l]
                    } else {
                        b[l * g.n + j]
                    };
                    acc += f64::from(x) * f64::from(y);
                }
                c[i * g.n + j] = acc as f32;
            }
        }
        c
    }

    #[test]
    fn column_major_call_computes_the_row_major_product_for_every_transpose() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        for &(m, k, n) in &[(1, 1, 1), (3, 5, 2), (7, 4, 9), (16, 3, 1), (2, 17, 11)] {
            for trans_a in [false, true] {
                for trans_b in [false, true] {
                    let g = RowMajorGemm {
                        m,
                        k,
                        n,
                        trans_a,
                        trans_b,
                    };
                    let (la, lb, lc) = g.lens();
                    let a: Vec<f32> = (0..la).map(|_| next()).collect();
                    let b: Vec<f32> = (0..lb).map(|_| next()).collect();
                    let col = g.to_col_major().unwrap();
                    assert_eq!((col.first, col.second), (Operand::B, Operand::A));
                    let init: Vec<f32> = (0..lc).map(|_| next()).collect();
                    let mut c = init.clone();
                    gemm_ex_reference(&col, 2.0, &|i| b[i], &|i| a[i], 0.5, &mut |i, v| {
                        if let Some(v) = v {
                            c[i] = v;
                        }
                        c[i]
                    });
                    let want = naive_row_major(&g, &a, &b);
                    for i in 0..lc {
                        let w = 2.0 * want[i] + 0.5 * init[i];
                        assert!(
                            (c[i] - w).abs() < 1e-5,
                            "{g:?}: element {i}: {} vs {w}",
                            c[i]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn leading_dimensions_are_the_stored_row_widths() {
        let g = RowMajorGemm {
            m: 8,
            k: 3,
            n: 5,
            trans_a: true,
            trans_b: false,
        };
        let c = g.to_col_major().unwrap();
        assert_eq!((c.m, c.n, c.k), (5, 8, 3));
        assert_eq!((c.ld_first, c.ld_second, c.ldc), (5, 8, 5));
        assert!(!c.trans_first && c.trans_second);
    }

    #[test]
    fn fp8_calls_must_be_tn_and_16_aligned() {
        let g = |m, k, n, trans_b| {
            RowMajorGemm {
                m,
                k,
                n,
                trans_a: false,
                trans_b,
            }
            .to_col_major()
            .unwrap()
        };
        assert_eq!(g(256, 512, 384, true).check_fp8(), Ok(()));
        for bad in [
            g(256, 512, 384, false),
            g(24, 512, 384, true),
            g(256, 8, 384, true),
        ] {
            assert!(
                matches!(bad.check_fp8(), Err(GpuError::Unsupported { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn sizes_past_i32_and_empty_products_are_refused() {
        let big = RowMajorGemm {
            m: 1 << 31,
            k: 1,
            n: 1,
            trans_a: false,
            trans_b: false,
        };
        assert!(matches!(
            big.to_col_major(),
            Err(GpuError::Unsupported { .. })
        ));
        let empty = RowMajorGemm {
            m: 0,
            k: 1,
            n: 1,
            trans_a: false,
            trans_b: false,
        };
        assert!(matches!(empty.to_col_major(), Err(GpuError::Shape { .. })));
    }
}
