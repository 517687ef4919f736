//! Launch geometry of every kernel in `backend/cuda/kernels/`: grids, blocks and shared memory, as
//! pure functions of the sizes, so they are unit-tested without a GPU.
//!
//! The constants mirror the `#define`s of the .cu files (a test reads them back from the
//! source). Every block is a whole number of warps: the kernels shuffle across full warps.

use super::GpuError;
use crate::backend::AttnShape;

/// A size as the kernels' `long long` argument (usize ≤ i64::MAX on every supported target).
pub(super) fn n64(x: usize) -> i64 {
    x as i64
}

pub(super) fn i32_of(x: usize, what: &str) -> Result<i32, GpuError> {
    i32::try_from(x).map_err(|_| GpuError::Unsupported {
        what: format!("{what} = {x} does not fit the kernels' 32-bit argument"),
        fix: "split the work into smaller pieces".into(),
    })
}

/// Threads per block of the element-wise and per-channel kernels.
pub const THREADS: u32 = 256;
/// Grid-stride kernels never launch more blocks than this (each thread loops).
pub const MAX_STRIDE_BLOCKS: u64 = 65_535;
/// Shared memory a block may use without opting in (`cuFuncSetAttribute`).
pub const DEFAULT_SHARED_LIMIT: u32 = 48 * 1024;

/// Mirrors of attention.cu's `ATT_WARPS`, `ATT_ROWS`, `ATT_BC`, `ATT_MAXD`.
pub const ATT_WARPS: u32 = 4;
pub const ATT_ROWS: u32 = 4;
pub const ATT_BR: u32 = ATT_WARPS * ATT_ROWS;
pub const ATT_BC: u32 = 32;
pub const ATT_MAXD: usize = 4;

/// One kernel launch: grid and block sizes and dynamic shared memory in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

impl Geometry {
    /// Threads in one block.
    pub fn threads(&self) -> u32 {
        self.block.0 * self.block.1 * self.block.2
    }
    /// Whether the kernel needs the shared-memory opt-in attribute before this launch.
    pub fn needs_shared_opt_in(&self) -> bool {
        self.shared_bytes > DEFAULT_SHARED_LIMIT
    }
}

fn too_big(what: String) -> GpuError {
    GpuError::Unsupported {
        what,
        fix: "use a smaller micro-batch or sequence, or more tensor parallelism".into(),
    }
}

fn grid_dim(x: u64, what: &str, limit: u64) -> Result<u32, GpuError> {
    if x > limit {
        return Err(too_big(format!(
            "{what}: {x} blocks exceed the grid limit {limit}"
        )));
    }
    Ok(x as u32)
}

/// A grid-stride loop over `n` elements: `None` when there is nothing to do.
pub fn elementwise(n: u64) -> Option<Geometry> {
    if n == 0 {
        return None;
    }
    let blocks = n.div_ceil(u64::from(THREADS)).min(MAX_STRIDE_BLOCKS);
    Some(Geometry {
        grid: (blocks as u32, 1, 1),
        block: (THREADS, 1, 1),
        shared_bytes: 0,
    })
}

/// One block per row (norms, cross-entropy): threads = the row width rounded up to a warp,
/// at most `max_threads` (a power of two multiple of 32).
pub fn per_row(rows: u64, width: usize, max_threads: u32) -> Result<Option<Geometry>, GpuError> {
    if rows == 0 {
        return Ok(None);
    }
    let threads = (width.div_ceil(32) * 32).clamp(32, max_threads as usize) as u32;
    Ok(Some(Geometry {
        grid: (grid_dim(rows, "rows", i32::MAX as u64)?, 1, 1),
        block: (threads, 1, 1),
        shared_bytes: 0,
    }))
}

/// How parameter-gradient reductions split the rows: `chunks` partial sums of `rows_per_chunk`
/// rows each (the last may be shorter, none empty), reduced in order afterwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunks {
    pub chunks: u32,
    pub rows_per_chunk: u64,
}

/// Rows per chunk aim at `TARGET` so that a few hundred blocks run even for a narrow C.
pub fn row_chunks(rows: u64) -> Chunks {
    const TARGET: u64 = 64;
    const MAX_CHUNKS: u64 = 1024;
    let chunks = rows.div_ceil(TARGET).clamp(1, MAX_CHUNKS);
    let rows_per_chunk = rows.div_ceil(chunks).max(1);
    // Recount so no chunk is empty.
    let chunks = rows.div_ceil(rows_per_chunk).max(1);
    Chunks {
        chunks: chunks as u32,
        rows_per_chunk,
    }
}

/// Per-channel kernels over row chunks: grid (⌈C / THREADS⌉, chunks).
pub fn per_channel(c: usize, chunks: Chunks) -> Result<Geometry, GpuError> {
    Ok(Geometry {
        grid: (
            grid_dim(
                c.div_ceil(THREADS as usize) as u64,
                "channels",
                i32::MAX as u64,
            )?,
            grid_dim(u64::from(chunks.chunks), "row chunks", 65_535)?,
            1,
        ),
        block: (THREADS, 1, 1),
        shared_bytes: 0,
    })
}

/// One thread per item, no stride loop (`embedding_backward`, `pos_embedding_backward`).
pub fn per_item(n: u64) -> Result<Option<Geometry>, GpuError> {
    if n == 0 {
        return Ok(None);
    }
    Ok(Some(Geometry {
        grid: (
            grid_dim(n.div_ceil(u64::from(THREADS)), "items", i32::MAX as u64)?,
            1,
            1,
        ),
        block: (THREADS, 1, 1),
        shared_bytes: 0,
    }))
}

/// Mirror of ring_attention.cu's `RING_MAXD`: its kernels take head sizes up to 32 × this.
pub const RING_MAXD: usize = 4;

/// One warp per item, `ATT_WARPS` warps per block (ring attention's row kernels): `None` when
/// there is nothing to do.
pub fn per_warp(warps: u64) -> Result<Option<Geometry>, GpuError> {
    if warps == 0 {
        return Ok(None);
    }
    Ok(Some(Geometry {
        grid: (
            grid_dim(
                warps.div_ceil(u64::from(ATT_WARPS)),
                "rows",
                i32::MAX as u64,
            )?,
            1,
            1,
        ),
        block: (ATT_WARPS * 32, 1, 1),
        shared_bytes: 0,
    }))
}

/// The three attention launches of one shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionLaunch {
    pub forward: Geometry,
    /// The tensor-core forward (`attention_forward_tc`) and dq (`attention_backward_dq_tc`),
    /// when the head size is a multiple of 16 (same tiles, same geometry).
    pub forward_tc: Option<Geometry>,
    /// The tensor-core dk/dv (`attention_backward_dkv_tc`), for head sizes that are a multiple
    /// of 16: one block per 64 keys, kv head and 64-dim half of the head (two above 64).
    pub backward_dkv_tc: Option<Geometry>,
    pub delta: Geometry,
    pub backward_dq: Geometry,
    pub backward_dkv: Geometry,
}

/// Checks the shape against what attention.cu supports and sizes its launches.
pub fn attention(s: &AttnShape, max_shared: u32) -> Result<AttentionLaunch, GpuError> {
    if s.hkv == 0 || !s.hq.is_multiple_of(s.hkv) {
        return Err(GpuError::shape(
            "attention",
            format!("kv heads {} must divide query heads {}", s.hkv, s.hq),
        ));
    }
    if s.hd == 0 || s.hd > 32 * ATT_MAXD {
        return Err(GpuError::Unsupported {
            what: format!(
                "attention head size {} is outside what the flash kernel supports (1..={})",
                s.hd,
                32 * ATT_MAXD
            ),
            fix: "use a head size of at most 128".into(),
        });
    }
    if s.b == 0 || s.t == 0 {
        return Err(GpuError::shape("attention", "empty batch or sequence"));
    }
    let ld = (s.hd + 1) as u64;
    let floats = |rows: u32, extra: u64| u64::from(rows) * ld + extra;
    let bytes = |f: u64| -> Result<u32, GpuError> {
        let b = f * 4;
        if b > u64::from(max_shared) {
            return Err(too_big(format!(
                "attention with head size {} needs {b} bytes of shared memory per block, the device allows {max_shared}",
                s.hd
            )));
        }
        Ok(b as u32)
    };
    let row_tiles = grid_dim(
        (s.t as u64).div_ceil(u64::from(ATT_BR)),
        "query tiles",
        i32::MAX as u64,
    )?;
    let hq = grid_dim(s.hq as u64, "heads", 65_535)?;
    let hkv = grid_dim(s.hkv as u64, "kv heads", 65_535)?;
    let b = grid_dim(s.b as u64, "batch", 65_535)?;
    let block = (ATT_WARPS * 32, 1, 1);
    let warps_rows = (s.b * s.hq * s.t) as u64;
    // Tensor-core tiles: 64 query rows (4 warps × 16) and two 64-key bf16 tiles of stride hd + 8.
    let forward_tc = if s.hd.is_multiple_of(16) {
        let tc_bytes = 2 * 64 * (s.hd as u64 + 8) * 2;
        Some(Geometry {
            grid: (
                grid_dim((s.t as u64).div_ceil(64), "query tiles", i32::MAX as u64)?,
                hq,
                b,
            ),
            block: (128, 1, 1),
            shared_bytes: bytes(tc_bytes.div_ceil(4))?,
        })
    } else {
        None
    };
    // Q and dO tiles of 64 queries (bf16, stride hd + 8) plus 64 lse and 64 delta values.
    let backward_dkv_tc = if s.hd.is_multiple_of(16) {
        let tc_bytes = 2 * 64 * (s.hd as u64 + 8) * 2 + 2 * 64 * 4;
        let halves = (s.hd as u64).div_ceil(64);
        Some(Geometry {
            grid: (
                grid_dim((s.t as u64).div_ceil(64), "key tiles", i32::MAX as u64)?,
                grid_dim(s.hkv as u64 * halves, "kv heads × halves", 65_535)?,
                b,
            ),
            block: (128, 1, 1),
            shared_bytes: bytes(tc_bytes.div_ceil(4))?,
        })
    } else {
        None
    };
    Ok(AttentionLaunch {
        forward_tc,
        backward_dkv_tc,
        forward: Geometry {
            grid: (row_tiles, hq, b),
            block,
            shared_bytes: bytes(floats(ATT_BR + 2 * ATT_BC, 0))?,
        },
        delta: Geometry {
            grid: (
                grid_dim(
                    warps_rows.div_ceil(u64::from(ATT_WARPS)),
                    "delta rows",
                    i32::MAX as u64,
                )?,
                1,
                1,
            ),
            block,
            shared_bytes: 0,
        },
        backward_dq: Geometry {
            grid: (row_tiles, hq, b),
            block,
            shared_bytes: bytes(floats(2 * ATT_BR + 2 * ATT_BC, 0))?,
        },
        backward_dkv: Geometry {
            grid: (row_tiles, hkv, b),
            block,
            shared_bytes: bytes(floats(2 * ATT_BR + 2 * ATT_BC, 2 * u64::from(ATT_BC)))?,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elementwise_covers_every_element_with_whole_warps() {
        assert_eq!(elementwise(0), None);
        for n in [1u64, 31, 256, 257, 1 << 20, 1 << 34] {
            let g = elementwise(n).unwrap();
            assert_eq!(g.threads() % 32, 0);
            let blocks = u64::from(g.grid.0);
            // Enough blocks for one pass, or the cap (the kernels' stride loops do the rest);
            // never a block without work in the first pass.
            assert!(blocks * u64::from(g.threads()) >= n || blocks == MAX_STRIDE_BLOCKS);
            assert!((blocks - 1) * u64::from(g.threads()) < n);
        }
    }

    #[test]
    fn per_row_threads_follow_the_width() {
        let g = per_row(10, 5, 1024).unwrap().unwrap();
        assert_eq!((g.grid.0, g.block.0), (10, 32));
        assert_eq!(per_row(3, 768, 256).unwrap().unwrap().block.0, 256);
        assert_eq!(per_row(3, 100, 1024).unwrap().unwrap().block.0, 128);
        assert_eq!(per_row(0, 100, 1024).unwrap(), None);
        assert!(per_row(1 << 32, 8, 256).is_err());
    }

    #[test]
    fn row_chunks_cover_all_rows_without_empty_chunks() {
        for rows in [1u64, 2, 63, 64, 65, 1000, 8192, 1 << 20, 1 << 30] {
            let c = row_chunks(rows);
            let k = u64::from(c.chunks);
            assert!(k * c.rows_per_chunk >= rows, "{rows}: {c:?}");
            assert!(
                (k - 1) * c.rows_per_chunk < rows,
                "{rows}: empty chunk in {c:?}"
            );
            assert!(k <= 1024);
        }
        assert_eq!(
            row_chunks(8192),
            Chunks {
                chunks: 128,
                rows_per_chunk: 64
            }
        );
    }

    #[test]
    fn attention_shared_memory_and_grids() {
        let s = AttnShape {
            b: 2,
            t: 1024,
            hq: 12,
            hkv: 12,
            hd: 64,
        };
        let a = attention(&s, 227 * 1024).unwrap();
        assert_eq!(a.forward.grid, (64, 12, 2));
        assert_eq!(a.forward.block, (128, 1, 1));
        // (16 q rows + 32 k rows + 32 v rows) × 65 floats × 4 bytes.
        assert_eq!(a.forward.shared_bytes, 80 * 65 * 4);
        assert!(!a.forward.needs_shared_opt_in());
        assert_eq!(a.backward_dkv.grid, (64, 12, 2));
        assert_eq!(a.backward_dkv.shared_bytes, (96 * 65 + 64) * 4);
        assert_eq!(a.delta.grid.0, (2 * 12 * 1024) / 4);
        // Head size 128 needs the opt-in for the backward, and fits an H100's 227 KiB.
        let big = AttnShape {
            hd: 128,
            hkv: 4,
            ..s
        };
        let a = attention(&big, 227 * 1024).unwrap();
        assert!(!a.forward.needs_shared_opt_in());
        assert!(a.backward_dq.needs_shared_opt_in() && a.backward_dkv.needs_shared_opt_in());
        assert_eq!(a.backward_dkv.grid.1, 4);
        assert!(attention(&big, 48 * 1024).is_err());
    }

    #[test]
    fn attention_refuses_what_the_kernel_cannot_do() {
        let s = AttnShape {
            b: 1,
            t: 8,
            hq: 6,
            hkv: 4,
            hd: 64,
        };
        assert!(matches!(
            attention(&s, 1 << 20),
            Err(GpuError::Shape { .. })
        ));
        let s = AttnShape {
            hkv: 2,
            hd: 129,
            ..s
        };
        assert!(matches!(
            attention(&s, 1 << 20),
            Err(GpuError::Unsupported { .. })
        ));
        let s = AttnShape { hd: 0, ..s };
        assert!(attention(&s, 1 << 20).is_err());
    }
}
