//! Context parallelism on the CUDA kernels: plans with `parallel.cp = 2` trained by
//! `exec::train_on` with the device backend over the kernel emulator (`emu/`), against the CPU
//! backend's runs of the same plans, as `executor_emulated.rs` does for the other layouts. Each
//! rank holds two of the four chunks of every sequence; attention is ring attention over the
//! CP group (`Backend::ring_*` on the device's buffers, the K/V and dK/dV messages through the
//! host-staged collective). The losses must agree at bf16 accuracy, and each weight's update
//! over the run (the losses of three steps hardly see the attention).
//!
//! Skips, with the reason printed, where there is no C++ compiler for the emulator.

#[allow(dead_code)]
mod emu;
#[allow(dead_code)]
mod exec_common;

use exec_common::{
    assert_close, assert_updates_close, cp_plan, initial_params, losses, on_cpu, on_device,
    one_rank, STEPS, TINY_LLAMA,
};
use tessera_planner::plan::Plan;
use tessera_runtime::exec::{RunError, TrainReport};

/// The plan on the emulated device and on the CPU: losses and updates close.
fn device_like_cpu(p: &Plan, what: &str) -> Option<TrainReport> {
    let emu = emu::or_skip()?;
    let dev = on_device(p, &|_| Ok::<_, RunError>(emu.clone()));
    let cpu = on_cpu(p);
    assert_close(&dev, &cpu, what);
    assert_updates_close(&dev, &cpu, &initial_params(p), what);
    let l = losses(&dev);
    assert!(l[STEPS - 1] < l[0], "{what}: the device run learns: {l:?}");
    Some(dev)
}

/// The tiny GPT on CP 2 (one rank per half of the ring), against the CPU, and against the
/// device's own single-rank run: the losses and each weight's update. The ring driver is the
/// CPU's too, so a fault in it (a dK/dV message that does not travel its last hop home) moves
/// both backends alike; the single-rank run has no ring and shows it.
#[test]
fn cp2_on_emulated_kernels_trains_like_the_cpu() {
    let Some(dev) = device_like_cpu(&cp_plan("specs/models/tiny.toml", 1, 2, 1), "CP 2") else {
        return;
    };
    let Some(emu) = emu::or_skip() else { return };
    let one = on_device(&one_rank(), &|_| Ok::<_, RunError>(emu.clone()));
    let what = "CP 2 vs 1×1×1 on the device";
    assert_close(&dev, &one, what);
    assert_updates_close(&dev, &one, &initial_params(&one_rank()), what);
}

/// CP 2 × DP 2: the gradients summed over the DP × CP group.
#[test]
fn cp2_by_dp2_on_emulated_kernels_trains_like_the_cpu() {
    device_like_cpu(&cp_plan("specs/models/tiny.toml", 2, 2, 1), "CP 2 × DP 2");
}

/// The tiny Llama (RoPE at each rank's global positions, GQA: 4 query heads on 2 kv heads) on
/// CP 2 × TP 2: one kv head for two query heads on each TP rank.
#[test]
fn llama_cp2_by_tp2_on_emulated_kernels_trains_like_the_cpu() {
    device_like_cpu(&cp_plan(TINY_LLAMA, 1, 2, 2), "Llama CP 2 × TP 2");
}
