//! Context parallelism (CP): ring attention over the CP group, with causal load balancing, as
//! Megatron-Core runs it through Transformer Engine's `AttnFuncWithCPAndKVP2P`
//! (`cp_comm_type = "p2p"`). docs/context-parallel.md explains the ring and its volume.
//!
//! The sequence of `T` tokens is cut into `2·CP` chunks of `T / (2·CP)`; CP rank `i` holds
//! chunks `i` and `2·CP − 1 − i` ([`cp_chunks`]), so every rank has the same causal work. Each
//! rank computes Q, K, V of its own tokens; the attention then runs `CP` ring steps: at step `s`
//! rank `i` holds the K/V of rank `(i − s) mod CP`, attends its query chunks to them (masked by
//! global chunk index, later chunks skipped), merges by log-sum-exp, and passes the K/V on to
//! rank `i + 1`. The backward walks the same ring from the rank's own K/V: each rank adds dQ
//! for its queries and dK/dV for the K/V it holds, and the dK/dV travel with the K/V, so after
//! `CP` hops they are back at their owner, summed over every rank that used them.
//!
//! Sends are buffered (the [`Comm`](crate::comm::Comm) contract: `LocalComm` and `ChannelComm`
//! post into per-pair queues; a device's `HostStaged` collective sends through them; NCCL's
//! collective stages a send on the device and issues it in one NCCL group with the group's next
//! receive), so each step sends first, computes, then receives: a receive waits only for a send
//! its peer issued before its own receive of that step, and no cycle of waits can form. Every
//! receive follows the one send it pairs with and no other (the backward receives the K/V
//! before it sends the dK/dV), so NCCL's group of pending sends and a receive always matches its
//! peers' groups. K/V and dK/dV are separate messages; per pair of ranks they are sent and
//! received in the same order (K/V, then dK/dV), and the per-pair queues keep that order.
//!
//! The math is the backend's (`Backend::ring_*`: the CPU backend's `ring_attention` kernels, a
//! device's `ring_attention.cu`), on its buffers; the running output and the gradients
//! accumulate in `F32` buffers of the [`RingWorkspace`]. This file adds the ranks: the chunk
//! assignment, the positions a rank's tokens have (RoPE and learned position embeddings need
//! them), cutting a `(b, T, …)` tensor into a rank's share and back, and the ring itself over
//! the CP group's [`Collective`].

use std::ops::Range;

use super::LayerError;
use crate::backend::{block_mask, block_pairs, AttnShape, Backend, Collective, Storage};

pub use crate::backend::RingShape;

/// The two global chunks (of `2·cp`) that CP rank `rank` holds: `[rank, 2·cp − 1 − rank]`.
pub fn cp_chunks(cp: usize, rank: usize) -> [usize; 2] {
    assert!(rank < cp, "CP rank {rank} outside a group of {cp}");
    [rank, 2 * cp - 1 - rank]
}

/// Tokens per chunk, `t / (2·cp)`, or why `t` cannot be cut.
pub fn cp_chunk_len(t: usize, cp: usize) -> Result<usize, LayerError> {
    if cp == 0 || t == 0 || !t.is_multiple_of(2 * cp) {
        return Err(LayerError::Config(format!(
            "context parallelism cuts each sequence into 2·CP chunks: {t} tokens do not divide \
             into 2 × {cp} = {} equal chunks; pick a sequence length divisible by 2·CP",
            2 * cp
        )));
    }
    Ok(t / (2 * cp))
}

/// The [`RingShape`] of one rank's share of `b` sequences of `t` tokens.
pub fn ring_shape(
    b: usize,
    t: usize,
    cp: usize,
    hq: usize,
    hkv: usize,
    hd: usize,
) -> Result<RingShape, LayerError> {
    if hkv == 0 || !hq.is_multiple_of(hkv) {
        return Err(LayerError::Config(format!(
            "ring attention needs kv heads ({hkv}) dividing the query heads ({hq})"
        )));
    }
    Ok(RingShape {
        b,
        chunk: cp_chunk_len(t, cp)?,
        hq,
        hkv,
        hd,
    })
}

/// The global positions of rank `rank`'s tokens within a sequence, as two ranges (its first
/// local chunk, then its second); `t` must divide by `2·cp`.
pub fn cp_token_ranges(t: usize, cp: usize, rank: usize) -> [Range<usize>; 2] {
    let c = cp_chunk_len(t, cp).unwrap_or_else(|e| panic!("{e}"));
    cp_chunks(cp, rank).map(|j| j * c..(j + 1) * c)
}

/// The global position of each of rank `rank`'s `t / cp` local tokens, in local order.
pub fn cp_positions(t: usize, cp: usize, rank: usize) -> Vec<usize> {
    cp_token_ranges(t, cp, rank).into_iter().flatten().collect()
}

/// Rank `rank`'s share of a `(b, t, w)` tensor: `(b, t / cp, w)`, its two chunks per sequence
/// in local order (token ids, positions, activations alike).
pub fn cp_split<T: Copy>(full: &[T], b: usize, t: usize, cp: usize, rank: usize) -> Vec<T> {
    assert!(
        b > 0 && t > 0 && full.len().is_multiple_of(b * t),
        "cp_split: {} elements are not (b = {b}, t = {t}, w)",
        full.len()
    );
    let w = full.len() / (b * t);
    let ranges = cp_token_ranges(t, cp, rank);
    let mut out = Vec::with_capacity(full.len() / cp);
    for seq in full.chunks_exact(t * w) {
        for r in &ranges {
            out.extend_from_slice(&seq[r.start * w..r.end * w]);
        }
    }
    out
}

/// The `(b, t, w)` tensor from every rank's share (`parts[rank]`, as [`cp_split`] cuts them).
pub fn cp_assemble<T: Copy>(parts: &[&[T]], b: usize, t: usize) -> Vec<T> {
    let cp = parts.len();
    let c = cp_chunk_len(t, cp).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        b > 0 && parts[0].len().is_multiple_of(b * 2 * c),
        "cp_assemble: shares of {} elements are not (b = {b}, {} tokens, w)",
        parts[0].len(),
        2 * c
    );
    let w = parts[0].len() / (b * 2 * c);
    // Which (rank, slot) holds each global chunk.
    let mut owner = vec![None; 2 * cp];
    for rank in 0..cp {
        for (slot, j) in cp_chunks(cp, rank).into_iter().enumerate() {
            owner[j] = Some((rank, slot));
        }
    }
    let mut out = Vec::with_capacity(b * t * w);
    for bi in 0..b {
        for (j, o) in owner.iter().enumerate() {
            let (rank, slot) = o.unwrap_or_else(|| panic!("chunk {j} has no CP rank"));
            let at = (bi * 2 * c + slot * c) * w;
            out.extend_from_slice(&parts[rank][at..at + c * w]);
        }
    }
    out
}

/// Unmasked (query, key) pairs rank `rank` computes per sequence and head over the whole ring
/// (the blocks [`ring_attention_forward`] runs): equal on every rank, `t·(t+1) / 2` in all.
pub fn cp_causal_pairs(t: usize, cp: usize, rank: usize) -> usize {
    let c = cp_chunk_len(t, cp).unwrap_or_else(|e| panic!("{e}"));
    let mine = cp_chunks(cp, rank);
    (0..cp)
        .flat_map(|owner| cp_chunks(cp, owner))
        .flat_map(|kc| mine.map(|qc| block_mask(qc, kc)))
        .flatten()
        .map(|m| block_pairs(m, c))
        .sum()
}

/// The buffers one rank's ring needs, on the backend: two K/V messages (held, arriving; in
/// activation storage), two dK/dV messages, the running output `o`, dQ, `delta` and the
/// block scratch (`F32`: accumulated over the ring's steps). Reusable across calls of the
/// same shape.
pub struct RingWorkspace<B: Backend> {
    shape: RingShape,
    kv: B::Buf,
    kv_next: B::Buf,
    dkv: B::Buf,
    dkv_next: B::Buf,
    o: B::Buf,
    dq: B::Buf,
    delta: B::Buf,
    scratch: B::Buf,
}

impl<B: Backend> RingWorkspace<B> {
    pub fn new(be: &B, shape: RingShape) -> Result<Self, LayerError> {
        let kv_len = shape.kv_len();
        let y_len = shape.b * shape.rows() * shape.y_width();
        let f32s = |len| be.alloc(Storage::F32, len);
        Ok(Self {
            shape,
            kv: be.alloc(Storage::Bf16, kv_len)?,
            kv_next: be.alloc(Storage::Bf16, kv_len)?,
            dkv: f32s(kv_len)?,
            dkv_next: f32s(kv_len)?,
            o: f32s(y_len)?,
            dq: f32s(y_len)?,
            delta: f32s(shape.lse_len())?,
            // Never empty: a device may need no scratch, and a view of nothing is still one.
            scratch: f32s(be.ring_scratch_len(&shape).max(1))?,
        })
    }
    pub fn shape(&self) -> RingShape {
        self.shape
    }
}

fn neighbours<B: Backend, C: Collective<B> + ?Sized>(comm: &C) -> (usize, usize, usize, usize) {
    let (cp, rank) = (comm.size(), comm.rank());
    (cp, rank, (rank + 1) % cp, (rank + cp - 1) % cp)
}

/// Unmasked (query, key) pairs per sequence and head of query chunks `q` against key chunks
/// `kv`, `c` tokens each (what a ring step computes).
fn step_pairs(q: [usize; 2], kv: [usize; 2], c: usize) -> usize {
    kv.into_iter()
        .flat_map(|kc| q.map(|qc| block_mask(qc, kc)))
        .flatten()
        .map(|m| block_pairs(m, c))
        .sum()
}

/// Ring-attention forward on CP rank `comm.rank()` of `comm.size()`: `qkv (b, t/cp, W)` holds
/// the rank's tokens ([`cp_split`] order, RoPE applied); `y (b, t/cp, hq·hd)` and
/// `lse (b, hq, t/cp)` (`F32`, kept for the backward) are overwritten. Returns the unmasked
/// (query, key) pairs computed per sequence and head ([`cp_causal_pairs`]).
pub fn ring_attention_forward<B: Backend, C: Collective<B> + ?Sized>(
    be: &B,
    comm: &C,
    y: B::Mut<'_>,
    mut lse: B::Mut<'_>,
    ws: &mut RingWorkspace<B>,
    qkv: B::Ref<'_>,
) -> Result<usize, LayerError> {
    let s = ws.shape;
    let (cp, rank, next, prev) = neighbours::<B, C>(comm);
    let mine = cp_chunks(cp, rank);
    be.ring_pack_kv(B::view_mut(&mut ws.kv), qkv, &s)?;
    be.fill(B::view_mut(&mut ws.o), 0.0)?;
    be.fill(B::rb(&mut lse), f32::NEG_INFINITY)?;
    let mut pairs = 0;
    for step in 0..cp {
        let owner = (rank + cp - step) % cp;
        let more = step + 1 < cp;
        if more {
            comm.send(B::view(&ws.kv), next)?;
        }
        let theirs = cp_chunks(cp, owner);
        be.ring_forward_step(
            B::view_mut(&mut ws.o),
            B::rb(&mut lse),
            B::view_mut(&mut ws.scratch),
            qkv,
            B::view(&ws.kv),
            mine,
            theirs,
            &s,
        )?;
        pairs += step_pairs(mine, theirs, s.chunk);
        if more {
            comm.recv(B::view_mut(&mut ws.kv_next), prev)?;
            std::mem::swap(&mut ws.kv, &mut ws.kv_next);
        }
    }
    be.copy(y, B::view(&ws.o))?;
    Ok(pairs)
}

/// Ring-attention backward: `dqkv (b, t/cp, W)` overwritten with the gradient w.r.t. this
/// rank's `qkv` (its K/V columns summed over every rank's queries), from `dy`, and the
/// forward's `qkv`, `y` and `lse`.
pub fn ring_attention_backward<B: Backend, C: Collective<B> + ?Sized>(
    be: &B,
    comm: &C,
    dqkv: B::Mut<'_>,
    ws: &mut RingWorkspace<B>,
    dy: B::Ref<'_>,
    qkv: B::Ref<'_>,
    y: B::Ref<'_>,
    lse: B::Ref<'_>,
) -> Result<(), LayerError> {
    let s = ws.shape;
    let (cp, rank, next, prev) = neighbours::<B, C>(comm);
    let mine = cp_chunks(cp, rank);
    be.ring_pack_kv(B::view_mut(&mut ws.kv), qkv, &s)?;
    be.ring_softmax_delta(B::view_mut(&mut ws.delta), y, dy, &s)?;
    be.fill(B::view_mut(&mut ws.dq), 0.0)?;
    be.fill(B::view_mut(&mut ws.dkv), 0.0)?;
    for step in 0..cp {
        let owner = (rank + cp - step) % cp;
        let more = step + 1 < cp;
        if more {
            comm.send(B::view(&ws.kv), next)?;
        }
        be.ring_backward_step(
            B::view_mut(&mut ws.dq),
            B::view_mut(&mut ws.dkv),
            B::view_mut(&mut ws.scratch),
            qkv,
            B::view(&ws.kv),
            dy,
            lse,
            B::view(&ws.delta),
            mine,
            cp_chunks(cp, owner),
            &s,
        )?;
        // Each receive right after the one send it pairs with (module doc).
        if more {
            comm.recv(B::view_mut(&mut ws.kv_next), prev)?;
            std::mem::swap(&mut ws.kv, &mut ws.kv_next);
        }
        // The dK/dV of `owner`'s chunks go on with them (after the last step: home).
        if cp > 1 {
            comm.send(B::view(&ws.dkv), next)?;
            comm.recv(B::view_mut(&mut ws.dkv_next), prev)?;
            std::mem::swap(&mut ws.dkv, &mut ws.dkv_next);
        }
    }
    be.ring_unpack(dqkv, B::view(&ws.dq), B::view(&ws.dkv), &s)?;
    Ok(())
}

/// The CP group on the backend's buffers (the ring's K/V and dK/dV messages).
pub type CpComm<B> = Box<dyn Collective<B>>;

/// A rank's ring attention as the layers run it: its CP group and the ring's buffers, sized
/// on first use. The executor hands one to the stage's
/// [`BlockWorkspace`](super::BlockWorkspace); attention of a block marked context-parallel
/// then runs [`ring_attention_forward`] / [`ring_attention_backward`] on it in place of the
/// backend's causal kernel, and keeps the log-sum-exp `(b, hq, t/cp)` as its saved state.
pub struct CpRing<B: Backend> {
    comm: CpComm<B>,
    ws: Option<RingWorkspace<B>>,
}

impl<B: Backend> std::fmt::Debug for CpRing<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpRing(rank {} of {})", self.rank(), self.size())
    }
}

impl<B: Backend> CpRing<B> {
    pub fn new(comm: CpComm<B>) -> Self {
        CpRing { comm, ws: None }
    }
    /// The CP degree.
    pub fn size(&self) -> usize {
        self.comm.size()
    }
    /// This rank's index in its CP group.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    /// The global positions of this rank's `t_local` tokens of each sequence ([`cp_positions`]
    /// of the full `t_local · CP`).
    pub fn positions(&self, t_local: usize) -> Vec<usize> {
        cp_positions(t_local * self.size(), self.size(), self.rank())
    }

    fn parts(
        &mut self,
        be: &B,
        s: &AttnShape,
    ) -> Result<(&dyn Collective<B>, &mut RingWorkspace<B>), LayerError> {
        let cp = self.size();
        let shape = ring_shape(s.b, s.t * cp, cp, s.hq, s.hkv, s.hd)?;
        let ws = match self.ws.take() {
            Some(w) if w.shape() == shape => w,
            _ => RingWorkspace::new(be, shape)?,
        };
        Ok((&*self.comm, self.ws.insert(ws)))
    }

    /// Ring-attention forward of this rank's `qkv (b, t, W)` (`s.t` local tokens): `y` and
    /// `lse (b, hq, t)` overwritten (`lse` may be longer; its head is used).
    pub fn forward(
        &mut self,
        be: &B,
        y: B::Mut<'_>,
        lse: B::Mut<'_>,
        qkv: B::Ref<'_>,
        s: AttnShape,
    ) -> Result<(), LayerError> {
        let (comm, ws) = self.parts(be, &s)?;
        let lse = sub_mut::<B>(lse, ws.shape().lse_len())?;
        ring_attention_forward(be, comm, y, lse, ws, qkv)?;
        Ok(())
    }

    /// Ring-attention backward: `dqkv` overwritten, from `dy` and the forward's `qkv`, `y`,
    /// `lse`.
    pub fn backward(
        &mut self,
        be: &B,
        dqkv: B::Mut<'_>,
        dy: B::Ref<'_>,
        qkv: B::Ref<'_>,
        y: B::Ref<'_>,
        lse: B::Ref<'_>,
        s: AttnShape,
    ) -> Result<(), LayerError> {
        let (comm, ws) = self.parts(be, &s)?;
        let n = ws.shape().lse_len();
        if B::len(lse) < n {
            return Err(short_lse(B::len(lse), n));
        }
        let lse = B::sub(lse, 0..n);
        ring_attention_backward(be, comm, dqkv, ws, dy, qkv, y, lse)?;
        Ok(())
    }
}

/// The first `n` elements of `v`, or why it is shorter.
fn sub_mut<B: Backend>(v: B::Mut<'_>, n: usize) -> Result<B::Mut<'_>, LayerError> {
    match B::len_mut(&v) >= n {
        true => Ok(B::sub_mut(v, 0..n)),
        false => Err(short_lse(B::len_mut(&v), n)),
    }
}

fn short_lse(got: usize, want: usize) -> LayerError {
    LayerError::Config(format!(
        "ring attention keeps a log-sum-exp of {want} elements; its buffer holds {got}"
    ))
}

#[cfg(test)]
#[path = "context_parallel_tests.rs"]
mod tests;
