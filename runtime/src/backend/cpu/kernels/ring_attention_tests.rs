//! Tests of the ring-attention block math on one rank (the ring itself is tested on threads in
//! `layers/context_parallel_tests.rs`).

use super::*;
use crate::backend::cpu::kernels::attention::{
    attention_backward, attention_forward, attention_scratch_len, AttnShape,
};
use crate::testutil::{assert_close, randn};

#[test]
fn block_mask_is_causal_by_global_chunk() {
    assert_eq!(block_mask(3, 1), Some(BlockMask::Full));
    assert_eq!(block_mask(3, 3), Some(BlockMask::Causal));
    assert_eq!(block_mask(1, 3), None);
    assert_eq!(block_pairs(BlockMask::Full, 4), 16);
    assert_eq!(block_pairs(BlockMask::Causal, 4), 10);
}

/// The merge of two key halves, in either order, is the softmax over all keys.
#[test]
fn merge_of_key_blocks_is_the_whole_softmax() {
    let (tq, tk, hd) = (3, 8, 4);
    let q = randn(tq * hd, 1, 1.0);
    let k = randn(tk * hd, 2, 1.5);
    let v = randn(tk * hd, 3, 1.0);
    let run = |k0: usize, k1: usize| {
        let (mut o, mut lse, mut p) = (vec![0.0; tq * hd], vec![0.0; tq], vec![0.0; tq * tk]);
        block_forward(
            &mut o,
            &mut lse,
            &mut p,
            MatRef::rows(&q, tq, hd),
            MatRef::new(&k, k0 * hd, k1 - k0, hd, hd, 1),
            MatRef::new(&v, k0 * hd, k1 - k0, hd, hd, 1),
            0.5,
            BlockMask::Full,
            tq,
            k1 - k0,
            hd,
        );
        (o, lse)
    };
    let (whole, whole_lse) = run(0, tk);
    let (a, b) = (run(0, 3), run(3, tk));
    for (first, second) in [(&a, &b), (&b, &a)] {
        let (mut o, mut lse) = (vec![0.0; tq * hd], vec![f32::NEG_INFINITY; tq]);
        for part in [first, second] {
            for r in 0..tq {
                merge_row(
                    &mut o[r * hd..(r + 1) * hd],
                    &mut lse[r],
                    &part.0[r * hd..(r + 1) * hd],
                    part.1[r],
                );
            }
        }
        assert_close(&o, &whole, 1e-6, "merged output");
        assert_close(&lse, &whole_lse, 1e-6, "merged lse");
    }
}

/// One rank holding both chunks (CP = 1): the step functions are the causal kernel.
#[test]
fn one_rank_steps_match_the_causal_kernel() {
    for (hq, hkv) in [(4, 2), (2, 2)] {
        let s = RingShape {
            b: 2,
            chunk: 5,
            hq,
            hkv,
            hd: 4,
        };
        let a = AttnShape {
            b: s.b,
            t: s.rows(),
            hq,
            hkv,
            hd: s.hd,
        };
        let qkv = randn(s.b * s.rows() * s.qkv_width(), 7, 1.0);
        let dy = randn(s.b * s.rows() * s.y_width(), 8, 1.0);
        let (mut want_y, mut att) = (vec![0.0; dy.len()], vec![0.0; a.att_len()]);
        attention_forward(&mut want_y, &mut att, &qkv, a);
        let mut want_dqkv = vec![0.0; qkv.len()];
        let mut sc = vec![0.0; attention_scratch_len(&a)];
        attention_backward(&mut want_dqkv, &mut sc, &dy, &qkv, &att, a);

        let mut kv = vec![0.0; s.kv_len()];
        pack_kv(&mut kv, &qkv, &s);
        let mut scratch = vec![0.0; ring_scratch_len(&s)];
        let (mut y, mut lse) = (vec![0.0; dy.len()], vec![0.0; s.lse_len()]);
        ring_forward_init(&mut y, &mut lse);
        let pairs = ring_forward_step(
            &mut y,
            &mut lse,
            &mut scratch,
            &qkv,
            &kv,
            [0, 1],
            [0, 1],
            &s,
        );
        assert_eq!(pairs, s.rows() * (s.rows() + 1) / 2);
        assert_close(&y, &want_y, 1e-5, "y");

        let mut delta = vec![0.0; s.lse_len()];
        softmax_delta(&mut delta, &y, &dy, &s);
        let (mut dq, mut dkv) = (vec![0.0; dy.len()], vec![0.0; s.kv_len()]);
        ring_backward_step(
            &mut dq,
            &mut dkv,
            &mut scratch,
            &qkv,
            &kv,
            &dy,
            &lse,
            &delta,
            [0, 1],
            [0, 1],
            &s,
        );
        let mut dqkv = vec![f32::NAN; qkv.len()];
        ring_unpack(&mut dqkv, &dq, &dkv, &s);
        assert_close(&dqkv, &want_dqkv, 1e-5, "dqkv");
    }
}
