//! The host side of the CUDA backend, built with or without the `cuda` feature: the device
//! backend ([`Device`]: buffers, views, every `Backend` kernel as launches), launch geometry, the
//! row-major → column-major GEMM mapping, the host-staged collectives ([`HostStaged`]) and
//! [`GpuKernels`], which runs [`crate::backend::ops::Kernels`] on any [`Launcher`].
//!
//! A [`Launcher`] is the only thing that touches a device: allocate, copy, launch a named kernel,
//! call a GEMM. `super::CudaLauncher` implements it with cudarc (feature `cuda`); the tests
//! implement it with a C++ emulator of the same .cu files (`runtime/tests/emu/`), so everything
//! here runs in CI on a machine without a GPU.
//!
//! This module must not depend on cudarc, nor on the feature-gated parts of `super` (launcher,
//! probe, compile, NCCL): only on `super::kernels` (the kernel list) and on `crate::backend`.

mod device;
mod device_backend;
mod device_fp8;
mod device_layers;
mod device_ring;
pub mod gemm;
pub mod launch;
mod ops;
mod staged;
mod views;

pub use super::kernels::DType;
pub use device::{Device, Launches};
pub use device_fp8::{Fp8Linear, FP8_ALIGN, FP8_STATS};
pub use launch::Geometry;
pub use ops::GpuKernels;
pub use staged::HostStaged;
pub use views::{DMut, DRef, DeviceIds};

use super::kernels::Module;
use crate::backend::GpuError;
use gemm::ColMajorGemm;

/// What device discovery reports about one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor), e.g. (9, 0) for an H100.
    pub compute_capability: (i32, i32),
    pub total_memory_bytes: u64,
    pub multiprocessors: u32,
    /// Largest dynamic shared memory one block may opt into.
    pub max_shared_bytes: u32,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GPU {}: {} (sm_{}{}, {:.1} GiB, {} SMs)",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.total_memory_bytes as f64 / (1u64 << 30) as f64,
            self.multiprocessors
        )
    }
}

/// Host data to upload.
#[derive(Debug, Clone, Copy)]
pub enum HostData<'a> {
    Bf16(&'a [u16]),
    F32(&'a [f32]),
    U32(&'a [u32]),
}

/// Host data downloaded.
#[derive(Debug, Clone, PartialEq)]
pub enum HostVec {
    Bf16(Vec<u16>),
    F32(Vec<f32>),
    U32(Vec<u32>),
}

/// One kernel argument.
#[derive(Debug)]
pub enum KArg<'a, B> {
    /// A device buffer (the kernel may write it even though it is borrowed shared: device
    /// memory is not Rust memory; ordering comes from the launcher's single stream).
    Buf(&'a B),
    /// A pointer `offset` elements into a device buffer (a view; same rules as `Buf`).
    At(&'a B, usize),
    /// A null pointer, for optional inputs the kernel tests against 0.
    Null,
    I32(i32),
    I64(i64),
    F32(f32),
}

/// What a device must do for [`GpuKernels`]. All work is ordered on one stream.
pub trait Launcher {
    type Buf;
    /// Device name, for messages.
    fn describe(&self) -> String;
    /// Largest dynamic shared memory a block may opt into.
    fn max_shared_bytes(&self) -> u32;
    fn dtype(buf: &Self::Buf) -> DType;
    fn len(buf: &Self::Buf) -> usize;
    fn alloc_zeros(&self, dtype: DType, len: usize) -> Result<Self::Buf, GpuError>;
    fn upload(&self, data: HostData<'_>) -> Result<Self::Buf, GpuError>;
    /// Waits for all queued work, then copies back.
    fn download(&self, buf: &Self::Buf) -> Result<HostVec, GpuError>;
    /// Elements `range` of a buffer (by default, the whole buffer copied back, then cut).
    fn download_range(
        &self,
        buf: &Self::Buf,
        range: std::ops::Range<usize>,
    ) -> Result<HostVec, GpuError> {
        if range.start > range.end || range.end > Self::len(buf) {
            return Err(GpuError::shape(
                "download",
                format!("elements {range:?} of a buffer of {}", Self::len(buf)),
            ));
        }
        Ok(match self.download(buf)? {
            HostVec::Bf16(v) => HostVec::Bf16(v[range].to_vec()),
            HostVec::F32(v) => HostVec::F32(v[range].to_vec()),
            HostVec::U32(v) => HostVec::U32(v[range].to_vec()),
        })
    }
    /// Launches `module::function`; [`GpuKernels`] has already checked the arguments against
    /// the kernel's signature.
    fn launch(
        &self,
        module: &'static Module,
        function: &'static str,
        geometry: &Geometry,
        args: &[KArg<'_, Self::Buf>],
    ) -> Result<(), GpuError>;
    /// `c = alpha·op(first)·op(second) + beta·c` (cublasGemmEx, f32 accumulation). `first`,
    /// `second` are bf16; `c` is bf16 or f32. Each operand is a buffer and an element offset
    /// into it; `c` is written although borrowed shared (device memory, one stream).
    fn gemm(
        &self,
        g: &ColMajorGemm,
        first: (&Self::Buf, usize),
        second: (&Self::Buf, usize),
        c: (&Self::Buf, usize),
        alpha: f32,
        beta: f32,
    ) -> Result<(), GpuError>;
    /// `c = first_scale · second_scale · op(first) · op(second)`, cuBLASLt's FP8 GEMM (f32
    /// accumulation): `first` and `second` hold E4M3 codes four a u32 word (little-endian, so
    /// byte i of the matrix is byte i of the buffer), each scale is one f32 on the device (a
    /// buffer and an element offset; the inverse of the quantization scale), `c` is bf16. Only
    /// `trans_first && !trans_second` (the "TN" layout Hopper's FP8 GEMM takes) with every size
    /// and leading dimension a multiple of 16; anything else is an error.
    fn gemm_fp8(
        &self,
        g: &ColMajorGemm,
        first: &Self::Buf,
        first_scale: (&Self::Buf, usize),
        second: &Self::Buf,
        second_scale: (&Self::Buf, usize),
        c: &Self::Buf,
    ) -> Result<(), GpuError>;
    /// `c = op(first)·op(second) + bias` broadcast over the columns of the column-major `c`
    /// (cuBLASLt with the bias epilogue); all bf16, `bias` of length `g.m`.
    fn gemm_bias(
        &self,
        g: &ColMajorGemm,
        first: &Self::Buf,
        second: &Self::Buf,
        c: &mut Self::Buf,
        bias: &Self::Buf,
    ) -> Result<(), GpuError>;
}
