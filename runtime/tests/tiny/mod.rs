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
use tessera_runtime::exec::{train, TrainOptions, TrainReport};

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

/// Each tensor within 1e-5 of the reference in relative L2 norm, ‖a − b‖ / ‖b‖. (Element-wise
/// maxima are the wrong yardstick after Adam: an element whose gradient is near zero moves by
/// ±lr on rounding noise alone, which no reordering of sums can avoid.)
pub fn assert_params_close(
    got: &BTreeMap<String, Vec<f32>>,
    want: &BTreeMap<String, Vec<f32>>,
    what: &str,
) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: same tensors"
    );
    for (name, w) in want {
        let g = &got[name];
        let diff: f64 = g
            .iter()
            .zip(w)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum::<f64>()
            .sqrt();
        let norm: f64 = w.iter().map(|b| f64::from(*b).powi(2)).sum::<f64>().sqrt();
        assert!(
            diff <= 1e-5 * norm,
            "{what}: {name} differs by {:e} relative",
            diff / norm
        );
    }
}
