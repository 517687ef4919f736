//! The ring-attention ops of the `Backend` (context parallelism) on the device backend over the
//! kernel emulator (`emu/`: `ring_attention.cu` compiled with the host C++ compiler), against
//! the CPU backend's (whose ring is checked against the single-rank causal kernel in
//! `layers/context_parallel_tests.rs`). They are Backend-level ops on the backend's buffers,
//! not `Kernels` (ops.rs's host-slice surface), so they are tested here; ops.rs's `COVERAGE`
//! names this file for their kernels.
//!
//! One rank's share of CP 2 (query chunks `[0, 3]` of rank 0, or `[1, 2]` of rank 1) runs a
//! forward step against its own K/V message and one against its peer's, then the backward
//! steps, as the ring driver does: every mask kind (a block seen fully, a causal block, a
//! skipped block) occurs. Inputs are rounded to bf16 first, so both backends see the same
//! values; the tolerance is ops.rs's for bf16 storage (2e-2 of the tensor's largest magnitude).
//!
//! Skips, with the reason printed, where there is no C++ compiler for the emulator.

#[allow(dead_code)]
mod emu;

use tessera_runtime::backend::cuda::Device;
use tessera_runtime::backend::{bf16, Backend, Cpu, RingShape, Storage};
use tessera_runtime::rng;

/// ops.rs's tolerance for bf16 storage.
const RTOL: f64 = 2e-2;

fn randn_bf16(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; n];
    rng::fill_normal(&mut v, seed, 0x71e, 0, 1.0);
    v.iter().map(|&x| bf16::round(x)).collect()
}

/// What one rank's steps produce, downloaded.
#[derive(Debug)]
struct Out {
    kv_own: Vec<f32>,
    o: Vec<f32>,
    lse: Vec<f32>,
    y: Vec<f32>,
    delta: Vec<f32>,
    dq: Vec<f32>,
    dkv_own: Vec<f32>,
    dkv_peer: Vec<f32>,
    dqkv: Vec<f32>,
}

/// Rank `mine`'s forward against its own message and the peer's (chunks `theirs`), then the
/// backward steps and the unpack, on `be`.
fn steps<B: Backend>(
    be: &B,
    s: &RingShape,
    mine: [usize; 2],
    theirs: [usize; 2],
    seed: u64,
) -> Out {
    let rows = s.b * s.rows();
    let qkv = be
        .upload(Storage::Bf16, &randn_bf16(rows * s.qkv_width(), seed))
        .unwrap();
    let peer_qkv = be
        .upload(Storage::Bf16, &randn_bf16(rows * s.qkv_width(), seed + 1))
        .unwrap();
    let dy = be
        .upload(Storage::Bf16, &randn_bf16(rows * s.y_width(), seed + 2))
        .unwrap();
    let act = |n| be.alloc(Storage::Bf16, n).unwrap();
    let f32s = |n| be.alloc(Storage::F32, n).unwrap();
    let (mut kv_own, mut kv_peer) = (act(s.kv_len()), act(s.kv_len()));
    let (mut o, mut lse, mut y) = (
        f32s(rows * s.y_width()),
        f32s(s.lse_len()),
        act(rows * s.y_width()),
    );
    let mut scratch = f32s(be.ring_scratch_len(s).max(1));
    be.ring_pack_kv(B::view_mut(&mut kv_own), B::view(&qkv), s)
        .unwrap();
    be.ring_pack_kv(B::view_mut(&mut kv_peer), B::view(&peer_qkv), s)
        .unwrap();
    be.fill(B::view_mut(&mut o), 0.0).unwrap();
    be.fill(B::view_mut(&mut lse), f32::NEG_INFINITY).unwrap();
    for (kv, chunks) in [(&kv_own, mine), (&kv_peer, theirs)] {
        be.ring_forward_step(
            B::view_mut(&mut o),
            B::view_mut(&mut lse),
            B::view_mut(&mut scratch),
            B::view(&qkv),
            B::view(kv),
            mine,
            chunks,
            s,
        )
        .unwrap();
    }
    be.copy(B::view_mut(&mut y), B::view(&o)).unwrap();
    let mut delta = f32s(s.lse_len());
    be.ring_softmax_delta(B::view_mut(&mut delta), B::view(&y), B::view(&dy), s)
        .unwrap();
    let (mut dq, mut dkv_own, mut dkv_peer) =
        (f32s(rows * s.y_width()), f32s(s.kv_len()), f32s(s.kv_len()));
    // Accumulated: start from non-zero values, as a later ring step does.
    let start = randn_bf16(rows * s.y_width(), seed + 3);
    let dq0 = be.upload(Storage::F32, &start).unwrap();
    be.copy(B::view_mut(&mut dq), B::view(&dq0)).unwrap();
    be.fill(B::view_mut(&mut dkv_own), 0.0).unwrap();
    be.fill(B::view_mut(&mut dkv_peer), 0.5).unwrap();
    for (kv, dkv, chunks) in [
        (&kv_own, &mut dkv_own, mine),
        (&kv_peer, &mut dkv_peer, theirs),
    ] {
        be.ring_backward_step(
            B::view_mut(&mut dq),
            B::view_mut(dkv),
            B::view_mut(&mut scratch),
            B::view(&qkv),
            B::view(kv),
            B::view(&dy),
            B::view(&lse),
            B::view(&delta),
            mine,
            chunks,
            s,
        )
        .unwrap();
    }
    let mut dqkv = act(rows * s.qkv_width());
    be.ring_unpack(B::view_mut(&mut dqkv), B::view(&dq), B::view(&dkv_own), s)
        .unwrap();
    let get = |b: &B::Buf| be.download(B::view(b)).unwrap();
    Out {
        kv_own: get(&kv_own),
        o: get(&o),
        lse: get(&lse),
        y: get(&y),
        delta: get(&delta),
        dq: get(&dq),
        dkv_own: get(&dkv_own),
        dkv_peer: get(&dkv_peer),
        dqkv: get(&dqkv),
    }
}

/// `max|got − want| ≤ RTOL · max|want|`, no NaN.
fn close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0.0f64, |m, &v| m.max(f64::from(v).abs()));
    let (mut at, mut err) = (0, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let e = (f64::from(g) - f64::from(w)).abs();
        if e.is_nan() || e > err {
            (at, err) = (i, if e.is_nan() { f64::INFINITY } else { e });
        }
    }
    assert!(
        err <= RTOL * scale.max(1e-30),
        "{what}: max error {err:e} at {at} ({} vs {}) exceeds {RTOL} × {scale:e}",
        got[at],
        want[at]
    );
}

fn compare(what: &str, dev: &Out, cpu: &Out) {
    assert_eq!(dev.kv_own, cpu.kv_own, "{what}: the K/V message is a copy");
    close(&format!("{what}: output"), &dev.o, &cpu.o);
    close(&format!("{what}: y"), &dev.y, &cpu.y);
    close(&format!("{what}: log-sum-exp"), &dev.lse, &cpu.lse);
    close(&format!("{what}: delta"), &dev.delta, &cpu.delta);
    close(&format!("{what}: dq"), &dev.dq, &cpu.dq);
    close(&format!("{what}: own dK/dV"), &dev.dkv_own, &cpu.dkv_own);
    close(&format!("{what}: peer dK/dV"), &dev.dkv_peer, &cpu.dkv_peer);
    close(&format!("{what}: dqkv"), &dev.dqkv, &cpu.dqkv);
}

/// Every ring kernel (`ring_pack_kv`, `ring_forward_step`, `attention_delta` on the rank's rows,
/// `ring_backward_dq`, `ring_backward_dkv`, `ring_unpack`, and `copy_f32_to_bf16` for `y`) on
/// both ranks of CP 2, GQA with a head over 32 dims (two lanes' slots) and MHA.
#[test]
fn ring_steps_on_emulated_kernels_match_the_cpu() {
    let Some(emu) = emu::or_skip() else { return };
    ring_cases(&Device::new(emu));
}

/// The same steps on a real GPU (feature `cuda`; scripts/gpu-check.sh runs it, and
/// compute-sanitizer over it). Skips, with the reason printed, where no GPU is usable;
/// `TESSERA_REQUIRE_GPU=1` turns the skip into a failure.
#[cfg(feature = "cuda")]
#[test]
fn ring_steps_on_a_gpu_match_the_cpu() {
    match tessera_runtime::backend::cuda::CudaLauncher::open(0) {
        Ok(gpu) => ring_cases(&Device::new(gpu)),
        Err(e) if std::env::var_os("TESSERA_REQUIRE_GPU").is_some() => {
            panic!("TESSERA_REQUIRE_GPU is set and no GPU is usable: {e}")
        }
        Err(e) => eprintln!("skipped: no CUDA device ({e})"),
    }
}

/// Both ranks of CP 2 on `dev` against the CPU: GQA with a head over 32 dims, and MHA.
fn ring_cases<B: Backend>(dev: &B) {
    for (hq, hkv, hd) in [(4, 2, 40), (3, 3, 8)] {
        let s = RingShape {
            b: 2,
            chunk: 5,
            hq,
            hkv,
            hd,
        };
        for (rank, mine, theirs) in [(0, [0, 3], [1, 2]), (1, [1, 2], [0, 3])] {
            let what = format!("hq {hq} hkv {hkv} hd {hd}, rank {rank}");
            let seed = (10 * hq + rank) as u64;
            let cpu = steps(&Cpu, &s, mine, theirs, seed);
            let got = steps(dev, &s, mine, theirs, seed);
            // The CPU's own values are sane: every row saw at least its diagonal key.
            assert!(cpu.lse.iter().all(|l| l.is_finite()), "{what}");
            compare(&what, &got, &cpu);
        }
    }
}

/// `copy` of an f32 view into activation storage: rounded to bf16 on the device (ties to even,
/// as `backend::bf16`), exact on the CPU.
#[test]
fn copy_of_f32_into_activations_rounds_to_bf16() {
    let Some(emu) = emu::or_skip() else { return };
    let dev = Device::new(emu);
    let mut x = vec![0.0f32; 1000];
    rng::fill_normal(&mut x, 5, 0x71f, 0, 3.0);
    let src = dev.upload(Storage::F32, &x).unwrap();
    let mut dst = dev.alloc(Storage::Bf16, 1000).unwrap();
    let v = |b| Device::<emu::EmuLauncher>::view(b);
    dev.copy(
        Device::<emu::EmuLauncher>::sub_mut(
            Device::<emu::EmuLauncher>::view_mut(&mut dst),
            0..1000,
        ),
        v(&src),
    )
    .unwrap();
    let want: Vec<f32> = x.iter().map(|&f| bf16::round(f)).collect();
    assert_eq!(dev.download(v(&dst)).unwrap(), want);
    let mut on_cpu = vec![0.0; 1000];
    Cpu.copy(&mut on_cpu, &x).unwrap();
    assert_eq!(on_cpu, x);
}
