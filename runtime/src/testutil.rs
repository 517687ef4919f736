//! Test helpers shared by the kernel and layer tests: random data, finite differences, and
//! closeness checks. Test-only; must not be used by library code.

use crate::rng;

/// `n` values of N(0, std) from the counter RNG.
pub fn randn(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let mut v = vec![0.0; n];
    rng::fill_normal(&mut v, seed, 0xfeed, 0, std);
    v
}

/// Largest |x|.
pub fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// Asserts `max|a−b| ≤ rtol · max|b|` (relative to the tensor's scale, so entries that cancel
/// to ~0 are judged against the tensor's magnitude, not their own).
pub fn assert_close(a: &[f32], b: &[f32], rtol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    let scale = max_abs(b).max(1e-30);
    let (i, err) = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .enumerate()
        .fold(
            (0, 0.0f32),
            |m, (i, e)| if e > m.1 || e.is_nan() { (i, e) } else { m },
        );
    assert!(
        err <= rtol * scale,
        "{what}: max error {err:e} at {i} ({} vs {}) exceeds {rtol:e} × scale {scale:e}",
        a[i],
        b[i]
    );
}

/// Checks `analytic` = d loss / d x by a 4-point central difference at up to `samples`
/// coordinates of `x` (all when fewer): error ≤ `tol · max|analytic|`. `loss` runs the forward
/// on the perturbed input; accumulate it in f64.
pub fn fd_check(
    what: &str,
    x: &[f32],
    analytic: &[f32],
    h: f32,
    tol: f64,
    samples: usize,
    mut loss: impl FnMut(&[f32]) -> f64,
) {
    assert_eq!(x.len(), analytic.len(), "{what}: gradient length");
    let scale = f64::from(max_abs(analytic)).max(1e-12);
    let step = x.len().div_ceil(samples.max(1)).max(1);
    let mut xp = x.to_vec();
    for i in (0..x.len()).step_by(step) {
        let mut at = |d: f32| {
            xp[i] = x[i] + d;
            let l = loss(&xp);
            xp[i] = x[i];
            l
        };
        // Use the actually representable perturbations so f32 rounding of x+h does not bias.
        let h1 = f64::from((x[i] + h) - x[i]);
        let h2 = f64::from((x[i] + 2.0 * h) - x[i]);
        assert!(
            (h2 - 2.0 * h1).abs() < 1e-3 * h1,
            "{what}: pick h as a power of two"
        );
        let fd = (8.0 * (at(h) - at(-h)) - (at(2.0 * h) - at(-2.0 * h))) / (12.0 * h1);
        let an = f64::from(analytic[i]);
        assert!(
            (fd - an).abs() <= tol * scale,
            "{what}[{i}]: finite difference {fd:e} vs analytic {an:e} (scale {scale:e})"
        );
    }
}

/// Σ out·w in f64: a scalar loss with a non-trivial gradient `w` for every output.
pub fn weighted(out: &[f32], w: &[f32]) -> f64 {
    out.iter()
        .zip(w)
        .map(|(&o, &w)| f64::from(o) * f64::from(w))
        .sum()
}
