//! The pre-norm transformer block, tensor-parallel: `x2 = x + Attn(Norm1(x))`,
//! `out = x2 + Mlp(Norm2(x2))`, with explicit forward and backward and activation recompute.
//!
//! Activations are split in two owners so the pipeline executor controls memory:
//! - [`BlockActs`]: what ONE micro-batch keeps between its forward and its backward (the
//!   executor holds one per in-flight micro-batch and block). Its size depends on [`Recompute`](super::Recompute):
//!   `None` keeps everything, `Selective` drops the attention probabilities `(B, hq, T, T)`,
//!   `Full` keeps only the block input.
//! - [`BlockWorkspace`]: scratch shared by all blocks of a stage (gradient temporaries, RoPE
//!   tables, and the recomputed tensors), reused across calls.
//!
//! All buffers live on the [`Backend`]: activations in `Storage::Bf16`, statistics in `F32`.
//!
//! With `sequence_parallel` (Korthikanti et al. 2022), the block's input, output, residual and
//! norms hold this rank's `N / t` rows: each norm's output is all-gathered into its TP region
//! and the region's partial output reduce-scattered back, in place of Megatron's all-reduces.
//!
//! Recompute runs the same functions in the same order on the same inputs, so results are
//! bitwise identical to keeping the activations. A full recompute re-issues the attention
//! all-reduce (or, under SP, both gathers and the attention reduce-scatter; every TP rank does,
//! in the same order) but not the MLP output's.
//! This module must not allocate in the hot path after the first call.

use crate::backend::{scratch, Backend, Collective, Storage};
use crate::params::ParamLayout;

use super::attention::{ParallelAttention, RopeTables};
pub use super::block_bufs::{BlockActs, BlockWorkspace};
use super::block_bufs::{Grads, Saved, SpScratch};
pub use super::block_mlp::Mlp;
use super::block_mlp::{moe_forward, stage_moe, tp_sum_host};
use super::context_parallel::CpRing;
use super::dropout::Site;
use super::mlp::ParallelMlp;
use super::moe::{EpShard, MoeMlp, MoeWorkspace};
use super::norm::Norm;
use super::tp::{copy_to_tp_backward, gather_rows, reduce_from_tp_forward, scatter_rows, TpShard};
use super::wgrad::WeightStash;
use super::{BlockConfig, Dims, LayerError};

/// A pre-norm transformer block on one TP rank.
#[derive(Debug, Clone)]
pub struct TransformerBlock {
    pub cfg: BlockConfig,
    pub tp: TpShard,
    pub ln1: Norm,
    pub attn: ParallelAttention,
    pub ln2: Norm,
    pub mlp: Mlp,
    /// Megatron sequence parallelism: activations outside the TP regions are split by rows.
    pub sequence_parallel: bool,
    /// Residual dropout on the attention's and the MLP's outputs, before each residual add
    /// (GPT-2's `resid_pdrop`); the probabilities' dropout is the attention's own.
    pub resid_attn: Site,
    pub resid_mlp: Site,
}

impl TransformerBlock {
    /// A block whose MLP is a mixture of experts (`MoeMlp::new`): its dense parameters in
    /// `layout`, this rank's routed experts in `expert_layout`.
    pub fn new_moe(
        layout: &mut ParamLayout,
        expert_layout: &mut ParamLayout,
        prefix: &str,
        cfg: &BlockConfig,
        moe: &tessera_planner::model::Moe,
        tp: TpShard,
        ep: EpShard,
    ) -> Result<Self, LayerError> {
        let c = cfg.hidden;
        let ln1 = Norm::new(layout, &format!("{prefix}.ln_1"), cfg.norm, c, cfg.norm_eps)?;
        let attn = ParallelAttention::new(layout, &format!("{prefix}.attn"), cfg, tp)?;
        let ln2 = Norm::new(layout, &format!("{prefix}.ln_2"), cfg.norm, c, cfg.norm_eps)?;
        let m = MoeMlp::new(
            layout,
            expert_layout,
            &format!("{prefix}.mlp"),
            cfg,
            moe,
            tp,
            ep,
        )?;
        let (_, f_local) = tp.split(cfg.ffn_hidden, "ffn_hidden")?;
        let h_width = match cfg.activation {
            super::Activation::Gelu => f_local,
            super::Activation::SwiGlu => 2 * f_local,
        };
        Ok(Self {
            cfg: cfg.clone(),
            tp,
            ln1,
            attn,
            ln2,
            mlp: Mlp::Moe {
                moe: Box::new(m),
                h_width,
                f_local,
            },
            sequence_parallel: false,
            resid_attn: Site::default(),
            resid_mlp: Site::default(),
        })
    }

    /// Registers the block's parameters under `{prefix}.` (e.g. `h.3.`); `prefix` must carry the
    /// GLOBAL layer index so every pipeline layout names (and initialises) tensors alike.
    pub fn new(
        layout: &mut ParamLayout,
        prefix: &str,
        cfg: &BlockConfig,
        tp: TpShard,
    ) -> Result<Self, LayerError> {
        let (c, std, pstd) = (cfg.hidden, cfg.init_std, cfg.proj_init_std);
        let ln1 = Norm::new(layout, &format!("{prefix}.ln_1"), cfg.norm, c, cfg.norm_eps)?;
        let attn = ParallelAttention::new(layout, &format!("{prefix}.attn"), cfg, tp)?;
        let ln2 = Norm::new(layout, &format!("{prefix}.ln_2"), cfg.norm, c, cfg.norm_eps)?;
        let mlp_prefix = format!("{prefix}.mlp");
        let mlp = ParallelMlp::new(
            layout,
            &mlp_prefix,
            c,
            cfg.ffn_hidden,
            cfg.activation,
            cfg.bias,
            tp,
            std,
            pstd,
        )?;
        Ok(Self {
            cfg: cfg.clone(),
            tp,
            ln1,
            attn,
            ln2,
            mlp: Mlp::Dense(mlp),
            sequence_parallel: false,
            resid_attn: Site::default(),
            resid_mlp: Site::default(),
        })
    }

    /// Rows of the activations this rank holds between blocks: `N`, or `N / t` under sequence
    /// parallelism.
    pub fn rows(&self, d: Dims) -> usize {
        d.rows(self.tp.size, self.sequence_parallel)
    }

    /// The forward through the MLP activation into `s` (and `att`); with `out`, also the MLP
    /// output and the second residual. Shared by forward and full recompute.
    fn forward_core<B: Backend, C: Collective<B> + ?Sized>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
        s: &mut Saved<B>,
        att: B::Mut<'_>,
        rope: Option<&RopeTables<B>>,
        ring: Option<&mut CpRing<B>>,
        d: Dims,
        comm: &C,
        sp: Option<&mut SpScratch<B>>,
        out: Option<B::Mut<'_>>,
        moe_ws: Option<&mut MoeWorkspace<B>>,
    ) -> Result<(), LayerError> {
        if let Some(sp) = sp {
            return self.forward_core_sp(be, p, x, s, att, rope, ring, d, comm, sp, out, moe_ws);
        }
        let m = B::view_mut;
        self.ln1.forward(
            be,
            p,
            x,
            m(&mut s.ln1),
            m(&mut s.ln1_mean),
            m(&mut s.ln1_rstd),
        )?;
        // Attention's output projection, its TP sum, then its bias, the residual and the
        // second norm in one step (one kernel on a device).
        self.attn.forward_partial(
            be,
            p,
            B::view(&s.ln1),
            m(&mut s.qkv),
            att,
            m(&mut s.y),
            m(&mut s.x2),
            rope,
            ring,
            d,
        )?;
        reduce_from_tp_forward(comm, m(&mut s.x2))?;
        let bias = self.attn_out_dropout(be, p, m(&mut s.x2), 0)?;
        self.ln2.forward_residual(
            be,
            p,
            m(&mut s.x2),
            bias,
            x,
            m(&mut s.ln2),
            m(&mut s.ln2_mean),
            m(&mut s.ln2_rstd),
        )?;
        let mlp = match &self.mlp {
            Mlp::Dense(mlp) => mlp,
            Mlp::Moe { moe, .. } => {
                let Some(mut out) = out else {
                    return moe_forward::<B>(be, moe, p, B::view(&s.ln2), &mut s.moe, None, moe_ws);
                };
                let o = Some(B::rb(&mut out));
                moe_forward::<B>(be, moe, p, B::view(&s.ln2), &mut s.moe, o, moe_ws)?;
                reduce_from_tp_forward(comm, B::rb(&mut out))?;
                return self.mlp_out_residual(be, out, None, B::view(&s.x2), 0);
            }
        };
        mlp.forward_hidden(be, p, B::view(&s.ln2), m(&mut s.h), m(&mut s.a))?;
        if let Some(mut out) = out {
            mlp.proj
                .forward_partial(be, p, B::view(&s.a), B::rb(&mut out))?;
            reduce_from_tp_forward(comm, B::rb(&mut out))?;
            let bias = mlp.proj.b.map(|b| b.view::<B>(p));
            self.mlp_out_residual(be, out, bias, B::view(&s.x2), 0)?;
        }
        Ok(())
    }

    /// [`forward_core`](Self::forward_core) under sequence parallelism: `x`, `s.x2` and `out`
    /// hold this rank's rows; each norm's output is all-gathered into the TP region, and each
    /// region's partial output is reduce-scattered back to rows before its bias is added.
    fn forward_core_sp<B: Backend, C: Collective<B> + ?Sized>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
        s: &mut Saved<B>,
        att: B::Mut<'_>,
        rope: Option<&RopeTables<B>>,
        ring: Option<&mut CpRing<B>>,
        d: Dims,
        comm: &C,
        sp: &mut SpScratch<B>,
        out: Option<B::Mut<'_>>,
        moe_ws: Option<&mut MoeWorkspace<B>>,
    ) -> Result<(), LayerError> {
        let (m, v) = (B::view_mut, B::view);
        self.ln1.forward(
            be,
            p,
            x,
            m(&mut s.ln1),
            m(&mut s.ln1_mean),
            m(&mut s.ln1_rstd),
        )?;
        gather_rows(comm, v(&s.ln1), m(&mut sp.ln))?;
        self.attn.forward_partial(
            be,
            p,
            v(&sp.ln),
            m(&mut s.qkv),
            att,
            m(&mut s.y),
            m(&mut sp.partial),
            rope,
            ring,
            d,
        )?;
        scatter_rows(comm, v(&sp.partial), m(&mut s.x2))?;
        let row = self.first_row(d);
        let bias = self.attn_out_dropout(be, p, m(&mut s.x2), row)?;
        self.ln2.forward_residual(
            be,
            p,
            m(&mut s.x2),
            bias,
            x,
            m(&mut s.ln2),
            m(&mut s.ln2_mean),
            m(&mut s.ln2_rstd),
        )?;
        gather_rows(comm, v(&s.ln2), m(&mut sp.ln))?;
        let mlp = match &self.mlp {
            Mlp::Dense(mlp) => mlp,
            Mlp::Moe { moe, .. } => {
                let Some(mut out) = out else {
                    return moe_forward::<B>(be, moe, p, v(&sp.ln), &mut s.moe, None, moe_ws);
                };
                let partial = Some(m(&mut sp.partial));
                moe_forward::<B>(be, moe, p, v(&sp.ln), &mut s.moe, partial, moe_ws)?;
                scatter_rows(comm, v(&sp.partial), B::rb(&mut out))?;
                return self.mlp_out_residual(be, out, None, v(&s.x2), row);
            }
        };
        mlp.forward_hidden(be, p, v(&sp.ln), m(&mut s.h), m(&mut s.a))?;
        if let Some(mut out) = out {
            mlp.proj
                .forward_partial(be, p, v(&s.a), m(&mut sp.partial))?;
            scatter_rows(comm, v(&sp.partial), B::rb(&mut out))?;
            let bias = mlp.proj.b.map(|b| b.view::<B>(p));
            self.mlp_out_residual(be, out, bias, v(&s.x2), row)?;
        }
        Ok(())
    }

    /// `out (N, C) = block(x (N, C))`, keeping in `acts` what its recompute policy says.
    pub fn forward<B: Backend, C: Collective<B> + ?Sized>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
        out: B::Mut<'_>,
        acts: &mut BlockActs<B>,
        ws: &mut BlockWorkspace<B>,
        comm: &C,
    ) -> Result<(), LayerError> {
        let d = acts.dims;
        check_dims(ws.dims, d)?;
        self.arm_dropout(acts.drop);
        be.copy(B::view_mut(&mut acts.x), x)?;
        let BlockWorkspace {
            rope,
            att: ws_att,
            saved: ws_saved,
            sp,
            ring,
            moe,
            ..
        } = ws;
        let moe_ws = match self.mlp {
            Mlp::Moe { .. } => Some(moe.get_or_insert_with(MoeWorkspace::single)),
            Mlp::Dense(_) => None,
        };
        let att_len = self.attn.saved_len(be, d);
        let att = match &mut acts.att {
            Some(a) => B::view_mut(a),
            None => scratch(be, ws_att, Storage::F32, att_len)?,
        };
        let s = match acts.saved.as_mut() {
            Some(s) => s,
            None => Saved::in_slot(be, ws_saved, self, d)?,
        };
        self.forward_core(
            be,
            p,
            x,
            s,
            att,
            rope.as_ref(),
            ring.as_mut(),
            d,
            comm,
            sp.as_mut(),
            Some(out),
            moe_ws,
        )?;
        if let (Some(ws), Mlp::Moe { .. }) = (moe.as_mut(), &self.mlp) {
            ws.record_aux(s.moe.aux);
        }
        Ok(())
    }

    /// Given `dout (N, C)`, writes `dx (N, C)` and accumulates parameter gradients into `g`.
    pub fn backward<B: Backend, C: Collective<B> + ?Sized>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        g: B::Mut<'_>,
        dout: B::Ref<'_>,
        dx: B::Mut<'_>,
        acts: &BlockActs<B>,
        ws: &mut BlockWorkspace<B>,
        comm: &C,
    ) -> Result<(), LayerError> {
        self.backward_split(be, p, g, dout, dx, acts, ws, comm, None)
    }

    /// [`backward`](Self::backward), the linears' weight and bias gradients deferred to
    /// `defer` when given: the B pass of a zero-bubble schedule, whose W pass is
    /// [`WeightStash::run`] ([`super::wgrad`] says what stays in B). The MoE experts' backward
    /// runs whole here (their gradients come in B; W does nothing for them).
    pub fn backward_split<B: Backend, C: Collective<B> + ?Sized>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        mut g: B::Mut<'_>,
        dout: B::Ref<'_>,
        mut dx: B::Mut<'_>,
        acts: &BlockActs<B>,
        ws: &mut BlockWorkspace<B>,
        comm: &C,
        mut defer: Option<&mut WeightStash<B>>,
    ) -> Result<(), LayerError> {
        let d = acts.dims;
        check_dims(ws.dims, d)?;
        self.arm_dropout(acts.drop);
        let BlockWorkspace {
            rope,
            att: ws_att,
            saved: ws_saved,
            grads: gr,
            sp,
            ring,
            moe,
            ..
        } = ws;
        if let Mlp::Moe { .. } = self.mlp {
            moe.get_or_insert_with(MoeWorkspace::single);
        }
        let rope = rope.as_ref();
        let att_len = self.attn.saved_len(be, d);
        let (s, att): (&Saved<B>, B::Ref<'_>) = match (&acts.att, acts.saved.as_ref()) {
            (Some(att), Some(s)) => (s, B::view(att)),
            (None, Some(s)) => {
                let mut att = scratch(be, ws_att, Storage::F32, att_len)?;
                self.attn
                    .recompute_saved(be, B::view(&s.qkv), B::rb(&mut att), d)?;
                (s, B::freeze(att))
            }
            (_, None) => {
                let s = Saved::in_slot(be, ws_saved, self, d)?;
                let mut att = scratch(be, ws_att, Storage::F32, att_len)?;
                let x = B::view(&acts.x);
                self.forward_core(
                    be,
                    p,
                    x,
                    s,
                    B::rb(&mut att),
                    rope,
                    ring.as_mut(),
                    d,
                    comm,
                    sp.as_mut(),
                    None,
                    moe.as_mut(),
                )?;
                (&*s, B::freeze(att))
            }
        };
        if let Some(sp) = sp.as_mut() {
            let ring = ring.as_mut();
            return self.backward_sp(
                be,
                p,
                g,
                dout,
                dx,
                acts,
                s,
                att,
                gr,
                sp,
                rope,
                ring,
                d,
                comm,
                moe.as_mut(),
                defer,
            );
        }
        let (m, v) = (B::view_mut, B::view);
        // Residual dropout's backward: the MLP's output sees `dout ⊙ mask` (in `dx2`, free
        // until the residual's copy below), the attention's `dx2 ⊙ mask` (in `dx`, free until
        // its final copy). Without dropout no copy is made (no launch on a device).
        let mlp_dy = match self.resid_mlp.p > 0.0 {
            true => {
                be.copy(m(&mut gr.dx2), dout)?;
                Self::drop_grad::<B>(&self.resid_mlp, m(&mut gr.dx2))?;
                v(&gr.dx2)
            }
            false => B::rr(&dout),
        };
        self.mlp_backward_partial(
            be,
            p,
            B::rb(&mut g),
            v(&s.ln2),
            s,
            mlp_dy,
            m(&mut gr.dln),
            m(&mut gr.dh),
            m(&mut gr.da),
            comm,
            moe.as_mut(),
            defer.as_deref_mut(),
        )?;
        copy_to_tp_backward(comm, m(&mut gr.dln))?;
        be.copy(m(&mut gr.dx2), dout)?;
        self.ln2.backward(
            be,
            p,
            B::rb(&mut g),
            v(&gr.dln),
            v(&s.x2),
            v(&s.ln2_mean),
            v(&s.ln2_rstd),
            m(&mut gr.dx2),
        )?;
        let attn_dy = match self.resid_attn.p > 0.0 {
            true => {
                be.copy(B::rb(&mut dx), v(&gr.dx2))?;
                Self::drop_grad::<B>(&self.resid_attn, B::rb(&mut dx))?;
                B::ro(&dx)
            }
            false => v(&gr.dx2),
        };
        self.attn.backward_partial(
            be,
            p,
            B::rb(&mut g),
            v(&s.ln1),
            v(&s.qkv),
            att,
            v(&s.y),
            attn_dy,
            m(&mut gr.dln),
            &mut gr.attn,
            rope,
            ring.as_mut(),
            d,
            defer,
        )?;
        copy_to_tp_backward(comm, m(&mut gr.dln))?;
        be.copy(B::rb(&mut dx), v(&gr.dx2))?;
        self.ln1.backward(
            be,
            p,
            g,
            v(&gr.dln),
            v(&acts.x),
            v(&s.ln1_mean),
            v(&s.ln1_rstd),
            dx,
        )?;
        Ok(())
    }
}

impl TransformerBlock {
    /// The backward under sequence parallelism: `dout` and `dx` hold this rank's rows. Each TP
    /// region's output gradient and its saved input (the norm's output) are all-gathered, and
    /// its partial input gradient reduce-scattered to rows before the norm's backward. The
    /// norms' weight gradients come from this rank's rows only; the executor sums them over TP
    /// after the step.
    fn backward_sp<B: Backend, C: Collective<B> + ?Sized>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        mut g: B::Mut<'_>,
        dout: B::Ref<'_>,
        mut dx: B::Mut<'_>,
        acts: &BlockActs<B>,
        s: &Saved<B>,
        att: B::Ref<'_>,
        gr: &mut Grads<B>,
        sp: &mut SpScratch<B>,
        rope: Option<&RopeTables<B>>,
        ring: Option<&mut CpRing<B>>,
        d: Dims,
        comm: &C,
        moe_ws: Option<&mut MoeWorkspace<B>>,
        mut defer: Option<&mut WeightStash<B>>,
    ) -> Result<(), LayerError> {
        let (m, v) = (B::view_mut, B::view);
        gather_rows(comm, dout, m(&mut sp.full_in))?;
        Self::drop_grad::<B>(&self.resid_mlp, m(&mut sp.full_in))?;
        gather_rows(comm, v(&s.ln2), m(&mut sp.ln))?;
        self.mlp_backward_partial(
            be,
            p,
            B::rb(&mut g),
            v(&sp.ln),
            s,
            v(&sp.full_in),
            m(&mut sp.partial),
            m(&mut gr.dh),
            m(&mut gr.da),
            comm,
            moe_ws,
            defer.as_deref_mut(),
        )?;
        scatter_rows(comm, v(&sp.partial), m(&mut gr.dln))?;
        be.copy(m(&mut gr.dx2), dout)?;
        self.ln2.backward(
            be,
            p,
            B::rb(&mut g),
            v(&gr.dln),
            v(&s.x2),
            v(&s.ln2_mean),
            v(&s.ln2_rstd),
            m(&mut gr.dx2),
        )?;
        gather_rows(comm, v(&gr.dx2), m(&mut sp.full_in))?;
        Self::drop_grad::<B>(&self.resid_attn, m(&mut sp.full_in))?;
        gather_rows(comm, v(&s.ln1), m(&mut sp.ln))?;
        self.attn.backward_partial(
            be,
            p,
            B::rb(&mut g),
            v(&sp.ln),
            v(&s.qkv),
            att,
            v(&s.y),
            v(&sp.full_in),
            m(&mut sp.partial),
            &mut gr.attn,
            rope,
            ring,
            d,
            defer,
        )?;
        scatter_rows(comm, v(&sp.partial), m(&mut gr.dln))?;
        be.copy(B::rb(&mut dx), v(&gr.dx2))?;
        self.ln1.backward(
            be,
            p,
            g,
            v(&gr.dln),
            v(&acts.x),
            v(&s.ln1_mean),
            v(&s.ln1_rstd),
            dx,
        )?;
        Ok(())
    }
}

impl TransformerBlock {
    /// The MLP's backward without the TP sum of `dx`: the dense MLP's, or the mixture of
    /// experts' (whose router gradient sums a few numbers per token over TP itself).
    fn mlp_backward_partial<B: Backend, C: Collective<B> + ?Sized>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        g: B::Mut<'_>,
        ln2: B::Ref<'_>,
        s: &Saved<B>,
        dout: B::Ref<'_>,
        dx: B::Mut<'_>,
        dh: B::Mut<'_>,
        da: B::Mut<'_>,
        comm: &C,
        moe_ws: Option<&mut MoeWorkspace<B>>,
        defer: Option<&mut WeightStash<B>>,
    ) -> Result<(), LayerError> {
        match &self.mlp {
            Mlp::Dense(mlp) => {
                let (h, a) = (B::view(&s.h), B::view(&s.a));
                mlp.backward_split(be, p, g, ln2, h, a, dout, dx, dh, da, defer)
            }
            // Whole in B even when deferring: the experts' GEMMs run between two all-to-alls, and splitting them would keep every expert's dispatched tokens
            // and gradients until W. Their gradients are final after B; W has none of them.
            Mlp::Moe { moe, .. } => {
                let mut tp_sum = |v: &mut [f32]| tp_sum_host(be, comm, v);
                moe.backward(
                    be,
                    p,
                    g,
                    ln2,
                    &s.moe,
                    dout,
                    dx,
                    stage_moe(moe_ws)?,
                    &mut tp_sum,
                )
            }
        }
    }
}

fn check_dims(ws: Dims, acts: Dims) -> Result<(), LayerError> {
    match ws == acts {
        true => Ok(()),
        false => Err(LayerError::Config(format!(
            "workspace built for micro-batch {ws:?}, activations for {acts:?}"
        ))),
    }
}

#[path = "block_dropout.rs"]
mod block_dropout;

#[cfg(test)]
#[path = "block_tests.rs"]
mod tests;
