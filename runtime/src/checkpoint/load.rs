//! Opening a checkpoint (validated whole before a run starts) and rebuilding any rank's shard
//! of any plan from it: the slices of every shard file are assembled into global tensors, from
//! which a rank of the new layout copies the parts it holds (`ParamInfo::copy_global_to_shard`,
//! and the flat-buffer segments of its optimizer ranges for the moments).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors};
use tessera_planner::plan::Plan;

use super::{complete_step, CheckpointError, Index, Kind, FORMAT, INDEX, LATEST};
use crate::data::Tokens;
use crate::params::{ParamInfo, ParamLayout};

/// A checkpoint read and checked whole: its index and every global tensor.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    index: Index,
    tensors: BTreeMap<String, Global>,
}

/// One global tensor's parameters and moments.
#[derive(Debug)]
struct Global {
    shape: Vec<usize>,
    /// Indexed by `Kind as usize`: param, exp_avg, exp_avg_sq.
    values: [Vec<f32>; 3],
    covered: [Vec<bool>; 3],
}

/// What one rank of the new plan starts from.
#[derive(Debug, Clone)]
pub struct RankState {
    /// The rank's whole flat parameter buffer (f32 master weights).
    pub params: Vec<f32>,
    /// `(exp_avg, exp_avg_sq)` per requested optimizer range.
    pub moments: Vec<(Vec<f32>, Vec<f32>)>,
    /// Adam's update count.
    pub updates: u64,
}

fn kind_index(k: Kind) -> usize {
    match k {
        Kind::Param => 0,
        Kind::ExpAvg => 1,
        Kind::ExpAvgSq => 2,
    }
}

/// The checkpoint directory `path` names: a `step-N` directory (with an index), or a save
/// directory whose `latest` names one. Should `latest` name a directory that is gone (a save
/// interrupted while replacing a checkpoint of the same step), the newest complete one is used.
fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    if path.join(INDEX).is_file() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join(LATEST);
    let name = match fs::read_to_string(&latest) {
        Ok(s) => s.trim().to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(CheckpointError::Invalid {
                path: path.display().to_string(),
                problem: format!("not a checkpoint: neither {INDEX} nor {LATEST} is there"),
                fix: "pass a save directory (with `latest`) or one of its step-N directories"
                    .into(),
            });
        }
        Err(e) => return Err(CheckpointError::io(&latest, "read", e)),
    };
    if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
        return Err(CheckpointError::damaged(
            &latest,
            format!("names {name:?}, not a step-N directory"),
        ));
    }
    let dir = path.join(&name);
    if dir.exists() {
        return Ok(dir);
    }
    let newest = fs::read_dir(path)
        .map_err(|e| CheckpointError::io(path, "list", e))?
        .flatten()
        .filter_map(|e| complete_step(path, e.file_name().to_str()?))
        .max();
    match newest {
        Some(step) => Ok(path.join(super::step_dir_name(step))),
        None => Err(CheckpointError::damaged(
            &latest,
            format!(
                "names {name}, which does not exist, and no other complete checkpoint is there"
            ),
        )),
    }
}

impl Checkpoint {
    /// Opens and checks the checkpoint at `path` (see [`resolve`]): the index's format, and
    /// every shard file against it (present, not truncated, the tensors it lists with the
    /// dtype and shapes it gives, covering every global tensor exactly once).
    pub fn open(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let dir = resolve(path)?;
        let index_path = dir.join(INDEX);
        let text =
            fs::read(&index_path).map_err(|e| CheckpointError::io(&index_path, "read", e))?;
        let head: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| CheckpointError::damaged(&index_path, format!("not valid JSON: {e}")))?;
        let format = head.get("format").and_then(|f| f.as_str()).unwrap_or("");
        if format != FORMAT {
            return Err(CheckpointError::Invalid {
                path: index_path.display().to_string(),
                problem: format!("`format` is {format:?}; this runtime reads {FORMAT:?}"),
                fix: "resume with the tessera version that wrote the checkpoint".into(),
            });
        }
        let index: Index = serde_json::from_value(head).map_err(|e| {
            CheckpointError::damaged(&index_path, format!("not a {FORMAT} index: {e}"))
        })?;
        index.check_itself(&index_path)?;
        if index.dtype != "F32" {
            let problem = format!("`dtype` is {:?}; this runtime reads \"F32\"", index.dtype);
            return Err(CheckpointError::damaged(&index_path, problem));
        }
        let world = index.parallel.world as usize;
        let ranks: Vec<usize> = index.shards.iter().map(|s| s.rank).collect();
        if ranks != (0..world).collect::<Vec<_>>() {
            let problem = format!("`shards` lists ranks {ranks:?} for a world of {world}");
            return Err(CheckpointError::damaged(&index_path, problem));
        }
        let mut ck = Checkpoint {
            dir,
            index,
            tensors: BTreeMap::new(),
        };
        for s in 0..world {
            ck.read_shard(s)?;
        }
        for (name, g) in &ck.tensors {
            for k in Kind::ALL {
                if let Some(at) = g.covered[kind_index(k)].iter().position(|c| !c) {
                    let problem = format!(
                        "no shard holds element {at} of {} {name} {:?}",
                        k.as_str(),
                        g.shape
                    );
                    return Err(CheckpointError::damaged(&index_path, problem));
                }
            }
        }
        Ok(ck)
    }

    /// Reads shard `s` into the global tensors.
    fn read_shard(&mut self, s: usize) -> Result<(), CheckpointError> {
        let shard = &self.index.shards[s];
        let path = self.dir.join(&shard.file);
        if shard.file.contains(['/', '\\']) || shard.file.starts_with('.') {
            let problem = format!("shard file name {:?} is not a plain name", shard.file);
            return Err(CheckpointError::damaged(&self.dir.join(INDEX), problem));
        }
        let bytes = fs::read(&path).map_err(|e| CheckpointError::io(&path, "read", e))?;
        if bytes.len() as u64 != shard.bytes {
            let problem = format!(
                "{} bytes, but the index says {} (truncated or overwritten)",
                bytes.len(),
                shard.bytes
            );
            return Err(CheckpointError::damaged(&path, problem));
        }
        let sum = super::sha256_hex(&bytes);
        if sum != shard.sha256 {
            let problem = format!(
                "SHA-256 {sum}, but the index says {} (the file changed after the save)",
                shard.sha256
            );
            return Err(CheckpointError::damaged(&path, problem));
        }
        let st = SafeTensors::deserialize(&bytes).map_err(|e| {
            CheckpointError::damaged(&path, format!("not a readable safetensors file: {e}"))
        })?;
        // Each shard records the step it was written at (its safetensors metadata).
        let written_at = SafeTensors::read_metadata(&bytes)
            .ok()
            .and_then(|(_, m)| m.metadata().as_ref().and_then(|kv| kv.get("step").cloned()));
        if let Some(at) = written_at.filter(|at| *at != self.index.step.to_string()) {
            let problem = format!(
                "written at step {at}, but the index's `step` is {}: the index or the shard was swapped or edited",
                self.index.step
            );
            return Err(CheckpointError::Invalid {
                path: path.display().to_string(),
                problem,
                fix: "restore the index.json the run wrote, or use another checkpoint (an older step-N)".into(),
            });
        }
        let listed: HashSet<&str> = shard.tensors.iter().map(|t| t.key.as_str()).collect();
        if let Some(extra) = st.names().into_iter().find(|n| !listed.contains(n)) {
            let problem = format!("holds tensor {extra}, which the index does not list");
            return Err(CheckpointError::damaged(&path, problem));
        }
        for e in &shard.tensors {
            let bad = |problem: String| CheckpointError::damaged(&path, problem);
            let view = st
                .tensor(&e.key)
                .map_err(|_| bad(format!("lacks tensor {}, which the index lists", e.key)))?;
            let kind = e
                .kind()
                .ok_or_else(|| bad(format!("{}: unknown kind {:?}", e.key, e.kind)))?;
            let m = e.meta();
            let nd = m.global_shape.len();
            let fits = nd > 0
                && m.offsets.len() == nd
                && m.shape.len() == nd
                && (0..nd).all(|d| m.offsets[d] + m.shape[d] <= m.global_shape[d])
                && m.elements.start <= m.elements.end
                && m.elements.end <= m.box_len()
                && e.stored_shape == m.stored_shape();
            if !fits {
                return Err(bad(format!(
                    "{}: its slice does not fit its global shape",
                    e.key
                )));
            }
            if view.dtype() != Dtype::F32 || view.shape() != e.stored_shape.as_slice() {
                return Err(bad(format!(
                    "{}: {:?} {:?} in the file, F32 {:?} in the index",
                    e.key,
                    view.dtype(),
                    view.shape(),
                    e.stored_shape
                )));
            }
            let g = self
                .tensors
                .entry(e.name.clone())
                .or_insert_with(|| Global::new(&m.global_shape));
            if g.shape != m.global_shape {
                return Err(bad(format!(
                    "{}: global shape {:?}, another shard says {:?}",
                    e.key, m.global_shape, g.shape
                )));
            }
            let data = view.data();
            let (values, covered) = (
                &mut g.values[kind_index(kind)],
                &mut g.covered[kind_index(kind)],
            );
            for (l, at, n) in m.runs() {
                if covered[at..at + n].iter().any(|&c| c) {
                    return Err(bad(format!("{}: elements another shard also holds", e.key)));
                }
                covered[at..at + n].fill(true);
                for (i, v) in values[at..at + n].iter_mut().enumerate() {
                    let b = 4 * (l + i);
                    *v = f32::from_le_bytes([data[b], data[b + 1], data[b + 2], data[b + 3]]);
                }
            }
        }
        Ok(())
    }

    /// Every global tensor: name, shape (the vocabulary padded as the writing plan had it)
    /// and parameter values. `open` checked that the shards cover each exactly once.
    pub fn params(&self) -> impl Iterator<Item = (&str, &[usize], &[f32])> {
        self.tensors
            .iter()
            .map(|(n, g)| (n.as_str(), g.shape.as_slice(), g.values[0].as_slice()))
    }

    /// Global tensor `name`'s shape and parameter values, if the checkpoint holds it.
    pub fn param(&self, name: &str) -> Option<(&[usize], &[f32])> {
        self.tensors
            .get(name)
            .map(|g| (g.shape.as_slice(), g.values[0].as_slice()))
    }

    /// Checks that the index's `model` describes the tensors the shards hold: `layout` is that
    /// model's single-rank layout (`exec::check_checkpoint` builds it). Every tensor the model
    /// has must be held with its shape (the vocabulary's padding rows may differ), and no
    /// other; else the index's model was edited or swapped, and the checkpoint is refused.
    pub fn check_model(&self, layout: &ParamLayout) -> Result<(), CheckpointError> {
        let index_path = self.dir.join(INDEX);
        let m = &self.index.model;
        let edited = |problem: String| CheckpointError::Invalid {
            path: index_path.display().to_string(),
            problem,
            fix:
                "restore the index.json the run wrote, or use another checkpoint (an older step-N)"
                    .into(),
        };
        let sizes = format!(
            "layers {}, hidden {}, heads {}, kv_heads {}, ffn_hidden {}, vocab {}",
            m.layers, m.hidden, m.heads, m.kv_heads, m.ffn_hidden, m.vocab
        );
        let vocab = m.vocab as usize;
        for e in layout.entries() {
            let Some(g) = self.tensors.get(&e.name) else {
                return Err(edited(format!(
                    "`model` ({sizes}) has a tensor {} {:?}, which no shard holds: the index's model disagrees with the tensors",
                    e.name, e.global_shape
                )));
            };
            let (a, b) = (&g.shape, &e.global_shape);
            let repad = a.len() == b.len() && a[1..] == b[1..] && a[0] >= vocab && b[0] >= vocab;
            if a != b && !repad {
                return Err(edited(format!(
                    "`model` ({sizes}) makes {} {b:?}, and the shards hold it as {a:?}: the index's model disagrees with the tensors",
                    e.name
                )));
            }
        }
        if let Some(extra) = self.tensors.keys().find(|n| layout.get(n).is_none()) {
            return Err(edited(format!(
                "the shards hold a tensor {extra}, which `model` ({sizes}) does not have: the index's model disagrees with the tensors"
            )));
        }
        Ok(())
    }

    /// The checkpoint directory (`…/step-N`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Steps completed: the resumed run's first (0-based) step.
    pub fn step(&self) -> usize {
        self.index.step
    }

    /// The data sampler's seed.
    pub fn sampler_seed(&self) -> u64 {
        self.index.data.sampler_seed
    }

    /// Checks that a run of `plan` on `data` can continue this checkpoint (see
    /// [`Index::check_compatible`]).
    pub fn check_compatible(&self, plan: &Plan, data: &Tokens) -> Result<(), CheckpointError> {
        self.index
            .check_compatible(&self.dir.join(INDEX), plan, data)
    }

    /// Global tensor `e.name`'s `kind` values, in the global shape `e` has. The vocabulary's
    /// padding rows may differ between layouts (`Architecture::padded_vocab`): they never
    /// reach the loss, so the real rows are copied and new padding rows are zero.
    fn global(&self, e: &ParamInfo, kind: Kind) -> Result<Cow<'_, [f32]>, CheckpointError> {
        let index_path = self.dir.join(INDEX);
        let g = self.tensors.get(&e.name).ok_or_else(|| {
            CheckpointError::damaged(&index_path, format!("holds no tensor {}", e.name))
        })?;
        let (a, b) = (&g.shape, &e.global_shape);
        let vocab = self.index.model.vocab as usize;
        let repad = a.len() == b.len() && a[1..] == b[1..] && a[0] >= vocab && b[0] >= vocab;
        if a != b && !repad {
            return Err(CheckpointError::Incompatible {
                path: index_path.display().to_string(),
                field: format!("shape of {}", e.name),
                checkpoint: format!("{a:?}"),
                run: format!("{b:?}"),
                fix: "resume with a plan of the same model".into(),
            });
        }
        Ok(super::repad(&g.values[kind_index(kind)], a, b))
    }

    /// The state of a rank whose parameters `layout` describes and whose optimizer states
    /// cover the flat-buffer `ranges`.
    pub fn restore(
        &self,
        layout: &ParamLayout,
        ranges: &[Range<usize>],
    ) -> Result<RankState, CheckpointError> {
        let mut params = layout.zeros();
        for e in layout.entries() {
            let g = self.global(e, Kind::Param)?;
            e.copy_global_to_shard(&g, e.param_ref().of_mut(&mut params));
        }
        let mut moments: Vec<(Vec<f32>, Vec<f32>)> = ranges
            .iter()
            .map(|r| (vec![0.0; r.len()], vec![0.0; r.len()]))
            .collect();
        // Each tensor's moments are cut to the shard once, however many ranges it spans.
        for e in layout.entries() {
            let span = |r: &Range<usize>| r.start.max(e.offset)..r.end.min(e.offset + e.len);
            if ranges.iter().all(|r| span(r).is_empty()) {
                continue;
            }
            for kind in [Kind::ExpAvg, Kind::ExpAvgSq] {
                let g = self.global(e, kind)?;
                let mut shard = vec![0.0; e.len];
                e.copy_global_to_shard(&g, &mut shard);
                for (r, (m, v)) in ranges.iter().zip(&mut moments) {
                    let sub = span(r);
                    if sub.is_empty() {
                        continue;
                    }
                    let out = if kind == Kind::ExpAvg { m } else { v };
                    out[sub.start - r.start..sub.end - r.start]
                        .copy_from_slice(&shard[sub.start - e.offset..sub.end - e.offset]);
                }
            }
        }
        Ok(RankState {
            params,
            moments,
            updates: self.index.optimizer.updates,
        })
    }
}

impl Global {
    fn new(shape: &[usize]) -> Global {
        let n: usize = shape.iter().product();
        Global {
            shape: shape.to_vec(),
            values: [vec![0.0; n], vec![0.0; n], vec![0.0; n]],
            covered: [vec![false; n], vec![false; n], vec![false; n]],
        }
    }
}
