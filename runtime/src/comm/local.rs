//! `LocalComm`: a process group whose ranks are threads of this process.
//!
//! Every ordered pair of ranks has its own unbounded channel, so `send` never blocks and
//! messages between two ranks arrive in the order they were sent. Collectives are built from
//! those messages; the all-reduce is a reduce-scatter (rank r sums chunk r over ranks in order
//! 0..n) followed by an all-gather, so every element is the rank-order sum and every rank ends
//! with the same bits.
//!
//! Message buffers are pooled per sender: a buffer comes back into use once every receiver has
//! dropped it, so a training step sends its gradients without fresh allocations (each fresh
//! buffer of hundreds of MiB costs its page faults again).
//!
//! A rank whose thread panics drops its handle, which disconnects its channels: peers waiting on
//! it get [`CommError::PeerGone`] instead of hanging. A timeout (default 300 s) catches ranks
//! that issue collectives in different orders.
//!
//! This module must not decide groups: callers (the mesh) say which world ranks form a group.

use std::cell::RefCell;
use std::fmt;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

use super::{Comm, CommError};

/// Which operation a message belongs to; checked on receipt to catch ranks out of step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    ReduceScatter,
    AllGather,
    Broadcast,
    P2p,
    Barrier,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

struct Msg {
    op: Op,
    data: Arc<[f32]>,
}

/// One thread's handle on a group of threads. Built by [`LocalComm::group`] or
/// [`LocalComm::from_groups`]; move each handle into its rank's thread.
pub struct LocalComm {
    rank: usize,
    size: usize,
    /// `to[p]`: sender to rank p (None for p == rank).
    to: Vec<Option<Sender<Msg>>>,
    /// `from[p]`: receiver of messages from rank p (None for p == rank).
    from: Vec<Option<Receiver<Msg>>>,
    timeout: Option<Duration>,
    /// Buffers this rank has sent; one whose receivers all dropped it is reused.
    pool: RefCell<Vec<Arc<[f32]>>>,
}

/// Buffers kept for reuse per rank; beyond this the oldest free one is dropped.
const POOL_CAP: usize = 16;

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Chunk r of a buffer of `len` split into `n` near-equal parts (the first `len % n` one longer).
fn chunk(len: usize, n: usize, r: usize) -> std::ops::Range<usize> {
    let (base, rem) = (len / n, len % n);
    let start = r * base + r.min(rem);
    start..start + base + usize::from(r < rem)
}

impl LocalComm {
    /// One handle per rank of a new group of `n` threads; handle `r` has `rank() == r`.
    pub fn group(n: usize) -> Vec<LocalComm> {
        assert!(n > 0, "a group needs at least one rank");
        let mut to: Vec<Vec<Option<Sender<Msg>>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        let mut from: Vec<Vec<Option<Receiver<Msg>>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for (src, row) in to.iter_mut().enumerate() {
            for (dst, slot) in row.iter_mut().enumerate() {
                if src != dst {
                    let (tx, rx) = channel();
                    *slot = Some(tx);
                    from[dst][src] = Some(rx);
                }
            }
        }
        to.into_iter()
            .zip(from)
            .enumerate()
            .map(|(rank, (to, from))| LocalComm {
                rank,
                size: n,
                to,
                from,
                timeout: Some(DEFAULT_TIMEOUT),
                pool: RefCell::new(Vec::new()),
            })
            .collect()
    }

    /// Handles for a partition of `world` ranks into groups: `groups[g]` lists the world ranks
    /// of group g in group-rank order. Returns one handle per world rank, indexed by world rank.
    /// Every world rank must appear in exactly one group.
    pub fn from_groups(world: usize, groups: &[Vec<usize>]) -> Result<Vec<LocalComm>, CommError> {
        let mut slots: Vec<Option<LocalComm>> = (0..world).map(|_| None).collect();
        for members in groups {
            for (&w, handle) in members.iter().zip(LocalComm::group(members.len().max(1))) {
                let slot = slots.get_mut(w).ok_or(CommError::BadRank {
                    op: "from_groups",
                    rank: w,
                    size: world,
                })?;
                if slot.is_some() {
                    return Err(CommError::BadRank {
                        op: "from_groups (rank listed twice)",
                        rank: w,
                        size: world,
                    });
                }
                *slot = Some(handle);
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

    /// Runs `f` on `n` scoped threads, one per rank of a fresh group, and returns the results
    /// in rank order. A panic in any rank is re-raised here after all threads ended (the other
    /// ranks see [`CommError::PeerGone`] rather than hanging).
    pub fn run<T: Send>(n: usize, f: impl Fn(LocalComm) -> T + Sync) -> Vec<T> {
        let f = &f;
        std::thread::scope(|s| {
            let handles: Vec<_> = LocalComm::group(n)
                .into_iter()
                .map(|c| s.spawn(move || f(c)))
                .collect();
            let results: Vec<std::thread::Result<T>> =
                handles.into_iter().map(|h| h.join()).collect();
            results
                .into_iter()
                .map(|r| r.unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        })
    }

    /// How long a receive waits before [`CommError::Timeout`]; `None` waits until the peer
    /// sends or disconnects.
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
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

    /// A message buffer of `len` elements filled by `fill`, reusing a pooled buffer that no
    /// receiver holds any more. The pool keeps a handle, so the buffer returns when received.
    fn message(&self, len: usize, fill: impl FnOnce(&mut [f32])) -> Arc<[f32]> {
        let _tag = crate::alloc::tagged(crate::alloc::Tag::Comm);
        let reused = {
            let mut pool = self.pool.borrow_mut();
            let free = pool
                .iter_mut()
                .position(|b| b.len() == len && Arc::get_mut(b).is_some());
            free.map(|i| pool.swap_remove(i))
        };
        let mut buf = reused.unwrap_or_else(|| Arc::from(vec![0.0f32; len]));
        // `fill` may itself send (an all-reduce reduces into its message), so no borrow is held.
        fill(Arc::get_mut(&mut buf).expect("a fresh or free buffer has one owner"));
        let mut pool = self.pool.borrow_mut();
        if pool.len() >= POOL_CAP {
            match pool.iter_mut().position(|b| Arc::get_mut(b).is_some()) {
                Some(i) => {
                    pool.remove(i);
                }
                None => return buf,
            }
        }
        pool.push(buf.clone());
        buf
    }

    /// A message holding a copy of `data`.
    fn copy_of(&self, data: &[f32]) -> Arc<[f32]> {
        self.message(data.len(), |b| b.copy_from_slice(data))
    }

    fn post(&self, op: Op, peer: usize, data: Arc<[f32]>) -> Result<(), CommError> {
        // The channel's own blocks are the communicator's too.
        let _tag = crate::alloc::tagged(crate::alloc::Tag::Comm);
        let tx = self.to[peer].as_ref().expect("no channel to self");
        tx.send(Msg { op, data }).map_err(|_| CommError::PeerGone {
            op: op_name(op),
            peer,
        })
    }

    /// Next message from `peer`, checked to be of `op` with `len` elements.
    fn take(&self, op: Op, peer: usize, len: usize) -> Result<Arc<[f32]>, CommError> {
        let rx = self.from[peer].as_ref().expect("no channel from self");
        let name = op_name(op);
        let msg = match self.timeout {
            Some(t) => rx.recv_timeout(t).map_err(|e| match e {
                RecvTimeoutError::Timeout => CommError::Timeout {
                    op: name,
                    peer,
                    secs: t.as_secs(),
                },
                RecvTimeoutError::Disconnected => CommError::PeerGone { op: name, peer },
            })?,
            None => rx
                .recv()
                .map_err(|_| CommError::PeerGone { op: name, peer })?,
        };
        if msg.op != op || msg.data.len() != len {
            return Err(CommError::OutOfStep {
                op: name,
                peer,
                expected: format!("{op} of {len} elements"),
                got: format!("{} of {} elements", msg.op, msg.data.len()),
            });
        }
        Ok(msg.data)
    }

    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.size).filter(move |&p| p != self.rank)
    }

    /// Sends chunk p of `input` (split by `chunk_of`) to each rank p, then writes into `output`
    /// the rank-order sum of the chunks addressed to this rank.
    fn reduce_scatter_chunks(
        &self,
        input: &[f32],
        output: &mut [f32],
        chunk_of: impl Fn(usize) -> std::ops::Range<usize>,
    ) -> Result<(), CommError> {
        for p in self.peers() {
            self.post(Op::ReduceScatter, p, self.copy_of(&input[chunk_of(p)]))?;
        }
        let mine = chunk_of(self.rank);
        let mut parts: Vec<Option<Arc<[f32]>>> = vec![None; self.size];
        for p in self.peers() {
            parts[p] = Some(self.take(Op::ReduceScatter, p, mine.len())?);
        }
        let own = &input[mine];
        for (r, part) in parts.iter().enumerate() {
            let src: &[f32] = part.as_deref().unwrap_or(own);
            if r == 0 {
                output.copy_from_slice(src);
            } else {
                output.iter_mut().zip(src).for_each(|(o, s)| *o += s);
            }
        }
        Ok(())
    }
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

impl Comm for LocalComm {
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
        let mut result = Ok(());
        let reduced = self.message(mine.len(), |out| {
            result = self.reduce_scatter_chunks(buf, out, |p| chunk(len, n, p));
        });
        result?;
        for p in self.peers() {
            self.post(Op::AllGather, p, reduced.clone())?;
        }
        buf[mine].copy_from_slice(&reduced);
        for p in self.peers() {
            let range = chunk(len, n, p);
            let part = self.take(Op::AllGather, p, range.len())?;
            buf[range].copy_from_slice(&part);
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
        let shared = self.copy_of(input);
        for p in self.peers() {
            self.post(Op::AllGather, p, shared.clone())?;
        }
        output[self.rank * l..(self.rank + 1) * l].copy_from_slice(input);
        for p in self.peers() {
            let part = self.take(Op::AllGather, p, l)?;
            output[p * l..(p + 1) * l].copy_from_slice(&part);
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
            let shared = self.copy_of(buf);
            for p in self.peers() {
                self.post(Op::Broadcast, p, shared.clone())?;
            }
        } else {
            buf.copy_from_slice(&self.take(Op::Broadcast, root, buf.len())?);
        }
        Ok(())
    }

    fn send(&self, buf: &[f32], peer: usize) -> Result<(), CommError> {
        self.check_peer("send", peer)?;
        self.post(Op::P2p, peer, self.copy_of(buf))
    }

    fn recv(&self, buf: &mut [f32], peer: usize) -> Result<(), CommError> {
        self.check_peer("recv", peer)?;
        buf.copy_from_slice(&self.take(Op::P2p, peer, buf.len())?);
        Ok(())
    }

    fn barrier(&self) -> Result<(), CommError> {
        let empty: Arc<[f32]> = Arc::from(Vec::new());
        for p in self.peers() {
            self.post(Op::Barrier, p, empty.clone())?;
        }
        for p in self.peers() {
            self.take(Op::Barrier, p, 0)?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "local_tests.rs"]
mod tests;
