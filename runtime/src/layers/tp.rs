//! Tensor-parallel coordinates and Megatron's conjugate collectives.
//!
//! `copy_to_tp` / `reduce_from_tp` are Megatron's f / g pair: `copy_to_tp` is the identity in
//! the forward (each TP rank already holds the replicated input) and an all-reduce of the input
//! gradient in the backward; `reduce_from_tp` is an all-reduce in the forward and the identity
//! in the backward. A column-parallel linear sits after `copy_to_tp`, a row-parallel one before
//! `reduce_from_tp`. Since layers here write their backward explicitly, the pair appears as four
//! named functions so every collective in a layer is visible at its call site.
//!
//! This module must not build groups: the caller hands in the TP group's [`Comm`].

use crate::backend::{Backend, Collective};
use crate::comm::CommError;
use crate::params::Shard;

use super::LayerError;

/// This rank's place in its tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpShard {
    pub rank: usize,
    pub size: usize,
}

impl TpShard {
    /// The unsharded case (t = 1).
    pub const SINGLE: TpShard = TpShard { rank: 0, size: 1 };

    pub fn new(rank: usize, size: usize) -> Self {
        assert!(rank < size, "TP rank {rank} outside a group of {size}");
        Self { rank, size }
    }

    /// The TP coordinates of a TP group's comm handle.
    pub fn of<B: Backend, C: Collective<B> + ?Sized>(comm: &C) -> Self {
        Self::new(comm.rank(), comm.size())
    }

    /// This rank's part of `n` things (`n / size` each): `(start, len)`; errors unless divisible.
    pub fn split(&self, n: usize, what: &'static str) -> Result<(usize, usize), LayerError> {
        if !n.is_multiple_of(self.size) {
            return Err(LayerError::NotDivisible {
                what,
                n,
                tp: self.size,
            });
        }
        let len = n / self.size;
        Ok((self.rank * len, len))
    }

    /// The parameter sharding "dimension `dim` split over this group".
    pub fn shard(&self, dim: usize) -> Shard {
        Shard::Split {
            dim,
            rank: self.rank,
            parts: self.size,
        }
    }
}

/// f, forward: identity (the input is already replicated on every TP rank); f, backward: each
/// rank holds a partial input gradient; sum them (rank order).
pub fn copy_to_tp_backward<B: Backend, C: Collective<B> + ?Sized>(
    comm: &C,
    dx: B::Mut<'_>,
) -> Result<(), CommError> {
    comm.all_reduce_sum(dx)
}

/// g, forward: each rank holds a partial output; sum them (rank order). g, backward: identity
/// (the output gradient is replicated on every TP rank).
pub fn reduce_from_tp_forward<B: Backend, C: Collective<B> + ?Sized>(
    comm: &C,
    y: B::Mut<'_>,
) -> Result<(), CommError> {
    comm.all_reduce_sum(y)
}

/// Sequence parallelism (Korthikanti et al. 2022, §4.2.2): outside the TP regions each rank
/// holds rows `[r·N/t, (r+1)·N/t)` of the activations. Entering a region, the rows are
/// all-gathered (`g` forward); leaving it, the partial sums are reduce-scattered (`ḡ` forward).
/// In the backward the two swap. Rows are the flattened `B·T` tokens, so `N` must divide by `t`.
pub fn gather_rows<B: Backend, C: Collective<B> + ?Sized>(
    comm: &C,
    local: B::Ref<'_>,
    full: B::Mut<'_>,
) -> Result<(), CommError> {
    comm.all_gather(local, full)
}

/// The other half of the pair: the rank-order sum of every rank's `full`, this rank's rows only.
pub fn scatter_rows<B: Backend, C: Collective<B> + ?Sized>(
    comm: &C,
    full: B::Ref<'_>,
    local: B::Mut<'_>,
) -> Result<(), CommError> {
    comm.reduce_scatter_sum(full, local)
}
