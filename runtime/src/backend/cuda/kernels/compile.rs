//! Compiling the kernel modules without a device: NVRTC (the library) to PTX and a CUBIN for a
//! real architecture, with the compiler's log kept, and `ptxas` (the assembler, a program) to
//! report each kernel's registers and spills. CI runs both from the `nvidia-cuda-nvrtc` and
//! `nvidia-cuda-nvcc` wheels, so every kernel is compiled by the real compiler on every change
//! (runtime/tests/nvrtc.rs); `tessera doctor` uses the same path to say whether the kernels
//! compile for the devices it finds.

use std::ffi::{CStr, CString};
use std::path::Path;
use std::process::Command;

use cudarc::nvrtc::{result, sys};

use super::{compile_options, Module};
use crate::backend::cuda::probe::{self, guard};
use crate::backend::GpuError;

/// The NVRTC library's version, (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), GpuError> {
    probe::probe_nvrtc()?;
    guard("nvrtcVersion", || {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints through valid pointers.
        let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
        r.result().map_err(|e| GpuError::Driver {
            op: "nvrtcVersion".into(),
            message: format!("{e:?}"),
        })?;
        Ok((major, minor))
    })
}

/// One module compiled for one architecture.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub module: &'static str,
    pub arch: String,
    pub ptx: String,
    /// The CUBIN NVRTC made for `arch` (an `sm_XY`), loadable by a driver older than NVRTC.
    pub cubin: Vec<u8>,
    /// NVRTC's log: warnings (empty when there are none).
    pub log: String,
}

fn nvrtc_err(module: &Module, arch: &str, message: String, log: String) -> GpuError {
    GpuError::Compile {
        module: module.name.into(),
        arch: arch.into(),
        message,
        log,
    }
}

/// Compiles `module` for `arch` (`sm_80`, `sm_90`, …) with the options the launcher uses.
pub fn compile(module: &'static Module, arch: &str) -> Result<Compiled, GpuError> {
    probe::probe_nvrtc()?;
    let options = compile_options(arch);
    let err = |m: String, log: String| nvrtc_err(module, arch, m, log);
    guard("NVRTC", || {
        let src = CString::new(module.program()).map_err(|e| err(e.to_string(), String::new()))?;
        let name = CString::new(format!("{}.cu", module.name)).expect("no NUL in a module name");
        let prog = result::create_program(&src, Some(&name))
            .map_err(|e| err(format!("{e:?}"), String::new()))?;
        // SAFETY: `prog` is a live program until destroyed below; every pointer handed to NVRTC
        // outlives the call.
        let out = unsafe {
            let compiled = result::compile_program(prog, &options);
            let log = result::get_program_log(prog)
                .map(|raw| CStr::from_ptr(raw.as_ptr()).to_string_lossy().into_owned())
                .unwrap_or_default();
            let log = log.trim_matches(char::from(0)).trim().to_string();
            match compiled {
                Err(e) => Err(err(format!("{e:?}"), log)),
                Ok(()) => {
                    let ptx =
                        result::get_ptx(prog).map_err(|e| err(format!("{e:?}"), String::new()));
                    let cubin = cubin_of(prog).map_err(|m| err(m, String::new()));
                    match (ptx, cubin) {
                        (Ok(p), Ok(cubin)) => {
                            let bytes: Vec<u8> = p.iter().map(|c| *c as u8).collect();
                            let ptx = CStr::from_bytes_until_nul(&bytes)
                                .map(|c| c.to_string_lossy().into_owned())
                                .unwrap_or_default();
                            Ok(Compiled {
                                module: module.name,
                                arch: arch.to_string(),
                                ptx,
                                cubin,
                                log,
                            })
                        }
                        (Err(e), _) | (_, Err(e)) => Err(e),
                    }
                }
            }
        };
        // SAFETY: destroys the program created above, once.
        unsafe { result::destroy_program(prog) }.ok();
        out
    })
}

/// The CUBIN of a compiled program (NVRTC makes one when the target is a real `sm_XY`).
///
/// # Safety
/// `prog` must be a program that compiled successfully and is not yet destroyed.
unsafe fn cubin_of(prog: sys::nvrtcProgram) -> Result<Vec<u8>, String> {
    let mut size = 0usize;
    sys::nvrtcGetCUBINSize(prog, &mut size)
        .result()
        .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
    let mut buf = vec![0u8; size];
    sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast())
        .result()
        .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
    Ok(buf)
}

/// What `ptxas -v` reports for one kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelUsage {
    pub kernel: String,
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// Assembles `ptx` for `arch` with the `ptxas` program and returns each kernel's registers
/// and spills (from `-v`). `Err` carries ptxas's output when it fails.
pub fn ptxas(ptxas: &Path, ptx: &str, arch: &str) -> Result<Vec<KernelUsage>, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let input = dir.path().join("module.ptx");
    std::fs::write(&input, ptx).map_err(|e| e.to_string())?;
    let out = Command::new(ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-v")
        .arg("--warn-on-spills")
        .arg(&input)
        .arg("-o")
        .arg(dir.path().join("module.cubin"))
        .output()
        .map_err(|e| format!("cannot run {}: {e}", ptxas.display()))?;
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(text);
    }
    Ok(parse_ptxas(&text))
}

/// Parses `ptxas -v`: a "Compiling entry function 'NAME'" line, then "N bytes spill stores,
/// M bytes spill loads" and "Used R registers" lines for it.
pub fn parse_ptxas(text: &str) -> Vec<KernelUsage> {
    let mut out: Vec<KernelUsage> = Vec::new();
    let number_before = |line: &str, word: &str| -> Option<u32> {
        let at = line.find(word)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    for line in text.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            out.push(KernelUsage {
                kernel: rest.split('\'').next().unwrap_or("").to_string(),
                registers: 0,
                spill_stores: 0,
                spill_loads: 0,
            });
        } else if let Some(k) = out.last_mut() {
            if let Some(n) = number_before(line, "bytes spill stores") {
                k.spill_stores = n;
            }
            if let Some(n) = number_before(line, "bytes spill loads") {
                k.spill_loads = n;
            }
            if let Some(n) = number_before(line, "registers") {
                k.registers = n;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_verbose_output_is_parsed_per_kernel() {
        let text = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'layernorm_fwd' for 'sm_90'\n\
ptxas info    : Function properties for layernorm_fwd\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 24 registers, used 0 barriers, 368 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'attention_bwd' for 'sm_90'\n\
ptxas info    : Function properties for attention_bwd\n\
    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n\
ptxas info    : Used 255 registers, used 1 barriers, 400 bytes cmem[0]\n";
        let k = parse_ptxas(text);
        assert_eq!(
            k,
            vec![
                KernelUsage {
                    kernel: "layernorm_fwd".into(),
                    registers: 24,
                    spill_stores: 0,
                    spill_loads: 0
                },
                KernelUsage {
                    kernel: "attention_bwd".into(),
                    registers: 255,
                    spill_stores: 12,
                    spill_loads: 16
                },
            ]
        );
    }
}
