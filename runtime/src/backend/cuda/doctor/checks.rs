//! `tessera doctor` with the CUDA backend built in: probes each library by itself (so one
//! missing library does not hide the others), the driver and its CUDA version, the devices,
//! and compiles every kernel module for each device's architecture with NVRTC.

use std::collections::BTreeSet;

use super::{Check, Report, Status};
use crate::backend::cuda::kernels::{self, compile, MODULES};
use crate::backend::cuda::probe;
use crate::backend::GpuError;

fn from(what: &str, r: Result<String, GpuError>) -> Check {
    match r {
        Ok(detail) => Check::new(what, Status::Ok, detail),
        Err(e @ GpuError::NoDevice { .. }) => Check::new(what, Status::NoGpu, e.to_string()),
        Err(e @ GpuError::LibraryMissing { .. }) => {
            Check::new(what, Status::Missing, e.to_string())
        }
        Err(e) => Check::new(what, Status::Failed, e.to_string()),
    }
}

/// Compiles every kernel module for `arch`.
fn kernels_for(arch: &str) -> Result<String, GpuError> {
    for m in MODULES {
        compile::compile(m, arch)?;
    }
    Ok(format!(
        "all {} kernel modules compile with NVRTC",
        MODULES.len()
    ))
}

/// Runs every check.
pub fn doctor() -> Report {
    let driver_found = probe::probe_driver();
    let have_driver = driver_found.is_ok();
    // A driver library that loads but lacks entry points: no GPU can be reached through it.
    let driver_unusable = matches!(driver_found, Err(GpuError::SymbolMissing { .. }));
    let mut checks = vec![from(
        "driver (libcuda)",
        driver_found.map(|()| "found".into()),
    )];
    if have_driver {
        let driver = probe::driver_cuda_version();
        checks.push(from(
            "driver CUDA version",
            driver.map(|v| {
                format!(
                    "{}.{} (this build targets {}.{})",
                    v / 1000,
                    v % 1000 / 10,
                    probe::TARGET_CUDA / 1000,
                    probe::TARGET_CUDA % 1000 / 10
                )
            }),
        ));
    }
    for (what, r) in probe::libraries() {
        checks.push(from(what, r.map(|()| "found".into())));
    }
    let have_nvrtc = match compile::nvrtc_version() {
        Ok((a, b)) => {
            checks.push(Check::new("NVRTC version", Status::Ok, format!("{a}.{b}")));
            true
        }
        Err(_) => false,
    };
    let devices = if have_driver {
        probe::devices()
    } else {
        Ok(Vec::new())
    };
    let mut archs = BTreeSet::new();
    let gpu_present = match devices {
        Ok(list) if !list.is_empty() => {
            for d in &list {
                archs.insert(kernels::arch_of(
                    d.compute_capability.0,
                    d.compute_capability.1,
                ));
                checks.push(Check::new(
                    format!("GPU {}", d.ordinal),
                    Status::Ok,
                    d.to_string(),
                ));
            }
            true
        }
        Ok(_) => {
            let why = if have_driver {
                "the driver lists none"
            } else if driver_unusable {
                "the driver library is not usable (see driver (libcuda)), so no GPU can be used"
            } else {
                "no NVIDIA driver on this machine, so no GPU can be used"
            };
            checks.push(Check::new("GPUs", Status::NoGpu, why));
            false
        }
        Err(e) => {
            let mut c = from("GPUs", Err(e));
            if c.status == Status::Missing {
                // No driver at all: as far as this machine goes, there is no GPU.
                c.status = Status::NoGpu;
            }
            checks.push(c);
            false
        }
    };
    if gpu_present {
        for arch in &archs {
            checks.push(from(&format!("kernels for {arch}"), kernels_for(arch)));
        }
    } else if have_nvrtc {
        // No device, but the compiler is here: show that the kernels build for an H100.
        checks.push(from("kernels for sm_90", kernels_for("sm_90")));
    }
    Report {
        checks,
        gpu_present,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On this crate's development machine and in CI there is no driver: the report says so,
    /// names each missing library with a fix, and counts as healthy (nothing to run on).
    /// On a GPU machine it lists the devices.
    #[test]
    fn the_report_names_every_library_and_never_panics() {
        let r = doctor();
        for c in &r.checks {
            eprintln!("{:24} {:8} {}", c.what, c.status.label(), c.detail);
        }
        for lib in ["driver (libcuda)", "cuBLAS", "cuBLASLt", "NVRTC", "NCCL"] {
            assert!(r.checks.iter().any(|c| c.what == lib), "no check of {lib}");
        }
        if !r.gpu_present {
            assert!(r.healthy());
            assert!(r.checks.iter().any(|c| c.status == Status::NoGpu));
        } else {
            assert!(r.checks.iter().any(|c| c.what.starts_with("GPU 0")));
        }
    }
}
