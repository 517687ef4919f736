//! AdamW against a scalar f64 reference, shard-vs-full bitwise parity, TP-aware gradient norm,
//! and the LR schedule.

use super::*;
use crate::comm::all_reduce_f64;
use crate::layers::testkit::on_tp;
use crate::layers::{ColumnParallelLinear, Norm, NormKind, RowParallelLinear};
use crate::testutil::randn;

fn layout(tp: crate::layers::TpShard) -> ParamLayout {
    let mut l = ParamLayout::new();
    Norm::new(&mut l, "ln", NormKind::LayerNorm, 4, 1e-5).unwrap();
    ColumnParallelLinear::new(&mut l, "fc", 4, 8, true, tp, 0.1).unwrap();
    RowParallelLinear::new(&mut l, "proj", 8, 4, true, tp, 0.1).unwrap();
    l
}

#[test]
fn lr_schedule_warms_up_then_decays_to_min() {
    let s = LrSchedule {
        max_lr: 1.0,
        min_lr: 0.1,
        warmup_steps: 4,
        total_steps: 14,
        decay: Decay::Cosine,
    };
    assert_eq!(s.lr(0), 0.25);
    assert_eq!(s.lr(3), 1.0);
    assert_eq!(s.lr(4), 1.0);
    assert!((s.lr(9) - 0.55).abs() < 1e-6, "half way: {}", s.lr(9));
    assert!((s.lr(14) - 0.1).abs() < 1e-7);
    assert!((s.lr(100) - 0.1).abs() < 1e-7);
    assert!(s.lr(5) < s.lr(4) && s.lr(6) < s.lr(5));
}

/// A schedule of peak 1.0 and minimum 0.2, 2 warm-up steps, decaying until step 12.
fn shape(decay: Decay) -> LrSchedule {
    LrSchedule {
        max_lr: 1.0,
        min_lr: 0.2,
        warmup_steps: 2,
        total_steps: 12,
        decay,
    }
}

fn close(got: f32, want: f64) {
    assert!((f64::from(got) - want).abs() < 1e-6, "{got} against {want}");
}

#[test]
fn lr_decay_shapes_by_hand() {
    // Warm-up is the same for every shape: (step + 1) / 2 of the peak.
    for d in [
        Decay::Cosine,
        Decay::Linear,
        Decay::Constant,
        Decay::Wsd { decay_steps: 4 },
    ] {
        close(shape(d).lr(0), 0.5);
        close(shape(d).lr(1), 1.0);
        close(shape(d).lr(2), 1.0);
    }
    // Cosine over steps 2..12: the midpoint (step 7) is (max + min) / 2; a quarter in (step
    // 4.5 is not a step; step 7 and the end suffice) and the end is min.
    let c = shape(Decay::Cosine);
    close(c.lr(7), (1.0 + 0.2) / 2.0);
    // Step 4: progress 2/10, 0.2 + 0.5 · (1 + cos(0.2π)) · 0.8.
    close(
        c.lr(4),
        0.2 + 0.5 * (1.0 + (0.2 * std::f64::consts::PI).cos()) * 0.8,
    );
    close(c.lr(12), 0.2);
    close(c.lr(1000), 0.2);
    // Linear: 1 − 0.08 per step after step 2.
    let l = shape(Decay::Linear);
    close(l.lr(3), 0.92);
    close(l.lr(7), 0.6);
    close(l.lr(11), 0.28);
    close(l.lr(12), 0.2);
    close(l.lr(50), 0.2);
    // Constant: the peak to the end and beyond.
    let k = shape(Decay::Constant);
    for step in [2, 7, 12, 100] {
        close(k.lr(step), 1.0);
    }
    // WSD with the last 4 steps decaying: stable until step 8, then 0.2 of the range per step.
    let w = shape(Decay::Wsd { decay_steps: 4 });
    for step in 2..=8 {
        close(w.lr(step), 1.0);
    }
    close(w.lr(9), 0.8);
    close(w.lr(10), 0.6);
    close(w.lr(11), 0.4);
    close(w.lr(12), 0.2);
    close(w.lr(13), 0.2);
    // A decay longer than the steps after the warm-up starts where the warm-up ends.
    let long = shape(Decay::Wsd { decay_steps: 100 });
    close(long.lr(2), 1.0);
    close(long.lr(7), 0.6);
}

#[test]
fn lr_schedule_of_a_plan_schedule() {
    use tessera_planner::optimizer::{DecayShape, Optimizer, Schedule};
    let o = Optimizer {
        lr: 1.0,
        min_lr: 0.2,
        ..Optimizer::default()
    };
    let s = Schedule {
        warmup_steps: 2,
        decay: DecayShape::Wsd,
        decay_steps: None,
        wsd_decay_fraction: 0.25,
    };
    // decay_steps absent: the run's 20 steps; WSD decays over round(0.25 · 20) = 5 of them.
    let w = LrSchedule::of(&o, &s, 20);
    assert_eq!(w.total_steps, 20);
    assert_eq!(w.decay, Decay::Wsd { decay_steps: 5 });
    let fixed = LrSchedule::of(
        &o,
        &Schedule {
            decay: DecayShape::Linear,
            decay_steps: Some(12),
            ..s
        },
        20,
    );
    assert_eq!(fixed, shape(Decay::Linear));
    // The defaults are the runtime's earlier constants.
    let d = LrSchedule::of(&Optimizer::default(), &Schedule::default(), 50);
    assert_eq!(
        (d.max_lr, d.min_lr, d.warmup_steps, d.total_steps, d.decay),
        (3e-3, 3e-4, 5, 50, Decay::Cosine)
    );
}

#[test]
fn decay_on_overrides_the_tensors_flags() {
    let l = layout(crate::layers::TpShard::SINGLE);
    let flags = |decay_on| {
        let cfg = AdamWConfig {
            decay_on,
            ..AdamWConfig::default()
        };
        let mut opt = AdamW::new(cfg, &l, 0..l.len());
        opt.begin_step(1.0, 1.0)
            .into_iter()
            .map(|(_, s)| s.weight_decay > 0.0)
            .collect::<Vec<_>>()
    };
    let matrices = flags(DecayOn::Matrices);
    assert!(matrices.contains(&true) && matrices.contains(&false));
    assert!(flags(DecayOn::All).iter().all(|&d| d));
    assert!(flags(DecayOn::None).iter().all(|&d| !d));
}

#[test]
fn adamw_matches_a_scalar_reference() {
    let l = layout(crate::layers::TpShard::SINGLE);
    let cfg = AdamWConfig {
        beta1: 0.8,
        beta2: 0.9,
        eps: 1e-6,
        weight_decay: 0.5,
        decay_on: DecayOn::Matrices,
    };
    let mut p = randn(l.len(), 1, 1.0);
    let mut opt = AdamW::new(cfg, &l, 0..l.len());
    let (mut rp, mut rm, mut rv): (Vec<f64>, Vec<f64>, Vec<f64>) = (
        p.iter().map(|&x| f64::from(x)).collect(),
        vec![0.0; l.len()],
        vec![0.0; l.len()],
    );
    let decay: Vec<bool> = (0..l.len())
        .map(|i| l.segments(i..i + 1).next().unwrap().1.decay)
        .collect();
    assert!(decay.iter().any(|&d| d) && decay.iter().any(|&d| !d));
    for t in 1..=3 {
        let g = randn(l.len(), 10 + t, 1.0);
        let (lr, scale) = (0.01 * t as f32, 0.5);
        opt.step(&mut p, &g, lr, scale);
        let (b1, b2) = (f64::from(cfg.beta1), f64::from(cfg.beta2));
        for i in 0..l.len() {
            let gi = f64::from(g[i]) * f64::from(scale);
            rm[i] = b1 * rm[i] + (1.0 - b1) * gi;
            rv[i] = b2 * rv[i] + (1.0 - b2) * gi * gi;
            let (mh, vh) = (
                rm[i] / (1.0 - b1.powi(t as i32)),
                rv[i] / (1.0 - b2.powi(t as i32)),
            );
            let wd = if decay[i] {
                f64::from(cfg.weight_decay)
            } else {
                0.0
            };
            rp[i] -= f64::from(lr) * (mh / (vh.sqrt() + f64::from(cfg.eps)) + wd * rp[i]);
        }
    }
    for (a, b) in p.iter().zip(&rp) {
        assert!((f64::from(*a) - b).abs() < 1e-5, "{a} vs {b}");
    }
}

#[test]
fn shard_updates_equal_the_full_update_bitwise() {
    let l = layout(crate::layers::TpShard::SINGLE);
    let n = l.len();
    let cfg = AdamWConfig::default();
    let p0 = randn(n, 1, 1.0);
    let mut full = p0.clone();
    let mut opt = AdamW::new(cfg, &l, 0..n);
    // Three "DP ranks" whose shards cut tensors in the middle.
    let cuts = [0, 7, n / 2 + 3, n];
    let mut shards: Vec<(Vec<f32>, AdamW)> = cuts
        .windows(2)
        .map(|w| (p0[w[0]..w[1]].to_vec(), AdamW::new(cfg, &l, w[0]..w[1])))
        .collect();
    for t in 0..3 {
        let g = randn(n, 20 + t, 1.0);
        opt.step(&mut full, &g, 1e-2, 0.7);
        for (p, o) in shards.iter_mut() {
            let r = o.range.clone();
            o.step(p, &g[r], 1e-2, 0.7);
        }
    }
    let joined: Vec<f32> = shards.iter().flat_map(|(p, _)| p.clone()).collect();
    assert!(joined
        .iter()
        .zip(&full)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn grad_norm_counts_replicated_tensors_once_across_tp() {
    // Global gradient values keyed by tensor name; each TP rank holds its shards.
    let full = layout(crate::layers::TpShard::SINGLE);
    let g_full = randn(full.len(), 5, 1.0);
    let want = local_grad_sq(&full, &g_full, 0..full.len(), 0).sqrt();
    let single = grad_norm(&full, &g_full, 0..full.len(), 0, &|x| Ok(x)).unwrap();
    assert_eq!(single, want);
    for t in [2, 4] {
        let norms = on_tp(t, |comm, tp| {
            let l = layout(tp);
            let mut g = l.zeros();
            for e in l.entries() {
                let fe = full.get(&e.name).unwrap();
                e.copy_global_to_shard(fe.param_ref().of(&g_full), e.param_ref().of_mut(&mut g));
            }
            let sum = |x: f64| all_reduce_f64(comm, x);
            grad_norm(&l, &g, 0..l.len(), tp.rank, &sum).unwrap()
        });
        for nrm in norms {
            assert!((nrm - want).abs() < 1e-12 * want, "t={t}: {nrm} vs {want}");
        }
    }
}

#[test]
fn clipping_scales_only_above_the_threshold() {
    assert_eq!(clip_scale(0.5, 1.0), 1.0);
    assert_eq!(clip_scale(5.0, 0.0), 1.0);
    assert!((clip_scale(4.0, 1.0) - 0.25).abs() < 1e-6);
}
