//! `tessera run plan.json`: train for real as the plan says, and compare with its predictions.
//!
//! Under a launcher (`tessera launch`, torchrun, Slurm: `RANK` / `WORLD_SIZE` set) every rank
//! process first meets the others (`tessera_runtime::launch::rendezvous`) and checks that they
//! all run the same plan. The CPU backend then trains every rank as a thread of rank 0's
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
//! Flags are honoured or refused: `--collectives` only means something to the CUDA backend,
//! `--backend cpu` cannot train a GPU cluster's plan, `--fail-rank` only acts under a launcher
//! with several ranks; each is refused (exit 2) where it would be ignored. The default data is
//! built into the binary, so it does not depend on the working directory.

mod checkpoint;
mod checks;
mod data;
mod metrics;
mod optim;
mod outputs;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::{Args, Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use tessera_planner::plan::Plan;
use tessera_planner::spec::DeviceKind;
use tessera_runtime::backend::cuda::Device;
use tessera_runtime::backend::cuda::{device_collective, CudaLauncher};
use tessera_runtime::data::Tokens;
use tessera_runtime::exec::{self, TrainOptions};
use tessera_runtime::launch::env::LaunchEnv;
use tessera_runtime::launch::rendezvous::{rendezvous, RendezvousError};
use tessera_runtime::launch::EXIT_PEER_FAILED;

use crate::signals::{uninterrupted, Interrupts};

use data::{BUNDLED_DATA, BUNDLED_DATA_NAME};
use outputs::Outputs;

use checks::{check_flags, check_run_outputs, gpus_here, host_bytes_needed};
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

/// How a GPU run's ranks exchange data.
#[derive(Clone, Copy, ValueEnum, PartialEq, Debug)]
enum Collectives {
    /// NCCL when every rank has a GPU of its own, else through host memory.
    Auto,
    /// NCCL on the device buffers (each rank needs its own GPU: NCCL refuses two ranks of one
    /// communicator on one GPU).
    Nccl,
    /// Through host memory (any number of ranks per GPU; rank-order sums, bit-reproducible).
    Staged,
}

impl Collectives {
    fn name(self) -> &'static str {
        match self {
            Collectives::Auto => "auto",
            Collectives::Nccl => "nccl",
            Collectives::Staged => "staged",
        }
    }
}

#[derive(Args)]
pub struct RunArgs {
    /// A plan written by `tessera plan -o`.
    plan: PathBuf,
    /// Optimizer steps to run (at least 1).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    steps: u64,
    #[command(flatten)]
    data: data::DataArgs,
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
    checkpoint: checkpoint::CheckpointArgs,
    #[command(flatten)]
    optim: optim::OptimArgs,
    #[command(flatten)]
    report: metrics::MetricsArgs,
}

/// `tessera run`'s arguments on their own, to check what `tessera launch` passes on.
#[derive(Parser)]
#[command(name = "tessera run", bin_name = "tessera run")]
struct RunCommand {
    #[command(flatten)]
    args: RunArgs,
}

impl RunArgs {
    /// Whether the run trains on the bundled text (no `--data`).
    fn bundled_data(&self) -> bool {
        self.data.data.is_none()
    }

    /// Whether the run goes to the CUDA backend: asked for, or a GPU cluster's plan.
    fn on_cuda(&self, plan: &Plan) -> bool {
        match self.backend {
            Some(b) => b == Backend::Cuda,
            None => plan.job.cluster.device.kind == DeviceKind::Gpu,
        }
    }
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
    if args.on_cuda(&plan) {
        let gpus = gpus_here(&args, &plan)?;
        exec::check_supported(&plan)
            .map_err(|e| anyhow::anyhow!("{}: {e}", args.plan.display()))?;
        return train_here(&args, &plan, Some(gpus), &interrupts);
    }
    check_runnable(&plan, &args.plan)?;
    match launch {
        Some(env) if env.world_size > 1 => distributed(&args, &plan, &env, &interrupts),
        _ => train_here(&args, &plan, None, &interrupts),
    }
}

/// One rank process of a launched CPU run: rendezvous, check the plan, then rank 0 trains and
/// the others wait for its outcome.
fn distributed(
    args: &RunArgs,
    plan: &Plan,
    env: &LaunchEnv,
    interrupts: &Interrupts,
) -> anyhow::Result<ExitCode> {
    let (rank, world) = (env.rank, env.world_size);
    if world as u64 != plan.parallel.world {
        bail!(
            "{}: the plan has {} ranks, this launch {world} (WORLD_SIZE)\n  fix: launch {} processes (`tessera launch {} --nproc {}`)",
            args.plan.display(),
            plan.parallel.world,
            plan.parallel.world,
            args.plan.display(),
            plan.parallel.world
        );
    }
    if args.fail_rank == Some(rank) {
        bail!("rank {rank}: injected failure (--fail-rank {rank}), before the rendezvous");
    }
    let cfg = env
        .rendezvous_config(&|k| std::env::var(k).ok())
        .with_context(|| format!("rank {rank}: cannot start the rendezvous"))?;
    let bytes = std::fs::read(&args.plan)
        .with_context(|| format!("{}: cannot read the plan", args.plan.display()))?;
    let digest = format!("plan {:016x}", tessera_runtime::rng::fnv1a64(&bytes));
    let joined = rendezvous(&cfg, || Ok(digest.clone().into_bytes()))
        .with_context(|| format!("rank {rank}: rendezvous"))?;
    if joined.blob != digest.as_bytes() {
        bail!(
            "rank {rank}: {} is not the plan rank 0 runs ({} here, {} there)\n  fix: give every rank the same plan file",
            args.plan.display(),
            digest,
            String::from_utf8_lossy(&joined.blob)
        );
    }
    if joined.session.is_root() {
        println!(
            "rank 0 of {world}: all ranks joined and run the same plan; the CPU backend trains all {world} ranks as threads of this process"
        );
        let result = train_here(args, plan, None, interrupts);
        let outcome = match &result {
            Ok(code) if *code == ExitCode::SUCCESS => Ok(()),
            Ok(_) => Err("rank 0 exited with an error".to_string()),
            Err(e) => Err(format!("{e:#}")),
        };
        if let Err(e) = joined.session.finish(outcome) {
            eprintln!("warning: could not tell the other ranks how the run ended: {e}");
        }
        return result;
    }
    println!(
        "rank {rank} of {world}: joined rank 0 (same plan); the CPU backend trains every rank as a thread of rank 0's process: waiting for it"
    );
    interrupts.waiting_for(Some(format!(
        "rank {rank} was waiting for rank 0, which trains every rank"
    )));
    match joined.session.wait() {
        Ok(()) => {
            println!("rank {rank}: rank 0 finished");
            Ok(ExitCode::SUCCESS)
        }
        Err(RendezvousError::RootFailed { message }) => {
            eprintln!("error: rank {rank}: stopped because rank 0 failed: {message}");
            Ok(ExitCode::from(EXIT_PEER_FAILED))
        }
        // Rank 0 died without a word (killed, crashed): this rank's stop is the consequence,
        // so it exits as a peer's failure and the launcher names rank 0's exit as the cause.
        Err(e @ RendezvousError::RootGone { .. }) => {
            eprintln!("error: {e}");
            Ok(ExitCode::from(EXIT_PEER_FAILED))
        }
        Err(e) => Err(e.into()),
    }
}

/// Trains in this process (every rank a thread): on the CPU, or with `gpus`, rank r on GPU
/// r mod gpus (the device backend, collectives through host memory).
fn train_here(
    args: &RunArgs,
    plan: &Plan,
    gpus: Option<usize>,
    interrupts: &Interrupts,
) -> anyhow::Result<ExitCode> {
    let cluster = &plan.job.cluster;
    let need = if gpus.is_some() {
        0.0
    } else {
        host_bytes_needed(plan)
    };
    if let Some(have) =
        tessera_runtime::calibrate::available_memory_bytes().filter(|_| gpus.is_none())
    {
        if need > have {
            bail!(
                "{}: this CPU run needs about {} of host memory ({} ranks), and {} is available\n  fix: plan a smaller model, a smaller micro-batch or more recompute, or free memory",
                args.plan.display(),
                tessera_planner::units::bytes(need),
                plan.parallel.world,
                tessera_planner::units::bytes(have)
            );
        }
    }
    let loaded = args.data.load(need)?;
    loaded.announce(args.bundled_data());
    let eval = args
        .report
        .eval_set(plan, loaded.val.as_ref())?
        .map(Arc::new);
    let data = loaded.train;
    let world = plan.parallel.world as usize;
    let nccl = match (args.collectives.unwrap_or(Collectives::Auto), gpus) {
        (Collectives::Staged, _) | (_, None) => false,
        (Collectives::Nccl, Some(n)) => {
            if world > n {
                bail!(
                    "{}: --collectives nccl needs a GPU per rank, and this plan has {world} ranks on {n} visible GPUs (NCCL refuses two ranks of one communicator on one GPU)\n  fix: use --collectives staged, or plan for {n} devices",
                    args.plan.display()
                );
            }
            tessera_runtime::backend::cuda::probe_nccl()
                .map_err(|e| anyhow::anyhow!("--collectives nccl: {e}"))?;
            true
        }
        (Collectives::Auto, Some(n)) => {
            world <= n && tessera_runtime::backend::cuda::probe_nccl().is_ok()
        }
    };
    // A checkpoint to resume is opened and checked before any output exists.
    let resume = args.checkpoint.resume(args.steps)?;
    let init = args.checkpoint.init_from(plan)?;
    // The outputs open now, just before the first step; from here on every way out closes
    // them, an exit at once included.
    let outputs = Arc::new(Outputs::open(args, interrupts)?);
    {
        let outputs = outputs.clone();
        interrupts.on_exit(move |sig| outputs.close_at_once(sig));
    }
    let stop = Arc::new(exec::Stop::new());
    interrupts.arm(stop.clone());
    let result = train_with(
        args,
        plan,
        (gpus, nccl),
        &data,
        &outputs,
        &stop,
        (resume, init, eval),
    );
    let (report, write_error) = match result {
        Ok(done) => done,
        Err(e) => {
            let why = format!("the run failed: {e:#}");
            if let Err(t) = uninterrupted(|| outputs.close_trace(&[], Some(&why))) {
                eprintln!("error: {t:#}");
            }
            return Err(e);
        }
    };
    if let Some(e) = write_error {
        let why = format!("{e:#}");
        if let Err(t) = uninterrupted(|| outputs.close_trace(&report.trace, Some(&why))) {
            eprintln!("error: {t:#}");
        }
        return Err(e);
    }
    let signal = interrupts.received();
    let (first, last) = (report.steps.first(), report.steps.last());
    if let (Some(a), Some(b)) = (first, last) {
        println!(
            "loss {:.4} → {:.4} over {} steps",
            a.loss,
            b.loss,
            report.steps.len()
        );
    }
    let evals: Vec<_> = report
        .steps
        .iter()
        .filter_map(|m| m.val_loss.map(|v| (m.step + 1, v)))
        .collect();
    if let (Some(a), Some(b)) = (evals.first(), evals.last()) {
        println!(
            "validation loss {:.4} (after step {}) → {:.4} (after step {}), {} evaluations",
            a.1,
            a.0,
            b.1,
            b.0,
            evals.len()
        );
    }
    // Measured against predicted. Steps after the first exclude one-time allocation.
    let timed: Vec<f64> = report.steps.iter().skip(1).map(|m| m.step_time_s).collect();
    if !timed.is_empty() {
        let mean = timed.iter().sum::<f64>() / timed.len() as f64;
        let t = &plan.job.model.training;
        println!(
            "step time {:.4} s measured (mean of steps 2..{}), {:.0} tokens/s; predicted {:.4} s ({:.2}× measured){}",
            mean,
            report.steps.len(),
            (t.global_batch * t.seq_len) as f64 / mean,
            plan.predicted.step_time_s,
            plan.predicted.step_time_s / mean,
            match (
                plan.job.cluster.device.kind == DeviceKind::Cpu,
                plan.job.cluster.calibrated,
            ) {
                (true, false) => {
                    " — this CPU cluster spec is nominal: `tessera calibrate` measures this host"
                }
                (true, true) => " — on the cluster spec's measured constants",
                _ => "",
            }
        );
    }
    metrics::memory_report(
        plan,
        &report.peak_bytes,
        gpus.is_some(),
        cluster.gpus_per_node,
    );
    if let Some(path) = uninterrupted(|| outputs.close_trace(&report.trace, None))? {
        println!("wrote {} (open in https://ui.perfetto.dev)", path.display());
    }
    if let Some(path) = &args.report.plot {
        let title = format!("{}: loss against training tokens", plan.job.model.name);
        uninterrupted(|| metrics::write_plot(path, &title, &report.steps))?;
        println!("wrote {} (the loss curve)", path.display());
    }
    if let Some(sig) = signal {
        eprintln!(
            "stopped by {} after {} of {} steps",
            Interrupts::name(sig),
            report.steps.len(),
            args.steps
        );
        return Ok(Interrupts::exit_code(sig));
    }
    Ok(ExitCode::SUCCESS)
}

/// What a run starts from besides the plan and the data: a checkpoint to resume, initial
/// weights, and the validation sequences to evaluate.
type StartFrom = (
    Option<Arc<tessera_runtime::checkpoint::Checkpoint>>,
    Option<Arc<exec::InitialParams>>,
    Option<Arc<exec::EvalSet>>,
);

/// The steps themselves: returns the report, and the metrics write that failed (the run stops
/// at that step).
fn train_with(
    args: &RunArgs,
    plan: &Plan,
    (gpus, nccl): (Option<usize>, bool),
    data: &Tokens,
    outputs: &Outputs,
    stop: &Arc<exec::Stop>,
    (resume, init, eval): StartFrom,
) -> anyhow::Result<(exec::TrainReport, Option<anyhow::Error>)> {
    let (optimizer, schedule) = args.optim.settings(plan)?;
    let opts = TrainOptions {
        steps: args.steps as usize,
        seed: args.seed,
        optimizer: Some(optimizer),
        schedule: Some(schedule),
        trace: args.trace.is_some(),
        threads_per_rank: tessera_runtime::calibrate::threads_per_rank(
            plan.parallel.world as usize,
        ),
        stop: Some(stop.clone()),
        save: args.checkpoint.save(args.steps),
        resume,
        init,
        fault: args.fault,
        eval,
    };
    if let Some(ck) = &opts.resume {
        optim::note_resume(ck, &opts, plan);
    }
    let p = &plan.parallel;
    println!(
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
            Some(n) => format!(
                "GPU (on {n} visible GPUs, collectives {})",
                if nccl { "on NCCL" } else { "through host memory" }
            ),
        },
        p.micro_batch,
        p.microbatches,
        p.zero_stage,
        p.recompute.name(),
        p.schedule.name()
    );
    if args.bundled_data() {
        println!(
            "data: the bundled {BUNDLED_DATA_NAME} ({} bytes, built into tessera); --data FILE trains on your own",
            BUNDLED_DATA.len()
        );
    }
    let bar = ProgressBar::new(args.steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}")
            .expect("a valid template"),
    );
    let mut write_error = None;
    let mut last_val = None;
    let mut on_step = |m: &exec::StepMetrics| {
        bar.set_position(m.step as u64 + 1);
        last_val = m.val_loss.or(last_val);
        bar.set_message(metrics::progress(m, last_val));
        if write_error.is_none() {
            let line = metrics::json_line(m);
            if let Err(e) = outputs.line(&line.to_string()) {
                // Stop at this step: the rest of the run could not be recorded.
                stop.request();
                write_error = Some(e.context(format!("step {}: the run stops here", m.step)));
            }
        }
    };
    let result = match gpus {
        None => exec::train(plan, data, &opts, &mut on_step),
        Some(n) => exec::train_on(
            plan,
            data,
            &opts,
            &mut on_step,
            &|r| Ok(Device::new(CudaLauncher::open(r % n)?)),
            &|dev: &Device<CudaLauncher>, comm| Ok(device_collective(dev, comm, nccl)?),
        ),
    };
    bar.finish();
    let report = result.map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((report, write_error))
}
