//! `tessera replan plan.json (--devices N | --nodes N) [-o new-plan.json] [pins]`: plan the same
//! job (model, cluster spec, global batch, sequence length) on a smaller or larger cluster with
//! `tessera plan`'s search, and print what changed (`tessera diff`'s tables). A checkpoint of
//! the old plan then continues on the new one: `tessera run new-plan.json --resume DIR`
//! reshards it.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use tessera_planner::plan::diff::diff;
use tessera_planner::plan::Plan;
use tessera_planner::search::{self, Pins, SearchOptions};
use tessera_planner::{Cluster, Diagnostic};

use crate::files::{check_outputs, named, write_output};

#[derive(Args)]
pub struct ReplanArgs {
    /// The plan to re-plan (its model, cluster spec and training settings are kept).
    plan: PathBuf,
    /// Plan for this many devices of the plan's cluster (may be fewer than one node).
    #[arg(long, conflicts_with = "nodes", required_unless_present = "nodes")]
    devices: Option<u64>,
    /// Plan for this many nodes of the plan's cluster.
    #[arg(long)]
    nodes: Option<u64>,
    /// Write the new plan to this file.
    #[arg(short, long)]
    output: Option<PathBuf>,
    #[command(flatten)]
    degrees: super::plan::DegreePins,
    /// Pin sequence parallelism off.
    #[arg(long)]
    no_sp: bool,
}

fn cli_error(field: &str, problem: String, fix: String) -> anyhow::Error {
    anyhow::anyhow!(Diagnostic::new("<command line>", field, problem, fix))
}

impl ReplanArgs {
    fn pins(&self) -> Pins {
        Pins {
            sp: self.no_sp.then_some(false),
            ..self.degrees.pins()
        }
    }

    /// The flag that sets the count, and the count.
    fn count(&self) -> (&'static str, u64) {
        match (self.devices, self.nodes) {
            (Some(n), _) => ("--devices", n),
            (None, Some(n)) => ("--nodes", n),
            (None, None) => unreachable!("clap requires --devices or --nodes"),
        }
    }

    /// The plan's cluster with the new count.
    fn cluster(&self, old: &Cluster) -> anyhow::Result<Cluster> {
        let (flag, n) = self.count();
        let g = old.gpus_per_node;
        let (nodes, devices) = match flag {
            "--devices" => (n.div_ceil(g), Some(n)),
            _ => (n, n.checked_mul(g)),
        };
        let Some(devices) = devices.filter(|_| n > 0) else {
            return Err(cli_error(
                flag,
                format!("must be between 1 and {}, found {n}", u64::MAX / g),
                format!("pass {flag} 1 or more"),
            ));
        };
        let cluster = Cluster {
            nodes,
            devices,
            ..old.clone()
        };
        cluster.check().map_err(|p| {
            cli_error(
                flag,
                format!("{n} gives a cluster whose `{}` {}", p.field, p.problem),
                format!("pass another {flag}: {}", p.fix),
            )
        })?;
        Ok(cluster)
    }
}

pub fn run(args: ReplanArgs) -> anyhow::Result<ExitCode> {
    if let Some(out) = &args.output {
        check_outputs(&[named("PLAN", &args.plan)], &[named("-o/--output", out)])?;
    }
    let old = Plan::load(&args.plan)?;
    let (flag, n) = args.count();
    let cluster = args.cluster(&old.job.cluster)?;
    let model = old.job.model.clone();
    let pins = args.pins();
    for (pin, v) in [("--tp", pins.tp), ("--pp", pins.pp), ("--dp", pins.dp)] {
        if let Some(v) = v.filter(|&v| v == 0 || cluster.devices % v != 0) {
            return Err(cli_error(
                pin,
                format!("{pin} {v} does not divide the {} devices", cluster.devices),
                format!(
                    "pass {pin} as a divisor of {}: {}",
                    cluster.devices,
                    search::divisors::listed(cluster.devices)
                ),
            ));
        }
    }
    let options = SearchOptions {
        top: 3,
        cost: tessera_planner::cost::Options::for_model(&model, &cluster),
    };
    let result = search::search_checked(&model, &cluster, &pins, options)
        .map_err(|e| anyhow::anyhow!("{}: {e}", args.plan.display()))?;
    if result.evaluated == 0 {
        let why: Vec<String> = result
            .rejected
            .values()
            .take(3)
            .map(|g| g.example.clone())
            .collect();
        return Err(cli_error(
            flag,
            format!(
                "no layout of {} devices can be built for {}: {}",
                cluster.devices,
                model.name,
                why.join("; ")
            ),
            format!(
                "pass a {flag} count that the global batch ({}), the heads ({}) and the layers ({}) can be split over",
                model.training.global_batch, model.architecture.heads, model.architecture.layers
            ),
        ));
    }
    let Some(plan) = super::plan::chosen_plan(&model, &cluster, &result, options.top) else {
        return Err(cli_error(
            flag,
            format!(
                "{} layouts of {} devices, and none fits in the devices' memory",
                result.evaluated, cluster.devices
            ),
            format!("pass a larger {flag} than {n}"),
        ));
    };
    super::run::check_runnable(&plan, &args.plan)?;
    if let Some(out) = &args.output {
        write_output(out, plan.to_json().as_bytes())?;
    }
    println!(
        "{}: {} on {} devices ({}), was {} on {}",
        args.plan.display(),
        plan.parallel.layout().label(),
        plan.job.cluster.devices,
        model.name,
        old.parallel.layout().label(),
        old.job.cluster.devices
    );
    println!("predicted step {:.3} s\n", plan.predicted.step_time_s);
    super::diff::print(&diff(&old, &plan));
    match &args.output {
        Some(out) => println!(
            "wrote {}; continue a checkpoint of the old plan with `tessera run {} --resume DIR`",
            out.display(),
            out.display()
        ),
        None => println!("pass -o new-plan.json to write the plan"),
    }
    Ok(ExitCode::SUCCESS)
}
