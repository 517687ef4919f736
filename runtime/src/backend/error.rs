//! Errors of the CUDA backend, shared by the real backend (feature `cuda`) and its stand-in, so
//! callers match on one type whichever way the crate was built.
//!
//! Every message says what was expected, what was found and how to fix it. Library and driver
//! errors are carried as text: this type must compile without cudarc.

/// Why the CUDA backend cannot do what was asked.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GpuError {
    /// The crate was compiled without the `cuda` feature.
    #[error("built without CUDA support: rebuild with --features cuda (see docs/cuda.md)")]
    NotCompiledWithCudaSupport,
    /// A shared library could not be loaded (probed before first use: cudarc panics otherwise).
    #[error(
        "the CUDA library {library} ({what}) was not found; searched for {searched}\n  fix: {fix}"
    )]
    LibraryMissing {
        library: &'static str,
        what: &'static str,
        searched: String,
        fix: String,
    },
    /// A library loaded but lacks an entry point this build calls (a stand-in, or a version
    /// older than the one targeted): one line, the file, the symbol and the fix.
    #[error("{path} ({library}) has no symbol `{symbol}`, which this build calls: it is not a usable CUDA 13 library; fix: {fix}")]
    SymbolMissing {
        library: &'static str,
        path: String,
        symbol: String,
        fix: &'static str,
    },
    /// The driver loaded but reported no usable device.
    #[error("no CUDA device: {reason}\n  fix: {fix}")]
    NoDevice { reason: String, fix: String },
    /// The installed driver is older than the CUDA version this build targets.
    #[error("the NVIDIA driver supports CUDA {found}, this build targets CUDA {needed}\n  fix: update the driver, or rebuild tessera with the cudarc `cuda-*` feature of your CUDA version in runtime/Cargo.toml")]
    DriverTooOld { found: String, needed: String },
    /// A CUDA driver call failed.
    #[error("CUDA driver: {op}: {message}")]
    Driver { op: String, message: String },
    /// NVRTC rejected a kernel module.
    #[error("NVRTC could not compile kernel module {module} for {arch}: {message}\n{log}")]
    Compile {
        module: String,
        arch: String,
        message: String,
        log: String,
    },
    /// cuBLAS or cuBLASLt failed.
    #[error("cuBLAS: {op}: {message}")]
    Blas { op: String, message: String },
    /// NCCL failed (its error type is mapped by hand: it is not `std::error::Error`).
    #[error("NCCL: {op}: {message}")]
    Nccl { op: String, message: String },
    /// A launch or a buffer does not fit what the kernel or the device allows.
    #[error("{what}\n  fix: {fix}")]
    Unsupported { what: String, fix: String },
    /// Arguments passed to a kernel do not match its signature in the .cu source.
    #[error("kernel {kernel}: {problem}")]
    BadLaunch { kernel: String, problem: String },
    /// Host-side sizes that do not agree (a bug in the caller).
    #[error("{op}: {problem}")]
    Shape { op: String, problem: String },
}

impl GpuError {
    pub(crate) fn shape(op: &str, problem: impl Into<String>) -> Self {
        GpuError::Shape {
            op: op.to_string(),
            problem: problem.into(),
        }
    }
}
