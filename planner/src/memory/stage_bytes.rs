//! The memory of a stage as an affine function of its layers, for the search and the
//! partitioner.

use super::{
    activations, cp_ring_bytes, cpu_runtime, in_flight, moe, per_layer_act, per_param,
    runtime_overhead_bytes, times,
};
use crate::layout::Layout;
use crate::model::Model;
use crate::precision::StateClass;
use crate::schedule::ScheduleKind;
use crate::spec::{Cluster, DeviceKind};

/// A stage's memory as an affine function of how many layers it holds:
/// `bytes(stage, n) = per_layer[stage] · n + fixed[stage]`. The same terms as [`estimate`]
/// (to rounding, which a test bounds), without building them, so that the search and the
/// partitioner can ask "how many layers fit on this stage" in O(1).
#[derive(Debug, Clone, PartialEq)]
pub struct StageBytes {
    pub per_layer: Vec<f64>,
    pub fixed: Vec<f64>,
    /// Where a stage's peak is the larger of FSDP2's two phases (`fsdp::phased`): the end of
    /// the backward's `(per_layer, fixed)`; `per_layer` and `fixed` are then the start's.
    pub end: Vec<Option<(f64, f64)>>,
}

impl StageBytes {
    pub fn new(model: &Model, cluster: &Cluster, layout: &Layout) -> StageBytes {
        let a = &model.architecture;
        let (pp, tp, v, b) = (
            layout.pp,
            layout.tp,
            layout.virtual_stages,
            layout.micro_batch,
        );
        let sp = layout.sequence_parallel;
        let zero = layout.sharding.zero_stage;
        let shard = layout.shard_degree(cluster);
        let fsdp = super::fsdp::Fsdp::of(model, cluster, layout);
        let policy = fsdp.policy(model);
        let m = layout.microbatches(model);
        let on_device = super::offload::device_states(policy, &layout.offload, zero);
        let states_zero = cpu_runtime::states_zero(cluster, zero);
        let bpp: f64 = on_device
            .iter()
            .map(|s| per_param(s, states_zero, shard))
            .sum();
        let cpu = cluster.device.kind == DeviceKind::Cpu;
        let act = per_layer_act(&cpu_runtime::activation_model(model, cpu), layout);
        // The caching allocator's slack is `allocator_reserved` (fixed per stage); a cluster
        // spec's flat fragmentation (0 in the presets) comes on top of it.
        let grow = 1.0 + cluster.overhead.fragmentation;
        let local = layout.rank_tokens(model);
        let mut fixed_all =
            cpu_runtime::workspace_bytes(&local, cpu, b, tp, sp) + cp_ring_bytes(model, layout);
        // The CPU runtime's ZeRO buffers and DP messages, per parameter a rank holds.
        let per_param_bufs = if cpu {
            cpu_runtime::zero_buffers(policy, 1.0, zero, shard, v)
                + cpu_runtime::dp_messages(1.0, layout.dp, zero, v)
        } else {
            0.0
        };
        let bpp = bpp + per_param_bufs;
        let adapters = super::frozen::Adapters::of(model, policy, zero, shard, cpu);
        let layer_states = match &adapters {
            Some(ad) => ad.layer_bytes(a, tp) + ad.layer_trainable(a, tp) * per_param_bufs,
            None => a.layer_params().per_tp_rank(tp) * bpp,
        };
        // The embedding and head: frozen under adapters.
        let end_bpp = adapters.as_ref().map_or(bpp, |ad| ad.frozen_bpp);
        // MoE layers: the dense part at the DP × CP shard, the experts at the expert-DP one.
        let eshard = moe::expert_shard_degree(layout, cluster);
        let ebpp: f64 = on_device
            .iter()
            .map(|s| per_param(s, states_zero, eshard))
            .sum::<f64>()
            + per_param_bufs;
        let (common, experts) = moe::moe_layer_params_per_rank(model, layout);
        let moe_states = match &adapters {
            Some(ad) => {
                ad.moe_layer_bytes(a, tp, (common, experts), zero, eshard)
                    + ad.layer_trainable(a, tp) * per_param_bufs
            }
            None => common * bpp + experts * ebpp,
        };
        let moe_act = if a.moe.is_some() {
            moe::moe_layer_act(model, layout)
        } else {
            0.0
        };
        let mixes = moe::stage_mixes(model, layout, &layout.split_layers(a.layers));
        if let Some(ad) = &adapters {
            fixed_all += ad.dequantized(model, layout);
            if zero == 3 && shard > 1 {
                fixed_all += ad.gathered_layers(a, tp, common + experts);
            }
        } else if states_zero == 3 && (shard > 1 || layout.offload.params()) && !fsdp.fsdp2 {
            let wb = policy.class_bytes(StateClass::Param) as f64;
            let block = a.layer_params().per_tp_rank(tp).max(common + experts);
            let stage_params = super::zero3::stage_params(model, layout);
            fixed_all +=
                super::zero3::gathered_bytes(fsdp.zero3_fetch, a, tp, block, stage_params, wb);
        }
        let held0 = in_flight(layout.schedule, pp, m, 1, 0).min(m) as f64;
        let first = a.embedding_params_at(tp, fsdp.pad_vocab).per_tp_rank(tp) * end_bpp
            + activations::embedding_bytes(&cpu_runtime::activation_model(&local, cpu), b, tp, sp)
                * held0;
        let held_last = if layout.schedule == ScheduleKind::Gpipe {
            m
        } else {
            1
        } as f64;
        let head_buffers = activations::head_terms(&local, b, tp, sp, fsdp.loss, fsdp.pad_vocab)
            .iter()
            .map(|(_, x, _)| x * held_last)
            .sum::<f64>();
        let last = a
            .head_params_at(a.tied_embeddings && pp == 1, tp, fsdp.pad_vocab)
            .per_tp_rank(tp)
            * end_bpp
            + head_buffers;
        // FSDP2's phases (`fsdp::Phase`, as the report takes them by name): the sharded
        // gradients' bytes per parameter, absent at the backward's start with one micro-batch.
        let phased = super::fsdp::phased(&fsdp, model, layout, !cpu);
        let grad_bpp: f64 = on_device
            .iter()
            .filter(|s| s.name == "grads_fp32_sharded" && m == 1)
            .map(|s| per_param(s, states_zero, shard))
            .sum();
        let (mut per_layer, mut fixed, mut end) = (Vec::new(), Vec::new(), Vec::new());
        for s in 0..pp {
            let flight = match cpu {
                true => cpu_runtime::pooled_in_flight(layout, m, s),
                false => in_flight(layout.schedule, pp, m, v, s),
            } as f64;
            // A layer of this stage is dense or MoE in the proportion the even split gives it
            // (exact for that split; the mean for others).
            let (d, n_moe) = mixes[s as usize];
            let moe_share = if d + n_moe == 0 {
                0.0
            } else {
                n_moe as f64 / (d + n_moe) as f64
            };
            // Activation offload keeps two buffers of the largest layer's (a fixed term below).
            let kept = if layout.offload.activations {
                0.0
            } else {
                flight / v as f64
            };
            let dense = layer_states + act * kept + crate::fp8::weight_cache(model, layout, 1, 0);
            let moe_layer =
                moe_states + moe_act * kept + crate::fp8::weight_cache(model, layout, 0, 1);
            per_layer.push(grow * ((1.0 - moe_share) * dense + moe_share * moe_layer));
            let mut f = fixed_all;
            if layout.offload.activations {
                f += 2.0 * if n_moe > 0 { act.max(moe_act) } else { act };
            }
            // ZeRO-2 with the optimizer offloaded: the gradient bucket, for the even split's
            // parameters of the stage (it is capped at 5e8 elements, which any stage of a model
            // that needs offload exceeds).
            let stage_params = a.layer_params().per_tp_rank(tp) * d as f64
                + common * n_moe as f64
                + experts * n_moe as f64;
            f += super::offload::grad_bucket_bytes(policy, layout, stage_params);
            if n_moe > 0 {
                f += moe::dispatch_buffer_bytes(model, layout);
            }
            if cpu && adapters.is_none() {
                f += cpu_runtime::tied_messages(model, layout, s);
            }
            if layout.holds_embedding(s) {
                f += first;
            }
            if layout.holds_head(s) {
                f += last;
            }
            let fsdp_terms = super::fsdp::stage_terms(&fsdp, model, layout, s);
            f += fsdp_terms.iter().map(|t| t.2).sum::<f64>();
            let reserved = if fsdp.caching {
                let blocks = super::fsdp::transient_blocks(&fsdp, model, layout, s);
                super::allocator::reserved_bytes(&blocks)
            } else {
                0.0
            };
            let rest = reserved + runtime_overhead_bytes(model, cluster, layout, s);
            if phased {
                // The start of the backward: no sharded gradient (one micro-batch), no
                // reduce-scatter buffer, one gathered block of three, the root's parameters
                // without their gradient. The end: no activations but one layer's, no head
                // buffers. `fsdp::phase_share` is the same rule by name.
                use super::fsdp::{phase_share, Phase};
                let end_params = a.embedding_params_at(tp, fsdp.pad_vocab).per_tp_rank(tp)
                    + a.head_params_at(a.tied_embeddings && pp == 1, tp, fsdp.pad_vocab)
                        .per_tp_rank(tp);
                let dropped = |phase: Phase| -> f64 {
                    fsdp_terms
                        .iter()
                        .map(|t| t.2 * (1.0 - phase_share(phase, t.0, m, 1, &[])))
                        .sum::<f64>()
                };
                let layer_grads = a.layer_params().per_tp_rank(tp) * grad_bpp;
                let one_layer = act * kept;
                let summed = per_layer[s as usize];
                per_layer[s as usize] = summed - grow * layer_grads;
                end.push(Some((
                    summed - grow * one_layer,
                    grow * (f - head_buffers + one_layer) + rest,
                )));
                fixed.push(
                    grow * (f - end_params * grad_bpp - dropped(Phase::BackwardStart)) + rest,
                );
            } else {
                end.push(None);
                fixed.push(grow * f + rest);
            }
        }
        StageBytes {
            per_layer,
            fixed,
            end,
        }
    }

    /// Bytes on `stage` when it holds `layers` layers (the larger phase where it has two).
    pub fn bytes(&self, stage: usize, layers: u64) -> f64 {
        let start = times(self.per_layer[stage], layers as f64) + self.fixed[stage];
        match self.end[stage] {
            Some((per_layer, fixed)) => start.max(times(per_layer, layers as f64) + fixed),
            None => start,
        }
    }

    /// The most layers `stage` can hold within `capacity` bytes (0 if not even one): within
    /// both phases where it has two.
    pub fn max_layers(&self, stage: usize, capacity: f64) -> u64 {
        let fit = |per_layer: f64, fixed: f64| -> u64 {
            let room = capacity - fixed;
            if room < per_layer {
                return 0;
            }
            // A small slack for the rounding of the exact per-term report.
            ((room - 64.0) / per_layer).floor().max(0.0) as u64
        };
        let start = fit(self.per_layer[stage], self.fixed[stage]);
        match self.end[stage] {
            Some((per_layer, fixed)) => start.min(fit(per_layer, fixed)),
            None => start,
        }
    }

    /// The peak over stages of a split given as layers per stage.
    pub fn peak(&self, per_stage: &[u64]) -> f64 {
        per_stage
            .iter()
            .enumerate()
            .map(|(s, &n)| self.bytes(s, n))
            .fold(0.0, f64::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Recompute, Sharding};
    use crate::memory::estimate_split;
    use crate::spec::{self, ClusterOverrides, TrainingOverrides};
    use std::path::Path;

    fn preset(kind: &str, name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../specs")
            .join(kind)
            .join(name)
    }

    /// The affine model's bytes equal the report's, stage by stage, within rounding; the
    /// number of stages checked.
    fn assert_agree(model: &Model, cluster: &Cluster, l: &Layout, split: &[u64]) -> usize {
        let report = estimate_split(model, cluster, l, split);
        let fast = StageBytes::new(model, cluster, l);
        for s in &report.per_stage {
            let got = fast.bytes(s.stage as usize, s.layers);
            let diff = (got - s.total_bytes as f64).abs();
            assert!(
                diff <= 64.0,
                "{} stage {}: {got} vs {}",
                l.label(),
                s.stage,
                s.total_bytes
            );
        }
        report.per_stage.len()
    }

    /// The affine per-stage model equals the per-term report, stage by stage, for uneven
    /// splits, every schedule, ZeRO stage, recompute and sequence parallelism.
    #[test]
    fn stage_bytes_equal_the_report_for_any_split() {
        let model = spec::load_model(
            &preset("models", "gpt3-175b.toml"),
            TrainingOverrides::default(),
        )
        .unwrap();
        let cluster = spec::load_cluster(
            &preset("clusters", "dgx-a100-80g.toml"),
            ClusterOverrides {
                nodes: Some(16),
                devices: None,
            },
        )
        .unwrap();
        let mut checked = 0;
        for (pp, v, kind) in [
            (1, 1, ScheduleKind::OneFOneB),
            (4, 1, ScheduleKind::OneFOneB),
            (4, 1, ScheduleKind::Gpipe),
            (8, 3, ScheduleKind::Interleaved),
        ] {
            for (zero, hybrid) in [(0, false), (1, false), (3, false), (3, true)] {
                for recompute in Recompute::ALL {
                    for sp in [false, true] {
                        let l = Layout {
                            dp: 128 / (8 * pp),
                            cp: 1,
                            cp_comm: crate::layout::CpComm::P2p,
                            ep: 1,
                            pp,
                            tp: 8,
                            micro_batch: 1,
                            sharding: Sharding {
                                zero_stage: zero,
                                hybrid,
                            },
                            recompute,
                            recompute_every: 1,
                            sequence_parallel: sp,
                            schedule: kind,
                            virtual_stages: v,
                            offload: crate::layout::Offload::NONE,
                        };
                        let chunks = (pp * v) as usize;
                        // An uneven split: one layer moved from the last chunk to the first.
                        let mut split = l.split_layers(model.architecture.layers);
                        if chunks > 1 {
                            split[0] += 1;
                            split[chunks - 1] -= 1;
                        }
                        checked += assert_agree(&model, &cluster, &l, &split);
                    }
                }
            }
        }
        assert!(checked > 200);
    }

    /// LoRA on attention over a mixture-of-experts base (Mixtral 8x7B, frozen experts): the
    /// affine model equals the report under EP, ZeRO 0/1/3 and pipelines (even splits, where a
    /// stage's dense/MoE mix is exact).
    #[test]
    fn stage_bytes_equal_the_report_for_lora_on_a_moe_base() {
        use crate::finetune::{Lora, Method, Target};
        let mut model = spec::load_model(
            &preset("models", "mixtral-8x7b.toml"),
            TrainingOverrides::default(),
        )
        .unwrap();
        model.training.method = Method::Lora;
        model.lora = Some(Lora {
            rank: 16,
            alpha: 32.0,
            dropout: 0.0,
            targets: vec![Target::Q, Target::K, Target::V, Target::O],
        });
        let cluster = spec::load_cluster(
            &preset("clusters", "dgx-h100-80g.toml"),
            ClusterOverrides {
                nodes: Some(2),
                devices: None,
            },
        )
        .unwrap();
        let mut checked = 0;
        for (pp, ep, zero) in [
            (1, 1, 0),
            (1, 8, 0),
            (2, 4, 1),
            (1, 2, 3),
            (2, 2, 3),
            (4, 2, 0),
        ] {
            let l = Layout {
                ep,
                sequence_parallel: true,
                ..Layout::without_pipeline(16 / (2 * pp), 2, zero, 1)
            };
            let l = Layout { pp, ..l };
            checked += assert_agree(&model, &cluster, &l, &l.split_layers(32));
        }
        assert_eq!(checked, 1 + 1 + 2 + 1 + 2 + 4);
    }
}
