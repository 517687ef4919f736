//! The ranking against brute force, the near-tie rule, and the reasons for losing.

use super::*;
use crate::cost::TimeTerm;
use crate::layout::Sharding;
use crate::spec::{self as specs, ClusterOverrides, TrainingOverrides};
use std::path::Path;

fn job(model: &str, cluster: &str, nodes: u64) -> (Model, Cluster) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    let m = specs::load_model(
        &root.join("models").join(model),
        TrainingOverrides::default(),
    )
    .unwrap();
    let c = specs::load_cluster(
        &root.join("clusters").join(cluster),
        ClusterOverrides {
            nodes: Some(nodes),
            devices: None,
        },
    )
    .unwrap();
    (m, c)
}

/// Branch and bound gives the ranking that simulating every fitting layout gives.
#[test]
fn search_ranking_equals_simulating_everything() {
    for (model, cluster, nodes) in [
        ("gpt2-124m.toml", "dgx-a100-80g.toml", 1),
        ("llama3-8b.toml", "dgx-h100-80g.toml", 2),
    ] {
        let (m, c) = job(model, cluster, nodes);
        let top = 6;
        let options = SearchOptions {
            top,
            ..SearchOptions::default()
        };
        let r = search_with(&m, &c, &Pins::default(), options);
        assert!(r.fits.len() > top, "{model}: too few layouts to test");
        // Every fitting layout, simulated.
        let mut all: Vec<(Layout, f64)> = r
            .fits
            .iter()
            .map(|f| {
                let links = Links::new(&c, &f.layout.mesh(&c));
                let times = cost::layer_times(&m, &c, &f.layout, &links, options.cost);
                let e = cost::evaluate(&m, &c, &f.layout, &f.split, &links, &times, options.cost);
                let step = e.predict(&Simulator::new().run(&e.pipeline)).step_time_s;
                assert!(
                    e.lower_bound <= step * (1.0 + 1e-12),
                    "bound above the simulation"
                );
                (f.layout, step)
            })
            .collect();
        let best = all.iter().map(|x| x.1).fold(f64::INFINITY, f64::min);
        let tie = |t: f64| t <= best * (1.0 + NEAR_TIE);
        all.sort_by(|a, b| {
            tie(b.1).cmp(&tie(a.1)).then_with(|| {
                if tie(a.1) && tie(b.1) {
                    complexity(&a.0, &c).cmp(&complexity(&b.0, &c))
                } else {
                    a.1.total_cmp(&b.1)
                }
            })
        });
        for (i, (layout, step)) in all.iter().take(top).enumerate() {
            let got = &r.fits[i];
            assert_eq!(got.layout, *layout, "{model} rank {}", i + 1);
            assert!((got.step_time() - step).abs() <= 1e-9 * step);
        }
        assert!(
            r.simulated < r.fits.len() as u64,
            "{model}: the bound pruned nothing"
        );
    }
}

/// Within 2% of the fastest the least complex layout wins, and it says so.
#[test]
fn search_prefers_the_simpler_layout_on_a_near_tie() {
    let (m, c) = job("gpt3-175b.toml", "dgx-a100-80g.toml", 16);
    // Every alternative gets its reason (the default names only the first `top` of them).
    let options = SearchOptions {
        top: usize::MAX,
        ..SearchOptions::default()
    };
    let r = search_with(&m, &c, &Pins::default(), options);
    let head: Vec<&Candidate> = r.fits.iter().filter(|f| f.prediction.is_some()).collect();
    let fastest = head
        .iter()
        .map(|f| f.step_time())
        .fold(f64::INFINITY, f64::min);
    let chosen = head[0];
    assert!(chosen.step_time() <= fastest * (1.0 + NEAR_TIE));
    for f in &head[1..] {
        if f.step_time() <= fastest * (1.0 + NEAR_TIE) {
            assert!(complexity(&chosen.layout, &c) <= complexity(&f.layout, &c));
            assert!(f
                .why
                .as_deref()
                .unwrap_or("")
                .contains("simpler layout is preferred"));
        }
    }
}

fn predicted(step: f64, terms: &[(&str, f64)]) -> Prediction {
    Prediction {
        step_time_s: step,
        breakdown: terms
            .iter()
            .map(|(n, s)| TimeTerm {
                name: n.to_string(),
                seconds: *s,
                reason: String::new(),
            })
            .collect(),
        tokens_per_s: 0.0,
        tokens_per_s_per_device: 0.0,
        mfu: 0.0,
        model_flops_per_step: 0.0,
        bottleneck_stage: 0,
    }
}

fn candidate(tp: u64, p: Prediction) -> Candidate {
    Candidate {
        layout: Layout {
            dp: 128 / tp,
            cp: 1,
            cp_comm: crate::layout::CpComm::P2p,
            ep: 1,
            pp: 1,
            tp,
            micro_batch: 1,
            sharding: Sharding {
                zero_stage: 0,
                hybrid: false,
            },
            recompute: Recompute::Full,
            recompute_every: 1,
            sequence_parallel: false,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            offload: crate::layout::Offload::NONE,
        },
        peak_bytes: 0,
        split: vec![96],
        lower_bound: 0.0,
        prediction: Some(p),
        why: None,
    }
}

/// The reason names the term that grew most, the knob behind it and by how much.
#[test]
fn search_says_why_an_alternative_lost() {
    let (m, c) = job("gpt3-175b.toml", "dgx-a100-80g.toml", 16);
    let best = candidate(8, predicted(10.0, &[("compute", 8.0), ("tp_comm", 2.0)]));
    let alt = candidate(16, predicted(11.0, &[("compute", 8.24), ("tp_comm", 2.76)]));
    let why = why::lost(&best, &alt, &c, &m);
    assert_eq!(
        why,
        "TP=16 crosses the node boundary: +38% tp_comm; step +10.0%"
    );
    let near = candidate(16, predicted(9.9, &[("compute", 7.9), ("tp_comm", 2.0)]));
    let why = why::lost(&best, &near, &c, &m);
    assert!(
        why.starts_with("1.0% faster, within 2% of the fastest"),
        "{why}"
    );
    assert!(why.contains("TP 16 vs 8"), "{why}");
}

/// The simulation bound rejects no layout of a preset job (it would change their reasons):
/// the largest, Megatron's 1T model on 2 nodes, has 393,216 passes.
#[test]
fn search_simulation_bound_rejects_no_preset_layout() {
    use crate::layout::{MAX_SIMULATED_PASSES, TOO_MANY_MICROBATCHES};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs");
    let mut most = 0;
    for model in std::fs::read_dir(root.join("models")).unwrap() {
        let m = match specs::load_model(&model.unwrap().path(), TrainingOverrides::default()) {
            Ok(m) => m,
            // Specs read for their counts but not planned (MLA, per-head norms).
            Err(e)
                if e.field.starts_with("architecture.mla") || e.field == "architecture.qk_norm" =>
            {
                continue
            }
            Err(e) => panic!("{e}"),
        };
        for nodes in [1, 2, 16] {
            let (_, c) = job("tiny.toml", "dgx-a100-80g.toml", nodes);
            for l in enumerate(&m, &c, &Pins::default()) {
                if let Err(r) = l.check(&m, &c) {
                    assert_ne!(r.rule, TOO_MANY_MICROBATCHES, "{}: {r}", m.name);
                    continue;
                }
                most = most.max(l.microbatches(&m) * l.pp * l.virtual_stages);
            }
        }
    }
    assert!((1 << 16..=MAX_SIMULATED_PASSES).contains(&most), "{most}");
}

/// The count is the enumeration's length, pins or none, and the presets fit under the limit.
#[test]
fn search_counts_exactly_the_layouts_it_enumerates() {
    let pinned = [
        Pins::default(),
        Pins {
            tp: Some(8),
            ..Pins::default()
        },
        Pins {
            pp: Some(4),
            micro_batch: Some(2),
            ..Pins::default()
        },
        Pins {
            dp: Some(6),
            schedule: Some(ScheduleKind::Interleaved),
            ..Pins::default()
        },
        Pins {
            schedule: Some(ScheduleKind::Interleaved),
            virtual_stages: Some(3),
            zero: Some(3),
            hybrid: Some(true),
            sp: Some(true),
            recompute: Some(Recompute::Full),
            ..Pins::default()
        },
    ];
    for (model, cluster, nodes) in [
        ("gpt3-175b.toml", "dgx-a100-80g.toml", 16),
        ("llama3-8b.toml", "dgx-h100-80g.toml", 3),
        ("tiny.toml", "cpu-8.toml", 1),
        ("megatron-530b.toml", "dgx-a100-80g.toml", 315),
    ] {
        let (m, c) = job(model, cluster, nodes);
        for pins in &pinned {
            let size = count_layouts(&m, &c, pins);
            assert!(size.complete && size.layouts <= MAX_LAYOUTS, "{model}");
            let listed = enumerate(&m, &c, pins).len() as u64;
            assert_eq!(size.layouts, listed, "{model} {pins:?}");
        }
    }
}
