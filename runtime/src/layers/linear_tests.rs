//! Linear layers: finite differences at t = 1, and t = 2, 4 against t = 1 on the full weights.

use super::*;
use crate::backend::Cpu;
use crate::comm::LocalComm;
use crate::layers::testkit::{assert_globals_close, full_cols, gather, local_cols, on_tp};
use crate::testutil::{assert_close, fd_check, randn, weighted};

const N: usize = 6;
const IN: usize = 8;
const PARTS: [(&str, usize); 2] = [("a", 8), ("b", 4)];

fn column(tp: TpShard) -> (ParamLayout, ColumnParallelLinear) {
    let mut l = ParamLayout::new();
    let lin = ColumnParallelLinear::fused(&mut l, &PARTS, IN, true, tp, 0.5).unwrap();
    (l, lin)
}

fn row(tp: TpShard) -> (ParamLayout, RowParallelLinear) {
    let mut l = ParamLayout::new();
    let lin = RowParallelLinear::new(&mut l, "r", IN, 5, true, tp, 0.5).unwrap();
    (l, lin)
}

#[test]
fn column_parallel_gradients_match_finite_differences() {
    let (layout, lin) = column(TpShard::SINGLE);
    let mut p = layout.init(1);
    p.iter_mut().for_each(|v| *v += 0.1); // non-zero biases
    let x = randn(N * IN, 2, 1.0);
    let gy = randn(N * 12, 3, 1.0);
    let comm = &LocalComm::group(1)[0];
    let mut g = layout.zeros();
    let mut dx = vec![0.0; N * IN];
    lin.backward(&Cpu, &p, &mut g, &x, &gy, &mut dx, comm)
        .unwrap();
    let fwd = |p: &[f32], x: &[f32]| {
        let mut y = vec![0.0; N * 12];
        lin.forward(&Cpu, p, x, &mut y).unwrap();
        weighted(&y, &gy)
    };
    fd_check("column dparams", &p, &g, 1.0 / 64.0, 1e-3, 200, |p| {
        fwd(p, &x)
    });
    fd_check("column dx", &x, &dx, 1.0 / 64.0, 1e-3, 200, |x| fwd(&p, x));
}

#[test]
fn row_parallel_gradients_match_finite_differences() {
    let (layout, lin) = row(TpShard::SINGLE);
    let mut p = layout.init(1);
    p.iter_mut().for_each(|v| *v += 0.1);
    let x = randn(N * IN, 2, 1.0);
    let gy = randn(N * 5, 3, 1.0);
    let comm = &LocalComm::group(1)[0];
    let mut g = layout.zeros();
    let mut dx = vec![0.0; N * IN];
    lin.backward(&Cpu, &p, &mut g, &x, &gy, &mut dx).unwrap();
    let fwd = |p: &[f32], x: &[f32]| {
        let mut y = vec![0.0; N * 5];
        lin.forward(&Cpu, p, x, &mut y, comm).unwrap();
        weighted(&y, &gy)
    };
    fd_check("row dparams", &p, &g, 1.0 / 64.0, 1e-3, 200, |p| fwd(p, &x));
    fd_check("row dx", &x, &dx, 1.0 / 64.0, 1e-3, 200, |x| fwd(&p, x));
}

/// Runs the column layer on `t` ranks.
/// Per rank: (layout, grads, y_local, dx).
type RankRun = (ParamLayout, Vec<f32>, Vec<f32>, Vec<f32>);

fn run_column(t: usize, x: &[f32], gy: &[f32]) -> Vec<RankRun> {
    let widths: Vec<usize> = PARTS.iter().map(|p| p.1).collect();
    on_tp(t, |comm, tp| {
        let (layout, lin) = column(tp);
        let mut p = layout.init(7);
        p.iter_mut().for_each(|v| *v += 0.1);
        let mut y = vec![0.0; N * lin.out_local];
        lin.forward(&Cpu, &p, x, &mut y).unwrap();
        let gy_local = local_cols(gy, &widths, tp);
        let (mut g, mut dx) = (layout.zeros(), vec![0.0; N * IN]);
        lin.backward(&Cpu, &p, &mut g, x, &gy_local, &mut dx, comm)
            .unwrap();
        (layout, g, y, dx)
    })
}

#[test]
fn column_parallel_matches_single_rank() {
    let widths: Vec<usize> = PARTS.iter().map(|p| p.1).collect();
    let x = randn(N * IN, 2, 1.0);
    let gy = randn(N * 12, 3, 1.0);
    let one = run_column(1, &x, &gy);
    let want_grads = gather(&[(&one[0].0, &one[0].1)]);
    for t in [2, 4] {
        let ranks = run_column(t, &x, &gy);
        let ys: Vec<Vec<f32>> = ranks.iter().map(|r| r.2.clone()).collect();
        assert_close(&full_cols(&ys, &widths), &one[0].2, 1e-5, "column y");
        for r in &ranks {
            assert_close(&r.3, &one[0].3, 1e-5, "column dx");
        }
        let grads = gather(&ranks.iter().map(|r| (&r.0, &r.1[..])).collect::<Vec<_>>());
        assert_globals_close(&grads, &want_grads, 1e-5, &format!("column t={t}"));
    }
}

#[test]
fn row_parallel_matches_single_rank() {
    let x = randn(N * IN, 2, 1.0);
    let gy = randn(N * 5, 3, 1.0);
    let run = |t: usize| {
        on_tp(t, |comm, tp| {
            let (layout, lin) = row(tp);
            let mut p = layout.init(7);
            p.iter_mut().for_each(|v| *v += 0.1);
            let x_local = local_cols(&x, &[IN], tp);
            let mut y = vec![0.0; N * 5];
            lin.forward(&Cpu, &p, &x_local, &mut y, comm).unwrap();
            let (mut g, mut dx) = (layout.zeros(), vec![0.0; x_local.len()]);
            lin.backward(&Cpu, &p, &mut g, &x_local, &gy, &mut dx)
                .unwrap();
            (layout, g, y, dx)
        })
    };
    let one = run(1);
    let want_grads = gather(&[(&one[0].0, &one[0].1)]);
    for t in [2, 4] {
        let ranks = run(t);
        for r in &ranks {
            assert_close(&r.2, &one[0].2, 1e-5, "row y");
        }
        let dxs: Vec<Vec<f32>> = ranks.iter().map(|r| r.3.clone()).collect();
        assert_close(&full_cols(&dxs, &[IN]), &one[0].3, 1e-5, "row dx");
        let grads = gather(&ranks.iter().map(|r| (&r.0, &r.1[..])).collect::<Vec<_>>());
        assert_globals_close(&grads, &want_grads, 1e-5, &format!("row t={t}"));
    }
}

#[test]
fn indivisible_shapes_are_rejected() {
    let mut l = ParamLayout::new();
    let err =
        ColumnParallelLinear::new(&mut l, "c", 4, 6, false, TpShard::new(0, 4), 0.1).unwrap_err();
    assert!(
        matches!(err, LayerError::NotDivisible { n: 6, tp: 4, .. }),
        "{err}"
    );
}
