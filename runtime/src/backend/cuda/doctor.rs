//! What `tessera doctor` reports about the GPU environment: one [`Check`] per library, the
//! driver, each device, and the kernels' compilation for each device's architecture. The
//! checks are made by `checks.rs` (feature `cuda`; without it, by the stand-in's `doctor`, one
//! check saying how to build with CUDA); the CLI only prints them.

#[cfg(feature = "cuda")]
pub(super) mod checks;

/// How one check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Found and working.
    Ok,
    /// Not found or not working; the detail says how to fix it.
    Missing,
    /// There is no GPU here: not a fault of the environment.
    NoGpu,
    /// Found, but failed (a kernel that does not compile, a driver call that errs).
    Failed,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Missing => "missing",
            Status::NoGpu => "no GPU",
            Status::Failed => "FAILED",
        }
    }
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub what: String,
    pub status: Status,
    /// What was found (a version, a device), or the error and its fix.
    pub detail: String,
}

impl Check {
    pub fn new(what: impl Into<String>, status: Status, detail: impl Into<String>) -> Check {
        Check {
            what: what.into(),
            status,
            detail: detail.into(),
        }
    }
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub checks: Vec<Check>,
    /// At least one GPU was found.
    pub gpu_present: bool,
}

impl Report {
    /// Whether the environment can run the CUDA backend: with a GPU, every check passed.
    /// Without one there is nothing to run on, which is not a fault: also healthy.
    pub fn healthy(&self) -> bool {
        !self.gpu_present
            || self
                .checks
                .iter()
                .all(|c| matches!(c.status, Status::Ok | Status::NoGpu))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_needs_every_check_only_where_there_is_a_gpu() {
        let missing = Check::new("NCCL", Status::Missing, "link libnccl.so");
        let no_gpu = Report {
            checks: vec![missing.clone()],
            gpu_present: false,
        };
        assert!(no_gpu.healthy());
        let gpu = Report {
            checks: vec![Check::new("GPU 0", Status::Ok, "H100"), missing],
            gpu_present: true,
        };
        assert!(!gpu.healthy());
    }
}
