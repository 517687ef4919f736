//! `tessera doctor`: is this machine ready for the CUDA backend? The driver and its CUDA
//! version, cuBLAS, cuBLASLt, NVRTC and NCCL (found, or the exact fix), the devices and their
//! memory, and whether the kernels compile for them. Without a GPU it says so and exits 0; with
//! one, it exits 1 if anything the backend needs is missing. A driver library that loads but
//! lacks an entry point (a stand-in libcuda.so) is named with its file and symbol, and exits 1.

use std::process::ExitCode;

use clap::Args;
use tessera_runtime::backend::cuda::doctor::Status;

use crate::output::table;

#[derive(Args)]
pub struct DoctorArgs {}

pub fn run(_args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let report = tessera_runtime::backend::cuda::doctor();
    let mut t = table(&["check", "status", "detail"], &[]);
    for c in &report.checks {
        t.add_row(vec![
            c.what.clone(),
            c.status.label().into(),
            c.detail.clone(),
        ]);
    }
    println!("{t}");
    let failed = |what: &str| {
        report
            .checks
            .iter()
            .any(|c| c.what == what && c.status == Status::Failed)
    };
    if !report.gpu_present && failed("driver (libcuda)") {
        // A driver library is there but cannot be used: whether a GPU is, nobody can say.
        eprintln!("\nnot ready: driver (libcuda) (the detail column says how to fix it)");
        return Ok(ExitCode::from(1));
    }
    if !report.gpu_present {
        println!("\nno GPU on this machine: the CPU backend (`tessera run --backend cpu`) works here; the checks above say what a GPU run would need");
        return Ok(ExitCode::SUCCESS);
    }
    let bad: Vec<&str> = report
        .checks
        .iter()
        .filter(|c| matches!(c.status, Status::Missing | Status::Failed))
        .map(|c| c.what.as_str())
        .collect();
    if bad.is_empty() {
        println!("\nready: the CUDA backend has everything it needs");
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "\nnot ready: {} (the detail column says how to fix each)",
            bad.join(", ")
        );
        Ok(ExitCode::from(1))
    }
}
