//! The `tessera` command line: parse arguments, call the libraries, print.
//!
//! Each subcommand lives in `commands/<name>.rs`. Input errors exit with code 2 and one message.

mod commands;
mod files;
mod launched;
mod output;
mod signals;
mod sinks;

#[global_allocator]
static ALLOC: tessera_runtime::alloc::TrackingAlloc = tessera_runtime::alloc::TrackingAlloc;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Compile a training job into a 3D-parallel plan, and run it"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Plan a model on a cluster: rank the layouts that fit and write plan.json.
    Plan(Box<commands::plan::PlanArgs>),
    /// Check model specs, cluster specs and plan files.
    Validate(commands::validate::ValidateArgs),
    /// Write a plan as Megatron-LM arguments, a DeepSpeed or torchtitan config, or a Slurm or
    /// Kubernetes job.
    Export(commands::export::ExportArgs),
    /// Show what changed between two plans (exit 1 when they differ, as diff does).
    Diff(commands::diff::DiffArgs),
    /// Plan a plan's job again on more or fewer devices and show what changed.
    Replan(commands::replan::ReplanArgs),
    /// Print a plan's per-stage memory, with the reason for each term.
    Explain(commands::explain::ExplainArgs),
    /// Train as a plan says (CPU backend: threads as ranks) and compare with its predictions.
    Run(Box<commands::run::RunArgs>),
    /// Generate text from a checkpoint on the CPU, to see what the model learned.
    Sample(commands::sample::SampleArgs),
    /// Prepare training data: tokenize text into llm.c shards (`tessera data prepare`).
    Data(commands::data::DataArgs),
    /// Start one `tessera run` process per local rank and stop them all if one fails.
    Launch(commands::launch::LaunchArgs),
    /// Check this machine's GPU environment: driver, libraries, devices, kernel compilation.
    Doctor(commands::doctor::DoctorArgs),
    /// Measure this host for the CPU backend and write a calibrated cluster spec.
    Calibrate(commands::calibrate::CalibrateArgs),
    /// Inspect a checkpoint of `tessera run --save-dir`, or export it as a Hugging Face model.
    Checkpoint(commands::checkpoint::CheckpointArgs),
    /// Replay the published runs of runs.toml through the planner; write docs/validation.md.
    #[command(hide = true)]
    ValidatePlanner(commands::validate_planner::ValidatePlannerArgs),
    /// Derive an edited plan's prediction again (scripts and tests that edit `parallel`).
    #[command(hide = true)]
    Repredict(commands::repredict::RepredictArgs),
}

fn main() -> ExitCode {
    // Behave like other Unix tools when the reader goes away (`tessera plan … | head`): end
    // quietly instead of panicking on a broken pipe.
    #[cfg(unix)]
    // SAFETY: restoring the default action of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(args) => commands::plan::run(*args),
        Command::Validate(args) => commands::validate::run(args),
        Command::Diff(args) => commands::diff::run(args),
        Command::Export(args) => commands::export::run(args),
        Command::Replan(args) => commands::replan::run(args),
        Command::Explain(args) => commands::explain::run(args),
        Command::Run(args) => commands::run::run(*args),
        Command::Sample(args) => commands::sample::run(args),
        Command::Data(args) => commands::data::run(args),
        Command::Launch(args) => commands::launch::run(args),
        Command::Doctor(args) => commands::doctor::run(args),
        Command::Calibrate(args) => commands::calibrate::run(args),
        Command::Checkpoint(args) => commands::checkpoint::run(args),
        Command::ValidatePlanner(args) => commands::validate_planner::run(args),
        Command::Repredict(args) => commands::repredict::run(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
