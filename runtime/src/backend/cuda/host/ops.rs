//! [`GpuKernels`]: the host-slice [`Kernels`] interface (the op tests' surface) on any
//! [`Launcher`], through the executor's own [`Device`] backend: each call uploads its inputs,
//! runs the same `Device` method the executor runs, and downloads the outputs. So the op tests
//! in `runtime/tests/ops.rs` check exactly the launches training uses. Inputs the GPU stores as
//! bf16 are rounded on upload; statistics, gradient accumulators and optimizer state stay f32.
#![allow(clippy::too_many_arguments)]

use std::ops::Range;

use super::launch::{self, i32_of, n64};
use super::{DType, Device, GpuError, HostData, HostVec, KArg, Launcher};
use crate::backend::ops::{AdamWStep, GemmShape, Kernels, RopeShape, Storage};
use crate::backend::AttnShape;
use crate::backend::{bf16, Backend};

/// Relative tolerance of bf16-stored inputs against an f64 reference: inputs and outputs are
/// rounded to 8 significant bits (relative step 2⁻⁸ ≈ 3.9e-3), and reductions over a few
/// hundred such terms add a few steps more; 2e-2 of the tensor's largest magnitude bounds that
/// with margin and still catches any indexing or formula error (those are O(1)).
pub const BF16_RTOL: f32 = 2e-2;
/// f32-only paths (AdamW on master weights): a few ulps of reassociation and `sqrtf`.
pub const F32_RTOL: f32 = 1e-5;

/// The GPU kernels behind [`Kernels`], on launcher `L`.
pub struct GpuKernels<L: Launcher> {
    dev: Device<L>,
}

type D<L> = Device<L>;

impl<L: Launcher> GpuKernels<L> {
    pub fn new(launcher: L) -> Self {
        GpuKernels {
            dev: Device::new(launcher),
        }
    }

    pub fn launcher(&self) -> &L {
        self.dev.launcher()
    }

    fn bf16(&self, x: &[f32]) -> Result<L::Buf, GpuError> {
        self.launcher().upload(HostData::Bf16(&bf16::encode(x)))
    }

    fn f32(&self, x: &[f32]) -> Result<L::Buf, GpuError> {
        self.launcher().upload(HostData::F32(x))
    }

    fn u32(&self, x: &[u32]) -> Result<L::Buf, GpuError> {
        self.launcher().upload(HostData::U32(x))
    }

    /// `x` on the device in `storage`'s element type (bf16 or f32).
    fn stored(&self, x: &[f32], storage: Storage) -> Result<L::Buf, GpuError> {
        match storage {
            Storage::Bf16 => self.bf16(x),
            Storage::F32 => self.f32(x),
        }
    }

    fn zeros(&self, dtype: DType, len: usize) -> Result<L::Buf, GpuError> {
        self.launcher().alloc_zeros(dtype, len)
    }

    fn read(&self, buf: &L::Buf, out: &mut [f32]) -> Result<(), GpuError> {
        let host = self.launcher().download(buf)?;
        let n = match &host {
            HostVec::Bf16(v) => v.len(),
            HostVec::F32(v) => v.len(),
            HostVec::U32(v) => v.len(),
        };
        if n != out.len() {
            return Err(GpuError::shape(
                "download",
                format!(
                    "device buffer of {n} elements into a host slice of {}",
                    out.len()
                ),
            ));
        }
        match host {
            HostVec::Bf16(v) => out
                .iter_mut()
                .zip(v)
                .for_each(|(o, b)| *o = bf16::to_f32(b)),
            HostVec::F32(v) => out.copy_from_slice(&v),
            HostVec::U32(_) => {
                return Err(GpuError::shape("download", "u32 buffer read as f32"));
            }
        }
        Ok(())
    }
}

impl<L: Launcher + Sync + 'static> Kernels for GpuKernels<L>
where
    L::Buf: Send + Sync,
{
    fn name(&self) -> String {
        self.launcher().describe()
    }

    fn rtol(&self, storage: Storage) -> f32 {
        match storage {
            Storage::Bf16 => BF16_RTOL,
            Storage::F32 => F32_RTOL,
        }
    }

    fn gemm(
        &self,
        out: &mut [f32],
        a: &[f32],
        b: &[f32],
        g: GemmShape,
        acc: bool,
    ) -> Result<(), GpuError> {
        let (ab, bb) = (self.bf16(a)?, self.bf16(b)?);
        // Accumulating products are gradient accumulators: f32 output, beta = 1.
        let mut c = if acc {
            self.f32(out)?
        } else {
            self.zeros(DType::Bf16, out.len())?
        };
        self.dev.gemm(
            D::<L>::view_mut(&mut c),
            D::<L>::view(&ab),
            D::<L>::view(&bb),
            g,
            acc,
        )?;
        self.read(&c, out)
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
        let g = GemmShape {
            m: n,
            k: in_f,
            n: out_f,
            trans_a: false,
            trans_b: true,
        };
        let Some(bias) = bias else {
            return self.gemm(out, x, w, g, false);
        };
        if n == 0 || out_f == 0 {
            return Ok(());
        }
        // cuBLASLt's bias epilogue (not used by the executor, which adds the bias after the
        // TP reduction): checked here so the epilogue path stays correct.
        let col = g.to_col_major()?;
        let (xb, wb, bb) = (self.bf16(x)?, self.bf16(w)?, self.bf16(bias)?);
        let mut c = self.zeros(DType::Bf16, out.len())?;
        self.launcher().gemm_bias(&col, &wb, &xb, &mut c, &bb)?;
        self.read(&c, out)
    }

    fn bias_backward(&self, dbias: &mut [f32], dout: &[f32], _c: usize) -> Result<(), GpuError> {
        let (mut db, d) = (self.f32(dbias)?, self.bf16(dout)?);
        self.dev
            .bias_backward(D::<L>::view_mut(&mut db), D::<L>::view(&d))?;
        self.read(&db, dbias)
    }

    fn embedding_forward(
        &self,
        out: &mut [f32],
        tokens: &[u32],
        wte: &[f32],
        vocab_start: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        let mut o = self.zeros(DType::Bf16, out.len())?;
        let (t, w) = (self.dev.ids(tokens.to_vec())?, self.bf16(wte)?);
        self.dev.embedding_forward(
            D::<L>::view_mut(&mut o),
            &t,
            D::<L>::view(&w),
            vocab_start,
            c,
        )?;
        self.read(&o, out)
    }

    fn embedding_backward(
        &self,
        dwte: &mut [f32],
        tokens: &[u32],
        dout: &[f32],
        vocab_start: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        let (mut dw, d) = (self.f32(dwte)?, self.bf16(dout)?);
        let t = self.dev.ids(tokens.to_vec())?;
        self.dev.embedding_backward(
            D::<L>::view_mut(&mut dw),
            &t,
            D::<L>::view(&d),
            vocab_start,
            c,
        )?;
        self.read(&dw, dwte)
    }

    fn pos_embedding_forward(
        &self,
        out: &mut [f32],
        wpe: &[f32],
        t: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        let (mut o, w) = (self.bf16(out)?, self.bf16(wpe)?);
        self.dev
            .pos_embedding_forward(D::<L>::view_mut(&mut o), D::<L>::view(&w), t, c, 0)?;
        self.read(&o, out)
    }

    fn pos_embedding_backward(
        &self,
        dwpe: &mut [f32],
        dout: &[f32],
        t: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        let (mut dw, d) = (self.f32(dwpe)?, self.bf16(dout)?);
        self.dev
            .pos_embedding_backward(D::<L>::view_mut(&mut dw), D::<L>::view(&d), t, c)?;
        self.read(&dw, dwpe)
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
        let mut o = self.zeros(DType::Bf16, out.len())?;
        let (mut mb, mut rb) = (
            self.zeros(DType::F32, mean.len())?,
            self.zeros(DType::F32, rstd.len())?,
        );
        let (x, w) = (self.bf16(inp)?, self.bf16(weight)?);
        let b = bias.map(|b| self.bf16(b)).transpose()?;
        self.dev.layernorm_forward(
            D::<L>::view_mut(&mut o),
            D::<L>::view_mut(&mut mb),
            D::<L>::view_mut(&mut rb),
            D::<L>::view(&x),
            D::<L>::view(&w),
            b.as_ref().map(D::<L>::view),
            c,
            eps,
        )?;
        self.read(&o, out)?;
        self.read(&mb, mean)?;
        self.read(&rb, rstd)
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
        let (mut dx, dy, x, w) = (
            self.bf16(dinp)?,
            self.bf16(dout)?,
            self.bf16(inp)?,
            self.bf16(weight)?,
        );
        let (mb, rb, mut dw) = (self.f32(mean)?, self.f32(rstd)?, self.f32(dweight)?);
        let mut db = dbias.as_ref().map(|b| self.f32(b)).transpose()?;
        self.dev.layernorm_backward(
            D::<L>::view_mut(&mut dx),
            D::<L>::view_mut(&mut dw),
            db.as_mut().map(D::<L>::view_mut),
            D::<L>::view(&dy),
            D::<L>::view(&x),
            D::<L>::view(&w),
            D::<L>::view(&mb),
            D::<L>::view(&rb),
            c,
        )?;
        self.read(&dx, dinp)?;
        self.read(&dw, dweight)?;
        if let (Some(out), Some(b)) = (dbias, db.as_ref()) {
            self.read(b, out)?;
        }
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
        let mut o = self.zeros(DType::Bf16, out.len())?;
        let mut rb = self.zeros(DType::F32, rstd.len())?;
        let (x, w) = (self.bf16(inp)?, self.bf16(weight)?);
        self.dev.rmsnorm_forward(
            D::<L>::view_mut(&mut o),
            D::<L>::view_mut(&mut rb),
            D::<L>::view(&x),
            D::<L>::view(&w),
            c,
            eps,
        )?;
        self.read(&o, out)?;
        self.read(&rb, rstd)
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
        let (mut dx, dy, x, w) = (
            self.bf16(dinp)?,
            self.bf16(dout)?,
            self.bf16(inp)?,
            self.bf16(weight)?,
        );
        let (rb, mut dw) = (self.f32(rstd)?, self.f32(dweight)?);
        self.dev.rmsnorm_backward(
            D::<L>::view_mut(&mut dx),
            D::<L>::view_mut(&mut dw),
            D::<L>::view(&dy),
            D::<L>::view(&x),
            D::<L>::view(&w),
            D::<L>::view(&rb),
            c,
        )?;
        self.read(&dx, dinp)?;
        self.read(&dw, dweight)
    }

    fn attention_forward(
        &self,
        y: &mut [f32],
        saved: &mut Vec<f32>,
        qkv: &[f32],
        s: AttnShape,
    ) -> Result<(), GpuError> {
        let q = self.bf16(qkv)?;
        let mut yb = self.zeros(DType::Bf16, y.len())?;
        let mut lse = self.zeros(DType::F32, self.dev.attention_saved_len(&s))?;
        self.dev.attention_forward(
            D::<L>::view_mut(&mut yb),
            D::<L>::view_mut(&mut lse),
            D::<L>::view(&q),
            s,
        )?;
        self.read(&yb, y)?;
        saved.clear();
        saved.resize(self.dev.attention_saved_len(&s), 0.0);
        self.read(&lse, saved)
    }

    fn attention_backward(
        &self,
        dqkv: &mut [f32],
        dy: &[f32],
        qkv: &[f32],
        y: &[f32],
        saved: &[f32],
        s: AttnShape,
    ) -> Result<(), GpuError> {
        let (q, dyb, yb, lse) = (
            self.bf16(qkv)?,
            self.bf16(dy)?,
            self.bf16(y)?,
            self.f32(saved)?,
        );
        let mut delta = self.zeros(DType::F32, self.dev.attention_scratch_len(&s))?;
        let mut dq = self.zeros(DType::Bf16, qkv.len())?;
        self.dev.attention_backward(
            D::<L>::view_mut(&mut dq),
            D::<L>::view_mut(&mut delta),
            D::<L>::view(&dyb),
            D::<L>::view(&q),
            D::<L>::view(&yb),
            D::<L>::view(&lse),
            s,
        )?;
        self.read(&dq, dqkv)
    }

    fn rope(
        &self,
        x: &mut [f32],
        shape: RopeShape,
        (cos, sin): (&[f32], &[f32]),
        backward: bool,
    ) -> Result<(), GpuError> {
        let (mut xb, c, s) = (self.bf16(x)?, self.f32(cos)?, self.f32(sin)?);
        self.dev.rope(
            D::<L>::view_mut(&mut xb),
            shape,
            D::<L>::view(&c),
            D::<L>::view(&s),
            backward,
        )?;
        self.read(&xb, x)
    }

    fn residual_add(&self, out: &mut [f32], a: &[f32], b: &[f32]) -> Result<(), GpuError> {
        let (mut x, y) = (self.bf16(a)?, self.bf16(b)?);
        self.dev
            .add_assign(D::<L>::view_mut(&mut x), D::<L>::view(&y))?;
        self.read(&x, out)
    }

    fn sum_squares(&self, x: &[f32]) -> Result<f64, GpuError> {
        let xs = self.f32(x)?;
        self.dev.sum_squares(D::<L>::view(&xs))
    }

    fn fill(
        &self,
        x: &mut [f32],
        range: Range<usize>,
        value: f32,
        storage: Storage,
    ) -> Result<(), GpuError> {
        let mut xb = self.stored(x, storage)?;
        let view = D::<L>::sub_mut(D::<L>::view_mut(&mut xb), range);
        self.dev.fill(view, value)?;
        self.read(&xb, x)
    }

    fn copy(
        &self,
        dst: &mut [f32],
        at: usize,
        src: &[f32],
        from: Range<usize>,
        storage: Storage,
    ) -> Result<(), GpuError> {
        let (mut d, s) = (self.stored(dst, storage)?, self.stored(src, storage)?);
        let n = from.len();
        self.dev.copy(
            D::<L>::sub_mut(D::<L>::view_mut(&mut d), at..at + n),
            D::<L>::sub(D::<L>::view(&s), from),
        )?;
        self.read(&d, dst)
    }

    fn add_bias(&self, y: &mut [f32], b: &[f32]) -> Result<(), GpuError> {
        let (mut yb, bb) = (self.bf16(y)?, self.bf16(b)?);
        self.dev
            .add_bias(D::<L>::view_mut(&mut yb), D::<L>::view(&bb))?;
        self.read(&yb, y)
    }

    fn scale(&self, x: &mut [f32], s: f32) -> Result<(), GpuError> {
        let mut xb = self.bf16(x)?;
        self.dev.scale(D::<L>::view_mut(&mut xb), s)?;
        self.read(&xb, x)
    }

    fn gelu_forward(&self, out: &mut [f32], inp: &[f32]) -> Result<(), GpuError> {
        let (mut o, x) = (self.zeros(DType::Bf16, out.len())?, self.bf16(inp)?);
        self.dev
            .gelu_forward(D::<L>::view_mut(&mut o), D::<L>::view(&x))?;
        self.read(&o, out)
    }

    fn gelu_backward(&self, dinp: &mut [f32], inp: &[f32], dout: &[f32]) -> Result<(), GpuError> {
        let mut d = self.zeros(DType::Bf16, dinp.len())?;
        let (x, dy) = (self.bf16(inp)?, self.bf16(dout)?);
        self.dev.gelu_backward(
            D::<L>::view_mut(&mut d),
            D::<L>::view(&x),
            D::<L>::view(&dy),
        )?;
        self.read(&d, dinp)
    }

    fn bias_gelu_forward(
        &self,
        h: &mut [f32],
        a: &mut [f32],
        bias: Option<&[f32]>,
    ) -> Result<(), GpuError> {
        let (mut hb, mut ab) = (self.bf16(h)?, self.zeros(DType::Bf16, a.len())?);
        let b = bias.map(|b| self.bf16(b)).transpose()?;
        self.dev.bias_gelu_forward(
            D::<L>::view_mut(&mut hb),
            D::<L>::view_mut(&mut ab),
            b.as_ref().map(D::<L>::view),
        )?;
        self.read(&hb, h)?;
        self.read(&ab, a)
    }

    fn gelu_backward_bias(
        &self,
        dinp: &mut [f32],
        dbias: Option<&mut [f32]>,
        inp: &[f32],
        dout: &[f32],
    ) -> Result<(), GpuError> {
        let mut d = self.zeros(DType::Bf16, dinp.len())?;
        let (x, dy) = (self.bf16(inp)?, self.bf16(dout)?);
        let mut db = dbias.as_ref().map(|b| self.f32(b)).transpose()?;
        self.dev.gelu_backward_bias(
            D::<L>::view_mut(&mut d),
            db.as_mut().map(D::<L>::view_mut),
            D::<L>::view(&x),
            D::<L>::view(&dy),
        )?;
        self.read(&d, dinp)?;
        if let (Some(out), Some(b)) = (dbias, db.as_ref()) {
            self.read(b, out)?;
        }
        Ok(())
    }

    fn add_bias_residual(
        &self,
        y: &mut [f32],
        bias: Option<&[f32]>,
        res: &[f32],
    ) -> Result<(), GpuError> {
        let (mut yb, r) = (self.bf16(y)?, self.bf16(res)?);
        let b = bias.map(|b| self.bf16(b)).transpose()?;
        self.dev.add_bias_residual(
            D::<L>::view_mut(&mut yb),
            b.as_ref().map(D::<L>::view),
            D::<L>::view(&r),
        )?;
        self.read(&yb, y)
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
        let (mut xb, r, w) = (self.bf16(x)?, self.bf16(res)?, self.bf16(weight)?);
        let pb = proj_bias.map(|b| self.bf16(b)).transpose()?;
        let b = bias.map(|b| self.bf16(b)).transpose()?;
        let mut o = self.zeros(DType::Bf16, out.len())?;
        let (mut mb, mut rb) = (
            self.zeros(DType::F32, mean.len())?,
            self.zeros(DType::F32, rstd.len())?,
        );
        self.dev.residual_layernorm_forward(
            D::<L>::view_mut(&mut xb),
            pb.as_ref().map(D::<L>::view),
            D::<L>::view(&r),
            D::<L>::view_mut(&mut o),
            D::<L>::view_mut(&mut mb),
            D::<L>::view_mut(&mut rb),
            D::<L>::view(&w),
            b.as_ref().map(D::<L>::view),
            c,
            eps,
        )?;
        self.read(&xb, x)?;
        self.read(&o, out)?;
        self.read(&mb, mean)?;
        self.read(&rb, rstd)
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
        let (mut xb, r, w) = (self.bf16(x)?, self.bf16(res)?, self.bf16(weight)?);
        let pb = proj_bias.map(|b| self.bf16(b)).transpose()?;
        let mut o = self.zeros(DType::Bf16, out.len())?;
        let mut rb = self.zeros(DType::F32, rstd.len())?;
        self.dev.residual_rmsnorm_forward(
            D::<L>::view_mut(&mut xb),
            pb.as_ref().map(D::<L>::view),
            D::<L>::view(&r),
            D::<L>::view_mut(&mut o),
            D::<L>::view_mut(&mut rb),
            D::<L>::view(&w),
            c,
            eps,
        )?;
        self.read(&xb, x)?;
        self.read(&o, out)?;
        self.read(&rb, rstd)
    }

    fn swiglu_forward(&self, out: &mut [f32], inp: &[f32], f: usize) -> Result<(), GpuError> {
        let (mut o, x) = (self.zeros(DType::Bf16, out.len())?, self.bf16(inp)?);
        self.dev
            .swiglu_forward(D::<L>::view_mut(&mut o), D::<L>::view(&x), f)?;
        self.read(&o, out)
    }

    fn swiglu_backward(
        &self,
        dinp: &mut [f32],
        inp: &[f32],
        dout: &[f32],
        f: usize,
    ) -> Result<(), GpuError> {
        let mut d = self.zeros(DType::Bf16, dinp.len())?;
        let (x, dy) = (self.bf16(inp)?, self.bf16(dout)?);
        self.dev.swiglu_backward(
            D::<L>::view_mut(&mut d),
            D::<L>::view(&x),
            D::<L>::view(&dy),
            f,
        )?;
        self.read(&d, dinp)
    }

    fn row_max(&self, max: &mut [f32], logits: &[f32], v: usize) -> Result<(), GpuError> {
        let (mut mb, l) = (self.zeros(DType::F32, max.len())?, self.bf16(logits)?);
        self.dev
            .row_max(D::<L>::view_mut(&mut mb), D::<L>::view(&l), v)?;
        self.read(&mb, max)
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
        let mut bb = self.zeros(DType::F32, both.len())?;
        let (l, mb) = (self.bf16(logits)?, self.f32(max)?);
        let t = self.dev.ids(targets.to_vec())?;
        self.dev.ce_partials(
            D::<L>::view_mut(&mut bb),
            D::<L>::view(&l),
            D::<L>::view(&mb),
            &t,
            vocab_start,
            v,
        )?;
        self.read(&bb, both)
    }

    fn ce_losses(
        &self,
        losses: &mut [f32],
        sumexp: &mut [f32],
        max: &[f32],
        both: &[f32],
    ) -> Result<(), GpuError> {
        let (mut lo, mut se) = (
            self.zeros(DType::F32, losses.len())?,
            self.zeros(DType::F32, sumexp.len())?,
        );
        let (mb, bb) = (self.f32(max)?, self.f32(both)?);
        self.dev.ce_losses(
            D::<L>::view_mut(&mut lo),
            D::<L>::view_mut(&mut se),
            D::<L>::view(&mb),
            D::<L>::view(&bb),
        )?;
        self.read(&lo, losses)?;
        self.read(&se, sumexp)
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
        let n = targets.len();
        let (lo, mb, sb) = (
            self.zeros(DType::F32, n)?,
            self.zeros(DType::F32, n)?,
            self.zeros(DType::F32, n)?,
        );
        let (l, t) = (self.bf16(logits)?, self.u32(targets)?);
        self.dev.run(
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
        let (mut l, mb, sb) = (self.bf16(logits)?, self.f32(max)?, self.f32(sumexp)?);
        let (t, dl) = (self.dev.ids(targets.to_vec())?, self.f32(dlosses)?);
        self.dev.crossentropy_backward(
            D::<L>::view_mut(&mut l),
            D::<L>::view(&mb),
            D::<L>::view(&sb),
            &t,
            D::<L>::view(&dl),
            vocab_start,
            v,
        )?;
        self.read(&l, logits)
    }

    fn crossentropy_fused(
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
        self.dev.run(
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

    fn adamw(
        &self,
        params: &mut [f32],
        params_bf16: Option<&mut [f32]>,
        grads: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        step: &AdamWStep,
    ) -> Result<(), GpuError> {
        let (mut p, g, mut mb, mut vb) = (
            self.f32(params)?,
            self.f32(grads)?,
            self.f32(m)?,
            self.f32(v)?,
        );
        let mut p16 = params_bf16
            .as_ref()
            .map(|x| self.zeros(DType::Bf16, x.len()))
            .transpose()?;
        self.dev.adamw(
            D::<L>::view_mut(&mut p),
            p16.as_mut().map(D::<L>::view_mut),
            D::<L>::view(&g),
            D::<L>::view_mut(&mut mb),
            D::<L>::view_mut(&mut vb),
            step,
        )?;
        self.read(&p, params)?;
        self.read(&mb, m)?;
        self.read(&vb, v)?;
        if let (Some(out), Some(b)) = (params_bf16, p16.as_ref()) {
            self.read(b, out)?;
        }
        Ok(())
    }
}
