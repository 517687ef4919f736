//! One rank's backward ops: the fused backward of a (micro-batch, chunk), and the zero-bubble
//! schedules' split of it into B (input gradients, sent on) and W (the weight gradients its
//! linears left in a stash, `layers::wgrad`). Split from `rank.rs`, which runs the schedule.

use std::collections::HashMap;

use super::{cp, dropout, schedule_bug, Key, Rank, RunError};
use crate::backend::{Backend, Collective, Storage};
use crate::exec::model::Chunk;
use crate::layers::tp::{copy_to_tp_backward, gather_rows, scatter_rows};
use crate::layers::vocab_parallel_cross_entropy_backward;

impl<'a, B: Backend, C: Collective<B>> Rank<'a, B, C> {
    /// The backward of `(mb, chunk)`: fused, or with `split` the B pass of a zero-bubble
    /// schedule, its linears' weight gradients left in a stash for [`Self::backward_weight`]
    /// (`layers::wgrad` says which gradients B still computes). Either way it sends the input
    /// gradient on.
    pub(super) fn backward(
        &mut self,
        mb: usize,
        chunk: usize,
        split: bool,
    ) -> Result<(), RunError> {
        if self.zero == 3 {
            self.gather_region(chunk)?;
        }
        let mut stash = split.then(|| self.stashes.pop().unwrap_or_default());
        let be = self.be;
        let (n, c) = (self.dims.n(), self.model.cfg.hidden);
        let ((rows, _), sp) = (self.rows(), self.ctx.plan.parallel.sequence_parallel);
        let tp = self.ctx.tp;
        let mut acts = self
            .acts
            .remove(&(mb, chunk))
            .ok_or_else(|| schedule_bug(format!("runs backward of micro-batch {mb} first")))?;
        let ch = &self.model.chunks[chunk];
        let p = B::view(&self.params);
        let mut g = B::view_mut(&mut self.grads);
        let (v, m) = (B::view, B::view_mut);
        let mut dx = match (&ch.head, acts.head.take()) {
            (Some(head), Some(mut s)) => {
                let t = &self.ctx.plan.job.model.training;
                let mut dl = be.alloc(Storage::F32, n)?;
                be.fill(m(&mut dl), 1.0 / (t.global_batch * t.seq_len) as f32)?;
                let start = self.tp.rank * (self.model.vocab / self.tp.size);
                vocab_parallel_cross_entropy_backward(
                    be,
                    m(&mut s.logits),
                    v(&s.max),
                    v(&s.sumexp),
                    &s.targets,
                    v(&dl),
                    start,
                )?;
                let mut dh = be.alloc(Storage::Bf16, rows * c)?;
                let (gg, dl, defer) = (B::rb(&mut g), v(&s.logits), stash.as_mut());
                if sp {
                    let mut h = be.alloc(Storage::Bf16, n * c)?;
                    gather_rows(tp, v(&s.h), m(&mut h))?;
                    let mut dh_full = be.alloc(Storage::Bf16, n * c)?;
                    head.proj
                        .backward_split(be, p, gg, v(&h), dl, m(&mut dh_full), defer)?;
                    scatter_rows(tp, v(&dh_full), m(&mut dh))?;
                } else {
                    head.proj
                        .backward_split(be, p, gg, v(&s.h), dl, m(&mut dh), defer)?;
                    copy_to_tp_backward(tp, m(&mut dh))?;
                }
                let mut dx = be.alloc(Storage::Bf16, rows * c)?;
                head.norm.backward(
                    be,
                    p,
                    B::rb(&mut g),
                    v(&dh),
                    v(&s.x),
                    v(&s.mean),
                    v(&s.rstd),
                    m(&mut dx),
                )?;
                dx
            }
            _ => take_input::<B>(
                &mut self.inbox,
                &mut self.outbox,
                &self.model.chunks,
                (mb, chunk),
                false,
            )
            .ok_or_else(|| {
                schedule_bug(format!(
                    "runs backward of micro-batch {mb} before its gradient"
                ))
            })?,
        };
        for (blk, a) in ch.blocks.iter().zip(acts.blocks.iter()).rev() {
            let mut din = be.alloc(Storage::Bf16, rows * c)?;
            blk.backward_split(
                be,
                p,
                B::rb(&mut g),
                v(&dx),
                m(&mut din),
                a,
                &mut self.ws,
                tp,
                stash.as_mut(),
            )?;
            dx = din;
        }
        match &ch.embedding {
            Some(e) => {
                if sp {
                    // Every TP rank needs every row's gradient: its table rows may be used anywhere.
                    let mut full = be.alloc(Storage::Bf16, n * c)?;
                    gather_rows(tp, v(&dx), m(&mut full))?;
                    dx = full;
                }
                dropout::drop_embedding::<B>(self.drop.embedding, c, m(&mut dx), acts.drop, 0)?;
                let inputs = acts.inputs.take().ok_or_else(|| {
                    schedule_bug(format!(
                        "runs backward of micro-batch {mb} before embedding it"
                    ))
                })?;
                if !self.model.adapters {
                    e.wte.backward(be, B::rb(&mut g), &inputs, v(&dx))?;
                }
                if let Some(wpe) = e.wpe.as_ref().filter(|_| !self.model.adapters) {
                    let (gg, cp) = (B::rb(&mut g), self.cp.as_ref());
                    cp::positions_backward(be, wpe, gg, v(&dx), self.dims.t, cp)?;
                }
            }
            None => {
                self.outbox.insert((mb, chunk), dx);
            }
        }
        drop(g);
        self.pool[chunk].push(acts);
        if let Some(stash) = stash {
            self.waiting.insert((mb, chunk), stash);
        }
        if self.zero == 3 {
            self.release_region(chunk)?;
        }
        Ok(())
    }

    /// The W pass of `(mb, chunk)`: the weight gradients its B pass deferred. It reads no
    /// parameter (`dW += dyᵀ·x` from the stash), so under ZeRO-3 it gathers none.
    pub(super) fn backward_weight(&mut self, mb: usize, chunk: usize) -> Result<(), RunError> {
        let mut stash = self.waiting.remove(&(mb, chunk)).ok_or_else(|| {
            schedule_bug(format!(
                "runs the weight gradients of micro-batch {mb} before its input gradients"
            ))
        })?;
        stash.run(self.be, B::view_mut(&mut self.grads))?;
        self.stashes.push(stash);
        Ok(())
    }
}

/// What `(mb, chunk)`'s forward (or backward) starts from: what the schedule received for it
/// into `inbox`, or, where the model piece before it (after it) is this rank's own other chunk
/// of `chunks`, that chunk's output in `outbox`, with no send (ZB-V's last rank runs pieces
/// pp-1 and pp back to back).
pub(super) fn take_input<B: Backend>(
    inbox: &mut HashMap<Key, B::Buf>,
    outbox: &mut HashMap<Key, B::Buf>,
    chunks: &[Chunk],
    (mb, chunk): Key,
    forward: bool,
) -> Option<B::Buf> {
    if let Some(buf) = inbox.remove(&(mb, chunk)) {
        return Some(buf);
    }
    let vs = chunks[chunk].virtual_stage;
    let next = match forward {
        true => vs.checked_sub(1)?,
        false => vs + 1,
    };
    let c = chunks.iter().position(|c| c.virtual_stage == next)?;
    outbox.remove(&(mb, c))
}
