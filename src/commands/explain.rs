//! `tessera explain plan.json`: the per-stage memory table with the reason for each term, and
//! with `--svg` a picture of the plan.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use tessera_planner::framework::Reports;
use tessera_planner::picture;
use tessera_planner::plan::Plan;

use tessera_planner::units;

use crate::files::{check_outputs, named, write_output};
use crate::output::memory_tables;

#[derive(Args)]
pub struct ExplainArgs {
    /// A plan written by `tessera plan -o`.
    plan: PathBuf,
    /// Show every stage's terms, not only the peak stage's.
    #[arg(long)]
    all_stages: bool,
    /// Write a picture of the plan (SVG): the summary; per pipeline stage, the device memory as
    /// a stacked bar of every named term against the device's capacity; and one step's
    /// predicted time per stage (compute, exposed communication, bubble, optimizer).
    #[arg(long, value_name = "FILE.svg")]
    svg: Option<PathBuf>,
}

pub fn run(args: ExplainArgs) -> anyhow::Result<ExitCode> {
    if let Some(svg) = &args.svg {
        check_outputs(&[named("PLAN", &args.plan)], &[named("--svg", svg)])?;
    }
    let plan = Plan::load(&args.plan)?;
    if let Some(svg) = &args.svg {
        let picture = picture::plan_svg(&plan, &picture::headline(&plan))?;
        write_output(svg, picture.as_bytes())?;
    }
    let p = &plan.parallel;
    println!(
        "{} on {} devices of {}: dp {}{} × tp {} × pp {}{}, micro-batch {} × {} micro-batches, ZeRO-{}, {} recompute, schedule {}{}",
        plan.job.model.name,
        p.world,
        plan.job.cluster.name,
        p.dp,
        if p.cp > 1 {
            format!(" × cp {}", p.cp)
        } else {
            String::new()
        },
        p.tp,
        p.pp,
        if p.ep > 1 {
            format!(" (ep {} over dp × cp)", p.ep)
        } else {
            String::new()
        },
        p.micro_batch,
        p.microbatches,
        p.zero_stage,
        p.recompute.name(),
        p.schedule.name(),
        if plan.feasible { "" } else { "  [INFEASIBLE: does not fit]" }
    );
    println!(
        "peak {} on stage {} of {}\n",
        units::bytes(plan.predicted.memory.peak_bytes as f64),
        plan.predicted.memory.peak_stage,
        units::bytes(plan.predicted.memory.capacity_bytes as f64)
    );
    let profile = tessera_planner::framework::of(&plan.job.model, &plan.job.cluster);
    println!(
        "{}\n",
        match profile.memory.reports {
            Reports::Reserved => format!(
                "memory as {} reports it: torch.cuda.max_memory_reserved(), what the caching allocator holds (the allocator_reserved term)",
                profile.name
            ),
            Reports::Allocated => format!(
                "memory as {} reports it: the allocated tensors (torch.cuda.max_memory_allocated()), every term but the overhead ones",
                profile.name
            ),
        }
    );
    println!(
        "uncertain: {}\n",
        tessera_planner::memory::uncertainty(profile, &plan.job.cluster)
    );
    super::plan::print_whole_run(&plan);
    super::plan::print_fp8(&plan);
    print!("{}", memory_tables(&plan.predicted.memory, args.all_stages));
    Ok(ExitCode::SUCCESS)
}
