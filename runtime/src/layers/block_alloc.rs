//! The constructors of a transformer block's buffers (`block_bufs.rs`), each sized from the
//! block's widths and a micro-batch's [`Dims`]. A file of their own so that `block.rs` (which
//! uses the buffers) and `block_bufs.rs` (which defines them) need not import each other;
//! neither imports this one (inherent methods need no import).

use crate::backend::{Backend, Storage};

use super::attention::{AttnGrads, RopeTables};
use super::block::TransformerBlock;
use super::block_bufs::{BlockActs, BlockWorkspace, Grads, Saved, SpScratch};
use super::context_parallel::CpRing;
use super::moe::MoeSaved;
use super::{Dims, LayerError, Recompute};

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

    /// The workspace's recompute buffers, allocated on first use.
    pub(super) fn in_slot<'a>(
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
        ring: CpRing<B>,
    ) -> Result<Self, LayerError> {
        Self::build(be, block, dims, Some(ring))
    }

    fn build(
        be: &B,
        block: &TransformerBlock,
        dims: Dims,
        ring: Option<CpRing<B>>,
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
