//! A tracking global allocator: bytes allocated per rank, with the peak.
//!
//! Each allocation carries a small header with the rank of the thread that made it, so a buffer
//! freed on another thread (a message moved between ranks) is still charged to its owner. The
//! binary installs it with `#[global_allocator]`; without it, `peak_bytes` reports 0.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// Ranks tracked; higher ranks share the last slot.
pub const MAX_RANKS: usize = 256;

static CURRENT: [AtomicI64; MAX_RANKS] = [const { AtomicI64::new(0) }; MAX_RANKS];
static PEAK: [AtomicU64; MAX_RANKS] = [const { AtomicU64::new(0) }; MAX_RANKS];

thread_local! {
    static RANK: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// Charges this thread's allocations to `rank` (`usize::MAX`: untracked).
pub fn set_rank(rank: usize) {
    RANK.with(|r| r.set(rank));
    if rank != usize::MAX {
        let slot = rank.min(MAX_RANKS - 1);
        PEAK[slot].store(
            CURRENT[slot].load(Ordering::Relaxed).max(0) as u64,
            Ordering::Relaxed,
        );
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
        (base as *mut usize).write(rank);
        if rank != usize::MAX {
            let slot = rank.min(MAX_RANKS - 1);
            let now = CURRENT[slot].fetch_add(layout.size() as i64, Ordering::Relaxed)
                + layout.size() as i64;
            PEAK[slot].fetch_max(now.max(0) as u64, Ordering::Relaxed);
        }
        base.add(h)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let h = header(&layout);
        let base = ptr.sub(h);
        let rank = (base as *const usize).read();
        if rank != usize::MAX {
            CURRENT[rank.min(MAX_RANKS - 1)].fetch_sub(layout.size() as i64, Ordering::Relaxed);
        }
        System.dealloc(
            base,
            Layout::from_size_align_unchecked(layout.size() + h, layout.align()),
        );
    }
}
