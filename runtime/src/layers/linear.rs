//! Column- and row-parallel linear layers (Megatron-LM, Shoeybi et al. 2019, §3).
//!
//! Weights are stored `(out, in)` (PyTorch convention) and applied as `y = x · Wᵀ + b`.
//! - [`ColumnParallelLinear`]: rank r holds output rows `[r·n/t, (r+1)·n/t)`; forward needs no
//!   communication and yields the local output columns; backward all-reduces `dx`
//!   (`copy_to_tp`). Several projections of the same input (q/k/v, gate/up) can be FUSED: each
//!   part is its own named, separately sharded tensor, but their local shards are adjacent in
//!   the flat buffer, so one gemm computes `[part0_local | part1_local | …]`.
//! - [`RowParallelLinear`]: rank r holds input columns `[r·k/t, (r+1)·k/t)`; forward
//!   all-reduces the partial `y` (`reduce_from_tp`) and adds the (replicated) bias once after it.
//!
//! This module must not allocate in forward/backward (but for QLoRA's dequantized weight,
//! [`super::nf4_base`]).

use std::sync::Arc;

use crate::backend::{Backend, Collective};
use crate::params::{Init, ParamLayout, ParamRef, ParamSpec, Shard};

use super::lora::Adapter;
use super::nf4_base::Nf4Weights;
use super::tp::{copy_to_tp_backward, reduce_from_tp_forward, TpShard};
use super::wgrad::WeightStash;
use super::LayerError;

/// `y_local (N, out_local) = x (N, in) · W_localᵀ + b_local`.
#[derive(Debug, Clone)]
pub struct ColumnParallelLinear {
    /// `(out_local, in)`; for a fused layer the parts' shards stacked.
    pub w: ParamRef,
    /// `(out_local)`.
    pub b: Option<ParamRef>,
    pub in_features: usize,
    pub out_local: usize,
    /// The weight and bias are frozen (adapter fine-tuning): no gradient is computed for them.
    pub frozen: bool,
    /// LoRA adapters added to the output ([`super::lora`]): one, or one per adapted part of a
    /// fused projection.
    pub lora: Vec<Adapter>,
    /// QLoRA: the weight is held in NF4 here, not in the flat buffer (`w` is empty).
    pub nf4: Option<Arc<Nf4Weights>>,
}

fn weight_spec(name: String, shape: [usize; 2], shard: Shard, std: f32) -> ParamSpec {
    ParamSpec {
        name,
        global_shape: shape.to_vec(),
        shard,
        decay: true,
        init: Init::Normal { std },
    }
}

fn bias_spec(name: String, len: usize, shard: Shard) -> ParamSpec {
    ParamSpec {
        name,
        global_shape: vec![len],
        shard,
        decay: false,
        init: Init::Const(0.0),
    }
}

impl ColumnParallelLinear {
    /// Registers `{name}.weight (out, in)` and optionally `{name}.bias (out)`, split on `out`.
    pub fn new(
        layout: &mut ParamLayout,
        name: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        tp: TpShard,
        std: f32,
    ) -> Result<Self, LayerError> {
        Self::fused(layout, &[(name, out_features)], in_features, bias, tp, std)
    }

    /// Several column-parallel projections of one input: `parts = [(name, out_features)]`.
    /// Registers every `{name}.weight` (then every `{name}.bias`), each split on its own `out`.
    pub fn fused(
        layout: &mut ParamLayout,
        parts: &[(&str, usize)],
        in_features: usize,
        bias: bool,
        tp: TpShard,
        std: f32,
    ) -> Result<Self, LayerError> {
        let mut w: Option<ParamRef> = None;
        let mut out_local = 0;
        let mut nf4 = Vec::new();
        for &(name, out) in parts {
            out_local += tp
                .split(out, "output features of a column-parallel linear")?
                .1;
            let spec = weight_spec(
                format!("{name}.weight"),
                [out, in_features],
                tp.shard(0),
                std,
            );
            let r = add_weight(layout, &mut nf4, spec)?;
            w = Some(w.map_or(r, |w| w.join(r)));
        }
        let mut b: Option<ParamRef> = None;
        if bias {
            for &(name, out) in parts {
                let r = layout.add(bias_spec(format!("{name}.bias"), out, tp.shard(0)))?;
                b = Some(b.map_or(r, |b| b.join(r)));
            }
        }
        Ok(Self {
            w: w.ok_or_else(|| {
                LayerError::Config("a fused linear needs at least one part".into())
            })?,
            b,
            in_features,
            out_local,
            frozen: layout.freezing(),
            lora: Vec::new(),
            nf4: nf4_weights(nf4),
        })
    }

    /// A bias-free layer on an existing weight `(out_local, in)`, e.g. the LM head tied to the
    /// vocab-parallel embedding table. Its gradient accumulates into the same flat slots.
    pub fn tied(w: ParamRef, in_features: usize) -> Self {
        assert_eq!(
            w.len % in_features,
            0,
            "tied weight is not (out, {in_features})"
        );
        Self {
            w,
            b: None,
            in_features,
            out_local: w.len / in_features,
            frozen: false,
            lora: Vec::new(),
            nf4: None,
        }
    }

    /// The layer restricted to its first `rows` local outputs (rows of `W_local`, contiguous):
    /// the output layer over the real rows of a padded vocabulary. Bias-free layers only.
    pub fn first_rows(mut self, rows: usize) -> Self {
        assert!(
            self.b.is_none() && rows <= self.out_local,
            "first_rows of a biased layer"
        );
        self.w.len = rows * self.in_features;
        self.out_local = rows;
        self
    }

    /// `y (N, out_local) = x (N, in) · W_localᵀ + b` (forward of `copy_to_tp` is the identity).
    pub fn forward<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
        mut y: B::Mut<'_>,
    ) -> Result<(), LayerError> {
        self.forward_matmul(be, p, x, B::rb(&mut y))?;
        if let Some(b) = self.b {
            be.add_bias(y, b.view::<B>(p))?;
        }
        Ok(())
    }

    /// `y = x · W_localᵀ` without the bias, for a caller that adds it in a fused kernel (the
    /// MLP's bias + GELU).
    pub fn forward_matmul<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
        y: B::Mut<'_>,
    ) -> Result<(), LayerError> {
        let (k, m) = (self.in_features, self.out_local);
        matmul_forward(be, p, x, y, self.weight(), k, m, &self.lora)
    }

    /// `dW += dyᵀ·x`, `db += Σ dy`, `dx (N, in) = all_reduce(dy · W_local)` (overwritten).
    pub fn backward<B: Backend, C: Collective<B> + ?Sized>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        g: B::Mut<'_>,
        x: B::Ref<'_>,
        dy: B::Ref<'_>,
        mut dx: B::Mut<'_>,
        comm: &C,
    ) -> Result<(), LayerError> {
        self.backward_partial(be, p, g, x, dy, B::rb(&mut dx))?;
        copy_to_tp_backward(comm, dx)?;
        Ok(())
    }

    /// [`backward`](Self::backward) without the all-reduce: `dx` is this rank's partial sum
    /// (sequence parallelism reduce-scatters it instead).
    pub fn backward_partial<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        g: B::Mut<'_>,
        x: B::Ref<'_>,
        dy: B::Ref<'_>,
        dx: B::Mut<'_>,
    ) -> Result<(), LayerError> {
        self.backward_split(be, p, g, x, dy, dx, None)
    }

    /// [`backward_partial`](Self::backward_partial), the weight and bias gradients deferred
    /// to `defer` when given (the B pass of a zero-bubble schedule, [`super::wgrad`]).
    pub fn backward_split<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        g: B::Mut<'_>,
        x: B::Ref<'_>,
        dy: B::Ref<'_>,
        dx: B::Mut<'_>,
        defer: Option<&mut WeightStash<B>>,
    ) -> Result<(), LayerError> {
        let (k, m) = (self.in_features, self.out_local);
        let weights = Weights::of(self.weight(), self.b, self.frozen, &self.lora);
        matmul_backward(be, p, g, x, dy, dx, weights, k, m, defer)
    }

    /// [`backward_split`](Self::backward_split) without the bias gradient, for a caller that
    /// sums it in a fused kernel (GELU's backward) when it does not defer.
    pub fn backward_matmuls<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        g: B::Mut<'_>,
        x: B::Ref<'_>,
        dy: B::Ref<'_>,
        dx: B::Mut<'_>,
        defer: Option<&mut WeightStash<B>>,
    ) -> Result<(), LayerError> {
        let (k, m) = (self.in_features, self.out_local);
        let weights = Weights::of(self.weight(), None, self.frozen, &self.lora);
        matmul_backward(be, p, g, x, dy, dx, weights, k, m, defer)
    }
}

/// `y (N, out) = all_reduce(x_local (N, in_local) · W_localᵀ) + b`.
#[derive(Debug, Clone)]
pub struct RowParallelLinear {
    /// `(out, in_local)`.
    pub w: ParamRef,
    /// `(out)`, replicated on every TP rank.
    pub b: Option<ParamRef>,
    pub in_local: usize,
    pub out_features: usize,
    /// The weight and bias are frozen (adapter fine-tuning): no gradient is computed for them.
    pub frozen: bool,
    /// LoRA adapters added to this rank's partial output ([`super::lora`]).
    pub lora: Vec<Adapter>,
    /// QLoRA: the weight is held in NF4 here, not in the flat buffer (`w` is empty).
    pub nf4: Option<Arc<Nf4Weights>>,
}

impl RowParallelLinear {
    /// Registers `{name}.weight (out, in)` split on `in`, and optionally a replicated
    /// `{name}.bias (out)`.
    pub fn new(
        layout: &mut ParamLayout,
        name: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        tp: TpShard,
        std: f32,
    ) -> Result<Self, LayerError> {
        let (_, in_local) = tp.split(in_features, "input features of a row-parallel linear")?;
        let spec = weight_spec(
            format!("{name}.weight"),
            [out_features, in_features],
            tp.shard(1),
            std,
        );
        let mut nf4 = Vec::new();
        let w = add_weight(layout, &mut nf4, spec)?;
        let b = if bias {
            Some(layout.add(bias_spec(
                format!("{name}.bias"),
                out_features,
                Shard::Replicated,
            ))?)
        } else {
            None
        };
        Ok(Self {
            w,
            b,
            in_local,
            out_features,
            frozen: layout.freezing(),
            lora: Vec::new(),
            nf4: nf4_weights(nf4),
        })
    }

    /// `y = reduce_from_tp(x_local · W_localᵀ) + b`; identical on every TP rank.
    pub fn forward<B: Backend, C: Collective<B> + ?Sized>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
        mut y: B::Mut<'_>,
        comm: &C,
    ) -> Result<(), LayerError> {
        self.forward_partial(be, p, x, B::rb(&mut y))?;
        reduce_from_tp_forward(comm, B::rb(&mut y))?;
        self.add_bias(be, p, y)
    }

    /// `y = x_local · W_localᵀ`: this rank's partial sum, before the reduction and the bias
    /// (sequence parallelism reduce-scatters it, then calls [`add_bias`](Self::add_bias)).
    pub fn forward_partial<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
        y: B::Mut<'_>,
    ) -> Result<(), LayerError> {
        let (k, m) = (self.in_local, self.out_features);
        matmul_forward(be, p, x, y, self.weight(), k, m, &self.lora)
    }

    /// `y += b` on the reduced output (rows of any count).
    pub fn add_bias<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        y: B::Mut<'_>,
    ) -> Result<(), LayerError> {
        if let Some(b) = self.b {
            be.add_bias(y, b.view::<B>(p))?;
        }
        Ok(())
    }

    /// `dW += dyᵀ·x_local`, `db += Σ dy`, `dx_local = dy · W_local` (overwritten; no comm:
    /// `dy` is replicated, the backward of `reduce_from_tp` is the identity).
    pub fn backward<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        g: B::Mut<'_>,
        x: B::Ref<'_>,
        dy: B::Ref<'_>,
        dx: B::Mut<'_>,
    ) -> Result<(), LayerError> {
        self.backward_split(be, p, g, x, dy, dx, None)
    }

    /// [`backward`](Self::backward), the weight and bias gradients deferred to `defer` when
    /// given ([`super::wgrad`]).
    pub fn backward_split<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        g: B::Mut<'_>,
        x: B::Ref<'_>,
        dy: B::Ref<'_>,
        dx: B::Mut<'_>,
        defer: Option<&mut WeightStash<B>>,
    ) -> Result<(), LayerError> {
        let (k, m) = (self.in_local, self.out_features);
        let weights = Weights::of(self.weight(), self.b, self.frozen, &self.lora);
        matmul_backward(be, p, g, x, dy, dx, weights, k, m, defer)
    }
}

/// Registers a weight, or, while the layout builds QLoRA's NF4 linears, only describes it into
/// `nf4` (it takes no room in the flat buffer; its `ParamRef` is empty).
fn add_weight(
    layout: &mut ParamLayout,
    nf4: &mut Vec<crate::params::ParamInfo>,
    spec: ParamSpec,
) -> Result<ParamRef, LayerError> {
    if !layout.nf4_linears() {
        return Ok(layout.add(spec)?);
    }
    nf4.push(ParamLayout::describe(spec)?);
    Ok(ParamRef { offset: 0, len: 0 })
}

impl ColumnParallelLinear {
    fn weight(&self) -> Weight<'_> {
        Weight::of(self.w, self.nf4.as_deref())
    }
}

impl RowParallelLinear {
    fn weight(&self) -> Weight<'_> {
        Weight::of(self.w, self.nf4.as_deref())
    }
}

fn nf4_weights(parts: Vec<crate::params::ParamInfo>) -> Option<Arc<Nf4Weights>> {
    (!parts.is_empty()).then(|| Arc::new(Nf4Weights::new(parts)))
}

/// Where a linear's weight is: the flat buffer, or NF4 storage (QLoRA).
#[derive(Clone, Copy)]
enum Weight<'a> {
    Flat(ParamRef),
    Nf4(&'a Nf4Weights),
}

impl<'a> Weight<'a> {
    fn of(w: ParamRef, nf4: Option<&'a Nf4Weights>) -> Self {
        nf4.map_or(Weight::Flat(w), Weight::Nf4)
    }
}

/// `y (N, m) = x (N, k) · Wᵀ`, plus each adapter's `s·(x·Aᵀ)·Bᵀ`.
#[allow(clippy::too_many_arguments)]
fn matmul_forward<B: Backend>(
    be: &B,
    p: B::Ref<'_>,
    x: B::Ref<'_>,
    mut y: B::Mut<'_>,
    w: Weight<'_>,
    k: usize,
    m: usize,
    lora: &[Adapter],
) -> Result<(), LayerError> {
    let n = B::len(x) / k;
    match w {
        Weight::Flat(w) => be.matmul_bt(B::rb(&mut y), x, w.view::<B>(p), n, k, m, false)?,
        Weight::Nf4(q) => q.forward::<B>(be, x, B::rb(&mut y), k, m)?,
    }
    for l in lora {
        l.forward::<B>(be, p, x, B::rb(&mut y))?;
    }
    Ok(())
}

/// What a linear's backward touches.
struct Weights<'a> {
    w: Weight<'a>,
    /// The bias whose gradient the backward sums (none where a fused kernel does).
    b: Option<ParamRef>,
    /// No gradient for `w` and `b` (the weight-gradient GEMM is skipped).
    frozen: bool,
    lora: &'a [Adapter],
}

impl<'a> Weights<'a> {
    fn of(w: Weight<'a>, b: Option<ParamRef>, frozen: bool, lora: &'a [Adapter]) -> Self {
        Self { w, b, frozen, lora }
    }
}

/// `dW += dyᵀ·x` and `db += Σ dy` unless frozen (deferred to `defer` when given); `dx (N, k) =
/// dy · W` (overwritten), plus the adapters' gradients and their part of `dx`.
#[allow(clippy::too_many_arguments)]
fn matmul_backward<B: Backend>(
    be: &B,
    p: B::Ref<'_>,
    mut g: B::Mut<'_>,
    x: B::Ref<'_>,
    dy: B::Ref<'_>,
    mut dx: B::Mut<'_>,
    t: Weights<'_>,
    k: usize,
    m: usize,
    defer: Option<&mut WeightStash<B>>,
) -> Result<(), LayerError> {
    let n = B::len(x) / k;
    match t.w {
        Weight::Flat(w) => {
            match (t.frozen, defer) {
                (true, _) => {}
                (false, Some(stash)) => stash.push(be, w, t.b, x, dy, k, m)?,
                (false, None) => {
                    be.matmul_at(w.view_mut::<B>(B::rb(&mut g)), dy, x, m, n, k, true)?;
                    if let Some(b) = t.b {
                        be.bias_backward(b.view_mut::<B>(B::rb(&mut g)), dy)?;
                    }
                }
            }
            be.matmul(B::rb(&mut dx), dy, w.view::<B>(p), n, m, k, false)?;
        }
        // Only a frozen base is stored in NF4 (`ParamLayout::nf4_linears` is set with adapters).
        Weight::Nf4(q) => q.input_grad::<B>(be, dy, B::rb(&mut dx), k, m)?,
    }
    for l in t.lora {
        l.backward::<B>(be, p, B::rb(&mut g), x, dy, B::rb(&mut dx))?;
    }
    Ok(())
}

#[cfg(test)]
#[path = "linear_tests.rs"]
mod tests;
