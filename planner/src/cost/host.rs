//! The host's per-op floor: an eager framework's CPU dispatches every op of a layer (Python,
//! the dispatcher, autograd's recording, the launch), so a layer's pass takes at least the host's
//! time for its ops, however little GPU work they hold. Per layer, per micro-batch and per pass
//! the time is `max(GPU time, host time)`; the excess is the `host` part.
//!
//! The host time, where the profile counts the layer's host work from a profiler trace
//! (scripts/host_layer_trace.py, docs/host-floor.md), is `dispatches × host_dispatch_us +
//! launches × host_launch_us`: each dispatcher call the Python side makes (a top-level aten op,
//! a custom autograd Function, a compiled region; in the backward, each autograd node) costs the
//! host its dispatch, and each op that launches a kernel adds the launch on top. The max with
//! the GPU's time is the GPU overlapping those launches with its own work: the host runs ahead
//! while the kernels are longer than their issue, and binds only when it is slower.
//!
//! A profile without counts keeps the older measure: bare-op equivalents, its framework's layer
//! timed against `y = y * c` with autograd on a CPU-only host (scripts/host_layer_cost.py),
//! times `host_op_us`.
//!
//! One max per pass, not one per segment between collectives: NCCL collectives are enqueued on
//! a stream and return to the host at once (`torch.distributed.all_reduce` without `.wait()`),
//! so the host runs ahead across a layer's TP collectives and no source we found says it stalls
//! there. Full recompute re-dispatches the forward's ops inside the backward.

use super::pipeline::ChunkTime;
use crate::framework::HostCost;
use crate::spec::Cluster;

/// Microseconds per eager op when the cluster's `[calibration]` gives no `host_op_us` (or no
/// `host_dispatch_us`): pytorch/pytorch issue #41383 (2020) measures `y = 2*x` with
/// `requires_grad=True` at 6.8 s per million ops in a Python loop (dispatch with autograd's
/// recording; 5 µs without it). On its CPU tensor of one element the kernel runs inline in far
/// less, so the figure is the host's dispatch, with no launch in it.
pub const DEFAULT_HOST_OP_US: f64 = 6.8;

/// One layer's host work per pass, counted from a profiler trace (the profile's
/// `host_dispatches_*` / `host_launches_*`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counts {
    pub dispatches_forward: u32,
    pub dispatches_backward: u32,
    pub launches_forward: u32,
    pub launches_backward: u32,
}

impl Counts {
    /// Whether the profile counted its layer (else its bare-op equivalents stand).
    pub fn counted(&self) -> bool {
        self.dispatches_forward + self.dispatches_backward > 0
    }
}

/// What the host pays per layer and pass (from the framework profile).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostFloor {
    /// Bare-op equivalents of one layer's forward and of its backward (the profile's
    /// `host_ops_forward` / `host_ops_backward`): the measure where `counts` is empty.
    pub ops_forward: u32,
    pub ops_backward: u32,
    /// Dispatches and launches counted from a profiler trace; where present they replace the
    /// bare-op equivalents.
    pub counts: Counts,
    pub cost: HostCost,
}

impl HostFloor {
    /// No floor (a profile whose ops are not counted).
    pub const NONE: HostFloor = HostFloor {
        ops_forward: 0,
        ops_backward: 0,
        counts: Counts {
            dispatches_forward: 0,
            dispatches_backward: 0,
            launches_forward: 0,
            launches_backward: 0,
        },
        cost: HostCost::Graph,
    };

    /// Seconds the host spends per op on `cluster`: the calibrated dispatch cost for eager
    /// PyTorch, the launch latency for a compiled program, nothing under CUDA graphs.
    pub fn per_op(&self, cluster: &Cluster) -> f64 {
        match self.cost {
            HostCost::Dispatch => {
                cluster.calibration.host_op_us.unwrap_or(DEFAULT_HOST_OP_US) * 1e-6
            }
            HostCost::Launch => cluster.device.kernel_launch_us * 1e-6,
            HostCost::Graph => 0.0,
        }
    }

    /// The host's seconds for one layer's forward and for its backward, the forward's again
    /// in the backward for its `recomputed` share.
    pub fn seconds(&self, cluster: &Cluster, recomputed: f64) -> (f64, f64) {
        if self.cost == HostCost::Dispatch && self.counts.counted() {
            let k = &cluster.calibration;
            let dispatch = k.host_dispatch_us.unwrap_or(DEFAULT_HOST_OP_US) * 1e-6;
            let launch = k.host_launch_us.unwrap_or(cluster.device.kernel_launch_us) * 1e-6;
            let n = &self.counts;
            let fwd = n.dispatches_forward as f64 * dispatch + n.launches_forward as f64 * launch;
            let bwd = n.dispatches_backward as f64 * dispatch + n.launches_backward as f64 * launch;
            return (fwd, bwd + recomputed * fwd);
        }
        let c = self.per_op(cluster);
        let fwd = self.ops_forward as f64 * c;
        let bwd = (self.ops_backward as f64 + recomputed * self.ops_forward as f64) * c;
        (fwd, bwd)
    }

    /// Raises `layer`'s passes to the host's time for their ops: the excess goes to the `host`
    /// part. `recomputed` is the share of a forward that the backward runs again (full
    /// recompute of every k-th layer: 1/k; 0 otherwise).
    pub fn apply(&self, cluster: &Cluster, layer: &mut ChunkTime, recomputed: f64) {
        let (fwd, bwd) = self.seconds(cluster, recomputed);
        if fwd <= 0.0 && bwd <= 0.0 {
            return;
        }
        layer.fwd.host = (fwd - layer.fwd.total()).max(0.0);
        layer.bwd.host = (bwd - layer.bwd.total()).max(0.0);
    }
}
