//! The executor: runs a plan for real, one thread per rank, on any [`Backend`] (the CPU's by
//! default).
//!
//! Every rank builds its share of the model from plan.json (`model`), then runs the planner's
//! own schedule op lists (`tessera_planner::schedule::build`) literally (`rank`): it never
//! re-decides the layout. Data parallelism syncs gradients by all-reduce or ZeRO-1/2/3 (over
//! DP × CP with context parallelism, whose ranks run ring attention: `rank/cp.rs`).
//! The oracle: every layout's losses and parameters equal the single-rank run's.

mod fault;
pub mod generate;
mod logits;
mod model;
mod nf4;
mod offload;
mod rank;
mod stop;
pub mod trace;

use std::collections::BTreeMap;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use tessera_planner::optimizer::{Optimizer, Schedule};
use tessera_planner::plan::Plan;
use tessera_planner::schedule::ScheduleKind;
use tessera_planner::Mesh;

use crate::backend::{Backend, Collective, Cpu};
use crate::checkpoint::{Checkpoint, CheckpointError, SaveOptions, Saver};
use crate::comm::{local_groups, local_moe_groups, CommError, LocalComm, MoeGroups};
use crate::data::{DataError, Tokens};
use crate::layers::context_parallel::CpComm;
use crate::layers::dropout::DropoutRates;
use crate::layers::LayerError;
use crate::params::ParamLayout;

pub use fault::{Fault, FaultKind};
pub use logits::{forward_logits, forward_logits_with};
pub use model::{shard_of, StageModel};
pub use rank::ckpt::{shard_initial, InitialParams};
pub use rank::eval::EvalSet;
pub use stop::Stop;
pub use trace::{chrome_trace, TraceEvent};

/// Why a run cannot start or failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("{0}")]
    Layer(#[from] LayerError),
    #[error("{0}")]
    Comm(#[from] CommError),
    #[error("{0}")]
    Data(#[from] DataError),
    #[error("{0}")]
    Backend(#[from] crate::backend::BackendError),
    #[error("{0}")]
    Checkpoint(#[from] CheckpointError),
    /// The plan asks for something this runtime does not do.
    #[error("{what}\n  fix: {fix}")]
    Unsupported { what: String, fix: String },
    /// The loss or the gradient norm stopped being a finite number (Megatron stops here too:
    /// every later step would only train on NaN).
    #[error("step {step}: the {what} is {value}, not a finite number; the run stops here\n  fix: lower the learning rate (--lr), or check the data and the model spec")]
    NonFinite {
        step: usize,
        what: &'static str,
        value: f64,
    },
    /// The test hook [`TrainOptions::fault`] made this rank fail.
    #[error("step {step}: injected error (test hook --fault)")]
    Injected { step: usize },
    /// A rank stopped with an error; the others were stopped.
    #[error("rank {rank} failed: {message}")]
    Rank { rank: usize, message: String },
}

/// Training settings that are not part of the plan.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    pub steps: usize,
    pub seed: u64,
    /// The optimizer this run trains with; `None`: the plan's (`job.model.optimizer`).
    /// `tessera run`'s flags set it.
    pub optimizer: Option<Optimizer>,
    /// The learning-rate schedule; `None`: the plan's (`job.model.schedule`). Its decay ends
    /// at `schedule.decay_steps`, or at `steps` when that is absent.
    pub schedule: Option<Schedule>,
    /// Record a Chrome trace of every op.
    pub trace: bool,
    /// Threads each rank's matmuls may use (1 keeps runs bit-reproducible across machines).
    pub threads_per_rank: usize,
    /// Asks the run to stop early, at the same step on every rank (a signal, a failed output).
    pub stop: Option<Arc<Stop>>,
    /// Save checkpoints (`checkpoint/`): every `every` steps and after the last step run.
    pub save: Option<SaveOptions>,
    /// Continue from this checkpoint (opened with [`Checkpoint::open`]): its step, parameters,
    /// Adam moments, data position and seeds; `steps` stays the run's total (the learning-rate
    /// schedule's length), so the run goes from the checkpoint's step to `steps`.
    pub resume: Option<Arc<Checkpoint>>,
    /// Start from these global parameters (e.g. an HF model, `crate::hf::load`) instead of
    /// the seed's initialisation, with fresh optimizer state; ignored when resuming.
    pub init: Option<Arc<InitialParams>>,
    /// Test hook: one rank fails at one step (`tessera run --fault`, hidden); `None` in every
    /// real run.
    pub fault: Option<Fault>,
    /// Evaluate the validation loss on these fixed sequences every `every` steps and after
    /// the last step (`eval.rs`); `None` for no evaluation.
    pub eval: Option<Arc<EvalSet>>,
    /// The dropout rates of the embedding, attention and residual sites; `None`: the plan's
    /// `training.dropout` (`--init-from` sets its config.json's). The adapters' rate is always
    /// the plan's `[lora] dropout`.
    pub dropout: Option<DropoutRates>,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            steps: 50,
            seed: 1234,
            optimizer: None,
            schedule: None,
            trace: false,
            threads_per_rank: 1,
            stop: None,
            save: None,
            resume: None,
            init: None,
            fault: None,
            eval: None,
            dropout: None,
        }
    }
}

impl TrainOptions {
    /// The optimizer of this run: the options', else the plan's.
    pub fn optimizer<'a>(&'a self, plan: &'a Plan) -> &'a Optimizer {
        self.optimizer.as_ref().unwrap_or(&plan.job.model.optimizer)
    }

    /// The learning-rate schedule's settings: the options', else the plan's.
    pub fn schedule<'a>(&'a self, plan: &'a Plan) -> &'a Schedule {
        self.schedule.as_ref().unwrap_or(&plan.job.model.schedule)
    }

    /// The learning rate of every step of this run.
    pub fn lr_schedule(&self, plan: &Plan) -> crate::optim::LrSchedule {
        crate::optim::LrSchedule::of(self.optimizer(plan), self.schedule(plan), self.steps)
    }

    /// The AdamW settings of this run.
    pub fn adamw(&self, plan: &Plan) -> crate::optim::AdamWConfig {
        crate::optim::AdamWConfig::of(self.optimizer(plan))
    }

    /// The dropout rates of this run: the options' sites with the plan's `[lora] dropout`,
    /// else the plan's.
    pub fn dropout(&self, plan: &Plan) -> DropoutRates {
        let planned = DropoutRates::of_plan(&plan.job.model);
        match self.dropout {
            Some(r) => DropoutRates {
                lora: planned.lora,
                ..r
            },
            None => planned,
        }
    }

    /// The global gradient-norm clip of this run (0 for none).
    pub fn clip(&self, plan: &Plan) -> f64 {
        self.optimizer(plan).clip_grad
    }
}

/// One optimizer step, as measured.
#[derive(Debug, Clone, PartialEq)]
pub struct StepMetrics {
    pub step: usize,
    /// Mean cross-entropy over the global batch.
    pub loss: f64,
    pub step_time_s: f64,
    pub tokens_per_s: f64,
    /// The learning rate this step's update used.
    pub lr: f64,
    /// The global gradient norm of this step, before clipping (the norm clipping compares
    /// with `clip_grad`).
    pub grad_norm: f64,
    /// Training tokens consumed up to and including this step (global batch × sequence ×
    /// steps, counted from step 0: a resumed run counts the steps before it too).
    pub tokens_seen: u64,
    /// The mean cross-entropy over the eval set's sequences, at the steps that evaluate.
    pub val_loss: Option<f64>,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct TrainReport {
    pub steps: Vec<StepMetrics>,
    /// Final parameters by tensor name, gathered from every rank into global tensors.
    pub params: BTreeMap<String, Vec<f32>>,
    /// Peak bytes allocated per rank during the training steps, setup and the final download
    /// left out (0 when the tracking allocator is not installed).
    pub peak_bytes: Vec<u64>,
    /// Every rank's executed ops, when tracing was asked for.
    pub trace: Vec<TraceEvent>,
    /// QLoRA: the bytes each rank holds of its NF4 base (codes and block scales); 0 else.
    pub nf4_bytes: Vec<u64>,
}

/// The most ranks the CPU backend runs (each a thread, with a channel to every peer).
pub const MAX_CPU_RANKS: u64 = 1024;

/// Checks that this runtime can execute the plan at all. `tessera plan` and `tessera validate`
/// run it on CPU-cluster plans too, so a plan that would fail here is refused before a run.
pub fn check_supported(plan: &Plan) -> Result<(), RunError> {
    let p = &plan.parallel;
    if p.world > MAX_CPU_RANKS {
        return Err(RunError::Unsupported {
            what: format!(
                "the CPU backend runs every rank as a thread of one process, and this plan has {} ranks (at most {MAX_CPU_RANKS})",
                p.world
            ),
            fix: "plan for fewer devices (--devices N)".into(),
        });
    }
    // Every schedule is named, so a new one is refused until the executor is taught it.
    match p.schedule {
        ScheduleKind::Gpipe
        | ScheduleKind::OneFOneB
        | ScheduleKind::Interleaved
        | ScheduleKind::ZbH1
        | ScheduleKind::ZbV => {}
        ScheduleKind::DualPipe => {
            return Err(RunError::Unsupported {
                what: "parallel.schedule dualpipe: the runtime does not run DualPipe (two pipelines in opposite directions, each rank holding two model stages' parameters)".into(),
                fix: "re-plan with --schedule zb-v (its V keeps the stages as busy, with one copy of the parameters), zb-h1 or 1f1b; plans of dualpipe are for the planner's numbers only".into(),
            });
        }
    }
    // A rank holds seq_len / CP tokens of each sequence.
    let rows = p.micro_batch * plan.job.model.training.seq_len / p.cp.max(1);
    if p.sequence_parallel && !rows.is_multiple_of(p.tp) {
        let cp = if p.cp > 1 { " / CP" } else { "" };
        return Err(RunError::Unsupported {
            what: format!(
                "sequence parallelism splits the {rows} tokens of a micro-batch \
                 (micro_batch × seq_len{cp}) over TP {}, which does not divide them",
                p.tp
            ),
            fix: "re-plan with a micro-batch or sequence length that TP divides, or with --no-sp"
                .into(),
        });
    }
    let a = &plan.job.model.architecture;
    // Padding rows sit at the end of the vocabulary: a TP rank whose whole shard is padding
    // would compute empty logits, which the kernels do not take.
    let local = a.padded_vocab(p.tp) / p.tp;
    if (a.vocab - 1) / local < p.tp - 1 {
        return Err(RunError::Unsupported {
            what: format!(
                "vocab {} padded to {} leaves TP ranks {}..{} only padding rows ({local} each)",
                a.vocab,
                a.padded_vocab(p.tp),
                (a.vocab - 1) / local + 1,
                p.tp - 1
            ),
            fix: "set a smaller make_vocab_size_divisible_by under [architecture] (1 pads only to a multiple of TP), or plan with a smaller TP".into(),
        });
    }
    let seq = plan.job.model.training.seq_len;
    if p.cp > 1 && !seq.is_multiple_of(2 * p.cp) {
        return Err(RunError::Unsupported {
            what: format!(
                "context parallelism cuts each sequence into 2·CP = {} chunks, and seq_len {seq} does not divide into them",
                2 * p.cp
            ),
            fix: "re-plan with a CP degree whose 2·CP divides the sequence length".into(),
        });
    }
    if p.cp > 1 && p.cp_comm != tessera_planner::layout::CpComm::P2p {
        return Err(RunError::Unsupported {
            what: format!(
                "parallel.cp_comm {}: the runtime runs context parallelism as ring attention (p2p) only",
                p.cp_comm.name()
            ),
            fix: "re-plan with --cp-comm p2p".into(),
        });
    }
    if p.hybrid_shard {
        // The executor shards ZeRO state over the whole DP group; hybrid sharding (shard inside
        // a node, replicate across) would be a plan it runs differently than written.
        return Err(RunError::Unsupported {
            what: "parallel.hybrid_shard: the runtime shards ZeRO state over the whole DP group, not inside a node with replicas across nodes".into(),
            fix: "re-plan with --no-hybrid-shard".into(),
        });
    }
    if a.mla.is_some() {
        return Err(RunError::Unsupported {
            what: "architecture.mla: the runtime does not compute Multi-head Latent Attention (its latent projections and shared RoPE key)".into(),
            fix: "run a model with standard attention (remove [architecture.mla] from the model spec); plans of it are for the planner's numbers only".into(),
        });
    }
    if a.qk_norm {
        return Err(RunError::Unsupported {
            what: "architecture.qk_norm: the runtime does not compute the per-head query and key norms".into(),
            fix: "set qk_norm = false in the model spec to run it; plans of it are for the planner's numbers only".into(),
        });
    }
    match &a.moe {
        None if p.ep > 1 => {
            return Err(RunError::Unsupported {
                what: format!("parallel.ep {}: expert parallelism needs a mixture-of-experts model, and this one is dense", p.ep),
                fix: "re-plan with --ep 1".into(),
            });
        }
        Some(m) if m.capacity_factor.is_some() && p.cp > 1 => {
            return Err(RunError::Unsupported {
                what: format!(
                    "architecture.capacity_factor with parallel.cp {}: the runtime drops tokens by their position in the micro-batch, which context parallelism splits over ranks",
                    p.cp
                ),
                fix: "remove capacity_factor (dropless routing), or re-plan with --cp 1".into(),
            });
        }
        _ => {}
    }
    check_dropout(plan, &DropoutRates::of_plan(&plan.job.model))?;
    offload::check_supported(plan)?;
    Ok(())
}

/// Refuses dropout `rates` where the runtime cannot draw the single rank's masks: under
/// context parallelism a rank's tokens are two chunks of each sequence, and ring attention has
/// no dropout.
pub fn check_dropout(plan: &Plan, rates: &DropoutRates) -> Result<(), RunError> {
    if rates.any() && plan.parallel.cp > 1 {
        return Err(RunError::Unsupported {
            what: format!(
                "dropout (embedding {}, attention {}, residual {}, LoRA {}) with parallel.cp {}: the runtime draws dropout masks for whole sequences, and ring attention has no dropout",
                rates.embedding, rates.attention, rates.residual, rates.lora, plan.parallel.cp
            ),
            fix: "re-plan with --cp 1, or set [training] dropout = 0.0 and [lora] dropout = 0.0".into(),
        });
    }
    Ok(())
}

/// Checks a checkpoint against itself where `Checkpoint::open` cannot: its index's `model`
/// against the tensors its shards hold (`Checkpoint::check_model` on that model's single-rank
/// layout). Every command that reads a checkpoint calls it after opening.
pub fn check_checkpoint(ck: &Checkpoint) -> Result<(), RunError> {
    let i = ck.index();
    let model = StageModel::whole_of(&i.model, i.lora.as_ref(), i.nf4_base)?;
    // The layout only names the tensors here: QLoRA's NF4 ones join it.
    let mut layout = model.layout.clone();
    for p in model.nf4_weights().flat_map(|w| &w.parts) {
        for spec in nf4::checkpoint_specs(p) {
            layout.add_trainable(spec).map_err(LayerError::from)?;
        }
    }
    Ok(ck.check_model(&layout)?)
}

/// Refuses a LoRA checkpoint where only the base model's forward runs (sampling): its adapters
/// would be silently left out.
pub fn refuse_adapters(ck: &Checkpoint) -> Result<(), RunError> {
    match ck.index().lora {
        Some(_) => Err(RunError::Unsupported {
            what: "the checkpoint holds LoRA adapters on a frozen base, and this forward runs the base model only: it would leave the adapters out".into(),
            fix: "use a checkpoint of full training; forwards through adapters are not implemented yet (issue 37)".into(),
        }),
        None => Ok(()),
    }
}

/// Trains for `opts.steps` steps on the CPU backend (threads are ranks); `on_step` sees each
/// step's metrics as it finishes.
pub fn train(
    plan: &Plan,
    data: &Tokens,
    opts: &TrainOptions,
    on_step: &mut dyn FnMut(&StepMetrics),
) -> Result<TrainReport, RunError> {
    offload::refuse_on_cpu(plan)?;
    train_on(plan, data, opts, on_step, &|_| Ok(Cpu), &|_, c| Ok(c))
}

/// [`train`] on any backend: rank `r` runs on `backend(r)`, and its groups are the local
/// (thread) groups wrapped by `collective` into the backend's collectives. The same executor
/// runs every backend.
pub fn train_on<B, C>(
    plan: &Plan,
    data: &Tokens,
    opts: &TrainOptions,
    on_step: &mut dyn FnMut(&StepMetrics),
    backend: &(dyn Fn(usize) -> Result<B, RunError> + Sync),
    collective: &(dyn Fn(&B, LocalComm) -> Result<C, RunError> + Sync),
) -> Result<TrainReport, RunError>
where
    B: Backend,
    C: Collective<B> + 'static,
{
    check_supported(plan)?;
    check_dropout(plan, &opts.dropout(plan))?;
    tessera_planner::optimizer::check(opts.optimizer(plan), opts.schedule(plan)).map_err(|p| {
        RunError::Unsupported {
            what: format!("the run's {}: {}", p.field, p.problem),
            fix: p.fix,
        }
    })?;
    let t = &plan.job.model.training;
    data.check(plan.job.model.architecture.vocab, t.seq_len)?;
    if let Some(e) = &opts.eval {
        check_eval(e, plan)?;
    }
    let p = &plan.parallel;
    let mesh =
        Mesh::with_cp(p.dp, p.cp, p.pp, p.tp, plan.job.cluster.gpus_per_node).with_ep(p.ep.max(1));
    let world = mesh.world() as usize;
    if let Some(ck) = &opts.resume {
        ck.check_compatible(plan, data)?;
    }
    let saver = opts
        .save
        .as_ref()
        .map(|s| saver(s, plan, data, opts))
        .transpose()?;
    let saver = saver.as_ref();
    let groups = local_groups(&mesh)?;
    let embedding_groups = tied_embedding_groups(plan, &mesh)?;
    let moe_groups: Vec<Option<MoeGroups<LocalComm>>> = match plan.job.model.architecture.moe {
        Some(_) => local_moe_groups(&mesh)?.into_iter().map(Some).collect(),
        None => (0..world).map(|_| None).collect(),
    };
    let (tx, rx) = mpsc::channel::<StepMetrics>();
    if std::env::var_os("TESSERA_MEM_BREAKDOWN").is_some() {
        crate::alloc::breakdown(true);
    }
    let epoch = Instant::now();
    let results: Vec<Result<rank::RankResult, RunError>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .zip(embedding_groups)
            .zip(moe_groups)
            .enumerate()
            .map(|(r, ((g, emb), moe))| {
                let tx = tx.clone();
                // Named, so that a panic's own line says which rank panicked.
                let thread = std::thread::Builder::new().name(format!("rank {r}"));
                thread.spawn_scoped(s, move || {
                    crate::alloc::set_rank(r);
                    crate::backend::set_cpu_kernel_threads(opts.threads_per_rank);
                    let out = (|| {
                        let be = backend(r)?;
                        let group = |c| collective(&be, c);
                        let (tp, dp, pp) = (group(g.tp)?, group(g.dp)?, group(g.pp)?);
                        // The ring's K/V and dK/dV move on the backend's buffers.
                        let cp = match g.cp {
                            Some(c) => Some(Box::new(group(c)?) as CpComm<B>),
                            None => None,
                        };
                        let embedding = emb.map(group).transpose()?;
                        let (expert_dp, moe) = match moe {
                            Some(m) => {
                                let host =
                                    |c: LocalComm| Box::new(c) as Box<dyn crate::comm::Comm + Send>;
                                let comms = rank::MoeComms {
                                    ep: Box::new(group(m.ep)?),
                                    cp: m.cp.map(host),
                                };
                                (Some(group(m.expert_dp)?), Some(comms))
                            }
                            None => (None, None),
                        };
                        let ctx = rank::RankCtx {
                            plan,
                            rank: r,
                            mesh,
                            be: &be,
                            tp: &tp,
                            dp: &dp,
                            pp: &pp,
                            embedding: embedding.as_ref(),
                            expert_dp: expert_dp.as_ref(),
                            data,
                            opts,
                            epoch,
                            metrics: &tx,
                            saver,
                        };
                        rank::run(&ctx, cp, moe)
                    })();
                    crate::alloc::set_rank(usize::MAX);
                    out
                })
            })
            .collect::<std::io::Result<Vec<_>>>()
            .expect("the system starts a thread per rank");
        drop(tx);
        for m in rx.iter() {
            on_step(&m);
        }
        handles
            .into_iter()
            .enumerate()
            .map(|(r, h)| {
                h.join().unwrap_or_else(|e| {
                    let message = e
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "no message".into());
                    Err(RunError::Rank {
                        rank: r,
                        message: format!("its thread panicked: {message}"),
                    })
                })
            })
            .collect()
    });
    // The first real failure explains the run; its peers only saw a partner disappear (a
    // `PeerGone`, possibly wrapped by the layer that issued the collective).
    let mut outs = Vec::with_capacity(world);
    let mut errors = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(o) => outs.push(o),
            Err(e) => errors.push((r, e)),
        }
    }
    if !errors.is_empty() {
        let pick = errors
            .iter()
            .position(|(_, e)| !saw_a_peer_go(e))
            .unwrap_or(0);
        let (r, e) = errors.swap_remove(pick);
        return Err(match e {
            RunError::Rank { .. } => e,
            other => RunError::Rank {
                rank: r,
                message: other.to_string(),
            },
        });
    }
    let steps = outs
        .iter()
        .find(|o| !o.steps.is_empty())
        .map(|o| o.steps.clone())
        .unwrap_or_default();
    let mut params = gather(
        &outs
            .iter()
            .map(|o| (&o.layout, &o.params[..]))
            .collect::<Vec<_>>(),
    );
    // QLoRA's base, dequantized: the values the forward computed with.
    for (info, values) in outs.iter().flat_map(|o| &o.nf4) {
        let global = params
            .entry(info.name.clone())
            .or_insert_with(|| vec![0.0; info.len_global()]);
        info.copy_shard_to_global(values, global);
    }
    Ok(TrainReport {
        steps,
        params,
        nf4_bytes: outs.iter().map(|o| o.nf4_bytes).collect(),
        peak_bytes: outs.iter().map(|o| o.peak_bytes).collect(),
        trace: outs.into_iter().flat_map(|o| o.trace).collect(),
    })
}

/// The eval set holds at least one global batch of sequences, of ids the vocabulary has.
fn check_eval(e: &EvalSet, plan: &Plan) -> Result<(), RunError> {
    let t = &plan.job.model.training;
    let (have, need) = (e.sequences(t.seq_len as usize), t.global_batch as usize);
    let invalid = |problem: String, fix: &str| {
        RunError::Data(DataError::Invalid {
            path: e.source.clone(),
            problem,
            fix: fix.into(),
        })
    };
    if have < need {
        return Err(invalid(
            format!(
                "the validation data holds {have} whole sequences of {} tokens (+1 target); one eval batch is the plan's global batch of {need}",
                t.seq_len
            ),
            "pass a longer --val-data, prepare a larger val split (--val-fraction), or lower --eval-tokens' need by a smaller global batch",
        ));
    }
    let vocab = plan.job.model.architecture.vocab;
    if let Some(bad) = e
        .inputs
        .iter()
        .chain(&e.targets)
        .find(|&&id| u64::from(id) >= vocab)
    {
        return Err(invalid(
            format!("token id {bad} does not fit the model's vocabulary of {vocab}"),
            "tokenize the validation data with the training data's tokenizer",
        ));
    }
    Ok(())
}

/// Whether a rank only failed because a peer of one of its groups ended first: a
/// [`CommError::PeerGone`], as the collective returned it or wrapped by the layer that issued
/// it (`LayerError::Comm` is transparent, so its chain of sources skips the `CommError`), or
/// anywhere further down the chain of sources.
fn saw_a_peer_go(e: &RunError) -> bool {
    let gone = |c: &CommError| matches!(c, CommError::PeerGone { .. });
    if let RunError::Comm(c) | RunError::Layer(LayerError::Comm(c)) = e {
        return gone(c);
    }
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(e) = next {
        if e.downcast_ref::<CommError>().is_some_and(gone)
            || matches!(e.downcast_ref::<LayerError>(), Some(LayerError::Comm(c)) if gone(c))
        {
            return true;
        }
        next = e.source();
    }
    false
}

/// The saver of a run: its seeds are the checkpoint's when it resumes one.
fn saver(
    save: &SaveOptions,
    plan: &Plan,
    data: &Tokens,
    opts: &TrainOptions,
) -> Result<Saver, CheckpointError> {
    let seeds = match &opts.resume {
        Some(ck) => (ck.index().rng.init_seed, ck.sampler_seed()),
        None => (opts.seed, opts.seed),
    };
    Saver::new(
        save,
        plan,
        data,
        seeds,
        opts.lr_schedule(plan),
        opts.adamw(plan),
        opts.clip(plan),
    )
}

/// With tied embeddings split over PP, ranks of stage 0 and the stage holding the head (the
/// last, but stage 0 itself under ZB-V, which then sums the two copies alone) with the same
/// (dp, tp) sum the table's gradient: one two-rank group each (Megatron's embedding group).
fn tied_embedding_groups(plan: &Plan, mesh: &Mesh) -> Result<Vec<Option<LocalComm>>, RunError> {
    let world = mesh.world() as usize;
    let head = plan
        .stages
        .iter()
        .position(|s| s.chunks.iter().any(|c| c.head))
        .unwrap_or(0) as u64;
    if !(plan.job.model.architecture.tied_embeddings && head > 0) {
        return Ok((0..world).map(|_| None).collect());
    }
    let mut slots: Vec<Option<LocalComm>> = (0..world).map(|_| None).collect();
    for r in 0..world as u64 {
        let c = mesh.coord(r);
        if c.pp != 0 {
            continue;
        }
        let last = mesh.rank(tessera_planner::mesh::Coord { pp: head, ..c });
        let mut pair = LocalComm::group(2).into_iter();
        slots[r as usize] = pair.next();
        slots[last as usize] = pair.next();
    }
    Ok(slots)
}

/// Global tensors by name from every rank's shards (a tensor held twice, e.g. a tied table on
/// two stages, is written twice with the same values).
pub fn gather(ranks: &[(&ParamLayout, &[f32])]) -> BTreeMap<String, Vec<f32>> {
    let mut out: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    for (layout, flat) in ranks {
        for e in layout.entries() {
            let total: usize = e.global_shape.iter().product();
            let global = out
                .entry(e.name.clone())
                .or_insert_with(|| vec![0.0; total]);
            e.copy_shard_to_global(&flat[e.offset..e.offset + e.len], global);
        }
    }
    out
}
