//! [`GpuKernels`]' norm, attention, activation and cross-entropy launches, split from `ops.rs`
//! for length: the `Kernels` methods there forward here. Same rules: every launch checked
//! against its kernel's signature, bf16 storage, f32 statistics and gradient accumulators.
#![allow(clippy::too_many_arguments)]

use super::launch;
use super::ops::{i32_of, n64, rows_of};
use super::{DType, GpuError, GpuKernels, KArg, Launcher};
use crate::cpu::AttnShape;
use crate::ops::RopeShape;

impl<L: Launcher> GpuKernels<L> {
    pub(super) fn gpu_layernorm_forward(
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
        let n = rows_of(inp.len(), c);
        let o = self.zeros(DType::Bf16, n * c)?;
        let (mb, rb) = (self.zeros(DType::F32, n)?, self.zeros(DType::F32, n)?);
        let (x, w) = (self.bf16(inp)?, self.bf16(weight)?);
        let b = bias.map(|b| self.bf16(b)).transpose()?;
        self.run(
            "norm",
            "layernorm_forward",
            launch::per_row(n as u64, c, 256)?,
            &[
                KArg::Buf(&o),
                KArg::Buf(&mb),
                KArg::Buf(&rb),
                KArg::Buf(&x),
                KArg::Buf(&w),
                b.as_ref().map_or(KArg::Null, KArg::Buf),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(c, "channels")?),
                KArg::F32(eps),
            ],
        )?;
        self.read(&o, out)?;
        self.read(&mb, mean)?;
        self.read(&rb, rstd)
    }

    pub(super) fn gpu_layernorm_backward(
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
        let n = rows_of(inp.len(), c);
        let ci = i32_of(c, "channels")?;
        let (dx, dy, x, w) = (
            self.bf16(dinp)?,
            self.bf16(dout)?,
            self.bf16(inp)?,
            self.bf16(weight)?,
        );
        let (mb, rb) = (self.f32(mean)?, self.f32(rstd)?);
        self.run(
            "norm",
            "layernorm_backward",
            launch::per_row(n as u64, c, 256)?,
            &[
                KArg::Buf(&dx),
                KArg::Buf(&dy),
                KArg::Buf(&x),
                KArg::Buf(&w),
                KArg::Buf(&mb),
                KArg::Buf(&rb),
                KArg::I64(n64(n)),
                KArg::I32(ci),
            ],
        )?;
        self.read(&dx, dinp)?;
        let ch = launch::row_chunks(n as u64);
        let partial = self.zeros(DType::F32, ch.chunks as usize * 2 * c)?;
        self.run(
            "norm",
            "layernorm_param_grads",
            (n > 0).then(|| launch::per_channel(c, ch)).transpose()?,
            &[
                KArg::Buf(&partial),
                KArg::Buf(&dy),
                KArg::Buf(&x),
                KArg::Buf(&mb),
                KArg::Buf(&rb),
                KArg::I64(n64(n)),
                KArg::I32(ci),
                KArg::I64(ch.rows_per_chunk as i64),
            ],
        )?;
        self.add_partials(dweight, &partial, ch.chunks, 2 * c, 0)?;
        if let Some(db) = dbias {
            self.add_partials(db, &partial, ch.chunks, 2 * c, c)?;
        }
        Ok(())
    }

    pub(super) fn gpu_rmsnorm_forward(
        &self,
        out: &mut [f32],
        rstd: &mut [f32],
        inp: &[f32],
        weight: &[f32],
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        let n = rows_of(inp.len(), c);
        let o = self.zeros(DType::Bf16, n * c)?;
        let rb = self.zeros(DType::F32, n)?;
        let (x, w) = (self.bf16(inp)?, self.bf16(weight)?);
        self.run(
            "norm",
            "rmsnorm_forward",
            launch::per_row(n as u64, c, 256)?,
            &[
                KArg::Buf(&o),
                KArg::Buf(&rb),
                KArg::Buf(&x),
                KArg::Buf(&w),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(c, "channels")?),
                KArg::F32(eps),
            ],
        )?;
        self.read(&o, out)?;
        self.read(&rb, rstd)
    }

    pub(super) fn gpu_rmsnorm_backward(
        &self,
        dinp: &mut [f32],
        dweight: &mut [f32],
        dout: &[f32],
        inp: &[f32],
        weight: &[f32],
        rstd: &[f32],
        c: usize,
    ) -> Result<(), GpuError> {
        let n = rows_of(inp.len(), c);
        let ci = i32_of(c, "channels")?;
        let (dx, dy, x, w) = (
            self.bf16(dinp)?,
            self.bf16(dout)?,
            self.bf16(inp)?,
            self.bf16(weight)?,
        );
        let rb = self.f32(rstd)?;
        self.run(
            "norm",
            "rmsnorm_backward",
            launch::per_row(n as u64, c, 256)?,
            &[
                KArg::Buf(&dx),
                KArg::Buf(&dy),
                KArg::Buf(&x),
                KArg::Buf(&w),
                KArg::Buf(&rb),
                KArg::I64(n64(n)),
                KArg::I32(ci),
            ],
        )?;
        self.read(&dx, dinp)?;
        let ch = launch::row_chunks(n as u64);
        let partial = self.zeros(DType::F32, ch.chunks as usize * c)?;
        self.run(
            "norm",
            "rmsnorm_param_grads",
            (n > 0).then(|| launch::per_channel(c, ch)).transpose()?,
            &[
                KArg::Buf(&partial),
                KArg::Buf(&dy),
                KArg::Buf(&x),
                KArg::Buf(&rb),
                KArg::I64(n64(n)),
                KArg::I32(ci),
                KArg::I64(ch.rows_per_chunk as i64),
            ],
        )?;
        self.add_partials(dweight, &partial, ch.chunks, c, 0)
    }

    pub(super) fn gpu_attention_forward(
        &self,
        y: &mut [f32],
        saved: &mut Vec<f32>,
        qkv: &[f32],
        s: AttnShape,
    ) -> Result<(), GpuError> {
        let geo = launch::attention(&s, self.launcher().max_shared_bytes())?;
        let q = self.bf16(qkv)?;
        let yb = self.zeros(DType::Bf16, s.b * s.t * s.y_width())?;
        let lse = self.zeros(DType::F32, s.b * s.hq * s.t)?;
        let scale = 1.0 / (s.hd as f32).sqrt();
        self.run(
            "attention",
            "attention_forward",
            Some(geo.forward),
            &[
                KArg::Buf(&yb),
                KArg::Buf(&lse),
                KArg::Buf(&q),
                KArg::I32(i32_of(s.b, "batch")?),
                KArg::I32(i32_of(s.t, "sequence")?),
                KArg::I32(s.hq as i32),
                KArg::I32(s.hkv as i32),
                KArg::I32(s.hd as i32),
                KArg::F32(scale),
            ],
        )?;
        self.read(&yb, y)?;
        saved.clear();
        saved.resize(s.b * s.hq * s.t, 0.0);
        self.read(&lse, saved)
    }

    pub(super) fn gpu_attention_backward(
        &self,
        dqkv: &mut [f32],
        dy: &[f32],
        qkv: &[f32],
        y: &[f32],
        saved: &[f32],
        s: AttnShape,
    ) -> Result<(), GpuError> {
        let geo = launch::attention(&s, self.launcher().max_shared_bytes())?;
        let (q, dyb, yb, lse) = (
            self.bf16(qkv)?,
            self.bf16(dy)?,
            self.bf16(y)?,
            self.f32(saved)?,
        );
        let delta = self.zeros(DType::F32, s.b * s.hq * s.t)?;
        let dq = self.zeros(DType::Bf16, qkv.len())?;
        let (b, t) = (i32_of(s.b, "batch")?, i32_of(s.t, "sequence")?);
        let (hq, hkv, hd) = (s.hq as i32, s.hkv as i32, s.hd as i32);
        let scale = 1.0 / (s.hd as f32).sqrt();
        self.run(
            "attention",
            "attention_delta",
            Some(geo.delta),
            &[
                KArg::Buf(&delta),
                KArg::Buf(&dyb),
                KArg::Buf(&yb),
                KArg::I32(b),
                KArg::I32(t),
                KArg::I32(hq),
                KArg::I32(hd),
            ],
        )?;
        for (function, g) in [
            ("attention_backward_dq", geo.backward_dq),
            ("attention_backward_dkv", geo.backward_dkv),
        ] {
            self.run(
                "attention",
                function,
                Some(g),
                &[
                    KArg::Buf(&dq),
                    KArg::Buf(&dyb),
                    KArg::Buf(&q),
                    KArg::Buf(&lse),
                    KArg::Buf(&delta),
                    KArg::I32(b),
                    KArg::I32(t),
                    KArg::I32(hq),
                    KArg::I32(hkv),
                    KArg::I32(hd),
                    KArg::F32(scale),
                ],
            )?;
        }
        self.read(&dq, dqkv)
    }

    pub(super) fn gpu_crossentropy_forward(
        &self,
        losses: &mut [f32],
        max: &mut [f32],
        sumexp: &mut [f32],
        logits: &[f32],
        targets: &[u32],
        v: usize,
    ) -> Result<(), GpuError> {
        let n = targets.len();
        let (lo, mb, sb) = (
            self.zeros(DType::F32, n)?,
            self.zeros(DType::F32, n)?,
            self.zeros(DType::F32, n)?,
        );
        let (l, t) = (self.bf16(logits)?, self.u32(targets)?);
        self.run(
            "crossentropy",
            "crossentropy_forward",
            launch::per_row(n as u64, v, 1024)?,
            &[
                KArg::Buf(&lo),
                KArg::Buf(&mb),
                KArg::Buf(&sb),
                KArg::Buf(&l),
                KArg::Buf(&t),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(v, "vocabulary")?),
            ],
        )?;
        self.read(&lo, losses)?;
        self.read(&mb, max)?;
        self.read(&sb, sumexp)
    }

    pub(super) fn gpu_crossentropy_backward(
        &self,
        logits: &mut [f32],
        max: &[f32],
        sumexp: &[f32],
        targets: &[u32],
        dlosses: &[f32],
        vocab_start: usize,
        v: usize,
    ) -> Result<(), GpuError> {
        let n = targets.len();
        let (l, mb, sb) = (self.bf16(logits)?, self.f32(max)?, self.f32(sumexp)?);
        let (t, dl) = (self.u32(targets)?, self.f32(dlosses)?);
        self.run(
            "crossentropy",
            "crossentropy_backward",
            launch::per_row(n as u64, v, 1024)?,
            &[
                KArg::Buf(&l),
                KArg::Buf(&l),
                KArg::Buf(&mb),
                KArg::Buf(&sb),
                KArg::Buf(&t),
                KArg::Buf(&dl),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(v, "vocabulary")?),
                KArg::I64(n64(vocab_start)),
            ],
        )?;
        self.read(&l, logits)
    }

    pub(super) fn gpu_crossentropy_fused(
        &self,
        losses: &mut [f32],
        logits: &mut [f32],
        targets: &[u32],
        dlosses: &[f32],
        v: usize,
    ) -> Result<(), GpuError> {
        let n = targets.len();
        let lo = self.zeros(DType::F32, n)?;
        let (l, t, dl) = (self.bf16(logits)?, self.u32(targets)?, self.f32(dlosses)?);
        self.run(
            "crossentropy",
            "crossentropy_fused",
            launch::per_row(n as u64, v, 1024)?,
            &[
                KArg::Buf(&lo),
                KArg::Buf(&l),
                KArg::Buf(&t),
                KArg::Buf(&dl),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(v, "vocabulary")?),
            ],
        )?;
        self.read(&lo, losses)?;
        self.read(&l, logits)
    }

    pub(super) fn gpu_rope(
        &self,
        x: &mut [f32],
        shape: RopeShape,
        (cos, sin): (&[f32], &[f32]),
        backward: bool,
    ) -> Result<(), GpuError> {
        let RopeShape {
            t,
            width,
            heads,
            hd,
        } = shape;
        if hd % 2 != 0 || heads * hd > width || cos.len() < t * hd / 2 || sin.len() < t * hd / 2 {
            return Err(GpuError::Unsupported {
                what: format!("RoPE on heads {heads} × {hd} of rows {width} wide with tables for {} positions", cos.len() / (hd / 2).max(1)),
                fix: "an even head size, heads × head size within the row, and tables for every position".into(),
            });
        }
        let rows = x.len() / width.max(1);
        let (xb, c, s) = (self.bf16(x)?, self.f32(cos)?, self.f32(sin)?);
        self.run(
            "rope",
            "rope_rotate",
            launch::elementwise((rows * heads * hd / 2) as u64),
            &[
                KArg::Buf(&xb),
                KArg::Buf(&c),
                KArg::Buf(&s),
                KArg::I64(n64(rows)),
                KArg::I32(i32_of(t, "sequence length")?),
                KArg::I32(i32_of(width, "row width")?),
                KArg::I32(i32_of(heads, "heads")?),
                KArg::I32(i32_of(hd, "head size")?),
                KArg::F32(if backward { -1.0 } else { 1.0 }),
            ],
        )?;
        self.read(&xb, x)
    }

    pub(super) fn gpu_gelu_forward(&self, out: &mut [f32], inp: &[f32]) -> Result<(), GpuError> {
        let (o, x) = (self.zeros(DType::Bf16, out.len())?, self.bf16(inp)?);
        self.run(
            "act",
            "gelu_forward",
            launch::elementwise(inp.len() as u64),
            &[KArg::Buf(&o), KArg::Buf(&x), KArg::I64(n64(inp.len()))],
        )?;
        self.read(&o, out)
    }

    pub(super) fn gpu_gelu_backward(
        &self,
        dinp: &mut [f32],
        inp: &[f32],
        dout: &[f32],
    ) -> Result<(), GpuError> {
        let (d, x, dy) = (
            self.zeros(DType::Bf16, dinp.len())?,
            self.bf16(inp)?,
            self.bf16(dout)?,
        );
        self.run(
            "act",
            "gelu_backward",
            launch::elementwise(inp.len() as u64),
            &[
                KArg::Buf(&d),
                KArg::Buf(&x),
                KArg::Buf(&dy),
                KArg::I64(n64(inp.len())),
            ],
        )?;
        self.read(&d, dinp)
    }

    pub(super) fn gpu_swiglu_forward(
        &self,
        out: &mut [f32],
        inp: &[f32],
        f: usize,
    ) -> Result<(), GpuError> {
        let n = rows_of(out.len(), f);
        let (o, x) = (self.zeros(DType::Bf16, out.len())?, self.bf16(inp)?);
        self.run(
            "act",
            "swiglu_forward",
            launch::elementwise((n * f) as u64),
            &[
                KArg::Buf(&o),
                KArg::Buf(&x),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(f, "features")?),
            ],
        )?;
        self.read(&o, out)
    }

    pub(super) fn gpu_swiglu_backward(
        &self,
        dinp: &mut [f32],
        inp: &[f32],
        dout: &[f32],
        f: usize,
    ) -> Result<(), GpuError> {
        let n = rows_of(dout.len(), f);
        let (d, x, dy) = (
            self.zeros(DType::Bf16, dinp.len())?,
            self.bf16(inp)?,
            self.bf16(dout)?,
        );
        self.run(
            "act",
            "swiglu_backward",
            launch::elementwise((n * f) as u64),
            &[
                KArg::Buf(&d),
                KArg::Buf(&x),
                KArg::Buf(&dy),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(f, "features")?),
            ],
        )?;
        self.read(&d, dinp)
    }
}
