//! Replays published training runs through the planner and compares the predicted step time
//! with the measured one (../shared/groundtruth/runs.toml and the README beside it).
//!
//! Each run is pinned to its published configuration. Knobs a source does not state (the
//! micro-batch and the interleaving depth of Megatron's Table 1, for instance) are left to the
//! planner's own search — the fastest layout that fits, with the near-tie rule — one rule for
//! every run; the report lists which knobs each run left open. What a source's framework does
//! that a spec cannot say (its model conventions, whether DP sync overlaps the backward) is set
//! once per source with its citation, never per run. Calibration constants come only from the
//! cluster presets. This module reads no files: callers pass the text of runs.toml and the
//! resolved presets; `report` renders docs/validation.md.

pub mod caveats;
pub mod extra_runs;
pub mod feasibility;
pub mod features;
pub mod fit;
pub mod fp8;
pub mod h100;
pub mod layer;
pub mod offload;
pub mod report;
pub mod resolve;
pub mod resolve_fp8;
pub mod schedules;
pub mod whole_run;

pub use resolve::Presets;

use toml::Value;

use crate::cost::Options;
use crate::framework::{Profile, Reports};
use crate::layout::Layout;
use crate::memory;
use crate::model::Model;
use crate::search::{self, Pins, SearchOptions};
use crate::spec::Cluster;

/// Why the validation could not run at all.
#[derive(Debug, thiserror::Error)]
pub enum ValidationError {
    #[error("runs.toml is not valid TOML: {0}")]
    Toml(String),
    #[error("runs.toml has no [[run]] entries")]
    NoRuns,
}

/// The sources the validation knows, each with its framework's conventions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Family {
    /// Narayanan et al. SC'21 (Megatron-LM).
    Megatron,
    /// Korthikanti et al. 2022 (Megatron-LM with sequence parallelism, selective recompute).
    Korthikanti,
    /// karpathy/llm.c.
    LlmC,
    /// mosaicml/llm-foundry (Composer, PyTorch FSDP).
    Mpt,
}

impl Family {
    fn of(source: &str) -> Option<Family> {
        if source.starts_with("Narayanan") {
            Some(Family::Megatron)
        } else if source.starts_with("Korthikanti") {
            Some(Family::Korthikanti)
        } else if source.starts_with("karpathy/llm.c") {
            Some(Family::LlmC)
        } else if source.starts_with("mosaicml/llm-foundry") {
            Some(Family::Mpt)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Family::Megatron => "Megatron-LM SC'21",
            Family::Korthikanti => "Korthikanti et al. 2022",
            Family::LlmC => "llm.c",
            Family::Mpt => "MosaicML llm-foundry",
        }
    }

    /// What the source's framework does, as the specs and options say it, with the why.
    pub fn conventions(self) -> &'static str {
        match self {
            Family::Megatron | Family::Korthikanti => "GPT as Megatron-LM builds it: GeLU MLP, LayerNorm, learned positions, tied embeddings, biases, dropout 0.1, a materialised softmax (no flash attention in 2021–22), fp32 main gradients (the `megatron` policy), no ZeRO; the DP all-reduce follows the backward (Korthikanti et al. §6.3: \"the gradient all-reduce was not overlapped\")",
            Family::LlmC => "GPT-2 as llm.c trains it: GeLU, LayerNorm, learned positions, tied embeddings, biases, no dropout, cuDNN flash attention, a fused classifier (`fused_classifier`: loss and its gradient in one pass over the logits), bf16 weights and gradients with fp32 master and Adam (`mixed16`), ZeRO-1 as stated; DP sync overlapped with the backward",
            Family::Mpt => "MPT as llm-foundry trains it: GeLU, LayerNorm, learned positions (the source's NumParams grows with the sequence length), tied embeddings, no biases, no dropout, FlashAttention's Triton kernel (the benchmark sweep's `--attn_impl` default `triton`, flash-attn 1.0.3 pinned; 1.83× FlashAttention-2's time: Dao 2023 §4.1 measures it 1.3–1.5× slower in the forward, 2× in the backward), bf16 with fp32 master and Adam (`mixed16`), FSDP FULL_SHARD = ZeRO-3 with prefetch",
        }
    }

    fn megatron_like(self) -> bool {
        matches!(self, Family::Megatron | Family::Korthikanti)
    }

    /// Every source, in the order the report lists them.
    pub const ALL: [Family; 4] = [
        Family::Megatron,
        Family::Korthikanti,
        Family::LlmC,
        Family::Mpt,
    ];
}

/// A published run, resolved into what the planner takes.
#[derive(Debug, Clone)]
pub struct Run {
    pub id: String,
    /// The known source it comes from, if any.
    pub family: Option<Family>,
    /// The source as the report groups it: the family's name, else the run's `source`.
    pub source: String,
    /// The framework profile it is replayed under (stated by the run, else its source's).
    pub profile: &'static Profile,
    pub model: Model,
    pub cluster: Cluster,
    pub pins: Pins,
    /// Knobs the source does not state, which the planner chose.
    pub open: Vec<&'static str>,
    /// Seconds per optimizer step as published (or derived in runs.toml).
    pub measured_step_s: Option<f64>,
    pub measured_tokens_per_s_per_gpu: Option<f64>,
    pub measured_mfu: Option<f64>,
    pub measured_memory_gib: Option<f64>,
    /// Achieved TFLOP/s per GPU as reported (for runs without a step time).
    pub measured_tflops: Option<f64>,
}

/// A run the validation cannot replay, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Skipped {
    pub id: String,
    pub reason: String,
}

/// One replayed run.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: String,
    pub family: Option<Family>,
    pub source: String,
    /// The framework profile's name.
    pub profile: &'static str,
    pub layout: Layout,
    pub open: Vec<&'static str>,
    pub measured_s: f64,
    pub predicted_s: f64,
    /// (predicted − measured) / measured.
    pub error: f64,
    pub measured_tokens: Option<f64>,
    pub predicted_tokens: f64,
    pub measured_mfu: Option<f64>,
    pub predicted_mfu: f64,
    pub measured_memory_gib: Option<f64>,
    /// Predicted peak per GPU, and its tensors alone (without the overhead terms).
    pub predicted_memory_gib: f64,
    pub predicted_tensors_gib: f64,
    /// The prediction of the number the framework reports (`memory.reports` of its profile):
    /// `allocated` → the tensors; `reserved` → the peak less what lies outside PyTorch's
    /// caching allocator (the CUDA context, NCCL's buffers).
    pub predicted_reported_gib: f64,
    /// False when the published layout exceeds device memory in this planner's memory model.
    pub fits: bool,
    /// The device's memory (GiB), which the predicted peak must fit in.
    pub capacity_gib: f64,
    /// How the measured step time was obtained, when runs.toml did not give it.
    pub derived: Option<String>,
}

impl Row {
    /// The layout as a table cell of the report: `dp tp pp mb`, then the knobs it turns on.
    fn layout_cell(&self) -> String {
        let l = &self.layout;
        let mut s = format!("dp{} tp{} pp{} mb{}", l.dp, l.tp, l.pp, l.micro_batch);
        if l.sharding.zero_stage > 0 {
            s += &format!(" zero{}", l.sharding.zero_stage);
        }
        s += &format!(" {}", l.recompute.name());
        if l.sequence_parallel {
            s += " sp";
        }
        if l.pp > 1 {
            s += &format!(" {}", l.schedule.name());
            if l.virtual_stages > 1 {
                s += &format!("×{}", l.virtual_stages);
            }
        }
        s
    }
}

pub(crate) fn get<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, k| v.get(k))
}

pub(crate) fn int(v: &Value, path: &str) -> Option<u64> {
    get(v, path)?
        .as_integer()
        .and_then(|i| u64::try_from(i).ok())
}

pub(crate) fn num(v: &Value, path: &str) -> Option<f64> {
    let x = get(v, path)?;
    x.as_float().or_else(|| x.as_integer().map(|i| i as f64))
}

pub(crate) fn text<'a>(v: &'a Value, path: &str) -> Option<&'a str> {
    get(v, path)?.as_str()
}

/// Resolves every run of runs.toml; `a100` and `h100` are the cluster presets the runs' GPUs
/// map to (their node counts are replaced by each run's).
pub fn load(
    runs_toml: &str,
    a100: &Cluster,
    h100: &Cluster,
) -> Result<(Vec<Run>, Vec<Skipped>), ValidationError> {
    load_with(runs_toml, &Presets::a100_h100(a100, h100))
}

/// Resolves every run of runs.toml against `presets`.
pub fn load_with(
    runs_toml: &str,
    presets: &Presets,
) -> Result<(Vec<Run>, Vec<Skipped>), ValidationError> {
    let doc: Value = runs_toml
        .parse::<toml::Table>()
        .map(Value::Table)
        .map_err(|e| ValidationError::Toml(e.to_string()))?;
    let list = doc
        .get("run")
        .and_then(Value::as_array)
        .ok_or(ValidationError::NoRuns)?;
    let mut runs = Vec::new();
    let mut skipped = Vec::new();
    for r in list {
        let id = text(r, "id").unwrap_or("?").to_string();
        match resolve::resolve(r, presets) {
            Ok(run) => runs.push(run),
            Err(reason) => skipped.push(Skipped { id, reason }),
        }
    }
    Ok((runs, skipped))
}

/// Megatron's Eq. 3 (Narayanan et al. 2021): FLOPs per step with full recompute, which its
/// TFLOP/s figures count; how runs.toml derives Table 1's step times, applied to the runs that
/// give only TFLOP/s.
pub fn megatron_eq3_flops(model: &Model) -> f64 {
    let a = &model.architecture;
    let (b, s, l, h, v) = (
        model.training.global_batch as f64,
        model.training.seq_len as f64,
        a.layers as f64,
        a.hidden as f64,
        a.vocab as f64,
    );
    96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
}

/// Replays one run: the planner's layout under the pins, its prediction, the comparison.
pub fn replay(run: &Run) -> Result<Row, String> {
    let tokens_per_step = (run.model.training.global_batch * run.model.training.seq_len) as f64;
    let per_gpu = run.measured_tokens_per_s_per_gpu;
    let (measured_s, derived) = match (run.measured_step_s, run.measured_tflops) {
        (Some(t), _) => (t, None),
        (None, _) if per_gpu.is_some() => (
            tokens_per_step / (per_gpu.unwrap_or(1.0) * run.cluster.devices as f64),
            Some("from tokens/s".to_string()),
        ),
        (None, Some(x)) if run.family.is_some_and(Family::megatron_like) => (
            megatron_eq3_flops(&run.model) / (run.cluster.devices as f64 * x * 1e12),
            Some(format!(
                "from {x} TFLOP/s per GPU with Eq. 3, as runs.toml derives Table 1"
            )),
        ),
        _ => return Err("no step time, tokens/s or TFLOP/s to compare with".into()),
    };
    let options = SearchOptions {
        top: 1,
        cost: Options::of(run.profile),
    };
    let result = search::search_with(&run.model, &run.cluster, &run.pins, options);
    let (layout, fits) = match (result.fits.first(), &result.closest_miss) {
        (Some(c), _) => (c.layout, true),
        (None, Some(m)) => (m.layout, false),
        (None, None) => {
            let why: Vec<String> = result
                .rejected
                .values()
                .map(|g| g.example.clone())
                .collect();
            return Err(format!(
                "the published layout cannot be built: {}",
                why.join("; ")
            ));
        }
    };
    let (assessed, p) =
        search::predict_layout(&run.model, &run.cluster, &layout, Options::of(run.profile));
    let mem = memory::estimate_split(&run.model, &run.cluster, &layout, &assessed.split);
    let peak = &mem.per_stage[mem.peak_stage as usize];
    let tensors: u64 = peak
        .terms
        .iter()
        .filter(|t| t.kind != "overhead")
        .map(|t| t.bytes)
        .sum();
    let outside_allocator: u64 = peak
        .terms
        .iter()
        .filter(|t| {
            t.kind == "overhead" && matches!(t.name.as_str(), "cuda_context" | "nccl_buffers")
        })
        .map(|t| t.bytes)
        .sum();
    let reported = match run.profile.memory.reports {
        Reports::Allocated => tensors,
        Reports::Reserved => mem.peak_bytes.saturating_sub(outside_allocator),
    };
    let gib = crate::spec::GIB;
    Ok(Row {
        id: run.id.clone(),
        family: run.family,
        source: run.source.clone(),
        profile: &run.profile.name,
        layout,
        open: run.open.clone(),
        measured_s,
        predicted_s: p.step_time_s,
        error: p.step_time_s / measured_s - 1.0,
        measured_tokens: run.measured_tokens_per_s_per_gpu,
        predicted_tokens: p.tokens_per_s_per_device,
        measured_mfu: run.measured_mfu,
        predicted_mfu: p.mfu,
        measured_memory_gib: run.measured_memory_gib,
        predicted_memory_gib: mem.peak_bytes as f64 / gib,
        predicted_tensors_gib: tensors as f64 / gib,
        predicted_reported_gib: reported as f64 / gib,
        fits,
        capacity_gib: run.cluster.device.memory_gib,
        derived,
    })
}

/// Median of absolute errors (0 for none).
pub fn median_abs(errors: &[f64]) -> f64 {
    let mut a: Vec<f64> = errors.iter().map(|e| e.abs()).collect();
    if a.is_empty() {
        return 0.0;
    }
    a.sort_by(f64::total_cmp);
    let n = a.len();
    if n % 2 == 1 {
        a[n / 2]
    } else {
        0.5 * (a[n / 2 - 1] + a[n / 2])
    }
}

/// The whole validation: runs with a published step time or tokens/s are the scored set;
/// runs with only TFLOP/s are replayed too and reported apart (not scored).
#[derive(Debug, Clone)]
pub struct Validation {
    pub scored: Vec<Row>,
    pub unscored: Vec<Row>,
    pub skipped: Vec<Skipped>,
    /// Leave one source out: per source, the A100 constants fitted on the others, scored on it
    /// (filled by [`document`]).
    pub loso: Vec<fit::HeldOut>,
    /// Features against a published figure outside runs.toml (filled by [`document`]).
    pub features: Vec<features::FeatureRow>,
}

impl Validation {
    /// Every held-out run's error, pooled over the sources: (median |error|, worst signed
    /// error and its run).
    pub fn loso_summary(&self) -> Option<(f64, (String, f64))> {
        let all: Vec<&(String, f64)> = self.loso.iter().flat_map(|h| &h.errors).collect();
        let worst = all.iter().max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))?;
        let errs: Vec<f64> = all.iter().map(|(_, e)| *e).collect();
        Some((median_abs(&errs), (*worst).clone()))
    }

    pub fn median_abs_error(&self) -> f64 {
        median_abs(&self.scored.iter().map(|r| r.error).collect::<Vec<_>>())
    }

    pub fn worst(&self) -> Option<&Row> {
        self.scored
            .iter()
            .max_by(|a, b| a.error.abs().total_cmp(&b.error.abs()))
    }
}

impl Run {
    /// Whether the source publishes (or derives) its step time or tokens/s: such a run is
    /// scored and fitted.
    pub fn has_time(&self) -> bool {
        self.measured_step_s.is_some() || self.measured_tokens_per_s_per_gpu.is_some()
    }
}

/// The runs with a published (or derived) step time or tokens/s: the ones scored and fitted.
pub fn scored_runs(
    runs_toml: &str,
    a100: &Cluster,
    h100: &Cluster,
) -> Result<Vec<Run>, ValidationError> {
    let (runs, _) = load(runs_toml, a100, h100)?;
    Ok(runs.into_iter().filter(Run::has_time).collect())
}

/// Loads and replays every run.
pub fn run_all(
    runs_toml: &str,
    a100: &Cluster,
    h100: &Cluster,
) -> Result<Validation, ValidationError> {
    let (runs, skipped) = load(runs_toml, a100, h100)?;
    Ok(replay_all(&runs, skipped))
}

/// Replays `runs`; the ones that cannot be replayed join `skipped`.
fn replay_all(runs: &[Run], mut skipped: Vec<Skipped>) -> Validation {
    let (mut scored, mut unscored) = (Vec::new(), Vec::new());
    for run in runs {
        match replay(run) {
            Ok(row) if run.has_time() => scored.push(row),
            Ok(row) => unscored.push(row),
            Err(reason) => skipped.push(Skipped {
                id: run.id.clone(),
                reason,
            }),
        }
    }
    Validation {
        scored,
        unscored,
        skipped,
        loso: Vec::new(),
        features: Vec::new(),
    }
}

/// The source groups of `labels` in report order: the known families first (in
/// [`Family::ALL`]'s order), then other sources as they first appear.
pub fn sources<'a>(labels: impl Iterator<Item = &'a str> + Clone) -> Vec<String> {
    let mut out: Vec<String> = Family::ALL
        .iter()
        .map(|f| f.name().to_string())
        .filter(|n| labels.clone().any(|l| l == n))
        .collect();
    for l in labels {
        if !out.iter().any(|o| o == l) {
            out.push(l.to_string());
        }
    }
    out
}

/// How docs/validation.md is regenerated.
pub const COMMAND: &str = "cargo run --release -- validate-planner";

/// The validation and its Markdown document (docs/validation.md).
pub fn document(
    runs_toml: &str,
    a100: &Cluster,
    h100: &Cluster,
) -> Result<(Validation, String), ValidationError> {
    document_with(runs_toml, &Presets::a100_h100(a100, h100))
}

/// [`document`] with further GPU and model presets (the CLI passes specs/clusters/ and
/// specs/models/).
pub fn document_with(
    runs_toml: &str,
    presets: &Presets,
) -> Result<(Validation, String), ValidationError> {
    let (a100, h100) = (presets.a100, presets.h100);
    let (runs, skipped) = load_with(runs_toml, presets)?;
    let mut v = replay_all(&runs, skipped);
    let scored: Vec<Run> = runs.into_iter().filter(Run::has_time).collect();
    v.loso = fit::leave_one_source_out(&scored, &fit::kernel_start(&a100.calibration));
    v.features = features::feature_rows(h100);
    let layer = layer::layer_benchmark(runs_toml, a100, h100);
    let md = report::markdown(&v, &layer, &[a100, h100], COMMAND);
    Ok((v, md))
}

#[cfg(test)]
mod tests;
