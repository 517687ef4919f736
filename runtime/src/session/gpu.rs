//! The session's GPU side: the one place above `backend/cuda/` that constructs the CUDA types
//! (docs/cuda.md, "Where the GPU code lives"). Rank r trains on GPU r mod the visible GPUs, on
//! the same executor as the CPU.

use tessera_planner::plan::Plan;

use crate::backend::cuda::{device_collective, probe_nccl, CudaLauncher, Device};
use crate::data::Tokens;
use crate::exec::{self, RunError, StepMetrics, TrainOptions, TrainReport};

use super::{refused, Collectives, RunOptions, SessionError};

/// Trains `plan` with rank r on GPU r mod `visible`; collectives on NCCL with `nccl`, else
/// through host memory.
pub(super) fn train(
    plan: &Plan,
    data: &Tokens,
    opts: &TrainOptions,
    on_step: &mut dyn FnMut(&StepMetrics),
    visible: usize,
    nccl: bool,
) -> Result<TrainReport, RunError> {
    exec::train_on(
        plan,
        data,
        opts,
        on_step,
        &|r| Ok(Device::new(CudaLauncher::open(r % visible)?)),
        &|dev: &Device<CudaLauncher>, comm| Ok(device_collective(dev, comm, nccl)?),
    )
}

/// Whether a GPU run's ranks exchange data on NCCL: asked for (and refused where a rank would
/// share a GPU, or NCCL does not load), or `auto`, where every rank has its own GPU and NCCL
/// loads. Always false on the CPU.
pub(super) fn nccl(plan: &Plan, opts: &RunOptions) -> Result<bool, SessionError> {
    let world = plan.parallel.world as usize;
    let Some(g) = opts.gpus else {
        return Ok(false);
    };
    let n = g.visible;
    match g.collectives {
        Collectives::Staged => Ok(false),
        Collectives::Nccl => {
            if world > n {
                return Err(refused(
                    format!(
                        "{}: --collectives nccl needs a GPU per rank, and this plan has {world} ranks on {n} visible GPUs (NCCL refuses two ranks of one communicator on one GPU)",
                        opts.plan_file.display()
                    ),
                    format!("use --collectives staged, or plan for {n} devices"),
                ));
            }
            probe_nccl().map_err(SessionError::Nccl)?;
            Ok(true)
        }
        Collectives::Auto => Ok(world <= n && probe_nccl().is_ok()),
    }
}
