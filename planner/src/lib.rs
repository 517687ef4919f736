//! Tessera planner: from a model spec and a cluster spec to a 3D-parallel plan.
//!
//! The flow: `spec` reads files into a resolved [`Model`] and [`Cluster`]; `search` enumerates
//! [`Layout`]s, prunes them with the `memory` model, splits the layers over the stages
//! (`partition`) and ranks them by the `cost` model's predicted step time; `plan` turns the
//! chosen layout into the versioned plan.json document; `validation` replays published runs.
//! `mesh` and `schedule` are shared with the runtime, which executes exactly what the plan says.

pub mod batch_law;
pub mod cost;
pub mod error;
pub mod export;
pub mod finetune;
pub mod fp8;
pub mod framework;
pub mod layout;
pub mod memory;
pub mod mesh;
pub mod model;
pub mod optimizer;
pub mod partition;
pub mod picture;
pub mod plan;
pub mod precision;
pub mod schedule;
pub mod search;
pub mod source;
pub mod spec;
pub mod trace;
pub mod units;
pub mod validation;
pub mod whole_run;

pub use error::{Diagnostic, PlanError};
pub use layout::{Layout, Recompute, Sharding};
pub use mesh::Mesh;
pub use model::Model;
pub use spec::Cluster;
