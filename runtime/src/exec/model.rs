//! One rank's share of the model, built from the plan: the chunks of its pipeline stage, each a
//! contiguous range of transformer blocks, plus the embedding on the first virtual stage and the
//! final norm, output layer and loss on the last.
//!
//! Parameters of all chunks live in one flat buffer (llm.c style), chunk after chunk, so that a
//! chunk's parameters are one contiguous region: ZeRO shards each region over the DP group.
//! Tensor names carry global layer indices, so every layout initialises the same model.

use std::ops::Range;

use std::sync::Arc;

use tessera_planner::finetune::{Lora, Method};
use tessera_planner::model::Architecture;
use tessera_planner::plan::Plan;

use crate::layers::lora::LoraSettings;
use crate::layers::nf4_base::Nf4Weights;
use crate::layers::{
    BlockConfig, ColumnParallelLinear, EpShard, LayerError, Norm, PositionEmbedding, TpShard,
    TransformerBlock, VocabParallelEmbedding,
};
use crate::params::ParamLayout;

/// The embedding of the first virtual stage.
pub struct Embedding {
    pub wte: VocabParallelEmbedding,
    pub wpe: Option<PositionEmbedding>,
}

/// The final norm and output layer of the last virtual stage.
pub struct Head {
    pub norm: Norm,
    pub proj: ColumnParallelLinear,
}

/// One model chunk (a virtual pipeline stage) on this rank.
pub struct Chunk {
    pub virtual_stage: usize,
    pub embedding: Option<Embedding>,
    pub blocks: Vec<TransformerBlock>,
    pub head: Option<Head>,
    /// This chunk's parameters in the rank's flat buffer: its dense parameters, then its
    /// routed experts' ([`Chunk::experts`]).
    pub region: Range<usize>,
    /// The end of `region` that holds this rank's routed experts (empty in a dense chunk):
    /// their gradients are summed over the expert-DP group, the rest over DP.
    pub experts: Range<usize>,
    /// Under adapter fine-tuning, where this chunk's routed experts sit in the frozen region
    /// (empty otherwise): like `experts`, held per expert-DP group rather than per DP group.
    pub frozen_experts: Range<usize>,
}

impl Chunk {
    /// The part of [`Chunk::region`] every DP × CP rank of the stage holds alike.
    pub fn dense(&self) -> Range<usize> {
        self.region.start..self.experts.start
    }
}

/// Everything one rank holds of the model.
pub struct StageModel {
    pub layout: ParamLayout,
    pub chunks: Vec<Chunk>,
    pub cfg: BlockConfig,
    /// Rows of the embedding table and output layer: the model's vocabulary padded to the
    /// plan's multiple (`Architecture::padded_vocab`).
    pub vocab: usize,
    /// The real (not padding) rows of this TP rank's vocabulary shard: the output layer
    /// computes logits for these only, so padding rows are never in the softmax and every
    /// padding gives the same model.
    pub vocab_real: usize,
    /// The last stage's copy of a tied embedding table living on stage 0 (PP > 1): its
    /// gradient is summed with stage 0's and it is counted once in the gradient norm.
    pub tied_copy: Option<Range<usize>>,
    /// Adapter fine-tuning: only the LoRA adapters train. Every other tensor sits in the
    /// layout's frozen region, past [`ParamLayout::trainable_len`], with no gradient.
    pub adapters: bool,
}

/// Name of the token embedding table (shared by a tied output layer).
pub const WTE: &str = "wte";

fn us(v: u64) -> usize {
    usize::try_from(v).expect("model dimensions fit in memory")
}

impl StageModel {
    /// Builds the chunks `stage` holds under `plan`, with `tp` its tensor-parallel shard (and
    /// the first 1/EP of each MoE layer's experts).
    pub fn build(plan: &Plan, stage: usize, tp: TpShard) -> Result<StageModel, LayerError> {
        let ep = EpShard {
            rank: 0,
            size: plan.parallel.ep.max(1) as usize,
        };
        Self::build_on(plan, stage, tp, ep)
    }

    /// [`build`](Self::build) for the rank holding the experts of `ep`.
    pub fn build_on(
        plan: &Plan,
        stage: usize,
        tp: TpShard,
        ep: EpShard,
    ) -> Result<StageModel, LayerError> {
        let p = &plan.parallel;
        let a = &plan.job.model.architecture;
        let chunks = &plan.stages[stage].chunks;
        let m = &plan.job.model;
        let lora = match (m.training.method.adapters(), &m.lora) {
            (false, _) => None,
            (true, Some(l)) => Some(LoraSettings::from_plan(l)?),
            (true, None) => {
                return Err(LayerError::Config(
                    "the plan trains adapters but has no [lora] settings".into(),
                ))
            }
        };
        let qlora = m.training.method == Method::Qlora;
        built(lora.as_ref(), |mut layout| {
            let (pp, sp) = (p.pp as usize, p.sequence_parallel);
            layout.set_nf4_linears(qlora);
            Self::build_chunks(a, chunks, pp, sp, tp, ep, layout, lora.as_ref())
        })
    }

    /// The whole model on one rank (TP 1, one stage): what a checkpoint's forward runs.
    pub fn whole(a: &Architecture) -> Result<StageModel, LayerError> {
        Self::whole_with(a, None)
    }

    /// [`whole`](Self::whole) with the adapters of `lora` on its frozen base (a LoRA
    /// checkpoint's tensors).
    pub fn whole_with(a: &Architecture, lora: Option<&Lora>) -> Result<StageModel, LayerError> {
        Self::whole_of(a, lora, false)
    }

    /// [`whole_with`](Self::whole_with), the blocks' linears in NF4 when `nf4` (QLoRA).
    pub fn whole_of(
        a: &Architecture,
        lora: Option<&Lora>,
        nf4: bool,
    ) -> Result<StageModel, LayerError> {
        let chunk = tessera_planner::plan::Chunk {
            chunk: 0,
            virtual_stage: 0,
            layers: [0, a.layers],
            embedding: true,
            head: true,
        };
        let s = lora.map(LoraSettings::from_plan).transpose()?;
        let (tp, ep) = (TpShard::new(0, 1), EpShard::SINGLE);
        let chunks = std::slice::from_ref(&chunk);
        built(s.as_ref(), |mut layout| {
            layout.set_nf4_linears(nf4);
            Self::build_chunks(a, chunks, 1, false, tp, ep, layout, s.as_ref())
        })
    }

    /// Builds `chunks` of a model of `pp` stages, with `tp` its tensor-parallel shard, into
    /// `layout` (a freezing one with `lora`; its blocks' linears in NF4 if it says
    /// [`ParamLayout::nf4_linears`]).
    #[allow(clippy::too_many_arguments)]
    fn build_chunks(
        a: &Architecture,
        chunks_of_stage: &[tessera_planner::plan::Chunk],
        pp: usize,
        sequence_parallel: bool,
        tp: TpShard,
        ep: EpShard,
        mut layout: ParamLayout,
        lora: Option<&LoraSettings>,
    ) -> Result<StageModel, LayerError> {
        // NF4 for the blocks' linears only: embeddings, norms, biases and the head stay f32.
        let nf4 = layout.nf4_linears();
        layout.set_nf4_linears(false);
        let cfg = BlockConfig::from_architecture(a)?;
        let (c, vocab) = (us(a.hidden), us(a.padded_vocab(tp.size as u64)));
        let local = vocab / tp.size;
        let vocab_real = us(a.vocab).saturating_sub(tp.rank * local).min(local);
        let mut chunks = Vec::new();
        let mut tied_copy = None;
        for ch in chunks_of_stage {
            let start = layout.trainable_len();
            let embedding = if ch.embedding {
                let wte = VocabParallelEmbedding::new(&mut layout, WTE, vocab, c, tp, 0.02)?;
                let wpe = match cfg.rope_theta {
                    None => Some(PositionEmbedding::new(
                        &mut layout,
                        "wpe",
                        us(a.max_positions),
                        c,
                        0.01,
                    )?),
                    Some(_) => None,
                };
                Some(Embedding { wte, wpe })
            } else {
                None
            };
            // Routed experts go to a layout of their own, appended after the chunk's dense
            // parameters (after its frozen ones when the base is frozen).
            let mut expert_layout = match layout.freezing() {
                true => ParamLayout::frozen_at(0),
                false => ParamLayout::new(),
            };
            layout.set_nf4_linears(nf4);
            let mut blocks = (ch.layers[0]..ch.layers[1])
                .map(|l| {
                    let prefix = format!("h.{l}");
                    let mut b = match &a.moe {
                        Some(m) if m.is_moe_layer(l) => TransformerBlock::new_moe(
                            &mut layout,
                            &mut expert_layout,
                            &prefix,
                            &cfg,
                            m,
                            tp,
                            ep,
                        )?,
                        _ => TransformerBlock::new(&mut layout, &prefix, &cfg, tp)?,
                    };
                    if let Some(l) = lora {
                        crate::layers::lora_attach::attach(&mut layout, &mut b, &prefix, l)?;
                    }
                    b.sequence_parallel = sequence_parallel;
                    Ok(b)
                })
                .collect::<Result<Vec<_>, LayerError>>()?;
            layout.set_nf4_linears(false);
            let head = if ch.head {
                let norm = Norm::new(&mut layout, "ln_f", cfg.norm, c, cfg.norm_eps)?;
                let proj = if a.tied_embeddings {
                    let table = match &embedding {
                        Some(e) => e.wte.w,
                        None => {
                            // Same name as stage 0's table: the same initial values by global
                            // index. Under ZB-V the table is in this rank's first chunk.
                            let here = chunks.iter().any(|c: &Chunk| c.embedding.is_some());
                            let copy = VocabParallelEmbedding::new_or_copy(
                                &mut layout,
                                WTE,
                                vocab,
                                c,
                                tp,
                                0.02,
                                here,
                            )?;
                            debug_assert!(pp > 1);
                            tied_copy = Some(copy.w.range());
                            copy.w
                        }
                    };
                    let mut proj = ColumnParallelLinear::tied(table, c);
                    proj.frozen = layout.freezing();
                    proj
                } else {
                    ColumnParallelLinear::new(&mut layout, "lm_head", c, vocab, false, tp, 0.02)?
                }
                .first_rows(vocab_real);
                Some(Head { norm, proj })
            } else {
                None
            };
            let len = expert_layout.len();
            let base = layout.append(expert_layout)?;
            // Trainable experts end the trainable prefix; frozen ones (under adapters) sit in
            // the frozen region and have no gradient to synchronise.
            let (experts, frozen_experts) = match layout.freezing() {
                false => (base..layout.trainable_len(), base..base),
                true => (
                    layout.trainable_len()..layout.trainable_len(),
                    base..base + len,
                ),
            };
            for b in &mut blocks {
                if let Some(m) = b.mlp.moe_mut() {
                    m.expert_base = base;
                }
            }
            chunks.push(Chunk {
                virtual_stage: ch.virtual_stage as usize,
                embedding,
                blocks,
                head,
                region: start..layout.trainable_len(),
                experts,
                frozen_experts,
            });
        }
        Ok(StageModel {
            layout,
            chunks,
            cfg,
            vocab,
            vocab_real,
            tied_copy,
            adapters: lora.is_some(),
        })
    }
}

impl StageModel {
    /// The flat ranges of every norm's parameters on this stage. Under sequence parallelism
    /// each TP rank computes their gradients from its own rows, so these are summed over TP.
    pub fn norm_ranges(&self) -> Vec<Range<usize>> {
        let norms = self.chunks.iter().flat_map(|c| {
            c.blocks
                .iter()
                .flat_map(|b| [&b.ln1, &b.ln2])
                .chain(c.head.as_ref().map(|h| &h.norm))
        });
        norms
            .filter(|n| !n.frozen)
            .flat_map(|n| std::iter::once(n.w.range()).chain(n.b.map(|b| b.range())))
            .collect()
    }

    /// The gradient ranges summed over TP (of `tp` ranks) at the end of a step: the
    /// sequence-parallel norms' and the adapters' partial sums.
    pub fn tp_summed(&self, sequence_parallel: bool, tp: usize) -> Vec<Range<usize>> {
        if tp == 1 {
            return Vec::new();
        }
        let mut r = match sequence_parallel {
            true => self.norm_ranges(),
            false => Vec::new(),
        };
        r.extend(self.adapter_tp_ranges());
        r
    }

    /// QLoRA: the NF4 weights of every linear of this rank's blocks, in model order.
    pub fn nf4_weights(&self) -> impl Iterator<Item = &Arc<Nf4Weights>> {
        self.chunks
            .iter()
            .flat_map(|c| c.blocks.iter())
            .flat_map(|b| {
                let mlp = b.mlp.dense();
                [
                    b.attn.qkv.nf4.as_ref(),
                    b.attn.proj.nf4.as_ref(),
                    mlp.and_then(|m| m.fc.nf4.as_ref()),
                    mlp.and_then(|m| m.proj.nf4.as_ref()),
                ]
            })
            .flatten()
    }

    /// Bytes of the NF4 base this rank holds (codes and block scales).
    pub fn nf4_bytes(&self) -> usize {
        self.nf4_weights().map(|w| w.bytes()).sum()
    }

    /// The flat ranges of the adapter tensors replicated over TP whose gradients are partial
    /// sums per TP rank (`Adapter::tp_summed`), in order.
    pub fn adapter_tp_ranges(&self) -> Vec<Range<usize>> {
        let blocks = self.chunks.iter().flat_map(|c| c.blocks.iter());
        blocks
            .flat_map(crate::layers::lora_attach::adapters)
            .map(|a| a.tp_summed().range())
            .collect()
    }
}

/// The model `build` makes into a fresh layout; with adapters, built twice: once to learn
/// how many elements the adapters take, then with the frozen base packed right after them.
fn built(
    lora: Option<&LoraSettings>,
    build: impl Fn(ParamLayout) -> Result<StageModel, LayerError>,
) -> Result<StageModel, LayerError> {
    match lora {
        None => build(ParamLayout::new()),
        Some(_) => {
            let trainable = build(ParamLayout::frozen_at(0))?.layout.trainable_len();
            build(ParamLayout::frozen_at(trainable))
        }
    }
}

/// The part of `region` that DP rank `r` of `n` owns under ZeRO: equal shards of
/// `ceil(len / n)` elements (the last ones may be short or empty).
pub fn shard_of(region: &Range<usize>, n: usize, r: usize) -> Range<usize> {
    let len = region.end - region.start;
    let s = len.div_ceil(n.max(1));
    let a = (region.start + r * s).min(region.end);
    let b = (region.start + (r + 1) * s).min(region.end);
    a..b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_a_region_once() {
        for len in [0usize, 1, 7, 8, 9, 100] {
            for n in 1..=5 {
                let region = 10..10 + len;
                let mut covered = Vec::new();
                for r in 0..n {
                    covered.extend(shard_of(&region, n, r));
                }
                assert_eq!(
                    covered,
                    region.clone().collect::<Vec<_>>(),
                    "len {len} n {n}"
                );
            }
        }
    }
}
