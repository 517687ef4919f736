//! The zero-bubble split of a backward (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"):
//! the B pass computes the input gradients and sends them on; the W pass, later, computes the
//! weight gradients `dW += dyᵀ·x` (and the biases' `Σ dy`) that nothing downstream waits for.
//!
//! A linear's backward run with a [`WeightStash`] computes its `dx` as always but, instead of
//! its weight-gradient GEMM, copies its input `x` and output gradient `dy` into the stash;
//! [`WeightStash::run`] does the GEMMs later, in the order they were deferred, which is the
//! order the fused backward runs them in: the same kernels on the same values, so B then W
//! gives the fused backward's gradients bit for bit (on the CPU; a device's fused GELU + bias
//! kernel sums the fc bias in another order, within f32 noise).
//!
//! Deferred: the linears' weights and biases (attention's q/k/v and output projection, the
//! MLP's, the output layer's), the GEMMs that make W worth splitting. Computed in B: the norms'
//! gradients (one kernel yields them with `dx`; O(rows·C)), the LoRA adapters' own (their
//! low-rank `du` is needed for `dx` anyway), the embedding tables' (a scatter-add at the very
//! end of the backward, which nothing waits for), and a mixture of experts' (the routed
//! experts' backward runs on host memory in one pass with their all-to-all).
//!
//! The stash copies `x` even where the block's saved activations hold it: under recompute or
//! sequence parallelism `x` is in the stage's workspace, overwritten by the next block.
//! Buffers are reused from one micro-batch to the next (no allocation after the first).

use crate::backend::{scratch, Backend, Storage};
use crate::params::ParamRef;

use super::LayerError;

/// One deferred weight gradient: `dW (m, k) += dyᵀ (m, n) · x (n, k)`, `db (m) += Σ dy`.
struct Job<B: Backend> {
    w: ParamRef,
    b: Option<ParamRef>,
    /// A gradient range the job must leave as it was (attention's key bias, whose gradient is
    /// exactly zero: `ParallelAttention`'s `k_bias`), saved in `kept`.
    keep: Option<ParamRef>,
    kept: Option<B::Buf>,
    x: B::Buf,
    dy: B::Buf,
    /// Lengths of the `x` and `dy` in use.
    lens: (usize, usize),
    k: usize,
    m: usize,
}

/// The weight gradients of one backward, deferred to a W pass.
pub struct WeightStash<B: Backend> {
    jobs: Vec<Job<B>>,
    /// Jobs `..used` wait for [`run`](Self::run); the rest are spare buffers.
    used: usize,
}

impl<B: Backend> Default for WeightStash<B> {
    fn default() -> Self {
        Self {
            jobs: Vec::new(),
            used: 0,
        }
    }
}

impl<B: Backend> WeightStash<B> {
    /// Whether no weight gradient waits.
    pub fn is_empty(&self) -> bool {
        self.used == 0
    }

    /// Defers `w += dyᵀ·x` (`x (n, k)`, `dy (n, m)`) and `b += Σ dy`: copies `x` and `dy`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push(
        &mut self,
        be: &B,
        w: ParamRef,
        b: Option<ParamRef>,
        x: B::Ref<'_>,
        dy: B::Ref<'_>,
        k: usize,
        m: usize,
    ) -> Result<(), LayerError> {
        let lens = (B::len(x), B::len(dy));
        if self.used == self.jobs.len() {
            self.jobs.push(Job {
                w,
                b,
                keep: None,
                kept: None,
                x: be.alloc(Storage::Bf16, lens.0)?,
                dy: be.alloc(Storage::Bf16, lens.1)?,
                lens,
                k,
                m,
            });
        }
        let job = &mut self.jobs[self.used];
        be.copy(fit(be, &mut job.x, lens.0)?, x)?;
        be.copy(fit(be, &mut job.dy, lens.1)?, dy)?;
        (job.w, job.b, job.keep, job.lens, job.k, job.m) = (w, b, None, lens, k, m);
        self.used += 1;
        Ok(())
    }

    /// The last deferred job leaves `r`'s gradient as it was (it overlaps the job's bias).
    pub(super) fn keep_last(&mut self, r: ParamRef) {
        if let Some(job) = self.used.checked_sub(1).map(|i| &mut self.jobs[i]) {
            job.keep = Some(r);
        }
    }

    /// The W pass: every deferred gradient, in the order deferred, into `g` (the flat gradient
    /// buffer); the stash is empty after.
    pub fn run(&mut self, be: &B, mut g: B::Mut<'_>) -> Result<(), LayerError> {
        for job in &mut self.jobs[..self.used] {
            let x = B::sub(B::view(&job.x), 0..job.lens.0);
            let dy = B::sub(B::view(&job.dy), 0..job.lens.1);
            if let Some(r) = job.keep {
                let kept = scratch(be, &mut job.kept, Storage::F32, r.len)?;
                be.copy(kept, r.view::<B>(B::ro(&g)))?;
            }
            let n = job.lens.0 / job.k;
            let w = job.w.view_mut::<B>(B::rb(&mut g));
            be.matmul_at(w, dy, x, job.m, n, job.k, true)?;
            if let Some(b) = job.b {
                be.bias_backward(b.view_mut::<B>(B::rb(&mut g)), dy)?;
            }
            if let (Some(r), Some(kept)) = (job.keep, &job.kept) {
                be.copy(
                    r.view_mut::<B>(B::rb(&mut g)),
                    B::sub(B::view(kept), 0..r.len),
                )?;
            }
        }
        self.used = 0;
        Ok(())
    }

    /// Drops the deferred gradients without computing them (keeps the buffers).
    pub fn clear(&mut self) {
        self.used = 0;
    }

    /// Elements the waiting jobs hold (for memory reports).
    pub fn floats(&self) -> usize {
        let jobs = self.jobs[..self.used].iter();
        jobs.map(|j| j.lens.0 + j.lens.1).sum()
    }
}

/// The first `len` elements of `buf`, reallocated if it is shorter (a `Bf16` activation).
fn fit<'a, B: Backend>(be: &B, buf: &'a mut B::Buf, len: usize) -> Result<B::Mut<'a>, LayerError> {
    if B::len(B::view(buf)) < len {
        *buf = be.alloc(Storage::Bf16, len)?;
    }
    Ok(B::sub_mut(B::view_mut(buf), 0..len))
}
