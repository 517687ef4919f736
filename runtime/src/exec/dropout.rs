//! Dropout in the executor (`layers::dropout`): the rates of each block's sites, the draw of a
//! micro-batch's masks, and the embedding's dropout, which sits outside the blocks.
//!
//! A micro-batch's draw is keyed by the optimizer step and the global index of its first
//! sequence — the sampler's own numbering (`Sampler::first_sequence`: DP replica × its share of
//! the global batch + micro-batch × micro-batch size) — so DP, gradient accumulation and PP
//! micro-batching all name the same sequence alike. Evaluation draws none.
//!
//! Split from `rank.rs`, which runs the schedule's ops.

use tessera_planner::plan::Plan;

use super::{Rank, RunError, StageModel};
use crate::backend::{Backend, Collective};
use crate::layers::dropout::{host_mut, DropCall, DropoutRates, Mask};

/// Sets the dropout rates of every block `model` holds on `stage` (global layer indices).
pub(super) fn set_rates(model: &mut StageModel, plan: &Plan, stage: usize, r: &DropoutRates) {
    for (ch, planned) in model.chunks.iter_mut().zip(&plan.stages[stage].chunks) {
        let first = planned.layers[0] as usize;
        for (i, b) in ch.blocks.iter_mut().enumerate() {
            b.set_dropout(first + i, r);
        }
    }
}

impl<B: Backend, C: Collective<B>> Rank<'_, B, C> {
    /// The draw of micro-batch `mb`'s masks at `step`; `None` without dropout or while
    /// evaluating.
    pub(super) fn drop_call(&self, step: u64, mb: usize) -> Option<DropCall> {
        if self.eval_batch.is_some() || !self.drop.any() {
            return None;
        }
        let coord = self.ctx.mesh.coord(self.ctx.rank as u64);
        let (dp, dp_rank) = (self.ctx.mesh.dp as usize, coord.dp as usize);
        let first = self.sampler.first_sequence(dp, dp_rank, self.dims.b, mb);
        Some(DropCall::new(self.sampler.seed, step, first, self.dims.t))
    }
}

/// The embedding's dropout (`rate`, `hidden` features) on `x` (rows from `row` of the
/// micro-batch's), or its backward on the gradient: the same mask either way.
pub(super) fn drop_embedding<B: Backend>(
    rate: f32,
    hidden: usize,
    x: B::Mut<'_>,
    call: Option<DropCall>,
    row: usize,
) -> Result<(), RunError> {
    if let Some(mask) = call.and_then(|c| Mask::embedding(rate, c, hidden)) {
        mask.apply(host_mut::<B>(x)?, row);
    }
    Ok(())
}
