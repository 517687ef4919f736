//! `tessera run plan.json`: train for real as the plan says, and compare with its predictions.
//!
//! Under a launcher (`tessera launch`, torchrun, Slurm: `RANK` / `WORLD_SIZE` set) every rank
//! process first meets the others (`tessera_runtime::launch::rendezvous`) and checks that they
//! all run the same plan. The CPU backend then trains every rank as a thread of rank 0's
//! process, and the other processes wait for rank 0 and exit with its outcome (docs/cuda.md,
//! "Launching").

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use tessera_planner::plan::Plan;
use tessera_planner::spec::DeviceKind;
use tessera_runtime::cuda::{device_collective, CudaLauncher};
use tessera_runtime::data::Tokens;
use tessera_runtime::exec::{self, chrome_trace, TrainOptions};
use tessera_runtime::gpu::Device;
use tessera_runtime::launch::env::LaunchEnv;
use tessera_runtime::launch::rendezvous::{rendezvous, RendezvousError};
use tessera_runtime::launch::EXIT_PEER_FAILED;

use crate::files::{check_outputs, named, write_output, LineStream};
use crate::output::table;
use crate::signals::Interrupts;

/// The text the default run trains on (ships with the repository, so it works offline).
const DEFAULT_DATA: &str = "examples/data/parallelism.txt";

#[derive(Clone, Copy, ValueEnum, PartialEq, Debug)]
enum Backend {
    /// f32 on the host CPU, threads as ranks.
    Cpu,
    /// NVIDIA GPUs (needs a build with `--features cuda`).
    Cuda,
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

#[derive(Args)]
pub struct RunArgs {
    /// A plan written by `tessera plan -o`.
    plan: PathBuf,
    /// Optimizer steps to run (at least 1).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    steps: u64,
    /// Training data: UTF-8 text (byte tokens) or a token file (.bin u16, .u32 u32, little-endian).
    #[arg(long, default_value = DEFAULT_DATA)]
    data: PathBuf,
    /// Seed of the weights and of the data order.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Peak learning rate (warm-up, then cosine decay to a tenth of it).
    #[arg(long, default_value_t = 3e-3, value_parser = learning_rate)]
    lr: f32,
    /// Write one JSON line per step (step, loss, step_time_s, tokens_per_s).
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Write a Chrome trace (Perfetto-readable) of the executed schedule, one track per rank.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
    /// GPU runs: how ranks exchange data.
    #[arg(long, value_enum, default_value_t = Collectives::Auto)]
    collectives: Collectives,
    /// Test hook: under a launcher, the process with this RANK fails before the rendezvous.
    #[arg(long, hide = true)]
    fail_rank: Option<usize>,
}

/// `--lr`: a finite number above zero (f32: at most about 3.4e38).
fn learning_rate(text: &str) -> Result<f32, String> {
    let v: f32 = text
        .trim()
        .parse()
        .map_err(|e| format!("not a number ({e}); pass a learning rate such as 3e-4"))?;
    if !v.is_finite() || v <= 0.0 {
        return Err(format!(
            "the learning rate must be a finite number above 0, found {v}; pass one such as 3e-4"
        ));
    }
    Ok(v)
}

/// The runtime's own conditions on a plan for a CPU cluster (what it implements, how many
/// ranks), checked by `plan`, `validate` and `run` alike; `file` is named in the error.
pub fn check_runnable(plan: &Plan, file: &std::path::Path) -> anyhow::Result<()> {
    if plan.job.cluster.device.kind != DeviceKind::Cpu {
        return Ok(());
    }
    exec::check_supported(plan).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))
}

/// Bytes of host memory a CPU run of `plan` needs: f32 weights, gradients and Adam moments for
/// every rank's parameters (ZeRO shards the moments), plus the plan's activations at 4 bytes
/// instead of 2. The CPU runtime computes attention eagerly, so a plan that assumes flash
/// attention also needs the s×s scores the plan does not count. In f64: never wraps.
fn host_bytes_needed(plan: &Plan) -> f64 {
    let p = &plan.parallel;
    let a = &plan.job.model.architecture;
    let t = &plan.job.model.training;
    let shard = if p.zero_stage >= 1 { p.dp as f64 } else { 1.0 };
    let scores_per_layer = if t.attention == tessera_planner::model::AttentionImpl::Flash {
        4.0 * p.micro_batch as f64 * (a.heads / p.tp) as f64 * (t.seq_len as f64).powi(2)
    } else {
        0.0
    };
    plan.predicted
        .memory
        .per_stage
        .iter()
        .map(|s| {
            let act: f64 = s
                .terms
                .iter()
                .filter(|t| t.kind == "activations")
                .map(|t| t.bytes as f64)
                .sum();
            let scores = scores_per_layer * s.layers as f64 * s.in_flight as f64;
            let states = s.params_per_rank as f64 * (8.0 + 8.0 / shard);
            (states + 2.0 * act + scores) * (p.dp * p.tp) as f64
        })
        .sum()
}

/// Why a plan cannot run on the CUDA backend here, with the fix.
fn cuda_refusal(args: &RunArgs, plan: &Plan, problem: &str) -> String {
    let cluster = &plan.job.cluster;
    let why = if args.backend == Backend::Cuda {
        "--backend cuda"
    } else {
        "a GPU cluster"
    };
    format!(
        "{}: this plan is for {} × {} ({why}); running it needs the CUDA backend: {problem}",
        args.plan.display(),
        cluster.devices,
        cluster.device.name,
    )
}

/// The GPUs a run may use, or why there are none.
fn gpus_here(args: &RunArgs, plan: &Plan) -> anyhow::Result<usize> {
    let cpu =
        "plan for a CPU cluster (specs/clusters/cpu-8.toml) to train here with the CPU backend";
    let problem = match tessera_runtime::cuda::devices() {
        Ok(devices) if !devices.is_empty() => return Ok(devices.len()),
        Ok(_) => format!("no GPU is visible\n  fix: {cpu}"),
        Err(tessera_runtime::gpu::GpuError::NotCompiledWithCudaSupport) => format!(
            "this tessera was built without CUDA support\n  fix: build with `cargo build --release --features cuda` on a machine with NVIDIA GPUs (docs/cuda.md), or {cpu}"
        ),
        // The error carries its own fix.
        Err(e) => format!("the CUDA backend is built in, but {e}\n  or {cpu}"),
    };
    bail!("{}", cuda_refusal(args, plan, &problem))
}

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let mut outputs = Vec::new();
    if let Some(p) = &args.metrics {
        outputs.push(named("--metrics", p));
    }
    if let Some(p) = &args.trace {
        outputs.push(named("--trace", p));
    }
    check_outputs(
        &[named("PLAN", &args.plan), named("--data", &args.data)],
        &outputs,
    )?;
    let plan = Plan::load(&args.plan)?;
    let cluster = &plan.job.cluster;
    let launch = LaunchEnv::from_env().context("reading the launch environment")?;
    if args.backend == Backend::Cuda || cluster.device.kind == DeviceKind::Gpu {
        let gpus = gpus_here(&args, &plan)?;
        exec::check_supported(&plan)
            .map_err(|e| anyhow::anyhow!("{}: {e}", args.plan.display()))?;
        if launch.as_ref().is_some_and(|env| env.world_size > 1) {
            bail!(
                "{}: the CUDA backend trains every rank as a thread of one process, on the GPUs it sees; it does not run under a launcher yet\n  fix: run `tessera run {}` once, without `tessera launch` or torchrun",
                args.plan.display(),
                args.plan.display()
            );
        }
        return train_here(&args, &plan, Some(gpus));
    }
    check_runnable(&plan, &args.plan)?;
    match launch {
        Some(env) if env.world_size > 1 => distributed(&args, &plan, &env),
        _ => train_here(&args, &plan, None),
    }
}

/// One rank process of a launched CPU run: rendezvous, check the plan, then rank 0 trains and
/// the others wait for its outcome.
fn distributed(args: &RunArgs, plan: &Plan, env: &LaunchEnv) -> anyhow::Result<ExitCode> {
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
    let digest = format!(
        "plan {:016x}",
        tessera_runtime::gpu::kernels::fnv1a64(&bytes)
    );
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
        let result = train_here(args, plan, None);
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
    match joined.session.wait() {
        Ok(()) => {
            println!("rank {rank}: rank 0 finished");
            Ok(ExitCode::SUCCESS)
        }
        Err(RendezvousError::RootFailed { message }) => {
            eprintln!("error: rank {rank}: stopped because rank 0 failed: {message}");
            Ok(ExitCode::from(EXIT_PEER_FAILED))
        }
        Err(e) => Err(e.into()),
    }
}

/// Trains in this process (every rank a thread): on the CPU, or with `gpus`, rank r on GPU
/// r mod gpus (the device backend, collectives through host memory).
fn train_here(args: &RunArgs, plan: &Plan, gpus: Option<usize>) -> anyhow::Result<ExitCode> {
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
    // Loading holds the file's bytes and the u32 tokens made of them: 5 bytes per byte of text,
    // 3 per byte of a .bin (u16) file, 2 per byte of a .u32 file.
    if let (Ok(m), Some(have)) = (
        std::fs::metadata(&args.data),
        tessera_runtime::calibrate::available_memory_bytes(),
    ) {
        let per_byte = match args.data.extension().and_then(|e| e.to_str()) {
            Some("u32") => 2.0,
            Some("bin") => 3.0,
            _ => 5.0,
        };
        let need_data = m.len() as f64 * per_byte;
        if m.is_file() && need + need_data > have {
            bail!(
                "{}: loading this data file of {} needs about {} of host memory besides the {} of the run, and {} is available\n  fix: train on a smaller file (or a slice of it)",
                args.data.display(),
                tessera_planner::units::bytes(m.len() as f64),
                tessera_planner::units::bytes(need_data),
                tessera_planner::units::bytes(need),
                tessera_planner::units::bytes(have)
            );
        }
    }
    let data = Tokens::load(&args.data)
        .with_context(|| format!("{}: cannot load the training data", args.data.display()))?;
    let world = plan.parallel.world as usize;
    let nccl = match (args.collectives, gpus) {
        (Collectives::Staged, _) | (_, None) => false,
        (Collectives::Nccl, Some(n)) => {
            if world > n {
                bail!(
                    "{}: --collectives nccl needs a GPU per rank, and this plan has {world} ranks on {n} visible GPUs (NCCL refuses two ranks of one communicator on one GPU)\n  fix: use --collectives staged, or plan for {n} devices",
                    args.plan.display()
                );
            }
            tessera_runtime::cuda::probe_nccl()
                .map_err(|e| anyhow::anyhow!("--collectives nccl: {e}"))?;
            true
        }
        (Collectives::Auto, Some(n)) => world <= n && tessera_runtime::cuda::probe_nccl().is_ok(),
    };
    let stop = Arc::new(exec::Stop::new());
    let interrupts = Interrupts::for_run(stop.clone())?;
    let opts = TrainOptions {
        steps: args.steps as usize,
        seed: args.seed,
        max_lr: args.lr,
        min_lr: args.lr / 10.0,
        trace: args.trace.is_some(),
        threads_per_rank: tessera_runtime::calibrate::threads_per_rank(
            plan.parallel.world as usize,
        ),
        stop: Some(stop.clone()),
        ..TrainOptions::default()
    };
    let p = &plan.parallel;
    println!(
        "{}: {} parameters, dp {} × tp {} × pp {} on {} {} ranks, micro-batch {} × {} micro-batches, ZeRO-{}, {} recompute, schedule {}",
        plan.job.model.name,
        plan.job.parameters,
        p.dp,
        p.tp,
        p.pp,
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
    let bar = ProgressBar::new(args.steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}")
            .expect("a valid template"),
    );
    let mut metrics = args.metrics.as_deref().map(LineStream::open).transpose()?;
    let mut write_error = None;
    let mut on_step = |m: &exec::StepMetrics| {
        bar.set_position(m.step as u64 + 1);
        bar.set_message(format!(
            "loss {:.4}  {:.0} tokens/s",
            m.loss, m.tokens_per_s
        ));
        if let (Some(f), None) = (metrics.as_mut(), &write_error) {
            let line = serde_json::json!({"step": m.step, "loss": m.loss, "step_time_s": m.step_time_s, "tokens_per_s": m.tokens_per_s});
            if let Err(e) = f.line(&line.to_string()) {
                // Stop at this step: the rest of the run could not be recorded.
                stop.request();
                write_error = Some(e.context(format!("step {}: the run stops here", m.step)));
            }
        }
    };
    let result = match gpus {
        None => exec::train(plan, &data, &opts, &mut on_step),
        Some(n) => exec::train_on(
            plan,
            &data,
            &opts,
            &mut on_step,
            &|r| Ok(Device::new(CudaLauncher::open(r % n)?)),
            &|dev: &Device<CudaLauncher>, comm| Ok(device_collective(dev, comm, nccl)?),
        ),
    };
    bar.finish();
    if let Some(e) = write_error {
        return Err(e);
    }
    let report = result.map_err(|e| anyhow::anyhow!("{e}"))?;
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
    let mib = |b: u64| format!("{:.1}", b as f64 / (1024.0 * 1024.0));
    let mut mem = table(
        &["rank", "stage", "measured MiB", "predicted MiB"],
        &[0, 1, 2, 3],
    );
    let mesh = tessera_planner::Mesh::new(p.dp, p.pp, p.tp, cluster.gpus_per_node);
    for (r, bytes) in report.peak_bytes.iter().enumerate() {
        let stage = mesh.coord(r as u64).pp as usize;
        let predicted = plan.predicted.memory.per_stage.get(stage);
        mem.add_row(vec![
            r.to_string(),
            stage.to_string(),
            match gpus {
                None => mib(*bytes),
                Some(_) => "-".into(),
            },
            predicted.map_or("-".into(), |s| mib(s.total_bytes)),
        ]);
    }
    println!("{mem}");
    println!(
        "measured: {}; predicted: the plan's per-device total under the \"{}\" precision policy",
        match gpus {
            None => "peak bytes the allocator gave each rank's thread (f32 weights, gradients and Adam moments)",
            Some(_) => "not tracked on GPUs yet",
        },
        plan.job.model.training.precision
    );
    if let Some(path) = &args.trace {
        write_output(path, chrome_trace(&report.trace).as_bytes())?;
        println!("wrote {} (open in https://ui.perfetto.dev)", path.display());
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
