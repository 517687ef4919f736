//! plan.json: the versioned document that carries a plan from the planner to the runtime.
//!
//! The plan is a program: everything the runtime needs is in it or derived from it by shared
//! code (mesh, stage layer ranges, the schedule's op lists). The format string is
//! `tessera.plan/v1`; keys are a contract (docs/plan.md), added to but never renamed. The
//! committed JSON Schema (docs/plan.schema.json) is generated from these types.

mod check;
pub mod diff;
mod timeline;

use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::cost::comm::Links;
use crate::cost::pipeline::Simulator;
use crate::cost::{self, Options, Prediction, TimeTerm, FLOP_CONVENTION};
use crate::error::Diagnostic;
use crate::layout::{Layout, Recompute, Sharding};
use crate::memory::{self, MemoryReport};
use crate::mesh::MESH_ORDER;
use crate::model::Model;
use crate::schedule::ScheduleKind;
use crate::source::Source;
use crate::spec::Cluster;
use crate::validation::caveats::{caveats, Caveat};

/// The format identifier of this version of plan.json.
pub const FORMAT: &str = "tessera.plan/v1";

/// A plan, as written to plan.json.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Always `tessera.plan/v1` for this version.
    pub format: String,
    /// The tool that wrote the plan.
    pub generator: String,
    /// False when the layout does not fit and was written with `--force`.
    pub feasible: bool,
    pub job: Job,
    pub parallel: Parallel,
    pub stages: Vec<Stage>,
    pub predicted: Predicted,
    pub search: SearchSummary,
}

/// The resolved job the plan was made for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Job {
    pub model: Model,
    pub cluster: Cluster,
    /// The model's exact parameter count (tied weights once).
    pub parameters: u64,
}

/// Parallel degrees and knobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Parallel {
    pub world: u64,
    pub dp: u64,
    pub tp: u64,
    pub pp: u64,
    /// Context-parallel degree: each sequence is cut into 2·CP chunks, CP rank i holding
    /// chunks i and 2·CP−1−i (Megatron-Core's ring attention). Absent means 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub cp: u64,
    /// How CP exchanges keys and values: `p2p` (ring attention) or `all_gather` (Llama 3's).
    /// Absent means `p2p`.
    #[serde(default, skip_serializing_if = "is_p2p")]
    pub cp_comm: crate::layout::CpComm,
    /// Expert-parallel degree of an MoE model: each MoE layer's routed experts are split over
    /// EP ranks taken from the DP × CP ranks (expert-data-parallel group DP × CP / EP, as
    /// Megatron-Core's `--expert-model-parallel-size` forms it). Absent means 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub ep: u64,
    /// Rank order, fastest-varying first: `tp-dp-pp`, i.e. rank = tp + TP·(dp + DP·pp), or
    /// with context parallelism `tp-cp-dp-pp`, rank = tp + TP·(cp + CP·(dp + DP·pp)).
    pub mesh_order: String,
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Micro-batches per optimizer step per DP replica.
    pub microbatches: u64,
    pub zero_stage: u8,
    pub hybrid_shard: bool,
    pub recompute: Recompute,
    /// With full recompute, every N-th layer is recomputed (1: every layer). Absent means 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub recompute_every: u64,
    pub sequence_parallel: bool,
    pub schedule: ScheduleKind,
    pub virtual_stages: u64,
    /// The vocabulary as the embedding table and output layer hold it under this TP. Absent in
    /// plans written before it existed (they hold the model's vocabulary unpadded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab: Option<VocabPadding>,
    /// Model states kept off the device: `none`, `optimizer` (fp32 master weights, Adam
    /// moments and the step on the host) or `params` (the sharded weights too). Absent (plans
    /// written before offload existed, and plans without it): `none`.
    #[serde(default, skip_serializing_if = "is_default")]
    pub offload: crate::layout::OffloadStates,
    /// Where offloaded states live: `cpu` (pinned host memory) or `nvme`. Absent: `cpu`.
    #[serde(default, skip_serializing_if = "is_default")]
    pub offload_to: crate::layout::OffloadTier,
    /// Saved activations go to host memory in the forward and come back for the backward.
    /// Absent: false.
    #[serde(default, skip_serializing_if = "is_default")]
    pub offload_activations: bool,
}

fn is_default<T: Default + PartialEq>(x: &T) -> bool {
    *x == T::default()
}

fn one() -> u64 {
    1
}

fn is_one(x: &u64) -> bool {
    *x == 1
}

fn is_p2p(x: &crate::layout::CpComm) -> bool {
    *x == crate::layout::CpComm::P2p
}

/// The padded vocabulary of a plan, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VocabPadding {
    /// The model's vocabulary (`architecture.vocab`).
    pub model: u64,
    /// Rows of the embedding table and output layer: `model` rounded up to `multiple`.
    pub padded: u64,
    /// `architecture.vocab_divisible_by × tp`.
    pub multiple: u64,
    pub reason: String,
}

impl VocabPadding {
    /// The vocabulary as `profile` holds it under TP `tp`: padded to
    /// `make_vocab_size_divisible_by × TP` where it pads (`runs.pad_vocab`), else as it is,
    /// split into TP shards ([`crate::model::Architecture::vocab_rows`]).
    pub fn of(model: &Model, tp: u64, profile: &crate::framework::Profile) -> VocabPadding {
        let a = &model.architecture;
        let name = &profile.name;
        if !profile.runs.pad_vocab {
            let padded = a.vocab_rows(tp, false);
            let rows = padded / tp.max(1);
            let split = if tp > 1 {
                format!(", split over TP {tp} into shards of at most {rows} rows")
            } else {
                String::new()
            };
            let element = crate::memory::stored::element_bytes(model) as u64;
            let align = if crate::cost::loss::aligned(rows, element) {
                String::new()
            } else {
                format!(
                    "; {rows} rows × {element} B is not a multiple of {} B, so the output layer's GEMMs run unaligned (charged {:.2} of the aligned rate on GPUs)",
                    crate::cost::loss::ALIGN_BYTES,
                    crate::cost::loss::UNALIGNED_GEMM_EFFICIENCY
                )
            };
            return VocabPadding {
                model: a.vocab,
                padded,
                multiple: tp.max(1),
                reason: format!(
                    "the {name} profile does not pad the vocabulary: vocab {} used as it is{split}{align}",
                    a.vocab
                ),
            };
        }
        let padded = a.padded_vocab(tp);
        let multiple = a.vocab_multiple(tp);
        let reason = if padded == a.vocab {
            format!(
                "the {name} profile pads the vocabulary: vocab {} is already a multiple of {} (make_vocab_size_divisible_by {} × TP {tp})",
                a.vocab, multiple, a.vocab_divisible_by
            )
        } else {
            format!(
                "the {name} profile pads the vocabulary: vocab {} padded to {padded}, a multiple of {multiple} (make_vocab_size_divisible_by {} × TP {tp}, as Megatron-LM pads it): every TP rank holds {} rows; the {} padding rows are allocated and multiplied but never a target",
                a.vocab,
                a.vocab_divisible_by,
                padded / tp.max(1),
                padded - a.vocab
            )
        };
        VocabPadding {
            model: a.vocab,
            padded,
            multiple,
            reason,
        }
    }
}

/// One pipeline stage and the model chunks it holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    pub stage: u64,
    pub chunks: Vec<Chunk>,
}

/// A contiguous range of layers run as one virtual pipeline stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Chunk {
    pub chunk: u64,
    /// The contiguous layer piece it holds, in model order: chunk · PP + stage, except under
    /// zb-v (chunk 1 holds piece 2·PP − 1 − stage) and dualpipe (chunk 1 holds piece
    /// PP − 1 − stage of the PP pieces).
    pub virtual_stage: u64,
    /// First layer (inclusive) and end layer (exclusive).
    pub layers: [u64; 2],
    /// Holds the token (and position) embedding.
    pub embedding: bool,
    /// Holds the final norm, output layer and loss.
    pub head: bool,
}

/// What the planner predicts for this plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Predicted {
    pub memory: MemoryReport,
    /// Seconds per optimizer step: the simulated pipeline makespan plus the exposed DP sync
    /// and the optimizer step. Other tools read this key.
    pub step_time_s: f64,
    /// The step time's named terms (compute, recompute, tp_comm, pipeline_bubble, dp_exposed,
    /// optimizer), which sum to `step_time_s`.
    pub breakdown: Vec<TimeTerm>,
    /// Tokens per second of the whole job: global_batch · seq_len / step_time_s.
    pub tokens_per_s: f64,
    pub tokens_per_s_per_device: f64,
    /// Model FLOPs utilisation, under `flop_convention`.
    pub mfu: f64,
    pub model_flops_per_step: f64,
    pub flop_convention: String,
    /// The pipeline stage whose busy time the breakdown describes.
    pub bottleneck_stage: u64,
    /// Where this prediction leaves the ground the validation covers (stable `id`s:
    /// `zero3_at_scale`, `uncalibrated_cluster`); empty when none applies. Absent in plans
    /// written before it existed.
    #[serde(default)]
    pub caveats: Vec<Caveat>,
    /// The checkpoint cadence, where the cluster states `[reliability]` and `[storage]`
    /// (`crate::whole_run`). Absent in plans written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<crate::whole_run::Cadence>,
    /// The whole run to `training.tokens`, where the job states a budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub whole_run: Option<crate::whole_run::WholeRun>,
    /// What FP8 changes for this layout (the job's recipe, or tensorwise as the example), where
    /// the device has an FP8 peak (`crate::fp8::report`). Absent in plans written before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<crate::fp8::report::Fp8Change>,
    /// What overlapping the TP collectives with their GEMMs changes for this layout, where it
    /// can apply (`crate::cost::tp_overlap::change`). Absent in plans written before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_overlap: Option<crate::cost::tp_overlap::TpOverlapChange>,
}

impl Predicted {
    /// What the planner predicts for `layout` with `split` (layers per virtual stage): the
    /// memory of every stage and the simulated step. A plan's `predicted` section is exactly
    /// this; `Plan::load` recomputes it and refuses a plan whose stored copy differs.
    pub fn derive(model: &Model, cluster: &Cluster, layout: &Layout, split: &[u64]) -> Predicted {
        let memory = memory::estimate_split(model, cluster, layout, split);
        let p = predict(model, cluster, layout, split);
        let caveats = caveats(cluster, layout, memory.peak_bytes, memory.capacity_bytes);
        let checkpoint = crate::whole_run::cadence(model, cluster, layout, &memory, p.step_time_s);
        let whole_run =
            crate::whole_run::whole_run(model, cluster, p.step_time_s, checkpoint.as_ref());
        let fp8 = crate::fp8::report::change(
            model,
            cluster,
            layout,
            (p.step_time_s, memory.peak_bytes),
            &|m| {
                (
                    predict(m, cluster, layout, split).step_time_s,
                    memory::peak_bytes_split(m, cluster, layout, split),
                )
            },
        );
        let tp_overlap =
            crate::cost::tp_overlap::change(model, cluster, layout, p.step_time_s, &|m| {
                predict(m, cluster, layout, split).step_time_s
            });
        Predicted {
            checkpoint,
            whole_run,
            fp8,
            tp_overlap,
            ..Predicted::new(memory, &p, caveats)
        }
    }

    fn new(memory: MemoryReport, p: &Prediction, caveats: Vec<Caveat>) -> Predicted {
        Predicted {
            checkpoint: None,
            whole_run: None,
            fp8: None,
            tp_overlap: None,
            memory,
            step_time_s: p.step_time_s,
            breakdown: p.breakdown.clone(),
            tokens_per_s: p.tokens_per_s,
            tokens_per_s_per_device: p.tokens_per_s_per_device,
            mfu: p.mfu,
            model_flops_per_step: p.model_flops_per_step,
            flop_convention: FLOP_CONVENTION.to_string(),
            bottleneck_stage: p.bottleneck_stage,
            caveats,
        }
    }
}

/// The simulated step of `layout` with `split`.
fn predict(model: &Model, cluster: &Cluster, layout: &Layout, split: &[u64]) -> Prediction {
    let options = Options::for_model(model, cluster);
    let links = Links::new(cluster, &layout.mesh(cluster));
    let times = cost::layer_times(model, cluster, layout, &links, options);
    let e = cost::evaluate(model, cluster, layout, split, &links, &times, options);
    e.predict(&Simulator::new().run(&e.pipeline))
}

/// How the layout was chosen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SearchSummary {
    /// The ranking rule used.
    pub ordering: String,
    /// Layouts evaluated against memory.
    pub evaluated: u64,
    /// Layouts that fit.
    pub fitting: u64,
    /// The next-ranked layouts that fit.
    pub alternatives: Vec<Alternative>,
}

impl SearchSummary {
    /// The summary of a plan made for one given layout, without a search (tests, benches).
    pub fn pinned() -> SearchSummary {
        SearchSummary {
            ordering: "pinned".into(),
            evaluated: 1,
            fitting: 1,
            alternatives: vec![],
        }
    }
}

/// A ranked alternative layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Alternative {
    pub rank: u64,
    pub layout: String,
    pub peak_bytes: u64,
    /// Predicted seconds per optimizer step.
    pub step_time_s: f64,
    pub tokens_per_s: f64,
    pub mfu: f64,
    pub breakdown: Vec<TimeTerm>,
    /// Why it ranks where it does: "chosen" for rank 1, else what it lost on.
    pub why: String,
}

impl Parallel {
    pub fn from_layout(l: &Layout, model: &Model, profile: &crate::framework::Profile) -> Parallel {
        Parallel {
            world: l.dp * l.cp * l.pp * l.tp,
            dp: l.dp,
            tp: l.tp,
            pp: l.pp,
            cp: l.cp,
            cp_comm: l.cp_comm,
            ep: l.ep,
            mesh_order: if l.cp > 1 {
                crate::mesh::MESH_ORDER_CP.to_string()
            } else {
                MESH_ORDER.to_string()
            },
            micro_batch: l.micro_batch,
            microbatches: l.microbatches(model),
            zero_stage: l.sharding.zero_stage,
            hybrid_shard: l.sharding.hybrid,
            recompute: l.recompute,
            recompute_every: l.recompute_every,
            sequence_parallel: l.sequence_parallel,
            schedule: l.schedule,
            virtual_stages: l.virtual_stages,
            vocab: Some(VocabPadding::of(model, l.tp, profile)),
            offload: l.offload.states,
            offload_to: l.offload.to,
            offload_activations: l.offload.activations,
        }
    }

    pub fn layout(&self) -> Layout {
        Layout {
            dp: self.dp,
            pp: self.pp,
            tp: self.tp,
            cp: self.cp,
            cp_comm: self.cp_comm,
            ep: self.ep,
            micro_batch: self.micro_batch,
            sharding: Sharding {
                zero_stage: self.zero_stage,
                hybrid: self.hybrid_shard,
            },
            recompute: self.recompute,
            recompute_every: self.recompute_every,
            sequence_parallel: self.sequence_parallel,
            schedule: self.schedule,
            virtual_stages: self.virtual_stages,
            offload: crate::layout::Offload {
                states: self.offload,
                to: self.offload_to,
                activations: self.offload_activations,
            },
        }
    }
}

/// The stages and chunks of a layout, with layer ranges, for the layout's even split.
pub fn stages(layout: &Layout, layers: u64) -> Vec<Stage> {
    stages_for_split(layout, &layout.split_layers(layers))
}

/// The stages and chunks of a layout for a split (layers per piece, model order): chunk `c`
/// of stage `s` holds piece [`Layout::piece`].
pub fn stages_for_split(layout: &Layout, split: &[u64]) -> Vec<Stage> {
    let starts = crate::partition::chunk_starts(split);
    let last = layout.pieces().unwrap_or(0).saturating_sub(1);
    (0..layout.pp)
        .map(|stage| Stage {
            stage,
            chunks: (0..layout.virtual_stages)
                .map(|chunk| {
                    let vs = layout.piece(stage as usize, chunk as usize) as u64;
                    let start = starts[vs as usize];
                    Chunk {
                        chunk,
                        virtual_stage: vs,
                        layers: [start, start + split[vs as usize]],
                        embedding: vs == 0,
                        head: vs == last,
                    }
                })
                .collect(),
        })
        .collect()
}

impl Plan {
    /// Builds the plan document of a layout: the balanced split of its layers (the search's),
    /// its memory and its predicted step time under the model's framework profile.
    pub fn new(model: &Model, cluster: &Cluster, layout: &Layout, search: SearchSummary) -> Plan {
        let device_model = crate::precision::for_device(model, cluster);
        let links = Links::new(cluster, &layout.mesh(cluster));
        let split = crate::search::assess(
            &device_model,
            cluster,
            layout,
            &links,
            Options::for_model(model, cluster),
        )
        .split;
        Plan::with_split(model, cluster, layout, &split, search)
    }

    /// [`Plan::new`] with the split (layers per virtual stage) the search already chose for
    /// the layout (`Candidate::split`, which honours pinned end stages), costed and simulated
    /// once by `derive`.
    pub fn with_split(
        model: &Model,
        cluster: &Cluster,
        layout: &Layout,
        split: &[u64],
        search: SearchSummary,
    ) -> Plan {
        let model = &*crate::precision::for_device(model, cluster);
        let predicted = Predicted::derive(model, cluster, layout, split);
        Plan {
            format: FORMAT.to_string(),
            generator: format!("tessera {}", env!("CARGO_PKG_VERSION")),
            feasible: predicted.memory.fits(),
            job: Job {
                model: model.clone(),
                cluster: cluster.clone(),
                parameters: model.architecture.param_count(),
            },
            parallel: Parallel::from_layout(layout, model, crate::framework::of(model, cluster)),
            stages: stages_for_split(layout, split),
            predicted,
            search,
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a plan always serialises") + "\n"
    }

    /// Reads and checks a plan file: format version, structure, and internal consistency.
    pub fn load(path: &Path) -> Result<Plan, Diagnostic> {
        let src = Source::read(path)?;
        Plan::parse(&src)
    }

    pub fn parse(src: &Source) -> Result<Plan, Diagnostic> {
        let path = &src.path;
        let value: serde_json::Value = serde_json::from_str(&src.text).map_err(|e| {
            Diagnostic::new(
                path,
                "-",
                format!("not valid JSON (a damaged or truncated plan?): {e}"),
                "re-create it with `tessera plan … -o plan.json`",
            )
            .at(Some((e.line(), e.column())))
        })?;
        match value.get("format").and_then(|f| f.as_str()) {
            Some(FORMAT) => {}
            Some(other) => {
                return Err(Diagnostic::new(
                    path,
                    "format",
                    format!("this plan is format \"{other}\"; this tessera reads \"{FORMAT}\""),
                    "re-create the plan with this version of `tessera plan`",
                )
                .at(src.json_key("format")))
            }
            None => {
                return Err(Diagnostic::new(
                    path,
                    "format",
                    format!(
                        "no \"format\" key: this is not a tessera plan (expected \"{FORMAT}\")"
                    ),
                    "pass a plan.json written by `tessera plan -o`",
                ))
            }
        }
        let plan: Plan = serde_json::from_str(&src.text).map_err(|e| {
            Diagnostic::new(path, "-", format!("the plan does not match {FORMAT}: {e}"), "re-create it with `tessera plan … -o plan.json` (docs/plan.schema.json describes the format)")
                .at(Some((e.line(), e.column())))
        })?;
        plan.check(src)?;
        Ok(plan)
    }
}
