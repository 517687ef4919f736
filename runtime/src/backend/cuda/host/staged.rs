//! [`HostStaged`]: the collectives of a [`Device`] backend through host memory — download the
//! view, run the host [`Comm`] (rank-order sums, the contract of `crate::comm`), write the result
//! back. It lets the one executor run on emulated (or real) devices with threads as ranks; NCCL
//! on device buffers replaces it where the speed matters.

use super::{DMut, DRef, Device, GpuError, Launcher};
use crate::backend::{Backend, Collective};
use crate::comm::{all_reduce_f64, all_reduce_max, Comm, CommError};

/// A host communicator serving a device backend.
pub struct HostStaged<L: Launcher, C> {
    dev: Device<L>,
    comm: C,
}

impl<L: Launcher, C: Comm> HostStaged<L, C> {
    pub fn new(dev: Device<L>, comm: C) -> Self {
        HostStaged { dev, comm }
    }
}

fn transport(op: &'static str) -> impl Fn(GpuError) -> CommError {
    move |e| CommError::Transport {
        op,
        message: e.to_string(),
    }
}

impl<L, C> HostStaged<L, C>
where
    L: Launcher + Sync + 'static,
    L::Buf: Send + Sync,
    C: Comm,
{
    fn get(&self, op: &'static str, v: DRef<'_, L::Buf>) -> Result<Vec<f32>, CommError> {
        self.dev.download(v).map_err(transport(op))
    }

    /// A group of one: its collectives stay on the device (a copy at most), no host round trip.
    fn alone(&self) -> bool {
        self.comm.size() == 1
    }

    fn copy(
        &self,
        op: &'static str,
        dst: DMut<'_, L::Buf>,
        src: DRef<'_, L::Buf>,
    ) -> Result<(), CommError> {
        if dst.len != src.len {
            return Err(CommError::SizeMismatch {
                op,
                expected: src.len,
                got: dst.len,
            });
        }
        Backend::copy(&self.dev, dst, src).map_err(|e| CommError::Transport {
            op,
            message: e.to_string(),
        })
    }

    fn put(&self, op: &'static str, v: DMut<'_, L::Buf>, x: &[f32]) -> Result<(), CommError> {
        self.dev.write(v, x).map_err(transport(op))
    }
}

impl<L, C> Collective<Device<L>> for HostStaged<L, C>
where
    L: Launcher + Sync + 'static,
    L::Buf: Send + Sync,
    C: Comm,
{
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn size(&self) -> usize {
        self.comm.size()
    }
    fn all_reduce_sum(&self, buf: DMut<'_, L::Buf>) -> Result<(), CommError> {
        if self.alone() {
            return Ok(());
        }
        let mut x = self.get("all_reduce", Device::<L>::ro(&buf))?;
        self.comm.all_reduce_sum(&mut x)?;
        self.put("all_reduce", buf, &x)
    }
    fn all_reduce_max(&self, buf: DMut<'_, L::Buf>) -> Result<(), CommError> {
        if self.alone() {
            return Ok(());
        }
        let mut x = self.get("all_reduce_max", Device::<L>::ro(&buf))?;
        all_reduce_max(&self.comm, &mut x)?;
        self.put("all_reduce_max", buf, &x)
    }
    fn all_gather(
        &self,
        input: DRef<'_, L::Buf>,
        output: DMut<'_, L::Buf>,
    ) -> Result<(), CommError> {
        if self.alone() {
            return self.copy("all_gather", output, input);
        }
        let x = self.get("all_gather", input)?;
        let mut out = vec![0.0; output.len];
        self.comm.all_gather(&x, &mut out)?;
        self.put("all_gather", output, &out)
    }
    fn reduce_scatter_sum(
        &self,
        input: DRef<'_, L::Buf>,
        output: DMut<'_, L::Buf>,
    ) -> Result<(), CommError> {
        if self.alone() {
            return self.copy("reduce_scatter", output, input);
        }
        let x = self.get("reduce_scatter", input)?;
        let mut out = vec![0.0; output.len];
        self.comm.reduce_scatter_sum(&x, &mut out)?;
        self.put("reduce_scatter", output, &out)
    }
    fn send(&self, buf: DRef<'_, L::Buf>, peer: usize) -> Result<(), CommError> {
        let x = self.get("send", buf)?;
        self.comm.send(&x, peer)
    }
    fn recv(&self, buf: DMut<'_, L::Buf>, peer: usize) -> Result<(), CommError> {
        let mut x = vec![0.0; buf.len];
        self.comm.recv(&mut x, peer)?;
        self.put("recv", buf, &x)
    }
    fn all_reduce_f64(&self, x: f64) -> Result<f64, CommError> {
        all_reduce_f64(&self.comm, x)
    }
    fn all_to_all_v(
        &self,
        input: DRef<'_, L::Buf>,
        send_counts: &[usize],
        output: DMut<'_, L::Buf>,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let x = self.get("all_to_all_v", input)?;
        let mut out = vec![0.0; output.len];
        self.comm
            .all_to_all_v(&x, send_counts, &mut out, recv_counts)?;
        self.put("all_to_all_v", output, &out)
    }
}
