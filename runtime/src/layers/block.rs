//! The pre-norm transformer block, tensor-parallel: `x2 = x + Attn(Norm1(x))`,
//! `out = x2 + Mlp(Norm2(x2))`, with explicit forward and backward and activation recompute.
//!
//! Activations are split in two owners so the pipeline executor controls memory:
//! - [`BlockActs`]: what ONE micro-batch keeps between its forward and its backward (the
//!   executor holds one per in-flight micro-batch and block). Its size depends on [`Recompute`]:
//!   `None` keeps everything, `Selective` drops the attention probabilities `(B, hq, T, T)`,
//!   `Full` keeps only the block input.
//! - [`BlockWorkspace`]: scratch shared by all blocks of a stage (gradient temporaries, RoPE
//!   tables, and the recomputed tensors), reused across calls.
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

use crate::comm::Comm;
use crate::params::ParamLayout;

use super::attention::{AttnGrads, ParallelAttention, RopeTables};
use super::mlp::ParallelMlp;
use super::norm::Norm;
use super::tp::{gather_rows, scatter_rows, TpShard};
use super::{BlockConfig, Dims, LayerError, Recompute};

/// The intermediate tensors of one block forward (local TP shapes, `N = B·T`).
#[derive(Debug, Clone, Default)]
struct Saved {
    ln1: Vec<f32>,      // (N, C)
    ln1_mean: Vec<f32>, // (N) LayerNorm only
    ln1_rstd: Vec<f32>, // (N)
    qkv: Vec<f32>,      // (N, (hq + 2·hkv)·hd), after RoPE
    y: Vec<f32>,        // (N, hq·hd) attention output before `o`
    x2: Vec<f32>,       // (N, C) residual after attention
    ln2: Vec<f32>,      // (N, C)
    ln2_mean: Vec<f32>, // (N)
    ln2_rstd: Vec<f32>, // (N)
    h: Vec<f32>,        // (N, f_local or 2·f_local) pre-activation
    a: Vec<f32>,        // (N, f_local)
}

impl Saved {
    /// Under sequence parallelism the norms' outputs and statistics and the residual `x2` hold
    /// this rank's rows only; the backward all-gathers the norms' outputs again (Megatron's
    /// sequence-parallel memory saving).
    fn new(b: &TransformerBlock, d: Dims) -> Self {
        let (n, c, s) = (d.n(), b.cfg.hidden, b.attn.shape(d));
        let rows = b.rows(d);
        Saved {
            ln1: vec![0.0; rows * c],
            ln1_mean: vec![0.0; b.ln1.mean_len(rows)],
            ln1_rstd: vec![0.0; rows],
            qkv: vec![0.0; n * s.qkv_width()],
            y: vec![0.0; n * s.y_width()],
            x2: vec![0.0; rows * c],
            ln2: vec![0.0; rows * c],
            ln2_mean: vec![0.0; b.ln2.mean_len(rows)],
            ln2_rstd: vec![0.0; rows],
            h: vec![0.0; n * b.mlp.h_width()],
            a: vec![0.0; n * b.mlp.f_local],
        }
    }

    fn floats(&self) -> usize {
        [
            &self.ln1,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.qkv,
            &self.y,
            &self.x2,
        ]
        .iter()
        .chain([&self.ln2, &self.ln2_mean, &self.ln2_rstd, &self.h, &self.a].iter())
        .map(|v| v.len())
        .sum()
    }
}

/// One micro-batch's saved activations for one block.
#[derive(Debug, Clone)]
pub struct BlockActs {
    pub recompute: Recompute,
    pub dims: Dims,
    /// `(rows, C)`: the block input, always kept (`rows = N`, or `N / t` under SP).
    x: Vec<f32>,
    /// Everything else, unless `Full`.
    saved: Option<Saved>,
    /// `(B, hq, T, T)` probabilities, only with `Recompute::None`.
    att: Vec<f32>,
}

impl BlockActs {
    pub fn new(block: &TransformerBlock, dims: Dims, recompute: Recompute) -> Self {
        let saved = (recompute != Recompute::Full).then(|| Saved::new(block, dims));
        let att_len = if recompute == Recompute::None {
            block.attn.shape(dims).att_len()
        } else {
            0
        };
        Self {
            recompute,
            dims,
            x: vec![0.0; block.rows(dims) * block.cfg.hidden],
            saved,
            att: vec![0.0; att_len],
        }
    }

    /// f32 elements held between forward and backward (for memory reports).
    pub fn floats(&self) -> usize {
        self.x.len() + self.att.len() + self.saved.as_ref().map_or(0, Saved::floats)
    }
}

/// Gradient temporaries of a block backward.
#[derive(Debug, Clone)]
struct Grads {
    dln: Vec<f32>, // (rows, C)
    dx2: Vec<f32>, // (rows, C)
    dh: Vec<f32>,  // like h
    da: Vec<f32>,  // like a
    attn: AttnGrads,
}

/// Scratch shared by the blocks of a stage (one micro-batch geometry).
#[derive(Debug, Clone)]
pub struct BlockWorkspace {
    pub dims: Dims,
    rope: Option<RopeTables>,
    /// Recomputed probabilities (Selective, Full), sized on first use.
    att: Vec<f32>,
    /// Recomputed tensors (Full), allocated on first use.
    saved: Option<Saved>,
    grads: Grads,
    /// Sequence parallelism only: full-row buffers for gathers and partial sums.
    sp: Option<SpScratch>,
}

/// Buffers of the sequence-parallel path, all `(N, C)`: a gathered norm output (a TP region's
/// input), a gathered output gradient, and a partial sum to reduce-scatter.
#[derive(Debug, Clone)]
struct SpScratch {
    ln: Vec<f32>,
    full_in: Vec<f32>,
    partial: Vec<f32>,
}

impl BlockWorkspace {
    pub fn new(block: &TransformerBlock, dims: Dims) -> Self {
        let (n, c, rows) = (dims.n(), block.cfg.hidden, block.rows(dims));
        Self {
            dims,
            rope: block
                .cfg
                .rope_theta
                .map(|th| RopeTables::new(dims.t, block.attn.hd, th)),
            att: Vec::new(),
            saved: None,
            sp: block.sequence_parallel.then(|| SpScratch {
                ln: vec![0.0; n * c],
                full_in: vec![0.0; n * c],
                partial: vec![0.0; n * c],
            }),
            grads: Grads {
                dln: vec![0.0; rows * c],
                dx2: vec![0.0; rows * c],
                dh: vec![0.0; n * block.mlp.h_width()],
                da: vec![0.0; n * block.mlp.f_local],
                attn: AttnGrads::new(&block.attn.shape(dims)),
            },
        }
    }
}

/// A pre-norm transformer block on one TP rank.
#[derive(Debug, Clone)]
pub struct TransformerBlock {
    pub cfg: BlockConfig,
    pub tp: TpShard,
    pub ln1: Norm,
    pub attn: ParallelAttention,
    pub ln2: Norm,
    pub mlp: ParallelMlp,
    /// Megatron sequence parallelism: activations outside the TP regions are split by rows.
    pub sequence_parallel: bool,
}

impl TransformerBlock {
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
            mlp,
            sequence_parallel: false,
        })
    }

    /// Rows of the activations this rank holds between blocks: `N`, or `N / t` under sequence
    /// parallelism.
    pub fn rows(&self, d: Dims) -> usize {
        d.rows(self.tp.size, self.sequence_parallel)
    }

    /// The forward through the MLP activation into `s` (and `att`); with `out`, also the MLP
    /// output and the second residual. Shared by forward and full recompute.
    fn forward_core(
        &self,
        p: &[f32],
        x: &[f32],
        s: &mut Saved,
        att: &mut [f32],
        rope: Option<&RopeTables>,
        d: Dims,
        comm: &dyn Comm,
        sp: Option<&mut SpScratch>,
        out: Option<&mut [f32]>,
    ) -> Result<(), LayerError> {
        if let Some(sp) = sp {
            return self.forward_core_sp(p, x, s, att, rope, d, comm, sp, out);
        }
        self.ln1
            .forward(p, x, &mut s.ln1, &mut s.ln1_mean, &mut s.ln1_rstd);
        self.attn.forward(
            p, &s.ln1, &mut s.qkv, att, &mut s.y, &mut s.x2, rope, d, comm,
        )?;
        add_assign(&mut s.x2, x);
        self.ln2
            .forward(p, &s.x2, &mut s.ln2, &mut s.ln2_mean, &mut s.ln2_rstd);
        self.mlp.forward_hidden(p, &s.ln2, &mut s.h, &mut s.a);
        if let Some(out) = out {
            self.mlp.forward_out(p, &s.a, out, comm)?;
            add_assign(out, &s.x2);
        }
        Ok(())
    }

    /// [`forward_core`](Self::forward_core) under sequence parallelism: `x`, `s.x2` and `out`
    /// hold this rank's rows; each norm's output is all-gathered into the TP region, and each
    /// region's partial output is reduce-scattered back to rows before its bias is added.
    fn forward_core_sp(
        &self,
        p: &[f32],
        x: &[f32],
        s: &mut Saved,
        att: &mut [f32],
        rope: Option<&RopeTables>,
        d: Dims,
        comm: &dyn Comm,
        sp: &mut SpScratch,
        out: Option<&mut [f32]>,
    ) -> Result<(), LayerError> {
        self.ln1
            .forward(p, x, &mut s.ln1, &mut s.ln1_mean, &mut s.ln1_rstd);
        gather_rows(comm, &s.ln1, &mut sp.ln)?;
        self.attn.forward_partial(
            p,
            &sp.ln,
            &mut s.qkv,
            att,
            &mut s.y,
            &mut sp.partial,
            rope,
            d,
        );
        scatter_rows(comm, &sp.partial, &mut s.x2)?;
        self.attn.proj.add_bias(p, &mut s.x2);
        add_assign(&mut s.x2, x);
        self.ln2
            .forward(p, &s.x2, &mut s.ln2, &mut s.ln2_mean, &mut s.ln2_rstd);
        gather_rows(comm, &s.ln2, &mut sp.ln)?;
        self.mlp.forward_hidden(p, &sp.ln, &mut s.h, &mut s.a);
        if let Some(out) = out {
            self.mlp.proj.forward_partial(p, &s.a, &mut sp.partial);
            scatter_rows(comm, &sp.partial, out)?;
            self.mlp.proj.add_bias(p, out);
            add_assign(out, &s.x2);
        }
        Ok(())
    }

    /// `out (N, C) = block(x (N, C))`, keeping in `acts` what its recompute policy says.
    pub fn forward(
        &self,
        p: &[f32],
        x: &[f32],
        out: &mut [f32],
        acts: &mut BlockActs,
        ws: &mut BlockWorkspace,
        comm: &dyn Comm,
    ) -> Result<(), LayerError> {
        let d = acts.dims;
        assert_eq!(
            ws.dims, d,
            "workspace built for another micro-batch geometry"
        );
        acts.x.copy_from_slice(x);
        let BlockWorkspace {
            rope,
            att: ws_att,
            saved: ws_saved,
            sp,
            ..
        } = ws;
        let att_len = self.attn.shape(d).att_len();
        let (s, att) = match (acts.recompute, acts.saved.as_mut()) {
            (Recompute::None, Some(s)) => (s, &mut acts.att[..]),
            (Recompute::Selective, Some(s)) => (s, sized(ws_att, att_len)),
            _ => (
                ws_saved.get_or_insert_with(|| Saved::new(self, d)),
                sized(ws_att, att_len),
            ),
        };
        self.forward_core(p, x, s, att, rope.as_ref(), d, comm, sp.as_mut(), Some(out))
    }

    /// Given `dout (N, C)`, writes `dx (N, C)` and accumulates parameter gradients into `g`.
    pub fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        dout: &[f32],
        dx: &mut [f32],
        acts: &BlockActs,
        ws: &mut BlockWorkspace,
        comm: &dyn Comm,
    ) -> Result<(), LayerError> {
        let d = acts.dims;
        assert_eq!(
            ws.dims, d,
            "workspace built for another micro-batch geometry"
        );
        let BlockWorkspace {
            rope,
            att: ws_att,
            saved: ws_saved,
            grads: gr,
            sp,
            ..
        } = ws;
        let rope = rope.as_ref();
        let att_len = self.attn.shape(d).att_len();
        let (s, att): (&Saved, &[f32]) = match (acts.recompute, acts.saved.as_ref()) {
            (Recompute::None, Some(s)) => (s, &acts.att),
            (Recompute::Selective, Some(s)) => {
                let att = sized(ws_att, att_len);
                self.attn.recompute_probs(&s.qkv, att, d);
                (s, att)
            }
            _ => {
                let s = ws_saved.get_or_insert_with(|| Saved::new(self, d));
                let att = sized(ws_att, att_len);
                self.forward_core(p, &acts.x, s, att, rope, d, comm, sp.as_mut(), None)?;
                (s, att)
            }
        };
        if let Some(sp) = sp.as_mut() {
            return self.backward_sp(p, g, dout, dx, acts, s, att, gr, sp, rope, d, comm);
        }
        let dln = &mut gr.dln;
        self.mlp.backward(
            p, g, &s.ln2, &s.h, &s.a, dout, dln, &mut gr.dh, &mut gr.da, comm,
        )?;
        gr.dx2.copy_from_slice(dout);
        self.ln2
            .backward(p, g, dln, &s.x2, &s.ln2_mean, &s.ln2_rstd, &mut gr.dx2);
        self.attn.backward(
            p,
            g,
            &s.ln1,
            &s.qkv,
            att,
            &s.y,
            &gr.dx2,
            dln,
            &mut gr.attn,
            rope,
            d,
            comm,
        )?;
        dx.copy_from_slice(&gr.dx2);
        self.ln1
            .backward(p, g, dln, &acts.x, &s.ln1_mean, &s.ln1_rstd, dx);
        Ok(())
    }
}

impl TransformerBlock {
    /// The backward under sequence parallelism: `dout` and `dx` hold this rank's rows. Each TP
    /// region's output gradient and its saved input (the norm's output) are all-gathered, and
    /// its partial input gradient reduce-scattered to rows before the norm's backward. The
    /// norms' weight gradients come from this rank's rows only; the executor sums them over TP
    /// after the step.
    fn backward_sp(
        &self,
        p: &[f32],
        g: &mut [f32],
        dout: &[f32],
        dx: &mut [f32],
        acts: &BlockActs,
        s: &Saved,
        att: &[f32],
        gr: &mut Grads,
        sp: &mut SpScratch,
        rope: Option<&RopeTables>,
        d: Dims,
        comm: &dyn Comm,
    ) -> Result<(), LayerError> {
        gather_rows(comm, dout, &mut sp.full_in)?;
        gather_rows(comm, &s.ln2, &mut sp.ln)?;
        self.mlp.backward_partial(
            p,
            g,
            &sp.ln,
            &s.h,
            &s.a,
            &sp.full_in,
            &mut sp.partial,
            &mut gr.dh,
            &mut gr.da,
        );
        scatter_rows(comm, &sp.partial, &mut gr.dln)?;
        gr.dx2.copy_from_slice(dout);
        self.ln2
            .backward(p, g, &gr.dln, &s.x2, &s.ln2_mean, &s.ln2_rstd, &mut gr.dx2);
        gather_rows(comm, &gr.dx2, &mut sp.full_in)?;
        gather_rows(comm, &s.ln1, &mut sp.ln)?;
        self.attn.backward_partial(
            p,
            g,
            &sp.ln,
            &s.qkv,
            att,
            &s.y,
            &sp.full_in,
            &mut sp.partial,
            &mut gr.attn,
            rope,
            d,
        );
        scatter_rows(comm, &sp.partial, &mut gr.dln)?;
        dx.copy_from_slice(&gr.dx2);
        self.ln1
            .backward(p, g, &gr.dln, &acts.x, &s.ln1_mean, &s.ln1_rstd, dx);
        Ok(())
    }
}

/// `v` grown (once) to `len` elements.
fn sized(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}

fn add_assign(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
}

#[cfg(test)]
#[path = "block_tests.rs"]
mod tests;
