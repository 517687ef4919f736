//! The cost model: seconds per optimizer step of a layout, every term named.
//!
//! Per micro-batch, each chunk (virtual stage) takes its layers' compute (`ops`: a roofline per
//! op), the TP collectives on the links the TP group spans (`comm`), recompute's extra forward,
//! and any ZeRO-3 parameter traffic compute cannot hide. The step time is the makespan of the
//! event simulation of the planner's own schedule op lists with those durations and the p2p
//! transfers on the edges (`pipeline`), plus the data-parallel gradient sync that the backward
//! did not hide, plus the optimizer step (costed by its bytes). Constants come from the cluster
//! spec's `[calibration]` only. This module predicts; it does not choose layouts or print.

mod adapters;
mod blocking;
pub mod comm;
pub(crate) mod device;
pub mod gemm;
pub mod host;
#[cfg(test)]
mod host_tests;
pub mod interference;
mod layer_times;
pub mod loss;
pub mod moe;
pub mod nccl;
pub mod offload;
pub mod ops;
pub mod pipeline;
mod reasons;
pub mod stages;
#[cfg(test)]
mod tests;
pub mod tp_overlap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::layout::Layout;
use crate::model::Model;
use crate::spec::{Cluster, DeviceKind};
use comm::Links;
use device::Device;
use pipeline::{ChunkTime, Parts, Pipeline, Simulated};

use crate::precision::dtype_bytes;
pub use layer_times::layer_times;
use reasons::{cp_reason, dp_reason, ep_reason, recompute_reason, tp_reason};

/// The FLOP convention of `mfu`, stated in the output and in plan.json.
pub const FLOP_CONVENTION: &str = "model FLOPs (Korthikanti et al. 2022 Eq. 7, PaLM's MFU): 3 × forward FLOPs of every matmul, the attention scores and their product with V over the full sequence (no causal halving) and the logits; recompute excluded; MFU = model FLOPs per step / (step time × devices × peak_tflops)";

/// Framework behaviour that the specs do not say.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    /// Overlap the data-parallel gradient reduction with the backward pass (buckets go out as
    /// gradients become ready: PyTorch DDP and FSDP, Megatron's `overlap_grad_reduce`). Off,
    /// the whole reduction follows the last backward (Megatron-LM in 2021–22: Korthikanti et
    /// al. §6.3 "the gradient all-reduce was not overlapped").
    pub overlap_dp: bool,
    /// The overlap holds under pipeline parallelism too (false: DeepSpeed's pipeline engine
    /// reduces after the last backward, `Runs::overlap_dp_pipeline`).
    pub overlap_dp_pipeline: bool,
    /// How the loss is computed: its bytes per logit and kernels ([`loss::LossCost`]).
    pub loss: crate::framework::LossKind,
    /// The vocabulary is padded to `vocab_divisible_by × TP` (Megatron); false: used as it is
    /// ([`crate::model::Architecture::vocab_rows`]), its output-layer GEMMs unaligned where the
    /// rows are not a multiple of 16 bytes ([`loss::ALIGN_BYTES`]).
    pub pad_vocab: bool,
    /// The host's per-op floor of every layer's passes (`host`).
    pub host: host::HostFloor,
    /// Pipeline stages send whole activations (not 1/TP) with blocking p2p: the sender waits
    /// for the transfer (DeepSpeed's pipeline engine).
    pub blocking_p2p: bool,
    /// Overlapped collectives (ZeRO-3 gathers, the DP gradient sync) slow the compute they
    /// overlap by the SMs NCCL takes (`interference`).
    pub overlap_slows_compute: bool,
    /// Offload's host copies run beside the compute (`offload`).
    pub offload_overlap: bool,
    /// The framework's host AdamW rate relative to the cluster's `adamw_gparams_per_s`.
    pub host_adamw_speed: f64,
    /// Its flash-class attention kernel (`device::Device::for_job` takes the cluster's
    /// efficiency of it).
    pub attention_kernel: crate::framework::AttentionKernel,
}

impl Options {
    /// What a framework profile does (`crate::framework`).
    pub fn of(profile: &crate::framework::Profile) -> Options {
        Options {
            overlap_dp: profile.runs.overlap_dp,
            overlap_dp_pipeline: profile.runs.overlap_dp_pipeline,
            loss: profile.runs.loss,
            pad_vocab: profile.runs.pad_vocab,
            host: host::HostFloor {
                ops_forward: profile.runs.host_ops_forward,
                ops_backward: profile.runs.host_ops_backward,
                counts: host::Counts {
                    dispatches_forward: profile.runs.host_dispatches_forward,
                    dispatches_backward: profile.runs.host_dispatches_backward,
                    launches_forward: profile.runs.host_launches_forward,
                    launches_backward: profile.runs.host_launches_backward,
                },
                cost: profile.runs.host_cost,
            },
            blocking_p2p: profile.runs.blocking_p2p,
            overlap_slows_compute: profile.runs.overlap_slows_compute,
            offload_overlap: profile.runs.offload_overlap,
            host_adamw_speed: profile.runs.host_adamw_speed,
            attention_kernel: profile.runs.attention_kernel,
        }
    }

    /// What the model's framework profile does on `cluster` (its spec's `training.framework`,
    /// else the device's default profile).
    pub fn for_model(model: &Model, cluster: &Cluster) -> Options {
        Options::of(crate::framework::of(model, cluster))
    }
}

impl Default for Options {
    /// Megatron-core's behaviour: overlapped DP, the vocabulary-parallel fp32 loss, the
    /// vocabulary padded.
    fn default() -> Self {
        Options {
            overlap_dp: true,
            overlap_dp_pipeline: true,
            loss: crate::framework::LossKind::VocabParallelFp32,
            pad_vocab: true,
            host: host::HostFloor::NONE,
            blocking_p2p: false,
            overlap_slows_compute: false,
            offload_overlap: true,
            host_adamw_speed: 1.0,
            // Transformer Engine's attention, as the megatron-core profile states.
            attention_kernel: crate::framework::AttentionKernel::Cudnn,
        }
    }
}

/// One named term of the step time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TimeTerm {
    /// `compute`, `recompute`, `tp_comm`, `cp_comm`, `ep_comm`, `host_floor`,
    /// `nccl_interference`, `pp_p2p_blocking`, `pipeline_bubble`, `dp_exposed` or `optimizer`.
    pub name: String,
    pub seconds: f64,
    /// What the term is and how it was sized.
    pub reason: String,
}

/// The predicted performance of one layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// Seconds per optimizer step; the breakdown's terms sum to it.
    pub step_time_s: f64,
    pub breakdown: Vec<TimeTerm>,
    /// Tokens per second of the whole job.
    pub tokens_per_s: f64,
    pub tokens_per_s_per_device: f64,
    /// Model FLOPs utilisation under [`FLOP_CONVENTION`].
    pub mfu: f64,
    pub model_flops_per_step: f64,
    /// The stage whose busy time sets the breakdown.
    pub bottleneck_stage: u64,
}

impl Prediction {
    /// Seconds of a named term (0 when absent).
    pub fn term(&self, name: &str) -> f64 {
        self.breakdown
            .iter()
            .find(|t| t.name == name)
            .map_or(0.0, |t| t.seconds)
    }
}

/// Per micro-batch: one transformer layer, the embedding, the head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerTimes {
    /// A layer with the dense MLP.
    pub layer: ChunkTime,
    /// An MoE layer (router, experts, all-to-all), for an MoE model.
    pub moe_layer: Option<ChunkTime>,
    /// The share of the model's layers that are MoE layers (0 for a dense model).
    pub moe_share: f64,
    pub embedding: ChunkTime,
    pub head: ChunkTime,
    /// The first layer's ZeRO-3 gather, which nothing hides, per micro-batch per stage.
    pub zero3_first_gather: f64,
}

impl LayerTimes {
    /// Forward plus backward of the mean layer (dense and MoE layers in the model's
    /// proportion), for the partitioner.
    pub fn per_layer(&self) -> f64 {
        let dense = self.layer.fwd.total() + self.layer.bwd.total();
        match &self.moe_layer {
            Some(m) => {
                (1.0 - self.moe_share) * dense + self.moe_share * (m.fwd.total() + m.bwd.total())
            }
            None => dense,
        }
    }

    /// One chunk's layers: `dense` layers with the dense MLP and `moe` MoE layers.
    pub fn layers(&self, dense: u64, moe: u64) -> ChunkTime {
        let mut c = ChunkTime {
            fwd: self.layer.fwd.scale(dense as f64),
            bwd: self.layer.bwd.scale(dense as f64),
            wgrad: self.layer.wgrad * dense as f64,
        };
        if let Some(m) = &self.moe_layer {
            c.fwd = c.fwd.add(&m.fwd.scale(moe as f64));
            c.bwd = c.bwd.add(&m.bwd.scale(moe as f64));
            c.wgrad += m.wgrad * moe as f64;
        }
        c
    }
}

/// A layout with its split, costed up to the pipeline simulation.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    pub pipeline: Pipeline,
    /// Per stage: seconds of DP gradient sync after its last backward (not hidden by it).
    sync: Vec<f64>,
    /// Per stage: seconds of the optimizer step.
    optimizer: Vec<f64>,
    /// Per stage: parameters one rank updates in the optimizer step.
    updated: Vec<f64>,
    /// Per stage: the optimizer step's parts on the host (zero without offload).
    host_steps: Vec<offload::HostStep>,
    /// A lower bound of the step time (the simulation can only add).
    pub lower_bound: f64,
    model_flops_per_step: f64,
    tokens_per_step: f64,
    devices: f64,
    peak: f64,
    layers: Vec<u64>,
    dp_reason: String,
    tp_reason: String,
    cp_reason: String,
    ep_reason: String,
    /// What the layout's recompute keeps, and the attention it runs: the recompute term's words.
    recompute_keep: crate::memory::activations::Keep,
    attention: crate::model::AttentionImpl,
    update_bytes: f64,
    layout: Layout,
    /// The host link of each GPU (GB/s) and whether offload's copies overlap the passes.
    host_link_gbps: f64,
    offload_overlap: bool,
    /// Ranks per core where a node's ranks time-share fewer cores (the CPU backend's threads);
    /// 1 otherwise. Such a host keeps its cores busy through one rank's bubble with another
    /// rank's work, so its step is the longer of the ranks' mean busy time and the makespan at a
    /// whole core per rank ([`Evaluation::predict`]).
    core_sharing: f64,
}

/// Costs `layout` with `split` (layers per virtual stage) up to the simulation.
pub fn evaluate(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    split: &[u64],
    links: &Links,
    times: &LayerTimes,
    options: Options,
) -> Evaluation {
    let (pp, v) = (layout.pp as usize, layout.virtual_stages as usize);
    let m = layout.microbatches(model);
    let pieces = split.len();
    let last = pieces.saturating_sub(1);
    let starts = crate::partition::chunk_starts(split);
    let chunks: Vec<ChunkTime> = (0..pieces)
        .map(|vs| {
            let (dense, moe) = crate::memory::moe::layer_mix(model, starts[vs], split[vs]);
            let mut c = times.layers(dense, moe);
            if vs == 0 {
                c.fwd = c.fwd.add(&times.embedding.fwd);
                c.bwd = c.bwd.add(&times.embedding.bwd);
            }
            if vs == last {
                c.fwd = c.fwd.add(&times.head.fwd);
                c.bwd = c.bwd.add(&times.head.bwd);
            }
            if vs < pp {
                c.fwd.zero3 += times.zero3_first_gather;
            }
            c
        })
        .collect();
    let a = &model.architecture;
    let (tp, sp) = (layout.tp, layout.sequence_parallel);
    // Sizes in f64 (a u64 product can overflow for huge specs; exact below 2^53 either way).
    // A rank sends its own tokens: 1/CP of the sequence under context parallelism.
    let act = layout.micro_batch as f64
        * (model.training.seq_len / layout.cp.max(1)) as f64
        * a.hidden as f64
        * 2.0;
    // Each TP rank sends its 1/TP slice (sequence parallelism, or Megatron's scatter/gather);
    // without SP the receiver all-gathers the slices inside its node.
    let regather = if tp > 1 && !sp {
        links.tp.all_gather(act)
    } else {
        0.0
    };
    let mut p2p_next: Vec<f64> = links
        .pp_next
        .iter()
        .map(|l| l.p2p(act / tp as f64) + regather)
        .collect();
    let mut chunks = chunks;
    if options.blocking_p2p && pp > 1 {
        // DeepSpeed's pipeline engine: whole activations, blocking (`cost::blocking`).
        p2p_next = blocking::whole_activation_sends(&links.pp_next, act, pp, v, &mut chunks);
    }
    let pipeline = Pipeline {
        kind: layout.schedule,
        pp,
        microbatches: m as usize,
        virtual_stages: v,
        chunks,
        p2p_next: if pp > 1 { p2p_next } else { vec![0.0] },
    };
    // Parameters per stage, as the memory model counts them: the dense weights, and apart
    // the routed experts, whose gradients the expert-data-parallel group sums.
    let layers: Vec<u64> = layout.stage_layers(split);
    let (moe_common, moe_experts) = crate::memory::moe::moe_layer_params_per_rank(model, layout);
    let mixes = crate::memory::moe::stage_mixes(model, layout, split);
    // Frozen experts (LoRA on an MoE base) have no gradient to sum.
    let moe_experts = match model.adapters() {
        Some(_) => 0.0,
        None => moe_experts,
    };
    let expert_params: Vec<f64> = mixes.iter().map(|m| moe_experts * m.1 as f64).collect();
    let params: Vec<f64> = (0..pp)
        .map(|s| {
            let (dense, moe) = mixes[s];
            let mut p = a.layer_params().per_tp_rank(tp) * dense as f64 + moe_common * moe as f64;
            if layout.holds_embedding(s as u64) {
                p += a.embedding_params_at(tp, options.pad_vocab).per_tp_rank(tp);
            }
            if layout.holds_head(s as u64) {
                p += a
                    .head_params_at(a.tied_embeddings && pp == 1, tp, options.pad_vocab)
                    .per_tp_rank(tp);
            }
            // A LoRA or QLoRA job trains, syncs and updates only its blocks' adapters.
            match model.adapters() {
                Some(l) => l.layer_params(a).per_tp_rank(tp) * (dense + moe) as f64,
                None => p,
            }
        })
        .collect();
    let (grad, weight, update) = dtype_bytes(model);
    let zero = layout.sharding.zero_stage;
    let shard = layout.shard_degree(cluster) as f64;
    let hybrid = layout.sharding.hybrid;
    let (grad_sync, after_step): (Vec<f64>, Vec<f64>) = params
        .iter()
        .zip(&expert_params)
        .map(|(&p, &x)| {
            let (g, w) = (p * grad, p * weight);
            let (dense_sync, dense_after) = match (zero, hybrid) {
                (0, _) => (links.dp.all_reduce(g), 0.0),
                (1 | 2, false) => (links.dp.reduce_scatter(g), links.dp.all_gather(w)),
                (1 | 2, true) => (
                    links.dp_in_node.reduce_scatter(g)
                        + links.dp_across_nodes.all_reduce(g / shard),
                    links.dp_in_node.all_gather(w),
                ),
                // ZeRO-3 moves weights and gradients per micro-batch (in the chunk times);
                // hybrid sharding also all-reduces the shards across nodes once per step.
                (_, true) => (links.dp_across_nodes.all_reduce(g / shard), 0.0),
                (_, false) => (0.0, 0.0),
            };
            // The experts' gradients over the expert-data-parallel group (hybrid: inside the
            // node, the rest of the group's cross-node reduction is not modelled apart).
            let (xg, xw) = (x * grad, x * weight);
            let group = if hybrid {
                &links.expert_dp_in_node
            } else {
                &links.expert_dp
            };
            let (expert_sync, expert_after) = match zero {
                _ if x == 0.0 => (0.0, 0.0),
                0 => (group.all_reduce(xg), 0.0),
                1 | 2 => (group.reduce_scatter(xg), group.all_gather(xw)),
                _ => (0.0, 0.0),
            };
            (dense_sync + expert_sync, dense_after + expert_after)
        })
        .unzip();
    let mut sync: Vec<f64> = (0..pp)
        .map(|s| {
            let g = grad_sync[s];
            let hidden = if options.overlap_dp && (pp == 1 || options.overlap_dp_pipeline) {
                // Buckets go out during the last micro-batch's backward; the last bucket
                // (one layer's gradients) always waits for it.
                let window: f64 = (0..v).map(|c| pipeline.chunk(s, c).bwd.total()).sum();
                let last_bucket = g / layers[s].max(1) as f64;
                (g - last_bucket).min(window).max(0.0)
            } else {
                0.0
            };
            // The hidden buckets slow the backward they overlap (`interference`): the last
            // micro-batch's backward ends that much later, before the sync's tail.
            let slowed = if options.overlap_slows_compute {
                let compute: f64 = (0..v)
                    .map(|c| {
                        let b = &pipeline.chunk(s, c).bwd;
                        b.compute + b.recompute
                    })
                    .sum();
                interference::slowdown(compute, hidden, interference::sm_share(cluster))
            } else {
                0.0
            };
            g - hidden + slowed + after_step[s]
        })
        .collect();
    if a.tied_embeddings && pp > 1 && !model.training.method.adapters() {
        // The first and last stage all-reduce the shared embedding's gradient.
        sync[0] += links
            .first_last
            .all_reduce(a.embedding_params_at(tp, options.pad_vocab).per_tp_rank(tp) * grad);
    }
    let dev = Device::of(cluster);
    let per_rank = if zero >= 1 { shard } else { 1.0 };
    let expert_per_rank = if zero >= 1 {
        crate::memory::moe::expert_shard_degree(layout, cluster) as f64
    } else {
        1.0
    };
    let updated: Vec<f64> = params
        .iter()
        .zip(&expert_params)
        .map(|(p, x)| p / per_rank + x / expert_per_rank)
        .collect();
    let policy = crate::precision::Policy::by_name(&model.training.precision)
        .expect("the precision policy is validated when the spec is resolved");
    let host_steps: Vec<offload::HostStep> = updated
        .iter()
        .map(|&p| offload::host_step(policy, cluster, layout, p, options.host_adamw_speed))
        .collect();
    let optimizer: Vec<f64> = updated
        .iter()
        .zip(&host_steps)
        .map(|(p, h)| {
            if layout.offload.optimizer() {
                h.total()
            } else {
                dev.memory(p * update)
            }
        })
        .collect();
    let tokens_per_step = model.training.global_batch as f64 * model.training.seq_len as f64;
    let ranks_per_node = cluster.gpus_per_node.min(cluster.devices) as f64;
    let core_sharing = match cluster.device.shared_cores {
        Some(c) if cluster.device.kind == DeviceKind::Cpu => (ranks_per_node / c as f64).max(1.0),
        _ => 1.0,
    };
    let mut e = Evaluation {
        lower_bound: 0.0,
        sync,
        optimizer,
        updated,
        host_steps,
        model_flops_per_step: ops::training_flops_per_token(model) * tokens_per_step,
        tokens_per_step,
        devices: cluster.devices as f64,
        peak: dev.peak,
        layers,
        dp_reason: dp_reason(layout, links),
        tp_reason: tp_reason(layout, links, sp, model.training.tp_comm_overlap),
        cp_reason: cp_reason(layout, links),
        ep_reason: ep_reason(model, layout, links),
        recompute_keep: crate::memory::activations::Keep::for_model(layout.recompute, model),
        attention: model.training.attention,
        update_bytes: update,
        layout: *layout,
        pipeline,
        core_sharing,
        host_link_gbps: cluster.host.link_gbps,
        offload_overlap: options.offload_overlap,
    };
    let mean_busy = if e.core_sharing > 1.0 {
        mean(&e.pipeline.busy())
    } else {
        0.0
    };
    e.lower_bound = e.shared_step(e.pipeline.lower_bound(), mean_busy, e.tail().0);
    e
}

fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len().max(1) as f64
}

impl Evaluation {
    /// Seconds after the pipeline's makespan: `(total, of which DP sync)`. Stage `s` finishes
    /// its last backward at least `drain(s)` before the makespan, so its sync and optimizer step
    /// only show past the makespan by what the drain does not cover.
    fn tail(&self) -> (f64, f64) {
        let mut best = (0.0, 0.0);
        for s in 0..self.pipeline.pp {
            let drain = self.pipeline.drain(s);
            let total = self.sync[s] + self.optimizer[s] - drain;
            if total > best.0 {
                best = (total, (self.sync[s] - drain).clamp(0.0, total));
            }
        }
        best
    }

    /// The step from a makespan, the stages' mean busy time and the tail: `makespan + tail`, or
    /// on a host whose ranks share cores, the longer of the mean busy time (the cores never idle
    /// while a rank has work) and the makespan with every rank on a whole core, plus the tail.
    /// Monotone in `makespan`, so a lower bound of it gives a lower bound of the step.
    fn shared_step(&self, makespan: f64, mean_busy: f64, tail: f64) -> f64 {
        if self.core_sharing <= 1.0 {
            return makespan + tail;
        }
        mean_busy.max(makespan / self.core_sharing) + tail
    }

    /// The prediction, given the simulation of [`Evaluation::pipeline`].
    pub fn predict(&self, sim: &Simulated) -> Prediction {
        let p = &self.pipeline;
        let l = &self.layout;
        let b = (0..p.pp)
            .max_by(|&x, &y| sim.busy[x].total_cmp(&sim.busy[y]).then(y.cmp(&x)))
            .unwrap_or(0);
        let m = p.microbatches as f64;
        let stage_parts = |s: usize| {
            (0..p.virtual_stages)
                .map(|c| {
                    let ch = p.chunk(s, c);
                    ch.fwd.add(&ch.bwd)
                })
                .fold(Parts::default(), |acc, x| acc.add(&x))
                .scale(m)
        };
        let (tail, dp_tail) = self.tail();
        let mean_busy = mean(&sim.busy);
        let step = self.shared_step(sim.makespan, mean_busy, tail);
        let shared = self.core_sharing > 1.0;
        // Where ranks share cores, the terms are the mean stage's (the host's cores do every
        // stage's work); the bubble is what the critical path adds to it.
        let (sum, bubble) = if shared {
            let mean = (0..p.pp)
                .map(stage_parts)
                .fold(Parts::default(), |acc, x| acc.add(&x))
                .scale(1.0 / p.pp as f64);
            (mean, (step - tail - mean_busy).max(0.0))
        } else {
            (stage_parts(b), (sim.makespan - sim.busy[b]).max(0.0))
        };
        let kind = l.schedule.name();
        let mut terms = vec![
            (
                "compute",
                sum.compute,
                if shared {
                    format!(
                        "matmuls, attention and element-wise ops (a roofline per op), the mean of the {} stages' for {} micro-batches: {:.0} ranks per core share this host, so its cores do every stage's work",
                        p.pp, p.microbatches, self.core_sharing
                    )
                } else {
                    format!(
                        "matmuls, attention and element-wise ops (a roofline per op) of stage {b}'s {} layers{} for {} micro-batches",
                        self.layers[b],
                        match (b == 0, b + 1 == p.pp) {
                            (true, true) => " with the embedding and the head",
                            (true, false) => " with the embedding",
                            (false, true) => " with the head and loss",
                            _ => "",
                        },
                        p.microbatches
                    )
                },
            ),
            (
                "recompute",
                sum.recompute,
                recompute_reason(l, self.recompute_keep, self.attention),
            ),
            ("tp_comm", sum.tp, self.tp_reason.clone()),
            ("cp_comm", sum.cp, self.cp_reason.clone()),
            ("ep_comm", sum.ep, self.ep_reason.clone()),
            (
                "host_floor",
                sum.host,
                "the host's per-op dispatch beyond the GPU's time: each layer's pass takes at least its ops × the host's cost per op (the framework profile's dispatches and launches per layer counted from a profiler trace × the cluster's host_dispatch_us and host_launch_us, or its measured bare-op equivalents × host_op_us, or the launch latency)".to_string(),
            ),
            (
                "nccl_interference",
                sum.interference,
                "compute slowed by the overlapped ZeRO-3 collectives beside it: NCCL's CTAs take their share of the SMs (cluster nccl_ctas / device sms)".to_string(),
            ),
            (
                "pp_p2p_blocking",
                sum.p2p,
                "blocking pipeline sends of whole activations (not 1/TP) that the sending stage waits for".to_string(),
            ),
            (
                "pipeline_bubble",
                bubble,
                if shared {
                    "with ranks sharing cores, another rank's work fills a stage's waits: what remains is the critical path at a whole core per rank beyond the mean stage's busy time".to_string()
                } else if p.pp == 1 {
                    "no pipeline".to_string()
                } else {
                    format!(
                        "idle time of stage {b} in the simulated {kind} schedule ({} stages, {} micro-batches{}), including waits for p2p transfers; textbook (p−1)/(v·m) = {:.1}%",
                        p.pp,
                        p.microbatches,
                        if p.virtual_stages > 1 { format!(", {} chunks per stage", p.virtual_stages) } else { String::new() },
                        100.0 * crate::schedule::bubble_formula(l.schedule, p.pp, p.microbatches, p.virtual_stages)
                    )
                },
            ),
            (
                "dp_exposed",
                sum.zero3 + dp_tail,
                format!(
                    "{} not hidden behind the backward{}",
                    self.dp_reason,
                    if sum.zero3 > 0.0 { format!(" ({:.3} s of it inside the pipeline, ZeRO-3 gathers)", sum.zero3) } else { String::new() }
                ),
            ),
            (
                "offload_copies",
                sum.offload,
                format!(
                    "offload's host copies that the layers' passes do not hide: {}{}, over the {:.1} GB/s host link of each GPU{}",
                    match (l.offload.params(), l.sharding.zero_stage >= 2) {
                        (true, _) => "each layer's weight shard up before its forward and its backward, and its gradient shard down after its backward",
                        (false, true) => "each layer's gradient shard down after its backward, every micro-batch",
                        (false, false) => "no weight or gradient inside the pipeline (ZeRO-1 copies the reduced gradient shard once per step)",
                    },
                    if l.offload.activations { "; each layer's saved activations down in its forward and back up before its backward" } else { "" },
                    self.host_link_gbps,
                    if self.offload_overlap { " (on a stream of their own: only the copy beyond the layer's pass shows, Calculon's rule)" } else { " (not overlapped by this framework)" }
                ),
            ),
            if l.offload.optimizer() {
                let h = self.host_steps[b];
                (
                    "host_optimizer",
                    tail - dp_tail,
                    format!(
                        "AdamW on the host over the {:.0} parameters of a rank of the slowest stage, the node's CPUs shared by its ranks: {:.3} s; the copies around it (gradient shard down under ZeRO-1, updated 16-bit weights up unless the weights live on the host): {:.3} s; the optimizer states read from and written to NVMe: {:.3} s",
                        self.updated[b], h.adamw, h.copies, h.nvme
                    ),
                )
            } else {
                (
                    "optimizer",
                    tail - dp_tail,
                    format!(
                        "Adam update moving {:.0} B per parameter of the {:.0} parameters a rank of the slowest stage updates, at the calibrated memory bandwidth",
                        self.update_bytes, self.updated[b]
                    ),
                )
            },
        ];
        terms.retain(|t| t.1 > 0.0 || t.0 == "compute");
        Prediction {
            step_time_s: step,
            breakdown: terms
                .into_iter()
                .map(|(name, seconds, reason)| TimeTerm {
                    name: name.to_string(),
                    seconds,
                    reason,
                })
                .collect(),
            tokens_per_s: self.tokens_per_step / step,
            tokens_per_s_per_device: self.tokens_per_step / step / self.devices,
            mfu: self.model_flops_per_step / (step * self.devices * self.peak),
            model_flops_per_step: self.model_flops_per_step,
            bottleneck_stage: b as u64,
        }
    }
}
