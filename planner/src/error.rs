//! Errors of the planner crate.
//!
//! Every user-facing problem with an input file becomes one [`Diagnostic`]: the file, the line and
//! column where known, the field, what is wrong, and how to fix it. The CLI prints it as one
//! message and exits with code 2. This module must not print or exit by itself.

use std::fmt;
use std::path::{Path, PathBuf};

/// One located problem in an input file, with the fix.
#[derive(Debug, Clone, PartialEq)]
pub struct Diagnostic {
    /// The file the problem is in (a spec, a plan, or `<command line>`).
    pub file: PathBuf,
    /// 1-based line and column, where the problem can be located.
    pub location: Option<(usize, usize)>,
    /// Dotted path of the field (`architecture.heads`), or `-` for the whole file.
    pub field: String,
    /// What is wrong: what was expected and what was found.
    pub problem: String,
    /// How to fix it.
    pub fix: String,
}

impl std::error::Error for Diagnostic {}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some((line, col)) = self.location {
            write!(f, ":{line}:{col}")?;
        }
        if self.field == "-" {
            // A problem with the whole file (unreadable, not JSON): there is no field to name.
            write!(f, ": {}\n  fix: {}", self.problem, self.fix)
        } else {
            write!(
                f,
                ": `{}`: {}\n  fix: {}",
                self.field, self.problem, self.fix
            )
        }
    }
}

impl Diagnostic {
    pub fn new(
        file: impl AsRef<Path>,
        field: impl Into<String>,
        problem: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Diagnostic {
            file: file.as_ref().to_path_buf(),
            location: None,
            field: field.into(),
            problem: problem.into(),
            fix: fix.into(),
        }
    }

    pub fn at(mut self, location: Option<(usize, usize)>) -> Self {
        self.location = location;
        self
    }
}

/// The planner's error type.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A problem with an input file or a command-line value.
    #[error("{0}")]
    Input(Box<Diagnostic>),
    /// No layout of the cluster fits the model in memory.
    #[error("no layout of {devices} devices fits {model}: the smallest layout needs {} per device ({layout}), the device has {}\n  fix: {fix}", crate::units::bytes(*.need_bytes as f64), crate::units::bytes(*.have_bytes as f64))]
    NothingFits {
        model: String,
        devices: u64,
        layout: String,
        need_bytes: u64,
        have_bytes: u64,
        fix: String,
    },
    /// The pinned layout cannot be built (degrees do not divide, etc.).
    #[error("{0}")]
    Layout(Box<Diagnostic>),
}

impl From<Diagnostic> for PlanError {
    fn from(d: Diagnostic) -> Self {
        PlanError::Input(Box::new(d))
    }
}
