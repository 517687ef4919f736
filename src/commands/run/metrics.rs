//! `tessera run`'s evaluation and reporting flags: `--eval-every N [--eval-tokens M]` and
//! `--plot FILE.svg`, the JSON line written per step, the progress bar's message and the
//! loss-curve picture. The validation pass itself is `tessera_runtime::exec::EvalSet`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use plotters::prelude::*;
use tessera_planner::plan::Plan;
use tessera_runtime::data::Tokens;
use tessera_runtime::exec::{EvalSet, StepMetrics};

#[derive(Args, Clone, Default)]
pub struct MetricsArgs {
    /// Compute the validation loss every N steps and after the last step, on fixed sequences
    /// of the validation data (--val-data, or the val shards of a prepared --data folder)
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    pub eval_every: Option<u64>,
    /// With --eval-every: validation tokens per evaluation, rounded down to whole global
    /// batches [default: 4 global batches, or as many whole ones as the validation data holds]
    #[arg(long, requires = "eval_every", value_parser = clap::value_parser!(u64).range(1..))]
    pub eval_tokens: Option<u64>,
    /// Write the loss curve (train and validation loss against tokens) as an SVG picture at
    /// the end of the run
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

impl MetricsArgs {
    /// The fixed eval sequences of the validation corpus `val` (its first whole windows, the
    /// same for every layout), or `None` without `--eval-every`. Refuses a run that asks for
    /// evaluation without validation data, or for more than the data holds.
    pub fn eval_set(&self, plan: &Plan, val: Option<&Tokens>) -> anyhow::Result<Option<EvalSet>> {
        let Some(every) = self.eval_every else {
            return Ok(None);
        };
        let Some(val) = val else {
            bail!(
                "--eval-every: there is no validation data\n  fix: pass --val-data FILE, or --data a folder prepared by `tessera data prepare --val-fraction F` (it holds val shards)"
            );
        };
        let t = &plan.job.model.training;
        let (seq, batch) = (t.seq_len, t.global_batch);
        let source = val.describe();
        // Whole windows of seq + 1 tokens the validation data holds, in whole global batches.
        let windows = val.eval_windows(seq as usize) as u64;
        let batches_held = windows / batch;
        if batches_held == 0 {
            bail!(
                "{source}: the validation data holds {windows} whole windows of seq_len {seq} + 1 tokens; one eval batch is the plan's global batch of {batch} sequences ({} tokens)\n  fix: pass a longer --val-data, or prepare a larger val split (--val-fraction)",
                batch * (seq + 1)
            );
        }
        let batches = match self.eval_tokens {
            None => batches_held.min(4),
            Some(m) => {
                let want = m / (batch * seq);
                if want == 0 {
                    bail!(
                        "--eval-tokens {m}: less than one global batch ({} tokens: {batch} sequences of {seq})\n  fix: pass --eval-tokens {} or more",
                        batch * seq,
                        batch * seq
                    );
                }
                if want > batches_held {
                    bail!(
                        "--eval-tokens {m}: {source} holds {batches_held} global batches of validation sequences ({} tokens), not {want}\n  fix: pass --eval-tokens {} or less, or more validation data",
                        batches_held * batch * seq,
                        batches_held * batch * seq
                    );
                }
                want
            }
        };
        let (inputs, targets) = val.eval_sequences(seq as usize, (batches * batch) as usize);
        Ok(Some(EvalSet {
            every: every as usize,
            inputs,
            targets,
            source,
        }))
    }
}

/// The JSON line of one step: `step`, `loss`, `step_time_s`, `tokens_per_s`, `tokens_seen`,
/// and `val_loss` at the steps that evaluate.
pub fn json_line(m: &StepMetrics) -> serde_json::Value {
    let mut line = serde_json::json!({
        "step": m.step,
        "loss": m.loss,
        "step_time_s": m.step_time_s,
        "tokens_per_s": m.tokens_per_s,
        "tokens_seen": m.tokens_seen,
        "lr": m.lr,
        "grad_norm": m.grad_norm,
    });
    if let Some(v) = m.val_loss {
        line["val_loss"] = v.into();
    }
    line
}

/// The progress bar's message after a step: loss, the latest validation loss, tokens/s.
pub fn progress(m: &StepMetrics, last_val: Option<f64>) -> String {
    match last_val {
        Some(v) => format!(
            "loss {:.4}  val {:.4}  {:.0} tokens/s",
            m.loss, v, m.tokens_per_s
        ),
        None => format!("loss {:.4}  {:.0} tokens/s", m.loss, m.tokens_per_s),
    }
}

/// The loss curve as an SVG document: train loss per step and validation loss at the steps
/// that evaluated, against training tokens seen.
pub fn loss_svg(title: &str, steps: &[StepMetrics]) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 540)).into_drawing_area();
        draw(&root, title, steps).map_err(|e| anyhow::anyhow!("{e}"))?;
        root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(svg)
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    steps: &[StepMetrics],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let train: Vec<(f64, f64)> = steps
        .iter()
        .map(|m| (m.tokens_seen as f64, m.loss))
        .collect();
    let val: Vec<(f64, f64)> = steps
        .iter()
        .filter_map(|m| m.val_loss.map(|v| (m.tokens_seen as f64, v)))
        .collect();
    let all = || train.iter().chain(&val);
    let x_max = all().map(|p| p.0).fold(1.0, f64::max);
    let (lo, hi) = all().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    let (lo, hi) = if lo.is_finite() {
        let pad = ((hi - lo) * 0.05).max(1e-3);
        (lo - pad, hi + pad)
    } else {
        (0.0, 1.0)
    };
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, lo..hi)?;
    chart
        .configure_mesh()
        .x_desc("training tokens")
        .y_desc("cross-entropy loss")
        .draw()?;
    chart
        .draw_series(LineSeries::new(train, &BLUE))?
        .label("train")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    if !val.is_empty() {
        chart
            .draw_series(LineSeries::new(val.clone(), &RED))?
            .label("validation")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
        chart.draw_series(val.into_iter().map(|p| Circle::new(p, 3, RED.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE)
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// Writes the loss curve to `path` (atomically, as every output).
pub fn write_plot(path: &Path, title: &str, steps: &[StepMetrics]) -> anyhow::Result<()> {
    let svg = loss_svg(title, steps).context("--plot: drawing the loss curve")?;
    crate::files::write_output(path, svg.as_bytes())
}

/// How far measured memory may stray from the prediction before the report says so.
const MEMORY_TOLERANCE: f64 = 0.10;

/// The end-of-run memory table: each rank's measured peak during the training steps against
/// the plan's per-device prediction, with a line naming the ranks more than 10% off.
pub fn memory_report(plan: &Plan, peak_bytes: &[u64], on_gpus: bool, gpus_per_node: u64) {
    let p = &plan.parallel;
    let mib = |b: f64| format!("{:.1}", b / (1024.0 * 1024.0));
    let mut mem = crate::output::table(
        &[
            "rank",
            "stage",
            "measured MiB",
            "predicted MiB",
            "measured/predicted",
        ],
        &[0, 1, 2, 3, 4],
    );
    let mesh = tessera_planner::Mesh::with_cp(p.dp, p.cp, p.pp, p.tp, gpus_per_node);
    let mut off = Vec::new();
    for (r, &bytes) in peak_bytes.iter().enumerate() {
        let stage = mesh.coord(r as u64).pp as usize;
        let predicted = plan.predicted.memory.per_stage.get(stage);
        let ratio = match (on_gpus, predicted) {
            (false, Some(s)) if s.total_bytes > 0 && bytes > 0 => {
                Some(bytes as f64 / s.total_bytes as f64)
            }
            _ => None,
        };
        if let Some(x) = ratio.filter(|x| (x - 1.0).abs() > MEMORY_TOLERANCE) {
            off.push((r, x));
        }
        mem.add_row(vec![
            r.to_string(),
            stage.to_string(),
            if on_gpus {
                "-".into()
            } else {
                mib(bytes as f64)
            },
            predicted.map_or("-".into(), |s| mib(s.total_bytes as f64)),
            ratio.map_or("-".into(), |x| format!("{x:.2}")),
        ]);
    }
    println!("{mem}");
    println!(
        "measured: {}; predicted: the plan's per-device total under the \"{}\" precision policy",
        if on_gpus {
            "not tracked on GPUs yet"
        } else {
            "peak bytes each rank's thread held during the training steps (setup and the final download left out)"
        },
        plan.job.model.training.precision
    );
    if let (Some(worst), false) = (
        off.iter()
            .max_by(|a, b| (a.1 - 1.0).abs().total_cmp(&(b.1 - 1.0).abs())),
        on_gpus,
    ) {
        println!(
            "memory: {} of {} ranks differ from the prediction by more than {:.0}% (worst: rank {} at {:.2}× predicted); docs/performance.md (\"CPU memory\") lists what the model leaves out",
            off.len(),
            peak_bytes.len(),
            MEMORY_TOLERANCE * 100.0,
            worst.0,
            worst.1
        );
    } else if !on_gpus && !peak_bytes.is_empty() {
        println!(
            "memory: every rank within {:.0}% of the prediction",
            MEMORY_TOLERANCE * 100.0
        );
    }
}
