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
//! - Mixtral-8x7B with expert parallelism on 64 H100s (Megatron-Core's MoE README: TP 1, EP 8,
//!   PP 4 interleaved × 8, micro-batch 1, global batch 256 × 4096 tokens, 468 TFLOP/s per GPU;
//!   docs/moe-figures.md row 3).

use crate::fp8::Recipe;
use crate::layout::{CpComm, Recompute};
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
    /// The published TFLOP/s per GPU, where the source gives it (else NaN).
    pub published_tflops: f64,
    /// The published MFU, where the source gives it (else NaN).
    pub published_mfu: f64,
    pub predicted_step_s: f64,
    pub predicted_mfu: f64,
    /// The published figure's step time: this planner's model FLOPs per step at the published
    /// TFLOP/s (the convention of `predicted_mfu`), or the tokens per step at the published
    /// tokens/s.
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
    /// The model preset: its path (for messages) and text.
    model: (&'static str, &'static str),
    /// The cluster preset, where it is not the H100 one.
    cluster: Option<(&'static str, &'static str)>,
    zero: Option<u8>,
    gpus: u64,
    dp: u64,
    tp: u64,
    pp: u64,
    cp: u64,
    cp_comm: CpComm,
    ep: u64,
    virtual_stages: u64,
    schedule: ScheduleKind,
    /// Pinned layers of the first and last stage.
    ends: Option<u64>,
    micro_batch: Option<u64>,
    recompute: Option<Recompute>,
    /// Sequence length and global batch (sequences), where they differ from the preset's.
    seq_len: u64,
    global_batch: u64,
    open: &'static str,
    published: Published,
}

/// What a source publishes of a run's speed.
#[derive(Debug, Clone, Copy)]
enum Published {
    /// TFLOP/s per GPU and MFU (NaN where not given).
    Tflops(f64, f64),
    /// Tokens per second per GPU.
    TokensPerGpu(f64),
}

const LLAMA405: (&str, &str) = (
    "specs/models/llama3.1-405b.toml",
    include_str!("../../../specs/models/llama3.1-405b.toml"),
);
const DEEPSEEK_V3: (&str, &str) = (
    "specs/models/deepseek-v3.toml",
    include_str!("../../../specs/models/deepseek-v3.toml"),
);
const H800: (&str, &str) = (
    "specs/clusters/h800-deepseek.toml",
    include_str!("../../../specs/clusters/h800-deepseek.toml"),
);
const MIXTRAL: (&str, &str) = (
    "specs/models/mixtral-8x7b.toml",
    include_str!("../../../specs/models/mixtral-8x7b.toml"),
);

/// Llama 3's pipeline (§3.3.2): TP 8 × PP 16, interleaved × 8, end stages 7 layers.
const fn llama(
    feature: &'static str,
    run: &'static str,
    gpus: u64,
    dp: u64,
    cp: (u64, CpComm),
    batch: (u64, u64),
    (tflops, mfu): (f64, f64),
) -> Figure {
    Figure {
        feature,
        run,
        source: LLAMA3_SOURCE,
        model: LLAMA405,
        cluster: None,
        zero: None,
        gpus,
        dp,
        tp: 8,
        pp: 16,
        cp: cp.0,
        cp_comm: cp.1,
        ep: 1,
        virtual_stages: 8,
        schedule: ScheduleKind::Interleaved,
        ends: Some(7),
        micro_batch: None,
        recompute: None,
        seq_len: batch.0,
        global_batch: batch.1,
        open: "micro-batch, ZeRO stage, recompute, SP",
        published: Published::Tflops(tflops, mfu),
    }
}

const LLAMA3_SOURCE: &str = "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4 and §3.3.2";

const FIGURES: [Figure; 5] = [
    llama(
        "uneven interleaved pipeline",
        "llama3.1-405b 8,192 H100 seq 8,192",
        8192,
        64,
        (1, CpComm::P2p),
        (8192, 2048),
        (430.0, 0.43),
    ),
    llama(
        "uneven interleaved pipeline",
        "llama3.1-405b 16,384 H100 seq 8,192",
        16384,
        128,
        (1, CpComm::P2p),
        (8192, 2048),
        (400.0, 0.41),
    ),
    // Table 4's long-context row: 16M tokens per step as 128 sequences of 131,072 tokens
    // (DP 8 × 16 per replica), the sequence split over CP 16 with K and V all-gathered
    // (§3.3.2). The pipeline as at 8k (§3.3.2 describes one pipeline design).
    llama(
        "context parallelism (all-gather)",
        "llama3.1-405b 16,384 H100 seq 131,072",
        16384,
        8,
        (16, CpComm::AllGather),
        (131072, 128),
        (380.0, 0.38),
    ),
    // Megatron-Core's MoE README (NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md,
    // v0.9): "Mixtral 8X7B … 64 … H100 … 468 TFLOPS", TP 1, EP 8, PP 4, VP 8, micro-batch 1,
    // global batch 256, sequence 4096, dropless; no recompute (NVIDIA's Megatron-MoE-ModelZoo
    // config). It states no MFU (468 of 989 is 47%).
    Figure {
        feature: "expert parallelism (MoE)",
        run: "mixtral-8x7b 64 H100 seq 4,096",
        source:
            "Megatron-Core MoE README (NVIDIA/Megatron-LM @ c230e0d), docs/moe-figures.md row 3",
        model: MIXTRAL,
        cluster: None,
        zero: None,
        gpus: 64,
        dp: 16,
        tp: 1,
        pp: 4,
        cp: 1,
        cp_comm: CpComm::P2p,
        ep: 8,
        virtual_stages: 8,
        schedule: ScheduleKind::Interleaved,
        ends: None,
        micro_batch: Some(1),
        recompute: Some(Recompute::None),
        seq_len: 4096,
        global_batch: 256,
        open: "ZeRO stage",
        published: Published::Tflops(468.0, f64::NAN),
    },
    // DeepSeek-V3's pre-training (arXiv 2412.19437, §1: "each trillion tokens requires only
    // 180K H800 GPU hours", 10^12 / (180,000 × 3600) = 1543 tokens/s per GPU; §3.2: PP 16, EP
    // 64 over 8 nodes, ZeRO-1 DP, no TP; §4.2: sequence 4096, the batch raised to 15,360).
    // Not what the planner models: FP8 GEMMs (planned in BF16) and DualPipe, which overlaps
    // the all-to-all with compute (planned as 1F1B, the all-to-all exposed); DP 128 derived.
    Figure {
        feature: "expert parallelism (MoE), FP8 run planned in BF16",
        run: "deepseek-v3 2,048 H800 seq 4,096",
        source: "DeepSeek-V3 report (arXiv 2412.19437) §1, §3.2, §4.2; docs/moe-figures.md row 1",
        model: DEEPSEEK_V3,
        cluster: Some(H800),
        zero: Some(1),
        gpus: 2048,
        dp: 128,
        tp: 1,
        pp: 16,
        cp: 1,
        cp_comm: CpComm::P2p,
        ep: 64,
        virtual_stages: 1,
        schedule: ScheduleKind::OneFOneB,
        ends: None,
        micro_batch: None,
        recompute: None,
        seq_len: 4096,
        global_batch: 15360,
        open: "micro-batch, recompute (the report recomputes RMSNorm, MLA up-projections, SwiGLU)",
        published: Published::TokensPerGpu(1543.2),
    },
];

fn preset(model: (&str, &str)) -> Option<Model> {
    let src = Source::from_text(model.0, model.1);
    spec::parse_model_toml(&src, TrainingOverrides::default()).ok()
}

/// The figures also rescored under DualPipe (issue 41): DeepSeek-V3's, which the report runs
/// with it.
const DUALPIPE_RESCORE: &[&str] = &["deepseek-v3 2,048 H800 seq 4,096"];

/// Every figure replayed on `h100` (the H100 preset); a figure whose layout cannot be built
/// is left out (the test of this module requires all of them). A figure of
/// [`DUALPIPE_RESCORE`] is followed by its DualPipe rescore ([`dualpipe_rescore`]).
pub fn feature_rows(h100: &Cluster) -> Vec<FeatureRow> {
    FIGURES
        .iter()
        .filter_map(|f| {
            let cluster = match f.cluster {
                None => h100.clone(),
                Some((path, text)) => {
                    let src = Source::from_text(path, text);
                    spec::parse_cluster_toml(&src, Default::default()).ok()?
                }
            };
            let model = preset(f.model)?;
            let (row, layout) = replay(f, &model, &cluster)?;
            let rescore: Vec<FeatureRow> = if DUALPIPE_RESCORE.contains(&f.run) {
                [Recipe::None, Recipe::Blockwise]
                    .into_iter()
                    .filter_map(|r| dualpipe_rescore(f, &model, &cluster, &layout, &row, r))
                    .collect()
            } else {
                Vec::new()
            };
            Some(std::iter::once(row).chain(rescore))
        })
        .flatten()
        .collect()
}

/// The figure's replayed layout with DeepSeek's DualPipe in place of 1F1B: two chunks per
/// stage (each stage holds its model stage and the mirror one: twice the parameters), the
/// F&B steps hiding each pass's expert all-to-all under the other's compute. Costed directly
/// (`search::predict_layout`): no framework profile here runs DualPipe, so the search would
/// refuse it; the row is the cost model's answer to "what does DualPipe change", beside the
/// 1F1B row. The micro-batch is the replay's when it gives DualPipe's even count of at least
/// 2 × PP micro-batches, else the largest that does. With `fp8` (DeepSeek-V3 §3.3: 1×128
/// activation tiles, 128×128 weight blocks, so `blockwise`) the block's linears run in FP8 too.
fn dualpipe_rescore(
    f: &Figure,
    model: &Model,
    on: &Cluster,
    replayed: &crate::layout::Layout,
    row: &FeatureRow,
    fp8: Recipe,
) -> Option<FeatureRow> {
    let (mut model, cluster) = figure_job(f, model, on);
    model.training.fp8 = fp8;
    let mut layout = *replayed;
    layout.schedule = ScheduleKind::DualPipe;
    layout.virtual_stages = 2;
    let per_replica = f.global_batch / layout.dp.max(1);
    let fits = |mb: u64| {
        let mut l = layout;
        l.micro_batch = mb;
        l.check(&model, &cluster).is_ok()
    };
    if !fits(layout.micro_batch) {
        layout.micro_batch = (1..=per_replica).rev().find(|&mb| fits(mb))?;
    }
    let options = crate::cost::Options::for_model(&model, &cluster);
    let predict = |l: &crate::layout::Layout| search::predict_layout(&model, &cluster, l, options);
    let (mut assessed, mut p) = predict(&layout);
    if !assessed.fits && layout.recompute != Recompute::Full {
        // Twice the parameters may not fit beside the replay's activations: full recompute
        // (every layer) is what would make room.
        let mut full = layout;
        full.recompute = Recompute::Full;
        full.recompute_every = 1;
        let (a, q) = predict(&full);
        if a.fits {
            (layout, assessed, p) = (full, a, q);
        }
    }
    Some(FeatureRow {
        feature: match fp8 {
            Recipe::None => "DualPipe (issue 41): the first row rescored with schedule dualpipe",
            _ => "DualPipe and FP8 (issue 41): the first row rescored with schedule dualpipe and fp8 blockwise, as the report trained",
        },
        layout: layout.label(),
        stage_layers: layout.stage_layers(&assessed.split),
        open: if assessed.fits {
            "the replayed layout with schedule dualpipe (two chunks per stage, twice the parameters; full recompute where the replay's does not leave room); costed directly, as no framework profile here runs DualPipe"
        } else {
            "the replayed layout with schedule dualpipe (two chunks per stage, twice the parameters), which does not fit in memory even with full recompute; costed directly, as no framework profile here runs DualPipe"
        },
        predicted_step_s: p.step_time_s,
        predicted_mfu: p.mfu,
        ..row.clone()
    })
}

/// The figure's model and cluster: its sequence and batch, its GPU count.
fn figure_job(f: &Figure, model: &Model, on: &Cluster) -> (Model, Cluster) {
    let mut model = model.clone();
    model.training.seq_len = f.seq_len;
    model.training.global_batch = f.global_batch;
    let mut cluster = on.clone();
    cluster.devices = f.gpus;
    cluster.nodes = f.gpus.div_ceil(cluster.gpus_per_node);
    (model, cluster)
}

fn replay(f: &Figure, model: &Model, on: &Cluster) -> Option<(FeatureRow, crate::layout::Layout)> {
    let (model, cluster) = figure_job(f, model, on);
    let model = &model;
    let pins = Pins {
        dp: Some(f.dp),
        cp: Some(f.cp),
        cp_comm: Some(f.cp_comm),
        ep: Some(f.ep),
        pp: Some(f.pp),
        tp: Some(f.tp),
        schedule: Some(f.schedule),
        virtual_stages: Some(f.virtual_stages),
        micro_batch: f.micro_batch,
        recompute: f.recompute,
        zero: f.zero,
        hybrid: Some(false),
        stage_layers: StageLayers {
            first: f.ends,
            last: f.ends,
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
    let stage_layers = best.layout.stage_layers(&best.split);
    let (tflops, mfu, published_step_s) = match f.published {
        Published::Tflops(t, m) => (
            t,
            m,
            p.model_flops_per_step / (t * 1e12 * cluster.devices as f64),
        ),
        Published::TokensPerGpu(x) => (
            f64::NAN,
            f64::NAN,
            (f.global_batch * f.seq_len) as f64 / (x * cluster.devices as f64),
        ),
    };
    let row = FeatureRow {
        feature: f.feature,
        run: f.run,
        source: f.source,
        layout: best.layout.label(),
        stage_layers,
        open: f.open,
        published_tflops: tflops,
        published_mfu: mfu,
        predicted_step_s: p.step_time_s,
        predicted_mfu: p.mfu,
        published_step_s,
    };
    Some((row, best.layout))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{load_cluster, ClusterOverrides};
    use std::path::Path;

    #[test]
    fn every_figure_replays_with_its_published_split() {
        let h100 = load_cluster(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/clusters/dgx-h100-80g.toml"),
            ClusterOverrides::default(),
        )
        .unwrap();
        let rows = feature_rows(&h100);
        assert_eq!(
            rows.len(),
            FIGURES.len() + 2 * DUALPIPE_RESCORE.len(),
            "every figure replays, and the DualPipe rescores (16-bit and FP8) follow theirs"
        );
        for r in rows.iter().filter(|r| r.run.starts_with("mixtral")) {
            // Mixtral's 32 layers on PP 4 × 8 chunks of one layer each.
            assert_eq!(r.stage_layers, vec![8; 4], "{}", r.run);
            assert!(r.layout.contains("·ep8") && r.layout.contains("interleaved×8"));
            assert!(r.predicted_mfu > 0.0 && r.predicted_step_s.is_finite());
        }
        for r in rows.iter().filter(|r| r.run.starts_with("deepseek")) {
            // 61 layers on 16 stages: the even split gives the first three stages 3 layers;
            // under DualPipe every stage also holds its mirror stage's, each layer twice.
            let dual = r.layout.contains("dualpipe");
            let held = if dual { 122 } else { 61 };
            assert_eq!(r.stage_layers.iter().sum::<u64>(), held, "{}", r.layout);
            assert!(r.layout.contains("·ep64") && r.layout.contains("pp16"));
            assert!(r.predicted_step_s.is_finite(), "{}", r.layout);
        }
        assert_eq!(
            rows.iter()
                .filter(|r| r.layout.contains("dualpipe"))
                .count(),
            2
        );
        for r in rows.iter().filter(|r| r.run.starts_with("llama")) {
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
