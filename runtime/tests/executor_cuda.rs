//! The executor on a real GPU (feature `cuda`): the tiny model, 1×1×1 and 2×2×2, the tiny
//! mixture of experts on one rank and DP 2 × EP 2, and context parallelism (CP 2 × DP 2, the
//! tiny Llama on CP 2 × TP 2), with every rank
//! on GPU 0 (threads as ranks, collectives through host memory), against the CPU backend at
//! bf16 accuracy — the same comparison `executor_emulated.rs` makes on the emulator. Skips,
//! with the reason printed, where no GPU is usable; `TESSERA_REQUIRE_GPU=1` (set by
//! scripts/gpu-check.sh) turns the skip into a failure.
#![cfg(feature = "cuda")]

#[allow(dead_code)] // the Llama and LoRA helpers serve the emulated tests
mod exec_common;

use exec_common::{
    assert_close, assert_updates_close, assert_updates_within, cp_plan, initial_params, losses,
    moe_plan, on_cpu, on_device, one_rank, tp2_sequence_parallel, two_by_two_by_two, STEPS,
    TINY_LLAMA,
};
use tessera_runtime::backend::cuda::CudaLauncher;
use tessera_runtime::exec::RunError;

/// GPU 0, shared by every rank (clones share its stream), or `None` with the reason printed.
fn gpu() -> Option<CudaLauncher> {
    match CudaLauncher::open(0) {
        Ok(l) => Some(l),
        Err(e) if std::env::var_os("TESSERA_REQUIRE_GPU").is_some() => {
            panic!("TESSERA_REQUIRE_GPU is set and no GPU is usable: {e}")
        }
        Err(e) => {
            eprintln!("SKIPPED: no usable GPU: {e}");
            None
        }
    }
}

#[test]
fn one_rank_on_a_gpu_trains_like_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let p = one_rank();
    let dev = on_device(&p, &|_| Ok::<_, RunError>(gpu.clone()));
    assert_close(&dev, &on_cpu(&p), "GPU 1×1×1");
    let l = losses(&dev);
    assert!(l[STEPS - 1] < l[0], "the GPU run learns: {l:?}");
}

#[test]
fn two_by_two_by_two_on_one_gpu_trains_like_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let p = two_by_two_by_two();
    let dev = on_device(&p, &|_| Ok::<_, RunError>(gpu.clone()));
    assert_close(&dev, &on_cpu(&p), "GPU 2×2×2");
}

#[test]
fn sequence_parallel_on_one_gpu_trains_like_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let p = tp2_sequence_parallel();
    let dev = on_device(&p, &|_| Ok::<_, RunError>(gpu.clone()));
    assert_close(&dev, &on_cpu(&p), "GPU TP 2 with sequence parallelism");
}

/// The routed experts' and the router's update tolerance: as executor_emulated.rs's (bf16
/// router logits can route a token near a top-k tie to another expert than the CPU's).
const MOE_UPDATE_RTOL: f64 = 0.25;

/// The mixture of experts on the GPU (router, gate and expert GEMMs on the device, rows moved
/// by index, the EP all-to-all through host memory): one rank and DP 2 × EP 2, against the CPU
/// backend, as executor_emulated.rs checks them on the emulator.
#[test]
fn moe_on_one_gpu_trains_like_the_cpu() {
    let Some(gpu) = gpu() else { return };
    for (p, what) in [
        (moe_plan(1, 1, 1), "GPU MoE 1×1×1"),
        (moe_plan(2, 1, 2), "GPU MoE DP 2 × EP 2"),
    ] {
        let dev = on_device(&p, &|_| Ok::<_, RunError>(gpu.clone()));
        let cpu = on_cpu(&p);
        assert_close(&dev, &cpu, what);
        assert_updates_within(&dev, &cpu, &initial_params(&p), MOE_UPDATE_RTOL, what);
    }
}

/// Context parallelism (ring attention on `ring_attention.cu`, the K/V and dK/dV messages
/// through host memory) on one GPU: the losses and each weight's update, at the emulated
/// tests' tolerances (`executor_emulated_cp.rs`).
#[test]
fn context_parallel_on_one_gpu_trains_like_the_cpu() {
    let Some(gpu) = gpu() else { return };
    for (p, what) in [
        (
            cp_plan("specs/models/tiny.toml", 2, 2, 1),
            "GPU CP 2 × DP 2",
        ),
        (cp_plan(TINY_LLAMA, 1, 2, 2), "GPU Llama CP 2 × TP 2"),
    ] {
        let dev = on_device(&p, &|_| Ok::<_, RunError>(gpu.clone()));
        let cpu = on_cpu(&p);
        assert_close(&dev, &cpu, what);
        assert_updates_close(&dev, &cpu, &initial_params(&p), what);
    }
}
