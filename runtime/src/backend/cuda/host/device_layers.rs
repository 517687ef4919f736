//! [`Device`]'s embedding, norm, attention, RoPE and cross-entropy launches, split from
//! `device.rs` for length. Same rules: views checked against the sizes each kernel addresses,
//! bf16 activations, f32 statistics and gradient accumulators.
#![allow(clippy::too_many_arguments)]

use super::device::Device;
use super::launch;
use super::launch::{i32_of, n64};
use super::views::{need, rows, DMut, DRef, DeviceIds};
use super::{DType, GpuError, KArg, Launcher};
use crate::backend::AttnShape;
use crate::backend::RopeShape;

type V<'a, L> = DRef<'a, <L as Launcher>::Buf>;
type M<'a, L> = DMut<'a, <L as Launcher>::Buf>;

impl<L: Launcher + Sync + 'static> Device<L>
where
    L::Buf: Send + Sync,
{
    pub(super) fn embedding_forward_impl(
        &self,
        out: M<'_, L>,
        ids: &DeviceIds<L::Buf>,
        wte: V<'_, L>,
        vocab_start: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        let n = ids.n;
        need("embedding_forward", out.len, n * c)?;
        let v_local = rows("embedding table", wte.len, c)?;
        self.run(
            "embedding",
            "embedding_forward",
            launch::elementwise((n * c) as u64),
            &[
                out.arg(),
                KArg::Buf(&ids.ids),
                wte.arg(),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(c, "channels")?),
                KArg::I64(n64(vocab_start)),
                KArg::I64(n64(v_local)),
            ],
        )
    }

    pub(super) fn pos_embedding_forward_impl(
        &self,
        out: M<'_, L>,
        wpe: V<'_, L>,
        t: usize,
        c: usize,
        first: usize,
    ) -> Result<(), GpuError> {
        let n = rows("pos_embedding_forward", out.len, c)?;
        if wpe.len < t * c {
            return Err(GpuError::shape(
                "pos_embedding_forward",
                format!("a table of {} elements for {t} positions", wpe.len),
            ));
        }
        self.run(
            "embedding",
            "pos_embedding_forward",
            launch::elementwise((n * c) as u64),
            &[
                out.arg(),
                wpe.arg(),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(t, "sequence")?),
                KArg::I32(i32_of(c, "channels")?),
                KArg::I64(n64(first)),
            ],
        )
    }

    pub(super) fn pos_embedding_backward_impl(
        &self,
        dwpe: M<'_, L>,
        dout: V<'_, L>,
        t: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        let n = rows("pos_embedding_backward", dout.len, c)?;
        if dwpe.len < t * c {
            return Err(GpuError::shape(
                "pos_embedding_backward",
                format!("a table of {} elements for {t} positions", dwpe.len),
            ));
        }
        self.run(
            "embedding",
            "pos_embedding_backward",
            launch::per_item((t * c) as u64)?,
            &[
                dwpe.arg(),
                dout.arg(),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(t, "sequence")?),
                KArg::I32(i32_of(c, "channels")?),
            ],
        )
    }

    pub(super) fn layernorm_forward_impl(
        &self,
        out: M<'_, L>,
        mean: M<'_, L>,
        rstd: M<'_, L>,
        inp: V<'_, L>,
        weight: V<'_, L>,
        bias: Option<V<'_, L>>,
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        let n = rows("layernorm_forward", inp.len, c)?;
        need("layernorm_forward out", out.len, n * c)?;
        need("layernorm_forward mean", mean.len, n)?;
        need("layernorm_forward rstd", rstd.len, n)?;
        need("layernorm weight", weight.len, c)?;
        self.run(
            "norm",
            "layernorm_forward",
            launch::per_row(n as u64, c, 256)?,
            &[
                out.arg(),
                mean.arg(),
                rstd.arg(),
                inp.arg(),
                weight.arg(),
                bias.as_ref().map_or(KArg::Null, |b| b.arg()),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(c, "channels")?),
                KArg::F32(eps),
            ],
        )
    }

    pub(super) fn layernorm_backward_impl(
        &self,
        dinp: M<'_, L>,
        dweight: M<'_, L>,
        dbias: Option<M<'_, L>>,
        dout: V<'_, L>,
        inp: V<'_, L>,
        weight: V<'_, L>,
        mean: V<'_, L>,
        rstd: V<'_, L>,
        c: usize,
    ) -> Result<(), GpuError> {
        let n = rows("layernorm_backward", inp.len, c)?;
        need("layernorm_backward dinp", dinp.len, n * c)?;
        need("layernorm_backward dout", dout.len, n * c)?;
        need("layernorm_backward dweight", dweight.len, c)?;
        let ci = i32_of(c, "channels")?;
        self.run(
            "norm",
            "layernorm_backward",
            launch::per_row(n as u64, c, 256)?,
            &[
                dinp.arg(),
                dout.arg(),
                inp.arg(),
                weight.arg(),
                mean.arg(),
                rstd.arg(),
                KArg::I64(n64(n)),
                KArg::I32(ci),
            ],
        )?;
        let ch = launch::row_chunks(n as u64);
        let partial = self
            .launcher()
            .alloc_zeros(DType::F32, ch.chunks as usize * 2 * c)?;
        self.run(
            "norm",
            "layernorm_param_grads",
            (n > 0).then(|| launch::per_channel(c, ch)).transpose()?,
            &[
                KArg::Buf(&partial),
                dout.arg(),
                inp.arg(),
                mean.arg(),
                rstd.arg(),
                KArg::I64(n64(n)),
                KArg::I32(ci),
                KArg::I64(ch.rows_per_chunk as i64),
            ],
        )?;
        match dbias {
            // The weight's and the bias's gradients side by side (a norm's parameters always
            // are): one sum over both halves of each chunk's partial, `[dw | db]`.
            Some(db) if std::ptr::eq(db.buf, dweight.buf) && db.at == dweight.at + c => {
                need("layernorm_backward dbias", db.len, c)?;
                let both = DMut {
                    buf: dweight.buf,
                    at: dweight.at,
                    len: 2 * c,
                    _excl: std::marker::PhantomData,
                };
                self.add_partials(both, &partial, ch.chunks, 2 * c, 0)
            }
            Some(db) => {
                need("layernorm_backward dbias", db.len, c)?;
                self.add_partials(dweight, &partial, ch.chunks, 2 * c, 0)?;
                self.add_partials(db, &partial, ch.chunks, 2 * c, c)
            }
            None => self.add_partials(dweight, &partial, ch.chunks, 2 * c, 0),
        }
    }

    pub(super) fn rmsnorm_forward_impl(
        &self,
        out: M<'_, L>,
        rstd: M<'_, L>,
        inp: V<'_, L>,
        weight: V<'_, L>,
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        let n = rows("rmsnorm_forward", inp.len, c)?;
        need("rmsnorm_forward out", out.len, n * c)?;
        need("rmsnorm_forward rstd", rstd.len, n)?;
        need("rmsnorm weight", weight.len, c)?;
        self.run(
            "norm",
            "rmsnorm_forward",
            launch::per_row(n as u64, c, 256)?,
            &[
                out.arg(),
                rstd.arg(),
                inp.arg(),
                weight.arg(),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(c, "channels")?),
                KArg::F32(eps),
            ],
        )
    }

    pub(super) fn rmsnorm_backward_impl(
        &self,
        dinp: M<'_, L>,
        dweight: M<'_, L>,
        dout: V<'_, L>,
        inp: V<'_, L>,
        weight: V<'_, L>,
        rstd: V<'_, L>,
        c: usize,
    ) -> Result<(), GpuError> {
        let n = rows("rmsnorm_backward", inp.len, c)?;
        need("rmsnorm_backward dinp", dinp.len, n * c)?;
        need("rmsnorm_backward dout", dout.len, n * c)?;
        need("rmsnorm_backward dweight", dweight.len, c)?;
        let ci = i32_of(c, "channels")?;
        self.run(
            "norm",
            "rmsnorm_backward",
            launch::per_row(n as u64, c, 256)?,
            &[
                dinp.arg(),
                dout.arg(),
                inp.arg(),
                weight.arg(),
                rstd.arg(),
                KArg::I64(n64(n)),
                KArg::I32(ci),
            ],
        )?;
        let ch = launch::row_chunks(n as u64);
        let partial = self
            .launcher()
            .alloc_zeros(DType::F32, ch.chunks as usize * c)?;
        self.run(
            "norm",
            "rmsnorm_param_grads",
            (n > 0).then(|| launch::per_channel(c, ch)).transpose()?,
            &[
                KArg::Buf(&partial),
                dout.arg(),
                inp.arg(),
                rstd.arg(),
                KArg::I64(n64(n)),
                KArg::I32(ci),
                KArg::I64(ch.rows_per_chunk as i64),
            ],
        )?;
        self.add_partials(dweight, &partial, ch.chunks, c, 0)
    }

    pub(super) fn attention_forward_impl(
        &self,
        y: M<'_, L>,
        lse: M<'_, L>,
        qkv: V<'_, L>,
        s: AttnShape,
    ) -> Result<(), GpuError> {
        let n = s.b * s.t;
        need("attention qkv", qkv.len, n * s.qkv_width())?;
        need("attention y", y.len, n * s.y_width())?;
        need("attention log-sum-exp", lse.len, s.b * s.hq * s.t)?;
        let geo = launch::attention(&s, self.launcher().max_shared_bytes())?;
        let scale = 1.0 / (s.hd as f32).sqrt();
        // Tensor cores where the head size allows (a multiple of 16), else CUDA cores.
        let (function, geometry) = match geo.forward_tc {
            Some(g) => ("attention_forward_tc", g),
            None => ("attention_forward", geo.forward),
        };
        self.run(
            "attention",
            function,
            Some(geometry),
            &[
                y.arg(),
                lse.arg(),
                qkv.arg(),
                KArg::I32(i32_of(s.b, "batch")?),
                KArg::I32(i32_of(s.t, "sequence")?),
                KArg::I32(s.hq as i32),
                KArg::I32(s.hkv as i32),
                KArg::I32(s.hd as i32),
                KArg::F32(scale),
            ],
        )
    }

    pub(super) fn attention_backward_impl(
        &self,
        dqkv: M<'_, L>,
        delta: M<'_, L>,
        dy: V<'_, L>,
        qkv: V<'_, L>,
        y: V<'_, L>,
        lse: V<'_, L>,
        s: AttnShape,
    ) -> Result<(), GpuError> {
        let n = s.b * s.t;
        need("attention dqkv", dqkv.len, n * s.qkv_width())?;
        need("attention qkv", qkv.len, n * s.qkv_width())?;
        need("attention dy", dy.len, n * s.y_width())?;
        need("attention y", y.len, n * s.y_width())?;
        need("attention log-sum-exp", lse.len, s.b * s.hq * s.t)?;
        need("attention delta", delta.len, s.b * s.hq * s.t)?;
        let geo = launch::attention(&s, self.launcher().max_shared_bytes())?;
        let (b, t) = (i32_of(s.b, "batch")?, i32_of(s.t, "sequence")?);
        let (hq, hkv, hd) = (s.hq as i32, s.hkv as i32, s.hd as i32);
        let scale = 1.0 / (s.hd as f32).sqrt();
        self.run(
            "attention",
            "attention_delta",
            Some(geo.delta),
            &[
                delta.arg(),
                dy.arg(),
                y.arg(),
                KArg::I32(b),
                KArg::I32(t),
                KArg::I32(hq),
                KArg::I32(hd),
            ],
        )?;
        // dq on tensor cores where the head size allows, as the forward.
        let dq = match geo.forward_tc {
            Some(g) => ("attention_backward_dq_tc", g),
            None => ("attention_backward_dq", geo.backward_dq),
        };
        let dkv = match geo.backward_dkv_tc {
            Some(g) => ("attention_backward_dkv_tc", g),
            None => ("attention_backward_dkv", geo.backward_dkv),
        };
        for (function, g) in [dq, dkv] {
            self.run(
                "attention",
                function,
                Some(g),
                &[
                    dqkv.arg(),
                    dy.arg(),
                    qkv.arg(),
                    lse.arg(),
                    delta.arg(),
                    KArg::I32(b),
                    KArg::I32(t),
                    KArg::I32(hq),
                    KArg::I32(hkv),
                    KArg::I32(hd),
                    KArg::F32(scale),
                ],
            )?;
        }
        Ok(())
    }

    pub(super) fn rope_impl(
        &self,
        x: M<'_, L>,
        shape: RopeShape,
        cos: V<'_, L>,
        sin: V<'_, L>,
        backward: bool,
    ) -> Result<(), GpuError> {
        let RopeShape {
            t,
            width,
            heads,
            hd,
        } = shape;
        if hd % 2 != 0 || heads * hd > width || cos.len < t * hd / 2 || sin.len < t * hd / 2 {
            return Err(GpuError::Unsupported {
                what: format!("RoPE on heads {heads} × {hd} of rows {width} wide with tables for {} positions", cos.len / (hd / 2).max(1)),
                fix: "an even head size, heads × head size within the row, and tables for every position".into(),
            });
        }
        let n = rows("rope", x.len, width)?;
        self.run(
            "rope",
            "rope_rotate",
            launch::elementwise((n * heads * hd / 2) as u64),
            &[
                x.arg(),
                cos.arg(),
                sin.arg(),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(t, "sequence length")?),
                KArg::I32(i32_of(width, "row width")?),
                KArg::I32(i32_of(heads, "heads")?),
                KArg::I32(i32_of(hd, "head size")?),
                KArg::F32(if backward { -1.0 } else { 1.0 }),
            ],
        )
    }

    pub(super) fn row_max_impl(
        &self,
        max: M<'_, L>,
        logits: V<'_, L>,
        v: usize,
    ) -> Result<(), GpuError> {
        let n = max.len;
        need("crossentropy logits", logits.len, n * v)?;
        self.run(
            "crossentropy",
            "crossentropy_row_max",
            launch::per_row(n as u64, v, 1024)?,
            &[
                max.arg(),
                logits.arg(),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(v, "vocabulary")?),
            ],
        )
    }

    pub(super) fn ce_partials_impl(
        &self,
        both: M<'_, L>,
        logits: V<'_, L>,
        max: V<'_, L>,
        targets: &L::Buf,
        vocab_start: usize,
        v: usize,
    ) -> Result<(), GpuError> {
        let n = max.len;
        need("crossentropy partials", both.len, 2 * n)?;
        need("crossentropy logits", logits.len, n * v)?;
        need("crossentropy targets", L::len(targets), n)?;
        self.run(
            "crossentropy",
            "crossentropy_partials",
            launch::per_row(n as u64, v, 1024)?,
            &[
                both.arg(),
                logits.arg(),
                max.arg(),
                KArg::Buf(targets),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(v, "vocabulary")?),
                KArg::I64(n64(vocab_start)),
            ],
        )
    }

    pub(super) fn ce_losses_impl(
        &self,
        losses: M<'_, L>,
        sumexp: M<'_, L>,
        max: V<'_, L>,
        both: V<'_, L>,
    ) -> Result<(), GpuError> {
        let n = losses.len;
        need("crossentropy sumexp", sumexp.len, n)?;
        need("crossentropy max", max.len, n)?;
        need("crossentropy partials", both.len, 2 * n)?;
        self.run(
            "crossentropy",
            "crossentropy_losses",
            launch::elementwise(n as u64),
            &[
                losses.arg(),
                sumexp.arg(),
                max.arg(),
                both.arg(),
                KArg::I64(n64(n)),
            ],
        )
    }

    pub(super) fn crossentropy_backward_impl(
        &self,
        logits: M<'_, L>,
        max: V<'_, L>,
        sumexp: V<'_, L>,
        targets: &L::Buf,
        dlosses: V<'_, L>,
        vocab_start: usize,
        v: usize,
    ) -> Result<(), GpuError> {
        let n = max.len;
        need("crossentropy logits", logits.len, n * v)?;
        need("crossentropy sumexp", sumexp.len, n)?;
        need("crossentropy dlosses", dlosses.len, n)?;
        need("crossentropy targets", L::len(targets), n)?;
        self.run(
            "crossentropy",
            "crossentropy_backward",
            launch::per_row(n as u64, v, 1024)?,
            &[
                logits.arg(),
                logits.arg(),
                max.arg(),
                sumexp.arg(),
                KArg::Buf(targets),
                dlosses.arg(),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(v, "vocabulary")?),
                KArg::I64(n64(vocab_start)),
            ],
        )
    }
}
