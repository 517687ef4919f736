//! [`Device`]'s [`Backend`] implementation: buffers, views and the element-wise, matmul,
//! activation and optimizer launches (norms, attention, embeddings and the loss forward to
//! `device_layers.rs`).
#![allow(clippy::too_many_arguments)]

use std::marker::PhantomData;
use std::ops::Range;

use super::device::Device;
use super::launch;
use super::launch::{i32_of, n64};
use super::views::{need, rows, DMut, DRef, DeviceIds};
use super::{DType, GpuError, HostData, HostVec, KArg, Launcher};
use crate::backend::GemmShape;
use crate::backend::{bf16, AdamWStep, Backend, RingShape, Storage};

fn dtype_of(storage: Storage) -> DType {
    match storage {
        Storage::Bf16 => DType::Bf16,
        Storage::F32 => DType::F32,
    }
}

impl<L: Launcher + Sync + 'static> Backend for Device<L>
where
    L::Buf: Send + Sync,
{
    type Buf = L::Buf;
    type Ref<'a> = DRef<'a, L::Buf>;
    type Mut<'a> = DMut<'a, L::Buf>;
    type Ids = DeviceIds<L::Buf>;

    fn name(&self) -> String {
        self.launcher().describe()
    }
    fn working_copy(&self) -> bool {
        true
    }

    fn alloc(&self, storage: Storage, len: usize) -> Result<L::Buf, GpuError> {
        self.launcher().alloc_zeros(dtype_of(storage), len)
    }
    fn upload(&self, storage: Storage, data: &[f32]) -> Result<L::Buf, GpuError> {
        match storage {
            Storage::Bf16 => self.launcher().upload(HostData::Bf16(&bf16::encode(data))),
            Storage::F32 => self.launcher().upload(HostData::F32(data)),
        }
    }
    fn download(&self, v: DRef<'_, L::Buf>) -> Result<Vec<f32>, GpuError> {
        let r = v.at..v.at + v.len;
        Ok(match self.launcher().download_range(v.buf, r)? {
            HostVec::Bf16(x) => x.iter().map(|&b| bf16::to_f32(b)).collect(),
            HostVec::F32(x) => x,
            HostVec::U32(_) => return Err(GpuError::shape("download", "token ids read as f32")),
        })
    }
    fn ids(&self, ids: Vec<u32>) -> Result<DeviceIds<L::Buf>, GpuError> {
        DeviceIds::upload(self.launcher(), ids)
    }

    fn view(buf: &L::Buf) -> DRef<'_, L::Buf> {
        DRef {
            buf,
            at: 0,
            len: L::len(buf),
        }
    }
    fn view_mut(buf: &mut L::Buf) -> DMut<'_, L::Buf> {
        DMut {
            len: L::len(buf),
            buf,
            at: 0,
            _excl: PhantomData,
        }
    }
    fn len(v: DRef<'_, L::Buf>) -> usize {
        v.len
    }
    fn len_mut(v: &DMut<'_, L::Buf>) -> usize {
        v.len
    }
    fn sub<'a>(v: DRef<'a, L::Buf>, r: Range<usize>) -> DRef<'a, L::Buf>
    where
        Self: 'a,
    {
        assert!(
            r.start <= r.end && r.end <= v.len,
            "view range out of bounds"
        );
        DRef {
            buf: v.buf,
            at: v.at + r.start,
            len: r.len(),
        }
    }
    fn sub_mut<'a>(v: DMut<'a, L::Buf>, r: Range<usize>) -> DMut<'a, L::Buf>
    where
        Self: 'a,
    {
        assert!(
            r.start <= r.end && r.end <= v.len,
            "view range out of bounds"
        );
        DMut {
            buf: v.buf,
            at: v.at + r.start,
            len: r.len(),
            _excl: PhantomData,
        }
    }
    fn split_at_mut<'a>(v: DMut<'a, L::Buf>, at: usize) -> (DMut<'a, L::Buf>, DMut<'a, L::Buf>)
    where
        Self: 'a,
    {
        assert!(at <= v.len, "split past the view");
        let head = DMut {
            buf: v.buf,
            at: v.at,
            len: at,
            _excl: PhantomData,
        };
        let tail = DMut {
            buf: v.buf,
            at: v.at + at,
            len: v.len - at,
            _excl: PhantomData,
        };
        (head, tail)
    }
    fn rb<'s>(v: &'s mut DMut<'_, L::Buf>) -> DMut<'s, L::Buf> {
        DMut {
            buf: v.buf,
            at: v.at,
            len: v.len,
            _excl: PhantomData,
        }
    }
    fn ro<'s>(v: &'s DMut<'_, L::Buf>) -> DRef<'s, L::Buf> {
        DRef {
            buf: v.buf,
            at: v.at,
            len: v.len,
        }
    }
    fn rr<'s>(v: &'s DRef<'_, L::Buf>) -> DRef<'s, L::Buf> {
        DRef {
            buf: v.buf,
            at: v.at,
            len: v.len,
        }
    }
    fn freeze<'a>(v: DMut<'a, L::Buf>) -> DRef<'a, L::Buf>
    where
        Self: 'a,
    {
        DRef {
            buf: v.buf,
            at: v.at,
            len: v.len,
        }
    }

    fn fill(&self, x: DMut<'_, L::Buf>, value: f32) -> Result<(), GpuError> {
        let f = match L::dtype(x.buf) {
            DType::Bf16 => "fill_bf16",
            DType::F32 => "fill_f32",
            DType::U32 => return Err(GpuError::shape("fill", "a u32 buffer")),
        };
        let n = x.len;
        let args = [x.arg(), KArg::I64(n64(n)), KArg::F32(value)];
        self.run("reduce", f, launch::elementwise(n as u64), &args)
    }
    fn copy(&self, dst: DMut<'_, L::Buf>, src: DRef<'_, L::Buf>) -> Result<(), GpuError> {
        need("copy", src.len, dst.len)?;
        let f = match (L::dtype(dst.buf), L::dtype(src.buf)) {
            (DType::Bf16, DType::Bf16) => "copy_bf16",
            (DType::F32, DType::F32) => "copy_f32",
            (DType::Bf16, DType::F32) => "copy_f32_to_bf16",
            (d, s) => return Err(GpuError::shape("copy", format!("{s:?} into {d:?}"))),
        };
        let n = dst.len;
        let args = [dst.arg(), src.arg(), KArg::I64(n64(n))];
        self.run("reduce", f, launch::elementwise(n as u64), &args)
    }
    fn add_assign(&self, a: DMut<'_, L::Buf>, b: DRef<'_, L::Buf>) -> Result<(), GpuError> {
        need("add_assign", b.len, a.len)?;
        let n = a.len;
        let args = [a.arg(), b.arg(), KArg::I64(n64(n))];
        self.run(
            "reduce",
            "add_inplace_bf16",
            launch::elementwise(n as u64),
            &args,
        )
    }
    fn scale(&self, x: DMut<'_, L::Buf>, s: f32) -> Result<(), GpuError> {
        if L::dtype(x.buf) != DType::Bf16 {
            return Err(GpuError::shape(
                "scale",
                format!("a {:?} buffer", L::dtype(x.buf)),
            ));
        }
        let n = x.len;
        let args = [x.arg(), KArg::I64(n64(n)), KArg::F32(s)];
        self.run("reduce", "scale_bf16", launch::elementwise(n as u64), &args)
    }
    fn sum(&self, x: DRef<'_, L::Buf>) -> Result<f64, GpuError> {
        Ok(self.download(x)?.iter().map(|&v| f64::from(v)).sum())
    }
    fn sum_squares(&self, x: DRef<'_, L::Buf>) -> Result<f64, GpuError> {
        // Chunks of 4096 elements, one thread each; the partials are added here, in order.
        const PER_CHUNK: usize = 4096;
        let chunks = x.len.div_ceil(PER_CHUNK);
        if chunks == 0 {
            return Ok(0.0);
        }
        let partial = self.launcher().alloc_zeros(DType::F32, chunks)?;
        self.run(
            "reduce",
            "sum_squares",
            launch::elementwise(chunks as u64),
            &[
                KArg::Buf(&partial),
                x.arg(),
                KArg::I64(n64(x.len)),
                KArg::I64(n64(PER_CHUNK)),
                KArg::I64(n64(chunks)),
            ],
        )?;
        Ok(self
            .download(Self::view(&partial))?
            .iter()
            .map(|&v| f64::from(v))
            .sum())
    }

    fn matmul_bt(
        &self,
        out: DMut<'_, L::Buf>,
        x: DRef<'_, L::Buf>,
        w: DRef<'_, L::Buf>,
        n: usize,
        k: usize,
        m: usize,
        acc: bool,
    ) -> Result<(), GpuError> {
        let g = GemmShape {
            m: n,
            k,
            n: m,
            trans_a: false,
            trans_b: true,
        };
        self.gemm(out, x, w, g, acc)
    }
    fn matmul_at(
        &self,
        dw: DMut<'_, L::Buf>,
        dy: DRef<'_, L::Buf>,
        x: DRef<'_, L::Buf>,
        m: usize,
        n: usize,
        k: usize,
        acc: bool,
    ) -> Result<(), GpuError> {
        let g = GemmShape {
            m,
            k: n,
            n: k,
            trans_a: true,
            trans_b: false,
        };
        self.gemm(dw, dy, x, g, acc)
    }
    fn matmul(
        &self,
        dx: DMut<'_, L::Buf>,
        dy: DRef<'_, L::Buf>,
        w: DRef<'_, L::Buf>,
        n: usize,
        m: usize,
        k: usize,
        acc: bool,
    ) -> Result<(), GpuError> {
        let g = GemmShape {
            m: n,
            k: m,
            n: k,
            trans_a: false,
            trans_b: false,
        };
        self.gemm(dx, dy, w, g, acc)
    }
    fn add_bias(&self, y: DMut<'_, L::Buf>, b: DRef<'_, L::Buf>) -> Result<(), GpuError> {
        let c = b.len;
        let n = rows("add_bias", y.len, c)?;
        let args = [
            y.arg(),
            b.arg(),
            KArg::I64(n64(n)),
            KArg::I32(i32_of(c, "channels")?),
        ];
        self.run(
            "reduce",
            "add_bias",
            launch::elementwise((n * c) as u64),
            &args,
        )
    }
    fn bias_backward(&self, db: DMut<'_, L::Buf>, dy: DRef<'_, L::Buf>) -> Result<(), GpuError> {
        let c = db.len;
        let n = rows("bias_backward", dy.len, c)?;
        let ch = launch::row_chunks(n as u64);
        let partial = self
            .launcher()
            .alloc_zeros(DType::F32, ch.chunks as usize * c)?;
        self.run(
            "reduce",
            "column_sums",
            (n > 0).then(|| launch::per_channel(c, ch)).transpose()?,
            &[
                KArg::Buf(&partial),
                dy.arg(),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(c, "channels")?),
                KArg::I64(ch.rows_per_chunk as i64),
            ],
        )?;
        self.add_partials(db, &partial, ch.chunks, c, 0)
    }

    fn embedding_forward(
        &self,
        out: DMut<'_, L::Buf>,
        ids: &DeviceIds<L::Buf>,
        wte: DRef<'_, L::Buf>,
        vocab_start: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        self.embedding_forward_impl(out, ids, wte, vocab_start, c)
    }
    fn embedding_backward(
        &self,
        dwte: DMut<'_, L::Buf>,
        ids: &DeviceIds<L::Buf>,
        dout: DRef<'_, L::Buf>,
        vocab_start: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        need("embedding_backward", dout.len, ids.n * c)?;
        let v_local = rows("embedding table", dwte.len, c)?;
        self.run(
            "embedding",
            "embedding_backward",
            launch::elementwise((ids.buckets * c) as u64),
            &[
                dwte.arg(),
                KArg::Buf(&ids.order),
                KArg::Buf(&ids.starts),
                KArg::Buf(&ids.tokens),
                dout.arg(),
                KArg::I64(n64(ids.buckets)),
                KArg::I32(i32_of(c, "channels")?),
                KArg::I64(n64(vocab_start)),
                KArg::I64(n64(v_local)),
            ],
        )
    }
    fn pos_embedding_forward(
        &self,
        out: DMut<'_, L::Buf>,
        wpe: DRef<'_, L::Buf>,
        t: usize,
        c: usize,
        first: usize,
    ) -> Result<(), GpuError> {
        self.pos_embedding_forward_impl(out, wpe, t, c, first)
    }
    fn pos_embedding_backward(
        &self,
        dwpe: DMut<'_, L::Buf>,
        dout: DRef<'_, L::Buf>,
        t: usize,
        c: usize,
    ) -> Result<(), GpuError> {
        self.pos_embedding_backward_impl(dwpe, dout, t, c)
    }

    fn layernorm_forward(
        &self,
        out: DMut<'_, L::Buf>,
        mean: DMut<'_, L::Buf>,
        rstd: DMut<'_, L::Buf>,
        inp: DRef<'_, L::Buf>,
        weight: DRef<'_, L::Buf>,
        bias: Option<DRef<'_, L::Buf>>,
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        self.layernorm_forward_impl(out, mean, rstd, inp, weight, bias, c, eps)
    }
    fn layernorm_backward(
        &self,
        dinp: DMut<'_, L::Buf>,
        dweight: DMut<'_, L::Buf>,
        dbias: Option<DMut<'_, L::Buf>>,
        dout: DRef<'_, L::Buf>,
        inp: DRef<'_, L::Buf>,
        weight: DRef<'_, L::Buf>,
        mean: DRef<'_, L::Buf>,
        rstd: DRef<'_, L::Buf>,
        c: usize,
    ) -> Result<(), GpuError> {
        self.layernorm_backward_impl(dinp, dweight, dbias, dout, inp, weight, mean, rstd, c)
    }
    fn rmsnorm_forward(
        &self,
        out: DMut<'_, L::Buf>,
        rstd: DMut<'_, L::Buf>,
        inp: DRef<'_, L::Buf>,
        weight: DRef<'_, L::Buf>,
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        self.rmsnorm_forward_impl(out, rstd, inp, weight, c, eps)
    }
    fn rmsnorm_backward(
        &self,
        dinp: DMut<'_, L::Buf>,
        dweight: DMut<'_, L::Buf>,
        dout: DRef<'_, L::Buf>,
        inp: DRef<'_, L::Buf>,
        weight: DRef<'_, L::Buf>,
        rstd: DRef<'_, L::Buf>,
        c: usize,
    ) -> Result<(), GpuError> {
        self.rmsnorm_backward_impl(dinp, dweight, dout, inp, weight, rstd, c)
    }

    fn attention_saved_len(&self, s: &crate::backend::AttnShape) -> usize {
        s.b * s.hq * s.t
    }
    fn attention_keeps_saved(&self) -> bool {
        true
    }
    fn attention_scratch_len(&self, s: &crate::backend::AttnShape) -> usize {
        s.b * s.hq * s.t
    }
    fn attention_forward(
        &self,
        y: DMut<'_, L::Buf>,
        saved: DMut<'_, L::Buf>,
        qkv: DRef<'_, L::Buf>,
        s: crate::backend::AttnShape,
    ) -> Result<(), GpuError> {
        self.attention_forward_impl(y, saved, qkv, s)
    }
    fn attention_recompute(
        &self,
        _saved: DMut<'_, L::Buf>,
        _qkv: DRef<'_, L::Buf>,
        _s: crate::backend::AttnShape,
    ) -> Result<(), GpuError> {
        // `attention_keeps_saved` is true: the executor never asks.
        Err(GpuError::Unsupported {
            what: "recomputing the attention log-sum-exp alone".into(),
            fix: "the device backend keeps it under selective recompute".into(),
        })
    }
    fn attention_backward(
        &self,
        dqkv: DMut<'_, L::Buf>,
        scratch: DMut<'_, L::Buf>,
        dy: DRef<'_, L::Buf>,
        qkv: DRef<'_, L::Buf>,
        y: DRef<'_, L::Buf>,
        saved: DRef<'_, L::Buf>,
        s: crate::backend::AttnShape,
    ) -> Result<(), GpuError> {
        self.attention_backward_impl(dqkv, scratch, dy, qkv, y, saved, s)
    }
    fn rope(
        &self,
        x: DMut<'_, L::Buf>,
        shape: crate::backend::RopeShape,
        cos: DRef<'_, L::Buf>,
        sin: DRef<'_, L::Buf>,
        backward: bool,
    ) -> Result<(), GpuError> {
        self.rope_impl(x, shape, cos, sin, backward)
    }

    fn ring_scratch_len(&self, _s: &RingShape) -> usize {
        0
    }
    fn ring_pack_kv(
        &self,
        kv: DMut<'_, L::Buf>,
        qkv: DRef<'_, L::Buf>,
        s: &RingShape,
    ) -> Result<(), GpuError> {
        self.ring_pack_kv_impl(kv, qkv, s)
    }
    fn ring_forward_step(
        &self,
        o: DMut<'_, L::Buf>,
        lse: DMut<'_, L::Buf>,
        _scratch: DMut<'_, L::Buf>,
        qkv: DRef<'_, L::Buf>,
        kv: DRef<'_, L::Buf>,
        q_chunks: [usize; 2],
        kv_chunks: [usize; 2],
        s: &RingShape,
    ) -> Result<(), GpuError> {
        self.ring_forward_step_impl(o, lse, qkv, kv, q_chunks, kv_chunks, s)
    }
    fn ring_softmax_delta(
        &self,
        delta: DMut<'_, L::Buf>,
        y: DRef<'_, L::Buf>,
        dy: DRef<'_, L::Buf>,
        s: &RingShape,
    ) -> Result<(), GpuError> {
        self.ring_softmax_delta_impl(delta, y, dy, s)
    }
    fn ring_backward_step(
        &self,
        dq: DMut<'_, L::Buf>,
        dkv: DMut<'_, L::Buf>,
        _scratch: DMut<'_, L::Buf>,
        qkv: DRef<'_, L::Buf>,
        kv: DRef<'_, L::Buf>,
        dy: DRef<'_, L::Buf>,
        lse: DRef<'_, L::Buf>,
        delta: DRef<'_, L::Buf>,
        q_chunks: [usize; 2],
        kv_chunks: [usize; 2],
        s: &RingShape,
    ) -> Result<(), GpuError> {
        let views = super::device_ring::BackwardViews {
            qkv,
            kv,
            dy,
            lse,
            delta,
        };
        self.ring_backward_step_impl(dq, dkv, views, q_chunks, kv_chunks, s)
    }
    fn ring_unpack(
        &self,
        dqkv: DMut<'_, L::Buf>,
        dq: DRef<'_, L::Buf>,
        dkv: DRef<'_, L::Buf>,
        s: &RingShape,
    ) -> Result<(), GpuError> {
        self.ring_unpack_impl(dqkv, dq, dkv, s)
    }

    fn gelu_forward(&self, out: DMut<'_, L::Buf>, inp: DRef<'_, L::Buf>) -> Result<(), GpuError> {
        need("gelu_forward", out.len, inp.len)?;
        let n = inp.len;
        let args = [out.arg(), inp.arg(), KArg::I64(n64(n))];
        self.run("act", "gelu_forward", launch::elementwise(n as u64), &args)
    }
    fn gelu_backward(
        &self,
        dinp: DMut<'_, L::Buf>,
        inp: DRef<'_, L::Buf>,
        dout: DRef<'_, L::Buf>,
    ) -> Result<(), GpuError> {
        need("gelu_backward", dinp.len, inp.len)?;
        need("gelu_backward", dout.len, inp.len)?;
        let n = inp.len;
        let args = [dinp.arg(), inp.arg(), dout.arg(), KArg::I64(n64(n))];
        self.run("act", "gelu_backward", launch::elementwise(n as u64), &args)
    }
    fn swiglu_forward(
        &self,
        out: DMut<'_, L::Buf>,
        inp: DRef<'_, L::Buf>,
        f: usize,
    ) -> Result<(), GpuError> {
        let n = rows("swiglu_forward", out.len, f)?;
        need("swiglu_forward", inp.len, 2 * n * f)?;
        let args = [
            out.arg(),
            inp.arg(),
            KArg::I64(n64(n)),
            KArg::I32(i32_of(f, "features")?),
        ];
        self.run(
            "act",
            "swiglu_forward",
            launch::elementwise((n * f) as u64),
            &args,
        )
    }
    fn swiglu_backward(
        &self,
        dinp: DMut<'_, L::Buf>,
        inp: DRef<'_, L::Buf>,
        dout: DRef<'_, L::Buf>,
        f: usize,
    ) -> Result<(), GpuError> {
        let n = rows("swiglu_backward", dout.len, f)?;
        need("swiglu_backward", inp.len, 2 * n * f)?;
        need("swiglu_backward", dinp.len, 2 * n * f)?;
        let args = [
            dinp.arg(),
            inp.arg(),
            dout.arg(),
            KArg::I64(n64(n)),
            KArg::I32(i32_of(f, "features")?),
        ];
        self.run(
            "act",
            "swiglu_backward",
            launch::elementwise((n * f) as u64),
            &args,
        )
    }

    fn bias_gelu_forward(
        &self,
        h: DMut<'_, L::Buf>,
        a: DMut<'_, L::Buf>,
        bias: Option<DRef<'_, L::Buf>>,
    ) -> Result<(), GpuError> {
        let Some(b) = bias else {
            return self.gelu_forward(a, Self::freeze(h));
        };
        let c = b.len;
        let n = rows("bias_gelu_forward", h.len, c)?;
        need("bias_gelu_forward", a.len, h.len)?;
        let args = [
            a.arg(),
            h.arg(),
            b.arg(),
            KArg::I64(n64(n)),
            KArg::I32(i32_of(c, "channels")?),
        ];
        self.run(
            "act",
            "bias_gelu_forward",
            launch::elementwise((n * c) as u64),
            &args,
        )
    }
    fn gelu_backward_bias(
        &self,
        dinp: DMut<'_, L::Buf>,
        dbias: Option<DMut<'_, L::Buf>>,
        inp: DRef<'_, L::Buf>,
        dout: DRef<'_, L::Buf>,
    ) -> Result<(), GpuError> {
        let Some(db) = dbias else {
            return self.gelu_backward(dinp, inp, dout);
        };
        let c = db.len;
        let n = rows("gelu_backward_bias", dinp.len, c)?;
        need("gelu_backward_bias", inp.len, n * c)?;
        need("gelu_backward_bias", dout.len, n * c)?;
        let ch = launch::row_chunks(n as u64);
        let partial = self
            .launcher()
            .alloc_zeros(DType::F32, ch.chunks as usize * c)?;
        self.run(
            "act",
            "gelu_backward_bias",
            (n > 0).then(|| launch::per_channel(c, ch)).transpose()?,
            &[
                dinp.arg(),
                KArg::Buf(&partial),
                inp.arg(),
                dout.arg(),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(c, "channels")?),
                KArg::I64(ch.rows_per_chunk as i64),
            ],
        )?;
        self.add_partials(db, &partial, ch.chunks, c, 0)
    }
    fn add_bias_residual(
        &self,
        y: DMut<'_, L::Buf>,
        bias: Option<DRef<'_, L::Buf>>,
        res: DRef<'_, L::Buf>,
    ) -> Result<(), GpuError> {
        let Some(b) = bias else {
            return self.add_assign(y, res);
        };
        let c = b.len;
        let n = rows("add_bias_residual", y.len, c)?;
        need("add_bias_residual", res.len, n * c)?;
        let args = [
            y.arg(),
            res.arg(),
            b.arg(),
            KArg::I64(n64(n)),
            KArg::I32(i32_of(c, "channels")?),
        ];
        self.run(
            "act",
            "add_bias_residual",
            launch::elementwise((n * c) as u64),
            &args,
        )
    }
    fn residual_layernorm_forward(
        &self,
        x: DMut<'_, L::Buf>,
        proj_bias: Option<DRef<'_, L::Buf>>,
        res: DRef<'_, L::Buf>,
        out: DMut<'_, L::Buf>,
        mean: DMut<'_, L::Buf>,
        rstd: DMut<'_, L::Buf>,
        weight: DRef<'_, L::Buf>,
        bias: Option<DRef<'_, L::Buf>>,
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        let n = rows("residual_layernorm_forward", x.len, c)?;
        need("residual_layernorm_forward res", res.len, n * c)?;
        need("residual_layernorm_forward out", out.len, n * c)?;
        need("residual_layernorm_forward mean", mean.len, n)?;
        need("residual_layernorm_forward rstd", rstd.len, n)?;
        need("layernorm weight", weight.len, c)?;
        if let Some(b) = &proj_bias {
            need("residual_layernorm_forward projection bias", b.len, c)?;
        }
        self.run(
            "norm",
            "residual_layernorm_forward",
            launch::per_row(n as u64, c, 256)?,
            &[
                out.arg(),
                mean.arg(),
                rstd.arg(),
                x.arg(),
                res.arg(),
                proj_bias.as_ref().map_or(KArg::Null, |b| b.arg()),
                weight.arg(),
                bias.as_ref().map_or(KArg::Null, |b| b.arg()),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(c, "channels")?),
                KArg::F32(eps),
            ],
        )
    }
    fn residual_rmsnorm_forward(
        &self,
        x: DMut<'_, L::Buf>,
        proj_bias: Option<DRef<'_, L::Buf>>,
        res: DRef<'_, L::Buf>,
        out: DMut<'_, L::Buf>,
        rstd: DMut<'_, L::Buf>,
        weight: DRef<'_, L::Buf>,
        c: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        let n = rows("residual_rmsnorm_forward", x.len, c)?;
        need("residual_rmsnorm_forward res", res.len, n * c)?;
        need("residual_rmsnorm_forward out", out.len, n * c)?;
        need("residual_rmsnorm_forward rstd", rstd.len, n)?;
        need("rmsnorm weight", weight.len, c)?;
        if let Some(b) = &proj_bias {
            need("residual_rmsnorm_forward projection bias", b.len, c)?;
        }
        self.run(
            "norm",
            "residual_rmsnorm_forward",
            launch::per_row(n as u64, c, 256)?,
            &[
                out.arg(),
                rstd.arg(),
                x.arg(),
                res.arg(),
                proj_bias.as_ref().map_or(KArg::Null, |b| b.arg()),
                weight.arg(),
                KArg::I64(n64(n)),
                KArg::I32(i32_of(c, "channels")?),
                KArg::F32(eps),
            ],
        )
    }

    fn row_max(
        &self,
        max: DMut<'_, L::Buf>,
        logits: DRef<'_, L::Buf>,
        v: usize,
    ) -> Result<(), GpuError> {
        self.row_max_impl(max, logits, v)
    }
    fn ce_partials(
        &self,
        both: DMut<'_, L::Buf>,
        logits: DRef<'_, L::Buf>,
        max: DRef<'_, L::Buf>,
        targets: &DeviceIds<L::Buf>,
        vocab_start: usize,
        v: usize,
    ) -> Result<(), GpuError> {
        self.ce_partials_impl(both, logits, max, &targets.ids, vocab_start, v)
    }
    fn ce_losses(
        &self,
        losses: DMut<'_, L::Buf>,
        sumexp: DMut<'_, L::Buf>,
        max: DRef<'_, L::Buf>,
        both: DRef<'_, L::Buf>,
    ) -> Result<(), GpuError> {
        self.ce_losses_impl(losses, sumexp, max, both)
    }
    fn crossentropy_backward(
        &self,
        logits: DMut<'_, L::Buf>,
        max: DRef<'_, L::Buf>,
        sumexp: DRef<'_, L::Buf>,
        targets: &DeviceIds<L::Buf>,
        dlosses: DRef<'_, L::Buf>,
        vocab_start: usize,
        v: usize,
    ) -> Result<(), GpuError> {
        let t = &targets.ids;
        self.crossentropy_backward_impl(logits, max, sumexp, t, dlosses, vocab_start, v)
    }

    fn adamw(
        &self,
        master: DMut<'_, L::Buf>,
        working: Option<DMut<'_, L::Buf>>,
        grads: DRef<'_, L::Buf>,
        m: DMut<'_, L::Buf>,
        v: DMut<'_, L::Buf>,
        step: &AdamWStep,
    ) -> Result<(), GpuError> {
        let n = master.len;
        need("adamw grads", grads.len, n)?;
        need("adamw m", m.len, n)?;
        need("adamw v", v.len, n)?;
        if let Some(w) = &working {
            need("adamw working copy", w.len, n)?;
        }
        let (bc1, bc2) = step.bias_corrections();
        self.run(
            "adamw",
            "adamw_step",
            launch::elementwise(n as u64),
            &[
                master.arg(),
                working.as_ref().map_or(KArg::Null, |w| w.arg()),
                grads.arg(),
                m.arg(),
                v.arg(),
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
        )
    }
}
