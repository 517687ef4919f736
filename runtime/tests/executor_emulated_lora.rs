//! LoRA adapters on the device backend: the tiny models fine-tuned by `exec::train_on` on the
//! kernel emulator (`emu/`), compared with the CPU backend's runs of the same plans, as
//! `executor_emulated.rs` compares full training. The adapters run on the backend's GEMMs and
//! its `scale`, in bf16 on the device, so the runs agree to bf16 accuracy: the losses at
//! `exec_common`'s tolerance, each adapter's `B` update over the run, and one adapter's output
//! and gradients against the CPU's. The frozen base is left out of the update check (it does
//! not move; the device reports its bf16 working copy).
//!
//! Skips, with the reason printed, where there is no C++ compiler for the emulator.

#[allow(dead_code)]
mod emu;
#[allow(dead_code)]
mod exec_common;

use std::collections::BTreeMap;

use exec_common::{
    assert_close, assert_updates_close, initial_params, losses, model, on_cpu, on_device, plan_for,
    STEPS, TINY_LLAMA,
};
use tessera_planner::finetune::{Lora, Method, Target};
use tessera_planner::layout::Recompute;
use tessera_planner::model::Model;
use tessera_planner::plan::Plan;
use tessera_runtime::exec::RunError;

/// `spec`'s model fine-tuned with LoRA r = 4, alpha = 8 (scaling 2) on `targets`.
fn with_lora(spec: &str, targets: Vec<Target>) -> Model {
    let mut m = model(spec);
    m.training.method = Method::Lora;
    m.lora = Some(Lora {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets,
    });
    m
}

/// The initial `B` of every adapter (the CPU backend's initialisation, which the device shares).
fn initial_b(plan: &Plan) -> BTreeMap<String, Vec<f32>> {
    let b: BTreeMap<_, _> = initial_params(plan)
        .into_iter()
        .filter(|(name, _)| name.contains(".lora_B."))
        .collect();
    assert!(!b.is_empty(), "the plan has adapters");
    b
}

/// `plan` on the emulated kernels against the CPU backend: the losses, and each adapter's `B`
/// update over the run. `A`'s is left out: its gradient is zero while `B` is (the first step),
/// so its first AdamW update is `lr · m̂/√v̂ ≈ 0.74 · lr · sign(g)` of a tiny gradient, and
/// the elements whose sign bf16 flips make 0.12–0.26 of the update's norm. The gradients
/// themselves are compared in [`adapter_gemms_on_emulated_kernels_match_the_cpu`].
fn trains_like_the_cpu(plan: &Plan, emu: &emu::EmuLauncher, what: &str) {
    let dev = on_device(plan, &|_| Ok::<_, RunError>(emu.clone()));
    let cpu = on_cpu(plan);
    assert_close(&dev, &cpu, what);
    assert_updates_close(&dev, &cpu, &initial_b(plan), what);
    let l = losses(&dev);
    assert!(l[STEPS - 1] < l[0], "{what}: the device run learns: {l:?}");
}

/// GPT-2's adapters (c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) on one rank and on TP 2, where
/// the column-parallel adapters' `A` and the row-parallel ones' `B` are summed over TP.
#[test]
fn lora_on_emulated_kernels_trains_like_the_cpu() {
    let Some(emu) = emu::or_skip() else { return };
    let m = with_lora(
        "specs/models/tiny.toml",
        vec![Target::Qkv, Target::O, Target::Up, Target::Down],
    );
    let none = Recompute::None;
    trains_like_the_cpu(&plan_for(&m, 1, 1, 1, 0, none, false), &emu, "LoRA 1×1×1");
    let tp2 = plan_for(&m, 1, 1, 2, 0, Recompute::Selective, false);
    trains_like_the_cpu(&tp2, &emu, "LoRA TP 2");
}

/// The tiny Llama with adapters on each of PEFT's modules (q/k/v_proj on the fused q/k/v of
/// GQA 4:2, gate/up_proj on the fused gate/up): each adapter reads and adds to its part's
/// columns of the fused rows (the strided path), on TP 2.
#[test]
fn llama_per_module_lora_on_emulated_kernels_trains_like_the_cpu() {
    let Some(emu) = emu::or_skip() else { return };
    use Target::*;
    let m = with_lora(TINY_LLAMA, vec![Q, K, V, O, Gate, Up, Down]);
    let tp2 = plan_for(&m, 1, 1, 2, 0, Recompute::None, false);
    trains_like_the_cpu(&tp2, &emu, "Llama per-module LoRA TP 2");
}

/// Values drawn from N(0, 1).
fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; n];
    tessera_runtime::rng::fill_normal(&mut v, seed, 0x10a, 0, 1.0);
    v
}

/// `max|got − want| ≤ 2e-2 · max|want|`: bf16 storage (the kernel tests' tolerance).
fn assert_bf16_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (g, w)| m.max((g - w).abs()));
    assert!(
        scale > 0.0 && err <= 2e-2 * scale,
        "{what}: max error {err:e} against {scale:e}"
    );
}

/// One adapter's forward and backward on the device backend over the emulator, against the
/// CPU backend's, on random weights (a non-zero `B`, so every gradient is): the output, the
/// input gradient and both weight gradients, which the training runs above see only through
/// AdamW's normalised steps. A planted device `scale` that leaves the intermediate unscaled
/// (LoRA's `alpha / r` dropped on the device) fails this test, the two training tests (the
/// GPT run's third loss moves by 0.3%, the Llama run stops learning) and `ops.rs`'s `scale`.
#[test]
fn adapter_gemms_on_emulated_kernels_match_the_cpu() {
    use tessera_runtime::backend::cuda::Device;
    use tessera_runtime::backend::{Backend, Cpu, Storage};
    use tessera_runtime::layers::lora::{Adapter, LoraSettings};
    use tessera_runtime::layers::TpShard;
    use tessera_runtime::params::ParamLayout;

    let Some(emu) = emu::or_skip() else { return };
    let dev = Device::new(emu);
    let s = LoraSettings {
        rank: 4,
        scaling: 2.0,
        targets: vec![],
        dropout: 0.0,
    };
    let (n, k, m) = (12, 16, 8);
    let tp = TpShard::new(1, 2);
    type Build = fn(&mut ParamLayout, &LoraSettings, usize, usize, TpShard) -> Adapter;
    let cases: [(&str, Build); 3] = [
        ("column", |l, s, k, m, tp| {
            Adapter::column(l, "lin", k, &[m], s, tp).unwrap()
        }),
        ("row", |l, s, k, m, tp| {
            Adapter::row(l, "lin", k, m, s, tp).unwrap()
        }),
        ("column part (strided)", |l, s, k, m, tp| {
            Adapter::column_part(l, "lin", k, &[m, m / 2, m / 2], 1, s, tp).unwrap()
        }),
    ];
    for (what, build) in cases {
        let mut layout = ParamLayout::frozen_at(0);
        let ad = build(&mut layout, &s, k, m, tp);
        let (xw, yw) = (ad.x_width, ad.y_stride);
        let p = randn(layout.len(), 1);
        let (x, dy) = (randn(n * xw, 2), randn(n * yw, 3));
        let gl = layout.trainable_len();

        let mut want_y = vec![0.0; n * yw];
        ad.forward::<Cpu>(&Cpu, &p, &x, &mut want_y).unwrap();
        let (mut want_g, mut want_dx) = (vec![0.0; gl], vec![0.0; n * xw]);
        ad.backward::<Cpu>(&Cpu, &p, &mut want_g, &x, &dy, &mut want_dx)
            .unwrap();

        let up = |storage, v: &[f32]| dev.upload(storage, v).unwrap();
        let (pd, xd, dyd) = (
            up(Storage::Bf16, &p),
            up(Storage::Bf16, &x),
            up(Storage::Bf16, &dy),
        );
        let mut yd = up(Storage::Bf16, &vec![0.0; n * yw]);
        let mut gd = up(Storage::F32, &vec![0.0; gl]);
        let mut dxd = up(Storage::Bf16, &vec![0.0; n * xw]);
        type D = Device<emu::EmuLauncher>;
        let view = D::view;
        ad.forward(&dev, view(&pd), view(&xd), D::view_mut(&mut yd))
            .unwrap();
        ad.backward(
            &dev,
            view(&pd),
            D::view_mut(&mut gd),
            view(&xd),
            view(&dyd),
            D::view_mut(&mut dxd),
        )
        .unwrap();
        let get = |b| dev.download(view(b)).unwrap();
        assert_bf16_close(&get(&yd), &want_y, &format!("{what}: y"));
        assert_bf16_close(&get(&dxd), &want_dx, &format!("{what}: dx"));
        let g = get(&gd);
        for (name, r) in [("dA", ad.a), ("dB", ad.b)] {
            // No frozen base here: the gradient buffer is laid out as the parameters.
            let at = r.range();
            assert_bf16_close(&g[at.clone()], &want_g[at], &format!("{what}: {name}"));
        }
    }
}
