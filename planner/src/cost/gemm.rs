//! GEMM time from mechanisms, not a lookup by the smallest dimension.
//!
//! A GEMM `C (m × n) = A (m × k) · B (k × n)` runs as a grid of output tiles, one thread block
//! each; the blocks run in waves over the device's SMs. So (NVIDIA, "Matrix Multiplication
//! Background User's Guide", §§ "Tile Quantization" and "Wave Quantization"):
//! - **tile quantisation**: a tile at the edge of `C` computes its whole `tm × tn` area;
//! - **wave quantisation**: `ceil(tiles / SMs)` waves each take one tile's time, so 109 tiles on
//!   108 SMs take two waves, as long as 216.
//!
//! Each candidate tile shape gives `waves × (one tile's FLOPs at one SM's share of the peak)`;
//! the library's heuristic is taken to pick the fastest of them. That is bounded below by the
//! memory roofline (operands read and result written once), and a fixed launch latency is added
//! per kernel. One efficiency factor per device (the fraction of peak a full wave of large
//! tiles reaches) carries everything else.
//!
//! Pure functions; the device comes in as [`Gemm`].

/// Output tile shapes (rows × columns) the model lets a GEMM choose from: large tiles of the
/// sizes tensor-core libraries use for 16-bit GEMMs (256 × 128, 128 × 256, 128 × 128). This set
/// is a modelling choice, not read from cuBLAS's heuristics. Smaller tiles reuse less data per
/// load and are not modelled: a GEMM small enough to want them is bound by memory or launch
/// latency here.
pub const TILES: [(f64, f64); 3] = [(256.0, 128.0), (128.0, 256.0), (128.0, 128.0)];

/// What a GEMM's time depends on, for one device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    /// Dense peak, FLOP/s.
    pub peak: f64,
    /// Fraction of the peak a full wave of large tiles reaches (one factor per device).
    pub efficiency: f64,
    /// Streaming multiprocessors; 0 = unknown (no quantisation is modelled).
    pub sms: f64,
    /// Achievable memory bandwidth, bytes/s (peak × memory efficiency).
    pub bandwidth: f64,
    /// Seconds per kernel launch.
    pub launch: f64,
}

/// Tiles of `tm × tn` that cover an `m × n` output.
pub fn tiles(m: f64, n: f64, tm: f64, tn: f64) -> f64 {
    (m / tm).ceil() * (n / tn).ceil()
}

/// Waves of `tiles` thread blocks over `sms` SMs (one resident tile per SM).
pub fn waves(tiles: f64, sms: f64) -> f64 {
    (tiles / sms).ceil()
}

/// The fraction of the SM-time of the waves that does useful work: tile quantisation (the
/// padded area) times wave quantisation (the idle SMs of the last wave).
pub fn quantisation_efficiency(m: f64, n: f64, tm: f64, tn: f64, sms: f64) -> f64 {
    let t = tiles(m, n, tm, tn);
    let useful = m * n / (t * tm * tn);
    useful * t / (waves(t, sms) * sms)
}

/// `x` rounded up to a multiple of 16.
fn round16(x: f64) -> f64 {
    (x / 16.0).ceil().max(1.0) * 16.0
}

impl Gemm {
    /// Seconds of the tensor-core work of `batch` independent `(m × k) · (k × n)` products in
    /// one kernel, with the fastest of [`TILES`].
    pub fn compute(&self, m: f64, k: f64, n: f64, batch: f64) -> f64 {
        let rate = self.peak * self.efficiency;
        if self.sms < 1.0 {
            return 2.0 * m * k * n * batch / rate;
        }
        let per_sm = rate / self.sms;
        TILES
            .iter()
            .map(|&(tm, tn)| {
                // A dimension smaller than the tile gets a tile cut to it (in steps of 16, the
                // tensor cores' granularity), as the small-tile kernels do.
                let (tm, tn) = (tm.min(round16(m)), tn.min(round16(n)));
                let w = waves(tiles(m, n, tm, tn) * batch, self.sms);
                w * 2.0 * tm * tn * k / per_sm
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// Seconds of one GEMM kernel: the tile model or the memory roofline (16-bit operands
    /// read once, the 16-bit result written once), whichever is slower, plus the launch.
    pub fn time(&self, m: f64, k: f64, n: f64, batch: f64) -> f64 {
        let bytes = 2.0 * (m * k + k * n + m * n) * batch;
        self.compute(m, k, n, batch).max(bytes / self.bandwidth) + self.launch
    }

    /// Seconds of one FP8 GEMM (`self` at the FP8 peak and efficiency): the same tile model, and
    /// the memory roofline of 1-byte operands and a 16-bit result (the scaled output is written
    /// in bf16: torch._scaled_mm's `out_dtype`, TE's GEMM output).
    pub fn time_fp8(&self, m: f64, k: f64, n: f64) -> f64 {
        let bytes = m * k + k * n + 2.0 * m * n;
        self.compute(m, k, n, 1.0).max(bytes / self.bandwidth) + self.launch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A100: Gemm = Gemm {
        peak: 312e12,
        efficiency: 1.0,
        sms: 108.0,
        bandwidth: 1.555e12,
        launch: 0.0,
    };

    #[test]
    fn tile_and_wave_counts() {
        // 1024 × 1024 in 256 × 128 tiles: 4 × 8 = 32 tiles, one wave on 108 SMs.
        assert_eq!(tiles(1024.0, 1024.0, 256.0, 128.0), 32.0);
        assert_eq!(waves(32.0, 108.0), 1.0);
        // One tile more than the SMs costs a whole second wave.
        assert_eq!(waves(108.0, 108.0), 1.0);
        assert_eq!(waves(109.0, 108.0), 2.0);
        // 1000 rows in 128-row tiles: 8 tiles, the last one 104 rows of 128 used.
        assert_eq!(tiles(1000.0, 128.0, 128.0, 128.0), 8.0);
        let q = quantisation_efficiency(1000.0, 128.0, 128.0, 128.0, 8.0);
        assert!((q - 1000.0 / 1024.0).abs() < 1e-12, "{q}");
    }

    #[test]
    fn wave_quantisation_makes_one_more_tile_cost_a_wave() {
        // 108 tiles of 128 × 128 fill A100's 108 SMs once: 12 × 9 tiles of output.
        let (m, n, k) = (12.0 * 128.0, 9.0 * 128.0, 4096.0);
        let full = A100.compute(m, k, n, 1.0);
        // The ideal time of exactly those FLOPs at the peak.
        let ideal = 2.0 * m * n * k / 312e12;
        assert!((full / ideal - 1.0).abs() < 1e-9, "{full} vs {ideal}");
        // One more row of output: 13 × 9 = 117 tiles of 128 × 128 need two waves, and the
        // larger tiles (7 × 9 = 63 of 256 × 128, 13 × 5 = 65 of 128 × 256) take one wave of
        // twice the work: 0.07% more FLOPs, twice the time (the guide's wave quantisation).
        let more = A100.compute(m + 1.0, k, n, 1.0);
        assert!((more / full - 2.0).abs() < 1e-9, "{more} vs {full}");
    }

    #[test]
    fn small_products_are_bound_by_memory_or_the_launch() {
        let g = Gemm {
            launch: 4e-6,
            ..A100
        };
        // A GEMV-like product (m = 1): 2·1·4096·4096 FLOPs, 32 MiB of weights to read.
        let t = g.time(1.0, 4096.0, 4096.0, 1.0);
        let bytes = 2.0 * (4096.0 + 4096.0 * 4096.0 + 4096.0);
        assert!((t - (bytes / 1.555e12 + 4e-6)).abs() < 1e-12);
    }
}
