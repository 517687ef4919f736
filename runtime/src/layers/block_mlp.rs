//! A transformer block's feed-forward part ([`Mlp`]: the dense MLP or a mixture of experts)
//! and the glue that runs the MoE layer (`super::moe`) from the block: its workspace, and a
//! TP sum of host vectors (the router's few numbers per token) through the block's collective. Split from `block.rs`; must not hold activations.

use crate::backend::{Backend, Collective, Storage};

use super::mlp::ParallelMlp;
use super::moe::{MoeMlp, MoeSaved, MoeWorkspace};
use super::LayerError;

/// The block's feed-forward part: the dense MLP, or a mixture of experts.
#[derive(Debug, Clone)]
pub enum Mlp {
    Dense(ParallelMlp),
    Moe {
        moe: Box<MoeMlp>,
        /// The dense MLP's `h` and `a` widths on this TP rank: a stage's blocks share one
        /// workspace (and recompute buffers), so an MoE block's are sized like a dense one's.
        h_width: usize,
        f_local: usize,
    },
}

impl Mlp {
    /// Row width of the dense pre-activation `h`.
    pub fn h_width(&self) -> usize {
        match self {
            Mlp::Dense(m) => m.h_width(),
            Mlp::Moe { h_width, .. } => *h_width,
        }
    }
    /// Row width of the dense activation `a`.
    pub fn f_local(&self) -> usize {
        match self {
            Mlp::Dense(m) => m.f_local,
            Mlp::Moe { f_local, .. } => *f_local,
        }
    }
    /// The dense MLP.
    pub fn dense(&self) -> Option<&ParallelMlp> {
        match self {
            Mlp::Dense(m) => Some(m),
            Mlp::Moe { .. } => None,
        }
    }
    /// The mixture of experts.
    pub fn moe(&self) -> Option<&MoeMlp> {
        match self {
            Mlp::Dense(_) => None,
            Mlp::Moe { moe, .. } => Some(moe),
        }
    }
    pub fn moe_mut(&mut self) -> Option<&mut MoeMlp> {
        match self {
            Mlp::Dense(_) => None,
            Mlp::Moe { moe, .. } => Some(moe),
        }
    }
}

/// Sums a host vector over the TP group through the backend's collective.
pub(super) fn tp_sum_host<B: Backend, C: Collective<B> + ?Sized>(
    be: &B,
    comm: &C,
    v: &mut [f32],
) -> Result<(), LayerError> {
    if comm.size() == 1 {
        return Ok(());
    }
    let mut buf = be.upload(Storage::F32, v)?;
    comm.all_reduce_sum(B::view_mut(&mut buf))?;
    v.copy_from_slice(&be.download(B::view(&buf))?);
    Ok(())
}

/// The MoE MLP's forward on `x` (every row of the TP region), writing its partial output into
/// `out` when given.
pub(super) fn moe_forward<B: Backend>(
    be: &B,
    moe: &MoeMlp,
    p: B::Ref<'_>,
    x: B::Ref<'_>,
    s: &mut MoeSaved<B>,
    out: Option<B::Mut<'_>>,
    ws: Option<&mut MoeWorkspace<B>>,
) -> Result<(), LayerError> {
    moe.forward(be, p, x, s, out, stage_moe(ws)?)
}

/// The stage's MoE workspace, which an MoE block cannot run without.
pub(super) fn stage_moe<B: Backend>(
    ws: Option<&mut MoeWorkspace<B>>,
) -> Result<&mut MoeWorkspace<B>, LayerError> {
    ws.ok_or_else(|| LayerError::Config("an MoE block needs the stage's MoE workspace".into()))
}
