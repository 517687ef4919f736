//! Fitting a cluster preset's calibration to published runs, and checking that constants fitted
//! on some sources hold on the others (leave one source out).
//!
//! Coordinate descent over the A100 preset's fitted constants — the GEMM efficiency of the tile
//! and wave model (or, without one, the matmul efficiency curve's points, kept non-decreasing),
//! the memory efficiency and the flash-attention efficiency —
//! minimising the mean |log(predicted / measured)| of the step time plus a penalty on any run
//! worse than 20%. The NCCL efficiencies are not fitted: they are published measurements. This
//! is a developer's tool (`tessera validate-planner --fit`): it prints, it does not write presets.

use super::{replay, Family, Run, ValidationError};
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
    pub held_out: Family,
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
    let worst = logs.iter().copied().fold(0.0, f64::max);
    mean + 2.0 * (worst - 0.2).max(0.0)
}

fn summary(errs: &[f64]) -> (f64, f64) {
    (
        super::median_abs(errs),
        errs.iter().map(|e| e.abs()).fold(0.0, f64::max),
    )
}

/// Fits `start` to `runs` (A100 runs only) by coordinate descent.
pub fn fit(runs: &[Run], start: &Calibration, rounds: usize) -> Fitted {
    let mut cal = start.clone();
    let mut best = objective(&errors(runs, &cal));
    let steps = [0.9, 0.95, 0.98, 1.02, 1.05, 1.1];
    for _ in 0..rounds {
        // The tile and wave model has one GEMM factor; the legacy curve has its points.
        if cal.gemm_efficiency.is_some() {
            for k in steps {
                let mut c = cal.clone();
                c.gemm_efficiency = c.gemm_efficiency.map(|e| (e * k).min(1.0));
                let o = objective(&errors(runs, &c));
                if o < best {
                    (best, cal) = (o, c);
                }
            }
        }
        let points = match cal.gemm_efficiency {
            Some(_) => 0,
            None => cal.matmul_efficiency.len(),
        };
        for i in 0..points {
            for k in steps {
                let mut c = cal.clone();
                c.matmul_efficiency[i][1] = (c.matmul_efficiency[i][1] * k).min(1.0);
                let e = &c.matmul_efficiency;
                if e.windows(2).any(|w| w[1][1] < w[0][1]) {
                    continue;
                }
                let o = objective(&errors(runs, &c));
                if o < best {
                    (best, cal) = (o, c);
                }
            }
        }
        for which in 0..2 {
            for k in steps {
                let mut c = cal.clone();
                let x = if which == 0 {
                    &mut c.memory_efficiency
                } else {
                    &mut c.flash_attention_efficiency
                };
                *x = (*x * k).min(1.0);
                let o = objective(&errors(runs, &c));
                if o < best {
                    (best, cal) = (o, c);
                }
            }
        }
    }
    let (median, worst) = summary(&errors(runs, &cal));
    Fitted {
        calibration: cal,
        median,
        worst,
    }
}

/// For each source: the constants fitted (from `start`) on every other source, scored on it.
pub fn leave_one_source_out(scored: &[Run], start: &Calibration, rounds: usize) -> Vec<HeldOut> {
    let mut held = Vec::new();
    for fam in [
        Family::Megatron,
        Family::Korthikanti,
        Family::LlmC,
        Family::Mpt,
    ] {
        let (out, train): (Vec<Run>, Vec<Run>) =
            scored.iter().cloned().partition(|r| r.family == fam);
        let f = fit(&train, start, rounds);
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
    rounds: usize,
) -> Result<(Fitted, Vec<HeldOut>), ValidationError> {
    let scored = super::scored_runs(runs_toml, a100, h100)?;
    let all = fit(&scored, &a100.calibration, rounds);
    let held = leave_one_source_out(&scored, &a100.calibration, rounds);
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
         `../shared/groundtruth/runs.toml` for each trial). The fit is coordinate descent over the \
         GEMM efficiency of the tile and wave model (or, for a spec without one, the matmul \
         efficiency curve, kept non-decreasing), the memory efficiency and the \
         flash-attention efficiency, minimising the mean |log(predicted / measured)| of the step \
         time plus a penalty on runs worse than 20%, on the A100 runs. The NCCL efficiencies are \
         not fitted (published measurements, see specs/clusters/dgx-a100-80g.toml). The preset \
         holds an earlier run's values fitted on every source, rounded to two decimals; as the \
         fit starts from the preset, a new run refines them a little (compare the starting point \
         with the result below).\n\n\
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
            h.held_out.name(),
            h.runs,
            100.0 * h.median,
            100.0 * h.worst,
            constants(&h.fitted.calibration)
        );
    }
    out
}
