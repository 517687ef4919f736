//! Every host [`Comm`] is a [`Collective`] on the CPU backend (its buffers are host f32 slices).

use super::{Collective, Cpu};
use crate::comm::{all_reduce_f64, all_reduce_max, Comm, CommError};

/// Every host [`Comm`] is a collective on the CPU backend.
impl<C: Comm + ?Sized> Collective<Cpu> for C {
    fn rank(&self) -> usize {
        Comm::rank(self)
    }
    fn size(&self) -> usize {
        Comm::size(self)
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        Comm::all_reduce_sum(self, buf)
    }
    fn all_reduce_max(&self, buf: &mut [f32]) -> Result<(), CommError> {
        all_reduce_max(&DynComm(self), buf)
    }
    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        Comm::all_gather(self, input, output)
    }
    fn reduce_scatter_sum(&self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        Comm::reduce_scatter_sum(self, input, output)
    }
    fn send(&self, buf: &[f32], peer: usize) -> Result<(), CommError> {
        Comm::send(self, buf, peer)
    }
    fn recv(&self, buf: &mut [f32], peer: usize) -> Result<(), CommError> {
        Comm::recv(self, buf, peer)
    }
    fn all_reduce_f64(&self, x: f64) -> Result<f64, CommError> {
        all_reduce_f64(&DynComm(self), x)
    }
    fn all_to_all_v(
        &self,
        input: &[f32],
        send_counts: &[usize],
        output: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        Comm::all_to_all_v(self, input, send_counts, output, recv_counts)
    }
}

/// A `?Sized` comm behind a sized wrapper, for the helpers that take `&dyn Comm`.
struct DynComm<'a, C: ?Sized>(&'a C);

impl<C: Comm + ?Sized> Comm for DynComm<'_, C> {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        self.0.all_reduce_sum(buf)
    }
    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.0.all_gather(input, output)
    }
    fn reduce_scatter_sum(&self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        self.0.reduce_scatter_sum(input, output)
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.0.broadcast(buf, root)
    }
    fn send(&self, buf: &[f32], peer: usize) -> Result<(), CommError> {
        self.0.send(buf, peer)
    }
    fn recv(&self, buf: &mut [f32], peer: usize) -> Result<(), CommError> {
        self.0.recv(buf, peer)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.0.barrier()
    }
    fn all_to_all_v(
        &self,
        input: &[f32],
        send_counts: &[usize],
        output: &mut [f32],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        self.0.all_to_all_v(input, send_counts, output, recv_counts)
    }
}
