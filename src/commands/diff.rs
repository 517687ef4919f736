//! `tessera diff plan-a.json plan-b.json`: what changed between two plans (every key of the job
//! and the layout, stage splits, memory per term, predicted time per term;
//! `tessera_planner::plan::diff` says what is left out and why). Exit 0 when they are the same,
//! 1 when they differ, 2 when a plan cannot be read: the convention of diff(1), so CI can gate
//! on it. A key absent from one plan (an older plan's) shows as `-`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use tessera_planner::plan::diff::{diff, Change, NumChange, PlanDiff};
use tessera_planner::plan::Plan;
use tessera_planner::units;

use crate::output::table;

#[derive(Args)]
pub struct DiffArgs {
    /// The plan before.
    a: PathBuf,
    /// The plan after.
    b: PathBuf,
}

fn changes(title: &str, rows: &[Change]) {
    if rows.is_empty() {
        return;
    }
    let mut t = table(&[title, "a", "b"], &[]);
    for c in rows {
        t.add_row(vec![c.what.clone(), c.a.clone(), c.b.clone()]);
    }
    println!("{t}\n");
}

fn numbers(title: &str, rows: &[NumChange], show: impl Fn(f64) -> String) {
    if rows.is_empty() {
        return;
    }
    let mut t = table(&[title, "a", "b", "change"], &[1, 2, 3]);
    for c in rows {
        let change = match c.relative() {
            Some(r) => format!("{:+.1}%", 100.0 * r),
            None => "new".into(),
        };
        t.add_row(vec![c.what.clone(), show(c.a), show(c.b), change]);
    }
    println!("{t}\n");
}

pub fn run(args: DiffArgs) -> anyhow::Result<ExitCode> {
    let a = Plan::load(&args.a)?;
    let b = Plan::load(&args.b)?;
    let d = diff(&a, &b);
    if d.is_empty() {
        println!(
            "{} and {}: no differences in job, layout, stages, memory or predicted time",
            args.a.display(),
            args.b.display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!("a: {}\nb: {}\n", args.a.display(), args.b.display());
    print(&d);
    Ok(ExitCode::from(1))
}

/// The changes of `d`, table by table (`tessera replan` prints them too).
pub(crate) fn print(d: &PlanDiff) {
    changes("job", &d.job);
    changes("layout", &d.layout);
    changes("stage split", &d.stages);
    numbers("memory per device", &d.memory, units::bytes);
    numbers("predicted per step", &d.time, |v| {
        if v.abs() >= 1000.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.4}")
        }
    });
}
