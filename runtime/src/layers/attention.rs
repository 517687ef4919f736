//! Self-attention split by heads across the TP group (Megatron-LM).
//!
//! q, k and v are one fused column-parallel projection (parts `q`, `k`, `v`, each split on its
//! heads), so rank r computes q heads `[r·H/t, (r+1)·H/t)` and kv heads `[r·KV/t, (r+1)·KV/t)`
//! and runs causal GQA attention on them with no communication; the output projection `o` is
//! row-parallel and all-reduces. RoPE, when on, rotates q and k after the projection.
//! Both H and KV must be divisible by t (no kv-head replication for MQA with t > KV).
//! With context parallelism (`context_parallel`), the rank holds `T/CP` tokens of each sequence
//! and the attention itself is ring attention over the CP group ([`CpRing`]), which keeps the
//! log-sum-exp as its saved state.
//! This module must not own activations or allocate in forward/backward.

use crate::backend::rope_tables::rope_tables_scaled;
use crate::backend::{AttnMask, AttnShape, Backend, Collective, RopeShape, Storage};
use crate::params::{ParamLayout, ParamRef};

use super::context_parallel::CpRing;
use super::dropout::Site;
use super::linear::{ColumnParallelLinear, RowParallelLinear};
use super::tp::{copy_to_tp_backward, reduce_from_tp_forward, TpShard};
use super::wgrad::WeightStash;
use super::{BlockConfig, Dims, LayerError};

/// RoPE tables for sequences of `t` positions, heads of size `hd`, on the backend.
#[derive(Debug, Clone)]
pub struct RopeTables<B: Backend> {
    /// `(t, hd/2)` each.
    pub cos: B::Buf,
    pub sin: B::Buf,
    pub t: usize,
    pub hd: usize,
}

impl<B: Backend> RopeTables<B> {
    pub fn new(be: &B, t: usize, hd: usize, theta: f64) -> Result<Self, LayerError> {
        Self::scaled(be, t, hd, theta, None)
    }

    /// [`RopeTables::new`] with the model's frequency scaling (`rope_scaling`).
    pub fn scaled(
        be: &B,
        t: usize,
        hd: usize,
        theta: f64,
        scaling: Option<&tessera_planner::model::RopeScaling>,
    ) -> Result<Self, LayerError> {
        let (cos, sin) = rope_tables_scaled(t, hd, theta, scaling);
        Ok(Self {
            cos: be.upload(Storage::F32, &cos)?,
            sin: be.upload(Storage::F32, &sin)?,
            t,
            hd,
        })
    }

    /// Tables whose row `i` is global position `positions[i]` (a context-parallel rank's
    /// tokens, `context_parallel::cp_positions`), for sequences of `positions.len()` tokens.
    pub fn at_positions(
        be: &B,
        positions: &[usize],
        hd: usize,
        theta: f64,
        scaling: Option<&tessera_planner::model::RopeScaling>,
    ) -> Result<Self, LayerError> {
        let full = positions.iter().max().map_or(0, |m| m + 1);
        let (cos, sin) = rope_tables_scaled(full, hd, theta, scaling);
        let h = hd / 2;
        let pick = |table: &[f32]| -> Vec<f32> {
            positions
                .iter()
                .flat_map(|&p| table[p * h..(p + 1) * h].iter().copied())
                .collect()
        };
        Ok(Self {
            cos: be.upload(Storage::F32, &pick(&cos))?,
            sin: be.upload(Storage::F32, &pick(&sin))?,
            t: positions.len(),
            hd,
        })
    }
}

/// Gradient temporaries of one attention backward.
#[derive(Debug, Clone)]
pub struct AttnGrads<B: Backend> {
    /// `(N, W)`.
    pub dqkv: B::Buf,
    /// `(N, hq·hd)`.
    pub dy: B::Buf,
    pub scratch: B::Buf,
    /// `(hkv·hd)`: the key-bias gradient kept across the qkv backward.
    pub k_bias: B::Buf,
}

impl<B: Backend> AttnGrads<B> {
    pub fn new(be: &B, s: &AttnShape) -> Result<Self, LayerError> {
        let n = s.b * s.t;
        Ok(Self {
            dqkv: be.alloc(Storage::Bf16, n * s.qkv_width())?,
            dy: be.alloc(Storage::Bf16, n * s.y_width())?,
            scratch: be.alloc(Storage::F32, be.attention_scratch_len(s))?,
            k_bias: be.alloc(Storage::F32, s.hkv * s.hd)?,
        })
    }
}

/// Causal self-attention with local heads `hq`, `hkv` of size `hd`.
#[derive(Debug, Clone)]
pub struct ParallelAttention {
    /// Fused `[q | k | v]`, `(W, C)` locally with `W = (hq + 2·hkv)·hd`.
    pub qkv: ColumnParallelLinear,
    /// `(C, hq·hd)` locally.
    pub proj: RowParallelLinear,
    pub hq: usize,
    pub hkv: usize,
    pub hd: usize,
    pub rope: bool,
    /// The local key bias, when there is one and no RoPE: its gradient is exactly zero
    /// (softmax ignores a per-query constant `q·b_k`), so backward writes zero instead of
    /// rounding noise, which AdamW would otherwise blow up into ±lr steps that differ by layout.
    k_bias: Option<ParamRef>,
    /// Context parallelism: the tokens are this rank's share of each sequence and attention
    /// runs as ring attention over the CP group (the [`CpRing`] its callers pass); set by the
    /// executor for CP > 1.
    pub context_parallel: bool,
    /// Dropout on the probabilities (`h.{l}.attn.drop`; offset and width count query heads).
    pub dropout: Site,
}

impl ParallelAttention {
    /// Registers `{prefix}.q/k/v` (column-parallel; biases when `qkv_bias` or `bias`) and
    /// `{prefix}.o` (row-parallel; bias when `bias`).
    pub fn new(
        layout: &mut ParamLayout,
        prefix: &str,
        cfg: &BlockConfig,
        tp: TpShard,
    ) -> Result<Self, LayerError> {
        let (c, heads, kv_heads, hd) = (cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim);
        let rope = cfg.rope_theta.is_some();
        if heads == 0 || kv_heads == 0 || hd == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(LayerError::Config(format!(
                "attention needs heads ({heads}), head_dim ({hd}) > 0 and kv_heads ({kv_heads}) dividing heads"
            )));
        }
        if rope && !hd.is_multiple_of(2) {
            return Err(LayerError::Config(format!(
                "RoPE needs an even head size, got {hd}"
            )));
        }
        let (_, hq) = tp.split(heads, "attention heads")?;
        let (_, hkv) = tp.split(kv_heads, "kv heads")?;
        let (q, k, v) = (
            format!("{prefix}.q"),
            format!("{prefix}.k"),
            format!("{prefix}.v"),
        );
        let parts = [
            (q.as_str(), heads * hd),
            (k.as_str(), kv_heads * hd),
            (v.as_str(), kv_heads * hd),
        ];
        let qkv_bias = cfg.qkv_bias || cfg.bias;
        let qkv = ColumnParallelLinear::fused(layout, &parts, c, qkv_bias, tp, cfg.init_std)?;
        let proj = RowParallelLinear::new(
            layout,
            &format!("{prefix}.o"),
            heads * hd,
            c,
            cfg.bias,
            tp,
            cfg.proj_init_std,
        )?;
        let k_bias = qkv.b.filter(|_| !rope).map(|b| ParamRef {
            offset: b.offset + hq * hd,
            len: hkv * hd,
        });
        Ok(Self {
            qkv,
            proj,
            hq,
            hkv,
            hd,
            rope,
            k_bias,
            context_parallel: false,
            dropout: Site::default(),
        })
    }

    pub fn shape(&self, d: Dims) -> AttnShape {
        AttnShape {
            b: d.b,
            t: d.t,
            hq: self.hq,
            hkv: self.hkv,
            hd: self.hd,
        }
    }

    /// Elements attention keeps for its backward: the backend's (`Backend::attention_saved_len`),
    /// or under context parallelism the ring's log-sum-exp `(b, hq, t)`.
    pub fn saved_len<B: Backend>(&self, be: &B, d: Dims) -> usize {
        match self.context_parallel {
            true => d.b * self.hq * d.t,
            false => be.attention_saved_len(&self.shape(d)),
        }
    }

    /// Whether selective recompute keeps the saved state (a log-sum-exp is small).
    pub fn keeps_saved<B: Backend>(&self, be: &B) -> bool {
        self.context_parallel || be.attention_keeps_saved()
    }

    fn ring<'r, B: Backend>(
        &self,
        ring: Option<&'r mut CpRing<B>>,
    ) -> Result<Option<&'r mut CpRing<B>>, LayerError> {
        match (self.context_parallel, ring) {
            (false, _) => Ok(None),
            (true, Some(r)) => Ok(Some(r)),
            (true, None) => Err(LayerError::Config(
                "context-parallel attention needs its CP group (a CpRing in the block workspace)"
                    .into(),
            )),
        }
    }

    /// The probabilities' mask for the armed micro-batch, if any.
    fn drop_mask(&self) -> Option<AttnMask> {
        self.dropout.mask().map(|m| AttnMask {
            p: m.p,
            seed: m.seed,
            stream: m.stream,
            first_sequence: m.call.first_sequence,
            head0: m.offset as usize,
            heads: m.width as usize,
        })
    }

    fn rope_check<'a, B: Backend>(
        &self,
        rope: Option<&'a RopeTables<B>>,
        d: Dims,
    ) -> Result<Option<&'a RopeTables<B>>, LayerError> {
        if !self.rope {
            return Ok(None);
        }
        match rope {
            Some(r) if r.t == d.t && r.hd == self.hd => Ok(Some(r)),
            _ => Err(LayerError::Config(format!(
                "RoPE attention needs tables for {} positions of head size {}",
                d.t, self.hd
            ))),
        }
    }

    fn rope_shape(&self, d: Dims) -> RopeShape {
        RopeShape {
            t: d.t,
            width: self.shape(d).qkv_width(),
            heads: self.hq + self.hkv,
            hd: self.hd,
        }
    }

    /// `x (N, C)` → `qkv (N, W)` (rotated), `saved` (what the backend's attention backward
    /// needs), `y (N, hq·hd)`, and `out (N, C) = all_reduce(y · Woᵀ) + bo`.
    pub fn forward<B: Backend, C: Collective<B> + ?Sized>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
        qkv: B::Mut<'_>,
        saved: B::Mut<'_>,
        y: B::Mut<'_>,
        mut out: B::Mut<'_>,
        rope: Option<&RopeTables<B>>,
        d: Dims,
        comm: &C,
    ) -> Result<(), LayerError> {
        self.forward_partial(be, p, x, qkv, saved, y, B::rb(&mut out), rope, None, d)?;
        reduce_from_tp_forward(comm, B::rb(&mut out))?;
        self.proj.add_bias(be, p, out)
    }

    /// [`forward`](Self::forward) up to the output projection's partial sum: `out` is
    /// `y · Wo_localᵀ` before the TP reduction and the bias (sequence parallelism). `ring`: the
    /// CP group's ring when the layer is context-parallel.
    pub fn forward_partial<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
        mut qkv: B::Mut<'_>,
        saved: B::Mut<'_>,
        mut y: B::Mut<'_>,
        out: B::Mut<'_>,
        rope: Option<&RopeTables<B>>,
        ring: Option<&mut CpRing<B>>,
        d: Dims,
    ) -> Result<(), LayerError> {
        self.qkv.forward(be, p, x, B::rb(&mut qkv))?;
        if let Some(r) = self.rope_check(rope, d)? {
            let (cos, sin) = (B::view(&r.cos), B::view(&r.sin));
            be.rope(B::rb(&mut qkv), self.rope_shape(d), cos, sin, false)?;
        }
        match (self.ring(ring)?, self.drop_mask()) {
            (Some(_), Some(_)) => return Err(cp_dropout()),
            (Some(r), None) => r.forward(be, B::rb(&mut y), saved, B::ro(&qkv), self.shape(d))?,
            (None, None) => {
                be.attention_forward(B::rb(&mut y), saved, B::ro(&qkv), self.shape(d))?
            }
            (None, Some(mk)) => {
                be.attention_forward_dropout(B::rb(&mut y), saved, B::ro(&qkv), self.shape(d), &mk)?
            }
        }
        self.proj.forward_partial(be, p, B::ro(&y), out)
    }

    /// Selective recompute: what attention saves, alone, by the same code as the forward.
    pub fn recompute_saved<B: Backend>(
        &self,
        be: &B,
        qkv: B::Ref<'_>,
        saved: B::Mut<'_>,
        d: Dims,
    ) -> Result<(), LayerError> {
        if self.context_parallel {
            // The ring's saved state is its log-sum-exp, which selective recompute keeps.
            return Err(LayerError::Config(
                "context-parallel attention keeps its log-sum-exp; there is nothing to recompute alone".into(),
            ));
        }
        be.attention_recompute(saved, qkv, self.shape(d))?;
        Ok(())
    }

    /// Gradients of [`forward`](Self::forward): `dx (N, C)` overwritten (all-reduced over TP),
    /// parameter gradients accumulated into `g`.
    pub fn backward<B: Backend, C: Collective<B> + ?Sized>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        g: B::Mut<'_>,
        x: B::Ref<'_>,
        qkv: B::Ref<'_>,
        saved: B::Ref<'_>,
        y: B::Ref<'_>,
        dout: B::Ref<'_>,
        mut dx: B::Mut<'_>,
        gr: &mut AttnGrads<B>,
        rope: Option<&RopeTables<B>>,
        d: Dims,
        comm: &C,
    ) -> Result<(), LayerError> {
        self.backward_partial(
            be,
            p,
            g,
            x,
            qkv,
            saved,
            y,
            dout,
            B::rb(&mut dx),
            gr,
            rope,
            None,
            d,
            None,
        )?;
        copy_to_tp_backward(comm, dx)?;
        Ok(())
    }

    /// [`backward`](Self::backward) without the final all-reduce: `dx` is this rank's
    /// partial sum (sequence parallelism reduce-scatters it instead, the block all-reduces it
    /// otherwise). `ring` as in [`forward_partial`](Self::forward_partial). With `defer`, the
    /// projections' weight and bias gradients go there for a later W pass (`super::wgrad`).
    pub fn backward_partial<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        mut g: B::Mut<'_>,
        x: B::Ref<'_>,
        qkv: B::Ref<'_>,
        saved: B::Ref<'_>,
        y: B::Ref<'_>,
        dout: B::Ref<'_>,
        dx: B::Mut<'_>,
        gr: &mut AttnGrads<B>,
        rope: Option<&RopeTables<B>>,
        ring: Option<&mut CpRing<B>>,
        d: Dims,
        mut defer: Option<&mut WeightStash<B>>,
    ) -> Result<(), LayerError> {
        let s = self.shape(d);
        let (gg, dy, dr) = (B::rb(&mut g), B::view_mut(&mut gr.dy), defer.as_deref_mut());
        self.proj.backward_split(be, p, gg, y, dout, dy, dr)?;
        match (self.ring(ring)?, self.drop_mask()) {
            (Some(_), Some(_)) => return Err(cp_dropout()),
            (Some(r), None) => r.backward(
                be,
                B::view_mut(&mut gr.dqkv),
                B::view(&gr.dy),
                qkv,
                y,
                saved,
                s,
            )?,
            (None, Some(mk)) => be.attention_backward_dropout(
                B::view_mut(&mut gr.dqkv),
                B::view_mut(&mut gr.scratch),
                B::view(&gr.dy),
                qkv,
                saved,
                s,
                &mk,
            )?,
            (None, None) => be.attention_backward(
                B::view_mut(&mut gr.dqkv),
                B::view_mut(&mut gr.scratch),
                B::view(&gr.dy),
                qkv,
                y,
                saved,
                s,
            )?,
        }
        if let Some(r) = self.rope_check(rope, d)? {
            let (cos, sin) = (B::view(&r.cos), B::view(&r.sin));
            be.rope(
                B::view_mut(&mut gr.dqkv),
                self.rope_shape(d),
                cos,
                sin,
                true,
            )?;
        }
        // A frozen bias has no gradient to protect; a deferred one is protected in the W pass.
        let k_bias = self.k_bias.filter(|_| !self.qkv.frozen);
        if let Some(stash) = defer {
            let dqkv = B::view(&gr.dqkv);
            self.qkv
                .backward_split(be, p, g, x, dqkv, dx, Some(&mut *stash))?;
            if let Some(kb) = k_bias {
                stash.keep_last(kb);
            }
            return Ok(());
        }
        if let Some(kb) = k_bias {
            be.copy(B::view_mut(&mut gr.k_bias), kb.view::<B>(B::ro(&g)))?;
        }
        self.qkv
            .backward_partial(be, p, B::rb(&mut g), x, B::view(&gr.dqkv), dx)?;
        if let Some(kb) = k_bias {
            be.copy(kb.view_mut::<B>(g), B::view(&gr.k_bias))?;
        }
        Ok(())
    }
}

fn cp_dropout() -> LayerError {
    LayerError::Config(
        "attention dropout under context parallelism (ring attention) is not implemented".into(),
    )
}
