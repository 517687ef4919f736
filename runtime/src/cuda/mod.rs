//! The CUDA backend (feature `cuda`): library probe and device discovery ([`probe`]), and the
//! [`CudaLauncher`] that runs the kernels of `crate::gpu` on one GPU. Without the feature,
//! `cuda_standin.rs` provides the same items and answers "built without CUDA support".
//!
//! Everything here is dynamically loaded (cudarc `dynamic-loading`), so building needs no CUDA
//! toolkit; using it needs the driver, cuBLAS, cuBLASLt and NVRTC of CUDA 13 (and NCCL for
//! multi-GPU runs). Missing pieces are errors with a fix, never cudarc's panics.
//!
//! Status: compiled and linted; NOT YET RUN ON A GPU. The kernels' arithmetic and the host
//! logic are tested on the CPU (emulator, `runtime/tests/ops.rs`); the cudarc calls are not.

pub mod compile;
pub mod doctor;
mod launcher;
mod nccl_device;
pub mod probe;

pub use doctor::doctor;
pub use launcher::{CudaBuf, CudaLauncher};
pub use nccl_device::{device_collective, DeviceCollective, NcclDevice};
pub use probe::{devices, probe, probe_nccl};

use crate::gpu::{GpuError, GpuKernels};

/// This build has the CUDA backend.
pub const COMPILED: bool = true;

/// The backend's kernels on GPU `ordinal` (probing the libraries and the device first).
pub fn kernels(ordinal: usize) -> Result<GpuKernels<CudaLauncher>, GpuError> {
    Ok(GpuKernels::new(CudaLauncher::open(ordinal)?))
}
