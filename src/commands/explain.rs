//! `tessera explain plan.json`: the per-stage memory table with the reason for each term.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use tessera_planner::plan::Plan;

use crate::output::memory_tables;

#[derive(Args)]
pub struct ExplainArgs {
    /// A plan written by `tessera plan -o`.
    plan: PathBuf,
    /// Show every stage's terms, not only the peak stage's.
    #[arg(long)]
    all_stages: bool,
}

pub fn run(args: ExplainArgs) -> anyhow::Result<ExitCode> {
    let plan = Plan::load(&args.plan)?;
    let p = &plan.parallel;
    println!(
        "{} on {} devices of {}: dp {} × tp {} × pp {}, micro-batch {} × {} micro-batches, ZeRO-{}, {} recompute, schedule {}{}",
        plan.job.model.name,
        p.world,
        plan.job.cluster.name,
        p.dp,
        p.tp,
        p.pp,
        p.micro_batch,
        p.microbatches,
        p.zero_stage,
        p.recompute.name(),
        p.schedule.name(),
        if plan.feasible { "" } else { "  [INFEASIBLE: does not fit]" }
    );
    println!(
        "peak {:.2} GiB on stage {} of {:.2} GiB\n",
        plan.predicted.memory.peak_bytes as f64 / tessera_planner::spec::GIB,
        plan.predicted.memory.peak_stage,
        plan.predicted.memory.capacity_bytes as f64 / tessera_planner::spec::GIB
    );
    print!("{}", memory_tables(&plan.predicted.memory, args.all_stages));
    Ok(ExitCode::SUCCESS)
}
