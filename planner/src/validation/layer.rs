//! One transformer layer against Korthikanti et al. 2022 Table 4 (runs.toml
//! `[[layer_benchmark]]`): the cost model's forward and backward time of a 22B layer on 8-way
//! TP, per variant (sequence parallelism, full or selective recompute). A check of the layer
//! model in isolation, below the whole-step comparison. Reads nothing but the text it is given.

use toml::Value;

use super::{load, Run};
use crate::cost::{self, comm::Links};
use crate::layout::Recompute;
use crate::spec::Cluster;

/// One variant of the benchmark: measured and predicted forward and backward, in ms.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerRow {
    pub experiment: String,
    pub measured_fwd_ms: f64,
    pub measured_bwd_ms: f64,
    pub predicted_fwd_ms: f64,
    pub predicted_bwd_ms: f64,
}

/// The run whose model and layout the benchmark uses (Table 3's 22B row).
const RUN: &str = "korthikanti-t5-22B-present";

fn variant(experiment: &str) -> Option<(bool, Recompute)> {
    let sp = experiment.contains("sequence parallel");
    let rc = if experiment.contains("selective") {
        Recompute::Selective
    } else if experiment.contains("full recompute") {
        Recompute::Full
    } else if experiment.contains("no recompute") || experiment == "sequence parallelism" {
        Recompute::None
    } else {
        return None;
    };
    Some((sp, rc))
}

/// The benchmark's rows with the model's predictions; empty if runs.toml lacks them.
pub fn layer_benchmark(runs_toml: &str, a100: &Cluster, h100: &Cluster) -> Vec<LayerRow> {
    let Ok((runs, _)) = load(runs_toml, a100, h100) else {
        return Vec::new();
    };
    let Some(run): Option<&Run> = runs.iter().find(|r| r.id == RUN) else {
        return Vec::new();
    };
    let Ok(doc) = runs_toml.parse::<toml::Table>() else {
        return Vec::new();
    };
    let rows = doc
        .get("layer_benchmark")
        .and_then(Value::as_array)
        .and_then(|b| b.first())
        .and_then(|b| b.get("rows"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let (Some(tp), Some(mb)) = (run.pins.tp, run.pins.micro_batch) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for row in rows {
        let name = row.get("experiment").and_then(Value::as_str).unwrap_or("");
        let ms = |k: &str| row.get(k).and_then(Value::as_float);
        let (Some((sp, recompute)), Some(f), Some(b)) =
            (variant(name), ms("forward_ms"), ms("backward_ms"))
        else {
            continue;
        };
        let layout = crate::layout::Layout {
            dp: 1,
            cp: 1,
            cp_comm: crate::layout::CpComm::P2p,
            ep: 1,
            pp: 1,
            tp,
            micro_batch: mb,
            sharding: crate::layout::Sharding {
                zero_stage: 0,
                hybrid: false,
            },
            recompute,
            recompute_every: 1,
            sequence_parallel: sp,
            schedule: crate::schedule::ScheduleKind::OneFOneB,
            virtual_stages: 1,
            offload: crate::layout::Offload::NONE,
        };
        let links = Links::new(&run.cluster, &layout.mesh(&run.cluster));
        let t = cost::layer_times(
            &run.model,
            &run.cluster,
            &layout,
            &links,
            crate::cost::Options::of(run.profile),
        );
        out.push(LayerRow {
            experiment: name.to_string(),
            measured_fwd_ms: f,
            measured_bwd_ms: b,
            predicted_fwd_ms: 1e3 * t.layer.fwd.total(),
            predicted_bwd_ms: 1e3 * t.layer.bwd.total(),
        });
    }
    out
}
