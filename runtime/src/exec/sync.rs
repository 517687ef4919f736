//! The end of a step on one rank: gradient sync over DP (all-reduce, or reduce-scatter under
//! ZeRO), the TP sum of sequence-parallel norm gradients, global-norm clipping, the optimizer,
//! and ZeRO's parameter all-gather (or ZeRO-3's release). Split from `rank.rs`, which runs the
//! schedule's ops.

use std::ops::Range;

use super::{Rank, RunError};
use crate::comm::{all_reduce_f64, Comm};
use crate::exec::model::shard_of;
use crate::optim::{clip_scale, local_grad_sq};

impl Rank<'_> {
    /// Gradient sync over DP (all-reduce, or reduce-scatter under ZeRO), global-norm clipping,
    /// the optimizer on this rank's part, and the parameter all-gather.
    pub(super) fn sync_and_update(&mut self, step: usize) -> Result<(), RunError> {
        for r in &self.tp_summed {
            self.ctx.tp.all_reduce_sum(&mut self.grads[r.clone()])?;
        }
        if let Some(emb) = self.ctx.embedding {
            let range = match &self.model.tied_copy {
                Some(r) => r.clone(),
                None => self.model.chunks[0]
                    .embedding
                    .as_ref()
                    .expect("stage 0 holds the embedding")
                    .wte
                    .w
                    .range(),
            };
            emb.all_reduce_sum(&mut self.grads[range])?;
        }
        if self.zero == 0 {
            self.ctx.dp.all_reduce_sum(&mut self.grads)?;
        } else {
            for c in 0..self.model.chunks.len() {
                self.reduce_scatter_region(c)?;
            }
        }
        let mut sq = 0.0;
        for opt in &self.optimizers {
            sq += self.owned_grad_sq(opt.range.clone());
        }
        let mut sum = all_reduce_f64(self.ctx.tp, sq)?;
        sum = all_reduce_f64(self.ctx.pp, sum)?;
        if self.zero > 0 {
            sum = all_reduce_f64(self.ctx.dp, sum)?;
        }
        // The same sum on every rank, so every rank stops here together.
        if !sum.is_finite() {
            return Err(RunError::NonFinite {
                step,
                what: "gradient norm",
                value: sum.sqrt(),
            });
        }
        let scale = clip_scale(sum.sqrt(), self.ctx.opts.clip);
        let lr = self.lr.lr(step);
        for opt in &mut self.optimizers {
            let r = opt.range.clone();
            opt.step(&mut self.params[r.clone()], &self.grads[r], lr, scale);
        }
        match self.zero {
            0 => {}
            3 => {
                for c in 0..self.model.chunks.len() {
                    self.release_region(c);
                }
            }
            _ => {
                for c in 0..self.model.chunks.len() {
                    self.gather_region(c)?;
                }
            }
        }
        Ok(())
    }

    /// Σ g² over `range`, each tensor counted once in the whole model: TP-replicated tensors on
    /// TP rank 0 only, and a tied table's second copy not at all.
    fn owned_grad_sq(&self, range: Range<usize>) -> f64 {
        let tp_rank = self.tp.rank;
        let layout = &self.model.layout;
        match &self.model.tied_copy {
            Some(copy) => {
                let before = range.start..range.end.min(copy.start).max(range.start);
                let after = range.start.max(copy.end).min(range.end)..range.end;
                local_grad_sq(layout, &self.grads, before, tp_rank)
                    + local_grad_sq(layout, &self.grads, after, tp_rank)
            }
            None => local_grad_sq(layout, &self.grads, range, tp_rank),
        }
    }

    /// Sums chunk `c`'s gradients over DP, leaving this rank's shard in place.
    fn reduce_scatter_region(&mut self, c: usize) -> Result<(), RunError> {
        let region = self.model.chunks[c].region.clone();
        let s = region.len().div_ceil(self.dp);
        self.shard_buf.resize(s, 0.0);
        let input = if region.len() == s * self.dp {
            &self.grads[region.clone()]
        } else {
            self.scratch.clear();
            self.scratch.extend_from_slice(&self.grads[region.clone()]);
            self.scratch.resize(s * self.dp, 0.0);
            &self.scratch
        };
        self.ctx.dp.reduce_scatter_sum(input, &mut self.shard_buf)?;
        let shard = shard_of(&region, self.dp, self.dp_rank);
        let len = shard.len();
        self.grads[shard].copy_from_slice(&self.shard_buf[..len]);
        Ok(())
    }

    /// Rebuilds chunk `c`'s full parameters from every DP rank's shard.
    pub(super) fn gather_region(&mut self, c: usize) -> Result<(), RunError> {
        let region = self.model.chunks[c].region.clone();
        let s = region.len().div_ceil(self.dp);
        let shard = shard_of(&region, self.dp, self.dp_rank);
        self.shard_buf.clear();
        self.shard_buf.extend_from_slice(&self.params[shard]);
        self.shard_buf.resize(s, 0.0);
        if region.len() == s * self.dp {
            self.ctx
                .dp
                .all_gather(&self.shard_buf, &mut self.params[region])?;
        } else {
            self.scratch.resize(s * self.dp, 0.0);
            self.ctx.dp.all_gather(&self.shard_buf, &mut self.scratch)?;
            let len = region.len();
            self.params[region].copy_from_slice(&self.scratch[..len]);
        }
        Ok(())
    }

    /// ZeRO-3: drops the parameters of chunk `c` that other DP ranks own.
    pub(super) fn release_region(&mut self, c: usize) {
        if self.dp == 1 {
            return;
        }
        let region = self.model.chunks[c].region.clone();
        let shard = shard_of(&region, self.dp, self.dp_rank);
        self.params[region.start..shard.start].fill(0.0);
        self.params[shard.end..region.end].fill(0.0);
    }
}
