//! The offload section of docs/validation.md: the published runs that offloaded
//! (docs/offload-validation/runs.toml), replayed as they state their layout with their offload,
//! never fitted. A run that ran must be predicted to fit: the `fits` column says whether it is.

use super::{extra_runs, Presets, ValidationError};

/// Where the offload runs live, as the section names them.
pub const RUNS: &str = "docs/offload-validation/runs.toml";

/// The section's Markdown.
pub fn section(runs_toml: &str, presets: &Presets) -> Result<String, ValidationError> {
    extra_runs::section(
        "Offload runs",
        &format!("Published runs that offloaded the optimizer or the parameters to host memory or NVMe ({RUNS}, with each source), replayed with their stated layout and offload and the presets' `[host]` tiers; nothing was fitted to them. A run that ran must be predicted to fit (`fits`)."),
        runs_toml,
        presets,
    )
}
