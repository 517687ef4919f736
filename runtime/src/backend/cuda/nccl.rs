//! `NcclComm`: one rank's NCCL communicator for one group (TP, DP or PP), one process per GPU.
//!
//! - [`nccl_groups`] creates a rank's three communicators, always in the order TP, DP, PP (the
//!   same on every rank: `ncclCommInitRank` blocks until the group's members join), from the ids
//!   rank 0 made ([`new_ids`]) and the rendezvous carried (`crate::launch::rendezvous`).
//! - cudarc's `nccl::Comm` is `!Send`: create it on the thread that uses it. Its `NcclError` is
//!   not `std::error::Error`: it is mapped by hand. Its drop (`ncclCommAbort`) can panic: the
//!   panic is caught and reported.
//! - The [`Comm`] implementation works on host slices and keeps the trait's contract
//!   (rank-order sums, identical bits on every rank) by gathering and summing on the host; the
//!   `*_device` methods run NCCL's own reductions on device buffers for the training path.
//! - `send` is buffered: the payload is staged on the device and the ncclSend is issued with
//!   the next operation on this communicator, in one NCCL group with it when that is a `recv`
//!   (so two ranks that both send, then receive, do not deadlock on the GPU).
//!
//! NOT YET RUN ON A GPU (docs/cuda.md); needs two GPUs (NCCL refuses two ranks on one device).
//!
//! [`device`]: the device [`Collective`](crate::backend::Collective) on these communicators.

use std::cell::RefCell;
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DriverError};
use cudarc::nccl::{self, Id, NcclType, ReduceOp};
use tessera_planner::Mesh;

pub mod device;

use crate::backend::cuda::probe;
use crate::backend::GpuError;
use crate::comm::group_ids::{self, ID_BYTES};
use crate::comm::{Comm, CommError, RankGroups};

pub(crate) fn nccl_err(op: &'static str) -> impl Fn(nccl::result::NcclError) -> CommError {
    // NcclError wraps ncclResult_t, whose Debug names the result (e.g. ncclInvalidUsage).
    move |e| CommError::Transport {
        op,
        message: format!("{:?}", e.0),
    }
}

pub(crate) fn cuda_err(op: &'static str) -> impl Fn(DriverError) -> CommError {
    move |e| CommError::Transport {
        op,
        message: e.to_string(),
    }
}

fn to_gpu(e: CommError) -> GpuError {
    GpuError::Nccl {
        op: "communicator".into(),
        message: e.to_string(),
    }
}

/// `n` fresh NCCL unique ids, concatenated: what rank 0 sends through the rendezvous.
pub fn new_ids(n: usize) -> Result<Vec<u8>, GpuError> {
    probe::probe_driver()?;
    probe::probe_nccl()?;
    probe::guard("ncclGetUniqueId", || {
        let mut blob = Vec::with_capacity(n * ID_BYTES);
        for _ in 0..n {
            let id = Id::new().map_err(|e| to_gpu(nccl_err("ncclGetUniqueId")(e)))?;
            blob.extend(id.internal().iter().map(|&c| c as u8));
        }
        Ok(blob)
    })
}

/// One rank's handle on one NCCL communicator.
pub struct NcclComm {
    comm: ManuallyDrop<nccl::Comm>,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    /// Sends staged on the device, not yet issued.
    pending: RefCell<Vec<(CudaSlice<f32>, usize)>>,
    /// Sends issued whose staging buffers must live until the stream passes them.
    in_flight: RefCell<Vec<CudaSlice<f32>>>,
}

impl NcclComm {
    /// Joins the communicator of `id` as `rank` of `size` (blocks until every member joins).
    /// Call on the thread that will use the handle.
    pub fn new(
        stream: Arc<CudaStream>,
        rank: usize,
        size: usize,
        id: &[u8; ID_BYTES],
    ) -> Result<Self, GpuError> {
        probe::probe_nccl()?;
        let id = Id::uninit(id.map(|b| b as core::ffi::c_char));
        let comm = probe::guard("ncclCommInitRank", || {
            nccl::Comm::from_rank(stream.clone(), rank, size, id)
                .map_err(|e| to_gpu(nccl_err("ncclCommInitRank")(e)))
        })?;
        Ok(NcclComm {
            comm: ManuallyDrop::new(comm),
            stream,
            rank,
            size,
            pending: RefCell::new(Vec::new()),
            in_flight: RefCell::new(Vec::new()),
        })
    }

    /// The communicator itself, for callers that order its stream themselves
    /// (`crate::backend::cuda::NcclDevice`).
    pub(crate) fn raw(&self) -> &nccl::Comm {
        &self.comm
    }

    /// Issues the staged sends (inside the caller's NCCL group when there is one).
    fn issue_pending(&self) -> Result<(), CommError> {
        let pending = std::mem::take(&mut *self.pending.borrow_mut());
        for (buf, peer) in pending {
            self.comm
                .send(&buf, peer as i32)
                .map_err(nccl_err("ncclSend"))?;
            self.in_flight.borrow_mut().push(buf);
        }
        Ok(())
    }

    /// Issues staged sends in a group of their own, before a collective.
    fn flush(&self) -> Result<(), CommError> {
        if self.pending.borrow().is_empty() {
            return Ok(());
        }
        nccl::group_start().map_err(nccl_err("ncclGroupStart"))?;
        let issued = self.issue_pending();
        nccl::group_end().map_err(nccl_err("ncclGroupEnd"))?;
        issued
    }

    /// Waits for the stream, then copies `buf` back.
    fn finish(&self, buf: &CudaSlice<f32>, out: &mut [f32]) -> Result<(), CommError> {
        let host = self
            .stream
            .clone_dtoh(buf)
            .map_err(cuda_err("copy from the device"))?;
        self.stream.synchronize().map_err(cuda_err("synchronize"))?;
        self.in_flight.borrow_mut().clear();
        out.copy_from_slice(&host[..out.len()]);
        Ok(())
    }

    fn stage(&self, data: &[f32]) -> Result<CudaSlice<f32>, CommError> {
        self.stream
            .clone_htod(data)
            .map_err(cuda_err("copy to the device"))
    }

    /// Every rank's `input`, concatenated in rank order, on the host.
    fn gather_host(&self, input: &[f32]) -> Result<Vec<f32>, CommError> {
        self.flush()?;
        let src = self.stage(input)?;
        let mut dst = self
            .stream
            .alloc_zeros::<f32>(input.len() * self.size)
            .map_err(cuda_err("allocate"))?;
        self.comm
            .all_gather(&src, &mut dst)
            .map_err(nccl_err("ncclAllGather"))?;
        let mut out = vec![0.0; input.len() * self.size];
        self.finish(&dst, &mut out)?;
        Ok(out)
    }

    /// In place on the device: `buf = Σ_ranks buf` with NCCL's own reduction order (fast path;
    /// not the rank-order sum of the `Comm` contract).
    pub fn all_reduce_sum_device<T: NcclType>(
        &self,
        buf: &mut CudaSlice<T>,
    ) -> Result<(), CommError> {
        self.flush()?;
        self.comm
            .all_reduce_in_place(buf, &ReduceOp::Sum)
            .map_err(nccl_err("ncclAllReduce"))?;
        Ok(())
    }

    /// `output = concat(input of every rank)` on the device.
    pub fn all_gather_device<T: NcclType>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
    ) -> Result<(), CommError> {
        self.flush()?;
        self.comm
            .all_gather(input, output)
            .map_err(nccl_err("ncclAllGather"))?;
        Ok(())
    }

    /// This rank's chunk of `Σ_ranks input` on the device (NCCL's reduction order).
    pub fn reduce_scatter_sum_device<T: NcclType>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
    ) -> Result<(), CommError> {
        self.flush()?;
        self.comm
            .reduce_scatter(input, output, &ReduceOp::Sum)
            .map_err(nccl_err("ncclReduceScatter"))?;
        Ok(())
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: `comm` is taken exactly once, here.
        let comm = unsafe { ManuallyDrop::take(&mut self.comm) };
        if catch_unwind(AssertUnwindSafe(move || drop(comm))).is_err() {
            eprintln!(
                "warning: NCCL communicator teardown (ncclCommAbort) failed for rank {}",
                self.rank
            );
        }
    }
}

impl Comm for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        if self.size == 1 {
            return Ok(());
        }
        let all = self.gather_host(buf)?;
        let n = buf.len();
        buf.copy_from_slice(&all[..n]);
        for part in all[n..].chunks_exact(n.max(1)) {
            buf.iter_mut().zip(part).for_each(|(b, p)| *b += p);
        }
        Ok(())
    }

    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        if output.len() != input.len() * self.size {
            return Err(CommError::SizeMismatch {
                op: "all_gather",
                expected: input.len() * self.size,
                got: output.len(),
            });
        }
        output.copy_from_slice(&self.gather_host(input)?);
        Ok(())
    }

    fn reduce_scatter_sum(&self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        let l = output.len();
        if input.len() != l * self.size {
            return Err(CommError::SizeMismatch {
                op: "reduce_scatter",
                expected: l * self.size,
                got: input.len(),
            });
        }
        let all = self.gather_host(input)?;
        let per_rank = input.len();
        output.copy_from_slice(&all[self.rank * l..(self.rank + 1) * l]);
        for r in 1..self.size {
            let part = &all[r * per_rank + self.rank * l..r * per_rank + (self.rank + 1) * l];
            output.iter_mut().zip(part).for_each(|(o, p)| *o += p);
        }
        Ok(())
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        if root >= self.size {
            return Err(CommError::BadRank {
                op: "broadcast",
                rank: root,
                size: self.size,
            });
        }
        self.flush()?;
        let mut dev = self.stage(buf)?;
        self.comm
            .broadcast_in_place(&mut dev, root as i32)
            .map_err(nccl_err("ncclBroadcast"))?;
        self.finish(&dev, buf)
    }

    fn send(&self, buf: &[f32], peer: usize) -> Result<(), CommError> {
        if peer >= self.size || peer == self.rank {
            return Err(CommError::BadRank {
                op: "send",
                rank: peer,
                size: self.size,
            });
        }
        let staged = self.stage(buf)?;
        self.pending.borrow_mut().push((staged, peer));
        Ok(())
    }

    fn recv(&self, buf: &mut [f32], peer: usize) -> Result<(), CommError> {
        if peer >= self.size || peer == self.rank {
            return Err(CommError::BadRank {
                op: "recv",
                rank: peer,
                size: self.size,
            });
        }
        let mut dev = self
            .stream
            .alloc_zeros::<f32>(buf.len())
            .map_err(cuda_err("allocate"))?;
        nccl::group_start().map_err(nccl_err("ncclGroupStart"))?;
        let issued = self.issue_pending().and_then(|_| {
            self.comm
                .recv(&mut dev, peer as i32)
                .map(|_| ())
                .map_err(nccl_err("ncclRecv"))
        });
        nccl::group_end().map_err(nccl_err("ncclGroupEnd"))?;
        issued?;
        self.finish(&dev, buf)
    }

    fn barrier(&self) -> Result<(), CommError> {
        let mut one = [0.0f32];
        self.all_reduce_sum(&mut one)
    }

    /// NCCL point-to-point sends are not buffered, so the default (every send, then every
    /// receive) could wait forever. Expert parallelism exchanges on the device's buffers
    /// instead (`NcclDevice`'s grouped all-to-all), never through this host view.
    fn all_to_all_v(
        &self,
        _input: &[f32],
        _send_counts: &[usize],
        _output: &mut [f32],
        _recv_counts: &[usize],
    ) -> Result<(), CommError> {
        Err(CommError::Transport {
            op: "all_to_all_v",
            message:
                "NCCL host groups have no all-to-all; expert parallelism exchanges through the device collective"
                    .into(),
        })
    }
}

/// A rank's TP, DP and PP communicators, created in that order on the calling thread from the
/// blob of ids rank 0 made with [`new_ids`]`(group_ids::id_count(mesh))`.
pub fn nccl_groups(
    mesh: &Mesh,
    rank: usize,
    stream: Arc<CudaStream>,
    blob: &[u8],
) -> Result<RankGroups<NcclComm>, GpuError> {
    let slots = group_ids::slots(mesh, rank as u64);
    let member = |group: Vec<u64>| {
        group
            .iter()
            .position(|&r| r == rank as u64)
            .expect("rank in its group")
    };
    let r = rank as u64;
    let make = |slot: usize, group: Vec<u64>| -> Result<NcclComm, GpuError> {
        let id = group_ids::id_at(blob, slot).map_err(to_gpu)?;
        let size = group.len();
        NcclComm::new(stream.clone(), member(group), size, &id)
    };
    let tp = make(slots.tp, mesh.tp_group(r))?;
    let dp = make(slots.dp, mesh.dp_cp_group(r))?;
    let pp = make(slots.pp, mesh.pp_group(r))?;
    // No CP communicator: these host groups serve the comm tests (`runtime/tests/cuda_local.rs`);
    // the executor's CP group, like its others, is `device_collective` over the local groups.
    Ok(RankGroups {
        tp,
        dp,
        pp,
        cp: None,
    })
}
