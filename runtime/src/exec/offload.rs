//! Where a rank's optimizer states live and its AdamW step runs: on the backend (the default),
//! or in host memory under optimizer offload (`parallel.offload = "optimizer"`, ZeRO-Offload:
//! Ren et al. 2021). Offloaded, the f32 master weights and the Adam moments of the rank's
//! optimised ranges (its ZeRO shard) are host vectors; after the gradient sync each tensor's
//! gradient comes down, the runtime's own AdamW (`optim.rs`) updates it on the host, and the
//! updated weights go back up in working precision. The device keeps its working weights and
//! gradients only: no moments and no master copy. Split from `rank.rs`.

use std::ops::Range;

use tessera_planner::layout::OffloadStates;
use tessera_planner::plan::Plan;

use super::RunError;
use crate::backend::{Backend, Storage};
use crate::optim::AdamW;

/// The optimizer states of a rank: one AdamW state per optimised range of the flat buffer.
pub(super) enum States<B: Backend> {
    /// On the backend: the moments in its buffers, and an f32 master copy of the whole flat
    /// buffer where the working precision is narrower (`Backend::working_copy`).
    Device {
        master: Option<B::Buf>,
        optimizers: Vec<AdamW<B::Buf>>,
    },
    /// In host memory (optimizer offload): per range, its master weights and host moments.
    Host(Vec<HostShard>),
}

/// One optimised range held on the host.
pub(super) struct HostShard {
    pub adam: AdamW,
    /// The f32 master weights of `adam.range`.
    pub master: Vec<f32>,
}

/// Whether the plan runs the optimizer step on the host.
pub(super) fn offloaded(plan: &Plan) -> bool {
    plan.parallel.offload == OffloadStates::Optimizer
}

impl<B: Backend> States<B> {
    /// The optimised ranges, in order.
    pub fn ranges(&self) -> Vec<Range<usize>> {
        match self {
            States::Device { optimizers, .. } => {
                optimizers.iter().map(|o| o.range.clone()).collect()
            }
            States::Host(shards) => shards.iter().map(|s| s.adam.range.clone()).collect(),
        }
    }

    /// Updates done so far.
    pub fn updates(&self) -> u64 {
        match self {
            States::Device { optimizers, .. } => optimizers.first().map_or(0, |o| o.t),
            States::Host(shards) => shards.first().map_or(0, |s| s.adam.t),
        }
    }

    /// One AdamW step of every range with `grads` (synced: this rank's shard is final) at
    /// learning rate `lr` and clip factor `scale`, leaving the updated weights in `params`.
    pub fn step(
        &mut self,
        be: &B,
        grads: &B::Buf,
        params: &mut B::Buf,
        lr: f32,
        scale: f32,
    ) -> Result<(), RunError> {
        match self {
            States::Device { master, optimizers } => {
                for opt in optimizers {
                    let base = opt.range.start;
                    for (r, st) in opt.begin_step(lr, scale) {
                        let at = base + r.start..base + r.end;
                        let g = B::sub(B::view(grads), at.clone());
                        let m = B::sub_mut(B::view_mut(&mut opt.m), r.clone());
                        let v = B::sub_mut(B::view_mut(&mut opt.v), r);
                        let params = B::sub_mut(B::view_mut(params), at.clone());
                        match master {
                            Some(master) => {
                                let master = B::sub_mut(B::view_mut(master), at);
                                be.adamw(master, Some(params), g, m, v, &st)?
                            }
                            None => be.adamw(params, None, g, m, v, &st)?,
                        }
                    }
                }
            }
            States::Host(shards) => {
                for s in shards {
                    let base = s.adam.range.start;
                    // One tensor at a time: its gradient down, the update, its weights up. The
                    // host holds one tensor's gradient, the device one tensor's upload.
                    for (r, st) in s.adam.begin_step(lr, scale) {
                        let at = base + r.start..base + r.end;
                        let g = be.download(B::sub(B::view(grads), at.clone()))?;
                        s.adam.update(r.clone(), &mut s.master[r.clone()], &g, &st);
                        // Rounded to the working precision as the device kernel rounds its
                        // working copy (`bf16::from_f32` is the kernels' `f2bf`).
                        let up = be.upload(Storage::Bf16, &s.master[r])?;
                        be.copy(B::sub_mut(B::view_mut(params), at), B::view(&up))?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The f32 weights of the whole flat buffer, for a checkpoint: the master copy where there
    /// is one (the host's for the optimised ranges under offload), else the working weights.
    pub fn weights(&self, be: &B, params: &B::Buf) -> Result<Vec<f32>, RunError> {
        Ok(match self {
            States::Device { master, .. } => {
                be.download(B::view(master.as_ref().unwrap_or(params)))?
            }
            States::Host(shards) => {
                let mut w = be.download(B::view(params))?;
                for s in shards {
                    w[s.adam.range.clone()].copy_from_slice(&s.master);
                }
                w
            }
        })
    }

    /// The moments of range `i` (of [`States::ranges`]), on the host.
    pub fn moments(&self, be: &B, i: usize) -> Result<(Vec<f32>, Vec<f32>), RunError> {
        Ok(match self {
            States::Device { optimizers, .. } => {
                let o = &optimizers[i];
                (be.download(B::view(&o.m))?, be.download(B::view(&o.v))?)
            }
            States::Host(shards) => (shards[i].adam.m.clone(), shards[i].adam.v.clone()),
        })
    }
}

/// Refuses the offload this runtime does not run yet: parameters offloaded, NVMe as the tier,
/// saved activations offloaded. Optimizer offload to host memory runs (on a device backend).
pub(super) fn check_supported(plan: &Plan) -> Result<(), RunError> {
    let p = &plan.parallel;
    let unsupported = |what: String| {
        RunError::Unsupported {
        what,
        fix: "re-plan with `tessera plan … --offload optimizer` (master weights, Adam moments and the step in host memory) or without --offload".into(),
    }
    };
    if p.offload == OffloadStates::Params {
        return Err(unsupported(
            "parallel.offload \"params\": the runtime offloads the optimizer states only; keeping the sharded weights in host memory between uses is not built yet".into(),
        ));
    }
    if p.offload != OffloadStates::None && p.offload_to != tessera_planner::layout::OffloadTier::Cpu
    {
        return Err(unsupported(format!(
            "parallel.offload_to \"{}\": the runtime keeps offloaded states in host memory only; NVMe is not built yet",
            p.offload_to.name()
        )));
    }
    if p.offload_activations {
        return Err(unsupported(
            "parallel.offload_activations: the runtime keeps saved activations on the device; offloading them to host memory is not built yet".into(),
        ));
    }
    Ok(())
}

/// Refuses offload on the CPU backend, whose device memory is the host's.
pub(super) fn refuse_on_cpu(plan: &Plan) -> Result<(), RunError> {
    let p = &plan.parallel;
    if p.offload == OffloadStates::None && !p.offload_activations {
        return Ok(());
    }
    Err(RunError::Unsupported {
        what: format!(
            "parallel.offload \"{}\"{}: on the CPU backend the device memory is the host's, so offload would move the states to where they already are",
            p.offload.name(),
            if p.offload_activations { " with offload_activations" } else { "" }
        ),
        fix: "re-plan without --offload and --offload-activations (offload is for a plan on GPUs)".into(),
    })
}
