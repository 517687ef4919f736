//! The memory model: bytes per device for each pipeline stage, every term named.
//!
//! Model states come from the precision policy (data, see `precision`), sharded by ZeRO over the
//! data-parallel group. Activations come from `activations`, multiplied by the micro-batches the
//! schedule keeps in flight on each stage. Framework overhead is a named, configurable term of
//! the cluster spec. This module only counts; it does not decide anything.

pub mod activations;
mod adapters;
mod allocator;
mod cpu_runtime;
mod frozen;
mod fsdp;
pub mod logits;
pub mod moe;
pub mod offload;
mod overhead;
mod phases;
#[cfg(test)]
pub(crate) mod schedule_tests;
mod stage_bytes;
pub mod stored;
mod zero3;

pub use overhead::{runtime_overhead_bytes, runtime_overheads};
pub use stage_bytes::StageBytes;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::layout::{Layout, Recompute};
use crate::model::Model;
use crate::precision::{Policy, State, StateClass};
use crate::schedule::ScheduleKind;
use crate::spec::{Cluster, DeviceKind};

/// What the memory model is unsure of for this framework on this cluster, for `tessera
/// explain`: the allocator's slack beyond the one segment it charges, and what it leaves out.
pub fn uncertainty(profile: &crate::framework::Profile, cluster: &Cluster) -> String {
    use crate::framework::Allocator;
    let frag = cluster.overhead.fragmentation;
    let flat = if frag > 0.0 {
        format!(
            "; the cluster spec adds {:.0}% of the tensors (overhead.fragmentation)",
            100.0 * frag
        )
    } else {
        String::new()
    };
    match (profile.memory.allocator, cluster.device.kind) {
        (_, DeviceKind::Cpu) => "the CPU backend's own buffers are modelled term by term (docs/performance.md, CPU memory); the host allocator's slack is not".into(),
        (Allocator::Static, _) => format!(
            "{} allocates its buffers once before the first step, so no allocator slack is charged{flat}; library workspaces beyond the named overhead terms are not modelled",
            profile.name
        ),
        (Allocator::Caching, _) if profile.memory.reports == crate::framework::Reports::Reserved => format!(
            "PyTorch's caching allocator is charged one cached segment of the stage's largest transient block (allocator_reserved), as {}'s published reserved peaks hold; blocks split by tensors of varying shapes can hold more, and expandable_segments less, neither modelled{flat}",
            profile.name
        ),
        (Allocator::Caching, _) => format!(
            "PyTorch's caching allocator is charged no slack: at a steady step each transient block reuses the cached block of its size the step before freed (the published runs of docs/validation.md's feasibility section ran with no more); blocks split by tensors of varying shapes (changing sequence lengths, ragged batches) can hold up to one segment of the largest transient block more{flat}"
        ),
    }
}

/// One named term of a stage's memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MemoryTerm {
    pub name: String,
    /// `model_states`, `activations` or `overhead`.
    pub kind: String,
    pub bytes: u64,
    /// Why the term is there and how it was sized.
    pub reason: String,
}

/// The memory of one rank of a pipeline stage (every rank of a stage holds the same).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StageMemory {
    pub stage: u64,
    /// Transformer layers on this stage (all its chunks).
    pub layers: u64,
    /// Parameters one rank of this stage holds before ZeRO sharding (after TP).
    pub params_per_rank: u64,
    /// Micro-batch-chunks whose activations are held at once (from the schedule).
    pub in_flight: u64,
    pub terms: Vec<MemoryTerm>,
    pub total_bytes: u64,
}

/// Memory of every stage, and the peak.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MemoryReport {
    /// The largest per-device total over all ranks.
    pub peak_bytes: u64,
    pub peak_stage: u64,
    pub capacity_bytes: u64,
    pub per_stage: Vec<StageMemory>,
    /// What a layout that offloads keeps in host memory and on NVMe, per rank and per node.
    /// Absent without offload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<offload::HostReport>,
}

impl MemoryReport {
    pub fn fits(&self) -> bool {
        self.peak_bytes <= self.capacity_bytes && self.host.as_ref().is_none_or(|h| h.fits())
    }
}

/// Peak micro-batch-chunks in flight on `stage`, in closed form; tests check it against the
/// schedule's own op lists (`Schedule::peak_in_flight`).
/// GPipe keeps all m; 1F1B keeps min(p − s, m) (PipeDream-Flush warm-up + 1); interleaved keeps
/// Megatron's warm-up `2(p − s − 1) + (v − 1)p` plus one, capped at m·v.
/// The split schedules hold a micro-batch until its W ran (the autograd graph that W runs on
/// keeps the chunk's saved activations alive in torch's `stage_backward_input`/`_weight`, so
/// the whole activations are counted, not only the linear layers' inputs and output
/// gradients W needs): ZB-H1 min(p, m) on every stage (1F1B's stage-0 peak); ZB-V
/// min(2p, 2m, m + s + 1) chunks (half a stage each: rank 0 holds p micro-batches of a stage
/// when m ≥ 2p); DualPipe p + 1 chunks (one model stage each: DeepSeek-V3's Table 2).
/// Saturating, so that no degree makes it wrap.
pub fn in_flight(kind: ScheduleKind, pp: u64, m: u64, v: u64, stage: u64) -> u64 {
    let after = pp.saturating_sub(stage);
    match kind {
        ScheduleKind::Gpipe => m.saturating_mul(v),
        ScheduleKind::OneFOneB => after.min(m),
        ScheduleKind::Interleaved => after
            .saturating_sub(1)
            .saturating_mul(2)
            .saturating_add(v.saturating_sub(1).saturating_mul(pp))
            .saturating_add(1)
            .min(m.saturating_mul(v)),
        ScheduleKind::ZbH1 => pp.min(m),
        ScheduleKind::ZbV => pp
            .saturating_mul(2)
            .min(m.saturating_mul(2))
            .min(m.saturating_add(stage).saturating_add(1)),
        ScheduleKind::DualPipe => pp.saturating_add(1),
    }
}

/// `x · n`, where no layers hold no bytes even when one layer's are infinite (an overflowed
/// parameter count): never NaN.
fn times(x: f64, n: f64) -> f64 {
    if n == 0.0 {
        0.0
    } else {
        x * n
    }
}

/// Bytes per parameter one rank keeps of a state, under a ZeRO stage sharding over `shard` ranks.
pub fn per_param(state: &State, zero_stage: u8, shard: u64) -> f64 {
    if zero_stage >= state.class.sharded_from_stage() {
        state.bytes as f64 / shard as f64
    } else {
        state.bytes as f64
    }
}

/// Receives a stage's terms: either recorded with their reasons, or only summed.
trait Sink {
    fn term(
        &mut self,
        name: &'static str,
        kind: &'static str,
        bytes: f64,
        reason: &dyn Fn() -> String,
    );
}

/// Sums the terms without building their descriptions (the search's fast path).
struct Total(u64);

impl Sink for Total {
    fn term(&mut self, _: &'static str, _: &'static str, bytes: f64, _: &dyn Fn() -> String) {
        if bytes > 0.0 {
            // An overflowed size is infinite bytes: the total saturates, never wraps.
            self.0 = self.0.saturating_add(bytes.round() as u64);
        }
    }
}

impl Sink for Vec<MemoryTerm> {
    fn term(
        &mut self,
        name: &'static str,
        kind: &'static str,
        bytes: f64,
        reason: &dyn Fn() -> String,
    ) {
        if bytes > 0.0 {
            self.push(MemoryTerm {
                name: name.to_string(),
                kind: kind.to_string(),
                bytes: bytes.round() as u64,
                reason: reason(),
            });
        }
    }
}

/// Everything about a layout that every stage's memory shares.
struct Ctx<'a> {
    model: &'a Model,
    cluster: &'a Cluster,
    layout: &'a Layout,
    policy: &'static Policy,
    split: Vec<u64>,
    microbatches: u64,
    shard: u64,
    per_layer_act: f64,
    /// The ZeRO shard degree of the expert states (the expert-data-parallel group).
    expert_shard: u64,
    /// One MoE layer's activations per micro-batch (0 for a dense model).
    moe_act: f64,
    /// One MoE layer's parameters on a rank: `(dense part, experts)`.
    moe_params: (f64, f64),
    /// Dense and MoE layers of each stage.
    mixes: Vec<(u64, u64)>,
    /// The profile's FSDP and allocator mechanisms (none under the default profiles), with its
    /// loss and vocabulary padding.
    fsdp: fsdp::Fsdp,
    /// The adapters and frozen base of a LoRA or QLoRA fine-tune (`None` for `full`).
    adapters: Option<frozen::Adapters<'a>>,
    /// The policy's states that stay on the device (all of them without offload).
    device_states: Vec<crate::precision::State>,
}

impl<'a> Ctx<'a> {
    fn new(model: &'a Model, cluster: &'a Cluster, layout: &'a Layout, split: &[u64]) -> Self {
        let fsdp = fsdp::Fsdp::of(model, cluster, layout);
        let policy = fsdp.policy(model);
        Ctx {
            model,
            cluster,
            layout,
            policy,
            split: split.to_vec(),
            microbatches: layout.microbatches(model),
            shard: layout.shard_degree(cluster),
            per_layer_act: per_layer_act(
                &cpu_runtime::activation_model(model, cluster.device.kind == DeviceKind::Cpu),
                layout,
            ),
            expert_shard: moe::expert_shard_degree(layout, cluster),
            moe_act: if model.architecture.moe.is_some() {
                moe::moe_layer_act(model, layout)
            } else {
                0.0
            },
            moe_params: moe::moe_layer_params_per_rank(model, layout),
            mixes: moe::stage_mixes(model, layout, split),
            adapters: frozen::Adapters::of(
                model,
                policy,
                layout.sharding.zero_stage,
                layout.shard_degree(cluster),
                cluster.device.kind == DeviceKind::Cpu,
            ),
            device_states: offload::device_states(
                policy,
                &layout.offload,
                layout.sharding.zero_stage,
            ),
            fsdp,
        }
    }

    /// One rank's inputs to the host report for `stage`.
    fn host_inputs(&self, stage: u64) -> offload::StageInputs {
        let (dense, experts) = self.param_parts(stage);
        let (zero, l) = (self.layout.sharding.zero_stage, self.layout);
        let shard = |n: u64| if zero >= 1 { n.max(1) as f64 } else { 1.0 };
        let (act, _) = self.activations(stage);
        offload::StageInputs {
            params: dense + experts,
            shard_params: dense / shard(self.shard) + experts / shard(self.expert_shard),
            offloaded_activations: if l.offload.activations {
                (act - self.device_activations(stage)).max(0.0)
            } else {
                0.0
            },
        }
    }

    /// The stage's saved layer activations of every micro-batch-chunk in flight, and the
    /// largest single layer's for one micro-batch.
    fn activations(&self, stage: u64) -> (f64, f64) {
        let v = self.layout.virtual_stages;
        let (dense_layers, moe_layers) = self.mix(stage);
        let per_chunk_bytes = (times(self.per_layer_act, dense_layers as f64)
            + times(self.moe_act, moe_layers as f64))
            / v as f64;
        let largest = if moe_layers > 0 {
            self.per_layer_act.max(self.moe_act)
        } else {
            self.per_layer_act
        };
        (per_chunk_bytes * self.in_flight(stage) as f64, largest)
    }

    /// What the device holds of [`Ctx::activations`]: all of it, or under activation offload
    /// two layers' worth (the layer in use and the one being copied).
    fn device_activations(&self, stage: u64) -> f64 {
        let (all, largest) = self.activations(stage);
        if self.layout.offload.activations {
            // Two buffers whatever the stage holds (what the affine `StageBytes` counts too).
            2.0 * largest
        } else {
            all
        }
    }

    /// Trainable parameters one rank of `stage` holds before ZeRO: the adapters of its blocks
    /// under LoRA or QLoRA, else every parameter.
    fn trainable(&self, stage: u64) -> f64 {
        match &self.adapters {
            Some(ad) => {
                ad.layer_trainable(&self.model.architecture, self.layout.tp)
                    * self.layers(stage) as f64
            }
            None => self.params(stage),
        }
    }

    /// Dense and MoE layers on `stage`.
    fn mix(&self, stage: u64) -> (u64, u64) {
        self.mixes[stage as usize]
    }

    fn layers(&self, stage: u64) -> u64 {
        (0..self.layout.virtual_stages as usize)
            .map(|c| self.split[self.layout.piece(stage as usize, c)])
            .sum()
    }

    /// Parameters one rank of `stage` holds after TP (and EP), before ZeRO.
    fn params(&self, stage: u64) -> f64 {
        let (dense, experts) = self.param_parts(stage);
        dense + experts
    }

    /// [`Ctx::params`] as `(dense weights, routed experts)`: ZeRO shards the first over DP × CP
    /// and the second over the expert-data-parallel group.
    fn param_parts(&self, stage: u64) -> (f64, f64) {
        let a = &self.model.architecture;
        let (pp, tp) = (self.layout.pp, self.layout.tp);
        let (dense_layers, moe_layers) = self.mix(stage);
        let (common, experts) = self.moe_params;
        let mut params = times(a.layer_params().per_tp_rank(tp), dense_layers as f64)
            + times(common, moe_layers as f64);
        if self.layout.holds_embedding(stage) {
            params += a
                .embedding_params_at(tp, self.fsdp.pad_vocab)
                .per_tp_rank(tp);
        }
        if self.layout.holds_head(stage) {
            // Tied embeddings share one matrix only when embedding and head sit on one stage.
            params += a
                .head_params_at(a.tied_embeddings && pp == 1, tp, self.fsdp.pad_vocab)
                .per_tp_rank(tp);
        }
        (params, times(experts, moe_layers as f64))
    }

    fn in_flight(&self, stage: u64) -> u64 {
        let l = self.layout;
        match self.cluster.device.kind {
            DeviceKind::Cpu => cpu_runtime::pooled_in_flight(l, self.microbatches, stage),
            DeviceKind::Gpu => {
                in_flight(l.schedule, l.pp, self.microbatches, l.virtual_stages, stage)
            }
        }
    }

    fn stage(&self, stage: u64, sink: &mut dyn Sink) {
        let (model, layout) = (self.model, self.layout);
        let (pp, v, tp, b) = (
            layout.pp,
            layout.virtual_stages,
            layout.tp,
            layout.micro_batch,
        );
        let sp = layout.sequence_parallel;
        let zero = layout.sharding.zero_stage;
        let shard = self.shard;
        let params = self.params(stage);
        let (dense_params, expert_params) = self.param_parts(stage);
        let eshard = self.expert_shard;
        let mut tensors = 0.0;
        let mut add = |sink: &mut dyn Sink, name, kind, bytes: f64, reason: &dyn Fn() -> String| {
            tensors += bytes.round().max(0.0);
            sink.term(name, kind, bytes, reason);
        };
        if let Some(ad) = &self.adapters {
            let a = &model.architecture;
            let layers = self.layers(stage) as f64;
            let trainable = self.trainable(stage);
            let l = ad.lora;
            for t in &ad.terms {
                let bpp = frozen::per_term(t, zero, shard);
                add(sink, t.name, "model_states", trainable * bpp, &|| {
                    let how = if zero >= t.class.sharded_from_stage() && shard > 1 {
                        format!("{bpp:.3} B/param, sharded over {shard} DP ranks by ZeRO-{zero}")
                    } else {
                        format!("{bpp} B/param")
                    };
                    format!("{}; {how} × {trainable:.0} adapter params (LoRA rank {} on {} of each of {layers} blocks)", t.why, l.rank, l.targets.iter().map(|t| t.name()).collect::<Vec<_>>().join(","))
                });
            }
            let (w, q) = ad.layer_frozen(a, tp);
            let (w, q) = match self.mix(stage).1 {
                0 => {
                    // The embedding and the head (on the end stages) are frozen and stay 16-bit.
                    let rest = dense_params - a.layer_params().per_tp_rank(tp) * layers;
                    (w * layers + rest, q * layers)
                }
                // An MoE base (LoRA only): every dense weight, with the routed experts below.
                _ => (dense_params, 0.0),
            };
            let ebpp = ad.expert_bpp(zero, eshard);
            let on = if zero >= 3 && shard > 1 {
                format!(", sharded over {shard} DP ranks by ZeRO-3")
            } else {
                String::new()
            };
            add(
                sink,
                "frozen_weights",
                "model_states",
                w * ad.frozen_bpp + expert_params * ebpp,
                &|| {
                    let what = if q > 0.0 {
                        "norms, biases, embedding and head"
                    } else {
                        "every base weight"
                    };
                    let experts = match expert_params > 0.0 {
                        true => format!(" + {ebpp:.3} B/param × {expert_params:.0} routed-expert params ({} experts of each MoE layer on this rank{})", model.architecture.moe.as_ref().map_or(0, |m| m.experts / layout.ep.max(1)), if zero >= 3 && eshard > 1 { format!(", sharded over the {eshard} expert-data-parallel ranks by ZeRO-3") } else { String::new() }),
                        false => String::new(),
                    };
                    format!("the frozen base ({what}): {} B/param{on} × {w:.0} params{experts}, with no gradient, master copy or optimizer state", ad.weight_bytes)
                },
            );
            add(
                sink,
                "frozen_weights_nf4",
                "model_states",
                ad.nf4_bytes(q, tp),
                &|| {
                    let whole = match ad.nf4_state_whole && tp > 1 {
                        true => format!("; the CPU runtime keeps each tensor's whole block scales on every TP rank: 0.5 B/param + {:.5} B × TP {tp}", crate::finetune::NF4_BYTES_PER_PARAM - 0.5),
                        false => String::new(),
                    };
                    format!("the blocks' linear weights in NF4 with double quantization (QLoRA; bitsandbytes quantize_4bit, block 64): 0.5 + 1/64 + 4/16384 = {:.5} B/param{on} × {q:.0} params{whole}", crate::finetune::NF4_BYTES_PER_PARAM)
                },
            );
        }
        for s in self
            .device_states
            .iter()
            .filter(|_| self.adapters.is_none())
        {
            let sz = cpu_runtime::states_zero(self.cluster, zero);
            let sharded = sz >= s.class.sharded_from_stage() && shard > 1;
            let bpp = per_param(s, sz, shard);
            let ebpp = per_param(s, sz, eshard);
            let bytes = dense_params * bpp + expert_params * ebpp;
            add(sink, s.name, "model_states", bytes, &|| {
                let how = if sharded {
                    format!("{bpp:.3} B/param, sharded over {shard} DP ranks by ZeRO-{zero}")
                } else {
                    format!("{bpp} B/param")
                };
                if expert_params > 0.0 {
                    let ehow = if sz >= s.class.sharded_from_stage() && eshard > 1 {
                        format!("{ebpp:.3} B/param, sharded over the {eshard} expert-data-parallel ranks")
                    } else {
                        format!("{ebpp} B/param")
                    };
                    format!("{}; {how} × {dense_params:.0} dense params + {ehow} × {expert_params:.0} expert params ({} routed experts of each MoE layer on this rank)", s.why, self.model.architecture.moe.as_ref().map_or(0, |m| m.experts / layout.ep.max(1)))
                } else {
                    format!("{}; {how} × {params:.0} params", s.why)
                }
            });
        }
        let (dense_layers, moe_layers) = self.mix(stage);
        let fp8 = crate::fp8::weight_cache(model, layout, dense_layers, moe_layers);
        add(sink, "fp8_weight_cache", "model_states", fp8, &|| {
            crate::fp8::weight_cache_reason(model, layout, dense_layers, moe_layers)
        });
        if let (Some(ad), true) = (&self.adapters, zero == 3 && shard > 1) {
            let (common, experts) = self.moe_params;
            let bytes = ad.gathered_layers(&model.architecture, tp, common + experts);
            add(
                sink,
                "zero3_gathered_layers",
                "model_states",
                bytes,
                &|| {
                    "ZeRO-3 all-gathers the current and the prefetched block's frozen weights (in their stored widths) and adapters; frozen weights have no gradient to hold".into()
                },
            );
        } else if cpu_runtime::states_zero(self.cluster, zero) == 3
            && (shard > 1 || layout.offload.params())
            && !self.fsdp.fsdp2
        {
            let (common, experts) = self.moe_params;
            let full = self
                .model
                .architecture
                .layer_params()
                .per_tp_rank(tp)
                .max(common + experts);
            let wb = self.policy.class_bytes(StateClass::Param) as f64;
            let arch = &self.model.architecture;
            let stage_params = zero3::stage_params(self.model, layout);
            let fetch = self.fsdp.zero3_fetch;
            add(
                sink,
                "zero3_gathered_layers",
                "model_states",
                zero3::gathered_bytes(fetch, arch, tp, full, stage_params, wb),
                &|| zero3::reason(fetch, arch, tp, stage_params),
            );
        }
        let bucket = offload::grad_bucket_bytes(self.policy, layout, params);
        add(sink, "offload_grad_bucket", "model_states", bucket, &|| {
            format!("ZeRO-2 with the optimizer offloaded: the 16-bit gradients wait in a bucket of min(DeepSpeed's reduce_bucket_size 5e8, the rank's {params:.0}) elements before they are reduced and copied down; no whole gradient stays on the device")
        });
        for (name, kind, bytes) in fsdp::stage_terms(&self.fsdp, model, layout, stage) {
            add(sink, name, kind, bytes, &|| {
                fsdp::reason(&self.fsdp, name, model, layout, stage)
            });
        }
        let flight = self.in_flight(stage);
        let per_chunk = self.layers(stage) as f64 / v as f64;
        add(
            sink,
            "layer_activations",
            "activations",
            self.device_activations(stage),
            &|| {
                if layout.offload.activations {
                    return format!("activation offload: the device keeps two buffers of the largest layer's saved activations for one micro-batch (the layer in use and the one being copied), {:.0} B; the stage's {:.0} B of in-flight activations wait in host memory", self.device_activations(stage), self.activations(stage).0);
                }
                let per_layer = if moe_layers > 0 {
                    format!(
                        "{:.0} B per dense layer and {:.0} B per MoE layer ({dense_layers} dense, {moe_layers} MoE on the stage)",
                        self.per_layer_act, self.moe_act
                    )
                } else {
                    format!("{:.0} B per layer", self.per_layer_act)
                };
                let fp8 = if model
                    .training
                    .fp8
                    .saves_fp8_inputs(crate::framework::fp8_engine(model))
                {
                    format!("; training.fp8 = \"{}\": the linears' saved inputs in FP8, 1 B per element", model.training.fp8)
                } else {
                    String::new()
                };
                format!(
                "{per_layer} per micro-batch ({} recompute{}) × {per_chunk:.1} layers per chunk × {flight} micro-batch-chunks in flight under {}{fp8}",
                layout.recompute.name(),
                if sp { ", sequence parallel" } else { "" },
                layout.schedule.name()
            )
            },
        );
        if moe_layers > 0 {
            let dispatch = moe::dispatch_buffer_bytes(model, layout);
            add(
                sink,
                "moe_dispatch_buffers",
                "activations",
                dispatch,
                &|| {
                    format!(
                    "the all-to-all's send and receive buffers of one MoE layer: {:.1} routed copies per token of the rank's tokens, hidden {} wide, each way",
                    moe::routed_copies(model),
                    model.architecture.hidden
                )
                },
            );
        }
        if let Some(ad) = &self.adapters {
            let bytes = ad.dequantized(model, layout);
            add(
                sink,
                "qlora_dequantized_weight",
                "activations",
                bytes,
                &|| {
                    "QLoRA dequantizes each NF4 linear just before its GEMM: the largest linear of a block on this rank, held once in the activations' width".into()
                },
            );
        }
        let ring = cp_ring_bytes(model, layout);
        if ring > 0.0 {
            add(sink, "cp_ring_buffers", "activations", ring, &|| {
                match layout.cp_comm {
                crate::layout::CpComm::P2p => format!("ring attention over CP {}: K and V of the block in hand and of the one arriving, and their gradients in the backward (4 × 2·b·(s/CP)·kv_dim/TP elements)", layout.cp),
                crate::layout::CpComm::AllGather => format!("K and V all-gathered over CP {}: the whole sequence's, and their gradients in the backward (2·CP × 2·b·(s/CP)·kv_dim/TP elements)", layout.cp),
            }
            });
        }
        let local = layout.rank_tokens(model);
        let cpu = self.cluster.device.kind == DeviceKind::Cpu;
        if cpu {
            let ws = cpu_runtime::workspace_bytes(&local, cpu, b, tp, sp);
            add(sink, "backward_workspace", "activations", ws, &|| {
                "the CPU runtime's gradient buffers of one layer's backward for one micro-batch, shared by the stage's layers".into()
            });
            let trainable = self.trainable(stage);
            let zb = cpu_runtime::zero_buffers(self.policy, trainable, zero, shard, v);
            if zb > 0.0 {
                add(sink, "zero_shard_buffers", "model_states", zb, &|| {
                    format!("the CPU runtime's ZeRO-{zero} buffers, kept between steps: the reduce-scattered gradient shard (fp32) and the shard the all-gather sends, each 1/{shard} of the largest chunk's parameters")
                });
            }
            let dp_msgs = cpu_runtime::dp_messages(trainable, layout.dp, zero, v);
            let tied = if self.adapters.is_some() {
                0.0
            } else {
                cpu_runtime::tied_messages(model, layout, stage)
            };
            if dp_msgs + tied > 0.0 {
                add(sink, "comm_messages", "overhead", dp_msgs + tied, &|| {
                    "the thread communicator's pooled message buffers, kept for reuse: the DP gradient sync's messages (the largest chunk's gradients, or the reduce-scatter's chunks under ZeRO) and the tied embedding's gradient sum between the end stages".into()
                });
            }
        }
        if stage == 0 {
            let held =
                in_flight(layout.schedule, pp, self.microbatches, 1, 0).min(self.microbatches);
            let bytes = activations::embedding_bytes(
                &cpu_runtime::activation_model(&local, cpu),
                b,
                tp,
                sp,
            ) * held as f64;
            add(
                sink,
                "embedding_dropout_mask",
                "activations",
                bytes,
                &|| {
                    format!("1-byte dropout mask of the embedding output × {held} micro-batches in flight")
                },
            );
        }
        if stage == pp - 1 {
            // The last stage runs each micro-batch's backward right after its forward, except
            // under GPipe, which keeps all of them.
            let held = if layout.schedule == ScheduleKind::Gpipe {
                self.microbatches
            } else {
                1
            };
            for (name, bytes, why) in
                activations::head_terms(&local, b, tp, sp, self.fsdp.loss, self.fsdp.pad_vocab)
            {
                add(sink, name, "activations", bytes * held as f64, &|| {
                    format!("{why} × {held} micro-batch(es)")
                });
            }
        }
        if self.fsdp.caching {
            let blocks = fsdp::transient_blocks(&self.fsdp, model, layout, stage);
            let reserved = allocator::reserved_bytes(&blocks);
            sink.term("allocator_reserved", "overhead", reserved, &|| {
                format!("PyTorch's caching allocator keeps freed blocks cached and splits them, so the peak holds one more segment of the stage's largest transient block ({:.0} B, rounded up to 2 MiB: CUDACachingAllocator.cpp kRoundLarge); the slack of blocks split by varying shapes beyond it is not modelled (docs/validation.md, memory where published)", blocks.iter().copied().fold(0.0, f64::max))
            });
        }
        let frag = self.cluster.overhead.fragmentation;
        if frag > 0.0 {
            sink.term(
                "allocator_fragmentation",
                "overhead",
                tensors * frag,
                &|| {
                    format!(
                        "{:.0}% of all tensors: the cluster spec's overhead.fragmentation",
                        frag * 100.0
                    )
                },
            );
        }
        for (name, bytes, why) in runtime_overheads(self.model, self.cluster, layout, stage) {
            sink.term(name, "overhead", bytes, &|| why.clone());
        }
    }
}

/// Activation bytes of an average layer for one micro-batch on one TP rank: under full
/// recompute of every N-th layer, one layer in N keeps its input only and the others keep all.
pub fn per_layer_act(model: &Model, layout: &Layout) -> f64 {
    layer_act_with(layout, &|r| {
        activations::layer_bytes(
            model,
            layout.micro_batch,
            layout.tp,
            layout.sequence_parallel,
            r,
        )
    })
}

/// The activation bytes a rank keeps of a layer whose full list, under each recompute mode,
/// `bytes` gives: the mix of full and no recompute under every-N-th-layer recompute, and the
/// rank's 1/CP of it (dense layers here, MoE layers in [`moe::moe_layer_act`]).
pub(crate) fn layer_act_with(layout: &Layout, bytes: &dyn Fn(Recompute) -> f64) -> f64 {
    let every = layout.recompute_every.max(1) as f64;
    let whole = match layout.recompute {
        Recompute::Full if every > 1.0 => {
            bytes(Recompute::Full) / every + bytes(Recompute::None) * (1.0 - 1.0 / every)
        }
        r => bytes(r),
    };
    // Context parallelism: a rank keeps its 1/CP of every tensor's rows (its own tokens; the
    // eager attention's scores are its s/CP queries against all s keys, 1/CP of them too).
    whole / layout.cp.max(1) as f64
}

/// Bytes of context parallelism's K/V buffers on a rank. Ring (p2p): K and V of the block in
/// hand and of the one arriving, and in the backward their gradients beside them (four blocks
/// of 2·b·(s/CP)·kv_dim/TP elements). All-gather: the whole sequence's K and V and, in the
/// backward, their gradients (2·CP such blocks). 0 without CP.
pub fn cp_ring_bytes(model: &Model, layout: &Layout) -> f64 {
    if layout.cp <= 1 {
        return 0.0;
    }
    let block = layout.cp_kv_block_bytes(model, stored::element_bytes(model));
    let blocks = match layout.cp_comm {
        crate::layout::CpComm::P2p => 4.0,
        // The whole sequence's K and V, gathered, and their gradients before the scatter.
        crate::layout::CpComm::AllGather => 2.0 * layout.cp as f64,
    };
    blocks * block
}

/// The largest per-device total over all stages, without building the breakdown, for the
/// layout's even split of the layers.
pub fn peak_bytes(model: &Model, cluster: &Cluster, layout: &Layout) -> u64 {
    peak_bytes_split(
        model,
        cluster,
        layout,
        &layout.split_layers(model.architecture.layers),
    )
}

/// Like [`peak_bytes`], for a given split: layers per virtual stage, in pipeline order.
pub fn peak_bytes_split(model: &Model, cluster: &Cluster, layout: &Layout, split: &[u64]) -> u64 {
    let ctx = Ctx::new(model, cluster, layout, split);
    (0..layout.pp).map(|s| ctx.peak_total(s)).max().unwrap_or(0)
}

/// The memory of every stage of a layout, every term named with its reason, for the layout's
/// even split of the layers.
pub fn estimate(model: &Model, cluster: &Cluster, layout: &Layout) -> MemoryReport {
    estimate_split(
        model,
        cluster,
        layout,
        &layout.split_layers(model.architecture.layers),
    )
}

/// Like [`estimate`], for a given split: layers per virtual stage, in pipeline order.
pub fn estimate_split(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    split: &[u64],
) -> MemoryReport {
    report(model, cluster, layout, split, true)
}

/// Every term of every stage summed, also where the peak is taken over FSDP2's phases: the
/// terms' own sizes, which the tests count by hand.
#[cfg(test)]
pub(crate) fn estimate_every_term(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
) -> MemoryReport {
    report(
        model,
        cluster,
        layout,
        &layout.split_layers(model.architecture.layers),
        false,
    )
}

fn report(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    split: &[u64],
    phases: bool,
) -> MemoryReport {
    let ctx = Ctx::new(model, cluster, layout, split);
    let per_stage: Vec<StageMemory> = (0..layout.pp)
        .map(|stage| {
            let terms = if phases {
                ctx.peak_terms(stage)
            } else {
                let mut t = Vec::new();
                ctx.stage(stage, &mut t);
                t
            };
            StageMemory {
                stage,
                layers: ctx.layers(stage),
                params_per_rank: ctx.params(stage).round() as u64,
                in_flight: ctx.in_flight(stage),
                total_bytes: terms.iter().fold(0u64, |t, x| t.saturating_add(x.bytes)),
                terms,
            }
        })
        .collect();
    let peak = per_stage
        .iter()
        .max_by_key(|s| (s.total_bytes, std::cmp::Reverse(s.stage)))
        .expect("pp ≥ 1");
    MemoryReport {
        peak_bytes: peak.total_bytes,
        peak_stage: peak.stage,
        capacity_bytes: cluster.memory_bytes() as u64,
        per_stage,
        host: host_report(&ctx),
    }
}

fn host_report(ctx: &Ctx) -> Option<offload::HostReport> {
    let stages: Vec<offload::StageInputs> =
        (0..ctx.layout.pp).map(|s| ctx.host_inputs(s)).collect();
    offload::host_report(ctx.policy, ctx.cluster, ctx.layout, &stages)
}

/// The host tier of `layout` with `split` (`None` without offload): what the search checks
/// besides the device's peak.
pub fn host_split(
    model: &Model,
    cluster: &Cluster,
    layout: &Layout,
    split: &[u64],
) -> Option<offload::HostReport> {
    if !layout.offload.any() {
        return None;
    }
    host_report(&Ctx::new(model, cluster, layout, split))
}
