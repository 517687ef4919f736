//! The dropout of a transformer block (`super::dropout`): its sites' rates and streams, the
//! arming of the micro-batch's draw, and residual dropout in the forward and the backward.
//! Split from `block.rs`, whose forward and backward call these at the residual adds.

use crate::backend::Backend;
use crate::layers::dropout::{self, DropCall, DropoutRates, Site};
use crate::layers::{Dims, LayerError};

use super::TransformerBlock;

impl TransformerBlock {
    /// Sets the dropout rates of the block, global layer `layer` (the sites' streams carry
    /// it, so every pipeline layout draws alike). The adapters' rate is the plan's `[lora]`
    /// one, set when they are attached.
    pub fn set_dropout(&mut self, layer: usize, r: &DropoutRates) {
        let (c, hq) = (self.cfg.hidden, self.attn.hq);
        let (heads, head0) = (hq * self.tp.size, hq * self.tp.rank);
        let name = |site: &str| format!("h.{layer}.{site}");
        self.attn.dropout = Site::new(&name("attn.drop"), r.attention, head0, hq, heads);
        self.resid_attn = Site::new(&name("attn.resid_drop"), r.residual, 0, c, c);
        self.resid_mlp = Site::new(&name("mlp.resid_drop"), r.residual, 0, c, c);
    }

    /// Arms every dropout site of the block and of its adapters with the micro-batch `call`
    /// (`None`: no dropout), before a forward, a recompute or a backward.
    pub(super) fn arm_dropout(&self, call: Option<DropCall>) {
        self.attn.dropout.arm(call);
        self.resid_attn.arm(call);
        self.resid_mlp.arm(call);
        for a in crate::layers::lora_attach::adapters(self) {
            a.dropout.arm(call);
        }
    }

    /// The first row, among the micro-batch's `B·T`, of the rows this rank holds between the
    /// TP regions.
    pub(super) fn first_row(&self, d: Dims) -> usize {
        match self.sequence_parallel {
            true => self.tp.rank * self.rows(d),
            false => 0,
        }
    }

    /// Residual dropout on the attention's reduced output `x2` (rows from `row`), its bias
    /// added first: returns the bias the fused residual norm still adds (none once added).
    pub(super) fn attn_out_dropout<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        mut x2: B::Mut<'_>,
        row: usize,
    ) -> Result<Option<crate::params::ParamRef>, LayerError> {
        let Some(mk) = self.resid_attn.mask() else {
            return Ok(self.attn.proj.b);
        };
        if let Some(b) = self.attn.proj.b {
            be.add_bias(B::rb(&mut x2), b.view::<B>(p))?;
        }
        mk.apply(dropout::host_mut::<B>(x2)?, row);
        Ok(None)
    }

    /// `out += bias`, the MLP's residual dropout (rows from `row`), then `out += res`.
    pub(super) fn mlp_out_residual<B: Backend>(
        &self,
        be: &B,
        mut out: B::Mut<'_>,
        bias: Option<B::Ref<'_>>,
        res: B::Ref<'_>,
        row: usize,
    ) -> Result<(), LayerError> {
        let Some(mk) = self.resid_mlp.mask() else {
            return Ok(be.add_bias_residual(out, bias, res)?);
        };
        if let Some(b) = bias {
            be.add_bias(B::rb(&mut out), b)?;
        }
        mk.apply(dropout::host_mut::<B>(B::rb(&mut out))?, row);
        Ok(be.add_assign(out, res)?)
    }

    /// The backward of residual dropout `site` on `g` (all the micro-batch's rows), in place.
    pub(super) fn drop_grad<B: Backend>(site: &Site, g: B::Mut<'_>) -> Result<(), LayerError> {
        if let Some(mk) = site.mask() {
            mk.apply(dropout::host_mut::<B>(g)?, 0);
        }
        Ok(())
    }
}
