//! The tiny model's spec, the CPU cluster and the data, for tests that build their own plans.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use tessera_planner::layout::{Layout, Recompute};
use tessera_planner::model::Model;
use tessera_planner::plan::{Plan, SearchSummary};
use tessera_planner::schedule::ScheduleKind;
use tessera_planner::spec::{load_cluster, load_model, ClusterOverrides, TrainingOverrides};
use tessera_planner::Cluster;
use tessera_runtime::data::Tokens;
use tessera_runtime::exec::{train, EvalSet, TrainOptions, TrainReport};

fn root() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// specs/models/tiny.toml.
pub fn model() -> Model {
    load_model(
        &root().join("specs/models/tiny.toml"),
        TrainingOverrides::default(),
    )
    .unwrap()
}

/// specs/models/tiny-moe.toml: the tiny model with 4 routed experts, top-2, in layers 1..3.
pub fn moe_model() -> Model {
    load_model(
        &root().join("specs/models/tiny-moe.toml"),
        TrainingOverrides::default(),
    )
    .unwrap()
}

/// `devices` devices of specs/clusters/cpu-8.toml.
pub fn cluster(devices: u64) -> Cluster {
    load_cluster(
        &root().join("specs/clusters/cpu-8.toml"),
        ClusterOverrides {
            nodes: None,
            devices: Some(devices),
        },
    )
    .unwrap()
}

/// The layouts of these tests: micro-batch 2, no hybrid sharding, no sequence parallelism.
pub fn layout(
    dp: u64,
    pp: u64,
    tp: u64,
    zero: u8,
    schedule: ScheduleKind,
    v: u64,
    recompute: Recompute,
) -> Layout {
    Layout {
        pp,
        recompute,
        schedule,
        virtual_stages: v,
        ..Layout::without_pipeline(dp, tp, zero, 2)
    }
}

/// The plan of `layout` for `model` (checked first).
pub fn plan(model: &Model, layout: &Layout) -> Plan {
    let cluster = cluster(layout.dp * layout.cp * layout.pp * layout.tp);
    layout
        .check(model, &cluster)
        .unwrap_or_else(|e| panic!("{}: {e}", layout.label()));
    Plan::new(model, &cluster, layout, SearchSummary::pinned())
}

/// examples/data/parallelism.txt.
pub fn data() -> Tokens {
    Tokens::load(&root().join("examples/data/parallelism.txt")).unwrap()
}

/// `steps` steps of `plan` on the CPU backend, on [`data`].
pub fn run(plan: &Plan, steps: usize) -> TrainReport {
    let data = data();
    let opts = TrainOptions {
        steps,
        ..TrainOptions::default()
    };
    train(plan, &data, &opts, &mut |_| {}).unwrap()
}

/// `steps` steps of `plan` on [`data`], with the validation loss as part of the oracle: two
/// global batches of fixed sequences, evaluated after every second step and the last.
pub fn run_evaluated(plan: &Plan, steps: usize) -> TrainReport {
    let t = &plan.job.model.training;
    let (seq, batch) = (t.seq_len as usize, t.global_batch as usize);
    let (inputs, targets) = data().eval_sequences(seq, 2 * batch);
    assert_eq!(
        inputs.len(),
        2 * batch * seq,
        "the tiny text holds two eval batches"
    );
    let opts = TrainOptions {
        steps,
        eval: Some(std::sync::Arc::new(EvalSet {
            every: 2,
            inputs,
            targets,
            source: "tiny text".into(),
        })),
        ..TrainOptions::default()
    };
    train(plan, &data(), &opts, &mut |_| {})
        .unwrap_or_else(|e| panic!("{}: {e}", plan.parallel.layout().label()))
}

/// A [`run_evaluated`] run of `steps` steps matches the reference: every step's loss, the
/// validation losses and the final parameters.
pub fn assert_same_run(got: &TrainReport, want: &TrainReport, steps: usize, what: &str) {
    assert_eq!(got.steps.len(), steps, "{what}: every step reports a loss");
    assert_losses_close(got, want, what);
    let evals = got.steps.iter().filter(|m| m.val_loss.is_some()).count();
    assert_eq!(
        evals,
        steps.div_ceil(2),
        "{what}: evaluated every second step and the last"
    );
    assert_params_close(&got.params, &want.params, what);
}

/// Each tensor within 1e-5 of the reference in relative L2 norm, ‖a − b‖ / ‖b‖. (Element-wise
/// maxima are the wrong yardstick after Adam: an element whose gradient is near zero moves by
/// ±lr on rounding noise alone, which no reordering of sums can avoid.)
pub fn assert_params_close(
    got: &BTreeMap<String, Vec<f32>>,
    want: &BTreeMap<String, Vec<f32>>,
    what: &str,
) {
    assert_tensors_close(got, want, what, |_| 1e-5);
}

/// `‖got − want‖ / ‖want‖` in f64.
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let d: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    let n: f64 = want.iter().map(|b| f64::from(*b).powi(2)).sum();
    (d / n.max(f64::MIN_POSITIVE)).sqrt()
}

/// The same tensors, each within `tol(name)` relative L2 (`tol` below 0: bit-identical);
/// returns the worst relative difference and its tensor, for the record.
pub fn assert_tensors_close<'a>(
    got: &BTreeMap<String, Vec<f32>>,
    want: &'a BTreeMap<String, Vec<f32>>,
    what: &str,
    tol: impl Fn(&str) -> f64,
) -> (f64, &'a str) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: same tensors"
    );
    let mut worst = (0.0, "");
    for (name, w) in want {
        let g = &got[name];
        let tol = tol(name);
        if tol < 0.0 {
            assert!(g == w, "{what}: {name} differs");
            continue;
        }
        let rel = rel_l2(g, w);
        assert!(rel <= tol, "{what}: {name} differs by {rel:e} relative");
        if rel > worst.0 {
            worst = (rel, name.as_str());
        }
    }
    worst
}

/// The same number of steps, each loss (and validation loss, where both have one) within 1e-5
/// relative.
pub fn assert_losses_close(got: &TrainReport, want: &TrainReport, what: &str) {
    assert_eq!(
        got.steps.len(),
        want.steps.len(),
        "{what}: every step reports a loss"
    );
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs();
    for (a, b) in got.steps.iter().zip(&want.steps) {
        assert!(
            close(a.loss, b.loss),
            "{what}: step {} loss {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
        match (a.val_loss, b.val_loss) {
            (Some(x), Some(y)) => {
                assert!(close(x, y), "{what}: step {} val loss {x} vs {y}", a.step)
            }
            (None, None) => {}
            other => panic!("{what}: step {} val loss {other:?}", a.step),
        }
    }
}
