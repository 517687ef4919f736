//! [`NcclDevice`]: the collectives of the device backend on NCCL, on the device buffers the
//! executor holds (no host copies), each group on a stream of its own.
//!
//! Ordering is explicit, with events, not cudarc's per-allocation tracking: the executor's
//! gradients are one allocation, and tracking would make every later kernel that writes any
//! gradient wait for a bucket's all-reduce. So the communicator works on raw spans of the
//! buffers ([`Span`]), and every operation
//! 1. records an event on the compute stream and makes the group's stream wait for it (the
//!    data the collective reads is written),
//! 2. enqueues NCCL on the group's stream,
//! 3. records an event there, which the compute stream waits for at once, or, for
//!    [`Collective::all_reduce_sum_start`], at [`Collective::wait_started`] (DP gradient
//!    buckets overlap the rest of the backward).
//!
//! Point-to-point: a `send` copies its payload into a staging buffer on the compute stream and
//! is issued with the next operation of the group, in one NCCL group with it when that is a
//! `recv`, so two stages that both send, then receive, do not deadlock on the GPU (1F1B's
//! steady state). Every step ends with an operation on the PP group (the gradient norm's sum),
//! so no send waits past its step.
//!
//! Sums are NCCL's own (ring or tree order), identical on every rank of a group but not in rank
//! order: a run on NCCL agrees with the CPU within bf16 tolerance, not bit for bit.
//!
//! NCCL refuses two ranks of one communicator on one GPU, so [`device_collective`] uses NCCL
//! only where every rank has a GPU of its own, and [`HostStaged`] otherwise.
//!
//! NOT YET RUN ON A GPU (docs/cuda.md): compiled and linted only.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use cudarc::nccl::{self, ReduceOp};
use half::bf16;

use super::{cuda_err, nccl_err, new_ids, NcclComm};
use crate::backend::cuda::{CudaBuf, CudaLauncher, DMut, DRef, Device, GpuError, HostStaged};
use crate::backend::Collective;
use crate::comm::group_ids::ID_BYTES;
use crate::comm::{Comm, CommError, LocalComm};

type NcclResult = Result<nccl::result::NcclStatus, nccl::result::NcclError>;

/// Events only order streams here: no timing.
const NO_TIMING: Option<cudarc::driver::sys::CUevent_flags> =
    Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);

/// `len` elements at a raw device address, for NCCL calls whose ordering this module makes
/// itself (so the pointer calls record and wait for nothing).
struct Span<'s, T> {
    ptr: CUdeviceptr,
    len: usize,
    stream: &'s Arc<CudaStream>,
    _t: PhantomData<T>,
}

impl<T> DeviceSlice<T> for Span<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtr<T> for Span<'_, T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for Span<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// The typed span of a view: f32 or bf16 (NCCL has no use for the u32 id buffers).
enum Typed<'s> {
    F32(Span<'s, f32>),
    Bf16(Span<'s, bf16>),
}

/// One group (TP, DP, PP or the tied embedding's) of one rank, on NCCL.
pub struct NcclDevice {
    comm: NcclComm,
    /// The launcher's stream: every kernel and copy of this rank.
    compute: Arc<CudaStream>,
    /// This group's stream.
    stream: Arc<CudaStream>,
    /// Ends of the sums started and not yet waited for.
    started: RefCell<Vec<CudaEvent>>,
    /// Sends staged on the compute stream, issued with the group's next operation.
    pending: RefCell<Vec<(CudaBuf, usize)>>,
    /// Staging buffers of issued sends: dropped once the compute stream is ordered after them.
    in_flight: RefCell<Vec<CudaBuf>>,
}

impl NcclDevice {
    /// Joins the group of `local` (the same ranks, threads of this process) on NCCL: its rank 0
    /// makes the NCCL id and broadcasts it over `local`; `ncclCommInitRank` blocks until every
    /// member has joined, so all ranks create their groups in the same order.
    pub fn new(dev: &Device<CudaLauncher>, local: &LocalComm) -> Result<Self, GpuError> {
        let launcher = dev.launcher();
        let mut id = [0f32; ID_BYTES];
        if Comm::rank(local) == 0 {
            let blob = new_ids(1)?;
            for (slot, b) in id.iter_mut().zip(&blob) {
                *slot = f32::from(*b);
            }
        }
        local.broadcast(&mut id, 0).map_err(|e| GpuError::Nccl {
            op: "sharing the NCCL id".into(),
            message: e.to_string(),
        })?;
        let id: [u8; ID_BYTES] = id.map(|x| x as u8);
        let stream = launcher.side_stream()?;
        let comm = NcclComm::new(stream.clone(), Comm::rank(local), Comm::size(local), &id)?;
        Ok(NcclDevice {
            comm,
            compute: launcher.stream().clone(),
            stream,
            started: RefCell::new(Vec::new()),
            pending: RefCell::new(Vec::new()),
            in_flight: RefCell::new(Vec::new()),
        })
    }

    /// The raw span of `len` elements of `buf` from `at`. The base address is taken on the
    /// compute stream, whose own tracking it satisfies; the group's stream is ordered by
    /// [`NcclDevice::run`]'s events.
    fn span<'s>(&'s self, buf: &CudaBuf, at: usize, len: usize) -> Result<Typed<'s>, CommError> {
        fn of<'s, T>(
            s: &CudaSlice<T>,
            at: usize,
            len: usize,
            compute: &CudaStream,
            stream: &'s Arc<CudaStream>,
        ) -> Result<Span<'s, T>, CommError> {
            if at + len > s.len() {
                return Err(CommError::SizeMismatch {
                    op: "nccl view",
                    expected: at + len,
                    got: s.len(),
                });
            }
            let (base, _guard) = s.device_ptr(compute);
            Ok(Span {
                ptr: base + (at * std::mem::size_of::<T>()) as CUdeviceptr,
                len,
                stream,
                _t: PhantomData,
            })
        }
        match buf {
            CudaBuf::F32(s) => Ok(Typed::F32(of(s, at, len, &self.compute, &self.stream)?)),
            CudaBuf::Bf16(s) => Ok(Typed::Bf16(of(s, at, len, &self.compute, &self.stream)?)),
            CudaBuf::U32(_) => Err(CommError::Transport {
                op: "nccl view",
                message: "a u32 buffer in a collective".into(),
            }),
        }
    }

    /// Orders the group's stream after the compute stream, enqueues `f` there (after any
    /// staged sends, in one NCCL group with `f` when `grouped`), and returns the event that
    /// marks its end.
    fn run(
        &self,
        grouped: bool,
        f: impl FnOnce(&nccl::Comm) -> Result<(), CommError>,
    ) -> Result<CudaEvent, CommError> {
        let ready = self
            .compute
            .record_event(NO_TIMING)
            .map_err(cuda_err("record an event"))?;
        self.stream
            .wait(&ready)
            .map_err(cuda_err("wait for an event"))?;
        let comm = self.comm.raw();
        let pending = std::mem::take(&mut *self.pending.borrow_mut());
        if !pending.is_empty() && !grouped {
            nccl::group_start().map_err(nccl_err("ncclGroupStart"))?;
            let sent = self.issue(comm, pending);
            nccl::group_end().map_err(nccl_err("ncclGroupEnd"))?;
            sent?;
            f(comm)?;
        } else if grouped {
            nccl::group_start().map_err(nccl_err("ncclGroupStart"))?;
            let done = self.issue(comm, pending).and_then(|_| f(comm));
            nccl::group_end().map_err(nccl_err("ncclGroupEnd"))?;
            done?;
        } else {
            f(comm)?;
        }
        self.stream
            .record_event(NO_TIMING)
            .map_err(cuda_err("record an event"))
    }

    /// Issues staged sends (inside the caller's NCCL group).
    fn issue(&self, comm: &nccl::Comm, pending: Vec<(CudaBuf, usize)>) -> Result<(), CommError> {
        for (buf, peer) in pending {
            let len = match &buf {
                CudaBuf::F32(s) => s.len(),
                CudaBuf::Bf16(s) => s.len(),
                CudaBuf::U32(s) => s.len(),
            };
            match self.span(&buf, 0, len)? {
                Typed::F32(s) => comm.send(&s, peer as i32),
                Typed::Bf16(s) => comm.send(&s, peer as i32),
            }
            .map_err(nccl_err("ncclSend"))?;
            self.in_flight.borrow_mut().push(buf);
        }
        Ok(())
    }

    /// Orders the compute stream after `done`.
    fn after(&self, done: &CudaEvent) -> Result<(), CommError> {
        self.compute
            .wait(done)
            .map_err(cuda_err("wait for an event"))
    }

    /// Runs `f` and orders the compute stream after it (a blocking collective, as the executor
    /// sees it); staging buffers of sends issued before are released.
    fn blocking(
        &self,
        grouped: bool,
        f: impl FnOnce(&nccl::Comm) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let done = self.run(grouped, f)?;
        self.after(&done)?;
        // Their frees are enqueued on the compute stream, now behind the sends.
        self.in_flight.borrow_mut().clear();
        Ok(())
    }

    /// A blocking collective from `input` to `output` of one element type, after checking
    /// `sizes` (expected, got); `f32s` and `bf16s` are the NCCL call for each type.
    fn in_out(
        &self,
        (op, nccl_op): (&'static str, &'static str),
        (input, output): (DRef<'_, CudaBuf>, DMut<'_, CudaBuf>),
        (expected, got): (usize, usize),
        f32s: impl FnOnce(&nccl::Comm, &Span<f32>, &mut Span<f32>) -> NcclResult,
        bf16s: impl FnOnce(&nccl::Comm, &Span<bf16>, &mut Span<bf16>) -> NcclResult,
    ) -> Result<(), CommError> {
        if expected != got {
            return Err(CommError::SizeMismatch { op, expected, got });
        }
        let src = self.span(input.buf, input.at, input.len)?;
        let mut dst = self.span(output.buf, output.at, output.len)?;
        self.blocking(false, |c| {
            match (&src, &mut dst) {
                (Typed::F32(s), Typed::F32(d)) => f32s(c, s, d),
                (Typed::Bf16(s), Typed::Bf16(d)) => bf16s(c, s, d),
                _ => {
                    return Err(CommError::Transport {
                        op,
                        message: "input and output of different element types".into(),
                    })
                }
            }
            .map(|_| ())
            .map_err(nccl_err(nccl_op))
        })
    }

    fn all_reduce(&self, buf: &DMut<'_, CudaBuf>, op: ReduceOp) -> Result<CudaEvent, CommError> {
        let mut span = self.span(buf.buf, buf.at, buf.len)?;
        self.run(false, |c| {
            match &mut span {
                Typed::F32(s) => c.all_reduce_in_place(s, &op),
                Typed::Bf16(s) => c.all_reduce_in_place(s, &op),
            }
            .map(|_| ())
            .map_err(nccl_err("ncclAllReduce"))
        })
    }
}

impl Collective<Device<CudaLauncher>> for NcclDevice {
    fn rank(&self) -> usize {
        Comm::rank(&self.comm)
    }

    fn size(&self) -> usize {
        Comm::size(&self.comm)
    }

    fn all_reduce_sum(&self, buf: DMut<'_, CudaBuf>) -> Result<(), CommError> {
        let done = self.all_reduce(&buf, ReduceOp::Sum)?;
        self.after(&done)
    }

    fn all_reduce_sum_start(&self, buf: DMut<'_, CudaBuf>) -> Result<(), CommError> {
        let done = self.all_reduce(&buf, ReduceOp::Sum)?;
        self.started.borrow_mut().push(done);
        Ok(())
    }

    fn wait_started(&self) -> Result<(), CommError> {
        for done in self.started.borrow_mut().drain(..) {
            self.after(&done)?;
        }
        Ok(())
    }

    fn all_reduce_max(&self, buf: DMut<'_, CudaBuf>) -> Result<(), CommError> {
        let done = self.all_reduce(&buf, ReduceOp::Max)?;
        self.after(&done)
    }

    fn all_gather(
        &self,
        input: DRef<'_, CudaBuf>,
        output: DMut<'_, CudaBuf>,
    ) -> Result<(), CommError> {
        let n = self.size();
        let sizes = (input.len * n, output.len);
        self.in_out(
            ("all_gather", "ncclAllGather"),
            (input, output),
            sizes,
            |c, s, d| c.all_gather(s, d),
            |c, s, d| c.all_gather(s, d),
        )
    }

    fn reduce_scatter_sum(
        &self,
        input: DRef<'_, CudaBuf>,
        output: DMut<'_, CudaBuf>,
    ) -> Result<(), CommError> {
        let n = self.size();
        let sizes = (output.len * n, input.len);
        self.in_out(
            ("reduce_scatter", "ncclReduceScatter"),
            (input, output),
            sizes,
            |c, s, d| c.reduce_scatter(s, d, &ReduceOp::Sum),
            |c, s, d| c.reduce_scatter(s, d, &ReduceOp::Sum),
        )
    }

    fn send(&self, buf: DRef<'_, CudaBuf>, peer: usize) -> Result<(), CommError> {
        if peer >= self.size() || peer == self.rank() {
            return Err(CommError::BadRank {
                op: "send",
                rank: peer,
                size: self.size(),
            });
        }
        let r = buf.at..buf.at + buf.len;
        let c = &self.compute;
        let staged = match buf.buf {
            CudaBuf::F32(s) => {
                let mut d = c
                    .alloc_zeros::<f32>(buf.len)
                    .map_err(cuda_err("allocate"))?;
                c.memcpy_dtod(&s.slice(r), &mut d)
                    .map_err(cuda_err("stage a send"))?;
                CudaBuf::F32(d)
            }
            CudaBuf::Bf16(s) => {
                let mut d = c
                    .alloc_zeros::<bf16>(buf.len)
                    .map_err(cuda_err("allocate"))?;
                c.memcpy_dtod(&s.slice(r), &mut d)
                    .map_err(cuda_err("stage a send"))?;
                CudaBuf::Bf16(d)
            }
            CudaBuf::U32(_) => {
                return Err(CommError::Transport {
                    op: "send",
                    message: "a u32 buffer sent".into(),
                })
            }
        };
        self.pending.borrow_mut().push((staged, peer));
        Ok(())
    }

    fn recv(&self, buf: DMut<'_, CudaBuf>, peer: usize) -> Result<(), CommError> {
        if peer >= self.size() || peer == self.rank() {
            return Err(CommError::BadRank {
                op: "recv",
                rank: peer,
                size: self.size(),
            });
        }
        let mut dst = self.span(buf.buf, buf.at, buf.len)?;
        self.blocking(true, |c| {
            match &mut dst {
                Typed::F32(d) => c.recv(d, peer as i32),
                Typed::Bf16(d) => c.recv(d, peer as i32),
            }
            .map(|_| ())
            .map_err(nccl_err("ncclRecv"))
        })
    }

    /// Expert parallelism's token exchange: one NCCL group of a send and a receive per peer
    /// (itself included, which NCCL copies), each part a span of the caller's buffers.
    fn all_to_all_v(
        &self,
        input: DRef<'_, CudaBuf>,
        send_counts: &[usize],
        output: DMut<'_, CudaBuf>,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let op = "all_to_all_v";
        let n = self.size();
        for (counts, len) in [(send_counts, input.len), (recv_counts, output.len)] {
            let total: usize = counts.iter().sum();
            if counts.len() != n || total != len {
                return Err(CommError::SizeMismatch {
                    op,
                    expected: len,
                    got: total,
                });
            }
        }
        let parts = |buf: &CudaBuf, at: usize, counts: &[usize]| {
            let mut from = at;
            counts
                .iter()
                .map(|&len| {
                    let s = self.span(buf, from, len);
                    from += len;
                    s
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let sends = parts(input.buf, input.at, send_counts)?;
        let mut recvs = parts(output.buf, output.at, recv_counts)?;
        self.blocking(true, |c| {
            for (peer, (s, d)) in sends.iter().zip(recvs.iter_mut()).enumerate() {
                let p = peer as i32;
                if send_counts[peer] > 0 {
                    match s {
                        Typed::F32(s) => c.send(s, p),
                        Typed::Bf16(s) => c.send(s, p),
                    }
                    .map_err(nccl_err("ncclSend"))?;
                }
                if recv_counts[peer] > 0 {
                    match d {
                        Typed::F32(d) => c.recv(d, p),
                        Typed::Bf16(d) => c.recv(d, p),
                    }
                    .map(|_| ())
                    .map_err(nccl_err("ncclRecv"))?;
                }
            }
            Ok(())
        })
    }

    /// Exact and identical on every rank: the values travel bit-split through an all-gather
    /// and are added in rank order in f64 on the host (as `crate::comm::all_reduce_f64`).
    fn all_reduce_f64(&self, x: f64) -> Result<f64, CommError> {
        let n = self.size();
        let bits = x.to_bits();
        let mine = [
            f32::from_bits((bits >> 32) as u32),
            f32::from_bits(bits as u32),
        ];
        let c = &self.compute;
        let src = CudaBuf::F32(
            c.clone_htod(&mine)
                .map_err(cuda_err("copy to the device"))?,
        );
        let dst = CudaBuf::F32(c.alloc_zeros::<f32>(2 * n).map_err(cuda_err("allocate"))?);
        let (s, mut d) = (self.span(&src, 0, 2)?, self.span(&dst, 0, 2 * n)?);
        // `src` and `dst` live until after the wait below.
        self.blocking(false, |comm| {
            match (&s, &mut d) {
                (Typed::F32(s), Typed::F32(d)) => comm.all_gather(s, d),
                _ => unreachable!("f32 spans"),
            }
            .map(|_| ())
            .map_err(nccl_err("ncclAllGather"))
        })?;
        let CudaBuf::F32(dst) = &dst else {
            unreachable!("made as f32")
        };
        let host = c
            .clone_dtoh(dst)
            .map_err(cuda_err("copy from the device"))?;
        c.synchronize().map_err(cuda_err("synchronize"))?;
        drop(src);
        Ok(host
            .chunks_exact(2)
            .map(|p| f64::from_bits((u64::from(p[0].to_bits()) << 32) | u64::from(p[1].to_bits())))
            .sum())
    }
}

/// One group's collective for a rank on a GPU: NCCL, or the host-staged one.
pub enum DeviceCollective {
    Nccl(NcclDevice),
    Staged(HostStaged<CudaLauncher, LocalComm>),
}

/// The collective of `local`'s group for a rank on `dev`: NCCL when `nccl` (every rank of the
/// run has a GPU of its own) and the group has more than one rank, else through host memory.
pub fn device_collective(
    dev: &Device<CudaLauncher>,
    local: LocalComm,
    nccl: bool,
) -> Result<DeviceCollective, GpuError> {
    Ok(match nccl && Comm::size(&local) > 1 {
        true => DeviceCollective::Nccl(NcclDevice::new(dev, &local)?),
        false => DeviceCollective::Staged(HostStaged::new(dev.clone(), local)),
    })
}

macro_rules! each {
    ($self:ident, $c:ident => $e:expr) => {
        match $self {
            DeviceCollective::Nccl($c) => $e,
            DeviceCollective::Staged($c) => $e,
        }
    };
}

impl Collective<Device<CudaLauncher>> for DeviceCollective {
    fn rank(&self) -> usize {
        each!(self, c => c.rank())
    }
    fn size(&self) -> usize {
        each!(self, c => c.size())
    }
    fn all_reduce_sum(&self, buf: DMut<'_, CudaBuf>) -> Result<(), CommError> {
        each!(self, c => c.all_reduce_sum(buf))
    }
    fn all_reduce_sum_start(&self, buf: DMut<'_, CudaBuf>) -> Result<(), CommError> {
        each!(self, c => c.all_reduce_sum_start(buf))
    }
    fn wait_started(&self) -> Result<(), CommError> {
        each!(self, c => c.wait_started())
    }
    fn all_reduce_max(&self, buf: DMut<'_, CudaBuf>) -> Result<(), CommError> {
        each!(self, c => c.all_reduce_max(buf))
    }
    fn all_gather(
        &self,
        input: DRef<'_, CudaBuf>,
        output: DMut<'_, CudaBuf>,
    ) -> Result<(), CommError> {
        each!(self, c => c.all_gather(input, output))
    }
    fn reduce_scatter_sum(
        &self,
        input: DRef<'_, CudaBuf>,
        output: DMut<'_, CudaBuf>,
    ) -> Result<(), CommError> {
        each!(self, c => c.reduce_scatter_sum(input, output))
    }
    fn send(&self, buf: DRef<'_, CudaBuf>, peer: usize) -> Result<(), CommError> {
        each!(self, c => c.send(buf, peer))
    }
    fn recv(&self, buf: DMut<'_, CudaBuf>, peer: usize) -> Result<(), CommError> {
        each!(self, c => c.recv(buf, peer))
    }
    fn all_reduce_f64(&self, x: f64) -> Result<f64, CommError> {
        each!(self, c => c.all_reduce_f64(x))
    }
    fn all_to_all_v(
        &self,
        input: DRef<'_, CudaBuf>,
        send_counts: &[usize],
        output: DMut<'_, CudaBuf>,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        each!(self, c => c.all_to_all_v(input, send_counts, output, recv_counts))
    }
}
