//! [`CudaLauncher`]: the [`Launcher`] of one GPU, over cudarc — one context, one stream, one
//! cuBLAS and one cuBLASLt handle, and the kernel modules compiled by NVRTC at first use.
//!
//! Compiled PTX is cached per (module, architecture, source hash): in memory for the process
//! (all devices of one architecture share it) and on disk (`kernels::DiskCache`). Modules
//! are loaded once per context.
//!
//! NOT YET RUN ON A GPU (docs/cuda.md): every path below compiles and is written against
//! cudarc 0.19's API, but no call here has executed on a device.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::cublas::CudaBlas;
use cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};
use half::bf16;

use super::probe::{self, driver_err, guard};
use crate::backend::cuda::gemm::ColMajorGemm;
use crate::backend::cuda::kernels::{self, CacheKey, DiskCache, Module};
use crate::backend::cuda::{
    DType, DeviceInfo, Geometry, GpuError, HostData, HostVec, KArg, Launcher,
};

/// A device buffer.
#[derive(Debug)]
pub enum CudaBuf {
    Bf16(CudaSlice<bf16>),
    F32(CudaSlice<f32>),
    U32(CudaSlice<u32>),
}

/// Loaded kernels by (module, function), with the shared memory they were opted into.
type FunctionTable = HashMap<(&'static str, &'static str), (CudaFunction, u32)>;

/// One GPU, ready to run the backend's kernels. Cheap to clone: clones share the context, the
/// stream (so their work stays ordered) and the handles.
#[derive(Clone)]
pub struct CudaLauncher(Arc<LauncherState>);

impl std::ops::Deref for CudaLauncher {
    type Target = LauncherState;
    fn deref(&self) -> &LauncherState {
        &self.0
    }
}

/// What a [`CudaLauncher`] holds.
pub struct LauncherState {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    blas_lt: CudaBlasLT,
    info: DeviceInfo,
    arch: String,
    /// Load CUBINs instead of PTX: the NVRTC is newer than the driver, which cannot JIT its
    /// PTX (a CUBIN for the device's own architecture needs no JIT).
    cubin: bool,
    disk: DiskCache,
    functions: Mutex<FunctionTable>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// cuBLASLt's workspace for the FP8 GEMM, allocated at its first call.
    fp8_workspace: Mutex<Option<CudaSlice<u8>>>,
}

fn blas_err(op: &str, e: impl std::fmt::Debug) -> GpuError {
    GpuError::Blas {
        op: op.into(),
        message: format!("{e:?}"),
    }
}

/// PTX compiled in this process, by key.
fn ptx_cache() -> &'static Mutex<HashMap<CacheKey, Arc<String>>> {
    static PTX: OnceLock<Mutex<HashMap<CacheKey, Arc<String>>>> = OnceLock::new();
    PTX.get_or_init(Default::default)
}

impl CudaLauncher {
    /// Probes the libraries, opens device `ordinal` and creates its stream and BLAS handles.
    pub fn open(ordinal: usize) -> Result<Self, GpuError> {
        probe::probe()?;
        let ctx = probe::open_context(ordinal)?;
        guard("opening the device", || {
            let info = probe::device_info(&ctx)?;
            let stream = ctx
                .new_stream()
                .map_err(|e| driver_err("creating a stream", e))?;
            let blas = CudaBlas::new(stream.clone())
                .map_err(|e| blas_err("creating the cuBLAS handle", e))?;
            let blas_lt = CudaBlasLT::new(stream.clone())
                .map_err(|e| blas_err("creating the cuBLASLt handle", e))?;
            let arch = kernels::arch_of(info.compute_capability.0, info.compute_capability.1);
            let (major, minor) = super::kernels::compile::nvrtc_version()?;
            let cubin = major * 1000 + minor * 10 > probe::driver_cuda_version()?;
            Ok(CudaLauncher(Arc::new(LauncherState {
                ctx: ctx.clone(),
                stream,
                blas,
                blas_lt,
                info,
                arch,
                cubin,
                disk: DiskCache::from_env(),
                functions: Mutex::new(HashMap::new()),
                modules: Mutex::new(HashMap::new()),
                fp8_workspace: Mutex::new(None),
            })))
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// A new stream on this device, for a communicator: its work is ordered against
    /// [`CudaLauncher::stream`] by events its user records.
    pub fn side_stream(&self) -> Result<Arc<CudaStream>, GpuError> {
        self.ctx
            .new_stream()
            .map_err(|e| driver_err("creating a stream", e))
    }

    /// The stream every operation of this launcher is ordered on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// PTX of `module` for this device's architecture: memory cache, disk cache, or NVRTC.
    fn ptx(&self, module: &'static Module) -> Result<Arc<String>, GpuError> {
        let options = kernels::compile_options(&self.arch);
        let (major, minor) = super::kernels::compile::nvrtc_version()?;
        let key = CacheKey::new(
            module,
            &self.arch,
            &options,
            &format!("nvrtc {major}.{minor}"),
        );
        if let Some(p) = ptx_cache().lock().expect("ptx cache").get(&key) {
            return Ok(p.clone());
        }
        let text = match self.disk.load(&key) {
            Some(t) => t,
            None => {
                let opts = CompileOptions {
                    options,
                    name: Some(format!("{}.cu", module.name)),
                    ..Default::default()
                };
                let ptx = guard("NVRTC", || {
                    compile_ptx_with_opts(module.program(), opts)
                        .map_err(|e| self.compile_err(module, e))
                })?;
                let text = ptx.to_src();
                // A cache that cannot be written only costs a recompile next time.
                if let Err(e) = self.disk.store(&key, &text) {
                    eprintln!(
                        "warning: kernel cache {:?} not written: {e}",
                        self.disk.dir()
                    );
                }
                text
            }
        };
        let text = Arc::new(text);
        ptx_cache()
            .lock()
            .expect("ptx cache")
            .insert(key, text.clone());
        Ok(text)
    }

    fn compile_err(&self, module: &Module, e: CompileError) -> GpuError {
        let (message, log) = match e {
            CompileError::CompileError { nvrtc, log, .. } => {
                (format!("{nvrtc:?}"), log.to_string_lossy().into_owned())
            }
            other => (format!("{other:?}"), String::new()),
        };
        GpuError::Compile {
            module: module.name.into(),
            arch: self.arch.clone(),
            message,
            log,
        }
    }

    fn function(
        &self,
        module: &'static Module,
        name: &'static str,
        shared: u32,
    ) -> Result<CudaFunction, GpuError> {
        let mut fns = self.functions.lock().expect("function table");
        if let Some((f, opted)) = fns.get_mut(&(module.name, name)) {
            if shared > *opted {
                Self::opt_in(f, shared)?;
                *opted = shared;
            }
            return Ok(f.clone());
        }
        let m = {
            let mut mods = self.modules.lock().expect("module table");
            match mods.get(module.name) {
                Some(m) => m.clone(),
                None => {
                    let image = if self.cubin {
                        Ptx::from_binary(
                            super::kernels::compile::compile(module, &self.arch)?.cubin,
                        )
                    } else {
                        Ptx::from_src(self.ptx(module)?.as_str())
                    };
                    let m = self
                        .ctx
                        .load_module(image)
                        .map_err(|e| driver_err(&format!("loading module {}", module.name), e))?;
                    mods.insert(module.name, m.clone());
                    m
                }
            }
        };
        let f = m
            .load_function(name)
            .map_err(|e| driver_err(&format!("loading kernel {name}"), e))?;
        let opted = if shared > crate::backend::cuda::launch::DEFAULT_SHARED_LIMIT {
            Self::opt_in(&f, shared)?;
            shared
        } else {
            crate::backend::cuda::launch::DEFAULT_SHARED_LIMIT
        };
        fns.insert((module.name, name), (f.clone(), opted));
        Ok(f)
    }

    fn opt_in(f: &CudaFunction, bytes: u32) -> Result<(), GpuError> {
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e| driver_err("raising the kernel's shared memory limit", e))
    }

    fn elem_size(buf: &CudaBuf) -> usize {
        match buf {
            CudaBuf::Bf16(_) => 2,
            CudaBuf::F32(_) | CudaBuf::U32(_) => 4,
        }
    }

    fn bf16_ptr<'a>(buf: &'a CudaBuf, what: &str) -> Result<&'a CudaSlice<bf16>, GpuError> {
        match buf {
            CudaBuf::Bf16(s) => Ok(s),
            _ => Err(GpuError::shape("gemm", format!("{what} must be bf16"))),
        }
    }
}

fn op(trans: bool) -> cublasOperation_t {
    if trans {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    }
}

static NULL_POINTER: u64 = 0;

impl Launcher for CudaLauncher {
    type Buf = CudaBuf;

    fn describe(&self) -> String {
        format!("cuda {}", self.info)
    }

    fn max_shared_bytes(&self) -> u32 {
        self.info.max_shared_bytes
    }

    fn dtype(buf: &CudaBuf) -> DType {
        match buf {
            CudaBuf::Bf16(_) => DType::Bf16,
            CudaBuf::F32(_) => DType::F32,
            CudaBuf::U32(_) => DType::U32,
        }
    }

    fn len(buf: &CudaBuf) -> usize {
        match buf {
            CudaBuf::Bf16(s) => s.len(),
            CudaBuf::F32(s) => s.len(),
            CudaBuf::U32(s) => s.len(),
        }
    }

    fn alloc_zeros(&self, dtype: DType, len: usize) -> Result<CudaBuf, GpuError> {
        let e = |e| driver_err("cuMemAlloc", e);
        Ok(match dtype {
            DType::Bf16 => CudaBuf::Bf16(self.stream.alloc_zeros(len).map_err(e)?),
            DType::F32 => CudaBuf::F32(self.stream.alloc_zeros(len).map_err(e)?),
            DType::U32 => CudaBuf::U32(self.stream.alloc_zeros(len).map_err(e)?),
        })
    }

    fn upload(&self, data: HostData<'_>) -> Result<CudaBuf, GpuError> {
        let e = |e| driver_err("copy to the device", e);
        Ok(match data {
            HostData::Bf16(v) => {
                let v: Vec<bf16> = v.iter().map(|&b| bf16::from_bits(b)).collect();
                CudaBuf::Bf16(self.stream.clone_htod(&v).map_err(e)?)
            }
            HostData::F32(v) => CudaBuf::F32(self.stream.clone_htod(v).map_err(e)?),
            HostData::U32(v) => CudaBuf::U32(self.stream.clone_htod(v).map_err(e)?),
        })
    }

    fn download(&self, buf: &CudaBuf) -> Result<HostVec, GpuError> {
        let e = |e| driver_err("copy from the device", e);
        let out = match buf {
            CudaBuf::Bf16(s) => HostVec::Bf16(
                self.stream
                    .clone_dtoh(s)
                    .map_err(e)?
                    .iter()
                    .map(|b| b.to_bits())
                    .collect(),
            ),
            CudaBuf::F32(s) => HostVec::F32(self.stream.clone_dtoh(s).map_err(e)?),
            CudaBuf::U32(s) => HostVec::U32(self.stream.clone_dtoh(s).map_err(e)?),
        };
        self.stream
            .synchronize()
            .map_err(|e| driver_err("synchronize", e))?;
        Ok(out)
    }

    fn launch(
        &self,
        module: &'static Module,
        function: &'static str,
        g: &Geometry,
        args: &[KArg<'_, CudaBuf>],
    ) -> Result<(), GpuError> {
        let f = self.function(module, function, g.shared_bytes)?;
        // Views (`KArg::At`) are passed as raw device addresses: base + offset · element size.
        // The guards keep the stream's read/write tracking alive until the launch is queued.
        let mut guards = Vec::new();
        let mut addresses = Vec::new();
        for a in args {
            if let KArg::At(buf, at) = a {
                let (base, guard) = match buf {
                    CudaBuf::Bf16(x) => x.device_ptr(&self.stream),
                    CudaBuf::F32(x) => x.device_ptr(&self.stream),
                    CudaBuf::U32(x) => x.device_ptr(&self.stream),
                };
                guards.push(guard);
                addresses.push(base + (*at * Self::elem_size(buf)) as u64);
            }
        }
        let mut b = self.stream.launch_builder(&f);
        let mut next = addresses.iter();
        for a in args {
            match a {
                KArg::Buf(CudaBuf::Bf16(s)) => b.arg(s),
                KArg::Buf(CudaBuf::F32(s)) => b.arg(s),
                KArg::Buf(CudaBuf::U32(s)) => b.arg(s),
                KArg::At(..) => b.arg(next.next().expect("one address per view")),
                KArg::Null => b.arg(&NULL_POINTER),
                KArg::I32(x) => b.arg(x),
                KArg::I64(x) => b.arg(x),
                KArg::F32(x) => b.arg(x),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: g.grid,
            block_dim: g.block,
            shared_mem_bytes: g.shared_bytes,
        };
        // SAFETY: the arguments were checked against the kernel's signature parsed from its
        // source (count, pointer element types, scalar widths) by GpuKernels before this call,
        // and the geometry against the kernel's assumptions (host::launch).
        unsafe { b.launch(cfg) }.map_err(|e| driver_err(&format!("launching {function}"), e))?;
        Ok(())
    }

    fn gemm(
        &self,
        g: &ColMajorGemm,
        (first, fo): (&CudaBuf, usize),
        (second, so): (&CudaBuf, usize),
        (c, co): (&CudaBuf, usize),
        alpha: f32,
        beta: f32,
    ) -> Result<(), GpuError> {
        let (a, b) = (Self::bf16_ptr(first, "A")?, Self::bf16_ptr(second, "B")?);
        let s = &self.stream;
        let (ap, _ra) = a.device_ptr(s);
        let (bp, _rb) = b.device_ptr(s);
        // C is written through a shared borrow: device memory is not Rust memory, and all work
        // is ordered on this one stream.
        let (cp, ct, _rc) = match c {
            CudaBuf::Bf16(x) => {
                let (p, r) = x.device_ptr(s);
                (p + (co * 2) as u64, cudaDataType_t::CUDA_R_16BF, r)
            }
            CudaBuf::F32(x) => {
                let (p, r) = x.device_ptr(s);
                (p + (co * 4) as u64, cudaDataType_t::CUDA_R_32F, r)
            }
            CudaBuf::U32(_) => return Err(GpuError::shape("gemm", "C must be bf16 or f32")),
        };
        let (ap, bp) = (ap + (fo * 2) as u64, bp + (so * 2) as u64);
        // SAFETY: the pointers are live device allocations, offset within them, of the sizes
        // the column-major arguments address (the caller sized them from the same shapes).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                op(g.trans_first),
                op(g.trans_second),
                g.m,
                g.n,
                g.k,
                (&alpha) as *const f32 as *const c_void,
                ap as *const c_void,
                cudaDataType_t::CUDA_R_16BF,
                g.ld_first,
                bp as *const c_void,
                cudaDataType_t::CUDA_R_16BF,
                g.ld_second,
                (&beta) as *const f32 as *const c_void,
                cp as *mut c_void,
                ct,
                g.ldc,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| blas_err("cublasGemmEx", e))
    }

    fn gemm_fp8(
        &self,
        g: &ColMajorGemm,
        first: &CudaBuf,
        first_scale: (&CudaBuf, usize),
        second: &CudaBuf,
        second_scale: (&CudaBuf, usize),
        c: &CudaBuf,
    ) -> Result<(), GpuError> {
        fn codes<'b>(buf: &'b CudaBuf, what: &str) -> Result<&'b CudaSlice<u32>, GpuError> {
            match buf {
                CudaBuf::U32(s) => Ok(s),
                _ => Err(GpuError::shape(
                    "FP8 GEMM",
                    format!("{what} must be E4M3 codes in a u32 buffer"),
                )),
            }
        }
        fn scale<'b>(buf: &'b CudaBuf, what: &str) -> Result<&'b CudaSlice<f32>, GpuError> {
            match buf {
                CudaBuf::F32(s) => Ok(s),
                _ => Err(GpuError::shape(
                    "FP8 GEMM",
                    format!("{what} must be an element of an f32 buffer"),
                )),
            }
        }
        let CudaBuf::Bf16(d) = c else {
            return Err(GpuError::shape("FP8 GEMM", "D must be bf16"));
        };
        let ops = super::fp8_gemm::Fp8Operands {
            first: codes(first, "A")?,
            first_scale: (scale(first_scale.0, "A's scale")?, first_scale.1),
            second: codes(second, "B")?,
            second_scale: (scale(second_scale.0, "B's scale")?, second_scale.1),
            c: d,
        };
        super::fp8_gemm::gemm_fp8(
            &self.blas_lt,
            &self.stream,
            &self.fp8_workspace,
            self.info.compute_capability.0,
            g,
            ops,
        )
    }

    fn gemm_bias(
        &self,
        g: &ColMajorGemm,
        first: &CudaBuf,
        second: &CudaBuf,
        c: &mut CudaBuf,
        bias: &CudaBuf,
    ) -> Result<(), GpuError> {
        let (a, b, bi) = (
            Self::bf16_ptr(first, "A")?,
            Self::bf16_ptr(second, "B")?,
            Self::bf16_ptr(bias, "bias")?,
        );
        let CudaBuf::Bf16(c) = c else {
            return Err(GpuError::shape("gemm_bias", "C must be bf16"));
        };
        let cfg = MatmulConfig {
            transa: g.trans_first,
            transb: g.trans_second,
            transc: false,
            m: g.m as u64,
            n: g.n as u64,
            k: g.k as u64,
            alpha: 1.0,
            lda: i64::from(g.ld_first),
            ldb: i64::from(g.ld_second),
            beta: 0.0,
            ldc: i64::from(g.ldc),
            stride_a: None,
            stride_b: None,
            stride_c: None,
            stride_bias: None,
            batch_size: None,
        };
        // SAFETY: as in `gemm`; the bias has g.m elements (the output features).
        unsafe { self.blas_lt.matmul(cfg, a, b, c, Some(bi), None) }
            .map_err(|e| blas_err("cublasLtMatmul (bias epilogue)", e))
    }
}
