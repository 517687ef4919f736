//! The end of a step on one rank: gradient sync over DP (all-reduce, or reduce-scatter under
//! ZeRO), the TP sum of sequence-parallel norm gradients, global-norm clipping, the optimizer,
//! and ZeRO's parameter all-gather (or ZeRO-3's release). Split from `rank.rs`, which runs the
//! schedule's ops.

use std::ops::Range;

use super::{Rank, RunError};
use crate::backend::{scratch, Backend, Collective, Storage};
use crate::exec::model::shard_of;
use crate::optim::clip_scale;

/// `region` without the ranges of `holes` (sorted, disjoint), in order.
fn without(region: Range<usize>, holes: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut at = region.start;
    for h in holes {
        let (a, b) = (h.start.max(region.start), h.end.min(region.end));
        if a >= b {
            continue;
        }
        if at < a {
            out.push(at..a);
        }
        at = at.max(b);
    }
    if at < region.end {
        out.push(at..region.end);
    }
    out
}

/// Which group a part of a chunk's parameters is summed and sharded over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Group {
    /// DP (× CP): every parameter but the routed experts'.
    Dense,
    /// The expert-DP group: the routed experts'.
    Expert,
}

impl<'a, B: Backend, C: Collective<B>> Rank<'a, B, C> {
    /// A group's collective, size and this rank's index in it.
    pub(super) fn group(&self, g: Group) -> (&'a C, usize, usize) {
        match (g, self.ctx.expert_dp) {
            (Group::Expert, Some(c)) => (c, self.edp, self.edp_rank),
            _ => (self.ctx.dp, self.dp, self.dp_rank),
        }
    }

    /// Chunk `c`'s dense and expert parts (either may be empty).
    pub(super) fn parts(&self, c: usize) -> [(Range<usize>, Group); 2] {
        let ch = &self.model.chunks[c];
        [
            (ch.dense(), Group::Dense),
            (ch.experts.clone(), Group::Expert),
        ]
    }

    /// Whether `r` (inside one chunk) holds routed experts' parameters.
    pub(super) fn is_expert(&self, r: &Range<usize>) -> bool {
        self.model
            .chunks
            .iter()
            .any(|c| !c.experts.is_empty() && r.start >= c.experts.start && r.end <= c.experts.end)
    }

    /// The tied embedding's gradient ranges on this rank, summed at the end of the step: over
    /// the embedding group (stage 0's table, or the head stage's copy of it), or, where this
    /// rank holds both the table and the head's copy (ZB-V puts the first and the last piece
    /// of the model on PP rank 0), with each other here ([`Self::sum_tied_here`]).
    fn tied_ranges(&self) -> Vec<Range<usize>> {
        if self.model.adapters {
            return Vec::new(); // frozen: no gradient
        }
        let chunks = self.model.chunks.iter();
        let table = chunks
            .filter_map(|c| c.embedding.as_ref())
            .map(|e| e.wte.w.range())
            .next();
        let mut r: Vec<Range<usize>> = match (self.ctx.embedding, &self.model.tied_copy) {
            (Some(_), Some(copy)) => vec![copy.clone()],
            (Some(_), None) => table.into_iter().collect(),
            (None, Some(copy)) => table.into_iter().chain([copy.clone()]).collect(),
            (None, None) => Vec::new(),
        };
        r.sort_by_key(|r| r.start);
        r
    }

    /// Sums the gradients of the table and the head's copy of it, both on this rank (`lo`
    /// before `hi` in the flat buffer), into both, so the two stay equal after the optimizer
    /// as they do across ranks (a two-term sum is the same in either order).
    fn sum_tied_here(&mut self, lo: Range<usize>, hi: Range<usize>) -> Result<(), RunError> {
        let (before, rest) = B::split_at_mut(B::view_mut(&mut self.grads), hi.start);
        let (mut a, mut b) = (B::sub_mut(before, lo), B::sub_mut(rest, 0..hi.len()));
        self.be.add_assign(B::rb(&mut a), B::ro(&b))?;
        self.be.copy(B::rb(&mut b), B::ro(&a))?;
        Ok(())
    }

    /// Chunk `c`'s gradients are final for this step (its last backward ran): without ZeRO,
    /// start their DP sum now, one bucket per chunk, so that it overlaps the backward of the
    /// chunks still to run (on a collective with a stream of its own). The sequence-parallel
    /// norm gradients in the chunk are summed over TP first, and the tied embedding's range is
    /// left for the end of the step, after its sum over the embedding group: each element is
    /// summed in the same order as when everything waits for the end of the step.
    pub(super) fn chunk_grads_done(&mut self, c: usize) -> Result<(), RunError> {
        if self.zero != 0 || self.dp == 1 {
            return Ok(());
        }
        let region = self.model.chunks[c].region.clone();
        let inside = |r: &Range<usize>| r.start >= region.start && r.end <= region.end;
        for r in self.tp_summed.iter().filter(|r| inside(r)) {
            let g = B::sub_mut(B::view_mut(&mut self.grads), r.clone());
            self.ctx.tp.all_reduce_sum(g)?;
        }
        let holes = self.tied_ranges();
        for piece in without(self.model.chunks[c].dense(), &holes) {
            let g = B::sub_mut(B::view_mut(&mut self.grads), piece);
            self.ctx.dp.all_reduce_sum_start(g)?;
        }
        let experts = self.model.chunks[c].experts.clone();
        if !experts.is_empty() {
            let (comm, ..) = self.group(Group::Expert);
            comm.all_reduce_sum_start(B::sub_mut(B::view_mut(&mut self.grads), experts))?;
        }
        self.bucketed[c] = true;
        Ok(())
    }

    /// Gradient sync over DP (all-reduce, or reduce-scatter under ZeRO), global-norm clipping,
    /// the optimizer on this rank's part, and the parameter all-gather.
    pub(super) fn sync_and_update(&mut self, step: usize) -> Result<(), RunError> {
        let be = self.be;
        let regions: Vec<Range<usize>> =
            self.model.chunks.iter().map(|c| c.region.clone()).collect();
        let done = |r: &Range<usize>, bucketed: &[bool]| {
            regions
                .iter()
                .zip(bucketed)
                .any(|(g, &b)| b && r.start >= g.start && r.end <= g.end)
        };
        for r in &self.tp_summed {
            if done(r, &self.bucketed) {
                continue;
            }
            let g = B::sub_mut(B::view_mut(&mut self.grads), r.clone());
            self.ctx.tp.all_reduce_sum(g)?;
        }
        let tied = self.tied_ranges();
        match (self.ctx.embedding, &tied[..]) {
            (Some(emb), [range]) => {
                emb.all_reduce_sum(B::sub_mut(B::view_mut(&mut self.grads), range.clone()))?
            }
            (None, [a, b]) => self.sum_tied_here(a.clone(), b.clone())?,
            _ => {}
        }
        if self.zero == 0 {
            // What the chunk buckets did not cover: chunks without a backward this step (none
            // in a well-formed schedule) and the tied embedding's range.
            self.ctx.dp.wait_started()?;
            if let Some(e) = self.ctx.expert_dp {
                e.wait_started()?;
            }
            for (c, region) in regions.iter().enumerate() {
                let rest: Vec<(Range<usize>, Group)> = match self.bucketed[c] {
                    true => tied
                        .iter()
                        .filter_map(|t| {
                            let r = t.start.max(region.start)..t.end.min(region.end);
                            (r.start < r.end).then_some((r, Group::Dense))
                        })
                        .collect(),
                    false => self
                        .parts(c)
                        .into_iter()
                        .filter(|(r, _)| !r.is_empty())
                        .collect(),
                };
                for (r, group) in rest {
                    let (comm, ..) = self.group(group);
                    comm.all_reduce_sum(B::sub_mut(B::view_mut(&mut self.grads), r))?;
                }
            }
        } else {
            for c in 0..self.model.chunks.len() {
                self.reduce_scatter_region(c)?;
            }
        }
        let (mut parts, mut expert_parts) = (Vec::new(), Vec::new());
        for range in self.states.ranges() {
            let sq = self.owned_grad_sq(range.clone())?;
            match self.zero == 0 && self.is_expert(&range) {
                true => expert_parts.push(sq),
                false => parts.push(sq),
            }
        }
        let mut sq: f64 = parts.iter().sum();
        if let Some(m) = self.ws.moe.as_ref() {
            // Without ZeRO every rank of the EP group holds other experts whole: their sum
            // counts each expert once (ZeRO's shards are summed over DP × CP below).
            let experts: f64 = expert_parts.iter().sum();
            sq += match &m.ep {
                Some(ep) => ep.all_reduce_f64(experts)?,
                None => experts,
            };
        }
        let mut sum = self.ctx.tp.all_reduce_f64(sq)?;
        sum = self.ctx.pp.all_reduce_f64(sum)?;
        if self.zero > 0 {
            sum = self.ctx.dp.all_reduce_f64(sum)?;
        }
        // The same sum on every rank, so every rank stops here together.
        if !sum.is_finite() {
            return Err(RunError::NonFinite {
                step,
                what: "gradient norm",
                value: sum.sqrt(),
            });
        }
        self.grad_norm = sum.sqrt();
        let scale = clip_scale(self.grad_norm, self.ctx.opts.clip(self.ctx.plan));
        let lr = self.lr.lr(step);
        self.states
            .step(be, &self.grads, &mut self.params, lr, scale)?;
        match self.zero {
            0 => {}
            3 => {
                for c in 0..self.model.chunks.len() {
                    self.release_region(c)?;
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
    fn owned_grad_sq(&self, range: Range<usize>) -> Result<f64, RunError> {
        Ok(match &self.model.tied_copy {
            Some(copy) => {
                let before = range.start..range.end.min(copy.start).max(range.start);
                let after = range.start.max(copy.end).min(range.end)..range.end;
                self.local_grad_sq(before)? + self.local_grad_sq(after)?
            }
            None => self.local_grad_sq(range)?,
        })
    }

    /// Σ g² (f64) over the tensors of `range` this rank contributes to the global norm:
    /// tensors replicated over TP count only on TP rank 0 (as `optim::local_grad_sq`).
    fn local_grad_sq(&self, range: Range<usize>) -> Result<f64, RunError> {
        let mut parts = Vec::new();
        for (r, e) in self.model.layout.segments(range) {
            if e.tp_sharded || self.tp.rank == 0 {
                parts.push(self.be.sum_squares(B::sub(B::view(&self.grads), r))?);
            }
        }
        Ok(parts.iter().sum())
    }

    /// Sums chunk `c`'s gradients over DP (its experts' over expert-DP), leaving this rank's
    /// shard in place.
    fn reduce_scatter_region(&mut self, c: usize) -> Result<(), RunError> {
        for (region, group) in self.parts(c) {
            if !region.is_empty() || group == Group::Dense {
                self.reduce_scatter_part(region, group)?;
            }
        }
        Ok(())
    }

    fn reduce_scatter_part(&mut self, region: Range<usize>, group: Group) -> Result<(), RunError> {
        let be = self.be;
        let (comm, n, rank) = self.group(group);
        let s = region.len().div_ceil(n);
        let mut shard_buf = scratch(be, &mut self.grad_bufs.shard, Storage::F32, s)?;
        let grads = B::view(&self.grads);
        if region.len() == s * n {
            let input = B::sub(grads, region.clone());
            comm.reduce_scatter_sum(input, B::rb(&mut shard_buf))?;
        } else {
            let mut padded = scratch(be, &mut self.grad_bufs.padded, Storage::F32, s * n)?;
            {
                let (head, tail) = B::split_at_mut(B::rb(&mut padded), region.len());
                be.copy(head, B::sub(grads, region.clone()))?;
                be.fill(tail, 0.0)?;
            }
            comm.reduce_scatter_sum(B::freeze(padded), B::rb(&mut shard_buf))?;
        }
        let shard = shard_of(&region, n, rank);
        let len = shard.len();
        let dst = B::sub_mut(B::view_mut(&mut self.grads), shard);
        be.copy(dst, B::sub(B::freeze(shard_buf), 0..len))?;
        Ok(())
    }

    /// Rebuilds chunk `c`'s full parameters from every DP rank's shard (its experts' from the
    /// expert-DP ranks').
    pub(super) fn gather_region(&mut self, c: usize) -> Result<(), RunError> {
        for (region, group) in self.parts(c) {
            if !region.is_empty() || group == Group::Dense {
                self.gather_part(region, group)?;
            }
        }
        Ok(())
    }

    fn gather_part(&mut self, region: Range<usize>, group: Group) -> Result<(), RunError> {
        let be = self.be;
        let (comm, n, rank) = self.group(group);
        let s = region.len().div_ceil(n);
        let shard = shard_of(&region, n, rank);
        let mut shard_buf = scratch(be, &mut self.param_bufs.shard, Storage::Bf16, s)?;
        {
            let (head, tail) = B::split_at_mut(B::rb(&mut shard_buf), shard.len());
            be.copy(head, B::sub(B::view(&self.params), shard))?;
            be.fill(tail, 0.0)?;
        }
        let shard_buf = B::freeze(shard_buf);
        if region.len() == s * n {
            let dst = B::sub_mut(B::view_mut(&mut self.params), region);
            comm.all_gather(shard_buf, dst)?;
        } else {
            let mut full = scratch(be, &mut self.param_bufs.padded, Storage::Bf16, s * n)?;
            comm.all_gather(shard_buf, B::rb(&mut full))?;
            let len = region.len();
            let dst = B::sub_mut(B::view_mut(&mut self.params), region);
            be.copy(dst, B::sub(B::freeze(full), 0..len))?;
        }
        Ok(())
    }

    /// ZeRO-3: drops the parameters of chunk `c` that other DP (expert-DP) ranks own.
    pub(super) fn release_region(&mut self, c: usize) -> Result<(), RunError> {
        for (region, group) in self.parts(c) {
            self.release_part(region, group)?;
        }
        Ok(())
    }

    fn release_part(&mut self, region: Range<usize>, group: Group) -> Result<(), RunError> {
        let (_, n, rank) = self.group(group);
        if n == 1 || region.is_empty() {
            return Ok(());
        }
        let shard = shard_of(&region, n, rank);
        let p = B::view_mut(&mut self.params);
        let (before, rest) = B::split_at_mut(p, shard.start);
        self.be
            .fill(B::sub_mut(before, region.start..shard.start), 0.0)?;
        let after = B::sub_mut(rest, shard.end - shard.start..region.end - shard.start);
        self.be.fill(after, 0.0)?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // holes are lists of ranges
mod tests {
    use super::without;

    #[test]
    fn without_cuts_the_holes_out_of_a_region() {
        assert_eq!(without(10..20, &[]), vec![10..20]);
        assert_eq!(without(10..20, &[12..15]), vec![10..12, 15..20]);
        assert_eq!(without(10..20, &[0..12, 18..30]), vec![12..18]);
        assert_eq!(without(10..20, &[0..5, 25..30]), vec![10..20]);
        assert_eq!(
            without(10..20, &[10..20]),
            Vec::<std::ops::Range<usize>>::new()
        );
        assert_eq!(
            without(10..20, &[11..12, 14..16]),
            vec![10..11, 12..14, 16..20]
        );
    }
}
