//! The CUDA backend: everything GPU lives under this folder.
//!
//! | path | what | cudarc? |
//! |---|---|---|
//! | `host/` | the host side: [`Device`] (the `Backend` on a [`Launcher`]), views, launch geometry, the GEMM mapping, [`HostStaged`] collectives, [`GpuKernels`] | no |
//! | `kernels/` | the .cu sources, their signatures and the compile cache; `kernels/compile.rs`: NVRTC | `compile.rs` only |
//! | `doctor.rs` | what `tessera doctor` reports; `doctor/checks.rs`: the checks | `checks.rs` only |
//! | `launcher.rs` | [`CudaLauncher`]: the [`Launcher`] on one GPU (cudarc, cuBLAS, cuBLASLt) | yes |
//! | `fp8_gemm.rs` | the launcher's FP8 GEMM: cuBLASLt through cudarc's raw API | yes |
//! | `probe.rs`, `probe/` | library probe and device discovery | yes |
//! | `nccl.rs`, `nccl/` | `NcclComm` (one process per GPU) and the device [`Collective`](crate::backend::Collective)s on it | yes |
//! | `local.rs` | the `cuda-local` carrier: thread ranks sharing one GPU | yes |
//! | `standin.rs` | without the `cuda` feature: the same public names, each answering "built without CUDA support" | no |
//!
//! The feature-gated parts (feature `cuda`) use `host/` and `kernels/`, never the other way
//! round; `host/` and `kernels/` build and are tested without the feature (the kernels through
//! a C++ emulator of the same .cu files, `runtime/tests/emu/`). Without the feature,
//! `standin.rs` provides the same items (candle's `dummy_cuda_backend` pattern), so callers
//! compile one `match` either way.
//!
//! Everything is dynamically loaded (cudarc `dynamic-loading`), so building needs no CUDA
//! toolkit; using it needs the driver, cuBLAS, cuBLASLt and NVRTC of CUDA 13 (and NCCL for
//! multi-GPU runs). Missing pieces are errors with a fix, never cudarc's panics.

pub mod doctor;
#[cfg(feature = "cuda")]
mod fp8_gemm;
pub mod host;
pub mod kernels;
#[cfg(feature = "cuda")]
mod launcher;
#[cfg(feature = "cuda")]
pub mod local;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod probe;
#[cfg(not(feature = "cuda"))]
mod standin;

pub use crate::backend::GpuError;
pub use host::{
    gemm, launch, DMut, DRef, DType, Device, DeviceIds, DeviceInfo, Fp8Linear, Geometry,
    GpuKernels, HostData, HostStaged, HostVec, KArg, Launcher, Launches, FP8_ALIGN, FP8_STATS,
};

#[cfg(feature = "cuda")]
pub use doctor::checks::doctor;
#[cfg(feature = "cuda")]
pub use launcher::{CudaBuf, CudaLauncher};
#[cfg(feature = "cuda")]
pub use nccl::device::{device_collective, DeviceCollective, NcclDevice};
#[cfg(feature = "cuda")]
pub use probe::{devices, probe, probe_nccl};
#[cfg(not(feature = "cuda"))]
pub use standin::{
    device_collective, devices, doctor, kernels, probe, probe_nccl, CudaBuf, CudaLauncher,
    DeviceCollective, COMPILED,
};

/// This build has the CUDA backend.
#[cfg(feature = "cuda")]
pub const COMPILED: bool = true;

/// The backend's kernels on GPU `ordinal` (probing the libraries and the device first).
#[cfg(feature = "cuda")]
pub fn kernels(ordinal: usize) -> Result<GpuKernels<CudaLauncher>, GpuError> {
    Ok(GpuKernels::new(CudaLauncher::open(ordinal)?))
}
