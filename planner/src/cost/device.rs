//! The device as the cost model sees it: peaks, calibration, the GEMM model and the FP8 side.
//! Its own module so that the per-op costs (`ops`) and the adapters' (`adapters`), which
//! `ops` adds to each layer, both read it from below.

use super::gemm::Gemm;
use crate::model::Model;
use crate::spec::{Calibration, Cluster};

/// The device's peaks and calibration, in SI units.
#[derive(Debug, Clone, Copy)]
pub struct Device<'a> {
    /// FLOP/s.
    pub peak: f64,
    /// Bytes/s.
    pub bandwidth: f64,
    pub cal: &'a Calibration,
    /// The tile and wave GEMM model, when the calibration has a `gemm_efficiency`; else the
    /// `matmul_efficiency` curve times GEMMs.
    pub gemm: Option<Gemm>,
    /// Seconds per kernel launch, charged to every kernel when `gemm` is in use.
    pub launch: f64,
    /// Element-wise evaluations with one exponential per second (`transcendental_gops`), where
    /// they bound those kernels (the CPU backend); `None` on GPUs.
    pub exp_rate: Option<f64>,
    /// A GPU's tensor cores, whose GEMMs slow down on unaligned dimensions
    /// ([`super::loss::gemm_slowdown`]); false on the CPU backend.
    pub tensor_cores: bool,
    /// The FP8 GEMMs and casts of the block's linears, where the job states a recipe and the
    /// device an FP8 peak ([`Device::for_job`]); `None`: 16-bit.
    pub fp8: Option<crate::fp8::device::Fp8Device>,
    /// Fraction of `peak` the job's flash-class attention kernel reaches: the cluster's
    /// `flash_attention_efficiency`, or its `cudnn_attention_efficiency` where the job's
    /// framework runs cuDNN's fused attention ([`Device::for_job`]).
    pub attention_efficiency: f64,
}

impl<'a> Device<'a> {
    pub fn of(cluster: &'a Cluster) -> Device<'a> {
        let (peak, bandwidth) = (
            cluster.device.peak_tflops * 1e12,
            cluster.device.memory_bandwidth_gbps * 1e9,
        );
        let cal = &cluster.calibration;
        let launch = cluster.device.kernel_launch_us * 1e-6;
        let gemm = cal.gemm_efficiency.map(|efficiency| Gemm {
            peak,
            efficiency,
            sms: cluster.device.sms as f64,
            bandwidth: bandwidth * cal.memory_efficiency,
            launch,
        });
        Device {
            peak,
            bandwidth,
            cal,
            launch: if gemm.is_some() { launch } else { 0.0 },
            gemm,
            exp_rate: cluster.device.transcendental_gops.map(|g| g * 1e9),
            tensor_cores: cluster.device.kind == crate::spec::DeviceKind::Gpu,
            fp8: None,
            attention_efficiency: cal.flash_attention_efficiency,
        }
    }

    /// [`Device::of`] with the job's FP8 recipe on the block's linears, as `layout` runs them
    /// (its micro-batches per step, over which cached FP8 weights are cast once, and its ZeRO
    /// stage, under which none are cached: [`crate::framework::fp8_engine_on`]).
    pub fn for_job(
        cluster: &'a Cluster,
        model: &Model,
        layout: &crate::layout::Layout,
        kernel: crate::framework::AttentionKernel,
    ) -> Device<'a> {
        let cal = &cluster.calibration;
        let attention_efficiency = match (kernel, cal.cudnn_attention_efficiency) {
            (crate::framework::AttentionKernel::Cudnn, Some(e)) => e,
            _ => cal.flash_attention_efficiency,
        };
        Device {
            fp8: crate::fp8::device::Fp8Device::of(
                model.training.fp8,
                crate::framework::fp8_engine_on(model, layout),
                cluster,
                layout.microbatches(model),
            ),
            attention_efficiency,
            ..Device::of(cluster)
        }
    }

    /// Forward and backward of one of the block's linears: FP8 GEMMs and their casts under an
    /// FP8 recipe (a trained weight only), else [`Device::linear_of`].
    pub fn block_linear(&self, l: &LinearShape) -> (f64, f64) {
        match &self.fp8 {
            Some(f) if !l.frozen => f.linear(l.m, l.k, l.n),
            _ => self.linear_of(l.frozen, l.m, l.k, l.n),
        }
    }

    /// The GEMMs alone of [`Device::block_linear`] (an FP8 linear's without its casts):
    /// (forward, backward).
    pub fn block_gemms(&self, l: &LinearShape) -> (f64, f64) {
        match &self.fp8 {
            Some(f) if !l.frozen => f.gemms(l.m, l.k, l.n),
            _ => self.linear_of(l.frozen, l.m, l.k, l.n),
        }
    }

    /// Seconds of `n` kernel launches (0 under the legacy curve).
    pub fn launches(&self, n: f64) -> f64 {
        n * self.launch
    }

    /// Seconds to move `bytes` through memory.
    pub fn memory(&self, bytes: f64) -> f64 {
        bytes / (self.bandwidth * self.cal.memory_efficiency)
    }

    /// Seconds of an element-wise kernel that moves `bytes` and evaluates one exponential for
    /// each of `exps` elements: the longer of the two (the exponentials count only where the
    /// device has a `transcendental_gops`).
    pub fn elementwise(&self, bytes: f64, exps: f64) -> f64 {
        let exp = self.exp_rate.map_or(0.0, |r| exps / r);
        self.memory(bytes).max(exp)
    }

    /// Seconds for `batch` multiplies of an (m × k) by a (k × n) 16-bit matrix.
    pub fn matmul(&self, m: f64, k: f64, n: f64, batch: f64) -> f64 {
        if let Some(g) = &self.gemm {
            return g.time(m, k, n, batch);
        }
        let flops = 2.0 * m * k * n * batch;
        let eff = self.cal.matmul_efficiency_at(m.min(k).min(n));
        let bytes = 2.0 * (m * k + k * n + m * n) * batch;
        (flops / (self.peak * eff)).max(self.memory(bytes))
    }

    /// Forward and backward (input gradient + weight gradient) of `x (m × k) · w (k × n)`.
    pub fn linear(&self, m: f64, k: f64, n: f64) -> (f64, f64) {
        let fwd = self.matmul(m, k, n, 1.0);
        let bwd = self.matmul(m, n, k, 1.0) + self.matmul(k, m, n, 1.0);
        (fwd, bwd)
    }

    /// [`Device::linear`] of a frozen weight (`frozen`): no weight-gradient GEMM.
    pub fn linear_of(&self, frozen: bool, m: f64, k: f64, n: f64) -> (f64, f64) {
        if frozen {
            (self.matmul(m, k, n, 1.0), self.matmul(m, n, k, 1.0))
        } else {
            self.linear(m, k, n)
        }
    }
}

/// One of a block's linear layers on one TP rank: `x (m × k) · w (k × n)`, `count` of them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearShape {
    /// `qkv`, `proj`, `fc1`, `fc2` (GeLU MLP), `gate_up` (SwiGLU's gate and up, two GEMMs),
    /// `down`, and MLA's projections.
    pub name: &'static str,
    pub m: f64,
    pub k: f64,
    pub n: f64,
    pub count: f64,
    /// A frozen weight (LoRA, QLoRA): no weight-gradient GEMM.
    pub frozen: bool,
}
