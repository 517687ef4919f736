//! Transformer block: finite differences at t = 1, t = 2 and 4 against t = 1, and recompute
//! policies bitwise equal to keeping activations.

use super::*;
use crate::backend::Cpu;
use crate::layers::testkit::{assert_globals_close, gather, jitter_nondecay, on_tp};
use crate::layers::wgrad::WeightStash;
use crate::layers::Recompute;
use crate::layers::{Activation, NormKind};
use crate::testutil::{assert_close, fd_check, randn, weighted};

/// GPT-2 flavour: GELU, LayerNorm, learned positions (none in the block), biases, MHA.
fn gpt2() -> BlockConfig {
    BlockConfig {
        hidden: 16,
        heads: 4,
        kv_heads: 4,
        head_dim: 4,
        ffn_hidden: 64,
        activation: Activation::Gelu,
        norm: NormKind::LayerNorm,
        rope_theta: None,
        rope_scaling: None,
        bias: true,
        qkv_bias: true,
        norm_eps: 1e-5,
        init_std: 0.3,
        proj_init_std: 0.2,
    }
}

/// LLaMA / Qwen2 flavour: SwiGLU, RMSNorm, RoPE, biases on q/k/v only, GQA (2 q heads per kv
/// head), and a head size (6) that is not hidden / heads.
fn llama() -> BlockConfig {
    BlockConfig {
        hidden: 32,
        heads: 8,
        kv_heads: 4,
        head_dim: 6,
        ffn_hidden: 48,
        activation: Activation::SwiGlu,
        norm: NormKind::RmsNorm,
        rope_theta: Some(10000.0),
        rope_scaling: None,
        bias: false,
        qkv_bias: true,
        norm_eps: 1e-5,
        init_std: 0.3,
        proj_init_std: 0.2,
    }
}

const D: Dims = Dims { b: 2, t: 5 };

struct RankOut {
    layout: ParamLayout,
    grads: Vec<f32>,
    out: Vec<f32>,
    dx: Vec<f32>,
}

/// Forward + backward of one block on `t` TP ranks.
fn run(cfg: &BlockConfig, t: usize, rc: Recompute, x: &[f32], gy: &[f32]) -> Vec<RankOut> {
    on_tp(t, |comm, tp| {
        let mut layout = ParamLayout::new();
        let block = TransformerBlock::new(&mut layout, "h.0", cfg, tp).unwrap();
        let mut p = layout.init(11);
        jitter_nondecay(&layout, &mut p, 0.1);
        let mut acts = BlockActs::new(&Cpu, &block, D, rc).unwrap();
        let mut ws = BlockWorkspace::new(&Cpu, &block, D).unwrap();
        let mut out = vec![0.0; x.len()];
        block
            .forward(&Cpu, &p, x, &mut out, &mut acts, &mut ws, comm)
            .unwrap();
        let (mut grads, mut dx) = (layout.zeros(), vec![0.0; x.len()]);
        block
            .backward(&Cpu, &p, &mut grads, gy, &mut dx, &acts, &mut ws, comm)
            .unwrap();
        RankOut {
            layout,
            grads,
            out,
            dx,
        }
    })
}

#[test]
fn block_gradients_match_finite_differences() {
    for cfg in [gpt2(), llama()] {
        let n = D.n() * cfg.hidden;
        let (x, gy) = (randn(n, 1, 1.0), randn(n, 2, 1.0));
        let comm = &crate::comm::LocalComm::group(1)[0];
        let mut layout = ParamLayout::new();
        let block = TransformerBlock::new(&mut layout, "h.0", &cfg, TpShard::SINGLE).unwrap();
        let p: Vec<f32> = layout
            .init(11)
            .iter()
            .zip(randn(layout.len(), 12, 0.1))
            .map(|(a, b)| a + b)
            .collect();
        let mut ws = BlockWorkspace::new(&Cpu, &block, D).unwrap();
        let loss = |p: &[f32], x: &[f32], ws: &mut BlockWorkspace<Cpu>| {
            let mut acts = BlockActs::new(&Cpu, &block, D, Recompute::None).unwrap();
            let mut out = vec![0.0; n];
            block
                .forward(&Cpu, p, x, &mut out, &mut acts, ws, comm)
                .unwrap();
            (weighted(&out, &gy), acts)
        };
        let (_, acts) = loss(&p, &x, &mut ws);
        let (mut g, mut dx) = (layout.zeros(), vec![0.0; n]);
        block
            .backward(&Cpu, &p, &mut g, &gy, &mut dx, &acts, &mut ws, comm)
            .unwrap();
        let h = 1.0 / 64.0;
        fd_check("block dx", &x, &dx, h, 2e-3, 150, |x| {
            loss(&p, x, &mut ws).0
        });
        fd_check("block dparams", &p, &g, h, 2e-3, 400, |p| {
            loss(p, &x, &mut ws).0
        });
    }
}

#[test]
fn tensor_parallel_block_matches_single_rank() {
    for cfg in [gpt2(), llama()] {
        let n = D.n() * cfg.hidden;
        let (x, gy) = (randn(n, 1, 1.0), randn(n, 2, 1.0));
        let one = run(&cfg, 1, Recompute::None, &x, &gy);
        let want = gather(&[(&one[0].layout, &one[0].grads)]);
        for t in [2, 4] {
            let ranks = run(&cfg, t, Recompute::None, &x, &gy);
            for r in &ranks {
                assert_close(&r.out, &one[0].out, 1e-5, &format!("t={t} out"));
                assert_close(&r.dx, &one[0].dx, 1e-5, &format!("t={t} dx"));
            }
            let got = gather(
                &ranks
                    .iter()
                    .map(|r| (&r.layout, &r.grads[..]))
                    .collect::<Vec<_>>(),
            );
            assert_globals_close(&got, &want, 1e-5, &format!("{:?} t={t}", cfg.activation));
        }
    }
}

#[test]
fn recompute_is_bitwise_identical() {
    for cfg in [gpt2(), llama()] {
        let n = D.n() * cfg.hidden;
        let (x, gy) = (randn(n, 1, 1.0), randn(n, 2, 1.0));
        for t in [1, 2] {
            let base = run(&cfg, t, Recompute::None, &x, &gy);
            for rc in [Recompute::Selective, Recompute::Full] {
                let other = run(&cfg, t, rc, &x, &gy);
                for (a, b) in base.iter().zip(&other) {
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&a.out), bits(&b.out), "{rc:?} out");
                    assert_eq!(bits(&a.dx), bits(&b.dx), "{rc:?} dx");
                    assert_eq!(bits(&a.grads), bits(&b.grads), "{rc:?} grads");
                }
            }
        }
    }
}

/// Per rank: two micro-batches' `dx` and the gradients they sum to.
struct TwoOut {
    dx: [Vec<f32>; 2],
    grads: Vec<f32>,
}

/// Two micro-batches through one block on `t` TP ranks (sequence parallel when `sp`), both
/// forwards first; then either two fused backwards, or the zero-bubble split B(0), B(1),
/// W(0), W(1), the workspace reused in between as on a pipeline stage (so the stash must hold
/// its own copies of what W reads).
fn run_two(cfg: &BlockConfig, t: usize, sp: bool, rc: Recompute, split: bool) -> Vec<TwoOut> {
    on_tp(t, |comm, tp| {
        let mut layout = ParamLayout::new();
        let mut block = TransformerBlock::new(&mut layout, "h.0", cfg, tp).unwrap();
        block.sequence_parallel = sp;
        let mut p = layout.init(11);
        jitter_nondecay(&layout, &mut p, 0.1);
        let n = block.rows(D) * cfg.hidden;
        let seed = 10 * tp.rank as u64;
        let mut ws = BlockWorkspace::new(&Cpu, &block, D).unwrap();
        let mut acts = [0, 1].map(|_| BlockActs::new(&Cpu, &block, D, rc).unwrap());
        for (mb, a) in acts.iter_mut().enumerate() {
            let (x, mut out) = (randn(n, seed + mb as u64, 1.0), vec![0.0; n]);
            block
                .forward(&Cpu, &p, &x, &mut out, a, &mut ws, comm)
                .unwrap();
        }
        let mut grads = layout.zeros();
        let mut stash = [WeightStash::default(), WeightStash::default()];
        let dx = [0, 1].map(|mb| {
            let (gy, mut dx) = (randn(n, seed + 5 + mb as u64, 1.0), vec![0.0; n]);
            let defer = split.then_some(&mut stash[mb]);
            let (g, a) = (&mut grads, &acts[mb]);
            block
                .backward_split(&Cpu, &p, g, &gy, &mut dx, a, &mut ws, comm, defer)
                .unwrap();
            dx
        });
        assert_eq!(stash.iter().all(|s| !s.is_empty()), split);
        for s in &mut stash {
            s.run(&Cpu, &mut grads).unwrap();
            assert!(s.is_empty());
        }
        TwoOut { dx, grads }
    })
}

#[test]
fn split_backward_is_bitwise_the_fused_one() {
    let same = |a: &[f32], b: &[f32], what: &str| {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        let differ = a
            .iter()
            .zip(b)
            .position(|(x, y)| x.to_bits() != y.to_bits());
        if let Some(i) = differ {
            panic!("{what}: element {i} is {} fused, {} split", a[i], b[i]);
        }
    };
    for cfg in [gpt2(), llama()] {
        for (t, sp) in [(1, false), (2, false), (2, true)] {
            for rc in [Recompute::None, Recompute::Full] {
                let fused = run_two(&cfg, t, sp, rc, false);
                let split = run_two(&cfg, t, sp, rc, true);
                let what = format!("{:?} t={t} sp={sp} {rc:?}", cfg.activation);
                for (a, b) in fused.iter().zip(&split) {
                    for mb in 0..2 {
                        same(&a.dx[mb], &b.dx[mb], &format!("{what}: dx {mb}"));
                    }
                    assert!(a.grads.iter().any(|&g| g != 0.0), "{what}: no gradient");
                    same(&a.grads, &b.grads, &format!("{what}: gradients"));
                }
            }
        }
    }
}

#[test]
fn recompute_policies_shrink_saved_activations() {
    let mut layout = ParamLayout::new();
    let block = TransformerBlock::new(&mut layout, "h.0", &gpt2(), TpShard::SINGLE).unwrap();
    let sizes: Vec<usize> = [Recompute::None, Recompute::Selective, Recompute::Full]
        .iter()
        .map(|&rc| BlockActs::new(&Cpu, &block, D, rc).unwrap().floats())
        .collect();
    assert!(sizes[0] > sizes[1] && sizes[1] > sizes[2]);
    assert_eq!(sizes[2], D.n() * 16);
    assert_eq!(sizes[0] - sizes[1], D.b * 4 * D.t * D.t);
}

#[test]
fn bad_tp_degree_is_rejected() {
    let mut layout = ParamLayout::new();
    let err = TransformerBlock::new(&mut layout, "h.0", &llama(), TpShard::new(0, 8)).unwrap_err();
    assert!(
        matches!(
            err,
            LayerError::NotDivisible {
                what: "kv heads",
                n: 4,
                tp: 8
            }
        ),
        "{err}"
    );
}

/// Time of one block forward + backward at GPT-2-small width (single thread), reported as
/// linear-layer GFLOP/s (6·N·12·C² per step) to compare with the bare gemm rate. Run:
/// `cargo test --release -p tessera-runtime bench_ -- --ignored --nocapture`.
#[test]
#[ignore]
fn bench_block_step() {
    let cfg = BlockConfig {
        hidden: 768,
        heads: 12,
        kv_heads: 12,
        head_dim: 64,
        ffn_hidden: 3072,
        init_std: 0.02,
        proj_init_std: 0.02,
        ..gpt2()
    };
    let d = Dims { b: 4, t: 256 };
    let comm = &crate::comm::LocalComm::group(1)[0];
    let mut layout = ParamLayout::new();
    let block = TransformerBlock::new(&mut layout, "h.0", &cfg, TpShard::SINGLE).unwrap();
    let p = layout.init(1);
    let mut g = layout.zeros();
    let n = d.n() * cfg.hidden;
    let (x, gy) = (randn(n, 1, 1.0), randn(n, 2, 1.0));
    let (mut out, mut dx) = (vec![0.0; n], vec![0.0; n]);
    let mut ws = BlockWorkspace::new(&Cpu, &block, d).unwrap();
    for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
        let mut acts = BlockActs::new(&Cpu, &block, d, rc).unwrap();
        let mut step = || {
            let t0 = std::time::Instant::now();
            block
                .forward(&Cpu, &p, &x, &mut out, &mut acts, &mut ws, comm)
                .unwrap();
            let t1 = std::time::Instant::now();
            block
                .backward(&Cpu, &p, &mut g, &gy, &mut dx, &acts, &mut ws, comm)
                .unwrap();
            (t1 - t0, t1.elapsed())
        };
        step();
        let (f, b) = step();
        let lin = 2.0 * (d.n() * 12 * cfg.hidden * cfg.hidden) as f64;
        println!(
            "{rc:?}: forward {:.1} ms ({:.1} GF/s linear), backward {:.1} ms ({:.1} GF/s linear)",
            f.as_secs_f64() * 1e3,
            lin / f.as_secs_f64() / 1e9,
            b.as_secs_f64() * 1e3,
            2.0 * lin / b.as_secs_f64() / 1e9
        );
    }
}
