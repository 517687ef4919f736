//! Matrix products over the `gemm` crate, with strided views so transposes and head slices
//! are never copied, plus the bias add/reduce that goes with a linear layer.
//!
//! Parallelism is a per-thread setting ([`set_threads`]): ranks are threads, so the default is
//! single-threaded (`gemm::Parallelism::None`); a single-rank run may ask for rayon threads.
//! This module must not allocate or transpose in the hot path.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

static COUNTING: AtomicBool = AtomicBool::new(false);
static FLOPS: AtomicU64 = AtomicU64::new(0);
static NANOS: AtomicU64 = AtomicU64::new(0);

/// Matmul work done by every thread since [`count_matmuls`] turned counting on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MatmulStats {
    /// 2·m·n·k summed over the calls.
    pub flops: u64,
    /// Wall time inside the calls, summed over threads.
    pub seconds: f64,
}

impl MatmulStats {
    /// Achieved rate per calling thread, in GFLOP/s.
    pub fn gflops_per_thread(&self) -> f64 {
        self.flops as f64 / self.seconds / 1e9
    }
}

/// Turns matmul counting on (from zero) or off; off by default, for benchmarks only.
pub fn count_matmuls(on: bool) {
    FLOPS.store(0, Ordering::Relaxed);
    NANOS.store(0, Ordering::Relaxed);
    COUNTING.store(on, Ordering::Relaxed);
}

/// What the counters hold now.
pub fn matmul_stats() -> MatmulStats {
    MatmulStats {
        flops: FLOPS.load(Ordering::Relaxed),
        seconds: NANOS.load(Ordering::Relaxed) as f64 / 1e9,
    }
}

thread_local! {
    static THREADS: Cell<usize> = const { Cell::new(1) };
}

/// Threads the gemm calls made by THIS thread may use (1 = no parallelism, the default; use it
/// inside rank threads). Results do not depend on it beyond f32 reassociation inside gemm.
pub fn set_threads(n: usize) {
    THREADS.with(|t| t.set(n.max(1)));
}

/// Bytes of the packing slab the `gemm` crate keeps on every thread that has multiplied
/// (gemm-common's thread-local `L2_SLAB`): the L2 cache per core it read for this host, so a
/// rank's memory holds it once beside its tensors.
pub fn packing_slab_bytes() -> usize {
    gemm_common::cache::CACHE_INFO[1].cache_bytes
}

fn parallelism() -> gemm::Parallelism {
    match THREADS.with(|t| t.get()) {
        1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

/// A read-only strided matrix view: element (i, j) is `data[off + i·rs + j·cs]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    data: &'a [f32],
    off: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

/// A mutable strided matrix view (see [`MatRef`]).
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    off: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

fn check_extent(len: usize, off: usize, rows: usize, cols: usize, rs: usize, cs: usize) {
    if rows > 0 && cols > 0 {
        let last = off + (rows - 1) * rs + (cols - 1) * cs;
        assert!(
            last < len,
            "matrix view {rows}x{cols} at {off} (strides {rs},{cs}) overruns a buffer of {len}"
        );
    }
}

impl<'a> MatRef<'a> {
    pub fn new(
        data: &'a [f32],
        off: usize,
        rows: usize,
        cols: usize,
        rs: usize,
        cs: usize,
    ) -> Self {
        check_extent(data.len(), off, rows, cols, rs, cs);
        Self {
            data,
            off,
            rows,
            cols,
            rs,
            cs,
        }
    }
    /// A dense row-major `rows × cols` matrix.
    pub fn rows(data: &'a [f32], rows: usize, cols: usize) -> Self {
        assert_eq!(
            data.len(),
            rows * cols,
            "row-major {rows}x{cols} view of {} elements",
            data.len()
        );
        Self::new(data, 0, rows, cols, cols, 1)
    }
    /// The transposed view (no copy).
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
}

impl<'a> MatMut<'a> {
    pub fn new(
        data: &'a mut [f32],
        off: usize,
        rows: usize,
        cols: usize,
        rs: usize,
        cs: usize,
    ) -> Self {
        check_extent(data.len(), off, rows, cols, rs, cs);
        Self {
            data,
            off,
            rows,
            cols,
            rs,
            cs,
        }
    }
    pub fn rows(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        assert_eq!(
            data.len(),
            rows * cols,
            "row-major {rows}x{cols} view of {} elements",
            data.len()
        );
        Self::new(data, 0, rows, cols, cols, 1)
    }
}

/// `dst = (acc ? dst : 0) + alpha · a·b` for strided views; `a: m×k`, `b: k×n`, `dst: m×n`.
pub fn gemm(dst: MatMut<'_>, a: MatRef<'_>, b: MatRef<'_>, alpha: f32, acc: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(
        b.rows == k && dst.rows == m && dst.cols == n,
        "gemm shapes: dst {}x{}, a {}x{}, b {}x{}",
        dst.rows,
        dst.cols,
        a.rows,
        a.cols,
        b.rows,
        b.cols
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !acc {
            for i in 0..m {
                for j in 0..n {
                    dst.data[dst.off + i * dst.rs + j * dst.cs] = 0.0;
                }
            }
        }
        return;
    }
    let start = COUNTING.load(Ordering::Relaxed).then(Instant::now);
    let _tag = crate::alloc::tagged(crate::alloc::Tag::Gemm);
    // SAFETY: the three views were bounds-checked at construction (every addressed element
    // lies inside its slice); `dst` is a unique borrow, so it cannot alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr().add(dst.off),
            dst.cs as isize,
            dst.rs as isize,
            acc,
            a.data.as_ptr().add(a.off),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr().add(b.off),
            b.cs as isize,
            b.rs as isize,
            1.0,
            alpha,
            false,
            false,
            false,
            parallelism(),
        );
    }
    if let Some(start) = start {
        FLOPS.fetch_add(2 * (m * n * k) as u64, Ordering::Relaxed);
        NANOS.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// `out (m×n) [+]= a (m×k) · b (k×n)`. Linear backward: `dx = dy · W`.
pub fn matmul(out: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize, acc: bool) {
    gemm(
        MatMut::rows(out, m, n),
        MatRef::rows(a, m, k),
        MatRef::rows(b, k, n),
        1.0,
        acc,
    );
}

/// `out (m×n) [+]= a (m×k) · bᵀ` with `b: n×k`. Linear forward: `y = x · Wᵀ`, `W: out×in`.
pub fn matmul_bt(out: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize, acc: bool) {
    gemm(
        MatMut::rows(out, m, n),
        MatRef::rows(a, m, k),
        MatRef::rows(b, n, k).t(),
        1.0,
        acc,
    );
}

/// `out (m×n) [+]= aᵀ · b` with `a: k×m`, `b: k×n`. Weight gradient: `dW += dyᵀ · x`.
pub fn matmul_at(out: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize, acc: bool) {
    gemm(
        MatMut::rows(out, m, n),
        MatRef::rows(a, k, m).t(),
        MatRef::rows(b, k, n),
        1.0,
        acc,
    );
}

/// `out (N×n) += bias (n)` on every row.
pub fn add_bias(out: &mut [f32], bias: &[f32]) {
    for row in out.chunks_exact_mut(bias.len()) {
        row.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
    }
}

/// `dbias (n) += Σ_rows dout (N×n)`, rows added in order.
pub fn bias_backward(dbias: &mut [f32], dout: &[f32]) {
    for row in dout.chunks_exact(dbias.len()) {
        dbias.iter_mut().zip(row).for_each(|(d, g)| *d += g);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{assert_close, randn};

    /// Naive f64 reference of `a (m×k) · b (k×n)`.
    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|p| f64::from(a[i * k + p]) * f64::from(b[p * n + j]))
                    .sum();
                c[i * n + j] = s as f32;
            }
        }
        c
    }

    fn transpose(a: &[f32], r: usize, c: usize) -> Vec<f32> {
        (0..c * r).map(|i| a[(i % r) * c + i / r]).collect()
    }

    #[test]
    fn three_variants_match_naive_and_accumulate() {
        let (m, k, n) = (7, 13, 5);
        let a = randn(m * k, 1, 1.0);
        let b = randn(k * n, 2, 1.0);
        let want = naive(&a, &b, m, k, n);
        let mut out = vec![f32::NAN; m * n];
        matmul(&mut out, &a, &b, m, k, n, false);
        assert_close(&out, &want, 1e-5, "matmul");
        let mut out = vec![f32::NAN; m * n];
        matmul_bt(&mut out, &a, &transpose(&b, k, n), m, k, n, false);
        assert_close(&out, &want, 1e-5, "matmul_bt");
        let mut out = vec![1.0; m * n];
        matmul_at(&mut out, &transpose(&a, m, k), &b, m, k, n, true);
        let want1: Vec<f32> = want.iter().map(|w| w + 1.0).collect();
        assert_close(&out, &want1, 1e-5, "matmul_at accumulate");
    }

    #[test]
    fn rayon_threads_give_the_same_product() {
        let (m, k, n) = (64, 96, 80);
        let (a, b) = (randn(m * k, 3, 1.0), randn(k * n, 4, 1.0));
        let mut one = vec![0.0; m * n];
        matmul(&mut one, &a, &b, m, k, n, false);
        set_threads(2);
        let mut two = vec![0.0; m * n];
        matmul(&mut two, &a, &b, m, k, n, false);
        set_threads(1);
        assert_close(&two, &one, 1e-6, "rayon matmul");
    }

    #[test]
    fn bias_add_and_reduce() {
        let mut out = vec![0.0; 6];
        add_bias(&mut out, &[1.0, 2.0, 3.0]);
        assert_eq!(out, vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
        let mut db = vec![1.0; 3];
        bias_backward(&mut db, &out);
        assert_eq!(db, vec![3.0, 5.0, 7.0]);
    }

    /// GFLOP/s of the three linear-layer products against a plain row-major gemm of the same
    /// size (single thread). Run: `cargo test --release -p tessera-runtime bench_ -- --ignored
    /// --nocapture`.
    #[test]
    #[ignore]
    fn bench_linear_products_against_plain_gemm() {
        let (n, c, f) = (1024, 768, 3072);
        let x = randn(n * c, 1, 1.0);
        let w = randn(f * c, 2, 1.0);
        let dy = randn(n * f, 3, 1.0);
        let mut y = vec![0.0; n * f];
        let mut dx = vec![0.0; n * c];
        let mut dw = vec![0.0; f * c];
        let wt = transpose(&w, f, c); // (c, f): the plain layout for x·W
        let flops = 2.0 * (n * c * f) as f64;
        let time = |name: &str, run: &mut dyn FnMut()| {
            run();
            let reps = 5;
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                run();
            }
            let gf = flops * reps as f64 / t0.elapsed().as_secs_f64() / 1e9;
            println!("{name:<28} {gf:7.1} GFLOP/s");
            gf
        };
        let base = time("plain gemm x·W (nn)", &mut || {
            matmul(&mut y, &x, &wt, n, c, f, false)
        });
        let fwd = time("forward y = x·Wᵀ (bt)", &mut || {
            matmul_bt(&mut y, &x, &w, n, c, f, false)
        });
        let bdx = time("backward dx = dy·W (nn)", &mut || {
            matmul(&mut dx, &dy, &w, n, f, c, false)
        });
        let bdw = time("backward dW += dyᵀ·x (at)", &mut || {
            matmul_at(&mut dw, &dy, &x, f, n, c, true)
        });
        println!(
            "relative to plain: fwd {:.2}, dx {:.2}, dW {:.2}",
            fwd / base,
            bdx / base,
            bdw / base
        );
    }

    #[test]
    #[should_panic(expected = "overruns")]
    fn views_are_bounds_checked() {
        let d = [0.0; 10];
        let _ = MatRef::new(&d, 2, 3, 3, 3, 1);
    }

    #[test]
    fn counting_adds_each_calls_flops() {
        // Only this test turns counting on, but other tests' gemms may run meanwhile and add
        // theirs: the count is at least this thread's.
        count_matmuls(true);
        let (a, b) = (randn(6, 1, 1.0), randn(12, 2, 1.0));
        let mut out = vec![0.0; 8];
        matmul(&mut out, &a, &b, 2, 3, 4, false);
        let on = matmul_stats();
        assert!(on.flops >= 2 * 2 * 3 * 4, "{on:?}");
        assert!(on.seconds > 0.0, "{on:?}");
        count_matmuls(false);
    }
}
