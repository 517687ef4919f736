//! `tessera validate FILE...`: check model specs, cluster specs and plans.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use tessera_planner::plan::Plan;
use tessera_planner::source::Source;
use tessera_planner::spec::{self, ClusterOverrides, TrainingOverrides};

#[derive(Args)]
pub struct ValidateArgs {
    /// Files to check: model specs (.toml or Hugging Face .json), cluster specs, plans.
    #[arg(required = true)]
    files: Vec<PathBuf>,
}

pub fn run(args: ValidateArgs) -> anyhow::Result<ExitCode> {
    let mut failed = 0;
    for path in &args.files {
        match check(path) {
            Ok(what) => println!("ok  {}: {what}", path.display()),
            Err(e) => {
                failed += 1;
                eprintln!("error: {e:#}");
            }
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}

fn check(path: &Path) -> anyhow::Result<String> {
    let src = Source::read(path)?;
    let is_json = path.extension().is_some_and(|e| e == "json");
    if is_json && src.text.contains("\"format\"") {
        let plan = Plan::parse(&src)?;
        super::run::check_runnable(&plan, path)?;
        let p = &plan.parallel;
        return Ok(format!(
            "plan of {} on {} devices (dp {} × tp {} × pp {}){}",
            plan.job.model.name,
            p.world,
            p.dp,
            p.tp,
            p.pp,
            if plan.feasible {
                ""
            } else {
                ", marked infeasible"
            }
        ));
    }
    let is_cluster =
        !is_json && (src.text.contains("[device]") || src.text.contains("gpus_per_node"));
    if is_cluster {
        let c = spec::parse_cluster_toml(&src, ClusterOverrides::default())?;
        return Ok(format!(
            "cluster {}: {} × {} {}",
            c.name, c.nodes, c.gpus_per_node, c.device.name
        ));
    }
    // A Hugging Face config has no training settings; validate its architecture with placeholders.
    let over = if is_json {
        TrainingOverrides {
            seq_len: Some(1),
            global_batch: Some(1),
            ..Default::default()
        }
    } else {
        TrainingOverrides::default()
    };
    // Read and checked the way `plan` loads it; an MoE model also gets its active count.
    let m = spec::read_model(path, over)?;
    let a = &m.architecture;
    let mut what = format!("model {}: {} parameters", m.name, a.param_count());
    if a.moe.is_some() {
        what += &format!(", {} active per token", a.active_param_count());
    }
    // A LoRA or QLoRA spec: the counts as PEFT's `print_trainable_parameters` gives them.
    if let Some(l) = m.adapters() {
        let c = tessera_planner::finetune::counts(a, m.training.method, Some(l));
        let all = c.trainable + c.frozen;
        what += &format!(
            "; {} rank {} on {} ({}): trainable params: {} || all params: {} || trainable%: {:.4} ({} frozen)",
            m.training.method.name(),
            l.rank,
            l.targets.iter().map(|t| t.name()).collect::<Vec<_>>().join(","),
            l.peft_modules(a).unwrap_or_default().join(","),
            c.trainable,
            all,
            100.0 * c.trainable as f64 / all as f64,
            c.frozen
        );
    }
    if let Err(p) = m.plannable() {
        what += &format!(" (`plan` refuses it at `{}`)", p.field);
    }
    Ok(what)
}
