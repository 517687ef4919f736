//! The one executor on the CUDA kernels: the tiny model trained by `exec::train_on` with the
//! device backend (`backend::cuda::Device`) over the kernel emulator (`emu/`), compared with the CPU
//! backend's run of the same plan. The device keeps bf16 weights and activations (f32 master
//! weights, gradients and optimizer state), the CPU f32 throughout, so losses agree to bf16
//! accuracy, not bit for bit. Collectives go through host memory (`backend::cuda::HostStaged`).
//!
//! Skips, with the reason printed, where there is no C++ compiler for the emulator.

#[allow(dead_code)]
mod emu;
mod exec_common;

use exec_common::{
    assert_close, losses, on_cpu, on_device, one_rank, tp2_sequence_parallel, two_by_two_by_two,
    STEPS,
};
use tessera_runtime::exec::RunError;

/// A launcher per rank on one emulator process, or `None` (the reason printed) without one.
fn emulator() -> Option<emu::EmuLauncher> {
    match emu::launcher() {
        Ok(l) => Some(l),
        Err(why) => {
            eprintln!("SKIPPED: the CUDA kernel emulator is not available: {why}");
            None
        }
    }
}

#[test]
fn one_rank_on_emulated_kernels_trains_like_the_cpu() {
    let p = one_rank();
    let cpu = on_cpu(&p);
    let Some(emu) = emulator() else { return };
    let dev = on_device(&p, &|_| Ok::<_, RunError>(emu.clone()));
    assert_close(&dev, &cpu, "1×1×1");
    let l = losses(&dev);
    assert!(l[STEPS - 1] < l[0], "the device run learns: {l:?}");
}

#[test]
fn two_by_two_by_two_on_emulated_kernels_trains_like_the_cpu() {
    let p = two_by_two_by_two();
    let cpu = on_cpu(&p);
    let Some(emu) = emulator() else { return };
    let dev = on_device(&p, &|_| Ok::<_, RunError>(emu.clone()));
    assert_close(&dev, &cpu, "2×2×2");
    // The device's parallel run against its own single-rank run, at the same tolerance.
    let one = on_device(&one_rank(), &|_| Ok::<_, RunError>(emu.clone()));
    assert_close(&dev, &one, "2×2×2 vs 1×1×1 on the device");
}

#[test]
fn sequence_parallel_on_emulated_kernels_trains_like_the_cpu() {
    let p = tp2_sequence_parallel();
    let cpu = on_cpu(&p);
    let Some(emu) = emulator() else { return };
    let dev = on_device(&p, &|_| Ok::<_, RunError>(emu.clone()));
    assert_close(&dev, &cpu, "TP 2 with sequence parallelism");
}
