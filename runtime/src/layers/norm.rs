//! Normalisation layer (LayerNorm or RMSNorm), replicated on every TP rank.
//!
//! Its input and output gradient are replicated too (the all-reduce in the following
//! column-parallel backward makes them so), so its parameter gradients come out bitwise
//! identical on every TP rank and need no communication. Must not communicate.

use crate::backend::{Backend, Storage};
use crate::params::{Init, ParamLayout, ParamRef, ParamSpec, Shard};

use super::{LayerError, NormKind};

/// `out = norm(x) · weight (+ bias)` over the last dimension `c`.
#[derive(Debug, Clone)]
pub struct Norm {
    pub kind: NormKind,
    /// `(c)`, initialised to 1.
    pub w: ParamRef,
    /// `(c)`, initialised to 0; LayerNorm only.
    pub b: Option<ParamRef>,
    pub c: usize,
    pub eps: f32,
    /// Frozen (adapter fine-tuning): the backward computes `dx` only.
    pub frozen: bool,
}

impl Norm {
    /// Registers `{name}.weight` (and `{name}.bias` for LayerNorm), replicated, no decay.
    pub fn new(
        layout: &mut ParamLayout,
        name: &str,
        kind: NormKind,
        c: usize,
        eps: f32,
    ) -> Result<Self, LayerError> {
        let spec = |suffix: &str, v: f32| ParamSpec {
            name: format!("{name}.{suffix}"),
            global_shape: vec![c],
            shard: Shard::Replicated,
            decay: false,
            init: Init::Const(v),
        };
        let w = layout.add(spec("weight", 1.0))?;
        let b = match kind {
            NormKind::LayerNorm => Some(layout.add(spec("bias", 0.0))?),
            NormKind::RmsNorm => None,
        };
        let frozen = layout.freezing();
        Ok(Self {
            kind,
            w,
            b,
            c,
            eps,
            frozen,
        })
    }

    /// `out (N, c)`, saving `mean (N)` (LayerNorm only; may be empty for RMSNorm) and `rstd (N)`.
    pub fn forward<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Ref<'_>,
        out: B::Mut<'_>,
        mean: B::Mut<'_>,
        rstd: B::Mut<'_>,
    ) -> Result<(), LayerError> {
        let w = self.w.view::<B>(p);
        match self.kind {
            NormKind::LayerNorm => {
                let b = self.b.map(|b| b.view::<B>(p));
                be.layernorm_forward(out, mean, rstd, x, w, b, self.c, self.eps)?
            }
            NormKind::RmsNorm => be.rmsnorm_forward(out, rstd, x, w, self.c, self.eps)?,
        }
        Ok(())
    }

    /// [`forward`](Self::forward) of `x = x + proj_bias + res`, computed in place first: the
    /// residual connection before the norm (one kernel on a device,
    /// `Backend::residual_layernorm_forward`).
    pub fn forward_residual<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        x: B::Mut<'_>,
        proj_bias: Option<ParamRef>,
        res: B::Ref<'_>,
        out: B::Mut<'_>,
        mean: B::Mut<'_>,
        rstd: B::Mut<'_>,
    ) -> Result<(), LayerError> {
        let w = self.w.view::<B>(p);
        let pb = proj_bias.map(|b| b.view::<B>(p));
        match self.kind {
            NormKind::LayerNorm => {
                let b = self.b.map(|b| b.view::<B>(p));
                be.residual_layernorm_forward(x, pb, res, out, mean, rstd, w, b, self.c, self.eps)?
            }
            NormKind::RmsNorm => {
                be.residual_rmsnorm_forward(x, pb, res, out, rstd, w, self.c, self.eps)?
            }
        }
        Ok(())
    }

    /// `dx (N, c) +=` input gradient; parameter gradients accumulate into `g`.
    pub fn backward<B: Backend>(
        &self,
        be: &B,
        p: B::Ref<'_>,
        g: B::Mut<'_>,
        dout: B::Ref<'_>,
        x: B::Ref<'_>,
        mean: B::Ref<'_>,
        rstd: B::Ref<'_>,
        dx: B::Mut<'_>,
    ) -> Result<(), LayerError> {
        let w = self.w.view::<B>(p);
        if self.frozen {
            // The kernels write the weight gradient with `dx`: into a scratch of its own.
            let mut gw = be.alloc(Storage::F32, 2 * self.c)?;
            let (gw, gb) = B::split_at_mut(B::view_mut(&mut gw), self.c);
            match self.kind {
                NormKind::LayerNorm => {
                    be.layernorm_backward(dx, gw, Some(gb), dout, x, w, mean, rstd, self.c)?
                }
                NormKind::RmsNorm => be.rmsnorm_backward(dx, gw, dout, x, w, rstd, self.c)?,
            }
            return Ok(());
        }
        match self.kind {
            NormKind::LayerNorm => {
                let b = self.b.expect("LayerNorm has a bias");
                let (gw, gb) = split_two::<B>(g, self.w, b);
                be.layernorm_backward(dx, gw, Some(gb), dout, x, w, mean, rstd, self.c)?
            }
            NormKind::RmsNorm => {
                be.rmsnorm_backward(dx, self.w.view_mut::<B>(g), dout, x, w, rstd, self.c)?
            }
        }
        Ok(())
    }

    /// Elements of the `mean` buffer `forward` needs for `n` rows.
    pub fn mean_len(&self, n: usize) -> usize {
        match self.kind {
            NormKind::LayerNorm => n,
            NormKind::RmsNorm => 0,
        }
    }
}

/// Two disjoint write views of the flat buffer (`a` before `b`).
pub(crate) fn split_two<B: Backend>(
    g: B::Mut<'_>,
    a: ParamRef,
    b: ParamRef,
) -> (B::Mut<'_>, B::Mut<'_>) {
    assert!(
        a.offset + a.len <= b.offset,
        "views overlap or are out of order"
    );
    let (lo, hi) = B::split_at_mut(g, b.offset);
    (B::sub_mut(lo, a.range()), B::sub_mut(hi, 0..b.len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Cpu;
    use crate::testutil::{fd_check, randn, weighted};

    #[test]
    fn norm_layers_match_finite_differences() {
        let (n, c) = (3, 8);
        for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
            let mut layout = ParamLayout::new();
            let norm = Norm::new(&mut layout, "ln", kind, c, 1e-5).unwrap();
            let p: Vec<f32> = layout
                .init(0)
                .iter()
                .zip(randn(layout.len(), 1, 0.3))
                .map(|(a, b)| a + b)
                .collect();
            let x = randn(n * c, 2, 1.0);
            let gy = randn(n * c, 3, 1.0);
            let fwd = |p: &[f32], x: &[f32]| {
                let (mut o, mut m, mut r) =
                    (vec![0.0; n * c], vec![0.0; norm.mean_len(n)], vec![0.0; n]);
                norm.forward(&Cpu, p, x, &mut o, &mut m, &mut r).unwrap();
                (o, m, r)
            };
            let (_, m, r) = fwd(&p, &x);
            let (mut g, mut dx) = (layout.zeros(), vec![0.0; n * c]);
            norm.backward(&Cpu, &p, &mut g, &gy, &x, &m, &r, &mut dx)
                .unwrap();
            fd_check("norm dparams", &p, &g, 1.0 / 64.0, 1e-3, 100, |p| {
                weighted(&fwd(p, &x).0, &gy)
            });
            fd_check("norm dx", &x, &dx, 1.0 / 64.0, 1e-3, 100, |x| {
                weighted(&fwd(&p, x).0, &gy)
            });
        }
    }
}
