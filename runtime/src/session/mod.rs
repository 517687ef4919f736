//! A training session: everything `tessera run` does between parsing its flags and printing,
//! as one runtime type. [`Session::prepare`] takes the plan and a resolved set of
//! [`RunOptions`] and does what must hold before the first step — the host-memory check, the
//! data and the eval set, the checkpoint to resume or the weights to start from, the optimizer
//! settings — refusing with one message that names the flag and the fix. [`Session::train`]
//! then runs the executor on the CPU or on GPUs and returns a [`Finished`] run with its summary,
//! its memory report and its loss curve.
//!
//! The caller owns the process: its signals (a [`Stop`] it arms), its outputs (what an
//! [`Observer`] does with each step), and when the outputs open (between the two calls, so that
//! nothing is written by a run that is refused).

mod data;
mod eval;
mod gpu;
mod optim;
mod plot;
mod report;
mod start;

use std::path::PathBuf;
use std::sync::Arc;

use tessera_planner::finetune::Method;
use tessera_planner::optimizer::{Optimizer, Schedule};
use tessera_planner::plan::Plan;

use crate::checkpoint::{Checkpoint, CheckpointError, Claim};
use crate::data::{DataError, Tokens};
use crate::exec::{self, EvalSet, Fault, InitialParams, RunError, StepMetrics, Stop, TrainOptions};

pub use data::{DataOptions, Loaded, BUNDLED_DATA, BUNDLED_DATA_NAME};
pub use eval::EvalOptions;
pub use optim::{resume_changes, OptimOverrides};
pub use plot::{loss_curve, loss_svg};
pub use report::{host_bytes_needed, json_line, memory_report, progress, summary, MemoryReport};
pub use start::{CheckpointOptions, SaveEvery};

/// Why a session refused to start, or failed.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// An input or setting the run refuses, with its fix.
    #[error("{what}\n  fix: {fix}")]
    Refused { what: String, fix: String },
    /// The data (or the tokenizer) could not be read.
    #[error("{context}: {source}")]
    Data { context: String, source: DataError },
    /// The bundled text could not be tokenized.
    #[error("{0}")]
    Tokenize(#[from] DataError),
    /// The checkpoint to resume could not be opened.
    #[error("{context}: {source}")]
    Checkpoint {
        context: String,
        source: Box<CheckpointError>,
    },
    /// The `--init-from` folder could not be read as the plan's model.
    #[error("--init-from: {0}")]
    InitFrom(crate::hf::HfError),
    /// NCCL was asked for and cannot run here.
    #[error("--collectives nccl: {0}")]
    Nccl(crate::backend::GpuError),
    /// The executor refused the plan or a rank failed.
    #[error("{0}")]
    Run(Box<RunError>),
}

impl From<RunError> for SessionError {
    fn from(e: RunError) -> Self {
        SessionError::Run(Box::new(e))
    }
}

/// A refusal: `what` is wrong (naming the flag or file), and the `fix`.
pub(crate) fn refused(what: impl Into<String>, fix: impl Into<String>) -> SessionError {
    SessionError::Refused {
        what: what.into(),
        fix: fix.into(),
    }
}

/// How a GPU run's ranks exchange data (`--collectives`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Collectives {
    /// NCCL when every rank has a GPU of its own, else through host memory.
    Auto,
    /// NCCL on the device buffers (each rank needs its own GPU: NCCL refuses two ranks of one
    /// communicator on one GPU).
    Nccl,
    /// Through host memory (any number of ranks per GPU; rank-order sums, bit-reproducible).
    Staged,
}

impl Collectives {
    pub fn name(self) -> &'static str {
        match self {
            Collectives::Auto => "auto",
            Collectives::Nccl => "nccl",
            Collectives::Staged => "staged",
        }
    }
}

/// The GPUs a run trains on: rank r on GPU r mod `visible`.
#[derive(Debug, Clone, Copy)]
pub struct Gpus {
    pub visible: usize,
    pub collectives: Collectives,
}

/// A `tessera run`, resolved: every flag turned into a setting, nothing read yet.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The plan's file, named in messages.
    pub plan_file: PathBuf,
    /// Optimizer steps, counted from step 0 (a resumed run goes from its checkpoint's step).
    pub steps: u64,
    /// Seed of the weights and of the data order.
    pub seed: u64,
    pub data: DataOptions,
    pub checkpoint: CheckpointOptions,
    pub optim: OptimOverrides,
    pub eval: EvalOptions,
    /// Record a Chrome trace of every op.
    pub trace: bool,
    /// `None`: the CPU backend (threads as ranks); else the CUDA backend on these GPUs.
    pub gpus: Option<Gpus>,
    /// Test hook: one rank fails at one step.
    pub fault: Option<Fault>,
}

/// What a session says as it prepares and runs; the caller prints, streams and draws.
pub trait Observer {
    /// A line for the user.
    fn say(&mut self, line: &str);
    /// A line for the user's attention (what the run decided for them).
    fn warn(&mut self, line: &str);
    /// The steps begin; the run counts up to `steps`.
    fn begin(&mut self, _steps: u64) {}
    /// A step finished. `false` stops the run: the steps some rank has begun are finished, and
    /// no rank begins another ([`Stop`]).
    fn step(&mut self, m: &StepMetrics) -> bool;
    /// The steps have ended, whether the run finished or failed.
    fn end(&mut self) {}
}

/// A run ready for its first step: its data, its starting point and its settings.
pub struct Session<'p> {
    plan: &'p Plan,
    opts: RunOptions,
    data: Tokens,
    /// Whether the GPU ranks exchange data on NCCL (false on the CPU).
    nccl: bool,
    settings: (Optimizer, Schedule),
    resume: Option<Arc<Checkpoint>>,
    init: Option<Arc<InitialParams>>,
    /// The dropout rates of `--init-from`'s config.json; `None`: the plan's.
    dropout: Option<crate::layers::dropout::DropoutRates>,
    eval: Option<Arc<EvalSet>>,
    /// The save directory, held (locked) until the run ends.
    claim: Option<Claim>,
}

/// A run that ended: what it measured.
pub struct Finished<'p> {
    plan: &'p Plan,
    on_gpus: bool,
    pub report: exec::TrainReport,
}

impl RunOptions {
    /// What can be refused from the options alone, before anything is read: optimizer
    /// settings the spec's rules refuse, and flags that would be ignored. `tessera run` and
    /// `tessera launch` (for what it passes to each rank) call it; [`Session::prepare`] too.
    /// Returns the run's optimizer settings (the plan's with the overrides applied).
    pub fn check(&self, plan: &Plan) -> Result<(Optimizer, Schedule), SessionError> {
        if !plan.job.model.training.optimizer_states.is_policy() {
            return Err(refused(
                "the plan keeps Adam's moments in 8 bits (training.optimizer_states = \"8bit\"), and the runtime's AdamW keeps them in the precision policy's width: it would train and hold something else than planned",
                "plan with --optimizer-states policy to run it; 8-bit moments are planned only",
            ));
        }
        if plan.job.model.training.precision == "bf16" {
            return Err(refused(
                "the plan's precision policy is \"bf16\" (pure bf16 weights and Adam states, no fp32 master copy), and the runtime keeps f32 master weights wherever it computes in 16 bits: it would train something else than planned",
                "plan with training.precision = \"default\" to run it; pure bf16 is planned only",
            ));
        }
        let settings = self.optim.settings(plan)?;
        if let (Some(v), None) = (&self.data.val_data, self.eval.eval_every) {
            return Err(refused(
                format!(
                    "--val-data {}: only --eval-every reads validation data, and it is not given, so the data would be ignored",
                    v.display()
                ),
                "add --eval-every N to compute the validation loss every N steps, or drop --val-data",
            ));
        }
        Ok(settings)
    }
}

impl<'p> Session<'p> {
    /// Checks and loads everything the run needs before its first step. It writes nothing but
    /// the claim of `--save-dir` (the folder and its lock file).
    pub fn prepare(
        plan: &'p Plan,
        opts: RunOptions,
        obs: &mut dyn Observer,
    ) -> Result<Session<'p>, SessionError> {
        let settings = opts.check(plan)?;
        opts.checkpoint.check()?;
        let mut opts = opts;
        if let Some(every) = opts.checkpoint.save_every {
            opts.checkpoint.save_every = Some(SaveEvery::Steps(every.steps(plan)?));
        }
        let on_cpu = opts.gpus.is_none();
        let planned = crate::layers::dropout::DropoutRates::of_plan(&plan.job.model);
        if !on_cpu && planned.any() {
            return Err(refused(
                format!(
                    "the plan trains with dropout (training.dropout {}, [lora] dropout {}), which the runtime runs on the CPU backend only so far: the CUDA backend would train without it",
                    plan.job.model.training.dropout, planned.lora
                ),
                "run it on the CPU backend (a plan for a CPU cluster), or plan for GPUs with [training] dropout = 0.0",
            ));
        }
        let method = plan.job.model.training.method;
        // LoRA runs on the backend's GEMMs; QLoRA's NF4 base is dequantized on the host.
        if !on_cpu && method == Method::Qlora {
            return Err(refused(
                format!("the plan trains QLoRA adapters (training.method = {}), which the runtime trains on the CPU backend only so far: the CUDA backend has no NF4 storage and dequantization", method.name()),
                "run it on the CPU backend (a plan for a CPU cluster), or plan --method lora for GPUs (issue 37)",
            ));
        }
        let need = if on_cpu { host_bytes_needed(plan) } else { 0.0 };
        if let Some(have) = crate::calibrate::available_memory_bytes().filter(|_| on_cpu) {
            if need > have {
                let bytes = tessera_planner::units::bytes;
                return Err(refused(
                    format!(
                        "{}: this CPU run needs about {} of host memory ({} ranks), and {} is available",
                        opts.plan_file.display(),
                        bytes(need),
                        plan.parallel.world,
                        bytes(have)
                    ),
                    "plan a smaller model, a smaller micro-batch or more recompute, or free memory",
                ));
            }
        }
        let loaded = opts.data.load(need, obs)?;
        let eval = opts.eval.eval_set(plan, loaded.val.as_ref())?.map(Arc::new);
        let nccl = gpu::nccl(plan, &opts)?;
        // A checkpoint to resume is opened and checked before any output exists.
        let resume = opts.checkpoint.resume(opts.steps, obs)?;
        let (init, dropout) = match opts.checkpoint.init_from(plan, obs)? {
            Some((w, rates)) => (Some(w), Some(rates)),
            None => (None, None),
        };
        if let Some(r) = dropout.filter(|r| !on_cpu && r.any()) {
            return Err(refused(
                format!(
                    "--init-from's config.json asks for dropout (embedding {}, attention {}, residual {}), which the runtime runs on the CPU backend only so far: the CUDA backend would train without it",
                    r.embedding, r.attention, r.residual
                ),
                "set the config.json's dropout keys to 0.0 to fine-tune on GPUs, or run on the CPU backend",
            ));
        }
        let claim = opts
            .checkpoint
            .claim(&opts.plan_file, resume.as_deref(), obs)?;
        Ok(Session {
            claim,
            plan,
            data: loaded.train,
            opts,
            nccl,
            settings,
            resume,
            init,
            dropout,
            eval,
        })
    }

    /// Trains, telling `obs` each step; `stop` ends the run early at a step boundary.
    pub fn train(
        self,
        stop: Arc<Stop>,
        obs: &mut dyn Observer,
    ) -> Result<Finished<'p>, SessionError> {
        let (plan, o) = (self.plan, &self.opts);
        let (optimizer, schedule) = self.settings;
        let opts = TrainOptions {
            steps: o.steps as usize,
            seed: o.seed,
            optimizer: Some(optimizer),
            schedule: Some(schedule),
            trace: o.trace,
            threads_per_rank: crate::calibrate::threads_per_rank(plan.parallel.world as usize),
            stop: Some(stop.clone()),
            save: o
                .checkpoint
                .save(o.steps, self.claim.as_ref().map(|c| c.lineage.clone())),
            resume: self.resume,
            init: self.init,
            fault: o.fault,
            eval: self.eval,
            dropout: self.dropout,
        };
        if let Some(ck) = &opts.resume {
            let rng = &ck.index().rng;
            if rng.init_seed != o.seed || rng.sampler_seed != o.seed {
                obs.warn(&format!(
                    "--seed {}: not used on resume; the run continues its checkpoint's seeds (weights {}, data order {})",
                    o.seed, rng.init_seed, rng.sampler_seed
                ));
            }
            let changed = resume_changes(ck, &opts, plan);
            if !changed.is_empty() {
                obs.say(&format!(
                    "note: the checkpoint was saved under other optimisation settings; this run continues under its own: {}",
                    changed.join(", ")
                ));
            }
        }
        obs.say(&header(plan, o.gpus, self.nccl));
        if o.data.bundled() {
            obs.say(&format!(
                "data: the bundled {BUNDLED_DATA_NAME} ({} bytes, built into tessera); --data FILE trains on your own",
                BUNDLED_DATA.len()
            ));
        }
        obs.begin(o.steps);
        let mut on_step = |m: &StepMetrics| {
            if !obs.step(m) {
                stop.request();
            }
        };
        let nccl = self.nccl;
        let result = match o.gpus {
            None => exec::train(plan, &self.data, &opts, &mut on_step),
            Some(g) => gpu::train(plan, &self.data, &opts, &mut on_step, g.visible, nccl),
        };
        obs.end();
        Ok(Finished {
            plan,
            on_gpus: o.gpus.is_some(),
            report: result?,
        })
    }
}

impl Finished<'_> {
    /// The lines that end the run: loss, validation loss, step time against the prediction.
    pub fn summary(&self) -> Vec<String> {
        summary(self.plan, &self.report.steps)
    }

    /// Each rank's measured memory against the plan's prediction.
    pub fn memory(&self) -> MemoryReport {
        memory_report(self.plan, &self.report.peak_bytes, self.on_gpus)
    }

    /// The loss curve as an SVG document.
    pub fn loss_curve(&self) -> Result<String, String> {
        loss_curve(self.plan, &self.report.steps)
    }
}

/// The run's first line: the model, the layout, where it runs.
fn header(plan: &Plan, gpus: Option<Gpus>, nccl: bool) -> String {
    let p = &plan.parallel;
    format!(
        "{}: {} parameters, dp {}{} × tp {} × pp {}{} on {} {} ranks, micro-batch {} × {} micro-batches, ZeRO-{}, {} recompute, schedule {}",
        plan.job.model.name,
        plan.job.parameters,
        p.dp,
        match p.cp {
            0 | 1 => String::new(),
            cp => format!(" × cp {cp} (ring attention)"),
        },
        p.tp,
        p.pp,
        match p.ep {
            0 | 1 => String::new(),
            ep => format!(" (ep {ep}: experts split over dp × cp, tokens by all-to-all)"),
        },
        p.world,
        match gpus {
            None => "CPU".to_string(),
            Some(g) => format!(
                "GPU (on {} visible GPUs, collectives {})",
                g.visible,
                if nccl { "on NCCL" } else { "through host memory" }
            ),
        },
        p.micro_batch,
        p.microbatches,
        p.zero_stage,
        p.recompute.name(),
        p.schedule.name()
    )
}
