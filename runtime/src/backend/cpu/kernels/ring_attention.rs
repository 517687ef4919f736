//! The block math of ring attention (context parallelism), forward and backward, f32.
//!
//! Under context parallelism (CP) a rank holds two of the sequence's `2·CP` chunks of `chunk`
//! tokens (Megatron-Core's causal load balancing; which two is the ring driver's business,
//! `layers::context_parallel`) and sees the other ranks' keys and values one pair of chunks at a
//! time. This module is the math the driver runs on each such pair, with no communication and no
//! notion of ranks: chunks are named by their GLOBAL index in the sequence, which is all the
//! causal mask needs ([`block_mask`]: a query chunk attends fully to earlier chunks, causally to
//! itself, not at all to later ones).
//!
//! - [`block_forward`]: one (sequence, head) block, `q (tq×hd)` against `k, v (tk×hd)`: the
//!   block's softmax-normalised output and its per-row log-sum-exp (flash-attention's `lse`).
//! - [`merge_row`]: the online-softmax merge of a partial output into the running one by their
//!   log-sum-exps, so the blocks of a row may arrive in any order.
//! - [`block_backward`]: a block's gradients from the FINAL `lse` and `D = rowsum(dO ∘ O)`
//!   ([`softmax_delta`]), as flash-attention's backward: `P = exp(S − lse)` is the block of the
//!   full softmax, so the blocks' gradients simply add.
//! - [`ring_forward_step`] / [`ring_backward_step`]: every (q chunk, kv chunk, sequence, head)
//!   block of one ring step on a rank's buffers, GQA-aware like `attention.rs` (q head `h` reads
//!   kv head `h / (hq / hkv)`).
//!
//! Layouts (a rank's `rows = 2·chunk` local tokens per sequence, its first chunk then its second):
//! `qkv: (b, rows, (hq + 2hkv)·hd)`, rows `[q heads | k heads | v heads]`, the fused projection's
//! layout that `attention.rs` reads; `y, dy: (b, rows, hq·hd)`; `lse, delta: (b, hq, rows)`; the
//! K/V message `kv, dkv: [K (b, rows, hkv·hd) | V (b, rows, hkv·hd)]` (K and V apart, so the
//! backward can write dK and dV through two disjoint borrows).
//!
//! Everything is f32: these are the CPU backend's ring-attention ops (`Backend::ring_*`), on its
//! buffers as they are (the CPU computes its `Bf16` storage as f32, `cpu/mod.rs`); a device
//! runs its own kernels of the same math (`backend/cuda/kernels/ring_attention.cu`). The dQ of
//! the backward accumulates in a buffer of its own, laid out as `y`, and [`ring_unpack`] writes
//! `dqkv` from it and the rank's dK/dV at the end.
//!
//! Must not allocate (scratch: [`ring_scratch_len`]), communicate, or know about ranks.

use super::matmul::{gemm, MatMut, MatRef};

/// Sizes of one rank's share under ring attention (local heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingShape {
    /// Sequences.
    pub b: usize,
    /// Tokens per chunk: `T / (2·CP)`.
    pub chunk: usize,
    /// Query heads.
    pub hq: usize,
    /// Key/value heads; divides `hq`.
    pub hkv: usize,
    /// Head size.
    pub hd: usize,
}

impl RingShape {
    /// Local tokens per sequence: two chunks.
    pub fn rows(&self) -> usize {
        2 * self.chunk
    }
    /// Row width of the fused qkv buffer.
    pub fn qkv_width(&self) -> usize {
        (self.hq + 2 * self.hkv) * self.hd
    }
    /// Row width of `y`.
    pub fn y_width(&self) -> usize {
        self.hq * self.hd
    }
    /// Elements of the K/V (or dK/dV) message: `2 · b · rows · hkv · hd`.
    pub fn kv_len(&self) -> usize {
        2 * self.kv_half()
    }
    /// Elements of `lse` and `delta`.
    pub fn lse_len(&self) -> usize {
        self.b * self.hq * self.rows()
    }
    /// The softmax scale `1/√hd`, as `attention.rs`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.hd as f32).sqrt()
    }
    fn kv_half(&self) -> usize {
        self.b * self.rows() * self.hkv * self.hd
    }
    fn kv_width(&self) -> usize {
        self.hkv * self.hd
    }
    /// q head `h`, local row `r`, sequence `bi` in `qkv`.
    fn q_at(&self, bi: usize, r: usize, h: usize) -> usize {
        (bi * self.rows() + r) * self.qkv_width() + h * self.hd
    }
    /// kv head `g`, local row `r`, sequence `bi` in either half of the K/V message.
    fn kv_at(&self, bi: usize, r: usize, g: usize) -> usize {
        (bi * self.rows() + r) * self.kv_width() + g * self.hd
    }
    fn y_at(&self, bi: usize, r: usize, h: usize) -> usize {
        (bi * self.rows() + r) * self.y_width() + h * self.hd
    }
    fn lse_at(&self, bi: usize, h: usize, r: usize) -> usize {
        (bi * self.hq + h) * self.rows() + r
    }
    fn check(&self) {
        assert!(
            self.hkv > 0 && self.hq.is_multiple_of(self.hkv),
            "GQA needs hkv dividing hq, got hq={} hkv={}",
            self.hq,
            self.hkv
        );
    }
}

/// Scratch elements the step functions need (the forward's and the backward's, whichever is
/// larger).
pub fn ring_scratch_len(s: &RingShape) -> usize {
    let c = s.chunk;
    (2 * c * c).max(c * c + c * s.hd + c)
}

/// How a query chunk sees a key/value chunk of the same length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockMask {
    /// Every query row sees every key (the keys are all earlier).
    Full,
    /// Row `r` sees keys `0..=r` (the same chunk).
    Causal,
}

/// The mask of query chunk `q_chunk` against key chunk `kv_chunk` (global chunk indices);
/// `None`: every key is later than every query, the block is skipped.
pub fn block_mask(q_chunk: usize, kv_chunk: usize) -> Option<BlockMask> {
    use std::cmp::Ordering::*;
    match kv_chunk.cmp(&q_chunk) {
        Less => Some(BlockMask::Full),
        Equal => Some(BlockMask::Causal),
        Greater => None,
    }
}

/// Unmasked (query, key) pairs of a `chunk × chunk` block.
pub fn block_pairs(mask: BlockMask, chunk: usize) -> usize {
    match mask {
        BlockMask::Full => chunk * chunk,
        BlockMask::Causal => chunk * (chunk + 1) / 2,
    }
}

fn live(mask: BlockMask, row: usize, tk: usize) -> usize {
    match mask {
        BlockMask::Full => tk,
        BlockMask::Causal => row + 1,
    }
}

/// One block's forward for one (sequence, head): `o (tq×hd, dense) = softmax(scale·q·kᵀ) · v`
/// over the keys `mask` leaves, and `lse (tq)` = each row's log-sum-exp of those scores.
/// `p`: `tq·tk` scratch (left holding the probabilities). `Causal` needs `tq == tk`.
pub fn block_forward(
    o: &mut [f32],
    lse: &mut [f32],
    p: &mut [f32],
    q: MatRef<'_>,
    k: MatRef<'_>,
    v: MatRef<'_>,
    scale: f32,
    mask: BlockMask,
    tq: usize,
    tk: usize,
    hd: usize,
) {
    assert!(
        mask == BlockMask::Full || tq == tk,
        "a causal block is square"
    );
    let p = &mut p[..tq * tk];
    gemm(MatMut::rows(p, tq, tk), q, k.t(), scale, false);
    for (r, row) in p.chunks_exact_mut(tk).enumerate() {
        let (seen, masked) = row.split_at_mut(live(mask, r, tk));
        let max = seen.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut z = 0.0f32;
        for x in seen.iter_mut() {
            *x = (*x - max).exp();
            z += *x;
        }
        let inv = 1.0 / z;
        seen.iter_mut().for_each(|x| *x *= inv);
        masked.fill(0.0);
        lse[r] = max + z.ln();
    }
    gemm(
        MatMut::rows(&mut o[..tq * hd], tq, hd),
        MatRef::rows(p, tq, tk),
        v,
        1.0,
        false,
    );
}

/// Online-softmax merge of one row: `(o, lse) ← (o, lse) ⊕ (part, part_lse)`, both outputs
/// normalised by their own softmax. `lse = −∞` marks an empty running row (it takes `part`).
pub fn merge_row(o: &mut [f32], lse: &mut f32, part: &[f32], part_lse: f32) {
    debug_assert_eq!(o.len(), part.len());
    if *lse == f32::NEG_INFINITY {
        o.copy_from_slice(part);
        *lse = part_lse;
        return;
    }
    let m = lse.max(part_lse);
    let (a, b) = ((*lse - m).exp(), (part_lse - m).exp());
    let z = a + b;
    let (wa, wb) = (a / z, b / z);
    o.iter_mut()
        .zip(part)
        .for_each(|(x, &y)| *x = wa * *x + wb * y);
    *lse = m + z.ln();
}

/// One block's backward for one (sequence, head), ACCUMULATING: `dq (tq×hd) += scale·dS·k`,
/// `dk (tk×hd) += scale·dSᵀ·q`, `dv (tk×hd) += Pᵀ·dout`, with `P = exp(scale·q·kᵀ − lse)` (the
/// block of the full softmax, from the final `lse`) and `dS = P ∘ (dout·vᵀ − delta)`.
/// `scratch`: at least `2·tq·tk` elements.
pub fn block_backward(
    dq: MatMut<'_>,
    dk: MatMut<'_>,
    dv: MatMut<'_>,
    scratch: &mut [f32],
    q: MatRef<'_>,
    k: MatRef<'_>,
    v: MatRef<'_>,
    dout: MatRef<'_>,
    lse: &[f32],
    delta: &[f32],
    scale: f32,
    mask: BlockMask,
    tq: usize,
    tk: usize,
) {
    assert!(
        mask == BlockMask::Full || tq == tk,
        "a causal block is square"
    );
    let (p, rest) = scratch.split_at_mut(tq * tk);
    let ds = &mut rest[..tq * tk];
    gemm(MatMut::rows(p, tq, tk), q, k.t(), scale, false);
    for (r, row) in p.chunks_exact_mut(tk).enumerate() {
        let (seen, masked) = row.split_at_mut(live(mask, r, tk));
        seen.iter_mut().for_each(|x| *x = (*x - lse[r]).exp());
        masked.fill(0.0);
    }
    // dP = dout·vᵀ, then dS = P ∘ (dP − D) in place.
    gemm(MatMut::rows(ds, tq, tk), dout, v.t(), 1.0, false);
    for (r, (d, pr)) in ds.chunks_exact_mut(tk).zip(p.chunks_exact(tk)).enumerate() {
        d.iter_mut()
            .zip(pr)
            .for_each(|(d, &p)| *d = p * (*d - delta[r]));
    }
    let (p, ds) = (MatRef::rows(p, tq, tk), MatRef::rows(ds, tq, tk));
    gemm(dv, p.t(), dout, 1.0, true);
    gemm(dq, ds, k, scale, true);
    gemm(dk, ds.t(), q, scale, true);
}

/// The K/V message of a rank's own chunks: `kv = [K | V]` copied out of `qkv`.
pub fn pack_kv(kv: &mut [f32], qkv: &[f32], s: &RingShape) {
    assert_eq!(kv.len(), s.kv_len(), "kv message");
    let (w, kw, hq) = (s.qkv_width(), s.kv_width(), s.hq * s.hd);
    let (k, v) = kv.split_at_mut(s.kv_half());
    for ((row, k), v) in qkv
        .chunks_exact(w)
        .zip(k.chunks_exact_mut(kw))
        .zip(v.chunks_exact_mut(kw))
    {
        k.copy_from_slice(&row[hq..hq + kw]);
        v.copy_from_slice(&row[hq + kw..]);
    }
}

/// Writes (overwrites) `dqkv` from a rank's dQ (`(b, rows, hq·hd)`, the layout of `y`) and its
/// own dK/dV message: each row `[dq | dK | dV]`.
pub fn ring_unpack(dqkv: &mut [f32], dq: &[f32], dkv: &[f32], s: &RingShape) {
    assert_eq!(dkv.len(), s.kv_len(), "dkv message");
    assert_eq!(dq.len(), s.b * s.rows() * s.y_width(), "dq");
    let (w, kw, hq) = (s.qkv_width(), s.kv_width(), s.y_width());
    let (dk, dv) = dkv.split_at(s.kv_half());
    for (((row, q), k), v) in dqkv
        .chunks_exact_mut(w)
        .zip(dq.chunks_exact(hq))
        .zip(dk.chunks_exact(kw))
        .zip(dv.chunks_exact(kw))
    {
        row[..hq].copy_from_slice(q);
        row[hq..hq + kw].copy_from_slice(k);
        row[hq + kw..].copy_from_slice(v);
    }
}

/// Empty running outputs for [`ring_forward_step`]: `y = 0`, `lse = −∞`.
pub fn ring_forward_init(y: &mut [f32], lse: &mut [f32]) {
    y.fill(0.0);
    lse.fill(f32::NEG_INFINITY);
}

/// One ring step of the forward: the rank's query chunks (global indices `q_chunks`, in `qkv`)
/// against the K/V message `kv` of chunks `kv_chunks`, merged into the running `y` and `lse`.
/// Returns the unmasked (query, key) pairs computed per sequence and query head.
pub fn ring_forward_step(
    y: &mut [f32],
    lse: &mut [f32],
    scratch: &mut [f32],
    qkv: &[f32],
    kv: &[f32],
    q_chunks: [usize; 2],
    kv_chunks: [usize; 2],
    s: &RingShape,
) -> usize {
    s.check();
    let (c, hd) = (s.chunk, s.hd);
    assert_eq!(qkv.len(), s.b * s.rows() * s.qkv_width(), "qkv");
    assert_eq!(y.len(), s.b * s.rows() * s.y_width(), "y");
    assert_eq!(lse.len(), s.lse_len(), "lse");
    assert_eq!(kv.len(), s.kv_len(), "kv message");
    assert!(
        scratch.len() >= ring_scratch_len(s),
        "ring scratch too small"
    );
    let (k, v) = kv.split_at(s.kv_half());
    let (p, rest) = scratch.split_at_mut(c * c);
    let (o, rest) = rest.split_at_mut(c * hd);
    let part_lse = &mut rest[..c];
    let mut pairs = 0;
    for (a, &qc) in q_chunks.iter().enumerate() {
        for (kb, &kc) in kv_chunks.iter().enumerate() {
            let Some(mask) = block_mask(qc, kc) else {
                continue;
            };
            pairs += block_pairs(mask, c);
            for bi in 0..s.b {
                for h in 0..s.hq {
                    let g = h / (s.hq / s.hkv);
                    let kat = s.kv_at(bi, kb * c, g);
                    block_forward(
                        o,
                        part_lse,
                        p,
                        MatRef::new(qkv, s.q_at(bi, a * c, h), c, hd, s.qkv_width(), 1),
                        MatRef::new(k, kat, c, hd, s.kv_width(), 1),
                        MatRef::new(v, kat, c, hd, s.kv_width(), 1),
                        s.scale(),
                        mask,
                        c,
                        c,
                        hd,
                    );
                    for r in 0..c {
                        let yo = s.y_at(bi, a * c + r, h);
                        merge_row(
                            &mut y[yo..yo + hd],
                            &mut lse[s.lse_at(bi, h, a * c + r)],
                            &o[r * hd..(r + 1) * hd],
                            part_lse[r],
                        );
                    }
                }
            }
        }
    }
    pairs
}

/// `delta = rowsum(dy ∘ y)` per (sequence, head, row), in `lse`'s layout.
pub fn softmax_delta(delta: &mut [f32], y: &[f32], dy: &[f32], s: &RingShape) {
    assert_eq!(delta.len(), s.lse_len(), "delta");
    for bi in 0..s.b {
        for h in 0..s.hq {
            for r in 0..s.rows() {
                let at = s.y_at(bi, r, h);
                delta[s.lse_at(bi, h, r)] = super::dot(&y[at..at + s.hd], &dy[at..at + s.hd]);
            }
        }
    }
}

/// One ring step of the backward, ACCUMULATING: `dq` (`(b, rows, hq·hd)`, the layout of `y`)
/// gets this step's dQ of the rank's query chunks, `dkv` (laid out as the K/V message) this
/// step's dK/dV of chunks `kv_chunks`. `lse` is the forward's final one, `delta` from
/// [`softmax_delta`]; [`ring_unpack`] assembles `dqkv` after the last step.
pub fn ring_backward_step(
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
) {
    s.check();
    let (c, hd, w, kw, yw) = (s.chunk, s.hd, s.qkv_width(), s.kv_width(), s.y_width());
    assert_eq!(dq.len(), s.b * s.rows() * yw, "dq");
    assert_eq!(qkv.len(), s.b * s.rows() * w, "qkv");
    assert_eq!(dy.len(), s.b * s.rows() * yw, "dy");
    assert_eq!((lse.len(), delta.len()), (s.lse_len(), s.lse_len()), "lse");
    assert_eq!((kv.len(), dkv.len()), (s.kv_len(), s.kv_len()), "kv");
    assert!(
        scratch.len() >= ring_scratch_len(s),
        "ring scratch too small"
    );
    let (k, v) = kv.split_at(s.kv_half());
    let (dk, dv) = dkv.split_at_mut(s.kv_half());
    for (a, &qc) in q_chunks.iter().enumerate() {
        for (kb, &kc) in kv_chunks.iter().enumerate() {
            let Some(mask) = block_mask(qc, kc) else {
                continue;
            };
            for bi in 0..s.b {
                for h in 0..s.hq {
                    let g = h / (s.hq / s.hkv);
                    let (qat, kat) = (s.q_at(bi, a * c, h), s.kv_at(bi, kb * c, g));
                    let rows = s.lse_at(bi, h, a * c)..s.lse_at(bi, h, a * c) + c;
                    block_backward(
                        MatMut::new(dq, s.y_at(bi, a * c, h), c, hd, yw, 1),
                        MatMut::new(dk, kat, c, hd, kw, 1),
                        MatMut::new(dv, kat, c, hd, kw, 1),
                        scratch,
                        MatRef::new(qkv, qat, c, hd, w, 1),
                        MatRef::new(k, kat, c, hd, kw, 1),
                        MatRef::new(v, kat, c, hd, kw, 1),
                        MatRef::new(dy, s.y_at(bi, a * c, h), c, hd, yw, 1),
                        &lse[rows.clone()],
                        &delta[rows],
                        s.scale(),
                        mask,
                        c,
                        c,
                    );
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "ring_attention_tests.rs"]
mod tests;
