//! Fitting a cluster preset's calibration to published runs, and checking that constants fitted
//! on some sources hold on the others (leave one source out).
//!
//! A pattern search, from what isolated kernels reach, over the A100 preset's fitted constants —
//! the GEMM efficiency of the tile and wave model (or, without one, the matmul efficiency
//! curve's points, kept non-decreasing) and the memory efficiency — minimising the mean
//! |log(predicted / measured)| of the step time (no extra weight on the worst run: one odd run
//! must not set the constants of all). The flash-attention efficiency (FlashAttention-2's
//! measured speed) and the NCCL efficiencies (published measurements) are not fitted. This
//! is a developer's tool (`tessera validate-planner --fit`): it prints, it does not write presets.

use super::{replay, sources, Run, ValidationError};
use crate::spec::{Calibration, Cluster};

/// What a fit produced, and how well it does.
#[derive(Debug, Clone)]
pub struct Fitted {
    pub calibration: Calibration,
    /// Median and worst |error| over the runs it was fitted on.
    pub median: f64,
    pub worst: f64,
}

/// Leave-one-source-out: fitted without `held_out`, then scored on it alone.
#[derive(Debug, Clone)]
pub struct HeldOut {
    /// The source held out (a known family's name, else the runs' `source`).
    pub held_out: String,
    pub fitted: Fitted,
    pub median: f64,
    pub worst: f64,
    pub runs: usize,
    /// Each held-out A100 run's signed error under the constants fitted without its source.
    pub errors: Vec<(String, f64)>,
}

fn errors(runs: &[Run], cal: &Calibration) -> Vec<f64> {
    named_errors(runs, cal)
        .into_iter()
        .map(|(_, e)| e)
        .collect()
}

/// Each A100 run's id and signed error under `cal`.
fn named_errors(runs: &[Run], cal: &Calibration) -> Vec<(String, f64)> {
    runs.iter()
        .filter(|r| r.cluster.device.name.contains("A100"))
        .filter_map(|r| {
            let mut r = r.clone();
            r.cluster.calibration = cal.clone();
            replay(&r).ok().map(|row| (row.id, row.error))
        })
        .collect()
}

fn objective(errs: &[f64]) -> f64 {
    let logs: Vec<f64> = errs.iter().map(|e| (1.0 + e).ln().abs()).collect();
    let mean = logs.iter().sum::<f64>() / logs.len().max(1) as f64;
    mean
}

fn summary(errs: &[f64]) -> (f64, f64) {
    (
        super::median_abs(errs),
        errs.iter().map(|e| e.abs()).fold(0.0, f64::max),
    )
}

/// Where every fit starts: what isolated kernels reach on the A100 (each cited in
/// specs/clusters/dgx-a100-80g.toml), so that no fit starts from constants already fitted to the
/// source it will be scored on.
/// - GEMM: cuBLAS 0.869 of peak at its best shape (271.2 TFLOPS, stas00/ml-engineering
///   "Maximum Achievable Matmul FLOPS");
/// - memory: a STREAM triad 0.863 of 2039 GB/s (gpu-benches gpu-stream/a100_80.txt).
///
/// The flash-attention efficiency is not fitted: it is FlashAttention-2's measured speed (the
/// preset cites it). Only MosaicML's runs train long sequences, so a fitted value could never be
/// checked on another source; fitted without them it ran to 1.0.
pub const KERNEL_START: [f64; 2] = [0.869, 0.863];

/// `cal` with the fitted constants set to [`KERNEL_START`].
pub fn kernel_start(cal: &Calibration) -> Calibration {
    let mut c = cal.clone();
    if c.gemm_efficiency.is_some() {
        c.gemm_efficiency = Some(KERNEL_START[0]);
    }
    c.memory_efficiency = KERNEL_START[1];
    c
}

/// The fitted constants of `cal`, as a vector (the tile model's GEMM factor, or the legacy
/// curve's points; then memory).
fn coords(cal: &Calibration) -> Vec<f64> {
    let mut v: Vec<f64> = match cal.gemm_efficiency {
        Some(g) => vec![g],
        None => cal.matmul_efficiency.iter().map(|p| p[1]).collect(),
    };
    v.push(cal.memory_efficiency);
    v
}

fn with_coords(cal: &Calibration, v: &[f64]) -> Calibration {
    let mut c = cal.clone();
    let n = v.len() - 1;
    match c.gemm_efficiency {
        Some(_) => c.gemm_efficiency = Some(v[0]),
        None => {
            for (p, x) in c.matmul_efficiency.iter_mut().zip(&v[..n]) {
                p[1] = *x;
            }
        }
    }
    c.memory_efficiency = v[n];
    c
}

/// Fits `start` to `runs` (A100 runs only) by a multiplicative pattern search run to
/// convergence: each constant is tried ×s and ÷s in turn (kept in (0, 1], the legacy curve
/// non-decreasing); a pass without an improvement shrinks s from 1.25 towards 1, and the search
/// stops when s is below 1.001 (a change of 0.1%).
pub fn fit(runs: &[Run], start: &Calibration) -> Fitted {
    let mut x = coords(start);
    let mut errs = errors(runs, start);
    let mut best = objective(&errs);
    let legacy = start.gemm_efficiency.is_none();
    let curve = x.len() - 1;
    let mut s: f64 = 1.25;
    while s > 1.001 {
        let mut improved = false;
        for i in 0..x.len() {
            for k in [s, 1.0 / s] {
                let mut y = x.clone();
                y[i] = (y[i] * k).min(1.0);
                if y[i] == x[i] || (legacy && y[..curve].windows(2).any(|w| w[1] < w[0])) {
                    continue;
                }
                let e = errors(runs, &with_coords(start, &y));
                let o = objective(&e);
                if o < best {
                    (best, x, errs, improved) = (o, y, e, true);
                    break;
                }
            }
        }
        if !improved {
            s = s.sqrt();
        }
    }
    let (median, worst) = summary(&errs);
    Fitted {
        calibration: with_coords(start, &x),
        median,
        worst,
    }
}

/// For each source: the constants fitted (from `start`) on every other source, scored on it.
pub fn leave_one_source_out(scored: &[Run], start: &Calibration) -> Vec<HeldOut> {
    let mut held = Vec::new();
    for fam in sources(scored.iter().map(|r| r.source.as_str())) {
        let (out, train): (Vec<Run>, Vec<Run>) =
            scored.iter().cloned().partition(|r| r.source == fam);
        if !out.iter().any(|r| r.cluster.device.name.contains("A100")) {
            continue;
        }
        let f = fit(&train, start);
        let errors = named_errors(&out, &f.calibration);
        let (median, worst) = summary(&errors.iter().map(|(_, e)| *e).collect::<Vec<_>>());
        held.push(HeldOut {
            held_out: fam,
            runs: errors.len(),
            fitted: f,
            median,
            worst,
            errors,
        });
    }
    held
}

/// The fit on every source, and one fit per held-out source.
pub fn fit_all(
    runs_toml: &str,
    a100: &Cluster,
    h100: &Cluster,
    start: &Calibration,
) -> Result<(Fitted, Vec<HeldOut>), ValidationError> {
    let scored = super::scored_runs(runs_toml, a100, h100)?;
    let all = fit(&scored, start);
    let held = leave_one_source_out(&scored, start);
    Ok((all, held))
}

fn constants(c: &Calibration) -> String {
    if let Some(g) = c.gemm_efficiency {
        return format!(
            "gemm_efficiency = {g:.3}, memory_efficiency = {:.3}, flash_attention_efficiency = {:.3}",
            c.memory_efficiency, c.flash_attention_efficiency
        );
    }
    let curve: Vec<String> = c
        .matmul_efficiency
        .iter()
        .map(|[d, e]| format!("[{d:.0}, {e:.3}]"))
        .collect();
    format!(
        "matmul_efficiency = [{}], memory_efficiency = {:.3}, flash_attention_efficiency = {:.3}",
        curve.join(", "),
        c.memory_efficiency,
        c.flash_attention_efficiency
    )
}

/// docs/calibration.md: the fit on every source and the leave-one-source-out check.
pub fn markdown(start: &Calibration, all: &Fitted, held: &[HeldOut], command: &str) -> String {
    let mut out = format!(
        "# Calibration of the A100 preset\n\n\
         Generated by `{command}` (minutes: it replays every scored run of \
         `../shared/groundtruth/runs.toml` for each trial). The fit is a pattern search over the \
         GEMM efficiency of the tile and wave model (or, for a spec without one, the matmul \
         efficiency curve, kept non-decreasing) and the memory efficiency, minimising the mean \
         |log(predicted / measured)| of the step time, on \
         the A100 runs, run to convergence (steps below 0.1%). Every fit starts from what \
         isolated kernels reach, never from the preset (which has seen every source). The \
         flash-attention efficiency is FlashAttention-2's measured speed and the NCCL \
         efficiencies are published measurements: neither is fitted (see \
         specs/clusters/dgx-a100-80g.toml). The preset holds the fit on every source below, \
         rounded to three decimals.\n\n\
         Started from: `{}`.\n\n\
         ## Fitted on every source\n\n`{}`\n\nmedian |error| {:.1}%, worst {:.1}%.\n\n\
         ## Does a constant fitted on some sources hold on the others?\n\n\
         Each row fits on every source but one and scores the one left out.\n\n\
         | held out | A100 runs | median abs error | worst | fitted without it |\n|---|---:|---:|---:|---|\n",
        constants(start),
        constants(&all.calibration),
        100.0 * all.median,
        100.0 * all.worst
    );
    for h in held {
        out += &format!(
            "| {} | {} | {:.1}% | {:.1}% | `{}` |\n",
            h.held_out,
            h.runs,
            100.0 * h.median,
            100.0 * h.worst,
            constants(&h.fitted.calibration)
        );
    }
    out += "\n## The CPU backend\n\n`tessera calibrate` fits a CPU cluster spec to this host by measuring it, not to published runs; docs/calibration-cpu.md has what it measures and its predictions against `tessera run`'s measured steps (`cargo bench -p tessera-runtime --bench calibrated`).\n\n## On a GPU\n\n`tessera calibrate --gpu` measures a GPU cluster's kernels through PyTorch and writes its `[calibration]` table: docs/calibration-gpu.md.\n";
    out
}
