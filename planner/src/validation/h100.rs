//! The H100 16-bit section of docs/validation.md: llm-foundry's published H100 sweep
//! (docs/h100-validation/runs.toml), replayed on the H100 preset as each run states its layout,
//! never fitted. The H100 preset's constants are the A100's training share applied to H100
//! kernel measurements (specs/clusters/dgx-h100-80g.toml); this is what they score on the
//! H100 runs of one framework, and what every FP8 row on an H100 carries.

use super::{extra_runs, Presets, ValidationError};

/// Where the H100 runs live, as the section names them.
pub const RUNS: &str = "docs/h100-validation/runs.toml";

/// The section's Markdown.
pub fn section(runs_toml: &str, presets: &Presets) -> Result<String, ValidationError> {
    extra_runs::section(
        "H100 16-bit runs",
        &format!("llm-foundry's published bf16 sweep on H100 80GB ({RUNS}, with its source), replayed with each run's stated layout on the H100 preset, whose constants are not fitted to any H100 run; nothing was fitted to these either."),
        runs_toml,
        presets,
    )
}
