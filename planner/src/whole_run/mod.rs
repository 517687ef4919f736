//! The whole run, not one step: how long and how much a token budget takes, the interruptions
//! a job of this size should expect, and the checkpoint cadence that keeps the most of the run.
//!
//! - **Budget.** `training.tokens` over the tokens of one optimizer step (global batch ×
//!   sequence) is the step count (rounded up); times the predicted step time, the compute time.
//! - **Interruptions.** A synchronous job stops when any of its GPUs does, so its rate is the
//!   sum of its parts': `devices / gpu_mtbf_hours` plus `nodes × preemptions_per_hour` (spot
//!   capacity, a node per instance). The job's mean time between interruptions M is its inverse.
//! - **Cadence.** A save takes δ (checkpoint::save_bytes over the node's `[storage]
//!   write_gbps`). Daly's higher-order estimate of the optimal compute time between saves
//!   (Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
//!   FGCS 22(3), Eq. 37) is τ = √(2δM)·[1 + ⅓·√(δ/2M) + (δ/2M)/9] − δ for δ < 2M, else M; its
//!   first term is Young's (1974) √(2δM). The interval is rounded to whole steps (at least 1).
//! - **Goodput**, the share of the job's GPU time that advances training, to first order in
//!   1/M: each segment of τ computing and δ saving keeps τ/(τ+δ), and each interruption (one
//!   per M of wall time) costs the restart R and, on average, half a segment of lost work:
//!   goodput = τ/(τ+δ) · (1 − (R + (τ+δ)/2)/M). The wall time is the compute time over it.
//!
//! A save is counted as blocking the step (as Tessera's own save does, and Megatron's and
//! torchtitan's synchronous saves); asynchronous saves, which overlap the write with training,
//! are not modelled.

pub mod checkpoint;
pub mod report;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::layout::Layout;
use crate::memory::MemoryReport;
use crate::model::Model;
use crate::spec::Cluster;

/// The checkpoint cadence of a plan whose cluster states `[reliability]` and `[storage]`
/// (plan.json `predicted.checkpoint`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Cadence {
    /// Bytes one save writes, all ranks together.
    pub save_bytes: f64,
    /// Bytes the busiest node writes.
    pub node_bytes: f64,
    /// Seconds one save takes: the busiest node's bytes over `storage.write_gbps`.
    pub save_s: f64,
    /// The job's mean time between interruptions, hours.
    pub job_mtbf_hours: f64,
    /// Daly's optimal compute time between saves, seconds (before rounding to steps).
    pub interval_s: f64,
    /// The recommended `--save-every`: the interval in whole optimizer steps, at least 1.
    pub save_every: u64,
    /// The share of GPU time that advances training at `save_every`.
    pub goodput: f64,
}

/// The whole run to the token budget (plan.json `predicted.whole_run`, present when the job
/// states `training.tokens`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WholeRun {
    pub tokens: u64,
    /// Tokens per optimizer step: global batch × sequence.
    pub tokens_per_step: u64,
    /// Optimizer steps to the budget (rounded up).
    pub steps: u64,
    /// Steps × the predicted step time, hours: the run with no interruption and no save.
    pub compute_hours: f64,
    /// The compute time over the goodput (the compute time where the cadence is unknown).
    pub wall_hours: f64,
    /// `wall_hours` × devices.
    pub gpu_hours: f64,
    /// `gpu_hours` × `cost.usd_per_gpu_hour`, where the cluster states a price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    /// Interruptions expected over `wall_hours`, where the cluster states `[reliability]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interruptions: Option<f64>,
}

/// The job's interruptions per hour, where the cluster states `[reliability]`.
pub fn interruption_rate(cluster: &Cluster) -> Option<f64> {
    let r = cluster.reliability?;
    Some(cluster.devices as f64 / r.gpu_mtbf_hours + cluster.nodes as f64 * r.preemptions_per_hour)
}

/// Daly's higher-order optimal compute time between saves, for a save of `save_s` seconds and
/// a mean time between interruptions of `mtbf_s` seconds.
pub fn daly_interval(save_s: f64, mtbf_s: f64) -> f64 {
    if save_s >= 2.0 * mtbf_s {
        return mtbf_s;
    }
    let x = save_s / (2.0 * mtbf_s);
    (2.0 * save_s * mtbf_s).sqrt() * (1.0 + x.sqrt() / 3.0 + x / 9.0) - save_s
}

/// The share of time that advances training with `interval_s` of compute between saves of
/// `save_s`, restarts of `restart_s` and a mean time between interruptions of `mtbf_s`.
pub fn goodput(interval_s: f64, save_s: f64, restart_s: f64, mtbf_s: f64) -> f64 {
    let segment = interval_s + save_s;
    (interval_s / segment * (1.0 - (restart_s + segment / 2.0) / mtbf_s)).max(0.0)
}

/// The cadence of `layout`, where the cluster states `[reliability]` and `[storage]`.
pub fn cadence(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    memory: &MemoryReport,
    step_time_s: f64,
) -> Option<Cadence> {
    let rate = interruption_rate(cluster)?;
    let storage = cluster.storage?;
    let restart_s = cluster.reliability?.restart_minutes * 60.0;
    let bytes = checkpoint::save_bytes(model, cluster, layout, memory);
    let save_s = bytes.busiest_node / (storage.write_gbps * 1e9);
    let mtbf_s = 3600.0 / rate;
    let interval_s = daly_interval(save_s, mtbf_s);
    let save_every = if step_time_s > 0.0 {
        ((interval_s / step_time_s).round() as u64).max(1)
    } else {
        1
    };
    Some(Cadence {
        save_bytes: bytes.total,
        node_bytes: bytes.busiest_node,
        save_s,
        job_mtbf_hours: 1.0 / rate,
        interval_s,
        save_every,
        goodput: goodput(save_every as f64 * step_time_s, save_s, restart_s, mtbf_s),
    })
}

/// The whole run to the job's token budget, where it states one.
pub fn whole_run(
    model: &Model,
    cluster: &Cluster,
    step_time_s: f64,
    cadence: Option<&Cadence>,
) -> Option<WholeRun> {
    let tokens = model.training.tokens?;
    let tokens_per_step = model
        .training
        .global_batch
        .saturating_mul(model.training.seq_len)
        .max(1);
    let steps = tokens.div_ceil(tokens_per_step);
    let compute_hours = steps as f64 * step_time_s / 3600.0;
    // A goodput of 0 (interruptions faster than a restart and a save) never finishes: the
    // wall time is left at the compute time and the printed summary says so.
    let wall_hours = match cadence {
        Some(c) if c.goodput > 0.0 => compute_hours / c.goodput,
        _ => compute_hours,
    };
    let gpu_hours = wall_hours * cluster.devices as f64;
    Some(WholeRun {
        tokens,
        tokens_per_step,
        steps,
        compute_hours,
        wall_hours,
        gpu_hours,
        cost_usd: cluster.cost.map(|c| gpu_hours * c.usd_per_gpu_hour),
        interruptions: interruption_rate(cluster).map(|r| wall_hours * r),
    })
}
