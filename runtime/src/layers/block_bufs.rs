//! The buffers of a transformer block on a backend: what one micro-batch keeps between its
//! forward and backward ([`BlockActs`]), and the scratch shared by the blocks of a stage
//! ([`BlockWorkspace`]). Activations are `Storage::Bf16`, statistics `F32`.

use crate::backend::{Backend, Storage};

use super::attention::{AttnGrads, RopeTables};
use super::block::TransformerBlock;
use super::context_parallel::CpRing;
use super::moe::{MoeSaved, MoeWorkspace};
use super::{Dims, LayerError, Recompute};

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
    /// A mixture-of-experts MLP's state (host vectors; empty in a dense block).
    pub(super) moe: MoeSaved,
    /// Elements held, for memory reports.
    pub(super) floats: usize,
}

impl<B: Backend> Saved<B> {
    /// Under sequence parallelism the norms' outputs and statistics and the residual `x2` hold
    /// this rank's rows only; the backward all-gathers the norms' outputs again (Megatron's
    /// sequence-parallel memory saving).
    pub(super) fn new(be: &B, b: &TransformerBlock, d: Dims) -> Result<Self, LayerError> {
        let (n, c, s) = (d.n(), b.cfg.hidden, b.attn.shape(d));
        let rows = b.rows(d);
        let lens = [
            rows * c,
            b.ln1.mean_len(rows),
            rows,
            n * s.qkv_width(),
            n * s.y_width(),
            rows * c,
            rows * c,
            b.ln2.mean_len(rows),
            rows,
            n * b.mlp.h_width(),
            n * b.mlp.f_local(),
        ];
        let act = |len| be.alloc(Storage::Bf16, len);
        let stat = |len| be.alloc(Storage::F32, len);
        Ok(Saved {
            ln1: act(lens[0])?,
            ln1_mean: stat(lens[1])?,
            ln1_rstd: stat(lens[2])?,
            qkv: act(lens[3])?,
            y: act(lens[4])?,
            x2: act(lens[5])?,
            ln2: act(lens[6])?,
            ln2_mean: stat(lens[7])?,
            ln2_rstd: stat(lens[8])?,
            h: act(lens[9])?,
            a: act(lens[10])?,
            moe: MoeSaved::default(),
            floats: lens.iter().sum(),
        })
    }
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
    pub fn new(
        be: &B,
        block: &TransformerBlock,
        dims: Dims,
        recompute: Recompute,
    ) -> Result<Self, LayerError> {
        let saved = match recompute {
            Recompute::Full => None,
            _ => Some(Saved::new(be, block, dims)?),
        };
        let keep_att = recompute == Recompute::None
            || (recompute == Recompute::Selective && block.attn.keeps_saved(be));
        let att_len = block.attn.saved_len(be, dims);
        let att = match keep_att {
            true => Some(be.alloc(Storage::F32, att_len)?),
            false => None,
        };
        let x_len = block.rows(dims) * block.cfg.hidden;
        Ok(Self {
            recompute,
            dims,
            x: be.alloc(Storage::Bf16, x_len)?,
            floats: x_len
                + if keep_att { att_len } else { 0 }
                + saved.as_ref().map_or(0, |s| s.floats),
            saved,
            att,
            drop: None,
        })
    }

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
    pub(super) ring: Option<CpRing>,
    /// Mixture-of-experts blocks only: the EP (and CP) groups their experts' tokens and
    /// statistics travel over; a single-rank one is made on first use when none was set.
    pub moe: Option<MoeWorkspace>,
}

/// Buffers of the sequence-parallel path, all `(N, C)`: a gathered norm output (a TP region's
/// input), a gathered output gradient, and a partial sum to reduce-scatter.
#[derive(Debug, Clone)]
pub(super) struct SpScratch<B: Backend> {
    pub(super) ln: B::Buf,
    pub(super) full_in: B::Buf,
    pub(super) partial: B::Buf,
}

impl<B: Backend> BlockWorkspace<B> {
    pub fn new(be: &B, block: &TransformerBlock, dims: Dims) -> Result<Self, LayerError> {
        Self::build(be, block, dims, None)
    }

    /// The workspace of a context-parallel stage: `dims.t` is this rank's share of each
    /// sequence, RoPE's tables are at its tokens' global positions, and attention runs on
    /// `ring`.
    pub fn with_ring(
        be: &B,
        block: &TransformerBlock,
        dims: Dims,
        ring: CpRing,
    ) -> Result<Self, LayerError> {
        Self::build(be, block, dims, Some(ring))
    }

    fn build(
        be: &B,
        block: &TransformerBlock,
        dims: Dims,
        ring: Option<CpRing>,
    ) -> Result<Self, LayerError> {
        let (n, c, rows) = (dims.n(), block.cfg.hidden, block.rows(dims));
        let act = |len| be.alloc(Storage::Bf16, len);
        let scaling = block.cfg.rope_scaling.as_ref();
        let rope = match (block.cfg.rope_theta, &ring) {
            (Some(th), Some(r)) => Some(RopeTables::at_positions(
                be,
                &r.positions(dims.t),
                block.attn.hd,
                th,
                scaling,
            )?),
            (Some(th), None) => Some(RopeTables::scaled(be, dims.t, block.attn.hd, th, scaling)?),
            (None, _) => None,
        };
        let sp = match block.sequence_parallel {
            true => Some(SpScratch {
                ln: act(n * c)?,
                full_in: act(n * c)?,
                partial: act(n * c)?,
            }),
            false => None,
        };
        Ok(Self {
            dims,
            rope,
            att: None,
            saved: None,
            sp,
            ring,
            moe: None,
            grads: Grads {
                dln: act(rows * c)?,
                dx2: act(rows * c)?,
                dh: act(n * block.mlp.h_width())?,
                da: act(n * block.mlp.f_local())?,
                attn: AttnGrads::new(be, &block.attn.shape(dims))?,
            },
        })
    }
}

/// The workspace's recompute buffers, allocated on first use.
pub(super) fn saved_in<'a, B: Backend>(
    be: &B,
    slot: &'a mut Option<Saved<B>>,
    block: &TransformerBlock,
    d: Dims,
) -> Result<&'a mut Saved<B>, LayerError> {
    Ok(match slot {
        Some(s) => s,
        None => slot.insert(Saved::new(be, block, d)?),
    })
}
