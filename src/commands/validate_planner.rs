//! `tessera validate-planner` (hidden): replay the published runs of
//! ../shared/groundtruth/runs.toml through the planner and write docs/validation.md.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use tessera_planner::spec::{self, ClusterOverrides};
use tessera_planner::validation::{self, report};

use crate::files::{check_outputs, named, write_output};
use crate::output::table;

#[derive(Args)]
pub struct ValidatePlannerArgs {
    /// The published runs (groundtruth/runs.toml).
    #[arg(long, default_value = "../shared/groundtruth/runs.toml")]
    runs: PathBuf,
    /// Where the cluster presets are.
    #[arg(long, default_value = "specs/clusters")]
    clusters: PathBuf,
    /// The Markdown report to write.
    #[arg(short, long, default_value = "docs/validation.md")]
    output: PathBuf,
    /// Instead: fit the A100 preset's calibration to the runs (all sources, then leaving each
    /// source out) and write the constants to docs/calibration.md (the presets are not edited).
    #[arg(long)]
    fit: bool,
    /// Where `--fit` writes its report.
    #[arg(long, default_value = "docs/calibration.md")]
    calibration_output: PathBuf,
}

pub fn run(args: ValidatePlannerArgs) -> anyhow::Result<ExitCode> {
    let a100_path = args.clusters.join("dgx-a100-80g.toml");
    let h100_path = args.clusters.join("dgx-h100-80g.toml");
    let output = if args.fit {
        named("--calibration-output", &args.calibration_output)
    } else {
        named("--output", &args.output)
    };
    check_outputs(
        &[
            named("--runs", &args.runs),
            named("--clusters", &a100_path),
            named("--clusters", &h100_path),
        ],
        &[output],
    )?;
    let text = std::fs::read_to_string(&args.runs)
        .with_context(|| format!("{}: cannot read the published runs", args.runs.display()))?;
    let preset =
        |name: &str| spec::load_cluster(&args.clusters.join(name), ClusterOverrides::default());
    let a100 = preset("dgx-a100-80g.toml")?;
    let h100 = preset("dgx-h100-80g.toml")?;
    if args.fit {
        return fit(&text, &a100, &h100, &args.calibration_output)
            .with_context(|| format!("{}", args.runs.display()));
    }
    let (v, md) = validation::document(&text, &a100, &h100)
        .with_context(|| format!("{}", args.runs.display()))?;
    let mut t = table(&["run", "measured s", "predicted s", "error"], &[1, 2, 3]);
    for r in &v.scored {
        t.add_row(vec![
            r.id.clone(),
            format!("{:.3}", r.measured_s),
            format!("{:.3}", r.predicted_s),
            format!("{:+.1}%", 100.0 * r.error),
        ]);
    }
    println!("{t}\n");
    let median = v.median_abs_error();
    let worst = v.worst().map_or(0.0, |w| w.error.abs());
    println!(
        "{} runs: median |error| {:.1}% (target ≤ {:.0}%), worst {:.1}% (target ≤ {:.0}%); {} unscored, {} not replayed",
        v.scored.len(),
        100.0 * median,
        100.0 * report::TARGET_MEDIAN,
        100.0 * worst,
        100.0 * report::TARGET_WORST,
        v.unscored.len(),
        v.skipped.len()
    );
    write_output(&args.output, md.as_bytes())?;
    println!("wrote {}", args.output.display());
    Ok(ExitCode::SUCCESS)
}

fn fit(
    text: &str,
    a100: &tessera_planner::Cluster,
    h100: &tessera_planner::Cluster,
    output: &std::path::Path,
) -> anyhow::Result<ExitCode> {
    let start = validation::fit::kernel_start(&a100.calibration);
    let (all, held) = validation::fit::fit_all(text, a100, h100, &start)?;
    let md = validation::fit::markdown(
        &start,
        &all,
        &held,
        "cargo run --release -- validate-planner --fit",
    );
    print!("{md}");
    write_output(output, md.as_bytes())?;
    println!("\nwrote {}", output.display());
    Ok(ExitCode::SUCCESS)
}
