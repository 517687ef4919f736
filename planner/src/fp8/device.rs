//! The FP8 side of a device: the recipe's casts and the FP8 GEMM model at the device's FP8
//! peak, which the cost model's device carries.

use super::recipe::{CastBytes, Fp8Engine, Recipe};
use crate::cost::gemm::Gemm;
use crate::spec::Cluster;

/// The FP8 side of a device for one job: the FP8 GEMMs and the casts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Device {
    pub recipe: Recipe,
    pub cast: CastBytes,
    /// The tile and wave model at `peak_tflops_fp8 ×` the FP8 GEMM efficiency.
    pub gemm: Gemm,
    /// Weight casts per micro-batch: 1, or 1/micro-batches where the copies are cached.
    pub weight_casts: f64,
}

/// The FP8 GEMM efficiency of a calibration: `gemm_efficiency_fp8`, else the 16-bit
/// `gemm_efficiency`, else the old curve's value at large sizes.
fn fp8_efficiency(cluster: &Cluster) -> f64 {
    let c = &cluster.calibration;
    c.gemm_efficiency_fp8
        .or(c.gemm_efficiency)
        .unwrap_or_else(|| c.matmul_efficiency_at(f64::MAX))
}

impl Fp8Device {
    /// The FP8 side of `cluster`'s device for `recipe` run on `engine`, with `microbatches` per
    /// step; `None` for 16-bit training or a device with no FP8 peak.
    pub fn of(
        recipe: Recipe,
        engine: Fp8Engine,
        cluster: &Cluster,
        microbatches: u64,
    ) -> Option<Fp8Device> {
        let cast = recipe.cast_bytes(engine)?;
        let peak = cluster.device.peak_tflops_fp8? * 1e12;
        let d = &cluster.device;
        Some(Fp8Device {
            recipe,
            cast,
            gemm: Gemm {
                peak,
                efficiency: fp8_efficiency(cluster),
                sms: d.sms as f64,
                bandwidth: d.memory_bandwidth_gbps * 1e9 * cluster.calibration.memory_efficiency,
                launch: d.kernel_launch_us * 1e-6,
            },
            weight_casts: if cast.weight_per_step {
                1.0 / microbatches.max(1) as f64
            } else {
                1.0
            },
        })
    }

    /// Seconds of the three FP8 GEMMs of `x (m × k) · w (k × n)`: (forward, backward).
    pub fn gemms(&self, m: f64, k: f64, n: f64) -> (f64, f64) {
        let g = &self.gemm;
        (
            g.time_fp8(m, k, n),
            g.time_fp8(m, n, k) + g.time_fp8(k, m, n),
        )
    }

    /// Seconds of the casts and scale reductions around those GEMMs (and the backward outputs'
    /// rescales where the recipe has them), memory-bound at the
    /// device's achievable bandwidth plus a launch per kernel: (forward, backward).
    pub fn casts(&self, m: f64, k: f64, n: f64) -> (f64, f64) {
        let c = &self.cast;
        let (bw, launch) = (self.gemm.bandwidth, self.gemm.launch);
        // A weight cast once per step is charged to each micro-batch in its share.
        let wc = self.weight_casts;
        let [ki, kw, kg, kwb] = c.kernels;
        let fwd_bytes = c.input * m * k + c.weight_fwd * k * n * wc;
        let bwd_bytes =
            c.grad_output * m * n + c.weight_bwd * k * n * wc + c.rescale * (m * k + k * n);
        (
            fwd_bytes / bw + (ki + kw * wc) * launch,
            bwd_bytes / bw + (kg + kwb * wc + c.rescale_kernels) * launch,
        )
    }

    /// Forward and backward of an FP8 linear: its GEMMs and its casts.
    pub fn linear(&self, m: f64, k: f64, n: f64) -> (f64, f64) {
        let (gf, gb) = self.gemms(m, k, n);
        let (cf, cb) = self.casts(m, k, n);
        (gf + cf, gb + cb)
    }
}
