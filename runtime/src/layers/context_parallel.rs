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
//! post into per-pair queues), so each step sends first, computes, then receives: a receive
//! waits only for a send its peer issued before its own receive of that step, and no cycle of
//! waits can form. K/V and dK/dV are separate messages; per pair of ranks they are sent and
//! received in the same order (K/V, then dK/dV), and the per-pair queues keep that order.
//!
//! The math is `backend::cpu::kernels::ring_attention` (f32 slices, see there for how a bf16
//! caller converts); this file adds the ranks: the chunk assignment, the positions a rank's
//! tokens have (RoPE and learned position embeddings need them), cutting a `(b, T, …)` tensor
//! into a rank's share and back, and the ring itself over a [`Collective`] on the CPU backend.

use std::ops::Range;

use super::LayerError;
use crate::backend::cpu::kernels::ring_attention::{self as ring, block_mask, block_pairs};
use crate::backend::{AttnShape, Backend, Collective, Cpu};
use crate::comm::CommError;

/// A host communicator (the ring moves f32 slices), as a CP group is held.
type HostComm = dyn crate::comm::Comm + Send;

pub use crate::backend::cpu::kernels::ring_attention::RingShape;

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

/// The buffers one rank's ring needs: two K/V messages (held, arriving), two dK/dV messages,
/// `delta`, and the block scratch. Reusable across calls of the same shape.
#[derive(Debug, Clone)]
pub struct RingWorkspace {
    shape: RingShape,
    kv: Vec<f32>,
    kv_next: Vec<f32>,
    dkv: Vec<f32>,
    dkv_next: Vec<f32>,
    delta: Vec<f32>,
    scratch: Vec<f32>,
}

impl RingWorkspace {
    pub fn new(shape: RingShape) -> Self {
        let kv = vec![0.0; shape.kv_len()];
        Self {
            shape,
            kv_next: kv.clone(),
            dkv: kv.clone(),
            dkv_next: kv.clone(),
            kv,
            delta: vec![0.0; shape.lse_len()],
            scratch: vec![0.0; ring::ring_scratch_len(&shape)],
        }
    }
    pub fn shape(&self) -> RingShape {
        self.shape
    }
}

fn neighbours<C: Collective<Cpu> + ?Sized>(comm: &C) -> (usize, usize, usize, usize) {
    let (cp, rank) = (comm.size(), comm.rank());
    (cp, rank, (rank + 1) % cp, (rank + cp - 1) % cp)
}

/// Ring-attention forward on CP rank `comm.rank()` of `comm.size()`: `qkv (b, t/cp, W)` holds the
/// rank's tokens ([`cp_split`] order, RoPE applied); `y (b, t/cp, hq·hd)` and
/// `lse (b, hq, t/cp)` (kept for the backward) are overwritten. Returns the unmasked (query,
/// key) pairs computed per sequence and head ([`cp_causal_pairs`]).
pub fn ring_attention_forward<C: Collective<Cpu> + ?Sized>(
    comm: &C,
    y: &mut [f32],
    lse: &mut [f32],
    ws: &mut RingWorkspace,
    qkv: &[f32],
) -> Result<usize, CommError> {
    let s = ws.shape;
    let (cp, rank, next, prev) = neighbours(comm);
    let mine = cp_chunks(cp, rank);
    ring::pack_kv(&mut ws.kv, qkv, &s);
    ring::ring_forward_init(y, lse);
    let mut pairs = 0;
    for step in 0..cp {
        let owner = (rank + cp - step) % cp;
        let more = step + 1 < cp;
        if more {
            comm.send(&ws.kv[..], next)?;
        }
        pairs += ring::ring_forward_step(
            y,
            lse,
            &mut ws.scratch,
            qkv,
            &ws.kv,
            mine,
            cp_chunks(cp, owner),
            &s,
        );
        if more {
            comm.recv(&mut ws.kv_next[..], prev)?;
            std::mem::swap(&mut ws.kv, &mut ws.kv_next);
        }
    }
    Ok(pairs)
}

/// Ring-attention backward: `dqkv (b, t/cp, W)` overwritten with the gradient w.r.t. this
/// rank's `qkv` (its K/V columns summed over every rank's queries), from `dy`, and the
/// forward's `qkv`, `y` and `lse`.
pub fn ring_attention_backward<C: Collective<Cpu> + ?Sized>(
    comm: &C,
    dqkv: &mut [f32],
    ws: &mut RingWorkspace,
    dy: &[f32],
    qkv: &[f32],
    y: &[f32],
    lse: &[f32],
) -> Result<(), CommError> {
    let s = ws.shape;
    let (cp, rank, next, prev) = neighbours(comm);
    let mine = cp_chunks(cp, rank);
    ring::pack_kv(&mut ws.kv, qkv, &s);
    ring::softmax_delta(&mut ws.delta, y, dy, &s);
    dqkv.fill(0.0);
    ws.dkv.fill(0.0);
    for step in 0..cp {
        let owner = (rank + cp - step) % cp;
        let more = step + 1 < cp;
        if more {
            comm.send(&ws.kv[..], next)?;
        }
        ring::ring_backward_step(
            dqkv,
            &mut ws.dkv,
            &mut ws.scratch,
            qkv,
            &ws.kv,
            dy,
            lse,
            &ws.delta,
            mine,
            cp_chunks(cp, owner),
            &s,
        );
        // The dK/dV of `owner`'s chunks go on with them (after the last step: home).
        if cp > 1 {
            comm.send(&ws.dkv[..], next)?;
        }
        if more {
            comm.recv(&mut ws.kv_next[..], prev)?;
            std::mem::swap(&mut ws.kv, &mut ws.kv_next);
        }
        if cp > 1 {
            comm.recv(&mut ws.dkv_next[..], prev)?;
            std::mem::swap(&mut ws.dkv, &mut ws.dkv_next);
        }
    }
    ring::unpack_dkv(dqkv, &ws.dkv, &s);
    Ok(())
}

/// A rank's ring attention as the layers run it: its CP group (a host
/// [`Comm`](crate::comm::Comm): the ring moves
/// f32 slices) and the ring's buffers, sized on first use. The executor hands one to the
/// stage's [`BlockWorkspace`](super::BlockWorkspace); attention of a block marked
/// context-parallel then runs [`ring_attention_forward`] / [`ring_attention_backward`] on it
/// in place of the backend's causal kernel, and keeps the log-sum-exp `(b, hq, t/cp)` as its
/// saved state.
pub struct CpRing {
    comm: Box<HostComm>,
    ws: Option<RingWorkspace>,
}

impl std::fmt::Debug for CpRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpRing(rank {} of {})", self.rank(), self.size())
    }
}

impl CpRing {
    pub fn new(comm: Box<HostComm>) -> Self {
        CpRing { comm, ws: None }
    }
    /// The CP degree.
    pub fn size(&self) -> usize {
        crate::comm::Comm::size(&*self.comm)
    }
    /// This rank's index in its CP group.
    pub fn rank(&self) -> usize {
        crate::comm::Comm::rank(&*self.comm)
    }
    /// The global positions of this rank's `t_local` tokens of each sequence ([`cp_positions`]
    /// of the full `t_local · CP`).
    pub fn positions(&self, t_local: usize) -> Vec<usize> {
        cp_positions(t_local * self.size(), self.size(), self.rank())
    }

    fn parts(&mut self, s: &AttnShape) -> Result<(&HostComm, &mut RingWorkspace), LayerError> {
        let cp = self.size();
        let shape = ring_shape(s.b, s.t * cp, cp, s.hq, s.hkv, s.hd)?;
        let ws = match self.ws.take() {
            Some(w) if w.shape() == shape => w,
            _ => RingWorkspace::new(shape),
        };
        Ok((&*self.comm, self.ws.insert(ws)))
    }

    /// Ring-attention forward of this rank's `qkv (b, t, W)` (`s.t` local tokens): `y` and
    /// `lse (b, hq, t)` overwritten.
    pub fn forward<B: Backend>(
        &mut self,
        y: B::Mut<'_>,
        lse: B::Mut<'_>,
        qkv: B::Ref<'_>,
        s: AttnShape,
    ) -> Result<(), LayerError> {
        let (y, lse, qkv) = (host_mut::<B>(y)?, host_mut::<B>(lse)?, host::<B>(qkv)?);
        let (comm, ws) = self.parts(&s)?;
        ring_attention_forward(comm, y, &mut lse[..ws.shape().lse_len()], ws, qkv)?;
        Ok(())
    }

    /// Ring-attention backward: `dqkv` overwritten, from `dy` and the forward's `qkv`, `y`,
    /// `lse`.
    pub fn backward<B: Backend>(
        &mut self,
        dqkv: B::Mut<'_>,
        dy: B::Ref<'_>,
        qkv: B::Ref<'_>,
        y: B::Ref<'_>,
        lse: B::Ref<'_>,
        s: AttnShape,
    ) -> Result<(), LayerError> {
        let dqkv = host_mut::<B>(dqkv)?;
        let (dy, qkv, y, lse) = (
            host::<B>(dy)?,
            host::<B>(qkv)?,
            host::<B>(y)?,
            host::<B>(lse)?,
        );
        let (comm, ws) = self.parts(&s)?;
        let lse = &lse[..ws.shape().lse_len()];
        ring_attention_backward(comm, dqkv, ws, dy, qkv, y, lse)?;
        Ok(())
    }
}

fn on_host() -> LayerError {
    LayerError::Config(
        "context parallelism (ring attention) runs on the CPU backend only: its ring moves \
         host f32 buffers"
            .into(),
    )
}

fn host<'a, B: Backend>(v: B::Ref<'a>) -> Result<&'a [f32], LayerError> {
    B::host(v).ok_or_else(on_host)
}

fn host_mut<'a, B: Backend>(v: B::Mut<'a>) -> Result<&'a mut [f32], LayerError> {
    B::host_mut(v).ok_or_else(on_host)
}

#[cfg(test)]
#[path = "context_parallel_tests.rs"]
mod tests;
