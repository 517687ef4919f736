//! Offload's memory: which per-parameter states stay on the device and which go to the host
//! (or NVMe), and the host tier's report per rank and per node.
//!
//! The placement follows the mechanisms the frameworks ship, each state named as the policy
//! names it:
//! - `optimizer` (ZeRO-Offload, Ren et al. 2021 §4; DeepSpeed `offload_optimizer`; Megatron-
//!   Core's `--optimizer-cpu-offload`): the fp32 master weights and the Adam moments live on
//!   the host with the step. The gradient the step reads lives there too: under ZeRO-2 and 3
//!   the gradients leave the device bucket by bucket into the host's fp32 accumulator
//!   (DeepSpeed accumulates into pinned fp32 CPU buffers every micro-batch); under ZeRO-1 the
//!   device accumulates as without offload and the host keeps a copy of the reduced shard. A policy without a separate master copy (`fp32`,
//!   `bf16`: the weights are the master) adds a host copy of the weights for the step.
//! - `params` (ZeRO-Infinity `offload_param`, FSDP `CPUOffload(offload_params=True)`): the
//!   16-bit weights live on the host too, and the device keeps only the gathered layers (the
//!   ZeRO-3 term); the 16-bit gradient the backward writes is reduce-scattered layer by layer
//!   and copied down, so it has no persistent place on the device either.
//! - `nvme`: the optimizer's states (and under `params` the weights) sit on NVMe; the
//!   gradient buffer and DeepSpeed's pinned swap buffers stay in host memory.
//!
//! Every offloaded state is the rank's ZeRO shard (offload needs ZeRO, `search::pins`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::MemoryTerm;
use crate::layout::{Layout, Offload};
use crate::precision::{Policy, State, StateClass};
use crate::spec::Cluster;

/// Where a state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Device,
    Host,
    Nvme,
}

/// One per-parameter state and its tier.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Placed {
    pub state: State,
    pub tier: Tier,
}

const HOST_MASTER: State = State {
    name: "host_master_copy",
    bytes: 0, // the policy's weight width, set in `placement`
    class: StateClass::Optim,
    why: "the weights the host's optimizer step updates (the policy keeps no separate master copy, so the host holds its own copy of the rank's shard)",
};
const HOST_GRAD: State = State {
    name: "host_grad_buffer",
    bytes: 0, // the policy's gradient width, set in `placement`
    class: StateClass::Optim,
    why: "the gradient shard the host's optimizer step reads, copied down from the device after the backward",
};

/// DeepSpeed's pinned swap buffers for NVMe (docs "ZeRO-Infinity" / `offload_param` and
/// `offload_optimizer` configs): the parameter swapper's `buffer_count` 5 × `buffer_size` 1e8
/// elements of the 16-bit weights, the optimizer swapper's `buffer_count` 4 × one sub-group
/// (`sub_group_size` 1e9 elements, or the rank's whole shard if smaller) of fp32.
pub const PARAM_SWAP_ELEMENTS: f64 = 5.0 * 1e8;
pub const OPTIM_SWAP_BUFFERS: f64 = 4.0;
pub const SUB_GROUP_SIZE: f64 = 1e9;

/// The policy's states with their tiers under `o`, plus the host-only copies the step needs.
pub fn placement(policy: &Policy, o: &Offload, zero: u8) -> Vec<Placed> {
    let off = if o.nvme() { Tier::Nvme } else { Tier::Host };
    let on = |state: State, tier| Placed { state, tier };
    if !o.optimizer() {
        return policy.states.iter().map(|s| on(*s, Tier::Device)).collect();
    }
    let grads: Vec<&State> = policy
        .states
        .iter()
        .filter(|s| s.class == StateClass::Grad)
        .collect();
    let streamed = o.params() || zero >= 2;
    let widest = grads.iter().map(|g| g.bytes).max().unwrap_or(0);
    let has_master = policy
        .states
        .iter()
        .any(|s| s.class == StateClass::Optim && s.name.starts_with("master"));
    let mut out = Vec::new();
    for s in policy.states {
        let tier = match s.class {
            StateClass::Optim => off,
            StateClass::Param if o.params() => off,
            StateClass::Param => Tier::Device,
            // Under ZeRO-2 and 3 the gradients leave the device as the backward writes them:
            // reduce-scattered bucket by bucket and copied down into the host's accumulator
            // (DeepSpeed's `contiguous_gradients` buffer and CPU fp32 partition, FSDP's
            // per-unit reduce-scatter). Of two gradients the wider is that accumulator (on the
            // host); the narrower has no whole copy anywhere.
            StateClass::Grad if streamed && s.bytes == widest => Tier::Host,
            StateClass::Grad if streamed => continue,
            // Under ZeRO-1 the device accumulates every micro-batch's gradients as without
            // offload and the reduced shard goes down once per step (DeepSpeed stage 1,
            // Megatron-Core's distributed optimizer): the host keeps a copy of that shard.
            StateClass::Grad => Tier::Device,
        };
        out.push(on(*s, tier));
    }
    if !streamed {
        out.push(on(
            State {
                bytes: widest,
                ..HOST_GRAD
            },
            Tier::Host,
        ));
    }
    if !has_master && !o.params() {
        out.push(on(
            State {
                bytes: policy.class_bytes(StateClass::Param),
                ..HOST_MASTER
            },
            off,
        ));
    }
    out
}

/// DeepSpeed's `reduce_bucket_size` default (5e8 elements): under ZeRO-2 with the optimizer
/// offloaded, the gradients the backward writes wait in a bucket of this size (or the rank's
/// whole gradient, if smaller) before they are reduced and copied down.
pub const REDUCE_BUCKET_ELEMENTS: f64 = 5e8;

/// The device's gradient bucket under ZeRO-2 with the optimizer offloaded (0 otherwise: ZeRO-3
/// counts one layer's gradient in its gathered layers), for a rank of `params` parameters.
pub fn grad_bucket_bytes(policy: &Policy, layout: &Layout, params: f64) -> f64 {
    if !layout.offload.optimizer() || layout.sharding.zero_stage != 2 {
        return 0.0;
    }
    REDUCE_BUCKET_ELEMENTS.min(params) * written_grad_bytes(policy)
}

/// Bytes per element of the gradient the backward writes: the policy's narrowest gradient
/// (what offload's copies move and its bucket holds).
pub fn written_grad_bytes(policy: &Policy) -> f64 {
    policy
        .states
        .iter()
        .filter(|s| s.class == StateClass::Grad)
        .map(|s| s.bytes)
        .min()
        .unwrap_or(2) as f64
}

/// The states that stay on the device under `o` (all of them without offload).
pub fn device_states(policy: &Policy, o: &Offload, zero: u8) -> Vec<State> {
    placement(policy, o, zero)
        .into_iter()
        .filter(|p| p.tier == Tier::Device)
        .map(|p| p.state)
        .collect()
}

/// What one rank of a stage keeps off the device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct HostStage {
    pub stage: u64,
    /// Each term's `kind` is `host` or `nvme`.
    pub terms: Vec<MemoryTerm>,
    pub host_bytes: u64,
    pub nvme_bytes: u64,
}

/// The host tier of a layout that offloads: per rank of each stage, and per node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct HostReport {
    pub per_stage: Vec<HostStage>,
    /// Host memory of the fullest node: its ranks' host bytes summed (the ranks of a node
    /// are consecutive in the mesh order, so a node holds one stage's ranks or a run of whole
    /// stages).
    pub host_bytes_per_node: u64,
    pub host_capacity_bytes: u64,
    pub nvme_bytes_per_node: u64,
    pub nvme_capacity_bytes: u64,
}

impl HostReport {
    pub fn fits(&self) -> bool {
        self.overflow().is_none()
    }

    /// The tier that overflows, for a refusal: `(tier, needs, has)`.
    pub fn overflow(&self) -> Option<(&'static str, u64, u64)> {
        if self.host_bytes_per_node > self.host_capacity_bytes {
            Some((
                "host memory",
                self.host_bytes_per_node,
                self.host_capacity_bytes,
            ))
        } else if self.nvme_bytes_per_node > self.nvme_capacity_bytes {
            Some(("NVMe", self.nvme_bytes_per_node, self.nvme_capacity_bytes))
        } else {
            None
        }
    }
}

/// One stage's inputs to the host report.
pub struct StageInputs {
    /// Parameters one rank holds after TP, before ZeRO.
    pub params: f64,
    /// Of them, the rank's ZeRO shard (dense weights over DP × CP, routed experts over the
    /// expert-data-parallel group).
    pub shard_params: f64,
    /// Activation bytes moved to the host.
    pub offloaded_activations: f64,
}

/// The host report of `layout` from each stage's inputs (`None` without offload).
pub fn host_report(
    policy: &Policy,
    cluster: &Cluster,
    layout: &Layout,
    stages: &[StageInputs],
) -> Option<HostReport> {
    let o = layout.offload;
    if !o.any() {
        return None;
    }
    let placed = placement(policy, &o, layout.sharding.zero_stage);
    let per_stage: Vec<HostStage> = stages
        .iter()
        .enumerate()
        .map(|(s, inp)| {
            let mut terms = Vec::new();
            let mut push = |name: &str, kind: &str, bytes: f64, reason: String| {
                if bytes > 0.0 {
                    terms.push(MemoryTerm {
                        name: name.to_string(),
                        kind: kind.to_string(),
                        bytes: bytes.round() as u64,
                        reason,
                    });
                }
            };
            let shard_params = inp.shard_params;
            for p in placed.iter().filter(|p| p.tier != Tier::Device) {
                let kind = if p.tier == Tier::Nvme { "nvme" } else { "host" };
                push(
                    p.state.name,
                    kind,
                    shard_params * p.state.bytes as f64,
                    format!(
                        "{}; {} B/param × {shard_params:.0} params (the rank's ZeRO shard of its {:.0})",
                        p.state.why, p.state.bytes, inp.params
                    ),
                );
            }
            if o.nvme() {
                let wb = policy.class_bytes(StateClass::Param) as f64;
                if o.params() {
                    push("nvme_param_swap_buffers", "host", PARAM_SWAP_ELEMENTS * wb, format!("DeepSpeed's pinned parameter swap buffers: offload_param buffer_count 5 × buffer_size 1e8 elements × {wb} B"));
                }
                let group = SUB_GROUP_SIZE.min(shard_params);
                push("nvme_optimizer_swap_buffers", "host", OPTIM_SWAP_BUFFERS * group * 4.0, format!("DeepSpeed's pinned optimizer swap buffers: offload_optimizer buffer_count 4 × one sub-group of {group:.0} fp32 elements (sub_group_size 1e9, or the rank's shard if smaller)"));
            }
            push(
                "offloaded_activations",
                "host",
                inp.offloaded_activations,
                "the saved activations beyond the two layers the device keeps (the one in use and the one prefetched), copied to pinned host memory in the forward and back in the backward".into(),
            );
            let sum = |k: &str| {
                terms
                    .iter()
                    .filter(|t| t.kind == k)
                    .fold(0u64, |a, t| a.saturating_add(t.bytes))
            };
            HostStage {
                stage: s as u64,
                host_bytes: sum("host"),
                nvme_bytes: sum("nvme"),
                terms,
            }
        })
        .collect();
    let per_rank =
        |f: &dyn Fn(&HostStage) -> u64| -> Vec<u64> { per_stage.iter().map(f).collect() };
    let host = per_node(&per_rank(&|h| h.host_bytes), layout, cluster);
    let nvme = per_node(&per_rank(&|h| h.nvme_bytes), layout, cluster);
    Some(HostReport {
        per_stage,
        host_bytes_per_node: host,
        host_capacity_bytes: cluster.host.memory_bytes() as u64,
        nvme_bytes_per_node: nvme,
        nvme_capacity_bytes: cluster.host.nvme_bytes() as u64,
    })
}

/// The fullest node's sum of per-rank bytes (`per_stage[s]` for each rank of stage `s`): the
/// ranks of stage `s` are `[s·R, (s+1)·R)` with `R = DP·CP·TP`, a node's `[n·g, (n+1)·g)`.
fn per_node(per_stage: &[u64], layout: &Layout, cluster: &Cluster) -> u64 {
    let g = cluster.gpus_per_node.min(cluster.devices).max(1);
    let r = layout
        .dp
        .saturating_mul(layout.cp)
        .saturating_mul(layout.tp)
        .max(1);
    let nodes = cluster.devices.div_ceil(g);
    (0..nodes)
        .map(|n| {
            let (lo, hi) = (n * g, ((n + 1) * g).min(cluster.devices));
            (lo / r..=(hi - 1) / r)
                .map(|s| {
                    let (a, b) = ((s * r).max(lo), ((s + 1) * r).min(hi));
                    per_stage
                        .get(s as usize)
                        .copied()
                        .unwrap_or(0)
                        .saturating_mul(b.saturating_sub(a))
                })
                .fold(0u64, u64::saturating_add)
        })
        .max()
        .unwrap_or(0)
}
