//! One interface to the numeric kernels of every backend, on host slices: the test bodies shared
//! by the CPU and the CUDA backend call it (`runtime/tests/ops.rs`), with an f64 reference as the
//! oracle and a tolerance per backend ([`Kernels::rtol`]).
//!
//! Semantics are the CPU kernels' (`crate::backend::cpu::kernels`): row-major, parameter gradients accumulated,
//! norm input gradients accumulated, other input gradients overwritten. A GPU backend rounds
//! activations and weights to bf16 on the way in and keeps statistics, gradient accumulators,
//! master weights and optimizer state in f32.
//!
//! This is a test and debugging surface (every call copies to the device and back), not the
//! training path: it must not grow state between calls.
#![allow(clippy::too_many_arguments)]

use std::ops::Range;

use super::{bf16, Backend, Cpu, GpuError};
use crate::backend::cpu::kernels::{self as cpu, AttnShape, MatMut, MatRef};

pub use super::shapes::RowMajorGemm as GemmShape;
pub use super::shapes::{AdamWStep, RopeShape, Storage};

/// The kernels every backend provides. Shapes in each method's doc; `N` is the number of rows.
pub trait Kernels {
    /// Backend and device, for test output.
    fn name(&self) -> String;
    /// Relative tolerance (of the tensor's largest magnitude) against an f64 reference.
    fn rtol(&self, storage: Storage) -> f32;

    /// `out [+]= op(a)·op(b)` (row-major; see [`GemmShape`]).
    fn gemm(
        &self,
        out: &mut [f32],
        a: &[f32],
        b: &[f32],
        g: GemmShape,
        acc: bool,
    ) -> Result<(), GpuError>;
    /// `out (n, out_f) = x (n, in_f) · wᵀ + bias`, `w: (out_f, in_f)`.
    fn linear_forward(
        &self,
        out: &mut [f32],
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        n: usize,
        in_f: usize,
        out_f: usize,
    ) -> Result<(), GpuError>;
    /// `dbias (c) += Σ_rows dout (N, c)`.
    fn bias_backward(&self, dbias: &mut [f32], dout: &[f32], c: usize) -> Result<(), GpuError>;
    /// `out (N, c) = wte[tokens − vocab_start]` or zeros outside the shard.
    fn embedding_forward(
        &self,
        out: &mut [f32],
        tokens: &[u32],
        wte: &[f32],
        vocab_start: usize,
        c: usize,
    ) -> Result<(), GpuError>;
    /// `dwte[tokens − vocab_start] += dout`.
    fn embedding_backward(
        &self,
        dwte: &mut [f32],
        tokens: &[u32],
        dout: &[f32],
        vocab_start: usize,
        c: usize,
    ) -> Result<(), GpuError>;
    /// `out (B·t, c) += wpe[row % t]`.
    fn pos_embedding_forward(
        &self,
        out: &mut [f32],
        wpe: &[f32],
        t: usize,
        c: usize,
    ) -> Result<(), GpuError>;
    /// `dwpe[p] += Σ_b dout[b, p]`.
    fn pos_embedding_backward(
        &self,
        dwpe: &mut [f32],
        dout: &[f32],
        t: usize,
        c: usize,
    ) -> Result<(), GpuError>;
    fn layernorm_forward(
        &self,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        bias: Option<&[f32]>,
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError>;
    fn layernorm_backward(
        &self,
        dinp: &mut [f32],
        dweight: &mut [f32],
        dbias: Option<&mut [f32]>,
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        mean: &[f32],
        rstd: &[f32],
        c: usize,
    ) -> Result<(), GpuError>;
    fn rmsnorm_forward(
        &self,
        out: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError>;
    fn rmsnorm_backward(
        &self,
        dinp: &mut [f32],
        dweight: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        rstd: &[f32],
        c: usize,
    ) -> Result<(), GpuError>;
    /// Causal GQA attention: `y (B, T, hq·hd)` from `qkv (B, T, (hq+2hkv)·hd)`; `saved` gets
    /// what this backend's backward needs (probabilities on the CPU, log-sum-exp on a GPU).
    fn attention_forward(
        &self,
        y: &mut [f32],
        saved: &mut Vec<f32>,
        qkv: &[f32],
        s: AttnShape,
    ) -> Result<(), GpuError>;
    /// `dqkv` overwritten.
    fn attention_backward(
        &self,
        dqkv: &mut [f32],
        dy: &[f32],
        qkv: &[f32],
        y: &[f32],
        saved: &[f32],
        s: AttnShape,
    ) -> Result<(), GpuError>;
    /// RoPE in place on the first `heads` heads of each row of `x: (N, width)`, row `n` at
    /// position `n % t`; `tables`: cos and sin, each `(t, hd/2)`, from `cpu::rope_tables`.
    /// `backward` applies the transpose rotation (to a gradient).
    fn rope(
        &self,
        x: &mut [f32],
        shape: RopeShape,
        tables: (&[f32], &[f32]),
        backward: bool,
    ) -> Result<(), GpuError>;

    /// `out = a + b` (the residual connection), in activation storage.
    fn residual_add(&self, out: &mut [f32], a: &[f32], b: &[f32]) -> Result<(), GpuError>;

    /// `x[range] = value`, `x` held in `storage`, through a view at an offset into it; the
    /// rest of `x` untouched.
    fn fill(
        &self,
        x: &mut [f32],
        range: Range<usize>,
        value: f32,
        storage: Storage,
    ) -> Result<(), GpuError>;
    /// `dst[at..at + from.len()] = src[from]`, both held in `storage`, through views at offsets
    /// into them; the rest of `dst` untouched.
    fn copy(
        &self,
        dst: &mut [f32],
        at: usize,
        src: &[f32],
        from: Range<usize>,
        storage: Storage,
    ) -> Result<(), GpuError>;
    /// `y (N, c) += b (c)`, in activation storage (the executor's bias add).
    fn add_bias(&self, y: &mut [f32], b: &[f32]) -> Result<(), GpuError>;
    /// `x *= s`, in activation storage (a LoRA adapter's scaling).
    fn scale(&self, x: &mut [f32], s: f32) -> Result<(), GpuError>;

    /// Σ x² (the squared norm of fp32 gradients, for global-norm clipping), summed in f64.
    fn sum_squares(&self, x: &[f32]) -> Result<f64, GpuError>;

    fn gelu_forward(&self, out: &mut [f32], inp: &[f32]) -> Result<(), GpuError>;
    fn gelu_backward(&self, dinp: &mut [f32], inp: &[f32], dout: &[f32]) -> Result<(), GpuError>;
    // The fused element-wise work of `Backend` (`bias_gelu_forward`, `gelu_backward_bias`,
    // `add_bias_residual`, `residual_*norm_forward`): one kernel each on a device, the separate
    // kernels (the trait's defaults) on the CPU.
    /// `h (N, c) += bias` (when given; `c` = its length), then `a = gelu(h)`; `h` and `a` in
    /// activation storage.
    fn bias_gelu_forward(
        &self,
        h: &mut [f32],
        a: &mut [f32],
        bias: Option<&[f32]>,
    ) -> Result<(), GpuError>;
    /// `dinp = gelu'(inp) · dout` (overwritten), then `dbias (c) += Σ_rows dinp` (when given;
    /// an f32 gradient accumulator).
    fn gelu_backward_bias(
        &self,
        dinp: &mut [f32],
        dbias: Option<&mut [f32]>,
        inp: &[f32],
        dout: &[f32],
    ) -> Result<(), GpuError>;
    /// `y (N, c) += bias` (when given), then `y += res`, in activation storage.
    fn add_bias_residual(
        &self,
        y: &mut [f32],
        bias: Option<&[f32]>,
        res: &[f32],
    ) -> Result<(), GpuError>;
    /// `x += proj_bias (when given) + res` in place (the residual stream), then
    /// [`layernorm_forward`](Self::layernorm_forward) of it into `out`, `mean`, `rstd`.
    fn residual_layernorm_forward(
        &self,
        x: &mut [f32],
        proj_bias: Option<&[f32]>,
        res: &[f32],
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        weight: &[f32],
        bias: Option<&[f32]>,
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError>;
    /// `x += proj_bias (when given) + res` in place, then
    /// [`rmsnorm_forward`](Self::rmsnorm_forward) of it into `out`, `rstd`.
    fn residual_rmsnorm_forward(
        &self,
        x: &mut [f32],
        proj_bias: Option<&[f32]>,
        res: &[f32],
        out: &mut [f32],
        rstd: &mut [f32],
        weight: &[f32],
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError>;
    /// `out (N, f)` from `inp (N, 2f)` rows `[gate | up]`.
    fn swiglu_forward(&self, out: &mut [f32], inp: &[f32], f: usize) -> Result<(), GpuError>;
    fn swiglu_backward(
        &self,
        dinp: &mut [f32],
        inp: &[f32],
        dout: &[f32],
        f: usize,
    ) -> Result<(), GpuError>;
    /// Vocab-parallel forward, 1 of 3: `max (N)` = row maxima of this shard's `logits (N, v)`.
    fn row_max(&self, max: &mut [f32], logits: &[f32], v: usize) -> Result<(), GpuError>;
    /// Vocab-parallel forward, 2 of 3: `both (2N) = [Σ exp(l − max) | target logit or 0]` over
    /// this shard's columns (`vocab_start..vocab_start + v`), against the GLOBAL `max`.
    fn ce_partials(
        &self,
        both: &mut [f32],
        logits: &[f32],
        max: &[f32],
        targets: &[u32],
        vocab_start: usize,
        v: usize,
    ) -> Result<(), GpuError>;
    /// Vocab-parallel forward, 3 of 3, from the group-summed `both (2N)`:
    /// `losses = ln(sumexp) + max − target`, `sumexp = both[..N]`.
    fn ce_losses(
        &self,
        losses: &mut [f32],
        sumexp: &mut [f32],
        max: &[f32],
        both: &[f32],
    ) -> Result<(), GpuError>;
    /// Single shard: `losses (N)`, saving `max` and `sumexp`.
    fn crossentropy_forward(
        &self,
        losses: &mut [f32],
        max: &mut [f32],
        sumexp: &mut [f32],
        logits: &[f32],
        targets: &[u32],
        v: usize,
    ) -> Result<(), GpuError>;
    /// In place: `logits ← (softmax − onehot) · dlosses`, from GLOBAL row statistics.
    fn crossentropy_backward(
        &self,
        logits: &mut [f32],
        max: &[f32],
        sumexp: &[f32],
        targets: &[u32],
        dlosses: &[f32],
        vocab_start: usize,
        v: usize,
    ) -> Result<(), GpuError>;
    /// Single shard, one pass: `losses` and, in place, the gradient over `logits`.
    fn crossentropy_fused(
        &self,
        losses: &mut [f32],
        logits: &mut [f32],
        targets: &[u32],
        dlosses: &[f32],
        v: usize,
    ) -> Result<(), GpuError>;
    /// One AdamW update of f32 master `params` and moments; `params_bf16`, when given, gets the
    /// bf16 working copy of the updated weights (as f32 values).
    fn adamw(
        &self,
        params: &mut [f32],
        params_bf16: Option<&mut [f32]>,
        grads: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        step: &AdamWStep,
    ) -> Result<(), GpuError>;
}

/// The CPU kernels behind [`Kernels`] (f32; the executor runs them through `backend::Cpu`).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuKernels;

fn rows(len: usize, width: usize) -> usize {
    len.checked_div(width).unwrap_or(0)
}

impl Kernels for CpuKernels {
    fn name(&self) -> String {
        "cpu (f32)".into()
    }

    fn rtol(&self, _storage: Storage) -> f32 {
        1e-5
    }

    fn gemm(
        &self,
        out: &mut [f32],
        a: &[f32],
        b: &[f32],
        g: GemmShape,
        acc: bool,
    ) -> Result<(), GpuError> {
        let av = if g.trans_a {
            MatRef::rows(a, g.k, g.m).t()
        } else {
            MatRef::rows(a, g.m, g.k)
        };
        let bv = if g.trans_b {
            MatRef::rows(b, g.n, g.k).t()
        } else {
            MatRef::rows(b, g.k, g.n)
        };
        cpu::gemm(MatMut::rows(out, g.m, g.n), av, bv, 1.0, acc);
        Ok(())
    }

    fn linear_forward(
        &self,
        out: &mut [f32],
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        n: usize,
        in_f: usize,
        out_f: usize,
    ) -> Result<(), GpuError> {
        cpu::matmul_bt(out, x, w, n, in_f, out_f, false);
        if let Some(b) = bias {
            cpu::add_bias(out, b);
        }
        Ok(())
    }

    fn bias_backward(&self, dbias: &mut [f32], dout: &[f32], _c: usize) -> Result<(), GpuError> {
        cpu::bias_backward(dbias, dout);
        Ok(())
    }

    fn embedding_forward(
        &self,
        out: &mut [f32],
        tokens: &[u32],
        wte: &[f32],
        vocab_start: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        cpu::embedding_forward(out, tokens, wte, vocab_start, c);
        Ok(())
    }

    fn embedding_backward(
        &self,
        dwte: &mut [f32],
        tokens: &[u32],
        dout: &[f32],
        vocab_start: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        cpu::embedding_backward(dwte, tokens, dout, vocab_start, c);
        Ok(())
    }

    fn pos_embedding_forward(
        &self,
        out: &mut [f32],
        wpe: &[f32],
        t: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        cpu::pos_embedding_forward(out, wpe, t, c);
        Ok(())
    }

    fn pos_embedding_backward(
        &self,
        dwpe: &mut [f32],
        dout: &[f32],
        t: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        cpu::pos_embedding_backward(dwpe, dout, t, c);
        Ok(())
    }

    fn layernorm_forward(
        &self,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        bias: Option<&[f32]>,
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        cpu::layernorm_forward(out, mean, rstd, inp, weight, bias, c, eps);
        Ok(())
    }

    fn layernorm_backward(
        &self,
        dinp: &mut [f32],
        dweight: &mut [f32],
        dbias: Option<&mut [f32]>,
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        mean: &[f32],
        rstd: &[f32],
        c: usize,
    ) -> Result<(), GpuError> {
        cpu::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, c);
        Ok(())
    }

    fn rmsnorm_forward(
        &self,
        out: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        cpu::rmsnorm_forward(out, rstd, inp, weight, c, eps);
        Ok(())
    }

    fn rmsnorm_backward(
        &self,
        dinp: &mut [f32],
        dweight: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        rstd: &[f32],
        c: usize,
    ) -> Result<(), GpuError> {
        cpu::rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, c);
        Ok(())
    }

    fn attention_forward(
        &self,
        y: &mut [f32],
        saved: &mut Vec<f32>,
        qkv: &[f32],
        s: AttnShape,
    ) -> Result<(), GpuError> {
        saved.clear();
        saved.resize(s.att_len(), 0.0);
        cpu::attention_forward(y, saved, qkv, s);
        Ok(())
    }

    fn attention_backward(
        &self,
        dqkv: &mut [f32],
        dy: &[f32],
        qkv: &[f32],
        _y: &[f32],
        saved: &[f32],
        s: AttnShape,
    ) -> Result<(), GpuError> {
        let mut scratch = vec![0.0; cpu::attention_scratch_len(&s)];
        cpu::attention_backward(dqkv, &mut scratch, dy, qkv, saved, s);
        Ok(())
    }

    fn rope(
        &self,
        x: &mut [f32],
        s: RopeShape,
        (cos, sin): (&[f32], &[f32]),
        backward: bool,
    ) -> Result<(), GpuError> {
        Cpu.rope(x, s, cos, sin, backward)
    }

    fn residual_add(&self, out: &mut [f32], a: &[f32], b: &[f32]) -> Result<(), GpuError> {
        out.copy_from_slice(a);
        Cpu.add_assign(out, b)
    }

    fn sum_squares(&self, x: &[f32]) -> Result<f64, GpuError> {
        Cpu.sum_squares(x)
    }

    fn fill(
        &self,
        x: &mut [f32],
        range: Range<usize>,
        value: f32,
        _storage: Storage,
    ) -> Result<(), GpuError> {
        Cpu.fill(&mut x[range], value)
    }

    fn copy(
        &self,
        dst: &mut [f32],
        at: usize,
        src: &[f32],
        from: Range<usize>,
        _storage: Storage,
    ) -> Result<(), GpuError> {
        let n = from.len();
        Cpu.copy(&mut dst[at..at + n], &src[from])
    }

    fn add_bias(&self, y: &mut [f32], b: &[f32]) -> Result<(), GpuError> {
        Cpu.add_bias(y, b)
    }

    fn scale(&self, x: &mut [f32], s: f32) -> Result<(), GpuError> {
        Cpu.scale(x, s)
    }

    fn gelu_forward(&self, out: &mut [f32], inp: &[f32]) -> Result<(), GpuError> {
        cpu::gelu_forward(out, inp);
        Ok(())
    }

    fn gelu_backward(&self, dinp: &mut [f32], inp: &[f32], dout: &[f32]) -> Result<(), GpuError> {
        cpu::gelu_backward(dinp, inp, dout);
        Ok(())
    }

    fn bias_gelu_forward(
        &self,
        h: &mut [f32],
        a: &mut [f32],
        bias: Option<&[f32]>,
    ) -> Result<(), GpuError> {
        Cpu.bias_gelu_forward(h, a, bias)
    }

    fn gelu_backward_bias(
        &self,
        dinp: &mut [f32],
        dbias: Option<&mut [f32]>,
        inp: &[f32],
        dout: &[f32],
    ) -> Result<(), GpuError> {
        Cpu.gelu_backward_bias(dinp, dbias, inp, dout)
    }

    fn add_bias_residual(
        &self,
        y: &mut [f32],
        bias: Option<&[f32]>,
        res: &[f32],
    ) -> Result<(), GpuError> {
        Cpu.add_bias_residual(y, bias, res)
    }

    fn residual_layernorm_forward(
        &self,
        x: &mut [f32],
        proj_bias: Option<&[f32]>,
        res: &[f32],
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
        weight: &[f32],
        bias: Option<&[f32]>,
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        Cpu.residual_layernorm_forward(x, proj_bias, res, out, mean, rstd, weight, bias, c, eps)
    }

    fn residual_rmsnorm_forward(
        &self,
        x: &mut [f32],
        proj_bias: Option<&[f32]>,
        res: &[f32],
        out: &mut [f32],
        rstd: &mut [f32],
        weight: &[f32],
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        Cpu.residual_rmsnorm_forward(x, proj_bias, res, out, rstd, weight, c, eps)
    }

    fn swiglu_forward(&self, out: &mut [f32], inp: &[f32], f: usize) -> Result<(), GpuError> {
        cpu::swiglu_forward(out, inp, f);
        Ok(())
    }

    fn swiglu_backward(
        &self,
        dinp: &mut [f32],
        inp: &[f32],
        dout: &[f32],
        f: usize,
    ) -> Result<(), GpuError> {
        cpu::swiglu_backward(dinp, inp, dout, f);
        Ok(())
    }

    fn row_max(&self, max: &mut [f32], logits: &[f32], v: usize) -> Result<(), GpuError> {
        Cpu.row_max(max, logits, v)
    }

    fn ce_partials(
        &self,
        both: &mut [f32],
        logits: &[f32],
        max: &[f32],
        targets: &[u32],
        vocab_start: usize,
        v: usize,
    ) -> Result<(), GpuError> {
        Cpu.ce_partials(both, logits, max, &targets.to_vec(), vocab_start, v)
    }

    fn ce_losses(
        &self,
        losses: &mut [f32],
        sumexp: &mut [f32],
        max: &[f32],
        both: &[f32],
    ) -> Result<(), GpuError> {
        Cpu.ce_losses(losses, sumexp, max, both)
    }

    fn crossentropy_forward(
        &self,
        losses: &mut [f32],
        max: &mut [f32],
        sumexp: &mut [f32],
        logits: &[f32],
        targets: &[u32],
        v: usize,
    ) -> Result<(), GpuError> {
        cpu::crossentropy_forward(losses, max, sumexp, logits, targets, v);
        Ok(())
    }

    fn crossentropy_backward(
        &self,
        logits: &mut [f32],
        max: &[f32],
        sumexp: &[f32],
        targets: &[u32],
        dlosses: &[f32],
        vocab_start: usize,
        v: usize,
    ) -> Result<(), GpuError> {
        cpu::crossentropy_backward(logits, max, sumexp, targets, dlosses, vocab_start, v);
        Ok(())
    }

    fn crossentropy_fused(
        &self,
        losses: &mut [f32],
        logits: &mut [f32],
        targets: &[u32],
        dlosses: &[f32],
        v: usize,
    ) -> Result<(), GpuError> {
        let n = rows(logits.len(), v);
        let (mut max, mut sumexp) = (vec![0.0; n], vec![0.0; n]);
        cpu::crossentropy_forward(losses, &mut max, &mut sumexp, logits, targets, v);
        cpu::crossentropy_backward(logits, &max, &sumexp, targets, dlosses, 0, v);
        Ok(())
    }

    fn adamw(
        &self,
        params: &mut [f32],
        params_bf16: Option<&mut [f32]>,
        grads: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        step: &AdamWStep,
    ) -> Result<(), GpuError> {
        // The update training runs (`backend::cpu::kernels::adamw_update`, as `backend::Cpu::adamw` calls it).
        Cpu.adamw(params, None, grads, m, v, step)?;
        if let Some(p16) = params_bf16 {
            p16.iter_mut()
                .zip(params.iter())
                .for_each(|(o, &p)| *o = bf16::round(p));
        }
        Ok(())
    }
}
