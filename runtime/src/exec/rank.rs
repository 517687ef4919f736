//! One rank's training loop: execute the schedule's op list, then sync and step.
//!
//! The op list comes from `tessera_planner::schedule::build`, the same function the planner
//! simulates; this file interprets it literally (buffered sends, blocking receives) and never
//! re-derives the order. Collectives are issued in the same order on every rank of a group.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::mpsc;
use std::time::Instant;

use tessera_planner::plan::Plan;
use tessera_planner::schedule::{self, Op};
use tessera_planner::Mesh;

use super::model::{shard_of, StageModel};
use super::trace::TraceEvent;
use super::{RunError, StepMetrics, TrainOptions};
use crate::comm::{all_reduce_f64, Comm, LocalComm};
use crate::data::{Sampler, Tokens};
use crate::layers::tp::{gather_rows, scatter_rows};
use crate::layers::{
    vocab_parallel_cross_entropy_backward, vocab_parallel_cross_entropy_forward, BlockActs,
    BlockWorkspace, Dims, TpShard,
};
use crate::optim::{AdamW, AdamWConfig, LrSchedule};
use crate::params::ParamLayout;

/// Everything a rank needs: the plan, its groups, the data and the options.
pub struct RankCtx<'a> {
    pub plan: &'a Plan,
    pub rank: usize,
    pub mesh: Mesh,
    pub tp: &'a LocalComm,
    pub dp: &'a LocalComm,
    pub pp: &'a LocalComm,
    /// Stage 0 ↔ last stage, for a tied embedding table split over PP.
    pub embedding: Option<&'a LocalComm>,
    pub data: &'a Tokens,
    pub opts: &'a TrainOptions,
    pub epoch: Instant,
    pub metrics: &'a mpsc::Sender<StepMetrics>,
}

/// What a rank hands back.
pub struct RankResult {
    pub steps: Vec<StepMetrics>,
    pub layout: ParamLayout,
    pub params: Vec<f32>,
    pub trace: Vec<TraceEvent>,
}

/// What the head keeps between a micro-batch's forward and backward.
struct HeadActs {
    x: Vec<f32>,
    h: Vec<f32>,
    mean: Vec<f32>,
    rstd: Vec<f32>,
    logits: Vec<f32>,
    max: Vec<f32>,
    sumexp: Vec<f32>,
}

/// What one (micro-batch, chunk) keeps between forward and backward.
struct ChunkActs {
    blocks: Vec<BlockActs>,
    head: Option<HeadActs>,
}

type Key = (usize, usize);

/// Runs the whole training on this rank.
pub fn run(ctx: &RankCtx) -> Result<RankResult, RunError> {
    let mut r = Rank::new(ctx)?;
    let mut steps = Vec::new();
    for step in 0..ctx.opts.steps {
        if ctx.opts.stop.as_ref().is_some_and(|s| !s.may_start(step)) {
            break;
        }
        let start = Instant::now();
        let loss = r.step(step)?;
        let step_time_s = start.elapsed().as_secs_f64();
        if let Some(loss) = loss {
            let t = &ctx.plan.job.model.training;
            let m = StepMetrics {
                step,
                loss,
                step_time_s,
                tokens_per_s: (t.global_batch * t.seq_len) as f64 / step_time_s,
            };
            ctx.metrics.send(m.clone()).ok();
            steps.push(m);
        }
    }
    if r.zero == 3 {
        for c in 0..r.model.chunks.len() {
            r.gather_region(c)?;
        }
    }
    Ok(RankResult {
        steps,
        layout: r.model.layout,
        params: r.params,
        trace: r.trace,
    })
}

struct Rank<'a> {
    ctx: &'a RankCtx<'a>,
    model: StageModel,
    tp: TpShard,
    stage: usize,
    dp_rank: usize,
    dp: usize,
    zero: u8,
    dims: Dims,
    ops: Vec<Op>,
    params: Vec<f32>,
    grads: Vec<f32>,
    optimizers: Vec<AdamW>,
    lr: LrSchedule,
    sampler: Sampler,
    ws: BlockWorkspace,
    acts: HashMap<Key, ChunkActs>,
    pool: Vec<Vec<ChunkActs>>,
    inbox: HashMap<Key, Vec<f32>>,
    outbox: HashMap<Key, Vec<f32>>,
    /// Padded copy of a region, for regions whose length DP does not divide.
    scratch: Vec<f32>,
    /// One DP shard of a region (reduce-scatter output, all-gather input); kept between steps
    /// so the step allocates nothing.
    shard_buf: Vec<f32>,
    /// Gradients summed over TP at the end of a step: the norms' under sequence parallelism
    /// (each TP rank computes them from its own rows), else none.
    tp_summed: Vec<Range<usize>>,
    trace: Vec<TraceEvent>,
    loss_sum: f64,
}

impl<'a> Rank<'a> {
    fn new(ctx: &'a RankCtx<'a>) -> Result<Self, RunError> {
        let plan = ctx.plan;
        let p = &plan.parallel;
        let coord = ctx.mesh.coord(ctx.rank as u64);
        let stage = coord.pp as usize;
        let tp = TpShard::of(ctx.tp);
        let model = StageModel::build(plan, stage, tp)?;
        let t = &plan.job.model.training;
        let dims = Dims {
            b: p.micro_batch as usize,
            t: t.seq_len as usize,
        };
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
        let (dp, dp_rank, zero) = (p.dp as usize, coord.dp as usize, p.zero_stage);
        let params = model.layout.init(ctx.opts.seed);
        let grads = model.layout.zeros();
        let cfg = AdamWConfig {
            weight_decay: ctx.opts.weight_decay,
            ..AdamWConfig::default()
        };
        let ranges: Vec<Range<usize>> = if zero == 0 {
            std::iter::once(0..model.layout.len()).collect()
        } else {
            model
                .chunks
                .iter()
                .map(|c| shard_of(&c.region, dp, dp_rank))
                .collect()
        };
        let optimizers = ranges
            .into_iter()
            .map(|r| AdamW::new(cfg, &model.layout, r))
            .collect();
        let first_block = model
            .chunks
            .iter()
            .flat_map(|c| c.blocks.first())
            .next()
            .ok_or_else(|| RunError::Unsupported {
                what: format!("stage {stage} holds no transformer layer"),
                fix: "re-plan with fewer pipeline stages".into(),
            })?;
        let ws = BlockWorkspace::new(first_block, dims);
        let chunks = model.chunks.len();
        let mut r = Rank {
            ctx,
            tp,
            stage,
            dp_rank,
            dp,
            zero,
            dims,
            ops,
            params,
            grads,
            optimizers,
            lr: LrSchedule {
                max_lr: ctx.opts.max_lr,
                min_lr: ctx.opts.min_lr,
                warmup_steps: ctx.opts.warmup_steps,
                total_steps: ctx.opts.steps,
            },
            sampler: Sampler {
                seed: ctx.opts.seed,
                seq_len: t.seq_len as usize,
                global_batch: t.global_batch as usize,
            },
            ws,
            acts: HashMap::new(),
            pool: (0..chunks).map(|_| Vec::new()).collect(),
            inbox: HashMap::new(),
            outbox: HashMap::new(),
            scratch: Vec::new(),
            shard_buf: Vec::new(),
            tp_summed: if p.sequence_parallel && tp.size > 1 {
                model.norm_ranges()
            } else {
                Vec::new()
            },
            trace: Vec::new(),
            loss_sum: 0.0,
            model,
        };
        if zero == 3 {
            for c in 0..chunks {
                r.release_region(c);
            }
        }
        Ok(r)
    }

    /// One optimizer step; returns the mean loss on the rank that reports it.
    fn step(&mut self, step: usize) -> Result<Option<f64>, RunError> {
        self.grads.fill(0.0);
        self.loss_sum = 0.0;
        let ops = std::mem::take(&mut self.ops);
        for op in &ops {
            let start = self.ctx.epoch.elapsed();
            self.op(*op, step as u64)?;
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
        let start = self.ctx.epoch.elapsed();
        self.sync_and_update(step)?;
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
        let pp = self.ctx.mesh.pp as usize;
        if self.stage + 1 != pp {
            return Ok(None);
        }
        let total = all_reduce_f64(self.ctx.dp, self.loss_sum)?;
        let c = self.ctx.mesh.coord(self.ctx.rank as u64);
        let t = &self.ctx.plan.job.model.training;
        let mean = total / (t.global_batch * t.seq_len) as f64;
        // Every rank of the last stage holds the same sum; the other stages learn of the stop
        // when their next step's partner is gone.
        if !mean.is_finite() {
            return Err(RunError::NonFinite {
                step,
                what: "loss",
                value: mean,
            });
        }
        Ok((c.dp == 0 && c.tp == 0).then_some(mean))
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
        match op {
            Op::RecvActivation { mb, chunk, peer } | Op::RecvGrad { mb, chunk, peer } => {
                let mut buf = vec![0.0; n];
                self.ctx.pp.recv(&mut buf, peer)?;
                self.inbox.insert((mb, chunk), buf);
            }
            Op::SendActivation { mb, chunk, peer } | Op::SendGrad { mb, chunk, peer } => {
                let buf = self
                    .outbox
                    .remove(&(mb, chunk))
                    .expect("the schedule sends what it computed");
                self.ctx.pp.send(&buf, peer)?;
            }
            Op::Forward { mb, chunk } => self.forward(mb, chunk, step)?,
            Op::Backward { mb, chunk } => self.backward(mb, chunk, step)?,
        }
        Ok(())
    }

    fn tokens(&self, step: u64, mb: usize) -> (Vec<u32>, Vec<u32>) {
        let first = self
            .sampler
            .first_sequence(self.dp, self.dp_rank, self.dims.b, mb);
        self.sampler
            .sequences(self.ctx.data, step, first, self.dims.b)
    }

    fn forward(&mut self, mb: usize, chunk: usize, step: u64) -> Result<(), RunError> {
        if self.zero == 3 {
            self.gather_region(chunk)?;
        }
        let (n, c) = (self.dims.n(), self.model.cfg.hidden);
        let ((rows, first), sp) = (self.rows(), self.ctx.plan.parallel.sequence_parallel);
        let tp = self.ctx.tp;
        let mut acts = self.pool[chunk].pop().unwrap_or_else(|| ChunkActs {
            blocks: self.model.chunks[chunk]
                .blocks
                .iter()
                .map(|b| BlockActs::new(b, self.dims, self.ctx.plan.parallel.recompute))
                .collect(),
            head: None,
        });
        let ch = &self.model.chunks[chunk];
        let p = &self.params;
        let mut x = match &ch.embedding {
            Some(e) if sp => {
                let (inputs, _) = self.tokens(step, mb);
                let mut partial = vec![0.0; n * c];
                e.wte.forward_partial(p, &inputs, &mut partial);
                let mut x = vec![0.0; rows * c];
                scatter_rows(tp, &partial, &mut x)?;
                if let Some(wpe) = &e.wpe {
                    wpe.forward_rows(p, &mut x, self.dims.t, first);
                }
                x
            }
            Some(e) => {
                let (inputs, _) = self.tokens(step, mb);
                let mut x = vec![0.0; n * c];
                e.wte.forward(p, &inputs, &mut x, tp)?;
                if let Some(wpe) = &e.wpe {
                    wpe.forward(p, &mut x, self.dims.t);
                }
                x
            }
            None => self
                .inbox
                .remove(&(mb, chunk))
                .expect("the schedule receives before it computes"),
        };
        for (blk, a) in ch.blocks.iter().zip(acts.blocks.iter_mut()) {
            let mut out = vec![0.0; rows * c];
            blk.forward(p, &x, &mut out, a, &mut self.ws, tp)?;
            x = out;
        }
        match &ch.head {
            Some(head) => {
                let (_, targets) = self.tokens(step, mb);
                let v_local = self.model.vocab / self.tp.size;
                // `h`: the final norm's output, kept for the backward (this rank's rows under
                // SP, gathered again there).
                let mut h = vec![0.0; rows * c];
                let (mut mean, mut rstd) = (vec![0.0; head.norm.mean_len(rows)], vec![0.0; rows]);
                head.norm.forward(p, &x, &mut h, &mut mean, &mut rstd);
                let mut logits = vec![0.0; n * v_local];
                if sp {
                    let mut full = vec![0.0; n * c];
                    gather_rows(tp, &h, &mut full)?;
                    head.proj.forward(p, &full, &mut logits);
                } else {
                    head.proj.forward(p, &h, &mut logits);
                }
                let (mut losses, mut max, mut sumexp) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
                let start = self.tp.rank * v_local;
                vocab_parallel_cross_entropy_forward(
                    &mut losses,
                    &mut max,
                    &mut sumexp,
                    &logits,
                    &targets,
                    start,
                    tp,
                )?;
                self.loss_sum += losses.iter().map(|&l| f64::from(l)).sum::<f64>();
                acts.head = Some(HeadActs {
                    x,
                    h,
                    mean,
                    rstd,
                    logits,
                    max,
                    sumexp,
                });
            }
            None => {
                self.outbox.insert((mb, chunk), x);
            }
        }
        self.acts.insert((mb, chunk), acts);
        if self.zero == 3 {
            self.release_region(chunk);
        }
        Ok(())
    }

    fn backward(&mut self, mb: usize, chunk: usize, step: u64) -> Result<(), RunError> {
        if self.zero == 3 {
            self.gather_region(chunk)?;
        }
        let (n, c) = (self.dims.n(), self.model.cfg.hidden);
        let ((rows, _), sp) = (self.rows(), self.ctx.plan.parallel.sequence_parallel);
        let tp = self.ctx.tp;
        let mut acts = self
            .acts
            .remove(&(mb, chunk))
            .expect("the schedule runs forward before backward");
        let (inputs, targets) = self.tokens(step, mb);
        let ch = &self.model.chunks[chunk];
        let (p, g) = (&self.params, &mut self.grads);
        let mut dx = match (&ch.head, acts.head.take()) {
            (Some(head), Some(mut s)) => {
                let t = &self.ctx.plan.job.model.training;
                let dl = vec![1.0 / (t.global_batch * t.seq_len) as f32; n];
                let start = self.tp.rank * (self.model.vocab / self.tp.size);
                vocab_parallel_cross_entropy_backward(
                    &mut s.logits,
                    &s.max,
                    &s.sumexp,
                    &targets,
                    &dl,
                    start,
                );
                let mut dh = vec![0.0; n * c];
                if sp {
                    let mut h = vec![0.0; n * c];
                    gather_rows(tp, &s.h, &mut h)?;
                    head.proj.backward_partial(p, g, &h, &s.logits, &mut dh);
                    let mut dh_rows = vec![0.0; rows * c];
                    scatter_rows(tp, &dh, &mut dh_rows)?;
                    dh = dh_rows;
                } else {
                    head.proj.backward(p, g, &s.h, &s.logits, &mut dh, tp)?;
                }
                let mut dx = vec![0.0; rows * c];
                head.norm
                    .backward(p, g, &dh, &s.x, &s.mean, &s.rstd, &mut dx);
                dx
            }
            _ => self
                .inbox
                .remove(&(mb, chunk))
                .expect("the schedule receives the gradient before backward"),
        };
        for (blk, a) in ch.blocks.iter().zip(acts.blocks.iter()).rev() {
            let mut din = vec![0.0; rows * c];
            blk.backward(p, g, &dx, &mut din, a, &mut self.ws, tp)?;
            dx = din;
        }
        match &ch.embedding {
            Some(e) => {
                if sp {
                    // Every TP rank needs every row's gradient: its table rows may be used anywhere.
                    let mut full = vec![0.0; n * c];
                    gather_rows(tp, &dx, &mut full)?;
                    dx = full;
                }
                e.wte.backward(g, &inputs, &dx);
                if let Some(wpe) = &e.wpe {
                    wpe.backward(g, &dx, self.dims.t);
                }
            }
            None => {
                self.outbox.insert((mb, chunk), dx);
            }
        }
        self.pool[chunk].push(acts);
        if self.zero == 3 {
            self.release_region(chunk);
        }
        Ok(())
    }
}

#[path = "sync.rs"]
mod sync;
