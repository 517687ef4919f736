//! A layout: the parallel degrees and knobs of one candidate plan, and its stage split.
//!
//! A layout is only a description; whether it fits is the memory model's question and how fast
//! it runs is the cost model's. `check` says whether the layout can be built at all for a job.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::mesh::Mesh;
use crate::model::Model;
use crate::schedule::ScheduleKind;
use crate::spec::Cluster;

/// Activation recomputation.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    None,
    /// Recompute the attention core (the s×s tensors) only (Korthikanti et al. 2022).
    Selective,
    /// Keep only each layer's input; recompute the whole layer in backward.
    Full,
}

impl Recompute {
    pub const ALL: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }
}

impl std::str::FromStr for Recompute {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Recompute::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| format!("unknown recompute \"{s}\"; use none | selective | full"))
    }
}

/// The most micro-batch passes through model chunks (m × PP × virtual stages) in one step
/// that a layout may have: the pipeline simulation's op lists grow linearly with it, so a
/// layout above it is rejected by [`Layout::check`] rather than simulated. Every preset job
/// stays below it: the most, Megatron's 1T model on 16 GPUs with DP 1, micro-batch 1 and
/// 16 stages of 8 chunks, has 3072 × 128 = 393,216.
pub const MAX_SIMULATED_PASSES: u64 = 1 << 19;

/// The rule name of layouts above [`MAX_SIMULATED_PASSES`].
pub const TOO_MANY_MICROBATCHES: &str = "too many micro-batches per step to simulate";

/// ZeRO sharding of model states over the data-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub struct Sharding {
    /// 0: none; 1: optimizer states; 2: + gradients; 3: + weights (FSDP FULL_SHARD).
    pub zero_stage: u8,
    /// Shard within a node only and replicate across nodes (FSDP HYBRID_SHARD).
    pub hybrid: bool,
}

/// One candidate layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub struct Layout {
    pub dp: u64,
    pub pp: u64,
    pub tp: u64,
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    pub sharding: Sharding,
    pub recompute: Recompute,
    /// With full recompute: every N-th layer is recomputed (layers N, 2N, … counting from 1,
    /// as torchtitan's `selective_ac_option = "N"`); 1 recomputes every layer.
    pub recompute_every: u64,
    pub sequence_parallel: bool,
    pub schedule: ScheduleKind,
    /// Model chunks per pipeline stage (1 unless interleaved).
    pub virtual_stages: u64,
}

impl Layout {
    /// A layout without a pipeline: DP × TP with the given ZeRO stage and micro-batch, no
    /// recompute, no sequence parallelism, no hybrid sharding (the schedule is 1F1B over one
    /// stage, which is no pipeline at all).
    pub fn without_pipeline(dp: u64, tp: u64, zero_stage: u8, micro_batch: u64) -> Layout {
        Layout {
            dp,
            pp: 1,
            tp,
            micro_batch,
            sharding: Sharding {
                zero_stage,
                hybrid: false,
            },
            recompute: Recompute::None,
            recompute_every: 1,
            sequence_parallel: false,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
        }
    }

    /// Micro-batches per optimizer step on each DP replica (0 where DP × micro-batch is 0 or
    /// exceeds the global batch).
    pub fn microbatches(&self, model: &Model) -> u64 {
        self.dp
            .checked_mul(self.micro_batch)
            .and_then(|q| model.training.global_batch.checked_div(q))
            .unwrap_or(0)
    }

    /// Model chunks of the pipeline, PP × virtual stages; `None` when that overflows u64.
    pub fn chunks(&self) -> Option<u64> {
        self.pp.checked_mul(self.virtual_stages)
    }

    pub fn mesh(&self, cluster: &Cluster) -> Mesh {
        Mesh::new(self.dp, self.pp, self.tp, cluster.gpus_per_node)
    }

    /// DP ranks a ZeRO shard is spread over: the whole DP group, or its members in one node.
    pub fn shard_degree(&self, cluster: &Cluster) -> u64 {
        if self.sharding.zero_stage == 0 {
            return 1;
        }
        if !self.sharding.hybrid {
            return self.dp;
        }
        // The DP group of rank 0 is ranks d·TP (d < DP); those below gpus_per_node share its
        // node: d < ⌈gpus_per_node / TP⌉. Closed form, so a DP of 10^12 allocates nothing.
        let per_node = cluster.gpus_per_node.max(1);
        self.dp.min(per_node.div_ceil(self.tp.max(1)))
    }

    /// A short label such as `dp16·tp8·pp8 mb1 zero1 full sp 1f1b`.
    pub fn label(&self) -> String {
        let mut s = format!(
            "dp{}·tp{}·pp{} mb{}",
            self.dp, self.tp, self.pp, self.micro_batch
        );
        if self.sharding.zero_stage > 0 {
            s += &format!(
                " zero{}{}",
                self.sharding.zero_stage,
                if self.sharding.hybrid { "-hybrid" } else { "" }
            );
        }
        if self.recompute != Recompute::None {
            s += &format!(" rc-{}", self.recompute.name());
            if self.recompute_every > 1 {
                s += &format!("/{}", self.recompute_every);
            }
        }
        if self.sequence_parallel {
            s += " sp";
        }
        if self.pp > 1 {
            s += &format!(" {}", self.schedule.name());
            if self.virtual_stages > 1 {
                s += &format!("×{}", self.virtual_stages);
            }
        }
        s
    }

    /// Why this layout cannot be built for the job, if it cannot.
    pub fn check(&self, model: &Model, cluster: &Cluster) -> Result<(), Rejection> {
        let a = &model.architecture;
        let t = &model.training;
        // Products in u128: three u64 degrees may overflow u64, two may not overflow u128.
        let world = u128::from(self.dp) * u128::from(self.pp);
        let world = world.checked_mul(u128::from(self.tp));
        if world != Some(u128::from(cluster.devices)) {
            return Err(Rejection::new(
                "degrees do not multiply to the device count",
                format!(
                    "DP {} × PP {} × TP {} = {} does not equal the {} devices",
                    self.dp,
                    self.pp,
                    self.tp,
                    world.map_or("more than 2^128".to_string(), |w| w.to_string()),
                    cluster.devices
                ),
            ));
        }
        if !a.heads.is_multiple_of(self.tp) || !a.kv_heads.is_multiple_of(self.tp) {
            return Err(Rejection::new(
                "TP does not divide the heads",
                format!(
                    "TP {} does not divide heads {} and kv_heads {}",
                    self.tp, a.heads, a.kv_heads
                ),
            ));
        }
        // The vocabulary never refuses a TP degree: it is padded to a multiple of
        // `vocab_divisible_by × TP` (`Architecture::padded_vocab`), as Megatron-LM does.
        if !a.ffn_hidden.is_multiple_of(self.tp) {
            return Err(Rejection::new(
                "TP does not divide the FFN width",
                format!("TP {} does not divide ffn_hidden {}", self.tp, a.ffn_hidden),
            ));
        }
        if self.sequence_parallel && (self.tp == 1 || !t.seq_len.is_multiple_of(self.tp)) {
            return Err(Rejection::new(
                "sequence parallelism needs TP > 1 dividing seq_len",
                format!(
                    "sequence parallelism needs TP > 1 dividing seq_len {} (TP is {})",
                    t.seq_len, self.tp
                ),
            ));
        }
        let chunks = u128::from(self.pp) * u128::from(self.virtual_stages);
        if chunks > u128::from(a.layers) {
            return Err(Rejection::new(
                "more pipeline chunks than layers",
                format!(
                    "PP {} × virtual stages {} = {} chunks but the model has only {} layers",
                    self.pp, self.virtual_stages, chunks, a.layers
                ),
            ));
        }
        if !t.global_batch.is_multiple_of(self.dp) {
            return Err(Rejection::new(
                "DP does not divide the global batch",
                format!(
                    "DP {} does not divide global_batch {}",
                    self.dp, t.global_batch
                ),
            ));
        }
        let per_replica = t.global_batch / self.dp;
        if !per_replica.is_multiple_of(self.micro_batch) {
            return Err(Rejection::new(
                "micro-batch does not divide the per-replica batch",
                format!(
                    "micro-batch {} does not divide the {} sequences per DP replica",
                    self.micro_batch, per_replica
                ),
            ));
        }
        if self.recompute_every != 1 && self.recompute != Recompute::Full {
            return Err(Rejection::new(
                "recompute every N-th layer needs full recompute",
                format!(
                    "recompute_every {} applies to full recompute, and the recompute is {}",
                    self.recompute_every,
                    self.recompute.name()
                ),
            ));
        }
        if self.recompute_every == 0 {
            return Err(Rejection::new(
                "recompute every N-th layer needs N ≥ 1",
                "recompute_every is 0".to_string(),
            ));
        }
        if self.sharding.zero_stage > 3 {
            return Err(Rejection::new(
                "no such ZeRO stage",
                format!(
                    "ZeRO stage {} does not exist (0-3)",
                    self.sharding.zero_stage
                ),
            ));
        }
        let m = per_replica.checked_div(self.micro_batch).unwrap_or(0);
        match self.schedule {
            ScheduleKind::Interleaved => {
                if self.pp < 2 || self.virtual_stages < 2 {
                    return Err(Rejection::new("interleaving needs PP ≥ 2 and v ≥ 2", format!(
                        "the interleaved schedule needs PP ≥ 2 and virtual stages ≥ 2 (PP {}, virtual stages {})",
                        self.pp, self.virtual_stages
                    )));
                }
                if !m.is_multiple_of(self.pp) {
                    return Err(Rejection::new("interleaving needs micro-batches divisible by PP", format!(
                        "the interleaved schedule needs the {m} micro-batches to be a multiple of PP {}",
                        self.pp
                    )));
                }
            }
            _ if self.virtual_stages != 1 => {
                return Err(Rejection::new(
                    "virtual stages need the interleaved schedule",
                    format!(
                        "virtual stages {} need the interleaved schedule (schedule is {})",
                        self.virtual_stages,
                        self.schedule.name()
                    ),
                ))
            }
            _ => {}
        }
        // Last, so that no layout of a normal-sized job changes its reason: the pipeline's op
        // lists grow with m × PP × v, and only a bounded number of them is simulated.
        if m == 0 {
            return Err(Rejection::new(
                "the step has no micro-batch",
                format!(
                    "global_batch {} leaves no micro-batch to run",
                    t.global_batch
                ),
            ));
        }
        let passes = u128::from(m) * chunks;
        if passes > u128::from(MAX_SIMULATED_PASSES) {
            let fix = if m > 1 {
                "pin a larger --micro-batch or a smaller global batch"
            } else {
                "pin a smaller --pp or --virtual-stages"
            };
            return Err(Rejection::new(
                TOO_MANY_MICROBATCHES,
                format!(
                    "too many micro-batches per step to simulate: m = {m} micro-batches × PP {} × virtual stages {} = {passes} chunk passes, above the limit of {MAX_SIMULATED_PASSES}; {fix}",
                    self.pp, self.virtual_stages
                ),
            ));
        }
        Ok(())
    }

    /// Layers per virtual stage, in pipeline order: an even split, the remainder given to the
    /// later chunks (the first stage already carries the embedding and the most activations).
    /// Empty when the layout has no chunk (PP or v is 0); callers bound PP × v first (a
    /// layout that passes [`Layout::check`] has at most [`MAX_SIMULATED_PASSES`] chunks).
    pub fn split_layers(&self, layers: u64) -> Vec<u64> {
        let Some(chunks) = self.chunks().filter(|c| *c > 0) else {
            return Vec::new();
        };
        let base = layers / chunks;
        let extra = layers % chunks;
        (0..chunks)
            .map(|c| base + u64::from(c >= chunks - extra))
            .collect()
    }
}

/// Why a layout cannot be built: the rule it breaks, and the details.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// A short, stable name of the rule (used to group rejections).
    pub rule: &'static str,
    pub detail: String,
}

impl Rejection {
    pub fn new(rule: &'static str, detail: String) -> Self {
        Rejection { rule, detail }
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}
