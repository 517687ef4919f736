//! `tessera run plan.json`: train for real as the plan says, and compare with its predictions.
//!
//! Under a launcher (`tessera launch`, torchrun, Slurm: `RANK` / `WORLD_SIZE` set) every rank
//! process first meets the others and checks that they all run the same plan
//! (`crate::launched`). The CPU backend then trains every rank as a thread of rank 0's
//! process, and the other processes wait for rank 0 and exit with its outcome (docs/cuda.md,
//! "Launching").
//!
//! Signals and outputs (`crate::signals` has the rule): the handlers are installed first, before
//! any output is opened. The outputs are opened just before the first step — a FIFO without a
//! reader is waited for without blocking in open(2), and a signal during that wait (or anywhere
//! before the first step) exits at once, 130 or 143, having written nothing. From the first
//! step on, every way the run ends closes them: the metrics stream is flushed a line at a time,
//! and the Chrome trace is written as closed JSON — whole at a step boundary, or, after a
//! failure or a second signal, with what was collected and why it stopped under
//! `otherData.stopped`.
//!
//! The training session itself — host memory, data, evaluation, resume and initial weights,
//! optimizer settings, the executor, the summary, the memory report and the loss curve — is
//! `tessera_runtime::session`: this command builds its options from the flags, calls it, and
//! prints.
//!
//! Flags are honoured or refused: `--collectives` only means something to the CUDA backend,
//! `--backend cpu` cannot train a GPU cluster's plan, `--fail-rank` only acts under a launcher
//! with several ranks; each is refused (exit 2) where it would be ignored. The default data is
//! built into the binary, so it does not depend on the working directory.

mod checks;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{anyhow, Context};
use clap::{Args, Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use tessera_planner::plan::Plan;
use tessera_planner::spec::DeviceKind;
use tessera_runtime::exec::{self, StepMetrics};
use tessera_runtime::launch::env::LaunchEnv;
use tessera_runtime::session::{
    json_line, progress, CheckpointOptions, Collectives, DataOptions, EvalOptions, Gpus, Observer,
    OptimOverrides, RunOptions, Session, SessionError,
};

use crate::launched::rank_process;
use crate::signals::{uninterrupted, Interrupts};
use crate::sinks::Outputs;

use checks::{check_flags, check_run_outputs, gpus_here};
pub use checks::{check_launched, check_runnable};

#[derive(Clone, Copy, ValueEnum, PartialEq, Debug)]
enum Backend {
    /// f32 on the host CPU, threads as ranks.
    Cpu,
    /// NVIDIA GPUs (needs a build with `--features cuda`).
    Cuda,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
        }
    }
}

#[derive(Args)]
pub struct RunArgs {
    /// A plan written by `tessera plan -o`.
    plan: PathBuf,
    /// Optimizer steps to run (at least 1) [default: the plan's token budget in steps
    /// (`predicted.whole_run.steps`, from `plan --tokens`), else 50]
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    steps: Option<u64>,
    #[command(flatten)]
    data: DataOptions,
    /// Seed of the weights and of the data order.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Write one JSON line per step (step, loss, step_time_s, tokens_per_s).
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Write a Chrome trace (Perfetto-readable) of the executed schedule, one track per rank.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Where to run [default: cpu for a plan of a CPU cluster, cuda for a GPU cluster's]
    #[arg(long, value_enum)]
    backend: Option<Backend>,
    /// GPU runs (the CUDA backend): how ranks exchange data [default: auto]
    #[arg(long, value_enum)]
    collectives: Option<Collectives>,
    /// Test hook: under a launcher, the process with this RANK fails before the rendezvous.
    #[arg(long, hide = true)]
    fail_rank: Option<usize>,
    /// Test hook: rank RANK fails when it begins step STEP (0-based), with an error or a panic
    /// of its thread, while the other ranks wait for it (tests/rank_faults.rs).
    #[arg(long, hide = true, value_name = "RANK:STEP:error|panic")]
    fault: Option<exec::Fault>,
    #[command(flatten)]
    checkpoint: CheckpointOptions,
    #[command(flatten)]
    optim: OptimOverrides,
    #[command(flatten)]
    eval: EvalOptions,
    /// Write the loss curve (train and validation loss against tokens) as an SVG picture at
    /// the end of the run
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// `tessera run`'s arguments on their own, to check what `tessera launch` passes on.
#[derive(Parser)]
#[command(name = "tessera run", bin_name = "tessera run")]
struct RunCommand {
    #[command(flatten)]
    args: RunArgs,
}

impl RunArgs {
    /// Whether the run goes to the CUDA backend: asked for, or a GPU cluster's plan.
    fn on_cuda(&self, plan: &Plan) -> bool {
        match self.backend {
            Some(b) => b == Backend::Cuda,
            None => plan.job.cluster.device.kind == DeviceKind::Gpu,
        }
    }

    /// Steps to run: `--steps`, else the plan's budget, else 50.
    fn steps(&self, plan: &Plan) -> u64 {
        self.steps
            .or_else(|| plan.predicted.whole_run.as_ref().map(|w| w.steps))
            .unwrap_or(50)
    }

    /// The session's options: the flags, on the CPU or on `gpus` visible GPUs.
    fn options(&self, plan: &Plan, gpus: Option<usize>) -> RunOptions {
        RunOptions {
            plan_file: self.plan.clone(),
            steps: self.steps(plan),
            seed: self.seed,
            data: self.data.clone(),
            checkpoint: self.checkpoint.clone(),
            optim: self.optim.clone(),
            eval: self.eval,
            trace: self.trace.is_some(),
            gpus: gpus.map(|visible| Gpus {
                visible,
                collectives: self.collectives.unwrap_or(Collectives::Auto),
            }),
            fault: self.fault,
        }
    }
}

/// A session's errors as the command prints them: the message alone.
fn flat(e: SessionError) -> anyhow::Error {
    anyhow!("{e}")
}

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    // First, before any output is opened: a signal from here until the first step exits at
    // once, having written nothing.
    let interrupts = Interrupts::for_run()?;
    check_run_outputs(&args)?;
    let plan = Plan::load(&args.plan)?;
    let launch = LaunchEnv::from_env().context("reading the launch environment")?;
    let launched = launch.as_ref().map(|e| e.world_size).filter(|w| *w > 1);
    let reads_data = launched.is_none() || launch.as_ref().is_some_and(|e| e.rank == 0);
    check_flags(&args, &plan, launched, reads_data)?;
    checks::check_fp8(&plan, &args.plan, args.on_cuda(&plan))?;
    if let Some(note) = checks::tp_overlap_note(&plan) {
        eprintln!("{note}");
    }
    if args.on_cuda(&plan) {
        let gpus = gpus_here(&args, &plan)?;
        exec::check_supported(&plan)
            .map_err(|e| anyhow::anyhow!("{}: {e}", args.plan.display()))?;
        return train_here(&args, &plan, Some(gpus), &interrupts);
    }
    check_runnable(&plan, &args.plan)?;
    match launch {
        Some(env) if env.world_size > 1 => {
            let train = || train_here(&args, &plan, None, &interrupts);
            rank_process(&args.plan, &plan, &env, args.fail_rank, &interrupts, train)
        }
        _ => train_here(&args, &plan, None, &interrupts),
    }
}

/// Trains in this process (every rank a thread): on the CPU, or with `gpus`, rank r on GPU
/// r mod gpus (the device backend).
fn train_here(
    args: &RunArgs,
    plan: &Plan,
    gpus: Option<usize>,
    interrupts: &Interrupts,
) -> anyhow::Result<ExitCode> {
    let mut console = Console::default();
    let session = Session::prepare(plan, args.options(plan, gpus), &mut console).map_err(flat)?;
    // The outputs open now, just before the first step; from here on every way out closes
    // them, an exit at once included.
    let outputs = Arc::new(Outputs::open(
        args.metrics.as_deref(),
        args.trace.as_deref(),
        interrupts,
    )?);
    {
        let outputs = outputs.clone();
        interrupts.on_exit(move |sig| outputs.close_at_once(sig));
    }
    let stop = Arc::new(exec::Stop::new());
    interrupts.arm(stop.clone());
    console.outputs = Some(outputs.clone());
    let finished = match session.train(stop, &mut console) {
        Ok(f) => f,
        Err(e) => {
            let why = format!("the run failed: {e}");
            if let Err(t) = uninterrupted(|| outputs.close_trace(&[], Some(&why))) {
                eprintln!("error: {t:#}");
            }
            return Err(flat(e));
        }
    };
    let report = &finished.report;
    if let Some(e) = console.write_error {
        let why = format!("{e:#}");
        if let Err(t) = uninterrupted(|| outputs.close_trace(&report.trace, Some(&why))) {
            eprintln!("error: {t:#}");
        }
        return Err(e);
    }
    let signal = interrupts.received();
    for line in finished.summary() {
        println!("{line}");
    }
    let memory = finished.memory();
    let mut table = crate::output::table(&memory.header, &[0, 1, 2, 3, 4]);
    for row in memory.rows {
        table.add_row(row.to_vec());
    }
    println!("{table}");
    for line in memory.notes {
        println!("{line}");
    }
    if let Some(path) = uninterrupted(|| outputs.close_trace(&report.trace, None))? {
        println!("wrote {} (open in https://ui.perfetto.dev)", path.display());
    }
    if let Some(path) = &args.plot {
        uninterrupted(|| {
            let svg = finished
                .loss_curve()
                .map_err(|e| anyhow!("--plot: drawing the loss curve: {e}"))?;
            crate::files::write_output(path, svg.as_bytes())
        })?;
        println!("wrote {} (the loss curve)", path.display());
    }
    if let Some(sig) = signal {
        eprintln!(
            "stopped by {} after {} of {} steps",
            Interrupts::name(sig),
            report.steps.len(),
            args.steps(plan)
        );
        return Ok(Interrupts::exit_code(sig));
    }
    Ok(ExitCode::SUCCESS)
}

/// What the session says, printed: lines, a progress bar over the steps, and each step's JSON
/// line to `--metrics` (a failed write stops the run at that step).
#[derive(Default)]
struct Console {
    outputs: Option<Arc<Outputs>>,
    bar: Option<ProgressBar>,
    last_val: Option<f64>,
    write_error: Option<anyhow::Error>,
}

impl Observer for Console {
    fn say(&mut self, line: &str) {
        println!("{line}");
    }

    fn warn(&mut self, line: &str) {
        eprintln!("{line}");
    }

    fn begin(&mut self, steps: u64) {
        let bar = ProgressBar::new(steps);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}")
                .expect("a valid template"),
        );
        self.bar = Some(bar);
    }

    fn step(&mut self, m: &StepMetrics) -> bool {
        self.last_val = m.val_loss.or(self.last_val);
        if let Some(bar) = &self.bar {
            bar.set_position(m.step as u64 + 1);
            bar.set_message(progress(m, self.last_val));
        }
        let (Some(out), None) = (&self.outputs, &self.write_error) else {
            return true;
        };
        match out.line(&json_line(m).to_string()) {
            Ok(()) => true,
            Err(e) => {
                // Stop at this step: the rest of the run could not be recorded.
                self.write_error = Some(e.context(format!("step {}: the run stops here", m.step)));
                false
            }
        }
    }

    fn end(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}
