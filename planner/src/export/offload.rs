//! A plan's offload (`parallel.offload`, `offload_to`, `offload_activations`) in each target, or
//! its refusal: a plan that keeps states on the host is never exported as a job that keeps them
//! on the device, whose memory would not hold them.

use super::{refuse, ExportError, Target};
use crate::layout::{Offload, OffloadStates};
use crate::plan::Plan;

/// Where an export writes the NVMe tier: a placeholder the user replaces with a folder on the
/// node-local NVMe drive (the plan knows the drive's size and speed, not its mount point).
pub const NVME_PATH: &str = "/local_nvme";

/// One offload knob of a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Knob {
    /// `--offload optimizer`: the optimizer states and step on the host, the weights on the
    /// device.
    Optimizer,
    /// `--offload params`: the weights too.
    Params,
    /// `--offload-to nvme`.
    Nvme,
    /// `--offload-activations`.
    Activations,
}

impl Knob {
    fn describe(self) -> &'static str {
        match self {
            Knob::Optimizer => "optimizer offload (parallel.offload = \"optimizer\": the optimizer states and step on the host, the weights on the device)",
            Knob::Params => "parameter offload (parallel.offload = \"params\": the sharded weights, gradients and optimizer states on the host)",
            Knob::Nvme => "offload to NVMe (parallel.offload_to = \"nvme\")",
            Knob::Activations => "activation offload (parallel.offload_activations = true)",
        }
    }
}

/// The plan's offload.
pub(super) fn of(plan: &Plan) -> Offload {
    let p = &plan.parallel;
    Offload {
        states: p.offload,
        to: p.offload_to,
        activations: p.offload_activations,
    }
}

/// The knobs the plan turns on, in the order a refusal names them.
fn knobs(o: &Offload) -> Vec<Knob> {
    let mut k = Vec::new();
    match o.states {
        OffloadStates::None => {}
        OffloadStates::Optimizer => k.push(Knob::Optimizer),
        OffloadStates::Params => k.push(Knob::Params),
    }
    if o.nvme() {
        k.push(Knob::Nvme);
    }
    if o.activations {
        k.push(Knob::Activations);
    }
    k
}

/// Refuses the first knob of the plan that `target` lacks: `lacks` gives, for each knob the
/// target cannot state, why (the target's side) and the fix.
pub(super) fn check(
    plan: &Plan,
    target: Target,
    lacks: &[(Knob, &str, &str)],
) -> Result<(), ExportError> {
    for k in knobs(&of(plan)) {
        if let Some((_, why, fix)) = lacks.iter().find(|(l, _, _)| *l == k) {
            return Err(refuse(target, format!("{} ({why})", k.describe()), *fix));
        }
    }
    Ok(())
}

/// Refuses any offload at all, for a target that has none.
pub(super) fn none(plan: &Plan, target: Target, why: &str, fix: &str) -> Result<(), ExportError> {
    let all = [Knob::Optimizer, Knob::Params, Knob::Nvme, Knob::Activations];
    let lacks: Vec<_> = all.iter().map(|&k| (k, why, fix)).collect();
    check(plan, target, &lacks)
}

/// What an export cannot hold of the plan's offload, printed beside it: the NVMe folder is a
/// placeholder to replace.
pub fn offload_note(plan: &Plan, target: Target) -> Option<String> {
    let o = of(plan);
    let writes_path = matches!(target, Target::DeepSpeed | Target::Lightning);
    (o.nvme() && writes_path).then(|| {
        format!(
            "the NVMe folder \"{NVME_PATH}\" in the export is a placeholder: replace it with a folder on each node's local NVMe drive (the plan offloads {} there)",
            match o.states {
                OffloadStates::Params => "the optimizer states and the weights",
                _ => "the optimizer states",
            }
        )
    })
}
