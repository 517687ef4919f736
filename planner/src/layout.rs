//! A layout: the parallel degrees and knobs of one candidate plan, and its stage split.
//!
//! A layout is only a description; whether it fits is the memory model's question and how fast
//! it runs is the cost model's. `check` says whether the layout can be built at all for a job.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::mesh::Mesh;

mod offload;
mod rejection;

use crate::model::Model;
use crate::schedule::ScheduleKind;
use crate::spec::Cluster;
pub use offload::{Offload, OffloadStates, OffloadTier};
use rejection::divisor_list;
pub(crate) use rejection::gcd;
pub use rejection::{Rejection, CHECK_ORDER};

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

/// How context parallelism exchanges keys and values.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Default,
    Serialize,
    Deserialize,
    JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum CpComm {
    /// Ring attention: K and V passed rank to rank in CP − 1 steps, each overlapped with the
    /// attention of the block in hand (Megatron-Core's `--cp-comm-type p2p`, the default).
    #[default]
    P2p,
    /// K and V all-gathered over the CP group before the attention of the local queries, the
    /// gradients reduce-scattered after it; not overlapped (Llama 3's choice, Dubey et al. 2024
    /// §3.3.2: GQA makes K and V small; Megatron-Core's `--cp-comm-type all_gather`).
    AllGather,
}

impl CpComm {
    pub const ALL: [CpComm; 2] = [CpComm::P2p, CpComm::AllGather];
    pub fn name(self) -> &'static str {
        match self {
            CpComm::P2p => "p2p",
            CpComm::AllGather => "all_gather",
        }
    }
}

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
    /// Context parallelism: each sequence is split over CP ranks (1: none).
    #[serde(default = "one")]
    pub cp: u64,
    /// How CP exchanges keys and values (ignored at CP 1, where it is `P2p`).
    #[serde(default)]
    pub cp_comm: CpComm,
    /// Expert parallelism (MoE models only; 1: none): each MoE layer's routed experts are
    /// split over EP ranks, which exchange tokens by all-to-all. EP ranks are taken from the
    /// DP × CP ranks that hold the same dense weights, as Megatron-Core forms them (expert TP
    /// equal to TP): the expert-data-parallel group is DP × CP / EP ([`crate::mesh::Mesh`]).
    #[serde(default = "one")]
    pub ep: u64,
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
    /// Model states (and activations) kept in host memory or on NVMe (absent: none).
    #[serde(default)]
    pub offload: Offload,
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
            cp: 1,
            cp_comm: CpComm::P2p,
            ep: 1,
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
            offload: crate::layout::Offload::NONE,
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

    /// The contiguous layer pieces the model is cut into: the chunks, except under DualPipe,
    /// whose two directions hold the same PP pieces ([`crate::schedule::pieces`]).
    pub fn pieces(&self) -> Option<u64> {
        match self.schedule {
            ScheduleKind::DualPipe => Some(self.pp),
            _ => self.chunks(),
        }
    }

    /// The piece (index into a split) that chunk `chunk` of stage `stage` holds
    /// ([`crate::schedule::virtual_stage`]).
    pub fn piece(&self, stage: usize, chunk: usize) -> usize {
        let (pp, v) = (self.pp as usize, self.virtual_stages as usize);
        crate::schedule::virtual_stage(self.schedule, pp, v, stage, chunk)
    }

    /// Whether stage `stage` holds the embedding (the first piece): stage 0, and under
    /// DualPipe also the last stage (the reverse direction's first piece).
    pub fn holds_embedding(&self, stage: u64) -> bool {
        self.holds_piece(stage, 0)
    }

    /// Whether stage `stage` holds the output layer and loss (the last piece): the last stage,
    /// under ZB-V stage 0 (the tip of the V's return), under DualPipe both end stages.
    pub fn holds_head(&self, stage: u64) -> bool {
        let last = self.pieces().unwrap_or(1).saturating_sub(1) as usize;
        self.holds_piece(stage, last)
    }

    fn holds_piece(&self, stage: u64, piece: usize) -> bool {
        (0..self.virtual_stages.max(1) as usize).any(|c| self.piece(stage as usize, c) == piece)
    }

    /// Layers per stage of a split (layers per piece): the sum over each stage's chunks.
    pub fn stage_layers(&self, split: &[u64]) -> Vec<u64> {
        (0..self.pp as usize)
            .map(|s| {
                (0..self.virtual_stages as usize)
                    .map(|c| split.get(self.piece(s, c)).copied().unwrap_or(0))
                    .sum()
            })
            .collect()
    }

    pub fn mesh(&self, cluster: &Cluster) -> Mesh {
        Mesh::with_cp(self.dp, self.cp, self.pp, self.tp, cluster.gpus_per_node).with_ep(self.ep)
    }

    /// DP ranks a ZeRO shard is spread over: the whole DP group (DP × CP with context
    /// parallelism: the ranks that hold the same weights, as Megatron-Core's distributed
    /// optimizer shards over them), or its members in one node.
    pub fn shard_degree(&self, cluster: &Cluster) -> u64 {
        if self.sharding.zero_stage == 0 {
            return 1;
        }
        let group = self.dp.saturating_mul(self.cp.max(1));
        if !self.sharding.hybrid {
            return group;
        }
        // The group of rank 0 is ranks j·TP (j < DP·CP); those below gpus_per_node share its
        // node: j < ⌈gpus_per_node / TP⌉. Closed form, so a DP of 10^12 allocates nothing.
        let per_node = cluster.gpus_per_node.max(1);
        group.min(per_node.div_ceil(self.tp.max(1)))
    }

    /// A short label such as `dp16·tp8·pp8 mb1 zero1 full sp 1f1b`.
    pub fn label(&self) -> String {
        let cp = match (self.cp > 1, self.cp_comm) {
            (false, _) => String::new(),
            (true, CpComm::P2p) => format!("·cp{}", self.cp),
            (true, CpComm::AllGather) => format!("·cp{}ag", self.cp),
        };
        let ep = if self.ep > 1 {
            format!("·ep{}", self.ep)
        } else {
            String::new()
        };
        let mut s = format!(
            "dp{}{cp}{ep}·tp{}·pp{} mb{}",
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
        s += &self.offload.label();
        s
    }

    /// Why this layout cannot be built for the job, if it cannot.
    pub fn check(&self, model: &Model, cluster: &Cluster) -> Result<(), Rejection> {
        let a = &model.architecture;
        let t = &model.training;
        // Products in u128: three u64 degrees may overflow u64, two may not overflow u128.
        let world = u128::from(self.dp) * u128::from(self.pp);
        let world = world
            .checked_mul(u128::from(self.tp))
            .and_then(|w| w.checked_mul(u128::from(self.cp)));
        if world != Some(u128::from(cluster.devices)) {
            let cp = if self.cp != 1 {
                format!(" × CP {}", self.cp)
            } else {
                String::new()
            };
            return Err(Rejection::new(
                "degrees do not multiply to the device count",
                format!(
                    "DP {}{cp} × PP {} × TP {} = {} does not equal the {} devices",
                    self.dp,
                    self.pp,
                    self.tp,
                    world.map_or("more than 2^128".to_string(), |w| w.to_string()),
                    cluster.devices
                ),
            ));
        }
        // Context parallelism cuts each sequence into 2·CP chunks (rank i holds chunks i and
        // 2·CP−1−i, so that causal attention costs every rank the same).
        if self.cp > 1 && !t.seq_len.is_multiple_of(2 * self.cp) {
            return Err(Rejection::new(
                "CP does not divide the sequence",
                format!(
                    "CP {} needs seq_len {} to split into 2 × CP = {} equal chunks (load-balanced causal ring attention), and it leaves {} over",
                    self.cp,
                    t.seq_len,
                    2 * self.cp,
                    t.seq_len % (2 * self.cp)
                ),
            )
            .with_fix(if t.seq_len.is_multiple_of(2) {
                // The degrees that pass this rule and divide the devices: divisors of
                // gcd(seq_len / 2, devices).
                let (mut a, mut b) = (t.seq_len / 2, cluster.devices.max(1));
                while b != 0 {
                    (a, b) = (b, a % b);
                }
                format!(
                    "use a CP with 2 × CP dividing seq_len {} and CP dividing the {} devices{}",
                    t.seq_len,
                    cluster.devices,
                    divisor_list(a)
                )
            } else {
                format!(
                    "use CP 1: an odd seq_len ({}) cannot split into 2 × CP equal chunks; or an even seq_len",
                    t.seq_len
                )
            }));
        }
        if self.ep != 1 || a.moe.is_some() {
            self.check_moe(model)?;
        }
        if !a.heads.is_multiple_of(self.tp) || !a.kv_heads.is_multiple_of(self.tp) {
            return Err(Rejection::new(
                "TP does not divide the heads",
                format!(
                    "TP {} does not divide heads {} and kv_heads {}",
                    self.tp, a.heads, a.kv_heads
                ),
            )
            .with_fix(format!(
                "use a TP that divides both {} and {}{}",
                a.heads,
                a.kv_heads,
                divisor_list(gcd(a.heads, a.kv_heads))
            )));
        }
        // The vocabulary never refuses a TP degree: it is padded to a multiple of
        // `vocab_divisible_by × TP` (`Architecture::padded_vocab`), as Megatron-LM does.
        if !a.ffn_hidden.is_multiple_of(self.tp) {
            return Err(Rejection::new(
                "TP does not divide the FFN width",
                format!("TP {} does not divide ffn_hidden {}", self.tp, a.ffn_hidden),
            )
            .with_fix(format!(
                "use a TP that divides ffn_hidden {}{}",
                a.ffn_hidden,
                divisor_list(gcd(a.ffn_hidden, gcd(a.heads, a.kv_heads)))
            )));
        }
        let local_seq = t.seq_len / self.cp.max(1);
        if self.sequence_parallel && (self.tp == 1 || !local_seq.is_multiple_of(self.tp)) {
            let of = if self.cp > 1 {
                format!("the {local_seq} tokens each CP rank holds")
            } else {
                format!("seq_len {}", t.seq_len)
            };
            return Err(Rejection::new(
                "sequence parallelism needs TP > 1 dividing seq_len",
                format!(
                    "sequence parallelism needs TP > 1 dividing {of} (TP is {})",
                    self.tp
                ),
            ));
        }
        // The layer pieces: PP × virtual stages, PP under DualPipe (its two directions hold
        // the same pieces).
        let chunks = if self.schedule == ScheduleKind::DualPipe {
            u128::from(self.pp)
        } else {
            u128::from(self.pp) * u128::from(self.virtual_stages)
        };
        // Interleaved, the first chunk may hold only the embedding and the last only the
        // output layer and loss (Llama 3's layout; Megatron-Core's
        // `--account-for-embedding-in-pipeline-split` and `--account-for-loss-in-pipeline-
        // split`): up to two chunks more than layers.
        let interleaved = self.schedule == ScheduleKind::Interleaved;
        let spare = if self.virtual_stages > 1 && interleaved {
            2
        } else {
            0
        };
        if chunks > u128::from(a.layers) + spare {
            let most = (a.layers + spare as u64) / self.virtual_stages.max(1);
            let fix = if !interleaved && chunks > u128::from(self.pp) {
                format!(
                    "use --pp ≤ {most} (the {} schedule cuts the model into 2 × PP pieces)",
                    self.schedule.name()
                )
            } else if self.virtual_stages > 2 {
                format!(
                    "use --pp ≤ {most} at {} virtual stages, or fewer virtual stages (--pp ≤ {} at 2)",
                    self.virtual_stages,
                    (a.layers + 2) / 2
                )
            } else if self.virtual_stages == 2 {
                format!(
                    "use --pp ≤ {most} to interleave, or --schedule 1f1b (--pp ≤ {})",
                    a.layers
                )
            } else {
                format!("use --pp ≤ {}", a.layers)
            };
            let room = if spare > 0 {
                format!(
                    " (interleaved, the first and last chunk may hold only the embedding and the head: at most {} chunks)",
                    u128::from(a.layers) + spare
                )
            } else {
                String::new()
            };
            return Err(Rejection::new(
                "more pipeline chunks than layers",
                format!(
                    "PP {} × virtual stages {} = {} chunks but the model has only {} layers{room}",
                    self.pp, self.virtual_stages, chunks, a.layers
                ),
            )
            .with_fix(fix));
        }
        if !t.global_batch.is_multiple_of(self.dp) {
            return Err(Rejection::new(
                "DP does not divide the global batch",
                format!(
                    "DP {} does not divide global_batch {}",
                    self.dp, t.global_batch
                ),
            )
            .with_fix(format!(
                "use a DP that divides global_batch {} (and PP × TP so that DP × PP × TP = {}), or change global_batch",
                t.global_batch, cluster.devices
            )));
        }
        let per_replica = t.global_batch / self.dp;
        if !per_replica.is_multiple_of(self.micro_batch) {
            return Err(Rejection::new(
                "micro-batch does not divide the per-replica batch",
                format!(
                    "micro-batch {} does not divide the {} sequences per DP replica",
                    self.micro_batch, per_replica
                ),
            )
            .with_fix(format!(
                "use a --micro-batch that divides {per_replica}{}",
                divisor_list(per_replica)
            )));
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
                    let ok: Vec<String> = (1..=per_replica.min(1 << 20))
                        .filter(|&b| {
                            per_replica.is_multiple_of(b)
                                && (per_replica / b).is_multiple_of(self.pp)
                        })
                        .take(8)
                        .map(|b| b.to_string())
                        .collect();
                    let fix = if ok.is_empty() {
                        format!(
                            "no micro-batch gives a multiple of PP {} micro-batches from the {per_replica} sequences per DP replica: use a smaller PP, a smaller DP, or 1f1b",
                            self.pp
                        )
                    } else {
                        format!(
                            "use --micro-batch {} (a multiple of PP {} micro-batches from the {per_replica} sequences per DP replica), or 1f1b",
                            ok.join(" | "),
                            self.pp
                        )
                    };
                    return Err(Rejection::new("interleaving needs micro-batches divisible by PP", format!(
                        "the interleaved schedule needs the {m} micro-batches to be a multiple of PP {}",
                        self.pp
                    )).with_fix(fix));
                }
            }
            kind @ (ScheduleKind::ZbV | ScheduleKind::DualPipe) => {
                let layers = model.architecture.layers;
                if self.virtual_stages != 2 {
                    return Err(Rejection::new(
                        "this schedule runs two chunks per stage",
                        format!(
                            "the {kind} schedule runs exactly 2 chunks per stage (virtual stages {})",
                            self.virtual_stages
                        ),
                    )
                    .with_fix("set --virtual-stages 2"));
                }
                let pieces = self.pieces().unwrap_or(u64::MAX);
                if layers < pieces {
                    return Err(Rejection::new(
                        "fewer layers than pipeline pieces",
                        format!(
                            "the {kind} schedule cuts the model into {pieces} pieces; the model has {layers} layers"
                        ),
                    )
                    .with_fix("use a smaller PP"));
                }
                let two_pp = self.pp.saturating_mul(2);
                if kind == ScheduleKind::DualPipe
                    && (!self.pp.is_multiple_of(2) || !m.is_multiple_of(2) || m < two_pp)
                {
                    return Err(Rejection::new(
                        "DualPipe needs an even PP and an even number of micro-batches, at least 2 × PP",
                        format!(
                            "the dualpipe schedule sends half the micro-batches each way and needs PP even and an even number of micro-batches ≥ 2 × PP (PP {}, {m} micro-batches)",
                            self.pp
                        ),
                    )
                    .with_fix(format!(
                        "use an even PP and a micro-batch that gives an even number of at least {two_pp} micro-batches, or 1f1b"
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

    /// Megatron-Core's rules for expert parallelism: EP only for an MoE model, dividing its
    /// routed experts (each EP rank holds E/EP whole experts) and the DP × CP ranks it is cut
    /// from (expert TP equal to TP: `world % (TP·EP·PP) == 0` with the CP ranks counted).
    /// And with expert TP equal to TP, TP divides each expert's FFN width.
    fn check_moe(&self, model: &Model) -> Result<(), Rejection> {
        let Some(moe) = &model.architecture.moe else {
            return Err(Rejection::new(
                "EP needs a mixture-of-experts model",
                format!(
                    "EP {} splits routed experts, and {} is dense (no `experts` key)",
                    self.ep, model.name
                ),
            )
            .with_fix("use --ep 1 (or leave it out) for a dense model".to_string()));
        };
        if self.ep == 0 || !moe.experts.is_multiple_of(self.ep) {
            return Err(Rejection::new(
                "EP does not divide the experts",
                format!(
                    "EP {} does not divide the {} routed experts of each MoE layer",
                    self.ep, moe.experts
                ),
            )
            .with_fix(format!(
                "use an EP that divides {}{}",
                moe.experts,
                divisor_list(moe.experts)
            )));
        }
        for (key, width) in [
            ("moe_ffn_hidden", moe.moe_ffn_hidden),
            ("shared_expert_ffn_hidden", moe.shared_expert_ffn_hidden),
        ] {
            if (key == "moe_ffn_hidden" || moe.shared_experts > 0) && !width.is_multiple_of(self.tp)
            {
                return Err(Rejection::new(
                    "TP does not divide the expert FFN width",
                    format!(
                        "TP {} (the experts' TP too) does not divide {key} {width}",
                        self.tp
                    ),
                )
                .with_fix(format!(
                    "use a TP that divides {key} {width}{}",
                    divisor_list(gcd(
                        width,
                        gcd(model.architecture.heads, model.architecture.kv_heads)
                    ))
                )));
            }
        }
        // Megatron-LM's arguments.py: "When using expert parallelism and tensor parallelism,
        // sequence parallelism must be used" (the dispatcher routes each TP rank's 1/TP of
        // the tokens).
        if self.ep > 1 && self.tp > 1 && !self.sequence_parallel {
            return Err(Rejection::new(
                "EP with TP needs sequence parallelism",
                format!(
                    "EP {} with TP {} routes each TP rank's share of the tokens, which needs sequence parallelism (Megatron-LM requires it)",
                    self.ep, self.tp
                ),
            )
            .with_fix("add --sp, or use --tp 1 or --ep 1".to_string()));
        }
        let group = self.dp.saturating_mul(self.cp.max(1));
        if !group.is_multiple_of(self.ep) {
            let cp = if self.cp > 1 {
                format!(" × CP {}", self.cp)
            } else {
                String::new()
            };
            return Err(Rejection::new(
                "EP does not divide DP × CP",
                format!(
                    "EP {} is cut from the DP {}{cp} = {group} ranks that hold the same dense weights, and does not divide them",
                    self.ep, self.dp
                ),
            )
            .with_fix(format!(
                "use an EP that divides both {} experts and DP × CP {group}{}",
                moe.experts,
                divisor_list(gcd(moe.experts, group))
            )));
        }
        Ok(())
    }

    /// The model as one rank of a context-parallel group sees its tokens: the sequence cut to
    /// its 1/CP share (the model itself where CP is 1). For what scales with the rank's tokens:
    /// linear and element-wise work, the embedding's and the head's activations, TP and PP
    /// messages, the CPU runtime's backward workspace.
    pub fn rank_tokens<'m>(&self, model: &'m Model) -> std::borrow::Cow<'m, Model> {
        if self.cp <= 1 {
            return std::borrow::Cow::Borrowed(model);
        }
        let mut m = model.clone();
        m.training.seq_len = model.training.seq_len / self.cp;
        std::borrow::Cow::Owned(m)
    }

    /// Bytes of one K/V block under context parallelism: K and V of this rank's tokens, its
    /// TP share of the KV heads (2·b·(s/CP)·kv_dim/TP elements of `element_bytes`). What the
    /// ring passes per step, and the unit of the exchange's buffers.
    pub fn cp_kv_block_bytes(&self, model: &Model, element_bytes: f64) -> f64 {
        let tokens = self.micro_batch as f64 * (model.training.seq_len / self.cp.max(1)) as f64;
        // K and V as attention reads them (under MLA, K of heads × (nope + rope) and V of
        // heads × v_head_dim; else kv_dim each).
        let w = crate::memory::stored::AttentionWidths::of(&model.architecture);
        tokens * (w.k + w.v) / self.tp.max(1) as f64 * element_bytes
    }

    /// Layers per virtual stage, in pipeline order: an even split, the remainder given to the
    /// later chunks (the first stage already carries the embedding and the most activations).
    /// Interleaved with layers that do not divide into the chunks, the stages are evened
    /// first, the first and last stages the ones left short ([`Layout::stage_split`]), and
    /// each stage's layers then spread over its chunks ([`Layout::chunk_split`]).
    /// Empty when the layout has no chunk (PP or v is 0); callers bound PP × v first (a
    /// layout that passes [`Layout::check`] has at most [`MAX_SIMULATED_PASSES`] chunks).
    pub fn split_layers(&self, layers: u64) -> Vec<u64> {
        let Some(chunks) = self.pieces().filter(|c| *c > 0) else {
            return Vec::new();
        };
        if chunks > self.pp && !layers.is_multiple_of(chunks) {
            return self.chunk_split(&self.stage_split(layers));
        }
        let base = layers / chunks;
        let extra = layers % chunks;
        (0..chunks)
            .map(|c| base + u64::from(c >= chunks - extra))
            .collect()
    }

    /// Layers per pipeline stage, as even as they go, with the stages that get one layer
    /// fewer taken from the ends first (last, then first, then from the end inwards): the
    /// first stage also holds the embedding and the last the output layer and loss (Llama
    /// 3's "first and last stage one layer short", Dubey et al. 2024 §3.3.2).
    pub fn stage_split(&self, layers: u64) -> Vec<u64> {
        let pp = self.pp.max(1);
        let base = layers / pp;
        let short = (pp - layers % pp) % pp;
        let mut per = vec![base + u64::from(!layers.is_multiple_of(pp)); pp as usize];
        // The order in which stages give up a layer: last, first, then inwards from the end.
        let n = pp as usize;
        let order = std::iter::once(n - 1)
            .chain((n > 1).then_some(0))
            .chain((1..n.saturating_sub(1)).rev());
        for s in order.take(short as usize) {
            per[s] -= 1;
        }
        per
    }

    /// Layers per piece (model order: chunk `c` of stage `s` holds [`Layout::piece`], `c·PP + s`
    /// unless zb-v or dualpipe) for the given layers per stage. Each stage spreads its layers evenly over its chunks; the
    /// chunks left a layer short are the first ones of the first stage (the embedding's
    /// chunk), the last ones of the last stage (the head's) and the first ones of the others.
    pub fn chunk_split(&self, per_stage: &[u64]) -> Vec<u64> {
        let (pp, v) = (per_stage.len(), self.virtual_stages.max(1) as usize);
        if self.schedule == ScheduleKind::DualPipe {
            // Each stage's pieces are its two directions' copies of the same layers.
            return per_stage.to_vec();
        }
        let mut split = vec![0; pp * v];
        for (s, &n) in per_stage.iter().enumerate() {
            let base = n / v as u64;
            let extra = (n % v as u64) as usize;
            for c in 0..v {
                let more = if s == pp - 1 && pp > 1 {
                    c < extra
                } else {
                    c >= v - extra
                };
                split[self.piece(s, c)] = base + u64::from(more);
            }
        }
        split
    }
}

fn one() -> u64 {
    1
}
