//! cuBLASLt's FP8 GEMM for [`CudaLauncher`](super::CudaLauncher)'s `Launcher::gemm_fp8`,
//! through cudarc's raw cuBLASLt API (cudarc's safe `Matmul` has no FP8 types).
//!
//! `D (bf16) = scale_a · scale_b · op(A) · op(B)` with A and B `CUDA_R_8F_E4M3`, compute
//! `CUBLAS_COMPUTE_32F`, scale type `CUDA_R_32F`, C the same type and layout as D with beta 0 (the
//! type table of cublasLtMatmul allows A, B E4M3 with C, D `CUDA_R_16BF`), TRANSA = T,
//! TRANSB = N, the scales read from device memory (`CUBLASLT_MATMUL_DESC_A_SCALE_POINTER`,
//! `B_SCALE_POINTER`), fast accumulation left off (the library's default: partial sums are
//! promoted to f32), and the best algorithm of `cublasLtMatmulAlgoGetHeuristic` for a workspace
//! of this launcher's own (cudarc keeps its handle's workspace private).
//!
//! NOT YET RUN ON A GPU (docs/cuda.md): this compiles against cudarc 0.19's API; no call here has
//! executed on a device. The host side around it runs on the kernel emulator in CI.

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, Mutex};

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublaslt::sys as lt;
use cudarc::cublaslt::{result, CudaBlasLT, MatmulShared};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::gemm::ColMajorGemm;
use super::probe::{driver_err, guard};
use super::GpuError;
use half::bf16;

/// cuBLASLt's recommended workspace: 32 MiB on Hopper and later, 4 MiB before.
fn workspace_bytes(cc_major: i32) -> usize {
    if cc_major >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

fn lt_err(op: &str, e: result::CublasError) -> GpuError {
    GpuError::Blas {
        op: op.into(),
        message: format!("{e:?}"),
    }
}

/// The descriptors of one call, destroyed on drop (also when a step fails).
struct Descriptors {
    desc: lt::cublasLtMatmulDesc_t,
    layouts: Vec<lt::cublasLtMatrixLayout_t>,
    pref: lt::cublasLtMatmulPreference_t,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each handle was created by the matching cuBLASLt call and is destroyed once;
        // null ones were never created. A failed destroy leaks a descriptor: nothing to do.
        unsafe {
            if !self.pref.is_null() {
                result::destroy_matmul_pref(self.pref).ok();
            }
            for &l in &self.layouts {
                result::destroy_matrix_layout(l).ok();
            }
            if !self.desc.is_null() {
                result::destroy_matmul_desc(self.desc).ok();
            }
        }
    }
}

/// The typed operands of one FP8 GEMM: E4M3 codes four to a u32, each scale an element of an
/// f32 buffer (its index beside it), and the bf16 output. [`CudaLauncher`](super::CudaLauncher)
/// checks the buffers' kinds and passes them here.
pub(super) struct Fp8Operands<'a> {
    pub first: &'a CudaSlice<u32>,
    pub first_scale: (&'a CudaSlice<f32>, usize),
    pub second: &'a CudaSlice<u32>,
    pub second_scale: (&'a CudaSlice<f32>, usize),
    pub c: &'a CudaSlice<bf16>,
}

/// Sets one attribute of a live matmul descriptor to `value` (of the attribute's C type).
fn set_desc<T>(
    desc: lt::cublasLtMatmulDesc_t,
    attr: lt::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<(), GpuError> {
    // SAFETY: `desc` is live (the caller created it); `value` points at `size_of::<T>()` bytes
    // of the attribute's type.
    unsafe {
        result::set_matmul_desc_attribute(
            desc,
            attr,
            value as *const T as *const c_void,
            size_of::<T>(),
        )
    }
    .map_err(|e| lt_err(&format!("cublasLtMatmulDescSetAttribute({attr:?})"), e))
}

/// Whether `bytes` of a buffer of `have` bytes are addressed.
fn fits(what: &str, bytes: i64, have: usize) -> Result<(), GpuError> {
    match usize::try_from(bytes) {
        Ok(b) if b <= have => Ok(()),
        _ => Err(GpuError::shape(
            "FP8 GEMM",
            format!("{what} addresses {bytes} bytes of a buffer of {have}"),
        )),
    }
}

/// `c = first_scale · second_scale · op(first) · op(second)` on `stream` (see the module docs).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_fp8(
    blas_lt: &CudaBlasLT,
    stream: &Arc<CudaStream>,
    workspace: &Mutex<Option<CudaSlice<u8>>>,
    cc_major: i32,
    g: &ColMajorGemm,
    ops: Fp8Operands<'_>,
) -> Result<(), GpuError> {
    g.check_fp8()?;
    let (a, b, d) = (ops.first, ops.second, ops.c);
    let ((sa, first_at), (sb, second_at)) = (ops.first_scale, ops.second_scale);
    for (what, at, len) in [
        ("A's scale", first_at, sa.len()),
        ("B's scale", second_at, sb.len()),
    ] {
        if at >= len {
            return Err(GpuError::shape(
                "FP8 GEMM",
                format!("{what} is element {at} of an f32 buffer of {len}"),
            ));
        }
    }
    let (m, n, k) = (i64::from(g.m), i64::from(g.n), i64::from(g.k));
    let (lda, ldb, ldc) = (
        i64::from(g.ld_first),
        i64::from(g.ld_second),
        i64::from(g.ldc),
    );
    // TN: A is stored k × m (column-major, lda), B k × n (ldb), D m × n (ldc); one byte each.
    fits("A", lda * m, a.len() * 4)?;
    fits("B", ldb * n, b.len() * 4)?;
    fits("D", ldc * n * 2, d.len() * 2)?;

    let mut ws = workspace.lock().expect("FP8 workspace");
    if ws.is_none() {
        // SAFETY: the workspace is scratch memory cuBLASLt writes before it reads.
        let w = unsafe { stream.alloc::<u8>(workspace_bytes(cc_major)) }
            .map_err(|e| driver_err("allocating the cuBLASLt FP8 workspace", e))?;
        *ws = Some(w);
    }
    let ws = ws.as_ref().expect("allocated above");

    let (ap, _ra) = a.device_ptr(stream);
    let (bp, _rb) = b.device_ptr(stream);
    let (dp, _rd) = d.device_ptr(stream);
    let (sap, _rsa) = sa.device_ptr(stream);
    let (sbp, _rsb) = sb.device_ptr(stream);
    let (wp, _rw) = ws.device_ptr(stream);
    let a_scale: u64 = sap + (first_at * 4) as u64;
    let b_scale: u64 = sbp + (second_at * 4) as u64;
    let (alpha, beta) = (1.0f32, 0.0f32);

    guard("cuBLASLt FP8 GEMM", || {
        let mut h = Descriptors {
            desc: std::ptr::null_mut(),
            layouts: Vec::new(),
            pref: std::ptr::null_mut(),
        };
        h.desc = result::create_matmul_desc(
            lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(|e| lt_err("cublasLtMatmulDescCreate", e))?;
        let desc = h.desc;
        // The attributes are int32_t holding a cublasOperation_t (cuBLASLt's sys module has no
        // such type; cuBLAS's enum gives the values), and device pointers to the f32 scales.
        use lt::cublasLtMatmulDescAttributes_t as A;
        set_desc(
            desc,
            A::CUBLASLT_MATMUL_DESC_TRANSA,
            &(cublasOperation_t::CUBLAS_OP_T as i32),
        )?;
        set_desc(
            desc,
            A::CUBLASLT_MATMUL_DESC_TRANSB,
            &(cublasOperation_t::CUBLAS_OP_N as i32),
        )?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale)?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale)?;
        let e4m3 = lt::cudaDataType_t::CUDA_R_8F_E4M3;
        let bf16 = lt::cudaDataType_t::CUDA_R_16BF;
        for (ty, rows, cols, ld) in [
            (e4m3, k, m, lda),
            (e4m3, k, n, ldb),
            (bf16, m, n, ldc),
            (bf16, m, n, ldc),
        ] {
            let l = result::create_matrix_layout(ty, rows as u64, cols as u64, ld)
                .map_err(|e| lt_err("cublasLtMatrixLayoutCreate", e))?;
            h.layouts.push(l);
        }
        h.pref = result::create_matmul_pref()
            .map_err(|e| lt_err("cublasLtMatmulPreferenceCreate", e))?;
        let ws_bytes = workspace_bytes(cc_major);
        // SAFETY: `pref` is live; the attribute is a size_t.
        unsafe {
            result::set_matmul_pref_attribute(
                h.pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws_bytes) as *const usize as *const c_void,
                size_of::<usize>(),
            )
        }
        .map_err(|e| lt_err("cublasLtMatmulPreferenceSetAttribute", e))?;
        let handle = *blas_lt.handle();
        let (la, lb, lc, ld) = (h.layouts[0], h.layouts[1], h.layouts[2], h.layouts[3]);
        // SAFETY: every descriptor is live and describes the buffers checked above.
        let heuristic =
            unsafe { result::get_matmul_algo_heuristic(handle, h.desc, la, lb, lc, ld, h.pref) }
                .map_err(|e| {
                    lt_err(
                "cublasLtMatmulAlgoGetHeuristic (no FP8 algorithm for these sizes on this GPU?)",
                e,
            )
                })?;
        // SAFETY: the pointers are live device allocations of the sizes the layouts address
        // (checked above); the scale pointers are f32 elements inside their buffers; C is D with
        // beta 0 (never read); the workspace is ours and as large as the preference says; all
        // work is ordered on the launcher's one stream.
        unsafe {
            result::matmul(
                handle,
                h.desc,
                (&alpha) as *const f32 as *const c_void,
                (&beta) as *const f32 as *const c_void,
                ap as *const c_void,
                la,
                bp as *const c_void,
                lb,
                dp as *const c_void,
                lc,
                dp as *mut c_void,
                ld,
                &heuristic.algo,
                wp as *mut c_void,
                ws_bytes,
                stream.cu_stream() as *mut _,
            )
        }
        .map_err(|e| lt_err("cublasLtMatmul (FP8)", e))
    })
}
