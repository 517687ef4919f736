//! A section of docs/validation.md for a further file of published runs (the offload runs, the
//! H100 16-bit runs): each run replayed as it states its layout, never fitted, with its step
//! time against the prediction and whether the layout that ran is predicted to fit.

use std::fmt::Write as _;

use super::{load_with, median_abs, replay_all, Presets, ValidationError};

/// The section's Markdown: `heading`, then `intro` (which the counts of replayed runs follow),
/// the table, the median and worst |error|, and the runs not replayed with the reason.
pub fn section(
    heading: &str,
    intro: &str,
    runs_toml: &str,
    presets: &Presets,
) -> Result<String, ValidationError> {
    let (runs, skipped) = load_with(runs_toml, presets)?;
    let v = replay_all(&runs, skipped);
    let mut md = String::new();
    let _ = writeln!(md, "\n## {heading}\n");
    let _ = writeln!(
        md,
        "{intro} {} replayed with a step time, {} without one, {} not replayed.\n",
        v.scored.len(),
        v.unscored.len(),
        v.skipped.len()
    );
    if !v.scored.is_empty() || !v.unscored.is_empty() {
        let _ = writeln!(
            md,
            "| run | layout | fits | measured s | predicted s | error |\n|---|---|---|---:|---:|---:|"
        );
        for r in v.scored.iter().chain(&v.unscored) {
            let measured = if r.measured_s > 0.0 {
                format!("{:.2}", r.measured_s)
            } else {
                "-".into()
            };
            let error = if r.measured_s > 0.0 {
                format!("{:+.1}%", 100.0 * r.error)
            } else {
                "-".into()
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {measured} | {:.2} | {error} |",
                r.id,
                r.layout.label(),
                if r.fits { "yes" } else { "**no**" },
                r.predicted_s
            );
        }
        let errors: Vec<f64> = v.scored.iter().map(|r| r.error).collect();
        if !errors.is_empty() {
            let signed = errors.iter().sum::<f64>() / errors.len() as f64;
            let _ = writeln!(
                md,
                "\nMedian |error| {:.1}% over {} runs (mean signed {:+.1}%), worst {:.1}%.",
                100.0 * median_abs(&errors),
                errors.len(),
                100.0 * signed,
                100.0 * errors.iter().map(|e| e.abs()).fold(0.0, f64::max)
            );
        }
        md.push('\n');
    }
    if !v.skipped.is_empty() {
        let _ = writeln!(md, "Not replayed (the source leaves out what a replay needs, or no preset or profile holds its GPU or framework):\n\n| run | why |\n|---|---|");
        for s in &v.skipped {
            let _ = writeln!(md, "| {} | {} |", s.id, s.reason);
        }
    }
    Ok(md)
}
