//! The host's per-op floor: an eager framework's CPU dispatches every op of a layer (Python,
//! the dispatcher, autograd's recording, the launch), so a layer's pass takes at least the host's
//! time for its ops, however little GPU work they hold. Per layer, per micro-batch and per pass
//! the time is `max(GPU time, ops × per-op host cost)`; the excess is the `host` part.
//!
//! "Ops" are bare-op equivalents: a framework's layer as its own code dispatches it, timed on the
//! host against the cheapest op (`y = y * c` with autograd) side by side
//! (scripts/host_layer_cost.py, docs/host-floor.md). A real layer's module calls, hooks, custom
//! autograd Functions and autocast casts make it cost more than its Python-level op count
//! (nanoGPT's block 65 forward against 22 ops counted, torchtitan's 109 against 45), so the
//! profiles carry the measured equivalents, and `host_op_us` is the bare op's cost on the host.
//!
//! One max per pass, not one per segment between collectives: NCCL collectives are enqueued on
//! a stream and return to the host at once (`torch.distributed.all_reduce` without `.wait()`),
//! so the host runs ahead across a layer's TP collectives and no source we found says it stalls
//! there. The backward's ops are the autograd nodes of the forward's (one each, the profile
//! file's rule); full recompute re-dispatches the forward's ops inside the backward.

use super::pipeline::ChunkTime;
use crate::framework::HostCost;
use crate::spec::Cluster;

/// Microseconds per eager op when the cluster's `[calibration]` gives no `host_op_us`:
/// pytorch/pytorch issue #41383 (2020) measures `y = 2*x` with `requires_grad=True` at 6.8 s per
/// million ops in a Python loop (dispatch with autograd's recording; 5 µs without it).
pub const DEFAULT_HOST_OP_US: f64 = 6.8;

/// What the host pays per layer and pass (from the framework profile).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostFloor {
    /// Bare-op equivalents of one layer's forward and of its backward (the profile's
    /// `host_ops_forward` / `host_ops_backward`).
    pub ops_forward: u32,
    pub ops_backward: u32,
    pub cost: HostCost,
}

impl HostFloor {
    /// No floor (a profile whose ops are not counted).
    pub const NONE: HostFloor = HostFloor {
        ops_forward: 0,
        ops_backward: 0,
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

    /// Raises `layer`'s passes to the host's time for their ops: the excess goes to the `host`
    /// part. `recomputed` is the share of a forward that the backward runs again (full
    /// recompute of every k-th layer: 1/k; 0 otherwise).
    pub fn apply(&self, cluster: &Cluster, layer: &mut ChunkTime, recomputed: f64) {
        let c = self.per_op(cluster);
        if c <= 0.0 {
            return;
        }
        let fwd = self.ops_forward as f64 * c;
        let bwd = (self.ops_backward as f64 + recomputed * self.ops_forward as f64) * c;
        layer.fwd.host = (fwd - layer.fwd.total()).max(0.0);
        layer.bwd.host = (bwd - layer.bwd.total()).max(0.0);
    }
}
