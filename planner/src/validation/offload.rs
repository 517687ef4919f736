//! The offload section of docs/validation.md: the published runs that offloaded
//! (docs/offload-validation/runs.toml), replayed as they state their layout with their offload,
//! never fitted. A run that ran must be predicted to fit: the `fits` column says whether it is.

use std::fmt::Write as _;

use super::{load_with, replay_all, Presets, ValidationError};

/// Where the offload runs live, as the section names them.
pub const RUNS: &str = "docs/offload-validation/runs.toml";

/// The section's Markdown.
pub fn section(runs_toml: &str, presets: &Presets) -> Result<String, ValidationError> {
    let (runs, skipped) = load_with(runs_toml, presets)?;
    let v = replay_all(&runs, skipped);
    let mut md = String::new();
    let _ = writeln!(md, "\n## Offload runs\n");
    let _ = writeln!(
        md,
        "Published runs that offloaded the optimizer or the parameters to host memory or NVMe ({RUNS}, with each source), replayed with their stated layout and offload and the presets' `[host]` tiers; nothing was fitted to them. A run that ran must be predicted to fit (`fits`). {} replayed with a step time, {} without one, {} not replayed.\n",
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
