//! [`Device`]: the executor's [`Backend`] on any [`Launcher`] — buffers stay on the device, views
//! are (buffer, offset, length) handles, and every kernel is one of `backend/cuda/kernels/*.cu` (or
//! a cuBLAS GEMM). The real GPU (`backend::cuda::CudaLauncher`) and the emulator of the tests run
//! the same code.
//!
//! Precision: `Storage::Bf16` buffers are bf16 (activations, working weights, activation
//! gradients), `Storage::F32` buffers f32 (statistics, gradient accumulators, master weights,
//! optimizer state). The GEMMs take bf16 operands and write bf16 outputs, or accumulate into
//! f32 (the weight gradients). Every view length is checked against the sizes the kernel will
//! address before the launch: a wrong size is an error, never an out-of-bounds write.
#![allow(clippy::too_many_arguments)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::launch::{self, n64, Geometry};
use super::views::{need, DMut, DRef};
use super::{DType, GpuError, KArg, Launcher};
use crate::backend::cuda::kernels::{self, Param};
use crate::backend::GemmShape;
use crate::backend::{Backend, Storage};

/// The device backend on launcher `L`.
#[derive(Clone)]
pub struct Device<L: Launcher> {
    launcher: L,
    /// Launches so far, shared by the clones of this device (one relaxed atomic add each).
    launches: Arc<LaunchCounter>,
}

/// Work submitted to the device: kernels of `backend/cuda/kernels/` and GEMMs (cuBLAS).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Launches {
    pub kernels: u64,
    pub gemms: u64,
}

impl Launches {
    /// Kernels and GEMMs together.
    pub fn total(&self) -> u64 {
        self.kernels + self.gemms
    }
}

impl std::ops::Sub for Launches {
    type Output = Launches;
    fn sub(self, o: Launches) -> Launches {
        Launches {
            kernels: self.kernels - o.kernels,
            gemms: self.gemms - o.gemms,
        }
    }
}

#[derive(Default)]
struct LaunchCounter {
    kernels: AtomicU64,
    gemms: AtomicU64,
}

impl<L: Launcher> Device<L> {
    pub fn new(launcher: L) -> Self {
        Device {
            launcher,
            launches: Arc::default(),
        }
    }

    pub fn launcher(&self) -> &L {
        &self.launcher
    }

    /// The kernels and GEMMs this device (and its clones) has launched so far; a launch with
    /// no work (an empty geometry) is not one. Tests difference two readings.
    pub fn launches(&self) -> Launches {
        Launches {
            kernels: self.launches.kernels.load(Ordering::Relaxed),
            gemms: self.launches.gemms.load(Ordering::Relaxed),
        }
    }

    /// Checks `args` against the kernel's signature (parsed from its .cu source) and the
    /// geometry against the device, then launches (nothing when `geometry` is `None`: no work).
    pub(super) fn run(
        &self,
        module: &str,
        function: &'static str,
        geometry: Option<Geometry>,
        args: &[KArg<'_, L::Buf>],
    ) -> Result<(), GpuError> {
        let bad = |problem: String| GpuError::BadLaunch {
            kernel: format!("{module}::{function}"),
            problem,
        };
        let m = kernels::module(module).ok_or_else(|| bad("no such module".into()))?;
        let sig =
            kernels::signature(module, function).ok_or_else(|| bad("no such kernel".into()))?;
        if sig.params.len() != args.len() {
            return Err(bad(format!(
                "{} arguments passed, the kernel takes {}",
                args.len(),
                sig.params.len()
            )));
        }
        for (i, ((param, name), arg)) in sig.params.iter().zip(args).enumerate() {
            let ok = match (param, arg) {
                (Param::Ptr { elem, .. }, KArg::Buf(b)) => L::dtype(b) == *elem,
                (Param::Ptr { elem, .. }, KArg::At(b, at)) => {
                    L::dtype(b) == *elem && *at <= L::len(b)
                }
                (Param::Ptr { .. }, KArg::Null) => true,
                (Param::I32, KArg::I32(_))
                | (Param::I64, KArg::I64(_))
                | (Param::F32, KArg::F32(_)) => true,
                _ => false,
            };
            if !ok {
                let got = match arg {
                    KArg::Buf(b) => format!("a {:?} buffer", L::dtype(b)),
                    KArg::At(b, at) => format!(
                        "a {:?} buffer of {} elements at offset {at}",
                        L::dtype(b),
                        L::len(b)
                    ),
                    KArg::Null => "null".into(),
                    KArg::I32(_) => "an i32".into(),
                    KArg::I64(_) => "an i64".into(),
                    KArg::F32(_) => "an f32".into(),
                };
                return Err(bad(format!(
                    "argument {i} ({name}) is {param:?}, got {got}"
                )));
            }
        }
        let Some(g) = geometry else {
            return Ok(());
        };
        if g.threads() % 32 != 0 || g.threads() > 1024 {
            return Err(bad(format!(
                "{} threads per block: must be whole warps, at most 1024",
                g.threads()
            )));
        }
        if g.shared_bytes > self.launcher.max_shared_bytes() {
            return Err(bad(format!(
                "{} bytes of shared memory, the device allows {}",
                g.shared_bytes,
                self.launcher.max_shared_bytes()
            )));
        }
        self.launches.kernels.fetch_add(1, Ordering::Relaxed);
        self.launcher.launch(m, function, &g, args)
    }

    /// Counts one GEMM submitted outside [`Device::gemm`] (the FP8 linear's).
    pub(super) fn count_gemm(&self) {
        self.launches.gemms.fetch_add(1, Ordering::Relaxed);
    }
}

impl<L: Launcher + Sync + 'static> Device<L>
where
    L::Buf: Send + Sync,
{
    /// Writes host values into a view (an upload, then a device copy).
    pub fn write(&self, dst: DMut<'_, L::Buf>, data: &[f32]) -> Result<(), GpuError> {
        let storage = match L::dtype(dst.buf) {
            DType::Bf16 => Storage::Bf16,
            _ => Storage::F32,
        };
        let tmp = self.upload(storage, data)?;
        self.copy(dst, Self::view(&tmp))
    }

    /// `dst (c) += Σ_chunks partial[k·stride + offset ..][..c]`.
    pub(super) fn add_partials(
        &self,
        dst: DMut<'_, L::Buf>,
        partial: &L::Buf,
        chunks: u32,
        stride: usize,
        offset: usize,
    ) -> Result<(), GpuError> {
        let c = dst.len;
        self.run(
            "reduce",
            "sum_partials",
            launch::elementwise(c as u64),
            &[
                dst.arg(),
                KArg::Buf(partial),
                KArg::I32(chunks as i32),
                KArg::I64(n64(c)),
                KArg::I64(n64(stride)),
                KArg::I64(n64(offset)),
            ],
        )
    }

    /// `out [+]= op(a) · op(b)` (row-major shapes; bf16 operands; `out` bf16, or f32 to
    /// accumulate).
    pub(super) fn gemm(
        &self,
        out: DMut<'_, L::Buf>,
        a: DRef<'_, L::Buf>,
        b: DRef<'_, L::Buf>,
        g: GemmShape,
        acc: bool,
    ) -> Result<(), GpuError> {
        need("gemm output", out.len, g.m * g.n)?;
        need("gemm A", a.len, g.m * g.k)?;
        need("gemm B", b.len, g.k * g.n)?;
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        if g.k == 0 {
            return match acc {
                true => Ok(()),
                false => self.fill(out, 0.0),
            };
        }
        let col = g.to_col_major()?;
        let beta = if acc { 1.0 } else { 0.0 };
        self.launches.gemms.fetch_add(1, Ordering::Relaxed);
        self.launcher().gemm(
            &col,
            (b.buf, b.at),
            (a.buf, a.at),
            (out.buf, out.at),
            1.0,
            beta,
        )
    }
}
