//! Library probe and device discovery: the only way into cudarc, so that a missing library or
//! device is an error with a fix, never cudarc's panic ("Unable to dynamically load …").
//!
//! Order: the driver library, then cuInit and the driver's CUDA version, then the devices. The
//! math libraries (cuBLAS, cuBLASLt, NVRTC) are probed before the kernels are used; NCCL only
//! by the NCCL communicator. Calls into cudarc after a positive probe still run under
//! [`guard`], which turns a residual panic (a symbol missing from an old library) into an error.

use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::sys::{CUdevice_attribute, CUresult};
use cudarc::driver::CudaContext;

use crate::backend::cuda::{DeviceInfo, GpuError};

mod symbols;

/// The CUDA version this build's cudarc bindings target (feature `cuda-13000`).
pub const TARGET_CUDA: i32 = 13000;

fn searched(lib: &str) -> String {
    let names = cudarc::get_lib_name_candidates(lib);
    format!(
        "{} (and {} other names) on the loader's path",
        names[..3].join(", "),
        names.len() - 3
    )
}

fn missing(library: &'static str, what: &'static str, stem: &str, fix: &str) -> GpuError {
    GpuError::LibraryMissing {
        library,
        what,
        searched: searched(stem),
        fix: fix.into(),
    }
}

/// The NVIDIA driver library (libcuda).
pub fn probe_driver() -> Result<(), GpuError> {
    // SAFETY: only tries to dlopen the candidate names; runs no library code.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        // A file that loads but lacks an entry point would panic inside cudarc at its call.
        return symbols::check(&symbols::DRIVER);
    }
    Err(missing(
        "libcuda",
        "the NVIDIA driver",
        "cuda",
        "install the NVIDIA driver (it provides libcuda.so.1); in a container, start it with the GPU runtime (e.g. docker run --gpus all)",
    ))
}

/// cuBLAS, cuBLASLt and NVRTC: what the kernels and matmuls need.
pub fn probe_math() -> Result<(), GpuError> {
    let toolkit = "install the CUDA 13 toolkit, or the nvidia-cublas / nvidia-cuda-nvrtc wheels, and put their lib folders on LD_LIBRARY_PATH";
    // SAFETY: as in probe_driver.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(missing("libcublas", "cuBLAS (matmuls)", "cublas", toolkit));
    }
    symbols::check(&symbols::CUBLAS)?;
    if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        return Err(missing(
            "libcublasLt",
            "cuBLASLt (matmuls with fused bias)",
            "cublasLt",
            toolkit,
        ));
    }
    symbols::check(&symbols::CUBLASLT)?;
    probe_nvrtc()
}

/// NVRTC alone: all that compiling the kernels needs (no driver, no device).
pub fn probe_nvrtc() -> Result<(), GpuError> {
    // SAFETY: as in probe_driver.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(missing(
            "libnvrtc",
            "NVRTC (compiles the kernels at first use)",
            "nvrtc",
            "install the CUDA 13 toolkit or `pip install nvidia-cuda-nvrtc==13.0.88`, and put its lib folder (nvidia/cu13/lib) on LD_LIBRARY_PATH",
        ));
    }
    symbols::check(&symbols::NVRTC)
}

/// Each library by itself, for `tessera doctor`: (name, found or the error with its fix).
pub fn libraries() -> Vec<(&'static str, Result<(), GpuError>)> {
    let toolkit = "install the CUDA 13 toolkit, or the nvidia-cublas wheel, and put its lib folder on LD_LIBRARY_PATH";
    // SAFETY: as in probe_driver.
    let cublas = unsafe { cudarc::cublas::sys::is_culib_present() };
    let cublas_lt = unsafe { cudarc::cublaslt::sys::is_culib_present() };
    vec![
        (
            "cuBLAS",
            if cublas {
                symbols::check(&symbols::CUBLAS)
            } else {
                Err(missing("libcublas", "cuBLAS (matmuls)", "cublas", toolkit))
            },
        ),
        (
            "cuBLASLt",
            if cublas_lt {
                symbols::check(&symbols::CUBLASLT)
            } else {
                Err(missing(
                    "libcublasLt",
                    "cuBLASLt (matmuls with fused bias)",
                    "cublasLt",
                    toolkit,
                ))
            },
        ),
        ("NVRTC", probe_nvrtc()),
        ("NCCL", probe_nccl()),
    ]
}

/// NCCL, for multi-GPU runs.
pub fn probe_nccl() -> Result<(), GpuError> {
    // SAFETY: as in probe_driver.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        return symbols::check(&symbols::NCCL);
    }
    Err(missing(
        "libnccl",
        "NCCL (collectives between GPUs)",
        "nccl",
        "NCCL installs libnccl.so.2, which cudarc does not look for: link it under a searched name, e.g. `ln -s $(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))')/lib/libnccl.so.2 ~/lib/libnccl.so` with ~/lib on LD_LIBRARY_PATH (docs/cuda.md)",
    ))
}

/// Every library the single-GPU backend needs.
pub fn probe() -> Result<(), GpuError> {
    probe_driver()?;
    probe_math()
}

/// Runs `f`, turning a panic inside cudarc into an error: a missing symbol into the error
/// that names the library file, anything else into a driver error. The panic hook stays
/// silent meanwhile (no cudarc message, no backtrace: the error says it all).
pub fn guard<T>(op: &str, f: impl FnOnce() -> Result<T, GpuError>) -> Result<T, GpuError> {
    symbols::quietly(|| catch_unwind(AssertUnwindSafe(f))).unwrap_or_else(|e| {
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic without a message".into());
        if let Some(missing) = symbols::from_panic(&msg) {
            return Err(missing);
        }
        Err(GpuError::Driver {
            op: op.into(),
            message: format!(
                "the CUDA library failed inside cudarc ({msg}); is it a CUDA {}.{} library?",
                TARGET_CUDA / 1000,
                TARGET_CUDA % 1000 / 10
            ),
        })
    })
}

pub(crate) fn driver_err(op: &str, e: impl std::fmt::Display) -> GpuError {
    GpuError::Driver {
        op: op.into(),
        message: e.to_string(),
    }
}

fn no_device(reason: &str) -> GpuError {
    GpuError::NoDevice {
        reason: reason.into(),
        fix: "check `nvidia-smi`; in a container pass the GPUs through (--gpus all); check CUDA_VISIBLE_DEVICES".into(),
    }
}

/// The driver's CUDA version (`13000` for 13.0), after initialising it.
pub fn driver_cuda_version() -> Result<i32, GpuError> {
    init_driver()?;
    guard("cuDriverGetVersion", || {
        let mut version = 0;
        // SAFETY: a plain driver entry point with a valid out-pointer.
        let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(driver_err("cuDriverGetVersion", format!("{r:?}")));
        }
        Ok(version)
    })
}

/// Initialises the driver and checks its CUDA version against [`TARGET_CUDA`].
fn init_driver() -> Result<(), GpuError> {
    probe_driver()?;
    guard("cuInit", || {
        // SAFETY: plain driver entry points with valid out-pointers.
        let r = unsafe { cudarc::driver::sys::cuInit(0) };
        match r {
            CUresult::CUDA_SUCCESS => {}
            CUresult::CUDA_ERROR_NO_DEVICE => return Err(no_device("the driver found no GPU")),
            other => return Err(driver_err("cuInit", format!("{other:?}"))),
        }
        let mut version = 0;
        let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(driver_err("cuDriverGetVersion", format!("{r:?}")));
        }
        if version < TARGET_CUDA {
            return Err(GpuError::DriverTooOld {
                found: format!("{}.{}", version / 1000, version % 1000 / 10),
                needed: format!("{}.{}", TARGET_CUDA / 1000, TARGET_CUDA % 1000 / 10),
            });
        }
        Ok(())
    })
}

/// What device `ordinal` is.
pub fn device_info(ctx: &CudaContext) -> Result<DeviceInfo, GpuError> {
    let attr = |a| {
        ctx.attribute(a)
            .map_err(|e| driver_err("cuDeviceGetAttribute", e))
    };
    Ok(DeviceInfo {
        ordinal: ctx.ordinal(),
        name: ctx.name().map_err(|e| driver_err("cuDeviceGetName", e))?,
        compute_capability: ctx
            .compute_capability()
            .map_err(|e| driver_err("compute capability", e))?,
        total_memory_bytes: ctx
            .total_mem()
            .map_err(|e| driver_err("cuDeviceTotalMem", e))? as u64,
        multiprocessors: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
        max_shared_bytes: attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )? as u32,
    })
}

/// Number of visible devices; an error (not 0) when there is none.
pub fn device_count() -> Result<usize, GpuError> {
    init_driver()?;
    let n = guard("cuDeviceGetCount", || {
        CudaContext::device_count().map_err(|e| driver_err("cuDeviceGetCount", e))
    })?;
    if n <= 0 {
        return Err(no_device("the driver reports 0 devices"));
    }
    Ok(n as usize)
}

/// The context of device `ordinal`, after the probe and the checks above.
pub fn open_context(ordinal: usize) -> Result<std::sync::Arc<CudaContext>, GpuError> {
    let n = device_count()?;
    if ordinal >= n {
        return Err(no_device(&format!("GPU {ordinal} asked for, {n} visible")));
    }
    guard("cuCtxCreate", || {
        CudaContext::new(ordinal).map_err(|e| driver_err("creating the CUDA context", e))
    })
}

/// Every visible device.
pub fn devices() -> Result<Vec<DeviceInfo>, GpuError> {
    (0..device_count()?)
        .map(|i| open_context(i).and_then(|c| guard("device info", || device_info(&c))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without the driver (CI, this crate's development machine) every entry
    /// point must return an error naming the library and a fix instead of panicking; on a GPU
    /// machine they return devices.
    #[test]
    fn missing_libraries_are_errors_not_panics() {
        match devices() {
            Ok(list) => {
                assert!(!list.is_empty());
                for d in &list {
                    eprintln!("found {d}");
                }
            }
            Err(GpuError::LibraryMissing {
                library,
                searched,
                fix,
                ..
            }) => {
                assert_eq!(library, "libcuda");
                assert!(searched.contains("libcuda.so"), "{searched}");
                assert!(!fix.is_empty());
            }
            Err(e) => eprintln!("no device here: {e}"),
        }
        if let Err(e) = probe_nccl() {
            let text = e.to_string();
            assert!(
                text.contains("libnccl.so.2") && text.contains("ln -s"),
                "{text}"
            );
        }
    }

    /// The stand-in libcuda.so of [`a_driver_without_cu_init_is_an_error_naming_the_file`].
    const STUB: &str = "TESSERA_TEST_STUB_LIBCUDA";

    /// Run in a child process whose loader path leads to a libcuda.so without `cuInit`.
    #[test]
    #[ignore = "run in a child process by a_driver_without_cu_init_is_an_error_naming_the_file"]
    fn child_probes_a_driver_without_cu_init() {
        let Ok(file) = std::env::var(STUB) else {
            return;
        };
        let e = probe_driver().expect_err("a libcuda.so without cuInit is not a driver");
        let text = e.to_string();
        assert!(matches!(e, GpuError::SymbolMissing { .. }), "{text}");
        assert!(
            text.contains(&file) && text.contains("`cuInit`") && text.contains("fix:"),
            "{text}"
        );
        assert!(!text.contains('\n'), "one line: {text}");
        // A call that skips the probe: cudarc panics, the guard answers the same, quietly.
        let e = guard("cuInit", || {
            // SAFETY: a driver entry point without pointers; cudarc panics looking it up.
            unsafe { cudarc::driver::sys::cuInit(0) };
            Ok(())
        })
        .expect_err("cuInit is missing");
        let text = e.to_string();
        assert!(text.contains(&file) && text.contains("`cuInit`"), "{text}");
        assert!(driver_cuda_version().is_err());
        println!("child: ok");
    }

    /// A library that loads but lacks a symbol cudarc calls (it panics at the call): the
    /// probe names the file and the symbol, and no panic message is printed. Builds the
    /// stand-in with `cc`, and skips with the reason where there is none.
    #[test]
    fn a_driver_without_cu_init_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("stub.c");
        std::fs::write(
            &src,
            "int cuDriverGetVersion(int *v) { *v = 13000; return 0; }\n",
        )
        .unwrap();
        let lib = dir.path().join("libcuda.so");
        match std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .args([&lib, &src])
            .output()
        {
            Ok(o) if o.status.success() => {}
            Ok(o) => {
                eprintln!("skipped: cc failed: {}", String::from_utf8_lossy(&o.stderr));
                return;
            }
            Err(e) => {
                eprintln!("skipped: no C compiler (cc) to build a stand-in libcuda.so: {e}");
                return;
            }
        }
        let o = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "backend::cuda::probe::tests::child_probes_a_driver_without_cu_init",
            ])
            .args(["--ignored", "--nocapture", "--test-threads", "1"])
            .env("LD_LIBRARY_PATH", dir.path())
            .env(STUB, &lib)
            .output()
            .unwrap();
        let (out, err) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        assert!(
            o.status.success() && out.contains("child: ok"),
            "{out}\n{err}"
        );
        assert!(
            !err.contains("Missing symbol"),
            "cudarc's panic was printed:\n{err}"
        );
    }
}
