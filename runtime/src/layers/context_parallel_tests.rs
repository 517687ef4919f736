//! Ring attention on threads as CP ranks against the single-rank causal kernel.

use super::*;
use crate::backend::cpu::kernels::{
    attention_backward, attention_forward, attention_scratch_len, AttnShape,
};
use crate::comm::LocalComm;
use crate::testutil::{assert_close, randn};

/// What every rank returns: `y`, `dqkv`, `lse`, causal pairs.
type RankOut = (Vec<f32>, Vec<f32>, Vec<f32>, usize);

/// Runs the ring forward and backward on `cp` threads for the full `qkv` and `dy`.
fn ring_on_threads(cp: usize, a: AttnShape, qkv: &[f32], dy: &[f32]) -> Vec<RankOut> {
    let s = ring_shape(a.b, a.t, cp, a.hq, a.hkv, a.hd).unwrap();
    LocalComm::run(cp, |comm| {
        let r = comm.rank();
        let q = cp_split(qkv, a.b, a.t, cp, r);
        let d = cp_split(dy, a.b, a.t, cp, r);
        let be = crate::backend::Cpu;
        let mut ws = RingWorkspace::new(&be, s).unwrap();
        let (mut y, mut lse) = (vec![0.0; d.len()], vec![0.0; s.lse_len()]);
        let pairs = ring_attention_forward(&be, &comm, &mut y, &mut lse, &mut ws, &q).unwrap();
        let mut dq = vec![f32::NAN; q.len()];
        ring_attention_backward(&be, &comm, &mut dq, &mut ws, &d, &q, &y, &lse).unwrap();
        (y, dq, lse, pairs)
    })
}

/// f64 log-sum-exp of the causal scores, `(b, hq, t)`.
fn reference_lse(qkv: &[f32], a: AttnShape) -> Vec<f64> {
    let (w, hd) = (a.qkv_width(), a.hd);
    let mut out = vec![0.0; a.b * a.hq * a.t];
    for b in 0..a.b {
        for h in 0..a.hq {
            let g = h / (a.hq / a.hkv);
            for i in 0..a.t {
                let q = (b * a.t + i) * w + h * hd;
                let sc: Vec<f64> = (0..=i)
                    .map(|j| {
                        let k = (b * a.t + j) * w + (a.hq + g) * hd;
                        (0..hd)
                            .map(|d| f64::from(qkv[q + d]) * f64::from(qkv[k + d]))
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                out[(b * a.hq + h) * a.t + i] =
                    m + sc.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            }
        }
    }
    out
}

fn parity(cp: usize, hq: usize, hkv: usize, chunk: usize) {
    let a = AttnShape {
        b: 2,
        t: 2 * cp * chunk,
        hq,
        hkv,
        hd: 8,
    };
    let seed = (cp * 100 + hq * 10 + hkv) as u64;
    let qkv = randn(a.b * a.t * a.qkv_width(), seed, 1.0);
    let dy = randn(a.b * a.t * a.y_width(), seed + 1, 1.0);
    let (mut y, mut att) = (vec![0.0; dy.len()], vec![0.0; a.att_len()]);
    attention_forward(&mut y, &mut att, &qkv, a);
    let mut dqkv = vec![0.0; qkv.len()];
    let mut scratch = vec![0.0; attention_scratch_len(&a)];
    attention_backward(&mut dqkv, &mut scratch, &dy, &qkv, &att, a);

    let out = ring_on_threads(cp, a, &qkv, &dy);
    let what = |x: &str| format!("cp={cp} hq={hq} hkv={hkv} chunk={chunk}: {x}");
    let ys: Vec<&[f32]> = out.iter().map(|o| &o.0[..]).collect();
    assert_close(&cp_assemble(&ys, a.b, a.t), &y, 1e-5, &what("y"));
    let ds: Vec<&[f32]> = out.iter().map(|o| &o.1[..]).collect();
    assert_close(&cp_assemble(&ds, a.b, a.t), &dqkv, 1e-5, &what("dqkv"));
    // lse (b, hq, t/cp) per rank, placed by global position.
    let want = reference_lse(&qkv, a);
    let rows = a.t / cp;
    for (r, o) in out.iter().enumerate() {
        for (i, p) in cp_positions(a.t, cp, r).into_iter().enumerate() {
            for bh in 0..a.b * a.hq {
                let (got, exp) = (f64::from(o.2[bh * rows + i]), want[bh * a.t + p]);
                assert!(
                    (got - exp).abs() <= 1e-5 * exp.abs().max(1.0),
                    "{}",
                    what(&format!(
                        "lse at rank {r} row {i} (position {p}): {got} vs {exp}"
                    ))
                );
            }
        }
    }
}

#[test]
fn ring_attention_matches_single_rank_gqa() {
    for cp in 1..=4 {
        parity(cp, 4, 2, 3);
    }
    // Chunks longer than the reference kernel's causal block (64 rows).
    parity(2, 4, 2, 40);
}

#[test]
fn ring_attention_matches_single_rank_mha() {
    for cp in 1..=4 {
        parity(cp, 3, 3, 3);
    }
}

#[test]
fn chunk_assignment_is_load_balanced() {
    for cp in 1..=6 {
        let t = 2 * cp * 3;
        let mut seen = vec![0; 2 * cp];
        let mut positions = Vec::new();
        for r in 0..cp {
            let ch = cp_chunks(cp, r);
            assert_eq!(ch, [r, 2 * cp - 1 - r], "cp={cp} rank {r}");
            ch.iter().for_each(|&j| seen[j] += 1);
            let pos = cp_positions(t, cp, r);
            assert_eq!(pos.len(), t / cp);
            assert!(ch
                .iter()
                .flat_map(|&j| j * 3..(j + 1) * 3)
                .eq(pos.iter().copied()));
            positions.extend(pos);
        }
        assert!(
            seen.iter().all(|&n| n == 1),
            "cp={cp}: chunks held {seen:?}"
        );
        positions.sort_unstable();
        assert!(positions.into_iter().eq(0..t), "cp={cp}: positions");
        let work: Vec<usize> = (0..cp).map(|r| cp_causal_pairs(t, cp, r)).collect();
        assert!(work.iter().all(|&w| w == work[0]), "cp={cp}: work {work:?}");
        assert_eq!(work.iter().sum::<usize>(), t * (t + 1) / 2, "cp={cp}");
    }
    // Split and assemble are inverse.
    let full: Vec<u32> = (0..2 * 24 * 3).collect();
    let parts: Vec<Vec<u32>> = (0..4).map(|r| cp_split(&full, 2, 24, 4, r)).collect();
    let refs: Vec<&[u32]> = parts.iter().map(|p| &p[..]).collect();
    assert_eq!(cp_assemble(&refs, 2, 24), full);
    assert!(cp_chunk_len(10, 3).is_err());
}

/// The work the ring actually does: the same on every rank, and every causal pair once.
#[test]
fn ring_work_is_balanced_and_complete() {
    for cp in 1..=4 {
        let a = AttnShape {
            b: 1,
            t: 2 * cp * 2,
            hq: 2,
            hkv: 1,
            hd: 2,
        };
        let qkv = randn(a.t * a.qkv_width(), 5, 1.0);
        let dy = randn(a.t * a.y_width(), 6, 1.0);
        let work: Vec<usize> = ring_on_threads(cp, a, &qkv, &dy)
            .iter()
            .map(|o| o.3)
            .collect();
        let want: Vec<usize> = (0..cp).map(|r| cp_causal_pairs(a.t, cp, r)).collect();
        assert_eq!(work, want, "cp={cp}");
        assert!(work.iter().all(|&w| w == work[0]), "cp={cp}: {work:?}");
        assert_eq!(work.iter().sum::<usize>(), a.t * (a.t + 1) / 2, "cp={cp}");
    }
}
