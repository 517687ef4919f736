//! Feed-forward block split across the TP group: column-parallel up projection (GELU: `fc`;
//! SwiGLU: fused `gate` and `up`, both column-parallel), local activation, row-parallel down
//! projection `proj` with the all-reduce. Must not own activations or allocate.

use crate::backend::{Backend, Collective};
use crate::params::ParamLayout;

use super::linear::{ColumnParallelLinear, RowParallelLinear};
use super::tp::{copy_to_tp_backward, TpShard};
use super::wgrad::WeightStash;
use super::{Activation, LayerError};

/// `out = proj(act(fc(x)))` with hidden size `f_local = ffn / t` on this rank.
#[derive(Debug, Clone)]
pub struct ParallelMlp {
    /// GELU: `(f_local, C)`; SwiGLU: `[gate; up]`, `(2·f_local, C)`.
    pub fc: ColumnParallelLinear,
    /// `(C, f_local)`.
    pub proj: RowParallelLinear,
    pub act: Activation,
    pub f_local: usize,
}

impl ParallelMlp {
    /// Registers `{prefix}.fc` (or `{prefix}.gate` + `{prefix}.up`) and `{prefix}.proj`.
    pub fn new(
        layout: &mut ParamLayout,
        prefix: &str,
        c: usize,
        ffn: usize,
        act: Activation,
        bias: bool,
        tp: TpShard,
        std: f32,
        proj_std: f32,
    ) -> Result<Self, LayerError> {
        let (_, f_local) = tp.split(ffn, "ffn_hidden")?;
        let fc = match act {
            Activation::Gelu => {
                ColumnParallelLinear::new(layout, &format!("{prefix}.fc"), c, ffn, bias, tp, std)?
            }
            Activation::SwiGlu => {
                let (gate, up) = (format!("{prefix}.gate"), format!("{prefix}.up"));
                ColumnParallelLinear::fused(layout, &[(&gate, ffn), (&up, ffn)], c, bias, tp, std)?
            }
        };
        let proj = RowParallelLinear::new(
            layout,
            &format!("{prefix}.proj"),
            ffn,
            c,
            bias,
            tp,
            proj_std,
        )?;
        Ok(Self {
            fc,
            proj,
            act,
            f_local,
        })
    }

    /// Row width of the pre-activation `h`.
    pub fn h_width(&self) -> usize {
        self.fc.out_local
    }

    /// `h (N, h_width) = fc(x (N, C))`, `a (N, f_local) = act(h)`.
    pub fn forward_hidden<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
        mut h: B::Mut<'_>,
        a: B::Mut<'_>,
    ) -> Result<(), LayerError> {
        match self.act {
            // The bias and GELU in one kernel on a device (`Backend::bias_gelu_forward`).
            Activation::Gelu => {
                self.fc.forward_matmul(be, p, x, B::rb(&mut h))?;
                be.bias_gelu_forward(h, a, self.fc.b.map(|b| b.view::<B>(p)))?
            }
            Activation::SwiGlu => {
                self.fc.forward(be, p, x, B::rb(&mut h))?;
                be.swiglu_forward(a, B::ro(&h), self.f_local)?
            }
        }
        Ok(())
    }

    /// `out (N, C) = all_reduce(a · W_projᵀ) + b`.
    pub fn forward_out<B: Backend, C: Collective<B> + ?Sized>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        a: B::Ref<'_>,
        out: B::Mut<'_>,
        comm: &C,
    ) -> Result<(), LayerError> {
        self.proj.forward(be, p, a, out, comm)
    }

    /// `dx (N, C)` overwritten (all-reduced over TP); `dh`, `da` are scratch of the sizes of
    /// `h` and `a`; parameter gradients accumulate into `g`.
    pub fn backward<B: Backend, C: Collective<B> + ?Sized>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        g: B::Mut<'_>,
        x: B::Ref<'_>,
        h: B::Ref<'_>,
        a: B::Ref<'_>,
        dout: B::Ref<'_>,
        mut dx: B::Mut<'_>,
        dh: B::Mut<'_>,
        da: B::Mut<'_>,
        comm: &C,
    ) -> Result<(), LayerError> {
        self.backward_partial(be, p, g, x, h, a, dout, B::rb(&mut dx), dh, da)?;
        copy_to_tp_backward(comm, dx)?;
        Ok(())
    }

    /// [`backward`](Self::backward) without the final all-reduce: `dx` is this rank's
    /// partial sum (sequence parallelism reduce-scatters it instead).
    pub fn backward_partial<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        g: B::Mut<'_>,
        x: B::Ref<'_>,
        h: B::Ref<'_>,
        a: B::Ref<'_>,
        dout: B::Ref<'_>,
        dx: B::Mut<'_>,
        dh: B::Mut<'_>,
        da: B::Mut<'_>,
    ) -> Result<(), LayerError> {
        self.backward_split(be, p, g, x, h, a, dout, dx, dh, da, None)
    }

    /// [`backward_partial`](Self::backward_partial), both linears' weight and bias gradients
    /// deferred to `defer` when given (the B pass of a zero-bubble schedule, `super::wgrad`).
    pub fn backward_split<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        mut g: B::Mut<'_>,
        x: B::Ref<'_>,
        h: B::Ref<'_>,
        a: B::Ref<'_>,
        dout: B::Ref<'_>,
        dx: B::Mut<'_>,
        mut dh: B::Mut<'_>,
        mut da: B::Mut<'_>,
        mut defer: Option<&mut WeightStash<B>>,
    ) -> Result<(), LayerError> {
        let proj = &self.proj;
        let dr = defer.as_deref_mut();
        proj.backward_split(be, p, B::rb(&mut g), a, dout, B::rb(&mut da), dr)?;
        let da = B::ro(&da);
        match self.act {
            // GELU's backward and the fc bias gradient in one kernel on a device, then the
            // fc matmuls (`Backend::gelu_backward_bias`). Deferred, the bias gradient goes
            // with the weight's to the W pass (`bias_backward` on the same `dh`).
            Activation::Gelu => {
                let fc = &self.fc;
                let db = fc.b.filter(|_| !fc.frozen && defer.is_none());
                let db = db.map(|b| b.view_mut::<B>(B::rb(&mut g)));
                be.gelu_backward_bias(B::rb(&mut dh), db, h, da)?;
                match defer {
                    None => fc.backward_matmuls(be, p, g, x, B::ro(&dh), dx, None),
                    d => fc.backward_split(be, p, g, x, B::ro(&dh), dx, d),
                }
            }
            Activation::SwiGlu => {
                be.swiglu_backward(B::rb(&mut dh), h, da, self.f_local)?;
                self.fc.backward_split(be, p, g, x, B::ro(&dh), dx, defer)
            }
        }
    }
}
