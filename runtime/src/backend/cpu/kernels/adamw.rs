//! The CPU AdamW kernel: one fused, element-wise pass over a range (decoupled weight decay,
//! bias-corrected moments). `crate::optim` decides the scalars (`AdamWStep`); this is the loop.

use crate::backend::AdamWStep;

/// One AdamW update of `params` from `grads` and the moments (all the same length).
pub fn adamw_update(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    s: &AdamWStep,
) {
    let (bc1, bc2) = s.bias_corrections();
    let (lr, wd, scale) = (s.lr, s.weight_decay, s.grad_scale);
    for ((p, &g), (m, v)) in params
        .iter_mut()
        .zip(grads)
        .zip(m.iter_mut().zip(v.iter_mut()))
    {
        let g = g * scale;
        *m = s.beta1 * *m + (1.0 - s.beta1) * g;
        *v = s.beta2 * *v + (1.0 - s.beta2) * g * g;
        let (mh, vh) = (*m / bc1, *v / bc2);
        *p -= lr * (mh / (vh.sqrt() + s.eps) + wd * *p);
    }
}
