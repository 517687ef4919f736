//! A rank's side of checkpoints (`crate::checkpoint`): the state it starts from (the
//! checkpoint's on resume) and the shard it hands to a save. Split from `rank.rs`.

use std::collections::BTreeMap;
use std::ops::Range;

use super::{Rank, RunError, TrainOptions};
use crate::backend::{Backend, Collective, Storage};
use crate::checkpoint::{owned_pieces, Piece, RankShard, Saver};
use crate::exec::offload::{HostShard, States};
use crate::optim::{AdamW, AdamWConfig};
use crate::params::ParamLayout;

/// Global parameters a run starts from, by tensor name: shape and values. A vocabulary-sized
/// tensor may hold the real rows only; the plan's padding rows start at zero (they never reach
/// the loss).
pub type InitialParams = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// The flat parameter buffer of the rank `layout` describes, cut from global tensors `init`.
/// Under adapter fine-tuning `init` is the base: a trainable tensor it lacks (a LoRA adapter)
/// starts from its initialiser with `seed`, as in a run from scratch.
pub fn shard_initial(
    layout: &ParamLayout,
    init: &InitialParams,
    seed: u64,
) -> Result<Vec<f32>, RunError> {
    let mut params = layout.zeros();
    for e in layout.entries() {
        if layout.freezing() && e.trainable && !init.contains_key(&e.name) {
            e.init_shard(seed, e.param_ref().of_mut(&mut params));
            continue;
        }
        let refuse = |what: String| RunError::Unsupported {
            what,
            fix: "start from weights of the plan's model".into(),
        };
        let (shape, values) = init
            .get(&e.name)
            .ok_or_else(|| refuse(format!("the initial weights lack tensor {}", e.name)))?;
        let b = &e.global_shape;
        let padded =
            shape.len() == b.len() && !b.is_empty() && shape[1..] == b[1..] && shape[0] <= b[0];
        if !padded || values.len() != shape.iter().product::<usize>() {
            return Err(refuse(format!(
                "initial tensor {} is {shape:?}; the plan's model has {b:?}",
                e.name
            )));
        }
        let global = crate::checkpoint::repad(values, shape, b);
        e.copy_global_to_shard(&global, e.param_ref().of_mut(&mut params));
    }
    Ok(params)
}

/// What a rank starts from: its weights, and its optimizer states with one AdamW state per
/// flat range of `ranges`: on the backend (with an f32 master copy where the backend keeps
/// one), or in host memory with `offload`. Resuming, these come from the checkpoint (moments
/// and update count included); otherwise the weights are initialised from the seed and the
/// moments are zero.
pub(super) fn initial_state<B: Backend>(
    be: &B,
    opts: &TrainOptions,
    layout: &ParamLayout,
    ranges: Vec<Range<usize>>,
    cfg: AdamWConfig,
    offload: bool,
) -> Result<(B::Buf, States<B>), RunError> {
    let mut resumed = match &opts.resume {
        Some(ck) => Some(ck.restore(layout, &ranges)?),
        None => None,
    };
    let init = match (&mut resumed, &opts.init) {
        (Some(s), _) => std::mem::take(&mut s.params),
        (None, Some(p)) => shard_initial(layout, p, opts.seed)?,
        (None, None) => layout.init(opts.seed),
    };
    let params = be.upload(Storage::Bf16, &init)?;
    let updates = resumed.as_ref().map_or(0, |s| s.updates);
    // The moments of range `i`: the checkpoint's, or `None` for zeros.
    let mut moments = |i: usize| resumed.as_mut().map(|s| std::mem::take(&mut s.moments[i]));
    if offload {
        let mut shards = Vec::with_capacity(ranges.len());
        for (i, r) in ranges.into_iter().enumerate() {
            let master = init[r.clone()].to_vec();
            let mut adam = AdamW::new(cfg, layout, r);
            if let Some((m, v)) = moments(i) {
                (adam.m, adam.v) = (m, v);
            }
            adam.t = updates;
            shards.push(HostShard { adam, master });
        }
        return Ok((params, States::Host(shards)));
    }
    let master = match be.working_copy() {
        true => Some(be.upload(Storage::F32, &init)?),
        false => None,
    };
    drop(init);
    let mut optimizers = Vec::with_capacity(ranges.len());
    for (i, r) in ranges.into_iter().enumerate() {
        let (m, v) = match moments(i) {
            Some((m, v)) => (be.upload(Storage::F32, &m)?, be.upload(Storage::F32, &v)?),
            None => (
                be.alloc(Storage::F32, r.len())?,
                be.alloc(Storage::F32, r.len())?,
            ),
        };
        let mut opt = AdamW::with_state(cfg, layout, r, m, v);
        opt.t = updates;
        optimizers.push(opt);
    }
    Ok((params, States::Device { master, optimizers }))
}

impl<B: Backend, C: Collective<B>> Rank<'_, B, C> {
    /// Hands this rank's shard to `saver` after `done` completed steps: the tensors it owns
    /// (its ZeRO shards, or under ZeRO-0 everything on DP rank 0 only; TP-replicated tensors
    /// on TP rank 0 only; not the last stage's copy of a tied table), with their f32 master
    /// weights and Adam moments.
    pub(super) fn save(&self, saver: &Saver, done: usize) -> Result<(), RunError> {
        let be = self.be;
        // Under ZeRO-0 one rank of each group writes: DP rank 0 the dense tensors, expert-DP
        // rank 0 its routed experts.
        let writes = |r: &Range<usize>| match self.is_expert(r) {
            true => self.zero > 0 || self.edp_rank == 0,
            false => self.zero > 0 || self.dp_rank == 0,
        };
        let weights = self.states.weights(be, &self.params)?;
        let ranges = self.states.ranges();
        let mut pieces = Vec::new();
        for (i, range) in ranges.iter().enumerate().filter(|(_, r)| writes(r)) {
            let (m, v) = self.states.moments(be, i)?;
            let base = range.start;
            let skip = self.model.tied_copy.as_ref();
            let owned = owned_pieces(
                &self.model.layout,
                std::slice::from_ref(range),
                self.tp.rank,
                skip,
            );
            for (sub, meta) in owned {
                let rel = sub.start - base..sub.end - base;
                pieces.push(Piece {
                    meta,
                    param: weights[sub].to_vec(),
                    exp_avg: m[rel.clone()].to_vec(),
                    exp_avg_sq: v[rel].to_vec(),
                });
            }
        }
        if self.dp_rank == 0 {
            // QLoRA's NF4 base, replicated over DP as the rest of the base.
            pieces.extend(crate::exec::nf4::pieces(&self.model, self.tp.rank));
        }
        if self.model.adapters {
            // The frozen base, replicated over DP (ZeRO shards the adapters only): its weights
            // as they are, with zero moments (it has no optimizer state), so the checkpoint is
            // a whole model and a resume reads it back like any other. DP rank 0 writes the
            // dense part; expert-DP rank 0 its routed experts (EP splits them over DP).
            let experts: Vec<Range<usize>> = (self.model.chunks.iter())
                .map(|c| c.frozen_experts.clone())
                .filter(|r| !r.is_empty())
                .collect();
            let mut ranges = Vec::new();
            let mut at = self.model.layout.trainable_len();
            for e in &experts {
                if self.dp_rank == 0 {
                    ranges.push(at..e.start);
                }
                if self.edp_rank == 0 {
                    ranges.push(e.clone());
                }
                at = e.end;
            }
            if self.dp_rank == 0 {
                ranges.push(at..self.model.layout.len());
            }
            ranges.retain(|r| !r.is_empty());
            let skip = self.model.tied_copy.as_ref();
            let owned = owned_pieces(&self.model.layout, &ranges, self.tp.rank, skip);
            for (sub, meta) in owned {
                let zeros = vec![0.0; sub.len()];
                pieces.push(Piece {
                    meta,
                    param: weights[sub].to_vec(),
                    exp_avg: zeros.clone(),
                    exp_avg_sq: zeros,
                });
            }
        }
        let coord = self.ctx.mesh.coord(self.ctx.rank as u64);
        let shard = RankShard {
            rank: self.ctx.rank,
            dp: coord.dp,
            tp: coord.tp,
            pp: coord.pp,
            optimizer_ranges: ranges,
            pieces,
        };
        let updates = self.states.updates();
        saver.submit(done, updates, shard)?;
        Ok(())
    }
}
