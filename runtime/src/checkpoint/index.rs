//! `index.json`: what a checkpoint holds and where (format `tessera.checkpoint/v1`).
//!
//! Keys are added to, never renamed or removed within `v1`; a reader refuses any other format.

use std::path::Path;

use serde::{Deserialize, Serialize};
use tessera_planner::finetune::Lora;
use tessera_planner::model::Architecture;
use tessera_planner::plan::{Parallel, Plan, Stage};

use super::{CheckpointError, Kind, SliceMeta};
use crate::data::Tokens;

/// The whole index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Index {
    /// Always [`FORMAT`].
    pub format: String,
    /// The tool and version that wrote it.
    pub generator: String,
    /// Optimizer steps completed: a resumed run starts at this (0-based) step.
    pub step: usize,
    /// The model: a load refuses a plan whose architecture differs.
    pub model: Architecture,
    pub training: TrainingShape,
    /// The layout that wrote the checkpoint (world, dp, tp, pp, zero stage, virtual stages,
    /// micro-batch, micro-batches, …) and its stages' chunks and layer ranges.
    pub parallel: Parallel,
    pub stages: Vec<Stage>,
    pub data: DataPosition,
    pub rng: RngState,
    pub lr: LrPosition,
    pub optimizer: OptimizerState,
    /// Element type of every stored tensor (`F32`).
    pub dtype: String,
    /// One per rank of the writing plan, in rank order.
    pub shards: Vec<ShardFile>,
    /// The run lineage that wrote it: a fresh run draws one, a resumed run keeps its
    /// checkpoint's. `--keep` prunes only its own lineage's checkpoints. Absent in checkpoints
    /// written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lineage: Option<String>,
    /// The LoRA adapters the run trained on a frozen base (`job.model.lora` of an adapter
    /// plan): the shards hold the base's weights (zero moments) and the adapters'. Absent for
    /// full training.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<Lora>,
    /// QLoRA: the frozen base's block linears are stored in NF4 (`W.nf4_codes` and its
    /// `QuantState` tensors, `exec::nf4`), not as f32 weights. Absent (false) otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub nf4_base: bool,
}

/// Whether `plan` stores its base in NF4 (QLoRA).
pub fn plan_nf4_base(plan: &Plan) -> bool {
    plan.job.model.training.method == tessera_planner::finetune::Method::Qlora
}

/// The adapters `plan` trains, if any.
pub fn plan_lora(plan: &Plan) -> Option<Lora> {
    let m = &plan.job.model;
    m.adapters().cloned()
}

/// The training settings the data order depends on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingShape {
    pub seq_len: u64,
    pub global_batch: u64,
}

/// Where the data sampler stands. The sampler is counter-based (`data::Sampler`): step `t`'s
/// batch depends only on (seed, t, corpus), so the position is the next step and the corpus.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataPosition {
    pub next_step: usize,
    pub sampler_seed: u64,
    /// The corpus: where it was read from, its token count and an FNV-1a fingerprint of its
    /// tokens (hex), which a resumed run's corpus must match.
    pub source: String,
    pub tokens: u64,
    pub fingerprint: String,
    /// The tokenizer that made the corpus's tokens, where known (`Tokens::tokenizer`):
    /// `tessera sample` decodes with it. Absent in older checkpoints and for token files
    /// without a `tessera-data.json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<crate::data::TokenizerRef>,
}

/// The random-number state: the runtime's generators are stateless hashes of (seed, stream,
/// index) (`rng.rs`), so their whole state is their seed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RngState {
    pub generator: String,
    /// Seed of the weights' initialisation (by global element index).
    pub init_seed: u64,
    /// Seed of the data sampler.
    pub sampler_seed: u64,
}

/// The learning-rate schedule (`optim::LrSchedule`) and where it stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LrPosition {
    pub schedule: String,
    pub max_lr: f32,
    pub min_lr: f32,
    pub warmup_steps: usize,
    pub total_steps: usize,
    /// The decay after the warm-up: `cosine`, `linear`, `constant` or `wsd` (a plan's
    /// `schedule.decay`); checkpoints written before it existed decayed by cosine.
    #[serde(default = "cosine")]
    pub decay: String,
    /// With `wsd`: the final steps (before `total_steps`) over which the rate decays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wsd_decay_steps: Option<usize>,
    pub next_step: usize,
    /// The rate the next step uses under this schedule.
    pub next_lr: f32,
}

fn cosine() -> String {
    "cosine".into()
}

fn matrices() -> String {
    "matrices".into()
}

/// The optimizer and its settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerState {
    pub kind: String,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// The tensors weight decay applies to: `matrices`, `all` or `none` (a plan's
    /// `optimizer.decay_on`); checkpoints written before it existed decayed matrices.
    #[serde(default = "matrices")]
    pub decay_on: String,
    /// Global gradient-norm clip (0 for none).
    pub clip: f64,
    /// Updates done (Adam's bias-correction step `t`).
    pub updates: u64,
    /// What the `param` tensors are.
    pub weights: String,
}

/// One rank's shard file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardFile {
    pub file: String,
    pub rank: usize,
    pub dp: u64,
    pub tp: u64,
    pub pp: u64,
    /// The file's length in bytes (a shorter file is truncated).
    pub bytes: u64,
    /// The file's SHA-256, lowercase hex: a file whose bytes changed after the save is refused.
    pub sha256: String,
    /// The flat-buffer ranges `[start, end)` of the rank's optimizer state (its ZeRO shards,
    /// or the whole buffer).
    pub optimizer_ranges: Vec<[usize; 2]>,
    pub tensors: Vec<TensorEntry>,
}

/// One tensor of a shard file: a slice of a global tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// The name in the shard file: `{kind}/{name}`.
    pub key: String,
    /// `param`, `exp_avg` or `exp_avg_sq`.
    pub kind: String,
    /// The global tensor's name (the same under every layout, e.g. `h.3.attn.wq`).
    pub name: String,
    pub global_shape: Vec<usize>,
    /// The TP box this slice lies in: its first element's global coordinates, and its shape.
    pub offsets: Vec<usize>,
    pub shape: Vec<usize>,
    /// The row-major element range `[start, end)` of the box that the slice holds.
    pub elements: [usize; 2],
    /// The shape stored in the file: the box's when the slice is the whole box, else flat.
    pub stored_shape: Vec<usize>,
}

impl TensorEntry {
    pub fn new(kind: Kind, m: &SliceMeta) -> TensorEntry {
        TensorEntry {
            key: format!("{}/{}", kind.as_str(), m.name),
            kind: kind.as_str().into(),
            name: m.name.clone(),
            global_shape: m.global_shape.clone(),
            offsets: m.offsets.clone(),
            shape: m.shape.clone(),
            elements: [m.elements.start, m.elements.end],
            stored_shape: m.stored_shape(),
        }
    }

    pub fn meta(&self) -> SliceMeta {
        SliceMeta {
            name: self.name.clone(),
            global_shape: self.global_shape.clone(),
            offsets: self.offsets.clone(),
            shape: self.shape.clone(),
            elements: self.elements[0]..self.elements[1],
        }
    }

    pub fn kind(&self) -> Option<Kind> {
        Kind::parse(&self.kind)
    }
}

/// A corpus's fingerprint, as 16 hex digits ([`Tokens::fingerprint`]: FNV-1a over the
/// tokens of a text or small token file, as before; shards by name, size, header and a sample).
pub fn fingerprint(data: &Tokens) -> String {
    data.fingerprint()
}

impl Index {
    /// Checks that the index agrees with itself: the step with the data and learning-rate
    /// positions and the optimizer's update count, and the recorded learning rate with the
    /// schedule it records. A hand-edited field is refused, named. Errors name `path`.
    pub fn check_itself(&self, path: &Path) -> Result<(), CheckpointError> {
        let edited = |problem: String| CheckpointError::Invalid {
            path: path.display().to_string(),
            problem,
            fix:
                "restore the index.json the run wrote, or use another checkpoint (an older step-N)"
                    .into(),
        };
        let step = self.step;
        for (field, v) in [
            ("data.next_step", self.data.next_step as u64),
            ("lr.next_step", self.lr.next_step as u64),
            ("optimizer.updates", self.optimizer.updates),
        ] {
            if v != step as u64 {
                return Err(edited(format!(
                    "`step` is {step}, but `{field}` is {v}: the index disagrees with itself (a run writes them equal)"
                )));
            }
        }
        let lr = &self.lr;
        let decay = match (lr.decay.as_str(), lr.wsd_decay_steps) {
            ("cosine", _) => crate::optim::Decay::Cosine,
            ("linear", _) => crate::optim::Decay::Linear,
            ("constant", _) => crate::optim::Decay::Constant,
            ("wsd", Some(decay_steps)) => crate::optim::Decay::Wsd { decay_steps },
            (d, _) => {
                return Err(edited(format!(
                    "`lr.decay` is {d:?}, not one of cosine, linear, constant, wsd (with `lr.wsd_decay_steps`)"
                )))
            }
        };
        let sane = lr.max_lr.is_finite()
            && lr.max_lr > 0.0
            && lr.min_lr.is_finite()
            && (0.0..=lr.max_lr).contains(&lr.min_lr);
        if !sane {
            return Err(edited(format!(
                "`lr.max_lr` {} and `lr.min_lr` {}: a run writes 0 <= min_lr <= max_lr, max_lr above 0",
                lr.max_lr, lr.min_lr
            )));
        }
        let schedule = crate::optim::LrSchedule {
            max_lr: lr.max_lr,
            min_lr: lr.min_lr,
            warmup_steps: lr.warmup_steps,
            total_steps: lr.total_steps,
            decay,
        };
        let want = schedule.lr(step);
        if want.to_bits() != lr.next_lr.to_bits() {
            return Err(edited(format!(
                "`lr.next_lr` is {}, but the schedule the index records (max_lr {}, min_lr {}, warm-up {}, {} decay to step {}) gives {want} at step {step}: a learning-rate field was changed",
                lr.next_lr, lr.max_lr, lr.min_lr, lr.warmup_steps, lr.decay, lr.total_steps
            )));
        }
        Ok(())
    }

    /// Checks that the index describes a model and data this run can continue: the same
    /// architecture (the vocabulary's padding may differ), sequence length, global batch and
    /// corpus. Errors name `path` (the index file) and the field.
    pub fn check_compatible(
        &self,
        path: &Path,
        plan: &Plan,
        data: &Tokens,
    ) -> Result<(), CheckpointError> {
        let incompatible = |field: &str, ck: String, run: String, fix: &str| {
            Err(CheckpointError::Incompatible {
                path: path.display().to_string(),
                field: field.into(),
                checkpoint: ck,
                run,
                fix: fix.into(),
            })
        };
        let model_fix = "resume with a plan of the same model (the parallel layout may differ)";
        let (ck, run) = (
            serde_json::to_value(&self.model),
            serde_json::to_value(&plan.job.model.architecture),
        );
        if let (Ok(serde_json::Value::Object(ck)), Ok(serde_json::Value::Object(run))) = (ck, run) {
            let keys: std::collections::BTreeSet<&String> = ck.keys().chain(run.keys()).collect();
            for k in keys {
                // Padding rows never reach the loss; a load re-pads (see `load.rs`).
                if k == "vocab_divisible_by" {
                    continue;
                }
                let show = |v: Option<&serde_json::Value>| {
                    v.map_or("absent".to_string(), |v| v.to_string())
                };
                if ck.get(k) != run.get(k) {
                    return incompatible(
                        &format!("model.{k}"),
                        show(ck.get(k)),
                        show(run.get(k)),
                        model_fix,
                    );
                }
            }
        }
        let run_lora = plan_lora(plan);
        if self.lora != run_lora {
            let show = |l: &Option<Lora>| match l {
                Some(l) => serde_json::to_string(l).unwrap_or_default(),
                None => "none (full training)".into(),
            };
            return incompatible(
                "lora",
                show(&self.lora),
                show(&run_lora),
                "resume with a plan of the checkpoint's training method and [lora] settings",
            );
        }
        if self.nf4_base != plan_nf4_base(plan) {
            let show = |nf4: bool| match nf4 {
                true => "NF4 (qlora)",
                false => "the weights' precision (lora or full)",
            };
            return incompatible(
                "nf4_base",
                show(self.nf4_base).into(),
                show(plan_nf4_base(plan)).into(),
                "resume with a plan of the checkpoint's training method (--method qlora stores the base in NF4, lora in f32)",
            );
        }
        let t = &plan.job.model.training;
        let batch_fix = "resume with the seq_len and global_batch the checkpoint was trained with";
        if self.training.seq_len != t.seq_len {
            let (a, b) = (self.training.seq_len, t.seq_len);
            return incompatible("training.seq_len", a.to_string(), b.to_string(), batch_fix);
        }
        if self.training.global_batch != t.global_batch {
            let (a, b) = (self.training.global_batch, t.global_batch);
            return incompatible(
                "training.global_batch",
                a.to_string(),
                b.to_string(),
                batch_fix,
            );
        }
        let data_fix = "resume on the data the checkpoint was trained on (--data)";
        let tokens = data.len() as u64;
        if self.data.tokens != tokens {
            let (a, b) = (self.data.tokens, tokens);
            return incompatible("data.tokens", a.to_string(), b.to_string(), data_fix);
        }
        let fp = fingerprint(data);
        if self.data.fingerprint != fp {
            return incompatible(
                "data.fingerprint",
                self.data.fingerprint.clone(),
                fp,
                data_fix,
            );
        }
        Ok(())
    }
}
