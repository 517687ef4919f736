//! A broken spec rule, where it was found: the one error type of every spec check, kept apart
//! from the checks so the model, fine-tuning and optimizer types below the spec readers can
//! return it without importing the readers.

use crate::error::Diagnostic;
use crate::source::Source;

/// A broken rule: the dotted field (relative to the model or cluster), what is wrong, the fix.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub field: String,
    pub problem: String,
    pub fix: String,
}

impl Problem {
    pub(crate) fn new(field: &str, problem: impl Into<String>, fix: impl Into<String>) -> Problem {
        Problem {
            field: field.to_string(),
            problem: problem.into(),
            fix: fix.into(),
        }
    }

    /// Replaces the fix (a plan's job is fixed by re-planning as well as by editing).
    pub fn with_fix_of(self, fix: &str) -> Problem {
        Problem {
            fix: format!("{}; {fix}", self.fix),
            ..self
        }
    }

    /// The diagnostic for a TOML spec: the key's line where it is in the file.
    pub fn in_toml(self, src: &Source) -> Diagnostic {
        let at = src.toml_key(&self.field);
        Diagnostic::new(&src.path, self.field, self.problem, self.fix).at(at)
    }

    /// The diagnostic for a JSON document, the field under `prefix` (`job.model`, or "").
    pub fn in_json(self, src: &Source, prefix: &str) -> Diagnostic {
        let field = if prefix.is_empty() {
            self.field
        } else {
            format!("{prefix}.{}", self.field)
        };
        let at = src.json_key(&field);
        Diagnostic::new(&src.path, field, self.problem, self.fix).at(at)
    }
}
