//! The file each CUDA library loads from, and whether it has the entry points this build calls.
//!
//! cudarc looks a symbol up at its first call and panics when the library lacks it ("Missing
//! symbol cuInit: dlsym failed"): a stand-in libcuda.so, or a library older than the CUDA
//! version targeted. So the probe opens the file cudarc would open (the first of
//! `cudarc::get_lib_name_candidates` that the loader finds, in cudarc's order) and looks the
//! symbols up first; and [`quietly`] keeps the panic hook silent inside `probe::guard`, which
//! turns any panic left (a symbol not listed here) into the same one-line error.

use std::cell::Cell;
use std::ffi::CString;
use std::sync::Once;

use crate::backend::GpuError;

/// One library: how cudarc names it, and the symbols called where this build uses it.
pub(super) struct Lib {
    library: &'static str,
    stems: &'static [&'static str],
    symbols: &'static [&'static str],
    fix: &'static str,
}

const TOOLKIT: &str = "install the CUDA 13 libraries (toolkit or nvidia-* wheels) and put their lib folder first on LD_LIBRARY_PATH, or take this file's folder off it";

pub(super) const DRIVER: Lib = Lib {
    library: "libcuda",
    stems: &["cuda", "nvcuda"],
    symbols: &[
        "cuInit",
        "cuDriverGetVersion",
        "cuDeviceGetCount",
        "cuDeviceGet",
        "cuDeviceGetName",
        "cuDeviceGetAttribute",
        "cuDeviceTotalMem_v2",
        "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease_v2",
        "cuCtxSetCurrent",
        "cuCtxGetCurrent",
    ],
    fix: "install the NVIDIA driver (it provides libcuda.so.1, CUDA 13 or newer), or take this file's folder off LD_LIBRARY_PATH",
};

pub(super) const CUBLAS: Lib = Lib {
    library: "libcublas",
    stems: &["cublas"],
    symbols: &[
        "cublasCreate_v2",
        "cublasDestroy_v2",
        "cublasSetStream_v2",
        "cublasGemmEx",
    ],
    fix: TOOLKIT,
};

pub(super) const CUBLASLT: Lib = Lib {
    library: "libcublasLt",
    stems: &["cublasLt"],
    symbols: &[
        "cublasLtCreate",
        "cublasLtMatmul",
        "cublasLtMatmulDescCreate",
        "cublasLtMatrixLayoutCreate",
    ],
    fix: TOOLKIT,
};

pub(super) const NVRTC: Lib = Lib {
    library: "libnvrtc",
    stems: &["nvrtc"],
    symbols: &[
        "nvrtcVersion",
        "nvrtcCreateProgram",
        "nvrtcCompileProgram",
        "nvrtcGetProgramLogSize",
        "nvrtcGetProgramLog",
        "nvrtcGetPTXSize",
        "nvrtcGetPTX",
        "nvrtcGetCUBINSize",
        "nvrtcGetCUBIN",
        "nvrtcDestroyProgram",
    ],
    fix: TOOLKIT,
};

pub(super) const NCCL: Lib = Lib {
    library: "libnccl",
    stems: &["nccl"],
    symbols: &[
        "ncclGetUniqueId",
        "ncclCommInitRank",
        "ncclAllReduce",
        "ncclCommDestroy",
    ],
    fix: "install NCCL 2 (the nvidia-nccl wheel) and link its libnccl.so.2 under a searched name (docs/cuda.md), or take this file's folder off LD_LIBRARY_PATH",
};

/// A library opened as cudarc opens it (the loader's handle, closed on drop).
struct Handle {
    ptr: *mut libc::c_void,
    name: String,
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: a handle dlopen returned, closed once; nothing from it outlives it.
        unsafe { libc::dlclose(self.ptr) };
    }
}

impl Handle {
    /// The first candidate name of `stems` that loads, in cudarc's order.
    fn open(stems: &[&str]) -> Option<Handle> {
        let names = stems
            .iter()
            .flat_map(|s| cudarc::get_lib_name_candidates(s));
        names.into_iter().find_map(|name| {
            let c = CString::new(name.clone()).ok()?;
            // SAFETY: dlopen with a NUL-terminated name; runs the library's initialisers, as
            // cudarc's own probe does. RTLD_NODELETE: closing the handle never unloads the
            // library (NVRTC crashes when it is unloaded and loaded again by cudarc).
            let ptr = unsafe {
                libc::dlopen(
                    c.as_ptr(),
                    libc::RTLD_LAZY | libc::RTLD_LOCAL | libc::RTLD_NODELETE,
                )
            };
            // Lazily: a Handle built for a null pointer would be dropped, and dlclose(NULL)
            // crashes.
            if ptr.is_null() {
                None
            } else {
                Some(Handle { ptr, name })
            }
        })
    }

    fn has(&self, symbol: &str) -> bool {
        let Ok(c) = CString::new(symbol) else {
            return false;
        };
        // SAFETY: dlsym on a live handle with a NUL-terminated name.
        !unsafe { libc::dlsym(self.ptr, c.as_ptr()) }.is_null()
    }

    /// The file the loader opened (its link map's name), or the name asked for.
    fn path(&self) -> String {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            /// The head of glibc's `struct link_map`.
            #[repr(C)]
            struct LinkMap {
                l_addr: usize,
                l_name: *const libc::c_char,
            }
            let mut map: *const LinkMap = std::ptr::null();
            // SAFETY: RTLD_DI_LINKMAP writes a `struct link_map *` for a live handle; only its
            // first two fields are read, and l_name is a NUL-terminated string glibc owns.
            let name = unsafe {
                let ok = libc::dlinfo(
                    self.ptr,
                    libc::RTLD_DI_LINKMAP,
                    (&mut map as *mut *const LinkMap).cast(),
                ) == 0;
                (ok && !map.is_null() && !(*map).l_name.is_null()).then(|| {
                    std::ffi::CStr::from_ptr((*map).l_name)
                        .to_string_lossy()
                        .into_owned()
                })
            };
            if let Some(n) = name.filter(|n| !n.is_empty()) {
                return n;
            }
        }
        self.name.clone()
    }
}

fn missing(lib: &Lib, path: String, symbol: &str) -> GpuError {
    GpuError::SymbolMissing {
        library: lib.library,
        path,
        symbol: symbol.to_string(),
        fix: lib.fix,
    }
}

/// The first of `lib`'s symbols that the file it loads from lacks; `Ok` also when no file
/// loads (whether the library is there is `is_culib_present`'s question).
pub(super) fn check(lib: &Lib) -> Result<(), GpuError> {
    let Some(h) = Handle::open(lib.stems) else {
        return Ok(());
    };
    match lib.symbols.iter().find(|s| !h.has(s)) {
        Some(s) => Err(missing(lib, h.path(), s)),
        None => Ok(()),
    }
}

/// The error for a cudarc panic message "Missing symbol NAME: …", naming the library file.
pub(super) fn from_panic(message: &str) -> Option<GpuError> {
    let symbol = message
        .strip_prefix("Missing symbol ")?
        .split(':')
        .next()?
        .trim();
    let lib = [&CUBLASLT, &CUBLAS, &NVRTC, &NCCL]
        .into_iter()
        .find(|l| symbol.starts_with(l.stems[0]))
        .unwrap_or(&DRIVER);
    let path = Handle::open(lib.stems).map_or_else(|| lib.library.to_string(), |h| h.path());
    Some(missing(lib, path, symbol))
}

thread_local! {
    /// Nesting depth of [`quietly`] on this thread.
    static QUIET: Cell<u32> = const { Cell::new(0) };
}

/// Runs `f` (which catches its own panics) with the panic hook silent on this thread: a
/// panic inside cudarc becomes an error, and its message and backtrace are not printed.
/// Panics elsewhere go to the hook that was installed before.
pub(super) fn quietly<T>(f: impl FnOnce() -> T) -> T {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if QUIET.with(Cell::get) == 0 {
                previous(info);
            }
        }));
    });
    struct Depth;
    impl Drop for Depth {
        fn drop(&mut self) {
            QUIET.with(|q| q.set(q.get().saturating_sub(1)));
        }
    }
    QUIET.with(|q| q.set(q.get() + 1));
    let _depth = Depth;
    f()
}
