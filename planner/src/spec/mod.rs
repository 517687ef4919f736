//! Specs: read a model or cluster file and resolve it, with located errors.
//!
//! Two phases, as in ripgrep's LowArgs → HiArgs: serde structs close to the file, then one
//! resolved, validated [`Model`] or [`Cluster`]. Only resolved types leave this module.

mod check;
mod cluster;
mod fields;
mod hf;
mod model;
mod optim;

pub use check::Problem;
pub use cluster::{
    parse_cluster_toml, Calibration, Cluster, ClusterOverrides, Device, DeviceKind, Link, Overhead,
    GIB,
};
pub use hf::parse_hf_config;
pub use model::{parse_model_toml, TrainingOverrides, DEFAULT_VOCAB_DIVISIBLE_BY};

use std::path::Path;

use crate::error::Diagnostic;
use crate::model::Model;
use crate::source::Source;

/// Loads a model spec: a TOML spec, or a Hugging Face `config.json` (by extension `.json`).
pub fn load_model(path: &Path, over: TrainingOverrides) -> Result<Model, Diagnostic> {
    let src = Source::read(path)?;
    if path.extension().is_some_and(|e| e == "json") {
        parse_hf_config(&src, over)
    } else {
        parse_model_toml(&src, over)
    }
}

/// Loads a cluster spec.
pub fn load_cluster(path: &Path, over: ClusterOverrides) -> Result<Cluster, Diagnostic> {
    let src = Source::read(path)?;
    parse_cluster_toml(&src, over)
}
