//! The two traits the executor is generic over: [`Backend`] (buffers and every kernel the
//! layers and the step use) and [`Collective`] (the group operations on a backend's buffers).
//! Both are statically dispatched: `layers/` and `exec/` are written once, against these.
//!
//! Buffers are owned ([`Backend::Buf`]) and passed as views: [`Backend::Ref`] (read) and
//! [`Backend::Mut`] (write), each a range of one buffer. On the CPU ([`Cpu`]) the views are
//! plain slices, so the CPU path is the code it always was; a device backend
//! ([`cuda::Device`]) makes them (buffer, offset, length) handles with a dtype.
//!
//! Precision is a property of the allocation ([`Storage`]): activations and working weights are
//! `Bf16` (bf16 on a GPU, f32 on the CPU), statistics, gradients, master weights and optimizer
//! state `F32`. [`Backend::working_copy`] says whether the weights the kernels read differ from
//! the f32 master weights, so the executor keeps both only where they differ.
//!
//! Layout: this file (the traits), [`ops`] (their shared types and the host-slice `Kernels`
//! test surface), `error.rs` ([`BackendError`]), [`bf16`] (host conversions); one folder per
//! backend: `cpu/` ([`Cpu`]) and [`cuda`] (everything GPU, its stand-in without the `cuda`
//! feature). The executor imports only what this file exports; `runtime/tests/layering.rs`
//! checks that no module imports from one above it (docs/cuda.md).
#![allow(clippy::too_many_arguments)] // llm.c-style kernel signatures

pub mod bf16;
pub mod cpu;
pub mod cuda;
mod error;
mod host_collective;
pub mod ops;
pub mod rope_tables;
mod shapes;

use std::ops::Range;

pub use self::cpu::kernels::attention_dropout::AttnMask;
pub use self::cpu::kernels::ring_attention::{block_mask, block_pairs, BlockMask, RingShape};
pub use self::cpu::kernels::AttnShape;
pub use cpu::kernels::set_threads as set_cpu_kernel_threads;
pub use cpu::Cpu;
pub use error::GpuError;
pub use error::GpuError as BackendError;
pub use ops::GemmShape;
pub use shapes::{AdamWStep, RopeShape, Storage};

use crate::comm::CommError;

/// Buffers, views and kernels. Semantics follow `crate::backend::cpu::kernels`: row-major, parameter gradients
/// accumulated, other outputs overwritten unless a method says otherwise.
pub trait Backend: Sized + Sync + 'static {
    /// An owned buffer.
    type Buf: Send;
    /// A read view of (part of) a buffer.
    type Ref<'a>: Copy
    where
        Self: 'a;
    /// A write view of (part of) a buffer.
    type Mut<'a>
    where
        Self: 'a;
    /// Token ids on the backend.
    type Ids: Send;

    /// Backend and device, for messages.
    fn name(&self) -> String;
    /// Whether `Storage::Bf16` buffers hold fewer bits than f32 (then the executor keeps f32
    /// master weights beside the working weights).
    fn working_copy(&self) -> bool;

    fn alloc(&self, storage: Storage, len: usize) -> Result<Self::Buf, BackendError>;
    fn upload(&self, storage: Storage, data: &[f32]) -> Result<Self::Buf, BackendError>;
    /// The values of a view, as f32 (waits for queued work).
    fn download(&self, v: Self::Ref<'_>) -> Result<Vec<f32>, BackendError>;
    fn ids(&self, ids: Vec<u32>) -> Result<Self::Ids, BackendError>;

    fn view<'a>(buf: &'a Self::Buf) -> Self::Ref<'a>;
    fn view_mut<'a>(buf: &'a mut Self::Buf) -> Self::Mut<'a>;
    fn len(v: Self::Ref<'_>) -> usize;
    fn len_mut(v: &Self::Mut<'_>) -> usize;
    fn sub<'a>(v: Self::Ref<'a>, r: Range<usize>) -> Self::Ref<'a>
    where
        Self: 'a;
    fn sub_mut<'a>(v: Self::Mut<'a>, r: Range<usize>) -> Self::Mut<'a>
    where
        Self: 'a;
    fn split_at_mut<'a>(v: Self::Mut<'a>, at: usize) -> (Self::Mut<'a>, Self::Mut<'a>)
    where
        Self: 'a;
    /// Reborrows a write view for one call.
    fn rb<'s>(v: &'s mut Self::Mut<'_>) -> Self::Mut<'s>;
    /// Reads a write view.
    fn ro<'s>(v: &'s Self::Mut<'_>) -> Self::Ref<'s>;
    /// A read view for a shorter lifetime (views are invariant in it).
    fn rr<'s>(v: &'s Self::Ref<'_>) -> Self::Ref<'s>;
    /// Turns a write view into a read view of the same elements.
    fn freeze<'a>(v: Self::Mut<'a>) -> Self::Ref<'a>
    where
        Self: 'a;
    /// The host f32 memory behind a read view, on a backend whose buffers are host f32 slices
    /// (the CPU's, where `Storage::Bf16` is f32 too); `None` on a device. The host-only
    /// defaults (attention dropout) run on these, so only where they exist.
    fn host<'a>(_v: Self::Ref<'a>) -> Option<&'a [f32]>
    where
        Self: 'a,
    {
        None
    }
    /// [`Backend::host`] for a write view.
    fn host_mut<'a>(_v: Self::Mut<'a>) -> Option<&'a mut [f32]>
    where
        Self: 'a,
    {
        None
    }

    // ---- element-wise -------------------------------------------------------------------
    fn fill(&self, x: Self::Mut<'_>, value: f32) -> Result<(), BackendError>;
    fn copy(&self, dst: Self::Mut<'_>, src: Self::Ref<'_>) -> Result<(), BackendError>;
    /// `a += b`.
    fn add_assign(&self, a: Self::Mut<'_>, b: Self::Ref<'_>) -> Result<(), BackendError>;
    /// `x *= s`, in activation storage.
    fn scale(&self, x: Self::Mut<'_>, s: f32) -> Result<(), BackendError>;
    /// Σ x (f64, in order): the loss sum.
    fn sum(&self, x: Self::Ref<'_>) -> Result<f64, BackendError>;
    /// Σ x² (f64, in order): the squared gradient norm.
    fn sum_squares(&self, x: Self::Ref<'_>) -> Result<f64, BackendError>;

    // ---- matmuls (shapes as in `crate::backend::cpu::kernels::matmul`) ---------------------------------------
    /// `out (n, m) [+]= x (n, k) · w (m, k)ᵀ`.
    fn matmul_bt(
        &self,
        out: Self::Mut<'_>,
        x: Self::Ref<'_>,
        w: Self::Ref<'_>,
        n: usize,
        k: usize,
        m: usize,
        acc: bool,
    ) -> Result<(), BackendError>;
    /// `dw (m, k) [+]= dy (n, m)ᵀ · x (n, k)`.
    fn matmul_at(
        &self,
        dw: Self::Mut<'_>,
        dy: Self::Ref<'_>,
        x: Self::Ref<'_>,
        m: usize,
        n: usize,
        k: usize,
        acc: bool,
    ) -> Result<(), BackendError>;
    /// `dx (n, k) [+]= dy (n, m) · w (m, k)`.
    fn matmul(
        &self,
        dx: Self::Mut<'_>,
        dy: Self::Ref<'_>,
        w: Self::Ref<'_>,
        n: usize,
        m: usize,
        k: usize,
        acc: bool,
    ) -> Result<(), BackendError>;
    /// `y (N, c) += b (c)`.
    fn add_bias(&self, y: Self::Mut<'_>, b: Self::Ref<'_>) -> Result<(), BackendError>;
    /// `db (c) += Σ_rows dy (N, c)`.
    fn bias_backward(&self, db: Self::Mut<'_>, dy: Self::Ref<'_>) -> Result<(), BackendError>;

    // ---- rows by index (expert parallelism's dispatch and combine) --------------------------
    // The defaults are correct on any backend but stage through host memory where a row is
    // scaled (download, `cpu::kernels::rows`, upload into activation storage); the CPU runs
    // the kernels in place. Index lists are the router's host vectors.

    /// `dst (rows.len(), c)`: row `i` = `src` row `rows[i]`, times `scale[i]` when given.
    /// `dst` is in activation storage.
    fn gather_rows(
        &self,
        mut dst: Self::Mut<'_>,
        src: Self::Ref<'_>,
        rows: &[usize],
        scale: Option<&[f32]>,
        c: usize,
    ) -> Result<(), BackendError> {
        if scale.is_none() {
            // Plain copies stay on the backend.
            for (i, &r) in rows.iter().enumerate() {
                let o = Self::sub_mut(Self::rb(&mut dst), i * c..(i + 1) * c);
                self.copy(o, Self::sub(src, r * c..(r + 1) * c))?;
            }
            return Ok(());
        }
        let mut out = vec![0.0; rows.len() * c];
        cpu::kernels::gather_rows(&mut out, &self.download(src)?, rows, scale, c);
        self.write_rows(dst, &out)
    }
    /// `dst` row `to[i]` += `scale[i]` · `src` row `from[i]`, for each `i` in order. `dst` is
    /// in activation storage.
    fn scatter_add_rows(
        &self,
        dst: Self::Mut<'_>,
        src: Self::Ref<'_>,
        to: &[usize],
        from: &[usize],
        scale: &[f32],
        c: usize,
    ) -> Result<(), BackendError> {
        let mut out = self.download(Self::ro(&dst))?;
        cpu::kernels::scatter_add_rows(&mut out, &self.download(src)?, to, from, scale, c);
        self.write_rows(dst, &out)
    }
    /// Host values into an activation-storage view (the staged defaults' last step).
    fn write_rows(&self, dst: Self::Mut<'_>, x: &[f32]) -> Result<(), BackendError> {
        if x.is_empty() {
            return Ok(());
        }
        let buf = self.upload(Storage::Bf16, x)?;
        self.copy(dst, Self::view(&buf))
    }

    // ---- embeddings ---------------------------------------------------------------------
    /// `out (N, c) = wte[ids − vocab_start]`, zeros for ids outside the shard.
    fn embedding_forward(
        &self,
        out: Self::Mut<'_>,
        ids: &Self::Ids,
        wte: Self::Ref<'_>,
        vocab_start: usize,
        c: usize,
    ) -> Result<(), BackendError>;
    /// `dwte[ids − vocab_start] += dout`.
    fn embedding_backward(
        &self,
        dwte: Self::Mut<'_>,
        ids: &Self::Ids,
        dout: Self::Ref<'_>,
        vocab_start: usize,
        c: usize,
    ) -> Result<(), BackendError>;
    /// `out (rows, c) += wpe[(first + row) % t]` (`first`: the first row's index in the
    /// micro-batch, non-zero for a sequence-parallel shard).
    fn pos_embedding_forward(
        &self,
        out: Self::Mut<'_>,
        wpe: Self::Ref<'_>,
        t: usize,
        c: usize,
        first: usize,
    ) -> Result<(), BackendError>;
    /// `dwpe[p] += Σ_b dout[b, p]`.
    fn pos_embedding_backward(
        &self,
        dwpe: Self::Mut<'_>,
        dout: Self::Ref<'_>,
        t: usize,
        c: usize,
    ) -> Result<(), BackendError>;

    // ---- norms (input gradients ACCUMULATED) ----------------------------------------------
    fn layernorm_forward(
        &self,
        out: Self::Mut<'_>,
        mean: Self::Mut<'_>,
        rstd: Self::Mut<'_>,
        inp: Self::Ref<'_>,
        weight: Self::Ref<'_>,
        bias: Option<Self::Ref<'_>>,
        c: usize,
        eps: f32,
    ) -> Result<(), BackendError>;
    fn layernorm_backward(
        &self,
        dinp: Self::Mut<'_>,
        dweight: Self::Mut<'_>,
        dbias: Option<Self::Mut<'_>>,
        dout: Self::Ref<'_>,
        inp: Self::Ref<'_>,
        weight: Self::Ref<'_>,
        mean: Self::Ref<'_>,
        rstd: Self::Ref<'_>,
        c: usize,
    ) -> Result<(), BackendError>;
    fn rmsnorm_forward(
        &self,
        out: Self::Mut<'_>,
        rstd: Self::Mut<'_>,
        inp: Self::Ref<'_>,
        weight: Self::Ref<'_>,
        c: usize,
        eps: f32,
    ) -> Result<(), BackendError>;
    fn rmsnorm_backward(
        &self,
        dinp: Self::Mut<'_>,
        dweight: Self::Mut<'_>,
        dout: Self::Ref<'_>,
        inp: Self::Ref<'_>,
        weight: Self::Ref<'_>,
        rstd: Self::Ref<'_>,
        c: usize,
    ) -> Result<(), BackendError>;

    // ---- attention ----------------------------------------------------------------------
    /// Elements attention keeps for its backward: the probabilities `(B, hq, T, T)` on the
    /// CPU, the log-sum-exp `(B, hq, T)` of a flash-style kernel on a GPU.
    fn attention_saved_len(&self, s: &AttnShape) -> usize;
    /// Whether that is small enough to keep under selective recompute (a flash kernel's
    /// log-sum-exp is; the CPU's probabilities are what selective recompute drops).
    fn attention_keeps_saved(&self) -> bool;
    fn attention_scratch_len(&self, s: &AttnShape) -> usize;
    /// Causal GQA attention: `y (N, hq·hd)` from `qkv (N, (hq+2hkv)·hd)`, filling `saved`.
    fn attention_forward(
        &self,
        y: Self::Mut<'_>,
        saved: Self::Mut<'_>,
        qkv: Self::Ref<'_>,
        s: AttnShape,
    ) -> Result<(), BackendError>;
    /// [`Backend::attention_forward`] with dropout on the probabilities (`mask` draws it, and
    /// the backward draws the same). Host kernels only: the default runs the CPU's on host
    /// views and refuses on a device, where a plan with dropout is refused before it starts.
    fn attention_forward_dropout(
        &self,
        y: Self::Mut<'_>,
        saved: Self::Mut<'_>,
        qkv: Self::Ref<'_>,
        s: AttnShape,
        mask: &AttnMask,
    ) -> Result<(), BackendError> {
        let (Some(y), Some(saved), Some(qkv)) =
            (Self::host_mut(y), Self::host_mut(saved), Self::host(qkv))
        else {
            return Err(dropout_off_host());
        };
        cpu::kernels::attention_probs(saved, qkv, s);
        cpu::kernels::attention_dropout::attention_values_dropout(y, saved, qkv, s, mask);
        Ok(())
    }
    /// The backward of [`Backend::attention_forward_dropout`], as it runs.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_dropout(
        &self,
        dqkv: Self::Mut<'_>,
        scratch: Self::Mut<'_>,
        dy: Self::Ref<'_>,
        qkv: Self::Ref<'_>,
        saved: Self::Ref<'_>,
        s: AttnShape,
        mask: &AttnMask,
    ) -> Result<(), BackendError> {
        let views = (
            Self::host_mut(dqkv),
            Self::host_mut(scratch),
            Self::host(dy),
            Self::host(qkv),
            Self::host(saved),
        );
        let (Some(dqkv), Some(scratch), Some(dy), Some(qkv), Some(saved)) = views else {
            return Err(dropout_off_host());
        };
        cpu::kernels::attention_dropout::attention_backward_dropout(
            dqkv, scratch, dy, qkv, saved, s, mask,
        );
        Ok(())
    }
    /// Recomputes `saved` alone from `qkv` (selective recompute).
    fn attention_recompute(
        &self,
        saved: Self::Mut<'_>,
        qkv: Self::Ref<'_>,
        s: AttnShape,
    ) -> Result<(), BackendError>;
    /// `dqkv` overwritten.
    fn attention_backward(
        &self,
        dqkv: Self::Mut<'_>,
        scratch: Self::Mut<'_>,
        dy: Self::Ref<'_>,
        qkv: Self::Ref<'_>,
        y: Self::Ref<'_>,
        saved: Self::Ref<'_>,
        s: AttnShape,
    ) -> Result<(), BackendError>;
    /// RoPE in place (see [`ops::Kernels::rope`]); `cos`, `sin`: `(t, hd/2)` each.
    fn rope(
        &self,
        x: Self::Mut<'_>,
        shape: RopeShape,
        cos: Self::Ref<'_>,
        sin: Self::Ref<'_>,
        backward: bool,
    ) -> Result<(), BackendError>;

    // ---- ring attention (context parallelism; layouts in `cpu::kernels::ring_attention`) ----
    // One rank's share of `s.b` sequences, `s.rows()` local tokens each. The running output
    // and the gradients accumulate in `F32` buffers (bf16 would round at every ring step);
    // `qkv`, `dy`, `y`, `dqkv` and the K/V message `kv` are in activation storage.

    /// Scratch elements (`F32`) [`Backend::ring_forward_step`] and
    /// [`Backend::ring_backward_step`] need.
    fn ring_scratch_len(&self, s: &RingShape) -> usize;
    /// The K/V message of the rank's own chunks, `kv = [K | V]`, out of `qkv`.
    fn ring_pack_kv(
        &self,
        kv: Self::Mut<'_>,
        qkv: Self::Ref<'_>,
        s: &RingShape,
    ) -> Result<(), BackendError>;
    /// One ring step of the forward: the rank's query chunks (global indices `q_chunks`)
    /// against the message `kv` of chunks `kv_chunks`, each block merged by log-sum-exp into
    /// the running `o (b, rows, hq·hd)` and `lse (b, hq, rows)` (both `F32`; start them at 0
    /// and −∞).
    fn ring_forward_step(
        &self,
        o: Self::Mut<'_>,
        lse: Self::Mut<'_>,
        scratch: Self::Mut<'_>,
        qkv: Self::Ref<'_>,
        kv: Self::Ref<'_>,
        q_chunks: [usize; 2],
        kv_chunks: [usize; 2],
        s: &RingShape,
    ) -> Result<(), BackendError>;
    /// `delta (b, hq, rows)` (`F32`) = `rowsum(dy ∘ y)` per head.
    fn ring_softmax_delta(
        &self,
        delta: Self::Mut<'_>,
        y: Self::Ref<'_>,
        dy: Self::Ref<'_>,
        s: &RingShape,
    ) -> Result<(), BackendError>;
    /// One ring step of the backward, ACCUMULATING: `dq (b, rows, hq·hd)` the step's dQ of the
    /// rank's queries, `dkv` (the message's layout) the step's dK/dV of chunks `kv_chunks`
    /// (both `F32`), from the forward's final `lse` and [`Backend::ring_softmax_delta`]'s
    /// `delta`.
    fn ring_backward_step(
        &self,
        dq: Self::Mut<'_>,
        dkv: Self::Mut<'_>,
        scratch: Self::Mut<'_>,
        qkv: Self::Ref<'_>,
        kv: Self::Ref<'_>,
        dy: Self::Ref<'_>,
        lse: Self::Ref<'_>,
        delta: Self::Ref<'_>,
        q_chunks: [usize; 2],
        kv_chunks: [usize; 2],
        s: &RingShape,
    ) -> Result<(), BackendError>;
    /// `dqkv` overwritten: each row `[dq | dK | dV]` from `dq` and the rank's own dK/dV
    /// message `dkv` (both `F32`).
    fn ring_unpack(
        &self,
        dqkv: Self::Mut<'_>,
        dq: Self::Ref<'_>,
        dkv: Self::Ref<'_>,
        s: &RingShape,
    ) -> Result<(), BackendError>;

    // ---- activations --------------------------------------------------------------------
    fn gelu_forward(&self, out: Self::Mut<'_>, inp: Self::Ref<'_>) -> Result<(), BackendError>;
    fn gelu_backward(
        &self,
        dinp: Self::Mut<'_>,
        inp: Self::Ref<'_>,
        dout: Self::Ref<'_>,
    ) -> Result<(), BackendError>;
    /// `out (N, f)` from `inp (N, 2f)` rows `[gate | up]`.
    fn swiglu_forward(
        &self,
        out: Self::Mut<'_>,
        inp: Self::Ref<'_>,
        f: usize,
    ) -> Result<(), BackendError>;
    fn swiglu_backward(
        &self,
        dinp: Self::Mut<'_>,
        inp: Self::Ref<'_>,
        dout: Self::Ref<'_>,
        f: usize,
    ) -> Result<(), BackendError>;

    // ---- fused element-wise work (defaults: the separate kernels, in the same order) --------
    // A device backend overrides these with one launch each (docs/cuda.md, "Launches per
    // layer"); the CPU keeps the defaults, so its results are the separate kernels' exactly.

    /// `h (N, c) += bias` (when given), then `a = gelu(h)`: the fc layer's bias and GELU.
    fn bias_gelu_forward(
        &self,
        mut h: Self::Mut<'_>,
        a: Self::Mut<'_>,
        bias: Option<Self::Ref<'_>>,
    ) -> Result<(), BackendError> {
        if let Some(b) = bias {
            self.add_bias(Self::rb(&mut h), b)?;
        }
        self.gelu_forward(a, Self::freeze(h))
    }
    /// `dinp = gelu'(inp) · dout` (overwritten), then `dbias += Σ_rows dinp` (when given).
    fn gelu_backward_bias(
        &self,
        mut dinp: Self::Mut<'_>,
        dbias: Option<Self::Mut<'_>>,
        inp: Self::Ref<'_>,
        dout: Self::Ref<'_>,
    ) -> Result<(), BackendError> {
        self.gelu_backward(Self::rb(&mut dinp), inp, dout)?;
        match dbias {
            Some(db) => self.bias_backward(db, Self::freeze(dinp)),
            None => Ok(()),
        }
    }
    /// `y (N, c) += bias` (when given), then `y += res`: a projection's bias and the residual.
    fn add_bias_residual(
        &self,
        mut y: Self::Mut<'_>,
        bias: Option<Self::Ref<'_>>,
        res: Self::Ref<'_>,
    ) -> Result<(), BackendError> {
        if let Some(b) = bias {
            self.add_bias(Self::rb(&mut y), b)?;
        }
        self.add_assign(y, res)
    }
    /// [`add_bias_residual`](Self::add_bias_residual) on `x`, then
    /// [`layernorm_forward`](Self::layernorm_forward) of it.
    fn residual_layernorm_forward(
        &self,
        mut x: Self::Mut<'_>,
        proj_bias: Option<Self::Ref<'_>>,
        res: Self::Ref<'_>,
        out: Self::Mut<'_>,
        mean: Self::Mut<'_>,
        rstd: Self::Mut<'_>,
        weight: Self::Ref<'_>,
        bias: Option<Self::Ref<'_>>,
        c: usize,
        eps: f32,
    ) -> Result<(), BackendError> {
        self.add_bias_residual(Self::rb(&mut x), proj_bias, res)?;
        self.layernorm_forward(out, mean, rstd, Self::freeze(x), weight, bias, c, eps)
    }
    /// [`add_bias_residual`](Self::add_bias_residual) on `x`, then
    /// [`rmsnorm_forward`](Self::rmsnorm_forward) of it.
    fn residual_rmsnorm_forward(
        &self,
        mut x: Self::Mut<'_>,
        proj_bias: Option<Self::Ref<'_>>,
        res: Self::Ref<'_>,
        out: Self::Mut<'_>,
        rstd: Self::Mut<'_>,
        weight: Self::Ref<'_>,
        c: usize,
        eps: f32,
    ) -> Result<(), BackendError> {
        self.add_bias_residual(Self::rb(&mut x), proj_bias, res)?;
        self.rmsnorm_forward(out, rstd, Self::freeze(x), weight, c, eps)
    }

    // ---- vocab-parallel cross-entropy -----------------------------------------------------
    /// `max (N)` = row maxima of this shard's `logits (N, v)`.
    fn row_max(
        &self,
        max: Self::Mut<'_>,
        logits: Self::Ref<'_>,
        v: usize,
    ) -> Result<(), BackendError>;
    /// `both (2N) = [Σ exp(l − max) | target logit or 0]` over this shard's columns.
    fn ce_partials(
        &self,
        both: Self::Mut<'_>,
        logits: Self::Ref<'_>,
        max: Self::Ref<'_>,
        targets: &Self::Ids,
        vocab_start: usize,
        v: usize,
    ) -> Result<(), BackendError>;
    /// From the group-summed `both`: `losses = ln(sumexp) + max − target`, `sumexp` saved.
    fn ce_losses(
        &self,
        losses: Self::Mut<'_>,
        sumexp: Self::Mut<'_>,
        max: Self::Ref<'_>,
        both: Self::Ref<'_>,
    ) -> Result<(), BackendError>;
    /// In place: `logits ← (softmax − onehot) · dlosses` from GLOBAL row statistics.
    fn crossentropy_backward(
        &self,
        logits: Self::Mut<'_>,
        max: Self::Ref<'_>,
        sumexp: Self::Ref<'_>,
        targets: &Self::Ids,
        dlosses: Self::Ref<'_>,
        vocab_start: usize,
        v: usize,
    ) -> Result<(), BackendError>;

    // ---- optimizer ----------------------------------------------------------------------
    /// One AdamW update of `master` (f32) and the moments; `working`, when the backend keeps a
    /// working copy, receives the updated weights in working precision.
    fn adamw(
        &self,
        master: Self::Mut<'_>,
        working: Option<Self::Mut<'_>>,
        grads: Self::Ref<'_>,
        m: Self::Mut<'_>,
        v: Self::Mut<'_>,
        step: &AdamWStep,
    ) -> Result<(), BackendError>;
}

/// One rank's view of a process group, on a backend's buffers. Every implementation gives
/// results identical on every rank of the group; the host ones (and [`cuda::HostStaged`])
/// keep the contract of [`crate::comm`] too, reductions in rank order, so a parallel run on them
/// is bit-reproducible. NCCL reduces in its own order.
pub trait Collective<B: Backend> {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn all_reduce_sum(&self, buf: B::Mut<'_>) -> Result<(), CommError>;
    /// Starts `buf = Σ buf` and may return before it is done: the caller neither reads nor
    /// writes `buf`'s range until [`Collective::wait_started`]. Where the transport has a
    /// stream of its own (NCCL), the sum overlaps the compute that follows, as data parallelism's
    /// gradient buckets do during the backward. By default it is [`Collective::all_reduce_sum`].
    fn all_reduce_sum_start(&self, buf: B::Mut<'_>) -> Result<(), CommError> {
        self.all_reduce_sum(buf)
    }
    /// Orders everything after this call behind the sums started so far.
    fn wait_started(&self) -> Result<(), CommError> {
        Ok(())
    }
    /// Element-wise maximum over the group.
    fn all_reduce_max(&self, buf: B::Mut<'_>) -> Result<(), CommError>;
    /// `output (size · n)` = every rank's `input (n)`, in rank order.
    fn all_gather(&self, input: B::Ref<'_>, output: B::Mut<'_>) -> Result<(), CommError>;
    /// `output (n)` = this rank's part of the sum of every rank's `input (size · n)`.
    fn reduce_scatter_sum(&self, input: B::Ref<'_>, output: B::Mut<'_>) -> Result<(), CommError>;
    /// Sends `buf` to `peer`. Buffered: it may return before `peer` receives (the host comms
    /// queue it; NCCL's stages it and issues it in one NCCL group with the group's next
    /// receive), so a ring of ranks that each send, then receive, does not deadlock as long as
    /// each receive follows only the send it pairs with (`layers::context_parallel`).
    fn send(&self, buf: B::Ref<'_>, peer: usize) -> Result<(), CommError>;
    /// Receives `peer`'s next message to this rank into `buf` (its length must match).
    fn recv(&self, buf: B::Mut<'_>, peer: usize) -> Result<(), CommError>;
    /// A host scalar summed over the group (same value on every rank).
    fn all_reduce_f64(&self, x: f64) -> Result<f64, CommError>;
    /// All-to-all with per-peer sizes ([`Comm::all_to_all_v`](crate::comm::Comm::all_to_all_v)): `send_counts[p]` elements of
    /// `input` to rank `p`, `recv_counts[p]` elements from rank `p` into `output`, rank order.
    /// Expert parallelism's token exchange (`layers::moe`). The host comms, the device's
    /// host-staged collective and NCCL's (grouped send/receive) have one; a collective without
    /// one says so.
    fn all_to_all_v(
        &self,
        _input: B::Ref<'_>,
        _send_counts: &[usize],
        _output: B::Mut<'_>,
        _recv_counts: &[usize],
    ) -> Result<(), CommError> {
        Err(CommError::Transport {
            op: "all_to_all_v",
            message: "this collective has no all-to-all; expert parallelism needs one (the CPU backend's, or the device's staged or NCCL collectives)".into(),
        })
    }
}

/// `slot`'s buffer, allocated on first use and again when shorter than `len`, as a write view
/// of its first `len` elements (contents unspecified: callers overwrite them).
pub fn scratch<'a, B: Backend>(
    be: &B,
    slot: &'a mut Option<B::Buf>,
    storage: Storage,
    len: usize,
) -> Result<B::Mut<'a>, BackendError> {
    if slot.as_ref().is_some_and(|b| B::len(B::view(b)) < len) {
        *slot = None;
    }
    let buf = match slot {
        Some(b) => b,
        None => slot.insert(be.alloc(storage, len)?),
    };
    Ok(B::sub_mut(B::view_mut(buf), 0..len))
}

/// Attention dropout off host memory: the refusal of [`Backend::attention_forward_dropout`]'s
/// default on a device.
fn dropout_off_host() -> BackendError {
    BackendError::Unsupported {
        what: "attention dropout runs on the CPU backend only (host memory)".into(),
        fix: "train with dropout 0 on a device (training.dropout), or use --backend cpu".into(),
    }
}
