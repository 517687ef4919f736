//! The validation loss: a forward-only pass of fixed sequences through the plan's own pipeline.
//!
//! The sequences are the same for every layout ([`EvalSet`]: the first non-overlapping windows
//! of the validation corpus), cut into batches of the plan's global batch, and each DP replica
//! and micro-batch takes its contiguous slice exactly as in training. The pass runs the
//! schedule's op list with the backward half left out (its backward ops, and the gradient
//! sends and receives): forwards never wait on a backward, so the remaining list cannot
//! deadlock, and every stage computes its forwards in the order the training step does. The
//! loss is summed on the last stage and reduced over DP as the training loss is, so a parallel
//! layout's validation loss equals the single rank's within the parity tolerance.
//!
//! Split from `rank.rs`, which runs the training step.

use tessera_planner::schedule::Op;

use super::{Rank, RunError};
use crate::backend::{Backend, Collective};

/// Fixed validation sequences and how often to evaluate them.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalSet {
    /// Evaluate after every `every`-th step (and after the last step).
    pub every: usize,
    /// `(sequences, seq_len)` input ids, row-major.
    pub inputs: Vec<u32>,
    /// The targets: the inputs shifted by one token.
    pub targets: Vec<u32>,
    /// Where the sequences came from, for messages.
    pub source: String,
}

impl EvalSet {
    /// Whole sequences held.
    pub fn sequences(&self, seq_len: usize) -> usize {
        self.inputs.len() / seq_len.max(1)
    }

    /// Whether the run evaluates after `done` steps of `total`.
    pub fn due(&self, done: usize, total: usize) -> bool {
        self.every > 0 && (done.is_multiple_of(self.every) || done == total)
    }

    /// Sequences `first..first + count` (inputs, targets).
    pub fn slice(&self, seq_len: usize, first: usize, count: usize) -> (Vec<u32>, Vec<u32>) {
        let r = first * seq_len..(first + count) * seq_len;
        (self.inputs[r.clone()].to_vec(), self.targets[r].to_vec())
    }
}

impl<B: Backend, C: Collective<B>> Rank<'_, B, C> {
    /// The mean validation loss over the eval set's whole batches, on the rank that reports
    /// the training loss (`None` elsewhere).
    pub(super) fn evaluate(&mut self) -> Result<Option<f64>, RunError> {
        let Some(set) = self.ctx.opts.eval.clone() else {
            return Ok(None);
        };
        let t = &self.ctx.plan.job.model.training;
        let (seq, batch) = (t.seq_len as usize, t.global_batch as usize);
        let batches = set.sequences(seq) / batch;
        let ops: Vec<Op> = self
            .ops
            .iter()
            .copied()
            .filter(|op| {
                matches!(
                    op,
                    Op::Forward { .. } | Op::SendActivation { .. } | Op::RecvActivation { .. }
                )
            })
            .collect();
        let train_sum = std::mem::replace(&mut self.loss_sum, 0.0);
        for b in 0..batches {
            self.eval_batch = Some(b);
            for op in &ops {
                let out = self.op(*op, 0);
                if out.is_err() {
                    self.eval_batch = None;
                }
                out?;
                // A forward keeps its activations for a backward that does not come: they go
                // back to the pool at once, so evaluation holds less than a training step.
                if let Op::Forward { mb, chunk } = *op {
                    if let Some(mut acts) = self.acts.remove(&(mb, chunk)) {
                        acts.head = None;
                        self.pool[chunk].push(acts);
                    }
                }
            }
        }
        self.eval_batch = None;
        // The validation loss is the cross-entropy alone: the forwards' load-balancing losses
        // are dropped.
        if let Some(m) = self.ws.moe.as_mut() {
            m.take_aux();
        }
        let sum = std::mem::replace(&mut self.loss_sum, train_sum);
        if !self.holds_head() {
            return Ok(None);
        }
        let total = self.ctx.dp.all_reduce_f64(sum)?;
        let c = self.ctx.mesh.coord(self.ctx.rank as u64);
        let mean = total / (batches * batch * seq) as f64;
        Ok((c.dp == 0 && c.cp == 0 && c.tp == 0).then_some(mean))
    }

    /// The input and target ids of micro-batch `mb`: the sampler's at `step`, or the eval
    /// set's while [`Self::evaluate`] runs. Each DP replica takes its own whole sequences (the
    /// CP ranks of a replica the same ones), and a CP rank keeps its two chunks of each.
    pub(super) fn tokens(&self, step: u64, mb: usize) -> (Vec<u32>, Vec<u32>) {
        let coord = self.ctx.mesh.coord(self.ctx.rank as u64);
        let (dp, dp_rank) = (self.ctx.mesh.dp as usize, coord.dp as usize);
        let first = self.sampler.first_sequence(dp, dp_rank, self.dims.b, mb);
        let t = &self.ctx.plan.job.model.training;
        let seq = t.seq_len as usize;
        let (inputs, targets) = match (self.eval_batch, &self.ctx.opts.eval) {
            (Some(b), Some(set)) => {
                let global = b * t.global_batch as usize + first;
                set.slice(seq, global, self.dims.b)
            }
            _ => self
                .sampler
                .sequences(self.ctx.data, step, first, self.dims.b),
        };
        match &self.cp {
            Some(cp) => (
                cp.split(&inputs, self.dims.b, seq),
                cp.split(&targets, self.dims.b, seq),
            ),
            None => (inputs, targets),
        }
    }
}
