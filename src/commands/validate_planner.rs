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
    /// Where the cluster presets are (A100 and H100; H800 and H200 presets there serve runs on
    /// those GPUs).
    #[arg(long, default_value = "specs/clusters")]
    clusters: PathBuf,
    /// Where the model presets are, for runs that name one (`model.preset = "llama3-8b"`).
    #[arg(long, default_value = "specs/models")]
    models: PathBuf,
    /// The published runs that offloaded (their section of the report).
    #[arg(long, default_value = "docs/offload-validation/runs.toml")]
    offload_runs: PathBuf,
    /// The published FP8 runs (their section of the report).
    #[arg(long, default_value = "docs/fp8-validation/runs.toml")]
    fp8_runs: PathBuf,
    /// The published H100 16-bit runs (their section of the report).
    #[arg(long, default_value = "docs/h100-validation/runs.toml")]
    h100_runs: PathBuf,
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
    let others = other_gpus(&args.clusters)?;
    let models = model_texts(&args.models)?;
    let presets = validation::Presets {
        a100: &a100,
        h100: &h100,
        others: &others,
        models: &models,
    };
    let (v, mut md) = validation::document_with(&text, &presets)
        .with_context(|| format!("{}", args.runs.display()))?;
    // A further file of published runs, read and replayed into its own section.
    type Section = fn(&str, &validation::Presets) -> Result<String, validation::ValidationError>;
    let section = |path: &PathBuf, what: &str, make: Section| -> anyhow::Result<String> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!("{}: cannot read the published {what} runs", path.display())
        })?;
        make(&text, &presets).with_context(|| format!("{}", path.display()))
    };
    md += &section(&args.offload_runs, "offload", validation::offload::section)?;
    md += &validation::whole_run::section_from_presets(&a100, &h100, &args.models, &args.clusters)?;
    md += &validation::schedules::section(&a100);
    md += &section(&args.h100_runs, "H100 16-bit", validation::h100::section)?;
    md += &section(&args.fp8_runs, "FP8", validation::fp8::section)?;
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

/// The cluster presets of GPUs other than the A100 80GB and H100 that runs may name (H800, H200,
/// the A100 40GB part, whose memory and bandwidth differ from the 80GB one's, and the 500 W
/// H100 of torchtitan's hosts).
fn other_gpus(dir: &std::path::Path) -> anyhow::Result<Vec<tessera_planner::Cluster>> {
    let mut out = Vec::new();
    for path in toml_files(dir)? {
        let c = spec::load_cluster(&path, ClusterOverrides::default())?;
        if [
            "H800",
            "H200",
            "A100-SXM4-40GB",
            "H100-SXM5-96GB-HBM2e-500W",
        ]
        .iter()
        .any(|g| c.device.name.contains(g))
        {
            out.push(c);
        }
    }
    Ok(out)
}

/// `(name, text)` of every model preset (the planner crate reads no files).
fn model_texts(dir: &std::path::Path) -> anyhow::Result<Vec<(String, String)>> {
    toml_files(dir)?
        .into_iter()
        .map(|p| {
            let name = p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let text = std::fs::read_to_string(&p)
                .with_context(|| format!("{}: cannot read the model preset", p.display()))?;
            Ok((name, text))
        })
        .collect()
}

/// The `*.toml` files of `dir`, sorted (none if it does not exist).
fn toml_files(dir: &std::path::Path) -> anyhow::Result<Vec<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(Vec::new());
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    out.sort();
    Ok(out)
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
