//! Every kernel module, compiled by the real NVRTC for sm_80 (A100) and sm_90 (H100) with
//! warnings treated as errors, then assembled by ptxas with no register spills allowed. Each
//! kernel's registers are printed. CI installs NVRTC and ptxas from the `nvidia-cuda-nvrtc` and
//! `nvidia-cuda-nvcc` wheels (.ci/run) and sets `TESSERA_REQUIRE_NVRTC=1`, so there the test
//! fails rather than skips when either is missing. No GPU is needed.
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use tessera_runtime::backend::cuda::kernels::compile;
use tessera_runtime::backend::cuda::kernels::MODULES;

fn required() -> bool {
    std::env::var("TESSERA_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

/// `TESSERA_PTXAS`, else `ptxas` on PATH.
fn ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TESSERA_PTXAS") {
        return Some(PathBuf::from(p));
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join("ptxas"))
        .find(|p| p.is_file())
}

#[test]
fn every_kernel_compiles_with_nvrtc_and_ptxas_without_spills() {
    let (major, minor) = match compile::nvrtc_version() {
        Ok(v) => v,
        Err(e) if required() => panic!("TESSERA_REQUIRE_NVRTC=1 but {e}"),
        Err(e) => {
            eprintln!("skipped: NVRTC is not available here ({e})");
            return;
        }
    };
    let ptxas = ptxas();
    match &ptxas {
        None if required() => panic!("TESSERA_REQUIRE_NVRTC=1 but no ptxas (set TESSERA_PTXAS)"),
        None => eprintln!("ptxas not found: compiling with NVRTC only"),
        Some(p) => println!("ptxas: {}", p.display()),
    }
    println!("NVRTC {major}.{minor}");
    let mut kernels = 0;
    for arch in ["sm_80", "sm_90"] {
        for m in MODULES {
            let c = compile::compile(m, arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                c.log.is_empty(),
                "NVRTC warned on {}.cu for {arch} (warnings are errors):\n{}",
                m.name,
                c.log
            );
            assert!(!c.cubin.is_empty(), "{}: no CUBIN for {arch}", m.name);
            let Some(p) = &ptxas else { continue };
            let usage = compile::ptxas(p, &c.ptx, arch)
                .unwrap_or_else(|log| panic!("ptxas failed on {}.cu for {arch}:\n{log}", m.name));
            assert!(
                !usage.is_empty(),
                "ptxas reported no kernels in {}.cu",
                m.name
            );
            for k in usage {
                println!(
                    "{arch} {}.cu {}: {} registers, {} B spill stores, {} B spill loads",
                    m.name, k.kernel, k.registers, k.spill_stores, k.spill_loads
                );
                assert_eq!(
                    (k.spill_stores, k.spill_loads),
                    (0, 0),
                    "{} spills registers on {arch}",
                    k.kernel
                );
                kernels += 1;
            }
        }
    }
    println!("{kernels} kernel builds checked");
}
