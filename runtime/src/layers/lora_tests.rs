//! The adapter's backward against central differences of `L = Σ w ⊙ y` (`y` is linear in
//! each of `x`, `A`, `B`, so the differences are exact up to rounding), without and with LoRA
//! dropout (its mask is a pure function of the armed call, the same in every perturbed forward).

use super::*;
use crate::backend::Cpu;
use crate::rng;

fn randn(n: usize, stream: u64) -> Vec<f32> {
    let mut v = vec![0.0; n];
    rng::fill_normal(&mut v, 7, stream, 0, 0.5);
    v
}

#[test]
fn gradients_match_central_differences() {
    let (n, k, m) = (5, 6, 4);
    for (column, dropout) in [(true, 0.0), (false, 0.0), (true, 0.5), (false, 0.5)] {
        let s = LoraSettings {
            rank: 3,
            scaling: 1.5,
            targets: vec![Target::O],
            dropout,
        };
        let mut layout = ParamLayout::frozen_at(0);
        let tp = TpShard::new(0, 1);
        let ad = match column {
            true => Adapter::column(&mut layout, "lin", k, &[m], &s, tp).unwrap(),
            false => Adapter::row(&mut layout, "lin", k, m, &s, tp).unwrap(),
        };
        assert_eq!(layout.trainable_len(), 3 * k + m * 3);
        ad.dropout
            .arm(Some(crate::layers::dropout::DropCall::new(1, 2, 3, n)));
        // A random B (not the zero init), so every gradient is non-zero.
        let mut p = randn(layout.len(), 1);
        let x = randn(n * k, 2);
        let w = randn(n * m, 3);
        let loss = |p: &[f32], x: &[f32]| {
            let mut y = vec![0.0; n * m];
            ad.forward::<Cpu>(&Cpu, p, x, &mut y).unwrap();
            y.iter().zip(&w).map(|(a, b)| f64::from(a * b)).sum::<f64>()
        };
        let mut g = vec![0.0; layout.trainable_len()];
        let mut dx = vec![0.0; n * k];
        ad.backward::<Cpu>(&Cpu, &p, &mut g, &x, &w, &mut dx)
            .unwrap();
        let h = 1e-2;
        let close = |num: f64, got: f32, what: &str| {
            assert!(
                (num - f64::from(got)).abs() <= 1e-3 * (1.0 + num.abs()),
                "column {column} dropout {dropout}: {what}: {num} vs {got}"
            );
        };
        for i in 0..p.len() {
            let v = p[i];
            p[i] = v + h;
            let up = loss(&p, &x);
            p[i] = v - h;
            let down = loss(&p, &x);
            p[i] = v;
            close(
                (up - down) / (2.0 * f64::from(h)),
                g[i],
                &format!("param {i}"),
            );
        }
        let mut xx = x.clone();
        for i in 0..x.len() {
            xx[i] = x[i] + h;
            let up = loss(&p, &xx);
            xx[i] = x[i] - h;
            let down = loss(&p, &xx);
            xx[i] = x[i];
            close((up - down) / (2.0 * f64::from(h)), dx[i], &format!("x {i}"));
        }
    }
}

/// LoRA dropout drops the adapter's input: the adapter's output changes, and disarmed (as in
/// evaluation) the adapter is the undropped one.
#[test]
fn dropout_changes_the_adapter_output_and_only_while_armed() {
    let s = LoraSettings {
        rank: 2,
        scaling: 1.0,
        targets: vec![Target::O],
        dropout: 0.5,
    };
    let (n, k, m) = (4, 8, 3);
    let mut layout = ParamLayout::frozen_at(0);
    let ad = Adapter::column(&mut layout, "lin", k, &[m], &s, TpShard::new(0, 1)).unwrap();
    let p = randn(layout.len(), 1);
    let x = randn(n * k, 2);
    let y = |armed: bool| {
        let call = crate::layers::dropout::DropCall::new(1, 2, 3, n);
        ad.dropout.arm(armed.then_some(call));
        let mut y = vec![0.0; n * m];
        ad.forward::<Cpu>(&Cpu, &p, &x, &mut y).unwrap();
        y
    };
    let (off, on) = (y(false), y(true));
    assert_ne!(off, on, "dropout changes the output");
    assert_eq!(y(false), off, "disarmed: no dropout");
    assert_eq!(y(true), on, "the same draw again");
}
