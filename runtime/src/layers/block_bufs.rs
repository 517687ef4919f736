//! The buffers of a transformer block on a backend: what one micro-batch keeps between its
//! forward and backward ([`BlockActs`]), and the scratch shared by the blocks of a stage
//! ([`BlockWorkspace`]). Activations are `Storage::Bf16`, statistics `F32`. The types only:
//! their constructors, which size them from a `TransformerBlock`, are `block_alloc.rs`'s, so
//! that this file and `block.rs` do not import each other.

use crate::backend::Backend;

use super::attention::{AttnGrads, RopeTables};
use super::context_parallel::CpRing;
use super::moe::{MoeSaved, MoeWorkspace};
use super::{Dims, Recompute};

/// The intermediate tensors of one block forward (local TP shapes, `N = B·T`).
#[derive(Debug, Clone)]
pub(super) struct Saved<B: Backend> {
    pub(super) ln1: B::Buf,      // (rows, C)
    pub(super) ln1_mean: B::Buf, // (rows) LayerNorm only
    pub(super) ln1_rstd: B::Buf, // (rows)
    pub(super) qkv: B::Buf,      // (N, (hq + 2·hkv)·hd), after RoPE
    pub(super) y: B::Buf,        // (N, hq·hd) attention output before `o`
    pub(super) x2: B::Buf,       // (rows, C) residual after attention
    pub(super) ln2: B::Buf,      // (rows, C)
    pub(super) ln2_mean: B::Buf, // (rows)
    pub(super) ln2_rstd: B::Buf, // (rows)
    pub(super) h: B::Buf,        // (N, f_local or 2·f_local) pre-activation
    pub(super) a: B::Buf,        // (N, f_local)
    /// A mixture-of-experts MLP's state (empty in a dense block).
    pub(super) moe: MoeSaved<B>,
    /// Elements held, for memory reports.
    pub(super) floats: usize,
}

/// One micro-batch's saved activations for one block.
#[derive(Debug, Clone)]
pub struct BlockActs<B: Backend> {
    pub recompute: Recompute,
    pub dims: Dims,
    /// `(rows, C)`: the block input, always kept (`rows = N`, or `N / t` under SP).
    pub(super) x: B::Buf,
    /// Everything else, unless `Full`.
    pub(super) saved: Option<Saved<B>>,
    /// What attention keeps for its backward: with `Recompute::None`, and with `Selective`
    /// on a backend whose saved state is small (a flash kernel's log-sum-exp).
    pub(super) att: Option<B::Buf>,
    pub(super) floats: usize,
    /// The micro-batch the block's dropout masks are drawn for (`None`: no dropout, as in
    /// evaluation); the executor sets it before the forward.
    pub drop: Option<super::dropout::DropCall>,
}

impl<B: Backend> BlockActs<B> {
    /// Elements held between forward and backward (for memory reports).
    pub fn floats(&self) -> usize {
        self.floats
    }
}

/// Gradient temporaries of a block backward.
#[derive(Debug, Clone)]
pub(super) struct Grads<B: Backend> {
    pub(super) dln: B::Buf, // (rows, C)
    pub(super) dx2: B::Buf, // (rows, C)
    pub(super) dh: B::Buf,  // like h
    pub(super) da: B::Buf,  // like a
    pub(super) attn: AttnGrads<B>,
}

/// Scratch shared by the blocks of a stage (one micro-batch geometry).
#[derive(Debug)]
pub struct BlockWorkspace<B: Backend> {
    pub dims: Dims,
    pub(super) rope: Option<RopeTables<B>>,
    /// Recomputed attention state (when not kept), sized on first use.
    pub(super) att: Option<B::Buf>,
    /// Recomputed tensors (Full), allocated on first use.
    pub(super) saved: Option<Saved<B>>,
    pub(super) grads: Grads<B>,
    /// Sequence parallelism only: full-row buffers for gathers and partial sums.
    pub(super) sp: Option<SpScratch<B>>,
    /// Context parallelism only: the CP group's ring, which the attention of a
    /// context-parallel block runs on.
    pub(super) ring: Option<CpRing<B>>,
    /// Mixture-of-experts blocks only: the EP (and CP) groups their experts' tokens and
    /// statistics travel over; a single-rank one is made on first use when none was set.
    pub moe: Option<MoeWorkspace<B>>,
}

/// Buffers of the sequence-parallel path, all `(N, C)`: a gathered norm output (a TP region's
/// input), a gathered output gradient, and a partial sum to reduce-scatter.
#[derive(Debug, Clone)]
pub(super) struct SpScratch<B: Backend> {
    pub(super) ln: B::Buf,
    pub(super) full_in: B::Buf,
    pub(super) partial: B::Buf,
}
