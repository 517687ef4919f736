//! Checkpoints: keep what a run trains, and resume it on the same or another plan.
//!
//! A checkpoint is a directory `DIR/step-N` (N = optimizer steps completed) holding one
//! safetensors file per rank (`rank-00003.safetensors`, written through the `safetensors`
//! crate) and one `index.json` (format `tessera.checkpoint/v1`, [`Index`]). Each rank writes the
//! part of the model it owns: its parameters (the f32 master weights) and both Adam moments,
//! each stored as a slice of a GLOBAL tensor (name, global shape, the TP box it lies in and the
//! element range of that box), so a load can rebuild any other rank's shard under any other
//! DP/TP/PP/ZeRO layout, as torch's distributed checkpoint does. Replicas are written once:
//! under ZeRO-0 only DP rank 0 writes, TP-replicated tensors (norms, row-parallel biases) only
//! on TP rank 0, and the last stage's copy of a tied embedding table not at all.
//!
//! Saving is atomic ([`save`]): the files go to `DIR/.tmp-step-N-<unique>`, every file and the
//! directory are fsynced, the directory is renamed to `DIR/step-N`, and only then does the
//! `DIR/latest` pointer move (itself written to a temporary name and renamed). A process
//! killed at any instant leaves the previous checkpoint whole; leftovers named `.tmp-*` are
//! ignored by a load and removed by the next save.
//!
//! The runtime's random numbers are counter-based (`rng.rs`, `data.rs`): a weight's initial
//! value and a step's batch are pure functions of (seed, indices), so the whole RNG and data
//! state is the seed and the step, which the index records.

mod index;
mod load;
mod owner;
mod save;

use std::borrow::Cow;
use std::ops::Range;
use std::path::PathBuf;

pub use index::{
    DataPosition, Index, LrPosition, OptimizerState, RngState, ShardFile, TensorEntry,
    TrainingShape,
};
pub use load::{Checkpoint, RankState};
pub use owner::{claim, refuse_foreign, Claim, Survey, LOCK};
pub use save::{owned_pieces, Saver};

/// The `format` of every index this runtime writes and reads.
pub const FORMAT: &str = "tessera.checkpoint/v1";
/// The index file in a checkpoint directory.
pub const INDEX: &str = "index.json";
/// The pointer file in a save directory: the name of the newest complete checkpoint.
pub const LATEST: &str = "latest";
/// Prefix of everything a save writes before it is complete.
pub const TMP_PREFIX: &str = ".tmp-";

/// Where and how often a run saves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaveOptions {
    /// The save directory: checkpoints go to `dir/step-N`, with `dir/latest` naming the newest.
    pub dir: PathBuf,
    /// Save after every `every` steps (counted from step 0), and after the last step run.
    pub every: usize,
    /// Keep this many complete checkpoints of this run's lineage (the newest by step),
    /// pruning older ones only after a new save is complete; `None` keeps all.
    pub keep: Option<usize>,
    /// The lineage the checkpoints record (`owner::Claim`); `--keep` prunes only checkpoints
    /// of the same lineage (`None`: those that record none).
    pub lineage: Option<String>,
}

/// `bytes`' SHA-256 as lowercase hex (the index's `sha256` of a shard file).
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `values` of global shape `from` in the global shape `to`, where the two differ (if at all)
/// in the vocabulary's padding rows (dim 0, `Architecture::padded_vocab`): the leading rows
/// both have are copied and any further rows of `to` are zero. Borrowed when the shapes agree.
pub(crate) fn repad<'a>(values: &'a [f32], from: &[usize], to: &[usize]) -> Cow<'a, [f32]> {
    if from == to {
        return Cow::Borrowed(values);
    }
    let row: usize = to[1..].iter().product();
    let mut out = vec![0.0; to.iter().product()];
    let n = from[0].min(to[0]) * row;
    out[..n].copy_from_slice(&values[..n]);
    Cow::Owned(out)
}

/// The name of the checkpoint directory of `step` completed steps.
pub fn step_dir_name(step: usize) -> String {
    format!("step-{step}")
}

/// The step of a complete checkpoint directory `step-N` (one with its index).
fn complete_step(dir: &std::path::Path, name: &str) -> Option<usize> {
    let n = name.strip_prefix("step-")?.parse().ok()?;
    dir.join(name).join(INDEX).is_file().then_some(n)
}

/// The shard file of `rank`.
pub fn shard_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// What a tensor slice holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// The parameters: f32 master weights.
    Param,
    /// Adam's first moment.
    ExpAvg,
    /// Adam's second moment.
    ExpAvgSq,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Param, Kind::ExpAvg, Kind::ExpAvgSq];

    /// The key prefix in a shard file and the `kind` in the index.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Param => "param",
            Kind::ExpAvg => "exp_avg",
            Kind::ExpAvgSq => "exp_avg_sq",
        }
    }

    fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// Where a slice sits in its global tensor: the TP box `offsets`/`shape` (the shard a TP rank
/// holds; the whole tensor when replicated) and the row-major element range `elements` of that
/// box (all of it, or the part a ZeRO shard holds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceMeta {
    pub name: String,
    pub global_shape: Vec<usize>,
    pub offsets: Vec<usize>,
    pub shape: Vec<usize>,
    pub elements: Range<usize>,
}

impl SliceMeta {
    /// Elements of the box.
    pub fn box_len(&self) -> usize {
        self.shape.iter().product()
    }

    /// The shape stored in a shard file: the box's when the slice is the whole box, else flat.
    pub fn stored_shape(&self) -> Vec<usize> {
        if self.elements == (0..self.box_len()) {
            self.shape.clone()
        } else {
            vec![self.elements.len()]
        }
    }

    /// Contiguous runs of the slice in the global tensor: `(slice_start, global_start, len)`.
    pub fn runs(&self) -> Vec<(usize, usize, usize)> {
        let info = crate::params::ParamInfo {
            name: self.name.clone(),
            global_shape: self.global_shape.clone(),
            shard_start: self.offsets.clone(),
            shard_shape: self.shape.clone(),
            offset: 0,
            len: self.box_len(),
            decay: false,
            tp_sharded: false,
            init: crate::params::Init::Const(0.0),
            trainable: true,
        };
        let (lo, hi) = (self.elements.start, self.elements.end);
        info.runs()
            .filter_map(|(l, g, n)| {
                let (a, b) = (l.max(lo), (l + n).min(hi));
                (a < b).then(|| (a - lo, g + (a - l), b - a))
            })
            .collect()
    }
}

/// One slice a rank saves: where it sits, and its parameter and moment values.
#[derive(Debug, Clone)]
pub struct Piece {
    pub meta: SliceMeta,
    pub param: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
}

impl Piece {
    pub fn values(&self, kind: Kind) -> &[f32] {
        match kind {
            Kind::Param => &self.param,
            Kind::ExpAvg => &self.exp_avg,
            Kind::ExpAvgSq => &self.exp_avg_sq,
        }
    }
}

/// Everything one rank hands to a save.
#[derive(Debug, Clone)]
pub struct RankShard {
    pub rank: usize,
    /// Mesh coordinates `(dp, tp, pp)`.
    pub dp: u64,
    pub tp: u64,
    pub pp: u64,
    /// The flat-buffer ranges of this rank's optimizer states (its ZeRO shards, or the
    /// whole buffer), for the record.
    pub optimizer_ranges: Vec<Range<usize>>,
    pub pieces: Vec<Piece>,
}

/// Why a checkpoint cannot be saved or used. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: cannot {what}: {source}")]
    Io {
        path: String,
        what: &'static str,
        source: std::io::Error,
    },
    /// The checkpoint is damaged or incomplete.
    #[error("{path}: {problem}\n  fix: {fix}")]
    Invalid {
        path: String,
        problem: String,
        fix: String,
    },
    /// The checkpoint is whole but does not fit this run.
    #[error(
        "{path}: `{field}` is {checkpoint} in the checkpoint but {run} in this run\n  fix: {fix}"
    )]
    Incompatible {
        path: String,
        field: String,
        checkpoint: String,
        run: String,
        fix: String,
    },
}

impl CheckpointError {
    fn io(path: &std::path::Path, what: &'static str, source: std::io::Error) -> Self {
        CheckpointError::Io {
            path: path.display().to_string(),
            what,
            source,
        }
    }

    fn damaged(path: &std::path::Path, problem: impl Into<String>) -> Self {
        CheckpointError::Invalid {
            path: path.display().to_string(),
            problem: problem.into(),
            fix: "resume from another checkpoint (an older step-N), or retrain".into(),
        }
    }
}

#[cfg(test)]
mod tests;
