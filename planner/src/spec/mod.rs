//! Specs: read a model or cluster file and resolve it, with located errors.
//!
//! Two phases, as in ripgrep's LowArgs → HiArgs: serde structs close to the file, then one
//! resolved, validated [`Model`] or [`Cluster`]. Only resolved types leave this module.

mod check;
mod cluster;
mod fields;
mod finetune;
mod hf;
mod host;
mod model;
mod moe;
mod moe_check;
mod optim;
mod problem;
mod raw_arch;
mod whole_run;

pub use cluster::{
    parse_cluster_toml, Calibration, Cluster, ClusterOverrides, Device, DeviceKind, Link, Overhead,
    GIB,
};
pub use finetune::{parse_targets, peft_default_targets, FineTuneOverrides};
pub use hf::parse_hf_config;
pub use host::Host;
pub use model::{parse_model_toml, TrainingOverrides, DEFAULT_VOCAB_DIVISIBLE_BY};
pub use moe::DEFAULT_ROUTER_AUX_LOSS_COEF;
pub use problem::Problem;
pub use whole_run::{Cost, Reliability, Storage};

use std::path::Path;

use crate::error::Diagnostic;
use crate::model::Model;
use crate::source::Source;

/// Loads a model spec to plan or run: a TOML spec, or a Hugging Face `config.json` (by
/// extension `.json`). A model that is read but cannot be planned yet (mixture-of-experts, MLA:
/// [`Model::plannable`]) is refused here, naming the spec's key and giving its counts.
pub fn load_model(path: &Path, over: TrainingOverrides) -> Result<Model, Diagnostic> {
    let src = Source::read(path)?;
    let model = parse(path, &src, over)?;
    if let Err(p) = model.plannable() {
        return Err(if is_json(path) {
            hf::locate(&src, p)
        } else {
            p.in_toml(&src)
        });
    }
    Ok(model)
}

/// Reads a model spec as [`load_model`] does, mixture-of-experts and MLA models included: for
/// their exact parameter counts, not for a plan.
pub fn read_model(path: &Path, over: TrainingOverrides) -> Result<Model, Diagnostic> {
    let src = Source::read(path)?;
    parse(path, &src, over)
}

fn is_json(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "json")
}

fn parse(path: &Path, src: &Source, over: TrainingOverrides) -> Result<Model, Diagnostic> {
    if is_json(path) {
        parse_hf_config(src, over)
    } else {
        parse_model_toml(src, over)
    }
}

/// Loads a cluster spec.
pub fn load_cluster(path: &Path, over: ClusterOverrides) -> Result<Cluster, Diagnostic> {
    let src = Source::read(path)?;
    parse_cluster_toml(&src, over)
}
