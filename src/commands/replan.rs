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

    /// The pins given, each as (flag, flag and value, these pins with it left free).
    fn pinned(&self) -> Vec<(&'static str, String, Pins)> {
        let p = self.pins();
        let mut out = Vec::new();
        let mut add = |flag: &'static str, v: Option<String>, freed: Pins| {
            if let Some(v) = v {
                out.push((flag, format!("{flag} {v}"), freed));
            }
        };
        let show = |v: Option<u64>| v.map(|v| v.to_string());
        add("--tp", show(p.tp), Pins { tp: None, ..p });
        add("--pp", show(p.pp), Pins { pp: None, ..p });
        add("--cp", show(p.cp), Pins { cp: None, ..p });
        add("--ep", show(p.ep), Pins { ep: None, ..p });
        add("--dp", show(p.dp), Pins { dp: None, ..p });
        add(
            "--micro-batch",
            show(p.micro_batch),
            Pins {
                micro_batch: None,
                ..p
            },
        );
        add(
            "--zero",
            p.zero.map(|z| z.to_string()),
            Pins { zero: None, ..p },
        );
        if self.no_sp {
            out.push(("--no-sp", "--no-sp".into(), Pins { sp: None, ..p }));
        }
        out
    }

    /// The pin at fault when the pinned search found nothing `ok`: the first pin whose release
    /// makes the search succeed, else all of them together where that does; `None` when the
    /// device count is at fault (or no pin was given).
    fn pin_at_fault(
        &self,
        model: &tessera_planner::Model,
        cluster: &Cluster,
        options: SearchOptions,
        ok: impl Fn(&search::SearchResult) -> bool,
    ) -> Option<(&'static str, String)> {
        let pinned = self.pinned();
        let passes = |pins: &Pins| {
            search::search_checked(model, cluster, pins, options).is_ok_and(|r| ok(&r))
        };
        if let Some((flag, shown, _)) = pinned.iter().find(|(_, _, freed)| passes(freed)) {
            return Some((flag, shown.clone()));
        }
        let first = pinned.first()?;
        let all: Vec<&str> = pinned.iter().map(|(_, shown, _)| shown.as_str()).collect();
        passes(&Pins::default()).then(|| (first.0, format!("the pins {}", all.join(" "))))
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
        if let Some((pin, shown)) =
            args.pin_at_fault(&model, &cluster, options, |r| r.evaluated > 0)
        {
            return Err(cli_error(
                pin,
                format!(
                    "{shown} leaves no layout of {} devices that can be built for {} ({}); without it, {} devices can be planned",
                    cluster.devices,
                    model.name,
                    why.join("; "),
                    cluster.devices
                ),
                format!("drop {pin} (the search then chooses it), or pin a value the rules above allow"),
            ));
        }
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
        let fits = |r: &search::SearchResult| !r.fits.is_empty();
        if let Some((pin, shown)) = args.pin_at_fault(&model, &cluster, options, fits) {
            return Err(cli_error(
                pin,
                format!(
                    "{shown} leaves {} layouts of {} devices, and none fits in the devices' memory; without it, some do",
                    result.evaluated, cluster.devices
                ),
                format!("drop {pin} (the search then chooses it), or pin another value"),
            ));
        }
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
    let from = old.job.model.training.global_batch;
    if from != plan.job.model.training.global_batch {
        super::plan::batch::print_change(from, &plan.job.model);
    }
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
