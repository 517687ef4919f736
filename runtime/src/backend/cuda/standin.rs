//! Stand-in for the cudarc parts of `backend::cuda` when the crate is built without the `cuda`
//! feature (candle's `dummy_cuda_backend` pattern): the same items, so callers compile one `match`
//! either way, and every entry point answers [`GpuError::NotCompiledWithCudaSupport`] ("built
//! without CUDA support: rebuild with --features cuda"). The launcher and buffer types are
//! uninhabited.

use crate::backend::cuda::gemm::ColMajorGemm;
use crate::backend::cuda::kernels::Module;
use crate::backend::cuda::{
    DType, DeviceInfo, Geometry, GpuError, GpuKernels, HostData, HostVec, KArg, Launcher,
};

/// This build has no CUDA backend.
pub const COMPILED: bool = false;

/// Uninhabited: no device buffer exists without the feature.
#[derive(Debug)]
pub enum CudaBuf {}

/// Uninhabited: no device can be opened without the feature.
#[derive(Clone)]
pub enum CudaLauncher {}

impl CudaLauncher {
    pub fn open(_ordinal: usize) -> Result<Self, GpuError> {
        Err(GpuError::NotCompiledWithCudaSupport)
    }

    pub fn info(&self) -> &DeviceInfo {
        match *self {}
    }
}

/// `tessera doctor` without the backend: one check, which says how to build it.
pub fn doctor() -> crate::backend::cuda::doctor::Report {
    use crate::backend::cuda::doctor::{Check, Report, Status};
    Report {
        checks: vec![Check::new(
            "CUDA backend",
            Status::NoGpu,
            "this tessera was built without CUDA support, so it cannot look for GPUs\n  fix: on a GPU machine, build with `cargo build --release --features cuda` (no CUDA toolkit is needed to build; docs/cuda.md) and run `tessera doctor` again",
        )],
        gpu_present: false,
    }
}

pub fn probe() -> Result<(), GpuError> {
    Err(GpuError::NotCompiledWithCudaSupport)
}

pub fn probe_nccl() -> Result<(), GpuError> {
    Err(GpuError::NotCompiledWithCudaSupport)
}

pub fn devices() -> Result<Vec<DeviceInfo>, GpuError> {
    Err(GpuError::NotCompiledWithCudaSupport)
}

pub fn kernels(_ordinal: usize) -> Result<GpuKernels<CudaLauncher>, GpuError> {
    Err(GpuError::NotCompiledWithCudaSupport)
}

impl Launcher for CudaLauncher {
    type Buf = CudaBuf;

    fn describe(&self) -> String {
        match *self {}
    }
    fn max_shared_bytes(&self) -> u32 {
        match *self {}
    }
    fn dtype(buf: &CudaBuf) -> DType {
        match *buf {}
    }
    fn len(buf: &CudaBuf) -> usize {
        match *buf {}
    }
    fn alloc_zeros(&self, _: DType, _: usize) -> Result<CudaBuf, GpuError> {
        match *self {}
    }
    fn upload(&self, _: HostData<'_>) -> Result<CudaBuf, GpuError> {
        match *self {}
    }
    fn download(&self, buf: &CudaBuf) -> Result<HostVec, GpuError> {
        match *buf {}
    }
    fn launch(
        &self,
        _: &'static Module,
        _: &'static str,
        _: &Geometry,
        _: &[KArg<'_, CudaBuf>],
    ) -> Result<(), GpuError> {
        match *self {}
    }
    fn gemm(
        &self,
        _: &ColMajorGemm,
        (first, _): (&CudaBuf, usize),
        _: (&CudaBuf, usize),
        _: (&CudaBuf, usize),
        _: f32,
        _: f32,
    ) -> Result<(), GpuError> {
        match *first {}
    }
    fn gemm_fp8(
        &self,
        _: &ColMajorGemm,
        first: &CudaBuf,
        _: (&CudaBuf, usize),
        _: &CudaBuf,
        _: (&CudaBuf, usize),
        _: &CudaBuf,
    ) -> Result<(), GpuError> {
        match *first {}
    }
    fn gemm_bias(
        &self,
        _: &ColMajorGemm,
        first: &CudaBuf,
        _: &CudaBuf,
        _: &mut CudaBuf,
        _: &CudaBuf,
    ) -> Result<(), GpuError> {
        match *first {}
    }
}

/// Without the feature a rank's collectives on a (never opened) GPU are the host-staged ones.
pub type DeviceCollective = crate::backend::cuda::HostStaged<CudaLauncher, crate::comm::LocalComm>;

/// See the `cuda` feature's `device_collective`; unreachable here (no device can be opened).
pub fn device_collective(
    dev: &crate::backend::cuda::Device<CudaLauncher>,
    local: crate::comm::LocalComm,
    _nccl: bool,
) -> Result<DeviceCollective, GpuError> {
    Ok(crate::backend::cuda::HostStaged::new(dev.clone(), local))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_point_says_how_to_get_cuda() {
        let text = "built without CUDA support: rebuild with --features cuda";
        assert!(probe().unwrap_err().to_string().starts_with(text));
        assert!(probe_nccl().unwrap_err().to_string().starts_with(text));
        assert!(devices().unwrap_err().to_string().starts_with(text));
        assert!(kernels(0).is_err());
        assert!(CudaLauncher::open(0).is_err());
    }
}
