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
    assert_close, assert_updates_close, assert_updates_within, initial_params, llama_one_rank,
    llama_tp2_pp2, losses, moe_plan, on_cpu, on_device, one_rank, tp2_sequence_parallel,
    two_by_two_by_two, STEPS,
};
use tessera_runtime::exec::RunError;

#[test]
fn one_rank_on_emulated_kernels_trains_like_the_cpu() {
    let p = one_rank();
    let cpu = on_cpu(&p);
    let Some(emu) = emu::or_skip() else { return };
    let dev = on_device(&p, &|_| Ok::<_, RunError>(emu.clone()));
    assert_close(&dev, &cpu, "1×1×1");
    let l = losses(&dev);
    assert!(l[STEPS - 1] < l[0], "the device run learns: {l:?}");
}

#[test]
fn two_by_two_by_two_on_emulated_kernels_trains_like_the_cpu() {
    let p = two_by_two_by_two();
    let cpu = on_cpu(&p);
    let Some(emu) = emu::or_skip() else { return };
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
    let Some(emu) = emu::or_skip() else { return };
    let dev = on_device(&p, &|_| Ok::<_, RunError>(emu.clone()));
    assert_close(&dev, &cpu, "TP 2 with sequence parallelism");
}

/// The Llama path (RMSNorm, SwiGLU, RoPE with θ 1e6 and Llama 3.1 frequency scaling, GQA with
/// 2 kv heads for 4 query heads, untied head, a vocabulary TP 2 pads) on one rank and on
/// TP 2 × PP 2 with selective recompute, against the CPU backend's runs of the same plans: the
/// losses at the GPT tests' tolerance, and each weight's update over the run (the losses of
/// three steps hardly see the blocks). A planted swap of SwiGLU's gate and up in the device
/// kernel fails the updates; one that skips RoPE on the device fails both.
#[test]
fn llama_on_emulated_kernels_trains_like_the_cpu() {
    let Some(emu) = emu::or_skip() else { return };
    let one = llama_one_rank();
    let dev_one = on_device(&one, &|_| Ok::<_, RunError>(emu.clone()));
    let cpu_one = on_cpu(&one);
    assert_close(&dev_one, &cpu_one, "Llama 1×1×1");
    assert_updates_close(&dev_one, &cpu_one, &initial_params(&one), "Llama 1×1×1");
    let l = losses(&dev_one);
    assert!(l[STEPS - 1] < l[0], "the device run learns: {l:?}");

    let par = llama_tp2_pp2();
    let dev_par = on_device(&par, &|_| Ok::<_, RunError>(emu.clone()));
    let cpu_par = on_cpu(&par);
    assert_close(&dev_par, &cpu_par, "Llama TP 2 × PP 2");
    assert_updates_close(
        &dev_par,
        &cpu_par,
        &initial_params(&par),
        "Llama TP 2 × PP 2",
    );
    assert_close(
        &dev_par,
        &dev_one,
        "Llama TP 2 × PP 2 vs 1×1×1 on the device",
    );
}

/// The MoE tests' update tolerance. The routed experts' and the router's updates agree to 0.13
/// (one rank, DP 2 × EP 2) and 0.14 (with TP 2), the other weights to 0.05 as in the dense
/// tests: the device routes on bf16 logits, and a token near a top-k tie that goes to another
/// expert moves two experts' updates at once (the likely cause; not isolated). A planted bug
/// in the dispatch or the all-to-all moves them by far more (the tests' docs).
const MOE_UPDATE_RTOL: f64 = 0.25;

/// The mixture of experts on the device (the router's and the experts' GEMMs on its buffers,
/// the tokens' dispatch and combine by row index, the EP all-to-all through
/// `Collective::all_to_all_v`) on one rank, against the CPU backend's run: the losses, and
/// each weight's update (the router's and every expert's included). A planted wrong row in the
/// device's dispatch gather (the first row of each gather taken from its neighbour) moves an
/// expert's update by 0.30 and fails.
#[test]
fn moe_one_rank_on_emulated_kernels_trains_like_the_cpu() {
    let Some(emu) = emu::or_skip() else { return };
    let p = moe_plan(1, 1, 1);
    let dev = on_device(&p, &|_| Ok::<_, RunError>(emu.clone()));
    let cpu = on_cpu(&p);
    assert_close(&dev, &cpu, "MoE 1×1×1");
    assert_updates_within(
        &dev,
        &cpu,
        &initial_params(&p),
        MOE_UPDATE_RTOL,
        "MoE 1×1×1",
    );
    let l = losses(&dev);
    assert!(l[STEPS - 1] < l[0], "the device run learns: {l:?}");
}

/// Expert parallelism on the device: DP 2 × EP 2 (each rank holds 2 of the 4 experts and
/// sends the other half of its tokens' slots to its peer), and TP 2 with sequence parallelism
/// on it (each TP rank exchanges with its own EP peer), against the CPU backend's runs. A
/// planted all-to-all that drops the part from the last peer fails the second step's loss
/// (0.0029 relative, allowed 0.002).
#[test]
fn moe_expert_parallel_on_emulated_kernels_trains_like_the_cpu() {
    let Some(emu) = emu::or_skip() else { return };
    for (p, what) in [
        (moe_plan(2, 1, 2), "MoE DP 2 × EP 2"),
        (moe_plan(2, 2, 2), "MoE DP 2 × EP 2 × TP 2"),
    ] {
        let dev = on_device(&p, &|_| Ok::<_, RunError>(emu.clone()));
        let cpu = on_cpu(&p);
        assert_close(&dev, &cpu, what);
        assert_updates_within(&dev, &cpu, &initial_params(&p), MOE_UPDATE_RTOL, what);
    }
}
