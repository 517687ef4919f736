//! Communication that slows compute: an NCCL collective overlapped with compute runs its
//! kernels on SMs the compute then lacks (one CTA per channel, each CTA on an SM). While a
//! collective of `o` seconds overlaps compute of `c` seconds, the compute runs at
//! `1 − f` of its rate with `f = CTAs / SMs`: it takes `c + min(o·f, c·f/(1−f))` (the first
//! when the collective ends first, the second when the compute does).
//!
//! Charged to all overlapped compute: GEMMs lose the SMs; the element-wise kernels, which are
//! memory-bound, lose memory bandwidth to NCCL's copies, which we do not model apart.

use crate::spec::Cluster;

/// CTAs per NCCL collective when the cluster's `[calibration]` gives no `nccl_ctas`: NCCL's
/// channel ceiling `MAXCHANNELS` = 32 (NVIDIA/nccl src/include/device.h, 2.x before 2.22), one
/// CTA per channel (`NCCL_MIN_CTAS`/`NCCL_MAX_CTAS`, "the number of CTAs (channels)", NCCL's
/// environment documentation), which NVSwitch systems (DGX A100/H100) reach for large
/// messages. An upper bound on smaller topologies.
pub const DEFAULT_NCCL_CTAS: f64 = 32.0;

/// The share of the SMs an overlapped collective takes (0 where the device gives no SM count).
pub fn sm_share(cluster: &Cluster) -> f64 {
    let sms = cluster.device.sms as f64;
    if sms <= 0.0 {
        return 0.0;
    }
    let ctas = cluster.calibration.nccl_ctas.unwrap_or(DEFAULT_NCCL_CTAS);
    (ctas / sms).clamp(0.0, 0.9)
}

/// Seconds that `overlap` seconds of collective add to `compute` seconds of compute they
/// overlap, at SM share `f` (module docs).
pub fn slowdown(compute: f64, overlap: f64, f: f64) -> f64 {
    if f <= 0.0 || compute <= 0.0 || overlap <= 0.0 {
        return 0.0;
    }
    (overlap * f).min(compute * f / (1.0 - f))
}
