//! One rank's training loop: execute the schedule's op list, then sync and step.
//!
//! The op list comes from `tessera_planner::schedule::build`, the same function the planner
//! simulates; this file interprets it literally (buffered sends, blocking receives) and never
//! re-derives the order. Collectives are issued in the same order on every rank of a group.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::mpsc;
use std::time::Instant;

use tessera_planner::layout::Recompute;
use tessera_planner::plan::Plan;
use tessera_planner::schedule::{self, Op};
use tessera_planner::Mesh;

use super::model::{shard_of, StageModel};
use super::offload::States;
use super::trace::TraceEvent;
use super::{RunError, StepMetrics, TrainOptions};
use crate::backend::{Backend, Collective, Storage};
use crate::checkpoint::Saver;
use crate::comm::Comm;
use crate::data::{Sampler, Tokens};
use crate::layers::context_parallel::CpComm;
use crate::layers::dropout::{DropCall, DropoutRates};
use crate::layers::moe::EpComm;
use crate::layers::tp::{gather_rows, scatter_rows};
use crate::layers::{
    vocab_parallel_cross_entropy_forward, BlockActs, BlockWorkspace, Dims, EpShard, MoeWorkspace,
    TpShard, WeightStash,
};
use crate::optim::LrSchedule;
use crate::params::ParamLayout;
use backward::take_input;

/// Everything a rank needs: the plan, its backend and groups, the data and the options.
pub struct RankCtx<'a, B: Backend, C: Collective<B>> {
    pub plan: &'a Plan,
    pub rank: usize,
    pub mesh: Mesh,
    pub be: &'a B,
    pub tp: &'a C,
    pub dp: &'a C,
    pub pp: &'a C,
    /// Stage 0 ↔ last stage, for a tied embedding table split over PP.
    pub embedding: Option<&'a C>,
    /// The ranks holding the same routed experts (`Mesh::expert_dp_group`), for an MoE model:
    /// they sum (or ZeRO-shard) the experts' gradients.
    pub expert_dp: Option<&'a C>,
    pub data: &'a Tokens,
    pub opts: &'a TrainOptions,
    pub epoch: Instant,
    pub metrics: &'a mpsc::Sender<StepMetrics>,
    /// Where this run's checkpoints go, if it saves.
    pub saver: Option<&'a Saver>,
}

/// What a rank hands back.
pub struct RankResult {
    pub steps: Vec<StepMetrics>,
    pub layout: ParamLayout,
    pub params: Vec<f32>,
    pub trace: Vec<TraceEvent>,
    /// Peak bytes the rank's thread held during the training steps (0 without the tracking
    /// allocator).
    pub peak_bytes: u64,
    /// QLoRA: the NF4 weights' dequantized shards (`(box, values)`), and the bytes the rank
    /// holds of them in NF4.
    pub nf4: Vec<(crate::params::ParamInfo, Vec<f32>)>,
    pub nf4_bytes: u64,
}

/// What the head keeps between a micro-batch's forward and backward.
struct HeadActs<B: Backend> {
    x: B::Buf,      // (rows, C) the final norm's input
    h: B::Buf,      // (rows, C) its output
    mean: B::Buf,   // (rows)
    rstd: B::Buf,   // (rows)
    logits: B::Buf, // (N, V_local)
    max: B::Buf,    // (N) global row statistics
    sumexp: B::Buf, // (N)
    /// The micro-batch's target ids, as the forward uploaded them.
    targets: B::Ids,
}

/// What one (micro-batch, chunk) keeps between forward and backward.
struct ChunkActs<B: Backend> {
    blocks: Vec<BlockActs<B>>,
    head: Option<HeadActs<B>>,
    /// The micro-batch's input ids, on the chunk that embeds them (as the forward uploaded
    /// them, for the embedding backward).
    inputs: Option<B::Ids>,
    /// The draw of the micro-batch's dropout masks (`None`: no dropout).
    drop: Option<DropCall>,
}

type Key = (usize, usize);

/// The groups of an MoE model's rank: EP (the token all-to-all, on the backend's buffers) and,
/// with CP, the host CP group its load-balancing statistics are summed over.
pub struct MoeComms<B: Backend> {
    pub ep: EpComm<B>,
    pub cp: Option<Box<dyn Comm + Send>>,
}

/// Runs the whole training on this rank; `cp`: its CP group when the plan has CP > 1; `moe`:
/// its MoE groups when the model has MoE layers.
pub fn run<B: Backend, C: Collective<B>>(
    ctx: &RankCtx<'_, B, C>,
    cp: Option<CpComm<B>>,
    moe: Option<MoeComms<B>>,
) -> Result<RankResult, RunError> {
    let setup = crate::alloc::tagged(crate::alloc::Tag::Setup);
    let mut r = Rank::new(ctx, cp, moe)?;
    drop(setup);
    // The measured peak is the training steps': the setup's transients (initial weights built
    // whole, a checkpoint's tensors read) are not what a step holds.
    crate::alloc::reset_peak(ctx.rank);
    let mut steps = Vec::new();
    // Steps completed, and the last of them that a checkpoint holds.
    let first = ctx.opts.resume.as_ref().map_or(0, |c| c.step());
    let (mut done, mut saved) = (first, first);
    for step in first..ctx.opts.steps {
        if ctx.opts.stop.as_ref().is_some_and(|s| !s.may_start(step)) {
            break;
        }
        if let Some(f) = &ctx.opts.fault {
            f.strike(ctx.rank, step)?;
        }
        let start = Instant::now();
        let loss = r.step(step)?;
        let step_time_s = start.elapsed().as_secs_f64();
        let val_loss = match &ctx.opts.eval {
            Some(e) if e.due(step + 1, ctx.opts.steps) => r.evaluate()?,
            _ => None,
        };
        if let Some(loss) = loss {
            let t = &ctx.plan.job.model.training;
            let tokens = t.global_batch * t.seq_len;
            let m = StepMetrics {
                step,
                loss,
                step_time_s,
                tokens_per_s: tokens as f64 / step_time_s,
                lr: f64::from(r.lr.lr(step)),
                grad_norm: r.grad_norm,
                tokens_seen: tokens * (step as u64 + 1),
                val_loss,
            };
            ctx.metrics.send(m.clone()).ok();
            steps.push(m);
        }
        done = step + 1;
        if let Some(saver) = ctx.saver.filter(|s| s.due(done)) {
            r.save(saver, done)?;
            saved = done;
        }
    }
    if let Some(saver) = ctx.saver.filter(|_| done != saved) {
        r.save(saver, done)?;
    }
    // The training steps' peak, before the final gather and download below add their copies.
    let peak_bytes = crate::alloc::peak_bytes(ctx.rank);
    if crate::alloc::breakdown_on() {
        let parts = crate::alloc::peak_by_tag(ctx.rank);
        let parts: Vec<_> = parts.iter().map(|(n, b)| format!("{n} {b}")).collect();
        eprintln!(
            "rank {} peak {peak_bytes} B: {}",
            ctx.rank,
            parts.join(", ")
        );
    }
    if r.zero == 3 {
        for c in 0..r.model.chunks.len() {
            r.gather_region(c)?;
        }
    }
    let params = ctx.be.download(B::view(&r.params))?;
    let nf4 = super::nf4::dequantized(&r.model)?;
    Ok(RankResult {
        steps,
        nf4_bytes: r.model.nf4_bytes() as u64,
        layout: r.model.layout,
        params,
        trace: r.trace,
        peak_bytes,
        nf4,
    })
}

/// A padded region and one shard of it (ZeRO's reduce-scatter and all-gather buffers).
struct ShardBufs<B: Backend> {
    padded: Option<B::Buf>,
    shard: Option<B::Buf>,
}

impl<B: Backend> Default for ShardBufs<B> {
    fn default() -> Self {
        ShardBufs {
            padded: None,
            shard: None,
        }
    }
}

struct Rank<'a, B: Backend, C: Collective<B>> {
    ctx: &'a RankCtx<'a, B, C>,
    be: &'a B,
    model: StageModel,
    tp: TpShard,
    stage: usize,
    /// This rank's index in, and the size of, the group holding the same weights (DP, or
    /// DP × CP under context parallelism): gradient sync and ZeRO shards.
    dp_rank: usize,
    dp: usize,
    /// The same for the routed experts: the expert-DP group (`dp`, `dp_rank` without EP).
    edp_rank: usize,
    edp: usize,
    zero: u8,
    /// A micro-batch on this rank: `T/CP` tokens of each sequence under context parallelism.
    dims: Dims,
    /// This rank's place in its CP group (CP > 1).
    cp: Option<cp::CpRank>,
    ops: Vec<Op>,
    /// The weights the kernels read (working precision).
    params: B::Buf,
    grads: B::Buf,
    /// The f32 master weights and Adam moments, on the backend or offloaded to the host.
    states: States<B>,
    lr: LrSchedule,
    /// The last step's global gradient norm, before clipping (`sync::sync_and_update`).
    grad_norm: f64,
    sampler: Sampler,
    ws: BlockWorkspace<B>,
    acts: HashMap<Key, ChunkActs<B>>,
    pool: Vec<Vec<ChunkActs<B>>>,
    inbox: HashMap<Key, B::Buf>,
    outbox: HashMap<Key, B::Buf>,
    /// Zero-bubble schedules: the weight gradients each B pass deferred, until its W pass,
    /// and the spare stashes (their buffers reused from one micro-batch to the next).
    waiting: HashMap<Key, WeightStash<B>>,
    stashes: Vec<WeightStash<B>>,
    /// ZeRO buffers, kept between steps so the step allocates nothing: a padded copy of a
    /// region (for regions whose length DP does not divide) and one DP shard of a region, for
    /// the gradients (f32, reduce-scatter) and for the weights (working precision, all-gather).
    grad_bufs: ShardBufs<B>,
    param_bufs: ShardBufs<B>,
    /// Gradients summed over TP at the end of a step: the norms' under sequence parallelism
    /// (each TP rank computes them from its own rows), else none.
    tp_summed: Vec<Range<usize>>,
    /// Per chunk: the index in `ops` of its last backward, or, split, its last B or W (its
    /// gradients are final there), and
    /// whether this step's DP sum of them has started (see `sync::chunk_grads_done`).
    last_backward: Vec<Option<usize>>,
    bucketed: Vec<bool>,
    trace: Vec<TraceEvent>,
    loss_sum: f64,
    /// The load-balancing losses of this step's MoE forwards, summed over the stages
    /// (`MoeWorkspace::take_aux`); the reported loss adds their mean over micro-batches.
    aux_sum: f64,
    /// The eval batch being computed, while `evaluate` runs (`eval.rs`).
    eval_batch: Option<usize>,
    /// The run's dropout rates (`dropout.rs`).
    drop: DropoutRates,
}

impl<'a, B: Backend, C: Collective<B>> Rank<'a, B, C> {
    fn new(
        ctx: &'a RankCtx<'a, B, C>,
        cp: Option<CpComm<B>>,
        moe: Option<MoeComms<B>>,
    ) -> Result<Self, RunError> {
        let (plan, be) = (ctx.plan, ctx.be);
        let p = &plan.parallel;
        let coord = ctx.mesh.coord(ctx.rank as u64);
        let stage = coord.pp as usize;
        let tp = TpShard::new(ctx.tp.rank(), ctx.tp.size());
        let ep = EpShard {
            rank: ctx.mesh.ep_rank(ctx.rank as u64) as usize,
            size: ctx.mesh.ep as usize,
        };
        let mut model = StageModel::build_on(plan, stage, tp, ep)?;
        let drop = ctx.opts.dropout(plan);
        dropout::set_rates(&mut model, plan, stage, &drop);
        let t = &plan.job.model.training;
        // One micro-batch's load-balancing loss weighs 1 / (micro-batches per global batch).
        let aux_scale = p.micro_batch as f64 / t.global_batch as f64;
        for b in model.chunks.iter_mut().flat_map(|c| c.blocks.iter_mut()) {
            if let Some(m) = b.mlp.moe_mut() {
                m.aux_scale = aux_scale;
            }
        }
        let dims = Dims {
            b: p.micro_batch as usize,
            t: t.seq_len as usize / p.cp.max(1) as usize,
        };
        let (mut ws, cp) = cp::stage_workspace(be, &mut model, dims, stage, cp)?;
        if let Some(m) = moe {
            ws.moe = Some(MoeWorkspace::new(Some(m.ep), m.cp));
        }
        let schedule = schedule::build(
            p.schedule,
            p.pp as usize,
            p.microbatches as usize,
            p.virtual_stages as usize,
        )
        .map_err(|e| RunError::Unsupported {
            what: format!("the plan's schedule cannot be built: {e}"),
            fix: "re-create the plan with `tessera plan`".into(),
        })?;
        let ops = schedule.stages[stage].clone();
        let (dp, dp_rank, zero) = (ctx.dp.size(), ctx.dp.rank(), p.zero_stage);
        let (edp, edp_rank) = ctx
            .expert_dp
            .map_or((dp, dp_rank), |c| (c.size(), c.rank()));
        let has_experts = model.chunks.iter().any(|c| !c.experts.is_empty());
        let ranges: Vec<Range<usize>> = match (zero, has_experts) {
            (0, false) => std::iter::once(0..model.layout.trainable_len()).collect(),
            // Dense and expert parameters are summed over different groups: one optimizer range
            // each, so a checkpoint can tell which ranks write them.
            (0, true) => model
                .chunks
                .iter()
                .flat_map(|c| [c.dense(), c.experts.clone()])
                .filter(|r| !r.is_empty())
                .collect(),
            (_, false) => model
                .chunks
                .iter()
                .map(|c| shard_of(&c.region, dp, dp_rank))
                .collect(),
            (_, true) => model
                .chunks
                .iter()
                .flat_map(|c| {
                    [
                        shard_of(&c.dense(), dp, dp_rank),
                        shard_of(&c.experts, edp, edp_rank),
                    ]
                })
                .collect(),
        };
        // Trainable parameters only: a frozen base sits past them, with no gradient.
        let grads = be.alloc(Storage::F32, model.layout.trainable_len())?;
        let cfg = ctx.opts.adamw(plan);
        let offload = super::offload::offloaded(plan);
        let (params, states) =
            ckpt::initial_state(be, ctx.opts, &model.layout, ranges, cfg, offload)?;
        super::nf4::load_base(&model, ctx.opts)?;
        let chunks = model.chunks.len();
        let mut last_backward = vec![None; chunks];
        for (i, op) in ops.iter().enumerate() {
            if let Some(chunk) = writes_grads(op) {
                *last_backward.get_mut(chunk).ok_or_else(|| {
                    schedule_bug(format!("a backward of chunk {chunk}, of {chunks} here"))
                })? = Some(i);
            }
        }
        let mut r = Rank {
            ctx,
            be,
            tp,
            stage,
            dp_rank,
            dp,
            edp_rank,
            edp,
            zero,
            dims,
            cp,
            ops,
            params,
            grads,
            states,
            lr: ctx.opts.lr_schedule(plan),
            grad_norm: 0.0,
            sampler: Sampler {
                seed: ctx
                    .opts
                    .resume
                    .as_ref()
                    .map_or(ctx.opts.seed, |c| c.sampler_seed()),
                seq_len: t.seq_len as usize,
                global_batch: t.global_batch as usize,
            },
            ws,
            acts: HashMap::new(),
            pool: (0..chunks).map(|_| Vec::new()).collect(),
            inbox: HashMap::new(),
            outbox: HashMap::new(),
            waiting: HashMap::new(),
            stashes: Vec::new(),
            grad_bufs: ShardBufs::default(),
            param_bufs: ShardBufs::default(),
            tp_summed: model.tp_summed(p.sequence_parallel, tp.size),
            last_backward,
            bucketed: vec![false; chunks],
            trace: Vec::new(),
            loss_sum: 0.0,
            aux_sum: 0.0,
            eval_batch: None,
            drop,
            model,
        };
        if zero == 3 {
            for c in 0..chunks {
                r.release_region(c)?;
            }
        }
        Ok(r)
    }

    /// One optimizer step; returns the mean loss on the rank that reports it.
    fn step(&mut self, step: usize) -> Result<Option<f64>, RunError> {
        self.be.fill(B::view_mut(&mut self.grads), 0.0)?;
        self.loss_sum = 0.0;
        self.bucketed.fill(false);
        let ops = std::mem::take(&mut self.ops);
        for (i, op) in ops.iter().enumerate() {
            let start = self.ctx.epoch.elapsed();
            self.op(*op, step as u64)?;
            if let Some(chunk) = writes_grads(op) {
                if self.last_backward[chunk] == Some(i) {
                    self.chunk_grads_done(chunk)?;
                }
            }
            if self.ctx.opts.trace {
                self.trace.push(TraceEvent::op(
                    self.ctx.rank,
                    step,
                    op,
                    start,
                    self.ctx.epoch.elapsed(),
                ));
            }
        }
        self.ops = ops;
        if let Some((mb, chunk)) = self.waiting.keys().next() {
            return Err(schedule_bug(format!(
                "never runs the weight gradients of micro-batch {mb} of chunk {chunk}"
            )));
        }
        let start = self.ctx.epoch.elapsed();
        let sync = crate::alloc::tagged(crate::alloc::Tag::Sync);
        self.sync_and_update(step)?;
        drop(sync);
        if let Some(m) = self.ws.moe.as_mut() {
            // Every stage's MoE layers, summed where the loss is reported.
            let aux = m.take_aux();
            self.aux_sum = self.ctx.pp.all_reduce_f64(aux)?;
        }
        if self.ctx.opts.trace {
            self.trace.push(TraceEvent::named(
                self.ctx.rank,
                step,
                "dp sync + optimizer",
                "optimizer",
                start,
                self.ctx.epoch.elapsed(),
            ));
        }
        if !self.holds_head() {
            return Ok(None);
        }
        let total = self.ctx.dp.all_reduce_f64(self.loss_sum)?;
        let c = self.ctx.mesh.coord(self.ctx.rank as u64);
        let t = &self.ctx.plan.job.model.training;
        let mut mean = total / (t.global_batch * t.seq_len) as f64;
        if self.ws.moe.is_some() {
            // Each micro-batch's load-balancing loss, averaged over the global batch's.
            let aux = self.ctx.dp.all_reduce_f64(self.aux_sum)?;
            let p = &self.ctx.plan.parallel;
            mean += aux * p.micro_batch as f64 / t.global_batch as f64;
        }
        // Every rank of the head's stage holds the same sum; the other stages learn of the stop
        // when their next step's partner is gone.
        if !mean.is_finite() {
            return Err(RunError::NonFinite {
                step,
                what: "loss",
                value: mean,
            });
        }
        Ok((c.dp == 0 && c.cp == 0 && c.tp == 0).then_some(mean))
    }

    /// Whether this rank computes the loss: the last stage's, or PP rank 0's under ZB-V (whose
    /// second chunk is the model's last piece).
    fn holds_head(&self) -> bool {
        self.model.chunks.iter().any(|c| c.head.is_some())
    }

    /// Rows of the activations this rank holds between layers (all `B·T`, or its share
    /// under sequence parallelism), and the first of them.
    fn rows(&self) -> (usize, usize) {
        let sp = self.ctx.plan.parallel.sequence_parallel;
        let rows = self.dims.rows(self.tp.size, sp);
        (rows, if sp { self.tp.rank * rows } else { 0 })
    }

    fn op(&mut self, op: Op, step: u64) -> Result<(), RunError> {
        let n = self.rows().0 * self.model.cfg.hidden;
        let _tag = crate::alloc::tagged(match op {
            Op::Forward { .. } => crate::alloc::Tag::Forward,
            Op::Backward { .. } | Op::BackwardInput { .. } | Op::BackwardWeight { .. } => {
                crate::alloc::Tag::Backward
            }
            _ => crate::alloc::Tag::P2p,
        });
        match op {
            Op::RecvActivation { mb, chunk, peer } | Op::RecvGrad { mb, chunk, peer } => {
                let mut buf = self.be.alloc(Storage::Bf16, n)?;
                self.ctx.pp.recv(B::view_mut(&mut buf), peer)?;
                self.inbox.insert((mb, chunk), buf);
            }
            Op::SendActivation { mb, chunk, peer } | Op::SendGrad { mb, chunk, peer } => {
                let buf = self.outbox.remove(&(mb, chunk)).ok_or_else(|| {
                    schedule_bug(format!("sends micro-batch {mb} before computing it"))
                })?;
                self.ctx.pp.send(B::view(&buf), peer)?;
            }
            Op::Forward { mb, chunk } => self.forward(mb, chunk, step)?,
            Op::Backward { mb, chunk } => self.backward(mb, chunk, false)?,
            Op::BackwardInput { mb, chunk } => self.backward(mb, chunk, true)?,
            Op::BackwardWeight { mb, chunk } => self.backward_weight(mb, chunk)?,
        }
        Ok(())
    }

    fn new_acts(&self, chunk: usize) -> Result<ChunkActs<B>, RunError> {
        let p = &self.ctx.plan.parallel;
        let first = self.ctx.plan.stages[self.stage].chunks[chunk].layers[0] as usize;
        let every = p.recompute_every.max(1) as usize;
        let blocks = self.model.chunks[chunk]
            .blocks
            .iter()
            .enumerate()
            .map(|(i, b)| {
                // Full recompute of every N-th layer: layers N, 2N, … counting from 1.
                let recompute = match p.recompute {
                    Recompute::Full if !(first + i + 1).is_multiple_of(every) => Recompute::None,
                    r => r,
                };
                BlockActs::new(self.be, b, self.dims, recompute)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ChunkActs {
            blocks,
            head: None,
            inputs: None,
            drop: None,
        })
    }

    fn forward(&mut self, mb: usize, chunk: usize, step: u64) -> Result<(), RunError> {
        if self.zero == 3 {
            self.gather_region(chunk)?;
        }
        let be = self.be;
        let (n, c) = (self.dims.n(), self.model.cfg.hidden);
        let ((rows, first), sp) = (self.rows(), self.ctx.plan.parallel.sequence_parallel);
        let tp = self.ctx.tp;
        let mut acts = match self.pool[chunk].pop() {
            Some(a) => a,
            None => self.new_acts(chunk)?,
        };
        let call = self.drop_call(step, mb);
        acts.drop = call;
        acts.blocks.iter_mut().for_each(|a| a.drop = call);
        let ch = &self.model.chunks[chunk];
        let p = B::view(&self.params);
        let (v, m) = (B::view, B::view_mut);
        let mut x = match &ch.embedding {
            Some(e) => {
                let (inputs, _) = self.tokens(step, mb);
                let inputs = be.ids(inputs)?;
                let mut x = be.alloc(Storage::Bf16, rows * c)?;
                if sp {
                    let mut partial = be.alloc(Storage::Bf16, n * c)?;
                    e.wte.forward_partial(be, p, &inputs, m(&mut partial))?;
                    scatter_rows(tp, v(&partial), m(&mut x))?;
                } else {
                    e.wte.forward(be, p, &inputs, m(&mut x), tp)?;
                }
                if let Some(wpe) = &e.wpe {
                    let cp = self.cp.as_ref();
                    cp::add_positions(be, wpe, p, m(&mut x), self.dims.t, first, cp)?;
                }
                dropout::drop_embedding::<B>(self.drop.embedding, c, m(&mut x), call, first)?;
                acts.inputs = Some(inputs);
                x
            }
            None => take_input::<B>(
                &mut self.inbox,
                &mut self.outbox,
                &self.model.chunks,
                (mb, chunk),
                true,
            )
            .ok_or_else(|| {
                schedule_bug(format!("computes micro-batch {mb} before receiving it"))
            })?,
        };
        for (blk, a) in ch.blocks.iter().zip(acts.blocks.iter_mut()) {
            let mut out = be.alloc(Storage::Bf16, rows * c)?;
            blk.forward(be, p, v(&x), m(&mut out), a, &mut self.ws, tp)?;
            x = out;
        }
        match &ch.head {
            Some(head) => {
                let (_, targets) = self.tokens(step, mb);
                let targets = be.ids(targets)?;
                let v_local = self.model.vocab_real;
                // `h`: the final norm's output, kept for the backward (this rank's rows under
                // SP, gathered again there).
                let mut h = be.alloc(Storage::Bf16, rows * c)?;
                let mut mean = be.alloc(Storage::F32, head.norm.mean_len(rows))?;
                let mut rstd = be.alloc(Storage::F32, rows)?;
                head.norm
                    .forward(be, p, v(&x), m(&mut h), m(&mut mean), m(&mut rstd))?;
                let mut logits = be.alloc(Storage::Bf16, n * v_local)?;
                if sp {
                    let mut full = be.alloc(Storage::Bf16, n * c)?;
                    gather_rows(tp, v(&h), m(&mut full))?;
                    head.proj.forward(be, p, v(&full), m(&mut logits))?;
                } else {
                    head.proj.forward(be, p, v(&h), m(&mut logits))?;
                }
                let mut losses = be.alloc(Storage::F32, n)?;
                let mut max = be.alloc(Storage::F32, n)?;
                let mut sumexp = be.alloc(Storage::F32, n)?;
                let mut both = be.alloc(Storage::F32, 2 * n)?;
                let start = self.tp.rank * (self.model.vocab / self.tp.size);
                vocab_parallel_cross_entropy_forward(
                    be,
                    m(&mut losses),
                    m(&mut max),
                    m(&mut sumexp),
                    m(&mut both),
                    v(&logits),
                    &targets,
                    start,
                    tp,
                )?;
                self.loss_sum += be.sum(v(&losses))?;
                acts.head = Some(HeadActs {
                    x,
                    h,
                    mean,
                    rstd,
                    logits,
                    max,
                    sumexp,
                    targets,
                });
            }
            None => {
                self.outbox.insert((mb, chunk), x);
            }
        }
        self.acts.insert((mb, chunk), acts);
        if self.zero == 3 {
            self.release_region(chunk)?;
        }
        Ok(())
    }
}

/// The chunk whose gradients `op` adds to: a fused backward, and under a zero-bubble schedule
/// both halves (B computes the norms' and embeddings' gradients, W the linears').
fn writes_grads(op: &Op) -> Option<usize> {
    match *op {
        Op::Backward { chunk, .. }
        | Op::BackwardInput { chunk, .. }
        | Op::BackwardWeight { chunk, .. } => Some(chunk),
        _ => None,
    }
}

/// The schedule's op list is inconsistent (a bug in `tessera_planner::schedule`).
fn schedule_bug(what: String) -> RunError {
    RunError::Unsupported {
        what: format!("the pipeline schedule {what}"),
        fix: "report this with the plan file; the schedule's op list is inconsistent".into(),
    }
}

#[path = "backward.rs"]
mod backward;

#[path = "sync.rs"]
mod sync;

#[path = "cp.rs"]
mod cp;

#[path = "eval.rs"]
pub(super) mod eval;

#[path = "dropout.rs"]
mod dropout;

#[path = "ckpt.rs"]
pub(super) mod ckpt;
