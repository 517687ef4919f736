//! The CPU backend: buffers are `Vec<f32>`, views are slices, kernels are `kernels/`'s. Bf16
//! storage is computed as f32, so there is one copy of the weights.

use std::ops::Range;

pub mod kernels;

use self::kernels as cpu;
use self::kernels::adamw_update;
use self::kernels::ring_attention as ring;
use super::{AdamWStep, AttnShape, Backend, BackendError, RingShape, RopeShape, Storage};

/// The CPU backend (threads are ranks; matmul threads per rank set by `cpu::set_threads`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu;

type R<T = ()> = Result<T, BackendError>;

impl Backend for Cpu {
    type Buf = Vec<f32>;
    type Ref<'a> = &'a [f32];
    type Mut<'a> = &'a mut [f32];
    type Ids = Vec<u32>;

    fn name(&self) -> String {
        "cpu (f32)".into()
    }
    fn working_copy(&self) -> bool {
        false
    }

    fn alloc(&self, _storage: Storage, len: usize) -> R<Vec<f32>> {
        Ok(vec![0.0; len])
    }
    fn upload(&self, _storage: Storage, data: &[f32]) -> R<Vec<f32>> {
        Ok(data.to_vec())
    }
    fn download(&self, v: &[f32]) -> R<Vec<f32>> {
        Ok(v.to_vec())
    }
    fn ids(&self, ids: Vec<u32>) -> R<Vec<u32>> {
        Ok(ids)
    }

    fn view(buf: &Vec<f32>) -> &[f32] {
        buf
    }
    fn view_mut(buf: &mut Vec<f32>) -> &mut [f32] {
        buf
    }
    fn host<'a>(v: &'a [f32]) -> Option<&'a [f32]>
    where
        Self: 'a,
    {
        Some(v)
    }
    fn host_mut<'a>(v: &'a mut [f32]) -> Option<&'a mut [f32]>
    where
        Self: 'a,
    {
        Some(v)
    }
    fn len(v: &[f32]) -> usize {
        v.len()
    }
    fn len_mut(v: &&mut [f32]) -> usize {
        v.len()
    }
    fn sub<'a>(v: &'a [f32], r: Range<usize>) -> &'a [f32]
    where
        Self: 'a,
    {
        &v[r]
    }
    fn sub_mut<'a>(v: &'a mut [f32], r: Range<usize>) -> &'a mut [f32]
    where
        Self: 'a,
    {
        &mut v[r]
    }
    fn split_at_mut<'a>(v: &'a mut [f32], at: usize) -> (&'a mut [f32], &'a mut [f32])
    where
        Self: 'a,
    {
        v.split_at_mut(at)
    }
    fn rb<'s>(v: &'s mut &mut [f32]) -> &'s mut [f32] {
        v
    }
    fn ro<'s>(v: &'s &mut [f32]) -> &'s [f32] {
        v
    }
    fn rr<'s>(v: &'s &[f32]) -> &'s [f32] {
        v
    }
    fn freeze<'a>(v: &'a mut [f32]) -> &'a [f32]
    where
        Self: 'a,
    {
        v
    }

    fn fill(&self, x: &mut [f32], value: f32) -> R {
        x.fill(value);
        Ok(())
    }
    fn copy(&self, dst: &mut [f32], src: &[f32]) -> R {
        dst.copy_from_slice(src);
        Ok(())
    }
    fn add_assign(&self, a: &mut [f32], b: &[f32]) -> R {
        a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        Ok(())
    }
    fn scale(&self, x: &mut [f32], s: f32) -> R {
        x.iter_mut().for_each(|v| *v *= s);
        Ok(())
    }
    fn sum(&self, x: &[f32]) -> R<f64> {
        Ok(x.iter().map(|&l| f64::from(l)).sum())
    }
    fn sum_squares(&self, x: &[f32]) -> R<f64> {
        // Eight f64 lanes: a single chain of 124M dependent adds was ~0.1 s a step.
        Ok(cpu::vmath::sum_squares_f64(x))
    }

    fn matmul_bt(
        &self,
        out: &mut [f32],
        x: &[f32],
        w: &[f32],
        n: usize,
        k: usize,
        m: usize,
        acc: bool,
    ) -> R {
        cpu::matmul_bt(out, x, w, n, k, m, acc);
        Ok(())
    }
    fn matmul_at(
        &self,
        dw: &mut [f32],
        dy: &[f32],
        x: &[f32],
        m: usize,
        n: usize,
        k: usize,
        acc: bool,
    ) -> R {
        cpu::matmul_at(dw, dy, x, m, n, k, acc);
        Ok(())
    }
    fn matmul(
        &self,
        dx: &mut [f32],
        dy: &[f32],
        w: &[f32],
        n: usize,
        m: usize,
        k: usize,
        acc: bool,
    ) -> R {
        cpu::matmul(dx, dy, w, n, m, k, acc);
        Ok(())
    }
    fn add_bias(&self, y: &mut [f32], b: &[f32]) -> R {
        cpu::add_bias(y, b);
        Ok(())
    }
    fn gather_rows(
        &self,
        dst: &mut [f32],
        src: &[f32],
        rows: &[usize],
        scale: Option<&[f32]>,
        c: usize,
    ) -> R {
        cpu::gather_rows(dst, src, rows, scale, c);
        Ok(())
    }
    fn scatter_add_rows(
        &self,
        dst: &mut [f32],
        src: &[f32],
        to: &[usize],
        from: &[usize],
        scale: &[f32],
        c: usize,
    ) -> R {
        cpu::scatter_add_rows(dst, src, to, from, scale, c);
        Ok(())
    }
    fn bias_backward(&self, db: &mut [f32], dy: &[f32]) -> R {
        cpu::bias_backward(db, dy);
        Ok(())
    }

    fn embedding_forward(
        &self,
        out: &mut [f32],
        ids: &Vec<u32>,
        wte: &[f32],
        vocab_start: usize,
        c: usize,
    ) -> R {
        cpu::embedding_forward(out, ids, wte, vocab_start, c);
        Ok(())
    }
    fn embedding_backward(
        &self,
        dwte: &mut [f32],
        ids: &Vec<u32>,
        dout: &[f32],
        vocab_start: usize,
        c: usize,
    ) -> R {
        cpu::embedding_backward(dwte, ids, dout, vocab_start, c);
        Ok(())
    }
    fn pos_embedding_forward(
        &self,
        out: &mut [f32],
        wpe: &[f32],
        t: usize,
        c: usize,
        first: usize,
    ) -> R {
        if first == 0 {
            cpu::pos_embedding_forward(out, wpe, t, c);
            return Ok(());
        }
        for (i, row) in out.chunks_exact_mut(c).enumerate() {
            let pos = (first + i) % t;
            let src = &wpe[pos * c..(pos + 1) * c];
            row.iter_mut().zip(src).for_each(|(o, s)| *o += s);
        }
        Ok(())
    }
    fn pos_embedding_backward(&self, dwpe: &mut [f32], dout: &[f32], t: usize, c: usize) -> R {
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
    ) -> R {
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
    ) -> R {
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
    ) -> R {
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
    ) -> R {
        cpu::rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, c);
        Ok(())
    }

    fn attention_saved_len(&self, s: &AttnShape) -> usize {
        s.att_len()
    }
    fn attention_keeps_saved(&self) -> bool {
        false
    }
    fn attention_scratch_len(&self, s: &AttnShape) -> usize {
        cpu::attention_scratch_len(s)
    }
    fn attention_forward(&self, y: &mut [f32], saved: &mut [f32], qkv: &[f32], s: AttnShape) -> R {
        cpu::attention_forward(y, saved, qkv, s);
        Ok(())
    }
    fn attention_recompute(&self, saved: &mut [f32], qkv: &[f32], s: AttnShape) -> R {
        cpu::attention_probs(saved, qkv, s);
        Ok(())
    }
    fn attention_backward(
        &self,
        dqkv: &mut [f32],
        scratch: &mut [f32],
        dy: &[f32],
        qkv: &[f32],
        _y: &[f32],
        saved: &[f32],
        s: AttnShape,
    ) -> R {
        cpu::attention_backward(dqkv, scratch, dy, qkv, saved, s);
        Ok(())
    }
    fn rope(&self, x: &mut [f32], s: RopeShape, cos: &[f32], sin: &[f32], backward: bool) -> R {
        let rotate = if backward {
            cpu::rope_backward
        } else {
            cpu::rope_forward
        };
        rotate(x, s.t, s.width, s.heads, s.hd, cos, sin);
        Ok(())
    }

    fn ring_scratch_len(&self, s: &RingShape) -> usize {
        ring::ring_scratch_len(s)
    }
    fn ring_pack_kv(&self, kv: &mut [f32], qkv: &[f32], s: &RingShape) -> R {
        ring::pack_kv(kv, qkv, s);
        Ok(())
    }
    fn ring_forward_step(
        &self,
        o: &mut [f32],
        lse: &mut [f32],
        scratch: &mut [f32],
        qkv: &[f32],
        kv: &[f32],
        q_chunks: [usize; 2],
        kv_chunks: [usize; 2],
        s: &RingShape,
    ) -> R {
        ring::ring_forward_step(o, lse, scratch, qkv, kv, q_chunks, kv_chunks, s);
        Ok(())
    }
    fn ring_softmax_delta(&self, delta: &mut [f32], y: &[f32], dy: &[f32], s: &RingShape) -> R {
        ring::softmax_delta(delta, y, dy, s);
        Ok(())
    }
    fn ring_backward_step(
        &self,
        dq: &mut [f32],
        dkv: &mut [f32],
        scratch: &mut [f32],
        qkv: &[f32],
        kv: &[f32],
        dy: &[f32],
        lse: &[f32],
        delta: &[f32],
        q_chunks: [usize; 2],
        kv_chunks: [usize; 2],
        s: &RingShape,
    ) -> R {
        ring::ring_backward_step(
            dq, dkv, scratch, qkv, kv, dy, lse, delta, q_chunks, kv_chunks, s,
        );
        Ok(())
    }
    fn ring_unpack(&self, dqkv: &mut [f32], dq: &[f32], dkv: &[f32], s: &RingShape) -> R {
        ring::ring_unpack(dqkv, dq, dkv, s);
        Ok(())
    }

    fn gelu_forward(&self, out: &mut [f32], inp: &[f32]) -> R {
        cpu::gelu_forward(out, inp);
        Ok(())
    }
    fn gelu_backward(&self, dinp: &mut [f32], inp: &[f32], dout: &[f32]) -> R {
        cpu::gelu_backward(dinp, inp, dout);
        Ok(())
    }
    fn swiglu_forward(&self, out: &mut [f32], inp: &[f32], f: usize) -> R {
        cpu::swiglu_forward(out, inp, f);
        Ok(())
    }
    fn swiglu_backward(&self, dinp: &mut [f32], inp: &[f32], dout: &[f32], f: usize) -> R {
        cpu::swiglu_backward(dinp, inp, dout, f);
        Ok(())
    }

    fn row_max(&self, max: &mut [f32], logits: &[f32], v: usize) -> R {
        cpu::row_max(max, logits, v);
        Ok(())
    }
    fn ce_partials(
        &self,
        both: &mut [f32],
        logits: &[f32],
        max: &[f32],
        targets: &Vec<u32>,
        vocab_start: usize,
        v: usize,
    ) -> R {
        let (se, tl) = both.split_at_mut(max.len());
        cpu::row_sumexp(se, logits, max, v);
        cpu::target_logit(tl, logits, targets, vocab_start, v);
        Ok(())
    }
    fn ce_losses(&self, losses: &mut [f32], sumexp: &mut [f32], max: &[f32], both: &[f32]) -> R {
        let (se, tl) = both.split_at(losses.len());
        sumexp.copy_from_slice(se);
        for ((l, &m), (&s, &t)) in losses.iter_mut().zip(max).zip(se.iter().zip(tl)) {
            *l = s.ln() + m - t;
        }
        Ok(())
    }
    fn crossentropy_backward(
        &self,
        logits: &mut [f32],
        max: &[f32],
        sumexp: &[f32],
        targets: &Vec<u32>,
        dlosses: &[f32],
        vocab_start: usize,
        v: usize,
    ) -> R {
        cpu::crossentropy_backward(logits, max, sumexp, targets, dlosses, vocab_start, v);
        Ok(())
    }

    fn adamw(
        &self,
        master: &mut [f32],
        working: Option<&mut [f32]>,
        grads: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        step: &AdamWStep,
    ) -> R {
        adamw_update(master, grads, m, v, step);
        if let Some(w) = working {
            w.copy_from_slice(master);
        }
        Ok(())
    }
}
