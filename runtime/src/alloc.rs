//! A tracking global allocator: bytes allocated per rank, with the peak.
//!
//! Each allocation carries a small header with the rank of the thread that made it, so a buffer
//! freed on another thread (a message moved between ranks) is still charged to its owner. The
//! binary installs it with `#[global_allocator]`; without it, `peak_bytes` reports 0.
//!
//! Each allocation is also charged to the [`Tag`] its thread was under (the executor's phase,
//! or the GEMM crate and the communicator inside it), so that `TESSERA_MEM_BREAKDOWN=1 tessera
//! run` can say what each rank's peak held, part by part, beside the planner's terms
//! (docs/performance.md, "CPU memory").

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

/// Ranks tracked; higher ranks share the last slot.
pub const MAX_RANKS: usize = 256;

static CURRENT: [AtomicI64; MAX_RANKS] = [const { AtomicI64::new(0) }; MAX_RANKS];
static PEAK: [AtomicU64; MAX_RANKS] = [const { AtomicU64::new(0) }; MAX_RANKS];

/// What a rank's allocations were made for: the executor's phase, or a library inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Tag {
    /// Anything not under a narrower tag.
    Other,
    /// The rank's setup: weights, gradients, optimizer states, workspaces.
    Setup,
    /// A forward pass: the activations kept for the backward, and its temporaries.
    Forward,
    /// A backward pass's temporaries.
    Backward,
    /// The pipeline's activation and gradient messages received.
    P2p,
    /// The DP gradient sync and the optimizer step.
    Sync,
    /// Inside the `gemm` crate: its per-thread packing slab and per-call packed panels.
    Gemm,
    /// The thread communicator's messages and pooled buffers.
    Comm,
}

const TAGS: usize = 8;
/// The header's tag of an allocation made while the breakdown was off.
const UNTAGGED: usize = usize::MAX;
const TAG_NAMES: [&str; TAGS] = [
    "other", "setup", "forward", "backward", "p2p", "sync", "gemm", "comm",
];

/// Bytes each rank holds now under each tag, and under each tag at the rank's peak (kept only
/// while [`breakdown`] is on: copying them at every new peak costs the hot path).
static BY_TAG: [[AtomicI64; TAGS]; MAX_RANKS] =
    [const { [const { AtomicI64::new(0) }; TAGS] }; MAX_RANKS];
static PEAK_BY_TAG: [[AtomicI64; TAGS]; MAX_RANKS] =
    [const { [const { AtomicI64::new(0) }; TAGS] }; MAX_RANKS];
static BREAKDOWN: AtomicBool = AtomicBool::new(false);

thread_local! {
    static RANK: Cell<usize> = const { Cell::new(usize::MAX) };
    static TAG: Cell<usize> = const { Cell::new(Tag::Other as usize) };
}

/// Keeps each rank's bytes by tag at its peak from now on (`TESSERA_MEM_BREAKDOWN=1`); only
/// what is allocated from then on is tagged, so turn it on before the ranks start.
pub fn breakdown(on: bool) {
    BREAKDOWN.store(on, Ordering::Relaxed);
}

/// Whether [`breakdown`] is on.
pub fn breakdown_on() -> bool {
    BREAKDOWN.load(Ordering::Relaxed)
}

/// Charges this thread's allocations to `tag` until the guard drops (then the previous tag).
pub fn tagged(tag: Tag) -> TagGuard {
    TagGuard(TAG.with(|t| t.replace(tag as usize)))
}

/// Restores the previous tag when dropped (see [`tagged`]).
pub struct TagGuard(usize);

impl Drop for TagGuard {
    fn drop(&mut self) {
        TAG.with(|t| t.set(self.0));
    }
}

/// `rank`'s bytes by tag at its peak (since the last reset), largest first; empty unless
/// [`breakdown`] was on.
pub fn peak_by_tag(rank: usize) -> Vec<(&'static str, u64)> {
    let slot = rank.min(MAX_RANKS - 1);
    let mut parts: Vec<_> = TAG_NAMES
        .iter()
        .zip(&PEAK_BY_TAG[slot])
        .map(|(n, b)| (*n, b.load(Ordering::Relaxed).max(0) as u64))
        .filter(|(_, b)| *b > 0)
        .collect();
    parts.sort_by_key(|p| std::cmp::Reverse(p.1));
    parts
}

fn snapshot(slot: usize) {
    for (p, c) in PEAK_BY_TAG[slot].iter().zip(&BY_TAG[slot]) {
        p.store(c.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// Charges this thread's allocations to `rank` (`usize::MAX`: untracked).
pub fn set_rank(rank: usize) {
    RANK.with(|r| r.set(rank));
    if rank != usize::MAX {
        reset_peak(rank);
    }
}

/// Starts `rank`'s peak again from what it holds now: the peak from here on leaves out the
/// setup's transients (the executor calls it before the first training step).
pub fn reset_peak(rank: usize) {
    let slot = rank.min(MAX_RANKS - 1);
    PEAK[slot].store(
        CURRENT[slot].load(Ordering::Relaxed).max(0) as u64,
        Ordering::Relaxed,
    );
    snapshot(slot);
}

/// Peak bytes allocated by `rank`'s threads since it was last set.
pub fn peak_bytes(rank: usize) -> u64 {
    PEAK[rank.min(MAX_RANKS - 1)].load(Ordering::Relaxed)
}

/// The allocator; install with `#[global_allocator] static A: TrackingAlloc = TrackingAlloc;`.
pub struct TrackingAlloc;

const HEADER: usize = 16;

fn header(layout: &Layout) -> usize {
    layout.align().max(HEADER)
}

// SAFETY: forwards to the system allocator with a larger size and the same alignment; the
// returned pointer is offset by a header that is a multiple of the alignment.
unsafe impl GlobalAlloc for TrackingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let h = header(&layout);
        let Ok(full) = Layout::from_size_align(layout.size() + h, layout.align()) else {
            return std::ptr::null_mut();
        };
        let base = System.alloc(full);
        if base.is_null() {
            return base;
        }
        let rank = RANK.try_with(|r| r.get()).unwrap_or(usize::MAX);
        // Tagged only while the breakdown is on (the header says so), so that a plain run pays
        // one relaxed load for it.
        let breakdown = BREAKDOWN.load(Ordering::Relaxed);
        let tag = match breakdown {
            true => TAG.try_with(|t| t.get()).unwrap_or(Tag::Other as usize),
            false => UNTAGGED,
        };
        // The header (at least 16 bytes) holds the owner and the tag.
        (base as *mut usize).write(rank);
        (base as *mut usize).add(1).write(tag);
        if rank != usize::MAX {
            let slot = rank.min(MAX_RANKS - 1);
            let size = layout.size() as i64;
            if tag != UNTAGGED {
                BY_TAG[slot][tag].fetch_add(size, Ordering::Relaxed);
            }
            let now = CURRENT[slot].fetch_add(size, Ordering::Relaxed) + size;
            let before = PEAK[slot].fetch_max(now.max(0) as u64, Ordering::Relaxed);
            if before < now.max(0) as u64 && breakdown {
                snapshot(slot);
            }
        }
        base.add(h)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let h = header(&layout);
        let base = ptr.sub(h);
        let rank = (base as *const usize).read();
        let tag = (base as *const usize).add(1).read();
        if rank != usize::MAX {
            let slot = rank.min(MAX_RANKS - 1);
            if tag != UNTAGGED {
                BY_TAG[slot][tag].fetch_sub(layout.size() as i64, Ordering::Relaxed);
            }
            CURRENT[slot].fetch_sub(layout.size() as i64, Ordering::Relaxed);
        }
        System.dealloc(
            base,
            Layout::from_size_align_unchecked(layout.size() + h, layout.align()),
        );
    }
}
