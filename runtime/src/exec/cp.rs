//! Context parallelism in the executor (docs/context-parallel.md, "How the executor runs it").
//!
//! With `parallel.cp = CP > 1` every sequence of a micro-batch is cut into `2·CP` chunks and CP
//! rank `i` holds chunks `i` and `2·CP − 1 − i` (`layers::context_parallel::cp_chunks`). The
//! rank therefore runs the stage on `(b, T/CP)` tokens: the sampler still hands each DP replica
//! whole sequences, and the rank keeps its two chunks of the ids and of the targets
//! ([`CpRank::split`]); learned position embeddings and RoPE use the tokens' global positions;
//! attention is ring attention over the CP group (`layers::context_parallel::CpRing`, given to
//! the stage's block workspace). Every other op is per token.
//!
//! The loss needs nothing special: each token's loss gradient is `1 / (global batch · T)`
//! already, so every rank's share is its tokens' part of the single-rank mean, and the
//! gradient sum over the DP × CP group (`RankGroups::dp`) and the loss sum over it add up to
//! exactly the single-rank gradient and loss.
//!
//! Split from `rank.rs`, which runs the schedule's ops.

use crate::backend::Backend;
use crate::layers::context_parallel::{cp_split, CpComm, CpRing};
use crate::layers::{BlockWorkspace, Dims, PositionEmbedding};

use super::{RunError, StageModel};

/// This rank's place in its CP group.
pub(super) struct CpRank {
    pub(super) size: usize,
    pub(super) rank: usize,
    /// The global position of each of the rank's `T/CP` tokens of a sequence.
    pub(super) positions: Vec<usize>,
}

impl CpRank {
    /// The rank's share `(b, T/CP)` of the `(b, T)` ids of whole sequences.
    pub(super) fn split(&self, ids: &[u32], b: usize, t: usize) -> Vec<u32> {
        cp_split(ids, b, t, self.size, self.rank)
    }
}

/// The stage's block workspace for micro-batches of `dims` (this rank's tokens: `T/CP` per
/// sequence under CP), and the rank's CP place: with a CP group (`comm`, CP > 1), the stage's
/// attention layers are marked context-parallel and the workspace gets the ring.
pub(super) fn stage_workspace<B: Backend>(
    be: &B,
    model: &mut StageModel,
    dims: Dims,
    stage: usize,
    comm: Option<CpComm<B>>,
) -> Result<(BlockWorkspace<B>, Option<CpRank>), RunError> {
    let cp = comm.map(CpRing::new);
    if cp.is_some() {
        for chunk in &mut model.chunks {
            for block in &mut chunk.blocks {
                block.attn.context_parallel = true;
            }
        }
    }
    let first_block = model
        .chunks
        .iter()
        .flat_map(|c| c.blocks.first())
        .next()
        .ok_or_else(|| RunError::Unsupported {
            what: format!("stage {stage} holds no transformer layer"),
            fix: "re-plan with fewer pipeline stages".into(),
        })?;
    Ok(match cp {
        Some(ring) => {
            let place = CpRank {
                size: ring.size(),
                rank: ring.rank(),
                positions: ring.positions(dims.t),
            };
            let ws = BlockWorkspace::with_ring(be, first_block, dims, ring)?;
            (ws, Some(place))
        }
        None => (BlockWorkspace::new(be, first_block, dims)?, None),
    })
}

/// Adds the position embedding to `x`, rows `first..` of the micro-batch's `(b, t)` tokens:
/// at the rank's global positions under CP.
pub(super) fn add_positions<B: Backend>(
    be: &B,
    wpe: &PositionEmbedding,
    p: B::Ref<'_>,
    x: B::Mut<'_>,
    t: usize,
    first: usize,
    cp: Option<&CpRank>,
) -> Result<(), RunError> {
    match cp {
        Some(cp) => wpe.forward_at(be, p, x, &cp.positions, first)?,
        None => wpe.forward(be, p, x, t, first)?,
    }
    Ok(())
}

/// The position embedding's backward for `dx` (all rows of the micro-batch's tokens).
pub(super) fn positions_backward<B: Backend>(
    be: &B,
    wpe: &PositionEmbedding,
    g: B::Mut<'_>,
    dx: B::Ref<'_>,
    t: usize,
    cp: Option<&CpRank>,
) -> Result<(), RunError> {
    match cp {
        Some(cp) => wpe.backward_at(be, g, dx, &cp.positions)?,
        None => wpe.backward(be, g, dx, t)?,
    }
    Ok(())
}
