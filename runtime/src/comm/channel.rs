//! `ChannelComm<C>`: a process group whose ranks are threads, with the payload carried by a
//! [`Carrier`] — host memory ([`HostCarrier`], always built, tested here) or device memory on
//! one GPU (`backend::cuda::local::DeviceCarrier`, feature `cuda`: the `cuda-local` Comm that runs
//! several ranks on ONE GPU, since NCCL refuses two ranks of a communicator on one device).
//!
//! The collectives are [`LocalComm`](super::LocalComm)'s algorithms (same chunking, rank-order
//! sums), so a run over any carrier gives the same bits as a run over `LocalComm`; the tests
//! check that for every operation. Only the transport differs.
//!
//! This module must not decide groups (callers pass the mesh's partition).

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use tessera_planner::Mesh;

use super::{Comm, CommError, RankGroups};

/// Moves one message's payload from the sending rank to the receiving rank.
pub trait Carrier {
    /// A payload in flight.
    type Msg: Send;
    /// Called on the sender's thread.
    fn pack(&self, data: &[f32]) -> Result<Self::Msg, CommError>;
    /// Called on the receiver's thread: writes the payload into `out` (same length).
    fn unpack(&self, msg: Self::Msg, out: &mut [f32]) -> Result<(), CommError>;
}

/// Payloads as host vectors: the reference carrier.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostCarrier;

impl Carrier for HostCarrier {
    type Msg = Vec<f32>;
    fn pack(&self, data: &[f32]) -> Result<Vec<f32>, CommError> {
        Ok(data.to_vec())
    }
    fn unpack(&self, msg: Vec<f32>, out: &mut [f32]) -> Result<(), CommError> {
        out.copy_from_slice(&msg);
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    ReduceScatter,
    AllGather,
    Broadcast,
    P2p,
    Barrier,
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::ReduceScatter => "reduce_scatter",
        Op::AllGather => "all_gather",
        Op::Broadcast => "broadcast",
        Op::P2p => "send/recv",
        Op::Barrier => "barrier",
    }
}

struct Msg<M> {
    op: Op,
    len: usize,
    payload: M,
}

/// `[from][to]` channel ends of a group (None on the diagonal).
type Grid<T> = Vec<Vec<Option<T>>>;

/// One thread's handle on a group of threads; payloads go through `C`.
pub struct ChannelComm<C: Carrier> {
    rank: usize,
    size: usize,
    carrier: C,
    to: Vec<Option<Sender<Msg<C::Msg>>>>,
    from: Vec<Option<Receiver<Msg<C::Msg>>>>,
    timeout: Duration,
}

/// Chunk r of `len` split into `n` near-equal parts (LocalComm's split).
fn chunk(len: usize, n: usize, r: usize) -> std::ops::Range<usize> {
    let (base, rem) = (len / n, len % n);
    let start = r * base + r.min(rem);
    start..start + base + usize::from(r < rem)
}

impl<C: Carrier> ChannelComm<C> {
    /// One handle per rank of a new group; `carriers[r]` moves rank r's payloads.
    pub fn group(carriers: Vec<C>) -> Vec<Self> {
        let n = carriers.len();
        assert!(n > 0, "a group needs at least one rank");
        let mut to: Grid<Sender<Msg<C::Msg>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        let mut from: Grid<Receiver<Msg<C::Msg>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for src in 0..n {
            for dst in 0..n {
                if src != dst {
                    let (tx, rx) = channel();
                    to[src][dst] = Some(tx);
                    from[dst][src] = Some(rx);
                }
            }
        }
        carriers
            .into_iter()
            .zip(to.into_iter().zip(from))
            .enumerate()
            .map(|(rank, (carrier, (to, from)))| ChannelComm {
                rank,
                size: n,
                carrier,
                to,
                from,
                timeout: Duration::from_secs(300),
            })
            .collect()
    }

    /// Handles for a partition of the world into groups (`groups[g]` = world ranks in group-rank
    /// order); `carrier(w)` makes world rank w's carrier. Indexed by world rank.
    pub fn from_groups(
        world: usize,
        groups: &[Vec<usize>],
        carrier: &dyn Fn(usize) -> C,
    ) -> Result<Vec<Self>, CommError> {
        let mut slots: Vec<Option<Self>> = (0..world).map(|_| None).collect();
        for members in groups {
            let handles = Self::group(members.iter().map(|&w| carrier(w)).collect());
            for (&w, h) in members.iter().zip(handles) {
                let bad = |op| CommError::BadRank {
                    op,
                    rank: w,
                    size: world,
                };
                let slot = slots.get_mut(w).ok_or(bad("from_groups"))?;
                if slot.is_some() {
                    return Err(bad("from_groups (rank listed twice)"));
                }
                *slot = Some(h);
            }
        }
        slots
            .into_iter()
            .enumerate()
            .map(|(w, s)| {
                s.ok_or(CommError::BadRank {
                    op: "from_groups (rank in no group)",
                    rank: w,
                    size: world,
                })
            })
            .collect()
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.size).filter(move |&p| p != self.rank)
    }

    fn post(&self, op: Op, peer: usize, data: &[f32]) -> Result<(), CommError> {
        let payload = self.carrier.pack(data)?;
        let tx = self.to[peer].as_ref().expect("no channel to self");
        tx.send(Msg {
            op,
            len: data.len(),
            payload,
        })
        .map_err(|_| CommError::PeerGone {
            op: op_name(op),
            peer,
        })
    }

    fn take(&self, op: Op, peer: usize, out: &mut [f32]) -> Result<(), CommError> {
        let rx = self.from[peer].as_ref().expect("no channel from self");
        let name = op_name(op);
        let msg = rx.recv_timeout(self.timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => CommError::Timeout {
                op: name,
                peer,
                secs: self.timeout.as_secs(),
            },
            RecvTimeoutError::Disconnected => CommError::PeerGone { op: name, peer },
        })?;
        if msg.op != op || msg.len != out.len() {
            return Err(CommError::OutOfStep {
                op: name,
                peer,
                expected: format!("{} of {} elements", op_name(op), out.len()),
                got: format!("{} of {} elements", op_name(msg.op), msg.len),
            });
        }
        self.carrier.unpack(msg.payload, out)
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<(), CommError> {
        if peer >= self.size || peer == self.rank {
            return Err(CommError::BadRank {
                op,
                rank: peer,
                size: self.size,
            });
        }
        Ok(())
    }

    /// Sends chunk p of `input` to each rank p; `output` = rank-order sum of this rank's chunks.
    fn reduce_scatter_chunks(
        &self,
        input: &[f32],
        output: &mut [f32],
        chunk_of: impl Fn(usize) -> std::ops::Range<usize>,
    ) -> Result<(), CommError> {
        for p in self.peers() {
            self.post(Op::ReduceScatter, p, &input[chunk_of(p)])?;
        }
        let mine = chunk_of(self.rank);
        let mut part = vec![0.0f32; mine.len()];
        for r in 0..self.size {
            let src: &[f32] = if r == self.rank {
                &input[mine.clone()]
            } else {
                self.take(Op::ReduceScatter, r, &mut part)?;
                &part
            };
            if r == 0 {
                output.copy_from_slice(src);
            } else {
                output.iter_mut().zip(src).for_each(|(o, s)| *o += s);
            }
        }
        Ok(())
    }
}

impl<C: Carrier> Comm for ChannelComm<C> {
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
        let (len, n) = (buf.len(), self.size);
        let mine = chunk(len, n, self.rank);
        let mut reduced = vec![0.0f32; mine.len()];
        self.reduce_scatter_chunks(buf, &mut reduced, |p| chunk(len, n, p))?;
        for p in self.peers() {
            self.post(Op::AllGather, p, &reduced)?;
        }
        buf[mine].copy_from_slice(&reduced);
        for p in self.peers() {
            self.take(Op::AllGather, p, &mut buf[chunk(len, n, p)])?;
        }
        Ok(())
    }

    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        let l = input.len();
        if output.len() != l * self.size {
            return Err(CommError::SizeMismatch {
                op: "all_gather",
                expected: l * self.size,
                got: output.len(),
            });
        }
        for p in self.peers() {
            self.post(Op::AllGather, p, input)?;
        }
        output[self.rank * l..(self.rank + 1) * l].copy_from_slice(input);
        for p in self.peers() {
            self.take(Op::AllGather, p, &mut output[p * l..(p + 1) * l])?;
        }
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
        if self.size == 1 {
            output.copy_from_slice(input);
            return Ok(());
        }
        self.reduce_scatter_chunks(input, output, |p| p * l..(p + 1) * l)
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        if root >= self.size {
            return Err(CommError::BadRank {
                op: "broadcast",
                rank: root,
                size: self.size,
            });
        }
        if self.rank == root {
            for p in self.peers() {
                self.post(Op::Broadcast, p, buf)?;
            }
            Ok(())
        } else {
            self.take(Op::Broadcast, root, buf)
        }
    }

    fn send(&self, buf: &[f32], peer: usize) -> Result<(), CommError> {
        self.check_peer("send", peer)?;
        self.post(Op::P2p, peer, buf)
    }

    fn recv(&self, buf: &mut [f32], peer: usize) -> Result<(), CommError> {
        self.check_peer("recv", peer)?;
        self.take(Op::P2p, peer, buf)
    }

    fn barrier(&self) -> Result<(), CommError> {
        for p in self.peers() {
            self.post(Op::Barrier, p, &[])?;
        }
        for p in self.peers() {
            self.take(Op::Barrier, p, &mut [])?;
        }
        Ok(())
    }
}

/// TP, DP (× CP), PP and CP handles for every world rank of `mesh` (as [`super::local_groups`] builds
/// them, asking the mesh which ranks form each group); `carrier(w)` makes rank w's carriers.
pub fn channel_groups<C: Carrier>(
    mesh: &Mesh,
    carrier: &dyn Fn(usize) -> C,
) -> Result<Vec<RankGroups<ChannelComm<C>>>, CommError> {
    let world = mesh.world() as usize;
    let groups = |group_of: &dyn Fn(u64) -> Vec<u64>| {
        ChannelComm::from_groups(world, &super::groups::partition(world, group_of), carrier)
    };
    let tp = groups(&|r| mesh.tp_group(r))?;
    let dp = groups(&|r| mesh.dp_cp_group(r))?;
    let pp = groups(&|r| mesh.pp_group(r))?;
    let cp: Vec<Option<ChannelComm<C>>> = match mesh.cp > 1 {
        true => groups(&|r| mesh.cp_group(r))?
            .into_iter()
            .map(Some)
            .collect(),
        false => (0..world).map(|_| None).collect(),
    };
    Ok(tp
        .into_iter()
        .zip(dp)
        .zip(pp)
        .zip(cp)
        .map(|(((tp, dp), pp), cp)| RankGroups { tp, dp, pp, cp })
        .collect())
}

#[cfg(test)]
#[path = "channel_tests.rs"]
mod tests;
