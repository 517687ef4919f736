//! Features against a published figure outside runs.toml: the layouts that a feature of the
//! planner exists to express, replayed as their source states them and compared with the
//! throughput it publishes. Scored apart from the runs (their sources are single figures, not
//! sweeps, and their constants were never fitted to).
//!
//! - Llama 3.1 405B's own layout (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4 and
//!   §3.3.2): TP 8 × PP 16 on 8,192 and 16,384 H100s at 8,192 tokens, the interleaved schedule
//!   with the first and last stage one layer short, "the first model chunk on the first stage
//!   has only the embedding, and the last model chunk on the last stage has only output
//!   projection and loss calculation": 128 chunks of one layer for 126 layers, so 8 virtual
//!   stages, the end stages pinned to 7 layers.
//! - Llama 3.1 405B at 131,072 tokens (the same Table 4): TP 8 × CP 16 × PP 16 × DP 8, the
//!   sequence split over 16 context-parallel ranks, K and V all-gathered (§3.3.2).

use crate::layout::CpComm;
use crate::model::Model;
use crate::schedule::ScheduleKind;
use crate::search::{self, Pins, SearchOptions, StageLayers};
use crate::source::Source;
use crate::spec::{self, Cluster, TrainingOverrides};

/// One published figure and the planner's prediction of it.
#[derive(Debug, Clone, PartialEq)]
pub struct FeatureRow {
    pub feature: &'static str,
    pub run: &'static str,
    pub source: &'static str,
    /// The replayed layout's label (the search's choice for what the source leaves open).
    pub layout: String,
    /// Layers per stage of the replayed split.
    pub stage_layers: Vec<u64>,
    pub open: &'static str,
    pub published_tflops: f64,
    pub published_mfu: f64,
    pub predicted_step_s: f64,
    pub predicted_mfu: f64,
    /// The published figure's step time: tokens per step at the published TFLOP/s, with this
    /// planner's model FLOPs per step (the convention of `predicted_mfu`).
    pub published_step_s: f64,
}

impl FeatureRow {
    /// Predicted over published step time, minus one.
    pub fn error(&self) -> f64 {
        self.predicted_step_s / self.published_step_s - 1.0
    }
}

/// A published figure to replay: a model preset, the GPUs and the stated pins.
struct Figure {
    feature: &'static str,
    run: &'static str,
    source: &'static str,
    gpus: u64,
    dp: u64,
    cp: u64,
    cp_comm: CpComm,
    /// Sequence length and global batch (sequences), where they differ from the preset's.
    seq_len: u64,
    global_batch: u64,
    open: &'static str,
    tflops: f64,
    mfu: f64,
}

const LLAMA3_SOURCE: &str = "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4 and §3.3.2";

const FIGURES: [Figure; 3] = [
    Figure {
        feature: "uneven interleaved pipeline",
        run: "llama3.1-405b 8,192 H100 seq 8,192",
        source: LLAMA3_SOURCE,
        gpus: 8192,
        dp: 64,
        cp: 1,
        cp_comm: CpComm::P2p,
        seq_len: 8192,
        global_batch: 2048,
        open: "micro-batch, ZeRO stage, recompute, SP",
        tflops: 430.0,
        mfu: 0.43,
    },
    Figure {
        feature: "uneven interleaved pipeline",
        run: "llama3.1-405b 16,384 H100 seq 8,192",
        source: LLAMA3_SOURCE,
        gpus: 16384,
        dp: 128,
        cp: 1,
        cp_comm: CpComm::P2p,
        seq_len: 8192,
        global_batch: 2048,
        open: "micro-batch, ZeRO stage, recompute, SP",
        tflops: 400.0,
        mfu: 0.41,
    },
    // Table 4's long-context row: 16M tokens per step as 128 sequences of 131,072 tokens
    // (DP 8 × 16 per replica), the sequence split over CP 16 with K and V all-gathered
    // (§3.3.2). The pipeline as at 8k (§3.3.2 describes one pipeline design).
    Figure {
        feature: "context parallelism (all-gather)",
        run: "llama3.1-405b 16,384 H100 seq 131,072",
        source: LLAMA3_SOURCE,
        gpus: 16384,
        dp: 8,
        cp: 16,
        cp_comm: CpComm::AllGather,
        seq_len: 131072,
        global_batch: 128,
        open: "micro-batch, ZeRO stage, recompute, SP",
        tflops: 380.0,
        mfu: 0.38,
    },
];

fn llama405() -> Option<Model> {
    let src = Source::from_text(
        "specs/models/llama3.1-405b.toml",
        include_str!("../../../specs/models/llama3.1-405b.toml"),
    );
    spec::parse_model_toml(&src, TrainingOverrides::default()).ok()
}

/// Every figure replayed on `h100` (the H100 preset); a figure whose layout cannot be built
/// is left out (the test of this module requires all of them).
pub fn feature_rows(h100: &Cluster) -> Vec<FeatureRow> {
    let Some(model) = llama405() else {
        return Vec::new();
    };
    FIGURES
        .iter()
        .filter_map(|f| replay(f, &model, h100))
        .collect()
}

fn replay(f: &Figure, model: &Model, h100: &Cluster) -> Option<FeatureRow> {
    let mut model = model.clone();
    model.training.seq_len = f.seq_len;
    model.training.global_batch = f.global_batch;
    let model = &model;
    let mut cluster = h100.clone();
    cluster.devices = f.gpus;
    cluster.nodes = f.gpus.div_ceil(cluster.gpus_per_node);
    let pins = Pins {
        dp: Some(f.dp),
        cp: Some(f.cp),
        cp_comm: Some(f.cp_comm),
        pp: Some(16),
        tp: Some(8),
        schedule: Some(ScheduleKind::Interleaved),
        virtual_stages: Some(8),
        hybrid: Some(false),
        stage_layers: StageLayers {
            first: Some(7),
            last: Some(7),
        },
        ..Pins::default()
    };
    let options = SearchOptions {
        top: 1,
        ..SearchOptions::default()
    };
    let result = search::search_with(model, &cluster, &pins, options);
    let best = result.fits.first()?;
    let p = best.prediction.as_ref()?;
    let (pp, v) = (best.layout.pp as usize, best.layout.virtual_stages as usize);
    let stage_layers = (0..pp)
        .map(|s| (0..v).map(|c| best.split[c * pp + s]).sum())
        .collect();
    let published_step_s = p.model_flops_per_step / (f.tflops * 1e12 * cluster.devices as f64);
    Some(FeatureRow {
        feature: f.feature,
        run: f.run,
        source: f.source,
        layout: best.layout.label(),
        stage_layers,
        open: f.open,
        published_tflops: f.tflops,
        published_mfu: f.mfu,
        predicted_step_s: p.step_time_s,
        predicted_mfu: p.mfu,
        published_step_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{load_cluster, ClusterOverrides};
    use std::path::Path;

    #[test]
    fn llama3_405b_replays_with_its_published_split() {
        let h100 = load_cluster(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/clusters/dgx-h100-80g.toml"),
            ClusterOverrides::default(),
        )
        .unwrap();
        let rows = feature_rows(&h100);
        assert_eq!(rows.len(), FIGURES.len(), "every figure replays");
        for r in &rows {
            // Llama 3's split: the end stages 7 layers, the others 8 (126 layers).
            let mut want = vec![8; 16];
            want[0] = 7;
            want[15] = 7;
            assert_eq!(r.stage_layers, want, "{}", r.run);
            assert!(r.layout.contains("interleaved×8"), "{}", r.layout);
            assert_eq!(
                r.layout.contains("·cp16"),
                r.run.contains("131,072"),
                "{}",
                r.layout
            );
            assert!(r.predicted_mfu > 0.0 && r.predicted_step_s.is_finite());
        }
    }
}
