//! Offload's time: the host↔device copies per layer and per step, the NVMe reads and writes,
//! and the optimizer step on the host.
//!
//! Per layer and micro-batch, on one rank (its ZeRO shard of the layer):
//! - `params` offload copies the layer's 16-bit weights up before its forward and again before
//!   its backward (ZeRO-Infinity's and FSDP's CPU offload fetch the shard, then all-gather it
//!   as ZeRO-3 does); from NVMe they are read first, through the node's drives shared by its
//!   ranks;
//! - under ZeRO-2 and ZeRO-3 each micro-batch's gradient shard goes down after the layer's
//!   backward (DeepSpeed accumulates into the host's fp32 buffer every micro-step,
//!   `async_accumulate_grad_in_cpu_via_gpu`); under ZeRO-1 the reduced shard goes down once per
//!   step, after the sync (DeepSpeed stage 1 and Megatron-Core's distributed optimizer reduce at
//!   the step's end).
//!
//! A copy overlaps the layer's compute only where the framework runs it on a stream of its
//! own (`runs.offload_overlap`); then only the copy beyond the layer's pass shows (Calculon's
//! rule, Isaev et al. 2023: the overhead of an offloaded block is its transfer beyond its
//! compute). Down and up run at once (PCIe is full duplex), so a backward's copies take the
//! longer of the two.
//!
//! With activation offload, each layer's saved activations go down in its forward and back up
//! before its backward, beside the weights' copies in the same direction.
//!
//! Per step: the host's AdamW over the rank's shard (the node's CPUs shared by its ranks, at
//! the cluster's `adamw_gparams_per_s` times the profile's `host_adamw_speed`), the updated
//! 16-bit weights copied back up (none under `params`: they stay on the host), and on NVMe the
//! optimizer states read and written once (DeepSpeed's `pipeline_read` and `pipeline_write`
//! are off by default, so the swaps do not overlap the step).

use crate::layout::Layout;
use crate::precision::{Policy, StateClass};
use crate::spec::Cluster;

/// Seconds of host copies of one layer for one micro-batch, each pass.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LayerCopies {
    pub fwd: f64,
    pub bwd: f64,
}

/// The widths the copies move: the 16-bit weight and the gradient the backward writes.
fn widths(policy: &Policy) -> (f64, f64) {
    let weight = policy.class_bytes(StateClass::Param) as f64;
    (weight, crate::memory::offload::written_grad_bytes(policy))
}

fn ranks_per_node(cluster: &Cluster) -> f64 {
    cluster.gpus_per_node.min(cluster.devices).max(1) as f64
}

/// Seconds to move `bytes` over one GPU's host link.
fn link(cluster: &Cluster, bytes: f64) -> f64 {
    bytes / (cluster.host.link_gbps.max(1e-9) * 1e9)
}

/// Seconds for every rank of a node to move `bytes` each through the node's NVMe.
fn nvme(cluster: &Cluster, bytes: f64) -> f64 {
    bytes * ranks_per_node(cluster) / (cluster.host.nvme_gbps.max(1e-9) * 1e9)
}

/// The copies of a layer whose rank-shard holds `shard_params` parameters.
pub fn layer_copies(
    policy: &Policy,
    cluster: &Cluster,
    layout: &Layout,
    shard_params: f64,
    act_bytes: f64,
) -> LayerCopies {
    let o = layout.offload;
    // Activation offload: the layer's saved activations go down in the forward and come back
    // up for the backward (torchtune's and DeepSpeed's, on a stream of their own).
    let act = if o.activations {
        link(cluster, act_bytes)
    } else {
        0.0
    };
    if !o.optimizer() {
        return LayerCopies { fwd: act, bwd: act };
    }
    let (weight, grad) = widths(policy);
    let up = if o.params() {
        let bytes = shard_params * weight;
        let from_nvme = if o.nvme() { nvme(cluster, bytes) } else { 0.0 };
        link(cluster, bytes).max(from_nvme)
    } else {
        0.0
    };
    let down = if layout.sharding.zero_stage >= 2 {
        link(cluster, shard_params * grad)
    } else {
        0.0
    };
    // Up and down share no direction: each pass takes its longer direction.
    LayerCopies {
        fwd: up.max(act),
        bwd: (up + act).max(down),
    }
}

/// What a copy of `copy` seconds adds to a pass of `pass` seconds.
pub fn exposed(copy: f64, pass: f64, overlap: bool) -> f64 {
    if overlap {
        (copy - pass).max(0.0)
    } else {
        copy
    }
}

/// The host step's parts on one rank, seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HostStep {
    /// AdamW on the host over the rank's shard.
    pub adamw: f64,
    /// Copies around the step: the reduced gradient shard down (ZeRO-1) and the updated 16-bit
    /// weights up (not under `params`).
    pub copies: f64,
    /// The optimizer states read from and written back to NVMe.
    pub nvme: f64,
}

impl HostStep {
    pub fn total(&self) -> f64 {
        self.adamw + self.copies + self.nvme
    }
}

/// The step of a rank that updates `updated` parameters (its shard) on the host.
/// `adamw_speed` is the profile's rate relative to the cluster's `adamw_gparams_per_s`.
pub fn host_step(
    policy: &Policy,
    cluster: &Cluster,
    layout: &Layout,
    updated: f64,
    adamw_speed: f64,
) -> HostStep {
    let o = layout.offload;
    if !o.optimizer() {
        return HostStep::default();
    }
    let (weight, grad) = widths(policy);
    let rate = cluster.host.adamw_gparams_per_s * adamw_speed * 1e9;
    let adamw = updated * ranks_per_node(cluster) / rate.max(1e-9);
    let mut copies = 0.0;
    if layout.sharding.zero_stage == 1 {
        copies += link(cluster, updated * grad);
    }
    if !o.params() {
        copies += link(cluster, updated * weight);
    }
    let nvme_time = if o.nvme() {
        let states = policy.class_bytes(StateClass::Optim) as f64;
        2.0 * nvme(cluster, updated * states)
    } else {
        0.0
    };
    HostStep {
        adamw,
        copies,
        nvme: nvme_time,
    }
}
