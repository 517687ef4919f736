//! What PyTorch's caching allocator reserves beyond the live tensors, for frameworks whose logs
//! report `torch.cuda.max_memory_reserved()` (torchtitan's "memory: X GiB").
//!
//! The rules, from pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp (and c10/core/
//! AllocatorConfig.h): requests of at most 1 MiB (`kSmallSize`) come from 2 MiB blocks
//! (`kSmallBuffer`); requests between 1 and 10 MiB (`kMinLargeAlloc`) get a 20 MiB segment
//! (`kLargeBuffer`); larger ones are rounded up to a multiple of 2 MiB (`kRoundLarge`). Freed
//! blocks stay cached (reserved) and are split to serve later, smaller requests; they go back
//! to the driver only when a `cudaMalloc` fails or on `empty_cache()`. `max_split_size`
//! (PYTORCH_CUDA_ALLOC_CONF) is unlimited by default, so every cached block may be split.
//!
//! At a step's peak the allocator therefore holds the live tensors and, beside them, the cached
//! blocks that the step's transient buffers left behind and that the peak could not reuse: a
//! large transient block, once split by smaller tensors allocated into it, can no longer serve
//! the next request of its own size, which gets a fresh segment. The model charges one such
//! segment: the largest transient block of the stage, rounded as the allocator rounds it.

/// `kRoundLarge`: large allocations are rounded up to a multiple of 2 MiB.
pub const ROUND_LARGE: f64 = 2.0 * 1024.0 * 1024.0;
/// `kSmallSize`: the largest request served from the small pool.
pub const SMALL_SIZE: f64 = 1024.0 * 1024.0;
/// `kSmallBuffer`: the small pool's blocks.
pub const SMALL_BUFFER: f64 = 2.0 * 1024.0 * 1024.0;
/// `kMinLargeAlloc`: requests between 1 MiB and this get a `kLargeBuffer` segment.
pub const MIN_LARGE_ALLOC: f64 = 10.0 * 1024.0 * 1024.0;
/// `kLargeBuffer`: the segment of a 1–10 MiB request.
pub const LARGE_BUFFER: f64 = 20.0 * 1024.0 * 1024.0;

/// The segment the caching allocator reserves for a request of `bytes`.
pub fn segment_bytes(bytes: f64) -> f64 {
    if bytes <= 0.0 {
        0.0
    } else if bytes <= SMALL_SIZE {
        SMALL_BUFFER
    } else if bytes < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        (bytes / ROUND_LARGE).ceil() * ROUND_LARGE
    }
}

/// The bytes reserved beyond the live tensors at the peak: one segment of the largest of the
/// stage's `transient` blocks (buffers allocated and freed within the step).
pub fn reserved_bytes(transient: &[f64]) -> f64 {
    segment_bytes(transient.iter().copied().fold(0.0, f64::max))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The allocator's rounding, by hand: 512 KiB → a 2 MiB small block; 5 MiB → a 20 MiB
    /// segment; 4,202,708,992 B (Llama-3 8B's root module, 1,050,677,248 params, as an fp32
    /// reduce-scatter buffer × 4 B; / 2,097,152 = 2004.008) → 2005 × 2 MiB = 4,204,789,760.
    #[test]
    fn segments_round_as_the_caching_allocator_does() {
        assert_eq!(segment_bytes(512.0 * 1024.0), 2_097_152.0);
        assert_eq!(segment_bytes(5.0 * 1024.0 * 1024.0), 20_971_520.0);
        assert_eq!(segment_bytes(4_202_708_992.0), 4_204_789_760.0);
        assert_eq!(
            reserved_bytes(&[1.0e6, 4_202_708_992.0, 3.0e9]),
            4_204_789_760.0
        );
        assert_eq!(reserved_bytes(&[]), 0.0);
    }
}
