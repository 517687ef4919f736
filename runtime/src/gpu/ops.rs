//! [`GpuKernels`]: the [`Kernels`] interface on any [`Launcher`] — which kernels to launch, with
//! which arguments and geometry, and the bf16/f32 conversions around them.
//!
//! Every launch is checked against the kernel's signature parsed from its .cu source
//! ([`kernels::signature`]) before it reaches the device. Inputs the GPU stores as bf16 are
//! rounded on upload; statistics, gradient accumulators and optimizer state stay f32.
#![allow(clippy::too_many_arguments)]

use super::kernels::{self, Param};
use super::launch::{self, Geometry};
use super::{bf16, DType, GpuError, HostData, HostVec, KArg, Launcher};
use crate::cpu::AttnShape;
use crate::ops::{AdamWStep, GemmShape, Kernels, RopeShape, Storage};

/// Relative tolerance of bf16-stored inputs against an f64 reference: inputs and outputs are
/// rounded to 8 significant bits (relative step 2⁻⁸ ≈ 3.9e-3), and reductions over a few
/// hundred such terms add a few steps more; 2e-2 of the tensor's largest magnitude bounds that
/// with margin and still catches any indexing or formula error (those are O(1)).
pub const BF16_RTOL: f32 = 2e-2;
/// f32-only paths (AdamW on master weights): a few ulps of reassociation and `sqrtf`.
pub const F32_RTOL: f32 = 1e-5;

/// The GPU kernels behind [`Kernels`], on launcher `L`.
pub struct GpuKernels<L: Launcher> {
    launcher: L,
}

/// A size as the kernels' `long long` argument (usize ≤ i64::MAX on every supported target).
pub(super) fn n64(x: usize) -> i64 {
    x as i64
}

impl<L: Launcher> GpuKernels<L> {
    pub fn new(launcher: L) -> Self {
        GpuKernels { launcher }
    }

    pub fn launcher(&self) -> &L {
        &self.launcher
    }

    pub(super) fn bf16(&self, x: &[f32]) -> Result<L::Buf, GpuError> {
        self.launcher.upload(HostData::Bf16(&bf16::encode(x)))
    }

    pub(super) fn f32(&self, x: &[f32]) -> Result<L::Buf, GpuError> {
        self.launcher.upload(HostData::F32(x))
    }

    pub(super) fn u32(&self, x: &[u32]) -> Result<L::Buf, GpuError> {
        self.launcher.upload(HostData::U32(x))
    }

    pub(super) fn zeros(&self, dtype: DType, len: usize) -> Result<L::Buf, GpuError> {
        self.launcher.alloc_zeros(dtype, len)
    }

    pub(super) fn read(&self, buf: &L::Buf, out: &mut [f32]) -> Result<(), GpuError> {
        let host = self.launcher.download(buf)?;
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

    /// Checks `args` against the kernel's signature and the geometry against the device, then
    /// launches (nothing when `geometry` is `None`: no work).
    pub(super) fn run(
        &self,
        module: &str,
        function: &'static str,
        geometry: Option<Geometry>,
        args: &[KArg<'_, L::Buf>],
    ) -> Result<(), GpuError> {
        let bad = |problem: String| GpuError::BadLaunch {
            kernel: format!("{module}::{function}"),
            problem,
        };
        let m = kernels::module(module).ok_or_else(|| bad("no such module".into()))?;
        let sig =
            kernels::signature(module, function).ok_or_else(|| bad("no such kernel".into()))?;
        if sig.params.len() != args.len() {
            return Err(bad(format!(
                "{} arguments passed, the kernel takes {}",
                args.len(),
                sig.params.len()
            )));
        }
        for (i, ((param, name), arg)) in sig.params.iter().zip(args).enumerate() {
            let ok = match (param, arg) {
                (Param::Ptr { elem, .. }, KArg::Buf(b)) => L::dtype(b) == *elem,
                (Param::Ptr { elem, .. }, KArg::At(b, at)) => {
                    L::dtype(b) == *elem && *at <= L::len(b)
                }
                (Param::Ptr { .. }, KArg::Null) => true,
                (Param::I32, KArg::I32(_))
                | (Param::I64, KArg::I64(_))
                | (Param::F32, KArg::F32(_)) => true,
                _ => false,
            };
            if !ok {
                let got = match arg {
                    KArg::Buf(b) => format!("a {:?} buffer", L::dtype(b)),
                    KArg::At(b, at) => format!(
                        "a {:?} buffer of {} elements at offset {at}",
                        L::dtype(b),
                        L::len(b)
                    ),
                    KArg::Null => "null".into(),
                    KArg::I32(_) => "an i32".into(),
                    KArg::I64(_) => "an i64".into(),
                    KArg::F32(_) => "an f32".into(),
                };
                return Err(bad(format!(
                    "argument {i} ({name}) is {param:?}, got {got}"
                )));
            }
        }
        let Some(g) = geometry else {
            return Ok(());
        };
        if g.threads() % 32 != 0 || g.threads() > 1024 {
            return Err(bad(format!(
                "{} threads per block: must be whole warps, at most 1024",
                g.threads()
            )));
        }
        if g.shared_bytes > self.launcher.max_shared_bytes() {
            return Err(bad(format!(
                "{} bytes of shared memory, the device allows {}",
                g.shared_bytes,
                self.launcher.max_shared_bytes()
            )));
        }
        self.launcher.launch(m, function, &g, args)
    }

    /// `dst (c) += Σ_chunks partial[k·stride + offset ..][..c]`.
    pub(super) fn add_partials(
        &self,
        dst: &mut [f32],
        partial: &L::Buf,
        chunks: u32,
        stride: usize,
        offset: usize,
    ) -> Result<(), GpuError> {
        let d = self.f32(dst)?;
        let c = dst.len();
        self.run(
            "reduce",
            "sum_partials",
            launch::elementwise(c as u64),
            &[
                KArg::Buf(&d),
                KArg::Buf(partial),
                KArg::I32(chunks as i32),
                KArg::I64(n64(c)),
                KArg::I64(n64(stride)),
                KArg::I64(n64(offset)),
            ],
        )?;
        self.read(&d, dst)
    }
}

pub(super) fn rows_of(len: usize, width: usize) -> usize {
    len.checked_div(width).unwrap_or(0)
}

pub(super) fn i32_of(x: usize, what: &str) -> Result<i32, GpuError> {
    i32::try_from(x).map_err(|_| GpuError::Unsupported {
        what: format!("{what} = {x} does not fit the kernels' 32-bit argument"),
        fix: "split the work into smaller pieces".into(),
    })
}

impl<L: Launcher> Kernels for GpuKernels<L> {
    fn name(&self) -> String {
        self.launcher.describe()
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
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        if g.k == 0 {
            if !acc {
                out.fill(0.0);
            }
            return Ok(());
        }
        let col = g.to_col_major()?;
        let (ab, bb) = (self.bf16(a)?, self.bf16(b)?);
        // Accumulating products are gradient accumulators: f32 output, beta = 1.
        let c = if acc {
            self.f32(out)?
        } else {
            self.zeros(DType::Bf16, out.len())?
        };
        self.launcher.gemm(
            &col,
            (&bb, 0),
            (&ab, 0),
            (&c, 0),
            1.0,
            if acc { 1.0 } else { 0.0 },
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
        let col = g.to_col_major()?;
        let (xb, wb, bb) = (self.bf16(x)?, self.bf16(w)?, self.bf16(bias)?);
        let mut c = self.zeros(DType::Bf16, out.len())?;
        self.launcher.gemm_bias(&col, &wb, &xb, &mut c, &bb)?;
        self.read(&c, out)
    }

    fn bias_backward(&self, dbias: &mut [f32], dout: &[f32], c: usize) -> Result<(), GpuError> {
        let n = rows_of(dout.len(), c);
        let ch = launch::row_chunks(n as u64);
        let partial = self.zeros(DType::F32, ch.chunks as usize * c)?;
        let d = self.bf16(dout)?;
        self.run(
            "reduce",
            "column_sums",
            (n > 0).then(|| launch::per_channel(c, ch)).transpose()?,
            &[
                KArg::Buf(&partial),
                KArg::Buf(&d),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(c, "channels")?),
                KArg::I64(ch.rows_per_chunk as i64),
            ],
        )?;
        self.add_partials(dbias, &partial, ch.chunks, c, 0)
    }

    fn embedding_forward(
        &self,
        out: &mut [f32],
        tokens: &[u32],
        wte: &[f32],
        vocab_start: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        let n = tokens.len();
        let o = self.zeros(DType::Bf16, n * c)?;
        let (t, w) = (self.u32(tokens)?, self.bf16(wte)?);
        self.run(
            "embedding",
            "embedding_forward",
            launch::elementwise((n * c) as u64),
            &[
                KArg::Buf(&o),
                KArg::Buf(&t),
                KArg::Buf(&w),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(c, "channels")?),
                KArg::I64(n64(vocab_start)),
                KArg::I64(n64(rows_of(wte.len(), c))),
            ],
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
        let n = tokens.len();
        let (dw, t, d) = (self.f32(dwte)?, self.u32(tokens)?, self.bf16(dout)?);
        self.run(
            "embedding",
            "embedding_backward",
            launch::per_item(c as u64)?,
            &[
                KArg::Buf(&dw),
                KArg::Buf(&t),
                KArg::Buf(&d),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(c, "channels")?),
                KArg::I64(n64(vocab_start)),
                KArg::I64(n64(rows_of(dwte.len(), c))),
            ],
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
        let n = rows_of(out.len(), c);
        let (o, w) = (self.bf16(out)?, self.bf16(wpe)?);
        self.run(
            "embedding",
            "pos_embedding_forward",
            launch::elementwise((n * c) as u64),
            &[
                KArg::Buf(&o),
                KArg::Buf(&w),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(t, "sequence")?),
                KArg::I32(i32_of(c, "channels")?),
                KArg::I64(0),
            ],
        )?;
        self.read(&o, out)
    }

    fn pos_embedding_backward(
        &self,
        dwpe: &mut [f32],
        dout: &[f32],
        t: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        let n = rows_of(dout.len(), c);
        let (dw, d) = (self.f32(dwpe)?, self.bf16(dout)?);
        self.run(
            "embedding",
            "pos_embedding_backward",
            launch::per_item((t * c) as u64)?,
            &[
                KArg::Buf(&dw),
                KArg::Buf(&d),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(t, "sequence")?),
                KArg::I32(i32_of(c, "channels")?),
            ],
        )?;
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
        self.gpu_layernorm_forward(out, mean, rstd, inp, weight, bias, c, eps)
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
        self.gpu_layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, c)
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
        self.gpu_rmsnorm_forward(out, rstd, inp, weight, c, eps)
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
        self.gpu_rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, c)
    }

    fn attention_forward(
        &self,
        y: &mut [f32],
        saved: &mut Vec<f32>,
        qkv: &[f32],
        s: AttnShape,
    ) -> Result<(), GpuError> {
        self.gpu_attention_forward(y, saved, qkv, s)
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
        self.gpu_attention_backward(dqkv, dy, qkv, y, saved, s)
    }

    fn rope(
        &self,
        x: &mut [f32],
        shape: RopeShape,
        tables: (&[f32], &[f32]),
        backward: bool,
    ) -> Result<(), GpuError> {
        self.gpu_rope(x, shape, tables, backward)
    }

    fn residual_add(&self, out: &mut [f32], a: &[f32], b: &[f32]) -> Result<(), GpuError> {
        let (o, x, y) = (
            self.zeros(DType::Bf16, out.len())?,
            self.bf16(a)?,
            self.bf16(b)?,
        );
        self.run(
            "reduce",
            "residual_add",
            launch::elementwise(out.len() as u64),
            &[
                KArg::Buf(&o),
                KArg::Buf(&x),
                KArg::Buf(&y),
                KArg::I64(n64(out.len())),
            ],
        )?;
        self.read(&o, out)
    }

    fn sum_squares(&self, x: &[f32]) -> Result<f64, GpuError> {
        // Chunks of 4096 elements, one thread each; the partials are added here, in order.
        const PER_CHUNK: usize = 4096;
        let chunks = x.len().div_ceil(PER_CHUNK);
        if chunks == 0 {
            return Ok(0.0);
        }
        let (xs, partial) = (self.f32(x)?, self.zeros(DType::F32, chunks)?);
        self.run(
            "reduce",
            "sum_squares",
            launch::elementwise(chunks as u64),
            &[
                KArg::Buf(&partial),
                KArg::Buf(&xs),
                KArg::I64(n64(x.len())),
                KArg::I64(n64(PER_CHUNK)),
                KArg::I64(n64(chunks)),
            ],
        )?;
        let mut sums = vec![0.0f32; chunks];
        self.read(&partial, &mut sums)?;
        Ok(sums.iter().map(|&v| f64::from(v)).sum())
    }

    fn gelu_forward(&self, out: &mut [f32], inp: &[f32]) -> Result<(), GpuError> {
        self.gpu_gelu_forward(out, inp)
    }

    fn gelu_backward(&self, dinp: &mut [f32], inp: &[f32], dout: &[f32]) -> Result<(), GpuError> {
        self.gpu_gelu_backward(dinp, inp, dout)
    }

    fn swiglu_forward(&self, out: &mut [f32], inp: &[f32], f: usize) -> Result<(), GpuError> {
        self.gpu_swiglu_forward(out, inp, f)
    }

    fn swiglu_backward(
        &self,
        dinp: &mut [f32],
        inp: &[f32],
        dout: &[f32],
        f: usize,
    ) -> Result<(), GpuError> {
        self.gpu_swiglu_backward(dinp, inp, dout, f)
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
        self.gpu_crossentropy_forward(losses, max, sumexp, logits, targets, v)
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
        self.gpu_crossentropy_backward(logits, max, sumexp, targets, dlosses, vocab_start, v)
    }

    fn crossentropy_fused(
        &self,
        losses: &mut [f32],
        logits: &mut [f32],
        targets: &[u32],
        dlosses: &[f32],
        v: usize,
    ) -> Result<(), GpuError> {
        self.gpu_crossentropy_fused(losses, logits, targets, dlosses, v)
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
        let n = params.len();
        let (p, g, mb, vb) = (
            self.f32(params)?,
            self.f32(grads)?,
            self.f32(m)?,
            self.f32(v)?,
        );
        let p16 = params_bf16
            .as_ref()
            .map(|_| self.zeros(DType::Bf16, n))
            .transpose()?;
        let (bc1, bc2) = step.bias_corrections();
        self.run(
            "adamw",
            "adamw_step",
            launch::elementwise(n as u64),
            &[
                KArg::Buf(&p),
                p16.as_ref().map_or(KArg::Null, KArg::Buf),
                KArg::Buf(&g),
                KArg::Buf(&mb),
                KArg::Buf(&vb),
                KArg::I64(n64(n)),
                KArg::F32(step.lr),
                KArg::F32(step.beta1),
                KArg::F32(step.beta2),
                KArg::F32(step.eps),
                KArg::F32(step.weight_decay),
                KArg::F32(bc1),
                KArg::F32(bc2),
                KArg::F32(step.grad_scale),
            ],
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
