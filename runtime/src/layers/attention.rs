//! Self-attention split by heads across the TP group (Megatron-LM).
//!
//! q, k and v are one fused column-parallel projection (parts `q`, `k`, `v`, each split on its
//! heads), so rank r computes q heads `[r·H/t, (r+1)·H/t)` and kv heads `[r·KV/t, (r+1)·KV/t)`
//! and runs causal GQA attention on them with no communication; the output projection `o` is
//! row-parallel and all-reduces. RoPE, when on, rotates q and k after the projection.
//! Both H and KV must be divisible by t (no kv-head replication for MQA with t > KV).
//! This module must not own activations or allocate in forward/backward.

use crate::comm::Comm;
use crate::cpu::{self, AttnShape};
use crate::params::{ParamLayout, ParamRef};

use super::linear::{ColumnParallelLinear, RowParallelLinear};
use super::tp::{copy_to_tp_backward, reduce_from_tp_forward, TpShard};
use super::{BlockConfig, Dims, LayerError};

/// RoPE tables for sequences of `t` positions, heads of size `hd`.
#[derive(Debug, Clone)]
pub struct RopeTables {
    /// `(t, hd/2)` each.
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub t: usize,
    pub hd: usize,
}

impl RopeTables {
    pub fn new(t: usize, hd: usize, theta: f64) -> Self {
        let (cos, sin) = cpu::rope_tables(t, hd, theta);
        Self { cos, sin, t, hd }
    }
}

/// Gradient temporaries of one attention backward.
#[derive(Debug, Clone)]
pub struct AttnGrads {
    /// `(N, W)`.
    pub dqkv: Vec<f32>,
    /// `(N, hq·hd)`.
    pub dy: Vec<f32>,
    pub scratch: Vec<f32>,
    /// `(hkv·hd)`: the key-bias gradient kept across the qkv backward.
    pub k_bias: Vec<f32>,
}

impl AttnGrads {
    pub fn new(s: &AttnShape) -> Self {
        let n = s.b * s.t;
        Self {
            dqkv: vec![0.0; n * s.qkv_width()],
            dy: vec![0.0; n * s.y_width()],
            scratch: vec![0.0; cpu::attention_scratch_len(s)],
            k_bias: vec![0.0; s.hkv * s.hd],
        }
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

    fn rope_check<'a>(&self, rope: Option<&'a RopeTables>, d: Dims) -> Option<&'a RopeTables> {
        if !self.rope {
            return None;
        }
        let r = rope.expect("RoPE attention needs RoPE tables");
        assert!(
            r.t == d.t && r.hd == self.hd,
            "RoPE tables built for another shape"
        );
        Some(r)
    }

    /// `x (N, C)` → `qkv (N, W)` (rotated), `att (B, hq, T, T)`, `y (N, hq·hd)`, and
    /// `out (N, C) = all_reduce(y · Woᵀ) + bo`.
    pub fn forward(
        &self,
        p: &[f32],
        x: &[f32],
        qkv: &mut [f32],
        att: &mut [f32],
        y: &mut [f32],
        out: &mut [f32],
        rope: Option<&RopeTables>,
        d: Dims,
        comm: &dyn Comm,
    ) -> Result<(), LayerError> {
        self.forward_partial(p, x, qkv, att, y, out, rope, d);
        reduce_from_tp_forward(comm, out)?;
        self.proj.add_bias(p, out);
        Ok(())
    }

    /// [`forward`](Self::forward) up to the output projection's partial sum: `out` is
    /// `y · Wo_localᵀ` before the TP reduction and the bias (sequence parallelism).
    pub fn forward_partial(
        &self,
        p: &[f32],
        x: &[f32],
        qkv: &mut [f32],
        att: &mut [f32],
        y: &mut [f32],
        out: &mut [f32],
        rope: Option<&RopeTables>,
        d: Dims,
    ) {
        let s = self.shape(d);
        self.qkv.forward(p, x, qkv);
        if let Some(r) = self.rope_check(rope, d) {
            cpu::rope_forward(
                qkv,
                d.t,
                s.qkv_width(),
                self.hq + self.hkv,
                self.hd,
                &r.cos,
                &r.sin,
            );
        }
        cpu::attention_forward(y, att, qkv, s);
        self.proj.forward_partial(p, y, out);
    }

    /// Selective recompute: the probabilities alone, by the same code as the forward.
    pub fn recompute_probs(&self, qkv: &[f32], att: &mut [f32], d: Dims) {
        cpu::attention_probs(att, qkv, self.shape(d));
    }

    /// Gradients of [`forward`](Self::forward): `dx (N, C)` overwritten (all-reduced over TP),
    /// parameter gradients accumulated into `g`.
    pub fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        x: &[f32],
        qkv: &[f32],
        att: &[f32],
        y: &[f32],
        dout: &[f32],
        dx: &mut [f32],
        gr: &mut AttnGrads,
        rope: Option<&RopeTables>,
        d: Dims,
        comm: &dyn Comm,
    ) -> Result<(), LayerError> {
        self.backward_partial(p, g, x, qkv, att, y, dout, dx, gr, rope, d);
        copy_to_tp_backward(comm, dx)?;
        Ok(())
    }

    /// [`backward`](Self::backward) without the final all-reduce: `dx` is this rank's
    /// partial sum (sequence parallelism reduce-scatters it instead).
    pub fn backward_partial(
        &self,
        p: &[f32],
        g: &mut [f32],
        x: &[f32],
        qkv: &[f32],
        att: &[f32],
        y: &[f32],
        dout: &[f32],
        dx: &mut [f32],
        gr: &mut AttnGrads,
        rope: Option<&RopeTables>,
        d: Dims,
    ) {
        let s = self.shape(d);
        self.proj.backward(p, g, y, dout, &mut gr.dy);
        cpu::attention_backward(&mut gr.dqkv, &mut gr.scratch, &gr.dy, qkv, att, s);
        if let Some(r) = self.rope_check(rope, d) {
            cpu::rope_backward(
                &mut gr.dqkv,
                d.t,
                s.qkv_width(),
                self.hq + self.hkv,
                self.hd,
                &r.cos,
                &r.sin,
            );
        }
        if let Some(kb) = self.k_bias {
            gr.k_bias.copy_from_slice(kb.of(g));
        }
        self.qkv.backward_partial(p, g, x, &gr.dqkv, dx);
        if let Some(kb) = self.k_bias {
            kb.of_mut(g).copy_from_slice(&gr.k_bias);
        }
    }
}
