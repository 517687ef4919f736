//! The atomic save: every rank writes its shard file into a temporary directory; the rank whose
//! file completes the set writes the index, fsyncs, renames the directory into place, moves the
//! `latest` pointer, prunes old checkpoints and removes leftovers of interrupted saves.
//!
//! No rank waits for another: a rank that fails before writing its file leaves the temporary
//! directory incomplete, never renamed, and the previous checkpoint stays the latest.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use safetensors::tensor::{Dtype, TensorView};
use tessera_planner::plan::Plan;

use super::index::{fingerprint, DataPosition, LrPosition, OptimizerState, RngState};
use super::{
    shard_file_name, step_dir_name, CheckpointError, Index, Kind, RankShard, SaveOptions,
    ShardFile, SliceMeta, TensorEntry, TrainingShape, FORMAT, INDEX, LATEST, TMP_PREFIX,
};
use crate::data::Tokens;
use crate::optim::{AdamWConfig, LrSchedule};
use crate::params::ParamLayout;

/// The slices of the tensors in the flat-buffer `ranges` that this rank saves: every segment,
/// except tensors replicated over TP on TP ranks other than 0 and the flat range `skip` (the
/// last stage's copy of a tied table). `(flat range, where it sits in its global tensor)`.
pub fn owned_pieces(
    layout: &ParamLayout,
    ranges: &[Range<usize>],
    tp_rank: usize,
    skip: Option<&Range<usize>>,
) -> Vec<(Range<usize>, SliceMeta)> {
    let mut out = Vec::new();
    for r in ranges {
        for (sub, e) in layout.segments(r.clone()) {
            if !e.tp_sharded && tp_rank != 0 {
                continue;
            }
            if skip.is_some_and(|s| sub.start >= s.start && sub.end <= s.end) {
                continue;
            }
            let meta = SliceMeta {
                name: e.name.clone(),
                global_shape: e.global_shape.clone(),
                offsets: e.shard_start.clone(),
                shape: e.shard_shape.clone(),
                elements: sub.start - e.offset..sub.end - e.offset,
            };
            out.push((sub, meta));
        }
    }
    out
}

/// Saves handed over by the ranks of one run (shared by the rank threads).
#[derive(Debug)]
pub struct Saver {
    opts: SaveOptions,
    world: usize,
    /// The index without the step's fields and shards.
    template: Index,
    schedule: LrSchedule,
    pending: Mutex<BTreeMap<usize, Pending>>,
}

#[derive(Debug)]
struct Pending {
    tmp: PathBuf,
    shards: Vec<Option<ShardFile>>,
}

/// A name no other save (of this or another process) uses.
fn unique() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{}-{nanos}-{n}", std::process::id())
}

fn fsync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| CheckpointError::io(dir, "fsync the directory", e))
}

/// Writes `bytes` to `path` and fsyncs the file.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut f = File::create(path).map_err(|e| CheckpointError::io(path, "create", e))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| CheckpointError::io(path, "write", e))
}

impl Saver {
    /// A saver for `plan`'s ranks; creates the save directory. `seeds` are the run's
    /// (initialisation, sampler) seeds, `schedule` its learning-rate schedule.
    pub fn new(
        opts: &SaveOptions,
        plan: &Plan,
        data: &Tokens,
        seeds: (u64, u64),
        schedule: LrSchedule,
        adam: AdamWConfig,
        clip: f64,
    ) -> Result<Saver, CheckpointError> {
        if opts.every == 0 {
            return Err(CheckpointError::Invalid {
                path: opts.dir.display().to_string(),
                problem: "saving every 0 steps".into(),
                fix: "save every 1 or more steps".into(),
            });
        }
        fs::create_dir_all(&opts.dir)
            .map_err(|e| CheckpointError::io(&opts.dir, "create the save directory", e))?;
        let t = &plan.job.model.training;
        let template = Index {
            format: FORMAT.into(),
            generator: format!("tessera {}", env!("CARGO_PKG_VERSION")),
            step: 0,
            model: plan.job.model.architecture.clone(),
            lora: super::index::plan_lora(plan),
            nf4_base: super::index::plan_nf4_base(plan),
            training: TrainingShape {
                seq_len: t.seq_len,
                global_batch: t.global_batch,
            },
            parallel: plan.parallel.clone(),
            stages: plan.stages.clone(),
            data: DataPosition {
                next_step: 0,
                sampler_seed: seeds.1,
                source: data.source.clone(),
                tokens: data.len() as u64,
                fingerprint: fingerprint(data),
                tokenizer: data.tokenizer.clone(),
            },
            rng: RngState {
                generator: "counter-based SplitMix64 hash of (seed, stream, index); stateless"
                    .into(),
                init_seed: seeds.0,
                sampler_seed: seeds.1,
            },
            lr: LrPosition {
                schedule: format!(
                    "linear warm-up, then {} decay to min_lr at total_steps",
                    schedule.decay_name()
                ),
                max_lr: schedule.max_lr,
                min_lr: schedule.min_lr,
                warmup_steps: schedule.warmup_steps,
                total_steps: schedule.total_steps,
                decay: schedule.decay_name().into(),
                wsd_decay_steps: match schedule.decay {
                    crate::optim::Decay::Wsd { decay_steps } => Some(decay_steps),
                    _ => None,
                },
                next_step: 0,
                next_lr: schedule.lr(0),
            },
            optimizer: OptimizerState {
                kind: "adamw".into(),
                beta1: adam.beta1,
                beta2: adam.beta2,
                eps: adam.eps,
                weight_decay: adam.weight_decay,
                decay_on: adam.decay_on.name().into(),
                clip,
                updates: 0,
                weights: "f32 master weights".into(),
            },
            dtype: "F32".into(),
            shards: Vec::new(),
            lineage: opts.lineage.clone(),
        };
        Ok(Saver {
            opts: opts.clone(),
            world: plan.parallel.world as usize,
            template,
            schedule,
            pending: Mutex::new(BTreeMap::new()),
        })
    }

    pub fn options(&self) -> &SaveOptions {
        &self.opts
    }

    /// Whether a run saves after completing `done` steps (it also saves after its last step).
    pub fn due(&self, done: usize) -> bool {
        done.is_multiple_of(self.opts.every)
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Pending>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rank `shard.rank`'s part of the checkpoint after `step` completed steps (`updates`: the
    /// optimizer's update count). The call that completes the set makes the checkpoint.
    pub fn submit(
        &self,
        step: usize,
        updates: u64,
        shard: RankShard,
    ) -> Result<(), CheckpointError> {
        let tmp = {
            let mut pending = self.pending();
            match pending.get(&step) {
                Some(p) => p.tmp.clone(),
                None => {
                    let name = format!("{TMP_PREFIX}step-{step}-{}", unique());
                    let tmp = self.opts.dir.join(name);
                    fs::create_dir(&tmp)
                        .map_err(|e| CheckpointError::io(&tmp, "create the directory", e))?;
                    let shards = vec![None; self.world];
                    pending.insert(
                        step,
                        Pending {
                            tmp: tmp.clone(),
                            shards,
                        },
                    );
                    tmp
                }
            }
        };
        let rank = shard.rank;
        let file = write_shard(&tmp, step, &shard)?;
        let complete = {
            let mut pending = self.pending();
            let p = pending.get_mut(&step).expect("a pending save");
            p.shards[rank] = Some(file);
            if p.shards.iter().all(Option::is_some) {
                pending.remove(&step)
            } else {
                None
            }
        };
        match complete {
            Some(p) => self.finish(step, updates, p),
            None => Ok(()),
        }
    }

    /// Writes the index, then makes the checkpoint visible and the latest.
    fn finish(&self, step: usize, updates: u64, p: Pending) -> Result<(), CheckpointError> {
        let mut index = self.template.clone();
        index.step = step;
        index.data.next_step = step;
        index.lr.next_step = step;
        index.lr.next_lr = self.schedule.lr(step);
        index.optimizer.updates = updates;
        index.shards = p.shards.into_iter().flatten().collect();
        let json = serde_json::to_vec_pretty(&index).expect("the index serialises");
        write_synced(&p.tmp.join(INDEX), &json)?;
        fsync_dir(&p.tmp)?;
        let dir = &self.opts.dir;
        let name = step_dir_name(step);
        let dst = dir.join(&name);
        if dst.exists() {
            // A checkpoint of the same step from an earlier run: moved aside (and removed
            // below), so that the rename cannot fail on a non-empty directory.
            let aside = dir.join(format!("{TMP_PREFIX}replaced-{name}-{}", unique()));
            fs::rename(&dst, &aside).map_err(|e| CheckpointError::io(&dst, "move aside", e))?;
        }
        fs::rename(&p.tmp, &dst).map_err(|e| CheckpointError::io(&p.tmp, "rename", e))?;
        fsync_dir(dir)?;
        let tmp_latest = dir.join(format!("{TMP_PREFIX}latest-{}", unique()));
        write_synced(&tmp_latest, format!("{name}\n").as_bytes())?;
        let latest = dir.join(LATEST);
        fs::rename(&tmp_latest, &latest).map_err(|e| CheckpointError::io(&latest, "replace", e))?;
        fsync_dir(dir)?;
        if let Some(keep) = self.opts.keep {
            prune(dir, step, keep, self.opts.lineage.as_deref());
        }
        let busy: Vec<PathBuf> = self.pending().values().map(|p| p.tmp.clone()).collect();
        clean_leftovers(dir, &busy);
        Ok(())
    }
}

/// Writes one rank's shard file (through the safetensors crate) and fsyncs it.
fn write_shard(tmp: &Path, step: usize, shard: &RankShard) -> Result<ShardFile, CheckpointError> {
    let name = shard_file_name(shard.rank);
    let path = tmp.join(&name);
    let mut entries = Vec::new();
    let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for piece in &shard.pieces {
        for kind in Kind::ALL {
            let e = TensorEntry::new(kind, &piece.meta);
            let values = piece.values(kind);
            if values.len() != piece.meta.elements.len() {
                return Err(CheckpointError::damaged(
                    &path,
                    format!(
                        "{}: {} values for {} elements",
                        e.key,
                        values.len(),
                        piece.meta.elements.len()
                    ),
                ));
            }
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            blobs.push((e.key.clone(), e.stored_shape.clone(), bytes));
            entries.push(e);
        }
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(e) = entries.iter().find(|e| !seen.insert(&e.key)) {
        return Err(CheckpointError::damaged(
            &path,
            format!("tensor {} twice in one shard", e.key),
        ));
    }
    let views = blobs
        .iter()
        .map(|(k, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes).map(|v| (k.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CheckpointError::damaged(&path, format!("cannot describe a tensor: {e}")))?;
    let meta = [
        ("format".to_string(), FORMAT.to_string()),
        ("rank".to_string(), shard.rank.to_string()),
        ("step".to_string(), step.to_string()),
    ];
    let bytes = safetensors::tensor::serialize(views, Some(meta.into_iter().collect()))
        .map_err(|e| CheckpointError::damaged(&path, format!("cannot serialise: {e}")))?;
    write_synced(&path, &bytes)?;
    Ok(ShardFile {
        file: name,
        rank: shard.rank,
        dp: shard.dp,
        tp: shard.tp,
        pp: shard.pp,
        bytes: bytes.len() as u64,
        sha256: super::sha256_hex(&bytes),
        optimizer_ranges: shard
            .optimizer_ranges
            .iter()
            .map(|r| [r.start, r.end])
            .collect(),
        tensors: entries,
    })
}

/// Removes complete checkpoints of `lineage` beyond the newest `keep` by step, never
/// `just_saved`; checkpoints of another lineage are never removed.
fn prune(dir: &Path, just_saved: usize, keep: usize, lineage: Option<&str>) {
    let mut steps: Vec<usize> = super::Survey::of(dir)
        .complete
        .into_iter()
        .filter(|(s, l)| *s != just_saved && l.as_deref() == lineage)
        .map(|(s, _)| s)
        .collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    for s in steps.into_iter().skip(keep.saturating_sub(1)) {
        fs::remove_dir_all(dir.join(step_dir_name(s))).ok();
    }
}

/// Removes what interrupted saves left (`.tmp-*`), except the saves still in progress.
fn clean_leftovers(dir: &Path, busy: &[PathBuf]) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let leftover = e
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(TMP_PREFIX));
        if !leftover || busy.contains(&path) {
            continue;
        }
        match e.file_type() {
            Ok(t) if t.is_dir() => fs::remove_dir_all(&path).ok(),
            _ => fs::remove_file(&path).ok(),
        };
    }
}
