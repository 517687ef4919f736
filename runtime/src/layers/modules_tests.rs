//! The attention and MLP modules on their own: finite differences at t = 1 (every parameter and
//! the input), and t = 2 against t = 1 on the full weights. The embedding gets its finite
//! differences here too (its TP test lives beside it).

use super::attention::{AttnGrads, ParallelAttention, RopeTables};
use super::testkit::{assert_globals_close, gather, jitter_nondecay, on_tp};
use super::*;
use crate::backend::Cpu;
use crate::comm::LocalComm;
use crate::params::ParamLayout;
use crate::testutil::{assert_close, fd_check, randn, weighted};

const D: Dims = Dims { b: 2, t: 4 };

fn cfg(rope: bool) -> BlockConfig {
    BlockConfig {
        hidden: 8,
        heads: 4,
        kv_heads: 2,
        head_dim: 2,
        ffn_hidden: 12,
        activation: Activation::SwiGlu,
        norm: NormKind::RmsNorm,
        rope_theta: rope.then_some(100.0),
        rope_scaling: None,
        bias: true,
        qkv_bias: true,
        norm_eps: 1e-5,
        init_std: 0.5,
        proj_init_std: 0.5,
    }
}

/// Attention forward + backward on one rank: (out, dx, grads, layout).
fn attention(
    c: &BlockConfig,
    comm: &LocalComm,
    tp: TpShard,
    p_seed: u64,
    x: &[f32],
    gy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>, ParamLayout) {
    let mut layout = ParamLayout::new();
    let a = ParallelAttention::new(&mut layout, "attn", c, tp).unwrap();
    let mut p = layout.init(p_seed);
    jitter_nondecay(&layout, &mut p, 0.3);
    let s = a.shape(D);
    let n = D.n();
    let rope = c
        .rope_theta
        .map(|th| RopeTables::new(&Cpu, D.t, c.head_dim, th).unwrap());
    let (mut qkv, mut att, mut y) = (
        vec![0.0; n * s.qkv_width()],
        vec![0.0; s.att_len()],
        vec![0.0; n * s.y_width()],
    );
    let mut out = vec![0.0; n * c.hidden];
    a.forward(
        &Cpu,
        &p,
        x,
        &mut qkv,
        &mut att,
        &mut y,
        &mut out,
        rope.as_ref(),
        D,
        comm,
    )
    .unwrap();
    let (mut g, mut dx, mut gr) = (
        layout.zeros(),
        vec![0.0; x.len()],
        AttnGrads::new(&Cpu, &s).unwrap(),
    );
    a.backward(
        &Cpu,
        &p,
        &mut g,
        x,
        &qkv,
        &att,
        &y,
        gy,
        &mut dx,
        &mut gr,
        rope.as_ref(),
        D,
        comm,
    )
    .unwrap();
    (out, dx, g, layout)
}

#[test]
fn attention_module_matches_fd_and_single_rank() {
    for rope in [false, true] {
        let c = cfg(rope);
        let n = D.n() * c.hidden;
        let (x, gy) = (randn(n, 1, 1.0), randn(n, 2, 1.0));
        let comm = &LocalComm::group(1)[0];
        let (_, dx, g, layout) = attention(&c, comm, TpShard::SINGLE, 5, &x, &gy);
        let mut p = layout.init(5);
        jitter_nondecay(&layout, &mut p, 0.3);
        let loss = |p: &[f32], x: &[f32]| {
            let a = ParallelAttention::new(&mut ParamLayout::new(), "attn", &c, TpShard::SINGLE)
                .unwrap();
            let s = a.shape(D);
            let rope = c
                .rope_theta
                .map(|th| RopeTables::new(&Cpu, D.t, c.head_dim, th).unwrap());
            let (mut qkv, mut att, mut y) = (
                vec![0.0; D.n() * s.qkv_width()],
                vec![0.0; s.att_len()],
                vec![0.0; D.n() * s.y_width()],
            );
            let mut out = vec![0.0; n];
            a.forward(
                &Cpu,
                p,
                x,
                &mut qkv,
                &mut att,
                &mut y,
                &mut out,
                rope.as_ref(),
                D,
                comm,
            )
            .unwrap();
            weighted(&out, &gy)
        };
        fd_check("attention dx", &x, &dx, 1.0 / 64.0, 1e-3, 64, |x| {
            loss(&p, x)
        });
        fd_check("attention dparams", &p, &g, 1.0 / 64.0, 1e-3, 400, |p| {
            loss(p, &x)
        });
        let one = gather(&[(&layout, &g)]);
        let ranks = on_tp(2, |comm, tp| attention(&c, comm, tp, 5, &x, &gy));
        for r in &ranks {
            let (out1, dx1, _, _) =
                attention(&c, &LocalComm::group(1)[0], TpShard::SINGLE, 5, &x, &gy);
            assert_close(&r.0, &out1, 1e-5, "attention out");
            assert_close(&r.1, &dx1, 1e-5, "attention dx");
        }
        let two = gather(&ranks.iter().map(|r| (&r.3, &r.2[..])).collect::<Vec<_>>());
        assert_globals_close(&two, &one, 1e-5, &format!("attention rope={rope}"));
    }
}

/// MLP forward + backward on one rank: (out, dx, grads, layout).
fn mlp(
    act: Activation,
    comm: &LocalComm,
    tp: TpShard,
    x: &[f32],
    gy: &[f32],
    p_override: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, ParamLayout) {
    let c = cfg(false);
    let mut layout = ParamLayout::new();
    let m = ParallelMlp::new(
        &mut layout,
        "mlp",
        c.hidden,
        c.ffn_hidden,
        act,
        true,
        tp,
        0.5,
        0.5,
    )
    .unwrap();
    let mut p = layout.init(9);
    jitter_nondecay(&layout, &mut p, 0.3);
    let p = p_override.map_or(p, |o| o.to_vec());
    let n = D.n();
    let (mut h, mut a) = (vec![0.0; n * m.h_width()], vec![0.0; n * m.f_local]);
    let mut out = vec![0.0; n * c.hidden];
    m.forward_hidden(&Cpu, &p, x, &mut h, &mut a).unwrap();
    m.forward_out(&Cpu, &p, &a, &mut out, comm).unwrap();
    let (mut g, mut dx) = (layout.zeros(), vec![0.0; x.len()]);
    let (mut dh, mut da) = (vec![0.0; h.len()], vec![0.0; a.len()]);
    m.backward(
        &Cpu, &p, &mut g, x, &h, &a, gy, &mut dx, &mut dh, &mut da, comm,
    )
    .unwrap();
    (out, dx, g, layout)
}

#[test]
fn mlp_module_matches_fd_and_single_rank() {
    for act in [Activation::Gelu, Activation::SwiGlu] {
        let n = D.n() * 8;
        let (x, gy) = (randn(n, 3, 1.0), randn(n, 4, 1.0));
        let comm = &LocalComm::group(1)[0];
        let (out1, dx, g, layout) = mlp(act, comm, TpShard::SINGLE, &x, &gy, None);
        let mut p = layout.init(9);
        jitter_nondecay(&layout, &mut p, 0.3);
        fd_check("mlp dx", &x, &dx, 1.0 / 64.0, 1e-3, 64, |x| {
            weighted(&mlp(act, comm, TpShard::SINGLE, x, &gy, None).0, &gy)
        });
        fd_check("mlp dparams", &p, &g, 1.0 / 64.0, 1e-3, 300, |p| {
            weighted(&mlp(act, comm, TpShard::SINGLE, &x, &gy, Some(p)).0, &gy)
        });
        let one = gather(&[(&layout, &g)]);
        for t in [2, 4] {
            let ranks = on_tp(t, |comm, tp| mlp(act, comm, tp, &x, &gy, None));
            for r in &ranks {
                assert_close(&r.0, &out1, 1e-5, "mlp out");
                assert_close(&r.1, &dx, 1e-5, "mlp dx");
            }
            let got = gather(&ranks.iter().map(|r| (&r.3, &r.2[..])).collect::<Vec<_>>());
            assert_globals_close(&got, &one, 1e-5, &format!("mlp {act:?} t={t}"));
        }
    }
}

#[test]
fn embedding_gradients_match_finite_differences() {
    let (vocab, c, t) = (6, 3, 2);
    let tokens = vec![1u32, 5, 1, 0];
    let gy = randn(tokens.len() * c, 1, 1.0);
    let comm = &LocalComm::group(1)[0];
    let mut layout = ParamLayout::new();
    let e =
        VocabParallelEmbedding::new(&mut layout, "wte", vocab, c, TpShard::SINGLE, 1.0).unwrap();
    let pos = PositionEmbedding::new(&mut layout, "wpe", t, c, 1.0).unwrap();
    let p = layout.init(2);
    let loss = |p: &[f32]| {
        let mut out = vec![0.0; tokens.len() * c];
        e.forward(&Cpu, p, &tokens, &mut out, comm).unwrap();
        pos.forward(&Cpu, p, &mut out, t, 0).unwrap();
        weighted(&out, &gy)
    };
    let mut g = layout.zeros();
    e.backward(&Cpu, &mut g, &tokens, &gy).unwrap();
    pos.backward(&Cpu, &mut g, &gy, t).unwrap();
    fd_check("embedding dparams", &p, &g, 1.0 / 64.0, 1e-4, 100, loss);
}
