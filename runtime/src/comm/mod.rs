//! Communication: one rank's view of a process group (a TP, DP or PP group of the mesh).
//!
//! The [`Comm`] trait is the only way ranks exchange data. Implementations: [`LocalComm`]
//! (threads are ranks, always built); [`ChannelComm`] (threads are ranks, payloads moved by a
//! [`Carrier`]: host memory, or one GPU's memory for `cuda-local`, feature `cuda`); `NcclComm`
//! (one process per GPU, feature `cuda`) lives with the CUDA backend (`backend/cuda/nccl.rs`):
//! this module builds without the `cuda` feature and imports no backend.
//!
//! Contract every implementation must keep, because parity between plans rests on it:
//! reductions are **deterministic and identical on every rank** — each element is summed in
//! rank order `0 + 1 + … + (n-1)`, whatever the algorithm moves around. Then a TP/DP run
//! differs from the single-rank run only by the (tiny) reassociation of partial sums, never by
//! run-to-run noise, and replicated tensors stay bitwise equal across the ranks of a group.
//!
//! This module must not know about layers or plans, and only the group builders (`groups.rs`,
//! `group_ids.rs`, `channel::channel_groups`, and the CUDA backend's `nccl_groups`) ask the mesh which ranks
//! form a group: to everything else a group is just `size()` ranks.

mod channel;
pub mod group_ids;
mod groups;
mod local;

pub use channel::{channel_groups, Carrier, ChannelComm, HostCarrier};
pub use groups::{local_groups, local_moe_groups, MoeGroups, RankGroups};
pub use local::LocalComm;

/// Why a collective or point-to-point operation failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// Buffer lengths do not fit the operation (e.g. all_gather output ≠ size × input).
    #[error("{op}: buffer of {got} elements where {expected} were expected; every rank must pass buffers of the documented lengths")]
    SizeMismatch {
        op: &'static str,
        expected: usize,
        got: usize,
    },
    /// A peer's handle was dropped (its thread ended or panicked) before it sent what we wait for.
    #[error("{op}: rank {peer} of this group is gone (its thread ended or panicked); look at that rank's error first")]
    PeerGone { op: &'static str, peer: usize },
    /// No message arrived in time: usually ranks issued collectives in different orders.
    #[error("{op}: no message from rank {peer} after {secs} s; do all ranks of the group issue the same collectives in the same order?")]
    Timeout {
        op: &'static str,
        peer: usize,
        secs: u64,
    },
    /// A message of another operation (or another length) arrived: the ranks are out of step.
    #[error("{op}: rank {peer} sent a message of {got}, expected {expected}; ranks issued operations in different orders")]
    OutOfStep {
        op: &'static str,
        peer: usize,
        expected: String,
        got: String,
    },
    /// The transport itself failed (a CUDA or NCCL call); the message names the call.
    #[error("{op}: {message}")]
    Transport { op: &'static str, message: String },
    /// A rank argument (root, peer) outside `0..size`, or a rank sending to itself.
    #[error("{op}: rank {rank} is not a valid peer in a group of {size}")]
    BadRank {
        op: &'static str,
        rank: usize,
        size: usize,
    },
}

/// One rank's handle on a process group of `size()` ranks.
///
/// All collectives must be called by every rank of the group, in the same order.
/// Reductions sum in rank order `0..size` and give bitwise identical results on every rank.
pub trait Comm {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// In place: `buf = Σ_r buf_r`, summed in rank order; identical on all ranks.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError>;
    /// `output = concat(input_0, …, input_{n-1})`; `output.len() == size() * input.len()`.
    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<(), CommError>;
    /// Rank r gets the r-th equal chunk of `Σ_r input_r` (rank-order sum);
    /// `input.len() == size() * output.len()`.
    fn reduce_scatter_sum(&self, input: &[f32], output: &mut [f32]) -> Result<(), CommError>;
    /// Every rank's `buf` becomes `root`'s.
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError>;
    /// Buffered send to `peer`: returns without waiting for the matching `recv`.
    fn send(&self, buf: &[f32], peer: usize) -> Result<(), CommError>;
    /// Blocking receive of exactly `buf.len()` elements from `peer`.
    fn recv(&self, buf: &mut [f32], peer: usize) -> Result<(), CommError>;
    /// Returns once every rank of the group has entered the barrier.
    fn barrier(&self) -> Result<(), CommError>;
    /// All-to-all with per-peer sizes (MPI's `alltoallv`, the token exchange of expert
    /// parallelism): `input` holds `send_counts[p]` elements for each rank `p`, in rank order,
    /// and `output` receives `recv_counts[p]` elements from each rank `p`, in rank order. Rank
    /// `p`'s `send_counts[self.rank()]` must equal this rank's `recv_counts[p]`. The default
    /// posts every buffered send first and then receives in rank order, so no cycle of waits
    /// can form; the own part is copied.
    fn all_to_all_v(
        &self,
        input: &[f32],
        send_counts: &[usize],
        output: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let n = self.size();
        check_counts("all_to_all_v", n, input.len(), send_counts)?;
        check_counts("all_to_all_v", n, output.len(), recv_counts)?;
        let me = self.rank();
        if send_counts[me] != recv_counts[me] {
            return Err(CommError::SizeMismatch {
                op: "all_to_all_v (own part)",
                expected: send_counts[me],
                got: recv_counts[me],
            });
        }
        let starts = |counts: &[usize]| -> Vec<usize> {
            counts
                .iter()
                .scan(0, |at, &c| {
                    let s = *at;
                    *at += c;
                    Some(s)
                })
                .collect()
        };
        let (from, to) = (starts(send_counts), starts(recv_counts));
        for p in (0..n).filter(|&p| p != me) {
            self.send(&input[from[p]..from[p] + send_counts[p]], p)?;
        }
        output[to[me]..to[me] + recv_counts[me]]
            .copy_from_slice(&input[from[me]..from[me] + send_counts[me]]);
        for p in (0..n).filter(|&p| p != me) {
            self.recv(&mut output[to[p]..to[p] + recv_counts[p]], p)?;
        }
        Ok(())
    }
}

/// `counts` has one entry per rank of a group of `n` and they add up to `len`.
fn check_counts(op: &'static str, n: usize, len: usize, counts: &[usize]) -> Result<(), CommError> {
    if counts.len() != n {
        return Err(CommError::SizeMismatch {
            op,
            expected: n,
            got: counts.len(),
        });
    }
    let total: usize = counts.iter().sum();
    if total != len {
        return Err(CommError::SizeMismatch {
            op,
            expected: total,
            got: len,
        });
    }
    Ok(())
}

/// Sum one f64 over the group exactly (no f32 rounding): the values travel bit-split through an
/// all_gather and are added in rank order in f64. Used for global gradient norms and losses.
pub fn all_reduce_f64(comm: &dyn Comm, x: f64) -> Result<f64, CommError> {
    let bits = x.to_bits();
    let mine = [
        f32::from_bits((bits >> 32) as u32),
        f32::from_bits(bits as u32),
    ];
    let mut all = vec![0.0f32; 2 * comm.size()];
    comm.all_gather(&mine, &mut all)?;
    Ok(all
        .chunks_exact(2)
        .map(|p| f64::from_bits((u64::from(p[0].to_bits()) << 32) | u64::from(p[1].to_bits())))
        .sum())
}

/// Element-wise maximum over the group (all_gather, then max in rank order). Used by the
/// vocab-parallel cross-entropy; exact, so identical on every rank.
pub fn all_reduce_max(comm: &dyn Comm, buf: &mut [f32]) -> Result<(), CommError> {
    if comm.size() == 1 {
        return Ok(());
    }
    let n = buf.len();
    let mut all = vec![0.0f32; n * comm.size()];
    comm.all_gather(buf, &mut all)?;
    buf.copy_from_slice(&all[..n]);
    for chunk in all[n..].chunks_exact(n) {
        for (b, &c) in buf.iter_mut().zip(chunk) {
            *b = b.max(c);
        }
    }
    Ok(())
}
