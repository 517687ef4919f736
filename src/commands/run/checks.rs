//! What `tessera run` refuses before anything starts: a plan the runtime cannot run here,
//! flags the chosen backend or launch would ignore, outputs that are inputs or cannot be written;
//! and the same checks for what `tessera launch` passes on to each rank.

use std::ffi::OsString;
use std::path::Path;

use anyhow::{anyhow, bail};
use clap::Parser;
use tessera_planner::plan::Plan;
use tessera_planner::spec::DeviceKind;
use tessera_runtime::exec;

use crate::files::{check_outputs, check_outside, named};
use crate::signals::uninterrupted;

use super::{Backend, RunArgs, RunCommand};

/// The runtime's own conditions on a plan for a CPU cluster (what it implements, how many
/// ranks), checked by `plan`, `validate` and `run` alike; `file` is named in the error.
pub fn check_runnable(plan: &Plan, file: &std::path::Path) -> anyhow::Result<()> {
    if plan.job.cluster.device.kind != DeviceKind::Cpu {
        return Ok(());
    }
    exec::check_supported(plan).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))
}

/// A plan with an FP8 recipe runs on neither backend yet: the CPU backend computes in f32 and
/// has no FP8 GEMM; the CUDA backend's (cuBLASLt's FP8 GEMM) is not written. Refused before
/// anything starts, rather than trained in 16-bit under an FP8 plan's name.
pub(super) fn check_fp8(plan: &Plan, file: &Path, cuda: bool) -> anyhow::Result<()> {
    let recipe = plan.job.model.training.fp8;
    if recipe.is_none() {
        return Ok(());
    }
    let (problem, fix) = if cuda {
        (
            "the CUDA backend's executor has no FP8 GEMM yet (the cuBLASLt FP8 linear is written, not yet called)",
            format!("run the plan's export with an engine that runs FP8 ({}), or re-plan with fp8 = \"none\"", recipe.runs_on()),
        )
    } else {
        (
            "the CPU backend computes in f32 and has no FP8 GEMM: FP8 GEMMs run on the CUDA backend",
            "re-plan with fp8 = \"none\" (training.fp8, --fp8 none) to run on the CPU".to_string(),
        )
    };
    bail!(
        "{}: the plan's training.fp8 is \"{recipe}\": {problem}\n  fix: {fix}",
        file.display()
    )
}

/// A plan predicted with its TP collectives overlapped (`training.tp_comm_overlap`, TP > 1)
/// runs them between the GEMMs here: the same arithmetic, a slower step than the plan's.
pub(super) fn tp_overlap_note(plan: &Plan) -> Option<String> {
    (plan.job.model.training.tp_comm_overlap && plan.parallel.tp > 1).then(|| {
        "note: the plan's step time counts the TP collectives overlapped with their GEMMs (training.tp_comm_overlap); this runtime runs them between the GEMMs, so its steps take longer than predicted".to_string()
    })
}

/// Why a plan cannot run on the CUDA backend here, with the fix.
pub(super) fn cuda_refusal(args: &RunArgs, plan: &Plan, problem: &str) -> String {
    let cluster = &plan.job.cluster;
    let why = if args.backend == Some(Backend::Cuda) {
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
pub(super) fn gpus_here(args: &RunArgs, plan: &Plan) -> anyhow::Result<usize> {
    let cpu =
        "plan for a CPU cluster (specs/clusters/cpu-8.toml) to train here with the CPU backend";
    let problem = match tessera_runtime::backend::cuda::devices() {
        Ok(devices) if !devices.is_empty() => return Ok(devices.len()),
        Ok(_) => format!("no GPU is visible\n  fix: {cpu}"),
        Err(tessera_runtime::backend::GpuError::NotCompiledWithCudaSupport) => format!(
            "this tessera was built without CUDA support\n  fix: build with `cargo build --release --features cuda` on a machine with NVIDIA GPUs (docs/cuda.md), or {cpu}"
        ),
        // The error carries its own fix.
        Err(e) => format!("the CUDA backend is built in, but {e}\n  or {cpu}"),
    };
    bail!("{}", cuda_refusal(args, plan, &problem))
}

/// Flags that the chosen backend or this launch would ignore, and a `--data` file that is not
/// there: refused before anything starts. `launched`: the world size under a launcher with
/// several ranks; `reads_data`: this process (rank 0, or a process alone) will load the data.
pub(super) fn check_flags(
    args: &RunArgs,
    plan: &Plan,
    launched: Option<usize>,
    reads_data: bool,
) -> anyhow::Result<()> {
    args.options(plan, None).check(plan).map_err(super::flat)?;
    // `--save-every auto` needs the plan's interval: refused here, before any rank starts.
    if let Some(every) = args.checkpoint.save_every {
        every.steps(plan).map_err(super::flat)?;
    }
    let shown = args.plan.display();
    let cluster = &plan.job.cluster;
    let gpu_plan = cluster.device.kind == DeviceKind::Gpu;
    if args.backend == Some(Backend::Cpu) && gpu_plan {
        bail!(
            "--backend cpu: {shown} is a plan for {} × {} (a GPU cluster), and the CPU backend trains plans for CPU clusters only\n  fix: drop --backend cpu to train it on the CUDA backend, or plan for a CPU cluster (specs/clusters/cpu-8.toml) to train it here",
            cluster.devices,
            cluster.device.name
        );
    }
    let cuda = args.on_cuda(plan);
    if let (Some(c), false) = (args.collectives, cuda) {
        bail!(
            "--collectives {}: this run is on the CPU backend ({shown} is a plan for a CPU cluster), whose ranks are threads that exchange data through host memory; --collectives picks how GPU ranks exchange data, so it would be ignored\n  fix: drop --collectives, or add --backend cuda to train on GPUs",
            c.name()
        );
    }
    if cuda && launched.is_some() {
        bail!(
            "{shown}: the CUDA backend trains every rank as a thread of one process, on the GPUs it sees; it does not run under a launcher yet{}\n  fix: run `tessera run {shown}` once, without `tessera launch` or torchrun",
            match args.backend {
                Some(b) => format!(" (--backend {})", b.name()),
                None => " (a GPU cluster's plan)".into(),
            }
        );
    }
    if let Some(r) = args.fail_rank {
        match launched {
            None => bail!(
                "--fail-rank {r} is a test hook of runs launched with several ranks (the process with RANK {r} fails before the rendezvous), and this run is not one: it would be ignored\n  fix: drop --fail-rank, or run under `tessera launch`"
            ),
            Some(world) if r >= world => bail!(
                "--fail-rank {r}: this launch has ranks 0..{world}, so no process would fail\n  fix: pass a rank below {world}"
            ),
            Some(_) => {}
        }
    }
    if let Some(f) = args.fault.filter(|f| f.rank as u64 >= plan.parallel.world) {
        bail!(
            "--fault {f}: this plan has ranks 0..{}, so no rank would fail\n  fix: pass a rank below {}",
            plan.parallel.world,
            plan.parallel.world
        );
    }
    if reads_data {
        args.data.check().map_err(super::flat)?;
        args.checkpoint.check().map_err(super::flat)?;
    }
    Ok(())
}

/// Refuses outputs that are inputs or cannot be written; the probe files it makes are never
/// left behind by a signal.
pub(super) fn check_run_outputs(args: &RunArgs) -> anyhow::Result<()> {
    let mut outputs = Vec::new();
    if let Some(p) = &args.metrics {
        outputs.push(named("--metrics", p));
    }
    if let Some(p) = &args.trace {
        outputs.push(named("--trace", p));
    }
    if let Some(p) = &args.plot {
        outputs.push(named("--plot", p));
    }
    let mut inputs = vec![named("PLAN", &args.plan)];
    for (flag, p) in [
        ("--data", &args.data.data),
        ("--val-data", &args.data.val_data),
    ] {
        if let Some(p) = p {
            inputs.push(named(flag, p));
        }
    }
    uninterrupted(|| check_outputs(&inputs, &outputs))?;
    let c = &args.checkpoint;
    let mut folders = Vec::new();
    if let Some(dir) = &c.save_dir {
        folders.push((named("--save-dir", dir), "writes"));
    }
    if let Some(p) = c.resume.as_deref().filter(|p| *p != "auto") {
        folders.push((named("--resume", Path::new(p)), "reads"));
    }
    check_outside(&outputs, &folders)
}

/// Checks what follows `--` in `tessera launch PLAN -- ARGS` as each rank's
/// `tessera run PLAN ARGS` would check it, launched with `world` ranks (`hosts_rank_0`: this
/// node runs rank 0, which reads the data): nothing starts when a rank would refuse it.
pub fn check_launched(
    plan_path: &Path,
    plan: &Plan,
    args: &[OsString],
    world: usize,
    hosts_rank_0: bool,
) -> anyhow::Result<()> {
    let argv = [
        OsString::from("tessera run"),
        plan_path.as_os_str().to_owned(),
    ]
    .into_iter()
    .chain(args.iter().cloned());
    let parsed = RunCommand::try_parse_from(argv).map_err(|e| {
        // clap's first paragraph is the error; its usage and tips follow.
        let text = e.render().to_string();
        let first = text.trim().split("\n\n").next().unwrap_or_default().to_string();
        anyhow!(
            "the arguments after `--` are passed to `tessera run`, which refuses them: {}\n  fix: pass only `tessera run` flags after `--` (`tessera run --help` lists them)",
            first.trim_start_matches("error: ")
        )
    })?;
    let args = parsed.args;
    check_run_outputs(&args)?;
    check_flags(&args, plan, (world > 1).then_some(world), hosts_rank_0)
}
