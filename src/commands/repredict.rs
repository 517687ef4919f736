//! `tessera repredict PLAN -o OUT` (hidden): a plan whose `parallel` section was edited by a
//! script (the export matrix and the export tests derive each offload mode from one base plan
//! that way), written again with its `predicted` section derived from the job, the edited
//! layout and the stages, as `tessera plan` would derive it. The edited layout must pass the
//! same checks `tessera plan` applies (`Layout::check`, `search::pins::effective`); the written
//! plan is read back by `Plan::parse` before it is kept.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use tessera_planner::plan::Plan;
use tessera_planner::source::Source;

use crate::files::{check_outputs, named, write_output};

#[derive(Args)]
pub struct RepredictArgs {
    /// The edited plan.json.
    plan: PathBuf,
    /// Where to write the plan with its prediction derived again.
    #[arg(short, long)]
    output: PathBuf,
}

pub fn run(args: RepredictArgs) -> anyhow::Result<ExitCode> {
    check_outputs(
        &[named("PLAN", &args.plan)],
        &[named("-o/--output", &args.output)],
    )?;
    let text = std::fs::read_to_string(&args.plan)
        .with_context(|| format!("{}: cannot read the plan", args.plan.display()))?;
    let plan: Plan = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a plan.json", args.plan.display()))?;
    let (model, cluster) = (&plan.job.model, &plan.job.cluster);
    let layout = plan.parallel.layout();
    layout
        .check(model, cluster)
        .and_then(|()| tessera_planner::search::pins::effective(&layout, model, cluster))
        .map_err(|why| {
            anyhow::anyhow!(
                "{}: the edited layout {} cannot be planned: {why}",
                args.plan.display(),
                layout.label()
            )
        })?;
    let mut chunks: Vec<(u64, u64)> = plan
        .stages
        .iter()
        .flat_map(|s| s.chunks.iter())
        .map(|c| (c.virtual_stage, c.layers[1] - c.layers[0]))
        .collect();
    chunks.sort();
    let split: Vec<u64> = chunks.into_iter().map(|(_, n)| n).collect();
    let new = Plan::with_split(model, cluster, &layout, &split, plan.search.clone());
    let out = serde_json::to_string_pretty(&new)? + "\n";
    Plan::parse(&Source::from_text(args.output.clone(), &out))?;
    write_output(&args.output, out.as_bytes())?;
    Ok(ExitCode::SUCCESS)
}
